"""The engine API, used by the `h3` command and the ComfyUI nodes alike (each name importable from here):

    load_dit / load_text_encoder / load_video_vae / load_audio_vae      (each placed and freed on its own)
    encode_request(request, text_encoder, video_vae, audio_vae) -> Conditioning (validates before any model runs)
    sample(dit, conditioning, seed, ...)                          -> AVLatents   (the dual-clock denoise)
    write_mp4(path, latents, video_vae, audio_vae)                -> Path        (streamed decode + mux)
    generate(...)                                                 -> everything above, with a progress callback
                                                                     (StageBars(): a bar per stage, as `h3` draws)
    generate_batch(jobs, ...)                                     -> the same for many requests, each model loaded once
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import numbers
import os
import re
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import geometry, media_read
from .attention import resolve_backend
from .checkpoint import (  # noqa: F401 (load_dit: engine API, above)
    DiTReader, held_linears, holds_stored_linears, load_dit, locate_dit, vsa_student, with_config,
)
from .config import TINY_DIT
from .dit import fp32_modules
from .memory_plan import (
    GIB, MemoryPlan, check_budget, does_not_fit, free_bytes, plan_for, usable_bytes,
)
from .offload import load_device, place
from .placement import check_devices, module_bytes
from .conditioning import Request, RequestError, encode_request, shows_pictures, validate
from .clip_latents import MAX_CLIP_FRAMES, encode_clip_frames, expected_clip_frames, file_soundtrack, stream_clip
from .layout import (GuideBlock, PackedLayout, build_ref2va_layout, build_t2va_layout, pack_audio, patched_rows, patchify, unpack_audio,
                     unpatchify)
from .local_attention import check_setting as check_window_setting
from .local_attention import dense_covers_run
from .fp8 import LINEAR_MODES, apply_linear_mode, check_linear_mode, read_mode
from .guides import (GuideFile, GuideMedia, add_guide, check_guide, check_guides_beside_kept, guide_frame_count,
                     read_guide)
from .hub import fetch_release, hub_error_text
from .keymap import bundled_models
from .lora import (
    VSA_STUDENT_CONTRACT, applied_contracts, apply_loras, check_loras, hooked_bytes, load_lora, run_mode,
    sampler_settings, task_warnings,
)
from .noise import check_seeds, condition_rows, request_generator, target_noise
from .media import SAMPLE_RATE, MediaError, naming
from .media_write import DEFAULT_CRF, check_crf
from .output import AVLatents, write_mp4
from .prompt import NO_PROCESSOR
from .references import RELEASE_CANVAS, CanvasRules, DecodedAudio, MediaReference
from .runtime import EXPANDABLE_SEGMENTS, empty_caches, fixed_allocator_segments, host_memory_warning
from .sampler import AUDIO_SHIFT, VIDEO_SHIFT, DualClockSchedule, StepCallback, check_shift, check_steps
from .sampler import denoise as denoise_loop
from .sparse_attention import STUDENT_SPARSITY
from .stage_bars import StageBars  # noqa: F401 (engine API, above)
from .text import ENCODING_FLOOR_BYTES, load_text_encoder, locate_text_encoder_files, spread_counts, text_encoder_sizes
from .text_checkpoint import GGUF_NO_VISION, TEXT_ENCODER_LAYER
from .tiny import TINY_RANDOM, tiny_model_dtype, tiny_random_audio_vae, tiny_random_dit, tiny_random_video_vae
from .tiny_text import tiny_random_text_encoder
from .vae_audio_checkpoint import check_audio_vae, load_audio_vae
from .vae_video import decode_working_bytes
from .vae_video_checkpoint import check_video_vae, load_video_vae
from .weights import CheckpointError, check_safetensors_file, tensor_names


class SamplingError(ValueError):
    """A denoising run gave what no decode or file should take (NaN or infinite latents)."""


def sample(
    dit,
    conditioning,
    seed: int | torch.Generator,
    steps: int = 50,
    video_shift: float = VIDEO_SHIFT,
    audio_shift: float = AUDIO_SHIFT,
    video_sigmas: Sequence[float] | None = None,
    audio_sigmas: Sequence[float] | None = None,
    callback: StepCallback | None = None,
    offload_adaln: bool = False,
    init: AVLatents | None = None,
    denoise: float = 1.0,
    keep: str | None = None,
) -> AVLatents:
    """Denoise one request. Noise comes from one CPU generator seeded with `seed`, in diffusers' order:
    one draw per visual condition (mixed to t = 0.999), then the target video, then the target audio.
    `seed` may be such a generator instead (a long video draws all its windows from one).

    `conditioning` provides `layout`, `text_states` [1, T, D], `visual_condition_latents` (list of
    normalized [1, C, L_i, h_i, w_i], packed order) and `audio_condition_rows` [1, N, Ca] (clean).
    `init`: latents to refine instead of pure noise; each modality starts at its ladder's first sigma s
    as s * noise + (1 - s) * init (`denoise` < 1 cuts the automatic ladders, see DualClockSchedule.build).
    `keep` ("video" or "audio", with `init`): that modality of `init` is held as conditioning and comes back
    as it is; only the other is generated (video-to-audio: the sound for a given video; audio-to-video as a
    driving track does). Held video rows are a visual condition (t = 0.999, drawn last of them), held audio
    clean at t = 1, as the release holds keyframes and vLLM-Omni a driving track. A modality the conditioning's
    layout already holds (a long video's driving track or kept clip) comes back with no latents: its holder
    has them.
    `dit` may be a `parallel.ParallelRunner`: its workers then run this function on their devices (a bad
    argument is refused here first: in a worker it would end the runner)."""
    if getattr(conditioning, "layout", None) is None:  # else an AttributeError deep in the run
        raise TypeError(f"sample takes a Conditioning (from encode_request), got {type(conditioning).__name__}"
                        + (": encode the request first." if isinstance(conditioning, Request) else "."))
    if init is not None and not isinstance(init, AVLatents):  # else an AttributeError, or a TypeError after a step
        raise TypeError(f"init takes AVLatents (from sample, or AVLatents.load for a saved file), got "
                        f"{type(init).__name__}.")
    if callback is not None and not callable(callback):
        raise TypeError(f"callback takes a function called with each step's state, got {type(callback).__name__}.")
    made_for, task = getattr(dit, "partition", None), getattr(conditioning, "task", None)
    if made_for is not None and TASK_PARTITION.get(task, made_for) != made_for:  # same shapes: it would just run
        raise RequestError(f"A {task} conditioning runs on the {TASK_PARTITION[task]} DiT; this one was loaded as "
                           f"the {made_for} partition.")
    schedule = DualClockSchedule.build(steps, video_shift, audio_shift, video_sigmas, audio_sigmas, denoise)
    if denoise < 1.0 and init is None:  # else pure noise is walked down a ladder made for a partly noised latent
        raise ValueError(f"denoise {denoise:g} < 1 refines a given latent: pass it as init, or keep denoise at 1.0.")
    layout = conditioning.layout
    kept = kept_latents(init, keep, latent_shape(layout))
    if keep is not None:
        if layout.locked_modality is not None:
            raise ValueError(f"This conditioning already holds its {layout.locked_modality} fixed (a driving track); "
                             "keep takes a request that generates both.")
        layout = layout.locked(keep)
        check_guides_beside_kept(getattr(conditioning, "guides", ()), keep)
    config = dit.config
    width = conditioning.text_states.shape[-1]
    if width != config.text_dim:  # else a matmul shape error deep in the first forward
        raise ValueError(f"The conditioning's text states are {width} wide, this DiT takes {config.text_dim} "
                         "(another model's text encoder?).")
    visual_conditions = [*conditioning.visual_condition_latents, *([kept] if keep == "video" else [])]
    held_audio = conditioning.audio_condition_rows
    if keep == "audio":
        held_audio = torch.cat([held_audio.float().cpu(), pack_audio(kept.float().cpu()[None])], dim=1)
    held_video_rows = patched_rows(visual_conditions)
    if held_video_rows != layout.num_condition_video_rows or held_audio.shape[1] != layout.num_condition_audio_rows:
        raise ValueError(
            f"The conditioning holds {held_video_rows} video / {held_audio.shape[1]} audio rows but its layout "
            f"reserves {layout.num_condition_video_rows} / {layout.num_condition_audio_rows}."
        )
    if not isinstance(dit, torch.nn.Module):  # checked above: in a worker a bad argument would end the runner
        return dit.sample(conditioning, seed, steps, video_shift, audio_shift, video_sigmas, audio_sigmas,
                          callback=callback, offload_adaln=offload_adaln, init=init, denoise=denoise, keep=keep)
    device = dit.condition_proj.weight.device
    generator = seed if isinstance(seed, torch.Generator) else request_generator(seed)
    held_video = (
        condition_rows(visual_conditions, generator)
        if visual_conditions
        else torch.zeros(1, 0, config.video_patch_dim)
    )
    video_noise, audio_noise = target_noise(layout, generator, config.in_channels, config.audio_in_channels)
    if init is not None:
        video_noise, audio_noise = start_rows(init, layout, schedule, video_noise, audio_noise)
    video_rows = torch.cat([held_video, video_noise], dim=1).to(device)
    audio_rows = torch.cat([held_audio.float().cpu(), audio_noise], dim=1).to(device)
    text = conditioning.text_states.to(device)
    with torch.inference_mode():
        video_rows, audio_rows = denoise_loop(
            dit, layout, text, video_rows, audio_rows, schedule, callback, offload_adaln=offload_adaln
        )
    target_video = video_rows[:, layout.num_condition_video_rows :].float().cpu()
    target_audio = audio_rows[:, layout.num_condition_audio_rows :].float().cpu()
    if not (torch.isfinite(target_video).all() and torch.isfinite(target_audio).all()):
        raise SamplingError("Sampling gave NaN or infinite latents: the DiT's or an adapter's weights hold NaN or "
                            "infinite values (a damaged file), or they overflowed in this dtype; nothing is saved.")
    if keep == "video":
        return AVLatents(kept.float().cpu().contiguous(), unpack_audio(target_audio)[0].contiguous())
    video = (unpatchify(target_video, layout.latent_frames, layout.latent_height, layout.latent_width)
             if target_video.shape[1] else torch.zeros(1, config.in_channels, 0, layout.latent_height,
                                                       layout.latent_width))
    audio = kept.float().cpu() if keep == "audio" else unpack_audio(target_audio)[0]
    return AVLatents(video.contiguous(), audio.contiguous())


def latent_shape(layout) -> tuple[int, int, int, int]:
    """(latent frames, latent height, latent width, audio latents per channel) a layout generates."""
    return layout.latent_frames, layout.latent_height, layout.latent_width, layout.audio_latents


def request_latent_shape(num_frames: int, width: int, height: int) -> tuple[int, int, int, int]:
    """`latent_shape` of a request's layout, from its frame count and canvas (before any layout exists)."""
    return (geometry.latent_frames(num_frames), *geometry.latent_size(width, height),
            geometry.audio_latents(num_frames))


def kept_latents(init: AVLatents | None, keep: str | None, want: tuple[int, ...]) -> torch.Tensor | None:
    """The latents `keep` holds fixed, checked against the request's `latent_shape` `want`, or None."""
    if keep is None:
        return None
    if keep not in ("video", "audio"):
        raise ValueError(f"keep holds the given 'video' or 'audio' fixed, got {keep!r}.")
    if init is None:
        raise ValueError(f"keep={keep!r} holds the {keep} of a given latent: pass init (the clip's latents).")
    _check_init_size(init, want)
    return init.video if keep == "video" else init.audio


def _check_init_size(init: AVLatents, want: tuple[int, ...]) -> None:
    if init.video.ndim == 5 and init.audio.ndim == 3:  # a latent of another size is said so before what else is wrong
        have = (*init.video.shape[2:], init.audio.shape[2])
        if have != want:
            raise ValueError(f"The given latent has (frames, height, width, audio) latents {have}, but this "
                             f"conditioning makes {want}; use a latent of the same size and duration.")
    init.check()


def start_rows(init: AVLatents, layout, schedule: DualClockSchedule, video_noise: torch.Tensor,
               audio_noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target rows that start from `init` at each ladder's first sigma (flow matching: s * noise + (1 - s) * x);
    a modality the layout holds fixed has no target rows and stays empty."""
    _check_init_size(init, latent_shape(layout))
    s_video, s_audio = schedule.video[0], schedule.audio[0]
    if video_noise.shape[1] and audio_noise.shape[1] and (s_video < 1.0) != (s_audio < 1.0):
        fresh, refined = ("audio", "video") if s_audio >= 1.0 else ("video", "audio")
        logging.getLogger("h3_core").warning(
            "H3: only the %s ladder starts below 1.0: the given latent's %s is refined, its %s is made anew from "
            "noise; give it a ladder that starts lower too, or keep=%r to hold it.", refined, refined, fresh, fresh)
    if video_noise.shape[1]:
        video_noise = s_video * video_noise + (1 - s_video) * patchify(init.video.float().cpu())
    if audio_noise.shape[1]:
        audio_noise = s_audio * audio_noise + (1 - s_audio) * pack_audio(init.audio.float().cpu()[None])
    return video_noise, audio_noise


# ----------------------------------------------------------------------------------------------
# Models and the whole request


TASK_PARTITION = {"t2va": "fl2va", "fl2va": "fl2va", "ref2va": "ref2va"}
MAX_OUTPUTS = 10_000  # numbered _00000 to _09999; a typo's extra zeros spent minutes naming files first
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# tiny-random runs the release's recipe on a small canvas (short edge 128) so it finishes in seconds.
TINY_CANVAS = CanvasRules(short_edge=128, max_pixels=128 * 224, reference_image_short_edge=256)


@dataclass(frozen=True)
class ModelFiles:
    """Where the text encoder (and its tokenizer) and the VAEs are when they are not under the DiT's path:
    ComfyUI's single files (models/text_encoders, models/vae), or any file or folder each loader takes.
    None: found with the DiT (a release root or partition folder holds all four)."""

    text_encoder: str | Path | None = None
    tokenizer: str | Path | None = None  # a single text-encoder file carries none: FL2VA/tokenizer (or FL2VA/)
    video_vae: str | Path | None = None
    audio_vae: str | Path | None = None

    def given(self) -> dict[str, Path]:
        return {name: Path(value).expanduser() for name, value in dataclasses.asdict(self).items() if value is not None}


def canvas_rules(model: str | Path | None) -> CanvasRules:
    """The canvas a model's requests are checked on, known from its name before any model is found or fetched
    (a Path("tiny-random") is the tiny model)."""
    return TINY_CANVAS if str(model) == TINY_RANDOM else RELEASE_CANVAS


@dataclass
class ModelSource:
    """Where a request's models come from: `tiny-random`, local paths, or a Hub repo id."""

    name: str
    root: Path | None  # the DiT's path (a release root or folder holds the other models too); None: tiny or files
    files: ModelFiles = ModelFiles()

    @property
    def tiny(self) -> bool:
        return self.name == TINY_RANDOM

    @property
    def canvas(self) -> CanvasRules:
        return canvas_rules(self.name)

    @property
    def text_encoder(self) -> Path:
        return self.files.given().get("text_encoder", self.root)

    @property
    def tokenizer(self) -> Path | None:
        """The given tokenizer; for a single text-encoder file with none given, the model's folder (a release
        root or partition folder holds tokenizer/ and processor/); else None: found beside the encoder."""
        given = self.files.given()
        if "tokenizer" in given:
            return given["tokenizer"]
        if "text_encoder" in given and given["text_encoder"].is_file() and self.root and self.root.is_dir():
            return self.root
        return None

    @property
    def video_vae(self) -> Path:
        return self.files.given().get("video_vae", self.root)

    @property
    def audio_vae(self) -> Path:
        return self.files.given().get("audio_vae", self.root)


FILE_OPTIONS = {"text_encoder": "--text-encoder", "tokenizer": "--tokenizer", "video_vae": "--video-vae",
                "audio_vae": "--audio-vae"}
COMFYUI_FOLDERS = {"text_encoder": "a file from models/text_encoders", "video_vae": "one from models/vae",
                   "audio_vae": "one from models/vae"}


def check_output_name(option: str, path: str | Path, suffix: str) -> None:
    """An output path names a `suffix` file: not empty (argparse and Path make "" the path ".") nor only the
    suffix (".mp4" is a hidden file's name), not a folder, and ending in `suffix` (an MP4's in any case; latents
    exactly, as AVLatents.save takes them)."""
    path = Path(path)
    if not path.name or path.name.lower() == suffix:
        name = repr(path.name) if path.name else "an empty name"
        raise ValueError(f"{option} must name a file such as clip{suffix}; got {name}.")
    if path.expanduser().is_dir():
        raise ValueError(f"{option} {path} is a folder; give the output file's name.")
    any_case = suffix == ".mp4"
    if (path.suffix.lower() if any_case else path.suffix) != suffix:
        raise ValueError(f"{option} {path} must end in {suffix}{' (any case)' if any_case else ''}.")


def resolve_model_source(model: str | None, partition: str, files: ModelFiles = ModelFiles(),
                         parts: Sequence[str] = tuple(FILE_OPTIONS), dit: bool = True) -> ModelSource:
    """`tiny-random`, an existing local path, or (only then) a Hugging Face repo id downloaded with
    huggingface_hub (of the partition that serves the task, just the DiT if `dit` and the `parts` not in
    `files`). `files`: the other models' own paths, checked to exist. A single DiT file holds the DiT alone,
    so then the other `parts` the caller needs must be given (but the tokenizer: the release's is fetched
    when none is), unless it is an all-in-one file holding them; with no `model` at all, every one."""
    given = files.given()
    model = None if model is None else str(model)  # a Path is welcome; the source's name is a str
    if model is not None and not model.strip():  # Path("") is the current folder
        raise CheckpointError(f"--model is empty; give a model path, a Hub repo id or {TINY_RANDOM}.")
    if model == TINY_RANDOM:
        if given:
            raise CheckpointError(f"{', '.join(FILE_OPTIONS[n] for n in given)}: {TINY_RANDOM} makes its own text "
                                  "encoder and VAEs; these name files of a real model.")
        return ModelSource(model, None)
    for name, path in given.items():
        if not path.exists():
            raise CheckpointError(f"{FILE_OPTIONS[name]} {path} does not exist.")
    path, bundled = None if model is None else Path(model).expanduser(), []
    if path is not None and path.is_file() and path.suffix.lower() != ".gguf":
        # a pickle is refused first, whatever else is missing; without a DiT to read (h3 encode), a file serves
        # only as an all-in-one file holding the VAEs
        if dit:
            check_safetensors_file(path, "DiT", " (or GGUF, .gguf)")
        else:
            check_safetensors_file(path, "all-in-one model",
                                   " (a release folder serves too; or give --video-vae and --audio-vae)")
        # an all-in-one file serves the models it holds that are not given on their own (an unreadable one is
        # said so by the DiT's loader, after what is missing)
        with contextlib.suppress(CheckpointError):
            bundled = bundled_models(tensor_names([path]))
        files = dataclasses.replace(files, **{name: path for name in bundled if name not in given and name in parts})
        given = files.given()
    if path is None or path.is_file():
        missing = [name for name in parts if name not in given and name != "tokenizer"]
        where = ("Without --model each model is given on its own" if path is None
                 else f"--model {model} is a single DiT file: the other models are not in it" if not bundled
                 else f"--model {model} is an all-in-one file holding the DiT and the "
                      f"{' and the '.join(name.replace('_', ' ').replace('vae', 'VAE') for name in bundled)} alone")
        if missing:
            raise CheckpointError(
                f"{where}. Give {', '.join(FILE_OPTIONS[name] for name in missing)} (ComfyUI: "
                f"{', '.join(COMFYUI_FOLDERS[name] for name in missing)}), or --model a release root holding them all.")
        if path is None:
            return ModelSource("the given files", None, files)
    if path.exists():
        return ModelSource(model, path, files)
    if not REPO_ID.match(model):
        raise CheckpointError(f"--model {model!r} is not an existing path, 'tiny-random' or a Hub repo id (owner/name).")
    needed = (["dit"] if dit else []) + [name for name in parts if name not in given]
    try:
        return ModelSource(model, fetch_release(model, partition, needed), files)
    except CheckpointError:
        raise
    except Exception as error:  # offline, no such repo, no access: said with the path it also is not
        raise CheckpointError(f"--model {model}: no such local path, and fetching it as a Hugging Face Hub repo "
                              f"failed ({hub_error_text(error)}).") from None


@dataclass
class GenerateSettings:
    """None for steps / shifts: a Turbo adapter's distilled schedule if one is applied, else 50 / 12 / 3."""

    seed: int = 0  # 0 to 2^64 - 1; only its low 32 bits set the noise (as in diffusers and ComfyUI)
    outputs: int = 1  # seeds seed, seed + 1, ...
    steps: int | None = None
    video_shift: float | None = None
    audio_shift: float | None = None
    device: str = "cpu"
    dtype: torch.dtype = torch.bfloat16
    attention: str = "auto"
    loras: Sequence[tuple[str | Path, float]] = ()  # (file, strength), applied in order, merged
    lora_unknown_keys: str = "error"  # "warn": a LoRA's keys that name no H3 module are reported, the rest loaded
    linears: str = "checkpoint"  # fp8.LINEAR_MODES; "fp8-lossy" / "fp8-weights-lossy" are opt-in, lossy
    devices: Sequence[str] = ()  # two or more: the DiT runs split over them (parallel/); the rest on `device`
    shard_weights: bool = False  # with devices: each holds 1/P of every block (FSDP-style)
    gpu_memory: float | None = None  # GiB the DiT may use on a GPU (None: what is free); less streams blocks
    compile: bool = False  # torch.compile the repeated block's forward (not bitwise exact)
    # The video VAE's dtype; None: `dtype`, as the reference pipeline loads it (decoder linears in bf16,
    # encoder, norms and residual stream float32). float32 decodes ~7.5x slower on an H200. The audio
    # VAE is float32 whole in both.
    vae_dtype: torch.dtype | None = None
    # Lossy, opt-in: > 0 limits target video rows' attention to the target video within this many latent
    # frames of themselves (local_attention.py); 0 = full attention, the model as trained.
    attention_window: int = 0
    attention_window_dense_steps: int = 0  # with a window: the first forwards of each run keep full attention
    crf: int = DEFAULT_CRF  # the MP4's H.264 quality: 0 lossless .. 51; 18 looks lossless, each 6 more halves the file


@dataclass
class GenerateResult:
    """One output of a job: its `seed`, the files written (None where not asked for), the final `latents`
    (normalized, as `AVLatents.save` writes them and `--continue-from` reads them), the `task`, and `seconds` by
    stage: "encode" (text encoder and VAE encodes of the whole batch) and "load" (the DiT, once for the batch), then
    this output's own "sample" and, when an MP4 was written, "decode"."""

    seed: int
    video_path: Path | None
    latents_path: Path | None
    latents: AVLatents
    seconds: dict[str, float] = field(default_factory=dict)
    task: str = ""


Progress = Callable[[str, int, int], None]  # (stage, done, total)


def numbered(path: Path | None, index: int, count: int) -> Path | None:
    """out.mp4 for one output; out_00000.mp4, out_00001.mp4, ... for several."""
    if path is None or count == 1:
        return path
    return path.with_name(f"{path.stem}_{index:05d}{path.suffix}")


@dataclass
class Job:
    """One request of a batch and where its results go. `seed` / `outputs` None: the settings'. `keep`
    ("video" or "audio") holds that part of the `given` clip's latents and generates the other."""

    request: Request  # or a long_video.LongVideoRequest
    out: Path | None = None
    save_latents: Path | None = None
    seed: int | None = None
    outputs: int | None = None
    given: AVLatents | None = None
    keep: str | None = None
    name: str = ""  # where the job came from, for messages (a batch file's line); default "job N"
    # files read to make `request` or `given` that they no longer name, as (option, path): latents from
    # --continue-from or --from, the --batch file; no output may overwrite one (nor the request's own files)
    inputs: Sequence[tuple[str, Path]] = ()


@dataclass
class _Prepared:
    """A job once validated: its request (guides read), the functions that encode and run it, its guides
    still to add to the conditioning, and its partition."""

    job: Job
    request: Request
    encode: Callable
    run: Callable
    guide_media: list
    partition: str
    seed: int
    outputs: int
    # its largest window's packed sequence as far as its sizes fix it before encoding (built when asked for)
    least_layout: Callable[[], PackedLayout]

    @property
    def plain_request(self) -> Request:
        """The request itself, or a long video's (`LongVideoRequest.request`): prompt, media, canvas."""
        return getattr(self.request, "request", self.request)


def generate(
    request: Request,
    model: str | Path,
    settings: GenerateSettings,
    out: str | Path | None = None,
    save_latents: str | Path | None = None,
    progress: Progress | None = None,
    notes: Callable[[str], None] | None = None,
    given: AVLatents | None = None,
    keep: str | None = None,
    files: ModelFiles = ModelFiles(),
) -> list[GenerateResult]:
    """Prompt and references to MP4s: `generate_batch` with one job. `keep` ("video" or "audio") holds
    that part of the `given` clip's latents and generates the other (`sample`'s keep; one plain request
    of the clip's size)."""
    from .long_video import LongVideoRequest

    if not isinstance(request, (Request, LongVideoRequest)):
        raise RequestError(f"generate takes a Request (or a long_video.LongVideoRequest), got {type(request).__name__}.")
    return generate_batch([Job(request, out, save_latents, given=given, keep=keep)], model, settings, progress,
                          notes, files)


def generate_batch(
    jobs: Sequence[Job],
    model: str | Path,
    settings: GenerateSettings,
    progress: Progress | None = None,
    notes: Callable[[str], None] | None = None,
    files: ModelFiles = ModelFiles(),
    on_failure: Callable[[str, Job, Exception], None] | None = None,
) -> list[GenerateResult]:
    """Requests to MP4s, each model loaded once for them all. Validation of every job runs first (no model
    is loaded for a bad one); then, one model at a time on the device: text encoder (released after
    encoding every job), VAEs for the conditionings, the DiT for sampling (planned for the largest job),
    the VAEs again for the streamed decodes: each output's as it is sampled where the decode fits beside
    the DiT (decode_fits_beside_dit), else all after the DiT has left, in order (the video chunks of those,
    and of the very last output, on all of `settings.devices` when several are given). A
    `LongVideoRequest` runs window by window (long_video.py) and its whole clip is decoded once. `model` is
    the DiT's path (a release root holds the other models too); `files` names the others where they are
    elsewhere (ComfyUI's single files). Results in job order, each job's outputs in seed order.

    A job that fails once the batch runs (an Exception from its encode, sampling, decode or writing) ends the
    batch, raised as a single `generate`'s would be, unless `on_failure` is given: so that an overnight batch
    loses only that job, its memory is then handed back, the failure goes to `notes` and to
    `on_failure(name, job, error)` (name: `job.name`, else "job N"), its remaining outputs are skipped (those
    it wrote stay in the results) and the batch goes on. `on_failure` may re-raise the error to stop (a host
    interrupt that is an Exception, as ComfyUI's is). KeyboardInterrupt (no Exception) always stops the batch,
    and a job that fails the checks still refuses the whole batch before any model loads."""
    if not jobs:
        raise ValueError("Nothing to generate: no jobs.")
    strays = [f"{type(job).__name__} (job {number})" for number, job in enumerate(jobs, 1) if not isinstance(job, Job)]
    if strays:
        raise RequestError(f"generate_batch takes Jobs (a request with where its results go: Job(request, out=...)), "
                           f"got {', '.join(strays[:3])}.")
    progress = progress or (lambda stage, done, total: None)
    notes = notes or (lambda line: None)
    window = check_settings(settings)
    device, timings = torch.device(settings.device), {}
    rules = canvas_rules(model)
    names = [job.name or f"job {number}" for number, job in enumerate(jobs, 1)]
    prepared = []
    for job, name in zip(jobs, names):  # every limit of every job, before any model
        try:
            prepared.append(_prepare(job, rules, settings))
        except (ValueError, MediaError) as error:  # a RequestError is a ValueError
            if len(jobs) > 1 or job.name:  # a batch file's one line is still named
                error.args = (f"{name}: {error}",)
            raise
    _check_batch(prepared, names)
    from .long_video import LongVideoRequest, resume_seed_warnings, sampled_prompt_warnings  # it uses sample

    for item, name in zip(prepared, names):
        seeds = range(item.seed, item.seed + item.outputs)
        for warning in sampled_prompt_warnings(item.request) + resume_seed_warnings(item.request, seeds):
            notes(f"warning: {name + ': ' if len(prepared) > 1 else ''}{warning}")
    partition = prepared[0].partition
    # these need no model: said before a download
    resolve_backend(settings.attention, device, window=window > 0, dtype=settings.dtype)
    check_linear_mode(settings.linears, device)
    loras = [(load_lora(path, unknown=settings.lora_unknown_keys), float(strength)) for path, strength in settings.loras]
    source = resolve_model_source(model, partition, files)
    dit_source = None if source.tiny else with_config(locate_dit(source.root, partition))
    # the DiT's headers checked against the model (names, shapes, formats) before any model loads
    reader = None if source.tiny else DiTReader(dit_source, partition, settings.dtype, dit_source.config,
                                                read_mode(settings.linears, bool(loras)), device)
    check_loras(TINY_DIT if source.tiny else reader.model, loras, partition)  # an adapter's shapes, the same way
    if len(settings.devices) > 1:
        from .parallel.workers import check_degree

        check_degree(TINY_DIT if source.tiny else dit_source.config, len(settings.devices))
    student = dit_source is not None and vsa_student(dit_source)
    if student:
        _check_vsa_student(settings)
    contracts = applied_contracts(loras) + ([VSA_STUDENT_CONTRACT] if student else [])
    schedule = sampler_settings(contracts, settings.steps, settings.video_shift, settings.audio_shift)
    idle_window = dense_covers_run(settings.attention_window, settings.attention_window_dense_steps, schedule.steps - 1)
    if idle_window:
        raise RequestError(f"{idle_window} (--attention-window-dense-steps; --steps counts the sigma points, one "
                           "more than the model calls)")
    for task in dict.fromkeys(item.plain_request.task for item in prepared):
        for line in task_warnings(contracts, task):
            notes(f"warning: {line}")
    notes(f"sampler: {schedule.steps} sigma points ({schedule.steps - 1} model calls), video shift "
          f"{schedule.video_shift:g}, audio shift {schedule.audio_shift:g}; from the {schedule.source}"
          + "".join(f"; {n}" for n in schedule.notes))
    if not source.tiny:  # every checkpoint found and recognized before the first one loads
        with _part_of(source, "text_encoder"):
            text_files = locate_text_encoder_files(source.text_encoder, source.tokenizer)
        showing = [name for item, name in zip(prepared, names) if shows_pictures(item.plain_request)]
        if showing and not text_files.vision_tower:
            which = "This request shows" if len(prepared) == 1 else f"{', '.join(showing)} show"
            raise CheckpointError(f"{which} the text encoder pictures (keyframes or image / video references), "
                                  f"but {text_files.files[0].name} {GGUF_NO_VISION}.")
        if showing and text_files.processor_folder is None:  # a tokenizer found alone: text prompts only
            raise CheckpointError(NO_PROCESSOR if len(prepared) == 1 else f"{', '.join(showing)}: {NO_PROCESSOR}")
        if text_files.vision is not None:
            notes(f"text encoder: vision tower from {text_files.vision.path.name}, beside it")
        if source.tokenizer is None and text_files.one_file:  # the release's, from the Hub
            source = dataclasses.replace(source, files=dataclasses.replace(
                source.files, tokenizer=text_files.tokenizer_folder))
            notes(f"tokenizer: the release's, from the Hugging Face cache ({text_files.tokenizer_folder})")
        with _part_of(source, "video_vae"):
            check_video_vae(source.video_vae)  # headers against the model, as the DiT's above
        with _part_of(source, "audio_vae"):
            check_audio_vae(source.audio_vae)
    if len(settings.devices) < 2:  # the sampling's rows as far as known before encoding: too many are said now
        least = max((item.least_layout() for item in prepared),
                    key=lambda layout: layout.sequence_length)  # the job with the most rows, planned once
        sampling_plan(TINY_DIT if source.tiny else dit_source.config, dit_source, partition, settings, loras, least,
                      schedule.steps, reader, ", before any model loads,")

    held, failures = [], []  # the loaded DiT (with its plan and streamer); the errors handed to on_failure

    def release_dit() -> None:
        """The DiT's device memory and worker processes handed back (once nothing else holds the DiT, its
        pinned blocks leave the host cache too)."""
        if held:
            dit, _, streamer = held.pop()
            _release_dit(dit, streamer, reader)
            dit = streamer = None  # this frame's names too, before the emptying (else the blocks stay cached)
            empty_caches(device)

    def run() -> list[GenerateResult]:
        clock = time.perf_counter()
        # the VAEs first: they sit beside the text encoder while it encodes, so it is placed in what they leave
        video_vae, audio_vae = load_vaes(source, device, settings.vae_dtype or model_dtype(source, settings), progress)
        notes(f"video VAE: decoder linears in {str(video_vae.dtype).removeprefix('torch.')} (encoder and norms float32)")
        beside = module_bytes([video_vae, audio_vae]) if device.type == "cuda" else 0
        progress("text encoder", 0, 1)
        text_encoder = load_text_encoder_for(source, settings, notes, _stage(progress, "read text encoder"), beside)
        progress("text encoder", 1, 1)
        conditionings = [None] * len(prepared)  # None: the job failed
        for number, item in enumerate(prepared):
            stage = f"encode job {number + 1}/{len(prepared)}" if len(prepared) > 1 else "encode"
            try:  # the prompt, then each picture or sound (a long video: each other window prompt, the track, guides)
                conditioning = item.encode(item.request, text_encoder, video_vae, audio_vae, rules=source.canvas,
                                           before_models=room_to_encode(text_encoder, settings, notes, beside),
                                           on_stage=_stage(progress, stage))
                for index, media in enumerate(item.guide_media, 1):
                    conditioning = add_guide(conditioning, media.frame_index, video_vae, audio_vae, media.frames,
                                             media.waveform, media.sample_rate,  # a clip: up to 362 frames
                                             _stage(progress, f"{stage}: guide {index}/{len(item.guide_media)}"))
                conditionings[number] = conditioning
            except Exception as error:
                if on_failure is None:
                    raise
                failures.append(error)
                _job_failed(names[number], item.job, error, device, on_failure, notes)
        text_encoder.release()  # its ~51 GB leave before the DiT arrives
        del text_encoder
        video_vae.to("cpu"), audio_vae.to("cpu")  # back on the device only for the decode
        empty_caches(device)
        timings["encode"] = time.perf_counter() - clock

        running = [number for number, conditioning in enumerate(conditionings) if conditioning is not None]
        if not running:
            return []  # every job failed, each reported
        clock = time.perf_counter()
        largest = max((conditionings[n] for n in running), key=lambda c: largest_layout(c).sequence_length)

        def sampling_dit():
            loaded = load_sampling_dit(source, dit_source, partition, settings, loras, largest, schedule.steps, notes,
                                       _stage(progress, "read DiT"), reader)
            held[:] = [loaded]
            return loaded

        dit, plan, streamer = sampling_dit()
        timings["load"] = time.perf_counter() - clock

        results, waiting = {}, []  # (job, output) -> result; outputs whose decode waits for the DiT to leave

        def write(number: int, index: int, latents: AVLatents, latents_path, seconds: dict) -> None:
            """An output's MP4 (where its job asks for one), the VAEs on the device for it, then its result."""
            item, request, seed = prepared[number], prepared[number].request, prepared[number].seed + index
            label = f"job {number + 1}/{len(prepared)}, " if len(prepared) > 1 else ""
            sound_stage, decode_stage = (f"{what} {label}{index + 1}/{item.outputs}"
                                         for what in ("decode sound", "decode"))
            video_path = numbered(item.job.out, index, item.outputs)
            if video_path is not None:
                clock = time.perf_counter()
                video_vae.to(device), audio_vae.to(device)
                Path(video_path).parent.mkdir(parents=True, exist_ok=True)
                video_path = write_mp4(
                    video_path, latents, video_vae, audio_vae,
                    metadata={"comment": f"MiniMax-H3 {request.task}, seed {seed}", "title": _title(request)},
                    on_frames=_stage(progress, decode_stage),
                    on_sound=_stage(progress, sound_stage),  # before the first frame
                    # video chunks split over the devices once the DiT's workers have left them
                    devices=settings.devices if len(settings.devices) > 1 and dit is None else None,
                    crf=settings.crf,
                )
                seconds["decode"] = time.perf_counter() - clock
                if dit is not None:  # the DiT samples again next: the VAEs' memory is its plan's again
                    video_vae.to("cpu"), audio_vae.to("cpu")
                    empty_caches(device)
            results[number, index] = GenerateResult(seed, video_path, latents_path, latents, seconds, request.task)

        def failed(number: int, error: Exception) -> None:
            if on_failure is None:
                raise error
            failures.append(error)
            _job_failed(names[number], prepared[number].job, error, device, on_failure, notes)

        for number in running:
            item, conditioning = prepared[number], conditionings[number]
            job, request = item.job, item.request
            label = f"job {number + 1}/{len(prepared)}, " if len(prepared) > 1 else ""
            try:
                for index in range(item.outputs):
                    seed = item.seed + index
                    step_stage = f"sample {label}{index + 1}/{item.outputs}"
                    clock = time.perf_counter()
                    latents_path = numbered(job.save_latents, index, item.outputs)
                    saved = {"seed": str(seed), "task": request.task, "model": source.name}
                    extra = {"init": job.given, "keep": job.keep} if job.keep is not None else {}
                    if latents_path is not None and isinstance(request, LongVideoRequest):
                        extra["on_window"] = functools.partial(_save_windows, latents_path, saved, notes)
                    latents = item.run(
                        dit, conditioning, seed, schedule.steps, schedule.video_shift, schedule.audio_shift,
                        schedule.video_sigmas, schedule.audio_sigmas,
                        callback=lambda state: progress(step_stage, state.step, state.total),
                        offload_adaln=plan.offload_adaln, **extra,
                    )
                    seconds = {**timings, "sample": time.perf_counter() - clock}
                    if number == running[-1] and index == item.outputs - 1:  # DiT's memory free before the last decode
                        dit = streamer = None  # the streamer holds the resident blocks too
                        release_dit()
                    if latents_path is not None:
                        latents.save(latents_path, saved)
                    if not waiting and (dit is None or job.out is None or decode_fits_beside_dit(
                            video_vae, audio_vae, latents, settings, device)):
                        write(number, index, latents, latents_path, seconds)
                    else:  # a decode now would take memory the DiT's plan counts on: after it has left, in order
                        waiting.append((number, index, AVLatents(latents.video.cpu(), latents.audio.cpu()),
                                        latents_path, seconds))
            except Exception as error:
                latents = conditioning = conditionings[number] = None
                failed(number, error)
                if getattr(dit, "closed", False) and number != running[-1]:  # a worker's failure ended the runner
                    notes("the DiT's worker processes stopped with that job; starting them again for the next")
                    dit, plan, streamer = sampling_dit()
        if waiting:
            notes(f"memory: a decode did not fit beside the DiT; {len(waiting)} output(s) decoded after it left")
            dit = None  # (the last job may have failed before it was released)
            del streamer
            release_dit()
        broken = set()  # jobs whose decode failed after the DiT left: their other outputs are skipped
        for entry in waiting:
            if entry[0] in broken:
                continue
            try:
                write(*entry)
            except Exception as error:
                broken.add(entry[0])
                failed(entry[0], error)
        return [results[key] for key in sorted(results)]

    try:
        return run()
    except BaseException as error:
        traceback.clear_frames(error.__traceback__)  # the run's models and tensors, not kept by a kept exception
        raise
    finally:  # however the run ends: the DiT let go of (a caller keeping the error keeps no models or workers)
        release_dit()
        if reader is not None:
            reader.drop()
        for error in failures:  # the errors on_failure kept hold the finished run's frame (its VAEs, latents)
            traceback.clear_frames(error.__traceback__)
        loras = None  # noqa: F841 (the adapters' factors, held by this frame while an exception is kept)


def decode_fits_beside_dit(video_vae, audio_vae, latents: AVLatents, settings: GenerateSettings,
                           device: torch.device) -> bool:
    """Whether an output's decode fits on `device` while the DiT stays there for the next output: both VAEs'
    weights and the decode's working memory (vae_video.decode_working_bytes) within what is free, and within
    `settings.gpu_memory` less what this process holds there. The DiT's plan did not count them."""
    if device.type != "cuda":
        return True
    _, _, frames, height, width = latents.video.shape
    need = module_bytes([video_vae, audio_vae]) + decode_working_bytes(
        video_vae.config, frames, height, width, video_vae.decoder.proj_out.weight.element_size())
    room = usable_bytes(free_bytes(device))
    if settings.gpu_memory:
        room = min(room, usable_bytes(int(settings.gpu_memory * GIB)) - torch.cuda.memory_allocated(device))
    return need <= room


def _title(request) -> str:
    """An MP4's title: the prompt, or a long video's first window prompt when it gives one a window instead."""
    prompts = getattr(request, "window_prompts", ()) or ()
    prompt = getattr(request, "request", request).prompt or (prompts[0] if prompts else "")
    return prompt[:200]


def _release_dit(dit, streamer, reader: DiTReader | None) -> None:
    """The DiT's device memory handed back: its streaming hooks removed (with their slots), parallel workers
    stopped, the weights its reader holds let go of. The caller then drops its own references and empties the
    caches."""
    if streamer is not None:
        streamer.remove()
    if hasattr(dit, "close"):
        dit.close()  # the parallel workers
    if reader is not None:
        reader.drop()  # it holds the model it read (a checkpoint on disk; tiny-random has none)


def _job_failed(name: str, job: Job, error: Exception, device: torch.device, on_failure, notes) -> None:
    """A job that failed while its batch runs: its memory handed back (the tensors its finished frames hold,
    as placement.freed_on_failure does), then said (which job, what it writes, why) and handed to the host."""
    traceback.clear_frames(error.__traceback__)
    empty_caches(device)
    written = job.out or job.save_latents
    notes(f"{name}{f' ({written})' if written else ''} failed: {type(error).__name__}: {error}; "
          "the batch goes on with the next job")
    on_failure(name, job, error)


MODEL_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # what a model runs in, by name


@contextlib.contextmanager
def _part_of(source: ModelSource, part: str):
    """A model looked for under --model that is not there: the error says which option names it elsewhere."""
    try:
        yield
    except CheckpointError as error:
        if part in source.files.given():
            raise
        raise CheckpointError(f"{error} (looked for under --model {source.name}; give {FILE_OPTIONS[part]} "
                              "where it is elsewhere)") from None


def check_settings(settings: GenerateSettings) -> int:
    """How a run is told to go (steps, shifts, devices, memory budget, attention window), checked before
    any job is read or model loaded; returns the window."""
    _check_setting_types(settings)
    try:
        window, _ = check_window_setting(settings.attention_window, settings.attention_window_dense_steps)
    except ValueError as error:
        raise RequestError(str(error)) from None
    if settings.steps is not None:
        check_steps(settings.steps)
    for name, shift in (("video_shift (--video-shift)", settings.video_shift), ("audio_shift (--audio-shift)", settings.audio_shift)):
        if shift is not None:
            check_shift(shift, name, bounded=True)
    check_devices([settings.device])
    if settings.devices:
        check_devices(settings.devices, split=True)
    if settings.shard_weights and len(settings.devices) < 2:
        raise ValueError("shard_weights (--shard-weights) splits the DiT's weights over several devices; give two or "
                         "more with devices (--devices).")
    for name, dtype in (("dtype (--dtype)", settings.dtype), ("vae_dtype (--vae-dtype)", settings.vae_dtype)):
        if dtype is not None and dtype not in MODEL_DTYPES.values():
            raise ValueError(f"{name} must be one of torch.bfloat16, torch.float16, torch.float32; got {dtype!r}.")
    check_budget(settings.gpu_memory)
    check_crf(settings.crf)
    return window


def _check_setting_types(settings: GenerateSettings) -> None:
    """What each setting is (an integer, a number, a flag, (file, strength) pairs): a Python caller's "2" or 2.5
    is said here, not met as a TypeError somewhere inside the run."""
    if not isinstance(settings, GenerateSettings):
        raise TypeError(f"settings must be a GenerateSettings, got {type(settings).__name__}.")

    def integer(value) -> bool:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)

    def number(value) -> bool:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)

    wanted = [("seed", integer, "an integer"), ("outputs", integer, "an integer"),
              ("steps", lambda v: v is None or integer(v), "an integer or None"),
              ("video_shift", lambda v: v is None or number(v), "a number or None"),
              ("audio_shift", lambda v: v is None or number(v), "a number or None"),
              ("gpu_memory", lambda v: v is None or number(v), "a number of GiB or None"),
              ("attention_window", integer, "an integer"), ("attention_window_dense_steps", integer, "an integer"),
              ("crf", integer, "an integer"),
              ("compile", lambda v: isinstance(v, bool), "True or False"),
              ("shard_weights", lambda v: isinstance(v, bool), "True or False"),
              ("lora_unknown_keys", lambda v: v in ("error", "warn"), "'error' or 'warn'"),
              ("loras", lambda v: not isinstance(v, (str, Path)) and isinstance(v, Sequence) and all(
                  isinstance(pair, Sequence) and not isinstance(pair, str) and len(pair) == 2 and number(pair[1])
                  for pair in v), "a list of (file, strength) pairs"),
              ("devices", lambda v: not isinstance(v, str) and isinstance(v, Sequence), "a list of devices")]
    for name, fits, what in wanted:
        value = getattr(settings, name)
        if not fits(value):
            raise ValueError(f"GenerateSettings.{name} must be {what}, got {value!r}.")


