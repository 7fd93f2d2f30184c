"""Writers for tiny random audio VAE checkpoints in the three on-disk layouts users have.

Every file is made from a diffusers reference model: the original layout with the same tensor names (the
release and diffusers share them, weight norm included) plus the original's two config files; the diffusers
layout by diffusers' own `save_pretrained`; the ComfyUI single file with weight norm folded by torch's own
`remove_weight_norm` (independent of h3_core's folding) and the statistics as tensors.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from diffusers import AutoencoderKLMiniMaxH3Audio
from safetensors.torch import save_file

from h3_core.vae_audio import AudioVAEConfig

# The recipe of h3-model.md J with the released decoder geometry (7 upsamplers, AMP blocks of kernels 3/7/11 at
# dilations 1/3/5: the same 29-frame decode context as the release), 8 heads (the original's fixed count, so the
# original layout can describe it) and 32 latent channels with the released statistics. Hop 800 at 32 kHz.
TINY_AUDIO_VAE = AudioVAEConfig(
    encoder_dim=4, latent_dim=64, latent_channels=32, num_attention_heads=8, decoder_dim=256
)


def reference_audio_vae(config: AudioVAEConfig = TINY_AUDIO_VAE, seed: int = 0) -> AutoencoderKLMiniMaxH3Audio:
    """The diffusers reference with seeded random fp32 weights. Parameters that start as constants (norms,
    biases, Snake alphas, weight-norm magnitudes, the q/v biases) are perturbed so every term is tested."""
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # torch.nn.utils.weight_norm's deprecation notice
        warnings.simplefilter("ignore", FutureWarning)
        model = AutoencoderKLMiniMaxH3Audio(
            encoder_dim=config.encoder_dim,
            encoder_rates=config.encoder_rates,
            latent_dim=config.latent_dim,
            latent_channels=config.latent_channels,
            num_attention_heads=config.num_attention_heads,
            decoder_dim=config.decoder_dim,
            decoder_rates=config.decoder_rates,
            decoder_kernel_sizes=config.decoder_kernel_sizes,
            resblock_kernel_sizes=config.resblock_kernel_sizes,
            resblock_dilation_sizes=config.resblock_dilation_sizes,
            sampling_rate=config.sample_rate,
            latents_mean=list(config.latents_mean),
            latents_std=list(config.latents_std),
        ).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1 or param.shape[1:].numel() == 1 or name.endswith("alpha"):
                param.add_(0.1 * torch.randn_like(param))
    return model


def write_original_partition(root: Path, model: AutoencoderKLMiniMaxH3Audio, partition: str = "FL2VA") -> Path:
    """`root/<partition>/audio_vae/` with config.json, metadata.json and model.safetensors, as released."""
    folder = root / partition / "audio_vae"
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config
    tensors = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(
        json.dumps(
            {
                "latent_channels": config.latent_channels,
                "sample_rate": config.sampling_rate,
                "latents_mean": list(config.latents_mean),
                "latents_std": list(config.latents_std),
            }
        )
    )
    kwargs = {
        "encoder_dim": config.encoder_dim,
        "encoder_rates": list(config.encoder_rates),
        "latent_dim": config.latent_dim,
        "vae_latent_channels": config.latent_channels,
        "decoder_dim": config.decoder_dim,
        "decoder_rates": list(config.decoder_rates),
        "decoder_type": "bigvgan",
        "attn_proj": True,
        "sample_rate": config.sampling_rate,
    }
    (folder / "metadata.json").write_text(json.dumps({"metadata": {"kwargs": kwargs}}))
    (root / partition / "model_index.json").write_text(json.dumps({"_class_name": "MiniMaxH3Pipeline"}))
    return folder


def write_diffusers_folder(folder: Path, model: AutoencoderKLMiniMaxH3Audio) -> Path:
    """diffusers' own writer: config.json + diffusion_pytorch_model.safetensors."""
    model.save_pretrained(str(folder))
    return folder


def comfy_state_dict(model: AutoencoderKLMiniMaxH3Audio) -> dict[str, torch.Tensor]:
    """What ComfyUI's port loads: weight norm folded into plain weights, statistics as tensors, buffers kept."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        folded = AutoencoderKLMiniMaxH3Audio.from_config(model.config)  # a copy: weight-normed modules can't deepcopy
    folded.load_state_dict(model.state_dict())
    for module in folded.modules():
        if hasattr(module, "weight_g"):
            torch.nn.utils.remove_weight_norm(module)
    tensors = {name: tensor.detach().contiguous() for name, tensor in folded.state_dict().items()}
    tensors["latents_mean"] = torch.tensor(model.config.latents_mean, dtype=torch.float32)
    tensors["latents_std"] = torch.tensor(model.config.latents_std, dtype=torch.float32)
    return tensors


def write_comfy_single_file(path: Path, model: AutoencoderKLMiniMaxH3Audio, prefix: str = "", extra=None) -> Path:
    """A ComfyUI single file (`prefix` "audio_vae." for a bundle; `extra` tensors stand for other models)."""
    tensors = {prefix + name: tensor for name, tensor in comfy_state_dict(model).items()}
    save_file({**tensors, **(extra or {})}, str(path))
    return path
