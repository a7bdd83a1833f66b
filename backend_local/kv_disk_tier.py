"""The disk tier under the llama.cpp engine's KV cells: a prompt's prefix, saved once
computed, so that a later request (after a restart too) starts from it instead of
computing it again (`kv_disk_path`, sized by `kv_disk_gb`).

llama.cpp has no blocks, but it saves and restores one sequence's cells
(`llama_state_seq_get_data` / `set_data`). A record is the state of a sequence holding
exactly a prompt's longest prefix of whole 16-token blocks (one token is left to
compute: its logits give the first output token), kept in engine_api.kv_disk's
DiskStore under the salted chain hash of the prefix's last block, as backend_gpu keys
its tiers. That hash fixes every token before it, the salt and the LoRA adapter (the
chain's root), so a tenant only finds its own prefixes and published ones, computed
under the same adapter.

The state is taken where the prefix ends, never cut from a longer one: llama.cpp writes
only the sliding-window layers' last window of cells, which is right for resuming at
the end and wrong anywhere before it. For the same reason a sequence restored from a
state past that window cannot be cut short later (Slot.floor).

The copy out of the context runs on the worker thread (milliseconds for a thousand
tokens); the file is written by a thread of its own. The fingerprint names what a
state's layout depends on, and the MAC (keyed by `kv_tier_secret`) that the engine
wrote it; a state llama.cpp refuses all the same is counted as rejected, not tried
again, and computed. A file is read no further than the most a state of its prefix's
length can take (`state_bytes_bound`), so a huge or endless one costs no memory.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import queue
import threading

import llama_cpp

from backend_local.config import EngineConfig
from backend_local.model import LlamaModel
from backend_local.prefix_blocks import BLOCK_SIZE
from engine_api.block_hash import adapter_root, hash_blocks
from engine_api.kv_disk import DiskStore
from engine_api.kv_records import HEADER_SIZE, RecordCodec, fingerprint
from engine_api.records import AdapterRef

GIB = 1 << 30
MIB = 1 << 20
# states copied out and not yet written; past this a save is skipped (a slow disk must
# not fill memory)
MAX_PENDING = 16
# no KV type is wider than float32; llama.cpp's framing of a state takes a few bytes a
# cell (position, sequences) and a few a layer
MAX_ELEMENT_BYTES = 4
CELL_BYTES = 64
# a recurrent or hybrid model's per-sequence state, per layer and embedding width:
# its SSM state (d_state <= 128 of 2 x n_embd float32s) and its conv state
RECURRENT_BYTES = 2048


def model_file_hash(path: str) -> str:
    """The first and the last MiB of a GGUF file: its metadata and some of its weights
    (a fine-tune keeps the metadata of its base)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(MIB))
        f.seek(max(0, os.fstat(f.fileno()).st_size - MIB))
        h.update(f.read(MIB))
    return h.hexdigest()


def state_fingerprint(model: LlamaModel, config: EngineConfig) -> bytes:
    """What a saved sequence state is valid for: the model file, the library that wrote
    it, the KV cells' types and shapes, and the context's KV stream count (the state
    names it). Not n_ctx: a state fits any stream large enough."""
    params = llama_cpp.llama_context_default_params()  # the KV types new_context keeps
    return fingerprint(
        layout="llama_state_seq",
        model=os.path.basename(model.path),
        model_size=os.path.getsize(model.path),
        model_hash=model_file_hash(model.path),
        llama_cpp=llama_cpp.__version__,
        type_k=params.type_k,
        type_v=params.type_v,
        n_layer=llama_cpp.llama_model_n_layer(model.ptr),
        n_embd=llama_cpp.llama_model_n_embd(model.ptr),
        n_head_kv=llama_cpp.llama_model_n_head_kv(model.ptr),
        n_swa=llama_cpp.llama_model_n_swa(model.ptr),
        n_streams=config.n_parallel,
        block_size=BLOCK_SIZE,
    )


