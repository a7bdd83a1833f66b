"""The paged attention kernels compile for the GPUs the engine targets, here on a machine
without one: every launch the wrappers make for a set of real model shapes (bfloat16,
float16, float32, an FP8 cache, GQA groups 2, 4 and 7, head dims 16 to 256, a sliding
window, 1 and 16 decode splits, a prefill chunk and a verification) becomes a cubin for
sm_90, sm_89 and sm_80 (an FP8 cache from sm_89 on) that fits the shared memory a block
may have there. The interpreter tests check what the kernels compute; this checks that
the compiler takes them (Triton as installed here; the H200 machine's 3.6 was checked by
hand when this was written).

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
    return compile_in_subprocess("tests.backend_gpu.kernel_compile")


def test_every_launch_compiles_for_each_target(compiled):
    assert not failures(compiled), "\n".join(failures(compiled))


def test_every_kernel_fits_the_targets_shared_memory(compiled):
    assert not over_shared_memory(compiled)


def test_each_kernel_was_launched_for_each_shape_and_target(compiled):
    """The recorders saw the wrappers' launches: an empty run would pass the tests above."""
    from tests.backend_gpu.kernel_compile import KERNELS, SHAPES, TARGETS

    seen = {(r["shape"], r["kernel"], r["target"]) for r in compiled}
    wanted = {
        (s.name, kernel, target)
        for s in SHAPES
        for kernel in KERNELS
        for target, (capability, _) in TARGETS.items()
        if s.runs_on(capability)
    }
    assert seen == wanted
