"""Guides (h3_core/guides.py): images, clips and sounds anchored at any pixel frame of a t2va / fl2va video.

Ground truth: the layout facts of ComfyUI's native H3 support (positions written out here from them, and
compared with its own PackedLayout when COMFYUI_PATH points at a checkout); and the fl2va path, proven
against diffusers in test_end_to_end: a guide image at frame 0 must be exactly a "first" keyframe."""

import dataclasses
import os

import numpy as np
import pytest
import torch
from PIL import Image

from h3_core.conditioning import Request, RequestError, encode_request
from h3_core.config import TINY_DIT
from h3_core.guides import add_guide, guide_frame_count, resolve_frame_index
from h3_core.layout import (
    AUDIO_TAG,
    VIDEO_TAG,
    GuideBlock,
    ReferenceBlock,
    RowClock,
    build_ref2va_layout,
    build_t2va_layout,
    frame_grid,
    pack_audio,
    unpack_audio,
)
from h3_core.pipeline import TINY_CANVAS, sample
from h3_core.references import DecodedAudio, encode_audio, encode_video, frames_on_canvas, prepare_audio
from h3_core.tiny import tiny_random_audio_vae, tiny_random_dit, tiny_random_video_vae

WIDTH, HEIGHT, FRAMES = 224, 128, 107  # the tiny canvas, 4 s
TEXT_ROWS = 9


@pytest.fixture(scope="module")
def models():
    return tiny_random_dit(), tiny_random_video_vae(), tiny_random_audio_vae()


def text():
    g = torch.Generator().manual_seed(5)
    return torch.randn(1, TEXT_ROWS, TINY_DIT.text_dim, generator=g), torch.ones(TEXT_ROWS, dtype=torch.int64)


def encoded(task="t2va", video_vae=None, **media):
    states, tags = text()
    request = Request(task, "a fox", width=WIDTH, height=HEIGHT, num_frames=FRAMES, **media)
    return encode_request(request, video_vae=video_vae, text_states=states, text_tags=tags, rules=TINY_CANVAS)


def picture(seed: int, frames: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (frames, HEIGHT, WIDTH, 3), dtype=np.uint8)


def test_guide_rows_sit_where_the_native_layout_puts_them():
    """Text | guide 1 video (2 latent frames) | guide 1 audio | guide 2 audio only | target audio | target
    video; times from origin T + 5/3 * frame index, the video's latent frames 5/3 * (1, 4, ...) apart."""
    tags = torch.ones(TEXT_ROWS, dtype=torch.int64)
    grid, w_axis = frame_grid(8, 14)
    rows = grid.shape[0]
    layout = build_t2va_layout(tags, 32, 8, 14, 142, guides=[GuideBlock(30, 2, 5), GuideBlock(99, 0, 3)])
    t, h, w = layout.position_ids.unbind(1)
    start = TEXT_ROWS
    first = slice(start, start + 2 * rows)
    assert torch.equal(t[first], torch.tensor([TEXT_ROWS + 50.0] * rows + [TEXT_ROWS + 50.0 + 5 / 3] * rows,
                                              dtype=torch.float64))
    assert torch.equal(torch.stack([h[first], w[first]], 1), torch.cat([grid, grid]).double())
    audio = slice(first.stop, first.stop + 10)
    assert torch.equal(t[audio], TEXT_ROWS + 50.0 + torch.arange(5, dtype=torch.float64).repeat(2))
    assert torch.equal(w[audio], torch.tensor([w_axis[0]] * 5 + [w_axis[-1]] * 5, dtype=torch.float64))
    second = slice(audio.stop, audio.stop + 6)
    assert torch.equal(t[second], TEXT_ROWS + 165.0 + torch.arange(3, dtype=torch.float64).repeat(2))
    assert (layout.token_tags[first] == VIDEO_TAG).all() and (layout.token_tags[audio] == AUDIO_TAG).all()
    assert (layout.row_clock[first] == RowClock.VISUAL_CONDITION).all()
    assert (layout.row_clock[audio] == RowClock.AUDIO_CONDITION).all()
    assert (layout.row_clock[second] == RowClock.AUDIO_CONDITION).all()
    assert (layout.num_condition_video_rows, layout.num_condition_audio_rows) == (2 * rows, 16)
    assert torch.equal(layout.video_indices[: 2 * rows], torch.arange(first.start, first.stop))
    assert torch.equal(layout.audio_indices[:16], torch.cat([torch.arange(audio.start, audio.stop),
                                                             torch.arange(second.start, second.stop)]))
    assert layout.sequence_length == second.stop + 2 * 142 + 32 * rows


