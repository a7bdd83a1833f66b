"""Speculative decoding: proposers (n-gram prompt lookup, a draft model, an EAGLE-3 head)
guess the next tokens, the target model checks them all in one step, the rejection
sampler keeps the target's output (greedy) or its distribution (sampling)."""

from backend_gpu.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
