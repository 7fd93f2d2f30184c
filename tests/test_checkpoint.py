"""The DiT loader on tiny random checkpoints written in every layout users have, and its errors."""

import json
import re
from pathlib import Path

import pytest
import torch
from reference_checkpoints import (
    original_state_dict,
    reference_dit,
    write_comfy_single_file,
    write_diffusers_folder,
    write_original_partition,
)
from safetensors.torch import load_file, save_file

import h3_core.checkpoint as checkpoint
import h3_core.weights as weights
from h3_core.checkpoint import CheckpointError, DiTReader, convert_state_dict, load_dit, locate_dit


@pytest.fixture(scope="module")
def reference():
    from h3_core.config import TINY_DIT

    return reference_dit(TINY_DIT, seed=11)


@pytest.fixture(scope="module")
def expected(reference):
    return convert_state_dict(reference.state_dict(), "diffusers", head_dim=32)


def assert_same_weights(model, expected):
    got = model.state_dict()
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("qkv_layout", ["interleaved", "stacked"])
def test_the_written_original_layouts_are_what_diffusers_converts_back(reference, qkv_layout):
    """The tests write the original and ComfyUI layouts with their own inverse of diffusers' names
    (reference_checkpoints.original_state_dict); diffusers' single-file converter reads them back to the
    reference's own state dict exactly, so what our loader is tested on is the layout diffusers knows."""
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers
    from h3_core.config import TINY_DIT

    state = reference.state_dict()
    written = original_state_dict(state, TINY_DIT, qkv_layout=qkv_layout)
    back = convert_minimax_h3_transformer_checkpoint_to_diffusers(written, dict(reference.config), qkv_layout=qkv_layout)
    assert set(back) == set(state) and all(torch.equal(back[key], state[key]) for key in state)


@pytest.mark.parametrize("where", ["root", "partition", "transformer"])
def test_original_partition_layouts(tmp_path, reference, expected, tiny_config, where):
    folder = write_original_partition(tmp_path, reference.state_dict(), tiny_config)
    path = {"root": tmp_path, "partition": tmp_path / "FL2VA", "transformer": folder}[where]
    source = locate_dit(path)
    assert source.naming == "native" and source.qkv_layout == "interleaved" and len(source.files) == 3
    assert source.config == tiny_config
    assert_same_weights(load_dit(path), expected)


def test_a_config_naming_more_blocks_than_the_files_hold_is_refused_at_once(tmp_path, reference, tiny_config):
    """A config.json of another model (num_layers 200000) built that model on meta first (minutes) before the
    tensors were found missing."""
    folder = write_original_partition(tmp_path, reference.state_dict(), tiny_config)
    raw = json.loads((folder / "config.json").read_text())
    key = next(key for key in raw if key in ("num_layers", "depth", "num_hidden_layers"))
    raw[key] = 200000
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=f"says 200000 transformer blocks, but the folder's files hold "
                                              f"{tiny_config.num_layers}"):
        locate_dit(folder)


def test_ref2va_partition_is_chosen_by_name(tmp_path, reference, expected, tiny_config):
    other = reference_dit(tiny_config, seed=99)
    write_original_partition(tmp_path, other.state_dict(), tiny_config, partition="FL2VA")
    write_original_partition(tmp_path, reference.state_dict(), tiny_config, partition="Ref2VA")
    assert_same_weights(load_dit(tmp_path, partition="ref2va"), expected)
    assert_same_weights(load_dit(tmp_path, partition="fl2va"),
                        convert_state_dict(other.state_dict(), "diffusers", head_dim=32))


def test_a_loaded_dit_refuses_the_other_partitions_conditioning(tmp_path, reference, tiny_config):
    """Both partitions have the same shapes, so a ref2va request on the FL2VA weights would just run."""
    from types import SimpleNamespace

    from h3_core.conditioning import RequestError
    from h3_core.pipeline import sample

    write_original_partition(tmp_path, reference.state_dict(), tiny_config, partition="Ref2VA")
    dit = load_dit(tmp_path, partition="ref2va")
    assert dit.partition == "ref2va"
    with pytest.raises(RequestError, match="A t2va conditioning runs on the fl2va DiT; this one was loaded as the "
                                           "ref2va partition"):
        sample(dit, SimpleNamespace(task="t2va", layout="never read: the partition is refused first"), 0)


