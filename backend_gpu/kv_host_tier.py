"""A host-memory tier under the device KV pool: cached blocks the device evicts are
written down here instead of being lost, and a prefix lookup that misses on the device
but hits here loads the block back instead of recomputing it.

Slots are keyed by the block's salted chain hash (engine_api.block_hash), the same key
the device pool uses, so tenant isolation holds here exactly as there: a block computed
under tenant A's salt sits under a hash that tenant B's prompt never produces. A hash
fixes the block's contents (its whole prefix and salt), so the tier needs no other
check within one engine, and eviction is plain LRU over hashes: the least recently
written down goes first. The tier is exclusive: a block loaded back leaves it (it is on
the device again, and is written down again if evicted there), so its slot serves
another block.

On CUDA the slots are pinned and the write-down runs on a side stream: it waits for the
work already queued (which computed the block), and the compute stream waits for its
event before anything later (the step that overwrites the block) runs. Loads are
queued on the compute stream, so the step that reads the block comes after them. On
the CPU both copies are plain synchronous copies.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

GIB = 1 << 30


class HostTier:
    """`capacity_bytes` of host slots, each one block of every layer's K and V."""

    def __init__(self, attention_layers: list, block_size: int, capacity_bytes: int) -> None:
        # the layers' caches are read at each copy: [slots * block_size, heads, head_dim]
        self.layers = attention_layers
        self.block_size = block_size
        k = attention_layers[0].k_cache
        self.device = k.device
        self.bytes_per_block = 2 * len(attention_layers) * k[:block_size].nbytes
        self.num_slots = capacity_bytes // self.bytes_per_block
        if self.num_slots < 1:
            raise ValueError(
                f"kv_offload_gb holds {capacity_bytes} bytes, less than one KV block "
                f"({self.bytes_per_block} bytes)"
            )
        pin = self.device.type == "cuda"
        shape = (self.num_slots * block_size, *k.shape[1:])
        self.host = [
            (
                torch.empty(shape, dtype=k.dtype, pin_memory=pin),
                torch.empty(shape, dtype=k.dtype, pin_memory=pin),
            )
            for _ in attention_layers
        ]
        self.stream = torch.cuda.Stream(self.device) if pin else None
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, oldest first
        self.free_slots = list(range(self.num_slots))
        self.blocks_written = 0
        self.blocks_loaded = 0

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.slots

    @property
    def blocks_held(self) -> int:
        return len(self.slots)

    def write_down(self, block_id: int, block_hash: bytes) -> None:
        """Copy device block `block_id` (about to be overwritten) into a slot, evicting
        the least recently written block when full. Dropped when every slot is taken
        by a load in progress."""
        if block_hash in self.slots:  # same hash, same contents: just fresher
            self.slots.move_to_end(block_hash)
            return
        if self.free_slots:
            slot = self.free_slots.pop()
        elif self.slots:
            slot = self.slots.popitem(last=False)[1]
        else:
            return
        self._copy(slot, block_id, down=True)
        self.slots[block_hash] = slot
        self.blocks_written += 1

    def take(self, hashes: list[bytes]) -> list[int]:
        """Detach the slots of `hashes` (all held) so that writes cannot evict them
        before `load` reads them."""
        return [self.slots.pop(block_hash) for block_hash in hashes]

    def load(self, slot: int, block_id: int) -> None:
        """Copy a taken slot up into device block `block_id` and free the slot."""
        self._copy(slot, block_id, down=False)
        self.free_slots.append(slot)
        self.blocks_loaded += 1

    def _copy(self, slot: int, block_id: int, down: bool) -> None:
        bs = self.block_size
        host_rows = slice(slot * bs, (slot + 1) * bs)
        device_rows = slice(block_id * bs, (block_id + 1) * bs)
        pairs = []  # (source, destination)
        for attn, (host_k, host_v) in zip(self.layers, self.host, strict=True):
            for host, device in ((host_k, attn.k_cache), (host_v, attn.v_cache)):
                ends = (device[device_rows], host[host_rows])
                pairs.append(ends if down else ends[::-1])
        if self.stream is None or not down:
            # the CPU: in order by construction; CUDA loads: queued on the compute
            # stream, before the step that reads the block
            for src, dst in pairs:
                dst.copy_(src, non_blocking=self.stream is not None)
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # the block is computed; earlier loads read their slot
        with torch.cuda.stream(self.stream):
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
        written = torch.cuda.Event()
        written.record(self.stream)
        compute.wait_event(written)  # the overwrite, and any load of this slot, after it
