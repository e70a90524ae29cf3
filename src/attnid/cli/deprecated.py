"""Old spellings of flags, kept working for one release: the one table of them, and the argv
pre-pass that rewrites each to today's spelling with one ``warning:`` line on stderr.

The pre-pass runs before click parses, so a command declares only its current flags (and
``--help`` shows only those). CHANGELOG.md lists the same renames.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["RENAMES", "Rename", "rewrite_argv"]


@dataclass(frozen=True)
class Rename:
    """``command``'s flag ``old`` is now ``new``; ``kind`` says how its value moves:

    * ``"option"``: ``old V`` -> ``new V``;
    * ``"positional"``: ``old V`` -> ``V`` as the command's argument (placed last);
    * ``"boolean"``: ``old VALUE`` -> ``new`` where ``VALUE`` was the flag's only value
      (``--permute-heads random`` -> ``--permute-heads``).
    """

    command: str
    old: str
    new: str  # the flag now ("positional": the argument's name)
    kind: Literal["option", "positional", "boolean"] = "option"
    value: str = ""  # the only value of a "boolean" rename's old form

    def warning(self) -> str:
        """The one line said when the old form is used."""
        said = f"{self.old} {self.value}".strip()
        now = {"option": f"{self.new} (same value)", "boolean": f"{self.new} alone",
               "positional": f"{self.new} as an argument: attnid {self.command} {self.new}"}[self.kind]
        return f"warning: {said} is deprecated; write {now} (the old form goes in the next release)"


RENAMES: tuple[Rename, ...] = (
    Rename("train", "--out", "OUT", "positional"),
    Rename("train", "--preset", "--scale"),
    Rename("barrier", "--data", "--calibration"),
    *(Rename(command, "--group", "--subgroup") for command in ("align", "merge", "barrier")),
    *(Rename("rewrite", flag, flag, "boolean", "random")
      for flag in ("--qk-planes", "--scale-mlp", "--permute-mlp", "--permute-heads")),
)


def rewrite_argv(argv: list[str], warn: Callable[[str], None] | None = None) -> list[str]:
    """``argv`` (without the program name) with every deprecated spelling of its command
    rewritten; ``warn`` (default: a line on stderr) is called once per rewrite. Arguments
    after ``--`` are left as they are."""
    say = warn or (lambda line: print(line, file=sys.stderr))
    if not argv:
        return argv
    renames = [r for r in RENAMES if r.command == argv[0]]
    head, out, moved = argv[:1], [], []
    rest = argv[1:]
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg == "--":
            out += rest[i:]
            break
        flag, eq, attached = arg.partition("=")
        r = next((r for r in renames if r.old == flag), None)
        if r is None:
            out.append(arg)
            i += 1
            continue
        value = attached if eq else (rest[i + 1] if i + 1 < len(rest) else None)
        step = 1 if eq else 2
        if r.kind == "boolean":
            if value != r.value:  # the new form already (a bare flag): nothing to rewrite
                out.append(arg)
                i += 1
                continue
            out.append(r.new)
        elif value is None:  # click will say that the flag needs a value
            out.append(arg)
            i += 1
            continue
        elif r.kind == "positional":
            moved.append(value)
        else:
            out += [r.new, value]
        say(r.warning())
        i += step
    if moved and "--" in out:
        k = out.index("--")
        return head + out[:k] + moved + out[k:]
    return head + out + moved
