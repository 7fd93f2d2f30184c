"""H3 Dual-Clock Sampler and H3 LoRA / Turbo Apply."""

from __future__ import annotations

import math
import weakref

import folder_paths
from comfy_api.latest import io
from h3_core.guides import check_guides_beside_kept
from h3_core.lora import check_loras, load_lora
from h3_core.noise import SEED_BITS, check_seeds
from h3_core.pipeline import TASK_PARTITION, sample
from h3_core.placement import freed_on_failure
from h3_core.sampler import DualClockSchedule, custom_ladder

from .common import (
    CATEGORY, H3Cond, H3Latent, H3Model, check_interrupt, files_fingerprint, preview_settings,
    progress_bar, range_problem, shift_inputs, shifts_problem, step_preview, steps_problem,
    wrong_link,
)
from .convert import latent_size_problem, pack_latents, unpack_latents
from .memory import dit_for_run, drop_loras, use_loras
from .model_folders import chosen_file

SIGMAS_TOOLTIP = ("Optional {what} sigma ladder (core SIGMAS, e.g. from ManualSigmas): strictly decreasing, at most "
                  "1.0, ending at 0.0; used as given. Overrides steps and the {what} shift; when only one ladder is "
                  "given, the other modality's automatic ladder gets as many points.")


KEEP_CHOICES = ("none", "video", "audio")
REFINE_WITHOUT_LATENT = ("denoise < 1 (or sigmas starting below 1.0) refines a latent: connect one from an H3 "
                         "sampler (an empty latent has nothing to refine), or set denoise to 1.0.")


def keep_without_latent(keep: str) -> str:
    return (f"keep = {keep} holds the {keep} of the connected latent: connect one with content (your clip through H3 "
            "VAE Encode, or a sampled one); an empty latent has none.")


def checked_sigmas(sigmas, what: str):
    """A SIGMAS input as a list, or a clear error naming the input (before any model moves)."""
    if sigmas is None:
        return None
    try:
        return custom_ladder(sigmas).tolist()
    except ValueError as error:
        raise ValueError(f"{what}: {error}") from None


