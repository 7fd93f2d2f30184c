"""The media contract of H3 and conforming caller arrays to it (h3-model.md C, F).

H3 speaks one format in and out:
- video: RGB frames, **uint8 [N, H, W, 3]** (channels last, like a ComfyUI IMAGE batch), 24 fps;
- audio: **float32 [2, N]** stereo (left, right), nominally -1..1, 32000 Hz.

`media_write.py` turns that into an MP4 (H.264 + AAC), `media_read.py` turns reference files into it.
This module holds what both share: the rates, the errors, and the functions that bring a caller's
numpy/torch arrays onto the contract (`as_uint8_frames`, `as_stereo_waveform`, `resample_audio`).
Request limits (clip lengths, counts) are not media facts; the conditioning code checks them.
"""

from __future__ import annotations

import math
from typing import Any

import av
import numpy as np
import torch

from . import geometry

FPS = geometry.FPS  # 24
SAMPLE_RATE = 32000  # the audio VAE's rate
# Resample long waveforms in pieces so no single PyAV frame gets huge.
_RESAMPLE_PIECE = 1 << 16


class MediaError(Exception):
    """A media file could not be read or written as H3 needs it."""


class UnreadableMediaError(MediaError):
    """PyAV could not open or decode a file (corrupt, truncated, or an unsupported format)."""


class EncoderUnavailableError(MediaError):
    """This PyAV/FFmpeg build has no usable encoder for a codec the MP4 needs."""


def naming(what, error: Exception) -> str:
    """`error`'s message naming `what` once (the readers' own messages often name the file already)."""
    return str(error) if str(what) in str(error) else f"{what}: {error}"


def audio_samples_for_frames(num_frames: int) -> int:
    """Samples per channel at 32 kHz that last as long as `num_frames` video frames at 24 fps."""
    return round(num_frames * SAMPLE_RATE / FPS)


def _to_numpy(array: Any, what: str) -> np.ndarray:
    """A numpy view of a numpy array or torch tensor (moved to the CPU; bfloat16 widened)."""
    if isinstance(array, np.ndarray):
        return array
    if isinstance(array, torch.Tensor):
        tensor = array.detach().cpu()
        if tensor.dtype in (torch.bfloat16, torch.float16):
            tensor = tensor.float()  # numpy has no bfloat16; float32 holds both exactly
        return tensor.numpy()
    raise ValueError(f"{what} must be a numpy array or a torch tensor, got {type(array).__name__}.")


FLOAT_FRAMES_ABOVE_ONE = 2.0  # a little over 1 (a resize or sharpen overshoot) is clipped; past 2, another scale
_FRAMES_A_CHUNK = 17


def as_uint8_frames(frames: Any, what: str = "Video frames") -> np.ndarray:
    """Frames as a C-contiguous uint8 [N, H, W, 3] RGB array.

    Accepts numpy or torch, channels last, either uint8 (0..255, passed through) or floating point
    read over 0..1 (clipped, then rounded to the nearest of 256 levels). Other layouts or dtypes
    raise ValueError naming `what`: guessing channels-first or an integer range would silently corrupt colours.
    """
    array = _to_numpy(frames, what)
    if array.ndim != 4 or array.shape[-1] != 3:
        hint = ""
        if array.ndim == 4 and array.shape[1] == 3:
            hint = " This looks channels-first; permute it to [N, H, W, 3]."
        elif array.ndim == 3 and array.shape[-1] == 3:
            hint = " For a single frame add a leading axis: frames[None]."
        raise ValueError(
            f"{what} must be [N, H, W, 3] RGB (channels last), got shape {tuple(array.shape)}.{hint}"
        )
    if array.dtype == np.uint8:
        return np.ascontiguousarray(array)
    if not np.issubdtype(array.dtype, np.floating):
        raise ValueError(
            f"{what} must be uint8 (0..255) or floating point (0..1), got dtype {array.dtype}."
        )
    # a few frames at a time: whole, each step's float32 copy of a long clip at 1344x768 took GBs (a 75 s one ~40)
    chunks = [slice(start, start + _FRAMES_A_CHUNK) for start in range(0, len(array), _FRAMES_A_CHUNK)]
    if not all(np.isfinite(array[chunk]).all() for chunk in chunks):
        raise ValueError(f"{what} hold NaN or infinite values; floating point frames must be finite, in 0..1.")
    highest = max((float(array[chunk].max()) for chunk in chunks if array[chunk].size), default=0.0)
    if highest > FLOAT_FRAMES_ABOVE_ONE:  # clipped, they would be a white picture
        raise ValueError(f"{what} reach {highest:g}; floating point frames are 0..1 (values in 0..255? "
                         "divide them by 255, or pass uint8).")
    out = np.empty(array.shape, np.uint8)
    # float64 is scaled in float64, as the reference rounds it: in float32 a value just over a half level can land on
    # it and round down (0.68431374265 * 255 = 174.500004, 174.5 in float32)
    precision = np.float64 if array.dtype.itemsize > 4 else np.float32
    for chunk in chunks:
        scaled = np.clip(array[chunk].astype(precision, copy=False), 0.0, 1.0)  # a new array, changed in place
        out[chunk] = np.rint(np.multiply(scaled, 255.0, out=scaled), out=scaled)
    return out


