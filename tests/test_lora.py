"""LoRA / Turbo adapters on the native DiT: every published spelling, merged and dynamic, stacked,
removed, against an independent computation and against diffusers' own LoRA loader; Turbo contracts.

Ground truth: a `Spec` (tests/lora_files.py) in diffusers layout. "Independent computation" means:
add `strength * scale * B @ A` to the diffusers reference model's own weights in diffusers names
(fp32), then map the whole merged state dict onto our names with the checkpoint converter (itself
checked against diffusers in test_dit_parity); our merge maps the adapter instead, so the two paths
share nothing but the base-weight mapping. fp32 tolerances are float-rounding level (1e-6 on weights,
1e-5 on outputs); bf16 checks are stated where they are made.
"""

from __future__ import annotations

import pytest
import torch
from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
)
from lora_files import (
    Spec,
    fused,
    native_name,
    random_spec,
    write_diffusers,
    write_fastvideo,
    write_kohya,
    write_native,
    write_peft,
)
from reference_checkpoints import reference_dit
from safetensors.torch import save_file

from h3_core.checkpoint import convert_state_dict
from h3_core.config import TINY_DIT, DiTConfig
from h3_core.dit import H3DiT
from h3_core.lora import (
    LoRAError,
    applied_loras,
    apply_loras,
    load_lora,
    remove_loras,
    sampler_settings,
)
from h3_core.sampler import DualClockSchedule

try:
    import peft  # noqa: F401

    HAVE_PEFT = True
except ImportError:  # diffusers' LoRA injection needs peft; without it the oracle merges diffusers' own conversion
    HAVE_PEFT = False

# head_dim 128 like the release: diffusers de-interleaves DiffSynth qkv rows with a fixed head_dim of 128.
WIDE_HEADS = DiTConfig(num_attention_heads=2, attention_head_dim=128, hidden_size=64, num_layers=2, num_refiner_layers=1,
                       ffn_dim=96, in_channels=24, audio_in_channels=32, text_dim=48, freq_dim=16,
                       time_embed_hidden_dim=64, time_embed_dim=32, rope_freq_dim=4)
LIGHTX2V_8STEP = "minimax_h3_fl2v_turbo_8step_v1.0_bf16.safetensors"
COMFY_8STEP = "minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors"


# ---------------------------------------------------------------------------------------------------
def ours_from(reference, config, dtype=torch.float32) -> H3DiT:
    model = H3DiT(config).eval()
    model.load_state_dict(convert_state_dict(reference.state_dict(), "diffusers", head_dim=config.attention_head_dim))
    return model.to(dtype).requires_grad_(False)


def expected_native(reference, config, adapters) -> dict:
    """Independent merge: adapters = [(spec, strength, scale_of(module, rank) -> alpha/rank)], added to the
    diffusers model's weights in diffusers names, then the merged state dict mapped to our names."""
    merged = {k: v.clone().double() for k, v in reference.state_dict().items()}
    for spec, strength, scale_of in adapters:
        for name, (a, b) in spec.factors.items():
            merged[f"{name}.weight"] += strength * scale_of(name, a.shape[0]) * (b.double() @ a.double())
        for name, deltas in spec.dense.items():
            for param, delta in deltas.items():
                merged[f"{name}.{param}"] += strength * delta.double()
    return convert_state_dict({k: v.float() for k, v in merged.items()}, "diffusers", head_dim=config.attention_head_dim)


def assert_weights(model, expected, atol=1e-6):
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        assert (state[name].float() - value).abs().max().item() <= atol, name


def packed(config, batch=1):
    tags = torch.ones(7, dtype=torch.long)
    tags[2:4] = 0
    pos, token_tags, vi, ai, ti, n_cond, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        tags, 7, 4, 6, 12, config.patch_size, 2, 2, 0, ("first",))
    timesteps, indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(vi, ai, n_cond, 0, 7, 0.3, 0.6, 0.999, 1.0)
    generator = torch.Generator().manual_seed(11)
    return dict(video_rows=torch.randn(batch, vi.numel(), config.video_patch_dim, generator=generator),
                audio_rows=torch.randn(batch, ai.numel(), config.audio_in_channels, generator=generator),
                text_states=torch.randn(batch, 7, config.text_dim, generator=generator),
                timesteps=timesteps, timestep_indices=indices, token_tags=token_tags, position_ids=pos,
                video_indices=vi, audio_indices=ai, text_indices=ti)


def run_ours(model, inputs):
    with torch.no_grad():
        return model(**inputs)


def run_diffusers(model, inputs):
    with torch.no_grad():
        return model(hidden_states=inputs["video_rows"], audio_hidden_states=inputs["audio_rows"],
                     encoder_hidden_states=inputs["text_states"], timestep=inputs["timesteps"],
                     timestep_indices=inputs["timestep_indices"], token_tags=inputs["token_tags"],
                     position_ids=inputs["position_ids"], video_indices=inputs["video_indices"],
                     audio_indices=inputs["audio_indices"], text_indices=inputs["text_indices"], return_dict=False)


def diffusers_with_loras(config, seed, files):
    """The diffusers reference with `files` [(path, strength)] loaded by diffusers' own H3 LoRA code:
    `MiniMaxH3LoraLoaderMixin.lora_state_dict` (format conversion, alpha folding, metadata alpha) then
    peft injection with per-adapter weights; without peft, the converted factors merged by hand."""
    reference = reference_dit(config, seed)
    names, weights = [], []
    for i, (path, strength) in enumerate(files):
        state, metadata = MiniMaxH3LoraLoaderMixin.lora_state_dict(str(path), return_lora_metadata=True)
        if HAVE_PEFT:
            reference.load_lora_adapter(state, prefix="transformer", metadata=metadata, adapter_name=f"a{i}")
            names.append(f"a{i}")
            weights.append(strength)
            continue
        alpha = (metadata or {}).get("transformer.lora_alpha")
        if (metadata or {}).get("transformer.alpha_pattern"):
            pytest.skip("peft's alpha_pattern semantics need peft installed (the test extra should list it)")
        with torch.no_grad():
            for key, a in state.items():
                if ".lora_A." in key:
                    b = state[key.replace(".lora_A.", ".lora_B.")]
                    module = reference.get_submodule(key[len("transformer."):].split(".lora_A.")[0])
                    module.weight += strength * (alpha / a.shape[0] if alpha else 1.0) * (b @ a)
    if names:
        reference.set_adapters(names, weights=weights)
    return reference


