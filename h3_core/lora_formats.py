"""Reading H3 LoRA files of every published layout and mapping them onto our (native, fused) modules.

A LoRA file is a flat safetensors dict. Producers spell the same adapter in several ways
(h3-model.md H.2); this module recognizes the spelling and turns every tensor into a `Term` on one of
our module names, so the rest of the engine sees a single layout:

    Term(kind="lowrank", target="blocks.3.attn.qkv_proj", param="weight",
         down=A [rank, in], up=B [rows, rank], alpha, part=None|"q"|"k"|"v", qkv_rows="stacked"|"interleaved")
    Term(kind="diff",    target=..., param="weight"|"bias", delta=full-shape tensor, part=None|"q"|"k"|"v")
    Term(kind="lokr"|"loha", target=..., param="weight", factors={"w1": W1 | "w1_a", "w1_b", ...}, alpha, part,
         swap_halves, qkv_rows)

`delta_W[rows] = alpha / rank * B @ A` (times the user's strength, applied later). LyCORIS LoKr: `kron(W1, W2)`,
each of W1 / W2 whole or a product `w_a @ w_b`; LoHa: `(w1_a @ w1_b) * (w2_a @ w2_b)`; both times alpha / rank
where a `.alpha` tensor is given and the factors are decomposed (else 1), as ComfyUI applies them. Their delta
is made one layer at a time when applied (a row order, for diffusers' SwiGLU or interleaved qkv, on the delta).
A q/k/v `part` addresses the first, second or third row block of our stacked `attn.qkv_proj` [q; k; v]; a
fused `qkv_rows="interleaved"` B is in the raw checkpoint's per-head order and is de-interleaved when the
model's head_dim is known (at apply time). diffusers' SwiGLU stores `ff.net.0.proj` rows as
[value; gate] where our `mlp.fc1` is [gate; value]: such B (and dense deltas) are half-swapped here.

Recognized layouts (the `format` label; first match wins):
- "kohya": keys `lora_unet_<flattened native name>.lora_down/lora_up/alpha` (musubi-tuner).
- "simpletuner-lycoris": keys `lycoris_<flattened name>` with LyCORIS's LoKr / LoHa (or LoRA) factors, the name
  the diffusers module's (SimpleTuner trains the diffusers transformer) or a native one.
- "diffsynth": native names with peft's `.default.` infix; fused qkv B rows per-head interleaved.
- "flashgen": native names, metadata `key_format=minimax-h3-native` (FlashGen); qkv B per-head
  interleaved (vLLM-Omni reorders them so; see `QKV_ROWS`).
- "lightx2v-comfyui": native names from a LightX2V `_comfyui_` Turbo export (by file name).
- "native": native names, `lora_A`/`lora_B` (or kohya's down/up) with an optional `diffusion_model.`
  prefix (ai-toolkit, ComfyUI-trained, larryvrh, the reference `generate.py`); qkv B stacked.
- "diffusers": a `transformer.` / `transformer_ref.` prefix over diffusers names (diffusers' writer;
  the prefix names the partition, and `lora_adapter_metadata` carries its alpha).
- "lightx2v-diffusers": diffusers names with `.default.` and metadata `key_format=minimax-h3-diffusers`
  or a LightX2V Turbo file name.
- "peft": any other diffusers names with `.default.`, or under peft's `base_model.model.` prefix (a
  peft dump of the diffusers model).
- "fastvideo": diffusers names without `.default.` (FastVideo `fastvideo-lora-v2`, low rank plus dense
  `.diff` / `.diff_b`).

Alpha, per low-rank module (the first rule that applies; `Term.alpha_source` says which):
1. the caller's `alpha` override; 2. a per-module `.alpha` tensor (kohya style); 3. a diffusers
`lora_adapter_metadata` (`alpha_pattern`, then `lora_alpha`); 4. LightX2V `_comfyui_` exports: scale 1
(ComfyUI reads only `.alpha` tensors, and these files are published for it); 5. a `__metadata__`
`alpha` (or `lora_alpha`) network alpha; 6. LightX2V Turbo file names that declare nothing: 8 (the
reference script's `--lora-alpha` default; only `4step_v0.1` is published so); 7. alpha = rank.

Every tensor must land somewhere: a key that names no H3 module is an error (or, with
`unknown="warn"`, a warning kept in `ParsedLoRA.notes`), never a silent skip. Pickles are refused.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import keymap
from .weights import SAFETENSORS_SUFFIXES, CheckpointError, check_safetensors_file, open_safetensors

PARTITIONS = ("fl2va", "ref2va")
TASKS_OF_PARTITION = {"fl2va": ("t2va", "fl2va"), "ref2va": ("ref2va",)}
TASKS = tuple(task for tasks in TASKS_OF_PARTITION.values() for task in tasks)


class LoRAError(ValueError):
    """A LoRA file or a LoRA application that cannot be honored; the message says what and what is allowed."""


# ---------------------------------------------------------------------------------------------------
# Our module vocabulary (h3-model.md A.2): every Linear a LoRA may target, and the RMSNorms a dense
# delta may target.
_NATIVE_LINEAR = re.compile(
    r"(?:token_refiner\.)?blocks\.\d+\.(?:attn\.(?:qkv_proj|out_proj)|mlp\.fc[12])"
    r"|blocks\.\d+\.adaln_proj\.linear"
    r"|video_patch_proj|audio_patch_proj|condition_proj|time_embedder\.proj_(?:in|out)"
    r"|final_layer\.(?:adaln_proj\.linear|video_out|audio_out)"
)
_NATIVE_NORM = re.compile(
    r"(?:token_refiner\.)?blocks\.\d+\.(?:norm[12]|attn\.[qk]_norm)|token_refiner\.final_norm|final_layer\.norm"
)
# musubi-tuner flattens every '.' to '_'; H3's own names hold '_' too, so names are rebuilt from parts.
_FLAT_BLOCK = re.compile(r"(token_refiner_)?blocks_(\d+)_(.+)")
_FLAT_BLOCK_MEMBERS = {
    "attn_qkv_proj": "attn.qkv_proj", "attn_out_proj": "attn.out_proj", "attn_q_norm": "attn.q_norm",
    "attn_k_norm": "attn.k_norm", "mlp_fc1": "mlp.fc1", "mlp_fc2": "mlp.fc2", "norm1": "norm1",
    "norm2": "norm2", "adaln_proj_linear": "adaln_proj.linear",
}
_FLAT_STANDALONE = {
    "video_patch_proj": "video_patch_proj", "audio_patch_proj": "audio_patch_proj",
    "condition_proj": "condition_proj", "time_embedder_proj_in": "time_embedder.proj_in",
    "time_embedder_proj_out": "time_embedder.proj_out", "final_layer_adaln_proj_linear": "final_layer.adaln_proj.linear",
    "final_layer_video_out": "final_layer.video_out", "final_layer_audio_out": "final_layer.audio_out",
    "final_layer_norm": "final_layer.norm", "token_refiner_final_norm": "token_refiner.final_norm",
}
# the same for diffusers' names (SimpleTuner's `lycoris_` keys flatten the diffusers transformer's)
_FLAT_DIFFUSERS_BLOCK = re.compile(r"(transformer_blocks|token_refiner_refiner_blocks)_(\d+)_(.+)")
_FLAT_DIFFUSERS_MEMBERS = {
    "attn_to_q": "attn.to_q", "attn_to_k": "attn.to_k", "attn_to_v": "attn.to_v", "attn_to_out_0": "attn.to_out.0",
    "attn_norm_q": "attn.norm_q", "attn_norm_k": "attn.norm_k", "ff_net_0_proj": "ff.net.0.proj",
    "ff_net_2": "ff.net.2", "norm1": "norm1", "norm2": "norm2", "adaln_proj_linear": "adaln_proj.linear",
}
_FLAT_DIFFUSERS_STANDALONE = {
    "proj_in": "proj_in", "audio_proj_in": "audio_proj_in", "context_embedder": "context_embedder",
    "time_embedder_linear_1": "time_embedder.linear_1", "time_embedder_linear_2": "time_embedder.linear_2",
    "norm_out_norm": "norm_out.norm", "norm_out_linear": "norm_out.linear", "proj_out": "proj_out",
    "audio_proj_out": "audio_proj_out",
}
# the prefixes of flattened spellings (every '.' of the module name turned '_'), and the format each names
FLAT_PREFIXES = {"lora_unet_": "kohya", "lycoris_": "simpletuner-lycoris"}
_DIFFUSERS_BLOCK = re.compile(r"(?:transformer_blocks|token_refiner\.refiner_blocks)\.\d+\.")
# One public report spells the LightX2V v0.1 attention as q_proj/k_proj/v_proj under diffusers block
# names (h3-model.md Open question 9); those map unambiguously onto the q/k/v parts.
_ALIAS_QKV = re.compile(r"^(.*\.attn)\.([qkv])_proj$")

# Tensor-name endings: (suffix, role). peft's adapter namespace is only ever `default`.
_SUFFIXES = (
    (".lora_A.default.weight", "down"), (".lora_B.default.weight", "up"),
    (".lora_A.weight", "down"), (".lora_B.weight", "up"),
    (".lora_down.weight", "down"), (".lora_up.weight", "up"),
    (".alpha", "alpha"), (".diff_b", "diff_b"), (".diff", "diff"),
    (".set_weight", "set_weight"), (".dora_scale", "dora_scale"), (".lora_B.bias", "lora_bias"),
    (".lora_B.default.bias", "lora_bias"),
    (".lora_magnitude_vector", "dora_scale"), (".lora_magnitude_vector.weight", "dora_scale"),  # peft's, diffusers'
    (".lora_magnitude_vector.default.weight", "dora_scale"),
    # LyCORIS LoKr (Kronecker) and LoHa (Hadamard) factors; their Tucker cores only serve convolutions
    *((f".lokr_{name}", f"lokr_{name}") for name in ("w1", "w2", "w1_a", "w1_b", "w2_a", "w2_b")),
    *((f".hada_{name}", f"hada_{name}") for name in ("w1_a", "w1_b", "w2_a", "w2_b")),
    (".lokr_t2", "tucker"), (".hada_t1", "tucker"), (".hada_t2", "tucker"),
)
_REFUSED_ROLES = {
    "set_weight": "replaces a whole parameter (a FastVideo VSA gate `to_gate_compress`, which the base model does "
                  "not have: h3_core runs VSA gates only in a VSA-trained transformer such as FastH3 8-Step V2); use "
                  "the dense (`dense-datafree`) variant of the adapter",
    "dora_scale": "is a DoRA magnitude vector; DoRA adapters are not supported, only LoRA, LoKr and LoHa",
    "lora_bias": "is a LoRA bias (peft `lora_bias=True`), which is not supported",
    "tucker": "is a LyCORIS Tucker core, made for convolutions; H3's adapters are on Linear layers (LoKr and LoHa "
              "without Tucker cores are read)",
}
_STRIP_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "base_model.model.")
_PARTITION_PREFIXES = {"transformer.": "fl2va", "transformer_ref.": "ref2va"}


# LightX2V Turbo file names: minimax_h3_<fl2v|ref2v>_turbo_<n>step_v<x.y>[_768p][_comfyui][_bf16].
# The name identifies the exporter (for alpha and the `_comfyui_` layout) and, in lora.py, the contract.
LIGHTX2V_NAME = re.compile(
    r"minimax_h3_(?P<task>fl2v|ref2v)_turbo_(?P<steps>\d+)step_v(?P<version>\d+\.\d+)(?P<tags>(?:_768p|_comfyui|_bf16)*)"
)
LIGHTX2V_DEFAULT_ALPHA = 8.0
# the LyCORIS adapters read here besides LoRA: LoKr and LoHa (`Term.factors`). The others' tensor names (ComfyUI's
# weight_adapter reads them too): OFT / BOFT, GLoRA
FACTORED_KINDS = ("lokr", "loha")
LYCORIS_KEY = re.compile(r"\.(oft_blocks$|oft_diag$|(a1|a2|b1|b2)\.weight$)")
# Which row order a fused qkv B has, by declared key_format. DiffSynth (`.default.` over native names)
# is interleaved too (diffusers' loader, h3-model.md H.2). FlashGen: vLLM-Omni's loader for
# `key_format=minimax-h3-native` reorders the fused qkv rows from the per-head grouped order, which
# contradicts h3-model.md H.2's "stacked" for FlashGen; we follow the code that serves the file.
QKV_ROWS = {"minimax-h3-native": "interleaved"}


# ---------------------------------------------------------------------------------------------------
@dataclass
class Term:
    """One piece of an adapter on one of our parameters; see the module docstring."""

    kind: str  # "lowrank" | "diff"
    target: str  # our module name, e.g. "blocks.0.attn.qkv_proj"
    param: str  # "weight" | "bias"
    keys: tuple[str, ...]  # the file's tensor names, for messages
    down: torch.Tensor | None = None
    up: torch.Tensor | None = None
    delta: torch.Tensor | None = None
    alpha: float = 0.0
    alpha_source: str = ""
    part: str | None = None  # "q" | "k" | "v": one row third of the stacked qkv
    qkv_rows: str = "stacked"  # fused qkv B row order: "stacked" | "interleaved" (raw per-head)
    factors: dict[str, torch.Tensor] | None = None  # LoKr / LoHa: role ("w1", "w1_a", ...) -> 2-D factor
    swap_halves: bool = False  # LoKr / LoHa on diffusers' SwiGLU: the delta's rows are [value; gate]

    @property
    def rank(self) -> int:
        """A low-rank pair's rank; LoKr's and LoHa's as ComfyUI and LyCORIS divide alpha by (0: not decomposed)."""
        if self.kind == "lokr":
            decomposed = [self.factors[f"{w}_b"] for w in ("w1", "w2") if w not in self.factors]
            return int(decomposed[-1].shape[0]) if decomposed else 0
        if self.kind == "loha":
            return int(self.factors["w1_b"].shape[0])
        return int(self.down.shape[0]) if self.down is not None else 0

    @property
    def scale(self) -> float:
        """alpha / rank for a low-rank term; for LoKr / LoHa the same where the file gives an alpha and the factors
        are decomposed (else 1, as ComfyUI applies them); 1 for a dense delta."""
        if self.kind == "lowrank":
            return self.alpha / self.rank
        if self.kind in FACTORED_KINDS and self.alpha and self.rank:
            return self.alpha / self.rank
        return 1.0

    def kronecker_factors(self, device=None, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """LoKr's (W1 [a, b], W2 [c, d]), each given whole or as the product of its two factors: the delta is
        kron(W1, W2) [a*c, b*d]."""
        def whole(name):
            if name in self.factors:
                return self.factors[name].to(device, dtype)
            return self.factors[f"{name}_a"].to(device, dtype) @ self.factors[f"{name}_b"].to(device, dtype)
        return whole("w1"), whole("w2")

    def factored_delta(self, device=None, dtype=torch.float32) -> torch.Tensor:
        """A LoKr's or LoHa's whole delta [out, in] in the file's row order, unscaled."""
        if self.kind == "lokr":
            return torch.kron(*self.kronecker_factors(device, dtype))
        f = {name: tensor.to(device, dtype) for name, tensor in self.factors.items()}
        return (f["w1_a"] @ f["w1_b"]) * (f["w2_a"] @ f["w2_b"])

    @property
    def factored_shape(self) -> tuple[int, int]:
        """(out, in) of a LoKr's or LoHa's delta."""
        f = self.factors
        if self.kind == "loha":
            return int(f["w1_a"].shape[0]), int(f["w1_b"].shape[1])
        (a, b), (c, d) = ((f[w].shape if w in f else (f[f"{w}_a"].shape[0], f[f"{w}_b"].shape[1]))
                          for w in ("w1", "w2"))
        return int(a * c), int(b * d)


@dataclass
class ParsedLoRA:
    """Everything a LoRA file says, in our names. `parts` maps the partition a file names ("fl2va",
    "ref2va"; None when it names none) to its terms."""

    format: str
    parts: dict[str | None, list[Term]]
    metadata: dict[str, str]
    notes: list[str] = field(default_factory=list)
    alpha_summary: str = ""


# ---------------------------------------------------------------------------------------------------
def read_safetensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors and the `__metadata__` of one LoRA file. Pickles are refused: they run code on load."""
    if str(path).strip() in ("", "."):  # Path("") is "."
        raise LoRAError("The LoRA path is empty; give a LoRA's .safetensors file.")
    path = Path(path).expanduser()
    if path.is_dir():  # said as a folder, not as a file of another format
        raise LoRAError(f"{path} is a folder; give the LoRA's .safetensors file in it.")
    try:
        check_safetensors_file(path, "LoRA")
    except CheckpointError as error:
        raise LoRAError(str(error)) from None
    if not path.is_file():
        raise LoRAError(f"LoRA file {path} does not exist.")
    with open_safetensors(path) as handle:
        metadata = dict(handle.metadata() or {})
        keys = list(handle.keys())
        lycoris = [key for key in keys if LYCORIS_KEY.search(key)]
        if lycoris:
            raise LoRAError(f"{path.name} is a LyCORIS adapter of another kind than LoRA, LoKr or LoHa (OFT, BOFT or "
                            f"GLoRA: '{lycoris[0]}'); H3 takes LoRAs (low-rank A / B factors), LoKr and LoHa factors "
                            "and dense deltas.")
        if keys and not any(key.endswith(suffix) for key in keys for suffix, _ in _SUFFIXES):
            # a model file picked as a LoRA: said from its names, before its tens of GB are read
            raise LoRAError(f"{path.name} holds no LoRA factors: none of its {len(keys)} tensor names ends as a "
                            f"LoRA's do (.lora_A / .lora_B / .lora_down / .lora_up / .alpha / .diff / .lokr_w1 / "
                            f".hada_w1_a ...; e.g. "
                            f"'{keys[0]}'). Is it a model file (a DiT, a VAE, a text encoder) rather than a LoRA?")
        # copies, not views of the file's map: a file rewritten in place later would change a held adapter
        # silently, or kill the process (SIGBUS) if it got shorter
        tensors = {key: handle.get_tensor(key).clone() for key in handle.keys()}
    return tensors, metadata


def adapter_stem(path: str | Path) -> str:
    """A LoRA file's name without its .safetensors (or .sft) suffix, however cased: the name a release is known by."""
    path = Path(path)
    return path.stem if path.suffix.lower() in SAFETENSORS_SUFFIXES else path.name


def parse_lora(
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    path: str | Path = "",
    alpha: float | None = None,
    qkv_layout: str | None = None,
    unknown: str = "error",
) -> ParsedLoRA:
    """Recognize the layout of `tensors`, map every tensor onto our modules and resolve alphas.

    `path`'s file name identifies LightX2V exports; `alpha` overrides every module's
    alpha; `qkv_layout` ("stacked" / "interleaved") overrides the fused-qkv B row order the format
    implies; `unknown="warn"` turns keys that name no H3 module into reported warnings.
    """
    if unknown not in ("error", "warn"):
        raise LoRAError(f"unknown must be 'error' or 'warn', got {unknown!r}.")
    if qkv_layout not in (None, "stacked", "interleaved"):
        raise LoRAError(f"qkv_layout must be 'stacked' or 'interleaved' (or None to follow the format), got {qkv_layout!r}.")
    if alpha is not None and not (math.isfinite(alpha) and alpha > 0):
        raise LoRAError(f"alpha must be a positive number, got {alpha!r}.")
    if not tensors:
        raise LoRAError(f"{Path(path).name or 'The LoRA'} holds no tensors.")
    for key, tensor in tensors.items():  # alphas are checked with their own rule below
        if key.endswith("alpha"):
            continue
        if not tensor.is_floating_point():
            stored = str(tensor.dtype).removeprefix("torch.")
            raise LoRAError(f"'{key}' of {Path(path).name or 'the LoRA'} is stored as {stored}; LoRA factors and "
                            "deltas are floating point (a damaged or foreign file).")
        values = tensor.float() if tensor.element_size() == 1 else tensor  # FP8: no isfinite of its own
        if not bool(torch.isfinite(values).all()):
            raise LoRAError(f"'{key}' of {Path(path).name or 'the LoRA'} holds NaN or infinite values (a damaged "
                            "file, or one saved from a diverged training run): every output would be NaN.")
    path = Path(path)
    notes: list[str] = []

    groups, prefixed, stray = _split_partitions(tensors, notes)
    if stray:  # another component's (a text encoder's), beside the transformer's: the unknown-keys rule
        message = (f"{len(stray)} tensor(s) of {path.name or 'the LoRA'} carry no component prefix beside ones that "
                   f"do (e.g. '{stray[0]}'); H3 reads a diffusers LoRA's 'transformer.' and 'transformer_ref.' ones.")
        _unknown_keys(message, unknown, notes)
    lightx2v = LIGHTX2V_NAME.fullmatch(adapter_stem(path))
    declared = metadata.get("key_format")
    parts: dict[str | None, list[Term]] = {}
    formats, alpha_sources = set(), {}
    found = {partition: _modules_of(group, prefixed, path, declared, lightx2v) for partition, group in groups.items()}
    if not any(modules for _, modules, _ in found.values()):  # said before the unknown-keys rule, whose advice
        raise _not_an_h3_lora(tensors, path)                    # (unknown='warn') would only lead here
    # a file with .alpha tensors has its alphas there: the modules without one are alpha = rank, its metadata
    # alpha unread (diffusers' loader; ComfyUI never reads metadata alpha)
    alpha_tensors = any("alpha" in module.tensors for _, modules, _ in found.values() for module in modules.values())
    for partition, (fmt, modules, unmapped) in found.items():
        if unmapped:
            listed = ", ".join(unmapped[:8]) + (f" and {len(unmapped) - 8} more" if len(unmapped) > 8 else "")
            message = (f"{len(unmapped)} tensor(s) of {path.name or 'the LoRA'} name no MiniMax-H3 module: {listed}. "
                       "H3 LoRAs target our attention/FFN/AdaLN/projection modules in the native, diffusers, "
                       "kohya (lora_unet_), SimpleTuner LyCORIS (lycoris_) or DiffSynth spelling.")
            _unknown_keys(message, unknown, notes)
        formats.add(fmt)
        rows = qkv_layout or ("interleaved" if fmt == "diffsynth" else QKV_ROWS.get(declared, "stacked"))
        context = _AlphaContext(alpha, metadata, partition, fmt, lightx2v, alpha_tensors)
        parts[partition] = _terms(modules, rows, context, alpha_sources)
    if not any(parts.values()):  # every key skipped under unknown="warn": nothing would change
        raise _not_an_h3_lora(tensors, path)
    if len(formats) != 1:
        raise LoRAError(f"{path.name} mixes layouts {sorted(formats)} across its partitions; one file must use one layout.")
    fmt = formats.pop()
    if qkv_layout is not None:
        notes.append(f"fused qkv B rows read as {qkv_layout} (caller override)")
    if fmt == "lightx2v-comfyui" and not (lightx2v and "_comfyui" in lightx2v.group("tags")):
        notes.append("read as a ComfyUI export (q, k and v adapters fused block-diagonally), though its file name "
                     "does not say so")
    if alpha is None and {"alpha", "lora_alpha"} & set(metadata):
        if fmt == "lightx2v-comfyui":
            notes.append("metadata alpha ignored: a ComfyUI export is scaled as ComfyUI scales it (per-module .alpha "
                         "tensors, else 1); load_lora(alpha=...) in Python overrides it")
        elif alpha_tensors:
            notes.append("metadata alpha ignored: the file's .alpha tensors give the alphas (alpha = rank where a "
                         "module has none), as diffusers and ComfyUI read it")
    if fmt == "flashgen" and qkv_layout is None:
        notes.append("FlashGen fused qkv B rows read as per-head interleaved (vLLM-Omni's reading of "
                     "key_format=minimax-h3-native); load_lora(qkv_layout='stacked') in Python reads them stacked")
    summary = "; ".join(f"{source} (for {count} of the file's modules)" for source, count in alpha_sources.items())
    return ParsedLoRA(fmt, parts, metadata, notes, summary)


def _unknown_keys(message: str, unknown: str, notes: list[str]) -> None:
    """The unknown-keys rule for tensors H3 does not read: refused ("error"), or reported and left out ("warn")."""
    if unknown == "error":
        raise LoRAError(message + " To load the rest and report these: unknown='warn' (h3 generate "
                        "--lora-unknown-keys warn; H3 LoRA / Turbo Apply's unknown_keys).")
    notes.append("NOT LOADED: " + message)


# ---------------------------------------------------------------------------------------------------
def _split_partitions(tensors: dict[str, torch.Tensor], notes: list[str]):
    """({partition or None: tensors without the prefix}, whether keys carried a component prefix, the keys without
    one beside those that have one): diffusers' writer prefixes each partition's keys with its component name."""
    prefixed = {prefix: {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)} for prefix in _PARTITION_PREFIXES}
    bare = {k: v for k, v in tensors.items() if not k.startswith(tuple(_PARTITION_PREFIXES))}
    named = {prefix: group for prefix, group in prefixed.items() if group}
    if not named:
        return {None: bare}, False, []
    if set(named) == {"transformer."}:
        # diffusers also routes `transformer.` layers into transformer_ref on request: not a partition claim.
        notes.append("diffusers 'transformer.' prefix: the file does not say which partition it was trained on")
        return {None: named["transformer."]}, True, list(bare)
    return {_PARTITION_PREFIXES[prefix]: group for prefix, group in named.items()}, True, list(bare)


