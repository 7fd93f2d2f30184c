"""Guides: an image, a short clip or a sound anchored at a pixel frame of the target video (any task).

    conditioning = add_guide(conditioning, frame_index=60, video_vae=vae, frames=image)     # chain several

From files (`h3 generate --guide FRAME:KIND=PATH`): `Request.guides` holds `GuideFile`s, which
`pipeline.generate` reads and checks before any model loads and adds after encoding.

The release's pipelines (diffusers) anchor keyframes at the first and last frame only; ComfyUI's native
H3 support (`MiniMaxH3AddGuide`) anchors them anywhere, which is where these facts come from:
- a guide packs after the text and keyframe rows, before ref2va's references, as conditioning rows: its
  video latent frames on the target grid from t = origin + 5/3 * frame_index (origin: where the target
  starts, after the references' span; the usual latent frame spans after that), then its stereo audio
  latents from the same t on the target audio columns (`layout.build_t2va_layout`, `build_ref2va_layout`);
- an image batch of fewer than 5 frames is its first image; a longer one is a clip, cut to its first
  17n + 5 frames; both are cover-cropped (LANCZOS, centred) onto the canvas; the clip must fit in the
  video from `frame_index` on;
- a sound is encoded whole (up to the video's length) and its latents cut to those left after the
  anchor;
- the text encoder does not see guides (the prompt's presentation holds fl2va keyframes and ref2va
  references only).
The sampler treats a guide like a keyframe: video rows mixed to 0.999 with the request generator (one
draw each in packed order, as diffusers draws for keyframes and references; ComfyUI's native nodes seed
each condition's draw anew instead) on the conditioning clock; audio rows clean.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from . import geometry, media_read
from .conditioning import NO_VAE, TASKS, Conditioning, RequestError, check_ratio
from .encode_memory import encode_working_bytes
from .layout import FRAME_TIME, GuideBlock, build_ref2va_layout, build_t2va_layout, pack_audio, unpack_audio
from .media import SAMPLE_RATE, MediaError, as_stereo_waveform, naming, resampled_length
from .references import (
    MediaInputError, as_rgb, encode_audio, encode_image, encode_video, frames_on_canvas, load_image, prepare_audio,
)

MIN_GUIDE_CLIP_FRAMES = geometry.LATENTS_PER_CHUNK  # 5: shorter batches are one image
GUIDE_KINDS = ("image", "video", "audio")


@dataclass(frozen=True)
class GuideFile:
    """A guide in a file: an image, a video (its frames at 24 fps and its soundtrack, if any, cut where the
    target video ends) or a sound, anchored at `frame_index` (negative: from the end)."""

    frame_index: int
    kind: str
    path: Path

    def __post_init__(self):
        if self.kind not in GUIDE_KINDS:
            raise RequestError(f"A guide file is one of {', '.join(GUIDE_KINDS)}, got {self.kind!r}.")


@dataclass(frozen=True)
class GuideMedia:
    """A guide in memory, before encoding: frames (a PIL image or uint8 [N, H, W, 3] at 24 fps), a sound
    [C, M] at `sample_rate`, or both, anchored at `frame_index` (negative: from the end). A long video
    takes its guides this way (long_video.LongVideoRequest.guides)."""

    frame_index: int
    frames: object = None
    waveform: object = None
    sample_rate: int | None = None


def read_guide(guide: GuideFile, num_frames: int, clip_frames: int | None = None
               ) -> tuple[np.ndarray | None, np.ndarray | None, int | None]:
    """(frames [N, H, W, 3] uint8 at 24 fps or None, sound [2, M] or None, its sample rate) of a guide file:
    a video file's frames up to the end of the video (`clip_room`) and at most `clip_frames` (a long video's
    window: no clip can be longer) if given, its soundtrack up to the end of the video however many frames are
    read (as a VIDEO's in memory: the sound may run on past the clip); a sound at most as long as the video."""
    what = f"the {guide.kind} guide at frame {guide.frame_index} ({guide.path})"
    if not Path(guide.path).is_file():
        raise RequestError(f"{what}: no such file.")
    try:
        if guide.kind == "image":
            return np.asarray(load_image(guide.path, what)), None, None
        if guide.kind == "video":
            room = clip_room(guide.frame_index, num_frames)
            clip = media_read.read_video(guide.path, 0.0, max_frames=min(room, clip_frames or room),
                                         sound_seconds=room / geometry.FPS)
            return clip.frames, clip.audio, None if clip.audio is None else SAMPLE_RATE
        return None, media_read.read_audio(guide.path, 0.0, num_frames / geometry.FPS), SAMPLE_RATE
    except (MediaError, MediaInputError) as error:
        raise RequestError(naming(what, error)) from None


def clip_room(frame_index: int, num_frames: int) -> int:
    """How many frames a video guide anchored at `frame_index` (negative: from the end) can hold before a
    `num_frames`-frame video ends: a longer video file is read only that far. At least 1 and at most
    `num_frames`, so an anchor outside the video is still reported by `resolve_frame_index`."""
    anchor = frame_index if frame_index >= 0 else num_frames + frame_index
    return min(num_frames, max(1, num_frames - anchor))


def guide_frame_count(count: int) -> int:
    """Pixel frames a batch of `count` images anchors: 1 below 5, else the largest 17n + 5 <= count."""
    if count < MIN_GUIDE_CLIP_FRAMES:
        return 1
    return geometry.floor_frames(count)


def resolve_frame_index(frame_index: int, num_frames: int, frames: int = 1) -> int:
    """A frame index (negative: from the end) as a frame of the video, checked so `frames` fit from it."""
    if frames > num_frames:
        raise RequestError(f"A {frames}-frame guide clip is longer than the video's {num_frames} frames; give "
                           f"at most {num_frames} frames.")
    resolved = frame_index if frame_index >= 0 else num_frames + frame_index
    if 0 <= resolved < num_frames and resolved + frames > num_frames:
        raise RequestError(f"A {frames}-frame guide clip from frame_index {frame_index} runs past the video's "
                           f"{num_frames} frames (to frame {resolved + frames - 1}); start it at 0..{num_frames - frames} "
                           f"or -{num_frames}..-{frames}.")
    if resolved < 0 or resolved + frames > num_frames:
        raise RequestError(f"frame_index {frame_index} is outside the video's {num_frames} frames; use "
                           f"0..{num_frames - frames} or -{num_frames}..-{frames}.")
    return resolved


def _as_frames(frames) -> np.ndarray:
    """A PIL image or uint8 frames [N, H, W, 3] (or one [H, W, 3]) as [N, H, W, 3]."""
    array = np.asarray(as_rgb(frames)) if isinstance(frames, Image.Image) else np.asarray(frames)
    array = array[None] if array.ndim == 3 else array
    if array.ndim != 4 or array.shape[-1] != 3 or array.dtype != np.uint8 or not array.shape[0]:
        raise RequestError(f"Guide frames must be uint8 RGB [N, H, W, 3] or a PIL image, got {array.dtype} "
                           f"{list(array.shape)}.")
    check_ratio(array.shape[2], array.shape[1], "The guide picture")
    return array


def check_guide(task: str, num_frames: int, frame_index: int, frames=None, waveform=None,
                sample_rate: int | None = None) -> tuple[np.ndarray | None, int, int]:
    """Every check of a guide on a `task` video of `num_frames` frames that needs no model: (its frames as
    [N, H, W, 3] uint8 or None, the video frame it anchors at, how many audio latents a sound may keep
    from there)."""
    if task not in TASKS:
        raise RequestError(f"Unknown task {task!r}; guides anchor frames of a {', '.join(TASKS)} video.")
    if frames is None and waveform is None:
        raise RequestError("A guide needs frames (an image or a clip), a sound, or both.")
    pixels = None if frames is None else _as_frames(frames)
    count = 1 if pixels is None else guide_frame_count(pixels.shape[0])
    anchor = resolve_frame_index(int(frame_index), num_frames, count)
    keep = math.floor(geometry.audio_latents(num_frames) - FRAME_TIME * anchor)
    if waveform is not None:
        if sample_rate is None:
            raise RequestError("A guide sound needs its sample_rate.")
        if isinstance(sample_rate, bool) or not (isinstance(sample_rate, numbers.Real) and sample_rate > 0
                                                 and float(sample_rate).is_integer()):
            raise RequestError(f"A guide sound's sample_rate is a positive whole number of Hz, got {sample_rate!r}.")
        try:  # a waveform the encode would refuse (int PCM, 3 channels, NaN) is refused before any model runs
            samples = as_stereo_waveform(waveform).shape[1]
        except ValueError as error:
            raise RequestError(f"The guide sound: {error}") from None
        if samples == 0:
            raise RequestError("The guide sound holds no samples.")
        if keep < 1:
            raise RequestError(f"frame_index {frame_index} is past the end of the video's soundtrack.")
    return pixels, anchor, keep


def check_guides_beside_kept(guides, keep: str | None) -> None:
    """No guide carries what `keep` holds fixed ("video" or "audio" of a given clip): that part comes back as it
    is, so a guide picture or sound for it would only contradict it. `guides`: GuideBlocks or GuideMedia."""
    for number, guide in enumerate(guides, 1):
        if isinstance(guide, GuideBlock):
            picture, sound = guide.latent_frames > 0, guide.audio_latents > 0
        else:
            picture, sound = guide.frames is not None, guide.waveform is not None
        if keep == "audio" and sound:
            raise RequestError(f"Guide {number} holds a sound, but keep = audio holds the given clip's sound as it "
                               "is; drop the sound from the guide, or keep nothing.")
        if keep == "video" and picture:
            raise RequestError(f"Guide {number} holds a picture, but keep = video holds the given clip's video as it "
                               "is; only sounds can guide it.")


def guide_encode_bytes(frames, waveform, sample_rate: int | None, width: int, height: int, video_vae=None,
                       audio_vae=None) -> int:
    """Device memory encoding a guide's `frames` (a PIL image or uint8 [N, H, W, 3]) on a `width` x `height`
    canvas and its sound [C, M] at `sample_rate` needs besides the VAEs' weights (`encode_working_bytes`)."""
    pictures = []
    if frames is not None:
        count = 1 if isinstance(frames, Image.Image) else guide_frame_count(np.shape(frames)[0])
        pictures.append((count, height, width))
    sounds = [] if waveform is None else [resampled_length(np.shape(waveform)[-1], int(sample_rate))]
    return encode_working_bytes(video_vae, audio_vae, pictures, sounds)


def encode_guide(pixels: np.ndarray | None, waveform, sample_rate: int | None, width: int, height: int,
                 num_frames: int, video_vae=None, audio_vae=None,
                 on_clip=None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A checked guide's media (`check_guide`'s frames) on a `width` x `height` canvas of a `num_frames`-frame
    video -> (video latents [1, C, L, h, w] or None, sound latents [2, Ca, A] or None), normalized, CPU.
    `on_clip(done, total)` after each 17 frames of a clip encoded: progress, and a host may raise there to stop
    (a clip is a VAE run of up to 362 frames)."""
    if pixels is not None and video_vae is None:
        raise RequestError(f"Guide frames are encoded with the video VAE{NO_VAE}")
    if waveform is not None and audio_vae is None:
        raise RequestError(f"A guide sound is encoded with the audio VAE{NO_VAE}")
    latents, sound = None, None
    if pixels is not None:
        count = guide_frame_count(pixels.shape[0])
        fitted = frames_on_canvas(pixels[:count], width, height)
        if count == 1:
            latents = encode_image(video_vae, Image.fromarray(fitted[0]))
        else:
            latents = encode_video(video_vae, fitted, None if on_clip is None else lambda done: on_clip(done, count))
    if waveform is not None:
        prepared = prepare_audio(waveform, int(sample_rate), num_frames)
        sound = unpack_audio(encode_audio(audio_vae, prepared))[0]
    return latents, sound


def add_guide(conditioning: Conditioning, frame_index: int, video_vae=None, audio_vae=None, frames=None,
              waveform=None, sample_rate: int | None = None, on_clip=None) -> Conditioning:
    """`conditioning` with one more guide at pixel frame `frame_index` (negative: from the end).

    frames     a PIL image, or uint8 frames [N, H, W, 3] at 24 fps (N >= 5: a clip); needs `video_vae`
    waveform   a sound [C, M] (mono or stereo) at `sample_rate`; needs `audio_vae`
    on_clip    `encode_guide`'s: (frames encoded, of how many) after each 17 frames of a clip
    Everything is checked before a model runs."""
    pixels, anchor, keep = check_guide(conditioning.task, conditioning.num_frames, frame_index, frames, waveform,
                                       sample_rate)
    latents, sound = encode_guide(pixels, waveform, sample_rate, conditioning.width, conditioning.height,
                                  conditioning.num_frames, video_vae, audio_vae, on_clip)
    rows = None if sound is None else pack_audio(sound[None, ..., :keep])  # each channel's first `keep`
    block = GuideBlock(anchor, 0 if latents is None else latents.shape[2],
                       0 if rows is None else rows.shape[1] // geometry.AUDIO_CHANNELS)
    guides = (*conditioning.guides, block)
    layout = conditioning.layout
    target = (layout.latent_frames, layout.latent_height, layout.latent_width, layout.audio_latents)
    if conditioning.task == "ref2va":
        layout = build_ref2va_layout(conditioning.text_tags, conditioning.reference_blocks, *target, guides=guides)
    else:
        layout = build_t2va_layout(conditioning.text_tags, *target, conditioning.keyframe_anchors, guides=guides)
    # packed order: keyframes, the guides so far, this one, then references
    visual = list(conditioning.visual_condition_latents)
    if latents is not None:
        visual.insert(len(conditioning.keyframe_anchors) + sum(g.latent_frames > 0 for g in conditioning.guides), latents)
    audio = conditioning.audio_condition_rows
    if rows is not None:
        held = sum(g.audio_latents for g in conditioning.guides) * geometry.AUDIO_CHANNELS
        audio = torch.cat([audio[:, :held], rows, audio[:, held:]], 1)
    return dataclasses.replace(conditioning, layout=layout, visual_condition_latents=visual,
                               audio_condition_rows=audio, guides=guides)
