"""Per-layer scales of the FP8 KV cache, from one forward of a fixed text at load.

The model reads a built-in text (prose and a little code) with its keys and values
cached in the model's dtype on scratch rows; each attention layer's largest |K| and |V|
as cached (after k-norm and rotary) set its scales, and the FP8 cache then holds
x / scale. vLLM takes the same amax from the first request; a fixed text gives the same
scales at every load, whichever request comes first. Under tensor parallelism each rank
caches only its KV heads; the ranks take the maximum over all of them, so a layer's
scales are the same as on one device.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
from torch import nn

from backend_gpu.distributed import SINGLE, ParallelGroup
from backend_gpu.layers.attention import AttentionMetadata, PrefillSpan

log = logging.getLogger(__name__)

# vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT: the text's largest key lands at 200 and
# its largest value at 100 of E4M3's 448, headroom (2.2x, 4.5x) for requests that run
# larger than the text before the cache saturates
K_HEADROOM = 200.0
V_HEADROOM = 100.0

CALIBRATION_TEXT = """\
The old lighthouse stood at the end of a narrow spit of land, where the road gave up \
and the gulls took over. For more than a hundred years its keepers had climbed the \
spiral stairs each evening to light the lamp, wind the clockwork and write a line in \
the log: the wind, the sea, the ships that passed. Most entries were short. "Calm. Two \
fishing boats, one freighter heading north." Some were not. In the winter of 1911 the \
keeper wrote four pages about a storm that tore the roof from the boat shed and left \
the village without bread for a week.

Today the lamp is automatic and the keeper's house is a small museum. Visitors read \
the logs behind glass, look at the brass lens, and ask the same questions: how heavy \
was the oil, how often did the glass need cleaning, did anyone ever fall asleep on \
duty? The guide, a retired teacher named Margaret, answers them patiently. She likes \
to point out that the keepers were, above all, careful record-keepers, and that their \
notes are still used by scientists who study how the coastline and the weather have \
changed.

Q: What is the difference between a list and a tuple in Python?
A: A list can be changed after it is created; a tuple cannot. Use a tuple for a fixed \
record, such as a point (x, y), and a list for a collection that grows.

def moving_average(values: list[float], window: int) -> list[float]:
    \"\"\"The mean of each run of `window` consecutive values.\"\"\"
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    averages = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        averages.append(total / window)
    return averages

print(moving_average([3.0, 1.5, 4.0, 1.0, 5.5, 9.0, 2.5], 3))

In short: measure twice, cut once, and write down what you did, so that whoever comes \
next knows why.
"""


def calibration_token_ids(tokenizer, max_len: int) -> list[int]:
    """The calibration text in the model's tokens (with its BOS, as prompts have),
    cut to the positions the model has."""
    return tokenizer.encode(CALIBRATION_TEXT)[:max_len]


def _scale(amax: float, headroom: float, name: str) -> float:
    if not math.isfinite(amax):
        raise ValueError(f"FP8 KV cache calibration: {name} has non-finite values")
    return max(amax, 1e-12) / headroom  # an all-zero layer still gets a usable scale


@torch.inference_mode()
def calibrate_kv_scales(
    model: nn.Module,
    attention_layers: Sequence[nn.Module],
    token_ids: list[int],
    cache_row: tuple[int, int],
    dtype: torch.dtype,
    device: torch.device,
    tp: ParallelGroup = SINGLE,
) -> None:
    """Set each attention layer's k_scale and v_scale from one forward of `token_ids`
    with K and V cached in `dtype` on scratch rows of shape `cache_row` (KV heads, head
    dim). The layers' caches are left empty: run before the real cache is allocated.
    Every tensor-parallel rank runs it together (the forward has collectives)."""
    num_tokens = len(token_ids)
    positions = torch.arange(num_tokens, device=device)
    # one prefill from position 0: it attends to its own keys and gathers nothing
    empty = torch.empty(0, dtype=dtype, device=device)
    meta = AttentionMetadata(
        slot_mapping=positions,
        block_size=num_tokens,
        k_workspace=empty,
        v_workspace=empty,
        prefills=[PrefillSpan(0, num_tokens, 0, torch.zeros(1, dtype=torch.long, device=device))],
    )
    for attn in attention_layers:
        attn.k_scale = attn.v_scale = 1.0
        attn.k_cache = torch.zeros((num_tokens, *cache_row), dtype=dtype, device=device)
        attn.v_cache = torch.zeros_like(attn.k_cache)
    model(torch.tensor(token_ids, device=device), positions, meta)
    amax = torch.stack(
        [torch.stack([a.k_cache.abs().max(), a.v_cache.abs().max()]) for a in attention_layers]
    )
    amax = tp.max_over_ranks(amax.float().cpu()).tolist()
    for i, (attn, (k_amax, v_amax)) in enumerate(zip(attention_layers, amax, strict=True)):
        attn.k_scale = _scale(k_amax, K_HEADROOM, f"layer {i} keys")
        attn.v_scale = _scale(v_amax, V_HEADROOM, f"layer {i} values")
        attn.k_cache = attn.v_cache = empty
    k_scales = [attn.k_scale for attn in attention_layers]
    v_scales = [attn.v_scale for attn in attention_layers]
    log.info(
        "FP8 KV cache scales from %d calibration tokens over %d layers: k %.3g..%.3g, v %.3g..%.3g",
        num_tokens,
        len(attention_layers),
        min(k_scales),
        max(k_scales),
        min(v_scales),
        max(v_scales),
    )
