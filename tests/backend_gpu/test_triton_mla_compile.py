"""The MLA kernel compiles for the GPUs the engine targets, here on a machine without
one: every launch mla_paged_attention makes for DeepSeek-shaped attention (a latent of
512 and a rotary key of 64; 16 heads a rank under TP 8 and all 128; bfloat16, float16,
an FP8 cache from sm_89 on; decodes split and whole, a verification, a prefill chunk)
becomes a cubin for sm_90, sm_89 and sm_80 that fits the shared memory a block may have
there (tests/backend_gpu/mla_compile.py). The interpreter tests (test_triton_mla.py)
check what the kernel computes; this checks that the compiler takes it.

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
    return compile_in_subprocess("tests.backend_gpu.mla_compile")


def test_every_launch_compiles_for_each_target(compiled):
    assert not failures(compiled), "\n".join(failures(compiled))


def test_every_kernel_fits_the_targets_shared_memory(compiled):
    assert not over_shared_memory(compiled)


def test_each_case_launched_the_kernel_and_the_merge_on_each_target(compiled):
    """The recorders saw the wrapper's launches (the merge only after split ones): an
    empty run would pass the tests above."""
    from tests.backend_gpu.kernel_compile import TARGETS
    from tests.backend_gpu.mla_compile import CASES, KERNELS

    seen = {(r["shape"], r["kernel"], r["target"]) for r in compiled}
    wanted = {
        (c.name, kernel, target)
        for c in CASES
        for kernel in KERNELS
        for target, (cc, _) in TARGETS.items()
        if c.runs_on(cc)
    }
    assert seen == wanted
