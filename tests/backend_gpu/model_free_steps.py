"""Drive the scheduler and block manager without a model: every scheduled token is
"computed" and every sequence that reaches its end gets token 7 as its next output."""

from __future__ import annotations

from backend_gpu.block_manager import BlockManager
from backend_gpu.scheduler import ScheduledBatch, Scheduler
from backend_gpu.sequence import Sequence


def advance(sched: Scheduler, bm: BlockManager, batch: ScheduledBatch, live: list[Sequence]):
    """Apply one step's results; sequences that reach max_tokens finish and leave `live`."""
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        seq.num_computed_tokens += n
        bm.cache_full_blocks(seq)
        if seq.num_computed_tokens == len(seq):
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, "length")
                live.remove(seq)
