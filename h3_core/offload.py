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

import weakref
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from .dit import H3DiT
from .pinned import PinnedSlabs
from .runtime import empty_host_cache, file_mapped_ranges, in_mapped_file, pinnable_bytes, read_ahead

ALIGN = 256  # bytes; every weight starts on an aligned offset inside its block's flat buffer
STREAMER = "_h3_block_streamer"  # the model's entry naming its streamer (weakly)
READ_AHEAD_BLOCKS = 2  # how many blocks past those being copied the disk is asked to read, where they are a file's


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
    pin_bytes: at most this much of the streamed blocks' CPU memory is pinned, as the allocator holds it
    (pinned.PinnedSlabs; None: all of it, on a CUDA device); the others are copied from where they are, the
    same values, the CPU waiting on each copy (a host's pinned-memory budget, e.g. ComfyUI's, which Windows
    needs under half the RAM; bench/pinned_stream.py: no slower at 1344x768 x 124 on an H200). Where they
    are is, for weights read as stored, the file's pages in the OS's cache: a host short of memory reads
    them from disk again instead of swapping.
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
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.home: dict[int, list[torch.Tensor]] = {}  # CPU views of each streamed block's weights
        # a pinned block's weights as read, where they are views of a mapped file (None where not): unplace
        # gives them back instead of copying the pinned ones again
        self.as_read: dict[int, list[torch.Tensor | None]] = {}
        self.offsets: dict[int, list[int]] = {}  # each streamed block's own packing
        self.on_file: dict[int, list[torch.Tensor]] = {}  # an unpinned block's weights in a mapped file
        self.pinned_blocks = 0
        self.hooks, self.reader, self.slots = [], None, []
        self.loaded: dict[int, tuple[int, torch.cuda.Event | None]] = {}  # block -> (slot, copy done)
        self.model = weakref.ref(dit)
        try:
            self._place(pin_bytes)
        except BaseException:  # out of memory partway: every block back in CPU memory as it was, no pins held
            unplace(dit, "cpu", self)
            raise
        dit.__dict__[STREAMER] = weakref.ref(self)  # what `is_streamed` reads

    def _place(self, pin_bytes: int | None) -> None:
        resident = self.resident
        slabs = PinnedSlabs(pin_bytes) if self.device.type == "cuda" else None
        slot_bytes = 0
        mapped = file_mapped_ranges()
        for index, block in enumerate(self.blocks):
            params = _streamed_parameters(block)
            if index < resident:
                for param in params:
                    param.data = param.data.to(self.device)
                continue
            self.offsets[index], size = _packing(params)
            slot_bytes = max(slot_bytes, size)
            flat = None if slabs is None else slabs.take(size, len(self.blocks) - index)
            pinned = flat is not None
            self.pinned_blocks += pinned
            if not pinned:  # copied from where it is: a block read from a file stays the OS's file cache
                self.home[index] = [param.data.to("cpu") for param in params]
                for param, home in zip(params, self.home[index]):
                    param.data = home
                on_file = [home for home in self.home[index] if in_mapped_file(home, mapped)]
                if on_file:
                    self.on_file[index] = on_file
                continue
            self.as_read[index] = [p.data if in_mapped_file(p.data, mapped) else None for p in params]
            self.home[index] = _views(flat, params, self.offsets[index])
            for param, view in zip(params, self.home[index]):
                view.copy_(param.data)
                param.data = view
        self.reader = ThreadPoolExecutor(1, "h3-read-ahead") if self.on_file else None
        streamed = len(self.blocks) - resident
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device)
                      for _ in range(min(streamed, self.prefetch + 2))]
        self.slot_free: list[torch.cuda.Event | None] = [None] * len(self.slots)
        self.next_slot = 0
        for i, block in enumerate(self.blocks):  # one at a time: each handle kept, to take off if one fails
            self.hooks.append(block.register_forward_pre_hook(self._before(i)))
        self.hooks.append(self.blocks[0].register_forward_pre_hook(lambda module, args: self._forget_stale(),
                                                                   prepend=True))
        for i, block in enumerate(self.blocks):
            self.hooks.append(block.register_forward_hook(self._after(i)))

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
            # a block fetched soon (in the next forward too) that copies from a file's pages: the disk reads it
            # meanwhile
            self._advise((index + self.prefetch + READ_AHEAD_BLOCKS) % len(self.blocks))

        return hook

    def _advise(self, index: int) -> None:
        """Have the OS read block `index`'s file pages on the side thread (madvise waits on the disk queue)."""
        if index in self.on_file:
            self.reader.submit(read_ahead, self.on_file[index])

    def _forget_stale(self) -> None:
        """At a forward's first block: a forward that failed part way left blocks marked as in their slots (their
        `_after` never ran) while later copies may have overwritten those slots; they are read again. The slots
        are free once the GPU is past the failed forward's work."""
        if not self.loaded:  # the last forward finished: its slots' events stand
            return
        self._send_home_loaded()
        if self.copy_stream is not None:
            free = torch.cuda.Event()
            free.record(torch.cuda.current_stream(self.device))
            self.slot_free = [free] * len(self.slots)

    def _send_home_loaded(self) -> None:
        """Point every block still marked as in a slot back at its CPU weights (a forward that failed part way)."""
        for index in list(self.loaded):
            for param, view in zip(_streamed_parameters(self.blocks[index]), self.home[index]):
                param.data = view
        self.loaded.clear()

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
        model = self.model()
        if model is not None and model.__dict__.get(STREAMER, lambda: None)() is self:
            del model.__dict__[STREAMER]
        self._send_home_loaded()  # after a failed forward no block may keep pointing into a slot
        if self.copy_stream is not None:  # a copy still queued must not write into memory handed out again
            self.copy_stream.synchronize()
        self.slots, self.slot_free = [], []
        if self.reader is not None:
            self.reader.shutdown(wait=True, cancel_futures=True)  # no madvise left on a mapping about to go
            self.reader = None

    def let_go(self) -> None:
        """Drop every reference to the streamed blocks' CPU weights (the model lets go of its weights)."""
        self.home.clear()
        self.as_read.clear()
        self.on_file.clear()

    @property
    def offloaded_bytes(self) -> int:
        """Block weights this streamer keeps off the device, less the slots they stream through."""
        home = sum(view.numel() * view.element_size() for views in self.home.values() for view in views)
        return home - sum(slot.numel() for slot in self.slots)


