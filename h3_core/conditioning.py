"""The conditioning stage: a request -> everything the sampler needs but noise (h3-model.md A.4-A.6, E, F).

    plan = validate(request)                                   # every published limit; no model, no full decode
    conditioning = encode_request(request, text_encoder, video_vae, audio_vae)

`Conditioning` (the stage's output):
    task, width, height, num_frames    the resolved request (17n + 5 frames at 24 fps)
    layout                             PackedLayout: [text | conditioning rows | target audio | target video]
    text_states [1, T, D]              Qwen3-VL after layer 50, the encoder's dtype and device
    text_tags   [T] int64              1 text, 0 the rows of a vision block
    visual_condition_latents           list of normalized [1, 24, L_i, h_i, w_i] float32 CPU, packed order:
                                       fl2va keyframes (first, then last), guides, ref2va image / video
                                       references
    audio_condition_rows [1, Na, 32]   clean normalized reference / guide audio rows, packed order,
                                       channel-major per block (empty [1, 0, 32] when none)
    reference_blocks                   ref2va: the shape each reference takes in the layout (request order)
    keyframe_anchors, guides           fl2va's keyframes and the guides (guides.py): what the layout holds
                                       besides the text, references and target
The sampler mixes each visual condition once to 0.999 with the request generator (one draw each, in
list order, *before* the target noise: diffusers' order), packs them into the leading video rows and
puts the audio rows, unmixed, in front of the target audio rows.

Choices where the sources leave room (each is a named constant below):
- Duration: 4-15 s (the official range, as vLLM-Omni and SGLang accept; diffusers 0.42.1 checks 5-15 s
  on the aligned count). Seconds round to frames (`round(s * 24)`) and snap *up* to 17n + 5, so 4 s ->
  107 frames and 15 s -> 362 (15.083 s); a frame count must snap to 107..362 (91..362 requested).
  Default 5 s (124 frames).
- Clip lengths are measured from a clip's `start_seconds` to its end, before it is truncated to the
  output; each 2-15 s, and video and audio references each <= 15 s in total, with 0.01 s of slack for
  containers' rounded durations. A video's soundtrack counts as part of the video, not as audio.
- Canvas: `width`/`height` win; else a named `aspect_ratio`; else t2va and ref2va take 16:9 and fl2va
  the first keyframe in packed order (the last one when it is alone). "auto"/"adaptive" = no name.
"""

from __future__ import annotations

import math
import numbers
import operator
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import geometry
from .encode_memory import encode_working_bytes
from .layout import (REFERENCE_KINDS, GuideBlock, PackedLayout, ReferenceBlock, build_ref2va_layout, build_t2va_layout,
                     patched_rows)
from .prompt import MAX_KEYFRAMES, TASKS, VISION_TOKENS, control_token_warnings, label_warnings, reference_mix_problem
from .references import (
    RELEASE_CANVAS,
    CanvasRules,
    MediaInputError,
    MediaReference,
    PreparedReference,
    encode_audio,
    encode_image,
    encode_video,
    fit_keyframes,
    inspect_audio,
    inspect_image,
    inspect_video,
    load_image,
    prepare_reference,
    vae_frame_count,
    video_has_sound,
)
from .vae_audio import AudioVAEConfig

EMPTY_PROMPT = "The prompt is empty; H3 needs a non-empty text prompt for every task."
MIN_SECONDS, MAX_SECONDS, DEFAULT_SECONDS = 4.0, 15.0, 5.0
MIN_FRAMES = geometry.frames_for_duration(MIN_SECONDS)  # 107
MAX_FRAMES = geometry.frames_for_duration(MAX_SECONDS)  # 362
MIN_REQUESTED_FRAMES = MIN_FRAMES - geometry.FRAMES_PER_CHUNK + 1  # 91: the lowest count that snaps up to 107
DEFAULT_ASPECT_RATIO = "16:9"
AUTO_ASPECT_RATIOS = ("auto", "adaptive")
MIN_CLIP_SECONDS, MAX_CLIP_SECONDS, MAX_TOTAL_CLIP_SECONDS = 2.0, 15.0, 15.0
CLIP_SECONDS_SLACK = 0.01
KEYFRAME_FIELDS = (("first", "first_image"), ("last", "last_image"))


