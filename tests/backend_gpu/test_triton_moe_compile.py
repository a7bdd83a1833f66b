"""The experts' grouped GEMM compiles for the GPUs the engine targets, here on a machine
without one: every launch fused_experts makes for Mixtral- and Qwen3-MoE-shaped experts
(bfloat16, FP8 weights from sm_89 on, float16; a decode and a prefill chunk, both
matmuls) becomes a cubin for sm_90, sm_89 and sm_80 that fits the shared memory a block may have
there (tests/backend_gpu/moe_compile.py). The interpreter tests (test_triton_moe.py)
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
    return compile_in_subprocess("tests.backend_gpu.moe_compile")


def test_every_launch_compiles_for_each_target(compiled):
    assert not failures(compiled), "\n".join(failures(compiled))


def test_every_kernel_fits_the_targets_shared_memory(compiled):
    assert not over_shared_memory(compiled)


def test_each_case_launched_both_matmuls_per_batch_on_each_target(compiled):
    """The recorder saw gate_up's and down's launches for a decode's and a prefill's
    tiles: an empty run would pass the tests above."""
    from tests.backend_gpu.kernel_compile import TARGETS
    from tests.backend_gpu.moe_compile import CASES, TOKENS

    seen = [(r["shape"], r["target"]) for r in compiled]
    wanted = {
        (c.name, target) for c in CASES for target, (cc, _) in TARGETS.items() if c.runs_on(cc)
    }
    assert set(seen) == wanted
    assert all(seen.count(key) == 2 * len(TOKENS) for key in wanted)
