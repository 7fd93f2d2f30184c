"""Adapters between ComfyUI's data types and h3_core, plus the handles that travel on our sockets.

Pure functions: no ComfyUI import, so the tests run them on a machine without ComfyUI.

    IMAGE   float [B, H, W, C] in 0..1               <-> PIL images / uint8 [N, H, W, 3]
    AUDIO   {"waveform": [B, C, N], "sample_rate"}   <-> DecodedAudio / float [2, N] at 32 kHz
    VIDEO   object with get_components() (images, frame_rate, audio) -> DecodedVideo
    H3_LATENT  dict {"video": [1, 24, L, h, w], "audio": [2, 32, A], "seed", "task", ...} <-> AVLatents
               ("empty": True from H3 Empty AV Latent: zeros that only fix the size)
    LATENT  (ComfyUI's own H3 AV latent) video [B, 24, L, h, w] and audio [B, 32, 2, A] <-> H3_LATENT per item
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from h3_core import geometry, media_read
from h3_core.conditioning import PartNames, Request
from h3_core.media import (
    DEFAULT_LAYOUTS,
    SAMPLE_RATE,
    MediaError,
    as_uint8_frames,
    audio_samples_for_frames,
    downmix_to_stereo,
    resample_audio,
)
from h3_core.lora import VSA_STUDENT_CONTRACT, applied_contracts, sampler_settings, task_warnings
from h3_core.output import AVLatents
from h3_core.prompt import MAX_KEYFRAMES, reference_mix_problem
from h3_core.references import (
    RELEASE_CANVAS, CanvasRules, DecodedAudio, DecodedVideo, MediaReference, frames_at_24fps,
)

LATENT_KIND = "h3_av_latent"


# ----------------------------------------------------------------------------------------------
# Handles carried on our custom sockets (H3_MODEL, H3_TEXT_ENCODER, H3_VAE)


@dataclass(frozen=True)
class DiTRunSettings:
    """A Model Loader's settings that leave the weights as they are: applied to the DiT at each run, so loaders
    differing only in these share one read of the weights (a 62 GiB read for a new attention kernel otherwise)."""

    attention: str  # a backend name, resolved by the loader
    window: int = 0
    dense_steps: int = 0
    compile: bool = False
    budget_gib: float | None = None

    def apply(self, dit, placement) -> None:
        placement.budget_gib = self.budget_gib
        dit.set_attention(self.attention, self.window, self.dense_steps)
        dit.set_compiled(self.compile)


@dataclass(frozen=True)
class ModelHandle:
    """A loaded DiT and what the sampler needs to know about it. LoRAs are listed, not merged: the
    sampler hooks them in for its run and removes them after, so the loader's cached DiT stays clean."""

    dit: Any = field(repr=False)  # reprs stay short: ComfyUI prints node inputs into its error reports
    partition: str  # "fl2va" | "ref2va"
    name: str
    device: torch.device
    tiny: bool = False
    loras: tuple = field(default=(), repr=False)  # ((LoRA, strength), ...) in application order
    patcher: Any = field(default=None, repr=False)  # the host's memory manager's handle (nodes/memory.py)
    run: DiTRunSettings | None = None  # None: a split DiT, its workers built with their settings

    def with_lora(self, lora, strength: float) -> ModelHandle:
        return replace(self, loras=self.loras + ((lora, float(strength)),))

    @property
    def split(self) -> bool:
        """True when the DiT runs split over several devices (worker processes hold it, not this process)."""
        return not isinstance(self.dit, torch.nn.Module)

    @property
    def vsa_student(self) -> bool:
        """A DiT with VSA gates (FastH3 8-Step V2): it samples on its own ladder (lora.VSA_STUDENT_CONTRACT). A split
        DiT's placement knows its config from the headers."""
        return self.dit.config.vsa_gates

    def sampler_settings(self, task: str, steps=None, video_shift=None, audio_shift=None, video_sigmas=None,
                         audio_sigmas=None):
        """`lora.sampler_settings` from the schedules this model samples on (its adapters' that act, a VSA
        student's own) and the user's values (None: the schedule's); an adapter distilled for another task
        than `task` is warned about in the log, and so is a setting that overrides an adapter's distilled one (the
        command line says both too)."""
        contracts = applied_contracts(self.loras) + ([VSA_STUDENT_CONTRACT] if self.vsa_student else [])
        log = logging.getLogger("h3")
        for line in task_warnings(contracts, task):
            log.warning("H3: %s", line)
        settings = sampler_settings(contracts, steps, video_shift, audio_shift, video_sigmas, audio_sigmas)
        ladders = [len(ladder) for ladder in (settings.video_sigmas, settings.audio_sigmas) if ladder is not None]
        points = min(ladders) if ladders else settings.steps  # walked together up to the shorter
        log.log(logging.WARNING if settings.notes else logging.INFO,
                "H3: sampler: %d sigma points (%d model calls), video shift %g, audio shift %g; from the %s%s",
                points, points - 1, settings.video_shift, settings.audio_shift, settings.source,
                "".join(f"; {note}" for note in settings.notes))
        return settings


