"""Canvas sizes, frame grid and latent lengths against h3-model.md F and the diffusers reference."""

import pytest

from h3_core import geometry

reference = pytest.importorskip("diffusers.modular_pipelines.minimax_h3.modular_pipeline")

FACT_SHEET_CANVAS = {
    "21:9": (1536, 672),
    "16:9": (1344, 768),
    "4:3": (1024, 768),
    "1:1": (768, 768),
    "3:4": (768, 1024),
    "9:16": (768, 1344),
}

# seconds, frames, L, A (h3-model.md F, duration table)
FACT_SHEET_DURATIONS = [
    (4, 107, 32, 178),
    (5, 124, 37, 207),
    (6, 158, 47, 263),
    (8, 192, 57, 320),
    (8.7, 209, 62, 348),
    (10, 243, 72, 405),
    (12, 294, 87, 490),
    (14, 345, 102, 575),
    (15, 362, 107, 603),
]

ODD_RATIOS = [
    (2.35, 1), (1, 3.9), (1.85, 1), (3, 2), (2, 3), (1920, 1080), (1080, 1920), (4, 1), (1, 4), (5, 4), (7, 3)
]


def reference_canvas(aspect_width, aspect_height):
    height, width = reference.resolve_canvas_size(aspect_width, aspect_height, 32, 768, 768 * 1344)
    return width, height


def test_named_ratios_are_the_fact_sheet_table():
    assert set(geometry.ASPECT_RATIOS) == set(FACT_SHEET_CANVAS)
    for name, size in FACT_SHEET_CANVAS.items():
        assert geometry.canvas_size(name) == size, name


@pytest.mark.parametrize("name", sorted(FACT_SHEET_CANVAS))
def test_named_ratio_equals_reference(name):
    assert geometry.canvas_size(name) == reference_canvas(*geometry.ASPECT_RATIOS[name])


@pytest.mark.parametrize("aspect", ODD_RATIOS)
def test_arbitrary_ratio_equals_reference(aspect):
    width, height = geometry.canvas_size(aspect)
    assert (width, height) == reference_canvas(*aspect)
    geometry.check_canvas(width, height)  # every resolved canvas is a valid one


def test_canvas_size_is_width_then_height():
    width, height = geometry.canvas_size((2.35, 1))
    assert width > height
    assert geometry.canvas_size((1, 2.35)) == (height, width)


@pytest.mark.parametrize("aspect", [(4.01, 1), (1, 4.2), (10, 1)])
def test_out_of_range_ratio_is_rejected(aspect):
    with pytest.raises(ValueError, match="outside the supported range 1:4 to 4:1"):
        geometry.canvas_size(aspect)


@pytest.mark.parametrize("aspect", [(0, 1), (1, -2), (16, 0), (-16, 9), (-16, -9)])
def test_a_side_not_above_zero_is_named_before_the_ratio_is_taken(aspect):
    with pytest.raises(ValueError, match="needs a positive width and height"):
        geometry.canvas_size(aspect)


def test_unknown_name_lists_the_allowed_ones():
    with pytest.raises(ValueError, match="21:9, 16:9, 4:3, 1:1, 3:4, 9:16"):
        geometry.canvas_size("2:1")


def test_check_canvas_accepts_named_canvases():
    for size in FACT_SHEET_CANVAS.values():
        geometry.check_canvas(*size)


@pytest.mark.parametrize(
    "width, height, message",
    [
        (1000, 768, "multiples of 32"),
        (1344, 760, "multiples of 32"),
        (0, 768, "multiples of 32"),
        (3328, 768, "1:4 to 4:1"),
        (256, 1056, "1:4 to 4:1"),
        (4128, 2304, "each side is at most 4096"),
        (2304, 4128, "each side is at most 4096"),
    ],
)
def test_check_canvas_rejects_bad_sizes(width, height, message):
    with pytest.raises(ValueError, match=message):
        geometry.check_canvas(width, height)


