"""The engine loop: admit requests, schedule a step, run it, sample, detokenize.

The stop checks and each step's outputs are request_outputs.py's; offline use (LLM),
llm.py's."""

from __future__ import annotations

import math
import os

import torch

from backend_gpu.block_manager import BlockManager, KVCacheEvent
from backend_gpu.config import EngineConfig
from backend_gpu.detokenizer import IncrementalDetokenizer
from backend_gpu.guided import hf_grammar_cache
from backend_gpu.kv_tiers import TierStack, build_tiers
from backend_gpu.loader import open_model
from backend_gpu.lora import BaseShapes, LoRAManager
from backend_gpu.multimodal import ImagePrompt, check_vision_settings
from backend_gpu.outputs import EngineStats, RequestOutput
from backend_gpu.prompt_logprobs import record_prompt_logprobs
from backend_gpu.request_outputs import append_tokens, eos_token_ids, request_output
from backend_gpu.sampler import Sampler
from backend_gpu.scheduler import Scheduler
from backend_gpu.sequence import Sequence, SequenceStatus
from backend_gpu.spec_decode.speculator import Speculator
from backend_gpu.tp_ranks import start_runner
from engine_api.block_hash import adapter_root, hash_blocks
from engine_api.errors import (
    AdapterLoadError,
    BadRequestError,
    LoraDisabledError,
    PromptTooLongError,
)
from engine_api.records import AdapterRef, GenRequest, Progress
from engine_api.throughput import Throughput


