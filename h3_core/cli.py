"""The `h3` command line.

    h3 generate --prompt ... --out clip.mp4   prompt (+ keyframes / references) to an MP4
    h3 generate --long-video --duration 75 ... the same, window by window (latent-tail continuation)
    h3 generate --batch JOBS.txt ...          many requests, each model loaded once (a request a line)
    h3 encode VIDEO --out LATENTS            a video of yours as latents, for generate --continue-from
    h3 info PATH                             the H3 models a path holds (layouts, DiT config, sizes), from headers
    h3 denoise --model M ...                 the DiT's denoise alone, from precomputed text states
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
import math
import os
import re
import shlex
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from . import geometry, keymap
from .attention import EXACT_BACKENDS, LOSSY_BACKENDS, resolve_backend
from .local_attention import check_setting as check_window_setting
from .local_attention import dense_covers_run
from .checkpoint import CheckpointError, infer_config, locate_dit, with_config
from .config import TINY_DIT
from .conditioning import MAX_FRAMES, MIN_FRAMES, Conditioning, PartNames, Request, resolve_num_frames
from .continuation import DEFAULT_OVERLAP_FRAMES, DEFAULT_WINDOW_FRAMES
from .fp8 import LINEAR_MODES
from .guides import GUIDE_KINDS, GuideFile
from .layout import build_request_layout
from .long_video import LongVideoRequest
from .media import MediaError
from .media_write import DEFAULT_CRF
from .noise import SEED_BITS, check_seeds
from .output import AVLatents
from .parallel.workers import ParallelWorkerError
from .placement import check_devices
from .memory_plan import check_budget
from .pipeline import (MAX_OUTPUTS, MODEL_DTYPES, TINY_CANVAS, GenerateSettings, Job, ModelFiles, SamplingError,
                       check_output_name, check_writable, encode_clip_file, generate_batch, load_sampling_dit,
                       resolve_model_source, sample)
from .references import REFERENCE_IMAGE_MODES, MediaReference
from .runtime import GIB, compile_failed, return_freed_memory_to_os, use_expandable_segments
from .sampler import AUDIO_SHIFT, VIDEO_SHIFT, DualClockSchedule, check_shift
from .stage_bars import StageBars
from .text_checkpoint import all_model_names, checkpoint_layers, locate_text_encoder, source_tensor_names
from .tiny import TINY_RANDOM
from .vae_audio_checkpoint import locate_audio_vae
from .vae_video_checkpoint import locate_video_vae
from .weights import HEADER_DTYPES, read_headers

LINEARS_HELP = "; ".join(f"{name}: {what}" for name, what in LINEAR_MODES.items())
ATTENTION_HELP = (f"attention kernel: auto (the fastest exact one installed: FlashAttention 3 or 4 on Hopper/Blackwell "
                  f"for a bf16 / fp16 model, else sdpa), "
                  f"{', '.join(EXACT_BACKENDS)} (exact), {', '.join(LOSSY_BACKENDS)} (lossy, only when named)")
WINDOW_HELP = ("lossy speed-up, 0 = off: each target video row attends only the video within FRAMES latent frames "
               "(about 3.4 pixel frames each) of itself, plus every row before the target video (text, keyframes, "
               "references) and the audio; fast with FlashAttention 3 "
               "(8 frames: a compiled 5 s forward 3.8 s instead of 5.6 s on an H200), correct but slower on sdpa")
DENSE_HELP = ("with --attention-window-lossy: the first N model calls keep full attention (the noisiest steps set "
              "the layout; training-free sparse attention for video DiTs commonly keeps ~20%% of them dense); fewer "
              "than the run's model calls (--steps minus one); default 0")
DEFAULT_DURATION = 5.0  # seconds, as the release's pipelines
DEFAULT_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DEVICE_HELP = f"where the models run: cpu, cuda or cuda:N (default here: {DEFAULT_DEVICE})"
COMPILE_HELP = ("torch.compile the repeated block: ~10%% faster per step on an H200, the first step pays the compile; "
                "not bitwise exact")
STREAM_HELP = "a DiT that does not fit keeps its leading blocks on the GPU and streams the rest from CPU memory"


def main(argv: list[str] | None = None) -> int:
    if hasattr(sys.stdout, "reconfigure"):  # a name the output's encoding lacks (Windows' cp1252 when redirected)
        sys.stdout.reconfigure(errors="backslashreplace")  # is escaped, not an error once the run is done
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args, unknown = parser.parse_known_args(_negative_guides(argv))
    if unknown:  # said by the command's own parser, with its usage, and the option meant if one is close
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}{_unknown_hint(args.parser, unknown)}")
    # one device (worker processes keep torch's default); `h3 env` reports the user's own settings
    if "," not in (getattr(args, "devices", None) or "") and args.run is not run_env:
        use_expandable_segments()
    main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _stop) if main_thread else None  # a kill unwinds like Ctrl-C: no
    said = _WarningNotes()                                                  # half-written file is left behind
    for name in WARNING_LOGGERS:
        logging.getLogger(name).addHandler(said)
    levels = {name: logging.getLogger(name).level for name in NOTED_INFO_LOGGERS}
    for name in NOTED_INFO_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
    try:
        code = args.run(args)
        sys.stdout.flush()  # a closed pipe is met here, not at Python's exit
        return code
    except BrokenPipeError:  # what reads our output stopped (`h3 env | head`): nothing is left to say
        _quiet_stdout()
        return 1
    except SamplingError as error:  # the run itself failed (a ValueError too): 1, as a failed --batch job
        print(f"h3: error: {error}", file=sys.stderr)
        return 1
    except (CheckpointError, ValueError, OSError, MediaError) as error:  # LoRAError is a ValueError
        print(f"h3: error: {in_flags(str(error), argv)}", file=sys.stderr)
        return 2
    except ParallelWorkerError as error:  # names the rank, with its traceback
        if getattr(args, "compile", False) and error.compile_failed:
            return _compile_refused(error.summary)
        print(f"h3: error: {error}", file=sys.stderr)
        return 1
    except RuntimeError as error:
        if not (getattr(args, "compile", False) and compile_failed(error)):
            raise
        return _compile_refused(str(error))
    except KeyboardInterrupt:
        print("h3: stopped; nothing more was written.", file=sys.stderr)
        return 130
    finally:
        for name in WARNING_LOGGERS:
            logging.getLogger(name).removeHandler(said)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        if main_thread:
            signal.signal(signal.SIGTERM, before)


WARNING_LOGGERS = ("h3", "h3_core")  # the engine's loggers (placement, media, attention; h3_core.lora)


QUIET_HELP = ("no progress bars (for scripts and logs); warnings, errors and the result line are still printed")
NOTED_INFO_LOGGERS = ("h3_core.hub",)  # what a download is about to fetch (tens of GiB): said, not only logged


class _WarningNotes(logging.Handler):
    """The engine's warnings (and what a Hub download fetches) as the command's status lines ("h3: ..." above the
    progress bars) instead of Python's bare last-resort print; a LoRA's are left out: they are in the LoRA report
    the command prints."""

    def __init__(self):
        super().__init__(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("h3_core.lora"):
            return
        if record.levelno >= logging.WARNING or record.name in NOTED_INFO_LOGGERS:
            _note(record.getMessage().removeprefix("H3: "))


def _unknown_hint(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """' (did you mean --prompt?)' for the first unknown option that is a near miss of one of the command's, or
    the start of just one (abbreviations are not taken: --output once meant --outputs); for stray words first (the
    rest of an unquoted prompt, most often), how to quote a prompt."""
    options = list(parser._option_string_actions)
    for token in unknown:
        if token.startswith("--"):
            name = token.split("=", 1)[0]
            starts = [option for option in options if option.startswith(name)]
            near = starts if len(starts) == 1 else difflib.get_close_matches(name, options, n=1, cutoff=0.75)
            if near:
                return f" (did you mean {near[0]}?)"
    if "--prompt" in options and not unknown[0].startswith("-"):  # not an unknown option's value
        return ' (a prompt of several words goes in quotes: --prompt "a red fox runs")'
    return ""


def _negative_guides(argv: list[str]) -> list[str]:
    """`--guide -1:image=c.png` as `--guide=-1:image=c.png`: argparse takes a word after an option that starts with
    '-' for another option (and says only 'expected one argument'); a guide counted from the end starts so."""
    out = []
    for word in argv:
        if out and out[-1] == "--guide" and re.match(r"-\d+:", word):
            out[-1] = f"--guide={word}"
        else:
            out.append(word)
    return out


def _stop(signum, frame) -> None:
    raise KeyboardInterrupt


def _compile_refused(why: str) -> int:
    print(f"h3: error: --compile: torch.compile cannot build the DiT's blocks here ({why.strip().splitlines()[0]}); "
          "drop --compile (it only speeds the steps up).", file=sys.stderr)
    return 2


def add_dit_speed_options(parser: argparse.ArgumentParser) -> None:
    """How the DiT runs: every command that loads one takes these (and a machine serving ranks must be given
    the same as its caller)."""
    parser.add_argument("--attention", default="auto", help=ATTENTION_HELP)
    parser.add_argument("--compile", action="store_true", help=COMPILE_HELP)
    parser.add_argument("--attention-window-lossy", type=int, default=0, metavar="FRAMES", help=WINDOW_HELP)
    parser.add_argument("--attention-window-dense-steps", type=int, default=0, metavar="N", help=DENSE_HELP)
    parser.add_argument("--linears", default="checkpoint", choices=list(LINEAR_MODES), help=LINEARS_HELP)


def add_model_file_options(parser: argparse.ArgumentParser, text_encoder: bool = True) -> None:
    """The models that are not under --model: ComfyUI's single files, or any file or folder the loaders take."""
    if text_encoder:
        parser.add_argument("--text-encoder", type=Path, metavar="PATH",
                            help="the text encoder, when not under --model: e.g. ComfyUI's "
                                 "models/text_encoders/qwen3vl_32b_minimax_h3_bf16.safetensors (or its int8 or nvfp4 file, or a "
                                 "llama.cpp GGUF of its language model; keyframes and references need its mmproj file beside it)")
        parser.add_argument("--tokenizer", type=Path, metavar="DIR",
                            help="with a single --text-encoder file, which carries none: the release's FL2VA/tokenizer "
                                 "folder or FL2VA/ (default: --model's folder when it is one, else the release's tokenizer "
                                 "and processor, fetched once from the Hugging Face Hub: about 7 MiB)")
    parser.add_argument("--video-vae", type=Path, metavar="PATH",
                        help="the video VAE, when not under --model: e.g. models/vae/minimax_h3_video_vae_fp16.safetensors")
    parser.add_argument("--audio-vae", type=Path, metavar="PATH",
                        help="the audio VAE, when not under --model: e.g. models/vae/minimax_h3_audio_vae_fp32.safetensors")


