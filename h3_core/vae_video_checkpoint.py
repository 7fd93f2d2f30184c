"""Finding and loading the video VAE's weights from every layout users have, strictly.

Accepted paths:
- an original release folder `video_vae/` (or the partition `FL2VA/` / `Ref2VA/`, or the release root
  above them): `config.json` (wrapper: clip length, token drop, tiling, latents_mean / latents_std),
  `source/config.json` (CompVis-style shape fields: ch, ch_mult, num_res_blocks, z_channels,
  space_down, time_down, vit_decoder_kwargs, ...) and `source/model.safetensors` (float32);
- a diffusers folder `vae/` (or the repo root above it): `config.json` (`AutoencoderKLMiniMaxH3`)
  and `diffusion_pytorch_model*.safetensors` (sharded with an index, or one file);
- a ComfyUI single file (`minimax_h3_video_vae_fp16.safetensors`): the original key names (what
  ComfyUI detects it by), float16, optionally `latents_mean` / `latents_std` tensors (ComfyUI keeps
  them as state), bare or under a prefix such as `vae.` / `video_vae.` in an all-in-one file.
  Single files carry no config: the release's is used unless one is given.

Key layouts, mapped onto our modules (the original names, vae_video.py):
- original and ComfyUI: our names; `attn.to_qkv` per-head interleaved and `ff.w1` = [gate; up] as we
  hold them; `decoder.mask_token` (an all-zero training-only buffer) is checked and dropped.
- diffusers: `encoder.down_blocks.{i}.resnets.{j}` / `conv_shortcut` / `downsamplers.0`,
  `decoder.proj_in`, `attn.to_q/to_k/to_v` (fused here, interleaved per head), `attn.to_out.0`,
  `ff.net.0.proj` (halves stored [up; gate]: swapped here), `ff.net.2`.
Tensors stream one at a time into a model built on the meta device (h3_core.weights). Checkpoint
dtypes are kept unless a dtype is asked for; then `FP32_MODULES` stay float32.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from . import keymap
from .placement import check_load_device
from .tiny import TINY_RANDOM, tiny_random_video_vae
from .vae_video import VideoVAE, VideoVAEConfig, keeps_fp32
from .weights import (
    CheckpointError,
    Item,
    assign_strictly,
    check_safetensors_file,
    config_errors,
    described,
    open_safetensors,
    read_headers,
    read_json,
    shard_files,
    tensor_names,
)

MARKER = "decoder.transformer_blocks.0.scale1"  # in every layout, and in no other H3 model
SINGLE_FILE_STATS = ("latents_mean", "latents_std")
TRAINING_ONLY = "decoder.mask_token"
DIFFUSERS_CLASS = "AutoencoderKLMiniMaxH3"
ORIGINAL_SOURCE_CLASS = "AutoencoderKLLegacy"
DIFFUSERS_INDEX = "diffusion_pytorch_model.safetensors.index.json"

DIFFUSERS_RENAMES = (  # (diffusers pattern, ours), applied in order with re.sub
    (r"^encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.conv_shortcut\.", r"encoder.down.\1.block.\2.nin_shortcut."),
    (r"^encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block."),
    (r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample."),
    (r"^decoder\.proj_in\.", "decoder.x_embedder."),
    (r"\.attn\.to_out\.0\.", ".attn.to_out."),
    (r"\.ff\.net\.0\.proj\.", ".ff.w1."),
    (r"\.ff\.net\.2\.", ".ff.w2."),
)
QKV_PART = re.compile(r"^(.*\.attn)\.to_([qkv])\.(weight|bias)$")

# Original `source/config.json` values our model implements; anything else is another architecture.
ORIGINAL_ARCHITECTURE = {
    "use_3d_conv": True,
    "use_vit_decoder": True,
    "causal_encoder": True,
    "causal_decoder": False,
    "use_t_isolated_gn": True,
    "pixel_norm_type": "imagenet",
    "scaling_factor": 1.0,
    "shift_factor": 0.0,
}


@dataclass(frozen=True)
class VideoVAESource:
    """Where a video VAE's tensors live and how they are spelled."""

    files: tuple[Path, ...]
    naming: str  # "original" (release folder, ComfyUI) or "diffusers"
    prefix: str  # stripped from every key; keys without it are skipped ("" takes every key)
    config: VideoVAEConfig | None  # None: a single file, whose config is the release's or given
    origin: str  # for messages

    @property
    def where(self) -> str:
        return described(self.files, self.origin)


def locate_video_vae(path: str | Path) -> VideoVAESource:
    """Resolve a user path: a single file, a `video_vae/` or `vae/` folder, or a folder above one. A damaged
    config (a null where a path or number goes) is a CheckpointError naming it, as `load_video_vae` says it."""
    with config_errors(f"The video VAE at {path}"):
        return _located(Path(path).expanduser())


