"""The lossy speed paths of one DiT forward against the exact one: seconds, memory and how far the
outputs move (cosine similarity, max abs diff, relative L2 of the video and audio velocities).

First, on CUDA, one layer's attention alone at each length (random q, k, v of unit scale): SDPA,
SageAttention and our int8-QK / FP8-PV Triton kernel (attention_8bit.py) over a few tile shapes; the
fastest tile shape is then used below. Then whole forwards, in this order (FP8 linears are swapped in
place, so the exact-weight ones run first):
    exact            bf16 weights, SDPA (cuDNN): the reference outputs
    sage_lossy       exact weights, SageAttention (8-bit QK) if `sageattention` is importable
    attn8_lossy      exact weights, our int8-QK / FP8-PV attention (needs Triton)
    fp8_lossy        FP8 block linears (e4m3 weights per channel, inputs per row, torch._scaled_mm), SDPA
    fp8_sage_lossy / fp8_attn8_lossy                     FP8 block linears + a lossy attention
    fp8_attn8_compile_lossy / fp8_sage_compile_lossy     the same with `compile_blocks()`
    fa3fp8_compile_lossy / fp8_fa3fp8_compile_lossy      exact weights / FP8 block linears, FlashAttention 3's
                                                         FP8 attention (`flash3-fp8-lossy`), compiled blocks
    compile / fp8_compile_lossy                          exact weights / FP8 linears, compiled blocks
    window_compile_lossy / fp8_window_compile_lossy      windowed video attention (`--windows` latent frames,
    fp8_fa3fp8_window_compile_lossy                      local_attention.py) on the exact kernel (`--attention`)
                                                         or FA3 FP8; exact / FP8 linears; compiled blocks
`--attention` picks the backend of every variant whose attention is exact (default sdpa; auto = the
fastest exact one here, e.g. FlashAttention 4).
Weights are random but shaped like a trained model's (linears ~ N(0, 1/fan_in), norm gains ~ 1), so
attention is not uniform; the similarity numbers are indicative only, not a quality verdict on the
real checkpoint. AdaLN tables are precomputed once (exact, as the sampler does) and shared.

    python bench/fp8_bench.py --frames 124 209 --text-rows 512          (one H200; needs no diffusers)
    python bench/fp8_bench.py --tiny                                   (CPU: proves the script runs)
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import time

import torch
import torch.nn.functional as F

from h3_core import geometry
from h3_core.attention import available_backends
from h3_core.config import DiTConfig, TINY_DIT
from h3_core.dit import H3DiT, rope_inverse_frequencies
from h3_core.fp8 import quantize_blocks
from h3_core.layout import build_request_layout
from h3_core.local_attention import VideoWindow

ALL_VARIANTS = ("exact", "sage_lossy", "attn8_lossy", "compile", "fp8_lossy", "fp8_sage_lossy", "fp8_attn8_lossy",
                "fp8_attn8_compile_lossy", "fp8_sage_compile_lossy", "fp8_compile_lossy", "fa3fp8_compile_lossy",
                "fp8_fa3fp8_compile_lossy", "window_compile_lossy", "fp8_window_compile_lossy",
                "fp8_fa3fp8_window_compile_lossy")
DEFAULT_VARIANTS = tuple(v for v in ALL_VARIANTS if "compile" not in v)
TILES = [  # (block_m, block_n, num_warps, num_stages) tried for the int8-QK / FP8-PV kernel
    (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (64, 128, 4, 3), (128, 128, 4, 2),
]
GIB = 2**30


def build(config: DiTConfig, device: torch.device, dtype: torch.dtype) -> H3DiT:
    """Allocate on `device` (no CPU copy) and fill with seeded values of trained-model magnitudes."""
    with torch.device("meta"):
        model = H3DiT(config)
    model.set_dtype(dtype)
    model.to_empty(device=device)
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim >= 2:
                param.normal_(0.0, param.shape[1] ** -0.5, generator=generator)
            elif name.endswith("weight"):  # RMSNorm gains
                param.normal_(1.0, 0.1, generator=generator)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    model.rope_inv_freq = rope_inverse_frequencies(config).to(device)
    return model.eval().requires_grad_(False)


def make_case(model: H3DiT, frames: int, text_rows: int, width: int, height: int, device: torch.device):
    config = model.config
    layout = build_request_layout(width, height, frames, torch.ones(text_rows, dtype=torch.long)).to(device)
    timesteps, indices = layout.row_timesteps(0.3, 0.55)
    g = torch.Generator(device).manual_seed(1)
    inputs = dict(
        video_rows=torch.randn(1, layout.video_indices.numel(), config.video_patch_dim, device=device, generator=g),
        audio_rows=torch.randn(1, layout.audio_indices.numel(), config.audio_in_channels, device=device, generator=g),
        text_states=torch.randn(1, text_rows, config.text_dim, device=device, generator=g).to(model.dtype),
        timesteps=timesteps.to(device), timestep_indices=indices.to(device), token_tags=layout.token_tags,
        position_ids=layout.position_ids, video_indices=layout.video_indices, audio_indices=layout.audio_indices,
        text_indices=layout.text_indices, target_video=layout.target_video_span,
    )
    with torch.inference_mode():
        inputs["modulation"] = model.modulation(inputs["timesteps"])
    return layout.sequence_length, inputs


def timed(call, repeats: int, cuda: bool) -> list[float]:
    call()  # warm-up (and compile, where there is one)
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            call()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000.0)
        else:
            started = time.perf_counter()
            call()
            times.append(time.perf_counter() - started)
    return times


def compare(reference, got) -> dict:
    out = {}
    for name, a, b in zip(("video", "audio"), reference, got):
        a, b = a.double().flatten(), b.double().flatten().to(a.device)
        out[name] = {
            "cosine": round(F.cosine_similarity(a, b, dim=0).item(), 6),
            "max_abs_diff": round((a - b).abs().max().item(), 6),
            "relative_l2": round(((a - b).norm() / a.norm()).item(), 6),
            "reference_max_abs": round(a.abs().max().item(), 4),
        }
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, nargs="+", default=[124, 209])
    parser.add_argument("--text-rows", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layers", type=int, default=50)
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=ALL_VARIANTS)
    parser.add_argument("--no-attention-micro", action="store_true", help="skip the attention-only timings")
    parser.add_argument("--attention-only", action="store_true", help="only the attention-only timings")
    parser.add_argument("--attention", default="sdpa", help="backend of the variants whose attention is exact (auto = fastest here)")
    parser.add_argument("--activations", default="row", choices=["row", "tensor"], help="FP8 input scaling")
    parser.add_argument("--compile-mode", default="default")
    parser.add_argument("--windows", type=int, nargs="+", default=[8], help="latent frames of the *window* variants")
    parser.add_argument("--tiny", action="store_true", help="tiny config on the CPU (CUDA-only variants skipped)")
    args = parser.parse_args()

    if args.tiny:
        device, dtype, config = torch.device("cpu"), torch.float32, TINY_DIT
        width, height, text_rows, frames_list = 128, 64, 6, [124]
    else:
        device, dtype, config = torch.device("cuda"), torch.bfloat16, DiTConfig(num_layers=args.layers)
        (width, height), text_rows, frames_list = geometry.canvas_size("16:9"), args.text_rows, args.frames
    cuda = device.type == "cuda"
    has_sage = cuda and importable("sageattention")
    has_attn8 = cuda and importable("triton")
    print(json.dumps({
        "torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu",
        "triton": version("triton"), "sageattention": version("sageattention"), "width": width, "height": height,
        "text_rows": text_rows, "layers": config.num_layers, "activations": args.activations,
    }), flush=True)

    if cuda and not args.no_attention_micro:
        for frames in frames_list:
            layout = build_request_layout(width, height, frames, torch.ones(text_rows, dtype=torch.long))
            windows = [VideoWindow.for_frames(w, layout.sequence_length, *layout.target_video_span) for w in args.windows]
            attention_micro(layout.sequence_length, config, has_sage, has_attn8, args.repeats, windows)
    if args.attention_only:
        return

    started = time.time()
    model = build(config, device, dtype)
    print(json.dumps({"built": round(time.time() - started, 1),
                      "weights_gib": round(torch.cuda.memory_allocated() / GIB, 2) if cuda else None}), flush=True)
    cases = {frames: make_case(model, frames, text_rows, width, height, device) for frames in frames_list}
    reference = {}
    quantized = compiled = False
    torch._dynamo.config.cache_size_limit = 64  # one graph per length and window
    runs = [(v, w) for v in args.variants for w in (args.windows if "window" in v else [0])]
    for variant, window in runs:
        sage, attn8, fa3fp8 = "sage" in variant, "attn8" in variant, "fa3fp8" in variant
        fp8, compile_ = variant.startswith("fp8"), "compile" in variant
        skip = ("needs CUDA and the sageattention package" if sage and not has_sage else
                "needs CUDA and Triton" if attn8 and not has_attn8 else
                "needs a FlashAttention 3 build" if fa3fp8 and "flash3-fp8-lossy" not in available_backends() else
                "compile is timed on CUDA only" if compile_ and not cuda else
                "the blocks are already compiled: list uncompiled variants first" if compiled and not compile_ else
                "the block linears are already FP8: list exact-weight variants first" if quantized and not fp8 else None)
        if skip:
            print(json.dumps({"variant": variant, "skipped": skip}), flush=True)
            continue
        try:
            if fp8 and not quantized:
                started = time.time()
                quantize_blocks(model, "scaled", args.activations, device=device)
                quantized = True
                if cuda:
                    torch.cuda.empty_cache()
                print(json.dumps({"quantized_blocks_seconds": round(time.time() - started, 1),
                                  "weights_gib": round(torch.cuda.memory_allocated() / GIB, 2) if cuda else None}), flush=True)
            if compile_ and not compiled:
                model.compile_blocks(args.compile_mode)
                compiled = True
            lossy = "sage" if sage else "int8qk-fp8pv-lossy" if attn8 else "flash3-fp8-lossy" if fa3fp8 else None
            model.set_attention_window(0)
            chosen = model.set_attention_backend(lossy or args.attention)
            model.set_attention_window(window)
            if window:
                variant = f"{variant}@{window}"
            print(json.dumps({"variant": variant, "attention": chosen, "window_frames": window}), flush=True)
        except Exception as error:  # noqa: BLE001  a benchmark reports and goes on
            print(json.dumps({"variant": variant, "error": f"{type(error).__name__}: {error}"[:2000]}), flush=True)
            continue
        for frames, (rows, inputs) in cases.items():
            try:
                run_case(variant, model, frames, rows, inputs, reference, args.repeats, cuda)
            except Exception as error:  # noqa: BLE001
                print(json.dumps({"variant": variant, "frames": frames, "error": f"{type(error).__name__}: {error}"[:2000]}), flush=True)
            if cuda:
                torch.cuda.empty_cache()


def run_case(variant, model, frames, rows, inputs, reference, repeats, cuda):
    def call():
        return model(**inputs)

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
    started = time.time()
    with torch.inference_mode():
        times = sorted(timed(call, repeats, cuda))
        out = call()
    first_call_and_timing = time.time() - started
    line = {"variant": variant, "frames": frames, "rows": rows,
            "seconds_per_forward_median": round(times[len(times) // 2], 4), "seconds_all": [round(t, 4) for t in times],
            "wall_seconds_incl_warmup": round(first_call_and_timing, 1)}
    if cuda:
        line.update(resident_gib=round(resident / GIB, 2), peak_gib=round(torch.cuda.max_memory_allocated() / GIB, 2))
    config = model.config
    linear_params = config.hidden_size * (3 * config.inner_dim) + config.inner_dim * config.hidden_size + 3 * config.hidden_size * config.ffn_dim
    flops = config.num_layers * (2 * rows * linear_params + 4 * rows * rows * config.inner_dim)
    line["effective_tflops"] = round(flops / times[len(times) // 2] / 1e12, 1)
    if variant == "exact":
        reference[frames] = tuple(t.float().cpu() for t in out)
    elif frames in reference:
        line["vs_exact"] = compare(reference[frames], out)
    print(json.dumps(line), flush=True)


def attention_micro(rows: int, config: DiTConfig, has_sage: bool, has_attn8: bool, repeats: int, windows=()) -> None:
    """One layer's attention at `rows` rows: seconds, TFLOP/s and error against SDPA for each backend
    (and each VideoWindow on the backends that run one; TFLOP/s then counts full attention's work);
    the fastest tile shape of our kernel becomes its default (KERNEL_CONFIG) for the forwards."""
    from h3_core.attention import EXACT_BACKENDS, attention

    g = torch.Generator("cuda").manual_seed(2)
    shape = (1, rows, config.num_attention_heads, config.attention_head_dim)
    q, k, v = (torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    k += 0.5  # a shared offset, as trained keys often have (smoothing removes it)
    flops = 4 * rows * rows * config.inner_dim
    with torch.inference_mode():
        exact = attention(q, k, v, "sdpa")
        cases = [("sdpa", {}, lambda: attention(q, k, v, "sdpa"))]
        for name in available_backends():
            if (name in EXACT_BACKENDS and name != "sdpa") or name == "flash3-fp8-lossy":
                cases.append((name, {}, functools.partial(attention, q, k, v, name)))
            if name == "flash3-fp8-lossy":  # its quantization fused by Inductor, as in compiled blocks
                fused = torch.compile(functools.partial(attention, backend=name), fullgraph=True)
                cases.append((name, {"compiled": True}, functools.partial(fused, q, k, v)))
            if name in ("flash3", "flash3-fp8-lossy"):
                for window in filter(None, windows):
                    windowed = torch.compile(functools.partial(attention, backend=name, window=window), fullgraph=True)
                    cases.append((name, {"compiled": True, "window": [window.start, window.radius]},
                                  functools.partial(windowed, q, k, v)))
        if has_sage:
            cases.append(("sage", {}, lambda: attention(q, k.clone(), v, "sage")))  # sage smooths k in place
        if has_attn8:
            from h3_core import attention_8bit

            for bm, bn, warps, stages in TILES:
                tile = dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
                cases.append(("int8qk-fp8pv-lossy", tile, functools.partial(attention_8bit.int8qk_fp8pv_attention, q, k, v, **tile)))
        best = None
        for name, tile, call in cases:
            try:
                started = time.time()
                call()  # the first call includes any just-in-time compile
                first = time.time() - started
                seconds = sorted(timed(call, max(repeats, 3), True))[1]
                out = call()
            except Exception as error:  # noqa: BLE001
                print(json.dumps({"attention": name, "tile": tile, "rows": rows, "error": f"{type(error).__name__}: {error}"[:1500]}), flush=True)
                continue
            err = compare((exact,), (out,))["video"]
            print(json.dumps({"attention": name, "tile": tile, "rows": rows, "seconds_per_layer": round(seconds, 5),
                              "tflops": round(flops / seconds / 1e12, 1), "seconds_50_layers": round(50 * seconds, 3),
                              "first_call_seconds": round(first, 2), "vs_sdpa": err}), flush=True)
            if name == "int8qk-fp8pv-lossy" and err["cosine"] > 0.99 and (best is None or seconds < best[0]):
                best = (seconds, tile)
        if best is not None:
            attention_8bit.KERNEL_CONFIG.update(best[1])
            print(json.dumps({"int8qk_fp8pv_tile_chosen": best[1], "rows": rows}), flush=True)


def importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def version(name: str) -> str | None:
    if not importable(name):
        return None
    from importlib.metadata import PackageNotFoundError, version as dist_version

    try:
        return dist_version(name)
    except PackageNotFoundError:
        return "unknown"


if __name__ == "__main__":
    main()
