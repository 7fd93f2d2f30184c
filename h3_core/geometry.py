"""Request geometry: canvas sizes, frame counts and latent lengths (h3-model.md F).

Pixel canvas (width, height) -> video latents (L, height/16, width/16) with L = 5n+2 for
F = 17n+5 pixel frames at 24 fps; audio latents A = round(F * 40/24) per stereo channel.
Sizes are always returned as (width, height) unless a name says otherwise (`latent_size`).
"""

from __future__ import annotations

import math
import operator

FPS = 24
AUDIO_LATENTS_PER_SECOND = 40
AUDIO_CHANNELS = 2
VAE_SPATIAL_FACTOR = 16
PATCH_SIZE = (1, 2, 2)  # (t, h, w) of one DiT video row
CANVAS_MULTIPLE = VAE_SPATIAL_FACTOR * PATCH_SIZE[2]  # 32
SHORT_EDGE = 768
MAX_PIXELS = 768 * 1344
# The longest canvas side taken (the nodes' width / height widgets stop here too): 4096x2304 at 5 s is already
# 9x the release's rows, about 52 GiB of activations a block.
MAX_CANVAS_EDGE = 4096
MIN_ASPECT_RATIO = 1 / 4
MAX_ASPECT_RATIO = 4.0
# The video VAE encodes 17-frame chunks into 5 latent frames, plus one leading frame of its own:
# F = 17n + 5 pixel frames <-> L = 5n + 2 latent frames.
FRAMES_PER_CHUNK = 17
LATENTS_PER_CHUNK = 5

ASPECT_RATIOS: dict[str, tuple[int, int]] = {
    "21:9": (21, 9),
    "16:9": (16, 9),
    "4:3": (4, 3),
    "1:1": (1, 1),
    "3:4": (3, 4),
    "9:16": (9, 16),
}


def _ratio_range_text() -> str:
    return f"1:{1 / MIN_ASPECT_RATIO:g} to {MAX_ASPECT_RATIO:g}:1"


def canvas_size(
    aspect: str | tuple[float, float], short_edge: int = SHORT_EDGE, max_pixels: int = MAX_PIXELS
) -> tuple[int, int]:
    """The canvas for an aspect ratio, as **(width, height)** in pixels.

    `aspect` is a name from `ASPECT_RATIOS` ("16:9") or a (width, height) pair of any positive
    numbers whose ratio is within 1:4..4:1 (e.g. a keyframe's pixel size). The short edge starts at
    `short_edge` (768), the area is capped at `max_pixels` (768*1344), then each axis is rounded to
    the nearest multiple of 32 (so the area may land slightly above the cap).
    """
    if isinstance(aspect, str):
        if aspect not in ASPECT_RATIOS:
            raise ValueError(
                f"Unknown aspect ratio {aspect!r}; named ratios are {', '.join(ASPECT_RATIOS)}, "
                f"or pass a (width, height) pair with a ratio from {_ratio_range_text()}."
            )
        aspect_width, aspect_height = ASPECT_RATIOS[aspect]
    else:
        aspect_width, aspect_height = aspect
    if not (aspect_width > 0 and aspect_height > 0):
        raise ValueError(f"An aspect ratio needs a positive width and height, got {aspect_width}:{aspect_height}.")
    ratio = aspect_width / aspect_height
    if not MIN_ASPECT_RATIO <= ratio <= MAX_ASPECT_RATIO:
        raise ValueError(
            f"Aspect ratio {aspect_width}:{aspect_height} ({ratio:.4g}) is outside the supported range "
            f"{_ratio_range_text()}."
        )

    if ratio >= 1.0:
        width, height = short_edge * ratio, float(short_edge)
    else:
        width, height = float(short_edge), short_edge / ratio
    area = width * height
    if area > max_pixels:
        scale = (max_pixels / area) ** 0.5
        width, height = width * scale, height * scale
    # Python's round (half to even) is what the reference uses.
    return (
        max(CANVAS_MULTIPLE, round(width / CANVAS_MULTIPLE) * CANVAS_MULTIPLE),
        max(CANVAS_MULTIPLE, round(height / CANVAS_MULTIPLE) * CANVAS_MULTIPLE),
    )


