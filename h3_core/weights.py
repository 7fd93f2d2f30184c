"""Strict, streamed safetensors loading shared by every model of the engine (DiT, VAEs).

A model is built on the meta device and each tensor is assigned as it is read, so no model is ever
held twice. Every mismatch is an error naming the tensor and the file. Pickle formats are refused.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open

PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".pkl")
SAFETENSORS_SUFFIXES = (".safetensors", ".sft")  # .sft: the same format, a name ComfyUI lists too

Item = tuple[str, torch.Tensor, Path | str]  # (name, tensor, where it came from)


class CheckpointError(ValueError):
    """A checkpoint that is missing, malformed or not what was asked for; the message names file and tensor."""


def check_safetensors_file(path: Path, what: str, also: str = "") -> None:
    """Refuse pickles (they can run code on load) and anything that is not .safetensors (`also`: the other
    format a caller takes, for the message)."""
    suffix = path.suffix.lower()
    if suffix in PICKLE_SUFFIXES:
        raise CheckpointError(
            f"{path.name} is a pickle checkpoint ({suffix}); H3 loads only .safetensors files, which cannot run "
            "code on load. Convert it to safetensors first."
        )
    if suffix not in SAFETENSORS_SUFFIXES:
        raise CheckpointError(f"{path.name} is not a .safetensors file; {what} files must be safetensors{also}.")


def refuse_a_shard(path: Path, what: str) -> None:
    """A file a sharded checkpoint's index (`*.index.json` beside it) names is one part of a model, which a host
    lists with the others (ComfyUI, once a release folder is linked into models/): said so, with the folder to
    give instead, rather than as a model file missing most of its tensors."""
    for index in sorted(path.parent.glob("*.index.json")):
        try:
            named = set(read_weight_map(index).values())
        except CheckpointError:  # a broken index beside a file: the file is said as itself
            continue
        if path.name in named:
            raise CheckpointError(f"{path.name} is one shard of a sharded {what} ({index.name} names it): give its "
                                  f"folder, {path.parent}, instead of one of its files.")


@contextlib.contextmanager
def open_safetensors(path: Path | str):
    """`safe_open` for torch, a file that is not readable safetensors (truncated, random bytes, another
    format under the name) refused as a CheckpointError that names it, not the library's bare header error."""
    try:
        opened = safe_open(path, "pt")
    except OSError as error:  # safetensors says "No such file or directory" for a file this user may not read
        raise CheckpointError(f"{path} cannot be read ({_why_unreadable(Path(path), error)}).") from None
    except SafetensorError as error:
        raise _not_safetensors(path, error) from None
    try:
        with opened as handle:
            yield handle
    except SafetensorError as error:
        raise _not_safetensors(path, error) from None


@contextlib.contextmanager
def config_errors(where):
    """A malformed config (a null, a string where a number goes, a tensor of the wrong rank read as one) fails in
    Python's own words while it is read or a model is built from it: said as one CheckpointError naming `where`."""
    try:
        yield
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, ZeroDivisionError, AttributeError) as error:
        raise CheckpointError(f"{where} does not describe a model H3 can build ({type(error).__name__}: {error}); "
                              "is its config damaged or another model's?") from error


# how torch.save's files begin (a zip archive, since torch 1.6); no safetensors file does (its first 8 bytes, the
# header's length, would say 67 MB)
TORCH_ZIP_MAGIC = b"PK\x03\x04"


def _not_safetensors(path: Path | str, error: Exception) -> CheckpointError:
    size = Path(path).stat().st_size
    with open(path, "rb") as file:
        head = file.read(4)
    if head == TORCH_ZIP_MAGIC:  # only its first bytes read: a pickle is never loaded
        return CheckpointError(f"{Path(path).name} is a pickle checkpoint (torch.save's format) under a .safetensors "
                               "name; H3 loads only real .safetensors files, which cannot run code on load. Convert it "
                               "to safetensors first.")
    return CheckpointError(f"{path} is not a readable safetensors file ({error}; {size:,} bytes: an interrupted "
                           "download, or another format under this name?).")


def _why_unreadable(path: Path, error: OSError) -> str:
    """The operating system's own reason a file cannot be opened (e.g. "Permission denied")."""
    try:
        with path.open("rb"):
            pass
    except OSError as cause:
        return cause.strerror or str(cause)
    return str(error)


MAX_JSON_BYTES = 64 << 20  # a release's largest index is ~0.2 MiB; a bigger "config" is some other file


def read_json(path: Path) -> dict:
    """A JSON object from a checkpoint's config, index or processor file; anything else is a CheckpointError
    (a huge file is refused before it is read into memory)."""
    try:
        size = Path(path).stat().st_size
        if size > MAX_JSON_BYTES:
            raise CheckpointError(f"{path} is {size / 2**20:.0f} MiB; a checkpoint's JSON file is at most "
                                  f"{MAX_JSON_BYTES >> 20} MiB: it is not the file it is named for.")
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}.") from None
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint folder holding it is incomplete.") from None
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} cannot be read ({getattr(error, 'strerror', None) or error}).") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object.")
    return raw