def dit_outputs_close(a, b, atol=1e-5):
    return all((x.float() - y.float()).abs().max().item() <= atol for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------------------
# One row per published spelling: (id, config, writer(tmp, spec) -> path, spec kwargs, expected format,
# scale_of(module, rank), checked against diffusers?)
def _scale(alpha_main, alpha_adaln=None):
    return lambda name, rank: (alpha_adaln if alpha_adaln is not None and rank == 2 else alpha_main) / rank


FORMATS = [
    ("lightx2v-diffusers", TINY_DIT, lambda d, s: write_peft(d / LIGHTX2V_8STEP, s, {"alpha": "8", "key_format": "minimax-h3-diffusers"}),
     {}, "lightx2v-diffusers", _scale(8.0), True),
    ("peft", TINY_DIT, lambda d, s: write_peft(d / "adapter.safetensors", s), {}, "peft", lambda n, r: 1.0, True),
    ("diffusers", TINY_DIT, lambda d, s: write_diffusers(d / "pytorch_lora_weights.safetensors", {"transformer": s}, {"transformer": dict(
        r=4, lora_alpha=2.0, rank_pattern={"adaln_proj.linear": 2, "norm_out.linear": 2}, alpha_pattern={"adaln_proj.linear": 1.0},
        target_modules=sorted(s.factors),
        use_dora=False, lora_bias=False)}),
     {}, "diffusers", lambda n, r: (1.0 if "adaln_proj" in n else 2.0) / r, True),
    ("fastvideo", TINY_DIT, lambda d, s: write_fastvideo(d / "adapter_model.safetensors", s), {"dense": True}, "fastvideo",
     lambda n, r: 1.0, False),
    ("native", TINY_DIT, lambda d, s: write_native(d / "minimax_h3_turbo_v4_step600_ema.safetensors", fused(s)),
     {"shared_qkv_a": True}, "native", lambda n, r: 1.0, True),
    ("ai-toolkit", TINY_DIT, lambda d, s: write_native(d / "my_style.safetensors", fused(s), prefix="diffusion_model.", metadata={"alpha": "2"}),
     {"shared_qkv_a": True}, "native", _scale(2.0), True),
    ("kohya", TINY_DIT, lambda d, s: write_kohya(d / "musubi.safetensors", fused(s), {n: (2.0 if f[0].shape[0] == 4 else 1.0) for n, f in fused(s).items()}),
     {"shared_qkv_a": True}, "kohya", lambda n, r: 0.5, True),
    ("diffsynth", WIDE_HEADS, lambda d, s: write_native(d / "lineart.safetensors", fused(s, "interleaved", 128), infix=".default"),
     {"shared_qkv_a": True}, "diffsynth", lambda n, r: 1.0, True),
    ("flashgen", WIDE_HEADS, lambda d, s: write_native(d / "flashgen.safetensors", fused(s, "interleaved", 128), metadata={
        "key_format": "minimax-h3-native", "lora_alpha": "2", "base_schedule": "1.0,0.7,0.4,0.15,0.0", "tasks": "t2va"}),
     {"shared_qkv_a": True}, "flashgen", _scale(2.0), False),
    ("lightx2v-comfyui", TINY_DIT, lambda d, s: write_native(d / COMFY_8STEP, fused(s, block_diagonal=True), prefix="diffusion_model.",
                                                             metadata={"alpha": "8"}),
     {}, "lightx2v-comfyui", lambda n, r: 1.0, False),
    # a ComfyUI export renamed (a browser's " (1)", a user's own name): known by its block-diagonal fused qkv,
    # scaled as ComfyUI scales it (metadata alpha 8 on rank 3r was 3x weaker on qkv than on the other modules)
    ("comfyui-renamed", TINY_DIT, lambda d, s: write_native(d / "h3 turbo (1).safetensors", fused(s, block_diagonal=True),
                                                            prefix="diffusion_model.", metadata={"alpha": "8"}),
     {}, "lightx2v-comfyui", lambda n, r: 1.0, False),
    # .alpha on one module and a metadata alpha: the rest are alpha = rank, as diffusers' loader and ComfyUI read it
    ("partial-alpha", TINY_DIT, lambda d, s: write_native(d / "partial.safetensors", fused(s), metadata={"alpha": "8"},
                                                          alphas={"blocks.0.mlp.fc2": 2.0}),
     {"shared_qkv_a": True}, "native", lambda n, r: 2.0 / r if n == "transformer_blocks.0.ff.net.2" else 1.0, True),
]


def _spec_for(config, kwargs, seed=0):
    spec = random_spec(config, shared_qkv_a=kwargs.get("shared_qkv_a", False), seed=seed)
    if kwargs.get("dense"):
        generator = torch.Generator().manual_seed(seed + 100)
        h = config.hidden_size
        spec.dense = {  # full-rank deltas as FastVideo ships them, on Linear weights/biases and an RMSNorm
            "proj_in": {"weight": 0.01 * torch.randn(h, config.video_patch_dim, generator=generator),
                        "bias": 0.01 * torch.randn(h, generator=generator)},
            "norm_out.linear": {"bias": 0.01 * torch.randn(2 * h, generator=generator)},
            "norm_out.norm": {"weight": 0.01 * torch.randn(h, generator=generator)},
            "transformer_blocks.1.attn.to_k": {"weight": 0.01 * torch.randn(config.inner_dim, h, generator=generator)},
            "token_refiner.refiner_blocks.0.ff.net.0.proj": {"weight": 0.01 * torch.randn(2 * config.ffn_dim, h, generator=generator)},
        }
    return spec


@pytest.mark.parametrize("row", FORMATS, ids=[f[0] for f in FORMATS])
def test_format_merge_and_dynamic(tmp_path, row):
    """Each spelling: recognized, merged onto the right rows of the fused tensors (== independent
    merge), dynamic output == merged output, weights untouched by dynamic, removal restores."""
    _, config, write, kwargs, fmt, scale_of, _ = row
    spec = _spec_for(config, kwargs)
    lora = load_lora(write(tmp_path, spec))
    assert lora.format == fmt
    reference = reference_dit(config, seed=1)
    model = ours_from(reference, config)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = packed(config)
    plain = run_ours(model, inputs)

    apply_loras(model, [(lora, 0.7)], partition="fl2va", mode="dynamic")
    assert all(torch.equal(v, base[k]) for k, v in model.state_dict().items())  # dynamic: weights untouched
    dynamic = run_ours(model, inputs)
    assert remove_loras(model) == 1 and applied_loras(model) == []
    assert all(torch.equal(a, b) for a, b in zip(run_ours(model, inputs), plain))

    apply_loras(model, [(lora, 0.7)], partition="fl2va", mode="merge")
    assert_weights(model, expected_native(reference, config, [(spec, 0.7, scale_of)]))
    merged = run_ours(model, inputs)
    assert dit_outputs_close(dynamic, merged)
    assert not dit_outputs_close(merged, plain, atol=1e-4)  # the adapter really changes the output
    remove_loras(model)
    assert all(torch.equal(v, base[k]) for k, v in model.state_dict().items())  # backup: bitwise


@pytest.mark.parametrize("row", [f for f in FORMATS if f[6]], ids=[f[0] for f in FORMATS if f[6]])
def test_format_against_diffusers(tmp_path, row):
    """The same file through diffusers' H3 LoRA loader into MiniMaxH3Transformer3DModel: its outputs
    equal ours (merged and dynamic)."""
    _, config, write, kwargs, *_ = row
    path = write(tmp_path, _spec_for(config, kwargs))
    expected = run_diffusers(diffusers_with_loras(config, 2, [(path, 0.6)]), packed(config))
    model = ours_from(reference_dit(config, seed=2), config)
    lora = load_lora(path)
    for mode in ("merge", "dynamic"):
        apply_loras(model, [(lora, 0.6)], partition="fl2va", mode=mode)
        assert dit_outputs_close(run_ours(model, packed(config)), expected), mode
        remove_loras(model)


def test_stacking_two_adapters(tmp_path):
    """A fused native LoRA and a split diffusers-layout one at strengths 0.8 and -0.5: the merge equals
    the independent sum (one fp32 sum, one cast), dynamic equals merged, diffusers agrees."""
    first, second = random_spec(TINY_DIT, shared_qkv_a=True, seed=3), random_spec(TINY_DIT, seed=4)
    path_a = write_native(tmp_path / "a.safetensors", fused(first))
    path_b = write_peft(tmp_path / "b.safetensors", second, {"alpha": "2"})
    loras = [(load_lora(path_a), 0.8), (load_lora(path_b), -0.5)]
    reference = reference_dit(TINY_DIT, seed=5)
    model = ours_from(reference, TINY_DIT)
    inputs = packed(TINY_DIT)
    report = apply_loras(model, loras, partition="fl2va")
    assert [item.strength for item in report.loras] == [0.8, -0.5]
    assert_weights(model, expected_native(reference, TINY_DIT, [(first, 0.8, lambda n, r: 1.0), (second, -0.5, _scale(2.0))]))
    merged = run_ours(model, inputs)
    remove_loras(model)
    apply_loras(model, loras[:1], partition="fl2va", mode="dynamic")  # applications stack too
    apply_loras(model, loras[1:], partition="fl2va", mode="dynamic")
    assert [mode for mode, _ in applied_loras(model)] == ["dynamic", "dynamic"]
    assert dit_outputs_close(run_ours(model, inputs), merged)
    assert remove_loras(model) == 2
    expected = run_diffusers(diffusers_with_loras(TINY_DIT, 5, [(path_a, 0.8), (path_b, -0.5)]), inputs)
    assert dit_outputs_close(merged, expected)
    assert not any("times" in line for line in report.warnings)
    twice = apply_loras(model, [loras[0], loras[0], loras[1]], partition="fl2va", mode="dynamic")
    assert "a.safetensors is applied 2 times: its deltas add up" in twice.warnings  # given twice by mistake, say


def test_dynamic_lora_on_fp8_linears(tmp_path):
    """FP8 block linears (ComfyUI's Model Loader with linears fp8-*): the dynamic hook adds the adapter
    exactly as on a dense model whose weights are the FP8 weights dequantized; merging into FP8 weights
    is refused before any weight changes; removal restores the plain FP8 output bitwise."""
    from h3_core.fp8 import FP8Linear, quantize_blocks

    lora = load_lora(write_peft(tmp_path / "x.safetensors", random_spec(TINY_DIT, seed=9)))
    reference = reference_dit(TINY_DIT, seed=10)
    quantized, dense = ours_from(reference, TINY_DIT), ours_from(reference, TINY_DIT)
    quantize_blocks(quantized, "dequantize")
    fp8_modules = {n: m for n, m in quantized.named_modules() if isinstance(m, FP8Linear)}
    assert fp8_modules
    with torch.no_grad():
        for name, module in fp8_modules.items():
            dense.get_submodule(name).weight.copy_(module.dequantized_weight())
    inputs = packed(TINY_DIT)
    plain = run_ours(quantized, inputs)
    assert dit_outputs_close(plain, run_ours(dense, inputs))
    stored = {k: v.clone() for k, v in quantized.state_dict().items()}
    with pytest.raises(LoRAError, match="holds FP8 / int8 / int4 / NVFP4 weights.*apply it dynamically"):
        apply_loras(quantized, [(lora, 0.9)], partition="fl2va", mode="merge")
    assert all(torch.equal(v, stored[k]) for k, v in quantized.state_dict().items())
    for model in (quantized, dense):
        apply_loras(model, [(lora, 0.9)], partition="fl2va", mode="dynamic")
    adapted = run_ours(quantized, inputs)
    assert dit_outputs_close(adapted, run_ours(dense, inputs))
    assert not dit_outputs_close(adapted, plain, atol=1e-4)  # the adapter really changes the output
    remove_loras(quantized)
    assert all(torch.equal(a, b) for a, b in zip(run_ours(quantized, inputs), plain))


def test_strength_zero_is_a_no_op(tmp_path):
    lora = load_lora(write_peft(tmp_path / "x.safetensors", random_spec(TINY_DIT)))
    model = ours_from(reference_dit(TINY_DIT, seed=6), TINY_DIT)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = packed(TINY_DIT)
    plain = run_ours(model, inputs)
    for mode in ("merge", "dynamic"):
        report = apply_loras(model, [(lora, 0.0)], partition="fl2va", mode=mode)
        assert "strength 0: nothing applied" in report.loras[0].notes
        assert all(torch.equal(v, base[k]) for k, v in model.state_dict().items())
        assert all(torch.equal(a, b) for a, b in zip(run_ours(model, inputs), plain))
        remove_loras(model)


def test_bf16_merge_and_removal(tmp_path):
    """bf16 weights: the merge is W + delta in fp32 with one rounding (== the independent value to
    within one bf16 step: the two sum in different orders); removal with the default CPU backup is
    bitwise; removal by subtraction (backup=False) rounds twice, so it lands within one bf16 step of
    max(|base|, |merged|) of the base."""
    spec = random_spec(TINY_DIT, seed=7)
    lora = load_lora(write_peft(tmp_path / "x.safetensors", spec, {"alpha": "8"}))
    reference = reference_dit(TINY_DIT, seed=8)
    model = ours_from(reference, TINY_DIT).set_dtype(torch.bfloat16)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    expected = expected_native(reference, TINY_DIT, [(spec, 1.0, _scale(8.0))])
    base32 = convert_state_dict(reference.state_dict(), "diffusers", head_dim=TINY_DIT.attention_head_dim)
    apply_loras(model, [lora], partition="fl2va")
    for name, value in model.state_dict().items():
        target = (base[name].float() + (expected[name] - base32[name])).to(value.dtype)
        step = torch.finfo(torch.bfloat16).eps * value.float().abs().clamp_min(1e-30)
        assert ((value.float() - target.float()).abs() <= step).all(), name
    remove_loras(model)
    assert all(torch.equal(v, base[k]) for k, v in model.state_dict().items())
    apply_loras(model, [lora], partition="fl2va", backup=False)
    merged = {k: v.clone() for k, v in model.state_dict().items()}
    remove_loras(model)
    for name, value in model.state_dict().items():
        # two roundings (merge, then subtract): at most one bf16 step of the larger of base and merged
        magnitude = torch.maximum(base[name].float().abs(), merged[name].float().abs())
        step = torch.finfo(torch.bfloat16).eps * magnitude.clamp_min(1e-30)
        assert ((value.float() - base[name].float()).abs() <= step).all(), name



def test_a_merge_into_layers_replaced_since_is_not_half_taken_out(tmp_path):
    """A layer the LoRA was merged into, replaced since (a worker's FP8 linear mode swaps block linears after
    its merge): removal is refused before any layer changes, rather than taking the delta out of the others only."""
    spec = random_spec(TINY_DIT, seed=7)
    lora = load_lora(write_peft(tmp_path / "x.safetensors", spec, {"alpha": "8"}))
    model = ours_from(reference_dit(TINY_DIT, seed=8), TINY_DIT)
    apply_loras(model, [lora], partition="fl2va", backup=False)
    old = model.blocks[0].attn.qkv_proj
    model.blocks[0].attn.qkv_proj = torch.nn.Linear(old.in_features, old.out_features, bias=old.bias is not None)
    merged = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(LoRAError, match=r"1 layer\(s\) a LoRA was merged into were replaced since .* Read the DiT "
                                        "again"):
        remove_loras(model)
    assert all(torch.equal(v, merged[k]) for k, v in model.state_dict().items())


def test_hooked_bytes_counts_the_factors_in_their_modules_dtypes(tmp_path):
    """A bf16 DiT keeps its patch projections, time embedder and output heads in fp32, and a hook holds the
    factors there in fp32: the memory plan counts them so (it counted every factor at the DiT's 2 bytes)."""
    from h3_core.dit import fp32_modules
    from h3_core.lora import _DeltaHook, hooked_bytes

    model = ours_from(reference_dit(TINY_DIT), TINY_DIT).set_dtype(torch.bfloat16)
    tensors = {}
    for name in ("video_patch_proj", "blocks.0.attn.out_proj"):  # native names, as ComfyUI-trained files spell them
        linear = model.get_submodule(name)
        tensors[f"diffusion_model.{name}.lora_A.weight"] = torch.randn(4, linear.in_features) * 0.01
        tensors[f"diffusion_model.{name}.lora_B.weight"] = torch.randn(linear.out_features, 4) * 0.01
    save_file(tensors, str(tmp_path / "x.safetensors"))
    lora = load_lora(tmp_path / "x.safetensors")
    apply_loras(model, [lora], partition="fl2va", mode="dynamic")
    hooks = [hook for module in model.modules() for hook in module._forward_hooks.values()
             if isinstance(hook, _DeltaHook)]
    held = sum(t.numel() * t.element_size() for hook in hooks for term in hook.terms for t in term[3:]
               if t is not None)
    assert {t.dtype for hook in hooks for term in hook.terms for t in term[3:] if t is not None} == {
        torch.float32, torch.bfloat16}
    assert hooked_bytes([(lora, 1.0)], "fl2va", 2, fp32_modules(TINY_DIT)) == held
    assert hooked_bytes([(lora, 1.0)], "fl2va", 2) < held


# ---------------------------------------------------------------------------------------------------
# Turbo contracts (h3-model.md H.3 / H.4 / D).
LIGHTX2V_TABLE = [  # file, metadata alpha (None: absent), steps (sigma points), video shift, effective scale, partition
    ("minimax_h3_fl2v_turbo_4step_v0.1.safetensors", None, 5, 12.0, 1 / 16, "fl2va"),
    ("minimax_h3_fl2v_turbo_4step_v1.0_768p_bf16.safetensors", "128", 5, 6.0, 1.0, "fl2va"),
    ("minimax_h3_fl2v_turbo_4step_v1.1_768p_bf16.safetensors", "128", 5, 6.0, 1.0, "fl2va"),
    ("minimax_h3_fl2v_turbo_4step_v1.2_768p_bf16.safetensors", "8", 5, 6.0, 1 / 16, "fl2va"),
    ("minimax_h3_fl2v_turbo_8step_v1.0_bf16.safetensors", "8", 9, 12.0, 1 / 16, "fl2va"),
    ("minimax_h3_fl2v_turbo_8step_v1.0_768p_bf16.safetensors", "8", 9, 6.0, 1 / 16, "fl2va"),
    ("minimax_h3_ref2v_turbo_4step_v0.1_bf16.safetensors", "8", 5, 12.0, 1 / 16, "ref2va"),
    ("minimax_h3_ref2v_turbo_8step_v1.0_768p_bf16.safetensors", "8", 9, 6.0, 1 / 16, "ref2va"),
]


def _turbo_file(path, alpha=None, rank=128, spelling="to_q"):
    """A LightX2V Diffusers-layout file: rank 128 like the release, two modules to keep it small."""
    generator = torch.Generator().manual_seed(9)
    tensors = {}
    for module, (fan_in, fan_out) in {f"transformer_blocks.0.attn.{spelling}": (64, 64),
                                      "transformer_blocks.0.ff.net.2": (128, 64)}.items():
        tensors[f"{module}.lora_A.default.weight"] = torch.randn(rank, fan_in, generator=generator)
        tensors[f"{module}.lora_B.default.weight"] = torch.randn(fan_out, rank, generator=generator)
    metadata = {"key_format": "minimax-h3-diffusers"} | ({"alpha": alpha} if alpha is not None else {})
    save_file(tensors, str(path), metadata=metadata)
    return path


@pytest.mark.parametrize("file,alpha,steps,video_shift,scale,partition", LIGHTX2V_TABLE, ids=[r[0][11:-12] for r in LIGHTX2V_TABLE])
def test_lightx2v_turbo_contracts(tmp_path, file, alpha, steps, video_shift, scale, partition):
    lora = load_lora(_turbo_file(tmp_path / file, alpha))
    contract = lora.contract
    assert (contract.steps, contract.forwards, contract.video_shift, contract.audio_shift) == (steps, steps - 1, video_shift, 3.0)
    assert lora.partition == partition and contract.identified_by == "file name"
    assert not any("not a published artifact" in note for note in lora.notes)  # every row is a file LightX2V published
    assert {term.scale for term in lora.parts[None]} == {scale}
    settings = sampler_settings(contract)
    assert (settings.steps, settings.video_shift, settings.audio_shift, settings.notes) == (steps, video_shift, 3.0, ())
    schedule = settings.schedule()
    assert schedule.num_calls == steps - 1
    if (steps, video_shift) == (5, 6.0):  # h3-model.md D: 5 points at shift 6 and the audio ladder at 3
        assert torch.allclose(schedule.video, torch.tensor([1.0, 0.94737, 0.85714, 0.66667, 0.0]), atol=1e-5)
        assert torch.allclose(schedule.audio, torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0]), atol=1e-6)


