"""How the tokenizer and the Qwen3-VL processor are LOADED from disk: diffusers' way against ours.

tests/test_text.py hands diffusers' text steps our own tokenizer and processor objects, so it never compares how
each side reads them from disk. Here one tiny tokenizer + processor (tiny_qwen's, plus a Qwen-style chat template)
and one tiny Qwen3-VL are written in each folder layout the engine accepts:

- "diffusers": the Hub repo root in diffusers format (h3-model.md I.1): `model_index.json` naming
  text_encoder / tokenizer / processor, and the `text_encoder/`, `tokenizer/`, `processor/` subfolders. diffusers'
  MiniMax-H3 text steps declare `ComponentSpec("tokenizer", Qwen2TokenizerFast)` and
  `ComponentSpec("processor", Qwen3VLProcessor)`; from a `model_index.json` a modular pipeline loads each component
  with `<class>.from_pretrained(root, subfolder=<component name>, variant=None, revision=None)`. `processor/` holds
  the processor config and the tokenizer files beside it, as `Qwen3VLProcessor.save_pretrained` writes it
  (transformers' Qwen3VLProcessor.from_pretrained loads its own tokenizer from that folder and fails without one).
- "release" / "partition": the original release root and its `FL2VA/` (legacy per-processor config files).
- "hf": one transformers folder (weights, tokenizer and nested processor config together).

The reference is always diffusers' own loading of the "diffusers" layout (`MiniMaxH3TextEncoderStep().init_pipeline
(root).load_components(...)`); ours is `h3_core.text.load_text_encoder(<layout>)`. Compared: token ids of several
prompts, special / control token ids, the chat template's output, the image (and video) processor's settings and the
pixel values of small random images and a clip, and the whole text-condition path (t2va, fl2va, ref2va) of both
sides, each with the tokenizer / processor / text encoder it loaded itself.

Without torchvision, transformers' Qwen3VLVideoProcessor cannot be built, so Qwen3VLProcessor.from_pretrained fails.
There the diffusers side is given a video processor that transformers loads from the same `processor/` folder
(`from_pretrained(root, subfolder="processor")`) with h3_core's torch stand-ins for torchvision's three calls
(checked bit-identical to torchvision in test_text.py), and transformers' isinstance check of that argument is
relaxed for it; the tokenizer and image processor are loaded by transformers itself. With torchvision installed, the
stock processor is loaded untouched.

Tolerance for hidden states: test_text.ATOL (1e-5 in fp32; observed exactly equal).
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import tiny_qwen
import torch
from test_text import ATOL, PROMPT, REF2VA_CASES, clip, picture, to_diffusers

from h3_core.prompt import ImageReference, VideoReference

pytestmark = pytest.mark.skipif(importlib.util.find_spec("diffusers") is None,
                                reason="compares with diffusers' loading of the H3 tokenizer and processor "
                                       "(the test extra)")

HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None

# A Qwen-style chat template (as the release's tokenizer/ and processor/ carry one, chat_template.jinja). H3 applies
# none (h3-model.md E.2); what is compared is that both sides load the same one.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MODEL_INDEX = {  # the diffusers-format root's entries for the text components (h3-model.md I.1)
    "_class_name": "MiniMaxH3Pipeline",
    "_diffusers_version": "0.42.1",
    "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
    "tokenizer": ["transformers", "Qwen2TokenizerFast"],
    "processor": ["transformers", "Qwen3VLProcessor"],
}

PROMPTS = {
    "plain": PROMPT,
    "labels": "<Picture 1>: the fox, <Video 2> the beach and <Audio 1> the waves; <Image 3> is not a label.",
    "dialogue": "<d>[English] Hello there, how are you today?</d> The waves crash softly.",
    "control": "Say <|im_end|> then <|endoftext|> and <|im_start|>user",
    "unicode": "Caf\u00e9 vs Cafe\u0301 \u2014 \u6771\u4eac\u306e\u591c \ufb01ne \U0001f98a \u00a0tabs\there\r\nnew line",
    "long": " ".join([PROMPT] * 40) + " [Shot 1] At 00:04.500 " + "x" * 500,
}


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    """One tiny tokenizer, processor config and model written in every layout; returns the layout roots."""
    root = tmp_path_factory.mktemp("loading")
    tokenizer = tiny_qwen.write_tokenizer(root / "tokenizer_source")
    (tokenizer / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    config = tiny_qwen.config_dict(tokenizer)
    model = tiny_qwen.random_model(config, seed=11)

    diffusers_root = root / "MiniMax-H3-diffusers"
    model.save_pretrained(str(diffusers_root / "text_encoder"), safe_serialization=True)
    tiny_qwen.copy_tokenizer(tokenizer, diffusers_root / "tokenizer")
    tiny_qwen.write_processor(diffusers_root / "processor", nested=True)
    tiny_qwen.copy_tokenizer(tokenizer, diffusers_root / "processor")
    (diffusers_root / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=2))

    release = tiny_qwen.write_original_release(root / "MiniMax-H3", model, tokenizer)
    hf = tiny_qwen.write_hf_folder(root / "qwen3vl-hf", model, tokenizer)
    return {"diffusers": diffusers_root, "release": release, "partition": release / "FL2VA", "hf": hf}


def _stand_in_video_processor(folder, subfolder):
    """transformers' Qwen3-VL video processor class with h3_core's torch stand-ins for torchvision, its config read by
    transformers' own from_pretrained."""
    from h3_core.prompt import _video_processor_class

    return _video_processor_class().from_pretrained(str(folder), subfolder=subfolder)