def _split_key(key: str) -> tuple[str, str] | None:
    for suffix, role in _SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)], role
    return None


def _native_of_flat(flat: str) -> str | None:
    if flat in _FLAT_STANDALONE:
        return _FLAT_STANDALONE[flat]
    match = _FLAT_BLOCK.fullmatch(flat)
    if match and match.group(3) in _FLAT_BLOCK_MEMBERS:
        return f"{'token_refiner.' if match.group(1) else ''}blocks.{match.group(2)}.{_FLAT_BLOCK_MEMBERS[match.group(3)]}"
    return None


def _unflattened(flat: str) -> str | None:
    """The dotted module name (native or diffusers) a flattened one spells, None if it spells none."""
    native = _native_of_flat(flat)
    if native is not None:
        return native
    if flat in _FLAT_DIFFUSERS_STANDALONE:
        return _FLAT_DIFFUSERS_STANDALONE[flat]
    match = _FLAT_DIFFUSERS_BLOCK.fullmatch(flat)
    if match and match.group(3) in _FLAT_DIFFUSERS_MEMBERS:
        blocks = "transformer_blocks" if match.group(1) == "transformer_blocks" else "token_refiner.refiner_blocks"
        return f"{blocks}.{match.group(2)}.{_FLAT_DIFFUSERS_MEMBERS[match.group(3)]}"
    return None


