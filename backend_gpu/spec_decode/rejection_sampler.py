"""Checks proposed tokens against the target model's logits at every proposed position.

Greedy: a draft token stands while it is the target's argmax; the first miss is
replaced by the argmax, and when all stand the target's next argmax comes free. The
output is exactly what plain greedy decoding gives.

Sampling (Leviathan et al. 2023): draft token d drawn from q stands with probability
min(1, p(d) / q(d)); on rejection the token is drawn from norm(max(0, p - q)), and
after k acceptances a bonus token is drawn from p. Each emitted token is distributed
as p, the target's own distribution. For n-gram proposals q is a point mass on d.
"""

from __future__ import annotations

import itertools

import torch

from backend_gpu.sampler import Sampler
from backend_gpu.sequence import Sequence


def rejection_sample(
    logits: torch.Tensor,
    seqs: list[Sequence],
    drafts: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    sampler: Sampler,
) -> list[list[int]]:
    """logits [sum(len(draft) + 1), V] float32, each sequence's rows in order -> per
    sequence the tokens it emits: its accepted drafts and one more token. A draft's
    probabilities are [len(draft), V] (a draft model's q) or None (a point mass)."""
    offsets = list(itertools.accumulate((len(d) + 1 for d in drafts), initial=0))
    assert logits.shape[0] == offsets[-1]
    argmax = logits.argmax(dim=-1).tolist()
    sampled = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
    probs = None
    if sampled:
        rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in sampled])
        row_seqs = [seqs[i] for i in sampled for _ in range(len(drafts[i]) + 1)]
        probs = sampler.probs(logits[rows.to(logits.device)], row_seqs)
    out: list[list[int]] = []
    j = 0  # first row of the next sampled sequence in `probs`
    for i, (seq, draft) in enumerate(zip(seqs, drafts, strict=True)):
        if seq.params.greedy:
            out.append(accept_greedy(draft, argmax[offsets[i] : offsets[i + 1]]))
            continue
        assert probs is not None
        p = probs[j : j + len(draft) + 1]
        j += len(draft) + 1
        out.append(accept_sampled(draft, p, draft_probs[i], sampler.generator_of(seq)))
    return out


def accept_greedy(draft: list[int], target_argmax: list[int]) -> list[int]:
    assert len(target_argmax) == len(draft) + 1
    for i, token in enumerate(draft):
        if token != target_argmax[i]:
            return target_argmax[: i + 1]
    return target_argmax


def accept_sampled(
    draft: list[int], p: torch.Tensor, q: torch.Tensor | None, gen: torch.Generator
) -> list[int]:
    """p [k + 1, V] target probabilities (maybe unnormalized), q [k, V] or None."""
    k = len(draft)
    p = p / p.sum(dim=-1, keepdim=True)
    draft_t = torch.tensor(draft, device=p.device, dtype=torch.long)
    rows = torch.arange(k, device=p.device)
    p_draft = p[rows, draft_t]
    q_draft = torch.ones_like(p_draft) if q is None else q[rows, draft_t]
    uniform = torch.rand(k, generator=gen, device=p.device)
    # u < p/q, written without dividing by a q that may underflow
    accepted = (uniform * q_draft < p_draft).tolist()
    for i, ok in enumerate(accepted):
        if ok:
            continue
        if q is None:
            residual = p[i].clone()
            residual[draft[i]] = 0
        else:
            residual = (p[i] - q[i]).clamp_(min=0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: sample p itself
            residual = p[i]
        token = torch.multinomial(residual, 1, generator=gen).item()
        return draft[:i] + [int(token)]
    bonus = torch.multinomial(p[k], 1, generator=gen).item()
    return draft + [int(bonus)]
