"""`h3 generate` / `h3 encode` with each model from its own file (ComfyUI's single files): the same tiny
weights laid out as a release root and as separate files give the same latents; a set with a part
missing is refused, naming the options, before anything loads."""

import re
from pathlib import Path

import huggingface_hub
import pytest
import torch
from audio_vae_checkpoints import reference_audio_vae
from audio_vae_checkpoints import write_comfy_single_file as write_audio_single
from audio_vae_checkpoints import write_original_partition as write_audio_partition
from reference_checkpoints import reference_dit
from reference_checkpoints import write_comfy_single_file as write_dit_single
from reference_checkpoints import write_original_partition as write_dit_partition
from safetensors.torch import load_file
from video_vae_checkpoints import reference_video_vae, tiny_config
from video_vae_checkpoints import write_diffusers_folder as write_video_folder
from video_vae_checkpoints import write_original_partition as write_video_partition

import tiny_qwen
from h3_core import pipeline, text_checkpoint
from h3_core.checkpoint import DiTReader
from h3_core.cli import main
from h3_core.config import TINY_DIT
from h3_core.pipeline import ModelFiles, resolve_model_source
from h3_core.weights import CheckpointError

REQUEST = ["--prompt", "a fox on the beach", "--width", "224", "--height", "128", "--duration", "4", "--steps", "3",
           "--device", "cpu"]


@pytest.fixture(scope="module")
def model_sets(tmp_path_factory):
    """One tiny model twice: `release` (root with FL2VA/: DiT, text encoder, tokenizer, processor, both VAEs)
    and `files` (a ComfyUI DiT file, a ComfyUI text-encoder file, a diffusers video VAE folder, a ComfyUI audio
    VAE file), plus the text encoder's config (a single file carries none)."""
    root = tmp_path_factory.mktemp("model_files")
    tokenizer = tiny_qwen.write_tokenizer(root / "tokenizer")
    text_config = tiny_qwen.config_dict(tokenizer, layers=50, hidden=TINY_DIT.text_dim)
    text = tiny_qwen.random_model(text_config, seed=11)
    release = root / "MiniMax-H3"
    tiny_qwen.write_original_release(release, text, tokenizer)
    video_config = tiny_config(seed=1)
    video = reference_video_vae(video_config, seed=2)
    write_video_partition(release, video.state_dict(), video_config)
    audio = reference_audio_vae(seed=3)
    write_audio_partition(release, audio)
    dit_state = reference_dit(TINY_DIT, seed=4).state_dict()
    write_dit_partition(release, dit_state, TINY_DIT)

    files = root / "comfyui"
    (files / "vae").mkdir(parents=True)
    dit = write_dit_single(files / "minimax_h3_fl2va_bf16.safetensors", dit_state, TINY_DIT)
    encoder = tiny_qwen.write_single_file(files / "qwen3vl_minimax_h3.safetensors", text,
                                          prefix="text_encoders.qwen3vl_32b.transformer.")
    video_folder = write_video_folder(files / "vae" / "video_vae", video)
    audio_file = write_audio_single(files / "vae" / "minimax_h3_audio_vae_fp32.safetensors", audio)
    return {"release": release, "dit": dit, "text_encoder": encoder, "tokenizer": release / "FL2VA",
            "video_vae": video_folder, "audio_vae": audio_file, "text_config": text_config,
            "clip": _write_clip(root / "clip.mp4")}


def _file_options(sets, *leave_out: str) -> list[str]:
    options = []
    for name in ("text_encoder", "tokenizer", "video_vae", "audio_vae"):
        if name not in leave_out:
            options += ["--" + name.replace("_", "-"), str(sets[name])]
    return options


def test_a_tokenizer_without_a_processor_runs_text_prompts_and_refuses_pictures_before_any_model(
        model_sets, tmp_path, monkeypatch, capsys):
    """--tokenizer a folder holding the tokenizer alone: a text prompt runs as with the release's FL2VA (its
    processor is never used); a keyframe request is refused before any model loads, saying what is missing."""
    from PIL import Image

    from h3_core.prompt import NO_PROCESSOR

    monkeypatch.setattr(text_checkpoint, "QWEN3VL_32B_CONFIG", model_sets["text_config"])
    alone = tiny_qwen.write_tokenizer(tmp_path / "tokenizer_only")
    runs = {}
    for name, tokenizer in (("alone", alone), ("release", model_sets["tokenizer"])):
        runs[name] = tmp_path / f"{name}.safetensors"
        argv = ["generate", "--model", str(model_sets["dit"]), *_file_options(model_sets, "tokenizer"),
                "--tokenizer", str(tokenizer), *REQUEST, "--save-latents", str(runs[name])]
        assert main(argv) == 0
    ours, theirs = load_file(str(runs["alone"])), load_file(str(runs["release"]))
    assert torch.equal(ours["video"], theirs["video"]) and torch.equal(ours["audio"], theirs["audio"])

    Image.new("RGB", (224, 128), (10, 120, 200)).save(tmp_path / "first.png")
    for name in ("load_dit", "load_text_encoder", "load_video_vae", "load_audio_vae"):
        monkeypatch.setattr(pipeline, name, lambda *a, **k: pytest.fail("a model was loaded"))
    capsys.readouterr()
    argv = ["generate", "--model", str(model_sets["dit"]), *_file_options(model_sets, "tokenizer"), "--tokenizer",
            str(alone), *REQUEST, "--task", "fl2va", "--first-image", str(tmp_path / "first.png"),
            "--out", str(tmp_path / "fl2va.mp4")]
    assert main(argv) == 2
    assert NO_PROCESSOR in capsys.readouterr().err