def check_writable(path: Path, option: str = "") -> None:
    """An output file can be written where it is asked for: not a folder itself, and a file (or the folders it
    needs, which the run makes when it writes) can be created there. Found out before the models run, not after,
    and without leaving anything behind for a run refused later. `option` (e.g. "--out") names it in the
    messages."""
    path = Path(path).expanduser()
    named = f"{option} {path}".strip()
    if path.is_dir():
        raise ValueError(f"{named} is a folder; give the output file's name.")
    above = next((parent for parent in path.parents if parent.exists()), None)
    if above is not None and not above.is_dir():
        raise ValueError(f"Cannot write {named}: {above} is a file, not a folder.")
    try:  # where the first missing folder (or the file) will be made
        with tempfile.NamedTemporaryFile(dir=above or Path.cwd(), prefix=f".{path.name}.", suffix=".check"):
            pass
    except OSError as error:
        raise ValueError(f"Cannot write {named}: {error.strerror or error}.") from None


def _prepare(job: Job, rules: CanvasRules, settings: GenerateSettings) -> _Prepared:
    """One job checked against every limit (its guide files read and checked too), before any model loads."""
    from .continuation import sampled
    from .long_video import (  # they use sample
        LongVideoRequest, encode_long_video, layout_before_encoding, sample_long_video, validate_long_video)

    job = dataclasses.replace(job, out=_as_path(job.out), save_latents=_as_path(job.save_latents))
    request, keep, given = job.request, job.keep, job.given
    long_video = isinstance(request, LongVideoRequest)
    if not (long_video or isinstance(request, Request)):
        raise RequestError(f"A job's request is a Request (or a long_video.LongVideoRequest), got {type(request).__name__}.")
    check, encode, run = (
        (validate_long_video, encode_long_video, sample_long_video) if long_video else (validate, encode_request, sample)
    )
    partition = TASK_PARTITION.get(request.task)
    if partition is None:
        raise RequestError(f"Unknown task {request.task!r}; choose t2va, fl2va or ref2va.")
    if job.out is None and job.save_latents is None:
        raise ValueError("Nothing to write: give an output MP4 path and/or a latents path.")
    for option, path, suffix in (("--out", job.out, ".mp4"), ("--save-latents", job.save_latents, ".safetensors")):
        if path is None:
            continue
        check_output_name(option, path, suffix)
    outputs = settings.outputs if job.outputs is None else job.outputs
    if isinstance(outputs, bool) or not isinstance(outputs, numbers.Integral) or not 1 <= outputs <= MAX_OUTPUTS:
        raise ValueError(f"outputs must be an integer of at least 1 and at most {MAX_OUTPUTS}, got {outputs!r}.")
    seed = settings.seed if job.seed is None else job.seed
    check_seeds(seed, outputs)
    if (keep is None) != (given is None):
        raise RequestError("keep ('video' or 'audio') and given (a clip's AVLatents) go together: which part of "
                           "which clip to keep.")
    plan = check(request, rules)
    for option, path in (("--out", job.out), ("--save-latents", job.save_latents)):
        if path is not None:  # only for a request that passed its checks; each name it will write (one folder)
            check_writable(numbered(path, 0, outputs), option)  # the others: `_check_batch`
    if keep is not None:
        if long_video:
            raise RequestError("keep holds part of a given clip in one plain request; a long video keeps a clip's "
                               "video with LongVideoRequest(keep_video=...), its sound with drive_audio.")
        try:
            kept_latents(given, keep, request_latent_shape(plan.num_frames, plan.width, plan.height))
        except ValueError as error:
            raise RequestError(str(error)) from None
    # a long video's: its request's (files or media) and its own (media), which were dropped here before
    guides = (*request.request.guides, *request.guides) if long_video else tuple(request.guides)
    # a clip is made in one window: no guide clip is longer than the longest window sampled (a clip being
    # continued is not sampled; its length would read that much of a guide file only to refuse it)
    clip_frames = max(w.frames for w in sampled(plan.windows)) if long_video else None
    guide_media = [_guide_media(guide, plan.num_frames, clip_frames) for guide in guides]
    if long_video:  # the windows take them in memory (validated again, now with them)
        request = dataclasses.replace(request, request=dataclasses.replace(request.request, guides=()),
                                      guides=tuple(guide_media))
        check(request, rules)
        guide_media = []
    guide_blocks = []
    check_guides_beside_kept(guide_media, keep)
    if guide_media:  # checked now, added to the conditioning once it is encoded
        for media in guide_media:
            pixels, anchor, _ = check_guide(request.task, plan.num_frames, media.frame_index, media.frames,
                                            media.waveform, media.sample_rate)
            if pixels is not None:  # its picture's latent frames, for the plan (its sound's fewer rows left out)
                count = guide_frame_count(pixels.shape[0])
                guide_blocks.append(GuideBlock(anchor, 1 if count == 1 else geometry.latent_frames(count)))
        request = dataclasses.replace(request, guides=())
    least_layout = (functools.partial(layout_before_encoding, plan, request.guides) if long_video else
                    functools.partial(rows_before_encoding, plan.width, plan.height, plan.num_frames,
                                      tuple(anchor for anchor, _ in plan.keyframes), plan.reference_blocks,
                                      tuple(guide_blocks)))
    return _Prepared(job, request, encode, run, guide_media, partition, seed, outputs, least_layout)


