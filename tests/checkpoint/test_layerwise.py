"""The loss along a path run one decoder layer at a time (`attnid.whole.layerwise`, what
`attnid barrier` streams) is the whole model's loss at every point, for every causal family of
the catalogue: the same transformers forward, so the same numbers (relative 1e-12); in token
groups it sums to the same; a forward that fails raises its error and leaves no thread behind."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from attnid.testing.catalogue import WHOLE_CASES

SLIDING = dict(num_hidden_layers=2, use_sliding_window=True, sliding_window=2, max_window_layers=1)
CASES = {k: c for k, c in WHOLE_CASES.items()
         if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in c.get("architectures", []))}
CASES |= {  # a sliding-window layer beside a full one (the model builds its masks from layer_types)
    "qwen2-sliding": dict(WHOLE_CASES["qwen2-qkv-bias"], **SLIDING),
    "qwen3-sliding": dict(WHOLE_CASES["qwen3-qk-norm"], **SLIDING)}
POINTS = [0.0, 0.3, 1.0]


def pair(config: dict, root: Path, dtype: torch.dtype = torch.float32):
    """Two checkpoints of one tiny architecture stored in ``dtype`` (B: A moved off by noise),
    their units, and their float32 models."""
    from attnid.checkpoint.load import open_checkpoint
    from attnid.checkpoint.units import open_units
    from attnid.testing.models import tiny_model

    out = []
    for k in range(2):
        m = tiny_model(config).to(dtype)
        if k:
            g = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(0.1 * torch.randn(p.shape, generator=g))
        m.save_pretrained(root / f"m{k}")
        out.append((open_units(open_checkpoint(root / f"m{k}")), m.float()))
    return out


def data(config: dict, n: int = 5, batch: int = 2):
    from attnid.checkpoint.tokens import Batches

    T = min(6, config.get("n_positions") or config.get("max_position_embeddings") or 16)
    return Batches(torch.randint(0, config["vocab_size"], (n, T), generator=torch.Generator().manual_seed(0)),
                   batch=batch)


def assert_no_thread_left(before: set) -> None:
    """Every thread started since ``before`` ends (each is given 5 s)."""
    new = [t for t in threading.enumerate() if t not in before]
    for t in new:
        t.join(timeout=5)
    alive = [t.name for t in new if t.is_alive()]
    assert not alive, f"threads left running: {alive}"


def losses(lm, a, b, batches, progress=None):
    """The summed loss at each of POINTS on the path from ``a`` to ``b``, streamed."""
    from attnid.checkpoint.evaluate import TokenLoss, batch_nll
    from attnid.whole.layerwise import Segment

    parts = lm.run(Segment(a, b), POINTS, batches.ids, batches.batch, batch_nll, progress)
    return [TokenLoss(sum(x.total for x in row), sum(x.count for x in row)) for row in parts]


def whole_losses(ua, ma, mb, batches, points) -> list[float]:
    """Each point's loss by the whole float32 model `attnid eval` runs, its weights
    ``(1 - t) A + t B``."""
    from attnid.checkpoint.evaluate import load_causal_lm, token_nll

    sa, sb = ma.state_dict(), mb.state_dict()
    out = []
    for t in points:
        m = load_causal_lm(ua.ck)
        m.load_state_dict({k: (1 - t) * v + t * sb[k] if v.is_floating_point() else v for k, v in sa.items()})
        out.append(token_nll(m, batches).mean)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_path_is_the_whole_model(case, tmp_path):
    from attnid.whole.layerwise import LayerwiseLM

    config = CASES[case]
    (ua, ma), (ub, mb) = pair(config, tmp_path)
    batches = data(config)
    want = whole_losses(ua, ma, mb, batches, POINTS)
    got = [x.mean for x in losses(LayerwiseLM(ua), ua, ub, batches)]
    rel = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
    assert rel <= 1e-12, f"{case}: streamed {got} vs whole {want}: relative {rel:.3g}"
    assert len(set(want)) == len(want), f"{case}: the points should differ: {want}"


def test_token_groups_sum_to_the_same(tmp_path, monkeypatch):
    """Hidden states over the budget: each chunk its own group, each group streaming the layers."""
    from attnid.whole import layerwise
    from attnid.whole.layerwise import LayerwiseLM

    config = WHOLE_CASES["llama-gqa-2layers"]
    (ua, _), (ub, _) = pair(config, tmp_path)
    batches = data(config, n=7, batch=1)  # the same forwards either way (float32 depends on the batch)
    one = losses(LayerwiseLM(ua), ua, ub, batches)
    monkeypatch.setattr(layerwise, "HIDDEN_BUDGET", 1)
    lines: list[str] = []
    many = losses(LayerwiseLM(ua), ua, ub, batches, lines.append)
    assert [x.count for x in one] == [x.count for x in many] == [7 * 5] * 3
    rel = max(abs(x.total - y.total) / abs(x.total) for x, y in zip(one, many, strict=True))
    assert rel <= 1e-12, f"groups {many} vs one {one}: relative {rel:.3g}"
    assert sum(line.startswith("chunks ") for line in lines) == 7, lines  # a chunk a group


def test_a_failing_layer_raises_and_leaves_no_thread(tmp_path, monkeypatch):
    from attnid.whole.layerwise import LayerwiseLM

    config = WHOLE_CASES["llama-gqa-2layers"]
    (ua, _), (ub, _) = pair(config, tmp_path)
    lm = LayerwiseLM(ua)
    before = set(threading.enumerate())

    def broken(*args, **kwargs):
        raise RuntimeError("layer 1 broke")

    monkeypatch.setattr(lm.layers[1], "forward", broken)
    with pytest.raises(RuntimeError, match="layer 1 broke"):
        losses(lm, ua, ub, data(config))
    assert_no_thread_left(before)


def test_a_model_in_memory_is_read_like_its_checkpoint(tmp_path):
    """`TensorSource` (what `benchmarks/merge.py` aligns in memory) gives the checkpoint's losses."""
    from attnid.checkpoint.align import load_tensors
    from attnid.whole.fit.source import TensorSource
    from attnid.whole.layerwise import LayerwiseLM

    config = WHOLE_CASES["gpt2-tied"]
    (ua, _), (ub, _) = pair(config, tmp_path)
    batches = data(config)
    files = losses(LayerwiseLM(ua), ua, ub, batches)
    a, b = (TensorSource(load_tensors(u, torch.float32)) for u in (ua, ub))
    memory = losses(LayerwiseLM(a), a, b, batches)
    assert [x.total for x in files] == [x.total for x in memory], (files, memory)


