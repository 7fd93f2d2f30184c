"""`tiny-random`: an embedded model with the real structure and tiny sizes, made in memory from a fixed
seed, so every command runs on a fresh CPU machine without weights (and tests need no files)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .config import TINY_DIT
from .dit import H3DiT

if TYPE_CHECKING:  # built on demand below: a DiT-only user never imports the VAEs
    from .vae_audio import AudioVAE
    from .vae_video import VideoVAE

TINY_RANDOM = "tiny-random"
TINY_SEED = 20261129


def seeded_random_weights(model: torch.nn.Module, seed: int, gain: float = 1.0) -> torch.nn.Module:
    """Seeded values for every parameter, whatever its constructor left (some are `empty`, waiting for a
    checkpoint): matrices ~ N(0, gain^2/fan_in), scales near 1, log-scales and biases near 0. Buffers made
    by the architecture (filters) are kept; empty stored ones (zero biases) become zeros."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            leaf = name.rsplit(".", 1)[-1]
            if param.ndim >= 2 and param.shape[0] > 1:  # linear / conv weights (Snake alphas are [1, C, 1])
                value = gain * noise / param[0].numel() ** 0.5
            elif leaf in ("weight", "scale1", "scale2") or (leaf == "alpha" and param.ndim == 3):
                value = 1.0 + 0.1 * noise  # norm gains, layer scales, Snake frequencies
            else:
                value = 0.02 * noise  # biases, SnakeBeta log-scales, register tokens
            param.copy_(value)
        for name, buffer in model.named_buffers():
            if name.endswith("zero_k_bias"):
                buffer.zero_()
    return model


def own_random_state():
    """Building a module draws its default initialization from torch's global generator; the tiny models are
    then seeded over, so they leave a caller's random sequence as it was."""
    return torch.random.fork_rng(devices=[])


def tiny_model_dtype(device, requested: torch.dtype | None) -> torch.dtype:
    """The dtype the tiny random model computes in: float32 on the CPU (bf16 kernels there are slow, and it
    needs none), else the requested one (bf16 when none is). A request that is no dtype is refused as the
    checkpoint readers refuse it, so a script finds it before it has real weights."""
    if requested is not None and not (isinstance(requested, torch.dtype) and requested.is_floating_point):
        raise ValueError(f"dtype is a floating point torch dtype (torch.bfloat16, torch.float16, torch.float32) or "
                         f"None; got {requested!r}.")
    return torch.float32 if torch.device(device).type == "cpu" else (requested or torch.bfloat16)


def tiny_random_dit(dtype: torch.dtype = torch.float32, device="cpu") -> H3DiT:
    """The tiny DiT with seeded random weights; norms and biases are perturbed too, so every term matters."""
    with own_random_state():
        model = seeded_random_weights(H3DiT(TINY_DIT), TINY_SEED).set_dtype(dtype)
    return model.to(device).eval().requires_grad_(False)


def tiny_random_video_vae(device="cpu") -> "VideoVAE":
    """The video VAE at a tiny width that keeps the real 16x spatial / 4x temporal factors."""
    from .vae_video import TINY_VIDEO_VAE, VideoVAE

    with own_random_state():
        model = seeded_random_weights(VideoVAE(TINY_VIDEO_VAE), TINY_SEED + 1)
    return model.to(device).eval().requires_grad_(False)


def tiny_audio_vae_config():
    """The tiny audio VAE's sizes (the release's rates and hop)."""
    from .vae_audio import AudioVAEConfig

    return AudioVAEConfig(encoder_dim=4, latent_dim=64, latent_channels=32, num_attention_heads=8, decoder_dim=256)


def tiny_random_audio_vae(device="cpu") -> "AudioVAE":
    """The audio VAE at a tiny width that keeps hop 800 (40 latents per second at 32 kHz)."""
    from .vae_audio import AudioVAE

    # gain 0.5 keeps the random decoder out of its chaotic, clipped regime (a quiet but faithful signal)
    with own_random_state():
        model = seeded_random_weights(AudioVAE(tiny_audio_vae_config()), TINY_SEED + 2, gain=0.5)
    return model.to(device).eval().requires_grad_(False)