# What a request needing a VAE it was not given says (the engine's argument, and ComfyUI's socket).
NO_VAE = ", and none was given (in ComfyUI: connect H3 VAE Loader's vae)."


class RequestError(ValueError):
    """A request H3 cannot run: says what was wrong and what is allowed."""


@dataclass(frozen=True)
class PartNames:
    """What a request's errors call its parts. The defaults are the Request's own field names; a front end
    passes the names its user gave them by (the CLI its options, a node its sockets), so an error points at
    the option or socket to change."""

    first_image: str = "first_image"
    last_image: str = "last_image"
    references: tuple[str, ...] = ()  # one a reference, in order; one not named is references[i]
    task: str = "the task"
    long_video: str = "in long-video mode"  # how clips over 15 s are asked for

    def keyframe(self, anchor: str) -> str:
        return self.first_image if anchor == "first" else self.last_image

    def reference(self, index: int) -> str:
        return self.references[index] if index < len(self.references) else f"references[{index}]"


@dataclass
class Request:
    """One generation request.

    task          "t2va" | "fl2va" | "ref2va"
    prompt        non-empty text
    first_image / last_image   fl2va keyframes: a path, a PIL image or a [H, W, 3] array
    references    ref2va, in the order the model reads them: `MediaReference`s or tuples
                  (kind, source) / (kind, source, start_seconds), kind "image" | "video" | "audio"
                  (sources: see references.py)
    aspect_ratio  a name of `geometry.ASPECT_RATIOS`, "auto" or None; or `width` and `height` (px)
    duration      seconds, or `num_frames` (24 fps); neither = 5 s
    guides        `guides.GuideFile`s (read) and `guides.GuideMedia` (in memory), checked by
                  `pipeline.generate` before any model loads and added after encoding (`encode_request`
                  refuses them: see guides.py)
    reference_images  "release" (image references at the release's 2048 short edge) or "canvas-lossy"
                  (scaled down to the output's pixel area: fewer rows, faster steps, less detail)
    names         what errors call the parts above (`PartNames`: the field names unless a front end gives its own)
    """

    task: str
    prompt: str
    first_image: Any = None
    last_image: Any = None
    references: Sequence[Any] = ()
    aspect_ratio: str | None = None
    width: int | None = None
    height: int | None = None
    duration: float | None = None
    num_frames: int | None = None
    guides: Sequence[Any] = ()
    reference_images: str = "release"
    names: PartNames = PartNames()


@dataclass(frozen=True)
class RequestPlan:
    """A validated request: resolved geometry and the media to prepare, in packed order."""

    task: str
    prompt: str
    width: int
    height: int
    num_frames: int
    keyframes: tuple[tuple[str, Any], ...] = ()  # (anchor "first" | "last", image source)
    references: tuple[MediaReference, ...] = ()
    reference_rules: CanvasRules = RELEASE_CANVAS  # what the references are prepared with
    names: PartNames = PartNames()  # the request's, for errors found while preparing its media
    # the reference blocks the media's sizes already fix, for planning memory before encoding (_sized_blocks)
    reference_blocks: tuple[ReferenceBlock, ...] = ()


# ----------------------------------------------------------------------------------------------
# Validation


def resolve_num_frames(duration: float | None = None, num_frames: int | None = None,
                       long_video: str = PartNames.long_video) -> int:
    """The 17n + 5 frame count of a request, checked against the 4-15 s range (see the module docstring);
    `long_video` names what makes longer clips, for the refusal."""
    if duration is not None and num_frames is not None:
        raise RequestError(f"Give the duration or num_frames, not both (got {duration} s and {num_frames} frames).")
    if num_frames is not None:
        try:
            count = operator.index(num_frames)
        except TypeError:
            raise RequestError(f"num_frames must be an integer, got {num_frames!r}.") from None
        aligned = geometry.align_frames(count) if count >= 1 else 0
        if not MIN_FRAMES <= aligned <= MAX_FRAMES:
            raise RequestError(
                f"num_frames={count} is outside H3's {MIN_SECONDS:g}-{MAX_SECONDS:g} s range: at 24 fps it must "
                f"snap up (to 17n + 5) to between {MIN_FRAMES} and {MAX_FRAMES} frames, i.e. be "
                f"{MIN_REQUESTED_FRAMES}..{MAX_FRAMES}."
            )
        return aligned
    seconds = DEFAULT_SECONDS if duration is None else duration
    if isinstance(seconds, numbers.Real) and not isinstance(seconds, bool):  # numpy's and torch's scalars too
        seconds = float(seconds)
    elif (isinstance(seconds, torch.Tensor) and seconds.numel() == 1 and seconds.dtype != torch.bool
          and not seconds.is_complex()):
        seconds = float(seconds.item())
    else:
        raise RequestError(f"The duration is a number of seconds, got {seconds!r}.")
    if not math.isfinite(seconds) or not MIN_SECONDS <= seconds <= MAX_SECONDS:
        raise RequestError(
            f"The duration must be between {MIN_SECONDS:g} and {MAX_SECONDS:g} seconds, got {seconds!r} (longer clips "
            f"are made window by window {long_video})."
        )
    return geometry.frames_for_duration(float(seconds))