def _is_native(name: str) -> bool:
    return bool(_NATIVE_LINEAR.fullmatch(name) or _NATIVE_NORM.fullmatch(name))


def _not_an_h3_lora(tensors, path: Path) -> LoRAError:
    return LoRAError(f"None of the {len(tensors)} tensor(s) of {path.name or 'the LoRA'} name a MiniMax-H3 module: "
                     "it is not an H3 LoRA (an SDXL, Flux or Wan one, say), and would change nothing.")


def _from_diffusers(name: str) -> tuple[str, str | None] | None:
    """(our module, qkv part) for a diffusers module name, or None if it names no H3 module."""
    alias = _ALIAS_QKV.match(name)
    if alias and _DIFFUSERS_BLOCK.match(name):
        name = f"{alias.group(1)}.to_{alias.group(2)}"
    native, part = keymap.diffusers_to_native_name(name + ".weight")
    native = native[: -len(".weight")]
    if native == name:
        return None  # no rename applied: not a diffusers name
    return (native, part) if _is_native(native) else None


@dataclass
class _Module:
    """The raw tensors of one source module, in our names."""

    target: str
    part: str | None
    swap_halves: bool  # diffusers `ff.net.0.proj` [value; gate] -> our fc1 [gate; value]
    source: str  # the module name as the file spells it
    tensors: dict[str, tuple[str, torch.Tensor]] = field(default_factory=dict)  # role -> (key, tensor)


