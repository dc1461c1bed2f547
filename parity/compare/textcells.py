"""Text layout of printed reports: console lines within 100 columns, Markdown table cells that stay cells."""

from __future__ import annotations

import textwrap


def fit_line(line: str, width: int = 100) -> str:
    """`line` wrapped at `width` columns, continuations indented two spaces past its own indent; words are never
    cut (a single word longer than `width`, a long path, stays whole)."""
    if len(line) <= width:
        return line
    lead = line[: len(line) - len(line.lstrip())]
    return textwrap.fill(line, width, subsequent_indent=lead + "  ", break_long_words=False, break_on_hyphens=False)


def table_lines(rows: list[list[str]], indent: str = "  ", width: int = 100) -> list[str]:
    """Aligned columns, two spaces apart, or one where two would pass `width`; trailing blanks stripped."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    gap = "  " if len(indent) + sum(widths) + 2 * (len(widths) - 1) <= width else " "
    return [(indent + gap.join(c.ljust(w) for c, w in zip(r, widths, strict=True))).rstrip() for r in rows]


def md_cell(text: str) -> str:
    """`text` safe in a Markdown table cell: `|` escaped (an unescaped one splits the cell), newlines as spaces."""
    return text.replace("|", "\\|").replace("\n", " ")
