"""`h3 generate` refuses bad settings and unusable paths before any model loads, in one line naming the
option, and warns of prompt labels nothing in the request carries; an interrupt (Ctrl-C or SIGTERM) stops it
with a short message and no half-written file."""

import dataclasses
import os
import re
import signal

import pytest
import torch

from h3_core import cli, pipeline
from h3_core.cli import _reference, main
from h3_core.noise import MAX_SEED
from h3_core.prompt import control_token_warnings, label_warnings


@pytest.fixture
def no_model_loads(monkeypatch):
    for name in ("load_text_encoder_for", "load_vaes", "load_sampling_dit"):
        monkeypatch.setattr(pipeline, name, lambda *a, **k: pytest.fail("a model was loaded"))


@pytest.fixture
def files(tmp_path):
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "taken.mp4").mkdir()
    (tmp_path / "model.ckpt").write_bytes(b"\x80\x02}q\x00.")  # a pickle's first bytes
    (tmp_path / "junk.safetensors").write_bytes(os.urandom(64))
    (tmp_path / "lora.safetensors").write_bytes(b"")
    return tmp_path


@pytest.mark.parametrize("options, message", [
    (["--steps", "0"], "error: --steps counts sigma points .* integer from 2 to 1000; got 0"),
    (["--steps", "1000000000"], "steps counts sigma points .* integer from 2 to 1000; got 1000000000"),
    (["--video-shift", "0"], r"--video-shift must be a number from 0.01 to 100, got 0"),
    (["--video-shift", "1e39"], r"--video-shift must be a number from 0.01 to 100, got 1e\+39"),
    (["--audio-shift", "nan"], r"--audio-shift must be a number from 0.01 to 100, got nan"),
    (["--width", "8192", "--height", "4096"], "Canvas 8192x4096 is too large: each side is at most 4096 pixels"),
    (["--seed", str(MAX_SEED + 1)], f"seed must be an integer from 0 to {MAX_SEED}; got {MAX_SEED + 1}"),
    (["--seed", "-1"], "error: --seed must be an integer from 0"),
    (["--aspect-ratio", "5:4"], r"Unknown --aspect-ratio '5:4'; use one of 21:9, 16:9"),  # the option, not the field
    (["--aspect-ratio", "16:9", "--width", "512", "--height", "512"], r"Give either --aspect-ratio \('16:9'\) or"),
    (["--seed", str(MAX_SEED), "--outputs", "2"], r"\(and seed \+ 1 for 2 outputs\)"),
    (["--device", "bogus"], "'bogus': not a device name such as cpu, cuda or cuda:1"),
    (["--devices", "cpu,gpu"], r"^h3: error: 'gpu': not a device name such as cpu, cuda or cuda:1\.$"),
    (["--device", f"cuda:{torch.cuda.device_count()}"], "does not exist here: this machine has"),
    (["--devices", "cpu,cpu,cpu"], r"3 devices cannot split the model's 2 attention heads evenly \(each takes an equal "
                                   r"share\); use 2 devices\."),
    (["--gpu-memory", "-5"], "GPU memory budget must be a positive number of GiB, got -5"),
    (["--gpu-memory", "1e300"], r"GPU memory budget must be a positive number of GiB, got 1e\+300 \(at most 1,048,576\)"),
    (["--attention-window-dense-steps", "3"], "give the window too"),
    (["--out", "{tmp}/file.txt/clip.mp4"], "Cannot write .*file.txt/clip.mp4"),
    (["--out", "{tmp}/taken.mp4"], "taken.mp4 is a folder; give the output file's name"),
    (["--save-latents", "{tmp}/file.txt/l.safetensors"], "Cannot write .*l.safetensors"),
    (["--lora", "{tmp}/lora.safetensors:strong"], "the strength after ':' must be a number"),
    (["--model", ""], "--model is empty; give a model path, a Hub repo id or tiny-random"),
    (["--model", "{tmp}/model.ckpt"], r"model.ckpt is a pickle checkpoint \(.ckpt\); H3 loads only .safetensors"),
    (["--model", "{tmp}/junk.safetensors", "--text-encoder", "{tmp}/junk.safetensors", "--video-vae",
      "{tmp}/junk.safetensors", "--audio-vae", "{tmp}/junk.safetensors"],
     "junk.safetensors is not a readable safetensors file"),
    (["--model", "{tmp}/junk.safetensors", "--video-vae", "{tmp}/junk.safetensors"],
     r"Give --text-encoder, --audio-vae \(ComfyUI: a file from models/text_encoders, one from models/vae\)"),
])
def test_a_bad_setting_is_refused_before_any_model_loads(files, no_model_loads, capsys, options, message):
    argv = ["generate", "--prompt", "a fox", "--out", str(files / "o.mp4"), "--steps", "3"]
    assert main(argv + [option.format(tmp=files) for option in options]) == 2
    error = capsys.readouterr().err
    assert re.search(message, error), error
    assert error.startswith("h3: error: ") and "Traceback" not in error
    assert not (files / "o.mp4").exists()


