"""llama.cpp's default thread count: one a core this process may run on, not one a core
of the machine (a pinned process with more threads spins at llama.cpp's barriers)."""

from __future__ import annotations

import os

from backend_local.config import EngineConfig, default_threads


def test_the_default_is_one_thread_a_core_this_process_may_run_on(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    assert default_threads() == 3
    assert EngineConfig(model_path="m.gguf").n_threads == 3
    assert EngineConfig(model_path="m.gguf", n_threads=2).n_threads == 2  # as given
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert default_threads() == 8  # at most
