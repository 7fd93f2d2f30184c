"""Long video (h3-model.md G): a clip longer than one request, generated window by window.

    plan = validate_long_video(request)                          # every limit and the window plan; no model
    conditioning = encode_long_video(request, text_encoder, video_vae, audio_vae)
    latents = sample_long_video(dit, conditioning, seed, ...)    # the cumulative AVLatents

Every window is an ordinary t2va / ref2va request of `window.frames` frames with the prompt (or its own
prompt) and all reference media. From the second window on, the tail of what was made so far is packed
as guide rows at the window's time origin (continuation.Timeline); every media row's time carries the
window's global offset `start * 40/24` (layout.build_window_layout). The window's target is sampled fresh
from noise; its hidden overlap is dropped and the rest appended. All windows draw their noise from one
generator seeded with the request's seed, so a seed decides the whole clip; a clip saved after a window carries
the generator's state (resume_point.py), so a stopped run continued from it with its seed makes the same clip.
The cumulative latents are decoded once, by the same streaming decoder as any request (output.write_mp4).

Choices (the sources leave room):
- References are prepared and encoded once, for the first (longest) window, and reused in every window
  (a reference clip is at most 15 s, so no window would keep more of it).
- A clip already made (`continue_from`, e.g. saved latents or an H3 sampler's) is kept as it is and the
  windows continue from its end, on its canvas: video extension.
- fl2va is not offered: its keyframes pin the first / last frame of one clip. Guides (images, clips,
  sounds at any frame of the clip) go to the windows that make their frames (window_guides.py).
- A clip's video can be kept (`keep_video`: the sound for a long clip of yours): each window holds its slice
  of the clip's latents as one request's keep="video" does (pipeline.sample), and only the sound continues
  from window to window. A window's first latents are then a slice of the whole clip's encoding rather than
  a fresh start; they are the hidden overlap (the tail guide), so the clip comes back exactly as given.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import geometry
from .conditioning import (
    MAX_FRAMES,
    MIN_FRAMES,
    NO_VAE,
    Conditioning,
    Request,
    RequestError,
    RequestPlan,
    blank,
    check_prompt_markers,
    encode_request,
    label_kinds,
    prompt_warnings,
    validate,
)
from .continuation import (
    DEFAULT_OVERLAP_FRAMES,
    DEFAULT_WINDOW_FRAMES,
    MODES,
    Timeline,
    Window,
    long_video_frames,
    mode_seconds,
    plan_request,
    sampled,
    video_at,
)
from .drive_audio import check_track, drive_seconds, encode_track, load_track, track_frames, window_slice
from .encode_memory import encode_working_bytes
from .guides import GuideMedia, guide_encode_bytes, guide_frame_count
from .layout import TEXT_TAG, GuideBlock, PackedLayout, ReferenceBlock, build_window_layout, pack_audio
from .media import audio_samples_for_frames
from .noise import request_generator
from .output import AVLatents
from .pipeline import sample
from .references import RELEASE_CANVAS, CanvasRules, MediaInputError, prepare_reference
from .resume_point import ResumePoint
from .sampler import AUDIO_SHIFT, VIDEO_SHIFT, StepCallback
from .window_guides import WindowGuide, check_window_guides, encode_window_guides, owning_window

LONG_VIDEO_TASKS = ("t2va", "ref2va")


@dataclass
class LongVideoRequest:
    """A long request: `request` holds the task (t2va or ref2va), prompt, references, canvas and the whole
    clip's `duration` in seconds (snapped up to 17n + 5 frames at 24 fps).

    mode            "continuation" (windows, up to 300 s) or "full" (one window, up to 30 s)
    window_frames   continuation window, 17n + 5 in 107..345; overlap_frames: 17n + 5, shorter than it
    window_prompts  optional: one prompt per window, in order (else `request.prompt` in every window; with
                    them `request.prompt` may be empty)
    drive_audio     optional driving soundtrack (a path or a `DecodedAudio`): the output's audio, held fixed;
                    with `duration` None the clip lasts as long as the track (the most 17n + 5 frames it covers)
    guides          optional `guides.GuideMedia`s, their frame indices counting frames of the whole clip
    continue_from   optional `AVLatents` of a clip already made: kept as they are, continued from their end
                    on their canvas; `duration` then counts the whole clip, the given one included
    keep_video      optional `AVLatents` of a clip (e.g. from h3 encode) whose video is kept while its sound is
                    made: on its canvas, `duration` None for all of it or its first seconds; its audio is unused
    """

    request: Request
    mode: str = "continuation"
    window_frames: int = DEFAULT_WINDOW_FRAMES
    overlap_frames: int = DEFAULT_OVERLAP_FRAMES
    window_prompts: Sequence[str] = ()
    drive_audio: Any = None
    guides: Sequence[GuideMedia] = ()
    continue_from: AVLatents | None = None
    keep_video: AVLatents | None = None

    def __post_init__(self):
        if not isinstance(self.request, Request):  # else an AttributeError on its task, wherever it is first read
            raise RequestError(f"A LongVideoRequest's request is a Request (task, prompt, canvas, duration), got "
                               f"{type(self.request).__name__}.")

    @property
    def task(self) -> str:
        return self.request.task

    @property
    def prompt(self) -> str:
        return self.request.prompt


@dataclass(frozen=True)
class LongVideoPlan:
    """A validated long request: its geometry, the whole clip's frame count, the windows and their prompts.

    `first` is the first window's prompt as one request on the clip's canvas, as long as the longest sampled
    window within one request's range (a continued clip's extension may be shorter than one request); the
    references and prompts are checked (`first_plan`) and encoded with it."""

    task: str
    width: int
    height: int
    num_frames: int
    windows: tuple[Window, ...]
    prompts: tuple[str, ...]  # one per window (a given clip's is the next window's, never used)
    first: Request
    first_plan: RequestPlan


def sampled_prompt_warnings(request: Request | LongVideoRequest) -> list[str]:
    """`conditioning.prompt_warnings` for every prompt a request samples: a long video's window prompts
    (numbered) when it has them, else its prompt."""
    if not isinstance(request, LongVideoRequest):
        return prompt_warnings(request)
    if not request.window_prompts or isinstance(request.window_prompts, str):  # a str is refused by validation
        return prompt_warnings(request.request)
    kinds = label_kinds(request.request)  # the same references under every window prompt
    return [f"window prompt {number}: {warning}" for number, prompt in enumerate(request.window_prompts, 1)
            for warning in prompt_warnings(dataclasses.replace(request.request, prompt=prompt), kinds)]


def resume_seed_warnings(request: Request | LongVideoRequest, seeds: Sequence[int]) -> list[str]:
    """A continued clip that a stopped run saved (it knows its seed), continued with none of `seeds`: the rest
    then differs from what that run would have made (said, not refused: another seed may be the point)."""
    point = _resume_point(getattr(request, "continue_from", None))
    if point is None or point.seed in seeds:
        return []
    return [f"the clip to continue was saved by a run with seed {point.seed} that stopped; with seed "
            f"{', '.join(map(str, seeds))} the rest differs from what that run would have made (give seed "
            f"{point.seed} to finish it as it would have)."]


WINDOW_PROMPT_SEPARATOR = "---"


def split_window_prompts(text: str) -> tuple[str, ...]:
    """Window prompts typed in one box (the ComfyUI node's): separated by lines holding only `---` when there is
    one (so a prompt may span lines), else one per line; blank ones skipped, ends trimmed."""
    lines = text.splitlines()
    if not any(line.strip() == WINDOW_PROMPT_SEPARATOR for line in lines):
        return tuple(line.strip() for line in lines if line.strip())
    parts = itertools.groupby(lines, key=lambda line: line.strip() == WINDOW_PROMPT_SEPARATOR)
    return tuple(prompt for prompt in ("\n".join(part).strip() for separator, part in parts if not separator) if prompt)


def _starts(windows) -> str:
    """Where windows start, in frames and seconds: the first three and the last of a long plan."""
    said = [f"{w.start} ({w.start / geometry.FPS:.1f} s)" for w in windows]
    return ", ".join(said) if len(said) <= 5 else ", ".join(said[:3]) + f", ... {said[-1]}"


def _shown(prompts) -> str:
    """Prompts as they were read (the first words of each), so a box split otherwise than meant shows how."""
    said = [repr(p if len(p) <= 24 else p[:23] + "…") for p in prompts[:5]]
    return ", ".join(said) + (f" and {len(prompts) - 5} more" if len(prompts) > 5 else "")


def _total_frames(request: Request, mode: str, kept_frames: int = 0) -> int:
    """The whole clip's frames from the request's duration; with a kept clip of `kept_frames`, all of it when
    no duration is given, else its first seconds."""
    if kept_frames and request.num_frames is None and request.duration is None:
        if kept_frames < MIN_FRAMES:
            raise RequestError(f"The kept clip lasts {kept_frames} frames ({kept_frames / geometry.FPS:.2f} s, as "
                               f"encoded: cut to 17n + 5 frames); H3 makes the sound for at least {MIN_FRAMES} "
                               f"frames ({MIN_FRAMES / geometry.FPS:.2f} s).")
        try:  # counted in frames: a clip made at the longest duration lasts a fraction of a second longer
            longest = long_video_frames(mode_seconds(mode), mode)
        except ValueError as error:
            raise RequestError(str(error)) from None
        if kept_frames > longest:
            raise RequestError(f"The kept clip lasts {kept_frames} frames ({kept_frames / geometry.FPS:.2f} s); a "
                               f"{mode} long video makes at most {longest} frames ({mode_seconds(mode):g} s): ask "
                               f"for at most {mode_seconds(mode):g} s to keep its first seconds"
                               + (", or use continuation mode." if mode == "full" else "."))
        return kept_frames
    if request.num_frames is not None or request.duration is None:
        raise RequestError(
            f"A long video is asked for by its duration in seconds (got duration={request.duration!r}, "
            f"num_frames={request.num_frames!r}); give the duration only."
        )
    try:
        total = long_video_frames(request.duration, mode)
    except ValueError as error:
        raise RequestError(str(error)) from None
    if kept_frames and total > kept_frames:
        raise RequestError(f"The kept clip lasts {kept_frames} frames ({kept_frames / geometry.FPS:.2f} s); "
                           f"{request.duration:g} s would need {total} frames. Ask for at most its length, or leave the "
                           "duration unset for all of it.")
    return total


def _track_length(track, mode: str) -> int:
    """The whole clip's frames when a driving track sets them (no duration given): all of the track, within
    the lengths `mode` makes."""
    longest = long_video_frames(mode_seconds(mode), mode)
    try:
        frames = track_frames(track, longest)
    except MediaInputError as error:
        raise RequestError(str(error)) from None
    if frames > longest:
        raise RequestError(f"The driving track lasts more than {mode_seconds(mode):g} s, the longest a {mode} long "
                           f"video makes: give a duration of at most {mode_seconds(mode):g} s to use its first seconds"
                           + (", or use continuation mode." if mode == "full" else "."))
    if frames < MIN_FRAMES:
        raise RequestError(f"The driving track lasts under {MIN_FRAMES / geometry.FPS:.2f} s ({MIN_FRAMES} frames), "
                           f"the shortest clip H3 makes: give a duration (at least 4 s), and the track is padded "
                           "with silence to it.")
    return frames


def covers_track(duration: float, track, mode: str = "continuation") -> bool:
    """Whether `duration` seconds reach the end of a driving track long enough to be a clip by itself: a host
    whose duration box always holds a number (ComfyUI's) then asks for all of the track (duration None) rather
    than for silence after it."""
    try:
        return duration * geometry.FPS >= _track_length(track, mode)
    except RequestError:  # not a clip's length by itself, or unreadable (which the request's checks say)
        return False


def validate_long_video(request: LongVideoRequest, rules: CanvasRules = RELEASE_CANVAS) -> LongVideoPlan:
    """Every limit of a long request and its window plan, before any model runs (RequestError otherwise)."""
    if not isinstance(request, LongVideoRequest):
        raise RequestError(f"validate_long_video takes a LongVideoRequest, got {type(request).__name__}.")
    if request.mode not in MODES:
        raise RequestError(f"Long-video mode must be one of {', '.join(MODES)}; got {request.mode!r}.")
    if request.task not in LONG_VIDEO_TASKS:
        raise RequestError(
            f"Long video and driving audio run t2va or ref2va, not {request.task!r} (fl2va keyframes are not "
            "supported here)."
        )
    clash = given_clips_clash(request.continue_from is not None, request.drive_audio is not None,
                              request.keep_video is not None)
    if clash:
        raise RequestError(clash)
    base, given_frames = _on_clip_canvas(request.request, request.continue_from, "continue_from", "continue",
                                         "A continued clip")
    base, kept_frames = _on_clip_canvas(base, request.keep_video, "keep_video", "keep", "A kept clip")
    if request.drive_audio is not None and base.duration is None and base.num_frames is None:
        total = _track_length(request.drive_audio, request.mode)
    else:
        total = _total_frames(base, request.mode, kept_frames)
    try:
        windows = tuple(plan_request(total, request.mode, request.window_frames, request.overlap_frames, given_frames))
    except ValueError as error:
        raise RequestError(str(error)) from None
    new = sampled(windows)
    if isinstance(request.window_prompts, str) or not all(isinstance(p, str) for p in request.window_prompts or ()):
        raise RequestError(f"window_prompts is a list of prompts, one per window (text each), got "
                           f"{type(request.window_prompts).__name__}"
                           + ("" if isinstance(request.window_prompts, str) else " holding something else than text")
                           + ".")
    prompts = tuple(request.window_prompts or ())
    if prompts:
        if len(prompts) != len(new):
            raise RequestError(
                f"Give one window prompt per window: this {total}-frame plan has {len(new)} window(s) (starting at "
                f"{_starts(new)}), got {len(prompts)} prompt(s): {_shown(prompts)}."
            )
        for index, prompt in enumerate(prompts):
            if blank(prompt):
                raise RequestError(f"Window prompt {index + 1} is empty; every window needs a non-empty prompt.")
            check_prompt_markers(prompt, f"Window prompt {index + 1}")  # the first window's prompt: `validate`
    else:
        prompts = (request.prompt,) * len(new)
    prompts = prompts[:1] * (len(windows) - len(new)) + prompts
    # a stopped run resumed: the references are encoded for the windows of the run it continues
    planned = new if _resume_point(request.continue_from) is None else sampled(
        plan_request(total, request.mode, request.window_frames, request.overlap_frames))
    longest = min(max(MIN_FRAMES, max(window.frames for window in planned)), MAX_FRAMES)
    first = dataclasses.replace(base, prompt=prompts[0], duration=None, num_frames=longest)
    plan = validate(first, rules)
    if request.drive_audio is not None:
        try:
            check_track(request.drive_audio, seconds=drive_seconds(total))
        except MediaInputError as error:
            raise RequestError(str(error)) from None
    check_window_guides(plan.task, windows, total, request.guides, _locked(request))
    return LongVideoPlan(plan.task, plan.width, plan.height, total, windows, prompts, first, plan)


def given_clips_clash(continue_from: bool, drive_audio: bool, keep_video: bool) -> str | None:
    """Which of a long request's given clip, driving soundtrack and kept clip cannot go together (None if
    they can): known from what is given alone, so a host can refuse it before anything runs."""
    if keep_video and (continue_from or drive_audio):
        clashes = [name for name, given in (("continue_from", continue_from), ("drive_audio", drive_audio)) if given]
        return (f"keep_video makes the sound for a whole clip of yours; it cannot go with {' or '.join(clashes)} "
                "(drive_audio already fixes the sound, continue_from extends a clip).")
    if drive_audio and continue_from:
        return ("A driving soundtrack drives a clip from its first frame; a continued clip already has its sound. "
                "Continue without drive audio, or drive the whole clip from the start.")
    return None


def _locked(request: LongVideoRequest) -> str | None:
    """The modality the whole clip holds fixed: "audio" with a driving track, "video" with a kept clip."""
    return "audio" if request.drive_audio is not None else "video" if request.keep_video is not None else None


def layout_before_encoding(plan: LongVideoPlan, guides: Sequence[GuideMedia] = ()) -> PackedLayout:
    """The longest sampled window's packed sequence as far as sizes fix it before encoding: a one-row prompt,
    the latent tail, the reference blocks and the guides' pictures (a sound's fewer rows left out, as for one
    request). A host refuses a job that cannot fit before any model loads; the first window's request alone
    stops at one request's 362 frames and has no tail."""
    pictures: dict[int, list[GuideBlock]] = {}
    for pixels, anchor, _ in check_window_guides(plan.task, plan.windows, plan.num_frames, guides):
        if pixels is not None:
            owner = owning_window(plan.windows, anchor)
            count = guide_frame_count(pixels.shape[0])
            pictures.setdefault(owner.index, []).append(
                GuideBlock(anchor - owner.start, 1 if count == 1 else geometry.latent_frames(count)))
    latent_height, latent_width = geometry.latent_size(plan.width, plan.height)
    return max((build_window_layout([TEXT_TAG], plan.first_plan.reference_blocks, window.latent_frames,
                                    latent_height, latent_width, window.audio_latents,
                                    guide_latent_frames=window.guide_latent_frames,
                                    guide_audio_latents=window.guide_audio_latents,
                                    guides=pictures.get(window.index, ()))
                for window in sampled(plan.windows)), key=lambda layout: layout.sequence_length)


