"""A whole tiny T2VA denoise (our layout, noise, DiT and sampler) equals diffusers' own core denoise
pipeline (its layout, noise draws, DiT and two MiniMaxH3Schedulers) for the same seed and weights."""

import pytest
import torch
from diffusers import MiniMaxH3Scheduler
from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3CoreDenoiseStep
from reference_checkpoints import reference_dit

from h3_core.checkpoint import convert_state_dict
from h3_core.dit import H3DiT
from h3_core.layout import build_request_layout, unpack_audio, unpatchify
from h3_core.noise import request_generator, target_noise
from h3_core.sampler import DualClockSchedule, denoise

WIDTH, HEIGHT, FRAMES = 96, 64, 124


@pytest.fixture(scope="module")
def models():
    from h3_core.config import TINY_DIT

    reference = reference_dit(TINY_DIT, seed=21)
    ours = H3DiT(TINY_DIT).eval().requires_grad_(False)
    ours.load_state_dict(convert_state_dict(reference.state_dict(), "diffusers", head_dim=32))
    return reference, ours


def run_reference(reference, text, tags, seed, steps):
    pipe = MiniMaxH3CoreDenoiseStep().init_pipeline()
    pipe.update_components(
        transformer=reference, scheduler=MiniMaxH3Scheduler(shift=12.0), audio_scheduler=MiniMaxH3Scheduler(shift=3.0)
    )
    out = pipe(
        prompt_embeds=text, text_token_tags=tags, height=HEIGHT, width=WIDTH, num_frames=FRAMES,
        num_inference_steps=steps, generator=torch.Generator().manual_seed(seed), output=["latents", "audio_latents"],
    )
    return out["latents"], out["audio_latents"]


def run_ours(ours, text, tags, seed, steps, callback=None):
    layout = build_request_layout(WIDTH, HEIGHT, FRAMES, tags)
    video, audio = target_noise(layout, request_generator(seed))
    video, audio = denoise(ours, layout, text, video, audio, DualClockSchedule.build(steps), callback)
    latents = unpatchify(video, layout.latent_frames, layout.latent_height, layout.latent_width)
    return latents, unpack_audio(audio)[0]


@pytest.mark.parametrize("steps", [2, 5])
def test_denoise_loop_equals_reference(models, steps):
    reference, ours = models
    text = torch.randn(1, 9, 48)
    tags = torch.tensor([1, 1, 0, 0, 0, 1, 1, 1, 1])
    with torch.no_grad():
        expected_video, expected_audio = run_reference(reference, text, tags, seed=7, steps=steps)
        video, audio = run_ours(ours, text, tags, seed=7, steps=steps)
    assert video.shape == expected_video.shape == (1, 24, 37, 4, 6)
    assert audio.shape == expected_audio.shape == (2, 32, 207)
    # Same ops in the same order in fp32: equal to 1e-5 (observed exact).
    assert (video - expected_video).abs().max().item() <= 1e-5
    assert (audio - expected_audio).abs().max().item() <= 1e-5
    # The loop really moved the latents away from the initial noise.
    noise_video, _ = target_noise(build_request_layout(WIDTH, HEIGHT, FRAMES, tags), request_generator(7))
    assert not torch.allclose(unpatchify(noise_video, 37, 4, 6), video, atol=1e-2)


def test_callback_sees_every_step_and_can_interrupt(models):
    _, ours = models
    text, tags = torch.randn(1, 5, 48), torch.ones(5, dtype=torch.long)
    seen = []
    with torch.no_grad():
        run_ours(ours, text, tags, seed=1, steps=5, callback=lambda s: seen.append((s.step, s.total)))
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]

    class Interrupted(Exception):
        pass

    def stop_after_two(state):
        if state.step == 2:
            raise Interrupted

    with torch.no_grad(), pytest.raises(Interrupted):
        run_ours(ours, text, tags, seed=1, steps=5, callback=stop_after_two)


@pytest.mark.parametrize("anchors", [("first",), ("last",), ("first", "last")])
def test_keyframe_conditioned_loop_equals_reference(models, anchors):
    """FL2VA rows: keyframes noised once to t = 0.999, clocked at max(t_v, 0.999) and never written."""
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3FL2VACoreDenoiseStep

    from h3_core.noise import condition_rows

    reference, ours = models
    text, tags = torch.randn(1, 6, 48), torch.tensor([1, 0, 0, 0, 1, 1])
    keyframes = [torch.randn(1, 24, 1, 4, 6) for _ in anchors]
    pipe = MiniMaxH3FL2VACoreDenoiseStep().init_pipeline()
    pipe.update_components(
        transformer=reference, scheduler=MiniMaxH3Scheduler(shift=12.0), audio_scheduler=MiniMaxH3Scheduler(shift=3.0)
    )
    with torch.no_grad():
        expected = pipe(
            prompt_embeds=text, text_token_tags=tags, height=HEIGHT, width=WIDTH, num_frames=FRAMES,
            keyframe_anchors=anchors, condition_latents=keyframes, num_inference_steps=4,
            generator=torch.Generator().manual_seed(3), output=["latents", "audio_latents"],
        )
        layout = build_request_layout(WIDTH, HEIGHT, FRAMES, tags, anchors)
        generator = request_generator(3)
        held = condition_rows(keyframes, generator)
        video, audio = target_noise(layout, generator)
        video = torch.cat([held, video], dim=1)
        video, audio = denoise(ours, layout, text, video, audio, DualClockSchedule.build(4))
    n = layout.num_condition_video_rows
    assert n == 6 * len(anchors)
    assert torch.equal(video[:, :n], held)  # conditioning rows are never written
    latents = unpatchify(video[:, n:], layout.latent_frames, layout.latent_height, layout.latent_width)
    assert (latents - expected["latents"]).abs().max().item() <= 1e-5
    assert (unpack_audio(audio)[0] - expected["audio_latents"]).abs().max().item() <= 1e-5


def test_only_a_seeds_low_32_bits_set_the_noise_as_the_help_says():
    """torch's CPU generator (which diffusers and ComfyUI's samplers draw from too) seeds from the low 32 bits; the
    seed's help and tooltips say so, since randomly drawn 64-bit seeds collide that way."""
    from h3_core.cli import build_parser
    from h3_core.noise import SEED_BITS

    def draw(seed):
        return torch.randn(8, generator=request_generator(seed))

    assert torch.equal(draw(5), draw(5 + 2**32)) and torch.equal(draw(0), draw(2**63))
    assert not torch.equal(draw(5), draw(6))
    assert "low 32 bits" in SEED_BITS
    generate = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    assert " ".join(SEED_BITS.split()) in " ".join(generate.split())