class H3Sampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3Sampler",
            display_name="H3 Dual-Clock Sampler",
            category=CATEGORY,
            description="Denoises video and audio together on their own sigma ladders (the H3 flow sampler). "
                        "Several outputs come out as a list: the nodes after it run once per output.",
            inputs=[
                H3Model.Input("model", tooltip="From H3 Model Loader (optionally through H3 LoRA / Turbo Apply)."),
                H3Cond.Input("conditioning", tooltip="From H3 Conditioning."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True,
                             tooltip="Noise seed (one CPU generator: the same seed draws the same noise on every "
                                     "device; outputs agree closely, not bit for bit, across devices and dtypes). "
                                     "Output i uses seed + i. " + SEED_BITS),
                io.Int.Input("steps", default=0, min=0, max=200,
                             tooltip="Sampling points, counting the final 0: one more than the model calls (8 "
                                     "points = 7 calls); at least 2. 0 = automatic: a Turbo adapter's distilled "
                                     "count, else 50."),
                *shift_inputs(),
                io.Float.Input("denoise", default=1.0, min=0.01, max=1.0, step=0.01,
                               tooltip="1.0: generate from noise. Below 1: refine the connected latent, running the "
                                       "last steps of a ladder of steps / denoise points (automatic ladders only: with "
                                       "a Turbo adapter's own ladder or custom sigmas, start those lower instead)."),
                io.Int.Input("outputs", default=1, min=1, max=64,
                             tooltip="How many videos to make, with seeds seed, seed + 1, ...; they leave as a list. With "
                                     "control after generate on increment, the next run repeats all but one of "
                                     "these seeds: use randomize for new videos each run."),
                H3Latent.Input("latent", optional=True,
                               tooltip="Optional. From H3 Empty AV Latent: fixes the size, which must match the "
                                       "conditioning's. From a sampler: the latent to refine with denoise < 1 (or "
                                       "sigmas starting below 1). Unconnected: the conditioning's size, from noise."),
                io.Sigmas.Input("video_sigmas", optional=True, tooltip=SIGMAS_TOOLTIP.format(what="video")),
                io.Sigmas.Input("audio_sigmas", optional=True, tooltip=SIGMAS_TOOLTIP.format(what="audio")),
                io.Combo.Input("keep", options=list(KEEP_CHOICES), default="none", optional=True,
                               tooltip="With a latent connected (e.g. your clip through H3 VAE Encode): video = keep "
                                       "its video and make the sound for it (video-to-audio); audio = keep its "
                                       "sound and make a video to it (as a driving soundtrack does). The kept part "
                                       "comes back unchanged (decoding shows the VAE's reconstruction); not in "
                                       "the release's pipelines. none = generate both."),
            ],
            outputs=[H3Latent.Output(display_name="latent", is_output_list=True,
                                     tooltip="The sampled video + audio latents, one per output, as a list: to H3 "
                                             "VAE Decode, H3 Save MP4 or H3 Continuation's continue_from.")],
        )

    @classmethod
    def validate_inputs(cls, input_types=None, seed=None, steps=None, video_shift=None, audio_shift=None,
                        denoise=None, outputs=None, keep=None) -> bool | str:
        """A refinement or a kept part with no latent linked, one sigma point, a shift out of range and seeds past
        the generator's range are known at queue time: refused before the text encoder and the DiT run. Naming
        these inputs turns ComfyUI's own checks of them (range, choices, link types) off: redone here (a linked
        value is known when it runs)."""
        types = input_types if isinstance(input_types, dict) else {}
        problem = wrong_link(cls, types) or range_problem(cls, seed=seed, steps=steps, video_shift=video_shift,
                                                          audio_shift=audio_shift, denoise=denoise, outputs=outputs)
        problem = problem or steps_problem(steps) or shifts_problem(video_shift, audio_shift)
        if problem:
            return problem
        if isinstance(keep, str) and keep not in KEEP_CHOICES:
            return f"Value not in list: keep: '{keep}' not in {list(KEEP_CHOICES)}"
        if "latent" not in types and isinstance(denoise, (int, float)) and denoise < 1.0:
            return REFINE_WITHOUT_LATENT
        if "latent" not in types and isinstance(keep, str) and keep != "none":
            return keep_without_latent(keep)
        if isinstance(seed, int) and isinstance(outputs, int):
            try:
                check_seeds(seed, outputs)
            except ValueError as error:
                return str(error)
        return True

    @classmethod
    def execute(cls, model, conditioning, seed, steps, video_shift, audio_shift, denoise=1.0, outputs=1, latent=None,
                video_sigmas=None, audio_sigmas=None, keep="none") -> io.NodeOutput:
        wanted = TASK_PARTITION[conditioning.task]
        if wanted != model.partition:
            raise ValueError(f"{conditioning.task} runs on the {wanted} partition, but this model was loaded as "
                             f"{model.partition}; set the loader's partition to {wanted}.")
        # a linked number skipped validate_inputs' range check (0 outputs ran the DiT for nothing; 2.0 failed in
        # range() once the DiT was placed), a linked keep its choices
        problem = range_problem(cls, steps=steps, denoise=denoise, outputs=outputs)
        problem = problem or steps_problem(steps) or shifts_problem(video_shift, audio_shift)
        if not problem and keep not in KEEP_CHOICES:
            problem = f"Value not in list: keep: {keep!r} not in {list(KEEP_CHOICES)}"
        if problem:
            raise ValueError(problem)
        steps, outputs = int(steps), int(outputs)  # whole numbers by now; a linked 2.0 is 2
        check_seeds(seed, outputs)  # seed + i for every output, said before any model moves
        video_sigmas = checked_sigmas(video_sigmas, "video_sigmas")
        audio_sigmas = checked_sigmas(audio_sigmas, "audio_sigmas")
        if (video_sigmas is None) != (audio_sigmas is None):  # the automatic ladder walks as many points
            steps = len(video_sigmas or audio_sigmas)
        init = None
        if latent is not None:
            problem = latent_size_problem(latent, conditioning.width, conditioning.height, conditioning.num_frames)
            if problem:
                raise ValueError(problem)
            init = None if latent.get("empty") else unpack_latents(latent)
        starts_low = denoise < 1.0 or any(ladder and ladder[0] < 1.0 for ladder in (video_sigmas, audio_sigmas))
        if starts_low and init is None:
            raise ValueError(REFINE_WITHOUT_LATENT)
        keep = None if keep == "none" else keep
        if keep is not None and init is None:
            raise ValueError(keep_without_latent(keep))
        check_guides_beside_kept(conditioning.guides, keep)  # before any model moves

        dit = model.dit
        settings = model.sampler_settings(conditioning.task, steps or None, video_shift or None, audio_shift or None,
                                          video_sigmas, audio_sigmas)
        # a bad combination (denoise with explicit ladders, a bad shift) fails here, before any model moves
        DualClockSchedule.build(settings.steps, settings.video_shift, settings.audio_shift, settings.video_sigmas,
                                settings.audio_sigmas, denoise)
        previews = preview_settings()
        results = []
        # ComfyUI frees room, the engine plans with what is free (streaming blocks that do not fit), ours is placed
        with freed_on_failure(model.device), dit_for_run(model, conditioning.layout, settings.steps) as plan:
            try:
                use_loras(model)
                if model.split:  # rank 0 then sends each step's rows back for the preview
                    dit.previews = previews is not None
                bar = progress_bar(outputs * settings.steps)
                for index in range(outputs):
                    def on_step(state, done=index):
                        bar.update_absolute(done * state.total + state.step, outputs * state.total,
                                            step_preview(state, previews))
                        check_interrupt()

                    check_interrupt()
                    seed_i = int(seed) + index  # check_seeds kept it within the generator's range
                    latents = sample(dit, conditioning, seed_i, settings.steps, settings.video_shift,
                                     settings.audio_shift, settings.video_sigmas, settings.audio_sigmas,
                                     callback=on_step, init=init, denoise=denoise, keep=keep,
                                     offload_adaln=plan is not None and plan.offload_adaln)
                    results.append(pack_latents(latents, seed=seed_i, task=conditioning.task,
                                                steps=settings.steps, width=conditioning.width,
                                                height=conditioning.height))
            finally:
                drop_loras(model)
        return io.NodeOutput(results)