def test_turbo_alias_spelling_and_comfyui_export_name(tmp_path):
    """The v0.1 `attn.q_proj` spelling one report shows maps like `attn.to_q`; a `_comfyui_` export name
    carries the same contract as its Diffusers-layout twin."""
    by_to_q = load_lora(_turbo_file(tmp_path / "minimax_h3_fl2v_turbo_4step_v0.1.safetensors"))
    alias_dir = tmp_path / "alias"
    alias_dir.mkdir()
    by_alias = load_lora(_turbo_file(alias_dir / "minimax_h3_fl2v_turbo_4step_v0.1.safetensors", spelling="q_proj"))
    assert [(t.target, t.part) for t in by_alias.parts[None]] == [(t.target, t.part) for t in by_to_q.parts[None]]
    comfy = load_lora(write_native(tmp_path / COMFY_8STEP, fused(random_spec(TINY_DIT), block_diagonal=True), metadata={"alpha": "8"}))
    assert (comfy.contract.steps, comfy.contract.video_shift, comfy.partition) == (9, 12.0, "fl2va")
    assert {t.scale for t in comfy.parts[None]} == {1.0} and any("metadata alpha ignored" in n for n in comfy.notes)
    qkv = [t for t in comfy.parts[None] if t.target.endswith("qkv_proj")]
    assert {t.rank for t in qkv} == {12}  # three rank-4 adapters fused block-diagonally
    renamed = tmp_path / "h3_turbo.safetensors"  # the same bytes under a user's name: scaled alike, no contract
    renamed.write_bytes((tmp_path / COMFY_8STEP).read_bytes())
    again = load_lora(renamed)
    assert [(t.target, t.scale) for t in again.parts[None]] == [(t.target, t.scale) for t in comfy.parts[None]]
    assert again.contract is None and any("though its file name does not say so" in n for n in again.notes)