def _resume_point(given: AVLatents | None) -> ResumePoint | None:
    """The point where the run that saved `given` stopped (`AVLatents.resume`), if it was saved with this clip."""
    point = getattr(given, "resume", None)
    return point if point is not None and point.frames == given.num_frames else None


def _on_canvas(request: Request, clip: AVLatents, what: str) -> Request:
    """`request` on the canvas of `clip`; a canvas the request names that is not the clip's is refused."""
    width, height = clip.canvas
    if (request.width, request.height) not in ((None, None), (width, height)) or request.aspect_ratio not in (None, "auto"):
        named = request.aspect_ratio if request.aspect_ratio not in (None, "auto") else f"{request.width}x{request.height}"
        raise RequestError(f"{what} keeps its canvas, {width}x{height}; this request asks for {named}. "
                           "Leave the size and aspect ratio unset (auto).")
    return dataclasses.replace(request, aspect_ratio=None, width=width, height=height)


def _on_clip_canvas(base: Request, clip, field: str, use: str, what: str) -> tuple[Request, int]:
    """`base` on the canvas of `clip` (the `field` given to `use` it; `what` in errors) and the clip's frame
    count; `base` as it is and 0 without one. A canvas the request names that is not the clip's is refused."""
    if clip is None:
        return base, 0
    if not isinstance(clip, AVLatents):
        raise RequestError(f"{field} takes the AVLatents of a clip, got {type(clip).__name__}.")
    try:
        clip.check()
    except ValueError as error:
        raise RequestError(f"The clip to {use}: {error}") from None
    return _on_canvas(base, clip, what), clip.num_frames


