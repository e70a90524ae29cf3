"""Fake round-to-nearest quantization (`attnid.quantize`): the vectorised quantizer against a
slow per-row, per-group loop; a weight already on its grid is kept to the bit; at most 2^bits
levels per row or group and an error of at most half a step; the scheme is parsed strictly;
`quantize_linears` rounds every linear layer but the head, on a copy."""

from __future__ import annotations

import math

import pytest
import torch

from attnid.errors import AttnidError
from attnid.quantize import Scheme, fake_quantize, parse_scheme, quantizable, quantize_linears

SCHEMES = ["w2", "w3", "w4", "w8", "w4:8", "w3:5", "w4:64"]  # w3:5 on 24 columns: a last group of 4


def reference(weight: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """Slow and obvious: for each row, for each group of columns, Python floats."""
    n = scheme.levels - 1
    out = weight.clone()
    rows, cols = weight.shape
    g = scheme.group or cols
    for r in range(rows):
        for start in range(0, cols, g):
            vals = [float(v) for v in weight[r, start:start + g]]
            lo, hi = min(vals), max(vals)
            if hi == lo:
                continue
            scale = (hi - lo) / n
            zero = round(-lo / scale)  # Python rounds half to even, as torch.round does
            for k, v in enumerate(vals):
                q = min(max(round(v / scale) + zero, 0), n)
                out[r, start + k] = (q - zero) * scale
    return out


def groups(w: torch.Tensor, scheme: Scheme) -> list[torch.Tensor]:
    g = scheme.group or w.shape[1]
    return [w[r, s:s + g] for r in range(w.shape[0]) for s in range(0, w.shape[1], g)]


@pytest.mark.parametrize("text", SCHEMES)
def test_matches_the_per_row_loop(text):
    scheme = parse_scheme(text)
    w = torch.randn(7, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    w[3] = 0.25  # a constant row is kept
    got, want = fake_quantize(w, scheme), reference(w, scheme)
    err = float((got - want).abs().max())
    assert err <= 1e-12 * float(w.abs().max()), f"{text}: {err:.3g} from the per-row loop"
    assert not torch.equal(got, w), f"{text}: nothing was rounded"


@pytest.mark.parametrize("text", SCHEMES)
def test_a_weight_on_its_grid_is_unchanged(text):
    scheme = parse_scheme(text)
    n, gen = scheme.levels - 1, torch.Generator().manual_seed(2)
    rows, cols = 5, 24
    g = scheme.group or cols
    q = torch.randint(0, n + 1, (rows, cols), generator=gen)
    for s in range(0, cols, g):  # each group reaches both ends of its grid
        q[:, s], q[:, min(s + 1, cols - 1)] = 0, n
    zero = torch.randint(0, n + 1, (rows, 1), generator=gen)
    scale = 2.0 ** -torch.randint(2, 8, (rows, 1), generator=gen).double()  # exact in binary
    w = (q - zero) * scale
    got = fake_quantize(w, scheme)
    assert torch.equal(got, w), f"{text}: moved by {float((got - w).abs().max()):.3g}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("text", SCHEMES)
def test_levels_and_error_bound(text, dtype):
    scheme = parse_scheme(text)
    w = (torch.randn(6, 24, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    w_in = w.clone()
    got = fake_quantize(w, scheme)
    assert got.dtype == dtype and got.shape == w.shape and torch.equal(w, w_in)  # a new tensor
    slack = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]  # bf16: stored back
    checked = 0
    for before, after in zip(groups(w.double(), scheme), groups(got.double(), scheme), strict=True):
        levels = len(set(after.tolist()))
        assert levels <= scheme.levels, f"{text}: {levels} levels in a group"
        half = float(before.max() - before.min()) / (scheme.levels - 1) / 2
        err = float((after - before).abs().max())
        assert err <= half * (1 + slack) + slack * float(before.abs().max()), (
            f"{text} {dtype}: error {err:.4g} beyond half a step {half:.4g}")
        checked += 1
    assert checked == 6 * math.ceil(24 / (scheme.group or 24))


def test_rounding_twice_changes_nothing():
    scheme = parse_scheme("w3:8")
    once = fake_quantize(torch.randn(4, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(4)),
                         scheme)
    err = float((fake_quantize(once, scheme) - once).abs().max())
    assert err <= 1e-12, f"rounding twice moved a weight by {err:.3g}"


@pytest.mark.parametrize("text,bits,group", [("w4", 4, None), ("w4:64", 4, 64), ("w3:64", 3, 64),
                                             ("w8", 8, None), ("w2:128", 2, 128)])
def test_parse(text, bits, group):
    s = parse_scheme(text)
    assert (s.bits, s.group, str(s)) == (bits, group, text)


@pytest.mark.parametrize("text", ["", "w", "4", "W4", "w4:", "w4:0", "w4:1", "w1", "w9", "w16", "int4",
                                  "w4:64:2", "w 4", "w4,64", "w-4", "w4:-64", "w4:６４"])
def test_parse_refuses(text):
    with pytest.raises(AttnidError, match="--quantize"):
        parse_scheme(text)


def test_quantize_linears_rounds_a_copy_and_keeps_the_head():
    transformers = pytest.importorskip("transformers")
    conf = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                                    tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(conf).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scheme = parse_scheme("w3")
    names = [n for n, _ in quantizable(model)]
    assert len(names) == 2 * 7 and "lm_head" not in names, names  # q k v o gate up down per layer
    out = quantize_linears(model, scheme)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()), "the input was changed"
    after = out.state_dict()
    for k, v in before.items():
        module = k.rpartition(".")[0]
        if module in names:
            assert torch.equal(after[k], fake_quantize(v, scheme)), k
        else:  # norms, embeddings, the head
            assert torch.equal(after[k], v), f"{k} changed"


def test_quantize_linears_gpt2_conv1d_by_output_channel():
    transformers = pytest.importorskip("transformers")
    conf = transformers.GPT2Config(n_embd=32, n_head=4, n_layer=1, n_inner=48, vocab_size=50, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(conf).eval()  # tied head: the embedding is not rounded either
    names = [n for n, _ in quantizable(model)]
    assert names == ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj",
                     "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"], names
    scheme = parse_scheme("w2")
    out = quantize_linears(model, scheme)
    for n in names:
        w = out.get_submodule(n).weight  # Conv1D: [in, out]
        counts = [len(set(w[:, j].tolist())) for j in range(w.shape[1])]
        assert max(counts) <= 4 < len(set(w[0].tolist())), f"{n}: not rounded per output channel"
    assert torch.equal(out.transformer.wte.weight, model.transformer.wte.weight)


def test_quantize_linears_explicit_skip():
    lin = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    out = quantize_linears(lin, parse_scheme("w2"), skip={"1"})
    assert torch.equal(out[1].weight, lin[1].weight) and not torch.equal(out[0].weight, lin[0].weight)


def test_cayley_is_a_rotation_and_zero_is_the_identity():
    from attnid.whole.transforms.orthogonal import cayley, skew

    A = torch.randn(12, 12, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    Q = cayley(skew(A))
    err = float((Q.T @ Q - torch.eye(12, dtype=torch.float64)).abs().max())
    assert err < 1e-12, f"Q^T Q - I = {err:.2e}"
    assert float(torch.linalg.det(Q)) > 0
    assert torch.equal(cayley(torch.zeros(5, 5)), torch.eye(5))


def test_refining_the_rotation_lowers_the_incoherence_proxy_and_stays_orthogonal():
    """Outlier channels on the residual side (a reader column, a writer row): the refinement
    from the Hadamard lowers the proxy, every iterate a rotation."""
    from attnid.quantize.incoherence import kurtosis, refine_rotation
    from attnid.whole.transforms.orthogonal import hadamard

    gen = torch.Generator().manual_seed(0)
    R, W = torch.randn(256, 32, generator=gen), torch.randn(32, 128, generator=gen)
    R[:, 3] *= 30
    W[5] *= 30
    H = hadamard(32).double()
    flat = float(kurtosis(R.double()) + kurtosis(W.double()))
    Q, trace = refine_rotation(R, W, H, steps=60)
    assert trace[0] < flat, f"the Hadamard does not spread the outliers ({trace[0]:.3f} vs {flat:.3f})"
    assert trace[-1] < 0.95 * trace[0], f"the proxy barely moved: {trace[0]:.4f} -> {trace[-1]:.4f}"
    err = float((Q.T @ Q - torch.eye(32, dtype=torch.float64)).abs().max())
    assert err < 1e-12, f"the refined rotation is not orthogonal ({err:.2e})"
    got = float(kurtosis(R.double() @ Q) + kurtosis(Q.T @ W.double()))
    assert abs(got - trace[-1]) < 1e-12, "the trace's last value is not the returned rotation's"
