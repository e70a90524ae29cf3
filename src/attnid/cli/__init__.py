"""The ``attnid`` command line. Thin: parse, call the library, print, exit.

User mistakes (:class:`attnid.AttnidError`, bad flags) print one ``error:`` line on
stderr and exit 2; ``verify`` exits 1 when theory and arbiter disagree. Each command's
module imports what it needs inside the command, so ``--help`` stays fast. Deprecated
spellings of flags are rewritten before parsing (`attnid.cli.deprecated`), each with one
``warning:`` line on stderr.
"""

from __future__ import annotations

import functools
import sys
from importlib.metadata import entry_points

import typer
import typer.main
from typer.core import TyperGroup
from typer.exceptions import TyperException

from attnid.cli import (  # noqa: F401  (register commands)
    align,
    audit,
    canonicalize,
    diff,
    evaluate,
    identify,
    rewrite,
    training,
)
from attnid.cli.app import app
from attnid.cli.deprecated import rewrite_argv
from attnid.errors import AttnidError

__all__ = ["app", "main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point: runs the app and maps user errors to one ``error:`` line, exit 2."""
    args = rewrite_argv(sys.argv[1:] if argv is None else list(argv))
    try:  # click returns an Exit's code here
        code = _command().main(args=args, standalone_mode=False, prog_name="attnid")
    except AttnidError as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return 2
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort:
        print("error: aborted", file=sys.stderr)
        return 130
    except TyperException as e:  # bad flags, missing arguments (click's usage errors)
        message = e.format_message() if hasattr(e, "format_message") else str(e)
        print(f"error: {one_line(message)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return code if isinstance(code, int) else 0


def one_line(message: str) -> str:
    r"""A message on one line (a library's multi-line refusal joined with "; ").

    >>> one_line("Validation error for field 'x':\n    TypeError: expected bool")
    "Validation error for field 'x': TypeError: expected bool"
    """
    parts = [p.strip() for p in message.splitlines() if p.strip()]
    return " ".join(p if p.endswith(":") or i == len(parts) - 1 else p + ";"
                    for i, p in enumerate(parts))


@functools.cache
def _command() -> TyperGroup:
    """The click command tree, built once (typer rebuilds it on every ``app()`` call: ~0.1 s,
    which adds up where the CLI is called in process, as in the tests), after the packages
    that add commands through the ``attnid.commands`` entry point (the paper's reproduction)
    have registered theirs."""
    for entry in entry_points(group="attnid.commands"):
        entry.load()  # importing the module registers its commands on `app`
    return typer.main.get_command(app)


if __name__ == "__main__":
    sys.exit(main())
