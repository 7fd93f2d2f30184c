"""Models a host moves between devices as one unit, and freeing memory when a run fails.

A `Placement` is what a host's model manager (ComfyUI's) holds for one loaded model: its parts (modules,
or objects with `.to(device)` such as the text encoder), the device they compute on and the device they
wait on. `load()` / `offload()` move every part and return the bytes moved, so a manager can account
for them; every move and the model's release are logged (logger "h3"), so a host's "unload" is visible.
`freed_on_failure` wraps heavy work so a failed or interrupted run hands its memory back.

A placement whose weights can be read again from their files (a DiT with its `DiTReader`, a text
encoder with its reader) can also `release_weights()`: a host short of CPU memory lets such a model go
while another needs the room, and the model is read again at its next `load()`. `make_host_room`
(set by a host) is asked before weights go into CPU memory, so it can free room first; a model that
would be parked there (unloaded from the GPU) with no room left lets go of its weights instead.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import traceback
import weakref
from collections.abc import Iterable

import torch

from .pinned import host_room
from .runtime import empty_caches, host_memory_warning

log = logging.getLogger("h3")
GIB = 2**30


def _modules(part) -> list[torch.nn.Module]:
    if isinstance(part, torch.nn.Module):
        return [part]
    inner = getattr(part, "model", None)  # TextEncoder keeps its transformers model here (None once released)
    return [inner] if isinstance(inner, torch.nn.Module) else []


def module_bytes(parts: Iterable, device_type: str | None = None) -> int:
    """Bytes of the parts' weights and buffers as they are held (those on `device_type` only, if given): what a
    memory plan counts for them."""
    seen, total = set(), 0
    for part in parts:
        for module in _modules(part):
            for tensor in list(module.parameters()) + list(module.buffers()):
                if id(tensor) not in seen and (device_type is None or tensor.device.type == device_type):
                    seen.add(id(tensor))
                    total += tensor.numel() * tensor.element_size()
    return total


def warn_host_memory(nbytes: int, what: str) -> None:
    """Log `runtime.host_memory_warning` when reading `nbytes` into CPU memory would not fit."""
    warning = host_memory_warning(nbytes, what)
    if warning:
        log.warning("H3: %s", warning)


def spill_device(load_device, offload_device) -> torch.device:
    """Where weights that do not stay on the device wait (streamed blocks and layers, parked AdaLN weights,
    a streamed model unloaded): the offload device, or the CPU where that is the device itself (ComfyUI's
    --highvram and --gpu-only keep a whole model there; one streamed because it does not fit cannot wait
    there)."""
    load_device, offload_device = torch.device(load_device), torch.device(offload_device)
    return offload_device if offload_device != load_device else torch.device("cpu")


class Placement:
    """One model's parts, moved together between `load_device` and `offload_device`.

    `loaded` is the host's view (resident on `load_device`); on a CPU-only host both devices are the CPU
    and a move is bookkeeping only, still logged."""

    def __init__(self, name: str, parts, load_device, offload_device, loaded: bool = False):
        self.name = name
        self.parts = list(parts) if isinstance(parts, (list, tuple)) else [parts]
        self.load_device = torch.device(load_device)
        self.offload_device = torch.device(offload_device)
        self.size = module_bytes(self.parts)
        self.loaded = loaded
        self.make_host_room = None  # (bytes, placement, others) -> whether they fit now: set by a host
        self.on_read = None  # (tensors done, total) while weights are read from files: a host's progress bar
        weakref.finalize(self, log.info, "H3: %s released (%.2f GiB)", name, self.size / GIB)

    @property
    def spill_device(self) -> torch.device:
        return spill_device(self.load_device, self.offload_device)

    @property
    def planned_bytes(self) -> int:
        """What its next load puts on the device: the size a host makes room for."""
        return self.size

    @property
    def host_bytes(self) -> int:
        """Bytes of its weights in CPU memory now."""
        return module_bytes(self.parts, "cpu")

    @property
    def releasable(self) -> bool:
        """Whether its weights can go and be read again from their files (`release_weights`)."""
        return False

    def release_weights(self) -> int:
        """Drop the weights (read again at the next `load`); the CPU bytes freed."""
        raise NotImplementedError(f"{self.name} cannot be read again from files, so it is not released.")

    def _host_room(self, nbytes: int, others: bool = True) -> bool:
        """Whether `nbytes` more fit in CPU memory, once the host (if any) made what room it can (`others`:
        also by letting its other idle models go)."""
        return self.make_host_room is None or self.make_host_room(nbytes, self, others)

    def _before_read(self, device: torch.device, nbytes: int) -> None:
        """Before `nbytes` of weights are read onto `device`: room made in CPU memory, or a warning."""
        if device.type == "cpu" and not self._host_room(nbytes):
            warn_host_memory(nbytes, self.name)

    def _parks_released(self, nbytes: int, home: torch.device) -> bool:
        """About to move `nbytes` from the device to `home`: if that is CPU memory without room for them, a model
        that can be read again lets go of its weights instead (True when it did). Other models are not let go
        of for it: it leaves because another model is about to run, maybe one of those."""
        if (nbytes == 0 or home.type != "cpu" or self.load_device == home
                or not self.releasable or self._host_room(nbytes, False)):
            return False
        self.release_weights()
        return True

    @property
    def device(self) -> torch.device:
        return self.load_device if self.loaded else self.offload_device

    @property
    def loaded_bytes(self) -> int:
        return self.size if self.loaded else 0

    def _move(self, loaded: bool) -> int:
        if self.loaded == loaded:
            return 0
        previous = self.device
        target = self.load_device if loaded else self.offload_device
        if self.load_device != self.offload_device:
            with _undone_on_failure(self, previous):
                for part in self.parts:
                    if _modules(part):  # a released text encoder has nothing left to move
                        part.to(target)
            empty_caches(previous)
        self.loaded = loaded
        return self.size

    def load(self) -> int:
        """Move every part to the compute device; the bytes moved (0 if already there)."""
        moved = self._move(True)
        if moved:
            log.info("H3: %s loaded on %s (%.2f GiB)", self.name, self.load_device, self.size / GIB)
        return moved

    def offload(self) -> int:
        """Move every part to the waiting device and free the compute device's cache; the bytes freed."""
        moved = self._move(False)
        if moved:
            log.info("H3: %s unloaded from %s to %s (%.2f GiB)", self.name, self.load_device, self.offload_device,
                     self.size / GIB)
        return moved


