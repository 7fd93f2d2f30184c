"""GGUF DiT files (ComfyUI-GGUF's layout: the ComfyUI single file's tensors in GGML types): block, AdaLN and
refiner linears held as their GGML blocks and rebuilt as they are used; every other quantized tensor
dequantized at load. What each weight must be is what gguf's own dequantizer makes of the file (gguf_files)."""

import re
import sys
from dataclasses import replace

import gguf_files
import pytest
import torch
from test_fp8 import (BLOCK_LINEARS, CPU_SCALED, check_cuda_linears_equal_the_cpus, check_lora_hook_equals_merge,
                      check_streamed_blocks_equal_resident, cosine, forward, native_tensors)
from torch import nn

from h3_core import fp8
from h3_core.checkpoint import CheckpointError, DiTReader, held_linears, infer_config, load_dit, locate_dit
from h3_core.config import DiTConfig, TINY_DIT
from h3_core.dit import H3DiT, rope_inverse_frequencies
from h3_core.gguf_file import GGUFEntry, GGUFLinear, GGUFLoad
from h3_core.memory_plan import block_weight_bytes, check_held, plan_memory
from h3_core.parallel.workers import ModelSpec
from h3_core.tiny import TINY_SEED, seeded_random_weights, tiny_random_dit

pytest.importorskip("gguf", reason="GGUF files are read and written with the gguf package (a dependency)")

PREFIX = "model.diffusion_model."
BLOCKS = [f"blocks.{i}.{leaf}" for i in range(2) for leaf in BLOCK_LINEARS]
KEPT_OTHERS = {"blocks.1.adaln_proj.linear": "Q4_0", "token_refiner.blocks.0.attn.qkv_proj": "Q5_1"}
# not storable: fp32 modules, and condition_proj (48 wide: stored flattened into rows of 256, as ComfyUI-GGUF may)
DEQUANTIZED = {"video_patch_proj": "Q4_1", "final_layer.video_out": "Q5_0", "condition_proj": "Q8_0"}
K_CONFIG = replace(TINY_DIT, attention_head_dim=128, hidden_size=256, ffn_dim=512, text_dim=256, rope_freq_dim=16)


PLAIN = {"token_refiner.blocks.1.mlp.fc1": "BF16"}  # stored unquantized: read as it is


def qtypes(blocks="Q8_0", others=True):
    chosen = {f"{layer}.weight": blocks for layer in BLOCKS}
    if others:
        chosen.update({f"{layer}.weight": qtype for layer, qtype in {**KEPT_OTHERS, **DEQUANTIZED, **PLAIN}.items()})
    return chosen


def write(path, model=None, blocks="Q8_0", others=True, **options):
    flattened = ("condition_proj.weight",) if others else ()
    return gguf_files.write_gguf(path, native_tensors(model or tiny_random_dit()), qtypes(blocks, others),
                                 flattened=flattened, **options)


def dense_model(meant, config=TINY_DIT):
    """The oracle: a dense fp32 model holding exactly what gguf's dequantizer makes of the file."""
    with torch.device("meta"):
        model = H3DiT(config)
    model.load_state_dict({k: v for k, v in meant.items() if k != "rope.inv_freq"}, assign=True)
    model.rope_inv_freq = rope_inverse_frequencies(config)
    return model.eval().requires_grad_(False)


