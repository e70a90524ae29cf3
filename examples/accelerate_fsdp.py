"""attnid's Monitor in a training loop prepared by accelerate with its FSDP plugin (FSDP2).

    torchrun --standalone --nproc-per-node 2 examples/accelerate_fsdp.py

``accelerator.prepare`` shards the model with FSDP2's ``fully_shard``; the Monitor, built on
the prepared model, gathers one layer at a time around each optimizer step. accelerate turns
FSDP on only on GPUs and other accelerators (on a CPU it quietly runs DDP): on a CPU-only
machine this script switches it on by hand, so that the same FSDP2 code path runs here.
"""


import time

import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

from attnid.monitor import Monitor
from attnid.stats import median

plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                        transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
cpu = not torch.cuda.is_available()
accelerator = Accelerator(fsdp_plugin=plugin, cpu=cpu)
if cpu:  # accelerate would run DDP here (see above)
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP

config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                  num_hidden_layers=2, intermediate_size=128, vocab_size=128)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
monitor = Monitor(model)

tokens = torch.Generator().manual_seed(accelerator.process_index)
step_s, monitor_s = [], []
for step in range(4):
    ids = torch.randint(0, 128, (4, 32), generator=tokens).to(accelerator.device)
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    t1 = time.perf_counter()
    monitor.begin()
    t2 = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad()
    t3 = time.perf_counter()
    last = monitor.end()
    t4 = time.perf_counter()
    step_s.append(t1 - t0 + t3 - t2)
    monitor_s.append(t2 - t1 + t4 - t3)
    rho = last.rho("qk").tolist()  # every layer's key/value groups
    accelerator.print(f"step {step}: loss {loss.item():.3f}  rho_qk median {median(rho):.4f}")
step, hooks = median(step_s[1:]), median(monitor_s[1:])
accelerator.print(f"weights: {type(model.model.layers[0].self_attn.q_proj.weight).__name__}")
accelerator.print(f"monitored step: {hooks:.3f} s, {hooks / step:.0%} of a training step ({step:.3f} s)")
