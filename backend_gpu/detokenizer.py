"""Incremental detokenization that is right for multi-byte characters and for
sentencepiece's word-start spaces.

Decoding one token alone loses the leading space sentencepiece folds into it, and a
character split over several byte tokens decodes to U+FFFD until its last byte comes.
So each step decodes a short window of recent tokens twice (with and without the new
ones) and emits the difference, holding it back while it ends in an incomplete char.
"""

from __future__ import annotations

# how many already-emitted tokens give the decoder its context
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""
        self.stop = stop
        # text that might be the start of a stop string is not streamed yet
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.num_emitted_chars = 0

    def add(self, token_ids: list[int]) -> str | None:
        """Append new tokens; return the stop string they complete, if any."""
        self.token_ids.extend(token_ids)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new_text = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            self.output_text += new_text
            return self._find_stop(len(new_text))
        return None

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _find_stop(self, num_new_chars: int) -> str | None:
        if not self.stop:
            return None
        # a stop string can only end inside the new text
        search_from = max(0, len(self.output_text) - num_new_chars - self.hold_back)
        best: tuple[int, str] | None = None
        for s in self.stop:
            at = self.output_text.find(s, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return None
        self.output_text = self.output_text[: best[0]]  # the stop string is not output
        return best[1]

    def take_delta(self, finished: bool) -> str:
        """The text not yet streamed; short of the finish, keep back what could still
        turn out to be the start of a stop string."""
        end = len(self.output_text) if finished else len(self.output_text) - self.hold_back
        if end <= self.num_emitted_chars:
            return ""
        delta = self.output_text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return delta