def _explicit_size(request: Request) -> tuple[int, int] | None:
    width, height = request.width, request.height
    if (width is None) != (height is None):
        given, value = ("width", width) if height is None else ("height", height)
        raise RequestError(f"Give width and height together, or neither (then the aspect ratio sets the canvas); "
                           f"only the {given} was given ({value}).")
    if width is None:
        return None
    if request.aspect_ratio not in (None, *AUTO_ASPECT_RATIOS):
        raise RequestError(
            f"Give either aspect_ratio ({request.aspect_ratio!r}) or width and height ({width}x{height}), not both."
        )
    try:
        width, height = operator.index(width), operator.index(height)
        geometry.check_canvas(width, height)
    except TypeError:
        raise RequestError(f"width and height must be integers, got {width!r} x {height!r}.") from None
    except ValueError as error:
        raise RequestError(str(error)) from None
    return width, height


def _named_canvas(request: Request, rules: CanvasRules) -> tuple[int, int] | None:
    name = request.aspect_ratio
    if name is None or name in AUTO_ASPECT_RATIOS:
        return None
    if name not in geometry.ASPECT_RATIOS:
        raise RequestError(
            f"Unknown aspect_ratio {name!r}; use one of {', '.join(geometry.ASPECT_RATIOS)}, "
            f"{' / '.join(AUTO_ASPECT_RATIOS)}, or width and height."
        )
    return rules.canvas(*geometry.ASPECT_RATIOS[name])


def _media_kinds(request: Request) -> list[str]:
    """What the text encoder is shown beside the prompt, in order: "image" for each fl2va keyframe, else each
    reference's kind."""
    if request.task == "fl2va":
        return ["image" for image in (request.first_image, request.last_image) if image is not None]
    return [_as_reference(item, request.names.reference(index)).kind
            for index, item in enumerate(request.references or ())]


def label_kinds(request: Request) -> list[str]:
    """`_media_kinds` as `prompt.label_warnings` counts labels: a video without a soundtrack is "silent video" (it
    carries no `<Audio j>`). Reads each video file's header: made once per request."""
    kinds = _media_kinds(request)
    if "video" not in kinds:
        return kinds
    sources = [_as_reference(item, "").source for item in request.references]
    return [("video" if video_has_sound(source) else "silent video") if kind == "video" else kind
            for kind, source in zip(kinds, sources, strict=True)]


def prompt_warnings(request: Request, kinds: list[str] | None = None) -> list[str]:
    """`prompt.label_warnings` for a request (fl2va keyframes are its pictures, references what they are) and
    `prompt.control_token_warnings`. A long video's window prompts may leave the request's own prompt out
    (None): nothing to say then. `kinds`: the request's `label_kinds`, where the caller has them (one per prompt
    of the same references)."""
    if not isinstance(request.prompt, str):
        return []
    kinds = label_kinds(request) if kinds is None else kinds
    return label_warnings(request.prompt, kinds) + control_token_warnings(request.prompt)


def shows_pictures(request: Request) -> bool:
    """Whether the text encoder's vision tower reads part of the request: fl2va keyframes, image or video
    references."""
    return any(kind != "audio" for kind in _media_kinds(request))


