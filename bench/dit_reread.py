"""What it costs a DiT that let go of its weights for CPU memory (nodes/host_memory.py) to be read again
from its file: DiTReader.read timed into CPU memory (the streamed case) and straight onto the GPU, with
the file in the page cache and after its pages were dropped (posix_fadvise). One JSON line per case.
Real config, random bf16 weights (fp32 heads), as a ComfyUI single file; `--layers` blocks (the disk of
the GPU machine holds half the model: 25 of 50 blocks, ~31 GB; the rate is what carries over).

    PYTHONPATH=.:bench python bench/dit_reread.py --layers 25 --file /tmp/h3_reread.safetensors
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from dit_forward import build_ours
from h3_core.checkpoint import DiTReader
from h3_core.config import DiTConfig
from h3_core.memory_plan import GIB
from h3_core.runtime import empty_caches


def drop_page_cache(path: Path) -> None:
    with open(path, "rb") as handle:
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def timed_read(reader: DiTReader, device: str, case: str, nbytes: int) -> None:
    torch.cuda.synchronize()
    start = time.perf_counter()
    reader.read(device)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(json.dumps({"case": case, "device": device, "gib": round(nbytes / GIB, 2), "seconds": round(seconds, 2),
                      "gib_per_s": round(nbytes / GIB / seconds, 2)}), flush=True)
    start = time.perf_counter()
    reader.drop()
    empty_caches(torch.device("cuda"))
    print(json.dumps({"case": f"{case} / drop", "seconds": round(time.perf_counter() - start, 2)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=25)
    parser.add_argument("--file", type=Path, default=Path("/tmp/h3_reread.safetensors"))
    args = parser.parse_args()

    config = replace(DiTConfig(), num_layers=args.layers)
    model = build_ours(config)
    start = time.perf_counter()
    save_file({name: tensor.cpu() for name, tensor in model.state_dict().items()}, str(args.file))
    del model
    empty_caches(torch.device("cuda"))
    nbytes = args.file.stat().st_size
    print(json.dumps({"case": "write", "gib": round(nbytes / GIB, 2),
                      "seconds": round(time.perf_counter() - start, 2)}), flush=True)
    try:
        reader = DiTReader(args.file, dtype=torch.bfloat16, device="cuda")
        timed_read(reader, "cpu", "page cache", nbytes)
        timed_read(reader, "cuda", "page cache", nbytes)
        drop_page_cache(args.file)
        timed_read(reader, "cpu", "from disk", nbytes)
        drop_page_cache(args.file)
        timed_read(reader, "cuda", "from disk", nbytes)
    finally:
        args.file.unlink()


if __name__ == "__main__":
    main()
