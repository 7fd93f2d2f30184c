"""The conditioning stage (h3_core.conditioning): request validation, geometry, and whole FL2VA / Ref2VA
conditionings against the diffusers 0.42.1 blocks that run before denoising.

End to end, both sides get the same tiny models: a Qwen3-VL (ours loaded from the release layout with
50 layers, diffusers' the 52-layer original), the tiny video VAE and the tiny audio VAE (ours loaded
from diffusers' weights), and the same canvas rules at tiny size (diffusers' `canvas_short_edge`,
`canvas_max_pixels` and `reference_image_short_edge` configs set to ours). Compared:
- geometry, token tags, layout (positions bitwise, tags, indices, condition row counts): exact;
- conditioning latents: exact (same moments, same seed-42 noise, same fp16 rounding);
- text states: 1e-5 absolute (test_text's tolerance: same transformers modules, same inputs);
- audio rows: 1e-5 absolute (test_vae_audio's tolerance for the posterior mean);
- the rows the sampler assembles from a Conditioning with the request seed (noise.condition_rows, then
  noise.target_noise) against diffusers' prepared `latents` / `audio_latents`: the video rows exactly
  where they are pure noise or mixed keyframes, the audio rows to 1e-5 (the audio conditioning).
Validation tests pass models that fail the test if touched: every limit is checked before any model.
"""

from __future__ import annotations

import dataclasses
import fractions
import math
import os
import wave
from pathlib import Path

import numpy as np
import pytest
import tiny_qwen
import torch
from audio_vae_checkpoints import TINY_AUDIO_VAE, reference_audio_vae, write_diffusers_folder
from PIL import Image
from test_text import reference_processor
from video_vae_checkpoints import reference_video_vae, tiny_config

from test_geometry import FACT_SHEET_DURATIONS
from h3_core import geometry
from h3_core.conditioning import (
    MAX_FRAMES,
    MIN_FRAMES,
    MIN_REQUESTED_FRAMES,
    Conditioning,
    PartNames,
    Request,
    RequestError,
    encode_request,
    resolve_num_frames,
    validate,
)
from h3_core.media_write import write_mp4
from h3_core.noise import condition_rows, request_generator, target_noise
from h3_core.references import CanvasRules, DecodedAudio, DecodedVideo, MediaReference, prepare_reference
from h3_core.text import load_text_encoder
from h3_core.vae_audio_checkpoint import load_audio_vae
from h3_core.vae_video import VideoVAE, encode_working_bytes
from h3_core.vae_video_checkpoint import convert_state_dict

PROMPT = "A red fox walks along the beach at sunset. <d>[English] Hello there.</d>"
TINY_RULES = CanvasRules(short_edge=64, max_pixels=64 * 128, reference_image_short_edge=64)
TEXT_ATOL = AUDIO_ATOL = 1e-5
SEED = 1234