def model_files(args) -> ModelFiles:
    return ModelFiles(getattr(args, "text_encoder", None), getattr(args, "tokenizer", None), args.video_vae,
                      args.audio_vae)


def add_generate_options(gen: argparse.ArgumentParser) -> None:
    """Everything `h3 generate` takes (a --batch line is parsed with the same options)."""
    models = gen.add_argument_group("models: --model, or the files that are not under it")
    models.add_argument("--model", default=TINY_RANDOM,
                        help=f"release root or partition folder, diffusers folder, Hub repo id, or '{TINY_RANDOM}' (default); "
                             "or a single DiT file (.safetensors or .gguf, e.g. ComfyUI's models/diffusion_models/...) with "
                             "--text-encoder, --video-vae and --audio-vae")
    add_model_file_options(models)
    request = gen.add_argument_group("the request")
    request.add_argument("--task", default="t2va", choices=["t2va", "fl2va", "ref2va"],
                         help="t2va (default): text to video with sound; fl2va: from a first and/or last keyframe "
                              "(--first-image, --last-image); ref2va: from references (--ref)")
    request.add_argument("--prompt", metavar="TEXT", help="the prompt (required, except with --long-video and --window-prompt: then "
                                          "the windows' prompts are all there is)")
    request.add_argument("--first-image", type=Path, metavar="IMAGE", help="fl2va: the first keyframe")
    request.add_argument("--last-image", type=Path, metavar="IMAGE", help="fl2va: the last keyframe")
    request.add_argument("--ref", action="append", default=[], metavar="KIND=PATH[@START]",
                         help="ref2va reference, repeatable and ordered: image=PATH, video=PATH, audio=PATH; "
                              "@START (seconds) picks where a video or audio clip starts")
    request.add_argument("--reference-images", choices=REFERENCE_IMAGE_MODES, default="release",
                         help="image references at the release's 2048-pixel short edge (default), or canvas-lossy: "
                              "scaled down to the output's pixel area (far fewer rows, faster steps, less detail)")
    request.add_argument("--guide", action="append", default=[], metavar="FRAME:KIND=PATH",
                         help="repeatable: an image, video (cut to its first 17n+5 frames, with its sound) or "
                              "audio file anchored at video frame FRAME (negative: from the end, written --guide=-1:image=b.png), "
                              "e.g. 60:image=a.png; with --long-video FRAME counts frames of the whole clip")
    request.add_argument("--aspect-ratio", metavar="RATIO", help=f"one of {', '.join(geometry.ASPECT_RATIOS)}, or auto: 16:9, for fl2va the "
                                                "keyframe's (the default)")
    request.add_argument("--width", type=int, metavar="PX", help="explicit width (multiple of 32; with --height)")
    request.add_argument("--height", type=int, metavar="PX", help="explicit height (multiple of 32; with --width)")
    request.add_argument("--duration", type=float, metavar="SECONDS",
                         help="seconds, 4-15, default 5 (snapped up to 17n+5 frames at 24 fps); with --long-video up to "
                              "300 (30 in full mode), default the --drive-audio track's length when one is given")
    long = gen.add_argument_group("long video, and clips of yours")
    long.add_argument("--long-video", action="store_true",
                      help="long video (t2va / ref2va): windows that each continue the previous one's latent tail")
    long.add_argument("--long-video-mode", choices=["continuation", "full"],
                      help="continuation (default, up to 300 s) or full: the whole clip as one window (up to 30 s)")
    long.add_argument("--window-frames", type=int, metavar="FRAMES", help="continuation window in frames, 17n+5 in 107..345 (default 277)")
    long.add_argument("--overlap-frames", type=int, metavar="FRAMES",
                      help="frames each window repeats from the one before as its guide, 17n+5 (default 22)")
    long.add_argument("--window-prompt", action="append", default=[], metavar="TEXT",
                      help="one prompt per window, repeatable, in window order (default: --prompt in every window)")
    long.add_argument("--continue-from", type=Path, metavar="LATENTS",
                      help="with --long-video: extend a clip saved with --save-latents or h3 encode (kept as it is; its canvas; "
                           "--duration counts the whole clip)")
    long.add_argument("--drive-audio", type=Path, metavar="PATH",
                      help="generate to this soundtrack: it becomes the output audio, held fixed while sampling "
                           "(cut or padded with silence to the duration; with --long-video and no --duration, all of "
                           "it); works with or without --long-video")
    long.add_argument("--keep", choices=["video", "audio"],
                      help="with --from: keep that part of the given clip and generate the other (video: the sound for "
                           "your video; audio: a video to your sound); its canvas and length; not in the release's "
                           "pipelines")
    long.add_argument("--from", dest="given", type=Path, metavar="LATENTS",
                      help="with --keep: a clip's latents from h3 encode (or --save-latents), 4-15 s; with "
                           "--long-video --keep video up to 300 s, its sound made window by window (for all of it, "
                           "or its first --duration seconds)")
    sampling = gen.add_argument_group("sampling")
    sampling.add_argument("--steps", type=int, metavar="N", help="sigma points including the final 0, 2-1000 (default 50 -> 49 model calls, "
                                                    "or what a Turbo adapter was distilled for)")
    sampling.add_argument("--video-shift", type=float, metavar="SHIFT", help=f"0.01-100, default {VIDEO_SHIFT:g} (or the Turbo adapter's)")
    sampling.add_argument("--audio-shift", type=float, metavar="SHIFT", help=f"0.01-100, default {AUDIO_SHIFT:g} (or the Turbo adapter's)")
    sampling.add_argument("--lora", action="append", default=[], metavar="PATH[:STRENGTH]",
                          help="LoRA / Turbo adapter (any published layout), repeatable; applied in order (merged; hooked on a quantized checkpoint); strength default 1")
    sampling.add_argument("--lora-unknown-keys", choices=["error", "warn"], default="error",
                          help="a LoRA holding keys that name no H3 module: refused (error, default) or loaded without "
                               "them, each said (warn)")
    sampling.add_argument("--seed", type=int, default=0, metavar="N", help="noise seed, 0 to 2^64-1 (default 0): the same seed gives "
                                                              "the same clip on any device. " + SEED_BITS)
    sampling.add_argument("--outputs", type=int, default=1, metavar="N", help=f"number of results, 1-{MAX_OUTPUTS}, seeds seed, seed+1, ...")
    output = gen.add_argument_group("outputs")
    output.add_argument("--out", "--output", type=Path, metavar="MP4", help="output .mp4 (several outputs: name_00000.mp4, ...)")
    output.add_argument("--save-latents", type=Path, metavar="LATENTS",
                        help="also save the final latents ('video', 'audio') as .safetensors (numbered _00000, _00001, "
                             "... with --outputs above 1, as --out is)")
    running = gen.add_argument_group("devices, speed and memory")
    running.add_argument("--device", default=DEFAULT_DEVICE, help=DEVICE_HELP)
    running.add_argument("--dtype", default=None, choices=list(MODEL_DTYPES),
                         help="model dtype (default: bf16 on GPU, fp32 on CPU)")
    running.add_argument("--vae-dtype", default=None, choices=list(MODEL_DTYPES),
                         help="video VAE dtype (default: --dtype's, as the reference pipeline: decoder linears in it, encoder "
                              "and norms fp32); fp32 decodes ~7.5x slower on an H200")
    running.add_argument("--crf", type=int, metavar="0-51",
                         help=f"the MP4's H.264 quality (default {DEFAULT_CRF}, visually lossless; 0 lossless, 51 worst; "
                              "each 6 more about halves the file)")
    add_dit_speed_options(running)
    running.add_argument("--gpu-memory", type=float, metavar="GIB",
                         help="GPU memory the text encoder, then the DiT, may use (default: what is free); " + STREAM_HELP
                              + ", a text encoder that does not fit streams its layers (with --device cpu: the DiT's "
                              "memory there, streamed the same way; with --devices: the text encoder's only, the split DiT "
                              "is not streamed)")
    running.add_argument("--devices", metavar="DEV,DEV[,...]",
                         help="split the DiT over several devices, e.g. cuda:0,cuda:1 (one worker process each, sequence "
                              "parallel; 2, 4, 7 or 8 of them; Linux: NCCL); the text encoder and VAEs run on the first "
                              "(replaces --device)")
    running.add_argument("--quiet", "-q", action="store_true", help=QUIET_HELP)
    batch = gen.add_argument_group("many requests")
    batch.add_argument("--batch", type=Path, metavar="FILE",
                       help="many requests with each model loaded once: a job a line, written as this command's request "
                            "options (--prompt, --task, --ref, --duration, --seed, --out, ...; # starts a comment); a line's "
                            "options override the command line's; the models, --steps and how the DiT runs are the "
                            "command line's, one DiT partition a batch; a job that fails while the batch runs is "
                            "skipped (the others still run; the command then exits 1)")
    batch.add_argument("--shard-weights", action="store_true",
                       help="with --devices: each device keeps 1/N of every block's weights and gathers a block just "
                            "before it runs (FSDP-style), so N smaller cards hold the model together")


