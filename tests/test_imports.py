"""The import graph: no cycles among attnid's modules (function-level imports included), and
`import attnid` stays light (no transformers, no matplotlib)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import attnid

ROOT = Path(attnid.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = ("attnid", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The attnid module an imported name lives in (``attnid.a.b.c`` -> ``attnid.a.b`` if c is
    an attribute), or None outside attnid."""
    while name.startswith("attnid"):
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str) -> set[str]:
    """Every attnid module ``module`` imports, at any depth of its code."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        found |= {m for m in map(_resolve, names) if m is not None and m != module}
    return found


GRAPH = {m: _imports(m) for m in MODULES}


def test_the_graph_was_read():
    assert len(MODULES) > 40
    assert "attnid.arbiter.rank" in GRAPH["attnid.arbiter.compare"]
    assert "attnid.rope" in GRAPH["attnid.testing"]


def test_no_import_cycles():
    # explicit edges only: a module that imports its own package's __init__ (which imports
    # the module back) is a cycle too
    colour: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        colour[m] = 1
        stack.append(m)
        for n in sorted(GRAPH[m]):
            if colour.get(n) == 1:
                cycles.append([*stack[stack.index(n):], n])
            elif n not in colour:
                visit(n)
        stack.pop()
        colour[m] = 2

    for m in sorted(GRAPH):
        if m not in colour:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_can_fail():
    assert "attnid.spec" in GRAPH["attnid.theory.attention"]
    GRAPH["attnid.spec"].add("attnid.theory.attention")
    try:
        with pytest.raises(AssertionError, match=re.escape("attnid.spec -> attnid.theory.attention")):
            test_no_import_cycles()
    finally:
        GRAPH["attnid.spec"].discard("attnid.theory.attention")


def test_import_attnid_stays_light():
    code = ("import sys, attnid, attnid.testing; "
            "print(sorted(m for m in ('transformers', 'matplotlib', 'safetensors') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert out.strip() == "[]", f"import attnid loaded {out.strip()}"


def test_no_private_torch_apis():
    # torch's private helpers change without notice; attnid uses public ones (torch.func)
    hits = [f"{m}: {n}" for m, path in MODULES.items() for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch")
            for n in [a.name for a in node.names] + (node.module or "").split(".")
            if n.startswith("_") and n != "__future__"]
    assert not hits, hits


def test_the_old_optim_module_warns_and_still_works():
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "try:\n    import attnid.optim\nexcept DeprecationWarning as e:\n    print('warned:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert out.startswith("warned: attnid.optim is deprecated"), out
    from attnid.monitor import Monitor

    with pytest.warns(DeprecationWarning):
        import importlib

        import attnid.optim as old

        importlib.reload(old)
    assert old.Monitor is Monitor


def _packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between attnid's top-level units (a subpackage or a top-level module), the
    root package's lazy facade (``attnid/__init__``, which imports nothing at load) left out."""
    unit = lambda m: ".".join(m.split(".")[:2])  # noqa: E731
    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        if m == "attnid":
            continue
        out.setdefault(unit(m), set()).update(unit(d) for d in deps if unit(d) not in (unit(m), "attnid"))
    return out


def _package_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    pk = _packages(graph)
    colour: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        colour[m] = 1
        stack.append(m)
        for n in sorted(pk.get(m, ())):
            if colour.get(n) == 1:
                return [*stack[stack.index(n):], n]
            if n not in colour and (found := visit(n)):
                return found
        stack.pop()
        colour[m] = 2
        return None

    for m in sorted(pk):
        if m not in colour and (found := visit(m)):
            return found
    return None


def test_no_package_level_cycles():
    # a lower floor never imports a higher one: e.g. adapters/ (which read configs into specs
    # and structures) must not import whole/ (which builds on adapters)
    cycle = _package_cycle(GRAPH)
    assert cycle is None, "package-level import cycle: " + " -> ".join(cycle)


def test_the_package_cycle_check_can_fail():
    planted = {m: set(d) for m, d in GRAPH.items()}
    planted["attnid.adapters.base"].add("attnid.whole.check")  # whole/ imports adapters/
    assert "attnid.adapters.base" in planted["attnid.whole.check"]
    cycle = _package_cycle(planted)
    assert cycle is not None and {"attnid.adapters", "attnid.whole"} <= set(cycle), cycle


def test_the_library_never_imports_the_paper():
    # the reproduction (attnid.paper) is built on the library; the library knows nothing of it
    # (its commands reach the CLI through the attnid.commands entry point)
    library = {m: deps for m, deps in GRAPH.items() if not m.startswith("attnid.paper")}
    hits = sorted(f"{m} -> {d}" for m, deps in library.items() for d in deps if d.startswith("attnid.paper"))
    assert len(library) > 40 and any(m.startswith("attnid.paper") for m in GRAPH)
    assert not hits, "library modules import the paper: " + "; ".join(hits)


def test_the_paper_commands_reach_the_cli():
    from attnid.cli import _command

    assert {"reproduce", "experiment"} <= set(_command().commands)


def _is_testing(m: str) -> bool:
    return m == "attnid.testing" or m.startswith("attnid.testing.")


def _importers_of_testing(graph: dict[str, set[str]]) -> list[str]:
    return sorted(m for m, deps in graph.items() if not _is_testing(m) and any(map(_is_testing, deps)))


def test_no_library_module_imports_the_test_tools():
    # tolerances, relative error and polar live in attnid.numerics; attnid.testing (test tools
    # for tests, scripts and adapter authors) re-exports them and is imported by no module
    users = {m for m, deps in GRAPH.items() if "attnid.numerics" in deps}
    assert {"attnid.testing", "attnid.checkpoint.diff"} <= users
    hits = _importers_of_testing(GRAPH)
    assert not hits, "library modules import attnid.testing: " + ", ".join(hits)


def test_the_test_tools_check_can_fail():
    planted = {m: set(d) for m, d in GRAPH.items()}
    planted["attnid.checkpoint.canonicalize"].add("attnid.testing")
    planted["attnid.whole.fit.fitter"].add("attnid.testing.models")
    assert _importers_of_testing(planted) == ["attnid.checkpoint.canonicalize", "attnid.whole.fit.fitter"]
