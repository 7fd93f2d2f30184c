"""One attention call of FastH3 8-Step V2's Video Sparse Attention (h3_core/sparse_attention.py, FlexAttention
kernel) against the dense exact kernels, at the real size: T2VA 1344x768, 124 frames, 512 text rows, 56 heads x
128, bf16, random inputs. One JSON line per case; the sparse output's largest difference to the masked dense
reference on a cut of the same inputs is printed too.

    python bench/vsa_attention.py --sparsity 0.8 0.9
"""

from __future__ import annotations

import argparse
import json

import torch

from dit_forward import time_forward
from h3_core.attention import attention, available_backends
from h3_core.layout import build_request_layout
from h3_core.sparse_attention import vsa_attention, vsa_tiles


def timed(call, repeats: int) -> float:
    """Median seconds of `repeats` calls after a warm-up (dit_forward's timer)."""
    times = time_forward(call, repeats)
    return sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sparsity", type=float, nargs="+", default=[0.8])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    layout = build_request_layout(1344, 768, 124, torch.ones(512, dtype=torch.long))
    grid = (layout.latent_frames, layout.latent_height // 2, layout.latent_width // 2)
    prefix = (layout.text_indices.numel(), 0, layout.audio_indices.numel())
    tiles = vsa_tiles(prefix, grid, "cuda")
    rows, heads, dim = layout.sequence_length, 56, 128
    g = torch.Generator("cuda").manual_seed(0)
    q, k, v, gate = (torch.randn(1, rows, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
                     for _ in range(4))
    flops = 4 * rows * rows * heads * dim
    for backend in [b for b in ("flash3", "sdpa") if b in available_backends()]:
        seconds = timed(lambda: attention(q, k, v, backend), args.repeats)
        print(json.dumps({"case": f"dense {backend}", "rows": rows, "ms": round(seconds * 1e3, 2),
                          "tflops": round(flops / seconds / 1e12, 1)}), flush=True)
    for sparsity in args.sparsity:
        for gated in (False, True):
            seconds = timed(lambda: vsa_attention(q, k, v, tiles, sparsity, gate if gated else None), args.repeats)
            print(json.dumps({"case": f"vsa flex, sparsity {sparsity}" + (", gated" if gated else ""), "rows": rows,
                              "tiles": [tiles.prefix_tiles, tiles.video_tiles], "ms": round(seconds * 1e3, 2),
                              "dense_equivalent_tflops": round(flops / seconds / 1e12, 1)}), flush=True)
    small = vsa_tiles((512, 0, 414), (5, 24, 42), "cuda")  # 5 latent frames: the dense reference fits
    n = small.slots.numel()
    got = vsa_attention(q[:, :n], k[:, :n], v[:, :n], small, 0.8, gate[:, :n], kernel="flex")
    want = vsa_attention(q[:, :n], k[:, :n], v[:, :n], small, 0.8, gate[:, :n], kernel="dense")
    print(json.dumps({"check": "flex vs dense reference", "rows": n,
                      "max_abs_diff": float((got.float() - want.float()).abs().max())}), flush=True)


if __name__ == "__main__":
    main()
