"""Streaming DiT blocks from CPU memory so the 66 GB (62 GiB) model runs on a small GPU.

The first `resident` blocks live on the GPU; every other block lives in (pinned) CPU memory and is
copied, ahead of use and on a side stream, into one of `prefetch + 2` fixed GPU slots. A slot is
reused only after the GPU has finished the block that used it (a stream wait, no CPU sync), so the
GPU memory of streaming is exactly the slots, however far the CPU runs ahead. The AdaLN projections
never travel: with precomputed tables (`H3DiT.modulation_schedule`, exact) the loop does not read
them, so only the ~0.77 GB per block of attention and FFN weights stream. Outputs are bitwise those
of the resident model: the same kernels run on the same values.
"""

from __future__ import annotations

import torch
from torch import nn

from .dit import H3DiT
from .runtime import empty_host_cache

ALIGN = 256  # bytes; every weight starts on an aligned offset inside its block's flat buffer


def _streamed_parameters(block: nn.Module) -> list[nn.Parameter]:
    """A block's weights that the denoise loop reads (everything but its AdaLN projection)."""
    return [p for name, p in block.named_parameters() if not name.startswith("adaln_proj.")]


def _packing(params: list[nn.Parameter]) -> tuple[list[int], int]:
    """Byte offsets of each weight in one flat buffer, and the buffer's size."""
    offsets, size = [], 0
    for p in params:
        offsets.append(size)
        size += -(-p.numel() * p.element_size() // ALIGN) * ALIGN
    return offsets, size


def _views(buffer: torch.Tensor, params: list[nn.Parameter], offsets: list[int]) -> list[torch.Tensor]:
    return [
        buffer[o : o + p.numel() * p.element_size()].view(p.dtype).view(p.shape) for p, o in zip(params, offsets)
    ]


class BlockStreamer:
    """Installs hooks on a DiT whose non-resident blocks sit on the CPU; `remove()` undoes them.

    device: the compute device. resident: how many leading blocks stay on it. prefetch: how many
    blocks ahead are copied; the GPU holds prefetch + 2 slots, each the size of the largest streamed
    block (blocks may differ: a GGUF file mixing quant types, an FP8 file with some blocks dense).
    pin_bytes: at most this much of the streamed blocks' CPU memory is pinned (None: all of it, on a
    CUDA device); the others are copied from ordinary memory, the same values, the CPU waiting on each
    copy (a host's pinned-memory budget, e.g. ComfyUI's, which Windows needs under half the RAM;
    bench/pinned_stream.py: no slower at 1344x768 x 124 on an H200).
    """

    def __init__(self, dit: H3DiT, device: torch.device | str, resident: int, prefetch: int = 1,
                 pin_bytes: int | None = None):
        self.device = torch.device(device)
        self.blocks = list(dit.blocks)
        if not 0 <= resident <= len(self.blocks):
            raise ValueError(f"resident blocks must be between 0 and {len(self.blocks)}, got {resident}.")
        if prefetch < 1:
            raise ValueError(f"prefetch must be at least 1 block, got {prefetch}.")
        self.resident, self.prefetch = resident, prefetch
        cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self.home: dict[int, list[torch.Tensor]] = {}  # CPU views of each streamed block's weights
        self.offsets: dict[int, list[int]] = {}  # each streamed block's own packing
        self.pinned_blocks = 0
        slot_bytes, pin_room = 0, pin_bytes
        for index, block in enumerate(self.blocks):
            params = _streamed_parameters(block)
            if index < resident:
                for param in params:
                    param.data = param.data.to(self.device)
                continue
            self.offsets[index], size = _packing(params)
            slot_bytes = max(slot_bytes, size)
            pinned = cuda and (pin_room is None or size <= pin_room)
            if pinned and pin_room is not None:
                pin_room -= size
            self.pinned_blocks += pinned
            flat = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
            self.home[index] = _views(flat, params, self.offsets[index])
            for param, view in zip(params, self.home[index]):
                view.copy_(param.data)
                param.data = view
        streamed = len(self.blocks) - resident
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(min(streamed, prefetch + 2))]
        self.slot_free: list[torch.cuda.Event | None] = [None] * len(self.slots)
        self.next_slot = 0
        self.loaded: dict[int, tuple[int, torch.cuda.Event | None]] = {}  # block -> (slot, copy done)
        self.hooks = [block.register_forward_pre_hook(self._before(i)) for i, block in enumerate(self.blocks)]
        self.hooks.append(self.blocks[0].register_forward_pre_hook(lambda module, args: self._forget_stale(),
                                                                   prepend=True))
        self.hooks += [block.register_forward_hook(self._after(i)) for i, block in enumerate(self.blocks)]

    def _fetch(self, index: int) -> None:
        """Start copying block `index` into the next slot, once the GPU is done with its last user."""
        if index in self.loaded or index not in self.home:
            return
        slot = self.next_slot
        self.next_slot = (slot + 1) % len(self.slots)
        targets = _views(self.slots[slot], _streamed_parameters(self.blocks[index]), self.offsets[index])
        if self.copy_stream is None:
            for target, source in zip(targets, self.home[index]):
                target.copy_(source)
            self.loaded[index] = (slot, None)
            return
        with torch.cuda.stream(self.copy_stream):
            if self.slot_free[slot] is not None:
                self.copy_stream.wait_event(self.slot_free[slot])
            for target, source in zip(targets, self.home[index]):
                target.copy_(source, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.copy_stream)
        self.loaded[index] = (slot, copied)

    def _before(self, index: int):
        def hook(module, args):
            self._fetch(index)
            if index in self.home:
                slot, copied = self.loaded[index]
                if copied is not None:
                    torch.cuda.current_stream(self.device).wait_event(copied)
                views = _views(self.slots[slot], _streamed_parameters(module), self.offsets[index])
                for param, view in zip(_streamed_parameters(module), views):
                    param.data = view
            for ahead in range(index + 1, min(index + 1 + self.prefetch, len(self.blocks))):
                self._fetch(ahead)

        return hook

    def _forget_stale(self) -> None:
        """At a forward's first block: a forward that failed part way left blocks marked as in their slots (their
        `_after` never ran) while later copies may have overwritten those slots; they are read again. The slots
        are free once the GPU is past the failed forward's work."""
        if not self.loaded:  # the last forward finished: its slots' events stand
            return
        for index in list(self.loaded):
            for param, view in zip(_streamed_parameters(self.blocks[index]), self.home[index]):
                param.data = view
        self.loaded.clear()
        if self.copy_stream is not None:
            free = torch.cuda.Event()
            free.record(torch.cuda.current_stream(self.device))
            self.slot_free = [free] * len(self.slots)

    def _after(self, index: int):
        def hook(module, args, output):
            if index not in self.home:
                return
            for param, view in zip(_streamed_parameters(module), self.home[index]):
                param.data = view
            slot, _ = self.loaded.pop(index)
            if self.copy_stream is not None:
                free = torch.cuda.Event()
                free.record(torch.cuda.current_stream(self.device))
                self.slot_free[slot] = free

        return hook

    def remove(self) -> None:
        """Take the hooks off and give back the GPU slots (the blocks keep their CPU or resident weights)."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        self.slots, self.slot_free, self.loaded = [], [], {}

    @property
    def offloaded_bytes(self) -> int:
        """Block weights this streamer keeps off the device, less the slots they stream through."""
        home = sum(view.numel() * view.element_size() for views in self.home.values() for view in views)
        return home - sum(slot.numel() for slot in self.slots)


def stream_blocks(dit: H3DiT, device: torch.device | str, resident: int, prefetch: int = 1,
                  pin_bytes: int | None = None) -> BlockStreamer:
    """Put the small shared parts on `device`, keep the AdaLN weights on the CPU (the sampler's
    `modulation_schedule` brings each over once) and stream the blocks; see BlockStreamer."""
    adaln = set(map(id, dit.adaln_modules()))
    for name, module in dit.named_children():
        if name == "final_layer":
            for child in module.children():
                child.to("cpu" if id(child) in adaln else device)
        elif name != "blocks":
            module.to("cpu" if id(module) in adaln else device)
    for block in dit.blocks:
        block.adaln_proj.to("cpu")
    dit.rope_inv_freq = dit.rope_inv_freq.to(device)
    return BlockStreamer(dit, device, resident, prefetch, pin_bytes)


def place(dit: H3DiT, device: torch.device | str, plan, pin_bytes: int | None = None) -> BlockStreamer | None:
    """Put `dit` (loaded anywhere, e.g. on the CPU) where a `memory_plan.MemoryPlan` says. Returns the
    streamer (`remove()` it when done) or None when every block is resident. AdaLN weights the plan
    leaves on the CPU stay there; the sampler's `offload_adaln` brings each over once. `pin_bytes`: as
    BlockStreamer's."""
    device = torch.device(device)
    if plan.streams:
        return stream_blocks(dit, device, plan.resident_blocks, plan.prefetch, pin_bytes)
    kept = {id(p) for module in dit.adaln_modules() for p in module.parameters()} if plan.offload_adaln else set()
    for module in dit.modules():
        for param in module.parameters(recurse=False):
            if id(param) not in kept:
                param.data = param.data.to(device)
        for name, buffer in module.named_buffers(recurse=False):
            setattr(module, name, buffer.to(device))
    return None


