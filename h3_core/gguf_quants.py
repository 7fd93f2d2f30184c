"""GGML tensor types of GGUF diffusion-model files (city96 ComfyUI-GGUF style), dequantized in pure torch.

GGUF weights are held quantized (on the GPU or the CPU) and rebuilt in the compute dtype as they are used, once
per forward. So this is pure torch on whatever device the bytes are on: no numpy, no `.item()`, no Python loops
over data, and traceable by `torch.compile(fullgraph=True)` without graph breaks. Every format is arithmetic on
small integers times fp16 scales, done in float32 in the order GGML's reference does it (so the result equals
`gguf.quants.dequantize` bit for bit), in place where it can (one float32 copy of the weight at a time), and
cast once to the asked dtype at the end.

Storage: a tensor of logical shape [..., n] is row-major, its last dim the fastest GGML dimension, stored as
n / block blocks a row of `bytes per block` bytes each; multi-byte fields are little-endian. In the K-quants a
block is a super-block of 256 weights cut into 16 or 8 sub-blocks that each have a small integer scale (and
minimum) multiplied by the super-block's fp16 `d` (and `dmin`).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

QK_K = 256  # weights per K-quant super-block

BLOCKS: dict[str, tuple[int, int]] = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q8_0": (32, 2 + 32),
    "Q4_0": (32, 2 + 16),
    "Q4_1": (32, 2 + 2 + 16),
    "Q5_0": (32, 2 + 4 + 16),
    "Q5_1": (32, 2 + 2 + 4 + 16),
    "Q2_K": (QK_K, QK_K // 16 + QK_K // 4 + 2 + 2),
    "Q3_K": (QK_K, QK_K // 8 + QK_K // 4 + 12 + 2),
    "Q4_K": (QK_K, 2 + 2 + 12 + QK_K // 2),
    "Q5_K": (QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    "Q6_K": (QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
    "IQ4_NL": (32, 2 + 16),
    "IQ4_XS": (QK_K, 2 + 2 + QK_K // 64 + QK_K // 2),
}
# IQ4_NL / IQ4_XS: what each 4-bit code stands for (a fixed non-linear grid, times the block's scale)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
SUPPORTED: tuple[str, ...] = tuple(BLOCKS)


def _check_type(qtype: str) -> tuple[int, int]:
    if qtype not in BLOCKS:
        raise ValueError(f"unsupported GGML tensor type {qtype!r}; supported: {', '.join(SUPPORTED)}")
    return BLOCKS[qtype]


def byte_shape(shape: tuple[int, ...], qtype: str) -> tuple[int, ...]:
    """The uint8 storage shape of a `qtype` tensor of logical `shape`: last dim // block * bytes per block."""
    block, size = _check_type(qtype)
    shape = tuple(int(dim) for dim in shape)
    if not shape or shape[-1] % block:
        raise ValueError(f"{qtype} stores blocks of {block} weights along the last dim; shape {shape} "
                         f"has a last dim that is not a multiple of {block}")
    return (*shape[:-1], shape[-1] // block * size)


# ---- helpers: `blocks` is contiguous uint8 [n_blocks, bytes per block]; fp16 fields all sit at even offsets
# and every block size is even, so the block rows can be viewed as fp16 words.

def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte `offset` of each block, as float32 [n_blocks, 1]."""
    return blocks.view(torch.float16)[:, offset // 2:offset // 2 + 1].float()


def _shifts(step: int, device: torch.device) -> torch.Tensor:
    """[8 / step, 1]: the bit offsets 0, step, ... of the fields packed `step` bits apart in a byte."""
    return torch.arange(0, 8, step, dtype=torch.uint8, device=device).unsqueeze(-1)


def _unpack(packed: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Split each run of `group` bytes into its `bits`-wide fields, lowest bits first:
    [n, k] -> [n, k / group, 8 / bits, group] (the field at bit `bits * s` of byte j lands at [.., s, j])."""
    n, k = packed.shape
    runs = packed.reshape(n, k // group, 1, group)
    return (runs >> _shifts(bits, packed.device)) & ((1 << bits) - 1)


def _qh_bits(qh: torch.Tensor) -> torch.Tensor:
    """The 32 high bits of a Q5_0/Q5_1 block (a little-endian uint32, bit j for weight j), as uint8 [n, 32]."""
    return _unpack(qh, 1, 1).reshape(qh.shape[0], 32)


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins, float32 [n, 8] each. Bytes 0-3 hold scales
    0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales/mins 4-7 take their low 4 bits from bytes 8-11 (low/high
    nibble) and their top 2 from the spare top 2 bits of bytes 0-3 / 4-7."""
    low_sc, low_m, rest = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([low_sc & 63, (rest & 15) | ((low_sc >> 2) & 48)], dim=-1)
    mins = torch.cat([low_m & 63, (rest >> 4) | ((low_m >> 2) & 48)], dim=-1)
    return scales.float(), mins.float()


# ---- the formats: each maps blocks [n, bytes per block] -> float32 [n, weights per block]

def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0: fp16 d, 32 int8 q; w = q * d."""
    return blocks[:, 2:].view(torch.int8).float().mul_(_f16(blocks, 0))


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0: fp16 d, 16 bytes of nibbles (weight j low nibble of byte j, weight j + 16 the high); w = (q - 8) * d."""
    q = _unpack(blocks[:, 2:], 4, 16).reshape(-1, 32)
    return (q.to(torch.int8) - 8).float().mul_(_f16(blocks, 0))


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1: fp16 d, fp16 m, 16 bytes of nibbles laid out as Q4_0; w = q * d + m."""
    q = _unpack(blocks[:, 4:], 4, 16).reshape(-1, 32)
    return q.float().mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_0: fp16 d, 4 bytes of 5th bits (a little-endian uint32, bit j for weight j), 16 bytes of low nibbles
    laid out as Q4_0; w = (q - 16) * d."""
    q = _unpack(blocks[:, 6:], 4, 16).reshape(-1, 32) | (_qh_bits(blocks[:, 2:6]) << 4)
    return (q.to(torch.int8) - 16).float().mul_(_f16(blocks, 0))


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_1: fp16 d, fp16 m, 4 bytes of 5th bits and 16 bytes of low nibbles laid out as Q5_0; w = q * d + m."""
    q = _unpack(blocks[:, 8:], 4, 16).reshape(-1, 32) | (_qh_bits(blocks[:, 4:8]) << 4)
    return q.float().mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q2_K: 16 scale bytes (low nibble scale, high nibble min, one per 16 weights), 64 bytes of 2-bit q (each
    half of 128 weights is 32 bytes read at bits 0, 2, 4, 6 in turn), fp16 d, fp16 dmin;
    w = (d * scale) * q - dmin * min."""
    packed = blocks[:, :16]
    q = _unpack(blocks[:, 16:80], 2, 32).reshape(-1, 16, 16).float()
    scale = (_f16(blocks, 80) * (packed & 15).float()).unsqueeze(-1)
    low = (_f16(blocks, 82) * (packed >> 4).float()).unsqueeze(-1)
    return q.mul_(scale).sub_(low).reshape(-1, QK_K)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q3_K: 32 bytes of high-bit mask (weight 32g + j: bit g of byte j), 64 bytes of low 2 bits laid out as Q2_K,
    12 bytes of 16 six-bit scales (offset by 32), fp16 d; q = low - 4 where the mask bit is clear (not set),
    w = (d * scale) * q."""
    n = blocks.shape[0]
    low = _unpack(blocks[:, 32:96], 2, 32).reshape(n, QK_K).to(torch.int8)
    high = _unpack(blocks[:, :32], 1, 32).reshape(n, QK_K).to(torch.int8)
    q = (low - 4 + 4 * high).reshape(n, 16, 16).float()
    packed = blocks[:, 96:108]
    # scale i: low 4 bits from byte i % 8 (low nibble for i < 8, high for i >= 8), top 2 bits from byte 8 + i % 4
    # at bit 2 * (i // 4)
    low4 = _unpack(packed[:, :8], 4, 8).reshape(n, 16)
    top2 = _unpack(packed[:, 8:], 2, 4).reshape(n, 16)
    scales = ((low4 | (top2 << 4)).to(torch.int8) - 32).float()
    return q.mul_((_f16(blocks, 108) * scales).unsqueeze(-1)).reshape(n, QK_K)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K: fp16 d, fp16 dmin, 12 bytes of 8 six-bit scales and mins (one per 32 weights), 128 bytes of nibbles
    (sub-blocks 2i and 2i + 1 are the low and high nibbles of bytes 32i..32i + 31); w = (d * scale) * q - dmin * min."""
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    q = _unpack(blocks[:, 16:], 4, 32).reshape(-1, 8, 32).float()
    scale = (_f16(blocks, 0) * scales).unsqueeze(-1)
    low = (_f16(blocks, 2) * mins).unsqueeze(-1)
    return q.mul_(scale).sub_(low).reshape(-1, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K: fp16 d, fp16 dmin, 12 bytes of scales and mins as Q4_K, 32 bytes of 5th bits (sub-block g: bit g of
    byte j), 128 bytes of low nibbles laid out as Q4_K; w = (d * scale) * q - dmin * min."""
    n = blocks.shape[0]
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    high = _unpack(blocks[:, 16:48], 1, 32).reshape(n, 8, 32)
    q = (_unpack(blocks[:, 48:], 4, 32).reshape(n, 8, 32) | (high << 4)).float()
    scale = (_f16(blocks, 0) * scales).unsqueeze(-1)
    low = (_f16(blocks, 2) * mins).unsqueeze(-1)
    return q.mul_(scale).sub_(low).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K: 128 bytes of low nibbles (each half of 128 weights: 64 bytes, low nibbles then high), 64 bytes of top
    2 bits (each half: 32 bytes at bits 0, 2, 4, 6), 16 int8 scales (one per 16 weights), fp16 d;
    w = (d * scale) * (q - 32)."""
    n = blocks.shape[0]
    low = _unpack(blocks[:, :128], 4, 64).reshape(n, QK_K)
    high = _unpack(blocks[:, 128:192], 2, 32).reshape(n, QK_K)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    scales = blocks[:, 192:208].view(torch.int8).float()
    return q.mul_((_f16(blocks, 208) * scales).unsqueeze(-1)).reshape(n, QK_K)


def _iq4_grid(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes -> their IQ4 grid values, float32. An embedding lookup takes int32 codes as they are (indexing
    would widen them to int64: 8 more bytes a weight while a weight is rebuilt)."""
    grid = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=codes.device).unsqueeze(-1)
    return F.embedding(codes.int(), grid).squeeze(-1)


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    """IQ4_NL: fp16 d, 16 bytes of nibbles laid out as Q4_0; w = d * grid[q]."""
    return _iq4_grid(_unpack(blocks[:, 2:], 4, 16).reshape(-1, 32)).mul_(_f16(blocks, 0))


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    """IQ4_XS: fp16 d, a little-endian uint16 of the 8 sub-block scales' top 2 bits (sub-block i at bit 2i), 4 bytes
    of their low 4 bits (sub-block i: byte i // 2, low nibble first), 128 bytes of nibbles (each 32-weight
    sub-block 16 bytes, laid out as Q4_0); w = (d * (scale - 32)) * grid[q]."""
    n = blocks.shape[0]
    high = _unpack(blocks[:, 2:4], 2, 1).reshape(n, 8)
    low = _unpack(blocks[:, 4:8], 4, 1).reshape(n, 8)
    scales = ((low | (high << 4)).to(torch.int8) - 32).float()
    q = _iq4_grid(_unpack(blocks[:, 8:], 4, 16).reshape(n, 8, 32))
    return q.mul_((_f16(blocks, 0) * scales).unsqueeze(-1)).reshape(n, QK_K)


_QUANTIZED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs,
}
PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}  # stored as the dtype itself


def dequantize(raw: torch.Tensor, qtype: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The `qtype` tensor whose stored bytes are `raw` (uint8, any shape holding prod(byte_shape(shape, qtype))
    bytes), as a `dtype` tensor of `shape` on raw's device."""
    block, size = _check_type(qtype)
    shape = tuple(int(dim) for dim in shape)
    stored = math.prod(byte_shape(shape, qtype))
    if raw.dtype != torch.uint8:
        raise ValueError(f"{qtype} tensor bytes must be uint8, got {raw.dtype}")
    if raw.numel() != stored:
        raise ValueError(f"a {qtype} tensor of shape {shape} is stored in {stored} bytes "
                         f"{byte_shape(shape, qtype)}, got {raw.numel()} bytes {tuple(raw.shape)}")
    blocks = raw.contiguous().reshape(-1, size)
    if qtype in PLAIN:
        return blocks.view(PLAIN[qtype]).reshape(shape).to(dtype)
    return _QUANTIZED[qtype](blocks).reshape(shape).to(dtype)
