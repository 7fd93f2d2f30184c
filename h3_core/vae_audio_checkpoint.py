"""Finding and loading the audio VAE from every layout users have, strictly, one tensor at a time.

Accepted (h3-model.md C, I):
- an original partition folder `FL2VA/audio_vae/` (or `Ref2VA/...`, or the partition / release root above it):
  `config.json` (latent_channels, sample_rate, latents_mean, latents_std), `metadata.json` (`metadata.kwargs`:
  encoder_dim, encoder_rates, latent_dim, vae_latent_channels, decoder_dim, decoder_rates, decoder_type,
  attn_proj, sample_rate) and `model.safetensors`;
- a diffusers folder `audio_vae/` (or the repository root above it): `config.json` of
  `AutoencoderKLMiniMaxH3Audio` and `diffusion_pytorch_model.safetensors`, tensor names identical to the original;
- a ComfyUI single file (Comfy-Org `vae/minimax_h3_audio_vae_fp32.safetensors`): the same names with weight norm
  already folded into plain `weight`s, plus the statistics as tensors `latents_mean` / `latents_std`; keys may
  carry an `audio_vae.` prefix (bundles), in which case only those keys are read. Its config is read off the
  tensor shapes.

On the way in: each `X.weight_g` / `X.weight_v` pair becomes `X.weight` (folded in fp32); the Kaiser `filter`
buffers are checked against the ones the architecture defines (the model computes its own); the posterior's
log-std head `logs_proj` is shape-checked and skipped (H3 only takes the mean). Anything else missing, extra or
mis-shaped is an error naming the tensor and the file. Checkpoint dtypes are kept unless `dtype` is given.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .placement import check_load_device
from .tiny import TINY_RANDOM, tiny_random_audio_vae
from .vae_audio import AudioVAE, AudioVAEConfig
from .weights import (
    PICKLE_SUFFIXES,
    CheckpointError,
    Item,
    assign_strictly,
    check_safetensors_file,
    config_errors,
    open_safetensors,
    read_headers,
    read_json,
    read_tensors,
    tensor_names,
)

ORIGINAL_WEIGHTS = "model.safetensors"
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
DIFFUSERS_CLASS = "AutoencoderKLMiniMaxH3Audio"
SINGLE_FILE_PREFIX = "audio_vae."
SINGLE_FILE_MARKER = "pre_block.attn.zero_k_bias"  # a tensor only this model has (ComfyUI detects it the same way)
STATISTICS = ("latents_mean", "latents_std")  # tensors of a single file that are config, not weights
UNUSED_HEAD = "logs_proj."
FILTER_SUFFIXES = {".upsample.filter": ".upsample.filter", ".downsample.lowpass.filter": ".downsample.filter"}
# The taps are at most 0.5: a copy made on another machine may differ in the last bit, a half-precision copy by
# one ulp of its dtype.
FILTER_TOLERANCE = 1e-6

# metadata.json does not carry the head count nor the AMP tables: the original code hard-codes them (8 heads; the
# tables are AudioVAEConfig's defaults), as the diffusers conversion does.
ORIGINAL_ATTENTION_HEADS = 8
ORIGINAL_METADATA_KEYS = (
    "encoder_dim", "encoder_rates", "latent_dim", "vae_latent_channels", "decoder_dim", "decoder_rates",
    "decoder_type", "attn_proj", "sample_rate",
)  # fmt: skip
ORIGINAL_CONFIG_KEYS = ("latent_channels", "sample_rate", "latents_mean", "latents_std")


@dataclass(frozen=True)
class AudioVAESource:
    """Where an audio VAE's tensors live, and its config (None: read it off the tensor shapes)."""

    file: Path
    config: AudioVAEConfig | None
    origin: str  # for messages: "original partition folder", "diffusers folder", "single file"
    prefix: str = ""  # read only the keys with this prefix, without it ("audio_vae." inside a bundle)


def locate_audio_vae(path: str | Path) -> AudioVAESource:
    """Resolve a user path: a single file, an `audio_vae` folder, or a partition / release / repository root. A
    damaged config (a null where a list goes) is a CheckpointError naming it, as `load_audio_vae` says it."""
    with config_errors(f"The audio VAE at {path}"):
        return _located(Path(path).expanduser())


