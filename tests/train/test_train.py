"""Training: data, model variants, the loop's files, resume, Ctrl-C, corrections, DDP, experiment."""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from attnid.cli import main
from attnid.errors import AttnidError
from attnid.train import data as data_mod
from attnid.train.data import SHA256, corpus, shakespeare
from attnid.train.loop import TrainConfig, train
from attnid.train.model import GPT, GPTConfig
from launch import TWO, torchrun

TINY = GPTConfig(n_layers=1, n_heads=4, d_model=32, block_size=16)
PER_HEAD = ["rho_qk", "rho_vo", "beta_qk", "beta_vo", "tau_qk", "tau_vo", "mu_qk", "drift_qk",
            "drift_vo"]


def _records(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]


def test_corpus_is_shipped_and_batches_are_deterministic():
    assert hashlib.sha256(corpus().encode()).hexdigest() == SHA256
    d = shakespeare()
    assert d.vocab_size == 78 and d.train.numel() == int(0.9 * len(corpus()))
    a = d.batch("train", 3, 8, torch.Generator().manual_seed(1))
    b = d.batch("train", 3, 8, torch.Generator().manual_seed(1))
    assert torch.equal(a[0], b[0]) and torch.equal(a[0][:, 1:], a[1][:, :-1])


@pytest.mark.parametrize("overrides", [{}, {"rope": 1.0}, {"n_kv_heads": 2, "rope": 0.5},
                                       {"qk_norm": "head", "attn_bias": "qkvo"}], ids=str)
def test_model_variants_run(overrides):
    model = GPT(GPTConfig(**{**TINY.to_dict(), **overrides, "vocab_size": 78}))
    idx = torch.randint(0, 78, (2, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 16, 78) and torch.isfinite(loss)


@pytest.mark.parametrize(("schedule", "warmup"),
                         [("constant", 0), ("constant", 5), ("cosine", 0), ("cosine", 5)])
def test_learning_rate_schedule(schedule, warmup, tmp_path):
    cfg = TrainConfig(model=TINY, lr=0.01, steps=20, schedule=schedule, warmup=warmup)
    lrs = [cfg.lr_at(s) for s in range(1, 21)]
    if warmup:
        assert lrs[:warmup] == pytest.approx([0.01 * s / warmup for s in range(1, warmup + 1)])
    assert lrs[warmup] == pytest.approx(0.01 if schedule == "constant" else 0.01 * (0.55 + 0.45 * math.cos(
        math.pi / (20 - warmup))))
    assert lrs[-1] == pytest.approx(0.01 if schedule == "constant" else 0.001)
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1:], strict=False))
    seen = []  # the loop uses it: the optimizer's lr at each step
    real = torch.optim.AdamW.step

    def spy(self, *a, **k):
        seen.append(self.param_groups[0]["lr"])
        return real(self, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.optim.AdamW, "step", spy)
        train(cfg, tmp_path / "lr", progress=False, checkpoint=False)
    assert seen == pytest.approx(lrs)
    with pytest.raises(AttnidError):
        TrainConfig(schedule="linear")


def test_train_writes_config_and_metrics_schema(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", str(out), "--layers", "1", "--d-model", "32", "--seq-len", "16",
                 "--steps", "12", "--log-every", "4", "--eval-every", "8", "--optimizer", "sgd",
                 "--lr", "0.1", "--bias", "qk", "--no-progress"])
    assert code == 0
    cfg = TrainConfig.from_dict(json.loads((out / "config.json").read_text()))
    assert cfg.optimizer == "sgd" and cfg.model.n_layers == 1
    recs = _records(out)
    assert [r["step"] for r in recs] == [1, 4, 8, 12]
    for r in recs:
        for key in PER_HEAD:
            assert len(r[key]) == 1 and len(r[key][0]) == 4, key
        assert {"loss", "update_norm", "grad_norm_bq", "grad_norm_bk"} <= set(r)
    assert "val_loss" in recs[2] and "val_loss" in recs[3]
    assert max(max(h) for r in recs for h in r["rho_qk"]) < 1e-6  # plain SGD


