"""The whole-model fit behind `attnid diff` (`attnid.whole.fit.fit`), on Hugging Face's own
classes in float64: a random group element (every multiplicative part at once) is certified
and the fitted element maps B back onto A; every additive symmetry is certified; one changed
tensor is refused with that tensor named; the probed path (random stream directions) keeps
both properties; models that differ for real get distances whose shares say what the rotation
and the permutations explain."""

import pytest
import torch

pytest.importorskip("transformers")

from attnid.testing.catalogue import TRANSFORM_CASES as CASES_T
from attnid.testing.catalogue import TRANSFORM_FAMILIES as FAMILIES
from attnid.testing.models import random_element as element
from attnid.whole import transforms as T
from attnid.whole.check import tiny_model
from attnid.whole.fit import TensorSource, fit
from attnid.whole.transforms.orthogonal import (
    random_orthogonal,
    random_rotation_fixing_ones,
)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def residuals(f):
    return [x for r in f.units for x in r.residuals]


def worst(f):
    return max(residuals(f), key=lambda x: x.residual)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_random_element_is_fitted_exactly(family):
    A = tiny_model(FAMILIES[family], seed=0)
    B = T.apply_element(A, element(A))
    f = fit(TensorSource(A), TensorSource(B))
    w = worst(f)
    assert w.residual <= f.tolerance, f"{family}: {w}"
    back = T.apply_element(T.ModelTensors.of(B), f.element).tensors
    err = max(float((back[k] - v).norm() / v.norm().clamp_min(1e-30))
              for k, v in A.state_dict().items() if v.is_floating_point())
    assert err < 1e-12, f"{family}: the fitted element maps B onto A up to {err:.1e}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_vocabulary_narrower_than_the_stream(family):
    """A character-level vocabulary (4 tokens, width 8): the table rows span too few directions
    to fix the residual rotation, which layer 0's MLP rows complete (the merging benchmark's
    models were refused before)."""
    config = {k: v for k, v in FAMILIES[family].items() if not k.endswith("token_id")}
    pad = FAMILIES[family].get("pad_token_id")
    A = tiny_model(dict(config, vocab_size=4, pad_token_id=pad if pad is not None and pad < 4 else 0), seed=0)
    el = element(A)
    B = T.apply_element(A, el)
    f = fit(TensorSource(A), TensorSource(B))
    w = worst(f)
    assert w.residual <= f.tolerance, f"{family}: {w} (rotation {f.rotation})"
    if el.rotation is not None:
        assert "completed with layer 0's MLP rows" in f.rotation, f"{family}: {f.rotation}"


@pytest.mark.parametrize("name", list(CASES_T))
def test_every_symmetry_is_certified(name):
    config, transform = CASES_T[name]
    A = tiny_model(config, seed=0)
    f = fit(TensorSource(A), TensorSource(transform(A)))
    assert worst(f).residual <= f.tolerance, f"{name}: {worst(f)}"


BLAME = ["llama-gqa", "qwen2-bias-gqa", "gpt2-untied", "phi3", "falcon-new-decoder"]


@pytest.mark.parametrize("family", BLAME)
def test_one_changed_tensor_is_named(family):
    """Each stored tensor, nudged alone by 1e-3 of its size: refused, that tensor blamed."""
    A = tiny_model(FAMILIES[family], seed=0)
    mt = T.ModelTensors.of(A)
    wrong = []
    for k, v in A.state_dict().items():
        if k == f"{mt.layout.unembed.path}.weight" and mt.layout.tied:
            continue
        t = v + 1e-3 * v.abs().mean().clamp_min(1e-3) * torch.randn(v.shape, generator=gen(1), dtype=v.dtype)
        f = fit(TensorSource(A), TensorSource(mt.replace({k: t})))
        first = next((x for x in residuals(f) if x.residual > f.tolerance), None)
        if first is None or first.tensor != k:
            wrong.append((k, None if first is None else first.tensor))
    assert not wrong, f"{family}: (changed, blamed): {wrong}"


