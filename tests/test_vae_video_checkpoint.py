"""The video VAE loader on tiny random checkpoints written in every layout users have, and its errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from video_vae_checkpoints import (
    original_configs,
    original_state_dict,
    reference_video_vae,
    tiny_config,
    write_comfy_single_file,
    write_diffusers_folder,
    write_original_partition,
)

from h3_core.vae_video import FP32_MODULES
from h3_core.vae_video_checkpoint import (
    CheckpointError,
    check_video_vae,
    convert_state_dict,
    load_video_vae,
    locate_video_vae,
)


@pytest.fixture(scope="module")
def config():
    return tiny_config(seed=3)


@pytest.fixture(scope="module")
def reference(config):
    return reference_video_vae(config, seed=11)


@pytest.fixture(scope="module")
def expected(reference, config):
    return convert_state_dict(reference.state_dict(), "diffusers", config)


def assert_same_weights(model, expected, dtype=torch.float32):
    got = model.state_dict()
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == dtype, name
        assert torch.equal(got[name], tensor.to(dtype)), name


def test_mapping_matches_the_release_names(reference, config, expected):
    """Our names are the release's: the fixture's independent inverse mapping lands on them exactly."""
    release = original_state_dict(reference.state_dict(), config)
    assert set(release) - set(expected) == {"decoder.mask_token"}
    assert all(torch.equal(release[name], tensor) for name, tensor in expected.items())


@pytest.mark.parametrize("where", ["root", "partition", "video_vae", "source"])
def test_original_release_layouts(tmp_path, reference, config, expected, where):
    folder = write_original_partition(tmp_path, reference.state_dict(), config.replace(decoder_tiling=False))
    path = {"root": tmp_path, "partition": tmp_path / "FL2VA", "video_vae": folder, "source": folder / "source"}[where]
    source = locate_video_vae(path)
    assert source.naming == "original" and source.files == (folder / "source" / "model.safetensors",)
    assert source.where == f"{folder / 'source' / 'model.safetensors'} (original folder)"
    model = load_video_vae(path)
    assert model.config == config.replace(decoder_tiling=False)  # shapes, statistics and tiling from the two configs
    assert_same_weights(model, expected)


def test_diffusers_layout_sharded(tmp_path, reference, config, expected):
    write_diffusers_folder(tmp_path / "vae", reference)
    assert len(list((tmp_path / "vae").glob("*.safetensors"))) > 2  # really sharded, with an index
    source = locate_video_vae(tmp_path)
    assert source.naming == "diffusers" and source.config == config
    assert source.where == f"{tmp_path / 'vae'} (diffusers folder)"  # messages name the folder, not one shard
    assert_same_weights(load_video_vae(tmp_path / "vae"), expected)


@pytest.mark.parametrize("prefix", ["", "vae.", "video_vae."])
def test_comfy_single_file(tmp_path, reference, config, expected, prefix):
    others = {  # an all-in-one file's other models, never read
        "model.diffusion_model.blocks.0.norm1.weight": torch.ones(4),
        "audio_vae.encoder.block.0.weight": torch.ones(2),
    }
    path = write_comfy_single_file(
        tmp_path / "minimax_h3_video_vae_fp16.safetensors", reference.state_dict(), config, prefix,
        extra=others if prefix else None,
    )  # fmt: skip
    source = locate_video_vae(path)
    assert (source.naming, source.prefix, source.config) == ("original", prefix, None)
    # Single files carry no config; the latent statistics come from the file's own tensors.
    model = load_video_vae(path, config=config.replace(latents_mean=(0.0,) * 24, latents_std=(1.0,) * 24))
    assert model.config == config
    assert_same_weights(model, {k: v.half() for k, v in expected.items()}, dtype=torch.float16)


def test_dtype_policy_at_load(tmp_path, reference, config, expected):
    write_original_partition(tmp_path, reference.state_dict(), config)
    model = load_video_vae(tmp_path, dtype=torch.bfloat16)
    for name, tensor in model.state_dict().items():
        fp32 = any(part in FP32_MODULES for part in name.split("."))
        assert tensor.dtype == (torch.float32 if fp32 else torch.bfloat16), name
        assert torch.equal(tensor, expected[name].to(tensor.dtype)), name
    assert model.dtype == torch.bfloat16 and model.encoder.conv_in.weight.dtype == torch.float32


def test_a_float8_file_loads_in_bf16_as_stored_otherwise(tmp_path, reference, config, expected):
    """dtype=None ('checkpoint' in H3 VAE Loader) kept float8, in which no convolution runs: the first encode
    failed with torch's raw "reflection_pad3d not implemented for 'Float8_e4m3fn'"."""
    folder = write_original_partition(tmp_path, reference.state_dict(), config)
    path = folder / "source" / "model.safetensors"
    save_file({name: t.to(torch.float8_e4m3fn) if t.is_floating_point() else t
               for name, t in load_file(str(path)).items()}, str(path))
    model = load_video_vae(tmp_path)
    for name, tensor in model.state_dict().items():
        fp32 = any(part in FP32_MODULES for part in name.split("."))
        assert tensor.dtype == (torch.float32 if fp32 else torch.bfloat16), name
        assert torch.equal(tensor, expected[name].to(torch.float8_e4m3fn).to(tensor.dtype)), name


