"""Host memory and seconds to encode a video file of your own into H3 latents (H3 VAE Encode given a Load
Video VIDEO, `h3 encode`) at the real VAE sizes (seeded random weights): streamed, the file decoded and
encoded 17 frames at a time (now), against the file read whole onto the canvas and then encoded (before).
Each case runs in a process of its own, so its peak resident memory is its own; both must give the same
latents. One JSON line each.

    python bench/clip_file_encode.py --seconds 60 [--source 1920x1080] [--width 1344 --height 768]
    python bench/clip_file_encode.py --seconds 2 --source 320x240 --width 256 --height 256 --device cpu  # smoke
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
from full_pipeline import host_rss_bytes  # bench/ is on the path when a script here runs

GIB = 1 << 30


def rss_gib() -> float:
    """This process's resident memory now, GiB."""
    return host_rss_bytes() / GIB


class PeakRss:
    """The largest resident memory this process reaches while the `with` block runs (sampled every 5 ms)."""

    def __enter__(self) -> PeakRss:
        self.peak, self._done = rss_gib(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.005):
            self.peak = max(self.peak, rss_gib())

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, rss_gib())


def write_source(path: Path, seconds: float, width: int, height: int) -> None:
    """A synthetic clip with sound, written a second at a time: a moving gradient with a little noise (so the
    encoder has detail to keep) and a tone."""
    from h3_core.media_write import Mp4Writer

    rng = np.random.default_rng(0)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    with Mp4Writer(path, preset="ultrafast") as writer:
        for second in range(int(seconds)):
            block = []
            for index in range(24):
                t = second * 24 + index
                red = (xs + 4 * t) % 256
                green = (ys + 2 * t) % 256
                blue = (xs + ys + 6 * t) % 256
                frame = np.stack([red, green, blue], -1) + rng.normal(0, 4, (height, width, 1)).astype(np.float32)
                block.append(np.clip(frame, 0, 255).astype(np.uint8))
            writer.write_video_frames(np.stack(block))
            tone = np.sin(2 * np.pi * 220 * (second + np.arange(32000) / 32000)).astype(np.float32) * 0.2
            writer.write_audio(np.stack([tone, tone]))


def run_case(case: str, path: Path, width: int, height: int, out: Path, device: torch.device) -> None:
    """One encode in this process; prints its JSON line and saves the latents to `out`."""
    from h3_core.clip_latents import encode_clip, encode_clip_frames, file_soundtrack, stream_clip
    from h3_core.media_read import read_video
    from h3_core.output import AVLatents
    from h3_core.references import RELEASE_CANVAS, frame_on_canvas
    from h3_core.tiny import seeded_random_weights
    from h3_core.vae_audio import AudioVAE, AudioVAEConfig
    from h3_core.vae_video import VideoVAE, VideoVAEConfig

    cuda = device.type == "cuda"
    video_vae = seeded_random_weights(VideoVAE(VideoVAEConfig()), 1).set_dtype(torch.bfloat16 if cuda else torch.float32)
    video_vae = video_vae.to(device).eval().requires_grad_(False)
    audio_vae = seeded_random_weights(AudioVAE(AudioVAEConfig()), 2, gain=0.5).to(device).eval().requires_grad_(False)
    if cuda:
        torch.cuda.synchronize()
    base = rss_gib()
    clock = time.perf_counter()
    with PeakRss() as rss:
        if case == "streamed":
            frames, _, _ = stream_clip(path, RELEASE_CANVAS, width, height)
            latents: AVLatents = encode_clip_frames(video_vae, audio_vae, frames, file_soundtrack(path))
        else:
            clip = read_video(path, fit=lambda frame: frame_on_canvas(frame, width, height))
            latents = encode_clip(video_vae, audio_vae, clip.frames, 24.0, width, height, clip.audio, 32000)
        if cuda:
            torch.cuda.synchronize()
    seconds = time.perf_counter() - clock
    peak = rss.peak
    latents.save(out)
    print(json.dumps({"case": case, "frames": latents.num_frames, "seconds": round(seconds, 2),
                      "host_rss_before_gib": round(base, 2), "host_peak_rss_gib": round(peak, 2),
                      "host_peak_above_before_gib": round(peak - base, 2),
                      "gpu_peak_gib": round(torch.cuda.max_memory_allocated() / GIB, 2) if cuda else None}),
          flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--source", default="1920x1080", help="the file's frame size, WIDTHxHEIGHT")
    parser.add_argument("--width", type=int, default=1344)
    parser.add_argument("--height", type=int, default=768)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--case", choices=["streamed", "whole"], help="(internal) run one case in this process")
    parser.add_argument("--file", type=Path, help="(internal) the source file")
    parser.add_argument("--latents", type=Path, help="(internal) where the case saves its latents")
    args = parser.parse_args()
    if args.case:
        run_case(args.case, args.file, args.width, args.height, args.latents, torch.device(args.device))
        return
    source_width, source_height = (int(n) for n in args.source.split("x"))
    path = Path(f"/tmp/h3_bench_clip_{args.seconds:g}s_{args.source}.mp4")
    if not path.is_file():
        clock = time.perf_counter()
        write_source(path, args.seconds, source_width, source_height)
        print(json.dumps({"wrote": str(path), "seconds": round(time.perf_counter() - clock, 1)}), flush=True)
    saved = {}
    for case in ("streamed", "whole"):
        saved[case] = Path(f"/tmp/h3_bench_clip_{case}.safetensors")
        subprocess.run([sys.executable, __file__, "--case", case, "--file", str(path), "--latents", str(saved[case]),
                        "--width", str(args.width), "--height", str(args.height), "--device", args.device], check=True)
    from safetensors.torch import load_file

    streamed, whole = load_file(str(saved["streamed"])), load_file(str(saved["whole"]))
    print(json.dumps({"equal": all(torch.equal(streamed[key], whole[key]) for key in ("video", "audio"))}), flush=True)


if __name__ == "__main__":
    main()
