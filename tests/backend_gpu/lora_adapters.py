"""Random LoRA adapters made with PEFT itself on the tiny models, and PEFT's greedy
outputs under them: the reference the engine's adapters are held to."""

from __future__ import annotations

import os

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM


def save_random_adapter(
    model_dir: str,
    directory: str,
    *,
    r: int = 8,
    alpha: float = 16,
    targets: list[str] | str = "all-linear",
    rslora: bool = False,
    seed: int = 1,
    b_std: float = 0.2,
    **extra,
) -> str:
    """A PEFT LoRA adapter of the model in `model_dir` with random A and B (PEFT starts
    B at zero, which would make the adapter a no-op), saved to `directory`."""
    if os.path.exists(os.path.join(directory, "adapter_config.json")):
        return directory
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, **extra)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=b_std)
    peft_model.save_pretrained(directory)
    return directory


def peft_greedy(
    model_dir: str, adapter_dir: str | None, prompts: list[list[int]], max_new_tokens: int
) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt: (generated ids, per-step logits) from transformers with the adapter
    applied by PEFT (not merged), or from the base model without one."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                input_ids=torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
                eos_token_id=None,
            )
            ids = out.sequences[0, len(prompt) :].tolist()
            results.append((ids, torch.cat(out.logits).float()))
    return results
