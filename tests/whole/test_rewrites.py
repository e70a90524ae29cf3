"""The rewrites users apply to real checkpoints (QuaRot/SpinQuant R1 and R2, FPTQuant-style
Q/K plane transforms, SmoothQuant/AWQ-style MLP scaling, the permutations merging tools use),
on Hugging Face's own classes in float64, for every family that has whole-model transforms:
each preserves the function to ~1e-10 (relative change of log-probabilities or hidden states)
or is refused with one `AttnidError` where it is no symmetry; the input is never modified; the
tensor-level path (`ModelTensors`) and the module path give the same tensors."""

import pytest
import torch

pytest.importorskip("transformers")

from attnid.errors import AttnidError
from attnid.testing import TOLERANCE
from attnid.testing.catalogue import TRANSFORM_FAMILIES as FAMILIES
from attnid.testing.models import model_function as function
from attnid.whole import transforms as T
from attnid.whole.check import tiny_model
from attnid.whole.transforms.orthogonal import (
    fixing_ones,
    random_commutant,
    random_head_permutation,
    random_orthogonal,
    random_rotation_fixing_ones,
)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def _rotation(m, kind, seed):
    d = m.config.hidden_size
    layer_norm = T.layout_of(m).norm == "layer"
    if kind == "hadamard":
        H = T.hadamard(d)
        return fixing_ones(H) if layer_norm else H
    return random_rotation_fixing_ones(d, gen(seed)) if layer_norm else random_orthogonal(d, gen(seed))


def _layers(m):
    return len(T.layout_of(m).layers)


def _spec(m, i):
    return T.ModelTensors.of(m).spec(i)


def _each_layer(m, fn):
    for i in range(_layers(m)):
        m = fn(m, i)
    return m


def _scales(m, i, seed):
    lay = T.layout_of(m)
    f = T.ModelTensors.of(m).weight(lay.mlps[i][1]).shape[1]
    c = torch.exp(0.5 * torch.randn(f, generator=gen(seed), dtype=torch.float64))
    if lay.mlp == "gated":  # the up half is linear: negative scales too
        c = c * torch.where(torch.rand(f, generator=gen(seed + 1)) < 0.5, -1.0, 1.0)
    return c


def _neurons(m, i, seed):
    f = T.ModelTensors.of(m).weight(T.layout_of(m).mlps[i][1]).shape[1]
    return torch.randperm(f, generator=gen(seed))


def _values(m, i, seed):
    s = _spec(m, i)
    return torch.stack([random_orthogonal(s.v_head_dim, gen(seed + g)) for g in range(s.n_kv_heads)])


REWRITES = {
    "fold-norms": T.fold_norm_gains,
    "rotate-random": lambda m: T.residual_rotation(m, _rotation(m, "random", 1)),
    "rotate-hadamard": lambda m: T.residual_rotation(m, _rotation(m, "hadamard", 0)),
    "rotate-values": lambda m: _each_layer(m, lambda x, i: T.value_transform(x, i, _values(x, i, 10 * i))),
    "qk-planes": lambda m: _each_layer(m, lambda x, i: T.query_key_transform(
        x, i, random_commutant(_spec(x, i), gen(i)))),
    "scale-mlp": lambda m: _each_layer(m, lambda x, i: T.mlp_scaling(x, i, _scales(x, i, 3 + i))),
    "permute-mlp": lambda m: _each_layer(m, lambda x, i: T.neuron_permutation(x, i, _neurons(x, i, i))),
    "permute-heads": lambda m: _each_layer(m, lambda x, i: T.head_permutation(
        x, i, random_head_permutation(_spec(x, i), gen(5 + i)))),
}

POST_LN = {"bert", "roberta"}
GELU = {"gpt2-untied", "neox-parallel", "neox-half-rotary-no-bias", "falcon-parallel-bias",
        "falcon-new-decoder", "bert", "roberta"}
