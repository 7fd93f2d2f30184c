"""FP8 block linears: half the weight bytes, and on Hopper / Ada GPUs the FP8 tensor cores.

A block linear holds its weight as float8_e4m3fn with an fp32 scale (per output channel when we
quantize; per tensor in ComfyUI's `fp8_scaled` files): W ~= weight * scale. It computes one of two ways:

- "dequantize" (weight-only): W is rebuilt in the compute dtype on each call and multiplied as usual.
  No loss beyond the stored weight's own rounding; it saves memory (and streamed bytes), not time.
- "scaled" (lossy, opt-in): each call also quantizes its input to e4m3, one fp32 scale per row
  (or per tensor), and runs `torch._scaled_mm` (FP8 tensor cores; CPU builds have it too).

Only the 200 token-wise block linears (qkv, out, fc1, fc2 of the 50 blocks) and, on request, the
AdaLN projections are ever FP8: the fp32 patch projections, time embedder and output heads, the text
projection and the token refiner stay as they are (they are < 1% of the work and the most sensitive).
A file's float8_e5m2 linears are kept weight-only (the FP8 matmul takes e4m3). ComfyUI's int8 files
(`*_int8_convrot`) are held the same weight-only way: int8 with a scale per row, each
weight's ConvRot rotation (a Hadamard matrix over groups of input columns) turned back as it is rebuilt. Its
int4 files (format `convrot_w4a4`: two signed 4-bit values a byte, the even column in the low nibble, a scale
per row, ConvRot-rotated) too, weight-only: the activations stay in the compute dtype (ComfyUI's own kernels
also round them to int4).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from . import keymap
from .weights import CheckpointError, HEADER_DTYPES, open_safetensors

FP8 = torch.float8_e4m3fn
MIN_SCALE = 1e-12  # an all-zero row or tensor quantizes to zeros with this scale, not to NaN
MATMULS = ("dequantize", "scaled")
BLOCK_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")

# How the DiT's linears are held (`load_dit(linears=...)`, `h3 ... --linears`). Lossy ones say so.
LINEAR_MODES = {
    "checkpoint": "as the checkpoint stores them (a file's FP8, int8, int4 or NVFP4 linears stay so, weight-only "
                  "compute)",
    "dense": "a quantized file's FP8, int8, int4 or NVFP4 weights dequantized into the model dtype at load",
    "fp8-weights-lossy": "block linears stored FP8 (quantized at load), weight-only compute: half the bytes",
    "fp8-lossy": "block linears FP8 (an int8 file's requantized) and their inputs FP8 per row: FP8 tensor-core "
                 "matmuls (Hopper/Ada)",
}


def compute_dtype(linear: nn.Module) -> torch.dtype:
    """The dtype a linear computes in: an FP8Linear's `compute_dtype` (its weight is e4m3), else its weight's."""
    return getattr(linear, "compute_dtype", linear.weight.dtype)


def check_linear_mode(mode: str, device: torch.device | str | None = None) -> str:
    """`mode` if it is one of LINEAR_MODES; with a `device`, "fp8-lossy" also needs FP8 matmuls there."""
    if mode not in LINEAR_MODES:
        raise ValueError(f"Unknown linears mode {mode!r}; choose one of {', '.join(LINEAR_MODES)}.")
    if device is not None and mode == "fp8-lossy":
        check_scaled_device(torch.device(device))
    return mode


# ----------------------------------------------------------------------------------------------
# Quantization


def quantize(tensor: torch.Tensor, per_row: bool, dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (q, scale) with x ~= q * scale; scale fp32 [rows, 1] (per row) or [] (per tensor).
    The scale maps each row's (or the tensor's) absolute maximum onto the format's largest value."""
    largest = torch.finfo(dtype).max
    # vector_norm(inf) is the absolute maximum without an |x| temporary (the inputs are large)
    amax = torch.linalg.vector_norm(tensor, float("inf"), dim=-1 if per_row else None, keepdim=per_row)
    scale = (amax.float() / largest).clamp(min=MIN_SCALE)
    scaled = tensor.to(torch.float32, copy=True).div_(scale)  # one fp32 temporary, then in place
    return scaled.clamp_(-largest, largest).to(dtype), scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> e4m3 weight and an fp32 scale per output channel [out]."""
    q, scale = quantize(weight, per_row=True)
    return q, scale.view(-1)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rotation: int = 0,
               packed: bool = False) -> torch.Tensor:
    """weight * scale in fp32, then rounded once to `dtype`; scale [] or [out]. `rotation` > 0: the integer
    weight was stored ConvRot-rotated in groups of that many input columns, turned back first (exactly, in
    integers: `rotate_integers`; the rotation's 1/sqrt(group), a power of two, goes with the scale). `packed`:
    int4 values two a byte (`unpack_int4`)."""
    values, scale = unpack_int4(weight) if packed else weight, scale.float()
    if rotation:
        values, scale = rotate_integers(values, rotation), scale / math.sqrt(rotation)
    return (values.float() * (scale.view(-1, 1) if scale.ndim else scale)).to(dtype)


def unpack_int4(weight: torch.Tensor) -> torch.Tensor:
    """[out, in / 2] int8, two signed 4-bit values a byte (the even column in the low nibble) -> [out, in] int8."""
    low = weight & 0x0F
    low = low - ((low & 0x08) << 1)  # sign of the low nibble
    high = weight >> 4  # arithmetic: the high nibble with its sign
    return torch.stack((low, high), dim=-1).view(weight.shape[0], weight.shape[1] * 2)


def hadamard(size: int, device: torch.device | None = None) -> torch.Tensor:
    """ComfyUI's ConvRot rotation: `hadamard_signs` scaled by 1/sqrt(size), fp32. Symmetric and orthogonal, so
    it is its own inverse."""
    return hadamard_signs(size, device).float() / size**0.5


def hadamard_signs(size: int, device: torch.device | None = None) -> torch.Tensor:
    """The rotation's signs (int8): Kronecker powers of [[1,1,1,-1],[1,1,-1,1],[1,-1,1,1],[-1,1,1,1]], size a
    power of 4. Made once per size and device (a kept int8 linear rebuilds its weight every call); a compiled
    graph builds them inside."""
    return _build_signs(size, device) if torch.compiler.is_compiling() else _cached_signs(size, device)


def is_rotation_group(size) -> bool:
    """A ConvRot group size: an integer power of 4 (4, 16, 64, 256, ...)."""
    return isinstance(size, int) and not isinstance(size, bool) and size >= 4 and 4 ** round(math.log(size, 4)) == size


def check_rotation_group(size: int) -> None:
    if not is_rotation_group(size):
        raise ValueError(f"A ConvRot group is a power of 4 (4, 16, 64, 256, ...); got {size}.")


def _build_signs(size: int, device) -> torch.Tensor:
    check_rotation_group(size)  # here, not in `hadamard_signs`: once per size, off the per-call path
    base = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.int8, device=device)
    matrix = base
    while matrix.shape[0] < size:
        matrix = torch.kron(matrix, base)
    return matrix


_cached_signs = functools.lru_cache(maxsize=None)(_build_signs)


def rotate_integers(values: torch.Tensor, group: int) -> torch.Tensor:
    """Integer weights [out, in] (int8) times the rotation's signs over each group of `group` input columns: the
    ConvRot rotation turned back, times sqrt(group). Exact either way: int32 sums on CUDA's int8 tensor cores
    (where its sizes suit them), else fp32 (integer sums far below 2^24)."""
    out_features, in_features = values.shape
    if in_features % group:
        raise ValueError(f"A ConvRot weight with {in_features} input columns does not split into groups of {group}.")
    grouped, signs = values.reshape(-1, group), hadamard_signs(group, values.device)
    if values.is_cuda and grouped.shape[0] > 16 and group % 8 == 0:
        rotated = torch._int_mm(grouped, signs)
    else:
        rotated = grouped.float() @ signs.float()
    return rotated.view(out_features, in_features)


@functools.lru_cache(maxsize=None)
def scaled_mm_supported(device_type: str, index: int | None = None) -> bool:
    """FP8 matmuls on this device: CUDA from compute capability 8.9 (Ada, Hopper); CPU where this
    torch build has them in the row-wise form FP8Linear uses (a scale per row and per column; torch
    2.11's CPU kernel takes per-tensor scales only), checked with a tiny product."""
    if device_type == "cuda":
        return torch.cuda.get_device_capability(index) >= (8, 9)
    try:
        a = torch.zeros(16, 16, dtype=FP8, device=device_type)
        ones = torch.ones(16, 1, device=device_type)
        torch._scaled_mm(a, a.t(), scale_a=ones, scale_b=ones.t().contiguous(), out_dtype=torch.float32)
        return True
    except (RuntimeError, NotImplementedError, TypeError):  # MPS: no FP8 tensors at all (TypeError)
        return False


# ----------------------------------------------------------------------------------------------
# The module


class StoredLinear(nn.Module):
    """A linear that holds its weight as a file stores it (FP8, int8, int4, NVFP4) and rebuilds it as it is used.
    `held` names the format for memory plans (memory_plan.HELD_FORMATS)."""

    held = "dense"

    def _apply(self, fn, recurse=True):
        """Device moves only: `model.to(dtype)` / `set_dtype` must not upcast the stored weight or round its
        scales, so a dtype change proposed by `fn` is dropped and only its device kept."""

        def device_only(t):
            moved = fn(t)
            return moved if moved.dtype == t.dtype else t.to(moved.device)

        return super()._apply(device_only, recurse)


class FP8Linear(StoredLinear):
    """y = x W^T (+ bias) with W = weight (e4m3) * weight_scale (fp32, [] or [out]); see the module
    docstring for the two `matmul` ways. Outputs are in `compute_dtype`. The parameter names are the
    fp8_scaled files' (`.weight`, `.weight_scale`), so state dicts load and stream as they are.
    A ComfyUI int8 file's linears are held the same way (`weight_dtype` int8, weight-only), their ConvRot
    rotation (`rotation`: its group size) turned back each time the weight is rebuilt; an int4 file's too,
    `packed` two values a byte."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, per_channel: bool = True,
                 compute_dtype: torch.dtype = torch.bfloat16, matmul: str = "dequantize",
                 activations: str = "row", weight_dtype: torch.dtype = FP8, device=None, rotation: int = 0,
                 packed: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = compute_dtype
        self.rotation, self.packed = rotation, packed
        stored = (out_features, in_features // 2 if packed else in_features)
        self.weight = nn.Parameter(torch.empty(stored, dtype=weight_dtype, device=device), requires_grad=False)
        scale_shape = (out_features,) if per_channel else ()
        self.weight_scale = nn.Parameter(torch.ones(scale_shape, dtype=torch.float32, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=compute_dtype, device=device), requires_grad=False) if bias else None
        self.set_matmul(matmul, activations)

    @classmethod
    def from_linear(cls, linear: nn.Linear, matmul: str = "dequantize", activations: str = "row") -> "FP8Linear":
        """Quantize a dense linear per output channel (on its own device); its bias is kept as is."""
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, True,
                     linear.weight.dtype, matmul, activations, device="meta")
        weight, scale = quantize_weight(linear.weight.detach())
        module.weight = nn.Parameter(weight, requires_grad=False)
        module.weight_scale = nn.Parameter(scale, requires_grad=False)
        if linear.bias is not None:
            module.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
        return module

    def set_matmul(self, matmul: str, activations: str = "row") -> "FP8Linear":
        """"scaled" needs both sizes to be multiples of 16 (the FP8 kernels' rule) and an e4m3 weight;
        otherwise this linear keeps the weight-only path."""
        if matmul not in MATMULS:
            raise ValueError(f"Unknown FP8 matmul {matmul!r}; choose one of {', '.join(MATMULS)}.")
        if activations not in ("row", "tensor"):
            raise ValueError(f"FP8 activations are scaled per 'row' or per 'tensor', got {activations!r}.")
        fits = self.in_features % 16 == 0 and self.out_features % 16 == 0 and self.weight.dtype == FP8
        self.matmul = matmul if fits else "dequantize"
        self.activations = activations
        return self

    @property
    def held(self) -> str:
        """memory_plan.HELD_FORMATS: half a byte a weight (int4), else a byte (e4m3 or int8) in FP8 matmuls, or
        rebuilt for each (ConvRot-rotated int8 costs more to rebuild)."""
        if self.packed:
            return "int4"
        if self.matmul == "scaled":
            return "fp8-scaled"
        return "int8" if self.rotation else "fp8"

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, self.compute_dtype, self.rotation, self.packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.matmul == "scaled":
            return self._scaled(x)
        return F.linear(x.to(self.compute_dtype), self.dequantized_weight(), self.bias)

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        q, scale_a = quantize(rows, per_row=self.activations == "row")
        scale_b = self.weight_scale
        if scale_a.ndim or scale_b.ndim:  # row-wise form: [M, 1] and [1, N]
            scale_a = scale_a.expand(rows.shape[0], 1).contiguous()
            scale_b = scale_b.view(1, -1).expand(1, self.out_features).contiguous()
        y = torch._scaled_mm(q, self.weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=self.compute_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        scale = "per channel" if self.weight_scale.ndim else "per tensor"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight={self.weight.dtype} scaled {scale}, matmul={self.matmul}, compute={self.compute_dtype}")


# ----------------------------------------------------------------------------------------------
# Swapping a model's block linears


def block_linear_names(model: nn.Module, adaln: bool = False) -> list[str]:
    """The 4 token-wise linears of each block, plus the AdaLN projections when asked."""
    names = [f"blocks.{i}.{leaf}" for i in range(len(model.blocks)) for leaf in BLOCK_LINEARS]
    if adaln:
        names += [f"blocks.{i}.adaln_proj.linear" for i in range(len(model.blocks))] + ["final_layer.adaln_proj.linear"]
    return names


def quantize_blocks(model: nn.Module, matmul: str = "scaled", activations: str = "row", adaln: bool = False,
                    device: torch.device | str | None = None) -> list[str]:
    """Swap the block linears (and, with `adaln`, the AdaLN projections) of an H3DiT for FP8Linear,
    quantized per output channel where they sit. Already-FP8 linears only get the new `matmul`; other stored ones
    (NVFP4, GGUF) stay weight-only, or are rebuilt and quantized for "scaled".
    `device` (default: where the weights are) is where the model will compute: "scaled" there needs
    FP8 matmul support. Lossy: returns the names swapped, so a caller can say what changed."""
    if matmul not in MATMULS:
        raise ValueError(f"Unknown FP8 matmul {matmul!r}; choose one of {', '.join(MATMULS)}.")
    names = block_linear_names(model, adaln)
    device = torch.device(device) if device is not None else model.get_submodule(names[0]).weight.device
    if matmul == "scaled":
        check_scaled_device(device)
    for name in names:
        module = model.get_submodule(name)
        if isinstance(module, FP8Linear):
            module.set_matmul(matmul, activations)
        elif isinstance(module, StoredLinear):  # NVFP4 / GGUF: already smaller weight-only; rebuilt for FP8 matmuls
            if matmul == "scaled":
                model.set_submodule(name, FP8Linear.from_linear(module.as_dense(), matmul, activations))
        else:
            model.set_submodule(name, FP8Linear.from_linear(module, matmul, activations))
    return names


def read_mode(linears: str, loras: bool) -> str:
    """The linears mode a checkpoint is read in for a run in `linears`: with LoRAs the lossy FP8 linears are made
    after the LoRAs merge into the dense weights, so the file is read as it stores them ("checkpoint")."""
    return "checkpoint" if loras and linears.startswith("fp8") else linears


def held_format(model: nn.Module) -> str:
    """How the blocks' linears are held (memory_plan.HELD_FORMATS): "dense", "fp8", "fp8-scaled", "int8", "int4",
    "nvfp4", or GGUF's "gguf:<bytes a weight>"; the costliest of every block's linears (a file may leave some
    blocks dense, and a GGUF file's GGML types may differ by block)."""
    from .memory_plan import HELD_COST_ORDER, gguf_held

    held = {getattr(block.get_submodule(leaf), "held", "dense") for block in model.blocks for leaf in BLOCK_LINEARS}
    if "gguf" not in held:
        return max(held, key=HELD_COST_ORDER.index)
    return gguf_held(_block_sizes([block.get_submodule(leaf) for leaf in BLOCK_LINEARS]) for block in model.blocks)


def _block_sizes(linears: list[nn.Module]) -> tuple[int, int]:
    """(stored bytes, weights) of a block's linears."""
    return (sum(linear.weight.numel() * linear.weight.element_size() for linear in linears),
            sum(linear.in_features * linear.out_features for linear in linears))


def check_scaled_device(device: torch.device) -> None:
    if device.type != "meta" and not scaled_mm_supported(device.type, device.index):
        raise ValueError(
            f"FP8 matmuls are not supported on {device} (CUDA needs compute capability 8.9+, Ada or Hopper); "
            "use linears 'fp8-weights-lossy' (weight-only) there."
        )


def apply_linear_mode(model: nn.Module, mode: str, device: torch.device | str | None = None) -> list[str]:
    """After loading: what `mode` asks of a model that is already in memory (dense or FP8)."""
    check_linear_mode(mode)
    if mode == "fp8-lossy":
        return quantize_blocks(model, "scaled", device=device)
    if mode == "fp8-weights-lossy":
        return quantize_blocks(model, "dequantize", device=device)
    return []


# ----------------------------------------------------------------------------------------------
# ComfyUI fp8_scaled checkpoints
#
# Two generations of the same idea (ComfyUI comfy/utils.py `convert_old_quants`, comfy/ops.py):
# - old: a marker tensor `scaled_fp8` (its dtype names the FP8 format; fp32 means e4m3fn), then per
#   quantized layer `X.weight` (FP8), `X.scale_weight` (fp32) and optionally `X.scale_input`;
# - new: per layer `X.weight` (FP8, or uint8 holding FP8 bytes), `X.weight_scale` (fp32), optionally
#   `X.input_scale`, and the format as JSON: a uint8 tensor `X.comfy_quant` ({"format": "float8_e4m3fn"})
#   or the file metadata `_quantization_metadata` ({"layers": {"X": {"format": ...}}}).
# We use the weight and its scale; input scales are for static activation scaling and are dropped
# (our activations are scaled per row on the fly).

FP8_FORMATS = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
INT8_FORMAT = "int8_tensorwise"  # ComfyUI's int8 files (`*_int8_convrot`): held weight-only, like FP8 ones
INT4_FORMAT = "convrot_w4a4"  # ComfyUI's int4 ConvRot files: held weight-only too, two values a byte
HEADER_FP8 = {name: dtype for name, dtype in HEADER_DTYPES.items() if name.startswith("F8_")}
DROPPED_LEAVES = ("comfy_quant", "input_scale", "scale_input")
SCALE_LEAVES = ("weight_scale", "scale_weight")


@dataclass(frozen=True)
class FP8Entry:
    """One quantized layer of a checkpoint: its format (an FP8 dtype, or int8 for ComfyUI's int8 ConvRot
    files) and the shape its scale is held in ([] or [out])."""

    dtype: torch.dtype
    scale_shape: tuple[int, ...]
    scaled: bool  # False: FP8 weight without a scale (scale 1)
    rotation: int = 0  # int8 / int4 ConvRot: the rotation's group size (input columns)
    packed: bool = False  # int4: two values a byte


def checkpoint_fp8_layers(files: Iterable[Path], rename: Callable[[str], str | None] = keymap.strip_prefix
                          ) -> dict[str, FP8Entry]:
    """Our layer name -> FP8Entry for every FP8 layer of these safetensors files (headers, the tiny
    comfy_quant tensors and the metadata only). Other quantized formats are a CheckpointError.
    `rename`: a file's key or layer name -> ours (a prefix change), None for what the model does not use."""
    layers: dict[str, FP8Entry] = {}
    for path in files:
        with open_safetensors(path) as handle:
            keys = {name: k for k in handle.keys() if (name := rename(k)) is not None}
            formats = layer_formats(handle, keys, path, rename)
            marker = next((k for name, k in keys.items() if name == "scaled_fp8"), None)
            if marker is not None:
                dtype = handle.get_slice(marker).get_dtype()
                old = FP8_FORMATS["float8_e5m2"] if dtype == "F8_E5M2" else FP8_FORMATS["float8_e4m3fn"]
                for name in keys:
                    if name.endswith(".scale_weight"):
                        formats.setdefault(name[: -len(".scale_weight")], (old, 0, False))
            for name, key in keys.items():
                if not name.endswith(".weight"):
                    continue
                layer = name[: -len(".weight")]
                header = handle.get_slice(key).get_dtype()
                dtype, rotation, packed = formats.get(layer, (HEADER_FP8.get(header), 0, False))
                scale_key = next((keys[f"{layer}.{leaf}"] for leaf in SCALE_LEAVES if f"{layer}.{leaf}" in keys), None)
                if dtype is None:
                    if scale_key is not None:
                        raise CheckpointError(
                            f"'{key}' in {path.name} has a scale but is stored as {header} with no FP8 format named; "
                            "this loader reads bf16/fp32, FP8 (fp8_scaled) and int8 ConvRot H3 files only."
                        )
                    continue
                if dtype == torch.int8:
                    if header != "I8" or scale_key is None:
                        raise CheckpointError(f"'{key}' in {path.name} is marked int8 but stored as {header}"
                                              f"{'' if scale_key else ' without a weight_scale'}.")
                elif header not in HEADER_FP8 and header != "U8":
                    raise CheckpointError(f"'{key}' in {path.name} is marked FP8 but stored as {header}.")
                shape = handle.get_slice(key).get_shape()
                scale_shape = () if scale_key is None else tuple(handle.get_slice(scale_key).get_shape())
                numel = 1
                for size in scale_shape:
                    numel *= size
                if numel not in (1, shape[0]):
                    raise CheckpointError(
                        f"The scale of '{key}' in {path.name} has shape {list(scale_shape)}; expected one value "
                        f"or one per output channel ({shape[0]})."
                    )
                if packed and numel != shape[0]:
                    raise CheckpointError(f"int4 layer '{key}' in {path.name} needs a scale per row ({shape[0]}), "
                                          f"has {numel}.")
                columns = shape[-1] * (2 if packed else 1)
                if rotation and columns % rotation:  # else only the first rebuild of the weight would say it
                    raise CheckpointError(f"'{key}' in {path.name} is rotated in groups of {rotation} input columns, "
                                          f"but it has {columns}.")
                layers[layer] = FP8Entry(dtype, () if numel == 1 else (shape[0],), scale_key is not None, rotation,
                                         packed)
    return layers


def layer_formats(handle, keys: dict[str, str], path: Path, rename: Callable[[str], str | None] = keymap.strip_prefix
                  ) -> dict[str, tuple[torch.dtype, int, bool]]:
    """(dtype, ConvRot group or 0, packed int4) per layer (our names: `keys` maps them to the file's, `rename` the
    metadata's layer names), as `X.comfy_quant` tensors or the `_quantization_metadata` file metadata name
    them: FP8; int8 ("int8_tensorwise", optionally ConvRot-rotated); int4 ("convrot_w4a4", ConvRot-rotated)."""
    formats = {}
    for layer, conf in quant_records(handle, keys, path, rename).items():
        fmt = conf.get("format")
        params = conf.get("params") if isinstance(conf.get("params"), dict) else {}  # ComfyUI reads either place
        if fmt in (INT8_FORMAT, INT4_FORMAT):
            rotated = fmt == INT4_FORMAT or conf.get("convrot", params.get("convrot", False))
            rotation = conf.get("convrot_groupsize", params.get("convrot_groupsize", 256)) if rotated else 0
            if isinstance(rotation, str) and rotation.strip().isdecimal():  # ComfyUI takes it through int()
                rotation = int(rotation)
            if rotated and not is_rotation_group(rotation):  # a group of 0 read as "not rotated" gave unrelated weights
                raise CheckpointError(f"{path.name} rotates '{layer}' in groups of {rotation!r}; ConvRot groups "
                                      "are powers of 4.")
            formats[layer] = (torch.int8, rotation, fmt == INT4_FORMAT)
            continue
        if fmt not in FP8_FORMATS:
            raise CheckpointError(
                f"{path.name} quantizes '{layer}' as {fmt!r}; this loader reads FP8 (float8_e4m3fn / float8_e5m2, "
                "the 'fp8_scaled' files), int8 ('int8_tensorwise', ConvRot-rotated or not), int4 ('convrot_w4a4'), "
                "NVFP4 ('nvfp4') and unquantized H3 files only."
            )
        formats[layer] = (FP8_FORMATS[fmt], 0, False)
    return formats


def quant_records(handle, keys: dict[str, str], path: Path,
                  rename: Callable[[str], str | None] = keymap.strip_prefix) -> dict[str, dict]:
    """Each quantized layer's record (our name -> its JSON, e.g. {"format": "float8_e4m3fn"}), from the
    `X.comfy_quant` tensors among `keys` (ours -> the file's) and the `_quantization_metadata` file metadata;
    where both name a layer the metadata's record is taken, as ComfyUI takes it (its files are made for it)."""
    named: dict[str, dict] = {}
    for name, key in keys.items():
        if name.endswith(".comfy_quant"):
            try:
                conf = json.loads(bytes(handle.get_tensor(key).tolist()).decode("utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError, ValueError, TypeError):
                conf = None
            if not isinstance(conf, dict):
                raise CheckpointError(f"'{key}' in {path.name} is not a JSON quantization record (a uint8 tensor "
                                      "of a JSON object).")
            named[name[: -len(".comfy_quant")]] = conf
    metadata = handle.metadata() or {}
    if "_quantization_metadata" in metadata:
        try:
            for layer, conf in json.loads(metadata["_quantization_metadata"]).get("layers", {}).items():
                if (name := rename(layer)) is not None:
                    named[name] = dict(conf)
        except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
            raise CheckpointError(f"{path.name} has unreadable '_quantization_metadata'.") from None
    return named


@dataclass
class FP8Load:
    """How one load treats FP8: which layers become FP8Linear (kept from the file or quantized as they
    stream in) and which FP8 layers of the file are dequantized; built on the meta model before loading."""

    file_layers: dict[str, FP8Entry]
    kept: set[str]  # FP8 in the file, FP8Linear in the model
    quantized: set[str]  # dense in the file, quantized at load
    dense_dtype: dict[str, torch.dtype]  # FP8 in the file, dequantized at load into this dtype

    @property
    def fp8_parameters(self) -> set[str]:
        return {f"{layer}.{leaf}" for layer in self.kept | self.quantized for leaf in ("weight", "weight_scale")}

    @classmethod
    def plan(cls, model: nn.Module, file_layers: dict[str, FP8Entry], mode: str, dtype: torch.dtype | None,
             fp32_modules: tuple[str, ...], device: torch.device | str = "cpu") -> "FP8Load":
        """Swap FP8Linear into the meta-built `model` where `mode` keeps or makes FP8 linears."""
        device = torch.device(device)
        check_linear_mode(mode, device)
        compute = dtype or torch.bfloat16
        matmul = "scaled" if mode == "fp8-lossy" else "dequantize"
        eligible = storable_linears(model, fp32_modules)
        blocks = set(block_linear_names(model))
        # int8 and e5m2 have no FP8 matmul here: under fp8-lossy such a file's block linears are turned back to
        # `compute` and quantized to e4m3 like a bf16 file's (int8 tensor cores are not used)
        requantized = blocks if mode == "fp8-lossy" else set()
        kept, dense_dtype = set(), {}
        for layer, entry in file_layers.items():
            module = _file_layer(model, layer)
            if layer in requantized and entry.dtype != FP8:
                dense_dtype[layer] = compute
            elif mode != "dense" and layer in eligible and _keepable(module, entry):
                kept.add(layer)  # int8 and e5m2 stay weight-only whatever `matmul` says (FP8Linear.set_matmul)
                layer_matmul = matmul if layer in blocks else "dequantize"  # AdaLN and refiner: weight-only
                model.set_submodule(layer, _held_as_stored(module, entry, compute, layer_matmul))
            else:  # the fp32 heads and anything else a file may hold quantized: dequantized once here
                dense_dtype[layer] = torch.float32 if layer.startswith(fp32_modules) else compute
        quantized = set()
        if mode in ("fp8-lossy", "fp8-weights-lossy"):
            for layer in block_linear_names(model):
                module = model.get_submodule(layer)
                if isinstance(module, StoredLinear):  # kept NVFP4 (nvfp4.NVFP4Load), already smaller
                    continue
                if layer not in kept and (layer not in file_layers or layer in requantized):
                    quantized.add(layer)
                    model.set_submodule(layer, FP8Linear(module.in_features, module.out_features, module.bias is not None,
                                                         True, compute, matmul, device="meta"))
        return cls(file_layers, kept, quantized, dense_dtype)

    @classmethod
    def weight_only(cls, model: nn.Module, file_layers: dict[str, FP8Entry], dtype: torch.dtype) -> "FP8Load":
        """For a model without FP8 modes (the text encoder): every e4m3, e5m2 or int8 linear of the file kept as
        stored (a weight-only FP8Linear computing in `dtype`: a byte a weight), anything else the file
        quantizes dequantized into `dtype` at load."""
        kept, dense_dtype = set(), {}
        for layer, entry in file_layers.items():
            module = _file_layer(model, layer)
            if _keepable(module, entry):
                kept.add(layer)
                model.set_submodule(layer, _held_as_stored(module, entry, dtype, "dequantize"))
            else:
                dense_dtype[layer] = dtype
        return cls(file_layers, kept, set(), dense_dtype)

    def stream(self, items: Iterable, device: torch.device | str) -> Iterator:
        """(name, tensor, where) items in our names -> the model's tensors: FP8 weights as e4m3 with fp32
        scales, dequantized layers as one dense weight, quantized-at-load layers as e4m3 + scale (done on
        `device`, one tensor at a time). Markers and input scales are dropped."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor, where in items:
            layer, _, leaf = name.rpartition(".")
            if name == "scaled_fp8" or (layer in self.file_layers and leaf in DROPPED_LEAVES):
                continue
            if layer in self.quantized and layer not in self.file_layers and leaf == "weight":
                weight, scale = quantize_weight(tensor.to(device))
                yield name, weight, where
                yield f"{layer}.weight_scale", scale, where
                continue
            entry = self.file_layers.get(layer)
            if entry is None or leaf not in ("weight",) + SCALE_LEAVES:
                yield name, tensor, where
                continue
            parts = pending.setdefault(layer, {})
            if leaf == "weight":
                parts["weight"] = tensor.view(entry.dtype) if tensor.dtype == torch.uint8 else tensor
                if not entry.scaled:
                    parts["scale"] = torch.ones(())
            else:
                parts["scale"] = tensor.float().reshape(entry.scale_shape)
            if len(parts) < 2:
                continue
            del pending[layer]
            if layer in self.kept:
                yield f"{layer}.weight", parts["weight"], where
                yield f"{layer}.weight_scale", parts["scale"], where
            else:
                dense = dequantize(parts["weight"].to(device), parts["scale"].to(device), self.dense_dtype[layer],
                                   entry.rotation, entry.packed)
                if layer in self.quantized:  # an int8 or e5m2 block linear under fp8-lossy
                    weight, scale = quantize_weight(dense)
                    yield f"{layer}.weight", weight, where
                    yield f"{layer}.weight_scale", scale, where
                else:
                    yield f"{layer}.weight", dense, where
        for layer, parts in pending.items():
            missing = "its scale" if "weight" in parts else "its weight"
            raise CheckpointError(f"FP8 layer '{layer}' lacks {missing} in the checkpoint.")


def storable_linears(model: nn.Module, fp32_modules: tuple[str, ...]) -> set[str]:
    """The linears a DiT may hold as a file stores them (FP8, int8, int4, NVFP4): the blocks' four, the AdaLN
    projections and the refiner's; never an fp32 module (the curve form's AdaLN too)."""
    refiner = [f"token_refiner.blocks.{i}.{leaf}" for i in range(len(model.token_refiner.blocks)) for leaf in BLOCK_LINEARS]
    return {layer for layer in [*block_linear_names(model, adaln=True), *refiner] if not layer.startswith(fp32_modules)}


def _file_layer(model: nn.Module, layer: str) -> nn.Module:
    try:
        return model.get_submodule(layer)
    except AttributeError:
        raise CheckpointError(f"The checkpoint has quantized weights for '{layer}', which this model does not have.") from None


def _keepable(module: nn.Module, entry: FP8Entry) -> bool:
    """e4m3, e5m2 and int8 weights are held a byte a weight, as ComfyUI holds them (int4 packed in int8)."""
    return entry.dtype in (FP8, torch.float8_e5m2, torch.int8) and isinstance(module, nn.Linear)


def _held_as_stored(module: nn.Linear, entry: FP8Entry, compute: torch.dtype, matmul: str) -> FP8Linear:
    """A meta FP8Linear in place of `module` that holds the file's weight and scale as they are stored."""
    return FP8Linear(module.in_features, module.out_features, module.bias is not None, bool(entry.scale_shape),
                     compute, matmul, weight_dtype=entry.dtype, device="meta", rotation=entry.rotation,
                     packed=entry.packed)
