"""The README's Python example runs as written, and the engine API refuses a bad request before loading."""

import re
import runpy
from pathlib import Path

import av
import pytest

from h3_core.pipeline import GenerateSettings, Request, RequestError, generate

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def streams(path: Path) -> tuple[str, int, int, str, int, int]:
    with av.open(str(path)) as container:
        (video,), (audio,) = container.streams.video, container.streams.audio
        frames = sum(1 for _ in container.decode(video=0))
        return video.codec_context.name, int(video.average_rate), frames, audio.codec_context.name, audio.rate, audio.channels


def test_readme_python_example_runs(tmp_path, monkeypatch, capsys):
    example, _ = readme_python_blocks()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "readme_example.py").write_text(example)  # run as a user's script would be (and no exec here:
    runpy.run_path(str(tmp_path / "readme_example.py"), run_name="__main__")  # the registry's checks flag it)
    shown = capsys.readouterr()
    printed, bars = shown.out.splitlines(), shown.err.splitlines()  # each drawing of a bar (\r splits too)
    assert all(any(line.startswith(f"{stage}: 100%") and f"| {count}/{count} " in line for line in bars)
               for stage, count in [("sample 1/1", 7), ("decode 1/1", 124)])  # a bar per stage, ended (in a log)
    assert "out/fox_py.mp4 7 (1, 24, 37, 8, 14) (2, 32, 207)" in printed
    assert printed[-2:] == ["out/rain.mp4 1", "out/city.mp4 1"]
    assert streams(tmp_path / "out/fox_py.mp4") == ("h264", 24, 124, "aac", 32000, 2)
    for name in ("rain", "city"):
        assert streams(tmp_path / f"out/{name}.mp4") == ("h264", 24, 107, "aac", 32000, 2)  # 4 s -> 17n+5 = 107 frames


def test_readme_step_by_step_example_runs_and_makes_what_generate_makes(tmp_path, monkeypatch, capsys):
    """The loaders take tiny-random, and the engine's steps called one by one give generate's latents."""
    import torch

    _, example = readme_python_blocks()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "steps.py").write_text(example)
    names = runpy.run_path(str(tmp_path / "steps.py"), run_name="__main__")
    assert capsys.readouterr().out.splitlines() == [f"step {step}/7" for step in range(1, 8)]
    assert streams(tmp_path / "rain_steps.mp4") == ("h264", 24, 107, "aac", 32000, 2)
    (result,) = generate(names["request"], model="tiny-random", settings=GenerateSettings(seed=1, steps=8),
                         out=tmp_path / "same.mp4")
    assert torch.equal(names["latents"].video, result.latents.video)
    assert torch.equal(names["latents"].audio, result.latents.audio)
    # one line, not the tensors (ComfyUI prints a failed node's inputs into the error it keeps in its history)
    assert re.fullmatch(r"Conditioning\(t2va, 224x128, 107 frames, \d+ rows \(\d+ text\)\)", repr(names["cond"]))


def test_bad_request_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    from h3_core import pipeline

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded for a bad request")

    monkeypatch.setattr(pipeline, "load_text_encoder_for", no_loading)
    with pytest.raises(RequestError, match="prompt"):
        generate(Request(task="t2va", prompt="  "), model="tiny-random", settings=GenerateSettings(steps=8),
                 out=tmp_path / "x.mp4")
    with pytest.raises(RequestError, match="fl2va"):
        generate(Request(task="t2va", prompt="a fox", first_image=tmp_path / "a.png"), model="tiny-random",
                 settings=GenerateSettings(steps=8), out=tmp_path / "x.mp4")
    assert not (tmp_path / "x.mp4").exists()
    from h3_core.long_video import LongVideoRequest
    from h3_core.pipeline import Job, generate_batch

    settings = GenerateSettings(steps=8)
    for bad, message in (({"task": "t2va", "prompt": "a fox"}, "generate takes a Request .* got dict"),
                         ("a fox", "generate takes a Request .* got str")):
        with pytest.raises(RequestError, match=message):
            generate(bad, model="tiny-random", settings=settings, out=tmp_path / "x.mp4")
    with pytest.raises(RequestError, match=r"generate_batch takes Jobs .* got Request \(job 1\)"):
        generate_batch([Request(task="t2va", prompt="a fox")], model="tiny-random", settings=settings)
    with pytest.raises(RequestError, match="A job's request is a Request .* got dict"):
        generate_batch([Job({"task": "t2va"}, out=tmp_path / "x.mp4")], model="tiny-random", settings=settings)
    windows = dict(window_frames=107, overlap_frames=22)
    with pytest.raises(RequestError, match="window_prompts is a list of prompts, one per window .*, got str."):
        generate(LongVideoRequest(Request(task="t2va", prompt="x", duration=9), window_prompts="A. B.", **windows),
                 model="tiny-random", settings=settings, out=tmp_path / "x.mp4")