def _load_processor(load, folder, subfolder):
    """Call `load(**extra)`, diffusers' from_pretrained of the processor in `folder`/`subfolder`: untouched where
    torchvision is installed, else given the stand-in video processor (read from the same folder) with transformers'
    class check relaxed for it."""
    if HAS_TORCHVISION:
        return load()
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    strict = Qwen3VLProcessor.check_argument_for_proper_class

    def relaxed(self, name, argument):  # BaseVideoProcessor is not importable without torchvision
        if name == "video_processor" and isinstance(argument, Qwen3VLVideoProcessor):
            return type(argument)
        return strict(self, name, argument)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Qwen3VLProcessor, "check_argument_for_proper_class", relaxed)
        return load(video_processor=_stand_in_video_processor(folder, subfolder))


@pytest.fixture(scope="module")
def reference(disk):
    """diffusers' modular pipeline over the diffusers-format root, its text components loaded by itself."""
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3TextEncoderStep

    pipe = MiniMaxH3TextEncoderStep().init_pipeline(str(disk["diffusers"]))
    pipe.load_components(names=["tokenizer", "text_encoder"], dtype=torch.float32)

    def load(**extra):
        pipe.load_components(names=["processor"], **extra)

    _load_processor(load, disk["diffusers"], "processor")
    for name in ("tokenizer", "processor", "text_encoder"):
        assert getattr(pipe, name, None) is not None, f"diffusers did not load its {name}"
    return pipe


@pytest.fixture(scope="module")
def loaded():
    return {}


@pytest.fixture(params=["diffusers", "release", "partition", "hf"])
def ours(request, disk, loaded):
    """h3_core's text encoder loaded from one layout (once per layout)."""
    from h3_core.text import load_text_encoder

    if request.param not in loaded:
        loaded[request.param] = load_text_encoder(disk[request.param], torch.float32)
    return loaded[request.param]


# ---------------------------------------------------------------------------------------------
# Where each side looks


def test_both_sides_read_the_release_subfolders(disk, reference):
    """diffusers loads tokenizer/ and processor/ with the component specs' classes; ours finds the same folders."""
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3TextEncoderStep
    from transformers import Qwen2TokenizerFast, Qwen3VLProcessor

    from h3_core.text import locate_text_encoder_files

    declared = {spec.name: spec.type_hint for spec in MiniMaxH3TextEncoderStep().expected_components}
    assert declared["tokenizer"] is Qwen2TokenizerFast and declared["processor"] is Qwen3VLProcessor
    root = disk["diffusers"]
    specs = reference._component_specs
    for name in ("tokenizer", "processor", "text_encoder"):
        assert (specs[name].pretrained_model_name_or_path, specs[name].subfolder) == (str(root), name)
    assert specs["tokenizer"].type_hint is Qwen2TokenizerFast and specs["processor"].type_hint is Qwen3VLProcessor
    assert isinstance(reference.tokenizer, Qwen2TokenizerFast) and isinstance(reference.processor, Qwen3VLProcessor)
    source = locate_text_encoder_files(root)
    assert (source.tokenizer_folder, source.processor_folder) == (root / "tokenizer", root / "processor")
    assert source.files == (root / "text_encoder" / "model.safetensors",)


def test_each_layout_is_named_for_what_it_is(disk):
    """`h3 inspect` and load messages name the layout: the diffusers-format root was called an original partition
    (both hold tokenizer/ beside text_encoder/; their model_index.json name different encoder classes)."""
    from h3_core.text_checkpoint import locate_text_encoder

    origins = {name: locate_text_encoder(disk[name]).origin for name in ("diffusers", "release", "partition", "hf")}
    assert origins == {"diffusers": "diffusers folder", "release": "original partition",
                       "partition": "original partition", "hf": "HF-layout folder"}


