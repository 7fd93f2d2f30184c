"""Finding and loading the Qwen3-VL text encoder's weights, truncated to the layers H3 reads.

H3 conditions on the residual stream after decoder layer 50 of Qwen3-VL-32B (h3-model.md E.1), so
only the token embedding, the first 50 decoder layers and the vision tower are loaded (about 25.6 B
parameters, 51.5 GB in bf16); decoder layers 50..63, the final norm and the LM head are never read
(sharded folders: shards that hold only those are not even opened).

Layouts (h3-model.md I):
- an original release partition: `FL2VA/text_encoder/` (config.json + sharded safetensors + index),
  with `FL2VA/tokenizer/` and `FL2VA/processor/` beside it; the release root or the partition folder
  may be given instead;
- an HF-layout model folder (config.json, shards, tokenizer and processor files in one folder);
- the Comfy-Org single file (`qwen3vl_32b_minimax_h3_bf16.safetensors`: 50 layers, no final norm,
  no LM head, keys optionally prefixed `text_encoders.qwen3vl_32b.transformer.`). It carries neither
  config nor tokenizer: the tokenizer/processor folders are given separately (or, when none is given,
  the release's are fetched from the Hub: about 7 MiB) and the config is the built-in Qwen3-VL-32B one
  (or one given);
- a GGUF file of Qwen3-VL-32B's language model, as llama.cpp's converter writes it (architecture `qwen3vl`,
  names `token_embd.*`, `blk.N.attn_q.*`, ...; no weight is permuted for Qwen models): its quantized block
  linears stay in their GGML blocks (`gguf_file.GGUFLinear`), the embedding is dequantized at load. llama.cpp
  keeps the vision tower in a separate mmproj file, read from beside it (`text_mmproj`); without one, a GGUF
  text encoder encodes prompts only, not keyframes or image / video references.
Tensor names may be spelled `model.language_model.*` / `model.visual.*` (transformers >= 4.57) or
`model.*` / `visual.*` (older Qwen-VL naming, the single file). Only safetensors and GGUF files are read.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import fp8, gguf_file, keymap, nvfp4
from .hub import fetch_release, hub_error_text, release_patterns
from .text_mmproj import VisionTowerFile, find_vision_tower
from .weights import (
    PICKLE_SUFFIXES,
    CheckpointError,
    assign_strictly,
    check_safetensors_file,
    config_errors,
    described,
    read_headers,
    read_json,
    read_tensors,
    read_weight_map,
    refuse_a_shard,
    tensor_names,
)

MIN_TRANSFORMERS = (5, 17)  # pyproject.toml's floor: the Qwen3-VL classes as this engine drives them


def check_transformers(version: str | None = None) -> None:
    """Refuse a transformers older than the engine needs, before any weight is read: another pack's requirements
    can downgrade it under ComfyUI, and an old one fails deep inside its Qwen3-VL code (AttributeError on None)."""
    if version is None:
        import transformers

        version = transformers.__version__
    found = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if found < MIN_TRANSFORMERS:
        wanted = ".".join(map(str, MIN_TRANSFORMERS))
        raise CheckpointError(f"The text encoder needs transformers >= {wanted}; this Python has {version}. "
                              f"Upgrade it: python -m pip install 'transformers>={wanted}'.")

RELEASE_REPO = "MiniMaxAI/MiniMax-H3"  # the original release on the Hugging Face Hub (h3-model.md I.1)
RELEASE_TOKENIZER_FILES = tuple(release_patterns("fl2va", ("tokenizer",)))  # FL2VA/tokenizer/*, FL2VA/processor/*
TEXT_ENCODER_LAYER = 50  # H3 reads hidden_states[50]: the residual stream after decoder layer 50
PARTITION_FOLDERS = ("FL2VA", "Ref2VA")  # both partitions ship the same text encoder
INDEX_NAME = "model.safetensors.index.json"
KEY_PREFIXES = ("text_encoders.qwen3vl_32b.transformer.", "qwen3vl_32b.transformer.")
# ComfyUI's CLIPSave and CheckpointSave write the CLIP logit scale beside the encoder; H3 does not use it
COMFY_EXTRAS = ("text_encoders.qwen3vl_32b.logit_scale", "qwen3vl_32b.logit_scale")
TOKENIZER_MARKERS = ("tokenizer.json", "vocab.json")
PROCESSOR_MARKERS = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
GGUF_ARCHITECTURE = "qwen3vl"  # llama.cpp's name for Qwen3-VL's language model
# llama.cpp's tensor names (gguf-py's TensorNameMap for qwen3vl) -> the older Qwen-VL names model_name reads
GGUF_LAYER_PARTS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GGUF_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
GGUF_NO_VISION = ("holds no vision tower, and no Qwen3-VL-32B mmproj file lies beside it (llama.cpp keeps the vision "
                  "tower in a separate file, e.g. mmproj-F16.gguf: put it in the same folder), so it encodes prompts "
                  "only; keyframes and image or video references need that file, or a safetensors text encoder")

# Qwen3-VL-32B (the config the release's text_encoder/config.json carries), for the single file.
QWEN3VL_32B_CONFIG = {
    "model_type": "qwen3_vl",
    "text_config": {
        "vocab_size": 151936,
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "attention_bias": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
    },
    "vision_config": {
        "depth": 27,
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_heads": 16,
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
        "patch_size": 16,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "out_hidden_size": 5120,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [8, 16, 24],
    },
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class TextEncoderSource:
    """Where the text encoder's pieces are. `config` is None for a single file (none shipped)."""

    files: tuple[Path, ...]  # safetensors holding the tensors that are used
    config: dict | None
    tokenizer_folder: Path | None
    processor_folder: Path | None
    origin: str  # "original partition", "diffusers folder", "HF-layout folder", "single file" or "GGUF file"
    gguf_tensors: dict = field(default_factory=dict, compare=False)  # file key -> gguf_file.GGUFEntry (GGUF files)
    vision: VisionTowerFile | None = field(default=None, compare=False)  # a GGUF file's mmproj beside it

    @property
    def one_file(self) -> bool:
        """A single file (safetensors or GGUF): it carries no config, tokenizer or processor."""
        return self.origin in ("single file", "GGUF file")

    @property
    def vision_tower(self) -> bool:
        """Whether the files hold the vision tower that reads keyframes and image / video references."""
        return not self.gguf_tensors or self.vision is not None


