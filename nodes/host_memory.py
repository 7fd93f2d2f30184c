"""CPU memory shared by our large models inside ComfyUI.

The bf16 DiT (~66 GB) and the text encoder (~51 GB) cannot both wait in the CPU memory of a typical
machine with a 24 GB card, and ComfyUI keeps every loader's output between runs. So before one of our
models reads weights into CPU memory, room is made: first ComfyUI is asked to drop cached outputs of
earlier workflows (its RAM-pressure cache, where it has one), then our other models that can be read
again from their files let their weights go, largest first, until the read fits. A released model is read
again when it is next needed (the text encoder for a changed prompt, the DiT at its next run): slower
than keeping both, but it runs where holding both would swap or be stopped by the system. A model that
ComfyUI unloads from the GPU asks only ComfyUI's cache for room to wait in; without it, it lets go of its
own weights (h3_core.placement).
"""

from __future__ import annotations

import gc
import weakref

from h3_core import runtime
from h3_core.memory_plan import GIB
from h3_core.placement import warn_host_memory

HEADROOM = 4 * GIB  # left free besides a read: ComfyUI, the activations' CPU side, the page cache
_tracked: weakref.WeakSet = weakref.WeakSet()


def track(placement) -> None:
    """Let `placement` make room before its weights go into CPU memory, and let go of its own weights
    when another of ours needs the room."""
    placement.make_host_room = make_host_room
    _tracked.add(placement)


def make_host_room(nbytes: int, needing=None, others: bool = True) -> bool:
    """Before `needing` (a Placement, or None for a model not yet placed) puts `nbytes` into CPU memory:
    free room as above (`others`: our other models too); whether they fit now (with the headroom)."""
    if _fits(nbytes + HEADROOM):
        return True
    _release_comfy_cache(nbytes + HEADROOM)
    for placement in sorted(_tracked, key=lambda p: p.host_bytes, reverse=True):
        if _fits(nbytes + HEADROOM):
            return True
        if others and placement is not needing and placement.releasable and placement.host_bytes > 0:
            placement.release_weights()
    return _fits(nbytes + HEADROOM)


def warn_unless_room(nbytes: int, what: str) -> None:
    """`make_host_room` for a model not yet placed, named `what`; a warning in the log if the read itself
    still does not fit (it goes on: the system may still find the memory)."""
    if not make_host_room(nbytes):
        warn_host_memory(nbytes, what)


def _fits(nbytes: int) -> bool:
    available = runtime.host_memory_available()
    return available is None or nbytes <= available


def _release_comfy_cache(target: int) -> None:
    """ComfyUI's RAM-pressure cache (its default in 0.33) drops outputs of earlier workflows first; an older
    ComfyUI, or one started with another cache mode, has none."""
    try:
        import comfy.memory_management as comfy_memory
    except ImportError:
        return
    release = getattr(comfy_memory, "extra_ram_release", None)
    if release is not None:
        release(target)
        gc.collect()
        runtime.empty_host_cache()  # a dropped DiT's pinned blocks: torch's host allocator keeps them till this
