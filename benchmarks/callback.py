"""Cost of `AttnidCallback` per monitored step at GPT-2-small shape, against the training step.

    python benchmarks/callback.py [--batch 4 8 8] [--seq 256 256 512] [--repeats 3]

A random GPT-2 small (12 layers, d = 768, 12 heads, vocabulary 50,257) in float32 takes
AdamW steps on random tokens; the callback's hooks (snapshot before, measure after:
rho, beta, drift for every layer) run around the optimizer step exactly as Trainer calls
them. Reported: median seconds of the training step (forward, backward, AdamW) and of the
callback's share, and their ratio (the target is at most 5%), for each batch shape: the
callback's cost does not depend on the batch (it reads the weights, not the activations), so
its share falls as the step grows.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from types import SimpleNamespace

import torch


def main() -> None:
    import transformers

    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, nargs="+", default=[4, 8, 8])
    p.add_argument("--seq", type=int, nargs="+", default=[256, 256, 512])
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    transformers.utils.logging.set_verbosity_error()
    print(f"GPT-2 small, torch threads {torch.get_num_threads()}")
    for batch, seq in zip(a.batch, a.seq, strict=True):
        step, hook = measure(batch, seq, a.repeats)
        print(f"batch {batch} x {seq} tokens: training step {step:.3f}s   callback (monitor every step) "
              f"{hook:.3f}s   overhead {hook / step:.1%}")


def measure(batch: int, seq: int, repeats: int) -> tuple[float, float]:
    """Median seconds of (forward + backward + AdamW) and of the callback's hooks."""
    import transformers

    from attnid.integrations.transformers import AttnidCallback

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config()).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 50257, (batch, seq), generator=torch.Generator().manual_seed(0))
    cb = AttnidCallback("off", path=False)
    with tempfile.TemporaryDirectory() as out:
        args = SimpleNamespace(output_dir=out)
        state = SimpleNamespace(global_step=0, is_world_process_zero=True, log_history=[])
        cb.on_train_begin(args, state, None, model=model)
        steps, hooks = [], []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            t1 = time.perf_counter()
            cb.on_pre_optimizer_step(args, state, None)
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            cb.on_optimizer_step(args, state, None)
            t4 = time.perf_counter()
            state.global_step += 1
            if i:  # the first step warms up
                steps.append((t1 - t0) + (t3 - t2))
                hooks.append((t2 - t1) + (t4 - t3))
    return statistics.median(steps), statistics.median(hooks)


if __name__ == "__main__":
    main()
