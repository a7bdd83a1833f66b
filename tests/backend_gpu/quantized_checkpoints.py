"""Tiny models written as pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors) and
each one's reference: the same checkpoint dequantized by the format's own definition,
saved as an ordinary float32 checkpoint for transformers to run.

GPTQ and AWQ tensors are packed here from random-rounded integers, by packers and
reference dequantizers written from the formats' published definitions (no quantizer
runs on a CPU in seconds):
- GPTQ: AutoGPTQ's QuantLinear.pack / dequantization (as GPTQModel keeps it):
  qweight [K*b/32, N] packs 32/b consecutive input rows per int32, low bits first;
  qzeros [G, N*b/32] packs output columns the same way and stores zero - 1 ("v1",
  checkpoint_format "gptq") or the zero itself (GPTQModel's "gptq_v2"); scales [G, N];
  g_idx [K]; W[k, n] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n]).
- AWQ: AutoAWQ's WQLinear_GEMM.from_linear: qweight [K, N/8] and qzeros [G, N/8] pack 8
  output columns per int32, nibble i holding column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i];
  its dequantize_gemm unpacks them with AWQ_REVERSE_ORDER (0, 4, 1, 5, 2, 6, 3, 7).
compressed-tensors checkpoints are written and dequantized by that library's own
compressors.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3's checkpoint fuses q/k/v and gate/up: its quantizers quantize each fused tensor
# as one layer (one scale per tensor for all its parts), as these writers do
FUSED = ("qkv_proj", "gate_up_proj")
# the layers that share an input, so GPTQ's act-order gives them one g_idx
SHARED_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}


def _linear_weights(state: dict[str, torch.Tensor]) -> list[str]:
    return [n for n in state if n.endswith(".weight") and n.split(".")[-2] in LINEARS + FUSED]


def _random_biases(state: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    """transformers starts biases at zero, where a dropped one would not show."""
    for name in [n for n in state if n.endswith(".bias")]:
        state[name] = torch.randn(state[name].shape, generator=gen) * 0.5


def _save(src: str, dst: str, state: dict, quantization_config: dict | None) -> str:
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith((".safetensors", "config.json")):
            shutil.copy(os.path.join(src, name), dst)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(dst, "model.safetensors"))
    return dst


def _group_quantize(w: torch.Tensor, bits: int, groups: torch.Tensor, sym: bool, gen):
    """Integers q [N, K], scales [N, G] and zeros [N, G] with w ~ (q - zero) * scale,
    group of column k = groups[k]; rounded at random so no value sits on a tie."""
    n_groups = int(groups.max()) + 1
    maxq = 2**bits - 1
    scales = torch.empty(w.shape[0], n_groups)
    zeros = torch.empty(w.shape[0], n_groups, dtype=torch.int64)
    for g in range(n_groups):
        cols = w[:, groups == g]
        lo, hi = cols.min(dim=1).values.clamp(max=0), cols.max(dim=1).values.clamp(min=0)
        if sym:
            scales[:, g] = torch.maximum(lo.abs(), hi) / (maxq / 2)
            zeros[:, g] = 2 ** (bits - 1)
        else:
            scales[:, g] = (hi - lo) / maxq
            zeros[:, g] = (-lo / scales[:, g]).round().long()
    scales = scales.clamp(min=1e-6).half().float()  # GPTQ and AWQ keep float16 scales
    x = w / scales[:, groups] + zeros[:, groups]
    q = (x + torch.rand(x.shape, generator=gen) - 0.5).round().clamp(0, maxq).long()
    return q, scales, zeros


def _pack(values: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """int32 words packing `values` [R, C] along dim 0, 32/bits per word, low first;
    `order`: which value of each run goes in slot i (AWQ's)."""
    per = 32 // bits
    v = values.long().view(-1, per, values.shape[1])
    if order is not None:
        v = v[:, order]
    words = sum(v[:, i] << (bits * i) for i in range(per))
    return torch.where(words >= 2**31, words - 2**32, words).int()


def write_gptq(src, dst, bits, group_size, sym, desc_act, v2=False, seed=0):
    """`src` as a GPTQ checkpoint at `dst`; returns the reference's directory."""
    gen = torch.Generator().manual_seed(seed)
    state = load_file(os.path.join(src, "model.safetensors"))
    _random_biases(state, gen)
    perms: dict[str, torch.Tensor] = {}
    for name in _linear_weights(state):
        w = state.pop(name)
        n, k = w.shape
        size = k if group_size == -1 else group_size
        groups = torch.arange(k) // size
        if desc_act:  # GPTQ's act order: input rows quantized in a permuted order
            module = name.rsplit(".", 2)
            key = f"{module[0]}.{SHARED_INPUT.get(module[1], module[1])}"
            perm = perms.setdefault(key, torch.randperm(k, generator=gen))
            groups = torch.empty_like(groups).scatter_(0, perm, groups)
        q, scales, zeros = _group_quantize(w, bits, groups, sym, gen)
        prefix = name[: -len(".weight")]
        state[f"{prefix}.qweight"] = _pack(q.t(), bits)
        state[f"{prefix}.qzeros"] = _pack(zeros - (0 if v2 else 1), bits).t().contiguous()
        state[f"{prefix}.scales"] = scales.t().contiguous().half()
        state[f"{prefix}.g_idx"] = groups.int()
    config = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "sym": sym,
        "desc_act": desc_act,
        "checkpoint_format": "gptq_v2" if v2 else "gptq",
    }
    _save(src, dst, state, config)
    return _save(src, dst + "-reference", gptq_dequantized(state, bits, v2), None)