def _block_diagonal_qkv(modules: dict[str, "_Module"]) -> bool:
    """Whether every fused qkv B is block-diagonal, three rank-r adapters side by side (rank 3r): how ComfyUI
    exports of diffusers-layout LoRAs (LightX2V's `_comfyui_`) fuse q, k and v; a LoRA trained on the fused
    module shares one A and has a full B. All-zero blocks alone (an untrained B) say nothing."""
    factors = [module.tensors["up"][1] for module in modules.values()
               if module.target.endswith("attn.qkv_proj") and "up" in module.tensors]
    if not factors:
        return False
    for up in factors:
        if up.dim() != 2:
            return False
        up = up.float() if up.element_size() == 1 else up  # FP8 factors: no `any` of their own
        rows, rank = up.shape[0] // 3, up.shape[1] // 3
        if rank == 0 or up.shape != (3 * rows, 3 * rank):
            return False
        blocks = [[up[i * rows:(i + 1) * rows, j * rank:(j + 1) * rank] for j in range(3)] for i in range(3)]
        if any(blocks[i][j].any() for i in range(3) for j in range(3) if i != j):
            return False
        if not any(blocks[i][i].any() for i in range(3)):
            return False
    return True


def _modules_of(group, prefixed, path, declared, lightx2v):
    """Recognize one partition group's layout; return (format, {source module: _Module}, unmapped keys)."""
    keys = list(group)
    flat = next((prefix for prefix in FLAT_PREFIXES if any(k.startswith(prefix) for k in keys)), None)
    peft_infix = any(".default." in k for k in keys)
    peft_dump = any(k.startswith("base_model.model.") for k in keys)
    modules: dict[str, _Module] = {}
    unmapped: list[str] = []
    namings = set()
    for key, tensor in group.items():
        name = key
        for prefix in _STRIP_PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        split = _split_key(name)
        if split is None:
            unmapped.append(key)
            continue
        source, role = split
        if role in _REFUSED_ROLES:
            raise LoRAError(f"'{key}' {_REFUSED_ROLES[role]}.")
        dotted = source
        if flat:  # a key without the prefix (a text encoder's lora_te_): for the unknown-keys rule
            dotted = _unflattened(source[len(flat):]) if source.startswith(flat) else None
            if dotted is None:
                unmapped.append(key)
                continue
        if _is_native(dotted):
            target, part, naming = dotted, None, "native"
        else:
            mapped = _from_diffusers(dotted)
            target, part = mapped if mapped else (None, None)
            naming = "diffusers"
        if target is None or not _is_native(target):
            unmapped.append(key)
            continue
        if dotted != "token_refiner.final_norm":
            namings.add(naming)
        # only diffusers' own SwiGLU name stores [value; gate]: a native `mlp.fc1` under diffusers block names
        # (a hybrid spelling) is [gate; value] already
        swap = dotted.endswith("ff.net.0.proj")
        module = modules.setdefault(source, _Module(target, part, swap, source))
        if role in module.tensors:
            raise LoRAError(f"'{key}' and '{module.tensors[role][0]}' are the same tensor of module '{source}'.")
        module.tensors[role] = (key, tensor)
    owners: dict[tuple[str, str | None], str] = {}
    for module in modules.values():
        other = owners.setdefault((module.target, module.part), module.source)
        if other != module.source:
            raise LoRAError(f"'{other}' and '{module.source}' in {path.name} both name {module.target}"
                            f"{f' ({module.part})' if module.part else ''}; a file must spell each module once.")
    if len(namings) > 1:
        raise LoRAError(
            f"{path.name} mixes native module names (blocks.N...) and diffusers names (transformer_blocks.N...); "
            "one file must use one spelling."
        )
    naming = namings.pop() if namings else "native"
    if flat:
        fmt = FLAT_PREFIXES[flat]
    elif naming == "native":
        if peft_infix:
            fmt = "diffsynth"
        elif declared == "minimax-h3-native":
            fmt = "flashgen"
        elif lightx2v and "_comfyui" in lightx2v.group("tags") or _block_diagonal_qkv(modules):
            fmt = "lightx2v-comfyui"  # by its name, or (renamed) by its q, k and v adapters fused side by side
        else:
            fmt = "native"
    elif prefixed:
        fmt = "diffusers"
    elif peft_infix or peft_dump:
        fmt = "lightx2v-diffusers" if declared == "minimax-h3-diffusers" or lightx2v else "peft"
    else:
        fmt = "fastvideo"
    if declared not in (None, "minimax-h3-native", "minimax-h3-diffusers"):
        raise LoRAError(f"{path.name} declares key_format={declared!r}; known: 'minimax-h3-native', 'minimax-h3-diffusers'.")
    if declared == "minimax-h3-native" and naming != "native" or declared == "minimax-h3-diffusers" and naming != "diffusers":
        raise LoRAError(f"{path.name} declares key_format={declared!r} but its tensors use {naming} module names.")
    return fmt, modules, unmapped