class TextEncoderPlacement(Placement):
    """The text encoder (text.TextEncoder). `stream`: it does not fit the device, so its weights wait in
    CPU memory; loading moves only the rest (embedding, vision tower) and hooks the decoder layers to
    visit the device one at a time while they run (`TextEncoder.stream_layers`), and `size` is that
    resident part, what a host sees loaded. Unloading (`TextEncoder.to`) removes the hooks.
    `working_bytes`: what encoding needs besides, whatever the prompt (streaming: two layers in flight); a
    prompt's activations come on top (`TextEncoder.encoding_bytes`). `budget_gib`: the GPU memory the user let it
    use (None: what the host has free)."""

    def __init__(self, name: str, encoder, load_device, offload_device, stream: bool = False,
                 loaded: bool = False, budget_gib: float | None = None):
        super().__init__(name, [encoder], load_device, offload_device, loaded)
        self.encoder, self.stream, self.budget_gib = encoder, False, budget_gib
        self.working_bytes = 0
        self.weight_bytes = self.size  # all of them, the streamed layers too: what a read puts in memory
        layers = encoder.model.language_model.layers
        self._layers_bytes = (module_bytes([layers]), module_bytes([layers[0]]))  # known once released too
        if stream:
            self._streaming()

    def _streaming(self) -> None:
        all_layers, one_layer = self._layers_bytes
        self.stream = True
        self.size -= all_layers
        self.working_bytes = 2 * one_layer

    def stream_from_now(self) -> None:
        """For an encode that does not fit beside the resident weights (a long prompt with many pictures, or the
        VAEs beside it on a small GPU): the encoder goes back to CPU memory, and from its next load on its
        decoder layers stay there and visit the device as they run."""
        if self.stream:
            return
        self.offload()
        self._streaming()
        if self.encoder.model is not None and self.spill_device != self.offload_device:  # offload left it there
            self.encoder.to(self.spill_device)

    @property
    def releasable(self) -> bool:
        return self.encoder.model is not None and self.encoder.reader is not None

    def release_weights(self) -> int:
        freed = self.host_bytes
        self.encoder.release()
        self.loaded = False
        log.info("H3: %s let go of its weights (%.2f GiB) for CPU memory; they are read again from the files "
                 "for the next prompt", self.name, self.size / GIB)
        return freed

    def _move(self, loaded: bool) -> int:
        if loaded and self.encoder.model is None and self.encoder.reader is not None:  # released: read it back
            home = self.spill_device if self.stream else self.load_device
            self._before_read(home, self.weight_bytes)
            self.encoder.read(home, self.on_read)
        if not self.stream:
            if not loaded and self.loaded and self._parks_released(self.size, self.offload_device):
                return self.size
            return super()._move(loaded)
        if self.loaded == loaded or self.encoder.model is None:  # a released encoder has nothing to move
            self.loaded = loaded
            return 0
        if loaded:
            with _undone_on_failure(self, self.spill_device):  # `to` takes the hooks off too
                self.encoder.stream_layers(self.load_device)
        else:
            self.encoder.to(self.spill_device)
            empty_caches(self.load_device)
        self.loaded = loaded
        return self.size

    def load(self) -> int:
        moved = self._move(True)
        if moved and self.stream:
            log.info("H3: %s loaded on %s (%.2f GiB; its decoder layers stay in CPU memory and visit %s one at "
                     "a time)", self.name, self.load_device, self.size / GIB, self.load_device)
        elif moved:
            log.info("H3: %s loaded on %s (%.2f GiB)", self.name, self.load_device, self.size / GIB)
        return moved

    def offload(self) -> int:
        moved = self._move(False)
        if moved:
            log.info("H3: %s unloaded from %s to %s (%.2f GiB)%s", self.name, self.load_device,
                     self.spill_device if self.stream else self.offload_device, self.size / GIB,
                     "; layer streaming removed" if self.stream else "")
        return moved