@functools.lru_cache(maxsize=8)  # a batch's jobs mostly share their sizes
def rows_before_encoding(width: int, height: int, frames: int, anchors: tuple[str, ...], references: tuple,
                         guides: tuple):
    """The packed layout of a job's largest window as far as its sizes fix it before encoding: a one-row prompt,
    its keyframes, the `references` blocks (conditioning._sized_blocks) and the guides' pictures."""
    text = torch.ones(1, dtype=torch.long)
    target = (geometry.latent_frames(frames), *geometry.latent_size(width, height), geometry.audio_latents(frames))
    if references:
        return build_ref2va_layout(text, references, *target, guides=guides)
    return build_t2va_layout(text, *target, anchors, guides=guides)


def _guide_media(guide, num_frames: int, clip_frames: int | None) -> GuideMedia:
    """A request's guide in memory: a GuideFile read (up to what the clip can hold), a GuideMedia as it is."""
    if isinstance(guide, GuideMedia):
        return guide
    if isinstance(guide, GuideFile):
        return GuideMedia(guide.frame_index, *read_guide(guide, num_frames, clip_frames))
    raise RequestError(f"A guide is a guides.GuideFile (a file) or a guides.GuideMedia (in memory), got "
                       f"{type(guide).__name__}.")


def _as_path(path: str | Path | None) -> Path | None:
    """An output path as it is checked and written (`~` expanded: a --batch line's is not, by any shell)."""
    return None if path is None else Path(path).expanduser()