def test_separate_files_generate_what_the_release_root_does(model_sets, tmp_path, monkeypatch, capsys):
    """A ComfyUI DiT file, text-encoder file (its tokenizer fetched), video VAE folder and audio VAE file: the
    same latents as the release root holding the same weights."""
    # a single text-encoder file is read with the built-in Qwen3-VL config: here the tiny one
    monkeypatch.setattr(text_checkpoint, "QWEN3VL_32B_CONFIG", model_sets["text_config"])
    release = tmp_path / "release.safetensors"
    assert main(["generate", "--model", str(model_sets["release"]), *REQUEST, "--save-latents", str(release)]) == 0
    out, latents = tmp_path / "files.mp4", tmp_path / "files.safetensors"
    loaded = []
    for name in ("load_text_encoder", "load_video_vae", "load_audio_vae"):
        real = getattr(pipeline, name)
        monkeypatch.setattr(pipeline, name, lambda path, *a, _real=real, _name=name, **k:
                            loaded.append((_name, path, k.get("tokenizer"))) or _real(path, *a, **k))
    fetched = []  # no --tokenizer: the release's, fetched once (here from the tiny release)
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, **options: fetched.append(repo) or str(model_sets["release"]))
    argv = ["generate", "--model", str(model_sets["dit"]), *_file_options(model_sets, "tokenizer"), *REQUEST,
            "--out", str(out), "--save-latents", str(latents)]
    assert main(argv) == 0
    assert fetched == ["MiniMaxAI/MiniMax-H3"]
    printed = capsys.readouterr()
    assert "h3: tokenizer: the release's, from the Hugging Face cache" in printed.err
    assert [(name, path) for name, path, _ in loaded] == [  # the VAEs first: the encoder is placed beside them
        ("load_video_vae", model_sets["video_vae"]), ("load_audio_vae", model_sets["audio_vae"]),
        ("load_text_encoder", model_sets["text_encoder"])]
    assert loaded[2][2] == model_sets["release"] / "FL2VA" / "tokenizer"
    ours, theirs = load_file(str(latents)), load_file(str(release))
    assert set(ours) == {"video", "audio"}
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    assert out.stat().st_size > 0
    assert "files.mp4: t2va, seed 0, 107 frames" in printed.out


def test_a_text_encoder_file_takes_its_tokenizer_from_the_release_root(model_sets, tmp_path, monkeypatch):
    """--model a release root with --text-encoder a single file (say ComfyUI's int8 one): the tokenizer and
    processor are the root's; the same latents as the root alone."""
    monkeypatch.setattr(text_checkpoint, "QWEN3VL_32B_CONFIG", model_sets["text_config"])
    release = str(model_sets["release"])
    source = resolve_model_source(release, "fl2va", ModelFiles(text_encoder=model_sets["text_encoder"]))
    assert source.tokenizer == model_sets["release"] and source.video_vae == model_sets["release"]
    argv = ["generate", "--model", release, *REQUEST, "--steps", "2"]
    assert main(argv + ["--save-latents", str(tmp_path / "a.safetensors")]) == 0
    assert main(argv + ["--text-encoder", str(model_sets["text_encoder"]),
                        "--save-latents", str(tmp_path / "b.safetensors")]) == 0
    a, b = load_file(str(tmp_path / "a.safetensors")), load_file(str(tmp_path / "b.safetensors"))
    assert torch.equal(a["video"], b["video"]) and torch.equal(a["audio"], b["audio"])


def _hub_serving(release, snapshots, fetched):
    """A stand-in for huggingface_hub.snapshot_download serving `release` as the Hub would: a new snapshot
    folder holding only the files `allow_patterns` match (huggingface_hub's own filter); each call's
    patterns are appended to `fetched`."""
    import shutil

    from huggingface_hub.utils import filter_repo_objects

    def download(repo, allow_patterns=None, **options):
        fetched.append(sorted(allow_patterns))
        root = snapshots / f"snapshot{len(fetched)}"
        names = [path.relative_to(release).as_posix() for path in release.rglob("*") if path.is_file()]
        for name in filter_repo_objects(names, allow_patterns=allow_patterns):
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(release / name, root / name)
        root.mkdir(parents=True, exist_ok=True)
        return str(root)

    return download