class _Parser(argparse.ArgumentParser):
    """No abbreviated options: --output was taken for --outputs, and a new option could change what one meant."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="h3", description="MiniMax-H3 engine (h3_core).")  # its commands' parsers: the same class
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="prompt (+ keyframes / references) to an MP4 with sound")
    add_generate_options(gen)
    gen.set_defaults(run=run_generate, parser=gen)

    enc = sub.add_parser("encode", help="a video file (and its sound) to H3 latents: extend it with "
                                        "generate --long-video --continue-from")
    enc.add_argument("video", type=Path, help="any video PyAV reads (brought to 24 fps, cut to 17n+5 frames)")
    enc.add_argument("--out", "--output", type=Path, required=True, help="the latents, .safetensors")
    enc.add_argument("--model", help=f"where the VAEs are: as generate's --model (default {TINY_RANDOM}, or none "
                                      "with --video-vae and --audio-vae)")
    add_model_file_options(enc, text_encoder=False)
    enc.add_argument("--audio", type=Path, help="a sound to use instead of the video's soundtrack (default: the video's own; silence if it has none)")
    enc.add_argument("--width", type=int, help="canvas width (multiple of 32; with --height; default: the video's "
                                                "aspect ratio on the model's canvas)")
    enc.add_argument("--height", type=int, help="canvas height (multiple of 32; with --width)")
    enc.add_argument("--device", default=DEFAULT_DEVICE, help=DEVICE_HELP)
    enc.add_argument("--vae-dtype", default=None, choices=list(MODEL_DTYPES),
                     help="video VAE linears (default bf16; tiny-random on the CPU: fp32)")
    enc.add_argument("--quiet", "-q", action="store_true", help=QUIET_HELP)
    enc.set_defaults(run=run_encode, parser=enc)

    info = sub.add_parser("info", help="what H3 models a path holds (DiT, text encoder, VAEs), without loading them")
    info.add_argument("path", help="release root, partition folder, diffusers folder or single .safetensors (or "
                                   "DiT .gguf) file")
    info.add_argument("--partition", default="fl2va", choices=["fl2va", "ref2va"],
                      help="which DiT of a release to describe: fl2va (default; t2va and fl2va) or ref2va")
    info.set_defaults(run=run_info, parser=info)

    env = sub.add_parser("env", help="what this machine gives H3: versions, GPUs, attention kernels, media encoders, "
                                     "memory (JSON; paste it into a bug report)")
    env.set_defaults(run=run_env, parser=env)

    den = sub.add_parser("denoise", help="run the dual-clock denoise of a T2VA request and save the latents")
    den.add_argument("--model", default=TINY_RANDOM, help=f"checkpoint path or '{TINY_RANDOM}' (default)")
    den.add_argument("--partition", default="fl2va", choices=["fl2va", "ref2va"],
                     help="which DiT of a release root to load (default fl2va, the one T2VA runs on)")
    den.add_argument("--text-states", type=Path,
                     help="safetensors with 'prompt_embeds' [1, T, text_dim] (and optional 'text_token_tags' [T])")
    den.add_argument("--aspect-ratio",
                     help=f"one of {', '.join(geometry.ASPECT_RATIOS)} (default 16:9; on tiny-random, generate's "
                          "small canvas); or --width and --height")
    den.add_argument("--width", type=int, help="explicit width (multiple of 32; with --height)")
    den.add_argument("--height", type=int, help="explicit height (multiple of 32; with --width)")
    den.add_argument("--duration", type=float, default=5.0, help="seconds (snapped up to 17n+5 frames at 24 fps)")
    den.add_argument("--steps", type=int, default=50, help="sigma points including the final 0 (50 -> 49 model calls)")
    den.add_argument("--video-shift", type=float, default=VIDEO_SHIFT, help=f"0.01-100 (default {VIDEO_SHIFT:g})")
    den.add_argument("--audio-shift", type=float, default=AUDIO_SHIFT, help=f"0.01-100 (default {AUDIO_SHIFT:g})")
    den.add_argument("--seed", type=int, default=0, help="noise seed, 0 to 2^64-1 (default 0). " + SEED_BITS)
    den.add_argument("--save-latents", type=Path, required=True, help="output .safetensors: 'video' and 'audio'")
    den.add_argument("--device", default=DEFAULT_DEVICE, help=DEVICE_HELP)
    den.add_argument("--dtype", default=None, choices=list(MODEL_DTYPES),
                     help="model dtype (default: bf16 on GPU, fp32 on CPU; fp32 heads stay fp32)")
    add_dit_speed_options(den)
    den.add_argument("--gpu-memory", type=float, metavar="GIB",
                     help="GPU memory the DiT may use (default: what is free); " + STREAM_HELP)
    den.add_argument("--quiet", "-q", action="store_true", help=QUIET_HELP)
    den.set_defaults(run=run_denoise, parser=den)
    return parser


def _version() -> str:
    from .environment import package_version

    return package_version("comfyui-h3") or "(not installed)"  # a checkout run without installing


def _reference(spec: str) -> MediaReference:
    kind, sep, rest = spec.partition("=")
    if not sep or kind not in ("image", "video", "audio") or not rest:
        raise ValueError(f"--ref takes KIND=PATH with KIND image, video or audio; got {spec!r}.")
    path, at, start = rest.rpartition("@")  # no shell expands a '~' after KIND=: done here
    if not at or Path(rest).expanduser().exists():  # a file whose name holds '@' is that file
        return MediaReference(kind, Path(rest).expanduser(), 0.0)
    try:
        return MediaReference(kind, Path(path).expanduser(), float(start))
    except ValueError:
        raise ValueError(f"--ref {spec!r}: no such file, and the part after '@' is not a start time in "
                         "seconds.") from None


def _guide(spec: str) -> GuideFile:
    frame, sep, rest = spec.partition(":")
    kind, eq, path = rest.partition("=")
    try:
        index = int(frame)
    except ValueError:
        index = None
    if not sep or not eq or index is None or kind not in GUIDE_KINDS or not path:
        raise ValueError(f"--guide takes FRAME:KIND=PATH with an integer FRAME and KIND {', '.join(GUIDE_KINDS)}; "
                         f"got {spec!r}.")
    return GuideFile(index, kind, Path(path).expanduser())  # no shell expands a '~' after KIND=


def lora_option(spec: str) -> tuple[Path, float]:
    """--lora PATH[:STRENGTH]; a Windows drive's colon (C:\\loras\\a.safetensors) is the path's."""
    path, sep, strength = spec.rpartition(":")
    if not sep or Path(spec).exists():
        return Path(spec), 1.0
    try:
        return Path(path), float(strength)
    except ValueError:
        if path.endswith(".safetensors"):
            raise ValueError(f"--lora {spec!r}: the strength after ':' must be a number.") from None
        return Path(spec), 1.0


def _prompt(args) -> str:
    """--prompt, or with --long-video and --window-prompt but no --prompt the first window's prompt (each
    window then uses its own; the long-video plan checks their count)."""
    if args.prompt is not None:
        if args.long_video and args.window_prompt:
            _note("warning: every window samples its own --window-prompt; --prompt is not sampled, it only titles "
                  "the MP4 (drop it, or make it the first --window-prompt)")
        return args.prompt
    if args.long_video and args.window_prompt:
        return args.window_prompt[0]
    raise ValueError("Give --prompt TEXT (or, with --long-video, one --window-prompt TEXT per window).")


def _long_video(args, request: Request, kept: AVLatents | None = None) -> Request | LongVideoRequest:
    """--long-video and --drive-audio make a LongVideoRequest; without --long-video a driving track runs
    as one window within the usual 4-15 s. `kept`: the clip of --long-video --keep video --from."""
    options = {"--long-video-mode": args.long_video_mode, "--window-frames": args.window_frames,
               "--overlap-frames": args.overlap_frames, "--window-prompt": args.window_prompt or None,
               "--continue-from": args.continue_from}
    given = [name for name, value in options.items() if value is not None]
    if not args.long_video:
        if given:
            raise ValueError(f"{', '.join(given)}: only with --long-video.")
        if args.drive_audio is None:
            return request
        frames = resolve_num_frames(request.duration, long_video=request.names.long_video)  # a plain request: 4-15 s
        if args.duration is None:
            _note_longer_track(args.drive_audio, frames)
        return LongVideoRequest(request, mode="full", drive_audio=args.drive_audio)
    mode = args.long_video_mode or "continuation"
    if mode == "full" and (args.window_frames is not None or args.overlap_frames is not None):
        raise ValueError("--window-frames and --overlap-frames plan continuation windows; full mode is one window.")
    if args.drive_audio is not None and args.duration is None:  # as long as the track
        request = dataclasses.replace(request, duration=None)
    return LongVideoRequest(
        request, mode,
        DEFAULT_WINDOW_FRAMES if args.window_frames is None else args.window_frames,
        DEFAULT_OVERLAP_FRAMES if args.overlap_frames is None else args.overlap_frames,
        tuple(args.window_prompt), args.drive_audio,
        continue_from=None if args.continue_from is None else _saved_latents(args.continue_from), keep_video=kept,
    )


def _note_longer_track(track: Path, frames: int) -> None:
    """A driving track longer than the default clip it drives (no --duration, no --long-video): said, with how
    to use more of it. A file the header says nothing of (or that cannot be read, refused later) is not said."""
    from .media_read import probe

    try:
        info = probe(track)
    except (MediaError, OSError):
        return
    seconds = (info.audio and info.audio.duration_seconds) or info.duration_seconds
    if seconds and seconds * geometry.FPS > frames + geometry.FRAMES_PER_CHUNK:
        _note(f"warning: --drive-audio {track.name} lasts {seconds:.1f} s; this clip uses its first "
              f"{frames / geometry.FPS:.2f} s: give --duration (4-15 s), or --long-video for all of it.")


# The engine's refusals name its fields (the ComfyUI nodes' inputs); the command line says the option typed.
_FIELD_OPTIONS = {"aspect_ratio": "--aspect-ratio", "reference_images": "--reference-images",
                  "window_frames": "--window-frames", "overlap_frames": "--overlap-frames",
                  "frame_index": "--guide FRAME", "start_seconds": "@START"}
_LEADING_OPTIONS = {"steps": "--steps", "outputs": "--outputs", "crf": "--crf", "seed": "--seed",
                    "drive audio": "--drive-audio"}


def in_flags(message: str, typed: Sequence[str] = ()) -> str:
    """An engine message as the command line's user reads it: `aspect_ratio` (a guide's `frame_index`, a reference's
    `start_seconds`, ...) anywhere, and `steps`, `outputs`, `crf`,
    `seed`, `drive audio` opening it, become the option's name (one already named with its option is left).
    What the user typed (`typed`: the command line's words) stays as typed: a file named aspect_ratio.png or
    "seed 1.txt" is no option."""
    fields = (*_FIELD_OPTIONS, *_LEADING_OPTIONS)
    kept = sorted({part for word in typed for part in _typed_parts(str(word)) if any(f in part for f in fields)},
                  key=len, reverse=True)
    held: list[str] = []

    def hold(match: re.Match) -> str:
        held.append(match.group(0))
        return f"\0{len(held) - 1}\0"

    if kept:
        message = re.sub("|".join(map(re.escape, kept)), hold, message)
    for field, option in _FIELD_OPTIONS.items():
        message = re.sub(rf"\b{field}\b(?! \(--)", option, message)
    # "shard_weights (--shard-weights)": the engine's name for it, then the option's; the user typed the latter
    message = re.sub(r"\b([a-z][a-z_]*) \((--[a-z][a-z-]*)\)",
                     lambda match: match[2] if match[1].replace("_", "-") == match[2][2:] else match[0], message)
    for field, option in _LEADING_OPTIONS.items():
        if message.startswith(field + " ") or message.startswith(field + ":"):
            message = option + message[len(field):]
            break
    return re.sub(r"\0(\d+)\0", lambda match: held[int(match.group(1))], message)


def _typed_parts(word: str) -> set[str]:
    """A command-line word and the paths inside it (--opt=PATH, --ref KIND=PATH@START, --guide F:KIND=PATH), as
    typed and as a message shows a path (./ dropped, ~ expanded)."""
    parts = {word, *re.split(r"[=@]", word), *([word.split("=", 1)[1]] if "=" in word else [])}
    return {shown for part in parts if part for shown in (part, str(Path(part)), str(Path(part).expanduser()))}


def _not_a_file(path: Path) -> str:
    """Why a path given for a file cannot be read as one."""
    return "a folder, not a file." if path.is_dir() else "no such file."


def _saved_latents(path: Path, option: str = "--continue-from") -> AVLatents:
    """Latents written by --save-latents or h3 encode, checked before any model loads."""
    if not path.is_file():
        raise ValueError(f"{option} {path}: {_not_a_file(path)}")
    if path.suffix != ".safetensors":
        raise ValueError(f"{option} {path}: latents are a .safetensors file (from --save-latents or h3 encode).")
    try:
        return AVLatents.load(path).check()
    except (ValueError, OSError, SafetensorError) as error:
        raise ValueError(f"{option} {path}: {error}") from None


def _kept(args, request: Request) -> tuple[Request, AVLatents | None]:
    """--keep with --from: the request on the given clip's canvas and length, and the clip's latents."""
    if args.keep is None and args.given is None:
        return request, None
    if args.keep is None or args.given is None:
        raise ValueError("--keep video|audio and --from LATENTS go together: which part of which clip to keep.")
    if args.long_video and args.keep == "audio":
        raise ValueError("--long-video --keep audio: a long video is made to a sound of yours with --drive-audio "
                         "FILE (the sound file itself) instead.")
    # a long video keeps the whole clip or its first --duration seconds; one request the whole clip
    length = () if args.long_video else (("--duration", args.duration),)
    clashes = [name for name, value in (("--drive-audio", args.drive_audio), ("--continue-from", args.continue_from),
                                        ("--aspect-ratio", args.aspect_ratio), ("--width", args.width),
                                        ("--height", args.height), *length) if value is not None]
    if clashes:
        what = "canvas" if args.long_video else "canvas and length"
        raise ValueError(f"--keep takes the given clip's {what}: drop {', '.join(clashes)}.")
    given = _saved_latents(args.given, "--from")
    if args.long_video:  # on its canvas (long_video.LongVideoRequest.keep_video)
        return dataclasses.replace(request, duration=args.duration), given
    if given.num_frames > MAX_FRAMES:
        raise ValueError(f"--from {args.given}: the clip lasts {given.num_frames / geometry.FPS:.1f} s; one request "
                         f"keeps 4-15 s. Add --long-video to make its sound window by window.")
    if given.num_frames < MIN_FRAMES:
        raise ValueError(f"--from {args.given}: the clip lasts {given.num_frames / geometry.FPS:.2f} s; one request "
                         f"keeps 4-15 s (a clip of {MIN_FRAMES} frames or more).")
    width, height = given.canvas
    return dataclasses.replace(request, width=width, height=height, duration=None,
                               num_frames=given.num_frames), given


def run_encode(args) -> int:
    progress = StageBars(args.quiet)
    try:
        check_output_name("--out", args.out, ".safetensors")
        files = model_files(args)
        if args.model is not None and not args.model.strip():  # else "" ran the demo model on the user's clip
            raise ValueError(f"--model is empty; give a model path, a Hub repo id or {TINY_RANDOM} (or leave it out "
                             "with the model files' own options).")
        model = args.model or (None if files.given() else TINY_RANDOM)
        for option, path in (("the video", args.video), ("--audio", args.audio)):
            if path is not None and not Path(path).expanduser().is_file():
                raise FileNotFoundError(f"{option} {path}: {_not_a_file(Path(path).expanduser())}")
        latents = encode_clip_file(args.video, model, args.out, audio=args.audio, width=args.width,
                                   height=args.height, device=args.device,
                                   vae_dtype=MODEL_DTYPES[args.vae_dtype] if args.vae_dtype else None,
                                   progress=progress,
                                   files=files)
    finally:
        progress.close()
    width, height = latents.canvas
    print(f"{args.out}: {latents.num_frames} frames at {width}x{height} ({latents.num_frames / geometry.FPS:.2f} s)")
    return 0


def _check_dense_steps(args) -> None:
    if args.attention_window_dense_steps and not args.attention_window_lossy:
        raise ValueError("--attention-window-dense-steps counts the steps before --attention-window-lossy's window "
                         "starts; give the window too (or drop it).")


def run_generate(args) -> int:
    _check_dense_steps(args)
    devices = [d.strip() for d in (args.devices or "").split(",") if d.strip()]
    if args.devices is not None and len(devices) < 2:
        raise ValueError(f"--devices splits the DiT over two or more devices, got {args.devices!r}; for one, use "
                         "--device.")
    jobs = _batch_jobs(args) if args.batch is not None else [_job(args)]
    if args.crf is not None and all(job.out is None for job in jobs):  # else accepted and ignored
        raise ValueError(f"--crf {args.crf} sets the MP4's quality; this run writes no MP4 (no --out): drop it, or "
                         "give --out FILE.mp4.")
    return_freed_memory_to_os()
    # a bad name, a missing GPU or a split this machine cannot run: said now
    device = (check_devices(devices, split=True) if devices else check_devices([args.device]))[0]
    dtype = MODEL_DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    settings = GenerateSettings(args.seed, args.outputs, args.steps, args.video_shift, args.audio_shift,
                                str(device), dtype, args.attention, [lora_option(spec) for spec in args.lora],
                                lora_unknown_keys=args.lora_unknown_keys,
                                linears=args.linears, devices=devices, shard_weights=args.shard_weights,
                                gpu_memory=args.gpu_memory, compile=args.compile,
                                attention_window=args.attention_window_lossy,
                                attention_window_dense_steps=args.attention_window_dense_steps,
                                vae_dtype=MODEL_DTYPES[args.vae_dtype] if args.vae_dtype else None,
                                crf=DEFAULT_CRF if args.crf is None else args.crf)
    progress = StageBars(args.quiet)
    if device.type == "cuda":
        torch.cuda.init()  # the memory statistics need CUDA's state, and nothing has touched the GPU yet
        torch.cuda.reset_peak_memory_stats(device)
    failed = []  # --batch jobs that failed while the batch ran: said and skipped, the others still run

    def job_failed(name: str, job: Job, error: Exception) -> None:
        failed.append(f"{name} ({job.out or job.save_latents}): {type(error).__name__}: {error}")

    try:
        results = generate_batch(jobs, args.model, settings, progress,
                                 notes=_note, files=model_files(args),
                                 on_failure=job_failed if args.batch is not None else None)
    finally:
        progress.close()
    for result in results:
        written = result.video_path or result.latents_path
        stages = ", ".join(f"{name} {seconds:.2f}s" for name, seconds in result.seconds.items())
        width, height = result.latents.canvas  # the canvas an aspect ratio or a keyframe chose
        print(f"{written}: {result.task}, seed {result.seed}, {result.latents.num_frames} frames at {width}x{height}; "
              f"{stages}; "
              f"{_peak(device)}{' in this process (the DiT ran in the workers)' if devices else ''}")
    if failed:
        print(f"h3: {len(jobs) - len(failed)} of {len(jobs)} jobs done, {len(failed)} failed:", file=sys.stderr)
        for line in failed:
            print(f"h3:   {line}", file=sys.stderr)
        return 1
    return 0


def _quiet_stdout() -> None:
    """Standard output to the null device: Python's flush at exit would meet the closed pipe again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # not a file (a caller's capture): nothing to flush there
        pass