@dataclass(frozen=True)
class LongConditioning:
    """What every window needs but its guide and noise.

    texts                  per window: (text_states [1, T_w, D], text_tags [T_w]); equal prompts share one
    media_origin           the longest T_w: one media clock for every window
    visual_references      normalized [1, C, L_i, h_i, w_i] reference latents, packed order (ref2va)
    reference_blocks       their shapes in the layout; reference_audio_rows [1, N, Ca] clean rows
    drive_audio            normalized driving latents [2, Ca, A_total] or None
    kept_video             the kept clip's normalized video latents [1, C, L_total, h, w] or None
    guides                 the guides' shares of the windows (window_guides.WindowGuide), in guide order
    given                  the latents of the clip the windows continue (the first window, given) or None
    """

    task: str
    width: int
    height: int
    num_frames: int
    windows: tuple[Window, ...]
    texts: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    media_origin: float
    visual_references: tuple[torch.Tensor, ...]
    reference_blocks: tuple[ReferenceBlock, ...]
    reference_audio_rows: torch.Tensor
    drive_audio: torch.Tensor | None = None
    guides: tuple[WindowGuide, ...] = ()
    given: AVLatents | None = None
    kept_video: torch.Tensor | None = None

    @property
    def seconds(self) -> float:
        return self.num_frames / geometry.FPS

    def window_layout(self, window: Window) -> PackedLayout:
        """The packed sequence of one window (guide rows from the second window on)."""
        _, tags = self.texts[window.index]
        latent_height, latent_width = geometry.latent_size(self.width, self.height)
        layout = build_window_layout(
            tags, self.reference_blocks, window.latent_frames, latent_height, latent_width, window.audio_latents,
            time_offset=window.time_offset, media_origin=self.media_origin,
            guide_latent_frames=window.guide_latent_frames, guide_audio_latents=window.guide_audio_latents,
            guides=[g.block for g in self._guides(window)],
        )
        if self.drive_audio is not None:
            return layout.locked("audio")  # the track is never sampled
        return layout if self.kept_video is None else layout.locked("video")

    def _guides(self, window: Window) -> list[WindowGuide]:
        return [guide for guide in self.guides if guide.window == window.index]

    @property
    def largest_layout(self) -> PackedLayout:
        """The longest packed sequence of any sampled window: what one DiT forward ever holds."""
        return max((self.window_layout(window) for window in sampled(self.windows)),
                   key=lambda layout: layout.sequence_length)

    @property
    def max_rows(self) -> int:
        return self.largest_layout.sequence_length

    def window(self, window: Window, guide: tuple[torch.Tensor, torch.Tensor] | None) -> Conditioning:
        """One window as an ordinary request: `guide` = (video [1, C, Lg, h, w], audio [2, Ca, Ag]) from
        `Timeline.guide`, None for the first window."""
        states, tags = self.texts[window.index]
        # packed order: the latent tail, the guides, the references
        guides = self._guides(window)
        visual = [g.video for g in guides if g.video is not None] + list(self.visual_references)
        audio = [pack_audio(g.audio[None]) for g in guides if g.audio is not None] + [self.reference_audio_rows]
        if guide is not None:  # video rows, then audio rows
            visual.insert(0, guide[0])
            audio.insert(0, pack_audio(guide[1][None]))
        if self.drive_audio is not None:
            audio.append(pack_audio(window_slice(self.drive_audio, window)[None]))
        if self.kept_video is not None:  # the last visual condition, as pipeline.sample's keep="video" adds it
            visual.append(self.kept_window(window))
        return Conditioning(
            self.task, self.width, self.height, window.frames, self.window_layout(window), states, tags, visual,
            torch.cat([rows.float().cpu() for rows in audio], dim=1), self.reference_blocks,
        )

    def kept_window(self, window: Window) -> torch.Tensor:
        """The kept clip's video latents of one window [1, C, L_w, h, w]."""
        first = video_at(window.start)
        return self.kept_video[:, :, first : first + window.latent_frames]


