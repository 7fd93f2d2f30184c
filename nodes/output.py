"""H3 VAE Decode (H3_LATENT -> IMAGE frames + AUDIO) and H3 AV Save (MP4 in the output folder)."""

from __future__ import annotations


import folder_paths
from comfy_api.latest import InputImpl, io, ui

from h3_core import geometry
from h3_core.media import resample_audio
from h3_core.media_write import DEFAULT_CRF, write_mp4
from h3_core.output import decode_audio, decode_video
from h3_core.placement import freed_on_failure
from h3_core.runtime import GIB, host_memory_available

from .common import (
    CATEGORY, SAVE_HIDDEN, H3VAE, H3Latent, crf_input, decode_inputs, decode_options, decode_progress, devices_problem,
    check_prefix, prefix_problem, progress_and_interrupt, reserved_output, saved_file_metadata, wrong_link,
)
from .convert import (
    audio_to_stereo_32k,
    frames_to_image,
    image_to_uint8,
    refuse_empty_latent,
    unpack_latents,
    video_at_24fps,
    video_file,
    video_to_decoded,
    waveform_to_audio,
)
from .memory import decode_working_bytes, place


class H3VAEDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3VAEDecode",
            display_name="H3 VAE Decode",
            category=CATEGORY,
            description="Decodes H3 latents chunk by chunk into frames (24 fps) and a 32 kHz stereo soundtrack.",
            inputs=[
                H3VAE.Input("vae", tooltip="From H3 VAE Loader."),
                H3Latent.Input("latent", tooltip="From H3 Dual-Clock Sampler (one output of its list at a time)."),
                *decode_inputs(),
            ],
            outputs=[
                io.Image.Output(display_name="images",
                                tooltip="The decoded frames, an IMAGE batch (one image per frame, 24 fps): connect "
                                        "to H3 AV Save's images or any image node."),
                io.Audio.Output(display_name="audio",
                                tooltip="The decoded soundtrack, 32 kHz stereo, as long as the frames: connect to "
                                        "H3 AV Save's audio."),
            ],
        )

    @classmethod
    def validate_inputs(cls, devices=None) -> bool | str:
        """A devices list that cannot be used is refused at queue time, not after the sampling above it."""
        return devices_problem(devices) or True

    @classmethod
    def execute(cls, vae, latent, tiling="release", devices="") -> io.NodeOutput:
        refuse_empty_latent(latent)
        tiled, decode_devices = decode_options(tiling, devices)
        latents = unpack_latents(latent)
        total = latents.num_frames
        check_image_room(total, *latents.video.shape[-2:])
        on_sound, on_frames = decode_progress(total)
        place([vae.patcher], decode_working_bytes(vae, latents.video, tiled))

        def counted(blocks):
            done = 0
            for block in blocks:
                yield block
                done += block.shape[0]
                on_frames(done, total)

        with freed_on_failure(vae.device):
            audio = waveform_to_audio(list(decode_audio(vae.audio, latents.audio, on_sound)), total)
            images = frames_to_image(counted(decode_video(vae.video, latents.video, decode_devices, tiled,
                                                          as_uint8=False)), total)
        return io.NodeOutput(images, audio)


def check_image_room(frames: int, latent_height: int, latent_width: int) -> None:
    """An IMAGE holds every frame in CPU memory as float32 (30 s at 1344x768: 8.7 GiB); one that cannot fit is
    refused before anything is decoded, rather than after minutes of decoding, by the system stopping ComfyUI."""
    height, width = latent_height * geometry.VAE_SPATIAL_FACTOR, latent_width * geometry.VAE_SPATIAL_FACTOR
    need = frames * height * width * 3 * 4
    available = host_memory_available()
    if available is not None and need > available:
        raise ValueError(f"H3 VAE Decode holds all {frames} frames ({width}x{height}) in CPU memory as an IMAGE: "
                         f"{need / GIB:.1f} GiB, more than the {available / GIB:.1f} GiB available. Use H3 Save "
                         "MP4 (streamed), which writes each frame as it is decoded, or free memory first.")


