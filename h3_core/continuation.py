"""Long video by latent-tail continuation: the window plan (h3-model.md G).

A clip longer than one request is cut into windows of `window` frames that overlap by `overlap`
frames, all on the 17n + 5 grid. From the second window on, the tail of what was generated so far
(the last latent frames and audio latents covering `overlap` frames) conditions the new window as
guide rows at its time origin; the window's first `overlap` frames are then dropped and the rest
appended. Every window's media rows carry a global time offset of `start * 40/24` RoPE units, so
positions keep counting across windows. Audio boundaries are taken on the cumulative timeline
(`round(frame * 40/24)`), so window rounding never drifts.

`Timeline` keeps the cumulative latents: it hands each window its guide tail and appends the window's
new part. In `full` mode the plan is one window over the whole clip.

A clip already made can be continued: the plan's first window is then that clip, `given` (never
sampled, its latents kept as they are), and the windows after it continue its tail as above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import geometry
from .layout import FRAME_TIME

DEFAULT_WINDOW_FRAMES = 277
DEFAULT_OVERLAP_FRAMES = 22
MIN_WINDOW_FRAMES, MAX_WINDOW_FRAMES = 107, 345
MIN_SECONDS = 4.0  # as for one request: 107 frames
MAX_CONTINUATION_SECONDS = 300.0
MAX_FULL_SECONDS = 30.0
MODES = ("continuation", "full")


def audio_at(frame: int) -> int:
    """Audio latents before pixel frame `frame` on the cumulative timeline."""
    return geometry.audio_latents(frame) if frame else 0


def video_at(start: int) -> int:
    """Video latents before a window's first frame `start` (a multiple of 17) on the cumulative timeline, 5 per
    17 frames: the window's latents are the whole clip's [video_at(start), video_at(start) + latent_frames)."""
    if start % geometry.FRAMES_PER_CHUNK:
        raise ValueError(f"Windows start at multiples of {geometry.FRAMES_PER_CHUNK} frames; got {start}.")
    return start // geometry.FRAMES_PER_CHUNK * geometry.LATENTS_PER_CHUNK


@dataclass(frozen=True)
class Window:
    """One request of the plan: pixel frames [start, end) of the whole clip."""

    index: int
    start: int
    end: int
    overlap: int  # frames at the front repeated from the previous window (0 for the first)
    given: bool = False  # a clip already made, continued by the windows after it

    @property
    def frames(self) -> int:
        return self.end - self.start

    @property
    def latent_frames(self) -> int:
        return geometry.latent_frames(self.frames)

    @property
    def audio_latents(self) -> int:
        return audio_at(self.end) - audio_at(self.start)

    @property
    def time_offset(self) -> float:
        """Added to the RoPE time of target, reference and guide media rows (not text or still images)."""
        return self.start * FRAME_TIME

    @property
    def guide_latent_frames(self) -> int:
        """Latent frames of the previous result's tail that condition this window (and are dropped after)."""
        return geometry.latent_frames(self.overlap) if self.overlap else 0

    @property
    def guide_audio_latents(self) -> int:
        return audio_at(self.start + self.overlap) - audio_at(self.start) if self.overlap else 0


def sampled(windows) -> list[Window]:
    """The windows to sample: all but a given clip."""
    return [window for window in windows if not window.given]


def long_video_frames(seconds: float, mode: str = "continuation") -> int:
    """Frames of a long request (17n + 5 grid), within the published bounds of each mode."""
    limit = mode_seconds(mode)
    if not isinstance(seconds, (int, float)) or not MIN_SECONDS <= seconds <= limit:
        raise ValueError(f"A {mode} long video lasts {MIN_SECONDS:g} s up to {limit:g} s; got {seconds!r} s.")
    return geometry.frames_for_duration(seconds)


def mode_seconds(mode: str) -> float:
    """The longest duration a long request of `mode` may ask for."""
    limit = {"continuation": MAX_CONTINUATION_SECONDS, "full": MAX_FULL_SECONDS}.get(mode)
    if limit is None:
        raise ValueError(f"Long-video mode must be 'continuation' or 'full', got {mode!r}.")
    return limit


def plan_windows(
    total_frames: int, window_frames: int = DEFAULT_WINDOW_FRAMES, overlap_frames: int = DEFAULT_OVERLAP_FRAMES,
    given_frames: int = 0,
) -> list[Window]:
    """Windows covering [0, total_frames): the first [0, min(total, W)) (or, with `given_frames`, the given
    clip [0, given_frames)), then each starting `overlap` frames before the previous end. Starts are
    multiples of 17 and ends 17n + 5, so every window is on the VAE's grid; the last one may be shorter."""
    sizes = [("total", total_frames), ("window", window_frames), ("overlap", overlap_frames)]
    for name, value in sizes + ([("given clip's", given_frames)] if given_frames else []):
        if value < 0 or value % geometry.FRAMES_PER_CHUNK != geometry.LATENTS_PER_CHUNK:  # -12 % 17 is 5
            examples = "107, 124, 277" if name == "window" else "22, 107, 277"
            raise ValueError(f"The {name} frame count must be of the form 17n + 5 (e.g. {examples}); got {value}.")
    if not MIN_WINDOW_FRAMES <= window_frames <= MAX_WINDOW_FRAMES:
        raise ValueError(f"Windows must be {MIN_WINDOW_FRAMES}-{MAX_WINDOW_FRAMES} frames; got {window_frames}.")
    if overlap_frames >= window_frames:
        raise ValueError(f"The overlap ({overlap_frames} frames) must be shorter than the window ({window_frames}).")
    if given_frames:
        if given_frames >= total_frames:
            raise ValueError(f"The whole clip ({total_frames} frames, {total_frames / geometry.FPS:.2f} s) must be "
                             f"longer than the clip it continues ({given_frames} frames, "
                             f"{given_frames / geometry.FPS:.2f} s as encoded: cut to 17n + 5 frames): the duration "
                             "counts the whole result, the continued clip included.")
        if overlap_frames >= given_frames:
            raise ValueError(f"The overlap ({overlap_frames} frames) must be shorter than the clip it continues "
                             f"({given_frames} frames).")
        windows = [Window(0, 0, given_frames, 0, given=True)]
    else:
        windows = [Window(0, 0, min(total_frames, window_frames), 0)]
    while windows[-1].end < total_frames:
        start = windows[-1].end - overlap_frames
        windows.append(Window(len(windows), start, min(total_frames, start + window_frames), overlap_frames))
    return windows


