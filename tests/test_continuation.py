"""The long-video window plan (h3-model.md G and the issue's examples)."""

import pytest
import torch

from h3_core import geometry
from h3_core.continuation import Timeline, audio_at, long_video_frames, plan_request, plan_windows


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
        ((481, 277, -12), "overlap frame count must be of the form 17n \\+ 5 .*got -12"),  # -12 % 17 is 5
    ],
)
def test_bad_plans_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        plan_windows(*args)


def test_duration_bounds():
    assert long_video_frames(300) == geometry.frames_for_duration(300)
    with pytest.raises(ValueError, match="300 s"):
        long_video_frames(301)
    with pytest.raises(ValueError, match="up to 30 s"):
        long_video_frames(31, mode="full")
    with pytest.raises(ValueError, match="4 s up to 300 s"):
        long_video_frames(3.9)
    with pytest.raises(ValueError, match="'continuation' or 'full'"):
        long_video_frames(10, mode="loop")


@pytest.mark.parametrize("sized", [True, False])
@pytest.mark.parametrize("window, overlap", [(277, 22), (107, 90)])
def test_the_timeline_hands_each_window_the_tail_of_the_clip_so_far(window, overlap, sized):
    """Guides are the last latents of the clip made so far (with a long overlap the tail spans several
    windows' parts); each window adds only what follows its overlap. Sized for the clip, the clip so far is
    a view of one tensor that later windows write after (never over), and the whole clip is that tensor."""
    windows = plan_windows(long_video_frames(30), window, overlap)
    total_latents = geometry.latent_frames(windows[-1].end)
    clip = torch.arange(total_latents, dtype=torch.float32).reshape(1, 1, -1, 1, 1)
    sound = torch.arange(geometry.audio_latents(windows[-1].end), dtype=torch.float32).expand(2, 1, -1)
    timeline = Timeline(windows[-1].end if sized else None)
    so_far = []
    for w in windows:
        if w.index:
            so_far.append(tuple(part.clone() for part in timeline.latents()) + timeline.latents())
        guide = timeline.guide(w)
        so_far_video = geometry.latent_frames(w.start + w.overlap) if w.index else 0
        so_far_audio = audio_at(w.start + w.overlap) if w.index else 0
        if w.index:
            assert torch.equal(guide[0], clip[:, :, so_far_video - w.guide_latent_frames : so_far_video])
            assert torch.equal(guide[1], sound[..., so_far_audio - w.guide_audio_latents : so_far_audio])
        # the window's own latents: the guide frames again, then the new ones
        first_video, first_audio = so_far_video - w.guide_latent_frames, so_far_audio - w.guide_audio_latents
        timeline.append(w, clip[:, :, first_video : first_video + w.latent_frames],
                        sound[..., first_audio : first_audio + w.audio_latents])
    video, audio = timeline.latents()
    assert torch.equal(video, clip) and torch.equal(audio, sound)
    for then_video, then_audio, view_video, view_audio in so_far:  # unchanged by the windows after
        assert torch.equal(view_video, then_video) and torch.equal(view_audio, then_audio)
        if sized:
            assert view_video.data_ptr() == video.data_ptr() and view_audio.data_ptr() == audio.data_ptr()
    assert not sized or (video.is_contiguous() and audio.is_contiguous())
    with pytest.raises(ValueError, match="does not continue"):
        timeline.append(windows[1], clip[:, :, : windows[1].latent_frames], sound[..., : windows[1].audio_latents])


def test_full_mode_is_one_window():
    assert [(w.start, w.end, w.overlap) for w in plan_request(481, "full")] == [(0, 481, 0)]
    assert [(w.start, w.end) for w in plan_request(481)] == [(0, 277), (255, 481)]
    with pytest.raises(ValueError, match="'continuation' or 'full'"):
        plan_request(481, "loop")
