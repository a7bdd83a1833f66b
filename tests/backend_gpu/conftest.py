from __future__ import annotations

import os

import pytest
import torch

import backend_gpu.config
from tests.backend_gpu.tiny_models import save_tiny_model

if not torch.cuda.is_available():
    # the Triton kernels run on CPU tensors in Triton's interpreter, which must be on
    # before anything imports triton: triton.language's own helpers are made at import.
    # Here, before any test module of this directory is collected, so no order of
    # collection can import triton first.
    os.environ["TRITON_INTERPRET"] = "1"


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