def test_check_canvas_takes_the_largest_side_the_nodes_offer():
    geometry.check_canvas(geometry.MAX_CANVAS_EDGE, 2304)
    geometry.check_canvas(2304, geometry.MAX_CANVAS_EDGE)


@pytest.mark.parametrize("seconds, frames, latents, audio", FACT_SHEET_DURATIONS)
def test_duration_table(seconds, frames, latents, audio):
    assert geometry.frames_for_duration(seconds) == frames
    assert geometry.latent_frames(frames) == latents
    assert geometry.audio_latents(frames) == audio
    assert reference.align_num_frames(round(seconds * 24), 17, 5) == frames


def test_frames_for_duration_rounds_then_snaps_up():
    assert geometry.frames_for_duration(5.2) == 141  # 124.8 -> 125 -> 141 (round is inferred)
    assert geometry.frames_for_duration(5.18) == 124  # 124.32 -> 124 (ceil would give 141)
    assert geometry.frames_for_duration(5.0) == 124
    assert geometry.frames_for_duration(0.01) == 5
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive"):
            geometry.frames_for_duration(bad)


def test_frame_arithmetic_equals_reference_over_a_range():
    for n in range(1, 420):
        aligned = geometry.align_frames(n)
        assert aligned == reference.align_num_frames(n, 17, 5), n
        assert geometry.latent_frames(aligned) == reference.video_latent_num_frames(aligned, 17, 5), n
        assert geometry.audio_latents(n) == reference.audio_latent_num_frames(n), n
        assert geometry.audio_latents(n) == round(n * 5 / 3), n


def test_latent_frames_rejects_off_grid_counts():
    for frames in (123, 125, 0, 17):
        with pytest.raises(ValueError, match="17n \\+ 5"):
            geometry.latent_frames(frames)
    with pytest.raises(ValueError, match="frame count must be positive, got 0"):
        geometry.align_frames(0)


def test_latent_size_is_height_then_width():
    assert geometry.latent_size(1344, 768) == (48, 84)  # 24 * 42 = 1008 DiT rows per latent frame
    assert geometry.latent_size(768, 1344) == (84, 48)
    with pytest.raises(ValueError, match="multiples of 16"):
        geometry.latent_size(1000, 768)
    for width, height in ((0, 768), (1344, 0), (-16, 768)):
        with pytest.raises(ValueError, match="positive multiples of 16"):
            geometry.latent_size(width, height)


def test_duration_for_frames_is_their_length_to_a_tenth_and_resolves_to_them():
    """What a latent's length asks of H3 Conditioning's duration widget (0.1 steps): 124 frames (5.17 s) are 5.1 s
    (5.2 s resolves to 141)."""
    from h3_core.geometry import duration_for_frames, frames_for_duration

    assert [duration_for_frames(n) for n in (5, 22, 107, 124, 345)] == [0.2, 0.9, 4.4, 5.1, 14.3]
    for frames in range(5, 730, 17):
        assert frames_for_duration(duration_for_frames(frames)) == frames
        assert frames / 24 - 0.1 < duration_for_frames(frames) <= frames / 24
    with pytest.raises(ValueError, match="108 frames is not 17n \\+ 5"):
        duration_for_frames(108)


def test_floor_frames_and_pixel_frames_walk_the_17n_plus_5_grid():
    """floor_frames: the largest 17n + 5 not over a count (a clip cut to what the VAE takes unpadded);
    pixel_frames: what L = 5n + 2 latent frames decode to, the inverse of latent_frames."""
    grid = range(5, 1000, 17)
    for count in range(5, 1000):
        assert geometry.floor_frames(count) == max(frames for frames in grid if frames <= count)
    for frames in grid:
        assert geometry.pixel_frames(geometry.latent_frames(frames)) == frames
    assert [geometry.pixel_frames(latents) for latents in (2, 7, 32, 42)] == [5, 22, 107, 141]
