"""Our models inside ComfyUI's model manager.

Each loaded model is an `h3_core.placement.Placement` wrapped in a ModelPatcher subclass, so that
`load_models_gpu` asks other models to leave before ours arrive, and every unload request (`/free`, the
"Unload models" button, another model needing the room) moves ours off the GPU. ComfyUI's per-layer
low-VRAM casting needs its own layer classes, which the H3 engine does not use; instead the DiT is placed
by the engine's memory plan for each run (DiTPlacement): whole when it fits, else partly resident with
the rest of its blocks streamed from pinned CPU memory, reported to ComfyUI as a partial load. A DiT
split over several devices (RunnerPlacement) lives in worker processes: unloading it stops them. A text
encoder that does not fit (TextEncoderPlacement) waits in CPU memory and its layers visit the device as
they run; the VAE decode nodes ask for the decode's working memory besides the weights. The DiT and a
text encoder read from files can also let go of their CPU memory for each other (host_memory.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import comfy.model_management as mm
import comfy.model_patcher
import torch

from h3_core import pinned
from h3_core.dit import fp32_modules
from h3_core.lora import apply_loras, hooked_bytes, remove_loras
from h3_core.memory_plan import GIB, usable_bytes, working_bytes
from h3_core.placement import DiTPlacement, Placement, RunnerPlacement, TextEncoderPlacement, spill_device

from .common import progress_and_interrupt
from .host_memory import track


class H3Patcher(comfy.model_patcher.ModelPatcher):
    """A ModelPatcher whose `model` is a Placement: loading places it (whole, by its memory plan, or its
    workers started), unloading sends it back; sizes are what the placement reports."""

    def __init__(self, placement: Placement):
        super().__init__(placement, placement.load_device, placement.offload_device, size=placement.size)

    def model_size(self):
        return self.model.planned_bytes

    def loaded_size(self):
        return self.model.loaded_bytes

    def current_loaded_device(self):
        return self.model.device

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
        self.model.load()

    def patch_model(self, device_to=None, lowvram_model_memory=0, load_weights=True, force_patch_weights=False):
        if load_weights:
            self.model.load()
        return self.model

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        return self.model.load()

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
        return self.model.offload()

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        if unpatch_weights:
            self.model.offload()

    def detach(self, unpatch_all=True):
        # ComfyUI detaches with unpatch_all=False when it re-registers a model it keeps where it is
        if unpatch_all:
            self.model.offload()
        return self.model


def manage(name: str, parts, device, kind: str) -> H3Patcher:
    """Wrap freshly loaded `parts` (already on `device`) and register them as loaded. `kind` picks
    ComfyUI's offload device: "diffusion" | "text_encoder" | "vae"."""
    offload = {"diffusion": mm.unet_offload_device, "text_encoder": mm.text_encoder_offload_device,
               "vae": mm.vae_offload_device}[kind]()
    patcher = H3Patcher(Placement(name, parts, device, offload, loaded=True))
    place([patcher])
    return patcher


def text_encoder_streams(nbytes: int, device, budget_gib: float | None, beside: int = 0, held=()) -> bool:
    """Whether a text encoder needing `nbytes` (weights + activations) must stream its layers: it does not
    fit in the user's budget (honoured on any device) or, automatically, in what ComfyUI reports free on a
    GPU once other models were asked to leave, less its reserve, with `beside` bytes of our other models next to
    it (the VAEs that encode keyframes and references). `held`: our patchers already on the device (their bytes
    are room, and they stay). Asked before any weight is read, and before each encode by a resident encoder."""
    device = torch.device(device)
    room = int(budget_gib * GIB) if budget_gib else None
    held_bytes = sum(patcher.loaded_size() for patcher in held)
    if room is None or nbytes <= usable_bytes(room):
        if room is not None or device.type == "cpu":
            make_room(nbytes - held_bytes, device, held)
            return False
        nbytes += beside
        make_room(nbytes - held_bytes, device, held)
        room = mm.get_free_memory(device) - mm.extra_reserved_memory() + held_bytes
        if nbytes <= usable_bytes(room):
            return False
    logging.getLogger("h3").info("H3: text encoder: %.2f GiB does not fit in %.2f GiB on %s (less the allocator's "
                                 "headroom: %.2f); its decoder layers will stream from CPU memory", nbytes / GIB,
                                 room / GIB, device, usable_bytes(room) / GIB)
    return True


