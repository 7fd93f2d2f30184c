"""From final latents to an MP4, streamed: video chunk by chunk, audio window by window.

    AVLatents.video  [1, 24, L, h, w]  normalized (what the DiT denoises; L = 5n + 2)
    AVLatents.audio  [2, 32, A]        normalized, one mono latent per stereo channel
These are the tensors (and the normalization) that the diffusers pipeline hands to its decoders, and
what `--save-latents` writes as `video` / `audio`. Frames leave the decoder as uint8 [n, H, W, 3]
blocks of at most 17 frames, so a long clip never holds all its frames in memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from . import geometry
from .conditioning import check_vaes
from .config import DiTConfig
from .continuation import MAX_CONTINUATION_SECONDS
from .media_write import DEFAULT_CRF, Mp4Writer, part_path
from .resume_point import ResumePoint
from .vae_audio import DECODE_WINDOW_LATENTS, AudioVAE, context_windows
from .vae_video import VideoVAE, model_space_to_frames


def current_umask() -> int:
    """The process's file-creation mask, as a new file honours it: Linux says it in /proc; elsewhere it is read
    by setting it and putting it back at once (another thread's file made in between gets the usual 022)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


@dataclass
class AVLatents:
    video: torch.Tensor
    audio: torch.Tensor
    resume: ResumePoint | None = None  # a long video's clip so far: where its windows stopped (saved with it)

    @property
    def num_frames(self) -> int:
        """Pixel frames these latents decode to (L = 5n + 2 -> F = 17n + 5)."""
        return geometry.pixel_frames(self.video.shape[2])

    @property
    def canvas(self) -> tuple[int, int]:
        """(width, height) in pixels that these latents decode to."""
        latent_height, latent_width = self.video.shape[3:]
        return latent_width * geometry.VAE_SPATIAL_FACTOR, latent_height * geometry.VAE_SPATIAL_FACTOR

    def check(self, video_channels: int = DiTConfig.in_channels,
              audio_channels: int = DiTConfig.audio_in_channels) -> "AVLatents":
        """Shapes and values a decode can take; a clear error otherwise."""
        v, a = self.video, self.audio
        for name, tensor in (("video", v), ("audio", a)):
            if not isinstance(tensor, torch.Tensor):  # numpy arrays pass the shape checks, then fail on a method
                raise ValueError(f"The {name} latents must be a torch tensor, got {type(tensor).__name__}"
                                 + (": torch.from_numpy(array) makes one." if hasattr(tensor, "__array__") else "."))
        if v.ndim != 5 or v.shape[0] != 1 or v.shape[1] != video_channels:
            raise ValueError(f"Video latents must be [1, {video_channels}, L, h, w]; got {list(v.shape)}.")
        if (v.shape[2] - 2) % geometry.LATENTS_PER_CHUNK or v.shape[2] < 7:
            raise ValueError(f"Video latents need L = 5n + 2 >= 7 latent frames (from 17n + 5 frames); got L = {v.shape[2]}.")
        # what H3 makes: no larger canvas, no longer clip (a small file of latents from elsewhere decodes to
        # as many pixels as it says, and the decode would take the memory and the time for them)
        try:
            geometry.check_canvas(*self.canvas)
        except ValueError as error:
            raise ValueError(f"These latents decode to {self.canvas[0]}x{self.canvas[1]}, not an H3 canvas: {error}") \
                from None
        longest = geometry.frames_for_duration(MAX_CONTINUATION_SECONDS)
        if self.num_frames > longest:
            raise ValueError(f"These latents decode to {self.num_frames} frames; H3's longest clip is {longest} "
                             f"({MAX_CONTINUATION_SECONDS:g} s).")
        if a.ndim != 3 or a.shape[0] != geometry.AUDIO_CHANNELS or a.shape[1] != audio_channels:
            raise ValueError(f"Audio latents must be [2, {audio_channels}, A] (one per stereo channel); got {list(a.shape)}.")
        expected = geometry.audio_latents(self.num_frames)
        if a.shape[2] != expected:
            raise ValueError(f"{self.num_frames} frames take {expected} audio latents per channel; got {a.shape[2]}.")
        for name, tensor in (("video", v), ("audio", a)):
            if not tensor.is_floating_point():
                raise ValueError(f"The {name} latents are {str(tensor.dtype).removeprefix('torch.')}; latents are "
                                 "floating point (float32, bfloat16, float16, float8).")
            _check_finite(tensor, name)
        return self

    def save(self, path: str | Path, metadata: dict[str, str] | None = None) -> Path:
        """Written under a hidden name, then moved onto `path` whole: a failed write leaves no half file, and a
        link at `path` is replaced, not followed."""
        path = Path(path)
        if path.suffix != ".safetensors":
            raise ValueError(f"Latents are saved as .safetensors; got {path.name}.")
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = part_path(path)
        try:
            if self.resume is not None:
                metadata = {**(metadata or {}), **self.resume.metadata()}
            save_file({"video": self.video.contiguous().cpu(), "audio": self.audio.contiguous().cpu()},
                      str(temporary), metadata=metadata)
            os.chmod(temporary, 0o666 & ~current_umask())  # safetensors writes 0600: a server of another user
            os.replace(temporary, path)                     # (ComfyUI's) could not read it
        except SafetensorError as error:  # safetensors' own wording of a full disk, say: an OSError, naming the file
            temporary.unlink(missing_ok=True)
            raise OSError(f"Saving the latents to {path} failed: {error}") from None
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def load(cls, path: str | Path) -> "AVLatents":
        try:  # the names first: a model or LoRA file picked by mistake is not read whole to be refused
            with safe_open(str(path), "pt") as file:
                missing = {"video", "audio"} - set(file.keys())
                if missing:
                    raise ValueError(f"{path} lacks the tensor(s) {', '.join(sorted(missing))}; expected 'video' and "
                                     "'audio'.")
                # copies, not views of the file's pages: one saved over under its name (or cut short) would change
                # (or crash) what was loaded
                tensors = {name: file.get_tensor(name).clone() for name in ("video", "audio")}
                resume = ResumePoint.from_metadata(file.metadata(), str(path))
        except SafetensorError as error:  # an MP4 given for its latents, say
            raise ValueError(f"{path} is not a safetensors file of latents ({error}); give the .safetensors that "
                             "--save-latents, h3 encode or AVLatents.save wrote.") from None
        # a file stored in float8 (nothing here computes in it) is widened
        video, audio = (t.float() if t.is_floating_point() and t.element_size() == 1 else t
                        for t in (tensors["video"], tensors["audio"]))
        return cls(video, audio, resume)


@torch.inference_mode()  # on a generator, only while it runs: the caller's code between blocks keeps its mode
def decode_video(vae: VideoVAE, latents: torch.Tensor, devices: Sequence[str | torch.device] | None = None,
                 tiled: bool | None = None, as_uint8: bool = True) -> Iterator[torch.Tensor]:
    """Normalized video latents [1, C, L, h, w] -> uint8 frame blocks [n, H, W, 3] as each chunk finishes
    (`as_uint8` False: float32 in 0..1, unrounded, as an IMAGE holds them). `devices` (two or more): the chunks
    are decoded on all of them at once (`VideoVAE.decode_stream`). `tiled`: spatial tiles (None: the VAE
    config's, which for the release is on)."""
    _check_decodable(latents, "video", 5, "[1, C, L, h, w]")
    if latents.shape[0] != 1:  # the decoder's frames are the first item's: the others were dropped without a word
        raise ValueError(f"decode_video takes one clip's latents [1, C, L, h, w]; got a batch of {latents.shape[0]}.")
    device = vae.post_quant_conv.weight.device
    raw = vae.denormalize_latents(latents.to(device))
    for block in vae.decode_stream(raw, tiled, devices=devices):
        if not torch.isfinite(block).all():  # as uint8 it would be a black clip, written without a word
            peak = latents.abs().max().item()
            raise ValueError(f"The video VAE decoded NaN or infinite values from finite latents (largest |value| "
                             f"{peak:.3g}): the latents are far outside what a sampler makes (from elsewhere?), "
                             "or the VAE's weights hold NaN or infinite values (a damaged file), or they "
                             "overflowed in this dtype.")
        frames = model_space_to_frames(block)[0]  # [3, n, H, W] float32 in 0..1
        if as_uint8:
            frames = frames.mul_(255.0).round_().to(torch.uint8)  # in place: a block is hundreds of MB
        yield frames.permute(1, 2, 3, 0).cpu()


def _check_decodable(latents, name: str, ndim: int, layout: str) -> None:
    """A tensor of the decoder's rank, with values, all finite: said before the decoder runs (NaN sound was
    returned without a word; numpy or an empty latent failed inside the VAE)."""
    if not isinstance(latents, torch.Tensor) or latents.ndim != ndim or latents.numel() == 0:
        shape = list(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
        raise ValueError(f"The {name} latents must be a non-empty tensor {layout}; got {shape}.")
    _check_finite(latents, name)


def _check_finite(latents: torch.Tensor, name: str) -> None:
    if not torch.isfinite(latents.float()).all():  # float8 has no isfinite of its own
        raise ValueError(f"The {name} latents hold NaN or infinite values; nothing to decode.")


@torch.inference_mode()  # as decode_video's
def decode_audio(vae: AudioVAE, latents: torch.Tensor, on_window=None) -> Iterator[torch.Tensor]:
    """Normalized audio latents [2, C, A] -> float32 waveform pieces [2, n] at 32 kHz, window by window;
    `on_window(done, total)` before the first (0 done: a bar shows while it decodes) and after each (a progress
    bar; a host may raise there to stop): a long clip's soundtrack is many windows."""
    _check_decodable(latents, "audio", 3, "[2, C, A]")
    total = len(context_windows(latents.shape[-1], DECODE_WINDOW_LATENTS))
    if on_window is not None:
        on_window(0, total)
    for done, piece in enumerate(vae.decode_windows(latents.to(vae.device)), 1):
        piece = piece.float().cpu()
        if on_window is not None:
            on_window(done, total)
        yield piece


def write_mp4(
    path: str | Path,
    latents: AVLatents,
    video_vae: VideoVAE,
    audio_vae: AudioVAE,
    metadata: dict[str, str] | None = None,
    on_frames=None,
    devices: Sequence[str | torch.device] | None = None,
    tiled: bool | None = None,
    on_sound=None,
    crf: int = DEFAULT_CRF,
) -> Path:
    """Decode and mux in one pass. The soundtrack is decoded first (it is small: 15 MB a minute);
    the writer interleaves it as the video chunks arrive. `on_sound(done, total)` reports the soundtrack's
    windows, then `on_frames(done, total)` the frames; `devices` (two or more) share the video decode and
    `tiled` picks its spatial tiles (`decode_video`); `crf` is the H.264 quality (media_write.Mp4Writer).
    Returns the path written."""
    if not isinstance(latents, AVLatents):
        raise TypeError(f"write_mp4(path, latents, video_vae, audio_vae): latents must be AVLatents (from sample), got "
                        f"{type(latents).__name__}.")
    check_vaes(video_vae, audio_vae)
    latents.check(video_vae.config.latent_channels)
    total = latents.num_frames
    with Mp4Writer(path, metadata=metadata, crf=crf) as writer:
        for piece in decode_audio(audio_vae, latents.audio, on_sound):
            writer.write_audio(piece)
        done = 0
        for frames in decode_video(video_vae, latents.video, devices, tiled):
            writer.write_video_frames(frames.numpy())
            done += frames.shape[0]
            if on_frames is not None:
                on_frames(done, total)
    return writer.path  # another name where the asked one could not be replaced (Mp4Writer)
