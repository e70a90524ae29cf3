"""``attnid audit``: per-layer, per-head imbalance of a checkpoint (read only)."""

from __future__ import annotations

from typing import Annotated

import typer

from attnid.cli.app import Json, app, console, emit_json


@app.command("audit")
def audit_cmd(
    model: Annotated[str, typer.Argument(
        help="Model directory, config.json, .safetensors file, or org/name from the local Hugging "
             "Face cache.")],
    plot: Annotated[str | None, typer.Option("--plot", help="Write a PNG heat map (layers x heads).")] = None,
    json_out: Json = False,
) -> None:
    """How far a checkpoint sits from its balanced point, per layer and head (never modifies it).

    beta_* are normalised (0 = balanced, at most 1); removable_norm is the weight norm that
    rebalancing would remove.
    """
    from pathlib import Path

    from attnid.checkpoint.audit import audit, heat_map
    from attnid.errors import AttnidError, require

    if plot:  # refuse before the work, not after it
        require("matplotlib", "report")
        if not Path(plot).resolve().parent.is_dir():
            raise AttnidError(f"--plot {plot}: its folder does not exist")
    report = audit(model)
    if plot:
        heat_map(report, plot)
    if json_out:
        emit_json(report)
        return
    _print(report)


def _print(report: dict) -> None:
    from rich.table import Table

    table = Table(title=f"{report['model']}  ({report['architecture']}, {report['spec']}, {report['dtype']})")
    for col in ("layer", "beta_qk med/max", "beta_vo med/max", "tau_qk med", "tau_vo med",
                "key bias invisible", "b_V foldable", "removable norm", "removable share"):
        table.add_column(col, justify="right")
    for r in report["layers"]:
        table.add_row(str(r["layer"]), _mm(r["beta_qk"]), _mm(r["beta_vo"]), f"{_med(r['tau_qk']):.3g}",
                      f"{_med(r['tau_vo']):.3g}",
                      "-" if r["key_bias_invisible"] is None else f"{_med(r['key_bias_invisible']):.2f}",
                      "-" if r["value_bias_foldable"] is None else f"{r['value_bias_foldable']:.3g}",
                      f"{r['removable_norm']:.3g}", f"{r['removable_share']:.3f}")
    out = console()
    out.print(table)
    s = report["summary"]
    out.print(f"beta_qk median {s['beta_qk_median']:.3f} max {s['beta_qk_max']:.3f}   "
              f"beta_vo median {s['beta_vo_median']:.3f} max {s['beta_vo_max']:.3f}   "
              f"removable norm {s['removable_norm']:.3g}")


def _med(x) -> float:
    xs = sorted(x if isinstance(x, list) else [x])
    return xs[len(xs) // 2]


def _mm(x) -> str:
    xs = x if isinstance(x, list) else [x]
    return f"{_med(xs):.3f}/{max(xs):.3f}"
