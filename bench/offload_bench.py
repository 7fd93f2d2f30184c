"""Streamed vs resident DiT steps under a capped GPU, and the planner's estimate against the measured
peak. One JSON line per case. Real config, random weights, T2VA, one forward = one denoise step.

    PYTHONPATH=.:bench python bench/offload_bench.py --caps 24 12

1. resident: every block on the GPU (AdaLN weights on the CPU, tables precomputed), 1344x768 124 f;
   also one block's activation peak per packed row, measured against the planner's per-row figure.
2. planner table: for 4 shapes, the plan for a 24 GiB budget, run streamed without a cap; measured
   peak (allocated and reserved) against the estimate.
3. caps: `set_per_process_memory_fraction` at each cap; the planner picks the placement for the cap;
   seconds per step against resident. An out-of-memory is reported (with the allocator's numbers)
   and the run retried with two fewer resident blocks, so one run always gives numbers.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # streamed blocks fragment less

import torch  # noqa: E402

from dit_forward import build_ours, make_inputs, time_forward  # noqa: E402
from h3_core.config import DiTConfig  # noqa: E402
from h3_core.memory_plan import GIB, activation_bytes, expected_peak, plan_memory  # noqa: E402
from h3_core.offload import stream_blocks  # noqa: E402

SHAPES = {  # name: (width, height, frames, text rows)
    "1344x768_124f": (1344, 768, 124, 512),
    "1344x768_209f": (1344, 768, 209, 512),
    "768x768_124f": (768, 768, 124, 512),
    "1344x768_107f": (1344, 768, 107, 1024),
}


def gib(value: int) -> float:
    return round(value / GIB, 3)


def shape_info(config, shape_name):
    """The packed layout of a shape and its number of distinct timesteps (no model needed)."""
    width, height, frames, text_rows = SHAPES[shape_name]
    layout, inputs = make_inputs(config, frames, text_rows, width, height)
    return layout, int(inputs["timesteps"].numel())


def step_call(model, config, shape_name):
    width, height, frames, text_rows = SHAPES[shape_name]
    layout, inputs = make_inputs(config, frames, text_rows, width, height)
    tables = model.modulation_schedule([inputs["timesteps"]])[0]
    structure = dict(token_tags=layout.token_tags, position_ids=layout.position_ids, video_indices=layout.video_indices,
                     audio_indices=layout.audio_indices, text_indices=layout.text_indices)
    return layout, int(inputs["timesteps"].numel()), (lambda: model(**inputs, **structure, modulation=tables))


def measure(name, model, config, shape_name, repeats, extra):
    torch.cuda.empty_cache()
    layout, _, call = step_call(model, config, shape_name)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        times = sorted(time_forward(call, repeats))
    row = {"case": name, "shape": shape_name, "rows": layout.sequence_length,
           "seconds_per_step": round(times[len(times) // 2], 4), "allocated_before_gib": gib(base),
           "measured_peak_gib": gib(torch.cuda.max_memory_allocated()),
           "measured_peak_reserved_gib": gib(torch.cuda.max_memory_reserved()), **extra}
    if "planner_estimate_gib" in extra:
        row["estimate_error"] = round(extra["planner_estimate_gib"] / row["measured_peak_gib"] - 1, 4)
    print(json.dumps(row), flush=True)
    return row


def block_activation_probe(model, config):
    """One block's peak above its inputs, per packed row, for two row counts (the planner's per-row term)."""
    block = model.blocks[0]
    for shape_name in ("768x768_124f", "1344x768_124f"):
        layout, inputs_k = shape_info(config, shape_name)
        rows = layout.sequence_length
        x = torch.randn(1, rows, config.hidden_size, device="cuda", dtype=torch.bfloat16)
        table = torch.randn(3 * inputs_k, 6 * config.hidden_size, device="cuda", dtype=torch.bfloat16)
        index = torch.zeros(rows, dtype=torch.long, device="cuda")
        from h3_core.dit import rope_tables

        rope = rope_tables(layout.position_ids, model.rope_inv_freq)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            out = block(x, table, index, rope)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        planner = activation_bytes(config, rows, 2) - rows * config.hidden_size * 2  # minus the input x held in base
        print(json.dumps({"probe": "one block activation peak", "shape": shape_name, "rows": rows,
                          "measured_bytes_per_row": round(peak / rows), "planner_bytes_per_row": round(planner / rows),
                          "measured_gib": gib(peak), "planner_gib": gib(planner)}), flush=True)
        del x, out, rope


def parked_tables_check():
    """On the GPU: the sampler with AdaLN weights and tables parked on the CPU equals the plain path."""
    from dataclasses import replace

    from h3_core.layout import build_request_layout
    from h3_core.noise import request_generator, target_noise
    from h3_core.sampler import DualClockSchedule, denoise

    config = replace(DiTConfig(), num_layers=2)
    model = build_ours(config)
    layout = build_request_layout(448, 256, 22, torch.ones(64, dtype=torch.long))
    video, audio = target_noise(layout, request_generator(3), config.in_channels, config.audio_in_channels)
    text = torch.randn(1, 64, config.text_dim, device="cuda", dtype=torch.bfloat16)
    outputs = []
    for offload in (False, True):
        with torch.inference_mode():
            outputs.append(denoise(model, layout, text, video.cuda(), audio.cuda(), DualClockSchedule.build(4),
                                   offload_adaln=offload))
    equal = all(torch.equal(a, b) for a, b in zip(*outputs))
    print(json.dumps({"check": "sampler with parked AdaLN weights and tables == plain", "bitwise_equal": equal}), flush=True)
    del model
    torch.cuda.empty_cache()


def place(model, streamer, resident, prefetch=1):
    """Re-place the blocks: `resident` on the GPU, the rest streamed (all resident: no streamer)."""
    if streamer is not None:
        streamer.remove()
    streamer = stream_blocks(model, "cuda", resident, prefetch) if resident < len(model.blocks) else None
    if streamer is None:
        for block in model.blocks:
            for name, param in block.named_parameters():
                if not name.startswith("adaln_proj."):
                    param.data = param.data.to("cuda")
    torch.cuda.empty_cache()
    return streamer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--caps", type=float, nargs="+", default=[24, 12])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-table", action="store_true")
    args = parser.parse_args()
    parked_tables_check()
    config = DiTConfig()
    total = torch.cuda.get_device_properties(0).total_memory
    model = build_ours(config)
    for module in model.adaln_modules():
        module.to("cpu")
    torch.cuda.empty_cache()

    layout, timesteps = shape_info(config, "1344x768_124f")
    rows_124 = layout.sequence_length
    resident = measure("resident", model, config, "1344x768_124f", args.repeats, {
        "planner_estimate_gib": gib(expected_peak(config, rows_124, 50, 0, True, steps=1, timesteps_per_step=timesteps))})
    block_activation_probe(model, config)

    streamer = None
    if not args.skip_table:
        for shape_name in SHAPES:
            shape_layout, k = shape_info(config, shape_name)
            plan = plan_memory(config, shape_layout.sequence_length, 24 * GIB, steps=1, timesteps_per_step=k)
            streamer = place(model, streamer, plan.resident_blocks, plan.prefetch)
            measure("planner_table_no_cap", model, config, shape_name, 1, {
                "budget_gib": 24, "resident_blocks": plan.resident_blocks,
                "planner_estimate_gib": gib(plan.expected_peak_bytes)})

    for cap in args.caps:
        plan = plan_memory(config, rows_124, int(cap * GIB), steps=1, timesteps_per_step=timesteps)
        resident_blocks = plan.resident_blocks
        for attempt in range(4):
            streamer = place(model, streamer, resident_blocks, plan.prefetch)
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap * GIB / total))
            estimate = expected_peak(config, rows_124, resident_blocks, plan.prefetch, True, steps=1, timesteps_per_step=timesteps)
            try:
                row = measure(f"streamed_cap_{cap:g}gib", model, config, "1344x768_124f", args.repeats, {
                    "cap_gib": cap, "resident_blocks": resident_blocks, "planner_choice": plan.resident_blocks,
                    "planner_estimate_gib": gib(estimate)})
                print(json.dumps({"cap_gib": cap, "resident_blocks": resident_blocks,
                                  "slowdown_vs_resident": round(row["seconds_per_step"] / resident["seconds_per_step"], 4)}), flush=True)
                break
            except torch.OutOfMemoryError as error:
                stats = torch.cuda.memory_stats()
                print(json.dumps({"cap_gib": cap, "resident_blocks": resident_blocks, "oom": str(error).splitlines()[0][:300],
                                  "allocated_gib": gib(stats["allocated_bytes.all.current"]),
                                  "peak_allocated_gib": gib(stats["allocated_bytes.all.peak"]),
                                  "reserved_gib": gib(stats["reserved_bytes.all.current"]),
                                  "planner_estimate_gib": gib(estimate)}), flush=True)
                resident_blocks = max(0, resident_blocks - 2)
            finally:
                torch.cuda.set_per_process_memory_fraction(1.0)


if __name__ == "__main__":
    main()
