"""GGUF DiT files (city96's ComfyUI-GGUF layout), their quantized linears held as stored.

A GGUF DiT file holds the ComfyUI single file's tensors (release names, qkv stacked; a `model.diffusion_model.`
prefix or not), each in one GGML type: F32, F16, BF16, or a block quantization (Q8_0 ... Q6_K, IQ4_NL, IQ4_XS:
`gguf_quants`).
GGUF lists a tensor's dimensions fastest first, so its torch shape is their reverse, unless a
`comfy.gguf.orig_shape.<name>` field gives the shape the tensor had before it was flattened into rows of 256.
GGUF files are no pickles: a header, key-value fields and raw tensor bytes, read here through the `gguf`
package (llama.cpp's reader, memory-mapped).

The quantized linears the DiT may hold as stored (the blocks', AdaLN and refiner linears) stay quantized as
GGUFLinear and are rebuilt in the compute dtype at each call (weight-only: any GPU, or the CPU); every other
quantized tensor is dequantized once at load (`GGUFLoad`).
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import gguf_quants
from .fp8 import StoredLinear
from .weights import CheckpointError, Item

GGUF_SUFFIX = ".gguf"
ORIGINAL_SHAPE_FIELD = "comfy.gguf.orig_shape."
ARCHITECTURE_FIELD = "general.architecture"
# the longest metadata array a file may hold: llama.cpp's reader makes Python objects of every element (a 2 MB
# array took it 23 s and 1.4 GB), and an H3 file's longest is a tokenizer's vocabulary (Qwen's 151,936 tokens)
MAX_METADATA_ARRAY = 1 << 20
_FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFEntry:
    """One tensor of a GGUF file: its GGML type, its torch shape and the shape it is stored in (the same, or
    rows of 256 where the file flattened it)."""

    qtype: str
    shape: tuple[int, ...]
    stored: tuple[int, ...]

    @property
    def quantized(self) -> bool:
        return self.qtype not in gguf_quants.PLAIN

    @property
    def raw_shape(self) -> tuple[int, ...]:
        """The uint8 shape of its stored bytes (a row of GGML blocks per stored row)."""
        return gguf_quants.byte_shape(self.stored, self.qtype)

    @property
    def bytes_per_weight(self) -> float:
        weights, size = gguf_quants.BLOCKS[self.qtype]
        return size / weights

    def read_as(self) -> torch.Tensor:
        """An empty (meta) tensor as `read_gguf` gives this one: itself in its torch shape, or its stored bytes."""
        if self.quantized:
            return torch.empty(self.raw_shape, dtype=torch.uint8, device="meta")
        return torch.empty(self.shape, dtype=gguf_quants.PLAIN[self.qtype], device="meta")


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == GGUF_SUFFIX


@dataclass(frozen=True)
class _StoredTensor:
    """One tensor as the header lists it: where its bytes lie and how they are laid out."""

    name: str
    qtype: str
    stored: tuple[int, ...]  # torch order
    original: tuple[int, ...] | None  # from a `comfy.gguf.orig_shape.<name>` field
    offset: int
    nbytes: int


@dataclass(frozen=True)
class _Header:
    tensors: tuple[_StoredTensor, ...]
    texts: dict[str, str]  # the header's text fields


def _header(path: Path) -> _Header:
    """The header of `path`, parsed once per version of the file: llama.cpp's reader takes seconds over a text
    encoder's (its 151k-token vocabulary), and one load asks several times (locate, size, read)."""
    try:
        stat = path.stat()
    except OSError as error:
        raise CheckpointError(f"{path} cannot be read ({error.strerror or error}).") from None
    return _parsed_header(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _parsed_header(path: str, size: int, modified: int) -> _Header:
    """`_header`'s cache (size and modification time in the key: a file rewritten is parsed again)."""
    try:
        import gguf
    except ImportError:
        raise CheckpointError(f"Reading {Path(path).name} needs the 'gguf' package (pip install gguf).") from None
    try:
        _check_metadata_arrays(Path(path))
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, OSError, struct.error) as error:
        raise CheckpointError(f"{path} is not a readable GGUF file ({error}).") from None
    tensors = tuple(_StoredTensor(tensor.name, getattr(tensor.tensor_type, "name", str(tensor.tensor_type)),
                                  tuple(int(size) for size in reversed(tensor.shape)),
                                  _original_shape(reader, tensor.name), int(tensor.data_offset), int(tensor.n_bytes))
                    for tensor in reader.tensors)
    _check_layout(tensors, int(getattr(reader, "alignment", 32)), Path(path))
    texts = {name: bytes(field.parts[field.data[-1]]).decode("utf-8", "replace")
             for name, field in reader.fields.items() if field.types == [gguf.GGUFValueType.STRING]}
    return _Header(tensors, texts)


