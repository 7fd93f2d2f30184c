"""Keyframe and reference preparation (h3_core.references) against diffusers 0.42.1's before-encoder and
reference-encoder steps, at the release's canvas rules (pixels) and at tiny size (encodes).

Pixels are compared exactly (the same PIL LANCZOS calls on the same inputs). Visual conditioning latents
exactly (same moments, the same seed-42 posterior noise, the same fp16 rounding: test_vae_video shows
the VAEs agree bitwise at this size). Audio rows to 1e-5 absolute (the audio VAE's posterior mean
agrees to that in test_vae_audio; observed equal here).
"""

from __future__ import annotations

import importlib.util
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from audio_vae_checkpoints import TINY_AUDIO_VAE, reference_audio_vae, write_diffusers_folder
from PIL import Image
from video_vae_checkpoints import reference_video_vae, tiny_config

from h3_core import geometry
from h3_core.media_read import read_audio, read_video
from h3_core.media_write import write_mp4
from h3_core.prompt import AudioReference, ImageReference, VideoReference
from h3_core.references import (
    RELEASE_CANVAS,
    CanvasRules,
    DecodedAudio,
    DecodedVideo,
    MediaInputError,
    MediaReference,
    encode_audio,
    encode_image,
    encode_video,
    fit_keyframes,
    frames_at_24fps,
    inspect_audio,
    inspect_video,
    prepare_audio,
    prepare_image_reference,
    prepare_reference,
    prepare_video_frames,
    vae_frame_count,
)
from h3_core.vae_audio_checkpoint import load_audio_vae
from h3_core.vae_video import VideoVAE
from h3_core.vae_video_checkpoint import convert_state_dict

before_encoder = pytest.importorskip("diffusers.modular_pipelines.minimax_h3.before_encoder")
from diffusers.modular_pipelines.minimax_h3 import references as diffusers_refs  # noqa: E402
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import resolve_canvas_size  # noqa: E402

Setup = before_encoder.MiniMaxH3Ref2VASetupStep
TINY_RULES = CanvasRules(short_edge=64, max_pixels=64 * 128, reference_image_short_edge=64)
AUDIO_ATOL = 1e-5