def test_a_gguf_file_keeps_its_quantized_linears(tmp_path):
    path = tmp_path / "minimax_h3_fl2va-Q8_0.gguf"
    meant = write(path, prefix=PREFIX)
    source = locate_dit(path)
    assert source.is_gguf
    assert source.origin == "GGUF file (architecture 'minimax_h3'; BF16, F16, F32, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)"
    assert infer_config(source) == TINY_DIT
    kept = load_dit(path, dtype=torch.float32)
    dense = load_dit(path, dtype=torch.float32, linears="dense")
    for layer in BLOCKS + list(KEPT_OTHERS):
        module = kept.get_submodule(layer)
        assert isinstance(module, GGUFLinear) and module.weight.dtype == torch.uint8, layer
        assert type(dense.get_submodule(layer)) is nn.Linear, layer
        assert torch.equal(module.dequantized_weight(), meant[f"{layer}.weight"]), layer
        assert torch.equal(dense.get_submodule(layer).weight, meant[f"{layer}.weight"]), layer
        rebuilt = module.as_dense()  # what the lossy FP8 "scaled" mode quantizes (on a GPU)
        assert type(rebuilt) is nn.Linear and torch.equal(rebuilt.weight, meant[f"{layer}.weight"]), layer
        assert not any(p.requires_grad for p in rebuilt.parameters()), layer
        assert (rebuilt.bias is None) == (module.bias is None), layer
        assert module.bias is None or torch.equal(rebuilt.bias, module.bias), layer
        assert f"bias={module.bias is not None}, gguf " in repr(module), layer
    assert any(kept.get_submodule(layer).bias is not None for layer in BLOCKS + list(KEPT_OTHERS))
    for layer in DEQUANTIZED:
        module = kept.get_submodule(layer)
        assert type(module) is nn.Linear and module.weight.dtype == torch.float32, layer
        assert module.weight.shape == tiny_random_dit().get_submodule(layer).weight.shape
    for layer in PLAIN:
        module = kept.get_submodule(layer)
        assert type(module) is nn.Linear and torch.equal(module.weight, meant[f"{layer}.weight"]), layer
        assert torch.equal(module.weight, meant[f"{layer}.weight"]), layer
    oracle = dense_model(meant)
    for a, b, c in zip(forward(kept), forward(dense), forward(oracle)):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert cosine(forward(kept)[0], forward(tiny_random_dit())[0]) > 0.99  # 4- and 8-bit rounding only

    def fc1_bytes(model):
        return sum(t.numel() * t.element_size() for n, t in model.state_dict().items()
                   if n.startswith("blocks.0.mlp.fc1."))

    assert fc1_bytes(kept) == fc1_bytes(dense) * 34 // (32 * 4)  # Q8_0: 34 bytes a 32 weights, against fp32


def test_a_gguf_dit_computes_in_bf16_unless_told(tmp_path):
    """GGUF files store small tensors in F32 and the rest in whatever type: the DiT follows the release's dtype
    policy (bf16, fp32 heads) instead of the file's types."""
    path = tmp_path / "dit.gguf"
    write(path)
    model = load_dit(path)
    assert model.blocks[0].mlp.fc1.compute_dtype == torch.bfloat16
    assert model.blocks[0].attn.q_norm.weight.dtype == model.condition_proj.weight.dtype == torch.bfloat16
    assert model.final_layer.video_out.weight.dtype == torch.float32
    assert model.video_patch_proj.weight.dtype == torch.float32
    assert cosine(forward(model)[0], forward(load_dit(path, dtype=torch.float32))[0]) > 0.999


def test_a_gguf_files_rope_table_gives_its_frequency_count(tmp_path):
    """16 frequencies per 128 channels is only what a file without rope.inv_freq is read with: a GGUF file that
    ships the table is read with its length, as a safetensors one is."""
    config = replace(TINY_DIT, rope_freq_dim=3)  # not attention_head_dim // 8 (4)
    path = tmp_path / "dit.gguf"
    write(path, seeded_random_weights(H3DiT(config), TINY_SEED))
    assert infer_config(locate_dit(path)) == config


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"])
def test_k_quant_linears_equal_gguf_s_own_dequantizer(tmp_path, qtype):
    """K-quants and IQ4 types (random blocks: gguf has no quantizer for them) on a model whose linears are 256
    wide: the blocks stay quantized and compute what the dequantized weights do."""
    model = seeded_random_weights(H3DiT(K_CONFIG), TINY_SEED)
    path = tmp_path / f"dit-{qtype}.gguf"
    meant = write(path, model, blocks=qtype, others=False)
    kept = load_dit(path, dtype=torch.float32)
    assert infer_config(locate_dit(path)) == K_CONFIG
    for layer in BLOCKS:
        module = kept.get_submodule(layer)
        assert isinstance(module, GGUFLinear) and module.qtype == qtype, layer
        assert torch.equal(module.dequantized_weight(), meant[f"{layer}.weight"]), layer
    for a, b in zip(forward(kept), forward(dense_model(meant, K_CONFIG))):
        assert torch.equal(a, b)


