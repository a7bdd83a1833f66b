"""Greedy reference outputs from transformers, the token-for-token comparison, the
teacher-forced agreement of two engines, and the per-architecture checks the model
families' test modules share (a greedy checker, an engine per architecture, a sparse
block's router seen from transformers)."""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Callable, Iterator
from unittest import mock

import gguf
import numpy as np
import torch
from transformers import AutoModelForCausalLM

from backend_gpu import LLM
from engine_api.sampling import SamplingParams

# Two tokens whose logits are this close may swap places under a different (but
# equally valid) floating-point summation order; vLLM's tests accept that too.
NEAR_TIE = 1e-4
ARRAY = gguf.GGUFValueType.ARRAY


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int, **load_kwargs):
    """Per prompt: (generated ids, per-step logits [steps, V])."""
    read_once = one_gguf_read() if "gguf_file" in load_kwargs else contextlib.nullcontext()
    with read_once:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **load_kwargs)
    model.eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens, like ignore_eos
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            ids = out.sequences[0, len(prompt) :].tolist()
            results.append((ids, torch.cat(out.logits).float()))
    return results


@contextlib.contextmanager
def one_gguf_read() -> Iterator[None]:
    """transformers opens a GGUF file twice for one model (its config, then its tensors),
    each time a gguf.GGUFReader that parses every metadata field in Python: about 10 s of
    CPU each for Gemma 3's 262k-token vocabulary. Here both get the same reader of the
    file, which transformers only reads, and that reader takes the vocabulary's arrays in
    one pass (ArraysAtOnce); what transformers builds from it is unchanged."""
    readers = {}

    def shared(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = ArraysAtOnce(path, *args, **kwargs)
        return readers[key]

    with mock.patch.object(gguf, "GGUFReader", shared):
        yield


class ArraysAtOnce(gguf.GGUFReader):
    """gguf.GGUFReader, but an array of numbers or strings (a vocabulary's tokens, scores
    and types: 262k each for Gemma 3) is read in one pass over the file's bytes, where
    gguf reads each element through a memmap slice of its own (about 2 million in all,
    most of the reader's 10 CPU-s). The fields are the same: the same parts (each a
    plain array over the same bytes, not a memmap), data indices and types
    (tests/backend_gpu/test_gguf_reader.py compares them); anything else is gguf's."""

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple:
        if raw_type != ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        itype, count, start = gguf.GGUFValueType(raw_itype[0]), int(alen[0]), orig_offs + 12
        scalar = self.gguf_scalar_to_np.get(itype)
        if count == 0 or (scalar is None and itype != gguf.GGUFValueType.STRING):
            return super()._get_field_parts(orig_offs, raw_type)  # empty or nested
        data = self.data.view(np.ndarray)
        parts: list = [raw_itype, alen]
        if scalar is not None:
            size = np.dtype(scalar).itemsize
            values = data[start : start + size * count].view(scalar)
            parts += [values[i : i + 1] for i in range(count)]
            return 12 + size * count, parts, list(range(2, 2 + count)), [ARRAY, itype]
        offs, indices = start, []
        for _ in range(count):
            (length,) = struct.unpack_from("=Q", data, offs)  # the host's order, as "I" says
            parts += [data[offs : offs + 8].view(np.uint64), data[offs + 8 : offs + 8 + length]]
            indices.append(len(parts) - 1)
            offs += 8 + length
        return offs - orig_offs, parts, indices, [ARRAY, itype]


def assert_greedy_matches(ours: list[int], ref_ids: list[int], ref_logits: torch.Tensor) -> None:
    """Equal token for token, except that at the first difference our token may be the
    reference's second choice within NEAR_TIE (after that the two runs diverge)."""
    assert len(ours) == len(ref_ids), (ours, ref_ids)
    for step, (a, b) in enumerate(zip(ours, ref_ids, strict=True)):
        if a == b:
            continue
        top2 = ref_logits[step].topk(2)
        second, gap = top2.indices[1].item(), (top2.values[0] - top2.values[1]).item()
        assert a == second and gap <= NEAR_TIE, (
            f"step {step}: ours {a}, reference {b} (2nd choice {second}, gap {gap:.2e})\n"
            f"ours {ours}\nref  {ref_ids}"
        )
        return


def forced_agreement(llm, prompts: list, refs: list) -> float:
    """Share of the reference's tokens that `llm` picks greedily after the prompt and
    the reference's tokens before it."""
    prefixes = [
        p + r.token_ids[:i]
        for p, r in zip(prompts, refs, strict=True)
        for i in range(len(r.token_ids))
    ]
    want = [t for r in refs for t in r.token_ids]
    params = SamplingParams(temperature=0, max_tokens=1)
    got = [o.token_ids[0] for o in llm.generate(prefixes, params)]
    return sum(a == b for a, b in zip(got, want, strict=True)) / len(want)


def greedy_checker(
    model_dir: Callable[[str], str], prompts: list[list[int]], params: SamplingParams
) -> Callable:
    """check(llm, arch): the engine's greedy outputs over `prompts` equal transformers'
    (its reference computed once per arch); returns the engine's outputs."""
    refs: dict[str, list] = {}

    def check(llm, arch: str) -> list:
        if arch not in refs:
            refs[arch] = hf_greedy(model_dir(arch), prompts, params.max_tokens)
        outs = llm.generate(prompts, params)
        for out, (ref_ids, ref_logits) in zip(outs, refs[arch], strict=True):
            assert_greedy_matches(out.token_ids, ref_ids, ref_logits)
        return outs

    return check


def chunked_engines(model_dir: Callable[[str], str]) -> Callable:
    """get(arch): one engine per architecture, made on first use, whose small chunks
    prefill the prompts in pieces."""
    made: dict[str, LLM] = {}

    def get(arch: str) -> LLM:
        if arch not in made:
            made[arch] = LLM(model_dir(arch), max_num_batched_tokens=24)
        return made[arch]

    return get


def hf_sparse_blocks(
    model_dir: str, prompt: list[int], router: str = "gate", **load_kwargs
) -> list[dict]:
    """Per sparse layer of transformers' model over `prompt` (a layer whose mlp has a
    `router`, the router's attribute name: Mixtral's and DeepSeek's `gate`, gpt-oss's
    `router`): the block's input `x`, the router's output under `router`'s name and the
    block's output `out`."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **load_kwargs)
    model.eval()
    seen: list[dict] = []
    hooks = []
    for layer in model.model.layers:
        block = layer.mlp
        if not hasattr(block, router):
            continue
        record: dict = {}
        seen.append(record)
        hooks.append(block.register_forward_pre_hook(lambda m, a, r=record: r.update(x=a[0])))
        hooks.append(block.register_forward_hook(lambda m, a, out, r=record: r.update(out=out)))
        hooks.append(
            getattr(block, router).register_forward_hook(
                lambda m, a, out, r=record: r.update({router: out})
            )
        )
    with torch.inference_mode():
        model(torch.tensor([prompt]))
    for hook in hooks:
        hook.remove()
    return seen
