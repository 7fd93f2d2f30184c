"""Reference videos at the edges of what recorders write: a picture shorter than its soundtrack in a container that
states no length per stream (Matroska), a picture that starts after its sound, a stream that changes size part way.
Clips are written here with PyAV, each frame's index in its colour (tests/test_media.py's helpers)."""

from __future__ import annotations

from fractions import Fraction

import av
import numpy as np
import pytest
from test_media import colour_index, index_colour

from h3_core.media_read import probe, read_video

RATE = 48000


def _frame(index: int, width: int = 96, height: int = 64) -> av.VideoFrame:
    pixels = np.empty((height, width, 3), np.uint8)
    pixels[:] = index_colour(index)
    return av.VideoFrame.from_ndarray(pixels, format="rgb24").reformat(format="yuv420p")


def write_clip(path, frames: int, sound_seconds: float, first_pts: int = 0, fmt: str | None = None,
               sizes: tuple[tuple[int, int], ...] = ((96, 64),), stamps: list[int] | None = None) -> None:
    """`frames` frames at 24 fps stamped from `first_pts` (1/24 s each; or at `stamps`, in 1/24 s), split evenly
    over `sizes` (a new encoder for each size, as an adaptive-stream recording switches), and a sound from 0 s
    lasting `sound_seconds`."""
    with av.open(str(path), "w", format=fmt) as container:
        video = container.add_stream("libx264", rate=24)
        video.width, video.height = sizes[0]
        video.pix_fmt, video.options = "yuv420p", {"crf": "0", "bf": "0"}
        video.codec_context.time_base = Fraction(1, 24)
        audio = container.add_stream("aac", rate=RATE, layout="stereo") if sound_seconds else None
        if audio is not None:
            sound = np.zeros((2, int(sound_seconds * RATE)), np.float32)
            for start in range(0, sound.shape[1], 1024):
                chunk = av.AudioFrame.from_ndarray(np.ascontiguousarray(sound[:, start:start + 1024]), format="fltp",
                                                   layout="stereo")
                chunk.sample_rate, chunk.pts = RATE, start
                for packet in audio.encode(chunk):
                    container.mux(packet)
        per_size = frames // len(sizes)
        for part, (width, height) in enumerate(sizes):
            encoder = video.codec_context
            if part:
                encoder = av.CodecContext.create("libx264", "w")
                encoder.width, encoder.height, encoder.pix_fmt = width, height, "yuv420p"
                encoder.time_base, encoder.framerate = Fraction(1, 24), Fraction(24)
                encoder.options = {"crf": "0", "bf": "0"}  # as the first: no B-frames, so timestamps keep rising
            for index in range(part * per_size, (part + 1) * per_size):
                frame = _frame(index, width, height)
                frame.pts = first_pts + index if stamps is None else stamps[index]
                for packet in encoder.encode(frame):
                    packet.stream = video
                    container.mux(packet)
            for packet in encoder.encode(None):
                packet.stream = video
                container.mux(packet)
        if audio is not None:
            for packet in audio.encode(None):
                container.mux(packet)


@pytest.mark.parametrize("frames, sound, expected", [(1, 5.0, 1 / 24), (72, 8.0, 3.0), (15, 5.0, 15 / 24)])
def test_a_matroska_picture_is_as_long_as_its_packets_not_its_soundtrack(tmp_path, frames, sound, expected):
    """Matroska states no length per stream (or the file's for each): a 3 s clip with a 16 s soundtrack was refused
    as too long, a 1-frame one with a 5 s soundtrack passed as a 5 s reference."""
    path = tmp_path / "clip.mkv"
    write_clip(path, frames, sound, fmt="matroska")
    assert probe(path).video_seconds == pytest.approx(expected, abs=1 / 24)
    assert probe(path).duration_seconds == pytest.approx(sound, abs=0.05)  # the file lasts as long as its sound
    mp4 = tmp_path / "clip.mp4"
    write_clip(mp4, frames, sound)
    assert probe(mp4).video_seconds == pytest.approx(expected, abs=1 / 24)


def test_a_picture_that_starts_after_its_sound_holds_its_first_frame_till_then(tmp_path):
    """A camera started 0.5 s after the microphone: the first frame is held for 12 slots, so frame i shows at
    0.5 s + i / 24 as stamped, in step with the soundtrack read from the same start (it was shown 0.5 s early)."""
    for name, fmt in (("late.mp4", None), ("late.mkv", "matroska")):
        path = tmp_path / name
        write_clip(path, 72, 3.5, first_pts=12, fmt=fmt)
        clip = read_video(path)
        shown = [colour_index(frame) for frame in clip.frames]
        assert shown == [0] * 13 + list(range(1, 72)), name
        assert clip.audio.shape[1] == round(84 * 32000 / 24)
    on_time = tmp_path / "on_time.mp4"
    write_clip(on_time, 72, 3.0)
    assert [colour_index(frame) for frame in read_video(on_time).frames] == list(range(72))  # no change there