def streamed_text_encoder_home(device) -> torch.device:
    """Where a streamed text encoder's layers wait (placement.spill_device)."""
    return spill_device(device, mm.text_encoder_offload_device())


def manage_text_encoder(name: str, encoder, device, stream: bool, budget_gib: float | None = None) -> H3Patcher:
    """The text encoder under ComfyUI's model manager, registered (and placed) now: whole on `device`
    (already there), or with `stream` resident but for its decoder layers, which visit `device` as they
    run; ComfyUI then sees only the resident part. `budget_gib`: the loader's GPU memory setting."""
    placement = TextEncoderPlacement(name, encoder, device, mm.text_encoder_offload_device(), stream,
                                     loaded=not stream, budget_gib=budget_gib)
    track(placement)
    patcher = H3Patcher(placement)
    place([patcher], placement.working_bytes + (encoder.encoding_bytes(0) if stream else 0))
    return patcher


def make_room(nbytes: int, device, keep=()) -> None:
    """Before reading weights from disk onto `device`: ask other models to leave `nbytes` free (the patchers in
    `keep` stay)."""
    if nbytes > 0:
        kept = [entry for entry in mm.current_loaded_models if any(entry.model is patcher for patcher in keep)]
        mm.free_memory(nbytes, device, keep_loaded=kept)


def place(patchers, working_bytes: int = 0) -> None:
    """Put our models on their device, after ComfyUI frees room for them plus `working_bytes` of activations."""
    mm.load_models_gpu([p for p in patchers if p is not None], memory_required=working_bytes)


@contextlib.contextmanager
def read_progress(placement):
    """While `placement` may read its weights from files (a first run, or after letting them go), its
    reads show a progress bar over the tensors, the node's cancel checked after each (the 66 GB DiT takes from
    seconds to a minute)."""
    if placement is None:  # a handle made outside the loaders has nothing to read
        yield
        return
    placement.on_read = progress_and_interrupt()
    try:
        yield
    finally:
        placement.on_read = None


def place_for_encoding(text_encoder, vae=None, rows: int = 0, media: int = 0) -> None:
    """The text encoder (and the VAE, for keyframes and references) on the device, with room for what encoding
    a presentation of `rows` rows needs besides (the activations, and a streaming encoder's layers in flight)
    and for the VAEs' encodes after it (`media` bytes besides their weights): ComfyUI unloads other models for
    it. `rows` 0 (the encoder remembers the prompt) or `text_encoder` None: only the VAE. A resident encoder
    placed with room for a short prompt alone streams its layers from now on when the encode would not fit
    beside it and the VAE (a small GPU, or its budget). An encode's `before_models`."""
    patcher = None if text_encoder is None or not rows else text_encoder.patcher
    placement = getattr(patcher, "model", None)
    encoder = getattr(placement, "encoder", None)  # a handle made outside the loaders may have no placement
    vae_patcher = None if vae is None else vae.patcher
    working = getattr(placement, "working_bytes", 0) + (encoder.encoding_bytes(rows) if rows and encoder else 0)
    if (isinstance(placement, TextEncoderPlacement) and not placement.stream
            and (placement.load_device.type != "cpu" or placement.budget_gib)):
        ours = [p for p in (patcher, vae_patcher) if p is not None and p.load_device == placement.load_device]
        beside = sum(p.model_size() for p in ours if p is vae_patcher)
        if text_encoder_streams(placement.size + working, placement.load_device, placement.budget_gib, beside, ours):
            placement.stream_from_now()  # it was placed with room for a short prompt alone
            working = placement.working_bytes + encoder.encoding_bytes(rows)
    with read_progress(placement):
        place([patcher, vae_patcher], max(working, media if vae_patcher is not None else 0))


def decode_working_bytes(vae, video_latents, tiled: bool | None = None) -> int:
    """What a streamed decode of `video_latents` [1, C, L, h, w] needs on the device besides the VAE
    weights (h3_core.vae_video.decode_working_bytes): the decode nodes ask ComfyUI for weights + this.
    `tiled`: as the decode will run (None: the VAE config's)."""
    from h3_core.vae_video import decode_working_bytes as estimate

    config = vae.video.config if tiled is None else dataclasses.replace(vae.video.config, decoder_tiling=tiled)
    _, _, frames, height, width = video_latents.shape
    return estimate(config, frames, height, width, vae.video.decoder.proj_out.weight.element_size())


