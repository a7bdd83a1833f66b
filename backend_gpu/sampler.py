"""Turns a batch of logits into next tokens, each row with its own sampling settings.

Everything that can be one tensor op over the batch is: a logit bias, penalties and
min_tokens each gather their rows' (row, token) pairs on the host and apply them with one
indexed op, touching only those pairs. The loop left runs only over rows with a seed of their own. Rows with a
structured output have the tokens their grammar forbids masked (backend_gpu.guided)
last, so that whatever is sampled, greedy or not, is allowed. A logit bias comes first,
as OpenAI's is added to the model's logits; logprobs stay the model's own.
"""

from __future__ import annotations

import torch

from backend_gpu.guided import GrammarMasks
from backend_gpu.sequence import Logprob, Sequence


class Sampler:
    def __init__(self, device: torch.device, seed: int, eos_token_ids: set[int]) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.eos_token_ids = sorted(eos_token_ids)
        self.seq_generators: dict[str, torch.Generator] = {}
        self.grammar_masks = GrammarMasks(device)

    def forget(self, request_id: str) -> None:
        self.seq_generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits [S, V] float32 -> one token per sequence; logprobs are stored on seqs.
        The tokens and the logprobs come back to the host together, in one read back."""
        raw = logits
        logits = logits.clone()
        self._apply_logit_bias(logits, seqs)
        self._apply_penalties(logits, seqs)
        self._block_stops_before_min_tokens(logits, seqs)
        self.grammar_masks.apply(logits, [s.grammar for s in seqs])
        tokens = logits.argmax(dim=-1)
        if not all(s.params.greedy for s in seqs):
            greedy = torch.tensor([s.params.greedy for s in seqs], device=self.device)
            tokens = torch.where(greedy, tokens, self._sample(logits, seqs))
        wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if not wanted:
            return read_back(tokens)[0].tolist()
        rows = torch.tensor(wanted, device=self.device)
        n = max(seqs[i].params.logprobs for i in wanted)
        host = read_back(tokens, *token_logprobs(raw[rows], tokens[rows], n))
        token_list = host[0].tolist()
        self._record_logprobs(wanted, token_list, seqs, *(t.tolist() for t in host[1:]))
        return token_list

    def _index(self, rows: list[int], ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, token ids) as index tensors on the device, in one host-to-device copy:
        each processor below touches the whole batch with one indexed op, not one per
        row (a row's few small copies and kernels add up on a GPU at 64 rows a step)."""
        index = torch.tensor([rows, ids], dtype=torch.long, device=self.device)
        return index[0], index[1]

    def _apply_logit_bias(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        rows, ids, bias = [], [], []
        for row, seq in enumerate(seqs):
            for token, value in seq.params.logit_bias:  # ids checked on admission
                rows.append(row)
                ids.append(token)
                bias.append(value)
        if rows:
            values = torch.tensor(bias, dtype=logits.dtype, device=self.device)
            logits.index_put_(self._index(rows, ids), values, accumulate=True)

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Repetition over every token so far (prompt and output), as vLLM; presence and
        frequency over the output, as OpenAI. Only the (row, token) pairs that occur are
        touched (a dense [S, V] pass costs more than they do on a CPU)."""
        rep = [(r, s.token_ids) for r, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
        if rep:
            rows, ids, _ = self._pairs(rep, logits.shape[1])
            penalty = self._per_row(seqs, "repetition_penalty")[rows]
            values = logits[rows, ids]
            logits[rows, ids] = torch.where(values > 0, values / penalty, values * penalty)
        counted = [
            (r, s.output_token_ids)
            for r, s in enumerate(seqs)
            if (s.params.presence_penalty or s.params.frequency_penalty) and s.num_output_tokens
        ]
        if counted:
            rows, ids, counts = self._pairs(counted, logits.shape[1])
            frequency = self._per_row(seqs, "frequency_penalty")[rows]
            presence = self._per_row(seqs, "presence_penalty")[rows]
            logits[rows, ids] -= frequency * counts.float() + presence * (counts > 0)

    def _pairs(
        self, tokens_by_row: list[tuple[int, list[int]]], vocab: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The distinct (row, token) pairs of these rows' tokens and how often each
        occurs, found on the host in one torch.unique and copied to the device once."""
        keys = torch.cat(
            [
                torch.tensor(t, dtype=torch.long).clamp_(max=vocab - 1) + r * vocab
                for r, t in tokens_by_row
            ]
        )
        keys, counts = (t.to(self.device) for t in torch.unique(keys, return_counts=True))
        return keys // vocab, keys % vocab, counts

    def _per_row(self, seqs: list[Sequence], name: str) -> torch.Tensor:
        """[S]: each row's value of a sampling parameter."""
        return torch.tensor([getattr(s.params, name) for s in seqs], device=self.device)

    def _block_stops_before_min_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        vocab = logits.shape[1]
        rows, ids = [], []
        for row, seq in enumerate(seqs):
            if seq.num_output_tokens >= seq.params.min_tokens:
                continue
            stops = set(seq.params.stop_token_ids)
            if not seq.params.ignore_eos:
                stops.update(self.eos_token_ids)
            for token in sorted(t for t in stops if t < vocab):
                rows.append(row)
                ids.append(token)
        if rows:
            logits[self._index(rows, ids)] = float("-inf")

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        probs = self.probs(logits, seqs)
        # Gumbel-max in its exponential form: argmax(p / E), E ~ Exp(1) per entry
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, seq in enumerate(seqs):
            if seq.params.seed is not None and not seq.params.greedy:
                noise[row].exponential_(generator=self.generator_of(seq))
        return (probs / noise).argmax(dim=-1)

    def generator_of(self, seq: Sequence) -> torch.Generator:
        """The request's own generator when it has a seed (reproducible whatever the
        batch), else the engine's."""
        if seq.params.seed is None:
            return self.generator
        gen = self.seq_generators.get(seq.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seq.params.seed)
            self.seq_generators[seq.request_id] = gen
        return gen

    def probs(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The distribution each row samples from: temperature, top-k, top-p, min-p."""
        temps = torch.tensor(
            [s.params.temperature if not s.params.greedy else 1.0 for s in seqs],
            device=self.device,
        )
        logits = logits / temps[:, None]
        if any(s.params.top_k > 0 or s.params.top_p < 1.0 for s in seqs):
            logits = self._top_k_top_p(logits, seqs)
        probs = logits.softmax(dim=-1)
        if any(s.params.min_p > 0 for s in seqs):
            min_p = torch.tensor([s.params.min_p for s in seqs], device=self.device)
            keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(keep, probs, torch.zeros_like(probs))
        return probs

    def _top_k_top_p(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        vocab = logits.shape[1]
        top_k = torch.tensor(
            [s.params.top_k if s.params.top_k > 0 else vocab for s in seqs], device=self.device
        ).clamp_(max=vocab)
        top_p = torch.tensor([s.params.top_p for s in seqs], device=self.device)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=self.device)
        drop = rank[None, :] >= top_k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # the best token is always kept
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)

    def _record_logprobs(
        self,
        wanted: list[int],
        tokens: list[int],
        seqs: list[Sequence],
        chosen: list[float],
        top_values: list[list[float]],
        top_ids: list[list[int]],
    ) -> None:
        for j, i in enumerate(wanted):
            n = seqs[i].params.logprobs
            seqs[i].logprobs.append(
                Logprob(
                    token_id=tokens[i],
                    logprob=chosen[j],
                    top=list(zip(top_ids[j][:n], top_values[j][:n], strict=True)),
                )
            )


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of float32 logits [R, V]: the log-softmax at tokens[r], and the values and
    ids of its max(1, n) best (callers cut each row to what its request asked)."""
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    top = logprobs.topk(max(1, n), dim=-1)
    return chosen, top.values, top.indices


def read_back(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors on the host, after one wait for the device: each is copied without
    blocking (into pinned memory, which torch allocates for such a copy), then the
    stream is synchronized once."""
    if all(t.device.type == "cpu" for t in tensors):
        return list(tensors)
    host = [t.to("cpu", non_blocking=True) for t in tensors]
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return host