@pytest.mark.skipif(not os.environ.get("COMFYUI_PATH"), reason="COMFYUI_PATH not set: no native ComfyUI layout to compare")
def test_guide_positions_equal_comfyuis_native_layout(monkeypatch):
    monkeypatch.syspath_prepend(os.environ["COMFYUI_PATH"])  # only for this test: its nodes.py would hide ours
    pytest.importorskip("comfy.cli_args").args.cpu = True  # before comfy.model_management looks for a GPU
    native = pytest.importorskip("comfy.ldm.minimax.model")
    keyframes = [{"resolved_frame_index": 0, "latent": torch.zeros(1, 24, 1, 8, 14)},
                 {"resolved_frame_index": 40, "latent": torch.zeros(1, 24, 2, 8, 14),
                  "audio_latent": torch.zeros(1, 32, 2, 7)},
                 {"resolved_frame_index": 70, "audio_latent": torch.zeros(1, 32, 2, 4)}]
    refs = [{"kind": "image", "latent_h": 16, "latent_w": 16}, {"kind": "audio", "ref_audio_t": 30}]
    theirs = native.PackedLayout(TEXT_ROWS, 32, 8, 14, 142, keyframes=keyframes, refs=refs)
    ours = build_ref2va_layout(torch.ones(TEXT_ROWS, dtype=torch.int64),
                               [ReferenceBlock.image(16, 16), ReferenceBlock.audio(30)], 32, 8, 14, 142,
                               guides=[GuideBlock(0, 1), GuideBlock(40, 2, 7), GuideBlock(70, 0, 4)])
    # the times exactly; the spatial grid within rounding (ComfyUI's differs from diffusers' in the last ulp
    # on the target rows too, and ours follows diffusers: test_layout)
    assert ours.position_ids.shape == theirs.position_ids.shape
    assert torch.equal(ours.position_ids[:, 0], theirs.position_ids[:, 0])
    assert torch.allclose(ours.position_ids[:, 1:], theirs.position_ids[:, 1:], rtol=0, atol=1e-12)


def test_a_guide_image_at_frame_0_is_a_first_keyframe(models):
    """Same rows, positions, clocks and latents as fl2va's first keyframe (an image already on the canvas:
    stretching and cover-cropping leave it as it is), so the same sample, bit for bit."""
    dit, video_vae, _ = models
    image = picture(1)[0]
    keyframe = encoded("fl2va", video_vae, first_image=Image.fromarray(image))
    guided = add_guide(encoded("t2va"), 0, video_vae, frames=image)
    for name in ("position_ids", "token_tags", "row_clock", "video_indices", "audio_indices"):
        assert torch.equal(getattr(keyframe.layout, name), getattr(guided.layout, name)), name
    assert torch.equal(keyframe.visual_condition_latents[0], guided.visual_condition_latents[0])
    ours, theirs = sample(dit, guided, seed=3, steps=3), sample(dit, keyframe, seed=3, steps=3)
    assert torch.equal(ours.video, theirs.video) and torch.equal(ours.audio, theirs.audio)


def test_clips_sounds_and_chained_guides(models):
    dit, video_vae, audio_vae = models
    plain = encoded("t2va")
    clip = picture(2, frames=30)  # cut to 22 frames: 7 latent frames
    sound = np.random.default_rng(3).standard_normal((1, 32000 * 5)).astype(np.float32) * 0.1  # 5 s mono
    cond = add_guide(plain, -22, video_vae, frames=clip)
    cond = add_guide(cond, 60, audio_vae=audio_vae, waveform=sound, sample_rate=32000)
    keep = int(np.floor(cond.layout.audio_latents - 60 * 5 / 3))
    assert cond.guides == (GuideBlock(FRAMES - 22, 7, 0), GuideBlock(60, 0, keep))
    assert cond.visual_condition_latents[0].shape[2] == 7 and cond.audio_condition_rows.shape[1] == 2 * keep
    # what is encoded: the clip's first 22 frames on the canvas, and the sound's first `keep` latents
    assert torch.equal(cond.visual_condition_latents[0], encode_video(video_vae, frames_on_canvas(clip[:22], WIDTH, HEIGHT)))
    heard = unpack_audio(encode_audio(audio_vae, prepare_audio(sound, 32000, FRAMES)))[0]
    assert heard.shape[-1] > keep and torch.equal(cond.audio_condition_rows, pack_audio(heard[None, ..., :keep]))
    assert plain.guides == () and plain.layout.num_condition_video_rows == 0  # the input is left as it was
    with_guides = sample(dit, cond, seed=4, steps=3)
    without = sample(dit, plain, seed=4, steps=3)
    assert with_guides.video.shape == without.video.shape and not torch.equal(with_guides.video, without.video)