def unplace(dit: H3DiT, device: torch.device | str, streamer: BlockStreamer | None = None) -> None:
    """Undo `place`: remove the streamer's hooks, give every streamed block its weights back in ordinary
    (pageable) CPU memory, block by block so the pinned buffers go as they empty (torch's host allocator
    would keep them all until the end: the streamed blocks twice in CPU memory), then move the whole model
    to `device`. Safe after a failed forward (a block may still point into a slot)."""
    if streamer is not None:
        streamer.remove()
        for index in list(streamer.home):
            views = streamer.home.pop(index)
            for param, view in zip(_streamed_parameters(streamer.blocks[index]), views):
                param.data = torch.empty(view.shape, dtype=view.dtype).copy_(view) if view.is_pinned() else view
            views = view = None  # the last view too: it holds the pinned buffer
            empty_host_cache()
    dit.to(device)


def load_device(plan, device: torch.device | str) -> torch.device:
    """Where to read the weights to: straight onto `device` when the plan keeps everything there."""
    return torch.device(device) if not plan.streams and not plan.offload_adaln else torch.device("cpu")


class LayerVisits:
    """For a one-shot forward through a model larger than the GPU (the 51 GB text encoder on a 24 GB
    card): each of `layers` keeps its weights where they are (the CPU) and computes on `device` from a
    copy made just before it runs and dropped just after, so the GPU holds one layer at a time. Same
    kernels on the same values as a resident model; `remove()` takes the hooks off."""

    def __init__(self, layers, device: torch.device | str):
        self.device = torch.device(device)
        self.homes: dict[int, list[tuple[nn.Parameter, torch.Tensor]]] = {}
        self.visits = 0
        self.hooks = []
        for layer in layers:
            self.hooks.append(layer.register_forward_pre_hook(self._arrive))
            self.hooks.append(layer.register_forward_hook(self._leave))

    def _arrive(self, module, args):
        self.homes[id(module)] = [(p, p.data) for p in module.parameters()]
        for param, home in self.homes[id(module)]:
            param.data = home.to(self.device, non_blocking=True)
        self.visits += 1

    def _leave(self, module, args, output):
        for param, home in self.homes.pop(id(module)):
            param.data = home

    def send_home(self) -> None:
        """Every layer still visiting back to its home: a forward that stopped inside a layer (an interrupt,
        an error) skipped its `_leave`, and its copy would stay on the device, counted nowhere."""
        for key in list(self.homes):
            for param, home in self.homes.pop(key):
                param.data = home

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