@dataclass(frozen=True)
class TextEncoderHandle:
    encoder: Any = field(repr=False)
    name: str
    canvas: CanvasRules  # tiny-random encodes on the small canvas its demo models were made for
    patcher: Any = field(default=None, repr=False)


@dataclass(frozen=True)
class VAEHandle:
    video: Any = field(repr=False)
    audio: Any = field(repr=False)
    name: str
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    patcher: Any = field(default=None, repr=False)
    canvas: CanvasRules = RELEASE_CANVAS  # the canvas a clip is encoded on when none is given


# ----------------------------------------------------------------------------------------------
# IMAGE


def _check_image(image: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(image, torch.Tensor):
        raise ValueError(f"{what} must be a ComfyUI IMAGE tensor [B, H, W, C], got {type(image).__name__}.")  # noqa: TRY004 (one error type for bad node inputs)
    if image.ndim == 3:
        image = image[None]
    if image.ndim == 4 and image.shape[0] == 0:
        raise ValueError(f"{what} holds no pictures (an empty batch, {list(image.shape)}): connect one that has some.")
    if image.ndim != 4 or image.shape[-1] not in (1, 3, 4):
        raise ValueError(f"{what} must be a ComfyUI IMAGE [B, H, W, C] with C = 1, 3 or 4; got {list(image.shape)}.")
    if image.shape[1] == 0 or image.shape[2] == 0:  # a crop with bad settings, say
        raise ValueError(f"{what} has no pixels ({image.shape[2]}x{image.shape[1]}): connect a picture of some size.")
    return image


def image_to_uint8(image: torch.Tensor, what: str = "image") -> np.ndarray:
    """IMAGE [B, H, W, C] 0..1 (or uint8 0..255, as a few nodes make) -> uint8 [B, H, W, 3] (grey repeated,
    alpha dropped)."""
    image = _check_image(image, what)
    if image.shape[-1] == 1:
        image = image.expand(*image.shape[:-1], 3)
    return as_uint8_frames(image[..., :3], f"{what}'s pixels")


def image_to_pils(image: torch.Tensor, what: str = "image") -> list[Image.Image]:
    return [Image.fromarray(frame) for frame in image_to_uint8(image, what)]


def image_to_pil(image: torch.Tensor, what: str = "image") -> Image.Image:
    """The first picture of an IMAGE batch as a PIL RGB image (a keyframe or an image reference); the rest of a
    batch, and transparency (RGB kept as it is under it), are left out with a warning in the log."""
    image = _check_image(image, what)
    log = logging.getLogger("h3")
    if image.shape[0] > 1:
        log.warning("H3: %s is a batch of %d images; its first is used.", what, image.shape[0])
    opaque = 255 if image.dtype == torch.uint8 else 1.0  # a few nodes hand uint8 0..255 on
    if image.shape[-1] == 4 and bool((image[:1, ..., 3] < opaque).any()):
        log.warning("H3: %s has transparent pixels; H3 takes RGB, so what lies under them is used (composite the "
                    "picture onto a background first to choose it).", what)
    return image_to_pils(image[:1], what)[0]


def frames_to_image(blocks, total: int | None = None) -> torch.Tensor:
    """Frame blocks [n, H, W, 3], uint8 or float32 in 0..1 (as h3_core's decoder yields them) -> IMAGE float32
    [F, H, W, 3], each block written into the IMAGE as it comes (`total` frames: F, when known), so a long clip
    is held once, not as its blocks, their concatenation and a float copy of that."""
    if total is None:
        blocks = list(blocks)
        total = sum(len(block) for block in blocks)
    image, done = None, 0
    for block in blocks:
        block = block if isinstance(block, torch.Tensor) else torch.as_tensor(np.asarray(block))
        if block.ndim != 4 or block.shape[-1] != 3 or not (block.dtype == torch.uint8 or block.is_floating_point()):
            raise ValueError(f"Frames must be uint8 or float [n, H, W, 3]; got {block.dtype} {list(block.shape)}.")
        if image is None:
            image = torch.empty(total, *block.shape[1:], dtype=torch.float32)
        if done + len(block) > total or block.shape[1:] != image.shape[1:]:
            raise ValueError(f"Frame blocks of {list(block.shape)} do not fill an IMAGE of {list(image.shape)} "
                             f"from frame {done}.")
        part = image[done : done + len(block)]
        part.copy_(block)
        if block.dtype == torch.uint8:
            part.div_(255.0)
        done += len(block)
    if image is None or done != total:
        raise ValueError("No frames to make an IMAGE from." if image is None else
                         f"The frame blocks held {done} frames; {total} were expected.")
    return image


# ----------------------------------------------------------------------------------------------
# AUDIO


# a float sound a little over full scale is a hot mix; one far over it is PCM values stored as floats
LOUDEST_FLOAT_SAMPLE = 64.0


def _check_audio(audio: dict, what: str) -> tuple[torch.Tensor, int]:
    if not isinstance(audio, dict) or "waveform" not in audio or "sample_rate" not in audio:
        raise ValueError(f"{what} must be a ComfyUI AUDIO dict with 'waveform' [B, C, N] and 'sample_rate'.")
    waveform, rate = audio["waveform"], int(audio["sample_rate"])
    if not isinstance(waveform, torch.Tensor) or waveform.ndim != 3:
        raise ValueError(f"{what}: waveform must be a tensor [B, C, N]; got {getattr(waveform, 'shape', waveform)!r}.")
    if waveform.shape[0] == 0:
        raise ValueError(f"{what} holds no sounds (an empty batch, {list(waveform.shape)}): connect one that has one.")
    if waveform.shape[0] > 1:
        raise ValueError(f"{what} is a batch of {waveform.shape[0]} sounds; H3 takes one here (one slot or input "
                         "for each sound).")
    if waveform.shape[1] not in DEFAULT_LAYOUTS:
        raise ValueError(f"{what}: H3 takes sound of 1 to {max(DEFAULT_LAYOUTS)} channels; got {waveform.shape[1]}.")
    if rate <= 0:
        raise ValueError(f"{what}: sample_rate must be positive, got {rate}.")
    if waveform.dtype in (torch.int16, torch.int32):  # PCM samples, as a few nodes hand them: to -1..1
        waveform = waveform.float() / -torch.iinfo(waveform.dtype).min
    elif not waveform.is_floating_point():
        raise ValueError(f"{what}: waveform samples must be floats in -1..1 (or int16 / int32 PCM); got "
                         f"{waveform.dtype}.")
    low, high = torch.aminmax(waveform) if waveform.numel() else (torch.zeros(()), torch.zeros(()))
    peak = max(-float(low), float(high))  # no |waveform| copy of a long sound
    if peak > LOUDEST_FLOAT_SAMPLE:  # encoded as it is, it would be noise
        raise ValueError(f"{what}: waveform samples reach {peak:g}; float samples are -1..1 (PCM values stored as "
                         "floats? divide them by 32768, or pass int16).")
    return waveform, rate


def audio_to_decoded(audio: dict, what: str = "audio") -> DecodedAudio:
    """AUDIO (one sound) -> DecodedAudio [C, N] float32 at its own rate, mono or stereo; wider sound (5.1, read in
    FFmpeg's default layout for its channel count) downmixed to stereo as reading such a file does."""
    waveform, rate = _check_audio(audio, what)
    sound = waveform[0].detach().float().cpu().contiguous()
    if sound.shape[0] > 2:
        sound = torch.from_numpy(downmix_to_stereo(sound.numpy(), rate))
    return DecodedAudio(sound, rate)


def audio_to_stereo_32k(audio: dict, what: str = "audio") -> np.ndarray:
    """AUDIO -> float32 [2, N] at 32 kHz (resampled and upmixed as needed), what the MP4 writer takes."""
    decoded = audio_to_decoded(audio, what)
    return resample_audio(decoded.waveform, decoded.sample_rate)


def waveform_to_audio(pieces, num_frames: int | None = None, sample_rate: int = SAMPLE_RATE) -> dict:
    """Waveform pieces [2, n] (as h3_core's audio decoder yields them) -> AUDIO {"waveform": [1, 2, N]}.
    With `num_frames` the result is cut (or zero-padded) to last exactly as long as that many frames."""
    pieces = [torch.as_tensor(p).float().cpu() for p in pieces]
    if not pieces:
        raise ValueError("No audio to make an AUDIO from.")
    waveform = torch.cat(pieces, dim=-1)
    if waveform.ndim != 2 or waveform.shape[0] != 2:
        raise ValueError(f"Decoded audio must be [2, N]; got {list(waveform.shape)}.")
    if num_frames is not None:
        want = audio_samples_for_frames(num_frames)
        waveform = waveform[:, :want]
        if waveform.shape[1] < want:
            waveform = torch.nn.functional.pad(waveform, (0, want - waveform.shape[1]))
    return {"waveform": waveform[None].contiguous(), "sample_rate": int(sample_rate)}


# ----------------------------------------------------------------------------------------------
# VIDEO


def video_to_decoded(video, what: str = "video") -> DecodedVideo:
    """A ComfyUI VIDEO (anything with get_components() -> images [F, H, W, C], frame_rate, audio)
    -> DecodedVideo with its soundtrack, if it has one."""
    get = getattr(video, "get_components", None)
    if get is None:
        raise ValueError(f"{what} must be a ComfyUI VIDEO (with get_components()), got {type(video).__name__}.")
    parts = get()
    frames = image_to_uint8(parts.images, f"{what} frames")
    fps = float(parts.frame_rate)
    if not fps > 0:
        raise ValueError(f"{what}: frame rate must be positive, got {parts.frame_rate!r}.")
    audio = getattr(parts, "audio", None)
    if audio is None:
        return DecodedVideo(frames, fps)
    decoded = audio_to_decoded(audio, f"{what} soundtrack")
    return DecodedVideo(frames, fps, decoded.waveform, decoded.sample_rate)


def video_file(video) -> tuple[str, float, float] | None:
    """(path, start seconds, duration seconds or 0 = to the end) of a ComfyUI VIDEO read from a file on disk
    (Load Video's VideoFromFile, trimmed or not), or None for any other VIDEO. Such a clip can be read
    straight from its file, frame by frame, instead of decoded whole into float32 frames by get_components()
    (a 30 s 1080p clip: 18 GB)."""
    source = getattr(video, "get_stream_source", None)
    path = source() if callable(source) and _frames_are_its_file(video) else None
    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
        return None
    trim = getattr(video, "get_active_trim_window", None)
    start, duration = trim() if callable(trim) else (0.0, 0.0)
    return os.fspath(path), float(start), float(duration)


def _frames_are_its_file(video) -> bool:
    """Whether `video`'s frames are its stream source's. Not when it answers get_stream_source() by ComfyUI's
    VideoInput default (a VIDEO made from frames, e.g. by Create Video: that encodes the whole clip to H.264 in
    memory, which takes seconds to minutes and fails on frames x264 cannot take, RGBA or odd sizes); not when a
    class below the one naming the file makes the frames (a Load Video with a crop that crops in get_components()
    and names the uncropped file); not with frame edits pending (a newer ComfyUI's as_cropped / as_resized)."""
    order = type(video).__mro__

    def owner(name: str) -> int:  # where in the class order `name` is defined; past the end: on the instance
        return next((i for i, cls in enumerate(order) if name in vars(cls)), len(order))

    source = owner("get_stream_source")
    if source < len(order) and order[source].__name__ == "VideoInput":
        return False
    if any(owner(name) < source for name in ("get_components", "get_components_internal")):
        return False
    pending = getattr(video, "has_pending_frame_edits", None)
    return not (callable(pending) and pending())


def trim_frames(duration: float, cap: int) -> int:
    """How many 24 fps frames a trim window of `duration` seconds holds (0: no end, so `cap`), 1 to `cap`."""
    return max(1, min(cap, round(duration * geometry.FPS))) if duration else cap


def video_at_24fps(video, what: str, max_frames: int, fit=None, with_audio: bool = True,
                   sound_frames: int | None = None) -> DecodedVideo:
    """A ComfyUI VIDEO's first `max_frames` frames on the 24 fps grid (uint8) and its soundtrack from the same
    start, `sound_frames` frames long (None: all of it) however many frames are kept: a guide's sound runs on
    past its clip. A Load Video VIDEO is read from its file (trim honoured), `fit` applied to each frame as it
    is decoded, so a long or large file is never held whole; any other VIDEO comes through get_components()
    and is cut after."""
    on_disk = video_file(video)
    if on_disk is None:
        clip = video_to_decoded(video, what)
        audio = clip.audio if with_audio else None
        if audio is not None and sound_frames is not None:
            audio = audio[:, :round(sound_frames / geometry.FPS * clip.sample_rate)]
        return DecodedVideo(frames_at_24fps(clip.frames, clip.fps, max_frames), float(geometry.FPS), audio,
                            None if audio is None else clip.sample_rate)
    path, start, duration = on_disk
    spans = [seconds for seconds in (duration, sound_frames and sound_frames / geometry.FPS) if seconds]
    try:
        clip = media_read.read_video(path, start, trim_frames(duration, max_frames), with_audio=with_audio, fit=fit,
                                     sound_seconds=min(spans, default=math.inf))
    except MediaError as error:
        raise ValueError(f"{what}: {error}") from None
    return DecodedVideo(clip.frames, float(geometry.FPS), clip.audio, None if clip.audio is None else SAMPLE_RATE)


# ----------------------------------------------------------------------------------------------
# The request


def media_reference(kind: str, value, what: str) -> MediaReference:
    """A ComfyUI IMAGE / VIDEO / AUDIO value -> an h3_core MediaReference. A Load Video VIDEO trimmed at most
    at its start is read from its file, from that start, only as many frames as the output takes; other
    VIDEOs (and a trim with an end, which the file path cannot express) are decoded by ComfyUI."""
    on_disk = video_file(value) if kind == "video" else None
    if on_disk is not None and not on_disk[2]:
        return MediaReference("video", Path(on_disk[0]), on_disk[1])
    return MediaReference(kind, reference_source(kind, value, what))


def reference_source(kind: str, value, what: str):
    """A ComfyUI IMAGE / VIDEO / AUDIO value -> the source h3_core takes for a reference of `kind`."""
    if kind == "image":
        if isinstance(value, torch.Tensor) and value.ndim == 4 and value.shape[0] > 1:
            raise ValueError(f"{what} is a batch of {value.shape[0]} images; a reference slot takes one picture (give "
                             "each its own slot; a clip as a VIDEO, e.g. from Create Video).")
        return image_to_pil(value, what)
    if kind == "video":
        return video_to_decoded(value, what)
    if kind == "audio":
        return audio_to_decoded(value, what)
    raise ValueError(f"Unknown reference kind {kind!r}.")


def reference_kind(value) -> str:
    """Which reference a ComfyUI value is: IMAGE tensor, AUDIO dict or VIDEO object."""
    if isinstance(value, torch.Tensor):
        return "image"
    if isinstance(value, dict) and "waveform" in value:
        return "audio"
    if hasattr(value, "get_components"):
        return "video"
    raise ValueError(f"A reference must be an IMAGE, VIDEO or AUDIO; got {type(value).__name__}.")


SOCKET_KINDS = {"IMAGE": "image", "VIDEO": "video", "AUDIO": "audio"}
UNKNOWN_KIND = "media"  # a reference link whose kind shows only when the node runs (an any-type or Switch output)


def ordered_references(values: dict | None) -> list[tuple[str, str, Any]]:
    """A growing input's {"ref0": v, "ref1": v, ...} -> [(socket, kind, value), ...] in slot order, the socket
    named as the prompt names it ("references.ref3"); gaps and slots that brought nothing skipped
    (`refuse_empty_links` first says why)."""
    items = sorted(((name, value) for name, value in (values or {}).items() if value is not None),
                   key=lambda item: _slot_number(item[0]))
    return [(f"references.{name}", reference_kind(value), value) for name, value in items]


def _slot_number(name: str) -> int:
    return int("".join(ch for ch in name if ch.isdigit()) or 0)


def refuse_empty_latent(latent: dict) -> None:
    """Decoding an empty latent (zeros that only fix the size) makes a clip of nothing: refused."""
    if latent.get("empty"):
        raise ValueError("latent holds an empty latent (H3 Empty AV Latent, or zeros): connect a sampled one, from "
                         "H3 Dual-Clock Sampler or H3 Continuation (or your clip's, from H3 VAE Encode).")


def refuse_extra_inputs(extra: dict) -> None:
    """ComfyUI hands execute the slots of a growing list past its maximum (references.ref12, ...) as inputs of
    their own, after its checks: refused by name, before anything runs."""
    if extra:
        from h3_core.prompt import MAX_REFERENCES

        names = sorted(extra)
        hint = (f"; references go from ref0 to ref{MAX_REFERENCES - 1} (H3 takes at most {MAX_REFERENCES})"
                if any(name.startswith("references.") for name in names) else "")
        raise ValueError(f"{', '.join(names)}: no such input{hint}.")


def media_problem(task: str, reference_kinds: list[str], keyframes: int) -> str | None:
    """What is wrong with the media wired to a request of `task` (checked before anything runs), or None.
    `reference_kinds` may hold UNKNOWN_KIND: such a reference counts, its kind does not (checked when it runs)."""
    if task == "t2va" and (reference_kinds or keyframes):
        return "t2va takes a prompt only: disconnect the keyframes (fl2va) and references (ref2va), or change the task."
    if task == "fl2va":
        if reference_kinds:
            return "fl2va takes first_image / last_image keyframes, not references (those are ref2va)."
        if not 1 <= keyframes <= MAX_KEYFRAMES:
            return "fl2va needs first_image, last_image or both connected; a prompt alone is t2va."
    if task == "ref2va":
        if keyframes:
            return "ref2va takes references, not first_image / last_image (those are fl2va keyframes)."
        if not reference_kinds:
            return "ref2va needs at least one image, video or audio reference; a prompt alone is t2va."
        return reference_mix_problem(reference_kinds)
    return None


def build_request(
    task: str,
    prompt: str,
    first_image=None,
    last_image=None,
    references: dict | None = None,
    aspect_ratio: str = "auto",
    width: int = 0,
    height: int = 0,
    duration: float | None = None,
    reference_images: str = "release",
) -> Request:
    """The node's inputs -> an h3_core Request whose errors name the node's sockets. `references`: the growing
    input's {"ref0": value, ...} (slots that brought nothing skipped). width/height 0 = not given: the aspect
    ratio (or, for "auto", the task's default) decides the canvas. h3_core validates everything else."""
    named = ordered_references(references)
    refs = [media_reference(kind, value, f"{name} ({kind})") for name, kind, value in named]
    explicit = bool(width) or bool(height)  # 0 = not given: one of them alone is refused, naming it
    return Request(
        task=task,
        prompt=prompt,
        first_image=None if first_image is None else image_to_pil(first_image, "first_image"),
        last_image=None if last_image is None else image_to_pil(last_image, "last_image"),
        references=refs,
        aspect_ratio=None if explicit or aspect_ratio in (None, "", "auto") else aspect_ratio,
        width=int(width) if width else None,
        height=int(height) if height else None,
        duration=duration,
        reference_images=reference_images,
        names=PartNames(references=tuple(name for name, _, _ in named), long_video="with H3 Continuation"),
    )


# ----------------------------------------------------------------------------------------------
# H3_LATENT


class H3LatentDict(dict):
    """The H3_LATENT dict, printed as a one-line summary (ComfyUI prints node inputs into error reports)."""

    def __repr__(self) -> str:
        shapes = {key: list(value.shape) for key, value in self.items() if isinstance(value, torch.Tensor)}
        facts = {key: value for key, value in self.items() if not isinstance(value, torch.Tensor)}
        return f"H3_LATENT({shapes}, {facts})"

    __str__ = __repr__


def pack_latents(latents: AVLatents, **info) -> dict:
    """AVLatents -> the H3_LATENT dict our sockets carry (CPU tensors plus plain facts)."""
    latents.check()
    if latents.resume is not None:  # a stopped long video's clip so far: where its windows stopped goes with it
        info = {**info, "resume": latents.resume}
    return H3LatentDict(kind=LATENT_KIND, video=latents.video.detach().cpu(), audio=latents.audio.detach().cpu(),
                        num_frames=latents.num_frames, **info)


def unpack_latents(value) -> AVLatents:
    """An H3_LATENT dict -> checked AVLatents (a core LATENT is refused with a clear message)."""
    if not isinstance(value, dict) or value.get("kind") != LATENT_KIND:
        raise ValueError("This input needs an H3_LATENT from an H3 node; a LATENT from ComfyUI's own MiniMax H3 "
                         "nodes converts with LATENT to H3 Latent.")
    return AVLatents(value["video"], value["audio"], value.get("resume")).check()


def empty_latent(width: int, height: int, num_frames: int, video_channels: int = 24, audio_channels: int = 32) -> dict:
    """An H3_LATENT of zeros that fixes the size (canvas multiple of 32, 17n + 5 frames) and nothing else."""
    geometry.check_canvas(width, height)
    latent_height, latent_width = geometry.latent_size(width, height)
    video = torch.zeros(1, video_channels, geometry.latent_frames(num_frames), latent_height, latent_width)
    audio = torch.zeros(geometry.AUDIO_CHANNELS, audio_channels, geometry.audio_latents(num_frames))
    return H3LatentDict(kind=LATENT_KIND, video=video, audio=audio, num_frames=num_frames, width=width,
                        height=height, empty=True)


def latent_size_problem(latent: dict, width: int, height: int, num_frames: int) -> str | None:
    """Whether an H3_LATENT has the conditioning's size (a refined or empty latent must)."""
    latents = unpack_latents(latent)
    latent_height, latent_width = geometry.latent_size(width, height)
    have = (latents.num_frames, *latents.video.shape[3:])
    if have != (num_frames, latent_height, latent_width):
        have_width, have_height = latents.canvas
        return (f"The latent is {have_width}x{have_height}, {latents.num_frames} frames, but the conditioning "
                f"asks for {width}x{height}, {num_frames} frames; make the latent from the conditioning (connect it "
                "to H3 Empty AV Latent), or for a clip of yours (H3 VAE Encode, H3 Load Latent) set H3 "
                f"Conditioning's duration to {geometry.duration_for_frames(latents.num_frames):g} s and its size to "
                f"{have_width}x{have_height}.")
    return None


def to_core_av(latent: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """An H3_LATENT -> (video [1, 24, L, h, w], audio [1, 32, 2, A]): the layout of ComfyUI's own H3 AV
    latents, whose stereo channel sits after the 32 latent channels (ours carries it as the batch). Both
    normalize with the release's per-channel statistics, so the values carry over unchanged."""
    latents = unpack_latents(latent)  # copies: a core node changing its LATENT in place leaves ours (cached) alone
    return latents.video.clone(), latents.audio.permute(1, 0, 2).unsqueeze(0).contiguous()


def from_core_av(video, audio) -> list[dict]:
    """ComfyUI's own H3 AV latent (video [B, 24, L, h, w], audio [B, 32, 2, A]) -> one checked H3_LATENT a
    batch item. All-zero items (an empty latent) only fix the size, as H3 Empty AV Latent's do."""
    if not isinstance(video, torch.Tensor) or video.ndim != 5 or video.shape[1] != 24:
        shape = list(video.shape) if isinstance(video, torch.Tensor) else type(video).__name__
        raise ValueError(f"The video part must be [B, 24, L, h, w] (a MiniMax H3 latent); got {shape}.")
    if not isinstance(audio, torch.Tensor) or audio.ndim != 4 or audio.shape[1:3] != (32, geometry.AUDIO_CHANNELS):
        shape = list(audio.shape) if isinstance(audio, torch.Tensor) else type(audio).__name__
        raise ValueError(f"The audio part must be [B, 32, 2, A] (a MiniMax H3 stereo latent); got {shape}. ComfyUI's "
                         f"latent edits (Trim Video Latent, Upscale, Batch) do not keep a joint video + audio latent "
                         f"whole: edit the parts after Separate AV Latent, then join them with Concat AV Latent.")
    if video.shape[0] != audio.shape[0]:
        raise ValueError(f"The video and audio parts hold {video.shape[0]} and {audio.shape[0]} items; they must agree.")
    latent_height, latent_width = video.shape[3:]
    width, height = latent_width * geometry.VAE_SPATIAL_FACTOR, latent_height * geometry.VAE_SPATIAL_FACTOR
    items = []
    for index in range(video.shape[0]):
        latents = AVLatents(video[index:index + 1].detach().float().cpu(),
                            audio[index].detach().float().cpu().permute(1, 0, 2).contiguous())
        steps = latents.video.shape[2]
        if steps < 7 or (steps - 2) % geometry.LATENTS_PER_CHUNK:
            latents.check()  # the video part's own message, before a frame count is made of it
        have, frames = latents.audio.shape[2], latents.num_frames
        expected = geometry.audio_latents(frames)
        if have != expected:
            per_second = geometry.AUDIO_LATENTS_PER_SECOND  # a sound and a video encoded apart rarely agree
            raise ValueError(f"The audio part holds {have} latents a channel ({have / per_second:.3f} s of sound), but "
                             f"the video part's {frames} frames ({frames / geometry.FPS:.3f} s) take {expected}: make "
                             f"the sound {expected / per_second:.3f} s long (pad it with silence or trim it) before "
                             "encoding it, or encode picture and sound together with H3 VAE Encode, which fits the "
                             "sound to the frames.")
        empty = not (latents.video.any() or latents.audio.any())
        items.append(pack_latents(latents, width=width, height=height, empty=empty))
    return items
