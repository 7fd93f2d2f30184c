"""H3 Empty AV Latent: the size of a generation (canvas and frame count) as an H3_LATENT of zeros."""

from __future__ import annotations

from comfy_api.latest import io

from h3_core import geometry
from h3_core.conditioning import MAX_FRAMES, MIN_REQUESTED_FRAMES, RequestError, resolve_num_frames

from .common import CATEGORY, H3Cond, H3Latent
from .convert import empty_latent


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
                io.Int.Input("width", default=1344, min=32, max=4096, step=32,
                             tooltip="Canvas width in pixels, a multiple of 32. Ignored when conditioning is connected."),
                io.Int.Input("height", default=768, min=32, max=4096, step=32,
                             tooltip="Canvas height in pixels, a multiple of 32. Ignored when conditioning is connected."),
                io.Int.Input("num_frames", default=124, min=1, max=geometry.FRAMES_PER_CHUNK * 21 + 5,
                             tooltip="Frames at 24 fps, snapped up to 17n + 5 (124 = 5.2 s); H3 takes 4-15 s "
                                     f"({MIN_REQUESTED_FRAMES}..{MAX_FRAMES} frames). Ignored when conditioning is "
                                     "connected."),
                H3Cond.Input("conditioning", optional=True,
                             tooltip="Optional: take the size H3 Conditioning resolved (recommended: the sampler "
                                     "requires the latent and the conditioning to agree)."),
            ],
            outputs=[H3Latent.Output(display_name="latent")],
        )

    @classmethod
    def execute(cls, width, height, num_frames, conditioning=None) -> io.NodeOutput:
        if conditioning is not None:
            width, height, num_frames = conditioning.width, conditioning.height, conditioning.num_frames
        try:
            geometry.check_canvas(width, height)
            num_frames = resolve_num_frames(num_frames=int(num_frames))
        except ValueError as error:
            raise RequestError(f"H3 Empty AV Latent: {error}") from None
        return io.NodeOutput(empty_latent(width, height, num_frames))


NODES = [H3EmptyAVLatent]