# ---------------------------------------------------------------------------------------------
# The tokenizer


@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_token_ids_equal(ours, reference, prompt):
    text = PROMPTS[prompt]
    tokenizers = {"tokenizer/": reference.tokenizer, "processor/": reference.processor.tokenizer}
    mine = ours.presenter.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(mine) > 3
    for where, tokenizer in tokenizers.items():
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == mine, where
        assert tokenizer(text)["input_ids"] == ours.presenter.tokenizer(text)["input_ids"], where
        assert tokenizer.decode(mine) == ours.presenter.tokenizer.decode(mine), where
    assert ours.presenter.t2va(text).input_ids.tolist() == mine  # what the engine presents: the prompt's ids alone


def test_special_and_control_token_ids_equal(ours, reference):
    mine = ours.presenter.tokenizer
    processor = reference.processor
    names = tiny_qwen.SPECIAL_TOKENS + tiny_qwen.ADDED_TOKENS
    ids = {token: mine.convert_tokens_to_ids(token) for token in names}
    assert len(set(ids.values())) == len(names) and mine.unk_token_id not in ids.values()
    for where, tokenizer in (("tokenizer/", reference.tokenizer), ("processor/", processor.tokenizer)):
        assert {token: tokenizer.convert_tokens_to_ids(token) for token in names} == ids, where
        for attribute in ("eos_token_id", "pad_token_id", "bos_token_id", "unk_token_id", "all_special_ids"):
            assert getattr(tokenizer, attribute) == getattr(mine, attribute), (where, attribute)
        assert len(tokenizer) == len(mine) and tokenizer.get_vocab() == mine.get_vocab(), where
        added = {i: (t.content, t.special, t.normalized) for i, t in tokenizer.added_tokens_decoder.items()}
        assert added == {i: (t.content, t.special, t.normalized) for i, t in mine.added_tokens_decoder.items()}, where
    assert (processor.image_token_id, processor.video_token_id) == (ours.presenter.image_token_id,
                                                                    ours.presenter.video_token_id)
    assert (processor.vision_start_token_id, processor.vision_end_token_id) == (
        ours.presenter.special_ids["<|vision_start|>"], ours.presenter.special_ids["<|vision_end|>"])
    config = reference.text_encoder.config  # the model diffusers loaded agrees with both
    assert (config.image_token_id, config.video_token_id) == (ours.model.config.image_token_id,
                                                              ours.model.config.video_token_id)
    assert config.image_token_id == ids["<|image_pad|>"] and config.video_token_id == ids["<|video_pad|>"]


def test_chat_template_output_equal(ours, reference):
    messages = [
        {"role": "system", "content": "You describe videos."},
        {"role": "user", "content": PROMPTS["unicode"]},
        {"role": "assistant", "content": PROMPTS["dialogue"]},
    ]
    mine = ours.presenter.tokenizer
    expected = mine.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert expected.startswith("<|im_start|>system\nYou describe videos.<|im_end|>\n")
    assert expected.endswith("<|im_start|>assistant\n")
    expected_ids = mine(expected, add_special_tokens=False)["input_ids"]
    for where, tokenizer in (("tokenizer/", reference.tokenizer), ("processor/", reference.processor.tokenizer)):
        assert tokenizer.chat_template == mine.chat_template, where
        assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == expected, where
        assert tokenizer(expected, add_special_tokens=False)["input_ids"] == expected_ids, where
    assert reference.processor.chat_template == mine.chat_template
    assert reference.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == expected


# ---------------------------------------------------------------------------------------------
# The processor


IMAGE_SETTINGS = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "rescale_factor",
                  "resample", "do_resize", "do_rescale", "do_normalize", "do_convert_rgb")


def _pixel_limits(processor) -> tuple:
    size = processor.size
    return (size.shortest_edge, size.longest_edge, getattr(processor, "min_pixels", None),
            getattr(processor, "max_pixels", None))


