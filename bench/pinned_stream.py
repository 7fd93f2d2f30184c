"""Seconds a streamed real-config forward takes with the streamed blocks pinned, with none pinned (pageable
copies, as a host's pinned-memory budget of 0 gives) and with 20 GiB of them pinned. 1344x768 x 124 frames,
10 blocks resident, 40 streamed, random weights. CUDA only.

    PYTHONPATH=.:bench python bench/pinned_stream.py
"""
import json
import time

import torch

from dit_forward import build_ours
from h3_core.config import DiTConfig
from h3_core.offload import stream_blocks, unplace
from h3_core.runtime import empty_caches
from offload_bench import step_call

config = DiTConfig()
model = build_ours(config).cuda()
for module in model.adaln_modules():
    module.to("cpu")
model.set_attention("auto")
for label, pin in (("pinned", None), ("pageable", 0), ("half pinned", 20 * 2**30)):
    streamer = stream_blocks(model, "cuda", 10, 1, pin_bytes=pin)
    torch.cuda.empty_cache()
    layout, _, call = step_call(model, config, "1344x768_124f")
    times = []
    with torch.inference_mode():
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            call()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    held = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)  # pinned bytes the allocator holds
    print(json.dumps({"streamed": label, "pinned_blocks": streamer.pinned_blocks, "streamed_blocks": len(streamer.home),
                      "pinned_gib": round(held / 2**30, 2), "seconds": [round(t, 3) for t in times]}), flush=True)
    unplace(model, "cuda", streamer)
    empty_caches(torch.device("cuda"))
    for module in model.adaln_modules():
        module.to("cpu")
