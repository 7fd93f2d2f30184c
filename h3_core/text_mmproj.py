"""Qwen3-VL's vision tower from a llama.cpp "mmproj" file, for a GGUF text encoder.

llama.cpp's converter writes Qwen3-VL's language model and its vision tower to two GGUF files: the model
(architecture `qwen3vl`) and a projector file (architecture `clip`, projector type `qwen3vl_merger`) that users
keep beside it, named with "mmproj" (`mmproj-F16.gguf`, `Qwen3-VL-32B-Instruct-mmproj-Q8_0.gguf`). A GGUF text
encoder takes its vision tower from such a file in its folder (`find_vision_tower`), so keyframes and image /
video references work with it.

The projector file holds transformers' vision tensors one to one under llama.cpp's names, but for the
patch embedding's Conv3d kernel, split into its two temporal frames (`v.patch_embd.weight`, `.weight.1`) and
stacked back here; the DeepStack mergers are named by the vision block they follow (`v.deepstack.8.*`), the
merger's two linears `mm.0` and `mm.2`. Weights come as F32, F16, BF16 or Q8_0 (the converter's choices);
a quantized one is dequantized as it loads (the tower is ~0.6B parameters).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from . import gguf_file
from .weights import CheckpointError, Item

log = logging.getLogger("h3")

ARCHITECTURE = "clip"  # llama.cpp's architecture name for every projector file
PROJECTOR_FIELD = "clip.projector_type"
PROJECTOR = "qwen3vl_merger"  # Qwen3-VL's (gguf-py's VisionProjectorType.QWEN3VL)
MARKER = "mmproj"  # in the file names llama.cpp, unsloth and Qwen give projector files
PATCH_KERNEL_FRAMES = ("v.patch_embd.weight", "v.patch_embd.weight.1")
PATCH_KERNEL = "visual.patch_embed.proj.weight"
# llama.cpp's projector names (its Qwen3-VL converter) -> transformers' vision tower names
NAMES = {
    "v.patch_embd.bias": "visual.patch_embed.proj.bias", "v.position_embd.weight": "visual.pos_embed.weight",
    "v.post_ln.weight": "visual.merger.norm.weight", "v.post_ln.bias": "visual.merger.norm.bias",
    "mm.0.weight": "visual.merger.linear_fc1.weight", "mm.0.bias": "visual.merger.linear_fc1.bias",
    "mm.2.weight": "visual.merger.linear_fc2.weight", "mm.2.bias": "visual.merger.linear_fc2.bias",
}
BLOCK_PARTS = {"ln1": "norm1", "attn_qkv": "attn.qkv", "attn_out": "attn.proj", "ln2": "norm2",
               "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"}
DEEPSTACK_PARTS = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}


@dataclass(frozen=True)
class VisionTowerFile:
    """A projector file's tensors: each key's entry and the vision-tower name it fills (both patch-kernel
    frames name the one Conv3d kernel), and the vision blocks its DeepStack mergers follow."""

    path: Path
    entries: dict  # file key -> gguf_file.GGUFEntry
    names: dict  # file key -> our name
    deepstack_layers: tuple[int, ...]

    def check_fits(self, visual: torch.nn.Module, deepstack_layers) -> None:
        """Before anything is read: the file must hold exactly the (meta-built) vision tower's tensors in their
        shapes, its DeepStack mergers after the same blocks (they are matched in order)."""
        wanted = tuple(int(i) for i in deepstack_layers)
        if self.deepstack_layers != wanted:
            problem = (f"it has DeepStack mergers after vision blocks {list(self.deepstack_layers)}, this model after "
                       f"blocks {list(wanted)}")
        else:
            problem = _first_difference(self.shapes(), {f"visual.{name}": tuple(t.shape)
                                                        for name, t in visual.state_dict().items()})
        if problem:
            raise CheckpointError(f"{self.path.name} (beside the text encoder) is not this Qwen3-VL's vision tower: "
                                  f"{problem}. Keep Qwen3-VL-32B's mmproj file there, or move this one out.")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Our name -> the shape the file gives it (the patch kernel's: its two frames stacked)."""
        held = {self.names[key]: tuple(entry.shape) for key, entry in self.entries.items()}
        frame = self.entries[PATCH_KERNEL_FRAMES[0]].shape
        held[PATCH_KERNEL] = (*frame[:2], len(PATCH_KERNEL_FRAMES), *frame[2:])
        return held

    def quantized(self) -> dict:
        """Our name -> entry of its quantized tensors (dequantized as they load)."""
        return {self.names[key]: entry for key, entry in self.entries.items() if entry.quantized}

    def tensors(self, data: bool = True) -> Iterator[Item]:
        """(our name, tensor, path), one at a time; the patch kernel's two frames stacked into the Conv3d's.
        `data=False`: meta tensors in the shapes and dtypes the data would come in (from the headers)."""
        items = (gguf_file.read_gguf(self.path, only=lambda key: key in self.names) if data
                 else ((key, entry.read_as(), self.path) for key, entry in self.entries.items()))
        frames = {}
        for key, tensor, where in items:
            if key in PATCH_KERNEL_FRAMES:
                frames[key] = tensor
                if len(frames) == len(PATCH_KERNEL_FRAMES):
                    yield PATCH_KERNEL, torch.stack([frames[k] for k in PATCH_KERNEL_FRAMES], dim=2), where
                continue
            yield self.names[key], tensor, where


