"""The text conditioner: presentation, layer-50 capture and loading, against diffusers' text-encode steps.

One tiny Qwen3-VL (transformers' own class, 52 decoder layers so `hidden_states[50]` exists, DeepStack
after both vision blocks) with random weights is written in every layout (original release partition,
HF-layout folder, Comfy-Org single file) and loaded through `h3_core.text.load_text_encoder`; the
diffusers 0.42.1 steps `MiniMaxH3TextEncoderStep`, `MiniMaxH3FL2VATextEncoderStep` and
`MiniMaxH3Ref2VATextEncoderStep` run on the in-memory 52-layer model with the same tokenizer.

Tolerance for hidden states: 1e-5 absolute in fp32 (the same transformers modules run on the same
inputs in the same order; observed exactly equal), on states of magnitude ~20.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import tiny_qwen
import torch
import video_pixels_oracle
from PIL import Image
from safetensors.torch import save_file

from h3_core.prompt import (
    AudioReference,
    ImageReference,
    Presenter,
    VideoReference,
    VisionProcessor,
    sample_video_frames,
    timestamp_label,
)
from h3_core.text import TextConditioning, load_text_encoder
from h3_core.text_checkpoint import CheckpointError, load_qwen3vl, locate_text_encoder, qwen3vl_config

PROMPT = "A red fox walks along the beach at sunset. <d>[English] Hello there.</d>"
ATOL = 1e-5


def picture(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


clip = video_pixels_oracle.clip  # the clips whose stock pixels it records


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_qwen")
    tokenizer = tiny_qwen.write_tokenizer(root / "tokenizer")
    config = tiny_qwen.config_dict(tokenizer)
    model = tiny_qwen.random_model(config, seed=11)
    release = tiny_qwen.write_original_release(root / "MiniMax-H3", model, tokenizer)
    hf = tiny_qwen.write_hf_folder(root / "qwen3vl-hf", model, tokenizer)
    single = tiny_qwen.write_single_file(
        root / "text_encoders" / "qwen3vl_32b_minimax_h3_bf16.safetensors",
        model,
        prefix="text_encoders.qwen3vl_32b.transformer.",
    )
    return {
        "root": root,
        "tokenizer": tokenizer,
        "config": config,
        "model": model,
        "release": release,
        "hf": hf,
        "single": single,
        "partition": release / "FL2VA",
    }


@pytest.fixture(scope="module")
def encoder(tiny):
    return load_text_encoder(tiny["release"], torch.float32)


@pytest.fixture(scope="module")
def presenter(tiny):
    return Presenter.from_folders(tiny["partition"] / "tokenizer", tiny["partition"] / "processor")


# ---------------------------------------------------------------------------------------------
# Parity with diffusers' text-encode steps


class ReferenceProcessor:
    """What diffusers' steps use of a `Qwen3VLProcessor` (which needs torchvision to construct here):
    its image processor, a video processor, and transformers' own `create_mm_token_type_ids`. The
    video processor is h3_core's (checked against transformers + torchvision in
    `test_video_pixels_equal_transformers_with_torchvision`)."""

    def __init__(self, vision: VisionProcessor, tokenizer):
        from transformers.processing_utils import ProcessorMixin

        self._create = ProcessorMixin.create_mm_token_type_ids
        self.image_processor = vision.image_processor
        self.video_processor = _VideoCall(vision)
        self.image_token_ids = [tokenizer.convert_tokens_to_ids("<|image_pad|>")]
        self.video_token_ids = [tokenizer.convert_tokens_to_ids("<|video_pad|>")]
        self.audio_token_ids = [None]

    def create_mm_token_type_ids(self, input_ids):
        return self._create(self, input_ids)


class _VideoCall:
    def __init__(self, vision: VisionProcessor):
        self.vision = vision
        self.temporal_patch_size = vision.temporal_patch_size
        self.merge_size = vision.video_merge

    def __call__(self, videos, do_sample_frames, return_tensors):
        assert do_sample_frames is False and return_tensors == "pt"
        pixels, grid = self.vision.videos(videos)
        return {"pixel_values_videos": pixels, "video_grid_thw": grid}


def reference_processor(vision: VisionProcessor, tokenizer):
    """transformers' real Qwen3VLProcessor (stock video processor) where torchvision is installed,
    else `ReferenceProcessor`. The image processor is the same PIL one either way."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return ReferenceProcessor(vision, tokenizer)
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    config = {
        k: v for k, v in tiny_qwen.VIDEO_PROCESSOR.items() if k not in ("video_processor_type", "processor_class")
    }
    return Qwen3VLProcessor(
        image_processor=vision.image_processor, tokenizer=tokenizer, video_processor=Qwen3VLVideoProcessor(**config)
    )


needs_diffusers = pytest.mark.skipif(importlib.util.find_spec("diffusers") is None,
                                     reason="compares with diffusers' H3 text steps (the test extra)")


def run_diffusers(step, tiny, presenter, monkeypatch, **inputs):
    """Run one diffusers text step; returns (prompt_embeds, tags, token ids, vision inputs) it used."""
    from diffusers.modular_pipelines.minimax_h3 import encoders

    seen = {}
    original = encoders.get_qwen3vl_prompt_embeds

    def recording(text_encoder, processor, token_ids, vision_inputs=None, **kwargs):
        seen["ids"], seen["vision"] = list(token_ids), dict(vision_inputs or {})
        return original(text_encoder, processor, token_ids, vision_inputs, **kwargs)

    monkeypatch.setattr(encoders, "get_qwen3vl_prompt_embeds", recording)
    pipe = step.init_pipeline()
    pipe.update_components(
        text_encoder=tiny["model"],
        tokenizer=presenter.tokenizer,
        processor=reference_processor(presenter.vision, presenter.tokenizer),
    )
    with torch.no_grad():
        out = pipe(**inputs, output=["prompt_embeds", "text_token_tags"])
    return out["prompt_embeds"], out["text_token_tags"], seen["ids"], seen["vision"]


def assert_same(ours: TextConditioning, presentation, reference) -> None:
    embeds, tags, ids, vision = reference
    assert presentation.input_ids.tolist() == ids
    assert torch.equal(ours.token_tags, tags)
    assert sorted(presentation.vision_inputs) == sorted(vision)
    for name, value in vision.items():
        assert torch.equal(presentation.vision_inputs[name], value), name
    assert ours.prompt_embeds.shape == embeds.shape == (1, len(ids), 32)
    assert ours.prompt_embeds.dtype == embeds.dtype == torch.float32
    assert (ours.prompt_embeds - embeds).abs().max().item() <= ATOL


@needs_diffusers
def test_t2va_equals_diffusers(tiny, encoder, monkeypatch):
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3TextEncoderStep

    reference = run_diffusers(MiniMaxH3TextEncoderStep(), tiny, encoder.presenter, monkeypatch, prompt=PROMPT)
    presentation = encoder.presenter.t2va(PROMPT)
    assert presentation.token_tags.tolist() == [1] * presentation.num_tokens
    assert presentation.vision_inputs == {}
    assert_same(encoder.encode(presentation), presentation, reference)


def test_between_layers_runs_before_each_decoder_layer_and_can_stop_the_encode(encoder):
    """A host's interrupt check runs between the decoder layers, told how many are done (the result unchanged),
    and raising there stops the encode mid-way and leaves no hook behind."""
    presentation = encoder.presenter.t2va(PROMPT)
    layers = encoder.model.language_model.layers
    calls = []
    got = encoder.forget().encode(presentation, calls.append)  # a remembered prompt runs no layer
    assert calls == list(range(len(layers))) and len(layers) > 1
    assert torch.equal(got.prompt_embeds, encoder.forget().encode(presentation).prompt_embeds)
    encoder.forget()

    class Stop(Exception):
        pass

    def stop_at_the_second(layers_done):
        if layers_done == 1:
            raise Stop
        calls.append(layers_done)

    with pytest.raises(Stop):
        encoder.encode(presentation, stop_at_the_second)
    assert calls[len(layers):] == [0] and all(not layer._forward_pre_hooks for layer in layers)


@pytest.mark.parametrize(
    "keyframes",
    [
        pytest.param(lambda: [picture(64, 96, 1)], id="first"),
        # a last keyframe alone is still `<Picture 1>` (the packed order); this one is resized by the processor
        pytest.param(lambda: [picture(128, 192, 2)], id="last"),
        pytest.param(lambda: [picture(64, 96, 3), picture(64, 96, 4)], id="first+last"),
    ],
)
@needs_diffusers
def test_fl2va_equals_diffusers(tiny, encoder, monkeypatch, keyframes):
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3FL2VATextEncoderStep

    images = keyframes()
    reference = run_diffusers(
        MiniMaxH3FL2VATextEncoderStep(), tiny, encoder.presenter, monkeypatch, prompt=PROMPT, keyframes=images
    )
    presentation = encoder.presenter.fl2va(PROMPT, images)
    assert presentation.vision_inputs["image_grid_thw"].shape == (len(images), 3)
    assert_same(encoder.encode(presentation), presentation, reference)


