"""A clip you already have (frames at any rate and its sound) as the AV latents H3 samples: what extending
that video (long_video's `continue_from`) or re-sampling it (a denoise below 1) starts from.

The frames are brought to 24 fps, cut to their first 17n + 5 (at least 22), cover-cropped onto the canvas
and encoded by the release's conditioning recipe, as keyframes, references and guides are; the sound
(silence without one) is cut or padded to those frames and encoded as a driving track is. Decoding these
latents gives the VAEs' reconstruction of the clip, not its pixels.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

from . import geometry, media_read
from .conditioning import RequestError
from .continuation import MAX_CONTINUATION_SECONDS
from .drive_audio import encode_track, load_track
from .encode_memory import encode_working_bytes
from .media import SAMPLE_RATE, MediaError, audio_samples_for_frames
from .output import AVLatents
from .references import (
    CanvasRules,
    DecodedAudio,
    MediaInputError,
    count_at_24fps,
    frame_on_canvas,
    slot_sources,
    vae_frame_count,
)
from .vae_video import condition_latents, frames_to_model_space

MIN_CLIP_FRAMES = 22  # the shortest clip the latent layout holds (7 latent frames)
MAX_CLIP_FRAMES = int(MAX_CONTINUATION_SECONDS * geometry.FPS)  # the longest read: a long video's whole length


def check_frame_rate(fps: float) -> None:
    if not (math.isfinite(fps) and fps > 0):
        raise RequestError(f"The clip's frame rate must be a positive number, got {fps!r}.")


def clip_frame_count(frames: int, fps: float) -> int:
    """Frames at 24 fps a clip of `frames` frames at `fps` keeps: the largest 17n + 5 (refused below 22), of its
    first MAX_CLIP_FRAMES as a file's are read (a longer clip held in memory was encoded whole, then refused)."""
    check_frame_rate(fps)
    at_24 = count_at_24fps(frames, fps)
    if at_24 < MIN_CLIP_FRAMES:
        raise RequestError(f"A clip to encode needs at least {MIN_CLIP_FRAMES} frames at 24 fps (0.92 s); this one "
                           f"has {at_24} ({frames} at {fps:g} fps).")
    return vae_frame_count(min(at_24, MAX_CLIP_FRAMES))


def stream_clip(path, rules: CanvasRules, width: int | None = None, height: int | None = None,
                max_frames: int = MAX_CLIP_FRAMES, start_seconds: float = 0.0) -> tuple[Iterator[np.ndarray], int, int]:
    """A video file's frames at 24 fps from `start_seconds`, each cover-cropped onto the canvas (width x height,
    or the video's own aspect ratio under `rules`) as it is decoded, as an iterator for `encode_clip_frames`:
    a long clip is never in memory whole. The first 22 frames are decoded now, so a file that cannot be read
    or is too short, or cut short before the part it uses (its header stating more), is refused before any VAE
    loads. Returns (frames, width, height)."""
    info = media_read.probe(path)
    stated, fps = info.video_seconds, info.video.fps if info.video is not None else None
    used_until = None if stated is None else min(stated, start_seconds + max_frames / geometry.FPS)
    problem = media_read.cut_short(path, stated, fps, used_until) if stated and fps else None
    if problem:
        raise MediaError(problem)
    frames = media_read.iter_video_frames(path, start_seconds, max_frames)
    first = list(itertools.islice(frames, MIN_CLIP_FRAMES))
    if not first:
        raise MediaError(f"{path} has no video frames at or after {start_seconds} s.")
    try:
        clip_frame_count(len(first), geometry.FPS)
    except RequestError as error:
        raise RequestError(f"{path}: {error}") from None
    if width is None:
        width, height = rules.canvas(first[0].shape[1], first[0].shape[0])
    on_canvas = (frame_on_canvas(frame, width, height) for frame in itertools.chain(first, frames))
    return on_canvas, width, height


def file_soundtrack(path, start_seconds: float = 0.0) -> Callable[[int], np.ndarray | None]:
    """`encode_clip_frames`'s `sound` for a streamed file: its own soundtrack over the frames that arrived
    (None without one), read once they are all known."""
    return lambda arrived: media_read.read_soundtrack(path, start_seconds, arrived / geometry.FPS)


