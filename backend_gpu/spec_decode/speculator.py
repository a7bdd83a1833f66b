"""The engine's side of speculative decoding: which running decodes get proposals, and
how their verified logits turn into tokens."""

from __future__ import annotations

import itertools

import torch

from backend_gpu.config import EngineConfig
from backend_gpu.loader import Checkpoint
from backend_gpu.sampler import Sampler
from backend_gpu.scheduler import ScheduledBatch
from backend_gpu.sequence import Sequence
from backend_gpu.spec_decode.draft import DraftProposer
from backend_gpu.spec_decode.eagle3 import Eagle3Proposer
from backend_gpu.spec_decode.ngram import NgramProposer
from backend_gpu.spec_decode.rejection_sampler import rejection_sample


def can_speculate(seq: Sequence) -> bool:
    """Penalties, a logit bias, logprobs, min_tokens and a grammar (structured output)
    change the target's distribution per position in ways the verifier does not replay
    yet: such requests decode one token a step."""
    p = seq.params
    return (
        not p.has_penalties
        and not p.logit_bias
        and p.logprobs is None
        and seq.num_output_tokens >= p.min_tokens
        and seq.grammar is None
    )


def may_speculate(seq: Sequence) -> bool:
    """can_speculate, now or once min_tokens are out: whether an EAGLE-3 head should
    keep the request's hidden states."""
    p = seq.params
    return not p.has_penalties and not p.logit_bias and p.logprobs is None and seq.grammar is None


class Speculator:
    def __init__(self, config: EngineConfig, target_config, target: Checkpoint, tokenizer) -> None:
        spec = config.speculative_config
        assert spec is not None
        self.k = spec.num_speculative_tokens
        # a draft model or a head has no adapters: its guesses for an adapter's request
        # would be the base model's, so those requests decode one token a step
        self.drafts_adapters = spec.method == "ngram"
        self.proposer: NgramProposer | DraftProposer | Eagle3Proposer
        if spec.method == "ngram":
            self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        elif spec.method == "draft":
            self.proposer = DraftProposer(config, target_config.vocab_size)
        else:
            self.proposer = Eagle3Proposer(config, target_config, target, tokenizer)
        # this step's q, a draft model's or a head's
        self.draft_probs: dict[str, torch.Tensor] = {}
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def attach(self, runner) -> None:
        """The target's runner exists: an EAGLE-3 head reads the hidden states it keeps."""
        if isinstance(self.proposer, Eagle3Proposer):
            self.proposer.attach(runner.aux_states)

    def observe(self, batch: ScheduledBatch) -> None:
        """After the target's step, before its tokens count as computed."""
        if isinstance(self.proposer, Eagle3Proposer):
            self.proposer.observe(batch, self._drafts_for)

    def _drafts_for(self, seq: Sequence) -> bool:
        return (seq.adapter is None or self.drafts_adapters) and may_speculate(seq)

    def propose(self, running: list[Sequence], sampler: Sampler, max_model_len: int) -> None:
        """Set spec_token_ids of the running decodes that may speculate."""
        if isinstance(self.proposer, Eagle3Proposer):
            self.proposer.retain(running)
        seqs: list[Sequence] = []
        ks: list[int] = []
        for seq in running:
            seq.spec_token_ids = []
            # no proposal past max_tokens or the context: those tokens would be cut anyway
            k = min(
                self.k,
                seq.params.max_tokens - seq.num_output_tokens - 1,
                max_model_len - len(seq) - 1,
            )
            if k > 0 and len(seq) - seq.num_computed_tokens == 1 and self._may_propose(seq):
                seqs.append(seq)
                ks.append(k)
        self.draft_probs.clear()
        if not seqs:
            return
        drafts, probs = self.proposer.propose(seqs, ks, sampler)
        for seq, draft, q in zip(seqs, drafts, probs, strict=True):
            seq.spec_token_ids = draft
            if q is not None:
                self.draft_probs[seq.request_id] = q

    def _may_propose(self, seq: Sequence) -> bool:
        return (seq.adapter is None or self.drafts_adapters) and can_speculate(seq)

    def sample(
        self, logits: torch.Tensor, seqs: list[Sequence], sampler: Sampler
    ) -> list[list[int]]:
        """logits: 1 + len(spec_token_ids) rows per sequence -> the tokens each emits."""
        counts = [1 + len(seq.spec_token_ids) for seq in seqs]
        starts = list(itertools.accumulate(counts, initial=0))
        plain = [i for i, seq in enumerate(seqs) if not seq.spec_token_ids]
        spec = [i for i, seq in enumerate(seqs) if seq.spec_token_ids]
        out: list[list[int]] = [[] for _ in seqs]
        if plain:
            rows = torch.tensor([starts[i] for i in plain], device=logits.device)
            tokens = sampler(logits[rows], [seqs[i] for i in plain])
            for i, token in zip(plain, tokens, strict=True):
                out[i] = [token]
        if spec:
            rows = torch.cat([torch.arange(starts[i], starts[i] + counts[i]) for i in spec])
            drafts = [seqs[i].spec_token_ids for i in spec]
            probs: list[torch.Tensor | None] = []
            for i, draft in zip(spec, drafts, strict=True):
                q = self.draft_probs.get(seqs[i].request_id)
                # the scheduler may have cut the proposal short: keep q's rows still in it
                probs.append(None if q is None else q[: len(draft)])
            spec_seqs = [seqs[i] for i in spec]
            emitted = rejection_sample(
                logits[rows.to(logits.device)], spec_seqs, drafts, probs, sampler
            )
            for i, draft, tokens in zip(spec, drafts, emitted, strict=True):
                out[i] = tokens
                self.num_drafts += 1
                self.num_draft_tokens += len(draft)
                self.num_accepted_tokens += len(tokens) - 1
        return out

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)
