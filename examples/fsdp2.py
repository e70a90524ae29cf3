"""attnid's Monitor and Corrector in a training loop sharded by FSDP2 (``fully_shard``).

    torchrun --standalone --nproc-per-node 2 examples/fsdp2.py

Every process runs this script. The Monitor and the Corrector are built on the sharded model
(building them before ``fully_shard`` works too: they find the parameters again every step);
every process must call them, because they gather each layer's shards, one layer at a time.
Every process gets the same numbers; rank 0 prints them, and at the end what a monitored step
costs against a training step.
"""

import os
import time

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import fully_shard

from attnid.monitor import Corrector, Monitor
from attnid.stats import median

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank = dist.get_rank()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)

config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                  num_hidden_layers=2, intermediate_size=128, vocab_size=128)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config).to(device)
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)

monitor = Monitor(model)
corrector = Corrector(model, "off")  # "project": remove the orbit part of every update
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
tokens = torch.Generator().manual_seed(rank)  # each process its own batches
step_s, monitor_s = [], []
for step in range(4):
    ids = torch.randint(0, 128, (4, 32), generator=tokens).to(device)
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    optimizer.zero_grad()
    loss.backward()
    t1 = time.perf_counter()
    monitor.begin()  # same as `with monitor.step(), corrector.step(): optimizer.step()`
    t2 = time.perf_counter()
    with corrector.step():
        optimizer.step()
    t3 = time.perf_counter()
    last = monitor.end()
    t4 = time.perf_counter()
    step_s.append(t1 - t0 + t3 - t2)
    monitor_s.append(t2 - t1 + t4 - t3)
    if rank == 0:
        rho = last.rho("qk").tolist()  # every layer's key/value groups
        beta = [x for layer in last.layers for x in layer.metrics.qk.beta.tolist()]
        print(f"step {step}: loss {loss.item():.3f}  rho_qk median {median(rho):.4f}  "
              f"beta_qk max {max(beta):.4f}")
if rank == 0:
    step, hooks = median(step_s[1:]), median(monitor_s[1:])
    print(f"monitored step: {hooks:.3f} s, {hooks / step:.0%} of a training step ({step:.3f} s)")
dist.destroy_process_group()
