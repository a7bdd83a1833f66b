"""The LoRA kernels compile for the GPUs the engine targets, here on a machine without
one: every launch lora_shrink and lora_expand make for a set of cases (bfloat16,
float16, float32, bfloat16 activations with float32 adapters; ranks 8 to 128; a decode
and a prefill chunk) becomes a cubin for sm_90, sm_89 and sm_80 that fits the shared
memory a block may have there (tests/backend_gpu/lora_compile.py). The interpreter tests
(test_triton_lora.py) check what the kernels compute; this checks that the compiler
takes them.

In a subprocess (tests/backend_gpu/compile_checks.py)."""

from __future__ import annotations

import pytest

from tests.backend_gpu.compile_checks import (
    COMPILE_TIMEOUT,
    compile_in_subprocess,
    failures,
    over_shared_memory,
)

pytest.importorskip("triton")
pytestmark = COMPILE_TIMEOUT


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    return compile_in_subprocess("tests.backend_gpu.lora_compile")


def test_every_launch_compiles_for_each_target(compiled):
    assert not failures(compiled), "\n".join(failures(compiled))


def test_every_kernel_fits_the_targets_shared_memory(compiled):
    assert not over_shared_memory(compiled)


def test_each_kernel_was_launched_for_each_case_and_target(compiled):
    """The recorders saw the wrappers' launches, a decode's and a prefill's tiles each:
    an empty run would pass the tests above."""
    from tests.backend_gpu.kernel_compile import TARGETS
    from tests.backend_gpu.lora_compile import CASES, KERNELS, TOKENS

    seen = [(r["shape"], r["kernel"], r["target"]) for r in compiled]
    wanted = {(c.name, kernel, target) for c in CASES for kernel in KERNELS for target in TARGETS}
    assert set(seen) == wanted
    assert all(seen.count(key) == len(TOKENS) for key in wanted)