def test_window_prompts_without_a_request_prompt_run(tmp_path):
    """A long video's window prompts may leave the request's prompt out (None), as its docstring says (a TypeError
    in the prompt-label check had stopped it)."""
    from h3_core.long_video import LongVideoRequest

    request = LongVideoRequest(Request(task="t2va", prompt=None, duration=9), window_frames=107, overlap_frames=22,
                               window_prompts=["A fox on a beach.", "The fox runs.", "The fox stops."])
    (result,) = generate(request, model="tiny-random", settings=GenerateSettings(steps=2), out=tmp_path / "w.mp4")
    assert result.latents.num_frames >= 9 * 24
    with av.open(str(tmp_path / "w.mp4")) as container:  # titled by the first window's prompt
        assert container.metadata.get("title") == "A fox on a beach."


@pytest.mark.parametrize("enabled", [True, False])
def test_the_tiny_text_encoder_leaves_transformers_progress_bars_as_it_found_them(enabled):
    from transformers.utils import logging as transformers_logging

    from h3_core.tiny_text import tiny_random_text_encoder

    (transformers_logging.enable_progress_bar if enabled else transformers_logging.disable_progress_bar)()
    try:
        tiny_random_text_encoder()
        assert transformers_logging.is_progress_bar_enabled() == enabled
    finally:
        transformers_logging.enable_progress_bar()  # transformers' default, for the tests after this one


def test_making_the_tiny_models_leaves_the_callers_random_sequence_alone():
    """Each module's constructor draws its default initialization from torch's global generator before the
    seeded values replace it: a script's torch.manual_seed sequence changed after a tiny-model generate()."""
    import torch

    from h3_core.tiny import tiny_random_audio_vae, tiny_random_dit, tiny_random_video_vae
    from h3_core.tiny_text import tiny_random_text_encoder

    for make in (tiny_random_dit, tiny_random_video_vae, tiny_random_audio_vae, tiny_random_text_encoder):
        torch.manual_seed(0)
        expected = torch.rand(4)
        torch.manual_seed(0)
        make()
        assert torch.equal(torch.rand(4), expected), make.__name__


def test_generate_reports_the_encoding_as_it_goes(tmp_path):
    """The "text encoder" stage stayed at (0, 1), and encoding a request's prompt, keyframes and references
    (tens of seconds for a video reference) reported nothing."""
    import numpy as np

    from h3_core.conditioning import Request
    from h3_core.pipeline import GenerateSettings, generate
    from h3_core.text_checkpoint import TEXT_ENCODER_LAYER

    seen = []
    first = np.full((128, 224, 3), 90, np.uint8)
    generate(Request("fl2va", "a fox", first_image=first, duration=4), "tiny-random", GenerateSettings(steps=2),
             save_latents=tmp_path / "fox.safetensors", progress=lambda stage, done, total: seen.append((stage, done, total)))
    assert ("text encoder", 1, 1) in seen
    encoding = [entry[1:] for entry in seen if entry[0] == "encode"]  # the prompt's encoder layers, then the keyframe
    assert sorted(set(encoding)) == [(done, TEXT_ENCODER_LAYER + 1) for done in range(TEXT_ENCODER_LAYER + 2)]
    from h3_core.guides import GuideMedia  # a guide clip (up to 362 frames) reported 17 frames at a time

    seen.clear()
    clip = np.full((40, 128, 224, 3), 90, np.uint8)  # its first 39 frames (17n + 5)
    generate(Request("t2va", "a fox", duration=4, guides=(GuideMedia(0, clip),)), "tiny-random",
             GenerateSettings(steps=2), save_latents=tmp_path / "guided.safetensors",
             progress=lambda stage, done, total: seen.append((stage, done, total)))
    assert [entry for entry in seen if entry[0].startswith("encode: guide")] == [
        ("encode: guide 1/1", 17, 39), ("encode: guide 1/1", 34, 39), ("encode: guide 1/1", 39, 39)]


