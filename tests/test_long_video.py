"""Long video on the tiny-random models (h3-model.md G): a 20 s clip in continuation and full mode, the
rows the denoiser sees, window prompts, driving audio, `h3 generate --long-video` and its errors.

20 s -> 481 frames -> windows [0, 277) and [255, 481) on the tiny canvas (224x128); 3 sigma points
(2 model calls a window) keep every run to about a second.
"""

import re

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from wav_files import write_wav

from h3_core import geometry, pipeline
from h3_core.cli import main
from h3_core.conditioning import Request, RequestError, encode_request
from h3_core.drive_audio import encode_track, load_track
from h3_core.guides import GuideMedia
from h3_core.layout import build_window_layout, pack_audio, patchify
from h3_core.long_video import LongVideoRequest, encode_long_video, sample_long_video, validate_long_video
from h3_core.output import AVLatents
from h3_core.pipeline import TINY_CANVAS, sample
from h3_core.references import DecodedAudio, DecodedVideo
from h3_core.tiny import tiny_random_audio_vae, tiny_random_dit, tiny_random_video_vae
from h3_core.tiny_text import tiny_random_text_encoder

STEPS = 3
PROMPT = "A red fox trots along a beach at sunset; waves crash softly and gulls call."


@pytest.fixture(scope="module")
def models():
    return {"text": tiny_random_text_encoder(), "video": tiny_random_video_vae(), "audio": tiny_random_audio_vae()}


def encode(models, task="t2va", seconds=20.0, references=(), **options):
    request = LongVideoRequest(Request(task, PROMPT, references=list(references), duration=seconds), **options)
    return encode_long_video(request, models["text"], models["video"], models["audio"], rules=TINY_CANVAS)


class Spy:
    """Stands in for the DiT's forward and keeps what each call received."""

    def __init__(self, dit):
        self.forward, self.calls = dit.forward, []

    def __call__(self, **inputs):
        self.calls.append({name: value.clone() if isinstance(value, torch.Tensor) else value
                           for name, value in inputs.items()})
        return self.forward(**inputs)


def spied_dit():
    dit = tiny_random_dit()
    spy = Spy(dit)
    dit.forward = spy
    return dit, spy


def test_twenty_seconds_is_deterministic_for_a_seed(models):
    conditioning = encode(models)
    assert [(w.start, w.end) for w in conditioning.windows] == [(0, 277), (255, 481)]
    dit = tiny_random_dit()
    first = sample_long_video(dit, conditioning, seed=5, steps=STEPS)
    again = sample_long_video(dit, conditioning, seed=5, steps=STEPS)
    other = sample_long_video(dit, conditioning, seed=6, steps=STEPS)
    # 481 frames: 142 latent frames of 8x14, 802 audio latents per channel
    assert first.video.shape == (1, 24, 142, 8, 14) and first.audio.shape == (2, 32, 802)
    assert first.check().num_frames == 481
    assert torch.equal(first.video, again.video) and torch.equal(first.audio, again.audio)
    assert not torch.equal(first.video, other.video)


def test_the_first_window_is_an_ordinary_request(models):
    """Window 1 draws first from the request generator, so it is the plain 277-frame request; window 2
    adds only its new frames: 82 + (67 - 7) = 142 latent frames, 462 + (376 - 37) = 802 audio latents."""
    conditioning = encode(models)
    dit = tiny_random_dit()
    whole = sample_long_video(dit, conditioning, seed=9, steps=STEPS)
    plain = encode_request(Request("t2va", PROMPT, num_frames=277), models["text"], rules=TINY_CANVAS)
    alone = sample(dit, plain, 9, STEPS)
    assert torch.equal(whole.video[:, :, :82], alone.video) and torch.equal(whole.audio[..., :462], alone.audio)


def test_each_windows_preview_estimates_its_own_frames(models):
    """Steps count over both windows, and each step's clean estimate (a preview) is of the window being made:
    at a window's last step its middle frame as the result holds it (window 1: frame 41 of 82; window 2: 33
    of its 67, after the 7 overlap frames dropped, so 82 + 26 of the clip)."""
    conditioning = encode(models)
    states = []
    latents = sample_long_video(tiny_random_dit(), conditioning, 5, STEPS, callback=lambda state: states.append(
        (state.step, state.total, state.video_estimate_frame())))
    assert [(step, total) for step, total, _ in states] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert torch.allclose(states[1][2], latents.video[0, :, 41], atol=1e-6)
    assert torch.allclose(states[3][2], latents.video[0, :, 82 + 26], atol=1e-6)


