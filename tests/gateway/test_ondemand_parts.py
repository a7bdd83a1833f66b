"""The models directory's pure parts (gateway.ondemand): Ollama's keep_alive as
seconds, what a directory holds, and which resident models make room for another."""

from __future__ import annotations

import pytest

from gateway.config_check import keep_alive_s
from gateway.ondemand.budget import GB, NoRoom, Resident, make_room
from gateway.ondemand.scan import scan


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("300ms", 0.3),
        ("0", 0.0),
        (0, 0.0),
        (90, 90.0),
        ("45", 45.0),
        ("-1", None),
        ("-5m", None),
        (-1, None),
    ],
)
def test_keep_alive_reads_as_ollama_does(value, seconds):
    assert keep_alive_s(value) == seconds


@pytest.mark.parametrize("value", ["5d", "m", "1m1", "", "inf", "nan", True, None, "9" * 40])
def test_keep_alive_refuses_what_is_no_duration(value):
    with pytest.raises(ValueError, match="keep_alive"):
        keep_alive_s(value)


def test_scan_serves_each_gguf_by_its_stem(tmp_path):
    (tmp_path / "tiny.gguf").write_bytes(b"x" * 10)
    (tmp_path / "big-00001-of-00002.gguf").write_bytes(b"x" * 5)
    (tmp_path / "big-00002-of-00002.gguf").write_bytes(b"x" * 7)
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "bad:tag.gguf").write_bytes(b"x")  # a tag cannot be in a file's name
    (tmp_path / ".hidden.gguf").write_bytes(b"x")
    (tmp_path / "sub.gguf").mkdir()  # a directory, not a file, and no model's
    (tmp_path / "hf").mkdir()  # a Hugging Face model's directory: the gpu backend's
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"x" * 20)
    (tmp_path / "notes").mkdir()  # a directory without config.json
    found = scan(str(tmp_path))
    assert sorted(found) == ["big", "hf", "tiny"]
    assert found["hf"].kind == "gpu" and found["hf"].size == 22 and found["tiny"].kind == "local"
    assert found["tiny"].size == 10 and found["tiny"].path == str(tmp_path / "tiny.gguf")
    assert found["big"].size == 12 and found["big"].path.endswith("big-00001-of-00002.gguf")


def r(name: str, size_gb: float, last_used: float, busy: bool = False) -> Resident:
    return Resident(name, int(size_gb * GB), last_used, busy)


def test_make_room_unloads_the_least_recently_used_idle_first():
    resident = [r("a", 1, 10), r("b", 1, 5), r("c", 1, 1, busy=True)]
    assert make_room("d", GB, resident, models_max=3, budget=10 * GB) == ["b"]
    assert make_room("d", GB, resident, models_max=2, budget=10 * GB) == ["b", "a"]
    assert make_room("d", GB, resident, models_max=4, budget=10 * GB) == []
    # memory: 3 GiB resident of 4.5, a 2 GiB model needs one idle one gone
    assert make_room("d", 2 * GB, resident, models_max=9, budget=int(4.5 * GB)) == ["b"]


def test_make_room_refuses_what_cannot_fit():
    with pytest.raises(NoRoom, match="more than the models' memory budget"):
        make_room("huge", 5 * GB, [], models_max=3, budget=4 * GB)
    busy = [r("a", 1, 1, busy=True)]
    with pytest.raises(NoRoom, match="all serving requests"):
        make_room("d", GB, busy, models_max=1, budget=10 * GB)
    with pytest.raises(NoRoom, match="does not fit"):
        make_room("d", 2 * GB, busy, models_max=5, budget=int(2.5 * GB))