@pytest.mark.parametrize("family", ["llama-gqa", "gpt2-untied", "neox-parallel"])
def test_probed(family):
    """Through 4 random stream directions (width 8): the same verdicts."""
    A = tiny_model(FAMILIES[family], seed=0)
    f = fit(TensorSource(A), TensorSource(T.apply_element(A, element(A))), probe_k=4)
    assert f.probes == 4 and worst(f).residual <= f.tolerance, worst(f)
    mt = T.ModelTensors.of(A)
    name = f"{mt.layout.mlps[1][1].path}.weight"
    nudged = mt.replace({name: mt.tensors[name] * 1.01})
    f = fit(TensorSource(A), TensorSource(nudged), probe_k=4)
    first = next(x for x in residuals(f) if x.residual > f.tolerance)
    assert first.tensor == name, first


@pytest.mark.parametrize("family", ["llama-gqa", "gpt2-untied", "neox-parallel"])
def test_probed_rotation_is_fitted_through_the_probes(family):
    """Through probes, the rotation is the least-squares map through them (no d x d
    decomposition), its ``Q^T Q = I`` residual is certified with the rest, and the element's
    matrix (fitted on demand) still maps B onto A; a stream map that is no rotation (one
    direction stretched by 5%) is refused."""

    A = tiny_model(FAMILIES[family], seed=0)
    el = element(A)
    f = fit(TensorSource(A), TensorSource(T.apply_element(A, el)), probe_k=4)
    assert f.rotation.endswith("(least squares through the probes)"), f.rotation
    orth = [x for x in residuals(f) if x.invariant == "rotation Q^T Q = I"]
    assert len(orth) == 1 and orth[0].residual <= f.tolerance / 2, orth
    assert worst(f).residual <= f.tolerance, worst(f)
    err = float((f.element.rotation - el.rotation.T).norm())
    assert err < 1e-10, f"{family}: the fitted rotation is {err:.1e} from the rewrite's"
    d = el.rotation.shape[0]
    u = torch.randn(d, 1, generator=gen(4), dtype=torch.float64)
    if family != "llama-gqa":  # LayerNorm: stretch a direction orthogonal to all-ones
        u = u - u.mean()
    S = torch.eye(d, dtype=torch.float64) + 0.05 * u @ u.T / (u.T @ u)
    mt = T.ModelTensors.of(T.apply_element(A, el))
    lay = mt.layout
    rows = [f"{lay.tables[0]}.weight", *([] if lay.tied else [f"{lay.unembed.path}.weight"])]
    B = mt.replace({n: mt.tensors[n] @ S for n in rows})  # the stream's rows stretched, not rotated
    f = fit(TensorSource(A), TensorSource(B), probe_k=4)
    assert worst(f).residual > f.tolerance, f"{family}: a stretched stream was certified ({f.rotation})"


