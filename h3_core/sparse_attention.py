"""Video Sparse Attention (VSA) over H3's packed rows, as FastVideo trained FastH3 8-Step V2 with it.

The packed rows are cut into tiles of 64: each prefix segment (text, condition video, audio) into
consecutive chunks that never straddle a segment, then the generated video (the packed tail, (t, h, w)
raster order in patches) into 4x4x4 boxes, ordered by (t, h, w) box and holding their rows in raster order
(boxes at the far edges hold fewer). Each tile is placed in a zero-padded 64-slot run of a tile buffer.

Per head, the tiles' mean queries and keys (fp32) score every tile pair (q_mean . k_mean / sqrt(head_dim)).
Prefix query tiles attend everything; a video query tile attends every prefix key tile ("exempt") and its
top-k video key tiles by score, k = ceil((1 - sparsity) x video tiles) (at least 1). Attention within the
selected tiles is exact (scale 1/sqrt(head_dim), pad slots masked). A learned gate (the attention's
`to_gate_compress`, zero for models trained without it) adds a compressed branch: softmax over all tile
scores times the tiles' mean values, broadcast to each tile's rows and multiplied by the gate.

`vsa_attention` computes this with a masked dense reference on any device (tiles x tiles x 64 x 64 mask:
small inputs only), or, on CUDA, with FlexAttention's block-sparse kernel at 64-row blocks.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

TILE_BOX = (4, 4, 4)  # (t, h, w) patches of a video tile
TILE_ROWS = math.prod(TILE_BOX)
STUDENT_SPARSITY = 0.8  # what FastH3 8-Step V2 was trained with (h3-model.md H.4)
# FlexAttention's tiles are ours (64 x 64); 4 warps, 3 stages: 34 ms for one call at the real size and
# sparsity 0.8 on an H200 against 54 ms with its defaults for 64-row blocks; 30 ms with full key tiles left
# unmasked and no check for query rows without keys (every row attends the prefix) (bench/RESULTS.md)
FLEX_OPTIONS = {"BLOCK_M": TILE_ROWS, "BLOCK_N": TILE_ROWS, "num_warps": 4, "num_stages": 3,
                "ROWS_GUARANTEED_SAFE": True}


@dataclass(frozen=True, eq=False)  # compared by identity: a kernel's compiled mask is kept per tiling
class VSATiles:
    """Where each packed row sits in the tile buffer (`slots`, [rows]), each tile's count of real rows
    (`sizes`, [tiles]) and how many tiles are prefix (the first) and video (the rest)."""

    slots: torch.Tensor
    sizes: torch.Tensor
    prefix_tiles: int
    video_tiles: int

    @property
    def tiles(self) -> int:
        return self.prefix_tiles + self.video_tiles


@dataclass(frozen=True, eq=False)
class SparsePlan:
    """One forward's Video Sparse Attention: its rows' tiling and the share of video key tiles left out."""

    tiles: VSATiles
    sparsity: float


def vsa_tiles(prefix_segments: Sequence[int], video_grid: tuple[int, int, int],
              device: torch.device | str = "cpu") -> VSATiles:
    """The tiling of rows packed as [prefix segments in order | video (t, h, w) raster], see the module doc."""
    sizes: list[int] = []
    for segment in prefix_segments:
        full, rest = divmod(int(segment), TILE_ROWS)
        sizes += [TILE_ROWS] * full + ([rest] if rest else [])
    prefix_tiles, prefix_rows = len(sizes), sum(int(s) for s in prefix_segments)
    grid = torch.arange(math.prod(video_grid)).reshape(video_grid)
    video_order = []
    for t in range(0, video_grid[0], TILE_BOX[0]):
        for h in range(0, video_grid[1], TILE_BOX[1]):
            for w in range(0, video_grid[2], TILE_BOX[2]):
                box = grid[t:t + TILE_BOX[0], h:h + TILE_BOX[1], w:w + TILE_BOX[2]].flatten()
                video_order.append(box)
                sizes.append(box.numel())
    # rows in tile order: the prefix as packed, then the video box by box; each fills its tile's first slots
    tile_order = torch.cat([torch.arange(prefix_rows)] + [box + prefix_rows for box in video_order])
    counts = torch.tensor(sizes)
    starts = torch.arange(len(sizes)) * TILE_ROWS
    filled = (starts.repeat_interleave(counts) + torch.arange(int(counts.sum()))
              - (counts.cumsum(0) - counts).repeat_interleave(counts))
    slots = torch.empty_like(filled)
    slots[tile_order] = filled
    return VSATiles(slots.to(device), counts.to(device), prefix_tiles, len(sizes) - prefix_tiles)


def check_sparsity(sparsity: float) -> float:
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"VSA sparsity is the share of video key tiles left out, 0 <= sparsity < 1; got {sparsity}.")
    return sparsity


def topk_tiles(sparsity: float, video_tiles: int) -> int:
    return max(1, min(math.ceil((1 - sparsity) * video_tiles), video_tiles))


def tile_means(x: torch.Tensor, tiles: VSATiles) -> torch.Tensor:
    """Tile buffer [B, tiles x 64, H, D] -> each tile's mean row, fp32 [B, H, tiles, D] (pads are zero)."""
    batch, _, heads, dim = x.shape
    summed = x.view(batch, tiles.tiles, TILE_ROWS, heads, dim).sum(dim=2, dtype=torch.float32)
    return (summed / tiles.sizes.view(1, -1, 1, 1)).permute(0, 2, 1, 3)


