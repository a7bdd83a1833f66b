"""Mixture-of-experts layers: the router (top k experts per token, with the model's own
normalization) and the experts' gated MLPs stacked in two tensors, run sorted by expert.

Each token's k (token, expert) pairs are sorted by expert once, so an expert's tokens
are one contiguous run and each expert does one matmul over all of them (a dense
model's MLP does one over the whole batch). A loop over experts that finds each one's
tokens with a mask (transformers' way) pays that search, a gather and a scatter per
expert; a loop over tokens pays a matmul per token. The one place that picks the path:
on CUDA the Triton grouped GEMM (layers/triton_moe.py: one launch per matmul for all
experts, no host sync, so decodes stay in CUDA graphs); elsewhere torch: one batched
matmul over all the experts where their runs are about one size and the padding costs
less arithmetic than the calls it saves (small experts: on a CPU a matmul per expert
then costs more in calls than in arithmetic), else one matmul per expert.

Weights: gate_up_proj [experts, 2 * inter, hidden] (gate rows, then up rows) and
down_proj [experts, hidden, inter], transformers 5's layout; loaded from the
checkpoint's per-expert tensors. 8-bit weights (quantize) keep one float32 scale per
output row of each expert, as QuantizedLinear does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend_gpu.distributed import SINGLE, ParallelGroup
from backend_gpu.expert_shards import ExpertShard
from backend_gpu.quantization import QUANTIZE_PER_CHANNEL, fp8

# the most arithmetic the one-bmm path may waste on padding rows: about what the ~4 calls
# per expert it saves cost a CPU core (10 us each, 8 experts); past it, a matmul per
# expert (on Mixtral-like shapes a decode's padding alone costs more than the calls)
PADDING_FLOPS = 10_000_000


class TopKRouter(nn.Module):
    """Router logits, a softmax over all experts in float32, its top k; renormalized
    to sum to 1 where the model does (Mixtral always, Qwen3-MoE by norm_topk_prob).
    Never quantized: a rounded router picks other experts."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.top_k = top_k
        self.renormalize = renormalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 weights [T, k], expert ids [T, k])."""
        probs = F.linear(x, self.weight).float().softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


class FusedExperts(nn.Module):
    """The experts this rank holds (ExpertShard), their MLPs silu(gate(x)) * up(x) -> down.
    forward gives this rank's part of the block's output: the caller all-reduces."""

    def __init__(self, hidden_size: int, shard: ExpertShard, leaves: tuple[str, str, str]) -> None:
        super().__init__()
        self.shard = shard
        self.leaves = leaves  # the checkpoint's names of gate, up and down
        self.gate_up_proj = nn.Parameter(torch.empty(shard.count, 2 * shard.inter, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(shard.count, hidden_size, shard.inter))
        self.gate_up_scale: torch.Tensor | None = None  # [experts, 2 * inter] when 8-bit
        self.down_scale: torch.Tensor | None = None  # [experts, hidden]

    def checkpoint_names(self, prefix: str) -> list[str]:
        """The checkpoint tensors this rank's experts are loaded from."""
        first = self.shard.first
        return [
            f"{prefix}.{e}.{leaf}.weight"
            for e in range(first, first + self.shard.count)
            for leaf in self.leaves
        ]

    @torch.no_grad()
    def load_expert(self, expert: int, leaf: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor (this rank's part of it) into its expert's rows."""
        gate, up, down = self.leaves
        e, inter = expert - self.shard.first, self.shard.inter
        target = {
            gate: self.gate_up_proj.data[e, :inter],
            up: self.gate_up_proj.data[e, inter:],
            down: self.down_proj.data[e],
        }[leaf]
        if target.shape != tensor.shape:
            raise ValueError(
                f"expert {expert} {leaf}: checkpoint shape {tuple(tensor.shape)}, "
                f"model shape {tuple(target.shape)}"
            )
        target.copy_(tensor)

    def quantize(self, method: str, tp: ParallelGroup) -> None:
        """8-bit weights, a scale per output row of each expert. A cut expert's down rows
        are split over the ranks, which agree on their scales (QuantizedLinear's rule)."""
        device = self.gate_up_proj.device
        if method == "fp8" and device.type == "cuda" and not fp8.supports_w8a8(device):
            raise ValueError(
                "FP8 experts need a GPU of compute capability 8.9 or later (Ada, Hopper): "
                "the grouped GEMM reads E4M3; use quantization 'int8'"
            )
        rows_over = tp if self.shard.sliced else SINGLE
        quantize = QUANTIZE_PER_CHANNEL[method]
        for name, over in (("gate_up_proj", SINGLE), ("down_proj", rows_over)):
            weight = getattr(self, name).detach()
            q, scale = quantize(weight.reshape(-1, weight.shape[-1]), over)
            setattr(self, name, nn.Parameter(q.view(weight.shape), requires_grad=False))
            scale_name = name.replace("proj", "scale")
            setattr(self, scale_name, nn.Parameter(scale.view(weight.shape[:2]), False))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda":
            from backend_gpu.layers.triton_moe import ExpertWeights, fused_experts

            local = local_expert_ids(self, ids).view(ids.shape)
            tensors = ExpertWeights(
                self.gate_up_proj, self.down_proj, self.gate_up_scale, self.down_scale
            )
            return fused_experts(x, tensors, weights, local)
        return grouped_experts(self, x, weights, ids)


def local_expert_ids(experts: FusedExperts, ids: torch.Tensor) -> torch.Tensor:
    """Expert ids [T * k] as indices into this rank's experts; experts held elsewhere
    map to `count`, one past the last, so they sort last and compute nothing."""
    local = ids.flatten() - experts.shard.first
    held = (local >= 0) & (local < experts.shard.count)
    return torch.where(held, local, experts.shard.count)


def grouped_experts(
    experts: FusedExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The torch path: [T, H], each token's experts' outputs weighted and summed."""
    tokens, k = ids.shape
    count = experts.shard.count
    local = local_expert_ids(experts, ids)
    order = local.argsort(stable=True)
    runs = torch.bincount(local, minlength=count + 1).tolist()[:count]
    held = sum(runs)
    pairs = order[:held]  # the (token, slot) pairs on this rank's experts, by expert
    out = x.new_zeros(tokens * k, x.shape[-1])
    if held:
        out[pairs] = _expert_mlps(experts, x[pairs // k], runs, local[pairs])
    return (out.view(tokens, k, -1) * weights[..., None]).sum(dim=1).to(x.dtype)


def _widened(experts: FusedExperts, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return experts.gate_up_proj.to(dtype), experts.down_proj.to(dtype)


def _expert_mlps(
    experts: FusedExperts, rows: torch.Tensor, runs: list[int], expert_of: torch.Tensor
) -> torch.Tensor:
    """The MLP of each row's expert; rows sorted by expert, runs[e] of expert e."""
    w13, w2 = _widened(experts, rows.dtype)
    s13, s2 = experts.gate_up_scale, experts.down_scale
    width = max(runs)
    padding = width * len(runs) - len(rows)
    padding_flops = padding * 3 * 2 * w13.shape[-1] * w2.shape[-1]
    if sum(r > 0 for r in runs) > 1 and padding <= len(rows) and padding_flops <= PADDING_FLOPS:
        # one bmm over every expert, each run padded to the longest
        starts = torch.tensor([0, *runs[:-1]], device=rows.device).cumsum(0)
        slot = torch.arange(len(rows), device=rows.device) - starts[expert_of]
        padded = rows.new_zeros(len(runs), width, rows.shape[-1])
        padded[expert_of, slot] = rows
        h = torch.bmm(padded, w13.transpose(1, 2))
        if s13 is not None:
            h = h * s13[:, None, :].to(h.dtype)
        gate, up = h.chunk(2, dim=-1)
        y = torch.bmm(F.silu(gate) * up, w2.transpose(1, 2))
        if s2 is not None:
            y = y * s2[:, None, :].to(y.dtype)
        return y[expert_of, slot]
    outs, start = [], 0
    for e, run in enumerate(runs):
        if run:
            outs.append(_one_expert(rows[start : start + run], w13[e], w2[e], s13, s2, e))
            start += run
    return torch.cat(outs)


def _one_expert(rows, w13, w2, s13, s2, e: int) -> torch.Tensor:
    h = F.linear(rows, w13)
    if s13 is not None:
        h = h * s13[e].to(h.dtype)
    gate, up = h.chunk(2, dim=-1)
    y = F.linear(F.silu(gate) * up, w2)
    return y if s2 is None else y * s2[e].to(y.dtype)


def loop_over_experts(
    experts: FusedExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """transformers' way, the reference the tests and the benchmark hold the grouped
    paths to: per expert, find its tokens by a mask, gather, run, scatter back."""
    w13, w2 = _widened(experts, x.dtype)
    s13, s2 = experts.gate_up_scale, experts.down_scale
    local = local_expert_ids(experts, ids).view(ids.shape)
    out = torch.zeros_like(x)
    for e in range(experts.shard.count):
        token, slot = torch.where(local == e)
        if token.numel():
            y = _one_expert(x[token], w13[e], w2[e], s13, s2, e)
            out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
    return out
