"""`attnid diff`: gauges certified, known-broken transforms caught and localised (layer and
checkpoint tensor), a genuinely fine-tuned checkpoint not certified, bad input refused, inputs
never modified. The catalogue of users' rewrites is `test_diff_catalogue.py`."""

from __future__ import annotations

import json

import pytest
import torch

from attnid.checkpoint.diff import compare_layers, tolerance
from attnid.checkpoint.load import open_checkpoint
from attnid.cli import main
from attnid.symmetry.gauge import Gauge, apply_gauge, random_gauge
from attnid.weights import AttentionWeights

TOL32 = tolerance(torch.float32)


def _diff(capsys, a, b) -> tuple[int, dict | None, str]:
    capsys.readouterr()  # what came before (transformers' warnings when a fixture saved a model)
    code = main(["diff", str(a), str(b), "--json"])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


def _gauged(i: int, w: AttentionWeights) -> AttentionWeights:
    return apply_gauge(w, random_gauge(w, seed=i, scale=0.5))


def test_random_gauge_of_real_minilm_is_certified(minilm, tmp_path, capsys, variant, digest):
    before = digest(minilm)
    b = variant(minilm, tmp_path / "gauged", _gauged)
    code, r, err = _diff(capsys, minilm, b)
    assert code == 0, (err, r and r["break"])
    assert digest(minilm) == before, "the input checkpoint was modified"
    assert r["certified"] and r["break"] is None and len(r["layers"]) == 6
    assert any("commutant" in c for c in r["covers"]) and any("every other tensor" in c for c in r["covers"])
    assert any("post-LN" in c for c in r["covers"]) and r["rotation"].startswith("post-LN")
    for row in r["layers"]:
        assert row["residual"] < TOL32, row
        assert row["raw_distance"] > 10.0 and row["gauge_share"] > 0.9999, row
        assert set(row) >= {"raw_distance", "aligned_distance", "gauge_share", "rotation_share",
                            "permutation_share", "worst_tensor", "worst_invariant", "residual"}


def test_rebalanced_canonical_minilm_is_certified(minilm, minilm_canonical, capsys):
    code, r, err = _diff(capsys, minilm, minilm_canonical)
    assert code == 0, (err, r and r["break"])
    assert max(row["residual"] for row in r["layers"]) < TOL32
    assert min(row["gauge_share"] for row in r["layers"]) > 0.9999


# ---- the four known-broken transforms ------------------------------------------------------
def test_value_bias_left_unrotated_is_caught(minilm, tmp_path, capsys, variant):
    """A VO rotation applied to W_V and W_O but not to b_V (real MiniLM, layer 3 only)."""
    def broken(i: int, w: AttentionWeights) -> AttentionWeights:
        g = random_gauge(w, seed=i)
        right = apply_gauge(w, Gauge(qk=g.qk, vo=g.vo))
        return right.replace(b_V=w.b_V) if i == 3 else right

    code, r, _ = _diff(capsys, minilm, variant(minilm, tmp_path / "bv", broken))
    assert code == 1 and not r["certified"]
    assert r["break"]["layer"] == 3 and r["break"]["invariant"] == "b_O+b_V·W_O", r["break"]
    assert r["break"]["tensor"] == "encoder.layer.3.attention.self.value.bias", r["break"]
    assert r["break"]["residual"] > 1e3 * TOL32
    assert all(row["residual"] < TOL32 for row in r["layers"] if row["layer"] != 3)


def _rotate_residual(t: dict[str, torch.Tensor], R: torch.Tensor, twice_tied: bool) -> None:
    """QuaRot-style rotation of a Llama's residual stream by an orthogonal ``R`` (gains are 1):
    inputs ``W -> W R``, outputs ``W -> R^T W``, embeddings (= the tied head) ``E -> E R``. The
    bug rotates the tied head again, i.e. the one shared tensor twice."""
    for n in list(t):
        x = t[n].double()
        if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                       "up_proj.weight")):
            t[n] = (x @ R).float()
        elif n.endswith(("o_proj.weight", "down_proj.weight")):
            t[n] = (R.T @ x).float()
        elif n.endswith("o_proj.bias"):
            t[n] = (x @ R).float()
        elif n.endswith("embed_tokens.weight"):
            t[n] = (x @ R @ R if twice_tied else x @ R).float()


