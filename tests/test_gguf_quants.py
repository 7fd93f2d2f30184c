"""GGUF tensor types (h3_core/gguf_quants.py) against gguf-py's numpy reference (`gguf.quants.dequantize`).

Every comparison is exact (`torch.equal` on float32): both sides turn small integers into float32 exactly and then
do the same float32 multiplies and subtracts in the same order (GGML's), one rounding each, so any difference is a
wrong bit layout or a wrong formula, never rounding. Inductor's CPU code keeps that order too (it compiles with
floating-point contraction off), so the compiled path is held to the same standard."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as reference
from gguf_files import random_blocks, set_scales

from h3_core import gguf_quants
from h3_core.gguf_quants import BLOCKS, SUPPORTED, byte_shape, dequantize

QUANTIZED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
LEGACY = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # the types gguf-py can also quantize
# byte offsets of each block's fp16 fields (d, and m / dmin where the type has one), from gguf-py's block layouts
WIDE_SCALES = {"low": 1e-3, "high": 1e-1, "signed": True}  # +-uniform(1e-3, 1e-1): every exponent path


def random_bytes(qtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Valid random storage for a `qtype` tensor of `shape`, uint8 [rows..., bytes per row]."""
    return random_blocks(qtype, shape, seed, **WIDE_SCALES)


def reference_values(raw: np.ndarray, qtype: str) -> torch.Tensor:
    values = torch.from_numpy(np.ascontiguousarray(reference.dequantize(raw, GGMLQuantizationType[qtype])))
    assert values.dtype == torch.float32 and torch.isfinite(values).all()
    return values


def test_block_sizes_match_ggml():
    assert set(SUPPORTED) == set(BLOCKS) and len(SUPPORTED) == 15
    assert set(SUPPORTED) == set(QUANTIZED) | {"F32", "F16", "BF16"}
    for qtype, sizes in BLOCKS.items():
        assert sizes == GGML_QUANT_SIZES[GGMLQuantizationType[qtype]], qtype
    assert BLOCKS["F32"] == (1, 4) and BLOCKS["Q8_0"] == (32, 34) and BLOCKS["Q4_K"] == (256, 144)


@pytest.mark.parametrize("qtype", QUANTIZED)
@pytest.mark.parametrize("shape", [(3, 512), (2, 2, 256)])
def test_random_blocks_match_reference(qtype, shape):
    raw = random_bytes(qtype, shape)
    expected = reference_values(raw, qtype)
    assert expected.shape == shape
    assert expected.abs().max() > 0  # the scales were set: not a vacuous all-zero comparison
    got = dequantize(torch.from_numpy(raw), qtype, shape, torch.float32)
    assert got.dtype == torch.float32 and got.shape == shape
    assert torch.equal(got, expected)


@pytest.mark.parametrize("qtype", QUANTIZED)
def test_whole_byte_range(qtype):
    """Every byte value in every byte position of a block (block i, byte p holds (i + 7p) % 256, 256 blocks),
    so every bit of every quant and sub-block scale byte is seen both set and clear."""
    block, size = BLOCKS[qtype]
    raw = ((np.arange(256)[:, None] + 7 * np.arange(size)[None, :]) % 256).astype(np.uint8)
    raw = set_scales(raw, qtype, np.random.default_rng(1), **WIDE_SCALES)
    expected = reference_values(raw, qtype)
    assert torch.equal(dequantize(torch.from_numpy(raw), qtype, (256, block), torch.float32), expected)


@pytest.mark.parametrize("qtype", LEGACY)
def test_quantized_real_data_matches_reference(qtype):
    g = torch.Generator().manual_seed(7)
    weights = (torch.randn(4, 256, generator=g) * 0.05).numpy()
    raw = reference.quantize(weights, GGMLQuantizationType[qtype])
    assert raw.dtype == np.uint8 and raw.shape == byte_shape((4, 256), qtype)
    expected = reference_values(raw, qtype)
    got = dequantize(torch.from_numpy(raw), qtype, (4, 256), torch.float32)
    assert torch.equal(got, expected)
    # and it is the weights back, to within one quantization step (block range / 2^(bits - 1), loosely)
    bits = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5}[qtype]
    assert (got - torch.from_numpy(weights)).abs().max() < np.abs(weights).max() / 2 ** (bits - 1)


def test_raw_any_shape_and_layout():
    """Bytes may come flat or as a column slice of a wider buffer (not contiguous)."""
    raw = random_bytes("Q6_K", (3, 512))
    expected = reference_values(raw, "Q6_K")
    flat = torch.from_numpy(raw).flatten()
    assert torch.equal(dequantize(flat, "Q6_K", (3, 512), torch.float32), expected)
    wide = torch.zeros(3, raw.shape[1] + 10, dtype=torch.uint8)
    wide[:, 5:-5] = torch.from_numpy(raw)
    sliced = wide[:, 5:-5]
    assert not sliced.is_contiguous()
    assert torch.equal(dequantize(sliced, "Q6_K", (3, 512), torch.float32), expected)