# -- errors -----------------------------------------------------------------------------------


@pytest.fixture
def original(tmp_path, reference, config):
    folder = write_original_partition(tmp_path, reference.state_dict(), config)
    return folder / "source" / "model.safetensors"


def rewrite(path, change):
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def test_a_damaged_config_is_refused_where_the_files_are_found(original):
    """The VAE Loader node and h3 encode find the files before loading: a null source path in config.json was a
    TypeError traceback there."""
    folder = original.parent.parent
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "source_safetensors_path": None}))
    with pytest.raises(CheckpointError, match="The video VAE at .* does not describe a model H3 can build"):
        locate_video_vae(folder)


def test_missing_tensor_is_named(original):
    rewrite(original, lambda t: t.pop("decoder.transformer_blocks.0.ff.w2.bias"))
    pattern = r"missing 1 tensor\(s\): decoder\.transformer_blocks\.0\.ff\.w2\.bias\."
    with pytest.raises(CheckpointError, match=pattern) as error:
        load_video_vae(original.parent.parent)
    assert str(original.parent) in str(error.value)


def test_checking_a_folder_reads_its_headers_only(original, monkeypatch):
    """A host refuses a broken video VAE before it loads anything else: the check reads no tensor's data, and
    gives the dtypes loading would (what it sizes the VAE's memory by)."""
    import h3_core.vae_video_checkpoint as vae_video_checkpoint

    folder = original.parent.parent
    loaded = {name: t.dtype for name, t in load_video_vae(folder, dtype=torch.bfloat16).state_dict().items()}
    monkeypatch.setattr(vae_video_checkpoint, "open_safetensors", lambda *_: pytest.fail("tensor data was read"))
    checked = check_video_vae(folder, torch.bfloat16)
    assert all(t.is_meta for t in checked.state_dict().values())
    assert {name: t.dtype for name, t in checked.state_dict().items()} == loaded
    assert {torch.float32, torch.bfloat16} <= set(loaded.values())
    rewrite(original, lambda t: t.pop("decoder.transformer_blocks.0.ff.w2.bias"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): decoder\.transformer_blocks\.0\.ff\.w2\.bias\."):
        check_video_vae(folder)


def test_unexpected_tensor_is_named_with_its_file(original):
    rewrite(original, lambda t: t.update({"decoder.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"Unexpected tensor 'decoder\.extra\.weight' in .*model\.safetensors"):
        load_video_vae(original.parent.parent)


def test_misshaped_tensor_is_named_with_its_file(original):
    rewrite(original, lambda t: t.update({"encoder.conv_in.bias": torch.zeros(9)}))
    pattern = r"'encoder\.conv_in\.bias' in .*model\.safetensors has shape \[9\], expected \[8\]"
    with pytest.raises(CheckpointError, match=pattern):
        load_video_vae(original.parent.parent)


def test_misshaped_mask_token_is_refused(original):
    rewrite(original, lambda t: t.update({"decoder.mask_token": torch.zeros(1, 1, 3)}))
    with pytest.raises(CheckpointError, match=r"'decoder\.mask_token' in .*model\.safetensors has shape \[1, 1, 3\]"):
        load_video_vae(original.parent.parent)


def test_single_file_of_another_size_needs_its_config(tmp_path, reference, config):
    path = write_comfy_single_file(tmp_path / "vae.safetensors", reference.state_dict(), config)
    with pytest.raises(CheckpointError, match=r"Tensor '[\w.]+' in .*vae\.safetensors has shape \[[\d, ]+\], expected"):
        load_video_vae(path)  # the release's config, checked tensor by tensor


def test_diffusers_folder_missing_a_qkv_part(tmp_path, reference):
    folder = write_diffusers_folder(tmp_path / "vae", reference, max_shard_size="10GB")
    weights = folder / "diffusion_pytorch_model.safetensors"
    rewrite(weights, lambda t: t.pop("decoder.transformer_blocks.0.attn.to_v.bias"))
    with pytest.raises(CheckpointError, match=r"lacks to_v for this attention"):
        load_video_vae(folder)


def test_diffusers_attention_parts_that_do_not_fuse_are_refused(tmp_path, reference):
    """to_q, to_k and to_v are fused into one qkv per head: parts of different shapes are named, not cut."""
    folder = write_diffusers_folder(tmp_path / "vae", reference, max_shard_size="10GB")
    weights = folder / "diffusion_pytorch_model.safetensors"
    key = "decoder.transformer_blocks.0.attn.to_k.weight"
    rewrite(weights, lambda t: t.update({key: t[key][:-1].clone()}))
    with pytest.raises(CheckpointError, match=r"in .*: to_q/to_k/to_v shapes .* do not fuse per head\.$"):
        load_video_vae(folder)


def test_wrong_folders_say_what_was_expected(tmp_path, reference, config):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_video_vae(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"not an H3 video VAE: expected an original 'video_vae' folder"):
        load_video_vae(tmp_path / "empty")
    transformer = tmp_path / "transformer"
    transformer.mkdir()
    (transformer / "config.json").write_text(json.dumps({"_class_name": "MiniMaxH3Transformer3DModel"}))
    save_file({"proj_in.weight": torch.zeros(2, 2)}, str(transformer / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(CheckpointError, match=r"holds a MiniMaxH3Transformer3DModel checkpoint, not the H3 video VAE"):
        load_video_vae(transformer)
    save_file({"blocks.0.norm1.weight": torch.zeros(2)}, str(tmp_path / "dit.safetensors"))
    with pytest.raises(CheckpointError, match=r"dit\.safetensors is not an H3 video VAE file"):
        load_video_vae(tmp_path / "dit.safetensors")


def test_other_architecture_in_the_source_config_is_refused(tmp_path, reference, config):
    folder = write_original_partition(tmp_path, reference.state_dict(), config)
    _, source = original_configs(config)
    source["use_vit_decoder"] = False
    (folder / "source" / "config.json").write_text(json.dumps(source))
    with pytest.raises(CheckpointError, match=r"another architecture .*use_vit_decoder=False"):
        load_video_vae(folder)
    del source["z_channels"]
    source["use_vit_decoder"] = True
    (folder / "source" / "config.json").write_text(json.dumps(source))
    with pytest.raises(CheckpointError, match=r"source/config\.json lacks 'z_channels'"):
        load_video_vae(folder)


@pytest.mark.parametrize("field, value", [("ch_mult", None), ("num_res_blocks", 1.5), ("vit_decoder_kwargs", None)])
def test_a_config_value_of_the_wrong_kind_is_a_clear_refusal(tmp_path, reference, config, field, value):
    """A null or a float where the model builder wants a list or an integer raised a bare TypeError."""
    folder = write_original_partition(tmp_path, reference.state_dict(), config)
    _, source = original_configs(config)
    source[field] = value
    (folder / "source" / "config.json").write_text(json.dumps(source))
    with pytest.raises(CheckpointError, match=r"The video VAE at .* does not describe a model H3 can build \(TypeError"):
        load_video_vae(folder)


@pytest.mark.parametrize("name", ["minimax_h3_video_vae.ckpt", "video_vae.pt"])
def test_pickles_are_refused(tmp_path, name):
    path = tmp_path / name
    torch.save({"encoder.conv_in.weight": torch.zeros(1)}, path)
    with pytest.raises(CheckpointError, match="pickle checkpoint"):
        load_video_vae(path)
    renamed = path.rename(tmp_path / "video_vae.safetensors")  # torch.save's file under a safetensors name
    with pytest.raises(CheckpointError, match=r"^video_vae.safetensors is a pickle checkpoint \(torch.save's "
                                              r"format\) under a .safetensors name"):
        load_video_vae(renamed)


def test_quantized_single_file_is_refused(tmp_path, reference, config):
    path = write_comfy_single_file(
        tmp_path / "q.safetensors", reference.state_dict(), config,
        extra={"decoder.transformer_blocks.0.ff.w1.weight_scale": torch.ones(1)},
    )  # fmt: skip
    with pytest.raises(CheckpointError, match="quantized video VAE"):
        load_video_vae(path, config=config)


def test_fields_a_release_config_may_leave_out_take_the_releases_values(config):
    """What the release hard-codes when its configs do not name it (clip length, tiling, channels, padding, the
    decoder's rotary settings) is VideoVAEConfig's default."""
    from h3_core.vae_video import VideoVAEConfig
    from h3_core.vae_video_checkpoint import config_from_original

    wrapper, source = original_configs(config)
    optional_wrapper = ("vae_clip_length", "vae_token_drop", "vae_tile_size", "vae_tile_overlap_min",
                        "vae_encoder_tiling", "vae_decoder_tiling")
    vit = {key: value for key, value in source["vit_decoder_kwargs"].items() if not key.startswith("rope_")}
    source = {key: value for key, value in source.items()
              if key not in ("in_channels", "out_ch", "padding_mode", "norm_num_groups")}
    got = config_from_original({key: value for key, value in wrapper.items() if key not in optional_wrapper},
                               {**source, "vit_decoder_kwargs": vit})
    release = VideoVAEConfig()
    for field in ("clip_length", "token_drop", "tile_size", "tile_min_overlap", "encoder_tiling", "decoder_tiling",
                  "in_channels", "out_channels", "spatial_padding_mode", "decoder_rope_theta",
                  "decoder_rope_dim_ratio", "norm_num_groups"):
        assert getattr(got, field) == getattr(release, field), field
    with pytest.raises(CheckpointError, match=r"^video_vae: .*latents_mean"):  # a config the model refuses
        config_from_original({**wrapper, "latents_mean": [0.0]}, source)


def test_a_single_file_missing_a_statistic_or_the_encoder_is_refused(tmp_path, reference, config):
    path = write_comfy_single_file(tmp_path / "vae.safetensors", reference.state_dict(), config)
    tensors = load_file(str(path))
    save_file({name: tensor for name, tensor in tensors.items() if name != "latents_std"}, str(path))
    with pytest.raises(CheckpointError, match=r"^vae\.safetensors holds 'latents_mean' without its partner\.$"):
        load_video_vae(path)
    save_file({name: tensor for name, tensor in tensors.items() if not name.startswith("encoder.")}, str(path))
    with pytest.raises(CheckpointError, match=r"vae\.safetensors holds no H3 video VAE encoder tensors \(expected "
                                              r"'encoder\.down\.N\.\*' or 'encoder\.down_blocks\.N\.\*'\)\.$"):
        locate_video_vae(path)


def test_a_folder_without_weights_or_a_file_of_two_vaes_is_refused(tmp_path, reference, config):
    folder = write_original_partition(tmp_path, reference.state_dict(), config)
    (folder / "source" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"video_vae has no video VAE weights: looked for "
                                              r"source/model\.safetensors, model\.safetensors\.$"):
        locate_video_vae(folder)
    single = write_comfy_single_file(tmp_path / "one.safetensors", reference.state_dict(), config, prefix="vae.")
    tensors = load_file(str(single))
    save_file({**tensors, **{"video_vae." + name.removeprefix("vae."): t.clone() for name, t in tensors.items()}},
              str(tmp_path / "two.safetensors"))
    with pytest.raises(CheckpointError, match=r"^two\.safetensors holds several video VAEs \(under 'vae\.', "
                                              r"'video_vae\.'\)\.$"):
        locate_video_vae(tmp_path / "two.safetensors")


def test_a_loaded_video_vae_is_ready_to_run(original):
    """Loaded for inference: eval mode (no dropout) and no gradients kept."""
    model = load_video_vae(original.parent.parent)
    assert not any(module.training for module in model.modules())
    assert not any(parameter.requires_grad for parameter in model.parameters())


def test_the_release_configs_must_agree_on_the_latent_width(original, config):
    """config.json and source/config.json both name the latent width (z_channels, embed_dim, latent_channels): a
    folder whose files disagree is refused by the file that disagrees, not loaded at one of the widths."""
    folder = original.parent.parent
    wrapper, source = original_configs(config)
    width = config.latent_channels
    (folder / "source" / "config.json").write_text(json.dumps({**source, "embed_dim": width + 1}))
    with pytest.raises(CheckpointError, match=rf"source/config\.json: embed_dim must equal z_channels \({width}\)\.$"):
        load_video_vae(folder)
    (folder / "source" / "config.json").write_text(json.dumps(source))
    (folder / "config.json").write_text(json.dumps({**wrapper, "latent_channels": width + 1}))
    with pytest.raises(CheckpointError, match=rf"video_vae/config\.json: latent_channels is not source z_channels "
                                              rf"\({width}\)\.$"):
        load_video_vae(folder)


def test_a_diffusers_config_the_model_refuses_says_why(tmp_path, reference):
    folder = write_diffusers_folder(tmp_path / "vae", reference)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "latents_mean": [0.0]}))
    with pytest.raises(CheckpointError, match=r"^diffusers video VAE config: .*latents_mean"):
        load_video_vae(folder)


def test_a_single_files_statistics_must_fit_its_config(tmp_path, reference, config):
    path = write_comfy_single_file(tmp_path / "vae.safetensors", reference.state_dict(), config)
    rewrite(path, lambda tensors: tensors.update(latents_std=torch.ones(config.latent_channels + 1)))
    with pytest.raises(CheckpointError, match=rf"Tensor 'latents_std' in .*vae\.safetensors has shape "
                                              rf"\[{config.latent_channels + 1}\], expected \[{config.latent_channels}\] "
                                              "for this config"):
        load_video_vae(path, config=config)


def test_a_config_without_weights_beside_it_is_not_taken_for_a_diffusers_folder(tmp_path, reference):
    """A folder is a diffusers VAE only with safetensors beside its config.json; one without (weights not yet
    downloaded) is refused as no video VAE, naming what was expected."""
    folder = write_diffusers_folder(tmp_path / "vae", reference)
    for shard in folder.glob("*.safetensors"):
        shard.unlink()
    with pytest.raises(CheckpointError, match=r"is not an H3 video VAE: expected an original 'video_vae' folder"):
        locate_video_vae(folder)
