"""`AttnidCallback`: the attnid monitor (and optional corrector) inside a Hugging Face `Trainer`.

    from attnid.integrations.transformers import AttnidCallback
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[AttnidCallback(correction="off")])   # or "project", "rebalance:100"

Around every monitored optimizer step it records, per attention layer and key/value group,
``rho_qk, rho_vo`` (share of the applied update along the invisible directions),
``beta_qk, beta_vo`` (the conserved quantities after the step), ``drift_qk, drift_vo`` (how
far the step moved them, as in `attnid.monitor.Monitor`) and ``drift_from_start_qk,
drift_from_start_vo`` (how far they moved since training started), plus the median and max
over heads.
Summaries go into Trainer's logs as ``attnid/<metric>/{median,max}`` and per layer
``attnid/<metric>/layer<i>/{median,max}``, so every reporting integration (TensorBoard, W&B,
...) and ``trainer.state.log_history`` get them; every measured step is also one line of
``<output_dir>/attnid_metrics.jsonl`` with the per-head values. Any model whose family has an
attnid adapter (or that is built from `attnid.Attention`) works.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
from pathlib import Path
from typing import Any

import torch

from attnid.errors import AttnidError, require

require("transformers", "hf")

from transformers import TrainerCallback  # noqa: E402

from attnid.monitor import Corrector, Monitor, parse_correction  # noqa: E402
from attnid.stats import flat, median  # noqa: E402
from attnid.symmetry.conserved import conserved, flat_key, kv_group_norm  # noqa: E402
from attnid.weights import SIDES, Side  # noqa: E402

METRICS = ("rho_qk", "rho_vo", "beta_qk", "beta_vo", "drift_qk", "drift_vo", "drift_from_start_qk",
           "drift_from_start_vo")


class AttnidCallback(TrainerCallback):
    """Monitor (and optionally correct) the attention symmetries during ``Trainer.train()``.

    ``correction``: ``"off"`` | ``"project"`` (remove the orbit part of every update) |
    ``"rebalance:N"`` (rebalance every N steps). ``every``: measure every N optimizer steps.
    ``path``: the JSONL file (default ``<output_dir>/attnid_metrics.jsonl``; ``False``: none).
    ``per_layer``: also log per-layer summaries.
    """

    def __init__(self, correction: str = "off", *, every: int = 1, path: str | Path | bool | None = None,
                 per_layer: bool = True, near: bool = False) -> None:
        parse_correction(correction)  # refuse a bad mode now, not mid-training
        if not isinstance(every, int) or every < 1:
            raise AttnidError(f"every must be a positive integer, got {every!r}")
        self.correction, self.every, self.path = correction, every, path
        self.per_layer, self.near = per_layer, near
        self.monitor: Monitor | None = None
        self.corrector: Corrector | None = None
        self.last: dict[str, Any] | None = None  # the latest measured record (its JSONL line)
        self._start: list[dict[Side, torch.Tensor]] = []
        self._stack: contextlib.ExitStack | None = None
        self._measuring = False
        self._file: Path | None = None
        self._logged = -1
        self._engine_steps = False  # the optimizer steps inside backward (DeepSpeed)

    # ---- Trainer events ----------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise AttnidError("AttnidCallback needs the model (Trainer passes it)")
        # under DeepSpeed (Trainer's ``deepspeed`` argument or ``accelerate launch --use_deepspeed``)
        # the engine steps inside ``backward``, before ``on_pre_optimizer_step``: the forward and
        # backward passes move no weight, so the step is measured from ``on_step_begin``
        self._engine_steps = bool(getattr(args, "deepspeed", None)) or \
            os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
        self.monitor = Monitor(model, near=self.near)
        self.corrector = Corrector(model, self.correction, near=self.near)
        self._start = [{side: conserved(w, side) for side in SIDES}
                       for w in self.monitor.batches.snapshot()]
        if self.path is not False and state.is_world_process_zero:
            self._file = Path(self.path) if isinstance(self.path, (str, Path)) else \
                Path(args.output_dir) / "attnid_metrics.jsonl"
            self._file.parent.mkdir(parents=True, exist_ok=True)
            self._file.write_text("")
        self._run_before_reporters()

    def on_step_begin(self, args, state, control, **kwargs):
        if self._engine_steps:  # DeepSpeed steps inside backward: start before it
            self._begin(state)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if not self._engine_steps:
            self._begin(state)

    def _begin(self, state) -> None:
        self._stack = contextlib.ExitStack()
        self._measuring = state.global_step % self.every == 0
        if self._measuring:
            self.monitor.begin(grads=not self._engine_steps)
        self._stack.enter_context(self.corrector.step())

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._stack.close()  # the corrector acts first: the monitor sees the update that was applied
        if not self._measuring:
            return
        vals = {**self.monitor.end().to_dict(), **self._drift_from_start()}
        self._measuring = False
        self.last = {"step": state.global_step + 1, "layers": self.monitor.layer_names, **vals}
        if self._file is not None:
            with self._file.open("a") as f:
                f.write(json.dumps(self.last) + "\n")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or self.last is None or self.last["step"] == self._logged:
            return  # nothing new since the last log (e.g. the end-of-training summary)
        self._logged = self.last["step"]
        extra = self.summary()
        logs.update(extra)
        if state.log_history:
            state.log_history[-1].update(extra)

    def _drift_from_start(self) -> dict[str, list]:
        """``drift_from_start_{qk,vo}``, ``[layer][kv_group]``: how far each conserved quantity has
        moved since training started, ``||C_t - C_0||`` (``drift_*`` is one update's, as in the
        Monitor)."""
        n = len(self.monitor.layer_names)
        out: dict[str, list] = {flat_key("drift_from_start", side): [None] * n for side in SIDES}
        for idx, w, c0 in zip(self.monitor.batches.stacks, self.monitor.after, self._start, strict=True):
            for side in SIDES:
                d = kv_group_norm(conserved(w, side) - c0[side], w, side)  # [n, G]
                for j, i in enumerate(idx):
                    out[flat_key("drift_from_start", side)][i] = d[j].tolist()
        return out

    # ---- summaries ----------------------------------------------------------------------
    def summary(self) -> dict[str, float]:
        """``attnid/<metric>/{median,max}`` over all heads, and per layer unless disabled."""
        out: dict[str, float] = {}
        for key in METRICS:
            rows = [flat(r) for r in self.last[key]]
            every = [x for r in rows for x in r]
            out[f"attnid/{key}/median"] = median(every)
            out[f"attnid/{key}/max"] = max(every)
            if self.per_layer:
                for i, r in enumerate(rows):
                    out[f"attnid/{key}/layer{i}/median"] = median(r)
                    out[f"attnid/{key}/layer{i}/max"] = max(r)
        return out

    def _run_before_reporters(self) -> None:
        """Move this callback right after Trainer's flow callback, so the reporting
        integrations (which Trainer puts first) see the values this callback adds to the logs."""
        for ref in gc.get_referrers(self):
            if isinstance(ref, list) and any(type(c).__name__ == "DefaultFlowCallback" for c in ref):
                ref.remove(self)
                flow = next(i for i, c in enumerate(ref) if type(c).__name__ == "DefaultFlowCallback")
                ref.insert(flow + 1, self)  # earlier in the list: the running loop calls nobody twice
                return
