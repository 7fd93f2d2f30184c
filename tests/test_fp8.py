"""FP8 block linears (h3_core/fp8.py): quantization, the two compute paths against independent
arithmetic, the swap's reach, ComfyUI fp8_scaled files in their real on-disk layouts, streaming, and
that every lossy path is opt-in."""

import json
import re
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from h3_core import fp8
from h3_core.checkpoint import CheckpointError, DiTReader, held_linears, load_dit, locate_dit, with_config
from h3_core.config import DiTConfig, TINY_DIT
from h3_core.dit import H3DiT, rope_inverse_frequencies
from h3_core.fp8 import FP8Linear, quantize_blocks
from h3_core.layout import build_request_layout
from h3_core.memory_plan import block_weight_bytes, plan_memory
from h3_core.offload import stream_blocks
from h3_core.tiny import seeded_random_weights, tiny_random_dit

E4M3_MAX = 448.0
BLOCK_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
CPU_SCALED = pytest.mark.skipif(not fp8.scaled_mm_supported("cpu"), reason=(
    "this torch's CPU _scaled_mm takes per-tensor scales only (torch 2.11); CI's torch 2.13 runs these"))


def forward(model, seed=3, times=(0.3, 0.55)):
    """One forward of a T2VA layout at a step where video and audio clocks differ (`times`: t video, audio)."""
    layout = build_request_layout(128, 64, 124, torch.ones(6, dtype=torch.long))
    timesteps, indices = layout.row_timesteps(*times)
    g = torch.Generator().manual_seed(seed)
    config = model.config
    with torch.inference_mode():
        return model(
            torch.randn(1, layout.video_indices.numel(), config.video_patch_dim, generator=g),
            torch.randn(1, layout.audio_indices.numel(), config.audio_in_channels, generator=g),
            torch.randn(1, 6, config.text_dim, generator=g).to(model.dtype),
            timesteps, indices, layout.token_tags, layout.position_ids,
            layout.video_indices, layout.audio_indices, layout.text_indices,
        )


def cosine(a, b):
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def check_streamed_blocks_equal_resident(path) -> None:
    """A file's DiT with its blocks streamed from the CPU (none or one resident) gives the resident one's outputs."""
    want = forward(load_dit(path, dtype=torch.float32))
    for resident in (0, 1):
        streamed = load_dit(path, dtype=torch.float32)
        streamer = stream_blocks(streamed, "cpu", resident=resident)
        assert all(torch.equal(a, b) for a, b in zip(forward(streamed), want))
        streamer.remove()


def check_cuda_linears_equal_the_cpus(path, layers, kind: type) -> None:
    """A file's stored `layers` (of type `kind`) on CUDA, eager and compiled, compute what the CPU's do."""
    cpu, gpu = load_dit(path, dtype=torch.float32), load_dit(path, dtype=torch.float32, device="cuda")
    g = torch.Generator().manual_seed(5)
    for layer in layers:
        module = gpu.get_submodule(layer)
        assert module.weight.is_cuda and isinstance(module, kind)
        x = torch.randn(7, module.in_features, generator=g)
        want = cpu.get_submodule(layer)(x)
        with torch.no_grad():
            eager, compiled = module(x.cuda()), torch.compile(module)(x.cuda())
        assert torch.allclose(eager.cpu(), want, rtol=1e-5, atol=1e-5), layer
        assert torch.allclose(compiled, eager, rtol=1e-5, atol=1e-5), layer


def check_lora_hook_equals_merge(path, lora_path) -> None:
    """Merging into a file's stored (quantized) weights would quantize again: runs hook LoRAs there
    (lora.run_mode), and the hook adds the adapter as a merge into the dequantized weights does."""
    from lora_files import random_spec, write_peft

    from h3_core.lora import apply_loras, load_lora, run_mode

    kept, dense = load_dit(path, dtype=torch.float32), load_dit(path, dtype=torch.float32, linears="dense")
    assert run_mode(kept) == "dynamic" and run_mode(dense) == "merge"
    lora = load_lora(write_peft(lora_path, random_spec(TINY_DIT, seed=9)))
    plain = forward(kept)
    apply_loras(kept, [(lora, 0.8)], partition="fl2va", mode="dynamic")
    apply_loras(dense, [(lora, 0.8)], partition="fl2va", mode="merge")
    adapted, merged = forward(kept), forward(dense)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(adapted, merged))
    assert (adapted[0] - plain[0]).abs().max() > 1e-3  # the adapter really changes the output


