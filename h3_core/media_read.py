"""Reading reference media onto H3's clock: video at 24 fps, audio at 32 kHz stereo (h3-model.md C, F).

- `read_video` / `iter_video_frames`: RGB uint8 frames [N, H, W, 3], turned upright by the stream's
  display rotation, resampled to 24 fps by whole frames (no blending): a frame stamped t seconds after the
  first one at or after `start_seconds` goes to slot s = floor(t * 24 + 0.5) and is held until the next
  frame's slot; so a slot shows the latest source frame that has reached it (frames sharing a slot: the
  later wins; gaps: the earlier repeats). For a constant frame rate that is the reference pipeline's
  s(i) = floor(i * 24 / fps + 0.5); a variable-rate recording (a phone, a screen capture that slows down)
  stays with its sound, where placing its frames at the average rate, as the reference does, drifted from
  it by seconds. A picture that starts later than `start_seconds` (by more than a frame: its stream begins
  after the sound) holds its first frame until its time. A stream that changes size part way (an
  adaptive-stream recording) is scaled to its first frame's size.
- `read_audio`: any soundtrack or audio file (WAV, MP3, AAC, FLAC, ...) -> float32 [2, M] at 32 kHz.
  The window is cut at the native rate, then resampled once (the reference order). Mono is
  duplicated into both channels; more than two channels are downmixed to stereo by FFmpeg's
  standard matrix (the reference rejects them; a 5.1 clip is still a usable reference).
- `probe`: stream facts from the container header plus one decoded frame (for the rotation).

All times are seconds from the container's start (its earliest stream), so a video's frames and its
soundtrack read with the same `start_seconds` stay in sync. Files PyAV cannot open or decode raise
`UnreadableMediaError` naming the file. Clip-length and count limits live in the conditioning code.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
from PIL import Image

from .media import FPS, MediaError, UnreadableMediaError, resample_audio

# A frame stamped up to this much before `start_seconds` still counts as at the start (timestamps
# are rationals in the stream's time base; a float start rarely equals them exactly).
START_TOLERANCE_SECONDS = 1e-3
_LIMITED_RANGE, _FULL_RANGE = 1, 2  # FFmpeg's AVCOL_RANGE_MPEG / AVCOL_RANGE_JPEG
_HDR_TRANSFERS = {16: "PQ", 18: "HLG"}  # FFmpeg's AVCOL_TRC_SMPTE2084 / AVCOL_TRC_ARIB_STD_B67
_BT2020_PRIMARIES = 9  # AVCOL_PRI_BT2020
log = logging.getLogger("h3")


@dataclass(frozen=True)
class VideoStreamInfo:
    """The first (non cover-art) video stream. Size is as displayed, i.e. after `rotation`."""

    codec: str
    width: int
    height: int
    fps: float | None  # average rate; None when the container does not say
    frame_count: int | None  # source frames per the header; None when unknown
    duration_seconds: float | None  # this stream's own length; None when the container states only its own
    rotation: int  # counterclockwise degrees applied for display: 0, 90, 180 or 270
    pixel_format: str | None


@dataclass(frozen=True)
class AudioStreamInfo:
    """The first audio stream."""

    codec: str
    sample_rate: int
    channels: int
    duration_seconds: float | None  # this stream's own length; None when the container states only its own


@dataclass(frozen=True)
class MediaInfo:
    """What `probe` reports; `video` / `audio` are None for a file without that kind of stream."""

    path: Path
    duration_seconds: float | None
    video: VideoStreamInfo | None
    audio: AudioStreamInfo | None

    @property
    def video_seconds(self) -> float | None:
        """How long the picture lasts: its stream's own length where stated, else the file's (its longest
        stream's: a one-frame video with a 5 s soundtrack is a 5 s file)."""
        if self.video is not None and self.video.duration_seconds is not None:
            return self.video.duration_seconds
        return self.duration_seconds


@dataclass(frozen=True)
class VideoClip:
    """A reference video on H3's clock.

    frames: uint8 [N, H, W, 3] RGB at 24 fps. audio: float32 [2, M] at 32 kHz covering the same span
    (M: the native samples of N / 24 s resampled, ceil(native * 32000 / rate), which may be one more than
    N * 32000 / 24; fewer only if the soundtrack ends early), or None when the
    file has no soundtrack in that span. source_fps: the rate the frames were resampled from.
    """

    frames: np.ndarray
    audio: np.ndarray | None
    source_fps: float


@contextmanager
def _open_media(path: Path) -> Iterator[av.container.InputContainer]:
    """An input container; FFmpeg errors while opening or decoding become `UnreadableMediaError`."""
    if not path.is_file():
        raise FileNotFoundError(f"No media file at {path}.")
    try:
        container = av.open(str(path.absolute()))  # whole: FFmpeg reads 'take:1.mp4' as protocol 'take'
    except av.error.FFmpegError as error:
        raise UnreadableMediaError(f"Cannot open {path} as audio or video: {_reason(error)}") from error
    try:
        with container:
            yield container
    except av.error.FFmpegError as error:
        raise UnreadableMediaError(f"Cannot decode {path}: {_reason(error)}") from error


def _reason(error: av.error.FFmpegError) -> str:
    """FFmpeg's words for what went wrong, without its error number and function name, and what files are read."""
    return (f"{error.strerror or error} (corrupt, truncated or not a media file: pictures, videos and sounds "
            "FFmpeg reads are taken)")


def _origin_seconds(container) -> float:
    """Where the container's timeline starts (its earliest stream), in seconds."""
    return container.start_time / av.time_base if container.start_time is not None else 0.0


def _video_stream(container):
    """The first video stream that is not an embedded cover picture (MP3/M4A album art)."""
    for stream in container.streams.video:
        if not stream.disposition & av.stream.Disposition.attached_pic:
            return stream
    return None


def _frame_rate(stream) -> float | None:
    rate = stream.average_rate or stream.guessed_rate
    return float(rate) if rate else None


def _quarter_turns(frame: av.VideoFrame) -> int:
    """Counterclockwise quarter turns that make a frame upright.

    `frame.rotation` is the display matrix's counterclockwise angle; FFmpeg's player and CLI apply it
    (e.g. a phone's portrait clip stores -90: turn clockwise). diffusers 0.42.1's reference loader
    turns the other way (np.rot90 by -turns), which shows such a clip upside down; we follow FFmpeg.
    Flips in the matrix are not handled.
    """
    return round((frame.rotation or 0) / 90) % 4


def _to_rgb(frame: av.VideoFrame) -> np.ndarray:
    """uint8 [H, W, 3] RGB, converted with the matrix and range the frame is tagged with.

    Untagged frames count as BT.601 limited range (swscale's default). Both ranges are named (RGB
    is full range) because PyAV 14 only applies a source matrix when something seems to change;
    without that it decodes BT.709 as BT.601, ~20 levels off in saturated colours.
    """
    rgb = frame.reformat(
        format="rgb24",
        src_colorspace=frame.colorspace,
        src_color_range=frame.color_range or _LIMITED_RANGE,
        dst_color_range=_FULL_RANGE,
    )
    return rgb.to_ndarray()


def _check_start(start_seconds: float) -> None:
    if not (math.isfinite(start_seconds) and start_seconds >= 0):
        raise ValueError(f"start_seconds must be a finite number >= 0, got {start_seconds!r}.")


def _decoded_from(container, stream, start_seconds: float) -> Iterator:
    """`stream`'s frames from the keyframe at or before `start_seconds` (from the container's start); the caller
    drops those before it. From the top when no seek is needed, or when the seek fails or lands past the start:
    FFmpeg seeks an MPEG-TS file (a recorder's .ts) by byte position, to a later frame or to none at all."""
    if start_seconds > 0:
        origin = _origin_seconds(container)
        try:
            container.seek(int((origin + start_seconds) / stream.time_base), stream=stream)
            frames = container.decode(stream)
            first = next(frames, None)
            at_start = first is not None and (first.time is None
                                              or first.time - origin <= start_seconds + START_TOLERANCE_SECONDS)
            if at_start:
                return itertools.chain([first], frames)
        except av.error.FFmpegError:
            pass
        container.seek(0)
    return container.decode(stream)


def _stream_seconds(stream) -> float | None:
    """A stream's own length: a file's duration is its longest stream's, so a one-frame video with a 5 s
    soundtrack is a 5 s file."""
    if not stream.duration or stream.time_base is None:
        return None
    return float(stream.duration * stream.time_base)


def _demuxed_seconds(path: Path, index: int) -> float:
    """A stream's length from its packets' timestamps (demuxed, not decoded): Matroska / WebM state none per
    stream, or the file's (its longest stream's, a soundtrack's say) for each."""
    with _open_media(path) as container:
        first, last = _demuxed_span(container, container.streams[index])
    return last - first


def _demuxed_span(container, stream, until: float | None = None) -> tuple[float, float]:
    """(first packet's start, last packet's end) of a stream of an open container, in seconds of its timestamps
    ((0, 0): no packets); with `until`, only as far as a packet ending there or later."""
    first = last = None
    for packet in container.demux(stream):
        if packet.pts is None:  # the demuxer's closing empty packet
            continue
        start = packet.pts * packet.time_base
        stop = start + (packet.duration or 0) * packet.time_base
        first = start if first is None else min(first, start)
        last = stop if last is None else max(last, stop)
        if until is not None and last >= until:
            break
    return (0.0, 0.0) if first is None else (float(first), float(last))


def readable_video_seconds(path: str | os.PathLike, until: float | None = None) -> float:
    """How long a file's video can really be read: where its last packet ends (demuxed, not decoded), counted from
    0 s, or from its first packet when that is earlier. A file cut short (a broken download or copy) keeps its
    header, which still states the whole length. Counted from 0 s, as some containers count their stated length
    (Matroska, WebM, FLV), a video starting late is not taken for a short one. `until`: enough to know whether
    it reaches that far (the packets after are not read)."""
    with _open_media(Path(path)) as container:  # opened once: the stream found and its packets demuxed
        stream = _video_stream(container)
        if stream is None:
            return 0.0
        first, last = _demuxed_span(container, stream, until)
    return last - min(first, 0.0)


def cut_short(path: str | os.PathLike, stated_seconds: float, fps: float, until: float | None = None) -> str | None:
    """What is wrong with a video file whose packets end before `until` seconds (default: the `stated_seconds` its
    header gives), or None: a file cut short (a broken download or copy) keeps its header. Three frames of
    slack: packets without durations end a frame early. Raises MediaError for a file that cannot be demuxed."""
    until = stated_seconds if until is None else until
    readable = readable_video_seconds(path, until)
    if readable < until - 3.0 / fps:
        return (f"{Path(path).name} holds {readable:.2f} s of video, though its header says {stated_seconds:.2f} s: "
                f"the file is cut short or damaged (a broken download or copy?).")
    return None


def probe(path: str | os.PathLike) -> MediaInfo:
    """Duration, video size/fps/rotation and audio rate/channels of a file, decoding one frame at most (and
    demuxing the video's packets where the file states no trustworthy length for it besides a soundtrack)."""
    path = Path(path)
    with _open_media(path) as container:
        duration = container.duration / av.time_base if container.duration else None
        video_info = audio_info = None
        stream = _video_stream(container)
        if stream is not None:
            seconds = _stream_seconds(stream)
            # beside a soundtrack, a length Matroska / WebM state (the file's) or none: what the packets span
            untrusted = seconds is None or container.format.name.startswith("matroska")
            if len(container.streams) > 1 and untrusted:
                fps = _frame_rate(stream) or FPS
                demuxed = _demuxed_seconds(path, stream.index)
                if seconds is None or demuxed < seconds - 1.0 / fps:
                    seconds = demuxed
            first = next(container.decode(stream), None)
            turns = _quarter_turns(first) if first is not None else 0
            width, height = stream.codec_context.width, stream.codec_context.height
            if turns % 2:
                width, height = height, width
            video_info = VideoStreamInfo(
                codec=stream.codec_context.name,
                width=width,
                height=height,
                fps=_frame_rate(stream),
                frame_count=stream.frames or None,
                duration_seconds=seconds,
                rotation=turns * 90,
                pixel_format=stream.codec_context.pix_fmt,
            )
        if container.streams.audio:
            audio = container.streams.audio[0]
            audio_info = AudioStreamInfo(
                codec=audio.codec_context.name, sample_rate=audio.sample_rate, channels=audio.channels,
                duration_seconds=_stream_seconds(audio),
            )
        return MediaInfo(path=path, duration_seconds=duration, video=video_info, audio=audio_info)


def _checked_video_stream(container, path: Path):
    """The video stream to read and its frame rate, or a MediaError saying why there is none."""
    stream = _video_stream(container)
    if stream is None:
        raise MediaError(f"{path} has no video stream.")
    fps = _frame_rate(stream)
    if fps is None:
        raise UnreadableMediaError(f"{path} does not state its frame rate, so it cannot be resampled to {FPS} fps.")
    stream.thread_type = "AUTO"
    context = stream.codec_context
    transfer, primaries = getattr(context, "color_trc", None), getattr(context, "color_primaries", None)
    if transfer in _HDR_TRANSFERS or primaries == _BT2020_PRIMARIES:
        log.warning("%s is HDR video (BT.2020 colours, %s): it is read as SDR BT.709 without tone mapping, so its "
                    "colours come out washed out. Convert it to SDR first (a phone's 'most compatible' setting, or an "
                    "editor's SDR export).", path.name, _HDR_TRANSFERS.get(transfer, "BT.2020 primaries"))
    return stream, fps


def _frames_on_24fps_grid(container, stream, fps: float, start_seconds: float, max_frames: int | None):
    """Decode `stream` from `start_seconds` and yield upright RGB frames on the 24 fps slot grid: each frame
    fills the slots from its own timestamp's to the next frame's (the last: for as long as it says it lasts)."""
    origin = _origin_seconds(container)
    held = base = None  # the frame waiting for the next one's time; where slot 0 is
    emitted = 0
    size = None

    def upright(frame) -> np.ndarray:
        nonlocal size
        rgb = _to_rgb(frame)
        turns = _quarter_turns(frame)
        if turns:
            rgb = np.ascontiguousarray(np.rot90(rgb, k=turns))
        if size is None:
            size = rgb.shape
        elif rgb.shape != size:  # a stream that changes size part way: on the first frame's
            rgb = np.asarray(Image.fromarray(rgb).resize((size[1], size[0]), Image.Resampling.BILINEAR))
        return rgb

    def slot(seconds: float) -> int:
        return math.floor((seconds - base) * FPS + 0.5)

    for decoded, frame in enumerate(_decoded_from(container, stream, start_seconds)):
        seconds = frame.time - origin if frame.pts is not None else decoded / fps
        if seconds < start_seconds - START_TOLERANCE_SECONDS:
            continue
        if base is None:  # a picture starting later than the sound (by over a frame) holds its first frame till then
            base = start_seconds if seconds - start_seconds > 1.0 / fps else seconds
        if held is not None:
            repeats = min(slot(seconds), max_frames or math.inf) - emitted
            rgb = upright(held) if repeats > 0 else None  # frames sharing a slot: the later wins
            for _ in range(repeats):
                yield rgb
            emitted += max(repeats, 0)
            if emitted == max_frames:
                return
        held, last_seconds = frame, seconds
    if held is not None:
        lasts = held.duration * held.time_base if getattr(held, "duration", None) and held.time_base else 1.0 / fps
        repeats = min(slot(last_seconds + float(lasts)), max_frames or math.inf) - emitted
        rgb = upright(held) if repeats > 0 else None
        for _ in range(repeats):
            yield rgb


def _check_max_frames(max_frames: int | None) -> None:
    if max_frames is not None and not (isinstance(max_frames, int) and max_frames > 0):
        raise ValueError(f"max_frames must be a positive integer or None, got {max_frames!r}.")


def iter_video_frames(
    path: str | os.PathLike, start_seconds: float = 0.0, max_frames: int | None = None
) -> Iterator[np.ndarray]:
    """Yield a video's frames one at a time on the 24 fps grid: uint8 [H, W, 3] RGB, upright.

    Streams (a long or large reference never has to fit in memory); the rule is in the module
    docstring. A repeated frame is yielded as the same array: copy it before changing it in place.
    """
    path = Path(path)
    _check_start(start_seconds)
    _check_max_frames(max_frames)
    with _open_media(path) as container:
        stream, fps = _checked_video_stream(container, path)
        yield from _frames_on_24fps_grid(container, stream, fps, start_seconds, max_frames)


def read_video(
    path: str | os.PathLike, start_seconds: float = 0.0, max_frames: int | None = None, *, with_audio: bool = True,
    fit: Callable[[np.ndarray], np.ndarray] | None = None, sound_seconds: float | None = None,
) -> VideoClip:
    """A video file's frames at 24 fps (at most `max_frames`, from `start_seconds`) and its soundtrack.

    The soundtrack is read from the same start, as `read_audio` would, for `sound_seconds` (math.inf: to its
    end), by default exactly the span of the returned frames (N / 24 s): a reference's or a guide's sound may
    run on past its picture. Raises MediaError if no frame lies at or after `start_seconds`.
    `fit` (e.g. a crop onto the canvas) is applied to each frame as it is decoded, so only what it
    returns is kept: a long clip at a larger size never sits in memory whole.
    """
    path = Path(path)
    _check_start(start_seconds)
    _check_max_frames(max_frames)
    with _open_media(path) as container:
        stream, fps = _checked_video_stream(container, path)
        decoded = _frames_on_24fps_grid(container, stream, fps, start_seconds, max_frames)
        frames = list(decoded if fit is None else map(fit, decoded))
    if not frames:
        raise MediaError(f"{path} has no video frames at or after {start_seconds} s.")
    seconds = len(frames) / FPS if sound_seconds is None else None if math.isinf(sound_seconds) else sound_seconds
    audio = read_soundtrack(path, start_seconds, seconds) if with_audio else None
    return VideoClip(frames=np.stack(frames), audio=audio, source_fps=fps)


def read_soundtrack(path: str | os.PathLike, start_seconds: float, seconds: float | None) -> np.ndarray | None:
    """A video's sound over `seconds` (None: to its end) from `start_seconds` as float32 [2, M] at 32 kHz (as
    `read_audio`), or None when the file has no audio stream or no sound there: a video without sound is not an
    error."""
    sound = native_soundtrack(path, start_seconds, seconds)
    return None if sound is None else resample_audio(*sound)


def native_soundtrack(path: str | os.PathLike, start_seconds: float,
                      seconds: float | None) -> tuple[np.ndarray, int] | None:
    """`read_soundtrack` before its resampling: (float32 [C, n], the file's own rate), or None. For a caller that
    cuts the sound at that rate and then resamples it once, as the reference does a reference's."""
    with _open_media(Path(path)) as container:
        if not container.streams.audio:
            return None
        waveform, rate = _decode_audio_window(container, start_seconds, seconds)
    return (waveform, rate) if waveform.shape[1] else None


def read_audio(path: str | os.PathLike, start_seconds: float = 0.0, max_seconds: float | None = None) -> np.ndarray:
    """The first audio stream of a file as float32 [2, M] at 32 kHz, from `start_seconds`.

    At most `max_seconds` (None: to the end); M = ceil(native samples * 32000 / native rate). A
    window that starts before the audio does (a late soundtrack) is led with silence to stay in sync.
    """
    return resample_audio(*read_native_audio(path, start_seconds, max_seconds))


def read_native_audio(path: str | os.PathLike, start_seconds: float = 0.0,
                      max_seconds: float | None = None) -> tuple[np.ndarray, int]:
    """`read_audio` before its resampling: (float32 [C, n] at the file's own rate, that rate)."""
    path = Path(path)
    _check_start(start_seconds)
    if max_seconds is not None and not (math.isfinite(max_seconds) and max_seconds > 0):
        raise ValueError(f"max_seconds must be a positive number or None, got {max_seconds!r}.")
    with _open_media(path) as container:
        if not container.streams.audio:
            raise MediaError(f"{path} has no audio stream.")
        waveform, rate = _decode_audio_window(container, start_seconds, max_seconds)
    if waveform.shape[1] == 0:
        raise MediaError(f"{path} has no audio at or after {start_seconds} s.")
    return waveform, rate


def _decode_audio_window(container, start_seconds: float, max_seconds: float | None) -> tuple[np.ndarray, int]:
    """The first audio stream's samples in [start, start + max) at the native rate: (float32 [C, n], rate).

    C is 1 or 2; wider layouts are downmixed to stereo here (format conversion only, same rate).
    """
    stream = container.streams.audio[0]
    rate = stream.sample_rate
    origin = _origin_seconds(container)
    # fltp at the native rate: only the sample format (and a >2-channel layout) changes here.
    converter = av.AudioResampler(format="fltp", layout="stereo" if stream.channels > 2 else None, rate=rate)
    wanted = round(max_seconds * rate) if max_seconds is not None else None
    pieces: list[np.ndarray] = []
    skip = None  # samples to drop (> 0) or silence to lead with (< 0) before `start_seconds`
    collected = 0
    for frame in _decoded_from(container, stream, start_seconds):
        if skip is None:
            first_seconds = frame.time - origin if frame.pts is not None else 0.0
            skip = round((start_seconds - first_seconds) * rate)
            if skip < 0:
                pieces.append(np.zeros((min(stream.channels, 2), -skip), np.float32))
                collected, skip = -skip, 0
        for converted in converter.resample(frame):
            pieces.append(converted.to_ndarray())
            collected += converted.samples
        if wanted is not None and collected >= skip + wanted:
            break
    pieces += [converted.to_ndarray() for converted in converter.resample(None)]
    if not pieces:
        return np.zeros((1, 0), np.float32), rate
    waveform = np.concatenate(pieces, axis=1)[:, skip:]
    return (waveform[:, :wanted] if wanted is not None else waveform), rate
