"""The sampler's batched logits processors (a logit bias, repetition/presence/frequency
penalties, stop tokens blocked before min_tokens) against the plain per-row definitions
below, on random batches: equal to the last bit, whatever mix of rows asks for what."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backend_gpu.sampler import Sampler
from backend_gpu.sequence import Sequence
from engine_api.sampling import SamplingParams
from tests.requests import req

VOCAB = 50
EOS = {3, 7}


def reference(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Each row on its own, as the definitions read."""
    out = logits.clone()
    for row, seq in enumerate(seqs):
        p = seq.params
        for token, bias in p.logit_bias:
            out[row, token] += bias
        if p.repetition_penalty != 1.0:
            for token in set(seq.token_ids):
                v = out[row, token]
                out[row, token] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        outputs = seq.output_token_ids
        if outputs and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(torch.tensor(outputs), minlength=VOCAB).float()
            out[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        if seq.num_output_tokens < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else EOS)
            out[row, sorted(stops)] = float("-inf")
    return out


tokens = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
penalty = st.sampled_from([0.0, 0.0, -1.5, 0.7, 2.0])


@st.composite
def rows(draw) -> Sequence:
    params = SamplingParams(
        max_tokens=20,
        repetition_penalty=draw(st.sampled_from([1.0, 1.0, 0.5, 1.3, 2.0])),
        presence_penalty=draw(penalty),
        frequency_penalty=draw(penalty),
        min_tokens=draw(st.sampled_from([0, 0, 3, 20])),
        ignore_eos=draw(st.booleans()),
        stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=3)),
        logit_bias=draw(
            st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=4)
        ),
    )
    seq = Sequence(req(f"r{draw(st.integers())}", draw(tokens), params))
    seq.token_ids.extend(draw(st.lists(st.integers(0, VOCAB - 1), max_size=8)))  # its output
    return seq


@settings(max_examples=200, deadline=None)
@given(st.lists(rows(), min_size=1, max_size=6), st.integers(0, 2**31))
def test_batched_processors_equal_the_per_row_definitions(seqs, seed):
    logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(seed))
    sampler = Sampler(torch.device("cpu"), 0, EOS)
    got = logits.clone()
    sampler._apply_logit_bias(got, seqs)
    sampler._apply_penalties(got, seqs)
    sampler._block_stops_before_min_tokens(got, seqs)
    assert torch.equal(got, reference(logits, seqs))
