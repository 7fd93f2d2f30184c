"""H3 Conditioning: prompt, task, keyframes or references, canvas and duration -> H3_COND (encoded by
h3_core, every published limit checked first) and the resolved width, height and frame count.
H3 Add Guide: an image, clip or sound anchored at any frame of an H3_COND's video (h3_core.guides)."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from comfy_api.latest import io

from h3_core.conditioning import (
    DEFAULT_SECONDS,
    MAX_FRAMES,
    MAX_SECONDS,
    MIN_SECONDS,
    TASKS,
    encode_request,
    prompt_warnings,
    validate,
)
from h3_core.guides import GuideMedia, add_guide, check_guide, clip_room, guide_encode_bytes
from h3_core.placement import freed_on_failure
from h3_core.prompt import MAX_AUDIO_REFERENCES, MAX_IMAGE_REFERENCES, MAX_REFERENCES, MAX_VIDEO_REFERENCES
from h3_core.references import REFERENCE_IMAGE_MODES, frame_on_canvas

from .common import (
    CATEGORY,
    LINK_HIDDEN,
    H3VAE,
    H3Cond,
    H3TextEncoder,
    canvas_inputs,
    canvas_problem,
    device,
    progress_and_interrupt,
    prompt_problem,
    refuse_empty_links,
    wrong_link,
)
from .convert import (
    SOCKET_KINDS,
    UNKNOWN_KIND,
    audio_to_decoded,
    build_request,
    image_to_uint8,
    media_problem,
    ordered_references,
    refuse_extra_inputs,
    video_at_24fps,
)
from .memory import place, place_for_encoding

REFERENCE_TOOLTIP = (f"ref2va references, read in slot order (images, videos and audio in any order the prompt "
                     f"refers to them): up to {MAX_IMAGE_REFERENCES} images, {MAX_VIDEO_REFERENCES} videos "
                     f"(2-15 s each, at most 15 s together; their soundtracks count as video) and "
                     f"{MAX_AUDIO_REFERENCES} audio clips (2-15 s each, at most 15 s together; only beside an image "
                     f"or video), {MAX_REFERENCES} in all. A new slot appears when the last one is connected.")


def reference_images_input():
    return io.Combo.Input(
        "reference_images", options=list(REFERENCE_IMAGE_MODES), default="release", optional=True,
        tooltip="How ref2va image references are sized. release: the reference pipeline's 2048-pixel short edge "
                "(a 16:9 image is 7,296 DiT rows at any output size). canvas-lossy: scaled down (never up) to the "
                "output's pixel area, as ComfyUI's native nodes do by default: far fewer rows and faster steps "
                "with several images, but the model sees less detail than the release gives it.")


def reference_input():
    slot = io.MultiType.Input("ref", types=[io.Image, io.Video, io.Audio], optional=True,
                              tooltip="One reference: an IMAGE, a VIDEO or an AUDIO.")
    return io.Autogrow.Input("references", optional=True, tooltip=REFERENCE_TOOLTIP,
                             template=io.Autogrow.TemplatePrefix(slot, prefix="ref", min=0, max=MAX_REFERENCES))


class H3Conditioning(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3Conditioning",
            display_name="H3 Conditioning",
            category=CATEGORY,
            description="Encodes one H3 request (t2va, fl2va or ref2va) for the H3 sampler.",
            inputs=[
                H3TextEncoder.Input("text_encoder", tooltip="From H3 Text Encoder Loader."),
                io.String.Input("prompt", multiline=True, default="",
                                tooltip="What to generate, sound included (speech, music, ambience)."),
                io.Combo.Input("task", options=list(TASKS), default="t2va",
                               tooltip="t2va: prompt only. fl2va: first and/or last frame. ref2va: image/video/audio "
                                       "references. Use a model loaded with the matching partition."),
                *canvas_inputs("16:9 for t2va/ref2va, the keyframe's shape for fl2va"),
                io.Float.Input("duration", default=DEFAULT_SECONDS, min=MIN_SECONDS, max=MAX_SECONDS, step=0.1,
                               tooltip="Seconds at 24 fps; the frame count snaps up to 17n + 5 (5 s -> 124 frames)."),
                H3VAE.Input("vae", optional=True,
                            tooltip="From H3 VAE Loader; needed to encode keyframes and references."),
                io.Image.Input("first_image", optional=True, tooltip="fl2va: the first frame (first image of a batch)."),
                io.Image.Input("last_image", optional=True, tooltip="fl2va: the last frame (first image of a batch)."),
                reference_input(),
                reference_images_input(),
            ],
            outputs=[
                H3Cond.Output(display_name="conditioning",
                              tooltip="The encoded request: connect to H3 Dual-Clock Sampler's conditioning (directly "
                                      "or through H3 Add Guide); H3 Empty AV Latent takes its size from it."),
                io.Int.Output(display_name="width",
                              tooltip="The canvas width in pixels the request resolved (a multiple of 32): the "
                                      "width of the video made."),
                io.Int.Output(display_name="height",
                              tooltip="The canvas height in pixels the request resolved (a multiple of 32): the "
                                      "height of the video made."),
                io.Int.Output(display_name="num_frames",
                              tooltip="The frame count the duration resolved to, at 24 fps (17n + 5: 5 s -> 124 "
                                      "frames)."),
            ],
            hidden=LINK_HIDDEN,
        )

    @classmethod
    def validate_inputs(cls, input_types=None, task=None, references=None, prompt=None, width=None,
                        height=None) -> bool | str:
        """Which media are wired, an empty prompt and a canvas the model cannot make are known before anything
        runs (the text encoder's load included): a node error at queue time. ComfyUI still checks the range and
        options of every input not named here (it hands the grown reference list over anyway; the prompt is a
        text: no range; `canvas_problem` redoes the canvas's range check); its link-type check, off for every
        input once `input_types` is named, is redone by `linked_media`."""
        types, kinds, problem = linked_media(cls, input_types)
        problem = (problem or typed_reference_problem(references, types)
                   or canvas_problem(width, height, zero="from the aspect ratio"))
        if problem:
            return problem
        problem = prompt_problem(prompt)
        if problem:
            return problem
        keyframes = sum(name in types for name in ("first_image", "last_image"))
        if task is None:  # the task comes from a link: checked when the node runs
            return True
        if task not in TASKS:  # naming task here turns ComfyUI's own options check off for it
            return f"task must be one of {', '.join(TASKS)}; got {task!r}."
        problem = media_problem(task, kinds, keyframes)
        if not problem and (kinds or keyframes) and "vae" not in types:
            problem = "Keyframes and references are encoded by the VAEs: connect H3 VAE Loader's vae."
        return problem or True

    @classmethod
    def execute(cls, text_encoder, prompt, task, aspect_ratio, width, height, duration, vae=None,
                first_image=None, last_image=None, references=None, reference_images="release",
                **extra) -> io.NodeOutput:
        refuse_extra_inputs(extra)
        refuse_empty_links(cls.hidden, vae=vae, first_image=first_image, last_image=last_image,
                           **{f"references.{slot}": value for slot, value in (references or {}).items()})
        keyframes = (first_image is not None) + (last_image is not None)
        problem = media_problem(task, [kind for _, kind, _ in ordered_references(references)], keyframes)
        if problem:
            raise ValueError(problem)
        request = build_request(task, prompt, first_image, last_image, references, aspect_ratio, width, height,
                                duration, reference_images)
        video_vae = None if vae is None else vae.video
        audio_vae = None if vae is None else vae.audio
        validate(request, text_encoder.canvas)  # every limit, before any model moves
        for warning in prompt_warnings(request):  # as h3 generate says them
            logging.getLogger("h3").warning("H3: %s", warning)
        with freed_on_failure(device()):
            # the encoder is loaded only to run: another length or canvas of a prompt reuses its states
            cond = encode_request(request, text_encoder.encoder, video_vae, audio_vae,
                                  rules=text_encoder.canvas, on_stage=progress_and_interrupt(),
                                  before_models=functools.partial(place_for_encoding, text_encoder, vae))
        return io.NodeOutput(cond, cond.width, cond.height, cond.num_frames)


def linked_media(node_class, input_types) -> tuple[dict, list[str], str | None]:
    """What a node's validate_inputs sees of its links: their types by input, the media kinds linked to the
    reference slots in slot order (UNKNOWN_KIND for a link that may bring any of them: an any-type "*", ComfyUI's
    Switch, a union; its value is checked when the node runs), and what is wrong with them (a reference link
    ComfyUI's own rule refuses for IMAGE, VIDEO or AUDIO; a link of the wrong type, `wrong_link`), or None."""
    from comfy_execution.validation import validate_node_input

    types = (input_types or {}) if isinstance(input_types, dict) else {}
    linked = [kind for name, kind in sorted(types.items(), key=lambda item: _slot(item[0]))
              if name.startswith("references.")]
    wrong = [str(kind) for kind in linked if not validate_node_input(kind, ",".join(SOCKET_KINDS))]
    if wrong:
        return types, [], f"References must be IMAGE, VIDEO or AUDIO; got {', '.join(wrong)}."
    kinds = [SOCKET_KINDS.get(kind, UNKNOWN_KIND) for kind in linked]
    return types, kinds, wrong_link(node_class, types)


def typed_reference_problem(references, types: dict) -> str | None:
    """A value typed into a reference slot (an API client's graph; the canvas has no box there) is no medium:
    refused at queue time, not when the node runs. ComfyUI hands validate_inputs every slot as None and the
    linked ones' types in `types`: a slot without a type holds a value."""
    typed = sorted((slot for slot in references if f"references.{slot}" not in types), key=_slot) \
        if isinstance(references, dict) else []
    if not typed:
        return None
    return (f"references.{typed[0]} holds a value, not a link: a reference is an IMAGE, VIDEO or AUDIO output linked "
            "to it (from Load Image, Load Video or Load Audio).")


def _slot(name: str) -> int:
    digits = "".join(ch for ch in name if ch.isdigit())
    return int(digits) if digits else -1


class H3AddGuide(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3AddGuide",
            display_name="H3 Add Guide",
            category=CATEGORY,
            description="Anchors an image, a short clip or a sound at any frame of the video; chain several.",
            inputs=[
                H3Cond.Input("conditioning", tooltip="From H3 Conditioning or another H3 Add Guide."),
                H3VAE.Input("vae", tooltip="From H3 VAE Loader: encodes the image or clip (video VAE) and the sound "
                                           "(audio VAE)."),
                io.Int.Input("frame_index", default=0, min=-9999, max=9999,
                             tooltip="The video frame (24 fps) the image, or the clip's first frame, and the sound "
                                     "start at; negative counts from the end (-1 = the last frame). A clip must fit "
                                     "from there."),
                *guide_media_inputs(),
            ],
            outputs=[H3Cond.Output(display_name="conditioning",
                                   tooltip="The request with this guide added: connect to H3 Dual-Clock Sampler's "
                                           "conditioning, or to another H3 Add Guide.")],
            hidden=LINK_HIDDEN,
        )

    @classmethod
    def validate_inputs(cls, input_types=None) -> bool | str:
        return validate_guide_links(cls, input_types)

    @classmethod
    def execute(cls, conditioning, vae, frame_index, image=None, audio=None, video=None) -> io.NodeOutput:
        refuse_empty_links(cls.hidden, image=image, audio=audio, video=video)
        room = clip_room(int(frame_index), conditioning.num_frames)
        media = guide_media(frame_index, image, audio, video, (conditioning.width, conditioning.height), room)
        # every check before the VAE moves
        check_guide(conditioning.task, conditioning.num_frames, media.frame_index, media.frames, media.waveform,
                    media.sample_rate)
        place([vae.patcher], guide_encode_bytes(media.frames, media.waveform, media.sample_rate, conditioning.width,
                                                conditioning.height, vae.video, vae.audio))
        with freed_on_failure(device()):  # a clip's 17-frame steps move the bar and may be interrupted
            guided = add_guide(conditioning, media.frame_index, vae.video, vae.audio, media.frames, media.waveform,
                               media.sample_rate, on_clip=progress_and_interrupt())
        return io.NodeOutput(guided)


def guide_media_inputs() -> list:
    """The image / audio / video sockets of a guide (H3 Add Guide, H3 Continuation Guide)."""
    return [
        io.Image.Input("image", optional=True,
                       tooltip="An image, or a clip at 24 fps: a batch of 5 frames or more is cut to its first "
                               "17n + 5 frames (5, 22, 39, ...); fewer than 5 use the first image. "
                               "Cover-cropped onto the canvas. Frames of another rate play at 24 fps here "
                               "(slower or faster): give a clip as a VIDEO to video instead."),
        io.Audio.Input("audio", optional=True,
                       tooltip="A sound from frame_index on, cut to the video's remaining length."),
        io.Video.Input("video", optional=True,
                       tooltip="Instead of image: a ComfyUI VIDEO (any frame rate, brought to 24 fps), used "
                               "as a clip with its soundtrack (unless audio is given too). Only the frames the "
                               "clip can use are read (a Load Video file from its trim start)."),
    ]


def guide_source_problem(image: bool, audio: bool, video: bool) -> str | None:
    """What is wrong with which of a guide's sockets are connected (None: nothing)."""
    if image and video:
        return "Connect an image or a video to one guide, not both."
    if not (image or audio or video):
        return "A guide needs an image, a video or a sound: connect at least one."
    return None


def validate_guide_links(node_class, input_types) -> bool | str:
    """A guide node's wiring at queue time (the links' types, and which of image / audio / video are connected),
    so a wrong one is refused before the loaders and the text encoder above it run."""
    types = input_types if isinstance(input_types, dict) else {}
    return (wrong_link(node_class, types)
            or guide_source_problem("image" in types, "audio" in types, "video" in types) or True)


def guide_media(frame_index, image=None, audio=None, video=None, canvas: tuple[int, int] | None = None,
                room: int | None = None) -> GuideMedia:
    """A guide's sockets as the engine's GuideMedia (frames uint8 at 24 fps, sound at its own rate). A VIDEO
    gives at most `room` frames (what is left of the video from the anchor; None: not known yet, as for a long
    video's guide) and at most MAX_FRAMES (no window is longer), each cover-cropped onto `canvas` (width,
    height) as it is read from its file when known; its soundtrack runs on past the clip, `room` frames long."""
    problem = guide_source_problem(image is not None, audio is not None, video is not None)
    if problem:
        raise ValueError(problem)
    frames = None if image is None else image_to_uint8(image, "image")
    sound = None if audio is None else audio_to_decoded(audio, "audio")
    waveform, rate = (None, None) if sound is None else (sound.waveform, sound.sample_rate)
    if video is not None:
        fit = None if canvas is None else (lambda frame: frame_on_canvas(frame, *canvas))
        clip = video_at_24fps(video, "video", min(room or MAX_FRAMES, MAX_FRAMES), fit, with_audio=sound is None,
                              sound_frames=room)
        frames = clip.frames
        if sound is None and clip.audio is not None:
            waveform, rate = clip.audio, clip.sample_rate
    return GuideMedia(int(frame_index), frames, waveform, rate)


@dataclass(frozen=True)
class UnreadVideoGuide:
    """A long video's VIDEO guide, kept unread until H3 Continuation knows the canvas and the clip's length:
    read before that, at its own size and as long as the longest window, a 4K clip held ~9 GB."""

    frame_index: int
    video: object
    audio: object = None  # a ComfyUI AUDIO, or None for the video's own soundtrack

    def read(self, canvas: tuple[int, int], num_frames: int) -> GuideMedia:
        """The guide as guide_media reads it on `canvas` (width, height) in a `num_frames`-frame clip."""
        try:
            return guide_media(self.frame_index, None, self.audio, self.video, canvas,
                               clip_room(self.frame_index, num_frames))
        except ValueError as error:
            raise ValueError(f"The video guide at frame {self.frame_index}: {error}") from None


NODES = [H3Conditioning, H3AddGuide]