REFUSED = {  # (family, rewrite) -> words of the refusal
    **{(f, r): "post-LN" for f in POST_LN for r in ("rotate-random", "rotate-hadamard")},
    **{(f, r): "not uniform" for f in ("llama-tied", "llama-no-positions-tied")
       for r in ("rotate-random", "rotate-hadamard")},
    ("qwen3-qk-norm", "qk-planes"): "QK-norm",
    **{(f, "scale-mlp"): "homogeneous" for f in GELU},
}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("rewrite", list(REWRITES))
def test_rewrite_preserves_the_function_or_is_refused(family, rewrite):
    model = tiny_model(FAMILIES[family], seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if (family, rewrite) in REFUSED:
        with pytest.raises(AttnidError, match=REFUSED[family, rewrite]):
            REWRITES[rewrite](model)
        return
    new = REWRITES[rewrite](model)
    a, b = function(model), function(new)
    rel = float((a - b).norm() / a.norm())
    assert rel < TOLERANCE[torch.float64], f"{family} {rewrite}: the function changed by {rel:.2e}"
    moved = max(float((new.state_dict()[k] - v).abs().max()) for k, v in before.items())
    assert moved > 1e-3, f"{family} {rewrite} did not move any parameter"
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items()), "input mutated"


def test_tied_rotation_with_a_uniform_final_gain_preserves_the_function():
    model = tiny_model(FAMILIES["llama-tied"], seed=0)
    with torch.no_grad():
        model.model.norm.weight.fill_(1.3)
    new = T.residual_rotation(model, random_orthogonal(8, gen(0)))
    rel = float((function(model) - function(new)).norm() / function(model).norm())
    assert rel < TOLERANCE[torch.float64], f"the function changed by {rel:.2e}"
    assert new.lm_head.weight is new.model.embed_tokens.weight, "the tie was broken"


@pytest.mark.parametrize("family", ["llama-gqa", "qwen2-bias-gqa", "gpt2-untied", "neox-parallel"])
def test_one_group_element_applied_at_once(family):
    """Every part at once (gains, rotation, head and neuron permutations, Q/K, V/O, MLP
    scales): the same function, and the tensor-level path gives the module path's tensors."""
    model = tiny_model(FAMILIES[family], seed=0)
    mt = T.ModelTensors.of(model)
    lay = mt.layout
    relu_or_gated = lay.mlp != "other"
    layers = tuple(T.LayerElement(
        heads=random_head_permutation(mt.spec(i), gen(i)), qk=random_commutant(mt.spec(i), gen(i)),
        vo=_values(model, i, i), neurons=_neurons(model, i, i),
        mlp=_scales(model, i, i).abs() if relu_or_gated else None) for i in range(len(lay.layers)))
    gains = {nm.path: torch.exp(torch.randn(8, generator=gen(7), dtype=torch.float64))
             for nm in lay.norms if nm.absorb is None and nm.gain}
    g = T.GroupElement(rotation=_rotation(model, "random", 2), gains=gains, layers=layers)
    new = T.apply_element(model, g)
    rel = float((function(model) - function(new)).norm() / function(model).norm())
    assert rel < TOLERANCE[torch.float64], f"{family}: the function changed by {rel:.2e}"
    tensors = T.apply_element(mt, g).tensors
    worst = max(float((tensors[k] - v).abs().max()) for k, v in new.state_dict().items())
    assert worst == 0.0, f"{family}: the tensor-level path differs from the module path by {worst:.2e}"


