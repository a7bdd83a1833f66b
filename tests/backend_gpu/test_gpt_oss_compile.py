"""gpt-oss's kernels compile for the GPUs the engine targets, here on a machine without
one: the paged attention kernels with sinks at its attention shape, and the MXFP4
grouped GEMM as its experts launch it (bfloat16 and float16, a decode and a prefill
chunk, both matmuls), each a cubin for sm_90, sm_89 and sm_80 that fits the shared
memory a block may have there (tests/backend_gpu/gpt_oss_compile.py). The interpreter
tests (test_attention_sinks.py, test_triton_mxfp4.py) check what they compute; this
checks that the compiler takes them.

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
    return compile_in_subprocess("tests.backend_gpu.gpt_oss_compile")


def test_every_launch_compiles_for_each_target(compiled):
    assert not failures(compiled), "\n".join(failures(compiled))


def test_every_kernel_fits_the_targets_shared_memory(compiled):
    assert not over_shared_memory(compiled)


def test_each_kernel_was_launched_on_each_target(compiled):
    """The recorders saw the launches: an empty run would pass the tests above. The
    attention kernels once per decode split count and query length; the MXFP4 GEMM
    twice (gate/up, down) per batch size."""
    from tests.backend_gpu.gpt_oss_compile import ATTENTION, CASES, TOKENS
    from tests.backend_gpu.kernel_compile import KERNELS, TARGETS

    seen = [(r["shape"], r["kernel"], r["target"]) for r in compiled]
    attention = {(s.name, k, t) for s in ATTENTION for k in KERNELS for t in TARGETS}
    experts = {(c.name, "_mxfp4_grouped_gemm_kernel", t) for c in CASES for t in TARGETS}
    assert set(seen) == attention | experts
    assert all(seen.count(key) == 2 * len(TOKENS) for key in experts)