@contextlib.contextmanager
def _undone_on_failure(placement: Placement, home: torch.device):
    """A move that fails partway (out of memory with half the parts moved) is undone: every part back on
    `home`, the `loaded` state unchanged, the failed device's cache freed. A model left half-placed but marked
    loaded made each later run of it fail until the host let it go."""
    try:
        yield
    except BaseException:
        for part in placement.parts:
            if _modules(part):
                part.to(home)
        empty_caches(placement.load_device)
        raise


@contextlib.contextmanager
def freed_on_failure(device=None):
    """Run heavy work; if it raises (an error or an interrupt), drop the tensors the traceback's finished
    frames still hold (the host keeps the exception for its report), collect, and empty the device cache
    before the exception goes on, so the host stays usable."""
    try:
        yield
    except BaseException as error:
        traceback.clear_frames(error.__traceback__)
        empty_caches(None if device is None else torch.device(device))
        raise


def _arrangement(plan, blocks: int) -> tuple[int, int, bool]:
    """What a plan puts where (None: the whole model on the device); equal arrangements need no move."""
    return (blocks, 0, False) if plan is None else (plan.resident_blocks, plan.prefetch, plan.offload_adaln)


class DiTPlacement(Placement):
    """The DiT, placed by a memory plan for each request (memory_plan.plan_for, offload.place): whole on
    the device when it fits, else its AdaLN weights and as many blocks as needed kept on the CPU, the
    blocks streamed through a few device slots. A host plans (`plan_request`), hands the plan over
    (`use`) and loads; `offload` removes the streaming hooks and brings every weight home, so the next
    request plans afresh. `loaded_bytes` is what the plan keeps on the device (a partial load).

    `budget_gib`: the device memory the DiT may use (None: what the host reports free). `reader`: the
    `checkpoint.DiTReader` whose model `dit` is; its weights are then read at the first load (straight
    onto the device when the plan keeps everything there), and may be released and read again. A streamed load
    pins at most what the host leaves (pinned.host_room: offload.BlockStreamer's pin_bytes)."""

    def __init__(self, name: str, dit, load_device, offload_device, loaded: bool = False,
                 budget_gib: float | None = None, reader=None):
        if reader is not None and reader.model is not dit:
            raise ValueError("The DiT placed must be its reader's model.")
        self.dit, self.budget_gib, self.reader = dit, budget_gib, reader
        self.plan = None  # the plan of the next load, and of the model while loaded (None: whole)
        self.streamer = None
        super().__init__(name, [dit], load_device, offload_device, loaded)

    @property
    def loaded_bytes(self) -> int:
        if not self.loaded:
            return 0
        away = 0
        if self.plan is not None and self.plan.offload_adaln:
            away += module_bytes(self.dit.adaln_modules())
        if self.streamer is not None:
            away += self.streamer.offloaded_bytes
        return self.size - away

    @property
    def planned_bytes(self) -> int:
        """What the plan of the next load (or of the loaded model) keeps on the device, `loaded_bytes` once
        loaded: a host making room for the whole model would push out models that fit beside a streamed one."""
        from .offload import streamed_bytes

        if self.plan is None:
            return self.size
        away = module_bytes(self.dit.adaln_modules()) if self.plan.offload_adaln else 0
        return self.size - away - streamed_bytes(self.dit, self.plan)

    @property
    def _home(self) -> torch.device:
        """Where the model goes when unloaded: the offload device, unless it is held there only in part."""
        whole = _arrangement(self.plan, len(self.dit.blocks)) == _arrangement(None, len(self.dit.blocks))
        return self.offload_device if whole else self.spill_device

    def plan_request(self, layout, steps: int, free_bytes: int | None = None, other_bytes: int = 0):
        """The plan for sampling `layout` (the largest a request samples) with a `steps`-point ladder,
        within `budget_gib`, else within `free_bytes` (what the host reports free on the device) plus what
        this model already holds there (None: what torch reports; the CPU is not limited); `other_bytes` of
        that held for the run besides (hooked LoRA factors). A request that does not fit even with every block
        streamed is refused here, before anything moves."""
        from .conditioning import RequestError
        from .fp8 import held_format
        from .memory_plan import does_not_fit, plan_for

        budget = self.budget_gib
        if budget is None and free_bytes is not None:
            budget = max(free_bytes + self.loaded_bytes, 1) / GIB
        plan = plan_for(self.dit.config, layout, steps, self.load_device, budget,
                        torch.empty(0, dtype=self.dit.dtype).element_size(), held=held_format(self.dit),
                        adaln_bytes=module_bytes(self.dit.adaln_modules()), other_bytes=other_bytes)
        if not plan.fits:
            given = "the budget set" if self.budget_gib is not None else "what is free"
            raise RequestError(does_not_fit(plan, str(self.load_device), given,
                                            None if budget is None else int(budget * GIB), other_bytes))
        return plan

    def use(self, plan) -> None:
        """Place by `plan` at the next load. A model loaded another way is unloaded first, unless only its
        AdaLN weights change place (no streaming before or after): then just they move."""
        blocks = len(self.dit.blocks)
        wanted = _arrangement(plan, blocks)
        if self.loaded and wanted != _arrangement(self.plan, blocks):
            if self.streamer is None and wanted[1] == 0:
                adaln_home = self.spill_device if wanted[2] else self.load_device
                for module in self.dit.adaln_modules():
                    module.to(adaln_home)
                empty_caches(self.load_device)
                log.info("H3: %s: AdaLN weights moved to %s", self.name, adaln_home)
            else:
                self.offload()
        self.plan = plan

    @property
    def releasable(self) -> bool:
        return self.reader is not None and self.reader.is_read

    def release_weights(self) -> int:
        freed = self.host_bytes
        if self.streamer is not None:  # its hooks off; the pinned homes and the slots go with the weights
            self.streamer.remove()
            self.streamer.let_go()
            self.streamer = None
        self.reader.drop()
        self.loaded = False
        empty_caches(self.load_device)
        log.info("H3: %s let go of its weights (%.2f GiB) for CPU memory; they are read again from the file at "
                 "its next run", self.name, self.size / GIB)
        return freed

    def _move(self, loaded: bool) -> int:
        from .offload import load_device, place, unplace

        if self.loaded == loaded:
            return 0
        if loaded:
            if self.reader is not None and not self.reader.is_read:
                home = self.load_device if self.plan is None else load_device(self.plan, self.load_device)
                self._before_read(home, self.size)
                log.info("H3: %s: reading its weights onto %s (%.2f GiB)", self.name, home, self.size / GIB)
                self.reader.read(home, self.on_read)
            with _undone_on_failure(self, self._home):  # a failed streamer undoes its own blocks
                if self.plan is None:
                    self.dit.to(self.load_device)
                else:
                    self.streamer = place(self.dit, self.load_device, self.plan, pin_bytes=host_room())
            self.loaded = True
            self._say_pinned()
            return self.loaded_bytes
        moved, home = self.loaded_bytes, self._home
        if self._parks_released(moved, home):
            return moved
        unplace(self.dit, home, self.streamer)
        self.streamer, self.loaded = None, False
        empty_caches(self.load_device)
        return moved

    def _say_pinned(self) -> None:
        streamer = self.streamer
        streamed = 0 if streamer is None else len(streamer.home)
        if streamed and streamer.pinned_blocks < streamed and streamer.copy_stream is not None:
            log.info("H3: %s: %d of its %d streamed blocks fit the host's pinned-memory budget and free memory; the "
                     "others are copied each step from where they were read (the file's pages where stored as held: "
                     "the OS reads from disk again what it did not keep; slower where the copies outlast a block's "
                     "compute)", self.name, streamer.pinned_blocks, streamed)

    def load(self) -> int:
        moved = self._move(True)
        if moved:
            how = "whole" if self.plan is None else self.plan.describe(len(self.dit.blocks))
            log.info("H3: %s loaded on %s (%.2f of %.2f GiB there; %s)", self.name, self.load_device, moved / GIB,
                     self.size / GIB, how)
        return moved

    def offload(self) -> int:
        streamed, home = self.streamer is not None, self._home
        moved = self._move(False)
        if moved:
            log.info("H3: %s unloaded from %s to %s (%.2f GiB)%s", self.name, self.load_device, home,
                     moved / GIB, "; block streaming removed" if streamed else "")
        return moved

    @contextlib.contextmanager
    def unloaded_on_failure(self):
        """Sample inside: if it fails or is interrupted while blocks stream, the model is unloaded (hooks
        off, blocks home), so nothing half-streamed is left and the next run places it afresh."""
        try:
            yield
        except BaseException:
            if self.streamer is not None:
                self.offload()
            raise


