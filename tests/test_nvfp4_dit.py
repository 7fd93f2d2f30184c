"""ComfyUI's NVFP4 DiT files (the `nvfp4` format in a single file, release names, qkv stacked): block, AdaLN
and refiner linears held NVFP4 (half a byte a weight) and rebuilt as they are used; everything else NVFP4 is
dequantized at load (fp32 modules in fp32). The weights meant are those the tests' own writer
(tests/nvfp4_files.py, checked against ComfyUI's kernels in test_fp8) quantized."""

import re
from dataclasses import replace

import nvfp4_files
import pytest
import torch
from safetensors.torch import save_file
from test_fp8 import (BLOCK_LINEARS, CPU_SCALED, check_cuda_linears_equal_the_cpus, check_lora_hook_equals_merge,
                      check_streamed_blocks_equal_resident, comfy_quant, cosine, forward, native_tensors)
from torch import nn

from h3_core import fp8, nvfp4
from h3_core.checkpoint import CheckpointError, held_linears, infer_config, load_dit, locate_dit
from h3_core.config import DiTConfig, TINY_DIT
from h3_core.dit import H3DiT
from h3_core.memory_plan import MemoryPlan, block_weight_bytes, plan_memory
from h3_core.nvfp4 import NVFP4Linear
from h3_core.tiny import seeded_random_weights, tiny_random_dit

PREFIX = "model.diffusion_model."
BLOCKS = [f"blocks.{i}.{leaf}" for i in range(2) for leaf in BLOCK_LINEARS]
KEPT_OTHERS = ["blocks.1.adaln_proj.linear", "token_refiner.blocks.0.attn.qkv_proj"]
DEQUANTIZED = {"condition_proj": torch.float32, "final_layer.video_out": torch.float32}  # not storable; fp32 head


def write_nvfp4(path, model=None, layers=BLOCKS + KEPT_OTHERS + list(DEQUANTIZED), smoothed=False):
    tensors = {PREFIX + k: v for k, v in native_tensors(model or tiny_random_dit()).items()}
    meant = nvfp4_files.quantize_layers(tensors, layers, PREFIX, smoothed=smoothed)
    save_file(tensors, str(path))
    return meant


def effective(meant) -> torch.Tensor:
    """The weight a dense linear needs to compute what the NVFP4 one does: W diag(pre_quant_scale)."""
    values, smoothing = meant
    return values if smoothing is None else values * smoothing.double()


@pytest.mark.parametrize("smoothed", [False, True])
def test_an_nvfp4_file_keeps_its_linears_nvfp4(tmp_path, smoothed):
    path = tmp_path / "minimax_h3_fl2va_nvfp4.safetensors"
    meant = write_nvfp4(path, smoothed=smoothed)
    source = locate_dit(path)
    assert set(source.nvfp4_layers) == set(meant) and source.fp8_layers == {} and "NVFP4" in source.origin
    assert infer_config(source) == TINY_DIT  # packed shapes read as the linears' own
    kept = load_dit(path, dtype=torch.float32)
    dense = load_dit(path, dtype=torch.float32, linears="dense")
    for layer in BLOCKS + KEPT_OTHERS:
        module = kept.get_submodule(layer)
        assert isinstance(module, NVFP4Linear) and module.weight.dtype == torch.uint8, layer
        assert (module.pre_quant_scale is not None) == smoothed
        weight = dense.get_submodule(layer).weight
        assert type(dense.get_submodule(layer)) is nn.Linear and weight.dtype == torch.float32
        assert torch.allclose(weight.double(), effective(meant[layer]), rtol=1e-6, atol=1e-9), layer
        rebuilt, bias = module.as_dense(), dense.get_submodule(layer).bias  # the AdaLN projection has a bias
        assert torch.equal(rebuilt.weight, weight) and not rebuilt.weight.requires_grad, layer
        assert (rebuilt.bias is None) == (bias is None) and (bias is None or torch.equal(rebuilt.bias, bias)), layer
    assert kept.blocks[1].adaln_proj.linear.bias is not None
    for layer, dtype in DEQUANTIZED.items():
        module = kept.get_submodule(layer)
        assert type(module) is nn.Linear and module.weight.dtype == dtype, layer
        assert torch.allclose(module.weight.double(), effective(meant[layer]), rtol=1e-6, atol=1e-9), layer
    bf16 = load_dit(path, dtype=torch.bfloat16)
    assert bf16.condition_proj.weight.dtype == torch.bfloat16 and bf16.final_layer.video_out.weight.dtype == torch.float32
    assert bf16.blocks[0].mlp.fc1.compute_dtype == torch.bfloat16
    out, want = forward(kept), forward(dense)
    if smoothed:  # x * s, then W: rounded apart from x (W diag(s)) in fp32
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(out, want))
    else:
        assert all(torch.equal(a, b) for a, b in zip(out, want))
    assert cosine(forward(kept)[0], forward(tiny_random_dit())[0]) > 0.99  # 4-bit rounding only
    def fc1_bytes(model):
        return sum(t.numel() * t.element_size() for n, t in model.state_dict().items() if n.startswith("blocks.0.mlp.fc1."))

    assert fc1_bytes(kept) < fc1_bytes(dense) / 6  # half a byte a weight (and its scales) against four