def test_plain_types_round_trip():
    g = torch.Generator().manual_seed(3)
    values = torch.randn(3, 5, 7, generator=g)
    as_f32 = values.numpy().view(np.uint8)
    assert torch.equal(dequantize(torch.from_numpy(as_f32), "F32", (3, 5, 7), torch.float32), values)
    half = values.half()
    as_f16 = half.numpy().view(np.uint8)
    got = dequantize(torch.from_numpy(as_f16), "F16", (3, 5, 7), torch.float32)
    assert torch.equal(got, half.float())
    assert torch.equal(got, reference_values(as_f16, "F16"))
    assert torch.equal(dequantize(torch.from_numpy(as_f16), "F16", (3, 5, 7), torch.float16), half)
    brain = values.bfloat16()
    as_bf16 = brain.view(torch.uint8)
    got = dequantize(as_bf16, "BF16", (3, 5, 7), torch.float32)
    assert torch.equal(got, brain.float())
    assert torch.equal(got, reference_values(as_bf16.numpy(), "BF16"))
    assert torch.equal(dequantize(as_bf16, "BF16", (3, 5, 7), torch.bfloat16), brain)


@pytest.mark.parametrize("qtype", ("Q8_0", "Q5_1", "Q3_K", "Q4_K", "Q6_K", "F32", "BF16"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_output_dtype_is_one_cast(qtype, dtype):
    if qtype in QUANTIZED:
        raw = torch.from_numpy(random_bytes(qtype, (2, 512), seed=2))
    else:
        raw = torch.randn(2, 512, dtype=torch.float32 if qtype == "F32" else torch.bfloat16).view(torch.uint8)
    full = dequantize(raw, qtype, (2, 512), torch.float32)
    got = dequantize(raw, qtype, (2, 512), dtype)
    assert got.dtype == dtype and torch.equal(got, full.to(dtype))


def test_byte_shape():
    assert byte_shape((3, 512), "Q8_0") == (3, 16 * 34)
    assert byte_shape((2, 2, 256), "Q4_K") == (2, 2, 144)
    assert byte_shape(torch.Size([5, 7]), "F32") == (5, 28)
    assert byte_shape((7,), "BF16") == (14,)
    for qtype in SUPPORTED:
        shape = (4, 3, 512)
        assert byte_shape(shape, qtype) == reference.quant_shape_to_byte_shape(shape, GGMLQuantizationType[qtype])
    with pytest.raises(ValueError, match=r"Q4_K.*256.*\(3, 100\)"):
        byte_shape((3, 100), "Q4_K")
    with pytest.raises(ValueError, match=r"Q8_0.*32.*\(4, 48\)"):
        byte_shape((4, 48), "Q8_0")
    with pytest.raises(ValueError, match=r"IQ2_XS.*supported: F32, F16, BF16, Q8_0.*Q6_K, IQ4_NL, IQ4_XS"):
        byte_shape((4, 256), "IQ2_XS")


def test_dequantize_refusals():
    raw = torch.from_numpy(random_bytes("Q4_0", (2, 64)))
    with pytest.raises(ValueError, match=r"unsupported GGML tensor type 'TQ1_0'.*Q4_0"):
        dequantize(raw, "TQ1_0", (2, 64), torch.float32)
    with pytest.raises(ValueError, match=r"Q4_0.*\(2, 96\).*108 bytes \(2, 54\), got 72 bytes"):
        dequantize(raw, "Q4_0", (2, 96), torch.float32)
    with pytest.raises(ValueError, match=r"Q4_0.*\(2, 64\).*got 71 bytes"):
        dequantize(raw.flatten()[:-1], "Q4_0", (2, 64), torch.float32)
    with pytest.raises(ValueError, match=r"uint8.*torch.int8"):
        dequantize(raw.view(torch.int8), "Q4_0", (2, 64), torch.float32)
    with pytest.raises(ValueError, match=r"Q4_0.*32.*\(2, 70\)"):
        dequantize(raw, "Q4_0", (2, 70), torch.float32)


def test_compiles_without_graph_breaks():
    """One K-quant and one legacy type through torch.compile(fullgraph=True) on the CPU: no graph break, and
    the same bits as eager (and so as the reference)."""
    compiled = torch.compile(gguf_quants.dequantize, fullgraph=True)
    for qtype in ("Q4_K", "Q8_0"):
        shape = (2, 256)
        raw = random_bytes(qtype, shape, seed=4)
        got = compiled(torch.from_numpy(raw), qtype, shape, torch.float32)
        assert torch.equal(got, reference_values(raw, qtype)), qtype


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("qtype", QUANTIZED)
def test_cuda_eager_equals_the_reference_and_compiled_is_within_an_fma(qtype):
    """Eager CUDA kernels round each step as the reference does; a compiled kernel may fuse a multiply and an
    add into one FMA (one rounding fewer), so it is held to float32 rounding of the largest value."""
    shape = (64, 512)
    raw = random_bytes(qtype, shape, seed=6)
    want = reference_values(raw, qtype)
    on_gpu = torch.from_numpy(raw).cuda()
    assert torch.equal(dequantize(on_gpu, qtype, shape, torch.float32).cpu(), want)
    torch._dynamo.reset()  # one graph a type: the parametrized runs would pass dynamo's recompile limit
    compiled = torch.compile(dequantize, fullgraph=True)(on_gpu, qtype, shape, torch.float32).cpu()
    assert (compiled - want).abs().max() <= 2**-21 * want.abs().max()