REF2VA_CASES = {
    "images+audio": lambda: [
        ImageReference(picture(64, 96, 5)),
        AudioReference(),
        ImageReference(picture(160, 96, 6)),
        AudioReference(),
    ],
    "videos": lambda: [
        VideoReference(clip(30, 7), has_audio=True),
        ImageReference(picture(64, 96, 8)),
        AudioReference(),
        VideoReference(clip(48, 9)),
    ],
}


def to_diffusers(references):
    from diffusers.modular_pipelines.minimax_h3.references import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )

    sound = torch.zeros(2, 3200)
    out = []
    for reference in references:
        if reference.kind == "image":
            out.append(MiniMaxH3ImageReference(image=reference.image))
        elif reference.kind == "audio":
            out.append(MiniMaxH3AudioReference(audio=sound, sample_rate=32000))
        else:
            audio = sound if reference.has_audio else None
            out.append(MiniMaxH3VideoReference(frames=reference.frames, fps=24.0, audio=audio, sample_rate=32000))
    return out


@needs_diffusers
@pytest.mark.parametrize("case", sorted(REF2VA_CASES))
def test_ref2va_equals_diffusers(tiny, encoder, monkeypatch, case):
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep

    references = REF2VA_CASES[case]()
    reference = run_diffusers(
        MiniMaxH3Ref2VATextEncoderStep(),
        tiny,
        encoder.presenter,
        monkeypatch,
        prompt=PROMPT,
        normalized_references=to_diffusers(references),
    )
    presentation = encoder.presenter.ref2va(PROMPT, references)
    assert_same(encoder.encode(presentation), presentation, reference)


# ---------------------------------------------------------------------------------------------
# What is captured: the un-normalized state after decoder layer 50


def test_captured_state_is_unnormalized_layer_50(tiny, encoder):
    from transformers import Qwen3VLConfig, Qwen3VLModel

    presentation = encoder.presenter.ref2va(PROMPT, [ImageReference(picture(64, 96, 12)), VideoReference(clip(30, 13))])
    ours = encoder.encode(presentation).prompt_embeds
    inputs = dict(
        input_ids=presentation.input_ids[None],
        mm_token_type_ids=presentation.mm_token_type_ids[None],
        attention_mask=torch.ones(1, presentation.num_tokens, dtype=torch.long),
        **presentation.vision_inputs,
    )
    full = tiny["model"].model
    with torch.no_grad():
        states = full(**inputs, output_hidden_states=True).hidden_states
    assert len(states) == tiny_qwen.TEXT_LAYERS + 1  # embeddings + 52 layers
    assert (ours - states[50]).abs().max().item() <= ATOL
    post_norm = full.language_model.norm(states[50])
    assert (ours - post_norm).abs().max().item() > 1.0  # the final norm really changes it
    assert (ours - states[49]).abs().max().item() > 1e-2 and (ours - states[51]).abs().max().item() > 1e-2

    # The trap: a plain transformers stack cut to 50 layers returns the *post-norm* state as its last one.
    config = dict(tiny["config"], text_config=dict(tiny["config"]["text_config"], num_hidden_layers=50))
    plain = Qwen3VLModel(Qwen3VLConfig(**config)).eval()
    weights = {k[len("model.") :]: v for k, v in tiny["model"].state_dict().items() if k.startswith("model.")}
    missing, unexpected = plain.load_state_dict(weights, strict=False)
    assert not missing and all(".layers.50." in k or ".layers.51." in k for k in unexpected)
    with torch.no_grad():
        last = plain(**inputs, output_hidden_states=True)
    assert torch.allclose(last.last_hidden_state, post_norm, atol=ATOL)
    assert torch.allclose(last.hidden_states[50], post_norm, atol=ATOL)


# ---------------------------------------------------------------------------------------------
# Presentation (no model)


def test_presentation_pieces_are_tokenized_separately_and_tagged(presenter):
    tokenizer = presenter.tokenizer
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    special = presenter.special_ids
    block = [special["<|vision_start|>"]] + [special["<|image_pad|>"]] * 6 + [special["<|vision_end|>"]]
    p = presenter.fl2va(PROMPT, [picture(64, 96, 1), picture(64, 96, 2)])
    expected = ids("<Picture 1>: ") + block + ids("<Picture 2>: ") + block + ids(PROMPT)
    assert p.input_ids.tolist() == expected
    tags = (
        [1] * len(ids("<Picture 1>: ")) + [0] * 8 + [1] * len(ids("<Picture 2>: ")) + [0] * 8 + [1] * len(ids(PROMPT))
    )
    assert p.token_tags.tolist() == tags
    assert p.mm_token_type_ids.tolist() == [1 if i == special["<|image_pad|>"] else 0 for i in expected]
    assert p.vision_inputs["image_grid_thw"].tolist() == [[1, 4, 6], [1, 4, 6]]  # 64x96: 4x6 patches -> 6 tokens
    assert p.vision_inputs["pixel_values"].shape == (48, 3 * 2 * 16 * 16)


def test_ref2va_labels_numbered_per_modality(presenter):
    references = [
        ImageReference(picture(64, 96, 1)),
        AudioReference(),
        VideoReference(clip(30, 2), has_audio=True),
        ImageReference(np.asarray(picture(64, 96, 3))),
        VideoReference(clip(48, 4)),
        AudioReference(),
    ]
    p = presenter.ref2va("Go.", references)
    image = "<|vision_start|>" + "<|image_pad|>" * 6 + "<|vision_end|>"
    video = "<|vision_start|>" + "<|video_pad|>" * 2 + "<|vision_end|>"  # 3 frames -> 32x64 by the processor's cap
    assert presenter.tokenizer.decode(p.input_ids.tolist()) == (
        "<Picture 1>: "
        + image
        + "<Audio 1>: "
        + "<Audio 2>: <Video 1>: "
        + "<0.2 seconds>"
        + video
        + "<1.0 seconds>"
        + video
        + "<Picture 2>: "
        + image
        + "<Video 2>: "
        + "<0.2 seconds>"
        + video
        + "<1.2 seconds>"
        + video
        + "<Audio 3>: Go."
    )
    assert p.vision_inputs["video_grid_thw"].tolist() == [[2, 2, 4], [2, 2, 4]]
    assert int((p.mm_token_type_ids == 2).sum()) == 8 and int((p.token_tags == 0).sum()) == 2 * 8 + 4 * 4


def test_video_sampling_and_timestamps():
    assert sample_video_frames(30) == ([0, 12, 24], [0.25, 1.0])
    assert sample_video_frames(13) == ([0, 12], [0.25])
    assert sample_video_frames(48) == ([0, 12, 24, 36], [0.25, 1.25])
    indices, blocks = sample_video_frames(125)
    assert indices == list(range(0, 125, 12)) and len(blocks) == 6
    assert [timestamp_label(t) for t in (0.25, 0.75, 1.25, 2.25, 3.0)] == [
        "<0.2 seconds>",
        "<0.8 seconds>",
        "<1.2 seconds>",
        "<2.2 seconds>",
        "<3.0 seconds>",
    ]  # Python's round-half-even on the binary value
    with pytest.raises(ValueError, match="at least 13 frames"):
        sample_video_frames(12)


def test_release_sized_keyframe_token_count(tmp_path, presenter):
    """With Qwen3-VL's stock processor limits a keyframe on the 1344x768 canvas is not resized:
    48 x 84 patches -> 1008 vision tokens (1010 rows with start/end)."""
    config = dict(tiny_qwen.IMAGE_PROCESSOR, size={"shortest_edge": 65536, "longest_edge": 16777216})
    vision = VisionProcessor(config, tiny_qwen.VIDEO_PROCESSOR)
    pixels, grid = vision.images([picture(768, 1344, 1)])
    assert grid.tolist() == [[1, 48, 84]] and vision.image_tokens(grid) == [1008]
    assert pixels.shape == (48 * 84, 1536)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda p: p.t2va(""), ValueError, "prompt is empty"),
        (lambda p: p.t2va("   \n"), ValueError, "prompt is empty"),
        (lambda p: p.t2va(["a"]), TypeError, "one string"),
        (lambda p: p.t2va("look <|image_pad|> here"), ValueError, "vision token"),
        (lambda p: p.fl2va("x", []), ValueError, "1 or 2 keyframes"),
        (lambda p: p.fl2va("x", [picture(64, 96, 1)] * 3), ValueError, "1 or 2 keyframes"),
        (lambda p: p.fl2va("", [picture(64, 96, 1)]), ValueError, "prompt is empty"),
        (lambda p: p.fl2va("x", [np.zeros((64, 96), np.uint8)]), ValueError, r"\[H, W, 3\] uint8"),
        (lambda p: p.ref2va("x", []), ValueError, "at least one reference"),
        (lambda p: p.ref2va("x", [AudioReference()]), ValueError, "image or video reference beside it"),
        (lambda p: p.ref2va("x", [ImageReference(picture(64, 96, 1))] * 10), ValueError, "at most 9 image"),
        (lambda p: p.ref2va("x", ["a.png"]), TypeError, "ImageReference, VideoReference or AudioReference"),
        (
            lambda p: p.ref2va("x", [VideoReference(clip(30, 1).astype(np.float32))]),
            ValueError,
            r"\[F, H, W, 3\] uint8",
        ),
        (lambda p: p.ref2va("x", [VideoReference(clip(6, 1))]), ValueError, "at least 13 frames"),
        (lambda p: p.present("i2v", "x"), ValueError, "t2va, fl2va, ref2va"),
        (lambda p: p.present("t2va", "x", keyframes=[picture(64, 96, 1)]), ValueError, "prompt only"),
    ],
)
def test_presentation_errors(presenter, call, error, match):
    with pytest.raises(error, match=match):
        call(presenter)