def test_repository_root_gives_each_partition_its_own_folder(tmp_path, reference, expected, tiny_config):
    """The Hub repository's root holds the FL2VA DiT in transformer/ and the Ref2VA one in transformer_ref/."""
    write_diffusers_folder(tmp_path / "transformer", reference_dit(tiny_config, seed=99))
    write_diffusers_folder(tmp_path / "transformer_ref", reference)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "MiniMaxH3Pipeline",
                                                           "transformer": ["diffusers", "X"],
                                                           "transformer_ref": ["diffusers", "X"]}))
    assert locate_dit(tmp_path, partition="ref2va").files[0].parent.name == "transformer_ref"
    assert_same_weights(load_dit(tmp_path, partition="ref2va"), expected)
    assert locate_dit(tmp_path, partition="fl2va").files[0].parent.name == "transformer"
    with pytest.raises(CheckpointError, match="holds H3's FL2VA DiT .'transformer' beside 'transformer_ref'"):
        locate_dit(tmp_path / "transformer", partition="ref2va")
    with pytest.raises(CheckpointError, match="holds H3's Ref2VA DiT .a 'transformer_ref' folder"):
        locate_dit(tmp_path / "transformer_ref", partition="fl2va")


@pytest.mark.parametrize("where", ["partition", "transformer"])
def test_the_other_partitions_folder_is_refused(tmp_path, reference, tiny_config, where):
    """Both partitions have the same shapes: only the release's own labels tell them apart."""
    folder = write_original_partition(tmp_path, reference.state_dict(), tiny_config, partition="Ref2VA")
    path = {"partition": tmp_path / "Ref2VA", "transformer": folder}[where]
    assert locate_dit(path, partition="ref2va").config == tiny_config
    with pytest.raises(CheckpointError, match="holds H3's Ref2VA DiT .its model_index.json says so.*choose "
                                              "partition 'ref2va', or give the FL2VA weights"):
        locate_dit(path, partition="fl2va")
    (tmp_path / "Ref2VA" / "model_index.json").unlink()  # then the folder's name says it
    with pytest.raises(CheckpointError, match="holds H3's Ref2VA DiT .it is in Ref2VA/"):
        locate_dit(path, partition="fl2va")


def test_a_single_file_named_for_the_other_partition_is_refused(tmp_path, reference, tiny_config):
    ref = write_comfy_single_file(tmp_path / "minimax_h3_ref2va_bf16.safetensors", reference.state_dict(), tiny_config)
    assert locate_dit(ref, partition="ref2va").files == (ref,)
    with pytest.raises(CheckpointError, match="holds H3's Ref2VA DiT .by its file name.*choose partition 'ref2va'"):
        locate_dit(ref, partition="fl2va")
    fl = ref.rename(tmp_path / "minimax_h3_fl2va_bf16.safetensors")
    with pytest.raises(CheckpointError, match="holds H3's FL2VA DiT .by its file name"):
        locate_dit(fl, partition="ref2va")
    neutral = fl.rename(tmp_path / "my_h3_finetune.safetensors")  # a name that does not say: either is taken
    assert locate_dit(neutral, partition="ref2va").files == locate_dit(neutral, partition="fl2va").files


def test_diffusers_layout(tmp_path, reference, expected, tiny_config):
    write_diffusers_folder(tmp_path / "transformer_ref", reference)
    assert len(list((tmp_path / "transformer_ref").glob("*.safetensors"))) > 2  # really sharded
    source = locate_dit(tmp_path, partition="ref2va")
    assert source.naming == "diffusers" and source.config == tiny_config
    assert_same_weights(load_dit(tmp_path, partition="ref2va"), expected)


