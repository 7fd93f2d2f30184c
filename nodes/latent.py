"""H3 Empty AV Latent: the size of a generation (canvas and frame count) as an H3_LATENT of zeros.
H3 VAE Encode: a clip you have (frames and sound) as an H3_LATENT, to extend or re-sample it.
H3 Latent to LATENT / LATENT to H3 Latent: the same latent in the layout of ComfyUI's own MiniMax H3 nodes."""

from __future__ import annotations

import logging

import torch
from comfy_api.latest import io

from h3_core import geometry
from h3_core.clip_latents import (
    MAX_CLIP_FRAMES, clip_encode_bytes, clip_frame_count, encode_clip, encode_clip_frames, expected_clip_frames,
    file_soundtrack, stream_clip,
)
from h3_core.media import MediaError
from h3_core.conditioning import MAX_FRAMES, MIN_REQUESTED_FRAMES, RequestError, resolve_num_frames
from h3_core.placement import freed_on_failure

from .common import (CATEGORY, LINK_HIDDEN, H3VAE, H3Cond, H3Latent, canvas_problem, check_interrupt, device,
                     progress_and_interrupt, progress_bar, range_problem, refuse_empty_links, wrong_link)
from .convert import (
    audio_to_decoded, empty_latent, from_core_av, image_to_uint8, pack_latents, to_core_av, trim_frames, video_file,
    video_to_decoded,
)
from .memory import place


class H3EmptyAVLatent(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3EmptyAVLatent",
            display_name="H3 Empty AV Latent",
            category=CATEGORY,
            description="An empty video + audio latent (zeros) that fixes the size the H3 sampler fills with seeded "
                        "noise: video [1, 24, 5n + 2, H/16, W/16] and audio [2, 32, 40 per second].",
            inputs=[
                io.Int.Input("width", default=1344, min=32, max=geometry.MAX_CANVAS_EDGE, step=32,
                             tooltip="Canvas width in pixels, a multiple of 32. Ignored when conditioning is connected."),
                io.Int.Input("height", default=768, min=32, max=geometry.MAX_CANVAS_EDGE, step=32,
                             tooltip="Canvas height in pixels, a multiple of 32. Ignored when conditioning is connected."),
                # min 1, not 91: saved workflows with conditioning connected (then unused) may hold any count
                io.Int.Input("num_frames", default=124, min=1, max=geometry.FRAMES_PER_CHUNK * 21 + 5,
                             tooltip="Frames at 24 fps, snapped up to 17n + 5 (124 = 5.2 s); H3 takes 4-15 s "
                                     f"({MIN_REQUESTED_FRAMES}..{MAX_FRAMES} frames). Ignored when conditioning is "
                                     "connected."),
                H3Cond.Input("conditioning", optional=True,
                             tooltip="Optional: take the size H3 Conditioning resolved (recommended: the sampler "
                                     "requires the latent and the conditioning to agree)."),
            ],
            outputs=[H3Latent.Output(display_name="latent",
                                     tooltip="An all-zero H3 latent that only fixes the size (canvas and frames): "
                                             "connect to H3 Dual-Clock Sampler's latent, which fills it with noise.")],
        )

    @classmethod
    def validate_inputs(cls, input_types=None, width=None, height=None, num_frames=None) -> bool | str:
        """A canvas or a length the model cannot make is a node error at queue time, unless conditioning (which
        sets the size) is linked; naming the inputs turns ComfyUI's own range and link-type checks off: redone."""
        types = input_types if isinstance(input_types, dict) else {}
        problem = wrong_link(cls, types) or range_problem(cls, num_frames=num_frames)
        if problem or "conditioning" in types:
            return problem or True
        problem = canvas_problem(width, height)
        if not problem and isinstance(num_frames, int):
            try:
                resolve_num_frames(num_frames=num_frames)
            except ValueError as error:
                problem = f"H3 Empty AV Latent: {error}"
        return problem or True

    @classmethod
    def execute(cls, width, height, num_frames, conditioning=None) -> io.NodeOutput:
        if conditioning is not None:
            width, height, num_frames = conditioning.width, conditioning.height, conditioning.num_frames
        else:  # a linked number was not checked at queue time
            problem = range_problem(cls, width=width, height=height, num_frames=num_frames)
            if problem:
                raise ValueError(f"H3 Empty AV Latent: {problem}")
        try:
            geometry.check_canvas(width, height)
            num_frames = resolve_num_frames(num_frames=int(num_frames))
        except ValueError as error:
            raise RequestError(f"H3 Empty AV Latent: {error}") from None
        return io.NodeOutput(empty_latent(width, height, num_frames))


