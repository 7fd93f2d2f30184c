"""The packed sequence of a long-video window (h3-model.md A.4-A.6, G), checked against the fact sheet
by independent computation, and against diffusers' t2va / ref2va builders where a window is an ordinary
request (diffusers has no continuation: a window without guide and offset must be its layout, bitwise)."""

import math

import numpy as np
import pytest
import torch

from h3_core import geometry
from h3_core.continuation import long_video_frames, plan_windows
from h3_core.layout import (
    AUDIO_TAG,
    TEXT_TAG,
    VIDEO_TAG,
    ReferenceBlock,
    RowClock,
    build_ref2va_layout,
    build_t2va_layout,
    build_window_layout,
    frame_grid,
)
from test_layout_ref2va import reference_inputs  # what diffusers' ref2va builder reads

T = 40
LATENT = (48, 84)  # 1344x768
ROWS_PER_FRAME = 24 * 42
REFERENCES = [ReferenceBlock.video(12, 48, 64, audio_latents=120), ReferenceBlock.image(96, 64), ReferenceBlock.audio(90)]


def tags(length: int = T) -> torch.Tensor:
    out = torch.full((length,), TEXT_TAG, dtype=torch.int64)
    out[5:12] = VIDEO_TAG  # a vision block inside the text
    return out


def first_pixel_frame(k: int) -> int:
    """The fact sheet's p(k): the first pixel frame latent frame k covers."""
    return 17 * (k // 5) + [0, 1, 5, 9, 13][k % 5]


def fields(layout):
    return (layout.position_ids, layout.token_tags, layout.row_clock, layout.text_indices, layout.video_indices,
            layout.audio_indices, layout.num_condition_video_rows, layout.num_condition_audio_rows,
            layout.latent_frames, layout.latent_height, layout.latent_width, layout.audio_latents)


def assert_same(a, b):
    for x, y in zip(fields(a), fields(b), strict=True):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def window_layout(window, references=(), text=None, **options):
    return build_window_layout(
        tags() if text is None else text, references, window.latent_frames, *LATENT, window.audio_latents,
        time_offset=window.time_offset, guide_latent_frames=window.guide_latent_frames,
        guide_audio_latents=window.guide_audio_latents, **options,
    )


@pytest.mark.parametrize("frames", [107, 277, 362])
def test_a_plain_window_is_the_request_layout(frames):
    target = (geometry.latent_frames(frames), *LATENT, geometry.audio_latents(frames))
    assert_same(build_window_layout(tags(), (), *target), build_t2va_layout(tags(), *target))
    assert_same(build_window_layout(tags(), REFERENCES, *target), build_ref2va_layout(tags(), REFERENCES, *target))


def test_a_plain_window_equals_diffusers():
    before_denoise = pytest.importorskip("diffusers.modular_pipelines.minimax_h3.before_denoise")
    frames = 277
    target = (geometry.latent_frames(frames), *LATENT, geometry.audio_latents(frames))
    reference = before_denoise.MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        tags(), *target, patch_size=(1, 2, 2), audio_channels=2, audio_tag=AUDIO_TAG, video_tag=VIDEO_TAG,
        keyframe_anchors=())
    ours = build_window_layout(tags(), (), *target)
    assert torch.equal(ours.position_ids, reference[0]) and torch.equal(ours.token_tags, reference[1])
    assert torch.equal(ours.video_indices, reference[2]) and torch.equal(ours.audio_indices, reference[3])

    refs, visual, audio = reference_inputs(REFERENCES)
    reference = before_denoise.MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
        tags(), refs, visual, audio, *target, patch_size=(1, 2, 2), audio_channels=2, audio_tag=AUDIO_TAG,
        video_tag=VIDEO_TAG)
    ours = build_window_layout(tags(), REFERENCES, *target)
    assert torch.equal(ours.position_ids, reference[0]) and torch.equal(ours.token_tags, reference[1])
    assert (ours.num_condition_video_rows, ours.num_condition_audio_rows) == (reference[5], reference[6])


