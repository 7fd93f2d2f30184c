"""GGUF text encoders: Qwen3-VL's language model as llama.cpp's converter writes it (architecture qwen3vl,
llama.cpp's tensor names, every layer, no vision tower) and its vision tower from the mmproj file beside it. The
quantized decoder-layer linears stay in their GGML blocks; the prompt states equal those of the same weights
(gguf's own dequantizer) in a safetensors file. Without an mmproj file, pictures are refused, saying so."""

import re

import pytest
import torch
from safetensors.torch import save_file

import tiny_qwen
from h3_core.gguf_file import GGUFLinear
from h3_core.text import load_text_encoder, text_encoder_sizes
from h3_core.text_checkpoint import locate_text_encoder, model_name
from h3_core.weights import CheckpointError

gguf = pytest.importorskip("gguf")

PROMPT = "A red fox runs along the beach at dawn."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_qwen_gguf")
    tokenizer = tiny_qwen.write_tokenizer(root / "tokenizer")
    config = tiny_qwen.config_dict(tokenizer)  # text width 32: rows of whole Q8_0 / Q4_0 blocks
    model = tiny_qwen.random_model(config, seed=11)
    release = tiny_qwen.write_original_release(root / "MiniMax-H3", model, tokenizer)
    keys = tiny_qwen.llama_cpp_keys(model.state_dict())
    qtypes = {key: ("Q4_0" if ".ffn_" in key else "Q8_0") for key, tensor in keys.items() if tensor.dim() == 2}
    path = root / "Qwen3-VL-tiny-Q8_0.gguf"
    meant = tiny_qwen.write_gguf_file(path, model, qtypes)
    return {"model": model, "config": config, "partition": release / "FL2VA", "gguf": path, "meant": meant,
            "qtypes": qtypes, "root": root}


def _load(tiny, path):
    return load_text_encoder(path, torch.float32, tokenizer=tiny["partition"], config=tiny["config"])


def _dense_file(tiny, path):
    """The GGUF file's weights as they stand (dequantized) beside the model's vision tower, in the Comfy-Org
    single file's names."""
    tensors = tiny_qwen.comfy_keys(tiny["model"].state_dict())
    ours = {model_name(key): value for key, value in tiny["meant"].items() if model_name(key) is not None}
    for key in tensors:
        name = model_name(key)
        if name.startswith("language_model."):
            tensors[key] = ours[name]
    save_file(tensors, str(path))
    return path


def test_llama_cpp_names_are_read_as_gguf_py_names_them():
    """Our reading of llama.cpp's names against gguf-py's own table for qwen3vl (transformers' names -> GGUF)."""
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3VL, 64)
    for hf, part in tiny_qwen.LLAMA_CPP_LAYER_PARTS.items():
        assert table.get_name(f"model.layers.7.{hf}") == f"blk.7.{part}"
        assert model_name(f"blk.7.{part}.weight") == f"language_model.layers.7.{hf}.weight"
    assert table.get_name("model.embed_tokens") == "token_embd"
    assert model_name("token_embd.weight") == "language_model.embed_tokens.weight"
    for unused in ("output.weight", "output_norm.weight", "rope_freqs.weight", "blk.50.attn_q.weight"):
        assert model_name(unused) is None, unused


def test_a_gguf_text_encoder_equals_its_weights_dequantized(tiny, tmp_path):
    loaded = _load(tiny, tiny["gguf"])
    modules = dict(loaded.model.named_modules())
    held = {name: module for name, module in modules.items() if isinstance(module, GGUFLinear)}
    assert len(held) == 7 * 50 and {m.qtype for m in held.values()} == {"Q8_0", "Q4_0"}
    assert held["language_model.layers.3.mlp.down_proj"].qtype == "Q4_0"
    assert held["language_model.layers.49.self_attn.o_proj"].qtype == "Q8_0"
    embedding = loaded.model.language_model.embed_tokens.weight
    assert embedding.dtype == torch.float32 and torch.equal(embedding, tiny["meant"]["token_embd.weight"])
    assert len(loaded.model.language_model.layers) == 50  # the file's layers 50, 51 are never read

    dense = _load(tiny, _dense_file(tiny, tmp_path / "dense.safetensors"))
    presentation = loaded.presenter.t2va(PROMPT)
    got = loaded.encode(presentation).prompt_embeds
    assert torch.equal(got, dense.encode(presentation).prompt_embeds)
    assert torch.equal(loaded.stream_layers("cpu").forget().encode(presentation).prompt_embeds, got)  # GGUF layers visit too
    original = _load(tiny, tiny["partition"]).encode(presentation).prompt_embeds
    # 4-bit MLPs through 50 random layers: near the unquantized model (a misread tensor would be unrelated to it)
    assert torch.nn.functional.cosine_similarity(got.flatten(), original.flatten(), dim=0) > 0.95


