"""`attnid rewrite --optimize`: the written rewrite is certified by `attnid diff` and computes
the same logits as the input (float64 models to ~1e-10, a tied float32 one to float32
rounding); the objective's references are the same under every group element, its errors
under the scalings RTN commutes with (the pairwise, scale-aware form) and under neuron
permutations; no part raises the objective; bad input is one `error:` line, exit 2, nothing
written."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from attnid.checkpoint.optimize import optimize
from attnid.cli import main
from attnid.quantize import parse_scheme
from attnid.quantize.objective import KINDS, LayerCalibration, layer_terms, objective_value
from attnid.testing.files import assert_one_error, fingerprint
from attnid.whole.transforms import ModelTensors, apply_element, mlp_scaling, neuron_permutation
from attnid.whole.transforms.element import GroupElement, LayerElement
from attnid.whole.transforms.orthogonal import random_commutant, random_orthogonal

from .test_align import LLAMA, TEXT, build, char_tokenizer

BIASED = dict(LLAMA, attention_bias=True, mlp_bias=True)  # every linear layer with a bias
# (config, dtype, parts): float64 without r1 (transformers' RMSNorm computes its statistics
# in float32, so a rotated float64 model agrees only to ~1e-9); every part in float32
MODELS = {"llama-gqa-f64": (LLAMA, torch.float64, "norm,vo,qk,mlp"),
          "llama-biases-f64": (BIASED, torch.float64, "norm,vo,qk,mlp"),
          "llama-gqa": (LLAMA, torch.float32, None),
          "tied": (dict(LLAMA, tie_word_embeddings=True), torch.float32, None)}
LIMIT = {torch.float64: 1e-10, torch.float32: 1e-5}


def save(config: dict, root: Path, name: str, dtype: torch.dtype) -> Path:
    d = root / name
    model = build(config, 0).to(dtype)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(d)
    char_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("calib") / "text.txt"
    p.write_text(TEXT)
    return p


def logits(d: Path, dtype: torch.dtype) -> torch.Tensor:
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype).eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return torch.log_softmax(m(input_ids=ids).logits.double(), -1)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_written_rewrite_is_certified_and_keeps_the_logits(name, tmp_path, text, capsys):
    config, dtype, parts = MODELS[name]
    src = save(config, tmp_path, name, dtype)
    before = fingerprint(src)
    capsys.readouterr()
    code = main(["rewrite", str(src), str(tmp_path / "out"), "--optimize", "w3", "--calibration", str(text),
                 "--json", *(["--optimize-parts", parts] if parts else [])])
    out, err = capsys.readouterr()
    assert code == 0, err
    r = json.loads(out)
    assert fingerprint(src) == before, "the input was modified"
    assert r["certified"] and r["max_residual"] <= r["tolerance"], r
    assert r["untied"] == ("lm_head.weight" if config.get("tie_word_embeddings") and not parts else None)
    a, b = logits(src, dtype), logits(tmp_path / "out", dtype)
    err_rel = float((a - b).norm() / a.norm())
    assert err_rel < LIMIT[dtype], f"the rewrite changed the log-probabilities by {err_rel:.2e}"
    found, start = r["objective"]["found"], r["objective"].get("folded", r["objective"]["input"])
    assert found < start, f"the search did not lower the objective ({start:.4f} -> {found:.4f})"
    assert set(r["parts_objective"]) == set((parts or "r1,norm,vo,qk,mlp").split(","))


@pytest.mark.parametrize("parts", ["r1", "norm", "vo", "qk", "mlp", "awq"])
def test_no_part_raises_the_objective(parts, tmp_path, text):
    src = save(LLAMA, tmp_path, "m", torch.float32)
    r = optimize(src, tmp_path / "out", "w3", text, parts=parts)
    assert r["certified"]
    for name, step in r["parts_objective"].items():
        b, a = step["before"], step["after"]
        assert a <= b * (1 + 1e-12), f"{name}: {b:.6f} -> {a:.6f}"
    start = r["objective"].get("folded", r["objective"]["input"])
    assert r["objective"]["found"] <= start, r["objective"]
    if parts in ("norm", "awq", "mlp"):  # the diagonal balances find something on a random model
        assert r["objective"]["found"] < 0.99 * start, r["objective"]


# ---- the objective's invariances ---------------------------------------------------------
def _model_and_calibration():
    model = build(LLAMA, 3)  # float64
    m = ModelTensors.of(model)
    gen = torch.Generator().manual_seed(0)
    c, T, d, H = 2, 16, 32, 4
    probs = torch.softmax(torch.randn(c, H, T, T, generator=gen, dtype=torch.float64)
                          .masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")), -1)
    calib = [LayerCalibration(torch.randn(c, T, d, generator=gen, dtype=torch.float64),
                              torch.randn(c, T, d, generator=gen, dtype=torch.float64), probs)
             for _ in range(2)]
    return model, m, calib


def _terms(m, calib, rotation=None, scheme="w3"):
    act = torch.nn.functional.silu
    return [layer_terms(m, i, calib[i], parse_scheme(scheme), rotation, act, KINDS) for i in range(2)]


def _element(model, gen, rotation: bool = True) -> GroupElement:
    spec_of = ModelTensors.of(model).spec
    d, f = 32, 48
    layers = []
    for i in range(2):
        s = spec_of(i)
        vo = torch.stack([random_orthogonal(s.v_head_dim, gen) * torch.exp(0.5 * torch.randn(
            s.v_head_dim, generator=gen, dtype=torch.float64))[None, :] for _ in range(s.n_kv_heads)])
        layers.append(LayerElement(qk=random_commutant(s, gen), vo=vo,
                                   mlp=torch.exp(0.5 * torch.randn(f, generator=gen, dtype=torch.float64))))
    gains = {f"model.layers.{i}.{n}": torch.exp(0.3 * torch.randn(d, generator=gen, dtype=torch.float64))
             for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")}
    return GroupElement(rotation=random_orthogonal(d, gen) if rotation else None, gains=gains,
                        layers=tuple(layers))


def test_the_references_are_the_same_under_every_group_element():
    model, m, calib = _model_and_calibration()
    g = _element(model, torch.Generator().manual_seed(1))
    before, after = _terms(m, calib), _terms(apply_element(m, g), calib, g.rotation)
    for i in range(2):
        for k in KINDS:
            r0, r1 = before[i][k][1], after[i][k][1]
            assert abs(r1 - r0) <= 1e-10 * r0, f"layer {i} {k}: reference {r0:.6e} -> {r1:.6e}"
    e0, e1 = objective_value(before), objective_value(after)
    assert abs(e1 - e0) > 1e-3 * e0, "the element should change the quantization error"


def test_the_errors_do_not_see_a_factor_moved_across_a_pair():
    """Scaling every GL part by 2^-10 (exact in float64, and RTN is positively homogeneous)
    shrinks one factor of each pair and grows the other: the objective must not move, while
    the values' own rounding error (the unpaired form) shrinks by 2^-20."""
    model, m, calib = _model_and_calibration()
    t = 2.0**-10
    g = _element(model, torch.Generator().manual_seed(2), rotation=False)
    small = GroupElement(gains={k: t * v for k, v in g.gains.items()}, layers=tuple(
        LayerElement(qk=le.qk * t, vo=le.vo * t, mlp=le.mlp * t) for le in g.layers))
    a, b = apply_element(m, g), apply_element(m, small)
    ta, tb = _terms(a, calib), _terms(b, calib)
    for i in range(2):
        for k in KINDS:
            ea, eb = ta[i][k][0], tb[i][k][0]
            assert abs(eb - ea) <= 1e-9 * ea, f"layer {i} {k}: error {ea:.6e} -> {eb:.6e}"
    from attnid.quantize.objective import rtn_change

    scheme = parse_scheme("w3")
    values_only = GroupElement(gains=g.gains, layers=tuple(dataclasses.replace(le, vo=le.vo * t)
                                                           for le in g.layers))
    Va, Vb = a.attention(0).W_V[0].T, apply_element(m, values_only).attention(0).W_V[0].T
    ra, rb = rtn_change(Va, scheme).square().sum(), rtn_change(Vb, scheme).square().sum()
    assert float(rb / ra) < 1e-5, f"the unpaired error moved by {float(rb / ra):.2e} only"


