"""Pinned CPU memory for the streamed blocks, carved from a few large buffers.

torch's pinned-memory allocator rounds every request up to a power of two: a bf16 block (735 MiB) took 1 GiB,
39% more locked memory than the budget counted (FP8's 368 MiB took 512). Slabs of 2^k bytes each holding
several blocks waste little (eleven bf16 blocks in 8 GiB: 1.3%), and are what the budget is charged.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .runtime import GIB

log = logging.getLogger("h3_core")

MAX_SLAB = 8 * GIB  # the largest buffer asked for: the most an unload holds twice while its blocks get copies
SLAB_ALIGN = 4096  # each block starts on a page


@dataclass(frozen=True)
class HostPins:
    """A host that budgets pinned memory itself (ComfyUI): `room()`, the bytes it leaves H3 (None: no limit);
    `count(n)`, told of each slab taken (+n) and given back (-n), so that its own pins leave room for ours."""

    room: Callable[[], int | None]
    count: Callable[[int], None]


host: HostPins | None = None  # set by the host (the ComfyUI nodes); None for the CLI and the Python API


def host_room() -> int | None:
    """The pinned bytes the host leaves H3 now (None: no host, or no limit)."""
    return None if host is None else host.room()


def pin(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def slab_bytes(size: int, wanted: int, room: int | None, largest: int = MAX_SLAB) -> int | None:
    """The next slab to pin (a power of two, at most `largest`) for up to `wanted` more blocks of `size` bytes
    within `room` (None: no limit): the first of the fewest bytes that pin the most of them; None when not even
    one fits. (Eleven bf16 blocks take one 8 GiB slab; seven, a 4 then a 2, not an 8.)"""
    size = aligned(size)
    smallest = 1 << (size - 1).bit_length()
    capacities = [smallest << k for k in range(64) if smallest << k <= max(largest, smallest)]
    least, first = [0], [None]  # least[n]: the fewest bytes that pin n blocks; first[n]: its first slab
    for n in range(1, wanted + 1):
        total, larger = min((c + least[n - min(n, c // size)], -c) for c in capacities)  # larger first if equal
        least.append(total)
        first.append(-larger)
    most = max(n for n in range(wanted + 1) if room is None or least[n] <= room)
    return first[most]


def aligned(size: int) -> int:
    return -(-size // SLAB_ALIGN) * SLAB_ALIGN


class PinnedSlabs:
    """Hands out pinned buffers for blocks, each a slice of the current slab, a new slab taken when it is full.
    `room`: the pinned bytes allowed in all (None: no limit), charged a whole slab at a time. A slab is freed
    when the last block in it lets go of its slice; the host (if any) is told of each then, and when taken."""

    def __init__(self, room: int | None, allocate: Callable[[int], torch.Tensor] = pin):
        self.room, self.allocate = room, allocate
        self.slab: torch.Tensor | None = None
        self.used = 0
        self.pinned_bytes = 0  # slabs taken, as the allocator holds them

    def take(self, size: int, wanted: int) -> torch.Tensor | None:
        """`size` pinned bytes for one of `wanted` more blocks of about that size (this one included), or None
        where the room left cannot hold it."""
        if self.slab is None or self.used + size > self.slab.numel():
            capacity = slab_bytes(size, wanted, self.room)
            if capacity is None:
                return None
            try:
                slab = self.allocate(capacity)
            except RuntimeError as error:  # the driver's limit, not the host's free memory (WSL2's, say)
                log.warning("H3: %.1f GiB of pinned memory could not be had (%s); what was to go there streams from "
                            "ordinary CPU memory instead", capacity / GIB, str(error).splitlines()[0])
                self.room = 0  # not asked again
                return None
            self.slab, self.used = slab, 0
            self.pinned_bytes += capacity
            if host is not None:
                host.count(capacity)
                weakref.finalize(self.slab.untyped_storage(), host.count, -capacity)
            if self.room is not None:
                self.room -= capacity
        piece = self.slab[self.used : self.used + size]
        self.used += aligned(size)
        return piece


def park_table(slabs: PinnedSlabs, table: torch.Tensor, left: int) -> torch.Tensor:
    """`table` (an AdaLN table made on the GPU) copied into a slice of `slabs`, one of `left` more of its size;
    into ordinary CPU memory where their room is spent."""
    piece = slabs.take(table.numel() * table.element_size(), left)
    if piece is None:
        return table.to("cpu")
    return piece.view(table.dtype).view(table.shape).copy_(table)
