"""The catalogue of rewrites users report (issue 19), each built on a real checkpoint's tensors
the way QuaRot/SpinQuant/FPTQuant/SmoothQuant-style tools build them (by hand here, on the
safetensors dict: nothing of attnid's own rewrite library), checked with Hugging Face's own
class (the correct ones keep the logits, the broken ones do not), then given to `attnid diff`:
every correct rewrite is certified (exit 0), every broken one is refused (exit 1) with the
right layer and checkpoint tensor named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from attnid.cli import main

GEN = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
BASE = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "intermediate_size": 48, "vocab_size": 96, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False}
CONFIGS = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **BASE},
    "llama-tied": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **BASE,
                   "tie_word_embeddings": True},
    "llama-tied-gain": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **BASE,
                        "tie_word_embeddings": True},  # its final gain not uniform (SmolLM2's case)
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **BASE},
    "gpt2": {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 32, "n_head": 4,
             "n_layer": 2, "n_inner": 48, "vocab_size": 96, "n_positions": 64, "tie_word_embeddings": False},
    "neox": {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_size": 32,
             "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 48, "vocab_size": 96,
             "max_position_embeddings": 64, "use_parallel_residual": True, "tie_word_embeddings": False,
             "rotary_pct": 0.5},
}
D, H, G, DK = 32, 4, 2, 8


# ---- checkpoints ---------------------------------------------------------------------------
def _load(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v.double() for k, v in load_file(d / "model.safetensors").items()}


def _save(src: Path, dst: Path, t: dict[str, torch.Tensor], dtype=torch.float32) -> Path:
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    save_file({k: v.to(dtype).contiguous() for k, v in t.items()}, dst / "model.safetensors",
              metadata={"format": "pt"})
    return dst


def _generic(kind: str, root: Path) -> Path:
    """A random checkpoint at a generic point: norm gains away from 1 (a tied model's final
    gain stays 1, as QuaRot needs), biases away from 0."""
    import transformers

    c = dict(CONFIGS[kind], bos_token_id=None, eos_token_id=None, pad_token_id=None)
    conf = transformers.AutoConfig.for_model(c.pop("model_type"), **c)
    torch.manual_seed(0)
    src = root / f"{kind}-raw"
    transformers.AutoModelForCausalLM.from_config(conf).save_pretrained(src)
    t = _load(src)
    gen = GEN(1)
    for n, x in t.items():
        final = n in ("model.norm.weight",) and kind == "llama-tied"
        if ("norm" in n or "ln_" in n) and n.endswith("weight") and not final:
            t[n] = 0.5 + torch.rand(x.shape, generator=gen, dtype=torch.float64)
        elif ("norm" in n or "ln_" in n) and n.endswith("bias"):
            t[n] = 0.3 * torch.randn(x.shape, generator=gen, dtype=torch.float64)
    for n in t:
        if kind == "qwen2" and n.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            t[n] = torch.randn(t[n].shape, generator=gen, dtype=torch.float64)  # Qwen2's biases, far from 0
        if n.endswith(("q_proj.weight", "k_proj.weight", "gate_proj.weight", "up_proj.weight")):
            t[n] = 8 * t[n]  # trained-like: scores far from uniform, the MLP's nonlinearity at work
    return _save(src, root / kind, t)


# ---- the tools' steps, by hand ----------------------------------------------------------------
def _conv1d(name: str, kind: str) -> bool:
    return kind == "gpt2" and not name.startswith("lm_head")


def _lin(t: dict, name: str, kind: str) -> torch.Tensor:
    """A linear map's weight as ``[out, in]`` (GPT-2's Conv1D stores ``[in, out]``)."""
    return t[name].T if _conv1d(name, kind) else t[name]


def _set(t: dict, name: str, kind: str, w: torch.Tensor) -> None:
    t[name] = w.T if _conv1d(name, kind) else w


def _layout(kind: str, i: int) -> dict[str, list[str]]:
    """norm -> readers, and the writers, of layer ``i`` (module paths)."""
    if kind == "gpt2":
        p = f"transformer.h.{i}."
        return {"norms": {f"{p}ln_1": [f"{p}attn.c_attn"], f"{p}ln_2": [f"{p}mlp.c_fc"]},
                "writers": [f"{p}attn.c_proj", f"{p}mlp.c_proj"]}
    if kind == "neox":
        p = f"gpt_neox.layers.{i}."
        return {"norms": {f"{p}input_layernorm": [f"{p}attention.query_key_value"],
                          f"{p}post_attention_layernorm": [f"{p}mlp.dense_h_to_4h"]},
                "writers": [f"{p}attention.dense", f"{p}mlp.dense_4h_to_h"]}
    p = f"model.layers.{i}."
    return {"norms": {f"{p}input_layernorm": [f"{p}self_attn.{x}_proj" for x in "qkv"],
                      f"{p}post_attention_layernorm": [f"{p}mlp.gate_proj", f"{p}mlp.up_proj"]},
            "writers": [f"{p}self_attn.o_proj", f"{p}mlp.down_proj"]}


def _head(kind: str) -> tuple[str, str, list[str]]:
    """(final norm, unembedding, embedding tables)."""
    return {"gpt2": ("transformer.ln_f", "lm_head", ["transformer.wte", "transformer.wpe"]),
            "neox": ("gpt_neox.final_layer_norm", "embed_out", ["gpt_neox.embed_in"])}.get(
        kind, ("model.norm", "lm_head", ["model.embed_tokens"]))


def _norms(t: dict, kind: str) -> list[tuple[str, list[str]]]:
    final, unembed, _ = _head(kind)
    pairs = [(n, rs) for i in range(2) for n, rs in _layout(kind, i)["norms"].items()]
    return pairs + ([(final, [unembed])] if f"{unembed}.weight" in t else [])


def fold(t: dict, kind: str) -> None:
    """Every norm's gain into its readers: ``W diag(g)``, gain 1, a LayerNorm bias ``b / g``."""
    for norm, readers in _norms(t, kind):
        g = t[f"{norm}.weight"]
        for r in readers:
            _set(t, f"{r}.weight", kind, _lin(t, f"{r}.weight", kind) * g[None, :])
        t[f"{norm}.weight"] = torch.ones_like(g)
        if f"{norm}.bias" in t:
            t[f"{norm}.bias"] = t[f"{norm}.bias"] / g


