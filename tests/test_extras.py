"""A command that needs a missing extra says so in one `error:` line naming every missing
package, before any work, and writes nothing; the core alone runs `count`, `verify` and
`train`. Missing packages are simulated (``sys.modules[name] = None``, which makes their
import fail as if they were not installed) in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from attnid.errors import EXTRAS

RUNNER = """
import contextlib, io, json, sys
for name in {missing!r}:
    sys.modules[name] = None
from attnid.cli import main
out = []
for argv in {commands!r}:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    out.append([code, err.getvalue()])
print(json.dumps(out))
"""


def run_without(missing: list[str], commands: list[list[str]], cwd: Path) -> list[tuple[int, str]]:
    code = RUNNER.format(missing=missing, commands=commands)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return [tuple(r) for r in json.loads(proc.stdout.strip().splitlines()[-1])]


HF = ["transformers", "safetensors"]
REPORT = ["matplotlib", "markdown-it-py"]
# command -> the extras it needs (the packages named in its refusal)
NEEDS = {
    "reproduce OUT --scale quick": HF + REPORT,
    "report --all": HF,
    "report DeepSeek-V3": HF,
    "report gpt2": HF,
    "verify --hf-config gpt2": HF,
    "verify --hf-config gpt2 --whole": HF,
    "audit MODEL": HF,
    "audit MODEL --plot OUT/map.png": HF + REPORT,
    "diff MODEL MODEL": HF,
    "canonicalize MODEL OUT": HF,
    "experiment paper OUT --scale quick": REPORT,
}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict[str, tuple[int, str, Path]]:
    """Every command of NEEDS run once with the core only (every extra's packages missing)."""
    root = tmp_path_factory.mktemp("extras")
    (root / "model").mkdir()
    outs = {cmd: root / f"out{i}" for i, cmd in enumerate(NEEDS)}
    commands = [cmd.replace("OUT", str(outs[cmd])).replace("MODEL", str(root / "model")).split()
                for cmd in NEEDS]
    modules = [m for ms in EXTRAS.values() for m in ms] + NOT_CORE
    results = run_without(modules, commands, root)
    return {cmd: (code, err, outs[cmd]) for cmd, (code, err) in zip(NEEDS, results, strict=True)}


@pytest.mark.parametrize("cmd", list(NEEDS))
def test_missing_extras_named_before_any_work(cmd, refusals):
    code, err, out = refusals[cmd]
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    for package in NEEDS[cmd]:
        assert package in lines[0], (package, lines[0])
    for package in set(HF + REPORT) - set(NEEDS[cmd]):
        assert package not in lines[0], (package, lines[0])
    extras = sorted({"hf" for p in NEEDS[cmd] if p in HF} | {"report" for p in NEEDS[cmd] if p in REPORT})
    assert f"pip install 'attnid[{','.join(extras)}]'" in lines[0]
    assert not out.exists(), "something was written"


def test_only_the_missing_extra_is_named(tmp_path):
    """With [report] installed and [hf] missing (the issue's case: reproduce crashed after
    3 minutes), reproduce names transformers and safetensors only."""
    (code, err), = run_without(HF, [["reproduce", str(tmp_path / "r"), "--scale", "quick"]], tmp_path)
    assert code == 2 and "transformers, safetensors" in err and "matplotlib" not in err, err
    assert "attnid[hf]'" in err and not (tmp_path / "r").exists()


# installed here as dependencies of the extras' packages, not of the core (typer vendors click)
NOT_CORE = ["click", "huggingface_hub", "tokenizers", "accelerate", "hypothesis", "pytest"]


def test_core_only_runs_count_verify_train(tmp_path):
    modules = [m for ms in EXTRAS.values() for m in ms] + NOT_CORE
    results = run_without(modules, [
        ["count", "--d-model", "16", "--heads", "4"],
        ["verify", "--d-model", "8", "--heads", "2", "--no-confirm"],
        ["train", "--steps", "2", "--n-layers", "1", "--eval-every", "2", "--no-progress",
         "--no-checkpoint", str(tmp_path / "t")],
    ], tmp_path)
    assert [code for code, _ in results] == [0, 0, 0], results
    assert (tmp_path / "t" / "metrics.jsonl").exists()
