"""Seconds per DiT forward on one GPU and split over P GPUs (sequence parallel over the packed rows,
optionally with FSDP-style sharded weights), at the real config with random weights, real shapes.

One process per GPU (torch.multiprocessing spawn, NCCL). Rank 0 first times the plain single-GPU
forward while the others wait; then all ranks time the sequence-parallel forward (and, with
--sharded, again after sharding the blocks). AdaLN tables are precomputed, as the sampler does. Each
timing is the slowest rank's, after a warm-up. Prints one JSON line per case, with the speedup over
one GPU, the peak memory of every rank, and the largest difference from the single-GPU output.

    python bench/multi_gpu.py --gpus 2 [--sharded] [--compile] [--frames 124] [--text-rows 512] [--attention flash3]
    python bench/multi_gpu.py --gpus 4 --compile --attention flash3-fp8-lossy --linears fp8-lossy   # lossy
    python bench/multi_gpu.py --gpus 2 --compile --vsa 0.8   # FastH3 8-Step V2's model: Video Sparse Attention
    python bench/multi_gpu.py --tiny      # CPU, gloo, a tiny model: the plumbing and exactness
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

from h3_core import geometry  # noqa: E402
from h3_core.config import TINY_DIT, DiTConfig  # noqa: E402
from h3_core.dit import H3DiT, rope_inverse_frequencies  # noqa: E402
from h3_core.fp8 import apply_linear_mode  # noqa: E402
from h3_core.layout import build_request_layout  # noqa: E402
from h3_core.parallel import sequence, sharding  # noqa: E402
from h3_core.sampler import sigma_ladder  # noqa: E402
from h3_core.tiny import TINY_SEED, seeded_random_weights  # noqa: E402


def build(config: DiTConfig, device: torch.device) -> H3DiT:
    """Random weights made directly on the device; the same on every rank (same seed, same op order)."""
    if device.type == "cpu":
        return seeded_random_weights(H3DiT(config), TINY_SEED).eval().requires_grad_(False)
    with torch.device("meta"):
        model = H3DiT(config)
    model.set_dtype(torch.bfloat16)
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    model.rope_inv_freq = rope_inverse_frequencies(config).to(device)
    return model.eval().requires_grad_(False)


def make_inputs(model: H3DiT, width: int, height: int, frames: int, text_rows: int, device: torch.device) -> dict:
    """A T2VA step's forward arguments (step 10 of 50), drawn on the CPU so every rank has the same."""
    config = model.config
    layout = build_request_layout(width, height, frames, torch.ones(text_rows, dtype=torch.long))
    t_video, t_audio = 1.0 - float(sigma_ladder(50, 12.0)[10]), 1.0 - float(sigma_ladder(50, 3.0)[10])
    timesteps, indices = layout.row_timesteps(t_video, t_audio)
    g = torch.Generator().manual_seed(0)
    inputs = dict(
        video_rows=torch.randn(1, layout.video_indices.numel(), config.video_patch_dim, generator=g),
        audio_rows=torch.randn(1, layout.audio_indices.numel(), config.audio_in_channels, generator=g),
        text_states=torch.randn(1, text_rows, config.text_dim, generator=g).to(model.dtype),
        timesteps=timesteps, timestep_indices=indices, token_tags=layout.token_tags,
        position_ids=layout.position_ids, video_indices=layout.video_indices,
        audio_indices=layout.audio_indices, text_indices=layout.text_indices,
    )
    inputs = {name: tensor.to(device) for name, tensor in inputs.items()}
    if model.sparse_attention is not None:
        inputs["sparse_tiles"] = layout.vsa_tiles(device)
    with torch.inference_mode():
        inputs["modulation"] = model.modulation(inputs["timesteps"])
    return inputs, layout.sequence_length


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward(model, inputs, device, repeats: int, warmup: int, group=None) -> tuple[list[float], tuple]:
    """Seconds per forward; with a group, each iteration's time is the slowest rank's."""
    with torch.inference_mode():
        for _ in range(warmup):
            out = model(**inputs)
        times = []
        for _ in range(repeats):
            sync(device)
            if group is not None:
                dist.barrier(group=group)
            start = time.perf_counter()
            out = model(**inputs)
            sync(device)
            times.append(time.perf_counter() - start)
    if group is not None:
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        times = slowest.tolist()
    return times, out