# ---------------------------------------------------------------------------------------------------
@dataclass
class _AlphaContext:
    override: float | None
    metadata: dict[str, str]
    partition: str | None
    fmt: str
    lightx2v: re.Match | None
    alpha_tensors: bool = False  # the file holds per-module .alpha tensors

    def network_alpha(self) -> tuple[float, str] | None:
        if self.alpha_tensors:
            return None
        for name in ("alpha", "lora_alpha"):
            if name in self.metadata:
                try:
                    value = float(self.metadata[name])
                except ValueError:
                    raise LoRAError(f"The file's __metadata__ '{name}' is {self.metadata[name]!r}; it must be a number "
                                    "(the network alpha every module was trained with).") from None
                return value, f"metadata {name} {value:g}"  # its range: `_checked_alpha`, as every source's
        return None

    def adapter_config(self) -> dict | None:
        """diffusers' `lora_adapter_metadata`: the LoraConfig of each component, keys '<component>.<field>'."""
        raw = self.metadata.get("lora_adapter_metadata")
        if not raw:
            return None
        try:
            config = json.loads(raw)
        except json.JSONDecodeError as error:
            raise LoRAError(f"The file's 'lora_adapter_metadata' is not valid JSON: {error}.") from None
        if not isinstance(config, dict):
            raise LoRAError("The file's 'lora_adapter_metadata' must be a JSON object (diffusers' LoraConfig fields by "
                            f"component), got a {type(config).__name__}.")
        component = "transformer_ref" if self.partition == "ref2va" else "transformer"
        fields = {k[len(component) + 1:]: v for k, v in config.items() if k.startswith(component + ".")}
        if fields.get("use_dora") or fields.get("use_rslora"):
            raise LoRAError("This diffusers LoRA was trained with DoRA or rsLoRA scaling, which is not supported.")
        return fields or None


