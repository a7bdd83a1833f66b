"""A small draft model guesses the next k tokens one at a time, on its own KV cache.

The draft keeps a shadow sequence per request: the request's tokens plus its last
guesses, with its own block table in its own block pool. Before each proposal the
shadow is cut back to where it agrees with the request (the target may have rejected
guesses) and catches up on the tokens it has not seen, all in the first of its k
forward passes.
"""

from __future__ import annotations

import dataclasses

import torch

from backend_gpu.block_manager import BlockManager
from backend_gpu.config import EngineConfig
from backend_gpu.loader import open_model
from backend_gpu.model_runner import ModelRunner
from backend_gpu.sampler import Sampler
from backend_gpu.scheduler import ScheduledBatch
from backend_gpu.sequence import Sequence
from engine_api.records import GenRequest

# on CUDA the draft is built first and sizes its KV cache from this share of the
# engine's gpu_memory_utilization; the target takes the rest. The draft is small: under
# tensor parallelism it runs whole on rank 0, beside the scheduler that asks for it.
DRAFT_MEMORY_SHARE = 0.1


class DraftProposer:
    def __init__(self, config: EngineConfig, target_vocab_size: int) -> None:
        spec = config.speculative_config
        assert spec is not None and spec.model is not None
        hf_config, tokenizer, weights = open_model(spec.model)
        if hf_config.vocab_size != target_vocab_size:
            raise ValueError(
                f"draft model vocabulary ({hf_config.vocab_size}) differs from the target's "
                f"({target_vocab_size}); the draft must share the target's tokenizer"
            )
        draft_config = dataclasses.replace(
            config,
            model=spec.model,
            speculative_config=None,
            enable_prefix_caching=False,
            tensor_parallel_size=1,
            enable_lora=False,  # adapter requests are not drafted for (speculator.py)
            gpu_memory_utilization=config.gpu_memory_utilization * DRAFT_MEMORY_SHARE,
        )
        self.runner = ModelRunner(draft_config, hf_config, weights, tokenizer)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, False)
        self.max_model_len = config.context_len(hf_config)
        self.shadows: dict[str, Sequence] = {}
        self.synced: dict[str, int] = {}  # shadow tokens known to match the request's

    def forget(self, request_id: str) -> None:
        shadow = self.shadows.pop(request_id, None)
        if shadow is not None:
            self.block_manager.free(shadow)
            del self.synced[request_id]

    def _sync(self, seq: Sequence) -> Sequence:
        """The request's shadow, cut back to where its KV is still right, holding
        exactly the request's tokens."""
        shadow = self.shadows.get(seq.request_id)
        if shadow is None:
            shadow = self.shadows[seq.request_id] = Sequence(
                GenRequest(seq.request_id, "", seq.token_ids, seq.params)
            )
            self.synced[seq.request_id] = len(seq)
            return shadow
        agree = self.synced[seq.request_id]
        limit = min(shadow.num_computed_tokens, len(seq) - 1)
        while agree < limit and shadow.token_ids[agree] == seq.token_ids[agree]:
            agree += 1
        # at least one token left to compute: the pass that yields the first guess
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, agree, len(seq) - 1)
        del shadow.token_ids[agree:]
        shadow.token_ids.extend(seq.token_ids[agree:])
        self.synced[seq.request_id] = len(seq)
        return shadow

    @torch.inference_mode()
    def propose(
        self, seqs: list[Sequence], ks: list[int], sampler: Sampler
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Per sequence up to k tokens and, for sampled requests, the draft's
        distributions q [len(draft), V] they were drawn from."""
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active: list[int] = []
        bm = self.block_manager
        proposing = {seq.request_id for seq in seqs}
        for request_id in [r for r in self.shadows if r not in proposing]:
            self.forget(request_id)  # preempted or paused: its blocks serve the others
        for i, (seq, k) in enumerate(zip(seqs, ks, strict=True)):
            if len(seq) + k > self.max_model_len:
                continue
            shadow = self._sync(seq)
            # the k passes compute every token but the last guess
            num_new = len(seq) + k - 1 - shadow.num_computed_tokens
            if not bm.can_append_slots(shadow, num_new):
                self.forget(seq.request_id)  # start afresh once the pool has room
                continue
            bm.append_slots(shadow, num_new)
            active.append(i)
        while active:
            shadows = [self.shadows[seqs[i].request_id] for i in active]
            batch = ScheduledBatch(shadows, [len(s) - s.num_computed_tokens for s in shadows])
            step = self.runner.run(batch)  # a draft's batches have no prompt spans
            logits, sampled = step.logits, step.sampled
            assert len(sampled) == len(shadows)
            for shadow, n in zip(shadows, batch.num_new_tokens, strict=True):
                shadow.num_computed_tokens += n
            tokens, q = sample_draft(logits, [seqs[i] for i in active], sampler)
            for row, (i, shadow) in enumerate(zip(active, shadows, strict=True)):
                shadow.token_ids.append(tokens[row])
                drafts[i].append(tokens[row])
                if q is not None:
                    probs[i].append(q[row])
            active = [i for i in active if len(drafts[i]) < ks[i]]
        q_out = [
            torch.stack(p) if p and not seq.params.greedy else None
            for seq, p in zip(seqs, probs, strict=True)
        ]
        return drafts, q_out


def sample_draft(
    logits: torch.Tensor, seqs: list[Sequence], sampler: Sampler
) -> tuple[list[int], torch.Tensor | None]:
    """Greedy requests get the draft's argmax; sampled ones a draw from the draft's
    own distribution q under the request's settings (and its seeded generator)."""
    tokens = logits.argmax(dim=-1)
    if all(seq.params.greedy for seq in seqs):
        return tokens.tolist(), None
    q = sampler.probs(logits, seqs)
    q = q / q.sum(dim=-1, keepdim=True)
    for row, seq in enumerate(seqs):
        if not seq.params.greedy:
            gen = sampler.generator_of(seq)
            tokens[row] = torch.multinomial(q[row], 1, generator=gen)[0]
    return tokens.tolist(), q
