"""The presentation: how a request is shown to the Qwen3-VL text encoder (h3-model.md E.2, A.4).

H3 conditions on Qwen3-VL's reading of one token sequence per request. There is no chat template,
no system prompt, no special token added and no truncation; each piece is tokenized on its own and
the pieces are concatenated (tokenizing the joined string would merge tokens across the seams and
change the ids):

- t2va:   the prompt, verbatim.
- fl2va:  per keyframe in packed order (first, then last): `"<Picture i>: "` + a vision block;
          then the prompt.
- ref2va: per reference in request order, labels numbered per modality (1-based):
          image -> `"<Picture i>: "` + a vision block;
          audio -> `"<Audio j>: "` alone (a waveform never reaches Qwen);
          video -> `"<Audio j>: "` first if it carries a soundtrack, then `"<Video k>: "`, then per
          temporal block `"<{t:.1f} seconds>"` + a vision block; then the prompt.

A vision block is `<|vision_start|>` + n x `<|image_pad|>` (or `<|video_pad|>`) + `<|vision_end|>`,
with n = grid_t * grid_h * grid_w / merge^2 from the Qwen3-VL processor (per temporal block for
videos: grid_h * grid_w / merge^2). Every row of a vision block, start and end included, carries the
DiT token tag 0 (video); all other rows carry 1 (text). The tags address the DiT's AdaLN table.

Video references are read at 2 fps from the normalized 24 fps clip (every 12th frame), merged in
pairs by Qwen3-VL's temporal patch (the last frame repeated when the count is odd); a block is
labelled with the mean of its pair's timestamps (sampled index / 2 fps), rendered by Python's
`format`, which rounds half to even on the binary value: the first block reads `<0.2 seconds>`.

Pixels: images go through transformers' PIL Qwen2-VL image processor (the class Qwen3-VL uses),
configured from the release's `processor/` folder. Where torchvision is installed transformers picks
its torchvision backend instead: the same pixels (to float rounding) when the processor does not
resize, as for H3 keyframes and reference images (multiples of 32 within its pixel limits), and
within one uint8 level when it does (different bicubic kernels). transformers' Qwen3-VL video
processor needs torchvision, which not every install has, so `VisionProcessor` runs that same
processor class with its three torchvision calls (resize, normalize, grayscale->RGB) replaced by the
torch operations torchvision performs on CPU: same target sizes, same antialiased bicubic on uint8,
same patch order (bit-identical to transformers + torchvision 0.29, tested where it is installed).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
import platform
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from .geometry import FPS
from .layout import TEXT_TAG, VIDEO_TAG
from .weights import CheckpointError, read_json

# a tokenizer found without the release's processor/ beside it: prompts encode, pictures cannot be cut into patches
NO_PROCESSOR = ("This request shows the text encoder pictures (keyframes, image or video references), but no Qwen3-VL "
                "processor config was found beside its tokenizer; give the release's FL2VA/processor folder (a "
                "tokenizer folder with processor/ beside it; `processor=` in Python), or send text prompts only.")

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

TASKS = ("t2va", "fl2va", "ref2va")
VIDEO_SAMPLE_FPS = 2.0  # the rate Qwen3-VL reads a reference video at
MAX_KEYFRAMES = 2  # first and/or last
# Request limits the released checkpoint documents for ref2va.
MAX_IMAGE_REFERENCES, MAX_VIDEO_REFERENCES, MAX_AUDIO_REFERENCES, MAX_REFERENCES = 9, 3, 3, 12

# Files a processor folder may hold, in transformers' order of preference: a nested
# `processor_config.json` (transformers >= 5) wins over the per-processor files.
PROCESSOR_CONFIG = "processor_config.json"
IMAGE_PROCESSOR_CONFIG = "preprocessor_config.json"
VIDEO_PROCESSOR_CONFIG = "video_preprocessor_config.json"


# --------------------------------------------------------------------------------------------
# References (ref2va) and the presentation itself


@dataclass(frozen=True)
class ImageReference:
    """An image reference, already normalized by the request setup (for the release: resized to a
    2048-pixel short edge, both sides multiples of 32). `image`: a PIL image or a [H, W, 3] uint8 array."""

    image: Image.Image | np.ndarray
    kind = "image"


@dataclass(frozen=True)
class AudioReference:
    """A standalone audio reference. Only its label `"<Audio j>: "` reaches the text encoder; its
    waveform goes to the audio VAE, so the presentation needs nothing from it."""

    kind = "audio"


@dataclass(frozen=True)
class VideoReference:
    """A video reference, already normalized by the request setup: `frames` [F, H, W, 3] uint8 at
    H3's 24 fps on the canvas its own aspect ratio resolves to, truncated to the generated length.
    `has_audio`: whether it carries a soundtrack (then it is labelled `"<Audio j>: "` first, the
    order its audio rows precede its video rows in the packed sequence)."""

    frames: np.ndarray
    has_audio: bool = False
    kind = "video"


Reference = ImageReference | AudioReference | VideoReference


@dataclass(frozen=True)
class Presentation:
    """One request as Qwen3-VL reads it.

    input_ids        [T] int64: the token sequence.
    token_tags       [T] int64: the DiT tag of every row, 1 (text) or 0 (a vision block's rows,
                     `<|vision_start|>` and `<|vision_end|>` included).
    vision_inputs    the processor's tensors, by the parameter names of Qwen3-VL's forward:
                     `pixel_values` [P, 3*tp*p*p] float32 and `image_grid_thw` [I, 3] int64 for the
                     image blocks in order; `pixel_values_videos` / `video_grid_thw` [V, 3] for the
                     videos (one grid row per video, grid_t temporal blocks each). Absent when unused.
    image_token_id / video_token_id: the pad ids of this tokenizer (they define `mm_token_type_ids`).
    """

    task: str
    input_ids: torch.Tensor
    token_tags: torch.Tensor
    vision_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    image_token_id: int = -1
    video_token_id: int = -1

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @functools.cached_property
    def digest(self) -> bytes:
        """Everything the encoder reads of this presentation (tokens, tags, pixel tensors), hashed once: the key
        of the prompt states a text encoder remembers."""
        digest = hashlib.blake2b(digest_size=20)
        digest.update(f"{self.task}:{self.image_token_id}:{self.video_token_id};".encode())
        for name, tensor in [("input_ids", self.input_ids), ("token_tags", self.token_tags),
                             *sorted(self.vision_inputs.items())]:
            tensor = tensor.detach().contiguous().cpu().reshape(-1)
            digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
            digest.update(tensor.view(torch.uint8).numpy().data)
        return digest.digest()

    @property
    def mm_token_type_ids(self) -> torch.Tensor:
        """[T] int64, Qwen3-VL's own modality ids (0 text, 1 image pad, 2 video pad), as transformers'
        processor derives them. They drive Qwen's multimodal RoPE and never reach the DiT."""
        types = torch.zeros_like(self.input_ids)
        types[self.input_ids == self.image_token_id] = 1
        types[self.input_ids == self.video_token_id] = 2
        return types


