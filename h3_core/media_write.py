"""Writing H3 output as an MP4: H.264 video at 24 fps + AAC stereo at 32 kHz, encoded as it streams.

`Mp4Writer` takes video in chunks of frames (so a tiled VAE decode never has to hold the whole
clip) and audio in one or several pieces; `write_mp4` is the one-shot form. Contract:
- frames: [N, H, W, 3] RGB, uint8 0..255 or float 0..1 (numpy or torch; see `media.as_uint8_frames`),
  H and W even (4:2:0 chroma halves both axes; H3 canvases are multiples of 32);
- audio: float32 [2, N] (or mono [N] / [1, N], duplicated) at 32000 Hz, clipped to -1..1.
On close the audio is cut or zero-padded to `round(frames * 32000 / 24)` samples, so both tracks
last frames/24 s (AAC's last frame is padded by the encoder, < 1024 samples).

The file appears only on success: it is written under a hidden temporary name in the same folder
and renamed into place by `close()`; a failed or aborted write removes the temporary file. A process
killed outright (SIGKILL, the OOM killer) cannot: its temporary file carries its process id, and the
next write of the same name removes it once that process is gone. Where the name cannot be replaced
(Windows, the old file open in a player) the clip is kept as `name (n).mp4`; `path` says which.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import secrets
import sys
from collections.abc import Callable, Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np

from .geometry import FRAMES_PER_CHUNK
from .media import (
    FPS,
    SAMPLE_RATE,
    EncoderUnavailableError,
    MediaError,
    as_stereo_waveform,
    as_uint8_frames,
    audio_samples_for_frames,
)

log = logging.getLogger("h3")

# Tried in order; the first this FFmpeg build has and can open wins. libx264 is the only one with a
# constant-quality (crf) mode here; the others get a bitrate scaled from the frame size.
H264_ENCODERS = ("libx264", "libopenh264", "h264_nvenc", "h264_videotoolbox", "h264_qsv", "h264_amf", "h264_mf")
AAC_ENCODERS = ("aac", "libfdk_aac")
DEFAULT_CRF = 18  # visually near-lossless for x264; 23 is x264's own default


def check_crf(crf) -> None:
    """x264's constant quality: an integer from 0 (lossless) to 51; each 6 more about halves the file."""
    if isinstance(crf, bool) or not (isinstance(crf, (int, np.integer)) and 0 <= crf <= 51):
        raise ValueError(f"crf must be an integer from 0 (lossless) to 51 (worst), got {crf!r}.")
DEFAULT_PRESET = "medium"
DEFAULT_AUDIO_BITRATE = 160_000
# For encoders without crf: bits per pixel per frame (about 5 Mbit/s at 1344x768, 24 fps).
_BITS_PER_PIXEL = 0.2
# BT.709, limited ("MPEG"/TV) range: FFmpeg's enum values (AVCOL_SPC/PRI/TRC_BT709, AVCOL_RANGE_MPEG),
# written as numbers because PyAV only names some of them, and differently across versions.
_BT709 = 1
_LIMITED_RANGE = 1
# faststart puts the index first so browsers (the ComfyUI preview) play while loading;
# use_metadata_tags keeps arbitrary keys (e.g. "workflow") that plain MP4 tags would drop.
_MOVFLAGS = "+faststart+use_metadata_tags"


def pick_h264_encoder(width: int, height: int, preferred: str | None = None) -> str:
    """The name of an H.264 encoder this build can open at width x height (yuv420p, 24 fps).

    `preferred` forces one encoder by name; otherwise `H264_ENCODERS` are tried in order. Hardware
    encoders are listed by FFmpeg even without the hardware, so each candidate is really opened.
    """
    candidates = (preferred,) if preferred else H264_ENCODERS
    failures = []
    for name in candidates:
        try:
            codec = av.Codec(name, "w")
        except ValueError:  # PyAV's UnknownCodecError: not built in, or only a decoder
            failures.append(f"{name} (no such encoder in this build)")
            continue
        if codec.canonical_name != "h264":
            raise ValueError(f"Encoder {name!r} does not produce H.264; H3 MP4s are H.264 (e.g. 'libx264').")
        try:
            trial = av.CodecContext.create(codec, "w")
            trial.width, trial.height, trial.pix_fmt = width, height, "yuv420p"
            trial.time_base = Fraction(1, FPS)
            trial.framerate = Fraction(FPS)
            trial.open()
        except av.error.FFmpegError as error:
            failures.append(f"{name} ({error})")
            continue
        return name
    if preferred:
        raise EncoderUnavailableError(
            f"The H.264 encoder {failures[0]} is not usable here; leave `encoder` unset to pick one of {H264_ENCODERS}."
        )
    raise EncoderUnavailableError(
        f"No usable H.264 encoder in this PyAV build (tried: {'; '.join(failures)}). "
        "Install a PyAV wheel that bundles libx264 (the PyPI wheels do)."
    )