def test_one_shard_of_a_sharded_dit_or_text_encoder_is_said_to_be_one(tmp_path, reference):
    """ComfyUI lists every shard of a release folder linked into models/: one picked was refused as a DiT file
    missing its tensors ('not an H3 DiT file, or one cut short')."""
    write_diffusers_folder(tmp_path / "transformer", reference)
    shard = sorted((tmp_path / "transformer").glob("*.safetensors"))[0]
    with pytest.raises(CheckpointError, match=f"{shard.name} is one shard of a sharded DiT .* give its folder, "):
        locate_dit(shard)
    # a text encoder's too
    import json

    from safetensors.torch import save_file

    from h3_core.text_checkpoint import locate_text_encoder

    encoder = tmp_path / "text_encoder"
    encoder.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        save_file({"x": torch.zeros(1)}, str(encoder / name))
    (encoder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors is one shard of a sharded text encoder"):
        locate_text_encoder(encoder / "model-00002-of-00002.safetensors")


@pytest.mark.parametrize("prefix,suffix", [("", ".safetensors"), ("model.diffusion_model.", ".safetensors"),
                                           ("diffusion_model.", ".safetensors"), ("", ".sft")])
def test_comfy_single_file(tmp_path, reference, expected, tiny_config, prefix, suffix):
    """.sft, the same format under a name ComfyUI lists, was refused as 'not a .safetensors file'."""
    path = write_comfy_single_file(tmp_path / f"minimax_h3_fl2va_bf16{suffix}", reference.state_dict(), tiny_config, prefix)
    source = locate_dit(path)
    assert source.qkv_layout == "stacked" and source.config is None
    model = load_dit(path)
    assert model.config == tiny_config  # inferred from shapes
    assert_same_weights(model, expected)


def test_checkpoint_dtypes_are_kept(tmp_path, reference, tiny_config):
    tensors = original_state_dict(reference.state_dict(), tiny_config, qkv_layout="stacked")
    fp32 = ("video_patch_proj", "audio_patch_proj", "time_embedder", "final_layer.video_out", "final_layer.audio_out", "rope")
    mixed = {k: (v if k.startswith(fp32) else v.to(torch.bfloat16)) for k, v in tensors.items()}
    save_file(mixed, str(tmp_path / "dit.safetensors"))
    model = load_dit(tmp_path / "dit.safetensors")
    for name, param in model.state_dict().items():
        assert param.dtype == mixed[name].dtype, name
    assert model.dtype == torch.bfloat16


def test_a_file_cast_whole_to_bf16_keeps_its_rope_table_check(tmp_path, reference, tiny_config):
    """A DiT cast with `.to(bf16)` holds rope.inv_freq in bf16 too: it was refused as "does not match rope_theta".
    It agrees within bf16's rounding; a table of another theta is still refused."""
    tensors = original_state_dict(reference.state_dict(), tiny_config, qkv_layout="stacked")
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(tmp_path / "dit.safetensors"))
    model = load_dit(tmp_path / "dit.safetensors")
    assert model.rope_inv_freq.dtype == torch.float32 and torch.equal(model.rope_inv_freq, load_dit(
        write_comfy_single_file(tmp_path / "fp32.safetensors", reference.state_dict(), tiny_config)).rope_inv_freq)
    other = dict(tensors, **{"rope.inv_freq": tensors["rope.inv_freq"] ** 1.1})
    save_file({k: v.to(torch.bfloat16) for k, v in other.items()}, str(tmp_path / "other.safetensors"))
    with pytest.raises(CheckpointError, match="does not match rope_theta"):
        load_dit(tmp_path / "other.safetensors")


def test_a_rope_table_of_another_length_than_the_config_says_is_refused(tmp_path, reference, tiny_config):
    """A release folder's config.json names the rope table's length; a table of another length in its files
    (a config edited, or taken from another model) is refused naming both, not read with the config's."""
    folder = write_original_partition(tmp_path, reference.state_dict(), tiny_config)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rope_inv_freq_len": tiny_config.rope_freq_dim - 1}))
    shard = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]["rope.inv_freq"]
    with pytest.raises(CheckpointError, match=re.escape(
            f"'rope.inv_freq' in {folder / shard} has shape [{tiny_config.rope_freq_dim}], expected "
            f"[{tiny_config.rope_freq_dim - 1}].")):
        load_dit(folder.parent)


def test_a_folder_without_both_a_config_and_weights_is_no_checkpoint(tmp_path, reference, tiny_config):
    """A transformer folder needs config.json and its shards: one holding only either (a download stopped
    early, weights copied without their config) is refused with what a checkpoint folder holds."""
    folder = write_original_partition(tmp_path / "release", reference.state_dict(), tiny_config)
    for kept in ("config.json", "model-00001-of-00003.safetensors"):
        part = tmp_path / f"only-{kept}"
        part.mkdir()
        (part / kept).write_bytes((folder / kept).read_bytes())
        with pytest.raises(CheckpointError, match=re.escape(
                f"{part} is not an H3 DiT checkpoint for partition 'fl2va': expected a folder with config.json and "
                "*.safetensors shards (an original 'FL2VA/transformer' folder, a diffusers 'transformer' folder, or "
                "either of their parents), or a single .safetensors or .gguf file.")):
            locate_dit(part)


