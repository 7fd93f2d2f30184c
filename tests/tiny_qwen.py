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
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

TEXT_LAYERS = 52
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
ADDED_TOKENS = ("<d>", "</d>")
QWEN2_PRETOKENIZE = (  # Qwen2's pre-tokenizer split
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
CORPUS = [
    "<Picture 1>: <Picture 2>: <Audio 1>: <Audio 2>: <Video 1>: <Video 2>: <0.2 seconds> <1.2 seconds> <2.2 seconds>",
    "integrated_multimodal_description: overall_soundscape: non_diegetic_music: subject_definitions: summary:",
    "A red fox walks along the beach at sunset while the camera pans slowly to the right.",
    "<d>[English] Hello there, how are you today?</d> The waves crash softly. [Shot 1] At 00:04.500",
]

# Image blocks of a 64x96 keyframe: (64/16) * (96/16) / 2^2 = 6 tokens. Images above 96x128 pixels
# are resized by the processor; video clips above 16384 pixels over all frames are resized.
IMAGE_PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "processor_class": "Qwen3VLProcessor",
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
    "resample": 3,
    "rescale_factor": 1 / 255,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 32 * 32, "longest_edge": 96 * 128},
}
VIDEO_PROCESSOR = {
    "video_processor_type": "Qwen3VLVideoProcessor",
    "processor_class": "Qwen3VLProcessor",
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
    "resample": 3,
    "rescale_factor": 1 / 255,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 32 * 32, "longest_edge": 16384},
}


def write_tokenizer(folder: Path) -> Path:
    """tokenizer.json + tokenizer_config.json of a tiny Qwen2-shaped byte-level BPE."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False, special_tokens=[]
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 262144,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "bos_token": None,
        "add_prefix_space": False,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


def write_processor(folder: Path, nested: bool = False) -> Path:
    """The processor configs: legacy per-processor files, or transformers 5's nested processor_config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    if nested:
        payload = {
            "processor_class": "Qwen3VLProcessor",
            "image_processor": IMAGE_PROCESSOR,
            "video_processor": VIDEO_PROCESSOR,
        }
        (folder / "processor_config.json").write_text(json.dumps(payload, indent=2))
    else:
        (folder / "preprocessor_config.json").write_text(json.dumps(IMAGE_PROCESSOR, indent=2))
        (folder / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PROCESSOR, indent=2))
    return folder


def config_dict(tokenizer_folder: Path, layers: int = TEXT_LAYERS) -> dict:
    """A tiny Qwen3-VL config whose special-token ids are the tiny tokenizer's."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_folder))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab = 32 * math.ceil(len(tokenizer) / 32)
    return {
        "model_type": "qwen3_vl",
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "text_config": {
            "vocab_size": vocab,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": layers,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [4, 2, 2],
                "mrope_interleaved": True,
            },
        },
        "vision_config": {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 16,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "out_hidden_size": 32,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0, 1],
        },
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "tie_word_embeddings": False,
    }


def random_model(config: dict, seed: int = 7):
    """transformers' Qwen3VLForConditionalGeneration with seeded random weights, fp32, eval."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**config)).eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.ndim == 1:
                base = 1.0 if "norm" in name and name.endswith("weight") else 0.0
                param.copy_(base + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(param[0].numel()))
    return model


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
    _copy_tokenizer(tokenizer_folder, partition / "tokenizer")
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
    _copy_tokenizer(tokenizer_folder, folder)
    write_processor(folder, nested=True)
    return folder


def write_single_file(path: Path, model, layers: int = 50, prefix: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(comfy_keys(model.state_dict(), layers, prefix), str(path))
    return path


def _copy_tokenizer(source: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (target / name).write_bytes((source / name).read_bytes())