def test_a_users_ladders_set_the_step_count(tmp_path):
    """The schedule walks given ladders whatever the step count says; the step count (what the memory plan counts
    AdaLN tables for, and a latent records) stayed the contract's or 50."""
    lora = load_lora(_turbo_file(tmp_path / "minimax_h3_fl2v_turbo_8step_v1.0_bf16.safetensors"))
    ladder = torch.linspace(1.0, 0.0, 50).tolist()
    for contract in (lora.contract, None):
        settings = sampler_settings(contract, video_sigmas=ladder, audio_sigmas=ladder)
        assert settings.steps == 50 == settings.schedule().num_calls + 1
        assert sampler_settings(contract, audio_sigmas=ladder).steps == 50  # one ladder: the other walks as many


def test_metadata_schedule_flashgen(tmp_path):
    """FlashGen's base_schedule is an unshifted ladder; the video (12) and audio (3) shifts go on top
    (vLLM-Omni's reading, Open question 10); 4 forwards; T2VA only."""
    meta = {"key_format": "minimax-h3-native", "base_schedule": "1.0,0.7,0.4,0.15,0.0", "tasks": "t2va"}
    lora = load_lora(write_native(tmp_path / "renamed.safetensors", fused(random_spec(TINY_DIT, shared_qkv_a=True)), metadata=meta))
    assert lora.contract.identified_by == "metadata" and lora.contract.forwards == 4 and lora.partition == "fl2va"
    settings = sampler_settings(lora.contract)
    assert settings.video_sigmas == pytest.approx([1.0, 0.9655172, 0.8888889, 0.6792453, 0.0], abs=1e-6)
    assert settings.audio_sigmas == pytest.approx([1.0, 0.875, 0.6666667, 0.3461539, 0.0], abs=1e-6)
    assert settings.schedule().num_calls == 4
    slower = sampler_settings(lora.contract, video_shift=6.0)  # the ladder follows the user's shift, reported
    assert slower.video_sigmas == pytest.approx([1.0, 0.9333333, 0.8, 0.5142857, 0.0], abs=1e-6)
    assert slower.audio_sigmas == settings.audio_sigmas and "video_shift=6 overrides" in slower.notes[0]
    assert sampler_settings(lora.contract, steps=9).video_sigmas is None  # a step count asks for a uniform ladder
    by_name = load_lora(write_native(tmp_path / "minimax_h3_t2va_flashgen_4step_v1.0_768p_bf16.safetensors",
                                     fused(random_spec(TINY_DIT, shared_qkv_a=True))))
    assert by_name.contract.base_sigmas == (1.0, 0.7, 0.4, 0.15, 0.0) and by_name.contract.identified_by == "file name"


