"""Packed layout, row timesteps and patchify against h3-model.md A.4-A.6 and the diffusers reference."""

import dataclasses
import functools
import itertools
import math
import operator
import random

import numpy as np
import pytest
import torch

from h3_core import geometry, layout
from h3_core.layout import RowClock

before_denoise = pytest.importorskip("diffusers.modular_pipelines.minimax_h3.before_denoise")
from diffusers import MiniMaxH3Scheduler  # noqa: E402

ReferenceLayout = before_denoise.MiniMaxH3PrepareLayoutStep
ReferenceTimesteps = before_denoise.MiniMaxH3SetTimestepsStep

DURATIONS = (4, 8.7, 15)
ASPECTS = ("16:9", "9:16", "21:9")
ANCHORS = ((), ("first",), ("last",), ("first", "last"))


def random_text_tags(seed: int) -> torch.Tensor:
    """Random text length with a block of 0-tagged vision rows somewhere inside."""
    rng = random.Random(seed)
    length = rng.randint(40, 700)
    tags = torch.ones(length, dtype=torch.int64)
    start = rng.randint(0, length - 20)
    tags[start : start + rng.randint(5, 20)] = 0
    return tags


def reference_layout(tags, num_frames, latent_height, latent_width, anchors):
    return ReferenceLayout.build_packed_sequence(
        tags,
        geometry.latent_frames(num_frames),
        latent_height,
        latent_width,
        geometry.audio_latents(num_frames),
        patch_size=(1, 2, 2),
        audio_channels=2,
        audio_tag=2,
        video_tag=0,
        keyframe_anchors=anchors,
    )


def reference_row_timesteps(ref, num_text_rows, t_video, t_audio):
    _, _, video_indices, audio_indices, _, condition_video, condition_audio = ref
    return ReferenceTimesteps.build_row_timesteps(
        video_indices,
        audio_indices,
        condition_video,
        condition_audio,
        num_text_rows,
        t_video,
        t_audio,
        condition_video_timestep=max(t_video, 0.999),
        condition_audio_timestep=1.0,
    )


def real_timestep_pairs(steps: int = 50):
    """(t_video, t_audio) of the shift-12 / shift-3 schedules, as floats."""
    video, audio = MiniMaxH3Scheduler(shift=12.0), MiniMaxH3Scheduler(shift=3.0)
    video.set_timesteps(steps)
    audio.set_timesteps(steps)
    return [(float(tv), float(ta)) for tv, ta in zip(video.timesteps, audio.timesteps)]


# A subset of one real schedule plus edge values: both zero, equal clocks, t_video above the floor.
TIMESTEP_PAIRS = [(0.0, 0.0), (0.5, 0.5), (0.9995, 0.3), (1.0, 1.0)] + real_timestep_pairs()[1::6]


CASES = [
    (seconds, aspect, anchors, index)
    for index, (seconds, aspect, anchors) in enumerate(itertools.product(DURATIONS, ASPECTS, ANCHORS))
]


@pytest.mark.parametrize("seconds, aspect, anchors, seed", CASES)
def test_layout_and_row_timesteps_equal_reference(seconds, aspect, anchors, seed):
    width, height = geometry.canvas_size(aspect)
    num_frames = geometry.frames_for_duration(seconds)
    tags = random_text_tags(seed)
    ours = layout.build_request_layout(width, height, num_frames, tags, keyframe_anchors=anchors)
    latent_height, latent_width = geometry.latent_size(width, height)
    ref = reference_layout(tags, num_frames, latent_height, latent_width, anchors)
    position_ids, token_tags, video_indices, audio_indices, text_indices, condition_video, condition_audio = ref

    assert ours.position_ids.dtype == torch.float64
    assert torch.equal(ours.position_ids, position_ids)  # bitwise
    assert torch.equal(ours.token_tags, token_tags)
    assert torch.equal(ours.video_indices, video_indices)
    assert torch.equal(ours.audio_indices, audio_indices)
    assert torch.equal(ours.text_indices, text_indices)
    assert ours.num_condition_video_rows == condition_video
    assert ours.num_condition_audio_rows == condition_audio == 0
    assert ours.sequence_length == position_ids.shape[0]
    assert ours.num_text_rows == tags.shape[0]
    assert (ours.latent_frames, ours.latent_height, ours.latent_width, ours.audio_latents) == (
        geometry.latent_frames(num_frames),
        latent_height,
        latent_width,
        geometry.audio_latents(num_frames),
    )

    for t_video, t_audio in TIMESTEP_PAIRS:
        timesteps, indices = ours.row_timesteps(t_video, t_audio)
        ref_timesteps, ref_indices = reference_row_timesteps(ref, tags.shape[0], t_video, t_audio)
        assert timesteps.dtype == torch.float32 and indices.dtype == torch.int64
        assert torch.equal(timesteps, ref_timesteps), (t_video, t_audio)
        assert torch.equal(indices, ref_indices), (t_video, t_audio)