def reference_quantize(x, per_row):
    """Independent per-row / per-tensor absmax quantization to e4m3 (float64 scale arithmetic)."""
    x64 = x.double()
    amax = x64.abs().amax(dim=-1, keepdim=True) if per_row else x64.abs().amax()
    scale = (amax / E4M3_MAX).clamp(min=1e-12).float()
    return (x64 / scale.double()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


# ----------------------------------------------------------------------------------------------
# Quantization and the module


@pytest.mark.parametrize("per_row", [True, False])
def test_quantize_dequantize_round_trip(per_row):
    x = torch.randn(33, 80) * torch.logspace(-3, 2, 33)[:, None]  # rows of very different ranges
    x[5] = 0.0
    q, scale = fp8.quantize(x, per_row=per_row)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.shape == ((33, 1) if per_row else ())
    assert not torch.isnan(q.float()).any()
    back = q.float() * scale
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value; below 2^-6 (subnormals) the
    # step is 2^-9 of the scale.
    bound = x.abs() * 2**-4 + scale * 2**-10
    assert ((back - x).abs() <= bound * 1.0001).all()
    # the largest magnitude lands on the format's largest value; an all-zero row stays zero
    rows = q.float().abs().amax(dim=-1)
    assert rows.max() == E4M3_MAX
    if per_row:
        assert rows[torch.arange(33) != 5].eq(E4M3_MAX).all() and back[5].eq(0).all()
    # values already on the e4m3 grid come back exactly
    assert torch.equal(fp8.quantize(back, per_row)[0].float() * fp8.quantize(back, per_row)[1], back)


def test_quantize_does_not_touch_its_input():
    x = torch.randn(4, 16)
    kept = x.clone()
    fp8.quantize(x, per_row=True)
    assert torch.equal(x, kept)


@CPU_SCALED
@pytest.mark.parametrize("activations", ["row", "tensor"])
@pytest.mark.parametrize("bias", [False, True])
def test_scaled_linear_matches_independent_arithmetic(activations, bias):
    linear = nn.Linear(96, 48, bias=bias)
    x = torch.randn(2, 7, 96)
    module = FP8Linear.from_linear(linear, "scaled", activations)
    assert module.weight.dtype == torch.float8_e4m3fn and module.weight_scale.shape == (48,)
    wq, ws = reference_quantize(linear.weight.detach(), per_row=True)
    xq, xs = reference_quantize(x.reshape(-1, 96), per_row=activations == "row")
    assert torch.equal(module.weight.view(torch.uint8), wq.view(torch.uint8))
    assert torch.equal(module.weight_scale, ws.view(-1))
    expected = (xq.double() * xs.double()) @ (wq.double() * ws.double()).T
    if bias:
        expected = expected + linear.bias.detach().double()
    got = module(x)
    assert got.shape == (2, 7, 48) and got.dtype == torch.float32
    torch.testing.assert_close(got.double().reshape(-1, 48), expected, rtol=1e-5, atol=1e-5)


def test_weight_only_linear_is_bitwise_dequantize_then_matmul():
    linear = nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    module = FP8Linear.from_linear(linear, "dequantize")
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    wq, ws = reference_quantize(linear.weight.detach(), per_row=True)
    dense = (wq.float() * ws).to(torch.bfloat16)  # fp32 product, one rounding
    assert torch.equal(module(x), F.linear(x, dense))


def test_sizes_off_the_fp8_grid_fall_back_to_weight_only():
    module = FP8Linear.from_linear(nn.Linear(24, 40), "scaled")
    assert module.matmul == "dequantize"  # 24 is not a multiple of 16
    x = torch.randn(3, 24)
    assert torch.equal(module(x), F.linear(x, module.dequantized_weight(), module.bias))


@CPU_SCALED
def test_dtype_moves_leave_fp8_weights_and_scales_alone():
    model = tiny_random_dit(torch.float32)
    quantize_blocks(model, "scaled")
    model.to(torch.bfloat16)
    model.set_dtype(torch.float16)
    qkv = model.blocks[0].attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.dtype == torch.float32
    model.to("meta")
    assert qkv.weight.device.type == "meta" and qkv.weight.dtype == torch.float8_e4m3fn


# ----------------------------------------------------------------------------------------------
# The swap


@CPU_SCALED
def test_swap_touches_only_the_block_linears_and_stays_close():
    model = tiny_random_dit(torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    exact = forward(model)
    names = quantize_blocks(model, "scaled")
    assert names == [f"blocks.{i}.{leaf}" for i in range(2) for leaf in BLOCK_LINEARS]
    swapped = {n for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert swapped == set(names)
    assert not any(p.requires_grad for name in names for p in model.get_submodule(name).parameters())
    after = model.state_dict()
    for name, tensor in before.items():
        layer = name.rpartition(".")[0]
        if layer in swapped:
            continue
        assert torch.equal(after[name], tensor), name  # heads, embedders, refiner, norms, AdaLN: untouched
    for name in ("video_patch_proj", "audio_patch_proj", "time_embedder.proj_in", "time_embedder.proj_out",
                 "final_layer.video_out", "final_layer.audio_out", "condition_proj", "token_refiner.blocks.0.attn.qkv_proj"):
        module = model.get_submodule(name)
        assert type(module) is nn.Linear, name
    lossy = forward(model)
    for a, b in zip(exact, lossy):
        assert cosine(a, b) > 0.99
        assert not torch.equal(a, b)  # it really is a different computation


def test_adaln_projections_are_swapped_only_on_request():
    model = tiny_random_dit(torch.float32)
    exact = forward(model)
    names = quantize_blocks(model, "dequantize", adaln=True)
    assert "blocks.1.adaln_proj.linear" in names and "final_layer.adaln_proj.linear" in names
    assert isinstance(model.final_layer.adaln_proj.linear, FP8Linear)
    assert model.final_layer.adaln_proj.linear.bias.dtype == torch.float32
    for a, b in zip(exact, forward(model)):
        assert cosine(a, b) > 0.99


def test_scaled_matmul_needs_a_capable_device(monkeypatch):
    monkeypatch.setattr(fp8, "scaled_mm_supported", lambda *args: False)
    with pytest.raises(ValueError, match="fp8-weights-lossy"):
        quantize_blocks(tiny_random_dit(), "scaled")
    quantize_blocks(tiny_random_dit(), "dequantize")  # weight-only runs anywhere
    quantize_blocks(tiny_random_dit(), "scaled", device="meta")  # a model being built: no device to ask yet
    with pytest.raises(ValueError, match="FP8 matmuls are not supported on cpu"):
        fp8.check_linear_mode("fp8-lossy", "cpu")
    # without a device (a mode named before one is chosen), or a mode without FP8 matmuls, nothing is asked
    assert fp8.check_linear_mode("fp8-lossy") == "fp8-lossy"
    assert fp8.check_linear_mode("fp8-weights-lossy", "cpu") == "fp8-weights-lossy"


# ----------------------------------------------------------------------------------------------
# ComfyUI fp8_scaled single files


def native_tensors(model: H3DiT) -> dict:
    """A ComfyUI bf16 repack of `model`: release names, qkv stacked, rope.inv_freq shipped."""
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    tensors["rope.inv_freq"] = rope_inverse_frequencies(model.config)
    return tensors


QUANTIZED_IN_FILE = [f"blocks.{i}.{leaf}" for i in range(2) for leaf in BLOCK_LINEARS] + [
    "blocks.0.adaln_proj.linear", "token_refiner.blocks.1.mlp.fc1", "final_layer.video_out",
]


def write_fp8_scaled(path, model, style, prefix="model.diffusion_model.", layers=QUANTIZED_IN_FILE,
                     dtype=torch.float8_e4m3fn):
    """An fp8_scaled file in ComfyUI's layouts: per-tensor fp32 scales, e4m3 (or `dtype`) weights, input scales.
    style "comfy_quant": `X.comfy_quant` JSON tensors; "metadata": `_quantization_metadata`;
    "uint8": comfy_quant with the FP8 bytes stored as uint8; "scaled_fp8": the older marker layout.
    Returns the dequantized weights (what the file means)."""
    tensors = native_tensors(model)
    meant = {}
    quant_layers = {}
    for layer in layers:
        weight = tensors.pop(f"{layer}.weight").float()
        scale = weight.abs().amax() / torch.finfo(dtype).max
        q = (weight / scale).to(dtype)
        meant[layer] = q.float() * scale
        if style == "scaled_fp8":
            tensors[f"{layer}.weight"] = q
            tensors[f"{layer}.scale_weight"] = scale.reshape(1)
            tensors[f"{layer}.scale_input"] = torch.ones(1)
            continue
        tensors[f"{layer}.weight"] = q.view(torch.uint8) if style == "uint8" else q
        tensors[f"{layer}.weight_scale"] = scale
        tensors[f"{layer}.input_scale"] = torch.tensor(0.25)
        conf = {"format": str(dtype).removeprefix("torch.")}
        if style == "metadata":
            quant_layers[prefix + layer] = conf
        else:
            tensors[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
    if style == "scaled_fp8":
        tensors["scaled_fp8"] = torch.empty(0, dtype=dtype)
    metadata = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": quant_layers})} if quant_layers else None
    save_file({prefix + k: v for k, v in tensors.items()}, str(path), metadata=metadata)
    return meant


@pytest.fixture(scope="module")
def bf16_model():
    return tiny_random_dit(torch.bfloat16)


@pytest.mark.parametrize("style", ["comfy_quant", "metadata", "uint8", "scaled_fp8"])
def test_fp8_scaled_file_loads_into_fp8_linears(tmp_path, bf16_model, style):
    path = tmp_path / "minimax_h3_fl2va_fp8_scaled.safetensors"
    meant = write_fp8_scaled(path, bf16_model, style)
    source = locate_dit(path)
    assert set(source.fp8_layers) == set(QUANTIZED_IN_FILE) and "FP8" in source.origin
    model = load_dit(path, dtype=torch.bfloat16)
    assert model.config == TINY_DIT
    fp8_modules = {n for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    # the heads stay dense fp32 even when a file quantizes them; block, AdaLN and refiner linears stay FP8
    assert fp8_modules == set(QUANTIZED_IN_FILE) - {"final_layer.video_out"}
    head = model.final_layer.video_out
    assert type(head) is nn.Linear and head.weight.dtype == torch.float32
    assert torch.equal(head.weight, meant["final_layer.video_out"])
    qkv = model.blocks[0].attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.shape == () and qkv.matmul == "dequantize"
    assert torch.equal(qkv.dequantized_weight().float(), meant["blocks.0.attn.qkv_proj"].bfloat16().float())

    # read again after a drop (a host short of CPU memory): the same FP8 weights and scales
    reader = DiTReader(path, dtype=torch.bfloat16)
    first = {k: v.clone() for k, v in reader.read("cpu").state_dict().items()}
    reader.drop()
    again = reader.read("cpu").state_dict()
    assert set(first) == set(again) and all(torch.equal(first[k], again[k]) for k in first)

    # "dense" dequantizes at load; the weight-only FP8 model computes exactly what it computes
    dense = load_dit(path, dtype=torch.bfloat16, linears="dense")
    assert not any(isinstance(m, FP8Linear) for m in dense.modules())
    for a, b in zip(forward(model), forward(dense)):
        assert torch.equal(a, b)
    # and stays close to the bf16 model the file was made from
    for a, b in zip(forward(bf16_model), forward(model)):
        assert cosine(a, b) > 0.99
    assert not any(p.requires_grad for layer in fp8_modules for p in model.get_submodule(layer).parameters())


def test_a_plain_fp8_cast_file_is_read_as_fp8_with_scale_one(tmp_path, bf16_model):
    """Files whose weights were only cast to e4m3fn (no scales, no quantization records) are FP8 with scale 1."""
    tensors = native_tensors(bf16_model)
    for layer in QUANTIZED_IN_FILE:
        tensors[f"{layer}.weight"] = tensors[f"{layer}.weight"].to(torch.float8_e4m3fn)
    path = tmp_path / "cast.safetensors"
    save_file({f"model.diffusion_model.{k}": v for k, v in tensors.items()}, str(path))
    assert locate_dit(path).fp8_layers["blocks.0.mlp.fc1"] == fp8.FP8Entry(torch.float8_e4m3fn, (), False)
    model = load_dit(path, dtype=torch.bfloat16)
    for layer in set(QUANTIZED_IN_FILE) - {"final_layer.video_out"}:
        module = model.get_submodule(layer)
        assert isinstance(module, FP8Linear) and module.weight_scale.item() == 1.0, layer
        assert torch.equal(module.dequantized_weight(), tensors[f"{layer}.weight"].bfloat16()), layer
    dense = load_dit(path, dtype=torch.bfloat16, linears="dense")
    for a, b in zip(forward(model), forward(dense)):
        assert torch.equal(a, b)


@CPU_SCALED
def test_fp8_file_with_scaled_matmul(tmp_path, bf16_model):
    path = tmp_path / "fp8.safetensors"
    meant = write_fp8_scaled(path, bf16_model, "comfy_quant", prefix="")
    model = load_dit(path, dtype=torch.float32, linears="fp8-lossy")
    fc2 = model.blocks[1].mlp.fc2
    assert fc2.matmul == "scaled" and fc2.weight_scale.shape == () and fc2.bias is None  # one scale, as in the file
    # FP8 activations only in the blocks: the file's AdaLN and refiner linears stay weight-only (as a bf16 file's do)
    for layer in ("blocks.0.adaln_proj.linear", "token_refiner.blocks.1.mlp.fc1"):
        assert model.get_submodule(layer).matmul == "dequantize", layer
    # the file's weight (one scale) against activations scaled per row, in independent float64 arithmetic
    x = torch.randn(3, 5, fc2.in_features)
    xq, xs = reference_quantize(x.reshape(-1, fc2.in_features), per_row=True)
    expected = (xq.double() * xs.double()) @ meant["blocks.1.mlp.fc2"].double().T
    torch.testing.assert_close(fc2(x).double().reshape(-1, fc2.out_features), expected, rtol=1e-5, atol=1e-5)
    dense = load_dit(path, dtype=torch.float32, linears="dense")
    for a, b in zip(forward(dense), forward(model)):
        assert cosine(a, b) > 0.99


@pytest.mark.parametrize("style", ["comfy_quant", "scaled_fp8"])
def test_an_e5m2_file_is_held_a_byte_a_weight_as_planned(tmp_path, bf16_model, style):
    """A float8_e5m2 file's linears are kept as stored (weight-only: the FP8 matmul takes e4m3), so the memory
    plan's byte a weight holds. They were dequantized to bf16 at load, two bytes a weight against the plan's one."""
    path = tmp_path / "minimax_h3_fl2va_fp8_e5m2.safetensors"
    meant = write_fp8_scaled(path, bf16_model, style, dtype=torch.float8_e5m2)
    source = with_config(locate_dit(path))
    for mode in ("checkpoint", "fp8-weights-lossy"):
        model = load_dit(path, dtype=torch.bfloat16, linears=mode)
        for layer in set(QUANTIZED_IN_FILE) - {"final_layer.video_out"}:
            module = model.get_submodule(layer)
            assert isinstance(module, FP8Linear) and module.weight.dtype == torch.float8_e5m2, (mode, layer)
            assert module.matmul == "dequantize", (mode, layer)
            assert torch.equal(module.dequantized_weight().float(), meant[layer].bfloat16().float()), (mode, layer)
        assert fp8.held_format(model) == "fp8" == held_linears(source, mode), mode
        assert held_linears(locate_dit(path), mode) == "fp8", mode  # its config not read yet: the blocks it names


@CPU_SCALED
def test_an_e5m2_files_block_linears_are_requantized_to_e4m3_under_fp8_lossy(tmp_path, bf16_model):
    """The FP8 matmul takes e4m3: under fp8-lossy an e5m2 file's block linears are requantized as an int8 file's."""
    path = tmp_path / "minimax_h3_fl2va_fp8_e5m2.safetensors"
    write_fp8_scaled(path, bf16_model, "comfy_quant", dtype=torch.float8_e5m2)
    source = with_config(locate_dit(path))
    blocks = [layer for layer in QUANTIZED_IN_FILE if layer.startswith("blocks.") and "adaln" not in layer]
    dense = load_dit(path, dtype=torch.float32, linears="dense")
    lossy = load_dit(path, dtype=torch.float32, linears="fp8-lossy")
    for layer in blocks:
        module = lossy.get_submodule(layer)
        weight, scale = fp8.quantize_weight(dense.get_submodule(layer).weight)
        assert module.weight.dtype == fp8.FP8 and module.matmul == "scaled", layer
        assert torch.equal(module.weight, weight) and torch.equal(module.weight_scale, scale), layer
    assert fp8.held_format(lossy) == "fp8-scaled" == held_linears(source, "fp8-lossy")


@CPU_SCALED
def test_online_quantization_at_load_equals_quantizing_after(tmp_path, bf16_model):
    path = tmp_path / "bf16.safetensors"
    save_file(native_tensors(bf16_model), str(path))
    assert locate_dit(path).fp8_layers == {}
    at_load = load_dit(path, linears="fp8-lossy")
    after = load_dit(path)
    assert not any(isinstance(m, FP8Linear) for m in after.modules())
    quantize_blocks(after, "scaled")
    a, b = at_load.state_dict(), after.state_dict()
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name
    assert isinstance(at_load.blocks[0].mlp.fc1, FP8Linear) and at_load.blocks[0].mlp.fc1.matmul == "scaled"


def test_other_quantizations_and_broken_fp8_files_are_refused(tmp_path, bf16_model):
    tensors = {f"model.diffusion_model.{k}": v for k, v in native_tensors(bf16_model).items()}
    int8 = dict(tensors)
    int8["model.diffusion_model.blocks.0.mlp.fc1.weight"] = torch.zeros(256, 64, dtype=torch.int8)
    int8["model.diffusion_model.blocks.0.mlp.fc1.weight_scale"] = torch.tensor(1.0)
    int8["model.diffusion_model.blocks.0.mlp.fc1.comfy_quant"] = torch.tensor(
        list(json.dumps({"format": "int8_tensorwise"}).encode()), dtype=torch.uint8)
    save_file(int8, str(tmp_path / "int8.safetensors"))  # plain int8 (no ConvRot) is read too
    assert torch.equal(load_dit(tmp_path / "int8.safetensors").blocks[0].mlp.fc1.dequantized_weight(),
                       torch.zeros(256, 64, dtype=torch.bfloat16))
    w4a8 = dict(int8)
    w4a8["model.diffusion_model.blocks.0.mlp.fc1.comfy_quant"] = torch.tensor(
        list(json.dumps({"format": "asym_w4a8_int8"}).encode()), dtype=torch.uint8)
    save_file(w4a8, str(tmp_path / "w4a8.safetensors"))
    with pytest.raises(CheckpointError, match="'asym_w4a8_int8'; this loader reads FP8"):
        load_dit(tmp_path / "w4a8.safetensors")

    no_scale = dict(tensors)
    no_scale["model.diffusion_model.blocks.0.mlp.fc1.weight"] = torch.zeros(256, 64, dtype=torch.uint8)
    no_scale["model.diffusion_model.blocks.0.mlp.fc1.comfy_quant"] = torch.tensor(
        list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)
    save_file(no_scale, str(tmp_path / "no_scale.safetensors"))
    # a uint8 weight named FP8 with no scale is read as unscaled FP8 (scale 1), like ComfyUI does
    model = load_dit(tmp_path / "no_scale.safetensors")
    assert model.blocks[0].mlp.fc1.weight_scale.item() == 1.0


def comfy_quant(fmt: str, **extra) -> torch.Tensor:
    """A layer's `X.comfy_quant` record: the JSON object's bytes as a uint8 tensor."""
    return torch.tensor(list(json.dumps({"format": fmt, **extra}).encode()), dtype=torch.uint8)


FC1 = "model.diffusion_model.blocks.0.mlp.fc1"


def _int4_one_scale(tensors):
    tensors[f"{FC1}.weight"] = torch.zeros(256, 32, dtype=torch.int8)
    tensors[f"{FC1}.weight_scale"] = torch.tensor(1.0)
    tensors[f"{FC1}.comfy_quant"] = comfy_quant("convrot_w4a4", convrot_groupsize=16)


BROKEN_FILES = {  # what is wrong -> (the change to a bf16 repack, file metadata, the refusal)
    "int8 record, bf16 weight": (
        lambda t: t.update({f"{FC1}.weight_scale": torch.tensor(1.0),
                            f"{FC1}.comfy_quant": comfy_quant("int8_tensorwise")}),
        None, f"'{FC1}.weight' in bad.safetensors is marked int8 but stored as BF16."),
    "int8 without a scale": (
        lambda t: t.update({f"{FC1}.weight": torch.zeros(256, 64, dtype=torch.int8),
                            f"{FC1}.comfy_quant": comfy_quant("int8_tensorwise")}),
        None, f"'{FC1}.weight' in bad.safetensors is marked int8 but stored as I8 without a weight_scale."),
    "FP8 record, bf16 weight": (
        lambda t: t.update({f"{FC1}.weight_scale": torch.tensor(1.0),
                            f"{FC1}.comfy_quant": comfy_quant("float8_e4m3fn")}),
        None, f"'{FC1}.weight' in bad.safetensors is marked FP8 but stored as BF16."),
    "a scale but no format": (
        lambda t: t.update({f"{FC1}.weight_scale": torch.tensor(1.0)}),
        None, f"'{FC1}.weight' in bad.safetensors has a scale but is stored as BF16 with no FP8 format named; "),
    "a scale of 3 values": (
        lambda t: t.update({f"{FC1}.weight": torch.zeros(256, 64, dtype=torch.float8_e4m3fn),
                            f"{FC1}.weight_scale": torch.ones(3)}),
        None, f"The scale of '{FC1}.weight' in bad.safetensors has shape [3]; expected one value or one per output "
              "channel (256)."),
    "int4 with one scale": (
        _int4_one_scale, None, f"int4 layer '{FC1}.weight' in bad.safetensors needs a scale per row (256), has 1."),
    "unreadable metadata": (
        lambda t: None, {"_quantization_metadata": "{not json"},
        "bad.safetensors has unreadable '_quantization_metadata'."),
}


@pytest.mark.parametrize("fault", list(BROKEN_FILES))
def test_a_broken_quantized_file_is_refused_saying_what_is_wrong(tmp_path, bf16_model, fault):
    """Each is said when the file's headers are read (locate_dit), before any weight is."""
    change, metadata, message = BROKEN_FILES[fault]
    tensors = {f"model.diffusion_model.{k}": v for k, v in native_tensors(bf16_model).items()}
    change(tensors)
    save_file(tensors, str(tmp_path / "bad.safetensors"), metadata=metadata)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        locate_dit(tmp_path / "bad.safetensors")


def test_quantized_weights_for_a_layer_the_model_lacks_are_refused(tmp_path, bf16_model):
    tensors = {f"model.diffusion_model.{k}": v for k, v in native_tensors(bf16_model).items()}
    tensors["model.diffusion_model.blocks.0.mlp.fc3.weight"] = torch.zeros(64, 64, dtype=torch.float8_e4m3fn)
    tensors["model.diffusion_model.blocks.0.mlp.fc3.weight_scale"] = torch.tensor(1.0)
    save_file(tensors, str(tmp_path / "extra.safetensors"))
    with pytest.raises(CheckpointError, match=re.escape("The checkpoint has quantized weights for 'blocks.0.mlp.fc3', "
                                                        "which this model does not have.")):
        load_dit(tmp_path / "extra.safetensors")


def test_bad_fp8_settings_are_refused_naming_the_choices():
    linear = FP8Linear.from_linear(nn.Linear(64, 32), "dequantize")
    with pytest.raises(ValueError, match=re.escape("Unknown FP8 matmul 'fast'; choose one of dequantize, scaled.")):
        linear.set_matmul("fast")
    with pytest.raises(ValueError, match=re.escape("FP8 activations are scaled per 'row' or per 'tensor', got 'column'.")):
        linear.set_matmul("dequantize", "column")
    with pytest.raises(ValueError, match=re.escape("Unknown FP8 matmul 'fast'; choose one of dequantize, scaled.")):
        quantize_blocks(tiny_random_dit(), "fast")
    sizes = (0, 1, 2, 4, 8, 12, 16, 32, 64, 256, 1024)
    assert [size for size in sizes if fp8.is_rotation_group(size)] == [4, 16, 64, 256, 1024]
    assert not fp8.is_rotation_group(True) and not fp8.is_rotation_group(16.0)
    with pytest.raises(ValueError, match=re.escape("A ConvRot group is a power of 4 (4, 16, 64, 256, ...); got 8.")):
        fp8.hadamard_signs(8)
    with pytest.raises(ValueError, match="A ConvRot weight with 24 input columns does not split into groups of 16."):
        fp8.rotate_integers(torch.zeros(2, 24, dtype=torch.int8), 16)


# ----------------------------------------------------------------------------------------------
# Streaming and memory


@pytest.mark.parametrize("quantized_block", [0, 1])
def test_a_file_with_some_blocks_left_dense_streams_and_is_planned_dense(tmp_path, quantized_block):
    """ComfyUI fp8_scaled files may leave layers in bf16: blocks then hold different weights. The streamer packed
    every block as block 0 (a shape error, or another block's bytes read as this one's), and the memory plan
    counted every block as block 0 held (FP8 when the others are dense: too few bytes)."""
    path = tmp_path / "partial.safetensors"
    write_fp8_scaled(path, tiny_random_dit(torch.bfloat16), "comfy_quant",
                     layers=[f"blocks.{quantized_block}.{leaf}" for leaf in BLOCK_LINEARS])
    check_streamed_blocks_equal_resident(path)
    assert fp8.held_format(load_dit(path)) == "dense"
    assert held_linears(with_config(locate_dit(path)), "checkpoint") == "dense"
    from h3_core.checkpoint import holds_stored_linears
    from h3_core.lora import run_mode
    from h3_core.parallel.workers import ModelSpec

    # LoRAs are hooked into such a file (its FP8 linears stay stored): the plan counts their factors as run_mode does
    assert holds_stored_linears(locate_dit(path)) and run_mode(load_dit(path)) == "dynamic"
    assert ModelSpec(str(path)).held_linears() == "dense"  # split workers plan every block too (the last was missed)
    every = tmp_path / "every.safetensors"
    write_fp8_scaled(every, tiny_random_dit(torch.bfloat16), "comfy_quant",
                     layers=[f"blocks.{index}.{leaf}" for index in (0, 1) for leaf in BLOCK_LINEARS])
    assert fp8.held_format(load_dit(every)) == "fp8" == held_linears(with_config(locate_dit(every)), "checkpoint")


@pytest.mark.parametrize("matmul", [pytest.param("scaled", marks=CPU_SCALED), "dequantize"])
def test_streamed_fp8_equals_resident_fp8(matmul):
    config = replace(TINY_DIT, num_layers=4)

    def fresh():
        model = seeded_random_weights(H3DiT(config), 2).eval().requires_grad_(False)
        quantize_blocks(model, matmul)
        return model

    expected = forward(fresh())
    model = fresh()
    streamer = stream_blocks(model, "cpu", resident=1, prefetch=1)
    home = streamer.home[2]
    assert any(t.dtype == torch.float8_e4m3fn for t in home) and any(t.dtype == torch.float32 for t in home)
    for a, b in zip(expected, forward(model)):
        assert torch.equal(a, b)
    # the streamed weights are back in their (pinned-able) CPU home, still e4m3
    fc1 = model.blocks[3].mlp.fc1
    assert fc1.weight.dtype == torch.float8_e4m3fn
    assert any(fc1.weight.data_ptr() == t.data_ptr() for t in streamer.home[3])
    streamer.remove()


def test_memory_plan_counts_one_byte_per_fp8_weight():
    real = DiTConfig()
    dense, quantized = block_weight_bytes(real, 2), block_weight_bytes(real, 2, "fp8")
    scales = 4 * (3 * 7168 + 5376 + 2 * 14336 + 5376)
    norms = 2 * (2 * 5376 + 2 * 128)
    assert quantized == 385_351_680 + scales + norms
    assert dense == 2 * 385_351_680 + norms
    budget = 40 * 2**30
    assert plan_memory(real, 38_222, budget, held="fp8").resident_blocks > plan_memory(real, 38_222, budget).resident_blocks
    # the streamed slot of a real block is what the planner counts (checked on the meta device)
    with torch.device("meta"):
        block_model = H3DiT(replace(real, num_layers=1)).set_dtype(torch.bfloat16)
    assert fp8.held_format(block_model) == "dense"
    quantize_blocks(block_model, "dequantize")
    assert fp8.held_format(block_model) == "fp8"
    assert block_weight_bytes(real, 2, "fp8-scaled") == block_weight_bytes(real, 2, "int8") == quantized
    streamed = [p for n, p in block_model.blocks[0].named_parameters() if not n.startswith("adaln_proj.")]
    assert sum(p.numel() * p.element_size() for p in streamed) == quantized


# ----------------------------------------------------------------------------------------------
# Off by default


@CPU_SCALED
def test_each_linears_mode_applied_to_a_model_in_memory():
    """What the tiny model and LoRA runs do after loading: only the lossy modes swap the block linears, each its way."""
    blocks = [f"blocks.{i}.{leaf}" for i in range(2) for leaf in BLOCK_LINEARS]
    for mode, matmul in (("checkpoint", None), ("dense", None), ("fp8-weights-lossy", "dequantize"),
                         ("fp8-lossy", "scaled")):
        model = tiny_random_dit(torch.float32)
        assert fp8.apply_linear_mode(model, mode, "cpu") == ([] if matmul is None else blocks), mode
        swapped = {name: module.matmul for name, module in model.named_modules() if isinstance(module, FP8Linear)}
        assert swapped == ({} if matmul is None else dict.fromkeys(blocks, matmul)), mode
    with pytest.raises(ValueError, match="Unknown linears mode 'fp4'"):
        fp8.apply_linear_mode(tiny_random_dit(), "fp4")


def test_with_loras_only_the_lossy_fp8_modes_read_the_file_as_stored():
    """LoRAs merge into the dense weights before lossy FP8 linears are made, so those modes read the file as it
    stores them; every other mode (and any mode without LoRAs) reads as asked."""
    assert [fp8.read_mode(mode, loras=True) for mode in fp8.LINEAR_MODES] == [
        "checkpoint", "dense", "checkpoint", "checkpoint"]
    assert [fp8.read_mode(mode, loras=False) for mode in fp8.LINEAR_MODES] == list(fp8.LINEAR_MODES)


def test_lossy_paths_are_off_by_default(tmp_path, bf16_model):
    from h3_core.attention import LOSSY_BACKENDS, resolve_backend
    from h3_core.cli import build_parser
    from h3_core.pipeline import GenerateSettings

    assert GenerateSettings().linears == "checkpoint" and GenerateSettings().attention == "auto"
    assert resolve_backend("auto", "cpu") not in LOSSY_BACKENDS
    for command in (["generate", "--prompt", "x"], ["denoise", "--save-latents", "x.safetensors"]):
        assert build_parser().parse_args(command).linears == "checkpoint"
    lossy = [mode for mode in fp8.LINEAR_MODES if mode.startswith("fp8")]
    assert lossy and all(mode.endswith("-lossy") for mode in lossy)
    path = tmp_path / "bf16.safetensors"
    save_file(native_tensors(bf16_model), str(path))
    assert not any(isinstance(m, FP8Linear) for m in load_dit(path).modules())
    assert not any(isinstance(m, FP8Linear) for m in tiny_random_dit().modules())
    with pytest.raises(ValueError, match="fp8-lossy"):
        load_dit(path, linears="fp8")


# ----------------------------------------------------------------------------------------------
# ComfyUI int8 (ConvRot) single files: dequantized at load


def convrot_matrix(group: int) -> torch.Tensor:
    """The rotation as ComfyUI documents it, built here independently: Kronecker powers of the 4x4 block,
    normalized (float64)."""
    block = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float64)
    matrix = block
    while matrix.shape[0] < group:
        matrix = torch.kron(matrix, block)
    return matrix / group**0.5


def test_the_rotation_is_comfyuis_and_its_own_inverse():
    """fp8.hadamard (what bench/text_encoder_quantized.py rotates with) against the documented construction."""
    for group in (4, 16, 64):
        rotation = fp8.hadamard(group)
        assert rotation.dtype == torch.float32
        torch.testing.assert_close(rotation.double(), convrot_matrix(group), rtol=0, atol=1e-7)
        torch.testing.assert_close(rotation @ rotation, torch.eye(group), rtol=0, atol=1e-6)


def write_convrot(path, model, layers, group=16, prefix="model.diffusion_model.", bits=8):
    """An `*_int8_convrot` file (`bits` 8) or an int4 ConvRot one (`bits` 4, format `convrot_w4a4`): each layer's
    weight rotated in groups of `group` input columns (x @ H^T), then rounded to +-127 (+-7) steps of one fp32
    scale per row, int4 values packed two a byte (the even column in the low nibble), and its comfy_quant record.
    Returns (the weights the file means, the original weights), float64."""
    tensors = native_tensors(model)
    rotation = convrot_matrix(group)
    levels = 127 if bits == 8 else 7
    meant, original = {}, {}
    for layer in layers:
        weight = tensors.pop(f"{layer}.weight").double()
        out_features, in_features = weight.shape
        rotated = (weight.reshape(out_features, -1, group) @ rotation.T).reshape(out_features, in_features)
        scale = rotated.abs().amax(dim=1, keepdim=True) / levels
        q = (rotated / scale).round().clamp(-levels, levels).to(torch.int8)
        stored = q.double() * scale.float().double()
        meant[layer] = (stored.reshape(out_features, -1, group) @ rotation).reshape(out_features, in_features)
        original[layer] = weight
        if bits == 4:
            nibbles = q.to(torch.int32) & 0x0F
            q = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
            record = {"format": "convrot_w4a4", "convrot_groupsize": group}
        else:
            record = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": group}
        tensors[f"{layer}.weight"] = q
        tensors[f"{layer}.weight_scale"] = scale.float().view(-1) if bits == 4 else scale.float()
        tensors[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps(record).encode()), dtype=torch.uint8)
    save_file({prefix + k: v.contiguous() for k, v in tensors.items()}, str(path))
    return meant, original


def test_an_int8_convrot_file_is_turned_back_and_dequantized_at_load(tmp_path):
    model = tiny_random_dit()
    layers = [f"blocks.{i}.{leaf}" for i in range(2) for leaf in BLOCK_LINEARS]
    path = tmp_path / "minimax_h3_fl2va_int8_convrot.safetensors"
    meant, original = write_convrot(path, model, layers)
    assert {entry.rotation for entry in locate_dit(path).fp8_layers.values()} == {16}
    kept = load_dit(path, dtype=torch.float32)  # int8 in memory, the weight rebuilt at each call
    dense = load_dit(path, dtype=torch.float32, linears="dense")  # dequantized once at load
    for layer in layers:
        module = kept.get_submodule(layer)
        assert isinstance(module, FP8Linear) and module.weight.dtype == torch.int8 and module.rotation == 16
        weight = dense.get_submodule(layer).weight
        assert type(dense.get_submodule(layer)) is nn.Linear and weight.dtype == torch.float32
        assert torch.allclose(weight.double(), meant[layer], atol=1e-6)
        assert torch.equal(module.dequantized_weight(), weight)
        error = (weight.double() - original[layer]).norm() / original[layer].norm()
        assert error < 0.02  # int8 rounding only: a weight left rotated would be ~1.4 away
    assert torch.equal(forward(kept)[0], forward(dense)[0])
    assert cosine(forward(kept)[0], forward(model)[0]) > 0.999
    # planned as a rotated int8 rebuild (12 bytes a weight against e4m3's 8), before the load and after
    assert fp8.held_format(kept) == "int8" == held_linears(with_config(locate_dit(path)), "checkpoint")
    assert locate_dit(path).origin == "single file (int8)"  # it said FP8


def _rewritten(path, records: dict, metadata: dict | None = None):
    """The file at `path` again with these layers' comfy_quant records (our layer names) and file metadata."""
    from safetensors import safe_open

    with safe_open(path, "pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    for layer, record in records.items():
        tensors[f"model.diffusion_model.{layer}.comfy_quant"] = torch.tensor(list(json.dumps(record).encode()),
                                                                             dtype=torch.uint8)
    save_file(tensors, str(path), metadata=metadata)


def test_a_convrot_record_is_read_as_comfyui_reads_it(tmp_path):
    """What ComfyUI takes, we take (its files are made for it): a group size written as a string ("16": ComfyUI
    reads it through int()), and the file metadata's record where a layer's comfy_quant tensor says otherwise
    (ComfyUI's metadata wins; here ours took the tensor's group 16 for weights rotated in groups of 64)."""
    model = tiny_random_dit()
    layer = "blocks.0.mlp.fc1"
    path = tmp_path / "int8.safetensors"
    meant16, _ = write_convrot(path, model, [layer], group=16)
    _rewritten(path, {layer: {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": "16"}})
    weight = load_dit(path, dtype=torch.float32, linears="dense").get_submodule(layer).weight
    assert torch.allclose(weight.double(), meant16[layer], atol=1e-6)

    meant64, _ = write_convrot(path, model, [layer], group=64)
    right = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 64}
    metadata = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": {
        f"model.diffusion_model.{layer}": right}})}
    _rewritten(path, {layer: {**right, "convrot_groupsize": 16}}, metadata)
    assert locate_dit(path).fp8_layers[layer].rotation == 64
    weight = load_dit(path, dtype=torch.float32, linears="dense").get_submodule(layer).weight
    assert torch.allclose(weight.double(), meant64[layer], atol=1e-6)
    # a rotated record without a group size rotates in ComfyUI's default groups of 256, which fc1's 64 input
    # columns do not fill: said when the headers are read, naming the file (it was a ValueError at the first rebuild)
    _rewritten(path, {layer: {"format": "int8_tensorwise", "convrot": True}})
    with pytest.raises(CheckpointError, match=re.escape(f"'model.diffusion_model.{layer}.weight' in int8.safetensors "
                                                        "is rotated in groups of 256 input columns, but it has 64.")):
        locate_dit(path)
    # int4 holds two columns a byte: its 32 bytes a row are 64 columns, one group of 64
    meant4, _ = write_convrot(path, model, [layer], group=64, bits=4)
    assert locate_dit(path).fp8_layers[layer].rotation == 64
    weight = load_dit(path, dtype=torch.float32, linears="dense").get_submodule(layer).weight
    assert torch.allclose(weight.double(), meant4[layer], atol=1e-6)


@CPU_SCALED
def test_an_int8_file_under_fp8_lossy_is_requantized_to_fp8(tmp_path):
    """int8 has no FP8 matmul: under fp8-lossy the int8 block linears are turned back and quantized to e4m3 per
    output channel, as a bf16 file's are (FP8 tensor-core matmuls); the other modes keep them int8."""
    model = tiny_random_dit()
    layers = [f"blocks.{i}.{leaf}" for i in range(2) for leaf in BLOCK_LINEARS]
    path = tmp_path / "minimax_h3_fl2va_int8_convrot.safetensors"
    write_convrot(path, model, layers)
    dense = load_dit(path, dtype=torch.float32, linears="dense")
    lossy = load_dit(path, dtype=torch.float32, linears="fp8-lossy")
    for layer in layers:
        module = lossy.get_submodule(layer)
        assert isinstance(module, FP8Linear) and module.weight.dtype == fp8.FP8 and module.matmul == "scaled", layer
        weight, scale = fp8.quantize_weight(dense.get_submodule(layer).weight)
        assert torch.equal(module.weight, weight) and torch.equal(module.weight_scale, scale), layer
    assert cosine(forward(lossy)[0], forward(dense)[0]) > 0.99
    assert fp8.held_format(lossy) == "fp8-scaled" == held_linears(with_config(locate_dit(path)), "fp8-lossy")
    weights_only = load_dit(path, dtype=torch.float32, linears="fp8-weights-lossy")
    assert {weights_only.get_submodule(layer).weight.dtype for layer in layers} == {torch.int8}


def test_an_int4_convrot_file_stays_int4(tmp_path):
    """ComfyUI's int4 ConvRot files (`convrot_w4a4`): the linears stay int4 (half a byte a weight) and each weight
    is rebuilt, turned back from its rotation, as it is used (weight-only: the activations stay in the model
    dtype); the same weights as dequantizing at load; fp8-lossy requantizes the block linears to e4m3,
    fp8-weights-lossy keeps them int4."""
    from h3_core.checkpoint import held_linears

    model = tiny_random_dit()
    layers = [f"blocks.{i}.{leaf}" for i in range(2) for leaf in BLOCK_LINEARS] + ["token_refiner.blocks.0.mlp.fc2"]
    path = tmp_path / "minimax_h3_fl2va_int4_convrot.safetensors"
    meant, original = write_convrot(path, model, layers, bits=4)
    source = locate_dit(path)
    assert {entry.packed for entry in source.fp8_layers.values()} == {True} and "int4" in source.origin
    assert held_linears(source, "checkpoint") == "int4" == held_linears(source, "fp8-weights-lossy")
    kept = load_dit(path, dtype=torch.float32)
    dense = load_dit(path, dtype=torch.float32, linears="dense")
    for layer in layers:
        module = kept.get_submodule(layer)
        assert isinstance(module, FP8Linear) and module.packed and module.held == "int4", layer
        assert module.weight.dtype == torch.int8 and module.weight.shape[1] * 2 == module.in_features
        weight = dense.get_submodule(layer).weight
        assert type(dense.get_submodule(layer)) is nn.Linear
        assert torch.allclose(weight.double(), meant[layer], atol=1e-6)
        assert torch.equal(module.dequantized_weight(), weight)
        assert (weight.double() - original[layer]).norm() / original[layer].norm() < 0.2  # 4-bit rounding only
    assert fp8.held_format(kept) == "int4"
    assert torch.equal(forward(kept)[0], forward(dense)[0])
    weights_only = load_dit(path, dtype=torch.float32, linears="fp8-weights-lossy")
    assert all(weights_only.get_submodule(layer).packed for layer in layers)
    if fp8.scaled_mm_supported("cpu"):
        lossy = load_dit(path, dtype=torch.float32, linears="fp8-lossy")
        for layer in layers[:8]:
            weight, scale = fp8.quantize_weight(dense.get_submodule(layer).weight)
            assert torch.equal(lossy.get_submodule(layer).weight, weight), layer
        assert lossy.get_submodule(layers[-1]).packed  # not a block linear: stays int4


def test_memory_plan_counts_half_a_byte_per_int4_weight():
    real = DiTConfig()
    with torch.device("meta"):
        block_model = H3DiT(replace(real, num_layers=1)).set_dtype(torch.bfloat16)
    for layer in fp8.block_linear_names(block_model):
        linear = block_model.get_submodule(layer)
        block_model.set_submodule(layer, FP8Linear(linear.in_features, linear.out_features, weight_dtype=torch.int8,
                                                   device="meta", rotation=256, packed=True))
    streamed = [p for n, p in block_model.blocks[0].named_parameters() if not n.startswith("adaln_proj.")]
    assert sum(p.numel() * p.element_size() for p in streamed) == block_weight_bytes(real, 2, "int4")
    assert block_weight_bytes(real, 2, "int4") < 0.6 * block_weight_bytes(real, 2, "fp8")


@pytest.mark.parametrize("record, message", [
    ({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 8}, "groups of 8; ConvRot groups are powers of 4"),
    # 0 was read as "not rotated": the weights came back unrelated
    ({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 0}, "groups of 0; ConvRot groups are powers of 4"),
    ({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": "sixteen"}, "groups of 'sixteen'"),
    ([1, 2], "comfy_quant' in bad.safetensors is not a JSON quantization record"),
    (None, "comfy_quant' in bad.safetensors is not a JSON quantization record"),
])
def test_int8_rotation_groups_must_be_powers_of_four(tmp_path, record, message):
    model = tiny_random_dit()
    path = tmp_path / "bad.safetensors"
    write_convrot(path, model, ["blocks.0.mlp.fc1"], group=16)
    from safetensors import safe_open

    with safe_open(path, "pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    key = "model.diffusion_model.blocks.0.mlp.fc1.comfy_quant"
    tensors[key] = (torch.tensor(list(json.dumps(record).encode()), dtype=torch.uint8) if record is not None
                    else torch.tensor([0.5, 1.5]))  # a float tensor where the record's bytes belong
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=message):
        locate_dit(path)


def test_our_convrot_dequantization_is_comfy_kitchens():
    """ComfyUI's own kernels package, where installed (ComfyUI's requirements): the same weights back."""
    kitchen = pytest.importorskip("comfy_kitchen.backends.eager.quantization",
                                  reason="comfy_kitchen (ComfyUI's kernels) is not installed here")
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (96, 256), generator=g, dtype=torch.int8)
    scale = torch.rand(96, 1, generator=g) * 0.01
    for group in (16, 64, 256):
        theirs = kitchen.dequantize_int8_convrot_weight(q, scale, group)
        assert torch.allclose(fp8.dequantize(q, scale.view(-1), torch.float32, group), theirs, atol=1e-6)


def test_our_nvfp4_dequantization_is_comfy_kitchens():
    """ComfyUI's kernels package, where installed: its NVFP4 quantizer's output (padded shapes too) comes back
    as its own dequantizer gives it, and the tests' NVFP4 writer (tests/nvfp4_files.py) lays weights out as it
    reads them."""
    kitchen = pytest.importorskip("comfy_kitchen.backends.eager.quantization",
                                  reason="comfy_kitchen (ComfyUI's kernels) is not installed here")
    import nvfp4_files

    from h3_core import nvfp4

    g = torch.Generator().manual_seed(3)
    for out_features, in_features in ((256, 128), (200, 72)):
        weight = torch.randn(out_features, in_features, generator=g) * 0.02
        tensor_scale = weight.abs().max() / (448.0 * 6.0)
        packed, blocks = kitchen.quantize_nvfp4(weight, tensor_scale, pad_16x=(out_features, in_features) != (256, 128))
        theirs = kitchen.dequantize_nvfp4(packed, tensor_scale, blocks, torch.float32)[:out_features, :in_features]
        ours = nvfp4.dequantize(packed, blocks, tensor_scale, (out_features, in_features), torch.float32)
        assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)
        assert ((ours - weight).norm() / weight.norm()).item() < 0.15

        written, meant = nvfp4_files.quantize(weight)
        theirs = kitchen.dequantize_nvfp4(written["weight"], written["weight_scale_2"], written["weight_scale"],
                                          torch.float32)[:out_features, :in_features]
        assert torch.allclose(theirs.double(), meant, rtol=1e-6, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("packed", [False, True])
def test_rotated_integer_weights_rebuild_on_cuda_as_on_the_cpu(packed):
    """CUDA turns the rotation back with int8 tensor cores (int32 sums), the CPU in fp32: both exact, so equal."""
    g = torch.Generator().manual_seed(6)
    weight = torch.randint(-128, 128, (384, 512 // (2 if packed else 1)), generator=g).to(torch.int8)
    scale = torch.rand(384, generator=g) * 0.01
    for group in (4, 16, 256):
        want = fp8.dequantize(weight, scale, torch.float32, group, packed)
        got = fp8.dequantize(weight.cuda(), scale.cuda(), torch.float32, group, packed)
        assert torch.equal(got.cpu(), want), group


def test_our_int4_convrot_dequantization_is_comfy_kitchens():
    """ComfyUI's kernels package, where installed: its int4 ConvRot quantizer's output comes back as its own
    dequantizer gives it."""
    kitchen = pytest.importorskip("comfy_kitchen.backends.eager.convrot_w4a4",
                                  reason="comfy_kitchen (ComfyUI's kernels) is not installed here")
    g = torch.Generator().manual_seed(4)
    for group in (16, 64, 256):
        weight = torch.randn(96, 512, generator=g) * 0.02
        packed, scales = kitchen.quantize_convrot_w4a4_weight(weight, group)
        theirs = kitchen.dequantize_convrot_w4a4_weight(packed, scales, group)
        ours = fp8.dequantize(packed, scales, torch.float32, group, packed=True)
        assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-7)
        assert ((ours - weight).norm() / weight.norm()).item() < 0.2


@pytest.mark.parametrize("bits", [8, 4])
def test_compiled_blocks_rebuild_int8_and_int4_weights_as_eager_ones_do(tmp_path, bits):
    """The rotation's matrix is built inside a compiled graph (its cache stays outside), int4 values unpacked
    there: same output."""
    layers = [f"blocks.{i}.{leaf}" for i in range(2) for leaf in BLOCK_LINEARS]
    write_convrot(tmp_path / "int8.safetensors", tiny_random_dit(), layers, bits=bits)
    expected = forward(load_dit(tmp_path / "int8.safetensors", dtype=torch.float32))[0]
    compiled = load_dit(tmp_path / "int8.safetensors", dtype=torch.float32).compile_blocks()
    assert torch.allclose(forward(compiled)[0], expected, atol=1e-5)


def test_fp8_in_a_sharded_folder_is_refused_naming_the_folder(tmp_path):
    """FP8 is read from ComfyUI-style single files only; a sharded folder holding some is named as a whole (the
    refusal named its first shard, which need not be the one holding FP8)."""
    pytest.importorskip("diffusers", reason="the diffusers folder is written by diffusers (the test extra)")
    from reference_checkpoints import reference_dit, write_diffusers_folder
    from safetensors.torch import load_file

    folder = write_diffusers_folder(tmp_path / "transformer", reference_dit(TINY_DIT, seed=4))
    shards = sorted(folder.glob("*.safetensors"))
    last = next(shard for shard in reversed(shards) if any(".weight" in key for key in load_file(str(shard))))
    tensors = load_file(str(last))
    name = next(key for key, tensor in tensors.items() if key.endswith(".weight") and tensor.ndim == 2)
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    tensors[name.removesuffix(".weight") + ".scale_weight"] = torch.tensor(1.0)
    save_file(tensors, str(last))
    assert len(shards) > 1 and last != shards[0]
    with pytest.raises(CheckpointError, match=rf"^{folder} holds FP8 weights; FP8 is read from ComfyUI-style single "
                                              r"files \(release names, fp8_scaled\) only\.$"):
        locate_dit(folder)
