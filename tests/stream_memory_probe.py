"""Run as a script: write an MP4 from random latents of a given duration with the tiny VAEs and print
the resident memory before decoding and the process peak after, as JSON (used by test_output.py)."""

import json
import resource
import sys

import torch

from h3_core import geometry
from h3_core.output import AVLatents, write_mp4
from h3_core.runtime import return_freed_memory_to_os
from h3_core.tiny import tiny_random_audio_vae, tiny_random_video_vae


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    """This process's own high-water mark (VmHWM). Not getrusage's ru_maxrss: Linux carries that over
    exec from the forking parent, so a probe started by a large pytest process would report its size."""
    with open("/proc/self/status") as handle:
        line = next(line for line in handle if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def main(seconds: float, width: int, height: int, path: str) -> None:
    torch.set_num_threads(1)
    return_freed_memory_to_os()  # what the `h3` command does at start
    frames = geometry.frames_for_duration(seconds)
    video = torch.randn(1, 24, geometry.latent_frames(frames), height // 16, width // 16, generator=torch.Generator().manual_seed(0))
    audio = torch.randn(2, 32, geometry.audio_latents(frames), generator=torch.Generator().manual_seed(1))
    video_vae, audio_vae = tiny_random_video_vae(), tiny_random_audio_vae()
    # Warm the decoders once on the smallest clip so lazy allocations are part of the baseline.
    write_mp4(path, AVLatents(video[:, :, :7], audio[:, :, : geometry.audio_latents(22)]), video_vae, audio_vae)
    before = rss_bytes()
    write_mp4(path, AVLatents(video, audio), video_vae, audio_vae)
    peak = peak_rss_bytes()
    print(json.dumps({"frames": frames, "rss_before": before, "peak": peak}))


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
