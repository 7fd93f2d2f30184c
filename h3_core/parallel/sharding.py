"""Weight sharding (FSDP-style, inference only): P ranks hold one model together.

Each block is cut into two units: its attention / FFN / norm weights, and its AdaLN projection (the
sampler computes AdaLN tables by calling `adaln_proj` alone, before the loop). A unit's weights are
packed into one flat byte buffer (any mix of dtypes), padded to a multiple of P, and rank r keeps
bytes [r*n, (r+1)*n). Just before a unit runs, one all-gather fills a reusable full-size buffer and
the parameters point into it; afterwards they point at empty tensors, so a stray read outside a
forward fails loudly instead of seeing another block's weights. The next block's gather starts
while the current one computes (two block buffers), on its own process group so it does not queue
behind the sequence-parallel all-to-alls. Outputs are exactly the unsharded ones: the same bytes
reach the same kernels.

The embeddings, the token refiner, the time embedder, the final layer (~0.3 GB in the release) and
any buffers stay whole on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..offload import _packing
from .sequence import all_gather_single


class _Unit:
    """One module's sharded weights: this rank's bytes, and where each parameter sits in the whole."""

    def __init__(self, params: list[nn.Parameter], world: int, rank: int, device):
        self.params = params
        offsets, size = _packing(params)
        self.places = [(offset, p.dtype, p.shape) for offset, p in zip(offsets, params)]  # kept: shapes go empty
        self.shard_bytes = -(-size // world)
        self.whole_bytes = self.shard_bytes * world  # what a gather fills: the front of a buffer for the largest
        whole = torch.zeros(self.whole_bytes, dtype=torch.uint8, device=params[0].device)
        for view, param in zip(self._views(whole), params):
            view.copy_(param.data)
        self.shard = whole[rank * self.shard_bytes : (rank + 1) * self.shard_bytes].to(device, copy=True)
        self.empty = [torch.empty(0, dtype=p.dtype, device=device) for p in params]
        self.release()

    def _views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        return [
            buffer[offset : offset + shape.numel() * dtype.itemsize].view(dtype).view(shape)
            for offset, dtype, shape in self.places
        ]

    def point_into(self, buffer: torch.Tensor) -> None:
        for param, view in zip(self.params, self._views(buffer)):
            param.data = view

    def release(self) -> None:
        for param, empty in zip(self.params, self.empty):
            param.data = empty


class BlockSharder:
    """The gather-before / release-after hooks on every block and AdaLN projection. One-way, like
    loading: the model keeps only shards from then on."""

    def __init__(self, dit, group: dist.ProcessGroup | None, device: torch.device | str):
        self.group = group
        self.world, rank = dist.get_world_size(group), dist.get_rank(group)
        device = torch.device(device)
        self.main, self.adaln = [], []
        for block in dit.blocks:
            weights = [p for name, p in block.named_parameters() if not name.startswith("adaln_proj.")]
            self.main.append(_Unit(weights, self.world, rank, device))
            self.adaln.append(_Unit(list(block.adaln_proj.parameters()), self.world, rank, device))
        # blocks may differ in size (a GGUF *_M mix, blocks a file leaves dense): buffers fit the largest
        full = lambda units: torch.empty(max(u.whole_bytes for u in units), dtype=torch.uint8, device=device)  # noqa: E731
        self.block_buffers = [full(self.main), full(self.main)]
        self.adaln_buffer = full(self.adaln)
        self.pending: dict[int, dist.Work] = {}  # block index -> its gather in flight
        for index, block in enumerate(dit.blocks):
            block.register_forward_pre_hook(self._before_block(index))
            block.register_forward_hook(lambda module, args, out, unit=self.main[index]: unit.release())
            adaln = self.adaln[index]
            block.adaln_proj.register_forward_pre_hook(lambda module, args, unit=adaln: self._gather_now(unit))
            block.adaln_proj.register_forward_hook(lambda module, args, out, unit=adaln: unit.release())

    def _gather(self, index: int, async_op: bool):
        unit = self.main[index]
        buffer = self.block_buffers[index % 2][: unit.whole_bytes]
        return all_gather_single(buffer, unit.shard, group=self.group, async_op=async_op)

    def _gather_now(self, unit: _Unit) -> None:
        all_gather_single(self.adaln_buffer[: unit.whole_bytes], unit.shard, group=self.group)
        unit.point_into(self.adaln_buffer)

    def _before_block(self, index: int):
        def hook(module, args):
            work = self.pending.pop(index, None)
            for stale in self.pending.values():  # an earlier forward stopped midway: settle its prefetch
                stale.wait()
            self.pending.clear()
            if work is None:
                self._gather(index, async_op=False)
            else:
                work.wait()
            self.main[index].point_into(self.block_buffers[index % 2])
            if index + 1 < len(self.main):  # its buffer was last used by block index - 1, already queued
                self.pending[index + 1] = self._gather(index + 1, async_op=True)

        return hook


def shard_blocks(dit, group: dist.ProcessGroup | None, device: torch.device | str) -> BlockSharder:
    """Keep 1/P of every block's weights on `device` (from a model loaded anywhere, e.g. the CPU) and
    move the rest of the model there whole; see BlockSharder."""
    sharder = BlockSharder(dit, group, device)
    dit.to(device)  # block parameters are empty on `device` already; this moves the rest and any buffers
    return sharder
