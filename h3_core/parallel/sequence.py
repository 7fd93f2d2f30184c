"""Sequence parallel (Ulysses) over the packed sequence.

Each of P ranks keeps a contiguous slice of the packed rows through the blocks: norms, AdaLN
modulation, RoPE, the projections and the FFN are per-row work, so they run on the slice alone.
Attention needs every row, so q, k, v trade rows for heads with one all-to-all
([B, S/P, H, D] -> [B, S, H/P, D]), each rank attends with its H/P heads over the whole sequence
(exact: a head's attention is independent of the others), and a second all-to-all trades back.
H must divide by P (56 heads: P = 1, 2, 4, 7, 8). Video Sparse Attention splits the same way: its tiles cover
every row and each head selects its own.

Padding: S is padded up to a multiple of P so every rank holds the same number of rows. The pad rows
are zeros; they are dropped before attention (they never enter a softmax) and again when the slices
are gathered for the final layer, so outputs equal the single-process ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..attention import attention
from ..sparse_attention import SparsePlan, vsa_attention

# torch 2.13 renamed all_gather_into_tensor (and warns on the old name); 2.11 has only the old one.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _rows(t: torch.Tensor, dim: int, start: int, count: int) -> torch.Tensor:
    """Rows [start, start + count) of `t` along `dim`, zero-padded where they run past the end."""
    have = max(0, min(count, t.shape[dim] - start))
    piece = t.narrow(dim, min(start, t.shape[dim]), have)
    if have == count:
        return piece
    shape = list(t.shape)
    shape[dim] = count - have
    return torch.cat([piece, t.new_zeros(shape)], dim=dim)


class SequenceParallel:
    """The split / attention / gather steps of one rank in `group` (installed by `enable`)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.rows = 0  # S of the forward in flight

    def local_rows(self, rows: int) -> int:
        return -(-rows // self.world)

    def split(self, x: torch.Tensor, adaln_index: torch.Tensor, rope):
        """This rank's slice: x [B, S, H] -> [B, S_pad/P, H]; adaln_index [S] and cos/sin [S, R] alike."""
        self.rows = x.shape[1]
        local = self.local_rows(self.rows)
        start = self.rank * local
        cos, sin = rope
        return (
            _rows(x, 1, start, local),
            _rows(adaln_index, 0, start, local),
            (_rows(cos, 0, start, local), _rows(sin, 0, start, local)),
        )

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str, window=None) -> torch.Tensor:
        """q, k, v [B, S/P, H, D] (this rank's rows, all heads) -> attention output, same shape. Attention
        sees every row, so a `window` (sequence positions) applies unchanged."""
        out = attention(self._to_heads(q), self._to_heads(k), self._to_heads(v), backend, window)  # pad rows never attend
        return self._to_rows(out)

    def sparse_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None,
                         plan: SparsePlan) -> torch.Tensor:
        """Video Sparse Attention of this rank's rows (q, k, v and the gate [B, S/P, H, D]), as `attention`."""
        heads = [self._to_heads(t) for t in (q, k, v)]
        out = vsa_attention(*heads, plan.tiles, plan.sparsity, None if gate is None else self._to_heads(gate))
        return self._to_rows(out)

    def _to_heads(self, t: torch.Tensor) -> torch.Tensor:
        """[B, S/P, H, D] my rows, all heads -> [B, S, H/P, D] all rows, my heads (pad rows dropped).
        One copy into the send buffer; for B = 1 the received buffer is already in row order."""
        batch, local, heads, dim = t.shape
        world, part = self.world, heads // self.world
        send = t.new_empty(world, batch, local, part, dim)  # chunk j: my rows of head group j, for rank j
        send.copy_(t.unflatten(2, (world, part)).permute(2, 0, 1, 3, 4))
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # recv[i]: rank i's rows of my heads
        return recv.transpose(0, 1).reshape(batch, world * local, part, dim)[:, : self.rows]

    def _to_rows(self, out: torch.Tensor) -> torch.Tensor:
        """[B, S, H/P, D] all rows, my heads -> [B, S/P, H, D] my rows, all heads."""
        batch, rows, part, dim = out.shape
        world, local = self.world, self.local_rows(rows)
        padded = F.pad(out, (0, 0, 0, 0, 0, world * local - rows))
        send = padded.unflatten(1, (world, local)).transpose(0, 1).contiguous()  # chunk j: rank j's rows
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # recv[i]: head group i of my rows
        return recv.permute(1, 2, 0, 3, 4).reshape(batch, local, world * part, dim)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's slice [B, S_pad/P, H] -> the whole sequence [B, S, H] on every rank."""
        batch, local, width = x.shape
        full = x.new_empty(self.world * batch, local, width)
        all_gather_single(full, x.contiguous(), group=self.group)
        return full.view(self.world, batch, local, width).transpose(0, 1).reshape(batch, -1, width)[:, : self.rows]


def enable(dit, group: dist.ProcessGroup | None = None) -> SequenceParallel:
    """Split `dit`'s blocks over the ranks of `group` (every rank runs the same forward calls)."""
    world = dist.get_world_size(group)
    heads = dit.config.num_attention_heads
    if heads % world:
        raise ValueError(
            f"Sequence parallel over {world} ranks needs the {heads} attention heads to divide by {world}; "
            f"use one of {', '.join(str(p) for p in range(1, heads + 1) if heads % p == 0)} devices."
        )
    parallel = SequenceParallel(group)
    dit.sequence_parallel = parallel
    for block in dit.blocks:  # the token refiner stays whole: every rank refines all text rows
        block.attn.sequence_parallel = parallel
    return parallel


def disable(dit) -> None:
    dit.sequence_parallel = None
    for block in dit.blocks:
        block.attn.sequence_parallel = None