def picture(width: int, height: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def clip(frames: int, width: int, height: int, seed: int) -> np.ndarray:
    """A smooth moving pattern (codec-friendly) with a little noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    out = np.empty((frames, height, width, 3), np.uint8)
    for index in range(frames):
        base = 128 + 100 * np.sin((x + 3 * index) / 7.0)[..., None] * np.array([1.0, -0.5, 0.3])
        out[index] = np.clip(base + 20 * np.cos(y / 5.0)[..., None] + rng.normal(0, 4, (height, width, 3)), 0, 255)
    return out


def sound(seconds: float, channels: int, seed: int, rate: int = 32000) -> np.ndarray:
    time = np.arange(round(seconds * rate)) / rate
    rng = np.random.default_rng(seed)
    tones = [np.sin(2 * math.pi * (220 + 110 * c) * time + c) for c in range(channels)]
    return (0.5 * np.stack(tones) + 0.1 * rng.standard_normal((channels, time.size))).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Models (tiny, shared weights)


@pytest.fixture(scope="module")
def tiny_text(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_qwen")
    tokenizer = tiny_qwen.write_tokenizer(root / "tokenizer")
    model = tiny_qwen.random_model(tiny_qwen.config_dict(tokenizer), seed=11)
    release = tiny_qwen.write_original_release(root / "MiniMax-H3", model, tokenizer)
    encoder = load_text_encoder(release, torch.float32)
    return {"model": model, "encoder": encoder}


@pytest.fixture(scope="module")
def video_vaes():
    config = tiny_config(seed=5)
    reference = reference_video_vae(config, seed=7)
    reference.enable_tiling(256, 256, 64, 64)  # the release's tiling, as ours is configured
    ours = VideoVAE(config).eval().requires_grad_(False)
    ours.load_state_dict(convert_state_dict(reference.state_dict(), "diffusers", config))
    return reference, ours


@pytest.fixture(scope="module")
def audio_vaes(tmp_path_factory):
    reference = reference_audio_vae(TINY_AUDIO_VAE, seed=3)
    ours = load_audio_vae(write_diffusers_folder(tmp_path_factory.mktemp("audio_vae") / "audio_vae", reference))
    return reference, ours


def run_diffusers(blocks: dict, components: dict, outputs: list[str], **inputs) -> dict:
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines import SequentialPipelineBlocks

    pipe = SequentialPipelineBlocks.from_blocks_dict(blocks).init_pipeline()
    pipe.update_components(
        scheduler=MiniMaxH3Scheduler(shift=12.0),
        canvas_short_edge=TINY_RULES.short_edge,
        canvas_max_pixels=TINY_RULES.max_pixels,
        **components,
    )
    if "reference_image_short_edge" in pipe.config:
        pipe.update_components(reference_image_short_edge=TINY_RULES.reference_image_short_edge)
    with torch.no_grad():
        return pipe(**inputs, generator=torch.Generator().manual_seed(SEED), output=outputs)


LAYOUT_OUTPUTS = [
    "height",
    "width",
    "num_frames",
    "prompt_embeds",
    "text_token_tags",
    "condition_latents",
    "position_ids",
    "token_tags",
    "video_indices",
    "audio_indices",
    "text_indices",
    "num_condition_video_rows",
    "num_condition_audio_rows",
    "latents",
    "audio_latents",
]


def assert_same_conditioning(ours: Conditioning, reference: dict, audio_rows: torch.Tensor | None) -> None:
    assert (ours.height, ours.width, ours.num_frames) == (
        reference["height"],
        reference["width"],
        reference["num_frames"],
    )
    # text
    assert torch.equal(ours.text_tags, reference["text_token_tags"])
    assert ours.text_states.shape == reference["prompt_embeds"].shape
    assert (ours.text_states - reference["prompt_embeds"]).abs().max().item() <= TEXT_ATOL
    # layout
    layout = ours.layout
    assert torch.equal(layout.position_ids, reference["position_ids"])
    assert torch.equal(layout.token_tags, reference["token_tags"])
    for name in ("video_indices", "audio_indices", "text_indices"):
        assert torch.equal(getattr(layout, name), reference[name]), name
    assert layout.num_condition_video_rows == reference["num_condition_video_rows"]
    assert layout.num_condition_audio_rows == reference["num_condition_audio_rows"]
    # conditions
    assert len(ours.visual_condition_latents) == len(reference["condition_latents"])
    for got, expected in zip(ours.visual_condition_latents, reference["condition_latents"], strict=True):
        assert got.dtype == torch.float32 and torch.equal(got, expected)
    assert ours.audio_condition_rows.shape[1] == layout.num_condition_audio_rows
    if audio_rows is not None:
        torch.testing.assert_close(ours.audio_condition_rows[0], audio_rows, atol=AUDIO_ATOL, rtol=0)

    # what the sampler builds from it with the request seed, against diffusers' prepared rows
    generator = request_generator(SEED)
    held = condition_rows(ours.visual_condition_latents, generator)
    video_noise, audio_noise = target_noise(layout, generator)
    video_rows = torch.cat([held, video_noise], dim=1)[0]
    audio_all = torch.cat([ours.audio_condition_rows, audio_noise], dim=1)[0]
    assert torch.equal(video_rows, reference["latents"])
    torch.testing.assert_close(audio_all, reference["audio_latents"], atol=AUDIO_ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------
# End to end against diffusers


@pytest.mark.parametrize(
    "keyframes",
    [
        pytest.param({"first_image": (100, 70), "last_image": (70, 120)}, id="first+last"),
        pytest.param({"last_image": (150, 60)}, id="last-only"),
    ],
)
def test_fl2va_equals_diffusers(tiny_text, video_vaes, keyframes):
    from diffusers.modular_pipelines.minimax_h3 import before_denoise as bd
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3ResizeStep
    from diffusers.modular_pipelines.minimax_h3.encoders import (
        MiniMaxH3FL2VATextEncoderStep,
        MiniMaxH3KeyframeVaeEncoderStep,
    )

    images = {name: picture(*size, seed=index) for index, (name, size) in enumerate(keyframes.items())}
    presenter = tiny_text["encoder"].presenter
    reference_vae, our_vae = video_vaes
    reference = run_diffusers(
        {
            "resize": MiniMaxH3ResizeStep(),
            "text": MiniMaxH3FL2VATextEncoderStep(),
            "encode": MiniMaxH3KeyframeVaeEncoderStep(),
            "layout": bd.MiniMaxH3PrepareLayoutStep(),
            "conditions": bd.MiniMaxH3PrepareConditionLatentsStep(),
            "noise": bd.MiniMaxH3PrepareLatentsStep(),
            "fl2va": bd.MiniMaxH3FL2VAPrepareLatentsStep(),
        },
        {
            "text_encoder": tiny_text["model"],
            "tokenizer": presenter.tokenizer,
            "processor": reference_processor(presenter.vision, presenter.tokenizer),
            "vae": reference_vae,
        },
        LAYOUT_OUTPUTS,
        prompt=PROMPT,
        image=images.get("first_image"),
        last_image=images.get("last_image"),
        num_frames=124,
    )
    request = Request("fl2va", PROMPT, duration=5.0, **images)
    ours = encode_request(request, tiny_text["encoder"], our_vae, rules=TINY_RULES)
    assert ours.task == "fl2va" and len(ours.visual_condition_latents) == len(images)
    assert_same_conditioning(ours, reference, None)


def _ref2va_media():
    """(ours, diffusers) reference pairs by name: a 30 fps 80x48 video with a mono soundtrack, the same
    video silent, two images of their own sizes, a stereo audio clip."""
    from diffusers.modular_pipelines.minimax_h3.references import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )

    frames, soundtrack = clip(75, 80, 48, seed=1), sound(2.5, 1, seed=2)
    image_a, image_b = picture(100, 70, seed=3), picture(70, 120, seed=4)
    voice = sound(2.2, 2, seed=5)
    return {
        "video+sound": (
            ("video", DecodedVideo(frames, 30.0, soundtrack, 32000)),
            MiniMaxH3VideoReference(frames=frames, fps=30.0, audio=torch.from_numpy(soundtrack), sample_rate=32000),
        ),
        "video": (("video", DecodedVideo(frames, 30.0)), MiniMaxH3VideoReference(frames=frames, fps=30.0)),
        "image_a": (("image", image_a), MiniMaxH3ImageReference(image=image_a)),
        "image_b": (("image", np.asarray(image_b)), MiniMaxH3ImageReference(image=image_b)),
        "audio": (
            ("audio", DecodedAudio(voice, 32000)),
            MiniMaxH3AudioReference(audio=torch.from_numpy(voice), sample_rate=32000),
        ),
    }


REF2VA_CASES = {  # the list: one image, two images, image+audio, a video with a soundtrack,
    # a video plus audio, and a mix of all three kinds
    "one image": ["image_a"],
    "two images": ["image_a", "image_b"],
    "image+audio": ["image_a", "audio"],
    "video with soundtrack": ["video+sound"],
    "video+audio": ["video", "audio"],
    "mix": ["video+sound", "image_a", "audio", "image_b"],
}


@pytest.mark.parametrize("case", list(REF2VA_CASES))
def test_ref2va_equals_diffusers(tiny_text, video_vaes, audio_vaes, case):
    from diffusers.modular_pipelines.minimax_h3 import before_denoise as bd
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep
    from diffusers.modular_pipelines.minimax_h3.encoders import (
        MiniMaxH3Ref2VAReferenceEncoderStep,
        MiniMaxH3Ref2VATextEncoderStep,
    )

    media = _ref2va_media()
    ours_refs = [media[name][0] for name in REF2VA_CASES[case]]
    diffusers_refs = [media[name][1] for name in REF2VA_CASES[case]]
    presenter = tiny_text["encoder"].presenter
    reference_vae, our_vae = video_vaes
    reference_audio_vae_, our_audio_vae = audio_vaes
    reference = run_diffusers(
        {
            "setup": MiniMaxH3Ref2VASetupStep(),
            "text": MiniMaxH3Ref2VATextEncoderStep(),
            "encode": MiniMaxH3Ref2VAReferenceEncoderStep(),
            "layout": bd.MiniMaxH3Ref2VAPrepareLayoutStep(),
            "conditions": bd.MiniMaxH3PrepareConditionLatentsStep(),
            "noise": bd.MiniMaxH3PrepareLatentsStep(),
            "ref2va": bd.MiniMaxH3Ref2VAPrepareLatentsStep(),
        },
        {
            "text_encoder": tiny_text["model"],
            "tokenizer": presenter.tokenizer,
            "processor": reference_processor(presenter.vision, presenter.tokenizer),
            "vae": reference_vae,
            "audio_vae": reference_audio_vae_,
        },
        [*LAYOUT_OUTPUTS, "audio_condition_latents"],
        prompt=PROMPT,
        references=diffusers_refs,
        num_frames=124,
    )
    request = Request("ref2va", PROMPT, references=ours_refs, num_frames=124)
    ours = encode_request(request, tiny_text["encoder"], our_vae, our_audio_vae, rules=TINY_RULES)
    assert (ours.width, ours.height) == TINY_RULES.canvas(16, 9)  # references never set the canvas
    audio_rows = reference["audio_condition_latents"]
    assert_same_conditioning(ours, reference, torch.cat(audio_rows) if audio_rows else None)
    if case == "mix":
        assert [z.shape[2] for z in ours.visual_condition_latents] == [17, 1, 1]  # 60 frames -> 56 -> 17 latents
        assert ours.layout.num_condition_audio_rows == 2 * (100 + 88)  # 2.5 s soundtrack, 2.2 s voice
        # the memory plan's blocks, from the media's sizes before any encode: the images' exactly, the video's
        # picture a second short (2.5 s -> 36 frames -> 22 -> 7 latents), sound left out; never more than encoded
        planned = validate(request, TINY_RULES).reference_blocks
        encoded = [block for block in ours.reference_blocks if block.kind != "audio"]
        assert [block.kind for block in planned] == [block.kind for block in encoded] == ["video", "image", "image"]
        assert planned[1:] == tuple(encoded[1:]) and planned[0].latent_frames == 7
        assert planned[0] == dataclasses.replace(encoded[0], latent_frames=7, audio_latents=0)


def test_precomputed_text_states_skip_the_encoder(tiny_text, video_vaes):
    request = Request("fl2va", PROMPT, first_image=picture(100, 70, 0), duration=5.0)
    with_encoder = encode_request(request, tiny_text["encoder"], video_vaes[1], rules=TINY_RULES)
    again = encode_request(
        request,
        video_vae=video_vaes[1],
        text_states=with_encoder.text_states,
        text_tags=with_encoder.text_tags,
        rules=TINY_RULES,
    )
    assert torch.equal(again.layout.position_ids, with_encoder.layout.position_ids)
    assert torch.equal(again.visual_condition_latents[0], with_encoder.visual_condition_latents[0])
    with pytest.raises(RequestError, match=r"\[1, T, D\]"):
        encode_request(
            request, video_vae=video_vaes[1], text_states=with_encoder.text_states[0], text_tags=with_encoder.text_tags
        )
    with pytest.raises(RequestError, match="not both"):
        encode_request(
            request,
            tiny_text["encoder"],
            video_vaes[1],
            text_states=with_encoder.text_states,
            text_tags=with_encoder.text_tags,
        )


def test_the_encoder_remembers_recent_prompts(tiny_text, video_vaes, monkeypatch):
    """The same prompt and pictures at another length or canvas run no encoder (their states are bitwise
    what a run gives); another prompt or picture does; a host hears before any model runs whether it will."""
    encoder = tiny_text["encoder"]
    encoder.forget()
    runs, told, media = [], [], []
    run = encoder._run
    monkeypatch.setattr(encoder, "_run", lambda *args: runs.append(1) or run(*args))

    def encode(request):
        return encode_request(request, encoder, video_vaes[1], rules=TINY_RULES,
                              before_models=lambda rows, nbytes: told.append(rows) or media.append(nbytes))

    first = picture(100, 70, 0)
    short = encode(Request("fl2va", PROMPT, first_image=first, duration=5.0))
    long = encode(Request("fl2va", PROMPT, first_image=first, duration=8.0))
    rows = short.text_states.shape[1]  # the presentation's rows: a host makes room for their encoding
    assert len(runs) == 1 and told == [rows, 0] and long.num_frames > short.num_frames
    # and for the video VAE's encode of the keyframe, on the canvas
    keyframe = encode_working_bytes(video_vaes[1].config, 1, short.height, short.width)
    assert media == [keyframe, keyframe] and keyframe > 0
    assert torch.equal(long.text_states, short.text_states) and torch.equal(long.text_tags, short.text_tags)
    assert long.text_states is not short.text_states  # each request owns its states
    encode(Request("fl2va", PROMPT + " Rain.", first_image=first, duration=5.0))
    encode(Request("fl2va", PROMPT, first_image=picture(100, 70, 1), duration=5.0))  # another picture
    assert len(runs) == 3 and all(told[2:]) and len(told) == 4
    encoder.forget()
    fresh = encode(Request("fl2va", PROMPT, first_image=first, duration=8.0))
    assert len(runs) == 4 and torch.equal(fresh.text_states, short.text_states)
    for prompt in ("a", "b", "c", "d"):  # four others push the first out
        encode(Request("fl2va", prompt, first_image=first, duration=5.0))
    encode(Request("fl2va", PROMPT, first_image=first, duration=5.0))
    assert told[-1] == rows


def test_t2va_conditioning_has_no_condition_rows(tiny_text):
    ours = encode_request(Request("t2va", PROMPT, aspect_ratio="9:16", duration=4), tiny_text["encoder"])
    assert (ours.width, ours.height, ours.num_frames) == (768, 1344, 107)
    assert ours.visual_condition_latents == [] and ours.audio_condition_rows.shape == (1, 0, 32)
    assert ours.layout.num_condition_video_rows == ours.layout.num_condition_audio_rows == 0
    assert ours.layout.latent_frames == 32 and ours.layout.audio_latents == 178


# ---------------------------------------------------------------------------------------------
# Geometry


@pytest.mark.parametrize(
    "first, last, canvas",
    [
        ((1920, 1080), None, (1344, 768)),  # 16:9 keyframe
        ((1080, 1920), (1920, 1080), (768, 1344)),  # the first decides, not the last
        ((1000, 1000), (1920, 1080), (768, 768)),
        (None, (800, 600), (1024, 768)),  # a last keyframe alone sets the canvas
        ((2100, 900), None, (1536, 672)),  # 21:9
    ],
)
def test_fl2va_canvas_follows_the_first_keyframe(first, last, canvas):
    images = {}
    if first:
        images["first_image"] = Image.new("RGB", first)
    if last:
        images["last_image"] = Image.new("RGB", last)
    plan = validate(Request("fl2va", PROMPT, **images))
    assert (plan.width, plan.height) == canvas
    assert [anchor for anchor, _ in plan.keyframes] == [a for a, k in (("first", first), ("last", last)) if k]
    # explicit size or a named ratio overrides the keyframe
    assert (validate(Request("fl2va", PROMPT, width=512, height=512, **images)).width) == 512
    assert (validate(Request("fl2va", PROMPT, aspect_ratio="4:3", **images)).height) == 768


def test_default_canvases():
    image = ("image", Image.new("RGB", (500, 2000)))
    plan = validate(Request("ref2va", PROMPT, references=[image]))
    assert (plan.width, plan.height) == (1344, 768)
    plan = validate(Request("ref2va", PROMPT, references=[image], aspect_ratio="auto"))
    assert (plan.width, plan.height) == (1344, 768)  # references never set the canvas
    plan = validate(Request("ref2va", PROMPT, references=[image], width=1024, height=576))
    assert (plan.width, plan.height) == (1024, 576)
    plan = validate(Request("t2va", PROMPT))
    assert (plan.width, plan.height, plan.num_frames) == (1344, 768, 124)  # 16:9, 5 s
    plan = validate(Request("t2va", PROMPT, aspect_ratio="21:9"))
    assert (plan.width, plan.height) == (1536, 672)


@pytest.mark.parametrize("seconds, frames, latents, audio", FACT_SHEET_DURATIONS)
def test_duration_table(seconds, frames, latents, audio):
    """h3-model.md F: round(s * 24), snapped up to 17n + 5."""
    plan = validate(Request("t2va", PROMPT, duration=seconds))
    assert plan.num_frames == frames == resolve_num_frames(num_frames=frames)
    assert geometry.latent_frames(frames) == latents and geometry.audio_latents(frames) == audio


def test_frame_count_bounds():
    assert (MIN_FRAMES, MAX_FRAMES) == (107, 362)
    assert resolve_num_frames(num_frames=91) == 107  # the smallest count that snaps into range
    assert MIN_REQUESTED_FRAMES == 91
    with pytest.raises(RequestError, match="91..362"):
        resolve_num_frames(num_frames=90)  # 90 = 17 * 5 + 5 is already aligned: 3.75 s
    assert resolve_num_frames(num_frames=346) == 362  # 362 = 15.083 s is accepted (vLLM-Omni, SGLang)
    assert resolve_num_frames() == 124


# ---------------------------------------------------------------------------------------------
# Validation: one test per limit, all before any model


class Untouchable:
    """A model that fails the test if anything of it is used."""

    def __getattr__(self, name):
        raise AssertionError(f"a model was used ({name}) before validation finished")

    def __call__(self, *args, **kwargs):
        raise AssertionError("a model was called before validation finished")


def untouchable(kind: type):
    """An Untouchable that passes for a `kind` (the VAE type checks) and fails the test if anything of it is used."""
    return object.__new__(type(f"Untouchable{kind.__name__}", (kind,),
                               {"__getattr__": Untouchable.__getattr__, "__call__": Untouchable.__call__}))


def assert_rejected(request: Request, *fragments: str) -> None:
    """encode_request refuses `request` before touching a model, with a message holding `fragments`."""
    model = Untouchable()
    with pytest.raises(RequestError) as caught:
        encode_request(request, model, model, model)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    with pytest.raises(RequestError):
        validate(request)


def write_wav(path: Path, seconds: float, rate: int = 32000, channels: int = 2) -> Path:
    samples = (sound(seconds, channels, 0, rate) * 16000).astype("<i2")
    with wave.open(str(path), "wb") as file:
        file.setnchannels(channels)
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes(samples.T.tobytes())
    return path


def video(seconds: float, fps: float = 24.0, width: int = 96, height: int = 64, audio: bool = False) -> DecodedVideo:
    frames = np.zeros((round(seconds * fps), height, width, 3), np.uint8)
    return DecodedVideo(frames, fps, np.zeros((2, round(seconds * 32000)), np.float32) if audio else None, 32000)


def audio(seconds: float, rate: int = 32000) -> DecodedAudio:
    return DecodedAudio(np.zeros((2, round(seconds * rate)), np.float32), rate)


IMAGE = ("image", Image.new("RGB", (96, 64)))


def test_rejects_unknown_task():
    assert_rejected(Request("i2v", PROMPT), "'i2v'", "t2va, fl2va, ref2va")


@pytest.mark.parametrize("prompt", ["", "   \n", None, "\u200b", " \ufeff\u200b "])  # invisible only too
def test_rejects_empty_prompt(prompt):
    assert_rejected(Request("t2va", prompt), "prompt is empty", "non-empty")


@pytest.mark.parametrize("prompt", [123, b"a fox", ["a fox"]])
def test_a_prompt_that_is_not_text_is_said_so(prompt):
    """It was refused as empty."""
    assert_rejected(Request("t2va", prompt), "The prompt must be text (a str)", type(prompt).__name__)


def test_a_prompt_is_blank_only_when_nothing_in_it_shows():
    """Characters this Python's Unicode tables do not know yet (emoji of Unicode 15 / 16) or private-use ones are
    text: refusing them as an empty prompt (as isprintable() would) would be wrong."""
    from h3_core.conditioning import blank

    assert not any(blank(p) for p in ("\U0001fae9", "\U0001fae8", "\U000f0000", "猫が走る", "🐱", "e\u0301", "a"))
    assert all(blank(p) for p in ("", " \n\t", "\u200b", "\ufeff", "\u200d\u2060", "\x00", None))


@pytest.mark.parametrize("token", ["<|image_pad|>", "<|vision_start|>", "<|video_pad|>"])
def test_rejects_the_text_encoders_picture_markers_in_a_prompt(token):
    """Typed into a prompt they would break the text encoder's picture accounting after it loaded."""
    assert_rejected(Request("t2va", f"A fox {token} on a beach."), token, "<Picture 1>")


@pytest.mark.parametrize("seconds", [3.9, 15.5, 0, float("nan"), -1])
def test_rejects_duration_out_of_range(seconds):
    assert_rejected(Request("t2va", PROMPT, duration=seconds), "between 4 and 15 seconds", repr(seconds))


@pytest.mark.parametrize("frames", [90, 363, 0])
def test_rejects_frame_count_out_of_range(frames):
    assert_rejected(Request("t2va", PROMPT, num_frames=frames), f"num_frames={frames}", "107 and 362")


def test_rejects_duration_and_frames_together():
    assert_rejected(Request("t2va", PROMPT, duration=5, num_frames=124), "not both")


@pytest.mark.parametrize(
    "size, fragments",
    [
        ((1000, 768), ("multiples of 32", "width=1000")),
        ((2048, 384), ("aspect ratio 5.33", "1:4 to 4:1")),
        ((1024, None), ("together",)),
    ],
)
def test_rejects_bad_canvas(size, fragments):
    assert_rejected(Request("t2va", PROMPT, width=size[0], height=size[1]), *fragments)


def test_rejects_a_keyframe_of_any_place_outside_1_to_4():
    """Not only the keyframe that sets the canvas: a follower (or one on a given canvas) is scaled whole to cover
    the canvas before its crop, so an 8000x2 last keyframe grew to a 3,072,000 x 768 image (6.6 GiB)."""
    wide, fine = Image.new("RGB", (8000, 2)), Image.new("RGB", (64, 64))
    assert_rejected(Request("fl2va", PROMPT, first_image=fine, last_image=wide), "last_image is 8000x2",
                    "aspect ratio 4e+03", "1:4 to 4:1")
    assert_rejected(Request("fl2va", PROMPT, first_image=wide, aspect_ratio="16:9"), "first_image is 8000x2")
    validate(Request("fl2va", PROMPT, first_image=fine, last_image=Image.new("RGB", (256, 64))))  # 4:1 is fine


def test_rejects_unknown_or_conflicting_aspect_ratio():
    assert_rejected(Request("t2va", PROMPT, aspect_ratio="5:4"), "'5:4'", "16:9")
    assert_rejected(Request("t2va", PROMPT, aspect_ratio="16:9", width=1024, height=576), "not both")


def test_t2va_takes_no_media():
    assert_rejected(Request("t2va", PROMPT, first_image=Image.new("RGB", (64, 64))), "t2va takes a prompt only")
    assert_rejected(Request("t2va", PROMPT, references=[IMAGE]), "t2va takes a prompt only")


def test_fl2va_needs_one_or_two_keyframes_and_no_references():
    assert_rejected(Request("fl2va", PROMPT), "fl2va needs 1 to 2 keyframes", "first_image, last_image or both")
    assert_rejected(
        Request("fl2va", PROMPT, first_image=Image.new("RGB", (64, 64)), references=[IMAGE]), "not references"
    )


def test_errors_name_the_parts_as_the_requests_front_end_named_them(tmp_path):
    """A Request's errors say its field names (first_image, references[1], the task), or the names a front end
    gave (the CLI's options, a node's sockets); the plan keeps them for errors found while encoding."""
    (tmp_path / "notes.txt").write_text("not a picture")
    bad = str(tmp_path / "notes.txt")
    front = PartNames("--start", "--end", ("ref A", "ref B"), "--mode", "with the long-clip tool")
    cases = (
        (dict(task="t2va", first_image=bad), "t2va takes a prompt only: first_image/last_image are fl2va keyframes and "
         "references are ref2va (set the task to", "--start/--end are fl2va keyframes and references are ref2va (set "
         "--mode to"),
        (dict(task="fl2va"), "keyframes: first_image, last_image or both", "keyframes: --start, --end or both"),
        (dict(task="fl2va", last_image=bad), "last_image: notes.txt is not an image", "--end: notes.txt is not an image"),
        (dict(task="ref2va", references=[IMAGE, ("image", bad)]), "references[1] (image): notes.txt",
         "ref B (image): notes.txt"),
        (dict(task="ref2va", references=[IMAGE, IMAGE, ("picture", bad)]), "references[2] has kind 'picture'",
         "references[2] has kind 'picture'"),  # a part the front end did not name keeps the field's name
        (dict(task="t2va", duration=30.0), "window by window in long-video mode)",
         "window by window with the long-clip tool)"),
    )
    for fields, plain, named in cases:
        for names, said in ((PartNames(), plain), (front, named)):
            with pytest.raises(RequestError) as refused:
                validate(Request(prompt=PROMPT, names=names, **fields))
            assert said in str(refused.value), (said, str(refused.value))
    request = Request("ref2va", PROMPT, references=[IMAGE], names=front)
    assert validate(request).names is front
    with pytest.raises(RequestError, match="names must be a PartNames, got dict"):
        validate(Request("t2va", PROMPT, names={"first_image": "--start"}))


def test_fl2va_keyframe_must_fit_the_ratio_range():
    assert_rejected(Request("fl2va", PROMPT, first_image=Image.new("RGB", (500, 100))), "first_image", "1:4 to 4:1")


def test_reference_image_sizing_is_checked_and_planned():
    plan = validate(Request("ref2va", PROMPT, references=[IMAGE], reference_images="canvas-lossy"))
    assert (plan.width, plan.height) == (1344, 768) and plan.reference_rules.reference_image_area == 1344 * 768
    assert validate(Request("ref2va", PROMPT, references=[IMAGE])).reference_rules.reference_image_area == 0
    assert_rejected(Request("ref2va", PROMPT, references=[IMAGE], reference_images="max"),
                    "Reference image sizing is one of release, canvas-lossy; got 'max'")


def test_ref2va_needs_references_and_no_keyframes():
    assert_rejected(Request("ref2va", PROMPT), "ref2va needs at least one")
    assert_rejected(
        Request("ref2va", PROMPT, references=[IMAGE], last_image=Image.new("RGB", (64, 64))),
        "not first_image/last_image",
    )


@pytest.mark.parametrize(
    "references, fragments",
    [
        ([IMAGE] * 10, ("at most 9 image references", "got 10")),
        ([IMAGE] + [("video", video(2))] * 4, ("at most 3 video references", "got 4")),
        ([IMAGE] + [("audio", audio(2))] * 4, ("at most 3 audio references", "got 4")),
        ([IMAGE] * 9 + [("audio", audio(2))] * 3 + [("video", video(2))], ("at most 12 references", "got 13")),
    ],
)
def test_rejects_too_many_references(references, fragments):
    assert_rejected(Request("ref2va", PROMPT, references=references), *fragments)


def test_rejects_audio_without_a_visual_reference():
    assert_rejected(Request("ref2va", PROMPT, references=[("audio", audio(3))]), "image or video reference beside it")


@pytest.mark.parametrize(
    "reference, fragments",
    [
        (("video", video(1.5)), ("references[1] (video)", "runs 1.500 s", "2-15 s each")),
        (("video", video(16)), ("runs 16.000 s", "2-15 s each")),
        (("audio", audio(1.9)), ("references[1] (audio)", "runs 1.900 s")),
        (("audio", audio(15.5)), ("runs 15.500 s",)),
        (("video", video(5), 3.5), ("runs 1.500 s from start_seconds=3.5",)),
        (("audio", audio(3), 1.5), ("runs 1.500 s from start_seconds=1.5",)),
    ],
)
def test_rejects_clip_lengths(reference, fragments):
    assert_rejected(Request("ref2va", PROMPT, references=[IMAGE, reference]), *fragments)


def test_rejects_clip_totals_but_measures_from_the_start():
    videos = [("video", video(6)), ("video", video(6)), ("video", video(4))]
    assert_rejected(Request("ref2va", PROMPT, references=videos), "video references run 16.000 s", "at most 15 s")
    audios = [IMAGE, ("audio", audio(8)), ("audio", audio(8))]
    assert_rejected(Request("ref2va", PROMPT, references=audios), "audio references run 16.000 s")
    # a soundtrack is part of its video, not an audio reference; start offsets shorten a clip
    fine = [("video", video(8, audio=True), 2.0), ("audio", audio(8)), ("video", video(9))]
    assert validate(Request("ref2va", PROMPT, references=fine)).references[0].start_seconds == 2.0


@pytest.mark.parametrize(
    "reference, fragments",
    [
        (("image", Image.new("RGB", (900, 200))), ("references[0] (image)", "900x200", "1:4 to 4:1")),
        (("video", video(3, width=300, height=64)), ("references[0] (video)", "300x64", "1:4 to 4:1")),
        (("image", np.zeros((64, 64, 4), np.uint8)), ("[H, W, 3]",)),
        (("image", "not-a-file.png"), ("no file at",)),
        (("image", os.path.dirname(__file__)), ("references[0] (image): ", "tests is a folder, not a file")),
        (("sticker", Image.new("RGB", (64, 64))), ("'sticker'", "('image', 'video', 'audio')")),
        (("video", DecodedVideo(np.zeros((48, 64, 64, 3), np.uint8), 0)), ("positive frame rate",)),
        (("video", DecodedVideo(np.zeros((48, 64, 64, 3), np.uint8), True)), ("frames per second", "bool True")),
        (("video", DecodedVideo(np.zeros((48, 64, 64, 3), np.uint8), "24")), ("frames per second", "str '24'")),
        (("audio", DecodedAudio(np.zeros((6, 64000), np.float32), 32000)), ("mono or stereo",)),
        (("video", np.zeros((48, 64, 64, 3), np.uint8)), ("DecodedVideo(frames, fps",)),
        (("audio", audio(3), -1.0), ("references[0] start_seconds", "finite number >= 0", "-1.0")),
        (("image", Image.new("RGB", (64, 64)), 2.0), ("is an image", "video and audio clips only")),
        ("image.png", ("references[0] must be a MediaReference or a tuple",)),
    ],
)
def test_rejects_unusable_media(reference, fragments):
    assert_rejected(Request("ref2va", PROMPT, references=[reference, IMAGE]), *fragments)


def test_a_video_in_memory_takes_any_real_frame_rate():
    """A numpy float (a rate read with numpy) or a Fraction (30000/1001) was refused as not positive."""
    clip = np.random.default_rng(0).integers(0, 256, (60, 64, 64, 3), np.uint8)
    plain = prepare_reference(MediaReference("video", DecodedVideo(clip, 30.0)), 124, TINY_RULES).frames
    assert plain.shape[0] == 48  # 2 s at 24 fps
    for rate in (np.float32(30.0), fractions.Fraction(30)):
        validate(Request("ref2va", PROMPT, references=[("video", DecodedVideo(clip, rate))]), TINY_RULES)
        prepared = prepare_reference(MediaReference("video", DecodedVideo(clip, rate)), 124, TINY_RULES)
        assert np.array_equal(prepared.frames, plain)


def test_rejects_files_of_unsupported_formats_sizes_or_corrupt(tmp_path):
    gif = tmp_path / "a.gif"
    Image.new("RGB", (64, 64)).save(gif)
    assert_rejected(Request("ref2va", PROMPT, references=[("image", gif)]), "a.gif is a GIF image", "JPEG, PNG, WEBP")
    huge = tmp_path / "huge.png"
    with open(huge, "wb") as file:
        file.truncate(31 * 2**20)
    assert_rejected(Request("ref2va", PROMPT, references=[("image", huge)]), "31.0 MiB", "at most 30 MiB")
    truncated = tmp_path / "cut.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(truncated)
    truncated.write_bytes(truncated.read_bytes()[:-200])
    assert_rejected(Request("fl2va", PROMPT, first_image=truncated), "first_image", "cut.png cannot be decoded")
    garbage = tmp_path / "clip.mp4"
    garbage.write_bytes(b"\x00\x01 not a video" * 100)
    assert_rejected(
        Request("ref2va", PROMPT, references=[IMAGE, ("video", garbage)]), "references[1] (video)", "clip.mp4"
    )
    wav = write_wav(tmp_path / "voice.wav", 3.0)
    assert_rejected(Request("ref2va", PROMPT, references=[IMAGE, ("video", wav)]), "voice.wav has no video stream")
    mp4 = tmp_path / "talk.mp4"
    write_mp4(mp4, np.zeros((72, 64, 96, 3), np.uint8), sound(3.0, 2, 1))
    assert_rejected(
        Request("ref2va", PROMPT, references=[IMAGE, ("audio", mp4)]), "talk.mp4 holds aac audio", "WAV (PCM) or MP3"
    )
    short_wav = write_wav(tmp_path / "short.wav", 1.0)
    assert_rejected(Request("ref2va", PROMPT, references=[IMAGE, ("audio", short_wav)]), "runs 1.000 s")
    big_wav = tmp_path / "big.wav"
    big_wav.write_bytes(wav.read_bytes() + bytes(16 * 2**20))
    assert_rejected(Request("ref2va", PROMPT, references=[IMAGE, ("audio", big_wav)]), "at most 15 MiB")


def write_uneven_mp4(path, frames: int, sound_seconds: float):
    """An MP4 whose picture and soundtrack differ in length (write_mp4 fits one to the other)."""
    import av

    with av.open(str(path), "w") as container:
        video = container.add_stream("libx264", rate=24)
        video.width, video.height, video.pix_fmt = 96, 64, "yuv420p"
        audio = container.add_stream("aac", rate=32000, layout="stereo")
        for index in range(frames):
            picture = av.VideoFrame.from_ndarray(np.full((64, 96, 3), index, np.uint8), format="rgb24")
            container.mux(video.encode(picture))
        container.mux(video.encode())
        samples = sound(sound_seconds, 2, 3)
        for start in range(0, samples.shape[1], 1024):
            chunk = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples[:, start:start + 1024]), format="fltp",
                                               layout="stereo")
            chunk.sample_rate, chunk.pts = 32000, start
            container.mux(audio.encode(chunk))
        container.mux(audio.encode())
    return path