def test_a_release_missing_a_part_names_the_option(tmp_path, tiny_config, no_model_loads, capsys):
    pytest.importorskip("diffusers", reason="the DiT folder is written by diffusers (the test extra)")
    from reference_checkpoints import reference_dit, write_diffusers_folder

    write_diffusers_folder(tmp_path / "release" / "transformer", reference_dit(tiny_config))
    argv = ["generate", "--prompt", "a fox", "--model", str(tmp_path / "release"), "--out", str(tmp_path / "o.mp4")]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert re.search(r"looked for under --model .*release; give --text-encoder where it is elsewhere", error), error


def test_a_hub_id_that_cannot_be_fetched_says_it_is_no_local_path_either(tmp_path, monkeypatch, capsys):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise ConnectionError("Name or service not known\nCheck your internet connection.")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "--prompt", "x", "--model", "models/MiniMax-H3", "--out", "o.mp4"]) == 2
    error = capsys.readouterr().err
    assert "--model models/MiniMax-H3: no such local path, and fetching it as a Hugging Face Hub repo failed " \
           "(ConnectionError: Name or service not known Check your internet connection.).\n" in error
    # what it set out to fetch, then why it could not (the download's size was only logged, unseen here)
    lines = error.splitlines()
    assert len(lines) == 2 and re.fullmatch(r"h3: fetching FL2VA/transformer, .* from models/MiniMax-H3 \(about "
                                            r"\d+ GiB, cached after\)", lines[0]), error


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_an_interrupt_stops_with_one_line(tmp_path, monkeypatch, capsys, stop):
    def interrupted(*args, **kwargs):
        if stop == "ctrl-c":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)  # main's handler turns it into the same unwinding
        pytest.fail("SIGTERM did not stop the run")

    monkeypatch.setattr(cli, "generate_batch", interrupted)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["generate", "--prompt", "x", "--out", str(tmp_path / "o.mp4")]) == 130
    assert signal.getsignal(signal.SIGTERM) is before  # the process's own handling comes back
    error = capsys.readouterr().err
    assert error == "h3: stopped; nothing more was written.\n"


def test_a_reference_file_may_hold_an_at_sign(tmp_path):
    photo = tmp_path / "photo@2x.png"
    photo.write_bytes(b"")
    assert _reference(f"image={photo}").source == photo and _reference(f"image={photo}").start_seconds == 0.0
    voice = _reference(f"audio={tmp_path}/take@1.wav@2.5")
    assert str(voice.source) == f"{tmp_path}/take@1.wav" and voice.start_seconds == 2.5
    with pytest.raises(ValueError, match="no such file, and the part after '@' is not a start time"):
        _reference(f"audio={tmp_path}/take@one.wav")


def test_a_home_folder_in_ref_and_guide_paths_is_expanded(tmp_path, monkeypatch):
    """No shell expands '~' after KIND= (nor in a --batch line): '0:video=~/g.mp4' was 'no such file'."""
    from h3_core.cli import _guide

    monkeypatch.setenv("HOME", str(tmp_path))
    assert _guide("0:video=~/g.mp4").path == tmp_path / "g.mp4"
    assert _reference("image=~/photo.png").source == tmp_path / "photo.png"
    assert _reference("audio=~/take.wav@1.5").source == tmp_path / "take.wav"


def test_a_bad_batch_line_is_said_without_the_usage_text(tmp_path, no_model_loads, capsys):
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"--prompt x --colour red --out {tmp_path}/a.mp4\n")
    assert main(["generate", "--batch", str(jobs)]) == 2
    error = capsys.readouterr().err
    assert "line 1: not the request options of an h3 generate command (unrecognized arguments: --colour red)" in error
    assert "usage:" not in error


def test_a_mistyped_option_is_said_by_its_command_with_the_one_meant(tmp_path, no_model_loads, capsys):
    """No abbreviations (--output was taken as --outputs, --step as --steps); an unknown option is said with the
    command's own usage and the option it is close to; --output is --out."""
    for options, said in ((["--promt", "x"], "unrecognized arguments: --promt x (did you mean --prompt?)"),
                          (["--prompt", "x", "--step", "8"],
                           "unrecognized arguments: --step 8 (did you mean --steps?)"),
                          (["--prompt", "x", "--colour", "red"], "unrecognized arguments: --colour red\n")):
        with pytest.raises(SystemExit) as stop:
            main(["generate", "--out", str(tmp_path / "a.mp4"), *options])
        error = capsys.readouterr().err
        assert stop.value.code == 2 and "usage: h3 generate" in error and f"h3 generate: error: {said}" in error + "\n"
    assert main(["generate", "--prompt", "x", "--output", str(tmp_path)]) == 2
    assert f"--out {tmp_path} is a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["info", "tiny-random", "--part", "fl2va"])
    assert "h3 info: error: unrecognized arguments: --part fl2va (did you mean --partition?)" in capsys.readouterr().err
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"--prompt x --step 8 --out {tmp_path}/b.mp4\n")  # a --batch line takes no abbreviation either
    assert main(["generate", "--batch", str(jobs)]) == 2
    assert ("line 1: not the request options of an h3 generate command (unrecognized arguments: --step 8 (did you "
            "mean --steps?))") in capsys.readouterr().err