def test_full_mode_is_one_window(models):
    dit, spy = spied_dit()
    ten = encode(models, seconds=10, mode="full")
    plain = encode_request(Request("t2va", PROMPT, duration=10), models["text"], rules=TINY_CANVAS)
    long, short = sample_long_video(dit, ten, seed=2, steps=STEPS), sample(dit, plain, 2, STEPS)
    assert torch.equal(long.video, short.video) and torch.equal(long.audio, short.audio)
    spy.calls.clear()
    twenty = encode(models, mode="full")
    assert [(w.start, w.end) for w in twenty.windows] == [(0, 481)]
    latents = sample_long_video(dit, twenty, seed=2, steps=STEPS)
    assert latents.video.shape[2] == 142 and latents.audio.shape[2] == 802
    assert [call["position_ids"].shape[0] for call in spy.calls] == [twenty.max_rows] * (STEPS - 1)


def test_the_denoiser_sees_one_window_at_a_time(models):
    conditioning = encode(models, seconds=40)  # 961 frames: windows at 0, 255, 510, 765
    assert [w.start for w in conditioning.windows] == [0, 255, 510, 765]
    dit, spy = spied_dit()
    timeline_parts = []
    latents = sample_long_video(dit, conditioning, seed=1, steps=STEPS,
                                callback=lambda state: timeline_parts.append((state.step, state.total)))
    assert timeline_parts == [(i, 8) for i in range(1, 9)]  # steps counted over all windows
    calls = spy.calls
    assert len(calls) == 4 * (STEPS - 1)
    expected = [conditioning.window_layout(w) for w in conditioning.windows for _ in range(STEPS - 1)]
    for call, layout in zip(calls, expected, strict=True):
        rows = call["position_ids"].shape[0]
        assert rows == layout.sequence_length <= conditioning.max_rows
        assert torch.equal(call["position_ids"], layout.position_ids)
        assert call["video_rows"].shape[1] + call["audio_rows"].shape[1] + call["text_states"].shape[1] == rows
    whole = build_window_layout(conditioning.texts[0][1], (), 282, 8, 14, 1602)  # all 961 frames at once
    assert conditioning.max_rows == expected[2].sequence_length < whole.sequence_length / 3

    # the guide of window k is the tail of the clip so far (a prefix of the result): the video mixed once to
    # 0.999 with one noise draw, the audio clean
    for window in conditioning.windows[1:]:
        call = calls[window.index * (STEPS - 1)]
        so_far = window.start + window.overlap
        video_end, audio_end = geometry.latent_frames(so_far), round(so_far * 5 / 3)
        tail_video = latents.video[:, :, video_end - window.guide_latent_frames : video_end]
        tail_audio = latents.audio[..., audio_end - window.guide_audio_latents : audio_end]
        held = call["video_rows"][:, : window.guide_latent_frames * 28]
        assert_held_once_noised(held, patchify(tail_video))
        assert torch.equal(call["audio_rows"][:, : 2 * window.guide_audio_latents], pack_audio(tail_audio[None]))


def assert_held_once_noised(held, clean):
    """Held rows are 0.999 * clean + 0.001 * n for one standard normal draw n: what is left once the clean part
    is taken out, scaled back, must look like such a draw (neither zero, as unmixed rows give, nor the clean
    rows' size, as another level gives)."""
    noise = (held - 0.999 * clean) / 0.001
    assert abs(noise.mean().item()) < 0.1 and 0.9 < noise.std().item() < 1.1


def test_window_prompts_each_encode_with_one_media_clock(models):
    conditioning = encode(models, window_prompts=["A fox on a beach.", PROMPT])
    (short, short_tags), (long, long_tags) = conditioning.texts
    assert short.shape[1] < long.shape[1] and conditioning.media_origin == float(long.shape[1])
    first = conditioning.window_layout(conditioning.windows[0])
    assert first.num_text_rows == short.shape[1]
    assert first.position_ids[first.target_video_indices[0], 0].item() == long.shape[1]
    latents = sample_long_video(tiny_random_dit(), conditioning, seed=0, steps=STEPS)
    assert latents.video.shape[2] == 142
    same = encode(models, window_prompts=[PROMPT, PROMPT])
    assert same.texts[0][0] is same.texts[1][0]  # one prompt is encoded once


def test_a_window_prompt_encodes_as_its_own_request_would(models):
    """A later window's prompt goes through the same presentation (its labels, the references shown as the first
    window shows them) and encoder as a request of that prompt alone: the same text states and tags."""
    image = Image.fromarray(np.full((96, 160, 3), (200, 120, 40), np.uint8))
    conditioning = encode(models, task="ref2va", references=[("image", image)],
                          window_prompts=["<Picture 1> on a beach.", "A fox beside <Picture 1> as the sun sets."])
    for (states, tags), prompt in zip(conditioning.texts, ["<Picture 1> on a beach.",
                                                            "A fox beside <Picture 1> as the sun sets."]):
        alone = encode_request(Request("ref2va", prompt, references=[("image", image)], num_frames=277), models["text"],
                               models["video"], rules=TINY_CANVAS)
        assert torch.equal(states, alone.text_states) and torch.equal(tags, alone.text_tags)
    assert conditioning.texts[0][0].shape != conditioning.texts[1][0].shape  # two prompts, each its own states


