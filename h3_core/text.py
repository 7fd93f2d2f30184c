"""The text conditioner: Qwen3-VL-32B read after decoder layer 50 (h3-model.md E).

    encoder = load_text_encoder("/models/MiniMax-H3/FL2VA")           # or a text_encoder/ folder,
    presentation = encoder.presenter.fl2va(prompt, [first, last])      # an HF folder, or the Comfy-Org
    text = encoder.encode(presentation)                                # single file + tokenizer=...
    text.prompt_embeds  # [1, T, 5120] in the encoder dtype
    text.token_tags     # [T] int64: 1 text, 0 the rows of a vision block

What H3 conditions on is the **un-normalized** residual stream after decoder layer 50 (of 64):
`hidden_states[50]` of the language model, index 0 being the embeddings. The encoder is built with
exactly 50 decoder layers and its final RMSNorm replaced by identity, so the model's last hidden
state *is* that stream (a plain 50-layer stack would return it post-norm, which is not what the DiT
was trained on). The call is the reference's: the presentation's input_ids, an all-ones attention
mask (the LM is causal inside), Qwen's `mm_token_type_ids` (0 text, 1 image pad, 2 video pad) and
the processor's pixel tensors; no cache, no LM head.

Memory: about 51.5 GB in bf16 for the 32B (embedding, 50 layers, vision tower). Weights stream
tensor by tensor straight to `device`; `to(device)` moves the encoder (e.g. to the CPU between
requests) and `release()` drops it. The DiT casts the embeddings to its own dtype.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .prompt import (
    IMAGE_PAD,
    NO_PROCESSOR,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    Presentation,
    Presenter,
    VisionProcessor,
    load_tokenizer,
)
from .placement import check_load_device, module_bytes
from .runtime import empty_caches
from .tiny import TINY_RANDOM
from .text_checkpoint import (
    GGUF_NO_VISION,
    TEXT_ENCODER_LAYER,
    CheckpointError,
    MissingVisionTower,
    check_is_text_encoder,
    check_transformers,
    load_qwen3vl,
    locate_text_encoder,
    planned_model,
    qwen3vl_config,
    release_tokenizer,
)


@dataclass(frozen=True)
class TextConditioning:
    """What the DiT takes from the text encoder.

    prompt_embeds [1, T, hidden] (5120 for the 32B) in the encoder dtype, in CPU memory.
    token_tags    [T] int64 on the CPU: 1 for text rows, 0 for the rows of a vision block."""

    prompt_embeds: torch.Tensor
    token_tags: torch.Tensor

    def as_tensors(self) -> dict[str, torch.Tensor]:
        """The `--text-states` safetensors layout of `h3 denoise`: prompt_embeds and text_token_tags."""
        return {"prompt_embeds": self.prompt_embeds.contiguous().cpu(), "text_token_tags": self.token_tags.cpu()}


REMEMBERED_PROMPTS = 4  # prompt states kept by each encoder ([1, T, 5120] bf16: ~10 KB a row; nine pictures ~0.7 GB)
ENCODING_FLOOR_BYTES = 2 * 1024**3  # a short prompt's activations, the vision tower's with them


class TextEncoder:
    """Qwen3-VL truncated after decoder layer `layer`, with the presenter that feeds it.

    `model`: transformers' `Qwen3VLModel` holding `layer` decoder layers and an identity final norm
    (as `text_checkpoint.load_qwen3vl` builds it). `presenter`: tokenizer + vision processor.
    `reader(device, on_tensor)`: reads the same model again from its files (None: it cannot be read
    again), so a host short of CPU memory may `release` the encoder and `read` it back for the next prompt."""

    def __init__(self, model, presenter: Presenter, layer: int = TEXT_ENCODER_LAYER,
                 reader: Callable[..., Any] | None = None):
        self.model = model
        self.presenter = presenter
        self.layer = layer
        self.reader = reader
        self._visits = None  # stream_layers' LayerVisits
        self._spread = None  # spread_layers' (devices, hooks)
        self._remembered: OrderedDict[bytes, TextConditioning] = OrderedDict()  # the last prompts' states
        _check_compatible(model.config, presenter)
        visual = model.visual
        self.blind_file = visual.file_name if isinstance(visual, MissingVisionTower) else None  # no vision tower
        text = model.config.text_config  # kept for `encoding_bytes` while the weights are let go of
        self._row_bytes = (3 * text.intermediate_size + 4 * text.hidden_size) * torch.finfo(
            model.language_model.embed_tokens.weight.dtype).bits // 8

    def check_sees(self, pictures: bool) -> None:
        """Refuse `pictures` (keyframes, image or video references) to an encoder without a vision tower (a GGUF
        without its mmproj file) or without the processor that cuts them into patches: said before any model is
        placed or runs."""
        if pictures and self.blind_file is not None:
            raise CheckpointError(f"This request shows the text encoder pictures, but {self.blind_file} "
                                  f"{GGUF_NO_VISION}.")
        if pictures and self.presenter.vision is None:
            raise CheckpointError(NO_PROCESSOR)

    def encoding_bytes(self, rows: int) -> int:
        """Device memory encoding a presentation of `rows` rows takes besides the weights: a decoder layer's MLP
        (gate, up and their product, intermediate-wide) and hidden-wide copies around it, a row each (an H200
        measured 0.18 GiB per 1,000 rows for the 32B in bf16; nine release-size image references are ~66,000
        rows), and at least ENCODING_FLOOR_BYTES."""
        return max(ENCODING_FLOOR_BYTES, rows * self._row_bytes)

    @property
    def resident_bytes(self) -> int | None:
        """The weights' bytes when the whole encoder sits on its device (None: its layers stream or are spread, or
        it is released)."""
        if self.model is None or self._visits is not None or self._spread is not None:
            return None
        return module_bytes([self.model])

    @property
    def device(self) -> torch.device:
        return self._loaded().language_model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self._loaded().language_model.embed_tokens.weight.dtype

    def present(self, task: str, prompt: str, keyframes=(), references=()) -> Presentation:
        """`Presenter.present`: the request as Qwen3-VL reads it (no model needed)."""
        return self.presenter.present(task, prompt, keyframes, references)

    def forget(self) -> "TextEncoder":
        """Drop the remembered prompt states: the next `encode` of any prompt runs the model (tests comparing two
        placements of one encoder use it)."""
        self._remembered.clear()
        return self

    def remembers(self, presentation: Presentation) -> bool:
        """Whether `encode` has this presentation's states at hand (one of the last `REMEMBERED_PROMPTS`
        encoded): then it runs no model, and a host need not load the encoder for it."""
        return presentation.digest in self._remembered

    @torch.no_grad()
    def encode(self, presentation: Presentation, between_layers: Callable[[int], None] | None = None
               ) -> TextConditioning:
        """The hidden state after decoder layer `layer` for every row of `presentation`. `between_layers` is
        called before each decoder layer runs, with the number of layers done (a host's progress): it may raise
        there to stop (an interrupt) without waiting for the whole encoder (50 layers of the 32B: tens of
        seconds when they stream from CPU memory). The states of the last few presentations are remembered: the
        same prompt and media again (another length or canvas of one request, a batch's repeated prompt) costs no
        encoder run."""
        if not isinstance(presentation, Presentation):
            raise TypeError(
                f"encode takes a Presentation (see TextEncoder.present), got {type(presentation).__name__}."
            )
        key = presentation.digest
        if key in self._remembered:
            self._remembered.move_to_end(key)
        else:
            self._remembered[key] = self._run(presentation, between_layers)
            while len(self._remembered) > REMEMBERED_PROMPTS:
                self._remembered.popitem(last=False)
        text = self._remembered[key]  # a copy given out: a caller changing its states in place changes no later call's
        return TextConditioning(text.prompt_embeds.clone(), text.token_tags.clone())

    def _run(self, presentation: Presentation, between_layers: Callable[[int], None] | None) -> TextConditioning:
        model = self._loaded()
        config = model.config
        if (presentation.image_token_id, presentation.video_token_id) != (config.image_token_id, config.video_token_id):
            raise ValueError(
                "This presentation was built with another tokenizer (its image/video pad ids are "
                f"{presentation.image_token_id}/{presentation.video_token_id}, the encoder's "
                f"{config.image_token_id}/{config.video_token_id}); build it with this encoder's presenter."
            )
        self.check_sees(bool(presentation.vision_inputs))
        vocab = model.language_model.embed_tokens.num_embeddings
        if presentation.num_tokens == 0 or int(presentation.input_ids.max()) >= vocab:
            raise ValueError(
                f"The presentation's token ids must be non-empty and below the encoder's vocabulary ({vocab})."
            )

        device, dtype = self.device, self.dtype
        input_ids = presentation.input_ids.to(device)[None]
        vision = {
            name: value.to(device, dtype) if name.startswith("pixel_") else value.to(device)
            for name, value in presentation.vision_inputs.items()
        }
        model.rope_deltas = None  # transformers caches multimodal RoPE offsets for generation; start clean
        hooks = [] if between_layers is None else [  # before a streamed layer's copy to the device
            layer.register_forward_pre_hook(lambda module, args, done=done: between_layers(done), prepend=True)
            for done, layer in enumerate(model.language_model.layers)
        ]
        try:
            output = model(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                mm_token_type_ids=presentation.mm_token_type_ids.to(device)[None],
                use_cache=False,
                **vision,
            )
        finally:
            for hook in hooks:
                hook.remove()
            if self._visits is not None:
                self._visits.send_home()
        # in CPU memory, as every other conditioning part: held by the memo and by hosts' caches (ComfyUI's node
        # outputs), the states must not keep device memory nobody counts once the encoder is unloaded
        states = output.last_hidden_state.cpu()
        if not torch.isfinite(states).all():  # else the sampler, many steps on, blames the DiT
            dtype = str(self.dtype).removeprefix("torch.")
            raise ValueError(f"The text encoder gave NaN or infinite states for this prompt: its weights hold NaN or "
                             f"infinite values (a damaged file), or they overflowed in {dtype}; try another copy of "
                             "the file, or bf16.")
        return TextConditioning(states, presentation.token_tags.clone())

    def to(self, device: str | torch.device) -> "TextEncoder":
        """Move the weights (e.g. "cpu" to park the encoder while the DiT runs)."""
        self._clear_placement()
        self.model = self._loaded().to(device)
        return self

    def stream_layers(self, device: str | torch.device) -> "TextEncoder":
        """Compute on `device` while the decoder layers stay in CPU memory: everything else (embedding,
        vision tower, rotary tables: ~2.7 GB for the 32B) moves to `device`, and each layer visits it only
        while it runs (`offload.LayerVisits`). For GPUs smaller than the encoder; the same result, plus
        one copy of the layers per prompt (~49 GB: a few seconds)."""
        from .offload import LayerVisits

        model = self._loaded()
        self._clear_placement()
        _move_all_but_layers(model, device)
        self._visits = LayerVisits(list(model.language_model.layers), device)
        return self

    def spread_layers(self, devices: Sequence[str | torch.device], counts: Sequence[int]) -> "TextEncoder":
        """Decoder layers in consecutive runs over several devices (`counts[i]` of them on `devices[i]`),
        everything else on the first: for GPUs that hold the encoder between them but none alone (it then
        needs no streaming and no CPU memory). Each layer past the first device's moves its inputs (the
        hidden state, masks, rotary tables) onto its device; `encode` returns on the first device. The same
        result as one device."""
        model = self._loaded()
        layers = model.language_model.layers
        if len(counts) != len(devices) or min(counts, default=-1) < 0 or sum(counts) != len(layers):
            raise ValueError(f"spread_layers needs one layer count (>= 0) per device, {len(layers)} layers in all; "
                             f"got {list(counts)} for {len(devices)} devices.")
        self._clear_placement()
        devices = [torch.device(d) for d in devices]
        _move_all_but_layers(model, devices[0])
        hooks, start = [], 0
        for run, (device, count) in enumerate(zip(devices, counts)):
            for layer in layers[start:start + count]:
                layer.to(device)
                if run:  # the model hands every layer the first device's masks and rotary tables
                    hooks.append(layer.register_forward_pre_hook(
                        lambda module, args, kwargs, device=device: (_to_device(args, device),
                                                                     _to_device(kwargs, device)),
                        with_kwargs=True))
            start += count
        self._spread = (devices, hooks)
        return self

    def _clear_placement(self) -> None:
        """End streaming or spreading (the weights stay where they are)."""
        if self._visits is not None:
            self._visits.remove()
            self._visits = None
        for hook in self._spread[1] if self._spread else ():
            hook.remove()
        self._spread = None

    def release(self) -> None:
        """Drop the weights and free their memory; the presenter stays usable."""
        devices = self._spread[0] if self._spread else [None if self.model is None else self.device]
        self._clear_placement()
        self.model = None
        for device in devices:
            empty_caches(device)

    def read(self, device: str | torch.device, on_tensor: Callable[[int, int], None] | None = None
             ) -> "TextEncoder":
        """After `release`: the weights read again from the files onto `device` (a no-op while they are
        here); `on_tensor(done, total)` after each tensor."""
        if self.model is None:
            if self.reader is None:
                raise RuntimeError("This text encoder was released and has no files to read it from; load it "
                                   "again with load_text_encoder.")
            self.model = self.reader(torch.device(device), on_tensor)
        return self

    def _loaded(self):
        if self.model is None:
            raise RuntimeError("This text encoder was released; read it again (TextEncoder.read) or load it "
                               "with load_text_encoder.")
        return self.model


def _move_all_but_layers(model, device: str | torch.device) -> None:
    """Every weight and buffer of `model` outside its decoder layers onto `device` (in place)."""
    layers = model.language_model.layers
    in_layers = {id(t) for t in list(layers.parameters()) + list(layers.buffers())}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) not in in_layers:
                param.data = param.data.to(device)
        for name, buffer in module.named_buffers(recurse=False):
            if id(buffer) not in in_layers:
                module._buffers[name] = buffer.to(device)


def _to_device(value, device: torch.device):
    """`value` with every tensor in it (through tuples, lists and dicts) on `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def spread_counts(layers: int, layer_bytes: int, room: Sequence[int]) -> list[int] | None:
    """How many of `layers` decoder layers (`layer_bytes` each) each device takes, filling the devices in
    order with what their `room` (bytes) holds; None when they do not all fit."""
    counts, left = [], layers
    for free in room:
        take = min(left, max(0, free) // layer_bytes) if layer_bytes > 0 else left
        counts.append(take)
        left -= take
    return counts if left == 0 else None


def load_text_encoder(
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    *,
    tokenizer: str | Path | None = None,
    processor: str | Path | None = None,
    config: dict | str | Path | None = None,
    layer: int = TEXT_ENCODER_LAYER,
    on_tensor: Callable[[int, int], None] | None = None,
) -> TextEncoder:
    """Load the text conditioner from any layout users have.

    path       a release root, a partition folder (`FL2VA/`), its `text_encoder/`, an HF-layout
               Qwen3-VL folder, or the Comfy-Org single file `qwen3vl_32b_minimax_h3_bf16.safetensors`.
    tokenizer  the H3 tokenizer folder (`FL2VA/tokenizer`), or a folder holding `tokenizer/` and
               `processor/` (the partition or the release root). Found beside folder layouts; a
               single file carries none: without one, the release's is fetched from the Hub (7 MiB).
    processor  the Qwen3-VL processor folder (`FL2VA/processor`); found beside the tokenizer if omitted.
    config     a Qwen3-VL config (dict, config.json or its folder) overriding the folder's; a single
               file defaults to the built-in Qwen3-VL-32B config.
    layer      the decoder layer whose output H3 reads: 50 for the released checkpoints.
    on_tensor  called (done, total) after each tensor read: a progress bar.
    Only the embedding, the first `layer` decoder layers and the vision tower are read, cast to
    `dtype` and put on `device` one tensor at a time. `tiny-random`: the embedded demo encoder (float32)."""
    check_load_device(device)
    if str(path) == TINY_RANDOM:
        from .tiny import tiny_model_dtype
        from .tiny_text import tiny_random_text_encoder  # it loads its files through this function

        tiny_model_dtype(device, dtype)  # float32 whatever is asked, but a dtype that is none is refused
        return tiny_random_text_encoder(device=device)
    source = locate_text_encoder_files(path, tokenizer, processor, layer)
    presenter, qwen_config = text_encoder_presenter(source, config, layer)  # before reading ~51 GB of weights
    model = load_qwen3vl(source, dtype, device, qwen_config, layer, on_tensor)
    return TextEncoder(model, presenter, layer, reader=lambda to, on_tensor=None: load_qwen3vl(
        source, dtype, to, qwen_config, layer, on_tensor))


def text_encoder_presenter(source, config: dict | str | Path | None = None, layer: int = TEXT_ENCODER_LAYER):
    """(Presenter, Qwen3-VL config) of a located text encoder (`locate_text_encoder_files`): its tokenizer and
    processor read and checked against the model's config, a few MB: a host calls it before it makes room for the
    weights, so a damaged or another model's tokenizer is refused before other models are moved out."""
    vision = None if source.processor_folder is None else VisionProcessor.from_folder(source.processor_folder)
    presenter = Presenter(load_tokenizer(source.tokenizer_folder), vision)
    qwen_config = qwen3vl_config(config if config is not None else source.config, layer)
    _check_compatible(qwen_config, presenter)
    return presenter, qwen_config


def locate_text_encoder_files(path: str | Path, tokenizer: str | Path | None = None,
                              processor: str | Path | None = None, layer: int = TEXT_ENCODER_LAYER):
    """`locate_text_encoder`, refusing a source without its tokenizer: a host calls it before it makes room on
    the GPU or reads any weight. A single file given no tokenizer gets the release's (`release_tokenizer`: from
    the Hugging Face cache, or fetched). One without a processor reads text prompts (TextEncoder.check_sees)."""
    check_transformers()
    source = locate_text_encoder(path, tokenizer, processor, layer)
    check_is_text_encoder(source)  # another model's file: said from its names, before a tokenizer is fetched for it
    if source.tokenizer_folder is None and source.one_file and tokenizer is None:
        source = locate_text_encoder(path, release_tokenizer(), processor, layer)
    if source.tokenizer_folder is None:
        raise CheckpointError(f"No tokenizer found for {path}.")
    return source


def text_encoder_bytes(path: str | Path, dtype: torch.dtype = torch.bfloat16, layer: int = TEXT_ENCODER_LAYER) -> int:
    """Bytes of the weights `load_text_encoder` would place (embedding, `layer` decoder layers, vision
    tower), from the config and the files' headers: a host decides before reading ~51 GB (27 GB for an int8
    file, 16 GB for an NVFP4 one) whether they fit on its GPU."""
    rest, per_layer = text_encoder_sizes(path, dtype, layer)
    return rest + layer * per_layer


def text_encoder_sizes(path: str | Path, dtype: torch.dtype = torch.bfloat16, layer: int = TEXT_ENCODER_LAYER
                       ) -> tuple[int, int]:
    """(bytes outside the decoder layers, bytes of the largest decoder layer) of what `load_text_encoder`
    places, from the config and the files' headers (linears an int8, FP8 or NVFP4 file holds stay as stored):
    what `spread_layers` must fit on each device."""
    source = locate_text_encoder(path, layers=layer)
    plan = planned_model(source, qwen3vl_config(source.config, layer), layer, dtype)

    def placed(module, prefix: str) -> int:
        return sum(p.numel() * (p.element_size() if (cast := plan.dtype_for(prefix + name)) is None else cast.itemsize)
                   for name, p in module.named_parameters())

    blocks = plan.model.language_model.layers
    layers = [placed(block, f"language_model.layers.{i}.") for i, block in enumerate(blocks)]
    return placed(plan.model, "") - sum(layers), max(layers, default=0)


def _check_compatible(config, presenter: Presenter) -> None:
    """The tokenizer, the processor and the model (its `Qwen3VLConfig`) must agree on special tokens
    and patch geometry."""
    expected = {
        VISION_START: config.vision_start_token_id,
        VISION_END: config.vision_end_token_id,
        IMAGE_PAD: config.image_token_id,
        VIDEO_PAD: config.video_token_id,
    }
    wrong = [
        f"{t} is {presenter.special_ids[t]} in the tokenizer, {i} in the model"
        for t, i in expected.items()
        if presenter.special_ids[t] != i
    ]
    if wrong:
        raise CheckpointError(f"Tokenizer and text encoder disagree: {'; '.join(wrong)}. Use the release's tokenizer.")
    if presenter.vision is None:  # text prompts only (check_sees)
        return
    vision = config.vision_config
    for name, processor in (("image", presenter.vision.image_processor), ("video", presenter.vision.video_processor)):
        got = (processor.patch_size, processor.temporal_patch_size, processor.merge_size)
        want = (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size)
        if tuple(int(v) for v in got) != tuple(int(v) for v in want):
            raise CheckpointError(
                f"The {name} processor's (patch, temporal patch, merge) sizes {got} do not match the vision tower's "
                f"{want}; use the release's processor/ folder."
            )