def test_row_timesteps_with_audio_condition_rows():
    # t2va has no audio conditioning; mark the first audio rows as references (as Ref2VA will) to
    # check all four clocks (K = 4) against the reference's count-based assignment.
    tags = random_text_tags(11)
    base = layout.build_request_layout(1344, 768, 124, tags, keyframe_anchors=("first",))
    row_clock = base.row_clock.clone()
    row_clock[base.audio_indices[:50]] = RowClock.AUDIO_CONDITION
    ours = dataclasses.replace(base, row_clock=row_clock, num_condition_audio_rows=50)
    ref = (None, None, base.video_indices, base.audio_indices, None, base.num_condition_video_rows, 50)
    for t_video, t_audio in TIMESTEP_PAIRS:
        timesteps, indices = ours.row_timesteps(t_video, t_audio)
        ref_timesteps, ref_indices = reference_row_timesteps(ref, tags.shape[0], t_video, t_audio)
        assert torch.equal(timesteps, ref_timesteps) and torch.equal(indices, ref_indices), (t_video, t_audio)
    assert ours.row_timesteps(0.2, 0.5)[0].tolist() == pytest.approx([0.2, 0.5, 0.999, 1.0])


def test_segment_order_and_clocks():
    tags = random_text_tags(7)
    ours = layout.build_request_layout(1344, 768, 124, tags, keyframe_anchors=("first", "last"))
    text_rows, rows_per_frame, audio_rows = tags.shape[0], 1008, 2 * 207
    condition_rows = 2 * rows_per_frame
    assert ours.sequence_length == text_rows + condition_rows + audio_rows + 37 * rows_per_frame
    assert torch.equal(ours.text_indices, torch.arange(text_rows))
    audio_start = text_rows + condition_rows
    video_start = audio_start + audio_rows
    assert torch.equal(ours.video_indices[:condition_rows], torch.arange(text_rows, audio_start))
    assert torch.equal(ours.audio_indices, torch.arange(audio_start, video_start))
    assert torch.equal(ours.target_video_indices, torch.arange(video_start, ours.sequence_length))
    assert torch.equal(ours.target_audio_indices, ours.audio_indices)

    clock = ours.row_clock
    assert bool((clock[ours.text_indices] == RowClock.VIDEO).all())
    assert bool((clock[ours.video_indices[:condition_rows]] == RowClock.VISUAL_CONDITION).all())
    assert bool((clock[ours.target_video_indices] == RowClock.VIDEO).all())
    assert bool((clock[ours.audio_indices] == RowClock.AUDIO).all())
    assert torch.equal(ours.token_tags[ours.text_indices], tags)


def test_number_of_distinct_timesteps():
    tags = random_text_tags(3)
    plain = layout.build_request_layout(1344, 768, 124, tags)
    keyframed = layout.build_request_layout(1344, 768, 124, tags, keyframe_anchors=("first",))
    assert plain.row_timesteps(0.0, 0.0)[0].tolist() == [0.0]
    assert torch.equal(keyframed.row_timesteps(0.0, 0.0)[0], torch.tensor([0.0, 0.999]))
    assert plain.row_timesteps(0.2, 0.5)[0].numel() == 2
    timesteps, indices = keyframed.row_timesteps(0.2, 0.5)
    assert torch.equal(timesteps, torch.tensor([0.2, 0.5, 0.999]))
    assert torch.equal(timesteps[indices[keyframed.target_audio_indices]], torch.full((414,), 0.5))
    assert torch.equal(timesteps[indices[keyframed.video_indices[:1008]]], torch.full((1008,), 0.999))
    # the floor is a floor: past it, keyframe rows follow the video clock
    assert keyframed.row_timesteps(0.9995, 0.5)[0].numel() == 2


def test_fact_sheet_positions_1344x768():
    tags = torch.ones(100, dtype=torch.int64)
    ours = layout.build_request_layout(1344, 768, 124, tags, keyframe_anchors=("last",))
    step = 64 / math.sqrt(48 * 84)  # 1.007905; h3-model.md A.6 rounds it to 1.00787
    target = ours.position_ids[ours.target_video_indices]
    first_frame = target[:1008].reshape(24, 42, 3)
    h_axis, w_axis = first_frame[:, 0, 1].numpy(), first_frame[0, :, 2].numpy()
    assert h_axis[0] == pytest.approx(3.90514, abs=1e-5)
    assert w_axis[0] == pytest.approx(-5.16601, abs=1e-5)
    assert np.allclose(np.diff(h_axis), step, rtol=0, atol=1e-12)
    assert np.allclose(np.diff(w_axis), step, rtol=0, atol=1e-12)
    assert np.allclose(np.diff(h_axis), 1.00787, atol=1e-4)
    # row-major over the grid: h constant along a row, w constant down a column
    assert bool((first_frame[:, :, 1] == first_frame[:, :1, 1]).all())
    assert bool((first_frame[:, :, 2] == first_frame[:1, :, 2]).all())

    frame_times = target[::1008, 0] - 100
    assert frame_times[:7].tolist() == pytest.approx([0, 5 / 3, 25 / 3, 15, 65 / 3, 85 / 3, 30], abs=1e-12)
    assert float(frame_times[-1]) == pytest.approx(200, abs=1e-9)  # last latent frame
    keyframe = ours.position_ids[ours.video_indices[:1008]]
    assert bool((keyframe[:, 0] == keyframe[0, 0]).all())
    assert float(keyframe[0, 0]) == pytest.approx(100 + 205, abs=1e-9)  # last pixel frame, not 200
    assert torch.equal(keyframe[:, 1:], target[:1008, 1:])

    audio = ours.position_ids[ours.audio_indices].reshape(2, 207, 3)
    assert torch.equal(audio[0, :, 0], 100 + torch.arange(207, dtype=torch.float64))
    assert torch.equal(audio[1, :, 0], audio[0, :, 0])
    assert bool((audio[:, :, 1] == 0).all())
    assert bool((audio[0, :, 2] == float(w_axis[0])).all()) and bool((audio[1, :, 2] == float(w_axis[-1])).all())

    text = ours.position_ids[ours.text_indices]
    assert torch.equal(text[:, 0], torch.arange(100, dtype=torch.float64)) and bool((text[:, 1:] == 0).all())