def plan_request(
    total_frames: int,
    mode: str = "continuation",
    window_frames: int = DEFAULT_WINDOW_FRAMES,
    overlap_frames: int = DEFAULT_OVERLAP_FRAMES,
    given_frames: int = 0,
) -> list[Window]:
    """The windows of a long request: `plan_windows` in continuation mode, one window in full mode."""
    if mode == "full" and given_frames:
        raise ValueError("Full mode samples the whole clip as one window, so it cannot continue a given clip; "
                         "use continuation mode.")
    if mode == "full":
        if total_frames % geometry.FRAMES_PER_CHUNK != geometry.LATENTS_PER_CHUNK:
            raise ValueError(f"The total frame count must be of the form 17n + 5; got {total_frames}.")
        return [Window(0, 0, total_frames, 0)]
    if mode != "continuation":
        raise ValueError(f"Long-video mode must be 'continuation' or 'full', got {mode!r}.")
    return plan_windows(total_frames, window_frames, overlap_frames, given_frames)


class Timeline:
    """The cumulative latents of a long video: video [1, C, L, h, w] and audio [2, C, A] (normalized), each
    window's new part written after the last into one tensor per modality. Sized for the whole clip when its
    frame count is given (else grown as needed), so the clip so far and the tail are views, never copies."""

    def __init__(self, frames: int | None = None) -> None:
        self.frames = 0  # pixel frames covered so far
        self._total = frames
        self._video = self._audio = None
        self._video_length = self._audio_length = 0

    def guide(self, window: Window) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The previous result's tail that conditions `window`: its last `guide_latent_frames` latent frames
        and `guide_audio_latents` audio latents per channel, i.e. pixel frames [start, start + overlap)."""
        if window.index == 0:
            return None
        if self.frames != window.start + window.overlap:
            raise ValueError(
                f"Window {window.index} starts at frame {window.start} with a {window.overlap}-frame overlap, "
                f"but the timeline ends at frame {self.frames}."
            )
        video, audio = self.latents()
        if video.shape[2] < window.guide_latent_frames or audio.shape[2] < window.guide_audio_latents:
            raise ValueError("The timeline is shorter than the guide it should give.")
        return (video[:, :, video.shape[2] - window.guide_latent_frames :],
                audio[:, :, audio.shape[2] - window.guide_audio_latents :])

    def append(self, window: Window, video: torch.Tensor, audio: torch.Tensor) -> None:
        """A sampled window ([1, C, L_w, h, w], [2, C, A_w]) without its hidden overlap."""
        if video.shape[2] != window.latent_frames or audio.shape[2] != window.audio_latents:
            raise ValueError(
                f"Window {window.index} holds {window.latent_frames} latent frames and {window.audio_latents} "
                f"audio latents; got {video.shape[2]} and {audio.shape[2]}."
            )
        if self.frames != (window.start + window.overlap if window.index else 0):
            raise ValueError(f"Window {window.index} does not continue a timeline that ends at frame {self.frames}.")
        total = self._total if self._total is not None and self._total >= window.end else None
        self._video = _written(self._video, self._video_length, video[:, :, window.guide_latent_frames :],
                               None if total is None else geometry.latent_frames(total))
        self._audio = _written(self._audio, self._audio_length, audio[:, :, window.guide_audio_latents :],
                               None if total is None else geometry.audio_latents(total))
        self._video_length += window.latent_frames - window.guide_latent_frames
        self._audio_length += window.audio_latents - window.guide_audio_latents
        self.frames = window.end

    def latents(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole clip so far: video [1, C, L(frames), h, w] and audio [2, C, round(frames * 40/24)] (views)."""
        if self._video is None:
            raise ValueError("The timeline holds no window yet.")
        return self._video[:, :, : self._video_length], self._audio[:, :, : self._audio_length]


def _written(buffer: torch.Tensor | None, length: int, part: torch.Tensor, size: int | None) -> torch.Tensor:
    """`part` written after the first `length` steps (dim 2) of `buffer`: a new buffer of `size` steps (or twice
    what is needed, without a size) when it does not fit; what was written before is never written over."""
    needed = length + part.shape[2]
    if buffer is None or buffer.shape[2] < needed:
        grown = part.new_empty(*part.shape[:2], max(needed, size or 2 * needed), *part.shape[3:])
        if buffer is not None:
            grown[:, :, :length] = buffer[:, :, :length]
        buffer = grown
    buffer[:, :, length:needed] = part
    return buffer
