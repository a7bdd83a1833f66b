"""Offline use: a list of prompts in, their outputs out (vLLM's `LLM`), stepping one
LLMEngine in the caller's thread until all of them are done. Apart from the engine
loop (engine.py), which only admits requests and runs steps for whoever drives it
(AsyncLLM's thread behind the gateway, or this).
"""

from __future__ import annotations

from tqdm.auto import tqdm

from backend_gpu.config import EngineConfig
from backend_gpu.engine import LLMEngine
from backend_gpu.outputs import EngineStats, RequestOutput
from backend_gpu.sequence import Logprob
from engine_api.images import ImageInput
from engine_api.records import AdapterRef, GenRequest
from engine_api.sampling import SamplingParams


class LLM:
    """Offline use: a list of prompts in, their outputs out (vLLM's `LLM`)."""

    def __init__(self, model: str, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._next_id = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        adapter: AdapterRef | None = None,
        images: list[list[ImageInput]] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt, under LoRA `adapter` if given (enable_lora);
        `images`: each prompt's images, in its placeholders' order (a vision model)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        ids = []
        images = images or [[] for _ in prompts]
        try:
            for prompt, params, pictures in zip(prompts, sampling_params, images, strict=True):
                ids.append(str(self._next_id))
                self._next_id += 1
                prompt_ids = self.engine.tokenize(prompt)
                self.engine.add_request(
                    GenRequest(ids[-1], "", prompt_ids, params, adapter=adapter, images=pictures)
                )
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        prompt_logprobs: dict[str, list[Logprob | None]] = {}
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.prompt_logprobs is not None:  # the first output's: kept for the last
                        prompt_logprobs[out.request_id] = out.prompt_logprobs
                    if out.finished:
                        out.prompt_logprobs = prompt_logprobs.pop(out.request_id, None)
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[i] for i in ids]

    def stats(self) -> EngineStats:
        return self.engine.stats()