def test_a_stream_that_changes_size_part_way_is_read_at_its_first_size(tmp_path):
    path = tmp_path / "switch.ts"
    write_clip(path, 48, 0.0, fmt="mpegts", sizes=((96, 64), (64, 48)))
    clip = read_video(path)
    assert clip.frames.shape == (48, 64, 96, 3)
    assert [colour_index(frame) for frame in clip.frames] == list(range(48))


def test_a_reference_videos_soundtrack_runs_as_long_as_the_output_from_a_file_as_from_memory(tmp_path):
    """The reference conditions a video reference on its soundtrack over the output's length, even where it outlasts
    the picture (diffusers reads a file's whole soundtrack, then cuts it there): a file gave only the picture's
    3 s of it."""
    from h3_core.references import DecodedVideo, MediaReference, prepare_reference

    path = tmp_path / "short_picture.mp4"
    write_clip(path, 72, 8.0)
    from_file = prepare_reference(MediaReference("video", path), 124)
    clip = read_video(path, with_audio=False)
    sound = np.zeros((2, 8 * RATE), np.float32)
    in_memory = prepare_reference(MediaReference("video", DecodedVideo(clip.frames, 24.0, sound, RATE)), 124)
    # 248000 samples at 48 kHz (the output's 124 frames) resampled once: 165333.3, counted up as the reference's
    assert from_file.audio.shape == in_memory.audio.shape == (2, 165334)
    assert np.array_equal(from_file.frames, in_memory.frames) and from_file.frames.shape[0] == 72


def test_a_variable_frame_rate_picture_is_placed_by_its_timestamps_and_stays_with_its_sound(tmp_path, caplog):
    """A screen recording that drops from 24 to 8 fps half way: its frames were placed by index at the average rate,
    as the release's pipelines place them, so its picture drifted from its sound (here by 2 s at the end). Each
    frame now fills the 24 fps slots from its own time to the next frame's."""
    slowing = tmp_path / "slowing.mp4"
    write_clip(slowing, 48, 4.0, stamps=[*range(24), *range(24, 96, 3)])  # 1 s at 24 fps, then 3 s at 8 fps
    clip = read_video(slowing)
    shown = [colour_index(frame) for frame in clip.frames]
    # slot k shows the frame stamped at or before it; the last lasts what the stream says (1/24 s here)
    assert shown == [*range(24), *(24 + k // 3 for k in range(70))]
    # the sound of that span at 32 kHz, from the same start (125333.3 samples, counted up as the reference's resample)
    assert clip.audio.shape[1] == 125334


def test_a_relative_name_with_a_colon_is_a_file_not_a_protocol(tmp_path, monkeypatch):
    """FFmpeg read 'take:1.mp4' (and the writer's '.take:1.mp4....part') as a URL of protocol 'take': writing or
    reading such a file in the current folder failed with 'Protocol not found', naming no file."""
    from h3_core.media_write import Mp4Writer

    monkeypatch.chdir(tmp_path)
    with Mp4Writer("take:1.mp4") as writer:
        writer.write_video_frames(np.zeros((24, 64, 96, 3), np.uint8))
        writer.write_audio(np.zeros((2, 32000), np.float32))
    assert (tmp_path / "take:1.mp4").is_file() and read_video("take:1.mp4").frames.shape == (24, 64, 96, 3)


def test_an_hdr_clip_is_said_to_be_read_without_tone_mapping(tmp_path, caplog):
    """A phone's HDR video (BT.2020, HLG) was read as BT.709 without a word: washed-out colours in the reference."""
    path = tmp_path / "hlg.mp4"
    with av.open(str(path), "w") as container:
        video = container.add_stream("libx264", rate=24)
        video.width, video.height, video.pix_fmt = 64, 64, "yuv420p"
        video.codec_context.color_primaries, video.codec_context.color_trc, video.codec_context.colorspace = 9, 18, 9
        for index in range(24):
            for packet in video.encode(av.VideoFrame.from_ndarray(np.full((64, 64, 3), index, np.uint8), "rgb24")):
                container.mux(packet)
        for packet in video.encode(None):
            container.mux(packet)
    write_clip(tmp_path / "sdr.mp4", 24, 0.0)
    with caplog.at_level("WARNING", logger="h3"):
        read_video(tmp_path / "sdr.mp4")
        assert not caplog.records
        read_video(path)
    (record,) = caplog.records
    assert "hlg.mp4 is HDR video (BT.2020 colours, HLG): it is read as SDR BT.709 without tone mapping" in record.message
