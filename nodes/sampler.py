"""H3 Dual-Clock Sampler and H3 LoRA / Turbo Apply."""

from __future__ import annotations

import folder_paths
from comfy_api.latest import io

from h3_core.lora import apply_loras, load_lora, remove_loras, sampler_settings
from h3_core.pipeline import TASK_PARTITION, sample

from .common import CATEGORY, H3Cond, H3Latent, H3Model, check_interrupt, progress_bar
from .convert import pack_latents


class H3Sampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3Sampler",
            display_name="H3 Dual-Clock Sampler",
            category=CATEGORY,
            description="Denoises video and audio together on their own sigma ladders (the H3 flow sampler).",
            inputs=[
                H3Model.Input("model", tooltip="From H3 Model Loader (optionally through H3 LoRA / Turbo Apply)."),
                H3Cond.Input("conditioning", tooltip="From H3 Conditioning."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True,
                             tooltip="Noise seed (one CPU generator: the same seed gives the same output anywhere)."),
                io.Int.Input("steps", default=0, min=0, max=200,
                             tooltip="Sampling points; 0 = automatic: a Turbo adapter's distilled count, else 50."),
                io.Float.Input("video_shift", default=0.0, min=0.0, max=100.0, step=0.1,
                               tooltip="Video sigma shift; 0 = automatic: the Turbo contract's, else 12."),
                io.Float.Input("audio_shift", default=0.0, min=0.0, max=100.0, step=0.1,
                               tooltip="Audio sigma shift; 0 = automatic: the Turbo contract's, else 3."),
            ],
            outputs=[H3Latent.Output(display_name="latent")],
        )

    @classmethod
    def execute(cls, model, conditioning, seed, steps, video_shift, audio_shift) -> io.NodeOutput:
        wanted = TASK_PARTITION[conditioning.task]
        if wanted != model.partition:
            raise ValueError(f"{conditioning.task} runs on the {wanted} partition, but this model was loaded as "
                             f"{model.partition}; set the loader's partition to {wanted}.")
        dit = model.dit
        contracts = []
        try:
            if model.loras:
                report = apply_loras(dit, list(model.loras), partition=model.partition, mode="dynamic")
                contracts = [c for c in report.contracts if c is not None]
            settings = sampler_settings(contracts, steps or None, video_shift or None, audio_shift or None)
            bar = progress_bar(settings.steps)

            def on_step(state):
                bar.update_absolute(state.step, state.total)
                check_interrupt()

            check_interrupt()
            latents = sample(dit, conditioning, seed, settings.steps, settings.video_shift, settings.audio_shift,
                             settings.video_sigmas, settings.audio_sigmas, callback=on_step)
        finally:
            if model.loras:
                remove_loras(dit)  # the loader's cached DiT goes back to its base weights
        return io.NodeOutput(pack_latents(latents, seed=int(seed), task=conditioning.task, steps=settings.steps,
                                          width=conditioning.width, height=conditioning.height))


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
                               tooltip="A file from models/loras (any H3 LoRA layout, Comfy-Org Turbo exports too)."),
                io.Float.Input("strength", default=1.0, min=-10.0, max=10.0, step=0.05,
                               tooltip="Scale of the adapter's delta; Turbo adapters are distilled for 1.0."),
            ],
            outputs=[H3Model.Output(display_name="model")],
        )

    @classmethod
    def execute(cls, model, lora_name, strength) -> io.NodeOutput:
        lora = load_lora(folder_paths.get_full_path_or_raise("loras", lora_name))
        lora.terms_for(model.partition)  # an adapter for the other partition is refused here
        return io.NodeOutput(model.with_lora(lora, strength))


NODES = [H3Sampler, H3LoRAApply]