def test_an_unquoted_prompt_is_said_with_how_to_quote_it(tmp_path, no_model_loads, capsys):
    """`--prompt a red fox` gives the prompt 'a' and two stray words: the error says to quote it, on the command
    line and on a --batch line alike."""
    hint = '(a prompt of several words goes in quotes: --prompt "a red fox runs")'
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "a", "red", "fox", "--out", str(tmp_path / "a.mp4")])
    assert f"h3 generate: error: unrecognized arguments: red fox {hint}" in capsys.readouterr().err
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"--prompt a red fox --out {tmp_path}/b.mp4\n")
    assert main(["generate", "--batch", str(jobs)]) == 2
    assert f"(unrecognized arguments: red fox {hint})" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["info", "tiny-random", "extra"])  # a command without a prompt says nothing of one
    assert capsys.readouterr().err.rstrip().endswith("h3 info: error: unrecognized arguments: extra")


def test_errors_name_the_options_not_the_engine_fields(tmp_path, no_model_loads, capsys):
    """The engine says first_image, references[0], 'the task' unless told otherwise; the command's requests name
    their parts by its options (a file named first_image.txt is left as it is)."""
    (tmp_path / "first_image.txt").write_text("not a picture")
    out = ["--prompt", "x", "--out", str(tmp_path / "a.mp4")]
    for options, said in (
            (["--ref", "image=a.png"], "t2va takes a prompt only: --first-image/--last-image are fl2va keyframes and "
                                       "references are ref2va (set --task to the one they are for)."),
            (["--task", "ref2va", "--ref", f"image={tmp_path}/first_image.txt"],
             "--ref #1 (image): first_image.txt is not an image Pillow can read"),
            (["--task", "fl2va", "--last-image", f"{tmp_path}/first_image.txt"],
             "--last-image: first_image.txt is not an image Pillow can read"),
            (["--duration", "30"], "The duration must be between 4 and 15 seconds, got 30.0 (longer clips are made "
                                   "window by window with --long-video)."),
    ):
        assert main(["generate", *out, *options]) == 2
        assert f"h3: error: {said}" in capsys.readouterr().err


