"""Holding one modality of a given clip while the other is generated (`pipeline.sample(..., keep=)`):
the sound for a video (keep="video") and a video to a sound (keep="audio", what a driving track does).

keep="audio" is checked against the driving-track path (long_video's drive audio, one window), which holds
the target audio at t = 1 as vLLM-Omni's lock_source does; keep="video" against h3-model.md A.5's rule for
visual conditioning rows: mixed once to 0.999 * z + 0.001 * noise and clocked at max(t_video, 0.999)."""

import dataclasses
import re

import numpy as np
import pytest
import torch

from test_long_video import PROMPT, STEPS, encode, models, spied_dit  # noqa: F401 (models is a fixture)

from h3_core.conditioning import Conditioning
from h3_core.layout import RowClock, build_t2va_layout, patchify
from h3_core.noise import request_generator
from h3_core.output import AVLatents
from h3_core.pipeline import sample
from h3_core.references import DecodedAudio
from h3_core.sampler import DualClockSchedule
from h3_core.tiny import tiny_random_dit


def track(seconds: float) -> DecodedAudio:
    time = torch.arange(int(32000 * seconds)) / 32000
    return DecodedAudio(torch.stack([torch.sin(2 * np.pi * 220 * time), torch.sin(2 * np.pi * 330 * time)]), 32000)


def test_a_locked_layout_moves_only_the_target_rows_clock_and_count():
    """What a driving track's window holds (tests/test_long_video_layout.py::test_locked_audio_is_held_at_t1):
    the target audio at AUDIO_CONDITION and counted as conditioning; every other field as before."""
    tags = torch.tensor([1, 1, 0, 0, 1])
    plain = build_t2va_layout(tags, 12, 4, 6, 70)
    locked = plain.locked("audio")
    expected_clock = plain.row_clock.clone()
    expected_clock[plain.audio_indices] = RowClock.AUDIO_CONDITION
    expected = dataclasses.replace(plain, row_clock=expected_clock, num_condition_audio_rows=140)
    for field in dataclasses.fields(expected):
        mine, theirs = getattr(locked, field.name), getattr(expected, field.name)
        assert torch.equal(mine, theirs) if isinstance(mine, torch.Tensor) else mine == theirs, field.name
    assert (plain.locked_modality, locked.locked_modality) == (None, "audio")

    video = plain.locked("video")
    assert video.locked_modality == "video" and video.num_condition_video_rows == plain.video_indices.numel()
    assert bool((video.row_clock[plain.video_indices] == RowClock.VISUAL_CONDITION).all())
    assert torch.equal(video.row_clock[plain.audio_indices], plain.row_clock[plain.audio_indices])
    assert torch.equal(video.position_ids, plain.position_ids) and torch.equal(video.token_tags, plain.token_tags)
    with pytest.raises(ValueError, match="'video' or 'audio'"):
        plain.locked("text")


def test_keep_audio_is_the_driving_track(models):
    """One 5 s window driven by a track, sampled the long-video way, equals a plain request given the track's
    latents with keep="audio": same rows, same noise, same result."""
    driven = encode(models, seconds=5.0, mode="full", drive_audio=track(6))
    (window,) = driven.windows
    expected = sample(tiny_random_dit(), driven.window(window, None), request_generator(3), STEPS)
    states, tags = driven.texts[0]
    plain = Conditioning("t2va", driven.width, driven.height, window.frames,
                         build_t2va_layout(tags, window.latent_frames, 8, 14, window.audio_latents), states, tags, [],
                         torch.zeros(1, 0, 32))
    given = AVLatents(torch.randn(1, 24, window.latent_frames, 8, 14), driven.drive_audio)
    got = sample(tiny_random_dit(), plain, 3, STEPS, init=given, keep="audio")
    assert torch.equal(got.video, expected.video) and torch.equal(got.audio, driven.drive_audio)
    free = sample(tiny_random_dit(), plain, 3, STEPS)
    assert not torch.equal(free.video, got.video)  # the track steers the video


