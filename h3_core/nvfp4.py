"""NVFP4 linears: ComfyUI's `nvfp4` files (the text encoder `qwen3vl_32b_minimax_h3_nvfp4_awq`), 4.5 bits a
weight, held as stored and rebuilt in the compute dtype as they are used (weight-only: any GPU, or the CPU;
FP4 tensor cores are Blackwell-only and not used).

A layer's tensors, as ComfyUI and its comfy_kitchen kernels lay them out:
- `X.weight` uint8 [round16(out), round16(in) / 2]: two E2M1 codes a byte, the even column in the high nibble;
- `X.weight_scale` float8_e4m3fn, one scale per 16 weights of a row, in cuBLAS's blocked layout
  ([round128(rows), round4(in / 16)], each 128 x 4 tile stored as 32 x 16: row 32a + b at [b, a]);
- `X.weight_scale_2` fp32, one per tensor. W = E2M1 value x block scale x tensor scale, cut to [out, in];
- `X.pre_quant_scale` [in], when the file is AWQ-smoothed: the input is multiplied by it before the matmul;
- `X.input_scale` (for FP4 activations) is not used.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from .fp8 import StoredLinear, quant_records
from .weights import CheckpointError

NVFP4_FORMAT = "nvfp4"
BLOCK = 16  # weights per block scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; 8-15 are the same, negative
STORED_LEAVES = ("weight", "weight_scale", "weight_scale_2")  # every NVFP4 layer has these; pre_quant_scale if smoothed
DROPPED_LEAVES = ("comfy_quant", "input_scale")


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@functools.lru_cache(maxsize=None)
def _e2m1_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=dtype, device=device)


def unswizzle_block_scales(scales: torch.Tensor, rows: int, blocks: int) -> torch.Tensor:
    """cuBLAS's blocked layout -> block scales [rows, blocks] (row-major)."""
    tiles_down, tiles_across = -(-rows // 128), -(-blocks // 4)
    tiles = scales.reshape(tiles_down, tiles_across, 32, 4, 4).transpose(2, 3)  # [.., a, b, column]
    plain = tiles.reshape(tiles_down, tiles_across, 128, 4).permute(0, 2, 1, 3)
    return plain.reshape(tiles_down * 128, tiles_across * 4)[:rows, :blocks]


def dequantize(weight: torch.Tensor, block_scales: torch.Tensor, tensor_scale: torch.Tensor,
               shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The dense weight [out, in] = `shape` in `dtype`. Each E2M1 value times its e4m3 block scale is exact in
    bf16, fp16 and fp32; that times the fp32 tensor scale is rounded once in fp32, then to `dtype`."""
    rows, columns = weight.shape[0], weight.shape[1] * 2
    codes = torch.stack((weight >> 4, weight & 0x0F), dim=-1).reshape(rows, columns)
    values = _e2m1_table(weight.device, dtype)[codes.int()]
    if block_scales.dtype == torch.uint8:
        block_scales = block_scales.view(torch.float8_e4m3fn)
    scales = unswizzle_block_scales(block_scales, rows, columns // BLOCK).to(dtype)
    dense = (values.view(rows, columns // BLOCK, BLOCK) * scales[..., None]).view(rows, columns)
    return (dense[: shape[0], : shape[1]].float() * tensor_scale.float().reshape(())).to(dtype)


@dataclass(frozen=True)
class NVFP4Entry:
    """One NVFP4 layer of a file: its stored tensors' shapes, and whether it is AWQ-smoothed."""

    weight: tuple[int, ...]
    weight_scale: tuple[int, ...]
    weight_scale_2: tuple[int, ...]
    smoothed: bool

    def check(self, layer: str, in_features: int, out_features: int) -> None:
        """The shapes an [out, in] linear's NVFP4 tensors must have; a CheckpointError naming the layer."""
        rows, columns = round_up(out_features, BLOCK), round_up(in_features, BLOCK)
        expected = {"weight": (rows, columns // 2),
                    "weight_scale": round_up(rows, 128) * round_up(columns // BLOCK, 4), "weight_scale_2": 1}
        got = {"weight": self.weight, "weight_scale": math.prod(self.weight_scale),
               "weight_scale_2": math.prod(self.weight_scale_2)}
        wrong = [f"{leaf} {got[leaf]} (expected {want})" for leaf, want in expected.items() if got[leaf] != want]
        if wrong:
            raise CheckpointError(f"NVFP4 layer '{layer}' ({out_features}x{in_features}) has the wrong sizes: "
                                  f"{'; '.join(wrong)}.")


def checkpoint_nvfp4_layers(files: Iterable[Path], rename: Callable[[str], str | None]) -> dict[str, NVFP4Entry]:
    """Our layer name -> NVFP4Entry for each layer these files quantize as "nvfp4" (headers and records only).
    `rename`: a file's key or layer name -> ours, None for what the model does not use."""
    layers: dict[str, NVFP4Entry] = {}
    for path in files:
        with safe_open(path, "pt") as handle:
            keys = {name: key for key in handle.keys() if (name := rename(key)) is not None}
            for layer, record in quant_records(handle, keys, path, rename).items():
                if record.get("format") != NVFP4_FORMAT:
                    continue
                missing = [leaf for leaf in STORED_LEAVES if f"{layer}.{leaf}" not in keys]
                if missing:
                    raise CheckpointError(f"NVFP4 layer '{layer}' in {path.name} lacks {', '.join(missing)}.")
                piece = {leaf: handle.get_slice(keys[f"{layer}.{leaf}"]) for leaf in STORED_LEAVES}
                if piece["weight"].get_dtype() != "U8" or piece["weight_scale"].get_dtype() not in ("F8_E4M3", "U8"):
                    raise CheckpointError(
                        f"NVFP4 layer '{layer}' in {path.name} stores its weight as {piece['weight'].get_dtype()} and "
                        f"its block scales as {piece['weight_scale'].get_dtype()}; expected U8 and F8_E4M3.")
                layers[layer] = NVFP4Entry(*(tuple(piece[leaf].get_shape()) for leaf in STORED_LEAVES),
                                           smoothed=f"{layer}.pre_quant_scale" in keys)
    return layers


class NVFP4Linear(StoredLinear):
    """y = (x * pre_quant_scale) W^T (+ bias), W rebuilt from the stored NVFP4 tensors at each call, in
    `compute_dtype`. Parameter names are the file's, so its tensors load as they are."""

    def __init__(self, in_features: int, out_features: int, entry: NVFP4Entry, bias: bool = False,
                 compute_dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        self.in_features, self.out_features, self.compute_dtype = in_features, out_features, compute_dtype

        def stored(shape, dtype):
            return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)

        self.weight = stored(entry.weight, torch.uint8)
        self.weight_scale = stored(entry.weight_scale, torch.float8_e4m3fn)
        self.weight_scale_2 = stored(entry.weight_scale_2, torch.float32)
        self.pre_quant_scale = stored((in_features,), compute_dtype) if entry.smoothed else None
        self.bias = stored((out_features,), compute_dtype) if bias else None

    @classmethod
    def replacing(cls, layer: str, linear: nn.Linear, entry: NVFP4Entry, compute_dtype: torch.dtype) -> "NVFP4Linear":
        """A meta NVFP4Linear in place of `linear`, checked against the file's shapes."""
        entry.check(layer, linear.in_features, linear.out_features)
        return cls(linear.in_features, linear.out_features, entry, linear.bias is not None, compute_dtype, "meta")

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, self.weight_scale_2, (self.out_features, self.in_features),
                          self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.compute_dtype)
        if self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale.to(x.dtype)
        return F.linear(x, self.dequantized_weight(), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"nvfp4{' AWQ-smoothed' if self.pre_quant_scale is not None else ''}, compute={self.compute_dtype}")
