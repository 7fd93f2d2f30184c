"""Every node's execute path on tiny-random, on the CPU, with ComfyUI's few services faked (fake_comfy):
loaders -> conditioning (t2va, fl2va, ref2va through the growing reference list) -> empty latent ->
sampler (output list, previews, custom sigmas, refinement, interrupt) -> decode -> MP4; LoRA apply;
the memory-manager wrapper."""

import importlib
import itertools
import json
import logging
import os
import re
import sys
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import av
import numpy as np
import pytest
import torch

from h3_core.pipeline import TINY_CANVAS
from h3_core.references import RELEASE_CANVAS

sys.path.insert(0, str(Path(__file__).parent))
import fake_comfy  # noqa: E402

TURBO = "minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors"


@pytest.fixture
def comfy(tmp_path):
    with fake_comfy.installed(tmp_path) as record:
        yield SimpleNamespace(record=record, tmp=tmp_path, **{
            name: importlib.import_module(f"nodes.{name}") for name in ("loaders", "conditioning", "latent", "sampler",
                                                                      "output", "memory")})


def _models(c, partition="fl2va"):
    model = c.loaders.H3ModelLoader.execute("tiny-random", "", partition, "bf16", "auto").values[0]
    text = c.loaders.H3TextEncoderLoader.execute("tiny-random", "", "", "bf16").values[0]
    vae = c.loaders.H3VAELoader.execute("tiny-random", "tiny-random", "").values[0]
    return model, text, vae


def _cond(c, text, vae, task="t2va", **media):
    return c.conditioning.H3Conditioning.execute(text, "a fox on a beach", task, "auto", 0, 0, 4.0, vae=vae, **media)


def test_t2va_chain_with_output_list_previews_and_mp4(comfy):
    c = comfy
    model, text, vae = _models(c)
    assert [names for names, _ in c.record.loaded] == [["H3 DiT (fl2va, tiny-random)"],
                                                     ["H3 text encoder (tiny-random)"],
                                                     ["H3 VAEs (tiny-random + tiny-random)"]]
    cond, width, height, frames = _cond(c, text, vae).values
    assert (width, height, frames) == (224, 128, 107)
    latent = c.latent.H3EmptyAVLatent.execute(1344, 768, 124, conditioning=cond).values[0]
    assert latent["empty"] and list(latent["video"].shape) == [1, 24, 32, 8, 14] and "H3_LATENT(" in str(latent)
    out = c.sampler.H3Sampler.execute(model, cond, 5, 3, 0.0, 0.0, 1.0, 2, latent=latent).values[0]
    assert [item["seed"] for item in out] == [5, 6] and not torch.equal(out[0]["video"], out[1]["video"])
    values = [(value, total) for value, total, _ in c.record.progress if total == 4]
    assert values == [(1, 4), (2, 4), (3, 4), (4, 4)]  # one bar over both outputs (2 model calls each)
    kind, picture, size = c.record.progress[-1][2]
    assert kind == "JPEG" and picture.size == (14, 8) and size == 512  # the middle latent frame, false colour
    assert c.record.loaded[-1][1] > 0  # the sampler asked ComfyUI for room for its activations

    images, audio = c.output.H3VAEDecode.execute(vae, out[0]).values
    assert images.shape == (107, 128, 224, 3) and audio["waveform"].shape == (1, 2, round(107 * 32000 / 24))
    # the decoder's floats, not rounded to 8 bits (as ComfyUI's own VAE Decode gives them); the MP4 path's bytes
    from h3_core.output import decode_video

    rounded = torch.cat(list(decode_video(vae.video, out[0]["video"])))
    assert torch.equal(images.mul(255.0).round().to(torch.uint8), rounded)
    assert not torch.equal(images, rounded.float() / 255.0)
    saved = c.output.H3AVSave.execute(images, "H3/test", audio=audio)
    path = Path(saved.values[0][1])
    assert path.is_file() and saved.ui["videos"][0].filename == path.name
    with av.open(str(path)) as container:
        assert sorted(s.type for s in container.streams) == ["audio", "video"]
    assert b"crf=18.0" in path.read_bytes()  # x264 notes its settings in the stream
    coarser = Path(c.output.H3AVSave.execute(images, "H3/test", audio=audio, crf=30).values[0][1])
    assert b"crf=30.0" in coarser.read_bytes() and coarser.stat().st_size < path.stat().st_size


def test_the_crf_widget_offers_what_the_encoder_takes(comfy):
    """Both MP4 savers' crf widget spans x264's whole range (0 lossless .. 51) and no more (a value the widget
    offers but the encoder refuses would fail only after the decode), and may be left out: prompts scripted
    before the input existed still run, at the default."""
    from h3_core.media_write import DEFAULT_CRF, check_crf

    for node in (comfy.output.H3AVSave, importlib.import_module("nodes.long_video").H3SaveMP4):
        crf = {port.id: port for port in node.define_schema().inputs}["crf"]
        assert (crf.options["default"], crf.optional) == (DEFAULT_CRF, True), node
        for inside in (crf.min, crf.max):
            check_crf(inside)
        for outside in (crf.min - 1, crf.max + 1):
            with pytest.raises(ValueError, match="crf must be an integer from 0"):
                check_crf(outside)


def test_vae_decode_refuses_an_image_larger_than_the_cpu_memory_before_decoding(comfy, monkeypatch):
    """An IMAGE holds every frame as float32 in CPU memory (300 s at 1344x768: 89 GB); one that cannot fit was
    decoded for minutes first and then ran the host out of memory."""
    c = comfy
    vae = c.loaders.H3VAELoader.execute("tiny-random", "tiny-random", "").values[0]
    latent = {**c.latent.H3EmptyAVLatent.execute(224, 128, 107).values[0], "empty": False}
    need = 107 * 128 * 224 * 3 * 4
    monkeypatch.setattr(c.output, "host_memory_available", lambda: need - 1)
    loaded = len(c.record.loaded)
    with pytest.raises(ValueError, match=r"holds all 107 frames \(224x128\) in CPU memory as an IMAGE: 0.0 GiB, "
                                         r"more than .* Use H3 Save MP4 \(streamed\)"):
        c.output.H3VAEDecode.execute(vae, latent)
    assert len(c.record.loaded) == loaded and not c.record.progress  # nothing placed, nothing decoded
    monkeypatch.setattr(c.output, "host_memory_available", lambda: need)
    assert c.output.H3VAEDecode.execute(vae, latent).values[0].shape == (107, 128, 224, 3)


def test_fl2va_and_ref2va_through_the_growing_reference_list(comfy):
    c = comfy
    model, text, vae = _models(c)
    first = torch.rand(1, 128, 224, 3)
    cond = _cond(c, text, vae, "fl2va", first_image=first, last_image=first.flip(1)).values[0]
    assert cond.task == "fl2va" and len(cond.visual_condition_latents) == 2
    assert len(c.sampler.H3Sampler.execute(model, cond, 0, 2, 0.0, 0.0).values[0]) == 1

    video = SimpleNamespace(get_components=lambda: SimpleNamespace(
        images=torch.rand(60, 128, 224, 3), frame_rate=Fraction(24), audio=None))
    audio = {"waveform": torch.randn(1, 2, 32000 * 3) * 0.1, "sample_rate": 32000}
    refs = {"ref2": audio, "ref0": torch.rand(1, 160, 160, 3), "ref1": video}  # slot order, not dict order
    cond = _cond(c, text, vae, "ref2va", references=refs).values[0]
    assert cond.task == "ref2va" and cond.layout.num_condition_audio_rows > 0
    ref_model = c.loaders.H3ModelLoader.execute("tiny-random", "", "ref2va", "bf16", "auto").values[0]
    assert len(c.sampler.H3Sampler.execute(ref_model, cond, 0, 2, 0.0, 0.0).values[0]) == 1
    with pytest.raises(ValueError, match="loaded as fl2va"):
        c.sampler.H3Sampler.execute(model, cond, 0, 2, 0.0, 0.0)

    # image references sized to the output's area (native ComfyUI's 'match') instead of a 256 short edge here
    lossy = _cond(c, text, vae, "ref2va", references=refs, reference_images="canvas-lossy").values[0]
    assert [(b.latent_height, b.latent_width) for b in cond.reference_blocks][0] == (16, 16)
    assert [(b.latent_height, b.latent_width) for b in lossy.reference_blocks][0] == (10, 10)  # 160 px, kept
    assert cond.layout.num_condition_video_rows - lossy.layout.num_condition_video_rows == 8 * 8 - 5 * 5  # 2x2 patches


def test_conditioning_says_what_h3_generate_warns_about_pictures_and_labels(comfy, caplog):
    """The prompt's labels checked against the media (as the command line notes them), and the parts of an IMAGE
    left out (the rest of a batch on a keyframe, transparency), in ComfyUI's log: they ran without a word."""
    c = comfy
    _, text, vae = _models(c)
    image = torch.rand(2, 64, 96, 4)
    image[..., 3] = 0.5
    with caplog.at_level("WARNING", logger="h3"):
        c.conditioning.H3Conditioning.execute(text, "<Image 1> walks in, <Picture 2> talks.", "ref2va", "auto", 0, 0,
                                              4.0, vae=vae, references={"ref0": image[:1]})
        c.conditioning.H3Conditioning.execute(text, "a fox", "fl2va", "auto", 0, 0, 4.0, vae=vae, first_image=image)
    said = [r.getMessage() for r in caplog.records]
    assert "H3: the prompt names <Image 1>: the model's label for a picture is <Picture 1>." in said, said
    assert "H3: the prompt names <Picture 2>, but the request carries 1 picture label." in said, said
    assert "H3: first_image is a batch of 2 images; its first is used." in said, said
    assert sum("has transparent pixels; H3 takes RGB" in line for line in said) == 2, said


def test_conditioning_media_checks(comfy):
    c = comfy
    _, text, vae = _models(c)
    image = torch.rand(1, 64, 64, 3)
    check = c.conditioning.H3Conditioning.validate_inputs
    ten = {f"references.ref{i}": "IMAGE" for i in range(10)}
    assert "at most 9 image references" in check(input_types=ten, task="ref2va")
    assert "needs an image or video" in check(input_types={"references.ref0": "AUDIO"}, task="ref2va")
    assert "t2va takes a prompt only" in check(input_types={"first_image": "IMAGE"}, task="t2va")
    assert check(input_types={"references.ref0": "IMAGE", "references.ref1": "AUDIO", "vae": "H3_VAE"},
                 task="ref2va") is True
    # wrong links are named in slot order (ref2 before ref10), however ComfyUI orders them
    assert "References must be IMAGE, VIDEO or AUDIO; got MASK, LATENT." in check(
        input_types={"references.ref10": "LATENT", "references.ref2": "MASK", "vae": "H3_VAE"}, task="ref2va")
    # as ComfyUI hands them over: every slot None, a typed value's slot without a type (it passed, then failed
    # when the node ran); both nodes
    for node in (c.conditioning.H3Conditioning, importlib.import_module("nodes.long_video").H3Continuation):
        linked = {"references.ref0": "IMAGE", "vae": "H3_VAE"}
        assert node.validate_inputs(input_types=linked, task="ref2va", references={"ref0": None}) is True
        assert node.validate_inputs(input_types=linked, task="ref2va", references={"ref0": None, "ref1": None}) == (
            "references.ref1 holds a value, not a link: a reference is an IMAGE, VIDEO or AUDIO output linked to it "
            "(from Load Image, Load Video or Load Audio).")
    assert "connect H3 VAE Loader's vae" in check(input_types={"first_image": "IMAGE"}, task="fl2va")
    assert check(input_types={"first_image": "IMAGE"}, task=None) is True  # a linked task is checked at run time
    assert "The prompt is empty" in check(input_types={}, task="t2va", prompt="  ")
    # as the engine refuses them, at queue time (they were refused after the text encoder loaded)
    assert "The prompt is empty" in check(input_types={}, task="t2va", prompt="\u200b\ufeff")
    assert "The prompt holds <|image_pad|>, the text encoder's own markers" in check(
        input_types={}, task="t2va", prompt="a fox <|image_pad|>")
    assert check(input_types={"prompt": "STRING"}, task="t2va", prompt=None) is True  # linked: at run time
    assert "vae takes H3_VAE, got VAE" in check(input_types={"vae": "VAE"}, task="t2va")
    assert "prompt takes STRING, got H3_VAE" in check(input_types={"prompt": "H3_VAE"}, task="t2va")
    assert "task must be one of t2va, fl2va, ref2va; got 't3va'" in check(input_types={}, task="t3va")
    assert "aspect_ratio takes COMBO, got IMAGE" in check(input_types={"aspect_ratio": "IMAGE"}, task="t2va")
    assert check(input_types={"aspect_ratio": "COMBO", "reference_images": ["release", "canvas-lossy"]},
                 task="t2va") is True
    with pytest.raises(ValueError, match=r"references.ref12: no such input; references go from ref0 to ref11"):
        _cond(c, text, vae, "ref2va", references={"ref0": image}, **{"references.ref12": image})
    with pytest.raises(ValueError, match=r"^num_frames: no such input\.$"):
        _cond(c, text, vae, "t2va", num_frames=124)
    with pytest.raises(ValueError, match=r"Give width and height together, or neither .*; only the width was given \(320\)"):
        c.conditioning.H3Conditioning.execute(text, "a fox", "t2va", "auto", 320, 0, 4.0)
    with pytest.raises(ValueError, match="ref2va takes references, not first_image"):
        _cond(c, text, vae, "ref2va", first_image=image, references={"ref0": image})
    # a linked task is checked against the media when the node runs, as validate_inputs checks a chosen one
    with pytest.raises(ValueError, match=r"^fl2va needs first_image, last_image or both connected; a prompt alone"):
        _cond(c, text, vae, "fl2va")
    with pytest.raises(ValueError, match=r"^t2va takes a prompt only: disconnect the keyframes"):
        _cond(c, text, vae, "t2va", first_image=image)
    with pytest.raises(ValueError, match="IMAGE, VIDEO or AUDIO"):
        _cond(c, text, vae, "ref2va", references={"ref0": "text"})



def test_continuation_wiring_checks_at_queue_time(comfy):
    """H3 Continuation's wiring is refused by validate_inputs, before ComfyUI runs the loaders feeding it."""
    check = importlib.import_module("nodes.long_video").H3Continuation.validate_inputs
    vae = {"vae": "H3_VAE"}
    assert check(input_types={}, task="t2va") is True
    assert check(input_types={"references.ref0": "IMAGE", "references.ref1": "AUDIO", **vae}, task="ref2va") is True
    assert "t2va takes a prompt only" in check(input_types={"references.ref0": "IMAGE", **vae}, task="t2va")
    assert "needs an image or video" in check(input_types={"references.ref0": "AUDIO", **vae}, task="ref2va")
    assert "References must be IMAGE, VIDEO or AUDIO; got LATENT" in check(
        input_types={"references.ref0": "LATENT", **vae}, task="ref2va")
    # a link that may bring any medium (an any-type "*", ComfyUI's Switch, a union with IMAGE): ComfyUI's own rule
    # takes it, so its kind is checked when the node runs; it still counts as a reference (once refused outright)
    for anything in ("*", "COMFY_MATCHTYPE_V3", "IMAGE,MASK"):
        assert check(input_types={"references.ref0": anything, **vae}, task="ref2va") is True, anything
        assert check(input_types={"references.ref0": "AUDIO", "references.ref1": anything, **vae},
                     task="ref2va") is True, anything  # perhaps the image the audio needs
        assert "t2va takes a prompt only" in check(input_types={"references.ref0": anything, **vae}, task="t2va")
    assert "References must be IMAGE, VIDEO or AUDIO; got MASK,LATENT" in check(
        input_types={"references.ref0": "MASK,LATENT", **vae}, task="ref2va")
    assert "at most 12 references in total, got 13" in check(
        input_types={**{f"references.ref{i}": "*" for i in range(13)}, **vae}, task="ref2va")
    assert "task must be one of t2va, ref2va; got 'fl2va'" in check(input_types={}, task="fl2va")
    assert check(input_types={"references.ref0": "IMAGE", **vae}, task=None) is True  # a linked task: at run time
    assert "The VAEs encode references and drive_audio: connect H3 VAE Loader's vae" in check(
        input_types={"references.ref0": "IMAGE", "drive_audio": "AUDIO"}, task="ref2va")
    assert "The VAEs encode guides" in check(input_types={"guides": "H3_GUIDES"}, task="t2va")
    assert check(input_types={"continue_from": "H3_LATENT", "keep_video": "H3_LATENT"}, task="t2va").startswith(
        "keep_video makes the sound for a whole clip of yours; it cannot go with continue_from")
    assert "a continued clip already has its sound" in check(
        input_types={"continue_from": "H3_LATENT", "drive_audio": "AUDIO", **vae}, task="t2va")
    assert "continue_from takes H3_LATENT, got LATENT" in check(input_types={"continue_from": "LATENT"}, task="t2va")
    assert "model takes H3_MODEL, got MODEL" in check(input_types={"model": "MODEL"}, task="t2va")
    assert check(input_types={}, task="t2va", prompt=" \n") == "The prompt is empty; H3 needs a non-empty text " \
        "prompt for every task."
    assert check(input_types={}, task="t2va", prompt="", window_prompts="rain\nsun") is True  # one per window
    assert "The prompt is empty" in check(input_types={}, task="t2va", prompt="\u200b", window_prompts="")
    assert "The prompt holds <|vision_start|>" in check(input_types={}, task="t2va", prompt="a <|vision_start|>")
    assert "window_prompts holds <|video_pad|>" in check(input_types={}, task="t2va", prompt="",
                                                           window_prompts="rain\n<|video_pad|>")
    assert check(input_types={"window_prompts": "STRING"}, task="t2va", prompt="", window_prompts=None) is True
    assert check(input_types={"prompt": "STRING"}, task="t2va", prompt=None) is True  # linked: at run time


