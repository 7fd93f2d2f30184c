"""Long video by latent-tail continuation: the window plan (h3-model.md G).

A clip longer than one request is cut into windows of `window` frames that overlap by `overlap`
frames, all on the 17n + 5 grid. From the second window on, the tail of what was generated so far
(the last latent frames and audio latents covering `overlap` frames) conditions the new window as
guide rows at its time origin; the window's first `overlap` frames are then dropped and the rest
appended. Every window's media rows carry a global time offset of `start * 40/24` RoPE units, so
positions keep counting across windows. Audio boundaries are taken on the cumulative timeline
(`round(frame * 40/24)`), so window rounding never drifts.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import geometry

DEFAULT_WINDOW_FRAMES = 277
DEFAULT_OVERLAP_FRAMES = 22
MIN_WINDOW_FRAMES, MAX_WINDOW_FRAMES = 107, 345
MAX_CONTINUATION_SECONDS = 300.0
MAX_FULL_SECONDS = 30.0
ROPE_UNITS_PER_FRAME = geometry.AUDIO_LATENTS_PER_SECOND / geometry.FPS  # 5/3


def _audio_at(frame: int) -> int:
    """Audio latents before pixel frame `frame` on the cumulative timeline."""
    return geometry.audio_latents(frame) if frame else 0


@dataclass(frozen=True)
class Window:
    """One request of the plan: pixel frames [start, end) of the whole clip."""

    index: int
    start: int
    end: int
    overlap: int  # frames at the front repeated from the previous window (0 for the first)

    @property
    def frames(self) -> int:
        return self.end - self.start

    @property
    def latent_frames(self) -> int:
        return geometry.latent_frames(self.frames)

    @property
    def audio_latents(self) -> int:
        return _audio_at(self.end) - _audio_at(self.start)

    @property
    def time_offset(self) -> float:
        """Added to the RoPE time of target, reference and guide media rows (not text or still images)."""
        return self.start * ROPE_UNITS_PER_FRAME

    @property
    def guide_latent_frames(self) -> int:
        """Latent frames of the previous result's tail that condition this window (and are dropped after)."""
        return geometry.latent_frames(self.overlap) if self.overlap else 0

    @property
    def guide_audio_latents(self) -> int:
        return _audio_at(self.start + self.overlap) - _audio_at(self.start) if self.overlap else 0


def long_video_frames(seconds: float, mode: str = "continuation") -> int:
    """Frames of a long request (17n + 5 grid), within the published bounds of each mode."""
    limit = {"continuation": MAX_CONTINUATION_SECONDS, "full": MAX_FULL_SECONDS}.get(mode)
    if limit is None:
        raise ValueError(f"Long-video mode must be 'continuation' or 'full', got {mode!r}.")
    if not 0 < seconds <= limit:
        raise ValueError(f"A {mode} long video lasts up to {limit:g} s; got {seconds:g} s.")
    return geometry.frames_for_duration(seconds)


def plan_windows(
    total_frames: int, window_frames: int = DEFAULT_WINDOW_FRAMES, overlap_frames: int = DEFAULT_OVERLAP_FRAMES
) -> list[Window]:
    """Windows covering [0, total_frames): the first [0, min(total, W)), then each starting `overlap`
    frames before the previous end. Starts are multiples of 17 and ends 17n + 5, so every window is on
    the VAE's grid; the last one may be shorter."""
    for name, value in (("total", total_frames), ("window", window_frames), ("overlap", overlap_frames)):
        if value % geometry.FRAMES_PER_CHUNK != geometry.LATENTS_PER_CHUNK:
            raise ValueError(f"The {name} frame count must be of the form 17n + 5 (e.g. 22, 107, 277); got {value}.")
    if not MIN_WINDOW_FRAMES <= window_frames <= MAX_WINDOW_FRAMES:
        raise ValueError(f"Windows must be {MIN_WINDOW_FRAMES}-{MAX_WINDOW_FRAMES} frames; got {window_frames}.")
    if overlap_frames >= window_frames:
        raise ValueError(f"The overlap ({overlap_frames} frames) must be shorter than the window ({window_frames}).")
    windows = [Window(0, 0, min(total_frames, window_frames), 0)]
    while windows[-1].end < total_frames:
        start = windows[-1].end - overlap_frames
        windows.append(Window(len(windows), start, min(total_frames, start + window_frames), overlap_frames))
    return windows