def _pattern_alpha(patterns: dict, module: str):
    """peft's alpha_pattern: a key matches a module name at its end (after a '.'), or as a '^' regex (the value
    is checked by `_checked_alpha`)."""
    if not isinstance(patterns, dict):
        raise LoRAError(f"The file's diffusers alpha_pattern must be a JSON object, got {patterns!r}.")
    for key, value in patterns.items():
        regex = key[1:] if key.startswith("^") else rf"(?:.*\.)?{key}"
        if re.fullmatch(regex, module):
            return value
    return None


def _alpha(module: _Module, rank: int, ctx: _AlphaContext) -> tuple[float, str]:
    if ctx.override is not None:
        return ctx.override, f"caller alpha {ctx.override:g}"
    if "alpha" in module.tensors:
        key, tensor = module.tensors["alpha"]
        if tensor.numel() != 1:
            raise LoRAError(f"'{key}' must hold one number (the module's alpha), it has shape {list(tensor.shape)}.")
        return float(tensor.item()), "per-module .alpha tensor"
    config = ctx.adapter_config()
    if config is not None:
        value = _pattern_alpha(config.get("alpha_pattern") or {}, module.source)
        if value is not None:
            return value, "diffusers adapter config alpha_pattern"
        if "lora_alpha" in config:
            return config["lora_alpha"], f"diffusers adapter config lora_alpha {config['lora_alpha']}"
    if ctx.fmt == "lightx2v-comfyui":
        return float(rank), "ComfyUI export: no .alpha tensor, scale 1 as ComfyUI applies it"
    network = ctx.network_alpha()
    if network is not None:
        return network
    if ctx.lightx2v is not None:
        return LIGHTX2V_DEFAULT_ALPHA, "LightX2V Turbo file without alpha: alpha 8 (reference script default)"
    return float(rank), "no alpha recorded: alpha = rank"


