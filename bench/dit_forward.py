"""Seconds per DiT forward at the real config with random weights (timing does not depend on values).

Prints one JSON line per case. `--reference` also times diffusers' MiniMaxH3Transformer3DModel on the
same inputs in the same process (needs diffusers installed), one model on the GPU at a time.

    python bench/dit_forward.py --frames 124 209 --text-rows 512 [--reference] [--attention auto] [--compile]
    python bench/dit_forward.py --frames 124 --image-references 3 --reference-images canvas-lossy --compile

`--curve-grid 1025` times the curve form of the pruned files (Comfy-Org's `*_pruned_*`: an 8-column AdaLN
table instead of the time embedder and the 26 GB of AdaLN weights).

`--held nvfp4` (or `int4`, or `gguf-Q8_0`, `gguf-Q4_K`, ... for a GGML type) holds the 200 block linears as an
NVFP4 (int4 ConvRot, GGUF) DiT file's are (random codes and scales; weight-only, each weight rebuilt in bf16 as it
is used).

`--image-references N` makes it a ref2va forward with N 1920x1080 image references, sized by
`--reference-images` (the release's 2048 short edge, or canvas-lossy: the output's area).

Ours runs with `--attention` (default sdpa, the reference's kernel; auto = the fastest exact one here)
and, with `--compile`, its blocks compiled; the reference always runs as diffusers ships it.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from h3_core import geometry
from h3_core.config import DiTConfig
from h3_core.dit import H3DiT, rope_inverse_frequencies
from h3_core.layout import ReferenceBlock, build_ref2va_layout, build_request_layout
from h3_core.references import REFERENCE_IMAGE_MODES, RELEASE_CANVAS
from h3_core.sampler import sigma_ladder


def randomize_(model: torch.nn.Module) -> torch.nn.Module:
    """Materialize a meta-built model on the GPU and fill it with small random values (not zeros)."""
    model.to_empty(device="cuda")
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:  # buffers too: the curve form's table
            if tensor.is_floating_point():
                tensor.normal_(0.0, 0.02)
    return model


def build_ours(config: DiTConfig) -> H3DiT:
    with torch.device("meta"):
        model = H3DiT(config)
    model.set_dtype(torch.bfloat16)
    randomize_(model)
    model.rope_inv_freq = rope_inverse_frequencies(config).cuda()
    return model.eval().requires_grad_(False)


# byte offsets of the fp16 scale fields in each GGML block (gguf_quants), set to sane values in random blocks
GGML_SCALE_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82),
                     "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}


def fill_random_ggml(blocks: torch.Tensor, qtype: str, generator: torch.Generator) -> None:
    """Fill `blocks` (uint8, one GGML block of `qtype` a row) with random bytes, their fp16 scales ~1e-3
    (weights of about a trained model's spread)."""
    blocks.copy_(torch.randint(0, 256, blocks.shape, device=blocks.device, generator=generator, dtype=torch.uint8))
    for offset in GGML_SCALE_FIELDS[qtype]:
        scales = (torch.rand(blocks.shape[0], 1, device=blocks.device, generator=generator) * 1e-3 + 5e-4).half()
        blocks[:, offset:offset + 2] = scales.view(torch.uint8)


def gguf_blocks(model: H3DiT, qtype: str) -> H3DiT:
    """The block linears as a GGUF file's in `qtype`: random blocks, their fp16 scales ~1e-3."""
    from h3_core import fp8, gguf_quants
    from h3_core.gguf_file import GGUFEntry, GGUFLoad

    names = fp8.block_linear_names(model)
    entries = {f"{layer}.weight": GGUFEntry(qtype, shape, shape) for layer in names
               if (shape := tuple(model.get_submodule(layer).weight.shape))}
    GGUFLoad.plan(model, entries, keep=lambda layer: True, compute=torch.bfloat16,
                  dense_dtype=lambda name: torch.bfloat16)
    g = torch.Generator("cuda").manual_seed(1)
    _, size = gguf_quants.BLOCKS[qtype]
    for layer in names:
        module = model.get_submodule(layer)
        module.to_empty(device="cuda")
        fill_random_ggml(module.weight.view(-1, size), qtype, g)
    return model


def stored_blocks(model: H3DiT, held: str) -> H3DiT:
    """The block linears as an NVFP4, int4 ConvRot (groups of 256) or GGUF file's, random codes and scales
    (weights of about the same spread)."""
    from h3_core import fp8, nvfp4

    if held.startswith("gguf-"):
        return gguf_blocks(model, held.removeprefix("gguf-"))
    names = fp8.block_linear_names(model)
    if held == "nvfp4":
        layers = {layer: nvfp4.NVFP4Entry.for_linear(model.get_submodule(layer).out_features,
                                                     model.get_submodule(layer).in_features) for layer in names}
        nvfp4.NVFP4Load.plan(model, layers, keep=lambda layer: True, compute=torch.bfloat16,
                             dense_dtype=lambda layer: torch.bfloat16)
    else:
        for layer in names:
            linear = model.get_submodule(layer)
            model.set_submodule(layer, fp8.FP8Linear(linear.in_features, linear.out_features, weight_dtype=torch.int8,
                                                     device="meta", rotation=256, packed=True))
    g = torch.Generator("cuda").manual_seed(1)
    for layer in names:
        module = model.get_submodule(layer)
        module.to_empty(device="cuda")
        codes = torch.randint(0, 256, module.weight.shape, device="cuda", generator=g, dtype=torch.uint8)
        module.weight.copy_(codes.view(module.weight.dtype))
        scales = torch.rand(module.weight_scale.shape, device="cuda", generator=g) * 0.5 + 0.5
        if held == "nvfp4":
            module.weight_scale.copy_(scales.to(torch.float8_e4m3fn))
            module.weight_scale_2.fill_(0.01)
        else:
            module.weight_scale.copy_(scales * 0.005)
    return model


def build_reference(config: DiTConfig):
    from diffusers import MiniMaxH3Transformer3DModel

    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel(**config.to_dict())
    model.to(torch.bfloat16)
    for name, module in model.named_modules():
        if name in MiniMaxH3Transformer3DModel._keep_in_fp32_modules:
            module.float()
    randomize_(model)
    model.rope.inv_freq = rope_inverse_frequencies(config).cuda()
    return model.eval().requires_grad_(False)


def make_layout(frames: int, text_rows: int, width: int, height: int, image_references: int = 0,
                reference_images: str = "release"):
    """t2va, or ref2va with `image_references` 1920x1080 images sized by `reference_images`."""
    tags = torch.ones(text_rows, dtype=torch.long)
    if not image_references:
        return build_request_layout(width, height, frames, tags)
    size = RELEASE_CANVAS.sized_for_canvas(reference_images, width, height).reference_image_size(1920, 1080)
    block = ReferenceBlock.image(*(side // geometry.VAE_SPATIAL_FACTOR for side in reversed(size)))
    return build_ref2va_layout(tags, [block] * image_references, geometry.latent_frames(frames),
                               *geometry.latent_size(width, height), geometry.audio_latents(frames))


def make_inputs(config: DiTConfig, frames: int, text_rows: int, width: int, height: int, image_references: int = 0,
                reference_images: str = "release"):
    layout = make_layout(frames, text_rows, width, height, image_references, reference_images).to("cuda")
    sigmas = sigma_ladder(50, 12.0)
    t_video, t_audio = 1.0 - float(sigmas[10]), 1.0 - float(sigma_ladder(50, 3.0)[10])
    timesteps, indices = layout.row_timesteps(t_video, t_audio)
    g = torch.Generator("cuda").manual_seed(0)
    return layout, dict(
        video_rows=torch.randn(1, layout.video_indices.numel(), config.video_patch_dim, device="cuda", generator=g),
        audio_rows=torch.randn(1, layout.audio_indices.numel(), config.audio_in_channels, device="cuda", generator=g),
        text_states=torch.randn(1, text_rows, config.text_dim, device="cuda", generator=g).bfloat16(),
        timesteps=timesteps.cuda(),
        timestep_indices=indices.cuda(),
    )


def time_forward(call, repeats: int) -> list[float]:
    call()  # warm-up
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000.0)
    return times


def bench(name, model, config, cases, text_rows, width, height, repeats, image_references=0,
          reference_images="release", **described):
    for frames in cases:
        layout, inputs = make_inputs(config, frames, text_rows, width, height, image_references, reference_images)
        if image_references:
            described = {**described, "image_references": image_references, "reference_images": reference_images}
        structure = dict(
            token_tags=layout.token_tags, position_ids=layout.position_ids, video_indices=layout.video_indices,
            audio_indices=layout.audio_indices, text_indices=layout.text_indices,
        )
        if name == "ours":
            sparse = {"sparse_tiles": layout.vsa_tiles()} if model.sparse_attention is not None else {}
            call = lambda: model(**inputs, **structure, **sparse)  # noqa: E731
        else:
            call = lambda: model(  # noqa: E731
                hidden_states=inputs["video_rows"], audio_hidden_states=inputs["audio_rows"],
                encoder_hidden_states=inputs["text_states"], timestep=inputs["timesteps"],
                timestep_indices=inputs["timestep_indices"], return_dict=False, **structure,
            )
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            times = sorted(time_forward(call, repeats))
        print(json.dumps({
            "impl": name, "width": width, "height": height, "frames": frames, "text_rows": text_rows,
            "rows": layout.sequence_length, "seconds_per_forward_median": round(times[len(times) // 2], 4),
            "seconds_all": [round(t, 4) for t in times], "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "torch": torch.__version__, "device": torch.cuda.get_device_name(), **described,
        }), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, nargs="+", default=[124, 209])
    parser.add_argument("--text-rows", type=int, default=512)
    parser.add_argument("--aspect-ratio", default="16:9")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=50, help="fewer blocks for a quick check")
    parser.add_argument("--reference", action="store_true", help="also time diffusers' DiT")
    parser.add_argument("--attention", default="sdpa", help="our attention backend (auto = fastest exact here)")
    parser.add_argument("--compile", action="store_true", help="compile our repeated block (not bitwise exact)")
    parser.add_argument("--image-references", type=int, default=0, help="ref2va with N 1920x1080 image references")
    parser.add_argument("--reference-images", nargs="+", choices=REFERENCE_IMAGE_MODES, default=["release"],
                        help="how the image references are sized; several: one run each")
    parser.add_argument("--curve-grid", type=int, default=0,
                        help="the curve form (pruned files) with this many table rows, 8 columns (0: the full model)")
    parser.add_argument("--held", choices=["nvfp4", "int4", *(f"gguf-{t}" for t in GGML_SCALE_FIELDS)], default=None,
                        help="block linears held as an nvfp4, int4 ConvRot or GGUF DiT file's")
    parser.add_argument("--vsa", type=float, default=None, metavar="SPARSITY",
                        help="FastH3 8-Step V2's model: a VSA gate in every block, Video Sparse Attention at SPARSITY")
    args = parser.parse_args()
    curve = {"adaln_curve_grid": args.curve_grid, "time_embed_dim": 8} if args.curve_grid else {}
    config = DiTConfig(num_layers=args.layers, vsa_gates=args.vsa is not None, **curve)
    width, height = geometry.canvas_size(args.aspect_ratio)
    started = time.time()
    model = build_ours(config)
    if args.held:
        with torch.no_grad():
            stored_blocks(model, args.held)
        torch.cuda.empty_cache()
    print(json.dumps({"built": "ours", "seconds": round(time.time() - started, 1),
                      "weights_gib": round(torch.cuda.memory_allocated() / 2**30, 2)}), flush=True)
    backend = model.set_attention_backend(args.attention)
    if args.vsa is not None:
        model.set_sparse_attention(args.vsa)
        backend = f"vsa {args.vsa:g} (flex)"
    if args.compile:
        model.compile_blocks()
    for mode in args.reference_images:
        bench("ours", model, config, args.frames, args.text_rows, width, height, args.repeats, args.image_references,
              mode, attention=backend, compiled=args.compile, **({"curve_grid": args.curve_grid} if curve else {}),
              **({"linears": args.held} if args.held else {}))
    del model
    torch.cuda.empty_cache()
    if args.reference:
        model = build_reference(config)
        for mode in args.reference_images:
            bench("diffusers", model, config, args.frames, args.text_rows, width, height, args.repeats,
                  args.image_references, mode, attention="diffusers default")


if __name__ == "__main__":
    main()