def test_a_file_mixing_nvfp4_and_fp8_layers_keeps_each_as_stored(tmp_path):
    """NVFP4 block linears beside FP8 AdaLN projections in one file: each reader sees only its own layers."""
    tensors = {PREFIX + k: v for k, v in native_tensors(tiny_random_dit()).items()}
    meant = nvfp4_files.quantize_layers(tensors, BLOCKS, PREFIX)
    adaln = ["blocks.0.adaln_proj.linear", "blocks.1.adaln_proj.linear"]
    for layer in adaln:
        weight = tensors[f"{PREFIX}{layer}.weight"].float()
        scale = weight.abs().amax() / torch.finfo(torch.float8_e4m3fn).max
        tensors[f"{PREFIX}{layer}.weight"] = (weight / scale).to(torch.float8_e4m3fn)
        tensors[f"{PREFIX}{layer}.weight_scale"] = scale
        tensors[f"{PREFIX}{layer}.comfy_quant"] = comfy_quant("float8_e4m3fn")
        meant[layer] = tensors[f"{PREFIX}{layer}.weight"].float() * scale
    save_file(tensors, str(tmp_path / "mixed.safetensors"))
    source = locate_dit(tmp_path / "mixed.safetensors")
    assert set(source.nvfp4_layers) == set(BLOCKS) and set(source.fp8_layers) == set(adaln)
    model = load_dit(tmp_path / "mixed.safetensors", dtype=torch.float32)
    for layer in BLOCKS:
        module = model.get_submodule(layer)
        assert isinstance(module, NVFP4Linear), layer
        assert torch.allclose(module.dequantized_weight().double(), effective(meant[layer]), rtol=1e-6, atol=1e-9)
    for layer in adaln:
        module = model.get_submodule(layer)
        assert isinstance(module, fp8.FP8Linear) and module.weight.dtype == torch.float8_e4m3fn, layer
        assert torch.equal(module.dequantized_weight(), meant[layer]), layer


def test_many_tiles_of_block_scales_are_unswizzled_in_order():
    """Block scales come in cuBLAS's 128x4 tiles: a weight of 17 x 2 tiles (2050 rows, padded to 2064; 5 blocks of
    16 columns a row) is rebuilt as the writer meant it, every tile in its place."""
    weight = torch.randn(2050, 72, generator=torch.Generator().manual_seed(5)) * 0.02
    stored, meant = nvfp4_files.quantize(weight)
    got = nvfp4.dequantize(stored["weight"], stored["weight_scale"], stored["weight_scale_2"], (2050, 72),
                           torch.float32)
    assert stored["weight_scale"].shape == (2176, 8)
    assert torch.allclose(got.double(), meant, rtol=1e-6, atol=0)