def _note(line: str) -> None:
    """A status line on stderr above the progress bars, not through them."""
    from tqdm import tqdm

    tqdm.write(f"h3: {line}", file=sys.stderr)


def option_names(references: int) -> PartNames:
    """The command's errors name the options that gave a request's parts (--first-image, --ref #2)."""
    return PartNames("--first-image", "--last-image", tuple(f"--ref #{index + 1}" for index in range(references)),
                     "--task", "with --long-video")


def _job(args) -> Job:
    """The request options of a generate command line (or of a --batch line over it) as one job."""
    if args.out is None and args.save_latents is None:
        raise ValueError("Give --out FILE.mp4 (and/or --save-latents FILE.safetensors).")
    if args.reference_images != "release" and args.task != "ref2va":  # else accepted and ignored
        raise ValueError(f"--reference-images {args.reference_images} sizes ref2va's image references; a "
                         f"{args.task} request has none: drop it.")
    request = Request(
        task=args.task, prompt=_prompt(args), first_image=args.first_image, last_image=args.last_image,
        references=[_reference(spec) for spec in args.ref], aspect_ratio=args.aspect_ratio,
        width=args.width, height=args.height, duration=DEFAULT_DURATION if args.duration is None else args.duration,
        guides=[_guide(spec) for spec in args.guide],
        reference_images=args.reference_images, names=option_names(len(args.ref)),
    )
    request, given = _kept(args, request)
    if args.long_video:  # the long request holds the kept clip
        request, given = _long_video(args, request, given), None
    else:
        request = _long_video(args, request)
    inputs = [(option, path) for option, path in (("--continue-from", args.continue_from), ("--from", args.given),
                                                  ("--batch", args.batch)) if path is not None]
    return Job(request, args.out, args.save_latents, args.seed, args.outputs, given,
               None if given is None else args.keep, inputs=inputs)