def read_weight_map(index_path: Path) -> dict[str, str]:
    """The tensor -> shard file map of a sharded checkpoint's index."""
    weight_map = read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path} has no 'weight_map'.")
    for tensor, shard in weight_map.items():  # a shard is a file name beside the index, never a path elsewhere
        if not isinstance(shard, str) or not shard or Path(shard).name != shard:
            raise CheckpointError(f"{index_path} maps '{tensor}' to {shard!r}; a weight_map names shard files in the "
                                  "index's own folder.")
    return weight_map


def shard_files(folder: Path, index_names: tuple[str, ...]) -> tuple[Path, ...]:
    """The safetensors files of a checkpoint folder: the shards its index names (all present), or its
    single .safetensors file when there is no index."""
    for name in index_names:
        index_path = folder / name
        if index_path.is_file():
            files = tuple(folder / shard for shard in sorted(set(read_weight_map(index_path).values())))
            for file in files:  # an index may name pickled shards: refused like any pickle
                check_safetensors_file(file, "checkpoint shard")
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{index_path} lists shards that are not in {folder}: {', '.join(missing)}.")
            return files
    files = tuple(sorted(folder.glob("*.safetensors")))
    if len(files) > 1:
        raise CheckpointError(f"{folder} holds {len(files)} .safetensors files but no index file ({index_names[0]}).")
    return files


def files_place(files: tuple[Path, ...]) -> Path:
    """What a message names for a checkpoint's files: the one file, or the folder of its shards (the first shard
    need not be the one a message is about)."""
    return files[0] if len(files) == 1 else files[0].parent


def described(files: tuple[Path, ...], origin: str) -> str:
    """A checkpoint as messages name it: its place (`files_place`) and what it was read as (`origin`)."""
    return f"{files_place(files)} ({origin})"


def tensor_names(files: Iterable[Path]) -> list[str]:
    """All tensor names of some safetensors files, from their headers only."""
    names = []
    for path in files:
        with open_safetensors(path) as handle:
            names.extend(handle.keys())
    return names


def read_tensors(files: Iterable[Path], only: Callable[[str], bool] | None = None) -> Iterator[Item]:
    """Yield (name, tensor, file) one tensor at a time, file by file; `only(key)`: the keys read (the others are
    not)."""
    for path in files:
        with open_safetensors(path) as handle:
            for key in handle.keys():
                if only is None or only(key):
                    yield key, handle.get_tensor(key), path


# safetensors header dtypes
HEADER_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


def read_headers(files: Iterable[Path], only: Callable[[str], bool] | None = None) -> Iterator[Item]:
    """`read_tensors` without the data: each tensor on the meta device with the shape and dtype its file's
    header gives, to check a checkpoint against a model before anything is read. `only(key)`: the keys wanted."""
    for path in files:
        with open_safetensors(path) as handle:
            for key in handle.keys():
                if only is not None and not only(key):
                    continue
                piece = handle.get_slice(key)
                dtype = HEADER_DTYPES.get(piece.get_dtype())
                if dtype is None:
                    raise CheckpointError(f"'{key}' in {path} has dtype {piece.get_dtype()}, which H3 does not use.")
                yield key, torch.empty(piece.get_shape(), dtype=dtype, device="meta"), path


def assign_strictly(
    model: torch.nn.Module,
    items: Iterable[Item],
    origin: str,
    dtype_for: Callable[[str], torch.dtype | None] = lambda name: None,
    device: str | torch.device = "cpu",
    on_tensor: Callable[[int, int], None] | None = None,
) -> torch.nn.Module:
    """Fill a meta-built `model` from streamed items. Unexpected, repeated, mis-shaped or missing
    tensors are errors. `dtype_for(name)` may cast a tensor (None keeps the checkpoint's dtype).
    `on_tensor(done, total)` after each tensor: a host's progress bar (it may raise to stop)."""
    state = model.state_dict()
    expected = {name: tuple(t.shape) for name, t in state.items()}
    floating = {name for name, t in state.items() if t.is_floating_point()}
    seen: set[str] = set()
    for name, tensor, where in items:
        if name not in expected:
            raise CheckpointError(f"Unexpected tensor '{name}' in {where} ({origin}); it is not part of this model.")
        if name in seen:
            raise CheckpointError(f"Tensor '{name}' appears twice ({where}).")
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(
                f"Tensor '{name}' in {where} has shape {list(tensor.shape)}, expected {list(expected[name])} "
                "for this config."
            )
        if name in floating and not tensor.is_floating_point():  # a cast would turn it into weights silently
            stored = str(tensor.dtype).removeprefix("torch.")
            raise CheckpointError(f"Tensor '{name}' in {where} is stored as {stored}; this model's weight there is "
                                  "floating point (a damaged or foreign file).")
        dtype = dtype_for(name)
        _assign(model, name, tensor.to(device=device, dtype=dtype) if dtype is not None else tensor.to(device))
        seen.add(name)
        if on_tensor is not None:
            on_tensor(len(seen), len(expected))
    missing = sorted(set(expected) - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{origin} is missing {len(missing)} tensor(s): {shown}.")
    return model


def _assign(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._buffers:
        module._buffers[leaf] = tensor
    else:
        module._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)
