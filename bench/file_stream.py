"""Seconds a streamed real-config forward takes when its streamed blocks are not pinned but copied from the
pages of the file they were read from (what a host short of memory gets: the OS keeps what it can of the file
in its cache and reads the rest from disk again). 1344x768 x 124 frames, 10 blocks resident, 40 streamed
(~31 GB written to a file first), random weights. Cases: the file's pages all cached; all dropped before each
forward (every streamed byte read from disk), with and without the streamer's read-ahead advice; and the
disk's own sequential read speed for scale. CUDA and Linux only.

    PYTHONPATH=.:bench python bench/file_stream.py [--folder /tmp]
"""
import argparse
import ctypes
import json
import os
import time

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dit_forward import build_ours
from h3_core import offload
from h3_core.config import DiTConfig
from h3_core.offload import stream_blocks, unplace
from offload_bench import step_call

MADV_DONTNEED = 4
RESIDENT = 10


def drop_from_cache(path, tensors) -> None:
    """Unmap the tensors' pages from this process, then have the OS drop the file's pages (it keeps mapped ones)."""
    libc, page = ctypes.CDLL(None, use_errno=True), os.sysconf("SC_PAGE_SIZE")
    for tensor in tensors:
        start = tensor.data_ptr() // page * page
        end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)
    descriptor = os.open(path, os.O_RDONLY)
    os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(descriptor)


def cached_share(tensors) -> float:
    libc, page = ctypes.CDLL(None, use_errno=True), os.sysconf("SC_PAGE_SIZE")
    cached = total = 0
    for tensor in tensors:
        start = tensor.data_ptr() // page * page
        pages = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size() - start) // page)
        vector = (ctypes.c_ubyte * pages)()
        libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vector)
        cached, total = cached + sum(v & 1 for v in vector), total + pages
    return round(cached / total, 4)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", default="/tmp")
    args = parser.parse_args()
    path = os.path.join(args.folder, "h3_streamed_blocks.safetensors")
    config = DiTConfig()
    model = build_ours(config).cuda()
    for module in model.adaln_modules():
        module.to("cpu")
    model.set_attention("auto")

    start = time.perf_counter()
    names = {}
    tensors = {}
    for index in range(RESIDENT, len(model.blocks)):
        for name, param in model.blocks[index].named_parameters():
            if not name.startswith("adaln_proj."):
                names[f"blocks.{index}.{name}"] = param
                tensors[f"blocks.{index}.{name}"] = param.data.cpu()
    save_file(tensors, path)
    del tensors
    descriptor = os.open(path, os.O_RDONLY)
    os.fsync(descriptor)
    os.close(descriptor)
    size = os.path.getsize(path)
    with safe_open(path, "pt") as handle:
        from_file = {key: handle.get_tensor(key) for key in names}
    for key, param in names.items():
        param.data = from_file[key]
    print(json.dumps({"file_gb": round(size / 1e9, 2), "written_and_read_in_s": round(time.perf_counter() - start, 1)}),
          flush=True)
    on_file = list(from_file.values())

    drop_from_cache(path, on_file)
    start, chunk = time.perf_counter(), 1 << 26
    with open(path, "rb", buffering=0) as handle:
        while handle.read(chunk):
            pass
    print(json.dumps({"disk_sequential_read_gb_per_s": round(size / 1e9 / (time.perf_counter() - start), 2)}), flush=True)

    real_read_ahead = offload.read_ahead
    for label, cold, read_ahead in (("file pages cached", False, True), ("from disk, read ahead", True, True),
                                    ("from disk, no read-ahead", True, False)):
        offload.read_ahead = real_read_ahead if read_ahead else (lambda tensors: False)
        streamer = stream_blocks(model, "cuda", RESIDENT, 1, pin_bytes=0)
        torch.cuda.empty_cache()
        layout, _, call = step_call(model, config, "1344x768_124f")
        times, shares = [], []
        with torch.inference_mode():
            for _ in range(2 if cold else 3):
                if cold:
                    drop_from_cache(path, on_file)
                shares.append(cached_share(on_file))
                torch.cuda.synchronize()
                start = time.perf_counter()
                call()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
        print(json.dumps({"streamed": label, "pinned_blocks": streamer.pinned_blocks,
                          "streamed_blocks": len(streamer.home), "blocks_on_file": len(streamer.on_file),
                          "cached_before": shares, "seconds": [round(t, 3) for t in times]}), flush=True)
        unplace(model, "cuda", streamer)
        for module in model.adaln_modules():
            module.to("cpu")
        for key, param in names.items():  # unplace moved them to the GPU: the file's pages again
            param.data = from_file[key]
        torch.cuda.empty_cache()
    offload.read_ahead = real_read_ahead
    os.remove(path)


if __name__ == "__main__":
    main()
