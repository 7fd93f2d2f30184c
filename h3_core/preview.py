"""Cheap latent previews: one latent frame [C, h, w] -> a small RGB picture, no VAE involved.

With `factors` [C, 3] (and `bias` [3]) the frame is projected linearly to RGB in -1..1 (the usual
"latent to RGB" table a host may know for this VAE). Without them a false-colour picture shows the
frame's three main channel directions (PCA), each stretched to 0..255: it shows layout and motion, not
true colours, and needs no table.
"""

from __future__ import annotations

import numpy as np
import torch


def latent_rgb(frame: torch.Tensor, factors=None, bias=None) -> np.ndarray:
    """[C, h, w] latent frame -> uint8 [h, w, 3]."""
    if frame.ndim != 3:
        raise ValueError(f"A preview takes one latent frame [C, h, w]; got {list(frame.shape)}.")
    channels, height, width = frame.shape
    # a run gone NaN or infinite previews black where it did (the sampler then says what went wrong)
    pixels = torch.nan_to_num(frame.detach().float().cpu().reshape(channels, -1).T, nan=0.0, posinf=0.0, neginf=0.0)
    if factors is not None:
        matrix = torch.as_tensor(factors, dtype=torch.float32)
        if matrix.shape != (channels, 3):
            raise ValueError(f"Preview factors must be [{channels}, 3]; got {list(matrix.shape)}.")
        rgb = pixels @ matrix
        if bias is not None:
            rgb = rgb + torch.as_tensor(bias, dtype=torch.float32)
        rgb = ((rgb + 1.0) / 2.0).clamp(0.0, 1.0)
    else:
        centred = pixels - pixels.mean(dim=0)
        # the axes of the frame scaled to 1: a diverging run's 1e19 values square to inf
        unit = centred / centred.abs().max().clamp_min(torch.finfo(torch.float32).tiny)
        _, vectors = torch.linalg.eigh(unit.T @ unit)  # ascending eigenvalues
        axes = vectors[:, -3:].flip(-1)
        axes = axes * torch.where(axes.sum(dim=0) < 0, -1.0, 1.0)  # a fixed sign, so colours do not flip per step
        rgb = centred @ axes
        low, high = rgb.min(dim=0).values, rgb.max(dim=0).values
        rgb = (rgb - low) / (high - low).clamp_min(1e-6)
    return (rgb * 255.0).round().to(torch.uint8).reshape(height, width, 3).numpy()