def test_guides_follow_fl2va_keyframes(models):
    _, video_vae, _ = models
    keyframe = encoded("fl2va", video_vae, last_image=Image.fromarray(picture(5)[0]))
    guided = add_guide(keyframe, 30, video_vae, frames=picture(6)[0])
    layout = guided.layout
    expected = build_t2va_layout(guided.text_tags, layout.latent_frames, layout.latent_height, layout.latent_width,
                                 layout.audio_latents, ("last",), guides=[GuideBlock(30, 1)])
    assert torch.equal(layout.position_ids, expected.position_ids) and torch.equal(layout.row_clock, expected.row_clock)
    assert guided.keyframe_anchors == ("last",) and len(guided.visual_condition_latents) == 2
    assert torch.equal(guided.visual_condition_latents[0], keyframe.visual_condition_latents[0])


def test_guide_inputs_are_checked_before_any_model_runs(models):
    _, video_vae, audio_vae = models
    plain = encoded("t2va")
    assert [guide_frame_count(n) for n in (1, 4, 5, 21, 22, 40)] == [1, 1, 5, 5, 22, 39]
    assert resolve_frame_index(-1, FRAMES) == FRAMES - 1
    assert resolve_frame_index(0, FRAMES, FRAMES) == 0  # a clip as long as the video, from either end
    assert resolve_frame_index(-FRAMES, FRAMES, FRAMES) == 0
    with pytest.raises(RequestError, match=r"frame_index 107 is outside the video's 107 frames; use 0\.\.106"):
        add_guide(plain, FRAMES, video_vae, frames=picture(1)[0])
    with pytest.raises(RequestError, match="A 124-frame guide clip is longer than the video's 107 frames"):
        add_guide(plain, 0, video_vae, frames=picture(1, frames=124))
    past = r"A 22-frame guide clip from frame_index 90 runs past the video's 107 frames \(to frame 111\); start it at 0\.\.85"
    with pytest.raises(RequestError, match=past):
        add_guide(plain, 90, video_vae, frames=picture(1, frames=22))
    with pytest.raises(RequestError, match="needs frames .*, a sound, or both"):
        add_guide(plain, 0, video_vae)
    with pytest.raises(RequestError, match="encoded (by|with) the video VAE, and none was given"):
        add_guide(plain, 0, frames=picture(1)[0])
    with pytest.raises(RequestError, match="encoded (by|with) the audio VAE, and none was given"):
        add_guide(plain, 0, waveform=np.zeros((2, 3200), np.float32), sample_rate=32000)
    with pytest.raises(RequestError, match="must be uint8 RGB"):
        add_guide(plain, 0, video_vae, frames=np.zeros((HEIGHT, WIDTH), np.uint8))
    # scaled whole to cover the canvas before its crop: an 8000x2 picture would grow to gigabytes
    with pytest.raises(RequestError, match=r"The guide picture is 8000x2 \(aspect ratio 4e\+03\); H3 takes 1:4 to 4:1: "
                                           r"crop it to within that first\."):
        add_guide(plain, 0, video_vae, frames=np.zeros((2, 8000, 3), np.uint8))
    with pytest.raises(RequestError, match="The guide sound holds no samples"):
        add_guide(plain, 0, audio_vae=audio_vae, waveform=torch.zeros(2, 0), sample_rate=32000)
    with pytest.raises(RequestError, match="Unknown task 'i2v'"):
        add_guide(dataclasses.replace(plain, task="i2v"), 0, video_vae, frames=picture(1)[0])
    # a sound the encode cannot take is refused before any VAE runs (none is given here for the picture); int16
    # PCM was read as floats 32768 times too loud
    sounds = ((np.zeros((2, 3200), np.int16), 32000, "must be floating point"),
              (np.zeros((3, 3200), np.float32), 32000, r"must be \[samples\], \[1, samples\] or \[2, samples\]"),
              (np.full((2, 3200), np.nan, np.float32), 32000, "NaN"),
              (np.zeros((2, 3200), np.float32), 0, "sample_rate is a positive whole number of Hz, got 0"))
    for waveform, rate, refused in sounds:
        with pytest.raises(RequestError, match=f"(The|A) guide sound.*{refused}"):
            add_guide(plain, 0, frames=picture(1)[0], audio_vae=audio_vae, waveform=waveform, sample_rate=rate)


def test_encode_request_refuses_guide_files_it_does_not_read():
    from h3_core.guides import GuideFile

    states, tags = text()
    request = Request("t2va", "a fox", width=WIDTH, height=HEIGHT, num_frames=FRAMES,
                      guides=[GuideFile(0, "image", "frame.png")])
    with pytest.raises(RequestError, match="does not read guide files: add each .* with guides.add_guide"):
        encode_request(request, text_states=states, text_tags=tags, rules=TINY_CANVAS)


