"""Writers of synthetic H3 LoRA files in every published key spelling, from one ground truth.

The ground truth (`Spec`) is an adapter in diffusers layout: one (A, B) per diffusers Linear name
(`transformer_blocks.0.attn.to_q`, `...ff.net.0.proj` with B rows [value; gate], ...), plus dense
deltas. Each writer re-spells it the way its producer does; the renaming, fusing and interleaving
here are written from h3-model.md (A.2, H.2) on their own, not through h3_core, so loading these files
tests h3_core's mapping instead of repeating it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from h3_core.config import DiTConfig

# diffusers module name -> original (native) name, by exact prefix / infix pieces (A.2).
_BLOCK_PREFIXES = (("token_refiner.refiner_blocks.", "token_refiner.blocks."), ("transformer_blocks.", "blocks."))
_MEMBERS = {"attn.to_out.0": "attn.out_proj", "ff.net.0.proj": "mlp.fc1", "ff.net.2": "mlp.fc2",
            "adaln_proj.linear": "adaln_proj.linear", "norm1": "norm1", "norm2": "norm2",
            "attn.norm_q": "attn.q_norm", "attn.norm_k": "attn.k_norm"}
_STANDALONE = {"proj_in": "video_patch_proj", "audio_proj_in": "audio_patch_proj", "context_embedder": "condition_proj",
               "time_embedder.linear_1": "time_embedder.proj_in", "time_embedder.linear_2": "time_embedder.proj_out",
               "norm_out.linear": "final_layer.adaln_proj.linear", "norm_out.norm": "final_layer.norm",
               "proj_out": "final_layer.video_out", "audio_proj_out": "final_layer.audio_out"}


def native_name(module: str) -> str:
    if module in _STANDALONE:
        return _STANDALONE[module]
    for old, new in _BLOCK_PREFIXES:
        if module.startswith(old):
            index, member = module[len(old):].split(".", 1)
            return f"{new}{index}.{_MEMBERS[member]}"
    raise KeyError(module)


@dataclass
class Spec:
    """Ground truth: {diffusers module: (A [r, in], B [out, r])}, optional per-module alphas, and dense
    deltas {diffusers module: {"weight"|"bias": tensor}} (FastVideo)."""

    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    alphas: dict[str, float] = field(default_factory=dict)
    dense: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


def linear_shapes(config: DiTConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of every LoRA-able Linear of the diffusers model for `config`, by diffusers name."""
    h, inner, ffn, temb = config.hidden_size, config.inner_dim, config.ffn_dim, config.time_embed_dim
    shapes = {}
    blocks = [f"token_refiner.refiner_blocks.{i}" for i in range(config.num_refiner_layers)]
    blocks += [f"transformer_blocks.{i}" for i in range(config.num_layers)]
    for block in blocks:
        shapes.update({f"{block}.attn.to_q": (h, inner), f"{block}.attn.to_k": (h, inner), f"{block}.attn.to_v": (h, inner),
                       f"{block}.attn.to_out.0": (inner, h), f"{block}.ff.net.0.proj": (h, 2 * ffn),
                       f"{block}.ff.net.2": (ffn, h)})
        if block.startswith("transformer_blocks"):
            shapes[f"{block}.adaln_proj.linear"] = (temb, 18 * h)
    shapes["norm_out.linear"] = (temb, 2 * h)
    return shapes


def random_spec(config: DiTConfig, rank: int = 4, adaln_rank: int = 2, shared_qkv_a: bool = False, seed: int = 0,
                modules: list[str] | None = None, scale: float = 0.05) -> Spec:
    """Mixed-rank random factors (rank on attention/FFN, adaln_rank on AdaLN, like published H3 LoRAs).
    `shared_qkv_a` gives q, k, v one A, as a fused qkv LoRA has."""
    generator = torch.Generator().manual_seed(seed)
    shapes = linear_shapes(config)
    factors = {}
    for name in modules or shapes:
        fan_in, fan_out = shapes[name]
        r = adaln_rank if "adaln" in name or name == "norm_out.linear" else rank
        a = torch.randn(r, fan_in, generator=generator) / fan_in ** 0.5
        b = torch.randn(fan_out, r, generator=generator) * scale
        if shared_qkv_a and name.endswith((".attn.to_k", ".attn.to_v")):
            a = factors[name.rsplit(".", 1)[0] + ".to_q"][0]
        factors[name] = (a, b)
    return Spec(factors)


# ---------------------------------------------------------------------------------------------------
# Diffusers-named writers.
def write_peft(path: Path, spec: Spec, metadata: dict | None = None, infix: str = ".default") -> Path:
    """peft dump / LightX2V "Diffusers layout": `<diffusers module>.lora_A.default.weight`, no prefix."""
    tensors = {}
    for name, (a, b) in spec.factors.items():
        tensors[f"{name}.lora_A{infix}.weight"] = a.contiguous()
        tensors[f"{name}.lora_B{infix}.weight"] = b.contiguous()
    save_file(tensors, str(path), metadata=metadata)
    return path