def test_a_window_plan_that_cannot_be_made_is_refused_at_queue_time(comfy):
    """H3 Continuation plans its windows from the widgets at queue time, as the run will (the loaders feeding it
    not run yet), redoing ComfyUI's own range check of the numbers it names; linked values and a given clip's
    length wait for the run."""
    node = importlib.import_module("nodes.long_video").H3Continuation

    def check(types=None, **given):
        widgets = dict(task="t2va", prompt="rain", duration=20.0, mode="continuation", window_frames=277,
                       overlap_frames=22)
        return node.validate_inputs(input_types=types or {}, **{**widgets, **given})

    assert check() is True and check(overlap_frames=5) is True and check(mode="full", duration=30.0) is True
    assert "The overlap frame count must be of the form 17n + 5 (e.g. 22, 107, 277); got 30" in check(overlap_frames=30)
    assert "The overlap (277 frames) must be shorter than the window (277)" in check(overlap_frames=277)
    assert check(window_frames=400) == "window_frames: Value 400 bigger than max of 345."
    assert check(overlap_frames=-12) == "overlap_frames: Value -12 smaller than min of 5."
    assert check(duration=301.0) == "duration: Value 301.0 bigger than max of 300.0."
    assert "30" in check(mode="full", duration=40.0)
    assert "Give one window prompt per window: this 481-frame plan has 2 window(s)" in check(
        prompt="", window_prompts="rain\nsun\nsnow")
    assert check(prompt="", window_prompts="rain\nsun") is True
    assert check(duration=None, overlap_frames=30) == check(window_frames=None, overlap_frames=30) is True  # linked
    assert check({"continue_from": "H3_LATENT"}, overlap_frames=277) is True  # the clip's length: at run time
    assert check({"window_prompts": "STRING"}, window_prompts=None) is True
    assert check({"continue_from": "H3_LATENT", "keep_video": "H3_LATENT"}, window_frames=400).endswith(
        "continue_from extends a clip). window_frames: Value 400 bigger than max of 345.")  # both said


def test_a_wrong_link_into_any_input_is_refused_at_queue_time(comfy):
    """validate_inputs turns ComfyUI's own link-type check off, so the nodes that have one check every input's
    link against the type their schema gives it (but the reference list, whose slots are checked as media)."""
    long_video = importlib.import_module("nodes.long_video")
    for node in (comfy.conditioning.H3Conditioning, long_video.H3Continuation, comfy.output.H3AVSave,
                 comfy.latent.H3EmptyAVLatent, comfy.latent.H3VAEEncode):
        ports = fake_comfy.schema_of(node)["inputs"]
        for name, port in ports.items():
            if port.type == "COMFY_AUTOGROW_V3":
                continue
            assert node.validate_inputs(input_types={name: "WRONG"}) == f"{name} takes {port.type}, got WRONG.", name
            assert "takes" not in str(node.validate_inputs(input_types={name: port.type})), name
    # ComfyUI validates a fresh copy of the class for each queued prompt: none is kept (a cache on the class did)
    import gc
    import weakref

    copy = type("H3ConditioningClone", (comfy.conditioning.H3Conditioning,), {})
    kept = weakref.ref(copy)
    assert copy.validate_inputs(input_types={"prompt": "WRONG"}) == "prompt takes STRING, got WRONG."
    del copy
    gc.collect()
    assert kept() is None


def test_a_canvas_the_model_cannot_make_is_refused_at_queue_time(comfy):
    """Width and height widgets are checked by validate_inputs (ComfyUI's min/max check is off for inputs it
    names, so it redoes that too): a multiple of 32, each side at most 4096, 1:4 to 4:1, both or neither."""
    long_video = importlib.import_module("nodes.long_video")
    task, clip = {"task": "t2va", "prompt": "rain"}, {"input_types": {"video": "VIDEO"}}
    for node, given, zero in ((comfy.conditioning.H3Conditioning, task, "from the aspect ratio"),
                              (long_video.H3Continuation, task, "from the aspect ratio"),
                              (comfy.latent.H3VAEEncode, clip, "from the clip"),
                              (comfy.latent.H3EmptyAVLatent, {}, None)):
        def check(width, height):
            return node.validate_inputs(**{"input_types": {}, **given}, width=width, height=height)

        assert check(1344, 768) is True and check(None, 100) is True, node  # None: linked, checked at run time
        assert "positive multiples of 32" in check(100, 768) and "width=100" in check(100, 768), node
        assert "positive multiples of 32" in check(-32, -32), node
        assert "each side is at most 4096" in check(4128, 2048), node
        assert "the model supports 1:4 to 4:1" in check(2048, 256), node
        if zero:
            assert check(0, 0) is True, node
            assert check(1344, 0) == f"Give width and height together, or both 0 ({zero}); got 1344x0.", node
        else:  # no 0 here: the schema's min is 32
            assert "positive multiples of 32" in check(0, 0), node
    # H3 Empty AV Latent takes the size from linked conditioning, whatever its widgets say
    empty = comfy.latent.H3EmptyAVLatent.validate_inputs
    assert empty(input_types={"conditioning": "H3_COND"}, width=100, height=0) is True


def test_sampler_sigmas_denoise_and_latent_checks(comfy):
    from nodes.convert import empty_latent

    c = comfy
    model, text, vae = _models(c)
    cond = _cond(c, text, vae).values[0]
    run = c.sampler.H3Sampler.execute
    loaded = len(c.record.loaded)
    with pytest.raises(ValueError, match="video_sigmas: Custom sigmas must be .* ending at 0.0"):
        run(model, cond, 0, 2, 0.0, 0.0, video_sigmas=torch.tensor([1.0, 0.5]))
    with pytest.raises(ValueError, match="audio_sigmas: .*strictly decreasing"):
        run(model, cond, 0, 2, 0.0, 0.0, audio_sigmas=torch.tensor([1.0, 0.6, 0.7, 0.0]))
    with pytest.raises(ValueError, match=r"seed must be .* \(and seed \+ 2 for 3 outputs\)"):
        run(model, cond, 2**64 - 2, 2, 0.0, 0.0, 1.0, 3)
    # a linked outputs or denoise out of range (validate_inputs skips linked values): 0 outputs placed the DiT
    with pytest.raises(ValueError, match="outputs: Value 0 smaller than min of 1"):
        run(model, cond, 0, 3, 0.0, 0.0, 1.0, 0)
    with pytest.raises(ValueError, match="denoise: Value 1.5 bigger than max of 1.0"):
        run(model, cond, 0, 3, 0.0, 0.0, 1.5, 1)
    with pytest.raises(ValueError, match="rounds to the whole 5-point ladder"):  # refining from pure noise
        run(model, cond, 0, 5, 0.0, 0.0, 0.9, 1, latent={**empty_latent(224, 128, 107), "empty": False})
    assert len(c.record.loaded) == loaded  # bad input fails before any model moves
    out = run(model, cond, 0, 0, 0.0, 0.0, video_sigmas=torch.tensor([1.0, 0.5, 0.0])).values[0][0]
    assert c.record.progress[-1][:2] == (2, 2)  # the automatic audio ladder got as many points
    with pytest.raises(ValueError, match="refines a latent"):
        run(model, cond, 0, 4, 0.0, 0.0, 0.5)
    empty = c.latent.H3EmptyAVLatent.execute(1344, 768, 124).values[0]
    with pytest.raises(ValueError, match="1344x768, 124 frames, but the conditioning asks for 224x128, 107 frames; "
                                         ".* set H3 Conditioning's duration to 5.1 s and its size to 1344x768"):
        run(model, cond, 0, 2, 0.0, 0.0, latent=empty)
    refined = run(model, cond, 0, 4, 0.0, 0.0, 0.5, latent=out).values[0][0]
    assert c.record.progress[-1][:2] == (3, 3) and not torch.equal(refined["video"], out["video"])
    with pytest.raises(ValueError, match="denoise < 1 cuts the automatic ladders"):
        run(model, cond, 0, 2, 0.0, 0.0, 0.5, latent=out, video_sigmas=torch.tensor([0.5, 0.0]))
    with pytest.raises(ValueError, match="multiples of 32"):
        c.latent.H3EmptyAVLatent.execute(100, 64, 124)
    with pytest.raises(ValueError, match="4-15 s range"):
        c.latent.H3EmptyAVLatent.execute(256, 128, 50)


def test_a_latent_saved_and_loaded_again_is_the_same_and_cli_files_load_too(comfy, monkeypatch):
    """H3 Save Latent writes what --save-latents writes; H3 Load Latent reads it (and h3's own files) from the
    input folder, gives the size it decodes to, and reads a file saved over again."""
    import shutil

    from h3_core.output import AVLatents
    from safetensors import safe_open

    c = comfy
    files = importlib.import_module("nodes.latent_files")
    model, text, vae = _models(c)
    sampled = c.sampler.H3Sampler.execute(model, _cond(c, text, vae).values[0], 5, 3, 0.0, 0.0).values[0][0]
    files.H3SaveLatent.hidden = SimpleNamespace(prompt={"1": {"class_type": "H3Sampler"}}, extra_pnginfo=None)
    result = files.H3SaveLatent.execute(sampled, "H3/keep")
    (saved,) = result.ui["latents"]
    assert result.values[0] is sampled and (saved.filename, saved.subfolder) == ("keep_00001_.safetensors", "H3")
    path = c.tmp / "output" / "H3" / saved.filename
    with safe_open(str(path), "pt") as file:
        metadata = file.metadata()
    assert {key: metadata[key] for key in ("width", "height", "frames", "seed", "task", "steps")} == {
        "width": "224", "height": "128", "frames": "107", "seed": "5", "task": "t2va", "steps": "3"}
    assert '"class_type": "H3Sampler"' in metadata["prompt"]
    # the name it picked, taken meanwhile by another saver's file or a link: left as it is, the next counter used
    # (it was written over, or through the link)
    monkeypatch.setattr(files.folder_paths, "get_save_image_path",
                        lambda prefix, out, w, h: (str(c.tmp / "output" / "H3"), "race", 1, "H3", prefix))
    theirs, target = c.tmp / "output" / "H3" / "race_00001_.safetensors", c.tmp / "elsewhere.txt"
    theirs.write_bytes(b"another saver's latents")
    target.write_text("not to be written through a link")
    (c.tmp / "output" / "H3" / "race_00002_.safetensors").symlink_to(target)
    (raced,) = files.H3SaveLatent.execute(sampled, "H3/race").ui["latents"]
    assert raced.filename == "race_00003_.safetensors" and theirs.read_bytes() == b"another saver's latents"
    assert target.read_text() == "not to be written through a link"
    assert torch.equal(AVLatents.load(c.tmp / "output" / "H3" / raced.filename).video, sampled["video"])
    assert not list((c.tmp / "output" / "H3").glob(".*.part"))

    (c.tmp / "input" / "mine").mkdir()
    shutil.copy(path, c.tmp / "input" / "mine" / "clip.safetensors")
    schema = fake_comfy.schema_of(files.H3LoadLatent)["inputs"]["latent_file"]
    assert schema.options["options"] == ["mine/clip.safetensors"]
    latent, width, height, frames = files.H3LoadLatent.execute("mine/clip.safetensors").values
    assert torch.equal(latent["video"], sampled["video"]) and torch.equal(latent["audio"], sampled["audio"])
    assert (width, height, frames, latent["seed"], latent["task"], latent["steps"]) == (224, 128, 107, 5, "t2va", 3)
    images, _ = c.output.H3VAEDecode.execute(vae, latent).values
    assert images.shape == (107, 128, 224, 3)

    # a file h3 encode wrote (no seed), saved over the first: read again, as the fingerprint changes
    before = files.H3LoadLatent.fingerprint_inputs("mine/clip.safetensors")
    AVLatents(sampled["video"] * 0.5, sampled["audio"]).save(c.tmp / "input" / "mine" / "clip.safetensors",
                                                             {"source": "mine.mp4", "width": "224"})
    assert files.H3LoadLatent.fingerprint_inputs("mine/clip.safetensors") != before
    latent = files.H3LoadLatent.execute("mine/clip.safetensors").values[0]
    assert torch.equal(latent["video"], sampled["video"] * 0.5) and "seed" not in latent
    # facts a hand-edited file spells wrong are left out, the others kept
    AVLatents(sampled["video"], sampled["audio"]).save(c.tmp / "input" / "mine" / "clip.safetensors",
                                                       {"seed": "five", "steps": "4", "task": "fl2va"})
    latent = files.H3LoadLatent.execute("mine/clip.safetensors").values[0]
    assert "seed" not in latent and (latent["steps"], latent["task"]) == (4, "fl2va")

    check = files.H3LoadLatent.validate_inputs
    assert check("mine/clip.safetensors") is True and check(None) is True
    shutil.copy(path, c.tmp / "input" / "mine" / "UP.SAFETENSORS")  # listed (ComfyUI matches any case): read too
    assert "mine/UP.SAFETENSORS" in files.latent_files() and check("mine/UP.SAFETENSORS") is True
    (c.tmp / "input" / "picture.png").write_bytes(b"png")
    for name in ("gone.safetensors", "../output/H3/keep_00001_.safetensors", "picture.png"):
        assert check(name).startswith(f"No latent file {name!r} in ComfyUI's input folder"), name
        with pytest.raises(ValueError, match=rf"^No latent file {re.escape(repr(name))} in ComfyUI's input folder\.$"):
            files.H3LoadLatent.execute(name)  # a linked name, not checked at queue time
    (c.tmp / "input" / "lora.safetensors").write_bytes((c.tmp / "output" / "H3" / saved.filename).read_bytes()[:8])
    with pytest.raises(ValueError, match="is not a safetensors file of latents"):
        files.H3LoadLatent.execute("lora.safetensors")
    with pytest.raises(ValueError, match="holds an empty latent"):
        files.H3SaveLatent.execute(c.latent.H3EmptyAVLatent.execute(224, 128, 107).values[0], "H3/empty")


def test_latents_cross_to_and_from_comfyuis_own_h3_latent(comfy, caplog, monkeypatch):
    c = comfy
    model, text, vae = _models(c)
    cond = _cond(c, text, vae).values[0]
    sampled = c.sampler.H3Sampler.execute(model, cond, 5, 3, 0.0, 0.0).values[0][0]
    core = c.latent.H3LatentToLatent.execute(sampled).values[0]
    video, audio = core["samples"].unbind()
    assert video.shape == (1, 24, 32, 8, 14) and audio.shape == (1, 32, 2, sampled["audio"].shape[2])
    (back,) = c.latent.H3LatentFromLatent.execute(core).values[0]
    assert torch.equal(back["video"], sampled["video"]) and torch.equal(back["audio"], sampled["audio"])
    images, sound = c.output.H3VAEDecode.execute(vae, back).values
    direct_images, direct_sound = c.output.H3VAEDecode.execute(vae, sampled).values
    assert torch.equal(images, direct_images) and torch.equal(sound["waveform"], direct_sound["waveform"])

    # an empty core latent of the conditioning's size (as Empty MiniMax H3 AV Latent makes) only fixes the size
    nested = sys.modules["comfy.nested_tensor"].NestedTensor
    zeros = {"samples": nested((torch.zeros_like(video), torch.zeros_like(audio)))}
    (empty,) = c.latent.H3LatentFromLatent.execute(zeros).values[0]
    assert empty["empty"]
    same = c.sampler.H3Sampler.execute(model, cond, 5, 3, 0.0, 0.0, latent=empty).values[0][0]
    assert torch.equal(same["video"], sampled["video"])
    for part in (video, audio):  # an H3 video or audio latent alone is told to join the other
        with pytest.raises(ValueError, match="LATENT to H3 Latent: .*video and audio together .* Concat AV Latent"):
            c.latent.H3LatentFromLatent.execute({"samples": part})
    with pytest.raises(ValueError, match=r"LATENT to H3 Latent: The audio part must be \[B, 32, 2, A\]"):
        c.latent.H3LatentFromLatent.execute({"samples": nested((video, audio[:, :, 0]))})
    # another model's latent is named as such (it was told to join an H3 video and audio latent)
    with pytest.raises(ValueError, match=r"got a plain latent \[1, 4, 16, 16\], not a MiniMax H3 latent\.$"):
        c.latent.H3LatentFromLatent.execute({"samples": torch.zeros(1, 4, 16, 16)})
    # a LATENT holding something else (a list of parts, nothing, three parts; or no dict at all): refused as such
    three = {"samples": nested((video, audio, audio))}
    for odd in ({"samples": [video, audio]}, {"samples": None}, [video, audio], three):
        with pytest.raises(ValueError, match=r"got something else, not a MiniMax H3 latent\.$"):
            c.latent.H3LatentFromLatent.execute(odd)
    # a noise mask is not carried over (a core sampler's output keeps the one it used): said, not silent
    assert "noise mask" not in caplog.text  # (a LATENT without one: nothing to say)
    with caplog.at_level(logging.WARNING, logger="h3"):
        (masked,) = c.latent.H3LatentFromLatent.execute({**core, "noise_mask": torch.zeros(1, 1, 8, 14)}).values[0]
    assert torch.equal(masked["video"], sampled["video"]) and "noise mask is not carried over" in caplog.text
    # the core LATENT is a copy: a node changing it in place leaves the H3 latent (cached by ComfyUI) as it was
    before = sampled["video"].clone()
    video.add_(1)
    assert torch.equal(sampled["video"], before)
    # a ComfyUI without joint AV latents is told to update, not shown an ImportError
    monkeypatch.setitem(sys.modules, "comfy.nested_tensor", None)
    with pytest.raises(RuntimeError, match=r"needs a ComfyUI with joint video \+ audio latents .* update ComfyUI\.$"):
        c.latent.H3LatentToLatent.execute(sampled)