def sample_video_frames(
    num_frames: int, fps: float = FPS, sample_fps: float = VIDEO_SAMPLE_FPS, temporal_patch: int = 2
) -> tuple[list[int], list[float]]:
    """Which frames of a `num_frames`-frame clip at `fps` Qwen3-VL reads, and the timestamp of every
    vision block they make. Returns (frame indices, one timestamp in seconds per block).

    Every `fps / sample_fps`-th frame (index rounded, duplicates dropped). Blocks merge
    `temporal_patch` sampled frames, the last repeated to fill the final block; a block's timestamp
    is the mean of its frames' sample times (sample k is at k / sample_fps seconds)."""
    if num_frames < 1:
        raise ValueError(f"A reference video needs at least one frame, got {num_frames}.")
    stride = fps / sample_fps
    indices: list[int] = []
    cursor = 0.0
    while round(cursor) < num_frames:
        index = round(cursor)
        if not indices or index > indices[-1]:
            indices.append(index)
        cursor += stride
    if len(indices) < temporal_patch:
        minimum = round((temporal_patch - 1) * stride) + 1
        raise ValueError(
            f"A reference video is read at {sample_fps:g} fps in groups of {temporal_patch} frames, so it needs at "
            f"least {minimum} frames at {fps:g} fps ({minimum / fps:.2g} s); got {num_frames}."
        )
    stamps = [k / sample_fps for k in range(len(indices))]
    stamps += [stamps[-1]] * (-len(stamps) % temporal_patch)
    blocks = [(stamps[i] + stamps[i + temporal_patch - 1]) / 2 for i in range(0, len(stamps), temporal_patch)]
    return indices, blocks