def test_loading_streams_one_tensor_at_a_time(tmp_path, reference, monkeypatch):
    """Tensors are read and assigned one by one (diffusers q/k/v wait for their siblings): never a second copy.
    (The check of the headers before, on meta tensors, is not counted.)"""
    write_diffusers_folder(tmp_path / "transformer", reference)
    reads, consumed, waiting = [0], [0], []
    real_to_native, real_assign = checkpoint.to_native, weights._assign

    def counting_to_native(items, *args):
        def counted():
            for item in items:
                reads[0] += not item[1].is_meta
                yield item

        return real_to_native(counted(), *args)

    def counting_assign(model, name, tensor):
        if not tensor.is_meta:
            consumed[0] += 3 if name.endswith("qkv_proj.weight") else 1  # a fused qkv came from three reads
            waiting.append(reads[0] - consumed[0])
        real_assign(model, name, tensor)

    monkeypatch.setattr(checkpoint, "to_native", counting_to_native)
    monkeypatch.setattr(weights, "_assign", counting_assign)
    load_dit(tmp_path)
    assert consumed[0] == reads[0] == len(reference.state_dict())
    assert max(waiting) <= 2  # at most two of a q/k/v triple wait for the third


# ---- errors -------------------------------------------------------------------------------------


def shard_holding(folder, name):
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return folder / index["weight_map"][name]


def test_missing_tensor_is_named(tmp_path, reference, tiny_config):
    folder = write_original_partition(tmp_path, reference.state_dict(), tiny_config)
    shard = shard_holding(folder, "blocks.1.mlp.fc2.weight")
    tensors = load_file(str(shard))
    del tensors["blocks.1.mlp.fc2.weight"]
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*blocks\.1\.mlp\.fc2\.weight"):
        load_dit(tmp_path)


def test_unexpected_tensor_is_named_with_its_file(tmp_path, reference, tiny_config):
    folder = write_original_partition(tmp_path, reference.state_dict(), tiny_config)
    shard = shard_holding(folder, "condition_proj.weight")
    tensors = load_file(str(shard))
    tensors["blocks.0.attn.bias_we_never_had"] = torch.zeros(3)
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError, match=rf"blocks\.0\.attn\.bias_we_never_had.*{shard.name}"):
        load_dit(tmp_path)


def test_a_sparse_attention_student_loads_with_its_gates(tmp_path, reference, tiny_config):
    """FastH3 8-Step V2 is a diffusers transformer plus a VSA gate per block's attention (`to_gate_compress`, no
    bias): recognized from the tensor names (its config.json does not say), each gate loaded where the block's
    attention uses it, and counted in the memory plan's block size."""
    from h3_core.memory_plan import block_weight_bytes

    folder = write_diffusers_folder(tmp_path / "transformer", reference, max_shard_size="10GB")
    (shard,) = folder.glob("*.safetensors")
    tensors = load_file(str(shard))
    inner = tiny_config.num_attention_heads * tiny_config.attention_head_dim
    g = torch.Generator().manual_seed(3)
    gates = {i: torch.randn(inner, tiny_config.hidden_size, generator=g) for i in range(tiny_config.num_layers)}
    tensors.update({f"transformer_blocks.{i}.attn.to_gate_compress.weight": gate for i, gate in gates.items()})
    save_file(tensors, str(shard))
    assert locate_dit(folder).config.vsa_gates and not locate_dit(write_diffusers_folder(
        tmp_path / "plain", reference, max_shard_size="10GB")).config.vsa_gates
    model = load_dit(folder, dtype=torch.float32)
    assert model.config.vsa_gates
    for i, gate in gates.items():
        assert torch.equal(model.blocks[i].attn.gate_compress.weight, gate)
    assert all(block.attn.gate_compress is None for block in model.token_refiner.blocks)
    block = model.blocks[0]
    streamed = sum(p.numel() * p.element_size() for name, p in block.named_parameters() if "adaln" not in name)
    assert block_weight_bytes(model.config, 4) == streamed


