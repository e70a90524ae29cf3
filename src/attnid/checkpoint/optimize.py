"""`attnid rewrite --optimize SCHEME --calibration FILE`: the group element under which
round-to-nearest of the weights hurts least (`attnid.quantize.search` on the objective of
`attnid.quantize.objective`), written and certified like every rewrite (issue 27;
docs/theory.md §13.23).

Steps: the scheme, the parts and the text are checked before any work; the calibration text is
tokenized with the checkpoint's tokenizer and run once through the transformers model (eager
attention) to capture, per layer, each norm's output at gain 1 and the attention
probabilities; the search then works one layer at a time on the checkpoint's tensors (read from
the memory-mapped file, float32); the element found is written by the rewrite machinery (each
unit in float64, `attnid diff` and the end-to-end check before anything is moved into place).
With ``r1`` the norms are folded first and a tied head is untied (QuaRot's and SpinQuant's
way, as ``--rotate-residual --untie``).

Supported: pre-LN RMSNorm decoders with separate gate and up projections or a ReLU MLP and no
QK-norm (Llama, Mistral, Qwen2, SmolLM2, ...); anything else is refused in one line.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from attnid.checkpoint.load import Checkpoint, open_checkpoint
from attnid.checkpoint.output import check_out_dir
from attnid.checkpoint.tokens import Batches, read_chunks
from attnid.checkpoint.units import Units, open_units
from attnid.errors import AttnidError
from attnid.progress import Progress
from attnid.quantize.objective import LayerCalibration, mlp_norm
from attnid.quantize.rtn import Scheme, parse_scheme
from attnid.quantize.search import Search, parse_parts
from attnid.whole.transforms.layout import Layout

__all__ = ["check_optimizable", "objective_of", "optimize"]


def _scheme(text: str) -> Scheme:
    try:
        return parse_scheme(text)
    except AttnidError as e:
        raise AttnidError(str(e).replace("--quantize", "--optimize", 1)) from None


def check_optimizable(lay: Layout, ck: Checkpoint) -> None:
    """Refuse, in one line, what the objective does not model."""
    why = None
    if lay.post or lay.parallel or lay.norm != "rms":
        why = "it needs a pre-LN decoder with RMSNorm (Llama, Mistral, Qwen2, SmolLM2, ...)"
    elif lay.unembed is None:
        why = "a bare model has no head"
    elif lay.mlp == "other":
        why = "its MLP is neither gated nor ReLU"
    elif lay.mlp == "gated" and any(g is None or g.path == u.path or g.rows or u.rows
                                    for g, (u, _) in zip(lay.gates, lay.mlps, strict=True)):
        why = "its gate and up projections are fused"
    elif any(s.qk_norm != "none" for s in ck.specs):
        why = "under QK-norm the scores are normalised per head"
    if why:
        raise AttnidError(f"--optimize: {ck.root} is {ck.adapter.family}; {why}")


def optimize(in_dir: str | Path, out_dir: str | Path, scheme: str, calibration: str | Path, *,
             parts: str | None = None, tokens: int = 512, context: int | None = None, seed: int = 0,
             force: bool = False, end_to_end_max_bytes: int = 2 * 1024**3,
             progress: Progress | None = None) -> dict[str, Any]:
    """Search the group element for ``scheme`` on ``calibration`` and write it (see the module);
    returns the JSON of `attnid rewrite --optimize`."""
    from attnid.checkpoint.output import write_certified
    from attnid.checkpoint.rewrite import Recipe, changes
    from attnid.whole.transforms.norms import fold_norm_gains

    start = time.perf_counter()
    sch = _scheme(scheme)
    part_set, awq = parse_parts(parts)
    if not Path(calibration).is_file():
        raise AttnidError(f"--calibration {calibration}: no such file")
    src, dst = check_out_dir(in_dir, out_dir, force)
    ck = open_checkpoint(src, purpose="rewrite")
    fold = "r1" in part_set
    units = open_units(ck, untie=fold)
    check_optimizable(units.layout, ck)
    chunks = read_chunks(ck, calibration, context=context, max_tokens=tokens, option="--calibration")
    shown = progress if progress is not None else Progress(enabled=False)
    shown.stage(f"capture the activations of {chunks.tokens} calibration tokens")
    calib = capture(ck, units, chunks)
    act = _activation(ck.config)

    def base(folded: bool) -> Callable[[int], Any]:
        def load(i: int):
            m = units.load(i + 1, torch.float32)
            return fold_norm_gains(m) if folded else m
        return load

    def search(folded: bool) -> Search:
        return Search(base(folded), calib, sch, act, part_set, awq=awq, seed=seed, line=shown.line,
                      run=shown.run)

    s = search(fold)
    if fold:
        shown.stage("objective of the input")
        objective = {"input": search(False).start()}
        shown.stage("objective with the norms folded")
        objective["folded"] = s.start()
    else:
        shown.stage("objective of the input")
        objective = {"input": s.start()}
    search_start = time.perf_counter()
    report = s.optimize()
    objective["found"] = s.value()
    search_seconds = time.perf_counter() - search_start
    shown.stage("write and certify")
    recipe = Recipe(fold_norms=fold, untie=units.untied is not None)
    check, e2e = write_certified(ck, units, changes(recipe, s.element()), dst, shown, end_to_end_max_bytes)
    shown.close()
    worst = max([row["residual"] for row in check["layers"]] + [check["other"]["residual"]])
    return {"architecture": ck.adapter.family, "layers": ck.n_layers, "scheme": str(sch),
            "parts": sorted(part_set) if not awq else "awq", "calibration": str(calibration),
            "calibration_tokens": chunks.tokens, "folded": fold, "untied": units.untied,
            "objective": objective, "parts_objective": report,
            "certified": True, "max_residual": worst, "tolerance": check["tolerance"],
            "end_to_end_rel_diff": e2e, "search_seconds": search_seconds,
            "seconds": time.perf_counter() - start, "out_dir": str(dst)}


def objective_of(model: str | Path, scheme: str, calibration: str | Path, *, tokens: int = 512,
                 context: int | None = None) -> float:
    """The objective of a checkpoint as it is (no element): what `optimize` reports as
    ``objective.input``, for comparing checkpoints written by other means (QuaRot's rewrite)."""
    sch = _scheme(scheme)
    ck = open_checkpoint(model, purpose="rewrite")
    units = open_units(ck)
    check_optimizable(units.layout, ck)
    chunks = read_chunks(ck, calibration, context=context, max_tokens=tokens, option="--calibration")
    calib = capture(ck, units, chunks)
    return Search(lambda i: units.load(i + 1, torch.float32), calib, sch, _activation(ck.config),
                  frozenset()).start()


def _activation(config: dict) -> Callable[[torch.Tensor], torch.Tensor]:
    from transformers.activations import ACT2FN

    name = config.get("hidden_act") or config.get("activation_function") or "silu"
    if name not in ACT2FN:
        raise AttnidError(f"--optimize: unknown MLP activation {name!r}")
    return ACT2FN[name]


def capture(ck: Checkpoint, units: Units, chunks: Batches) -> list[LayerCalibration]:
    """Per layer, each norm's output at gain 1 and the attention probabilities on ``chunks``
    (one forward pass of the transformers body, eager attention, float32)."""
    import transformers

    lay = units.layout
    transformers.utils.logging.set_verbosity_error()
    try:
        body = transformers.AutoModel.from_pretrained(str(ck.root), attn_implementation="eager",
                                                      dtype=torch.float32).eval()
    except Exception as e:  # transformers reading the user's checkpoint: its refusal
        raise AttnidError(f"{ck.root}: transformers cannot load this model ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None
    modules = dict(body.named_modules())

    def module(path: str) -> torch.nn.Module:
        parts = path.split(".")
        for k in range(len(parts)):
            if ".".join(parts[k:]) in modules:
                return modules[".".join(parts[k:])]
        raise AttnidError(f"internal: no module {path} in {type(body).__name__}")

    seen: dict[str, torch.Tensor] = {}
    hooks = []
    paths = [p for i in range(len(lay.layers)) for p in (lay.attn_norm(i), mlp_norm(lay, i).path)]
    for p in paths:
        hooks.append(module(p).register_forward_hook(
            lambda _m, _i, out, p=p: seen.__setitem__(p, out.detach())))
    try:
        with torch.no_grad():
            out = body(input_ids=chunks.ids, output_attentions=True)
    finally:
        for h in hooks:
            h.remove()
    if out.attentions is None or len(out.attentions) != len(lay.layers):
        raise AttnidError(f"{ck.root}: transformers returned no attention probabilities")
    calib = []
    for i in range(len(lay.layers)):
        m = units.load(i + 1, torch.float32)
        ins = []
        for p in (lay.attn_norm(i), mlp_norm(lay, i).path):
            g = m.gain(next(n for n in lay.norms if n.path == p))
            if bool((g == 0).any()):
                raise AttnidError(f"{p} has a zero gain: its readers' input cannot be recovered")
            ins.append(seen.pop(p) / g)
        calib.append(LayerCalibration(ins[0], ins[1], out.attentions[i].detach().float()))
    return calib