class H3AVSave(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3AVSave",
            display_name="H3 AV Save",
            category=CATEGORY,
            description="Writes frames and soundtrack as an MP4 (H.264 + AAC, 24 fps) into ComfyUI's output folder.",
            inputs=[
                io.Image.Input("images", optional=True,
                               tooltip="Frames at 24 fps, e.g. from H3 VAE Decode (or connect a VIDEO instead)."),
                io.String.Input("filename_prefix", default="H3/h3",
                                tooltip="File name prefix inside the output folder; a subfolder may be given."),
                io.Audio.Input("audio", optional=True,
                               tooltip="Soundtrack (resampled to 32 kHz stereo); without it the MP4 gets silence "
                                       "(or the VIDEO's own soundtrack). Given with a VIDEO, it replaces that one."),
                io.Video.Input("video", optional=True,
                               tooltip="Instead of images: a ComfyUI VIDEO at 24 fps, with its soundtrack."),
                crf_input(),
            ],
            outputs=[io.Video.Output(display_name="video",
                                     tooltip="The MP4 just saved, as a ComfyUI VIDEO read from its file, for nodes "
                                             "that take a VIDEO (e.g. Get Video Components).")],
            hidden=SAVE_HIDDEN,
            is_output_node=True,
        )

    @classmethod
    def validate_inputs(cls, input_types=None, filename_prefix=None) -> bool | str:
        """Images or a video, one of them, and a usable file name: known at queue time, so a wrong wiring is
        refused before the sampling and decoding above it run (asking for input_types, it checks the links'
        types itself)."""
        types = input_types if isinstance(input_types, dict) else {}
        return (wrong_link(cls, types) or _source_problem("images" in types, "video" in types)
                or prefix_problem(filename_prefix) or True)

    @classmethod
    def execute(cls, images=None, filename_prefix="H3/h3", audio=None, video=None, crf=DEFAULT_CRF) -> io.NodeOutput:
        check_prefix(filename_prefix)
        frames, waveform = _frames_and_soundtrack(images, audio, video)
        count, height, width = frames.shape[:3]
        folder, filename, counter, subfolder, _ = folder_paths.get_save_image_path(
            filename_prefix, folder_paths.get_output_directory(), width, height)
        with reserved_output(folder, filename, counter) as reserved:  # a bar, and ComfyUI's interrupt, per 17 frames
            path = write_mp4(reserved, frames, waveform, crf=crf, metadata=saved_file_metadata(cls.hidden, count),
                             on_frames=progress_and_interrupt())
        file = path.name  # another where a program holds that name open (Windows)
        preview = ui.PreviewVideo([ui.SavedResult(file, subfolder, io.FolderType.output)])
        return io.NodeOutput(InputImpl.VideoFromFile(str(path)), ui=preview)


def _source_problem(images: bool, video: bool) -> str | None:
    if images == video:
        return ("H3 AV Save: connect either images (frames at 24 fps) or a video, "
                + ("not both." if video else "got neither."))
    return None


def _frames_and_soundtrack(images, audio, video):
    """uint8 frames [F, H, W, 3] and a 32 kHz stereo waveform (or None) from images or a VIDEO; the
    audio input, when given, is the soundtrack."""
    problem = _source_problem(images is not None, video is not None)
    if problem:
        raise ValueError(problem)
    given = None if audio is None else audio_to_stereo_32k(audio, "audio")  # a bad sound refused before any frame
    if images is not None:
        return image_to_uint8(images, "images"), given
    stated = getattr(video, "get_frame_rate", None)  # said before the whole clip is decoded just to be refused
    if callable(stated):
        _check_rate(float(stated()))
    if video_file(video) is not None:  # read from its file as uint8 frames: get_components() stacks float32 ones
        clip = video_at_24fps(video, "video", _ALL_FRAMES, with_audio=audio is None)  # (4x the bytes) of it all
        return clip.frames, given if audio is not None else clip.audio
    decoded = video_to_decoded(video, "video")
    _check_rate(decoded.fps)
    if audio is not None:
        return decoded.frames, given
    soundtrack = None if decoded.audio is None else resample_audio(decoded.audio, decoded.sample_rate)
    return decoded.frames, soundtrack


_ALL_FRAMES = 1 << 31  # no cap on a VIDEO's frames: it is saved as it is


def _check_rate(fps: float) -> None:
    if abs(fps - geometry.FPS) > 1e-3:
        raise ValueError(f"H3 AV Save writes {geometry.FPS} fps (H3's rate); this video is {fps:g} fps. "
                         "Use ComfyUI's Save Video for other rates.")


NODES = [H3VAEDecode, H3AVSave]
