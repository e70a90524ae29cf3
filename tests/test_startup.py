"""`attnid --help` and `attnid count` stay fast: they must not import torch (~1 s on 2 cores)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys, contextlib, io
from attnid.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    code = main({argv!r})
heavy = [m for m in ("torch", "transformers", "matplotlib") if m in sys.modules]
print(code, ",".join(heavy))
"""


@pytest.mark.parametrize("argv", [["--help"], ["count", "--d-model", "64", "--n-heads", "8"],
                                  ["count", "--d-model", "8", "--n-heads", "2", "--json"]])
def test_light_commands_do_not_import_heavy_modules(argv):
    out = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True,
                         text=True, check=True).stdout.split()
    assert out[0] == "0", out
    assert len(out) == 1, f"{argv} imported {out[1]}"


def test_lazy_names_resolve_and_unknown_names_fail():
    import attnid

    assert attnid.AttentionSpec(d_model=8, n_heads=2).n_kv_heads == 2
    assert callable(attnid.verify) and callable(attnid.jacobian_rank)
    assert set(attnid.__all__) == set(attnid._HOME) and set(attnid.__all__) <= set(dir(attnid))
    with pytest.raises(AttributeError, match="no_such_name"):
        attnid.no_such_name  # noqa: B018
