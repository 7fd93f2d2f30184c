"""Finding and loading DiT weights from every layout users have, strictly and shard by shard.

Accepted: an original release root or partition folder (`FL2VA/transformer`, `Ref2VA/transformer`:
sharded safetensors + index, qkv interleaved per head), a diffusers folder (`transformer/` or
`transformer_ref/`), a ComfyUI single file (qkv stacked), or a GGUF file of one (`gguf_file`). Tensors are read
one at a time and assigned into a model built on the meta device, so the model is never held twice.
Checkpoint dtypes are kept unless a dtype is asked for (a GGUF file's DiT computes in bf16 unless told).
Pickle formats are refused.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import fp8, gguf_file, keymap, nvfp4
from .config import DiTConfig
from .dit import H3DiT, fp32_modules, rope_inverse_frequencies
from .memory_plan import HELD_COST_ORDER, gguf_held
from .placement import check_load_device, module_bytes
from .tiny import TINY_RANDOM, tiny_model_dtype, tiny_random_dit
from .weights import (
    CheckpointError,
    assign_strictly,
    check_safetensors_file,
    config_errors,
    described,
    files_place,
    open_safetensors,
    read_headers,
    read_json,
    read_tensors,
    refuse_a_shard,
    shard_files,
    tensor_names,
)

PARTITIONS = {"fl2va": ("FL2VA", "transformer"), "ref2va": ("Ref2VA", "transformer_ref")}
INDEX_NAMES = ("model.safetensors.index.json", "diffusion_pytorch_model.safetensors.index.json")


@dataclass(frozen=True)
class DiTSource:
    """Where a DiT's tensors live and how they are spelled."""

    files: tuple[Path, ...]
    naming: str  # "native" (original / ComfyUI names) or "diffusers"
    qkv_layout: str  # "interleaved" (original shards) or "stacked" (ComfyUI, diffusers after concat)
    config: DiTConfig | None  # None: infer from tensor shapes (single files carry no config)
    origin: str  # a short description for messages: "original partition", "diffusers folder", ...
    fp8_layers: dict = field(default_factory=dict, compare=False)  # layer -> fp8.FP8Entry (fp8_scaled files)
    nvfp4_layers: dict = field(default_factory=dict, compare=False)  # layer -> nvfp4.NVFP4Entry (nvfp4 files)
    gguf_tensors: dict = field(default_factory=dict, compare=False)  # name -> gguf_file.GGUFEntry (GGUF files)

    @property
    def is_gguf(self) -> bool:
        return gguf_file.is_gguf(self.files[0])


def held_linears(source: DiTSource | None, mode: str, dtype_bytes: int = 2) -> str:
    """How a load of `source` (None: a model made here, dense) in linears `mode` (fp8.LINEAR_MODES) holds the
    block linears (memory_plan.HELD_FORMATS): as the file stores them unless dequantized ("dense") or
    requantized to FP8 ("fp8-lossy"); a dense file's as the mode makes them. `dtype_bytes`: the model dtype's,
    what a GGUF file's plain block linears are read in."""
    if mode == "fp8-lossy":
        return "fp8-scaled"
    dense = "fp8" if mode == "fp8-weights-lossy" else "dense"
    if source is None or mode == "dense":
        return dense
    if any(entry.quantized for entry in source.gguf_tensors.values()):
        return _gguf_held(source.gguf_tensors, 1 if mode == "fp8-weights-lossy" else dtype_bytes)
    layers = {**source.fp8_layers, **source.nvfp4_layers}
    if not layers or not _every_block_linear(layers, source.config):  # blocks the file left dense cost the most
        return dense
    held = {"int4" if getattr(entry, "packed", False) else "nvfp4" if name in source.nvfp4_layers
            else "int8" if entry.rotation else "fp8" for name, entry in layers.items()}
    return max(held, key=HELD_COST_ORDER.index)


def holds_stored_linears(source: DiTSource | None) -> bool:
    """Whether a file keeps some linears quantized as it stores them (FP8, int8, int4, NVFP4, GGUF blocks), anywhere
    in the model: LoRAs are then hooked, their factors held beside the weights (lora.run_mode), not merged."""
    return source is not None and bool(source.fp8_layers or source.nvfp4_layers
                                       or any(entry.quantized for entry in source.gguf_tensors.values()))


