"""Writers for tiny random DiT checkpoints in the three on-disk layouts users have.

The original-layout writer maps diffusers names back to the release's names with its own table
(written from h3-model.md A.2, independent of h3_core.keymap), so loading these files tests our
mapping rather than repeating it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import MiniMaxH3Transformer3DModel
from safetensors.torch import save_file

from h3_core.config import DiTConfig

# diffusers -> original, whole-name pieces (A.2); applied by exact prefix / infix match.
_TO_ORIGINAL_PREFIX = {
    "proj_in.": "video_patch_proj.",
    "audio_proj_in.": "audio_patch_proj.",
    "context_embedder.": "condition_proj.",
    "time_embedder.linear_1.": "time_embedder.proj_in.",
    "time_embedder.linear_2.": "time_embedder.proj_out.",
    "norm_out.norm.": "final_layer.norm.",
    "norm_out.linear.": "final_layer.adaln_proj.linear.",
    "proj_out.": "final_layer.video_out.",
    "audio_proj_out.": "final_layer.audio_out.",
    "token_refiner.refiner_blocks.": "token_refiner.blocks.",
    "transformer_blocks.": "blocks.",
}
_TO_ORIGINAL_INFIX = {
    "attn.norm_q.": "attn.q_norm.",
    "attn.norm_k.": "attn.k_norm.",
    "attn.to_out.0.": "attn.out_proj.",
    "ff.net.0.proj.": "mlp.fc1.",
    "ff.net.2.": "mlp.fc2.",
}
_ORIGINAL_CONFIG_NAMES = {
    "num_refiner_layers": "token_refiner_num_layers",
    "ffn_dim": "ffn_hidden_size",
    "in_channels": "latents_dim",
    "audio_in_channels": "audio_latents_dim",
    "freq_dim": "timestep_input_dim",
    "time_embed_hidden_dim": "time_embed_hidden_size",
    "rope_freq_dim": "rope_inv_freq_len",
}


def reference_dit(config: DiTConfig, seed: int = 0) -> MiniMaxH3Transformer3DModel:
    """The diffusers reference DiT with seeded random weights (fp32). Zero-init parts get random values."""
    torch.manual_seed(seed)
    model = MiniMaxH3Transformer3DModel(**config.to_dict()).eval()
    with torch.no_grad():
        for param in model.parameters():  # norms start at 1, biases at 0: randomize so every term is tested
            if param.ndim == 1:
                param.add_(0.1 * torch.randn_like(param))
    return model


def _original_name(key: str) -> str:
    for old, new in _TO_ORIGINAL_PREFIX.items():
        if key.startswith(old):
            key = new + key[len(old):]
            break
    for old, new in _TO_ORIGINAL_INFIX.items():
        key = key.replace(old, new)
    return key


def original_state_dict(diffusers_sd: dict, config: DiTConfig, qkv_layout: str = "interleaved") -> dict:
    """The release's tensor set: fused qkv (per-head interleaved or stacked), fc1 as [gate; value], rope.inv_freq."""
    out = {}
    for key, tensor in diffusers_sd.items():
        if ".attn.to_k." in key or ".attn.to_v." in key:
            continue
        if ".attn.to_q." in key:
            stem = key.split(".attn.to_q.")[0]
            q, k, v = (diffusers_sd[f"{stem}.attn.to_{p}.weight"] for p in "qkv")
            heads, d = config.num_attention_heads, config.attention_head_dim
            if qkv_layout == "interleaved":  # rows [head h: q_h, k_h, v_h]
                fused = torch.stack([q.view(heads, d, -1), k.view(heads, d, -1), v.view(heads, d, -1)], dim=1)
                fused = fused.reshape(3 * heads * d, -1)
            else:
                fused = torch.cat([q, k, v], dim=0)
            out[_original_name(stem) + ".attn.qkv_proj.weight"] = fused.contiguous()
            continue
        if ".ff.net.0.proj." in key:  # diffusers [value; gate] -> original [gate; value]
            value, gate = tensor.chunk(2, dim=0)
            tensor = torch.cat([gate, value], dim=0)
        out[_original_name(key)] = tensor.contiguous()
    f = config.rope_freq_dim
    out["rope.inv_freq"] = 1.0 / (config.rope_theta ** (torch.arange(0, 2 * f, 2, dtype=torch.float32) / (2 * f)))
    return out


def write_original_partition(root: Path, diffusers_sd: dict, config: DiTConfig, partition: str = "FL2VA", shards: int = 3) -> Path:
    """`root/<partition>/transformer/` with config.json (original names), N shards and an index."""
    folder = root / partition / "transformer"
    folder.mkdir(parents=True, exist_ok=True)
    tensors = original_state_dict(diffusers_sd, config)
    names = list(tensors)
    weight_map = {}
    for i in range(shards):
        shard_name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(folder / shard_name))
        weight_map.update({n: shard_name for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    raw = {_ORIGINAL_CONFIG_NAMES.get(k, k): v for k, v in config.to_dict().items()}
    raw.update({"_class_name": "MiniMaxH3DiTModel", "_diffusers_version": "0.32.2"})
    (folder / "config.json").write_text(json.dumps(raw))
    (root / partition / "model_index.json").write_text(json.dumps(
        {"_class_name": "MiniMaxH3Pipeline", "_minimax_h3": {"schema_version": 1, "partition": partition.lower()}}))
    return folder


def write_comfy_single_file(path: Path, diffusers_sd: dict, config: DiTConfig, prefix: str = "model.diffusion_model.") -> Path:
    """A ComfyUI repack: the release's names flat in one file, qkv stacked, optional key prefix."""
    tensors = original_state_dict(diffusers_sd, config, qkv_layout="stacked")
    save_file({prefix + k: v for k, v in tensors.items()}, str(path))
    return path


def write_diffusers_folder(folder: Path, model: MiniMaxH3Transformer3DModel, max_shard_size: str = "200KB") -> Path:
    """diffusers' own writer: config.json + sharded diffusion_pytorch_model-*.safetensors + index."""
    model.save_pretrained(str(folder), max_shard_size=max_shard_size)
    return folder
