"""`attnid reproduce`: every claim of the paper, with its evidence and a verdict.

Writes under ``out``: ``tables/`` (CSV, JSON, Markdown), ``figures/`` (PNG), ``report.md``,
a self-contained ``report.html`` (figures embedded) and ``summary.json`` (the claims).

The report is assembled from *sections*. A section is a function ``(ctx: Context) ->
Section`` (`attnid.paper.document`): it does its own work at the size its scale asks for
(`attnid.paper.scales.sizes_of`; ``ctx.quick`` for the sections that know only that), writes
its figures (PNG) under ``ctx.figures``, reports its stages through
``ctx.progress.stage(...)`` and returns

    Section(title, text,            # Markdown text under the title
            tables=(Table(stem, rows, columns={key: header}, notes=(...)), ...),
            figures=(Figure(path, caption), ...),   # caption: one or two sentences
            claims=(Claim(section, claim, holds, evidence), ...))

:func:`reproduce` writes each table to ``tables/<stem>.{csv,json,md}``, puts failing
claims first in the summary, and renders both report files. :data:`SECTIONS` lists the
sections in report order; a new one plugs in by adding its function there (or passing
``extra=`` to :func:`reproduce`).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure as MplFigure

from attnid.arbiter.compare import verify
from attnid.arbiter.rank import randomize_
from attnid.attention import Attention
from attnid.errors import AttnidError
from attnid.paper.document import (
    Claim,
    Context,
    Figure,
    Section,
    Table,
    render_html,
    render_markdown,
    write_table,
)
from attnid.paper.experiment import load_experiment, run_experiment
from attnid.paper.pretrained import pretrained_section
from attnid.paper.scales import SIZES, RunContext, experiment_options, sizes_of
from attnid.paper.training import training_section
from attnid.paper.whole import whole_model_section
from attnid.progress import Progress
from attnid.spec import AttentionSpec
from attnid.theory import count


def _claim(claim: str, holds: bool, evidence: str, section: str) -> Claim:
    return Claim(section, claim, bool(holds), evidence)


# ---- Table 1: ratio against heads -------------------------------------------------------
def table1(widths: list[int]) -> tuple[list[dict], list[Claim]]:
    rows = []
    for d in widths:
        for H in [h for h in range(1, d + 1) if d % h == 0 and h <= 8]:
            spec = AttentionSpec(d_model=d, n_heads=H)
            v = verify(spec, confirm=False)
            c = v.theory
            rows.append({"d_model": d, "heads": H, "params": c.total, "unidentified_theory": c.unidentified,
                         "unidentified_arbiter": v.arbiter.nullity, "ratio_theory": c.ratio,
                         "one_over_2H": 1 / (2 * H), "agree": v.agree})
    n_ok = sum(r["agree"] for r in rows)
    exact = all(math.isclose(r["ratio_theory"], r["one_over_2H"]) for r in rows)
    six = 1 - count(AttentionSpec(d_model=12, n_heads=6)).ratio
    claims = [
        _claim("unidentified share of plain MHA is 1/(2H) (1/2 for one head)", exact and n_ok == len(rows),
               f"closed form = 1/(2H) in all {len(rows)} cells; arbiter agrees in {n_ok}/{len(rows)}",
               "Table 1"),
        _claim("6 heads leave 11/12 = 91.7% of the parameters identified (the paper prints 83%)",
               math.isclose(six, 11 / 12), f"identified share for H=6: {six:.4f}", "Table 1"),
    ]
    return rows, claims


def figure1(rows: list[dict], path: Path) -> Path:
    fig = MplFigure(figsize=(6.5, 4.2))
    ax = fig.subplots()
    widths = sorted({r["d_model"] for r in rows})
    hs = [h / 10 for h in range(10, 81)]
    ax.plot(hs, [1 / (2 * h) for h in hs], "k-", lw=1, label="closed form 1/(2H)", zorder=1)
    markers = "os^Dv"
    for i, d in enumerate(widths):  # hollow markers of shrinking size: coinciding points stay visible
        sub = [r for r in rows if r["d_model"] == d]
        ax.plot([r["heads"] for r in sub], [r["unidentified_arbiter"] / r["params"] for r in sub],
                markers[i % len(markers)], ms=11 - 2 * i, mfc="none", mew=1.3, label=f"arbiter, d_model={d}")
    ax.set_xlabel("heads H")
    ax.set_ylabel("unidentified / total parameters")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path


def figure1_caption(rows: list[dict]) -> str:
    """Fig. 1's caption, from the rows it plots."""
    on = sum(math.isclose(r["unidentified_arbiter"] / r["params"], 1 / (2 * r["heads"])) for r in rows)
    widths = sorted({r["d_model"] for r in rows})
    text = (f"Unidentified share of a plain attention layer against its number of heads. The arbiter's "
            f"counts (markers, one per width: d_model {', '.join(map(str, widths))}) lie on the closed form "
            f"1/(2H) in {on} of {len(rows)} cells")
    return text + (": the share depends on H only." if on == len(rows) else ".")


