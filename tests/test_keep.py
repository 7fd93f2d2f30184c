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
from PIL import Image
from safetensors.torch import load_file

from test_long_video import PROMPT, STEPS, encode, models, spied_dit  # noqa: F401 (models is a fixture)

from h3_core import geometry, pipeline
from h3_core.conditioning import Conditioning, Request, RequestError
from h3_core.continuation import long_video_frames, mode_seconds
from h3_core.guides import GuideMedia
from h3_core.long_video import LongVideoRequest, encode_long_video, sample_long_video, validate_long_video
from h3_core.layout import GuideBlock, RowClock, build_t2va_layout, patchify
from h3_core.noise import request_generator
from h3_core.output import AVLatents
from h3_core.pipeline import TINY_CANVAS, sample
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
    sounding = dataclasses.replace(plain, guides=(GuideBlock(0, 2), GuideBlock(40, 0, 20)))  # as the layout sees them
    with pytest.raises(ValueError, match="Guide 2 holds a sound, but keep = audio"):
        sample(dit, sounding, 0, STEPS, init=clip, keep="audio")
    with pytest.raises(ValueError, match="Guide 1 holds a picture, but keep = video"):
        sample(dit, sounding, 0, STEPS, init=clip, keep="video")
    assert not spy.calls


def test_cli_makes_the_sound_for_an_encoded_clip(tmp_path, capsys, monkeypatch):
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

    picture = tmp_path / "still.png"
    Image.fromarray(frames[0]).save(picture)
    for name in ("load_text_encoder_for", "load_vaes", "load_sampling_dit"):  # each refused before any model
        monkeypatch.setattr(pipeline, name, lambda *a, **k: pytest.fail("a model was loaded"))
    for argv, message in (
        (["--keep", "video"], "--keep video|audio and --from LATENTS go together"),
        (["--keep", "audio", "--from", str(clip), "--long-video"], "--long-video --keep audio: .* --drive-audio FILE"),
        (["--keep", "video", "--from", str(clip), "--continue-from", str(clip)], "drop --continue-from"),
        (["--keep", "video", "--from", str(clip), "--duration", "8"], "canvas and length: drop --duration"),
        (["--keep", "audio", "--from", str(clip), "--height", "128"], "canvas and length: drop --height"),
        (["--keep", "audio", "--from", str(tmp_path / "none.safetensors")], "--from .*none.safetensors: no such file"),
        (["--keep", "video", "--from", str(clip), "--guide", f"10:image={picture}"],
         "Guide 1 holds a picture, but keep = video holds the given clip's video as it is; only sounds can guide it"),
    ):
        assert main(["generate", "--prompt", PROMPT, "--out", str(tmp_path / "x.mp4"), *argv]) == 2
        assert re.search(message, capsys.readouterr().err), message


def kept_clip(frames: int, seed: int = 0) -> AVLatents:
    """Random latents of a `frames`-frame clip on the tiny canvas (224x128: 8x14 latents)."""
    generator = torch.Generator().manual_seed(seed)
    return AVLatents(torch.randn(1, 24, geometry.latent_frames(frames), 8, 14, generator=generator),
                     torch.randn(2, 32, geometry.audio_latents(frames), generator=generator))


def encode_kept(models, clip: AVLatents, seconds=None, **options):
    request = LongVideoRequest(Request("t2va", PROMPT, duration=seconds), keep_video=clip, **options)
    return encode_long_video(request, models["text"], models["video"], models["audio"], rules=TINY_CANVAS)


def test_a_kept_clip_in_one_window_is_keep_video(models):
    """A 5 s clip kept the long-video way (one window) equals one request given the clip with keep="video"."""
    clip = kept_clip(124)
    conditioning = encode_kept(models, clip, mode="full")
    (window,) = conditioning.windows
    assert (conditioning.num_frames, conditioning.width, conditioning.height) == (124, 224, 128)
    got = sample_long_video(tiny_random_dit(), conditioning, 7, STEPS)
    plain = encode(models, seconds=5.0, mode="full").window(window, None)
    expected = sample(tiny_random_dit(), plain, 7, STEPS, init=clip, keep="video")
    assert torch.equal(got.video, clip.video) and torch.equal(got.audio, expected.audio)


