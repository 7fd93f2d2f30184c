"""NVFP4 weights as ComfyUI stores them (the `nvfp4` format of its `*_nvfp4_awq` files), written by the tests
from the layout's description (independently of h3_core.nvfp4): E2M1 codes two a byte (the even column in the
high nibble), e4m3 block scales per 16 weights in cuBLAS's blocked layout, an fp32 tensor scale, and an
optional AWQ pre_quant_scale the input is multiplied by."""

from __future__ import annotations

import json

import torch

MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def blocked(scales: torch.Tensor) -> torch.Tensor:
    """[rows, blocks] -> cuBLAS's blocked layout [round128(rows), round4(blocks)]: each 128x4 tile as 32x16,
    tile row 32a + b, column c at [b, 4a + c]."""
    rows, blocks = scales.shape
    padded = torch.zeros(_round_up(rows, 128), _round_up(blocks, 4), dtype=scales.dtype)
    padded[:rows, :blocks] = scales
    out = torch.empty_like(padded)
    for tile_row in range(0, padded.shape[0], 128):
        for tile_col in range(0, padded.shape[1], 4):
            tile = padded[tile_row:tile_row + 128, tile_col:tile_col + 4]  # [128, 4]
            flat = torch.empty(32, 16, dtype=scales.dtype)
            for a in range(4):
                flat[:, 4 * a:4 * a + 4] = tile[32 * a:32 * a + 32]
            start = (tile_row // 128 * (padded.shape[1] // 4) + tile_col // 4) * 512
            out.view(-1)[start:start + 512] = flat.reshape(-1)
    return out


def quantize(weight: torch.Tensor, pre_quant_scale: torch.Tensor | None = None):
    """weight [out, in] -> (tensors by leaf, the weight they stand for [out, in] in float64). With a
    pre_quant_scale [in], weight / it is quantized (AWQ smoothing: the input is multiplied by it)."""
    smoothed = weight.double() if pre_quant_scale is None else weight.double() / pre_quant_scale.double()
    out_features, in_features = weight.shape
    rows, columns = _round_up(out_features, 16), _round_up(in_features, 16)
    padded = torch.zeros(rows, columns, dtype=torch.float64)
    padded[:out_features, :in_features] = smoothed
    tensor_scale = torch.tensor(padded.abs().max().item() / (448.0 * 6.0), dtype=torch.float32)
    grouped = padded.view(rows, columns // 16, 16)
    block = (grouped.abs().amax(dim=-1) / 6.0 / tensor_scale.double()).float().to(torch.float8_e4m3fn)
    step = (block.double() * tensor_scale.double()).clamp(min=1e-30)[..., None]
    scaled = (grouped / step).clamp(-6.0, 6.0)
    codes = (scaled.abs()[..., None] - MAGNITUDES).abs().argmin(dim=-1)
    codes = codes + 8 * ((scaled < 0) & (codes > 0))
    values = MAGNITUDES[codes % 8] * torch.where(codes >= 8, -1.0, 1.0)
    meant = (values * block.double()[..., None] * tensor_scale.double()).view(rows, columns)
    flat = codes.view(rows, columns).to(torch.uint8)
    tensors = {"weight": (flat[:, 0::2] << 4) | flat[:, 1::2], "weight_scale": blocked(block),
               "weight_scale_2": tensor_scale, "input_scale": torch.tensor(1.0)}
    if pre_quant_scale is not None:
        tensors["pre_quant_scale"] = pre_quant_scale.float()
    return tensors, meant[:out_features, :in_features]


def record() -> torch.Tensor:
    return torch.tensor(list(json.dumps({"format": "nvfp4"}).encode()), dtype=torch.uint8)


def quantize_layers(tensors: dict, layers, prefix: str = "", smoothed: bool = False, seed: int = 0) -> dict:
    """ComfyUI's nvfp4 file in miniature: each of `layers` in the state dict `tensors` (keys `prefix` + name)
    replaced in place by its NVFP4 tensors and comfy_quant record, AWQ-smoothed with a random positive
    pre_quant_scale when asked. Returns layer -> (the weight meant, float64, pre_quant_scale or None)."""
    g = torch.Generator().manual_seed(seed)
    meant = {}
    for layer in layers:
        weight = tensors.pop(f"{prefix}{layer}.weight").float()
        smoothing = 0.5 + torch.rand(weight.shape[1], generator=g) if smoothed else None
        stored, values = quantize(weight, smoothing)
        for leaf, tensor in stored.items():
            tensors[f"{prefix}{layer}.{leaf}"] = tensor.contiguous()
        tensors[f"{prefix}{layer}.comfy_quant"] = record()
        meant[layer] = (values, smoothing)
    return meant