# ---- Table 2: biases --------------------------------------------------------------------
def table2(d: int) -> tuple[list[dict], list[Claim]]:
    rows = []
    for H in (1, 4):
        for k in range(5):
            for subset in itertools.combinations("qkvo", k):
                spec = AttentionSpec(d_model=d, n_heads=H, bias="".join(subset))
                v = verify(spec, confirm=False)
                comps = v.theory.components
                rows.append({"heads": H, "biases": "".join(subset) or "-", "params": v.theory.total,
                             "unidentified_theory": v.theory.unidentified,
                             "unidentified_arbiter": v.arbiter.nullity,
                             "key_bias_unidentified": comps.get("key_bias_translation").unidentified
                             if "key_bias_translation" in comps else 0,
                             "value_bias_unidentified": comps["value_bias_translation"].unidentified
                             if "value_bias_translation" in comps else 0, "agree": v.agree})
    n_ok = sum(r["agree"] for r in rows)
    kb_err, fold_err = _bias_demos(d)
    claims = [
        _claim("bias counts (every subset of q, k, v, o; one and several heads) match the arbiter",
               n_ok == len(rows), f"{n_ok}/{len(rows)} agree", "Table 2"),
        _claim("the key bias has no effect at all (softmax ignores row constants)", kb_err < 1e-12,
               f"a random key-bias change of norm 100 moves outputs by {kb_err:.1e} (relative, float64)",
               "Table 2"),
        _claim("value and output biases act only through their sum b_O + sum_h b_V W_O", fold_err < 1e-12,
               f"folding b_V into b_O changes outputs by {fold_err:.1e} (relative, float64)", "Table 2"),
    ]
    return rows, claims