def _inputs(job: Job) -> list[tuple[str, Path]]:
    """The files a job reads, as (option, path): keyframes, references, guides, a driving track, `job.inputs`."""
    request = job.request
    plain = getattr(request, "request", request)  # a LongVideoRequest's own request
    references = [item if isinstance(item, MediaReference) else MediaReference(*item)
                  for item in plain.references or ()]
    found = [("--first-image", plain.first_image), ("--last-image", plain.last_image),
             *(("--ref", reference.source) for reference in references),
             *(("--guide", getattr(guide, "path", None)) for guide in plain.guides),
             ("--drive-audio", getattr(request, "drive_audio", None)), *job.inputs]
    return [(option, Path(path).expanduser()) for option, path in found if isinstance(path, (str, Path))]


def _save_windows(path: Path, metadata: dict[str, str], notes: Callable[[str], None], clip: AVLatents, made: int,
                  count: int) -> None:
    """A long video's clip so far, saved where its whole clip will be (replaced whole after each window): a run
    stopped later keeps it, and --continue-from makes the rest."""
    clip.save(path, {**metadata, "windows": f"{made} of {count}"})
    if clip.resume is None:  # a driving track or a kept video: --continue-from would make the rest of it anew
        notes(f"long video: windows 1-{made} of {count} saved to {path} (a run that holds its sound or video "
              "fixed cannot be continued: were it to stop, run it again)")
        return
    notes(f"long video: windows 1-{made} of {count} saved to {path} (were the run to stop, continue it with "
          f"--continue-from {path} --seed {metadata['seed']})")