def test_flattened_tensors_take_their_original_shape(tmp_path):
    """ComfyUI-GGUF may store a tensor as rows of 256 with a `comfy.gguf.orig_shape.<key>` field."""
    model = seeded_random_weights(H3DiT(K_CONFIG), TINY_SEED)
    path = tmp_path / "flat.gguf"
    # audio_patch_proj [256, 32] (8,192 weights) stored as [32, 256]
    meant = gguf_files.write_gguf(path, native_tensors(model), {"audio_patch_proj.weight": "Q8_0",
                                                                "condition_proj.weight": "Q8_0"},
                                  prefix=PREFIX, flattened=("audio_patch_proj.weight", "condition_proj.weight"))
    loaded = load_dit(path, dtype=torch.float32)
    assert loaded.audio_patch_proj.weight.shape == model.audio_patch_proj.weight.shape
    assert torch.equal(loaded.audio_patch_proj.weight, meant["audio_patch_proj.weight"])
    assert torch.equal(loaded.condition_proj.weight, meant["condition_proj.weight"])

    # a field whose shape holds another count of weights ([512, 32] for 8,192) is refused, not read as garbage
    import struct

    data = bytearray(path.read_bytes())
    key = f"comfy.gguf.orig_shape.{PREFIX}audio_patch_proj.weight".encode()
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)  # then: ARRAY, its element type, count, values
    element, count = struct.unpack_from("<IQ", data, at + 4)
    assert count == 2 and element in (4, 5)  # GGUF's UINT32 / INT32
    struct.pack_into("<I", data, at + 16, 512)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=re.escape(f"'{PREFIX}audio_patch_proj.weight' in flat.gguf is stored as "
                                                        "[32, 256] but its original shape field says [512, 32]: the "
                                                        "element counts differ.")):
        locate_dit(path)


def test_broken_gguf_files_are_refused_before_reading(tmp_path, monkeypatch):
    import gguf
    import numpy as np

    from h3_core.gguf_file import gguf_entries

    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file" * 8)
    with pytest.raises(CheckpointError, match="junk.gguf is not a readable GGUF file"):
        locate_dit(tmp_path / "junk.gguf")
    with pytest.raises(CheckpointError, match=r"gone.gguf cannot be read \(No such file or directory\)"):
        gguf_entries(tmp_path / "gone.gguf")  # deleted since it was listed

    tensors = native_tensors(tiny_random_dit())
    odd = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(odd), arch="minimax_h3")
    for name, tensor in tensors.items():
        if name == "blocks.0.mlp.fc1.weight":  # IQ2_XXS: 256 weights in 66 bytes, a type we do not read
            writer.add_tensor(name, np.zeros((256, 66), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
        else:
            writer.add_tensor(name, tensor.float().numpy())
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(CheckpointError, match=r"'blocks.0.mlp.fc1.weight' in odd.gguf is stored as GGML type IQ2_XXS.*"
                                              r"may use F32, F16, BF16, Q8_0"):
        locate_dit(odd)

    wide = dict(tensors, **{"blocks.1.mlp.fc1.weight": torch.zeros(256, 128)})  # block 0 sets the config's widths
    gguf_files.write_gguf(tmp_path / "wide.gguf", wide, qtypes(others=False))
    with pytest.raises(CheckpointError, match=re.escape("'blocks.1.mlp.fc1.weight' has shape [256, 128], expected "
                                                        "[256, 64] for this config.")):
        load_dit(tmp_path / "wide.gguf")

    lacking = {k: v for k, v in tensors.items() if k != "blocks.1.mlp.fc2.weight"}
    gguf_files.write_gguf(tmp_path / "lacking.gguf", lacking, qtypes(others=False))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): blocks.1.mlp.fc2.weight"):
        DiTReader(tmp_path / "lacking.gguf")  # the headers alone

    wan = {"blocks.0.self_attn.q.weight": torch.zeros(64, 64), **tensors}  # another model's file (Wan's names)
    gguf_files.write_gguf(tmp_path / "wan.gguf", wan, arch="wan")
    with pytest.raises(CheckpointError, match=r"Unexpected tensor 'blocks.0.self_attn.q.weight' .*architecture 'wan'"):
        DiTReader(tmp_path / "wan.gguf")

    renamed = {k.replace("blocks.", "transformer_blocks."): v for k, v in tensors.items()}
    gguf_files.write_gguf(tmp_path / "diffusers.gguf", renamed)
    with pytest.raises(CheckpointError, match="diffusers.gguf is a GGUF file with diffusers names"):
        locate_dit(tmp_path / "diffusers.gguf")

    write(tmp_path / "minimax_h3_ref2va-Q8_0.gguf")
    with pytest.raises(CheckpointError, match="holds H3's Ref2VA DiT"):
        locate_dit(tmp_path / "minimax_h3_ref2va-Q8_0.gguf", "fl2va")

    # a damaged type field: the tensor's size no longer meets the next tensor, which starts where the stored type's
    # 256 x 64 weights end (Q8_0: 34 bytes a 32, Q4_0: 18)
    for stored_as, written in (("Q8_0", 17408), ("Q4_0", 9216)):
        damaged = tmp_path / f"damaged-{stored_as}.gguf"
        write(damaged, blocks=stored_as)
        retype(damaged, "blocks.0.mlp.fc1.weight", "Q4_1" if stored_as == "Q8_0" else "Q8_0")
        said = (rf"damaged-{stored_as}.gguf is damaged: its header says 'blocks.0.mlp.fc1.weight' is Q\d_\d "
                rf"\[256, 64\], \d+ bytes, but the next tensor's data \('[\w.]+'\) starts {written} bytes after "
                r"its start")
        with pytest.raises(CheckpointError, match=said):
            locate_dit(damaged)

    # a ComfyUI whose Python lacks the gguf package (a dependency, but installs go wrong): said, not an ImportError
    write(tmp_path / "unread.gguf")
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(CheckpointError, match=r"Reading unread.gguf needs the 'gguf' package \(pip install gguf\)"):
        locate_dit(tmp_path / "unread.gguf")


def test_a_gguf_file_with_an_endless_metadata_array_is_refused_before_llama_cpps_reader(tmp_path, monkeypatch):
    """A 2 MB upload holding one metadata array of 2M bytes took llama.cpp's reader 23 s and 1.4 GB (Python
    objects per element; 100 MB: minutes and tens of GB): its header is walked first and the file refused. A
    text encoder's vocabulary (strings, and the tokens' types) still reads, and so do fields of every fixed-size
    type before it (a size mistaken there would throw the walk off the following fields)."""
    import time

    import gguf
    import numpy as np

    from h3_core import gguf_file

    tensors = native_tensors(tiny_random_dit())
    vocabulary = [f"token{i}" for i in range(2000)]
    for name, count in (("endless.gguf", 2_000_000), ("vocab.gguf", 0)):
        writer = gguf.GGUFWriter(str(tmp_path / name), arch="minimax_h3")
        for kind in ("uint8", "int8", "uint16", "int16", "uint32", "int32", "float32", "bool", "uint64", "int64",
                     "float64"):
            getattr(writer, f"add_{kind}")(f"h3.test.{kind}", 1)
            writer.add_key_value(f"h3.test.{kind}s", [1, 0, 1], gguf.GGUFValueType.ARRAY,
                                 getattr(gguf.GGUFValueType, kind.upper()))
        writer.add_array("tokenizer.ggml.tokens", vocabulary)
        writer.add_array("tokenizer.ggml.token_type", [1] * len(vocabulary))
        if count:
            writer.add_array("general.padding", np.zeros(count, np.uint8).tolist())
        for key, tensor in tensors.items():
            writer.add_tensor(key, tensor.float().numpy())
        writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a: pytest.fail("llama.cpp's reader was reached"))
    started = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"endless.gguf holds a metadata array of 2,000,000 entries"):
        locate_dit(tmp_path / "endless.gguf")
    assert time.perf_counter() - started < 2
    monkeypatch.undo()
    gguf_file._parsed_header.cache_clear()
    assert locate_dit(tmp_path / "vocab.gguf").gguf_tensors


