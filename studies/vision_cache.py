"""Issue 52's measurement: a chat that sends the same image with every user turn, on a
random Qwen2.5-VL-shaped model, TTFT per turn with the encoder cache and prefix caching
against without either (and each alone), every arm in one run.

Turn k's prompt is the whole conversation so far: k user turns, each the image and a
question, and the k - 1 answers before them (greedy, the first arm's, so every arm
gets the very same prompt). With prefix caching a turn finds the conversation's earlier
blocks cached, images and all (keyed by the image's digest); with the encoder cache the
new turn's copy of the image is not encoded again. Without either, turn 5 encodes five
images and computes every token.

The model is built here with transformers (random weights, seeded) and saved like a hub
checkpoint: a vision tower of `--vision-depth` blocks of `--vision-hidden` (windows of
112 pixels, full attention every fourth block, as Qwen2.5-VL), a decoder of
`--layers` layers of `--hidden`, float32 on the CPU (or `--device cuda`). Requests run one at a time
through LLMEngine's step loop; TTFT is from `add_request` to the step that returns the
first token. The arms alternate within each turn, so a shared machine's noise falls on
all of them; each arm's row says whether it generated the first arm's tokens.

    .venv/bin/python -m studies.vision_cache --out docs/perf
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from backend_gpu.config import EngineConfig
from backend_gpu.engine import LLMEngine
from bench.options import DefaultsHelpFormatter
from engine_api.images import ImageInput, image_input
from engine_api.records import GenRequest
from engine_api.sampling import SamplingParams

ARMS = {
    "cached": dict(enable_prefix_caching=True, encoder_cache_tokens=16384),
    "prefix-only": dict(enable_prefix_caching=True, encoder_cache_tokens=0),
    "encoder-only": dict(enable_prefix_caching=False, encoder_cache_tokens=16384),
    "uncached": dict(enable_prefix_caching=False, encoder_cache_tokens=0),
}
WORDS = [
    "what",
    "is",
    "in",
    "this",
    "picture",
    "and",
    "where",
    "is",
    "the",
    "sun",
    "the",
    "house",
    "the",
    "hills",
]
VISION = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]


def build_model(out: Path, args: argparse.Namespace) -> Path:
    """A random Qwen2.5-VL-shaped model and a word-level tokenizer, saved in `out`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
    )

    tokens = ["<unk>", "<s>", "</s>", "user", "assistant", *VISION, *WORDS]
    tokens += [f"w{i}" for i in range(len(tokens), 1024)]
    vocab = {t: i for i, t in enumerate(tokens)}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=word_level, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    heads = args.hidden // 64
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(vocab),
            hidden_size=args.hidden,
            intermediate_size=args.hidden * 3,
            num_hidden_layers=args.layers,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2),
            max_position_embeddings=8192,
            rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]},
        ),
        vision_config=dict(
            depth=args.vision_depth,
            hidden_size=args.vision_hidden,
            intermediate_size=args.vision_hidden * 3,
            num_heads=args.vision_hidden // 64,
            out_hidden_size=args.hidden,
            window_size=112,
            fullatt_block_indexes=list(range(3, args.vision_depth, 4)),
        ),
        image_token_id=vocab["<|image_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"],
        architectures=["Qwen2_5_VLForConditionalGeneration"],
    )
    torch.manual_seed(args.seed)
    Qwen2_5_VLForConditionalGeneration(config).float().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def picture(size: int, seed: int) -> ImageInput:
    """A drawn scene (gradient sky, sun, hills, a house, noise, a blur)."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0, 1, size)[:, None, None]
    sky = (rng.uniform(60, 200, 3) * (1 - y) + rng.uniform(150, 255, 3) * y).repeat(size, 1)
    image = Image.fromarray(sky.astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    draw.ellipse((size // 8, size // 10, size // 3, size // 3), fill=(255, 220, 60))
    for i in range(3):
        base = int(size * (0.55 + 0.12 * i))
        hills = [(x, base + int(rng.normal(0, size / 20))) for x in range(0, size, 9)]
        draw.polygon([(0, size), *hills, (size, size)], fill=tuple(rng.integers(20, 140, 3)))
    draw.rectangle((size // 2, size // 2, size // 2 + size // 5, size * 3 // 4), fill=(170, 60, 40))
    noise = rng.normal(0, 12, (size, size, 3))
    pixels = np.clip(np.asarray(image, dtype=np.float64) + noise, 0, 255).astype(np.uint8)
    blurred = Image.fromarray(pixels, "RGB").filter(ImageFilter.SMOOTH)
    return image_input(size, size, blurred.tobytes())


def first_token_time(
    engine: LLMEngine,
    request_id: str,
    tokens: list[int],
    image_count: int,
    image: ImageInput,
    max_new: int,
) -> tuple[float, list[int], int]:
    """(TTFT seconds, the output tokens, its cached prompt tokens) of one request."""
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(
        GenRequest(request_id, "", tokens, params, cache_salt="t", images=[image] * image_count)
    )
    ttft = None
    while True:
        for out in engine.step():
            if ttft is None and out.new_token_ids:
                ttft = time.perf_counter() - start
            if out.finished:
                return ttft, out.token_ids, out.num_cached_tokens


def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(args.model_dir or tmp) / "vl", args)
        engines = {
            name: LLMEngine(
                EngineConfig(
                    str(model),
                    device=args.device,
                    dtype=args.dtype,
                    kv_cache_memory_bytes=args.kv_cache_mib << 20,
                    max_num_batched_tokens=4096,
                    **options,
                )
            )
            for name, options in ARMS.items()
        }
        tokenizer = engines["cached"].tokenizer
        vocab = tokenizer.get_vocab()
        processor = engines["cached"].runner.vision.processor
        image = picture(args.image_size, args.seed)
        n = processor.num_tokens(image.width, image.height)
        placeholder = [vocab[VISION[0]], *[vocab[VISION[1]]] * n, vocab[VISION[2]]]
        history: list[int] = [vocab["<s>"]]
        turns = []
        for turn in range(1, args.turns + 1):
            question = [vocab["user"], *placeholder] + tokenizer.encode(" ".join(WORDS[:8]))
            tokens = history + question + [vocab["assistant"]]
            row: dict = {"turn": turn, "prompt_tokens": len(tokens), "images": turn}
            answer = None
            order = list(ARMS)
            order = order[turn % len(order) :] + order[: turn % len(order)]
            for name in order:
                ttft, out, cached = first_token_time(
                    engines[name], f"{name}-{turn}", tokens, turn, image, args.max_new
                )
                answer = answer or out
                row[name] = {"ttft_s": round(ttft, 4), "cached_tokens": cached}
                row[name]["same_tokens"] = out == answer  # float32: always; bfloat16 may not
            row["speedup"] = round(row["uncached"]["ttft_s"] / row["cached"]["ttft_s"], 2)
            turns.append(row)
            print(json.dumps(row))
            history = tokens + answer
        encoder = {name: engines[name].stats().encoder_cache_misses for name in ARMS}
    return {
        "model": vars(args),
        "image_tokens": n,
        "turns": turns,
        "images_encoded": encoder,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    p.add_argument("--out", help="directory for vision_cache.json")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--image-size", type=int, default=448, help="a square image's side, pixels")
    p.add_argument("--hidden", type=int, default=256, help="the decoder's width")
    p.add_argument("--layers", type=int, default=4, help="the decoder's layers")
    p.add_argument("--vision-hidden", type=int, default=256, help="the tower's width")
    p.add_argument("--vision-depth", type=int, default=8, help="the tower's blocks")
    p.add_argument("--max-new", type=int, default=4, help="tokens each answer generates")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", help="where to write the model (default: a temporary one)")
    p.add_argument("--device", default="auto", help="auto: CUDA where torch sees a GPU")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-mib", type=int, default=512, help="each engine's KV cache")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run(args)
    last = result["turns"][-1]
    print(
        f"turn {last['turn']}: TTFT {last['cached']['ttft_s']:.3f} s cached against "
        f"{last['uncached']['ttft_s']:.3f} s uncached: {last['speedup']}x"
    )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, "vision_cache.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