def picture(width: int, height: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def frames(count: int, width: int, height: int, seed: int) -> np.ndarray:
    """Frame i carries its index in the red channel of pixel (0, 0), so resampling can be read back."""
    out = np.random.default_rng(seed).integers(0, 256, (count, height, width, 3), dtype=np.uint8)
    out[:, 0, 0, 0] = np.arange(count) % 256
    return out


def waveform(seconds: float, channels: int, seed: int, rate: int = 32000) -> np.ndarray:
    time = np.arange(round(seconds * rate)) / rate
    tones = np.stack([np.sin(2 * math.pi * (300 + 50 * c) * time) for c in range(channels)])
    noise = 0.05 * np.random.default_rng(seed).standard_normal(tones.shape)
    return (0.6 * tones + noise).astype(np.float32)


def diffusers_pipe(step, **config):
    pipe = step.init_pipeline()
    if config:
        pipe.update_components(**config)
    return pipe


# ---------------------------------------------------------------------------------------------
# Canvas rules


RATIOS = [(16, 9), (9, 16), (21, 9), (4, 3), (1, 1), (4, 1), (1, 4), (1920, 1080), (1000, 999), (333, 1000), (7, 3)]


@pytest.mark.parametrize("rules", [RELEASE_CANVAS, TINY_RULES, CanvasRules(short_edge=544, max_pixels=544 * 960)])
def test_canvas_rules_equal_geometry_and_diffusers(rules):
    for width, height in RATIOS:
        expected_height, expected_width = resolve_canvas_size(width, height, 32, rules.short_edge, rules.max_pixels)
        assert rules.canvas(width, height) == (expected_width, expected_height), (width, height)
        if rules == RELEASE_CANVAS:
            assert rules.canvas(width, height) == geometry.canvas_size((width, height))
    with pytest.raises(ValueError, match="1:4 to 4:1"):
        rules.canvas(5, 1)


def test_reference_image_size_rule():
    """Short edge 2048 (up or down, no area cap), each axis then rounded to the nearest 32, as diffusers'
    setup step computes it (`round(side * scale / 32) * 32`, at least 32)."""
    for width, height in [(120, 90), (300, 1100), (4000, 2100), (1023, 1024), (37, 149), (6000, 1500), (2048, 2048)]:
        scale = 2048 / min(width, height)
        expected = (max(32, round(width * scale / 32) * 32), max(32, round(height * scale / 32) * 32))
        assert RELEASE_CANVAS.reference_image_size(width, height) == expected
    assert RELEASE_CANVAS.reference_image_size(1920, 1080) == (3648, 2048)  # 7296 DiT rows (h3-model.md F)


def test_canvas_lossy_scales_image_references_down_to_the_output_area():
    """ComfyUI's native default ('match'): scale = min(1, sqrt(W * H / (w * h))), never up, then the same
    rounding to 32; the release's rule is left as it is."""
    rules = RELEASE_CANVAS.sized_for_canvas("canvas-lossy", 1344, 768)
    for width, height in [(120, 90), (300, 1100), (4000, 2100), (1023, 1024), (37, 149), (6000, 1500), (2048, 2048)]:
        scale = min(1.0, math.sqrt(1344 * 768 / (width * height)))
        expected = (max(32, round(width * scale / 32) * 32), max(32, round(height * scale / 32) * 32))
        assert rules.reference_image_size(width, height) == expected
    assert rules.reference_image_size(1920, 1080) == (1344, 768)  # 1008 DiT rows instead of 7296
    assert rules.reference_image_size(300, 200) == (288, 192)  # not scaled up to a 2048 short edge
    assert RELEASE_CANVAS.sized_for_canvas("release", 1344, 768) == RELEASE_CANVAS
    with pytest.raises(MediaInputError, match="one of release, canvas-lossy; got 'match'"):
        RELEASE_CANVAS.sized_for_canvas("match", 1344, 768)


# ---------------------------------------------------------------------------------------------
# Keyframes


@pytest.mark.parametrize(
    "first, last, size",
    [
        ((1000, 700), (700, 1200), None),  # first stretched onto its own canvas, last cover-cropped
        ((640, 360), (333, 777), None),
        (None, (1500, 600), None),  # a last keyframe alone is the geometry anchor: stretched
        ((500, 500), (1920, 1080), (1024, 576)),  # explicit canvas: the first stretched onto it too
        ((1344, 768), (1345, 769), None),  # already on the canvas: untouched; one pixel off: cropped
    ],
)
def test_keyframes_equal_diffusers_resize_step(first, last, size):
    images = {
        name: picture(*dims, seed=i) for i, (name, dims) in enumerate((("image", first), ("last_image", last))) if dims
    }
    inputs = dict(images)
    if size:
        inputs.update(width=size[0], height=size[1])
    reference = diffusers_pipe(before_encoder.MiniMaxH3ResizeStep())(**inputs, output=["keyframes", "width", "height"])
    width, height = size or RELEASE_CANVAS.canvas(*next(iter(images.values())).size)
    assert (width, height) == (reference["width"], reference["height"])
    ours = fit_keyframes(list(images.values()), width, height)
    assert len(ours) == len(reference["keyframes"])
    for got, expected in zip(ours, reference["keyframes"], strict=True):
        assert got.size == (width, height)
        assert np.array_equal(np.asarray(got), np.asarray(expected))
    if first == (1344, 768):
        assert ours[0] is images["image"]


# ---------------------------------------------------------------------------------------------
# References: normalization (release rules, pixels) through diffusers' setup step


@pytest.mark.parametrize("dims", [(120, 90), (90, 160), (2048, 2048)])
def test_image_reference_equals_diffusers_setup(dims):
    image = picture(*dims, seed=3)
    reference = diffusers_pipe(Setup())(
        references=[diffusers_refs.MiniMaxH3ImageReference(image=image)], num_frames=124, output="normalized_references"
    )[0].image
    ours = prepare_reference(MediaReference("image", image), 124)
    assert ours.image.size == reference.size
    assert np.array_equal(np.asarray(ours.image), np.asarray(reference))
    if dims == (2048, 2048):
        assert np.array_equal(np.asarray(ours.image), np.asarray(image))  # already at its size: not resampled
    # arrays (uint8 or float 0..1, numpy or torch) are the same image
    array = np.array(image)
    for source in (array, torch.from_numpy(array), array.astype(np.float32) / 255):
        again = prepare_reference(MediaReference("image", source), 124).image
        assert np.array_equal(np.asarray(again), np.asarray(ours.image))
    assert prepare_image_reference(ours.image) is ours.image  # already at its size: untouched


@pytest.mark.parametrize(
    "fps, count, num_frames, dims",
    [
        (30.0, 20, 124, (80, 48)),  # drops frames; resized onto its own canvas (the 768 rule)
        (12.0, 8, 124, (96, 64)),  # repeats frames
        (23.976, 40, 22, (64, 64)),  # truncated to the output frame count
        (24.0, 40, 124, (1152, 768)),  # already on its canvas at 24 fps: untouched
    ],
)
def test_video_reference_equals_diffusers_setup(fps, count, num_frames, dims):
    clip = frames(count, *dims, seed=1)
    expected = Setup._normalize_video_condition(clip, fps, num_frames, 32, 768, 768 * 1344, 24.0)
    ours = prepare_video_frames(clip, fps, num_frames)
    assert ours.dtype == np.uint8 and ours.shape == expected.shape
    assert np.array_equal(ours, expected)
    assert ours.shape[2:0:-1] == RELEASE_CANVAS.canvas(*dims)
    # the slot rule of h3-model.md F: source frame i lands on slot floor(i * 24 / fps + 0.5)
    slots = frames_at_24fps(clip, fps)
    assert slots.shape[0] == math.floor(count * 24 / fps + 0.5)
    for i in range(count):
        slot = math.floor(i * 24 / fps + 0.5)
        if slot < slots.shape[0] and (i + 1 == count or math.floor((i + 1) * 24 / fps + 0.5) > slot):
            assert slots[slot, 0, 0, 0] == i % 256


def test_whole_setup_step_equals_prepared_references():
    """diffusers' setup step on a mixed list (tiny rules) = prepare_reference per entry, soundtracks included."""
    video = frames(75, 80, 48, seed=2)
    soundtrack, voice = waveform(2.5, 1, seed=3), waveform(2.2, 2, seed=4)
    image = picture(100, 70, seed=5)
    diffusers_list = [
        diffusers_refs.MiniMaxH3VideoReference(
            frames=video, fps=30.0, audio=torch.from_numpy(soundtrack), sample_rate=32000
        ),
        diffusers_refs.MiniMaxH3ImageReference(image=image),
        diffusers_refs.MiniMaxH3AudioReference(audio=torch.from_numpy(voice), sample_rate=32000),
    ]
    pipe = diffusers_pipe(Setup(), canvas_short_edge=64, canvas_max_pixels=64 * 128, reference_image_short_edge=64)
    expected = pipe(references=diffusers_list, num_frames=124, output="normalized_references")
    ours = [
        prepare_reference(MediaReference("video", DecodedVideo(video, 30.0, soundtrack, 32000)), 124, TINY_RULES),
        prepare_reference(MediaReference("image", image), 124, TINY_RULES),
        prepare_reference(MediaReference("audio", DecodedAudio(voice, 32000)), 124, TINY_RULES),
    ]
    assert np.array_equal(ours[0].frames, expected[0].frames)
    assert torch.equal(ours[0].audio, expected[0].audio)
    assert np.array_equal(np.asarray(ours[1].image), np.asarray(expected[1].image))
    assert torch.equal(ours[2].audio, expected[2].audio)
    assert ours[0].frames.shape == (60, 64, 96, 3) and ours[0].audio.shape == (2, 80000)
    assert [type(r.for_presentation()) for r in ours] == [VideoReference, ImageReference, AudioReference]
    assert ours[0].for_presentation().has_audio and not ours[1].has_audio


@pytest.mark.parametrize("channels, seconds, num_frames", [(1, 3.0, 124), (2, 9.0, 124), (2, 4.0, 209)])
def test_audio_reference_equals_diffusers_setup(channels, seconds, num_frames):
    """Mono is duplicated; the clip is cut to int(F / 24 * rate) samples (the output duration)."""
    clip = waveform(seconds, channels, seed=6)
    expected = Setup._normalize_audio_condition(torch.from_numpy(clip), 32000, 32000, num_frames / 24)
    ours = prepare_audio(clip, 32000, num_frames)
    assert ours.dtype == torch.float32 and torch.equal(ours, expected)
    assert ours.shape == (2, min(clip.shape[1], int(num_frames / 24 * 32000)))


def test_audio_at_another_rate_is_cut_natively_then_resampled_once():
    clip = waveform(7.0, 2, seed=7, rate=44100)
    ours = prepare_audio(clip, 44100, 124)
    cut = int(124 / 24 * 44100)  # 227850 samples at 44.1 kHz
    assert ours.shape == (2, math.ceil(cut * 32000 / 44100))
    tone = np.sin(2 * math.pi * 300 * np.arange(ours.shape[1]) / 32000)
    assert np.corrcoef(ours[0, 1000:-1000].numpy(), tone[1000:-1000])[0, 1] > 0.99


@pytest.mark.parametrize("rate, count, expected", [
    (44100, 111353, 80801), (44100, 100000, 72563), (22050, 55677, 80802), (48000, 100000, 66667),
    (16000, 33333, 66666), (44100, 441, 320),
    (44100, 400038, 290277),  # 290277.0068 exactly: its float32 is 290277.0, which torchaudio's ceil keeps
])
def test_a_resampled_waveform_is_as_long_as_the_references(rate, count, expected):
    """The reference resamples with torchaudio, whose output is ceil(N * 32000 / rate) samples (its quotient in
    float32); a rounded count (80800 for 111353 at 44.1 kHz) made one audio latent fewer for some reference
    lengths (a 2.525 s clip: 101 against 102), so the whole sequence differed. The counts here are torchaudio's
    (`torchaudio.functional.resample(torch.zeros(2, count), rate, 32000).shape[1]`, torchaudio 2.11)."""
    from h3_core.media import resample_audio

    assert resample_audio(np.zeros((2, count), np.float32), rate).shape == (2, expected)
    reference = importlib.util.find_spec("torchaudio")
    if reference is not None:  # where it is installed (ComfyUI's Python), asked as well
        from torchaudio.functional import resample

        assert resample(torch.zeros(2, count), rate, 32000).shape[1] == expected


@pytest.mark.parametrize("rate, tolerance", [(44100, 3e-3), (48000, 3e-3), (16000, 2e-2), (22050, 2e-2)])
def test_audio_at_another_rate_sounds_as_the_references_resampler_makes_it(rate, tolerance):
    """The release resamples reference audio once with torchaudio's default `resample` (a windowed sinc); ours is
    FFmpeg's swresample, not the same bits: on band-limited noise (below 60% of the lower Nyquist frequency) the two
    agree to `tolerance` of the signal's RMS (the differences are the two filters' transition bands; -50 dB for
    44.1 and 48 kHz, which most sound comes at), and in time: a sample's shift or a filter without anti-aliasing
    is 100x that. Needs torchaudio (ComfyUI's Python has it; no build loads beside the CPU torch 2.13.0)."""
    resample = pytest.importorskip("torchaudio.functional", reason="torchaudio, the reference's resampler").resample
    from h3_core.media import resample_audio

    count = 2 * rate
    noise = np.random.default_rng(rate).standard_normal((2, count))
    spectrum = np.fft.rfft(noise, axis=1)
    spectrum[:, np.fft.rfftfreq(count, 1 / rate) > 0.6 * min(rate, 32000) / 2] = 0
    signal = (0.3 * np.fft.irfft(spectrum, count, axis=1)).astype(np.float32)
    ours = resample_audio(signal, rate)
    reference = resample(torch.from_numpy(signal), rate, 32000).numpy()
    assert ours.shape == reference.shape
    inner = slice(200, -200)  # the edges: each filter pads the ends its own way
    error = ours[:, inner] - reference[:, inner]
    assert np.sqrt((error**2).mean()) < tolerance * np.sqrt((reference[:, inner] ** 2).mean())


def test_start_offsets_of_decoded_media():
    clip, sound = frames(90, 64, 64, seed=8), waveform(3.0, 2, seed=9)
    later = prepare_reference(MediaReference("video", DecodedVideo(clip, 30.0, sound, 32000), 1.0), 124, TINY_RULES)
    direct = prepare_reference(
        MediaReference("video", DecodedVideo(clip[30:], 30.0, sound[:, 32000:], 32000)), 124, TINY_RULES
    )
    assert np.array_equal(later.frames, direct.frames) and torch.equal(later.audio, direct.audio)
    assert later.frames.shape[0] == 48  # 60 frames at 30 fps from 1 s on -> 48 at 24 fps
    assert inspect_video(DecodedVideo(clip, 30.0), 1.0).seconds == 2.0
    voice = prepare_reference(MediaReference("audio", DecodedAudio(sound, 32000), 0.5), 124)
    assert torch.equal(voice.audio, torch.from_numpy(sound[:, 16000:]))
    assert inspect_audio(DecodedAudio(sound, 32000), 0.5).seconds == 2.5


def test_files_are_read_at_24fps_from_their_start(tmp_path):
    """A reference file = read_video / read_audio from start_seconds, then the same normalization."""
    path = tmp_path / "ref.mp4"
    clip = frames(96, 96, 64, seed=10)
    write_mp4(path, clip, waveform(4.0, 2, seed=11))
    facts = inspect_video(path, 1.0)
    assert (facts.width, facts.height, facts.has_audio) == (96, 64, True)
    assert facts.seconds == pytest.approx(3.0, abs=0.05)
    prepared = prepare_reference(MediaReference("video", path, 1.0), 124, TINY_RULES)
    decoded = read_video(path, 1.0, max_frames=124)
    assert np.array_equal(prepared.frames, decoded.frames)  # 24 fps, and 96x64 is its tiny canvas
    assert prepared.frames.shape == (72, 64, 96, 3)
    assert torch.equal(prepared.audio, torch.from_numpy(decoded.audio))
    voice = prepare_reference(MediaReference("audio", path, 0.5), 124, TINY_RULES)
    assert torch.equal(voice.audio, torch.from_numpy(read_audio(path, 0.5, 124 / 24)))


def test_a_video_file_larger_than_its_canvas_is_fitted_as_it_is_decoded(tmp_path):
    """A file's frames were all held at the file's size (twice, while stacked) before going onto the canvas: a
    15 s 4K clip took ~18 GB. Each is now fitted as it is decoded: the same frames, in the memory of the fitted."""
    import tracemalloc

    path = tmp_path / "large.mp4"
    write_mp4(path, frames(48, 448, 256, seed=12))
    whole = read_video(path, max_frames=124, with_audio=False).frames
    expected = prepare_video_frames(whole, 24.0, 124, TINY_RULES)
    assert expected.shape[0] == 48 and expected.nbytes * 4 < whole.nbytes  # well under the file's size
    tracemalloc.start()
    try:
        prepared = prepare_reference(MediaReference("video", path), 124, TINY_RULES)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.array_equal(prepared.frames, expected)
    assert peak < whole.nbytes, (peak, whole.nbytes)


@pytest.mark.parametrize("fps", [30, 12, Fraction(30000, 1001)])
def test_a_video_file_at_another_rate_reads_as_the_references_decoder_reads_it(tmp_path, fps):
    """A file's frames, read and put on 24 fps by us, equal diffusers' own file decoder (its from_file) followed
    by its setup step's normalization: the decode (colour conversion, frame order, the rate the container states)
    and the 24 fps grid. (In-memory clips are compared with the setup step above.)"""
    from test_media import write_index_clip  # a colour a frame: frame order shows in the pixels

    path = tmp_path / "clip.mp4"
    write_index_clip(path, fps, 45)
    theirs = diffusers_refs.MiniMaxH3VideoReference.from_file(str(path))
    assert theirs.fps == pytest.approx(float(fps))
    expected = Setup._normalize_video_condition(theirs.frames, theirs.fps, 124, 32, 768, 768 * 1344, 24.0)
    ours = prepare_reference(MediaReference("video", path), 124).frames
    assert ours.shape == expected.shape
    assert np.array_equal(ours, np.asarray(expected))


def test_vae_frame_count_snaps_down_to_17n_plus_5():
    table = {10: 22, 22: 22, 38: 22, 39: 39, 48: 39, 60: 56, 123: 107, 124: 124, 362: 362, 378: 362}
    assert {n: vae_frame_count(n) for n in table} == table


# ---------------------------------------------------------------------------------------------
# Encoding: the same tiny VAEs as diffusers' keyframe / reference encoder steps


@pytest.fixture(scope="module")
def video_vaes():
    config = tiny_config(seed=5)
    reference = reference_video_vae(config, seed=7)
    reference.enable_tiling(256, 256, 64, 64)
    ours = VideoVAE(config).eval().requires_grad_(False)
    ours.load_state_dict(convert_state_dict(reference.state_dict(), "diffusers", config))
    return reference, ours


@pytest.fixture(scope="module")
def audio_vaes(tmp_path_factory):
    reference = reference_audio_vae(TINY_AUDIO_VAE, seed=3)
    ours = load_audio_vae(write_diffusers_folder(tmp_path_factory.mktemp("audio_vae") / "audio_vae", reference))
    return reference, ours


def test_keyframe_latents_equal_diffusers(video_vaes):
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3KeyframeVaeEncoderStep

    keyframes = fit_keyframes([picture(100, 70, 1), picture(70, 120, 2)], 96, 64)
    pipe = diffusers_pipe(MiniMaxH3KeyframeVaeEncoderStep())
    pipe.update_components(vae=video_vaes[0])
    expected = pipe(keyframes=keyframes, output="condition_latents")
    ours = [encode_image(video_vaes[1], keyframe) for keyframe in keyframes]
    for got, want in zip(ours, expected, strict=True):
        assert got.shape == (1, 24, 1, 4, 6) and got.device.type == "cpu"
        assert torch.equal(got, want)


def test_reference_latents_and_audio_rows_equal_diffusers(video_vaes, audio_vaes):
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VAReferenceEncoderStep

    prepared = [
        prepare_reference(
            MediaReference("video", DecodedVideo(frames(75, 80, 48, 1), 30.0, waveform(2.5, 1, 2), 32000)),
            124,
            TINY_RULES,
        ),
        prepare_reference(MediaReference("image", picture(70, 120, 3)), 124, TINY_RULES),
        prepare_reference(MediaReference("audio", DecodedAudio(waveform(2.2, 2, 4), 32000)), 124, TINY_RULES),
        prepare_reference(MediaReference("video", DecodedVideo(frames(30, 96, 64, 5), 24.0)), 124, TINY_RULES),
    ]
    normalized = [
        diffusers_refs.MiniMaxH3VideoReference(
            frames=prepared[0].frames, fps=24.0, audio=prepared[0].audio, sample_rate=32000
        ),
        diffusers_refs.MiniMaxH3ImageReference(image=prepared[1].image),
        diffusers_refs.MiniMaxH3AudioReference(audio=prepared[2].audio, sample_rate=32000),
        diffusers_refs.MiniMaxH3VideoReference(frames=prepared[3].frames, fps=24.0),
    ]
    pipe = diffusers_pipe(MiniMaxH3Ref2VAReferenceEncoderStep())
    pipe.update_components(vae=video_vaes[0], audio_vae=audio_vaes[0])
    out = pipe(normalized_references=normalized, output=["condition_latents", "audio_condition_latents"])
    visual = [
        encode_video(video_vaes[1], prepared[0].frames),
        encode_image(video_vaes[1], prepared[1].image),
        encode_video(video_vaes[1], prepared[3].frames),
    ]
    assert [z.shape[2] for z in visual] == [17, 1, 7]  # 60 -> 56 frames, one image, 30 -> 22 frames
    for got, want in zip(visual, out["condition_latents"], strict=True):
        assert torch.equal(got, want)
    rows = [encode_audio(audio_vaes[1], prepared[i].audio) for i in (0, 2)]
    assert [r.shape for r in rows] == [(1, 200, 32), (1, 176, 32)]  # ceil(M / 800) latents per channel
    for got, want in zip(rows, out["audio_condition_latents"], strict=True):
        torch.testing.assert_close(got[0], want, atol=AUDIO_ATOL, rtol=0)


def test_a_16_bit_grey_image_is_scaled_not_clipped(tmp_path):
    """Pillow reads a 16-bit grey PNG as I;16 and its own RGB conversion clips it to white: the image comes out as
    its 8-bit version does (a file, or the opened image given as is, as a reference or a guide)."""
    from PIL import Image

    from h3_core.references import load_image

    ramp = np.tile(np.linspace(0, 65535, 256).astype(np.uint16), (64, 1))
    deep, flat = tmp_path / "deep.png", tmp_path / "flat.png"
    Image.fromarray(ramp).save(deep)
    Image.fromarray((ramp >> 8).astype(np.uint8)).save(flat)
    assert Image.open(deep).mode.startswith("I")
    expected = np.asarray(load_image(flat))
    assert np.array_equal(np.asarray(load_image(deep)), expected)
    assert np.array_equal(np.asarray(load_image(Image.open(deep))), expected) and expected[:, -1].min() == 255
    from h3_core.guides import check_guide

    pixels, _, _ = check_guide("t2va", 107, 0, frames=Image.open(deep))  # a guide image given as a PIL image
    assert np.array_equal(pixels[0], expected)


def test_a_sample_rate_that_is_not_an_integer_is_said_so():
    """'needs its sample rate in Hz, got 16000.0' left the user to guess that 16000.0 was wrong for being a float."""
    from h3_core.references import _checked_audio

    with pytest.raises(MediaInputError, match=r"needs its sample rate in Hz, a positive integer, got sample_rate=16000.0"):
        _checked_audio(DecodedAudio(np.zeros((2, 100), np.float32), 16000.0), "references[0] (audio)")
