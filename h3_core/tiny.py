"""`tiny-random`: an embedded model with the real structure and tiny sizes, made in memory from a fixed
seed, so every command runs on a fresh CPU machine without weights (and tests need no files)."""

from __future__ import annotations

import torch

from .config import TINY_DIT
from .dit import H3DiT

TINY_RANDOM = "tiny-random"
TINY_SEED = 20261129


def tiny_random_dit(dtype: torch.dtype = torch.float32, device="cpu") -> H3DiT:
    """The tiny DiT with seeded random weights; norms and biases are perturbed too, so every term matters."""
    generator = torch.Generator().manual_seed(TINY_SEED)
    model = H3DiT(TINY_DIT)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            scale = 0.1 if param.ndim == 1 else 1.0 / param.shape[1] ** 0.5
            base = 1.0 if param.ndim == 1 and "norm" in name else 0.0
            param.copy_(base + scale * torch.randn(param.shape, generator=generator))
    return model.set_dtype(dtype).to(device).eval().requires_grad_(False)