def _check_batch(prepared: list[_Prepared], names: list[str]) -> None:
    """One DiT partition for the whole batch, no two outputs written to one file, and no output written over
    a file a job reads (the same file: by path, link or hard link), nor one of several numbered outputs into a
    folder of its name."""
    partitions = sorted({item.partition for item in prepared})
    if len(partitions) > 1:
        raise RequestError("A batch runs one DiT: t2va and fl2va jobs use the FL2VA partition, ref2va jobs Ref2VA; "
                           "put them in separate batches.")
    read = {}
    for item, name in zip(prepared, names):
        for option, path in _inputs(item.job):
            if path.exists():  # what the job has read; a missing file was refused by its checks
                stat = path.stat()
                read.setdefault((stat.st_dev, stat.st_ino), (name, option, path))
    written = {}
    for item, name in zip(prepared, names):
        for index in range(item.outputs):
            for option, path in (("--out", numbered(item.job.out, index, item.outputs)),
                                 ("--save-latents", numbered(item.job.save_latents, index, item.outputs))):
                if path is None:
                    continue
                resolved = Path(path).expanduser().resolve()
                key = os.path.normcase(resolved)  # one file whatever its case, where names ignore case (Windows)
                if key in written:
                    first, _, line = written[key].partition(", line ")
                    both = (f"{first}, lines {line} and {name.partition(', line ')[2]}" if line and name.startswith(f"{first}, line ")
                            else f"{written[key]} and {name}")
                    raise ValueError(f"{both} both write {path}.")
                written[key] = name
                if resolved.is_dir():  # else found when it is written, after the outputs before it
                    raise ValueError(f"{option} {path} is a folder; give the output file's name (the run writes "
                                     f"{item.outputs} numbered files).")
                stat = resolved.stat() if resolved.exists() else None
                if stat is not None and (stat.st_dev, stat.st_ino) in read:
                    reader, read_option, read_path = read[stat.st_dev, stat.st_ino]
                    where = f"{name}: " if len(prepared) > 1 or item.job.name else ""
                    whose = "its" if reader == name else f"{reader}'s"
                    raise ValueError(f"{where}{option} {path} would overwrite {whose} {read_option} {read_path}; "
                                     "an output may not be one of the run's input files: write it elsewhere.")


