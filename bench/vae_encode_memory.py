"""Device memory an encode needs besides the VAE weights (H3 VAE Encode, keyframes and references), measured
against `vae_video.encode_working_bytes` / `vae_audio.encode_working_bytes`, at the real VAE sizes with seeded
random weights. One JSON line per case: peak allocated less the weights, the bound, and whether it holds.

    python bench/vae_encode_memory.py [--cudnn-benchmark]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from h3_core.clip_latents import encode_clip_frames
from h3_core.tiny import seeded_random_weights
from h3_core.vae_audio import AudioVAE, AudioVAEConfig
from h3_core.vae_audio import encode_working_bytes as audio_bound
from h3_core.vae_video import VideoVAE, VideoVAEConfig, frames_to_model_space
from h3_core.vae_video import encode_working_bytes as video_bound

GIB = 2**30
# (frames, width, height, tiled): 17-frame clips (H3 VAE Encode) and single frames (keyframes, image references)
VIDEO_CASES = [
    (17, 1344, 768, True), (17, 768, 1344, True), (17, 992, 992, True), (17, 512, 512, True),
    (17, 1984, 512, True), (17, 320, 320, True), (17, 512, 512, False), (17, 1344, 768, False),
    (1, 1344, 768, True), (1, 768, 1344, True), (1, 512, 512, True), (1, 1344, 768, False), (1, 320, 320, False),
    (9, 1344, 768, True),
]
AUDIO_SECONDS = [5.2, 20.0, 120.0]


def measure(work):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    clock = time.perf_counter()
    try:
        result = work()
    except (torch.OutOfMemoryError, RuntimeError) as error:  # RuntimeError: past 32-bit indexing, untiled
        return str(error).splitlines()[0], time.perf_counter() - clock, None
    torch.cuda.synchronize()
    return result, time.perf_counter() - clock, torch.cuda.max_memory_allocated() - base


def report(case: dict, seconds: float, used: int | None, bound: int, failed=None) -> None:
    line = {**case, "seconds": round(seconds, 3), "bound_gib": round(bound / GIB, 3)}
    if used is None:
        line["failed"] = failed
    else:
        line.update(used_gib=round(used / GIB, 3), bound_over_used=round(bound / used, 3), holds=bound >= used)
    print(json.dumps(line), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cudnn-benchmark", action="store_true", help="as a host that sets it (cuDNN autotunes)")
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    config = VideoVAEConfig()
    video_vae = seeded_random_weights(VideoVAE(config), 1).set_dtype(torch.bfloat16).cuda().eval()
    audio_vae = seeded_random_weights(AudioVAE(AudioVAEConfig()), 2, gain=0.5).cuda().eval()
    video_vae.requires_grad_(False)
    audio_vae.requires_grad_(False)
    rng = np.random.default_rng(0)
    for frames, width, height, tiled in VIDEO_CASES:
        clip = torch.from_numpy(rng.integers(0, 256, (1, 3, frames, height, width), dtype=np.uint8))
        failed, seconds, used = measure(lambda: video_vae.encode_moments(clip, tiled, frames_to_model_space))
        report({"case": "video clip", "frames": frames, "width": width, "height": height, "tiled": tiled,
                "cudnn_benchmark": args.cudnn_benchmark}, seconds, used,
               video_bound(config, frames, height, width, tiled), failed)
    for seconds_of_sound in AUDIO_SECONDS:
        track = torch.randn(2, int(seconds_of_sound * 32000), device="cuda") * 0.1
        _, seconds, used = measure(lambda: audio_vae.encode(track))
        report({"case": "audio track", "sound_seconds": seconds_of_sound}, seconds, used,
               audio_bound(audio_vae.config, track.shape[-1]))
        del track
    # H3 VAE Encode's whole path: 5 s of frames streamed in, 17 at a time, then the (silent) sound
    count = 124
    frames = (rng.integers(0, 256, (768, 1344, 3), dtype=np.uint8) for _ in range(count))
    _, seconds, used = measure(lambda: encode_clip_frames(video_vae, audio_vae, frames))
    bound = max(video_bound(config, count, 768, 1344), audio_bound(audio_vae.config, count * 32000 // 24))
    report({"case": "encode_clip_frames", "frames": count, "width": 1344, "height": 768}, seconds, used, bound)


if __name__ == "__main__":
    main()