# What one --batch line may set; everything else (the models, how the DiT runs, the sampler ladder) is one
# for the whole batch and given on the command line.
JOB_OPTIONS = ("task", "prompt", "first_image", "last_image", "ref", "reference_images", "guide", "aspect_ratio",
               "width", "height", "duration", "long_video", "long_video_mode", "window_frames", "overlap_frames",
               "window_prompt", "continue_from", "drive_audio", "keep", "given", "seed", "outputs", "out",
               "save_latents")


class _NotGiven(list):
    """What an option holds before a --batch line gives it (a list, so repeatable options can append to it)."""


def _options_given(parser: argparse.ArgumentParser, tokens: list[str]) -> dict:
    """The generate options `tokens` give, by destination: parsed over a namespace in which every option is
    not given, so an option spelled with its default value still counts as given."""
    blank = argparse.Namespace(**{dest: _NotGiven() for dest in vars(parser.parse_args([]))})
    parsed = vars(parser.parse_args(tokens, namespace=blank))
    return {dest: value for dest, value in parsed.items() if not (isinstance(value, _NotGiven) and not value)}


class _QuietParser(_Parser):
    """A --batch line's parser: a bad line is the caller's error to word, without the whole usage text."""

    def error(self, message):
        raise ValueError(message)

    def parse_args(self, args=None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}{_unknown_hint(self, unknown)}")
        return parsed


