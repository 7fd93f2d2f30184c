"""The Ref2VA packed layout against diffusers' `build_ref2va_packed_sequence` (h3-model.md A.4-A.6).

Positions are compared bitwise (float64), tags, index tensors and conditioning row counts exactly,
and the per-row timesteps against `build_row_timesteps` over real schedules (K = 4 with audio
references: t_video, t_audio, max(t_video, 0.999) and 1.0).
"""

from types import SimpleNamespace

import pytest
import torch

from h3_core import geometry
from h3_core.layout import (
    AUDIO_TAG,
    TEXT_TAG,
    VIDEO_TAG,
    ReferenceBlock,
    RowClock,
    build_ref2va_layout,
    reference_clock_advance,
)
from h3_core.sampler import DualClockSchedule

before_denoise = pytest.importorskip("diffusers.modular_pipelines.minimax_h3.before_denoise")
ReferenceLayout = before_denoise.MiniMaxH3Ref2VAPrepareLayoutStep
ReferenceTimesteps = before_denoise.MiniMaxH3SetTimestepsStep

# The target: 1344x768 (48x84 latents) unless a case says otherwise.
TARGET = (48, 84)
# A 16:9 image reference at the release's 2048 short edge: 3648x2048 pixels -> 128x228 latents.
IMAGE_2048 = ReferenceBlock.image(128, 228)
CASES = {
    "images only": [IMAGE_2048, ReferenceBlock.image(64, 64), ReferenceBlock.image(160, 96)],
    "image + audio": [ReferenceBlock.audio(83), IMAGE_2048, ReferenceBlock.audio(207)],
    "video with soundtrack": [ReferenceBlock.video(37, 48, 84, audio_latents=207)],
    "video without soundtrack": [ReferenceBlock.video(22, 40, 96)],
    # soundtrack longer than the video span (A_ref wins) and a >= 16-latent video (the sequential sum)
    "mixed order": [
        ReferenceBlock.video(12, 48, 64, audio_latents=120),
        ReferenceBlock.image(96, 64),
        ReferenceBlock.audio(90),
        ReferenceBlock.video(62, 48, 84),
        ReferenceBlock.video(17, 32, 48, audio_latents=30),
    ],
}


def text_tags(length: int = 75, vision: slice = slice(9, 40)) -> torch.Tensor:
    tags = torch.full((length,), TEXT_TAG, dtype=torch.int64)
    tags[vision] = VIDEO_TAG
    return tags


def reference_inputs(blocks):
    """What diffusers' builder reads: each reference's kind/has_audio and tensors of the encoded shapes."""
    references, visual, audio = [], [], []
    for block in blocks:
        has_audio = block.kind == "audio" or block.audio_latents > 0
        references.append(SimpleNamespace(kind=block.kind, has_audio=has_audio))
        if block.kind != "audio":
            visual.append(torch.zeros(1, 1, block.latent_frames, block.latent_height, block.latent_width))
        if has_audio:
            audio.append(torch.zeros(2 * block.audio_latents, 1))
    return references, visual, audio


def reference_layout(tags, blocks, num_frames=124, target=TARGET):
    references, visual, audio = reference_inputs(blocks)
    return ReferenceLayout.build_ref2va_packed_sequence(
        tags,
        references,
        visual,
        audio,
        geometry.latent_frames(num_frames),
        *target,
        geometry.audio_latents(num_frames),
        patch_size=(1, 2, 2),
        audio_channels=2,
        audio_tag=AUDIO_TAG,
        video_tag=VIDEO_TAG,
    )


def ours_layout(tags, blocks, num_frames=124, target=TARGET):
    return build_ref2va_layout(
        tags, blocks, geometry.latent_frames(num_frames), *target, geometry.audio_latents(num_frames)
    )


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("num_frames", [124, 362])
def test_layout_equals_reference(case, num_frames):
    tags = text_tags()
    blocks = CASES[case]
    ours = ours_layout(tags, blocks, num_frames)
    positions, token_tags, video_indices, audio_indices, text_indices, condition_video, condition_audio = (
        reference_layout(tags, blocks, num_frames)
    )
    assert ours.position_ids.dtype == positions.dtype == torch.float64
    assert torch.equal(ours.position_ids, positions)  # bitwise
    assert torch.equal(ours.token_tags, token_tags)
    assert torch.equal(ours.video_indices, video_indices)
    assert torch.equal(ours.audio_indices, audio_indices)
    assert torch.equal(ours.text_indices, text_indices)
    assert (ours.num_condition_video_rows, ours.num_condition_audio_rows) == (condition_video, condition_audio)
    assert ours.sequence_length == positions.shape[0]

    # the clocks: every conditioning row on its condition clock, every target row on its own
    clock = ours.row_clock
    assert bool((clock[ours.text_indices] == RowClock.VIDEO).all())
    assert bool((clock[video_indices[:condition_video]] == RowClock.VISUAL_CONDITION).all())
    assert bool((clock[video_indices[condition_video:]] == RowClock.VIDEO).all())
    assert bool((clock[audio_indices[:condition_audio]] == RowClock.AUDIO_CONDITION).all())
    assert bool((clock[audio_indices[condition_audio:]] == RowClock.AUDIO).all())