def _as_reference(item, name: str) -> MediaReference:
    if isinstance(item, MediaReference):
        reference = item
    elif isinstance(item, tuple) and len(item) in (2, 3):
        reference = MediaReference(*item)
    else:
        raise RequestError(
            f"{name} must be a MediaReference or a tuple (kind, source[, start_seconds]), got {type(item).__name__}."
        )
    if reference.kind not in REFERENCE_KINDS:
        raise RequestError(f"{name} has kind {reference.kind!r}; a reference is one of {REFERENCE_KINDS}.")
    start = reference.start_seconds
    if isinstance(start, bool) or not isinstance(start, numbers.Real) or not math.isfinite(start) or start < 0:
        raise RequestError(f"{name} start_seconds must be a finite number >= 0, got {start!r}.")
    if reference.kind == "image" and start:
        raise RequestError(f"{name} is an image; start_seconds applies to video and audio clips only.")
    return reference


def _check_task_media(request: Request, references: list[MediaReference]) -> list[tuple[str, Any]]:
    keyframes = [
        (anchor, getattr(request, name)) for anchor, name in KEYFRAME_FIELDS if getattr(request, name) is not None
    ]
    names = request.names
    pair = f"{names.first_image}/{names.last_image}"
    if request.task == "t2va" and (keyframes or references):
        raise RequestError(
            f"t2va takes a prompt only: {pair} are fl2va keyframes and references are ref2va (set {names.task} to the "
            "one they are for)."
        )
    if request.task == "fl2va":
        if not keyframes:
            raise RequestError(f"fl2va needs 1 to {MAX_KEYFRAMES} keyframes: {names.first_image}, {names.last_image} or "
                               "both; a prompt alone is t2va.")
        if references:
            raise RequestError(f"fl2va takes {pair} keyframes, not references (those are ref2va).")
    if request.task == "ref2va":
        if keyframes:
            raise RequestError(f"ref2va takes references, not {pair} (those are fl2va keyframes).")
        if not references:
            raise RequestError("ref2va needs at least one image, video or audio reference; a prompt alone is t2va.")
        problem = reference_mix_problem([reference.kind for reference in references])
        if problem:
            raise RequestError(problem)
    return keyframes


def check_ratio(width: int, height: int, what: str) -> None:
    """A picture's aspect ratio within H3's 1:4 to 4:1: a canvas-setting keyframe must be, and any other picture
    cover-cropped onto the canvas (a follower keyframe, a guide) is scaled whole first, so an 8000x2 image
    would grow to gigabytes before its crop."""
    ratio = width / height
    if not geometry.MIN_ASPECT_RATIO <= ratio <= geometry.MAX_ASPECT_RATIO:
        raise RequestError(f"{what} is {width}x{height} (aspect ratio {ratio:.3g}); H3 takes 1:4 to 4:1: crop it to "
                           f"within that first.")


def _check_clip(seconds: float, start: float, what: str) -> None:
    if seconds <= 0 and start:
        raise RequestError(f"{what} starts at {start:g} s, past its end ({start + seconds:.3f} s long).")
    if not MIN_CLIP_SECONDS - CLIP_SECONDS_SLACK <= seconds <= MAX_CLIP_SECONDS + CLIP_SECONDS_SLACK:
        where = f" from start_seconds={start:g}" if start else ""
        raise RequestError(
            f"{what} runs {seconds:.3f} s{where}; reference clips must be "
            f"{MIN_CLIP_SECONDS:g}-{MAX_CLIP_SECONDS:g} s each."
        )


def _check_references(references: list[MediaReference], names: PartNames) -> list:
    """Each reference's MediaFacts, once its own limits and the clips' total length are checked."""
    totals, found = {"video": 0.0, "audio": 0.0}, []
    for index, reference in enumerate(references):
        what = f"{names.reference(index)} ({reference.kind})"
        if reference.kind == "image":
            facts = inspect_image(reference.source, what)
            check_ratio(facts.width, facts.height, what)
            found.append(facts)
            continue
        inspect = inspect_video if reference.kind == "video" else inspect_audio
        facts = inspect(reference.source, reference.start_seconds, what)
        _check_clip(facts.seconds, reference.start_seconds, what)
        if reference.kind == "video":
            check_ratio(facts.width, facts.height, what)
        totals[reference.kind] += facts.seconds
        found.append(facts)
    for kind, total in totals.items():
        if total > MAX_TOTAL_CLIP_SECONDS + CLIP_SECONDS_SLACK:
            raise RequestError(
                f"The {kind} references run {total:.3f} s together; H3 takes at most {MAX_TOTAL_CLIP_SECONDS:g} s "
                f"of {kind} references in total."
            )
    return found