def _check_metadata_arrays(path: Path) -> None:
    """Walk the header's key-value pairs (lengths only, skipping their values) and refuse an array longer than
    MAX_METADATA_ARRAY before llama.cpp's reader spends minutes and gigabytes on it."""
    with open(path, "rb") as file:
        def unpack(fmt: str):
            return struct.unpack("<" + fmt, file.read(struct.calcsize(fmt)))[0]

        def skip(kind: int) -> None:
            if kind == _STRING:
                file.seek(unpack("Q"), 1)
            elif kind == _ARRAY:
                element, count = unpack("I"), unpack("Q")
                if count > MAX_METADATA_ARRAY:
                    raise CheckpointError(f"{path} holds a metadata array of {count:,} entries, more than a model "
                                          f"file's (at most {MAX_METADATA_ARRAY:,} are read; a tokenizer's "
                                          "vocabulary, the longest, has about 152,000): not a model file.")
                if element in _FIXED_SIZES:
                    file.seek(count * _FIXED_SIZES[element], 1)
                else:
                    for _ in range(count):
                        skip(element)
            elif kind in _FIXED_SIZES:
                file.seek(_FIXED_SIZES[kind], 1)
            else:
                raise ValueError(f"unknown metadata value type {kind}")

        if file.read(4) != b"GGUF" or unpack("I") < 2:  # the reader says what is wrong with these
            return
        unpack("Q")  # tensor count
        for _ in range(unpack("Q")):
            file.seek(unpack("Q"), 1)  # the key
            skip(unpack("I"))


def _check_layout(tensors: tuple[_StoredTensor, ...], alignment: int, path: Path) -> None:
    """The header's types and shapes must account for the data as written: writers put each tensor right after
    the one before, padded to `alignment`. A tensor overlapping the next, or ending `alignment` bytes or more
    before it, has a size its header does not describe (say, a damaged type field) and would be read as garbage."""
    placed = sorted(tensors, key=lambda tensor: tensor.offset)
    for tensor, following in zip(placed, placed[1:]):
        gap = following.offset - (tensor.offset + tensor.nbytes)
        if not 0 <= gap < alignment:
            raise CheckpointError(
                f"{path.name} is damaged: its header says '{tensor.name}' is {tensor.qtype} {list(tensor.stored)}, "
                f"{tensor.nbytes} bytes, but the next tensor's data ('{following.name}') starts "
                f"{following.offset - tensor.offset} bytes after its start. Download the file again.")


def _original_shape(reader, name: str) -> tuple[int, ...] | None:
    field = reader.get_field(ORIGINAL_SHAPE_FIELD + name)
    if field is None:
        return None
    return tuple(int(field.parts[part][0]) for part in field.data)


def _entry(tensor: _StoredTensor, path: Path, model: str = "DiT") -> GGUFEntry:
    if tensor.qtype not in gguf_quants.SUPPORTED:
        raise CheckpointError(
            f"'{tensor.name}' in {path.name} is stored as GGML type {tensor.qtype}, which H3 does not read; GGUF "
            f"{model} files may use {', '.join(gguf_quants.SUPPORTED)}.")
    shape = tensor.original or tensor.stored
    if math.prod(shape) != math.prod(tensor.stored):
        raise CheckpointError(f"'{tensor.name}' in {path.name} is stored as {list(tensor.stored)} but its original "
                              f"shape field says {list(shape)}: the element counts differ.")
    return GGUFEntry(tensor.qtype, shape, tensor.stored)


def gguf_entries(path: Path, model: str = "DiT", unused: Callable[[str], bool] | None = None,
                 fields: tuple[str, ...] = (ARCHITECTURE_FIELD,)) -> tuple[dict[str, GGUFEntry], tuple]:
    """Each tensor's entry, by its key in the file (headers only), but those `unused` names (never read, so
    their types do not matter), and the header's text `fields` (None where missing; by default the
    architecture the file names). `model` names the model in errors."""
    header = _header(path)
    entries = {tensor.name: _entry(tensor, path, model) for tensor in header.tensors
               if unused is None or not unused(tensor.name)}
    return entries, tuple(header.texts.get(key) for key in fields)