def test_the_objective_does_not_see_a_permutation_of_neurons():
    _, m, calib = _model_and_calibration()
    perm = torch.randperm(48, generator=torch.Generator().manual_seed(4))
    p = neuron_permutation(m, 0, perm)
    e0, e1 = objective_value(_terms(m, calib)), objective_value(_terms(p, calib))
    assert abs(e1 - e0) <= 1e-10 * e0, f"{e0:.10e} -> {e1:.10e}"
    scaled = mlp_scaling(m, 0, torch.full((48,), 3.0, dtype=torch.float64))  # one factor for all
    e2 = objective_value(_terms(scaled, calib))
    assert abs(e2 - e0) <= 1e-10 * e0, f"a common MLP scale moved it: {e0:.10e} -> {e2:.10e}"


# ---- bad input ------------------------------------------------------------------------------
BAD = {  # extra flags, words of the one error line
    "unknown-scheme": (["--optimize", "w9", "--calibration", "{text}"], ["--optimize", "bits between"]),
    "unparsable-scheme": (["--optimize", "int4", "--calibration", "{text}"], ["--optimize", "w<bits>"]),
    "unknown-part": (["--optimize", "w4", "--calibration", "{text}", "--optimize-parts", "r1,r2"],
                     ["--optimize-parts", "r2"]),
    "missing-calibration-file": (["--optimize", "w4", "--calibration", "{missing}"], ["no such file"]),
    "no-calibration": (["--optimize", "w4"], ["--calibration"]),
    "calibration-alone": (["--calibration", "{text}"], ["--optimize SCHEME"]),
    "with-other-rewrites": (["--optimize", "w4", "--calibration", "{text}", "--rotate-residual", "hadamard"],
                            ["--rotate-residual"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_error_line_and_nothing_is_written(case, tmp_path, text, capsys):
    src = save(LLAMA, tmp_path, "m", torch.float32)
    flags, words = BAD[case]
    flags = [f.format(text=text, missing=tmp_path / "nope.txt") for f in flags]
    before = fingerprint(src)
    capsys.readouterr()
    code = main(["rewrite", str(src), str(tmp_path / "out"), *flags])
    _, err = capsys.readouterr()
    assert_one_error(code, err, "", words)
    assert not (tmp_path / "out").exists() and fingerprint(src) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")], "a staging folder was left"


def test_text_output_names_the_objective_and_the_certificate(tmp_path, text, capsys):
    src = save(LLAMA, tmp_path, "m", torch.float32)
    capsys.readouterr()
    code = main(["rewrite", str(src), str(tmp_path / "out"), "--optimize", "w4:16",
                 "--calibration", str(text), "--optimize-parts", "norm,mlp"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "optimized for w4:16 (mlp,norm; 512 calibration tokens)" in out, out
    assert "objective: input" in out and "norm:" in out and "mlp:" in out, out
    assert "certified by attnid diff" in out, out