def test_generate_takes_guides_from_files_and_from_memory_alike(tmp_path):
    """A plain request's guides may be files or GuideMedia (as a long video's are): a GuideMedia failed with an
    AttributeError, anything else too instead of a RequestError."""
    from h3_core.guides import GuideFile, GuideMedia
    from h3_core.pipeline import GenerateSettings, generate

    image = picture(3)[0]
    Image.fromarray(image).save(tmp_path / "guide.png")
    results = {}
    for name, guide in (("file", GuideFile(30, "image", tmp_path / "guide.png")), ("memory", GuideMedia(30, image))):
        request = Request("t2va", "a fox", width=WIDTH, height=HEIGHT, num_frames=FRAMES, guides=[guide])
        (results[name],) = generate(request, "tiny-random", GenerateSettings(steps=2),
                                    save_latents=tmp_path / f"{name}.safetensors")
    assert torch.equal(results["file"].latents.video, results["memory"].latents.video)
    request = Request("t2va", "a fox", width=WIDTH, height=HEIGHT, num_frames=FRAMES, guides=[(30, "image.png")])
    with pytest.raises(RequestError, match="A guide is a guides.GuideFile .* or a guides.GuideMedia .*, got tuple"):
        generate(request, "tiny-random", GenerateSettings(steps=2), save_latents=tmp_path / "x.safetensors")


def test_ref2va_guides_pack_before_the_references_from_the_target_origin(models):
    """In ref2va a guide's rows come after the text and before the references, timed from where the target
    starts (after the references' span); its latents and sound go before the references' in packed order."""
    dit, video_vae, audio_vae = models
    states, tags = text()
    request = Request("ref2va", "a fox", references=[("image", Image.fromarray(picture(7)[0]))], width=WIDTH,
                      height=HEIGHT, num_frames=FRAMES)
    plain = encode_request(request, video_vae=video_vae, text_states=states, text_tags=tags, rules=TINY_CANVAS)
    sound = np.random.default_rng(8).standard_normal((2, 32000)).astype(np.float32) * 0.1
    guided = add_guide(plain, 30, video_vae, audio_vae, frames=picture(9)[0], waveform=sound, sample_rate=32000)
    layout = guided.layout
    grid, _ = frame_grid(layout.latent_height, layout.latent_width)
    origin = TEXT_ROWS + 1.0  # one image reference advances the clock by 1
    guide_rows = slice(TEXT_ROWS, TEXT_ROWS + grid.shape[0])
    assert torch.equal(layout.position_ids[guide_rows, 0], torch.full((grid.shape[0],), origin + 50.0, dtype=torch.float64))
    assert torch.equal(layout.position_ids[guide_rows.stop, 0], torch.tensor(origin + 50.0, dtype=torch.float64))
    assert guided.visual_condition_latents[1] is plain.visual_condition_latents[0]  # the reference, after the guide
    assert guided.audio_condition_rows.shape[1] == 2 * guided.guides[0].audio_latents == 2 * 40
    out = sample(dit, guided, seed=2, steps=3)
    assert not torch.equal(out.video, sample(dit, plain, seed=2, steps=3).video)


def test_sound_guides_pack_in_the_order_added_before_the_references_sound(models):
    """ref2va with a reference sound and two guide sounds: the audio condition rows are the first guide's, the
    second's (placed after every sound guided before it), then the reference's."""
    _, video_vae, audio_vae = models
    states, tags = text()
    rng = np.random.default_rng(11)
    voice, first, second = (rng.standard_normal((2, 32000 * seconds)).astype(np.float32) * 0.1 for seconds in (3, 1, 1))
    references = [("image", Image.fromarray(picture(7)[0])), ("audio", DecodedAudio(voice, 32000))]
    request = Request("ref2va", "a fox", references=references, width=WIDTH, height=HEIGHT, num_frames=FRAMES)
    plain = encode_request(request, video_vae=video_vae, audio_vae=audio_vae, text_states=states, text_tags=tags,
                           rules=TINY_CANVAS)
    heard = plain.audio_condition_rows
    alone = [add_guide(plain, frame, audio_vae=audio_vae, waveform=sound, sample_rate=32000)
             for frame, sound in ((0, first), (60, second))]
    own = [guided.audio_condition_rows[:, : guided.audio_condition_rows.shape[1] - heard.shape[1]] for guided in alone]
    assert heard.shape[1] > 0 and all(rows.shape[1] > 0 for rows in own)
    assert all(torch.equal(guided.audio_condition_rows[:, rows.shape[1]:], heard) for guided, rows in zip(alone, own))
    both = add_guide(alone[0], 60, audio_vae=audio_vae, waveform=second, sample_rate=32000)
    assert torch.equal(both.audio_condition_rows, torch.cat([*own, heard], 1))