def test_a_script_passing_the_wrong_thing_is_told_what_to_pass(tmp_path):
    """Wrong types and swapped arguments are refused naming what is wanted, before the work they would break
    (not a bare TypeError from int() or an AttributeError deep in a run)."""
    import numpy as np
    import torch
    from PIL import Image

    from h3_core.output import AVLatents
    from h3_core.pipeline import (TINY_CANVAS, Job, encode_request, generate_batch, load_audio_vae, load_dit,
                                  load_text_encoder, load_video_vae, sample, write_mp4)

    request = Request(task="t2va", prompt="Rain.", duration=4)
    for job, said in ((Job(request, out=tmp_path / "a.mp4", seed="x"), "seed must be an integer from 0"),
                      (Job(request, out=tmp_path / "a.mp4", seed=True), "seed must be an integer from 0"),
                      (Job(request, out=tmp_path / "a.mp4", outputs="2"), "outputs must be an integer of at least 1")):
        with pytest.raises(ValueError, match=said):
            generate_batch([job], "tiny-random", GenerateSettings())
    video_vae, audio_vae = load_video_vae("tiny-random"), load_audio_vae("tiny-random")
    text_encoder = load_text_encoder("tiny-random")
    with pytest.raises(TypeError, match=r"video_vae must be a vae_video.VideoVAE, got AudioVAE \(the VAEs swapped\?\)"):
        encode_request(request, text_encoder, audio_vae, video_vae, rules=TINY_CANVAS)
    from h3_core.long_video import LongVideoRequest

    for given, said in ((None, r"got NoneType\."), ({"task": "t2va"}, r"got dict\."),
                        (LongVideoRequest(request),
                         "got LongVideoRequest: encode_long_video encodes a LongVideoRequest")):
        with pytest.raises(RequestError, match=f"encode_request takes a Request, {said}"):
            encode_request(given, text_encoder, video_vae, audio_vae, rules=TINY_CANVAS)
    cond = encode_request(request, text_encoder, video_vae, audio_vae, rules=TINY_CANVAS)
    dit = load_dit("tiny-random")
    for kwargs, error, said in (({"seed": None}, ValueError, "seed must be an integer"),
                                ({"seed": True}, ValueError, "seed must be an integer"),
                                ({"seed": 1, "video_shift": "12"}, ValueError, "video_shift must be a number, got '12'")):
        with pytest.raises(error, match=said):
            sample(dit, cond, steps=2, **kwargs)
    with pytest.raises(TypeError, match="sample takes a Conditioning .from encode_request., got Request: encode the "
                                        "request first"):
        sample(dit, request, seed=1, steps=2)
    steps = []
    for kwargs, said in (({"init": torch.zeros(1, 24, 7, 8, 14)}, r"init takes AVLatents \(from sample, or "
                                                                  r"AVLatents\.load for a saved file\), got Tensor"),
                         ({"callback": 5}, "callback takes a function called with each step's state, got int")):
        with pytest.raises(TypeError, match=said):  # before the first step, not after it
            sample(dit, cond, seed=1, steps=2, **kwargs, **({} if "callback" in kwargs else {"callback": steps.append}))
    assert steps == []
    for load in (load_dit, load_text_encoder, load_video_vae, load_audio_vae):
        with pytest.raises(ValueError, match=r"'gpu': not a device name such as cpu, cuda or cuda:1"):
            load("tiny-random", device="gpu")
        with pytest.raises(ValueError, match=rf"cuda:{torch.cuda.device_count()} does not exist here: this machine "
                                             rf"has {torch.cuda.device_count()} CUDA device"):
            load("tiny-random", device=f"cuda:{torch.cuda.device_count()}")
        with pytest.raises(ValueError, match="device must be a device name such as 'cpu'.*got float"):
            load("tiny-random", device=1.5)
    ref2va = encode_request(Request("ref2va", "A fox.", references=[("image", Image.new("RGB", (96, 64)))],
                                    duration=4), text_encoder, video_vae, audio_vae, rules=TINY_CANVAS)
    with pytest.raises(RequestError, match="runs on the ref2va DiT; this one was loaded as the fl2va partition"):
        sample(dit, ref2va, seed=1, steps=2)  # the tiny DiT is labelled with its partition, as a read one is
    sample(load_dit("tiny-random", partition="ref2va"), ref2va, seed=1, steps=2)
    with pytest.raises(ValueError, match="dtype is a floating point torch dtype"):
        load_dit("tiny-random", dtype="bfloat16")
    with pytest.raises(ValueError, match="dtype is a floating point torch dtype"):
        load_text_encoder("tiny-random", dtype="fp16")
    latents = sample(dit, cond, seed=np.int64(1), steps=2)  # numpy's integers are seeds too
    with pytest.raises(TypeError, match=r"latents must be AVLatents \(from sample\), got str"):
        write_mp4(latents, str(tmp_path / "a.mp4"), video_vae, audio_vae)  # the design sketch's order
    with pytest.raises(TypeError, match="the VAEs swapped"):
        write_mp4(tmp_path / "a.mp4", latents, audio_vae, video_vae)
    with pytest.raises(ValueError, match=r"a.webm: the file is an MP4 \(H.264 \+ AAC\); name it .mp4"):
        write_mp4(tmp_path / "a.webm", latents, video_vae, audio_vae)
    for video, said in ((None, "got NoneType"), (latents.video.numpy(), r"got ndarray: torch\.from_numpy\(array\)")):
        with pytest.raises(ValueError, match=f"The video latents must be a torch tensor, {said}"):
            write_mp4(tmp_path / "a.mp4", AVLatents(video, latents.audio), video_vae, audio_vae)
    with pytest.raises(RequestError, match=r"A LongVideoRequest's request is a Request \(task, prompt, canvas, "
                                           r"duration\), got str"):
        LongVideoRequest("A fox.", mode="full")
    assert not list(tmp_path.iterdir())
    # arrays in a neighbouring layout are told the one step that fixes them
    from h3_core.references import DecodedAudio

    channels_last = DecodedAudio(np.zeros((64000, 2), np.float32), 32000)
    for kwargs, said in (
            ({"task": "fl2va", "first_image": torch.rand(1, 64, 96, 3)},
             r"got shape \(1, 64, 96, 3\) \(a batch of one: give image\[0\]\)"),
            ({"task": "fl2va", "first_image": torch.rand(3, 64, 96)}, r"channels first: give it permuted to \[H, W, 3\]"),
            ({"task": "ref2va", "references": [("image", Image.new("RGB", (96, 64))), ("audio", channels_last)]},
             r"got shape \(64000, 2\)\. Channels last \(\[samples, channels\], as soundfile reads it\)\? Pass it "
             r"transposed, waveform\.T")):
        with pytest.raises(ValueError, match=said):
            encode_request(Request(prompt="A fox.", duration=4, **kwargs), text_encoder, video_vae, audio_vae,
                           rules=TINY_CANVAS)
    # numbers of numpy's and torch's kinds are taken where Python's are
    from h3_core.conditioning import validate

    plan = validate(Request("ref2va", "A fox.", duration=torch.tensor(5),
                            references=[("image", Image.new("RGB", (96, 64))),
                                        ("audio", str(write_tone(tmp_path / "tone.wav")), np.float32(0.5))]),
                    TINY_CANVAS)
    assert plan.num_frames == 124 and plan.references[1].start_seconds == np.float32(0.5)


def write_tone(path):
    from wav_files import write_wav

    write_wav(path, 4.0)
    return path
