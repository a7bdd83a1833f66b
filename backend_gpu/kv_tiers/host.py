"""Host memory for KV blocks: one row of bytes per block (every layer's K then V), and
the copies between a row and a block of the device's KV cache.

A row is laid out exactly as a stored block's payload (engine_api.kv_records), so a
block goes to disk, to the shared store or to another worker as the row's bytes, and
comes back from them into a row without any reshaping. Which row holds which block,
and when a row is reused, is the tier stack's business (kv_tiers.stack).

On CUDA the rows are pinned and a copy down runs on a side stream: it waits for the
work already queued (which computed the block), and the compute stream waits for its
event before anything later (the step that overwrites the block) runs; a reader of the
row on the host (the writer thread) waits for the same event. Copies up are queued on
the compute stream, so the step that reads the block comes after them. On the CPU both
are plain synchronous copies.
"""

from __future__ import annotations

import numpy as np
import torch

GIB = 1 << 30


def layer_caches(attn) -> tuple[torch.Tensor, ...]:
    """A layer's cache tensors: K and V, or MLA's one row (its v_cache is empty)."""
    return (attn.k_cache, attn.v_cache) if attn.v_cache.numel() else (attn.k_cache,)


def block_bytes(attention_layers: list, block_size: int) -> int:
    """Bytes of one block of every layer's K and V (MLA's one row)."""
    k = attention_layers[0].k_cache
    tensors = len(layer_caches(attention_layers[0]))
    return tensors * len(attention_layers) * k[:block_size].nbytes


class HostRows:
    """`num_rows` rows of host memory, each one block of every layer's K and V."""

    def __init__(self, attention_layers: list, block_size: int, num_rows: int) -> None:
        # the layers' caches are read at each copy: [slots * block_size, heads, head_dim]
        self.layers = attention_layers
        self.block_size = block_size
        k = attention_layers[0].k_cache
        self.device = k.device
        self.row_shape = (block_size, *k.shape[1:])
        self.layer_bytes = k[:block_size].nbytes
        self.bytes_per_block = block_bytes(attention_layers, block_size)
        self.num_rows = num_rows
        pin = self.device.type == "cuda"
        self.rows = torch.empty((num_rows, self.bytes_per_block), dtype=torch.uint8, pin_memory=pin)
        self.stream = torch.cuda.Stream(self.device) if pin else None
        self.ready: dict[int, torch.cuda.Event] = {}  # row -> its copy down's event
        self.read_up: dict[int, torch.cuda.Event] = {}  # row -> its last copy up's event

    def _views(self, data: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(host view, device cache) per layer's K and V, over one block's bytes `data`."""
        out = []
        caches = [cache for attn in self.layers for cache in layer_caches(attn)]
        for n, cache in enumerate(caches):
            start = n * self.layer_bytes
            view = data[start : start + self.layer_bytes].view(cache.dtype)
            out.append((view.view(self.row_shape), cache))
        return out

    def _device_rows(self, block_id: int) -> slice:
        return slice(block_id * self.block_size, (block_id + 1) * self.block_size)

    def _copy_from_device(self, data: torch.Tensor, block_id: int) -> torch.cuda.Event | None:
        """Device block `block_id` into `data`; on CUDA the event that says it landed."""
        rows = self._device_rows(block_id)
        if self.stream is None:
            for host, cache in self._views(data):
                host.copy_(cache[rows])
            return None
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # the block is computed; earlier loads read their row
        with torch.cuda.stream(self.stream):
            for host, cache in self._views(data):
                host.copy_(cache[rows], non_blocking=True)
        written = torch.cuda.Event()
        written.record(self.stream)
        compute.wait_event(written)  # the overwrite, and any load of this row, after it
        return written

    def copy_down(self, row: int, block_id: int) -> None:
        """Device block `block_id` (about to be overwritten) into `row`."""
        event = self._copy_from_device(self.rows[row], block_id)
        if event is not None:
            self.ready[row] = event

    def snapshot(self, block_id: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A copy of device block `block_id` outside the rows, for the writer thread
        (which waits for the event, on CUDA, before reading it)."""
        buf = torch.empty(
            self.bytes_per_block, dtype=torch.uint8, pin_memory=self.stream is not None
        )
        return buf, self._copy_from_device(buf, block_id)

    def copy_up(self, row: int, block_id: int) -> None:
        """`row` into device block `block_id`, before the step that reads it."""
        rows = self._device_rows(block_id)
        for host, cache in self._views(self.rows[row]):
            cache[rows].copy_(host, non_blocking=self.stream is not None)
        if self.stream is not None:  # the host must not refill the row before this ran
            self.read_up[row] = torch.cuda.Event()
            self.read_up[row].record(torch.cuda.current_stream(self.device))

    def read(self, row: int) -> bytes:
        """The row's bytes, once its copy down has landed (any thread)."""
        event = self.ready.get(row)
        if event is not None:
            event.synchronize()
        return self.rows[row].numpy().tobytes()

    def fill(self, row: int, payload: bytes | memoryview) -> None:
        """Put a stored block's bytes into `row`."""
        self.ready.pop(row, None)
        event = self.read_up.pop(row, None)
        if event is not None:
            event.synchronize()
        self.rows[row].numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