def _located(path: Path) -> VideoVAESource:
    if not path.exists():
        raise CheckpointError(f"{path} does not exist.")
    if path.is_file():
        return _single_file(path)
    if path.name == "source" and (path.parent / "source" / "config.json").is_file():
        path = path.parent
    for folder in (path, path / "video_vae", path / "FL2VA" / "video_vae", path / "Ref2VA" / "video_vae", path / "vae"):
        if (folder / "source" / "config.json").is_file():
            return _original_folder(folder)
        if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
            return _diffusers_folder(folder)
    raise CheckpointError(
        f"{path} is not an H3 video VAE: expected an original 'video_vae' folder (config.json, source/config.json, "
        "source/model.safetensors), a diffusers 'vae' folder (config.json, diffusion_pytorch_model*.safetensors), "
        "a folder above either (release partition or root), or a single .safetensors file "
        "(minimax_h3_video_vae_fp16.safetensors)."
    )


def _naming(keys: Iterable[str], prefix: str, where: Path) -> str:
    keys = [k[len(prefix) :] for k in keys if k.startswith(prefix)]
    if any(k.endswith((".weight_scale", ".comfy_quant", ".scale_weight")) for k in keys):
        raise CheckpointError(
            f"{where.name} is a quantized video VAE; it is not supported. Use the fp16 or fp32 file "
            "(minimax_h3_video_vae_fp16.safetensors or the release's video_vae folder)."
        )
    if any(k.startswith("encoder.down_blocks.") for k in keys):
        return "diffusers"
    if any(k.startswith("encoder.down.") for k in keys):
        return "original"
    raise CheckpointError(
        f"{where} holds no H3 video VAE encoder tensors (expected 'encoder.down.N.*' or 'encoder.down_blocks.N.*')."
    )


def _single_file(path: Path) -> VideoVAESource:
    check_safetensors_file(path, "H3 video VAE single")
    keys = tensor_names([path])
    prefixes = sorted(key[: -len(MARKER)] for key in keys if key.endswith(MARKER))
    if not prefixes:
        raise CheckpointError(
            f"{path.name} is not an H3 video VAE file: it holds no '{MARKER}' (bare or under a prefix such as "
            "'vae.' or 'video_vae.')."
        )
    if len(prefixes) > 1:
        raise CheckpointError(f"{path.name} holds several video VAEs (under {', '.join(map(repr, prefixes))}).")
    (prefix,) = prefixes
    return VideoVAESource((path,), _naming(keys, prefix, path), prefix, None, "single file")


def _original_folder(folder: Path) -> VideoVAESource:
    wrapper = read_json(folder / "config.json")
    source = read_json(folder / "source" / "config.json")
    candidates = [folder / "source" / "model.safetensors"]
    if "source_safetensors_path" in wrapper:
        name = wrapper["source_safetensors_path"]
        named = [folder / wrapper.get("source_path", "source") / name, folder / name]
        candidates = list(dict.fromkeys(named + candidates))  # each place once (the named one may be the default)
    weights = next((c for c in candidates if c.is_file()), None)
    if weights is None:
        looked = ", ".join(str(c.relative_to(folder)) for c in candidates)
        raise CheckpointError(f"{folder} has no video VAE weights: looked for {looked}.")
    check_safetensors_file(weights, "H3 video VAE")
    config = config_from_original(wrapper, source, folder)
    return VideoVAESource((weights,), _naming(tensor_names([weights]), "", weights), "", config, "original folder")


def _diffusers_folder(folder: Path) -> VideoVAESource:
    raw = read_json(folder / "config.json")
    class_name = raw.get("_class_name")
    if class_name != DIFFUSERS_CLASS:
        raise CheckpointError(
            f"{folder} holds a {class_name or 'model without _class_name'} checkpoint, not the H3 video VAE "
            f"(expected _class_name '{DIFFUSERS_CLASS}' in config.json)."
        )
    files = shard_files(folder, (DIFFUSERS_INDEX,))
    naming = _naming(tensor_names(files), "", folder)
    return VideoVAESource(files, naming, "", config_from_diffusers(raw), "diffusers folder")