def _every_block_linear(layers: dict, config: DiTConfig | None) -> bool:
    """Whether `layers` (quantized layer names) hold every block's four linears; without a config (a single file
    not yet read with `with_config`), of the blocks they name."""
    indices = [int(name.split(".")[1]) for name in layers if name.startswith("blocks.")]
    count = config.num_layers if config is not None else 1 + max(indices, default=-1)
    return count > 0 and all(f"blocks.{index}.{leaf}" in layers for index in range(count) for leaf in fp8.BLOCK_LINEARS)


def locate_dit(path: str | Path, partition: str = "fl2va") -> DiTSource:
    """Resolve a user path (release root, partition folder, transformer folder or single file)."""
    path = Path(path).expanduser()
    if partition not in PARTITIONS:
        raise ValueError(f"Unknown partition {partition!r}; choose one of {', '.join(PARTITIONS)}.")
    if not path.exists():
        raise CheckpointError(f"{path} does not exist.")
    if path.is_file():
        _check_partition(partition, _partition_of_file(path), path)
        refuse_a_shard(path, "DiT")
        return _gguf_file(path) if gguf_file.is_gguf(path) else _single_file(path)
    original_partition, diffusers_folder = PARTITIONS[partition]
    # the partition's own folders first: a repository root holds both `transformer/` and `transformer_ref/`
    for candidate in (path, path / diffusers_folder, path / original_partition / "transformer", path / "transformer"):
        if (candidate / "config.json").is_file() and _has_safetensors(candidate):
            _check_partition(partition, _partition_of_folder(candidate), candidate)
            return _folder(candidate)
    raise CheckpointError(
        f"{path} is not an H3 DiT checkpoint for partition {partition!r}: expected a folder with config.json and "
        f"*.safetensors shards (an original '{original_partition}/transformer' folder, a diffusers "
        f"'{diffusers_folder}' folder, or either of their parents), or a single .safetensors or .gguf file."
    )


def _partition_of_file(path: Path) -> tuple[str, str] | None:
    """(partition, how we know) from a single file's name (Comfy-Org: minimax_h3_{fl2va,ref2va}_bf16), if it says."""
    named = [partition for partition in PARTITIONS if partition in path.name.lower()]
    return (named[0], "by its file name") if len(named) == 1 else None


def _partition_of_folder(folder: Path) -> tuple[str, str] | None:
    """(partition, how we know) of a transformer folder, from what surrounds it: a diffusers repository's
    `transformer_ref/` (Ref2VA) beside `transformer/` (FL2VA), the partition's model_index.json
    (`_minimax_h3.partition`), or an original partition folder's name (FL2VA/, Ref2VA/)."""
    if folder.name == PARTITIONS["ref2va"][1]:
        return "ref2va", f"a '{folder.name}' folder"
    index = folder.parent / "model_index.json"
    try:
        raw = read_json(index) if index.is_file() else {}
    except CheckpointError:
        raw = {}  # an unreadable index says nothing; the weights themselves are checked as they load
    labels = raw.get("_minimax_h3")
    named = labels.get("partition") if isinstance(labels, dict) else None
    if named in PARTITIONS:
        return named, f"its {index.name} says so"
    if folder.name == PARTITIONS["fl2va"][1] and PARTITIONS["ref2va"][1] in raw:
        return "fl2va", f"'{folder.name}' beside '{PARTITIONS['ref2va'][1]}' in {index.name}"
    by_name = {original.lower(): partition for partition, (original, _) in PARTITIONS.items()}
    if folder.parent.name.lower() in by_name:
        return by_name[folder.parent.name.lower()], f"it is in {folder.parent.name}/"
    return None


def _check_partition(partition: str, found: tuple[str, str] | None, where: Path) -> None:
    """Refuse weights that say they are the other partition: both have the same shapes, so they would
    load and run the wrong task's model without a word."""
    if found is None or found[0] == partition:
        return
    named, how = found
    raise CheckpointError(
        f"{where} holds H3's {PARTITIONS[named][0]} DiT ({how}), but partition {partition!r} was asked for. "
        f"t2va and fl2va run on FL2VA, ref2va on Ref2VA: choose partition '{named}', or give the "
        f"{PARTITIONS[partition][0]} weights."
    )


def _has_safetensors(folder: Path) -> bool:
    return any(folder.glob("*.safetensors"))


