"""Key names of the three DiT checkpoint layouts, mapped onto our modules (the original names).

- original release shards: our names, but `attn.qkv_proj` rows are interleaved per head
  [h0: q k v, h1: q k v, ...]; `rope.inv_freq` is shipped (we recompute it).
- ComfyUI single files: our names with qkv stacked [q; k; v]; optional `model.diffusion_model.` prefix.
- diffusers: renamed modules, q/k/v split in three tensors, SwiGLU `fc1` halves stored [value; gate]
  where ours are [gate; value].
"""

from __future__ import annotations

import re

import torch

DIFFUSERS_RENAMES = (  # (diffusers prefix/infix, ours); applied in order to a key string
    ("transformer_blocks.", "blocks."),
    ("token_refiner.refiner_blocks.", "token_refiner.blocks."),
    ("time_embedder.linear_1.", "time_embedder.proj_in."),
    ("time_embedder.linear_2.", "time_embedder.proj_out."),
    ("audio_proj_in.", "audio_patch_proj."),
    ("proj_in.", "video_patch_proj."),
    ("context_embedder.", "condition_proj."),
    ("norm_out.norm.", "final_layer.norm."),
    ("norm_out.linear.", "final_layer.adaln_proj.linear."),
    ("audio_proj_out.", "final_layer.audio_out."),
    ("proj_out.", "final_layer.video_out."),
)
DIFFUSERS_INFIXES = (
    (".attn.norm_q.", ".attn.q_norm."),
    (".attn.norm_k.", ".attn.k_norm."),
    (".attn.to_out.0.", ".attn.out_proj."),
    (".ff.net.0.proj.", ".mlp.fc1."),
    (".ff.net.2.", ".mlp.fc2."),
    (".attn.to_gate_compress.", ".attn.gate_compress."),  # FastVideo's VSA gate (FastH3 8-Step V2)
)
QKV_PART = re.compile(r"^(.*\.attn)\.to_([qkv])\.weight$")
PREFIXES = ("model.diffusion_model.", "diffusion_model.")
# an all-in-one file's other models (ComfyUI's checkpoint save: `vae.`, `text_encoders.`; h3-model.md I.2):
# no DiT key starts so
VAE_PREFIXES = ("vae.", "video_vae.", "audio_vae.")
OTHER_MODELS = (*VAE_PREFIXES, "text_encoders.")


def strip_prefix(key: str) -> str:
    for prefix in PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def bundled_models(keys) -> list[str]:
    """Which models besides the DiT an all-in-one file's tensor names hold ('text_encoder', 'video_vae',
    'audio_vae')."""
    found = {"text_encoder": ("text_encoders.qwen3vl_32b.",), "video_vae": VAE_PREFIXES[:2],
             "audio_vae": VAE_PREFIXES[2:]}
    return [model for model, prefixes in found.items() if any(key.startswith(prefixes) for key in keys)]


def dit_name(key: str) -> str | None:
    """`strip_prefix` for a file that may hold other models too: None for their keys."""
    return None if key.startswith(OTHER_MODELS) else strip_prefix(key)


def is_dit_key(key: str) -> bool:
    return not key.startswith(OTHER_MODELS)


def diffusers_to_native_name(key: str) -> tuple[str, str | None]:
    """Our name for a diffusers key, and which qkv part ('q', 'k', 'v') it is, if any."""
    match = QKV_PART.match(key)
    part = None
    if match:
        key, part = f"{match.group(1)}.qkv_proj.weight", match.group(2)
    for old, new in DIFFUSERS_RENAMES:
        if key.startswith(old):
            key = new + key[len(old):]
            break
    for old, new in DIFFUSERS_INFIXES:
        key = key.replace(old, new)
    return key, part


def swap_halves(weight: torch.Tensor) -> torch.Tensor:
    """[a; b] -> [b; a] along rows: diffusers' SwiGLU [value; gate] <-> our [gate; value]."""
    first, second = weight.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def deinterleave_qkv(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Per-head interleaved rows [h: q k v]... -> stacked [q_all; k_all; v_all]."""
    heads = weight.shape[0] // (3 * head_dim)
    return weight.view(heads, 3, head_dim, -1).transpose(0, 1).reshape(weight.shape)


def interleave_qkv(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of `deinterleave_qkv`: stacked -> per-head interleaved (the original shards' order)."""
    heads = weight.shape[0] // (3 * head_dim)
    return weight.view(3, heads, head_dim, -1).transpose(0, 1).reshape(weight.shape)
