"""The release's spatial-tile and temporal-chunk recipes of the H3 video VAE, as plain functions.

They take the per-tile network as a callable, so they hold no weights and no model math
(h3-model.md B.3, B.4). Tensors are [B, C, T, H, W] throughout.

Spatial tiles. A frame side of `length` pixels is covered by the fewest `tile_size` tiles whose
overlaps are all >= `min_overlap`; the slack is then added to the overlaps round-robin in steps of
the spatial compression (16 px), so every tile edge stays on the latent grid. Neighbouring tiles
are cross-faded linearly over their overlap, first with the tile above, then with the tile to the
left (both taken before they were blended themselves), and cropped. The ViT decoder normalizes its
RoPE coordinates by the extent of the tile it runs on, so the tile geometry is part of the function:
decoding with other tiles, or untiled, gives other frames.

Temporal chunks. Encode: 17-frame clips (the last one padded by repeating its last frame), each
encoded on its own (the causal padding restarts per clip) into 5 latents; the last 3 latents of the
whole video are dropped, so 17n + 5 frames -> 5n + 2 latents. Decode: chunk i takes latents
[5i, 5i + 7) and yields 28 frames; frames [3, 20) are emitted, their first 5 cross-faded with the
previous chunk's tail, frames [23, 28) are held back as the next tail; the last tail closes the
video. Latents are padded at the end (repeating the last one) to whole chunks and the frames they
produce are cut again.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

Tile = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TileLayout:
    """Tiles along one side: start offsets, a common tile length, and the overlap after each tile."""

    starts: tuple[int, ...]
    size: int
    overlaps: tuple[int, ...]

    def in_units_of(self, factor: int) -> TileLayout:
        """The same layout on a grid `factor` times coarser (pixels -> latents)."""
        return TileLayout(
            tuple(s // factor for s in self.starts), self.size // factor, tuple(o // factor for o in self.overlaps)
        )


def split_tiles(length: int, tile_size: int, min_overlap: int, step: int) -> TileLayout:
    """The release's tile layout along one side of `length` pixels (see the module docstring).

    Examples (h3-model.md B.3, tile 256, min overlap 64, step 16): 1344 -> starts 0, 176, 352, 528,
    704, 896, 1088 with overlaps 80, 80, 80, 80, 64, 64; 768 -> 0, 160, 336, 512; 320 -> 0, 64.
    """
    if tile_size >= length:
        return TileLayout((0,), length, ())
    count = math.ceil(length / tile_size)
    while tile_size * count - min_overlap * (count - 1) < length:
        count += 1
    overlaps = [min_overlap] * (count - 1)
    slack = tile_size * count - min_overlap * (count - 1) - length
    for i in range(slack // step):
        overlaps[i % (count - 1)] += step
    starts = itertools.accumulate((tile_size - overlap for overlap in overlaps), initial=0)
    return TileLayout(tuple(starts), tile_size, tuple(overlaps))


def blend(previous: torch.Tensor, current: torch.Tensor, extent: int, dim: int) -> torch.Tensor:
    """Cross-fade the last `extent` entries of `previous` into the first ones of `current` along `dim`
    with linear weights i/extent (computed in `current`'s dtype, as the release does); returns
    `current` with its head replaced by the mix."""
    extent = min(previous.shape[dim], current.shape[dim], extent)
    shape = [1] * current.ndim
    shape[dim] = extent
    ramp = (torch.arange(extent, device=current.device, dtype=current.dtype) / extent).view(shape)
    tail_of_previous = previous.narrow(dim, previous.shape[dim] - extent, extent)
    head = tail_of_previous * (1 - ramp) + current.narrow(dim, 0, extent) * ramp
    return torch.cat([head, current.narrow(dim, extent, current.shape[dim] - extent)], dim=dim)


def stitch_tiles(
    tile_at: Callable[[int, int], torch.Tensor], rows: TileLayout, cols: TileLayout, row_overlaps, col_overlaps
) -> torch.Tensor:
    """Run `tile_at(i, j)` over the grid in row-major order and blend the results into one tensor.

    `row_overlaps` / `col_overlaps` are the overlaps in the units of the tiles `tile_at` returns. A
    tile blends with the unblended bottom strip of the tile above and right strip of the tile to its
    left, as the release does; those strips are kept, copied before the tile is blended itself.
    """
    last_row, last_col = len(rows.starts) - 1, len(cols.starts) - 1
    strips_above: list[torch.Tensor] = []
    out_rows = []
    for i in range(last_row + 1):
        strips_below, strip_left, out_row = [], None, []
        for j in range(last_col + 1):
            tile = tile_at(i, j)
            if i < last_row:
                strips_below.append(tile[..., -row_overlaps[i] :, :].clone())
            strip_right = tile[..., :, -col_overlaps[j] :].clone() if j < last_col else None
            if i > 0:
                tile = blend(strips_above[j], tile, row_overlaps[i - 1], dim=-2)
            if j > 0:
                tile = blend(strip_left, tile, col_overlaps[j - 1], dim=-1)
            if i < last_row:
                tile = tile[..., : -row_overlaps[i], :]
            if j < last_col:
                tile = tile[..., :, : -col_overlaps[j]]
            out_row.append(tile)
            strip_left = strip_right
        out_rows.append(torch.cat(out_row, dim=-1))
        strips_above = strips_below
    return torch.cat(out_rows, dim=-2)


def encode_tiled(encode_tile: Tile, pixels: torch.Tensor, tile_size: int, min_overlap: int, ratio: int) -> torch.Tensor:
    """Encode [B, 3, T, H, W] pixels tile by tile; tiles are laid out in pixels and blended in latent
    space over overlap/ratio latents."""
    rows = split_tiles(pixels.shape[-2], tile_size, min_overlap, ratio)
    cols = split_tiles(pixels.shape[-1], tile_size, min_overlap, ratio)

    def tile_at(i: int, j: int) -> torch.Tensor:
        y, x = rows.starts[i], cols.starts[j]
        return encode_tile(pixels[..., y : y + rows.size, x : x + cols.size])

    latent_rows, latent_cols = rows.in_units_of(ratio), cols.in_units_of(ratio)
    return stitch_tiles(tile_at, rows, cols, latent_rows.overlaps, latent_cols.overlaps)


def decode_tiled(
    decode_tile: Tile, latents: torch.Tensor, tile_size: int, min_overlap: int, ratio: int
) -> torch.Tensor:
    """Decode [B, C, t, h, w] latents tile by tile; tiles are laid out over the h*ratio x w*ratio pixel
    frame, cut from the latents on the latent grid, and blended in pixel space."""
    rows = split_tiles(latents.shape[-2] * ratio, tile_size, min_overlap, ratio)
    cols = split_tiles(latents.shape[-1] * ratio, tile_size, min_overlap, ratio)
    latent_rows, latent_cols = rows.in_units_of(ratio), cols.in_units_of(ratio)

    def tile_at(i: int, j: int) -> torch.Tensor:
        y, x = latent_rows.starts[i], latent_cols.starts[j]
        return decode_tile(latents[..., y : y + latent_rows.size, x : x + latent_cols.size])

    return stitch_tiles(tile_at, rows, cols, rows.overlaps, cols.overlaps)


@dataclass(frozen=True)
class TemporalChunking:
    """The temporal recipe, derived from `clip_length` (17), `token_drop` (3) and the temporal
    compression (4): 5 latents per chunk, 2 overlapping latents, 3 leading frames of every decoded
    part discarded, a 5-frame cross-fade."""

    clip_length: int
    token_drop: int
    frames_per_latent: int

    @property
    def latents_per_chunk(self) -> int:
        return math.ceil(self.clip_length / self.frames_per_latent)

    @property
    def overlap_latents(self) -> int:
        return (-self.token_drop) % self.latents_per_chunk

    @property
    def lead_frames(self) -> int:
        """Frames the encoder's clip never had (17 is not a multiple of 4): dropped from every part."""
        return (-self.clip_length) % self.frames_per_latent

    @property
    def crossfade_frames(self) -> int:
        return max(self.overlap_latents * self.frames_per_latent - self.lead_frames, 0)

    @property
    def part_frames(self) -> int:
        return self.latents_per_chunk * self.frames_per_latent

    def padding_and_chunks(self, num_latents: int) -> tuple[int, int]:
        """Latents to append (repeating the last) and the number of decode chunks for L latents."""
        tokens = num_latents + self.token_drop
        pad = (-tokens) % self.latents_per_chunk
        chunks = (tokens + pad) // self.latents_per_chunk - int(self.token_drop > 0)
        return pad, chunks

    def num_frames(self, num_latents: int) -> int:
        """Pixel frames decoded from L latents: 17 per chunk plus the closing tail, minus the frames of
        the padding latents (a chunk's last latent covers clip_length % 4 = 1 frame, the others 4)."""
        pad, chunks = self.padding_and_chunks(num_latents)
        head = self.part_frames - self.lead_frames
        tail = self.overlap_latents * self.frames_per_latent - self.lead_frames if self.token_drop > 0 else 0
        short = self.clip_length % self.frames_per_latent
        padded_frames = sum(
            short if short and (num_latents + k) % self.latents_per_chunk == 0 else self.frames_per_latent
            for k in range(pad)
        )
        return chunks * head + tail - padded_frames

    def encode(self, encode_clip: Tile, pixels: torch.Tensor,
               on_clip: Callable[[int], None] | None = None) -> torch.Tensor:
        """[B, 3, F, H, W] -> moments [B, 2C, L, h, w]. One frame is encoded alone (1 -> 1 latent, no
        padding to a clip); F > 1 goes through 17-frame clips, one at a time (`encode_clips`)."""
        num_frames = pixels.shape[2]
        if num_frames == 1:
            return encode_clip(pixels)
        return self.encode_clips(encode_clip, pixels.split(self.clip_length, dim=2), on_clip)

    def encode_clips(self, encode_clip: Tile, clips: Iterable[torch.Tensor],
                     on_clip: Callable[[int], None] | None = None) -> torch.Tensor:
        """`encode` of a video given as its consecutive 17-frame clips [B, 3, 17, H, W] (the last may be
        shorter: it is padded with its last frame): the clips may be made as they are consumed, so a long
        video need never be in memory whole. `on_clip(frames encoded so far)` after each clip, before the
        next is made: a host shows progress there and may raise to stop."""
        parts, done = [], 0
        for clip in clips:
            parts.append(encode_clip(self._padded(clip)))
            done += clip.shape[2]
            if on_clip is not None:
                on_clip(done)
        moments = torch.cat(parts, dim=2)
        return moments[:, :, : moments.shape[2] - self.token_drop]

    def _padded(self, clip: torch.Tensor) -> torch.Tensor:
        missing = self.clip_length - clip.shape[2]
        return torch.cat([clip, clip[:, :, -1:].expand(-1, -1, missing, -1, -1)], dim=2) if missing else clip

    def decode(self, decode_clip: Tile, latents: torch.Tensor) -> Iterator[torch.Tensor]:
        """Yield the frames of [B, C, L, h, w] latents chunk by chunk, each block as soon as it is final.

        Blocks are [B, 3, n, H, W] with n <= 17; their concatenation along dim 2 is the whole decode.
        Only one chunk's frames and a 5-frame tail are alive at a time.
        """
        yield from self.decode_clips(lambda clips: map(decode_clip, clips), latents)

    def decode_clips(
        self, decode_all: Callable[[Iterator[torch.Tensor]], Iterator[torch.Tensor]], latents: torch.Tensor
    ) -> Iterator[torch.Tensor]:
        """`decode`, with the latent clips handed to `decode_all` as one ordered iterator; it must yield
        their frames in the same order. Each clip is cut from the latents alone (the overlap is in the
        latents, no state passes between clips), so `decode_all` may decode several at once."""
        num_latents = latents.shape[2]
        pad, chunks = self.padding_and_chunks(num_latents)
        if chunks < 1:
            minimum = self.latents_per_chunk - self.token_drop + 1 if self.token_drop else 1
            raise ValueError(
                f"Decoding needs at least {minimum} latent frames (the release's chunk recipe); got {num_latents}."
            )
        if pad:
            latents = torch.cat([latents, latents[:, :, -1:].expand(-1, -1, pad, -1, -1)], dim=2)
        remaining = self.num_frames(num_latents)
        clip_latents = self.latents_per_chunk + self.overlap_latents
        starts = range(0, chunks * self.latents_per_chunk, self.latents_per_chunk)
        tail = None
        for frames in decode_all(latents[:, :, start : start + clip_latents] for start in starts):
            head = frames[:, :, self.lead_frames : self.part_frames]
            if tail is not None:
                head = blend(tail, head, self.crossfade_frames, dim=2)
            if self.token_drop > 0:
                tail = frames[:, :, self.part_frames + self.lead_frames : 2 * self.part_frames].clone()
            block, remaining = head[:, :, :remaining], remaining - min(remaining, head.shape[2])
            if block.shape[2]:
                yield block
        if tail is not None and remaining:
            yield tail[:, :, :remaining]
