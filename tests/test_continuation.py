"""The long-video window plan (h3-model.md G and the issue's examples)."""

import pytest

from h3_core import geometry
from h3_core.continuation import long_video_frames, plan_windows


def test_seventy_five_seconds():
    frames = long_video_frames(75)
    assert frames == 1807
    windows = plan_windows(frames)
    assert [w.start for w in windows] == [0, 255, 510, 765, 1020, 1275, 1530]
    assert [w.time_offset for w in windows[:3]] == [0.0, 425.0, 850.0]
    assert windows[-1].end == 1807
    # Kept latents: the first window whole, each later one without its 7 guide frames -> 532 = L(1807).
    kept = windows[0].latent_frames + sum(w.latent_frames - w.guide_latent_frames for w in windows[1:])
    assert kept == 82 + 6 * 75 == geometry.latent_frames(1807) == 532
    # Audio on the cumulative timeline: the kept latents add up to the whole clip's, with no drift.
    kept_audio = windows[0].audio_latents + sum(w.audio_latents - w.guide_audio_latents for w in windows[1:])
    assert kept_audio == geometry.audio_latents(1807) == 3012


def test_twenty_seconds_has_a_shorter_last_window():
    windows = plan_windows(long_video_frames(20))
    assert [(w.start, w.end) for w in windows] == [(0, 277), (255, 481)]
    assert windows[1].frames == 226 and windows[1].latent_frames == 67
    assert windows[1].guide_latent_frames == 7
    assert windows[1].guide_audio_latents == geometry.audio_latents(277) - geometry.audio_latents(255)


def test_every_window_is_on_the_vae_grid():
    for total in (107, 277, 481, 1807, 7196):
        for w in plan_windows(total, 345, 39):
            assert w.frames % 17 == 5 and w.start % 17 == 0


def test_one_window_when_it_fits():
    assert [(w.start, w.end) for w in plan_windows(243)] == [(0, 243)]


@pytest.mark.parametrize(
    "args, message",
    [
        ((1800,), "17n \\+ 5"),
        ((1807, 276), "17n \\+ 5"),
        ((1807, 362), "107-345"),
        ((1807, 107, 107), "shorter than the window"),
        ((1807, 277, 20), "17n \\+ 5"),
    ],
)
def test_bad_plans_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        plan_windows(*args)


def test_duration_bounds():
    assert long_video_frames(300) == geometry.frames_for_duration(300)
    with pytest.raises(ValueError, match="300 s"):
        long_video_frames(301)
    with pytest.raises(ValueError, match="30 s"):
        long_video_frames(31, mode="full")
    with pytest.raises(ValueError, match="'continuation' or 'full'"):
        long_video_frames(10, mode="loop")
