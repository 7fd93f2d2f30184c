"""The audio VAE loader on tiny random checkpoints in every layout users have, and its errors."""

import dataclasses
import json
import re

import pytest
import torch
from audio_vae_checkpoints import (
    TINY_AUDIO_VAE,
    comfy_state_dict,
    reference_audio_vae,
    write_comfy_single_file,
    write_diffusers_folder,
    write_original_partition,
)
from safetensors.torch import load_file, save_file

from h3_core.vae_audio import RELEASED_LATENTS_MEAN, RELEASED_LATENTS_STD
from h3_core.vae_audio_checkpoint import CheckpointError, check_audio_vae, load_audio_vae, locate_audio_vae

STATISTICS = ("latents_mean", "latents_std")


@pytest.fixture(scope="module")
def reference():
    return reference_audio_vae(TINY_AUDIO_VAE, seed=11)


@pytest.fixture(scope="module")
def expected(reference):
    """Our tensors: weight norm folded by torch's remove_weight_norm; no filters, log-std head or statistics."""
    return {
        name: tensor
        for name, tensor in comfy_state_dict(reference).items()
        if not name.endswith(".filter") and not name.startswith("logs_proj.") and name not in STATISTICS
    }


def assert_same_weights(model, expected):
    got = model.state_dict()
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("where", ["root", "partition", "folder", "weights file"])
def test_original_partition(tmp_path, reference, expected, where):
    folder = write_original_partition(tmp_path, reference)
    path = {"root": tmp_path, "partition": tmp_path / "FL2VA", "folder": folder}.get(where)
    path = path or folder / "model.safetensors"  # "weights file": the folder's configs still apply
    assert locate_audio_vae(path).origin == "original partition folder"
    model = load_audio_vae(path)
    assert model.config == TINY_AUDIO_VAE  # heads and AMP tables from the original's fixed values, kernels 2u - u % 2
    assert_same_weights(model, expected)


def test_ref2va_partition_copy_is_found(tmp_path, reference, expected):
    write_original_partition(tmp_path, reference, partition="Ref2VA")
    assert_same_weights(load_audio_vae(tmp_path), expected)


@pytest.mark.parametrize("where", ["root", "folder"])
def test_diffusers_folder(tmp_path, reference, expected, where):
    write_diffusers_folder(tmp_path / "audio_vae", reference)
    path = tmp_path if where == "root" else tmp_path / "audio_vae"
    assert locate_audio_vae(path).origin == "diffusers folder"
    model = load_audio_vae(path)
    assert model.config == TINY_AUDIO_VAE
    assert_same_weights(model, expected)


def test_a_diffusers_config_keeps_its_statistics_or_takes_the_released_ones_for_null(tmp_path, reference):
    folder = write_diffusers_folder(tmp_path / "audio_vae", reference)
    raw = json.loads((folder / "config.json").read_text())
    shifted = [0.25] * raw["latent_channels"]
    (folder / "config.json").write_text(json.dumps({**raw, "latents_mean": shifted}))
    assert locate_audio_vae(folder).config.latents_mean == tuple(shifted)
    (folder / "config.json").write_text(json.dumps({**raw, "latents_mean": None, "latents_std": None}))
    config = locate_audio_vae(folder).config
    assert (config.latents_mean, config.latents_std) == (RELEASED_LATENTS_MEAN, RELEASED_LATENTS_STD)


def test_checking_a_file_reads_its_headers_only(tmp_path, reference, monkeypatch):
    """A host refuses a broken audio VAE before it loads anything else: the check reads no tensor's data."""
    import h3_core.vae_audio_checkpoint as vae_audio_checkpoint

    folder = write_original_partition(tmp_path, reference)
    monkeypatch.setattr(vae_audio_checkpoint, "read_tensors", lambda *_: pytest.fail("tensor data was read"))
    model = check_audio_vae(folder)
    assert model.config == TINY_AUDIO_VAE and all(t.is_meta for t in model.parameters())
    rewrite(folder / "model.safetensors", lambda t: t.pop("pre_block.mlp.w2.bias"))
    with pytest.raises(CheckpointError, match=r"is missing 1 tensor\(s\): pre_block\.mlp\.w2\.bias"):
        check_audio_vae(folder)