def test_a_video_reference_is_as_long_as_its_picture_not_its_soundtrack(tmp_path):
    """A file lasts as long as its longest stream: a one-frame video with a 5 s soundtrack passed the length
    check and failed only after the text encoder ran."""
    still = write_uneven_mp4(tmp_path / "still.mp4", 1, 5.0)
    assert_rejected(Request("ref2va", PROMPT, references=[IMAGE, ("video", still)]), "references[1] (video)",
                    "runs 0.042 s", "2-15 s each")
    fine = write_uneven_mp4(tmp_path / "fine.mp4", 72, 5.0)
    assert validate(Request("ref2va", PROMPT, references=[IMAGE, ("video", fine)])).references[1].kind == "video"


def test_a_video_cut_short_is_refused_before_any_model_loads(tmp_path):
    """A file cut short (a broken download) keeps its header's length: it passed the checks and failed only after
    the text encoder ran, naming no file. Its packets say how much of it can be read."""
    whole = tmp_path / "whole.mp4"
    write_mp4(whole, np.random.default_rng(0).integers(0, 255, (120, 64, 96, 3), dtype=np.uint8), sound(5.0, 2, 1))
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 3])
    assert validate(Request("ref2va", PROMPT, references=[IMAGE, ("video", whole)])).references[1].kind == "video"
    assert_rejected(Request("ref2va", PROMPT, references=[IMAGE, ("video", cut)]), "references[1] (video)",
                    "cut.mp4 holds", "though its header says 5.00 s: the file is cut short or damaged")
    # a whole video that starts late, in a container that counts its stated length from 0 s (Matroska, WebM, FLV)
    import av

    for fmt in ("matroska", "flv"):
        late = tmp_path / f"late.{'mkv' if fmt == 'matroska' else 'flv'}"
        with av.open(str(late), "w", format=fmt) as container:
            stream = container.add_stream("libx264", rate=30)
            stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
            stream.codec_context.time_base = stream.time_base = fractions.Fraction(1, 1000)
            for index in range(75):
                frame = av.VideoFrame.from_ndarray(np.full((64, 96, 3), index, np.uint8), format="rgb24")
                frame.pts, frame.time_base = 1000 + index * 33, fractions.Fraction(1, 1000)
                for packet in stream.encode(frame):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        assert validate(Request("ref2va", PROMPT, references=[IMAGE, ("video", late)])).references[1].kind == "video"