def rotate(t: dict, kind: str, Q: torch.Tensor, *, tied_twice: bool = False) -> None:
    """R1: the stream ``x -> x Q``: tables ``E Q``, readers ``W Q``, writers ``Q^T W`` (biases)."""
    final, unembed, tables = _head(kind)
    for tab in tables:
        t[f"{tab}.weight"] = t[f"{tab}.weight"] @ Q
    if tied_twice:  # the tool rotates the head too, which is the very same (tied) tensor
        t[f"{tables[0]}.weight"] = t[f"{tables[0]}.weight"] @ Q
    readers = [r for i in range(2) for rs in _layout(kind, i)["norms"].values() for r in rs]
    readers += [unembed] if f"{unembed}.weight" in t else []
    for r in readers:
        _set(t, f"{r}.weight", kind, _lin(t, f"{r}.weight", kind) @ Q)
    for w in (x for i in range(2) for x in _layout(kind, i)["writers"]):
        _set(t, f"{w}.weight", kind, Q.T @ _lin(t, f"{w}.weight", kind))
        if f"{w}.bias" in t:
            t[f"{w}.bias"] = Q.T @ t[f"{w}.bias"]
    for norm in {n for n, _ in _norms(t, kind)} | {final}:
        if f"{norm}.bias" in t:  # (gains folded: 1) the norm's output rotates with the stream
            t[f"{norm}.bias"] = Q.T @ t[f"{norm}.bias"]


def _v_rows(kind: str, h: int) -> tuple[str, slice]:
    """(tensor, rows) of head ``h``'s values in the fused or separate projection."""
    if kind == "gpt2":
        return "attn.c_attn", slice(2 * D + h * DK, 2 * D + (h + 1) * DK)
    if kind == "neox":
        return "attention.query_key_value", slice(h * 3 * DK + 2 * DK, (h + 1) * 3 * DK)
    return "self_attn.v_proj", slice(h * DK, (h + 1) * DK)


def _prefix(kind: str, i: int) -> str:
    return {"gpt2": f"transformer.h.{i}.", "neox": f"gpt_neox.layers.{i}."}.get(kind, f"model.layers.{i}.")