def test_other_distilled_releases(tmp_path):
    spec = random_spec(TINY_DIT, shared_qkv_a=True)
    larry = load_lora(write_native(tmp_path / "minimax_h3_turbo_v4_step600_ema.safetensors", fused(spec)))
    assert (larry.contract.steps, larry.contract.video_shift, larry.partition) == (9, 12.0, None)
    assert {t.scale for t in larry.parts[None]} == {1.0}  # alpha = rank
    folder = tmp_path / "FastVideo-FastH3-4-step-Preview-v1-LoRA" / "dense-datafree"
    folder.mkdir(parents=True)
    fast = load_lora(write_fastvideo(folder / "adapter_model.safetensors", _spec_for(TINY_DIT, {"dense": True})))
    assert (fast.format, fast.contract.steps, fast.contract.video_shift, fast.contract.audio_shift) == ("fastvideo", 5, 12.0, 3.0)
    assert fast.partition == "fl2va"
    # as huggingface_hub caches it: the repo's name five levels up (it was looked for in the last three)
    cached = (tmp_path / "models--FastVideo--FastVideo-FastH3-4-step-Preview-v1-LoRA" / "snapshots" / "0123abc" /
              "dense-datafree")
    cached.mkdir(parents=True)
    fast = load_lora(write_fastvideo(cached / "adapter_model.safetensors", _spec_for(TINY_DIT, {"dense": True})))
    assert (fast.contract.steps, fast.contract.identified_by) == (5, "folder name")
    style = load_lora(write_native(tmp_path / "h3-realism-people-t2v-i2v-r2v.safetensors", fused(spec)))
    assert style.contract is None