def test_bfloat16_checkpoints_interpolated_a_block_at_a_time(tmp_path, monkeypatch):
    """Stored bfloat16, B converted to float32 a few elements at a time (block edges inside
    every tensor): the whole float32 model's loss at every point."""
    from attnid.whole import layerwise

    config = WHOLE_CASES["llama-gqa-2layers"]
    (ua, ma), (ub, mb) = pair(config, tmp_path, torch.bfloat16)
    batches = data(config)
    monkeypatch.setattr(layerwise, "STEP", 7)
    got = [x.mean for x in losses(layerwise.LayerwiseLM(ua), ua, ub, batches)]
    want = whole_losses(ua, ma, mb, batches, POINTS)
    rel = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
    assert rel <= 1e-12, f"streamed {got} vs whole {want}: relative {rel:.3g}"


def test_a_nan_weight_stops_the_run_and_leaves_no_thread(tmp_path):
    """The driver's own refusal (a NaN met in layer 1, after layer 0 ran) ends every forward."""
    from attnid.checkpoint.align import load_tensors
    from attnid.errors import AttnidError
    from attnid.whole.fit.source import TensorSource
    from attnid.whole.layerwise import LayerwiseLM
    from attnid.whole.transforms.state import ModelTensors

    config = WHOLE_CASES["llama-gqa-2layers"]
    (ua, _), (ub, _) = pair(config, tmp_path)
    a = TensorSource(load_tensors(ua, torch.float32))
    bad = dict(load_tensors(ub, torch.float32).tensors)
    bad["model.layers.1.mlp.up_proj.weight"] = bad["model.layers.1.mlp.up_proj.weight"].clone()
    bad["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    b = TensorSource(ModelTensors(a.layout, bad, a.config))
    before = set(threading.enumerate())
    with pytest.raises(AttnidError, match=r"model\.layers\.1\.mlp\.up_proj\.weight holds NaN"):
        losses(LayerwiseLM(a), a, b, data(config))
    assert_no_thread_left(before)


def test_forwards_in_flight_are_capped(tmp_path, monkeypatch):
    """At most MAX_GATES forwards (threads) at once, unless the points alone are more."""
    from attnid.checkpoint.evaluate import batch_nll
    from attnid.whole import layerwise

    config = WHOLE_CASES["llama-gqa-2layers"]
    (ua, _), (ub, _) = pair(config, tmp_path)
    monkeypatch.setattr(layerwise, "MAX_GATES", 4)
    base, most = threading.active_count(), []

    def counted(model, x):
        most.append(threading.active_count() - base)
        return batch_nll(model, x)

    lm = layerwise.LayerwiseLM(ua)
    lm.run(layerwise.Segment(ua, ub), POINTS, data(config, n=7, batch=1).ids, 1, counted)
    assert len(most) == 3 * 7 and max(most) <= 3, most  # 4 // 3 points: a batch a group
