"""Seconds to decode a clip's latents at the real VAE sizes, float32 against the reference's precision.

The release's video VAE is float32. Diffusers' pipeline loads it with `dtype=torch.bfloat16`, which
(through `_keep_in_fp32_modules`) keeps the encoder, norms and layer scales float32 and runs the
decoder's linears in bf16; the audio VAE stays float32 whole. This times `decode_video` (the streamed,
tiled decode `write_mp4` uses) with the decoder in each precision on the same seeded random weights and
latents, compares the uint8 frames, and sets the peak memory beside `decode_working_bytes`' bound.
Prints one JSON line per case.

    python bench/vae_decode.py --frames 124 [--width 1344 --height 768] [--dtypes fp32 bf16]
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch

from h3_core import geometry
from h3_core.output import decode_audio, decode_video
from h3_core.tiny import seeded_random_weights
from h3_core.vae_audio import AudioVAE, AudioVAEConfig
from h3_core.vae_video import VideoVAE, VideoVAEConfig, decode_working_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GIB = 1024**3


def timed(work):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    clock = time.perf_counter()
    result = work()
    torch.cuda.synchronize()
    return result, time.perf_counter() - clock, torch.cuda.max_memory_allocated() / GIB


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, default=124)
    parser.add_argument("--width", type=int, default=1344)
    parser.add_argument("--height", type=int, default=768)
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    args = parser.parse_args()
    latent_frames = geometry.latent_frames(args.frames)
    video = torch.randn(1, 24, latent_frames, args.height // 16, args.width // 16, generator=torch.Generator().manual_seed(0))
    audio_rows = geometry.audio_latents(args.frames)
    audio = torch.randn(2, 32, audio_rows, generator=torch.Generator().manual_seed(1))

    audio_vae = seeded_random_weights(AudioVAE(AudioVAEConfig()), 2, gain=0.5).cuda().eval().requires_grad_(False)
    _, seconds, peak = timed(lambda: list(decode_audio(audio_vae, audio)))
    print(json.dumps({"case": "audio fp32", "audio_latents": audio_rows, "seconds": round(seconds, 3),
                      "peak_gib": round(peak, 2)}), flush=True)
    del audio_vae

    master = seeded_random_weights(VideoVAE(VideoVAEConfig()), 1).eval().requires_grad_(False)  # fp32, CPU
    frames = {}
    for name in args.dtypes:
        vae = copy.deepcopy(master).set_dtype(DTYPES[name]).cuda()
        list(decode_video(vae, video[:, :, :7]))  # warm-up: one chunk
        blocks, seconds, peak = timed(lambda: list(decode_video(vae, video)))
        frames[name] = torch.cat(blocks)
        weights = sum(t.numel() * t.element_size() for t in vae.parameters()) / GIB
        estimate = decode_working_bytes(vae.config, latent_frames, args.height // 16, args.width // 16,
                                        vae.decoder.proj_out.weight.element_size()) / GIB
        row = {"case": f"video decoder {name}", "frames": frames[name].shape[0], "latent_frames": latent_frames,
               "seconds": round(seconds, 3), "peak_gib": round(peak, 2), "weights_gib": round(weights, 2),
               "working_gib_measured": round(peak - weights, 2), "working_gib_estimate": round(estimate, 2)}
        if name != args.dtypes[0]:
            base = frames[args.dtypes[0]].float()
            diff = (frames[name].float() - base).abs()
            mse = (diff**2).mean().item()
            row.update({"vs": args.dtypes[0], "mean_abs_diff_255": round(diff.mean().item(), 4),
                        "max_abs_diff_255": int(diff.max().item()),
                        "psnr_db": round(10 * torch.log10(torch.tensor(255.0**2 / max(mse, 1e-12))).item(), 2)})
        print(json.dumps(row), flush=True)
        raw = vae.denormalize_latents(video.cuda())  # the decode alone, blocks leaving as they come
        _, seconds, peak = timed(lambda: [block.cpu() for block in vae.decode_stream(raw)])
        print(json.dumps({"case": f"video decoder {name}, decode_stream only", "seconds": round(seconds, 3),
                          "working_gib_measured": round(peak - weights, 2)}), flush=True)
        del vae, raw
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