def test_a_long_kept_clip_gets_its_sound_window_by_window(models):
    """20 s: windows [0, 277) and [255, 481). Each holds its slice of the clip as its last visual condition
    (window 2: [75, 142) of 142 latent frames, after the tail guide [75, 82)); the clip comes back as given and
    only the sound is new. A shorter duration keeps the clip's first seconds."""
    clip = kept_clip(481)
    conditioning = encode_kept(models, clip)
    first, second = conditioning.windows
    assert [(w.start, w.end) for w in conditioning.windows] == [(0, 277), (255, 481)]
    dit, spy = spied_dit()
    got = sample_long_video(dit, conditioning, 3, STEPS)
    assert torch.equal(got.video, clip.video) and got.check().num_frames == 481
    assert got.audio.shape == clip.audio.shape and not torch.equal(got.audio, clip.audio)
    assert len(spy.calls) == 2 * (STEPS - 1)

    window = conditioning.window(second, (clip.video[:, :, 75:82], got.audio[..., 425:462]))
    assert window.layout.locked_modality == "video" and window.layout.num_condition_audio_rows == 2 * 37
    assert torch.equal(window.visual_condition_latents[0], clip.video[:, :, 75:82])
    assert torch.equal(window.visual_condition_latents[-1], clip.video[:, :, 75:142])
    assert torch.equal(conditioning.kept_window(first), clip.video[:, :, :82])
    # window 2's video rows, all held: the tail guide and its slice, each mixed once to 0.999 z + 0.001 n with
    # the generator's next draws (window 1 drew for its slice, then its audio)
    generator, level = request_generator(3), torch.tensor(0.999)
    torch.randn(1, 24, 82, 8, 14, generator=generator), torch.randn(2 * 462, 32, generator=generator)
    tail, rest = (torch.randn(1, 24, count, 8, 14, generator=generator) for count in (7, 67))
    held = torch.cat([patchify(level * clip.video[:, :, 75:82] + (1 - level) * tail),
                      patchify(level * clip.video[:, :, 75:142] + (1 - level) * rest)], dim=1)
    assert torch.equal(spy.calls[STEPS - 1]["video_rows"], held)
    assert torch.equal(spy.calls[-1]["video_rows"], held)  # never written

    other = sample_long_video(tiny_random_dit(), encode_kept(models, dataclasses.replace(clip, video=-clip.video)), 3,
                              STEPS)
    assert not torch.equal(other.audio[..., 462:], got.audio[..., 462:])  # the sound follows the video

    shorter = encode_kept(models, clip, seconds=10.0)  # 243 frames: the clip's first 72 latent frames
    assert shorter.num_frames == 243 and torch.equal(shorter.kept_video, clip.video[:, :, :72])


def test_cli_makes_the_sound_for_a_long_clip_window_by_window(tmp_path, capsys):
    """h3 generate --long-video --keep video --from a 5 s clip in 107-frame windows ([0, 107), [85, 124)): the
    whole clip on its canvas, its video kept; a clip over 15 s without --long-video is sent there."""
    from h3_core.cli import main

    clip = tmp_path / "clip.safetensors"
    kept_clip(124).save(clip)
    latents = tmp_path / "sound.safetensors"
    assert main(["generate", "--prompt", PROMPT, "--long-video", "--window-frames", "107", "--keep", "video",
                 "--from", str(clip), "--steps", "3", "--device", "cpu", "--save-latents", str(latents)]) == 0
    saved, given = load_file(str(latents)), load_file(str(clip))
    assert torch.equal(saved["video"], given["video"]) and saved["audio"].shape == given["audio"].shape
    assert "124 frames" in capsys.readouterr().out

    kept_clip(481).save(tmp_path / "long.safetensors")
    # its first seconds, as H3 Continuation and LongVideoRequest keep them (the command refused --duration, though
    # a clip too long for full mode was told to ask for at most 30 s)
    first = tmp_path / "first.safetensors"
    assert main(["generate", "--prompt", PROMPT, "--long-video", "--window-frames", "107", "--keep", "video",
                 "--from", str(tmp_path / "long.safetensors"), "--duration", "5", "--steps", "2", "--device", "cpu",
                 "--save-latents", str(first)]) == 0
    saved, given = load_file(str(first)), load_file(str(tmp_path / "long.safetensors"))
    assert "124 frames" in capsys.readouterr().out
    assert torch.equal(saved["video"], given["video"][:, :, :saved["video"].shape[2]]) and saved["video"].shape[2] < \
        given["video"].shape[2]
    assert main(["generate", "--prompt", PROMPT, "--keep", "video", "--from", str(tmp_path / "long.safetensors"),
                 "--out", str(tmp_path / "x.mp4")]) == 2
    assert "the clip lasts 20.0 s; one request keeps 4-15 s. Add --long-video" in capsys.readouterr().err
    kept_clip(22).save(tmp_path / "short.safetensors")
    assert main(["generate", "--prompt", PROMPT, "--keep", "video", "--from", str(tmp_path / "short.safetensors"),
                 "--out", str(tmp_path / "x.mp4")]) == 2
    assert "short.safetensors: the clip lasts 0.92 s; one request keeps 4-15 s (a clip of 107" in capsys.readouterr().err


