"""A batch input file checked line by line before it is stored: each line one JSON
object `{"custom_id", "method": "POST", "url", "body"}`, custom_ids unique, at most
`max_lines` of them. A file with bad lines is refused whole with a 400 that names the
first of them (line numbers from 1), so a client fixes them all in one go."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import ValidationError

from gateway.http.errors import ApiError
from gateway.http.validation import described
from gateway.schemas.files import BatchInputLine

NAMED_AT_MOST = 5  # bad lines a refusal names


@dataclass(frozen=True)
class InputLine:
    custom_id: str
    url: str
    body: dict


def check_lines(data: bytes, max_lines: int) -> list[InputLine]:
    """The file's lines, or an ApiError(400) naming its first bad lines."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"The file is not UTF-8 (at byte {e.start}).", param="file") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":  # the last line's newline
        lines.pop()
    if not lines:
        raise ApiError(400, "The file has no lines; a batch needs at least one.", param="file")
    if len(lines) > max_lines:
        raise ApiError(
            400, f"The file has {len(lines)} lines; at most {max_lines} are taken.", param="file"
        )
    good: list[InputLine] = []
    bad: list[str] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, 1):
        why = _why_bad(line.rstrip("\r"), seen, good)
        if why is not None:
            bad.append(f"line {number}: {why}")
    if bad:
        shown = "; ".join(bad[:NAMED_AT_MOST])
        more = f" (and {len(bad) - NAMED_AT_MOST} more)" if len(bad) > NAMED_AT_MOST else ""
        raise ApiError(400, f"The file has {len(bad)} bad lines: {shown}{more}.", param="file")
    return good


def _why_bad(line: str, seen: set[str], good: list[InputLine]) -> str | None:
    """Why one line is not a request (None: it is one, appended to `good`)."""
    try:
        data = json.loads(line)
    except RecursionError:
        return "nested too deep"
    except ValueError as e:
        return f"not JSON ({getattr(e, 'msg', e)})" if line.strip() else "empty"
    try:
        parsed = BatchInputLine.model_validate(data)
    except ValidationError as e:
        return described(e, data)[0]
    if parsed.custom_id in seen:
        return f"custom_id {parsed.custom_id!r} is not unique"
    seen.add(parsed.custom_id)
    good.append(InputLine(parsed.custom_id, parsed.url, parsed.body))
    return None