def test_info_and_version_say_what_they_are(capsys):
    import dataclasses
    import json

    from h3_core.tiny import tiny_random_audio_vae, tiny_random_video_vae

    assert main(["info", "tiny-random"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert list(info) == ["dit", "text_encoder", "video_vae", "audio_vae"]  # all four, as for a release root
    assert all(part["origin"].startswith("tiny-random: made on the fly") for part in info.values())
    assert info["video_vae"]["config"] == json.loads(json.dumps(dataclasses.asdict(tiny_random_video_vae().config)))
    assert info["audio_vae"]["config"] == json.loads(json.dumps(dataclasses.asdict(tiny_random_audio_vae().config)))
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and re.fullmatch(r"h3 (\d+\.\d+\S*|\(not installed\))\n", capsys.readouterr().out)


def test_a_reference_started_past_its_end_says_so(tmp_path, no_model_loads, capsys):
    from PIL import Image
    from wav_files import write_wav

    Image.new("RGB", (96, 64)).save(tmp_path / "cat.png")
    write_wav(tmp_path / "voice.wav", 5.0)
    argv = ["generate", "--task", "ref2va", "--ref", f"image={tmp_path}/cat.png", "--ref",
            f"audio={tmp_path}/voice.wav@100", "--prompt", "x", "--out", str(tmp_path / "o.mp4")]
    assert main(argv) == 2
    assert "--ref #2 (audio) starts at 100 s, past its end (5.000 s long)" in capsys.readouterr().err
    argv[4] = f"image={tmp_path}/cat.png@5"  # named as the command line spells it, not the engine's start_seconds
    assert main(argv) == 2
    assert "--ref #1 is an image; @START applies to video and audio clips only" in capsys.readouterr().err


def test_prompt_labels_no_reference_carries_are_warned_of(tmp_path, monkeypatch, capsys):
    assert label_warnings("<Picture 1> waves at <Video 1>; <Audio 1> hums.", ["image", "video"]) == []
    assert label_warnings("<Picture 2> and <Image 1> sing <Audio 1>.", ["image"]) == [
        "the prompt names <Audio 1>, but the request carries no audio labels.",
        "the prompt names <Image 1>: the model's label for a picture is <Picture 1>.",
        "the prompt names <Picture 2>, but the request carries 1 picture label.",
    ]
    def stop(*args, **kwargs):
        raise ValueError("stopped before the text encoder")

    monkeypatch.setattr(pipeline, "load_text_encoder_for", stop)
    assert main(["generate", "--prompt", "<Picture 1> smiles.", "--out", str(tmp_path / "o.mp4")]) == 2
    error = capsys.readouterr().err
    assert "h3: warning: the prompt names <Picture 1>, but the request carries no picture labels." in error
    assert error.index("warning") < error.index("stopped before the text encoder")


def test_control_tokens_typed_into_a_prompt_are_warned_of(tmp_path, monkeypatch, capsys):
    """The tokenizer reads a typed <|im_end|> as its control token (the reference does the same), which the
    model never met inside a prompt: said, not refused. Vision markers are refused elsewhere, not warned."""
    from transformers import AutoTokenizer

    from h3_core.tiny_text import write_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(write_tokenizer(tmp_path / "tok")))
    ids = tokenizer("a fox<|im_end|>", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids  # one token, not the letters
    assert control_token_warnings("a fox <|vision_start|> and <Picture 1>") == []
    assert control_token_warnings("a fox<|im_end|><|endoftext|> runs <|im_end|>") == [
        "the prompt holds <|endoftext|>, <|im_end|>: the text encoder reads them as its own control token, not as "
        "words, and H3 never saw one inside a prompt."]

    def stop(*args, **kwargs):
        raise ValueError("stopped before the text encoder")

    monkeypatch.setattr(pipeline, "load_text_encoder_for", stop)
    assert main(["generate", "--prompt", "a fox<|im_end|>", "--out", str(tmp_path / "o.mp4")]) == 2
    assert "h3: warning: the prompt holds <|im_end|>: the text encoder reads it as its own" in capsys.readouterr().err
    # a long video's window prompts are what it samples: each checked, numbered
    assert main(["generate", "--long-video", "--duration", "20", "--window-prompt", "a fox", "--window-prompt",
                 "a fox<|im_end|>", "--out", str(tmp_path / "o.mp4")]) == 2
    assert "h3: warning: window prompt 2: the prompt holds <|im_end|>" in capsys.readouterr().err


def test_a_folder_or_a_file_that_is_no_media_is_said_as_such(tmp_path, capsys):
    """A folder given for a file was 'no such file'; a text file given as media gave FFmpeg's error number and
    function name, and not what is read."""
    folder, text = tmp_path / "clips", tmp_path / "notes.png"
    folder.mkdir()
    text.write_text("not a picture")
    for argv in (["encode", str(folder), "--out", str(tmp_path / "x.safetensors")],
                 ["denoise", "--text-states", str(folder), "--save-latents", str(tmp_path / "x.safetensors")],
                 ["generate", "--long-video", "--prompt", "x", "--continue-from", str(folder), "--out",
                  str(tmp_path / "x.mp4")]):
        assert main(argv) == 2
        assert f"{folder}: a folder, not a file." in capsys.readouterr().err, argv[0]
    assert main(["encode", str(text), "--out", str(tmp_path / "x.safetensors")]) == 2
    said = capsys.readouterr().err
    assert "notes.png: Invalid data found when processing input (corrupt, truncated or not a " \
           "media file: pictures, videos and sounds FFmpeg reads are taken)" in said
    assert "Errno" not in said and "avcodec" not in said


def test_an_empty_weight_file_is_named_wherever_it_is_read(tmp_path):
    """What an interrupted download leaves: every reader says which file and what it holds."""
    from h3_core.checkpoint import locate_dit
    from h3_core.lora import load_lora
    from h3_core.vae_video_checkpoint import locate_video_vae
    from h3_core.weights import CheckpointError

    empty = tmp_path / "minimax_h3_fl2va_bf16.safetensors"
    empty.write_bytes(b"")
    for read in (lambda: locate_dit(empty, "fl2va"), lambda: load_lora(empty), lambda: locate_video_vae(empty)):
        with pytest.raises(CheckpointError, match=r"minimax_h3_fl2va_bf16.safetensors is not a readable safetensors "
                                                  r"file \(.*; 0 bytes: an interrupted download"):
            read()
    (tmp_path / "dit.png").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"H3 DiT single files must be safetensors \(or GGUF, .gguf\)"):
        locate_dit(tmp_path / "dit.png", "fl2va")


def test_info_on_a_pickle_says_it_once(tmp_path, capsys):
    (tmp_path / "model.ckpt").write_bytes(b"\x80\x02}q\x00.")
    assert main(["info", str(tmp_path / "model.ckpt")]) == 2
    error = capsys.readouterr().err
    assert "holds no H3 model: model.ckpt is a pickle checkpoint" in error and error.count("is a pickle checkpoint") == 1


def test_the_engine_takes_paths_and_strings_alike(tmp_path):
    """generate() with the model as a Path and the outputs as str, several of them (numbered files)."""
    from pathlib import Path

    from h3_core.conditioning import Request
    from h3_core.pipeline import GenerateSettings, generate

    results = generate(Request("t2va", "a fox", duration=4), Path("tiny-random"), GenerateSettings(steps=2, outputs=2),
                       save_latents=str(tmp_path / "deep" / "fox.safetensors"))
    assert [r.latents_path for r in results] == [tmp_path / "deep" / f"fox_0000{i}.safetensors" for i in (0, 1)]
    assert all(path.is_file() for path in (r.latents_path for r in results))
    # checked against the tiny model's canvas, as a str names it (a given latent was held to the release's)
    (kept,) = generate(Request("t2va", "a fox", duration=4), Path("tiny-random"), GenerateSettings(steps=2),
                       save_latents=tmp_path / "kept.safetensors", given=results[0].latents, keep="video")
    assert torch.equal(kept.latents.video, results[0].latents.video)


def test_the_engine_refuses_what_it_would_ignore(tmp_path):
    import numpy as np

    from h3_core.conditioning import Request, RequestError, resolve_num_frames
    from h3_core.output import AVLatents
    from h3_core.pipeline import GenerateSettings, generate

    assert resolve_num_frames(np.float32(5)) == resolve_num_frames(torch.tensor(5.0)) == 124
    with pytest.raises(RequestError, match="The duration is a number of seconds, got '5'"):
        resolve_num_frames("5")
    request = Request("t2va", "a fox", duration=4)
    with pytest.raises(ValueError, match=r"shard_weights \(--shard-weights\) splits the DiT's weights over several devices; give two or more with devices \(--devices\)"):
        generate(request, "tiny-random", GenerateSettings(shard_weights=True), save_latents=tmp_path / "a.safetensors")
    clip = AVLatents(torch.zeros(1, 24, 27, 8, 14), torch.zeros(2, 32, 160))
    with pytest.raises(RequestError, match="keep .* and given .* go together"):
        generate(request, "tiny-random", GenerateSettings(steps=2), save_latents=tmp_path / "b.safetensors", given=clip)
    # a setting of the wrong type failed as a TypeError inside the run (or, for a float step count, was taken)
    for name, value, what in (("steps", 3.0, "an integer or None"), ("outputs", "2", "an integer"),
                              ("video_shift", "12", "a number or None"), ("gpu_memory", "8", "a number of GiB or None"),
                              ("loras", "a.safetensors", "a list of (file, strength) pairs"),
                              ("loras", [("a.safetensors",)], "a list of (file, strength) pairs"),
                              ("compile", "yes", "True or False"), ("lora_unknown_keys", "x", "'error' or 'warn'")):
        with pytest.raises(ValueError, match=re.escape(f"GenerateSettings.{name} must be {what}, got {value!r}.")):
            generate(request, "tiny-random", GenerateSettings(**{name: value}), save_latents=tmp_path / "c.safetensors")
    # references=None is no references (validate took it so; the prompt's label check then iterated None)
    (plain,) = generate(dataclasses.replace(request, references=None), "tiny-random", GenerateSettings(steps=2),
                        save_latents=tmp_path / "d.safetensors")
    assert plain.latents_path.is_file()


def test_sample_refuses_to_refine_pure_noise(tmp_path):
    """denoise < 1 walks the end of a ladder made for a partly noised latent: without one (init) the engine
    denoised pure noise from there, silently (the ComfyUI sampler node refused it; the engine did not)."""
    import numpy as np

    from h3_core.conditioning import Request, encode_request
    from h3_core.pipeline import TINY_CANVAS, sample
    from h3_core.tiny import tiny_random_dit
    from h3_core.tiny_text import tiny_random_text_encoder

    conditioning = encode_request(Request("t2va", "a fox", duration=4), tiny_random_text_encoder(), rules=TINY_CANVAS)
    with pytest.raises(ValueError, match="denoise 0.5 < 1 refines a given latent: pass it as init"):
        sample(tiny_random_dit(), conditioning, 0, steps=3, denoise=0.5)
    with pytest.raises(ValueError, match="an integer from 2 to"):
        sample(tiny_random_dit(), conditioning, 0, steps=3.0)
    # precomputed text states: a numpy array failed in the sampler ('no attribute to'), a width another model's
    # encoder gives as a matmul shape error inside the first forward
    request, tags = Request("t2va", "a fox", duration=4), torch.ones(5, dtype=torch.long)
    with pytest.raises(ValueError, match="text_states must be a floating point torch tensor .* got ndarray"):
        encode_request(request, text_states=np.zeros((1, 5, 48), np.float32), text_tags=tags, rules=TINY_CANVAS)
    narrow = encode_request(request, text_states=torch.zeros(1, 5, 40), text_tags=tags, rules=TINY_CANVAS)
    with pytest.raises(ValueError, match="text states are 40 wide, this DiT takes 48"):
        sample(tiny_random_dit(), narrow, 0, steps=3)


def test_h3_denoise_refuses_bad_files_and_durations_before_running(tmp_path, capsys):
    """The debug command `h3 denoise` checks like `h3 generate`: the duration range, an output it cannot write,
    text states that are not a safetensors file or hold no rows; each a one-line error, no traceback."""
    from safetensors.torch import save_file

    (tmp_path / "folder.safetensors").mkdir()
    (tmp_path / "junk.safetensors").write_bytes(os.urandom(64))
    save_file({"prompt_embeds": torch.zeros(1, 0, 48)}, str(tmp_path / "empty.safetensors"))
    save_file({f"blocks.{index}.weight": torch.zeros(1) for index in range(500)}, str(tmp_path / "model.safetensors"))
    out = ["--save-latents", str(tmp_path / "x.safetensors")]
    for argv, message in (
        (["--text-states", str(tmp_path / "model.safetensors"), *out],  # a model given by mistake: not every name
         r"model\.safetensors has no 'prompt_embeds' tensor \(it holds 500, e\.g\. 'blocks\.0\.weight', "
         r"'blocks\.1\.weight', 'blocks\.10\.weight'\): give a text encoder's output saved with 'prompt_embeds' "
         r"\[1, T, D\] \(text\.TextConditioning\.as_tensors\(\)\)\.\n$"),
        (["--model", "", *out], r"--model is empty; give a model path, a Hub repo id or tiny-random\."),
        (["--duration", "1e9", *out], r"The duration must be between 4 and 15 seconds, got 1000000000\.0 \(longer "
                                      r"clips are made window by window by `h3 generate --long-video`\)"),  # not here
        (["--video-shift", "1e39", *out], "--video-shift must be a number from 0.01 to 100"),
        (["--save-latents", str(tmp_path / "folder.safetensors")], "folder.safetensors is a folder"),
        (["--save-latents", ""], r"--save-latents must name a file such as clip.safetensors; got an empty name"),
        (["--text-states", str(tmp_path / "junk.safetensors"), *out], "junk.safetensors is not a readable safetensors"),
        (["--text-states", str(tmp_path / "empty.safetensors"), *out], r"must be \[1, T >= 1, \d+\] .* got \[1, 0, 48\]"),
    ):
        assert main(["denoise", "--steps", "2", *argv]) == 2, argv
        error = capsys.readouterr().err
        assert re.search(message, error) and "Traceback" not in error, error
    assert not (tmp_path / "x.safetensors").exists()
    assert main(["encode", str(tmp_path / "clip.mp4"), "--out", ""]) == 2  # argparse made "" the path "."
    assert "--out must name a file such as clip.safetensors; got an empty name" in capsys.readouterr().err
    # an unset shell variable ran the demo model on the user's clip
    assert main(["encode", str(tmp_path / "clip.mp4"), "--out", str(tmp_path / "x.safetensors"), "--model", ""]) == 2
    assert "--model is empty; give a model path, a Hub repo id or tiny-random" in capsys.readouterr().err
    # float8 states (no isfinite for them) are widened, as float8 latents are
    save_file({"prompt_embeds": torch.randn(1, 8, 48).to(torch.float8_e4m3fn)}, str(tmp_path / "fp8.safetensors"))
    assert main(["denoise", "--steps", "2", "--text-states", str(tmp_path / "fp8.safetensors"), *out]) == 0
    assert (tmp_path / "x.safetensors").is_file()


def test_an_adapter_for_another_model_size_is_refused_before_any_model_loads(tmp_path, no_model_loads, capsys):
    import dataclasses

    from lora_files import random_spec, write_diffusers

    from h3_core.config import TINY_DIT

    wider = dataclasses.replace(TINY_DIT, num_attention_heads=3, hidden_size=96, time_embed_hidden_dim=96)
    write_diffusers(tmp_path / "wider.safetensors", {"transformer": random_spec(wider)})
    argv = ["generate", "--prompt", "a fox", "--out", str(tmp_path / "o.mp4"), "--steps", "3",
            "--lora", str(tmp_path / "wider.safetensors")]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert re.search(r"h3: error: .*lora_B\.weight' of wider\.safetensors has 192 output rows", error), error


def test_nan_weights_stop_the_run_before_anything_is_saved(tmp_path, monkeypatch, capsys):
    """A damaged DiT (NaN weights) wrote NaN latents and exited 0 with --save-latents."""
    real = pipeline.tiny_random_dit

    def poisoned(*args, **kwargs):
        dit = real(*args, **kwargs)
        with torch.no_grad():
            dit.blocks[0].mlp.fc2.weight[0, 0] = float("nan")
        return dit

    monkeypatch.setattr(pipeline, "tiny_random_dit", poisoned)
    argv = ["generate", "--prompt", "a fox", "--duration", "4", "--steps", "2", "--device", "cpu",
            "--save-latents", str(tmp_path / "fox.safetensors"), "--out", str(tmp_path / "fox.mp4")]
    assert main(argv) == 1  # the run failed, not its options (2: a usage error), as a failed --batch job says
    error = capsys.readouterr().err
    assert "h3: error: Sampling gave NaN or infinite latents" in error and "Traceback" not in error
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("options, message", [
    (["--attention", "banana"], "Unknown attention backend 'banana'; choose one of auto, "),
    (["--lora", "{tmp}/missing.safetensors"], "LoRA file .*missing.safetensors does not exist"),
])
def test_a_hub_model_is_not_downloaded_for_a_run_refused_without_it(tmp_path, monkeypatch, no_model_loads, capsys,
                                                                    options, message):
    import huggingface_hub

    fetched = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, **kwargs: fetched.append(repo) or pytest.fail("the model was downloaded"))
    argv = ["generate", "--prompt", "a fox", "--model", "MiniMaxAI/MiniMax-H3", "--out", str(tmp_path / "o.mp4")]
    assert main(argv + [option.format(tmp=tmp_path) for option in options]) == 2
    assert re.search(message, capsys.readouterr().err) and fetched == []