def test_misshaped_tensor_is_named_with_shapes(tmp_path, reference, tiny_config):
    path = write_comfy_single_file(tmp_path / "dit.safetensors", reference.state_dict(), tiny_config, "")
    tensors = load_file(str(path))
    tensors["blocks.1.mlp.fc2.weight"] = torch.zeros(64, 100)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"blocks\.1\.mlp\.fc2\.weight.*\[64, 100\].*\[64, 128\]"):
        load_dit(path)


def test_the_embedded_model_takes_a_partition_name_only():
    """`tiny-random` is made, not read, yet labelled with its partition as a read DiT is: a task is no partition."""
    assert load_dit("tiny-random", partition="ref2va").partition == "ref2va"
    with pytest.raises(ValueError, match=r"^Unknown partition 't2va'; choose one of fl2va, ref2va\.$"):
        load_dit("tiny-random", partition="t2va")


def test_an_original_qkv_whose_rows_are_no_whole_heads_is_named_with_its_shape(tmp_path, reference, tiny_config):
    """Original shards interleave q/k/v head by head: rows that are not whole heads of three cannot be taken apart."""
    folder = write_original_partition(tmp_path, reference.state_dict(), tiny_config)
    shard = shard_holding(folder, "blocks.0.attn.qkv_proj.weight")
    tensors = load_file(str(shard))
    tensors["blocks.0.attn.qkv_proj.weight"] = tensors["blocks.0.attn.qkv_proj.weight"][:-1].clone()
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError, match=rf"^'blocks\.0\.attn\.qkv_proj\.weight' in .*{shard.name} has shape "
                                              r"\[191, 64\]; its rows must be a multiple of 3 x head_dim \(96\)\.$"):
        load_dit(tmp_path)


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.bool])
def test_a_weight_stored_as_integers_is_refused_from_the_headers(tmp_path, reference, tiny_config, dtype):
    """A DiT tensor of int32, uint8 or bool was cast to the model dtype (a bool norm weight became 1.0)."""
    folder = write_original_partition(tmp_path, reference.state_dict(), tiny_config)
    shard = shard_holding(folder, "blocks.1.norm2.weight")
    tensors = load_file(str(shard))
    tensors["blocks.1.norm2.weight"] = tensors["blocks.1.norm2.weight"].to(dtype)
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError, match=rf"'blocks\.1\.norm2\.weight' in .* is stored as "
                                              rf"{str(dtype).removeprefix('torch.')}; this model's weight there is "
                                              "floating point"):
        DiTReader(tmp_path)


def test_missing_diffusers_qkv_part(tmp_path, reference):
    sd = {k: v for k, v in reference.state_dict().items() if k != "transformer_blocks.1.attn.to_v.weight"}
    save_file(sd, str(tmp_path / "dit.safetensors"))
    with pytest.raises(CheckpointError, match=r"blocks\.1\.attn\.qkv_proj.*to_v"):
        load_dit(tmp_path / "dit.safetensors")


def test_index_naming_a_missing_shard(tmp_path, reference, tiny_config):
    folder = write_original_partition(tmp_path, reference.state_dict(), tiny_config)
    (folder / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"index\.json lists shards that are not in .*transformer: "
                                              r"model-00002-of-00003\.safetensors\.$"):
        load_dit(tmp_path)


@pytest.mark.parametrize("shard", [5, None, "../outside.safetensors", "/elsewhere/model.safetensors", ""])
def test_an_index_names_shards_beside_it_only(tmp_path, reference, tiny_config, shard):
    """A number in a weight_map gave a TypeError; a path led outside the checkpoint's folder."""
    folder = write_original_partition(tmp_path, reference.state_dict(), tiny_config)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["blocks.0.mlp.fc1.weight"] = shard
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"maps 'blocks\.0\.mlp\.fc1\.weight' to .*; a weight_map names shard "
                                              r"files in the index's own folder"):
        load_dit(tmp_path)


def test_a_tensor_held_by_two_shards_is_refused_naming_the_second(tmp_path, reference, tiny_config):
    folder = write_original_partition(tmp_path, reference.state_dict(), tiny_config, shards=2)
    first, second = (folder / f"model-0000{i}-of-00002.safetensors" for i in (1, 2))
    name, tensor = next(iter(load_file(first).items()))
    save_file({**load_file(second), name: tensor}, str(second))
    with pytest.raises(CheckpointError,
                       match=rf"^Tensor '{re.escape(name)}' appears twice \(.*00002\.safetensors\)\.$"):
        load_dit(tmp_path)


