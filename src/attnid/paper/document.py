"""The pieces of a report and their rendering: Markdown (``report.md``) and one self-contained
HTML page (``report.html``, through markdown-it-py, figures embedded).

A report is a list of :class:`Section`; each has text, tables, figures with captions and
claims. Failing claims come first in the summary and are shown in red in the HTML.
"""

from __future__ import annotations

import base64
import csv
import html
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from attnid.progress import Progress

FAILS = "**FAILS**"


@dataclass(frozen=True)
class Claim:
    section: str
    claim: str
    holds: bool
    evidence: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Figure:
    path: Path  # a PNG
    caption: str  # what to see, with the numbers behind it
    alt: str = ""  # what the image shows, for who cannot see it (default: the caption's first sentence)

    @property
    def alt_text(self) -> str:
        """The alt text: ``alt``, or the caption's first sentence; never the file name."""
        text = self.alt or self.caption.split(". ")[0].rstrip(".")
        return " ".join(text.split())


@dataclass(frozen=True)
class Table:
    """``rows`` are written whole to CSV/JSON/MD; the report shows ``view`` (default: ``rows``)
    through ``columns`` (key -> short header; all keys when None), its first ``max_rows``
    rows, and ``notes`` under it."""

    stem: str
    rows: list[dict[str, Any]]
    columns: dict[str, str] | None = None
    notes: tuple[str, ...] = ()
    max_rows: int = 40
    view: list[dict[str, Any]] | None = None

    @property
    def shown(self) -> list[dict[str, Any]]:
        return self.rows if self.view is None else self.view


@dataclass(frozen=True)
class Section:
    title: str
    text: str = ""
    tables: tuple[Table, ...] = ()
    figures: tuple[Figure, ...] = ()
    claims: tuple[Claim, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class Context:
    """What a section gets (`attnid.paper.reproduce`): where to write, how big to run, where
    to report progress."""

    out: Path  # the report's folder
    quick: bool  # small sizes (``reproduce --quick``)
    progress: Progress
    scale: str | None = None  # quick | default | full | paper (``reproduce --scale``); None: from quick

    @property
    def figures(self) -> Path:
        """Where a section writes its PNGs."""
        return self.out / "figures"


# a number as prose prints it: an optional sign, digits (thousands separated by commas), a
# fraction, an exponent, a percent sign; never part of a name (L6, v2, rho_qk, C_0, float32)
NUMBER = re.compile(r"(?<![\w.])([+\-−±]?)(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?([eE][+\-]?\d+)?(%?)(?![\w])")
# a reference, not a quantity: §9.3, Fig. 2, Figs. 2-4, Section 5, section 13, Table 1
REFERENCE = re.compile(r"(?:§\s?|\b(?:figs?\.|sections?|tables?)\s)\d+(?:\.\d+)*(?:[-–]\d+(?:\.\d+)*)?",
                       re.IGNORECASE)


@dataclass(frozen=True)
class Quoted:
    """A number as printed in text: its value (a percent already divided by 100), how far a
    value may lie from it and still print so (half a unit in its last digit), and its sign."""

    text: str
    value: float
    tolerance: float
    sign: str  # "+", "-" or "" (printed without one: not negative), "±" (either)

    def matches(self, x: float) -> bool:
        if self.sign == "-" and not (x < 0 or (x == 0 and str(x).startswith("-"))):
            return False
        if self.sign in ("+", "") and x < 0:
            return False
        target = -self.value if self.sign == "-" else self.value
        return abs((abs(x) if self.sign == "±" else x) - target) <= self.tolerance * (1 + 1e-9) + 1e-300


def quoted_numbers(text: str) -> list[Quoted]:
    """Every number printed in ``text`` (see :data:`NUMBER`), references (:data:`REFERENCE`)
    left out."""
    out = []
    for m in NUMBER.finditer(REFERENCE.sub(" ", text)):
        sign, whole, frac, exp, pct = m.groups()
        digits = len(frac) - 1 if frac else 0
        scale = (10.0 ** int(exp[1:])) if exp else 1.0
        scale /= 100.0 if pct else 1.0
        value = float(whole.replace(",", "") + (frac or "")) * scale
        out.append(Quoted(m.group(0), value, 0.5 * 10.0 ** -digits * scale, "-" if sign == "−" else sign))
    return out


def table_values(tables: tuple[Table, ...] | list[Table]) -> list[float]:
    """Every number in ``tables``: numeric cells, and the numbers printed inside text cells."""
    out: list[float] = []
    for t in tables:
        for row in t.rows:
            for v in row.values():
                if isinstance(v, bool) or v is None:
                    continue
                if isinstance(v, (int, float)):
                    out.append(float(v))
                elif isinstance(v, str):
                    out += [(-q.value if q.sign == "-" else q.value) for q in quoted_numbers(v)]
    return out


def untabled(section: Section) -> list[str]:
    """The numbers that the section's text, figure captions and claims (statement and evidence)
    print but none of its tables holds, within the precision they are printed to; each as
    ``"where: number"``. Empty when every number the section states is in its tables."""
    values = table_values(section.tables)
    texts = [("text", section.text), *((f"caption of {f.path.name}", f.caption) for f in section.figures),
             *((f"claim {c.claim[:40]!r}", c.claim + " " + c.evidence) for c in section.claims)]
    return [f"{where}: {q.text}" for where, text in texts for q in quoted_numbers(text)
            if not any(q.matches(v) for v in values)]


def cell(v: Any) -> str:
    """A value as Markdown table cell text: floats to 4 significant digits, ints with
    separators, ``|`` escaped (it would split the row), None as an em dash."""
    if v is None or v == "":
        return "—"
    if isinstance(v, bool):
        text = "yes" if v else "no"
    elif isinstance(v, int):
        text = f"{v:,}"
    elif isinstance(v, float):
        text = f"{v:.4g}"
    else:
        text = str(v)
    return text.replace("|", "\\|").replace("\n", " ")


def _keys(rows: list[dict]) -> list[str]:
    """Every column, in first-seen order (rows may differ in optional columns)."""
    return list(dict.fromkeys(k for r in rows for k in r))


def markdown_table(rows: list[dict[str, Any]], columns: dict[str, str] | None = None) -> str:
    cols = columns or {k: k for k in _keys(rows)}

    def numeric(k: str) -> bool:
        vals = [r.get(k) for r in rows if r.get(k) is not None]
        return bool(vals) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals)

    rule = "|" + "".join("---:|" if numeric(k) else "---|" for k in cols)
    lines = ["| " + " | ".join(cell(h) for h in cols.values()) + " |", rule]
    lines += ["| " + " | ".join(cell(r.get(k)) for k in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_table(rows: list[dict[str, Any]], stem: Path) -> None:
    """``stem.csv``, ``stem.json`` and ``stem.md`` with every row and column."""
    keys = _keys(rows)
    with stem.with_suffix(".csv").open("w", newline="") as f:
        w = csv.DictWriter(f, keys, restval="")
        w.writeheader()
        w.writerows(rows)
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=2))
    stem.with_suffix(".md").write_text(markdown_table(rows))


