"""gpt-oss's mixture of experts: a router with a bias that keeps each token's top k
logits and takes the softmax of those k alone, and experts whose projections have biases
and whose activation is a clamped SwiGLU, (up + 1) * gate * sigmoid(alpha * gate), gate
clamped above at `limit` and up to [-limit, limit] (transformers' GptOssExperts).

The experts' gate and up rows are interleaved as the checkpoints hold them (row 2i is
gate i, row 2i + 1 up i), in [experts, rows, inputs] order: a tensor-parallel rank's
intermediate rows are one contiguous range of them either way. Two formats:
BiasedExperts, 16-bit (8-bit after quantize, FusedExperts' rule: it is one, so the
loader, quantize_model and kvgate plan treat it as the other models' experts), and
Mxfp4Experts, the published checkpoints' MXFP4 kept packed (quantization/mxfp4.py).

Both run a step's (token, expert) pairs sorted by expert, as layers/moe.py does. The
CPU: an addmm per expert over its run (its bias the addmm's input) into one buffer of
all runs (weight @ run.T into a transposed one for stored weights, run @ weight.T for
an MXFP4 expert's matrix, widened for its one matmul: its 16-bit copy lives for that
matmul alone), the activation once over it, each pair's output weighted and added into
its token's row. float32 experts on the CPU take the engine's own kernel where it is
built (layers/cpu_kernels.py: one call for all of a projection's runs, reading each
weight once, about the memory's rate) for decode-sized runs, the addmm above for a
prefill's; else they are packed for oneDNN once loaded (layers/cpu_packed.py), whose
linear per run is faster than MKL's from memory. CUDA:
two grouped GEMM launches for all experts
(triton_moe.py's, or triton_mxfp4.py's decoding MXFP4 in registers), the biases and the
activation in torch between them, no host sync, so decodes stay in CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from backend_gpu.expert_shards import ExpertShard
from backend_gpu.layers import cpu_kernels, cpu_packed
from backend_gpu.layers.moe import FusedExperts, local_expert_ids
from backend_gpu.quantization import mxfp4

STACKED = ("gate_up_proj", "gate_up_proj", "down_proj")  # one tensor for all experts
# (e -> expert e's weight, whether it is the stored tensor rather than a fresh widening)
ExpertWeights = tuple[Callable[[int], torch.Tensor], bool]


@dataclass(frozen=True)
class ClampedSwiGLU:
    alpha: float
    limit: float

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """[..., 2I] interleaved gate/up -> [..., I]."""
        gate = h[..., ::2].clamp(max=self.limit)
        up = h[..., 1::2].clamp(min=-self.limit, max=self.limit).add_(1)
        # (up + 1) * (gate * sigmoid(gate * alpha)), the products' order aside (the same
        # values): the temporaries reused, each op a contiguous pass
        return gate.mul(self.alpha).sigmoid_().mul_(gate).mul_(up)


class GptOssRouter(nn.Module):
    """Logits with a bias, the top k of them, a softmax over those k (in float32). Its
    own parameters, not a linear layer: never quantized (a rounded router picks other
    experts)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts))
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 weights [T, k], expert ids [T, k])."""
        top, ids = F.linear(x, self.weight, self.bias).topk(self.top_k, dim=-1)
        return top.float().softmax(dim=-1), ids


class BiasedExperts(FusedExperts):
    """16-bit experts with biases; gate_up_proj [E, 2I, H] interleaved, down_proj
    [E, H, I]. `down_bias`: whether this rank adds down's bias (a rank holding a slice
    of every expert adds partial sums: rank 0 alone adds it)."""

    def __init__(
        self, hidden_size: int, shard: ExpertShard, activation: ClampedSwiGLU, down_bias: bool
    ) -> None:
        super().__init__(hidden_size, shard, STACKED)
        self.activation = activation
        self.gate_up_proj_bias = nn.Parameter(torch.empty(shard.count, 2 * shard.inter))
        self.down_proj_bias = (
            nn.Parameter(torch.empty(shard.count, hidden_size)) if down_bias else None
        )
        # "gate_up" and "down": each expert's weight in oneDNN's layout, once packed
        self.packed: dict[str, tuple[torch.Tensor, ...]] | None = None
        self.kernel = False  # the stacked weights are in the engine's CPU kernel's layout

    def pack_for_cpu(self) -> None:
        """On the CPU, float32 weights are put in the engine's kernel's layout
        (layers/cpu_kernels.py) where it is built, in place; else they are packed for
        oneDNN (layers/cpu_packed.py) in place of the stacked parameters, which become
        None: nothing reads them after loading. 8-bit weights and a dtype oneDNN does
        not compute here stay as they are."""
        pairs = ((self.gate_up_proj, self.gate_up_scale), (self.down_proj, self.down_scale))
        if all(cpu_kernels.usable(weight, scale) for weight, scale in pairs):
            with torch.no_grad():
                for name in ("gate_up_proj", "down_proj"):
                    weight = getattr(self, name)
                    weight.copy_(cpu_kernels.blocked(weight))
            self.kernel = True
            return
        if not cpu_packed.packable(self.gate_up_proj, self.gate_up_scale):
            return
        self.packed = {
            which: cpu_packed.pack(getattr(self, f"{which}_proj")) for which in ("gate_up", "down")
        }
        self.gate_up_proj = self.down_proj = None

    def checkpoint_names(self, prefix: str) -> list[str]:
        """Stacked: one tensor per projection (and bias) for all of this rank's experts."""
        return [f"{prefix}.{name}" for name, _ in self.named_parameters()]

    def expert_weights(self, which: str, dtype: torch.dtype) -> ExpertWeights:
        """(e -> expert e's `which` ("gate_up" or "down") in `dtype`, 8-bit widened by
        its row scales; whether those are the stored weights, not fresh copies)."""
        weight, scale = getattr(self, f"{which}_proj"), getattr(self, f"{which}_scale")
        if self.kernel:  # the kernel's layout, as rows for the BLAS (a prefill's runs)
            return lambda e: cpu_kernels.rows_of(weight[e]).to(dtype), False
        if scale is None and weight.dtype == dtype:  # the experts' views, made at once
            return weight.unbind(0).__getitem__, True
        return lambda e: _widened(weight[e], scale, e, dtype), False

    def grouped_gemm(self, which: str, a, blocks, out, a_div: int, weights=None):
        from backend_gpu.layers.triton_moe import grouped_gemm

        weight, scale = (
            (self.gate_up_proj, self.gate_up_scale)
            if which == "gate_up"
            else (self.down_proj, self.down_scale)
        )
        return grouped_gemm(a, weight, scale, blocks, out, a_div, weights)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return expert_mlps(self, x, weights, ids)


