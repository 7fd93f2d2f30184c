"""NVFP4 linears: ComfyUI's `nvfp4` files (the text encoder `qwen3vl_32b_minimax_h3_nvfp4_awq`), 4.5 bits a
weight, held as stored and rebuilt in the compute dtype as they are used (weight-only: any GPU, or the CPU;
FP4 tensor cores are Blackwell-only and not used).

A layer's tensors, as ComfyUI and its comfy_kitchen kernels lay them out:
- `X.weight` uint8 [round16(out), round16(in) / 2]: two E2M1 codes a byte, the even column in the high nibble;
- `X.weight_scale` float8_e4m3fn (or its bytes as uint8), one scale per 16 weights of a row, in cuBLAS's blocked layout
  ([round128(rows), round4(in / 16)], each 128 x 4 tile stored as 32 x 16: row 32a + b at [b, a]);
- `X.weight_scale_2` fp32, one per tensor. W = E2M1 value x block scale x tensor scale, cut to [out, in];
- `X.pre_quant_scale` [in], when the file is AWQ-smoothed: the input is multiplied by it before the matmul;
- `X.input_scale` (for FP4 activations) is not used.

The text encoder keeps every NVFP4 linear; the DiT (Comfy-Org's `*_nvfp4` DiT files) keeps its block, AdaLN and
refiner linears NVFP4 unless its linears mode asks otherwise, and dequantizes the rest once at load (`NVFP4Load`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .fp8 import StoredLinear, quant_records
from .weights import CheckpointError, open_safetensors

NVFP4_FORMAT = "nvfp4"
BLOCK = 16  # weights per block scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; 8-15 are the same, negative
STORED_LEAVES = ("weight", "weight_scale", "weight_scale_2")  # every NVFP4 layer has these; pre_quant_scale if smoothed
DROPPED_LEAVES = ("comfy_quant", "input_scale")


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _build_byte_table(device, dtype: torch.dtype) -> torch.Tensor:
    values = E2M1_VALUES + tuple(-v for v in E2M1_VALUES)
    return torch.tensor([(values[byte >> 4], values[byte & 0x0F]) for byte in range(256)], dtype=dtype, device=device)


_cached_byte_table = functools.lru_cache(maxsize=None)(_build_byte_table)


def byte_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 2]: the two E2M1 values a stored byte holds (high nibble first), so a weight is rebuilt with one
    lookup per byte. Made once per device and dtype; a compiled graph builds it inside (its cache stays outside)."""
    return _build_byte_table(device, dtype) if torch.compiler.is_compiling() else _cached_byte_table(device, dtype)


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
    values = byte_table(weight.device, dtype)[weight.int()]  # [rows, columns / 2, 2]
    if block_scales.dtype == torch.uint8:
        block_scales = block_scales.view(torch.float8_e4m3fn)
    scales = unswizzle_block_scales(block_scales, rows, columns // BLOCK).to(dtype)
    dense = (values.view(rows, columns // BLOCK, BLOCK) * scales[..., None]).view(rows, columns)
    return dense[: shape[0], : shape[1]].float().mul_(tensor_scale.float().reshape(())).to(dtype)


@dataclass(frozen=True)
class NVFP4Entry:
    """One NVFP4 layer of a file: its stored tensors' shapes, and whether it is AWQ-smoothed."""

    weight: tuple[int, ...]
    weight_scale: tuple[int, ...]
    weight_scale_2: tuple[int, ...]
    smoothed: bool

    @classmethod
    def for_linear(cls, out_features: int, in_features: int, smoothed: bool = False) -> "NVFP4Entry":
        """What an [out, in] linear's NVFP4 tensors are (sizes padded to 16, block scales in the blocked layout)."""
        rows, columns = round_up(out_features, BLOCK), round_up(in_features, BLOCK)
        return cls((rows, columns // 2), (round_up(rows, 128), round_up(columns // BLOCK, 4)), (), smoothed)

    def check(self, layer: str, in_features: int, out_features: int) -> None:
        """The shapes an [out, in] linear's NVFP4 tensors must have; a CheckpointError naming the layer."""
        want = NVFP4Entry.for_linear(out_features, in_features)
        expected = {"weight": want.weight, "weight_scale": math.prod(want.weight_scale), "weight_scale_2": 1}
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
        with open_safetensors(path) as handle:
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
                        f"its block scales as {piece['weight_scale'].get_dtype()}; expected U8, and F8_E4M3 (or U8).")
                layers[layer] = NVFP4Entry(*(tuple(piece[leaf].get_shape()) for leaf in STORED_LEAVES),
                                           smoothed=f"{layer}.pre_quant_scale" in keys)
    return layers


def outside(layers: dict, rename: Callable[[str], str | None]) -> Callable[[str], str | None]:
    """`rename` that also drops these NVFP4 `layers`' tensors and records, so the FP8 / int8 reader passes over
    them."""

    def renamed(key: str) -> str | None:
        name = rename(key)
        return None if name is None or name in layers or name.rpartition(".")[0] in layers else name

    return renamed


class NVFP4Linear(StoredLinear):
    """y = (x * pre_quant_scale) W^T (+ bias), W rebuilt from the stored NVFP4 tensors at each call, in
    `compute_dtype`. Parameter names are the file's, so its tensors load as they are."""

    held = "nvfp4"

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

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, self.weight_scale_2, (self.out_features, self.in_features),
                          self.compute_dtype)

    def as_dense(self) -> nn.Linear:
        """A dense linear computing the same (the AWQ scale folded into its columns), in `compute_dtype`."""
        linear = nn.Linear(self.in_features, self.out_features, self.bias is not None, device="meta")
        weight = smoothed_weight(self.weight, self.weight_scale, self.weight_scale_2, self.pre_quant_scale,
                                 (self.out_features, self.in_features))
        linear.weight = nn.Parameter(weight.to(self.compute_dtype), requires_grad=False)
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias.detach(), requires_grad=False)
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.compute_dtype)
        if self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale.to(x.dtype)
        return F.linear(x, self.dequantized_weight(), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"nvfp4{' AWQ-smoothed' if self.pre_quant_scale is not None else ''}, compute={self.compute_dtype}")


@dataclass
class NVFP4Load:
    """How one load treats a file's NVFP4 layers: the `kept` ones are NVFP4Linear in the model (their tensors
    load as stored); the others are rebuilt into one dense weight in `dense_dtype[layer]` as they stream in."""

    layers: dict[str, NVFP4Entry]
    kept: set[str]
    dense_dtype: dict[str, torch.dtype]
    shapes: dict[str, tuple[int, int]]  # [out, in] of each layer (the stored tensors are padded to 16)

    @classmethod
    def plan(cls, model: nn.Module, layers: dict[str, NVFP4Entry], keep: Callable[[str], bool],
             compute: torch.dtype, dense_dtype: Callable[[str], torch.dtype]) -> "NVFP4Load":
        """Swap NVFP4Linear into the meta-built `model` for the layers `keep` accepts, computing in `compute`;
        every NVFP4 layer must be a linear of the model with the file's shapes."""
        kept, dense, shapes = set(), {}, {}
        for layer, entry in layers.items():
            try:
                linear = model.get_submodule(layer)
            except AttributeError:
                linear = None
            if not isinstance(linear, nn.Linear):
                raise CheckpointError(f"The checkpoint holds '{layer}' as NVFP4, but it is not a linear layer of this "
                                      "model.")
            entry.check(layer, linear.in_features, linear.out_features)
            shapes[layer] = (linear.out_features, linear.in_features)
            if keep(layer):
                kept.add(layer)
                model.set_submodule(layer, NVFP4Linear(linear.in_features, linear.out_features, entry,
                                                       linear.bias is not None, compute, "meta"))
            else:
                dense[layer] = dense_dtype(layer)
        return cls(layers, kept, dense, shapes)

    def dtype_for(self, name: str, otherwise: torch.dtype | None) -> torch.dtype | None:
        """The dtype the model holds `name` in: a kept layer's codes and block scales as stored (None), its
        tensor scale in fp32; anything else `otherwise`."""
        layer, _, leaf = name.rpartition(".")
        if layer in self.kept and leaf in STORED_LEAVES:
            return torch.float32 if leaf == "weight_scale_2" else None
        return otherwise

    def stream(self, items: Iterable, device: torch.device | str) -> Iterator:
        """(name, tensor, where) items in our names -> the model's tensors: a kept layer's as stored, a dequantized
        layer's gathered into its dense weight (on `device`; an AWQ pre_quant_scale folded into its columns).
        Quantization records and input scales are dropped."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor, where in items:
            layer, _, leaf = name.rpartition(".")
            entry = self.layers.get(layer)
            if entry is not None and leaf == "weight_scale" and tensor.dtype == torch.uint8:
                tensor = tensor.view(torch.float8_e4m3fn)  # the e4m3 bytes stored as uint8 (header check), kept or not
            if entry is None or layer in self.kept or leaf == "bias":
                if entry is None or leaf not in DROPPED_LEAVES:
                    yield name, tensor, where
                continue
            if leaf in DROPPED_LEAVES:
                continue
            parts = pending.setdefault(layer, {})
            parts[leaf] = tensor
            if all(needed in parts for needed in STORED_LEAVES + (("pre_quant_scale",) if entry.smoothed else ())):
                del pending[layer]
                yield f"{layer}.weight", self._dense(layer, parts, device), where
        for layer, parts in pending.items():
            missing = [leaf for leaf in STORED_LEAVES if leaf not in parts] or ["pre_quant_scale"]
            raise CheckpointError(f"NVFP4 layer '{layer}' lacks {', '.join(missing)} in the checkpoint.")

    def _dense(self, layer: str, parts: dict[str, torch.Tensor], device) -> torch.Tensor:
        dtype, shape = self.dense_dtype[layer], self.shapes[layer]
        if parts["weight"].is_meta:
            return torch.empty(shape, dtype=dtype, device="meta")
        stored = (parts[leaf].to(device) for leaf in STORED_LEAVES)
        smoothing = parts.get("pre_quant_scale")
        return smoothed_weight(*stored, None if smoothing is None else smoothing.to(device), shape).to(dtype)


def smoothed_weight(weight: torch.Tensor, block_scales: torch.Tensor, tensor_scale: torch.Tensor,
                    pre_quant_scale: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor:
    """The fp32 weight a dense linear needs to compute what an NVFP4 one does: W diag(pre_quant_scale)
    ((x * s) W^T = x (W diag(s))^T), or W where the layer is not smoothed."""
    dense = dequantize(weight, block_scales, tensor_scale, shape, torch.float32)
    return dense if pre_quant_scale is None else dense.mul_(pre_quant_scale.float())