def test_h3_denoise_checks_the_seed_and_text_states_before_reading_the_dit(tmp_path, tiny_config, monkeypatch, capsys):
    pytest.importorskip("diffusers", reason="the DiT folder is written by diffusers (the test extra)")
    from reference_checkpoints import reference_dit, write_diffusers_folder
    from safetensors.torch import save_file

    write_diffusers_folder(tmp_path / "ckpt" / "transformer", reference_dit(tiny_config))
    from h3_core import pipeline

    monkeypatch.setattr(cli, "load_sampling_dit", lambda *a, **k: pytest.fail("the DiT was read"))
    for name in ("DiTReader", "tiny_random_dit"):
        monkeypatch.setattr(pipeline, name, lambda *a, **k: pytest.fail("the DiT was read"))
    save_file({"prompt_embeds": torch.zeros(1, 5, 47)}, str(tmp_path / "narrow.safetensors"))
    save_file({"prompt_embeds": torch.zeros(1, 5, 48), "text_token_tags": torch.ones(4, dtype=torch.long)},
              str(tmp_path / "tags.safetensors"))
    save_file({"prompt_embeds": torch.zeros(1, 2, 48), "text_token_tags": torch.tensor([1.0, 7.5])},
              str(tmp_path / "values.safetensors"))
    nan = torch.zeros(1, 3, 48)
    nan[0, 1, 7] = float("nan")  # found only after every step, blamed on the DiT's weights, before
    save_file({"prompt_embeds": nan}, str(tmp_path / "nan.safetensors"))
    save_file({"prompt_embeds": torch.zeros(1, 3, 48, dtype=torch.int32)}, str(tmp_path / "ints.safetensors"))
    real = ["--model", str(tmp_path / "ckpt"), "--text-states"]
    for argv, message in (
        (["--seed", str(MAX_SEED + 1)], f"seed must be an integer from 0 to {MAX_SEED}; got {MAX_SEED + 1}"),
        ([*real, str(tmp_path / "narrow.safetensors")], r"'prompt_embeds' must be \[1, T >= 1, 48\] for this model, "
                                                        r"got \[1, 5, 47\]"),
        ([*real, str(tmp_path / "tags.safetensors")], r"'text_token_tags' must be \[T\] = \[5\] .* got \[4\]"),
        ([*real, str(tmp_path / "values.safetensors")], r"values.safetensors: 'text_token_tags' hold 1 \(text\) or 0 "
                                                        r"\(rows of a vision block\), got 7.5\."),
        ([*real, str(tmp_path / "nan.safetensors")], r"nan.safetensors: 'prompt_embeds' must hold finite "
                                                     r"floating-point values, got torch.float32 with NaN or infinite"),
        ([*real, str(tmp_path / "ints.safetensors")], r"'prompt_embeds' must hold finite floating-point values, got "
                                                      r"torch.int32\."),
        (["--attention-window-dense-steps", "3"], "give the window too"),
        (["--attention-window-lossy", "1", "--attention-window-dense-steps", "1"],
         r"1 dense steps keep full attention for all 1 model calls .*\(--attention-window-dense-steps\)"),
        (["--width", "256", "--height", "128", "--aspect-ratio", "1:1"], r"Give either --aspect-ratio \(1:1\) or "
                                                                         r"--width and --height \(256x128\), not both"),
        (["--aspect-ratio", "auto"], r"h3 denoise --aspect-ratio is one of 21:9, 16:9, .* \(or give --width and --height\); "
                                     r"got 'auto'"),  # generate's auto, in Python's words ("a (width, height) pair")
    ):
        assert main(["denoise", "--steps", "2", *argv, "--save-latents", str(tmp_path / "x.safetensors")]) == 2, argv
        error = capsys.readouterr().err
        assert re.fullmatch(f"h3: error: .*{message}.*\n", error), error
    with pytest.raises(SystemExit):
        main(["denoise", "--help"])
    assert "noise seed, 0 to 2^64-1" in capsys.readouterr().out