def _write_clip(path):
    import av
    import numpy as np

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = 224, 128, "yuv420p"
        for index in range(30):
            frame = np.full((128, 224, 3), index * 8, dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path


def test_a_hub_repo_is_fetched_only_as_far_as_the_run_reads_it(model_sets, tmp_path, monkeypatch):
    """A repo id downloads just the folders the run reads (the release's partition is ~134 GiB; h3 encode
    needs its ~10 GiB of VAEs): encode fetches the two VAEs, generate with its own text-encoder file everything
    but the text encoder; each run from those files alone matches the same run on the whole local release."""
    monkeypatch.setattr(text_checkpoint, "QWEN3VL_32B_CONFIG", model_sets["text_config"])
    fetched = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        _hub_serving(model_sets["release"], tmp_path / "hub", fetched))
    clip = model_sets["clip"]
    canvas = ["--width", "224", "--height", "128", "--device", "cpu"]
    for model, out in ((str(model_sets["release"]), "local"), ("MiniMaxAI/MiniMax-H3", "hub")):
        assert main(["encode", str(clip), "--model", model, *canvas, "--out", str(tmp_path / f"{out}.safetensors")]) == 0
    assert fetched == [["FL2VA/audio_vae/*", "FL2VA/video_vae/*"]]
    local, hub = load_file(str(tmp_path / "local.safetensors")), load_file(str(tmp_path / "hub.safetensors"))
    assert torch.equal(local["video"], hub["video"]) and torch.equal(local["audio"], hub["audio"])

    argv = ["generate", *REQUEST, "--steps", "2", "--text-encoder", str(model_sets["text_encoder"])]
    for model, out in ((str(model_sets["release"]), "local"), ("MiniMaxAI/MiniMax-H3", "hub")):
        assert main(argv + ["--model", model, "--save-latents", str(tmp_path / f"{out}_av.safetensors")]) == 0
    assert fetched[1] == ["FL2VA/audio_vae/*", "FL2VA/model_index.json", "FL2VA/processor/*", "FL2VA/tokenizer/*",
                          "FL2VA/transformer/*", "FL2VA/video_vae/*"]
    local, hub = load_file(str(tmp_path / "local_av.safetensors")), load_file(str(tmp_path / "hub_av.safetensors"))
    assert torch.equal(local["video"], hub["video"]) and torch.equal(local["audio"], hub["audio"])
    source = resolve_model_source("MiniMaxAI/MiniMax-H3", "fl2va")  # every model: the whole partition
    assert fetched[2] == sorted(f"FL2VA/{name}" for name in (
        "audio_vae/*", "model_index.json", "processor/*", "text_encoder/*", "tokenizer/*", "transformer/*",
        "video_vae/*"))
    assert sorted(path.name for path in (source.root / "FL2VA").iterdir()) == sorted(
        path.name for path in (model_sets["release"] / "FL2VA").iterdir())


def test_a_hub_repo_in_another_layout_is_refused_naming_the_missing_folders(tmp_path, monkeypatch, capsys):
    """A repo holding no FL2VA/ folders (ComfyUI single files, say) is refused with the layout a repo id needs,
    not as an empty cache folder that is no checkpoint; h3 encode reads its clip before fetching anything."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "minimax_h3_fl2va_bf16.safetensors").write_bytes(b"")
    fetched = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _hub_serving(other, tmp_path / "hub", fetched))
    assert main(["encode", str(tmp_path / "missing.mp4"), "--model", "Comfy-Org/MiniMax-H3",
                 "--out", str(tmp_path / "x.safetensors")]) == 2  # a clip that is not there: refused unfetched
    assert f"the video {tmp_path / 'missing.mp4'}: no such file." in capsys.readouterr().err and fetched == []
    assert main(["encode", str(_write_clip(tmp_path / "clip.mp4")), "--model", "Comfy-Org/MiniMax-H3",
                 "--out", str(tmp_path / "x.safetensors")]) == 2
    error = capsys.readouterr().err
    assert "Hub repo Comfy-Org/MiniMax-H3 has no FL2VA/video_vae, FL2VA/audio_vae. A repo id is read in the " \
           "original release's layout" in error, error


def test_folders_missing_from_an_offline_cache_are_said_to_be_missing_from_the_cache(tmp_path, monkeypatch):
    """Offline (HF_HUB_OFFLINE), huggingface_hub hands back the cache's snapshot as far as it goes: the folders a
    cache lacks (only the VAEs fetched by an earlier `h3 encode`) were blamed on the repo's layout ("download
    another repo's files"); now they are said to be missing from the cache, with the download that fills it."""
    from huggingface_hub import constants

    from h3_core.hub import fetch_release
    from h3_core.weights import CheckpointError

    cached = tmp_path / "cached"
    (cached / "FL2VA" / "video_vae").mkdir(parents=True)
    (cached / "FL2VA" / "video_vae" / "config.json").write_text("{}")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _hub_serving(cached, tmp_path / "hub", []))
    monkeypatch.setattr(constants, "is_offline_mode", lambda: True, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError, match=r"^Not in the Hugging Face cache \(.*\): FL2VA/transformer of "
                                              r"MiniMaxAI/MiniMax-H3, and the Hub is not asked \(HF_HUB_OFFLINE is "
                                              r"set\)\..*hf download MiniMaxAI/MiniMax-H3 "
                                              r"--include 'FL2VA/transformer/\*'"):
        fetch_release("MiniMaxAI/MiniMax-H3", "fl2va", ["dit", "video_vae"])
    monkeypatch.setattr(constants, "is_offline_mode", lambda: False, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(CheckpointError, match="has no FL2VA/transformer. A repo id is read in the original"):
        fetch_release("MiniMaxAI/MiniMax-H3", "fl2va", ["dit", "video_vae"])  # online, the repo's own listing


def test_encode_names_what_its_model_may_be(tmp_path, capsys):
    """h3 encode reads no DiT: a --model file that is no safetensors was refused as a DiT file."""
    (tmp_path / "note.txt").write_text("not a model")
    assert main(["encode", str(_write_clip(tmp_path / "clip.mp4")), "--out", str(tmp_path / "x.safetensors"),
                 "--model", str(tmp_path / "note.txt")]) == 2
    assert ("note.txt is not a .safetensors file; all-in-one model files must be safetensors (a release folder "
            "serves too; or give --video-vae and --audio-vae)") in capsys.readouterr().err


def test_encode_reads_the_given_vae_files(model_sets, tmp_path):
    """`h3 encode` with --video-vae and --audio-vae and no --model: the same latents as the release root's VAEs."""
    clip = model_sets["clip"]
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    canvas = ["--width", "224", "--height", "128", "--device", "cpu"]
    assert main(["encode", str(clip), "--model", str(model_sets["release"]), *canvas, "--out", str(a)]) == 0
    assert main(["encode", str(clip), "--video-vae", str(model_sets["video_vae"]), "--audio-vae",
                 str(model_sets["audio_vae"]), *canvas, "--out", str(b)]) == 0
    first, second = load_file(str(a)), load_file(str(b))
    assert torch.equal(first["video"], second["video"]) and torch.equal(first["audio"], second["audio"])


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "{dit}", "--text-encoder", "{text_encoder}", "--audio-vae", "{audio_vae}"],
     r"single DiT file: the other models are not in it. Give --video-vae \("),
    (["generate", "--model", "{dit}"], "Give --text-encoder, --video-vae, --audio-vae"),
    (["generate", "--video-vae", "{video_vae}"], "--video-vae: tiny-random makes its own text encoder and VAEs"),
    (["generate", "--model", "{release}", "--audio-vae", "{release}/nowhere.safetensors"],
     "--audio-vae .*nowhere.safetensors does not exist"),
    (["encode", "{clip}", "--video-vae", "{video_vae}"], "Without --model each model is given on its own. Give --audio-vae"),
])
def test_an_incomplete_set_is_refused_before_loading(model_sets, tmp_path, monkeypatch, capsys, argv, message):
    for name in ("load_text_encoder", "load_video_vae", "load_audio_vae", "locate_dit"):
        monkeypatch.setattr(pipeline, name, lambda *a, **k: pytest.fail("a model was looked at"))
    argv = [part.format(**model_sets) for part in argv]
    extra = ["--out", str(tmp_path / "x.safetensors")] if argv[0] == "encode" else [
        "--prompt", "x", "--out", str(tmp_path / "x.mp4")]
    assert main(argv + extra) == 2
    error = capsys.readouterr().err
    assert re.search(message, error), error
    with pytest.raises(CheckpointError, match="single DiT file"):
        resolve_model_source(str(model_sets["dit"]), "fl2va")