def test_project_correction_zeroes_rho(tmp_path):
    cfg = TrainConfig(model=TINY, optimizer="adamw", lr=1e-2, steps=6, log_every=1, correct="project")
    train(cfg, tmp_path / "p", progress=False)
    recs = _records(tmp_path / "p")
    worst = max(max(h) for r in recs for key in ("rho_qk", "rho_vo") for h in r[key])
    assert worst < 1e-9, f"rho of the applied update {worst:.2e}"
    cfg2 = TrainConfig(model=TINY, optimizer="adamw", lr=1e-2, steps=6, log_every=1)
    train(cfg2, tmp_path / "raw", progress=False)
    assert max(max(h) for r in _records(tmp_path / "raw")[1:] for h in r["rho_qk"]) > 1e-3


def test_interrupt_leaves_valid_log_and_resume_continues(tmp_path, monkeypatch):
    cfg = TrainConfig(model=TINY, steps=20, log_every=2, eval_every=4)
    out = tmp_path / "r"
    real = data_mod.CharData.batch
    calls = {"n": 0}

    def flaky(self, split, *a, **k):
        if split == "train":
            calls["n"] += 1
            if calls["n"] == 11:
                raise KeyboardInterrupt
        return real(self, split, *a, **k)

    monkeypatch.setattr(data_mod.CharData, "batch", flaky)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, out, progress=False)
    monkeypatch.setattr(data_mod.CharData, "batch", real)
    steps = [r["step"] for r in _records(out)]  # every line parses
    assert steps == [1, 2, 4, 6, 8, 10]
    train(cfg, out, resume=True, progress=False)
    steps = [r["step"] for r in _records(out)]
    assert steps == sorted(set(steps)) and steps[-1] == 20 and 10 in steps


def test_resume_without_checkpoint_is_a_clean_error(tmp_path, capsys):
    code = main(["train", str(tmp_path / "none"), "--resume", "--no-progress"])
    assert code == 2 and capsys.readouterr().err.startswith("error: nothing to resume")


@pytest.mark.slow
@pytest.mark.serial  # two processes: both cores
def test_ddp_two_processes_stay_in_sync(tmp_path):
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = torchrun([*TWO, "-m", "attnid", "train", str(out), "--layers", "1", "--d-model", "32",
                     "--seq-len", "16", "--steps", "8", "--log-every", "2", "--correct", "rebalance:3",
                     "--no-progress"], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["ranks_in_sync"], summary
    assert [r["step"] for r in _records(out)] == [1, 2, 4, 6, 8]


def test_train_prints_rho_and_beta_and_checkpoint_is_optional(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", str(out), "--layers", "1", "--d-model", "32", "--seq-len", "16",
                 "--steps", "6", "--log-every", "2", "--optimizer", "sgd", "--lr", "0.1",
                 "--no-progress", "--no-checkpoint"])
    printed = capsys.readouterr().out
    assert code == 0 and not (out / "checkpoint.pt").exists()
    assert "QK: median rho" in printed and "mean beta" in printed and "VO: median rho" in printed, printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["median_rho_qk"] < 1e-6  # plain SGD: no orbit motion
    recs = _records(out)
    assert set(summary) == {"steps", "final_loss", "world_size", "rank", "seconds", "median_rho_qk",
                            "beta_qk_first", "beta_qk_last", "median_rho_vo", "beta_vo_first", "beta_vo_last"}
    for side in ("qk", "vo"):  # the one median (even count: the mean of the two middle values)
        rhos = [x for r in recs[1:] for row in r[f"rho_{side}"] for x in row]
        assert len(rhos) % 2 == 0 and summary[f"median_rho_{side}"] == pytest.approx(float(np.median(rhos)))
        betas = recs[-1][f"beta_{side}"][0]
        assert summary[f"beta_{side}_last"] == pytest.approx(sum(betas) / len(betas), rel=1e-12)
    assert all(len(r["update_sq_qk"]) == 1 and r["update_sq_qk"][0] > 0 for r in recs)


def test_ctrl_c_in_the_cli_exits_130_with_one_line(tmp_path, capsys, monkeypatch):
    import attnid.train.loop as loop

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "train", interrupted)
    code = main(["train", str(tmp_path / "x"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 130 and len(err) == 1 and "attnid train --resume" in err[0]
