import pytest


@pytest.fixture(scope="session")
def model_path() -> str:
    from gateway.backends.default_model import default_model_path

    return str(default_model_path())


@pytest.fixture(scope="session")
def vision_gguf(tmp_path_factory) -> tuple[str, str]:
    """The tiny Gemma 3 vision model's (text GGUF, mmproj GGUF), written once a session
    for every module that serves it (tiny_vision_gguf.py)."""
    from tests.backend_local.tiny_vision_gguf import write_vision_gguf

    return write_vision_gguf(str(tmp_path_factory.mktemp("vision-gguf")))