def _sized_blocks(references: list[MediaReference], found: list, rules: CanvasRules,
                  num_frames: int) -> tuple[ReferenceBlock, ...]:
    """The reference blocks the media's sizes fix before anything is encoded, for a memory plan made before any
    model loads: an image's exactly; a video's picture at the frames its seconds surely hold (a second short, for
    any frame rate, snapped down as the VAE snaps it); soundtracks and audio references left out. So never more
    rows than the encoded request has."""
    blocks = []
    for reference, facts in zip(references, found):
        if reference.kind == "image":
            height, width = geometry.latent_size(*rules.reference_image_size(facts.width, facts.height))
            blocks.append(ReferenceBlock.image(height, width))
            continue
        frames = min(num_frames, math.floor(facts.seconds * geometry.FPS) - geometry.FPS)
        if reference.kind == "video" and frames >= vae_frame_count(1):  # the fewest the VAE takes (22)
            height, width = geometry.latent_size(*rules.canvas(facts.width, facts.height))
            blocks.append(ReferenceBlock.video(geometry.latent_frames(vae_frame_count(frames)), height, width))
    return tuple(blocks)


def blank(prompt) -> bool:
    """Whether `prompt` is no text with something to read: not a string, or only spaces, controls and format
    characters (zero-width spaces, byte-order marks). Anything else counts, emoji newer than this Python too."""
    return not isinstance(prompt, str) or all(ch.isspace() or unicodedata.category(ch) in ("Cc", "Cf") for ch in prompt)


def check_prompt_markers(prompt: str, what: str = "The prompt") -> None:
    """Refuse the text encoder's own picture markers typed into a prompt (`what` names it)."""
    tokens = [token for token in VISION_TOKENS if token in prompt]
    if tokens:
        raise RequestError(f"{what} holds {', '.join(tokens)}, the text encoder's own markers for pictures; name "
                           "keyframes and references with <Picture 1>, <Video 1>, <Audio 1> instead.")


def validate(request: Request, rules: CanvasRules = RELEASE_CANVAS) -> RequestPlan:
    """Check every published limit of `request` and resolve its geometry, before any model runs.

    Raises `RequestError` (a ValueError) naming what was wrong and what is allowed. Files are probed,
    images decoded (so a corrupt or unsupported file fails here); no model is touched."""
    if not isinstance(request, Request):
        raise RequestError(f"validate takes a Request, got {type(request).__name__}.")
    if request.task not in TASKS:
        raise RequestError(f"Unknown task {request.task!r}; choose one of {', '.join(TASKS)}.")
    if not isinstance(request.prompt, (str, type(None))):  # None: no prompt, said as empty below
        raise RequestError(f"The prompt must be text (a str), got {type(request.prompt).__name__}.")
    if blank(request.prompt):
        raise RequestError(EMPTY_PROMPT)
    check_prompt_markers(request.prompt)
    if not isinstance(request.names, PartNames):
        raise RequestError(f"names must be a PartNames, got {type(request.names).__name__}.")
    num_frames = resolve_num_frames(request.duration, request.num_frames, request.names.long_video)
    size = _explicit_size(request)
    named = _named_canvas(request, rules)
    items = () if request.references is None else request.references
    if isinstance(items, (str, MediaReference)) or not isinstance(items, Sequence):
        raise RequestError("references must be a list of (kind, source[, start_seconds]) or MediaReference entries.")
    references = [_as_reference(item, request.names.reference(index)) for index, item in enumerate(items)]
    keyframes = _check_task_media(request, references)

    try:
        anchor_size = None
        for index, (anchor, source) in enumerate(keyframes):
            what = request.names.keyframe(anchor)
            facts = inspect_image(source, what)
            sets_canvas = index == 0 and size is None and named is None
            check_ratio(facts.width, facts.height, what + (" (it sets the canvas)" if sets_canvas else ""))
            if index == 0:
                anchor_size = (facts.width, facts.height)
        found = _check_references(references, request.names)
    except MediaInputError as error:
        raise RequestError(str(error)) from None

    if size is None and named is None:
        size = rules.canvas(*(anchor_size or geometry.ASPECT_RATIOS[DEFAULT_ASPECT_RATIO]))
    width, height = size or named
    try:
        reference_rules = rules.sized_for_canvas(request.reference_images, width, height)
    except MediaInputError as error:
        raise RequestError(str(error)) from None
    return RequestPlan(request.task, request.prompt, width, height, num_frames, tuple(keyframes), tuple(references),
                       reference_rules, request.names, _sized_blocks(references, found, reference_rules, num_frames))