def test_progress_written_to_a_log_is_not_redrawn_ten_times_a_second(capsys, monkeypatch):
    import itertools

    import tqdm.std

    from h3_core.stage_bars import StageBars

    clock = itertools.count(0.0, 0.05)  # tqdm's clock: each reading 50 ms on
    monkeypatch.setattr(tqdm.std, "time", lambda: next(clock))
    bars = StageBars()
    for done in range(1, 1001):  # a minute or two of steps, into a log (stderr is not a terminal here)
        bars("sample 1/1", done, 1000)
    bars.close()
    assert capsys.readouterr().err.count("\r") <= 12  # every 30 s, not hundreds of redraws


def logged_lines(err: str) -> list[str]:
    """Each line of stderr written to a log as a reader sees it: a bar redrawn after a carriage return, its last
    drawing."""
    return [line.split("\r")[-1] for line in err.split("\n")[:-1]]


def test_each_stage_written_to_a_log_ends_with_a_line_of_its_own(capsys):
    """A stage shorter than 30 s was drawn at 0% and then blanked (a terminal's closing), so a log showed no
    end to it (found by the progress review)."""
    from h3_core.stage_bars import StageBars

    bars = StageBars()
    bars("read DiT", 0, 10)
    bars("read DiT", 10, 10)
    bars("sample 1/1", 4, 4)
    bars.close()
    lines = logged_lines(capsys.readouterr().err)
    assert [line.split("|")[0] for line in lines] == ["read DiT: 100%", "sample 1/1: 100%"]
    assert "10/10" in lines[0] and "4/4" in lines[1]