def encode_clip(video_vae, audio_vae, frames: np.ndarray, fps: float, width: int, height: int, waveform=None,
                sample_rate: int | None = None, on_clip: Callable[[int, int], None] | None = None) -> AVLatents:
    """uint8 frames [N, H, W, 3] at `fps` (and a sound [C, M] at `sample_rate`) -> AVLatents of their first
    17n + 5 frames at 24 fps on a `width` x `height` canvas (checked before either VAE runs). `on_clip(done,
    total)` after each 17 frames encoded: progress, and a host may raise there to stop."""
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise RequestError(f"Clip frames must be uint8 RGB [N, H, W, 3], got {frames.dtype} {list(frames.shape)}.")
    check_frame_rate(fps)
    try:
        geometry.check_canvas(width, height)
    except ValueError as error:
        raise RequestError(str(error)) from None
    count = clip_frame_count(frames.shape[0], fps)
    sound = None if waveform is None else DecodedAudio(waveform, sample_rate)
    # each slot's frame as it is encoded: a clip below 24 fps is not repeated out whole first
    on_canvas = (frame_on_canvas(frames[index], width, height) for index in slot_sources(frames.shape[0], fps, count))
    return encode_clip_frames(video_vae, audio_vae, on_canvas, sound,
                              None if on_clip is None else lambda done: on_clip(done, count))


def expected_clip_frames(path, start_seconds: float = 0.0, max_frames: int = MAX_CLIP_FRAMES) -> int:
    """How many frames encoding a video file from `start_seconds` will keep, from its container's duration
    (for a progress bar's total; `max_frames` when the container does not say)."""
    duration = media_read.probe(path).video_seconds
    at_24 = max_frames if duration is None else min(max_frames, int((duration - start_seconds) * geometry.FPS))
    return vae_frame_count(max(at_24, MIN_CLIP_FRAMES))


def encode_clip_frames(video_vae, audio_vae, frames: Iterable[np.ndarray],
                       sound: DecodedAudio | Callable[[int], np.ndarray | None] | None = None,
                       on_clip: Callable[[int], None] | None = None) -> AVLatents:
    """Frames at 24 fps already on the canvas, uint8 [H, W, 3], one at a time (at least 22) -> AVLatents of
    their first 17n + 5 frames: the video VAE encodes 17 at a time as they arrive, so 22 frames are held,
    not the clip (the posterior is then sampled in one draw: the same latents as `encode_video` of them all).

    sound  a DecodedAudio (checked before any VAE runs), or a function given how many frames arrived that
           returns their sound [2, M] at 32 kHz or None (a file's own soundtrack, read once its length is
           known); None or no sound: silence. Either is cut or padded to the 17n + 5 frames.
    on_clip  called with the frames encoded so far after each 17-frame clip: a host shows progress there
             and may raise to stop (an interrupt)."""
    try:
        given = load_track(sound, "the clip's sound") if isinstance(sound, DecodedAudio) else None
    except MediaInputError as error:
        raise RequestError(str(error)) from None
    pieces = VaeClips(frames)
    moments = video_vae.encode_moments_of_clips(map(_as_pixels, pieces), prepare=frames_to_model_space,
                                                on_clip=on_clip)
    video = condition_latents(video_vae, moments).cpu()
    count = pieces.kept
    if callable(sound):
        found = sound(pieces.arrived)
        given = None if found is None else load_track(DecodedAudio(found, SAMPLE_RATE), "the clip's sound")
    track = given if given is not None else torch.zeros(2, audio_samples_for_frames(count))
    return AVLatents(video, encode_track(audio_vae, track, count)).check()


def clip_encode_bytes(video_vae, audio_vae, num_frames: int, width: int, height: int) -> int:
    """Device memory `encode_clip` / `encode_clip_frames` of `num_frames` frames on a `width` x `height` canvas
    needs besides the VAEs' weights (the video, then its sound cut to the frames)."""
    return encode_working_bytes(video_vae, audio_vae, [(num_frames, height, width)],
                                [audio_samples_for_frames(num_frames)])


class VaeClips:
    """Frames arriving one at a time, cut into the video VAE's 17-frame clips of their first 17n + 5: a clip
    is yielded once 5 more frames have arrived after it (so it is surely kept), then the last 5 (which the
    VAE pads, `TemporalChunking.encode_clips`). `arrived` and `kept` count frames."""

    def __init__(self, frames: Iterable[np.ndarray]):
        self.frames, self.arrived, self.kept = frames, 0, 0

    def __iter__(self) -> Iterator[np.ndarray]:
        length, tail = geometry.FRAMES_PER_CHUNK, MIN_CLIP_FRAMES - geometry.FRAMES_PER_CHUNK
        held: list[np.ndarray] = []
        for frame in self.frames:
            self.arrived += 1
            held.append(frame)
            if len(held) == length + tail:
                self.kept += length
                yield np.stack(held[:length])
                held = held[length:]
        if not self.kept:
            clip_frame_count(self.arrived, geometry.FPS)  # fewer than 22: refused with the usual message
        self.kept += tail
        yield np.stack(held[:tail])


def _as_pixels(clip: np.ndarray) -> torch.Tensor:
    """uint8 [F, H, W, 3] -> [1, 3, F, H, W] (what the video VAE's encoder takes)."""
    return torch.from_numpy(clip).permute(3, 0, 1, 2)[None]
