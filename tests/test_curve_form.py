"""The curve form ("pruned" files: `adaln_t_table` instead of the time embedder, h3-model.md I.2).

diffusers refuses these files; ComfyUI's own MiniMaxH3Model runs them, and is the reference where
COMFYUI_PATH points at a checkout: the same weights give the same forward. Without it, the curve form is
proven against our full model (test_dit_parity: equal to diffusers): a curve-form model made from a full
one by the published construction (table = G V, W_reduced = W V for the curve G = silu(time_embedder(t))
sampled at t = i / (grid - 1), V orthogonal) gives the full model's output at timesteps on the grid, and
reads timesteps between grid points by linear interpolation. The files load in ComfyUI's layouts (bf16
and fp8_scaled), their AdaLN in fp32.
"""

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from test_fp8 import forward, native_tensors, write_fp8_scaled

from h3_core.checkpoint import DiTReader, infer_config, load_dit, locate_dit
from h3_core.dit import CurveTimeEmbedder, H3DiT
from h3_core.fp8 import FP8Linear
from h3_core.memory_plan import adaln_weight_bytes
from h3_core.tiny import tiny_random_dit

GRID = 1025  # as published: t = i / 1024, so quarter steps land exactly on rows


def curve_model(full: H3DiT, seed: int = 0) -> H3DiT:
    """The curve form of `full`: its AdaLN input sampled on the grid, turned by a random orthogonal V
    (rank kept whole, so nothing is truncated); projections W V, biases as they were."""
    config = dataclasses.replace(full.config, adaln_curve_grid=GRID)
    rotation, _ = torch.linalg.qr(torch.randn(config.time_embed_dim, config.time_embed_dim,
                                              generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    with torch.no_grad():
        curve = F.silu(full.time_embedder(torch.linspace(0, 1, GRID))).double()
    state = {k: v for k, v in full.state_dict().items() if not k.startswith("time_embedder.")}
    state["time_embedder.table"] = (curve @ rotation).float()
    for name in [k for k in state if k.endswith("adaln_proj.linear.weight")]:
        state[name] = (state[name].double() @ rotation).float()
    model = H3DiT(config)
    model.load_state_dict(state)
    return model.eval().requires_grad_(False)


def test_on_the_grid_the_curve_form_is_the_full_model():
    full = tiny_random_dit()
    curve = curve_model(full)
    layout_times = (0.25, 0.5)  # video, audio: rows 256 and 512 of the table
    video, audio = forward(curve, times=layout_times)
    expected_video, expected_audio = forward(full, times=layout_times)
    assert torch.allclose(video, expected_video, atol=2e-5, rtol=1e-4)
    assert torch.allclose(audio, expected_audio, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(forward(curve, times=(0.5, 0.25))[0], video, atol=1e-3)  # the timesteps matter

    no_silu = curve_model(full)
    for module in [*(block.adaln_proj for block in no_silu.blocks), no_silu.final_layer.adaln_proj]:
        module.silu = True  # what a curve read through the full model's SiLU would give
    assert not torch.allclose(forward(no_silu, times=layout_times)[0], video, atol=1e-3)


def test_the_table_is_read_by_linear_interpolation_and_clamped():
    """A table sampled from an affine curve a + b t gives a + b t back anywhere in [0, 1] (linear
    interpolation is exact on it), the ends outside; t = 1 is the last row."""
    config = dataclasses.replace(tiny_random_dit().config, adaln_curve_grid=5, time_embed_dim=3)
    embedder = CurveTimeEmbedder(config)
    a, b = torch.tensor([1.0, -2.0, 0.5]), torch.tensor([3.0, 0.25, -1.0])
    embedder.table.copy_(a + torch.linspace(0, 1, 5)[:, None] * b)
    t = torch.tensor([0.0, 0.1, 0.25, 0.6, 0.999, 1.0])
    assert torch.allclose(embedder(t), a + t[:, None] * b, atol=1e-6)
    assert torch.equal(embedder(torch.tensor([1.0]))[0], embedder.table[-1])
    assert torch.equal(embedder(torch.tensor([-0.5, 1.5])), embedder.table[[0, -1]])


def test_bf16_curve_model_keeps_its_adaln_in_fp32():
    curve = curve_model(tiny_random_dit()).set_dtype(torch.bfloat16)
    assert curve.blocks[0].adaln_proj.linear.weight.dtype == torch.float32
    assert curve.final_layer.adaln_proj.linear.weight.dtype == torch.float32
    assert curve.time_embedder.table.dtype == torch.float32 and curve.blocks[0].mlp.fc1.weight.dtype == torch.bfloat16
    table = curve.modulation(torch.tensor([0.5]))
    assert table.blocks[0].dtype == torch.bfloat16  # a block's rows meet the bf16 stream in its dtype
    assert table.final.dtype == torch.float32  # the final layer modulates in fp32, as ComfyUI's curve form does
    video, _ = forward(curve, times=(0.25, 0.5))
    assert torch.isfinite(video).all()


def comfy_curve_file(path, model: H3DiT, prefix="model.diffusion_model.") -> None:
    """A pruned file as ComfyUI ships it: `adaln_t_table` fp32, the reduced AdaLN weights bf16 and their
    folded biases fp16, no time embedder, everything else as the bf16 repack."""
    tensors = native_tensors(model)
    tensors["adaln_t_table"] = tensors.pop("time_embedder.table")
    for name in list(tensors):
        if ".adaln_proj.linear." in name or name.startswith("final_layer.adaln_proj.linear."):
            tensors[name] = tensors[name].to(torch.bfloat16 if name.endswith("weight") else torch.float16)
    save_file({prefix + k: v.contiguous() for k, v in tensors.items()}, str(path))


def test_a_pruned_comfy_file_loads_as_the_curve_form(tmp_path):
    curve = curve_model(tiny_random_dit())
    path = tmp_path / "minimax_h3_fl2va_pruned_bf16.safetensors"
    comfy_curve_file(path, curve)
    config = infer_config(locate_dit(path))
    unused = {"freq_dim": config.freq_dim, "time_embed_hidden_dim": config.time_embed_hidden_dim}  # no time embedder
    assert config == dataclasses.replace(curve.config, **unused) and (config.adaln_curve_grid, config.time_embed_dim) == (GRID, 32)
    loaded = load_dit(path, dtype=torch.bfloat16)
    adaln = loaded.blocks[1].adaln_proj.linear
    assert adaln.weight.dtype == adaln.bias.dtype == loaded.time_embedder.table.dtype == torch.float32
    assert torch.equal(adaln.weight, curve.blocks[1].adaln_proj.linear.weight.bfloat16().float())
    assert torch.equal(loaded.time_embedder.table, curve.time_embedder.table)
    kept = load_dit(path)  # the file's dtypes, but its AdaLN in fp32 all the same
    assert kept.final_layer.adaln_proj.linear.bias.dtype == torch.float32
    assert kept.blocks[0].mlp.fc1.weight.dtype == torch.float32  # stored fp32 in this test file

    expected = curve_model(tiny_random_dit()).set_dtype(torch.bfloat16)
    expected.load_state_dict(loaded.state_dict())  # the values as loaded, in the model the file describes
    assert all(torch.equal(a, b) for a, b in zip(forward(loaded, times=(0.25, 0.5)), forward(expected, times=(0.25, 0.5))))


def spell_the_table_as_shipped(path) -> None:
    """The quantized-file writers keep our names: rename our `time_embedder.table` to `adaln_t_table`."""
    from safetensors import safe_open

    with safe_open(path, "pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    tensors["model.diffusion_model.adaln_t_table"] = tensors.pop("model.diffusion_model.time_embedder.table")
    save_file(tensors, str(path))


def test_a_pruned_int8_convrot_file_keeps_its_int8_linears(tmp_path):
    """Comfy-Org's `*_pruned_int8_convrot`: the blocks' and the token refiner's linears int8 ConvRot (kept int8,
    each weight rebuilt when used), the curve form around them."""
    from test_fp8 import write_convrot

    curve = curve_model(tiny_random_dit())
    leaves = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
    layers = [f"{stack}.{i}.{leaf}" for stack in ("blocks", "token_refiner.blocks") for i in range(2) for leaf in leaves]
    path = tmp_path / "minimax_h3_fl2va_pruned_int8_convrot.safetensors"
    meant, _ = write_convrot(path, curve, layers)
    spell_the_table_as_shipped(path)
    loaded = load_dit(path, dtype=torch.float32)
    assert loaded.config.curve_form and torch.equal(loaded.time_embedder.table, curve.time_embedder.table)
    for layer in layers:
        module = loaded.get_submodule(layer)
        assert isinstance(module, FP8Linear) and module.weight.dtype == torch.int8
        assert torch.allclose(module.dequantized_weight().double(), meant[layer], atol=1e-6)
    video, _ = forward(loaded, times=(0.25, 0.5))
    assert F.cosine_similarity(video.flatten(), forward(curve, times=(0.25, 0.5))[0].flatten(), dim=0) > 0.999


def test_a_pruned_fp8_scaled_file_dequantizes_its_adaln_to_fp32(tmp_path):
    curve = curve_model(tiny_random_dit()).set_dtype(torch.bfloat16)
    path = tmp_path / "minimax_h3_fl2va_pruned_fp8_scaled.safetensors"
    layers = [f"blocks.{i}.{leaf}" for i in range(2) for leaf in ("attn.qkv_proj", "mlp.fc1")]
    meant = write_fp8_scaled(path, curve, "comfy_quant", layers=[*layers, "blocks.0.adaln_proj.linear"])
    spell_the_table_as_shipped(path)
    loaded = load_dit(path, dtype=torch.bfloat16)
    assert isinstance(loaded.blocks[1].mlp.fc1, FP8Linear)
    adaln = loaded.blocks[0].adaln_proj.linear
    assert not isinstance(adaln, FP8Linear) and adaln.weight.dtype == torch.float32
    assert torch.equal(adaln.weight, meant["blocks.0.adaln_proj.linear"])
    video, _ = forward(loaded, times=(0.25, 0.5))
    assert torch.isfinite(video).all()


def test_the_curve_form_weighs_a_fraction_of_the_full_adaln():
    """At the real config: ~26 GB of AdaLN (bf16, fp32 embedder) against ~175 MB in the curve form (fp32)."""
    from h3_core.config import DiTConfig

    full = adaln_weight_bytes(DiTConfig(), 2)
    curve = adaln_weight_bytes(DiTConfig(adaln_curve_grid=GRID, time_embed_dim=8), 2)
    assert 25e9 < full < 27e9 and 170e6 < curve < 180e6
    config = dataclasses.replace(tiny_random_dit().config, adaln_curve_grid=GRID)
    with torch.device("meta"):
        model = H3DiT(config)
    counted = sum(p.numel() * 4 for module in model.adaln_modules() for p in [*module.parameters(), *module.buffers()])
    assert adaln_weight_bytes(model.config, 2) == counted


def test_reading_a_pruned_file_again_gives_the_same_model(tmp_path):
    curve = curve_model(tiny_random_dit())
    path = tmp_path / "pruned.safetensors"
    comfy_curve_file(path, curve, prefix="")
    reader = DiTReader(path, dtype=torch.bfloat16)
    first = {k: v.clone() for k, v in reader.read().state_dict().items()}
    reader.drop()
    again = reader.read().state_dict()
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)


def test_a_curve_model_streams_and_offloads_its_adaln_like_any_other():
    """Blocks streamed and the AdaLN tables made up front (its projections and table kept off the compute
    path): the same sample as the resident model."""
    from h3_core.conditioning import Request, encode_request
    from h3_core.offload import stream_blocks
    from h3_core.pipeline import TINY_CANVAS, sample
    from h3_core.tiny_text import tiny_random_text_encoder

    cond = encode_request(Request("t2va", "a fox", duration=4.0), tiny_random_text_encoder(), rules=TINY_CANVAS)
    expected = sample(curve_model(tiny_random_dit()), cond, 3, 4)
    streamed = curve_model(tiny_random_dit())
    streamer = stream_blocks(streamed, "cpu", resident=0, prefetch=1)
    got = sample(streamed, cond, 3, 4, offload_adaln=True)
    streamer.remove()
    assert torch.equal(got.video, expected.video) and torch.equal(got.audio, expected.audio)


def test_an_adapter_for_the_full_adaln_is_refused_with_the_reason(tmp_path):
    """A LoRA trained on the full model's AdaLN (2688 inputs at the real size, 32 here) cannot adapt a
    curve-form projection (8 curve columns as published): refused, saying why, before any weight changes."""
    from lora_files import write_native

    from h3_core.lora import LoRAError, apply_loras, load_lora
    from h3_core.tiny import seeded_random_weights

    config = dataclasses.replace(tiny_random_dit().config, adaln_curve_grid=GRID, time_embed_dim=8)
    model = seeded_random_weights(H3DiT(config), 1).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    path = write_native(tmp_path / "adaln.safetensors", {
        "blocks.0.adaln_proj.linear": (torch.randn(2, 32), torch.randn(6 * 3 * 64, 2)),
        "blocks.0.attn.qkv_proj": (torch.randn(2, 64), torch.randn(3 * 64, 2)),
    })
    with pytest.raises(LoRAError, match="input width 32; 'blocks.0.adaln_proj.linear' takes 8. This model is a pruned"):
        apply_loras(model, [load_lora(path)], partition="fl2va")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.skipif(not os.environ.get("COMFYUI_PATH"),
                    reason="COMFYUI_PATH not set: ComfyUI's own H3 model, the curve form's reference, is not here")
def test_comfyuis_own_h3_model_gives_the_same_output(monkeypatch):
    """The same curve-form weights in ComfyUI's MiniMaxH3Model (what runs these files in ComfyUI) and in
    ours, one t2va forward at a step off the grid: the same velocities (ComfyUI returns them negated)."""
    monkeypatch.syspath_prepend(os.environ["COMFYUI_PATH"])  # only for this test: its nodes.py would hide ours
    pytest.importorskip("comfy.cli_args").args.cpu = True  # before comfy.model_management looks for a GPU
    native = pytest.importorskip("comfy.ldm.minimax.model")
    import comfy.ops

    from h3_core.dit import rope_inverse_frequencies
    from h3_core.layout import build_t2va_layout, pack_audio, patchify, unpatchify

    ours = curve_model(tiny_random_dit())
    c = ours.config
    theirs = native.MiniMaxH3Model(
        hidden_size=c.hidden_size, num_layers=c.num_layers, token_refiner_num_layers=c.num_refiner_layers,
        num_attention_heads=c.num_attention_heads, attention_head_dim=c.attention_head_dim, ffn_hidden_size=c.ffn_dim,
        latents_dim=c.in_channels, audio_latents_dim=c.audio_in_channels, text_dim=c.text_dim,
        time_embed_dim=c.time_embed_dim, rope_inv_freq_len=c.rope_freq_dim, adaln_curve_grid=c.adaln_curve_grid,
        dtype=torch.float32, device="cpu", operations=comfy.ops.disable_weight_init)
    state = {("adaln_t_table" if k == "time_embedder.table" else k): v for k, v in ours.state_dict().items()}
    theirs.load_state_dict({**state, "rope.inv_freq": rope_inverse_frequencies(c)})
    theirs.eval().requires_grad_(False)

    g = torch.Generator().manual_seed(4)
    frames, height, width, audio_latents, text_rows = 7, 8, 14, 37, 5
    video = torch.randn(1, c.in_channels, frames, height, width, generator=g)
    audio = torch.randn(2, c.audio_in_channels, audio_latents, generator=g)  # ours: one latent per channel
    text = torch.randn(1, text_rows, c.text_dim, generator=g)
    sigma = 0.6
    t_video = 1.0 - sigma
    t_audio = float(1.0 - native.time_shift_sigma(torch.tensor(sigma), 12.0, 3.0))
    with torch.inference_mode():
        their_video, their_audio = theirs._forward([video, audio.permute(1, 0, 2)[None]],
                                                   torch.tensor([sigma * 1000.0]), text)
    layout = build_t2va_layout(torch.ones(text_rows, dtype=torch.long), frames, height, width, audio_latents)
    timesteps, indices = layout.row_timesteps(t_video, t_audio)
    with torch.inference_mode():
        our_video, our_audio = ours(patchify(video), pack_audio(audio[None]), text, timesteps, indices,
                                    layout.token_tags, layout.position_ids, layout.video_indices,
                                    layout.audio_indices, layout.text_indices)
    assert torch.allclose(unpatchify(our_video, frames, height, width), -their_video, atol=1e-4, rtol=1e-4)
    assert torch.allclose(our_audio, pack_audio(-their_audio.permute(0, 2, 1, 3)), atol=1e-4, rtol=1e-4)