def config_from_original(wrapper: dict, source: dict, folder: Path | str = "video_vae") -> VideoVAEConfig:
    """Our config from the release's `video_vae/config.json` (wrapper) and `source/config.json`.

    The release hard-codes what its source config does not name: 32 norm groups, 4 register tokens,
    feed-forward multiple 4. A `norm_num_groups` entry in the source config (not a release field)
    overrides the groups, so tiny test checkpoints can be written in this layout.
    """

    def need(raw: dict, key: str, file: str):
        if key not in raw:
            raise CheckpointError(f"{folder}/{file} lacks '{key}'; it is not an H3 video VAE config.")
        return raw[key]

    source_class = source.get("_class_name", ORIGINAL_SOURCE_CLASS)
    wrong = [f"{k}={source[k]!r}" for k, v in ORIGINAL_ARCHITECTURE.items() if k in source and source[k] != v]
    if source_class != ORIGINAL_SOURCE_CLASS or wrong:
        raise CheckpointError(
            f"{folder}/source/config.json describes another architecture than the H3 video VAE "
            f"({', '.join([f'_class_name={source_class!r}'] + wrong)})."
        )
    latent_channels = need(source, "z_channels", "source/config.json")
    if source.get("embed_dim", latent_channels) != latent_channels:
        raise CheckpointError(f"{folder}/source/config.json: embed_dim must equal z_channels ({latent_channels}).")
    if wrapper.get("latent_channels", latent_channels) != latent_channels:
        raise CheckpointError(f"{folder}/config.json: latent_channels is not source z_channels ({latent_channels}).")
    vit = need(source, "vit_decoder_kwargs", "source/config.json")
    ch = need(source, "ch", "source/config.json")
    try:
        return VideoVAEConfig(
            in_channels=source.get("in_channels", 3),
            out_channels=source.get("out_ch", 3),
            latent_channels=latent_channels,
            block_out_channels=tuple(ch * m for m in need(source, "ch_mult", "source/config.json")),
            layers_per_block=need(source, "num_res_blocks", "source/config.json"),
            spatial_downsample_factors=need(source, "space_down", "source/config.json"),
            temporal_downsample_factors=need(source, "time_down", "source/config.json"),
            norm_num_groups=source.get("norm_num_groups", 32),
            spatial_padding_mode=source.get("padding_mode", "reflect"),
            decoder_num_layers=need(vit, "num_layers", "source/config.json vit_decoder_kwargs"),
            decoder_num_attention_heads=need(vit, "heads", "source/config.json vit_decoder_kwargs"),
            decoder_attention_head_dim=need(vit, "dim_head", "source/config.json vit_decoder_kwargs"),
            decoder_rope_theta=vit.get("rope_theta", 100.0),
            decoder_rope_dim_ratio=vit.get("rope_dim_ratio", 0.75),
            clip_length=wrapper.get("vae_clip_length", 17),
            token_drop=wrapper.get("vae_token_drop", 3),
            latents_mean=need(wrapper, "latents_mean", "config.json"),
            latents_std=need(wrapper, "latents_std", "config.json"),
            tile_size=wrapper.get("vae_tile_size", 256),
            tile_min_overlap=wrapper.get("vae_tile_overlap_min", 64),
            encoder_tiling=bool(wrapper.get("vae_encoder_tiling", 1)),
            decoder_tiling=bool(wrapper.get("vae_decoder_tiling", 1)),
        )
    except ValueError as error:
        raise CheckpointError(f"{folder}: {error}") from None


def config_from_diffusers(raw: dict) -> VideoVAEConfig:
    """Our config from a diffusers `vae/config.json`; the tiling settings are diffusers' (the release's)."""
    fields = set(VideoVAEConfig.__dataclass_fields__)
    try:
        return VideoVAEConfig(**{key: value for key, value in raw.items() if key in fields})
    except ValueError as error:
        raise CheckpointError(f"diffusers video VAE config: {error}") from None


def diffusers_to_native_name(key: str) -> tuple[str, str | None]:
    """Our name for a diffusers key, and which fused-qkv part ('q', 'k', 'v') it is, if any."""
    match = QKV_PART.match(key)
    part = None
    if match:
        key, part = f"{match.group(1)}.to_qkv.{match.group(3)}", match.group(2)
    for pattern, replacement in DIFFUSERS_RENAMES:
        key = re.sub(pattern, replacement, key)
    return key, part


def to_native(items: Iterable[Item], naming: str, config: VideoVAEConfig, drop: tuple[str, ...] = ()) -> Iterator[Item]:
    """Map (key, tensor, where) items of either naming onto our names and layouts.

    diffusers q/k/v (weights and biases) are fused and interleaved per head as soon as all three are
    read. `decoder.mask_token` is checked and dropped; `drop` names further keys already consumed.
    """
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor, where in items:
        if key in drop:
            continue
        if key == TRAINING_ONLY:
            if tuple(tensor.shape) != (1, 1, config.decoder_dim):
                raise CheckpointError(
                    f"Tensor '{key}' in {where} has shape {list(tensor.shape)}, expected [1, 1, {config.decoder_dim}]."
                )
            continue
        if naming == "diffusers":
            key, part = diffusers_to_native_name(key)
            if ".ff.w1." in key:
                tensor = keymap.swap_halves(tensor)
            if part is not None:
                parts = pending.setdefault(key, {})
                parts[part] = tensor
                if len(parts) < 3:
                    continue
                del pending[key]
                shapes = {p: tuple(t.shape) for p, t in parts.items()}
                if len(set(shapes.values())) != 1 or parts["q"].shape[0] % config.decoder_attention_head_dim:
                    raise CheckpointError(f"'{key}' in {where}: to_q/to_k/to_v shapes {shapes} do not fuse per head.")
                stacked = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
                tensor = keymap.interleave_qkv(stacked, config.decoder_attention_head_dim)
        yield key, tensor, where
    for key, parts in pending.items():
        missing = sorted(set("qkv") - set(parts))
        raise CheckpointError(f"'{key}': the diffusers checkpoint lacks to_{'/to_'.join(missing)} for this attention.")