# ----------------------------------------------------------------------------------------------
# The stage's output


@dataclass(frozen=True)
class Conditioning:
    """Everything the sampler needs for one request but its noise; see the module docstring."""

    task: str
    width: int
    height: int
    num_frames: int
    layout: PackedLayout
    text_states: torch.Tensor
    text_tags: torch.Tensor
    visual_condition_latents: list[torch.Tensor] = field(default_factory=list)
    audio_condition_rows: torch.Tensor | None = None
    reference_blocks: tuple[ReferenceBlock, ...] = ()  # ref2va: each reference's shape in the layout
    keyframe_anchors: tuple[str, ...] = ()  # fl2va: "first" / "last" in packed order
    guides: tuple[GuideBlock, ...] = ()  # guides.add_guide's blocks in packed order

    def __repr__(self) -> str:
        """One line: a host prints a failed node's inputs into its error report (ComfyUI keeps each in its
        history), and the tensors made that kilobytes long."""
        layout = self.layout
        parts = [self.task, f"{self.width}x{self.height}", f"{self.num_frames} frames",
                 f"{layout.sequence_length} rows ({layout.num_text_rows} text)"]
        parts += [f"{len(items)} {name}" for name, items in (("keyframes", self.keyframe_anchors),
                                                              ("references", self.reference_blocks),
                                                              ("guides", self.guides)) if items]
        return f"Conditioning({', '.join(parts)})"

    def __post_init__(self):
        if self.audio_condition_rows is None:
            object.__setattr__(self, "audio_condition_rows", torch.zeros(1, 0, AudioVAEConfig().latent_channels))
        layout = self.layout
        if self.text_states.ndim != 3 or self.text_states.shape[0] != 1:
            raise ValueError(f"text_states must be [1, T, D], got {list(self.text_states.shape)}.")
        if not self.text_states.shape[1] == self.text_tags.shape[0] == layout.num_text_rows:
            raise ValueError(
                f"text_states ({self.text_states.shape[1]} rows), text_tags ({self.text_tags.shape[0]}) and the "
                f"layout ({layout.num_text_rows} text rows) disagree."
            )
        visual_rows = patched_rows(self.visual_condition_latents)
        if visual_rows != layout.num_condition_video_rows:
            raise ValueError(
                f"The visual conditions pack into {visual_rows} rows but the layout reserves "
                f"{layout.num_condition_video_rows}."
            )
        if self.audio_condition_rows.ndim != 3 or self.audio_condition_rows.shape[1] != layout.num_condition_audio_rows:
            raise ValueError(
                f"audio_condition_rows {list(self.audio_condition_rows.shape)} must be [1, "
                f"{layout.num_condition_audio_rows}, C] as the layout reserves."
            )

    @property
    def seconds(self) -> float:
        return self.num_frames / geometry.FPS


# ----------------------------------------------------------------------------------------------
# Encoding


def _pictures(keyframes, prepared) -> list[tuple[int, int, int]]:
    """(frames, height, width) of each picture the video VAE encodes: keyframes and image references one frame,
    video references their first `vae_frame_count` frames."""
    pictures = [(1, image.height, image.width) for image in keyframes]
    for reference in prepared:
        if reference.kind == "image":
            pictures.append((1, reference.image.height, reference.image.width))
        elif reference.kind == "video":
            count, height, width, _ = reference.frames.shape
            pictures.append((vae_frame_count(count), height, width))
    return pictures