def test_pictures_need_the_vision_tower_a_gguf_file_lacks(tiny):
    from PIL import Image

    loaded = _load(tiny, tiny["gguf"])
    presentation = loaded.presenter.fl2va(PROMPT, [Image.new("RGB", (96, 64), (200, 30, 30))])
    with pytest.raises(CheckpointError, match=r"Qwen3-VL-tiny-Q8_0.gguf holds no vision tower, and no Qwen3-VL-32B "
                                              r"mmproj file lies beside it \(llama.cpp keeps the vision tower in a "
                                              r"separate file.*keyframes and image or video references need that"):
        loaded.encode(presentation)
    assert not locate_text_encoder(tiny["gguf"], tokenizer=tiny["partition"]).vision_tower


def test_sizes_count_the_blocks_as_stored(tiny, monkeypatch):
    from h3_core import text_checkpoint

    monkeypatch.setattr(text_checkpoint, "QWEN3VL_32B_CONFIG", tiny["config"])  # a one-file encoder's config
    rest, layer = text_encoder_sizes(tiny["gguf"], torch.float32)
    meant = tiny["meant"]
    block = {"Q8_0": 34 / 32, "Q4_0": 18 / 32}  # bytes a weight: GGML blocks of 32 with an fp16 scale
    expected = sum(meant[k].numel() * (block[tiny["qtypes"][k]] if k in tiny["qtypes"] else 4)
                   for k in meant if k.startswith("blk.0."))
    assert layer == expected
    assert rest == meant["token_embd.weight"].numel() * 4  # dequantized to float32; no vision tower


def test_a_header_is_parsed_once_per_version_of_the_file(tiny, tmp_path, monkeypatch):
    """llama.cpp's reader takes seconds over a real text encoder's header (its 151k-token vocabulary), and a
    load asks for it to locate the file, size it and read it: one parse, until the file changes."""
    import shutil

    from h3_core import text_checkpoint

    monkeypatch.setattr(text_checkpoint, "QWEN3VL_32B_CONFIG", tiny["config"])
    path = shutil.copy(tiny["gguf"], tmp_path / "encoder.gguf")
    parses = []
    real_reader = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *args, **kwargs: parses.append(args) or real_reader(*args, **kwargs))
    locate_text_encoder(path)
    text_encoder_sizes(path, torch.float32)
    model = _load(tiny, path)
    assert len(parses) == 1
    assert torch.equal(model.model.language_model.embed_tokens.weight, tiny["meant"]["token_embd.weight"])
    from gguf_files import write_gguf

    write_gguf(path, {"token_embd.weight": torch.zeros(64, 32)}, arch="llama")  # the same name, another file
    with pytest.raises(CheckpointError, match="the 'llama' architecture"):
        locate_text_encoder(path)
    assert len(parses) == 2


