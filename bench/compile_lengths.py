"""Compiled forwards at several sequence lengths (prompts of other lengths) in one process, at the real config with
random weights: the first forward at each length (a compile, if a new graph is needed) and the median of the next
`--repeats`. `--static` compiles a graph per length instead of marking the row count dynamic (h3_core.dit's
compiled blocks before session 51). One JSON line per length.

    python bench/compile_lengths.py --frames 124 --text-rows 512 300 700 [--static] [--attention sdpa]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dit_forward import build_ours, make_inputs, time_forward
from h3_core.config import DiTConfig


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=124)
    parser.add_argument("--text-rows", type=int, nargs="+", default=[512, 300, 700])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=50)
    parser.add_argument("--attention", default="sdpa")
    parser.add_argument("--static", action="store_true", help="a graph per length (no dynamic row count)")
    args = parser.parse_args()
    if args.static:
        torch._dynamo.maybe_mark_dynamic = lambda *a, **k: None
    config = DiTConfig(num_layers=args.layers)
    model = build_ours(config)
    model.set_attention(args.attention)
    model.compile_blocks()
    from torch._dynamo.utils import counters

    for text_rows in args.text_rows:
        layout, inputs = make_inputs(config, args.frames, text_rows, 1344, 768)
        structure = dict(token_tags=layout.token_tags, position_ids=layout.position_ids,
                         video_indices=layout.video_indices, audio_indices=layout.audio_indices,
                         text_indices=layout.text_indices)
        call = lambda: model(**inputs, **structure)  # noqa: E731
        with torch.inference_mode():
            torch.cuda.synchronize()
            start = time.perf_counter()
            call()
            torch.cuda.synchronize()
            first = time.perf_counter() - start
            times = sorted(time_forward(call, args.repeats))
        print(json.dumps({"static": args.static, "frames": args.frames, "text_rows": text_rows,
                          "rows": layout.sequence_length, "first_forward_s": round(first, 2),
                          "seconds_per_forward_median": round(times[len(times) // 2], 4),
                          "seconds_all": [round(t, 4) for t in times], "graphs": counters["stats"]["unique_graphs"],
                          "attention": args.attention, "torch": torch.__version__,
                          "device": torch.cuda.get_device_name()}), flush=True)


if __name__ == "__main__":
    main()
