"""Our ladders and Euler steps equal diffusers' MiniMaxH3Scheduler exactly."""

import pytest
import torch
from diffusers import MiniMaxH3Scheduler

from h3_core.sampler import DualClockSchedule, check_shift, custom_ladder, euler_step, sigma_ladder


@pytest.mark.parametrize("points", [50, 9, 5])
@pytest.mark.parametrize("shift", [12.0, 6.0, 3.0])
def test_ladder_equals_reference(points, shift):
    reference = MiniMaxH3Scheduler(shift=shift)
    reference.set_timesteps(points)
    ours = sigma_ladder(points, shift)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, reference.sigmas)
    assert torch.equal(1.0 - ours[:-1], reference.timesteps)


def test_ladder_fact_sheet_values():
    assert torch.allclose(sigma_ladder(5, 12.0), torch.tensor([1.0, 0.97297, 0.92308, 0.8, 0.0]), atol=1e-5)
    assert torch.allclose(sigma_ladder(9, 3.0), torch.tensor([1.0, 0.95455, 0.9, 0.83333, 0.75, 0.64286, 0.5, 0.3, 0.0]), atol=1e-5)
    video = sigma_ladder(50, 12.0)
    assert video.numel() == 50 and video[-2].item() == pytest.approx(0.2, abs=1e-6)


def test_duplicates_collapse_like_reference():
    # A huge shift pushes the top of the grid to 1.0 in fp32: duplicates collapse to fewer points.
    reference = MiniMaxH3Scheduler(shift=1e9)
    reference.set_timesteps(50)
    ours = sigma_ladder(50, 1e9)
    assert ours.numel() < 50
    assert torch.equal(ours, reference.sigmas)


def test_schedule_walks_the_shorter_ladder():
    schedule = DualClockSchedule.build(steps=5, video_sigmas=[1.0, 0.5, 0.0])
    assert schedule.num_calls == 2
    assert DualClockSchedule.build(steps=50).num_calls == 49


@pytest.mark.parametrize("bad", [5.5, 1, 0])
def test_bad_step_counts_are_refused(bad):
    with pytest.raises(ValueError, match="sigma points"):
        sigma_ladder(bad, 12.0)


@pytest.mark.parametrize("bad", [[1.0, 0.5], [0.5, 0.7, 0.0], [1.0], [2.0, 0.0]])
def test_bad_custom_sigmas_are_refused(bad):
    with pytest.raises(ValueError, match="sigmas"):
        custom_ladder(bad)


def test_the_shortest_custom_ladder_is_one_step():
    assert custom_ladder([0.5, 0.0]).tolist() == [0.5, 0.0]
    assert DualClockSchedule.build(video_sigmas=[0.5, 0.0], audio_sigmas=[0.25, 0.0]).num_calls == 1


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_shift_must_be_a_positive_finite_number(bad):
    with pytest.raises(ValueError, match=f"video_shift must be a positive number, got {bad}"):
        DualClockSchedule.build(5, video_shift=bad)
    with pytest.raises(ValueError, match=f"audio_shift must be a number from 0.01 to 100, got {bad}"):
        check_shift(bad, "audio_shift", bounded=True)


def test_custom_sigmas_equal_reference():
    sigmas = [0.9999, 0.98579, 0.96758, 0.94317, 0.90909, 0.85714, 0.76923, 0.58824, 0.0]
    reference = MiniMaxH3Scheduler()
    reference.set_timesteps(sigmas=sigmas)
    assert torch.equal(custom_ladder(sigmas), reference.sigmas)


