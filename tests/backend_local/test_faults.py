import pytest

from backend_local import EngineConfig, EngineDeadError, LocalEngine, ModelLoadError, SamplingParams
from tests.requests import req


def test_missing_model_file(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        LocalEngine(EngineConfig(str(tmp_path / "nope.gguf")))


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip, not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        LocalEngine(EngineConfig(str(path)))


@pytest.mark.slow
def test_truncated_gguf_file(tmp_path, model_path):
    path = tmp_path / "truncated.gguf"
    with open(model_path, "rb") as f:
        path.write_bytes(f.read(4 << 20))
    with pytest.raises(ModelLoadError, match="could not load"):
        LocalEngine(EngineConfig(str(path)))


@pytest.mark.slow
async def test_requests_after_shutdown_get_engine_dead_error(model_path):
    engine = LocalEngine(EngineConfig(model_path, n_ctx=256, n_parallel=1, n_batch=64, n_threads=1))
    engine.shutdown()
    assert not engine.healthy
    with pytest.raises(EngineDeadError, match="shut down"):
        await anext(engine.generate(req("late", [2, 100], SamplingParams(max_tokens=2))))