def test_probed_distances_estimate_the_exact_ones():
    """Width 640 through 256 probes (64 for the unrotated pass, whose distance only the rotation's
    share uses): B = A rotated, permuted and moved off its orbit; each layer's distances through
    the probes are within 25% of the exact ones (``--probes`` at the full width)."""
    config = dict(FAMILIES["llama-gqa"], hidden_size=640, intermediate_size=64, vocab_size=1536,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    A = tiny_model(config, seed=0)
    g = element(A)
    B = T.ModelTensors.of(T.apply_element(A, T.GroupElement(rotation=g.rotation, layers=tuple(
        T.LayerElement(heads=le.heads, neurons=le.neurons) for le in g.layers))))
    noise = {k: v + 0.3 * v.std() * torch.randn(v.shape, generator=gen(5), dtype=v.dtype)
             for k, v in B.tensors.items() if ".layers." in k and v.ndim == 2}
    exact = fit(TensorSource(A), TensorSource(B.replace(noise)), probe_k=640)
    probed = fit(TensorSource(A), TensorSource(B.replace(noise)), probe_k=256)
    assert exact.probes is None and probed.probes == 256
    for u in (1, 2):
        for stage in ("fixed", "rotated", "aligned"):
            e, p = (f.units[u].distances[stage] ** 0.5 for f in (exact, probed))
            assert abs(p / e - 1) < 0.25, f"layer {u - 1} {stage}: probed {p:.3g} vs exact {e:.3g}"


@pytest.mark.parametrize("sides", [1, 2])
@pytest.mark.parametrize("rank", [1, 4])
@pytest.mark.parametrize("k,factor", [(8, 3.0), (16, 2.0)])
def test_the_probe_bound_holds(sides, rank, k, factor):
    """`accept_bound` (docs/theory.md §13.19) against the rate at which ``k`` random probes
    shrink a difference ``D`` (rank 1 or 4, one side ``D Z`` or both ``Z^T D Z``) by ``factor``
    or more, over 20000 draws."""
    from attnid.whole.fit.frame import accept_bound

    d, n = 32, 20000
    g = gen(rank * 10 + sides)
    f64 = torch.float64
    D = torch.randn(d, rank, generator=g, dtype=f64) @ torch.randn(rank, d, generator=g, dtype=f64)
    Z = torch.randn(n, d, k, generator=g, dtype=torch.float64) / k**0.5
    DZ = D @ Z
    seen = (Z.mT @ DZ if sides == 2 else DZ).flatten(1).norm(dim=1) / D.norm()
    rate = float((seen <= 1 / factor).double().mean())
    bound = accept_bound(k, factor)
    assert 0 < bound < 1 and rate <= bound + 3 * (bound / n) ** 0.5, (rate, bound)


def test_shares_of_a_model_that_differs_for_real():
    """B: A rotated and permuted, then moved off the orbit a little: the rotation and the
    permutations explain most of the raw difference, the aligned distance is the move."""
    A = tiny_model(dict(FAMILIES["llama-gqa"], intermediate_size=16), seed=0)
    g = element(A)
    g = T.GroupElement(rotation=g.rotation, layers=tuple(
        T.LayerElement(heads=le.heads, neurons=le.neurons) for le in g.layers))
    B = T.ModelTensors.of(T.apply_element(A, g))
    noise = {k: v + 1e-3 * torch.randn(v.shape, generator=gen(5), dtype=v.dtype)
             for k, v in B.tensors.items() if k.startswith("model.layers.0.") and v.ndim == 2}
    f = fit(TensorSource(A), TensorSource(B.replace(noise)))
    u = f.units[1]  # layer 0
    d = u.distances
    assert worst(f).residual > f.tolerance
    rotation = (d["fixed"] - d["rotated"]) / d["fixed"]
    permutation = (d["rotated"] - d["permuted"]) / d["fixed"]
    assert rotation + permutation > 0.9 and permutation > 0.05, (rotation, permutation)
    moved = sum(float((t - B.tensors[k]).norm()) ** 2 for k, t in noise.items()) ** 0.5
    assert 0.2 * moved < d["aligned"] ** 0.5 < 5 * moved, (d["aligned"] ** 0.5, moved)


def test_two_unrelated_models_need_a_real_assignment():
    """Different seeds: nearest neighbours clash, linear assignment decides; each fitted part
    brings B closer (the rotation is fitted on the tables, so a layer may not follow it), and
    nothing is certified."""
    A, B = (tiny_model(dict(FAMILIES["llama-gqa"], intermediate_size=16), seed=s) for s in (0, 1))
    f = fit(TensorSource(A), TensorSource(B))
    assert worst(f).residual > 0.1
    for u in f.units[1:-1]:
        d = u.distances
        assert d["rotated"] >= d["permuted"] - 1e-9 and d["permuted"] >= d["aligned"] - 1e-9, d
        assert sorted(u.element.neurons.tolist()) == list(range(16))


def test_a_rotated_post_ln_model_is_refused_at_its_token_table():
    """BERT's stream is a LayerNorm's output: a rotation is no symmetry; B built as one is
    refused at the word embeddings, with the reason (the default suite's twin of the real
    MiniLM case in tests/checkpoint/test_diff_catalogue.py)."""
    A = tiny_model(FAMILIES["bert"], seed=0)
    mt = T.ModelTensors.of(A)
    Q = random_rotation_fixing_ones(8, gen(0))
    rotated = {}
    for n, t in mt.tensors.items():
        table = n.startswith("bert.embeddings.") and n.endswith("embeddings.weight")
        if table or n.endswith(("query.weight", "key.weight", "value.weight", "intermediate.dense.weight",
                                "transform.dense.weight")):
            rotated[n] = t @ Q
        elif n.endswith(("output.dense.weight", "output.dense.bias", "LayerNorm.bias")):
            rotated[n] = Q.T @ t
    f = fit(TensorSource(A), TensorSource(mt.replace(rotated)))
    first = next(x for x in residuals(f) if x.residual > f.tolerance)
    assert first.tensor == "bert.embeddings.word_embeddings.weight", first
    assert "post-LN" in first.reason, first


@pytest.mark.parametrize("gain,centre", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("narrow", [False, True])
def test_probes_see_norms_unbiased_and_fold_gain_and_centring(gain, centre, narrow):
    """Through the probes (full or narrowed to 64), ``||X diag(g) P R||`` estimates ``||X
    diag(g) P||`` without bias (a narrowed frame is rescaled), and the gain and the centring
    folded into the probes give the same product as applied to ``X`` first."""
    from attnid.whole.fit.frame import Frame, probes

    d, k = 1024, 256
    X = torch.randn(2000, d, generator=gen(1), dtype=torch.float64)
    g = 0.5 + torch.rand(d, generator=gen(2), dtype=torch.float64) if gain else None
    f = Frame(probes(d, k, torch.float64), random_orthogonal(d, gen(3)), torch.float64)
    f = f.narrow() if narrow else f
    Y = X * (1 if g is None else g)
    Y = Y - Y.mean(-1, keepdim=True) if centre else Y
    folded = f.right(X, g, centre)
    err = float((folded - Y @ f.R).norm() / folded.norm())
    assert err < 1e-13, f"folding the gain/centring into the probes changed the product by {err:.2e}"
    ratio = float(folded.norm() ** 2 / Y.norm() ** 2)
    assert abs(ratio - 1) < 0.05, f"probed squared norm is {ratio:.3f} of the true one (k={f.R.shape[1]})"
    left = f.left(X.T, g, centre)
    err = float((left - f.R.T @ Y.T).norm() / left.norm())
    assert err < 1e-13, f"left: folding changed the product by {err:.2e}"


@pytest.mark.parametrize("family", ["llama-gqa", "gpt2-untied", "neox-parallel"])
def test_without_a_rotation_fitted(family):
    """``fit(rotate=False)`` (what `attnid align`'s certificate uses when its alignment rotated
    no stream) certifies an element without a stream rotation as tightly as the fitted path,
    and reports a stream-rotated B as broken: no rotation is fitted behind the caller's back."""
    from dataclasses import replace

    A = tiny_model(FAMILIES[family], seed=0)
    el = element(A)
    if el.rotation is None:
        pytest.skip(f"{family}: no stream rotation is a symmetry here")
    plain = T.apply_element(A, replace(el, rotation=None))
    f = fit(TensorSource(A), TensorSource(plain), rotate=False)
    assert worst(f).residual <= f.tolerance, f"{family}: {worst(f)}"
    assert f.stream is None and f.rotation.startswith("none")
    rotated = T.apply_element(A, el)
    assert worst(fit(TensorSource(A), TensorSource(rotated))).residual <= f.tolerance
    w = worst(fit(TensorSource(A), TensorSource(rotated), rotate=False)).residual
    assert w > 1e3 * f.tolerance, f"{family}: a rotated stream passed unrotated ({w:.1e})"