def _checked_alpha(module: _Module, rank: int, ctx: _AlphaContext) -> tuple[float, str]:
    """`_alpha`, refused unless a positive number: alpha 0 made the adapter a silent no-op, NaN made NaN video."""
    value, source = _alpha(module, rank, ctx)
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise LoRAError(f"The alpha of '{module.source}' is {value!r} ({source}); an alpha is a positive "
                        "number.") from None
    if not (math.isfinite(value) and value > 0):
        raise LoRAError(f"The alpha of '{module.source}' is {value:g} ({source}); an alpha is a positive number.")
    return value, source


def _terms(modules: dict[str, _Module], qkv_rows: str, ctx: _AlphaContext, alpha_sources: dict) -> list[Term]:
    terms = []
    for module in modules.values():
        roles = module.tensors
        if "down" in roles or "up" in roles:
            if "down" not in roles or "up" not in roles:
                have, need = ("down", "up") if "down" in roles else ("up", "down")
                raise LoRAError(f"'{roles[have][0]}' has no partner {('lora_A/lora_down' if need == 'down' else 'lora_B/lora_up')} "
                                f"tensor for module '{module.source}'.")
            (down_key, down), (up_key, up) = roles["down"], roles["up"]
            if down.ndim != 2 or up.ndim != 2 or up.shape[1] != down.shape[0]:
                raise LoRAError(f"'{down_key}' {list(down.shape)} and '{up_key}' {list(up.shape)} are not a LoRA pair "
                                "(A [rank, in], B [out, rank]).")
            if _NATIVE_NORM.fullmatch(module.target):
                raise LoRAError(f"'{down_key}' is a low-rank factor on '{module.source}', an RMSNorm; LoRA targets Linear layers.")
            if down.shape[0] == 0:
                raise LoRAError(f"'{down_key}' has rank 0 (no rows): it is not a usable LoRA factor.")
            value, source = _checked_alpha(module, down.shape[0], ctx)
            alpha_sources[source] = alpha_sources.get(source, 0) + 1
            if module.swap_halves:
                up = keymap.swap_halves(up)
            keys = (down_key, up_key) + ((roles["alpha"][0],) if "alpha" in roles else ())
            fused_qkv = module.part is None and module.target.endswith("attn.qkv_proj")
            terms.append(Term("lowrank", module.target, "weight", keys, down=down, up=up, alpha=value,
                              alpha_source=source, part=module.part, qkv_rows=qkv_rows if fused_qkv else "stacked"))
            if any(role.startswith(("lokr_", "hada_")) for role in roles):
                raise LoRAError(f"Module '{module.source}' holds both a LoRA pair and LoKr / LoHa factors; a file "
                                "gives each module one kind of adapter.")
        elif any(role.startswith(("lokr_", "hada_")) for role in roles):
            terms.append(_factored_term(module, ctx, alpha_sources, qkv_rows))
        elif "alpha" in roles:
            raise LoRAError(f"'{roles['alpha'][0]}' is an alpha for module '{module.source}', which has no lora_down/lora_up pair.")
        for role, param in (("diff", "weight"), ("diff_b", "bias")):
            if role in roles:
                key, delta = roles[role]
                if module.swap_halves:
                    delta = keymap.swap_halves(delta)
                fused_qkv = module.part is None and module.target.endswith("attn.qkv_proj")
                terms.append(Term("diff", module.target, param, (key,), delta=delta, part=module.part,
                                  qkv_rows=qkv_rows if fused_qkv else "stacked", alpha_source="dense delta"))
    return terms