def load_text_encoder_for(source, settings: GenerateSettings, notes, on_tensor=None, beside: int = 0):
    """The text encoder on the device when it fits (in `settings.gpu_memory`, less the `beside` bytes of the VAEs
    already there, or what is free); else, with several `settings.devices` that hold it between them, its decoder
    layers spread over them (`TextEncoder.spread_layers`); else in CPU memory with its decoder layers visiting the
    GPU one at a time (`TextEncoder.stream_layers`). `on_tensor(done, total)` as its tensors are read."""
    device = torch.device(settings.device)
    if source.tiny:
        return tiny_random_text_encoder(device=device)
    if device.type == "cuda":
        rest, layer_bytes = text_encoder_sizes(source.text_encoder, settings.dtype)
        need = rest + TEXT_ENCODER_LAYER * layer_bytes + ENCODING_FLOOR_BYTES
        budget = _budget_bytes(settings, device, beside)
        if need > usable_bytes(budget):
            counts = _text_encoder_spread(settings, rest, layer_bytes)
            spread = ", ".join(f"{d} ({n})" for d, n in zip(settings.devices, counts or ()) if n)
            where = f"its layers are spread over {spread}" if counts else "its layers stream from CPU memory"
            notes(f"text encoder: {need / GIB:.1f} GiB does not fit in {budget / GIB:.1f} GiB (less the allocator's "
                  f"headroom: {usable_bytes(budget) / GIB:.1f}); {where}")
            loaded = load_text_encoder(source.text_encoder, settings.dtype, "cpu", tokenizer=source.tokenizer,
                                       on_tensor=on_tensor)
            return loaded.spread_layers(settings.devices, counts) if counts else loaded.stream_layers(device)
    return load_text_encoder(source.text_encoder, settings.dtype, device, tokenizer=source.tokenizer,
                             on_tensor=on_tensor)


