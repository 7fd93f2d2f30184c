"""The engine's multi-GPU path as users reach it (`pipeline.generate` with `devices`, i.e. `h3 generate
--devices`): ParallelRunner worker processes over NCCL, against one device. Tiny random model in bf16,
so it proves the plumbing and the results, not the speed (bench/multi_gpu.py times the real config).

Prints one JSON line per case: seconds and the largest difference of the latents from one device's.

    python bench/parallel_runner_check.py --devices cuda:0,cuda:1
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing
from h3_core import pipeline  # noqa: E402
from h3_core.conditioning import Request  # noqa: E402


def run(folder: Path, name: str, **settings):
    request = Request("t2va", "a fox trots along the beach at sunset", duration=4)
    started = time.perf_counter()
    (result,) = pipeline.generate(request, "tiny-random", pipeline.GenerateSettings(steps=6, **settings),
                                  out=folder / f"{name}.mp4", save_latents=folder / f"{name}.safetensors")
    return result, time.perf_counter() - started


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cuda:0,cuda:1")
    args = parser.parse_args()
    devices = [d.strip() for d in args.devices.split(",")]
    cases = [("split", dict(devices=devices)), ("split_sharded", dict(devices=devices, shard_weights=True)),
             ("split_compiled", dict(devices=devices, compile=True))]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        single, seconds = run(folder, "single", device=devices[0])
        print(json.dumps({"case": "one_device", "device": devices[0], "seconds": round(seconds, 1)}), flush=True)
        for name, settings in cases:
            try:
                result, seconds = run(folder, name, device=devices[0], **settings)
            except Exception as error:  # noqa: BLE001  a check reports and goes on
                print(json.dumps({"case": name, "error": f"{type(error).__name__}: {error}"[:2000]}), flush=True)
                continue
            diffs = {kind: (getattr(result.latents, kind).float() - getattr(single.latents, kind).float()).abs().max().item()
                     for kind in ("video", "audio")}
            print(json.dumps({"case": name, "devices": devices, "seconds": round(seconds, 1),
                              "max_abs_diff_vs_one_device": diffs, "mp4_bytes": result.video_path.stat().st_size,
                              "latent_max_abs": single.latents.video.abs().max().item()}), flush=True)


if __name__ == "__main__":
    main()