def timestamp_label(seconds: float) -> str:
    """`"<0.2 seconds>"`: one decimal, Python's round-half-even formatting (0.25 -> "0.2")."""
    return f"<{seconds:.1f} seconds>"


# --------------------------------------------------------------------------------------------
# Pixels


class VisionProcessor:
    """Pixel tensors for Qwen3-VL's vision tower, exactly as transformers' Qwen3-VL processor makes them.

    `images(...)`: PIL images or [H, W, 3] uint8 arrays -> (`pixel_values` [P, 3*tp*p*p] float32,
    `image_grid_thw` [N, 3] int64), through transformers' `Qwen2VLImageProcessorPil`.
    `videos(...)`: [F, H, W, 3] uint8 arrays (already sampled) -> (`pixel_values_videos`,
    `video_grid_thw`), through transformers' Qwen3-VL video processor without torchvision.
    Both are configured from the release's `processor/` folder (`from_folder`): its min/max pixels
    decide how many vision tokens a picture or a video block becomes.
    """

    def __init__(self, image_config: dict, video_config: dict):
        from transformers import Qwen2VLImageProcessorPil

        self.image_processor = Qwen2VLImageProcessorPil.from_dict(dict(image_config))
        self.video_processor = _video_processor_class().from_dict(dict(video_config))

    @classmethod
    def from_folder(cls, folder: str | Path) -> "VisionProcessor":
        image_config, video_config = read_processor_configs(folder)
        return cls(image_config, video_config)

    @property
    def image_merge(self) -> int:
        return int(self.image_processor.merge_size)

    @property
    def video_merge(self) -> int:
        return int(self.video_processor.merge_size)

    @property
    def temporal_patch_size(self) -> int:
        return int(self.video_processor.temporal_patch_size)

    def images(self, images: Sequence[Image.Image | np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        pil = [_as_pil(image, f"image {i + 1}") for i, image in enumerate(images)]
        out = self.image_processor(images=pil, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"].to(torch.int64)

    def image_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        """Vision tokens of each image block: grid_t * grid_h * grid_w / merge^2."""
        return [int(grid.prod()) // self.image_merge**2 for grid in grid_thw]

    def videos(self, videos: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        for i, frames in enumerate(videos):
            _check_frames(frames, f"video {i + 1}")
        # transformers (5.24) reads an unset `cap_pixels_per_frame` as False, with a warning: pass it.
        cap = self.video_processor.cap_pixels_per_frame
        out = self.video_processor(
            videos=[np.ascontiguousarray(v) for v in videos],
            do_sample_frames=False,
            cap_pixels_per_frame=bool(cap),
            return_tensors="pt",
        )
        return out["pixel_values_videos"], out["video_grid_thw"].to(torch.int64)

    def video_block_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        """Vision tokens of one temporal block of each video: grid_h * grid_w / merge^2."""
        return [int(grid[1]) * int(grid[2]) // self.video_merge**2 for grid in grid_thw]


def read_processor_configs(folder: str | Path) -> tuple[dict, dict]:
    """(image processor config, video processor config) of a Qwen3-VL processor folder.

    Order as transformers reads them: `processor_config.json`'s nested "image_processor" /
    "video_processor" first, then `preprocessor_config.json` (image) and
    `video_preprocessor_config.json` (video, falling back to `preprocessor_config.json`)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"Processor folder {folder} does not exist.")

    def load(name: str) -> dict | None:
        path = folder / name
        return read_json(path) if path.is_file() else None

    nested = load(PROCESSOR_CONFIG) or {}
    image = nested.get("image_processor") or load(IMAGE_PROCESSOR_CONFIG)
    video = nested.get("video_processor") or load(VIDEO_PROCESSOR_CONFIG) or load(IMAGE_PROCESSOR_CONFIG)
    if image is None or video is None:
        raise FileNotFoundError(
            f"{folder} holds no Qwen3-VL processor config: expected {IMAGE_PROCESSOR_CONFIG} (and "
            f"{VIDEO_PROCESSOR_CONFIG}) or a {PROCESSOR_CONFIG} with 'image_processor' and 'video_processor' "
            "entries, as in the release's processor/ folder."
        )
    return image, video


def _as_pil(image, what: str) -> Image.Image:
    if isinstance(image, Image.Image):
        return image
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"{what} must be a PIL image or a [H, W, 3] uint8 array, got {image.dtype} {image.shape}.")
        return Image.fromarray(image)
    raise TypeError(f"{what} must be a PIL image or a [H, W, 3] uint8 array, got {type(image).__name__}.")


def _check_frames(frames, what: str) -> None:
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3:
        shape = getattr(frames, "shape", None)
        raise ValueError(f"{what} must be [F, H, W, 3] uint8 frames, got {type(frames).__name__} {shape}.")


def _torchvision_resize(images: torch.Tensor, size: tuple[int, int], mode: str) -> torch.Tensor:
    """torchvision.transforms.v2.functional.resize(antialias=True) for [..., C, H, W] tensors, in torch.

    Same path torchvision 0.29 takes: no-op when the size is unchanged; uint8 stays uint8 on CPU for
    bicubic (and for bilinear where its native uint8 kernel runs), else float32 then clamp (bicubic),
    round and cast back."""
    height, width = images.shape[-2:]
    if (height, width) == tuple(size):
        return images
    shape = images.shape
    flat = images.reshape(-1, *shape[-3:])
    native = flat.dtype in (torch.float32, torch.float64) or (
        flat.dtype == torch.uint8
        and flat.device.type == "cpu"
        and (mode == "bicubic" or torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
             or platform.machine() in ("aarch64", "arm64"))  # as torchvision decides (Apple silicon included)
    )
    dtype = flat.dtype
    if not native:
        flat = flat.to(torch.float32)
    out = F.interpolate(flat, size=list(size), mode=mode, align_corners=False, antialias=True)
    if not native:
        if mode == "bicubic" and dtype == torch.uint8:
            out = out.clamp_(0, 255)
        if not dtype.is_floating_point:
            out = out.round_()
        out = out.to(dtype)
    return out.reshape(*shape[:-2], *size)


_RESAMPLE_MODES = {2: "bilinear", 3: "bicubic"}  # PIL resampling ids used in processor configs


@functools.cache
def _video_processor_class():
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize

    class TorchVideoProcessor(Qwen3VLVideoProcessor):
        """transformers' Qwen3-VL video processor (sizes, grouping, rescale/normalize fusion,
        temporal padding, patch order) with torchvision's three calls done in torch."""

        def convert_to_rgb(self, video):
            if video.shape[-3] != 3:
                raise ValueError(f"Video frames must have 3 (RGB) channels, got {video.shape[-3]}.")
            return video

        def resize(self, videos, size, resample, factor, temporal_factor, cap_pixels_per_frame=None, **kwargs):
            # The target size exactly as Qwen3VLVideoProcessor.resize computes it.
            if not size.shortest_edge or not size.longest_edge:
                raise ValueError(f"The video processor's `size` needs 'shortest_edge' and 'longest_edge', got {size}.")
            num_frames = videos.shape[1]
            max_pixels = size.longest_edge
            if cap_pixels_per_frame:
                frame_cap = self.max_video_tokens * factor * factor
                per_frame = max(min(frame_cap, size.longest_edge // num_frames), int(size.shortest_edge * 1.05))
                max_pixels = per_frame * num_frames
            height, width = videos.shape[-2:]
            target = smart_resize(
                num_frames=num_frames,
                height=height,
                width=width,
                temporal_factor=temporal_factor,
                factor=factor,
                min_pixels=size.shortest_edge,
                max_pixels=max_pixels,
            )
            mode = _RESAMPLE_MODES.get(int(getattr(resample, "value", resample)))
            if mode is None:
                raise ValueError(
                    f"Video processor resample {resample!r} is not supported; "
                    "use 3 (bicubic, Qwen3-VL's) or 2 (bilinear)."
                )
            return _torchvision_resize(videos, target, mode)

        def normalize(self, image, mean, std, inplace=False, **kwargs):
            mean = torch.as_tensor(mean, dtype=image.dtype, device=image.device).view(-1, 1, 1)
            std = torch.as_tensor(std, dtype=image.dtype, device=image.device).view(-1, 1, 1)
            image = image.sub_(mean) if inplace else image.sub(mean)
            return image.div_(std)

    return TorchVideoProcessor


# --------------------------------------------------------------------------------------------
# The presenter


class Presenter:
    """Builds `Presentation`s with the H3 tokenizer and a `VisionProcessor`.

    `tokenizer`: a transformers tokenizer (the release's `tokenizer/`, which carries MiniMax's added
    tokens; a stock Qwen tokenizer is not the same). Special token ids are read from it, never assumed.
    """

    def __init__(self, tokenizer, vision: VisionProcessor | None):
        self.tokenizer = tokenizer
        self.vision = vision  # None: no processor config was found, so text prompts only
        self.special_ids = {token: _special_id(tokenizer, token) for token in VISION_TOKENS}
        self.image_token_id = self.special_ids[IMAGE_PAD]
        self.video_token_id = self.special_ids[VIDEO_PAD]

    @classmethod
    def from_folders(cls, tokenizer_folder: str | Path, processor_folder: str | Path) -> "Presenter":
        return cls(load_tokenizer(tokenizer_folder), VisionProcessor.from_folder(processor_folder))

    def _sight(self) -> VisionProcessor:
        if self.vision is None:
            raise CheckpointError(NO_PROCESSOR)
        return self.vision

    # ---- the three tasks

    def present(self, task: str, prompt: str, keyframes: Sequence = (), references: Sequence = ()) -> Presentation:
        """Dispatch on `task` ("t2va", "fl2va" or "ref2va")."""
        if task == "t2va":
            if keyframes or references:
                raise ValueError("t2va takes a prompt only; keyframes are fl2va, references are ref2va.")
            return self.t2va(prompt)
        if task == "fl2va":
            if references:
                raise ValueError("fl2va takes keyframes, not references (those are ref2va).")
            return self.fl2va(prompt, keyframes)
        if task == "ref2va":
            if keyframes:
                raise ValueError("ref2va takes references, not keyframes (those are fl2va).")
            return self.ref2va(prompt, references)
        raise ValueError(f"Unknown task {task!r}; choose one of {', '.join(TASKS)}.")

    def t2va(self, prompt: str) -> Presentation:
        builder = _Builder(self)
        builder.prompt(prompt)
        return builder.finish("t2va")

    def fl2va(self, prompt: str, keyframes: Sequence[Image.Image | np.ndarray]) -> Presentation:
        """`keyframes` in packed order (first, then last), already on the target canvas."""
        _check_prompt(prompt)
        keyframes = list(keyframes)
        if not 1 <= len(keyframes) <= MAX_KEYFRAMES:
            raise ValueError(
                f"fl2va takes 1 or 2 keyframes (first and/or last, in that order), got {len(keyframes)}; "
                "a prompt alone is t2va."
            )
        vision = self._sight()
        pixels, grids = vision.images(keyframes)
        builder = _Builder(self, pixel_values=pixels, image_grid_thw=grids)
        for index, count in enumerate(vision.image_tokens(grids)):
            builder.text(f"<Picture {index + 1}>: ")
            builder.vision_block(IMAGE_PAD, count)
        builder.prompt(prompt)
        return builder.finish("fl2va")

    def ref2va(self, prompt: str, references: Sequence[Reference]) -> Presentation:
        """`references` in request order; images and videos normalized by the request setup."""
        _check_prompt(prompt)
        references = list(references)
        _check_references(references)

        # Pixels batched per modality; Qwen fills the n-th pad run of a modality with the n-th entry.
        images = [r.image for r in references if r.kind == "image"]
        videos = [r.frames for r in references if r.kind == "video"]
        inputs, image_counts, block_counts, block_times = {}, [], [], []
        vision = self._sight() if images or videos else None
        if images:
            inputs["pixel_values"], inputs["image_grid_thw"] = vision.images(images)
            image_counts = vision.image_tokens(inputs["image_grid_thw"])
        if videos:
            patch = vision.temporal_patch_size
            sampled = []
            for i, frames in enumerate(videos):
                _check_frames(frames, f"video reference {i + 1}")
                indices, times = sample_video_frames(frames.shape[0], FPS, VIDEO_SAMPLE_FPS, patch)
                sampled.append(frames[indices])
                block_times.append(times)
            inputs["pixel_values_videos"], inputs["video_grid_thw"] = vision.videos(sampled)
            block_counts = vision.video_block_tokens(inputs["video_grid_thw"])
            for i, (times, grid) in enumerate(zip(block_times, inputs["video_grid_thw"], strict=True)):
                if int(grid[0]) != len(times):
                    raise ValueError(
                        f"The processor made {int(grid[0])} temporal blocks of video reference {i + 1}, but its 2 fps "
                        f"sampling labels {len(times)}; the processor's temporal_patch_size must be {patch}."
                    )

        builder = _Builder(self, **inputs)
        counts = {"image": 0, "audio": 0, "video": 0}
        for reference in references:
            if reference.kind == "audio" or (reference.kind == "video" and reference.has_audio):
                counts["audio"] += 1
                builder.text(f"<Audio {counts['audio']}>: ")
            if reference.kind == "image":
                counts["image"] += 1
                builder.text(f"<Picture {counts['image']}>: ")
                builder.vision_block(IMAGE_PAD, image_counts[counts["image"] - 1])
            elif reference.kind == "video":
                counts["video"] += 1
                builder.text(f"<Video {counts['video']}>: ")
                for seconds in block_times[counts["video"] - 1]:
                    builder.text(timestamp_label(seconds))
                    builder.vision_block(VIDEO_PAD, block_counts[counts["video"] - 1])
        builder.prompt(prompt)
        return builder.finish("ref2va")


class _Builder:
    """Accumulates token ids and DiT tags piece by piece."""

    def __init__(self, presenter: Presenter, **vision_inputs: torch.Tensor):
        self.presenter = presenter
        self.ids: list[int] = []
        self.tags: list[int] = []
        self.vision_inputs = vision_inputs

    def text(self, text: str) -> list[int]:
        ids = self.presenter.tokenizer(text, add_special_tokens=False)["input_ids"]
        self.ids += ids
        self.tags += [TEXT_TAG] * len(ids)
        return ids

    def prompt(self, prompt: str) -> None:
        _check_prompt(prompt)
        ids = self.text(prompt)
        found = [token for token, token_id in self.presenter.special_ids.items() if token_id in ids]
        if found:
            raise ValueError(
                f"The prompt contains Qwen3-VL's vision token(s) {', '.join(found)}; vision blocks come only from "
                "keyframes and references. Remove them from the prompt."
            )

    def vision_block(self, pad: str, count: int) -> None:
        special = self.presenter.special_ids
        ids = [special[VISION_START]] + [special[pad]] * count + [special[VISION_END]]
        self.ids += ids
        self.tags += [VIDEO_TAG] * len(ids)

    def finish(self, task: str) -> Presentation:
        return Presentation(
            task=task,
            input_ids=torch.tensor(self.ids, dtype=torch.int64),
            token_tags=torch.tensor(self.tags, dtype=torch.int64),
            vision_inputs=dict(self.vision_inputs),
            image_token_id=self.presenter.image_token_id,
            video_token_id=self.presenter.video_token_id,
        )


def _check_prompt(prompt) -> None:
    if not isinstance(prompt, str):
        raise TypeError(f"The prompt must be one string, got {type(prompt).__name__}.")
    if not prompt.strip():
        raise ValueError("The prompt is empty; H3 needs a non-empty prompt for every task.")


def reference_mix_problem(kinds: list[str]) -> str | None:
    """What is wrong with a Ref2VA mix of reference kinds ("image" / "video" / "audio"), or None: the
    published limits (9 images, 3 videos, 3 audios, 12 in all) and no audio without a visual reference."""
    for kind, limit in (("image", MAX_IMAGE_REFERENCES), ("video", MAX_VIDEO_REFERENCES), ("audio", MAX_AUDIO_REFERENCES)):
        if kinds.count(kind) > limit:
            return f"H3 takes at most {limit} {kind} references, got {kinds.count(kind)}."
    if len(kinds) > MAX_REFERENCES:
        return f"H3 takes at most {MAX_REFERENCES} references in total, got {len(kinds)}."
    if set(kinds) == {"audio"}:
        return "An audio reference needs an image or video reference beside it; H3 does not take audio alone."
    return None


def _check_references(references: list) -> None:
    if not references:
        raise ValueError("ref2va needs at least one reference (image, video or audio); a prompt alone is t2va.")
    for index, reference in enumerate(references):
        if not isinstance(reference, (ImageReference, AudioReference, VideoReference)):
            raise TypeError(
                f"references[{index}] is a {type(reference).__name__}; use ImageReference, VideoReference or "
                "AudioReference."
            )
    problem = reference_mix_problem([reference.kind for reference in references])
    if problem:
        raise ValueError(problem)


def _special_id(tokenizer, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if (
        token_id is None
        or token_id == getattr(tokenizer, "unk_token_id", None)
        or (tokenizer.convert_ids_to_tokens(token_id) != token)
    ):
        raise ValueError(
            f"The tokenizer has no {token} token; it is not a Qwen3-VL tokenizer. Use the release's tokenizer/ folder."
        )
    return int(token_id)


TOKENIZER_FILES = ("tokenizer.json", "vocab.json")
DIALOGUE_TOKENS = ("<d>", "</d>")  # MiniMax's own, added to the release's tokenizer (h3-model.md E.1)
log = logging.getLogger("h3")


def load_tokenizer(folder: str | Path):
    """The tokenizer in `folder` (a release `tokenizer/` folder or an HF-layout model folder), through
    transformers' AutoTokenizer, local files only, no remote code."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{folder} holds no tokenizer (expected {' or '.join(TOKENIZER_FILES)}); point at the release's "
            "tokenizer/ folder."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except (ValueError, OSError) as error:  # a damaged tokenizer.json gave JSON's bare message, naming no file
        raise CheckpointError(f"The tokenizer in {folder} cannot be read: {error}") from None
    missing = [token for token in DIALOGUE_TOKENS if token not in tokenizer.get_vocab()]
    if missing:  # a stock Qwen3-VL tokenizer: it runs, but spells dialogue marks as text the model never read
        log.warning("H3: the tokenizer in %s has no %s token; H3's own (the release's tokenizer/ folder) has them "
                    "for dialogue (<d>[English] words</d>), which this one splits into plain text.",
                    folder, " or ".join(missing))
    return tokenizer


PROMPT_LABEL = re.compile(r"<(Picture|Image|Video|Audio) (\d+)>")
CONTROL_TOKEN = re.compile(r"<\|[A-Za-z_]+\|>")  # Qwen's spelling of its control tokens: <|im_end|>, <|endoftext|>


def control_token_warnings(prompt: str) -> list[str]:
    """Qwen control tokens typed into a prompt (<|im_end|>, say): the tokenizer reads them as the token, not as
    words, as the reference does; the model never saw them inside a prompt, so the user is told. The vision
    markers among them are refused instead (`conditioning.check_prompt_markers`)."""
    typed = sorted(set(CONTROL_TOKEN.findall(prompt)) - set(VISION_TOKENS))
    if not typed:
        return []
    return [f"the prompt holds {', '.join(typed)}: the text encoder reads {'it' if len(typed) == 1 else 'them'} as "
            "its own control token, not as words, and H3 never saw one inside a prompt."]


def label_warnings(prompt: str, kinds: Sequence[str]) -> list[str]:
    """Labels a prompt names that no keyframe or reference of the request carries (the model reads them as
    plain words), and `<Image N>`, which the model never sees (its pictures are `<Picture N>`). `kinds`: the
    references' kinds in order ("video" one with sound, "silent video" one without), or "image" for each fl2va
    keyframe. A video with sound carries an `<Audio j>` too, so audio labels up to the audio references and those
    videos pass."""
    count = collections.Counter(kinds)
    have = {"Picture": count["image"], "Video": count["video"] + count["silent video"],
            "Audio": count["audio"] + count["video"]}
    warnings = []
    for kind, number in sorted({(kind, int(number)) for kind, number in PROMPT_LABEL.findall(prompt)}):
        if kind == "Image":
            warnings.append(f"the prompt names <Image {number}>: the model's label for a picture is <Picture {number}>.")
        elif not 1 <= number <= have[kind]:
            warnings.append(f"the prompt names <{kind} {number}>, but the request carries "
                            f"{have[kind] or 'no'} {kind.lower()} label{'' if have[kind] == 1 else 's'}.")
    return warnings