class Mxfp4Experts(nn.Module):
    """The experts as the published checkpoints hold them: gate/up and down in MXFP4
    (blocks and scales, quantization/mxfp4.py), their biases 16-bit; `down_bias` as in
    BiasedExperts."""

    def __init__(
        self, hidden_size: int, shard: ExpertShard, activation: ClampedSwiGLU, down_bias: bool
    ) -> None:
        super().__init__()
        self.shard = shard
        self.activation = activation
        packed = {
            "gate_up_proj": mxfp4.packed_shapes(shard.count, 2 * shard.inter, hidden_size),
            "down_proj": mxfp4.packed_shapes(shard.count, hidden_size, shard.inter),
        }
        for name, (blocks, scales) in packed.items():
            self.register_parameter(f"{name}_blocks", _bytes(blocks))
            self.register_parameter(f"{name}_scales", _bytes(scales))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(shard.count, 2 * shard.inter))
        self.down_proj_bias = (
            nn.Parameter(torch.empty(shard.count, hidden_size)) if down_bias else None
        )

    def expert_weights(self, which: str, dtype: torch.dtype) -> ExpertWeights:
        """(e -> expert e's `which` ("gate_up" or "down") widened to `dtype`, False: a
        fresh copy, not a stored weight)."""
        blocks, scales = (
            getattr(self, f"{which}_proj_blocks"),
            getattr(self, f"{which}_proj_scales"),
        )
        return lambda e: mxfp4.dequantize(blocks[e], scales[e], dtype), False

    def grouped_gemm(self, which: str, a, blocks, out, a_div: int, weights=None):
        from backend_gpu.layers.triton_mxfp4 import mxfp4_grouped_gemm

        packed = getattr(self, f"{which}_proj_blocks"), getattr(self, f"{which}_proj_scales")
        return mxfp4_grouped_gemm(a, *packed, blocks, out, a_div, weights)

    @torch.no_grad()
    def fill_dummy(self, generator: torch.Generator) -> None:
        """Random codes under scales of about 2^-7 (values of about the 0.02 the loader's
        dummy weights have), for load_format "dummy"."""
        for name, param in self.named_parameters():
            if name.endswith("_blocks"):
                param.random_(0, 256, generator=generator)
            elif name.endswith("_scales"):
                param.random_(118, 122, generator=generator)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return expert_mlps(self, x, weights, ids)


def _widened(weight: torch.Tensor, scale, e: int, dtype: torch.dtype) -> torch.Tensor:
    w = weight.to(dtype)
    return w if scale is None else w * scale[e, :, None].to(dtype)


def _bytes(shape: tuple[int, ...]) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)


Experts = BiasedExperts | Mxfp4Experts


def expert_mlps(experts: Experts, x: torch.Tensor, weights, ids: torch.Tensor) -> torch.Tensor:
    """[T, H]: each token's experts' outputs weighted and summed (this rank's part)."""
    if x.device.type == "cuda":
        return grouped_kernels(experts, x, weights, ids)
    return per_expert(experts, x, weights, ids)