def pick_aac_encoder() -> str:
    for name in AAC_ENCODERS:
        if name in av.codecs_available:
            return name
    raise EncoderUnavailableError(f"No AAC encoder in this PyAV build (looked for {', '.join(AAC_ENCODERS)}).")


def part_path(path: Path) -> Path:
    """The hidden name a file is written under before it is moved onto `path` whole: this process's id in it, so
    `remove_orphaned_parts` can tell a dead writer's leftovers."""
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.part")


def remove_orphaned_parts(path: Path) -> list[Path]:
    """Remove the temporary files that writes of `path` by processes no longer running left behind (their
    process ids, in their names, checked on this machine); returns them."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(\d+)-[0-9a-f]{{8}}\.part")
    removed = []
    for candidate in path.parent.glob(f".{glob.escape(path.name)}.*.part"):
        found = pattern.fullmatch(candidate.name)
        if found and not process_running(int(found[1])):
            candidate.unlink(missing_ok=True)
            removed.append(candidate)
    return removed


def remove_dead_writes(folder: Path, stem_prefix: str) -> list[Path]:
    """What writes of files named `stem_prefix`... in `folder` by processes no longer running left behind (killed
    outright: the OOM killer): their hidden temporary files and, where one still waits empty, the placeholder
    that held its name (a numbered saver counts it, so no later save of the same name would ever remove it)."""
    pattern = re.compile(rf"\.({re.escape(stem_prefix)}.*)\.(\d+)-[0-9a-f]{{8}}\.part")
    removed = []
    for candidate in folder.glob(f".{glob.escape(stem_prefix)}*.part"):
        found = pattern.fullmatch(candidate.name)
        if not found or process_running(int(found[2])):
            continue
        candidate.unlink(missing_ok=True)
        removed.append(candidate)
        placeholder = folder / found[1]
        if placeholder.is_file() and not placeholder.is_symlink() and placeholder.stat().st_size == 0:
            placeholder.unlink(missing_ok=True)
            removed.append(placeholder)
    return removed


def free_name(path: Path) -> Path:
    """`name (1).mp4`, `name (2).mp4`, ...: the first that no file has."""
    number = 1
    while (candidate := path.with_name(f"{path.stem} ({number}){path.suffix}")).exists():
        number += 1
    return candidate


def process_running(pid: int) -> bool:
    """Whether process `pid` runs on this machine. On Windows (where signal 0 would be a Ctrl-C) it is assumed
    to, so nothing is removed there."""
    if sys.platform == "win32":
        return True
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's
        return True
    return True


class Mp4Writer:
    """Incremental MP4 writer; use as a context manager (an exception inside aborts the file).

    ```
    with Mp4Writer("out.mp4", metadata={"title": "H3"}) as writer:
        for chunk in decoded_chunks:        # [n, H, W, 3] each
            writer.write_video_frames(chunk)
        writer.write_audio(waveform)        # [2, samples] at 32 kHz, any time, any number of pieces
    ```
    The container opens with the first video chunk (its size fixes the stream's size). Audio is
    held back until video covers it, so the tracks interleave and nothing past the video's end is
    ever encoded. Without any audio the MP4 still gets a silent AAC track: every H3 output has one.
    Used without `with`, call `close()` (or `abort()`) yourself, or the temporary file stays behind.

    Args:
        path: the MP4 to create (its folder must exist); replaced if it exists.
        crf: x264 constant quality, 0 (lossless) .. 51; ignored by encoders without a crf mode.
        preset: x264 speed/size preset ("ultrafast" .. "veryslow").
        encoder: force an H.264 encoder by FFmpeg name; default: first usable of `H264_ENCODERS`.
        metadata: container tags, str -> str (e.g. "title", "comment", or a JSON "workflow").
        audio_bitrate: AAC bitrate in bit/s.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        crf: int = DEFAULT_CRF,
        preset: str = DEFAULT_PRESET,
        encoder: str | None = None,
        metadata: Mapping[str, str] | None = None,
        audio_bitrate: int = DEFAULT_AUDIO_BITRATE,
    ):
        check_crf(crf)
        metadata = dict(metadata or {})
        for key, value in metadata.items():
            if not (isinstance(key, str) and isinstance(value, str)):
                raise ValueError(
                    f"MP4 metadata must map str to str (serialize other values, e.g. json.dumps), "
                    f"got {key!r}: {type(value).__name__}."
                )
        self.path = Path(path)
        if self.path.is_dir():
            raise ValueError(f"Cannot write {self.path}: it is a folder; give the MP4 file's name.")
        if self.path.suffix.lower() != ".mp4":  # the file is an MP4 whatever its name says
            raise ValueError(f"Cannot write {self.path}: the file is an MP4 (H.264 + AAC); name it .mp4.")
        if not self.path.parent.is_dir():
            raise FileNotFoundError(f"Cannot write {self.path}: the folder {self.path.parent} does not exist.")
        remove_orphaned_parts(self.path)
        self._temp_path = part_path(self.path)
        self._crf, self._preset, self._encoder_name = int(crf), preset, encoder
        self._metadata, self._audio_bitrate = metadata, audio_bitrate
        self._container = None
        self._video_stream = None
        self._audio_stream = None
        self._size: tuple[int, int] | None = None  # (width, height), fixed by the first chunk
        self._closed = False
        self.frames_written = 0
        self.audio_samples_received = 0
        self._audio_encoded = 0
        self._pending_audio: list[np.ndarray] = []  # [2, n] pieces not yet covered by video

    # -- public --------------------------------------------------------------------------------

    @property
    def encoder(self) -> str | None:
        """The H.264 encoder in use (None until the first frames arrive)."""
        return self._video_stream.codec_context.name if self._video_stream else None

    def write_video_frames(self, frames: Any) -> None:
        """Encode a chunk of frames, [N, H, W, 3] uint8 or float 0..1; every chunk has one size."""
        self._check_open()
        frames = as_uint8_frames(frames)
        height, width = frames.shape[1:3]
        if self._size is None:
            if width % 2 or height % 2 or not (width and height):
                raise ValueError(
                    f"Frame width and height must be even and positive for H.264 4:2:0 (yuv420p), got "
                    f"{width}x{height}. "
                    "H3 canvases are multiples of 32; crop or pad other frames by one pixel."
                )
            self._open_container(width, height)
        elif (width, height) != self._size:
            raise ValueError(
                f"All frames of one MP4 must share a size: {self._size[0]}x{self._size[1]}, got {width}x{height}."
            )
        try:
            for rgb in frames:
                frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
                # BT.709 limited range, tagged on the stream below, so players decode the colours back.
                frame = frame.reformat(format="yuv420p", dst_colorspace=_BT709, dst_color_range=_LIMITED_RANGE)
                frame.pts = self.frames_written
                self._mux(self._video_stream.encode(frame))
                self.frames_written += 1
            self._encode_pending_audio(audio_samples_for_frames(self.frames_written))
        except av.error.FFmpegError as error:
            raise MediaError(f"Encoding video for {self.path} failed: {error}") from error

    def write_audio(self, waveform: Any) -> None:
        """Append audio: float [2, N] (or mono [N] / [1, N], duplicated) at 32 kHz, clipped to -1..1."""
        self._check_open()
        stereo = np.clip(as_stereo_waveform(waveform), -1.0, 1.0)
        self._pending_audio.append(stereo)
        self.audio_samples_received += stereo.shape[1]
        if self._container is not None:
            self._encode_pending_audio(audio_samples_for_frames(self.frames_written))

    def close(self) -> None:
        """Fit the audio to the video's length, finish both encoders and move the file into place."""
        if self._closed:
            return
        if self.frames_written == 0:
            self.abort()
            raise MediaError(f"No video frames were written to {self.path}; an MP4 needs at least one frame.")
        try:
            target = audio_samples_for_frames(self.frames_written)
            self._say_lengths_differ(target)
            self._encode_pending_audio(target)
            if self._audio_encoded < target:
                self._encode_audio(np.zeros((2, target - self._audio_encoded), np.float32))
            self._pending_audio.clear()  # audio past the video's end is dropped
            self._mux(self._video_stream.encode(None))
            self._mux(self._audio_stream.encode(None))
            self._container.close()
            self._container = None
            self._closed = True
        except BaseException:
            self.abort()
            raise
        self._move_into_place()

    def _say_lengths_differ(self, target: int) -> None:
        """A sound given that does not last as long as the frames (by more than a frame's time) is cut or padded
        with silence to them, as the contract says: told, since it is rarely meant (frames made at another
        rate, a song beside one picture)."""
        given = self.audio_samples_received
        if given and abs(given - target) > SAMPLE_RATE // FPS:
            log.warning("%s: the sound lasts %.2f s but the %d frames %.2f s at %d fps; the sound is %s.", self.path.name,
                        given / SAMPLE_RATE, self.frames_written, target / SAMPLE_RATE, FPS,
                        "cut to the frames' length" if given > target else "padded with silence to the frames' length")

    def _move_into_place(self) -> None:
        """The finished file takes its name. Where another program holds a file of that name open (Windows
        refuses to replace it), the clip is kept under the first free name `name (n).mp4`, which `path` then
        gives, rather than deleted with the temporary file."""
        try:
            os.replace(self._temp_path, self.path)
            return
        except PermissionError as error:
            refused = error
        kept = free_name(self.path)
        try:
            os.replace(self._temp_path, kept)
        except OSError as error:
            raise MediaError(f"Could not write {self.path} ({refused}) nor {kept} ({error}); the finished clip is "
                             f"{self._temp_path}.") from error
        log.warning("Could not replace %s (%s; is it open in another program?): the clip was saved as %s.",
                    self.path, refused.strerror or refused, kept)
        self.path = kept

    def abort(self) -> None:
        """Stop without a file: close the container if open and remove the temporary file."""
        self._closed = True
        if self._container is not None:
            container, self._container = self._container, None
            try:
                container.close()
            except av.error.FFmpegError:
                pass  # the file is being discarded anyway
        self._temp_path.unlink(missing_ok=True)

    def __enter__(self) -> Mp4Writer:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # -- internals -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise MediaError(f"The MP4 writer for {self.path} is already closed.")

    def _open_container(self, width: int, height: int) -> None:
        encoder = pick_h264_encoder(width, height, self._encoder_name)
        audio_encoder = pick_aac_encoder()
        # the whole path: FFmpeg takes a relative '.take:1.mp4...part' for a protocol named '.take'
        container = av.open(str(self._temp_path.absolute()), "w", format="mp4", options={"movflags": _MOVFLAGS})
        try:
            container.metadata.update(self._metadata)
            video = container.add_stream(encoder, rate=FPS)
            video.width, video.height, video.pix_fmt = width, height, "yuv420p"
            video.time_base = Fraction(1, FPS)  # frame index = pts; the MP4 muxer picks 12288 = 512*24 ticks/s
            video.codec_context.colorspace = _BT709
            video.codec_context.color_primaries = _BT709
            video.codec_context.color_trc = _BT709
            video.codec_context.color_range = _LIMITED_RANGE
            if encoder == "libx264":
                video.options = {"crf": str(self._crf), "preset": self._preset}
            else:
                video.bit_rate = int(width * height * FPS * _BITS_PER_PIXEL)
            audio = container.add_stream(audio_encoder, rate=SAMPLE_RATE, layout="stereo")
            audio.bit_rate = self._audio_bitrate
        except BaseException:
            container.close()
            raise
        self._container, self._video_stream, self._audio_stream = container, video, audio
        self._size = (width, height)

    def _encode_pending_audio(self, limit: int) -> None:
        """Encode held-back audio up to sample `limit` (what the video covers so far)."""
        room = limit - self._audio_encoded
        if room <= 0 or not self._pending_audio:
            return
        pending = np.concatenate(self._pending_audio, axis=1)
        self._encode_audio(pending[:, :room])
        self._pending_audio = [pending[:, room:]] if pending.shape[1] > room else []

    def _encode_audio(self, stereo: np.ndarray) -> None:
        if not stereo.shape[1]:  # an empty sound given (the encoder refuses an empty frame): close() pads silence
            return
        # PyAV re-blocks the samples into the encoder's 1024-sample AAC frames.
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(stereo), format="fltp", layout="stereo")
        frame.sample_rate = SAMPLE_RATE
        frame.pts = self._audio_encoded
        self._mux(self._audio_stream.encode(frame))
        self._audio_encoded += stereo.shape[1]

    def _mux(self, packets) -> None:
        for packet in packets:
            self._container.mux(packet)


def write_mp4(
    path: str | os.PathLike,
    frames: Any,
    audio: Any | None = None,
    *,
    crf: int = DEFAULT_CRF,
    preset: str = DEFAULT_PRESET,
    encoder: str | None = None,
    metadata: Mapping[str, str] | None = None,
    on_frames: Callable[[int, int], None] | None = None,
) -> Path:
    """Write a whole clip at once: frames [N, H, W, 3] and audio [2, M] at 32 kHz (None = silence).

    The same rules as `Mp4Writer` (which this wraps): audio fit to N/24 s, file only on success.
    `on_frames(done, N)` after each 17 frames encoded (a progress bar; raising there stops the write and
    leaves no file). Returns the path written.
    """
    total = len(frames)
    with Mp4Writer(path, crf=crf, preset=preset, encoder=encoder, metadata=metadata) as writer:
        for start in range(0, max(total, 1), FRAMES_PER_CHUNK):
            writer.write_video_frames(frames[start:start + FRAMES_PER_CHUNK])
            if on_frames is not None:
                on_frames(min(start + FRAMES_PER_CHUNK, total), total)
        if audio is not None:
            writer.write_audio(audio)
    return writer.path
