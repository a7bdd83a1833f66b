"""Weights packed for oneDNN on the CPU (layers/cpu_packed.py). gpt-oss's experts: the
packed path is taken once packed, replaces the stacked weights, and gives the unpacked
path's outputs (decode-sized runs, runs shorter than MIN_ROWS at either end of the
buffer, a buffer shorter than MIN_ROWS, a prefill, a rank without down's bias); 8-bit
and float16 experts are left unpacked. A linear: its weight parameter becomes the packed
tensor, outputs as before; a float16 one is left as it is."""

from __future__ import annotations

import copy

import pytest
import torch

from backend_gpu.distributed import ParallelGroup
from backend_gpu.expert_shards import ExpertShard, MoEConfig
from backend_gpu.layers import cpu_kernels, cpu_packed
from backend_gpu.layers.gpt_oss_moe import STACKED, BiasedExperts, ClampedSwiGLU, per_expert
from backend_gpu.layers.linear import Linear
from backend_gpu.memory import parameter_bytes
from tests.backend_gpu.test_moe import routing

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="needs torch built with oneDNN"
)

MOE = MoEConfig(8, 4, 64, True, STACKED, frozenset({0}))


@pytest.fixture(autouse=True)
def no_kernel(monkeypatch):
    """The oneDNN packing, which float32 experts take where the engine's own kernel is
    not built (test_cpu_kernels.py tests that one)."""
    monkeypatch.setattr(cpu_kernels, "usable", lambda *args: False)


HIDDEN = 64


def experts_of(dtype: torch.dtype, down_bias: bool = True) -> BiasedExperts:
    shard = ExpertShard.of(MOE, ParallelGroup(), False)
    experts = BiasedExperts(HIDDEN, shard, ClampedSwiGLU(1.702, 7.0), down_bias)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return experts.to(dtype)


def packed_copy(experts: BiasedExperts) -> BiasedExperts:
    packed = copy.deepcopy(experts)
    packed.pack_for_cpu()
    return packed


@pytest.mark.parametrize("tokens,skew", [(1, False), (3, False), (16, False), (40, True)])
@pytest.mark.parametrize("down_bias", [True, False])
def test_packed_experts_equal_the_stacked(tokens, skew, down_bias):
    experts = experts_of(torch.float32, down_bias)
    packed = packed_copy(experts)
    assert packed.packed is not None and len(packed.packed["gate_up"]) == 8
    assert packed.gate_up_proj is None and packed.down_proj is None  # one copy held
    assert all(t.is_mkldnn for t in packed.packed["down"])
    held = parameter_bytes(packed) + cpu_packed.packed_bytes(packed)
    assert held == parameter_bytes(experts)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(4))
    weights, ids = routing(tokens, 8, 4, skew)
    with torch.inference_mode():
        want = per_expert(experts, x, weights, ids)
        got = per_expert(packed, x, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("runs", [[1, 0, 2, 5, 1], [2], [0, 3, 0], [4, 4], [9, 1, 1]])
def test_short_runs_take_their_neighbours_rows(runs):
    """Each run's product alone, whatever rows were computed beside it."""
    gen = torch.Generator().manual_seed(5)
    stacked = torch.randn(len(runs), 24, HIDDEN, generator=gen)
    biases = torch.randn(len(runs), 24, generator=gen)
    rows = torch.randn(sum(runs), HIDDEN, generator=gen)
    got = cpu_packed.packed_runs(cpu_packed.pack(stacked), biases, rows, runs)
    expert = torch.repeat_interleave(torch.arange(len(runs)), torch.tensor(runs))
    want = torch.einsum("rh,roh->ro", rows, stacked[expert]) + biases[expert]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bfloat16_packs_where_onednn_computes_it():
    experts = experts_of(torch.bfloat16)
    packed = packed_copy(experts)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert packed.packed is None
        return
    x = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(4)).bfloat16()
    weights, ids = routing(16, 8, 4, False)
    with torch.inference_mode():
        want = per_expert(experts, x, weights, ids)
        got = per_expert(packed, x, weights, ids)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kind", ["float16", "int8"])
def test_unpackable_experts_stay_stacked(kind):
    experts = experts_of(torch.float16 if kind == "float16" else torch.float32)
    if kind == "int8":
        experts.quantize("int8", ParallelGroup())
    stacked = experts.gate_up_proj
    experts.pack_for_cpu()
    assert experts.packed is None and experts.gate_up_proj is stacked
    x = torch.randn(4, HIDDEN, dtype=stacked.dtype if kind == "float16" else torch.float32)
    with torch.inference_mode():
        assert per_expert(experts, x, *routing(4, 8, 4, False)).isfinite().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, HIDDEN), (16, HIDDEN), (2, 40, HIDDEN)])
def test_packed_linear_equals_the_plain_one(dtype, bias, shape):
    torch.manual_seed(7)
    linear = Linear(HIDDEN, 48, bias=bias).to(dtype)
    x = torch.randn(shape).to(dtype)
    with torch.inference_mode():
        want = linear(x)
        cpu_packed.pack_linear(linear)
        got = linear(x)
    packed = dtype == torch.float32
    assert linear.weight.is_mkldnn == packed and linear.weight.shape == (48, HIDDEN)
    assert parameter_bytes(linear) == (48 * HIDDEN + 48 * bias) * x.element_size()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