def test_residual_rotation_twice_through_tied_embeddings_is_caught(tmp_path, capsys, variant,
                                                                   random_checkpoint, small):
    import transformers

    src = random_checkpoint(small["llama"], tmp_path, "llama")
    gen = torch.Generator().manual_seed(3)
    R = torch.linalg.qr(torch.randn(32, 32, dtype=torch.float64, generator=gen))[0]
    right = variant(src, tmp_path / "right", other_fn=lambda t: _rotate_residual(t, R, False))
    wrong = variant(src, tmp_path / "wrong", other_fn=lambda t: _rotate_residual(t, R, True))
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = {}
    for name, d in (("src", src), ("right", right), ("wrong", wrong)):
        m = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
        with torch.no_grad():
            logits[name] = m(input_ids=ids).logits.double()
    rel = lambda x: float((x - logits["src"]).norm() / logits["src"].norm())  # noqa: E731
    assert rel(logits["right"]) < 1e-5 and rel(logits["wrong"]) > 1e-2  # the bug is real
    code, r, _ = _diff(capsys, right, wrong)
    assert code == 1 and r["break"]["layer"] is None and r["break"]["tensor"] == "model.embed_tokens.weight"
    assert all(row["residual"] < TOL32 for row in r["layers"]), "every layer agrees with the rotation"
    # the right rotation is a symmetry (the final gain is uniform): certified
    code, r, _ = _diff(capsys, src, right)
    assert code == 0 and r["rotation"].startswith("fitted"), r["break"]


def _gated(w: AttentionWeights, W_G: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A test-local gated attention: each head's output times ``sigmoid(x W_G^h)`` elementwise."""
    q = x @ w.W_Q + w.b_Q[:, None]  # [H, T, dk]
    k = x @ w.W_K + w.b_K[:, None]
    v = x @ w.W_V + w.b_V[:, None]
    a = torch.softmax(q @ k.mT / w.spec.head_dim**0.5, dim=-1) @ v  # [H, T, dv]
    return ((a * torch.sigmoid(x @ W_G)) @ w.W_O).sum(0) + w.b_O


@pytest.mark.parametrize("change", ["rotation", "scaling"])
def test_head_rotation_through_an_output_gate_is_caught(minilm, change):
    w = open_checkpoint(minilm).layer(2)
    s = w.spec
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, s.d_model, dtype=torch.float64, generator=gen)
    trained_gate = 0.2 * torch.randn(s.n_heads, s.d_model, s.v_head_dim, dtype=torch.float64, generator=gen)
    init_gate = torch.zeros_like(trained_gate)  # sigmoid(0): a constant gate at initialisation
    if change == "rotation":
        C = torch.eye(s.v_head_dim, dtype=torch.float64) + 0.3 * torch.randn(
            s.n_kv_heads, s.v_head_dim, s.v_head_dim, dtype=torch.float64, generator=gen)
    else:
        C = torch.diag_embed(torch.exp(0.5 * torch.randn(s.n_kv_heads, s.v_head_dim, generator=gen,
                                                          dtype=torch.float64)))
    b = apply_gauge(w, Gauge(vo=C))
    change_at = {name: float((_gated(b, g, x) - _gated(w, g, x)).norm() / _gated(w, g, x).norm())
                 for name, g in (("init", init_gate), ("trained", trained_gate))}
    assert change_at["init"] < 1e-12, change_at  # looks fine on freshly initialised weights
    d = compare_layers(w, b, vo_gauge="diagonal")
    if change == "rotation":
        assert change_at["trained"] > 1e-2, change_at
        assert d.worst_tensor == "W_V·W_O" and d.residual > 1e-2, d
        assert compare_layers(w, b).residual < 1e-12  # without the gate it is a symmetry
    else:
        assert change_at["trained"] < 1e-12 and d.residual < 1e-12, (change_at, d)


def _llama_gl(i: int, w: AttentionWeights, commutant: bool) -> AttentionWeights:
    if commutant:
        return apply_gauge(w, random_gauge(w, seed=i))
    s = w.spec
    gen = torch.Generator().manual_seed(i)
    M = torch.eye(s.head_dim, dtype=torch.float64) + 0.3 * torch.randn(
        s.n_kv_heads, s.head_dim, s.head_dim, dtype=torch.float64, generator=gen)
    return apply_gauge(w, Gauge(qk=M)) if i == 1 else w


@pytest.mark.parametrize("commutant", [True, False], ids=["commutant", "full-GL"])
def test_full_gl_rotation_of_qk_under_rope_is_caught(tmp_path, capsys, variant, random_checkpoint, small,
                                                     commutant):
    import transformers

    def sharpen(t: dict[str, torch.Tensor]) -> None:  # trained-like scores: attention far from uniform
        for n in t:
            if n.endswith(("q_proj.weight", "k_proj.weight")):
                t[n] = t[n] * 30.0

    src = variant(random_checkpoint(small["llama"], tmp_path, "llama"), tmp_path / "src", other_fn=sharpen)
    b = variant(src, tmp_path / "b", lambda i, w: _llama_gl(i, w, commutant))
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    out = []
    for d in (src, b):
        with torch.no_grad():
            out.append(transformers.AutoModelForCausalLM.from_pretrained(d).eval()(input_ids=ids).logits)
    moved = float((out[1] - out[0]).norm() / out[0].norm())
    code, r, _ = _diff(capsys, src, b)
    if commutant:
        assert moved < 1e-5 and code == 0, (moved, r["break"])
    else:
        assert moved > 1e-4, moved  # the transform really breaks the function (float32 noise ~1e-6)
        assert code == 1 and r["break"]["layer"] == 1 and r["break"]["invariant"] == "W_Q·W_K", r["break"]
        assert r["break"]["tensor"] == "model.layers.1.self_attn.q_proj.weight", r["break"]


