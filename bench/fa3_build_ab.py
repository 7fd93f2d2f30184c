"""FlashAttention 3's forward alone at H3's shapes (56 heads x 128, bf16, full attention), for comparing
builds: run it once per build (PYTHONPATH pointing at that build's flash_attn_3), interleaving builds.

    PYTHONPATH=BUILD_DIR python bench/fa3_build_ab.py NAME --sm-margins 0,4,8,12,16,20 --rows 38222 38400 63704

Prints one JSON line per row count: ms per call (the best of two rounds of 8 calls) for each `sm_margin` (SMs
left out of FA3's persistent grid), and the largest |difference| to SDPA over the first and last 2,048
query rows. bench/RESULTS.md ("FlashAttention 3 with 4-CTA clusters") says how the compared builds were made.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F


def sdpa_rows(q, k, v, rows: slice) -> torch.Tensor:
    return F.scaled_dot_product_attention(q[:, rows].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def time_call(call, repeats: int = 8) -> float:
    for _ in range(2):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="the build's name, echoed in the output")
    parser.add_argument("--sm-margins", default="0", help="comma-separated sm_margin values")
    parser.add_argument("--rows", type=int, nargs="+", default=[38222, 38400, 63704])
    args = parser.parse_args()
    import flash_attn_interface  # the build under test (after --help, which needs none)
    margins = [int(m) for m in args.sm_margins.split(",")]
    torch.manual_seed(0)
    for rows in args.rows:
        q, k, v = (torch.randn(1, rows, 56, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        edges = (slice(0, 2048), slice(rows - 2048, rows))
        references = [sdpa_rows(q, k, v, edge).float() for edge in edges]
        line = {"build": args.name, "rows": rows}
        for _ in range(2):  # two rounds over the margins, interleaved
            for margin in margins:
                call = lambda: flash_attn_interface.flash_attn_func(q, k, v, sm_margin=margin)  # noqa: E731
                ms = time_call(call)
                out = call()
                out = out[0] if isinstance(out, tuple) else out
                error = max((out[:, edge].float() - ref).abs().max().item() for edge, ref in zip(edges, references))
                line[f"ms_margin_{margin}"] = round(min(line.get(f"ms_margin_{margin}", float("inf")), ms), 3)
                line["max_abs_diff"] = max(line.get("max_abs_diff", 0.0), error)
        print(json.dumps(line), flush=True)
        del q, k, v, references


if __name__ == "__main__":
    main()