def gptq_dequantized(state: dict, bits: int, v2: bool) -> dict:
    """AutoGPTQ's dequantization of every quantized layer in `state`."""
    out = {
        k: v for k, v in state.items() if not k.endswith(("qweight", "qzeros", "scales", "g_idx"))
    }
    shifts = torch.arange(0, 32, bits)
    mask = 2**bits - 1
    for name in [k for k in state if k.endswith(".qweight")]:
        prefix = name[: -len(".qweight")]
        qweight, qzeros = state[name], state[f"{prefix}.qzeros"]
        scales, g_idx = state[f"{prefix}.scales"].float(), state[f"{prefix}.g_idx"].long()
        zeros = (qzeros[:, :, None] >> shifts) & mask  # [G, N/per, per]
        zeros = zeros.reshape(qzeros.shape[0], -1) + (0 if v2 else 1)
        weight = (qweight[:, None, :] >> shifts[None, :, None]) & mask  # [K/per, per, N]
        weight = weight.reshape(-1, qweight.shape[1])
        out[f"{prefix}.weight"] = (scales[g_idx] * (weight - zeros[g_idx])).t().contiguous()
    return out


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's order_map: column 8c + AWQ_ORDER[i] in nibble i
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def write_awq(src, dst, group_size, seed=0):
    """`src` as an AutoAWQ GEMM checkpoint (4 bits, zero points) at `dst`; returns the
    reference's directory."""
    gen = torch.Generator().manual_seed(seed)
    state = load_file(os.path.join(src, "model.safetensors"))
    _random_biases(state, gen)
    for name in _linear_weights(state):
        w = state.pop(name)
        groups = torch.arange(w.shape[1]) // group_size
        q, scales, zeros = _group_quantize(w, 4, groups, False, gen)
        prefix = name[: -len(".weight")]
        state[f"{prefix}.qweight"] = _pack(q, 4, AWQ_ORDER).t().contiguous()
        state[f"{prefix}.qzeros"] = _pack(zeros, 4, AWQ_ORDER).t().contiguous()
        state[f"{prefix}.scales"] = scales.t().contiguous().half()
    config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    _save(src, dst, state, config)
    return _save(src, dst + "-reference", awq_dequantized(state, group_size), None)