def test_an_interrupt_is_heard_inside_a_video_reference(models, monkeypatch):
    """A video reference (up to 15 s: 362 frames) is encoded clip by clip; a host's stop was heard only after all
    of them."""
    class Stop(Exception):
        pass

    vae, clips = models["video"], []
    real = vae._encode_clip
    monkeypatch.setattr(vae, "_encode_clip", lambda *a, **k: clips.append(1) or real(*a, **k))

    def on_stage(done, total):
        if clips:  # pressed while the reference's first 17 frames encode
            raise Stop

    video = DecodedVideo(np.full((56, 64, 96, 3), 90, np.uint8), 24.0)
    with pytest.raises(Stop):
        encode_request(Request("ref2va", "<Video 1> on a beach.", references=[("video", video)], duration=4),
                       models["text"], vae, models["audio"], rules=TINY_CANVAS, on_stage=on_stage)
    assert len(clips) == 1  # of the reference's 4


def test_drive_audio_is_held_and_returned(models):
    seconds = torch.arange(32000 * 21) / 32000
    track = DecodedAudio(torch.stack([torch.sin(2 * np.pi * 220 * seconds), torch.sin(2 * np.pi * 110 * seconds)]),
                         32000)
    conditioning = encode(models, drive_audio=track)
    expected = conditioning.drive_audio  # encode_track (tests/test_long_video_audio.py) of the whole track
    assert expected.shape == (2, 32, 802)
    dit, spy = spied_dit()
    latents = sample_long_video(dit, conditioning, seed=4, steps=STEPS)
    assert torch.equal(latents.audio, expected)  # the output soundtrack is the track's latents
    for window in conditioning.windows:
        calls = spy.calls[window.index * (STEPS - 1) : (window.index + 1) * (STEPS - 1)]
        layout = conditioning.window_layout(window)
        held = 2 * window.guide_audio_latents
        for call in calls:  # the target audio rows are the track's slice, at t = 1, every step
            target = call["audio_rows"][:, held:]
            first = round(window.start * 5 / 3)
            assert torch.equal(target, pack_audio(expected[..., first : first + window.audio_latents][None]))
            assert bool((call["timesteps"][call["timestep_indices"][layout.audio_indices]] == 1.0).all())


def test_ref2va_references_stay_in_every_window(models):
    image = Image.fromarray(np.full((96, 160, 3), (200, 120, 40), np.uint8))
    conditioning = encode(models, task="ref2va", references=[("image", image)])
    assert len(conditioning.visual_references) == 1
    layouts = [conditioning.window_layout(w) for w in conditioning.windows]
    for layout, window in zip(layouts, conditioning.windows):
        image_rows = layout.video_indices[window.guide_latent_frames * 28 : layout.num_condition_video_rows]
        assert bool((layout.position_ids[image_rows, 0] == conditioning.media_origin).all())  # never moved
    latents = sample_long_video(tiny_random_dit(), conditioning, seed=0, steps=STEPS)
    assert latents.video.shape[2] == 142


@pytest.mark.parametrize("task, seconds, options, message", [
    ("fl2va", 20, {}, "t2va or ref2va"),
    ("t2va", 301, {}, "up to 300 s"),
    ("t2va", 31, {"mode": "full"}, "up to 30 s"),
    ("t2va", 3, {}, "4 s up to"),
    ("t2va", 20, {"mode": "loop"}, "continuation, full"),
    ("t2va", 20, {"window_frames": 276}, "17n \\+ 5"),
    ("t2va", 20, {"window_frames": 362}, "107-345"),
    ("t2va", 20, {"overlap_frames": 277}, "shorter than the window"),
    ("t2va", 20, {"window_prompts": ["one"]},
     "has 2 window\\(s\\) \\(starting at 0 \\(0.0 s\\), 255 \\(10.6 s\\)\\), got 1 prompt\\(s\\): 'one'\\."),
    ("t2va", 20, {"window_prompts": ["one", " "]}, "Window prompt 2 is empty"),
    ("t2va", 20, {"window_prompts": ["one", "\u200b\ufeff"]}, "Window prompt 2 is empty"),  # invisible only
    ("t2va", 20, {"window_prompts": ["one", "a <|image_pad|> cat"]},  # was found only after the models loaded
     r"Window prompt 2 holds <\|image_pad\|>, the text encoder's own markers"),
    ("t2va", 20, {"drive_audio": "/nonexistent/track.wav"}, "does not exist"),
])
def test_bad_long_requests_fail_before_any_model(task, seconds, options, message):
    request = LongVideoRequest(Request(task, PROMPT, duration=seconds), **options)
    with pytest.raises(RequestError, match=message):
        validate_long_video(request, TINY_CANVAS)