def test_unknown_file_is_a_plain_lora_and_overrides_are_reported(tmp_path):
    lora = load_lora(write_peft(tmp_path / "someones_style.safetensors", random_spec(TINY_DIT)))
    model = ours_from(reference_dit(TINY_DIT), TINY_DIT)
    report = apply_loras(model, [lora], partition="ref2va")  # a plain LoRA may go on either partition
    assert report.contract is None
    assert not report.warnings  # a plain LoRA is the usual case: said in its report line, not warned about
    assert "    schedule: no schedule found (plain LoRA)" in report.lines()
    settings = report.sampler_settings()
    assert (settings.steps, settings.video_shift, settings.audio_shift) == (50, 12.0, 3.0)
    assert settings.source.startswith("base model defaults")
    turbo = load_lora(_turbo_file(tmp_path / LIGHTX2V_8STEP, "8")).contract
    overridden = sampler_settings(turbo, steps=6, audio_shift=3.0)
    assert overridden.steps == 6 and overridden.video_shift == 12.0
    assert len(overridden.notes) == 1 and "steps=6 overrides the contract's 9" in overridden.notes[0]
    # a ladder of the user's beside a contract with none of its own names what it was distilled for, not "None"
    laddered = sampler_settings(turbo, video_sigmas=[1.0, 0.5, 0.0], audio_sigmas=[1.0, 0.5, 0.0])
    assert len(laddered.notes) == 2 and "None" not in " ".join(laddered.notes)
    assert "video_sigmas=[1, 0.5, 0] overrides the contract's 9-point ladder at video shift 12" in laddered.notes[0]
    other = load_lora(_turbo_file(tmp_path / "minimax_h3_fl2v_turbo_4step_v1.2_768p_bf16.safetensors", "8")).contract
    ladder = [1.0, 0.5, 0.0]
    for partial in ({}, {"video_sigmas": ladder}, {"audio_sigmas": ladder}, {"steps": 7, "video_shift": 8.0},
                    {"steps": 7, "audio_shift": 3.0}, {"video_shift": 8.0, "audio_shift": 3.0}):
        with pytest.raises(LoRAError, match="different schedules"):  # all of one way is needed, not some
            sampler_settings([turbo, other], **partial)
    both = sampler_settings([turbo, other], video_sigmas=ladder, audio_sigmas=[1.0, 0.25, 0.0])
    assert (both.steps, both.video_sigmas, both.audio_sigmas) == (3, (1.0, 0.5, 0.0), (1.0, 0.25, 0.0))
    chosen = sampler_settings([turbo, other], steps=7, video_shift=8.0, audio_shift=3.0)
    assert chosen.steps == 7 and chosen.source.startswith("user settings") and "different schedules" in chosen.notes[0]


def test_wrong_partition_is_refused(tmp_path):
    model = ours_from(reference_dit(TINY_DIT), TINY_DIT)
    fl2v = load_lora(_turbo_file(tmp_path / LIGHTX2V_8STEP, "8"))
    ref2v = load_lora(_turbo_file(tmp_path / "minimax_h3_ref2v_turbo_4step_v0.1_bf16.safetensors", "8"))
    with pytest.raises(LoRAError, match="t2va/fl2va.*not on ref2va"):
        apply_loras(model, [fl2v], partition="ref2va")
    with pytest.raises(LoRAError, match="ref2va.*not on fl2va"):
        apply_loras(model, [ref2v], partition="fl2va")
    assert applied_loras(model) == []  # refused before touching anything
    spec = random_spec(TINY_DIT)
    ref_only = load_lora(write_diffusers(tmp_path / "ref.safetensors", {"transformer_ref": spec}))
    with pytest.raises(LoRAError, match="only for the ref2va partition"):
        apply_loras(model, [ref_only], partition="fl2va")
    both = load_lora(write_diffusers(tmp_path / "both.safetensors", {"transformer": spec, "transformer_ref": random_spec(TINY_DIT, seed=1)}))
    report = apply_loras(model, [both], partition="ref2va", mode="dynamic")
    assert any("fl2va not applied" in note for note in report.loras[0].notes)
    with pytest.raises(LoRAError, match="partition must be one of"):
        apply_loras(model, [both], partition="t2va")


def test_keys_that_map_to_nothing(tmp_path):
    spec = random_spec(TINY_DIT, modules=["transformer_blocks.0.attn.to_q"])
    good = {"transformer_blocks.0.attn.to_q.lora_A.default.weight": spec.factors["transformer_blocks.0.attn.to_q"][0],
            "transformer_blocks.0.attn.to_q.lora_B.default.weight": spec.factors["transformer_blocks.0.attn.to_q"][1]}
    stray = {"transformer_blocks.0.attn.to_qq.lora_A.default.weight": torch.zeros(4, 64),
             "transformer_blocks.0.attn.to_qq.lora_B.default.weight": torch.zeros(64, 4)}
    save_file(good | stray, str(tmp_path / "stray.safetensors"))
    with pytest.raises(LoRAError, match=r"transformer_blocks\.0\.attn\.to_qq\.lora_A\.default\.weight"):
        load_lora(tmp_path / "stray.safetensors")
    lora = load_lora(tmp_path / "stray.safetensors", unknown="warn")
    model = ours_from(reference_dit(TINY_DIT), TINY_DIT)
    report = apply_loras(model, [lora], partition="fl2va")
    assert any("NOT LOADED" in line and "to_qq" in line for line in report.lines())
    # a module this model does not have: block 7 of a 2-block model
    far = {k.replace("blocks.0.", "blocks.7."): v for k, v in good.items()}
    save_file(far, str(tmp_path / "far.safetensors"))
    with pytest.raises(LoRAError, match=r"transformer_blocks\.7\.attn\.to_q\.lora_A\.default\.weight.*blocks\.7\.attn\.qkv_proj"):
        apply_loras(model, [load_lora(tmp_path / "far.safetensors")], partition="fl2va")
    wide = {k: torch.zeros(4, 80) if "lora_A" in k else v for k, v in good.items()}
    save_file(wide, str(tmp_path / "wide.safetensors"))
    with pytest.raises(LoRAError, match="input width 80"):
        apply_loras(model, [load_lora(tmp_path / "wide.safetensors")], partition="fl2va")
    rows = model.blocks[0].adaln_proj.linear.out_features
    adaln = {"transformer_blocks.0.adaln_proj.linear.lora_A.weight": torch.zeros(2, 4096),
             "transformer_blocks.0.adaln_proj.linear.lora_B.weight": torch.zeros(rows, 2)}
    save_file(adaln, str(tmp_path / "adaln.safetensors"))
    with pytest.raises(LoRAError, match=r"input width 4096; 'blocks\.0\.adaln_proj\.linear' takes \d+\.$"):
        apply_loras(model, [load_lora(tmp_path / "adaln.safetensors")], partition="fl2va")  # no "pruned" on a full model
    save_file({"transformer_blocks.0.attn.to_q.lora_A.default.weight": good["transformer_blocks.0.attn.to_q.lora_A.default.weight"]},
              str(tmp_path / "half.safetensors"))
    with pytest.raises(LoRAError, match="no partner"):
        load_lora(tmp_path / "half.safetensors")
    ranks = {k: torch.zeros(64, 3) if "lora_B" in k else v for k, v in good.items()}  # A rank 4, B rank 3
    save_file(ranks, str(tmp_path / "ranks.safetensors"))
    with pytest.raises(LoRAError, match=r"lora_A\.default\.weight' \[4, 64\] and .*\[64, 3\] are not a LoRA pair"):
        load_lora(tmp_path / "ranks.safetensors")