# A batch line's words are split as a shell splits them; on Windows a backslash is a path's, not an escape
# (C:\clips\a.png), as in its own command prompt: a quote inside a prompt then takes the other kind of quotes.
BATCH_ESCAPE = "" if os.name == "nt" else "\\"


def _batch_words(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True)
    lexer.whitespace_split, lexer.commenters, lexer.escape = True, "", BATCH_ESCAPE
    return list(lexer)


def _without_comment(line: str) -> str:
    """A batch line without its comment: from a '#' that starts a word outside quotes, as in a shell
    (`--out take#2.mp4` and `--prompt "shot #2"` keep theirs)."""
    quote, escaped, word_start = None, False, True
    for index, char in enumerate(line):
        literal = escaped
        if escaped:
            escaped = False
        elif char in BATCH_ESCAPE and quote != "'":
            escaped = True
        elif quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and word_start:
            return line[:index]
        word_start = char.isspace() and not (quote or literal)
    return line


CANVAS_OPTIONS = ("aspect_ratio", "width", "height")


def _unless_replaced(given: dict) -> dict:
    """The command line's options that a --batch line's `given` ones replace as a whole, cleared: a line's canvas
    (a ratio, or width and height) replaces the command line's canvas, and a line keeping a clip of yours (--keep,
    --from) takes that clip's canvas and length."""
    cleared = CANVAS_OPTIONS if given.keys() & set(CANVAS_OPTIONS) else ()
    if given.keys() & {"keep", "given"}:
        cleared = (*CANVAS_OPTIONS, "duration")
    return dict.fromkeys(cleared)