def convert_state_dict(state_dict: dict, naming: str, config: VideoVAEConfig) -> dict:
    """An in-memory state dict of either naming -> our names (what `load_video_vae` streams from files)."""
    items = ((key, tensor, "state dict") for key, tensor in state_dict.items())
    return {name: tensor for name, tensor, _ in to_native(items, naming, config)}


def _read_under_prefix(files: Iterable[Path], prefix: str, data: bool = True) -> Iterator[Item]:
    """(key without prefix, tensor, file), reading only the tensors under `prefix` (a bundle holds others);
    `data=False`: meta tensors from the headers."""
    if not data:
        yield from ((key[len(prefix):], tensor, path) for key, tensor, path in read_headers(files)
                    if key.startswith(prefix))
        return
    for path in files:
        with open_safetensors(path) as handle:
            for key in handle.keys():
                if key.startswith(prefix):
                    yield key[len(prefix) :], handle.get_tensor(key), path


def _single_file_stats(source: VideoVAESource, config: VideoVAEConfig) -> VideoVAEConfig:
    """A single file's own latents_mean / latents_std tensors replace the config's, when present."""
    (path,) = source.files
    with open_safetensors(path) as handle:
        present = [name for name in SINGLE_FILE_STATS if source.prefix + name in handle.keys()]
        if not present:
            return config
        if len(present) == 1:
            raise CheckpointError(f"{path.name} holds '{present[0]}' without its partner.")
        stats = {name: handle.get_tensor(source.prefix + name).float() for name in SINGLE_FILE_STATS}
    for name, tensor in stats.items():
        if tuple(tensor.shape) != (config.latent_channels,):
            raise CheckpointError(
                f"Tensor '{source.prefix}{name}' in {path} has shape {list(tensor.shape)}, "
                f"expected [{config.latent_channels}] for this config."
            )
    return config.replace(**{name: tuple(tensor.tolist()) for name, tensor in stats.items()})


def check_video_vae(path: str | Path, dtype: torch.dtype | None = None) -> VideoVAE:
    """Every check `load_video_vae` makes (names, shapes, nothing missing) on the files' headers alone: a host
    refuses a broken file before it loads anything else. The model comes back on the meta device, its tensors in
    the dtypes `load_video_vae(path, dtype)` gives them: their bytes are what loading takes."""
    return load_video_vae(path, dtype=dtype, device="meta")


def load_video_vae(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    config: VideoVAEConfig | None = None,
    on_tensor: Callable[[int, int], None] | None = None,
) -> VideoVAE:
    """Load the video VAE strictly from any layout (module docstring). `on_tensor(done, total)` after each tensor
    read (a host's progress bar and cancel: the release's fp32 VAE is 9.7 GiB).

    `dtype=None` keeps each tensor's checkpoint dtype (but float8, in which no convolution runs: bf16, or fp32
    for `FP32_MODULES`); else `FP32_MODULES` are float32 and the rest `dtype`. `config` overrides the
    checkpoint's (single files have none: the release's is the default). `device="meta"` reads the headers only
    (`check_video_vae`). `tiny-random`: the embedded demo VAE (float32), made, not read.
    """
    check_load_device(device, headers_only=True)
    if str(path) == TINY_RANDOM:
        return tiny_random_video_vae(device)
    with config_errors(f"The video VAE at {path}"):
        source = locate_video_vae(path)
        config = config or source.config or VideoVAEConfig()
        drop: tuple[str, ...] = ()
        if source.config is None:
            config = _single_file_stats(source, config)
            drop = SINGLE_FILE_STATS
        with torch.device("meta"):
            model = VideoVAE(config)

    def policy(name: str) -> torch.dtype | None:
        if dtype is None:
            return None
        return torch.float32 if keeps_fp32(name) else dtype

    items = to_native(_read_under_prefix(source.files, source.prefix, data=torch.device(device).type != "meta"),
                      source.naming, config, drop)
    assign_strictly(model, items, source.where, policy, device, on_tensor)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and tensor.element_size() == 1:
            tensor.data = tensor.data.to(torch.float32 if keeps_fp32(name) else torch.bfloat16)
    return model.eval().requires_grad_(False)
