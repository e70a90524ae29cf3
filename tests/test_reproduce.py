"""`attnid reproduce --quick`: every table and figure exists and every claim holds."""

from __future__ import annotations

import json

from attnid.cli import main


def test_reproduce_quick_writes_everything_and_every_claim_holds(tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["reproduce", "--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for stem in ("table1_ratio_vs_heads", "table2_biases", "table3_variants", "table4_models",
                 "table5_single_head", "training_summary"):
        for ext in ("csv", "json", "md"):
            path = out / "tables" / f"{stem}.{ext}"
            assert path.exists() and path.stat().st_size > 0, path
    for fig in ("fig1_ratio_vs_heads", "fig2_qk", "fig2_vo", "fig3_bias_grads", "fig4_drift_qk",
                "fig4_drift_vo", "fig2_qk_rope", "fig2_qk_gqa", "fig_project"):
        path = out / "figures" / f"{fig}.png"
        assert path.exists() and path.read_bytes()[:4] == b"\x89PNG", path
    summary = json.loads((out / "summary.json").read_text())
    assert summary["total"] >= 30
    failing = [c for c in summary["claims"] if not c["holds"]]
    assert not failing, json.dumps(failing, indent=2)
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 9 and "<table>" in html
    md = (out / "report.md").read_text()
    assert f"{summary['holds']} of {summary['total']} claims hold" in md
    assert f"{summary['holds']}/{summary['total']} claims hold" in printed
    rows = json.loads((out / "tables" / "table4_models.json").read_text())
    assert any(r["model"] == "Llama-2-70b" and r["qk_unid_no_rope"] == 131_072 for r in rows)