def check_canvas(width: int, height: int) -> None:
    """Raise ValueError unless (width, height) is a canvas the model generates on."""
    if width <= 0 or height <= 0 or width % CANVAS_MULTIPLE or height % CANVAS_MULTIPLE:
        raise ValueError(
            f"Canvas width and height must be positive multiples of {CANVAS_MULTIPLE} "
            f"(VAE factor {VAE_SPATIAL_FACTOR} x patch {PATCH_SIZE[2]}), got width={width}, height={height}."
        )
    if max(width, height) > MAX_CANVAS_EDGE:
        raise ValueError(
            f"Canvas {width}x{height} is too large: each side is at most {MAX_CANVAS_EDGE} pixels (the release's "
            f"canvases are about {MAX_PIXELS:,} pixels, 1344x768 at 16:9)."
        )
    ratio = width / height
    if not MIN_ASPECT_RATIO <= ratio <= MAX_ASPECT_RATIO:
        raise ValueError(
            f"Canvas {width}x{height} has aspect ratio {ratio:.4g}; the model supports {_ratio_range_text()}."
        )


def align_frames(num_frames: int) -> int:
    """Snap a pixel frame count up to the next 17k + 5 the video VAE can encode."""
    num_frames = operator.index(num_frames)
    if num_frames < 1:
        raise ValueError(f"The frame count must be positive, got {num_frames}.")
    chunks = max(0, math.ceil((num_frames - LATENTS_PER_CHUNK) / FRAMES_PER_CHUNK))
    return FRAMES_PER_CHUNK * chunks + LATENTS_PER_CHUNK


def floor_frames(num_frames: int) -> int:
    """The largest 17n + 5 (n >= 0) not over `num_frames` (>= 5): a clip cut to what the VAE takes unpadded."""
    return (num_frames - LATENTS_PER_CHUNK) // FRAMES_PER_CHUNK * FRAMES_PER_CHUNK + LATENTS_PER_CHUNK


def frames_for_duration(seconds: float) -> int:
    """Pixel frames for a duration: round(seconds * 24), then snapped up to 17k + 5."""
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"The duration must be a positive number of seconds, got {seconds}.")
    # round rather than ceil is inferred, not confirmed by an official implementation
    # (h3-model.md open question 6); e.g. 5.2 s -> 125 -> 141 frames.
    return align_frames(max(1, round(seconds * FPS)))


def duration_for_frames(num_frames: int) -> float:
    """A duration in tenths of a second (a 0.1-step widget's) that resolves to `num_frames` (17n + 5): their
    length rounded down to a tenth, which is at most 2.4 frames short, where the 17-frame snap makes it up."""
    if align_frames(num_frames) != num_frames:
        raise ValueError(f"{num_frames} frames is not 17n + 5.")
    return math.floor(num_frames * 10 / FPS) / 10


def latent_frames(num_frames: int) -> int:
    """Video latent frames (5n + 2) for F = 17n + 5 pixel frames."""
    num_frames = operator.index(num_frames)
    if num_frames < 1 or num_frames % FRAMES_PER_CHUNK != LATENTS_PER_CHUNK:
        raise ValueError(
            f"The frame count must be of the form {FRAMES_PER_CHUNK}n + {LATENTS_PER_CHUNK} "
            f"(e.g. 124, 243), got {num_frames}; align_frames() snaps a count up to the grid."
        )
    return (num_frames - LATENTS_PER_CHUNK) // FRAMES_PER_CHUNK * LATENTS_PER_CHUNK + 2


def pixel_frames(latent_frames: int) -> int:
    """Pixel frames (17n + 5) that L = 5n + 2 video latent frames decode to: `latent_frames`' inverse."""
    return (latent_frames - 2) // LATENTS_PER_CHUNK * FRAMES_PER_CHUNK + LATENTS_PER_CHUNK


def audio_latents(num_frames: int) -> int:
    """Audio latents per channel covering `num_frames` video frames: round(F * 40/24)."""
    if num_frames < 1:
        raise ValueError(f"The frame count must be positive, got {num_frames}.")
    return int(round(num_frames / FPS * AUDIO_LATENTS_PER_SECOND))


def latent_size(width: int, height: int) -> tuple[int, int]:
    """Video latent **(height, width)** for a pixel canvas of (width, height)."""
    if width <= 0 or height <= 0 or width % VAE_SPATIAL_FACTOR or height % VAE_SPATIAL_FACTOR:
        raise ValueError(
            f"Pixel width and height must be positive multiples of {VAE_SPATIAL_FACTOR}, "
            f"got width={width}, height={height}."
        )
    return height // VAE_SPATIAL_FACTOR, width // VAE_SPATIAL_FACTOR