def retype(path, name, qtype):
    """Overwrite the GGML type of tensor `name` in a GGUF header: after the name come n_dims (u32), the dims
    (u64 each) and the type (u32)."""
    import struct

    import gguf

    data = bytearray(path.read_bytes())
    key = name.encode()
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    (dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * dims, int(gguf.GGMLQuantizationType[qtype]))
    path.write_bytes(bytes(data))


def test_memory_plan_counts_what_gguf_blocks_hold(tmp_path):
    """A real block's Q4_K linears stream exactly the bytes the plan counts; a file mixing types is planned by its
    costliest block; a 24 GiB budget keeps more Q4_K blocks resident than FP8 ones."""
    real = DiTConfig()
    with torch.device("meta"):
        block_model = H3DiT(replace(real, num_layers=1)).set_dtype(torch.bfloat16)
    entries = {f"{layer}.weight": GGUFEntry("Q4_K", shape, shape)
               for layer in fp8.block_linear_names(block_model)
               if (shape := tuple(block_model.get_submodule(layer).weight.shape))}
    GGUFLoad.plan(block_model, entries, keep=lambda layer: True, compute=torch.bfloat16,
                  dense_dtype=lambda name: torch.bfloat16)
    held = fp8.held_format(block_model)
    assert held == "gguf:0.5625" and check_held(held) == "gguf"
    streamed = [p for n, p in block_model.blocks[0].named_parameters() if not n.startswith("adaln_proj.")]
    assert sum(p.numel() * p.element_size() for p in streamed) == block_weight_bytes(real, 2, held)
    budget = 24 * 2**30
    assert (plan_memory(real, 38_222, budget, held=held).resident_blocks
            > plan_memory(real, 38_222, budget, held="fp8").resident_blocks)
    with pytest.raises(ValueError, match="gguf as 'gguf:<bytes a weight>'"):
        block_weight_bytes(real, 2, "gguf")

    path = tmp_path / "mixed.gguf"  # block 1's fc2 in Q8_0 (34/32 bytes a weight), the rest Q4_0 (18/32)
    gguf_files.write_gguf(path, native_tensors(tiny_random_dit()),
                          {**qtypes("Q4_0", others=False), "blocks.1.mlp.fc2.weight": "Q8_0"})
    weights = {leaf: 64 * 192 if leaf == "attn.qkv_proj" else 64 * 64 if leaf == "attn.out_proj"
               else 64 * 256 if leaf == "mlp.fc1" else 128 * 64 for leaf in BLOCK_LINEARS}
    costliest = (sum(weights.values()) - weights["mlp.fc2"]) * 18 / 32 + weights["mlp.fc2"] * 34 / 32
    expected = f"gguf:{costliest / sum(weights.values()):.6g}"
    assert held_linears(locate_dit(path), "checkpoint") == expected == fp8.held_format(load_dit(path))
    assert held_linears(locate_dit(path), "dense") == "dense"


