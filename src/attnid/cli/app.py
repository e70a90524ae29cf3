"""The Typer app, the options shared by several commands, and output helpers."""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from attnid.errors import AttnidError
from attnid.spec import AttentionSpec
from attnid.theory import Count

if TYPE_CHECKING:
    from attnid.progress import Progress

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Measure and exploit the parameter symmetries of transformer attention.",
)

DModel = Annotated[int, typer.Option("--d-model", help="Model width d.")]
NHeads = Annotated[int, typer.Option("--n-heads", "--heads", help="Query heads H.")]
NKVHeads = Annotated[int | None, typer.Option(
    "--n-kv-heads", "--kv-heads", help="Key/value groups G (GQA; 1 = MQA; default H).")]
HeadDim = Annotated[int | None, typer.Option("--head-dim", help="Query/key head size d_k.")]
VHeadDim = Annotated[int | None, typer.Option("--v-head-dim", help="Value head size d_v.")]
Bias = Annotated[str, typer.Option("--bias", help="Which biases exist: a subset of 'qkvo'.")]
Rope = Annotated[float, typer.Option("--rope", help="Fraction of each head's dims that RoPE rotates.")]
RopePairing = Annotated[Literal["half", "interleaved"], typer.Option(
    "--rope-pairing", help="Which dims form a rotated plane: (i, i + r/2) or (2i, 2i + 1).")]
QKNormOpt = Annotated[Literal["none", "head"], typer.Option(
    "--qk-norm", help="RMSNorm of each query/key head (gain shared across heads).")]
QKNormEps = Annotated[float, typer.Option("--qk-norm-eps", help="QK-norm epsilon.")]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]


def make_spec(d_model: int, n_heads: int, n_kv_heads: int | None, head_dim: int | None,
              v_head_dim: int | None, bias: str, rope: float, rope_pairing: str,
              qk_norm: str, qk_norm_eps: float) -> AttentionSpec:
    """The spec the flags give; a refusal names the flags, not `AttentionSpec`'s fields."""
    try:
        return AttentionSpec(
            d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
            v_head_dim=v_head_dim, bias=bias, rope=rope, rope_pairing=rope_pairing,  # type: ignore[arg-type]
            qk_norm=qk_norm, qk_norm_eps=qk_norm_eps,  # type: ignore[arg-type]
        )
    except AttnidError as e:
        raise AttnidError(flag_words(str(e))) from None


# AttentionSpec's fields that are flags of count and verify, longest first
_SPEC_FLAGS = re.compile(r"(?<![\w-])(qk_norm_eps|v_head_dim|n_kv_heads|rope_pairing|head_dim|d_model|"
                         r"n_heads|qk_norm|rope fraction)(=?)")


def flag_words(message: str) -> str:
    """A spec refusal in the CLI's words: each field named by its flag.

    >>> flag_words("n_heads=3 does not divide d_model=10; give head_dim explicitly")
    '--n-heads 3 does not divide --d-model 10; give --head-dim explicitly'
    """
    return _SPEC_FLAGS.sub(lambda m: "--" + m[1].split()[0].replace("_", "-") + (" " if m[2] else ""),
                           message)


def _describe(spec: dict) -> str:
    return AttentionSpec.from_dict(spec).describe()


def console():
    """A rich console for stdout: the terminal's full width on a terminal; when piped (a
    file, CI), no wrapping at all, so tables keep their natural width and words stay whole."""
    from rich.console import Console

    out = Console()
    return out if out.is_terminal else Console(width=1000, soft_wrap=True, no_color=True)


def _print_rows(rows: list[dict], title: str) -> None:
    from rich.table import Table

    table = Table(title=title)
    keys = list(rows[0])
    for k in keys:
        table.add_column(k, justify="left" if k in ("model", "family", "bias") else "right")
    for r in rows:
        table.add_row(*[_cell(r[k]) for k in keys])
    console().print(table)


def _cell(v: Any) -> str:
    """A table cell: ints with separators, floats to 4 significant digits, "n/a" for None."""
    if v is None:
        return "n/a"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def print_count_dict(d: dict, title: str) -> None:
    from attnid.theory import Component, Count

    spec = AttentionSpec.from_dict(d["spec"])
    print_count(Count(spec, {k: Component(**v) for k, v in d["components"].items()}), title)


def read_ahead(*models: str) -> None:
    """Start reading each local checkpoint's first units in the background (`attnid.readahead`),
    before torch is imported: the disk works while the imports run."""
    from attnid import readahead

    for m in models:
        readahead.checkpoint(m)


def sized_progress(*models: str, above: int, always: bool = False) -> Progress:
    """A `Progress` shown when the models' safetensors files hold more than ``above`` bytes (a
    small model finishes before a bar would say anything), or ``always`` (work that takes long
    at any size: a refinement's steps). ``models`` as the commands take them:
    a directory, its ``config.json`` or a ``.safetensors`` file, or a cached hub id."""
    from attnid.adapters.config import model_path
    from attnid.progress import Progress

    size = 0
    for m in models:
        p = model_path(m)
        d = p if p.is_dir() else p.parent
        size += sum(f.stat().st_size for f in d.glob("*.safetensors")) if d.is_dir() else 0
    return Progress(enabled=always or size > above)


def narrow_table(title: str, columns: list[str]) -> Any:
    """A rich table whose headers of several words stand on two lines (split at the last
    space), so that a report fits about 100 columns; every column right-aligned."""
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        head, _, tail = col.rpartition(" ")
        table.add_column(f"{head}\n{tail}" if head else col, justify="right")
    return table


def emit_json(obj: Any) -> None:
    """Print ``obj`` as strict JSON: non-finite floats (an infinite spectral gap) become null."""
    typer.echo(json.dumps(finite(obj), indent=2, allow_nan=False))


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by None (JSON has no inf or nan)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def print_count(result: Count, title: str | None = None) -> None:
    from rich.table import Table

    table = Table(title=title or f"attention layer: {result.spec.describe()}")
    table.add_column("component")
    table.add_column("params", justify="right")
    table.add_column("unidentified", justify="right")
    table.add_column("near-unidentified", justify="right")
    for name, c in result.components.items():
        table.add_row(name, f"{c.params:,}", f"{c.unidentified:,}", f"{c.near_unidentified:,}")
    table.add_section()
    table.add_row("total", f"{result.total:,}", f"{result.unidentified:,}",
                  f"{result.near_unidentified:,}")
    out = console()
    out.print(table)
    out.print(f"identified {result.identified:,}   unidentified ratio {result.ratio:.4f}")
