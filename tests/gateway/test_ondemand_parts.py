"""The models directory's pure parts (gateway.ondemand): Ollama's keep_alive as
seconds, what a directory holds (its vision projectors paired, never listed), and
which resident models make room for another."""

from __future__ import annotations

import gguf
import pytest

from gateway.config_check import keep_alive_s
from gateway.ondemand import files
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


def gguf_of(path, architecture: str) -> None:
    """A GGUF holding only its header, of `architecture`."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_scan_pairs_each_vision_projector_with_its_model_and_never_lists_one(tmp_path):
    (tmp_path / "gemma.gguf").write_bytes(b"x" * 10)
    (tmp_path / "mmproj-gemma.gguf").write_bytes(b"x" * 3)  # NAME's by its name
    gguf_of(tmp_path / "qwen.gguf", "qwen2vl")
    (tmp_path / "qwen.mmproj.gguf").write_bytes(b"x" * 4)
    (tmp_path / "mmproj-F16.gguf").write_bytes(b"x")  # pairs with no model here
    gguf_of(tmp_path / "tower.gguf", "clip")  # a projector by its header: no model
    (tmp_path / "plain.gguf").write_bytes(b"x" * 2)
    vl = tmp_path / "gemma-3-4b"  # llama-server's router's layout: one model, one projector
    vl.mkdir()
    (vl / "gemma-3-4b-it-Q8_0.gguf").write_bytes(b"x" * 20)
    (vl / "mmproj-F16.gguf").write_bytes(b"x" * 5)
    by_header = tmp_path / "by-header"  # the projector known by its architecture
    by_header.mkdir()
    gguf_of(by_header / "projector.gguf", "clip")
    (by_header / "model.gguf").write_bytes(b"x" * 8)
    split = tmp_path / "kimi"  # a model split into parts, in its own subdirectory
    split.mkdir()
    (split / "kimi-00001-of-00002.gguf").write_bytes(b"x" * 6)
    (split / "kimi-00002-of-00002.gguf").write_bytes(b"x" * 6)
    two = tmp_path / "two"  # which would be the model? neither is served
    two.mkdir()
    (two / "a.gguf").write_bytes(b"x")
    (two / "b.gguf").write_bytes(b"x")
    (tmp_path / "docs").mkdir()  # no GGUF: no model's
    found = scan(str(tmp_path))
    assert sorted(found) == ["by-header", "gemma", "gemma-3-4b", "kimi", "plain", "qwen"]
    assert found["gemma"].mmproj == str(tmp_path / "mmproj-gemma.gguf")
    assert found["gemma"].size == 13  # the model and its projector
    assert found["qwen"].mmproj == str(tmp_path / "qwen.mmproj.gguf")
    assert found["plain"].mmproj is None and found["kimi"].mmproj is None
    assert found["gemma-3-4b"].path == str(vl / "gemma-3-4b-it-Q8_0.gguf")
    assert found["gemma-3-4b"].mmproj == str(vl / "mmproj-F16.gguf")
    assert found["gemma-3-4b"].size == 25
    assert found["by-header"].mmproj == str(by_header / "projector.gguf")
    assert found["kimi"].path == str(split / "kimi-00001-of-00002.gguf")
    assert found["kimi"].size == 12


def test_a_copy_or_delete_takes_the_projector_with_its_model(tmp_path):
    (tmp_path / "gemma.gguf").write_bytes(b"x" * 10)
    (tmp_path / "mmproj-gemma.gguf").write_bytes(b"x" * 3)
    vl = tmp_path / "vl"
    vl.mkdir()
    (vl / "model.gguf").write_bytes(b"x")
    (vl / "mmproj-F16.gguf").write_bytes(b"x")
    found = scan(str(tmp_path))
    files.copy(str(tmp_path), found["gemma"], "gemma-2")
    copied = scan(str(tmp_path))["gemma-2"]
    assert copied.mmproj == str(tmp_path / "mmproj-gemma-2.gguf") and copied.size == 13
    with pytest.raises(files.FileError, match="'mmproj-gemma-2.gguf' exists already"):
        files.copy(str(tmp_path), found["gemma"], "gemma-2")
    files.delete(str(tmp_path), copied)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gemma.gguf", "mmproj-gemma.gguf", "vl"]
    for act in (
        lambda: files.copy(str(tmp_path), found["vl"], "vl-2"),
        lambda: files.delete(str(tmp_path), found["vl"]),
    ):
        with pytest.raises(files.FileError, match="'vl' is a subdirectory") as refused:
            act()
        assert refused.value.status == 400


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