def test_another_models_adapter_is_refused_from_shapes_before_any_weight_is_read(tmp_path):
    """The DiT built from its file's headers holds no weights yet: its shapes refuse an adapter made for another
    model size, so a 62 GB DiT is not read only to fail (the check used to need the weights)."""
    import dataclasses

    from h3_core.lora import check_loras

    wider = dataclasses.replace(TINY_DIT, num_attention_heads=3, hidden_size=96, time_embed_hidden_dim=96)
    foreign = load_lora(write_diffusers(tmp_path / "wider.safetensors", {"transformer": random_spec(wider)}))
    fitting = load_lora(write_diffusers(tmp_path / "fits.safetensors", {"transformer": random_spec(TINY_DIT)}))
    with torch.device("meta"):
        headers_only = H3DiT(TINY_DIT)
    for model in (headers_only, TINY_DIT):
        with pytest.raises(LoRAError, match=r"'\S+\.lora_B\.weight' of wider\.safetensors has \d+ output rows"):
            check_loras(model, [(foreign, 1.0)], "fl2va")
        check_loras(model, [(fitting, 0.5), (foreign, 0.0)], "fl2va")  # strength 0 applies nothing
    ref_only = load_lora(write_diffusers(tmp_path / "ref.safetensors", {"transformer_ref": random_spec(TINY_DIT)}))
    with pytest.raises(LoRAError, match="only for the ref2va partition"):
        check_loras(headers_only, [(ref_only, 0.0)], "fl2va")
    with pytest.raises(LoRAError, match="meta device"):  # applying still needs the weights
        apply_loras(headers_only, [fitting], partition="fl2va")


def test_an_adapter_read_is_its_own_copy_of_the_file(tmp_path):
    """Tensors safetensors hands out are views of the file's map: an adapter held across ComfyUI prompts changed
    when its file was saved over, and a shorter file killed the process (SIGBUS) at the next read."""
    import os

    from h3_core.lora_formats import read_safetensors

    path = tmp_path / "epoch.safetensors"
    save_file({"blocks.0.attn.qkv_proj.lora_A.weight": torch.zeros(4, 64)}, str(path))
    tensors, _ = read_safetensors(path)
    with open(path, "r+b") as file:  # saved over in place, the same size: what the map shows changes
        file.seek(-64, os.SEEK_END)
        file.write(b"\x3f" * 64)
    assert torch.equal(tensors["blocks.0.attn.qkv_proj.lora_A.weight"], torch.zeros(4, 64))


def test_refused_files(tmp_path):
    (tmp_path / "x.ckpt").write_bytes(b"\x80\x04")
    with pytest.raises(LoRAError, match="pickle"):
        load_lora(tmp_path / "x.ckpt")
    (tmp_path / "epochs").mkdir()  # said as what they are (h3 --lora '': " is not a .safetensors file")
    with pytest.raises(LoRAError, match=r"^The LoRA path is empty; give a LoRA's .safetensors file\.$"):
        load_lora("")
    with pytest.raises(LoRAError, match=r"epochs is a folder; give the LoRA's .safetensors file in it\.$"):
        load_lora(tmp_path / "epochs")
    save_file({"transformer_blocks.0.attn.to_gate_compress.set_weight": torch.zeros(64, 64)}, str(tmp_path / "vsa.safetensors"))
    with pytest.raises(LoRAError, match="VSA"):
        load_lora(tmp_path / "vsa.safetensors")
    save_file({"blocks.0.attn.qkv_proj.lora_A.weight": torch.zeros(2, 64),
               "blocks.0.attn.qkv_proj.lora_B.weight": torch.zeros(192, 2)},
              str(tmp_path / "bad.safetensors"), metadata={"alpha": "eight"})
    with pytest.raises(LoRAError, match="must be a number"):
        load_lora(tmp_path / "bad.safetensors")


@pytest.mark.parametrize("alpha", [0.0, float("nan"), float("inf"), -4.0])
def test_an_alpha_that_is_no_positive_number_is_refused(tmp_path, alpha):
    """Alpha 0 made an adapter a silent no-op and NaN / inf made NaN video; each alpha a file can carry is checked."""
    spec = random_spec(TINY_DIT, modules=["transformer_blocks.0.attn.to_out.0"])
    modules = {native_name(name): factors for name, factors in spec.factors.items()}
    tensor = write_kohya(tmp_path / "kohya.safetensors", modules, {name: alpha for name in modules})
    config = write_diffusers(tmp_path / "peft.safetensors", {"transformer": spec}, {"transformer": {"lora_alpha": alpha}})
    pattern = write_diffusers(tmp_path / "pattern.safetensors", {"transformer": spec},
                              {"transformer": {"lora_alpha": 4, "alpha_pattern": {"to_out.0": alpha}}})
    for path, source in ((tensor, "per-module .alpha tensor"), (config, "lora_alpha"), (pattern, "alpha_pattern")):
        with pytest.raises(LoRAError, match=f"The alpha of .* is {alpha:g} \\(.*{source}.*\\); an alpha is a positive number"):
            load_lora(path)