class H3VAEEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3VAEEncode",
            display_name="H3 VAE Encode",
            category=CATEGORY,
            description="A clip you have (a VIDEO, or IMAGE frames with an optional AUDIO) as an H3 latent: extend "
                        "it with H3 Continuation (continue_from) or re-sample it with H3 Dual-Clock Sampler "
                        "(denoise below 1).",
            inputs=[
                H3VAE.Input("vae", tooltip="From H3 VAE Loader: the video and audio VAEs."),
                io.Video.Input("video", optional=True,
                               tooltip="A ComfyUI VIDEO (any frame rate, brought to 24 fps) with its soundtrack."),
                io.Image.Input("images", optional=True, tooltip="Instead of video: frames at frame_rate."),
                io.Float.Input("frame_rate", default=24.0, min=1.0, max=240.0, step=0.001, optional=True,
                               tooltip="The frame rate of images (brought to 24 fps)."),
                io.Audio.Input("audio", optional=True,
                               tooltip="The sound (instead of the video's soundtrack); silence when there is none."),
                io.Int.Input("width", default=0, min=0, max=geometry.MAX_CANVAS_EDGE, step=32, optional=True,
                             tooltip="Canvas width (multiple of 32); 0 with height 0: the clip's own aspect ratio on "
                                     "the model's canvas (768 px short edge, 1344x768's area at most). The frames are "
                                     "cover-cropped onto it."),
                io.Int.Input("height", default=0, min=0, max=geometry.MAX_CANVAS_EDGE, step=32, optional=True,
                             tooltip="Canvas height (multiple of 32); 0 with width 0: from the clip."),
            ],
            outputs=[
                H3Latent.Output(display_name="latent",
                                tooltip="Your clip's video and sound as an H3 latent: connect to H3 Continuation's "
                                        "continue_from or keep_video, or H3 Dual-Clock Sampler's latent."),
                io.Int.Output(display_name="width",
                              tooltip="The canvas width in pixels the clip was encoded on (a multiple of 32)."),
                io.Int.Output(display_name="height",
                              tooltip="The canvas height in pixels the clip was encoded on (a multiple of 32)."),
                io.Int.Output(display_name="num_frames",
                              tooltip="The clip's frame count as encoded, at 24 fps: its first 300 s at most, cut "
                                      "down to 17n + 5 (its last few frames may be dropped)."),
            ],
            hidden=LINK_HIDDEN,
        )

    @classmethod
    def validate_inputs(cls, input_types=None, width=None, height=None) -> bool | str:
        """Its links and canvas at queue time: a video or images, one of them, of the right types; a canvas the
        model can make (naming width and height turns ComfyUI's range check off for them: redone here)."""
        types = input_types if isinstance(input_types, dict) else {}
        return (wrong_link(cls, types) or _clip_source_problem("video" in types, "images" in types)
                or canvas_problem(width, height, zero="from the clip") or True)

    @classmethod
    def execute(cls, vae, video=None, images=None, frame_rate=24.0, audio=None, width=0, height=0) -> io.NodeOutput:
        refuse_empty_links(cls.hidden, video=video, images=images, audio=audio)
        problem = _clip_source_problem(video is not None, images is not None)
        if problem:
            raise ValueError(problem)
        problem = canvas_problem(width, height, zero="from the clip")  # validate_inputs' check, for linked values
        if problem:
            raise ValueError(problem)
        given = None if audio is None else audio_to_decoded(audio, "audio")
        on_disk = None if video is None else video_file(video)
        if on_disk is not None:  # streamed from its file onto the canvas, as h3 encode does: ~22 frames held
            path, start, duration = on_disk
            try:
                frames, width, height = stream_clip(path, vae.canvas, width or None, height or None,
                                                    trim_frames(duration, MAX_CLIP_FRAMES), start)
            except MediaError as error:
                raise ValueError(f"video: {error}") from None
            sound = given or file_soundtrack(path, start)
            expected = expected_clip_frames(path, start, trim_frames(duration, MAX_CLIP_FRAMES))
            bar = progress_bar(expected)

            def on_clip(done: int) -> None:  # after each 17 frames: a 300 s clip takes minutes
                bar.update_absolute(done, max(done, expected))
                check_interrupt()

            place([vae.patcher], clip_encode_bytes(vae.video, vae.audio, expected, width, height))
            with freed_on_failure(device()):
                try:
                    latents = encode_clip_frames(vae.video, vae.audio, frames, sound, on_clip)
                except MediaError as error:
                    raise ValueError(f"video: {error}") from None
        else:
            if video is not None:
                clip = video_to_decoded(video, "video")
                frames, fps, waveform, rate = clip.frames, clip.fps, clip.audio, clip.sample_rate
            else:
                frames, fps, waveform, rate = image_to_uint8(images, "images"), float(frame_rate), None, None
            if given is not None:
                waveform, rate = given.waveform, given.sample_rate
            if not width:
                width, height = vae.canvas.canvas(frames.shape[2], frames.shape[1])
            count = clip_frame_count(frames.shape[0], fps)  # too short a clip is refused before the VAEs move
            place([vae.patcher], clip_encode_bytes(vae.video, vae.audio, count, int(width), int(height)))
            with freed_on_failure(device()):
                latents = encode_clip(vae.video, vae.audio, frames, fps, int(width), int(height), waveform, rate,
                                      progress_and_interrupt())
        latent = pack_latents(latents, width=int(width), height=int(height))
        return io.NodeOutput(latent, int(width), int(height), latents.num_frames)


