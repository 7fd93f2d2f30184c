"""H3 Save Latent / H3 Load Latent: an H3_LATENT as a .safetensors file ('video' [1, 24, L, h, w] and 'audio'
[2, 32, A]), the file `h3 generate --save-latents`, `h3 encode` and `AVLatents.save` write and read: a clip sampled
once can be decoded, extended or given its sound in another session, or moved between ComfyUI and the `h3`
command, without going through an MP4 (whose re-encoding loses detail)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import folder_paths
from comfy_api.latest import io, ui

from h3_core.output import AVLatents

from .common import (CATEGORY, SAVE_HIDDEN, H3Latent, PrefixCheckedSave, check_prefix, files_fingerprint,
                     files_under, reserved_output, saved_file_metadata)
from .convert import pack_latents, refuse_empty_latent, unpack_latents

KEPT_FACTS = ("seed", "task", "steps")  # the facts of a sampled latent its file keeps (as text)


def latent_files() -> list[str]:
    """The .safetensors files in ComfyUI's input folder and its subfolders, as paths relative to it."""
    found = files_under(folder_paths.get_input_directory())
    return [name.replace(os.sep, "/") for name in folder_paths.filter_files_extensions(found, [".safetensors"])]


def input_file(name) -> Path | None:
    """A latent file chosen from the list, inside the input folder (None: not there, not .safetensors, or it leads
    outside)."""
    if not isinstance(name, str) or not name.lower().endswith(".safetensors"):  # as the list matches them
        return None
    root = Path(folder_paths.get_input_directory()).resolve()
    path = (root / name).resolve()
    return path if path.is_relative_to(root) and path.is_file() else None


class H3SaveLatent(PrefixCheckedSave):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3SaveLatent",
            display_name="H3 Save Latent",
            category=CATEGORY,
            description="Saves an H3 latent (video and sound) as .safetensors in the output folder, as h3 generate "
                        "--save-latents does: decode, extend or re-sample it later without an MP4 in between. "
                        "H3 Load Latent reads it back from the input folder.",
            inputs=[
                H3Latent.Input("latent", tooltip="From H3 Dual-Clock Sampler, H3 Continuation or H3 VAE Encode."),
                io.String.Input("filename_prefix", default="H3/latent",
                                tooltip="File name prefix inside the output folder; a subfolder may be given."),
            ],
            outputs=[H3Latent.Output(display_name="latent", tooltip="The same latent, passed on.")],
            hidden=SAVE_HIDDEN,
            is_output_node=True,
        )

    @classmethod
    def execute(cls, latent, filename_prefix) -> io.NodeOutput:
        check_prefix(filename_prefix)
        refuse_empty_latent(latent)
        latents = unpack_latents(latent)
        facts = {key: latent[key] for key in KEPT_FACTS if latent.get(key) is not None}
        path, subfolder = save_latent_file(latents, filename_prefix,
                                           {**facts, **saved_file_metadata(cls.hidden, latents.num_frames)})
        saved = ui.SavedResult(os.path.basename(path), subfolder, io.FolderType.output)
        return io.NodeOutput(latent, ui={"latents": [saved]})


def save_latent_file(latents: AVLatents, prefix: str, facts: dict) -> tuple[str, str]:
    """`latents` as the next numbered `prefix` .safetensors file in the output folder, its canvas, length and
    `facts` in its metadata (text); (its path, its subfolder)."""
    width, height = latents.canvas
    folder, filename, counter, subfolder, _ = folder_paths.get_save_image_path(
        prefix, folder_paths.get_output_directory(), width, height)
    metadata = {"width": str(width), "height": str(height), "frames": str(latents.num_frames),
                **{key: str(value) for key, value in facts.items()}}
    # the name taken at once (another saver's file, or a link there, moves this one to the next counter)
    with reserved_output(folder, filename, counter, ".safetensors") as reserved:
        latents.save(reserved, metadata)
    return reserved, subfolder