def test_processor_config_files(tmp_path, tiny):
    """transformers 5's nested processor_config.json and the per-processor files read the same."""
    nested = VisionProcessor.from_folder(tiny_qwen.write_processor(tmp_path / "nested", nested=True))
    legacy = VisionProcessor.from_folder(tiny["partition"] / "processor")
    frames = [clip(4, 3)]
    assert all(torch.equal(a, b) for a, b in zip(nested.videos(frames), legacy.videos(frames), strict=True))
    with pytest.raises(FileNotFoundError, match="preprocessor_config.json"):
        VisionProcessor.from_folder(tiny["tokenizer"])


def our_video_pixels() -> dict[str, torch.Tensor]:
    """video_pixels_oracle.stock_pixels' layout, from our torch-only video path."""
    got = {}
    for size in video_pixels_oracle.SIZES:
        ours = VisionProcessor(tiny_qwen.IMAGE_PROCESSOR, video_pixels_oracle.processor_config(size))
        got[f"{size}.pixels"], got[f"{size}.grid"] = ours.videos(video_pixels_oracle.clips())
    return got


def assert_same_pixels(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].shape == tensor.shape and torch.equal(got[name], tensor), name


def test_video_pixels_equal_transformers_with_torchvision():
    """Where torchvision is installed, the torch-only video path equals transformers' own processor."""
    pytest.importorskip("torchvision", reason="torchvision runs transformers' video processor (ComfyUI has it)")
    assert_same_pixels(our_video_pixels(), video_pixels_oracle.stock_pixels())


def test_video_pixels_equal_transformers_recorded_with_torchvision():
    """Without torchvision (CI: PyPI's needs a CUDA torch) the video path is compared with transformers' processor
    as recorded where torchvision was: else every video parity test compared our pixels with our own stand-in."""
    from safetensors import safe_open

    with safe_open(video_pixels_oracle.RECORDING, "pt") as recording:
        made_natively = recording.metadata()["native_uint8_resize"] == "True"
        expected = {name: recording.get_tensor(name) for name in recording.keys()}
    if made_natively != video_pixels_oracle.native_uint8_resize():
        pytest.skip("torchvision resizes uint8 another way on this CPU than where the pixels were recorded")
    assert_same_pixels(our_video_pixels(), expected)


@pytest.mark.parametrize("machine, capability", [("x86_64", "AVX2"), ("x86_64", "AVX512"), ("x86_64", "DEFAULT"),
                                                   ("arm64", "DEFAULT"), ("aarch64", "DEFAULT")])
def test_uint8_bilinear_resizes_take_torchvisions_path_on_every_cpu(monkeypatch, machine, capability):
    """torchvision resizes uint8 bilinear natively where the CPU has AVX2 / AVX512 or is ARM (Apple silicon), else
    through float32: ours took the float path on ARM, another rounding than torchvision's there."""
    torchvision = pytest.importorskip("torchvision", reason="torchvision is the oracle (installed with ComfyUI)")
    import platform

    from packaging.version import Version

    if machine != "x86_64" and Version(torchvision.__version__) < Version("0.29"):
        pytest.skip(f"torchvision {torchvision.__version__} resizes through float32 on ARM; ours follows 0.29's rule")

    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2.functional import resize

    from h3_core.prompt import _torchvision_resize

    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    images = torch.randint(0, 256, (2, 3, 37, 53), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    expected = resize(images, [24, 70], interpolation=InterpolationMode.BILINEAR, antialias=True)
    assert torch.equal(_torchvision_resize(images, (24, 70), "bilinear"), expected)


# ---------------------------------------------------------------------------------------------
# Loading


def test_every_layout_loads_the_same_encoder(tiny, encoder, tmp_path):
    presentation = encoder.presenter.fl2va(PROMPT, [picture(64, 96, 21)])
    expected = encoder.encode(presentation).prompt_embeds
    for path, kwargs in (
        (tiny["partition"], {}),
        (tiny["partition"] / "text_encoder", {}),
        (tiny["hf"], {}),
        (tiny["single"], {"tokenizer": tiny["partition"], "config": tiny["partition"] / "text_encoder"}),
        (
            tiny_qwen.write_single_file(tmp_path / "unprefixed.safetensors", tiny["model"]),
            {"tokenizer": tiny["release"], "config": tiny["config"]},
        ),
        (
            tiny["single"],
            {
                "tokenizer": tiny["partition"] / "tokenizer",
                "processor": tiny["partition"] / "processor",
                "config": tiny["config"],
            },
        ),
    ):
        other = load_text_encoder(path, torch.float32, **kwargs)
        again = other.presenter.fl2va(PROMPT, [picture(64, 96, 21)])
        assert torch.equal(again.input_ids, presentation.input_ids)
        assert torch.equal(again.vision_inputs["pixel_values"], presentation.vision_inputs["pixel_values"])
        assert torch.equal(other.encode(again).prompt_embeds, expected), path


@pytest.mark.parametrize("root", ["qwen3vl_32b.", "text_encoders.qwen3vl_32b."])
def test_a_file_comfyui_saved_loads_without_its_logit_scale(tiny, encoder, tmp_path, root):
    """ComfyUI's CLIPSave (and CheckpointSave, under text_encoders.) write the encoder under
    `qwen3vl_32b.transformer.` with the CLIP `logit_scale` beside it; H3 has no use for the scale, and the
    file loads the same encoder."""
    tensors = tiny_qwen.comfy_keys(tiny["model"].state_dict(), prefix=root + "transformer.")
    tensors[root + "logit_scale"] = torch.tensor(4.6055)
    path = _write(tmp_path / "clip_save.safetensors", tensors)
    loaded = load_text_encoder(path, torch.float32, tokenizer=tiny["partition"], config=tiny["config"])
    presentation = encoder.presenter.t2va(PROMPT)
    assert torch.equal(loaded.encode(presentation).prompt_embeds, encoder.encode(presentation).prompt_embeds)


def _int8_convrot_file(tiny, path: Path):
    """ComfyUI's `qwen3vl_32b_minimax_h3_int8_convrot` in miniature: every decoder linear int8, rotated in groups
    (here 16 columns), one scale per row, and a vision linear with a bias. Returns (path, layer -> (q, scale,
    the weight it stands for in float64))."""
    from test_fp8 import convrot_matrix

    tensors = tiny_qwen.comfy_keys(tiny["model"].state_dict())
    rotation, meant = convrot_matrix(16), {}
    decoder = r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$"
    vision = "visual.blocks.0.mlp.linear_fc1.weight"  # a linear with a bias, which must load beside it
    for key in [k for k in tensors if re.match(decoder, k)] + [vision]:
        weight = tensors[key].double()
        out_features, in_features = weight.shape
        rotated = (weight.reshape(out_features, -1, 16) @ rotation.T).reshape(out_features, in_features)
        scale = rotated.abs().amax(dim=1, keepdim=True) / 127.0
        q = (rotated / scale).round().clamp(-127, 127).to(torch.int8)
        layer = key[: -len(".weight")]
        meant[layer] = (q, scale.float(), ((q.double() * scale.float().double()).reshape(out_features, -1, 16)
                                           @ rotation).reshape(out_features, in_features))
        record = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 16}
        tensors.update({key: q, f"{layer}.weight_scale": scale.float(),
                        f"{layer}.comfy_quant": torch.tensor(list(json.dumps(record).encode()), dtype=torch.uint8)})
    assert len(meant) == 7 * 50 + 1  # the 50 decoder layers a ComfyUI file keeps, and the vision linear
    return _write(path, tensors), meant


