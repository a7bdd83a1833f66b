"""What the engine hands back: per-request outputs and engine-wide stats."""

from __future__ import annotations

from dataclasses import dataclass, field

from backend_gpu.fairness import TenantStats
from backend_gpu.sequence import Logprob
from engine_api.errors import AdapterLoadError


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all generated so far
    text: str  # all generated so far (stop strings excluded)
    new_token_ids: list[int]  # since the previous output of this request
    text_delta: str
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token or string that ended it
    num_cached_tokens: int = 0
    logprobs: list[Logprob] = field(default_factory=list)  # one per token in token_ids
    # SamplingParams.prompt_logprobs, on the request's first output only (and on the
    # results of LLM.generate): one per prompt token, None for the first
    prompt_logprobs: list[Logprob | None] | None = None
    # a request that could not run (finish_reason "abort"): its adapter would not load
    error: AdapterLoadError | None = None
    # of the prompt's tokens, how many are images' placeholders (Usage.image_tokens)
    num_image_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    # a vision model's encoder cache (backend_gpu.encoder_cache): images found, encoded
    encoder_cache_hits: int = 0
    encoder_cache_misses: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    num_steps: int = 0
    num_batched_tokens_total: int = 0
    num_generated_tokens_total: int = 0
    peak_blocks_used: int = 0
    peak_tokens_in_blocks: int = 0
    weight_bytes: int = 0
    kv_cache_bytes: int = 0
    # the host tier under the KV cache (kv_offload_gb): prompt tokens loaded back from
    # it at admission, blocks and bytes it holds, blocks written down and loaded back
    kv_host_hits: int = 0
    kv_host_blocks: int = 0
    kv_host_bytes: int = 0
    kv_host_blocks_written: int = 0
    kv_host_blocks_loaded: int = 0
    # blocks read ahead from the disk or the shared store while their request waited
    kv_prefetched_blocks: int = 0
    # the disk tier (kv_disk_path), as the host's; rejected: blocks not written (full,
    # too large) or not used (fingerprint or checksum mismatch); write_errors: failed writes
    kv_disk_hits: int = 0
    kv_disk_blocks: int = 0
    kv_disk_bytes: int = 0
    kv_disk_blocks_written: int = 0
    kv_disk_rejected: int = 0
    kv_disk_write_errors: int = 0
    # the shared store (kv_shared_url): prompt tokens loaded from it, blocks written to
    # it, blocks rejected as the disk's, failed calls to the store (it is down)
    kv_shared_hits: int = 0
    kv_shared_blocks_written: int = 0
    kv_shared_rejected: int = 0
    kv_shared_errors: int = 0
    # blocks between engines (kv_transfer, prefill apart from decode): prompt tokens
    # loaded that another engine computed, blocks sent and taken, records refused
    kv_transfer_hits: int = 0
    kv_transfer_blocks_out: int = 0
    kv_transfer_blocks_in: int = 0
    kv_transfer_rejected: int = 0
    # speculative decoding: acceptance rate = accepted / draft tokens; tokens per
    # verifying step = 1 + accepted / drafts
    num_drafts: int = 0  # decodes that carried proposed tokens
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # over the last RATE_WINDOW_S seconds (engine_api.throughput), counted per step
    prompt_tokens_per_s: float = 0.0
    gen_tokens_per_s: float = 0.0
    # LoRA (enable_lora): adapters resident on the device, and loads onto it so far
    adapters_loaded: list[str] = field(default_factory=list)
    lora_loads: int = 0
    # fair share: per tenant id (the offline API's requests are tenant "")
    tenants: dict[str, TenantStats] = field(default_factory=dict)
