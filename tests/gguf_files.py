"""GGUF DiT files as ComfyUI-GGUF makes them (its convert script, then llama-quantize), written by the tests with
the `gguf` package (llama.cpp's writer): the ComfyUI single file's tensors (release names, qkv stacked), 1-D
tensors in F32, the others in the GGML type asked for (F16 by default), dimensions listed fastest first.

Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 weights are quantized from the model's by gguf's own quantizer; the package has
no quantizer for the K-quants and IQ4 types, so their blocks are random bytes with sane fp16 scales. Either way
what a tensor stands for is what gguf's own dequantizer (numpy) makes of the stored bytes: the oracle the loader
must match.
"""

from __future__ import annotations

import numpy as np
import torch

QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16")  # gguf.quants.quantize handles these
# byte offsets of each block's fp16 fields (d, and m / dmin where the type has one), from gguf-py's block layouts
SCALE_FIELDS = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
}
RANDOM_ONLY = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")  # no quantizer in gguf: random blocks


def set_scales(raw: np.ndarray, qtype: str, rng: np.random.Generator, low: float = 2e-4, high: float = 2e-3,
               signed: bool = False) -> np.ndarray:
    """Set each fp16 field of `raw`'s blocks to uniform(low, high) (a random sign if `signed`), so nothing is inf
    or NaN (in place)."""
    import gguf

    blocks = raw.reshape(-1, gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1])
    for offset in SCALE_FIELDS[qtype]:
        values = rng.uniform(low, high, size=blocks.shape[0])
        if signed:
            values *= rng.choice([-1.0, 1.0], size=blocks.shape[0])
        blocks[:, offset:offset + 2] = values.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


def random_blocks(qtype: str, shape: tuple[int, ...], seed: int = 0, **scales) -> np.ndarray:
    """Valid random stored bytes (uint8 [..., bytes a row]) for a `qtype` tensor of `shape`: random bytes for every
    quant and scale bit, finite fp16 scales (`set_scales`; by default ~1e-3, so the weights are of order 0.01-0.1
    and a tiny model's outputs stay finite)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block * size), dtype=np.uint8)
    return set_scales(raw, qtype, rng, **scales)


def write_gguf(path, tensors: dict[str, torch.Tensor], qtypes: dict[str, str] | None = None, prefix: str = "",
               flattened: tuple[str, ...] = (), arch: str = "minimax_h3", texts: dict[str, str] | None = None
               ) -> dict[str, torch.Tensor]:
    """Write `tensors` (our names) as a GGUF file, each key `prefix` + name, in `qtypes[name]` (F32 for 1-D ones,
    else F16 unless named); `flattened` ones are stored as rows of 256 with ComfyUI-GGUF's original-shape field;
    `texts` are header fields. Returns the float32 tensor each stands for (by our name), per gguf's dequantizer."""
    import gguf
    from gguf import GGMLQuantizationType as Types

    qtypes = qtypes or {}
    writer = gguf.GGUFWriter(str(path), arch=arch)
    for key, value in (texts or {}).items():
        writer.add_string(key, value)
    meant = {}
    for name, tensor in tensors.items():
        values = tensor.detach().float().numpy()
        qtype = "F32" if values.ndim == 1 else qtypes.get(name, "F16")
        if name in flattened:
            writer.add_array(f"comfy.gguf.orig_shape.{prefix + name}", list(values.shape))
            values = values.reshape(-1, 256)
        if qtype in RANDOM_ONLY:
            data = random_blocks(qtype, values.shape, seed=len(meant))
        elif qtype in QUANTIZABLE:
            data = gguf.quants.quantize(values, Types[qtype])
        else:
            data = values.astype(np.float16 if qtype == "F16" else np.float32)
        writer.add_tensor(prefix + name, data, raw_dtype=Types[qtype])
        stored = gguf.quants.dequantize(data, Types[qtype]) if data.dtype == np.uint8 else data
        meant[name] = torch.from_numpy(np.asarray(stored, dtype=np.float32).reshape(tensor.shape).copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return meant
