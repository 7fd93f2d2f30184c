"""Whole requests against the diffusers modular pipeline: the same tiny random text encoder, VAEs and
DiT on both sides, the same seed; the final latents (what both hand to their decoders) must agree.

Our side is the engine path `h3 generate` runs (`encode_request` then `pipeline.sample`); the diffusers
side chains its own blocks from text encoding through the denoise loop to the after-denoise unpack.
fp32 on the CPU: the same operations in the same order, tolerance 1e-5 (observed: exact or ~1e-7).
"""

import numpy as np
import pytest
import torch
from diffusers import MiniMaxH3Scheduler
from diffusers.modular_pipelines.minimax_h3 import before_denoise as bd
from diffusers.modular_pipelines.minimax_h3.decoders import MiniMaxH3AfterDenoiseStep
from diffusers.modular_pipelines.minimax_h3.denoise import MiniMaxH3DenoiseStep, MiniMaxH3Ref2VADenoiseStep
from reference_checkpoints import reference_dit
from test_conditioning import (  # noqa: F401  (fixtures and helpers shared with the conditioning parity)
    PROMPT,
    SEED,
    TINY_RULES,
    audio_vaes,
    clip,
    picture,
    reference_processor,
    run_diffusers,
    sound,
    tiny_text,
    video_vaes,
)

from h3_core.checkpoint import convert_state_dict
from h3_core.conditioning import Request, encode_request
from h3_core.config import TINY_DIT
from h3_core.dit import H3DiT
from h3_core.pipeline import sample
from h3_core.references import DecodedAudio, DecodedVideo

STEPS = 3  # sigma points: 2 model calls, enough to carry every row through a step
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def dits():
    config = TINY_DIT.__class__(**{**TINY_DIT.to_dict(), "text_dim": 32, "patch_size": (1, 2, 2)})
    reference = reference_dit(config, seed=17)
    ours = H3DiT(config).eval().requires_grad_(False)
    ours.load_state_dict(convert_state_dict(reference.state_dict(), "diffusers", head_dim=config.attention_head_dim))
    return reference, ours


def denoise_blocks(ref2va: bool = False) -> dict:
    return {
        "timesteps": bd.MiniMaxH3SetTimestepsStep(),
        "denoise": MiniMaxH3Ref2VADenoiseStep() if ref2va else MiniMaxH3DenoiseStep(),
        "after": MiniMaxH3AfterDenoiseStep(),
    }


def components(tiny_text, dit, **extra) -> dict:
    presenter = tiny_text["encoder"].presenter
    return {
        "text_encoder": tiny_text["model"],
        "tokenizer": presenter.tokenizer,
        "processor": reference_processor(presenter.vision, presenter.tokenizer),
        "audio_scheduler": MiniMaxH3Scheduler(shift=3.0),
        **dit,
        **extra,
    }


def assert_same_latents(ours, reference) -> None:
    assert ours.video.shape == reference["latents"].shape
    assert ours.audio.shape == reference["audio_latents"].shape
    assert (ours.video - reference["latents"]).abs().max().item() <= TOLERANCE
    assert (ours.audio - reference["audio_latents"]).abs().max().item() <= TOLERANCE


def test_t2va_end_to_end(tiny_text, dits):
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3TextEncoderStep

    reference_dit_, our_dit = dits
    reference = run_diffusers(
        {
            "text": MiniMaxH3TextEncoderStep(),
            "anchors": bd.MiniMaxH3NoKeyframeAnchorsStep(),
            "layout": bd.MiniMaxH3PrepareLayoutStep(),
            "noise": bd.MiniMaxH3PrepareLatentsStep(),
            **denoise_blocks(),
        },
        components(tiny_text, {"transformer": reference_dit_}),
        ["latents", "audio_latents"],
        prompt=PROMPT, height=64, width=96, num_frames=124, num_inference_steps=STEPS,
    )
    conditioning = encode_request(Request("t2va", PROMPT, width=96, height=64, num_frames=124), tiny_text["encoder"])
    assert_same_latents(sample(our_dit, conditioning, SEED, steps=STEPS), reference)


