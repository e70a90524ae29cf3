"""``attnid audit``: per-layer, per-head imbalance of a checkpoint (read only)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from attnid.cli.app import Json, app, console, emit_json, narrow_table

if TYPE_CHECKING:
    from attnid.checkpoint.audit import Audit


@app.command("audit")
def audit_cmd(
    model: Annotated[str, typer.Argument(
        help="Model directory, config.json, .safetensors file, or org/name from the local Hugging "
             "Face cache.")],
    plot: Annotated[str | None, typer.Option(
        "--plot", help="Write a heat map (layers x heads); the suffix picks the format: .png, .svg, "
        ".pdf or another that matplotlib writes.")] = None,
    json_out: Json = False,
) -> None:
    """How far a checkpoint sits from its balanced point, per layer and head (never modifies it).

    imbalance_* is ||C|| over the Gram scale (0 = balanced, at most 1); med is the median over
    the layer's heads; removable_norm is the weight norm that rebalancing would remove.
    """
    from pathlib import Path

    from attnid.checkpoint.audit import audit, heat_map
    from attnid.errors import AttnidError, require_extras

    require_extras("hf", *(["report"] if plot else []), what="attnid audit" + (" --plot" if plot else ""))
    if plot:  # refuse before the work, not after it
        if not Path(plot).resolve().parent.is_dir():
            raise AttnidError(f"--plot {plot}: its folder does not exist")
        _check_format(plot)
    result = audit(model)
    if plot:
        heat_map(result, plot)
    if json_out:
        emit_json(result.to_dict())
        return
    _print(result)


def _check_format(plot: str) -> None:
    """The file's suffix must name a format matplotlib writes (it would silently write PNG
    for no suffix, and fail after the work for an unknown one)."""
    from pathlib import Path

    from matplotlib.figure import Figure

    from attnid.errors import AttnidError

    formats = sorted(Figure().canvas.get_supported_filetypes())
    suffix = Path(plot).suffix.lower().lstrip(".")
    if suffix not in formats:
        said = "has no suffix" if not suffix else f"has the suffix .{suffix}, which matplotlib does not write"
        raise AttnidError(f"--plot {plot} {said}; the suffix picks the format: "
                          f"{', '.join('.' + f for f in formats)}")


def _print(result: Audit) -> None:
    table = narrow_table(f"{result.model}  ({result.architecture}, {result.spec}, {result.dtype})",
                         ["layer", "imbalance_qk med/max", "imbalance_vo med/max", "tau_qk med",
                          "tau_vo med", "key bias invisible", "b_V foldable", "removable norm (share)"])
    for layer in result.layers:
        r = layer.row()
        table.add_row(str(r["layer"]), f"{r['imbalance_qk_median']:.3f}/{r['imbalance_qk_max']:.3f}",
                      f"{r['imbalance_vo_median']:.3f}/{r['imbalance_vo_max']:.3f}",
                      f"{r['tau_qk_median']:.3g}", f"{r['tau_vo_median']:.3g}",
                      _or_dash(r["key_bias_invisible_median"], ".2f"),
                      _or_dash(r["value_bias_foldable"], ".3g"),
                      f"{r['removable_norm']:.3g} ({r['removable_share']:.3f})")
    out = console()
    out.print(table)
    s = result.summary
    out.print(f"imbalance_qk median {s.imbalance_qk_median:.3f} max {s.imbalance_qk_max:.3f}   "
              f"imbalance_vo median {s.imbalance_vo_median:.3f} max {s.imbalance_vo_max:.3f}\n"
              f"removable norm {s.removable_norm:.3g}")


def _or_dash(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)
