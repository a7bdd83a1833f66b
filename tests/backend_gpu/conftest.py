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


# the tests that take the session's float32 Gemma 3 270M: one worker runs them all, so it
# is loaded once (about 4.3 CPU-s a load, its 262k-token tokenizer most of it)
GEMMA3_270M_GROUP = pytest.mark.xdist_group("gemma3-270m-float32")


@pytest.fixture(scope="session")
def gemma3_270m():
    """The default model, Gemma 3 270M from its GGUF, as a plain float32 engine: the
    reference of the FP8 test, the n-gram test's plain decoding and the two-rank test's one
    rank, which each made the same engine. A small KV cache (16 MiB: 28 blocks of 16 tokens
    in float32) and a max_model_len it holds, so that it starts whatever else the machine
    holds. Its users only generate: prefix caching is on, so no test may read its cache
    state."""
    from backend_gpu import LLM
    from gateway.backends.default_model import default_model_path

    llm = LLM(default_model_path(), kv_cache_memory_bytes=16 << 20, max_model_len=448)
    yield llm
    llm.engine.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")

    def make(arch: str) -> str:
        return save_tiny_model(arch, str(root))

    return make
