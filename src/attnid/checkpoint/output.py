"""Writing a checkpoint the checkpoint tools produce: OUT_DIR checked before any work, the
output written into a temporary sibling, verified, and only then moved into place; the other
files of the model directory (config, tokenizer) copied along. The input is never modified."""

from __future__ import annotations

import math
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from attnid.adapters.base import hf_model_class
from attnid.adapters.config import model_path
from attnid.errors import AttnidError, require
from attnid.io import weight_files


def check_out_dir(in_dir: str | Path, out_dir: str | Path, force: bool) -> tuple[Path, Path]:
    """``(IN_DIR, OUT_DIR)`` resolved, refused before any work when writing OUT_DIR could touch
    the input or replace something without ``force``."""
    src, dst = model_path(in_dir).resolve(), Path(out_dir).resolve()
    if not src.is_dir():
        raise AttnidError(f"{in_dir} is not a directory")
    if dst == src or dst in src.parents or src in dst.parents:
        raise AttnidError("OUT_DIR must be neither IN_DIR nor inside it nor around it "
                          "(the input is never modified)")
    return src, check_new_dir(out_dir, force)


def check_new_dir(out_dir: str | Path, force: bool) -> Path:
    """``out_dir`` resolved, refused before any work when it is a file, or a non-empty
    directory and not ``force``."""
    dst = Path(out_dir).resolve()
    if dst.exists() and not dst.is_dir():
        raise AttnidError(f"{out_dir} exists and is not a directory")
    if dst.exists() and any(dst.iterdir()) and not force:
        raise AttnidError(f"{out_dir} exists and is not empty (use --force to replace it)")
    return dst