def select_tiles(scores: torch.Tensor, tiles: VSATiles, sparsity: float) -> torch.Tensor:
    """Tile scores [B, H, tiles, tiles] -> which key tiles each query tile attends (bool, same shape)."""
    keep = topk_tiles(sparsity, tiles.video_tiles)
    if keep == tiles.video_tiles:
        return torch.ones_like(scores, dtype=torch.bool)
    chosen = torch.zeros_like(scores, dtype=torch.bool)
    best = scores[..., tiles.prefix_tiles:].topk(keep, dim=-1).indices + tiles.prefix_tiles
    chosen.scatter_(-1, best, True)
    chosen[..., :tiles.prefix_tiles] = True  # prefix keys for every query
    chosen[:, :, :tiles.prefix_tiles, :] = True  # prefix queries attend everything
    return chosen


def to_tiles(x: torch.Tensor, tiles: VSATiles) -> torch.Tensor:
    """Packed rows [B, rows, H, D] -> the zero-padded tile buffer [B, tiles x 64, H, D]."""
    buffer = x.new_zeros(x.shape[0], tiles.tiles * TILE_ROWS, *x.shape[2:])
    buffer[:, tiles.slots] = x
    return buffer


def vsa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tiles: VSATiles, sparsity: float,
                  gate: torch.Tensor | None = None, kernel: str = "auto") -> torch.Tensor:
    """VSA of packed [B, rows, H, D] inputs (`gate` the same shape, or None) -> [B, rows, H, D].
    `kernel`: "dense" (masked reference), "flex" (FlexAttention, CUDA) or "auto" (flex on CUDA)."""
    if query.shape[1] != tiles.slots.numel():
        raise ValueError(f"VSA tiles were made for {tiles.slots.numel()} rows, got {query.shape[1]}.")
    check_sparsity(sparsity)
    if kernel not in ("auto", "dense", "flex"):
        raise ValueError(f"Unknown VSA kernel {kernel!r}; choose auto, dense or flex.")
    q, k, v = (to_tiles(x, tiles) for x in (query, key, value))
    scores = tile_means(q, tiles) @ tile_means(k, tiles).transpose(-2, -1) / query.shape[-1] ** 0.5
    chosen = select_tiles(scores, tiles, sparsity)
    if kernel == "auto":
        kernel = "flex" if query.is_cuda else "dense"
    out = (_flex_tiles if kernel == "flex" else _dense_tiles)(q, k, v, chosen, tiles)
    if gate is not None:
        compressed = (scores.softmax(dim=-1) @ tile_means(v, tiles)).permute(0, 2, 1, 3).to(out.dtype)
        batch, rows, heads, dim = out.shape
        gated = to_tiles(gate, tiles).view(batch, tiles.tiles, TILE_ROWS, heads, dim)
        out = (out.view(batch, tiles.tiles, TILE_ROWS, heads, dim) + compressed.unsqueeze(2) * gated).view(out.shape)
    return out[:, tiles.slots]


def _valid_slots(tiles: VSATiles) -> torch.Tensor:
    return (torch.arange(TILE_ROWS, device=tiles.sizes.device) < tiles.sizes[:, None]).flatten()


def _dense_tiles(q, k, v, chosen: torch.Tensor, tiles: VSATiles) -> torch.Tensor:
    """Reference: attention over the tile buffer with the selection expanded to a row mask."""
    allowed = chosen.repeat_interleave(TILE_ROWS, dim=-2).repeat_interleave(TILE_ROWS, dim=-1) & _valid_slots(tiles)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed)
    return out.transpose(1, 2)


def _flex_tiles(q, k, v, chosen: torch.Tensor, tiles: VSATiles) -> torch.Tensor:
    """FlexAttention with a block mask at 64-row blocks (one block a tile): key tiles with pad slots are masked
    per row, full ones are "full blocks", which the kernel takes without evaluating a mask."""
    from torch.nn.attention.flex_attention import BlockMask

    full = tiles.sizes == TILE_ROWS
    mask = BlockMask.from_kv_blocks(*_block_lists(chosen & ~full), *_block_lists(chosen & full),
                                    BLOCK_SIZE=TILE_ROWS, mask_mod=_pad_mask(tiles), compute_q_blocks=False)
    out = _compiled_flex()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask,
                           kernel_options=FLEX_OPTIONS)
    return out.transpose(1, 2)


def _block_lists(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Selected key tiles [B, H, tiles, tiles] (bool) -> FlexAttention's per-query-tile count and key tile list
    (the selected tiles in tile order, then zeros): each selected tile is written at its rank among the row's
    selected ones, a running count, where a sort of every row would cost several times more."""
    tiles = chosen.shape[-1]
    rank = torch.where(chosen, chosen.cumsum(dim=-1, dtype=torch.int32) - 1, tiles)  # the rest to a spare column
    lists = torch.zeros(*chosen.shape[:-1], tiles + 1, dtype=torch.int32, device=chosen.device)
    order = torch.arange(tiles, dtype=torch.int32, device=chosen.device).expand(chosen.shape)
    lists.scatter_(-1, rank.long(), order)
    return chosen.sum(dim=-1, dtype=torch.int32), lists[..., :tiles]


@functools.lru_cache(maxsize=8)
def _pad_mask(tiles: VSATiles):
    """FlexAttention's mask_mod masking pad key slots; one function per tiling, so compiled kernels are reused."""
    valid = _valid_slots(tiles)
    return lambda batch, head, query_index, key_index: valid[key_index]


_FLEX = None


def _compiled_flex():
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX
