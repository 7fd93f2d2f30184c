"""Attention behind one call, so backends can be swapped without touching the model.

H3 packs one request into a single attention document: full, bidirectional, unmasked, scale
1/sqrt(head_dim). Inputs and output are [batch, rows, heads, head_dim].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BACKENDS = ("sdpa",)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, backend: str = "sdpa") -> torch.Tensor:
    """Full self-attention over the packed sequence; [B, S, H, D] in and out."""
    if backend != "sdpa":
        raise ValueError(f"Unknown attention backend {backend!r}; available: {', '.join(BACKENDS)}.")
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), dropout_p=0.0, is_causal=False
    )
    return out.transpose(1, 2)