def test_shards_without_their_index_are_refused_naming_the_index_wanted(tmp_path, reference, tiny_config):
    folder = write_original_partition(tmp_path, reference.state_dict(), tiny_config, shards=2)
    (folder / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match=r"holds 2 \.safetensors files but no index file "
                                              r"\(model\.safetensors\.index\.json\)\.$"):
        load_dit(tmp_path)


@pytest.mark.parametrize("index", [{}, {"weight_map": {}}, {"weight_map": ["model-00001-of-00003.safetensors"]}])
def test_an_index_without_a_weight_map_is_refused_naming_it(tmp_path, reference, tiny_config, index):
    folder = write_original_partition(tmp_path, reference.state_dict(), tiny_config)
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json has no 'weight_map'\.$"):
        load_dit(tmp_path)


@pytest.mark.parametrize("field, value, wanted", [
    ("num_layers", "abc", "an integer of at least 1"), ("num_layers", None, "an integer of at least 1"),
    ("num_layers", 2.5, "an integer of at least 1"), ("ffn_hidden_size", "128", "ffn_dim must be an integer"),
    ("rope_theta", -1, "a positive number"), ("patch_size", 2, "three positive integers"),
])
def test_a_config_of_wrong_types_is_refused_naming_its_file(tmp_path, reference, tiny_config, field, value, wanted):
    """config.json said "abc" or null for a layer count: a TypeError deep in the model's constructor."""
    folder = write_original_partition(tmp_path, reference.state_dict(), tiny_config)
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"config\.json: The DiT config's .*{wanted}"):
        load_dit(tmp_path)


def test_folder_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="not an H3 DiT checkpoint.*config.json"):
        load_dit(tmp_path)


def test_nonexistent_path(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_dit(tmp_path / "nowhere")


@pytest.mark.parametrize("suffix", [".ckpt", ".pt", ".pth", ".bin"])
def test_pickle_files_are_refused(tmp_path, suffix):
    path = tmp_path / f"model{suffix}"
    path.write_bytes(b"not even opened")
    with pytest.raises(CheckpointError, match=rf"^model\{suffix} is a pickle checkpoint \(\{suffix}\); H3 loads only "
                                              r"\.safetensors files, which cannot run code on load"):
        load_dit(path)


def test_safetensors_without_dit_tensors(tmp_path):
    save_file({"encoder.conv_in.weight": torch.zeros(2, 2)}, str(tmp_path / "vae.safetensors"))
    with pytest.raises(CheckpointError, match="no H3 DiT tensors"):
        load_dit(tmp_path / "vae.safetensors")
    # a LoRA's names, say, look like a DiT's but lack its tensors
    save_file({"blocks.0.attn.qkv_proj.lora_A.weight": torch.zeros(2, 2)}, str(tmp_path / "lora.safetensors"))
    with pytest.raises(CheckpointError, match=r"lora\.safetensors has no tensor 'blocks\.0\.attn\.q_norm\.weight', which "
                                              "every H3 DiT has: it is not an H3 DiT file"):
        load_dit(tmp_path / "lora.safetensors")


def test_a_dtype_that_is_no_float_is_refused(tmp_path):
    with pytest.raises(ValueError, match="floating point torch dtype .* got torch.int8"):
        load_dit(tmp_path, dtype=torch.int8)


def test_unknown_partition():
    with pytest.raises(ValueError, match="fl2va, ref2va"):
        locate_dit(".", partition="t2v")


def test_a_reader_reads_drops_and_reads_again_the_same_weights(tmp_path, reference, expected, tiny_config):
    """DiTReader: the model is built from the headers alone (every weight on meta), read strictly on demand,
    dropped back to meta (its memory freed) and read again into the same module objects."""
    path = write_comfy_single_file(tmp_path / "minimax_h3_fl2va_bf16.safetensors", reference.state_dict(), tiny_config)
    reader = checkpoint.DiTReader(path, dtype=torch.float32)
    modules = dict(reader.model.named_modules())
    assert not reader.is_read and all(t.is_meta for t in reader.model.state_dict().values())
    assert reader.nbytes == sum(t.numel() * 4 for t in expected.values())
    assert_same_weights(reader.read("cpu"), expected) and reader.is_read
    weight = reader.model.blocks[0].attn.qkv_proj.weight
    assert reader.read("cpu").blocks[0].attn.qkv_proj.weight is weight  # a read model is not read twice
    reader.drop()
    assert not reader.is_read and all(t.is_meta for t in reader.model.state_dict().values())
    assert reader.model.rope_inv_freq.is_meta
    assert_same_weights(reader.read("cpu"), expected)
    assert all(modules[name] is module for name, module in reader.model.named_modules())
    assert torch.equal(reader.model.rope_inv_freq, load_dit(path).rope_inv_freq)


def test_a_reader_checks_the_headers_before_reading_anything(tmp_path, reference, tiny_config, monkeypatch):
    """A broken checkpoint (a tensor missing) is refused when the reader is made, with no data read; an
    unread model already has the dtypes the read will give (the release policy: bf16, fp32 heads), so its
    size is the read model's."""
    path = write_comfy_single_file(tmp_path / "dit.safetensors", reference.state_dict(), tiny_config)
    reads = []
    monkeypatch.setattr(checkpoint, "read_tensors", lambda files: reads.append(files) or iter(()))
    reader = checkpoint.DiTReader(path, dtype=torch.bfloat16)
    assert reads == [] and not reader.is_read
    dtypes = {name: t.dtype for name, t in reader.model.state_dict().items()}
    monkeypatch.undo()
    read = reader.read("cpu").state_dict()
    assert dtypes == {name: t.dtype for name, t in read.items()}
    assert dtypes["blocks.0.attn.qkv_proj.weight"] == torch.bfloat16
    assert dtypes["final_layer.video_out.weight"] == torch.float32
    assert reader.nbytes == sum(t.numel() * t.element_size() for t in read.values())

    tensors = load_file(str(path))
    tensors.pop(next(name for name in tensors if name.endswith("blocks.1.mlp.fc2.weight")))
    save_file(tensors, str(path))
    monkeypatch.setattr(checkpoint, "read_tensors", lambda files: reads.append(files) or iter(()))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): blocks\.1\.mlp\.fc2\.weight"):
        checkpoint.DiTReader(path)
    assert reads == []