def _single_file(path: Path) -> DiTSource:
    check_safetensors_file(path, "H3 DiT single", " (or GGUF, .gguf)")
    keys = tensor_names([path])
    naming = _naming([key for key in keys if keymap.is_dit_key(key)], path)
    nvfp4_layers = _nvfp4_layers((path,), naming == "native")
    layers = _fp8_layers((path,), naming == "native", nvfp4.outside(nvfp4_layers, keymap.dit_name))
    held = ("NVFP4" if nvfp4_layers else "int4" if any(e.packed for e in layers.values())
            else "int8" if any(e.dtype == torch.int8 for e in layers.values()) else "FP8" if layers else None)
    kind = "single file" if all(map(keymap.is_dit_key, keys)) else "all-in-one file"  # its other models unread
    return DiTSource((path,), naming, "stacked", None, f"{kind} ({held})" if held else kind, layers, nvfp4_layers)


def _gguf_file(path: Path) -> DiTSource:
    entries, (arch,) = gguf_file.gguf_entries(path)
    if _naming(list(entries), path) != "native":
        raise CheckpointError(f"{path.name} is a GGUF file with diffusers names; GGUF DiT files are read in the "
                              "ComfyUI single file's layout (release names, qkv stacked), as ComfyUI-GGUF makes them.")
    tensors = {native_name(key): entry for key, entry in entries.items()}
    kinds = sorted({entry.qtype for entry in tensors.values()})
    named = f"architecture '{arch}'; " if arch else ""  # ComfyUI-GGUF names the model: a wrong file shows here
    return DiTSource((path,), "native", "stacked", None, f"GGUF file ({named}{', '.join(kinds)})", gguf_tensors=tensors)


def _gguf_held(tensors: dict, plain_bytes: int) -> str:
    """memory_plan's held format for a GGUF file's block linears: the costliest block's bytes a weight, plain
    (unquantized) ones at `plain_bytes` (the model dtype's, or FP8's where fp8-weights-lossy quantizes them)."""
    blocks: dict[str, list[float]] = {}
    for name, entry in tensors.items():
        parts = name.split(".")
        if parts[0] == "blocks" and parts[-1] == "weight" and ".".join(parts[2:-1]) in fp8.BLOCK_LINEARS:
            weights = math.prod(entry.shape)
            totals = blocks.setdefault(parts[1], [0.0, 0.0])
            totals[0] += weights * (entry.bytes_per_weight if entry.quantized else plain_bytes)
            totals[1] += weights
    return gguf_held(blocks.values())