def write_fastvideo(path: Path, spec: Spec) -> Path:
    """FastVideo `fastvideo-lora-v2`: diffusers names, `lora_A.weight` (no `.default.`), plus dense
    `<module>.diff` / `<module>.diff_b` full deltas."""
    tensors = {}
    for name, (a, b) in spec.factors.items():
        tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"] = a.contiguous(), b.contiguous()
    for name, deltas in spec.dense.items():
        for param, delta in deltas.items():
            tensors[f"{name}.{'diff' if param == 'weight' else 'diff_b'}"] = delta.contiguous()
    save_file(tensors, str(path))
    return path


def write_diffusers(path: Path, specs: dict[str, Spec], adapter_config: dict[str, dict] | None = None) -> Path:
    """diffusers' writer: `<component>.<module>.lora_A.weight`, component `transformer` (FL2VA) or
    `transformer_ref` (Ref2VA), and the LoraConfig of each in `lora_adapter_metadata` as
    '<component>.<field>' keys."""
    tensors, config = {}, {}
    for component, spec in specs.items():
        for name, (a, b) in spec.factors.items():
            tensors[f"{component}.{name}.lora_A.weight"] = a.contiguous()
            tensors[f"{component}.{name}.lora_B.weight"] = b.contiguous()
        for key, value in (adapter_config or {}).get(component, {}).items():
            config[f"{component}.{key}"] = value
    metadata = {"format": "pt"}
    if config:
        metadata["lora_adapter_metadata"] = json.dumps(config, sort_keys=True)
    save_file(tensors, str(path), metadata=metadata)
    return path


# ---------------------------------------------------------------------------------------------------
# Native (fused) writers.
def interleave(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Stacked [q_all; k_all; v_all] rows -> the raw checkpoint's [h0: q k v, h1: q k v, ...]."""
    q, k, v = rows.chunk(3, dim=0)
    heads = q.shape[0] // head_dim
    return torch.stack([t.reshape(heads, head_dim, -1) for t in (q, k, v)], dim=1).reshape(rows.shape)


def fused(spec: Spec, qkv_rows: str = "stacked", head_dim: int | None = None, block_diagonal: bool = False) -> dict:
    """{native module: (A, B)}: q/k/v fused into `attn.qkv_proj` (one shared A, B stacked or per-head
    interleaved; or, `block_diagonal`, A = [A_q; A_k; A_v] and a block-diagonal B of rank 3r), fc1 B
    halves swapped to [gate; value]."""
    out = {}
    for name, (a, b) in spec.factors.items():
        if name.endswith((".attn.to_k", ".attn.to_v")):
            continue
        if name.endswith(".attn.to_q"):
            stem = name[: -len(".attn.to_q")]
            parts = [spec.factors[f"{stem}.attn.to_{p}"] for p in "qkv"]
            if block_diagonal:
                a = torch.cat([p[0] for p in parts], dim=0)
                b = torch.block_diag(*(p[1] for p in parts))
            else:
                if not all(torch.equal(p[0], parts[0][0]) for p in parts):
                    raise ValueError("a fused qkv LoRA needs one A shared by q, k and v (random_spec(shared_qkv_a=True))")
                b = torch.cat([p[1] for p in parts], dim=0)
                if qkv_rows == "interleaved":
                    b = interleave(b, head_dim)
            out[native_name(stem + ".attn.to_out.0").replace("out_proj", "qkv_proj")] = (a, b)
            continue
        if name.endswith(".ff.net.0.proj"):
            value, gate = b.chunk(2, dim=0)
            b = torch.cat([gate, value], dim=0)
        out[native_name(name)] = (a, b)
    return out


def write_native(path: Path, modules: dict, prefix: str = "", infix: str = "", metadata: dict | None = None,
                 alphas: dict[str, float] | None = None) -> Path:
    """Native names `<prefix><module>.lora_A<infix>.weight` (ai-toolkit prefix `diffusion_model.`,
    DiffSynth infix `.default`), optional `<module>.alpha` scalars."""
    tensors = {}
    for name, (a, b) in modules.items():
        tensors[f"{prefix}{name}.lora_A{infix}.weight"] = a.contiguous()
        tensors[f"{prefix}{name}.lora_B{infix}.weight"] = b.contiguous()
        if alphas and name in alphas:
            tensors[f"{prefix}{name}.alpha"] = torch.tensor(alphas[name])
    save_file(tensors, str(path), metadata=metadata)
    return path


def write_kohya(path: Path, modules: dict, alphas: dict[str, float]) -> Path:
    """musubi-tuner / kohya: `lora_unet_<native name with '.' -> '_'>.lora_down/lora_up/alpha`."""
    tensors = {}
    for name, (a, b) in modules.items():
        flat = "lora_unet_" + name.replace(".", "_")
        tensors[f"{flat}.lora_down.weight"], tensors[f"{flat}.lora_up.weight"] = a.contiguous(), b.contiguous()
        tensors[f"{flat}.alpha"] = torch.tensor(float(alphas[name]))
    save_file(tensors, str(path))
    return path