def test_a_failed_read_leaves_the_model_dropped_and_a_missing_file_is_named(tmp_path, reference, tiny_config):
    path = write_comfy_single_file(tmp_path / "dit.safetensors", reference.state_dict(), tiny_config)
    reader = checkpoint.DiTReader(path)
    tensors = load_file(str(path))
    tensors.pop(next(name for name in tensors if name.endswith("final_layer.video_out.bias")))
    save_file(tensors, str(path))  # the file changed under the reader: a tensor went missing
    with pytest.raises(CheckpointError, match="missing 1 tensor"):
        reader.read("cpu")
    assert not reader.is_read and all(t.is_meta for t in reader.model.state_dict().values())
    path.unlink()
    with pytest.raises(CheckpointError, match=r"dit\.safetensors is gone"):
        reader.read("cpu")


def test_a_missing_or_unreadable_config_is_named(tmp_path):
    """A folder whose config.json went missing gave a bare '[Errno 2] No such file or directory'."""
    from h3_core.weights import read_json

    with pytest.raises(CheckpointError, match=r"config\.json is missing: the checkpoint folder holding it is incomplete"):
        read_json(tmp_path / "config.json")
    (tmp_path / "bytes.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(CheckpointError, match=r"bytes\.json cannot be read \('utf-8' codec can't decode byte 0xff"):
        read_json(tmp_path / "bytes.json")
    (tmp_path / "broken.json").write_text('{"weight_map": ')
    with pytest.raises(CheckpointError, match=r"broken\.json is not valid JSON: Expecting value: line 1 column 16"):
        read_json(tmp_path / "broken.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"list\.json must hold a JSON object\.$"):
        read_json(tmp_path / "list.json")
    (tmp_path / "folder.json").mkdir()  # the system's reason, not the exception's repr
    with pytest.raises(CheckpointError, match=r"folder\.json cannot be read \(Is a directory\)\.$"):
        read_json(tmp_path / "folder.json")


def test_a_huge_json_file_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """A multi-GB file named config.json (a weights file renamed, say) was read whole into memory first; a
    processor folder's configs are read the same way."""
    from h3_core.prompt import VisionProcessor
    from h3_core.weights import MAX_JSON_BYTES, read_json

    huge = tmp_path / "config.json"
    with open(huge, "wb") as file:
        file.truncate(MAX_JSON_BYTES + 1)  # sparse: no disk taken
    monkeypatch.setattr(Path, "read_text", lambda *_, **__: pytest.fail("the huge file was read"))
    with pytest.raises(CheckpointError, match=r"config\.json is 64 MiB; a checkpoint's JSON file is at most 64 MiB"):
        read_json(huge)
    huge.rename(tmp_path / "preprocessor_config.json")
    with pytest.raises(CheckpointError, match=r"preprocessor_config\.json is 64 MiB"):
        VisionProcessor.from_folder(tmp_path)


def _open_as_another_user(path) -> str:
    """The message open_safetensors gives for `path` opened by a user who may not read it: this process when it
    is not root (root reads any file), else a forked child that has given up root for 'nobody'."""
    import os

    def attempt() -> str:
        try:
            with weights.open_safetensors(path):
                return "opened"
        except CheckpointError as error:
            return str(error)

    path.chmod(0)
    if os.geteuid() != 0:
        return attempt()
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            os.write(write, attempt().encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        said = pipe.read()
    os.waitpid(child, 0)
    return said


def test_a_file_this_user_may_not_read_is_said_so(tmp_path):
    """safetensors reports a file the user may not read as 'No such file or directory': a user looking at the
    file in the folder was told it is not there."""
    path = tmp_path / "model.safetensors"
    save_file({"x": torch.zeros(2)}, str(path))
    said = _open_as_another_user(path)
    assert said == f"{path} cannot be read (Permission denied).", said
    with pytest.raises(CheckpointError, match="missing.safetensors cannot be read \\(No such file or directory\\)"):
        with weights.open_safetensors(tmp_path / "missing.safetensors"):
            pass


def test_a_tensor_in_a_dtype_torch_cannot_hold_is_refused_naming_it(tmp_path):
    """safetensors lists dtypes torch has no type for (6-bit floats): checking the headers names the tensor and
    its dtype; reading it names the file as unreadable rather than raising the library's own error."""
    header = json.dumps({"odd": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}}).encode()
    path = tmp_path / "odd.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(3))
    with pytest.raises(CheckpointError, match=rf"'odd' in {re.escape(str(path))} has dtype F6_E2M3, which H3 does "
                                              r"not use\.$"):
        list(weights.read_headers([path]))
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))} is not a readable safetensors file "
                                              r"\(.*F6_E2M3.*; 78 bytes"):
        list(weights.read_tensors([path]))