def test_sampler_keeps_a_clips_video_and_makes_its_sound(comfy):
    c = comfy
    model, text, vae = _models(c)
    cond = _cond(c, text, vae).values[0]  # 224x128, 107 frames
    clip, width, height, frames = c.latent.H3VAEEncode.execute(
        vae, images=torch.rand(110, 128, 224, 3), frame_rate=24.0, width=224, height=128).values
    assert (width, height, frames) == (224, 128, 107)
    # frames held in memory report each 17 encoded, as a streamed file's do (and may be interrupted there)
    encoded = [done for done, total, _ in c.record.progress if total == 107]
    assert len(encoded) >= 6 and encoded == sorted(encoded) and encoded[-1] == 107
    run = c.sampler.H3Sampler.execute
    out = run(model, cond, 3, 3, 0.0, 0.0, latent=clip, keep="video").values[0][0]
    assert torch.equal(out["video"], clip["video"]) and not torch.equal(out["audio"], clip["audio"])
    assert all(preview is None for _, _, preview in c.record.progress[-2:])  # nothing generated to preview
    sound = run(model, cond, 3, 3, 0.0, 0.0, latent=clip, keep="audio").values[0][0]
    assert torch.equal(sound["audio"], clip["audio"]) and not torch.equal(sound["video"], clip["video"])

    loads = len(c.record.loaded)
    empty = c.latent.H3EmptyAVLatent.execute(224, 128, 107).values[0]
    with pytest.raises(ValueError, match="keep = video holds the video of the connected latent"):
        run(model, cond, 3, 3, 0.0, 0.0, latent=empty, keep="video")
    with pytest.raises(ValueError, match="keep = audio holds the audio"):
        run(model, cond, 3, 3, 0.0, 0.0, keep="audio")
    # a guide carrying the held part only contradicted it (H3 Continuation refused the same with a driving track)
    guide = c.conditioning.H3AddGuide.execute
    sounding = guide(cond, vae, 20, audio={"waveform": torch.randn(1, 2, 32000) * 0.1, "sample_rate": 32000})
    pictured = guide(cond, vae, 20, image=torch.rand(1, 128, 224, 3))
    loads = len(c.record.loaded)
    with pytest.raises(ValueError, match="Guide 1 holds a sound, but keep = audio holds the given clip's sound"):
        run(model, sounding.values[0], 3, 3, 0.0, 0.0, latent=clip, keep="audio")
    with pytest.raises(ValueError, match="Guide 1 holds a picture, but keep = video holds the given clip's video"):
        run(model, pictured.values[0], 3, 3, 0.0, 0.0, latent=clip, keep="video")
    assert len(c.record.loaded) == loads  # refused before any model moved
    kept = run(model, sounding.values[0], 3, 3, 0.0, 0.0, latent=clip, keep="video").values[0][0]  # a sound: fine
    assert torch.equal(kept["video"], clip["video"])


def test_interrupt_stops_and_frees(comfy):
    """Cancel stops the sampler after the step it came in, and the traceback ComfyUI keeps holds none of the
    run's tensors (its frames' locals cleared: the latents and activations go at once)."""
    c = comfy
    model, text, vae = _models(c)
    cond = _cond(c, text, vae).values[0]
    c.record.progress.clear()
    c.record.interrupt_after = 2
    with pytest.raises(sys.modules["comfy.model_management"].InterruptProcessingException) as caught:
        c.sampler.H3Sampler.execute(model, cond, 0, 20, 0.0, 0.0)
    assert [value for value, _, _ in c.record.progress] == [1, 2]  # stopped right after the step it was asked
    trace = caught.value.__traceback__
    while trace.tb_frame.f_code.co_name != "execute":  # the node's own frame was still running: its inputs stay
        trace = trace.tb_next
    below = []
    while (trace := trace.tb_next) is not None:
        below.append(trace.tb_frame.f_code.co_name)
        assert trace.tb_frame.f_locals == {}, below
    assert len(below) > 2, below


def test_a_guide_clip_shows_its_encoding_and_stops_when_interrupted(comfy):
    """H3 Add Guide encodes a clip (up to 362 frames) 17 frames at a time, moving ComfyUI's bar and checking its
    interrupt after each (found by the progress review: no bar, and Cancel waited for the whole encode)."""
    c = comfy
    model, text, vae = _models(c)
    cond = _cond(c, text, vae).values[0]
    clip = torch.rand(60, 128, 224, 3)  # its first 56 frames (17n + 5) are the guide
    c.record.progress.clear()
    bars = c.record.bars
    guided = c.conditioning.H3AddGuide.execute(cond, vae, 0, image=clip).values[0]
    assert [(value, total) for value, total, _ in c.record.progress] == [(17, 56), (34, 56), (51, 56), (56, 56)]
    assert c.record.bars == bars + 1
    c.conditioning.H3AddGuide.execute(cond, vae, 0, image=clip[:1])  # one picture: no bar that never moves
    assert c.record.bars == bars + 1 and len(c.record.progress) == 4
    assert guided.guides[0].latent_frames == 17  # 56 frames: L = 5 * 3 + 2
    c.record.progress.clear()
    c.record.interrupt_after = 2
    try:
        with pytest.raises(sys.modules["comfy.model_management"].InterruptProcessingException):
            c.conditioning.H3AddGuide.execute(cond, vae, 0, image=clip)
    finally:
        c.record.interrupt_after = None
    assert len(c.record.progress) == 2  # stopped after the clip it was asked at, not at the end


def test_av_save_shows_its_encoding_and_stops_when_interrupted(comfy):
    """H3 AV Save encodes a clip held in memory 17 frames at a time, moving ComfyUI's bar and checking its
    interrupt after each (a 30 s clip took minutes with neither); interrupted, it leaves no file behind."""
    c = comfy
    images = torch.rand(40, 32, 48, 3)
    c.record.progress.clear()
    c.output.H3AVSave.execute(images, "H3/bar")
    assert [(done, total) for done, total, _ in c.record.progress] == [(17, 40), (34, 40), (40, 40)]
    output = Path(sys.modules["folder_paths"].get_output_directory())
    written = sorted(p.name for p in output.rglob("*") if p.is_file())
    c.record.progress.clear()
    c.record.interrupt_after = 1
    with pytest.raises(sys.modules["comfy.model_management"].InterruptProcessingException):
        c.output.H3AVSave.execute(images, "H3/bar")
    c.record.interrupt_after = None
    assert [done for done, _, _ in c.record.progress] == [17]
    assert sorted(p.name for p in output.rglob("*") if p.is_file()) == written  # no MP4, no placeholder, no part


def test_interrupt_stops_a_forward_between_blocks(comfy, monkeypatch):
    """ComfyUI's interrupt is checked after every block: a forward of minutes (a large canvas) stops after the block
    running when it was asked, not at the end of the step; the model samples again afterwards."""
    c = comfy
    model, text, vae = _models(c)
    cond = _cond(c, text, vae).values[0]
    mm = sys.modules["comfy.model_management"]
    ran = []
    hooks = [block.register_forward_hook(lambda *args: ran.append(1)) for block in model.dit.blocks]

    def interrupted_once_a_block_ran():
        if ran:
            raise mm.InterruptProcessingException()

    c.record.progress.clear()
    monkeypatch.setattr(mm, "throw_exception_if_processing_interrupted", interrupted_once_a_block_ran)
    try:
        with pytest.raises(mm.InterruptProcessingException):
            c.sampler.H3Sampler.execute(model, cond, 0, 20, 0.0, 0.0)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(ran) == 1 and c.record.progress == []  # one block of the first forward, no step finished
    monkeypatch.undo()
    c.sampler.H3Sampler.execute(model, cond, 0, 2, 0.0, 0.0)
    assert len(model.dit.blocks) > 1 and model.dit._between_blocks is None


def test_lora_apply_keeps_the_cached_model_clean(comfy, caplog):
    from lora_files import fused, random_spec, write_native

    from h3_core.config import TINY_DIT

    c = comfy
    write_native(c.tmp / "loras" / TURBO, fused(random_spec(TINY_DIT), block_diagonal=True),
                 prefix="diffusion_model.")
    model, text, vae = _models(c)
    turbo = c.sampler.H3LoRAApply.execute(model, TURBO, 1.0).values[0]
    assert len(turbo.loras) == 1 and turbo.dit is model.dit and turbo.patcher is model.patcher
    before = {k: v.clone() for k, v in model.dit.state_dict().items()}
    cond = _cond(c, text, vae).values[0]
    with caplog.at_level("INFO", logger="h3"):
        c.sampler.H3Sampler.execute(turbo, cond, 0, 0, 0.0, 0.0)
    assert c.record.progress[-1][:2] == (8, 8)  # the Turbo contract: 8 distilled steps
    said = [r for r in caplog.records if "H3: sampler: " in r.getMessage()]
    assert said[-1].levelname == "INFO" and "9 sigma points (8 model calls)" in said[-1].getMessage()
    assert all(torch.equal(before[k], v) for k, v in model.dit.state_dict().items())
    from h3_core.lora import hooked_bytes
    from h3_core.memory_plan import working_bytes

    factors = sum(t.numel() for term in turbo.loras[0][0].parts[None] for t in (term.down, term.up) if t is not None)
    assert hooked_bytes(turbo.loras, "fl2va", 4) == 4 * factors > 0
    asked = [working for names, working in c.record.loaded if names == ["H3 DiT (fl2va, tiny-random)"]][-1]
    assert asked == working_bytes(model.dit.config, cond.layout.sequence_length, 9) + 4 * factors  # fp32 tiny DiT
    caplog.clear()
    with caplog.at_level("INFO", logger="h3"):  # 8 points is 7 calls, off the distilled ladder: warned
        c.sampler.H3Sampler.execute(turbo, cond, 0, 8, 0.0, 0.0)
    said = [r for r in caplog.records if "H3: sampler: " in r.getMessage()]
    assert said[-1].levelname == "WARNING" and "8 sigma points (7 model calls)" in said[-1].getMessage()
    assert "user steps=8 overrides the contract's 9" in said[-1].getMessage()
    c.record.progress.clear()
    off = c.sampler.H3LoRAApply.execute(model, TURBO, 0.0).values[0]  # switched off: the base model's schedule too
    c.record.interrupt_after = len(c.record.progress) + 1
    with pytest.raises(c.memory.mm.InterruptProcessingException):
        c.sampler.H3Sampler.execute(off, cond, 0, 0, 0.0, 0.0)
    c.record.interrupt_after = None
    assert c.record.progress[-1][:2] == (1, 49)

    from safetensors.torch import load_file, save_file

    stray = load_file(str(c.tmp / "loras" / TURBO)) | {"diffusion_model.blocks.0.attn.nothing.lora_A.weight":
                                                        torch.zeros(4, 64)}
    save_file(stray, str(c.tmp / "loras" / "stray.safetensors"))
    with pytest.raises(ValueError, match="H3 LoRA / Turbo Apply's unknown_keys"):
        c.sampler.H3LoRAApply.execute(model, "stray.safetensors", 1.0)
    assert len(c.sampler.H3LoRAApply.execute(model, "stray.safetensors", 1.0, "warn").values[0].loras) == 1


def test_a_weight_file_saved_over_under_its_name_loads_again(comfy):
    """A LoRA saved over under its name (a new training epoch) changes its node's fingerprint, so ComfyUI runs
    the node again instead of handing on the adapter read from the old file. The loaders' fingerprints follow
    their files (or folders) too."""
    import os

    from lora_files import fused, random_spec, write_native
    from safetensors.torch import load_file, save_file

    from h3_core.config import TINY_DIT

    c = comfy
    path = write_native(c.tmp / "loras" / "epoch.safetensors", fused(random_spec(TINY_DIT), block_diagonal=True),
                        prefix="diffusion_model.")
    fingerprint = c.sampler.H3LoRAApply.fingerprint_inputs
    before = fingerprint(model=None, lora_name="epoch.safetensors", strength=1.0)
    # a digest: ComfyUI keeps it in the prompt saved files embed, where paths would tell what the server holds
    assert re.fullmatch("[0-9a-f]{64}", before)
    model = c.loaders.H3ModelLoader.execute("tiny-random", "", "fl2va", "bf16", "auto").values[0]
    assert len(c.sampler.H3LoRAApply.execute(model, "epoch.safetensors", 1.0).values[0].loras) == 1
    stat = path.stat()
    save_file({key: value + 1 for key, value in load_file(str(path)).items()}, str(path))  # the same size
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert fingerprint(model=None, lora_name="epoch.safetensors", strength=1.0) != before
    assert fingerprint(model=None, lora_name="gone.safetensors", strength=1.0) == ""  # execute says it is missing

    folder = c.tmp / "release"
    (folder / "FL2VA" / "transformer").mkdir(parents=True)
    shard = folder / "FL2VA" / "transformer" / "model-00001.safetensors"
    shard.write_bytes(b"0" * 8)
    (folder / "FL2VA" / "transformer" / "notes.txt").write_text("not a weight")
    loader = c.loaders.H3ModelLoader.fingerprint_inputs
    assert loader(checkpoint="tiny-random", folder="") == ""
    first = loader(checkpoint="tiny-random", folder=str(folder))
    assert first and str(folder) not in first
    (folder / "FL2VA" / "transformer" / "notes.txt").write_text("still not a weight")
    assert loader(checkpoint="tiny-random", folder=str(folder)) == first  # only weight and config files count
    shard.write_bytes(b"0" * 9)
    assert loader(checkpoint="tiny-random", folder=str(folder)) != first
    vaes = c.loaders.H3VAELoader.fingerprint_inputs
    assert vaes(video_vae="tiny-random", audio_vae="tiny-random", folder="") == ""
    both = vaes(video_vae="tiny-random", audio_vae="tiny-random", folder=str(folder))
    shard.write_bytes(b"0" * 10)
    assert both and vaes(video_vae="tiny-random", audio_vae="tiny-random", folder=str(folder)) != both
    # the release's video VAE weights lie four levels down (FL2VA/video_vae/source/model.safetensors): missed
    deep = folder / "FL2VA" / "video_vae" / "source" / "model.safetensors"
    deep.parent.mkdir(parents=True)
    deep.write_bytes(b"0" * 8)
    before = vaes(video_vae="tiny-random", audio_vae="tiny-random", folder=str(folder))
    deep.write_bytes(b"0" * 9)
    assert vaes(video_vae="tiny-random", audio_vae="tiny-random", folder=str(folder)) != before


def test_a_decode_moves_one_progress_bar_over_sound_then_frames(comfy):
    """The soundtrack's windows and then the frames share one bar: two took ComfyUI's from 100% back to 1%."""
    c = comfy
    model, text, vae = _models(c)
    out = c.sampler.H3Sampler.execute(model, _cond(c, text, vae).values[0], 1, 3, 0.0, 0.0).values[0][0]
    for decode in (lambda: c.output.H3VAEDecode.execute(vae, out),
                   lambda: importlib.import_module("nodes.long_video").H3SaveMP4.execute(vae, out, "H3/bar")):
        start = len(c.record.progress)
        decode()
        bar = [(value, total) for value, total, _ in c.record.progress[start:]]
        totals = {total for _, total in bar}
        assert len(totals) == 1 and totals.pop() > 107, bar  # the windows and the 107 frames
        assert [value for value, _ in bar] == sorted({value for value, _ in bar}) and bar[-1][0] == bar[-1][1]


def test_memory_wrapper_moves_and_reports(comfy, caplog):
    c = comfy
    module = torch.nn.Linear(4, 4)
    patcher = c.memory.manage("H3 test model", [module], "cpu", "vae")
    placement = patcher.model
    assert patcher.model_size() == placement.size == 4 * 4 * 4 + 4 * 4 and patcher.loaded_size() == placement.size
    with caplog.at_level("INFO", logger="h3"):
        assert patcher.partially_unload("cpu", 1) == placement.size and patcher.loaded_size() == 0
        patcher.detach(unpatch_all=False)  # ComfyUI re-registering: nothing moves
        assert patcher.partially_load("cpu") == placement.size and patcher.loaded_size() == placement.size
        patcher.unpatch_model(unpatch_weights=False)  # ComfyUI's "weights stay": nothing moves
        assert patcher.loaded_size() == placement.size
        patcher.unpatch_model()
        assert patcher.loaded_size() == 0
        assert patcher.patch_model(load_weights=False) is placement and patcher.loaded_size() == 0
        assert patcher.patch_model() is placement and patcher.loaded_size() == placement.size
        patcher.detach()
        assert patcher.loaded_size() == 0
        del patcher, placement
        import gc

        gc.collect()
    lines = [r.getMessage() for r in caplog.records]
    unloaded, loaded = "H3: H3 test model unloaded from cpu to cpu (0.00 GiB)", "H3: H3 test model loaded on cpu (0.00 GiB)"
    assert lines == [unloaded, loaded, unloaded, loaded, unloaded, "H3: H3 test model released (0.00 GiB)"]


def test_a_failed_run_leaves_no_tensors_behind():
    """freed_on_failure clears the frames of the traceback the host keeps, so their tensors go at once."""
    import weakref

    from h3_core.placement import freed_on_failure

    refs = []

    def work():
        activations = torch.zeros(1000)
        refs.append(weakref.ref(activations))
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError) as caught, freed_on_failure("cpu"):
        work()
    assert caught.value.__traceback__ is not None and refs[0]() is None


def test_preview_is_the_clean_estimate_of_the_middle_frame():
    """At the last step the estimate is the result itself; a colour table maps channels as given."""
    from h3_core.conditioning import Request, encode_request
    from h3_core.pipeline import sample
    from h3_core.preview import latent_rgb
    from h3_core.tiny import tiny_random_dit
    from h3_core.tiny_text import tiny_random_text_encoder

    cond = encode_request(Request("t2va", "a fox", duration=4.0), tiny_random_text_encoder(), rules=TINY_CANVAS)
    frames = []
    latents = sample(tiny_random_dit(), cond, 0, 3, callback=lambda state: frames.append(state.video_estimate_frame()))
    middle = latents.video.shape[2] // 2
    assert len(frames) == 2 and torch.allclose(frames[-1], latents.video[0, :, middle], atol=1e-6)
    assert latent_rgb(frames[0]).shape == (8, 14, 3)
    factors = torch.zeros(24, 3)
    factors[0, 0] = 1.0
    rgb = latent_rgb(torch.ones(24, 2, 2), factors)  # channel 0 -> red; (x + 1) / 2 -> 0..1
    assert (rgb[..., 0] == 255).all() and (rgb[..., 1:] == 128).all()
    # a run gone NaN or infinite previews (black where it did) instead of failing in the false-colour PCA with
    # "linalg.eigh: failed to converge", which hid the sampler's own message
    broken = torch.randn(24, 8, 14)
    broken[:, :2] = float("nan")
    broken[:, 2:4] = float("inf")
    for table in (None, factors):
        rgb = latent_rgb(broken, table)
        assert rgb.shape == (8, 14, 3) and (rgb[:4] == rgb[0, 0]).all()
    # a run diverging to huge but finite values: the false colours of any scale are the same picture (the PCA's
    # covariance of 1e19 values overflowed to inf, and eigh failed inside the step callback, ending the run)
    frame = torch.randn(24, 8, 14, generator=torch.Generator().manual_seed(3))
    assert all(np.array_equal(latent_rgb(frame * scale), latent_rgb(frame)) for scale in (1e-3, 1e19, 1e30))


