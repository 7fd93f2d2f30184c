"""Rotate-half rotary embedding, shared by the DiT and the video VAE decoder (both rotate only the
leading channels of each head and pass the rest through)."""

from __future__ import annotations

import torch


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first cos.shape[-1] channels of each head; the rest pass through. x: [B, S, H, D]."""
    width = cos.shape[-1]
    cos = cos.to(x.dtype)[None, :, None, :]
    sin = sin.to(x.dtype)[None, :, None, :]
    rotary, rest = x[..., :width], x[..., width:]
    first, second = rotary.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return torch.cat([rotary * cos + rotated * sin, rest], dim=-1)