def encode_long_video(
    request: LongVideoRequest, text_encoder, video_vae=None, audio_vae=None, *, rules: CanvasRules = RELEASE_CANVAS,
    between_calls: Callable[[], None] | None = None, before_models: Callable[[int, int], None] | None = None,
    on_stage: Callable[[int, int], None] | None = None,
) -> LongConditioning:
    """Validate, then encode every distinct prompt, the references (once) and the driving track (once).
    `between_calls` is called between model calls and the text encoder's layers: a host may raise there to
    stop (an interrupt). `on_stage(done, total)` as the encodes go: the first request's prompt and media, then
    each other window prompt (a step per text encoder layer, as encode_request counts), the driving track and
    each guide (tens of prompts for a long video).
    `before_models` is called once before any model runs, with the most rows the text encoder will run for one
    prompt (0: it remembers them all) and the most device memory one of the VAEs'
    encodes needs besides their weights, so a host places only the models that run, with room for their work."""
    plan = validate_long_video(request, rules)
    if request.drive_audio is not None and audio_vae is None:
        raise RequestError(f"A driving audio track is encoded by the audio VAE{NO_VAE}")
    # the guides' VAEs asked for now, not after the text encoder has run
    if video_vae is None and any(guide.frames is not None for guide in request.guides):
        raise RequestError(f"Guide frames are encoded with the video VAE{NO_VAE}")
    if audio_vae is None and any(guide.waveform is not None for guide in request.guides):
        raise RequestError(f"A guide sound is encoded with the audio VAE{NO_VAE}")
    others = [prompt for prompt in dict.fromkeys(plan.prompts) if prompt != plan.prompts[0]]
    presented = {}
    if others:
        checked = plan.first_plan
        shown = [
            prepare_reference(reference, checked.num_frames, checked.reference_rules,
                              checked.names.reference(i)).for_presentation()
            for i, reference in enumerate(checked.references)
        ]
        presented = {prompt: text_encoder.present(plan.task, prompt, (), shown) for prompt in others}

    # besides the first request's media: the driving track and the guides, encoded after it
    sounds = [] if request.drive_audio is None else [audio_samples_for_frames(plan.num_frames)]
    later = max([encode_working_bytes(video_vae, audio_vae, sounds=sounds),
                 *(guide_encode_bytes(guide.frames, guide.waveform, guide.sample_rate, plan.width, plan.height,
                                      video_vae, audio_vae) for guide in request.guides)])

    def placing(first_rows: int, media: int) -> None:  # nothing new is remembered before this, so nothing is forgotten
        if before_models is not None:
            before_models(max([first_rows, *(presentation.num_tokens for presentation in presented.values()
                                             if not text_encoder.remembers(presentation))]), max(media, later))

    # a prompt counts its text encoder layers, as encode_request counts the first one's
    later_stages = len(presented) * text_encoder.layer + (request.drive_audio is not None) + len(request.guides)
    first_stages, later_done = 1, 0  # encode_request's own count (known once it reports), the later ones done

    def first_stage(done: int, total: int) -> None:
        nonlocal first_stages
        first_stages = total
        if between_calls is not None:
            between_calls()
        if on_stage is not None:
            on_stage(done, total + later_stages)

    def report(within: int = 0) -> None:  # the later encodes done, `within` steps into the next one
        if on_stage is not None:
            on_stage(first_stages + later_done + within, first_stages + later_stages)

    def after(steps: int = 1) -> None:  # one more of the later encodes done (a prompt: its layers)
        nonlocal later_done
        later_done += steps
        report()

    def before_layer(layers_done: int) -> None:  # inside a later prompt's encode
        if between_calls is not None:
            between_calls()
        report(layers_done)

    first = encode_request(plan.first, text_encoder, video_vae, audio_vae, rules=rules, on_stage=first_stage,
                           before_models=placing)
    texts = {plan.prompts[0]: (first.text_states, first.text_tags)}
    for prompt, presentation in presented.items():
        states = text_encoder.encode(presentation, before_layer)
        texts[prompt] = (states.prompt_embeds, states.token_tags)
        after(text_encoder.layer)
    drive = None
    if request.drive_audio is not None:
        if between_calls is not None:
            between_calls()
        track = load_track(request.drive_audio, max_seconds=drive_seconds(plan.num_frames))
        drive = encode_track(audio_vae, track, plan.num_frames)
        after()
    guides = encode_window_guides(plan.task, plan.windows, plan.width, plan.height, plan.num_frames, request.guides,
                                  video_vae, audio_vae, _locked(request), between_calls, after)
    kept = request.keep_video
    if kept is not None:
        kept = kept.video[:, :, : geometry.latent_frames(plan.num_frames)].float().cpu()
    origin = max(states.shape[1] for states, _ in texts.values())
    resumed = _resume_point(request.continue_from)  # the finished windows' prompts count too
    return LongConditioning(
        plan.task, plan.width, plan.height, plan.num_frames, plan.windows,
        tuple(texts[prompt] for prompt in plan.prompts),
        float(origin if resumed is None else max(origin, resumed.media_origin)),
        tuple(first.visual_condition_latents), first.reference_blocks, first.audio_condition_rows, drive,
        tuple(guides), request.continue_from, kept,
    )