def _without(source, target, key_part):
    """A copy of a safetensors file (or of a folder) without its first tensor whose name holds `key_part`."""
    import shutil

    from safetensors.torch import save_file

    if source.is_dir():
        shutil.copytree(source, target)
        source = target = next(path for path in sorted(target.rglob("*.safetensors"))
                               if any(key_part in key for key in load_file(str(path))))
    tensors = load_file(str(source))
    del tensors[next(key for key in tensors if key_part in key)]
    save_file(tensors, str(target))


@pytest.mark.parametrize("part, key_part", [("dit", "blocks.1.mlp.fc2"), ("video_vae", "decoder."), ("audio_vae", "dec_")])
def test_a_damaged_model_file_is_refused_before_any_model_loads(model_sets, tmp_path, monkeypatch, capsys, part,
                                                                key_part):
    """A DiT or VAE missing a tensor was refused only once it was read: after the text encoder (51 GB with the
    real model) had been read and run. Their headers are checked against the models first now."""
    for name in ("load_text_encoder_for", "load_vaes", "load_sampling_dit"):
        monkeypatch.setattr(pipeline, name, lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(text_checkpoint, "QWEN3VL_32B_CONFIG", model_sets["text_config"])
    damaged = tmp_path / model_sets[part].name
    _without(model_sets[part], damaged, key_part)
    paths = {"model": model_sets["dit"], **{name: model_sets[name] for name in
                                            ("text_encoder", "tokenizer", "video_vae", "audio_vae")}}
    paths["model" if part == "dit" else part] = damaged
    argv = ["generate", *REQUEST, "--out", str(tmp_path / "x.mp4")]
    for name, path in paths.items():
        argv += ["--" + name.replace("_", "-"), str(path)]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert re.search(r"h3: error: .*is missing 1 tensor", error), error


def test_info_names_every_model_a_path_holds(model_sets, capsys):
    """`h3 info`: a release root holds all four; each separate file is the one model it is."""
    import json

    def info(path) -> dict:
        assert main(["info", str(path)]) == 0
        return json.loads(capsys.readouterr().out)

    root = info(model_sets["release"])
    assert list(root) == ["dit", "text_encoder", "video_vae", "audio_vae"]
    assert root["dit"]["config"]["hidden_size"] == TINY_DIT.hidden_size and root["text_encoder"]["decoder_layers"] == 50
    assert root["text_encoder"]["tokenizer"].endswith("FL2VA/tokenizer")
    dit = info(model_sets["dit"])
    assert list(dit) == ["dit"] and dit["dit"]["tensors"] == root["dit"]["tensors"]
    text = info(model_sets["text_encoder"])
    assert list(text) == ["text_encoder"] and text["text_encoder"]["origin"] == "single file"
    assert text["text_encoder"]["tokenizer"] is None
    assert list(info(model_sets["video_vae"])) == ["video_vae"]
    audio = info(model_sets["audio_vae"])
    assert list(audio) == ["audio_vae"] and audio["audio_vae"]["tensors"] > 0


def _bundle(sets, path):
    """An all-in-one file as ComfyUI's checkpoint save writes one: the DiT under `model.diffusion_model.`, the text
    encoder under `text_encoders.qwen3vl_32b.transformer.`, the video VAE under `vae.`, plus the audio VAE under
    `audio_vae.`: the same tiny weights as the separate files."""
    from safetensors.torch import save_file
    from video_vae_checkpoints import original_state_dict

    video = {}
    for shard in sorted(sets["video_vae"].glob("*.safetensors")):
        video.update(load_file(str(shard)))
    tensors = {**load_file(str(sets["dit"])), **load_file(str(sets["text_encoder"])),
               **{"vae." + k: v.half() for k, v in original_state_dict(video, tiny_config(seed=1)).items()},
               **{"audio_vae." + k: v for k, v in load_file(str(sets["audio_vae"])).items()}}
    assert {key.split(".")[0] for key in tensors} == {"model", "text_encoders", "vae", "audio_vae"}
    save_file(tensors, str(path))
    return path


def test_an_all_in_one_file_supplies_the_dit_text_encoder_and_audio_vae(model_sets, tmp_path, monkeypatch, capsys):
    """A bundle given as --model serves the DiT, the text encoder and the audio VAE (the DiT was refused, naming a
    text-encoder tensor as unexpected; the others had to be given), each reading its own part, and the run matches
    the separate files'; `h3 info` finds all four models in it, the DiT's tensors counted without the others'."""
    import json

    monkeypatch.setattr(text_checkpoint, "QWEN3VL_32B_CONFIG", model_sets["text_config"])
    bundle = str(_bundle(model_sets, tmp_path / "minimax_h3_fl2va_all_in_one.safetensors"))
    argv = ["generate", *REQUEST, "--steps", "2", "--tokenizer", str(model_sets["tokenizer"]),
            "--video-vae", str(model_sets["video_vae"])]
    separate = ["--model", str(model_sets["dit"]), "--text-encoder", str(model_sets["text_encoder"]),
                "--audio-vae", str(model_sets["audio_vae"])]
    assert main(argv + separate + ["--save-latents", str(tmp_path / "a.safetensors")]) == 0
    loaded = []
    for name in ("load_text_encoder", "load_audio_vae"):
        real = getattr(pipeline, name)
        monkeypatch.setattr(pipeline, name, lambda path, *a, _real=real, **k: loaded.append(path) or _real(path, *a, **k))
    assert main(argv + ["--model", bundle, "--save-latents", str(tmp_path / "b.safetensors")]) == 0
    assert loaded == [Path(bundle)] * 2  # the bundle serves both, given as --model alone
    a, b = load_file(str(tmp_path / "a.safetensors")), load_file(str(tmp_path / "b.safetensors"))
    # the same weights, but read in place from other file offsets (alignment): CPU kernels may round otherwise
    # (with the DiT's tensors copied to fresh memory the runs are bitwise equal)
    for key in ("video", "audio"):
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-5)
    dits = [DiTReader(path, "fl2va", torch.float32).read().state_dict() for path in (model_sets["dit"], bundle)]
    assert dits[0].keys() == dits[1].keys() and all(torch.equal(dits[0][k], dits[1][k]) for k in dits[0])
    from safetensors.torch import save_file

    without_audio = tmp_path / "no_audio.safetensors"
    save_file({k: v for k, v in load_file(bundle).items() if not k.startswith("audio_vae.")}, str(without_audio))
    with pytest.raises(CheckpointError, match=r"all-in-one file holding the DiT and the text encoder and the video "
                                              r"VAE alone\. Give --audio-vae \(ComfyUI: one from models/vae\)"):
        resolve_model_source(str(without_audio), "fl2va")
    without_video = tmp_path / "no_video.safetensors"  # the audio VAE's `audio_vae.` is no video VAE
    save_file({k: v for k, v in load_file(bundle).items() if not k.startswith("vae.")}, str(without_video))
    with pytest.raises(CheckpointError, match=r"holding the DiT and the text encoder and the audio VAE alone\. "
                                              r"Give --video-vae \(ComfyUI: one from models/vae\)"):
        resolve_model_source(str(without_video), "fl2va")
    capsys.readouterr()
    assert main(["info", bundle]) == 0
    info = json.loads(capsys.readouterr().out)
    assert list(info) == ["dit", "text_encoder", "video_vae", "audio_vae"]
    assert info["dit"]["origin"] == "all-in-one file"
    assert info["dit"]["tensors"] == len(load_file(str(model_sets["dit"])))
    assert info["video_vae"]["tensors"] + info["audio_vae"]["tensors"] + info["dit"]["tensors"] < len(load_file(bundle))


