"""Request ids sort by the time they were made (the usage table's request_id index takes
each row at its end), and the part after the time is random."""

from __future__ import annotations

import time

from gateway.serving import request_ids
from gateway.serving.request_ids import time_ordered_hex


def test_ids_made_later_sort_later(monkeypatch):
    clock = iter(t * 1_000_000 for t in (1, 2, 255, 256, 4096, 2**40))
    monkeypatch.setattr(request_ids.time, "time_ns", lambda: next(clock))
    ids = [time_ordered_hex() for _ in range(6)]
    assert ids == sorted(ids) and len(set(ids)) == 6
    assert {len(i) for i in ids} == {28}
    assert all(int(i, 16) >= 0 for i in ids)  # hex digits only


def test_within_a_millisecond_the_ids_differ_by_their_random_part(monkeypatch):
    monkeypatch.setattr(request_ids.time, "time_ns", lambda: 1_700_000_000_000_000_000)
    ids = {time_ordered_hex() for _ in range(1000)}
    assert len(ids) == 1000
    assert {i[:12] for i in ids} == {f"{1_700_000_000_000:012x}"}


def test_the_time_part_is_now():
    before = time.time_ns() // 1_000_000
    made = int(time_ordered_hex()[:12], 16)
    assert before <= made <= time.time_ns() // 1_000_000