def test_probes_report_their_bound(tmp_path, capsys, variant, random_checkpoint, small):
    """``--probes K``: the verdicts of the exact diff (a gauge certified, a nudged value
    projection caught there), ``probes`` K and ``probe_bound`` the derived bound (docs/theory.md
    §13.19), decreasing with the size of the break; exact: both null."""
    from attnid.whole.fit.frame import accept_bound

    src = random_checkpoint(small["llama"], tmp_path, "llama")
    b = variant(src, tmp_path / "b", _gauged)

    def nudge(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.1.self_attn.v_proj.weight"] = t["model.layers.1.self_attn.v_proj.weight"] * 1.1

    bad = variant(src, tmp_path / "bad", other_fn=nudge)
    code, r, err = _diff(capsys, src, b)
    assert code == 0 and r["probes"] is None and r["probe_bound"] is None, (err, r and r["break"])
    capsys.readouterr()
    assert main(["diff", str(src), str(b), "--json", "--probes", "6"]) == 0
    r = json.loads(capsys.readouterr().out)
    bound = r["probe_bound"]
    assert r["probes"] == 6 and bound == {f"break_{c}x": accept_bound(6, c) for c in (2, 4, 8)}, r
    assert 1 >= bound["break_2x"] > bound["break_4x"] > bound["break_8x"] > 0, bound
    assert main(["diff", str(src), str(bad), "--json", "--probes", "6"]) == 1
    r = json.loads(capsys.readouterr().out)
    assert r["break"]["tensor"].startswith("model.layers.1.self_attn."), r["break"]


# ---- a genuinely fine-tuned checkpoint ---------------------------------------------------------
def test_fine_tuned_minilm_is_not_certified(minilm, tmp_path, capsys, variant):
    from attnid.paper.contrastive import batches, contrastive_loss, embed, line_pairs, load_encoder

    torch.manual_seed(0)
    model, tok = load_encoder(minilm)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for a, b in batches(line_pairs().train, 8, 2):
        loss = contrastive_loss(embed(model, tok, a), embed(model, tok, b))
        opt.zero_grad()
        loss.backward()
        opt.step()
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    tuned = variant(minilm, tmp_path / "tuned", other_fn=lambda t: t.update(
        {k: state[k] for k in t if k in state}))
    code, r, _ = _diff(capsys, minilm, tuned)
    assert code == 1 and r["break"] is not None  # the first place is the embeddings
    shares = [row["gauge_share"] for row in r["layers"]]
    assert all(0.0 <= s <= 1.0 for s in shares) and max(shares) > 0.0, shares
    assert all(row["residual"] > 10 * TOL32 for row in r["layers"])


# ---- bad input --------------------------------------------------------------------------------
def test_bad_input_is_one_error_line(minilm, tmp_path, capsys, random_checkpoint, small):
    other = random_checkpoint(small["gpt2"], tmp_path, "gpt2")
    for b, message in ((tmp_path / "missing", "does not exist"), (other, "not the same architecture")):
        code, _, err = _diff(capsys, minilm, b)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], err


# ---- every family canonicalize supports ---------------------------------------------------------
def _families() -> list[str]:
    from attnid.adapters.config import bundled, load_config
    from attnid.adapters.registry import adapter_for

    out: dict[str, str] = {}
    for name in bundled():
        try:
            a = adapter_for(load_config(name)[1])
        except Exception:  # a bundled config this transformers cannot serve
            continue
        if a.closed_form:
            out.setdefault(a.family, name)
    return sorted(out.values())


@pytest.mark.parametrize("name", _families())
def test_random_gauge_certified_and_a_nudge_caught_in_every_family(name, tmp_path, capsys, variant,
                                                                    random_checkpoint):
    from attnid.adapters.config import load_config
    from attnid.adapters.registry import adapter_for

    config = load_config(name)[1]
    small = dict(adapter_for(config).reduce(config), num_hidden_layers=2)
    for k in ("n_layer", "num_layers"):
        small.pop(k, None)
    src = random_checkpoint(small, tmp_path, "m")
    code, r, _ = _diff(capsys, src, variant(src, tmp_path / "g", _gauged))
    assert code == 0, r["break"]

    def nudge(i: int, w: AttentionWeights) -> AttentionWeights:
        return w.replace(W_K=w.W_K * 1.01) if i == 1 else w

    code, r, _ = _diff(capsys, src, variant(src, tmp_path / "n", nudge))
    assert code == 1 and r["break"]["layer"] == 1, r["break"]