def test_accepts_files_within_the_limits(tmp_path):
    png = tmp_path / "still.png"
    Image.new("RGB", (120, 90)).save(png)
    mp4 = tmp_path / "talk.mp4"
    write_mp4(mp4, np.zeros((72, 64, 96, 3), np.uint8), sound(3.0, 2, 1))
    wav = write_wav(tmp_path / "voice.wav", 2.5)
    plan = validate(Request("ref2va", PROMPT, references=[("image", png), ("video", mp4, 0.5), ("audio", wav)]))
    assert [r.kind for r in plan.references] == ["image", "video", "audio"]
    assert validate(Request("fl2va", PROMPT, first_image=png)).width == 1024  # 4:3


def test_missing_models_are_named_before_any_model_runs(tiny_text):
    model = Untouchable()
    with pytest.raises(RequestError, match="encoded (by|with) the video VAE, and none was given"):
        encode_request(Request("fl2va", PROMPT, first_image=Image.new("RGB", (96, 64))), model)
    with pytest.raises(RequestError, match="encoded (by|with) the audio VAE, and none was given"):
        encode_request(Request("ref2va", PROMPT, references=[IMAGE, ("audio", audio(2))]), model,
                        untouchable(VideoVAE))
    with pytest.raises(RequestError, match="needs a text_encoder"):
        encode_request(Request("t2va", PROMPT))
    assert issubclass(RequestError, ValueError)