def test_block_scales_stored_as_bytes_are_read_as_e4m3(tmp_path):
    """Some writers store the e4m3 block scales as uint8 (the same bytes): the weights are those of the e4m3 file."""
    tensors = {PREFIX + k: v for k, v in native_tensors(tiny_random_dit()).items()}
    meant = nvfp4_files.quantize_layers(tensors, BLOCKS, PREFIX)
    for layer in BLOCKS:
        key = f"{PREFIX}{layer}.weight_scale"
        tensors[key] = tensors[key].view(torch.uint8)
    save_file(tensors, str(tmp_path / "bytes.safetensors"))
    dense = load_dit(tmp_path / "bytes.safetensors", dtype=torch.float32, linears="dense")
    kept = load_dit(tmp_path / "bytes.safetensors", dtype=torch.float32)
    for layer in BLOCKS:
        weight = dense.get_submodule(layer).weight
        assert torch.allclose(weight.double(), effective(meant[layer]), rtol=1e-6, atol=1e-9), layer
        assert torch.equal(kept.get_submodule(layer).as_dense().weight, weight), layer


@CPU_SCALED
def test_nvfp4_under_the_lossy_fp8_modes(tmp_path):
    """fp8-weights-lossy keeps NVFP4 (already smaller); fp8-lossy rebuilds the block linears and quantizes them
    to e4m3 per output channel for FP8 matmuls, as after loading (quantize_blocks); others stay NVFP4."""
    path = tmp_path / "nvfp4.safetensors"
    write_nvfp4(path, smoothed=True)
    weights_only = load_dit(path, dtype=torch.float32, linears="fp8-weights-lossy")
    assert all(isinstance(weights_only.get_submodule(layer), NVFP4Linear) for layer in BLOCKS + KEPT_OTHERS)
    assert fp8.held_format(weights_only) == "nvfp4" == held_linears(locate_dit(path), "fp8-weights-lossy")
    dense = load_dit(path, dtype=torch.float32, linears="dense")
    lossy = load_dit(path, dtype=torch.float32, linears="fp8-lossy")
    after = load_dit(path, dtype=torch.float32)
    fp8.quantize_blocks(after, "scaled")
    for layer in BLOCKS:
        module = lossy.get_submodule(layer)
        assert isinstance(module, fp8.FP8Linear) and module.weight.dtype == fp8.FP8 and module.matmul == "scaled"
        weight, scale = fp8.quantize_weight(dense.get_submodule(layer).weight)
        assert torch.equal(module.weight, weight) and torch.equal(module.weight_scale, scale), layer
        assert torch.equal(after.get_submodule(layer).weight, weight), layer
    assert all(isinstance(lossy.get_submodule(layer), NVFP4Linear) for layer in KEPT_OTHERS)
    assert held_linears(locate_dit(path), "fp8-lossy") == "fp8-scaled"
    assert held_linears(locate_dit(path), "dense") == "dense"
    assert cosine(forward(lossy)[0], forward(dense)[0]) > 0.99


