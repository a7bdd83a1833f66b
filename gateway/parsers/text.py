"""The text mechanics every parser shares: cutting a stream at markers, holding back only
what could still become one, and trimming whitespace without looking ahead.

A parser calls `take` with the markers its state waits for; what comes back is safe to
hand out, and the buffer keeps only a tail that begins some marker (or everything, when
the parser must see a block whole). That is what makes any split of the text parse the
same: a decision is made only on text that no later text can change.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


def held_tail(buf: str, markers: Sequence[str]) -> int:
    """The length of the longest tail of `buf` that is a proper prefix of a marker."""
    best = 0
    for m in markers:
        first = m[0]
        start = max(0, len(buf) - len(m) + 1)
        i = buf.find(first, start)
        while i != -1:
            n = len(buf) - i
            if n > best and m.startswith(buf[i:]):
                best = n
                break
            i = buf.find(first, i + 1)
    return best


def first_marker(buf: str, markers: Sequence[str]) -> tuple[int, str] | None:
    """Where the earliest whole marker in `buf` starts, and which (the longest at a tie)."""
    found: tuple[int, str] | None = None
    for m in markers:
        i = buf.find(m)
        if i != -1 and (
            found is None or i < found[0] or (i == found[0] and len(m) > len(found[1]))
        ):
            found = (i, m)
    return found


def is_prefix(text: str, *markers: str) -> bool:
    """Whether `text` could still grow into one of `markers` (it is not one yet)."""
    for m in markers:  # noqa: SIM110 (a loop: any() over a generator costs 2-3x)
        if len(text) < len(m) and m.startswith(text):
            return True
    return False


_IDS_A_DRAW = 64
_ids: list[str] = []  # call ids drawn and not yet given
os.register_at_fork(after_in_child=_ids.clear)  # a forked worker draws its own


def new_call_id() -> str:
    """A call's id: "call_" and 24 hex digits from os.urandom, drawn 64 at a time (one
    system call where each id made one). Pop and extend are atomic: a large reply
    finished off the event loop may draw beside it."""
    while True:
        try:
            return _ids.pop()
        except IndexError:
            raw = os.urandom(12 * _IDS_A_DRAW).hex()
            _ids.extend(["call_" + raw[i : i + 24] for i in range(0, len(raw), 24)])


class Buffered:
    """A text buffer cut at markers."""

    def __init__(self) -> None:
        self.buf = ""

    def take(self, markers: Sequence[str], final: bool = False) -> tuple[str, str | None]:
        """(text before the first whole marker, the marker), consumed from the buffer; else
        (the text no marker can start in, None), keeping a possible marker's prefix unless
        `final`."""
        buf = self.buf
        if len(markers) == 1:  # most states wait for one marker: one pass, no helpers
            return self._take_one(markers[0], final)
        for m in markers:
            if m[0] in buf:
                break
        else:  # the common case, a token of plain text: no marker can begin in it
            self.buf = ""
            return buf, None
        hit = first_marker(buf, markers)
        if hit is not None:
            i, m = hit
            before, self.buf = self.buf[:i], self.buf[i + len(m) :]
            return before, m
        keep = 0 if final else held_tail(self.buf, markers)
        out = self.buf[: len(self.buf) - keep]
        self.buf = self.buf[len(self.buf) - keep :]
        return out, None

    def holds(self, text: str, marker: str) -> bool:
        """Whether `text` only lengthens the start of `marker` the buffer holds, still
        short of all of it: then it is kept, and `take` would hand out nothing and find
        nothing (a marker that comes a token at a time costs one check a token)."""
        if not self.buf:
            return False
        buf = self.buf + text
        if len(buf) < len(marker) and marker.startswith(buf):
            self.buf = buf
            return True
        return False

    def _take_one(self, marker: str, final: bool) -> tuple[str, str | None]:
        """`take` of one marker."""
        buf = self.buf
        i = buf.find(marker)
        if i != -1:
            self.buf = buf[i + len(marker) :]
            return buf[:i], marker
        # a possible start of the marker can only be in the last len(marker) - 1 characters
        j = -1 if final else buf.find(marker[0], max(0, len(buf) - len(marker) + 1))
        while j != -1 and not marker.startswith(buf[j:]):
            j = buf.find(marker[0], j + 1)
        if j == -1:
            self.buf = ""
            return buf, None
        self.buf = buf[j:]
        return buf[:j], None


class Trim:
    """Whitespace trimmed from both ends of a streamed span: the leading dropped, a trailing
    run held until more text follows it (and dropped when the span closes)."""

    def __init__(self) -> None:
        self.started = False
        self.ws = ""

    def add(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.ws + text
        kept = text.rstrip()
        self.ws = text[len(kept) :]
        return kept
