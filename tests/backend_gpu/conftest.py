from __future__ import annotations

import pytest

from tests.backend_gpu.tiny_models import save_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")

    def make(arch: str) -> str:
        return save_tiny_model(arch, str(root))

    return make
