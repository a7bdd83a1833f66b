"""Block-wise FP8 checkpoints as DeepSeek-V3 / R1 publish them (quantization/block_fp8.py):
a tiny random DeepSeek-V3 with every decoder linear layer's weight (attention, dense
MLP, each routed and shared expert) quantized here in its tiles to float8_e4m3fn with a
float32 `weight_scale_inv` a tile, embeddings, norms and the router left as they are.
The engine's greedy output equals transformers' on the dequantized weights, on one rank,
on two (a rank's part cut after widening, inside a tile) and by expert parallel, its
weights exactly those values; `quantization="fp8"` holds it in FP8; a config field or a
tensor the engine cannot honour is refused by name. Qwen3's checkpoints in the format
load too, and Phi-3's, whose q/k/v and gate/up are fused tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from backend_gpu import LLM
from tests.backend_gpu.reference import assert_greedy_matches, hf_greedy
from tests.backend_gpu.test_deepseek_v3 import GREEDY, MAX_NEW, prompts

FP8 = torch.float8_e4m3fn
# DeepSeek publishes [128, 128]; the tiny model's matrices are under 128, so smaller
# tiles, unequal and not dividing them (48 x 64 is 3 x 3 tiles, the last ones partial)
BLOCK = [16, 24]
QUANT = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "weight_block_size": BLOCK,
    "activation_scheme": "dynamic",
}


def quantized(name: str, tensor: torch.Tensor) -> bool:
    """DeepSeek-V3's published choice: the decoder's linear layers; not the router."""
    return (
        name.startswith("model.layers.")
        and name.endswith("_proj.weight")
        and tensor.dim() == 2
        and ".mlp.gate." not in name
    )


def quantize_tiles(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(FP8 weight, float32 scale a tile, the dequantized weight), a tile's largest
    value at E4M3's 448, as DeepSeek's quantizer does."""
    rows, cols = w.shape
    tiles = (-(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
    padded = F.pad(w.float(), (0, tiles[1] * BLOCK[1] - cols, 0, tiles[0] * BLOCK[0] - rows))
    grid = padded.view(tiles[0], BLOCK[0], tiles[1], BLOCK[1])
    scale = grid.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    codes = (grid / scale[:, None, :, None]).clamp(-448, 448).to(FP8)
    widened = codes.float() * scale[:, None, :, None]
    flat = (padded.shape[0], padded.shape[1])
    fp8, dequantized = codes.view(flat)[:rows, :cols], widened.view(flat)[:rows, :cols]
    return fp8.contiguous(), scale, dequantized.contiguous()


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory) -> tuple[str, str]:
    """(the block-FP8 DeepSeek-V3, the same model's dequantized float32 one)."""
    return write_block_fp8(tiny_model_dir("deepseek_v3"), tmp_path_factory.mktemp("block-fp8"))


def write_block_fp8(model_dir: str, root: Path) -> tuple[str, str]:
    """`model_dir` quantized in tiles as published, and dequantized: (fp8, float32)."""
    source = Path(model_dir)
    fp8_dir, ref_dir = root / "fp8", root / "dequantized"
    shutil.copytree(source, fp8_dir)
    shutil.copytree(source, ref_dir)
    fp8_tensors, ref_tensors = {}, {}
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        if not quantized(name, tensor):
            fp8_tensors[name] = ref_tensors[name] = tensor
            continue
        codes, scale, widened = quantize_tiles(tensor)
        fp8_tensors[name], ref_tensors[name] = codes, widened
        fp8_tensors[name.removesuffix("weight") + "weight_scale_inv"] = scale
    save_file(fp8_tensors, str(fp8_dir / "model.safetensors"))
    save_file(ref_tensors, str(ref_dir / "model.safetensors"))
    write_quantization(fp8_dir, QUANT)
    return str(fp8_dir), str(ref_dir)


def write_quantization(directory: Path, quant: dict) -> None:
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = quant
    (directory / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def reference(checkpoints):
    return hf_greedy(checkpoints[1], prompts(), MAX_NEW)


def check(llm: LLM, reference) -> None:
    for out, (ids, logits) in zip(llm.generate(prompts(), GREEDY), reference, strict=True):
        assert_greedy_matches(out.token_ids, ids, logits)


def test_greedy_equals_transformers_on_the_dequantized_weights(
    checkpoints, reference, tiny_model_dir
):
    fp8_dir, ref_dir = checkpoints
    llm = LLM(fp8_dir, max_num_batched_tokens=24)
    check(llm, reference)
    # the engine's weights are the tiles' values exactly (an attention projection, an
    # expert), which the quantization moved off the original ones (else this would
    # pass with the scales ignored)
    ours = dict(llm.engine.runner.model.named_parameters())
    dequantized = load_file(f"{ref_dir}/model.safetensors")
    original = load_file(f"{tiny_model_dir('deepseek_v3')}/model.safetensors")
    name = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(ours[name], dequantized[name])
    assert not torch.equal(dequantized[name], original[name])
    expert = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert torch.equal(ours["model.layers.1.mlp.experts.down_proj"][3], dequantized[expert])


def test_a_qwen3_checkpoint_in_tiles_equals_transformers(tiny_model_dir, tmp_path):
    """Qwen3's FP8 releases use the same format: q/k/v and gate/up widened, then packed
    into the engine's fused layers as any checkpoint's are. Its quantization_config as
    transformers' FineGrainedFP8Config writes it (every key of its own, at defaults)."""
    from transformers import FineGrainedFP8Config

    fp8_dir, ref_dir = write_block_fp8(tiny_model_dir("qwen3"), tmp_path)
    written = json.loads(json.dumps(FineGrainedFP8Config(weight_block_size=BLOCK).to_dict()))
    assert {"dequantize", "scale_fmt", "expert_dtype", "modules_to_convert"} <= set(written)
    write_quantization(Path(fp8_dir), written)
    llm = LLM(fp8_dir, max_num_batched_tokens=24)
    check(llm, hf_greedy(ref_dir, prompts(), MAX_NEW))


def test_a_phi3_checkpoint_in_tiles_equals_transformers(tiny_model_dir, tmp_path):
    """Phi-3's fused qkv_proj and gate_up_proj, one tiling over their parts: each widened
    whole, then split into q/k/v and gate/up; on two ranks, each rank's rows of each."""
    fp8_dir, ref_dir = write_block_fp8(tiny_model_dir("phi3_window"), tmp_path)
    reference = hf_greedy(ref_dir, prompts(), MAX_NEW)
    llm = LLM(fp8_dir, max_num_batched_tokens=24)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.weight
    dequantized = load_file(f"{ref_dir}/model.safetensors")
    assert torch.equal(qkv, dequantized["model.layers.0.self_attn.qkv_proj.weight"])
    check(llm, reference)
    check(LLM(fp8_dir, tensor_parallel_size=2, max_num_batched_tokens=24), reference)


def test_heads_split_over_two_ranks_equal_transformers(checkpoints, reference):
    """Each rank widens a weight whole, then keeps its part: its heads' rows, and of
    every expert its 16 of the 32 intermediate rows and down_proj's columns, a cut
    inside a tile of 24 columns."""
    llm = LLM(checkpoints[0], tensor_parallel_size=2, max_num_batched_tokens=24)
    check(llm, reference)


def test_expert_parallel_over_two_ranks_equals_transformers(checkpoints, reference):
    """Each rank reads only its experts' weights and scales (the others' neither)."""
    llm = LLM(
        checkpoints[0],
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        max_num_batched_tokens=24,
    )
    check(llm, reference)


def test_held_in_fp8_with_quantization_fp8(checkpoints):
    llm = LLM(checkpoints[0], quantization="fp8", max_num_batched_tokens=24)
    layer = llm.engine.runner.model.model.layers[1]
    assert layer.self_attn.o_proj.weight.dtype == FP8
    assert layer.mlp.experts.gate_up_proj.dtype == FP8
    assert len(llm.generate(prompts()[:1], GREEDY)[0].token_ids) == MAX_NEW


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("fmt", "e5m2"),
        ("activation_scheme", "static"),
        ("weight_block_size", [128]),
        ("weight_block_size", None),
        ("scale_fmt", "ue8m0"),  # DeepSeek-V4's E8M0 scales
        ("expert_dtype", "fp4"),  # and its FP4 experts
        ("group_size", 128),  # a key neither DeepSeek's nor transformers' config has
    ],
)
def test_a_config_field_the_engine_cannot_honour_is_refused_by_name(
    checkpoints, tmp_path, field, value
):
    path = tmp_path / "bad"
    shutil.copytree(checkpoints[0], path)
    write_quantization(path, {**QUANT, field: value})
    with pytest.raises(ValueError, match=f"quantization_config.{field}"):
        LLM(str(path))


def test_a_weight_without_its_scale_is_refused_by_name(checkpoints, tmp_path):
    path = tmp_path / "no-scale"
    shutil.copytree(checkpoints[0], path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.2.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.2.self_attn.o_proj.weight: FP8"):
        LLM(str(path))


def test_a_scale_of_the_wrong_shape_is_refused_by_name(checkpoints, tmp_path):
    path = tmp_path / "wrong-tiles"
    shutil.copytree(checkpoints[0], path)
    write_quantization(path, {**QUANT, "weight_block_size": [16, 16]})  # 4 tile columns
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.weight: weight_scale_inv"):
        LLM(str(path))