def awq_dequantized(state: dict, group_size: int) -> dict:
    """AutoAWQ's dequantize_gemm of every quantized layer in `state`."""
    out = {k: v for k, v in state.items() if not k.endswith(("qweight", "qzeros", "scales"))}
    shifts = torch.arange(0, 32, 4)

    def unpack(words):  # [R, C] -> [R, 8C] in column order
        values = ((words[:, :, None] >> shifts) & 15).reshape(words.shape[0], -1)
        order = torch.arange(values.shape[1]).view(-1, 8)[:, AWQ_REVERSE_ORDER].view(-1)
        return values[:, order]

    for name in [k for k in state if k.endswith(".qweight")]:
        prefix = name[: -len(".qweight")]
        weight, zeros = unpack(state[name]), unpack(state[f"{prefix}.qzeros"])
        scales = state[f"{prefix}.scales"].float()
        zeros = zeros.repeat_interleave(group_size, dim=0)
        scales = scales.repeat_interleave(group_size, dim=0)
        out[f"{prefix}.weight"] = ((weight - zeros) * scales).t().contiguous()
    return out


def compressed_schemes() -> dict[str, tuple[str, dict]]:
    """name -> (compressed-tensors format, QuantizationScheme fields)."""
    from compressed_tensors.quantization import QuantizationArgs as Args

    fp8_channel = Args(num_bits=8, type="float", strategy="channel", symmetric=True)
    return {
        "w4a16-group-asym": (
            "pack-quantized",
            {"weights": Args(num_bits=4, strategy="group", group_size=32, symmetric=False)},
        ),
        "w8a16-channel": ("pack-quantized", {"weights": Args(num_bits=8, strategy="channel")}),
        # the token table too, as studies/gptq_w4a16.py --table writes it (held once
        # where the model ties it)
        "w4a16-table": (
            "pack-quantized",
            {"weights": Args(num_bits=4, strategy="group", group_size=32, symmetric=True)},
        ),
        "fp8-dynamic": (
            "float-quantized",
            {
                "weights": fp8_channel,
                "input_activations": Args(num_bits=8, type="float", strategy="token", dynamic=True),
            },
        ),
        "fp8-static-tensor": (
            "float-quantized",
            {
                "weights": Args(num_bits=8, type="float", strategy="tensor"),
                "input_activations": Args(num_bits=8, type="float", strategy="tensor"),
            },
        ),
        "w8a8-int": (
            "int-quantized",
            {
                "weights": Args(num_bits=8, strategy="channel"),
                "input_activations": Args(num_bits=8, strategy="token", dynamic=True),
            },
        ),
    }


def write_compressed(src: str, dst: str, kind: str) -> str:
    """`src` as a compressed-tensors checkpoint of scheme `kind` (compressed_schemes) at
    `dst`, compressed and dequantized by the library's compressors; returns the
    reference's directory."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    fmt, fields = compressed_schemes()[kind]
    table = kind.endswith("-table")
    targets = ["Linear", "Embedding"] if table else ["Linear"]
    scheme = QuantizationScheme(targets=targets, **fields)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    args = scheme.weights
    state = load_file(os.path.join(src, "model.safetensors"))
    reference = dict(state)
    tables = [n for n in ("model.embed_tokens.weight", "lm_head.weight") if n in state]
    for name in _linear_weights(state) + (tables if table else []):
        w = state.pop(name)
        if args.strategy == "group":
            grouped = w.view(w.shape[0], -1, args.group_size)
            lo, hi = grouped.amin(dim=2), grouped.amax(dim=2)
        elif args.strategy == "channel":
            lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
        else:
            lo, hi = w.min().reshape(1), w.max().reshape(1)
        scale, zero = calculate_qparams(lo, hi, args)
        local = {"weight": w, "weight_scale": scale}
        if not args.symmetric:
            local["weight_zero_point"] = zero
        if scheme.input_activations is not None and not scheme.input_activations.dynamic:
            local["input_scale"] = torch.tensor([0.05])
        compressed = compressor.compress(local, scheme)
        prefix = name[: -len(".weight")]
        state.update({f"{prefix}.{k}": v for k, v in compressed.items()})
        reference[name] = compressor.decompress(compressed, scheme)["weight"].float()
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=fmt,
        quantization_status="compressed",
        ignore=[] if table else ["lm_head"],
    ).model_dump(mode="json")
    config["quant_method"] = "compressed-tensors"
    _save(src, dst, state, config)
    return _save(src, dst + "-reference", reference, None)