@pytest.mark.parametrize("prefix", ["", "audio_vae."])
def test_comfy_single_file(tmp_path, reference, expected, prefix):
    other_models = {"model.diffusion_model.blocks.0.norm1.weight": torch.ones(4)} if prefix else {}
    path = write_comfy_single_file(tmp_path / "minimax_h3_audio_vae_fp32.safetensors", reference, prefix, other_models)
    model = load_audio_vae(path)
    stored = {name: tuple(torch.tensor(getattr(TINY_AUDIO_VAE, name)).tolist()) for name in STATISTICS}  # float32
    assert model.config == dataclasses.replace(TINY_AUDIO_VAE, **stored)  # the rest read off the shapes
    assert_same_weights(model, expected)


def test_single_file_with_weight_norm(tmp_path, reference, expected):
    """An original model.safetensors on its own: weight-norm pairs, no statistics (the released ones apply)."""
    folder = write_original_partition(tmp_path, reference)
    loose = (folder / "model.safetensors").rename(tmp_path / "audio_vae.safetensors")
    model = load_audio_vae(loose)
    assert model.config == TINY_AUDIO_VAE
    assert_same_weights(model, expected)


def test_single_file_statistics(tmp_path, reference):
    tensors = comfy_state_dict(reference)
    tensors["latents_mean"] = torch.linspace(-1, 1, 32)
    save_file(tensors, str(tmp_path / "custom.safetensors"))
    config = load_audio_vae(tmp_path / "custom.safetensors").config
    assert config.latents_mean == tuple(torch.linspace(-1, 1, 32).tolist())
    save_file({k: v for k, v in tensors.items() if k not in STATISTICS}, str(tmp_path / "bare.safetensors"))
    config = load_audio_vae(tmp_path / "bare.safetensors").config
    assert (config.latents_mean, config.latents_std) == (RELEASED_LATENTS_MEAN, RELEASED_LATENTS_STD)


def test_a_loaded_audio_vae_is_ready_to_run(tmp_path, reference):
    """Loaded for inference: eval mode (no dropout) and no gradients kept, whatever the layout."""
    folder = write_original_partition(tmp_path, reference)
    single = write_comfy_single_file(tmp_path / "single.safetensors", reference)
    for model in (load_audio_vae(folder), load_audio_vae(single)):
        assert not any(module.training for module in model.modules())
        assert not any(parameter.requires_grad for parameter in model.parameters())


def test_the_audio_vae_runs_in_fp32_unless_asked(tmp_path, reference):
    """A community bf16 / fp16 file is widened to fp32 (run as stored, its encodes were off by ~2x a latent's
    std on the tiny model, its decodes audibly worse); dtype=None keeps what the file stores."""
    folder = write_original_partition(tmp_path, reference)
    assert {t.dtype for t in load_audio_vae(folder).state_dict().values()} == {torch.float32}
    assert {t.dtype for t in load_audio_vae(folder, dtype=torch.bfloat16).state_dict().values()} == {torch.bfloat16}
    tensors = load_file(folder / "model.safetensors")
    save_file({name: tensor.bfloat16() for name, tensor in tensors.items()}, str(folder / "model.safetensors"))
    widened = load_audio_vae(folder)
    assert {t.dtype for t in widened.state_dict().values()} == {torch.float32}
    stored = load_audio_vae(folder, dtype=None)  # weight norm folded in fp32, stored back in the file's bf16
    assert {t.dtype for t in stored.state_dict().values()} == {torch.bfloat16}
    assert stored.encode(torch.zeros(2, 800)).dtype == torch.float32  # outputs are float32 whatever the weights
    assert all(torch.equal(a.float(), b) for a, b in zip(stored.state_dict().values(), widened.state_dict().values(),
                                                         strict=True))


# ----------------------------------------------------------------------------------------------
# Errors


def rewrite(path, change):
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, str(path))


def drop_biases(count):
    """A change that removes the first `count` biases (by name) from a state dict."""
    return lambda tensors: [tensors.pop(name) for name in sorted(n for n in tensors if n.endswith(".bias"))[:count]]