def test_broken_nvfp4_files_are_refused_before_reading(tmp_path):
    model = tiny_random_dit()
    tensors = {PREFIX + k: v for k, v in native_tensors(model).items()}
    nvfp4_files.quantize_layers(tensors, ["blocks.0.mlp.fc1"], PREFIX)
    cut = dict(tensors)
    cut[PREFIX + "blocks.0.mlp.fc1.weight"] = cut[PREFIX + "blocks.0.mlp.fc1.weight"][:, :16].contiguous()
    save_file(cut, str(tmp_path / "cut.safetensors"))
    with pytest.raises(CheckpointError, match=r"NVFP4 layer 'blocks.0.mlp.fc1' \(256x64\) has the wrong sizes"):
        load_dit(tmp_path / "cut.safetensors")
    signed = dict(tensors)
    signed[PREFIX + "blocks.0.mlp.fc1.weight"] = signed[PREFIX + "blocks.0.mlp.fc1.weight"].view(torch.int8)
    save_file(signed, str(tmp_path / "signed.safetensors"))
    with pytest.raises(CheckpointError, match=re.escape(
            "NVFP4 layer 'blocks.0.mlp.fc1' in signed.safetensors stores its weight as I8 and its block scales as "
            "F8_E4M3; expected U8, and F8_E4M3 (or U8).")):
        locate_dit(tmp_path / "signed.safetensors")
    lacking = {k: v for k, v in tensors.items() if not k.endswith("fc1.weight_scale_2")}
    save_file(lacking, str(tmp_path / "lacking.safetensors"))
    with pytest.raises(CheckpointError, match="NVFP4 layer 'blocks.0.mlp.fc1' in lacking.safetensors lacks weight_scale_2"):
        locate_dit(tmp_path / "lacking.safetensors")
    norm = {PREFIX + k: v for k, v in native_tensors(model).items()}
    norm[PREFIX + "blocks.0.attn.k_norm.weight"] = torch.zeros(16, dtype=torch.uint8)
    for leaf, value in (("weight_scale", torch.zeros(128, 4)), ("weight_scale_2", torch.ones(()))):
        norm[PREFIX + f"blocks.0.attn.k_norm.{leaf}"] = value.to(torch.float8_e4m3fn if leaf == "weight_scale" else torch.float32)
    norm[PREFIX + "blocks.0.attn.k_norm.comfy_quant"] = nvfp4_files.record()
    save_file(norm, str(tmp_path / "norm.safetensors"))
    with pytest.raises(CheckpointError, match="holds 'blocks.0.attn.k_norm' as NVFP4, but it is not a linear layer"):
        load_dit(tmp_path / "norm.safetensors")


def test_memory_plan_counts_what_nvfp4_blocks_hold():
    """A real block's NVFP4 linears (smoothed: the plan's upper bound) stream exactly the bytes the plan counts,
    and a 24 GiB budget keeps more of them resident than of FP8 blocks."""
    real = DiTConfig()
    with torch.device("meta"):
        block_model = H3DiT(replace(real, num_layers=1)).set_dtype(torch.bfloat16)
    layers = {layer: nvfp4.NVFP4Entry.for_linear(block_model.get_submodule(layer).out_features,
                                                 block_model.get_submodule(layer).in_features, smoothed=True)
              for layer in fp8.block_linear_names(block_model)}
    nvfp4.NVFP4Load.plan(block_model, layers, keep=lambda layer: True, compute=torch.bfloat16,
                         dense_dtype=lambda layer: torch.bfloat16)
    assert fp8.held_format(block_model) == "nvfp4"
    streamed = [p for n, p in block_model.blocks[0].named_parameters() if not n.startswith("adaln_proj.")]
    assert sum(p.numel() * p.element_size() for p in streamed) == block_weight_bytes(real, 2, "nvfp4")
    assert block_weight_bytes(real, 2, "nvfp4") < 0.6 * block_weight_bytes(real, 2, "fp8")
    budget = 24 * 2**30
    assert (plan_memory(real, 38_222, budget, held="nvfp4").resident_blocks
            > plan_memory(real, 38_222, budget, held="fp8").resident_blocks)
    with pytest.raises(ValueError, match="held as one of dense, fp8, fp8-scaled, int8, int4, nvfp4"):
        block_weight_bytes(real, 2, "mxfp8")