def _reference_blocks(prepared, visual, audio) -> list[ReferenceBlock]:
    visual, audio = iter(visual), iter(audio)
    blocks = []
    for reference in prepared:
        if reference.kind == "audio":
            blocks.append(ReferenceBlock.audio(next(audio).shape[1] // 2))
            continue
        _, _, frames, height, width = next(visual).shape
        if reference.kind == "image":
            blocks.append(ReferenceBlock.image(height, width))
        else:
            soundtrack = next(audio).shape[1] // 2 if reference.has_audio else 0
            blocks.append(ReferenceBlock.video(frames, height, width, soundtrack))
    return blocks


def _precomputed_text(text_states, text_tags) -> tuple[torch.Tensor, torch.Tensor]:
    if text_states is None or text_tags is None:
        raise RequestError("Pass both text_states [1, T, D] and text_tags [T], or a text_encoder.")
    if not isinstance(text_states, torch.Tensor) or not text_states.is_floating_point():
        raise RequestError(f"text_states must be a floating point torch tensor [1, T, D] (TextEncoder.encode's "
                           f"prompt_embeds), got {type(text_states).__name__}"
                           f"{f' of {text_states.dtype}' if isinstance(text_states, torch.Tensor) else ''}.")
    tags = torch.as_tensor(text_tags).to("cpu", torch.int64)
    if text_states.ndim != 3 or text_states.shape[0] != 1 or tags.ndim != 1 or tags.shape[0] != text_states.shape[1]:
        raise RequestError(
            f"text_states must be [1, T, D] and text_tags [T]; got {list(text_states.shape)} and {list(tags.shape)}."
        )
    return text_states, tags


def check_vaes(video_vae, audio_vae) -> None:
    """The VAEs given as such, in their places (swapped, they would fail deep in the first encode, after the
    text encoder's run)."""
    from .vae_audio import AudioVAE
    from .vae_video import VideoVAE

    for given, kind, name in ((video_vae, VideoVAE, "video_vae"), (audio_vae, AudioVAE, "audio_vae")):
        if given is not None and not isinstance(given, kind):
            swapped = " (the VAEs swapped?)" if isinstance(given, (VideoVAE, AudioVAE)) else ""
            raise TypeError(f"{name} must be a {kind.__module__.rsplit('.', 1)[-1]}.{kind.__name__}, got "
                            f"{type(given).__name__}{swapped}.")


def encode_request(
    request: Request,
    text_encoder=None,
    video_vae=None,
    audio_vae=None,
    *,
    text_states: torch.Tensor | None = None,
    text_tags: torch.Tensor | None = None,
    rules: CanvasRules = RELEASE_CANVAS,
    on_stage: Callable[[int, int], None] | None = None,
    before_models: Callable[[int, int], None] | None = None,
) -> Conditioning:
    """Validate `request`, prepare its media and encode it.

    text_encoder  `text.TextEncoder`; or pass `text_states` [1, T, D] and `text_tags` [T] computed for
                  this request's presentation instead (they are checked for shape only).
    video_vae     `vae_video.VideoVAE`, needed for keyframes and image/video references.
    audio_vae     `vae_audio.AudioVAE`, needed for audio references and video soundtracks.
    on_stage      called (done, total) before each of the text encoder's layers (one step each: a streamed
                  encoder takes tens of seconds), after each keyframe or reference (one step each), and with
                  `done` unchanged between a video reference's 17-frame clips: a host shows progress there,
                  and may raise to stop (an interrupt).
    before_models called once, after the media are read and before any model runs, with how many rows the
                  text encoder will run (0: it will not: precomputed states, or ones it remembers) and the
                  device memory the VAEs' encodes of the media need besides their weights
                  (`encode_memory.encode_working_bytes`; 0: none): a host places only the models that run,
                  with room for that encoding (`TextEncoder.encoding_bytes`) and those.
    Everything is validated and decoded before the first model runs; models are used in the order
    text encoder, video VAE, audio VAE (so a caller can place one at a time)."""
    if not isinstance(request, Request):  # named as the caller called it (validate's own message names validate)
        raise RequestError(f"encode_request takes a Request, got {type(request).__name__}"
                           + (": encode_long_video encodes a LongVideoRequest." if hasattr(request, "mode") else "."))
    plan = validate(request, rules)
    check_vaes(video_vae, audio_vae)
    if request.guides:
        raise RequestError("encode_request does not read guide files: add each to its result with "
                           "guides.add_guide (pipeline.generate does both).")
    precomputed = text_states is not None or text_tags is not None
    if precomputed and text_encoder is not None:
        raise RequestError("Pass a text_encoder or precomputed text_states/text_tags, not both.")
    if not precomputed and text_encoder is None:
        raise RequestError("encode_request needs a text_encoder (or precomputed text_states and text_tags).")
    if (plan.keyframes or any(r.kind != "audio" for r in plan.references)) and video_vae is None:
        raise RequestError(f"This {plan.task} request has keyframes or visual references: they are encoded by the video VAE{NO_VAE}")

    # Decode and normalize every piece of media (no model yet).
    try:
        keyframes = fit_keyframes(
            [load_image(source, plan.names.keyframe(anchor)) for anchor, source in plan.keyframes], plan.width,
            plan.height
        )
        prepared: list[PreparedReference] = [
            prepare_reference(reference, plan.num_frames, plan.reference_rules,
                              f"{plan.names.reference(index)} ({reference.kind})")
            for index, reference in enumerate(plan.references)
        ]
    except MediaInputError as error:
        raise RequestError(str(error)) from None
    if any(reference.has_audio for reference in prepared) and audio_vae is None:
        raise RequestError(f"This request has audio references or video soundtracks: they are encoded by the audio VAE{NO_VAE}")

    visual_count = len(keyframes) + sum(reference.kind != "audio" for reference in prepared)
    text_steps = 0 if precomputed else text_encoder.layer  # its decoder layers
    stages = text_steps + visual_count + sum(reference.has_audio for reference in prepared)
    done = 0

    def staged(result, steps: int = 1):
        nonlocal done
        done += steps
        if on_stage is not None:
            on_stage(done, stages)
        return result

    # inside a model call (a video reference's 17-frame clips): the count as it is, so a host may stop there
    within = None if on_stage is None else (lambda *_: on_stage(done, stages))
    before_layer = None if on_stage is None else (lambda layers_done: on_stage(done + layers_done, stages))

    media = encode_working_bytes(video_vae, audio_vae, _pictures(keyframes, prepared),
                                 [reference.audio.shape[-1] for reference in prepared if reference.has_audio])
    if precomputed:
        if before_models is not None:
            before_models(0, media)
        states, tags = _precomputed_text(text_states, text_tags)
    else:
        text_encoder.check_sees(visual_count > 0)  # before any model moves for it
        presentation = text_encoder.present(
            plan.task, plan.prompt, keyframes, [reference.for_presentation() for reference in prepared]
        )
        if before_models is not None:
            before_models(0 if text_encoder.remembers(presentation) else presentation.num_tokens, media)
        text = staged(text_encoder.encode(presentation, before_layer), text_steps)  # remembered: all at once
        states, tags = text.prompt_embeds, text.token_tags

    visual = [staged(encode_image(video_vae, keyframe)) for keyframe in keyframes]
    for reference in prepared:
        if reference.kind == "image":
            visual.append(staged(encode_image(video_vae, reference.image)))
        elif reference.kind == "video":
            visual.append(staged(encode_video(video_vae, reference.frames, within)))
    audio = [staged(encode_audio(audio_vae, reference.audio)) for reference in prepared if reference.has_audio]
    channels = audio_vae.config.latent_channels if audio_vae is not None else AudioVAEConfig().latent_channels
    audio_rows = torch.cat(audio, dim=1) if audio else torch.zeros(1, 0, channels)

    latent_height, latent_width = geometry.latent_size(plan.width, plan.height)
    target = (
        geometry.latent_frames(plan.num_frames),
        latent_height,
        latent_width,
        geometry.audio_latents(plan.num_frames),
    )
    blocks = tuple(_reference_blocks(prepared, visual, audio))
    anchors = tuple(anchor for anchor, _ in plan.keyframes)
    if plan.task == "ref2va":
        layout = build_ref2va_layout(tags, blocks, *target)
    else:
        layout = build_t2va_layout(tags, *target, keyframe_anchors=anchors)
    return Conditioning(
        plan.task, plan.width, plan.height, plan.num_frames, layout, states, tags, visual, audio_rows, blocks, anchors
    )
