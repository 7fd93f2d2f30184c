"""Streamed vs resident DiT steps under a capped GPU, and the planner's estimate against the measured
peak. One JSON line per case. Real config, random weights, T2VA, one forward = one denoise step.

    python bench/offload_bench.py --caps 24 12
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # streamed blocks fragment less

import torch  # noqa: E402

from dit_forward import build_ours, make_inputs, time_forward  # noqa: E402
from h3_core import geometry  # noqa: E402
from h3_core.config import DiTConfig  # noqa: E402
from h3_core.memory_plan import GIB, expected_peak, plan_memory  # noqa: E402
from h3_core.offload import stream_blocks  # noqa: E402

SHAPES = {  # name: (width, height, frames, text rows)
    "1344x768_124f": (1344, 768, 124, 512),
    "1344x768_209f": (1344, 768, 209, 512),
    "768x768_124f": (768, 768, 124, 512),
    "1344x768_107f": (1344, 768, 107, 1024),
}


def step_call(model, config, shape):
    width, height, frames, text_rows = shape
    layout, inputs = make_inputs(config, frames, text_rows, width, height)
    tables = model.modulation_schedule([inputs["timesteps"]])[0]
    structure = dict(token_tags=layout.token_tags, position_ids=layout.position_ids, video_indices=layout.video_indices,
                     audio_indices=layout.audio_indices, text_indices=layout.text_indices)
    return layout, (lambda: model(**inputs, **structure, modulation=tables))


def measure(name, model, config, shape_name, repeats, extra):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    layout, call = step_call(model, config, SHAPES[shape_name])
    with torch.inference_mode():
        times = sorted(time_forward(call, repeats))
    row = {"case": name, "shape": shape_name, "rows": layout.sequence_length,
           "seconds_per_step": round(times[len(times) // 2], 4),
           "measured_peak_gib": round(torch.cuda.max_memory_allocated() / GIB, 3), **extra}
    print(json.dumps(row), flush=True)
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--caps", type=float, nargs="+", default=[24, 12])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    config = DiTConfig()
    total = torch.cuda.get_device_properties(0).total_memory
    model = build_ours(config)
    # Resident baseline (AdaLN weights on the CPU as in every streamed case, tables precomputed).
    for module in model.adaln_modules():
        module.to("cpu")
    resident = measure("resident", model, config, "1344x768_124f", args.repeats, {
        "planner_estimate_gib": round(expected_peak(config, 38_222, 50, 0, True, steps=1, timesteps_per_step=2) / GIB, 3)})
    shape = SHAPES["1344x768_124f"]

    streamer = None
    for cap in args.caps:
        if streamer is not None:
            streamer.remove()
            streamer = None  # drop its pinned copies before the next placement
        for block in model.blocks:  # all home to the GPU, then re-plan under the cap
            block.to("cuda")
        torch.cuda.empty_cache()
        layout, _ = step_call(model, config, shape)
        # Leave 8% of the cap for the allocator's rounding and fragmentation.
        plan = plan_memory(config, layout.sequence_length, int(cap * GIB * 0.92), steps=1,
                           timesteps_per_step=int(layout.to("cpu").row_timesteps(0.5, 0.5)[0].numel()))
        for block in model.blocks[plan.resident_blocks:]:
            block.to("cpu")
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap * GIB / total))
        streamer = stream_blocks(model, "cuda", plan.resident_blocks, plan.prefetch)
        names = ["1344x768_124f"] + ([name for name in SHAPES if name != "1344x768_124f"] if cap == args.caps[0] else [])
        for name in names:
            width, height, frames, text_rows = SHAPES[name]
            rows = geometry.latent_frames(frames) * (width // 32) * (height // 32) + 2 * geometry.audio_latents(frames) + text_rows
            estimate = expected_peak(config, rows, plan.resident_blocks, plan.prefetch, True, steps=1, timesteps_per_step=2)
            row = measure(f"streamed_cap_{cap:g}gib", model, config, name, args.repeats, {
                "resident_blocks": plan.resident_blocks, "planner_estimate_gib": round(estimate / GIB, 3),
            })
            if name == "1344x768_124f":
                print(json.dumps({"cap_gib": cap, "slowdown_vs_resident": round(row["seconds_per_step"] / resident["seconds_per_step"], 4)}), flush=True)
        torch.cuda.set_per_process_memory_fraction(1.0)


if __name__ == "__main__":
    main()