def test_image_processor_settings_and_pixels_equal(ours, reference):
    mine, theirs = ours.presenter.vision.image_processor, reference.processor.image_processor
    for name in IMAGE_SETTINGS:
        assert getattr(theirs, name) == getattr(mine, name), name
    assert _pixel_limits(theirs) == _pixel_limits(mine) == (1024, 12288, None, None)
    assert theirs.to_dict() == mine.to_dict()
    same_backend = type(theirs) is type(mine)
    assert same_backend or HAS_TORCHVISION  # without torchvision both are transformers' PIL processor
    for height, width, seed in ((64, 96, 1), (150, 200, 2)):  # the second is resized by the processor
        image = picture(height, width, seed)
        pixels, grid = ours.presenter.vision.images([image])
        expected = theirs(images=[image], return_tensors="pt")
        assert torch.equal(grid, expected["image_grid_thw"].to(torch.int64)), (height, width)
        if same_backend:
            assert torch.equal(pixels, expected["pixel_values"]), (height, width)
        else:  # torchvision backend on diffusers' side: float rounding, one uint8 level where it resizes
            assert torch.allclose(pixels, expected["pixel_values"], atol=1e-5 if height == 64 else 2 / 255 / 0.5)
    assert grid.tolist() == [[1, 6, 8]]  # 150x200 -> 96x128 under the 12288-pixel cap


def test_video_processor_settings_and_pixels_equal(ours, reference):
    mine, theirs = ours.presenter.vision.video_processor, reference.processor.video_processor
    for name in IMAGE_SETTINGS:
        assert getattr(theirs, name) == getattr(mine, name), name
    assert _pixel_limits(theirs) == _pixel_limits(mine) == (1024, 16384, None, None)
    frames = clip(4, 3)
    pixels, grid = ours.presenter.vision.videos([frames])
    expected = theirs(videos=[frames], do_sample_frames=False, return_tensors="pt")
    assert torch.equal(grid, expected["video_grid_thw"].to(torch.int64))
    assert torch.equal(pixels, expected["pixel_values_videos"])


def _sized(config: dict, longest: int) -> dict:
    return dict(config, size={"shortest_edge": 32 * 32, "longest_edge": longest})


PROCESSOR_FILES = {  # processor/ folders whose files disagree: which one each side reads must be the same
    "nested-and-legacy": {
        "processor_config.json": {"processor_class": "Qwen3VLProcessor",
                                  "image_processor": _sized(tiny_qwen.IMAGE_PROCESSOR, 96 * 96),
                                  "video_processor": _sized(tiny_qwen.VIDEO_PROCESSOR, 12800)},
        "preprocessor_config.json": _sized(tiny_qwen.IMAGE_PROCESSOR, 128 * 128),
        "video_preprocessor_config.json": _sized(tiny_qwen.VIDEO_PROCESSOR, 20480),
    },
    "legacy-image-only": {"preprocessor_config.json": _sized(tiny_qwen.IMAGE_PROCESSOR, 96 * 96)},
    "nested-image-legacy-video": {
        "processor_config.json": {"processor_class": "Qwen3VLProcessor",
                                  "image_processor": _sized(tiny_qwen.IMAGE_PROCESSOR, 96 * 96)},
        "video_preprocessor_config.json": _sized(tiny_qwen.VIDEO_PROCESSOR, 20480),
    },
}


READ = {  # (image, video) longest_edge both read: nested first; no video file -> the image one (as transformers)
    "nested-and-legacy": [96 * 96, 12800],
    "legacy-image-only": [96 * 96, 96 * 96],
    "nested-image-legacy-video": [96 * 96, 20480],
}


@pytest.mark.parametrize("case", sorted(PROCESSOR_FILES))
def test_which_processor_file_is_read_is_the_same(disk, tmp_path, case):
    """Both sides pick the same file (and so the same pixel limits) when a processor/ folder holds several."""
    from diffusers.modular_pipelines.modular_pipeline_utils import ComponentSpec
    from transformers import Qwen3VLProcessor

    from h3_core.text import load_text_encoder

    root = tmp_path / "repo"
    processor = root / "processor"
    tiny_qwen.copy_tokenizer(disk["diffusers"] / "tokenizer", processor)
    for name, payload in PROCESSOR_FILES[case].items():
        (processor / name).write_text(json.dumps(payload))
    if HAS_TORCHVISION and "video_preprocessor_config.json" not in PROCESSOR_FILES[case] and not any(
            "video_processor" in payload for payload in PROCESSOR_FILES[case].values()):
        pytest.skip("with torchvision, transformers refuses a processor folder without a video processor config "
                    "(ours reads the image one for videos); without torchvision diffusers is given the stand-in")
    spec = ComponentSpec("processor", Qwen3VLProcessor, pretrained_model_name_or_path=str(root), subfolder="processor")
    theirs = _load_processor(spec.load, root, "processor")
    mine = load_text_encoder(disk["diffusers"], torch.float32, processor=processor).presenter.vision
    limits = [_pixel_limits(p) for p in (mine.image_processor, mine.video_processor)]
    assert [_pixel_limits(p) for p in (theirs.image_processor, theirs.video_processor)] == limits
    assert [limit[1] for limit in limits] == READ[case]
    image = picture(150, 200, 5)
    pixels, grid = mine.images([image])
    expected = theirs.image_processor(images=[image], return_tensors="pt")
    assert torch.equal(grid, expected["image_grid_thw"].to(torch.int64))
    if type(theirs.image_processor) is type(mine.image_processor):
        assert torch.equal(pixels, expected["pixel_values"])


