"""q and k of an attention call normalized (per-head RMSNorm) and rotated (rotate-half RoPE) in one pass.

Used by compiled blocks on CUDA. There Inductor ran this step as two reductions and a pointwise kernel,
2.2 ms a block at 38k rows on an H200, about a third of the memory bandwidth; one Triton kernel reads
q and k once and writes them once. Inside it everything is float32 with one rounding at the end, so
it equals the eager path up to bf16 rounding, like the compiled block it serves.

    qkv   [B, S, 3 * H * D]  the fused projection's output ([q heads | k heads | v heads])
    cos, sin [S, R]          RoPE tables (R <= D rotated channels, halves paired as in rope.apply_rope)
    ->    q [B, Sq, H, D], k [B, S, H, D]  contiguous; q's rows past S (Sq >= S) are zeros

Sq > S writes q straight into the zero-padded buffer FlashAttention 3 wants (attention.flash3_query_rows),
which saves copying q there: 9-24 ms of a compiled 124-frame forward on an H200 (bench/RESULTS.md).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the compiled blocks keep Inductor's kernels
    triton = None


def available(qkv: torch.Tensor, head_dim: int) -> bool:
    """Whether the kernel can run here: Triton, a contiguous CUDA tensor, a power-of-two head size."""
    return triton is not None and qkv.is_cuda and qkv.is_contiguous() and head_dim & (head_dim - 1) == 0


def qk_norm_rope_reference(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor, heads: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's arithmetic in torch (float32 inside, one rounding): what the kernel is tested against."""
    batch, rows, _ = qkv.shape
    q, k = qkv.view(batch, rows, 3, heads, -1).float().unbind(2)[:2]
    width, half = cos.shape[-1], cos.shape[-1] // 2
    cos, sin = cos.float()[None, :, None, :], sin.float()[None, :, None, :]

    def one(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        rotary, rest = x[..., :width], x[..., width:]
        rotated = torch.cat([-rotary[..., half:], rotary[..., :half]], dim=-1)
        return torch.cat([rotary * cos + rotated * sin, rest], dim=-1).to(qkv.dtype)

    return one(q, q_weight), one(k, k_weight)


if triton is not None:

    @triton.jit
    def _norm_rope(QKV, Wq, Wk, Cos, Sin, Q, K, total_rows, rows_per_batch, q_rows_per_batch, eps,
                   H: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr):
        """One program: BLOCK rows of one head of q (axis 2 = 0) or k (1)."""
        head, which = tl.program_id(1), tl.program_id(2)
        rows = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        d = tl.arange(0, D)
        inside = rows[:, None] < total_rows
        partner = tl.where(d < HALF, d + HALF, tl.where(d < 2 * HALF, d - HALF, d))
        source = QKV + rows[:, None] * (3 * H * D) + which * H * D + head * D
        x = tl.load(source + d[None, :], mask=inside, other=0.0).to(tl.float32)
        x_partner = tl.load(source + partner[None, :], mask=inside, other=0.0).to(tl.float32)
        if which == 0:
            w, w_partner = tl.load(Wq + d).to(tl.float32), tl.load(Wq + partner).to(tl.float32)
        else:
            w, w_partner = tl.load(Wk + d).to(tl.float32), tl.load(Wk + partner).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
        rotating = inside & (d[None, :] < 2 * HALF)
        table = (rows % rows_per_batch)[:, None] * (2 * HALF) + d[None, :]
        cos = tl.load(Cos + table, mask=rotating, other=1.0).to(tl.float32)
        sin = tl.load(Sin + table, mask=rotating, other=0.0).to(tl.float32)
        sign = tl.where(d < HALF, -1.0, 1.0)[None, :]
        y = x * rstd * w[None, :] * cos + sign * (x_partner * rstd * w_partner[None, :]) * sin
        if which == 0:
            q_rows = rows // rows_per_batch * q_rows_per_batch + rows % rows_per_batch
            tl.store(Q + (q_rows[:, None] * H + head) * D + d[None, :], y.to(Q.dtype.element_ty), mask=inside)
        else:
            tl.store(K + (rows[:, None] * H + head) * D + d[None, :], y.to(K.dtype.element_ty), mask=inside)


@torch.library.custom_op("h3::qk_norm_rope", mutates_args=())
def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, heads: int, eps: float, query_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring; one opaque op, so torch.compile calls the kernel as it is."""
    batch, rows, width = qkv.shape
    dim = width // (3 * heads)
    if not qkv.is_contiguous() or cos.shape != sin.shape or cos.shape[0] != rows or cos.shape[1] % 2 or cos.shape[1] > dim:
        raise ValueError(f"qk_norm_rope needs a contiguous qkv [B, S, 3*H*D] and cos/sin [S, R<=D]; got qkv "
                         f"{list(qkv.shape)}, cos {list(cos.shape)}, sin {list(sin.shape)}.")
    if query_rows < rows:
        raise ValueError(f"qk_norm_rope: query_rows ({query_rows}) must be at least the {rows} rows of qkv.")
    q = torch.empty(batch, query_rows, heads, dim, dtype=qkv.dtype, device=qkv.device)
    q[:, rows:].zero_()
    k = torch.empty(batch, rows, heads, dim, dtype=qkv.dtype, device=qkv.device)
    block = 16  # x 8 warps: 0.815 ms at 38,222 rows x 56 heads on an H200, 32 x 4 took 0.864 (bench/RESULTS.md)
    grid = (triton.cdiv(batch * rows, block), heads, 2)
    _norm_rope[grid](qkv, q_weight, k_weight, cos.contiguous(), sin.contiguous(), q, k, batch * rows, rows, query_rows,
                     eps, H=heads, D=dim, HALF=cos.shape[1] // 2, BLOCK=block, num_warps=8)
    return q, k


@qk_norm_rope.register_fake
def _(qkv, q_weight, k_weight, cos, sin, heads, eps, query_rows):
    batch, rows, width = qkv.shape
    dim = width // (3 * heads)
    return qkv.new_empty(batch, query_rows, heads, dim), qkv.new_empty(batch, rows, heads, dim)
