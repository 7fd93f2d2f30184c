"""The `h3` command: the README's main command, determinism, real-checkpoint path and errors."""

import json
import re
import shlex
from pathlib import Path

import av
import pytest
import torch
from reference_checkpoints import reference_dit, write_diffusers_folder
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from h3_core.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_main_command() -> list[str]:
    line = next(line for line in README.read_text().splitlines() if line.startswith("h3 generate --prompt"))
    return shlex.split(line)[1:]


def with_option(argv: list[str], option: str, value: str) -> list[str]:
    argv = list(argv)
    argv[argv.index(option) + 1] = value
    return argv


def test_readme_main_command_runs(tmp_path, capsys):
    out = tmp_path / "fox.mp4"
    argv = with_option(readme_main_command(), "--out", str(out)) + ["--save-latents", str(tmp_path / "fox.safetensors")]
    assert main(argv) == 0
    with av.open(str(out)) as container:
        (video,), (audio,) = container.streams.video, container.streams.audio
        assert video.codec_context.name == "h264" and video.average_rate == 24
        assert audio.codec_context.name == "aac" and audio.rate == 32000 and audio.channels == 2
        assert sum(1 for _ in container.decode(video=0)) == 124  # 5 s -> 17n+5 = 124 frames
    tensors = load_file(str(tmp_path / "fox.safetensors"))
    assert tensors["video"].shape[:3] == (1, 24, 37) and tensors["audio"].shape == (2, 32, 207)
    summary = capsys.readouterr().out
    assert re.search(r"fox.mp4: t2va, seed 0, 124 frames at 224x128; encode .*sample .*decode .*peak", summary)


def test_denoise_runs_from_text_states_alone(tmp_path, capsys):
    out = tmp_path / "latents.safetensors"
    argv = ["denoise", "--width", "256", "--height", "160", "--steps", "4", "--save-latents", str(out)]
    assert main(argv) == 0
    tensors = load_file(str(out))
    # 256x160, 5 s -> 124 frames -> 37 latent frames of 10x16 latents; 207 audio latents per channel.
    assert tensors["video"].shape == (1, 24, 37, 10, 16)
    assert tensors["audio"].shape == (2, 32, 207)
    assert torch.isfinite(tensors["video"]).all() and torch.isfinite(tensors["audio"]).all()
    with safe_open(str(out), "pt") as handle:
        assert handle.metadata()["frames"] == "124"
    assert re.search(r"256x160, 124 frames; load .*denoise .*peak", capsys.readouterr().out)


def test_denoise_on_tiny_random_takes_generates_small_canvas(tmp_path, capsys):
    assert main(["denoise", "--steps", "2", "--save-latents", str(tmp_path / "l.safetensors")]) == 0
    assert "224x128, 124 frames" in capsys.readouterr().out


def test_seed_decides_the_result(tmp_path):
    base = ["denoise", "--width", "128", "--height", "64", "--duration", "5", "--steps", "3"]
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        assert main(base + ["--seed", str(seed), "--save-latents", str(tmp_path / f"{name}.safetensors")]) == 0
    a, b, c = (load_file(str(tmp_path / f"{n}.safetensors")) for n in "abc")
    assert torch.equal(a["video"], b["video"]) and torch.equal(a["audio"], b["audio"])
    assert not torch.equal(a["video"], c["video"])


def test_denoise_from_a_checkpoint_with_text_states(tmp_path, tiny_config, capsys):
    write_diffusers_folder(tmp_path / "transformer", reference_dit(tiny_config))
    save_file({"prompt_embeds": torch.randn(1, 5, 48), "text_token_tags": torch.tensor([1, 0, 0, 1, 1])},
              str(tmp_path / "prompt.safetensors"))
    out = tmp_path / "out.safetensors"
    argv = ["denoise", "--model", str(tmp_path), "--text-states", str(tmp_path / "prompt.safetensors"),
            "--width", "96", "--height", "64", "--steps", "3", "--save-latents", str(out)]
    assert main(argv) == 0
    assert load_file(str(out))["video"].shape == (1, 24, 37, 4, 6)
    # two of its rows are a picture's (tag 0): t2va runs without the picture, and says so
    assert "h3: warning: the text states hold 2 rows of pictures" in capsys.readouterr().err