@pytest.mark.parametrize("shift", [12.0, 3.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_euler_steps_equal_reference(shift, dtype):
    reference = MiniMaxH3Scheduler(shift=shift)
    reference.set_timesteps(9)
    sigmas = sigma_ladder(9, shift)
    x_ref = torch.randn(37, 96).to(dtype)
    x_ours = x_ref.clone()
    for step, t in enumerate(reference.timesteps):
        velocity = torch.randn(37, 96)
        x_ref = reference.step(velocity, t, x_ref, return_dict=False)[0]
        x_ours = euler_step(x_ours, velocity, 1.0 - sigmas[step], sigmas[step], sigmas[step + 1])
        assert x_ours.dtype == dtype
        assert torch.equal(x_ours, x_ref), f"step {step}"


def test_euler_last_step_returns_the_x0_estimate():
    x, v = torch.randn(10), torch.randn(10)
    sigma = torch.tensor(0.2)
    out = euler_step(x, v, 1.0 - sigma, sigma, torch.tensor(0.0))
    assert torch.allclose(out, x + 0.2 * v, atol=1e-6)


def test_refining_starts_each_modality_at_its_first_sigma():
    """pipeline.start_rows: s * noise + (1 - s) * init per modality, in the packed row layouts (so s = 0
    would give back the init latents exactly), and a size mismatch is a clear error."""
    from h3_core.layout import build_request_layout, unpack_audio, unpatchify
    from h3_core.noise import request_generator, target_noise
    from h3_core.output import AVLatents
    from h3_core.pipeline import start_rows

    layout = build_request_layout(128, 64, 124, torch.ones(6, dtype=torch.long))
    generator = torch.Generator().manual_seed(5)
    init = AVLatents(torch.randn(1, 24, layout.latent_frames, layout.latent_height, layout.latent_width, generator=generator),
                     torch.randn(2, 32, layout.audio_latents, generator=generator))
    video_noise, audio_noise = target_noise(layout, request_generator(3))
    schedule = DualClockSchedule.build(9, denoise=0.5)
    s_video, s_audio = float(schedule.video[0]), float(schedule.audio[0])
    assert 0 < s_video < 1 and 0 < s_audio < 1
    video, audio = start_rows(init, layout, schedule, video_noise, audio_noise)
    clean_video = (video - s_video * video_noise) / (1 - s_video)
    clean_audio = (audio - s_audio * audio_noise) / (1 - s_audio)
    assert torch.allclose(unpatchify(clean_video, layout.latent_frames, layout.latent_height, layout.latent_width), init.video, atol=1e-5)
    assert torch.allclose(unpack_audio(clean_audio)[0], init.audio, atol=1e-5)
    narrow = AVLatents(init.video[..., :-1], init.audio)
    with pytest.raises(ValueError, match="same size and duration"):
        start_rows(narrow, layout, schedule, video_noise, audio_noise)


def test_refining_with_one_ladder_below_one_warns_that_the_other_is_made_anew(caplog):
    """A video ladder from 0.3 alone gives the audio an automatic ladder from 1.0: the given latent's sound is
    dropped and made from noise. That is the documented rule, but a refinement that loses half its input says so."""
    from h3_core.layout import build_request_layout
    from h3_core.noise import request_generator, target_noise
    from h3_core.output import AVLatents
    from h3_core.pipeline import start_rows

    layout = build_request_layout(128, 64, 124, torch.ones(6, dtype=torch.long))
    init = AVLatents(torch.zeros(1, 24, layout.latent_frames, layout.latent_height, layout.latent_width),
                     torch.zeros(2, 32, layout.audio_latents))
    noise = target_noise(layout, request_generator(3))
    with caplog.at_level("WARNING", logger="h3_core"):
        start_rows(init, layout, DualClockSchedule.build(video_sigmas=[0.3, 0.1, 0.0]), *noise)
    assert [r.getMessage() for r in caplog.records] == [
        "H3: only the video ladder starts below 1.0: the given latent's video is refined, its audio is made anew "
        "from noise; give it a ladder that starts lower too, or keep='audio' to hold it."]
    caplog.clear()
    with caplog.at_level("WARNING", logger="h3_core"):
        start_rows(init, layout, DualClockSchedule.build(9, denoise=0.5), *noise)
        start_rows(init, layout, DualClockSchedule.build(video_sigmas=[0.3, 0.1, 0.0], audio_sigmas=[0.5, 0.2, 0.0]),
                   *noise)
    assert not caplog.records


def test_custom_ladders_reach_zero_together():
    """One explicit ladder: the automatic other walks as many points (whatever steps says); two of different
    lengths are refused (walked together, the longer would stop short of 0)."""
    schedule = DualClockSchedule.build(50, video_sigmas=[1.0, 0.5, 0.0])
    assert schedule.num_calls == 2 and schedule.audio[-1].item() == 0.0 and schedule.audio.numel() == 3
    with pytest.raises(ValueError, match="video_sigmas has 3 points and audio_sigmas 4"):
        DualClockSchedule.build(video_sigmas=[1.0, 0.5, 0.0], audio_sigmas=[1.0, 0.7, 0.3, 0.0])


def test_denoise_takes_the_tail_of_a_longer_ladder():
    """denoise d with n points runs the last n of a ladder of round((n - 1) / d) intervals, as ComfyUI's
    KSampler runs the last `steps` of steps / denoise: 9 points at 0.5 are the last 9 of 17."""
    schedule = DualClockSchedule.build(9, denoise=0.5)
    assert torch.equal(schedule.video, sigma_ladder(17, 12.0)[-9:])
    assert torch.equal(schedule.audio, sigma_ladder(17, 3.0)[-9:])
    assert torch.equal(DualClockSchedule.build(9, denoise=1.0).video, sigma_ladder(9, 12.0))
    assert DualClockSchedule.build(5, denoise=0.3).video.numel() == 5  # round(4 / 0.3) = 13 intervals
    assert torch.equal(DualClockSchedule.build(5, denoise=0.3).video, sigma_ladder(14, 12.0)[-5:])


def test_a_denoise_that_rounds_to_the_whole_ladder_is_refused():
    """Turbo's 5 points at denoise 0.9 built the whole 5-point ladder (round(4 / 0.9) = 4 intervals): it started
    from pure noise, so the latent a refine needs was silently unused and the result equalled a fresh run."""
    for steps, denoise, most in ((5, 0.9, "0.88"), (2, 0.7, "0.66"), (9, 0.95, "0.94")):
        with pytest.raises(ValueError, match=f"rounds to the whole {steps}-point ladder.*Lower denoise to {most} "):
            DualClockSchedule.build(steps, denoise=denoise)
        assert DualClockSchedule.build(steps, denoise=float(most)).video[0] < 1.0


def test_a_small_denoise_is_bounded_by_the_steps_it_runs():
    """The cap on points is on what runs: 50 points at denoise 0.04 cut the end of a 1226-point ladder, which
    was refused as if 1226 steps had been asked for; an absurd denoise names denoise and the least it takes."""
    schedule = DualClockSchedule.build(50, denoise=0.04)
    reference = MiniMaxH3Scheduler(shift=12.0)
    reference.set_timesteps(1226)  # round(49 / 0.04) + 1
    assert schedule.num_calls == 49 and torch.equal(schedule.video, reference.sigmas[-50:])
    with pytest.raises(ValueError, match=r"denoise 1e-09 with 50 steps .* raise denoise to at least 0.00049"):
        DualClockSchedule.build(50, denoise=1e-9)
    with pytest.raises(ValueError, match="from 2 to 1000; got 1001"):
        DualClockSchedule.build(1001, denoise=0.5)


def test_custom_ladders_are_capped_like_automatic_ones():
    long = torch.linspace(1.0, 0.0, 1001)
    with pytest.raises(ValueError, match="Custom sigmas have 1001 points; at most 1000"):
        custom_ladder(long)
    with pytest.raises(ValueError, match="Custom sigmas have 1001 points"):
        DualClockSchedule.build(video_sigmas=long)
    assert DualClockSchedule.build(video_sigmas=long[:-1].tolist()[:999] + [0.0]).num_calls == 999


def test_preview_estimate_is_the_steps_own_clean_estimate():
    """The preview's x0 after a step (x_next + sigma_next * v) is the x0 the Euler step blended toward
    (x + sigma * v from the rows before it): checked at a middle step, where the velocity term is not zero."""
    from h3_core.conditioning import Request, encode_request
    from h3_core.layout import unpatchify
    from h3_core.pipeline import TINY_CANVAS, sample
    from h3_core.tiny import tiny_random_dit
    from h3_core.tiny_text import tiny_random_text_encoder

    cond = encode_request(Request("t2va", "a fox", duration=4.0), tiny_random_text_encoder(), rules=TINY_CANVAS)
    states = []

    def keep(state):
        states.append((state.video_rows.clone(), state.video_velocity.clone(), state.video_estimate_frame(),
                       state.video_estimate_frame(1)))

    sample(tiny_random_dit(), cond, 0, 5, callback=keep)
    layout, schedule = cond.layout, DualClockSchedule.build(5)
    (before, _, _, _), (_, velocity, estimate, second) = states[1], states[2]  # the third step: sigma > sigma_next > 0
    sigma = schedule.video[2]
    assert 0 < schedule.video[3] < sigma
    target = slice(layout.num_condition_video_rows, None)
    x0 = before[:, target] + sigma * velocity[:, target].float()
    clean = unpatchify(x0, layout.latent_frames, layout.latent_height, layout.latent_width)[0]
    assert torch.allclose(estimate, clean[:, layout.latent_frames // 2], atol=1e-5)
    assert torch.allclose(second, clean[:, 1], atol=1e-5)  # another frame than the middle one, counted from the start
    assert not torch.allclose(estimate, unpatchify(before[:, target], layout.latent_frames, layout.latent_height,
                                                   layout.latent_width)[0, :, layout.latent_frames // 2], atol=1e-2)