@contextlib.contextmanager
def _host_main_hidden():
    """Start worker processes without the host's start script: multiprocessing's spawn runs the parent's
    `__main__` again in every child (for ComfyUI its main.py: start-up, custom nodes' prestartup scripts,
    a CUDA context on the first GPU) unless `__main__` names neither a file nor a module. The workers need
    only h3_core, so both are hidden while they start."""
    main = sys.modules.get("__main__")
    names = ("__file__", "__spec__")
    saved = {name: main.__dict__[name] for name in names if main is not None and name in main.__dict__}
    for name in saved:
        if name == "__file__":
            del main.__file__
        else:
            main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(saved)


def check_devices(devices, split: bool = False) -> list[torch.device]:
    """`devices` as torch devices, each one that exists here (a missing GPU is named before anything runs).
    `split`: the devices a DiT is split over, whose worker processes share one collective backend: at least one,
    all CUDA or all 'cpu', no GPU twice. A string is a comma-separated list ("cuda:0,cuda:1")."""
    devices = [name.strip() for name in devices.split(",") if name.strip()] if isinstance(devices, str) else list(devices)
    bad = [name for name in devices if not _device_name(name)]
    if bad:
        raise ValueError(f"{', '.join(map(repr, bad))}: not a device name such as cpu, cuda or cuda:1.")
    devices = [torch.device(d) for d in devices]
    kinds = {device.type for device in devices}
    if split and (len(kinds) != 1 or not kinds <= {"cpu", "cuda"}):
        raise ValueError(f"Devices to split the DiT over must be all CUDA devices or all 'cpu'; got "
                         f"{', '.join(map(str, devices)) or 'none'}.")
    gpus = [device.index or 0 for device in devices if device.type == "cuda"]  # "cuda" is the current GPU, cuda:0
    twice = sorted({index for index in gpus if gpus.count(index) > 1})
    if split and twice:
        raise ValueError(f"cuda:{twice[0]} is named more than once in {', '.join(map(str, devices))}; each worker "
                         "needs a GPU of its own.")
    for device in devices:
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"{device} does not exist here: this machine has {torch.cuda.device_count()} CUDA "
                             "device(s).")
        if device.type == "meta":  # it passed, and the run failed once models had loaded ("Cannot copy out of meta")
            raise ValueError("meta is torch's device of shapes without data: nothing runs there; use cpu or cuda.")
        if device.type not in ("cpu", "cuda") and not _available(device.type):
            raise ValueError(f"{device}: this torch build has no {device.type} device here; use cpu or cuda"
                             f"{' (mps on a Mac)' if device.type != 'mps' else ''}.")
    # after the GPUs are known to be there: a CPU-only build lacks both, and the missing GPU is the news
    if split and gpus and not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        raise ValueError("Splitting the DiT over GPUs needs NCCL, which this torch build lacks (Windows and macOS "
                         "builds have none): run it on one GPU (blocks that do not fit are streamed), or on Linux.")
    if split:  # a worker's GPU by its index: torch.cuda.set_device takes no bare "cuda"
        devices = [torch.device("cuda", device.index or 0) if device.type == "cuda" else device for device in devices]
    return devices