FILE = r"in .*model\.safetensors"
TENSOR_ERRORS = {
    "missing": (lambda t: t.pop("pre_block.mlp.w2.bias"), r"is missing 1 tensor\(s\): pre_block\.mlp\.w2\.bias"),
    "five missing": (
        drop_biases(5),
        r"is missing 5 tensor\(s\): ([^ ,]+\.bias, ){4}[^ ,]+\.bias\.$",
    ),
    "six missing": (  # five named, the rest counted
        drop_biases(6),
        r"is missing 6 tensor\(s\): ([^ ,]+\.bias, ){4}[^ ,]+\.bias and 1 more\.$",
    ),
    "unpaired weight norm": (
        lambda t: t.pop("decoder.conv_post.weight_v"),
        rf"'decoder\.conv_post\.weight_g' {FILE} has no 'decoder\.conv_post\.weight_v'",
    ),
    "extra": (
        lambda t: t.update({"decoder.extra.bias": torch.zeros(3)}),
        rf"Unexpected tensor 'decoder\.extra\.bias' {FILE}",
    ),
    "mis-shaped": (
        lambda t: t.update({"pre_block.proj.bias": torch.zeros(31)}),
        rf"'pre_block\.proj\.bias' {FILE} has shape \[31\], expected \[32\]",
    ),
    "mis-shaped folded": (
        lambda t: t.update({"decoder.conv_pre.weight_v": torch.zeros(256, 64, 5)}),
        rf"'decoder\.conv_pre\.weight' {FILE} has shape \[256, 64, 5\], expected \[256, 64, 7\]",
    ),
    "mis-shaped magnitude": (
        lambda t: t.update({"decoder.conv_pre.weight_g": torch.ones(256)}),
        rf"'decoder\.conv_pre\.weight_g' {FILE} has shape \[256\]; the magnitudes of a 'decoder\.conv_pre\.weight_v' "
        r"of shape \[256, 64, 7\] must be \[256, 1, 1\]\.$",
    ),
    "wrong filter": (
        lambda t: t["decoder.activation_post.upsample.filter"].mul_(1.01),
        rf"'decoder\.activation_post\.upsample\.filter' {FILE} is not the Kaiser",
    ),
    "mis-shaped filter": (
        lambda t: t.update({"decoder.activation_post.upsample.filter": torch.zeros(1, 1, 10)}),
        rf"'decoder\.activation_post\.upsample\.filter' {FILE} has shape \[1, 1, 10\], expected \[1, 1, 12\]",
    ),
    "extra filter": (
        lambda t: t.update({"decoder.ups.9.0.upsample.filter": torch.zeros(1, 1, 12)}),
        rf"Unexpected tensor 'decoder\.ups\.9\.0\.upsample\.filter' {FILE}",
    ),
    "log-std head": (
        lambda t: t.update({"logs_proj.bias": torch.zeros(8)}),
        rf"'logs_proj\.bias' {FILE} does not fit the log-std head",
    ),
}


@pytest.mark.parametrize("change, message", TENSOR_ERRORS.values(), ids=TENSOR_ERRORS.keys())
def test_tensor_errors_name_tensor_and_file(tmp_path, reference, change, message):
    folder = write_original_partition(tmp_path, reference)
    rewrite(folder / "model.safetensors", change)
    with pytest.raises(CheckpointError, match=message):
        load_audio_vae(folder)


def test_config_disagreements(tmp_path, reference):
    folder = write_original_partition(tmp_path, reference)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "latent_channels": 16}))
    with pytest.raises(CheckpointError, match="latent_channels=16 but metadata.json has vae_latent_channels=32"):
        load_audio_vae(folder)
    (folder / "config.json").write_text(json.dumps(config))
    metadata = json.loads((folder / "metadata.json").read_text())
    metadata["metadata"]["kwargs"]["decoder_type"] = "hifigan"
    (folder / "metadata.json").write_text(json.dumps(metadata))
    with pytest.raises(CheckpointError, match="BigVGAN decoder"):
        load_audio_vae(folder)
    del metadata["metadata"]["kwargs"]["decoder_rates"]
    (folder / "metadata.json").write_text(json.dumps(metadata))
    with pytest.raises(CheckpointError, match="metadata.json lacks decoder_rates"):
        load_audio_vae(folder)


def test_a_config_h3_cannot_build_is_refused_with_its_reason(tmp_path, reference):
    folder = write_original_partition(tmp_path, reference)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "latents_std": [0.0] * 32}))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(folder))}: Invalid audio VAE config: latents_std "
                                              "must be positive"):
        load_audio_vae(folder)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "metadata.json").write_text(json.dumps({"metadata": {"args": []}}))
    with pytest.raises(CheckpointError, match=r"metadata\.json has no 'metadata\.kwargs' object"):
        load_audio_vae(folder)