@pytest.mark.parametrize("seconds, options, message", [
    (25.0, {}, r"The kept clip lasts 481 frames \(20.04 s\); 25 s would need 600 frames"),
    (None, {"drive_audio": "song.wav"}, "cannot go with drive_audio"),
    (None, {"mode": "full"}, r"The kept clip lasts 753 frames \(31.38 s\); a full long video makes at most 736 frames "
                             r"\(30 s\): ask for at most 30 s to keep its first seconds, or use continuation "
                             r"mode\."),
    (None, {"frames": 56}, r"The kept clip lasts 56 frames \(2.33 s, as encoded: .*at least 107 frames \(4.46 s\)"),
    (None, {"guides": (GuideMedia(0, np.zeros((1, 128, 224, 3), np.uint8)),)}, "Guide 1 holds a picture, but the kept"),
])
def test_bad_kept_clips_fail_before_any_model(seconds, options, message):
    frames = options.pop("frames", 481)
    clip = kept_clip(frames) if "mode" not in options else AVLatents(torch.zeros(1, 24, 5 * 44 + 2, 8, 14),
                                                                   torch.zeros(2, 32, geometry.audio_latents(753)))
    request = LongVideoRequest(Request("t2va", PROMPT, duration=seconds), keep_video=clip, **options)
    with pytest.raises(RequestError, match=message):
        validate_long_video(request, TINY_CANVAS)
    sized = LongVideoRequest(Request("t2va", PROMPT, aspect_ratio="16:9"), keep_video=kept_clip(124))
    with pytest.raises(RequestError, match="A kept clip keeps its canvas, 224x128; this request asks for 16:9"):
        validate_long_video(sized, TINY_CANVAS)
    sound = GuideMedia(240, waveform=np.zeros((2, 32000), np.float32), sample_rate=32000)
    validate_long_video(LongVideoRequest(Request("t2va", PROMPT), keep_video=kept_clip(481), guides=(sound,)),
                        TINY_CANVAS)  # a sound may guide a kept clip


@pytest.mark.parametrize("mode, frames", [("full", 736), ("continuation", 7213)])
def test_a_clip_made_at_the_longest_duration_can_be_kept_whole(mode, frames):
    """`--duration 300` (or 30 s in full mode) makes 7213 (736) frames, 300.54 (30.67) s on the 17n + 5 grid: kept
    whole again (no duration), it is counted in frames, not refused for its seconds."""
    clip = kept_clip(frames)
    assert long_video_frames(mode_seconds(mode), mode) == frames
    plan = validate_long_video(LongVideoRequest(Request("t2va", PROMPT), mode=mode, keep_video=clip), TINY_CANVAS)
    assert plan.num_frames == frames


def test_a_duration_of_the_kept_clips_own_length_keeps_it_all():
    """20 s is the 481-frame clip's own length on the 17n + 5 grid: kept whole. A duration past the clip is refused
    (20.75 s would need 498 frames)."""
    plan = validate_long_video(LongVideoRequest(Request("t2va", PROMPT, duration=20.0), keep_video=kept_clip(481)),
                               TINY_CANVAS)
    assert plan.num_frames == 481
    with pytest.raises(RequestError, match=r"The kept clip lasts 481 frames \(20.04 s\); 20.75 s would need 498"):
        validate_long_video(LongVideoRequest(Request("t2va", PROMPT, duration=20.75), keep_video=kept_clip(481)),
                            TINY_CANVAS)
