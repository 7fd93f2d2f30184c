"""Where a real-size DiT forward spends its time, and what the optional speed paths change.

One JSON line per variant (eager, precomputed AdaLN tables, torch.compile'd blocks) with seconds per
forward and the max abs difference of its outputs from the eager ones; the top CUDA kernels of one
eager forward go to $OUT/profile.txt (or ./profile.txt), of one compiled forward to profile_compiled.txt.

    python bench/dit_profile.py --frames 124 --text-rows 512 [--attention auto]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from dit_forward import build_ours, make_inputs, time_forward
from h3_core import geometry
from h3_core.config import DiTConfig


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, default=124)
    parser.add_argument("--text-rows", type=int, default=512)
    parser.add_argument("--layers", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile-mode", default="default")
    parser.add_argument("--attention", default="sdpa", help="attention backend (auto = fastest exact here)")
    args = parser.parse_args()
    config = DiTConfig(num_layers=args.layers)
    width, height = geometry.canvas_size("16:9")
    model = build_ours(config)
    print(json.dumps({"attention": model.set_attention_backend(args.attention)}), flush=True)
    layout, inputs = make_inputs(config, args.frames, args.text_rows, width, height)
    structure = dict(token_tags=layout.token_tags, position_ids=layout.position_ids, video_indices=layout.video_indices,
                     audio_indices=layout.audio_indices, text_indices=layout.text_indices)
    out_dir = os.environ.get("OUT", ".")

    def report(name, call, reference=None):
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            times = sorted(time_forward(call, args.repeats))
            out = call()
        diff = None if reference is None else max((a - b).abs().max().item() for a, b in zip(out, reference))
        print(json.dumps({"variant": name, "frames": args.frames, "rows": layout.sequence_length,
                          "seconds_per_forward_median": round(times[len(times) // 2], 4),
                          "max_abs_diff_vs_eager": diff, "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}),
              flush=True)
        return out

    eager = report("eager", lambda: model(**inputs, **structure))
    with torch.inference_mode():
        tables = model.modulation(inputs["timesteps"])
    report("precomputed_adaln", lambda: model(**inputs, **structure, modulation=tables), eager)

    def profile(name):
        with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            model(**inputs, **structure)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90)
        with open(os.path.join(out_dir, name), "w") as handle:
            handle.write(table)
        print(table[:6000], flush=True)

    profile("profile.txt")
    model.compile_blocks(args.compile_mode)
    report("compiled_blocks", lambda: model(**inputs, **structure), eager)
    profile("profile_compiled.txt")


if __name__ == "__main__":
    main()