def test_info_describes_a_checkpoint(tmp_path, tiny_config, capsys):
    write_diffusers_folder(tmp_path / "transformer", reference_dit(tiny_config))
    assert main(["info", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report) == ["dit"]  # a transformer folder: the DiT alone
    dit = report["dit"]
    assert dit["naming"] == "diffusers" and dit["config"]["hidden_size"] == 64
    assert dit["files"] > 1 and "F32" in dit["gib_by_dtype"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["denoise", "--model", "{ckpt}", "--save-latents", "{out}"], "needs --text-states"),
        (["denoise", "--width", "256", "--save-latents", "{out}"], "--width and --height go together"),
        (["denoise", "--width", "250", "--height", "128", "--save-latents", "{out}"], "multiple"),
        (["denoise", "--aspect-ratio", "5:1", "--save-latents", "{out}"], "one of 21:9, 16:9, 4:3, 1:1, 3:4, 9:16"),
        (["denoise", "--steps", "1", "--save-latents", "{out}"], "sigma points"),
        (["denoise", "--save-latents", "{tmp}/x.pt"], ".safetensors"),
        (["info", "{tmp}/nothing-here"], "does not exist"),
        (["generate", "--prompt", "x", "--model", "{tmp}/nowhere", "--out", "{tmp}/o.mp4"], "not an existing path"),
        (["generate", "--prompt", "x", "--model", "{tmp}", "--out", "{tmp}/o.mp4"], "not an H3 DiT checkpoint"),
        (["generate", "--prompt", "x"], "Give --out"),
        (["generate", "--prompt", "x", "--out", "{tmp}/o.mov"], "must end in .mp4"),
        (["generate", "--prompt", "", "--out", "{tmp}/o.mp4"], "prompt"),
        (["generate", "--prompt", "x", "--duration", "40", "--out", "{tmp}/o.mp4"], "15"),
        (["generate", "--prompt", "x", "--task", "ref2va", "--ref", "picture={tmp}/a.png", "--out", "{tmp}/o.mp4"], "KIND=PATH"),
        (["generate", "--prompt", "x", "--task", "ref2va", "--ref", "image={tmp}/missing.png", "--out", "{tmp}/o.mp4"], "no file"),
        (["generate", "--prompt", "x", "--task", "fl2va", "--out", "{tmp}/o.mp4"], "image"),
        (["generate", "--prompt", "x", "--outputs", "0", "--out", "{tmp}/o.mp4"], "at least 1"),
        (["generate", "--prompt", "x", "--outputs", "100000000", "--out", "{tmp}/o.mp4"], "at most 10000, got 100000000"),
        (["generate", "--prompt", "x", "--reference-images", "canvas-lossy", "--out", "{tmp}/o.mp4"],
         "--reference-images canvas-lossy sizes ref2va's image references; a t2va request has none: drop it."),
        (["generate", "--prompt", "x", "--guide", "60=image={tmp}/a.png", "--out", "{tmp}/o.mp4"], "FRAME:KIND=PATH"),
        (["generate", "--prompt", "x", "--guide", "60:image={tmp}/missing.png", "--out", "{tmp}/o.mp4"], "no such file"),
        (["generate", "--prompt", "x", "--long-video", "--duration", "20", "--guide", "500:image={tmp}/missing.png",
          "--out", "{tmp}/o.mp4"], "the image guide at frame 500"),
    ],
)
def test_bad_input_is_a_clear_error(tmp_path, tiny_config, capsys, argv, message):
    write_diffusers_folder(tmp_path / "ckpt" / "transformer", reference_dit(tiny_config))
    fill = {"ckpt": str(tmp_path / "ckpt"), "out": str(tmp_path / "o.safetensors"), "tmp": str(tmp_path)}
    assert main([a.format(**fill) for a in argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o.safetensors").exists() and not (tmp_path / "o.mp4").exists()


def test_generate_with_guides_from_files(tmp_path, capsys):
    """--guide: an image at frame 50 and a sound from frame 10 change the clip; a frame past the end is
    refused before any model loads."""
    from PIL import Image

    image, sound = tmp_path / "frame.png", tmp_path / "voice.wav"
    Image.fromarray((torch.rand(90, 160, 3) * 255).byte().numpy()).save(image)
    with av.open(str(sound), "w") as container:
        stream = container.add_stream("pcm_s16le", rate=32000, layout="stereo")
        frame = av.AudioFrame.from_ndarray((torch.randn(1, 2 * 32000) * 3000).short().numpy(), format="s16",
                                           layout="stereo")
        frame.sample_rate = 32000
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    base = ["generate", "--prompt", "A fox.", "--steps", "3", "--duration", "4"]
    plain, guided = tmp_path / "plain.safetensors", tmp_path / "guided.safetensors"
    assert main([*base, "--save-latents", str(plain)]) == 0
    assert main([*base, "--guide", f"50:image={image}", "--guide", f"10:audio={sound}",
                 "--save-latents", str(guided)]) == 0
    a, b = load_file(plain), load_file(guided)
    assert a.keys() == b.keys() and not torch.equal(a["video"], b["video"]) and not torch.equal(a["audio"], b["audio"])
    capsys.readouterr()
    assert main([*base, "--guide", f"107:image={image}", "--save-latents", str(tmp_path / "x.safetensors")]) == 2
    assert "--guide FRAME 107 is outside the video's 107 frames" in capsys.readouterr().err  # the option, not a field
    assert not (tmp_path / "x.safetensors").exists()


def test_generate_with_a_turbo_lora_takes_its_schedule(tmp_path, capsys):
    from lora_files import random_spec, write_peft

    from h3_core.config import TINY_DIT

    turbo = write_peft(tmp_path / "minimax_h3_fl2v_turbo_4step_v1.1_768p_bf16.safetensors", random_spec(TINY_DIT, rank=4))
    out = tmp_path / "turbo.safetensors"
    argv = ["generate", "--prompt", "A fox.", "--lora", f"{turbo}:0.8", "--save-latents", str(out)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "sampler: 5 sigma points (4 model calls), video shift 6, audio shift 3" in err  # the 4-step 768p contract (h3-model.md H.3)
    assert "strength 0.8" in err
    plain = tmp_path / "plain.safetensors"
    assert main(["generate", "--prompt", "A fox.", "--steps", "5", "--video-shift", "6", "--save-latents", str(plain)]) == 0
    # Same schedule and seed, with and without the adapter: the adapter changed the result.
    assert not torch.equal(load_file(str(out))["video"], load_file(str(plain))["video"])


def test_a_lora_with_stray_keys_is_refused_unless_told_to_warn(tmp_path, capsys):
    from lora_files import random_spec, write_peft

    from h3_core.config import TINY_DIT

    lora = write_peft(tmp_path / "style.safetensors", random_spec(TINY_DIT, rank=4))
    tensors = load_file(str(lora))
    tensors["transformer_blocks.0.attn.to_qq.lora_A.default.weight"] = torch.zeros(4, 64)
    save_file(tensors, str(lora))
    argv = ["generate", "--prompt", "A fox.", "--steps", "3", "--lora", str(lora), "--save-latents",
            str(tmp_path / "out.safetensors")]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "to_qq" in error and "(h3 generate --lora-unknown-keys warn;" in error
    assert main(argv[:1] + ["--lora-unknown-keys", "warn"] + argv[1:]) == 0
    assert "NOT LOADED" in capsys.readouterr().err


def test_generate_refuses_a_ref2va_turbo_on_t2va_before_loading(tmp_path, capsys):
    from lora_files import random_spec, write_peft

    from h3_core.config import TINY_DIT

    turbo = write_peft(tmp_path / "minimax_h3_ref2v_turbo_4step_v0.1_bf16.safetensors", random_spec(TINY_DIT, rank=4))
    assert main(["generate", "--prompt", "A fox.", "--lora", str(turbo), "--out", str(tmp_path / "o.mp4")]) == 2
    err = capsys.readouterr().err
    assert "ref2va" in err and "text encoder" not in err  # refused before any model loaded


def test_generate_decodes_with_the_chosen_vae_dtype(tmp_path, monkeypatch, capsys):
    """--vae-dtype reaches the video VAE the MP4 is decoded with (decoder linears in it, encoder float32);
    without it the VAE takes the model dtype (here the CPU's float32)."""
    from h3_core import pipeline

    seen = []
    monkeypatch.setattr(pipeline, "write_mp4", lambda path, latents, video_vae, audio_vae, **_: seen.append(
        (video_vae.decoder.transformer_blocks[0].attn.to_qkv.weight.dtype, video_vae.encoder.conv_in.weight.dtype)))
    argv = readme_main_command() + ["--steps", "2", "--duration", "4", "--device", "cpu"]
    for extra, named in (([], "float32"), (["--vae-dtype", "bf16"], "bfloat16")):
        assert main(with_option(argv, "--out", str(tmp_path / "a.mp4")) + extra) == 0
        assert f"video VAE: decoder linears in {named}" in capsys.readouterr().err
    assert seen == [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize(
    "configured, devices, expected",
    [
        ("", None, "expandable_segments:True"),  # the default on one device
        ("backend:cudaMallocAsync", None, "backend:cudaMallocAsync"),  # the user's choice stays
        ("", "cpu,cpu", ""),  # worker processes keep torch's default allocator
    ],
)
def test_generate_turns_on_expandable_segments(monkeypatch, capsys, configured, devices, expected):
    """A streamed DiT ran out of memory by fragmentation under torch's fixed-size segments (bench/RESULTS.md),
    so one-device runs set PYTORCH_CUDA_ALLOC_CONF before CUDA starts, unless the user set it."""
    import os

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", configured)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    argv = ["generate", "--prompt", "x", "--duration", "40", "--out", "o.mp4"] + (["--devices", devices] if devices else [])
    assert main(argv) == 2  # refused (40 s) after the setting, before any model
    assert "duration must be between 4 and 15 seconds, got 40.0" in capsys.readouterr().err  # not refused earlier
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == expected


def readme_commands() -> list[str]:
    """Every `h3 ...` command in the README's code blocks, continued lines joined, comments dropped."""
    commands, inside = [], False
    for line in README.read_text().replace("\\\n", " ").splitlines():
        if line.startswith("```"):
            inside = not inside
        elif inside and line.startswith("h3 "):
            commands.append(line.split("  #")[0])
    return commands


def test_every_readme_command_parses():
    """The README's examples use options that exist, spelled as the parser wants them."""
    from h3_core.cli import build_parser

    commands = readme_commands()
    assert len(commands) > 15 and any("--text-encoder" in c for c in commands)
    parser = build_parser()
    for command in commands:
        try:
            parser.parse_args(shlex.split(command)[1:])
        except SystemExit:
            pytest.fail(f"the README's `{command}` does not parse")


def test_env_reports_what_a_run_would_use(capsys, monkeypatch):
    """`h3 env`: versions as installed, the attention kernels that import and the one `auto` picks, the encoders
    an MP4 is written with (or why there is none), one entry per CUDA device."""
    from h3_core import attention, media_write

    assert main(["env"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["packages"]["torch"] == torch.__version__ and found["packages"]["av"] == av.__version__
    assert found["attention_available"] == attention.available_backends() and "sdpa" in found["attention_available"]
    assert found["attention_auto_cpu"] == "sdpa"
    assert found["media"] == {"h264_encoder": media_write.pick_h264_encoder(1344, 768), "aac_encoder": "aac"}
    assert len(found["cuda_devices"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    for device in found["cuda_devices"]:
        assert device["attention_auto"] in attention.EXACT_BACKENDS and device["memory_gib"] >= device["free_gib"] > 0

    def no_h264(*args, **kwargs):
        raise media_write.EncoderUnavailableError("No usable H.264 encoder in this PyAV build.")

    monkeypatch.setattr(media_write, "pick_h264_encoder", no_h264)
    assert main(["env"]) == 0
    assert json.loads(capsys.readouterr().out)["media"]["h264_encoder"] == "none: No usable H.264 encoder in this PyAV build."


@pytest.mark.parametrize("configured,shown,allocator", [
    ("", None, "expandable_segments:True (set by h3)"),
    ("backend:cudaMallocAsync", "backend:cudaMallocAsync", "PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync (yours)"),
])
def test_env_reports_the_users_allocator_setting_apart_from_h3s(capsys, monkeypatch, configured, shown, allocator):
    """`h3 env` shows the environment as the user set it (a bug report must not look as if they configured the
    allocator) and, apart, the allocator a one-device `h3 generate` runs with."""
    import os

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", configured)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert main(["env"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert (found["settings"]["PYTORCH_CUDA_ALLOC_CONF"] or None) == shown
    assert found["cuda_allocator_h3_generate"] == allocator and os.environ["PYTORCH_CUDA_ALLOC_CONF"] == configured


def test_denoise_places_the_dit_by_its_memory_plan(tmp_path, monkeypatch, capsys):
    """h3 denoise loaded the whole DiT onto the device (a 62 GiB read into a 24 GB card). It plans as generate
    does: a streamed placement gives the resident latents bitwise, and a --gpu-memory nothing fits in is refused
    before the model is built."""
    from h3_core import pipeline
    from h3_core.memory_plan import MemoryPlan

    base = ["denoise", "--width", "128", "--height", "64", "--steps", "3"]
    assert main(base + ["--save-latents", str(tmp_path / "resident.safetensors")]) == 0
    placed = []
    real_place = pipeline.place
    monkeypatch.setattr(pipeline, "plan_for", lambda *args, **kwargs: MemoryPlan(1, 1, True, 0, True))
    monkeypatch.setattr(pipeline, "place", lambda *args: placed.append(real_place(*args)) or placed[-1])
    assert main(base + ["--save-latents", str(tmp_path / "streamed.safetensors")]) == 0
    assert placed and placed[0] is not None and placed[0].resident == 1  # blocks after the first streamed
    resident, streamed = (load_file(str(tmp_path / f"{name}.safetensors")) for name in ("resident", "streamed"))
    assert torch.equal(resident["video"], streamed["video"]) and torch.equal(resident["audio"], streamed["audio"])
    monkeypatch.undo()
    monkeypatch.setattr(pipeline, "tiny_random_dit", lambda *a, **k: pytest.fail("a DiT built that cannot fit"))
    capsys.readouterr()
    assert main(base + ["--gpu-memory", "1e-6", "--save-latents", str(tmp_path / "no.safetensors")]) == 2
    assert "even with every DiT block streamed from the CPU, more than --gpu-memory" in capsys.readouterr().err
    assert not (tmp_path / "no.safetensors").exists()


def test_reading_the_vaes_and_the_dit_shows_progress(tmp_path, tiny_config, monkeypatch):
    """h3 denoise read its DiT, and h3 generate / h3 encode their VAEs (the release's video VAE: 9.7 GiB), with no
    bar (found by the progress review)."""
    from types import SimpleNamespace

    import audio_vae_checkpoints
    import video_vae_checkpoints

    from h3_core import cli
    from h3_core.pipeline import load_vaes

    stages = []
    monkeypatch.setattr(cli.StageBars, "__call__", lambda self, stage, done, total: stages.append((stage, done, total)))
    write_diffusers_folder(tmp_path / "transformer", reference_dit(tiny_config))
    save_file({"prompt_embeds": torch.randn(1, 5, 48), "text_token_tags": torch.tensor([1, 1, 1, 1, 1])},
              str(tmp_path / "prompt.safetensors"))
    assert main(["denoise", "--model", str(tmp_path), "--text-states", str(tmp_path / "prompt.safetensors"), "--width",
                 "96", "--height", "64", "--steps", "2", "--save-latents", str(tmp_path / "out.safetensors")]) == 0
    read = [(done, total) for stage, done, total in stages if stage == "read DiT"]
    assert read and read[-1][0] == read[-1][1] > 1 and stages[-1][0] == "denoise"  # read first, then the steps

    video = video_vae_checkpoints.write_diffusers_folder(
        tmp_path / "video_vae", video_vae_checkpoints.reference_video_vae(video_vae_checkpoints.tiny_config()))
    audio = audio_vae_checkpoints.write_diffusers_folder(tmp_path / "audio_vae",
                                                         audio_vae_checkpoints.reference_audio_vae())
    stages.clear()
    load_vaes(SimpleNamespace(tiny=False, video_vae=video, audio_vae=audio), torch.device("cpu"), torch.float32,
              lambda stage, done, total: stages.append((stage, done, total)))
    for stage in ("read video VAE", "read audio VAE"):
        done, total = [entry[1:] for entry in stages if entry[0] == stage][-1]
        assert done == total > 1