def locate_text_encoder(
    path: str | Path,
    tokenizer: str | Path | None = None,
    processor: str | Path | None = None,
    layers: int = TEXT_ENCODER_LAYER,
) -> TextEncoderSource:
    """Resolve a user path to the text encoder's weights, config, tokenizer and processor folders.

    `path`: a release root, a partition folder (`FL2VA/`), a `text_encoder/` folder, an HF-layout
    model folder, a single .safetensors file, or a GGUF file of the language model. `tokenizer` / `processor`: folders overriding the
    ones found beside the weights; each may also be a folder holding `tokenizer/` and `processor/`
    (a partition folder or the release root), which is how a single file is paired with them.
    `layers`: how many decoder layers will be loaded (decides which shards are needed)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path} does not exist.")
    gguf_tensors, vision = {}, None
    if path.is_file() and gguf_file.is_gguf(path):
        gguf_tensors = _gguf_text_encoder(path)
        if "token_embd.weight" in gguf_tensors:
            vision = find_vision_tower(path, gguf_tensors["token_embd.weight"].shape[1])
        files, config, roots, origin = (path,), None, [], "GGUF file"
    elif path.is_file():
        check_safetensors_file(path, "Text encoder single", " (or GGUF, .gguf)")
        refuse_a_shard(path, "text encoder")
        files, config, roots, origin = (path,), None, [], "single file"
    else:
        folder = _weights_folder(path)
        config = _read_config(folder / "config.json")
        files = _shards(folder, layers)
        roots = [folder, folder.parent]
        origin = _folder_origin(folder)

    tokenizer_roots = [Path(tokenizer).expanduser()] if tokenizer is not None else roots
    tokenizer_folder = _find(tokenizer_roots, "tokenizer", TOKENIZER_MARKERS)
    if tokenizer is not None and tokenizer_folder is None:
        raise CheckpointError(
            f"{tokenizer} holds no tokenizer (expected {' or '.join(TOKENIZER_MARKERS)} in it or in a tokenizer/ "
            "folder inside it)."
        )
    processor_roots = [Path(processor).expanduser()] if processor is not None else list(tokenizer_roots)
    if processor is None and tokenizer_folder is not None:
        processor_roots += [tokenizer_folder, tokenizer_folder.parent]
    if processor is None and tokenizer is not None:  # a tokenizer given alone: the model's own processor after
        processor_roots += roots
    processor_folder = _find(processor_roots, "processor", PROCESSOR_MARKERS)
    if processor is not None and processor_folder is None:
        raise CheckpointError(
            f"{processor} holds no Qwen3-VL processor config (expected one of {', '.join(PROCESSOR_MARKERS)} in it "
            "or in a processor/ folder inside it)."
        )
    return TextEncoderSource(tuple(files), config, tokenizer_folder, processor_folder, origin, gguf_tensors, vision)


def _folder_origin(folder: Path) -> str:
    """What a text encoder folder is part of, for messages: a repository whose model_index.json names
    transformers' Qwen3VLForConditionalGeneration is the diffusers-format root; one beside a tokenizer/ otherwise an
    original partition (whose index names MiniMax's own encoder class); else a model folder on its own."""
    if not (folder.parent / "tokenizer").is_dir():
        return "HF-layout folder"
    index = folder.parent / "model_index.json"
    try:
        entry = read_json(index).get("text_encoder") if index.is_file() else None
    except CheckpointError:
        entry = None  # an unreadable index says nothing; the weights are checked as they load
    return "diffusers folder" if isinstance(entry, list) and "Qwen3VLForConditionalGeneration" in entry else \
        "original partition"


def _gguf_text_encoder(path: Path) -> dict:
    """A GGUF file's tensor entries, refused unless it is a Qwen3-VL language model (headers only)."""
    # the LM head, final norm and rope table are never read: their GGML types do not matter
    entries, (arch,) = gguf_file.gguf_entries(path, "text encoder", unused=lambda key: model_name(key, 10**9) is None)
    if arch != GGUF_ARCHITECTURE:
        what = ("a vision projector (mmproj) file" if arch == "clip" else
                f"a GGUF file of the '{arch}' architecture" if arch else "a GGUF file naming no architecture")
        raise CheckpointError(f"{path.name} is {what}; a GGUF text encoder for H3 is Qwen3-VL-32B's language model "
                              f"(architecture '{GGUF_ARCHITECTURE}', e.g. Qwen3-VL-32B-Instruct-Q8_0.gguf).")
    return entries


def release_tokenizer(repo: str = RELEASE_REPO) -> Path:
    """The release's `FL2VA/` holding only its tokenizer and processor folders (about 7 MiB), from the Hugging
    Face cache or fetched into it. A single text-encoder file carries neither, and the release's tokenizer
    has MiniMax's own tokens (`<d>` for dialogue) that a stock Qwen tokenizer splits into text."""
    try:
        root = fetch_release(repo, "fl2va", ("tokenizer",))
    except (OSError, ValueError) as error:  # offline, gated, moved: say how to get them by hand
        raise CheckpointError(
            f"A single text-encoder file carries no tokenizer, and fetching the release's from {repo} failed "
            f"({hub_error_text(error)}). Download them with "
            f"`hf download {repo} {' '.join('--include ' + repr(f) for f in RELEASE_TOKENIZER_FILES)} "
            "--local-dir DIR` and give DIR/FL2VA as the tokenizer (the H3 Text Encoder Loader's tokenizer_folder, "
            "`--tokenizer` for h3 generate, `tokenizer=` in Python).") from None
    return root / "FL2VA"


def _weights_folder(path: Path) -> Path:
    candidates = [path, path / "text_encoder"] + [path / p / "text_encoder" for p in PARTITION_FOLDERS]
    for candidate in candidates:
        if (candidate / "config.json").is_file():
            if any(candidate.glob("*.safetensors")):
                return candidate
            pickles = sorted(p.name for p in candidate.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
            if pickles:
                raise CheckpointError(
                    f"{candidate} holds only pickle weights ({', '.join(pickles[:3])}); H3 loads only .safetensors, "
                    "which cannot run code on load. Convert them to safetensors first."
                )
    raise CheckpointError(
        f"{path} is not a Qwen3-VL text encoder: expected a folder with config.json and *.safetensors (an original "
        "'FL2VA/text_encoder' folder, an HF-layout model folder, or a release root / partition folder holding one), "
        "or a single .safetensors file."
    )


def _read_config(path: Path) -> dict:
    config = read_json(path)
    if "text_config" not in config or "vision_config" not in config:
        raise CheckpointError(f"{path} is not a Qwen3-VL config (it needs 'text_config' and 'vision_config').")
    return config


def _shards(folder: Path, layers: int) -> tuple[Path, ...]:
    """The shards to open: from the index, only those holding a tensor that is used."""
    index_path = folder / INDEX_NAME
    if not index_path.is_file():
        return tuple(sorted(folder.glob("*.safetensors")))
    weight_map = read_weight_map(index_path)
    needed = sorted({shard for key, shard in weight_map.items() if model_name(key, layers) is not None})
    for shard in needed:
        check_safetensors_file(folder / shard, "Text encoder shard")
    missing = [shard for shard in needed if not (folder / shard).is_file()]
    if missing:
        raise CheckpointError(f"{index_path} lists shards that are not in {folder}: {', '.join(missing)}.")
    return tuple(folder / shard for shard in needed)


def _find(roots: list[Path], subfolder: str, markers: tuple[str, ...]) -> Path | None:
    for root in roots:
        candidates = [root, root / subfolder] + [root / p / subfolder for p in PARTITION_FOLDERS]
        for candidate in candidates:
            if candidate.is_dir() and any((candidate / marker).is_file() for marker in markers):
                return candidate
    return None


def model_name(key: str, layers: int = TEXT_ENCODER_LAYER) -> str | None:
    """A checkpoint key -> the `Qwen3VLModel` parameter it fills, or None when H3 does not use it (the LM
    head, the final norm, decoder layers >= `layers`, an all-in-one file's other models, ComfyUI's saved logit
    scale). Unknown keys are returned as they are, so the strict loader names them."""
    key = _from_gguf_name(key)
    if key is None or key.startswith(keymap.PREFIXES + keymap.VAE_PREFIXES):  # an all-in-one file's DiT and VAEs
        return None
    if key in COMFY_EXTRAS:
        return None
    for prefix in KEY_PREFIXES:
        if key.startswith(prefix):
            key = key[len(prefix) :]
            break
    if key.startswith("lm_head."):
        return None
    if key.startswith("model.language_model."):
        name = "language_model." + key[len("model.language_model.") :]
    elif key.startswith("model.visual."):
        name = "visual." + key[len("model.visual.") :]
    elif key.startswith(("visual.", "language_model.")):
        name = key
    elif key.startswith("model."):
        name = "language_model." + key[len("model.") :]
    else:
        return key
    if name.startswith("language_model.norm."):
        return None
    match = re.match(r"language_model\.layers\.(\d+)\.", name)
    if match and int(match.group(1)) >= layers:
        return None
    return name


def _from_gguf_name(key: str) -> str | None:
    """A llama.cpp tensor name as the older Qwen-VL name (None: rope_freqs, which transformers computes); any
    other key as it is."""
    if key in GGUF_NAMES:
        return GGUF_NAMES[key]
    if key.startswith("rope_freqs."):
        return None
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", key)
    if match and match.group(2) in GGUF_LAYER_PARTS:
        return f"model.layers.{match.group(1)}.{GGUF_LAYER_PARTS[match.group(2)]}.{match.group(3)}"
    return key


def source_tensor_names(source: TextEncoderSource) -> list[str]:
    """Every tensor key of the source's files (headers only)."""
    return list(source.gguf_tensors) if source.gguf_tensors else tensor_names(source.files)


def checkpoint_layers(keys: list[str]) -> int:
    """How many decoder layers a checkpoint holds (1 + the highest layer index)."""
    indices = [int(m.group(1)) for k in keys if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", k))]
    return 1 + max(indices) if indices else 0


def qwen3vl_config(config, layers: int = TEXT_ENCODER_LAYER):
    """A transformers `Qwen3VLConfig` from a `Qwen3VLConfig`, a config dict, a config.json path or
    its folder (None: the built-in Qwen3-VL-32B one), with the text stack cut to `layers` layers."""
    from transformers import Qwen3VLConfig

    if isinstance(config, Qwen3VLConfig):
        config = config.to_dict()
    if config is None:
        raw = copy.deepcopy(QWEN3VL_32B_CONFIG)
    elif isinstance(config, dict):
        raw = copy.deepcopy(config)
    else:
        path = Path(config).expanduser()
        raw = _read_config(path / "config.json" if path.is_dir() else path)
    if "text_config" not in raw or "vision_config" not in raw:
        raise CheckpointError("A Qwen3-VL config needs 'text_config' and 'vision_config'.")
    where = "" if config is None or isinstance(config, dict) else f" at {config}"
    with config_errors(f"The text encoder (Qwen3-VL){where}"):
        available = int(raw["text_config"].get("num_hidden_layers", 0))
        if available < layers:
            raise CheckpointError(
                f"H3 reads the state after decoder layer {layers}, but this Qwen3-VL config has {available} layers."
            )
        text = dict(raw["text_config"], num_hidden_layers=layers)
        top = {
            k: raw[k]
            for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
            if k in raw
        }
        return Qwen3VLConfig(text_config=text, vision_config=dict(raw["vision_config"]), tie_word_embeddings=False,
                             **top)


def load_qwen3vl(
    source: TextEncoderSource,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    config=None,
    layers: int = TEXT_ENCODER_LAYER,
    on_tensor=None,
):
    """Build transformers' `Qwen3VLModel` with `layers` decoder layers and an identity final norm,
    and fill it tensor by tensor (cast to `dtype`, placed on `device`) from `source`; `on_tensor(done,
    total)` after each (weights.assign_strictly).

    With the stack cut after decoder layer `layers` and no final norm, the model's
    `last_hidden_state` is the un-normalized residual stream after that layer, i.e. the full
    model's `hidden_states[layers]`. `config` (anything `qwen3vl_config` takes) overrides the
    folder's config.json; a single file without one is read as Qwen3-VL-32B. Linears a file holds in int8,
    FP8 or NVFP4 stay so, and so do a GGUF file's quantized decoder-layer linears (`planned_model`)."""
    names = source_tensor_names(source)
    _check_is_text_encoder(names, source)
    qwen_config = qwen3vl_config(config if config is not None else source.config, layers)
    deepstack = len(qwen_config.vision_config.deepstack_visual_indexes)
    if layers <= deepstack:
        raise CheckpointError(
            f"Layer {layers} is one of the first {deepstack} layers that take DeepStack vision features after them; "
            "H3 reads layer 50."
        )
    held = checkpoint_layers([name for name in all_model_names(names) if name.startswith("language_model.")])
    if held < layers:
        raise CheckpointError(
            f"{_origin(source)} holds {held} decoder layers; H3 reads the state after layer {layers}, so it needs at "
            f"least {layers}."
        )

    plan = planned_model(source, qwen_config, layers, dtype)
    if source.vision is not None:
        source.vision.check_fits(plan.model.visual, qwen_config.vision_config.deepstack_visual_indexes)
    # names, shapes and dtypes from the headers first: a wrong tensor is found before ~50 GB are read
    assign_strictly(plan.model, plan.tensors(_used_tensors(source, layers, data=False), "meta"), _origin(source),
                    plan.dtype_for, "meta")
    assign_strictly(plan.model, plan.tensors(_used_tensors(source, layers), device), _origin(source),
                    plan.dtype_for, device, on_tensor)
    _rebuild_rotary_buffers(plan.model, device)
    return plan.model.eval().requires_grad_(False)


@dataclass
class TextEncoderPlan:
    """The meta-built model `load_qwen3vl` fills, and how it holds the linears its files quantize: int8 and e4m3
    ones as FP8Linear (`fp8`), NVFP4 ones as NVFP4Linear (`nvfp4`), GGUF blocks as GGUFLinear (`gguf`), each
    rebuilt in `dtype` as it is used."""

    model: torch.nn.Module
    dtype: torch.dtype | None
    fp8: fp8.FP8Load
    nvfp4: nvfp4.NVFP4Load
    gguf: gguf_file.GGUFLoad

    def dtype_for(self, name: str) -> torch.dtype | None:
        """The dtype a tensor is placed in: None (as the file stores it) for quantized weights and their block
        scales, fp32 for NVFP4 tensor scales, else `dtype`."""
        dtype = None if name in self.fp8.fp8_parameters else self.dtype
        return self.gguf.dtype_for(name, self.nvfp4.dtype_for(name, dtype))

    def tensors(self, items, device):
        """The files' (model name, tensor, file) items as the model takes them (fp8.FP8Load.stream pairs int8 /
        FP8 weights with their scales; GGUF tensors other than kept linears are dequantized); NVFP4 records and
        input scales are dropped."""
        return self.fp8.stream(self.nvfp4.stream(self.gguf.stream(items, device), device), device)


def planned_model(source: TextEncoderSource, qwen_config, layers: int = TEXT_ENCODER_LAYER,
                  dtype: torch.dtype | None = torch.bfloat16) -> TextEncoderPlan:
    """Qwen3-VL with `layers` decoder layers and an identity final norm, built on meta, each linear the files
    hold in int8 (ComfyUI's ConvRot files), e4m3 or NVFP4 kept so (a byte or half a byte a weight; the same
    weights as dequantizing at load), and a GGUF file's quantized decoder-layer linears kept in their GGML blocks
    (its other quantized tensors, the embedding and its mmproj's, dequantized as they load). A GGUF file without
    an mmproj beside it gets `MissingVisionTower`. Read from the files' headers and quantization records only."""
    from transformers import Qwen3VLModel

    with torch.device("meta"):
        model = Qwen3VLModel(qwen_config)
    model.language_model.norm = torch.nn.Identity()  # H3 reads the stream before the final norm
    compute = dtype or torch.bfloat16

    def rename(key: str) -> str | None:
        return model_name(key, layers)

    gguf = bool(source.gguf_tensors)  # a GGUF file holds no safetensors quantization records
    if not source.vision_tower:
        model.visual = MissingVisionTower(source.files[0].name)
    blocks = {name: entry for key, entry in source.gguf_tensors.items()
              if entry.quantized and (name := rename(key)) is not None}
    blocks.update(source.vision.quantized() if source.vision is not None else {})
    held_gguf = gguf_file.GGUFLoad.plan(model, blocks, keep=lambda layer: layer.startswith("language_model.layers."),
                                        compute=compute, dense_dtype=lambda name: compute)
    nvfp4_layers = {} if gguf else nvfp4.checkpoint_nvfp4_layers(source.files, rename)
    held = nvfp4.NVFP4Load.plan(model, nvfp4_layers, keep=lambda layer: True, compute=compute,
                                dense_dtype=lambda layer: compute)
    file_layers = {} if gguf else fp8.checkpoint_fp8_layers(source.files, rename=nvfp4.outside(nvfp4_layers, rename))
    return TextEncoderPlan(model, dtype, fp8.FP8Load.weight_only(model, file_layers, compute), held, held_gguf)


class MissingVisionTower(torch.nn.Module):
    """Stands in for the vision tower a GGUF text encoder file does not hold: using it says so."""

    def __init__(self, file_name: str):
        super().__init__()
        self.file_name = file_name

    @property
    def dtype(self):  # transformers reads it first when pictures come
        raise CheckpointError(f"{self.file_name} {GGUF_NO_VISION}.")

    def forward(self, *args, **kwargs):
        raise CheckpointError(f"{self.file_name} {GGUF_NO_VISION}.")


def _used_tensors(source: TextEncoderSource, layers: int, data: bool = True):
    """(model name, tensor, file) for the tensors H3 uses; the others are never read from disk. `data=False`:
    meta tensors from the headers instead."""
    def used(key: str) -> bool:
        return model_name(key, layers) is not None

    if source.gguf_tensors:
        path = source.files[0]
        items = (gguf_file.read_gguf(path, only=used) if data else
                 ((key, entry.read_as(), path) for key, entry in source.gguf_tensors.items() if used(key)))
    else:
        items = (read_tensors if data else read_headers)(source.files, only=used)
    for key, tensor, where in items:
        yield model_name(key, layers), tensor, where
    if source.vision is not None:  # a GGUF file's mmproj beside it
        yield from source.vision.tensors(data)


def all_model_names(keys: list[str]) -> list[str]:
    """Model names of all keys, every layer kept (LM head and final norm dropped)."""
    return [name for name in (model_name(key, layers=10**9) for key in keys) if name is not None]


def check_is_text_encoder(source: TextEncoderSource) -> None:
    """Refuse a source that holds no Qwen3-VL text encoder (a DiT or a VAE picked by mistake), from its tensor
    names alone: before a host fetches a tokenizer for it or makes ~50 GB of room."""
    _check_is_text_encoder(source_tensor_names(source), source)


def _check_is_text_encoder(names: list[str], source: TextEncoderSource) -> None:
    stripped = all_model_names(names)
    if any(k.endswith(".scale_weight") for k in names):
        raise CheckpointError(f"{_origin(source)} is an old-style scaled FP8 text encoder; use the bf16 file or "
                              "a ComfyUI int8 ConvRot one.")
    if "language_model.embed_tokens.weight" not in stripped:
        keys = ("'token_embd.weight'" if source.gguf_tensors else
                "'model.embed_tokens.weight' or 'model.language_model.embed_tokens.weight'")
        raise CheckpointError(
            f"{_origin(source)} holds no Qwen3-VL text encoder (no {keys}); is it another model's file?"
        )


def _rebuild_rotary_buffers(model: torch.nn.Module, device) -> None:
    """Rotary frequency tables are non-persistent buffers computed in __init__ (on meta above);
    recompute them by rebuilding those modules from their config on the target device."""
    for name, module in list(model.named_modules()):
        if not any(buffer.is_meta for buffer in module.buffers(recurse=False)):
            continue
        if "RotaryEmbedding" not in type(module).__name__ or not hasattr(module, "config"):
            raise CheckpointError(f"Module '{name}' ({type(module).__name__}) has buffers that were never loaded.")
        with torch.device(device):
            model.set_submodule(name, type(module)(module.config))
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise CheckpointError(f"Tensors left unloaded: {', '.join(left[:5])}.")


def _origin(source: TextEncoderSource) -> str:
    return described(source.files, source.origin)
