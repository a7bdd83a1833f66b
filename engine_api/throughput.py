"""Token rates over a sliding window, fed once per engine step.

Both engines count their steps with this class (backend_gpu per engine step, backend_local
per decode step), so their rates mean the same thing. The window's sums are kept as steps
come and go: a window holds thousands of steps, and summing them at each read cost 0.2 ms
(docs/PERF.md, issue 50), paid by the engine thread after every step (its stats) and by
the gateway's loop at every stats() read (each request's routing).
"""

from __future__ import annotations

import threading
from collections import deque
from time import monotonic

RATE_WINDOW_S = 10.0


class Throughput:
    """Token counts per step, summed over the last RATE_WINDOW_S seconds; thread-safe
    (the engine records from its step thread, callers read rates from any other)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: deque[tuple[float, int, int]] = deque()
        self._prompt = self._gen = 0  # the window's sums
        self.prompt_total = 0
        self.gen_total = 0

    def record(self, prompt_tokens: int, gen_tokens: int) -> None:
        now = monotonic()
        with self._lock:
            self._steps.append((now, prompt_tokens, gen_tokens))
            self._prompt += prompt_tokens
            self._gen += gen_tokens
            self.prompt_total += prompt_tokens
            self.gen_total += gen_tokens
            self._trim(now)

    def rates(self) -> tuple[float, float]:
        """Prompt and generated tokens per second over the window; reading resets nothing."""
        now = monotonic()
        with self._lock:
            self._trim(now)
            prompt, gen = self._prompt, self._gen
        return prompt / RATE_WINDOW_S, gen / RATE_WINDOW_S

    def _trim(self, now: float) -> None:
        while self._steps and self._steps[0][0] < now - RATE_WINDOW_S:
            _, prompt, gen = self._steps.popleft()
            self._prompt -= prompt
            self._gen -= gen
