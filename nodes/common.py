"""What every H3 node shares: the category, the socket types, ComfyUI's device and progress services."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
from pathlib import Path

import torch
from comfy_api.latest import io

from h3_core import geometry
from h3_core.conditioning import EMPTY_PROMPT, RequestError, blank, check_prompt_markers
from h3_core.media import SAMPLE_RATE
from h3_core.media_write import DEFAULT_CRF, remove_dead_writes
from h3_core.pipeline import MODEL_DTYPES
from h3_core.sampler import AUDIO_SHIFT, MAX_SHIFT, VIDEO_SHIFT, check_shift
from h3_core.weights import SAFETENSORS_SUFFIXES

CATEGORY = "H3"
H3Model = io.Custom("H3_MODEL")
H3TextEncoder = io.Custom("H3_TEXT_ENCODER")
H3VAE = io.Custom("H3_VAE")
H3Cond = io.Custom("H3_COND")
H3Latent = io.Custom("H3_LATENT")
H3Guides = io.Custom("H3_GUIDES")

DTYPES = {**MODEL_DTYPES, "checkpoint": None}  # "checkpoint": as the file stores its weights


def device() -> torch.device:
    import comfy.model_management as mm

    return mm.get_torch_device()


def vae_device() -> torch.device:
    """Where ComfyUI runs VAEs: its device, or the CPU when started with --cpu-vae."""
    import comfy.model_management as mm

    return mm.vae_device()


def check_interrupt() -> None:
    import comfy.model_management as mm

    mm.throw_exception_if_processing_interrupted()


def progress_bar(total: int):
    import comfy.utils

    return comfy.utils.ProgressBar(total)


def progress_and_interrupt():
    """An engine loop's `(done, total)` callback: ComfyUI's progress bar (made at the first call: a node whose
    loop never runs shows none) moved when the count moves, then its interrupt checked on every call (a raise
    there stops the loop; a video reference's clips are reported with the count unchanged)."""
    bar, shown = None, 0

    def report(done: int, total: int) -> None:
        nonlocal bar, shown
        bar = bar or progress_bar(total)
        if done != shown:
            bar.update_absolute(done, total)
            shown = done
        check_interrupt()

    return report


def decode_progress(frames: int):
    """(on_sound, on_frames) for a decode: one progress bar over the soundtrack's windows, then the frames (two
    bars in a row took ComfyUI's from 100% back to 1% inside one node)."""
    report = progress_and_interrupt()
    windows = [0]

    def on_sound(done: int, total: int) -> None:
        windows[0] = total
        report(done, total + frames)

    def on_frames(done: int, total: int) -> None:
        report(windows[0] + done, windows[0] + total)

    return on_sound, on_frames


def model_choices(kind: str, also: tuple[str, ...] = (), unless: str | None = None) -> list[str]:
    """'tiny-random' first, then the files ComfyUI lists for `kind` (diffusion_models, text_encoders, ...) and
    those of its folders ending in `also` (ComfyUI lists its own weight suffixes only: GGUF files are not), but
    for those whose name holds `unless` (llama.cpp's mmproj files: companions, not models)."""
    import folder_paths

    from h3_core.tiny import TINY_RANDOM

    names = set(folder_paths.get_filename_list(kind))
    if also:
        for folder in folder_paths.get_folder_paths(kind):
            found = files_under(folder)
            names.update(name for name in folder_paths.filter_files_extensions(found, also)
                         if unless is None or unless not in Path(name).name.lower())
    return [TINY_RANDOM] + sorted(names)


# folder -> (its files, each directory's mtime); a key per folder ComfyUI names (its model folders and input folder)
_walked: dict[str, tuple[list[str], dict[str, float]]] = {}


def files_under(folder: str) -> list[str]:
    """ComfyUI's recursive_search of `folder`, walked again only when one of its directories changed (a file
    added, removed or renamed), as ComfyUI's own file lists are: the loaders' schemas list GGUF files on ComfyUI's
    server thread at every queue, and walking a large or network model folder each time stalls it."""
    import folder_paths

    walked = _walked.get(folder)
    if walked is None or not _unchanged(walked[1]):
        walked = _walked[folder] = folder_paths.recursive_search(folder, excluded_dir_names=[".git"])
    return walked[0]


def _unchanged(mtimes: dict[str, float]) -> bool:
    """Whether every directory still has its recorded mtime (none recorded: a folder not there, looked for again)."""
    try:
        return bool(mtimes) and all(os.path.getmtime(directory) == mtime for directory, mtime in mtimes.items())
    except OSError:
        return False


WEIGHT_SUFFIXES = (*SAFETENSORS_SUFFIXES, ".gguf", ".json")


def files_fingerprint(*paths) -> str:
    """Name, modification time and size of each weight file at `paths` (a folder: its weight and config files
    up to four levels down, as a release root holds them: FL2VA/video_vae/source/model.safetensors): a loader's
    `fingerprint_inputs`, so a file saved
    over under the same name (a new training epoch, a finished re-download) loads again instead of ComfyUI
    handing on the model read from the old one. Empty for what is not there: execute says so. A digest of
    those stamps: ComfyUI keeps the value in the prompt our saved files embed, where the paths, names and sizes
    would tell anyone holding the file what the server's folders hold."""
    stamps = []
    for path in map(Path, paths):
        try:
            found = (sorted(file for depth in ("*", "*/*", "*/*/*", "*/*/*/*") for file in path.glob(depth)
                            if file.suffix.lower() in WEIGHT_SUFFIXES and file.is_file())
                     if path.is_dir() else [path] if path.is_file() else [])
            for file in found:
                stat = file.stat()
                stamps.append(f"{file} {stat.st_mtime_ns} {stat.st_size}")
        except OSError:  # unreadable: execute says so
            continue
    return hashlib.sha256("; ".join(stamps).encode()).hexdigest() if stamps else ""


def preview_settings():
    """(max_size, factors, bias) for step previews, or None when the user turned previews off. The colours
    come from ComfyUI's own H3 latent format where this ComfyUI has one; else h3_core's false colour."""
    from comfy.cli_args import LatentPreviewMethod, args

    if args.preview_method == LatentPreviewMethod.NoPreviews:
        return None
    import comfy.latent_formats as formats

    known = getattr(formats, "MiniMaxH3Video", None)
    factors = getattr(known, "latent_rgb_factors", None) if known else None
    bias = getattr(known, "latent_rgb_factors_bias", None) if known else None
    return args.preview_size, factors, bias


def step_preview(state, previews):
    """A step's preview for ComfyUI's progress bar, ("JPEG", picture, max size): the clean-video estimate of
    the middle frame being made. None when previews are off or no video is made (a kept video)."""
    if previews is None or state.video_rows is None or state.layout.locked_modality == "video":
        return None
    from PIL import Image

    from h3_core.preview import latent_rgb

    size, factors, bias = previews
    return "JPEG", Image.fromarray(latent_rgb(state.video_estimate_frame(), factors, bias)), size


TILING = {"release": None, "off": False}  # None: the VAE config's (the release's: tiled)


@contextlib.contextmanager
def reserved_output(folder: str, filename: str, counter: int, suffix: str = ".mp4"):
    """The output file `{filename}_{counter:05}_{suffix}` (the next counter where that name is taken), created empty
    at once so that another ComfyUI writing the same folder counts it: an MP4 is written for minutes under a hidden
    name, and two savers that picked one name replaced each other's clip. Removed again if the body fails, or
    leaves it empty (the clip kept as `name (1).mp4`); a killed saver's leftovers of this prefix go first."""
    remove_dead_writes(Path(folder), f"{filename}_")
    while True:
        path = os.path.join(folder, f"{filename}_{counter:05}_{suffix}")
        try:
            with open(path, "x"):
                break
        except FileExistsError:
            counter += 1
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            if os.path.getsize(path) == 0:  # still our placeholder: a failed body, or the file kept elsewhere
                os.unlink(path)


def crf_input():
    """The saved MP4's H.264 quality (x264's constant-quality number)."""
    return io.Int.Input("crf", default=DEFAULT_CRF, min=0, max=51, optional=True,
                        tooltip=f"H.264 quality: {DEFAULT_CRF} (default) looks lossless; 0 is lossless, but in a "
                                "profile browsers (and so ComfyUI's preview) and many players do not play; 51 the "
                                "worst; each 6 more about halves the file.")


def decode_inputs() -> list:
    """How a node decodes video latents: spatial tiling, and the devices that share the clips."""
    return [
        io.Combo.Input("tiling", options=list(TILING), default="release", optional=True,
                       tooltip="release: each frame decoded in overlapping 256 px tiles, blended (the release's "
                               "setting, least memory). off: whole frames at once, no tile seams, more memory."),
        io.String.Input("devices", default="", optional=True,
                        tooltip="Empty: ComfyUI's device. Two or more (e.g. cuda:0,cuda:1): the video's clips are "
                                "decoded on all of them at once, a VAE copy on each (about 5.6 GB in bf16); the "
                                "frames equal a one-device decode."),
    ]


DECODE_DEVICES_PURPOSE = "share the decode"


def decode_options(tiling: str, devices: str) -> tuple[bool | None, list[torch.device] | None]:
    """The decode inputs as h3_core takes them: (tiled, devices or None); a bad value is refused."""
    if tiling not in TILING:
        raise ValueError(f"tiling must be one of {', '.join(TILING)}, got {tiling!r}.")
    return TILING[tiling], device_list(devices, DECODE_DEVICES_PURPOSE) or None


def devices_problem(devices) -> str | None:
    """What a decode's *devices* text gets refused for, for validate_inputs (None: fine, or linked)."""
    try:
        if isinstance(devices, str):
            device_list(devices, DECODE_DEVICES_PURPOSE)
    except ValueError as error:
        return str(error)
    return None


def device_list(text: str, purpose: str) -> list[torch.device]:
    """A node's *devices* text (comma-separated) as devices: none, or two or more that exist here."""
    from h3_core.placement import check_devices

    names = [name.strip() for name in (text or "").split(",") if name.strip()]
    try:
        parsed = [torch.device(name) for name in names]
    except RuntimeError:
        raise ValueError(f"devices: {text!r} is not a list of device names such as cuda:0,cuda:1.") from None
    if len(names) == 1:
        raise ValueError(f"devices: {names[0]} alone is one device; list two or more to {purpose} "
                         "(e.g. cuda:0,cuda:1), or leave it empty for ComfyUI's device.")
    return check_devices(parsed)


SAVE_HIDDEN = [io.Hidden.prompt, io.Hidden.extra_pnginfo]  # what a saving node embeds in its file
LINK_HIDDEN = [io.Hidden.prompt, io.Hidden.unique_id]  # what `refuse_empty_links` reads


NOTHING_MEANS_MISSING = ("GetVideoComponents",)  # nodes whose None output is media a clip lacks (its sound)


def refuse_empty_links(hidden, **given) -> None:
    """ComfyUI hands execute None both for an unconnected input and for one linked to an output that holds
    nothing: the node's inputs in the queued prompt (a link is a [node, output] pair) tell the two apart. From
    Get Video Components (the audio of a video without sound) it is refused: a soundtrack the artist wired
    would be left out unseen. From any other node (a switch with its inputs muted: a way to turn an input off)
    the run goes on without it, saying so in the log."""
    prompt = getattr(hidden, "prompt", None)
    prompt = prompt if isinstance(prompt, dict) else {}
    node = prompt.get(str(getattr(hidden, "unique_id", None)))
    inputs = node.get("inputs", {}) if isinstance(node, dict) else {}
    for name, value in given.items():
        link = inputs.get(name)
        if value is None and isinstance(link, list) and link:
            source = (prompt.get(str(link[0])) or {}).get("class_type")
            if source in NOTHING_MEANS_MISSING:
                raise ValueError(f"{name} is connected, but {source} gave nothing for it (the audio of a video "
                                 f"without sound?): connect one that holds it, or disconnect {name}.")
            logging.getLogger("h3").warning("%s is connected, but %s gave nothing: running without it.", name,
                                            source or "the node feeding it")


MAX_NAME_BYTES = 255  # a file or folder name, on the file systems ComfyUI runs on
MAX_PREFIX_NAME_BYTES = 200  # a file name is at most 255 bytes, and the counter adds "_00001_.mp4"


def prefix_problem(prefix) -> str | None:
    """What is wrong with a save node's filename_prefix (None: nothing, or it is linked, so not known yet): at
    queue time, not after the sampling and decoding above the node (an over-long name failed only then); a
    linked one is checked by `check_prefix` when the node runs."""
    if not isinstance(prefix, str):
        return None
    *folders, name = prefix.replace("\\", "/").split("/")
    if name.strip() in ("", ".", ".."):
        return (f"filename_prefix {prefix!r} names no file (it is empty or ends in a folder); give a name after "
                "any folder, e.g. H3/clip.")
    if len(name.encode()) > MAX_PREFIX_NAME_BYTES:
        return (f"filename_prefix's file name is {len(name.encode())} bytes long; at most {MAX_PREFIX_NAME_BYTES} "
                "(the counter and .mp4 follow it, and a file name holds 255).")
    long_folder = next((folder for folder in folders if len(folder.encode()) > MAX_NAME_BYTES), None)
    if long_folder is not None:
        return (f"filename_prefix's folder name {long_folder[:40]!r}... is {len(long_folder.encode())} bytes long; "
                f"a folder name holds at most {MAX_NAME_BYTES}.")
    # ComfyUI's save path refuses a folder outside its output folder, but only when the node saves
    folder = os.path.normpath(os.path.join("output", os.path.dirname(os.path.normpath(prefix))))
    if os.path.isabs(prefix) or not (folder == "output" or folder.startswith("output" + os.sep)):
        return (f"filename_prefix {prefix!r} leads outside ComfyUI's output folder (an absolute path, or '..' past "
                "it); give a name inside it, e.g. H3/clip.")
    return None


class PrefixCheckedSave(io.ComfyNode):
    """A save node whose filename_prefix is checked at queue time, before the long work above it runs."""

    @classmethod
    def validate_inputs(cls, filename_prefix=None) -> bool | str:
        return prefix_problem(filename_prefix) or True


def check_prefix(prefix) -> None:
    """`prefix_problem` as an error, for a save node's execute: a linked filename_prefix is known only then."""
    problem = prefix_problem(prefix)
    if problem:
        raise ValueError(problem)


def saved_file_metadata(hidden, num_frames: int) -> dict[str, str]:
    """A saved file's metadata (MP4 tags, safetensors metadata): a comment, and (as ComfyUI's own save nodes
    do, unless it runs with --disable-metadata) the prompt and the workflow as JSON, so dropping an MP4 on the
    canvas brings the graph back."""
    from comfy.cli_args import args

    tags = {"comment": f"MiniMax-H3, {num_frames} frames at {geometry.FPS} fps, {SAMPLE_RATE} Hz audio"}
    if hidden is None or args.disable_metadata:
        return tags
    if hidden.prompt is not None:
        tags["prompt"] = json.dumps(hidden.prompt)
    for key, value in (hidden.extra_pnginfo or {}).items():
        tags[key] = json.dumps(value)
    return tags


def shift_inputs() -> list:
    """The video and audio sigma shifts, as every sampling node takes them (0 = automatic)."""
    return [
        io.Float.Input("video_shift", default=0.0, min=0.0, max=MAX_SHIFT, step=0.1,
                       tooltip=f"Video sigma shift; 0 = automatic: the Turbo contract's, else {VIDEO_SHIFT:g}."),
        io.Float.Input("audio_shift", default=0.0, min=0.0, max=MAX_SHIFT, step=0.1,
                       tooltip=f"Audio sigma shift; 0 = automatic: the Turbo contract's, else {AUDIO_SHIFT:g}."),
    ]


def prompt_problem(prompt, what: str = "The prompt") -> str | None:
    """A prompt with nothing to read, or holding the text encoder's picture markers, as the engine refuses it
    (None: fine, or linked and known when the node runs): said at queue time, before the encoder loads."""
    if isinstance(prompt, str) and blank(prompt):
        return EMPTY_PROMPT
    return markers_problem(prompt, what)


def markers_problem(text, what: str = "The prompt") -> str | None:
    """Text holding the text encoder's picture markers, as the engine refuses it (None: none, or not yet known)."""
    if not isinstance(text, str):
        return None
    try:
        check_prompt_markers(text, what)
    except RequestError as error:
        return str(error)
    return None


def steps_problem(steps) -> str | None:
    """One sigma point is no step: said at queue time (0 is automatic)."""
    if steps == 1:
        return ("steps counts sigma points including the final 0, so 2 is one model call; got 1. Set at least 2, "
                "or 0 for the automatic count.")
    return None


def shifts_problem(video_shift, audio_shift) -> str | None:
    """A shift set by hand (0 is automatic) within what the command line allows too."""
    for name, shift in (("video_shift", video_shift), ("audio_shift", audio_shift)):
        if isinstance(shift, (int, float)) and shift:
            try:
                check_shift(shift, name, bounded=True)
            except ValueError as error:
                return f"{str(error).rstrip('.')} (0 = automatic)."
    return None


def canvas_inputs(auto: str) -> list:
    """Aspect ratio, or explicit width and height (0 = from the ratio); `auto` says what auto means."""
    return [
        io.Combo.Input("aspect_ratio", options=["auto", *geometry.ASPECT_RATIOS], default="auto",
                       tooltip=f"Canvas shape. auto: {auto}. Ignored when width and height are set."),
        io.Int.Input("width", default=0, min=0, max=geometry.MAX_CANVAS_EDGE, step=32,
                     tooltip="Canvas width in pixels (multiple of 32); 0 = from the aspect ratio."),
        io.Int.Input("height", default=0, min=0, max=geometry.MAX_CANVAS_EDGE, step=32,
                     tooltip="Canvas height in pixels (multiple of 32); 0 = from the aspect ratio."),
    ]


def canvas_problem(width, height, zero: str | None = None) -> str | None:
    """The width and height widgets at queue time (None: linked, known when the node runs). Naming them in
    validate_inputs turns ComfyUI's own min/max check off for them, so this is that check and the model's
    (multiples of 32, each side at most 4096, 1:4 to 4:1). `zero` says what 0 means where 0 is allowed."""
    if width is None or height is None:
        return None
    if zero is not None and not width and not height:
        return None
    if zero is not None and (not width or not height):
        return f"Give width and height together, or both 0 ({zero}); got {width}x{height}."
    try:
        geometry.check_canvas(int(width), int(height))
    except (TypeError, ValueError) as error:
        return str(error)
    return None


def wrong_link(node_class, input_types) -> str | None:
    """A node whose validate_inputs asks for `input_types` turns ComfyUI's own link-type check off for all its
    inputs: the same check, with ComfyUI's own rule, against the socket types of the node's schema."""
    from comfy_execution.validation import validate_node_input

    takes = socket_types(node_class)
    for name, kind in (input_types if isinstance(input_types, dict) else {}).items():
        wanted = takes.get(name)
        if wanted and not validate_node_input(kind, wanted):
            return f"{name} takes {wanted}, got {kind}."
    return None


def range_problem(node_class, **values) -> str | None:
    """ComfyUI's own min/max check of number widgets, which naming them in validate_inputs turns off (None: a
    linked value, known when the node runs), against the node's schema, in ComfyUI's words; a linked value, which
    ComfyUI checks not at all, must also be a number (a whole one for an INT input), and not NaN."""
    inputs = {port.id: port for port in node_class.define_schema().inputs}
    for name, value in values.items():
        low, high = getattr(inputs[name], "min", None), getattr(inputs[name], "max", None)
        if value is None:
            continue
        whole = inputs[name].get_io_type() == "INT"
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
        if not number or whole and (math.isinf(value) or value != int(value)):
            return f"{name} must be {'a whole number' if whole else 'a number'} from {low} to {high}; got {value!r}."
        if low is not None and value < low:
            return f"{name}: Value {value} smaller than min of {low}."
        if high is not None and value > high:
            return f"{name}: Value {value} bigger than max of {high}."
    return None


def socket_types(node_class) -> dict[str, str]:
    """Each input's socket type in a node's schema (read at every call, not cached: ComfyUI validates a fresh
    copy of the class each time, which a cache keyed on it would keep alive, one per queued prompt)."""
    return {port.id: port.get_io_type() for port in node_class.define_schema().inputs}