def streamed_bytes(dit: H3DiT, plan) -> int:
    """What streaming by `plan` keeps off the device (BlockStreamer.offloaded_bytes, known before placing):
    the streamed blocks' weights less the prefetch + 2 slots, each the largest one's packing, they pass through."""
    if not plan.streams:
        return 0
    streamed = [_streamed_parameters(block) for block in list(dit.blocks)[plan.resident_blocks:]]
    if not streamed:
        return 0
    weights = sum(p.numel() * p.element_size() for params in streamed for p in params)
    slot = max(_packing(params)[1] for params in streamed)
    return weights - slot * min(len(streamed), plan.prefetch + 2)


def is_streamed(dit: nn.Module) -> bool:
    """Whether `dit`'s blocks stream now (a BlockStreamer's hooks on, its weights at the streamer's homes)."""
    streamer = dit.__dict__.get(STREAMER, lambda: None)()
    return streamer is not None and bool(streamer.hooks)


def stream_blocks(dit: H3DiT, device: torch.device | str, resident: int, prefetch: int = 1,
                  pin_bytes: int | None = None) -> BlockStreamer:
    """Put the small shared parts on `device`, keep the AdaLN weights on the CPU (the sampler's
    `modulation_schedule` brings each over once) and stream the blocks; see BlockStreamer."""
    if is_streamed(dit):  # a second streamer would take the first one's slots for the blocks' homes
        raise ValueError("This DiT's blocks already stream; unplace it (or remove its streamer) before placing it "
                         "again.")
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
    BlockStreamer's, within what the system has available (runtime.pinnable_bytes)."""
    device = torch.device(device)
    if plan.streams:
        return stream_blocks(dit, device, plan.resident_blocks, plan.prefetch, pinnable_bytes(pin_bytes))
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
    (pageable) CPU memory (a pinned block: its weights as read where those are a mapped file's, else a
    copy), block by block so each pinned slab goes once its blocks have left it (torch's host allocator
    would keep them all until the end: the streamed blocks twice in CPU memory), then move the whole model
    to `device`.
    Safe after a failed forward (a block may still point into a slot)."""
    if streamer is not None:
        streamer.remove()
        for index in list(streamer.home):
            views, as_read = streamer.home.pop(index), streamer.as_read.pop(index, None)
            for param, view, read in zip(_streamed_parameters(streamer.blocks[index]), views,
                                         as_read or [None] * len(views)):
                if read is not None:
                    param.data = read
                else:
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
    kernels on the same values as a resident model; `remove()` takes the hooks off. Weights read as stored
    are the file's pages: each layer's are asked of the disk two layers early (a host short of memory)."""

    def __init__(self, layers, device: torch.device | str):
        self.device = torch.device(device)
        self.layers = list(layers)
        self.homes: dict[int, list[tuple[nn.Parameter, torch.Tensor]]] = {}
        self.visits = 0
        self.hooks = []
        self.reader = ThreadPoolExecutor(1, "h3-read-ahead")
        for index, layer in enumerate(self.layers):
            self.hooks.append(layer.register_forward_pre_hook(self._arrive(index)))
            self.hooks.append(layer.register_forward_hook(self._leave))

    def _arrive(self, index: int):
        def hook(module, args):
            self.homes[id(module)] = [(p, p.data) for p in module.parameters()]
            for param, home in self.homes[id(module)]:
                param.data = home.to(self.device, non_blocking=True)
            self.visits += 1
            # the layer after next, where its weights are a file's pages (a host short of memory): the disk
            # reads them while these two run
            if index + 2 < len(self.layers) and self.reader is not None:
                ahead = [p.data for p in self.layers[index + 2].parameters() if p.device.type == "cpu"]
                self.reader.submit(_read_ahead_mapped, ahead)

        return hook

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
        if self.reader is not None:
            self.reader.shutdown(wait=True, cancel_futures=True)
            self.reader = None


def _read_ahead_mapped(tensors: list[torch.Tensor]) -> None:
    """`read_ahead` for those of `tensors` that are a mapped file's pages (read as stored)."""
    mapped = file_mapped_ranges()
    on_file = [t for t in tensors if in_mapped_file(t, mapped)]
    if on_file:
        read_ahead(on_file)