def test_vae_loader_weight_dtype_follows_the_reference_policy(comfy, tmp_path):
    """weight_dtype bf16 (the default) gives the reference pipeline's decoder: linears bf16, encoder and
    norms float32; fp32 keeps everything float32; the audio VAE stays as stored either way."""
    from audio_vae_checkpoints import reference_audio_vae
    from audio_vae_checkpoints import write_original_partition as write_audio
    from video_vae_checkpoints import reference_video_vae, tiny_config
    from video_vae_checkpoints import write_original_partition as write_video

    config = tiny_config(seed=1)
    write_video(tmp_path, reference_video_vae(config, seed=2).state_dict(), config)
    write_audio(tmp_path, reference_audio_vae(seed=3))
    folder = str(tmp_path / "FL2VA")
    loader = comfy.loaders.H3VAELoader
    helds = []
    for chosen, expected in (({}, torch.bfloat16), ({"weight_dtype": "fp32"}, torch.float32)):
        vae = loader.execute("tiny-random", "tiny-random", folder, **chosen).values[0]
        decoder_block = vae.video.decoder.transformer_blocks[0]
        assert decoder_block.attn.to_qkv.weight.dtype == expected and decoder_block.ff.w1.weight.dtype == expected
        assert decoder_block.norm1.weight.dtype == torch.float32 == vae.video.encoder.conv_in.weight.dtype
        assert {p.dtype for p in vae.audio.parameters()} == {torch.float32}
        # before reading them, the loader asked ComfyUI for room for both VAEs as they are held (it asked for the
        # files' bytes: an fp16 file's VAE in fp32 took twice what was freed)
        held = sum(t.numel() * t.element_size() for model in (vae.video, vae.audio)
                   for t in [*model.parameters(), *model.buffers()])
        assert comfy.record.freed[-1] == (held, "cpu")
        helds.append(held)
    assert len(comfy.record.freed) == 2 and helds[0] < helds[1]  # the bf16 decoder linears: less


def test_vae_loader_heeds_comfyuis_cpu_vae(comfy, monkeypatch):
    """ComfyUI started with --cpu-vae runs VAEs on the CPU (mm.vae_device); the H3 VAE Loader put them on the GPU."""
    mm = sys.modules["comfy.model_management"]
    monkeypatch.setattr(mm, "get_torch_device", lambda: torch.device("meta"))  # the GPU: nothing may land there
    monkeypatch.setattr(mm, "vae_device", lambda: torch.device("cpu"))
    vae = comfy.loaders.H3VAELoader.execute("tiny-random", "tiny-random", "").values[0]
    assert vae.device == torch.device("cpu") == vae.patcher.model.load_device
    assert {p.device.type for model in (vae.video, vae.audio) for p in model.parameters()} == {"cpu"}


def test_vae_loader_makes_room_for_an_fp16_file_widened_as_it_loads(comfy):
    """fp16 VAE files (as ComfyUI's single files store them): bf16 loads the video encoder and norms in fp32, fp32
    all of it, and the audio VAE is widened to fp32; the room asked for is what is held, not the files' bytes."""
    from safetensors.torch import load_file

    from audio_vae_checkpoints import reference_audio_vae
    from audio_vae_checkpoints import write_original_partition as write_audio
    from video_vae_checkpoints import reference_video_vae, tiny_config
    from video_vae_checkpoints import write_original_partition as write_video

    config = tiny_config(seed=1)
    fp16 = {k: v.half() for k, v in reference_video_vae(config, seed=2).state_dict().items()}
    write_video(comfy.tmp / "vae", fp16, config)
    write_audio(comfy.tmp / "vae", reference_audio_vae(seed=3).half())
    files = list((comfy.tmp / "vae" / "FL2VA").rglob("*.safetensors"))
    stored = sum(t.numel() * t.element_size() for f in files for t in load_file(str(f)).values())
    assert torch.float16 in {t.dtype for f in files for t in load_file(str(f)).values()}
    for weight_dtype in ("bf16", "fp32"):
        vae = comfy.loaders.H3VAELoader.execute("tiny-random", "tiny-random", str(comfy.tmp / "vae" / "FL2VA"),
                                                weight_dtype=weight_dtype).values[0]
        held = sum(t.numel() * t.element_size() for model in (vae.video, vae.audio)
                   for t in [*model.parameters(), *model.buffers()])
        assert comfy.record.freed[-1] == (held, "cpu") and held > stored


def test_vae_loader_makes_room_for_an_all_in_one_files_vae_alone(comfy):
    """An audio VAE chosen from an all-in-one file (a 60 GiB DiT beside it in the real thing): ComfyUI is asked
    for the VAE's bytes, not the whole file's (it was asked to unload everything for a file it never reads)."""
    from audio_vae_checkpoints import comfy_state_dict, reference_audio_vae, write_comfy_single_file

    (comfy.tmp / "vae").mkdir()
    model = reference_audio_vae(seed=3)
    dit = {"model.diffusion_model.blocks.0.mlp.fc1.weight": torch.zeros(4096, 2048)}  # 32 MiB standing for the DiT
    write_comfy_single_file(comfy.tmp / "vae" / "all_in_one.safetensors", model, "audio_vae.", dit)
    vae = comfy.loaders.H3VAELoader.execute("tiny-random", "all_in_one.safetensors", "").values[0]
    own = sum(t.numel() * t.element_size() for t in comfy_state_dict(model).values())
    held = sum(t.numel() * t.element_size() for t in [*vae.audio.parameters(), *vae.audio.buffers()])
    assert comfy.record.freed == [(held, "cpu")] and 0.99 * own < held <= own < 32 << 20


def test_vae_loader_refuses_a_wrong_file_before_making_room_or_reading(comfy, tmp_path, monkeypatch):
    from video_vae_checkpoints import reference_video_vae, tiny_config
    from video_vae_checkpoints import write_original_partition as write_video

    config = tiny_config(seed=1)
    write_video(tmp_path, reference_video_vae(config, seed=2).state_dict(), config)

    def never(*args, **kwargs):
        raise AssertionError("the video VAE was read before the audio VAE's path was checked")

    monkeypatch.setattr(comfy.loaders, "load_video_vae", never)
    with pytest.raises(ValueError, match="is not an H3 audio VAE"):  # the folder holds no audio VAE
        comfy.loaders.H3VAELoader.execute("tiny-random", "tiny-random", str(tmp_path / "FL2VA"))
    assert comfy.record.freed == [] and comfy.record.loaded == []

    # with an audio VAE there too, a video VAE file missing a tensor: said from its headers, before ComfyUI is
    # asked to unload anything for it
    from audio_vae_checkpoints import reference_audio_vae
    from audio_vae_checkpoints import write_original_partition as write_audio
    from safetensors.torch import load_file, save_file

    write_audio(tmp_path, reference_audio_vae())
    weights = tmp_path / "FL2VA" / "video_vae" / "source" / "model.safetensors"
    tensors = load_file(str(weights))
    tensors.popitem()
    save_file(tensors, str(weights))
    with pytest.raises(ValueError, match="missing 1 tensor"):
        comfy.loaders.H3VAELoader.execute("tiny-random", "tiny-random", str(tmp_path / "FL2VA"))
    assert comfy.record.freed == [] and comfy.record.loaded == []


def test_model_loader_run_settings_apply_at_each_run_and_share_the_weights(comfy):
    """Kernel, window, compile and budget leave the weights alone: loaders differing only in them share one DiT
    (with the real model, a 62 GiB read each otherwise), and each run gets its own loader's settings."""
    c = comfy
    loader = c.loaders.H3ModelLoader
    windowed = loader.execute("tiny-random", "", "fl2va", "bf16", "auto", attention_window_lossy=4,
                              attention_window_dense_steps=5, gpu_memory_gb=3.0).values[0]
    assert (windowed.dit.attention_window, windowed.dit.attention_window_dense_steps) == (4, 5)
    assert windowed.dit.blocks[0].attn.backend == "sdpa"
    plain = loader.execute("tiny-random", "", "fl2va", "bf16", "sdpa", compile=True).values[0]
    assert plain.dit is windowed.dit and plain.patcher is windowed.patcher and plain.name == "tiny-random"
    _, text, vae = _models(c)
    cond = _cond(c, text, vae).values[0]
    c.sampler.H3Sampler.execute(plain, cond, 0, 2, 0.0, 0.0)
    placement = plain.patcher.model
    assert plain.dit.attention_window == 0 and placement.budget_gib is None
    assert all(type(block.forward).__name__ == "_CompiledForward" for block in plain.dit.blocks)
    c.sampler.H3Sampler.execute(windowed, cond, 0, 2, 0.0, 0.0)
    assert (windowed.dit.attention_window, windowed.dit.attention_window_dense_steps) == (4, 5)
    assert placement.budget_gib == 3.0 and not any("forward" in block.__dict__ for block in plain.dit.blocks)
    for other in (loader.execute("tiny-random", "", "fl2va", "bf16", "auto", linears="fp8-weights-lossy").values[0],
                  loader.execute("tiny-random", "", "ref2va", "bf16", "auto").values[0]):  # other weights
        assert other.dit is not plain.dit
    # a window without dense steps (0, None, or the input left out of an API prompt) is windowed from the first step
    for dense in ({"attention_window_dense_steps": 0}, {"attention_window_dense_steps": None}, {}):
        sparse = loader.execute("tiny-random", "", "fl2va", "bf16", "auto", attention_window_lossy=4,
                                **dense).values[0]
        assert (sparse.dit.attention_window, sparse.dit.attention_window_dense_steps) == (4, 0)


def test_model_loader_linears_reach_the_tiny_model_and_the_workers(comfy, monkeypatch):
    from h3_core.fp8 import FP8Linear

    loader = comfy.loaders.H3ModelLoader
    model = loader.execute("tiny-random", "", "fl2va", "bf16", "auto", linears="fp8-weights-lossy").values[0]
    assert isinstance(model.dit.blocks[0].mlp.fc1, FP8Linear) and model.dit.blocks[0].mlp.fc1.matmul == "dequantize"
    assert not isinstance(loader.execute("tiny-random", "", "fl2va", "bf16", "auto").values[0].dit.blocks[0].mlp.fc1,
                          FP8Linear)
    specs = []
    monkeypatch.setattr(comfy.loaders, "manage_runner", lambda name, spec, *rest: specs.append(spec) or SimpleNamespace(model=None))
    loader.execute("tiny-random", "", "fl2va", "bf16", "auto", devices="cpu,cpu", linears="fp8-weights-lossy")
    assert specs[0].linears == "fp8-weights-lossy"
    split = loader.execute("tiny-random", "", "fl2va", "bf16", "auto", devices="cpu:0,cpu:1").values[0]
    assert split.device == torch.device("cpu", 0)  # rank 0's: where conditioning goes and results come back
    with pytest.raises(ValueError, match="Unknown linears mode 'fp4'"):
        loader.execute("tiny-random", "", "fl2va", "bf16", "auto", linears="fp4")


def test_add_guide_anchors_a_clip_and_a_sound_and_the_sampler_runs_it(comfy):
    c = comfy
    model, text, vae = _models(c)
    cond = _cond(c, text, vae).values[0]
    clip = torch.rand(30, 100, 160, 3)  # cut to 22 frames, cover-cropped onto the 224x128 canvas
    sound = {"waveform": torch.randn(1, 1, 44100 * 2) * 0.1, "sample_rate": 44100}
    node = c.conditioning.H3AddGuide
    guided = node.execute(cond, vae, -30, image=clip).values[0]
    guided = node.execute(guided, vae, 20, audio=sound).values[0]
    assert [(g.frame_index, g.latent_frames) for g in guided.guides] == [(cond.num_frames - 30, 7), (20, 0)]
    assert guided.guides[1].audio_latents == 80  # 2 s of sound at 40 latents a second
    assert cond.guides == ()  # the input conditioning is unchanged
    out = c.sampler.H3Sampler.execute(model, guided, 5, 3, 0.0, 0.0).values[0][0]
    plain = c.sampler.H3Sampler.execute(model, cond, 5, 3, 0.0, 0.0).values[0][0]
    assert out["video"].shape == plain["video"].shape and not torch.equal(out["video"], plain["video"])
    placed = len(c.record.loaded)
    with pytest.raises(ValueError, match="frame_index 200 is outside the video's 107 frames"):
        node.execute(cond, vae, 200, image=clip[:1])
    assert len(c.record.loaded) == placed  # refused before the VAE was placed

    # a VIDEO at 30 fps: 40 frames are 32 at 24 fps, cut to 22; its soundtrack comes along
    video = SimpleNamespace(get_components=lambda: SimpleNamespace(images=torch.rand(40, 100, 160, 3),
                                                                   frame_rate=Fraction(30), audio=sound))
    from_video = node.execute(cond, vae, 10, video=video).values[0]
    assert from_video.guides[0].latent_frames == 7 and from_video.guides[0].audio_latents == 80
    with pytest.raises(ValueError, match="an image or a video to one guide, not both"):
        node.execute(cond, vae, 0, image=clip, video=video)


def _counted_video_reads(monkeypatch) -> list:
    """The frame shapes of every media_read.read_video from here on (each still reads the file)."""
    from h3_core import media_read

    reads, real_read = [], media_read.read_video

    def counted(*args, **kwargs):
        clip = real_read(*args, **kwargs)
        reads.append(clip.frames.shape)
        return clip

    monkeypatch.setattr(media_read, "read_video", counted)
    return reads


def test_add_guide_reads_a_loaded_video_from_its_file_only_as_far_as_the_video_goes(comfy, monkeypatch):
    """A Load Video VIDEO guide is read from its file (trim start honoured), only the frames that fit from the
    anchor, each cropped onto the canvas as decoded: the same latents as the frames through get_components()."""
    from h3_core import media_read
    from h3_core.media_write import write_mp4

    c = comfy
    _, text, vae = _models(c)
    cond = _cond(c, text, vae).values[0]  # 107 frames on the 224x128 canvas
    path = c.tmp / "guide.mp4"
    frames = np.random.default_rng(6).integers(0, 256, (240, 100, 180, 3), dtype=np.uint8)  # 10 s at 24 fps
    write_mp4(path, frames, (np.sin(np.arange(32000 * 10) / 7.0) * 0.3).astype(np.float32)[None].repeat(2, 0))
    loaded = SimpleNamespace(get_stream_source=lambda: str(path), get_active_trim_window=lambda: (1.0, 0.0),
                             get_components=lambda: pytest.fail("decoded whole through get_components"))
    reads = _counted_video_reads(monkeypatch)
    from_file = c.conditioning.H3AddGuide.execute(cond, vae, 60, video=loaded).values[0]
    monkeypatch.undo()
    assert reads == [(47, 128, 224, 3)]  # 107 - 60 frames, already on the canvas
    clip = media_read.read_video(path, 1.0, 47)
    sound = {"waveform": torch.from_numpy(clip.audio)[None], "sample_rate": 32000}
    in_memory = SimpleNamespace(get_components=lambda: SimpleNamespace(
        images=torch.from_numpy(clip.frames).float() / 255, frame_rate=Fraction(24), audio=sound))
    expected = c.conditioning.H3AddGuide.execute(cond, vae, 60, video=in_memory).values[0]
    assert from_file.guides == expected.guides and from_file.guides[0].latent_frames == 12  # 39 frames
    assert torch.equal(from_file.visual_condition_latents[-1], expected.visual_condition_latents[-1])
    assert torch.equal(from_file.audio_condition_rows, expected.audio_condition_rows)
    # a soundtrack that outlasts its picture runs on past the clip from a file too, as from memory
    from test_media_edges import write_clip

    write_clip(path, 30, 3.0)
    loaded = SimpleNamespace(get_stream_source=lambda: str(path), get_active_trim_window=lambda: (0.0, 0.0))
    whole = {"waveform": torch.from_numpy(media_read.read_audio(path))[None], "sample_rate": 32000}
    in_memory = SimpleNamespace(get_components=lambda: SimpleNamespace(
        images=torch.from_numpy(media_read.read_video(path).frames).float() / 255, frame_rate=Fraction(24),
        audio=whole))
    from_file, expected = (c.conditioning.H3AddGuide.execute(cond, vae, 0, video=video).values[0]
                           for video in (loaded, in_memory))
    assert from_file.guides == expected.guides and from_file.guides[0].audio_latents > 100  # 3 s: 120 latents
    assert torch.equal(from_file.audio_condition_rows, expected.audio_condition_rows)


def test_continuation_guides_reach_the_window_that_makes_their_frames(comfy):
    c = comfy
    model, text, vae = _models(c)
    long_video = importlib.import_module("nodes.long_video")
    guide, continuation = long_video.H3ContinuationGuide, long_video.H3Continuation
    sound = {"waveform": torch.randn(1, 1, 44100) * 0.1, "sample_rate": 44100}
    guides = guide.execute(150, image=torch.rand(1, 100, 160, 3)).values[0]
    guides = guide.execute(-40, audio=sound, guides=guides).values[0]
    assert [(g.frame_index, g.frames is None, g.waveform is None) for g in guides] == [(150, False, True),
                                                                                       (-40, True, False)]
    # 8 s = 192 frames: windows [0, 107) and [85, 192); both guides are in the second window's new frames
    args = (text, "a fox on a beach", "t2va", 8.0, "continuation", 107, 22, 3, 2, 0.0, 0.0, "auto", 0, 0)
    plain = continuation.execute(model, *args, vae=vae).values[0]
    guided = continuation.execute(model, *args, vae=vae, guides=guides).values[0]
    assert torch.equal(guided["video"][:, :, :32], plain["video"][:, :, :32])  # window 1: 32 latent frames
    assert not torch.equal(guided["video"][:, :, 32:], plain["video"][:, :, 32:])

    loads = len(c.record.loaded)
    with pytest.raises(ValueError, match="connect H3 VAE Loader's vae to H3 Continuation"):
        continuation.execute(model, *args, guides=guides)
    clip = guide.execute(100, image=torch.rand(22, 100, 160, 3)).values[0]
    with pytest.raises(ValueError, match="crosses the end of window 1"):
        continuation.execute(model, *args, vae=vae, guides=clip)
    assert len(c.record.loaded) == loads  # refused before any model moved
    with pytest.raises(ValueError, match="needs an image, a video or a sound"):
        guide.execute(0)