def _vsa_student_folder(tmp_path):
    """FastH3 8-Step V2's layout in miniature: a diffusers transformer folder plus `to_gate_compress` per block."""
    from reference_checkpoints import write_diffusers_folder
    from safetensors.torch import save_file

    folder = write_diffusers_folder(tmp_path / "fasth3_v2" / "transformer", reference_dit(TINY_DIT, seed=4),
                                    max_shard_size="10GB")
    (shard,) = folder.glob("*.safetensors")
    tensors = load_file(str(shard))
    g = torch.Generator().manual_seed(6)
    for i in range(TINY_DIT.num_layers):
        tensors[f"transformer_blocks.{i}.attn.to_gate_compress.weight"] = 0.1 * torch.randn(
            TINY_DIT.inner_dim, TINY_DIT.hidden_size, generator=g)
    save_file(tensors, str(shard))
    return folder


def test_a_vsa_student_runs_on_its_ladder_with_sparse_attention(model_sets, tmp_path, monkeypatch, capsys):
    """A DiT with VSA gates (FastH3 8-Step V2's layout: a diffusers transformer folder plus `to_gate_compress`
    per block): its contract's 8 forwards, every block's attention through Video Sparse Attention at sparsity
    0.8 with its gate, on one device or split over two; the attention window refused before anything loads."""
    from h3_core import dit as dit_module

    monkeypatch.setattr(text_checkpoint, "QWEN3VL_32B_CONFIG", model_sets["text_config"])
    folder = _vsa_student_folder(tmp_path)
    calls = []
    real = dit_module.vsa_attention
    monkeypatch.setattr(dit_module, "vsa_attention", lambda *a: calls.append(a) or real(*a))
    request = [arg for arg in REQUEST if arg not in ("--steps", "3")]
    argv = ["generate", "--model", str(folder), *_file_options(model_sets), *request, "--out", str(tmp_path / "v2.mp4")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "sampler: 9 sigma points (8 model calls), video shift 10, audio shift 3" in err and "FastVideo FastH3 8-Step V2" in err
    assert "Video Sparse Attention, sparsity 0.8" in err
    assert len(calls) == 8 * TINY_DIT.num_layers and {call[4] for call in calls} == {0.8}
    assert all(call[5] is not None for call in calls)  # the gates
    # split over two devices (sequence parallel: each rank's heads over every row's tiles), blocks compiled there:
    # the same latents
    one, two = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    assert main(argv + ["--save-latents", str(one)]) == 0
    assert main(argv + ["--devices", "cpu,cpu", "--compile", "--save-latents", str(two)]) == 0
    said = capsys.readouterr()
    assert "Video Sparse Attention, sparsity 0.8" in said.err
    assert "peak RSS" in said.out and "in this process (the DiT ran in the workers)" in said.out
    for key, value in load_file(str(one)).items():
        assert torch.allclose(load_file(str(two))[key], value, rtol=1e-4, atol=1e-5), key
    monkeypatch.setattr(pipeline, "load_text_encoder", lambda *a, **k: pytest.fail("loaded before the refusal"))
    assert main(argv + ["--attention-window-lossy", "2"]) != 0
    assert "Video Sparse Attention gates" in capsys.readouterr().err


def test_an_nvfp4_dit_file_generates_with_its_lora_hooked(model_sets, tmp_path, monkeypatch, capsys):
    """ComfyUI's NVFP4 DiT file with a LoRA: its block linears stay NVFP4 and the LoRA is hooked (merging would
    quantize again); the latents are those of a dense file holding the weights the NVFP4 ones stand for, with
    the LoRA merged."""
    import nvfp4_files
    from lora_files import random_spec, write_peft
    from safetensors.torch import save_file

    from h3_core.nvfp4 import NVFP4Linear

    monkeypatch.setattr(text_checkpoint, "QWEN3VL_32B_CONFIG", model_sets["text_config"])
    tensors = load_file(str(model_sets["dit"]))
    dense = dict(tensors)
    prefix = "model.diffusion_model."
    layers = [f"blocks.{i}.{leaf}" for i in range(TINY_DIT.num_layers)
              for leaf in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")]
    for layer, (values, _) in nvfp4_files.quantize_layers(tensors, layers, prefix).items():
        dense[f"{prefix}{layer}.weight"] = values.to(dense[f"{prefix}{layer}.weight"].dtype)
    save_file(tensors, str(tmp_path / "minimax_h3_fl2va_nvfp4.safetensors"))
    save_file(dense, str(tmp_path / "dense.safetensors"))
    lora = write_peft(tmp_path / "lora.safetensors", random_spec(TINY_DIT, seed=9))
    held = []
    real = pipeline.place
    monkeypatch.setattr(pipeline, "place", lambda dit, *a, **k: held.append(
        {type(dit.get_submodule(layer)) for layer in layers}) or real(dit, *a, **k))
    latents = {}
    for name in ("minimax_h3_fl2va_nvfp4", "dense"):
        latents[name] = tmp_path / f"{name}-latents.safetensors"
        assert main(["generate", "--model", str(tmp_path / f"{name}.safetensors"), *_file_options(model_sets), *REQUEST,
                     "--lora", f"{lora}:0.8", "--save-latents", str(latents[name])]) == 0
        err = capsys.readouterr().err
        assert ("LoRA on fl2va (dynamic):" if "nvfp4" in name else "LoRA on fl2va (merge):") in err
    assert held[0] == {NVFP4Linear} and held[1] == {torch.nn.Linear}
    ours, theirs = (load_file(str(path)) for path in latents.values())
    for key in ("video", "audio"):
        assert torch.allclose(ours[key], theirs[key], rtol=1e-3, atol=1e-4), key


def test_a_vsa_student_makes_a_long_video(model_sets, tmp_path, monkeypatch):
    """Continuation windows pack the previous window's tail as condition video rows, which VSA's tiling takes as a
    prefix segment: a 12 s clip in two windows of the student's 8 forwards, every block through VSA."""
    from h3_core import dit as dit_module
    from h3_core.layout import PackedLayout

    monkeypatch.setattr(text_checkpoint, "QWEN3VL_32B_CONFIG", model_sets["text_config"])
    calls, condition_rows = [], []
    real, tiling = dit_module.vsa_attention, PackedLayout.vsa_tiles
    monkeypatch.setattr(dit_module, "vsa_attention", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(PackedLayout, "vsa_tiles", lambda layout, *a: condition_rows.append(
        layout.num_condition_video_rows) or tiling(layout, *a))
    request = [arg for arg in REQUEST if arg not in ("--steps", "3", "--duration", "4")]
    out = tmp_path / "long.mp4"
    assert main(["generate", "--model", str(_vsa_student_folder(tmp_path)), *_file_options(model_sets), *request,
                 "--long-video", "--duration", "12", "--out", str(out)]) == 0
    assert out.stat().st_size > 0
    assert len(calls) == 2 * 8 * TINY_DIT.num_layers
    assert condition_rows[0] == 0 and condition_rows[-1] > 0 and len(condition_rows) == 2  # a tiling a window


def test_a_gguf_dit_file_generates_what_its_weights_do(model_sets, tmp_path, monkeypatch, capsys):
    """`h3 generate --model dit.gguf` with the other models' files: the latents of the same DiT written densely with
    the weights gguf's own dequantizer makes of the file; `h3 info` names its GGML types."""
    import json

    import gguf_files
    from safetensors.torch import save_file

    from h3_core.keymap import strip_prefix

    monkeypatch.setattr(text_checkpoint, "QWEN3VL_32B_CONFIG", model_sets["text_config"])
    tensors = {strip_prefix(k): v for k, v in load_file(str(model_sets["dit"])).items()}
    quantized = {name: "Q8_0" for name, v in tensors.items() if name.startswith("blocks.") and v.ndim == 2}
    gguf = tmp_path / "minimax_h3_fl2va-Q8_0.gguf"
    meant = gguf_files.write_gguf(gguf, tensors, quantized, prefix="model.diffusion_model.")
    save_file({f"model.diffusion_model.{k}": v for k, v in meant.items()}, str(tmp_path / "dense.safetensors"))
    runs = {}
    for name, dit in (("gguf", gguf), ("dense", tmp_path / "dense.safetensors")):
        runs[name] = tmp_path / f"{name}.safetensors"
        argv = ["generate", "--model", str(dit), *_file_options(model_sets), *REQUEST, "--dtype", "fp32",
                "--save-latents", str(runs[name])]
        assert main(argv) == 0
    ours, theirs = load_file(str(runs["gguf"])), load_file(str(runs["dense"]))
    assert torch.equal(ours["video"], theirs["video"]) and torch.equal(ours["audio"], theirs["audio"])
    capsys.readouterr()
    assert main(["info", str(gguf)]) == 0
    info = json.loads(capsys.readouterr().out)["dit"]
    assert info["origin"] == "GGUF file (architecture 'minimax_h3'; F16, F32, Q8_0)" and set(info["gib_by_type"]) == {"F16", "F32", "Q8_0"}
    assert info["config"]["hidden_size"] == TINY_DIT.hidden_size


def test_a_gguf_text_encoder_generates_what_its_weights_do(model_sets, tmp_path, monkeypatch, capsys):
    """`--text-encoder Qwen3-VL.gguf` (llama.cpp's language model, no vision tower): the latents of the same
    weights (gguf's dequantizer) in a safetensors file; a request with keyframes is refused before any model
    loads, saying why; `h3 info` says it has no vision tower."""
    import json

    from safetensors.torch import save_file

    monkeypatch.setattr(text_checkpoint, "QWEN3VL_32B_CONFIG", model_sets["text_config"])
    text = tiny_qwen.random_model(model_sets["text_config"], seed=11)  # the weights model_sets wrote
    keys = tiny_qwen.llama_cpp_keys(text.state_dict())
    gguf = tmp_path / "Qwen3-VL-32B-Instruct-Q8_0.gguf"
    meant = tiny_qwen.write_gguf_file(gguf, text, {k: "Q8_0" for k in keys if k.endswith("ffn_down.weight")})
    dense = load_file(str(model_sets["text_encoder"]))
    by_name = {text_checkpoint.model_name(k): v for k, v in meant.items()}
    dense.update({k: by_name[text_checkpoint.model_name(k)] for k in dense
                  if text_checkpoint.model_name(k).startswith("language_model.")})
    save_file(dense, str(tmp_path / "dense.safetensors"))
    runs = {}
    for name, encoder in (("gguf", gguf), ("dense", tmp_path / "dense.safetensors")):
        runs[name] = tmp_path / f"{name}.safetensors"
        argv = ["generate", "--model", str(model_sets["dit"]), *_file_options(model_sets, "text_encoder"),
                "--text-encoder", str(encoder), *REQUEST, "--dtype", "fp32", "--save-latents", str(runs[name])]
        assert main(argv) == 0
    ours, theirs = load_file(str(runs["gguf"])), load_file(str(runs["dense"]))
    assert torch.equal(ours["video"], theirs["video"]) and torch.equal(ours["audio"], theirs["audio"])

    from PIL import Image

    Image.new("RGB", (224, 128), (10, 120, 200)).save(tmp_path / "first.png")
    for name in ("load_text_encoder", "load_video_vae", "load_audio_vae"):
        monkeypatch.setattr(pipeline, name, lambda *a, **k: pytest.fail("a model was loaded"))
    capsys.readouterr()
    argv = ["generate", "--model", str(model_sets["dit"]), *_file_options(model_sets, "text_encoder"),
            "--text-encoder", str(gguf), *REQUEST, "--task", "fl2va", "--first-image", str(tmp_path / "first.png"),
            "--out", str(tmp_path / "fl2va.mp4")]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert re.search(r"This request shows the text encoder pictures \(keyframes or image / video references\), but "
                     r"Qwen3-VL-32B-Instruct-Q8_0.gguf holds no vision tower", error), error
    assert main(["info", str(gguf)]) == 0
    info = json.loads(capsys.readouterr().out)["text_encoder"]
    assert info["origin"] == "GGUF file" and info["decoder_layers"] == 50 and info["vision_tower"] is False
    assert set(info["gib_by_type"]) == {"F16", "F32", "Q8_0"}

    # its mmproj file beside it: the keyframe request runs, as with the same weights in one safetensors file
    monkeypatch.undo()
    monkeypatch.setattr(text_checkpoint, "QWEN3VL_32B_CONFIG", model_sets["text_config"])
    vision = tiny_qwen.write_mmproj_file(tmp_path / "mmproj-Qwen3-VL-32B-Instruct-F16.gguf", text, {})
    by_name = tiny_qwen.vision_from_mmproj(vision, text.config.vision_config.deepstack_visual_indexes)
    dense.update({k: by_name[text_checkpoint.model_name(k)] for k in dense
                  if text_checkpoint.model_name(k).startswith("visual.")})
    save_file(dense, str(tmp_path / "dense.safetensors"))
    for name, encoder in (("gguf", gguf), ("dense", tmp_path / "dense.safetensors")):
        argv = ["generate", "--model", str(model_sets["dit"]), *_file_options(model_sets, "text_encoder"),
                "--text-encoder", str(encoder), *REQUEST, "--dtype", "fp32", "--task", "fl2va",
                "--first-image", str(tmp_path / "first.png"), "--save-latents", str(runs[name])]
        assert main(argv) == 0
    ours, theirs = load_file(str(runs["gguf"])), load_file(str(runs["dense"]))
    assert torch.equal(ours["video"], theirs["video"]) and torch.equal(ours["audio"], theirs["audio"])
    assert "text encoder: vision tower from mmproj-Qwen3-VL-32B-Instruct-F16.gguf, beside it" in capsys.readouterr().err
    assert main(["info", str(gguf)]) == 0
    info = json.loads(capsys.readouterr().out)["text_encoder"]
    assert info["vision_tower"] is True and info["vision_tower_file"].endswith("mmproj-Qwen3-VL-32B-Instruct-F16.gguf")
    assert set(info["vision_tower_sizes"]["gib_by_type"]) == {"F16", "F32"} and info["vision_tower_sizes"]["tensors"] == \
        len(tiny_qwen.mmproj_keys(text.state_dict(), text.config.vision_config.deepstack_visual_indexes))


def test_a_dit_read_from_disk_is_let_go_of_before_the_last_decode(model_sets, tmp_path, monkeypatch):
    """generate() dropped its own names for the DiT before the last decode, but its reader (a checkpoint on disk)
    still held the weights: the streamed blocks' pinned memory through the decode, and in torch's host cache
    after generate returned."""
    import weakref

    from h3_core.conditioning import Request
    from h3_core.memory_plan import MemoryPlan
    from h3_core.output import AVLatents

    placed, held_at_save = [], []
    real_place, real_save = pipeline.place, AVLatents.save

    def place(dit, *args):
        placed.append(weakref.ref(dit))
        return real_place(dit, *args)

    def save(latents, *args, **kwargs):  # after the sampling, before the decode
        dit = placed[-1]()
        held_at_save.append(dit is not None and not next(dit.blocks[1].parameters()).is_meta)
        return real_save(latents, *args, **kwargs)

    monkeypatch.setattr(pipeline, "plan_for", lambda *args, **kwargs: MemoryPlan(1, 1, True, 0, True))
    monkeypatch.setattr(pipeline, "place", place)
    monkeypatch.setattr(AVLatents, "save", save)
    request = Request("t2va", "a fox on the beach", width=224, height=128, duration=4)
    pipeline.generate(request, str(model_sets["release"]), pipeline.GenerateSettings(steps=3),
                      save_latents=tmp_path / "fox.safetensors")
    assert held_at_save == [False]