def room_to_encode(text_encoder, settings: GenerateSettings, notes, beside: int = 0) -> Callable[[int, int], None]:
    """`before_models` for a request's encode: an encoder resident on a CUDA device without room left for
    encoding `rows` rows (`TextEncoder.encoding_bytes`: a long prompt with many pictures takes far more than the
    short prompt's allowance it was placed with), or for the VAEs' encodes of the media after it (`media` bytes
    besides the VAEs' weights, which are in `beside`), goes back to CPU memory and streams its layers from then
    on."""
    device = torch.device(settings.device)

    def check(rows: int, media: int = 0) -> None:
        weights = text_encoder.resident_bytes
        if not (rows or media) or device.type != "cuda" or weights is None:
            return
        text = text_encoder.encoding_bytes(rows) if rows else 0
        need = max(text, media)
        room = _budget_bytes(settings, device, beside) if settings.gpu_memory else free_bytes(device) + weights
        if weights + need <= usable_bytes(room):
            return
        work = f"encoding {rows:,} rows takes" if text >= media else "the VAEs' encodes of its pictures and sounds take"
        notes(f"text encoder: {work} about {need / GIB:.1f} GiB beside its {weights / GIB:.1f} GiB of "
              f"weights, more than {room / GIB:.1f} GiB holds; its layers stream from CPU memory from now on")
        text_encoder.to("cpu").stream_layers(device)

    return check


def _text_encoder_spread(settings: GenerateSettings, rest: int, layer_bytes: int) -> list[int] | None:
    """How many decoder layers each of several CUDA `settings.devices` takes (the first also holds the
    encoder's `rest` bytes), or None when there are not several or they cannot hold the encoder together."""
    devices = [torch.device(d) for d in settings.devices]
    if len(devices) < 2 or any(d.type != "cuda" for d in devices):
        return None
    room = [usable_bytes(_budget_bytes(settings, d)) - ENCODING_FLOOR_BYTES - (rest if i == 0 else 0)
            for i, d in enumerate(devices)]
    return spread_counts(TEXT_ENCODER_LAYER, layer_bytes, room)


def _budget_bytes(settings: GenerateSettings, device: torch.device, beside: int = 0) -> int:
    """What a model may use on a CUDA `device`: `settings.gpu_memory` less the `beside` bytes other models already
    hold there when set, else what is free there (which they are not)."""
    return max(int(settings.gpu_memory * GIB) - beside, 0) if settings.gpu_memory else free_bytes(device)


def load_vaes(source, device: torch.device, dtype: torch.dtype, progress: Progress | None = None):
    """(video VAE with its decoder linears in `dtype`, audio VAE) of a model source, on `device`; `progress`
    gets "read video VAE" and "read audio VAE" (tensors read, of how many: the release's video VAE is 9.7 GiB)."""
    if source.tiny:
        return tiny_random_video_vae(device).set_dtype(dtype), tiny_random_audio_vae(device)
    video_vae = load_video_vae(source.video_vae, dtype=dtype, device=device,
                               on_tensor=_stage(progress, "read video VAE"))
    return video_vae, load_audio_vae(source.audio_vae, device=device, on_tensor=_stage(progress, "read audio VAE"))


def _stage(progress: Progress | None, stage: str):
    """`progress` as an engine step's (done, total) callback for `stage` (None without one)."""
    return None if progress is None else lambda done, total: progress(stage, done, total)