def test_a_continuation_video_guide_is_read_on_the_canvas_only_once_the_clip_is_known(comfy, monkeypatch):
    """H3 Continuation Guide read its VIDEO at the file's own size and as long as a window can be, before the
    canvas or the clip's length was known (a 4K clip held ~9 GB); H3 Continuation reads it now, onto the canvas
    and only as far as the clip goes, with the same latents as the frames given in memory."""
    from h3_core import media_read
    from h3_core.media_write import write_mp4

    c = comfy
    model, text, vae = _models(c)
    long_video = importlib.import_module("nodes.long_video")
    guide, continuation = long_video.H3ContinuationGuide, long_video.H3Continuation
    path = c.tmp / "long_guide.mp4"
    frames = np.random.default_rng(7).integers(0, 256, (72, 120, 200, 3), dtype=np.uint8)  # 3 s, not the canvas
    write_mp4(path, frames, (np.sin(np.arange(32000 * 3) / 5.0) * 0.3).astype(np.float32)[None].repeat(2, 0))
    reads = _counted_video_reads(monkeypatch)
    loaded = SimpleNamespace(get_stream_source=lambda: str(path), get_active_trim_window=lambda: (0.0, 0.0),
                             get_components=lambda: pytest.fail("decoded whole through get_components"))
    guides = guide.execute(150, video=loaded).values[0]
    assert reads == []  # nothing read before the canvas is known
    # 8 s = 192 frames on the 224x128 canvas: the guide at 150 holds 42 frames, in window 2 ([85, 192))
    args = (text, "a fox on a beach", "t2va", 8.0, "continuation", 107, 22, 3, 2, 0.0, 0.0, "auto", 0, 0)
    from_file = continuation.execute(model, *args, vae=vae, guides=guides).values[0]
    assert reads == [(42, 128, 224, 3)]
    monkeypatch.undo()
    clip = media_read.read_video(path)
    in_memory = SimpleNamespace(get_components=lambda: SimpleNamespace(
        images=torch.from_numpy(clip.frames).float() / 255, frame_rate=Fraction(24),
        audio={"waveform": torch.from_numpy(clip.audio)[None], "sample_rate": 32000}))
    expected = continuation.execute(model, *args, vae=vae, guides=guide.execute(150, video=in_memory).values[0])
    assert torch.equal(from_file["video"], expected.values[0]["video"])
    assert torch.equal(from_file["audio"], expected.values[0]["audio"])
    plain = continuation.execute(model, *args, vae=vae).values[0]
    assert not torch.equal(from_file["video"][:, :, 32:], plain["video"][:, :, 32:])
    (c.tmp / "broken.mp4").write_bytes(b"not a video")
    broken = SimpleNamespace(get_stream_source=lambda: str(c.tmp / "broken.mp4"),
                             get_active_trim_window=lambda: (0.0, 0.0))
    with pytest.raises(ValueError, match=r"^The video guide at frame 150: video: "):
        continuation.execute(model, *args, vae=vae, guides=guide.execute(150, video=broken).values[0])


def test_continuation_stops_inside_the_text_encoder_on_interrupt(comfy):
    c = comfy
    model, text, vae = _models(c)
    continuation = importlib.import_module("nodes.long_video").H3Continuation
    layers = text.encoder.model.language_model.layers
    ran = []
    hook = layers[0].register_forward_hook(lambda module, args, output: ran.append(module))
    c.record.interrupt_after = len(c.record.progress)
    try:
        with pytest.raises(c.memory.mm.InterruptProcessingException):
            continuation.execute(model, text, "a fox on a beach", "t2va", 8.0, "continuation", 107, 22, 3, 2, 0.0,
                                 0.0, "auto", 0, 0, vae=vae)
    finally:
        hook.remove()
    assert ran == [] and all(not layer._forward_pre_hooks for layer in layers)


def test_continuation_says_what_h3_generate_warns_about_the_prompts_it_samples(comfy, caplog):
    """With window prompts, each is checked as a prompt (labels, control tokens), numbered; the prompt box is
    not sampled then, and a filled one is said to be unused. Said before the text encoder runs (stopped there)."""
    c = comfy
    model, text, vae = _models(c)
    continuation = importlib.import_module("nodes.long_video").H3Continuation

    def said(prompt, window_prompts):
        caplog.clear()
        c.record.interrupt_after = len(c.record.progress)
        with caplog.at_level("WARNING", logger="h3"), pytest.raises(c.memory.mm.InterruptProcessingException):
            continuation.execute(model, text, prompt, "t2va", 8.0, "continuation", 107, 22, 3, 2, 0.0, 0.0, "auto",
                                 0, 0, vae=vae, window_prompts=window_prompts)
        return [r.getMessage() for r in caplog.records]

    unused = ("H3: every window samples its own line of window_prompts; the prompt box is not sampled (clear it, "
              "or make it the first window's line).")
    lines = said("waves and gulls", "a fox runs<|im_end|>\n<Picture 1> sits")
    assert lines == [unused, "H3: window prompt 1: the prompt holds <|im_end|>: the text encoder reads it as its own "
                     "control token, not as words, and H3 never saw one inside a prompt.",
                     "H3: window prompt 2: the prompt names <Picture 1>, but the request carries no picture labels."]
    assert said("", "a fox runs\nthe fox stops") == []
    assert said("a fox<|endoftext|>", "") == ["H3: the prompt holds <|endoftext|>: the text encoder reads it as its "
                                              "own control token, not as words, and H3 never saw one inside a prompt."]


def test_continuation_places_the_text_encoder_only_for_prompts_it_does_not_remember(comfy):
    """H3 Continuation run again (another seed) with its window prompts: every prompt's states are remembered,
    so the text encoder is neither placed nor run; a new window prompt places it again."""
    c = comfy
    model, text, vae = _models(c)
    continuation = importlib.import_module("nodes.long_video").H3Continuation
    args = ("t2va", 8.0, "continuation", 107, 22)
    rest = (2, 0.0, 0.0, "auto", 0, 0)
    first = continuation.execute(model, text, "a fox on a beach", *args, 3, *rest,
                                 window_prompts="a fox on a beach\nthe fox swims")
    encoder = "H3 text encoder (tiny-random)"
    assert encoder in c.record.loaded[-2][0]  # then the DiT
    layers = text.encoder.model.language_model.layers
    ran = []
    hook = layers[0].register_forward_hook(lambda module, args, output: ran.append(module))
    try:
        before = len(c.record.loaded)
        again = continuation.execute(model, text, "a fox on a beach", *args, 4, *rest,
                                     window_prompts="a fox on a beach\nthe fox swims")
        assert ran == [] and not any(encoder in names for names, _ in c.record.loaded[before:])
        assert not torch.equal(again.values[0]["video"], first.values[0]["video"])  # another seed, sampled anew
        before = len(c.record.loaded)
        continuation.execute(model, text, "a fox on a beach", *args, 4, *rest,
                             window_prompts="a fox on a beach\nthe fox dives")
        assert len(ran) == 1 and encoder in c.record.loaded[before][0]  # only the new prompt ran
    finally:
        hook.remove()


def test_continuation_extends_a_sampled_clip(comfy):
    c = comfy
    model, text, vae = _models(c)
    cond = _cond(c, text, vae).values[0]  # 4 s: 107 frames, 32 latent frames
    clip = c.sampler.H3Sampler.execute(model, cond, 5, 3, 0.0, 0.0).values[0][0]
    continuation = importlib.import_module("nodes.long_video").H3Continuation
    args = (text, "the fox keeps running", "t2va", 8.0, "continuation", 107, 22, 3, 2, 0.0, 0.0, "auto", 0, 0)
    longer, frames = continuation.execute(model, *args, continue_from=clip).values
    assert frames == 192 and torch.equal(longer["video"][:, :, :32], clip["video"])
    assert torch.equal(longer["audio"][..., :clip["audio"].shape[2]], clip["audio"])
    again = continuation.execute(model, *args[:3], 12.0, *args[4:], continue_from=longer).values[0]  # chained
    assert torch.equal(again["video"][:, :, :57], longer["video"])

    loads = len(c.record.loaded)
    empty = c.latent.H3EmptyAVLatent.execute(224, 128, 107).values[0]
    with pytest.raises(ValueError, match="empty latent .* connect a sampled one"):
        continuation.execute(model, *args, continue_from=empty)
    with pytest.raises(ValueError, match="keeps its canvas, 224x128; this request asks for 256x128"):
        continuation.execute(model, *args[:-2], 256, 128, continue_from=clip)
    assert len(c.record.loaded) == loads  # refused before any model moved


def test_a_continuation_that_stops_saves_its_finished_windows(comfy, monkeypatch, caplog):
    """Stopped in its second window (an interrupt, out of memory), H3 Continuation saves the first in the output
    folder and says how to go on: H3 Load Latent reads it into continue_from, which makes the rest, as the run
    would have made it."""
    import shutil

    import h3_core.long_video as long_video_module

    c = comfy
    model, text, vae = _models(c)
    continuation = importlib.import_module("nodes.long_video").H3Continuation
    files = importlib.import_module("nodes.latent_files")
    args = (text, "a fox on a beach", "t2va", 8.0, "continuation", 107, 22, 3, 2, 0.0, 0.0, "auto", 0, 0)
    sample, calls = long_video_module.sample, []

    def stopped_in_the_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise c.memory.mm.InterruptProcessingException()
        return sample(*a, **k)

    monkeypatch.setattr(long_video_module, "sample", stopped_in_the_second)
    with caplog.at_level("WARNING", logger="h3"), pytest.raises(c.memory.mm.InterruptProcessingException):
        continuation.execute(model, *args)
    (saved,) = (c.tmp / "output" / "H3").glob("unfinished_long_video_*.safetensors")
    assert f"stopped after window 1 of 2; those windows are saved as {saved}: move the file" in caplog.text
    assert "give it to H3 Continuation's continue_from" in caplog.text and "cannot be continued" not in caplog.text
    monkeypatch.setattr(long_video_module, "sample", sample)
    shutil.copy(saved, c.tmp / "input" / saved.name)
    first, _, _, frames = files.H3LoadLatent.execute(saved.name).values
    assert frames == 107 and (first["seed"], first["task"]) == (3, "t2va")
    whole, total = continuation.execute(model, *args, continue_from=first).values
    assert total == 192 and torch.equal(whole["video"][:, :, :first["video"].shape[2]], first["video"])
    straight = continuation.execute(model, *args).values[0]  # the run that never stopped makes the same clip
    assert torch.equal(whole["video"], straight["video"]) and torch.equal(whole["audio"], straight["audio"])
    with caplog.at_level("WARNING", logger="h3"):
        continuation.execute(model, *args[:7], 4, *args[8:], continue_from=first)  # another seed: said
    assert "saved by a run with seed 3 that stopped; with seed 4 the rest differs" in caplog.text
    # a run with drive_audio or keep_video hands its clip without a resume point: not offered to continue
    from h3_core.output import AVLatents

    with caplog.at_level("WARNING", logger="h3"):
        files.save_unfinished(AVLatents(first["video"], first["audio"]), 1, 2)
    assert "A run with drive_audio or keep_video cannot be continued from them: queue it again." in caplog.text

    def no_room(*_):  # a full disk: said in the log, never raised over the run's own error
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files, "save_latent_file", no_room)
    with caplog.at_level("WARNING", logger="h3"):
        files.save_unfinished(AVLatents(first["video"], first["audio"]), 1, 2)
    assert "the long video's finished windows could not be saved: [Errno 28] No space left on device" in caplog.text


def test_continuation_makes_the_sound_for_a_kept_clip(comfy):
    """keep_video: the clip's video comes back as it is with a new sound, over all its windows (a duration longer
    than the clip takes all of it, a shorter one its first seconds)."""
    c = comfy
    model, text, vae = _models(c)
    continuation = importlib.import_module("nodes.long_video").H3Continuation
    args = (text, "rain on a tin roof", "t2va", 8.0, "continuation", 107, 22, 3, 2, 0.0, 0.0, "auto", 0, 0)
    clip, frames = continuation.execute(model, *args).values  # 192 frames: windows [0, 107), [85, 192)
    steps = c.record.progress[-2:]  # one bar over both windows (a model call each), a preview of the window made
    assert [(value, total) for value, total, _ in steps] == [(1, 2), (2, 2)]
    assert all(preview[0] == "JPEG" and preview[1].size == (14, 8) for _, _, preview in steps)
    sound, total = continuation.execute(model, *args[:3], 300.0, *args[4:], keep_video=clip).values
    assert all(preview is None for _, _, preview in c.record.progress[-2:])  # the video is kept: nothing to show
    assert total == frames == 192 and torch.equal(sound["video"], clip["video"])
    assert sound["audio"].shape == clip["audio"].shape and not torch.equal(sound["audio"], clip["audio"])
    first, total = continuation.execute(model, *args[:3], 5.0, *args[4:], keep_video=clip).values
    assert total == 124 and torch.equal(first["video"], clip["video"][:, :, :37])

    loads = len(c.record.loaded)
    empty = c.latent.H3EmptyAVLatent.execute(224, 128, 107).values[0]
    with pytest.raises(ValueError, match="keep_video holds an empty latent"):
        continuation.execute(model, *args, keep_video=empty)
    with pytest.raises(ValueError, match="A kept clip keeps its canvas, 224x128; this request asks for 16:9"):
        continuation.execute(model, *args[:-3], "16:9", 0, 0, keep_video=clip)
    with pytest.raises(ValueError, match="cannot go with continue_from"):
        continuation.execute(model, *args, keep_video=clip, continue_from=clip)
    with pytest.raises(ValueError, match=r"^task must be one of t2va, ref2va; got 'fl2va'\.$"):  # a linked task
        continuation.execute(model, *args[:2], "fl2va", *args[3:])
    assert len(c.record.loaded) == loads  # refused before any model moved


def test_continuation_makes_a_video_as_long_as_its_driving_track(comfy):
    """drive_audio: a duration at or past the track's end makes the clip as long as the track (the most 17n + 5
    frames within it), not the track padded with silence; a shorter one its first seconds; a track too short to
    be a clip by itself is padded to the duration."""
    c = comfy
    model, text, vae = _models(c)
    continuation = importlib.import_module("nodes.long_video").H3Continuation
    args = (text, "a drum solo", "t2va", 300.0, "continuation", 107, 22, 3, 2, 0.0, 0.0, "auto", 0, 0)
    song = {"waveform": torch.randn(1, 2, 16000 * 6) * 0.1, "sample_rate": 16000}  # 144 frames
    clip, frames = continuation.execute(model, *args, vae=vae, drive_audio=song).values
    assert frames == 141 and clip["video"].shape[2] == 42 and clip["audio"].shape[-1] == 235  # 141 frames of sound
    first, frames = continuation.execute(model, *args[:3], 5.0, *args[4:], vae=vae, drive_audio=song).values
    assert frames == 124 and first["audio"].shape[-1] == 207
    short = {"waveform": torch.randn(1, 2, 16000 * 3) * 0.1, "sample_rate": 16000}
    assert continuation.execute(model, *args[:3], 8.0, *args[4:], vae=vae, drive_audio=short).values[1] == 192
    with pytest.raises(ValueError, match="cannot go with drive_audio"):  # linked past the queue-time check
        continuation.execute(model, *args, vae=vae, drive_audio=song, keep_video=clip)


def test_vae_encode_turns_a_video_into_a_latent_to_extend(comfy):
    c = comfy
    model, text, vae = _models(c)
    sound = {"waveform": torch.randn(1, 2, 44100 * 3) * 0.1, "sample_rate": 44100}
    video = SimpleNamespace(get_components=lambda: SimpleNamespace(images=torch.rand(75, 100, 180, 3),
                                                                   frame_rate=Fraction(30), audio=sound))
    encode = c.latent.H3VAEEncode
    latent, width, height, frames = encode.execute(vae, video=video).values
    # 75 frames at 30 fps = 60 at 24 fps, cut to 56 (17n + 5); tiny-random's canvas for a 9:5 clip
    assert (width, height, frames) == (224, 128, 56) and latent["video"].shape == (1, 24, 17, 8, 14)
    assert latent["audio"].shape == (2, 32, 93) and not latent.get("empty")
    longer, total = importlib.import_module("nodes.long_video").H3Continuation.execute(
        model, text, "the street keeps going", "t2va", 5.0, "continuation", 107, 22, 3, 2, 0.0, 0.0, "auto", 0, 0,
        continue_from=latent).values
    assert total == 124 and torch.equal(longer["video"][:, :, :17], latent["video"])
    frames_only = encode.execute(vae, images=torch.rand(30, 64, 64, 3), frame_rate=24.0, width=128, height=128).values
    assert frames_only[1:] == (128, 128, 22)  # silence for the sound

    loads = len(c.record.loaded)
    with pytest.raises(ValueError, match="Connect a video or images"):
        encode.execute(vae)
    with pytest.raises(ValueError, match="needs at least 22 frames at 24 fps"):
        encode.execute(vae, images=torch.rand(10, 64, 64, 3))
    with pytest.raises(ValueError, match="width and height together"):
        encode.execute(vae, images=torch.rand(30, 64, 64, 3), width=128)
    assert len(c.record.loaded) == loads  # refused before the VAEs were placed