@torch.no_grad()  # inference only: the products are written into buffers (out=)
def per_expert(experts: Experts, x: torch.Tensor, weights, ids: torch.Tensor) -> torch.Tensor:
    """The torch path: the pairs sorted by expert, one addmm per expert over its run
    (its bias the addmm's input: an expert no token chose is never read, nor widened),
    each into one buffer of all the runs, so the activation is one op over every pair;
    each pair's output scaled by its routing weight and added into its token's row
    (index_add_, in expert order as transformers' eager experts add them); an MXFP4
    expert's two matrices are never widened at once."""
    tokens, k = ids.shape
    count = experts.shard.count
    local = local_expert_ids(experts, ids).flatten()
    order = local.argsort(stable=True)
    runs = torch.bincount(local, minlength=count + 1).tolist()[:count]
    held = sum(runs)
    out = torch.zeros(tokens, x.shape[-1], dtype=torch.float32, device=x.device)
    if held:
        pairs = order[:held]  # the pairs on this rank's experts, by expert
        rows = pairs // k
        h = _runs(experts, "gate_up", x.index_select(0, rows), runs)
        # the activation over [pairs, 2I] (a view of h's columns); down's runs want its
        # rows contiguous (_runs)
        act = experts.activation(h.t()).contiguous()
        y = _runs(experts, "down", act, runs).t()
        out.index_add_(0, rows, y.float().mul_(weights.flatten()[pairs, None]))
    return out.to(x.dtype)


def _runs(experts: Experts, which: str, rows: torch.Tensor, runs: list[int]) -> torch.Tensor:
    """[out, rows], transposed: each run of `rows` ([rows, in], contiguous) times its
    expert's `which` weight plus its bias, in the form that suits where the weight comes
    from. A stored weight, read from memory (a decode step reads every expert's): weight
    @ run.T into the run's columns, which streams it once (the BLAS call's small side is
    the run), 0.6-0.7x the time of run @ weight.T at 2 to 5 rows, about 0.9x at 6 to 8,
    the same from 16 (PERF.md "gpt-oss decode: the weights from memory"). A weight
    widened for this one matmul (MXFP4, 8-bit) is in the cache already: run @ weight.T
    into the run's rows, about 0.93x the other form's time on such a step's 4 layers.
    Weights packed for oneDNN (BiasedExperts.pack_for_cpu): its linear per run, into the
    run's rows (layers/cpu_packed.py)."""
    biases = getattr(experts, f"{which}_proj_bias")
    if isinstance(experts, BiasedExperts) and experts.kernel and max(runs) <= cpu_kernels.MAX_ROWS:
        return cpu_kernels.expert_runs(rows, runs, getattr(experts, f"{which}_proj"), biases).t()
    if isinstance(experts, Mxfp4Experts) and max(runs) <= cpu_kernels.MAX_ROWS:
        packed = (getattr(experts, f"{which}_proj_{part}") for part in ("blocks", "scales"))
        out = cpu_kernels.mxfp4_runs(rows, runs, *packed, biases)
        if out is not None:
            return out.t()
    if isinstance(experts, BiasedExperts) and experts.packed is not None:
        return cpu_packed.packed_runs(experts.packed[which], biases, rows, runs).t()
    weights, stored = experts.expert_weights(which, rows.dtype)
    if biases is not None:  # views made at once; a stored weight's a column [out, 1]
        biases = (biases.unsqueeze(-1) if stored else biases).unbind(0)
    out, start = None, 0
    for e, run in enumerate(runs):
        if not run:
            continue
        weight = weights(e)
        if out is None:
            size = (weight.shape[0], rows.shape[0])
            out = rows.new_empty(size if stored else size[::-1])
        part = rows[start : start + run]
        if stored:
            part, into = part.t(), out[:, start : start + run]
            operands = weight, part
        else:
            into, operands = out[start : start + run], (part, weight.t())
        if biases is None:
            torch.mm(*operands, out=into)
        else:
            torch.addmm(biases[e], *operands, out=into)
        start += run
    return out if stored else out.t()


def grouped_kernels(experts: Experts, x: torch.Tensor, weights, ids: torch.Tensor):
    """The CUDA path (also run on CPU tensors in Triton's interpreter by the tests): the
    grouped GEMMs, each pair's gate/up bias added to its rows and down's scaled by the
    pair's routing weight, as the kernel scales down's product."""
    from backend_gpu.layers.triton_moe import align_by_expert, block_m_for

    tokens, k = ids.shape
    count = experts.shard.count
    local = local_expert_ids(experts, ids)
    blocks = align_by_expert(local, count, block_m_for(local.numel(), count))
    # a zero bias row for pairs held elsewhere (local == count)
    gate_up_bias = F.pad(experts.gate_up_proj_bias, (0, 0, 0, 1))
    h = torch.empty(tokens * k, gate_up_bias.shape[1], dtype=x.dtype, device=x.device)
    experts.grouped_gemm("gate_up", x, blocks, h, a_div=k)
    act = experts.activation(h + gate_up_bias[local])
    pair_weights = weights.flatten().float()
    out = torch.zeros(tokens * k, x.shape[-1], dtype=torch.float32, device=x.device)
    experts.grouped_gemm("down", act, blocks, out, 1, pair_weights)
    if experts.down_proj_bias is not None:
        down_bias = F.pad(experts.down_proj_bias, (0, 0, 0, 1))[local].float()
        out += pair_weights[:, None] * down_bias
    return out.view(tokens, k, -1).sum(dim=1).to(x.dtype)