def rotate_values(t: dict, kind: str, i: int, seed: int, bias: str = "right") -> None:
    """R2: per key/value group an orthogonal ``C``: values ``C^T v``, the kv group's heads' output
    columns ``W_O^h C``; the value bias ``C^T b`` (``bias="none"``: forgotten; ``"wrong"``: the
    bias of all groups viewed as ``[dv, G]`` instead of ``[G, dv]``)."""
    kv_groups = G if kind in ("llama", "llama-tied", "llama-tied-gain", "qwen2") else H
    Cs = [torch.linalg.qr(torch.randn(DK, DK, generator=GEN(seed + g), dtype=torch.float64))[0]
          for g in range(kv_groups)]
    p = _prefix(kind, i)
    out = "attn.c_proj" if kind == "gpt2" else "attention.dense" if kind == "neox" else "self_attn.o_proj"
    Wo = _lin(t, f"{p}{out}.weight", kind).clone()
    for g, C in enumerate(Cs):
        name, rows = _v_rows(kind, g)
        Wv = _lin(t, f"{p}{name}.weight", kind).clone()
        Wv[rows] = C.T @ Wv[rows]
        _set(t, f"{p}{name}.weight", kind, Wv)
        if f"{p}{name}.bias" in t and bias == "right":
            b = t[f"{p}{name}.bias"].clone()
            b[rows] = C.T @ b[rows]
            t[f"{p}{name}.bias"] = b
        for h in range(g * H // kv_groups, (g + 1) * H // kv_groups):
            Wo[:, h * DK:(h + 1) * DK] = Wo[:, h * DK:(h + 1) * DK] @ C
    _set(t, f"{p}{out}.weight", kind, Wo)
    if bias == "wrong":  # a GQA value bias rotated with the shapes mixed up
        b = t[f"{p}self_attn.v_proj.bias"].reshape(DK, G).T.clone()  # [G, dv], but scrambled
        t[f"{p}self_attn.v_proj.bias"] = torch.stack([Cs[g].T @ b[g] for g in range(G)]).T.reshape(-1)


def qk_transform(t: dict, i: int, seed: int, commute: bool = True) -> None:
    """FPTQuant-style: per kv group ``M`` (``q -> M^T q``, ``k -> M^{-1} k``), a scaled rotation on
    each RoPE plane ``(j, j + dk/2)``; ``commute=False``: any invertible ``M`` (the bug)."""
    gen = GEN(seed)
    p = _prefix("llama", i)
    for g in range(G):
        if commute:
            M = torch.zeros(DK, DK, dtype=torch.float64)
            size = torch.exp(0.3 * torch.randn(DK // 2, generator=gen, dtype=torch.float64))
            angle = 6 * torch.rand(DK // 2, generator=gen, dtype=torch.float64)
            for j in range(DK // 2):
                a, b = size[j] * torch.cos(angle[j]), size[j] * torch.sin(angle[j])
                M[j, j] = M[j + DK // 2, j + DK // 2] = a
                M[j, j + DK // 2], M[j + DK // 2, j] = b, -b
        else:
            M = torch.eye(DK, dtype=torch.float64)
            M = M + 0.4 * torch.randn(DK, DK, generator=gen, dtype=torch.float64)
        for h in range(g * H // G, (g + 1) * H // G):
            rows = slice(h * DK, (h + 1) * DK)
            W = t[f"{p}self_attn.q_proj.weight"].clone()
            W[rows] = M.T @ W[rows]
            t[f"{p}self_attn.q_proj.weight"] = W
        rows = slice(g * DK, (g + 1) * DK)
        W = t[f"{p}self_attn.k_proj.weight"].clone()
        W[rows] = torch.linalg.solve(M, W[rows])
        t[f"{p}self_attn.k_proj.weight"] = W


def scale_mlp(t: dict, i: int, seed: int, which: str = "up") -> None:
    """SmoothQuant/AWQ-style: neuron rows of ``which`` times ``c``, the down columns ``/ c``."""
    p = _prefix("llama", i)
    c = torch.exp(torch.randn(BASE["intermediate_size"], generator=GEN(seed), dtype=torch.float64))
    t[f"{p}mlp.{which}_proj.weight"] = t[f"{p}mlp.{which}_proj.weight"] * c[:, None]
    t[f"{p}mlp.down_proj.weight"] = t[f"{p}mlp.down_proj.weight"] / c[None, :]


def permute(t: dict, i: int, seed: int) -> None:
    """Merging tools' permutations: MLP neurons, and the two key/value groups (with their heads)."""
    p = _prefix("llama", i)
    f = torch.randperm(BASE["intermediate_size"], generator=GEN(seed))
    for n in ("gate_proj", "up_proj"):
        t[f"{p}mlp.{n}.weight"] = t[f"{p}mlp.{n}.weight"][f]
    t[f"{p}mlp.down_proj.weight"] = t[f"{p}mlp.down_proj.weight"][:, f]
    heads = torch.cat([torch.arange(2, 4), torch.arange(0, 2)])  # group 1 first, its heads swapped
    heads = heads[[1, 0, 2, 3]]
    rows = torch.cat([torch.arange(h * DK, (h + 1) * DK) for h in heads])
    grows = torch.cat([torch.arange(g * DK, (g + 1) * DK) for g in (1, 0)])
    t[f"{p}self_attn.q_proj.weight"] = t[f"{p}self_attn.q_proj.weight"][rows]
    t[f"{p}self_attn.o_proj.weight"] = t[f"{p}self_attn.o_proj.weight"][:, rows]
    for n in ("k_proj", "v_proj"):
        t[f"{p}self_attn.{n}.weight"] = t[f"{p}self_attn.{n}.weight"][grows]
        if f"{p}self_attn.{n}.bias" in t:
            t[f"{p}self_attn.{n}.bias"] = t[f"{p}self_attn.{n}.bias"][grows]
    if f"{p}self_attn.q_proj.bias" in t:
        t[f"{p}self_attn.q_proj.bias"] = t[f"{p}self_attn.q_proj.bias"][rows]


def change_gain(t: dict, name: str, size: float = 0.2) -> None:
    """A hand-broken copy: one norm's gain, each entry times ``exp(size * N(0, 1))``."""
    t[name] = t[name] * torch.exp(size * torch.randn(t[name].shape, generator=GEN(9), dtype=torch.float64))


def random_rotation(d: int, seed: int, fix_ones: bool = False) -> torch.Tensor:
    Q = torch.linalg.qr(torch.randn(d, d, generator=GEN(seed), dtype=torch.float64))[0]
    if not fix_ones:
        return Q
    u = torch.ones(d, 1, dtype=torch.float64) / d**0.5
    U = torch.linalg.qr(torch.cat([u, torch.eye(d, dtype=torch.float64)], 1))[0][:, 1:d]
    R = torch.linalg.qr(torch.randn(d - 1, d - 1, generator=GEN(seed), dtype=torch.float64))[0]
    return U @ R @ U.T + u @ u.T


def sylvester(d: int) -> torch.Tensor:
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < d:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H / d**0.5


# ---- the catalogue -----------------------------------------------------------------------------
def _r1_r2_qk_scale(t: dict) -> None:
    fold(t, "llama")
    rotate(t, "llama", random_rotation(D, 5))
    for i in range(2):
        rotate_values(t, "llama", i, 10 * i)
        qk_transform(t, i, 20 + i)
        scale_mlp(t, i, 30 + i)
        permute(t, i, 40 + i)


CORRECT = {
    "llama-R1-random": ("llama", lambda t: (fold(t, "llama"), rotate(t, "llama", random_rotation(D, 1)))),
    "llama-R1-hadamard": ("llama", lambda t: (fold(t, "llama"), rotate(t, "llama", sylvester(D)))),
    "llama-R1-R2-qk-planes-mlp-scaling-permutations": ("llama", _r1_r2_qk_scale),
    "qwen2-R1-R2-biases": ("qwen2", lambda t: (
        fold(t, "qwen2"), rotate(t, "qwen2", random_rotation(D, 2)), rotate_values(t, "qwen2", 0, 3),
        rotate_values(t, "qwen2", 1, 4))),
    "llama-tied-unit-final-gain-R1": ("llama-tied", lambda t: (
        fold(t, "llama-tied"), rotate(t, "llama-tied", random_rotation(D, 6)))),
    "gpt2-layernorm-R1-fixing-ones-R2": ("gpt2", lambda t: (fold(t, "gpt2"), rotate(
        t, "gpt2", random_rotation(D, 7, fix_ones=True)), rotate_values(t, "gpt2", 1, 8))),
    "neox-parallel-R1-fixing-ones-R2": ("neox", lambda t: (fold(t, "neox"), rotate(
        t, "neox", random_rotation(D, 9, fix_ones=True)), rotate_values(t, "neox", 0, 11))),
}

BROKEN = {  # name: (kind, rewrite, (layer, tensor, words of the reason or None))
    "value-bias-left-unrotated": ("qwen2", lambda t: (
        fold(t, "qwen2"), rotate(t, "qwen2", random_rotation(D, 2)),
        rotate_values(t, "qwen2", 1, 4, bias="none")),
        (1, "model.layers.1.self_attn.v_proj.bias", None)),
    "tied-embeddings-rotated-twice": ("llama-tied", lambda t: (fold(t, "llama-tied"), rotate(
        t, "llama-tied", random_rotation(D, 6), tied_twice=True)), (None, "model.embed_tokens.weight", None)),
    "norm-gains-not-folded-before-rotation": ("llama", lambda t: rotate(t, "llama", random_rotation(D, 1)),
                                              (0, "model.layers.0.input_layernorm.weight", "not folded")),
    "gqa-biases-rotated-with-wrong-shapes": ("qwen2", lambda t: (fold(t, "qwen2"), rotate_values(
        t, "qwen2", 0, 3, bias="wrong")), (0, "model.layers.0.self_attn.v_proj.bias", None)),
    "gate-scaled-instead-of-up": ("llama", lambda t: (fold(t, "llama"), scale_mlp(t, 1, 5, which="gate")),
                                  (1, "model.layers.1.mlp.gate_proj.weight", None)),
    "qk-transform-not-commuting-with-rope": ("llama", lambda t: qk_transform(t, 1, 7, commute=False),
                                            (1, "model.layers.1.self_attn.q_proj.weight", None)),
    # one norm gain changed after R1 (issue 25): named by the norm, not by its reader
    "mlp-norm-gain-changed-after-R1": ("llama", lambda t: (
        fold(t, "llama"), rotate(t, "llama", random_rotation(D, 1)),
        change_gain(t, "model.layers.1.post_attention_layernorm.weight")),
        (1, "model.layers.1.post_attention_layernorm.weight", "gain changed")),
    "attention-norm-gain-changed-after-R1-R2": ("qwen2", lambda t: (
        fold(t, "qwen2"), rotate(t, "qwen2", random_rotation(D, 2)), rotate_values(t, "qwen2", 1, 4),
        change_gain(t, "model.layers.1.input_layernorm.weight", 2.0)),
        (1, "model.layers.1.input_layernorm.weight", "gain changed")),
    "final-norm-gain-changed-after-R1": ("llama", lambda t: (
        fold(t, "llama"), rotate(t, "llama", random_rotation(D, 1)), change_gain(t, "model.norm.weight")),
        (None, "model.norm.weight", "gain changed")),
}


def _logits(d: Path) -> torch.Tensor:
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = torch.randint(0, 96, (2, 12), generator=GEN(0))
    with torch.no_grad():
        return torch.log_softmax(m(input_ids=ids).logits.double(), -1)


def _diff(capsys, a: Path, b: Path) -> tuple[int, dict]:
    code = main(["diff", str(a), str(b), "--json"])
    out, err = capsys.readouterr()
    assert out.strip(), err
    return code, json.loads(out)


def _moved(a: Path, b: Path) -> float:
    la, lb = _logits(a), _logits(b)
    return float((la - lb).norm() / la.norm())


@pytest.mark.parametrize("name", list(CORRECT))
def test_correct_rewrite_is_certified(name, tmp_path, capsys):
    kind, rewrite = CORRECT[name]
    src = _generic(kind, tmp_path)
    t = _load(src)
    rewrite(t)
    b = _save(src, tmp_path / "rewritten", t)
    moved = _moved(src, b)
    assert moved < 1e-5, f"{name}: the rewrite itself changed the logits by {moved:.1e}"
    code, r = _diff(capsys, src, b)
    assert code == 0 and r["certified"], f"{name}: {r['break']}"
    worst = max(row["residual"] for row in r["layers"])
    assert worst <= r["tolerance"], (name, worst)


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_rewrite_is_refused_where_it_broke(name, tmp_path, capsys):
    kind, rewrite, (layer, tensor, words) = BROKEN[name]
    src = _generic(kind, tmp_path)
    t = _load(src)
    rewrite(t)
    b = _save(src, tmp_path / "rewritten", t)
    moved = _moved(src, b)
    assert moved > 1e-3, f"{name}: the bug does not change the function ({moved:.1e})"
    code, r = _diff(capsys, src, b)
    brk = r["break"]
    assert code == 1 and not r["certified"], name
    assert (brk["layer"], brk["tensor"]) == (layer, tensor), f"{name}: {brk}"
    assert brk["residual"] > 100 * r["tolerance"], brk
    if words:
        assert words in (brk["reason"] or ""), brk


# ---- post-LN: the real all-MiniLM-L6-v2 -------------------------------------------------------------
def _minilm_tensors(minilm: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v.double() for k, v in load_file(minilm / "model.safetensors").items()}


def _minilm_rotated(t: dict) -> None:
    """QuaRot's R1 on a post-LN encoder, as a tool unaware of post-LN would apply it."""
    Q = random_rotation(384, 0, fix_ones=True)
    for n in list(t):
        reader = n.endswith(("query.weight", "key.weight", "value.weight", "intermediate.dense.weight"))
        if reader or (n.startswith("embeddings.") and n.endswith("embeddings.weight")):
            t[n] = t[n] @ Q
        elif n.endswith(("output.dense.weight", "output.dense.bias", "LayerNorm.bias")):
            t[n] = Q.T @ t[n]


def _minilm_r2_and_permutations(t: dict) -> None:
    """Symmetries of a post-LN encoder: R2 per head, head and neuron permutations."""
    for i in range(6):
        p = f"encoder.layer.{i}."
        heads = torch.randperm(12, generator=GEN(i))
        rows = torch.cat([torch.arange(h * 32, (h + 1) * 32) for h in heads])
        for n in ("query", "key", "value"):
            t[f"{p}attention.self.{n}.weight"] = t[f"{p}attention.self.{n}.weight"][rows]
            t[f"{p}attention.self.{n}.bias"] = t[f"{p}attention.self.{n}.bias"][rows]
        Wo = t[f"{p}attention.output.dense.weight"][:, rows].clone()
        Wv, bv = t[f"{p}attention.self.value.weight"].clone(), t[f"{p}attention.self.value.bias"].clone()
        for h in range(12):
            C = torch.linalg.qr(torch.randn(32, 32, generator=GEN(100 * i + h), dtype=torch.float64))[0]
            s = slice(h * 32, (h + 1) * 32)
            Wv[s], bv[s], Wo[:, s] = C.T @ Wv[s], C.T @ bv[s], Wo[:, s] @ C
        t[f"{p}attention.self.value.weight"], t[f"{p}attention.self.value.bias"] = Wv, bv
        t[f"{p}attention.output.dense.weight"] = Wo
        f = torch.randperm(1536, generator=GEN(50 + i))
        t[f"{p}intermediate.dense.weight"] = t[f"{p}intermediate.dense.weight"][f]
        t[f"{p}intermediate.dense.bias"] = t[f"{p}intermediate.dense.bias"][f]
        t[f"{p}output.dense.weight"] = t[f"{p}output.dense.weight"][:, f]


def _hidden(d: Path) -> torch.Tensor:
    import transformers

    m = transformers.AutoModel.from_pretrained(d).eval()
    ids = torch.randint(0, 30000, (2, 12), generator=GEN(0))
    with torch.no_grad():
        return m(input_ids=ids).last_hidden_state.double()


@pytest.mark.parametrize("case", ["r2-and-permutations", pytest.param("rotated", marks=pytest.mark.slow)])
def test_real_minilm(case, minilm, tmp_path, capsys):
    t = _minilm_tensors(minilm)
    (_minilm_r2_and_permutations if case == "r2-and-permutations" else _minilm_rotated)(t)
    b = _save(minilm, tmp_path / case, t)
    a0, b0 = _hidden(minilm), _hidden(b)
    moved = float((a0 - b0).norm() / a0.norm())
    code, r = _diff(capsys, minilm, b)
    if case == "r2-and-permutations":
        assert moved < 1e-5, moved
        assert code == 0, r["break"]
        assert min(row["permutation_share"] for row in r["layers"]) > 0.5, r["layers"]
    else:
        assert moved > 1e-2, f"rotating a post-LN stream is no symmetry ({moved:.1e})"
        assert code == 1 and r["break"]["tensor"] == "embeddings.word_embeddings.weight", r["break"]
        assert "post-LN" in r["break"]["reason"], r["break"]


# ---- tied models untied, as QuaRot and SpinQuant rewrite them (issue 25) ----------------------
def _untied(src: Path, dst: Path, t: dict) -> Path:
    """``t`` saved with ``tie_word_embeddings: false`` (it holds its own lm_head.weight)."""
    out = _save(src, dst, t)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    return out


def spinquant_untie(t: dict, *, forget_gain: bool = False) -> None:
    """SpinQuant's R1 + R2 on a tied model: the head a copy of the token table, every gain
    folded (the final one into the new head: ``forget_gain`` leaves it out, the bug), then the
    stream rotated and each layer's values."""
    t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    g = t["model.norm.weight"].clone()
    fold(t, "llama-tied-gain")
    if forget_gain:
        t["lm_head.weight"] = t["lm_head.weight"] / g[None, :]
    rotate(t, "llama-tied-gain", sylvester(D))
    for i in range(2):
        rotate_values(t, "llama-tied-gain", i, 60 + i)


@pytest.mark.parametrize("case", ["certified", "reverse", "final-gain-forgotten"])
def test_tied_model_untied_by_spinquant(case, tmp_path, capsys):
    src = _generic("llama-tied-gain", tmp_path)
    assert "lm_head.weight" not in _load(src)
    t = _load(src)
    spinquant_untie(t, forget_gain=case == "final-gain-forgotten")
    b = _untied(src, tmp_path / "untied", t)
    moved = _moved(src, b)
    a_, b_ = (b, src) if case == "reverse" else (src, b)
    code, r = _diff(capsys, a_, b_)
    if case == "final-gain-forgotten":
        assert moved > 1e-3, moved
        assert code == 1 and r["break"]["layer"] is None, r["break"]
        assert r["break"]["tensor"] in ("lm_head.weight", "model.norm.weight"), r["break"]
        return
    assert moved < 1e-5, f"the rewrite itself changed the logits by {moved:.1e}"
    assert code == 0 and r["certified"], r["break"]
    assert r["other"]["residual"] <= r["tolerance"], r["other"]


def test_rewrite_unties_a_tied_model(tmp_path, capsys):
    """`attnid rewrite --rotate-residual` of a tied model whose final gain is not uniform: refused
    without --untie (the error names the flag), written, untied and certified with it."""
    src = _generic("llama-tied-gain", tmp_path)
    out = tmp_path / "out"
    args = ["rewrite", str(src), str(out), "--fold-norms", "--rotate-residual", "hadamard", "--json"]
    assert main(args) == 2
    assert "--untie" in capsys.readouterr().err and not out.exists()
    assert main([*args, "--untie"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["untied"] == "lm_head.weight" and r["certified"], r
    assert r["end_to_end_rel_diff"] < 1e-5, r
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert "lm_head.weight" in _load(out)
    code, back = _diff(capsys, out, src)
    assert code == 0, back["break"]


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_config_without_architectures(tied, tmp_path, capsys):
    """``"architectures": null`` (a GGUF conversion): the head comes from the tensors (an
    lm_head.weight, or tie_word_embeddings), so rewrite and diff read it as audit does."""
    src = _generic("llama-tied" if tied else "llama", tmp_path)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "architectures": None}))
    out = tmp_path / "out"
    assert main(["rewrite", str(src), str(out), "--rotate-values", "hadamard", "--json"]) == 0, \
        capsys.readouterr().err
    r = json.loads(capsys.readouterr().out)
    assert r["certified"] and r["end_to_end_rel_diff"] < 1e-5, r
    code, d = _diff(capsys, src, out)
    assert code == 0 and d["architecture"] == "Llama", d["break"]
