from __future__ import annotations

import pytest

import backend_gpu.config
from tests.backend_gpu.tiny_models import save_tiny_model


@pytest.fixture(autouse=True)
def cpu_unless_marked_cuda(request, monkeypatch):
    """Engines built without a device run on the CPU in float32, as these tests expect
    (their references are transformers' on the CPU), even where a GPU is: device "auto"
    means CUDA only in the tests marked `cuda`."""
    if request.node.get_closest_marker("cuda") is None:
        monkeypatch.setattr(backend_gpu.config, "auto_device", lambda: "cpu")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")

    def make(arch: str) -> str:
        return save_tiny_model(arch, str(root))

    return make
