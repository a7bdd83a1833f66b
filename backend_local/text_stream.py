"""Token bytes -> text deltas, with stop strings.

A UTF-8 character may be split over tokens, and a stop string over text deltas: bytes wait
in the decoder until they form characters, and text that could still begin a stop string
waits here until the next token decides it. The stop string itself is never emitted.
"""

from __future__ import annotations

import codecs


class TextStream:
    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""  # decoded text not emitted yet: it may be the start of a stop string

    def add(self, piece: bytes) -> tuple[str, str | None]:
        """Feed one token's bytes; returns (text to emit now, the stop string that
        matched, if one did: the earliest in the text)."""
        self._held += self._decoder.decode(piece)
        if not self.stop:
            text, self._held = self._held, ""
            return text, None
        hits = [(i, s) for s in self.stop if (i := self._held.find(s)) >= 0]
        if hits:
            at, stop = min(hits, key=lambda hit: hit[0])
            text, self._held = self._held[:at], ""
            return text, stop
        keep = self._partial_stop_len()
        text = self._held[: len(self._held) - keep]
        self._held = self._held[len(self._held) - keep :]
        return text, None

    def flush(self) -> str:
        """The rest of the text when generation ends for another reason than a stop string."""
        text, self._held = self._held + self._decoder.decode(b"", final=True), ""
        return text

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of the held text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self._held)), best, -1):
                if self._held.endswith(s[:n]):
                    best = n
                    break
        return best
