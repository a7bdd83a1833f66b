"""An EAGLE-3 head proposes the next k tokens as a chain, from the target's own hidden
states: the target's step keeps three layers' inputs (aux_states.py), the head reads
them with the next token's embedding.

The head's position t reads token t + 1 and the target's hidden states at t, so the
head keeps a shadow sequence per request whose tokens are the request's shifted by one,
with its own block table in its own block pool: the head runs whole beside rank 0 under
tensor parallelism while the target's cache is cut by heads, and its chain writes k - 1
positions past the slots the target holds for the request. Its pool is one layer's KV.

Before a proposal the shadow is cut back to the positions computed from the target's
verified hidden states (the chain's later positions read the head's own output) and
catches up on the rest in the first of its k passes. A position whose target hidden
states were never computed (a prefix-cache hit, a restart after the head's pool ran
out) reads zeros: the head's guesses there are worse, the output is the same.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import AutoConfig

from backend_gpu.block_manager import BlockManager
from backend_gpu.config import EngineConfig
from backend_gpu.loader import Checkpoint
from backend_gpu.model_runner import ModelRunner
from backend_gpu.sampler import Sampler
from backend_gpu.scheduler import ScheduledBatch
from backend_gpu.sequence import Sequence
from backend_gpu.spec_decode.aux_states import AuxStates
from backend_gpu.spec_decode.draft import DRAFT_MEMORY_SHARE, sample_draft
from backend_gpu.spec_decode.eagle3_config import Eagle3Layout
from backend_gpu.spec_decode.eagle3_head import Eagle3Head, HeadCheckpoint
from engine_api.records import GenRequest


@dataclasses.dataclass
class HeadState:
    shadow: Sequence | None = None
    verified: int = 0  # shadow positions computed from the target's hidden states
    pending: list[tuple[int, torch.Tensor]] = dataclasses.field(default_factory=list)


class Eagle3Proposer:
    def __init__(self, config: EngineConfig, target_config, target: Checkpoint, tokenizer) -> None:
        spec = config.speculative_config
        assert spec is not None and spec.model is not None
        layout = Eagle3Layout.read(spec.model, target_config)
        head_config = AutoConfig.from_pretrained(spec.model)
        # the head's rope table covers the target's context
        head_config.max_position_embeddings = max(
            head_config.max_position_embeddings, target_config.max_position_embeddings
        )
        head_engine = dataclasses.replace(
            config,
            model=spec.model,
            speculative_config=None,
            enable_prefix_caching=False,
            tensor_parallel_size=1,
            enable_lora=False,
            quantization=None,
            load_format="auto",  # a head is always read: a random one is written as such
            enforce_eager=True,  # its steps read hidden rows set beside the step buffers
            max_model_len=config.context_len(target_config),
            gpu_memory_utilization=config.gpu_memory_utilization * DRAFT_MEMORY_SHARE,
        )
        self.runner = ModelRunner(
            head_engine,
            head_config,
            HeadCheckpoint(layout, target),
            tokenizer,
            model_cls=Eagle3Head,
        )
        self.head: Eagle3Head = self.runner.model
        self.layout = layout
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, False)
        self.max_model_len = config.context_len(target_config)
        self.threshold = spec.draft_confidence_threshold or 0.0
        self.states: dict[str, HeadState] = {}
        self.aux: AuxStates | None = None  # the target runner's, once it exists

    def attach(self, aux: AuxStates | None) -> None:
        assert aux is not None, "the target runner keeps no hidden states for the head"
        self.aux = aux

    def observe(self, batch: ScheduledBatch, drafts_for) -> None:
        """After a target step: keep each draftable sequence's new rows of hidden states
        (prompt chunks, a decode, a verify's accepted and rejected positions alike)."""
        assert self.aux is not None
        rows = self.aux.rows(batch.num_tokens)
        start = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if drafts_for(seq):
                state = self.states.setdefault(seq.request_id, HeadState())
                state.pending.append((seq.num_computed_tokens, rows[start : start + n].clone()))
            start += n

    def retain(self, running: list[Sequence]) -> None:
        """Let go of requests no longer running (preempted: their shadow's blocks serve
        the others; the target recomputes their hidden states when they come back)."""
        keep = {seq.request_id for seq in running}
        for request_id in [r for r in self.states if r not in keep]:
            self.forget(request_id)

    def forget(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None and state.shadow is not None:
            self.block_manager.free(state.shadow)

    def _hidden_rows(self, state: HeadState, start: int, stop: int) -> torch.Tensor:
        """Target hidden states for positions [start, stop): the latest rows kept for
        each, zeros where none were; the kept rows are used up."""
        aux = self.aux
        rows = aux.buffer.new_zeros(stop - start, aux.width)
        for first, chunk in state.pending:
            lo, hi = max(first, start), min(first + chunk.shape[0], stop)
            if lo < hi:
                rows[lo - start : hi - start] = chunk[lo - first : hi - first]
        state.pending.clear()  # rows past stop are rejected guesses'
        return rows

    def _sync(self, seq: Sequence, state: HeadState) -> Sequence:
        """The shadow holding the request's tokens shifted by one, computed up to the
        positions its verified hidden states give."""
        shifted = seq.token_ids[1:]
        if state.shadow is None:
            state.shadow = Sequence(GenRequest(seq.request_id, "", shifted, seq.params))
            state.verified = 0
        shadow = state.shadow
        shadow.num_computed_tokens = state.verified
        del shadow.token_ids[state.verified :]
        shadow.token_ids.extend(shifted[state.verified :])
        return shadow

    def _restart(self, state: HeadState) -> None:
        if state.shadow is not None:
            self.block_manager.free(state.shadow)
        state.shadow, state.verified = None, 0

    @torch.inference_mode()
    def propose(
        self, seqs: list[Sequence], ks: list[int], sampler: Sampler
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Per sequence up to k tokens and, for sampled requests, the head's
        distributions q [len(draft), V] they were drawn from. A chain stops early once
        the head's probability of its guesses so far is under the threshold: whether a
        guess is drawn depends on the guesses before it alone, so the verifier's
        sampled output keeps the target's distribution."""
        drafts: list[list[int]] = [[] for _ in seqs]
        sure = [1.0] * len(seqs)  # the head's probability of each chain so far
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active: list[int] = []
        hidden: list[torch.Tensor] = []
        bm = self.block_manager
        for i, (seq, k) in enumerate(zip(seqs, ks, strict=True)):
            state = self.states.get(seq.request_id)
            if state is None or len(seq) + k > self.max_model_len:
                continue
            shadow = self._sync(seq, state)
            # the chain computes every position up to its last guess's input
            num_new = len(shadow) + k - 1 - shadow.num_computed_tokens
            if not bm.can_append_slots(shadow, num_new):
                self._restart(state)  # start afresh once the pool has room
                continue
            bm.append_slots(shadow, num_new)
            hidden.append(self._hidden_rows(state, shadow.num_computed_tokens, len(shadow)))
            state.verified = len(shadow)
            active.append(i)
        rows = torch.cat(hidden) if hidden else None
        while active:
            shadows = [self.states[seqs[i].request_id].shadow for i in active]
            batch = ScheduledBatch(shadows, [len(s) - s.num_computed_tokens for s in shadows])
            # the runner's rows and metadata; every shadow ends here, so each one's last
            # row is sampled: the head's output there proposes and feeds the next pass
            input_ids, positions, meta, last, _ = self.runner.prepare(batch, None, [])
            prenorm = self.head.layer_out(input_ids, positions, meta, rows)[last]
            for shadow, n in zip(shadows, batch.num_new_tokens, strict=True):
                shadow.num_computed_tokens += n
            tokens, chance, q = self._draw(prenorm, [seqs[i] for i in active], sampler)
            for row, (i, shadow) in enumerate(zip(active, shadows, strict=True)):
                shadow.token_ids.append(tokens[row])
                drafts[i].append(tokens[row])
                sure[i] *= chance[row]
                if q is not None:
                    probs[i].append(q[row])
            going = [
                row
                for row, i in enumerate(active)
                if len(drafts[i]) < ks[i] and sure[i] >= self.threshold
            ]
            active = [active[row] for row in going]
            rows = prenorm[going]
        q_out = [
            torch.stack(p) if p and not seq.params.greedy else None
            for seq, p in zip(seqs, probs, strict=True)
        ]
        return drafts, q_out

    def _draw(
        self, prenorm: torch.Tensor, seqs: list[Sequence], sampler: Sampler
    ) -> tuple[list[int], list[float], torch.Tensor | None]:
        """A pass's guesses from its last rows (before `norm`) and the head's own
        probability of each (its softmax): all greedy, the argmax over the draft
        vocabulary; else sample_draft over the target's vocabulary."""
        if all(seq.params.greedy for seq in seqs):
            return *self.head.greedy_tokens(prenorm), None
        logits = self.head.compute_logits(self.head.model.norm(prenorm)).float()
        tokens, q = sample_draft(logits, seqs, sampler)
        picked = torch.tensor(tokens, device=logits.device)[:, None]
        chance = logits.log_softmax(dim=-1).gather(-1, picked)[:, 0].exp()
        return tokens, chance.tolist(), q
