"""Token rates over a sliding window: the counter both engines feed once per step and
every reader (router, /metrics, dashboard) reads without resetting."""

from __future__ import annotations

import pytest

from engine_api import throughput
from engine_api.throughput import RATE_WINDOW_S, Throughput


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    """The time Throughput sees: set now[0] to move it."""
    now = [1000.0]
    monkeypatch.setattr(throughput, "monotonic", lambda: now[0])
    return now


def test_rates_sum_the_window_and_old_steps_drop_out(clock):
    t = Throughput()
    assert t.rates() == (0.0, 0.0)
    t.record(30, 1)
    clock[0] += 4
    t.record(0, 5)
    assert t.rates() == (30 / RATE_WINDOW_S, 6 / RATE_WINDOW_S)
    assert t.rates() == (30 / RATE_WINDOW_S, 6 / RATE_WINDOW_S)  # reading resets nothing
    clock[0] += RATE_WINDOW_S - 4 + 0.5  # the first step is now older than the window
    assert t.rates() == (0.0, 5 / RATE_WINDOW_S)
    clock[0] += 4
    assert t.rates() == (0.0, 0.0)
    assert (t.prompt_total, t.gen_total) == (30, 6)  # the totals keep everything
