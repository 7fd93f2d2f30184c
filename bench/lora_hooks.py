"""What a dynamic (hooked) adapter adds to one block linear at the real size: LoRA, LyCORIS LoKr and LoHa.

    python bench/lora_hooks.py [--rows 38000] [--rank 32] [--repeats 20]

For each of a block's four linears (real config, bf16, random weights; a 124-frame 1344x768 forward holds
~38k rows) it times the layer alone and with each adapter hooked (lora._DeltaHook, as ComfyUI's LoRA node and a
quantized model run them), and the peak memory the hook adds. One JSON line per layer and adapter.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from h3_core.config import DiTConfig
from h3_core.lora import _DeltaHook, _Resolved
from h3_core.lora_formats import Term


def near_square(n: int) -> tuple[int, int]:
    """n = p * q with p <= q as close as can be (how LyCORIS splits a LoKr dimension by default)."""
    p = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return p, n // p


def adapters(out_features: int, in_features: int, rank: int, device) -> dict[str, _Resolved]:
    g = torch.Generator(device).manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g, device=device) * 0.01  # noqa: E731
    (a, c), (b, d) = near_square(out_features), near_square(in_features)
    lokr = Term("lokr", "t", "weight", ("t.lokr_w1",), factors={"w1": r(a, b), "w2_a": r(c, rank), "w2_b": r(rank, d)},
                alpha=float(rank))
    loha = Term("loha", "t", "weight", ("t.hada_w1_a",), alpha=float(rank),
                factors={"w1_a": r(out_features, rank), "w1_b": r(rank, in_features), "w2_a": r(out_features, rank),
                         "w2_b": r(rank, in_features)})
    rows = slice(0, out_features)
    return {
        "lora": _Resolved(None, "t", "weight", rows, 1.0, r(rank, in_features), r(out_features, rank), None),
        "lokr": _Resolved(None, "t", "weight", rows, 1.0, None, None, None, lokr),
        "loha": _Resolved(None, "t", "weight", rows, 1.0, None, None, None, loha),
    }


def timed(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=38000)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    config, device = DiTConfig(), "cuda"
    inner = config.num_attention_heads * config.attention_head_dim
    layers = {"qkv_proj": (3 * inner, config.hidden_size), "out_proj": (config.hidden_size, inner),
              "fc1": (2 * config.ffn_dim, config.hidden_size), "fc2": (config.hidden_size, config.ffn_dim)}
    x = torch.randn(1, args.rows, max(i for _, i in layers.values()), device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, (out_features, in_features) in layers.items():
            linear = torch.nn.Linear(in_features, out_features, bias=False, device=device, dtype=torch.bfloat16)
            inputs = x[..., :in_features].contiguous()
            base = timed(lambda: linear(inputs), args.repeats)
            for kind, resolved in adapters(out_features, in_features, args.rank, device).items():
                resolved.module = linear
                hook = _DeltaHook(linear, [resolved])
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                hooked = timed(lambda: hook(linear, (inputs,), linear(inputs)), args.repeats)
                extra = torch.cuda.max_memory_allocated() - before - out_features * args.rows * 2  # less the output
                print(json.dumps({"layer": name, "shape": [out_features, in_features], "rows": args.rows,
                                  "adapter": kind, "rank": args.rank, "base_ms": round(base, 3),
                                  "hooked_ms": round(hooked, 3), "added": round(hooked / base - 1, 3),
                                  "extra_peak_mib": round(extra / 2**20, 1), "device": torch.cuda.get_device_name()}),
                      flush=True)


if __name__ == "__main__":
    main()
