"""Process-level settings for long CPU-side runs (decoding minutes of video and audio)."""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


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