def test_a_stage_met_again_gets_a_bar_again(capsys):
    """A stage named again after another began (the DiT read anew after a worker failed) updated a closed bar,
    which shows nothing (found by the progress review)."""
    from h3_core.stage_bars import StageBars

    bars = StageBars()
    bars("read DiT", 0, 10)
    bars("sample 1/1", 1, 4)
    bars("read DiT", 3, 10)
    assert not bars.bars["read DiT"].disable and bars.bars["read DiT"].n == 3 and list(bars.bars) == ["read DiT"]
    bars.close()
    lines = [line.split("|")[0] for line in logged_lines(capsys.readouterr().err)]
    assert lines == ["read DiT:   0%", "sample 1/1:  25%", "read DiT:  30%"]  # drawn again (a closed bar draws nothing)


def test_generate_help_is_grouped_and_gives_the_ranges(capsys):
    """48 options were one list, without the ranges the refusals name."""
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    shown = capsys.readouterr().out
    headings = ["models: --model, or the files that are not under it:", "the request:",
                "long video, and clips of yours:", "sampling:", "outputs:", "devices, speed and memory:", "many requests:"]
    assert [shown.index(heading) for heading in headings] == sorted(shown.index(heading) for heading in headings)
    assert "--steps N" in shown and "2-1000" in shown and shown.count("0.01-100") == 2 and "--out MP4" in shown


