"""Process-level settings: how freed memory is handed back (CPU, pinned, GPU) and how the GPU's caching
allocator grows (set before CUDA is first used)."""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import functools
import gc
import os
import sys
from pathlib import Path

import torch

from . import cgroup

GIB = 2**30
ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the old name and torch 2.9's
EXPANDABLE_SEGMENTS = sys.platform.startswith("linux")  # where torch's CUDA allocator has them

M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MADV_WILLNEED = 3  # Linux madvise advice: read these pages in now, without waiting for them
PIN_RESERVE_BYTES = 4 * GIB  # CPU memory pinning leaves free for everything else (as ComfyUI's budget does)
READ_AHEAD_CHUNK = 128 << 10  # bytes a madvise call asks for: a disk's smallest read-ahead size, so none is cut


def compile_failed(error: BaseException) -> bool:
    """Whether torch.compile failed to build a graph (no C++ compiler, no Triton, an Inductor bug)."""
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
    allocation in this process. Returns whether it set the variable: not on Windows or macOS, where torch
    has no expandable segments (it warns and keeps fixed ones), nor once CUDA runs in this process (`h3`'s main
    called from a script that used the GPU already): the variable would then misstate the allocator to the
    memory plans that read it (`fixed_allocator_segments`)."""
    if not EXPANDABLE_SEGMENTS or any(environ.get(name) for name in ALLOCATOR_VARIABLES) or torch.cuda.is_initialized():
        return False
    environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return True


def fixed_allocator_segments(environ=os.environ) -> bool:
    """Whether torch's CUDA allocator runs with fixed-size segments (its default): neither expandable
    segments nor CUDA's own pool (`backend:cudaMallocAsync`, ComfyUI's default) are set in the
    environment, where torch reads them (expandable segments only on Linux: elsewhere torch keeps fixed
    ones). Memory plans leave more room then (memory_plan.py)."""
    settings = ",".join(environ.get(name, "") for name in ALLOCATOR_VARIABLES).replace(" ", "").lower()
    expandable = EXPANDABLE_SEGMENTS and "expandable_segments:true" in settings
    return not expandable and "backend:cudamallocasync" not in settings


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
    """Bytes the system can give without swapping: Linux MemAvailable, or less where a container's memory limit
    leaves less (cgroup.memory_room); elsewhere (Windows, macOS) psutil's `available` where psutil is installed
    (ComfyUI needs it); else None (not known)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available, room = int(line.split()[1]) * 1024, cgroup.memory_room()
                return available if room is None else min(available, room)
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def pinnable_bytes(budget: int | None) -> int | None:
    """At most `budget` (None: no limit) and what the system has available less PIN_RESERVE_BYTES: pinned
    memory can be neither swapped nor dropped, so pinning past what is free pushes everything else out (the
    streamed blocks not pinned are copied from where they are instead)."""
    available = host_memory_available()
    if available is None:
        return budget
    room = max(0, available - PIN_RESERVE_BYTES)
    return room if budget is None else min(budget, room)


def host_memory_warning(nbytes: int, what: str) -> str | None:
    """A warning when reading `nbytes` into CPU memory would take more than the system has available (what is
    read as stored only makes the OS read the file again; the rest swaps, or the system stops the process),
    else None."""
    available = host_memory_available()
    if available is None or nbytes <= available:
        return None
    return (f"{what} needs about {nbytes / GIB:.1f} GiB of CPU memory and {available / GIB:.1f} GiB is "
            "available. Weights read as stored (a bf16 file in bf16, FP8 and GGUF linears) stay the file's pages, "
            "which the OS reads from disk again when short (slower); the others may swap, or the system may stop "
            "this process. Free other models first, or load a smaller (FP8) file.")


def file_mapped_ranges() -> list[tuple[int, int]]:
    """The address ranges this process maps from files (Linux /proc/self/maps; none known elsewhere), sorted.
    safetensors reads a tensor as a view of the file mapped into memory, so weights kept as read are the OS's
    file cache: pages it can drop and read again, not memory the process holds."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                path = fields[5] if len(fields) == 6 else ""
                # a file with an inode; not a device (the GPU driver's) or a memfd (memory under a name)
                if fields[4] != "0" and path.startswith("/") and not path.startswith(("/dev/", "/memfd:")):
                    start, end = fields[0].split("-")
                    ranges.append((int(start, 16), int(end, 16)))
    except OSError:
        return []
    return sorted(ranges)


def in_mapped_file(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    """Whether a CPU tensor's data lies in one of `ranges` (`file_mapped_ranges`)."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return False
    start = tensor.data_ptr()
    at = bisect.bisect_right(ranges, (start, float("inf"))) - 1
    return at >= 0 and ranges[at][0] <= start and start + tensor.numel() * tensor.element_size() <= ranges[at][1]


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name, use_errno=True) if name else None


def read_ahead(tensors) -> bool:
    """Ask the OS to start reading these tensors' pages of a mapped file (`in_mapped_file`) from disk now, and
    return at once: a streamed block read this way before its copy does not wait on one page fault at a time.
    Only a hint (False where it was not taken: no libc with madvise, or an address the OS refused)."""
    libc = _libc() if os.name == "posix" else None
    madvise = getattr(libc, "madvise", None)
    if madvise is None:
        return False
    page, advised = os.sysconf("SC_PAGE_SIZE"), True
    for tensor in tensors:
        start = tensor.data_ptr() // page * page
        end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
        for at in range(start, end, READ_AHEAD_CHUNK):  # Linux reads at most its read-ahead size a call
            advised &= madvise(ctypes.c_void_p(at), ctypes.c_size_t(min(READ_AHEAD_CHUNK, end - at)), MADV_WILLNEED) == 0
    return advised