def _folder(folder: Path) -> DiTSource:
    raw = read_json(folder / "config.json")
    files = shard_files(folder, INDEX_NAMES)
    names = tensor_names(files)
    naming = _naming(names, folder)
    _nvfp4_layers(files, supported=False)
    _fp8_layers(files, supported=False)
    # FastVideo's VSA students (FastH3 8-Step V2) carry a gate per attention; diffusers' config does not say so
    try:
        config = dataclasses.replace(DiTConfig.from_dict(raw), vsa_gates=any(name.endswith(SPARSE_ATTENTION_GATE)
                                                                            for name in names))
    except (ValueError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{folder / 'config.json'}: {error}") from None
    blocks = {int(m.group(1)) for name in names if (m := re.match(r"(?:.+\.)?(?:transformer_)?blocks\.(\d+)\.", name))
              and "refiner" not in name}
    if len(blocks) != config.num_layers:  # said from the headers, before a model of the config's size is built
        raise CheckpointError(f"{folder / 'config.json'} says {config.num_layers} transformer blocks, but the folder's "
                              f"files hold {len(blocks)}: the config and the weights come from different models.")
    if naming == "diffusers":
        return DiTSource(files, naming, "stacked", config, "diffusers folder")
    return DiTSource(files, naming, "interleaved", config, "original partition folder")


def _fp8_layers(files: tuple[Path, ...], supported: bool, rename=keymap.dit_name) -> dict:
    """The FP8 (and int8) layers of a ComfyUI fp8_scaled / int8 single file (native names, qkv stacked); FP8
    anywhere else, and any quantization other than these and NVFP4 (`rename` leaves NVFP4 layers out), is
    refused."""
    layers = fp8.checkpoint_fp8_layers(files, rename)
    if layers and not supported:
        raise CheckpointError(f"{files_place(files)} holds FP8 weights; FP8 is read from ComfyUI-style single files "
                              "(release names, fp8_scaled) only.")
    return layers


def _nvfp4_layers(files: tuple[Path, ...], supported: bool) -> dict:
    """The NVFP4 layers of a ComfyUI nvfp4 single file (native names, qkv stacked); refused anywhere else."""
    layers = nvfp4.checkpoint_nvfp4_layers(files, keymap.dit_name)
    if layers and not supported:
        raise CheckpointError(f"{files_place(files)} holds NVFP4 weights; NVFP4 is read from ComfyUI-style single files "
                              "(release names) only.")
    return layers


def _naming(keys: list[str], path: Path) -> str:
    stripped = [keymap.strip_prefix(k) for k in keys]
    if any(k.startswith("transformer_blocks.") for k in stripped):
        return "diffusers"
    if any(k.startswith("blocks.") for k in stripped):
        return "native"
    raise CheckpointError(
        f"{path.name} holds no H3 DiT tensors (expected keys 'blocks.N.*' or 'transformer_blocks.N.*')."
    )


def with_config(source: DiTSource) -> DiTSource:
    """`source` with its config (a single file's read off its headers here), so the checks and the reader that
    follow do not read the headers again."""
    return source if source.config is not None else dataclasses.replace(source, config=infer_config(source))


def vsa_student(source: DiTSource) -> bool:
    """Whether the DiT carries FastVideo's VSA gates (FastH3 8-Step V2): it runs Video Sparse Attention on its
    own ladder (lora.VSA_STUDENT_CONTRACT)."""
    return (source.config or infer_config(source)).vsa_gates


def infer_config(source: DiTSource) -> DiTConfig:
    """Read a config off the tensor shapes (single files ship none)."""
    with config_errors(f"The DiT in {source.files[0].name}"):  # a 0-d or empty tensor where a matrix goes
        return _config_from_shapes(source)


def _config_from_shapes(source: DiTSource) -> DiTConfig:
    shapes, inv_freq = _gguf_shapes(source) if source.is_gguf else _safetensors_shapes(source)

    def shape(name):
        if name not in shapes:
            raise CheckpointError(f"{source.files[0].name} has no tensor '{name}', which every H3 DiT has: it is "
                                  "not an H3 DiT file, or one cut short (the model size cannot be told).")
        return shapes[name]

    head_dim = shape("blocks.0.attn.q_norm.weight")[0]
    patch_volume = 4
    num_layers = 1 + max(int(m.group(1)) for k in shapes if (m := re.match(r"blocks\.(\d+)\.", k)))
    refiner = {int(m.group(1)) for k in shapes if (m := re.match(r"token_refiner\.blocks\.(\d+)\.", k))}
    if CURVE_FORM_TABLE in shapes:  # curve form: the table's rows and width instead of a time embedder
        grid, width = shape(CURVE_FORM_TABLE)
        time_embedder = {"adaln_curve_grid": grid, "time_embed_dim": width}
    else:
        time_embedder = {"freq_dim": shape("time_embedder.proj_in.weight")[1],
                         "time_embed_hidden_dim": shape("time_embedder.proj_in.weight")[0],
                         "time_embed_dim": shape("time_embedder.proj_out.weight")[0]}
    return DiTConfig(
        num_attention_heads=shape("blocks.0.attn.out_proj.weight")[1] // head_dim,
        attention_head_dim=head_dim,
        hidden_size=shape("condition_proj.weight")[0],
        num_layers=num_layers,
        num_refiner_layers=len(refiner),
        ffn_dim=shape("blocks.0.mlp.fc2.weight")[1],
        in_channels=shape("video_patch_proj.weight")[1] // patch_volume,
        audio_in_channels=shape("audio_patch_proj.weight")[1],
        text_dim=shape("condition_proj.weight")[1],
        **time_embedder,
        # The release ships rope.inv_freq; without it, the release's ratio (16 frequencies per 128 channels).
        rope_freq_dim=int(inv_freq.numel()) if inv_freq is not None else head_dim // 8,
        vsa_gates="blocks.0.attn.gate_compress.weight" in shapes,
    )


def _safetensors_shapes(source: DiTSource) -> tuple[dict[str, tuple[int, ...]], torch.Tensor | None]:
    """Every tensor's shape in our names (packed 4-bit weights unpacked), and the shipped rope.inv_freq."""
    shapes: dict[str, tuple[int, ...]] = {}
    inv_freq = None
    packed = set(source.nvfp4_layers) | {layer for layer, entry in source.fp8_layers.items() if entry.packed}
    for path in source.files:
        with open_safetensors(path) as handle:
            for key in filter(keymap.is_dit_key, handle.keys()):
                name = native_name(key)
                if source.naming == "diffusers":
                    name = keymap.diffusers_to_native_name(name)[0]
                shapes[name] = tuple(handle.get_slice(key).get_shape())
                if name.removesuffix(".weight") in packed and len(shapes[name]) == 2:
                    shapes[name] = (shapes[name][0], 2 * shapes[name][1])  # two 4-bit weights a byte
                if name == "rope.inv_freq":
                    inv_freq = handle.get_tensor(key)
    return shapes, inv_freq


def _gguf_shapes(source: DiTSource) -> tuple[dict[str, tuple[int, ...]], torch.Tensor | None]:
    shapes = {name: entry.shape for name, entry in source.gguf_tensors.items()}
    if "rope.inv_freq" not in shapes:
        return shapes, None
    _, inv_freq, _ = next(gguf_file.read_gguf(source.files[0], only=lambda key: native_name(key) == "rope.inv_freq"))
    return shapes, inv_freq


def native_name(key: str) -> str:
    """Our name for a key of a file in release names (a ComfyUI single file's prefix stripped, the curve form's
    table renamed)."""
    name = keymap.strip_prefix(key)
    return CURVE_FORM_TABLE if name == CURVE_TABLE else name


SPARSE_ATTENTION_GATE = ".to_gate_compress.weight"  # FastVideo's VSA gate, one per block's attention (h3-model.md H)
CURVE_TABLE = "adaln_t_table"  # a curve-form ("pruned") file's sampled AdaLN input: our time_embedder.table
CURVE_FORM_TABLE = "time_embedder.table"


def to_native(items, naming: str, qkv_layout: str, head_dim: int):
    """Map (key, tensor, where) items of any layout onto our names; diffusers q/k/v are fused as soon as
    all three have been read, so at most a few attention weights wait in memory."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor, where in items:
        name = native_name(key)
        if naming == "diffusers":
            name, part = keymap.diffusers_to_native_name(name)
            if name.endswith(".mlp.fc1.weight"):
                tensor = keymap.swap_halves(tensor)
            if part is not None:
                parts = pending.setdefault(name, {})
                parts[part] = tensor
                if len(parts) == 3:
                    del pending[name]
                    yield name, torch.cat([parts["q"], parts["k"], parts["v"]], dim=0), where
                continue
        elif qkv_layout == "interleaved" and name.endswith(".attn.qkv_proj.weight"):
            if tensor.shape[0] % (3 * head_dim):
                raise CheckpointError(
                    f"'{key}' in {where} has shape {list(tensor.shape)}; its rows must be a multiple of "
                    f"3 x head_dim ({3 * head_dim})."
                )
            tensor = keymap.deinterleave_qkv(tensor, head_dim)
        yield name, tensor, where
    for name, parts in pending.items():
        missing = sorted(set("qkv") - set(parts))
        raise CheckpointError(f"'{name}': the diffusers checkpoint lacks to_{'/to_'.join(missing)} for this attention.")


def convert_state_dict(state_dict: dict, naming: str, qkv_layout: str = "stacked", head_dim: int = 128) -> dict:
    """An in-memory state dict of any layout -> our names (what `load_dit` streams from files)."""
    items = ((key, tensor, "state dict") for key, tensor in state_dict.items())
    return {name: tensor for name, tensor, _ in to_native(items, naming, qkv_layout, head_dim)}


def load_dit(
    path: str | Path,
    partition: str = "fl2va",
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    config: DiTConfig | None = None,
    linears: str = "checkpoint",
) -> H3DiT:
    """Load a DiT strictly. `dtype=None` keeps each tensor's checkpoint dtype; else the release policy
    (fp32 projections/heads, `dtype` elsewhere) is applied tensor by tensor while streaming.
    `linears` (fp8.LINEAR_MODES): FP8 weights of an fp8_scaled file stay FP8 ("checkpoint") or are
    dequantized ("dense"); the "fp8-*-lossy" modes also quantize dense block linears as they stream in.
    `tiny-random`: the embedded demo model (the same weights for both partitions, float32 on the CPU), made, not
    read; labelled with `partition` as a read DiT is, so sample() refuses the other partition's tasks alike."""
    check_load_device(device)
    if str(path) == TINY_RANDOM:
        if partition not in PARTITIONS:
            raise ValueError(f"Unknown partition {partition!r}; choose one of {', '.join(PARTITIONS)}.")
        dit = tiny_random_dit(tiny_model_dtype(device, dtype), device)
        dit.partition = partition
        return dit
    return DiTReader(path, partition, dtype, config, linears, device).read(device)


class DiTReader:
    """One checkpoint's DiT, whose weights can be read, dropped and read again. Built from the files'
    headers only: `model` is the DiT on the meta device, its FP8 layers chosen, and every strict check
    (names, shapes, nothing missing) already run on the headers, so its tensors carry the shapes and
    dtypes the read will give and a broken file is refused before any data is read. `read(device)`
    fills it; `drop()` empties it again (every weight back on the meta device), so a host short of CPU
    memory can let a model it does not need now go and read it back later; the module objects, and
    whatever holds them, stay the same. `path`: anything `locate_dit` takes, or its DiTSource (a caller that
    located it already). `device` (for the FP8 checks): where it computes."""

    def __init__(self, path: str | Path | DiTSource, partition: str = "fl2va", dtype: torch.dtype | None = None,
                 config: DiTConfig | None = None, linears: str = "checkpoint",
                 device: str | torch.device = "cpu"):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"The DiT's dtype is a floating point torch dtype (bf16, fp16, fp32) or None (as stored); "
                             f"got {dtype!r}.")
        self.source = path if isinstance(path, DiTSource) else locate_dit(path, partition)
        # a GGUF file's plain tensors are F32 / F16 / BF16 by size, not by what the model computes in
        self.dtype = dtype = torch.bfloat16 if dtype is None and self.source.is_gguf else dtype
        config = config or self.source.config or infer_config(self.source)
        with torch.device("meta"):
            self.model = H3DiT(config)
        self.model.partition = partition  # which tasks it serves: sample() refuses the other partition's
        self._nvfp4 = _plan_nvfp4(self.model, self.source.nvfp4_layers, linears, dtype)
        self._gguf = _plan_gguf(self.model, self.source.gguf_tensors, linears, dtype)
        self._fp8 = fp8.FP8Load.plan(self.model, self.source.fp8_layers, linears, dtype, fp32_modules(config), device)
        self._fill(self._items(data=False), "meta")

    @property
    def nbytes(self) -> int:
        """The bytes the model's weights take once read."""
        return sum(t.numel() * t.element_size() for t in self.model.state_dict().values())

    @property
    def adaln_nbytes(self) -> int:
        """The bytes the timestep-only weights (`H3DiT.adaln_modules`) take once read: a quantized file's AdaLN
        projections stay as it stores them unless the linears mode dequantizes them."""
        return module_bytes(self.model.adaln_modules())

    @property
    def is_read(self) -> bool:
        return not any(t.is_meta for t in self.model.state_dict().values())

    def read(self, device: str | torch.device = "cpu", on_tensor: Callable[[int, int], None] | None = None) -> H3DiT:
        """Fill the model from the files onto `device` (a read model is returned as it is); `on_tensor(done,
        total)` after each tensor (a progress bar; raising there stops the read and drops what was read)."""
        if self.is_read:
            return self.model
        for file in self.source.files:
            if not file.exists():
                raise CheckpointError(f"{file} is gone: the DiT cannot be read from it.")
        try:
            self._fill(self._items(data=True), device, on_tensor)
        except BaseException:
            self.drop()  # nothing half-read stays behind
            raise
        self.model.rope_inv_freq = rope_inverse_frequencies(self.model.config).to(device)
        return self.model.eval().requires_grad_(False)

    def drop(self) -> None:
        """Every weight back on the meta device (shapes and dtypes kept), its memory freed once nothing
        else holds it."""
        for module in self.model.modules():
            for name, tensor in module._parameters.items():
                if tensor is not None and not tensor.is_meta:
                    module._parameters[name] = torch.nn.Parameter(tensor.to("meta"), requires_grad=False)
            for name, tensor in module._buffers.items():
                if tensor is not None and not tensor.is_meta:
                    module._buffers[name] = tensor.to("meta")

    def _items(self, data: bool):
        """The files' (key, tensor, file) items: their tensors, or (`data=False`) meta tensors from the headers."""
        if self.source.is_gguf:  # its headers were read when it was located
            if data:
                return gguf_file.read_gguf(self.source.files[0])
            return ((name, entry.read_as(), self.source.files[0]) for name, entry in self.source.gguf_tensors.items())
        return (read_tensors if data else read_headers)(self.source.files, only=keymap.is_dit_key)

    def _fill(self, items, device, on_tensor=None) -> None:
        """Assign the file's (key, tensor, file) `items` strictly, in our names, the release dtype policy
        and the FP8 plan applied (meta tensors from the headers check everything but the values)."""
        model, source, dtype = self.model, self.source, self.dtype
        fp8_parameters = self._fp8.fp8_parameters
        in_fp32 = fp32_modules(model.config)

        def without_inv_freq():
            for name, tensor, file in to_native(items, source.naming, source.qkv_layout, model.config.attention_head_dim):
                if name == "rope.inv_freq":  # shipped by the release; we recompute it, after checking it agrees
                    _check_inv_freq(tensor, model, file)
                else:
                    yield name, tensor, file

        def release_policy(name: str) -> torch.dtype | None:
            if name in fp8_parameters:
                return None
            if name.startswith(in_fp32) and (dtype is not None or model.config.curve_form):
                return torch.float32  # the curve form's AdaLN is fp32 even when the file stores bf16 / fp16
            return self._nvfp4.dtype_for(name, self._gguf.dtype_for(name, dtype))

        origin = described(source.files, source.origin)
        tensors = self._fp8.stream(self._nvfp4.stream(self._gguf.stream(without_inv_freq(), device), device), device)
        assign_strictly(model, tensors, origin, release_policy, device, on_tensor)


