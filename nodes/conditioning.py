"""H3 Conditioning: prompt, task, keyframes or references, canvas and duration -> H3_COND (encoded by
h3_core, every published limit checked first) and the resolved width, height and frame count."""

from __future__ import annotations

from comfy_api.latest import io

from h3_core import geometry
from h3_core.conditioning import (
    DEFAULT_SECONDS,
    MAX_SECONDS,
    MIN_SECONDS,
    TASKS,
    encode_request,
)

from .common import CATEGORY, H3VAE, H3Cond, H3TextEncoder
from .convert import build_request

# First version: fixed optional slots, read in this order (images, then videos, then audio).
IMAGE_SLOTS, VIDEO_SLOTS, AUDIO_SLOTS = 4, 2, 2


def reference_inputs():
    inputs = []
    for kind, socket, count in (("image", io.Image, IMAGE_SLOTS), ("video", io.Video, VIDEO_SLOTS),
                                ("audio", io.Audio, AUDIO_SLOTS)):
        for index in range(1, count + 1):
            inputs.append(socket.Input(
                f"ref_{kind}_{index}", optional=True,
                tooltip=f"ref2va: {kind} reference {index}. The model reads references in this order: "
                        "images, then videos, then audio (audio needs an image or video beside it)."))
    return inputs


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
                io.Combo.Input("aspect_ratio", options=["auto", *geometry.ASPECT_RATIOS], default="auto",
                               tooltip="Canvas shape. auto: 16:9 for t2va/ref2va, the keyframe's shape for fl2va. "
                                       "Ignored when width and height are set."),
                io.Int.Input("width", default=0, min=0, max=4096, step=32,
                             tooltip="Canvas width in pixels (multiple of 32); 0 = from the aspect ratio."),
                io.Int.Input("height", default=0, min=0, max=4096, step=32,
                             tooltip="Canvas height in pixels (multiple of 32); 0 = from the aspect ratio."),
                io.Float.Input("duration", default=DEFAULT_SECONDS, min=MIN_SECONDS, max=MAX_SECONDS, step=0.1,
                               tooltip="Seconds at 24 fps; the frame count snaps up to 17n + 5 (5 s -> 124 frames)."),
                H3VAE.Input("vae", optional=True,
                            tooltip="From H3 VAE Loader; needed to encode keyframes and references."),
                io.Image.Input("first_image", optional=True, tooltip="fl2va: the first frame (first image of a batch)."),
                io.Image.Input("last_image", optional=True, tooltip="fl2va: the last frame (first image of a batch)."),
                *reference_inputs(),
            ],
            outputs=[
                H3Cond.Output(display_name="conditioning"),
                io.Int.Output(display_name="width"),
                io.Int.Output(display_name="height"),
                io.Int.Output(display_name="num_frames"),
            ],
        )

    @classmethod
    def execute(cls, text_encoder, prompt, task, aspect_ratio, width, height, duration, vae=None,
                first_image=None, last_image=None, **refs) -> io.NodeOutput:
        references = [(kind, refs.get(f"ref_{kind}_{i}"))
                      for kind, count in (("image", IMAGE_SLOTS), ("video", VIDEO_SLOTS), ("audio", AUDIO_SLOTS))
                      for i in range(1, count + 1)]
        request = build_request(task, prompt, first_image, last_image, references, aspect_ratio, width, height,
                                duration)
        cond = encode_request(request, text_encoder.encoder, None if vae is None else vae.video,
                              None if vae is None else vae.audio, rules=text_encoder.canvas)
        return io.NodeOutput(cond, cond.width, cond.height, cond.num_frames)


NODES = [H3Conditioning]
