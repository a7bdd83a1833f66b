"""How the `kvgate` commands print what they found: JSON for scripts, a table for people.
One module so that every command's tables look alike.

A table is fitted to the terminal (a tenant's row of limits ran 200 columns): its widest
columns are cut with an ellipsis, but never below CLIP_FLOOR, so ids and timestamps stay
whole; a table that still does not fit prints each row as a record, one field a line.
Printed to a pipe or a file, rows stay whole, for scripts.
"""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
import time
from typing import Any

GAP = "  "
ELLIPSIS = "…"
CLIP_FLOOR = 20  # the longest id ("key_" and 16 hex digits) stays whole


def print_rows(data: Any, as_json: bool) -> None:
    """JSON for scripts; else a table for people (a record is a table of one row)."""
    if as_json:
        print(json.dumps(data, indent=2))
        return
    if isinstance(data, dict):
        data = [data]
    if not data:
        print("(none)")
        return
    cols = [c for c in data[0] if c != "object"]  # the same word on every row
    rows = [[cell(r[c]) for c in cols] for r in data]
    print("\n".join(format_table(cols, rows, terminal_width())))


def terminal_width() -> int | None:
    """The columns a table must fit: the terminal's ($COLUMNS first, as everywhere);
    None when printing to a pipe or a file, where whole rows serve a script better."""
    return shutil.get_terminal_size().columns if sys.stdout.isatty() else None


def format_table(cols: list[str], rows: list[list[str]], width: int | None) -> list[str]:
    """The lines of a table of `rows` under `cols`, at most `width` characters each."""
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    if width is not None:
        fitted = fit_widths(widths, width)
        if fitted is None:
            return format_records(cols, rows, width)
        widths = fitted
    return [
        GAP.join(clip(text, w).ljust(w) for text, w in zip(line, widths, strict=True)).rstrip()
        for line in [cols, *rows]
    ]


def fit_widths(widths: list[int], width: int) -> list[int] | None:
    """Column widths whose table fits `width`: the widest narrowed first, none below
    CLIP_FLOOR (or its own width); None if that is still too wide."""
    widths = list(widths)
    overflow = sum(widths) + len(GAP) * (len(widths) - 1) - width
    while overflow > 0:
        widest = max(range(len(widths)), key=widths.__getitem__)
        if widths[widest] <= CLIP_FLOOR:
            return None
        widths[widest] -= 1
        overflow -= 1
    return widths


def format_records(cols: list[str], rows: list[list[str]], width: int) -> list[str]:
    """Each row as `field  value` lines, a blank line between rows; a long value wraps."""
    label = max(map(len, cols))
    room = max(width - label - len(GAP), CLIP_FLOOR)
    indent = " " * (label + len(GAP))
    lines: list[str] = []
    for row in rows:
        if lines:
            lines.append("")
        for col, text in zip(cols, row, strict=True):
            wrapped = textwrap.wrap(text, room, break_on_hyphens=False) or [""]
            lines.append(f"{col.ljust(label)}{GAP}{wrapped[0]}".rstrip())
            lines += [indent + more for more in wrapped[1:]]
    return lines


def clip(text: str, width: int) -> str:
    """`text` in at most `width` characters: its middle cut for an ellipsis, so that a
    path keeps its file name and a name its end."""
    if len(text) <= width:
        return text
    head = (width - len(ELLIPSIS) + 1) // 2
    tail = width - len(ELLIPSIS) - head
    return text[:head] + ELLIPSIS + (text[-tail:] if tail else "")


def cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and v > 1e9:  # a timestamp
        return time.strftime("%Y-%m-%d %H:%M", time.gmtime(v))
    if isinstance(v, list):
        return ",".join(map(str, v))
    return str(v)