def test_the_offset_moves_media_rows_only():
    """start_frame * 40/24 on target, reference and guide audio/video; text and image references keep theirs."""
    window = plan_windows(long_video_frames(75))[2]  # starts at frame 510: offset 850
    assert window.time_offset == 850.0
    still = build_window_layout(tags(), REFERENCES, window.latent_frames, *LATENT, window.audio_latents)
    moved = build_window_layout(tags(), REFERENCES, window.latent_frames, *LATENT, window.audio_latents,
                                time_offset=window.time_offset)
    shift = moved.position_ids[:, 0] - still.position_ids[:, 0]
    assert torch.equal(moved.position_ids[:, 1:], still.position_ids[:, 1:])  # spatial coordinates untouched
    image_start = T + 2 * 120 + 12 * 32 * 24  # after text, the video reference's soundtrack and frames
    image_rows = torch.arange(image_start, image_start + 48 * 32)
    unmoved = torch.zeros(moved.sequence_length, dtype=torch.bool)
    unmoved[:T] = True
    unmoved[image_rows] = True
    assert bool((shift[unmoved] == 0).all())
    assert torch.allclose(shift[~unmoved], torch.full_like(shift[~unmoved], 850.0), rtol=0, atol=1e-9)
    assert bool((moved.position_ids[image_rows, 0] == T + 120).all())  # the image sits at the cursor after the video


def test_an_offset_between_latent_positions_is_not_rounded():
    """Windows of 141 frames (overlap 22) start at frame 119: an offset of 119 * 40/24 = 198.33 RoPE units, which
    media rows take as it is (the default windows start at multiples of 255, whose offsets are whole numbers)."""
    window = plan_windows(long_video_frames(10), 141, 22)[1]
    assert window.start == 119 and window.time_offset == 119 * 40 / 24
    still = build_window_layout(tags(), REFERENCES, window.latent_frames, *LATENT, window.audio_latents)
    moved = build_window_layout(tags(), REFERENCES, window.latent_frames, *LATENT, window.audio_latents,
                                time_offset=window.time_offset)
    shift = (moved.position_ids[:, 0] - still.position_ids[:, 0]).double()
    assert bool((shift[:T] == 0).all())
    target = shift[-window.latent_frames * ROWS_PER_FRAME:]  # the target video, last
    assert torch.allclose(target, torch.full_like(target, 119 * 40 / 24), rtol=0, atol=1e-4)


def test_guide_rows_sit_at_the_new_origin():
    """Window 2 of a 20 s clip: [text | 7 guide frames | 2 x 37 guide audio | target audio | target video]."""
    _, window = plan_windows(long_video_frames(20))
    layout = window_layout(window)
    guide_video, guide_audio = 7 * ROWS_PER_FRAME, 2 * 37
    assert (window.guide_latent_frames, window.guide_audio_latents) == (7, 37)
    target_audio, target_video = 2 * window.audio_latents, window.latent_frames * ROWS_PER_FRAME
    assert layout.sequence_length == T + guide_video + guide_audio + target_audio + target_video
    # order, tags and clocks, segment by segment
    segments = [(T, None, RowClock.VIDEO), (guide_video, VIDEO_TAG, RowClock.VISUAL_CONDITION),
                (guide_audio, AUDIO_TAG, RowClock.AUDIO_CONDITION), (target_audio, AUDIO_TAG, RowClock.AUDIO),
                (target_video, VIDEO_TAG, RowClock.VIDEO)]
    start = 0
    for count, tag, clock in segments:
        rows = slice(start, start + count)
        if tag is not None:
            assert bool((layout.token_tags[rows] == tag).all())
        assert bool((layout.row_clock[rows] == clock).all())
        start += count
    assert (layout.num_condition_video_rows, layout.num_condition_audio_rows) == (guide_video, guide_audio)

    # positions from the fact sheet: origin T + 255 * 40/24 = T + 425 for guides and target alike
    origin = T + 425.0
    t = layout.position_ids[:, 0]
    video_t = t[T : T + guide_video].reshape(7, ROWS_PER_FRAME)
    expected = torch.tensor([origin + 5 / 3 * first_pixel_frame(k) for k in range(7)], dtype=torch.float64)
    assert torch.allclose(video_t, expected[:, None].expand(7, ROWS_PER_FRAME), rtol=0, atol=1e-9)
    _, w_axis = frame_grid(*LATENT)
    audio = layout.position_ids[T + guide_video : T + guide_video + guide_audio].reshape(2, 37, 3)
    assert torch.equal(audio[:, :, 0], (origin + torch.arange(37, dtype=torch.float64)).expand(2, 37))
    assert bool((audio[:, :, 1] == 0).all())
    assert bool((audio[0, :, 2] == w_axis[0]).all()) and bool((audio[1, :, 2] == w_axis[-1]).all())
    assert t[layout.target_audio_indices[0]].item() == origin
    assert t[layout.target_video_indices[0]].item() == origin
    # the guide takes max(t_video, 0.999), its audio 1.0, as references do
    timesteps, index = layout.row_timesteps(0.3, 0.6)
    assert torch.allclose(timesteps[index[T]], torch.tensor(0.999))
    assert timesteps[index[T + guide_video]].item() == 1.0