def _batch_jobs(args) -> list[Job]:
    """--batch FILE: a job a line, written as the request options of an h3 generate command (blank lines and
    comments from #, as in a shell, skipped). A line's options override the command line's for that job."""
    path = args.batch
    if not path.is_file():
        raise ValueError(f"--batch {path}: " + ("a folder; give the jobs file." if path.is_dir() else "no such file."))
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors) is not part of line 1
    except UnicodeDecodeError as error:
        raise ValueError(f"--batch {path} is not UTF-8 text (byte {error.start}); save it as UTF-8.") from None
    parser = _QuietParser(prog="h3 generate --batch line", add_help=False)
    add_generate_options(parser)
    jobs = []
    for number, line in enumerate(text.splitlines(), 1):
        line = _without_comment(line)
        if not line.strip():
            continue
        where = f"--batch {path}, line {number}"
        try:
            given = _options_given(parser, _negative_guides(_batch_words(line)))
        except (ValueError, SystemExit) as error:
            raise ValueError(f"{where}: not the request options of an h3 generate command ({error}): "
                             f"{line.strip()}") from None
        shared = [dest for dest in given if dest not in JOB_OPTIONS]
        if shared:
            options = ", ".join("--" + dest.replace("_", "-") for dest in shared)
            raise ValueError(f"{where}: {options} appl{'ies' if len(shared) == 1 else 'y'} to the whole batch; give "
                             f"{'it' if len(shared) == 1 else 'them'} on the command line (a line "
                             f"takes {', '.join('--' + d.replace('_', '-') for d in JOB_OPTIONS if d != 'given')}, --from).")
        merged = argparse.Namespace(**{**vars(args), **_unless_replaced(given), **given})
        try:
            jobs.append(dataclasses.replace(_job(merged), name=where))
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
    if not jobs:
        raise ValueError(f"--batch {path} holds no jobs (a line each: --prompt ... --out FILE.mp4).")
    return jobs


def _peak(device: torch.device) -> str:
    if device.type == "cuda":
        return f"peak GPU {torch.cuda.max_memory_allocated(device) / GIB:.2f} GiB"
    try:
        import resource  # Unix only: on Windows the CPU line names no peak
    except ImportError:
        return "peak RSS not measured here"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return f"peak RSS {peak / (2**30 if sys.platform == 'darwin' else 2**20):.2f} GiB"


def run_env(args) -> int:
    from .environment import report

    print(json.dumps(report(), indent=2))
    return 0


def run_info(args) -> int:
    """Every H3 model at a path, from file headers only: the DiT (layout, config), the text encoder, the
    video VAE and the audio VAE (a release root or partition folder holds all four; a single file one, or a
    ComfyUI bundle both VAEs)."""
    if args.path == TINY_RANDOM:
        print(json.dumps(_tiny_info(), indent=2))
        return 0
    if not args.path.strip():
        raise ValueError("h3 info takes a path: a release root, a partition or diffusers folder, or a model file.")
    found, reasons = {}, []
    for kind, describe in (("dit", lambda path: _dit_info(path, args.partition)), ("text_encoder", _text_encoder_info),
                           ("video_vae", _video_vae_info), ("audio_vae", _audio_vae_info)):
        try:
            found[kind] = describe(args.path)
        except CheckpointError as error:
            reasons.append((kind.replace("_", " "), str(error)))
    if not found:
        if len({reason for _, reason in reasons}) == 1:  # e.g. a pickle: every reader says the same
            raise CheckpointError(f"{args.path} holds no H3 model: {reasons[0][1]}")
        raise CheckpointError(f"{args.path} holds no H3 model. " + " ".join(f"{k}: {r}" for k, r in reasons))
    print(json.dumps(found, indent=2))
    return 0


def _tiny_info() -> dict:
    """The four tiny-random models: made on the fly, so their sizes, not files."""
    from .text_checkpoint import TEXT_ENCODER_LAYER
    from .tiny import tiny_audio_vae_config
    from .tiny_text import TINY_TEXT_HIDDEN
    from .vae_video import TINY_VIDEO_VAE

    made = f"{TINY_RANDOM}: made on the fly from a fixed seed (no files), the real structure at tiny sizes"
    return {"dit": {"origin": made, "config": TINY_DIT.to_dict()},
            "text_encoder": {"origin": f"{made}; the embedded tiny tokenizer", "decoder_layers": TEXT_ENCODER_LAYER,
                             "hidden_size": TINY_TEXT_HIDDEN},
            "video_vae": {"origin": made, "config": dataclasses.asdict(TINY_VIDEO_VAE)},
            "audio_vae": {"origin": made, "config": dataclasses.asdict(tiny_audio_vae_config())}}


def _dit_config(path: str, partition: str):
    source = locate_dit(path, partition)
    return source, source.config or infer_config(source)


def _dit_info(path: str, partition: str) -> dict:
    source, config = _dit_config(path, partition)
    sizes = _gguf_sizes(source.gguf_tensors) if source.is_gguf else _sizes(source.files, keymap.is_dit_key)
    return {"origin": source.origin, "naming": source.naming, "qkv_layout": source.qkv_layout, **sizes,
            "config": config.to_dict()}


def _gguf_sizes(entries: dict) -> dict:
    """Files, tensors and GiB by GGML type of a GGUF file's tensors."""
    bytes_by_type: dict[str, int] = {}
    for entry in entries.values():
        bytes_by_type[entry.qtype] = bytes_by_type.get(entry.qtype, 0) + math.prod(entry.raw_shape)
    return {"files": 1, "tensors": len(entries),
            "gib_by_type": {k: round(v / GIB, 3) for k, v in sorted(bytes_by_type.items())}}


def _text_encoder_info(path: str) -> dict:
    source = locate_text_encoder(path)
    names = all_model_names(source_tensor_names(source))  # every layer the file holds
    if "language_model.embed_tokens.weight" not in names:
        raise CheckpointError(f"{path} holds no Qwen3-VL text encoder (no embed_tokens).")
    sizes = _gguf_sizes(source.gguf_tensors) if source.gguf_tensors else _sizes(source.files)
    return {"origin": source.origin, "decoder_layers": checkpoint_layers(names), **sizes,
            "vision_tower": source.vision_tower,
            **({"vision_tower_file": str(source.vision.path), "vision_tower_sizes": _gguf_sizes(source.vision.entries)}
               if source.vision is not None else {}),
            "tokenizer": None if source.tokenizer_folder is None else str(source.tokenizer_folder)}


def _video_vae_info(path: str) -> dict:
    source = locate_video_vae(path)
    return {"origin": source.origin, "naming": source.naming, **_sizes(source.files, _under(source.prefix))}


def _audio_vae_info(path: str) -> dict:
    source = locate_audio_vae(path)
    return {"origin": source.origin, **_sizes((source.file,), _under(source.prefix))}


def _under(prefix: str):
    return lambda key: key.startswith(prefix)


def _sizes(files, only=None) -> dict:
    """Files, tensors and GiB by dtype (safetensors' spelling) of the tensors `only(key)` takes (all: None)."""
    names = {dtype: name for name, dtype in HEADER_DTYPES.items()}
    count, bytes_by_dtype = 0, {}
    for key, tensor, _ in read_headers(files, only):
        name = names[tensor.dtype]
        bytes_by_dtype[name] = bytes_by_dtype.get(name, 0) + tensor.numel() * tensor.element_size()
        count += 1
    return {"files": len(files), "tensors": count,
            "gib_by_dtype": {k: round(v / GIB, 3) for k, v in sorted(bytes_by_dtype.items())}}


