"""Cost of a monitored (and of a projected) step under FSDP2 sharding, against the same step unsharded.

    torchrun --nproc-per-node 2 benchmarks/sharded.py [--layers 8] [--d-model 512] [--heads 8]
                                                      [--batch 4] [--seq 128] [--repeats 3]

Every process builds the same random Llama (float32) twice: one copy sharded by FSDP2
(``fully_shard`` per decoder layer and at the root), one left whole, and trains both with AdamW
on the same tokens. Timed around each optimizer step, as the Trainer callback runs it:
``Monitor.begin()`` + ``Monitor.end()`` (rho, beta, ... for every layer), and separately the
``Corrector("project")`` hooks. Sharded, every layer is gathered whole (twice: before and after
the step) and measured alone, never the whole model at once; whole, the layers of one spec are
stacked and measured in one batch. Reported (rank 0, medians over the repeats): seconds of
the training step and of each hook, sharded and whole, and the ratio sharded / whole. Both
processes run at once on the same machine, so on a 2-core CPU each has one core.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {sharded: measure(a, sharded) for sharded in (False, True)}
    if dist.get_rank() == 0:
        print(f"Llama {a.layers} layers, d={a.d_model}, {a.heads} heads, batch {a.batch} x {a.seq}, "
              f"{dist.get_world_size()} processes, torch threads {torch.get_num_threads()}")
        for what in ("step", "monitor", "project"):
            whole, shard = results[False][what], results[True][what]
            print(f"{what:8s} whole {whole:.3f}s   FSDP2 {shard:.3f}s   ratio {shard / whole:.2f}")
        for sharded in (False, True):
            r = results[sharded]
            print(f"{'FSDP2' if sharded else 'whole'}: monitored step costs {r['monitor'] / r['step']:.1%} "
                  f"of a training step, projection {r['project'] / r['step']:.1%}")
    dist.destroy_process_group()


def measure(a, sharded: bool) -> dict[str, float]:
    """Median seconds of the training step (forward, backward, AdamW) and of each hook."""
    import transformers

    from attnid.monitor import Corrector, Monitor

    conf = transformers.LlamaConfig(hidden_size=a.d_model, num_attention_heads=a.heads,
                                    num_key_value_heads=a.heads, num_hidden_layers=a.layers,
                                    intermediate_size=2 * a.d_model, vocab_size=1024)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(conf)
    if sharded:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    monitor, corrector = Monitor(model), Corrector(model, "project")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 1024, (a.batch, a.seq), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {"step": [], "monitor": [], "project": []}
    for i in range(a.repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        t1 = time.perf_counter()
        monitor.begin()
        t2 = time.perf_counter()
        with corrector.step():
            t3 = time.perf_counter()
            opt.step()
            t4 = time.perf_counter()
        t5 = time.perf_counter()
        monitor.end()
        t6 = time.perf_counter()
        if i:  # the first step warms up
            times["step"].append((t1 - t0) + (t4 - t3))
            times["monitor"].append((t2 - t1) + (t6 - t5))
            times["project"].append((t3 - t2) + (t5 - t4))
    return {k: statistics.median(v) for k, v in times.items()}


if __name__ == "__main__":
    main()