def as_stereo_waveform(waveform: Any) -> np.ndarray:
    """A waveform as C-contiguous float32 [2, N] (left, right); values are not rescaled.

    Accepts numpy or torch floating point [N] or [1, N] (mono: duplicated into both channels, as the
    reference pipeline upmixes) or [2, N]. More channels raise ValueError: which ones are left and
    right depends on a layout an array does not carry, so the caller must downmix.
    """
    array = _to_numpy(waveform, "Audio waveform")
    if not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"Audio waveform must be floating point (nominally -1..1), got dtype {array.dtype}.")
    if array.ndim == 1:
        array = array[None]
    if array.ndim != 2 or array.shape[0] not in (1, 2):
        hint = ""
        if array.ndim == 3:
            hint = " A ComfyUI AUDIO waveform is [batch, channels, samples]: pass one item, waveform[0]."
        elif array.ndim == 2 and array.shape[1] in (1, 2):
            hint = " Channels last ([samples, channels], as soundfile reads it)? Pass it transposed, waveform.T."
        raise ValueError(
            f"Audio waveform must be [samples], [1, samples] or [2, samples] (mono or stereo), "
            f"got shape {tuple(array.shape)}.{hint}"
        )
    if not np.isfinite(array).all():
        raise ValueError("Audio waveform holds NaN or infinite values.")
    if array.shape[0] == 1:
        array = np.concatenate([array, array])
    return np.ascontiguousarray(array, dtype=np.float32)


# FFmpeg's default layout for each channel count (av_channel_layout_default): how a waveform that carries no
# layout of its own (a ComfyUI AUDIO) is read when it is downmixed
DEFAULT_LAYOUTS = {1: "mono", 2: "stereo", 3: "2.1", 4: "4.0", 5: "5.0", 6: "5.1", 7: "6.1", 8: "7.1"}


def downmix_to_stereo(waveform: np.ndarray, sample_rate: int) -> np.ndarray:
    """float [C, N] of 3 to 8 channels in FFmpeg's default layout for C (5.1 for 6) -> float32 [2, N] at the same
    rate, with FFmpeg's downmix matrix: what reading such a file gives (`media_read`)."""
    channels = waveform.shape[0]
    if channels not in DEFAULT_LAYOUTS:
        raise ValueError(f"H3 takes sound of 1 to {max(DEFAULT_LAYOUTS)} channels; this one has {channels}.")
    stereo = _swresample(np.asarray(waveform, np.float32), DEFAULT_LAYOUTS[channels], sample_rate, sample_rate)
    return _fit_length(stereo, waveform.shape[1])


def resample_audio(waveform: Any, sample_rate: int) -> np.ndarray:
    """A mono or stereo waveform at `sample_rate` Hz -> float32 [2, M] at 32 kHz.

    Input as `as_stereo_waveform` takes it. The rate conversion is FFmpeg's swresample through
    PyAV's AudioResampler, one pass over the whole waveform (pieces share the filter state, so there
    are no seams). M = ceil(N * 32000 / sample_rate) as the reference's torchaudio resample counts it (the
    quotient in float32, then ceil), so a reference clip makes as many audio latents there as here; a
    waveform already at 32 kHz is returned as is.
    """
    if not (isinstance(sample_rate, (int, np.integer)) and sample_rate > 0):
        raise ValueError(f"sample_rate must be a positive integer (Hz), got {sample_rate!r}.")
    stereo = as_stereo_waveform(waveform)
    if sample_rate == SAMPLE_RATE:
        return stereo
    count = resampled_length(stereo.shape[1], sample_rate)
    return _fit_length(_swresample(stereo, "stereo", sample_rate, SAMPLE_RATE), count)


def resampled_length(samples: int, sample_rate: int) -> int:
    """Samples `resample_audio` makes of `samples` at `sample_rate` Hz: ceil(N * 32000 / rate), the quotient in
    float32 as the reference's torchaudio resample counts it."""
    if sample_rate == SAMPLE_RATE:
        return samples
    return math.ceil(np.float32(samples * SAMPLE_RATE / sample_rate))


def _swresample(waveform: np.ndarray, layout: str, rate: int, out_rate: int) -> np.ndarray:
    """float32 [C, N] in `layout` at `rate` -> float32 stereo [2, ~N * out_rate / rate] through FFmpeg's swresample,
    one pass in pieces that share the filter state (no seams)."""
    resampler = av.AudioResampler(format="fltp", layout="stereo", rate=out_rate)
    pieces = []
    for start in range(0, waveform.shape[1], _RESAMPLE_PIECE):
        # given interleaved: PyAV makes an 8-channel planar frame with 9 planes and fails to fill it
        interleaved = np.ascontiguousarray(waveform[:, start : start + _RESAMPLE_PIECE].T).reshape(1, -1)
        frame = av.AudioFrame.from_ndarray(interleaved, format="flt", layout=layout)
        frame.sample_rate = rate
        frame.pts = start
        pieces += [out.to_ndarray() for out in resampler.resample(frame)]
    pieces += [out.to_ndarray() for out in resampler.resample(None)]  # what the filter still holds
    return np.concatenate(pieces, axis=1) if pieces else np.zeros((2, 0), np.float32)


def _fit_length(waveform: np.ndarray, num_samples: int) -> np.ndarray:
    """A [C, N] waveform cut or zero-padded at its end to exactly `num_samples` samples."""
    if waveform.shape[1] >= num_samples:
        return np.ascontiguousarray(waveform[:, :num_samples])
    padding = np.zeros((waveform.shape[0], num_samples - waveform.shape[1]), dtype=waveform.dtype)
    return np.concatenate([waveform, padding], axis=1)