def _bias_demos(d: int) -> tuple[float, float]:
    spec = AttentionSpec(d_model=d, n_heads=4, n_kv_heads=2, bias="qkvo")
    layer = randomize_(Attention(spec).double(), 0)
    x = torch.randn(8, 12, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = layer(x)
        shift = torch.randn_like(layer.b_K)
        layer.b_K += 100 * shift / shift.norm()
        kb = float((layer(x) - y).norm() / y.norm())
        kv_group = torch.arange(spec.n_heads) // spec.kv_group_size
        layer.b_O += torch.einsum("hv,hvd->d", layer.b_V[kv_group], layer.W_O)
        layer.b_V.zero_()
        fold = float((layer(x) - y).norm() / y.norm())
    return kb, fold


# ---- Table 3: modern variants -------------------------------------------------------------
VARIANTS = [
    ("MHA", dict(d_model=16, n_heads=4)),
    ("GQA (G=2)", dict(d_model=16, n_heads=4, n_kv_heads=2)),
    ("MQA", dict(d_model=16, n_heads=4, n_kv_heads=1)),
    ("full RoPE, half pairing", dict(d_model=16, n_heads=4, rope=1.0)),
    ("full RoPE, interleaved", dict(d_model=16, n_heads=4, rope=1.0, rope_pairing="interleaved")),
    ("partial RoPE 1/2", dict(d_model=16, n_heads=4, rope=0.5)),
    ("partial RoPE 1/2 + key bias", dict(d_model=16, n_heads=4, rope=0.5, bias="k")),
    ("full RoPE + key bias", dict(d_model=16, n_heads=4, rope=1.0, bias="k")),
    ("GQA + full RoPE", dict(d_model=16, n_heads=4, n_kv_heads=2, rope=1.0)),
    ("MQA + partial RoPE + qkv biases", dict(d_model=16, n_heads=4, n_kv_heads=1, rope=0.5, bias="qkv")),
    ("QK-norm", dict(d_model=16, n_heads=4, qk_norm="head")),
    ("QK-norm, eps = 0", dict(d_model=16, n_heads=4, qk_norm="head", qk_norm_eps=0.0)),
    ("QK-norm + GQA + full RoPE", dict(d_model=16, n_heads=4, n_kv_heads=2, rope=1.0, qk_norm="head")),
    ("head_dim 6 > d_model 4", dict(d_model=4, n_heads=2, head_dim=6)),
    ("value bias without output bias", dict(d_model=8, n_heads=4, n_kv_heads=2, bias="v")),
]


def table3(confirm: bool = True) -> tuple[list[dict], list[Claim]]:
    rows = []
    for label, kw in VARIANTS:
        spec = AttentionSpec(**kw)
        v = verify(spec, confirm=True if confirm else None)  # None: a second look where needed
        rows.append({"variant": label, "spec": spec.describe(), "params": v.theory.total,
                     "unidentified_theory": v.theory.unidentified, "unidentified_arbiter": v.arbiter.nullity,
                     "near_theory": v.theory.near_unidentified, "near_arbiter": v.arbiter.near_nullity,
                     "ratio": round(v.theory.ratio, 5), "stable": v.stable, "agree": v.agree})
    n_ok = sum(r["agree"] for r in rows)
    by = {r["variant"]: r for r in rows}
    claims = [
        _claim("counts for RoPE, GQA/MQA, QK-norm and their combinations match the arbiter",
               n_ok == len(rows), f"{n_ok}/{len(rows)} agree"
               + (" (each confirmed at a second seed)" if confirm else
                  " (a second seed wherever the first look was borderline)"), "Table 3"),
        _claim("RoPE and GQA raise the identified share",
               by["full RoPE, half pairing"]["ratio"] < by["MHA"]["ratio"]
               and by["GQA (G=2)"]["ratio"] < by["MHA"]["ratio"],
               f"unidentified ratio: MHA {by['MHA']['ratio']}, GQA {by['GQA (G=2)']['ratio']}, "
               f"full RoPE {by['full RoPE, half pairing']['ratio']}", "Table 3"),
        _claim("attention is never fully identified", all(r["unidentified_theory"] > 0 for r in rows),
               f"smallest unidentified count across variants: {min(r['unidentified_theory'] for r in rows)}",
               "Table 3"),
    ]
    return rows, claims


# ---- Table 4: model families ----------------------------------------------------------------
TABLE4_COLUMNS = {"model": "model", "family": "family", "layers": "layers", "heads": "heads / kv",
                  "head_dim": "d_head", "bias": "bias", "rope": "RoPE", "qk_norm": "QK-norm",
                  "attention_params": "attention params", "unidentified": "unidentified",
                  "ratio": "ratio", "qk_unid_per_layer": "QK gauge unid./layer",
                  "qk_unid_no_rope": "QK gauge unid./layer, no RoPE"}


def table4(whole_numeric: bool = True) -> tuple[list[dict], list[Claim], list[dict], tuple[str, ...]]:
    """All rows, the claims, and the compact view shown in the report with its footnotes.

    ``whole_numeric=False`` leaves out the whole-model cells (``model_params``, ``whole_*``) of
    the families without a closed form: the whole-model arbiter on their reduced configs is
    most of this table's time."""
    from attnid.adapters.config import bundled, load_config
    from attnid.adapters.registry import adapter_for
    from attnid.report.models import model_report, summary_row

    reports = [model_report(n, with_params=whole_numeric or adapter_for(load_config(n)[1]).closed_form)
               for n in bundled()]
    rows = [summary_row(r) for r in reports]
    llama = next(r for r in rows if r["model"] == "Llama-2-70b")
    claims = [_claim("Llama-2-70B: GQA leaves 131,072 QK-unidentified parameters per layer against "
                     "1,048,576 for MHA (counted without RoPE, as the paper does)",
                     llama["qk_unid_no_rope"] == 131_072 and llama["qk_unid_no_rope_if_mha"] == 1_048_576,
                     f"{llama['qk_unid_no_rope']:,} vs {llama['qk_unid_no_rope_if_mha']:,}; with its RoPE "
                     f"only {llama['qk_unid_per_layer']:,} per layer", "Table 4")]
    view, notes = _table4_view(reports, rows)
    return rows, claims, view, notes


def _table4_view(reports: list[dict], rows: list[dict]) -> tuple[list[dict], tuple[str, ...]]:
    view, notes = [], []
    for rep, row in zip(reports, rows, strict=True):
        v = {k: row.get(k) for k in TABLE4_COLUMNS}
        if row.get("heads") is not None:
            v["heads"] = f"{row['heads']} / {row['kv_heads']}"
        if rep.get("closed_form", True):
            view.append(v)
            continue
        mark = "†" * (len(notes) + 1)
        nr = rep.get("numeric_reduced") or {}
        why = str(rep.get("note", "")).split(";")[0].removeprefix("no closed form: ")
        for k in ("heads", "head_dim", "bias", "rope", "qk_norm", "unidentified", "ratio",
                  "qk_unid_per_layer", "qk_unid_no_rope"):
            v[k] = "n/a"
        v["unidentified"] = f"see {mark}"
        notes.append(f"{mark} {row['model']}: no closed form ({why}). The Jacobian-rank arbiter counted one "
                     f"layer of the same structure at a reduced size ({nr.get('params', '?')} parameters): "
                     f"{nr.get('unidentified', '?')} unidentified, and "
                     f"{nr.get('near_unidentified', '?')} more "
                     "near-unidentified (null only when the normalization's eps is 0).")
        view.append(v)
    notes.append("QK gauge unid./layer: unidentified directions of one layer's query/key weights (the "
                 "QK gauge; key-bias translation and QK-norm gain transfer are counted in 'unidentified', "
                 "not here: under QK-norm, as in Qwen3, the gauge is broken and this reads 0 while the "
                 "gain transfer and the near-unidentified scales remain); 'no RoPE' counts as the paper "
                 "does, ignoring the rotation. Ratio: unidentified / attention parameters.")
    return view, tuple(notes)


# ---- Table 5: single-head equivalence --------------------------------------------------------
def table5(arbiter_widths: list[int]) -> tuple[list[dict], list[Claim]]:
    rows = []
    for E, H in [(e, h) for e in (4, 6, 8, 64, 384, 768, 4096) for h in (2, 3, 4, 6, 8, 12, 32)
                 if e % h == 0 and e >= h]:
        target = count(AttentionSpec(d_model=E, n_heads=H)).identified
        E0 = math.ceil(E * math.sqrt(2 - 1 / H))
        ident = lambda w: count(AttentionSpec(d_model=w, n_heads=1)).identified  # noqa: E731
        row = {"E": E, "H": H, "identified_H_heads": target, "E0_formula": E0,
               "identified_single_E0": ident(E0), "identified_single_E0_minus_1": ident(E0 - 1),
               "identified_single_E": ident(E), "formula_is_minimal": ident(E0) >= target > ident(E0 - 1)}
        if E in arbiter_widths:  # direct counting with the arbiter
            row["arbiter_identified_single_E0"] = verify(AttentionSpec(d_model=E0, n_heads=1),
                                                         confirm=False).arbiter.rank
            row["arbiter_identified_H_heads"] = verify(AttentionSpec(d_model=E, n_heads=H),
                                                       confirm=False).arbiter.rank
        rows.append(row)
    ok = all(r["formula_is_minimal"] for r in rows)
    arb = [r for r in rows if "arbiter_identified_single_E0" in r]
    arb_ok = all(r["arbiter_identified_single_E0"] >= r["arbiter_identified_H_heads"] for r in arb)
    equal_width = all(r["identified_single_E"] < r["identified_H_heads"] for r in rows)
    claims = [
        _claim("one head matches an H-head layer's identified count only from width "
               "E0 = ceil(E sqrt(2 - 1/H))",
               ok and arb_ok, f"minimal in {sum(r['formula_is_minimal'] for r in rows)}/{len(rows)} cases; "
               f"arbiter confirms {len(arb)} small cases", "Table 5"),
        _claim("at equal width one head is always less identified than H > 1 heads", equal_width,
               f"{len(rows)} (E, H) pairs checked", "Table 5"),
    ]
    return rows, claims


# ---- sections -------------------------------------------------------------------------------
def table1_section(ctx: Context) -> Section:
    ctx.progress.stage("Table 1: unidentified share against heads (closed form and arbiter)")
    rows, claims = table1(list(sizes_of(ctx).table1_widths))
    fig1 = figure1(rows, ctx.figures / "fig1_ratio_vs_heads.png")
    return Section("Table 1: unidentified share against heads",
                   "Plain multi-head attention: the closed form and the Jacobian-rank arbiter.",
                   (Table("table1_ratio_vs_heads", rows,
                          {"d_model": "d_model", "heads": "H", "params": "params",
                           "unidentified_theory": "unid. (theory)", "unidentified_arbiter": "unid. (arbiter)",
                           "ratio_theory": "ratio", "one_over_2H": "1/(2H)", "agree": "agree"}),),
                   (Figure(fig1, figure1_caption(rows),
                           "Unidentified share against the number of heads: a 1/(2H) curve and the "
                           "arbiter's count for each width as hollow markers."),),
                   tuple(claims))


def table2_section(ctx: Context) -> Section:
    ctx.progress.stage("Table 2: biases")
    rows, claims = table2(8)
    return Section("Table 2: every subset of the biases", "d_model = 8, one and four heads.",
                   (Table("table2_biases", rows,
                          {"heads": "H", "biases": "biases", "params": "params",
                           "unidentified_theory": "unid. (theory)", "unidentified_arbiter": "unid. (arbiter)",
                           "key_bias_unidentified": "key bias unid.",
                           "value_bias_unidentified": "value bias unid.", "agree": "agree"}),),
                   (), tuple(claims))


def table3_section(ctx: Context) -> Section:
    ctx.progress.stage("Table 3: modern variants")
    confirm = sizes_of(ctx).table3_confirm
    rows, claims = table3(confirm)
    return Section("Table 3: RoPE, GQA/MQA, QK-norm",
                   "Each count checked by the arbiter"
                   + (", confirmed at a second seed." if confirm else "."),
                   (Table("table3_variants", rows,
                          {"variant": "variant", "params": "params", "unidentified_theory": "unid. (theory)",
                           "unidentified_arbiter": "unid. (arbiter)", "near_theory": "near (theory)",
                           "near_arbiter": "near (arbiter)", "ratio": "ratio", "agree": "agree"},
                          ("near: near-unidentified, null at QK-norm eps = 0 but not at the given eps. "
                           "The full spec of each variant is in the CSV.",)),), (), tuple(claims))


def table4_section(ctx: Context) -> Section:
    ctx.progress.stage("Table 4: model families")
    whole_numeric = sizes_of(ctx).table4_whole_numeric
    rows, claims, view, notes = table4(whole_numeric)
    if not whole_numeric:
        notes += ("Whole-model columns of the CSV for the families without a closed form: at "
                  "--scale full only.",)
    return Section("Table 4: real model families", "Counted from each model's configuration (bundled).",
                   (Table("table4_models", rows, TABLE4_COLUMNS, notes, view=view),), (), tuple(claims))


def table5_section(ctx: Context) -> Section:
    ctx.progress.stage("Table 5: single-head equivalence")
    rows, claims = table5(list(sizes_of(ctx).table5_arbiter_widths))
    return Section("Table 5: single-head equivalence (Section 4.10)",
                   "E0 = ceil(E sqrt(2 - 1/H)): the smallest width at which one head is as identified "
                   "as H heads.",
                   (Table("table5_single_head", rows,
                          {"E": "E", "H": "H", "identified_H_heads": "identified, H heads",
                           "E0_formula": "E0",
                           "identified_single_E0": "1 head at E0",
                           "identified_single_E0_minus_1": "1 head at E0-1",
                           "identified_single_E": "1 head at E", "formula_is_minimal": "E0 minimal",
                           "arbiter_identified_single_E0": "arbiter, 1 head at E0",
                           "arbiter_identified_H_heads": "arbiter, H heads"},
                          ("arbiter columns: counted directly for the small widths only (— elsewhere).",)),),
                   (), tuple(claims))


def training_sections(ctx: Context) -> list[Section]:
    """The training experiments at the context's scale, or read from ``ctx.from_runs``."""
    from_runs = getattr(ctx, "from_runs", None)
    if from_runs is not None:
        ctx.progress.stage(f"training experiments: reading the runs in {from_runs}")
        data = load_experiment(Path(from_runs))
    else:
        scale = sizes_of(ctx).training
        ctx.progress.stage(f"training experiments ({scale} scale)")
        data = run_experiment(ctx.out / "experiment", **experiment_options(ctx), progress=ctx.progress)
    ctx.progress.stage("drawing training figures")
    return [training_section(data, ctx.figures)]


SectionFn = Callable[[Context], "Section | list[Section]"]
# the report, in order; other sections plug in here
SECTIONS: list[SectionFn] = [table1_section, table2_section, table3_section, table4_section, table5_section,
                             whole_model_section, training_sections, pretrained_section]


def _cpu_seconds() -> float:
    """User and system CPU seconds of this process and its finished children (every core)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


# ---- assembling -------------------------------------------------------------------------------
TITLE = "attnid reproduction report"
INTRO = ("Claims of *Multi-Head Self Attention is a Parameter Identification Mechanism* "
         "(arXiv:2609.01231) and what attnid adds, each with its evidence and a verdict.")


def reproduce(out: str | Path = "attnid-report", *, scale: str = "default", device: str = "cpu",
              jobs: int = 1, from_runs: str | Path | None = None, progress: Progress | None = None,
              extra: Sequence[SectionFn] = ()) -> dict[str, Any]:
    """Run every section at ``scale`` (`attnid.paper.scales`), write the tables, ``report.md``,
    ``report.html`` and ``summary.json``; return the summary (claims, how many hold, seconds,
    and each section's wall and CPU seconds).

    ``from_runs``: the training section reads that experiment folder instead of training."""
    if scale not in SIZES:
        raise AttnidError(f"unknown scale {scale!r}: use one of {', '.join(SIZES)}")
    start = time.perf_counter()
    ctx = RunContext(Path(out), SIZES[scale].pretrained_quick,
                     progress if progress is not None else Progress(enabled=False), scale=scale,
                     device=device, jobs=jobs, from_runs=Path(from_runs) if from_runs is not None else None)
    (ctx.out / "tables").mkdir(parents=True, exist_ok=True)
    ctx.figures.mkdir(parents=True, exist_ok=True)
    sections: list[Section] = []
    timing: list[dict[str, Any]] = []
    for fn in [*SECTIONS, *extra]:
        wall, cpu = time.perf_counter(), _cpu_seconds()
        got = fn(ctx)
        timing.append({"section": fn.__name__, "wall_s": round(time.perf_counter() - wall, 2),
                       "cpu_s": round(_cpu_seconds() - cpu, 2)})
        sections += got if isinstance(got, list) else [got]
    ctx.progress.stage("writing the report")
    for s in sections:
        for t in s.tables:
            write_table(t.rows, ctx.out / "tables" / t.stem)
    claims = [c.to_dict() for s in sections for c in s.claims]
    summary = {"claims": claims, "holds": sum(c["holds"] for c in claims), "total": len(claims),
               "scale": scale, "device": device, "seconds": time.perf_counter() - start,
               "cpu_seconds": _cpu_seconds(), "sections": timing}
    (ctx.out / "summary.json").write_text(json.dumps(summary, indent=2))
    status = f"{scale} run, {summary['seconds']:.0f} s"
    if from_runs is not None:
        status += f", training read from {from_runs}"
    md = render_markdown(TITLE, INTRO, sections, status)
    (ctx.out / "report.md").write_text(md)
    (ctx.out / "report.html").write_text(render_html(md, ctx.figures, TITLE))
    return summary