def _is_weight(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isfinite(value) and value > 0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        hf_config, self.tokenizer, weights = open_model(os.fspath(config.model))
        self.hf_config = hf_config
        check_vision_settings(config, hf_config)
        # before the target's runner: on CUDA a draft model sizes its KV cache first
        self.speculator = (
            Speculator(config, hf_config, weights, self.tokenizer)
            if config.speculative_config
            else None
        )
        self.runner = start_runner(config, hf_config, weights, self.tokenizer)
        if self.speculator is not None:
            self.speculator.attach(self.runner)
        self.max_model_len = config.context_len(hf_config)
        self.vocab_size = hf_config.vocab_size
        self.eos_token_ids = eos_token_ids(hf_config, self.tokenizer)
        self.kv_tiers = build_tiers(config, self.runner.attention_layers, self.max_model_len)
        if self.kv_tiers is not None:
            self.kv_tiers.stop_with(self)
        self.block_manager = BlockManager(
            self.runner.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.enable_kv_events,
            self.kv_tiers,
        )
        self.lora = (
            LoRAManager(
                BaseShapes.of(hf_config),
                config.max_loras,
                config.max_lora_rank,
                config.max_cpu_loras or 2 * config.max_loras,
                self.runner.write_lora,
            )
            if config.enable_lora
            else None
        )
        # requests whose adapter's tensors are being read: queued once they are at hand
        self.lora_waiting: list[Sequence] = []
        self.scheduler = Scheduler(config, self.block_manager, self.lora)
        self.sampler = Sampler(self.runner.device, config.seed, self.eos_token_ids)
        self.grammars = hf_grammar_cache(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.seqs: dict[str, Sequence] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.stats_ = EngineStats(
            num_blocks=self.runner.num_blocks,
            weight_bytes=self.runner.weight_bytes,
            kv_cache_bytes=self.runner.kv_cache_bytes,
        )
        self.throughput = Throughput()

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def add_request(self, req: GenRequest, progress: Progress | None = None) -> None:
        """Admit a request, or raise BadRequestError (a ValueError; PromptTooLongError for
        size) and change nothing. The first `req.shared_prefix_len` prompt tokens are a
        published prefix: their blocks are cached without `req.cache_salt`, shared with
        every other salt. `req.tenant_id` and its `weight` decide its fair share
        (config.fairness). `progress` hears, after each step that computes some of the
        prompt, how much of it is computed."""
        request_id, params, prompt_ids = req.request_id, req.sampling, req.prompt_token_ids
        if request_id in self.seqs:
            raise BadRequestError(f"request id {request_id!r} is already in use")
        params.validate()
        if not _is_weight(req.weight):
            raise BadRequestError(f"weight must be a finite number > 0, got {req.weight!r}")
        if not prompt_ids:
            raise BadRequestError("prompt is empty")
        params.check_vocab(self.vocab_size)
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise BadRequestError(
                f"prompt has token ids outside the vocabulary [0, {self.vocab_size})"
            )
        if not 0 <= req.shared_prefix_len <= len(prompt_ids):
            raise BadRequestError(
                f"shared_prefix_len must be in [0, {len(prompt_ids)}], got {req.shared_prefix_len}"
            )
        # the pool holds one max_model_len sequence (ModelRunner checks), so any request
        # within max_model_len fits it alone
        if len(prompt_ids) >= self.max_model_len:
            raise PromptTooLongError(len(prompt_ids), params.max_tokens, self.max_model_len)
        if req.adapter is not None:
            self.check_adapter(req.adapter)
        images = self.image_prompt(req)
        # compiled (or found compiled) before the request takes anything
        grammar = self.grammars.matcher(params.structured) if params.structured else None
        seq = Sequence(req)
        seq.images = images
        seq.grammar = grammar
        seq.progress = progress
        self.seqs[request_id] = seq
        self.detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer, prompt_ids, params.stop, params.skip_special_tokens
        )
        if (
            self.lora is not None
            and req.adapter is not None
            and not self.lora.ready(req.adapter.name)
        ):
            self.lora.start_loading(req.adapter)
            self.lora_waiting.append(seq)
        else:
            self.scheduler.add(seq)
        if self.kv_tiers is not None and req.sampling.prompt_logprobs is None:
            keys = self.prompt_keys(req, images)
            on_device = self.block_manager.cached
            first_miss = next((i for i, k in enumerate(keys) if k not in on_device), len(keys))
            self.kv_tiers.prefetch(keys[first_miss:])

    def image_prompt(self, req: GenRequest) -> ImagePrompt | None:
        """Where `req`'s images lie in its prompt (None: a text prompt), or a
        BadRequestError: a model that takes no images, placeholders that do not fit."""
        vision = self.runner.vision
        if vision is None:
            if req.images:
                raise BadRequestError(f"model {self.config.model} does not take images")
            return None
        placeholder = self.hf_config.image_token_id
        if not req.images and placeholder not in req.prompt_token_ids:
            return None
        return vision.layout(req.prompt_token_ids, req.images, placeholder)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; unknown ids are ignored."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        if seq in self.lora_waiting:
            self._finish_unqueued(seq, "abort")
        else:
            self.scheduler.finish(seq, "abort")
        return self._output(seq, [])

    # -- LoRA adapters (backend_gpu.lora) -------------------------------------------------

    def check_adapter(self, ref: AdapterRef) -> None:
        """Accept adapter `ref` (its files fit the base model) or raise BadRequestError
        naming the problem; reads files only, so any thread may call it."""
        if self.lora is None:
            raise LoraDisabledError(
                f"adapter {ref.name!r}: this engine was started without enable_lora"
            )
        self.lora.check(ref)

    def remove_adapter(self, name: str) -> None:
        """Forget adapter `name`; running requests under it finish first."""
        if self.lora is not None:
            self.lora.remove(name)

    def _queue_loaded(self) -> list[RequestOutput]:
        """Queue the requests whose adapter's tensors are now at hand; a failed read
        ends the requests waiting for it with its error (AdapterLoadError)."""
        if self.lora is None or not (self.lora_waiting or self.lora.loading):
            return []
        queued = [*self.lora_waiting, *self.scheduler.waiting]
        wanted = {seq.adapter.name for seq in queued if seq.adapter is not None}
        failed = {name: e for name, e in self.lora.poll(wanted).items() if e is not None}
        outputs = []
        for seq in queued:
            if seq.adapter is not None and seq.adapter.name in failed:
                if seq in self.lora_waiting:
                    self._finish_unqueued(seq, "abort")
                else:
                    self.scheduler.finish(seq, "abort")
                out = self._output(seq, [])
                out.error = AdapterLoadError(seq.adapter.name, str(failed[seq.adapter.name]))
                outputs.append(out)
        for seq in list(self.lora_waiting):
            name = seq.adapter.name
            if self.lora.ready(name):
                self.lora_waiting.remove(seq)
                self.scheduler.add(seq)
            else:  # removed meanwhile: read again
                self.lora.start_loading(seq.adapter)
        return outputs

    def _finish_unqueued(self, seq: Sequence, reason: str) -> None:
        self.lora_waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def take_kv_events(self) -> list[KVCacheEvent]:
        """Prefix-cache blocks stored and removed since the last call (needs
        enable_kv_events; else always empty)."""
        events = self.block_manager.take_events()
        if self.kv_tiers is not None:
            events += self.kv_tiers.take_events()
        return events

    # -- prefill on one engine, decode on another (kv_transfer) ---------------------------

    def prompt_keys(self, req: GenRequest, images: ImagePrompt | None = None) -> list[bytes]:
        """The keys of the blocks admitting `req` would look up: its prompt's full
        blocks, leaving one token to compute, under its salt (and its images' digests:
        `images`, where admission computed them already)."""
        n = (len(req.prompt_token_ids) - 1) // self.config.block_size * self.config.block_size
        images = images or self.image_prompt(req)
        return hash_blocks(
            req.prompt_token_ids[:n],
            self.config.block_size,
            req.cache_salt,
            req.shared_prefix_len,
            adapter_root(req.adapter),
            extra_keys=images.key_spans if images is not None else None,
        )

    def export_kv(self, keys: list[bytes]) -> list[bytes]:
        """Stored records (engine_api.kv_records) of `keys` from the first on, as far as
        this engine holds them, for another engine's import_kv."""
        tiers = self._transfer_tiers()
        cached = self.block_manager.cached

        def device_block(key: bytes) -> int | None:
            block = cached.get(key)
            return None if block is None else block.block_id

        return tiers.export(keys, device_block)

    def import_kv(self, keys: list[bytes], records: list[bytes]) -> int:
        """Take another engine's records of `keys` (its export_kv's), so that the request
        admitted next with that prompt loads them instead of computing them; how many
        leading blocks were taken. They are not that request's cached tokens."""
        return self._transfer_tiers().import_records(keys, records)

    def _transfer_tiers(self) -> TierStack:
        if self.kv_tiers is None:
            raise BadRequestError("this engine was started without kv_transfer")
        return self.kv_tiers

    def close(self) -> None:
        """Write what the tiers have queued, then stop the model's ranks."""
        if self.kv_tiers is not None:
            self.kv_tiers.close()
        if self.lora is not None:
            self.lora.close()
        self.runner.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.lora_waiting)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.sampler, self.max_model_len)
        outputs = self._queue_loaded()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            if self.lora is not None and self.lora.loading:  # nothing to run but reads
                self.lora.wait(0.05)
            return outputs
        step = self.runner.run(batch)
        if self.speculator is not None:
            self.speculator.observe(batch)
        logits, sampled = step.logits, step.sampled
        if step.prompt_logprobs is not None:
            record_prompt_logprobs(batch.seqs, step.prompt_logprobs)
        prompt_tokens = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            # proposed tokens count as computed only once accepted, below
            computed = n - len(seq.spec_token_ids)
            # positions past the prompt hold output tokens, fed back in or recomputed
            prompt = max(0, min(computed, seq.num_prompt_tokens - seq.num_computed_tokens))
            prompt_tokens += prompt
            seq.num_computed_tokens += computed
            if prompt and seq.progress is not None:  # a prefill chunk, never a decode
                done = min(seq.num_computed_tokens, seq.num_prompt_tokens)
                seq.progress.advance(done, seq.num_cached_tokens)
        self._record_step(batch.num_tokens)
        sampled_seqs = [batch.seqs[i] for i in sampled]
        new_tokens = self._sample(logits, sampled_seqs) if sampled_seqs else []
        for seq in batch.seqs:
            self.block_manager.cache_full_blocks(seq)
        generated = 0
        for seq, tokens in zip(sampled_seqs, new_tokens, strict=True):
            seq.spec_token_ids = []
            emitted, reason = self._append(seq, tokens)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            outputs.append(self._output(seq, emitted))
            generated += len(emitted)
        self.stats_.num_generated_tokens_total += generated
        self.throughput.record(prompt_tokens, generated)
        return outputs

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[list[int]]:
        """The tokens each sampled sequence emits: one, or with speculation its accepted
        proposals and one more."""
        if self.speculator is None:
            return [[token] for token in self.sampler(logits, seqs)]
        return self.speculator.sample(logits, seqs, self.sampler)

    def _append(self, seq: Sequence, tokens: list[int]) -> tuple[list[int], str | None]:
        """append_tokens' (those appended and the finish reason); accepted proposals'
        KV counts as computed and their full blocks are cached."""
        emitted, reason = append_tokens(
            seq, tokens, self.detokenizers[seq.request_id], self.eos_token_ids, self.max_model_len
        )
        if len(emitted) > 1:  # accepted proposals: their KV was computed while verifying
            seq.num_computed_tokens = min(seq.num_computed_tokens + len(emitted) - 1, len(seq) - 1)
            self.block_manager.cache_full_blocks(seq)
        return emitted, reason

    def _output(self, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        out = request_output(seq, self.detokenizers[seq.request_id], new_tokens)
        if seq.is_finished:
            del self.seqs[seq.request_id]
            del self.detokenizers[seq.request_id]
            self.sampler.forget(seq.request_id)
            if self.speculator is not None:
                self.speculator.forget(seq.request_id)
        return out

    def _record_step(self, num_tokens: int) -> None:
        s = self.stats_
        s.num_steps += 1
        s.num_batched_tokens_total += num_tokens
        used = self.block_manager.num_used_blocks
        if used > s.peak_blocks_used:
            s.peak_blocks_used = used
            held = sum(seq.num_computed_tokens for seq in self.scheduler.running)
            s.peak_tokens_in_blocks = min(held, used * self.config.block_size)

    def stats(self) -> EngineStats:
        s = self.stats_
        bm = self.block_manager
        s.running = len(self.scheduler.running)
        s.waiting = len(self.scheduler.waiting)
        s.num_free_blocks = bm.num_free_blocks
        s.kv_usage = bm.num_used_blocks / bm.num_blocks
        s.prefix_queries, s.prefix_hits = bm.prefix_queries, bm.prefix_hits
        s.preemptions = self.scheduler.num_preemptions
        if self.kv_tiers is not None:
            for name, value in self.kv_tiers.stats().items():
                setattr(s, name, value)
        if self.speculator is not None:
            sp = self.speculator
            s.num_drafts, s.num_draft_tokens = sp.num_drafts, sp.num_draft_tokens
            s.num_accepted_tokens = sp.num_accepted_tokens
        s.prompt_tokens_per_s, s.gen_tokens_per_s = self.throughput.rates()
        if self.lora is not None:
            s.adapters_loaded, s.lora_loads = self.lora.resident(), self.lora.loads
        if self.runner.vision is not None:
            cache = self.runner.vision.cache
            s.encoder_cache_hits, s.encoder_cache_misses = cache.hits, cache.misses
        s.waiting += len(self.lora_waiting)
        s.tenants = self.scheduler.tenant_stats()  # a new dict: the copy below shares it
        return EngineStats(**vars(s))
