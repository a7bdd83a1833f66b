"""The packed INT4/INT8 matmul compiles for the GPUs the engine targets, here on a
machine without one: every launch int4_matmul makes for two cases (bfloat16 INT4 in
groups of 128; float16 INT8 in act order; between them the GEMV shape at 1 and 4 rows,
a 16-row tile and a prefill chunk's 64-row tile) becomes a cubin
for sm_90, sm_89 and sm_80 that fits the shared memory a block may have there
(tests/backend_gpu/int4_compile.py). The interpreter tests (test_triton_int4.py) check
what the kernel computes; this checks that the compiler takes it.

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


def test_every_launch_compiles_and_fits_each_target():
    from tests.backend_gpu.int4_compile import CASES, KERNELS
    from tests.backend_gpu.kernel_compile import TARGETS

    compiled = compile_in_subprocess("tests.backend_gpu.int4_compile")
    assert not failures(compiled), "\n".join(failures(compiled))
    assert not over_shared_memory(compiled)
    # the recorder saw the wrapper's launches, one per batch size of each case (each its
    # own tile shape): an empty run would pass the checks above
    seen = [(r["shape"], r["kernel"], r["target"]) for r in compiled]
    wanted = {(c.name, kernel, target) for c in CASES for kernel in KERNELS for target in TARGETS}
    assert set(seen) == wanted
    assert all(seen.count(key) == 2 for key in wanted)