def test_a_gguf_file_of_another_model_is_refused(tiny, tmp_path):
    from gguf_files import write_gguf

    cases = {"llama": "a GGUF file of the 'llama' architecture", "clip": "a vision projector \\(mmproj\\) file"}
    for arch, said in cases.items():
        path = tmp_path / f"{arch}.gguf"
        write_gguf(path, {"token_embd.weight": torch.zeros(64, 32)}, arch=arch)
        with pytest.raises(CheckpointError, match=f"{arch}.gguf is {said}; a GGUF text encoder for H3 is "
                                                  r"Qwen3-VL-32B's language model \(architecture 'qwen3vl'"):
            locate_text_encoder(path)
    no_embedding = tmp_path / "no_embedding.gguf"
    write_gguf(no_embedding, {k: v for k, v in tiny_qwen.llama_cpp_keys(tiny["model"].state_dict()).items()
                              if k != "token_embd.weight"}, arch="qwen3vl")
    with pytest.raises(CheckpointError, match=r"holds no Qwen3-VL text encoder \(no 'token_embd.weight'\)"):
        _load(tiny, no_embedding)
    short = tmp_path / "short.gguf"
    keys = {k: v for k, v in tiny_qwen.llama_cpp_keys(tiny["model"].state_dict()).items()
            if not re.match(r"blk\.(4\d|5\d)\.", k)}
    write_gguf(short, keys, arch="qwen3vl")
    with pytest.raises(CheckpointError, match="holds 40 decoder layers; H3 reads the state after layer 50"):
        _load(tiny, short)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gguf_text_encoder_on_the_gpu_resident_and_streamed(tiny):
    """Kept in GGML blocks on a GPU, resident or streamed from CPU memory: the CPU's prompt states (float32)."""
    on_cpu = _load(tiny, tiny["gguf"])
    presentation = on_cpu.presenter.t2va(PROMPT)
    expected = on_cpu.encode(presentation).prompt_embeds
    on_gpu = load_text_encoder(tiny["gguf"], torch.float32, "cuda", tokenizer=tiny["partition"], config=tiny["config"])
    weight = on_gpu.model.language_model.layers[0].mlp.down_proj.weight
    assert weight.device.type == "cuda" and weight.dtype == torch.uint8
    relative = lambda got: ((got.cpu() - expected).norm() / expected.norm()).item()  # noqa: E731
    assert relative(on_gpu.encode(presentation).prompt_embeds) < 1e-3
    assert relative(on_cpu.stream_layers("cuda").encode(presentation).prompt_embeds) < 1e-3