def test_configs_that_do_not_describe_a_model_are_clear_refusals(tmp_path):
    """Malformed configs failed in Python's words (IndexError, ZeroDivisionError, TypeError): tracebacks from the
    command line. A single DiT file's config comes from its shapes; a text encoder's from its config.json."""
    from h3_core.text_checkpoint import qwen3vl_config
    from h3_core.tiny import tiny_random_dit

    tensors = {key: value.contiguous() for key, value in tiny_random_dit().state_dict().items()}
    tensors["condition_proj.weight"] = torch.tensor(1.0)  # 0-d where the text projection's matrix goes
    save_file(tensors, str(tmp_path / "odd.safetensors"))
    with pytest.raises(CheckpointError, match=r"The DiT in odd.safetensors does not describe a model H3 can build "
                                              r"\(IndexError"):
        checkpoint.with_config(locate_dit(tmp_path / "odd.safetensors"))
    for text_config, error in (({"num_hidden_layers": None}, "TypeError"), (None, "AttributeError"),
                               ({"num_hidden_layers": "fifty"}, "ValueError")):
        with pytest.raises(CheckpointError, match=f"does not describe a model H3 can build \\({error}"):
            qwen3vl_config({"text_config": text_config, "vision_config": {}})


def test_a_single_file_without_its_rope_table_takes_the_releases_ratio(tmp_path, reference, tiny_config):
    """The release ships rope.inv_freq; a file without it is read with 16 frequencies per 128 channels."""
    from h3_core.checkpoint import infer_config

    tensors = original_state_dict(reference.state_dict(), tiny_config, qkv_layout="stacked")
    del tensors["rope.inv_freq"]
    save_file(tensors, str(tmp_path / "dit.safetensors"))
    assert infer_config(locate_dit(tmp_path / "dit.safetensors")).rope_freq_dim == tiny_config.attention_head_dim // 8