def _first_difference(held: dict, wanted: dict) -> str | None:
    """The first tensor (by name) a file holds that a model has not, lacks, or holds in another shape."""
    for name in sorted(set(held) | set(wanted)):
        if name not in held or name not in wanted:
            return f"'{name}' is {'missing' if name not in held else 'not part of this model'}"
        if held[name] != wanted[name]:
            return f"'{name}' is {list(held[name])}, this model's {list(wanted[name])}"
    return None


def vision_name(key: str, deepstack_rank: dict[int, int]) -> str | None:
    """A projector key -> the vision tower parameter it fills (None: not one of Qwen3-VL's); `deepstack_rank`
    gives each DeepStack merger's place among the file's."""
    if key in NAMES:
        return NAMES[key]
    if key in PATCH_KERNEL_FRAMES:
        return PATCH_KERNEL
    match = re.fullmatch(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)", key)
    if match and match.group(2) in BLOCK_PARTS:
        return f"visual.blocks.{match.group(1)}.{BLOCK_PARTS[match.group(2)]}.{match.group(3)}"
    match = re.fullmatch(r"v\.deepstack\.(\d+)\.(\w+)\.(weight|bias)", key)
    if match and match.group(2) in DEEPSTACK_PARTS:
        rank = deepstack_rank[int(match.group(1))]
        return f"visual.deepstack_merger_list.{rank}.{DEEPSTACK_PARTS[match.group(2)]}.{match.group(3)}"
    return None


def read_vision_tower(path: Path) -> VisionTowerFile:
    """A Qwen3-VL projector file's entries and names (headers only); anything else is refused by name."""
    entries, (arch, projector) = gguf_file.gguf_entries(
        path, "vision tower", fields=(gguf_file.ARCHITECTURE_FIELD, PROJECTOR_FIELD))
    if arch != ARCHITECTURE or projector != PROJECTOR:
        raise CheckpointError(f"{path.name} is not Qwen3-VL's vision tower as llama.cpp writes it (architecture "
                              f"'{ARCHITECTURE}', projector '{PROJECTOR}'); it says {arch!r}, {projector!r}.")
    layers = sorted({int(m.group(1)) for key in entries if (m := re.match(r"v\.deepstack\.(\d+)\.", key))})
    names = {key: vision_name(key, {layer: rank for rank, layer in enumerate(layers)}) for key in entries}
    unknown = [key for key, name in names.items() if name is None]
    if unknown:
        raise CheckpointError(f"{path.name} holds tensors Qwen3-VL's vision tower has not: {', '.join(unknown[:5])}.")
    missing = [key for key in PATCH_KERNEL_FRAMES if key not in entries]
    if missing:
        raise CheckpointError(f"{path.name} lacks {', '.join(missing)}: the patch kernel's frames, which H3 reads as "
                              "llama.cpp's converter splits them (temporal patch 2).")
    frames = [entries[key] for key in PATCH_KERNEL_FRAMES]
    if any(entry.quantized for entry in frames) or frames[0].shape != frames[1].shape:
        raise CheckpointError(f"{path.name}'s patch kernel frames must be two F32 / F16 / BF16 tensors of one shape; "
                              f"got {[(e.qtype, list(e.shape)) for e in frames]}.")
    return VisionTowerFile(path, entries, names, tuple(layers))


def companions(model_file: Path) -> list[Path]:
    """The GGUF files beside `model_file` named as projector files are."""
    return [path for path in sorted(model_file.parent.iterdir())
            if gguf_file.is_gguf(path) and MARKER in path.name.lower() and path != model_file and path.is_file()]


def find_vision_tower(model_file: Path, width: int) -> VisionTowerFile | None:
    """The Qwen3-VL projector file beside a GGUF language model `width` wide (None without one): of its
    `companions`, those of Qwen3-VL whose projection is that wide (the others are passed by, each said once
    in the log); with several, the one whose name shares the longest start with the model's (ComfyUI-GGUF's
    convention), said once."""
    found = []
    for path in companions(model_file):
        try:
            tower = read_vision_tower(path)
        except CheckpointError as error:
            _say_once(model_file.parent, f"H3: {path.name} beside {model_file.name} is passed by: {error}")
            continue
        projection = tower.entries.get("mm.2.weight")
        if projection is not None and projection.shape[0] == width:
            found.append(tower)
        else:
            _say_once(model_file.parent, f"H3: {path.name} beside {model_file.name} is passed by: it projects to "
                      f"{None if projection is None else projection.shape[0]} wide, the text encoder is {width}.")
    if not found:
        return None
    chosen = max(found, key=lambda tower: len(os.path.commonprefix([tower.path.name, model_file.name])))
    if len(found) > 1:
        _say_once(model_file.parent, f"H3: several vision tower files lie beside {model_file.name} "
                  f"({', '.join(t.path.name for t in found)}); reading {chosen.path.name}, whose name is closest to it.")
    else:
        _say_once(model_file.parent, f"H3: {model_file.name}'s vision tower: {chosen.path.name}", logging.INFO)
    return chosen


_said: set[tuple[str, str]] = set()


def _say_once(folder: Path, message: str, level: int = logging.WARNING) -> None:
    """What was made of the files in `folder`, beside a text encoder, said once a process (a host locates the
    files several times a load)."""
    if (str(folder), message) not in _said:
        _said.add((str(folder), message))
        log.log(level, message)