@pytest.mark.parametrize("dtype", [None, torch.float16, torch.float32])
@pytest.mark.parametrize("mode", ["checkpoint", "fp8-weights-lossy"])
def test_the_plan_counts_plain_gguf_block_linears_as_they_are_read(tmp_path, dtype, mode):
    """A GGUF file's unquantized block linear is read in the model dtype (fp32: four bytes a weight, once planned as
    two), or as FP8 under fp8-weights-lossy; the plan (here and on split workers) counts what the load holds."""
    path = tmp_path / "plain.gguf"
    gguf_files.write_gguf(path, native_tensors(tiny_random_dit()),
                          {**qtypes("Q4_0", others=False), "blocks.1.mlp.fc2.weight": "F32"})
    itemsize = (dtype or torch.bfloat16).itemsize
    held = fp8.held_format(load_dit(path, dtype=dtype, linears=mode))
    assert held_linears(locate_dit(path), mode, itemsize) == held
    spec = ModelSpec(str(path), dtype=dtype or torch.bfloat16, linears=mode)
    assert spec.held_linears() == held


def test_streamed_gguf_blocks_equal_resident_ones(tmp_path):
    path = tmp_path / "dit.gguf"
    write(path)
    check_streamed_blocks_equal_resident(path)


@pytest.mark.parametrize("types", [
    {"blocks.1.mlp.fc2.weight": "Q8_0"},  # block 1 larger than block 0
    {"blocks.0.mlp.fc2.weight": "Q8_0", "blocks.1.attn.qkv_proj.weight": "Q8_0"},  # each larger in another linear
])
def test_gguf_blocks_of_mixed_types_stream_as_they_are(tmp_path, types):
    """llama.cpp's _M files mix GGML types by block: streamed blocks were packed as block 0 (a shape error, or
    bytes of another size read as this block's weights)."""
    path = tmp_path / "mixed.gguf"
    gguf_files.write_gguf(path, native_tensors(tiny_random_dit()), {**qtypes("Q4_0", others=False), **types})
    check_streamed_blocks_equal_resident(path)


def test_a_lora_on_a_gguf_model_is_hooked(tmp_path):
    path = tmp_path / "dit.gguf"
    write(path)
    check_lora_hook_equals_merge(path, tmp_path / "lora.safetensors")


@CPU_SCALED
def test_gguf_under_the_lossy_fp8_modes(tmp_path):
    """fp8-weights-lossy keeps GGUF blocks (smaller already); fp8-lossy rebuilds the block linears and quantizes
    them to e4m3 for FP8 matmuls; the other kept linears stay GGUF."""
    path = tmp_path / "dit.gguf"
    write(path)
    weights_only = load_dit(path, dtype=torch.float32, linears="fp8-weights-lossy")
    assert all(isinstance(weights_only.get_submodule(layer), GGUFLinear) for layer in BLOCKS + list(KEPT_OTHERS))
    dense = load_dit(path, dtype=torch.float32, linears="dense")
    lossy = load_dit(path, dtype=torch.float32, linears="fp8-lossy")
    for layer in BLOCKS:
        module = lossy.get_submodule(layer)
        assert isinstance(module, fp8.FP8Linear) and module.matmul == "scaled", layer
        weight, scale = fp8.quantize_weight(dense.get_submodule(layer).weight)
        assert torch.equal(module.weight, weight) and torch.equal(module.weight_scale, scale), layer
    assert all(isinstance(lossy.get_submodule(layer), GGUFLinear) for layer in KEPT_OTHERS)
    assert held_linears(locate_dit(path), "fp8-lossy") == "fp8-scaled"
    assert cosine(forward(lossy)[0], forward(dense)[0]) > 0.99


