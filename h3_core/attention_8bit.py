"""Lossy 8-bit attention (backend "int8qk-fp8pv-lossy"): a Triton flash-attention forward with both
matmuls on 8-bit tensor cores (Hopper / Ada; twice the bf16 rate), for the opt-in fast path. Exact
attention stays the default.

Quantization, chosen so every scale comes out of the inner loop or costs one multiply:
- Q: int8, one scale per row (token, head); softmax's 1/sqrt(d) and log2(e) are folded into it.
- K: the mean over the sequence is first subtracted per head and channel (SageAttention's smoothing:
  it shifts every score of a query row by the same amount, which softmax ignores), then int8, one scale
  per row. (int8 keeps 7 bits for QK, where e4m3's 3 mantissa bits cost visibly more.)
- P (the probabilities, in [0, 1]) is cast to e4m3 directly, as FlashAttention-3's FP8 path does.
- V: one scale per head and channel over the sequence, applied to the output; V is stored transposed
  ([B, H, D, S]) so the P.V product reads it in the K-major order the FP8 tensor cores need.
Inputs and output are [batch, rows, heads, head_dim] like every backend in attention.py.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
LOG2_E = 1.4426950408889634
# Tile shape and pipelining of the attention kernel (bench/fp8_bench.py sweeps these on the GPU).
KERNEL_CONFIG = {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3}


@triton.jit
def _quantize_rows(X, Mean, Out, Scale, S, H, sx_b, sx_s, sx_h, multiplier,
                   D: tl.constexpr, BLOCK: tl.constexpr, CENTER: tl.constexpr):
    """Rows of one head -> int8 (round to nearest) with one fp32 scale per row (after subtracting
    Mean[b, h, :] if CENTER)."""
    b, h = tl.program_id(2).to(tl.int64), tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, D)
    inside = rows[:, None] < S
    x = tl.load(X + b * sx_b + h * sx_h + rows[:, None] * sx_s + d[None, :], mask=inside, other=0.0).to(tl.float32)
    if CENTER:
        x = x - tl.load(Mean + (b * H + h) * D + d)[None, :]
    x = x * multiplier
    scale = tl.maximum(tl.max(tl.abs(x), 1) / 127.0, 1e-12)
    x = x / scale[:, None]
    q = tl.clamp(tl.where(x >= 0, x + 0.5, x - 0.5), -127.0, 127.0).to(tl.int8)  # the cast truncates
    out = (b * S * H + rows[:, None] * H + h) * D + d[None, :]  # contiguous [B, S, H, D]
    tl.store(Out + out, q, mask=inside)
    tl.store(Scale + (b * S + rows) * H + h, scale, mask=rows < S)


@triton.jit
def _quantize_columns_transposed(X, Scale, Out, S, H, sx_b, sx_s, sx_h, D: tl.constexpr, BLOCK: tl.constexpr):
    """V of one head -> e4m3 with the given per-channel scales, written transposed: Out[b, h, d, s]."""
    b, h = tl.program_id(2).to(tl.int64), tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, D)
    inside = rows[:, None] < S
    x = tl.load(X + b * sx_b + h * sx_h + rows[:, None] * sx_s + d[None, :], mask=inside, other=0.0).to(tl.float32)
    scale = tl.load(Scale + (b * H + h) * D + d)
    q = tl.clamp(x / scale[None, :], -448.0, 448.0).to(tl.float8e4nv)
    tl.store(Out + ((b * H + h) * D + d[None, :]) * S + rows[:, None], q, mask=inside)


@triton.jit
def _attention(Q, QS, K, KS, V, VS, O, S, FULL, H, so_b, so_s, so_h,
               D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One (row block, head, batch) program: online softmax over all keys, FP8 products, fp32 state.
    FULL = the rows in whole key blocks (S rounded down to BLOCK_N)."""
    b, h = tl.program_id(2).to(tl.int64), tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    q = tl.load(Q + ((b * S + rows[:, None]) * H + h) * D + d[None, :], mask=rows[:, None] < S, other=0.0)
    q_scale = tl.load(QS + (b * S + rows) * H + h, mask=rows < S, other=0.0)
    k_base = K + (b * S * H + h) * D  # K[b, s, h, :] at k_base + s * H * D
    ks_base = KS + b * S * H + h
    v_base = V + (b * H + h) * D * S  # V^T[b, h, :, s] at v_base + d * S + s
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(0, FULL, BLOCK_N):  # whole key blocks: no masks
        keys = start + cols
        k = tl.load(k_base + keys[None, :] * (H * D) + d[:, None])
        scores = tl.dot(q, k).to(tl.float32) * q_scale[:, None] * tl.load(ks_base + keys * H)[None, :]
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.math.exp2(scores - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + d[None, :] * S + keys[:, None])
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float8e4nv), v)
        m_i = m_new
    if FULL < S:  # the last, partial key block
        keys = FULL + cols
        inside = keys < S
        k = tl.load(k_base + keys[None, :] * (H * D) + d[:, None], mask=inside[None, :], other=0.0)
        k_scale = tl.load(ks_base + keys * H, mask=inside, other=0.0)
        scores = tl.dot(q, k).to(tl.float32) * q_scale[:, None] * k_scale[None, :]
        scores = tl.where(inside[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.math.exp2(scores - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + d[None, :] * S + keys[:, None], mask=inside[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float8e4nv), v)
    v_scale = tl.load(VS + (b * H + h) * D + d)
    out = acc / l_i[:, None] * v_scale[None, :]
    tl.store(O + b * so_b + h * so_h + rows[:, None] * so_s + d[None, :], out.to(O.dtype.element_ty), mask=rows[:, None] < S)


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int = 64):
    """[B, S, H, D] bf16 -> int8 Q, K ([B, S, H, D]) with row scales [B, S, H] (Q's carrying
    log2(e)/sqrt(D)), e4m3 V^T [B, H, D, S] with channel scales [B, H, D]."""
    batch, rows, heads, dim = q.shape
    grid = (triton.cdiv(rows, block), heads, batch)
    fp8 = torch.float8_e4m3fn
    q8, k8 = torch.empty(q.shape, dtype=torch.int8, device=q.device), torch.empty(k.shape, dtype=torch.int8, device=k.device)
    v8 = torch.empty(batch, heads, dim, rows, dtype=fp8, device=v.device)
    q_scale = torch.empty(batch, rows, heads, dtype=torch.float32, device=q.device)
    k_scale = torch.empty_like(q_scale)
    k_mean = k.mean(dim=1, dtype=torch.float32).contiguous()  # [B, H, D]
    v_scale = (torch.linalg.vector_norm(v, float("inf"), dim=1).float() / FP8_MAX).clamp_(min=1e-12).contiguous()
    _quantize_rows[grid](q, k_mean, q8, q_scale, rows, heads, q.stride(0), q.stride(1), q.stride(2),
                         LOG2_E / math.sqrt(dim), D=dim, BLOCK=block, CENTER=False)
    _quantize_rows[grid](k, k_mean, k8, k_scale, rows, heads, k.stride(0), k.stride(1), k.stride(2),
                         1.0, D=dim, BLOCK=block, CENTER=True)
    _quantize_columns_transposed[grid](v, v_scale, v8, rows, heads, v.stride(0), v.stride(1), v.stride(2),
                                       D=dim, BLOCK=block)
    return q8, q_scale, k8, k_scale, v8, v_scale


@torch.compiler.disable  # inside compiled blocks: a clean graph break around the hand-written kernels
def int8qk_fp8pv_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **config) -> torch.Tensor:
    """Full, unmasked attention with scale 1/sqrt(D); [B, S, H, D] in and out (lossy, see the module
    docstring). `config` overrides KERNEL_CONFIG."""
    config = {**KERNEL_CONFIG, **config}
    block_m, block_n = config["block_m"], config["block_n"]
    if query.shape != key.shape or key.shape != value.shape or query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("8-bit attention needs q, k, v of one shape [B, S, H, D] with a contiguous last dimension.")
    batch, rows, heads, dim = query.shape
    if dim not in (64, 128, 256):
        raise ValueError(f"8-bit attention supports head_dim 64, 128 or 256, got {dim}.")
    q8, q_scale, k8, k_scale, v8, v_scale = quantize_qkv(query, key, value)
    out = torch.empty_like(query)
    grid = (triton.cdiv(rows, block_m), heads, batch)
    _attention[grid](q8, q_scale, k8, k_scale, v8, v_scale, out, rows, rows // block_n * block_n, heads,
                     out.stride(0), out.stride(1), out.stride(2), D=dim, BLOCK_M=block_m, BLOCK_N=block_n,
                     num_warps=config["num_warps"], num_stages=config["num_stages"])
    return out