_FACTOR_SETS = {  # the factors each kind needs: any one alternative for each of W1 and W2 (LoKr), or all (LoHa)
    "lokr": ((("w1",), ("w1_a", "w1_b")), (("w2",), ("w2_a", "w2_b"))),
    "loha": ((("w1_a", "w1_b", "w2_a", "w2_b"),),),
}


def _factored_term(module: _Module, ctx: _AlphaContext, alpha_sources: dict, qkv_rows: str) -> Term:
    """A LyCORIS LoKr or LoHa module as one Term: its factors checked for a whole delta on a Linear's weight."""
    roles = {role: entry for role, entry in module.tensors.items() if role.startswith(("lokr_", "hada_"))}
    kinds = {"lokr" if role.startswith("lokr_") else "loha" for role in roles}
    first_key = next(iter(roles.values()))[0]
    if len(kinds) > 1:
        raise LoRAError(f"Module '{module.source}' mixes LoKr (lokr_) and LoHa (hada_) factors; one module has one.")
    kind = kinds.pop()
    factors = {role.split("_", 1)[1]: tensor for role, (_, tensor) in roles.items()}
    for key, tensor in roles.values():
        if tensor.ndim != 2:
            raise LoRAError(f"'{key}' has shape {list(tensor.shape)}; H3's adapters are on Linear layers, whose "
                            "LoKr / LoHa factors are matrices.")
    if _NATIVE_NORM.fullmatch(module.target):
        raise LoRAError(f"'{first_key}' is a {kind} factor on '{module.source}', an RMSNorm; they target Linear "
                        "layers.")
    for alternatives in _FACTOR_SETS[kind]:
        complete = [names for names in alternatives if all(name in factors for name in names)]
        if not complete:
            prefix = "lokr" if kind == "lokr" else "hada"
            wanted = " or ".join("+".join(f"{prefix}_{name}" for name in names) for names in alternatives)
            raise LoRAError(f"Module '{module.source}' lacks its {wanted} tensor(s) (it has "
                            f"{', '.join(key for key, _ in roles.values())}).")
    fits = all(factors[f"{w}_a"].shape[1] == factors[f"{w}_b"].shape[0]
               for w in ("w1", "w2") if f"{w}_a" in factors and f"{w}_b" in factors)
    if kind == "loha":  # both products are the delta's [out, in]
        fits = fits and (factors["w1_a"].shape[0], factors["w1_b"].shape[1]) == (factors["w2_a"].shape[0],
                                                                                factors["w2_b"].shape[1])
    if not fits:
        raise LoRAError(f"The {kind} factors of '{module.source}' do not fit together: "
                        + ", ".join(f"{name} {list(tensor.shape)}" for name, tensor in factors.items()) + ".")
    term = Term(kind, module.target, "weight", tuple(key for key, _ in roles.values()), factors=factors,
                part=module.part, swap_halves=module.swap_halves,
                qkv_rows=qkv_rows if module.part is None and module.target.endswith("attn.qkv_proj") else "stacked")
    if ctx.override is not None:
        term.alpha, term.alpha_source = ctx.override, f"caller alpha {ctx.override:g}"
    elif "alpha" in module.tensors:
        term.alpha, term.alpha_source = _checked_alpha(module, term.rank or 1, ctx)
        term.keys += (module.tensors["alpha"][0],)
    else:
        term.alpha_source = f"{kind}: no .alpha tensor, scale 1 as ComfyUI applies it"
    if term.rank == 0:
        term.alpha_source = f"{kind} of whole factors: scale 1, as ComfyUI applies it"
    alpha_sources[term.alpha_source] = alpha_sources.get(term.alpha_source, 0) + 1
    return term
