"""Which part of the model each tensor-parallel rank holds (Megatron's split), and which
part of each checkpoint tensor it therefore reads.

- q/k/v and gate/up are column-parallel: a rank holds its attention heads' rows and its
  share of the MLP's intermediate rows. KV heads are split the same way; where there
  are fewer KV heads than ranks, each rank holds the one its query heads use (ranks
  r * kv // size share head r * kv // size), so KV heads are replicated, not cut.
- o and down are row-parallel: a rank holds the input columns of its heads or its
  intermediate share, and the partial sums are added by one all-reduce; their bias is
  added once, on rank 0.
- The embedding and the LM head are split over the vocabulary, padded to a multiple
  of the ranks (the padding rows are zeros, and their logits are cut after the gather).
- Norms are replicated.
- A checkpoint tensor holding several of ours (Phi-3's qkv_proj: q, k and v rows in
  turn) is read as its parts, each cut as a tensor of its own name (FusedParts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from backend_gpu.distributed import ParallelGroup

# checkpoint module leaf -> how it is split: column (output rows) or row (input columns)
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("embed_tokens", "lm_head")
# a fused checkpoint tensor's name -> its parts (name, rows), in row order; None: unfused
FusedParts = Callable[[str], list[tuple[str, int]] | None]


def check_divisible(hf_config, size: int) -> None:
    """Raise ValueError unless the model splits evenly over `size` ranks."""
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    problems = []
    if heads % size:
        problems.append(f"its {heads} attention heads")
    if kv_heads % size and size % kv_heads:
        problems.append(f"its {kv_heads} KV heads (nor do the ranks divide among them)")
    if hf_config.intermediate_size % size:
        problems.append(f"its intermediate size {hf_config.intermediate_size}")
    if problems:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide {' or '.join(problems)}: "
            "pick a size that does"
        )


def local_heads(hf_config, size: int) -> tuple[int, int]:
    """(query heads, KV heads) a rank holds."""
    return hf_config.num_attention_heads // size, max(1, hf_config.num_key_value_heads // size)


def first_kv_head(hf_config, tp: ParallelGroup) -> int:
    kv_heads = hf_config.num_key_value_heads
    if kv_heads >= tp.size:
        return tp.rank * (kv_heads // tp.size)
    return tp.rank * kv_heads // tp.size  # replicated: the head of this rank's queries


@dataclass(frozen=True)
class VocabShard:
    start: int  # first token id of this rank's rows
    rows: int  # rows a rank holds (every rank the same, the last padded)
    vocab_size: int  # the model's vocabulary, to cut the padding from gathered logits

    @classmethod
    def of(cls, vocab_size: int, tp: ParallelGroup) -> VocabShard:
        rows = -(-vocab_size // tp.size)
        return cls(tp.rank * rows, rows, vocab_size)


@dataclass(frozen=True)
class ShardRead:
    """Read checkpoint rows or columns [start, stop) along `dim`; pad dim 0 with zero
    rows up to `rows` when set."""

    dim: int
    start: int
    stop: int
    rows: int | None = None


SKIP = ShardRead(0, 0, 0)  # a tensor this rank does not hold (a row-parallel bias off rank 0)


class CheckpointShards:
    """Maps a checkpoint tensor's name and shape to what this rank reads of it."""

    def __init__(self, hf_config, head_dim: int, tp: ParallelGroup) -> None:
        self.tp = tp
        heads, kv_heads = local_heads(hf_config, tp.size)
        self.q = (tp.rank * heads * head_dim, heads * head_dim)
        self.kv = (first_kv_head(hf_config, tp) * head_dim, kv_heads * head_dim)
        inter = hf_config.intermediate_size // tp.size
        self.mlp = (tp.rank * inter, inter)
        self.vocab = VocabShard.of(hf_config.vocab_size, tp)

    def __call__(self, name: str) -> ShardRead | None:
        """None: the whole tensor."""
        if self.tp.size == 1:
            return None
        module_path, _, param = name.rpartition(".")
        leaf = module_path.rpartition(".")[2]
        if leaf in VOCAB_PARALLEL:
            v = self.vocab
            return ShardRead(0, v.start, min(v.start + v.rows, v.vocab_size), v.rows)
        if leaf in COLUMN_PARALLEL:
            start, size = {"q_proj": self.q, "k_proj": self.kv, "v_proj": self.kv}.get(
                leaf, self.mlp
            )
            return ShardRead(0, start, start + size)
        if leaf in ROW_PARALLEL:
            if param == "bias":
                return None if self.tp.rank == 0 else SKIP
            start, size = self.q if leaf == "o_proj" else self.mlp
            return ShardRead(1, start, start + size)
        return None
