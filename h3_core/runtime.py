"""Process-level settings: how freed memory is handed back (CPU, pinned, GPU) and how the GPU's caching
allocator grows (set before CUDA is first used)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from pathlib import Path

import torch

ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the old name and torch 2.9's

M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def compile_failed(error: BaseException) -> bool:
    """Whether torch.compile failed to build a graph (no C++ compiler, no Triton, an Inductor bug)."""
    import sys

    dynamo = sys.modules.get("torch._dynamo.exc")  # imported by any torch.compile that ran
    return dynamo is not None and isinstance(error, dynamo.BackendCompilerFailed)  # InductorError is one


def return_freed_memory_to_os(threshold_bytes: int = 1 << 20) -> bool:
    """Make glibc serve allocations above `threshold_bytes` with mmap, so freed activations go back to
    the OS. By default glibc raises that threshold after the first large free and then keeps freed
    tensors in its heap, so a streamed decode's resident memory creeps up with every window even
    though its live memory does not. No-op (False) where glibc is not the allocator."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold_bytes)))
    except (OSError, AttributeError):
        return False


def use_expandable_segments(environ=os.environ) -> bool:
    """Ask torch's CUDA caching allocator to grow expandable segments instead of fixed-size ones, unless
    the user configured the allocator. With fixed segments, a streamed DiT on a 24 GiB budget ran out of
    memory with 1.9 GiB reserved but unusable (freed pieces too small for the next 1 GiB activation);
    with expandable segments the same request fit at 24 and 16 GiB. Only effective before CUDA's first
    allocation in this process. Returns whether it set the variable."""
    if any(environ.get(name) for name in ALLOCATOR_VARIABLES):
        return False
    environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return True


def fixed_allocator_segments(environ=os.environ) -> bool:
    """Whether torch's CUDA allocator runs with fixed-size segments (its default): neither expandable
    segments nor CUDA's own pool (`backend:cudaMallocAsync`, ComfyUI's default) are set in the
    environment, where torch reads them. Memory plans leave more room then (memory_plan.py)."""
    settings = ",".join(environ.get(name, "") for name in ALLOCATOR_VARIABLES).replace(" ", "").lower()
    return "expandable_segments:true" not in settings and "backend:cudamallocasync" not in settings


def empty_caches(device: torch.device | None = None) -> None:
    """Hand back what torch keeps cached after its tensors are freed (after a gc, so dropped models are
    really gone): the CUDA allocator's device blocks, and its host allocator's pinned blocks. A streamed
    DiT's blocks wait in pinned memory (~25-50 GB); freed, they stayed resident in the process (39 GiB
    after the DiT of a 24 GiB run was dropped) until this. `device`: a CPU device skips the CUDA part."""
    gc.collect()
    if device is not None and device.type != "cuda" or not torch.cuda.is_initialized():
        return
    torch.cuda.empty_cache()
    empty_host_cache()


def empty_host_cache() -> None:
    """Hand back the pinned CPU blocks torch's host allocator keeps after their tensors are freed."""
    if not torch.cuda.is_initialized():
        return
    empty_host = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or \
        getattr(torch._C, "_host_emptyCache", None)
    if empty_host is not None:
        empty_host()


def host_memory_available() -> int | None:
    """Bytes the system can give without swapping (Linux MemAvailable), or None where it does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_memory_warning(nbytes: int, what: str) -> str | None:
    """A warning when reading `nbytes` into CPU memory would take more than the system has available (it
    would swap, or the system would stop the process), else None."""
    available = host_memory_available()
    if available is None or nbytes <= available:
        return None
    return (f"{what} needs about {nbytes / 2**30:.1f} GiB of CPU memory and {available / 2**30:.1f} GiB is "
            "available: expect swapping, or the system stopping this process. Free other models first, or load a "
            "smaller (FP8) file.")