def test_row_order_and_clock_of_a_mixed_request():
    """The fact sheet's order, spelled out for [video+soundtrack, image, audio]: soundtrack rows, then
    the video's rows, then the image, then the standalone audio, then target audio, then target video."""
    video = ReferenceBlock.video(2, 4, 6, audio_latents=20)  # span(2) = 5/3 * (1 + 4) < 20: A wins
    image = ReferenceBlock.image(8, 8)
    audio = ReferenceBlock.audio(11)
    tags = text_tags(10, slice(2, 5))
    ours = build_ref2va_layout(tags, [video, image, audio], 7, 4, 6, 207)
    pieces = [(TEXT_TAG, 10), (AUDIO_TAG, 40), (VIDEO_TAG, 2 * 6), (VIDEO_TAG, 16), (AUDIO_TAG, 22)]
    pieces += [(AUDIO_TAG, 414), (VIDEO_TAG, 7 * 6)]
    order = torch.cat([torch.full((count,), tag) for tag, count in pieces])
    order[2:5] = VIDEO_TAG
    assert torch.equal(ours.token_tags, order)
    t, w = ours.position_ids[:, 0], ours.position_ids[:, 2]
    assert t[10].item() == t[50].item() == 10.0  # soundtrack and video start at the same cursor
    assert t[62].item() == 30.0  # the image at 10 + max(20, 25/3)
    assert t[78].item() == 31.0  # the audio after the image's single slot
    assert t[ours.target_audio_indices[0]].item() == t[ours.target_video_indices[0]].item() == 42.0
    # audio rows sit on extreme columns: the video's own grid for its soundtrack, the target's otherwise
    video_w = ours.position_ids[50:62, 2]
    assert w[10].item() == video_w.min().item() and w[49].item() == video_w.max().item()
    target_w = ours.position_ids[ours.target_video_indices, 2]
    assert w[78].item() == target_w.min().item() and w[99].item() == target_w.max().item()
    assert reference_clock_advance(video) == 20.0
    assert reference_clock_advance(audio) == 11.0 and reference_clock_advance(image) == 1.0
    assert reference_clock_advance(ReferenceBlock.video(7, 4, 6)) == 5 / 3 * 22


def test_row_timesteps_equal_reference_with_four_clocks():
    tags = text_tags()
    blocks = [ReferenceBlock.video(7, 8, 12, audio_latents=30), ReferenceBlock.image(8, 8), ReferenceBlock.audio(40)]
    ours = ours_layout(tags, blocks, target=(8, 12))
    _, _, video_indices, audio_indices, _, condition_video, condition_audio = reference_layout(
        tags, blocks, target=(8, 12)
    )
    schedule = DualClockSchedule.build(50)
    seen_four = False
    for step in range(schedule.num_calls):
        t_video, t_audio = (float(t) for t in schedule.timesteps(step))
        timesteps, indices = ours.row_timesteps(t_video, t_audio)
        expected_timesteps, expected_indices = ReferenceTimesteps.build_row_timesteps(
            video_indices,
            audio_indices,
            condition_video,
            condition_audio,
            tags.shape[0],
            t_video,
            t_audio,
            max(t_video, 0.999),
            1.0,
        )
        assert torch.equal(timesteps, expected_timesteps)
        assert torch.equal(indices, expected_indices)
        seen_four |= timesteps.numel() == 4
    assert seen_four
    assert ours.row_timesteps(0.2, 0.5)[0].tolist() == pytest.approx([0.2, 0.5, 0.999, 1.0])


@pytest.mark.parametrize(
    "blocks, target, match",
    [
        ([], TARGET, "at least one reference"),
        ([ReferenceBlock.image(7, 8)], TARGET, "does not divide"),
        ([ReferenceBlock.image(8, 8)], (48, 85), "does not divide"),
    ],
)
def test_layout_errors(blocks, target, match):
    with pytest.raises(ValueError, match=match):
        build_ref2va_layout(text_tags(), blocks, 37, *target, 207)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: ReferenceBlock("sound", audio_latents=3), "one of"),
        (lambda: ReferenceBlock.image(0, 8), "positive latent size"),
        (lambda: ReferenceBlock.audio(0), "audio latents only"),
        (lambda: ReferenceBlock("image", 2, 8, 8), "one latent frame"),
    ],
)
def test_reference_block_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()