def state_bytes_bound(model: LlamaModel, tokens: int) -> int:
    """The most the saved state of a `tokens`-token sequence can take: every layer's
    K and V of every cell at the widest type, as if each head were a KV head, plus
    llama.cpp's framing (and a recurrent state, for a model that has one). Only a
    bound to read up to: a state is always smaller."""
    ptr = model.ptr
    n_layer, n_embd = llama_cpp.llama_model_n_layer(ptr), llama_cpp.llama_model_n_embd(ptr)
    n_head = llama_cpp.llama_model_n_head(ptr)
    arch = model.architecture
    head_dims = [
        int(model.meta(f"{arch}.attention.{which}_length") or n_embd // max(n_head, 1))
        for which in ("key", "value")
    ]
    per_cell = n_layer * n_head * sum(head_dims) * MAX_ELEMENT_BYTES + CELL_BYTES
    recurrent = llama_cpp.llama_model_is_recurrent(ptr) or llama_cpp.llama_model_is_hybrid(ptr)
    fixed = MIB + (n_layer * n_embd * RECURRENT_BYTES if recurrent else 0)
    return HEADER_SIZE + fixed + tokens * per_cell


class DiskTier:
    """Saves and restores sequence states of one context. Called from the worker
    thread only; the writer thread only writes files."""

    def __init__(self, model: LlamaModel, config: EngineConfig, ctx: llama_cpp.llama_context_p):
        self.ctx = ctx
        self.model = model
        capacity = int(config.kv_disk_gb * GIB)
        codec = RecordCodec(state_fingerprint(model, config), config.kv_tier_secret)
        largest = state_bytes_bound(model, config.n_ctx_per_seq)
        self.store = DiskStore(config.kv_disk_path, capacity, codec, largest)
        self.hits = 0  # prompt tokens restored
        self.refused = 0  # records that passed their checks but llama.cpp would not load
        self._bad: set[bytes] = set()  # those records' keys
        # keys copied out, not yet written: the worker adds, the writer removes (a set's
        # add, discard and `in` are atomic under the GIL)
        self._pending: set[bytes] = set()
        self._queue: queue.Queue[tuple[bytes, bytearray] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer")
        self._writer.daemon = True
        self._writer.start()

    @staticmethod
    def prefix_hashes(
        prompt: list[int],
        salt: str | None,
        shared_prefix_len: int,
        adapter: AdapterRef | None = None,
    ) -> list[bytes]:
        """The chain hashes of the prompt's whole blocks that leave at least one token,
        computed under `adapter`."""
        usable = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
        root = adapter_root(adapter)
        return hash_blocks(prompt[:usable], BLOCK_SIZE, salt, shared_prefix_len, root)

    def candidates(self, hashes: list[bytes], beyond: int) -> list[tuple[int, bytes]]:
        """(length, key) of the stored prefixes longer than `beyond` tokens, longest first."""
        found = []
        for i in range(len(hashes) - 1, -1, -1):
            length = (i + 1) * BLOCK_SIZE
            if length <= beyond:
                break
            if hashes[i] in self.store and hashes[i] not in self._bad:
                found.append((length, hashes[i]))
        return found

    def restore(self, seq_id: int, candidates: list[tuple[int, bytes]]) -> int:
        """Load the first of `candidates` that loads into the (empty) sequence; its
        length, or 0 with the sequence left empty."""
        for length, key in candidates:
            # None: refused (and deleted) by its checks
            payload = self.store.get(key, state_bytes_bound(self.model, length))
            if payload is None:
                continue
            data = (ctypes.c_uint8 * len(payload)).from_buffer_copy(payload)
            if llama_cpp.llama_state_seq_set_data(self.ctx, data, len(payload), seq_id):
                self.hits += length
                return length
            # llama.cpp found it does not fit this context (and emptied the sequence)
            self.refused += 1
            self._bad.add(key)
        return 0

    def wants(self, key: bytes) -> bool:
        """Whether a state under `key` is worth copying out now."""
        return (
            self.store.writable
            and key not in self.store
            and key not in self._pending
            and key not in self._bad
            and len(self._pending) < MAX_PENDING
        )

    def save(self, seq_id: int, key: bytes) -> None:
        """Copy the sequence's state out (it must hold exactly the prefix `key` ends) and
        queue it for the writer, unless another sequence's copy of it came first."""
        if not self.wants(key):
            return
        size = llama_cpp.llama_state_seq_get_size(self.ctx, seq_id)
        data = bytearray(size)
        buf = (ctypes.c_uint8 * size).from_buffer(data)
        if size and llama_cpp.llama_state_seq_get_data(self.ctx, buf, size, seq_id) == size:
            self._pending.add(key)
            self._queue.put((key, data))

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            key, data = item
            self.store.put(key, data)
            self._pending.discard(key)

    def close(self) -> None:
        """Write what is queued, then stop the writer."""
        self._queue.put(None)
        self._writer.join()

    def stats(self) -> dict[str, int]:
        store = self.store
        return {
            "kv_disk_hits": self.hits,
            "kv_disk_blocks": len(store),  # records: one a saved prefix
            "kv_disk_bytes": store.bytes,
            "kv_disk_blocks_written": store.written,
            "kv_disk_rejected": store.rejected + self.refused,
            "kv_disk_write_errors": store.write_errors,
        }