def peak_gib(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def rank_main(rank: int, args, init_method: str) -> None:
    world = args.gpus
    if args.tiny:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        config = dataclasses.replace(TINY_DIT, num_attention_heads=4, vsa_gates=args.vsa is not None)
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        config = DiTConfig(num_layers=args.layers, vsa_gates=args.vsa is not None)
    dist.init_process_group("gloo" if args.tiny else "nccl", init_method=init_method, rank=rank, world_size=world)
    cpu = dist.new_group(backend="gloo")  # waits and small exchanges that must not spin a GPU
    started = time.perf_counter()
    model = build(config, device)
    if args.linears != "checkpoint":
        apply_linear_mode(model, args.linears, device)
    backend = model.set_attention_backend(args.attention)
    if args.vsa is not None:
        model.set_sparse_attention(args.vsa)
        backend = f"vsa {args.vsa:g} (flex)"
    if args.compile:
        model.compile_blocks()  # the one-GPU and the sequence-parallel forward each compile once, in the warm-up
    width, height = (args.width, args.height) if args.tiny else geometry.canvas_size(args.aspect_ratio)
    inputs, rows = make_inputs(model, width, height, args.frames, args.text_rows, device)
    common = {"width": width, "height": height, "frames": args.frames, "text_rows": args.text_rows, "rows": rows,
              "layers": config.num_layers, "attention": backend, "linears": args.linears, "compiled": args.compile, "torch": torch.__version__,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    if rank == 0:
        print(json.dumps({"built": round(time.perf_counter() - started, 1), **common}), flush=True)

    single = None
    if rank == 0:
        reset_peak(device)
        times, single = time_forward(model, inputs, device, args.repeats, args.warmup)
        one_gpu = statistics.median(times)
        print(json.dumps({"mode": "one_gpu", "gpus": 1, "seconds_per_forward_median": round(one_gpu, 4),
                          "seconds_all": [round(t, 4) for t in times], "peak_gib": peak_gib(device), **common}), flush=True)
    dist.barrier(group=cpu)

    cases = [("sequence_parallel", False)] + ([("sequence_parallel_sharded", True)] if args.sharded else [])
    for mode, shard in cases:
        if shard:
            sharding.shard_blocks(model, dist.new_group(), device)
            with torch.inference_mode():  # the tables again, through the sharded AdaLN projections
                inputs["modulation"] = model.modulation(inputs["timesteps"])
            if device.type == "cuda":
                torch.cuda.empty_cache()
        sequence.enable(model)
        reset_peak(device)
        times, out = time_forward(model, inputs, device, args.repeats, args.warmup, group=cpu)
        sequence.disable(model)
        peaks = [None] * world
        dist.all_gather_object(peaks, {"rank": rank, "peak_gib": peak_gib(device),
                                       "resident_gib": round(torch.cuda.memory_allocated(device) / 2**30, 2)
                                       if device.type == "cuda" else None}, group=cpu)
        if rank == 0:
            seconds = statistics.median(times)
            diff = [float((a.float() - b.float()).abs().max()) for a, b in zip(out, single)]
            print(json.dumps({
                "mode": mode, "gpus": world, "seconds_per_forward_median": round(seconds, 4),
                "seconds_all": [round(t, 4) for t in times], "speedup_vs_one_gpu": round(one_gpu / seconds, 3),
                "max_abs_diff_vs_one_gpu": {"video": diff[0], "audio": diff[1]}, "ranks": peaks, **common,
            }), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2, help="ranks (a divisor of 56 heads: 2, 4, 7, 8)")
    parser.add_argument("--sharded", action="store_true", help="also time with FSDP-style sharded block weights")
    parser.add_argument("--frames", type=int, default=124)
    parser.add_argument("--text-rows", type=int, default=512)
    parser.add_argument("--aspect-ratio", default="16:9", help="canvas (16:9 = 1344x768)")
    parser.add_argument("--layers", type=int, default=50, help="fewer blocks for a quick check")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--linears", default="checkpoint", help="block linears, as h3 generate's (fp8-lossy: e4m3)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the repeated block")
    parser.add_argument("--vsa", type=float, default=None, metavar="SPARSITY",
                        help="FastH3 8-Step V2's model: a VSA gate in every block, Video Sparse Attention at SPARSITY")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="CPU + gloo with a tiny 4-head model (no GPU needed)")
    parser.add_argument("--width", type=int, default=128, help="--tiny canvas")
    parser.add_argument("--height", type=int, default=64, help="--tiny canvas")
    args = parser.parse_args()
    if not args.tiny and torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"--gpus {args.gpus} needs {args.gpus} CUDA devices; {torch.cuda.device_count()} visible.")
    with tempfile.TemporaryDirectory(prefix="h3-bench-") as folder:
        mp.spawn(rank_main, args=(args, "file://" + os.path.join(folder, "store")), nprocs=args.gpus)


if __name__ == "__main__":
    main()