def test_compile_that_cannot_work_here_says_to_drop_it(tmp_path, monkeypatch, capsys):
    """No C++ compiler (or Triton): Inductor fails at the first step; one line naming --compile, no traceback.
    Any other error of the run is not taken for it."""
    from torch._inductor.exc import InductorError

    def compiled(error):
        def forward(*args, **kwargs):
            raise error
        return lambda function, **options: forward

    argv = ["generate", "--prompt", "a fox", "--duration", "4", "--steps", "2", "--compile",
            "--save-latents", str(tmp_path / "fox.safetensors")]
    monkeypatch.setattr(torch, "compile", compiled(InductorError(RuntimeError("No working C++ compiler found"), None)))
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert re.search(r"h3: error: --compile: torch.compile cannot build the DiT's blocks here \(RuntimeError: No "
                     r"working C\+\+ compiler found\); drop --compile", error), error
    assert "Traceback" not in error and not (tmp_path / "fox.safetensors").exists()
    monkeypatch.setattr(torch, "compile", compiled(RuntimeError("a bug of ours")))
    with pytest.raises(RuntimeError, match="a bug of ours"):
        main(argv)


def test_a_guide_counted_from_the_end_needs_no_equals_sign(tmp_path, no_model_loads, capsys):
    """`--guide -1:image=c.png` (as written after other options, on the command line or a batch line) is the guide,
    not argparse's 'expected one argument'; `h3 info ''` names what it takes."""
    missing = tmp_path / "c.png"
    assert main(["generate", "--prompt", "a fox", "--out", str(tmp_path / "o.mp4"), "--guide", f"-1:image={missing}"]) == 2
    error = capsys.readouterr().err
    assert "expected one argument" not in error and re.search(r"c\.png", error), error
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"--prompt x --out {tmp_path / 'o.mp4'} --guide -1:image={missing}\n")
    assert main(["generate", "--batch", str(jobs)]) == 2
    error = capsys.readouterr().err
    assert "line 1" in error and "not the request options" not in error and "c.png" in error, error
    assert main(["info", " "]) == 2
    assert capsys.readouterr().err == ("h3: error: h3 info takes a path: a release root, a partition or diffusers "
                                       "folder, or a model file.\n")


def test_a_path_that_spells_a_field_is_shown_as_typed(tmp_path, monkeypatch, no_model_loads, capsys):
    """The engine's field names (aspect_ratio, start_seconds, window_frames; seed opening a message) become the
    options' names, but not inside what the user typed: a file aspect_ratio.png was shown as --aspect-ratio.png."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "seed 1.txt").write_text("not a model")
    (tmp_path / "clip.mp4").write_bytes(b"its name is refused first")
    for argv, said in (
            (["generate", "--task", "fl2va", "--prompt", "x", "--first-image", "aspect_ratio.png", "--save-latents",
              "o.safetensors"], "--first-image: no file at aspect_ratio.png."),
            (["generate", "--task", "ref2va", "--prompt", "x", "--ref", "video=./takes/start_seconds.mp4@1",
              "--save-latents", "o.safetensors"], "--ref #1 (video): no file at takes/start_seconds.mp4."),
            (["info", "window_frames"], "window_frames holds no H3 model: window_frames does not exist."),
            (["info", "seed 1.txt"], "seed 1.txt holds no H3 model."),
            (["generate", "--prompt", "x", "--aspect-ratio", "7:3", "--out", "aspect_ratio.mp4"],  # still the option
             "Unknown --aspect-ratio '7:3'"),
            (["generate", "--prompt", "x", "--out", "a.mp4", "--video-shift", "0"],  # not "video_shift (--video-shift)"
             "--video-shift must be a number from 0.01 to 100, got 0.0."),
            (["encode", "clip.mp4", "--out", "clip.mp4"], "--out clip.mp4 must end in .safetensors."),
            (["encode", "clip.mp4", "--out", str(tmp_path)], f"--out {tmp_path} is a folder; give the output file's "
                                                              "name.")):
        assert main(argv) == 2, argv
        error = capsys.readouterr().err
        assert error.startswith(f"h3: error: {said}"), error
