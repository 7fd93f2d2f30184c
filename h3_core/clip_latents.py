"""A clip you already have (frames at any rate and its sound) as the AV latents H3 samples: what extending
that video (long_video's `continue_from`) or re-sampling it (a denoise below 1) starts from.

The frames are brought to 24 fps, cut to their first 17n + 5 (at least 22), cover-cropped onto the canvas
and encoded by the release's conditioning recipe, as keyframes, references and guides are; the sound
(silence without one) is cut or padded to those frames and encoded as a driving track is. Decoding these
latents gives the VAEs' reconstruction of the clip, not its pixels.
"""

from __future__ import annotations

import numpy as np

from . import geometry, media_read
from .conditioning import RequestError
from .continuation import MAX_CONTINUATION_SECONDS
from .drive_audio import encode_track, load_track
from .media import SAMPLE_RATE, audio_samples_for_frames
from .media_read import VideoClip
from .output import AVLatents
from .references import (
    CanvasRules,
    DecodedAudio,
    MediaInputError,
    count_at_24fps,
    encode_video,
    frames_at_24fps,
    frames_on_canvas,
    vae_frame_count,
)

MIN_CLIP_FRAMES = 22  # the shortest clip the latent layout holds (7 latent frames)
MAX_CLIP_FRAMES = int(MAX_CONTINUATION_SECONDS * geometry.FPS)  # the longest read: a long video's whole length


def clip_frame_count(frames: int, fps: float) -> int:
    """Frames at 24 fps a clip of `frames` frames at `fps` keeps: the largest 17n + 5 (refused below 22)."""
    at_24 = count_at_24fps(frames, fps)
    if at_24 < MIN_CLIP_FRAMES:
        raise RequestError(f"A clip to encode needs at least {MIN_CLIP_FRAMES} frames at 24 fps (0.92 s); this one "
                           f"has {at_24} ({frames} at {fps:g} fps).")
    return vae_frame_count(at_24)


def read_clip(path, rules: CanvasRules, width: int | None = None, height: int | None = None,
              max_frames: int = MAX_CLIP_FRAMES, start_seconds: float = 0.0,
              with_audio: bool = True) -> tuple[VideoClip, int, int]:
    """A video file's frames at 24 fps from `start_seconds` and its soundtrack, each frame cover-cropped onto
    the canvas as it is decoded (width x height, or the video's own aspect ratio under `rules`), so a long
    clip is held at the canvas size only. Returns (clip, width, height)."""
    canvas = [] if width is None else [(width, height)]  # else the first frame decides

    def onto_canvas(frame: np.ndarray) -> np.ndarray:
        if not canvas:
            canvas.append(rules.canvas(frame.shape[1], frame.shape[0]))
        return frames_on_canvas(frame[None], *canvas[0])[0]

    clip = media_read.read_video(path, start_seconds, max_frames, with_audio=with_audio, fit=onto_canvas)
    return clip, *canvas[0]


def encode_clip(video_vae, audio_vae, frames: np.ndarray, fps: float, width: int, height: int, waveform=None,
                sample_rate: int | None = None) -> AVLatents:
    """uint8 frames [N, H, W, 3] at `fps` (and a sound [C, M] at `sample_rate`) -> AVLatents of their first
    17n + 5 frames at 24 fps on a `width` x `height` canvas (checked before either VAE runs)."""
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise RequestError(f"Clip frames must be uint8 RGB [N, H, W, 3], got {frames.dtype} {list(frames.shape)}.")
    if not fps or fps <= 0:
        raise RequestError(f"The clip's frame rate must be positive, got {fps!r}.")
    try:
        geometry.check_canvas(width, height)
    except ValueError as error:
        raise RequestError(str(error)) from None
    count = clip_frame_count(frames.shape[0], fps)
    silence = DecodedAudio(np.zeros((2, audio_samples_for_frames(count)), np.float32), SAMPLE_RATE)
    try:
        track = load_track(silence if waveform is None else DecodedAudio(waveform, sample_rate), "the clip's sound")
    except MediaInputError as error:
        raise RequestError(str(error)) from None
    video = encode_video(video_vae, frames_on_canvas(frames_at_24fps(frames, fps)[:count], width, height))
    return AVLatents(video, encode_track(audio_vae, track, count)).check()