def check_load_device(device, headers_only: bool = False) -> torch.device:
    """The device a loader is asked to put weights on, refused with a clear message before any file is read
    (else torch's own error, or a CPU build's "not compiled with CUDA", after the headers). `headers_only`:
    the loader also takes "meta", where it reads the headers only."""
    if headers_only and _device_name(device) and torch.device(device).type == "meta":
        return torch.device("meta")
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):  # int: a GPU's index, as torch
        raise ValueError(f"device must be a device name such as 'cpu', 'cuda' or 'cuda:1' (or a torch.device), "
                         f"got {type(device).__name__}.")
    return check_devices([device])[0]


def _available(kind: str) -> bool:
    """Whether torch can use a device of this kind here (mps: a Mac with Metal; xpu: an Intel GPU build)."""
    backend = getattr(torch.backends, kind, None) if kind == "mps" else getattr(torch, kind, None)
    try:
        return bool(backend.is_available())
    except AttributeError:
        return False


def _device_name(name) -> bool:
    try:
        torch.device(name)
    except (RuntimeError, TypeError):
        return False
    return True


class RunnerPlacement(Placement):
    """The DiT split over several devices (parallel.ParallelRunner), as a host's model manager sees it:
    `load` starts the worker processes (each loads its share), `offload` stops them, which frees their
    device memory; dropping the placement stops them too. `sample` is what pipeline.sample calls on a
    runner, starting the workers again if they were stopped. `size`: an estimate of one device's weights.
    `previews`: rank 0 sends each step's rows back for a preview (a device-to-host copy a step).
    `loras`: the adapters every worker hooks in (dynamic) for the runs that follow."""

    def __init__(self, name: str, spec, devices, shard_weights: bool = False, offload_device="cpu"):
        devices = check_devices(devices, split=True)
        if len(devices) < 2:
            raise ValueError(f"Splitting the DiT needs two or more devices, got {[str(d) for d in devices]}.")
        self.spec, self.devices, self.shard_weights = spec, devices, shard_weights
        self.config = spec.dit_config()  # a checkpoint's shape from its headers: nothing loads yet
        self._dtype = spec.compute_dtype()
        self.runner = None
        self.previews = False
        self.loras: tuple[list, str | None] = ([], None)  # (LoRA, strength) list and partition for the next runs
        self.between_waits = None  # while the workers load: a host's cancel check (ParallelRunner's on_wait)
        super().__init__(name, [], devices[0], offload_device, loaded=False)
        self.size = self._device_bytes()

    @property
    def dtype(self) -> torch.dtype:
        """What the workers' DiT computes in (a file's own dtype when the spec names none)."""
        return self._dtype

    def _device_bytes(self) -> int:
        from .memory_plan import adaln_weight_bytes, block_weight_bytes, shared_weight_bytes

        dtype_bytes = self.dtype.itemsize
        blocks = self.config.num_layers * block_weight_bytes(self.config, dtype_bytes, self.spec.held_linears())
        if self.shard_weights:
            blocks //= len(self.devices)
        adaln = self.spec.adaln_bytes()
        return (shared_weight_bytes(self.config, dtype_bytes) + blocks
                + (adaln_weight_bytes(self.config, dtype_bytes) if adaln is None else adaln))

    def load(self) -> int:
        """Start the workers (if not running: a failed worker stops its runner, and one may have died while idle,
        killed for memory say); returns the bytes estimate."""
        if self.runner is not None and (self.runner.closed or not all(p.is_alive() for p in self.runner.processes)):
            self.runner.close()
            self.runner, self.loaded = None, False
        if self.loaded:
            return 0
        from .parallel import ParallelRunner

        with _host_main_hidden():
            self.runner = ParallelRunner(self.spec, self.devices, self.shard_weights, on_wait=self.between_waits)
        self.loaded = True
        log.info("H3: %s workers started on %s (%s)", self.name, ", ".join(map(str, self.devices)),
                 "sharded weights" if self.shard_weights else "a whole model each")
        return self.size

    def offload(self) -> int:
        """Stop every worker; returns the bytes estimate they held on the first device."""
        if self.runner is None:
            self.loaded = False
            return 0
        runner, self.runner, self.loaded = self.runner, None, False
        runner.close()
        log.info("H3: %s unloaded: workers on %s stopped", self.name, ", ".join(map(str, self.devices)))
        return self.size

    def sample(self, *args, **kwargs):
        self.load()
        self.runner.use_loras(*self.loras)  # again after a restart: new workers start without adapters
        return self.runner.sample(*args, preview=self.previews, **kwargs)