def read_gguf(path: Path, only: Callable[[str], bool] | None = None) -> Iterator[Item]:
    """(key, tensor, path) for each tensor of the file (whose key `only` accepts), one at a time, as
    `GGUFEntry.read_as` describes it: F32 / F16 / BF16 tensors as themselves, quantized ones as their stored
    bytes."""
    # copy-on-write: each tensor stays a view of the file's pages (the OS's file cache, as safetensors reads), and
    # one written to would get its own copy, never change the file
    mapped = np.memmap(path, dtype=np.uint8, mode="c")
    for tensor in _header(path).tensors:
        if only is not None and not only(tensor.name):
            continue
        like = _entry(tensor, path).read_as()
        raw = torch.from_numpy(mapped[tensor.offset:tensor.offset + tensor.nbytes])
        yield tensor.name, raw.view(like.dtype).reshape(like.shape), path


class GGUFLinear(StoredLinear):
    """y = x W^T (+ bias), W rebuilt from the file's GGML blocks at each call, in `compute_dtype`. The weight
    parameter holds the stored bytes, so the file's tensor loads as it is."""

    held = "gguf"

    def __init__(self, in_features: int, out_features: int, entry: GGUFEntry, bias: bool = False,
                 compute_dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        self.in_features, self.out_features, self.compute_dtype = in_features, out_features, compute_dtype
        self.qtype, self.stored = entry.qtype, entry.stored
        self.weight = nn.Parameter(torch.empty(entry.raw_shape, dtype=torch.uint8, device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=compute_dtype, device=device), requires_grad=False)
                     if bias else None)

    def dequantized_weight(self) -> torch.Tensor:
        dense = gguf_quants.dequantize(self.weight, self.qtype, self.stored, self.compute_dtype)
        return dense.reshape(self.out_features, self.in_features)

    def as_dense(self) -> nn.Linear:
        """A dense linear computing the same, in `compute_dtype`."""
        linear = nn.Linear(self.in_features, self.out_features, self.bias is not None, device="meta")
        linear.weight = nn.Parameter(self.dequantized_weight(), requires_grad=False)
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias.detach(), requires_grad=False)
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.compute_dtype), self.dequantized_weight(), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"gguf {self.qtype}, compute={self.compute_dtype}")


@dataclass
class GGUFLoad:
    """How one load treats a file's quantized tensors (our names): the `kept` linears' weights stay as stored
    (GGUFLinear); every other quantized tensor is rebuilt in `dense_dtype(name)` as it streams in."""

    tensors: dict[str, GGUFEntry]  # the quantized ones
    kept: set[str]  # layer names
    dense_dtype: Callable[[str], torch.dtype]

    @classmethod
    def plan(cls, model: nn.Module, tensors: dict[str, GGUFEntry], keep: Callable[[str], bool],
             compute: torch.dtype, dense_dtype: Callable[[str], torch.dtype]) -> "GGUFLoad":
        """Swap GGUFLinear into the meta-built `model` for the quantized linear weights `keep` accepts (by
        layer name), computing in `compute`."""
        kept = set()
        for name, entry in tensors.items():
            layer, _, leaf = name.rpartition(".")
            try:
                module = model.get_submodule(layer)
            except AttributeError:
                continue  # not part of this model: the strict load names it
            if leaf != "weight" or not isinstance(module, nn.Linear) or not keep(layer):
                continue
            if entry.shape != (module.out_features, module.in_features):
                raise CheckpointError(f"'{name}' has shape {list(entry.shape)}, expected "
                                      f"{[module.out_features, module.in_features]} for this config.")
            kept.add(layer)
            model.set_submodule(layer, GGUFLinear(module.in_features, module.out_features, entry,
                                                  module.bias is not None, compute, "meta"))
        return cls(tensors, kept, dense_dtype)

    def dtype_for(self, name: str, otherwise: torch.dtype | None) -> torch.dtype | None:
        """The dtype the model holds `name` in: a kept weight's bytes as stored (None); anything else
        `otherwise`."""
        layer, _, leaf = name.rpartition(".")
        return None if layer in self.kept and leaf == "weight" else otherwise

    def stream(self, items: Iterable[Item], device: torch.device | str) -> Iterator[Item]:
        """(name, tensor, where) items in our names -> the model's: kept weights as stored, other quantized
        tensors dequantized (on `device`) into their torch shape."""
        for name, tensor, where in items:
            entry = self.tensors.get(name)
            if entry is None or name.rpartition(".")[0] in self.kept:
                yield name, tensor, where
            elif tensor.is_meta:
                yield name, torch.empty(entry.shape, dtype=self.dense_dtype(name), device="meta"), where
            else:
                dense = gguf_quants.dequantize(tensor.to(device), entry.qtype, entry.stored, self.dense_dtype(name))
                yield name, dense.reshape(entry.shape), where
