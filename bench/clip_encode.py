"""Seconds and peak GPU memory to encode a clip of your own into H3 latents (H3 VAE Encode, `h3 encode`) at
the real VAE sizes (seeded random weights), and the same video encode the way it ran before: the whole
clip moved to the GPU and put in model space at once. Both must give the same latents. One JSON line each.

    python bench/clip_encode.py --frames 722 [--width 1344 --height 768]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from h3_core.clip_latents import encode_clip
from h3_core.tiny import seeded_random_weights
from h3_core.vae_audio import AudioVAE, AudioVAEConfig
from h3_core.vae_video import (
    CONDITION_ENCODE_SEED, VideoVAE, VideoVAEConfig, fp16_round_trip, frames_to_model_space,
)
from vae_decode import GIB, timed  # bench/ is on the path when a script here runs


def whole_clip_on_device(vae: VideoVAE, frames: np.ndarray) -> torch.Tensor:
    """The encode as it ran before: every frame on the GPU in model space, then 17-frame clips."""
    pixels = torch.from_numpy(frames).permute(3, 0, 1, 2)[None].cuda()
    posterior = vae.encode(frames_to_model_space(pixels))
    latents = posterior.sample(torch.Generator().manual_seed(CONDITION_ENCODE_SEED))
    return vae.normalize_latents(fp16_round_trip(latents)).cpu()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, default=722, help="17n + 5 frames at 24 fps (722 = 30 s)")
    parser.add_argument("--width", type=int, default=1344)
    parser.add_argument("--height", type=int, default=768)
    args = parser.parse_args()
    frames = np.random.default_rng(0).integers(0, 256, (args.frames, args.height, args.width, 3), dtype=np.uint8)
    sound = np.random.default_rng(1).standard_normal((2, args.frames * 32000 // 24)).astype(np.float32) * 0.1
    video_vae = seeded_random_weights(VideoVAE(VideoVAEConfig()), 1).set_dtype(torch.bfloat16)
    video_vae = video_vae.cuda().eval().requires_grad_(False)
    audio_vae = seeded_random_weights(AudioVAE(AudioVAEConfig()), 2, gain=0.5).cuda().eval().requires_grad_(False)
    weights = torch.cuda.memory_allocated() / GIB

    latents, seconds, peak = timed(lambda: encode_clip(video_vae, audio_vae, frames, 24.0, args.width, args.height,
                                                       sound, 32000))
    print(json.dumps({"case": "encode_clip (clip by clip)", "frames": args.frames, "seconds": round(seconds, 2),
                      "peak_gib": round(peak, 2), "vae_weights_gib": round(weights, 2),
                      "video": list(latents.video.shape), "audio": list(latents.audio.shape)}), flush=True)
    before, seconds, peak = timed(lambda: whole_clip_on_device(video_vae, frames))
    print(json.dumps({"case": "video, whole clip on the GPU (before)", "frames": args.frames,
                      "seconds": round(seconds, 2), "peak_gib": round(peak, 2),
                      "equal": bool(torch.equal(before, latents.video))}), flush=True)


if __name__ == "__main__":
    main()