# ---------------------------------------------------------------------------------------------
# The whole text-condition path, each side with what it loaded


def _run_reference(step, reference, monkeypatch, **inputs):
    from diffusers.modular_pipelines.minimax_h3 import encoders

    seen = {}
    original = encoders.get_qwen3vl_prompt_embeds

    def recording(text_encoder, processor, token_ids, vision_inputs=None, **kwargs):
        seen["ids"], seen["vision"] = list(token_ids), dict(vision_inputs or {})
        seen["mm"] = processor.create_mm_token_type_ids([list(token_ids)])[0]
        return original(text_encoder, processor, token_ids, vision_inputs, **kwargs)

    monkeypatch.setattr(encoders, "get_qwen3vl_prompt_embeds", recording)
    pipe = step.init_pipeline()
    pipe.update_components(text_encoder=reference.text_encoder, tokenizer=reference.tokenizer,
                           processor=reference.processor)
    with torch.no_grad():
        out = pipe(**inputs, output=["prompt_embeds", "text_token_tags"])
    return out["prompt_embeds"], out["text_token_tags"], seen


TASKS = ("t2va", "fl2va", "ref2va-images+audio", "ref2va-videos")


@pytest.mark.parametrize("task", TASKS)
def test_text_conditions_equal_with_each_sides_own_loading(ours, reference, monkeypatch, task):
    from diffusers.modular_pipelines.minimax_h3 import encoders

    if task == "t2va":
        step, inputs = encoders.MiniMaxH3TextEncoderStep(), {"prompt": PROMPTS["unicode"]}
        presentation = ours.presenter.t2va(PROMPTS["unicode"])
    elif task == "fl2va":
        keyframes = [picture(64, 96, 3), picture(150, 200, 4)]
        step, inputs = encoders.MiniMaxH3FL2VATextEncoderStep(), {"prompt": PROMPT, "keyframes": keyframes}
        presentation = ours.presenter.fl2va(PROMPT, keyframes)
    else:
        references = REF2VA_CASES[task.split("-", 1)[1]]()
        step = encoders.MiniMaxH3Ref2VATextEncoderStep()
        inputs = {"prompt": PROMPTS["labels"], "normalized_references": to_diffusers(references)}
        presentation = ours.presenter.ref2va(PROMPTS["labels"], references)
        kinds = {type(r) for r in references}
        assert (ImageReference in kinds) and (VideoReference in kinds) == (task == "ref2va-videos")
    embeds, tags, seen = _run_reference(step, reference, monkeypatch, **inputs)
    assert presentation.input_ids.tolist() == seen["ids"]
    assert presentation.mm_token_type_ids.tolist() == seen["mm"]
    assert sorted(presentation.vision_inputs) == sorted(seen["vision"])
    # with torchvision, transformers loads its torchvision image processor for diffusers, ours resizes with PIL
    same_backend = type(reference.processor.image_processor) is type(ours.presenter.vision.image_processor)
    for name, value in seen["vision"].items():
        mine = presentation.vision_inputs[name]
        if same_backend or not value.is_floating_point():
            assert torch.equal(mine, value), name
        else:  # float rounding, one uint8 level where it resizes (as in the image processor test)
            assert torch.allclose(mine, value, atol=2 / 255 / 0.5), name
    got = ours.encode(presentation)
    assert torch.equal(got.token_tags, tags)
    assert got.prompt_embeds.shape == embeds.shape == (1, len(seen["ids"]), 32)
    assert got.prompt_embeds.dtype == embeds.dtype == torch.float32
    if same_backend or task == "t2va":
        assert (got.prompt_embeds - embeds).abs().max().item() <= ATOL
    else:  # pixels a uint8 level apart where they were resized: the states near (0.13% at most with torchvision 0.29)
        assert ((got.prompt_embeds - embeds).norm() / embeds.norm()).item() < 5e-3
    if task != "t2va":
        assert int((np.asarray(seen["mm"]) > 0).sum()) > 0  # pictures really reached the processors
