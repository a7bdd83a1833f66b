"""Token rates over a sliding window, fed once per engine step.

Both engines count their steps with this class (backend_gpu per engine step, backend_local
per decode step), so their rates mean the same thing.
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
        self.prompt_total = 0
        self.gen_total = 0

    def record(self, prompt_tokens: int, gen_tokens: int) -> None:
        now = monotonic()
        with self._lock:
            self._steps.append((now, prompt_tokens, gen_tokens))
            self.prompt_total += prompt_tokens
            self.gen_total += gen_tokens
            self._trim(now)

    def rates(self) -> tuple[float, float]:
        """Prompt and generated tokens per second over the window; reading resets nothing."""
        now = monotonic()
        with self._lock:
            self._trim(now)
            prompt = sum(p for _, p, _ in self._steps)
            gen = sum(g for _, _, g in self._steps)
        return prompt / RATE_WINDOW_S, gen / RATE_WINDOW_S

    def _trim(self, now: float) -> None:
        while self._steps and self._steps[0][0] < now - RATE_WINDOW_S:
            self._steps.popleft()
