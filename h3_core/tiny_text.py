"""The tiny Qwen3-VL text encoder of `tiny-random`: transformers' own model at a tiny size, a tokenizer
built offline with the `tokenizers` library, and the processor configs; used by the embedded demo
model and by the tests (which also write it in every on-disk layout).

The model: text width 32 (48 for the demo, the tiny DiT's text_dim), 52 decoder layers so that
`hidden_states[50]` exists for diffusers' helper (50 for the demo), 2 vision blocks with DeepStack,
the real patch 16 / temporal patch 2 / merge 2; seeded random weights with norms and biases
perturbed. The tokenizer is a byte-level BPE in Qwen2's shape (same pre-tokenizer split, NFC,
byte-level decoder) trained on a small corpus, plus the special tokens the processor needs and
MiniMax's `<d>` / `</d>`.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import torch

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
VIDEO_PROCESSOR = {  # the image processor's recipe with the video processor's type and pixel budget
    **{key: value for key, value in IMAGE_PROCESSOR.items() if key != "image_processor_type"},
    "video_processor_type": "Qwen3VLVideoProcessor",
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


def config_dict(tokenizer_folder: Path, layers: int = TEXT_LAYERS, hidden: int = 32) -> dict:
    """A tiny Qwen3-VL config (text width `hidden`) whose special-token ids are the tiny tokenizer's."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_folder))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab = 32 * math.ceil(len(tokenizer) / 32)
    return {
        "model_type": "qwen3_vl",
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "text_config": {
            "vocab_size": vocab,
            "hidden_size": hidden,
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
            "out_hidden_size": hidden,
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
    """transformers' Qwen3VLForConditionalGeneration, seeded random weights (`tiny.seeded_random_weights`), eval."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from .tiny import own_random_state, seeded_random_weights

    with own_random_state():
        model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**config))
        return seeded_random_weights(model, seed).eval().requires_grad_(False)




TINY_TEXT_HIDDEN = 48


def tiny_random_text_encoder(hidden: int = TINY_TEXT_HIDDEN, device="cpu", seed: int = 7):
    """The demo's text encoder, written to a temporary folder and loaded through the real loader (so the
    demo runs the same code path as real weights). The folder is removed once loaded: every demo run and
    every ComfyUI load of the tiny model would otherwise leave 3.5 MB behind in the temp directory."""
    from transformers.utils import logging as transformers_logging

    from .text import load_text_encoder
    from .text_checkpoint import check_transformers

    check_transformers()  # the random model below is made with its classes
    bars = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()  # no "Writing model shards" bar in the demo's output
    try:
        with tempfile.TemporaryDirectory(prefix="h3-tiny-text-", ignore_cleanup_errors=True) as name:
            folder = Path(name)
            write_tokenizer(folder)
            write_processor(folder, nested=True)
            model = random_model(config_dict(folder, layers=50, hidden=hidden), seed)
            model.save_pretrained(str(folder), safe_serialization=True)
            encoder = load_text_encoder(folder, dtype=torch.float32, device=device)
    finally:  # the caller's setting back: a library leaves transformers' bars as it found them
        if bars:
            transformers_logging.enable_progress_bar()
    encoder.reader = None  # its files are gone: it cannot be let go of and read again
    return encoder