def test_fl2va_end_to_end(tiny_text, video_vaes, dits):
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3ResizeStep
    from diffusers.modular_pipelines.minimax_h3.encoders import (
        MiniMaxH3FL2VATextEncoderStep,
        MiniMaxH3KeyframeVaeEncoderStep,
    )

    reference_dit_, our_dit = dits
    reference_vae, our_vae = video_vaes
    first, last = picture(100, 70, seed=1), picture(70, 120, seed=2)
    reference = run_diffusers(
        {
            "resize": MiniMaxH3ResizeStep(),
            "text": MiniMaxH3FL2VATextEncoderStep(),
            "encode": MiniMaxH3KeyframeVaeEncoderStep(),
            "layout": bd.MiniMaxH3PrepareLayoutStep(),
            "conditions": bd.MiniMaxH3PrepareConditionLatentsStep(),
            "noise": bd.MiniMaxH3PrepareLatentsStep(),
            "fl2va": bd.MiniMaxH3FL2VAPrepareLatentsStep(),
            **denoise_blocks(),
        },
        components(tiny_text, {"transformer": reference_dit_}, vae=reference_vae),
        ["latents", "audio_latents"],
        prompt=PROMPT, image=first, last_image=last, num_frames=124, num_inference_steps=STEPS,
    )
    request = Request("fl2va", PROMPT, first_image=first, last_image=last, num_frames=124)
    conditioning = encode_request(request, tiny_text["encoder"], our_vae, rules=TINY_RULES)
    assert len(conditioning.visual_condition_latents) == 2
    assert_same_latents(sample(our_dit, conditioning, SEED, steps=STEPS), reference)


def test_ref2va_end_to_end(tiny_text, video_vaes, audio_vaes, dits):
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep
    from diffusers.modular_pipelines.minimax_h3.encoders import (
        MiniMaxH3Ref2VAReferenceEncoderStep,
        MiniMaxH3Ref2VATextEncoderStep,
    )
    from diffusers.modular_pipelines.minimax_h3.references import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )

    reference_dit_, our_dit = dits
    reference_vae, our_vae = video_vaes
    reference_audio_vae, our_audio_vae = audio_vaes
    frames, soundtrack = clip(60, 80, 48, seed=3), sound(2.5, 2, seed=4)
    image, voice = picture(90, 60, seed=5), sound(2.1, 1, seed=6)
    reference = run_diffusers(
        {
            "setup": MiniMaxH3Ref2VASetupStep(),
            "text": MiniMaxH3Ref2VATextEncoderStep(),
            "encode": MiniMaxH3Ref2VAReferenceEncoderStep(),
            "layout": bd.MiniMaxH3Ref2VAPrepareLayoutStep(),
            "conditions": bd.MiniMaxH3PrepareConditionLatentsStep(),
            "noise": bd.MiniMaxH3PrepareLatentsStep(),
            "ref2va": bd.MiniMaxH3Ref2VAPrepareLatentsStep(),
            **denoise_blocks(ref2va=True),
        },
        components(tiny_text, {"transformer_ref": reference_dit_}, vae=reference_vae, audio_vae=reference_audio_vae),
        ["latents", "audio_latents"],
        prompt=PROMPT,
        references=[
            MiniMaxH3ImageReference(image=image),
            MiniMaxH3VideoReference(frames=frames, fps=24.0, audio=torch.from_numpy(soundtrack), sample_rate=32000),
            MiniMaxH3AudioReference(audio=torch.from_numpy(voice), sample_rate=32000),
        ],
        num_frames=124,
        num_inference_steps=STEPS,
    )
    request = Request(
        "ref2va", PROMPT, num_frames=124,
        references=[
            ("image", image),
            ("video", DecodedVideo(frames, 24.0, soundtrack, 32000)),
            ("audio", DecodedAudio(np.asarray(voice), 32000)),
        ],
    )
    conditioning = encode_request(request, tiny_text["encoder"], our_vae, our_audio_vae, rules=TINY_RULES)
    assert conditioning.layout.num_condition_audio_rows > 0 and len(conditioning.visual_condition_latents) == 2
    assert_same_latents(sample(our_dit, conditioning, SEED, steps=STEPS), reference)


def test_every_engine_api_name_the_pipeline_docstring_lists_is_importable_from_it():
    import re

    import h3_core.pipeline as pipeline

    listed = [re.findall(r"\w+", line.split("(")[0]) for line in pipeline.__doc__.splitlines() if line.startswith("    ")]
    names = [name for line in listed for name in line]
    assert len(names) == 9 and "encode_request" in names and "load_dit" in names and "generate_batch" in names
    assert all(callable(getattr(pipeline, name, None)) for name in names), names


def test_the_tiny_model_computes_in_float32_on_the_cpu_and_as_asked_elsewhere():
    import torch

    from h3_core.tiny import tiny_model_dtype

    assert tiny_model_dtype("cpu", torch.bfloat16) == torch.float32 == tiny_model_dtype("cpu", None)
    assert tiny_model_dtype("cuda:1", torch.float16) == torch.float16
    assert tiny_model_dtype("cuda", None) == torch.bfloat16  # 'checkpoint' in the loader: the release's bf16