def test_the_memory_plan_counts_adaln_weights_as_the_file_holds_them(tmp_path, monkeypatch):
    """An NVFP4 file whose AdaLN projections are NVFP4 too: the plans of `h3 generate`, of the nodes' DiT
    placement and of the workers' size count those projections at what they hold once read, not in the model
    dtype; a file holding them dense is planned as before (`adaln_weight_bytes`)."""
    from types import SimpleNamespace

    from h3_core import memory_plan, pipeline
    from h3_core.checkpoint import DiTReader
    from h3_core.layout import build_request_layout
    from h3_core.parallel import ModelSpec
    from h3_core.placement import DiTPlacement

    adaln = [f"blocks.{i}.adaln_proj.linear" for i in range(TINY_DIT.num_layers)] + ["final_layer.adaln_proj.linear"]
    layout = build_request_layout(224, 128, 107, torch.ones(6, dtype=torch.long))
    plans, real_plan = [], memory_plan.plan_for
    monkeypatch.setattr(pipeline, "plan_for", lambda *a, **k: plans.append(real_plan(*a, **k)) or plans[-1])
    found = {}
    for name, layers in (("quantized", BLOCKS + adaln), ("dense", BLOCKS)):
        path = tmp_path / f"{name}_nvfp4.safetensors"
        write_nvfp4(path, layers=layers)
        dit, plan, _ = pipeline.load_sampling_dit(
            pipeline.ModelSource(str(path), path), locate_dit(path), "fl2va",
            pipeline.GenerateSettings(steps=3, dtype=torch.bfloat16), [], SimpleNamespace(layout=layout), 3,
            lambda note: None)
        assert plan is plans[-1] and not plan.offload_adaln
        held = sum(t.numel() * t.element_size() for module in dit.adaln_modules() for t in module.state_dict().values())
        reader = DiTReader(path, dtype=torch.bfloat16)
        placed = DiTPlacement(name, reader.model, "cpu", "cpu", reader=reader).plan_request(layout, 3)
        spec = ModelSpec(str(path), dtype=torch.bfloat16)
        found[name] = (held, plan.expected_peak_bytes, placed.expected_peak_bytes, spec.adaln_bytes())
        assert isinstance(dit.final_layer.adaln_proj.linear, NVFP4Linear) == (name == "quantized")
    (q_held, q_peak, q_placed, q_spec), (d_held, d_peak, d_placed, d_spec) = found["quantized"], found["dense"]
    assert d_held == memory_plan.adaln_weight_bytes(TINY_DIT, 2) and q_held < d_held / 2
    assert d_peak - q_peak == d_placed - q_placed == d_held - q_held
    assert (q_spec, d_spec) == (q_held, d_held)


def test_the_plan_leaves_room_for_the_factors_of_a_lora_hooked_into_an_nvfp4_model(tmp_path, monkeypatch):
    """LoRAs are hooked into NVFP4 linears (their factors on the device for the run), merged into dense ones: the
    engine's memory plan counts the factors only then."""
    from types import SimpleNamespace

    from lora_files import random_spec, write_peft

    from h3_core import pipeline
    from h3_core.layout import build_request_layout
    from h3_core.lora import hooked_bytes, load_lora

    lora = load_lora(write_peft(tmp_path / "style.safetensors", random_spec(TINY_DIT)))
    layout = build_request_layout(224, 128, 107, torch.ones(6, dtype=torch.long))
    asked = []
    monkeypatch.setattr(pipeline, "plan_for", lambda *a, **k: asked.append(k["other_bytes"]) or MemoryPlan(
        TINY_DIT.num_layers, 0, False, 0, True))
    quantized, dense = tmp_path / "nvfp4.safetensors", tmp_path / "dense.safetensors"
    write_nvfp4(quantized)
    save_file(seeded_random_weights(H3DiT(TINY_DIT), 0).state_dict(), str(dense))
    for path in (quantized, dense):
        pipeline.load_sampling_dit(pipeline.ModelSource(str(path), path), locate_dit(path), "fl2va",
                                   pipeline.GenerateSettings(steps=3, dtype=torch.bfloat16), [(lora, 1.0)],
                                   SimpleNamespace(layout=layout), 3, lambda note: None)
    assert asked == [hooked_bytes([(lora, 1.0)], "fl2va", 2), 0] and asked[0] > 0