def test_compiled_blocks_rebuild_gguf_weights_as_eager_ones_do(tmp_path):
    """Blocks of different GGML types (llama.cpp's _M mixes give some blocks a larger type) each get their graph."""
    path = tmp_path / "dit.gguf"
    gguf_files.write_gguf(path, native_tensors(tiny_random_dit()), {**qtypes(), "blocks.1.mlp.fc2.weight": "Q4_0"},
                          flattened=("condition_proj.weight",))
    expected = forward(load_dit(path, dtype=torch.float32))[0]
    compiled = load_dit(path, dtype=torch.float32).compile_blocks()
    assert torch.allclose(forward(compiled)[0], expected, atol=1e-5)


def test_a_read_gguf_dit_can_be_dropped_and_read_again(tmp_path):
    path = tmp_path / "dit.gguf"
    write(path)
    reader = DiTReader(path, dtype=torch.float32)
    first = forward(reader.read())
    reader.drop()
    assert not reader.is_read and reader.model.blocks[0].mlp.fc1.weight.is_meta
    assert all(torch.equal(a, b) for a, b in zip(forward(reader.read()), first))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("blocks", ["Q8_0", "Q4_K"])
def test_gguf_linears_on_cuda_eager_and_compiled_equal_the_cpus(tmp_path, blocks):
    model = seeded_random_weights(H3DiT(K_CONFIG), TINY_SEED) if blocks.endswith("_K") else None
    path = tmp_path / "dit.gguf"
    write(path, model, blocks=blocks, others=model is None)
    check_cuda_linears_equal_the_cpus(path, BLOCKS + ([] if model is not None else list(KEPT_OTHERS)), GGUFLinear)


def test_a_pruned_gguf_file_loads_as_its_safetensors_form(tmp_path):
    """ComfyUI-GGUF made from a pruned (curve-form) file: `adaln_t_table` in F32, the rest as any GGUF file's; the
    same curve-form DiT as the safetensors file holding the values gguf's dequantizer makes."""
    from safetensors.torch import save_file
    from test_curve_form import curve_model

    curve = curve_model(tiny_random_dit())
    tensors = native_tensors(curve)
    tensors["adaln_t_table"] = tensors.pop("time_embedder.table")
    path = tmp_path / "minimax_h3_fl2va_pruned-Q8_0.gguf"
    meant = gguf_files.write_gguf(path, tensors, qtypes(others=False), prefix=PREFIX)
    save_file({PREFIX + k: v for k, v in meant.items()}, str(tmp_path / "pruned.safetensors"))
    config = infer_config(locate_dit(path))
    assert config == infer_config(locate_dit(tmp_path / "pruned.safetensors")) and config.adaln_curve_grid > 0
    got = load_dit(path, dtype=torch.float32)
    assert isinstance(got.blocks[0].mlp.fc1, GGUFLinear) and got.config.curve_form
    want = load_dit(tmp_path / "pruned.safetensors", dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(forward(got), forward(want)))


def test_held_blocks_stay_the_files_pages_and_writes_never_reach_the_file(tmp_path):
    """GGUF blocks held as stored are views of the file mapped into memory (the OS's file cache, as safetensors
    reads): a streamed block copies from there, a host short of memory reads it from disk again instead of
    swapping (they were copied out of the map into memory the process holds). The map is copy-on-write."""
    import hashlib

    from h3_core.runtime import file_mapped_ranges, in_mapped_file

    path = tmp_path / "dit.gguf"
    write(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    model = DiTReader(path).read("cpu")
    mapped = file_mapped_ranges()
    for block in model.blocks:
        for layer in (block.attn.qkv_proj, block.attn.out_proj, block.mlp.fc1, block.mlp.fc2):
            assert isinstance(layer, GGUFLinear) and in_mapped_file(layer.weight, mapped)
    model.blocks[0].mlp.fc1.weight.data.fill_(7)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
