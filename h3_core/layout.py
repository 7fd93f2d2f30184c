"""The packed sequence the DiT denoises: row order, positions, tags and clocks (h3-model.md A.4-A.6).

t2va / fl2va:  [ text (T) | keyframe rows | guides | target audio (A ch0 rows, A ch1 rows) | target video (L*R) ]
ref2va:        [ text (T) | guides | reference blocks in request order | target audio | target video ]
window (long video, G):  [ text | guide video | guide audio | references | target audio | target video ]
with R = (h/2)*(w/2) rows per latent frame. Per row: `position_ids` [S, 3] float64 (t, h, w),
`token_tags` [S] (0 video, 1 text, 2 audio; they address the AdaLN table) and `row_clock` [S]
(which timestep the row takes each step). Video rows are patchified latents:
[B, C, L, h, w] <-> [B, L*(h/2)*(w/2), C*4]. Within each modality, conditioning rows come first.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from einops import rearrange

from . import geometry
from .sparse_attention import VSATiles, vsa_tiles

VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2  # checkpoint contract

# Rotary time: 40 units per second for both modalities, so an audio latent is 1 unit and a pixel
# frame 5/3. A latent frame starts (1, 4, 4, 4, 4, 1, 4, ...) pixel frames after the previous one:
# the VAE's first latent of a chunk covers one frame, the other four cover four each.
FRAME_TIME = geometry.AUDIO_LATENTS_PER_SECOND / geometry.FPS
# Visual conditions (keyframes, references, guides) sit just off clean: t = 1 is off-distribution. The noise mix
# (noise.condition_rows) and the clock the DiT reads for those rows (row_timesteps) both use it.
VISUAL_CONDITION_T = 0.999
PIXEL_FRAMES_PER_LATENT = (1, 4, 4, 4, 4)
SPATIAL_SCALE = 32.0

KEYFRAME_ANCHORS = ("first", "last")


class RowClock(enum.IntEnum):
    """Which timestep a row takes in a step (A.5)."""

    VIDEO = 0  # target video rows and all text rows: t_video
    AUDIO = 1  # target audio rows: t_audio
    VISUAL_CONDITION = 2  # keyframe / reference / guide video rows: max(t_video, 0.999)
    AUDIO_CONDITION = 3  # reference / guide audio rows: 1.0


# ----------------------------------------------------------------------------------------------
# Patchify


def patched_rows(latents: Sequence[torch.Tensor]) -> int:
    """The rows `patchify` packs latents [1, C, L, h, w] into, all of them together, without packing them."""
    pt, ph, pw = geometry.PATCH_SIZE
    return sum((z.shape[2] // pt) * (z.shape[3] // ph) * (z.shape[4] // pw) for z in latents)


def patchify(latents: torch.Tensor, patch_size: tuple[int, int, int] = geometry.PATCH_SIZE) -> torch.Tensor:
    """[B, C, L, h, w] -> [B, (L/pt)*(h/ph)*(w/pw), C*pt*ph*pw]; rows frame-major, then row-major."""
    pt, ph, pw = patch_size
    _, _, frames, height, width = latents.shape
    if frames % pt or height % ph or width % pw:
        raise ValueError(f"Latents of shape {list(latents.shape)} do not divide into patches {tuple(patch_size)}.")
    return rearrange(latents, "b c (l pt) (h ph) (w pw) -> b (l h w) (c pt ph pw)", pt=pt, ph=ph, pw=pw)


def unpatchify(
    rows: torch.Tensor,
    latent_frames: int,
    latent_height: int,
    latent_width: int,
    patch_size: tuple[int, int, int] = geometry.PATCH_SIZE,
) -> torch.Tensor:
    """[B, N, C*pt*ph*pw] -> [B, C, L, h, w]; the inverse of `patchify`."""
    pt, ph, pw = patch_size
    return rearrange(
        rows,
        "b (l h w) (c pt ph pw) -> b c (l pt) (h ph) (w pw)",
        l=latent_frames // pt,
        h=latent_height // ph,
        w=latent_width // pw,
        pt=pt,
        ph=ph,
        pw=pw,
    )


# ----------------------------------------------------------------------------------------------
# Positions


def spatial_axis(size: int, patch: int, sqrt_area: float) -> np.ndarray:
    """Rotary coordinates of one spatial axis of `size` latents: size/patch points, float64.

    The axis is normalized by sqrt(h*w) and centred on [0, 1) (a square canvas spans [0, 32)).
    """
    ratio = size / sqrt_area
    left = (1.0 - ratio) / 2.0
    # np.linspace(endpoint=False) computes start + arange(n) * (stop - start) / n; torch.linspace
    # rounds differently, and the float64 grid must match the reference bit for bit.
    return np.linspace(left, left + ratio, size // patch, endpoint=False) * SPATIAL_SCALE


def frame_grid(
    latent_height: int, latent_width: int, patch_size: tuple[int, int, int] = geometry.PATCH_SIZE
) -> tuple[torch.Tensor, np.ndarray]:
    """(h, w) positions of one latent frame's rows [R, 2] float64 (row-major), and its width axis."""
    _, ph, pw = patch_size
    sqrt_area = np.sqrt(latent_height * latent_width)
    h_axis = spatial_axis(latent_height, ph, sqrt_area)
    w_axis = spatial_axis(latent_width, pw, sqrt_area)
    hh, ww = np.meshgrid(h_axis, w_axis, indexing="ij")
    return torch.from_numpy(np.stack([hh.reshape(-1), ww.reshape(-1)], axis=-1)), w_axis


