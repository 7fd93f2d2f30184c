"""Driving audio (vLLM-Omni's `audio_mode=lock_source`, h3-model.md A.5, D, G): video made to a given soundtrack.

The track takes the place of the generated audio: each stereo channel is cut or zero-padded to the output
length, the audio VAE encodes it once into the target audio latents [2, C, A] (A = round(F * 40/24)), and
those rows are held at t = 1 for every step (never sampled). No `<Audio N>` tag enters the prompt; the
output's soundtrack is the VAE's reconstruction of the track. A long video gives each window the slice
[a(start), a(end)) of the cumulative timeline, a(f) = round(f * 40/24), so the slices tile the track
exactly, with no drift however many windows there are.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from . import geometry, media_read
from .continuation import Window, audio_at
from .media import SAMPLE_RATE, MediaError, audio_samples_for_frames, resample_audio
from .references import DecodedAudio, MediaInputError, vae_frame_count


def check_track(source, what: str = "drive audio", seconds: float = 1.0) -> None:
    """Checks before any model runs: a file with an audio stream whose first `seconds` (the part the clip will
    use) decode, or a DecodedAudio whose first `seconds` are a valid waveform."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise MediaInputError(f"{what}: {path} does not exist or is not a file.")
        try:
            if media_read.probe(path).audio is None:
                raise MediaInputError(f"{what}: {path.name} has no audio stream.")
            media_read.read_audio(path, max_seconds=seconds)  # empty or undecodable: refused now, not after models load
        except MediaError as error:
            raise MediaInputError(f"{what}: {error}") from error
        return
    load_track(source, what, max_seconds=seconds)


def drive_seconds(num_frames: int) -> float:
    """How much of a driving track a `num_frames`-frame clip reads: its length and a second more."""
    return num_frames / geometry.FPS + 1.0


def track_frames(source, max_frames: int, what: str = "drive audio") -> int:
    """The frames on the 17n + 5 grid a whole driving track covers (0 under the VAE's shortest clip, 22): the most
    that fit in it, what is left over cut rather than padded with silence. The track is read for `max_frames` and
    a second more at most, so a longer one counts more than `max_frames`."""
    samples = load_track(source, what, max_seconds=drive_seconds(max_frames)).shape[1]
    frames = samples * geometry.FPS // SAMPLE_RATE
    return vae_frame_count(frames) if frames >= geometry.FRAMES_PER_CHUNK + geometry.LATENTS_PER_CHUNK else 0


def load_track(source, what: str = "drive audio", max_seconds: float | None = None) -> torch.Tensor:
    """A path (any audio PyAV reads) or a `DecodedAudio` (mono or stereo, any rate) -> float32 [2, N] at 32 kHz, at
    most its first `max_seconds` (the clip's length: an album-long file is not held whole, nor a long waveform
    resampled whole), cut at the native rate as a file read is."""
    try:
        if isinstance(source, (str, Path)):
            waveform = media_read.read_audio(Path(source), max_seconds=max_seconds)
        elif isinstance(source, DecodedAudio):
            if not (isinstance(source.sample_rate, (int, np.integer)) and source.sample_rate > 0):
                raise MediaInputError(f"{what}: the sample rate must be a positive integer, got {source.sample_rate!r}.")
            rate = int(source.sample_rate)
            given = source.waveform  # anything but an array is refused by resample_audio, which says what it takes
            if max_seconds is not None and isinstance(given, (np.ndarray, torch.Tensor)):
                given = given[..., : round(max_seconds * rate)]
            waveform = resample_audio(given, rate)
        else:
            raise MediaInputError(
                f"{what}: give a path to an audio file or a DecodedAudio(waveform, sample_rate), got {type(source).__name__}."
            )
    except (MediaError, ValueError, FileNotFoundError) as error:
        if isinstance(error, MediaInputError):
            raise
        raise MediaInputError(f"{what}: {error}") from error
    if waveform.shape[1] == 0:
        raise MediaInputError(f"{what}: the track holds no samples.")
    return torch.from_numpy(np.ascontiguousarray(waveform, dtype=np.float32))


def fit_track(waveform: torch.Tensor, num_frames: int) -> torch.Tensor:
    """[2, N] at 32 kHz -> [2, M] lasting exactly `num_frames` frames: each channel cut at M or padded with silence."""
    samples = audio_samples_for_frames(num_frames)
    fitted = waveform.new_zeros(waveform.shape[0], samples)
    for channel in range(waveform.shape[0]):
        kept = waveform[channel, :samples]
        fitted[channel, : kept.shape[0]] = kept
    return fitted


def encode_track(audio_vae, waveform: torch.Tensor, num_frames: int) -> torch.Tensor:
    """The driving track of a `num_frames`-frame output as normalized latents [2, C, round(F * 40/24)], float32, CPU.

    The VAE gives ceil(M / hop) latents for M samples, one more than round(F * 40/24) when F * 40/24 has a
    fractional part of 1/3; that trailing latent (mostly padding) is dropped."""
    latents = audio_vae.encode(fit_track(waveform, num_frames).to(audio_vae.device)).float().cpu()
    wanted = geometry.audio_latents(num_frames)
    if latents.shape[-1] < wanted:
        raise ValueError(f"The audio VAE gave {latents.shape[-1]} latents for {num_frames} frames; {wanted} are needed.")
    return latents[..., :wanted].contiguous()


def window_slice(latents: torch.Tensor, window: Window) -> torch.Tensor:
    """The driving latents [2, C, A_w] of one window: [a(start), a(end)) on the cumulative timeline."""
    first, last = audio_at(window.start), audio_at(window.end)
    if last > latents.shape[-1]:
        raise ValueError(f"The driving track has {latents.shape[-1]} latents; window {window.index} needs up to {last}.")
    return latents[..., first:last]