def test_malformed_adapter_fields_are_refused_by_name(tmp_path):
    spec = random_spec(TINY_DIT, modules=["transformer_blocks.0.attn.to_out.0"])
    (a, b), = spec.factors.values()
    empty = Spec({"transformer_blocks.0.attn.to_out.0": (a[:0], b[:, :0])})
    with pytest.raises(LoRAError, match=r"to_out\.0\.lora_A\.weight' has rank 0"):
        load_lora(write_diffusers(tmp_path / "rank0.safetensors", {"transformer": empty}))
    text = write_diffusers(tmp_path / "text.safetensors", {"transformer": spec}, {"transformer": {"lora_alpha": "x"}})
    with pytest.raises(LoRAError, match=r"is 'x' \(diffusers adapter config lora_alpha x\)"):
        load_lora(text)
    listed = tmp_path / "listed.safetensors"
    save_file({"transformer.transformer_blocks.0.attn.to_out.0.lora_A.weight": a,
               "transformer.transformer_blocks.0.attn.to_out.0.lora_B.weight": b}, str(listed),
              metadata={"lora_adapter_metadata": "[1, 2]"})
    with pytest.raises(LoRAError, match="'lora_adapter_metadata' must be a JSON object"):
        load_lora(listed)


def test_report_lines_and_alpha_override(tmp_path):
    """A renamed v0.1 file (no alpha anywhere) runs at alpha = rank unless the caller says otherwise;
    the override and the alpha source are both in the report."""
    path = _turbo_file(tmp_path / "turbo_renamed.safetensors")
    assert {t.scale for t in load_lora(path).parts[None]} == {1.0}
    lora = load_lora(path, alpha=8)
    assert {t.scale for t in lora.parts[None]} == {8 / 128}
    report = apply_loras(ours_from(reference_dit(TINY_DIT), TINY_DIT), [lora], partition="fl2va")
    assert "caller alpha 8" in report.loras[0].alpha
    assert report.lines()[0] == "LoRA on fl2va (merge):"


def test_schedule_defaults_build_a_dual_clock_schedule():
    settings = sampler_settings(None)
    reference = DualClockSchedule.build(50)
    assert torch.equal(settings.schedule().video, reference.video) and torch.equal(settings.schedule().audio, reference.audio)



@pytest.mark.parametrize("kind", ["lowrank", "dense", "lokr", "loha", "loha-dense", "lokr-reordered", "loha-reordered"])
@pytest.mark.parametrize("layout", ["rows", "permuted"])
def test_a_dynamic_lora_adds_its_product_without_an_output_wide_temporary(layout, kind, monkeypatch):
    """The hook adds scale * (x A^T) B^T (or a dense delta's, a LoKr's or a LoHa's scale * x D^T) into its rows of
    the output in place: no tensor of the output's width (two of them at fc1 were 4.1 GiB at a 5 s clip's rows on
    an H200, not in the memory plan), the float64 sum either way; an output that cannot be seen as a matrix
    (permuted) takes the plain sum. A LoHa of ranks r1, r2 goes as a rank r1 * r2 pair where that is fewer
    multiply-adds than its dense delta (never making the delta), else through the delta."""
    from torch.profiler import ProfilerActivity, profile

    from h3_core.lora import _DeltaHook, _Resolved
    from h3_core.lora_formats import Term

    generator = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(32, 2048, bias=False).requires_grad_(False)
    x = torch.randn(2, 2048, 32, generator=generator)
    down, up = torch.randn(4, 32, generator=generator), torch.randn(1024, 4, generator=generator)
    factored, order = None, None
    if kind.startswith("lokr"):  # [32 * 32, 4 * 8]; x W2^T made 100 of the 4096 rows at a time
        monkeypatch.setattr("h3_core.lora.FACTORED_CHUNK_ELEMENTS", 4 * 32 * 100)
        factored = Term("lokr", "t", "weight", ("t",), factors={"w1": torch.randn(32, 4, generator=generator),
                                                               "w2": torch.randn(32, 8, generator=generator)})
    elif kind.startswith("loha"):  # ranks 4 x 4: 16 * (1024 + 32) < 1024 * 32; 6 x 6 (dense): 36 * 1056 > 32768
        monkeypatch.setattr("h3_core.lora.FACTORED_CHUNK_ELEMENTS", 16 * 100)  # x V^T 100 rows at a time, not 4096
        rank = 6 if kind == "loha-dense" else 4
        down, up = torch.randn(rank, 32, generator=generator), torch.randn(1024, rank, generator=generator)
        factored = Term("loha", "t", "weight", ("t",), factors={"w1_a": up, "w1_b": down, "w2_a": up.flip(0),
                                                               "w2_b": down.flip(1)})
    if kind.endswith("reordered"):  # diffusers' SwiGLU rows [value; gate] onto our [gate; value]
        order = torch.cat([torch.arange(512, 1024), torch.arange(512)])
    delta = up @ down if factored is None else factored.factored_delta()
    delta = delta if order is None else delta[order]
    factors = {"lowrank": (down, up, None), "dense": (None, None, delta)}.get(kind, (None, None, None, factored, order))
    hook = _DeltaHook(linear, [_Resolved(linear, "t", "weight", slice(512, 1536), 0.7, *factors)])
    with torch.no_grad():
        base = linear(x)
        if layout == "permuted":
            base = base.transpose(0, 1).contiguous().transpose(0, 1)  # [2, 256, 2048] stored [256, 2, 2048]
        want = base.double()
        want[..., 512:1536] += 0.7 * x.double() @ delta.double().T
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiled:
            out = hook(linear, (x,), base)
    assert (out.double() - want).abs().max() < 1e-3 * want.abs().max()
    largest = max(event.cpu_memory_usage for event in profiled.events())
    if layout == "rows":  # LoRA: the [rows, rank] product; LoKr: x W2^T [100, 4, 32]; LoHa: U [1024, 16] or its delta
        rows = x.shape[0] * x.shape[1]
        bound = {"loha": 1024 * 16, "loha-dense": 1024 * 32, "lokr": 100 * 128}.get(kind.removesuffix("-reordered"))
        assert out is base and largest <= (bound or rows * 4) * 4
    else:
        assert largest >= x.shape[0] * x.shape[1] * 1024 * 4


def test_a_dynamic_lora_under_autocast_takes_the_plain_sum():
    """Under autocast the hook's products come out in the autocast dtype: the in-place GEMM (which needs one dtype)
    is left before it adds anything, and the plain sum is taken."""
    from h3_core.lora import _DeltaHook, _Resolved

    generator = torch.Generator().manual_seed(5)
    linear = torch.nn.Linear(32, 64, bias=False).requires_grad_(False)
    x = torch.randn(3, 40, 32, generator=generator)
    down, up = torch.randn(4, 32, generator=generator), torch.randn(64, 4, generator=generator)
    hook = _DeltaHook(linear, [_Resolved(linear, "t", "weight", slice(0, 64), 0.5, down, up, None)])
    with torch.no_grad():
        base = linear(x)
        want = base.double() + 0.5 * x.double() @ (up @ down).double().T
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = hook(linear, (x,), base.clone())
    assert out.dtype == torch.float32 and (out.double() - want).abs().max() < 0.02 * want.abs().max()