def _plan_nvfp4(model: H3DiT, layers: dict, linears: str, dtype: torch.dtype | None) -> nvfp4.NVFP4Load:
    """NVFP4 linears stay NVFP4 where the DiT may hold stored linears (fp8.storable_linears), except under
    "dense" and, for the block linears, under "fp8-lossy" (dequantized here, then requantized to e4m3 for FP8
    matmuls); everything else NVFP4 is dequantized at load (fp32 modules in fp32)."""
    compute = dtype or torch.bfloat16
    in_fp32 = fp32_modules(model.config)
    storable = fp8.storable_linears(model, in_fp32)
    requantized = set(fp8.block_linear_names(model)) if linears == "fp8-lossy" else set()
    return nvfp4.NVFP4Load.plan(
        model, layers, keep=lambda layer: linears != "dense" and layer in storable and layer not in requantized,
        compute=compute, dense_dtype=lambda layer: torch.float32 if layer.startswith(in_fp32) else compute)


def _plan_gguf(model: H3DiT, tensors: dict, linears: str, dtype: torch.dtype | None) -> gguf_file.GGUFLoad:
    """Quantized GGUF linears stay quantized where NVFP4 ones would (`_plan_nvfp4`); every other quantized tensor
    is dequantized at load (fp32 modules in fp32)."""
    compute = dtype or torch.bfloat16
    in_fp32 = fp32_modules(model.config)
    storable = fp8.storable_linears(model, in_fp32)
    requantized = set(fp8.block_linear_names(model)) if linears == "fp8-lossy" else set()
    quantized = {name: entry for name, entry in tensors.items() if entry.quantized}
    return gguf_file.GGUFLoad.plan(
        model, quantized, keep=lambda layer: linears != "dense" and layer in storable and layer not in requantized,
        compute=compute, dense_dtype=lambda name: torch.float32 if name.startswith(in_fp32) else compute)


def _check_inv_freq(tensor: torch.Tensor, model: H3DiT, file: Path) -> None:
    expected = rope_inverse_frequencies(model.config)
    if tensor.shape != expected.shape:
        raise CheckpointError(f"'rope.inv_freq' in {file} has shape {list(tensor.shape)}, expected {list(expected.shape)}.")
    if tensor.is_meta:  # a check of the headers: the values are checked when read
        return
    # within the rounding of the dtype it is stored in (a file cast whole to bf16 holds the table in bf16); the
    # model uses the recomputed fp32 table either way
    tolerance = max(1e-6, torch.finfo(tensor.dtype).eps) if tensor.is_floating_point() else 1e-6
    if not torch.allclose(tensor.float(), expected, rtol=tolerance, atol=0):
        raise CheckpointError(
            f"'rope.inv_freq' in {file} does not match rope_theta={model.config.rope_theta} from the config."
        )
