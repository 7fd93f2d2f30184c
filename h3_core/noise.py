"""Initial noise, drawn exactly as the diffusers pipeline draws it for the same seed.

One CPU generator per request, one `torch.randn` per tensor, in this order: each visual condition
(packed order; added with conditioning), the target video as a [1, C, L, h, w] latent, then the
target audio directly as [2A, Ca] channel-major rows. Drawing on the CPU makes a seed give the same
noise on every device.
"""

from __future__ import annotations

import numbers

import torch

from .config import DiTConfig
from .layout import VISUAL_CONDITION_T, PackedLayout, patchify


MAX_SEED = 2**64 - 1  # what torch's generator (and ComfyUI's seed widget) takes
# torch's CPU generator (a Mersenne Twister) is seeded from a seed's low 32 bits: faithful to diffusers, which draws
# the same way, and to ComfyUI's own samplers; said wherever a seed is asked for
SEED_BITS = ("Only a seed's low 32 bits set the noise: seeds 2^32 apart draw the same (as in diffusers and ComfyUI's "
             "own samplers).")


def check_seeds(seed: int, count: int = 1) -> None:
    """Seeds seed .. seed + count - 1 must all be generator seeds: checked before any model runs. Only a seed's
    low 32 bits set the noise (torch's CPU generator, as in diffusers and ComfyUI's samplers)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed <= MAX_SEED - (count - 1):
        last = f" (and seed + {count - 1} for {count} outputs)" if count > 1 else ""
        raise ValueError(f"seed must be an integer from 0 to {MAX_SEED}{last}; got {seed!r}.")


def request_generator(seed: int) -> torch.Generator:
    check_seeds(seed)
    return torch.Generator("cpu").manual_seed(int(seed))


def target_noise(
    layout: PackedLayout, generator: torch.Generator, latent_channels: int = DiTConfig.in_channels,
    audio_latent_channels: int = DiTConfig.audio_in_channels,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise for the generated rows: video [1, Nv_target, C*4] and audio [1, 2A, Ca], fp32 on the CPU (no draw
    for a modality the layout holds fixed)."""
    frames = layout.latent_frames if layout.target_video_indices.numel() else 0
    video = torch.randn(
        (1, latent_channels, frames, layout.latent_height, layout.latent_width),
        generator=generator,
        dtype=torch.float32,
    )
    channels = layout.target_audio_indices.numel() // layout.audio_latents
    audio = torch.randn((channels * layout.audio_latents, audio_latent_channels), generator=generator, dtype=torch.float32)
    return patchify(video), audio[None]


def condition_rows(latents: list[torch.Tensor], generator: torch.Generator) -> torch.Tensor:
    """Visual conditions [1, C, L_i, h_i, w_i] (packed order) -> their rows [1, N, C*4], each mixed once to
    x = t*z + (1-t)*noise at t = VISUAL_CONDITION_T with one draw per condition from the request generator (before
    the target's)."""
    packed = []
    for condition in latents:
        noise = torch.randn(condition.shape, generator=generator, dtype=torch.float32)
        level = torch.tensor(VISUAL_CONDITION_T, dtype=torch.float32)
        packed.append(patchify(level * condition.float().cpu() + (1.0 - level) * noise))
    return torch.cat(packed, dim=1)
