"""The ``attnid`` command line. Thin: parse, call the library, print, exit.

User mistakes (:class:`attnid.AttnidError`, bad flags) print one ``error:`` line on
stderr and exit 2; ``verify`` exits 1 when theory and arbiter disagree.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer
from typer._click import exceptions as click_exceptions

from attnid.errors import AttnidError
from attnid.spec import AttentionSpec
from attnid.theory import Count, count

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Measure and exploit the parameter symmetries of transformer attention.",
)

DModel = Annotated[int, typer.Option("--d-model", help="Model width d.")]
Heads = Annotated[int, typer.Option("--heads", help="Query heads H.")]
KVHeads = Annotated[int | None, typer.Option("--kv-heads", help="Key/value groups G (GQA; 1 = MQA).")]
HeadDim = Annotated[int | None, typer.Option("--head-dim", help="Query/key head size d_k.")]
VHeadDim = Annotated[int | None, typer.Option("--v-head-dim", help="Value head size d_v.")]
Bias = Annotated[str, typer.Option("--bias", help="Which biases exist: a subset of 'qkvo'.")]
Rope = Annotated[float, typer.Option("--rope", help="Fraction of each head's dims that RoPE rotates.")]
RopePairing = Annotated[str, typer.Option("--rope-pairing", help="half | interleaved")]
QKNormOpt = Annotated[str, typer.Option("--qk-norm", help="none | head")]
QKNormEps = Annotated[float, typer.Option("--qk-norm-eps", help="QK-norm epsilon.")]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]


def make_spec(d_model: int, heads: int, kv_heads: int | None, head_dim: int | None,
              v_head_dim: int | None, bias: str, rope: float, rope_pairing: str,
              qk_norm: str, qk_norm_eps: float) -> AttentionSpec:
    return AttentionSpec(
        d_model=d_model, n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim,
        v_head_dim=v_head_dim, bias=bias, rope=rope, rope_pairing=rope_pairing,  # type: ignore[arg-type]
        qk_norm=qk_norm, qk_norm_eps=qk_norm_eps,  # type: ignore[arg-type]
    )


@app.command("count")
def count_cmd(
    d_model: DModel, heads: Heads, kv_heads: KVHeads = None, head_dim: HeadDim = None,
    v_head_dim: VHeadDim = None, bias: Bias = "", rope: Rope = 0.0,
    rope_pairing: RopePairing = "half", qk_norm: QKNormOpt = "none",
    qk_norm_eps: QKNormEps = 1e-6, json_out: Json = False,
) -> None:
    """Closed-form counts of identified and unidentified parameters of one layer."""
    spec = make_spec(d_model, heads, kv_heads, head_dim, v_head_dim, bias, rope,
                     rope_pairing, qk_norm, qk_norm_eps)
    result = count(spec)
    if json_out:
        emit_json(result.to_dict())
    else:
        print_count(result)


@app.command("verify")
def verify_cmd(
    d_model: Annotated[int | None, typer.Option("--d-model", help="Model width d.")] = None,
    heads: Annotated[int | None, typer.Option("--heads", help="Query heads H.")] = None,
    kv_heads: KVHeads = None, head_dim: HeadDim = None,
    v_head_dim: VHeadDim = None, bias: Bias = "", rope: Rope = 0.0,
    rope_pairing: RopePairing = "half", qk_norm: QKNormOpt = "none",
    qk_norm_eps: QKNormEps = 1e-6,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random point.")] = 0,
    confirm: Annotated[bool, typer.Option(
        "--confirm/--no-confirm", help="Recount at a second seed with twice the sequences.")] = True,
    hf_config: Annotated[str | None, typer.Option(
        "--hf-config", help="Check a Hugging Face attention class, reduced from this config.")] = None,
    json_out: Json = False,
) -> None:
    """Arbiter (Jacobian rank, float64) against the closed form; exit 1 on disagreement."""
    if hf_config is not None:
        from attnid.adapters.verify import verify_hf_config

        result = verify_hf_config(hf_config, seed=seed, confirm=confirm)
    else:
        if d_model is None or heads is None:
            raise AttnidError("verify needs --d-model and --heads (or --hf-config)")
        from attnid.verify import verify

        spec = make_spec(d_model, heads, kv_heads, head_dim, v_head_dim, bias, rope,
                         rope_pairing, qk_norm, qk_norm_eps)
        count(spec)  # a spec without a closed form fails here, before any work
        result = verify(spec, seed=seed, confirm=confirm)
    if json_out:
        emit_json(result.to_dict())
    else:
        d = result.to_dict()
        gap = d["spectral_gap"]
        status = "AGREE" if result.agree else "DISAGREE"
        typer.echo(
            f"{status}  {d['model']}\n"
            f"  parameters {d['total']}   unidentified: theory {d['unidentified_theory']}, "
            f"arbiter {d['unidentified_numeric']}   near-unidentified: theory "
            f"{d['near_unidentified_theory']}, arbiter {d['near_unidentified_numeric']}\n"
            f"  spectral gap {'n/a' if gap is None else f'{gap:.2e}'}   stable across seeds: "
            f"{d['stable']}   {d['seconds']:.2f}s"
        )
    raise typer.Exit(0 if result.agree else 1)


def emit_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, default=_json_default, allow_nan=False))


def _json_default(o: Any) -> Any:
    if isinstance(o, float):
        return None
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def print_count(result: Count) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"attention layer: {result.spec.describe()}")
    table.add_column("component")
    table.add_column("params", justify="right")
    table.add_column("unidentified", justify="right")
    table.add_column("near-unidentified", justify="right")
    for name, c in result.components.items():
        table.add_row(name, f"{c.params:,}", f"{c.unidentified:,}", f"{c.near_unidentified:,}")
    table.add_section()
    table.add_row("total", f"{result.total:,}", f"{result.unidentified:,}",
                  f"{result.near_unidentified:,}")
    console = Console(width=100)
    console.print(table)
    console.print(f"identified {result.identified:,}   unidentified ratio {result.ratio:.4f}")


def main(argv: list[str] | None = None) -> int:
    """Entry point: runs the app and maps user errors to one ``error:`` line, exit 2."""
    try:
        app(args=argv, standalone_mode=False)
    except AttnidError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except typer.Exit as e:
        return e.exit_code
    except click_exceptions.UsageError as e:
        print(f"error: {e.format_message()}", file=sys.stderr)
        return 2
    except typer.Abort:
        print("error: aborted", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
