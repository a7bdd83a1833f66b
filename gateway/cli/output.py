"""How the `kvgate` commands print what they found: JSON for scripts, a table for people.
One module so that every command's tables look alike."""

from __future__ import annotations

import json
import time
from typing import Any


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
    widths = [max(len(c), *(len(cell(r[c])) for r in data)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for r in data:
        print("  ".join(cell(r[c]).ljust(w) for c, w in zip(cols, widths, strict=True)))


def cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and v > 1e9:  # a timestamp
        return time.strftime("%Y-%m-%d %H:%M", time.gmtime(v))
    if isinstance(v, list):
        return ",".join(map(str, v))
    return str(v)