def test_square_canvas_spans_0_to_32():
    grid, w_axis = layout.frame_grid(48, 48, (1, 2, 2))
    assert w_axis[0] == 0.0 and w_axis[-1] < 32.0
    assert np.allclose(w_axis, np.arange(24) * 32 / 24, atol=1e-12)


def test_last_keyframe_uses_pairwise_summation():
    # For 32 latent frames (107 pixel frames) after 37 text rows the summation order shows in the
    # last bit; the reference's pairwise order is what must come out.
    tags = torch.ones(37, dtype=torch.int64)
    ours = layout.build_request_layout(1344, 768, 107, tags, keyframe_anchors=("last",))
    spans = [5 / 3 * (1, 4, 4, 4, 4)[k % 5] for k in range(32)]
    sequential_time = 37.0 + functools.reduce(operator.add, spans) - 5 / 3  # left to right (Python's sum
    # is compensated from 3.12 on)
    time = float(ours.position_ids[ours.video_indices[0], 0])
    ref = reference_layout(tags, 107, 48, 84, ("last",))
    assert time == float(ref[0][37, 0])
    assert time != sequential_time


def test_patchify_equals_reference_and_documents_the_row_layout():
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 24, 7, 8, 12, generator=generator)
    rows = layout.patchify(latents)
    assert rows.shape == (2, 7 * 4 * 6, 96)
    assert torch.equal(rows.reshape(-1, 96), before_denoise.patchify_video_latents(latents, (1, 2, 2)))
    # row (l, i, j) frame-major then row-major; value index c*4 + dh*2 + dw
    b, c, l, i, j, dh, dw = 1, 5, 3, 2, 4, 1, 0
    assert rows[b, l * 24 + i * 6 + j, c * 4 + dh * 2 + dw] == latents[b, c, l, 2 * i + dh, 2 * j + dw]
    assert torch.equal(layout.unpatchify(rows, 7, 8, 12), latents)


@pytest.mark.parametrize("patch_size", [(1, 1, 1), (2, 2, 2), (1, 2, 4)])
def test_patchify_other_patch_sizes(patch_size):
    latents = torch.randn(1, 3, 4, 8, 8)
    rows = layout.patchify(latents, patch_size)
    assert torch.equal(rows.reshape(-1, rows.shape[-1]), before_denoise.patchify_video_latents(latents, patch_size))
    assert torch.equal(layout.unpatchify(rows, 4, 8, 8, patch_size), latents)


def test_patchify_rejects_indivisible_latents():
    with pytest.raises(ValueError, match="patches"):
        layout.patchify(torch.zeros(1, 24, 3, 7, 8))


def test_to_moves_every_tensor():
    ours = layout.build_request_layout(768, 768, 124, torch.ones(10, dtype=torch.int64), ("first",))
    moved = ours.to("meta")
    for name in ("position_ids", "token_tags", "row_clock", "text_indices", "video_indices", "audio_indices"):
        assert getattr(moved, name).device.type == "meta", name
        assert getattr(ours, name).device.type == "cpu", name
    assert moved.position_ids.dtype == torch.float64
    assert moved.num_condition_video_rows == ours.num_condition_video_rows == 576


def test_bad_requests_are_rejected_clearly():
    tags = torch.ones(10, dtype=torch.int64)
    with pytest.raises(ValueError, match="'first', 'last'"):
        layout.build_request_layout(1344, 768, 124, tags, ("middle",))
    with pytest.raises(ValueError, match="once"):
        layout.build_request_layout(1344, 768, 124, tags, ("last", "last"))
    with pytest.raises(ValueError, match="text_tags"):
        layout.build_request_layout(1344, 768, 124, torch.tensor([1, 2, 1]))
    with pytest.raises(ValueError, match="17n \\+ 5"):
        layout.build_request_layout(1344, 768, 125, tags)
    with pytest.raises(ValueError, match="multiples of 32"):
        layout.build_request_layout(1360, 768, 124, tags)
    with pytest.raises(ValueError, match="patches"):
        layout.build_t2va_layout(tags, 37, 48, 83, 207)