def test_compiled_blocks_with_hooked_loras_are_said_to_run_uncompiled(tmp_path):
    """A compiled block carrying a hooked LoRA runs its eager forward; `h3 generate --compile` said 'blocks compiled'
    for a stored-linears file with a LoRA, where none ran compiled."""
    from types import SimpleNamespace

    from lora_files import random_spec, write_peft

    from h3_core import pipeline
    from h3_core.layout import build_request_layout
    from h3_core.lora import load_lora

    lora = load_lora(write_peft(tmp_path / "style.safetensors", random_spec(TINY_DIT)))
    layout = build_request_layout(224, 128, 107, torch.ones(6, dtype=torch.long))
    quantized, dense = tmp_path / "nvfp4.safetensors", tmp_path / "dense.safetensors"
    write_nvfp4(quantized)
    save_file(seeded_random_weights(H3DiT(TINY_DIT), 0).state_dict(), str(dense))
    said = {}
    for path in (quantized, dense):
        notes = said[path.stem] = []
        pipeline.load_sampling_dit(pipeline.ModelSource(str(path), path), locate_dit(path), "fl2va",
                                   pipeline.GenerateSettings(steps=3, dtype=torch.bfloat16, compile=True),
                                   [(lora, 1.0)], SimpleNamespace(layout=layout), 3, notes.append)
    assert any("those the LoRAs are hooked into run uncompiled" in note for note in said["nvfp4"])
    assert "blocks compiled (the first step pays the compile)" in said["dense"]  # merged: compiled


def test_streamed_nvfp4_blocks_equal_resident_ones(tmp_path):
    path = tmp_path / "nvfp4.safetensors"
    write_nvfp4(path, smoothed=True)
    check_streamed_blocks_equal_resident(path)


def test_a_lora_on_an_nvfp4_model_is_hooked(tmp_path):
    path = tmp_path / "nvfp4.safetensors"
    write_nvfp4(path, smoothed=True)
    check_lora_hook_equals_merge(path, tmp_path / "lora.safetensors")


def test_compiled_blocks_rebuild_nvfp4_weights_as_eager_ones_do(tmp_path):
    """The byte table is built inside a compiled graph (its cache stays outside): same output."""
    path = tmp_path / "nvfp4.safetensors"
    write_nvfp4(path, smoothed=True)
    expected = forward(load_dit(path, dtype=torch.float32))[0]
    compiled = load_dit(path, dtype=torch.float32).compile_blocks()
    assert torch.allclose(forward(compiled)[0], expected, atol=1e-5)


def test_nvfp4_is_read_from_single_files_only(tmp_path):
    pytest.importorskip("diffusers", reason="the diffusers folder is written by diffusers (the test extra)")
    from reference_checkpoints import reference_dit, write_diffusers_folder
    from safetensors.torch import load_file

    folder = write_diffusers_folder(tmp_path / "transformer", reference_dit(TINY_DIT, seed=4), max_shard_size="10GB")
    (shard,) = folder.glob("*.safetensors")
    tensors = load_file(str(shard))
    nvfp4_files.quantize_layers(tensors, ["transformer_blocks.0.ff.net.2"])
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError, match="holds NVFP4 weights; NVFP4 is read from ComfyUI-style single files"):
        locate_dit(folder)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nvfp4_linears_on_cuda_eager_and_compiled_equal_the_cpus(tmp_path):
    path = tmp_path / "nvfp4.safetensors"
    write_nvfp4(path, smoothed=True)
    check_cuda_linears_equal_the_cpus(path, BLOCKS + KEPT_OTHERS, NVFP4Linear)
