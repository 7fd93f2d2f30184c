"""Keyframes and references: from a request's media to what H3 conditions on (h3-model.md B.3, C, E.2, F).

Three steps, each plain functions:

1. **inspect** a source without decoding all of it (file format and size, corrupt files, clip length,
   aspect ratio), so a request is checked before any model runs (`inspect_image`, `inspect_video`,
   `inspect_audio`; the request limits themselves live in conditioning.py);
2. **prepare** it as the release does (bit-identical to diffusers' before-encoder steps):
   - fl2va keyframes onto the canvas: the first in packed order (the geometry anchor) is stretched
     (LANCZOS, no crop); a follower is cover-cropped: scale = max(W/w, H/h), resized to
     (max(W, round(w*scale)), max(H, round(h*scale))) with LANCZOS, cropped at ((rw-W)//2, (rh-H)//2);
     a keyframe already at the canvas size passes untouched;
   - image reference: short edge 2048 (upscaling allowed, no area cap), each axis then rounded to the
     nearest multiple of 32 (at least 32), LANCZOS;
   - video reference: onto 24 fps by whole frames (source frame i fills slots floor(i*24/fps + 0.5) up to
     the next one's; the last up to floor(n*24/fps + 0.5)), truncated to the output frame count F, then
     LANCZOS onto the canvas of its *own* aspect ratio (the 768 rule of the target);
   - audio (standalone clip or a video's soundtrack): cut at its native rate to the output duration,
     `int(F / 24 * rate)` samples, mono duplicated to stereo, then resampled once to 32 kHz;
3. **encode** it: visual conditions through the video VAE's conditioning recipe (`encode_condition`:
   posterior sample under a seed-42 generator, fp16 round trip, normalization), a video first snapped
   *down* to 17n+5 frames (at least 22); audio through the audio VAE (posterior mean, normalized) into
   channel-major rows.

Sources a request may hold:
- image: a path, a PIL image, or a [H, W, 3] array/tensor, uint8 (0..255) or float (0..1), channels last;
- video: a path, or `DecodedVideo(frames [F, H, W, 3], fps, audio [C, N] | None, sample_rate)`
  (`media_read.VideoClip` is taken as 24 fps frames with a 32 kHz soundtrack);
- audio: a path, or `DecodedAudio(waveform [C, N] or [N], sample_rate)`, mono or stereo float.
Files are read with `media_read` (videos at 24 fps from `start_seconds`, soundtracks and audio files cut
at the native rate, then resampled by FFmpeg's swresample); in-memory waveforms at another rate than
32 kHz are resampled the same way (diffusers uses torchaudio there: same rate, not the same bits).

Canvas rules are the release's by default (`RELEASE_CANVAS`); `CanvasRules` exists because diffusers
makes them configurable too, which is what lets the parity tests run the whole recipe at tiny size.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from . import geometry, media_read
from .layout import pack_audio
from .media import SAMPLE_RATE, MediaError, as_stereo_waveform, as_uint8_frames, resample_audio
from .prompt import AudioReference, ImageReference, VideoReference
from .vae_video import encode_condition

FPS = geometry.FPS
REFERENCE_IMAGE_SHORT_EDGE = 2048
# How image references are sized: the release's 2048 short edge (up or down), or scaled down (never up) to
# the output's pixel area as ComfyUI's native nodes do by default ("match"): fewer DiT rows, less detail.
REFERENCE_IMAGE_MODES = ("release", "canvas-lossy")
# Published file limits (h3-model.md F): images JPG/PNG/WEBP/HEIC/HEIF up to 30 MiB, audio WAV/MP3 up
# to 15 MiB. Videos have no published file limit; any container PyAV decodes is taken.
IMAGE_FILE_FORMATS = ("JPEG", "PNG", "WEBP", "HEIF")  # Pillow's names; HEIC files report HEIF
MAX_IMAGE_FILE_BYTES = 30 * 1024 * 1024
AUDIO_FILE_CODECS = ("pcm_", "mp3")  # WAV holds PCM; prefixes of FFmpeg decoder names (mp3float, pcm_s16le)
MAX_AUDIO_FILE_BYTES = 15 * 1024 * 1024


class MediaInputError(ValueError):
    """A keyframe or reference that cannot be used: missing, unreadable, corrupt, or of an unsupported kind."""


# ----------------------------------------------------------------------------------------------
# Sources


@dataclass(frozen=True)
class DecodedVideo:
    """A video already in memory: frames [F, H, W, 3] (uint8, or float 0..1) at `fps`, and optionally
    its soundtrack [C, N] (C = 1 or 2, float) at `sample_rate` Hz."""

    frames: Any
    fps: float
    audio: Any = None
    sample_rate: int | None = None


@dataclass(frozen=True)
class DecodedAudio:
    """An audio clip already in memory: waveform [N], [1, N] or [2, N] (float) at `sample_rate` Hz."""

    waveform: Any
    sample_rate: int


@dataclass(frozen=True)
class MediaReference:
    """One ref2va reference as a request gives it: kind "image" | "video" | "audio", a source (see the
    module docstring) and where a clip starts (seconds; images have none)."""

    kind: str
    source: Any
    start_seconds: float = 0.0


@dataclass(frozen=True)
class CanvasRules:
    """The canvas geometry of a checkpoint: target and video-reference canvases keep `short_edge` with
    the area capped at `max_pixels`; image references are encoded at their own
    `reference_image_short_edge` (the release's rule), or with `reference_image_area` set, scaled down
    (never up) to that many pixels (`sized_for_canvas`). Both axes round to `multiple` (VAE 16 x patch 2)."""

    short_edge: int = geometry.SHORT_EDGE
    max_pixels: int = geometry.MAX_PIXELS
    reference_image_short_edge: int = REFERENCE_IMAGE_SHORT_EDGE
    multiple: int = geometry.CANVAS_MULTIPLE
    reference_image_area: int = 0

    def canvas(self, width: float, height: float) -> tuple[int, int]:
        """(width, height) of the canvas for an aspect ratio: `geometry.canvas_size` under these rules."""
        return geometry.canvas_size((width, height), self.short_edge, self.max_pixels)

    def reference_image_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) an image reference is encoded at: its short edge scaled to
        `reference_image_short_edge` (up or down), or its area down to `reference_image_area` when that is
        set, each axis rounded to the nearest multiple."""
        if self.reference_image_area:
            scale = min(1.0, math.sqrt(self.reference_image_area / (width * height)))
        else:
            scale = self.reference_image_short_edge / min(width, height)
        return self._round(width * scale), self._round(height * scale)

    def sized_for_canvas(self, mode: str, width: int, height: int) -> "CanvasRules":
        """These rules with image references sized by `mode` (REFERENCE_IMAGE_MODES) for a width x height output."""
        if mode not in REFERENCE_IMAGE_MODES:
            raise MediaInputError(f"Reference image sizing is one of {', '.join(REFERENCE_IMAGE_MODES)}; got {mode!r}.")
        return dataclasses.replace(self, reference_image_area=width * height if mode == "canvas-lossy" else 0)

    def _round(self, value: float) -> int:
        return max(self.multiple, round(value / self.multiple) * self.multiple)


RELEASE_CANVAS = CanvasRules()


# ----------------------------------------------------------------------------------------------
# Inspect (no model, no full decode of videos or audio)


@dataclass(frozen=True)
class MediaFacts:
    """What validation needs to know of a source: its displayed size (visual media) and, for clips, the
    seconds available from the start offset on and whether a video carries a soundtrack."""

    width: int | None = None
    height: int | None = None
    seconds: float | None = None
    has_audio: bool = False


def _is_path(source) -> bool:
    return isinstance(source, (str, os.PathLike))


def _existing_file(source, what: str) -> Path:
    path = Path(source)
    if not path.is_file():
        raise MediaInputError(f"{what}: {path} is a folder, not a file." if path.is_dir() else
                              f"{what}: no file at {path}.")
    return path


def _probe(path: Path, what: str) -> media_read.MediaInfo:
    try:
        return media_read.probe(path)
    except media_read.UnreadableMediaError as error:  # says what files are read itself
        raise MediaInputError(f"{what}: {error}.") from error
    except MediaError as error:
        raise MediaInputError(f"{what}: {error} (corrupt, truncated or not a media file).") from error


def _check_start(start_seconds, what: str) -> float:
    if (isinstance(start_seconds, bool) or not isinstance(start_seconds, numbers.Real)
            or not math.isfinite(start_seconds) or start_seconds < 0):
        raise MediaInputError(f"{what}: start_seconds must be a finite number >= 0, got {start_seconds!r}.")
    return float(start_seconds)


def _image_file(path: Path, what: str) -> Image.Image:
    """Decode an image file fully (a truncated file fails here), upright (EXIF) and RGB."""
    size = path.stat().st_size
    if size > MAX_IMAGE_FILE_BYTES:
        raise MediaInputError(
            f"{what}: {path.name} is {size / 2**20:.1f} MiB; image files may be at most "
            f"{MAX_IMAGE_FILE_BYTES // 2**20} MiB."
        )
    try:
        with Image.open(path) as opened:
            file_format = opened.format
            opened.load()
            image = as_rgb(ImageOps.exif_transpose(opened))
    except UnidentifiedImageError as error:
        raise MediaInputError(
            f"{what}: {path.name} is not an image Pillow can read; H3 takes JPEG, PNG, WEBP or HEIC/HEIF "
            "(HEIC/HEIF need the pillow-heif plugin)."
        ) from error
    except Image.DecompressionBombError as error:
        raise MediaInputError(f"{what}: {path.name} has too many pixels to decode safely: {error}") from error
    except (OSError, SyntaxError, ValueError) as error:
        raise MediaInputError(f"{what}: {path.name} cannot be decoded (corrupt or truncated): {error}") from error
    if file_format not in IMAGE_FILE_FORMATS:
        raise MediaInputError(
            f"{what}: {path.name} is a {file_format} image; H3 takes JPEG, PNG, WEBP or HEIC/HEIF files."
        )
    return image


def as_rgb(image: Image.Image) -> Image.Image:
    """`image` as 8-bit RGB. Pillow's own conversion clips 16-bit greys (a 16-bit grey PNG, mode I;16 or I) to white
    instead of scaling them, so those are scaled here (16 bits to 8)."""
    if image.mode == "RGB":
        return image
    if image.mode.startswith("I"):
        image = Image.fromarray((np.asarray(image).astype(np.int64) >> 8).clip(0, 255).astype(np.uint8))
    return image.convert("RGB")


def load_image(source, what: str = "image") -> Image.Image:
    """Any image source -> an RGB PIL image (files decoded fully and turned upright by their EXIF tag)."""
    if _is_path(source):
        return _image_file(_existing_file(source, what), what)
    if isinstance(source, Image.Image):
        image = as_rgb(source)
    elif isinstance(source, (np.ndarray, torch.Tensor)):
        if source.ndim != 3 or source.shape[-1] != 3:
            shape = tuple(source.shape)
            hint = ""
            if source.ndim == 4 and shape[0] == 1 and shape[-1] == 3:  # a ComfyUI IMAGE batch of one
                hint = " (a batch of one: give image[0])"
            elif source.ndim == 3 and shape[0] == 3:
                hint = " (channels first: give it permuted to [H, W, 3])"
            raise MediaInputError(
                f"{what}: an image array must be [H, W, 3] RGB, channels last, got shape {shape}{hint}."
            )
        try:
            image = Image.fromarray(as_uint8_frames(source[None], "its pixels")[0])
        except ValueError as error:
            raise MediaInputError(f"{what}: {error}") from error
    else:
        raise MediaInputError(
            f"{what}: an image is a path, a PIL image or a [H, W, 3] array, got {type(source).__name__}."
        )
    if image.width < 1 or image.height < 1:
        raise MediaInputError(f"{what}: the image is empty ({image.width}x{image.height}).")
    return image


def inspect_image(source, what: str = "image") -> MediaFacts:
    """Size of an image source; a file is decoded fully, so a corrupt one is caught here."""
    image = load_image(source, what)
    return MediaFacts(width=image.width, height=image.height)


def _checked_video(video: DecodedVideo, what: str) -> tuple[np.ndarray, float]:
    if isinstance(video, media_read.VideoClip):
        return video.frames, float(FPS)
    try:
        frames = as_uint8_frames(video.frames)
    except ValueError as error:
        raise MediaInputError(f"{what}: {error}") from error
    fps = video.fps
    if not isinstance(fps, numbers.Real) or isinstance(fps, bool):  # numpy floats and Fraction rates are real
        raise MediaInputError(f"{what}: a decoded video's frame rate is a number of frames per second, got "
                              f"{type(fps).__name__} {fps!r}.")
    if not math.isfinite(fps) or fps <= 0:
        raise MediaInputError(f"{what}: a decoded video needs its positive frame rate, got fps={fps!r}.")
    if frames.shape[0] == 0 or frames.shape[1] == 0 or frames.shape[2] == 0:
        raise MediaInputError(f"{what}: the video holds no pixels (frames of shape {tuple(frames.shape)}).")
    return frames, float(fps)


def _video_audio(video, what: str) -> tuple[np.ndarray | None, int | None]:
    if isinstance(video, media_read.VideoClip):
        return video.audio, SAMPLE_RATE
    if video.audio is None:
        return None, None
    return _stereo(video.audio, video.sample_rate, what, "a soundtrack", "soundtrack: ")


def _first_frame_at(start_seconds: float, fps: float) -> int:
    """Index of the first frame at or after `start_seconds` (frame i shows at i / fps)."""
    return max(0, math.ceil((start_seconds - media_read.START_TOLERANCE_SECONDS) * fps))


def video_has_sound(source) -> bool:
    """Whether a video reference carries a soundtrack (the text encoder labels it `<Audio j>` too): a file's audio
    stream (its header read), an in-memory clip's audio. A file that cannot be read counts as sounding: this only
    words a warning, and the request's own checks name the file."""
    if not _is_path(source):
        return getattr(source, "audio", None) is not None
    try:
        return media_read.probe(source).audio is not None
    except (MediaError, OSError):
        return True


def inspect_video(source, start_seconds: float = 0.0, what: str = "video") -> MediaFacts:
    """Displayed size, seconds from `start_seconds` to the end, and whether it has a soundtrack."""
    start = _check_start(start_seconds, what)
    if _is_path(source):
        info = _probe(_existing_file(source, what), what)
        if info.video is None:
            raise MediaInputError(f"{what}: {Path(source).name} has no video stream.")
        if not info.video.fps:
            raise MediaInputError(
                f"{what}: {Path(source).name} does not state its frame rate, so it cannot be put on 24 fps."
            )
        duration = info.video_seconds
        if duration is None and info.video.frame_count:
            duration = info.video.frame_count / info.video.fps
        if duration is None:
            raise MediaInputError(f"{what}: the length of {Path(source).name} is unknown (no duration in the file).")
        try:  # read after the models load: a cut file fails now
            problem = media_read.cut_short(source, duration, info.video.fps)
        except media_read.UnreadableMediaError as error:  # says what files are read itself
            raise MediaInputError(f"{what}: {error}.") from error
        except MediaError as error:
            raise MediaInputError(f"{what}: {error} (corrupt, truncated or not a media file).") from error
        if problem:
            raise MediaInputError(f"{what}: {problem}")
        return MediaFacts(info.video.width, info.video.height, duration - start, info.audio is not None)
    if not isinstance(source, (DecodedVideo, media_read.VideoClip)):
        raise MediaInputError(
            f"{what}: a video is a path or a DecodedVideo(frames, fps, audio, sample_rate), "
            f"got {type(source).__name__}."
        )
    frames, fps = _checked_video(source, what)
    audio, _ = _video_audio(source, what)
    seconds = (frames.shape[0] - _first_frame_at(start, fps)) / fps
    return MediaFacts(frames.shape[2], frames.shape[1], seconds, audio is not None)


def _checked_audio(audio: DecodedAudio, what: str) -> tuple[np.ndarray, int]:
    return _stereo(audio.waveform, audio.sample_rate, what, "decoded audio")


def _stereo(waveform, sample_rate, what: str, kind: str, context: str = "") -> tuple[np.ndarray, int]:
    """A decoded waveform as stereo float samples with its positive integer sample rate, or a clear error."""
    if not (isinstance(sample_rate, (int, np.integer)) and sample_rate > 0):
        raise MediaInputError(f"{what}: {kind} needs its sample rate in Hz, a positive integer, got "
                              f"sample_rate={sample_rate!r}.")
    try:
        return as_stereo_waveform(waveform), int(sample_rate)
    except ValueError as error:
        raise MediaInputError(f"{what}: {context}{error}") from error


def inspect_audio(source, start_seconds: float = 0.0, what: str = "audio") -> MediaFacts:
    """Seconds from `start_seconds` to the end of an audio clip; files must be WAV or MP3 of <= 15 MiB."""
    start = _check_start(start_seconds, what)
    if _is_path(source):
        path = _existing_file(source, what)
        size = path.stat().st_size
        if size > MAX_AUDIO_FILE_BYTES:
            raise MediaInputError(
                f"{what}: {path.name} is {size / 2**20:.1f} MiB; audio files may be at most "
                f"{MAX_AUDIO_FILE_BYTES // 2**20} MiB."
            )
        info = _probe(path, what)
        if info.audio is None:
            raise MediaInputError(f"{what}: {path.name} has no audio stream.")
        if not info.audio.codec.startswith(AUDIO_FILE_CODECS):
            raise MediaInputError(
                f"{what}: {path.name} holds {info.audio.codec} audio; H3 takes WAV (PCM) or MP3 audio files."
            )
        duration = info.audio.duration_seconds or info.duration_seconds
        if duration is None:
            raise MediaInputError(f"{what}: the length of {path.name} is unknown (no duration in the file).")
        return MediaFacts(seconds=duration - start)
    if not isinstance(source, DecodedAudio):
        raise MediaInputError(
            f"{what}: an audio clip is a path or a DecodedAudio(waveform, sample_rate), got {type(source).__name__}."
        )
    waveform, rate = _checked_audio(source, what)
    return MediaFacts(seconds=(waveform.shape[1] - round(start * rate)) / rate)


# ----------------------------------------------------------------------------------------------
# Prepare (the release's normalization; no model)


def fit_keyframes(keyframes: Sequence[Image.Image], width: int, height: int) -> list[Image.Image]:
    """Keyframes in packed order onto a (width, height) canvas: the first stretched, followers cover-cropped."""
    fitted = []
    for index, keyframe in enumerate(keyframes):
        if keyframe.size == (width, height):
            fitted.append(keyframe)
        elif index == 0:
            fitted.append(keyframe.resize((width, height), Image.Resampling.LANCZOS))
        else:
            fitted.append(cover_crop(keyframe, width, height))
    return fitted


def cover_crop(image: Image.Image, width: int, height: int) -> Image.Image:
    """Scale to cover (width, height) with the release's rounding, then center-crop (LANCZOS)."""
    scale = max(width / image.width, height / image.height)
    resized_width = max(width, round(image.width * scale))
    resized_height = max(height, round(image.height * scale))
    left = max(0, (resized_width - width) // 2)
    top = max(0, (resized_height - height) // 2)
    resized = image.resize((resized_width, resized_height), Image.Resampling.LANCZOS)
    return resized.crop((left, top, left + width, top + height))


def frames_on_canvas(frames: np.ndarray, width: int, height: int) -> np.ndarray:
    """uint8 frames [N, H, W, 3] cover-cropped onto width x height; frames already that size as they are
    (`cover_crop` would give them back unchanged)."""
    if frames.shape[1:3] == (height, width):
        return frames
    return np.stack([frame_on_canvas(frame, width, height) for frame in frames])


def frame_on_canvas(frame: np.ndarray, width: int, height: int) -> np.ndarray:
    """One uint8 frame [H, W, 3] cover-cropped onto width x height (as it is when already that size)."""
    if frame.shape[:2] == (height, width):
        return frame
    return np.asarray(cover_crop(Image.fromarray(frame), width, height))


def prepare_image_reference(image: Image.Image, rules: CanvasRules = RELEASE_CANVAS) -> Image.Image:
    """An image reference at its own encode size (`CanvasRules.reference_image_size`), LANCZOS."""
    size = rules.reference_image_size(image.width, image.height)
    return image if image.size == size else image.resize(size, Image.Resampling.LANCZOS)


def count_at_24fps(count: int, fps: float) -> int:
    """How many frames `count` frames at `fps` become on the 24 fps slot grid (`frames_at_24fps`)."""
    return count if fps == FPS else math.floor(count * (FPS / fps) + 0.5)


def slot_sources(count: int, fps: float, limit: int | None = None) -> np.ndarray:
    """Which of `count` frames at `fps` fills each slot of the 24 fps grid (whole frames dropped and repeated: frame
    i starts at slot round(i * 24 / fps) and lasts until the next one starts), for the first `limit` slots."""
    total = count_at_24fps(count, fps)
    slots = np.arange(total if limit is None else min(limit, total))
    starts = np.floor(np.arange(count) * (FPS / fps) + 0.5).astype(np.int64)
    return np.searchsorted(starts, slots, side="right") - 1


def frames_at_24fps(frames: np.ndarray, fps: float, limit: int | None = None) -> np.ndarray:
    """[N, H, W, 3] at `fps` -> the 24 fps slot grid by dropping and repeating whole frames; only its first `limit`
    frames are made (a clip at 1 fps is 24 times as many frames at 24)."""
    if fps == FPS:
        return frames[:limit]
    return frames[slot_sources(frames.shape[0], fps, limit)]


def prepare_video_frames(
    frames: np.ndarray, fps: float, num_frames: int, rules: CanvasRules = RELEASE_CANVAS
) -> np.ndarray:
    """Reference frames [N, H, W, 3] uint8 at `fps` -> 24 fps, at most `num_frames`, on the canvas of
    their own aspect ratio (LANCZOS per frame; untouched when already there)."""
    frames = frames_at_24fps(frames, fps, num_frames)
    width, height = rules.canvas(frames.shape[2], frames.shape[1])
    if frames.shape[1:3] == (height, width):
        return frames
    return np.stack([onto_own_canvas(frame, rules) for frame in frames])


def onto_own_canvas(frame: np.ndarray, rules: CanvasRules = RELEASE_CANVAS) -> np.ndarray:
    """One reference frame [H, W, 3] uint8 on the canvas of its own aspect ratio (LANCZOS; untouched when there):
    a file's frames are fitted as they are decoded, so a 4K clip is never held at its own size."""
    width, height = rules.canvas(frame.shape[1], frame.shape[0])
    if frame.shape[:2] == (height, width):
        return frame
    return np.asarray(Image.fromarray(frame).resize((width, height), Image.Resampling.LANCZOS))


def vae_frame_count(num_frames: int) -> int:
    """A reference video's frame count snapped *down* to 17n + 5 (at least 22) so the VAE needs no padding."""
    return max(geometry.floor_frames(num_frames), geometry.FRAMES_PER_CHUNK + geometry.LATENTS_PER_CHUNK)


def prepare_audio(waveform, sample_rate: int, num_frames: int) -> torch.Tensor:
    """A mono or stereo waveform [C, N] at `sample_rate` -> float32 [2, M] at 32 kHz covering at most the
    output duration: cut to `int(F / 24 * sample_rate)` samples at the native rate, then resampled."""
    stereo = as_stereo_waveform(waveform)
    stereo = stereo[:, : int(num_frames / FPS * sample_rate)]
    return torch.from_numpy(np.ascontiguousarray(resample_audio(stereo, sample_rate)))


@dataclass(frozen=True)
class PreparedReference:
    """A reference normalized for the model (what diffusers calls a normalized reference).

    image:  PIL RGB image at its encode size (image references).
    frames: [N, H, W, 3] uint8, 24 fps, N <= F, on its own canvas (video references; all N frames go
            to the text encoder, the first `vae_frame_count(N)` to the VAE).
    audio:  [2, M] float32 at 32 kHz, M <= F/24 s (audio references and video soundtracks; None for a
            silent video)."""

    kind: str
    image: Image.Image | None = None
    frames: np.ndarray | None = None
    audio: torch.Tensor | None = None

    @property
    def has_audio(self) -> bool:
        return self.audio is not None

    def for_presentation(self) -> ImageReference | AudioReference | VideoReference:
        """The reference as the text encoder's presenter takes it."""
        if self.kind == "image":
            return ImageReference(self.image)
        if self.kind == "audio":
            return AudioReference()
        return VideoReference(self.frames, has_audio=self.has_audio)


def prepare_reference(
    reference: MediaReference, num_frames: int, rules: CanvasRules = RELEASE_CANVAS, what: str = "reference"
) -> PreparedReference:
    """Decode and normalize one reference for an output of `num_frames` frames (17n + 5)."""
    kind, source, start = reference.kind, reference.source, _check_start(reference.start_seconds, what)
    try:
        if kind == "image":
            return PreparedReference("image", image=prepare_image_reference(load_image(source, what), rules))
        if kind == "video":
            if _is_path(source):
                # its soundtrack over the output's length, as a clip in memory (and the reference) gives it, even
                # where it outlasts the picture; at its own rate, cut there and resampled once, as the reference does
                path = _existing_file(source, what)
                frames = media_read.read_video(path, start, max_frames=num_frames, with_audio=False,
                                               fit=functools.partial(onto_own_canvas, rules=rules)).frames
                fps, sound = float(FPS), media_read.native_soundtrack(path, start, num_frames / FPS)
                audio, rate = sound if sound is not None else (None, SAMPLE_RATE)
            else:
                frames, fps = _checked_video(source, what)
                audio, rate = _video_audio(source, what)
                frames = frames[_first_frame_at(start, fps) :]
                if audio is not None:
                    audio = audio[:, round(start * rate) :]
                    audio = audio if audio.shape[1] else None
            if frames.shape[0] == 0:
                raise MediaInputError(f"{what}: no video frames at or after {start} s.")
            return PreparedReference(
                "video",
                frames=prepare_video_frames(frames, fps, num_frames, rules),
                audio=None if audio is None else prepare_audio(audio, rate, num_frames),
            )
        if kind == "audio":
            if _is_path(source):  # at its own rate, cut there and resampled once, as the reference does
                waveform, rate = media_read.read_native_audio(_existing_file(source, what), start, num_frames / FPS)
            else:
                waveform, rate = _checked_audio(source, what)
                waveform = waveform[:, round(start * rate) :]
            if waveform.shape[1] == 0:
                raise MediaInputError(f"{what}: no audio at or after {start} s.")
            return PreparedReference("audio", audio=prepare_audio(waveform, rate, num_frames))
    except MediaError as error:
        raise MediaInputError(f"{what}: {error}") from error
    raise MediaInputError(f"{what}: a reference kind is 'image', 'video' or 'audio', got {kind!r}.")


# ----------------------------------------------------------------------------------------------
# Encode


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def encode_image(vae, image: Image.Image) -> torch.Tensor:
    """A keyframe or image reference -> normalized conditioning latents [1, C, 1, H/16, W/16], float32, CPU."""
    pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None, :, None]
    return encode_condition(vae, pixels.to(_device(vae))).cpu()


@torch.no_grad()
def encode_video(vae, frames: np.ndarray, on_clip=None) -> torch.Tensor:
    """Video reference frames [N, H, W, 3] -> normalized latents [1, C, L, H/16, W/16] of their first
    `vae_frame_count(N)` frames (L = 5n + 2), float32, CPU. The frames stay in CPU memory; each 17-frame
    clip visits the VAE's device as it is encoded (then `on_clip(frames so far)`, if given)."""
    count = vae_frame_count(frames.shape[0])
    pixels = torch.from_numpy(np.ascontiguousarray(frames[:count])).permute(3, 0, 1, 2)[None]
    return encode_condition(vae, pixels, on_clip=on_clip).cpu()


@torch.no_grad()
def encode_audio(audio_vae, waveform: torch.Tensor) -> torch.Tensor:
    """[2, M] at 32 kHz -> normalized posterior means as channel-major rows [1, 2A, Ca], A = ceil(M / hop),
    float32, CPU."""
    latents = audio_vae.encode(waveform.to(audio_vae.device))  # [2, Ca, A]
    return pack_audio(latents[None].float().cpu())