# LoRAs read, kept while anything (the model ComfyUI keeps as a node's output) holds them: a new strength reads
# no file unless it changed on disk (as ComfyUI's own LoRA loader keeps the last file it read)
_read_loras: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def read_lora(path: str, unknown_keys: str):
    key = (path, unknown_keys, files_fingerprint(path))
    lora = _read_loras.get(key)
    if lora is None:
        lora = _read_loras[key] = load_lora(path, unknown=unknown_keys)
    return lora


class H3LoRAApply(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3LoRAApply",
            display_name="H3 LoRA / Turbo Apply",
            category=CATEGORY,
            description="Adds a LoRA or Turbo adapter to an H3 model; chain several. A Turbo adapter's distilled "
                        "schedule becomes the sampler's automatic steps and shifts.",
            inputs=[
                H3Model.Input("model", tooltip="An H3 model (from the loader or another LoRA node)."),
                io.Combo.Input("lora_name", options=folder_paths.get_filename_list("loras"),
                               tooltip="A file from models/loras (any H3 LoRA layout, LyCORIS LoKr / LoHa and "
                                       "Comfy-Org Turbo exports too)."),
                io.Float.Input("strength", default=1.0, min=-10.0, max=10.0, step=0.01,
                               tooltip="Scale of the adapter's delta; Turbo adapters are distilled for 1.0."),
                io.Combo.Input("unknown_keys", options=["error", "warn"], default="error", optional=True,
                               tooltip="A file holding keys that name no H3 module (a LoRA for another model, or "
                                       "extra parts): error refuses it; warn loads the rest and says each in the log."),
            ],
            outputs=[H3Model.Output(display_name="model",
                                    tooltip="The model with this adapter added (hooked in while sampling): connect "
                                            "to H3 Dual-Clock Sampler, H3 Continuation or another LoRA node.")],
        )

    @classmethod
    def fingerprint_inputs(cls, lora_name=None, **_) -> str:
        """The file as it is on disk now: saved over under the same name (a new training epoch), it is read again
        with its schedule, instead of ComfyUI handing on the adapter read from the old one."""
        return files_fingerprint(path) if (path := chosen_file("loras", lora_name, "")) else ""

    @classmethod
    def execute(cls, model, lora_name, strength, unknown_keys="error") -> io.NodeOutput:
        if not math.isfinite(float(strength)):  # NaN passes ComfyUI's range check
            raise ValueError(f"strength must be a finite number, got {strength!r}.")
        lora = read_lora(folder_paths.get_full_path_or_raise("loras", lora_name), unknown_keys)
        # an adapter for the other partition or another model's shapes is refused here, before the DiT is read
        check_loras(model.dit.config if model.split else model.dit, [(lora, strength)], model.partition)
        return io.NodeOutput(model.with_lora(lora, strength))


NODES = [H3Sampler, H3LoRAApply]