def test_vae_encode_reads_a_loaded_video_from_its_file(comfy, monkeypatch):
    """A Load Video VIDEO (VideoFromFile: a path and a trim window) is read from its file onto the canvas frame
    by frame, as `h3 encode` reads it, never decoded whole through get_components(); the trim is honoured."""
    from h3_core.clip_latents import encode_clip
    from h3_core.media_read import read_video
    from h3_core.media_write import write_mp4

    c = comfy
    _, _, vae = _models(c)
    path = c.tmp / "mine.mp4"
    frames = np.random.default_rng(4).integers(0, 256, (96, 100, 180, 3), dtype=np.uint8)  # 4 s at 24 fps
    write_mp4(path, frames, (np.sin(np.arange(32000 * 4) / 9.0) * 0.3).astype(np.float32)[None].repeat(2, 0))

    def loaded(trim=None):
        video = SimpleNamespace(get_stream_source=lambda: str(path),
                                get_components=lambda: pytest.fail("decoded whole through get_components"))
        if trim is not None:
            video.get_active_trim_window = lambda: trim
        return video

    start = len(c.record.progress)
    latent, width, height, count = c.latent.H3VAEEncode.execute(vae, video=loaded((1.0, 2.0))).values
    assert [(done, total) for done, total, _ in c.record.progress[start:]] == [(17, 39), (34, 39), (39, 39)]
    clip = read_video(path, 1.0, 48)  # frames 24-71, decoded whole, then encoded whole
    expected = encode_clip(vae.video, vae.audio, clip.frames, 24.0, 224, 128, clip.audio, 32000)
    assert (width, height, count) == (224, 128, 39)  # 48 frames at 24 fps, cut to 17n + 5
    assert torch.equal(latent["video"], expected.video) and torch.equal(latent["audio"], expected.audio)
    whole = c.latent.H3VAEEncode.execute(vae, video=loaded()).values  # no trim window: the whole file
    assert whole[3] == 90
    with pytest.raises(ValueError, match="multiples of 32"):
        c.latent.H3VAEEncode.execute(vae, video=loaded(), width=200, height=128)
    # linked sizes (unchecked at queue time): one of the two is refused, not taken as "from the clip"
    with pytest.raises(ValueError, match=r"^Give width and height together, or both 0 \(from the clip\); got 0x128\.$"):
        c.latent.H3VAEEncode.execute(vae, video=loaded(), width=0, height=128)
    # a file that cannot be read is said as the video's fault
    (c.tmp / "broken.mp4").write_bytes(b"not a video" * 100)
    broken = SimpleNamespace(get_stream_source=lambda: str(c.tmp / "broken.mp4"))
    with pytest.raises(ValueError, match=r"^video: .*broken\.mp4"):
        c.latent.H3VAEEncode.execute(vae, video=broken)
    # a canvas given is the one the file's frames are cropped onto
    assert c.latent.H3VAEEncode.execute(vae, video=loaded((1.0, 2.0)), width=128, height=128).values[1:3] == (128, 128)
    # a file that fails part-way (past the frames read up front to check it) is said as the video's fault
    from h3_core import media_read
    from h3_core.media import MediaError

    read_frames = media_read.iter_video_frames

    def fails_at_30(*args):
        yield from itertools.islice(read_frames(*args), 30)
        raise MediaError(f"{path}: invalid data at frame 30")

    said = r"^video: .*mine\.mp4: invalid data at frame 30$"
    with monkeypatch.context() as patch, pytest.raises(ValueError, match=said):
        patch.setattr(media_read, "iter_video_frames", fails_at_30)
        c.latent.H3VAEEncode.execute(vae, video=loaded())
    c.record.interrupt_after = len(c.record.progress) + 2  # cancelled after the second 17 frames
    with pytest.raises(c.memory.mm.InterruptProcessingException):
        c.latent.H3VAEEncode.execute(vae, video=loaded())
    assert [done for done, _, _ in c.record.progress[-2:]] == [17, 34]


def test_single_file_text_encoder_without_tokenizer_folder_is_refused_before_making_room(comfy, monkeypatch):
    """No tokenizer_folder: the release's is fetched from the Hub; offline that fails before any room is made."""
    import huggingface_hub
    import tiny_qwen

    def offline(repo, **options):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)

    tokenizer = tiny_qwen.write_tokenizer(comfy.tmp / "tok")
    name = "qwen3vl_32b_minimax_h3_bf16.safetensors"
    tiny_qwen.write_single_file(comfy.tmp / "text_encoders" / name,
                                tiny_qwen.random_model(tiny_qwen.config_dict(tokenizer), seed=3))
    with pytest.raises(ValueError, match="fetching the release's .* failed .*the H3 Text Encoder Loader's "
                                         "tokenizer_folder"):
        comfy.loaders.H3TextEncoderLoader.execute(name, "", "", "bf16")
    assert comfy.record.freed == [] and comfy.record.loaded == []  # no other model was asked to leave


def test_a_damaged_tokenizer_folder_is_refused_before_making_room(comfy):
    """The tokenizer (and processor) are read and checked against the model before room is asked of other models:
    a damaged tokenizer.json was refused only after the DiT had been moved out for the text encoder."""
    import tiny_qwen

    tokenizer = tiny_qwen.write_tokenizer(comfy.tmp / "text_encoders" / "tok")
    name = "qwen3vl_32b_minimax_h3_bf16.safetensors"
    tiny_qwen.write_single_file(comfy.tmp / "text_encoders" / name,
                                tiny_qwen.random_model(tiny_qwen.config_dict(tokenizer), seed=3))
    (tokenizer / "tokenizer.json").write_text("{ damaged")
    with pytest.raises(ValueError, match="The tokenizer in .*tok cannot be read"):
        comfy.loaders.H3TextEncoderLoader.execute(name, "", str(tokenizer), "bf16")
    assert comfy.record.freed == [] and comfy.record.loaded == []  # no other model was asked to leave


def test_another_models_file_in_the_text_encoder_loader_is_refused_before_any_fetch_or_room(comfy, monkeypatch):
    """A DiT file picked in H3 Text Encoder Loader: said from its tensor names, before the release's tokenizer is
    fetched from the Hub for it and before ~54 GB of room were asked of other models."""
    import huggingface_hub
    from safetensors.torch import save_file

    fetched = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **options: fetched.append(repo))
    name = "minimax_h3_fl2va_bf16.safetensors"
    (comfy.tmp / "text_encoders").mkdir(exist_ok=True)
    save_file({"blocks.0.attn.qkv_proj.weight": torch.zeros(6, 2), "proj_in.weight": torch.zeros(2, 2)},
              str(comfy.tmp / "text_encoders" / name))
    with pytest.raises(ValueError, match="holds no Qwen3-VL text encoder .*is it another model's file"):
        comfy.loaders.H3TextEncoderLoader.execute(name, "", "", "bf16")
    assert fetched == [] and comfy.record.freed == [] and comfy.record.loaded == []


def test_saved_mp4_carries_the_prompt_and_workflow_unless_metadata_is_disabled(comfy):
    """As ComfyUI's SaveVideo: the MP4 holds the prompt and the workflow as JSON tags (use_metadata_tags),
    so dropping it on the canvas restores the graph; --disable-metadata leaves only our comment."""
    args = sys.modules["comfy.cli_args"].args
    save = comfy.output.H3AVSave
    workflow = {"nodes": [{"id": 1, "type": "H3AVSave"}], "links": []}
    prompt = {"1": {"class_type": "H3AVSave", "inputs": {"filename_prefix": "H3/meta"}}}
    save.hidden = SimpleNamespace(prompt=prompt, extra_pnginfo={"workflow": workflow})
    try:
        path = Path(save.execute(torch.rand(5, 32, 32, 3), "H3/meta").values[0][1])
        with av.open(str(path)) as container:
            tags = dict(container.metadata)
        assert json.loads(tags["workflow"]) == workflow and json.loads(tags["prompt"]) == prompt
        assert tags["comment"] == "MiniMax-H3, 5 frames at 24 fps, 32000 Hz audio"

        args.disable_metadata = True
        path = Path(save.execute(torch.rand(5, 32, 32, 3), "H3/meta").values[0][1])
        with av.open(str(path)) as container:
            assert "workflow" not in container.metadata and "prompt" not in container.metadata
            assert container.metadata["comment"].startswith("MiniMax-H3")
    finally:
        save.hidden = None


def test_vae_decode_tiling_off_decodes_whole_frames(comfy):
    import dataclasses

    from h3_core.output import decode_video

    c = comfy
    model, text, vae = _models(c)
    out = c.sampler.H3Sampler.execute(model, _cond(c, text, vae).values[0], 0, 2, 0.0, 0.0).values[0][0]
    vae.video.config = dataclasses.replace(vae.video.config, tile_size=64, tile_min_overlap=32)  # 2 x 4 tiles
    tiled = c.output.H3VAEDecode.execute(vae, out).values[0]
    whole = c.output.H3VAEDecode.execute(vae, out, tiling="off").values[0]
    latents = c.output.unpack_latents(out).video
    expected = torch.cat(list(decode_video(vae.video, latents, tiled=False, as_uint8=False)))
    assert torch.equal(whole, expected) and not torch.equal(tiled, whole)
    with pytest.raises(ValueError, match="tiling must be one of release, off"):
        c.output.H3VAEDecode.execute(vae, out, tiling="auto")


def test_av_save_takes_a_video_with_its_soundtrack(comfy):
    save = comfy.output.H3AVSave
    tone = {"waveform": torch.sin(torch.arange(48000 * 2) / 10.0).repeat(1, 2, 1) * 0.3, "sample_rate": 48000}

    def video(fps, audio=tone):
        return SimpleNamespace(get_components=lambda: SimpleNamespace(
            images=torch.rand(12, 32, 48, 3), frame_rate=Fraction(fps), audio=audio))

    path = Path(save.execute(filename_prefix="H3/video", video=video(24)).values[0][1])
    with av.open(str(path)) as container:
        assert container.streams.video[0].codec_context.name == "h264"
        assert container.streams.audio[0].codec_context.sample_rate == 32000
        assert sum(1 for _ in container.decode(video=0)) == 12
        assert (container.streams.video[0].codec_context.width, container.streams.video[0].codec_context.height) == (48, 32)
    with av.open(str(path)) as container:
        loud = np.abs(np.concatenate([f.to_ndarray().ravel() for f in container.decode(audio=0)])).max()
    assert loud > 0.1  # the video's soundtrack, not silence
    with pytest.raises(ValueError, match="writes 24 fps .H3's rate.; this video is 25 fps"):
        save.execute(filename_prefix="H3/video", video=video(25))
    stating = SimpleNamespace(get_frame_rate=lambda: Fraction(30),  # a Load Video's: said before it is decoded
                              get_components=lambda: pytest.fail("a 30 fps video was decoded only to be refused"))
    with pytest.raises(ValueError, match="this video is 30 fps"):
        save.execute(filename_prefix="H3/video", video=stating)
    undecoded = SimpleNamespace(get_frame_rate=lambda: Fraction(24),  # a bad audio input: said before any frame
                                get_components=lambda: pytest.fail("decoded whole, then refused for its audio input"))
    with pytest.raises(ValueError, match="audio is a batch of 2 sounds"):
        save.execute(filename_prefix="H3/video", video=undecoded,
                     audio={**tone, "waveform": tone["waveform"].repeat(2, 1, 1)})
    with pytest.raises(ValueError, match="either images .frames at 24 fps. or a video, not both"):
        save.execute(torch.rand(3, 32, 48, 3), "H3/video", video=video(24))
    with pytest.raises(ValueError, match="got neither"):
        save.execute(filename_prefix="H3/video")

    # a VIDEO read from a file (Load Video, H3 Save MP4's output) is read from it as uint8 frames, trim honoured:
    # get_components() stacked every frame as float32 (a 300 s clip: 89 GB) before a uint8 copy was made
    from h3_core.media_write import write_mp4

    source = write_mp4(comfy.tmp / "mine.mp4", np.full((30, 32, 48, 3), 200, np.uint8),
                       np.full((2, 40000), 0.3, np.float32))
    on_disk = SimpleNamespace(get_stream_source=lambda: str(source), get_frame_rate=lambda: Fraction(24),
                              get_components=lambda: pytest.fail("a file's VIDEO was decoded whole into floats"))
    trimmed = SimpleNamespace(**vars(on_disk), get_active_trim_window=lambda: (0.5, 0.5))
    for given, frames in ((on_disk, 30), (trimmed, 12)):
        path = Path(save.execute(filename_prefix="H3/video", video=given).values[0][1])
        with av.open(str(path)) as container:
            pictures = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        with av.open(str(path)) as container:
            loud = np.abs(np.concatenate([f.to_ndarray().ravel() for f in container.decode(audio=0)])).max()
        assert len(pictures) == frames and abs(int(pictures[0].mean()) - 200) <= 3 and loud > 0.1


def test_av_save_shows_the_file_it_kept_where_its_name_is_held_open(comfy, monkeypatch):
    """Windows refuses to replace a file a program holds open: the clip is kept under a free name (Mp4Writer),
    and the save nodes' preview and VIDEO are that file, not the name asked for."""
    from h3_core import media_write

    real = media_write.os.replace

    def replace(source, target):
        if Path(target).name.endswith("_.mp4"):
            raise PermissionError(13, "being used by another process", str(target))
        return real(source, target)

    monkeypatch.setattr(media_write.os, "replace", replace)
    c = comfy
    model, text, vae = _models(c)
    out = c.sampler.H3Sampler.execute(model, _cond(c, text, vae).values[0], 0, 2, 0.0, 0.0).values[0][0]
    for saved in (c.output.H3AVSave.execute(torch.rand(3, 32, 48, 3), "H3/held"),
                  importlib.import_module("nodes.long_video").H3SaveMP4.execute(vae, out, "H3/held_latent")):
        path = Path(saved.values[0][1])
        assert path.name.endswith("_ (1).mp4") and path.is_file()
        assert saved.ui["videos"][0].filename == path.name
        assert not path.with_name(path.name.replace(" (1)", "")).exists()  # no empty placeholder left at the name


def test_a_killed_savers_leftovers_go_at_the_next_save_of_its_prefix(comfy, caplog):
    """A saver killed outright (the OOM killer) left its empty placeholder and its hidden part: the numbered names
    move on past them, so only a save of the same prefix can tell they are a dead writer's, and removes them.
    A live writer's, another prefix's and a real file stay. A sound of another length than the frames is said."""
    import subprocess

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)  # a process that has ended
    folder = comfy.tmp / "output" / "H3"
    folder.mkdir(parents=True, exist_ok=True)
    placeholder, part = folder / "h3_00001_.mp4", folder / f".h3_00001_.mp4.{dead}-0123abcd.part"
    placeholder.touch()
    part.write_bytes(b"half a clip")
    live = folder / f".h3_00002_.mp4.{os.getpid()}-0123abcd.part"
    live.write_bytes(b"being written")
    other = folder / f".clip_00001_.mp4.{dead}-0123abcd.part"
    other.write_bytes(b"another prefix's")
    (folder / "h3_00003_.mp4").write_bytes(b"a finished clip")
    with caplog.at_level("WARNING", logger="h3"):
        saved = comfy.output.H3AVSave.execute(torch.rand(48, 32, 48, 3), "H3/h3",
                                              {"waveform": torch.zeros(1, 2, 32000), "sample_rate": 32000})
    assert Path(saved.values[0][1]).is_file()
    assert not placeholder.exists() and not part.exists()
    assert live.exists() and other.exists() and (folder / "h3_00003_.mp4").read_bytes() == b"a finished clip"
    assert "the sound lasts 1.00 s but the 48 frames 2.00 s at 24 fps; the sound is padded with silence" in caplog.text


def test_conditioning_shows_progress_per_model_call_and_stops_on_interrupt(comfy):
    c = comfy
    _, text, vae = _models(c)
    video = SimpleNamespace(get_components=lambda: SimpleNamespace(
        images=torch.rand(60, 128, 224, 3), frame_rate=Fraction(24), audio=None))
    audio = {"waveform": torch.randn(1, 2, 32000 * 3) * 0.1, "sample_rate": 32000}
    refs = {"ref0": torch.rand(1, 160, 160, 3), "ref1": video, "ref2": audio}
    start = len(c.record.progress)
    _cond(c, text, vae, "ref2va", references=refs)
    # a step per text encoder layer, then the image, the video, the audio
    steps = text.encoder.layer + 3
    shown = [(value, total) for value, total, _ in c.record.progress[start:]]
    assert shown == [(n, steps) for n in range(1, steps + 1)]
    layers = text.encoder.model.language_model.layers

    def interrupted_before(layer: int) -> bool:
        """Cancel pressed at `interrupt_after` stops the encode, and `layer` never ran."""
        ran = []
        hook = layers[layer].register_forward_hook(lambda module, args, output: ran.append(module))
        try:
            with pytest.raises(c.memory.mm.InterruptProcessingException):
                _cond(c, text, vae, "ref2va", references=refs)
        finally:
            hook.remove()
        return ran == []

    c.record.interrupt_after = len(c.record.progress) + 1  # stop after the text encoder's first layer
    assert interrupted_before(1) and c.record.progress[-1][:2] == (1, steps)
    c.record.interrupt_after = len(c.record.progress)  # stop inside the text encoder, before its first layer
    assert interrupted_before(0) and len(c.record.progress) == c.record.interrupt_after
    assert all(not layer._forward_pre_hooks for layer in layers)


def test_decode_nodes_share_the_clips_over_devices(comfy, monkeypatch):
    """devices: the video's clips decode on each listed device at once; the frames equal one device's."""
    import h3_core.vae_video as vae_video

    c = comfy
    model, text, vae = _models(c)
    out = c.sampler.H3Sampler.execute(model, _cond(c, text, vae).values[0], 0, 2, 0.0, 0.0).values[0][0]
    shared_on, share = [], vae_video.decode_on_devices

    def recorded(vae_, clips, devices, *rest):
        shared_on.append(list(devices))
        return share(vae_, clips, devices, *rest)

    monkeypatch.setattr(vae_video, "decode_on_devices", recorded)
    one = c.output.H3VAEDecode.execute(vae, out).values[0]
    assert shared_on == []
    assert torch.equal(c.output.H3VAEDecode.execute(vae, out, devices="cpu, cpu").values[0], one)
    assert shared_on == [[torch.device("cpu")] * 2]  # the equal frames did come from both devices
    with pytest.raises(ValueError, match="cpu alone is one device; list two or more to share the decode"):
        c.output.H3VAEDecode.execute(vae, out, devices="cpu")
    with pytest.raises(ValueError, match="is not a list of device names"):
        c.output.H3VAEDecode.execute(vae, out, devices="cpu, gpu0")
    with pytest.raises(ValueError, match="'garbage' is not a list of device names"):
        c.output.H3VAEDecode.execute(vae, out, devices="garbage")

    long_video = importlib.import_module("nodes.long_video")
    shared = Path(long_video.H3SaveMP4.execute(vae, out, "H3/shared", devices="cpu,cpu").values[0][1])
    assert len(shared_on) == 2
    alone = Path(long_video.H3SaveMP4.execute(vae, out, "H3/alone").values[0][1])
    frames = []
    for path in (shared, alone):
        with av.open(str(path)) as container:
            frames.append(np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)]))
    assert frames[0].shape[0] == 107 and np.array_equal(*frames)
    assert b"crf=40.0" in Path(long_video.H3SaveMP4.execute(vae, out, "H3/coarse", crf=40).values[0][1]).read_bytes()