def _located(path: Path) -> AudioVAESource:
    if not path.exists():
        raise CheckpointError(f"{path} does not exist.")
    if path.is_file():
        if path.name in (ORIGINAL_WEIGHTS, DIFFUSERS_WEIGHTS) and (folder := _audio_vae_folder(path.parent)):
            return folder  # the weights file of a folder: take its configs too
        return _single_file(path)
    for candidate in (path, path / "audio_vae", path / "FL2VA" / "audio_vae", path / "Ref2VA" / "audio_vae"):
        if candidate.is_dir() and (folder := _audio_vae_folder(candidate)):
            return folder
    raise CheckpointError(
        f"{path} is not an H3 audio VAE: expected an original 'audio_vae' folder (config.json, metadata.json, "
        f"{ORIGINAL_WEIGHTS}), a diffusers 'audio_vae' folder (config.json of {DIFFUSERS_CLASS}, {DIFFUSERS_WEIGHTS}), "
        "either of their parents (partition, release or repository root), or a single .safetensors file."
    )


def _audio_vae_folder(folder: Path) -> AudioVAESource | None:
    if (folder / "metadata.json").is_file() and (folder / "config.json").is_file():
        config = config_from_original(read_json(folder / "config.json"), read_json(folder / "metadata.json"), folder)
        return AudioVAESource(_weights_file(folder, ORIGINAL_WEIGHTS), config, "original partition folder")
    if (folder / "config.json").is_file():
        raw = read_json(folder / "config.json")
        if raw.get("_class_name") == DIFFUSERS_CLASS:
            config = _config(lambda: AudioVAEConfig.from_dict(_without_missing_statistics(raw)), folder / "config.json")
            return AudioVAESource(_weights_file(folder, DIFFUSERS_WEIGHTS), config, "diffusers folder")
    return None


def _weights_file(folder: Path, name: str) -> Path:
    path = folder / name
    if path.is_file():
        return path
    for pickle in sorted(p for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES):
        check_safetensors_file(pickle, "audio VAE")  # raises: explains why pickles are refused
    raise CheckpointError(f"{folder} has no {name}.")


def _config(build, where: Path) -> AudioVAEConfig:
    try:
        return build()
    except (ValueError, TypeError) as error:
        raise CheckpointError(f"{where}: {error}") from None


def _without_missing_statistics(raw: dict) -> dict:
    """diffusers allows `latents_mean: null`; the released statistics then apply (32 channels only)."""
    return {key: value for key, value in raw.items() if not (key in STATISTICS and value is None)}


def config_from_original(config: dict, metadata: dict, folder: Path) -> AudioVAEConfig:
    """The config of an original `audio_vae/` folder; its two files repeat the latent width and sample rate,
    which must agree."""
    section = metadata.get("metadata")
    kwargs = section.get("kwargs") if isinstance(section, dict) else None
    if not isinstance(kwargs, dict):
        raise CheckpointError(f"{folder / 'metadata.json'} has no 'metadata.kwargs' object.")
    expected = (("metadata.json", kwargs, ORIGINAL_METADATA_KEYS), ("config.json", config, ORIGINAL_CONFIG_KEYS))
    for name, values, keys in expected:
        missing = [key for key in keys if key not in values]
        if missing:
            raise CheckpointError(f"{folder / name} lacks {', '.join(missing)}.")
    if kwargs["decoder_type"] != "bigvgan" or not kwargs["attn_proj"]:
        raise CheckpointError(
            f"{folder / 'metadata.json'} describes decoder_type={kwargs['decoder_type']!r}, "
            f"attn_proj={kwargs['attn_proj']}; H3's audio VAE is the BigVGAN decoder with the attention projection."
        )
    for config_key, kwargs_key in (("latent_channels", "vae_latent_channels"), ("sample_rate", "sample_rate")):
        if config[config_key] != kwargs[kwargs_key]:
            raise CheckpointError(
                f"{folder}: config.json has {config_key}={config[config_key]} but metadata.json has "
                f"{kwargs_key}={kwargs[kwargs_key]}."
            )
    rates = [int(rate) for rate in kwargs["decoder_rates"]]
    return _config(
        lambda: AudioVAEConfig(
            encoder_dim=kwargs["encoder_dim"],
            encoder_rates=kwargs["encoder_rates"],
            latent_dim=kwargs["latent_dim"],
            latent_channels=kwargs["vae_latent_channels"],
            num_attention_heads=ORIGINAL_ATTENTION_HEADS,
            decoder_dim=kwargs["decoder_dim"],
            decoder_rates=rates,
            # The original pairs an upsampling rate u with kernel 2u (even u) or 2u - 1 (odd u).
            decoder_kernel_sizes=[2 * rate - rate % 2 for rate in rates],
            sample_rate=kwargs["sample_rate"],
            latents_mean=config["latents_mean"],
            latents_std=config["latents_std"],
        ),
        folder,
    )


# ----------------------------------------------------------------------------------------------
# Single files


