"""Counters the worker keeps and the snapshot the engine hands out."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

RATE_WINDOW_S = 10.0


@dataclass
class EngineStats:
    healthy: bool
    n_parallel: int
    busy: int  # sequences serving a request
    free: int
    waiting: int  # requests queued for a free sequence
    n_ctx: int
    kv_cells_busy: int  # cells held by busy sequences (idle ones keep theirs for reuse)
    prompt_tokens_total: int  # prompt tokens computed
    gen_tokens_total: int
    prefix_query_tokens: int  # prompt tokens of admitted requests
    prefix_reused_tokens: int  # of those, found in the KV cells
    prompt_tokens_per_s: float  # over the last RATE_WINDOW_S seconds
    gen_tokens_per_s: float


class Throughput:
    """Token counts per decode step, summed over a sliding window; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: deque[tuple[float, int, int]] = deque()
        self.prompt_total = 0
        self.gen_total = 0

    def record(self, prompt_tokens: int, gen_tokens: int) -> None:
        now = time.monotonic()
        with self._lock:
            self._steps.append((now, prompt_tokens, gen_tokens))
            self.prompt_total += prompt_tokens
            self.gen_total += gen_tokens
            self._trim(now)

    def rates(self) -> tuple[float, float]:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            prompt = sum(p for _, p, _ in self._steps)
            gen = sum(g for _, _, g in self._steps)
        return prompt / RATE_WINDOW_S, gen / RATE_WINDOW_S

    def _trim(self, now: float) -> None:
        while self._steps and self._steps[0][0] < now - RATE_WINDOW_S:
            self._steps.popleft()
