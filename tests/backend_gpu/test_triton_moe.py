"""The experts' Triton grouped GEMM (backend_gpu/layers/triton_moe.py) against the torch
path (layers/moe.py's grouped_experts, itself held to the loop over experts): a decode
batch and a prefill chunk (16- and 64-row tiles), skewed runs and experts with no
tokens, a rank holding half the experts (expert parallel), FP8 weights with their
scales. Without CUDA in Triton's interpreter (conftest.py turns it on), in float32;
on a GPU (the `cuda` mark, studies/gpu_check.sh) also at Mixtral 8x7B's sizes in
bfloat16."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from backend_gpu.distributed import ParallelGroup  # noqa: E402
from backend_gpu.expert_shards import ExpertShard, MoEConfig  # noqa: E402
from backend_gpu.layers.moe import FusedExperts, grouped_experts, local_expert_ids  # noqa: E402
from backend_gpu.layers.triton_moe import (  # noqa: E402
    ExpertWeights,
    align_by_expert,
    fused_experts,
)
from backend_gpu.quantization import fp8  # noqa: E402
from tests.backend_gpu.test_moe import MOE8, random_experts, routing  # noqa: E402


def test_pairs_are_tiled_by_expert():
    # experts of 5 pairs: 2, 0, 2, 0 and one held elsewhere (4)
    local = torch.tensor([2, 0, 4, 2, 0])
    blocks = align_by_expert(local, 4, 2)
    tiles = blocks.pairs.view(-1, 2).tolist()
    experts = blocks.block_expert.tolist()
    # expert 0's pairs (1, 4) fill a tile, expert 2's (0, 3) the next; 5 marks padding
    assert tiles[:2] == [[1, 4], [0, 3]] and experts[:2] == [0, 2]
    assert all(e >= 4 for e in experts[2:]) and all(t == [5, 5] for t in tiles[2:])


@pytest.mark.parametrize("tokens,skew", [(5, False), (40, True)])
@pytest.mark.parametrize("expert_parallel", [False, True])
@pytest.mark.parametrize("method", [None, "fp8"])
def test_kernel_equals_the_torch_path(tokens, skew, expert_parallel, method):
    tp = ParallelGroup(1, 2) if expert_parallel else ParallelGroup()
    experts = random_experts(ExpertShard.of(MOE8, tp, expert_parallel))
    if method is not None:
        experts.quantize(method, ParallelGroup())
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(3))
    weights, ids = routing(tokens, 8, 2, skew)
    tensors = ExpertWeights(
        experts.gate_up_proj, experts.down_proj, experts.gate_up_scale, experts.down_scale
    )
    local = local_expert_ids(experts, ids).view(ids.shape)
    got = fused_experts(x, tensors, weights, local)
    torch.testing.assert_close(got, grouped_experts(experts, x, weights, ids))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 300])
@pytest.mark.parametrize("method", [None, "fp8"])
def test_mixtral_sizes_on_cuda(tokens, method):
    """One layer of Mixtral 8x7B's experts in bfloat16 (FP8 where the GPU reads E4M3),
    a decode and a prefill chunk, against the torch path on the same GPU."""
    moe = MoEConfig(8, 2, 14336, True, ("w1", "w3", "w2"), frozenset({0}))
    with torch.device("cuda"):
        experts = FusedExperts(4096, ExpertShard.of(moe, ParallelGroup(), False), moe.leaves)
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(0.0, param.shape[-1] ** -0.5)
    experts.to(torch.bfloat16)
    if method is not None:
        if not fp8.supports_w8a8(torch.device("cuda")):
            pytest.skip("FP8 experts need sm_89 or later")
        experts.quantize(method, ParallelGroup())
    x = torch.randn(tokens, 4096, device="cuda").to(torch.bfloat16)
    weights, ids = routing(tokens, 8, 2, skew=False)
    weights, ids = weights.cuda(), ids.cuda()
    got = experts(x, weights, ids)  # on CUDA: the Triton path
    want = grouped_experts(experts, x, weights, ids)
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