def test_the_tail_keeps_its_global_time():
    """Guide rows of window k + 1 sit where the same frames sat in window k: positions count on globally."""
    windows = plan_windows(long_video_frames(75))
    for previous, window in zip(windows, windows[1:]):
        before, after = window_layout(previous), window_layout(window)
        tail = before.position_ids[before.target_video_indices][-window.guide_latent_frames * ROWS_PER_FRAME :]
        guide = after.position_ids[after.video_indices[: after.num_condition_video_rows]]
        assert torch.allclose(tail, guide, rtol=0, atol=1e-9)
        tail = before.position_ids[before.target_audio_indices].reshape(2, previous.audio_latents, 3)
        guide = after.position_ids[after.audio_indices[: after.num_condition_audio_rows]].reshape(2, -1, 3)
        assert torch.allclose(tail[:, -window.guide_audio_latents :], guide, rtol=0, atol=1e-9)


def test_guides_come_before_references_at_the_target_origin():
    _, window = plan_windows(long_video_frames(20))
    layout = window_layout(window, REFERENCES)
    cursor = T + max(120, 5 / 3 * sum([1, 4, 4, 4, 4] * 2 + [1, 4])) + 1 + 90  # video, image, audio refs advance
    t = layout.position_ids[:, 0]
    guide_video = 7 * ROWS_PER_FRAME
    assert math.isclose(t[T].item(), cursor + 425.0, abs_tol=1e-9)  # first guide row
    assert layout.token_tags[T + guide_video + 74 : T + guide_video + 74 + 240].eq(AUDIO_TAG).all()  # soundtrack next
    assert math.isclose(t[T + guide_video + 74].item(), T + 425.0, abs_tol=1e-9)  # the video reference, moved
    assert math.isclose(t[layout.target_video_indices[0]].item(), cursor + 425.0, abs_tol=1e-9)
    guide_rows = 7 * ROWS_PER_FRAME + 12 * 32 * 24 + 48 * 32
    assert layout.num_condition_video_rows == guide_rows
    assert layout.num_condition_audio_rows == 2 * (37 + 120 + 90)


def test_a_shared_origin_for_window_prompts():
    """A window with a shorter prompt still starts its media at the longest prompt's end."""
    window = plan_windows(long_video_frames(20))[0]
    short = window_layout(window, text=tags(25), media_origin=T)
    assert short.num_text_rows == 25
    assert short.position_ids[short.target_video_indices[0], 0].item() == float(T)
    assert torch.equal(short.position_ids[25:], window_layout(window).position_ids[T:])


def test_locked_audio_is_held_at_t1():
    _, window = plan_windows(long_video_frames(20))
    layout = window_layout(window).locked("audio")
    guide_audio = 2 * window.guide_audio_latents
    assert layout.num_condition_audio_rows == guide_audio + 2 * window.audio_latents
    assert layout.target_audio_indices.numel() == 0 and layout.audio_latents == window.audio_latents
    assert bool((layout.row_clock[layout.audio_indices] == RowClock.AUDIO_CONDITION).all())
    timesteps, index = layout.row_timesteps(0.0, 0.0)
    assert bool((timesteps[index[layout.audio_indices]] == 1.0).all())
    assert torch.equal(layout.position_ids, window_layout(window).position_ids)  # same places, another clock


@pytest.mark.parametrize("options, message", [
    ({"guide_latent_frames": 7}, "both video and audio"),
    ({"guide_audio_latents": 37}, "both video and audio"),
    ({"media_origin": T - 1}, "inside the text rows"),
])
def test_bad_windows_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        build_window_layout(tags(), (), 82, *LATENT, 462, **options)


def test_window_rows_stay_bounded_over_300_s():
    """However long the clip, no window's sequence is longer than a full window with its guide."""
    windows = plan_windows(long_video_frames(300))
    rows = [window_layout(window).sequence_length for window in windows]
    assert max(rows) == rows[1] == T + (7 + 82) * ROWS_PER_FRAME + 2 * (37 + 462)
    whole = geometry.latent_frames(windows[-1].end) * ROWS_PER_FRAME
    assert max(rows) < whole / 20
    assert np.all(np.diff([w.time_offset for w in windows]) == pytest.approx(255 * 5 / 3))
