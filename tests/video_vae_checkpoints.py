"""Tiny random video VAE checkpoints in the three on-disk layouts users have.

The reference is diffusers' `AutoencoderKLMiniMaxH3`. The original-layout writer maps its names back
to the release's with its own table (written from h3-model.md B.2, independent of
h3_core.vae_video_checkpoint), so loading these files tests our mapping rather than repeating it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import AutoencoderKLMiniMaxH3
from safetensors.torch import save_file

from h3_core.vae_video import TINY_VIDEO_VAE, VideoVAEConfig

# Our config fields that diffusers' config does not have (the release wrapper's tiling settings).
_WRAPPER_ONLY = ("tile_size", "tile_min_overlap", "encoder_tiling", "decoder_tiling")


def tiny_config(seed: int = 0, **changes) -> VideoVAEConfig:
    """The tiny config with per-seed latent statistics (not the release's, so a loader that ignored
    the checkpoint's statistics would be caught)."""
    generator = torch.Generator().manual_seed(seed)
    channels = TINY_VIDEO_VAE.latent_channels
    mean = (torch.randn(channels, generator=generator) * 0.5).tolist()
    std = (0.5 + torch.rand(channels, generator=generator)).tolist()
    return TINY_VIDEO_VAE.replace(latents_mean=tuple(mean), latents_std=tuple(std), **changes)


def diffusers_kwargs(config: VideoVAEConfig) -> dict:
    fields = {name: getattr(config, name) for name in VideoVAEConfig.__dataclass_fields__}
    return {name: value for name, value in fields.items() if name not in _WRAPPER_ONLY}


def reference_video_vae(config: VideoVAEConfig, seed: int = 0) -> AutoencoderKLMiniMaxH3:
    """diffusers' model with seeded random weights (fp32). The zero-initialized layer scales and
    register tokens and the unit norms get random values too, so every term reaches the output."""
    torch.manual_seed(seed)
    model = AutoencoderKLMiniMaxH3(**diffusers_kwargs(config)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("scale1", "scale2", "register_tokens")):
                param.copy_(0.5 * torch.randn_like(param))
            elif param.ndim == 1:
                param.add_(0.1 * torch.randn_like(param))
    return model


def original_name(key: str) -> str:
    """A diffusers key -> the release's key (B.2), for every key except the split q/k/v."""
    parts = key.split(".")
    if parts[:2] == ["encoder", "down_blocks"]:
        level, kind = parts[2], parts[3]
        if kind == "resnets":  # encoder.down_blocks.i.resnets.j.X -> encoder.down.i.block.j.X
            tail = ["nin_shortcut" if p == "conv_shortcut" else p for p in parts[5:]]
            parts = ["encoder", "down", level, "block", parts[4], *tail]
        else:  # encoder.down_blocks.i.downsamplers.0.conv.X -> encoder.down.i.downsample.conv.X
            parts = ["encoder", "down", level, "downsample", *parts[5:]]
    key = ".".join(parts)
    for old, new in (
        ("decoder.proj_in.", "decoder.x_embedder."),
        (".attn.to_out.0.", ".attn.to_out."),
        (".ff.net.0.proj.", ".ff.w1."),
        (".ff.net.2.", ".ff.w2."),
    ):
        key = key.replace(old, new)
    return key


def original_state_dict(diffusers_sd: dict, config: VideoVAEConfig) -> dict:
    """The release's tensor set: to_qkv fused per head [h: q k v], ff.w1 as [gate; up], plus the
    training-only `decoder.mask_token`."""
    heads, head_dim = config.decoder_num_attention_heads, config.decoder_attention_head_dim
    out = {}
    for key, tensor in diffusers_sd.items():
        if ".attn.to_k." in key or ".attn.to_v." in key:
            continue
        if ".attn.to_q." in key:
            stem, suffix = key.split(".attn.to_q.")
            q, k, v = (diffusers_sd[f"{stem}.attn.to_{p}.{suffix}"] for p in "qkv")
            per_head = [t.reshape(heads, head_dim, -1) for t in (q, k, v)]
            fused = torch.stack(per_head, dim=1).reshape(3 * heads * head_dim, -1)
            out[original_name(stem) + f".attn.to_qkv.{suffix}"] = fused.squeeze(-1) if suffix == "bias" else fused
            continue
        if ".ff.net.0.proj." in key:  # diffusers [up; gate] -> release [gate; up]
            up, gate = tensor.chunk(2, dim=0)
            tensor = torch.cat([gate, up], dim=0)
        out[original_name(key)] = tensor.contiguous()
    out["decoder.mask_token"] = torch.zeros(1, 1, config.decoder_dim)
    return out


def original_configs(config: VideoVAEConfig) -> tuple[dict, dict]:
    """(`video_vae/config.json`, `video_vae/source/config.json`) with the release's field names."""
    wrapper = {
        "_class_name": "MiniMaxH3VideoVAE",
        "vae_clip_length": config.clip_length,
        "vae_token_drop": config.token_drop,
        "vae_encoder_tiling": int(config.encoder_tiling),
        "vae_decoder_tiling": int(config.decoder_tiling),
        "vae_parallel_tiling": 0,
        "vae_tile_size": config.tile_size,
        "vae_tile_overlap_min": config.tile_min_overlap,
        "vae_encoder_parallel": 0,
        "vae_decoder_parallel": 0,
        "vae_chunk_dim": -1,
        "latent_channels": config.latent_channels,
        "latents_mean": list(config.latents_mean),
        "latents_std": list(config.latents_std),
        "source_path": "source",
        "source_safetensors_path": "model.safetensors",
    }
    ch = config.block_out_channels[0]
    source = {
        "_class_name": "AutoencoderKLLegacy",
        "causal_decoder": False,
        "causal_encoder": True,
        "ch": ch,
        "ch_mult": [c // ch for c in config.block_out_channels],
        "embed_dim": config.latent_channels,
        "in_channels": config.in_channels,
        "num_res_blocks": config.layers_per_block,
        "num_res_blocks_decoder": None,
        "out_ch": config.out_channels,
        "padding_mode": config.spatial_padding_mode,
        "padding_mode_t": None,
        "pixel_norm_type": "imagenet",
        "scaling_factor": 1.0,
        "shift_factor": 0.0,
        "space_down": list(config.spatial_downsample_factors),
        "space_up": [1, 2, 2, 2, 2, 1],
        "time_down": list(config.temporal_downsample_factors),
        "time_up": None,
        "use_3d_conv": True,
        "use_t_isolated_gn": True,
        "use_vit_decoder": True,
        "vae_ratio": config.spatial_ratio,
        "vae_ratio_t": config.temporal_ratio,
        "vit_decoder_kwargs": {
            "dim_head": config.decoder_attention_head_dim,
            "ffn_activation_fn": "silu",
            "ffn_use_gated": True,
            "heads": config.decoder_num_attention_heads,
            "norm_affine": True,
            "norm_type": "rms_norm",
            "num_layers": config.decoder_num_layers,
            "qk_norm_affine": False,
            "qk_norm_type": "rms_norm",
            "rope_dim_ratio": config.decoder_rope_dim_ratio,
            "rope_theta": config.decoder_rope_theta,
        },
        "z_channels": config.latent_channels,
        "zq_ch_decoder": None,
        "zq_ch_encoder": None,
    }
    if config.norm_num_groups != 32:  # the release hard-codes 32 groups; tiny models need fewer
        source["norm_num_groups"] = config.norm_num_groups
    return wrapper, source


def write_original_partition(root: Path, diffusers_sd: dict, config: VideoVAEConfig, partition: str = "FL2VA") -> Path:
    """`root/<partition>/video_vae/` with both config files and `source/model.safetensors` (fp32)."""
    folder = root / partition / "video_vae"
    (folder / "source").mkdir(parents=True, exist_ok=True)
    wrapper, source = original_configs(config)
    (folder / "config.json").write_text(json.dumps(wrapper))
    (folder / "source" / "config.json").write_text(json.dumps(source))
    save_file(original_state_dict(diffusers_sd, config), str(folder / "source" / "model.safetensors"))
    (root / partition / "model_index.json").write_text(json.dumps({"_class_name": "MiniMaxH3Pipeline"}))
    return folder


def write_diffusers_folder(folder: Path, model: AutoencoderKLMiniMaxH3, max_shard_size: str = "150KB") -> Path:
    """diffusers' own writer: config.json + sharded diffusion_pytorch_model-*.safetensors + index."""
    model.save_pretrained(str(folder), max_shard_size=max_shard_size)
    return folder


def write_comfy_single_file(
    path: Path, diffusers_sd: dict, config: VideoVAEConfig, prefix: str = "", extra: dict | None = None
) -> Path:
    """A ComfyUI repack: the release's names (qkv interleaved) in float16, the latent statistics as
    tensors, an optional key prefix, and optional other tensors (an all-in-one file's other models)."""
    tensors = {k: v.to(torch.float16) for k, v in original_state_dict(diffusers_sd, config).items()}
    tensors["latents_mean"] = torch.tensor(config.latents_mean)
    tensors["latents_std"] = torch.tensor(config.latents_std)
    tensors = {prefix + k: v for k, v in tensors.items()}
    save_file({**tensors, **(extra or {})}, str(path))
    return path