def test_keep_video_holds_the_clip_as_a_visual_condition_and_makes_its_sound(models):
    conditioning = encode(models, seconds=5.0, mode="full")
    (window,) = conditioning.windows
    plain = conditioning.window(window, None)
    clip = AVLatents(torch.randn(1, 24, window.latent_frames, 8, 14), torch.randn(2, 32, window.audio_latents))
    dit, spy = spied_dit()
    got = sample(dit, plain, 7, STEPS, init=clip, keep="video")
    assert torch.equal(got.video, clip.video)  # returned as given
    assert got.audio.shape == clip.audio.shape and not torch.equal(got.audio, clip.audio)  # made from noise

    # the rows: the clip mixed once to 0.999 z + 0.001 n with the generator's first draw, then audio noise
    generator = request_generator(7)
    first = torch.randn(clip.video.shape, generator=generator)
    level = torch.tensor(0.999)
    held = patchify(level * clip.video + (1 - level) * first)
    audio_noise = torch.randn(2 * window.audio_latents, 32, generator=generator)
    assert torch.equal(spy.calls[0]["video_rows"], held)
    assert torch.equal(spy.calls[0]["audio_rows"], audio_noise[None])
    schedule = DualClockSchedule.build(STEPS)
    layout = plain.layout
    for step, call in enumerate(spy.calls):  # video rows never written, at max(t_video, 0.999) every step
        assert torch.equal(call["video_rows"], held)
        t_video, t_audio = (float(t) for t in schedule.timesteps(step))
        per_row = call["timesteps"][call["timestep_indices"]]
        assert bool((per_row[layout.video_indices] == max(t_video, 0.999)).all())
        assert bool((per_row[layout.text_indices] == torch.tensor(t_video)).all())
        assert bool((per_row[layout.audio_indices] == torch.tensor(t_audio)).all())

    other = sample(tiny_random_dit(), plain, 7, STEPS, init=dataclasses.replace(clip, video=-clip.video), keep="video")
    assert not torch.equal(other.audio, got.audio)  # the sound follows the video


def test_keep_is_checked_before_the_model_runs(models):
    conditioning = encode(models, seconds=5.0, mode="full")
    (window,) = conditioning.windows
    plain = conditioning.window(window, None)
    dit, spy = spied_dit()
    clip = AVLatents(torch.randn(1, 24, window.latent_frames, 8, 14), torch.randn(2, 32, window.audio_latents))
    with pytest.raises(ValueError, match="pass init"):
        sample(dit, plain, 0, STEPS, keep="video")
    with pytest.raises(ValueError, match="'video' or 'audio'"):
        sample(dit, plain, 0, STEPS, init=clip, keep="both")
    with pytest.raises(ValueError, match=r"\(frames, height, width, audio\) latents \(7, 8, 14, 37\)"):
        sample(dit, plain, 0, STEPS, init=AVLatents(clip.video[:, :, :7], clip.audio[..., :37]), keep="video")
    driven = encode(models, seconds=5.0, mode="full", drive_audio=track(6))
    with pytest.raises(ValueError, match="already holds its audio fixed"):
        sample(dit, driven.window(window, None), 0, STEPS, init=clip, keep="video")
    assert not spy.calls


def test_cli_makes_the_sound_for_an_encoded_clip(tmp_path, capsys):
    """h3 encode a clip, then h3 generate --keep video --from it: the saved video latents are the clip's, the
    request takes the clip's canvas and length, and the MP4 has its frames with a new soundtrack."""
    import av
    from safetensors.torch import load_file

    from h3_core.cli import main
    from h3_core.media_write import write_mp4

    frames = np.random.default_rng(1).integers(0, 256, (110, 96, 176, 3), dtype=np.uint8)
    write_mp4(tmp_path / "clip.mp4", frames, np.zeros((2, 32000 * 5), np.float32))
    clip = tmp_path / "clip.safetensors"
    assert main(["encode", str(tmp_path / "clip.mp4"), "--out", str(clip), "--device", "cpu"]) == 0
    out, latents = tmp_path / "sound.mp4", tmp_path / "sound.safetensors"
    assert main(["generate", "--prompt", PROMPT, "--keep", "video", "--from", str(clip), "--steps", "3",
                 "--device", "cpu", "--out", str(out), "--save-latents", str(latents)]) == 0
    saved, given = load_file(str(latents)), load_file(str(clip))
    assert torch.equal(saved["video"], given["video"]) and not torch.equal(saved["audio"], given["audio"])
    assert "107 frames" in capsys.readouterr().out
    with av.open(str(out)) as container:
        assert sum(1 for _ in container.decode(video=0)) == 107 and container.streams.audio

    for argv, message in (
        (["--keep", "video"], "--keep video|audio and --from LATENTS go together"),
        (["--keep", "audio", "--from", str(clip), "--long-video"], "drop --long-video"),
        (["--keep", "audio", "--from", str(tmp_path / "none.safetensors")], "--from .*none.safetensors: no such file"),
    ):
        assert main(["generate", "--prompt", PROMPT, "--out", str(tmp_path / "x.mp4"), *argv]) == 2
        assert re.search(message, capsys.readouterr().err), message