def _canvas(args) -> tuple[int, int]:
    if (args.width is None) != (args.height is None):
        raise ValueError("--width and --height go together; give both or neither (then --aspect-ratio is used).")
    if args.width is not None:
        if args.aspect_ratio is not None:
            raise ValueError(f"Give either --aspect-ratio ({args.aspect_ratio}) or --width and --height "
                             f"({args.width}x{args.height}), not both.")
        geometry.check_canvas(args.width, args.height)
        return args.width, args.height
    ratio = args.aspect_ratio or "16:9"
    if ratio not in geometry.ASPECT_RATIOS:  # auto, or a typo: the text states hold no picture to take one from
        raise ValueError(f"h3 denoise --aspect-ratio is one of {', '.join(geometry.ASPECT_RATIOS)} (or give --width "
                         f"and --height); got {ratio!r}.")
    if args.model == TINY_RANDOM:  # the small canvas generate gives it
        return geometry.canvas_size(ratio, TINY_CANVAS.short_edge, TINY_CANVAS.max_pixels)
    return geometry.canvas_size(ratio)


def _text_states(args, text_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    if args.text_states is not None:
        try:  # the two tensors alone: a model file given by mistake is not read whole
            with safe_open(str(args.text_states), "pt") as handle:
                names = list(handle.keys())
                tensors = {name: handle.get_tensor(name) for name in ("prompt_embeds", "text_token_tags")
                           if name in names}
        except (SafetensorError, OSError) as error:
            raise ValueError(f"--text-states {args.text_states} is not a readable safetensors file ({error}).") from None
        if "prompt_embeds" not in tensors:
            some = ", ".join(map(repr, names[:3])) or "none"
            raise ValueError(f"--text-states {args.text_states} has no 'prompt_embeds' tensor (it holds {len(names)}, "
                             f"e.g. {some}): give a text encoder's output saved with 'prompt_embeds' [1, T, D] "
                             "(text.TextConditioning.as_tensors()).")
        text = tensors["prompt_embeds"]
        if text.is_floating_point() and text.element_size() == 1:  # float8: no isfinite, no matmul; widened
            text = text.float()
        if text.ndim != 3 or text.shape[0] != 1 or text.shape[1] < 1 or text.shape[2] != text_dim:
            raise ValueError(f"'prompt_embeds' must be [1, T >= 1, {text_dim}] for this model, got {list(text.shape)}.")
        if not text.is_floating_point() or not bool(torch.isfinite(text).all()):  # else found after every step
            raise ValueError(f"--text-states {args.text_states}: 'prompt_embeds' must hold finite floating-point "
                             f"values, got {text.dtype}" + ("" if not text.is_floating_point() else " with NaN or "
                                                            "infinite ones") + ".")
        tags = tensors.get("text_token_tags", torch.ones(text.shape[1], dtype=torch.long))
        if tags.shape != (text.shape[1],):
            raise ValueError(f"--text-states {args.text_states}: 'text_token_tags' must be [T] = [{text.shape[1]}] "
                             f"as 'prompt_embeds', got {list(tags.shape)}.")
        odd = sorted({value for value in tags.tolist() if value not in (0, 1)})
        if odd:
            raise ValueError(f"--text-states {args.text_states}: 'text_token_tags' hold 1 (text) or 0 (rows of a vision "
                             f"block), got {', '.join(map(str, odd[:5]))}.")
        return text, tags.long()
    generator = torch.Generator().manual_seed(args.seed)
    return torch.randn(1, 16, text_dim, generator=generator), torch.ones(16, dtype=torch.long)


def run_denoise(args) -> int:
    """The DiT alone on a T2VA layout: `pipeline.sample` over precomputed (or, for tiny-random, seeded
    random) text states, the latents saved as `h3 generate --save-latents` saves them. The DiT is placed by
    the request's memory plan, as generate places it (streamed where it does not fit)."""
    device = check_devices([args.device])[0]
    dtype = MODEL_DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    width, height = _canvas(args)
    frames = resolve_num_frames(duration=args.duration, long_video="by `h3 generate --long-video`")  # not here
    for name, shift in (("--video-shift", args.video_shift), ("--audio-shift", args.audio_shift)):
        check_shift(shift, name, bounded=True)
    schedule = DualClockSchedule.build(args.steps, args.video_shift, args.audio_shift)  # a bad one fails first
    check_output_name("--save-latents", args.save_latents, ".safetensors")
    check_writable(args.save_latents)
    if not str(args.model).strip():  # else taken for a real model lacking text states
        raise ValueError(f"--model is empty; give a model path, a Hub repo id or {TINY_RANDOM}.")
    if args.model != TINY_RANDOM and args.text_states is None:
        raise ValueError("A real model needs --text-states (prompt embeddings); `h3 generate` runs the text encoder.")
    _check_dense_steps(args)
    check_window_setting(args.attention_window_lossy, args.attention_window_dense_steps)
    idle_window = dense_covers_run(args.attention_window_lossy, args.attention_window_dense_steps, schedule.num_calls)
    if idle_window:
        raise ValueError(f"{idle_window} (--attention-window-dense-steps)")
    # an unavailable backend (or one that cannot run the window) fails before any loading
    resolve_backend(args.attention, device, window=args.attention_window_lossy > 0, dtype=dtype)
    check_seeds(args.seed)
    check_budget(args.gpu_memory)
    if args.text_states is not None and not args.text_states.is_file():
        raise FileNotFoundError(f"--text-states {args.text_states}: {_not_a_file(args.text_states)}")
    source = resolve_model_source(args.model, args.partition, parts=())  # the DiT alone
    dit_source = None if source.tiny else with_config(locate_dit(source.root, args.partition))  # from headers
    config = TINY_DIT if source.tiny else dit_source.config
    text, tags = _text_states(args, config.text_dim)  # checked before the DiT loads
    pictured = int((tags == 0).sum())
    if pictured:  # states `h3 encode` made for an fl2va or ref2va prompt: the pictures' own rows are not here
        _note(f"warning: the text states hold {pictured} rows of pictures (an fl2va or ref2va prompt's); h3 denoise "
              "runs t2va, without the keyframes or references they show: `h3 generate` runs those tasks.")
    layout = build_request_layout(width, height, frames, tags)
    conditioning = Conditioning("t2va", width, height, frames, layout, text, tags)
    settings = GenerateSettings(device=str(device), dtype=dtype, attention=args.attention, linears=args.linears,
                                gpu_memory=args.gpu_memory, compile=args.compile,
                                attention_window=args.attention_window_lossy,
                                attention_window_dense_steps=args.attention_window_dense_steps)
    timings = {}

    started = time.perf_counter()
    bars = StageBars(args.quiet)
    try:
        model, _, streamer = load_sampling_dit(source, dit_source, args.partition, settings, (), conditioning,
                                               args.steps, _note, lambda done, total: bars("read DiT", done, total))
        backend = model.blocks[0].attn.backend
        timings["load"] = time.perf_counter() - started
        started = time.perf_counter()
        latents = sample(model, conditioning, args.seed, args.steps, args.video_shift, args.audio_shift,
                         callback=lambda state: bars("denoise", state.step, state.total))
    finally:
        bars.close()
    timings["denoise"] = time.perf_counter() - started
    if streamer is not None:
        streamer.remove()

    started = time.perf_counter()
    latents.save(args.save_latents, {"width": str(width), "height": str(height), "frames": str(frames),
                                     "seed": str(args.seed), "steps": str(args.steps), "model": str(args.model)})
    timings["save"] = time.perf_counter() - started
    print(_summary(args.save_latents, width, height, frames, timings, device) + f"; attention {backend}")
    return 0


def _summary(path, width, height, frames, timings, device) -> str:
    stages = ", ".join(f"{name} {seconds:.2f}s" for name, seconds in timings.items())
    return f"{path}: {width}x{height}, {frames} frames; {stages}; {_peak(device)}"


if __name__ == "__main__":
    raise SystemExit(main())