def _single_file(path: Path) -> AudioVAESource:
    check_safetensors_file(path, "H3 audio VAE")
    keys = tensor_names([path])
    prefix = SINGLE_FILE_PREFIX if any(key.startswith(SINGLE_FILE_PREFIX) for key in keys) else ""
    if prefix + SINGLE_FILE_MARKER not in keys:
        raise CheckpointError(
            f"{path.name} holds no H3 audio VAE tensors (expected e.g. '{SINGLE_FILE_MARKER}', optionally prefixed "
            f"'{SINGLE_FILE_PREFIX}')."
        )
    return AudioVAESource(path, None, "single file", prefix)


def infer_config(source: AudioVAESource) -> AudioVAEConfig:
    """Read a single file's config off its tensor shapes and its `latents_mean` / `latents_std` tensors
    (without them, the released statistics). The attention head count is not visible in any shape; it is the
    original's fixed 8, and the dilations of an AMP block with n convolutions are the release's first n."""
    shapes, statistics = {}, {}
    with open_safetensors(source.file) as handle:
        for key in handle.keys():
            if not key.startswith(source.prefix):
                continue
            name = key[len(source.prefix) :]
            if name in STATISTICS:
                statistics[name] = handle.get_tensor(key).float().tolist()
            else:  # a folded weight has the shape of its weight_v
                shapes[name.removesuffix("_v")] = tuple(handle.get_slice(key).get_shape())
    path = source.file

    def shape(name: str) -> tuple[int, ...]:
        if name not in shapes:
            raise CheckpointError(f"{path.name} has no tensor '{name}'; cannot tell the audio VAE's size.")
        return shapes[name]

    def count(template: str, start: int = 0) -> int:
        """How many consecutive indices from `start` the template names."""
        index = start
        while template.format(index) in shapes:
            index += 1
        return index - start

    stages = count("decoder.ups.{}.0.weight")
    blocks = count("decoder.resblocks.{}.convs1.0.weight")
    if not stages or blocks % stages:
        raise CheckpointError(f"{path.name}: {stages} decoder upsamplers and {blocks} AMP blocks do not form stages.")
    blocks_per_stage = blocks // stages
    release_dilations = AudioVAEConfig().resblock_dilation_sizes[0]
    encoder_blocks = range(1, 1 + count("encoder.block.{}.block.4.weight", start=1))  # block 0 is the stem
    values = dict(
        encoder_dim=shape("encoder.block.0.weight")[0],
        encoder_rates=[shape(f"encoder.block.{i}.block.4.weight")[2] // 2 for i in encoder_blocks],  # kernel 2s
        latent_dim=shape("pre_block.norm1.weight")[0],
        latent_channels=shape("mean_proj.weight")[0],
        num_attention_heads=ORIGINAL_ATTENTION_HEADS,
        decoder_dim=shape("decoder.conv_pre.weight")[0],
        decoder_rates=[math.ceil(shape(f"decoder.ups.{i}.0.weight")[2] / 2) for i in range(stages)],
        decoder_kernel_sizes=[shape(f"decoder.ups.{i}.0.weight")[2] for i in range(stages)],
        resblock_kernel_sizes=[shape(f"decoder.resblocks.{j}.convs1.0.weight")[2] for j in range(blocks_per_stage)],
        resblock_dilation_sizes=[
            release_dilations[: count(f"decoder.resblocks.{j}.convs1.{{}}.weight")] for j in range(blocks_per_stage)
        ],
        **statistics,
    )
    return _config(lambda: AudioVAEConfig(**values), path)


# ----------------------------------------------------------------------------------------------
# Streaming the tensors in


def fold_weight_norm(direction: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """`weight_v`, `weight_g` -> weight = g * v / ||v||, the norm over every dim but the first (weight_norm with
    dim=0; for a transposed convolution that is the input-channel dim). Computed in fp32 by torch's own
    weight-norm kernel, the one the reference runs before every forward, so the folded weight is bit-identical
    to the weight the reference convolves with; returned in `weight_v`'s dtype."""
    return torch._weight_norm(direction.float(), magnitude.float(), 0).to(direction.dtype)


def model_tensors(items: Iterable[Item], model: AudioVAE, skip: Iterable[str] = ()) -> Iterator[Item]:
    """Map (checkpoint name, tensor, file) items of any layout onto the model's names: fold weight-norm pairs
    (the first half of a pair waits until its partner is read), check and drop the Kaiser filters and the unused
    log-std head, drop the names in `skip` (already read as config)."""
    skip = set(skip)
    halves: dict[str, dict[str, tuple[torch.Tensor, Path | str]]] = {}
    for name, tensor, where in items:
        if name in skip:
            continue
        if name.endswith((".weight_g", ".weight_v")):
            stem, half = name[: -len("_g")], name[-1]
            pair = halves.setdefault(stem, {})
            if half in pair:
                raise CheckpointError(f"Tensor '{name}' appears twice ({where}).")
            pair[half] = tensor, where
            if len(pair) == 2:
                del halves[stem]
                (direction, _), (magnitude, _) = pair["v"], pair["g"]
                if magnitude.shape != (direction.shape[0],) + (1,) * (direction.ndim - 1):
                    raise CheckpointError(
                        f"Tensor '{stem}_g' in {where} has shape {list(magnitude.shape)}; the magnitudes of a "
                        f"'{stem}_v' of shape {list(direction.shape)} must be [{direction.shape[0]}, 1, 1]."
                    )
                yield stem, fold_weight_norm(direction, magnitude), where
            continue
        filter_suffix = next((suffix for suffix in FILTER_SUFFIXES if name.endswith(suffix)), None)
        if filter_suffix is not None:
            _check_filter(model, name[: -len(filter_suffix)] + FILTER_SUFFIXES[filter_suffix], name, tensor, where)
        elif name.startswith(UNUSED_HEAD):
            _check_unused_head(model, name, tensor, where)
        else:
            yield name, tensor, where
    for stem, pair in halves.items():
        present, absent = ("g", "v") if "g" in pair else ("v", "g")
        raise CheckpointError(f"'{stem}_{present}' in {pair[present][1]} has no '{stem}_{absent}' to fold it with.")


def _check_filter(model: AudioVAE, ours: str, name: str, tensor: torch.Tensor, where) -> None:
    try:
        expected = model.get_buffer(ours)
    except AttributeError:
        raise CheckpointError(f"Unexpected tensor '{name}' in {where}; it is not part of this model.") from None
    if tensor.shape != expected.shape:
        raise CheckpointError(
            f"Tensor '{name}' in {where} has shape {list(tensor.shape)}, expected {list(expected.shape)}."
        )
    if tensor.is_meta and tensor.is_floating_point():  # a check of the headers: the values are checked when read
        return
    tolerance = max(FILTER_TOLERANCE, torch.finfo(tensor.dtype).eps) if tensor.is_floating_point() else 0.0
    if not tensor.is_floating_point() or not torch.allclose(tensor.float(), expected, rtol=0, atol=tolerance):
        raise CheckpointError(
            f"Tensor '{name}' in {where} is not the Kaiser-sinc low-pass filter of BigVGAN's anti-aliased "
            "activation (2x, 12 taps) that this model computes."
        )


def _check_unused_head(model: AudioVAE, name: str, tensor: torch.Tensor, where) -> None:
    expected = dict(model.mean_proj.named_parameters()).get(name[len(UNUSED_HEAD) :])
    if expected is None or tensor.shape != expected.shape:
        raise CheckpointError(
            f"Tensor '{name}' in {where} does not fit the log-std head (shaped like mean_proj) of this model."
        )


def check_audio_vae(path: str | Path) -> AudioVAE:
    """Every check `load_audio_vae` makes but the filters' values, on the file's headers alone: a host refuses a
    broken file before it loads anything else. The model comes back on the meta device in fp32, as it loads."""
    return load_audio_vae(path, device="meta")


def load_audio_vae(
    path: str | Path, dtype: torch.dtype | None = torch.float32, device: str | torch.device = "cpu",
    on_tensor: Callable[[int, int], None] | None = None,
) -> AudioVAE:
    """Load the audio VAE strictly from any accepted layout, in fp32 by default whatever the file stores: the
    release is fp32, and a community bf16 / fp16 file run as stored decodes audibly worse (see `vae_audio`), so
    it is widened. `dtype=None` keeps the checkpoint's dtypes. `device="meta"` reads the headers only
    (`check_audio_vae`). `tiny-random`: the embedded demo VAE (float32), made, not read. `on_tensor(done,
    total)` after each tensor read."""
    check_load_device(device, headers_only=True)
    if str(path) == TINY_RANDOM:
        return tiny_random_audio_vae(device)
    with config_errors(f"The audio VAE at {path}"):
        source = locate_audio_vae(path)
        config = source.config or infer_config(source)
        with torch.device("meta"):
            model = AudioVAE(config)
    headers_only = torch.device(device).type == "meta"

    def items() -> Iterator[Item]:
        for key, tensor, where in (read_headers if headers_only else read_tensors)([source.file]):
            if key.startswith(source.prefix):
                yield key[len(source.prefix) :], tensor, where

    skip = STATISTICS if source.config is None else ()  # a single file's statistics went into its config
    origin = f"{source.file} ({source.origin})"
    assign_strictly(model, model_tensors(items(), model, skip), origin, lambda name: dtype, device, on_tensor)
    if headers_only:
        return model
    return model.to(device).eval().requires_grad_(False)  # `to` moves the filters, which were never on meta