@contextmanager
def staged(dst: Path, src: Path | None = None, weights: set[str] | frozenset[str] = frozenset()
           ) -> Iterator[Path]:
    """A fresh temporary sibling of ``dst`` holding ``src``'s other files (none without
    ``src``): the caller writes and verifies the weights there; on success it replaces
    ``dst``, on any failure it is removed."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.{secrets.token_hex(4)}.tmp"
    tmp.mkdir()  # mode 0o777 less the umask, like any folder the user creates
    try:
        if src is not None:
            copy_other_files(src, tmp, weights)
        yield tmp
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_other_files(src: Path, dst: Path, weights: set[str] | frozenset[str]) -> None:
    """Everything in the model directory but its weight files (config, tokenizer, ...)."""
    for item in src.rglob("*"):
        rel = item.relative_to(src)
        if item.is_dir() or (len(rel.parts) == 1 and item.name in weights):
            continue
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(item, target)


def end_to_end(src: Path, out: Path, config: dict[str, Any], *, float64: bool = False) -> float:
    """Load both checkpoints with transformers, run probe tokens, return the relative difference
    of their log-probabilities (bare models: hidden states). ``float64``: a float64 checkpoint,
    loaded and run in float64 throughout (`attnid.arbiter.precision.Float64Mode`: transformers
    computes RMSNorm, softmax and its rotary table in float32 even in a float64 model, which
    would hide the checkpoint's own precision)."""
    require("transformers", "hf")
    import contextlib

    import transformers  # optional heavy dependency: loaded only here

    from attnid.arbiter.precision import Float64Mode

    mode = Float64Mode if float64 else contextlib.nullcontext
    kw = {"dtype": torch.float64} if float64 else {}

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    loader = hf_model_class(config)  # the one resolver of an architecture to its class
    try:  # transformers reading the user's checkpoint: whatever it raises is its refusal
        with mode():
            a, info = loader.from_pretrained(src, output_loading_info=True, **kw)
    except Exception as e:
        raise AttnidError(f"{src / 'config.json'}: transformers cannot load this checkpoint "
                          f"({type(e).__name__}: {e}); nothing was written") from None
    if info["missing_keys"]:  # it would fill them at random, and the outputs could not agree
        missing = sorted(info["missing_keys"], key=lambda k: (k.startswith("lm_head."), k))  # tied last
        files = ", ".join(str(p) for p in weight_files(src))
        raise AttnidError(f"{files}: transformers finds no stored tensor for {missing[0]}"
                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                          + f" of {loader.__name__} as {src / 'config.json'} describes it (a config and "
                          "weights that disagree); nothing was written")
    vocab = int(config.get("vocab_size", 100))
    ids = torch.randint(0, min(vocab, 1000), (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), mode():
        ta = _function(a.eval()(input_ids=ids))
    del a  # one model held at a time (two 2 GiB models and their loading would be 5-6 GB)
    try:
        with mode():
            b = loader.from_pretrained(out, **kw).eval()
    except Exception as e:
        raise AttnidError(f"refused: transformers could not load the rewritten checkpoint: {e}") from None
    with torch.no_grad(), mode():
        tb = _function(b(input_ids=ids))
    return float((ta - tb).double().norm() / ta.double().norm())


def _function(y: Any) -> torch.Tensor:
    """What the model computes: log-probabilities (a logit shift is a symmetry), or hidden states."""
    if getattr(y, "logits", None) is not None:
        return torch.log_softmax(y.logits.double(), -1)
    return y.last_hidden_state


def verify_end_to_end(ck: Any, out: Path, max_bytes: int, what: str = "rewritten") -> float | None:
    """The end-to-end check of a written checkpoint ``out`` against its input ``ck`` (a
    `Checkpoint`), when the input is at most ``max_bytes`` on disk (else None): refused above
    ten times the tolerance of the input's dtype."""
    from attnid.numerics import tolerance

    if sum(f.path.stat().st_size for f in ck.files) > max_bytes:
        return None
    e2e = end_to_end(ck.root, out, ck.config, float64=ck.dtype() == torch.float64)
    if not math.isfinite(e2e) or e2e > 10 * tolerance(ck.dtype()):
        raise AttnidError(f"refused: the {what} model's outputs differ by {e2e:.2e} (relative); "
                          "nothing was written")
    return e2e



def write_units(units: Any, compute: Any, tmp: Path) -> None:
    """The checkpoint of ``units`` (a `attnid.checkpoint.units.Units`) again under ``tmp``, each
    unit's tensors taken from ``compute(u)`` (a `ModelTensors`, asked once per unit, when its
    first tensor is written, and let go after its last) in the stored dtypes; every tensor no
    unit holds copied as stored. A tied head read untied is written as a tensor of its own,
    beside its table (`untie_files` then unties the config)."""
    from attnid.io import DTYPES, write_streaming

    ck = units.ck
    out_of = {s: s if s == units.untied else c for s, c in units.to_ck.items()}  # the name written
    state_of = {w: s for s, w in out_of.items()}
    src_of = {out_of[s]: c for s, c in units.to_ck.items()}  # written name -> the stored tensor read
    unit_of = {out_of[s]: units.unit_of[s] for s in units.to_ck}
    left = {u: sum(1 for c in unit_of if unit_of[c] == u) for u in range(units.count)}
    cache: dict[int, Any] = {}
    files = []
    for f in ck.files:
        names = list(f.names)
        if units.untied and units.untied not in ck.index and ck.index[src_of[units.untied]] is f:
            names.append(units.untied)  # the new head, beside its table
        files.append((f, sorted(names, key=lambda n: unit_of.get(n, -1))))
    order = list(dict.fromkeys(unit_of[n] for _, names in files for n in names if n in unit_of))
    for u in order[:2]:
        units.read_ahead(u)

    def produce(name: str) -> torch.Tensor:
        if name not in unit_of:
            return ck.tensor(name)  # no unit reads it: its stored bytes
        u = unit_of[name]
        if u not in cache:
            k = order.index(u)
            if k + 2 < len(order):  # read while this unit computes (`attnid.readahead`)
                units.read_ahead(order[k + 2])
            cache[u] = compute(u)
        t = cache[u].tensors[state_of[name]]
        left[u] -= 1
        if left[u] == 0:
            del cache[u]
        return t.to(DTYPES[ck.info(src_of[name]).dtype]) if t.is_floating_point() else t

    for f, names in files:
        entries = [(n, f.info(src_of.get(n, n)).dtype, f.info(src_of.get(n, n)).shape) for n in names]
        write_streaming(tmp / f.path.name, entries, produce, f.metadata)


def write_certified(ck: Any, units: Any, change: Callable[[Any], Any], dst: Path, progress: Any,
                    end_to_end_max_bytes: int) -> tuple[dict[str, Any], float | None]:
    """The one pipeline of the checkpoint commands that rewrite one model: each unit of
    ``units`` loaded in its compute dtype (float64; float32 for bfloat16/float16 checkpoints),
    ``change``d (a `ModelTensors` to a `ModelTensors`), written by :func:`write_units` into a
    temporary sibling of ``dst``, certified by `attnid diff` against the input and end to end,
    and only then moved into place; returns ``(the diff's JSON, the end-to-end difference)``."""
    from attnid.checkpoint.diff import diff  # the certificate: the whole-model invariants
    from attnid.checkpoint.load import open_checkpoint
    from attnid.whole.fit.fitter import compute_dtype

    cd = compute_dtype(ck.dtype())

    def compute(u: int) -> Any:
        m = change(units.load(u, cd))
        progress.line(f"rewrote unit {u} of {units.count - 1}")
        return m

    with staged(dst, ck.root, {f.path.name for f in ck.files}) as tmp:
        write_units(units, compute, tmp)
        if units.untied:
            untie_files(ck, units, tmp)
        progress.line("verifying: attnid diff against the input")
        try:
            check = diff(ck, open_checkpoint(tmp, purpose="certify"))
        except AttnidError as e:  # e.g. a NaN written: the message would name the scratch folder
            raise AttnidError(f"refused: the rewritten checkpoint cannot be certified ({e}); "
                              "nothing was written") from None
        if not check["certified"]:
            b = check["break"]
            where = "outside the layers" if b["layer"] is None else f"layer {b['layer']}"
            raise AttnidError(f"refused: the rewritten checkpoint is not certified ({where}, {b['tensor']}: "
                              f"residual {b['residual']:.2e}); nothing was written")
        e2e = verify_end_to_end(ck, tmp, end_to_end_max_bytes)
    return check, e2e


def untie_files(ck: Any, units: Any, tmp: Path) -> None:
    """The written config says ``tie_word_embeddings: false``; a sharded checkpoint's index
    names the shard holding the new head (beside its table)."""
    import json

    config = json.loads((tmp / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    index = tmp / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        table = units.to_ck[units.untied]
        data["weight_map"][units.untied] = ck.index[table].path.name
        index.write_text(json.dumps(data, indent=2) + "\n")


@contextmanager
def scratch(dst: Path) -> Iterator[Path]:
    """A fresh temporary sibling of ``dst``, removed on leaving (what is kept is moved out first)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.{secrets.token_hex(4)}.tmp"
    tmp.mkdir()
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