def test_an_int8_convrot_single_file_stays_int8(tiny, encoder, tmp_path):
    """Each int8 linear is held as the file stores it (a byte a weight, its scale per row) and rebuilt, turned
    back from its rotation, as it is used: the prompt states equal those of the same weights dequantized into
    a dense file, and are close to the original model's."""
    from h3_core.fp8 import FP8Linear

    path, meant = _int8_convrot_file(tiny, tmp_path / "qwen3vl_int8_convrot.safetensors")
    loaded = load_text_encoder(path, torch.float32, tokenizer=tiny["partition"], config=tiny["config"])
    modules = dict(loaded.model.named_modules())
    dense = tiny_qwen.comfy_keys(tiny["model"].state_dict())
    for layer, (q, scale, weight) in meant.items():
        name = layer.replace("model.layers.", "language_model.layers.")
        module = modules[name]
        assert isinstance(module, FP8Linear) and module.rotation == 16 and module.compute_dtype == torch.float32, name
        assert torch.equal(module.weight, q) and torch.equal(module.weight_scale, scale.view(-1)), name
        assert torch.allclose(module.dequantized_weight().double(), weight, atol=1e-6), name
        dense[f"{layer}.weight"] = module.dequantized_weight()
    vision_fc1 = loaded.model.visual.blocks[0].mlp.linear_fc1
    assert torch.equal(vision_fc1.bias, tiny["model"].state_dict()["model.visual.blocks.0.mlp.linear_fc1.bias"])
    assert sum(isinstance(m, FP8Linear) for m in modules.values()) == len(meant)

    dequantized = load_text_encoder(_write(tmp_path / "dequantized.safetensors", dense), torch.float32,
                                    tokenizer=tiny["partition"], config=tiny["config"])
    assert not any(isinstance(m, FP8Linear) for m in dequantized.model.modules())
    presentation = encoder.presenter.fl2va(PROMPT, [picture(64, 96, 21)])
    got = loaded.encode(presentation).prompt_embeds
    assert torch.equal(got, dequantized.encode(presentation).prompt_embeds)
    expected = encoder.encode(presentation).prompt_embeds
    assert torch.nn.functional.cosine_similarity(got.flatten(), expected.flatten(), dim=0) > 0.999
    assert torch.equal(loaded.stream_layers("cpu").forget().encode(presentation).prompt_embeds, got)  # int8 layers visit too


def test_an_fp8_scaled_text_encoder_stays_fp8(tiny, encoder, tmp_path):
    """An FP8 file (e4m3 weights, a scale per tensor, formats named in the file's metadata): each linear held as
    stored, the same prompt states as its weights dequantized into a dense file."""
    from h3_core.fp8 import FP8Linear

    tensors = tiny_qwen.comfy_keys(tiny["model"].state_dict())
    dense, layers = dict(tensors), {}
    for key in [k for k in tensors if re.match(r"model\.layers\.\d+\.mlp\.\w+_proj\.weight$", k)]:
        scale = tensors[key].abs().max() / 448.0
        stored = (tensors[key] / scale).to(torch.float8_e4m3fn)
        layer = key[: -len(".weight")]
        tensors.update({key: stored, f"{layer}.weight_scale": scale.float(), f"{layer}.input_scale": torch.ones(())})
        dense[key] = stored.float() * scale.float()
        layers[layer] = {"format": "float8_e4m3fn"}
    path = tmp_path / "qwen3vl_fp8_scaled.safetensors"
    save_file(tensors, str(path), metadata={"_quantization_metadata": json.dumps({"layers": layers})})
    options = dict(tokenizer=tiny["partition"], config=tiny["config"])
    loaded = load_text_encoder(path, torch.float32, **options)
    held = [m for m in loaded.model.modules() if isinstance(m, FP8Linear)]
    assert len(held) == 3 * 50 and {m.weight.dtype for m in held} == {torch.float8_e4m3fn}
    assert {tuple(m.weight_scale.shape) for m in held} == {()}
    presentation = encoder.presenter.t2va(PROMPT)
    dequantized = load_text_encoder(_write(tmp_path / "dense.safetensors", dense), torch.float32, **options)
    assert torch.equal(loaded.encode(presentation).prompt_embeds, dequantized.encode(presentation).prompt_embeds)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["int8_convrot", "nvfp4_awq"])
def test_a_quantized_text_encoder_on_the_gpu_resident_and_streamed(tiny, tmp_path, kind):
    """Kept quantized on a GPU, resident or streamed from CPU memory: the CPU's prompt states (float32)."""
    write = _int8_convrot_file if kind == "int8_convrot" else _nvfp4_awq_file
    path, _ = write(tiny, tmp_path / f"qwen3vl_{kind}.safetensors")
    options = dict(tokenizer=tiny["partition"], config=tiny["config"])
    on_cpu = load_text_encoder(path, torch.float32, **options)
    presentation = on_cpu.presenter.fl2va(PROMPT, [picture(64, 96, 21)])
    expected = on_cpu.encode(presentation).prompt_embeds
    on_gpu = load_text_encoder(path, torch.float32, "cuda", **options)
    weight = on_gpu.model.language_model.layers[0].mlp.down_proj.weight
    assert weight.device.type == "cuda" and weight.dtype == (torch.int8 if kind == "int8_convrot" else torch.uint8)
    relative = lambda got: ((got.cpu() - expected).norm() / expected.norm()).item()  # noqa: E731
    assert relative(on_gpu.encode(presentation).prompt_embeds) < 1e-3  # float32 through 50 layers, GPU kernels
    streamed = on_cpu.stream_layers("cuda").forget().encode(presentation).prompt_embeds
    assert relative(streamed) < 1e-3
    assert on_cpu.model.language_model.layers[0].mlp.down_proj.weight.device.type == "cpu"  # the layers stay home


