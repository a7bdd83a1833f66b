"""The engine's memory arithmetic, in one place: what the weights and a KV block cost,
what budget a device leaves the KV cache, and how many blocks that budget holds.

The engine's memory profile (kv_budget.py) sizes its cache with these functions from
what it measures (the weights it loaded, the device's free memory, one profiling
forward); `kvgate plan` calls the same functions with what it computes from a model's
config alone (memory_plan.py), so a plan can only differ from the engine in its
inputs, never in its sums.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from backend_gpu.expert_shards import MoEConfig
from backend_gpu.models.llama import head_dim_of
from backend_gpu.tp_shards import local_heads

GIB = 1 << 30
MIB = 1 << 20
# the CPU's default KV budget: a tenth of the free RAM, at most this much
CPU_KV_BUDGET_CAP = 2 * GIB


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters, a tied one counted once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


@dataclass(frozen=True)
class KVShape:
    """What one token costs in one rank's KV cache: a key and a value row in every
    attention layer (every layer holds a sequence in full, sliding-window ones too), or
    multi-head latent attention's one row (the latent and the rotary key, which all
    heads share, whole on every rank)."""

    num_layers: int
    kv_heads: int  # on one rank
    head_dim: int
    itemsize: int  # bytes of one cached value: the KV cache dtype's
    tensors: int = 2  # K and V; 1: MLA's latent row is keys and values both

    @property
    def bytes_per_token(self) -> int:
        return self.tensors * self.num_layers * self.kv_heads * self.head_dim * self.itemsize

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token * block_size


@dataclass(frozen=True)
class KVCacheSize:
    budget: int  # bytes the cache may take
    bytes_per_block: int
    num_blocks: int
    blocks_per_seq: int  # one sequence of max_model_len tokens

    @property
    def cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def device_kv_budget(
    total: int, utilization: float, in_use: int, activations: int, graph_pool: int
) -> int:
    """The KV cache's share of a GPU: `utilization` of its memory less what is in use
    once the weights are loaded (the weights, the CUDA context, other processes), the
    activations' peak of a step and the CUDA graphs' memory pool."""
    return int(total * utilization) - in_use - activations - graph_pool


def cpu_kv_budget(free_ram: int) -> int:
    """The CPU's default KV budget: a share of the free RAM, which the OS, the weights'
    pages and the rest of the process share."""
    return min(CPU_KV_BUDGET_CAP, free_ram // 10)


def kv_cache_size(
    shape: KVShape,
    block_size: int,
    budget: int,
    max_model_len: int,
    cap_seqs: int | None = None,
) -> KVCacheSize:
    """Blocks of `block_size` tokens that `budget` bytes hold. `cap_seqs`: hold no more
    than that many sequences of max_model_len tokens (the CPU's default budget: no
    point taking RAM that no schedule can fill)."""
    per_block = shape.bytes_per_block(block_size)
    if cap_seqs is not None:
        budget = min(budget, cap_seqs * max_model_len * per_block // block_size)
    return KVCacheSize(
        budget=budget,
        bytes_per_block=per_block,
        num_blocks=max(0, budget // per_block),
        blocks_per_seq=-(-max_model_len // block_size),
    )


@dataclass(frozen=True)
class StepShape:
    """The sizes a forward step's activations scale with (one rank's)."""

    hidden_size: int
    intermediate_size: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    dtype_bytes: int


def step_activation_bytes(shape: StepShape, tokens: int, logit_rows: int) -> int:
    """An estimate of the peak bytes a step of `tokens` tokens adds over the weights:
    the residual stream and the normed input beside the larger of the attention's
    (q, k, v, its output) and the MLP's (gate and up, the activation) temporaries, and
    `logit_rows` rows of logits (in the model's dtype, in float32 and a softmax
    beside them). On CUDA the engine measures this peak instead (one profiling
    forward); the CUDA graphs' pool, captured after the cache is sized, uses this
    estimate at the largest captured batch, without logits (the LM head runs after
    the graph)."""
    attention = (shape.q_heads * 2 + shape.kv_heads * 2) * shape.head_dim
    mlp = 3 * shape.intermediate_size
    per_token = 2 * shape.hidden_size + max(attention, mlp)
    logits = logit_rows * shape.vocab_size * (shape.dtype_bytes + 8)
    return tokens * per_token * shape.dtype_bytes + logits


def encoder_batch_bytes(vision_config, patches: int, dtype_bytes: int) -> int:
    """An estimate of the peak bytes one image of `patches` patches adds through a
    vision tower (Qwen2.5-VL's): its float32 patches, the residual stream and the normed
    input beside the larger of the attention's (q, k, v, output) and the MLP's (gate and
    up, the activation) temporaries, and its merged output. The engine runs one image
    at a time, so this is the tower's whole share at the largest image it takes (the
    configured limit, not a worst case per image). On CUDA the engine measures it."""
    hidden, inter = vision_config.hidden_size, vision_config.intermediate_size
    temporal, patch = vision_config.temporal_patch_size, vision_config.patch_size
    pixels = patches * 3 * temporal * patch * patch * 4
    per_patch = 2 * hidden + max(4 * hidden, 3 * inter)
    merged = patches // vision_config.spatial_merge_size**2
    return pixels + (patches * per_patch + merged * vision_config.out_hidden_size) * dtype_bytes


def siglip_batch_bytes(vision_config, out_tokens: int, out_hidden: int, dtype_bytes: int) -> int:
    """An estimate of the peak bytes one image adds through a SigLIP tower (Gemma 3's):
    every image is one square of image_size, so this is its whole share. Its float32
    pixels, the residual stream and the normed input beside the larger of the
    attention's (q, k, v, output) and the MLP's (fc1's output, the activation)
    temporaries, and the pooled, projected soft tokens."""
    side = vision_config.image_size
    patches = (side // vision_config.patch_size) ** 2
    hidden, inter = vision_config.hidden_size, vision_config.intermediate_size
    per_patch = 2 * hidden + max(4 * hidden, 2 * inter)
    return 3 * side * side * 4 + (patches * per_patch + out_tokens * out_hidden) * dtype_bytes


def encoder_cache_bytes(tokens: int, hidden_size: int, dtype_bytes: int) -> int:
    """The encoder cache's bound in bytes: `tokens` image tokens of the model's width."""
    return tokens * hidden_size * dtype_bytes


def kv_shape_of(hf_config, tp_size: int, itemsize: int) -> KVShape:
    """The KV shape of one rank of `hf_config`'s model split over `tp_size` ranks."""
    if getattr(hf_config, "kv_lora_rank", None):  # MLA (models/deepseek_v3.py)
        row = hf_config.kv_lora_rank + hf_config.qk_rope_head_dim
        return KVShape(hf_config.num_hidden_layers, 1, row, itemsize, tensors=1)
    return KVShape(
        num_layers=hf_config.num_hidden_layers,
        kv_heads=local_heads(hf_config, tp_size)[1],
        head_dim=head_dim_of(hf_config),
        itemsize=itemsize,
    )


def full_heads_kv_bytes_per_token(hf_config, itemsize: int) -> int:
    """What caching every head's key and value would take a token, the whole model, for
    a multi-head latent attention model (its saving's measure; 0 for any other model):
    num_attention_heads keys of qk_nope + qk_rope and values of v_head_dim a layer."""
    if not getattr(hf_config, "kv_lora_rank", None):
        return 0
    key = hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim
    per_layer = hf_config.num_attention_heads * (key + hf_config.v_head_dim)
    return hf_config.num_hidden_layers * per_layer * itemsize


def step_shape_of(hf_config, tp_size: int, dtype_bytes: int) -> StepShape:
    """The activation sizes of one rank of `hf_config`'s model over `tp_size` ranks."""
    q_heads, kv_heads = local_heads(hf_config, tp_size)
    head_dim = head_dim_of(hf_config)
    if getattr(hf_config, "kv_lora_rank", None):  # MLA: each head's absorbed query and
        # output are a latent row wide, its one new row beside them (mla_attention.py)
        kv_heads, head_dim = 1, hf_config.kv_lora_rank + hf_config.qk_rope_head_dim
    inter = hf_config.intermediate_size
    if (moe := MoEConfig.of(hf_config)) is not None:
        # a token's rows through its top_k experts (layers/moe.py): k intermediates,
        # and the shared expert's beside them
        inter = max(inter, moe.top_k * moe.intermediate_size + moe.shared_intermediate)
    return StepShape(
        hidden_size=hf_config.hidden_size,
        intermediate_size=-(-inter // tp_size),
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=hf_config.vocab_size,
        dtype_bytes=dtype_bytes,
    )


def logit_rows(max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Rows of vocabulary-wide logits a step holds at once: a row per seat it samples
    (one seat beyond max_num_seqs under VTC, scheduler.py), or a slice of prompt
    logprobs; the memory profile measures this many."""
    return min(max_num_seqs + 1, max_num_batched_tokens)


def graph_batch(max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The largest decode batch the engine captures as a CUDA graph."""
    return min(max_num_seqs, max_num_batched_tokens)


def graph_pool_bytes(shape: StepShape, largest_batch: int) -> int:
    """The CUDA graphs' pool, estimated before they are captured (after the cache is
    sized): one decode step of the largest captured batch, whose memory the smaller
    graphs share; 0: no graphs (the CPU, enforce_eager)."""
    return step_activation_bytes(shape, largest_batch, logit_rows=0) if largest_batch else 0