def encode_clip_file(video: str | Path, model: str | None, out: str | Path, *, audio: str | Path | None = None,
                     width: int | None = None, height: int | None = None, device: str = "cpu",
                     vae_dtype: torch.dtype | None = None, progress: Progress | None = None,
                     files: ModelFiles = ModelFiles()) -> AVLatents:
    """A video file (its frames at 24 fps and its soundtrack, or `audio`'s) encoded by `model`'s VAEs and
    saved as latents for `generate --long-video --continue-from` (clip_latents.py). The canvas: width x
    height, or the video's own aspect ratio on the model's canvas. Everything is checked before a VAE loads.
    `progress("encode", frames done, frames expected)` after each 17 frames. The VAEs are `model`'s, or
    `files`' (then `model` may be None)."""
    check_output_name("--out", out, ".safetensors")
    if (width is None) != (height is None):
        raise RequestError(f"Give width and height (--width, --height) together, or neither (then the video's aspect "
                           f"ratio sets the canvas); got {width}x{height}.")
    if width is not None:
        geometry.check_canvas(width, height)
    check_devices([device])
    check_writable(out, "--out")
    try:  # the first frames are read now: a bad or short file is refused before a VAE is fetched or loads
        frames, width, height = stream_clip(video, canvas_rules(model), width, height)
        sound = file_soundtrack(video) if audio is None else \
            DecodedAudio(media_read.read_audio(audio, 0.0, MAX_CLIP_FRAMES / geometry.FPS), SAMPLE_RATE)
    except MediaError as error:
        raise RequestError(naming(video if audio is None else audio, error)) from None
    source = resolve_model_source(model, "fl2va", files, parts=("video_vae", "audio_vae"), dit=False)
    if not source.tiny:  # both found and checked (names, shapes, nothing missing) before either loads
        check_video_vae(source.video_vae)
        check_audio_vae(source.audio_vae)
    device = torch.device(device)
    dtype = vae_dtype or (tiny_model_dtype(device, None) if source.tiny else torch.bfloat16)
    video_vae, audio_vae = load_vaes(source, device, dtype, progress)
    expected = expected_clip_frames(video)
    on_clip = None if progress is None else (lambda done: progress("encode", done, max(done, expected)))
    try:  # the rest of the frames are decoded as the video VAE takes them, 17 at a time
        latents = encode_clip_frames(video_vae, audio_vae, frames, sound, on_clip)
    except MediaError as error:
        raise RequestError(naming(video, error)) from None
    latents.save(out, {"source": str(video), "model": source.name, "width": str(width), "height": str(height)})
    return latents


def model_dtype(source, settings: GenerateSettings) -> torch.dtype:
    """The dtype the DiT and the video VAE run in: the settings', or the tiny random model's rule."""
    return tiny_model_dtype(settings.device, settings.dtype) if source.tiny else settings.dtype


VSA_NOTE = (f"attention: Video Sparse Attention, sparsity {STUDENT_SPARSITY:g} (the model's VSA gates: FastVideo's "
            "FastH3 8-Step V2)")


def _note_lines(notes, report) -> None:
    for line in report.lines():
        notes(line)


def sampling_plan(config, dit_source, partition: str, settings: GenerateSettings, loras, layout, steps: int,
                  reader: DiTReader | None = None, before: str = "") -> MemoryPlan:
    """The DiT's memory plan for sampling `layout` on `settings.device`, refused (naming what was planned, and
    `before` what it is refused) when it cannot fit even with every block streamed from the CPU."""
    device = torch.device(settings.device)
    # LoRAs are hooked (their factors on the device) into linears held as the file stores them, else merged
    read_linears = read_mode(settings.linears, bool(loras))
    stored = read_linears == "checkpoint" and holds_stored_linears(dit_source)  # as lora.run_mode will find it
    dtype = tiny_model_dtype(device, settings.dtype) if dit_source is None else settings.dtype
    itemsize = 2 if dtype is None else dtype.itemsize  # None: as stored (the release's bf16); fp32 was planned as bf16
    other = hooked_bytes(loras, partition, itemsize, fp32_modules(config)) if stored else 0
    plan = plan_for(config, layout, steps, device, settings.gpu_memory, dtype_bytes=itemsize,
                    held=held_linears(dit_source, settings.linears, itemsize),
                    adaln_bytes=None if reader is None else reader.adaln_nbytes,
                    other_bytes=other)
    if not plan.fits:
        budget = "--gpu-memory" if settings.gpu_memory else "what is free"
        budget_bytes = int(settings.gpu_memory * GIB) if settings.gpu_memory else None
        raise RequestError(does_not_fit(plan, f"{device}{before}", budget, budget_bytes, other))
    return plan


def load_sampling_dit(source, dit_source, partition: str, settings: GenerateSettings, loras, conditioning, steps: int,
                      notes, on_tensor=None, reader: DiTReader | None = None):
    """The DiT where the request's memory plan puts it: resident, or its leading blocks resident and the
    rest streamed from the CPU (a request that cannot fit even so is refused before any weight is read);
    or split over `settings.devices` in worker processes. Returns (dit, plan, streamer or None). `reader`:
    the DiT's, built (its headers checked) by a caller that checked them before anything loaded."""
    device = torch.device(settings.device)
    if len(settings.devices) > 1:  # one worker process per device holds the DiT; encode and decode stay here
        from .parallel import ModelSpec, ParallelRunner

        if settings.gpu_memory:  # said before the workers start: the split DiT is not planned against it
            notes("memory: --gpu-memory (gpu_memory) placed the text encoder only; split over devices, the DiT is not "
                  "streamed: each device holds its share whole (with --shard-weights 1/N of every block)")
        dit = ParallelRunner(ModelSpec(
            TINY_RANDOM if source.tiny else str(source.root), partition,
            model_dtype(source, settings), settings.attention,
            tuple((str(path), float(strength)) for path, strength in settings.loras), settings.linears,
            compile=settings.compile, attention_window=settings.attention_window,
            attention_window_dense_steps=settings.attention_window_dense_steps,
            lora_unknown_keys=settings.lora_unknown_keys,
        ), settings.devices, settings.shard_weights)
        notes(f"DiT split over {', '.join(map(str, settings.devices))} (sequence parallel"
              + (", sharded weights)" if settings.shard_weights else ")"))
        for line in dit.load_notes:
            notes(line)
        if dit.config.vsa_gates:
            notes(VSA_NOTE)
        return dit, MemoryPlan(0, 0, False, 0, True), None

    config = TINY_DIT if source.tiny else with_config(dit_source).config
    read_linears = read_mode(settings.linears, bool(loras))
    quantize_later = source.tiny or read_linears != settings.linears
    if reader is None and not source.tiny:
        reader = DiTReader(dit_source, partition, settings.dtype, config, read_linears, device)
    plan = sampling_plan(config, dit_source, partition, settings, loras, largest_layout(conditioning), steps, reader)
    if device.type == "cuda":
        notes(f"memory: {plan.describe(config.num_layers)}")
        if plan.streams and fixed_allocator_segments():
            better = ("expandable_segments:True (the h3 command's default)" if EXPANDABLE_SEGMENTS
                      else "backend:cudaMallocAsync (no expandable segments here)")
            notes("memory: torch's allocator has fixed-size segments, so the plan keeps one block's activations "
                  f"spare for fragmentation; PYTORCH_CUDA_ALLOC_CONF={better} leaves more room for resident blocks")
    home = load_device(plan, device)
    if source.tiny:
        dit = tiny_random_dit(model_dtype(source, settings), home)
    else:
        warning = host_memory_warning(reader.nbytes, "The DiT") if home.type == "cpu" else None
        if warning:
            notes(f"memory: {warning}")
        dit = reader.read(home, on_tensor)
    lora_mode = run_mode(dit)  # merged, or hooked after the linears are made where the DiT holds stored ones
    if loras and lora_mode == "merge":
        _note_lines(notes, apply_loras(dit, loras, partition=partition, mode="merge", backup=False))
    if quantize_later:
        apply_linear_mode(dit, settings.linears, device)  # checked where it runs, not where it waits (home)
    if loras and lora_mode == "dynamic":
        _note_lines(notes, apply_loras(dit, loras, partition=partition, mode="dynamic"))
    if settings.linears != "checkpoint":
        notes(f"linears: {settings.linears} ({LINEAR_MODES[settings.linears]})")
    streamer = place(dit, device, plan)
    backend = dit.set_attention(settings.attention, settings.attention_window, settings.attention_window_dense_steps)
    notes(f"attention: {backend}" + (" (auto: the fastest exact kernel installed)" if settings.attention == "auto" else ""))
    if settings.attention_window:
        notes(f"attention window: {settings.attention_window} latent frames around each target video row (lossy)"
              + (f", full attention for the first {settings.attention_window_dense_steps} steps"
                 if settings.attention_window_dense_steps else ""))
    if config.vsa_gates:  # the DiT turns its Video Sparse Attention on itself
        notes(VSA_NOTE)
    if settings.compile:  # streaming hooks stay outside the compiled block forward
        dit.compile_blocks()
        notes("blocks compiled (the first step pays the compile)" if not (loras and lora_mode == "dynamic") else
              "blocks compiled, but those the LoRAs are hooked into run uncompiled: this DiT holds its linears as "
              "the file stores them, so LoRAs are hooked, not merged (--linears dense merges them, and compiles)")
    return dit, plan, streamer


def _check_vsa_student(settings: GenerateSettings) -> None:
    """A VSA-trained DiT runs its sparse attention with no other thinning of it."""
    if settings.attention_window:
        raise RequestError("This DiT carries Video Sparse Attention gates (FastH3 8-Step V2): its attention is sparse "
                           "already; drop --attention-window-lossy.")


def largest_layout(conditioning):
    """The packed layout the DiT sees at its largest: the request's, or a long video's biggest window."""
    if hasattr(conditioning, "layout"):
        return conditioning.layout
    return conditioning.largest_layout