@pytest.mark.parametrize("family", ["qwen2-bias-gqa", "qwen3-qk-norm", "gpt2-untied", "falcon-parallel-bias"])
def test_a_layer_element_carries_the_whole_attention_gauge(family):
    """A LayerElement is an attention Gauge plus permutations and MLP scales: every piece the
    layer has (Q/K, V/O, key-bias and value-bias shifts, QK-norm gain transfer) drawn at once by
    `random_gauge` and applied through `apply_element` keeps the function."""
    from dataclasses import fields

    from attnid.symmetry.gauge import Gauge, apply_gauge, random_gauge
    from attnid.weights import NAMES

    model = tiny_model(FAMILIES[family], seed=0)
    mt = T.ModelTensors.of(model)
    gauges = [random_gauge(mt.attention(i), seed=i) for i in range(len(mt.layout.layers))]
    layers = tuple(T.LayerElement(**{f.name: getattr(g, f.name) for f in fields(Gauge)}) for g in gauges)
    drawn = {f.name for g in gauges for f in fields(Gauge) if getattr(g, f.name) is not None}
    assert drawn - {"qk", "vo"}, f"{family}: random_gauge drew no shift or norm scale ({drawn})"
    new = T.apply_element(model, T.GroupElement(layers=layers))
    rel = float((function(model) - function(new)).norm() / function(model).norm())
    assert rel < TOLERANCE[torch.float64], f"{family} ({sorted(drawn)}): the function changed by {rel:.2e}"
    after = T.ModelTensors.of(new)
    for i, g in enumerate(gauges):  # each layer's tensors are the per-layer gauge's
        want, got = apply_gauge(mt.attention(i), g), after.attention(i)
        for name in NAMES:
            a, b = getattr(want, name, None), getattr(got, name, None)
            if a is None:
                continue
            err = float((a - b).norm() / a.norm().clamp_min(1e-300))
            assert err < 1e-12, f"{family} layer {i} {name}: {err:.2e} from apply_gauge's"


def test_a_key_bias_shift_alone_on_a_float32_model():
    """``kappa`` without ``qk`` (dropped before the element carried it) and ``nu``, on a float32
    GPT-2 (no RoPE: every key dim passes through): the pieces are cast, applied and exact."""
    from attnid.symmetry.gauge import Gauge

    model = tiny_model(FAMILIES["gpt2-untied"], seed=0).float()
    mt = T.ModelTensors.of(model)
    s = mt.spec(0)
    kappa = torch.randn(s.n_kv_heads, s.head_dim, generator=gen(3), dtype=torch.float64)
    nu = torch.randn(s.n_kv_heads, s.v_head_dim, generator=gen(4), dtype=torch.float64)
    new = T.apply_element(model, T.GroupElement(layers=(T.LayerElement(kappa=kappa, nu=nu),)))
    before, after = mt.attention(0), T.ModelTensors.of(new).attention(0)
    moved = float((after.b_K - before.b_K).abs().max())
    assert abs(moved - float(kappa.abs().max())) < 1e-5, f"the key bias moved by {moved}, not by kappa"
    ids = torch.randint(0, model.config.vocab_size, (2, 4), generator=gen(5))
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, new(input_ids=ids).logits
    rel = float((a - b).norm() / a.norm())
    assert rel < TOLERANCE[torch.float32], f"the function changed by {rel:.2e}"
    scales = Gauge(c_q=2 * torch.ones(s.n_heads), c_k=torch.ones(s.n_kv_heads))  # QK-norm's, without one
    with pytest.raises(AttnidError, match="not a symmetry"):
        T.attention_gauge(model, 0, scales)


@pytest.mark.parametrize("name,piece", [
    ("kappa-without-a-key-bias", lambda s: {"kappa": torch.ones(s.n_kv_heads, s.head_dim)}),
    ("kappa-on-rotated-dims", lambda s: {"kappa": torch.ones(s.n_kv_heads, s.head_dim)}),
    ("log_t-without-qk-norm", lambda s: {"log_t": torch.zeros(s.head_dim)}),
    ("c_q-without-c_k", lambda s: {"c_q": torch.ones(s.n_heads)}),
])
def test_an_attention_gauge_that_is_no_symmetry_is_refused(name, piece):
    from attnid.symmetry.gauge import Gauge

    family = "qwen2-bias-gqa" if name == "kappa-on-rotated-dims" else "llama-gqa"
    model = tiny_model(FAMILIES[family], seed=0)
    g = Gauge(**piece(T.ModelTensors.of(model).spec(0)))
    with pytest.raises(AttnidError, match="layer 0"):
        T.attention_gauge(model, 0, g)


