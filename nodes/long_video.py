"""H3 Continuation (long video, optionally to a driving soundtrack), H3 Continuation Guide (images, clips
and sounds anchored at frames of the whole clip) and H3 Save MP4 (streamed decode).

A long clip cannot go through H3 VAE Decode: 300 s at 1344x768 is 89 GB of IMAGE frames. H3 Save MP4
decodes the latent chunk by chunk straight into the file (h3_core.output.write_mp4).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import folder_paths
from comfy_api.latest import InputImpl, io, ui

from h3_core import geometry
from h3_core.conditioning import EMPTY_PROMPT, MIN_FRAMES, Request, RequestError, blank
from h3_core.continuation import (
    DEFAULT_OVERLAP_FRAMES,
    DEFAULT_WINDOW_FRAMES,
    MAX_CONTINUATION_SECONDS,
    MAX_WINDOW_FRAMES,
    MIN_SECONDS,
    MIN_WINDOW_FRAMES,
    MODES,
    sampled,
)
from h3_core.long_video import (
    LONG_VIDEO_TASKS,
    LongVideoRequest,
    covers_track,
    encode_long_video,
    given_clips_clash,
    resume_seed_warnings,
    sample_long_video,
    sampled_prompt_warnings,
    split_window_prompts,
    validate_long_video,
)
from h3_core.media_write import DEFAULT_CRF
from h3_core.noise import SEED_BITS, check_seeds
from h3_core.output import write_mp4
from h3_core.pipeline import TASK_PARTITION, largest_layout
from h3_core.placement import freed_on_failure

from .common import (
    CATEGORY, SAVE_HIDDEN, H3VAE, H3Guides, H3Latent, H3Model, H3TextEncoder, LINK_HIDDEN, canvas_inputs,
    canvas_problem, check_interrupt, check_prefix, crf_input, decode_inputs, decode_options, decode_progress,
    device, devices_problem, preview_settings, prefix_problem, progress_and_interrupt, progress_bar, range_problem,
    refuse_empty_links, markers_problem, reserved_output, saved_file_metadata, shift_inputs, shifts_problem,
    step_preview, steps_problem,
)
from .conditioning import (UnreadVideoGuide, guide_media, guide_media_inputs, guide_source_problem, linked_media,
                           reference_images_input, reference_input, typed_reference_problem, validate_guide_links)
from .convert import (audio_to_decoded, build_request, media_problem, ordered_references, pack_latents,
                      refuse_empty_latent, refuse_extra_inputs, unpack_latents)
from .latent_files import save_unfinished
from .memory import decode_working_bytes, dit_for_run, drop_loras, place, place_for_encoding, use_loras

STEP = geometry.FRAMES_PER_CHUNK  # window and overlap stay on the 17n + 5 grid


class H3Continuation(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3Continuation",
            display_name="H3 Continuation (long video)",
            category=CATEGORY,
            description="A long video (up to 300 s), window by window: each window continues the latent tail of "
                        "the one before, with the prompt and references in every window. Optionally made to a "
                        "driving soundtrack, extending a clip already sampled (continue_from), or making the sound "
                        "for a clip of yours (keep_video). Decode with H3 Save MP4 (streamed).",
            inputs=[
                H3Model.Input("model", tooltip="From H3 Model Loader: fl2va partition for t2va, ref2va for ref2va."),
                H3TextEncoder.Input("text_encoder", tooltip="From H3 Text Encoder Loader."),
                io.String.Input("prompt", multiline=True, default="",
                                tooltip="What to generate, in every window (unless window prompts are given)."),
                io.Combo.Input("task", options=list(LONG_VIDEO_TASKS), default="t2va",
                               tooltip="t2va: prompt only. ref2va: image/video/audio references in every window."),
                io.Float.Input("duration", default=20.0, min=MIN_SECONDS, max=MAX_CONTINUATION_SECONDS, step=0.1,
                               tooltip="Seconds at 24 fps (snapped up to 17n + 5 frames): up to 300 in continuation "
                                       "mode, 30 in full mode."),
                io.Combo.Input("mode", options=list(MODES), default="continuation",
                               tooltip="continuation: windows that continue each other's tail. full: the whole clip "
                                       "as one window (up to 30 s; the sequence grows with the clip)."),
                io.Int.Input("window_frames", default=DEFAULT_WINDOW_FRAMES, min=MIN_WINDOW_FRAMES,
                             max=MAX_WINDOW_FRAMES, step=STEP,
                             tooltip="Frames per window, 17n + 5 (277 = 11.5 s); the last window may be shorter."),
                io.Int.Input("overlap_frames", default=DEFAULT_OVERLAP_FRAMES, min=5, max=MAX_WINDOW_FRAMES - STEP,
                             step=STEP,
                             tooltip="Frames each window repeats from the one before as its guide, 17n + 5."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True,
                             tooltip="Noise seed: all windows draw from one generator, so it decides the whole clip. "
                                     + SEED_BITS),
                io.Int.Input("steps", default=0, min=0, max=200,
                             tooltip="Sampling points per window; 0 = automatic: a Turbo adapter's count, else 50."),
                *shift_inputs(),
                *canvas_inputs("16:9, or the canvas of a clip connected to continue_from or keep_video"),
                io.String.Input("window_prompts", multiline=True, default="", optional=True,
                                tooltip="Optional: one prompt per window, in window order (empty: the prompt in every "
                                        "window): one per line, or, for prompts of several lines, separated by lines "
                                        "holding only ---. The count must match the plan's windows."),
                H3VAE.Input("vae", optional=True,
                            tooltip="From H3 VAE Loader; needed for references, a driving soundtrack and guides."),
                io.Audio.Input("drive_audio", optional=True,
                               tooltip="Optional driving soundtrack: it becomes the output audio, held fixed while "
                                       "the video is generated to it, for its first `duration` seconds (all of it "
                                       f"when shorter; one under {MIN_FRAMES / geometry.FPS:.2f} s is padded with "
                                       "silence to the duration)."),
                reference_input(),
                H3Guides.Input("guides", optional=True,
                               tooltip="From H3 Continuation Guide: images, clips and sounds at frames of the whole "
                                       "clip, each given to the window that makes its frames; needs the vae."),
                H3Latent.Input("continue_from", optional=True,
                               tooltip="Optional: a clip to extend (from H3 Dual-Clock Sampler or another H3 "
                                       "Continuation), kept as it is; the windows continue from its end on its "
                                       "canvas, and duration counts the whole clip, it included."),
                H3Latent.Input("keep_video", optional=True,
                               tooltip="Optional: a clip whose video is kept while its sound is made, window by window "
                                       "(from H3 VAE Encode of your video, or a sampler) on its canvas (leave the "
                                       "aspect ratio on auto), for its first `duration` seconds (all of it when "
                                       "longer). Not one of the release's pipelines: judge it on real clips."),
                reference_images_input(),
            ],
            outputs=[
                H3Latent.Output(display_name="latent",
                                tooltip="The whole clip as one H3 latent (continue_from included): connect to H3 "
                                        "Save MP4 (streamed), or another H3 Continuation's continue_from."),
                io.Int.Output(display_name="num_frames",
                              tooltip="The whole clip's frame count at 24 fps (continue_from included)."),
            ],
            hidden=LINK_HIDDEN,
        )

    @classmethod
    def validate_inputs(cls, input_types=None, task=None, references=None, prompt=None, window_prompts=None,
                        width=None, height=None, duration=None, mode=None, window_frames=None,
                        overlap_frames=None, steps=None, video_shift=None, audio_shift=None) -> bool | str:
        """What is wired, an empty prompt, a canvas the model cannot make and a window plan that cannot be made
        are known before anything runs (the model loader included): a node error at queue time. ComfyUI still
        checks the other inputs' ranges and options (the two prompts are texts: no range; `canvas_problem` and
        `range_problem` redo the named numbers'); its link-type check, off for every input once `input_types`
        is named, is redone by `linked_media`."""
        types, kinds, problem = linked_media(cls, input_types)
        problem = (problem or typed_reference_problem(references, types)
                   or canvas_problem(width, height, zero="from the aspect ratio"))
        # said beside the others, as ComfyUI says its own range errors beside a node's
        ranged = (range_problem(cls, duration=duration, window_frames=window_frames, overlap_frames=overlap_frames,
                                steps=steps, video_shift=video_shift, audio_shift=audio_shift)
                  or steps_problem(steps) or shifts_problem(video_shift, audio_shift))
        texts = (prompt, window_prompts or "")  # a linked one (None) is known when the node runs
        if not problem and "window_prompts" not in types and all(isinstance(t, str) and blank(t) for t in texts):
            problem = EMPTY_PROMPT
        if not problem:  # the text encoder's picture markers in either, as the engine refuses them
            problem = markers_problem(prompt) or markers_problem(window_prompts, "window_prompts")
        problem = problem or given_clips_clash(*(name in types for name in ("continue_from", "drive_audio",
                                                                             "keep_video")))
        if not problem and task is not None:  # a linked task is checked when the node runs
            problem = _task_problem(task) or media_problem(task, kinds, 0)  # naming task turns ComfyUI's check off
        encoded = [name for name, given in (("references", kinds), ("drive_audio", "drive_audio" in types),
                                             ("guides", "guides" in types)) if given]
        if not problem and encoded and "vae" not in types:
            problem = f"The VAEs encode {' and '.join(encoded)}: connect H3 VAE Loader's vae."
        if not (problem or ranged) and not {"continue_from", "keep_video"} & set(types):  # else the clip's length
            problem = _plan_problem(duration, mode, window_frames, overlap_frames,
                                    None if "window_prompts" in types else window_prompts)
        return " ".join(said for said in (problem, ranged) if said) or True

    @classmethod
    def execute(cls, model, text_encoder, prompt, task, duration, mode, window_frames, overlap_frames, seed, steps,
                video_shift, audio_shift, aspect_ratio, width, height, window_prompts="", vae=None, drive_audio=None,
                references=None, guides=None, continue_from=None, reference_images="release",
                keep_video=None, **extra) -> io.NodeOutput:
        refuse_extra_inputs(extra)
        refuse_empty_links(cls.hidden, vae=vae, drive_audio=drive_audio, guides=guides, continue_from=continue_from,
                           keep_video=keep_video,
                           **{f"references.{slot}": value for slot, value in (references or {}).items()})
        # linked numbers skipped validate_inputs' checks: a NaN window, 201 steps or a seed of -1 are refused here,
        # before the text encoder and the DiT are placed
        problem = (_task_problem(task) or range_problem(cls, duration=duration, window_frames=window_frames,
                                                        overlap_frames=overlap_frames, steps=steps,
                                                        video_shift=video_shift, audio_shift=audio_shift)
                   or steps_problem(steps) or shifts_problem(video_shift, audio_shift))
        if not problem and not isinstance(window_prompts or "", str):
            problem = f"window_prompts must be text (one line per window); got {type(window_prompts).__name__}."
        if problem:
            raise ValueError(problem)
        steps = int(steps)  # a whole number by now; a linked 2.0 is 2
        check_seeds(seed)
        wanted = TASK_PARTITION[task]
        if wanted != model.partition:
            raise ValueError(f"{task} runs on the {wanted} partition, but this model was loaded as "
                             f"{model.partition}; set the loader's partition to {wanted}.")
        problem = media_problem(task, [kind for _, kind, _ in ordered_references(references)], 0)
        if problem:
            raise ValueError(problem)
        if continue_from is not None and continue_from.get("empty"):
            raise ValueError("continue_from holds an empty latent (H3 Empty AV Latent): connect a sampled one, from "
                             "H3 Dual-Clock Sampler or H3 Continuation.")
        given = None if continue_from is None else unpack_latents(continue_from)
        if keep_video is not None and keep_video.get("empty"):
            raise ValueError("keep_video holds an empty latent (H3 Empty AV Latent): connect your clip's, from H3 VAE "
                             "Encode.")
        kept = None if keep_video is None else unpack_latents(keep_video)
        if kept is not None and duration * geometry.FPS >= kept.num_frames:
            duration = None  # the whole clip
        drive = None if drive_audio is None else audio_to_decoded(drive_audio, "drive_audio")
        if drive is not None and duration is not None and covers_track(duration, drive, mode):
            duration = None  # the whole track
        if guides and vae is None:
            raise ValueError("Guides are encoded with the VAE: connect H3 VAE Loader's vae to H3 Continuation.")
        with freed_on_failure(device()):
            request = LongVideoRequest(
                build_request(task, prompt, None, None, references, aspect_ratio, width, height, duration,
                              reference_images),
                mode, int(window_frames), int(overlap_frames), split_window_prompts(window_prompts or ""),
                drive, tuple(guides or ()),
                given, kept,
            )
            request = _with_video_guides_read(request, text_encoder.canvas)
            validate_long_video(request, text_encoder.canvas)  # every limit and the plan, before any model moves
            if request.window_prompts and not blank(prompt):
                logging.getLogger("h3").warning("H3: every window samples its own line of window_prompts; the prompt "
                                                "box is not sampled (clear it, or make it the first window's line).")
            # said as h3 generate says them
            for warning in sampled_prompt_warnings(request) + resume_seed_warnings(request, [int(seed)]):
                logging.getLogger("h3").warning("H3: %s", warning)
            cond = encode_long_video(request, text_encoder.encoder, None if vae is None else vae.video,
                                     None if vae is None else vae.audio, rules=text_encoder.canvas,
                                     between_calls=check_interrupt, on_stage=progress_and_interrupt(),
                                     before_models=functools.partial(place_for_encoding, text_encoder, vae))

        dit = model.dit
        settings = model.sampler_settings(task, steps or None, video_shift or None, audio_shift or None)
        previews = preview_settings()
        # placed by the engine's plan for the largest window, as the sampler places it
        with freed_on_failure(model.device), dit_for_run(model, largest_layout(cond), settings.steps) as plan:
            try:
                use_loras(model)
                if model.split:  # rank 0 then sends each step's rows back for the preview
                    dit.previews = previews is not None
                bar = progress_bar(len(sampled(cond.windows)) * settings.steps)

                def on_step(state):  # the window being made: its middle frame
                    bar.update_absolute(state.step, state.total, step_preview(state, previews))
                    check_interrupt()

                finished = []  # the clip so far after each window but the last: saved if a later one stops

                def keep(clip, made, count):
                    finished[:] = [(clip, made, count)]

                check_interrupt()
                try:
                    latents = sample_long_video(dit, cond, int(seed), settings.steps, settings.video_shift,
                                                settings.audio_shift, settings.video_sigmas, settings.audio_sigmas,
                                                callback=on_step, offload_adaln=plan is not None and plan.offload_adaln,
                                                on_window=keep)
                except BaseException:
                    if finished:
                        save_unfinished(*finished.pop(), seed=int(seed), task=task, steps=settings.steps)
                    raise
            finally:
                drop_loras(model)
        latent = pack_latents(latents, seed=int(seed), task=task, steps=settings.steps, width=cond.width,
                              height=cond.height)
        return io.NodeOutput(latent, latents.num_frames)


def _plan_problem(duration, mode, window_frames, overlap_frames, window_prompts) -> str | None:
    """The windows the widgets plan (and a window prompt for each, when they are typed in), as the run will
    plan them (long_video.validate_long_video), at queue time; None where a value is linked."""
    if None in (duration, mode, window_frames, overlap_frames):
        return None
    prompts = split_window_prompts(window_prompts) if isinstance(window_prompts, str) else ()
    try:
        validate_long_video(LongVideoRequest(Request("t2va", "a plan", duration=duration), mode, int(window_frames),
                                             int(overlap_frames), prompts))
    except RequestError as error:
        return str(error)
    return None


def _with_video_guides_read(request: LongVideoRequest, rules) -> LongVideoRequest:
    """`request` with its VIDEO guides read onto the canvas its plan gives, only as far as the clip goes."""
    if not any(isinstance(guide, UnreadVideoGuide) for guide in request.guides):
        return request
    plan = validate_long_video(dataclasses.replace(request, guides=()), rules)
    return dataclasses.replace(request, guides=tuple(
        guide.read((plan.width, plan.height), plan.num_frames) if isinstance(guide, UnreadVideoGuide) else guide
        for guide in request.guides))


def _task_problem(task) -> str | None:
    return None if task in LONG_VIDEO_TASKS else f"task must be one of {', '.join(LONG_VIDEO_TASKS)}; got {task!r}."


class H3ContinuationGuide(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3ContinuationGuide",
            display_name="H3 Continuation Guide",
            category=CATEGORY,
            description="Anchors an image, a short clip or a sound at a frame of a long video (H3 Continuation); "
                        "chain several.",
            inputs=[
                io.Int.Input("frame_index", default=0, min=-9999, max=9999,
                             tooltip="The frame of the whole clip (24 fps: 240 = 10 s) the image, or the clip's "
                                     "first frame, and the sound start at; negative counts from the end (-1 = the "
                                     "last frame). A clip must end in the window it starts in."),
                *guide_media_inputs(),
                H3Guides.Input("guides", optional=True, tooltip="Guides so far, from another H3 Continuation Guide."),
            ],
            outputs=[H3Guides.Output(display_name="guides",
                                     tooltip="The guides so far with this one added: connect to H3 Continuation's "
                                             "guides, or to another H3 Continuation Guide.")],
            hidden=LINK_HIDDEN,
        )

    @classmethod
    def validate_inputs(cls, input_types=None) -> bool | str:
        return validate_guide_links(cls, input_types)

    @classmethod
    def execute(cls, frame_index, image=None, audio=None, video=None, guides=None) -> io.NodeOutput:
        refuse_empty_links(cls.hidden, image=image, audio=audio, video=video, guides=guides)
        # checked against the clip and its windows by H3 Continuation, before any model moves
        if video is None:
            guide = guide_media(frame_index, image, audio)
        else:  # read by H3 Continuation, which knows the canvas and how far the clip goes
            problem = guide_source_problem(image is not None, audio is not None, True)
            if problem:
                raise ValueError(problem)
            if audio is not None:
                audio_to_decoded(audio, "audio")  # a bad sound is said here, at its own node
            guide = UnreadVideoGuide(int(frame_index), video, audio)
        return io.NodeOutput((*(guides or ()), guide))


class H3SaveMP4(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3SaveMP4",
            display_name="H3 Save MP4 (streamed)",
            category=CATEGORY,
            description="Decodes an H3 latent chunk by chunk straight into an MP4 (H.264 + AAC, 24 fps) in the "
                        "output folder, never holding the whole clip's frames: for long videos.",
            inputs=[
                H3VAE.Input("vae", tooltip="From H3 VAE Loader."),
                H3Latent.Input("latent", tooltip="From H3 Continuation or H3 Dual-Clock Sampler."),
                io.String.Input("filename_prefix", default="H3/long",
                                tooltip="File name prefix inside the output folder; a subfolder may be given."),
                *decode_inputs(),
                crf_input(),
            ],
            outputs=[io.Video.Output(display_name="video",
                                     tooltip="The MP4 just saved, as a ComfyUI VIDEO read from its file, for nodes "
                                             "that take a VIDEO (e.g. Get Video Components).")],
            hidden=SAVE_HIDDEN,
            is_output_node=True,
        )

    @classmethod
    def validate_inputs(cls, filename_prefix=None, devices=None) -> bool | str:
        """The file name and the decode's devices, at queue time: before the long work above it runs."""
        return prefix_problem(filename_prefix) or devices_problem(devices) or True

    @classmethod
    def execute(cls, vae, latent, filename_prefix, tiling="release", devices="", crf=DEFAULT_CRF) -> io.NodeOutput:
        check_prefix(filename_prefix)
        refuse_empty_latent(latent)
        tiled, decode_devices = decode_options(tiling, devices)
        latents = unpack_latents(latent)
        width, height = latents.canvas
        folder, filename, counter, subfolder, _ = folder_paths.get_save_image_path(
            filename_prefix, folder_paths.get_output_directory(), width, height)
        on_sound, on_frames = decode_progress(latents.num_frames)
        place([vae.patcher], decode_working_bytes(vae, latents.video, tiled))
        with freed_on_failure(vae.device), reserved_output(folder, filename, counter) as reserved:
            path = write_mp4(reserved, latents, vae.video, vae.audio, on_frames=on_frames,
                             devices=decode_devices, tiled=tiled, crf=crf,
                             metadata=saved_file_metadata(cls.hidden, latents.num_frames), on_sound=on_sound)
        file = path.name  # another where a program holds that name open (Windows)
        preview = ui.PreviewVideo([ui.SavedResult(file, subfolder, io.FolderType.output)])
        return io.NodeOutput(InputImpl.VideoFromFile(str(path)), ui=preview)


NODES = [H3Continuation, H3ContinuationGuide, H3SaveMP4]
