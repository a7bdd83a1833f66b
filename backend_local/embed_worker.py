"""The embedding loop: one thread owns an embedding llama context, as Worker owns the
generating one, and turns each input into its pooled (and normalized) vector.

One input a llama_decode, as llama-server's --embedding serves one slot: llama.cpp picks
its matrix kernels by the number of tokens a decode holds, and the pooled vector of a
short input decoded beside others differs from the same input decoded alone by up to
1e-2 (measured on Gemma 3 270M, Q4_K_M). A vector must not depend on what else was in
the batch, so inputs are decoded one at a time, taken from the waiting requests in turn
(a request of 2048 inputs does not hold up a request of one for all of them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import llama_cpp
import numpy as np

from backend_local.config import EngineConfig
from backend_local.context_thread import ContextThread
from backend_local.errors import DecodeError
from backend_local.model import LlamaModel
from backend_local.stats import EngineStats
from engine_api.errors import EngineDeadError
from engine_api.records import Progress
from engine_api.throughput import Throughput

log = logging.getLogger(__name__)


@dataclass
class EmbedJob:
    """One request's inputs (checked) and the vectors made so far."""

    request_id: str
    inputs: list[list[int]]
    # hands the vectors, the exception that ended the job, or None once an abort dropped
    # it, to its caller; safe to call from the worker thread
    emit: Callable[[list[list[float]] | BaseException | None], None]
    vectors: list[list[float]] = field(default_factory=list)
    progress: Progress | None = None  # where its caller reads `pooled`
    pooled: int = 0  # tokens of the inputs embedded so far


def l2_normalized(vector: np.ndarray) -> np.ndarray:
    """llama.cpp's common_embd_normalize(…, 2): the sum in double, a zero vector kept."""
    norm = float(np.sqrt(np.sum(np.square(vector), dtype=np.float64)))
    scale = 1.0 / norm if norm > 0.0 else 0.0
    return (vector.astype(np.float64) * scale).astype(np.float32)


class EmbedWorker(ContextThread[EmbedJob]):
    label = "embedding worker"

    def __init__(self, model: LlamaModel, config: EngineConfig, pooling: str) -> None:
        super().__init__("llama-embed")
        self.model = model
        self.config = config
        self.pooling = pooling
        self.ctx = model.new_embed_context(config, pooling)
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(config.n_ctx_per_seq, 0, 1)
        self.throughput = Throughput()
        self.ledger = None  # no prefix cache: no KV events
        self._busy = False

    def stats(self) -> EngineStats:
        prompt_rate, _ = self.throughput.rates()
        with self._cond:
            jobs, busy = len(self._inbox), self._busy
        return EngineStats(
            healthy=self.alive,
            n_parallel=1,
            busy=int(busy),
            free=int(not busy),
            waiting=max(0, jobs - int(busy)),
            n_ctx=self.config.n_ctx_per_seq,
            kv_cells_busy=0,  # the cells are cleared after every input
            prompt_tokens_total=self.throughput.prompt_total,
            gen_tokens_total=0,
            prefix_query_tokens=0,
            prefix_reused_tokens=0,
            prompt_tokens_per_s=prompt_rate,
            gen_tokens_per_s=0.0,
        )

    # -- the worker thread ---------------------------------------------------------------

    def _close(self, orphans: list[EmbedJob], dead: EngineDeadError) -> None:
        for job in orphans:
            job.emit(dead)
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)

    def _step(self) -> bool:
        """Embed the next input of the job whose turn it is; False when the loop ends."""
        with self._cond:
            while not (self._inbox or self._stopping):
                self._cond.wait()
            if self._stopping and not self._drain:
                return False  # the jobs left learn that the engine is shut down
            aborts, self._aborts = self._aborts, set()
            dropped = [j for j in self._inbox if j.request_id in aborts]
            for job in dropped:
                self._inbox.remove(job)  # its caller has gone: it only waits for this
                job.emit(None)
            if not self._inbox:
                return not self._stopping
            job = self._inbox.popleft()
            self._busy = True
        try:
            done = self._embed_next(job)
        finally:
            with self._cond:
                self._busy = False
                if not done:  # its next input waits for the others' turns
                    self._inbox.append(job)
        return True

    def _embed_next(self, job: EmbedJob) -> bool:
        """Add the job's next vector; True when the job has ended (answered or failed)."""
        ids = job.inputs[len(job.vectors)]
        b = self.batch
        for i, token in enumerate(ids):
            b.token[i] = token
            b.pos[i] = i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = True  # a pooled sequence outputs every token
        b.n_tokens = len(ids)
        if self.mem:  # a model without a KV cache (an encoder) keeps nothing between inputs
            llama_cpp.llama_memory_clear(self.mem, True)
        rc = llama_cpp.llama_decode(self.ctx, b)
        pooled = llama_cpp.llama_get_embeddings_seq(self.ctx, 0) if rc == 0 else None
        if not pooled:
            n = len(ids)
            job.emit(DecodeError(f"llama.cpp could not embed an input of {n} tokens (rc {rc})"))
            return True
        vector = np.ctypeslib.as_array(pooled, shape=(self.model.n_embd,)).copy()
        if self.config.normalize:
            vector = l2_normalized(vector)
        job.vectors.append(vector.tolist())
        job.pooled += len(ids)
        if job.progress is not None:
            job.progress.advance(job.pooled)
        self.throughput.record(len(ids), 0)
        if len(job.vectors) < len(job.inputs):
            return False
        job.emit(job.vectors)
        return True