class H3LatentToLatent(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3LatentToLatent",
            display_name="H3 Latent to LATENT",
            category=CATEGORY,
            description="An H3 latent as ComfyUI's own MiniMax H3 AV LATENT (video [1, 24, L, H/16, W/16], audio "
                        "[1, 32, 2, 40 per second]), for the core nodes: Separate AV Latent, then VAE Decode and "
                        "VAE Decode Audio with the MiniMax H3 VAEs (or a TAEH3 preview decoder). Same values. "
                        "Core latent edits (Trim Video Latent, Upscale, Batch, Save Latent) do not keep a joint "
                        "latent whole: edit its parts after Separate AV Latent.",
            inputs=[H3Latent.Input("latent", tooltip="From an H3 sampler, H3 Continuation or H3 VAE Encode.")],
            outputs=[io.Latent.Output(display_name="LATENT",
                                      tooltip="The same latent as ComfyUI's own MiniMax H3 AV LATENT: connect to "
                                              "Separate AV Latent, then VAE Decode and VAE Decode Audio.")],
        )

    @classmethod
    def execute(cls, latent) -> io.NodeOutput:
        try:
            from comfy.nested_tensor import NestedTensor
        except ImportError:
            raise RuntimeError("H3 Latent to LATENT needs a ComfyUI with joint video + audio latents "
                               "(comfy.nested_tensor, as its own MiniMax H3 nodes use): update ComfyUI.") from None
        video, audio = to_core_av(latent)
        return io.NodeOutput({"samples": NestedTensor((video, audio))})


class H3LatentFromLatent(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3LatentFromLatent",
            display_name="LATENT to H3 Latent",
            category=CATEGORY,
            description="ComfyUI's own MiniMax H3 AV LATENT (Empty MiniMax H3 AV Latent, a core sampler's output) as "
                        "H3 latents, one per batch item (a list: the nodes after it run once per item). Then: H3 VAE "
                        "Decode or H3 Save MP4, H3 Continuation's continue_from, or the H3 sampler's latent (an "
                        "all-zero latent only fixes the size).",
            inputs=[io.Latent.Input("latent", tooltip="A joint video + audio LATENT of MiniMax H3 (join separate "
                                                      "video and audio latents with Concat AV Latent first).")],
            outputs=[H3Latent.Output(display_name="latent", is_output_list=True,
                                     tooltip="One H3 latent per batch item, as a list: to H3 VAE Decode, H3 Save MP4, "
                                             "H3 Continuation's continue_from or the H3 sampler's latent.")],
        )

    @classmethod
    def execute(cls, latent) -> io.NodeOutput:
        samples = latent.get("samples") if isinstance(latent, dict) else None
        if not getattr(samples, "is_nested", False) or len(samples.unbind()) != 2:
            got = (f"a plain latent {list(samples.shape)}" if isinstance(samples, torch.Tensor) and not samples.is_nested
                   else "something else")
            part = isinstance(samples, torch.Tensor) and not samples.is_nested and samples.ndim in (4, 5) and \
                samples.shape[1] in (24, 32)  # an H3 video or audio part alone
            raise ValueError(f"LATENT to H3 Latent: the LATENT must hold MiniMax H3's video and audio together (an AV "
                             f"latent); got {got}" + ("; join a separate H3 video and audio latent with Concat AV Latent "
                                                      "first." if part else ", not a MiniMax H3 latent."))
        if latent.get("noise_mask") is not None:  # a core sampler's output keeps the mask it used: decoding is fine
            logging.getLogger("h3").warning(
                "H3: LATENT to H3 Latent: the LATENT's noise mask is not carried over (H3 sampling takes none): a "
                "refine with the H3 sampler samples the whole clip; keep part of a clip with its keep or H3 Add Guide.")
        try:
            return io.NodeOutput(from_core_av(*samples.unbind()))
        except ValueError as error:
            raise ValueError(f"LATENT to H3 Latent: {error}") from None


def _clip_source_problem(video: bool, images: bool) -> str | None:
    return None if video != images else "Connect a video or images (frames) to H3 VAE Encode, one of them."


NODES = [H3EmptyAVLatent, H3VAEEncode, H3LatentToLatent, H3LatentFromLatent]