def verdict(c: Claim) -> str:
    return "holds" if c.holds else FAILS


def render_markdown(title: str, intro: str, sections: list[Section], status: str) -> str:
    """The whole report: title, summary table (failing claims first), then each section."""
    claims = [c for s in sections for c in s.claims]
    ordered = sorted(claims, key=lambda c: c.holds)  # stable: failing first, else in order
    n_hold = sum(c.holds for c in claims)
    lines = [f"# {title}", "", intro, "", "## Summary", "",
             f"**{n_hold} of {len(claims)} claims hold** ({status}).", ""]
    if n_hold < len(claims):
        lines += [f"{len(claims) - n_hold} failing claim(s) are listed first.", ""]
    lines.append(markdown_table([{"s": c.section, "c": _inline(c.claim), "v": verdict(c),
                                  "e": _inline(c.evidence)} for c in ordered],
                                {"s": "section", "c": "claim", "v": "verdict", "e": "evidence"}))
    figure_no = 0
    for s in sections:
        lines += [f"## {s.title}", ""]
        if s.text:
            lines += [s.text.strip(), ""]
        for c in s.claims:
            lines.append(f"- {verdict(c)}: {_inline(c.claim)} ({_inline(c.evidence)})")
        if s.claims:
            lines.append("")
        for t in s.tables:
            shown = t.shown[: t.max_rows]
            lines += [markdown_table(shown, t.columns)]
            if len(t.shown) > len(shown):
                lines += [f"({len(t.shown) - len(shown)} more rows in `tables/{t.stem}.csv`.)", ""]
            lines += [*[f"{note}  " for note in t.notes],
                      f"All columns: `tables/{t.stem}.csv` (also `.json`, `.md`).", ""]
        for f in s.figures:
            figure_no += 1
            lines += [f"![Figure {figure_no}: {_alt(f.alt_text)}](figures/{f.path.name})", "",
                      f"*Figure {figure_no}.* {f.caption}", ""]
    return "\n".join(lines) + "\n"


def _alt(text: str) -> str:
    """Text for an image description: Markdown markup escaped (CommonMark keeps only the plain
    text of the description as the ``alt`` attribute), brackets included."""
    text = _inline(text)
    for ch in ("[", "]"):
        text = text.replace(ch, "\\" + ch)
    return text


def _inline(text: str) -> str:
    """Text for a Markdown paragraph or list item: characters Markdown would read as markup
    (``*``, ``_``, backquote) escaped."""
    for ch in ("\\", "*", "_", "`"):
        text = text.replace(ch, "\\" + ch)
    return text


CSS = """
body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;
 color:#222;line-height:1.45}
h1{font-size:1.7em}h2{margin-top:2em;border-bottom:1px solid #ddd}
.table-wrap{overflow-x:auto;margin:1em 0}
table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #ccc;padding:3px 6px;vertical-align:top}
th{background:#f3f3f3}
tr.fail td,li.fail{color:#b00000;background:#fff0f0}
tr.fail strong,li.fail strong{color:#b00000}
img{max-width:100%;border:1px solid #eee}
code{background:#f5f5f5;padding:0 3px}
"""


def render_html(md_text: str, figures: Path, title: str = "attnid report") -> str:
    """``md_text`` rendered by markdown-it-py (CommonMark + tables): failing claims' rows and
    list items get ``class="fail"`` (red), figures are embedded as base64 PNG."""
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark").enable("table")
    tokens = md.parse(md_text)
    open_stack: list[Any] = []
    for tok in tokens:
        if tok.type in ("tr_open", "list_item_open"):
            open_stack.append(tok)
        elif tok.type in ("tr_close", "list_item_close"):
            open_stack.pop()
        elif tok.type == "inline":
            if FAILS in tok.content and open_stack:
                open_stack[-1].attrSet("class", "fail")
            for child in tok.children or []:
                if child.type == "image":
                    png = figures / Path(child.attrGet("src") or "").name
                    if png.exists():
                        data = base64.b64encode(png.read_bytes()).decode()
                        child.attrSet("src", "data:image/png;base64," + data)
    body = md.renderer.render(tokens, md.options, {})
    body = body.replace("<table>", '<div class="table-wrap"><table>').replace("</table>", "</table></div>")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body>{body}</body></html>\n")