def test_a_silent_video_carries_no_audio_label(tmp_path):
    """The text encoder labels a video `<Audio j>` only when it has a soundtrack: a prompt naming <Audio 2> beside
    one sounding and one silent video is warned of (it was counted as carried), <Audio 1> is not."""
    import av

    from h3_core.conditioning import prompt_warnings

    silent_file = tmp_path / "silent.mp4"
    with av.open(str(silent_file), "w") as container:  # a video stream alone
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
        for _ in range(24):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.zeros((64, 96, 3), np.uint8), format="rgb24")))
        container.mux(stream.encode())
    sounding_file = write_mp4(tmp_path / "sounding.mp4", np.zeros((24, 64, 96, 3), np.uint8),
                              np.zeros((2, 32000), np.float32))
    prompt = "<Video 1> and <Video 2> talk; <Audio 1> answers <Audio 2>."
    for sounding, silent in ((video(5, audio=True), video(5)), (str(sounding_file), str(silent_file))):
        request = Request("ref2va", prompt, references=[("video", sounding), ("video", silent)])
        assert prompt_warnings(request) == ["the prompt names <Audio 2>, but the request carries 1 audio label."]
        request = Request("ref2va", prompt, references=[("video", sounding), ("video", sounding)])
        assert prompt_warnings(request) == []


