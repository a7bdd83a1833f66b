"""MXFP4 (quantization/mxfp4.py) and gpt-oss's experts on their two paths: dequantize
equal to transformers' own MXFP4 conversion, bit for bit; the tests' quantizer exact on
values on the grid; the Triton MXFP4 grouped GEMM (layers/triton_mxfp4.py) against
dequantize then a matmul; and the experts' kernel path (layers/gpt_oss_moe.py's
grouped_kernels: MXFP4, 16-bit and FP8 weights, biases, the clamped SwiGLU) against the
torch path, for a decode and a prefill chunk, skewed runs and a rank holding half the
experts. Without CUDA in Triton's interpreter (conftest.py), float32; on a GPU (the
`cuda` mark, studies/gpu_check.sh) also gpt-oss-120b's expert sizes in bfloat16."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from backend_gpu.distributed import ParallelGroup
from backend_gpu.expert_shards import ExpertShard, MoEConfig
from backend_gpu.layers.gpt_oss_moe import (
    STACKED,
    BiasedExperts,
    ClampedSwiGLU,
    Mxfp4Experts,
    grouped_kernels,
    per_expert,
)
from backend_gpu.quantization import mxfp4
from tests.backend_gpu.mxfp4_checkpoints import quantize_mxfp4
from tests.backend_gpu.test_moe import routing

pytest.importorskip("triton")

from backend_gpu.layers.triton_moe import align_by_expert  # noqa: E402
from backend_gpu.layers.triton_mxfp4 import mxfp4_grouped_gemm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # else interpreted (conftest)
MOE = MoEConfig(8, 4, 64, True, STACKED, frozenset({0}))
HIDDEN = 64
SWIGLU = ClampedSwiGLU(1.702, 1.0)


def random_packed(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes and scales around 2^-3 (a few far out, as real checkpoints have)."""
    gen = torch.Generator().manual_seed(seed)
    groups = shape[-1] // mxfp4.GROUP
    blocks = torch.randint(0, 256, (*shape[:-1], groups, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(118, 130, (*shape[:-1], groups), generator=gen, dtype=torch.uint8)
    scales.view(-1)[:3] = torch.tensor([100, 140, 127], dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_is_transformers_conversion(dtype):
    blocks, scales = random_packed((3, 40, 96), seed=1)
    ours = mxfp4.dequantize(blocks, scales, dtype)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, cols, rows]
    assert ours.shape == (3, 40, 96) and ours.dtype == dtype
    assert torch.equal(ours, theirs.transpose(1, 2))


def test_quantizer_keeps_values_on_the_grid():
    """Values that are E2M1 codes times a group's power of two come back exactly;
    others within two of the group's units (2^e, at most a quarter of its largest:
    half the top step, or the clamp of a largest above 6 units to 6)."""
    gen = torch.Generator().manual_seed(2)
    codes = torch.tensor(mxfp4.E2M1_VALUES)[torch.randint(0, 8, (4, 64), generator=gen)]
    codes[:, ::32] = 6.0  # each group's largest sets its exponent
    signs = torch.where(torch.rand(4, 64, generator=gen) < 0.5, -1.0, 1.0)
    exact = codes * signs * 2.0 ** torch.tensor([[-9.0], [-3.0], [0.0], [4.0]])
    assert torch.equal(mxfp4.dequantize(*quantize_mxfp4(exact), torch.float32), exact)
    x = torch.randn(4, 64, generator=gen)
    err = (mxfp4.dequantize(*quantize_mxfp4(x), torch.float32) - x).abs()
    unit = torch.exp2(torch.floor(torch.log2(x.abs().unflatten(-1, (-1, 32)).amax(-1))) - 2)
    assert (err <= 2 * unit.repeat_interleave(32, -1)).all()


@pytest.mark.parametrize("tokens,skew", [(1, False), (5, False), (40, True)])
@pytest.mark.parametrize("weighted", [False, True])
def test_kernel_equals_dequantize_then_matmul(tokens, skew, weighted):
    experts, n, k, top = 8, 96, 128, 2
    blocks, scales = random_packed((experts, n, k), seed=3)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(4))
    weights, ids = routing(tokens, experts, top, skew)
    local = ids.flatten()
    tiles = align_by_expert(local.to(DEVICE), experts, 16)
    out = torch.zeros(tokens * top, n, device=DEVICE)
    pair_weights = weights.flatten().to(DEVICE) if weighted else None
    device = (t.to(DEVICE) for t in (x, blocks, scales))
    mxfp4_grouped_gemm(*device, tiles, out, top, pair_weights)
    w = mxfp4.dequantize(blocks, scales, torch.float32)
    want = torch.einsum("pk,pnk->pn", x.repeat_interleave(top, 0), w[local])
    if weighted:
        want = want * weights.flatten()[:, None]
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-5)


def random_experts(kind: str, shard: ExpertShard, seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    cls = Mxfp4Experts if kind == "mxfp4" else BiasedExperts
    experts = cls(HIDDEN, shard, SWIGLU, down_bias=True)
    with torch.no_grad():
        for name, param in experts.named_parameters():
            if param.dtype == torch.uint8:  # [E, rows, groups(, 16)]
                cols = param.shape[2] * mxfp4.GROUP
                blocks, scales = random_packed((*param.shape[:2], cols), seed)
                param.copy_(blocks if name.endswith("_blocks") else scales)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    if kind == "fp8":
        experts.quantize("fp8", ParallelGroup())
    return experts.to(DEVICE)


@pytest.mark.parametrize("kind", ["mxfp4", "16-bit", "fp8"])
@pytest.mark.parametrize("tokens,skew", [(3, False), (40, True)])
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_kernel_path_equals_the_torch_path(kind, tokens, skew, expert_parallel):
    """The two paths of the experts' whole MLP (biases, activation, routing weights); as
    rank 1 of 2 under expert parallel, only experts 4..7 are computed here."""
    tp = ParallelGroup(1, 2) if expert_parallel else ParallelGroup()
    experts = random_experts(kind, ExpertShard.of(MOE, tp, expert_parallel))
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(6))
    weights, ids = routing(tokens, 8, 4, skew)
    want = per_expert(experts.cpu(), x, weights, ids)
    got = grouped_kernels(experts.to(DEVICE), x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    if expert_parallel:  # tokens only on experts 0..3 get nothing here
        assert not want[(ids < 4).all(dim=1)].any()


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 64, 512])
def test_gpt_oss_120b_sizes_on_cuda(tokens):
    """One layer of gpt-oss-120b's experts (128 of 2880, hidden 2880, top 4) in MXFP4,
    bfloat16 activations: the kernel path against the torch path on the same GPU."""
    moe = MoEConfig(128, 4, 2880, True, STACKED, frozenset({0}))
    shard = ExpertShard.of(moe, ParallelGroup(), False)
    with torch.device("cuda"):
        experts = Mxfp4Experts(2880, shard, ClampedSwiGLU(1.702, 7.0), down_bias=True)
    with torch.no_grad():
        for name, param in experts.named_parameters():
            if name.endswith("_blocks"):
                param.random_(0, 256)
            elif name.endswith("_scales"):
                param.random_(118, 122)
            else:
                param.normal_(0.0, 0.02)
    experts.to(torch.bfloat16)
    x = torch.randn(tokens, 2880, device="cuda").to(torch.bfloat16)
    weights, ids = routing(tokens, 128, 4, skew=False)
    weights, ids = weights.cuda(), ids.cuda()
    got = grouped_kernels(experts, x, weights, ids)
    want = per_expert(experts, x, weights, ids)
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
