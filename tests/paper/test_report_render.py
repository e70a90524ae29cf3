"""The report's rendering and the progress lines: pipes, failing claims, captions, non-TTY output."""

from __future__ import annotations

import io
import re
from pathlib import Path

from attnid.paper.document import Claim, Figure, Section, Table, markdown_table, render_html, render_markdown
from attnid.progress import Progress

PNG = (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x06\x00\x00\x00\x1f\x15"
       b"\xc4\x89\x00\x00\x00\rIDATx\x9cc\xf8\x0f\x00\x00\x01\x01\x00\x05\x18\xd8N\x00\x00\x00\x00IEND\xaeB`\x82")


def _report(tmp_path: Path) -> tuple[str, str]:
    (tmp_path / "f.png").write_bytes(PNG)
    claims = (Claim("T", "a true claim about b_K", True, "max |grad b_K| 1e-9, median |grad b_Q| 1e-2"),
              Claim("T", "a *false* claim", False, "x | y = 3"))
    sections = [Section("Section one", "Some text.", (Table("t", [{"a": 1, "b": "p|q"}], notes=("note",)),),
                        (Figure(tmp_path / "f.png", "What to see."),), claims)]
    md = render_markdown("Report", "intro", sections, "quick run")
    return md, render_html(md, tmp_path)


def test_pipe_in_evidence_does_not_split_a_row(tmp_path):
    _, html = _report(tmp_path)
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", html, flags=re.S)
    for row in rows:
        assert row.count("<td") in (0, 2, 4), row  # every body row keeps its column count
    assert "max |grad b_K| 1e-9" in html and "<td>p|q</td>" in html
    assert "\\|" in markdown_table([{"e": "a|b"}])


def test_failing_claims_come_first_and_are_red_in_html(tmp_path):
    md, html = _report(tmp_path)
    summary = md.split("## Summary")[1].split("## Section one")[0]
    assert summary.index("a \\*false\\* claim") < summary.index("a true claim")
    fail_rows = re.findall(r'<tr class="fail">(.*?)</tr>', html, flags=re.S)
    assert len(fail_rows) == 1 and "false" in fail_rows[0]
    assert '<li class="fail">' in html and "tr.fail td" in html and "#b00000" in html
    assert "**" not in html and "`" not in html  # Markdown rendered, not shown raw


def test_figures_are_embedded_with_captions(tmp_path):
    md, html = _report(tmp_path)
    assert "*Figure 1.* What to see." in md
    assert html.count("data:image/png;base64,") == 1 and "What to see." in html


def test_non_tty_progress_prints_timestamped_lines_with_eta():
    stream = io.StringIO()
    ticks = iter(range(0, 1000, 10))
    p = Progress(stream, clock=lambda: float(next(ticks)))
    assert not p.rich
    p.stage("Table 1")
    p.run(1, 3, "sgd")
    p.run(2, 3, "adamw")
    bar = p.steps(10, "adamw")
    for step in range(1, 11):
        bar(step, 2.5)
    bar.close()
    p.close()
    lines = stream.getvalue().splitlines()
    assert all(re.match(r"\d\d:\d\d:\d\d ", ln) for ln in lines), lines
    assert lines[0].endswith("Table 1") and lines[1].endswith("run 1/3 sgd")
    assert re.search(r"run 2/3 adamw \(ETA \d\d:\d\d:\d\d, 0:20 left\)", lines[2]), lines[2]
    assert sum("adamw: step" in ln for ln in lines) == 10 and "step 10/10" in lines[-1]


def test_disabled_progress_prints_nothing():
    stream = io.StringIO()
    p = Progress(stream, enabled=False)
    p.stage("x")
    p.run(1, 2, "y")
    p.steps(5)(1, 1.0)
    assert stream.getvalue() == ""


def test_piped_tables_keep_their_width(capsys):
    from attnid.cli.app import _print_rows

    rows = [{f"a_rather_long_column_{i}": f"value_{i}_{j}" for i in range(12)} for j in range(3)]
    _print_rows(rows, "wide")
    lines = capsys.readouterr().out.splitlines()
    body = [ln for ln in lines if "value_0_" in ln]
    assert len(body) == 3 and all("value_11_" in ln for ln in body), lines  # one line per row
    assert max(len(ln) for ln in lines) > 250


def test_every_figure_has_alt_text_that_says_what_it_shows_never_the_file_name(tmp_path):
    (tmp_path / "fig_a.png").write_bytes(PNG)
    (tmp_path / "fig_b.png").write_bytes(PNG)
    alt = "Two panels [left, right] of *rho* over steps"
    figures = (Figure(tmp_path / "fig_a.png", "Caption A. More.", alt=alt),
               Figure(tmp_path / "fig_b.png", "Loss of the four cases over steps. The rest."))
    md = render_markdown("Report", "intro", [Section("S", figures=figures)], "quick run")
    html = render_html(md, tmp_path)
    alts = re.findall(r'<img src="data:image/png;base64,[^"]*" alt="([^"]*)"', html)
    assert alts == ["Figure 1: Two panels [left, right] of *rho* over steps",  # markup kept as text
                    "Figure 2: Loss of the four cases over steps"], alts  # default: caption's 1st sentence
    assert "fig_a" not in " ".join(alts) and "fig_b" not in " ".join(alts)
    assert "![Figure 2: Loss of the four cases over steps](figures/fig_b.png)" in md


def test_the_eta_counts_the_runs_of_the_current_stage_only():
    stream = io.StringIO()
    now = [0.0]
    p = Progress(stream, clock=lambda: now[0])
    p.stage("training")
    for i in (1, 2):  # two runs of 100 s
        p.run(i, 2, "slow")
        now[0] += 100
    p.stage("fine-tuning")
    p.run(1, 3, "fast")  # one run of 10 s: the 2 left take 20 s, not 2 * 70 s
    now[0] += 10
    p.run(2, 3, "fast")
    last = stream.getvalue().splitlines()[-1]
    assert re.search(r"run 2/3 fast \(ETA \d\d:\d\d:\d\d, 0:20 left\)", last), last