@pytest.mark.parametrize("guide, message", [
    (GuideMedia(300, Image.new("RGB", (96, 64), "teal")), "Guide frames are encoded with the video VAE, and none"),
    (GuideMedia(300, waveform=np.zeros((2, 32000), np.float32), sample_rate=32000),
     "A guide sound is encoded with the audio VAE, and none"),
])
def test_a_guide_without_its_vae_is_refused_before_the_text_encoder(models, monkeypatch, guide, message):
    """Guides were encoded after every prompt: a missing VAE was said only once the text encoder had run."""
    monkeypatch.setattr(models["text"], "encode", lambda *a, **k: pytest.fail("the text encoder ran"))
    request = LongVideoRequest(Request("t2va", PROMPT, duration=20.0), guides=[guide])
    vaes = (None, models["audio"]) if guide.frames is not None else (models["video"], None)
    with pytest.raises(RequestError, match=message):
        encode_long_video(request, models["text"], *vaes, rules=TINY_CANVAS)


def test_an_interrupt_is_heard_between_guide_encodes(models, monkeypatch):
    """Each guide clip is a VAE run of up to 362 frames; the host's check ran once before all of them."""
    from h3_core import window_guides

    class Stop(Exception):
        pass

    encodes, real = [], window_guides.encode_guide
    monkeypatch.setattr(window_guides, "encode_guide", lambda *a, **k: encodes.append(1) or real(*a, **k))

    def between_calls():
        if encodes:  # an interrupt pressed while the first guide encodes
            raise Stop

    guides = [GuideMedia(frame, Image.new("RGB", (96, 64), "teal")) for frame in (100, 300, 400)]
    request = LongVideoRequest(Request("t2va", PROMPT, duration=20.0), guides=guides)
    with pytest.raises(Stop):
        encode_long_video(request, models["text"], models["video"], models["audio"], rules=TINY_CANVAS,
                          between_calls=between_calls)
    assert len(encodes) == 1


def test_the_encode_of_a_long_video_reports_each_prompt_track_and_guide(models):
    """H3 Continuation and h3 generate --long-video showed no progress while every window prompt, the driving
    track and each guide encoded (tens of prompts for a long video; found by the progress review)."""
    stages = []
    track = DecodedAudio(np.zeros((2, 32000 * 20), np.float32), 32000)
    request = LongVideoRequest(Request("t2va", "", duration=20.0), window_prompts=["A fox.", "A cat."],
                               drive_audio=track, guides=[GuideMedia(100, Image.new("RGB", (96, 64), "teal"))])
    encode_long_video(request, models["text"], models["video"], models["audio"], rules=TINY_CANVAS,
                      on_stage=lambda done, total: stages.append((done, total)))
    first = stages[0][1]  # the total, from the first report on
    assert first == 2 * models["text"].layer + 2  # each window prompt's text encoder layers, the track, the guide
    # after the first window's request: the second window's prompt, the driving track, the guide
    assert stages[-3:] == [(first - 2, first), (first - 1, first), (first, first)]
    assert {total for _, total in stages} == {first} and [done for done, _ in stages] == sorted(d for d, _ in stages)
    assert sorted({done for done, _ in stages}) == list(range(first + 1))  # a step per layer: no prompt a jump


def test_an_interrupt_is_heard_inside_a_guide_clip(models, monkeypatch):
    """A guide clip's encode (up to 362 frames) is heard between its 17-frame clips, not only before it."""
    class Stop(Exception):
        pass

    vae, clips = models["video"], []
    real = vae._encode_clip
    monkeypatch.setattr(vae, "_encode_clip", lambda *a, **k: clips.append(1) or real(*a, **k))

    def between_calls():
        if clips:  # pressed while the guide's first 17 frames encode
            raise Stop

    frames = np.full((56, 64, 96, 3), 90, np.uint8)
    request = LongVideoRequest(Request("t2va", PROMPT, duration=20.0), guides=[GuideMedia(100, frames)])
    with pytest.raises(Stop):
        encode_long_video(request, models["text"], vae, models["audio"], rules=TINY_CANVAS,
                          between_calls=between_calls)
    assert len(clips) == 1  # of the clip's 4


def test_generate_decodes_the_whole_clip_once(tmp_path, monkeypatch):
    decoded = []
    monkeypatch.setattr(pipeline, "write_mp4", lambda path, latents, *a, **k: decoded.append(latents.num_frames))
    request = LongVideoRequest(Request("t2va", PROMPT, duration=20))
    (result,) = pipeline.generate(request, "tiny-random", pipeline.GenerateSettings(steps=STEPS), out=tmp_path / "a.mp4")
    assert decoded == [481] and result.latents.num_frames == 481


