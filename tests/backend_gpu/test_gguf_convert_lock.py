"""A GGUF file is converted once however many ask for it at once (gguf_loader.convert_gguf):
the second caller waits on the file lock beside the cache entry and loads what the first
wrote. Tensor-parallel ranks, two engines of one gateway and the suite's workers all start
on the same file; each used to convert it again beside the others (Gemma 3 270M: about
50 CPU-s each)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from backend_gpu import gguf_loader
from tests.backend_local.gguf_families import save_family, write_gguf


def test_two_callers_at_once_convert_the_file_once(tmp_path, monkeypatch):
    checkpoint = save_family("gemma3_mm", str(tmp_path))
    path = write_gguf(checkpoint, str(tmp_path / "tiny.gguf"))
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path / "cache"))
    conversions = []
    convert = gguf_loader._convert

    def counted(source: str, target: str) -> None:
        conversions.append(target)
        convert(source, target)

    monkeypatch.setattr(gguf_loader, "_convert", counted)
    both_started = threading.Barrier(2)

    def ask(_: int) -> str:
        both_started.wait()  # both ask at once: neither finds the other's conversion
        return gguf_loader.convert_gguf(path)

    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(ask, range(2))
    assert first == second == conversions[0]
    assert len(conversions) == 1
    assert os.path.isfile(os.path.join(first, "config.json"))
    assert not [name for name in os.listdir(os.path.dirname(first)) if name.startswith(".conv")]
