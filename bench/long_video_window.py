"""Seconds per DiT forward for one long-video window at the real config (random weights).

The window is a continuation window as the long-video plan makes it (h3-model.md G): the second window
of a clip, `window` frames starting `window - overlap` frames in, with the previous result's
`overlap`-frame latent tail packed as guide rows (visual rows, then audio rows) at its time origin and
the global time offset `start * 40/24` on every media row. T2VA, 1344x768, 512 text rows by default.
Prints JSON lines: the layout (rows per segment), then one line per timing case.

    python bench/long_video_window.py                 # H200: real config, bf16, one warm-up + timed forwards
    python bench/long_video_window.py --tiny          # CPU: the tiny config on the tiny canvas (proves it runs)

Needs torch and h3_core's engine modules only (no diffusers, no media libraries); works on torch 2.11.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from h3_core import geometry
from h3_core.config import DiTConfig
from h3_core.continuation import DEFAULT_OVERLAP_FRAMES, DEFAULT_WINDOW_FRAMES, Window, plan_windows
from h3_core.layout import build_window_layout
from h3_core.sampler import sigma_ladder

TINY_CANVAS = (224, 128)  # the tiny-random model's 16:9 canvas (pipeline.TINY_CANVAS)


def second_window(window_frames: int, overlap_frames: int) -> Window:
    """The second window of a clip long enough for it to be a full window (plan_windows decides)."""
    start = window_frames - overlap_frames
    windows = plan_windows(start + window_frames, window_frames, overlap_frames)
    assert len(windows) == 2 and windows[1].frames == window_frames, windows
    return windows[1]


def window_layout(window: Window, width: int, height: int, text_rows: int):
    latent_height, latent_width = geometry.latent_size(width, height)
    return build_window_layout(
        torch.ones(text_rows, dtype=torch.long), (), window.latent_frames, latent_height, latent_width,
        window.audio_latents, time_offset=window.time_offset,
        guide_latent_frames=window.guide_latent_frames, guide_audio_latents=window.guide_audio_latents,
    )


def build_real(config: DiTConfig, attention: str):
    """The real-config DiT in bf16 (fp32 heads as the release keeps them), random values, built on the GPU."""
    from h3_core.dit import H3DiT, rope_inverse_frequencies

    with torch.device("meta"):
        model = H3DiT(config)
    model.set_dtype(torch.bfloat16)
    model.to_empty(device="cuda")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    model.rope_inv_freq = rope_inverse_frequencies(config).cuda()
    model.set_attention_backend(attention)
    return model.eval().requires_grad_(False)


def build_tiny(attention: str):
    from h3_core.tiny import tiny_random_dit

    model = tiny_random_dit(torch.float32, "cpu")
    model.set_attention_backend(attention)
    return model


def make_inputs(layout, config: DiTConfig, text_rows: int, device: str):
    """Random rows at a mid-ladder step (t from the 50-point schedules), timesteps from the layout's clocks."""
    t_video = 1.0 - float(sigma_ladder(50, 12.0)[10])
    t_audio = 1.0 - float(sigma_ladder(50, 3.0)[10])
    timesteps, indices = layout.row_timesteps(t_video, t_audio)
    generator = torch.Generator(device).manual_seed(0)
    text = torch.randn(1, text_rows, config.text_dim, device=device, generator=generator)
    return dict(
        video_rows=torch.randn(1, layout.video_indices.numel(), config.video_patch_dim, device=device, generator=generator),
        audio_rows=torch.randn(1, layout.audio_indices.numel(), config.audio_in_channels, device=device, generator=generator),
        text_states=text.bfloat16() if device == "cuda" else text,
        timesteps=timesteps.to(device),
        timestep_indices=indices.to(device),
        token_tags=layout.token_tags.to(device),
        position_ids=layout.position_ids.to(device),
        video_indices=layout.video_indices.to(device),
        audio_indices=layout.audio_indices.to(device),
        text_indices=layout.text_indices.to(device),
    )


def timed(call, repeats: int, cuda: bool) -> list[float]:
    call()  # warm-up
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def forward_flops(rows: int) -> float:
    """h3-model.md K: token-wise linears 3.853e10 * S plus full attention 1,433,600 * S^2 (real config)."""
    return 3.853e10 * rows + 1_433_600 * rows**2


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny config on the CPU, to prove the script runs")
    parser.add_argument("--window-frames", type=int, default=DEFAULT_WINDOW_FRAMES)
    parser.add_argument("--overlap-frames", type=int, default=DEFAULT_OVERLAP_FRAMES)
    parser.add_argument("--text-rows", type=int, default=None, help="default 512 (16 with --tiny)")
    parser.add_argument("--aspect-ratio", default="16:9", help="canvas of the real config (ignored with --tiny)")
    parser.add_argument("--repeats", type=int, default=2, help="timed forwards after one warm-up")
    parser.add_argument("--layers", type=int, default=50, help="fewer blocks for a quick check (real config)")
    parser.add_argument("--attention", default="auto")
    args = parser.parse_args()

    window = second_window(args.window_frames, args.overlap_frames)
    text_rows = args.text_rows or (16 if args.tiny else 512)
    width, height = TINY_CANVAS if args.tiny else geometry.canvas_size(args.aspect_ratio)
    layout = window_layout(window, width, height, text_rows)
    rows_per_frame = (layout.latent_height // 2) * (layout.latent_width // 2)
    print(json.dumps({
        "window": {"start": window.start, "end": window.end, "frames": window.frames, "overlap": window.overlap,
                   "time_offset": window.time_offset},
        "width": width, "height": height, "rows": layout.sequence_length,
        "segments": {"text": text_rows, "guide_video": window.guide_latent_frames * rows_per_frame,
                     "guide_audio": 2 * window.guide_audio_latents, "target_audio": 2 * window.audio_latents,
                     "target_video": window.latent_frames * rows_per_frame},
    }), flush=True)

    cuda = not args.tiny
    if cuda and not torch.cuda.is_available():
        raise SystemExit("No CUDA device: run with --tiny on the CPU.")
    started = time.perf_counter()
    if args.tiny:
        from h3_core.config import TINY_DIT

        config, model = TINY_DIT, build_tiny(args.attention)
    else:
        config = DiTConfig(num_layers=args.layers)
        model = build_real(config, args.attention)
    built = {"built": "tiny" if args.tiny else "real", "layers": config.num_layers,
             "seconds": round(time.perf_counter() - started, 1)}
    if cuda:
        built["weights_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    print(json.dumps(built), flush=True)

    inputs = make_inputs(layout, config, text_rows, "cuda" if cuda else "cpu")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        times = sorted(timed(lambda: model(**inputs), args.repeats, cuda))
    median = times[len(times) // 2]
    result = {
        "impl": "ours", "config": "tiny" if args.tiny else "real", "frames": window.frames,
        "guide_frames": window.overlap, "text_rows": text_rows, "rows": layout.sequence_length,
        "seconds_per_forward_median": round(median, 4), "seconds_all": [round(t, 4) for t in times],
        "torch": torch.__version__,
    }
    if cuda:
        flops = forward_flops(layout.sequence_length) * config.num_layers / 50
        result.update({
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "pflop_per_forward": round(flops / 1e15, 2), "tflops_achieved": round(flops / median / 1e12, 1),
            "device": torch.cuda.get_device_name(),
        })
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
