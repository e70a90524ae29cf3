"""`attnid reproduce --quick`, run the way the README shows (a subprocess, output not a terminal):
every table and figure exists, every claim holds, progress lines are timestamped."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_reproduce_quick_writes_everything_and_every_claim_holds(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "attnid", "reproduce", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = proc.stderr.splitlines()
    assert len(err) >= 20 and all(re.match(r"\d\d:\d\d:\d\d ", ln) for ln in err), err[:5]
    assert any(re.search(r"run 5/17 .*\(ETA \d\d:\d\d:\d\d", ln) for ln in err), err
    # no long silence: a line per whole-model check and per step tenth of each MiniLM fine-tune
    assert any(re.search(r"whole model 1/\d+: \S+, closed form against the arbiter", ln) for ln in err), err
    assert any(re.search(r"AdamW lr [\d.e-]+, wd 0\.01, seed 0: step 1/3", ln) for ln in err), err
    for stem in ("table1_ratio_vs_heads", "table2_biases", "table3_variants", "table4_models",
                 "table5_single_head", "training_summary", "whole_model_counts", "whole_model_checks",
                 "pretrained_finetune", "pretrained_seeds", "pretrained_audit"):
        for ext in ("csv", "json", "md"):
            path = out / "tables" / f"{stem}.{ext}"
            assert path.exists() and path.stat().st_size > 0, path
    figs = ("fig1_ratio_vs_heads", "fig2_qk", "fig2_vo", "fig3_bias_grads", "fig4_drift_qk",
            "fig4_drift_vo", "fig2_qk_rope", "fig2_qk_gqa", "fig5_second_order", "fig6_vo_drift",
            "fig_project", "pretrained_finetune", "pretrained_audit")
    for fig in figs:
        path = out / "figures" / f"{fig}.png"
        assert path.exists() and path.read_bytes()[:4] == b"\x89PNG", path
    summary = json.loads((out / "summary.json").read_text())
    assert summary["total"] >= 30
    failing = [c for c in summary["claims"] if not c["holds"]]
    assert not failing, json.dumps(failing, indent=2)
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == len(figs) and "<table>" in html
    assert html.count("<figure") == 0 and html.count("<em>Figure") == len(figs)  # every figure captioned
    alts = re.findall(r'<img src="data:image/png;base64,[^"]*" alt="Figure \d+: ([^"]*)"', html)
    assert len(alts) == len(figs) and all(len(a) > 30 and not any(f in a for f in figs) for a in alts), alts
    assert "**" not in html
    md = (out / "report.md").read_text()
    assert f"{summary['holds']} of {summary['total']} claims hold" in md
    assert f"{summary['holds']}/{summary['total']} claims hold" in proc.stdout
    rows = json.loads((out / "tables" / "table4_models.json").read_text())
    assert any(r["model"] == "Llama-2-70b" and r["qk_unid_no_rope"] == 131_072 for r in rows)
    assert "second order" in md and "n/a" in md.split("## Table 4")[1].split("## Table 5")[0]
    assert "Δbeta_vo" in md.split("## Training")[1].split("\n## ")[0]  # beta_vo_change in the shown table
    assert "same pattern as QK" not in md and "sits near 1/(2H)" not in md


def test_a_section_plugs_into_the_report(tmp_path, monkeypatch):
    from attnid.paper import reproduce as rep
    from attnid.paper.document import Claim, Figure, Section, Table

    png = tmp_path / "dot.png"

    def tiny(ctx: rep.Context) -> Section:
        ctx.progress.stage("tiny section")
        path = ctx.figures / "dot.png"
        fig = rep.MplFigure(figsize=(1, 1))
        fig.subplots().plot([0, 1], [0, 1])
        fig.savefig(path)
        png.write_bytes(path.read_bytes())
        return Section("Tiny", "Text.", (Table("tiny", [{"a": 1, "b": "x|y"}]),),
                       (Figure(path, "A line."),),
                       (Claim("Tiny", "true", True, "e"), Claim("Tiny", "false", False, "e")))

    monkeypatch.setattr(rep, "SECTIONS", [])
    summary = rep.reproduce(tmp_path / "out", quick=True, extra=[tiny])
    assert summary["total"] == 2 and summary["holds"] == 1
    assert (tmp_path / "out" / "tables" / "tiny.csv").read_text().splitlines()[1] == "1,x|y"
    html = (tmp_path / "out" / "report.html").read_text()
    assert html.count('<tr class="fail">') == 1 and "A line." in html and "data:image/png" in html


def test_table4_view_fits_and_explains_every_row():
    from attnid.paper.reproduce import TABLE4_COLUMNS, table4

    rows, _, view, notes = table4()
    assert len(view) == len(rows) and len(TABLE4_COLUMNS) <= 13
    for v in view:
        assert all(v.get(k) not in (None, "") for k in TABLE4_COLUMNS), v
    numeric = [r["model"] for r in rows if r.get("unidentified") is None]
    assert numeric and all(any(m in n and "reduced size" in n for n in notes) for m in numeric), notes


def test_figure1_caption_counts_the_cells_on_the_closed_form():
    from attnid.paper.reproduce import figure1_caption

    rows = [{"d_model": 8, "heads": h, "params": 100 * h, "unidentified_arbiter": 50} for h in (1, 2, 4)]
    assert "in 3 of 3 cells: the share depends on H only" in figure1_caption(rows)
    rows[1] = {**rows[1], "unidentified_arbiter": 51}
    text = figure1_caption(rows)
    assert "in 2 of 3 cells." in text and "depends on H only" not in text, text
