"""FastVideo's own VSA code for H3 (the reference FastH3 8-Step V2 was trained with), loaded as a test oracle.

FastVideo (Apache-2.0) is not a dependency: `.ci/run` downloads its wheel without dependencies and sets
FASTVIDEO_SRC to the unpacked folder holding `fastvideo/`. Only its two VSA modules are executed, unchanged;
the package around them (logger, distributed groups, attention-backend base classes, the probe) is replaced
by stubs, and its block-sparse kernel (fastvideo_kernel, CUDA) by `masked_block_attention` below, a plain
masked attention over the same tile buffer.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

BACKENDS = "fastvideo.attention.backends"


def source_folder() -> Path | None:
    folder = os.environ.get("FASTVIDEO_SRC")
    if not folder or not (Path(folder) / "fastvideo" / "attention" / "backends" / "video_sparse_attn_h3.py").is_file():
        return None
    return Path(folder)


def masked_block_attention(q, k, v, block_map, variable_block_sizes):
    """The kernel's contract: q, k, v [B, H, tiles x 64, D]; query tile i attends the valid rows of key tiles
    j with block_map[b, h, i, j]. Returns (out, None)."""
    valid = (torch.arange(64)[None, :] < variable_block_sizes[:, None].cpu()).flatten()
    allowed = block_map.repeat_interleave(64, dim=-2).repeat_interleave(64, dim=-1) & valid
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed), None


def load(folder: Path):
    """FastVideo's `video_sparse_attn_h3` module, its kernel replaced by `masked_block_attention`."""
    stubs = {
        "fastvideo": types.ModuleType("fastvideo"),
        "fastvideo.attention": types.ModuleType("fastvideo.attention"),
        BACKENDS: types.ModuleType(BACKENDS),
        "fastvideo.logger": types.ModuleType("fastvideo.logger"),
        "fastvideo.distributed": types.ModuleType("fastvideo.distributed"),
        f"{BACKENDS}.abstract": types.ModuleType(f"{BACKENDS}.abstract"),
        f"{BACKENDS}.video_sparse_attn_h3_probe": types.ModuleType(f"{BACKENDS}.video_sparse_attn_h3_probe"),
    }

    class Logger:
        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    @dataclass
    class AttentionMetadata:  # FastVideo's base fields
        current_timestep: int
        VSA_sparsity: float = field(default=0.0, kw_only=True)

    abstract = stubs[f"{BACKENDS}.abstract"]
    abstract.AttentionBackend, abstract.AttentionImpl = object, object
    abstract.AttentionMetadata, abstract.AttentionMetadataBuilder = AttentionMetadata, object
    abstract.layer_idx_from_prefix = lambda prefix, default=-1: default
    stubs["fastvideo.logger"].init_logger = lambda name: Logger()
    stubs["fastvideo.distributed"].get_sp_group = lambda: None
    probe = stubs[f"{BACKENDS}.video_sparse_attn_h3_probe"]
    probe.probe_enabled, probe.record_probe = (lambda: None), (lambda *args, **kwargs: None)
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        for name in ("video_sparse_attn", "video_sparse_attn_h3"):
            path = folder / "fastvideo" / "attention" / "backends" / f"{name}.py"
            spec = importlib.util.spec_from_file_location(f"{BACKENDS}.{name}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    h3 = sys.modules.pop(f"{BACKENDS}.video_sparse_attn_h3")
    sys.modules.pop(f"{BACKENDS}.video_sparse_attn")
    h3.block_sparse_attn_64_bhsd = masked_block_attention
    return h3


def reference_vsa(h3, query, key, value, gate, prefix_segments, video_grid, sparsity):
    """FastVideo's VSA-H3 forward on packed [B, rows, H, D] inputs with 64-row tiles (as FastH3 8-Step V2)."""
    metadata = h3.MiniMaxH3VSAMetadataBuilder().build(
        current_timestep=0, raw_latent_shape=video_grid, patch_size=(1, 1, 1), VSA_sparsity=sparsity,
        prefix_segments=tuple(prefix_segments), device=query.device, exempt=True, tile_size=64)
    impl = h3.MiniMaxH3VSAImpl(num_heads=query.shape[2], head_size=query.shape[3], causal=False,
                               softmax_scale=query.shape[3] ** -0.5)
    tiled = [impl.tile(x, metadata).clone() for x in (query, key, value)]
    tiled_gate = None if gate is None else impl.tile(gate, metadata).clone()
    out = impl.forward(*tiled, tiled_gate, metadata)
    return impl.postprocess_output(out, metadata)
