"""A clip you have as H3 latents (clip_latents.py): the frames go through the same recipe as a guide clip,
the sound as a driving track, and the result continues like any sampled clip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from h3_core.clip_latents import clip_frame_count, encode_clip
from h3_core.conditioning import RequestError
from h3_core.drive_audio import encode_track, load_track
from h3_core.references import DecodedAudio, cover_crop, encode_video, frames_at_24fps
from h3_core.tiny import tiny_random_audio_vae, tiny_random_video_vae


@pytest.fixture(scope="module")
def vaes():
    return tiny_random_video_vae(), tiny_random_audio_vae()


def clip(frames: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (frames, 100, 180, 3), dtype=np.uint8)


def test_frames_are_encoded_as_a_guide_clip_and_the_sound_as_a_driving_track(vaes):
    video_vae, audio_vae = vaes
    frames = clip(75)  # 2.5 s at 30 fps: 60 frames at 24 fps, cut to 56
    sound = np.random.default_rng(1).standard_normal((1, 44100 * 3)).astype(np.float32) * 0.1
    latents = encode_clip(video_vae, audio_vae, frames, 30.0, 224, 128, sound, 44100)
    assert latents.num_frames == 56 and latents.video.shape == (1, 24, 17, 8, 14)
    fitted = np.stack([np.asarray(cover_crop(Image.fromarray(f), 224, 128)) for f in frames_at_24fps(frames, 30.0)[:56]])
    assert torch.equal(latents.video, encode_video(video_vae, fitted))
    assert torch.equal(latents.audio, encode_track(audio_vae, load_track(DecodedAudio(sound, 44100)), 56))
    quiet = encode_clip(video_vae, audio_vae, frames, 30.0, 224, 128)
    silence = encode_track(audio_vae, torch.zeros(2, 32000 * 3), 56)
    assert torch.equal(quiet.video, latents.video) and torch.equal(quiet.audio, silence)


def test_clip_lengths_snap_down_to_17n_plus_5():
    assert [clip_frame_count(n, 24.0) for n in (22, 38, 39, 124, 130)] == [22, 22, 39, 124, 124]
    assert clip_frame_count(300, 60.0) == 107  # 120 frames at 24 fps
    with pytest.raises(RequestError, match="needs at least 22 frames at 24 fps .* has 21 \\(21 at 24 fps\\)"):
        clip_frame_count(21, 24.0)


def test_bad_clips_are_refused_before_a_vae_runs():
    with pytest.raises(RequestError, match="multiples of 32"):
        encode_clip(None, None, clip(30), 24.0, 200, 128)
    with pytest.raises(RequestError, match="uint8 RGB"):
        encode_clip(None, None, clip(30).astype(np.float32), 24.0, 224, 128)
    with pytest.raises(RequestError, match="frame rate must be positive"):
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
    held = []  # the frames the command keeps in memory: cropped onto the canvas as they were decoded
    monkeypatch.setattr(media_read, "read_video", lambda *a, **k: held.append(read_video(*a, **k)) or held[-1])
    assert main(["encode", str(path), "--out", str(out), "--device", "cpu"]) == 0
    assert "mine.safetensors: 56 frames at 224x128" in capsys.readouterr().out  # 176x96 on the tiny canvas
    assert [c.frames.shape for c in held] == [(60, 128, 224, 3)]
    monkeypatch.undo()
    video = read_video(path)
    expected = encode_clip(*vaes, video.frames, 24.0, 224, 128, video.audio, 32000)
    saved = load_file(str(out))
    assert torch.equal(saved["video"], expected.video) and torch.equal(saved["audio"], expected.audio)
    assert main(["encode", str(path), "--out", str(out), "--width", "224"]) == 2
    assert "width and height together" in capsys.readouterr().err
