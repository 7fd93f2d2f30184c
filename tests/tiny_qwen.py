"""A tiny Qwen3-VL text encoder + tokenizer + processor, written in every layout users have.

The model is transformers' own `Qwen3VLForConditionalGeneration` at a tiny size (text hidden 32,
52 decoder layers so that `hidden_states[50]` exists for diffusers' helper, 2 vision blocks with
DeepStack after both, the real patch 16 / temporal patch 2 / merge 2), with seeded random weights
(norms and biases perturbed too, so every term matters). The tokenizer is a byte-level BPE built
with the `tokenizers` library in Qwen2's shape (same pre-tokenizer regex, NFC, byte-level decoder)
from a small corpus, plus the special tokens the processor needs and MiniMax's `<d>`/`</d>`.
Everything is written as safetensors / JSON only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from h3_core.tiny_text import (  # noqa: F401  (re-exported for the tests)
    ADDED_TOKENS,
    CORPUS,
    IMAGE_PROCESSOR,
    QWEN2_PRETOKENIZE,
    SPECIAL_TOKENS,
    TEXT_LAYERS,
    VIDEO_PROCESSOR,
    config_dict,
    random_model,
    write_processor,
    write_tokenizer,
)


def original_keys(state: dict) -> dict:
    """transformers' names as the release's text_encoder/ shards spell them (model.language_model.*,
    model.visual.*, lm_head.*)."""
    return {key: tensor.contiguous() for key, tensor in state.items()}


def comfy_keys(state: dict, layers: int = 50, prefix: str = "") -> dict:
    """The Comfy-Org single file: model.embed_tokens.*, model.layers.{0..layers-1}.*, visual.*;
    no final norm, no LM head."""
    out = {}
    for key, tensor in state.items():
        if key.startswith("model.language_model."):
            rest = key[len("model.language_model.") :]
            if rest.startswith("norm.") or (rest.startswith("layers.") and int(rest.split(".")[1]) >= layers):
                continue
            out[prefix + "model." + rest] = tensor.contiguous()
        elif key.startswith("model.visual."):
            out[prefix + "visual." + key[len("model.visual.") :]] = tensor.contiguous()
    return out


# transformers' decoder-layer names -> llama.cpp's (gguf-py's tensor name map for the qwen3vl architecture)
LLAMA_CPP_LAYER_PARTS = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def llama_cpp_keys(state: dict) -> dict:
    """The language model as llama.cpp's converter writes a Qwen3-VL GGUF: token_embd, blk.N.* (every layer),
    output_norm, output (the LM head); the vision tower goes to a separate mmproj file, so it is left out."""
    out = {}
    for key, tensor in state.items():
        if key == "lm_head.weight":
            out["output.weight"] = tensor
        elif key.startswith("model.language_model."):
            rest = key[len("model.language_model."):]
            if rest == "embed_tokens.weight":
                out["token_embd.weight"] = tensor
            elif rest.startswith("norm."):
                out["output_norm." + rest[len("norm."):]] = tensor
            else:
                number, part, leaf = re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", rest).groups()
                out[f"blk.{number}.{LLAMA_CPP_LAYER_PARTS[part]}.{leaf}"] = tensor
    return {key: tensor.contiguous() for key, tensor in out.items()}


def write_gguf_file(path: Path, model, qtypes: dict[str, str]) -> dict:
    """`llama_cpp_keys` of the model as a GGUF file (architecture qwen3vl), each tensor in `qtypes[key]` (1-D:
    F32, else F16 unless named). Returns the float32 tensor each key stands for, per gguf's dequantizer."""
    from gguf_files import write_gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    return write_gguf(path, llama_cpp_keys(model.state_dict()), qtypes, arch="qwen3vl")


# transformers' vision block names -> llama.cpp's mmproj names (its Qwen3-VL converter; gguf-py's MMPROJ map)
MMPROJ_BLOCK_PARTS = {"norm1": "ln1", "attn.qkv": "attn_qkv", "attn.proj": "attn_out", "norm2": "ln2",
                      "mlp.linear_fc1": "ffn_up", "mlp.linear_fc2": "ffn_down"}
MMPROJ_MERGER_PARTS = {"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}
MMPROJ_DEEPSTACK_PARTS = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}


def mmproj_keys(state: dict, deepstack_layers: list[int]) -> dict:
    """The vision tower as llama.cpp's converter writes a Qwen3-VL mmproj file: the Conv3d patch kernel split
    into its two temporal frames, DeepStack mergers named by the vision block they follow, the merger's
    linears mm.0 / mm.2."""
    out = {}
    for key, tensor in state.items():
        if not key.startswith("model.visual."):
            continue
        rest = key[len("model.visual."):]
        if rest == "patch_embed.proj.weight":
            out["v.patch_embd.weight"], out["v.patch_embd.weight.1"] = tensor[:, :, 0], tensor[:, :, 1]
        elif rest == "patch_embed.proj.bias":
            out["v.patch_embd.bias"] = tensor
        elif rest == "pos_embed.weight":
            out["v.position_embd.weight"] = tensor
        elif rest.startswith("blocks."):
            number, part, leaf = re.fullmatch(r"blocks\.(\d+)\.(.+)\.(weight|bias)", rest).groups()
            out[f"v.blk.{number}.{MMPROJ_BLOCK_PARTS[part]}.{leaf}"] = tensor
        elif rest.startswith("merger."):
            part, leaf = rest[len("merger."):].rsplit(".", 1)
            out[f"{MMPROJ_MERGER_PARTS[part]}.{leaf}"] = tensor
        else:
            index, part, leaf = re.fullmatch(r"deepstack_merger_list\.(\d+)\.(.+)\.(weight|bias)", rest).groups()
            out[f"v.deepstack.{deepstack_layers[int(index)]}.{MMPROJ_DEEPSTACK_PARTS[part]}.{leaf}"] = tensor
    return {key: tensor.contiguous() for key, tensor in out.items()}