def manage_dit(name: str, dit, device, loaded: bool, budget_gib: float | None, reader=None) -> H3Patcher:
    """The DiT under ComfyUI's model manager, placed by a memory plan at each run. One read onto the
    device (`loaded`) is registered now; one waiting on the CPU is registered by its first run. With
    `reader` (checkpoint.DiTReader) the weights are read at the first run, and may be let go of while
    another of our models needs the CPU memory (host_memory)."""
    placement = DiTPlacement(name, dit, device, mm.unet_offload_device(), loaded=loaded, budget_gib=budget_gib,
                             reader=reader)
    track(placement)
    patcher = H3Patcher(placement)
    if loaded:
        place([patcher])
    return patcher


def pin_room() -> int | None:
    """The pinned CPU memory ComfyUI's budget leaves for streamed DiT blocks and parked AdaLN tables: none with
    --disable-pinned-memory (or off NVIDIA and AMD); None (no limit) in a ComfyUI without such a budget."""
    most = getattr(mm, "MAX_PINNED_MEMORY", None)
    if most is None:
        return None
    return max(0, int(most - getattr(mm, "TOTAL_PINNED_MEMORY", 0)))


def count_pins(nbytes: int) -> None:
    """H3's pinned slabs taken (+) and given back (-) counted in ComfyUI's pinned total, which its own pinning
    keeps within its budget: without them there, ComfyUI's pins and ours could each take the whole budget."""
    if hasattr(mm, "TOTAL_PINNED_MEMORY"):
        mm.TOTAL_PINNED_MEMORY = max(0, mm.TOTAL_PINNED_MEMORY + nbytes)


pinned.host = pinned.HostPins(pin_room, count_pins)


def manage_runner(name: str, spec, devices, shard_weights: bool) -> H3Patcher:
    """A DiT split over `devices`: registered under the first one, so ComfyUI first makes room there for
    its share; the workers start then (each loads its part) and stop when ComfyUI unloads it."""
    from .common import check_interrupt

    placement = RunnerPlacement(name, spec, devices, shard_weights, mm.unet_offload_device())
    placement.between_waits = check_interrupt  # ComfyUI's Cancel heard while the workers load
    patcher = H3Patcher(placement)
    place([patcher])
    return patcher


def use_loras(model) -> None:
    """Hook the handle's adapters into its DiT for one run, after placement so they sit on its device;
    a split model's workers hook them in instead (an empty list removes what an earlier run left)."""
    if model.split:
        model.dit.loras = (list(model.loras), model.partition)
    elif model.loras:
        apply_loras(model.dit, list(model.loras), partition=model.partition, mode="dynamic")


def drop_loras(model) -> None:
    """After a run the loader's cached DiT goes back to its base weights (shared by every handle)."""
    if not model.split and model.loras:
        remove_loras(model.dit)


@contextlib.contextmanager
def dit_for_run(model, layout, steps: int):
    """The DiT ready for one run over `layout` (the largest a run samples) with a `steps`-point ladder.
    Other models are asked to leave room for the whole DiT and its activations (or the user's budget);
    the engine then plans with what ComfyUI reports free, and the model is placed by that plan (moving
    only if the plan changed). Yields the plan (None for several devices: their workers hold the model).
    A streamed run that fails or is interrupted unloads the model; ComfyUI's interrupt is checked after every
    block, so even a forward of minutes stops at once."""
    from .common import check_interrupt

    patcher = model.patcher
    placement = patcher.model
    working = working_bytes(model.dit.config, layout.sequence_length, steps)
    # the adapters' factors sit next to their modules on the device while hooked; a split model's workers each
    # hold them all, the first beside ComfyUI's own models
    adapters = hooked_bytes(model.loras, model.partition, model.dit.dtype.itemsize, fp32_modules(model.dit.config))
    working += adapters
    if isinstance(placement, RunnerPlacement):
        place([patcher], working)
        yield None
        return
    if model.run is not None:  # this loader's kernel, window, compile and budget (another's may share the weights)
        model.run.apply(model.dit, placement)
    free = None
    if placement.load_device.type != "cpu":
        wanted = int(placement.budget_gib * GIB) if placement.budget_gib else placement.size + working
        make_room(wanted - placement.loaded_bytes, placement.load_device, keep=[patcher])
        free = mm.get_free_memory(placement.load_device) - mm.extra_reserved_memory()
    plan = placement.plan_request(layout, steps, free, other_bytes=adapters)
    placement.use(plan)
    with read_progress(placement):
        place([patcher], working)
    with placement.unloaded_on_failure(), model.dit.checked_between_blocks(check_interrupt):
        yield plan