def test_gguf_files_are_listed_by_walking_a_model_folder_again_only_once_it_changed(comfy, monkeypatch):
    """The loaders list GGUF files (which ComfyUI's own lists leave out) on ComfyUI's server thread at every queue:
    a large or network model folder was walked each time, stalling the server (found by the threads review)."""
    import folder_paths

    from nodes.common import model_choices

    walks, walk = [], folder_paths.recursive_search
    monkeypatch.setattr(folder_paths, "recursive_search", lambda folder, **k: walks.append(folder) or walk(folder, **k))
    folder = comfy.tmp / "diffusion_models"
    (folder / "quantized").mkdir(parents=True, exist_ok=True)
    (folder / "quantized" / "h3-Q8_0.gguf").write_bytes(b"")
    listed = model_choices("diffusion_models", (".gguf",))
    assert "quantized/h3-Q8_0.gguf" in listed and len(walks) == 1
    assert model_choices("diffusion_models", (".gguf",)) == listed and len(walks) == 1  # nothing changed: no walk
    (folder / "quantized" / "h3-Q4_K.gguf").write_bytes(b"")  # a file added in a subfolder
    assert "quantized/h3-Q4_K.gguf" in model_choices("diffusion_models", (".gguf",)) and len(walks) == 2
    (folder / "quantized" / "h3-Q8_0.gguf").unlink()
    assert "quantized/h3-Q8_0.gguf" not in model_choices("diffusion_models", (".gguf",)) and len(walks) == 3
    folder.rename(comfy.tmp / "moved")  # the folder itself gone (unmounted, say): walked again, nothing listed
    try:
        assert "quantized/h3-Q4_K.gguf" not in model_choices("diffusion_models", (".gguf",)) and len(walks) == 4
    finally:
        (comfy.tmp / "moved").rename(folder)


def test_a_gguf_text_encoder_is_offered_and_reads_its_mmproj(comfy, monkeypatch):
    """A llama.cpp GGUF of the encoder's language model in models/text_encoders: listed (ComfyUI lists its own
    suffixes only), loaded with its linears in GGML blocks; a keyframe is refused, saying the file has no vision
    tower, until its mmproj file lies beside it."""
    import tiny_qwen
    from PIL import Image

    from h3_core import text_checkpoint
    from h3_core.gguf_file import GGUFLinear

    tokenizer = tiny_qwen.write_tokenizer(comfy.tmp / "tok")
    config = tiny_qwen.config_dict(tokenizer)
    model = tiny_qwen.random_model(config, seed=3)
    release = tiny_qwen.write_original_release(comfy.tmp / "release", model, tokenizer)
    keys = tiny_qwen.llama_cpp_keys(model.state_dict())
    name = "Qwen3-VL-32B-Instruct-Q8_0.gguf"
    tiny_qwen.write_gguf_file(comfy.tmp / "text_encoders" / name, model, {k: "Q8_0" for k, v in keys.items() if v.ndim == 2})
    monkeypatch.setattr(text_checkpoint, "QWEN3VL_32B_CONFIG", config)  # a one-file encoder's config: the tiny one
    schema = comfy.loaders.H3TextEncoderLoader.define_schema()
    assert name in next(p for p in schema.inputs if p.id == "text_encoder").options["options"]
    text = comfy.loaders.H3TextEncoderLoader.execute(name, "", str(release / "FL2VA"), "bf16").values[0]
    assert any(isinstance(m, GGUFLinear) for m in text.encoder.model.modules())
    conditioning = comfy.conditioning.H3Conditioning.execute(text, "a fox on a beach", "t2va", "auto", 0, 0, 4.0)
    assert conditioning.values[0] is not None
    keyframe = torch.from_numpy(np.asarray(Image.new("RGB", (96, 64), (200, 30, 30)), dtype=np.float32) / 255)[None]
    _, _, vae = _models(comfy)
    placed = len(comfy.record.loaded)
    with pytest.raises(Exception, match=f"This request shows the text encoder pictures, but {name} holds no vision "
                                        "tower, .*keyframes and image or video references"):
        comfy.conditioning.H3Conditioning.execute(text, "a fox", "fl2va", "auto", 0, 0, 4.0, vae=vae,
                                                  first_image=keyframe)
    assert len(comfy.record.loaded) == placed  # refused before the encoder and the VAEs were placed for it

    # its mmproj file beside it: not offered as a text encoder, read as the vision tower; ComfyUI loads the encoder
    # again for it (its fingerprint changed)
    fingerprint = comfy.loaders.H3TextEncoderLoader.fingerprint_inputs
    before = fingerprint(name, "", str(release / "FL2VA"), "bf16")
    tiny_qwen.write_mmproj_file(comfy.tmp / "text_encoders" / "mmproj-F16.gguf", model, {})
    assert fingerprint(name, "", str(release / "FL2VA"), "bf16") != before
    before = fingerprint(name, "", str(release / "FL2VA"), "bf16")
    tokenizer_file = next((release / "FL2VA").rglob("tokenizer_config.json"))
    tokenizer_file.write_text(tokenizer_file.read_text() + "\n")  # a tokenizer fixed in place loads again
    assert fingerprint(name, "", str(release / "FL2VA"), "bf16") != before
    assert fingerprint("tiny-random", "", "", "bf16") == ""
    assert fingerprint(None, "", "", "bf16") == fingerprint(name, None, "", "bf16") == ""  # linked: not followed
    options = next(p for p in comfy.loaders.H3TextEncoderLoader.define_schema().inputs if p.id == "text_encoder")
    assert name in options.options["options"] and "mmproj-F16.gguf" not in options.options["options"]
    text = comfy.loaders.H3TextEncoderLoader.execute(name, "", str(release / "FL2VA"), "bf16").values[0]
    cond = comfy.conditioning.H3Conditioning.execute(text, "a fox", "fl2va", "auto", 0, 0, 4.0, vae=vae,
                                                     first_image=keyframe).values[0]
    assert cond.task == "fl2va" and len(cond.visual_condition_latents) == 1


def test_values_comfyui_lets_through_are_refused_at_their_node(comfy):
    """An empty latent is not decoded into a clip of nothing; NaN passes ComfyUI's range checks, so the node
    holding it refuses it before any model loads."""
    c = comfy
    _, _, vae = _models(c)
    empty = c.latent.H3EmptyAVLatent.execute(1344, 768, 124).values[0]
    with pytest.raises(ValueError, match="latent holds an empty latent"):
        c.output.H3VAEDecode.execute(vae, empty)
    with pytest.raises(ValueError, match="latent holds an empty latent"):
        importlib.import_module("nodes.long_video").H3SaveMP4.execute(vae, empty, "H3/empty")
    loaded = len(c.record.loaded)
    with pytest.raises(ValueError, match="GPU memory budget must be a positive number of GiB, got nan"):
        c.loaders.H3ModelLoader.execute("tiny-random", "", "fl2va", "bf16", "auto", gpu_memory_gb=float("nan"))
    with pytest.raises(ValueError, match="GPU memory budget must be a positive number of GiB, got nan"):
        c.loaders.H3TextEncoderLoader.execute("tiny-random", "", "", "bf16", gpu_memory_gb=float("nan"))
    with pytest.raises(ValueError, match="strength must be a finite number, got nan"):
        c.sampler.H3LoRAApply.execute(None, "any.safetensors", float("nan"))
    with pytest.raises(ValueError, match="frame rate must be a positive number, got nan"):
        c.latent.H3VAEEncode.execute(vae, images=torch.rand(30, 64, 96, 3), frame_rate=float("nan"))
    assert len(c.record.loaded) == loaded


def test_a_link_that_delivers_nothing_is_refused_not_left_out(comfy, monkeypatch, caplog):
    """Get Video Components' audio of a silent video is None: execute sees what an unconnected input gives. The
    queued prompt says the input is linked, and to what: from Get Video Components the node refuses rather than
    running without the sound; from another node (a switch with its inputs muted) it runs on, saying so."""
    c = comfy
    long_video = importlib.import_module("nodes.long_video")
    linked = {"inputs": {"drive_audio": ["4", 2], "audio": ["4", 2], "first_image": ["4", 0], "prompt": "rain",
                         "references.ref1": ["4", 2]}}
    prompt = {"9": linked, "4": {"class_type": "GetVideoComponents", "inputs": {}}}
    for node in (long_video.H3Continuation, long_video.H3ContinuationGuide, c.conditioning.H3Conditioning,
                 c.conditioning.H3AddGuide, c.latent.H3VAEEncode):
        monkeypatch.setattr(node, "hidden", SimpleNamespace(prompt=prompt, unique_id="9"), raising=False)
    image = torch.rand(1, 64, 96, 3)
    message = "is connected, but GetVideoComponents gave nothing for it"
    with pytest.raises(ValueError, match=f"drive_audio {message}"):
        long_video.H3Continuation.execute(None, None, "rain", "t2va", 20.0, "continuation", 277, 22, 0, 0, 0.0, 0.0,
                                          "auto", 0, 0, drive_audio=None)
    with pytest.raises(ValueError, match=f"audio {message}"):
        long_video.H3ContinuationGuide.execute(10, image=image, audio=None)
    with pytest.raises(ValueError, match=f"first_image {message}"):
        c.conditioning.H3Conditioning.execute(None, "rain", "fl2va", "auto", 0, 0, 4.0, first_image=None)
    with pytest.raises(ValueError, match=f"audio {message}"):
        c.conditioning.H3AddGuide.execute(None, None, 0, image=image, audio=None)
    with pytest.raises(ValueError, match=f"audio {message}"):
        c.latent.H3VAEEncode.execute(None, images=image, audio=None)
    linked["inputs"].pop("first_image")
    with pytest.raises(ValueError, match=f"references.ref1 {message}"):  # a grown slot, as the prompt names it
        c.conditioning.H3Conditioning.execute(None, "rain", "ref2va", "auto", 0, 0, 4.0,
                                              references={"ref0": image, "ref1": None})
    # from a switch: the guide runs with its image alone, and the log says the sound was left out
    prompt["4"]["class_type"] = "Any Switch (rgthree)"
    with caplog.at_level("WARNING", logger="h3"):
        assert long_video.H3ContinuationGuide.execute(10, image=image, audio=None).values[0]
    assert "audio is connected, but Any Switch (rgthree) gave nothing: running without it." in caplog.text
    # unconnected (not in the prompt's inputs) is neither refused nor said
    caplog.clear()
    linked["inputs"].pop("audio")
    assert long_video.H3ContinuationGuide.execute(10, image=image, audio=None).values[0] and not caplog.text


def test_a_long_video_on_the_wrong_partition_is_refused_before_encoding(comfy):
    """ref2va needs the ref2va DiT: said before the text encoder runs (None here: it is never asked)."""
    model = comfy.loaders.H3ModelLoader.execute("tiny-random", "", "fl2va", "bf16", "auto").values[0]
    continuation = importlib.import_module("nodes.long_video").H3Continuation.execute
    with pytest.raises(ValueError, match=r"^ref2va runs on the ref2va partition, but this model was loaded as fl2va; "
                                         r"set the loader's partition to ref2va\.$"):
        continuation(model, None, "a fox", "ref2va", 20.0, "continuation", 277, 22, 0, 2, 0.0, 0.0, "auto", 0, 0)


def test_a_reference_problem_names_its_slot(comfy):
    """The engine counts references in list order; the node's slots have gaps (ref0, ref3): errors name the slot."""
    c = comfy
    _, text, vae = _models(c)
    short = {"waveform": torch.zeros(1, 2, 16000), "sample_rate": 32000}  # 0.5 s: reference clips are 2-15 s
    long_video = importlib.import_module("nodes.long_video")
    model = c.loaders.H3ModelLoader.execute("tiny-random", "", "ref2va", "bf16", "auto").values[0]
    with pytest.raises(ValueError, match=r"^references.ref3 \(audio\) runs 0.500 s; reference clips must be 2-15 s"):
        c.conditioning.H3Conditioning.execute(text, "a fox", "ref2va", "auto", 0, 0, 4.0, vae=vae,
                                              references={"ref0": torch.rand(1, 64, 96, 3), "ref3": short})
    with pytest.raises(ValueError, match=r"references.ref3 \(audio\) runs 0.500 s"):
        long_video.H3Continuation.execute(model, text, "a fox", "ref2va", 20.0, "continuation", 277, 22, 0, 2, 0.0, 0.0,
                                          "auto", 0, 0, vae=vae,
                                          references={"ref0": torch.rand(1, 64, 96, 3), "ref3": short})
    # refused by the node's own conversion, before the engine sees it
    two = torch.rand(2, 64, 96, 3)
    with pytest.raises(ValueError, match=r"^references.ref3 \(image\) is a batch of 2 images"):
        c.conditioning.H3Conditioning.execute(text, "a fox", "ref2va", "auto", 0, 0, 4.0, vae=vae,
                                              references={"ref1": torch.rand(1, 64, 96, 3), "ref3": two})
    with pytest.raises(ValueError, match=r"^references.ref3 \(image\) is a batch of 2 images"):
        long_video.H3Continuation.execute(model, text, "a fox", "ref2va", 20.0, "continuation", 277, 22, 0, 2, 0.0, 0.0,
                                          "auto", 0, 0, vae=vae, references={"ref1": short, "ref3": two})


def test_guide_wiring_is_checked_at_queue_time(comfy):
    """H3 Add Guide / H3 Continuation Guide: an image and a video together, or nothing, was said only when the node
    ran, after the loaders and the text encoder above it."""
    for node in (comfy.conditioning.H3AddGuide, importlib.import_module("nodes.long_video").H3ContinuationGuide):
        check = node.validate_inputs
        assert check(input_types={"image": "IMAGE"}) is True
        assert check(input_types={"audio": "AUDIO", "video": "VIDEO"}) is True
        assert "not both" in check(input_types={"image": "IMAGE", "video": "VIDEO"})
        assert "connect at least one" in check(input_types={})
        assert "image takes IMAGE, got AUDIO" in check(input_types={"image": "AUDIO"})
    check = comfy.latent.H3VAEEncode.validate_inputs  # the same for H3 VAE Encode's clip
    assert check(input_types={"video": "VIDEO", "audio": "AUDIO"}) is True and check(input_types={"images": "IMAGE"})
    assert "one of them" in check(input_types={"video": "VIDEO", "images": "IMAGE"})
    assert "one of them" in check(input_types={"audio": "AUDIO"})
    assert "video takes VIDEO, got IMAGE" in check(input_types={"video": "IMAGE"})
    # and when they run (what switches give is known only then): the long video's guide reads its clip later
    guide = importlib.import_module("nodes.long_video").H3ContinuationGuide
    with pytest.raises(ValueError, match=r"^Connect an image or a video to one guide, not both\.$"):
        guide.execute(0, image=torch.rand(1, 64, 96, 3), video=object())


def test_av_save_wiring_is_checked_at_queue_time(comfy):
    """H3 AV Save runs last: images or a video (one of them), and its links' types, checked before anything runs."""
    check = comfy.output.H3AVSave.validate_inputs
    assert check(input_types={"images": "IMAGE", "audio": "AUDIO"}) is True
    assert check(input_types={"video": "VIDEO"}) is True
    assert "or a video, not both" in check(input_types={"images": "IMAGE", "video": "VIDEO"})
    assert "or a video, got neither" in check(input_types={"audio": "AUDIO"})
    assert "audio takes AUDIO, got IMAGE" in check(input_types={"images": "IMAGE", "audio": "IMAGE"})
    assert check(input_types={"images": "*"}) is True
    assert check(input_types={"images": "COMFY_MATCHTYPE_V3"}) is True  # a core switch node's output
    assert check(input_types={"images": "IMAGE,MASK"}) is True  # a union that overlaps, as ComfyUI takes it


def test_linked_numbers_are_checked_when_the_node_runs(comfy):
    """ComfyUI checks a linked number not at all, and validate_inputs sees None for it: the sampler, H3 Continuation
    and H3 Empty AV Latent check them before any model is placed (201 steps ran; 2.0 outputs failed in range() once
    the DiT was placed; Continuation read a seed of -1 only after the text encoder and the DiT were, and took 3.7 as
    3; a NaN window or frame count failed in int() with no name; a linked keep of 'both' got a message about it)."""
    c = comfy
    model, text, vae = _models(c)
    cond = _cond(c, text, vae).values[0]
    placed = len(c.record.loaded)
    sampler = c.sampler.H3Sampler.execute
    for options, message in ((dict(steps=201), r"^steps: Value 201 bigger than max of 200\."),
                             (dict(steps=4.5), r"^steps must be a whole number from 0 to 200; got 4\.5\."),
                             (dict(outputs=2.0 + 0.5), r"^outputs must be a whole number from 1 to 64; got 2\.5\."),
                             (dict(outputs="2"), r"^outputs must be a whole number from 1 to 64; got '2'\."),
                             (dict(denoise=float("nan")), r"^denoise must be a number from 0\.01 to 1\.0; got nan\."),
                             (dict(keep="both"), r"^Value not in list: keep: 'both' not in \['none', 'video', 'audio'\]"),
                             (dict(outputs=2.0, steps=3.0, seed=2**64 - 1), r"^seed must be an integer .* \(and seed \+ 1 "
                                                                            r"for 2 outputs\)")):  # 2.0 is taken as 2
        settings = {"seed": 0, "steps": 3, "video_shift": 0.0, "audio_shift": 0.0, **options}
        with pytest.raises(ValueError, match=message):
            sampler(model, cond, **settings)
    continuation = importlib.import_module("nodes.long_video").H3Continuation.execute
    base = dict(prompt="a fox", task="t2va", duration=20.0, mode="continuation", window_frames=277,
                overlap_frames=22, seed=0, steps=3, video_shift=0.0, audio_shift=0.0, aspect_ratio="auto", width=0,
                height=0)
    for options, message in ((dict(seed=-1), "seed must be an integer from 0"), (dict(seed=3.7), "seed must be an "
                             "integer from 0"), (dict(steps=1000), "steps: Value 1000 bigger than max of 200"),
                             (dict(window_frames=float("nan")), r"^window_frames must be a whole number .*; got nan"),
                             (dict(window_prompts=5), "window_prompts must be text")):
        with pytest.raises(ValueError, match=message):  # no model or text encoder is looked at first
            continuation(None, None, **{**base, **options})
    with pytest.raises(ValueError, match=r"^H3 Empty AV Latent: num_frames must be a whole number .*; got nan"):
        c.latent.H3EmptyAVLatent.execute(224, 128, float("nan"))
    assert len(c.record.loaded) == placed  # nothing was placed for any of them


