"""MP4 writing and reference media reading (h3_core.media*), checked by reading files back with PyAV.

Synthetic clips stamp each source frame's index into its colour so the 24 fps resampling can be
checked frame by frame. Codecs are lossy; tolerances are stated where used.
"""

from __future__ import annotations

import math
from fractions import Fraction

import av
import numpy as np
import pytest
import torch

from h3_core import media_write
from h3_core.media import (
    SAMPLE_RATE,
    EncoderUnavailableError,
    MediaError,
    UnreadableMediaError,
    as_stereo_waveform,
    as_uint8_frames,
    resample_audio,
)
from h3_core.media_read import iter_video_frames, probe, read_audio, read_video
from h3_core.media_write import Mp4Writer, write_mp4

WIDTH, HEIGHT = 96, 64
AAC_FRAME = 1024


# -- helpers -------------------------------------------------------------------------------------


def tone(frequency: float, seconds: float, rate: int = SAMPLE_RATE, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return (amplitude * np.sin(2 * np.pi * frequency * t)).astype(np.float32)


def index_colour(index: int) -> tuple[int, int, int]:
    """A colour that encodes a frame index in 16-level steps (robust to codec error < 8)."""
    return (index % 16) * 16 + 8, (index // 16) * 16 + 8, 128


def colour_index(frame: np.ndarray) -> int:
    red, green = frame[frame.shape[0] // 2, frame.shape[1] // 2, :2].astype(int)
    return round((red - 8) / 16) + 16 * round((green - 8) / 16)


def write_index_clip(path, fps, num_frames, audio_rate=None):
    """A clip at `fps` whose frame i is a solid `index_colour(i)`; optional mono 440 Hz AAC soundtrack."""
    with av.open(str(path), "w") as container:
        video = container.add_stream("libx264", rate=Fraction(fps))
        video.width, video.height, video.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        video.options = {"crf": "0"}
        audio = None
        if audio_rate:
            audio = container.add_stream("aac", rate=audio_rate, layout="mono")
        for index in range(num_frames):
            pixels = np.empty((HEIGHT, WIDTH, 3), np.uint8)
            pixels[:] = index_colour(index)
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts = index
            for packet in video.encode(frame):
                container.mux(packet)
        for packet in video.encode():
            container.mux(packet)
        if audio is not None:
            samples = tone(440, num_frames / float(fps), audio_rate)[None]
            frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
            frame.sample_rate, frame.pts = audio_rate, 0
            for packet in [*audio.encode(frame), *audio.encode()]:
                container.mux(packet)


def write_audio_file(path, samples: np.ndarray, rate: int, codec: str, layout: str, sample_format: str):
    """An audio-only file; `samples` is float [channels, n] in -1..1, sent as "s16" or "fltp"."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=rate, layout=layout)
        if sample_format == "s16":  # packed: channels interleaved in one plane
            data = np.round(samples * 32767).astype(np.int16).T.reshape(1, -1)
        else:
            data = samples.astype(np.float32)
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(data), format=sample_format, layout=layout)
        frame.sample_rate, frame.pts = rate, 0
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)


def expected_sources(num_source: int, fps: float) -> list[int]:
    """Brute force of the 24 fps rule: slot j shows the latest frame i with floor(i*24/fps + .5) <= j."""
    slots = [math.floor(i * 24 / fps + 0.5) for i in range(num_source)]
    total = math.floor(num_source * 24 / fps + 0.5)
    return [max(i for i in range(num_source) if slots[i] <= j) for j in range(total)]


def decode_audio(path) -> np.ndarray:
    with av.open(str(path)) as container:
        return np.concatenate([frame.to_ndarray() for frame in container.decode(audio=0)], axis=1)


def dominant_frequency(signal: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(signal * np.hanning(len(signal))))
    return float(np.fft.rfftfreq(len(signal), 1 / rate)[np.argmax(spectrum)])


def files_in(folder) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


# -- writing -------------------------------------------------------------------------------------


def test_chunked_write_gives_one_h264_24fps_and_one_aac_32k_stereo_track(tmp_path):
    path = tmp_path / "out.mp4"
    rng = np.random.default_rng(0)
    with Mp4Writer(path, metadata={"title": "H3 test", "comment": "chunked", "workflow": '{"nodes": []}'}) as writer:
        writer.write_audio(rng.uniform(-0.3, 0.3, (2, 10_000)).astype(np.float32))  # before any video
        writer.write_video_frames(rng.integers(0, 256, (10, HEIGHT, WIDTH, 3), dtype=np.uint8))
        writer.write_video_frames(torch.rand(7, HEIGHT, WIDTH, 3))  # float 0..1, torch
        writer.write_audio(torch.rand(2, 30_000) * 0.2 - 0.1)
        writer.write_video_frames(rng.random((8, HEIGHT, WIDTH, 3), dtype=np.float32))
    assert writer.encoder == "libx264"
    assert files_in(tmp_path) == ["out.mp4"]  # the temporary file is gone

    num_frames = 25
    with av.open(str(path)) as container:
        assert [stream.type for stream in container.streams] == ["video", "audio"]
        video, audio = container.streams.video[0], container.streams.audio[0]
        assert video.codec_context.name == "h264" and video.codec_context.pix_fmt == "yuv420p"
        # Tagged BT.709 limited range (FFmpeg enum value 1 for both), as the pixels were converted.
        assert (video.codec_context.colorspace, video.codec_context.color_range) == (1, 1)
        assert (video.codec_context.width, video.codec_context.height) == (WIDTH, HEIGHT)
        assert video.average_rate == 24 and video.frames == num_frames
        assert audio.codec_context.name == "aac" and audio.sample_rate == 32000 and audio.channels == 2
        video_seconds = video.duration * video.time_base
        audio_seconds = audio.duration * audio.time_base
        assert video_seconds == Fraction(num_frames, 24)
        assert abs(audio_seconds - video_seconds) * 32000 <= AAC_FRAME
        assert container.metadata["title"] == "H3 test"
        assert container.metadata["comment"] == "chunked"
        assert container.metadata["workflow"] == '{"nodes": []}'
        packets = [packet for packet in container.demux(video) if packet.size]
        assert len(packets) == num_frames
        assert {packet.duration * video.time_base for packet in packets} == {Fraction(1, 24)}
    decoded = decode_audio(path)
    assert abs(decoded.shape[1] - num_frames * 32000 / 24) <= AAC_FRAME


@pytest.mark.parametrize("audio_seconds", [0.0, 0.4, 2.5])
def test_audio_is_padded_or_trimmed_to_the_video(tmp_path, audio_seconds):
    """A sound shorter than the video ends in silence (an empty one is all silence); a longer one is cut."""
    path = tmp_path / "fit.mp4"
    frames = np.zeros((24, HEIGHT, WIDTH, 3), np.uint8)  # 1 s
    waveform = np.tile(tone(1000, audio_seconds), (2, 1))
    write_mp4(path, frames, waveform)
    with av.open(str(path)) as container:
        audio = container.streams.audio[0]
        assert abs(audio.duration * audio.time_base - 1) * 32000 <= AAC_FRAME
    decoded = decode_audio(path)
    assert abs(decoded.shape[1] - 32000) <= AAC_FRAME
    if audio_seconds == 0:
        assert np.abs(decoded).max() < 1e-3
    elif audio_seconds < 1:  # padded with silence after the tone (AAC rings for < 1 frame)
        assert np.abs(decoded[:, 1_000:12_000]).mean() > 0.2
        assert np.abs(decoded[:, 12_800 + AAC_FRAME : 32_000]).max() < 1e-3
    else:  # trimmed: the tone runs to the end
        assert np.abs(decoded[:, 30_000:31_000]).mean() > 0.2


def test_colour_and_stereo_tones_survive(tmp_path):
    """Tolerances (lossy codecs): solid colour within 3/255 per channel at crf 18; each channel's
    tone back at its frequency (+-2 Hz) with RMS within 5 %, and the waveform correlates > 0.99."""
    path = tmp_path / "content.mp4"
    colour = (200, 60, 110)
    frames = np.empty((12, HEIGHT, WIDTH, 3), np.uint8)
    frames[:] = colour
    left, right = tone(440, 0.5), tone(1000, 0.5, amplitude=0.3)
    write_mp4(path, frames, np.stack([left, right]))

    clip = read_video(path)
    assert clip.frames.shape == (12, HEIGHT, WIDTH, 3)
    assert np.abs(clip.frames.astype(int) - colour).max() <= 3
    decoded = decode_audio(path)[:, : left.size]
    for channel, reference, frequency in ((0, left, 440), (1, right, 1000)):
        assert abs(dominant_frequency(decoded[channel], 32000) - frequency) <= 2
        rms, reference_rms = np.sqrt(np.mean(decoded[channel] ** 2)), np.sqrt(np.mean(reference**2))
        assert abs(rms / reference_rms - 1) < 0.05
        assert np.corrcoef(decoded[channel], reference)[0, 1] > 0.99
    assert clip.audio.shape == (2, 16_000)  # the soundtrack as read_audio gives it: the video's span


def test_bad_frames_and_audio_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="even"):
        write_mp4(tmp_path / "odd.mp4", np.zeros((2, 63, 96, 3), np.uint8))
    with pytest.raises(ValueError, match=r"even and positive .* got 96x0"):  # was "No usable H.264 encoder"
        write_mp4(tmp_path / "flat.mp4", np.zeros((2, 0, 96, 3), np.uint8))
    with pytest.raises(ValueError, match="channels-first"):
        write_mp4(tmp_path / "chw.mp4", torch.zeros(2, 3, 64, 96))
    with pytest.raises(ValueError, match="uint8 .* or floating point"):
        write_mp4(tmp_path / "int.mp4", np.zeros((2, 64, 96, 3), np.int32))
    with pytest.raises(ValueError, match="NaN"):
        write_mp4(tmp_path / "nan.mp4", np.full((2, 64, 96, 3), np.nan, np.float32))
    with pytest.raises(ValueError, match="mono or stereo"):
        write_mp4(tmp_path / "6ch.mp4", np.zeros((2, 64, 96, 3), np.uint8), np.zeros((6, 100), np.float32))
    with pytest.raises(ValueError, match="share a size"), Mp4Writer(tmp_path / "sizes.mp4") as writer:
        writer.write_video_frames(np.zeros((2, 64, 96, 3), np.uint8))
        writer.write_video_frames(np.zeros((2, 64, 128, 3), np.uint8))
    with pytest.raises(ValueError, match="crf"):
        Mp4Writer(tmp_path / "crf.mp4", crf=60)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Mp4Writer(tmp_path / "missing" / "out.mp4")
    assert files_in(tmp_path) == []  # no half files, no temporaries


def test_failed_or_empty_write_leaves_no_file(tmp_path):
    (tmp_path / "keep.mp4").write_bytes(b"old")
    with pytest.raises(RuntimeError, match="decoder blew up"), Mp4Writer(tmp_path / "keep.mp4") as writer:
        writer.write_video_frames(np.zeros((5, 64, 96, 3), np.uint8))
        raise RuntimeError("decoder blew up")
    assert (tmp_path / "keep.mp4").read_bytes() == b"old"  # an existing file is only replaced on success
    with pytest.raises(MediaError, match="No video frames"), Mp4Writer(tmp_path / "empty.mp4") as writer:
        writer.write_audio(np.zeros(1000, np.float32))
    assert files_in(tmp_path) == ["keep.mp4"]
    with pytest.raises(MediaError, match="closed"):
        writer.write_video_frames(np.zeros((1, 64, 96, 3), np.uint8))


def test_encoder_choice_and_clear_error_when_none_is_usable(tmp_path, monkeypatch):
    assert media_write.pick_h264_encoder(WIDTH, HEIGHT) == "libx264"
    with pytest.raises(ValueError, match="does not produce H.264"):
        media_write.pick_h264_encoder(WIDTH, HEIGHT, "mpeg4")
    monkeypatch.setattr(media_write, "H264_ENCODERS", ("h264_no_such_encoder",))
    with pytest.raises(EncoderUnavailableError, match="h264_no_such_encoder"):
        write_mp4(tmp_path / "none.mp4", np.zeros((2, 64, 96, 3), np.uint8))
    assert files_in(tmp_path) == []


def test_array_coercion_contract():
    floats = torch.tensor([[[[0.0, 0.5, 1.0]]], [[[-0.2, 1.7, 0.999]]]], dtype=torch.bfloat16)
    assert as_uint8_frames(floats).tolist() == [[[[0, 128, 255]]], [[[0, 255, 255]]]]
    with pytest.raises(ValueError, match=r"Video frames reach 254; floating point frames are 0..1 \(values in 0..255\? "
                                         "divide them by 255"):  # clipped, they were a white picture
        as_uint8_frames(np.full((1, 2, 2, 3), 254.0, np.float32))
    from h3_core.references import MediaInputError, load_image

    with pytest.raises(MediaInputError, match="first_image: its pixels reach 200; floating point"):  # not "Video frames"
        load_image(np.full((4, 6, 3), 200.0, np.float32), "first_image")
    mono = np.linspace(-1, 1, 5, dtype=np.float64)
    stereo = as_stereo_waveform(mono)
    assert stereo.dtype == np.float32 and stereo.shape == (2, 5) and (stereo[0] == stereo[1]).all()
    with pytest.raises(ValueError, match=r"waveform\[0\]"):
        as_stereo_waveform(np.zeros((1, 2, 10), np.float32))
    resampled = resample_audio(np.tile(tone(440, 1.0, 48_000), (2, 1)), 48_000)
    assert resampled.shape == (2, 32_000)
    assert abs(dominant_frequency(resampled[0], 32_000) - 440) <= 1


# -- reading -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fps, num_source", [(30, 60), (12, 24), (24, 20), (Fraction(30000, 1001), 50)])
def test_video_is_resampled_to_24fps_by_whole_frames(tmp_path, fps, num_source):
    path = tmp_path / "clip.mp4"
    write_index_clip(path, fps, num_source)
    clip = read_video(path)
    sources = [colour_index(frame) for frame in clip.frames]
    assert sources == expected_sources(num_source, float(fps))
    assert clip.audio is None and clip.source_fps == pytest.approx(float(fps))
    if fps == 30:  # frames 2 and 3 share slot 2 (the later wins); 7 and 8 share slot 6
        assert sources[:8] == [0, 1, 3, 4, 5, 6, 8, 9] and len(sources) == 48
    if fps == 12:  # every frame held for two slots
        assert sources[:6] == [0, 0, 1, 1, 2, 2] and len(sources) == 48


def test_video_start_offset_max_frames_and_soundtrack(tmp_path):
    path = tmp_path / "clip30.mp4"
    write_index_clip(path, 30, 60, audio_rate=44_100)  # 2 s, mono 44.1 kHz AAC soundtrack
    clip = read_video(path, start_seconds=1.0, max_frames=10)
    assert [colour_index(frame) for frame in clip.frames] == [30, 31, 33, 34, 35, 36, 38, 39, 40, 41]
    # 10 frames' sound: 18375 samples at 44.1 kHz, 13333.3 at 32 kHz, counted up as the reference's resample does
    assert clip.audio.dtype == np.float32 and clip.audio.shape == (2, 13334)
    assert (clip.audio[0] == clip.audio[1]).all()  # mono duplicated
    assert abs(dominant_frequency(clip.audio[0], 32000) - 440) <= 3
    streamed = [colour_index(frame) for frame in iter_video_frames(path, start_seconds=1.5)]
    assert streamed == [45 + index for index in expected_sources(15, 30)]
    with pytest.raises(MediaError, match="no video frames at or after 5"):
        read_video(path, start_seconds=5.0)


def test_an_mpeg_ts_file_is_read_from_its_start_and_from_later(tmp_path):
    """FFmpeg seeks an MPEG-TS file (a recorder's .ts) to a later timestamp and its decoder then gives nothing:
    such a file is read from the top, the frames before the start dropped."""
    path = tmp_path / "clip.ts"
    write_index_clip(path, 24, 72, audio_rate=44_100)
    assert [colour_index(frame) for frame in read_video(path, max_frames=5).frames] == [0, 1, 2, 3, 4]
    later = read_video(path, start_seconds=1.0, max_frames=24)
    assert [colour_index(frame) for frame in later.frames] == list(range(24, 48))
    assert later.audio.shape == (2, 32000) and abs(dominant_frequency(later.audio[0], 32000) - 440) <= 3
    assert read_audio(path, 1.0, 0.5).shape == (2, 16000)


def ffmpeg_transpose(pixels: np.ndarray, direction: str) -> np.ndarray:
    """`pixels` through FFmpeg's own transpose filter ("clock" / "cclock")."""
    graph = av.filter.Graph()
    source = graph.add_buffer(width=pixels.shape[1], height=pixels.shape[0], format="rgb24", time_base=Fraction(1, 24))
    transpose, sink = graph.add("transpose", direction), graph.add("buffersink")
    source.link_to(transpose)
    transpose.link_to(sink)
    graph.configure()
    frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
    frame.pts = 0
    graph.push(frame)
    return graph.pull().to_ndarray()


@pytest.mark.parametrize("rotation, ffmpeg_filter", [(-90, "clock"), (90, "cclock")])
def test_display_rotation_is_applied_as_ffmpeg_does(tmp_path, rotation, ffmpeg_filter):
    """FFmpeg's CLI shows a stream whose display matrix reads `rotation` by inserting
    transpose=clock for -90 (a phone's portrait clip) and transpose=cclock for +90 (fftools
    get_rotation negates the angle); read_video must give the same upright picture."""
    if not hasattr(av.video.stream.VideoStream, "set_display_rotation"):
        pytest.skip("this PyAV cannot write a display matrix")
    pixels = np.zeros((HEIGHT, WIDTH, 3), np.uint8)
    pixels[:16, :16] = 255  # a white top-left corner and a red left edge: no symmetry to hide behind
    pixels[:, :4, 0] = 255
    path = tmp_path / "rotated.mp4"
    with av.open(str(path), "w") as container:
        video = container.add_stream("libx264", rate=24)
        video.width, video.height, video.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        video.options = {"crf": "0"}
        video.set_display_rotation(rotation)
        frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
        frame.pts = 0
        for packet in [*video.encode(frame), *video.encode()]:
            container.mux(packet)
    frames = read_video(path).frames
    assert frames.shape == (1, WIDTH, HEIGHT, 3)  # portrait on display
    assert np.abs(frames[0].astype(int) - ffmpeg_transpose(pixels, ffmpeg_filter)).mean() < 2
    info = probe(path).video
    assert (info.width, info.height, info.rotation) == (HEIGHT, WIDTH, rotation % 360)


def test_audio_files_come_back_32k_stereo(tmp_path):
    # WAV, 44.1 kHz mono: 0.5 s silence then 1 s of 440 Hz.
    wav = tmp_path / "voice.wav"
    signal = np.concatenate([np.zeros(22_050, np.float32), tone(440, 1.0, 44_100)])[None]
    write_audio_file(wav, signal, 44_100, "pcm_s16le", "mono", "s16")
    audio = read_audio(wav)
    assert audio.dtype == np.float32 and audio.shape == (2, 48_000)
    assert (audio[0] == audio[1]).all()
    assert np.abs(audio[:, :15_000]).max() < 1e-3 and np.abs(audio[:, 17_000:]).mean() > 0.25
    window = read_audio(wav, start_seconds=0.5, max_seconds=0.5)
    assert window.shape == (2, 16_000)
    assert np.corrcoef(window[0], tone(440, 0.5))[0, 1] > 0.99  # starts exactly on the tone's onset

    # FLAC 48 kHz stereo (lossless): different tones per side, exact length.
    flac = tmp_path / "music.flac"
    write_audio_file(flac, np.stack([tone(300, 1.0, 48_000), tone(900, 1.0, 48_000)]), 48_000, "flac", "stereo", "s16")
    audio = read_audio(flac)
    assert audio.shape == (2, 32_000)
    assert [round(dominant_frequency(channel, 32_000)) for channel in audio] == [300, 900]

    # MP3 (its LAME header makes it gapless: within one 1152-sample frame) and raw ADTS AAC, which
    # cannot say how much encoder priming and end padding it holds: up to two 1024-sample frames.
    for name, codec, extra_samples in (("a.mp3", "libmp3lame", 1152), ("a.aac", "aac", 2 * 1024)):
        path = tmp_path / name
        write_audio_file(path, np.tile(tone(440, 1.0, 44_100), (2, 1)), 44_100, codec, "stereo", "fltp")
        audio = read_audio(path)
        assert 0 <= audio.shape[1] - 32_000 <= extra_samples * 32_000 / 44_100 + 1
        assert abs(dominant_frequency(audio[0], 32_000) - 440) <= 2

    # 5.1 WAV: downmixed to stereo by FFmpeg's matrix (front left stays left).
    surround = tmp_path / "surround.wav"
    channels = np.zeros((6, 16_000), np.float32)
    channels[0] = tone(440, 0.5, 32_000)
    write_audio_file(surround, channels, 32_000, "pcm_s16le", "5.1", "s16")
    audio = read_audio(surround)
    assert audio.shape == (2, 16_000)
    assert np.abs(audio[0]).max() > 0.3 and np.abs(audio[1]).max() < 1e-3


def test_probe_reports_streams_without_decoding_everything(tmp_path):
    path = tmp_path / "probe.mp4"
    write_mp4(path, np.zeros((30, HEIGHT, WIDTH, 3), np.uint8), np.zeros((2, 100), np.float32))
    info = probe(path)
    assert info.duration_seconds == pytest.approx(30 / 24, abs=1 / 24)
    assert (info.video.width, info.video.height, info.video.fps, info.video.frame_count) == (WIDTH, HEIGHT, 24.0, 30)
    assert (info.video.codec, info.video.pixel_format, info.video.rotation) == ("h264", "yuv420p", 0)
    assert (info.audio.codec, info.audio.sample_rate, info.audio.channels) == ("aac", 32000, 2)
    wav = tmp_path / "tone.wav"
    write_audio_file(wav, tone(440, 0.25, 44_100)[None], 44_100, "pcm_s16le", "mono", "s16")
    info = probe(wav)
    assert info.video is None and (info.audio.sample_rate, info.audio.channels) == (44_100, 1)
    with pytest.raises(MediaError, match="has no video stream"):
        read_video(wav)
    with pytest.raises(MediaError, match="has no audio stream"):
        write_index_clip(tmp_path / "mute.mp4", 24, 2)
        read_audio(tmp_path / "mute.mp4")


def test_corrupt_or_missing_files_raise_errors_naming_the_file(tmp_path):
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(np.random.default_rng(1).integers(0, 256, 50_000, dtype=np.uint8).tobytes())
    for read in (probe, read_video, read_audio):
        with pytest.raises(UnreadableMediaError, match="junk.mp4"):
            read(junk)
    with pytest.raises(FileNotFoundError, match="nowhere.mp4"):
        read_video(tmp_path / "nowhere.mp4")
    with pytest.raises(ValueError, match="start_seconds"):
        read_audio(junk, start_seconds=-1.0)


def test_a_killed_writers_temporary_file_goes_with_the_next_write_of_its_name(tmp_path):
    """A process killed outright (SIGKILL, the OOM killer) left its hidden temporary MP4 behind for good. Its
    name carries the writer's process id: the next write of the same name removes it once that process is gone,
    and leaves a running writer's, and other names', alone."""
    import os
    import subprocess
    import sys

    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True)
    gone = int(finished.stdout)
    orphan = tmp_path / f".out.mp4.{gone}-0123abcd.part"
    running = tmp_path / f".out.mp4.{os.getpid()}-89abcdef.part"
    other = tmp_path / f".other.mp4.{gone}-0123abcd.part"
    for path in (orphan, running, other):
        path.write_bytes(b"half an mp4")
    rng = np.random.default_rng(0)
    with Mp4Writer(tmp_path / "out.mp4") as writer:
        names = [path.name for path in tmp_path.iterdir()]
        assert orphan.name not in names and running.name in names  # removed before this write began
        writer.write_video_frames(rng.integers(0, 256, (3, HEIGHT, WIDTH, 3), dtype=np.uint8))
        assert writer._temp_path.name.startswith(f".out.mp4.{os.getpid()}-")  # its own, named the same way
    assert files_in(tmp_path) == sorted(["out.mp4", running.name, other.name])


def test_float64_frames_round_at_their_own_precision():
    """diffusers rounds a float64 picture's levels in float64; through float32 a value just over a half level
    landed on it and rounded down (found by the edge-shape parity review: references 1 level darker)."""
    values = np.array([0.6843137426534533, 0.5823529516960055, 0.5, 0.25], np.float64)
    assert np.float32(values[0]) * np.float32(255) == np.float32(174.5)  # the case: float32 lands on the half
    frames = np.broadcast_to(values[:, None, None, None], (4, 1, 1, 3))
    assert as_uint8_frames(frames)[:, 0, 0, 0].tolist() == np.rint(values * 255).tolist() == [175, 149, 128, 64]
    from diffusers.image_processor import VaeImageProcessor  # how the reference makes an image reference's pixels

    assert [image.getpixel((0, 0))[0] for image in VaeImageProcessor.numpy_to_pil(np.ascontiguousarray(frames))] == [
        175, 149, 128, 64]


def test_float_frames_become_uint8_a_few_at_a_time():
    """H3 AV Save's IMAGE became uint8 through three float32 copies of the whole batch (a 75 s clip at 1344x768:
    ~40 GB); now a few frames at a time, with the same levels."""
    import tracemalloc

    from h3_core.media import as_uint8_frames

    frames = np.random.default_rng(0).random((96, 128, 256, 3), dtype=np.float32) * 1.2 - 0.1
    want = np.rint(np.clip(frames, 0.0, 1.0) * 255.0).astype(np.uint8)
    tracemalloc.start()
    try:
        got = as_uint8_frames(frames)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.array_equal(got, want) and peak < got.nbytes + frames.nbytes / 2  # was over twice the frames