@pytest.mark.parametrize("layout, weights", [("original", "model.safetensors"),
                                             ("diffusers", "diffusion_pytorch_model.safetensors")])
def test_a_folder_without_its_weights_names_the_file_it_needs(tmp_path, reference, layout, weights):
    folder = (write_original_partition(tmp_path, reference) if layout == "original" else
              write_diffusers_folder(tmp_path / "audio_vae", reference))
    (folder / weights).unlink()
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(folder))} has no {re.escape(weights)}\.$"):
        load_audio_vae(tmp_path)


def test_a_damaged_config_is_refused_where_the_files_are_found(tmp_path, reference):
    """The VAE Loader node and h3 encode find the files (locate) before loading: a null in metadata.json was a
    TypeError traceback there, a clear refusal only once loading."""
    folder = write_original_partition(tmp_path, reference)
    metadata = json.loads((folder / "metadata.json").read_text())
    metadata["metadata"]["kwargs"]["decoder_rates"] = None
    (folder / "metadata.json").write_text(json.dumps(metadata))
    for find in (locate_audio_vae, load_audio_vae):
        with pytest.raises(CheckpointError, match="The audio VAE at .* does not describe a model H3 can build"):
            find(tmp_path)


def test_wrong_folder_and_file(tmp_path):
    transformer = tmp_path / "transformer"
    transformer.mkdir()
    (transformer / "config.json").write_text(json.dumps({"_class_name": "MiniMaxH3Transformer3DModel"}))
    with pytest.raises(CheckpointError, match="is not an H3 audio VAE: expected an original 'audio_vae' folder"):
        load_audio_vae(transformer)
    save_file({"blocks.0.norm1.weight": torch.ones(4)}, str(tmp_path / "dit.safetensors"))
    with pytest.raises(CheckpointError, match="dit.safetensors holds no H3 audio VAE tensors"):
        load_audio_vae(tmp_path / "dit.safetensors")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_audio_vae(tmp_path / "nowhere")


def test_pickles_are_refused(tmp_path, reference):
    (tmp_path / "audio_vae.ckpt").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match=r"^audio_vae\.ckpt is a pickle checkpoint \(\.ckpt\); H3 loads only "):
        load_audio_vae(tmp_path / "audio_vae.ckpt")
    folder = write_diffusers_folder(tmp_path / "audio_vae", reference)
    (folder / "diffusion_pytorch_model.safetensors").rename(folder / "diffusion_pytorch_model.bin")
    with pytest.raises(CheckpointError, match="diffusion_pytorch_model.bin is a pickle"):
        load_audio_vae(tmp_path)


@pytest.mark.parametrize("dropped, message", [
    ("mean_proj.weight", r"single\.safetensors has no tensor 'mean_proj\.weight'; cannot tell the audio VAE's size\."),
    ("decoder.resblocks.20.", r"single\.safetensors: 7 decoder upsamplers and 20 AMP blocks do not form stages\."),
    ("decoder.ups.", r"single\.safetensors: 0 decoder upsamplers and 21 AMP blocks do not form stages\."),
])
def test_a_single_file_whose_size_cannot_be_read_says_why(tmp_path, reference, dropped, message):
    """A single file's config comes from its tensors' shapes: 7 upsampling stages of 3 AMP blocks in the tiny
    model; a file missing what tells a size, or whose blocks do not split into its stages, is refused by name."""
    tensors = {k: v for k, v in comfy_state_dict(reference).items() if not k.startswith(dropped)}
    save_file(tensors, str(tmp_path / "single.safetensors"))
    with pytest.raises(CheckpointError, match=message):
        load_audio_vae(tmp_path / "single.safetensors")


def test_a_tensor_of_the_wrong_rank_in_a_single_file_is_a_clear_refusal(tmp_path, reference):
    """A single file's config is read off its tensors' shapes: a 1-D tensor where a kernel goes raised a bare
    IndexError (a traceback from the command line)."""
    tensors = comfy_state_dict(reference)
    key = next(key for key in tensors if key.startswith("decoder.ups.0") and key.endswith("weight"))
    tensors[key] = tensors[key].flatten()
    save_file(tensors, str(tmp_path / "odd.safetensors"))
    with pytest.raises(CheckpointError, match=r"The audio VAE at .*odd.safetensors does not describe a model H3 can "
                                              r"build \(IndexError"):
        load_audio_vae(tmp_path / "odd.safetensors")