def _nvfp4_awq_file(tiny, path: Path):
    """ComfyUI's `qwen3vl_32b_minimax_h3_nvfp4_awq` in miniature: every decoder linear NVFP4 with an AWQ
    pre_quant_scale. Returns (path, layer -> (the weight its NVFP4 tensors stand for, the pre_quant_scale))."""
    import nvfp4_files

    tensors = tiny_qwen.comfy_keys(tiny["model"].state_dict())
    g, meant = torch.Generator().manual_seed(5), {}
    for key in [k for k in tensors if re.match(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$", k)]:
        layer = key[: -len(".weight")]
        smoothing = torch.exp(0.3 * torch.randn(tensors[key].shape[1], generator=g))
        stored, weight = nvfp4_files.quantize(tensors[key], smoothing)
        tensors.update({f"{layer}.{leaf}": value for leaf, value in stored.items()})
        tensors[f"{layer}.comfy_quant"] = nvfp4_files.record()
        meant[layer] = (weight, smoothing)
    assert len(meant) == 7 * 50
    return _write(path, tensors), meant


def test_an_nvfp4_awq_file_stays_nvfp4(tiny, encoder, tmp_path):
    """Each NVFP4 linear is held as stored (half a byte a weight) and rebuilt as it is used: the weights the
    file stands for (within FP4's rounding of the original), the input multiplied by the AWQ scale; the prompt
    states equal a dense model's holding those weights with the scale folded in."""
    from h3_core.nvfp4 import NVFP4Linear

    path, meant = _nvfp4_awq_file(tiny, tmp_path / "qwen3vl_nvfp4_awq.safetensors")
    loaded = load_text_encoder(path, torch.float32, tokenizer=tiny["partition"], config=tiny["config"])
    modules = dict(loaded.model.named_modules())
    dense = tiny_qwen.comfy_keys(tiny["model"].state_dict())
    originals = dict(dense)
    for layer, (weight, smoothing) in meant.items():
        module = modules[layer.replace("model.layers.", "language_model.layers.")]
        assert isinstance(module, NVFP4Linear) and module.weight.dtype == torch.uint8, layer
        assert torch.allclose(module.dequantized_weight().double(), weight, rtol=1e-6, atol=0), layer
        dense[f"{layer}.weight"] = (weight * smoothing.double()).float()
        original = originals[f"{layer}.weight"].double()
        assert ((weight * smoothing.double() - original).norm() / original.norm()).item() < 0.15, layer  # FP4's rounding
    assert sum(isinstance(m, NVFP4Linear) for m in modules.values()) == len(meant)
    folded = load_text_encoder(_write(tmp_path / "folded.safetensors", dense), torch.float32,
                               tokenizer=tiny["partition"], config=tiny["config"])
    presentation = encoder.presenter.fl2va(PROMPT, [picture(64, 96, 21)])
    got = loaded.encode(presentation).prompt_embeds
    want = folded.encode(presentation).prompt_embeds
    assert ((got - want).norm() / want.norm()).item() < 1e-5  # float32: x * s then W, against x then W * s
    assert torch.equal(loaded.stream_layers("cpu").forget().encode(presentation).prompt_embeds, got)

    bf16 = load_text_encoder(path, torch.bfloat16, tokenizer=tiny["partition"], config=tiny["config"])
    down = bf16.model.language_model.layers[3].mlp.down_proj
    assert down.dequantized_weight().dtype == torch.bfloat16 and down.weight_scale_2.dtype == torch.float32
    assert torch.equal(down.dequantized_weight(), meant["model.layers.3.mlp.down_proj"][0].to(torch.bfloat16))


def test_broken_nvfp4_layers_are_refused_before_reading(tiny, tmp_path):
    path, _ = _nvfp4_awq_file(tiny, tmp_path / "nvfp4.safetensors")
    from safetensors import safe_open

    with safe_open(path, "pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    options = dict(tokenizer=tiny["partition"], config=tiny["config"])
    short = dict(tensors, **{"model.layers.2.mlp.up_proj.weight_scale": torch.zeros(7, dtype=torch.uint8)})
    with pytest.raises(CheckpointError, match=r"NVFP4 layer 'language_model.layers.2.mlp.up_proj' \(\d+x32\) has the "
                                              r"wrong sizes: weight_scale 7 \(expected 512\)"):
        load_text_encoder(_write(tmp_path / "short.safetensors", short), **options)
    unscaled = {k: v for k, v in tensors.items() if k != "model.layers.0.self_attn.q_proj.weight_scale_2"}
    with pytest.raises(CheckpointError, match="NVFP4 layer 'language_model.layers.0.self_attn.q_proj' in "
                                              "unscaled.safetensors lacks weight_scale_2"):
        load_text_encoder(_write(tmp_path / "unscaled.safetensors", unscaled), **options)


def test_quantized_text_encoder_sizes_count_the_stored_bytes(tiny, tmp_path):
    """The sizes a host plans with count what loading places: int8 weights and fp32 scales as stored, the
    rest in the dtype asked for."""
    from h3_core.text import text_encoder_bytes, text_encoder_sizes

    path = tmp_path / "int8-hf"  # an HF-layout folder: its config.json sizes it (a single file is sized as the 32B)
    _int8_convrot_file(tiny, path / "model.safetensors")
    shutil.copy(tiny["hf"] / "config.json", path)
    loaded = load_text_encoder(path, torch.bfloat16, tokenizer=tiny["partition"])
    placed = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16, torch.int8, torch.float32}
    sizes = text_encoder_sizes(path, torch.bfloat16)
    layers = loaded.model.language_model.layers
    assert sizes[1] == sum(p.numel() * p.element_size() for p in layers[0].parameters())
    assert sizes[0] + len(layers) * sizes[1] == placed == text_encoder_bytes(path, torch.bfloat16)
    assert placed < 0.75 * text_encoder_bytes(tiny["partition"], torch.bfloat16)

    nvfp4 = tmp_path / "nvfp4-hf"  # NVFP4: half a byte a weight, its block scales, fp32 tensor scales
    _nvfp4_awq_file(tiny, nvfp4 / "model.safetensors")
    shutil.copy(tiny["hf"] / "config.json", nvfp4)
    loaded = load_text_encoder(nvfp4, torch.bfloat16, tokenizer=tiny["partition"])
    placed = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    assert torch.uint8 in {p.dtype for p in loaded.model.parameters()}
    rest, per_layer = text_encoder_sizes(nvfp4, torch.bfloat16)
    assert per_layer == sum(p.numel() * p.element_size() for p in loaded.model.language_model.layers[0].parameters())
    assert rest + len(loaded.model.language_model.layers) * per_layer == placed == text_encoder_bytes(nvfp4)


def test_only_the_used_weights_are_loaded(tiny, encoder, tmp_path):
    model = encoder.model
    assert len(model.language_model.layers) == 50
    assert isinstance(model.language_model.norm, torch.nn.Identity)
    names = set(model.state_dict())
    assert not any(
        ".layers.50." in n or ".layers.51." in n or "lm_head" in n or n.startswith("language_model.norm") for n in names
    )
    reference = {k[len("model.") :] for k in tiny["model"].state_dict() if k.startswith("model.")}
    assert names == {
        n for n in reference if ".layers.50." not in n and ".layers.51." not in n and "language_model.norm" not in n
    }

    # The release's last shard holds only layers >= 50, the final norm and the LM head: never opened.
    source = locate_text_encoder(tiny["release"])
    assert [f.name for f in source.files] == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"]
    copy = tmp_path / "FL2VA"
    shutil.copytree(tiny["partition"], copy)
    (copy / "text_encoder" / "model-00003-of-00003.safetensors").unlink()
    assert load_text_encoder(copy, torch.float32).encode(encoder.presenter.t2va("x")).prompt_embeds.shape == (1, 1, 32)


def test_dtype_move_and_release(tiny, encoder):
    presentation = encoder.presenter.t2va(PROMPT)
    expected = encoder.encode(presentation).prompt_embeds
    half = load_text_encoder(tiny["hf"], torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half.device.type == "cpu"
    text = half.to("cpu").encode(presentation)
    assert text.prompt_embeds.dtype == torch.bfloat16
    relative = (text.prompt_embeds.float() - expected).norm() / expected.norm()
    assert relative.item() < 0.05
    tensors = text.as_tensors()
    assert set(tensors) == {"prompt_embeds", "text_token_tags"} and tensors["text_token_tags"].dtype == torch.int64
    half.release()
    with pytest.raises(RuntimeError, match="released"):
        half.encode(encoder.presenter.t2va(PROMPT + " Rain."))
    again = half.encode(presentation)  # a prompt it remembers needs no weights
    assert torch.equal(again.prompt_embeds, text.prompt_embeds) and torch.equal(again.token_tags, text.token_tags)
    text.prompt_embeds.mul_(0)  # a caller's in-place change to what it was given stays its own
    assert torch.equal(half.encode(presentation).prompt_embeds, again.prompt_embeds)
    assert again.prompt_embeds.abs().sum() > 0
    assert half.presenter.t2va("still works").num_tokens > 0


def test_builtin_config_is_qwen3vl_32b_cut_at_layer_50():
    """What a single file (which ships no config) is read as (h3-model.md E.1)."""
    config = qwen3vl_config(None)
    text, vision = config.text_config, config.vision_config
    assert (text.num_hidden_layers, text.hidden_size, text.intermediate_size) == (50, 5120, 25600)
    assert (text.num_attention_heads, text.num_key_value_heads, text.head_dim, text.vocab_size) == (64, 8, 128, 151936)
    assert text.rope_parameters["rope_theta"] == 5e6 and text.rope_parameters["mrope_section"] == [24, 20, 20]
    assert (vision.depth, vision.hidden_size, vision.intermediate_size, vision.num_heads) == (27, 1152, 4304, 16)
    assert (vision.out_hidden_size, list(vision.deepstack_visual_indexes)) == (5120, [8, 16, 24])
    assert (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size) == (16, 2, 2)
    assert (config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id) == (
        151655,
        151656,
        151652,
        151653,
    )
    with pytest.raises(CheckpointError, match="has 40 layers"):
        qwen3vl_config(qwen3vl_config(None, 40), 50)


def test_a_load_checks_the_headers_then_reads_each_used_tensor_once(tiny, monkeypatch):
    """Names, shapes and dtypes are checked on the headers first; then each tensor H3 uses is read once and no
    other (the release's encoder is ~50 GB of them: a header check that read the data would read it twice)."""
    import h3_core.text_checkpoint as text_checkpoint

    source = locate_text_encoder(tiny["hf"])
    read, reader = [], text_checkpoint.read_tensors

    def counted(files, only=None):
        for key, tensor, where in reader(files, only):
            read.append(key)
            yield key, tensor, where

    monkeypatch.setattr(text_checkpoint, "read_tensors", counted)
    model = load_qwen3vl(source, torch.float32)
    names = text_checkpoint.source_tensor_names(source)
    used = [name for name in names if text_checkpoint.model_name(name, text_checkpoint.TEXT_ENCODER_LAYER) is not None]
    assert sorted(read) == sorted(used) and len(used) < len(names)  # the layers past 50 and the LM head stay unread
    assert len(model.state_dict()) == len(used)


def test_a_state_read_inside_the_deepstack_layers_is_refused(tiny):
    """The first decoder layers take DeepStack vision features after them: a state read there is not the text
    state a later layer's is. Read after the last of them, it loads."""
    source = locate_text_encoder(tiny["hf"])
    deepstack = len(tiny["config"]["vision_config"]["deepstack_visual_indexes"])
    with pytest.raises(CheckpointError, match=rf"^Layer {deepstack} is one of the first {deepstack} layers that take "
                                              "DeepStack vision features"):
        load_qwen3vl(source, torch.float32, layers=deepstack)
    assert len(load_qwen3vl(source, torch.float32, layers=deepstack + 1).language_model.layers) == deepstack + 1


def test_a_config_without_both_halves_is_not_a_qwen3vl_config(tmp_path):
    halves = qwen3vl_config(None).to_dict()
    with pytest.raises(CheckpointError, match=r"^A Qwen3-VL config needs 'text_config' and 'vision_config'\.$"):
        qwen3vl_config({"text_config": halves["text_config"]})
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": halves["vision_config"]}))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(tmp_path / 'config.json'))} is not a Qwen3-VL config"):
        qwen3vl_config(tmp_path)
    damaged = dict(halves, text_config=dict(halves["text_config"], num_hidden_layers="many"))
    (tmp_path / "config.json").write_text(json.dumps(damaged))
    with pytest.raises(CheckpointError, match=rf"^The text encoder \(Qwen3-VL\) at {re.escape(str(tmp_path))} does not "
                                              r"describe a model H3 can build \(ValueError"):
        qwen3vl_config(tmp_path)
    with pytest.raises(CheckpointError, match=r"^The text encoder \(Qwen3-VL\) does not describe"):
        qwen3vl_config(damaged)


def test_real_size_encoder_is_the_902_tensors_of_the_comfy_file():
    """Built on the meta device at the real config: embedding + 50 layers + vision tower = the 902
    tensors of `qwen3vl_32b_minimax_h3_bf16.safetensors` (25.75 B parameters, 51.5 GB in bf16), and
    every key spelling maps onto them; layers 50..63, the final norm and the LM head map to nothing."""
    from transformers import Qwen3VLModel

    from h3_core.text_checkpoint import model_name

    with torch.device("meta"):
        model = Qwen3VLModel(qwen3vl_config(None))
    model.language_model.norm = torch.nn.Identity()
    shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}
    assert len(shapes) == 902
    assert sum(math.prod(shape) for shape in shapes.values()) == 25_753_095_920
    for spell in (
        lambda n: "text_encoders.qwen3vl_32b.transformer." + n.replace("language_model.", "model.", 1),  # Comfy-Org
        lambda n: "model." + n,  # transformers (model.language_model.*, model.visual.*)
    ):
        assert {model_name(spell(name)) for name in shapes} == set(shapes)
    for unused in (
        "model.language_model.layers.50.mlp.up_proj.weight",
        "model.layers.63.input_layernorm.weight",
        "model.language_model.norm.weight",
        "model.norm.weight",
        "lm_head.weight",
    ):
        assert model_name(unused) is None


def test_encode_refuses_foreign_input(encoder):
    import dataclasses

    presentation = encoder.presenter.t2va(PROMPT)
    with pytest.raises(TypeError, match="takes a Presentation"):
        encoder.encode(presentation.input_ids)
    swapped = dataclasses.replace(
        presentation, image_token_id=presentation.video_token_id, video_token_id=presentation.image_token_id
    )
    with pytest.raises(ValueError, match="built with another tokenizer"):
        encoder.encode(swapped)
    with pytest.raises(ValueError, match="below the encoder's vocabulary"):
        encoder.encode(dataclasses.replace(presentation, input_ids=presentation.input_ids + 10_000))


def _write(path: Path, tensors: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


def test_loader_errors(tiny, tmp_path):
    partition = tiny["partition"]
    with pytest.raises(CheckpointError, match="does not exist"):
        load_text_encoder(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="not a Qwen3-VL text encoder"):
        load_text_encoder(partition / "tokenizer")

    broken = tmp_path / "broken"
    shutil.copytree(partition, broken)
    (broken / "text_encoder" / "model-00001-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="lists shards that are not in"):
        load_text_encoder(broken)

    pickled = tmp_path / "pickled" / "text_encoder"
    pickled.mkdir(parents=True)
    shutil.copy(partition / "text_encoder" / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(CheckpointError, match=r"holds only pickle weights \(pytorch_model\.bin\); H3 loads only "):
        load_text_encoder(pickled)
    with pytest.raises(CheckpointError, match=r"^pytorch_model\.bin is a pickle checkpoint"):
        load_text_encoder(pickled / "pytorch_model.bin", tokenizer=partition)

    with pytest.raises(CheckpointError, match="holds no tokenizer"):
        load_text_encoder(tiny["single"], tokenizer=tmp_path, config=tiny["config"])

    short = _write(tmp_path / "short.safetensors", tiny_qwen.comfy_keys(tiny["model"].state_dict(), layers=40))
    with pytest.raises(CheckpointError, match="holds 40 decoder layers"):
        load_text_encoder(short, tokenizer=partition, config=tiny["config"])

    dit = _write(tmp_path / "dit.safetensors", {"blocks.0.attn.qkv_proj.weight": torch.zeros(4, 4)})
    with pytest.raises(CheckpointError, match="holds no Qwen3-VL text encoder"):
        load_text_encoder(dit, tokenizer=partition, config=tiny["config"])

    tensors = tiny_qwen.comfy_keys(tiny["model"].state_dict())
    scaled = _write(tmp_path / "scaled.safetensors",
                    dict(tensors, **{"model.layers.0.mlp.down_proj.scale_weight": torch.ones(1)}))
    with pytest.raises(CheckpointError, match=r"scaled\.safetensors .*is an old-style scaled FP8 text encoder; use the "
                                              "bf16 file or a ComfyUI int8 ConvRot one"):
        load_text_encoder(scaled, tokenizer=partition, config=tiny["config"])

    quantized = _write(
        tmp_path / "int8.safetensors", dict(tensors, **{"model.layers.0.mlp.down_proj.weight_scale": torch.ones(1)})
    )
    with pytest.raises(CheckpointError, match="down_proj.weight' in int8.safetensors has a scale but is stored as F32 "
                                              "with no FP8 format named"):
        load_text_encoder(quantized, tokenizer=partition, config=tiny["config"])

    # A single file with no config given is read as Qwen3-VL-32B: the tiny tokenizer's ids do not
    # fit it (checked before any weight is read), nor do the tiny tensors.
    pad = tiny["config"]["image_token_id"]
    with pytest.raises(
        CheckpointError, match=re.escape(f"<|image_pad|> is {pad} in the tokenizer, 151655 in the model")
    ):
        load_text_encoder(tiny["single"], tokenizer=partition)
    with pytest.raises(CheckpointError, match=r"has shape \[\d+, 32\], expected \[151936, 5120\]"):
        load_qwen3vl(locate_text_encoder(tiny["single"], tokenizer=partition), torch.float32)

    other_ids = dict(
        tiny["config"], image_token_id=tiny["config"]["video_token_id"], video_token_id=tiny["config"]["image_token_id"]
    )
    with pytest.raises(CheckpointError, match="Tokenizer and text encoder disagree"):
        load_text_encoder(tiny["single"], tokenizer=partition, config=other_ids)

    processor = tmp_path / "processor14"
    processor.mkdir()
    (processor / "preprocessor_config.json").write_text(json.dumps(dict(tiny_qwen.IMAGE_PROCESSOR, patch_size=14)))
    with pytest.raises(CheckpointError, match="do not match the vision tower"):
        load_text_encoder(partition, processor=processor)


def test_a_processor_folder_given_must_hold_one(tiny, tmp_path):
    """A processor folder the user names is the one used: one without a processor config is refused, not
    passed over for the model's own (which the user chose not to use)."""
    empty = tmp_path / "no_processor"
    empty.mkdir()
    for tokenizer in (None, tiny["partition"]):
        with pytest.raises(CheckpointError, match=rf"^{re.escape(str(empty))} holds no Qwen3-VL processor config"):
            locate_text_encoder(tiny["partition"], tokenizer=tokenizer, processor=empty)
    assert locate_text_encoder(tiny["partition"]).processor_folder == tiny["partition"] / "processor"


def test_a_tokenizer_folder_holding_the_processor_files_gives_both(tiny, tmp_path):
    """An HF-layout tokenizer folder often carries the processor configs too: named as the tokenizer, it gives
    both, before the model's own processor."""
    mine = tmp_path / "mine"
    shutil.copytree(tiny["partition"] / "tokenizer", mine / "tokenizer")
    for config in (tiny["partition"] / "processor").iterdir():
        shutil.copy(config, mine / "tokenizer" / config.name)
    source = locate_text_encoder(tiny["partition"], tokenizer=mine)
    assert source.tokenizer_folder == source.processor_folder == mine / "tokenizer"


def test_text_encoder_bytes_from_the_config_equal_the_loaded_weights(tiny):
    """What a host checks against its GPU before reading the weights is what loading then places."""
    from h3_core.text import text_encoder_bytes, text_encoder_sizes

    loaded = load_text_encoder(tiny["partition"], dtype=torch.bfloat16)
    placed = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    assert text_encoder_bytes(tiny["partition"], torch.bfloat16) == placed
    rest, per_layer = text_encoder_sizes(tiny["partition"], torch.bfloat16)
    layers = loaded.model.language_model.layers
    assert per_layer == sum(p.numel() * p.element_size() for p in layers[-1].parameters())
    assert rest + len(layers) * per_layer == placed


@pytest.fixture
def encoder_loads(monkeypatch):
    """pipeline.load_text_encoder replaced by a recorder: ("load", device), then ("stream", device) or
    ("spread", devices, counts) as the pipeline places the encoder."""
    from h3_core import pipeline

    calls = []

    class Loaded:
        def stream_layers(self, device):
            calls.append(("stream", str(device)))
            return self

        def spread_layers(self, devices, counts):
            calls.append(("spread", [str(d) for d in devices], counts))
            return self

    monkeypatch.setattr(pipeline, "load_text_encoder",
                        lambda root, dtype, device, tokenizer=None, on_tensor=None:
                        calls.append(("load", str(device))) or Loaded())
    return calls


def test_generate_streams_a_text_encoder_that_does_not_fit(tiny, monkeypatch, encoder_loads):
    """pipeline.load_text_encoder_for: on a GPU with too little room, the encoder loads to the CPU and
    streams its layers; with room (or on the CPU) it loads onto the device."""
    from h3_core import pipeline

    monkeypatch.setattr(pipeline, "free_bytes", lambda device: 64 * 2**30)
    source = pipeline.ModelSource("release", tiny["partition"])
    notes = []
    pipeline.load_text_encoder_for(source, pipeline.GenerateSettings(device="cuda", gpu_memory=0.5), notes.append)
    assert encoder_loads == [("load", "cpu"), ("stream", "cuda")] and "stream from CPU memory" in notes[0]
    encoder_loads.clear()
    pipeline.load_text_encoder_for(source, pipeline.GenerateSettings(device="cuda"), notes.append)
    assert encoder_loads == [("load", "cuda")]
    encoder_loads.clear()
    pipeline.load_text_encoder_for(source, pipeline.GenerateSettings(device="cpu"), notes.append)
    assert encoder_loads == [("load", "cpu")]


def test_generate_spreads_a_text_encoder_over_devices_that_hold_it_together(tiny, monkeypatch, encoder_loads):
    """pipeline.load_text_encoder_for with several devices: too big for the first, the encoder's decoder
    layers go to the devices in order, as many as each has room for (the first also holds the rest of the
    encoder); when all of them together cannot hold it, it streams through the first."""
    from h3_core import pipeline
    from h3_core.text import text_encoder_sizes

    rest, layer_bytes = text_encoder_sizes(tiny["partition"], torch.bfloat16)
    notes, free = [], {}
    monkeypatch.setattr(pipeline, "free_bytes", lambda device: free[str(device)])
    monkeypatch.setattr(pipeline, "usable_bytes", lambda budget: budget)  # no allocator headroom: exact counts
    source = pipeline.ModelSource("release", tiny["partition"])
    work = pipeline.ENCODING_FLOOR_BYTES
    settings = pipeline.GenerateSettings(device="cuda:0", devices=("cuda:0", "cuda:1", "cuda:2"))
    free.update({"cuda:0": rest + work + 30 * layer_bytes, "cuda:1": work + 5 * layer_bytes,
                 "cuda:2": work + 40 * layer_bytes})
    pipeline.load_text_encoder_for(source, settings, notes.append)
    assert encoder_loads == [("load", "cpu"), ("spread", ["cuda:0", "cuda:1", "cuda:2"], [30, 5, 15])]
    assert "spread over cuda:0 (30), cuda:1 (5), cuda:2 (15)" in notes[-1]
    encoder_loads.clear()
    free["cuda:2"] = work + 14 * layer_bytes  # one layer short
    pipeline.load_text_encoder_for(source, settings, notes.append)
    assert encoder_loads == [("load", "cpu"), ("stream", "cuda:0")] and "stream from CPU memory" in notes[-1]


def test_demo_text_encoder_leaves_no_temporary_folder(tmp_path, monkeypatch):
    """The tiny model's encoder is written to a temporary folder for the real loader, then the folder goes
    (each demo run and each ComfyUI load left 3.5 MB in /tmp before); the encoder works without it."""
    import tempfile

    from h3_core.tiny_text import tiny_random_text_encoder

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    encoder = tiny_random_text_encoder()
    assert not list(tmp_path.glob("h3-tiny-text-*"))
    states = encoder.encode(encoder.present("t2va", "a fox trots along the beach")).prompt_embeds
    assert states.shape[-1] == 48 and torch.isfinite(states).all()


def test_an_old_transformers_is_refused_before_any_weight_is_read(tiny, monkeypatch):
    """transformers 4.57 (which ComfyUI's own floor admits) failed inside its Qwen3-VL code with an AttributeError on
    None, after the loader had made room for the encoder."""
    import transformers

    from h3_core.text_checkpoint import check_transformers
    from h3_core.tiny_text import tiny_random_text_encoder

    check_transformers("5.17.0")
    check_transformers("6.0.0.dev0")
    monkeypatch.setattr(transformers, "__version__", "4.57.6")
    for load in (lambda: load_text_encoder(tiny["release"]), tiny_random_text_encoder):
        with pytest.raises(CheckpointError, match=r"needs transformers >= 5\.17; this Python has 4\.57\.6\. Upgrade"):
            load()


def test_non_finite_text_states_are_refused_naming_the_text_encoder():
    """A damaged (or overflowing) encoder's NaN states were taken: the sampler ran every step, then blamed the DiT's
    or an adapter's weights."""
    from h3_core.tiny_text import tiny_random_text_encoder

    encoder = tiny_random_text_encoder()
    presentation = encoder.present("t2va", "a fox trots along the beach")
    assert torch.isfinite(encoder.encode(presentation).prompt_embeds).all()
    with torch.no_grad():
        encoder.model.language_model.embed_tokens.weight[int(presentation.input_ids[0])] = float("inf")
    with pytest.raises(ValueError, match=r"The text encoder gave NaN or infinite states .* overflowed in float32"):
        encoder.encode(encoder.present("t2va", "a cat on a wall"))  # another prompt: not the memo's


def test_a_single_file_without_a_tokenizer_gets_the_releases_from_the_hub(tiny, monkeypatch):
    """No tokenizer given for a single file: the release's tokenizer and processor folders alone are fetched
    (huggingface_hub, cached) and used; offline, the error says how to download them by hand."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    calls = []

    def offline(repo, **options):
        calls.append((repo, options))
        raise LocalEntryNotFoundError("Got: ConnectError: [Errno -2] Name or service not known\nmore")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(CheckpointError, match=r"fetching the release's from MiniMaxAI/MiniMax-H3 failed "
                                              r"\(LocalEntryNotFoundError: Got: ConnectError.*\)\. Download them "
                                              r"with `hf download MiniMaxAI/MiniMax-H3 --include 'FL2VA/tokenizer/\*' "
                                              r"--include 'FL2VA/processor/\*' --local-dir DIR`"):
        load_text_encoder(tiny["single"], config=tiny["config"])
    assert calls == [("MiniMaxAI/MiniMax-H3", {"allow_patterns": ["FL2VA/tokenizer/*", "FL2VA/processor/*"]})]

    def gated(repo, **options):  # huggingface_hub's GatedRepoError: the cause is lines below the status
        raise OSError("401 Client Error. (Request ID: Root=1-abc)\n\nCannot access gated repo for url "
                      "https://huggingface.co/api/models/MiniMaxAI/MiniMax-H3.\nAccess to model MiniMaxAI/MiniMax-H3 "
                      "is restricted. You must have access to it and be authenticated to access it. Please log in.")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", gated)
    with pytest.raises(CheckpointError, match=r"failed \(OSError: 401 Client Error\. .*Cannot access gated repo .*"
                                              r"is restricted\. .* Please log in\.\)\. Download them"):
        load_text_encoder(tiny["single"], config=tiny["config"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **options: str(tiny["release"]))
    fetched = load_text_encoder(tiny["single"], config=tiny["config"])
    given = load_text_encoder(tiny["single"], tokenizer=tiny["partition"], config=tiny["config"])
    presentation = given.present("t2va", "<d>[English] Hello there.</d> A fox on the beach.")
    assert fetched.present("t2va", "<d>[English] Hello there.</d> A fox on the beach.").input_ids.tolist() == \
        presentation.input_ids.tolist()
    assert torch.equal(fetched.encode(presentation).prompt_embeds, given.encode(presentation).prompt_embeds)


def test_a_tokenizer_given_alone_keeps_the_models_own_processor(tiny):
    """A tokenizer folder without a processor/ beside it, given for a release that has one: 'No Qwen3-VL processor
    config found', though the release's was there."""
    from h3_core.text import locate_text_encoder_files

    assert not (tiny["root"] / "tokenizer" / "processor").exists() and not (tiny["root"] / "processor").exists()
    source = locate_text_encoder_files(tiny["partition"], tokenizer=tiny["root"] / "tokenizer")
    assert source.tokenizer_folder == tiny["root"] / "tokenizer"
    assert source.processor_folder == tiny["partition"] / "processor"


def test_a_tokenizer_without_a_processor_encodes_text_prompts_and_refuses_pictures(tiny, encoder, tmp_path):
    """A tokenizer folder with no processor/ anywhere near it was refused outright, though a text prompt never
    uses the processor: it now loads, encodes prompts as the full release does, and a request with pictures is
    refused before any model runs, saying what is missing."""
    from h3_core.prompt import NO_PROCESSOR

    alone = tiny_qwen.write_tokenizer(tmp_path / "tokenizer_only")
    loaded = load_text_encoder(tiny["single"], torch.float32, tokenizer=alone, config=tiny["config"])
    assert loaded.presenter.vision is None
    presentation = encoder.presenter.t2va(PROMPT)
    assert torch.equal(loaded.present("t2va", PROMPT).input_ids, presentation.input_ids)
    assert torch.equal(loaded.encode(presentation).prompt_embeds, encoder.encode(presentation).prompt_embeds)
    loaded.check_sees(False)
    with pytest.raises(CheckpointError, match=re.escape(NO_PROCESSOR)):
        loaded.check_sees(True)
    with pytest.raises(CheckpointError, match="no Qwen3-VL processor config was found"):
        loaded.presenter.fl2va(PROMPT, [picture(64, 96, 21)])


def test_a_damaged_tokenizer_is_named(tmp_path):
    """A tokenizer.json cut or edited by hand gave JSON's bare message ("Expecting property name ..."), no file."""
    from h3_core.prompt import load_tokenizer
    from h3_core.weights import CheckpointError

    folder = tiny_qwen.write_tokenizer(tmp_path / "tokenizer")
    (folder / "tokenizer.json").write_text("{oops")
    with pytest.raises(CheckpointError, match=rf"The tokenizer in {re.escape(str(folder))} cannot be read: Expecting"):
        load_tokenizer(folder)


def test_a_tokenizer_folders_own_code_is_never_run(tmp_path):
    """A shared tokenizer folder may name Python of its own (tokenizer_config's auto_map); running it would run
    whatever its author wrote. The stock tokenizer is loaded instead, that code never imported."""
    import json

    from h3_core.prompt import load_tokenizer

    folder = tiny_qwen.write_tokenizer(tmp_path / "tokenizer")
    ran = tmp_path / "ran"
    (folder / "custom_tokenizer.py").write_text(
        f"import pathlib\npathlib.Path({str(ran)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class CustomTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "custom_tokenizer.CustomTokenizer"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(folder)
    assert not ran.exists() and type(tokenizer).__name__ != "CustomTokenizer"
    assert tokenizer("<d>hi</d>", add_special_tokens=False)["input_ids"][0] == tokenizer.convert_tokens_to_ids("<d>")


def test_a_tokenizer_without_the_dialogue_tokens_is_warned_of(tmp_path, caplog):
    """A stock Qwen3-VL tokenizer (no MiniMax <d> / </d>) loads and runs, but splits dialogue marks into text the
    model never read: said once it loads; the release's tokenizer says nothing."""
    import json
    import logging

    from h3_core.prompt import load_tokenizer

    folder = tiny_qwen.write_tokenizer(tmp_path / "release")
    with caplog.at_level(logging.WARNING, logger="h3"):
        assert load_tokenizer(folder).convert_tokens_to_ids("<d>") != load_tokenizer(folder).unk_token_id
    assert not caplog.records
    stock = tmp_path / "stock"
    stock.mkdir()
    for path in folder.iterdir():
        (stock / path.name).write_bytes(path.read_bytes())
    raw = json.loads((folder / "tokenizer.json").read_text())
    raw["added_tokens"] = [token for token in raw["added_tokens"] if token["content"] not in ("<d>", "</d>")]
    (stock / "tokenizer.json").write_text(json.dumps(raw))
    with caplog.at_level(logging.WARNING, logger="h3"):
        tokenizer = load_tokenizer(stock)
    assert len(tokenizer("<d>hi</d>", add_special_tokens=False)["input_ids"]) > 3  # the marks are text now
    assert [record.getMessage() for record in caplog.records] == [
        f"H3: the tokenizer in {stock} has no <d> or </d> token; H3's own (the release's tokenizer/ folder) has "
        "them for dialogue (<d>[English] words</d>), which this one splits into plain text."]


def test_a_wrong_tensor_is_found_from_the_headers_before_any_is_read(tiny, tmp_path):
    """The DiT and VAEs were checked from their headers before reading; the text encoder (~50 GB) was read up to
    the wrong tensor first (a bad shape in layer 49 after 9 / 10 of the file)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tiny["single"]))
    key = next(key for key in tensors if key.endswith("layers.49.self_attn.v_proj.weight"))
    tensors[key] = tensors[key][:3].clone()
    bad = tmp_path / "qwen3vl_bad.safetensors"
    save_file(tensors, str(bad))
    read = []
    extra = load_file(str(tiny["single"]))  # a tensor H3 never reads, in a dtype it has no use for, is not looked at
    extra["lm_head.weight"] = torch.zeros(4, 4, dtype=torch.uint16)
    tolerated = tmp_path / "qwen3vl_extra.safetensors"
    save_file(extra, str(tolerated))
    load_text_encoder(tolerated, torch.float32, tokenizer=tiny["partition"], config=tiny["config"])
    with pytest.raises(CheckpointError, match=r"layers.49.self_attn.v_proj.weight' .* has shape \[3, "):
        load_text_encoder(bad, torch.float32, tokenizer=tiny["partition"], config=tiny["config"],
                          on_tensor=lambda done, total: read.append(done))
    assert read == []  # not one tensor read


def test_a_resident_encoder_streams_when_a_prompt_needs_more_room_than_is_left(tiny, monkeypatch):
    """h3 generate chose resident or streamed at load with a short prompt's allowance (2 GiB): a long prompt with
    many pictures (~12 GiB of activations for nine release-size images on the 32B) ran out of memory beside a
    resident encoder. Before such an encode, the encoder goes back to CPU memory and streams its layers."""
    from h3_core import pipeline

    encoder = load_text_encoder(tiny["partition"], torch.float32)
    streamed, notes = [], []
    monkeypatch.setattr(encoder, "stream_layers", lambda device: streamed.append(str(device)) or encoder)
    weights = encoder.resident_bytes
    budget_gib = (weights + encoder.encoding_bytes(10)) / 2**30 / 0.95 + 0.3  # a short prompt's room, and headroom
    check = pipeline.room_to_encode(encoder, pipeline.GenerateSettings(device="cuda", gpu_memory=budget_gib),
                                    notes.append)
    check(0)  # a remembered prompt runs no encoder
    check(10)
    assert streamed == [] and notes == []
    rows = 10
    while encoder.encoding_bytes(rows) <= budget_gib * 2**30:  # a prompt whose encoding the budget cannot hold
        rows *= 2
    check(rows)
    assert streamed == ["cuda"] and f"encoding {rows:,} rows takes about" in notes[0]
    assert encoder.device.type == "cpu"
    # the VAEs' encodes of the pictures and sounds after it need room beside its weights too
    encoder = load_text_encoder(tiny["partition"], torch.float32)
    monkeypatch.setattr(encoder, "stream_layers", lambda device: streamed.append(str(device)) or encoder)
    check = pipeline.room_to_encode(encoder, pipeline.GenerateSettings(device="cuda", gpu_memory=budget_gib),
                                    notes.append)
    check(10, 2**20)
    assert len(streamed) == 1
    check(10, int(budget_gib * 2**30))
    assert streamed == ["cuda", "cuda"] and "the VAEs' encodes of its pictures and sounds take about" in notes[1]


def test_generate_makes_room_before_each_encode(monkeypatch, tmp_path):
    """generate hands each request's encode the room check, which hears the rows the encoder will run."""
    from h3_core import pipeline
    from h3_core.conditioning import Request

    heard = []
    monkeypatch.setattr(pipeline, "room_to_encode",
                        lambda encoder, settings, notes, beside: lambda rows, media: heard.append((rows, media)))
    pipeline.generate(Request("t2va", "a fox", duration=4), "tiny-random", pipeline.GenerateSettings(steps=2),
                      save_latents=tmp_path / "fox.safetensors")
    assert len(heard) == 1 and heard[0][0] > 0 and heard[0][1] == 0  # t2va: no pictures or sounds to encode
