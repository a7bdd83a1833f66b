"""How fast one sequence decodes beside the cells other sequences left, by KV layout.

    python -m studies.llama_kv_streams [--fill 900] [--threads 1]

llama.cpp's context is either unified (one cell pool for all sequences; kvgate's local
backend uses it so that `llama_memory_seq_cp` hands one sequence's cached prefix to
another by tagging cells) or split into one stream per sequence (llama-server's default).
In a unified pool a decode attends over the span of every cell in use; `swa_full` keeps
every cell of the sliding-window layers too. Seven sequences are filled with `--fill`
tokens (finished requests' cells, kept for reuse), then an eighth decodes 64 tokens
alone; each layout twice, the better rate kept. The default GGUF (Gemma 3 270M).

Then, with one stream per sequence (9, as the gateway's local backend has: 8 and a spare
seat), a step of 8 decodes whose sequence ids run without a gap against one with a gap:
llama.cpp puts only sequences of consecutive streams in one pass, so a gap costs a second
pass (why backend_local/slots.py keeps the busy ids contiguous).
"""

from __future__ import annotations

import argparse
import statistics
import time

import llama_cpp

from backend_local.model import LlamaModel
from bench.options import DefaultsHelpFormatter
from gateway.backends.default_model import default_model_path

N_PARALLEL, CTX_PER_SEQ, N_BATCH, DECODE = 8, 1024, 512, 64
GAP_SEQS = 9


class Context:
    """One llama context of a given layout, and a batch to decode into it."""

    def __init__(
        self, model: LlamaModel, unified: bool, swa_full: bool, threads: int, seqs: int = N_PARALLEL
    ) -> None:
        p = llama_cpp.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = CTX_PER_SEQ * seqs, N_BATCH, N_BATCH, seqs
        p.n_threads = p.n_threads_batch = threads
        p.kv_unified, p.swa_full = unified, swa_full
        p.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(model.ptr, p)
        self.batch = llama_cpp.llama_batch_init(N_BATCH, 0, 1)

    def decode(self, tokens: list[int], start: int, seq: int) -> None:
        b = self.batch
        for off in range(0, len(tokens), N_BATCH):
            chunk = tokens[off : off + N_BATCH]
            for i, token in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i] = token, start + off + i, 1
                b.seq_id[i][0] = seq
                b.logits[i] = off + i == len(tokens) - 1
            b.n_tokens = len(chunk)
            if llama_cpp.llama_decode(self.ctx, b) != 0:
                raise RuntimeError("llama_decode failed")

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)


def lone_decode_rate(model: LlamaModel, unified: bool, swa_full: bool, args) -> float:
    ctx = Context(model, unified, swa_full, args.threads)
    try:
        text = "The quick brown fox jumps over the lazy dog. " * 400
        filler = model.tokenize(text)[: args.fill]
        for seq in range(1, N_PARALLEL):
            if filler:
                ctx.decode(filler, 0, seq)
        prompt = model.tokenize("Once upon a time, in a land far away, there lived")
        ctx.decode(prompt, 0, 0)
        start = time.perf_counter()
        for i in range(DECODE):
            ctx.decode([prompt[-1]], len(prompt) + i, 0)
        return DECODE / (time.perf_counter() - start)
    finally:
        ctx.close()


def gap_step_ms(model: LlamaModel, seqs: list[int], args) -> float:
    """Median ms of a step decoding one token of each of `seqs`, one stream per sequence."""
    ctx = Context(model, unified=False, swa_full=True, threads=args.threads, seqs=GAP_SEQS)
    try:
        prompt = model.tokenize("The quick brown fox jumps over the lazy dog. " * 8)[:64]
        for seq in seqs:
            ctx.decode(prompt, 0, seq)
        times = []
        for i in range(16):
            b = ctx.batch
            for j, seq in enumerate(seqs):
                b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = prompt[-1], 64 + i, 1, True
                b.seq_id[j][0] = seq
            b.n_tokens = len(seqs)
            start = time.perf_counter()
            if llama_cpp.llama_decode(ctx.ctx, b) != 0:
                raise RuntimeError("llama_decode failed")
            times.append(time.perf_counter() - start)
        return 1000 * statistics.median(times)
    finally:
        ctx.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--fill", type=int, default=900, help="cells in each other sequence")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    model = LlamaModel(str(default_model_path()))
    for unified, swa_full in ((True, True), (True, False), (False, True), (False, False)):
        rate = max(lone_decode_rate(model, unified, swa_full, args) for _ in range(2))
        print(f"unified={unified!s:5} swa_full={swa_full!s:5} {rate:6.1f} tok/s", flush=True)
    for label, seqs in (("ids 0-7", list(range(8))), ("ids 0-6 and 8", [*range(7), 8])):
        print(f"8 decodes, {label}: {gap_step_ms(model, seqs, args):6.1f} ms a step", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