def test_types_matter_only_where_tensors_are_read(tiny, tmp_path, capsys):
    """A GGML type H3 does not read is refused in a decoder layer, naming the text encoder, and ignored in the LM
    head (never read); `h3 info` counts every layer the file holds (52 here, 50 read)."""
    import numpy as np

    from h3_core.cli import main

    keys = tiny_qwen.llama_cpp_keys(tiny["model"].state_dict())

    def written(name, qtype_of):
        path = tmp_path / name
        writer = gguf.GGUFWriter(str(path), arch="qwen3vl")
        for key, tensor in keys.items():
            qtype = qtype_of(key)  # Q8_1: blocks of 32 (40 bytes) that llama.cpp has and H3 does not read
            data = (np.zeros((tensor.shape[0], tensor.shape[1] // 32 * 40), dtype=np.uint8) if qtype else
                    tensor.float().numpy().astype("float32" if tensor.dim() == 1 else "float16"))
            raw = getattr(gguf.GGMLQuantizationType, qtype or ("F32" if tensor.dim() == 1 else "F16"))
            writer.add_tensor(key, data, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    head = written("head.gguf", lambda key: "Q8_1" if key == "output.weight" else None)
    with pytest.raises(CheckpointError, match="blk.0.ffn_up.weight' in layer.gguf is stored as GGML type Q8_1, "
                                              "which H3 does not read; GGUF text encoder files may use"):
        locate_text_encoder(written("layer.gguf", lambda key: "Q8_1" if key == "blk.0.ffn_up.weight" else None))
    assert locate_text_encoder(head).gguf_tensors
    assert main(["info", str(head)]) == 0
    import json

    assert json.loads(capsys.readouterr().out)["text_encoder"]["decoder_layers"] == 52


def _mmproj_qtypes(model) -> dict:
    """The converter's types for a Q8_0 projector file: 2-D linears Q8_0, the position embedding F32, the patch
    kernel's frames F32 (forced), norms and biases F32."""
    keys = tiny_qwen.mmproj_keys(model.state_dict(), model.config.vision_config.deepstack_visual_indexes)
    return {key: "F32" if key.startswith(("v.position_embd", "v.patch_embd")) else "Q8_0"
            for key, tensor in keys.items() if tensor.dim() >= 2}


@pytest.fixture(scope="module")
def paired(tiny, tmp_path_factory):
    """The GGUF language model with a Q8_0 mmproj file beside it, and another model's projector (ignored)."""
    folder = tmp_path_factory.mktemp("paired")
    model = tiny_qwen.write_gguf_file(folder / "Qwen3-VL-tiny-Q8_0.gguf", tiny["model"], tiny["qtypes"])
    vision = tiny_qwen.write_mmproj_file(folder / "mmproj-Qwen3-VL-tiny-Q8_0.gguf", tiny["model"],
                                         _mmproj_qtypes(tiny["model"]))
    tiny_qwen.write_mmproj_file(folder / "mmproj-Qwen2.5-VL-F16.gguf", tiny["model"], {}, projector="qwen2.5vl_merger")
    return {"folder": folder, "gguf": folder / "Qwen3-VL-tiny-Q8_0.gguf", "model": model, "vision": vision}


def test_mmproj_names_are_read_as_gguf_py_names_them():
    """Our reading of llama.cpp's projector names against gguf-py's own table (transformers' names -> GGUF) where
    it has them; the converter's own names (merger, DeepStack, patch frames) as its Qwen3-VL code writes them."""
    from h3_core.text_mmproj import vision_name

    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, 27)
    for hf, part in tiny_qwen.MMPROJ_BLOCK_PARTS.items():
        assert table.get_name(f"visual.blocks.7.{hf}") == f"v.blk.7.{part}"
        assert vision_name(f"v.blk.7.{part}.bias", {}) == f"visual.blocks.7.{hf}.bias"
    assert table.get_name("visual.pos_embed") == "v.position_embd"
    assert vision_name("v.position_embd.weight", {}) == "visual.pos_embed.weight"
    assert table.get_name("visual.patch_embed.proj") == "v.patch_embd"
    assert vision_name("v.patch_embd.weight.1", {}) == "visual.patch_embed.proj.weight"
    assert vision_name("v.deepstack.16.fc2.weight", {8: 0, 16: 1, 24: 2}) == \
        "visual.deepstack_merger_list.1.linear_fc2.weight"
    assert vision_name("mm.2.bias", {}) == "visual.merger.linear_fc2.bias"
    assert vision_name("v.blk.0.attn_q.weight", {}) is None  # Ollama's split q / k / v: not llama.cpp's layout


def test_the_vision_tower_comes_from_the_mmproj_file_beside_it(tiny, paired, tmp_path, monkeypatch):
    """Keyframes through a GGUF text encoder: the prompt states of the same weights (gguf's dequantizer, the patch
    kernel's frames stacked) in a safetensors single file, bit for bit; the other model's projector is passed by."""
    from PIL import Image

    from h3_core import text_checkpoint
    from h3_core.text import text_encoder_sizes

    source = locate_text_encoder(paired["gguf"], tokenizer=tiny["partition"])
    assert source.vision_tower and source.vision.path.name == "mmproj-Qwen3-VL-tiny-Q8_0.gguf"
    assert source.vision.deepstack_layers == (0, 1)
    loaded = _load(tiny, paired["gguf"])
    qkv = loaded.model.visual.blocks[1].attn.qkv.weight
    assert qkv.dtype == torch.float32 and torch.equal(qkv, paired["vision"]["v.blk.1.attn_qkv.weight"])

    dense = tiny_qwen.comfy_keys(tiny["model"].state_dict())
    lm = {model_name(key): value for key, value in paired["model"].items() if model_name(key) is not None}
    dense.update({key: lm[model_name(key)] for key in dense if model_name(key).startswith("language_model.")})
    dense.update(tiny_qwen.vision_from_mmproj(paired["vision"], [0, 1]))
    save_file(dense, str(tmp_path / "dense.safetensors"))
    reference = _load(tiny, tmp_path / "dense.safetensors")
    picture = Image.new("RGB", (96, 64), (200, 30, 30))
    presentation = loaded.presenter.fl2va(PROMPT, [picture, picture.rotate(90, expand=True)])
    got = loaded.encode(presentation).prompt_embeds
    assert torch.equal(got, reference.encode(presentation).prompt_embeds)
    original = _load(tiny, tiny["partition"]).encode(presentation).prompt_embeds  # unquantized: near, not equal
    assert torch.nn.functional.cosine_similarity(got.flatten(), original.flatten(), dim=0) > 0.95

    monkeypatch.setattr(text_checkpoint, "QWEN3VL_32B_CONFIG", tiny["config"])  # a one-file encoder's config
    without = text_encoder_sizes(tiny["gguf"], torch.float32)[0]
    vision_bytes = sum(t.numel() * 4 for k, t in tiny["model"].state_dict().items() if k.startswith("model.visual."))
    assert text_encoder_sizes(paired["gguf"], torch.float32)[0] == without + vision_bytes


def test_which_mmproj_file_pairs_with_a_gguf_text_encoder(tiny, tmp_path, caplog):
    """Several of Qwen3-VL's projectors: the one named most like the model, said in the log; one of another
    width is passed by; DeepStack mergers after other vision blocks are refused by name."""
    import logging

    from gguf_files import write_gguf

    folder = tmp_path / "several"
    model = tiny["model"]
    tiny_qwen.write_gguf_file(folder / "tiny-Qwen3-VL-Instruct-Q4_K_M.gguf", model, {})
    for name in ("mmproj-F16.gguf", "tiny-Qwen3-VL-Instruct-mmproj-BF16.gguf"):  # the closest name sorts last
        tiny_qwen.write_mmproj_file(folder / name, model, {})
    with caplog.at_level(logging.WARNING, logger="h3"):
        source = locate_text_encoder(folder / "tiny-Qwen3-VL-Instruct-Q4_K_M.gguf")
        locate_text_encoder(folder / "tiny-Qwen3-VL-Instruct-Q4_K_M.gguf")
    assert source.vision.path.name == "tiny-Qwen3-VL-Instruct-mmproj-BF16.gguf"
    assert caplog.text.count("several vision tower files lie beside tiny-Qwen3-VL-Instruct-Q4_K_M.gguf") == 1

    narrow = tmp_path / "narrow"
    tiny_qwen.write_gguf_file(narrow / "Qwen3-VL-tiny.gguf", model, {})
    keys = tiny_qwen.mmproj_keys(model.state_dict(), [0, 1])
    keys.update({k: v[:16] for k, v in keys.items() if k.startswith(("mm.2.", "v.deepstack.1.fc2."))})
    write_gguf(narrow / "mmproj-8B.gguf", keys, arch="clip", texts={"clip.projector_type": "qwen3vl_merger"})
    with caplog.at_level(logging.WARNING, logger="h3"):
        assert not locate_text_encoder(narrow / "Qwen3-VL-tiny.gguf").vision_tower
    assert "mmproj-8B.gguf beside Qwen3-VL-tiny.gguf is passed by: it projects to 16 wide, the text encoder is 32" \
        in caplog.text

    deeper = tmp_path / "deeper"  # one vision block more than this model has: refused before any weight is read
    tiny_qwen.write_gguf_file(deeper / "Qwen3-VL-tiny.gguf", model, {})
    keys = tiny_qwen.mmproj_keys(model.state_dict(), [0, 1])
    keys.update({k.replace("v.blk.1.", "v.blk.2."): v for k, v in keys.items() if k.startswith("v.blk.1.")})
    write_gguf(deeper / "mmproj.gguf", keys, arch="clip", texts={"clip.projector_type": "qwen3vl_merger"})
    read = []
    with pytest.raises(CheckpointError, match=r"mmproj.gguf \(beside the text encoder\) is not this Qwen3-VL's vision "
                                              r"tower: 'visual.blocks.2.attn.proj.bias' is not part of this model"):
        load_text_encoder(deeper / "Qwen3-VL-tiny.gguf", torch.float32, tokenizer=tiny["partition"],
                          config=tiny["config"], on_tensor=lambda done, total: read.append(done))
    assert not read

    shifted = tmp_path / "shifted"
    tiny_qwen.write_gguf_file(shifted / "Qwen3-VL-tiny.gguf", model, {})
    write_gguf(shifted / "mmproj.gguf", tiny_qwen.mmproj_keys(model.state_dict(), [0, 3]), arch="clip",
               texts={"clip.projector_type": "qwen3vl_merger"})
    with pytest.raises(CheckpointError, match=r"mmproj.gguf \(beside the text encoder\) is not this Qwen3-VL's vision "
                                              r"tower: it has DeepStack mergers after vision blocks \[0, 3\], this "
                                              r"model after blocks \[0, 1\]"):
        _load(tiny, shifted / "Qwen3-VL-tiny.gguf")


def test_an_mmproj_file_loads_as_the_vision_tower_it_was_written_from(tiny, tmp_path):
    """Every vision tensor of an F32 projector file is the model's it was written from, bit for bit: the patch
    kernel's frames stacked in order, DeepStack mergers after blocks 1 and 2 (not 0 and 1) in their places."""
    import copy

    config = copy.deepcopy(tiny["config"])
    config["vision_config"].update(depth=3, deepstack_visual_indexes=[1, 2])
    model = tiny_qwen.random_model(config, seed=5)
    tiny_qwen.write_gguf_file(tmp_path / "Qwen3-VL-tiny.gguf", model, {})
    keys = tiny_qwen.mmproj_keys(model.state_dict(), [1, 2])
    assert "v.deepstack.2.fc1.weight" in keys and "v.deepstack.0.fc1.weight" not in keys
    tiny_qwen.write_mmproj_file(tmp_path / "mmproj-F32.gguf", model, {key: "F32" for key in keys})
    loaded = load_text_encoder(tmp_path / "Qwen3-VL-tiny.gguf", torch.float32, tokenizer=tiny["partition"],
                               config=config)
    expected = {key[len("model.visual."):]: value for key, value in model.state_dict().items()
                if key.startswith("model.visual.")}
    got = loaded.model.visual.state_dict()
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[name], expected[name]) for name in expected), \
        [name for name in expected if not torch.equal(got[name], expected[name])]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_mmproj_vision_tower_on_the_gpu_resident_and_streamed(tiny, paired):
    """Keyframes through a GGUF encoder and its Q8_0 mmproj on a GPU, resident or with the layers streamed: the
    CPU's prompt states (float32)."""
    from PIL import Image

    on_cpu = _load(tiny, paired["gguf"])
    picture = Image.new("RGB", (96, 64), (200, 30, 30))
    presentation = on_cpu.presenter.fl2va(PROMPT, [picture, picture.rotate(90, expand=True)])
    expected = on_cpu.encode(presentation).prompt_embeds
    on_gpu = load_text_encoder(paired["gguf"], torch.float32, "cuda", tokenizer=tiny["partition"],
                               config=tiny["config"])
    assert on_gpu.model.visual.blocks[0].attn.qkv.weight.device.type == "cuda"
    relative = lambda got: ((got.cpu() - expected).norm() / expected.norm()).item()  # noqa: E731
    assert relative(on_gpu.encode(presentation).prompt_embeds) < 1e-3
    assert relative(on_cpu.stream_layers("cuda").encode(presentation).prompt_embeds) < 1e-3


def test_companions_are_gguf_files_named_mmproj_whatever_the_suffix_case(tmp_path):
    from h3_core.text_mmproj import companions

    model = tmp_path / "Qwen3-VL.gguf"
    for name in ("Qwen3-VL.gguf", "x-mmproj.GGUF", "mmproj-notes.txt", "other.gguf"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "y-mmproj.gguf").mkdir()
    assert [path.name for path in companions(model)] == ["x-mmproj.GGUF"]