def test_sampler_and_decode_settings_are_checked_at_queue_time(comfy):
    """Known before anything runs, so refused then (they failed after the text encoder ran, or after sampling):
    keep or denoise < 1 with no latent linked, seeds past the generator's range, a decode's devices. Naming them
    turns ComfyUI's own range, choice and link checks off for them: redone."""
    check = comfy.sampler.H3Sampler.validate_inputs
    linked = {"model": "H3_MODEL", "conditioning": "H3_COND"}
    fine = dict(seed=0, denoise=1.0, outputs=1, keep="none")
    assert check(input_types=linked, **fine) is True
    assert check(input_types={**linked, "latent": "H3_LATENT"}, **{**fine, "denoise": 0.5, "keep": "audio"}) is True
    assert "refines a latent" in check(input_types=linked, **{**fine, "denoise": 0.5})
    assert "keep = video holds the video of the connected latent" in check(input_types=linked, **{**fine, "keep": "video"})
    assert "seed must be an integer from 0 to 18446744073709551615 (and seed + 3 for 4 outputs)" in check(
        input_types=linked, **{**fine, "seed": 2**64 - 2, "outputs": 4})
    assert "outputs: Value 65 bigger than max of 64" in check(input_types=linked, **{**fine, "outputs": 65})
    # a linked seed or output count (None here) is checked with the other when the node runs
    assert check(input_types={**linked, "seed": "INT"}, **{**fine, "seed": None, "outputs": 64}) is True
    assert check(input_types={**linked, "outputs": "INT"}, **{**fine, "seed": 2**64 - 1, "outputs": None}) is True
    assert "denoise: Value 0.0 smaller than min of 0.01" in check(input_types=linked, **{**fine, "denoise": 0.0})
    assert "keep: 'both' not in" in check(input_types=linked, **{**fine, "keep": "both"})
    assert "latent takes H3_LATENT, got LATENT" in check(input_types={**linked, "latent": "LATENT"}, **fine)
    assert check(input_types=linked, seed=None, denoise=None, outputs=None, keep=None) is True  # linked values
    # one sigma point is no step (0 is automatic, 2 one model call); a shift by hand within the command line's range
    assert "steps counts sigma points including the final 0, so 2 is one model call; got 1" in check(
        input_types=linked, **fine, steps=1)
    assert check(input_types=linked, **fine, steps=0, video_shift=0.0, audio_shift=0.0) is True
    assert check(input_types=linked, **fine, steps=2, video_shift=0.01, audio_shift=100.0) is True
    assert "video_shift must be a number from 0.01 to 100, got 0.005 (0 = automatic)" in check(
        input_types=linked, **fine, video_shift=0.005)
    assert "steps: Value 201 bigger than max of 200" in check(input_types=linked, **fine, steps=201)
    continuation = importlib.import_module("nodes.long_video").H3Continuation.validate_inputs
    assert "so 2 is one model call; got 1" in continuation(input_types={}, task="t2va", steps=1)
    assert "audio_shift must be a number from 0.01" in continuation(input_types={}, task="t2va", audio_shift=0.001)
    # H3 Empty AV Latent's length without conditioning linked (its widget allows 1 for saved workflows)
    empty = comfy.latent.H3EmptyAVLatent.validate_inputs
    assert "H3 Empty AV Latent: " in empty(input_types={}, width=1344, height=768, num_frames=40)
    assert empty(input_types={}, width=1344, height=768, num_frames=124) is True
    assert empty(input_types={}, width=1344, height=768, num_frames=362) is True  # 15 s, the widget's max
    assert "num_frames: Value 363 bigger than max of 362" in empty(input_types={}, width=1344, height=768,
                                                                    num_frames=363)
    # a canvas and a length both wrong: the canvas is said (then the length, once it is mended)
    assert "width=100" in empty(input_types={}, width=100, height=768, num_frames=40)
    assert empty(input_types={"conditioning": "H3_COND"}, width=1344, height=768, num_frames=1) is True
    assert "num_frames: Value 0 smaller than min of 1" in empty(input_types={}, width=1344, height=768, num_frames=0)
    streamed = importlib.import_module("nodes.long_video").H3SaveMP4.validate_inputs
    for validate in (comfy.output.H3VAEDecode.validate_inputs, lambda **k: streamed(filename_prefix="H3/x", **k)):
        assert validate(devices="") is True and validate(devices=None) is True
        assert "'cuda0' is not a list of device names" in validate(devices="cuda0")
        assert "cpu alone is one device" in validate(devices="cpu")


def _tiny_vaes(root: Path) -> Path:
    """A release's two tiny VAEs under root/FL2VA."""
    from audio_vae_checkpoints import reference_audio_vae
    from audio_vae_checkpoints import write_original_partition as write_audio
    from video_vae_checkpoints import reference_video_vae, tiny_config
    from video_vae_checkpoints import write_original_partition as write_video

    config = tiny_config(seed=1)
    write_video(root, reference_video_vae(config, seed=2).state_dict(), config)
    write_audio(root, reference_audio_vae(seed=3))
    return root / "FL2VA"


def test_a_typed_folder_outside_the_model_folders_is_refused(comfy, tmp_path_factory, monkeypatch):
    """ComfyUI queues what any client sends: a folder box naming a path outside ComfyUI's model folders (or
    '..' out of them) is refused at queue time and at run time, before anything there is read, unless ComfyUI
    runs with H3_ALLOW_ANY_FOLDER=1. The loaders read any path before."""
    monkeypatch.delenv("H3_ALLOW_ANY_FOLDER", raising=False)
    outside = _tiny_vaes(tmp_path_factory.mktemp("elsewhere"))
    escaping = str(comfy.tmp / "vae" / ".." / ".." / outside.parent.name / "FL2VA")
    loaders = comfy.loaders
    for folder in (str(outside), escaping):
        for problem in (loaders.H3ModelLoader.validate_inputs(folder=folder),
                        loaders.H3VAELoader.validate_inputs(folder=folder),
                        loaders.H3TextEncoderLoader.validate_inputs(folder=folder),
                        loaders.H3TextEncoderLoader.validate_inputs(folder="", tokenizer_folder=folder)):
            assert "is outside ComfyUI's model folders" in problem and "H3_ALLOW_ANY_FOLDER=1" in problem, problem
        with pytest.raises(ValueError, match="is outside ComfyUI's model folders"):
            loaders.H3VAELoader.execute("tiny-random", "tiny-random", folder)
        with pytest.raises(ValueError, match="is outside ComfyUI's model folders"):
            loaders.H3ModelLoader.execute("tiny-random", folder, "fl2va", "bf16", "auto")
        with pytest.raises(ValueError, match="is outside ComfyUI's model folders"):
            loaders.H3TextEncoderLoader.execute("tiny-random", folder, "", "bf16")
        assert loaders.H3VAELoader.fingerprint_inputs(video_vae="tiny-random", audio_vae="tiny-random",
                                                      folder=folder) == ""
    assert comfy.record.freed == [] and comfy.record.loaded == []
    # '..' from a model folder to a path that exists out there and to one that does not: refused alike, naming the
    # path as typed (the refusal named the model folder's join where something existed there: what lay where)
    for leaf in ("FL2VA", "no-such-folder"):
        relative = os.path.relpath(outside.parent / leaf, comfy.tmp / "vae")
        problem = loaders.H3VAELoader.validate_inputs(folder=relative)
        assert problem.startswith(f"{relative!r} is outside ComfyUI's model folders"), problem
    # empty or linked boxes are fine at queue time
    assert loaders.H3ModelLoader.validate_inputs(folder="") is True
    assert loaders.H3TextEncoderLoader.validate_inputs(folder=None, tokenizer_folder=None) is True

    monkeypatch.setenv("H3_ALLOW_ANY_FOLDER", "1")  # the user's own machine: any path
    assert loaders.H3VAELoader.validate_inputs(folder=str(outside)) is True
    assert loaders.H3VAELoader.execute("tiny-random", "tiny-random", str(outside)).values[0].video is not None


def test_a_relative_folder_is_looked_for_in_the_model_folders(comfy, monkeypatch):
    """'FL2VA' typed into the VAE Loader's box is models/vae/FL2VA; a path inside the model folders loads."""
    monkeypatch.delenv("H3_ALLOW_ANY_FOLDER", raising=False)
    inside = _tiny_vaes(comfy.tmp / "vae")
    loaders = comfy.loaders
    assert loaders.H3VAELoader.validate_inputs(folder="FL2VA") is True
    vae = loaders.H3VAELoader.execute("tiny-random", "tiny-random", "FL2VA").values[0]
    assert vae.name == str(inside) and vae.video is not None
    assert vae.canvas == RELEASE_CANVAS  # a release's VAE encodes clips on the release's canvas
    assert loaders.H3VAELoader.fingerprint_inputs(video_vae="tiny-random", audio_vae="tiny-random",
                                                  folder="FL2VA") != ""
    # a release folder kept once, under diffusion_models: the same relative path in every loader (the VAE and
    # text encoder loaders looked only in their own folders, then called it outside the model folders)
    release = _tiny_vaes(comfy.tmp / "diffusion_models" / "MiniMax-H3")
    assert loaders.H3VAELoader.validate_inputs(folder="MiniMax-H3/FL2VA") is True
    assert loaders.H3VAELoader.execute("tiny-random", "tiny-random", "MiniMax-H3/FL2VA").values[0].name == str(release)
    assert loaders.H3TextEncoderLoader.validate_inputs(folder="MiniMax-H3/FL2VA", tokenizer_folder="") is True
    # a typo: not found where it was looked for (it was called outside the model folders, to be moved in)
    for problem in (loaders.H3VAELoader.validate_inputs(folder="MiniMax-H3/FL2VAX"),
                    loaders.H3ModelLoader.validate_inputs(folder="nope"),
                    loaders.H3TextEncoderLoader.validate_inputs(folder="", tokenizer_folder="nope/tokenizer")):
        assert re.fullmatch(r"'[\w/-]+' is in none of ComfyUI's model folders \(looked in .*\): check the name, or "
                            r"give its full path\.", problem), problem
        assert str(comfy.tmp / "vae") in problem and "H3_ALLOW_ANY_FOLDER" not in problem


def test_a_path_on_another_windows_drive_is_outside_the_model_folders(monkeypatch):
    """Windows paths on two drives have no common path (Python raises): such a path is outside, not an error."""
    import ntpath

    folders = importlib.import_module("nodes.model_folders")
    monkeypatch.setattr(folders.os, "path", ntpath)
    assert not folders._inside("D:\\models\\H3", "C:\\ComfyUI\\models")
    assert folders._inside("c:\\comfyui\\Models\\vae\\H3", "C:\\ComfyUI\\models")  # case does not matter there


def test_the_vae_loader_shows_its_read_and_stops_on_cancel(comfy):
    """The release's fp32 video VAE is 9.7 GiB: its read had no progress bar and could not be cancelled."""
    c = comfy
    _tiny_vaes(c.tmp / "vae")
    shown = len(c.record.progress)
    c.loaders.H3VAELoader.execute("tiny-random", "tiny-random", "FL2VA")
    assert len(c.record.progress) > shown + 2  # a bar over each VAE's tensors
    c.record.interrupt_after = len(c.record.progress) + 1
    with pytest.raises(c.memory.mm.InterruptProcessingException):
        c.loaders.H3VAELoader.execute("tiny-random", "tiny-random", "FL2VA")


def test_a_pasted_path_in_quotes_is_the_path(comfy, tmp_path):
    """Windows' "Copy as path" pastes "C:\\models\\H3" with its quotes: the loaders said no such folder."""
    folders = importlib.import_module("nodes.model_folders")
    assert [folders.clean_path(text) for text in ('"/m/H3"', " '/m/H3' ", '"/m/H3', '""', "/m/H3")] == \
        ["/m/H3", "/m/H3", '"/m/H3', "", "/m/H3"]
    assert folders.model_path("vae", "unused", f' "{tmp_path}" ') == str(tmp_path)
    vae = comfy.loaders.H3VAELoader.execute("tiny-random", "tiny-random", '  ""  ').values[0]  # nothing typed
    assert vae.video is not None and vae.canvas == TINY_CANVAS  # the tiny VAEs, and the tiny model's canvas
    model = comfy.loaders.H3ModelLoader.execute("tiny-random", ' "" ', "fl2va", "bf16", "auto").values[0]
    assert model.tiny  # the tiny model, not a folder named '""'
    encoder = comfy.loaders.H3TextEncoderLoader.execute("tiny-random", "''", "", "bf16").values[0]
    assert encoder is not None
    assert comfy.loaders.H3ModelLoader.fingerprint_inputs(checkpoint="tiny-random", folder='""') == ""


@pytest.mark.parametrize("prefix, problem", [
    ("H3/clip", None), ("H3/%date:yyyy%/clip", None), (None, None), ("x" * 200, None),
    ("", "names no file"), ("H3/", "names no file"), ("H3\\", "names no file"), ("  ", "names no file"),
    ("H3/" + "x" * 201, "file name is 201 bytes long; at most 200"), ("é" * 101, "202 bytes long"),
    ("H3/../clip", None), ("../clip", "leads outside ComfyUI's output folder"), ("H3/../../clip", "leads outside"),
    ("/tmp/clip", "an absolute path, or '..' past it"),
    ("..", "names no file"), ("H3/..", "names no file"), (".", "names no file"),  # '.._00001_.mp4', '._00001_.mp4'
    ("d" * 255 + "/clip", None),
    ("d" * 300 + "/clip", f"folder name '{'d' * 40}'... is 300 bytes long; a folder name holds at most 255."),
])
def test_a_save_prefix_is_checked_at_queue_time(comfy, prefix, problem):
    """An over-long name failed with an OSError only after sampling and decoding; an empty one wrote a hidden
    '._00001_.mp4'. None: a linked prefix, not known at queue time; the node checks it when it runs."""
    av_save = comfy.output.H3AVSave.validate_inputs(input_types={"images": "IMAGE"}, filename_prefix=prefix)
    streamed = importlib.import_module("nodes.long_video").H3SaveMP4.validate_inputs(filename_prefix=prefix)
    latent = importlib.import_module("nodes.latent_files").H3SaveLatent.validate_inputs(filename_prefix=prefix)
    for result in (av_save, streamed, latent):
        assert result is True if problem is None else problem in result
    if problem is not None:  # linked: the same message when the node runs, before it decodes or writes anything
        with pytest.raises(ValueError, match=re.escape(problem)):
            comfy.output.H3AVSave.execute(images=torch.rand(5, 64, 64, 3), filename_prefix=prefix)
        with pytest.raises(ValueError, match=re.escape(problem)):
            importlib.import_module("nodes.long_video").H3SaveMP4.execute(None, None, prefix)


def test_another_length_of_a_prompt_does_not_run_the_text_encoder_again(comfy):
    """H3 Conditioning with only the duration or canvas changed: the encoder remembers the prompt's states,
    so it is neither loaded nor run (with the real 32B encoder, a full prompt encode each time)."""
    c = comfy
    _, text, vae = _models(c)
    first = _cond(c, text, vae).values[0]
    before = len(c.record.loaded)
    longer = c.conditioning.H3Conditioning.execute(text, "a fox on a beach", "t2va", "1:1", 0, 0, 5.0, vae=vae).values[0]
    assert longer.num_frames > first.num_frames and longer.width == longer.height
    assert torch.equal(longer.text_states, first.text_states)  # remembered (a copy: each request owns its states)
    assert [names for names, _ in c.record.loaded[before:]] == [["H3 VAEs (tiny-random + tiny-random)"]]
    other = c.conditioning.H3Conditioning.execute(text, "a cat", "t2va", "auto", 0, 0, 4.0, vae=vae).values[0]
    assert not torch.equal(other.text_states, first.text_states)
    assert c.record.loaded[-1][0] == ["H3 text encoder (tiny-random)", "H3 VAEs (tiny-random + tiny-random)"]


def test_a_strength_change_does_not_read_the_lora_file_again(comfy, monkeypatch):
    """Changing only the strength re-ran H3 LoRA / Turbo Apply, which read the whole file again (a LoRA of
    the 33B DiT is up to a few GB). While the model ComfyUI keeps still holds the adapter it is reused; a file
    saved over under its name, or the other unknown_keys choice, is read again."""
    import os

    from lora_files import fused, random_spec, write_native

    from h3_core import lora as lora_module
    from h3_core.config import TINY_DIT

    c = comfy
    path = write_native(c.tmp / "loras" / "style.safetensors", fused(random_spec(TINY_DIT), block_diagonal=True),
                        prefix="diffusion_model.")
    reads = []
    monkeypatch.setattr(c.sampler, "load_lora", lambda *a, **k: reads.append(a[0]) or lora_module.load_lora(*a, **k))
    model = c.loaders.H3ModelLoader.execute("tiny-random", "", "fl2va", "bf16", "auto").values[0]
    first = c.sampler.H3LoRAApply.execute(model, "style.safetensors", 1.0).values[0]
    second = c.sampler.H3LoRAApply.execute(model, "style.safetensors", 0.5).values[0]
    assert len(reads) == 1 and second.loras[0][0] is first.loras[0][0] and second.loras[0][1] == 0.5
    c.sampler.H3LoRAApply.execute(model, "style.safetensors", 0.5, "warn")
    assert len(reads) == 2
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # saved over: read again
    c.sampler.H3LoRAApply.execute(model, "style.safetensors", 0.5)
    assert len(reads) == 3
    del first, second
    import gc

    gc.collect()  # nothing holds the adapters any more: nothing kept
    assert not c.sampler._read_loras


def test_two_savers_that_pick_one_name_keep_both_clips(comfy, monkeypatch):
    """ComfyUI counts the files in the output folder to name a save; an MP4 is written for minutes under a hidden name,
    so a second ComfyUI writing the same folder picked the same name and replaced the first clip when it finished.
    The name is now taken at once (an empty file), and a save whose name is taken moves on to the next."""
    import folder_paths

    pick = folder_paths.get_save_image_path
    monkeypatch.setattr(folder_paths, "get_save_image_path", lambda *args: (*pick(*args)[:2], 1, *pick(*args)[3:]))
    folder = Path(folder_paths.get_output_directory()) / "H3"
    folder.mkdir(exist_ok=True)
    (folder / "race_00001_.mp4").write_bytes(b"")  # another ComfyUI's clip, still being written
    saved = Path(comfy.output.H3AVSave.execute(torch.rand(5, 32, 48, 3), "H3/race").values[0][1])
    assert saved.name == "race_00002_.mp4" and (folder / "race_00001_.mp4").read_bytes() == b""
    with pytest.raises(ValueError, match="crf must be an integer"):  # a failed save leaves no placeholder behind
        comfy.output.H3AVSave.execute(torch.rand(5, 32, 48, 3), "H3/race", crf=99)
    assert sorted(p.name for p in folder.iterdir()) == ["race_00001_.mp4", "race_00002_.mp4"]