def test_fl2va_keyframes_are_the_requests_pictures():
    """An fl2va request's keyframes are what the vision tower reads and what <Picture N> names: both keyframes
    are two pictures, a first frame alone one (the prompt's <Picture 2> is then warned of)."""
    from h3_core.conditioning import prompt_warnings, shows_pictures

    prompt = "<Picture 1> turns into <Picture 2>."
    both = Request("fl2va", prompt, first_image=picture(64, 36, 1), last_image=picture(64, 36, 2))
    first = Request("fl2va", prompt, first_image=picture(64, 36, 1))
    assert shows_pictures(both) and shows_pictures(first)
    assert prompt_warnings(both) == []
    assert prompt_warnings(first) == ["the prompt names <Picture 2>, but the request carries 1 picture label."]


@pytest.mark.parametrize("references", ["photo.png", MediaReference("image", "photo.png"), {"image": "photo.png"}, 3])
def test_references_not_given_as_a_list_are_refused_as_such(references):
    """One path or one reference where a list belongs is refused as such, not read item by item (a path's letters
    as references)."""
    with pytest.raises(RequestError, match=r"references must be a list of \(kind, source\[, start_seconds\]\) or "
                                           r"MediaReference entries\."):
        validate(Request("ref2va", PROMPT, references=references))
