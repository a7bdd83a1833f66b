"""Runs an embedding model on a batch of whole inputs: builds the model (a BERT encoder,
or a Llama-family decoder without its LM head), feeds the inputs one after another as
flat rows with each input's positions from 0, and pools each input's hidden states into
one float32 vector as the model's sentence-transformers configuration says.

There is no KV cache and no block table: an input is computed in one forward and only
its vector is kept, so the memory a step needs is its activations alone, bounded by the
engine's token budget (embed_engine.py).
"""

from __future__ import annotations

import itertools

import torch

from backend_gpu.config import EngineConfig
from backend_gpu.loader import Checkpoint, build_model
from backend_gpu.model_runner import DTYPES
from backend_gpu.models import embedding_model_class
from backend_gpu.pooling import EmbeddingSpec, pool


def check_embedding_config(config: EngineConfig) -> None:
    """ValueError for an engine option an embedding model cannot honour."""
    unsupported = {
        "tensor_parallel_size": config.tensor_parallel_size != 1,
        "pipeline_parallel_size": config.pipeline_parallel_size != 1,
        "quantization": config.quantization is not None,
        "speculative_config": config.speculative_config is not None,
        "kv_cache_dtype": config.kv_cache_dtype != "auto",
    }
    named = [name for name, is_set in unsupported.items() if is_set]
    if named:
        raise ValueError(f"an embedding model runs without {', '.join(named)}: leave it unset")


class EmbeddingRunner:
    def __init__(
        self, config: EngineConfig, hf_config, checkpoint: Checkpoint, spec: EmbeddingSpec
    ) -> None:
        check_embedding_config(config)
        self.spec = spec
        self.device = torch.device(config.device)
        self.model = build_model(
            hf_config,
            DTYPES[config.dtype],
            self.device,
            checkpoint,
            config.load_format,
            config.seed,
            cls=embedding_model_class(hf_config.model_type),
        )
        self.model.eval()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())

    @torch.inference_mode()
    def run(self, inputs: list[list[int]]) -> torch.Tensor:
        """[len(inputs), hidden] float32: each input's pooled hidden states (not yet
        normalized: that is per request, pooling.finish)."""
        lens = [len(ids) for ids in inputs]
        ids = torch.tensor(list(itertools.chain.from_iterable(inputs)), device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        hidden = self.model(ids, positions, lens)
        return pool(hidden, lens, self.spec.pooling)

    def check_alive(self) -> None:
        """Nothing to watch: an embedding model runs in this process alone."""

    def close(self) -> None:
        """Nothing to stop: no other ranks."""
