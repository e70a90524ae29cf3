"""Sharded training runs for the slow tests (test_sharded.py): the Monitor, the Corrector and the
Trainer callback on a tiny Hugging Face Llama, sharded over the processes of a torchrun launch
(gloo, CPU), and the same runs in one process as the reference.

    torchrun --nproc-per-node 2 tests/integrations/sharded.py OUT CASE [CASE ...]

Each case writes ``OUT/<case>.rank<r>.json`` on every rank: the Monitor's record of every step
(``Monitor.last``). Every rank trains on the same batch, so a sharded run must report what the
one-process run (:func:`run` with ``world=1``) reports. ``trainer-fsdp2`` and
``trainer-zero3`` run ``Trainer`` (FSDP2, DeepSpeed ZeRO-3) with the callback (its jsonl in
``OUT/<case>/``); their batches are split between the ranks
as Trainer splits them, and its one-process equivalent (:func:`run_trainer` with ``world=1``)
takes both halves in one batch.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import torch
import transformers

from attnid.monitor import Corrector, Monitor
from attnid.testing import TINY_LLAMA, random_hf_model

STEPS = 3
EPS = 1e-3  # AdamW's eps: large enough that its step is smooth in the gradient (see run)
CASES = ("fsdp2", "fsdp2-before", "fsdp2-project", "fsdp2-rebalance", "fsdp1", "fsdp1-before", "ddp",
         "trainer-fsdp2")
ZERO3 = ("zero3", "zero3-project", "zero3-persistent-project", "zero3-rebalance2", "zero2-rebalance2",
         "trainer-zero3")  # need deepspeed


def tiny_llama() -> transformers.LlamaForCausalLM:
    return random_hf_model(TINY_LLAMA, seed=0)


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(step))


def _fsdp2(model) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def _fsdp1(model):
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={type(model.model.layers[0])})
    return FullyShardedDataParallel(model, use_orig_params=True, auto_wrap_policy=policy,
                                    device_id=torch.device("cpu"))


def run(case: str, world: int) -> list[dict]:
    """The Monitor's records of ``STEPS`` AdamW steps (``world=1``: no sharding, the reference)."""
    before = case.endswith("-before")
    correction = {"project": "project", "rebalance": "rebalance", "rebalance2": "rebalance:2"}.get(
        case.split("-")[-1], "off")
    if case.startswith(("zero3", "zero2")):
        return _run_zero(int(case[4]), correction, persistent="-persistent" in case)
    model = tiny_llama()
    if before:
        monitor, corrector = Monitor(model), Corrector(model, correction)
    wrapped = model
    if world > 1 and case.startswith("fsdp2"):
        _fsdp2(model)
    elif world > 1 and case.startswith("fsdp1"):
        wrapped = _fsdp1(model)
    elif world > 1 and case == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    if not before:  # built on what the user holds: the FSDP1 or DDP wrapper
        monitor, corrector = Monitor(wrapped), Corrector(wrapped, correction)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, weight_decay=0.1, eps=EPS)
    records = []
    for step in range(STEPS):
        ids = batch(step)
        loss = wrapped(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        with monitor.step(), corrector.step():
            opt.step()
        records.append({**monitor.last.to_dict(), "loss": loss.item()})
    return records


def _run_zero(stage: int, correction: str, persistent: bool) -> list[dict]:
    """DeepSpeed ZeRO-``stage`` (3: parameters partitioned; 2: whole, the optimizer's float32
    copy partitioned). ZeRO-3's AdamW steps differ from torch's in one process beyond rounding (its gradients
    are scaled differently), so the reference is DeepSpeed's own view of the same weights: an
    unsharded twin that gets them, gathered by ``deepspeed.zero.GatheredParameters``, before
    and after each step and is measured by its own Monitor (``reference`` in each record).
    ``persistent``: DeepSpeed's default keeps small parameters (all of this model's) whole on
    every process besides their partition; otherwise every parameter is only partitioned."""
    import deepspeed

    model = tiny_llama()
    monitor, corrector = Monitor(model), Corrector(model, correction)  # before ZeRO-3 partitions
    zero = {"stage": stage}
    if stage == 3 and not persistent:
        zero["stage3_param_persistence_threshold"] = 0
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero,
              "optimizer": {"type": "AdamW",
                            "params": {"lr": 1e-2, "weight_decay": 0.1, "eps": EPS, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    twin = tiny_llama()
    twin_monitor = Monitor(twin)

    def to_twin() -> None:
        with deepspeed.zero.GatheredParameters(list(model.parameters())), torch.no_grad():
            for p, q in zip(model.parameters(), twin.parameters(), strict=True):
                q.copy_(p)

    records = []
    for step in range(STEPS):
        ids = batch(step)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        to_twin()
        twin_monitor.begin()
        with monitor.step(), corrector.step():
            engine.step()
        to_twin()
        records.append({**monitor.last.to_dict(), "loss": loss.item(),
                        "reference": twin_monitor.end().to_dict()})
    return records


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(100 + i))
        return {"input_ids": ids, "labels": ids}


SHARDING = {  # Trainer arguments
    "fsdp2": {"fsdp": True, "fsdp_config": {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}},
    "zero3": {"deepspeed": {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                            "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 3}}},
}


def run_trainer(out: Path, world: int, sharding: str = "fsdp2") -> str:
    """Trainer (sharded by FSDP2 through accelerate, or DeepSpeed ZeRO-3, when ``world > 1``)
    with the callback, writing ``out/attnid_metrics.jsonl``; returns the class of the trained
    attention weights and whether DeepSpeed partitioned them."""
    from attnid.integrations.transformers import AttnidCallback

    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=8 // world, logging_steps=1,
        learning_rate=1e-2, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
        **(SHARDING[sharding] if world > 1 else {}))
    trainer = transformers.Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(),
                                   callbacks=[AttnidCallback()])
    if world > 1 and sharding == "fsdp2":
        fsdp_on_cpu(trainer)
    trainer.train()
    w = trainer.model.model.layers[0].self_attn.q_proj.weight
    return type(w).__name__ + (" partitioned" if hasattr(w, "ds_id") else "")


def fsdp_on_cpu(trainer) -> None:
    """accelerate turns FSDP on only on accelerators (on CPU it quietly runs DDP): switch the
    Trainer's accelerator state to FSDP, so that accelerate's own FSDP2 preparation runs."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    state.distributed_type = DistributedType.FSDP
    trainer.is_fsdp_enabled = True


def main(out: Path, cases: list[str]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for case in cases:
        if case.startswith("trainer-"):
            records = [{"weights": run_trainer(out / case, dist.get_world_size(), case.split("-")[1])}]
        else:
            records = run(case, dist.get_world_size())
        (out / f"{case}.rank{rank}.json").write_text(json.dumps(records))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(Path(sys.argv[1]), sys.argv[2:])