def test_cli_long_video_with_window_prompts_and_drive_audio(tmp_path, capsys):
    write_wav(tmp_path / "track.wav", 12.0)  # shorter than the clip: padded with silence
    out = tmp_path / "long.safetensors"
    # as the README writes it: window prompts and no --prompt
    argv = ["generate", "--device", "cpu", "--long-video", "--duration", "20", "--steps", str(STEPS),
            "--window-prompt", "A fox walks.", "--window-prompt", "The fox runs.", "--drive-audio",
            str(tmp_path / "track.wav"), "--save-latents", str(out)]
    assert main(argv) == 0
    tensors = load_file(str(out))
    assert tensors["video"].shape == (1, 24, 142, 8, 14)
    expected = encode_track(tiny_random_audio_vae(), load_track(tmp_path / "track.wav"), 481)
    assert torch.equal(tensors["audio"], expected)
    said = capsys.readouterr()
    assert re.search(r"long.safetensors: t2va, seed 0, 481 frames", said.out)
    # its track cannot go with --continue-from: the clip saved after window 1 is not offered to continue
    assert (f"windows 1-1 of 2 saved to {out} (a run that holds its sound or video fixed cannot be continued: were "
            "it to stop, run it again)") in said.err


def test_a_driving_track_without_a_duration_sets_the_clip_length(tmp_path, capsys):
    """No duration with a driving track: the clip lasts as long as the track (the most 17n + 5 frames within it,
    what is left over cut rather than padded with silence); a duration still cuts or pads it."""
    from h3_core.drive_audio import track_frames
    from h3_core.long_video import covers_track

    def plan(track, mode="continuation", duration=None):
        request = LongVideoRequest(Request("t2va", PROMPT, duration=duration), mode, drive_audio=track)
        return validate_long_video(request, TINY_CANVAS)

    rate = 32000
    assert track_frames(DecodedAudio(torch.zeros(2, 142667), rate), 7213) == 107  # 107 frames and a sample
    assert track_frames(DecodedAudio(torch.zeros(2, 142666), rate), 7213) == 90
    assert track_frames(DecodedAudio(torch.zeros(1, 4 * 8000), 8000), 7213) == 90  # mono, another rate: 4 s
    assert track_frames(DecodedAudio(torch.zeros(2, 29334), rate), 7213) == 22  # the VAE's shortest clip, just
    assert track_frames(DecodedAudio(torch.zeros(2, 29333), rate), 7213) == 0  # under it: no clip
    song = write_wav(tmp_path / "song.wav", 10.3)  # 247 frames -> 243
    assert plan(song).num_frames == 243 and plan(song, "full").num_frames == 243
    assert plan(song, duration=12.0).num_frames == 294  # padded with silence, as asked
    assert plan(song, duration=5.0).num_frames == 124
    assert covers_track(10.2, song) and covers_track(300.0, song) and not covers_track(10.0, song)
    assert covers_track(243 / 24, song)  # exactly the frames the track sets
    assert not covers_track(20.0, write_wav(tmp_path / "short.wav", 4.4))  # padded to the duration instead
    with pytest.raises(RequestError, match=r"lasts under 4.46 s \(107 frames\).* give a duration"):
        plan(tmp_path / "short.wav")
    with pytest.raises(RequestError, match="more than 30 s, the longest a full long video makes.*continuation mode"):
        plan(write_wav(tmp_path / "album.wav", 31.5, rate=8000), "full")
    assert plan(tmp_path / "album.wav").num_frames == 753  # 756 frames
    with pytest.raises(RequestError, match="drive audio: No media file at .*missing.wav"):
        plan(tmp_path / "missing.wav")
    # the command line: --long-video --drive-audio without --duration makes the whole track
    out = tmp_path / "song.safetensors"
    argv = ["generate", "--device", "cpu", "--long-video", "--steps", "2", "--prompt", PROMPT, "--drive-audio",
            str(write_wav(tmp_path / "six.wav", 6.0)), "--save-latents", str(out)]
    assert main(argv) == 0
    assert load_file(str(out))["video"].shape[2] == geometry.latent_frames(141)  # 144 frames -> 141
    assert main(argv[:3] + ["--duration", "5"] + argv[3:]) == 0  # a duration as before
    assert load_file(str(out))["video"].shape[2] == geometry.latent_frames(124)
    assert "warning" not in capsys.readouterr().err
    # one request (no --long-video) takes 5 s by default: a longer track is said, with how to use more of it
    assert main(argv[:3] + argv[4:]) == 0
    assert load_file(str(out))["video"].shape[2] == geometry.latent_frames(124)
    assert ("h3: warning: --drive-audio six.wav lasts 6.0 s; this clip uses its first 5.17 s: give --duration (4-15 "
            "s), or --long-video for all of it.") in capsys.readouterr().err
    assert main(argv[:3] + argv[4:] + ["--duration", "5"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_long_run_that_stops_keeps_its_finished_windows(tmp_path, monkeypatch, capsys):
    """With --save-latents, the clip so far is saved after each window: a run that fails (or is stopped) in its
    second window leaves the first, which --continue-from extends to the whole clip, as said: the clip the run
    would have made."""
    import h3_core.long_video as long_video_module

    out = tmp_path / "long.safetensors"
    argv = ["generate", "--long-video", "--duration", "20", "--steps", "2", "--prompt", PROMPT]
    calls = []

    def failing_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA out of memory (a stand-in)")
        return sample(*args, **kwargs)

    monkeypatch.setattr(long_video_module, "sample", failing_second)
    with pytest.raises(RuntimeError, match="a stand-in"):
        main([*argv, "--save-latents", str(out)])
    said = capsys.readouterr().err
    assert (f"windows 1-1 of 2 saved to {out} (were the run to stop, continue it with --continue-from {out} --seed 0)"
            in said)
    first = load_file(str(out))
    assert first["video"].shape[2] == geometry.latent_frames(277)  # the first window, whole
    monkeypatch.setattr(long_video_module, "sample", sample)
    whole = tmp_path / "whole.safetensors"
    assert main([*argv, "--continue-from", str(out), "--save-latents", str(whole)]) == 0
    made = load_file(str(whole))
    assert made["video"].shape[2] == geometry.latent_frames(481)
    assert torch.equal(made["video"][:, :, :first["video"].shape[2]], first["video"])
    straight = tmp_path / "straight.safetensors"  # the run that never stopped makes the same clip
    assert main([*argv, "--save-latents", str(straight)]) == 0
    assert all(torch.equal(made[name], tensor) for name, tensor in load_file(str(straight)).items())
    capsys.readouterr()
    assert main([*argv, "--continue-from", str(out), "--seed", "3", "--save-latents", str(tmp_path / "other.safetensors")]) == 0
    assert ("warning: the clip to continue was saved by a run with seed 0 that stopped; with seed 3 the rest differs "
            "from what that run would have made (give seed 0 to finish it as it would have).") in capsys.readouterr().err


def test_cli_full_mode(tmp_path):
    out = tmp_path / "full.safetensors"
    argv = ["generate", "--long-video", "--long-video-mode", "full", "--duration", "20", "--steps", "2",
            "--prompt", PROMPT, "--save-latents", str(out)]
    assert main(argv) == 0
    assert load_file(str(out))["video"].shape == (1, 24, 142, 8, 14)


@pytest.mark.parametrize("extra, message", [
    (["--window-frames", "107"], "--window-frames: only with --long-video"),
    (["--window-prompt", "a"], "--window-prompt: only with --long-video"),
    (["--duration", "20", "--drive-audio", "x.wav"], "between 4 and 15 seconds"),
    (["--long-video", "--long-video-mode", "full", "--overlap-frames", "39"], "full mode is one window"),
    (["--long-video", "--duration", "20", "--window-prompt", "a"], "has 2 window"),
    (["--long-video", "--duration", "20", "--window-frames", "100"], "17n \\+ 5"),
    (["--long-video", "--duration", "400"], "up to 300 s"),
    (["--long-video", "--task", "fl2va", "--first-image", "a.png"], "t2va or ref2va"),
])
def test_cli_refuses_bad_long_video_flags(tmp_path, capsys, extra, message):
    argv = ["generate", "--prompt", PROMPT, "--save-latents", str(tmp_path / "x.safetensors"), *extra]
    assert main(argv) == 2
    assert re.search(message, capsys.readouterr().err)


def test_cli_says_prompt_is_not_sampled_beside_window_prompts(capsys):
    """--prompt with --window-prompt: the windows sample theirs; --prompt was dropped without a word."""
    from argparse import Namespace

    from h3_core.cli import _prompt

    args = Namespace(prompt="a cat", long_video=True, window_prompt=["b", "c"])
    assert _prompt(args) == "a cat"
    assert "--prompt is not sampled, it only titles the MP4" in capsys.readouterr().err
    assert _prompt(Namespace(prompt="a cat", long_video=True, window_prompt=[])) == "a cat"
    assert _prompt(Namespace(prompt=None, long_video=True, window_prompt=["b", "c"])) == "b"
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("extra", [[], ["--window-prompt", "a"], ["--long-video", "--duration", "20"]])
def test_cli_without_any_prompt_says_which_flags_give_one(tmp_path, capsys, extra):
    assert main(["generate", "--save-latents", str(tmp_path / "x.safetensors"), *extra]) == 2
    assert "Give --prompt TEXT (or, with --long-video, one --window-prompt TEXT per window)" in capsys.readouterr().err
    assert not (tmp_path / "x.safetensors").exists()


def test_window_prompts_typed_one_per_line():
    from h3_core.long_video import split_window_prompts

    assert split_window_prompts("  A fox walks.\n\nThe fox runs. \n") == ("A fox walks.", "The fox runs.")
    assert split_window_prompts("") == ()
    # prompts of several lines (the release's structured prompts), separated by lines holding only ---
    typed = "scene: a fox walks.\nsound: waves.\n ---\n\nscene: the fox runs.\nsound: wind.\n---\n \n---\n"
    assert split_window_prompts(typed) == ("scene: a fox walks.\nsound: waves.", "scene: the fox runs.\nsound: wind.")


def five_second_clip(models, seed=4):
    plain = encode_request(Request("t2va", PROMPT, duration=5), models["text"], rules=TINY_CANVAS)
    return sample(tiny_random_dit(), plain, seed, STEPS)  # 124 frames: 37 latent frames, 207 audio latents


def test_a_given_clip_is_kept_and_continued_from_its_tail(models):
    given = five_second_clip(models)
    conditioning = encode(models, continue_from=given, window_prompts=["The fox runs.", "The fox rests."])
    # the given clip [0, 124), then windows from 22 frames before each end
    assert [(w.start, w.end, w.given) for w in conditioning.windows] == [(0, 124, True), (102, 379, False),
                                                                        (357, 481, False)]
    dit, spy = spied_dit()
    steps = []
    latents = sample_long_video(dit, conditioning, seed=1, steps=STEPS, callback=lambda s: steps.append(s.step))
    assert latents.check().num_frames == 481 and steps == [1, 2, 3, 4]  # only the new windows are sampled
    assert torch.equal(latents.video[:, :, :37], given.video) and torch.equal(latents.audio[..., :207], given.audio)
    assert len(spy.calls) == 2 * (STEPS - 1)
    window = conditioning.windows[1]  # its guide is the given clip's tail
    held = spy.calls[0]["video_rows"][:, : window.guide_latent_frames * 28]
    assert_held_once_noised(held, patchify(given.video[:, :, 37 - window.guide_latent_frames:]))
    tail_audio = given.audio[..., 207 - window.guide_audio_latents:]
    assert torch.equal(spy.calls[0]["audio_rows"][:, : 2 * window.guide_audio_latents], pack_audio(tail_audio[None]))
    assert conditioning.max_rows == conditioning.window_layout(window).sequence_length


@pytest.mark.parametrize("options, message", [
    ({"mode": "full"}, "cannot continue a given clip; use continuation mode"),
    ({"seconds": 5.0}, r"must be longer than the clip it continues \(124 frames, 5.17 s as encoded: cut to 17n \+ 5 "
                       r"frames\): the duration counts the whole result"),
    ({"width": 256, "height": 128}, "keeps its canvas, 224x128; this request asks for 256x128"),
    ({"aspect_ratio": "1:1"}, "keeps its canvas, 224x128; this request asks for 1:1"),
    ({"window_prompts": ["one"]}, r"has 2 window\(s\) \(starting at 102 \(4.2 s\), 357 \(14.9 s\)\), got 1"),
    ({"overlap_frames": 124}, r"overlap \(124 frames\) must be shorter than the clip it continues"),
    ({"drive_audio": "track.wav"}, "a continued clip already has its sound"),
    ({"guides": [GuideMedia(100, frames=np.zeros((128, 224, 3), np.uint8))]},
     "inside the clip being continued \\(frames 0-123\\).*at frame 124 or later"),
    ({"guides": [GuideMedia(370, frames=np.zeros((22, 128, 224, 3), np.uint8))]},  # numbered as window prompts
     r"crosses the end of window 1 \(frames 124-378 are made there\).*The windows made end at frames 379, 481"),
])
def test_bad_continuations_fail_before_any_model(models, tmp_path, options, message):
    given = AVLatents(torch.zeros(1, 24, 37, 8, 14), torch.zeros(2, 32, 207))
    seconds = options.pop("seconds", 20.0)
    canvas = {key: options.pop(key) for key in ("width", "height", "aspect_ratio") if key in options}
    if "drive_audio" in options:
        write_wav(tmp_path / "track.wav", 2.0)
        options["drive_audio"] = tmp_path / "track.wav"
    request = LongVideoRequest(Request("t2va", PROMPT, duration=seconds, **canvas), continue_from=given, **options)
    with pytest.raises(RequestError, match=message):
        validate_long_video(request, TINY_CANVAS)
    broken = AVLatents(torch.zeros(1, 24, 36, 8, 14), torch.zeros(2, 32, 207))
    with pytest.raises(RequestError, match="The clip to continue: Video latents need L = 5n \\+ 2"):
        validate_long_video(LongVideoRequest(Request("t2va", PROMPT, duration=20.0), continue_from=broken), TINY_CANVAS)


def test_cli_extends_saved_latents(tmp_path, capsys):
    five, longer = tmp_path / "five.safetensors", tmp_path / "twelve.safetensors"
    assert main(["generate", "--prompt", PROMPT, "--steps", "2", "--save-latents", str(five)]) == 0
    argv = ["generate", "--long-video", "--duration", "12", "--prompt", "The fox keeps running.", "--steps", "2"]
    assert main([*argv, "--continue-from", str(five), "--save-latents", str(longer)]) == 0
    first, whole = load_file(str(five)), load_file(str(longer))
    assert whole["video"].shape[2] == 87 and torch.equal(whole["video"][:, :, :37], first["video"])
    capsys.readouterr()
    assert main([*argv, "--continue-from", str(tmp_path / "none.safetensors"), "--save-latents", str(longer)]) == 2
    assert "none.safetensors: no such file" in capsys.readouterr().err
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    assert main([*argv, "--continue-from", str(tmp_path / "bad.safetensors"), "--save-latents", str(longer)]) == 2
    assert "bad.safetensors:" in capsys.readouterr().err
    assert main(["generate", "--prompt", PROMPT, "--continue-from", str(five), "--save-latents", str(longer)]) == 2
    assert "--continue-from: only with --long-video" in capsys.readouterr().err



def test_a_stopped_run_continued_with_its_seed_makes_the_clip_it_would_have_made(models, tmp_path):
    """The clip saved after each window carries where the run stopped (generator state, media clock), through
    its file: continued with the same seed it comes out bitwise as the run that never stopped, also when the
    finished window's prompt was the longest and the window left is shorter than the first (the reference video
    is still read for the first window's length). A new seed, or a clip cut since, draws afresh."""
    frames = np.linspace(0, 255, 130 * 40 * 64 * 3).astype(np.uint8).reshape(130, 40, 64, 3)
    video = ("video", DecodedVideo(frames, 24.0))
    prompts = [PROMPT + " The camera pans slowly across the dunes while the light fades to a deep orange. <Video 1>",
               "The fox rests. <Video 1>", "The fox sleeps. <Video 1>"]
    dit = tiny_random_dit()

    def run(windows_prompts, seed=5, **given):
        conditioning = encode(models, "ref2va", 12.9, [video], window_prompts=windows_prompts, window_frames=124,
                              **given)
        saved = []
        whole = sample_long_video(dit, conditioning, seed=seed, steps=STEPS,
                                  on_window=lambda clip, made, count: saved.append(clip))
        return whole, saved

    whole, saved = run(prompts)  # windows [0, 124), [102, 226), [204, 311)
    assert [clip.num_frames for clip in saved] == [124, 226] and whole.num_frames == 311
    for made, clip in enumerate(saved, 1):
        path = clip.save(tmp_path / f"after_{made}.safetensors", {"windows": f"{made} of 3"})
        resumed, again = run(prompts[made:], continue_from=AVLatents.load(path))
        assert torch.equal(resumed.video, whole.video) and torch.equal(resumed.audio, whole.audio)
        if made == 1:  # the continued run saves where it stopped too
            assert torch.equal(again[0].resume.generator_state, saved[1].resume.generator_state)
    given = AVLatents.load(tmp_path / "after_1.safetensors")
    assert given.resume.media_origin == saved[0].resume.media_origin > 0
    other_seed, _ = run(prompts[1:], seed=6, continue_from=given)
    assert not torch.equal(other_seed.video[:, :, 37:], whole.video[:, :, 37:])
    cut = AVLatents(given.video[:, :, :32], given.audio[..., :178], given.resume)  # 107 frames, not the 124 saved
    cut_clip, _ = run(prompts[1:], continue_from=cut)
    assert torch.equal(cut_clip.video, run(prompts[1:], continue_from=AVLatents(cut.video, cut.audio))[0].video)


@pytest.mark.parametrize("saved, error", [
    ('{"seed": 5, "media_origin": 30.0, "frames": 124}', "KeyError: 'generator'"),
    ('{"seed": 5, "generator": "AAAA", "media_origin": 30.0, "frames": 124}', "RuntimeError"),  # not a state
    ("not json", "JSONDecodeError"),
])
def test_a_latent_file_whose_resume_point_was_changed_is_refused(tmp_path, saved, error):
    from safetensors.torch import save_file

    path = tmp_path / "changed.safetensors"
    save_file({"video": torch.zeros(1, 24, 37, 8, 14), "audio": torch.zeros(2, 32, 207)}, str(path),
              metadata={"h3_long_video_resume": saved})
    with pytest.raises(ValueError, match=f"changed.safetensors: its 'h3_long_video_resume' metadata .*cannot be read "
                                         f"\\({error}"):
        AVLatents.load(path)
