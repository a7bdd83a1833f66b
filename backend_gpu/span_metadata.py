"""The torch attention path's metadata for one step (layers/attention.py): which rows
are decodes, grouped by length into padded batches (or taken one by one on a CPU
running one thread), and which are prefill chunks, each with the blocks it reads, and
workspaces to gather those blocks into. The Triton path needs none of this: its kernels
read the block tables as they are (step_buffers.paged_metadata)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from backend_gpu.layers.attention import AttentionMetadata, DecodeGroup, DecodeSpan, PrefillSpan
from backend_gpu.rank_handoff import StepRows

# a decode joins the current group while its context is at least this share of the
# group's longest; below, padding it would cost more than one more attention call
DECODE_GROUP_FILL = 0.7
# a chunk of at most this many rows after a context (a speculative verify's k + 1) is
# attended row by row as decodes where decodes go one by one: each row then computes
# what a plain decode at its position does, bit for bit (in bfloat16 the prefill's SDPA
# rounds otherwise, and greedy speculation would part from plain decoding)
ROWS_AS_DECODES = 17


def group_decodes(decodes: list[int], ends: list[int]) -> list[list[int]]:
    """Split decodes, longest first, into groups whose padding to their longest member
    stays small; each group is one padded attention batch."""
    groups: list[list[int]] = []
    for i in sorted(decodes, key=lambda i: -ends[i]):
        if groups and ends[i] >= DECODE_GROUP_FILL * ends[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def span_metadata(
    step: StepRows,
    block_size: int,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    workspace: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    groups_on_one_thread: bool = False,
) -> AttentionMetadata:
    """The torch attention's metadata of `step`: decodes in padded groups (or one by one)
    and prefill chunks, each with its blocks (rows of the device's `block_tables`), and
    workspaces to gather them into (`workspace(num_blocks)` gives K's and V's).
    `groups_on_one_thread`: the model's attention computes a padded group with its own
    matmuls, not SDPA (attention sinks), which on one thread beats one by one."""
    bs = block_size
    device = block_tables.device
    ends = step.ends
    q_ends = list(itertools.accumulate(step.num_new))
    decodes = [i for i, n in enumerate(step.num_new) if n == 1]
    prefills = [i for i, n in enumerate(step.num_new) if n > 1]
    # one thread on a CPU: decodes one by one, measured faster there than SDPA's single
    # query (no padding, a cache-sized workspace); else padded groups, whose SDPA spreads
    # over threads. Attention with sinks takes its groups through two batched matmuls:
    # one call a layer instead of one a sequence (PERF.md "gpt-oss decode: the weights
    # from memory")
    one_by_one = device.type == "cpu" and torch.get_num_threads() == 1
    one_by_one = one_by_one and not groups_on_one_thread
    groups = [] if one_by_one else group_decodes(decodes, ends)
    gathered = [len(g) * -(-ends[g[0]] // bs) for g in groups]
    gathered += [-(-end // bs) for end in ends]
    k_ws, v_ws = workspace(max(gathered))
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        block_size=bs,
        k_workspace=k_ws,
        v_workspace=v_ws,
    )
    for group in groups:
        num_blocks = -(-ends[group[0]] // bs)
        meta.decode_groups.append(
            DecodeGroup(
                rows=torch.tensor([q_ends[i] - 1 for i in group], device=device),
                block_ids=block_tables[group, :num_blocks].flatten(),
                lens=torch.tensor([ends[i] for i in group], device=device),
                shortest=min(ends[i] for i in group),
            )
        )
    if one_by_one:
        meta.decodes = [
            DecodeSpan(q_ends[i] - 1, ends[i], block_tables[i, : -(-ends[i] // bs)])
            for i in decodes
        ]
        # rows after a context (a chunk from position 0 has nothing a decode would read),
        # none of which sees ahead (an image's rows do)
        short = [
            i
            for i in prefills
            if ends[i] > step.num_new[i] <= ROWS_AS_DECODES and step.key_last is None
        ]
        for i in short:
            n = step.num_new[i]
            blocks = block_tables[i, : -(-ends[i] // bs)]  # one tensor: one gather (attention.py)
            for j in range(n):  # row j sees the context and the chunk's rows up to it
                meta.decodes.append(DecodeSpan(q_ends[i] - n + j, ends[i] - n + j + 1, blocks))
        prefills = [i for i in prefills if i not in short]
    for i in prefills:
        n = step.num_new[i]
        meta.prefills.append(
            PrefillSpan(
                q_start=q_ends[i] - n,
                q_end=q_ends[i],
                start_pos=ends[i] - n,
                block_ids=block_tables[i, : -(-ends[i] // bs)],
            )
        )
    return meta
