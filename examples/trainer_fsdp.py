"""attnid's Trainer callback in a Hugging Face ``Trainer`` run sharded by FSDP2.

    torchrun --standalone --nproc-per-node 2 examples/trainer_fsdp.py

``Trainer(fsdp=True)`` shards the model through accelerate (FSDP2, one unit per decoder
layer); the callback runs on every process (each layer is gathered on all of them) and only
rank 0 writes ``trainer-fsdp/attnid_metrics.jsonl`` and logs. accelerate turns FSDP on only on
GPUs and other accelerators: on a CPU-only machine this script switches it on by hand (see
examples/accelerate_fsdp.py).
"""

import json
from pathlib import Path

import torch
import transformers
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

from attnid.integrations.transformers import AttnidCallback
from attnid.stats import median

config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                  num_hidden_layers=2, intermediate_size=128, vocab_size=128)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config)
gen = torch.Generator().manual_seed(0)
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (64, 32), generator=gen)]

args = transformers.TrainingArguments(
    "trainer-fsdp", max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1,
    report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
    fsdp=True, fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
callback = AttnidCallback(correction="off")  # or "project", "rebalance:100"
trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
if args.use_cpu:  # accelerate would run DDP here (see above)
    trainer.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    trainer.accelerator.state.distributed_type = DistributedType.FSDP
    trainer.is_fsdp_enabled = True
trainer.train()

if trainer.is_world_process_zero():
    lines = Path("trainer-fsdp/attnid_metrics.jsonl").read_text().splitlines()
    last = json.loads(lines[-1])
    rho = [x for layer in last["rho_qk"] for x in layer]
    print(f"{len(lines)} lines in trainer-fsdp/attnid_metrics.jsonl; step {last['step']}: "
          f"rho_qk median {median(rho):.4f}")
    print(f"weights: {type(trainer.model.model.layers[0].self_attn.q_proj.weight).__name__}")
