"""benchmarks/quantize.py's own logic (arguments, the rows a CLI without ``--optimize`` cannot make,
the table), without running a model: the benchmark itself is measured, not tested."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_quantize", ROOT / "benchmarks" / "quantize.py")
assert spec is not None and spec.loader is not None
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_models_are_named():
    args = bench.parse_args(["--model", "a=/x/a", "--model", "b=/y", "--calibration", "c", "--heldout", "h"])
    assert args.models == {"a": Path("/x/a"), "b": Path("/y")}, args.models
    assert args.schemes == ["w4", "w4:64", "w3:64"], args.schemes
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "/x/a", "--calibration", "c", "--heldout", "h"])


@pytest.mark.parametrize(("code", "err", "status"), [
    (2, "error: No such option: --optimize", "not available"),
    (2, "error: --optimize w4: no calibration", "failed: error: --optimize w4: no calibration"),
    (0, "", "ok"),
])
def test_rewrite_status(tmp_path, monkeypatch, code, err, status):
    src = tmp_path / "m"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    calls = []

    def fake_cli(argv):
        calls.append(argv)
        return code, json.dumps({"certified": True}) if code == 0 else "", err, 1.5

    monkeypatch.setattr(bench, "cli", fake_cli)
    r = bench.rewrite(src, "full", "w4:64", Path("calib.txt"), tmp_path / "out")
    assert r["status"] == status, r
    assert calls[0][:3] == ["rewrite", str(src), str(tmp_path / "out")], calls
    assert calls[0][3:5] == ["--optimize", "w4:64"] and "r1,vo,qk,mlp,norm" in calls[0], calls
    q = bench.rewrite(src, "quarot", "", Path("calib.txt"), tmp_path / "out")
    assert "--untie" in calls[-1], calls[-1]  # a tied model is untied before its residual is rotated
    assert q["command"].endswith("--untie"), q


def test_table_marks_each_row():
    ev = {s: {"perplexity": p} for s, p in (("w4", 133.04), ("w4:64", 40.5), ("w3:64", 772.0))}
    data = {"m": {
        "none": {"eval": {"float": {"perplexity": 27.8, "predicted": 4080}, **ev}},
        "quarot": {"eval": ev, "rewrite": {"status": "ok", "seconds": 12.0, "certified": True}},
        "full": {"eval": {}, "rewrite w4": {"status": "not available", "seconds": 3.0}},
        "llmc spinquant": {"eval": ev, "peer": {"all": {"seconds": 26.1}},
                           "diff": {"spinquant": {"certified": False}}},
    }}
    md = bench.table(data, ["w4", "w4:64", "w3:64"])
    lines = md.splitlines()
    assert "float perplexity 27.80 on 4,080" in lines[0], lines[0]
    assert "| quarot | 133.04 | 40.50 | 772.00 | 12 | yes (rewrite's own diff) |" in lines, md
    assert "| full | not available |  |  |  |  |" in lines, md
    assert "| llmc spinquant | 133.04 | 40.50 | 772.00 | 26 | no |" in lines, md