def save_unfinished(clip: AVLatents, made: int, count: int, **facts) -> None:
    """A long run's clip so far, saved in the output folder (H3/unfinished_long_video_NNNNN_.safetensors) when the
    run stops in a later window (interrupted, out of memory): H3 Load Latent reads it into H3 Continuation's
    continue_from, which makes the rest. Said in the log; a failure to save is said too, never raised over the
    run's own error."""
    log = logging.getLogger("h3")
    try:
        reserved, _ = save_latent_file(clip, "H3/unfinished_long_video", {"windows": f"{made} of {count}", **facts})
    except Exception as error:  # a full disk, say: the run's own error is what the user must see
        log.warning("H3: the long video's finished windows could not be saved: %s", error)
        return
    if clip.resume is None:  # a driving track or a kept video: continue_from would make the rest of it anew
        log.warning("H3: the long video stopped after window %d of %d; those windows are saved as %s. A run with "
                    "drive_audio or keep_video cannot be continued from them: queue it again.", made, count, reserved)
        return
    log.warning("H3: the long video stopped after window %d of %d; those windows are saved as %s: move the file "
                "to the input folder and give it to H3 Continuation's continue_from (through H3 Load Latent), same "
                "duration and seed, to make the rest.", made, count, reserved)


class H3LoadLatent(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3LoadLatent",
            display_name="H3 Load Latent",
            category=CATEGORY,
            description="Reads an H3 latent file (.safetensors with 'video' and 'audio': from H3 Save Latent, h3 "
                        "generate --save-latents or h3 encode) from the input folder.",
            inputs=[
                io.Combo.Input("latent_file", options=latent_files(),
                               tooltip="A .safetensors latent file in ComfyUI's input folder (move a saved one "
                                       "there from the output folder)."),
            ],
            outputs=[
                H3Latent.Output(display_name="latent",
                                tooltip="The clip's latent: connect to H3 VAE Decode, H3 Save MP4, H3 Continuation's "
                                        "continue_from or keep_video, or H3 Dual-Clock Sampler's latent."),
                io.Int.Output(display_name="width", tooltip="The canvas width in pixels it decodes to."),
                io.Int.Output(display_name="height", tooltip="The canvas height in pixels it decodes to."),
                io.Int.Output(display_name="num_frames", tooltip="The frame count it decodes to, at 24 fps."),
            ],
        )

    @classmethod
    def validate_inputs(cls, latent_file=None) -> bool | str:
        """A file that is there, inside the input folder (the list may be older than the folder)."""
        if latent_file is None or input_file(latent_file) is not None:  # None: linked, known when it runs
            return True
        return f"No latent file {latent_file!r} in ComfyUI's input folder; refresh the list (R) or move it there."

    @classmethod
    def fingerprint_inputs(cls, latent_file=None) -> str:
        """The file as it is on disk now: saved over under the same name, it is read again."""
        path = input_file(latent_file)
        return files_fingerprint(path) if path else ""

    @classmethod
    def execute(cls, latent_file) -> io.NodeOutput:
        path = input_file(latent_file)
        if path is None:
            raise ValueError(f"No latent file {latent_file!r} in ComfyUI's input folder.")
        latents = AVLatents.load(path).check()
        facts = _kept_facts(path)
        width, height = latents.canvas
        latent = pack_latents(latents, width=width, height=height, **facts)
        return io.NodeOutput(latent, width, height, latents.num_frames)


def _kept_facts(path: Path) -> dict:
    """The seed, task and steps its saver wrote, where it wrote them (h3 encode's files have none)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as file:
        metadata = file.metadata() or {}
    facts = {key: metadata[key] for key in KEPT_FACTS if key in metadata}
    for key in ("seed", "steps"):
        if key in facts:
            try:
                facts[key] = int(facts[key])
            except ValueError:
                del facts[key]
    return facts


NODES = [H3SaveLatent, H3LoadLatent]