REFUSED_INPUT = {
    "not-orthogonal": lambda m: T.residual_rotation(m, 2 * torch.eye(8, dtype=torch.float64)),
    "qk-off-the-commutant": lambda m: T.query_key_transform(
        m, 0, torch.eye(2, dtype=torch.float64).repeat(2, 1, 1) + torch.tensor([[0.0, 0.3], [0.0, 0.0]])),
    "values-singular": lambda m: T.value_transform(m, 0, torch.zeros(2, 2, 2, dtype=torch.float64)),
    "heads-split-a-group": lambda m: T.head_permutation(m, 0, torch.tensor([0, 2, 1, 3])),
    "neurons-not-a-permutation": lambda m: T.neuron_permutation(m, 0, torch.zeros(6, dtype=torch.long)),
    "zero-scale": lambda m: T.mlp_scaling(m, 0, torch.zeros(6, dtype=torch.float64)),
}


@pytest.mark.parametrize("name", list(REFUSED_INPUT))
def test_what_is_no_group_element_is_refused(name):
    with pytest.raises(AttnidError):
        REFUSED_INPUT[name](tiny_model(FAMILIES["llama-gqa"], seed=0))


def test_hadamard_sizes():
    for n in (1, 2, 12, 20, 28, 36, 64, 768, 896):
        H = T.hadamard(n)
        assert float((H @ H.T - torch.eye(n, dtype=torch.float64)).abs().max()) < 1e-12, n
        assert torch.equal((H * n**0.5).abs().round(), torch.ones(n, n, dtype=torch.float64)), n
    with pytest.raises(AttnidError, match="no Hadamard matrix of order 77"):
        T.hadamard(77)
    Q = fixing_ones(T.hadamard(12))
    ones = torch.ones(12, dtype=torch.float64)
    assert float((Q @ ones - ones).abs().max()) < 1e-12
    assert float((Q.T @ Q - torch.eye(12, dtype=torch.float64)).abs().max()) < 1e-12


def test_a_transform_never_acts_on_half_of_what_it_changes():
    """A checkpoint is rewritten one unit at a time: a unit holding a norm's readers but not the
    norm is refused (folding would be wrong), a unit without them is left alone."""
    mt = T.ModelTensors.of(tiny_model(FAMILIES["llama-gqa"], seed=0))
    layer0 = {k: v for k, v in mt.tensors.items() if k.startswith("model.layers.0.")}
    part = T.ModelTensors(mt.layout, layer0, mt.config)
    folded = T.fold_norm_gains(part)
    gain = folded.tensors["model.layers.0.input_layernorm.weight"]
    assert torch.equal(gain, torch.ones(8, dtype=torch.float64)), gain
    assert "model.layers.1.input_layernorm.weight" not in folded.tensors
    half = {k: v for k, v in layer0.items() if k != "model.layers.0.input_layernorm.weight"}
    with pytest.raises(AttnidError, match=r"input_layernorm\.weight is missing"):
        T.fold_norm_gains(T.ModelTensors(mt.layout, half, mt.config))


@pytest.mark.parametrize("n", [1, 2, 12, 20, 28, 64, 128, 768, 896, 4096, 5120])
def test_hadamard_applied_by_its_kronecker_factors(n):
    """R1 = Hadamard is applied factor by factor (`kron_right`): the same product as with the
    ``n x n`` matrix, to float64 rounding."""
    from attnid.whole.transforms.orthogonal import hadamard_factors, kron_right

    X = torch.randn(3, 5, n, generator=gen(n), dtype=torch.float64)
    fast, dense = kron_right(X, hadamard_factors(n), n**-0.5), X @ T.hadamard(n)
    err = float((fast - dense).norm() / dense.norm())
    assert err < 1e-14, f"n={n}: relative difference {err:.2e}"


def test_a_checked_rotation_changed_in_place_is_checked_again():
    """The residual rotation is checked once per tensor (a checkpoint is rotated unit by unit);
    changing it in place makes it a new rotation, checked again."""
    m = tiny_model(FAMILIES["llama-gqa"], seed=0)
    Q = T.hadamard(m.config.hidden_size)
    T.residual_rotation(m, Q)
    Q.mul_(2.0)
    with pytest.raises(AttnidError, match="orthogonal"):
        T.residual_rotation(m, Q)