def _frame_spans(num_latent_frames: int) -> np.ndarray:
    """Rotary time from each latent frame to the next, float64 [L]: 5/3 * (1, 4, 4, 4, 4, 1, ...)."""
    pattern = np.resize(np.asarray(PIXEL_FRAMES_PER_LATENT, dtype=np.float64), num_latent_frames)
    return FRAME_TIME * pattern


def latent_frame_times(num_latent_frames: int, origin: float) -> np.ndarray:
    """Rotary time of every latent frame, float64 [L]: origin + a sequential running sum of spans."""
    offsets = np.concatenate([[0.0], np.cumsum(_frame_spans(num_latent_frames)[:-1])])
    return origin + offsets


def last_pixel_frame_time(num_latent_frames: int, origin: float) -> float:
    """Rotary time of the last pixel frame, where an FL2VA "last" keyframe sits: origin + 5/3 * (F-1).

    The reference sums the span series with numpy's pairwise summation (not sequentially), then
    adds it to the origin and subtracts 5/3, in that order; from 16 latent frames on the other
    orders differ in the last ulp.
    """
    return float(origin) + float(np.sum(_frame_spans(num_latent_frames))) - FRAME_TIME


# ----------------------------------------------------------------------------------------------
# The layout


@dataclass(frozen=True)
class PackedLayout:
    """One request's packed sequence. Index tensors are int64 row positions in sequence order."""

    position_ids: torch.Tensor  # [S, 3] float64 (t, h, w)
    token_tags: torch.Tensor  # [S] int64, VIDEO_TAG / TEXT_TAG / AUDIO_TAG
    row_clock: torch.Tensor  # [S] int64, RowClock values
    text_indices: torch.Tensor  # [T]
    video_indices: torch.Tensor  # [Nv], conditioning rows first
    audio_indices: torch.Tensor  # [Na], conditioning rows first
    num_condition_video_rows: int
    num_condition_audio_rows: int
    latent_frames: int  # target geometry from here on
    latent_height: int
    latent_width: int
    audio_latents: int  # per channel

    @property
    def sequence_length(self) -> int:
        return self.position_ids.shape[0]

    @property
    def num_text_rows(self) -> int:
        return self.text_indices.shape[0]

    @property
    def target_video_indices(self) -> torch.Tensor:
        return self.video_indices[self.num_condition_video_rows :]

    @property
    def target_audio_indices(self) -> torch.Tensor:
        return self.audio_indices[self.num_condition_audio_rows :]

    @property
    def target_video_span(self) -> tuple[int, int]:
        """(first row of the target video, rows per latent frame): every layout here ends with the target
        video, frame-major (the DiT's attention window relies on it)."""
        _, ph, pw = geometry.PATCH_SIZE
        rows_per_frame = (self.latent_height // ph) * (self.latent_width // pw)
        return self.sequence_length - self.latent_frames * rows_per_frame, rows_per_frame

    def vsa_tiles(self, device: torch.device | str | None = None) -> VSATiles:
        """Video Sparse Attention's tiling of these rows (sparse_attention.py). FastVideo's VSA takes rows packed
        as [text | condition video | audio | target video], the target video frame-major at the end; other
        packings (reference blocks) are refused."""
        text, condition, audio = self.num_text_rows, self.num_condition_video_rows, self.audio_indices.numel()
        start, _ = self.target_video_span
        runs = ((self.text_indices, 0), (self.video_indices[:condition], text), (self.audio_indices, text + condition),
                (self.target_video_indices, start))
        if start != text + condition + audio or not all(
                torch.equal(indices.cpu(), torch.arange(first, first + indices.numel())) for indices, first in runs):
            raise ValueError("Video Sparse Attention needs rows packed as [text | condition video | audio | video] "
                             "(as FastVideo packs them); this request's are not (a video reference, say).")
        _, ph, pw = geometry.PATCH_SIZE
        grid = (self.latent_frames, self.latent_height // ph, self.latent_width // pw)
        return vsa_tiles((text, condition, audio), grid, device or self.position_ids.device)

    def row_timesteps(self, t_video: float, t_audio: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's distinct timesteps [K] float32 (sorted) and each row's index into them [S] int64.

        t = 1 - sigma (1 is clean). Equal to `torch.unique(per_row_t, sorted=True, return_inverse=True)`
        over the float32 per-row timesteps, computed over the four clocks instead of S rows.
        """
        t_video, t_audio = float(t_video), float(t_audio)
        per_clock = torch.tensor(  # indexed by RowClock
            [t_video, t_audio, max(t_video, VISUAL_CONDITION_T), 1.0],
            dtype=torch.float32,
            device=self.row_clock.device,
        )
        present = torch.bincount(self.row_clock, minlength=len(RowClock)).nonzero().squeeze(1)
        timesteps, clock_to_index = torch.unique(per_clock[present], sorted=True, return_inverse=True)
        lookup = torch.zeros(len(RowClock), dtype=torch.int64, device=self.row_clock.device)
        lookup[present] = clock_to_index
        return timesteps, lookup[self.row_clock]

    def locked(self, modality: str) -> PackedLayout:
        """This layout with its target `modality` ("video" or "audio") held as conditioning: the rows keep
        their positions and tags, take the conditioning clock (video max(t_video, 0.999), audio 1.0, as
        keyframes and driving audio do) and count as conditioning rows, so the sampler never writes them.
        A driving track's window is `locked("audio")` (long_video.py)."""
        if modality not in ("video", "audio"):
            raise ValueError(f"A layout locks its target 'video' or 'audio', got {modality!r}.")
        targets = self.target_video_indices if modality == "video" else self.target_audio_indices
        row_clock = self.row_clock.clone()
        row_clock[targets] = RowClock.VISUAL_CONDITION if modality == "video" else RowClock.AUDIO_CONDITION
        counts = {"num_condition_video_rows": self.video_indices.numel()} if modality == "video" else {
            "num_condition_audio_rows": self.audio_indices.numel()}
        return dataclasses.replace(self, row_clock=row_clock, **counts)

    @property
    def locked_modality(self) -> str | None:
        """The modality ("video" or "audio") that has no rows to generate (a locked layout), else None."""
        if not self.target_video_indices.numel():
            return "video"
        return None if self.target_audio_indices.numel() else "audio"

    def to(self, device: torch.device | str) -> PackedLayout:
        """The layout's tensors on `device`. MPS has no float64: there the positions go as float32, the
        precision the DiT reads them in (`dit.rope_tables`), so the tables are the same."""
        device = torch.device(device)
        narrow = device.type == "mps"
        moved = {
            field.name: (value.float() if narrow and value.dtype == torch.float64 else value).to(device)
            for field in dataclasses.fields(self)
            if isinstance(value := getattr(self, field.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)


class _SequenceBuilder:
    """Appends segments in sequence order, recording each row's position, tag and clock."""

    def __init__(self) -> None:
        self.length = 0
        self._positions: list[torch.Tensor] = []
        self._tags: list[torch.Tensor] = []
        self._clocks: list[torch.Tensor] = []
        self._rows: dict[str, list[torch.Tensor]] = {"text": [], "video": [], "audio": []}
        self._condition_rows = {"video": 0, "audio": 0}
        self._has_target = {"video": False, "audio": False}

    def _append(self, kind: str, positions: torch.Tensor, tags: torch.Tensor, clock: RowClock, condition: bool):
        count = positions.shape[0]
        self._positions.append(positions)
        self._tags.append(tags)
        self._clocks.append(torch.full((count,), int(clock), dtype=torch.int64))
        self._rows[kind].append(torch.arange(self.length, self.length + count))
        if kind in self._has_target:
            if condition and self._has_target[kind]:
                raise ValueError(f"{kind} conditioning rows must come before the target {kind} rows.")
            self._has_target[kind] |= not condition
            self._condition_rows[kind] += count if condition else 0
        self.length += count

    def text(self, text_tags: torch.Tensor) -> None:
        """Text rows at (j, 0, 0), on the video clock."""
        count = text_tags.shape[0]
        positions = torch.zeros(count, 3, dtype=torch.float64)
        positions[:, 0] = torch.arange(count, dtype=torch.float64)
        self._append("text", positions, text_tags.to(torch.int64), RowClock.VIDEO, condition=False)

    def video(self, frame_times: np.ndarray, grid: torch.Tensor, clock: RowClock) -> None:
        """Latent frames at the given times, each a full grid of rows [R, 2] (frame-major)."""
        rows_per_frame = grid.shape[0]
        positions = torch.empty(len(frame_times), rows_per_frame, 3, dtype=torch.float64)
        positions[:, :, 0] = torch.from_numpy(np.asarray(frame_times, dtype=np.float64))[:, None]
        positions[:, :, 1:] = grid[None]
        tags = torch.full((positions.shape[0] * rows_per_frame,), VIDEO_TAG, dtype=torch.int64)
        self._append("video", positions.reshape(-1, 3), tags, clock, clock == RowClock.VISUAL_CONDITION)

    def audio(self, num_latents: int, origin: float, w_axis: np.ndarray, clock: RowClock) -> None:
        """Stereo audio, channel-major: t = origin + j, h = 0, w = leftmost (ch0) / rightmost (ch1) column."""
        times = float(origin) + torch.arange(num_latents, dtype=torch.float64)
        positions = torch.zeros(geometry.AUDIO_CHANNELS, num_latents, 3, dtype=torch.float64)
        positions[:, :, 0] = times
        positions[0, :, 2] = float(w_axis[0])
        positions[1, :, 2] = float(w_axis[-1])
        tags = torch.full((positions.shape[0] * num_latents,), AUDIO_TAG, dtype=torch.int64)
        self._append("audio", positions.reshape(-1, 3), tags, clock, clock == RowClock.AUDIO_CONDITION)

    def finish(self, latent_frames: int, latent_height: int, latent_width: int, audio_latents: int) -> PackedLayout:
        def indices(kind: str) -> torch.Tensor:
            return torch.cat(self._rows[kind]) if self._rows[kind] else torch.zeros(0, dtype=torch.int64)

        return PackedLayout(
            position_ids=torch.cat(self._positions),
            token_tags=torch.cat(self._tags),
            row_clock=torch.cat(self._clocks),
            text_indices=indices("text"),
            video_indices=indices("video"),
            audio_indices=indices("audio"),
            num_condition_video_rows=self._condition_rows["video"],
            num_condition_audio_rows=self._condition_rows["audio"],
            latent_frames=latent_frames,
            latent_height=latent_height,
            latent_width=latent_width,
            audio_latents=audio_latents,
        )


def _checked_text_tags(text_tags: torch.Tensor | Sequence[int]) -> torch.Tensor:
    tags = torch.as_tensor(text_tags).to("cpu", torch.int64)
    if tags.dim() != 1:
        raise ValueError(f"text_tags must be one tag per text row, shape [T]; got shape {list(tags.shape)}.")
    if not bool(((tags == TEXT_TAG) | (tags == VIDEO_TAG)).all()):
        raise ValueError(
            f"text_tags must be {TEXT_TAG} (text) or {VIDEO_TAG} (rows of a vision block); "
            f"got values {sorted(set(tags.tolist()))}."
        )
    return tags


@dataclass(frozen=True)
class GuideBlock:
    """The shape a guide takes in a layout (guides.py; a long-video window's latent tail is one at frame
    0): `latent_frames` latent frames on the target grid (0: a sound only), then `audio_latents` stereo
    latents per channel (0: no sound), both anchored at pixel frame `frame_index` of the target video."""

    frame_index: int
    latent_frames: int
    audio_latents: int = 0

    def __post_init__(self):
        if self.frame_index < 0 or self.latent_frames < 0 or self.audio_latents < 0:
            raise ValueError(f"A guide block's frame index and sizes must be >= 0, got {self}.")
        if not self.latent_frames and not self.audio_latents:
            raise ValueError(f"A guide block holds video latents, audio latents or both, got {self}.")


def build_t2va_layout(
    text_tags: torch.Tensor | Sequence[int],
    latent_frames: int,
    latent_height: int,
    latent_width: int,
    audio_latents: int,
    keyframe_anchors: Sequence[str] = (),
    patch_size: tuple[int, int, int] = geometry.PATCH_SIZE,
    guides: Sequence[GuideBlock] = (),
) -> PackedLayout:
    """`[text | keyframe rows | guides | target audio | target video]` for t2va (no anchors) and fl2va.

    `text_tags` [T]: 1 for text rows, 0 for the rows of a vision block in the text stream.
    `keyframe_anchors`: one entry per keyframe block in packed order, "first" or "last"; each block
    is one latent frame on the target grid, at the time of the first / last pixel frame.
    `guides`: in packed order, each its video latent frames (target grid, conditioning clock) from
    t = origin + 5/3 * frame_index, then its audio latents (target audio columns, clean) from the same
    t, as ComfyUI's native H3 keyframes are laid out.
    """
    tags = _checked_text_tags(text_tags)
    _, ph, pw = patch_size
    if latent_frames < 1 or audio_latents < 1:
        raise ValueError(f"Need at least one latent frame and one audio latent, got {latent_frames}, {audio_latents}.")
    if latent_height % ph or latent_width % pw:
        raise ValueError(f"Latent size {latent_height}x{latent_width} does not divide into {ph}x{pw} patches.")
    for anchor in keyframe_anchors:
        if anchor not in KEYFRAME_ANCHORS:
            raise ValueError(f"A keyframe anchor must be one of {KEYFRAME_ANCHORS}, got {anchor!r}.")
    if len(set(keyframe_anchors)) != len(keyframe_anchors):
        raise ValueError(f"Each keyframe anchor may be used once, got {tuple(keyframe_anchors)}.")

    origin = float(tags.shape[0])  # the media clock starts where the text ends
    grid, w_axis = frame_grid(latent_height, latent_width, patch_size)
    sequence = _SequenceBuilder()
    sequence.text(tags)
    for anchor in keyframe_anchors:
        time = origin if anchor == "first" else last_pixel_frame_time(latent_frames, origin)
        sequence.video(np.array([time]), grid, RowClock.VISUAL_CONDITION)
    _guide_rows(sequence, guides, origin, grid, w_axis)
    sequence.audio(audio_latents, origin, w_axis, RowClock.AUDIO)
    sequence.video(latent_frame_times(latent_frames, origin), grid, RowClock.VIDEO)
    return sequence.finish(latent_frames, latent_height, latent_width, audio_latents)


def _guide_rows(sequence: _SequenceBuilder, guides: Sequence[GuideBlock], origin: float, grid: torch.Tensor,
                w_axis: np.ndarray) -> None:
    """Each guide's video latent frames (target grid) then audio latents, from origin + 5/3 * frame index."""
    for guide in guides:
        anchor = origin + FRAME_TIME * guide.frame_index
        if guide.latent_frames:
            sequence.video(latent_frame_times(guide.latent_frames, anchor), grid, RowClock.VISUAL_CONDITION)
        if guide.audio_latents:
            sequence.audio(guide.audio_latents, anchor, w_axis, RowClock.AUDIO_CONDITION)


def build_request_layout(
    width: int,
    height: int,
    num_frames: int,
    text_tags: torch.Tensor | Sequence[int],
    keyframe_anchors: Sequence[str] = (),
) -> PackedLayout:
    """t2va / fl2va layout from a pixel canvas and a 17n+5 pixel frame count."""
    geometry.check_canvas(width, height)
    latent_height, latent_width = geometry.latent_size(width, height)
    return build_t2va_layout(
        text_tags,
        geometry.latent_frames(num_frames),
        latent_height,
        latent_width,
        geometry.audio_latents(num_frames),
        keyframe_anchors,
    )


def pack_audio(latents: torch.Tensor) -> torch.Tensor:
    """[B, channels, C, A] per-channel latents -> [B, channels*A, C] rows, channel-major (left, then right)."""
    return rearrange(latents, "b ch c a -> b (ch a) c")


def unpack_audio(rows: torch.Tensor, channels: int = geometry.AUDIO_CHANNELS) -> torch.Tensor:
    """[B, channels*A, C] rows -> [B, channels, C, A]: one mono latent per stereo channel, as the audio VAE takes."""
    return rearrange(rows, "b (ch a) c -> b ch c a", ch=channels)


# ----------------------------------------------------------------------------------------------
# Ref2VA

REFERENCE_KINDS = ("image", "video", "audio")


@dataclass(frozen=True)
class ReferenceBlock:
    """The shape one ref2va reference takes in the packed sequence, read off its encoded latents.

    image: one latent frame of (latent_height, latent_width), its own grid (2048 short edge at release).
    video: `latent_frames` frames of its own grid, preceded by `audio_latents` soundtrack latents per
           channel (0 = silent video).
    audio: `audio_latents` latents per channel (a standalone audio reference).
    """

    kind: str
    latent_frames: int = 0
    latent_height: int = 0
    latent_width: int = 0
    audio_latents: int = 0

    @classmethod
    def image(cls, latent_height: int, latent_width: int) -> ReferenceBlock:
        return cls("image", 1, latent_height, latent_width)

    @classmethod
    def video(cls, latent_frames: int, latent_height: int, latent_width: int, audio_latents: int = 0) -> ReferenceBlock:
        return cls("video", latent_frames, latent_height, latent_width, audio_latents)

    @classmethod
    def audio(cls, audio_latents: int) -> ReferenceBlock:
        return cls("audio", audio_latents=audio_latents)

    def __post_init__(self):
        if self.kind not in REFERENCE_KINDS:
            raise ValueError(f"A reference block is one of {REFERENCE_KINDS}, got {self.kind!r}.")
        visual = self.kind != "audio"
        if visual and (self.latent_frames < 1 or self.latent_height < 1 or self.latent_width < 1):
            raise ValueError(f"A {self.kind} reference block needs a positive latent size, got {self}.")
        if self.kind == "image" and (self.latent_frames != 1 or self.audio_latents):
            raise ValueError(f"An image reference block is one latent frame without audio, got {self}.")
        if self.kind == "audio" and (self.audio_latents < 1 or self.latent_frames or self.latent_height):
            raise ValueError(f"An audio reference block needs audio latents only, got {self}.")
        if self.audio_latents < 0:
            raise ValueError(f"audio_latents must be >= 0, got {self.audio_latents}.")


def reference_clock_advance(block: ReferenceBlock) -> float:
    """How far a reference block moves the ref2va clock (A.6): 1 for an image, A for an audio clip, and
    max(A, span(L)) for a video, the video span summed in float64 by Python's built-in `sum`, as the
    reference does: sequentially before Python 3.12, with compensated (Neumaier) summation from 3.12 on.
    The FL2VA last-keyframe anchor sums the same series with numpy's pairwise sum instead; from 16 latent
    frames on the orders differ in the last ulp, so each call site keeps its own."""
    if block.kind == "image":
        return 1.0
    if block.kind == "audio":
        return float(block.audio_latents)
    return max(float(block.audio_latents), sum(_frame_spans(block.latent_frames).tolist()))


def build_ref2va_layout(
    text_tags: torch.Tensor | Sequence[int],
    references: Sequence[ReferenceBlock],
    latent_frames: int,
    latent_height: int,
    latent_width: int,
    audio_latents: int,
    patch_size: tuple[int, int, int] = geometry.PATCH_SIZE,
    guides: Sequence[GuideBlock] = (),
) -> PackedLayout:
    """`[text | guides | reference blocks in request order | target audio | target video]` for ref2va (A.4, A.6).

    A clock cursor starts at T (the text length). Image: its rows at t = cursor, own grid; cursor += 1.
    Standalone audio (A_ref): t = cursor + j, w at the target grid's extreme columns; cursor += A_ref.
    Video: its soundtrack rows (if any; w at the video's own grid extremes) immediately followed by its
    video rows, both from t = cursor; cursor += max(A_ref, span(L_ref)). Target audio and video start at
    the final cursor. Visual reference rows take the VISUAL_CONDITION clock, reference audio rows
    AUDIO_CONDITION; as everywhere, conditioning rows come first within each modality. `guides` (guides.py)
    pack after the text as in `build_t2va_layout`, anchored at the target's origin (after the references).
    """
    if not references:
        raise ValueError("A ref2va layout needs at least one reference block; without any use build_t2va_layout.")
    # a long-video window with no guide, offset or lock is exactly this layout: one builder for both
    return build_window_layout(text_tags, references, latent_frames, latent_height, latent_width, audio_latents,
                               patch_size=patch_size, guides=guides)


def _reference_rows(
    sequence: _SequenceBuilder,
    references: Sequence[ReferenceBlock],
    cursor: float,
    target_w_axis: np.ndarray,
    patch_size: tuple[int, int, int],
    time_offset: float = 0.0,
) -> float:
    """Appends the reference blocks in request order from clock `cursor`; returns the cursor after them.
    `time_offset` (long video) moves reference audio and video rows, not image rows, and not the cursor."""
    for block in references:
        moved = cursor + time_offset
        if block.kind == "image":
            grid, _ = frame_grid(block.latent_height, block.latent_width, patch_size)
            sequence.video(np.full(block.latent_frames, cursor), grid, RowClock.VISUAL_CONDITION)
        elif block.kind == "audio":
            sequence.audio(block.audio_latents, moved, target_w_axis, RowClock.AUDIO_CONDITION)
        else:
            grid, w_axis = frame_grid(block.latent_height, block.latent_width, patch_size)
            if block.audio_latents:
                sequence.audio(block.audio_latents, moved, w_axis, RowClock.AUDIO_CONDITION)
            sequence.video(latent_frame_times(block.latent_frames, moved), grid, RowClock.VISUAL_CONDITION)
        cursor += reference_clock_advance(block)
    return cursor


# ----------------------------------------------------------------------------------------------
# Long-video windows (h3-model.md A.4, A.6, G)


def build_window_layout(
    text_tags: torch.Tensor | Sequence[int],
    references: Sequence[ReferenceBlock],
    latent_frames: int,
    latent_height: int,
    latent_width: int,
    audio_latents: int,
    *,
    time_offset: float = 0.0,
    media_origin: float | None = None,
    guide_latent_frames: int = 0,
    guide_audio_latents: int = 0,
    patch_size: tuple[int, int, int] = geometry.PATCH_SIZE,
    guides: Sequence[GuideBlock] = (),
) -> PackedLayout:
    """One window of a long video:
    `[text | guide video | guide audio | guides | reference blocks | target audio | target video]`.

    With no guide, offset or origin this is `build_t2va_layout` (no references) or
    `build_ref2va_layout`, row for row.
    media_origin  where the media clock starts (default T, the text length). With one prompt per
                  window, the longest text length: every window keeps one clock.
    time_offset   `start_frame * 40/24`, added to the time of target, guide and reference audio/video
                  rows; text rows, image references and the clock cursor keep theirs.
    guide_*       the previous result's tail: latent frames on the target grid, then stereo audio
                  latents (channel-major), both from the target's time origin (guides never advance
                  the clock); clocks VISUAL_CONDITION (0.999 floor) and AUDIO_CONDITION (t = 1).
    guides        guides.py's blocks, each from the target's time origin + 5/3 * its frame index.
    """
    tags = _checked_text_tags(text_tags)
    _, ph, pw = patch_size
    if latent_frames < 1 or audio_latents < 1:
        raise ValueError(f"Need at least one latent frame and one audio latent, got {latent_frames}, {audio_latents}.")
    sizes = [(latent_height, latent_width)]
    sizes += [(block.latent_height, block.latent_width) for block in references if block.kind != "audio"]
    for height, width in sizes:
        if height < 1 or width < 1 or height % ph or width % pw:
            raise ValueError(f"Latent size {height}x{width} does not divide into {ph}x{pw} patches.")
    if guide_latent_frames < 0 or guide_audio_latents < 0 or (guide_latent_frames == 0) != (guide_audio_latents == 0):
        raise ValueError(
            f"A guide has both video and audio latents (or neither); got {guide_latent_frames} latent frames "
            f"and {guide_audio_latents} audio latents."
        )
    origin = float(tags.shape[0]) if media_origin is None else float(media_origin)
    if origin < tags.shape[0]:
        raise ValueError(f"media_origin {origin:g} lies inside the text rows (T = {tags.shape[0]}); it must be >= T.")

    target_grid, target_w_axis = frame_grid(latent_height, latent_width, patch_size)
    target_origin = origin
    for block in references:  # the same sequential sum the reference rows make below
        target_origin += reference_clock_advance(block)
    moved = target_origin + float(time_offset)
    sequence = _SequenceBuilder()
    sequence.text(tags)
    tail = [GuideBlock(0, guide_latent_frames, guide_audio_latents)] if guide_latent_frames else []
    _guide_rows(sequence, [*tail, *guides], moved, target_grid, target_w_axis)  # the tail: a guide at frame 0
    _reference_rows(sequence, references, origin, target_w_axis, patch_size, float(time_offset))
    sequence.audio(audio_latents, moved, target_w_axis, RowClock.AUDIO)
    sequence.video(latent_frame_times(latent_frames, moved), target_grid, RowClock.VIDEO)
    return sequence.finish(latent_frames, latent_height, latent_width, audio_latents)