def vision_from_mmproj(values: dict, deepstack_layers: list[int]) -> dict:
    """`mmproj_keys`' inverse: an mmproj file's tensors (by its keys) in the Comfy-Org single file's visual.*
    names, the patch kernel's frames stacked back into the Conv3d kernel."""
    blocks = {v: k for k, v in MMPROJ_BLOCK_PARTS.items()}
    merger = {v: k for k, v in MMPROJ_MERGER_PARTS.items()}
    deepstack = {v: k for k, v in MMPROJ_DEEPSTACK_PARTS.items()}
    out = {"visual.patch_embed.proj.weight": torch.stack([values["v.patch_embd.weight"],
                                                          values["v.patch_embd.weight.1"]], dim=2)}
    for key, tensor in values.items():
        stem, _, leaf = key.rpartition(".")
        if key in ("v.patch_embd.weight", "v.patch_embd.weight.1"):
            continue
        if stem == "v.patch_embd":
            out[f"visual.patch_embed.proj.{leaf}"] = tensor
        elif stem == "v.position_embd":
            out[f"visual.pos_embed.{leaf}"] = tensor
        elif stem in merger:
            out[f"visual.merger.{merger[stem]}.{leaf}"] = tensor
        elif stem.startswith("v.blk."):
            _, _, number, part = stem.split(".", 3)
            out[f"visual.blocks.{number}.{blocks[part]}.{leaf}"] = tensor
        else:
            _, _, layer, part = stem.split(".", 3)
            out[f"visual.deepstack_merger_list.{deepstack_layers.index(int(layer))}.{deepstack[part]}.{leaf}"] = tensor
    return out


def write_mmproj_file(path: Path, model, qtypes: dict[str, str], projector: str = "qwen3vl_merger") -> dict:
    """`mmproj_keys` of the model as a GGUF file (architecture clip, its projector type), each tensor in
    `qtypes[key]` (1-D: F32, else F16 unless named). Returns the float32 tensor each key stands for."""
    from gguf_files import write_gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    keys = mmproj_keys(model.state_dict(), model.config.vision_config.deepstack_visual_indexes)
    return write_gguf(path, keys, qtypes, arch="clip", texts={"clip.projector_type": projector})


def write_sharded(folder: Path, tensors: dict, shard_of) -> None:
    """Safetensors shards + model.safetensors.index.json; `shard_of(key)` picks a shard number."""
    folder.mkdir(parents=True, exist_ok=True)
    shards: dict[int, dict] = {}
    for key, tensor in tensors.items():
        shards.setdefault(shard_of(key), {})[key] = tensor
    count = len(shards)
    weight_map = {}
    for number, (_, part) in enumerate(sorted(shards.items()), start=1):
        name = f"model-{number:05d}-of-{count:05d}.safetensors"
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in part})
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
        "weight_map": weight_map,
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def unused_last(key: str) -> int:
    """Shard plan of the release: layers >= 50, the final norm and the LM head in the last shard."""
    if key.startswith("lm_head.") or key.startswith("model.language_model.norm."):
        return 2
    if key.startswith("model.language_model.layers."):
        return 2 if int(key.split(".")[3]) >= 50 else 1
    return 0


def write_original_release(root: Path, model, tokenizer_folder: Path) -> Path:
    """`root/FL2VA/{model_index.json, text_encoder/, tokenizer/, processor/}` as the release lays it out."""
    partition = root / "FL2VA"
    encoder = partition / "text_encoder"
    write_sharded(encoder, original_keys(model.state_dict()), unused_last)
    config = dict(model.config.to_dict())
    (encoder / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer(tokenizer_folder, partition / "tokenizer")
    write_processor(partition / "processor")
    index = {
        "_class_name": "MiniMaxH3Pipeline",
        "text_encoder": ["minimax_h3", "MiniMaxH3Qwen3VLHFEncoder"],
        "tokenizer": ["transformers", "Qwen2TokenizerFast"],
        "processor": ["transformers", "Qwen3VLProcessor"],
    }
    (partition / "model_index.json").write_text(json.dumps(index, indent=2))
    return root


def write_hf_folder(folder: Path, model, tokenizer_folder: Path) -> Path:
    """transformers' own save_pretrained (safetensors) + tokenizer + nested processor config, one folder."""
    model.save_pretrained(str(folder), safe_serialization=True)
    copy_tokenizer(tokenizer_folder, folder)
    write_processor(folder, nested=True)
    return folder


def write_single_file(path: Path, model, layers: int = 50, prefix: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(comfy_keys(model.state_dict(), layers, prefix), str(path))
    return path


def copy_tokenizer(source: Path, target: Path) -> None:
    """The tokenizer's files into `target` (its chat template too, where `source` has one)."""
    target.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if name != "chat_template.jinja" or (source / name).is_file():
            (target / name).write_bytes((source / name).read_bytes())