def sample_long_video(
    dit,
    conditioning: LongConditioning,
    seed: int,
    steps: int = 50,
    video_shift: float = VIDEO_SHIFT,
    audio_shift: float = AUDIO_SHIFT,
    video_sigmas: Sequence[float] | None = None,
    audio_sigmas: Sequence[float] | None = None,
    callback: StepCallback | None = None,
    offload_adaln: bool = False,
    on_window: Callable[[AVLatents, int, int], None] | None = None,
) -> AVLatents:
    """Sample the windows in order and return the whole clip's AVLatents (video [1, C, L, h, w], audio
    [2, Ca, A]). The callback sees steps counted over all windows. `on_window(clip so far, windows made, windows
    to make)` is called after each window but the last, so that a host keeps the finished part of a run of
    hours (h3 generate saves it to --save-latents): a run stopped later is continued from it, not made again. That
    clip carries where the run stopped (`AVLatents.resume`), so continuing it with the same seed and settings makes
    the clip the run would have made."""
    generator = request_generator(seed)
    point = _resume_point(conditioning.given)
    if point is not None and point.seed == seed:  # another seed draws afresh
        generator.set_state(point.generator_state)
    timeline = Timeline(conditioning.num_frames)
    new = sampled(conditioning.windows)
    for window in conditioning.windows:
        if window.given:
            timeline.append(window, conditioning.given.video.float().cpu(), conditioning.given.audio.float().cpu())
            continue
        index = new.index(window)
        window_callback = None if callback is None else _counting_over_windows(callback, index, len(new))
        latents = sample(
            dit, conditioning.window(window, timeline.guide(window)), generator, steps, video_shift, audio_shift,
            video_sigmas, audio_sigmas, callback=window_callback, offload_adaln=offload_adaln,
        )
        drive, kept = conditioning.drive_audio, conditioning.kept_video
        timeline.append(window, latents.video if kept is None else conditioning.kept_window(window),
                        latents.audio if drive is None else window_slice(drive, window))
        if on_window is not None and index + 1 < len(new):
            # where it stopped, for a run continued from it; none for a run that holds its sound or video fixed,
            # which continue_from cannot go on with (the rest would be made afresh)
            made = None if drive is not None or kept is not None else ResumePoint(
                seed, generator.get_state(), conditioning.media_origin, timeline.frames)
            on_window(AVLatents(*timeline.latents(), resume=made), index + 1, len(new))
    return AVLatents(*timeline.latents())


def _counting_over_windows(callback: StepCallback, index: int, count: int) -> StepCallback:
    def on_step(state):
        callback(dataclasses.replace(state, step=index * state.total + state.step, total=count * state.total,
                                     ladder_step=state.step))

    return on_step
