"""A clip you have as H3 latents (clip_latents.py): the frames go through the same recipe as a guide clip,
the sound as a driving track, and the result continues like any sampled clip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from h3_core.clip_latents import VaeClips, clip_frame_count, encode_clip, stream_clip
from h3_core.conditioning import RequestError
from h3_core.drive_audio import encode_track, load_track
from h3_core.references import DecodedAudio, cover_crop, encode_video, frames_at_24fps
from h3_core.references import RELEASE_CANVAS
from h3_core.tiny import tiny_random_audio_vae, tiny_random_video_vae
from h3_core.vae_video import VideoVAE


@pytest.fixture(scope="module")
def vaes():
    return tiny_random_video_vae(), tiny_random_audio_vae()


def clip(frames: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (frames, 100, 180, 3), dtype=np.uint8)


@pytest.mark.parametrize("fps", [1.0, 7.5, 23.976, 24.0, 30.0, 60.0])
def test_a_slow_clip_in_memory_is_not_repeated_out_whole(vaes, fps):
    """A clip below 24 fps (images given at 1 fps) was repeated onto the whole 24 fps grid before the first frame
    was encoded: 60 images at 1 fps held 24 times over. Now each slot's frame is taken as it is encoded; the first
    `limit` slots are those of the whole grid, at any rate."""
    import tracemalloc

    frames = np.random.default_rng(0).integers(0, 256, (60, 64, 128, 3), dtype=np.uint8)
    whole = frames_at_24fps(frames, fps)
    for limit in (0, 1, 22, 56, 10**6):
        assert np.array_equal(frames_at_24fps(frames, fps, limit), whole[:limit])

    class Stop(Exception):
        pass

    def stop(done, total):
        raise Stop  # after the first VAE clip, as an interrupt would

    tracemalloc.start()
    try:
        with pytest.raises(Stop):
            encode_clip(*vaes, frames, fps, 128, 64, on_clip=stop)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * frames.nbytes  # before: 24 x the frames at 1 fps


def test_frames_are_encoded_as_a_guide_clip_and_the_sound_as_a_driving_track(vaes):
    video_vae, audio_vae = vaes
    frames = clip(75)  # 2.5 s at 30 fps: 60 frames at 24 fps, cut to 56
    sound = np.random.default_rng(1).standard_normal((1, 44100 * 3)).astype(np.float32) * 0.1
    latents = encode_clip(video_vae, audio_vae, frames, 30.0, 224, 128, sound, 44100)
    assert latents.num_frames == 56 and latents.video.shape == (1, 24, 17, 8, 14)
    fitted = np.stack([np.asarray(cover_crop(Image.fromarray(f), 224, 128)) for f in frames_at_24fps(frames, 30.0)[:56]])
    assert torch.equal(latents.video, encode_video(video_vae, fitted))
    assert torch.equal(latents.audio, encode_track(audio_vae, load_track(DecodedAudio(sound, 44100)), 56))
    reported = []  # a host's progress after each 17 frames encoded, then the last 5
    quiet = encode_clip(video_vae, audio_vae, frames, 30.0, 224, 128, on_clip=lambda *done: reported.append(done))
    assert reported == [(17, 56), (34, 56), (51, 56), (56, 56)]
    silence = encode_track(audio_vae, torch.zeros(2, 32000 * 3), 56)
    assert torch.equal(quiet.video, latents.video) and torch.equal(quiet.audio, silence)


def test_clip_lengths_snap_down_to_17n_plus_5():
    assert [clip_frame_count(n, 24.0) for n in (22, 38, 39, 124, 130)] == [22, 22, 39, 124, 124]
    assert clip_frame_count(300, 60.0) == 107  # 120 frames at 24 fps
    # a clip held in memory keeps its first 300 s, as a file read does (it was encoded whole, then refused)
    assert clip_frame_count(7251, 24.0) == clip_frame_count(7200, 24.0) == 7196  # 17n + 5 in 300 s
    with pytest.raises(RequestError, match="needs at least 22 frames at 24 fps .* has 21 \\(21 at 24 fps\\)"):
        clip_frame_count(21, 24.0)


@pytest.mark.parametrize("count", [22, 38, 39, 40, 60])
def test_clips_cut_as_frames_arrive_are_the_whole_clips_17_frame_pieces(count):
    """VaeClips yields what TemporalChunking.encode cuts from the first 17n + 5 frames (17 each, the last 5),
    each piece once 5 more frames have arrived: never more than 22 frames held."""
    frames = clip(count)
    arrived = []

    def source():
        for index, frame in enumerate(frames):
            arrived.append(index + 1)
            yield frame

    pieces = VaeClips(source())
    got = [(piece, len(arrived)) for piece in pieces]
    kept = clip_frame_count(count, 24.0)
    whole = torch.from_numpy(frames[:kept]).permute(3, 0, 1, 2)[None]
    expected = [c[0].permute(1, 2, 3, 0).numpy() for c in whole.split(17, dim=2)]
    assert len(got) == len(expected) and all(np.array_equal(a, b) for (a, _), b in zip(got, expected))
    assert [seen for _, seen in got[:-1]] == [17 * k + 22 for k in range(len(got) - 1)]
    assert (pieces.arrived, pieces.kept) == (count, kept)


def test_a_soundtrack_read_after_the_frames_is_asked_for_what_arrived(vaes):
    """A file's own soundtrack is read once the frames have all arrived (for exactly those), and a file
    without one gets silence, as frames given with no sound do."""
    from h3_core.clip_latents import encode_clip_frames

    frames = clip(60)[:, :64, :64]
    asked = []
    quiet = encode_clip_frames(*vaes, iter(frames), lambda seen: asked.append(seen))  # returns None
    assert asked == [60] and quiet.num_frames == 56
    expected = encode_clip(*vaes, frames, 24.0, 64, 64)
    assert torch.equal(quiet.video, expected.video) and torch.equal(quiet.audio, expected.audio)


def test_a_short_or_unreadable_file_is_refused_from_its_first_frames(tmp_path):
    from h3_core.media import MediaError
    from h3_core.media_write import write_mp4

    with pytest.raises(RequestError, match="needs at least 22 frames at 24 fps"):
        list(VaeClips(iter(clip(21))))
    path = tmp_path / "short.mp4"
    write_mp4(path, clip(20)[:, :96, :176])
    with pytest.raises(RequestError, match=r"short\.mp4: A clip to encode needs at least 22 frames .* has 20"):
        stream_clip(path, RELEASE_CANVAS)  # the file named (h3 encode said only "A clip to encode...")
    with pytest.raises(MediaError, match="no video frames at or after 5"):
        stream_clip(path, RELEASE_CANVAS, start_seconds=5.0)
    # cut short (a broken upload keeps its header's length): refused, not encoded as a shorter clip, unless the
    # part it uses is whole
    whole = tmp_path / "whole.mp4"
    write_mp4(whole, clip(120)[:, :96, :176])
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    assert stream_clip(whole, RELEASE_CANVAS)[1:] == stream_clip(cut, RELEASE_CANVAS, max_frames=22)[1:]
    with pytest.raises(MediaError, match=r"cut\.mp4 holds \d\.\d\d s of video, though its header says 5\.00 s"):
        stream_clip(cut, RELEASE_CANVAS)
    assert stream_clip(cut, RELEASE_CANVAS, start_seconds=0.5, max_frames=22)[1:] == (1376, 736)  # inside
    with pytest.raises(MediaError, match="the file is cut short or damaged"):  # the part from 2 s runs past the cut
        stream_clip(cut, RELEASE_CANVAS, start_seconds=2.0, max_frames=60)


def test_bad_clips_are_refused_before_a_vae_runs():
    with pytest.raises(RequestError, match="multiples of 32"):
        encode_clip(None, None, clip(30), 24.0, 200, 128)
    with pytest.raises(RequestError, match="uint8 RGB"):
        encode_clip(None, None, clip(30).astype(np.float32), 24.0, 224, 128)
    with pytest.raises(RequestError, match="frame rate must be a positive number"):
        encode_clip(None, None, clip(30), 0.0, 224, 128)
    with pytest.raises(RequestError, match="the clip's sound"):
        encode_clip(None, None, clip(30), 24.0, 224, 128, np.zeros((2, 100), np.float32), -1)


def test_cli_encodes_a_video_file_for_continue_from(tmp_path, capsys, vaes, monkeypatch):
    from safetensors.torch import load_file

    from h3_core import media_read
    from h3_core.cli import main
    from h3_core.media_read import read_video
    from h3_core.media_write import write_mp4

    path, out = tmp_path / "mine.mp4", tmp_path / "mine.safetensors"
    sound = (np.sin(np.arange(32000 * 3) / 7.0) * 0.3).astype(np.float32)[None].repeat(2, 0)
    write_mp4(path, clip(60, seed=3)[:, :96, :176], sound)
    decoded, encoded_after = [], []  # frames decoded from the file so far, when each 17-frame clip is encoded
    real_frames, real_encode = media_read.iter_video_frames, VideoVAE._encode_clip

    def counted_frames(*args, **kwargs):
        for frame in real_frames(*args, **kwargs):
            decoded.append(frame.shape)
            yield frame

    def logged_encode(self, pixels, tiled):
        encoded_after.append((len(decoded), tuple(pixels.shape[2:])))
        return real_encode(self, pixels, tiled)

    monkeypatch.setattr(media_read, "iter_video_frames", counted_frames)
    monkeypatch.setattr(VideoVAE, "_encode_clip", logged_encode)
    assert main(["encode", str(path), "--out", str(out), "--device", "cpu"]) == 0
    assert "mine.safetensors: 56 frames at 224x128" in capsys.readouterr().out  # 176x96 on the tiny canvas
    # streamed: each clip is encoded once 5 frames past it are decoded (so at most 22 are held); the kept
    # 56 = 3 x 17 + 5, the last 5 padded to 17 once the file ends; the 4 after them are dropped
    assert encoded_after == [(22 + 17 * k, (17, 128, 224)) for k in range(3)] + [(60, (17, 128, 224))]
    monkeypatch.undo()
    video = read_video(path)
    expected = encode_clip(*vaes, video.frames, 24.0, 224, 128, video.audio, 32000)
    saved = load_file(str(out))
    assert torch.equal(saved["video"], expected.video) and torch.equal(saved["audio"], expected.audio)
    from h3_core.pipeline import encode_clip_file

    steps = []
    encode_clip_file(path, "tiny-random", tmp_path / "again.safetensors", progress=lambda *step: steps.append(step))
    assert steps == [("encode", 17, 56), ("encode", 34, 56), ("encode", 51, 56), ("encode", 56, 56)]
    assert main(["encode", str(path), "--out", str(out), "--width", "224"]) == 2
    assert "Give width and height (--width, --height) together" in capsys.readouterr().err
    assert main(["encode", str(path), "--out", str(out), "--audio", str(tmp_path / "nope.wav")]) == 2
    assert f"--audio {tmp_path / 'nope.wav'}: no such file." in capsys.readouterr().err  # said no option


@pytest.mark.parametrize("start, max_frames", [(0.0, 10_000), (2.0, 10_000), (0.5, 60), (3.9, 10_000)])
def test_a_files_expected_clip_length_is_what_encoding_it_from_its_start_keeps(tmp_path, start, max_frames):
    """The progress bar's total and the memory placed before a file's encode: the frames kept from `start`."""
    from h3_core.clip_latents import expected_clip_frames
    from h3_core.media_write import write_mp4

    path = tmp_path / "five_seconds.mp4"
    write_mp4(path, clip(120)[:, :96, :176])
    frames, _, _ = stream_clip(path, RELEASE_CANVAS, 64, 64, max_frames, start)
    kept = sum(chunk.shape[0] for chunk in VaeClips(frames))
    assert expected_clip_frames(path, start, max_frames) == kept == {0.0: 107, 2.0: 56, 0.5: 56, 3.9: 22}[start]
