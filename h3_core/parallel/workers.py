"""Worker processes for several devices: one per device, each holding the DiT, requests in and
latents out.

The caller's process keeps the text encoder and the VAEs (it encodes before and decodes after; only
the DiT is split). A request goes to rank 0 through a queue and from rank 0 to every rank over a CPU
(gloo) group, so ranks started on other machines receive it the same way. Every rank runs the same
`pipeline.sample` (same seed, so the same noise; the DiT split by sequence parallel, optionally with
sharded weights) and rank 0 sends progress and the latents back. After every step the ranks agree on
the interrupt flag with one all-reduce, so they all stop at the same step. A failure on any rank
ends the runner: every worker is stopped and the caller gets a ParallelWorkerError with the rank and
the worker's traceback. Workers also exit when their parent process goes away.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import pickle
import queue
import shutil
import signal
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout

from ..config import TINY_DIT, DiTConfig
from ..dit import H3DiT
from ..placement import check_devices
from ..runtime import compile_failed, empty_caches
from ..sampler import AUDIO_SHIFT, VIDEO_SHIFT, StepState
from ..tiny import TINY_RANDOM, TINY_SEED, seeded_random_weights
from . import peer_reports, sequence, sharding

# Idle ranks wait for the next request inside a CPU broadcast; it must outlast any pause between requests.
CONTROL_TIMEOUT = timedelta(days=30)
RENDEZVOUS_PREFIX = "h3-rendezvous-"  # the private rendezvous folder of a runner's own workers


class ParallelWorkerError(RuntimeError):
    """A worker failed or died; by the time this is raised every worker has been stopped. `summary`: the worker's
    error in one line; `compile_failed`: it was torch.compile failing to build a graph."""

    summary: str = ""
    compile_failed: bool = False


@dataclass(frozen=True)
class ModelSpec:
    """How every worker gets its DiT (picklable; each worker loads onto its own device)."""

    source: str  # "tiny-random" or anything `checkpoint.load_dit` takes
    partition: str = "fl2va"
    dtype: torch.dtype = torch.bfloat16
    attention: str = "auto"
    loras: tuple[tuple[str, float], ...] = ()  # (file, strength), merged after loading, in order
    linears: str = "checkpoint"  # fp8.LINEAR_MODES, as `h3 generate --linears`
    config: DiTConfig | None = None  # tiny-random: another tiny shape (default TINY_DIT)
    compile: bool = False  # torch.compile the repeated block's forward
    attention_window: int = 0  # latent frames; > 0: the lossy windowed video attention (local_attention.py)
    attention_window_dense_steps: int = 0  # with a window: leading forwards of each run with full attention
    lora_unknown_keys: str = "error"  # "warn": keys of `loras` that name no H3 module are reported, the rest loaded

    def dit_config(self) -> DiTConfig:
        """The model's shape without loading it (a checkpoint's from its config or headers)."""
        if self.source == TINY_RANDOM:
            return self.config or TINY_DIT
        from ..checkpoint import infer_config, locate_dit

        located = locate_dit(self.source, self.partition)
        return self.config or located.config or infer_config(located)

    def held_linears(self) -> str:
        """How the workers will hold the block linears (memory_plan.HELD_FORMATS), from the headers."""
        from ..checkpoint import held_linears, locate_dit, with_config

        if self.source == TINY_RANDOM:
            return held_linears(None, self.linears)
        located = with_config(locate_dit(self.source, self.partition))  # every block counted
        return held_linears(located, self.linears, self.compute_dtype().itemsize)

    def compute_dtype(self) -> torch.dtype:
        """What the workers' DiT computes in: `dtype`, or where that is None (as stored) what the file's blocks
        hold, from the headers (a GGUF file's: bf16)."""
        if self.dtype is not None or self.source == TINY_RANDOM:
            return self.dtype or torch.float32  # the tiny model is made in float32
        from ..checkpoint import DiTReader

        reader = DiTReader(self.source, self.partition, None, self.config, self._read_linears(), "meta")
        return reader.model.attention_dtype

    def adaln_bytes(self) -> int | None:
        """What the timestep-only weights take on each worker as it will hold them, from the headers (None:
        tiny-random, dense in the model dtype)."""
        if self.source == TINY_RANDOM:
            return None
        from ..checkpoint import DiTReader

        return DiTReader(self.source, self.partition, self.dtype, self.config, self._read_linears(), "meta").adaln_nbytes

    def _read_linears(self) -> str:
        from ..fp8 import read_mode

        return read_mode(self.linears, bool(self.loras))

    def load(self, device: torch.device | str, compute: torch.device | str | None = None):
        """As `pipeline.generate` loads its DiT: weights, then LoRAs merged, then lossy FP8 linears made
        (after the merge when there are LoRAs, since those merge into dense weights); a DiT holding linears as
        its file stores them (FP8, int8, int4, NVFP4) gets its LoRAs hooked after that instead. The weights go
        to `device`; `compute` (default: `device`) is where it will run, what FP8 matmuls need (a sharded
        worker reads onto the CPU, whose FP8 matmuls torch 2.11 lacks, to run on its GPU)."""
        device = torch.device(device)
        compute = device if compute is None else torch.device(compute)
        tiny = self.source == TINY_RANDOM
        quantize_later = tiny or self._read_linears() != self.linears
        if tiny:  # as tiny.tiny_random_dit, in any tiny shape
            model = seeded_random_weights(H3DiT(self.config or TINY_DIT), TINY_SEED).set_dtype(self.dtype)
            model = model.to(device).eval().requires_grad_(False)
        else:
            from ..checkpoint import DiTReader

            model = DiTReader(self.source, self.partition, self.dtype, self.config, self._read_linears(),
                              compute).read(device)
        from ..lora import apply_loras, load_lora, run_mode

        adapters = [(load_lora(path, unknown=self.lora_unknown_keys), float(strength)) for path, strength in self.loras]
        lora_mode = run_mode(model)  # as pipeline.load_sampling_dit: stored linears get the LoRAs hooked
        notes = []
        if adapters and lora_mode == "merge":
            notes += apply_loras(model, adapters, partition=self.partition, mode="merge", backup=False).lines()
        if quantize_later and self.linears != "checkpoint":
            from ..fp8 import apply_linear_mode

            apply_linear_mode(model, self.linears, compute)
        if adapters and lora_mode == "dynamic":
            notes += apply_loras(model, adapters, partition=self.partition, mode="dynamic").lines()
        backend = model.set_attention(self.attention, self.attention_window, self.attention_window_dense_steps)
        model.load_notes = [*notes, f"attention: {backend}"]  # what a load on one device says: rank 0 sends them
        if self.compile:
            model.compile_blocks()
        return model


@dataclass(frozen=True)
class _Setup:
    rank: int
    world: int
    device: str
    init_method: str
    spec: ModelSpec
    shard_weights: bool
    threads: int | None
    parent: int  # the process to outlive no longer than


def _pack_request(message: tuple) -> bytes:
    buffer = io.BytesIO()
    torch.save(message, buffer)
    return buffer.getvalue()


def _unpack_request(data: bytes) -> tuple:
    """Every tensor lands on the CPU, wherever the caller kept it (no rank touches another's GPU)."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


class _Stop(Exception):
    def __init__(self, step: int):
        super().__init__(step)
        self.step = step


def _private_store(init_method: str) -> str | None:
    """The store file of a runner's own private rendezvous (`file://` in a folder it made), else None."""
    store = init_method.removeprefix("file://") if init_method.startswith("file://") else None
    return store if store is not None and os.path.basename(os.path.dirname(store)).startswith(RENDEZVOUS_PREFIX) else None


def _watch_parent(parent: int, init_method: str) -> None:
    """Exit as soon as the process that started us is gone (killed, crashed): never linger, nor leave the
    private rendezvous folder it made (it would have removed it on a normal stop)."""
    store = _private_store(init_method)

    def watch():
        launcher = mp.parent_process()  # spawned: the parent's handle, which ends with it (on Windows a
        if launcher is not None:        # parent's id stays its own after it ends: getppid cannot tell)
            launcher.join()
        else:
            while os.getppid() == parent:
                time.sleep(0.5)
        if store is not None:
            shutil.rmtree(os.path.dirname(store), ignore_errors=True)
        os._exit(3)

    threading.Thread(target=watch, name="h3-parent-watch", daemon=True).start()


def _worker(setup: _Setup, requests, results, interrupt) -> None:
    """Process entry point: serve until told to stop; on any failure report it and exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the caller, which then stops us
    logging.getLogger("h3_core.lora").addHandler(logging.NullHandler())  # sent to the caller, which says them
    _watch_parent(setup.parent, setup.init_method)

    def send(*message) -> None:
        if results is not None:
            results.put(pickle.dumps(message))

    store = None
    try:
        store = _join(setup)
        _serve(setup, requests, send, interrupt)
    except BaseException as error:  # noqa: BLE001  every failure must reach the caller
        summary = f"{type(error).__name__}: {error}"
        peers = peer_reports.exchange(store, setup.rank, setup.world, setup.device, error, summary)
        send("error", setup.rank, setup.device, summary, traceback.format_exc(), compile_failed(error), peers)
        if results is None:
            traceback.print_exc()
        else:
            results.close()
            results.join_thread()
        os._exit(1)  # peers may be blocked in a collective with us; the caller stops them


def _join(setup: _Setup) -> dist.Store:
    """Meet the other ranks as init_process_group(init_method=...) would (the same store, timeout and key prefix);
    returns the rendezvous store, where a failing rank leaves its report (peer_reports)."""
    device = torch.device(setup.device)
    if setup.threads:
        torch.set_num_threads(setup.threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = default_pg_nccl_timeout if backend == "nccl" and default_pg_nccl_timeout else default_pg_timeout
    private = _private_store(setup.init_method)  # opened as a path: a URL would cut it at a '?' in TMPDIR
    if private:
        store = dist.FileStore(private, setup.world)
    else:  # tcp:// or env://
        store, _, _ = next(dist.rendezvous(setup.init_method, setup.rank, setup.world, timeout=timeout))
    store.set_timeout(timeout)
    peer_reports.forget(store, setup.rank)
    dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=setup.rank,
                            world_size=setup.world)
    return store


def _load(setup: _Setup, device: torch.device, control, weights):
    if not setup.shard_weights:
        dit = setup.spec.load(device)
    else:
        for turn in range(setup.world):  # one rank at a time holds a whole model in CPU memory
            if turn == setup.rank:
                dit = setup.spec.load("cpu", compute=device)
                sharding.shard_blocks(dit, weights, device)
                backend = dit.set_attention_backend(setup.spec.attention)  # "auto" chosen for the device, not the CPU
                dit.load_notes[-1] = f"attention: {backend}"
            dist.barrier(group=control)
    if setup.world > 1:
        sequence.enable(dit)
    return dit


def _comparable(spec: ModelSpec, shard_weights: bool) -> dict:
    """What every rank must share of its model options: all but paths (machines may mount the files elsewhere;
    LoRAs are compared by file name) and the attention kernel (one GPU kind may lack another's)."""
    options = {field.name: getattr(spec, field.name) for field in dataclasses.fields(spec)}
    options.update(source=None, attention=None, loras=tuple((os.path.basename(path), strength) for path, strength in spec.loras),
                   shard_weights=shard_weights, kind=type(spec).__name__)
    return options


def _check_same_options(setup: _Setup, control, config: DiTConfig | None = None) -> None:
    """Ranks started on other machines (`serve_ranks`) with other options than the caller's would compute another
    model, or fail in a collective of mismatched sizes: every rank compares its options (then its loaded DiT's
    config) with rank 0's and all refuse together."""
    mine = _comparable(setup.spec, setup.shard_weights) if config is None else {"config": config}
    every = [None] * setup.world
    dist.all_gather_object(every, mine, group=control)
    for rank, theirs in enumerate(every):
        differ = sorted(name for name in every[0] if theirs.get(name) != every[0][name])
        if differ:
            shown = "; ".join(f"{name}: rank 0 {every[0][name]!r}, rank {rank} {theirs.get(name)!r}" for name in differ)
            raise ValueError(f"The ranks were started with different model options ({shown}); start every machine's "
                             "ranks with the caller's options.")


def _portable_rows(state: StepState) -> dict:
    """A step's tensors for a preview, on the CPU (the layout and schedule travel separately)."""
    return {
        f.name: value.cpu() if isinstance(value, torch.Tensor) else value
        for f in dataclasses.fields(state)
        if f.name not in ("step", "total", "schedule", "layout")
        for value in [getattr(state, f.name)]
    }


def _serve(setup: _Setup, requests, send, interrupt) -> None:
    from ..lora import applied_loras
    from ..pipeline import SamplingError, sample

    device = torch.device(setup.device)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _check_same_options(setup, control)
    weights = dist.new_group() if setup.shard_weights else None  # weight gathers don't queue behind attention
    dit = _load(setup, device, control, weights)
    loaded = len(applied_loras(dit))  # the spec's own LoRAs, which the runs' adapters come and go above
    _check_same_options(setup, control, dit.config)
    send("ready", setup.rank, dit.config, getattr(dit, "load_notes", []))
    while True:
        box = [requests.get() if setup.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=control)
        kind, *rest = _unpack_request(box[0])
        if kind == "stop":
            break
        if kind == "loras":
            _use_loras(dit, *rest, send if setup.rank == 0 else None, keep=loaded)
            continue
        options, preview = rest

        def on_step(state: StepState) -> None:
            flag = torch.tensor([int(interrupt is not None and interrupt.is_set())])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=control)  # every rank stops at the same step
            if setup.rank == 0:
                send("step", state.step, state.total, state.schedule, _portable_rows(state) if preview else None)
            if flag.item():
                raise _Stop(state.step)

        try:
            latents = sample(dit, callback=on_step, **options)
        except _Stop as stop:
            if setup.rank == 0:
                send("interrupted", stop.step)
            continue
        except SamplingError as error:  # NaN latents: after the last step's collectives, so the workers stay up
            if setup.rank == 0:
                send("failed", str(error))
            continue
        finally:  # rank 0 shares its GPU with the host, which sees another process's cached memory as used
            empty_caches(device)
        if setup.rank == 0:  # a generator seed (long video) goes back advanced, as a local run leaves it
            seed = options["seed"]
            send("done", latents, seed.get_state() if isinstance(seed, torch.Generator) else None)
    dist.destroy_process_group()


def _use_loras(dit: H3DiT, adapters: list, partition: str, send, keep: int = 0) -> None:
    """Replace the adapters hooked into this worker's DiT (dynamic, as a one-device run hooks them), above its
    first `keep` applications (the spec's LoRAs, applied at load). Every rank holds the same model and adapters,
    so a bad adapter fails the same everywhere, before any weight changes: it is reported and the workers stay up."""
    from ..lora import LoRAError, apply_loras, remove_loras

    remove_loras(dit, keep)
    warnings = []
    try:
        if adapters:
            warnings = apply_loras(dit, adapters, partition=partition, mode="dynamic").warnings
    except LoRAError as error:
        if send is not None:
            send("loras", str(error), [])
        return
    if send is not None:  # the host logs the warnings: workers keep theirs quiet (one copy, in the host's log)
        send("loras", None, warnings)


class _Pool:
    """The worker processes and their queues; `stop` is also the runner's finalizer, so it holds no
    reference to the runner."""

    def __init__(self, setups: list[_Setup], tempdir: str | None):
        ctx = mp.get_context("spawn")
        self.requests, self.results, self.interrupt = ctx.Queue(), ctx.Queue(), ctx.Event()
        self.tempdir = tempdir
        self.devices = [s.device for s in setups]
        self.world = setups[0].world  # ranks here and on other machines
        self.processes = [
            ctx.Process(
                target=_worker,
                args=(s, self.requests if s.rank == 0 else None, self.results, self.interrupt),
                name=f"h3-worker-{s.rank}",
                daemon=True,
            )
            for s in setups
        ]
        self.stopped = False

    def start(self) -> None:
        """Start the workers with Ctrl-C ignored from their first instruction (an ignored signal stays ignored
        across exec): it belongs to the caller, which then stops them, and a worker still importing torch would
        otherwise print a KeyboardInterrupt traceback."""
        main = threading.current_thread() is threading.main_thread()  # only there can a handler be set
        before = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            for process in self.processes:
                process.start()
        finally:
            if main:
                signal.signal(signal.SIGINT, before)

    def put(self, *message) -> None:
        self.requests.put(_pack_request(message))

    def receive(self, on_wait=None) -> tuple:
        """The next message from any worker; a reported error or a dead worker stops all and raises. `on_wait()`
        is called while none has come (every 0.2 s): a host's cancel check, whose exception goes on."""
        while True:
            try:
                return self._checked(pickle.loads(self.results.get(timeout=0.2)))
            except queue.Empty:
                pass
            if on_wait is not None:
                on_wait()
            dead = [(rank, p.exitcode) for rank, p in enumerate(self.processes) if p.exitcode is not None]
            if dead:
                try:  # a worker that reported before exiting: take its report
                    return self._checked(pickle.loads(self.results.get(timeout=1.0)))
                except queue.Empty:
                    rank, code = dead[0]
                    self._fail(rank, self.devices[rank], _silent_exit(code), "")

    def _checked(self, message: tuple) -> tuple:
        if message[0] == "error":
            self._fail(*message[1:])
        return message

    def _fail(self, rank: int, device: str, summary: str, worker_traceback: str, compiling: bool = False,
              peers: Sequence[tuple[int, str, str]] = ()) -> None:
        late = self._late_reports()
        killed = [(other, process.exitcode) for other, process in enumerate(self.processes)
                  if other != rank and process.exitcode is not None and process.exitcode < 0]
        self.stop(graceful=False)
        cause = ""
        if peers:  # the report is a survivor's, and the rank it lost left its own in the store
            other, where, told = peers[0]
            cause = f"H3 worker rank {other} on {where} failed ({told}), so "
        elif killed:  # the report is a survivor's (its collective lost a peer): name the rank that died first
            other, code = killed[0]
            cause = (f"H3 worker rank {other} on {self.devices[other]} was killed ({_signal_name(-code)}; out "
                     "of memory?), so ")
        elif self.world > len(self.processes) and peer_reports.lost_a_peer(summary):
            first, last = len(self.processes), self.world - 1
            served = f"rank {first}" if first == last else f"ranks {first}-{last}"
            cause = (f"a rank on another machine ({served}, served by `python -m h3_core.parallel` there) went away "
                     "without a report (killed, or its machine lost; its own output may say why), so ")
        error = ParallelWorkerError(
            f"{cause}H3 worker rank {rank} on {device} failed: {summary}\n"
            + (f"--- traceback in the worker ---\n{worker_traceback}" if worker_traceback else "")
            + "All workers have been stopped."
        )
        error.late_steps = [message[1:] for message in late if message[0] == "step"]
        error.summary, error.compile_failed = summary, compiling
        raise error

    def _late_reports(self, quiet: float = 0.5) -> list[tuple]:
        """Messages that were still on their way when an error arrived: ranks share one queue, so rank 0's
        report of a finished step can land after another rank's error (until the queue is quiet)."""
        late = []
        while True:
            try:
                late.append(pickle.loads(self.results.get(timeout=quiet)))
            except queue.Empty:
                return late

    def stop(self, graceful: bool = True, timeout: float = 30.0) -> None:
        """Ask the workers to finish (idle ones exit at once, busy ones after their current step), then
        terminate and finally kill whatever is left; returns when no worker process remains."""
        if self.stopped:
            return
        self.stopped = True
        alive = lambda: [p for p in self.processes if p.is_alive()]  # noqa: E731
        try:  # a second Ctrl-C while waiting still ends every worker and removes the rendezvous folder
            try:
                if graceful and alive():
                    self.interrupt.set()
                    self.put("stop")
                    deadline = time.monotonic() + timeout
                    while alive() and time.monotonic() < deadline:
                        try:  # keep draining: a worker cannot exit while its last message waits in a full pipe
                            self.results.get(timeout=0.1)
                        except queue.Empty:
                            pass
            finally:
                for process in alive():
                    process.terminate()
                for process in self.processes:
                    if process.pid is not None:
                        process.join(5.0)
                        if process.is_alive():
                            process.kill()
                            process.join()
                for channel in (self.requests, self.results):
                    channel.cancel_join_thread()
                    channel.close()
        finally:
            if self.tempdir is not None:
                shutil.rmtree(self.tempdir, ignore_errors=True)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal has no name
        return f"signal {number}"


def _silent_exit(code: int) -> str:
    """Why a worker that exited without reporting did: killed by a signal, or stopped before our code ran (its own
    output says why; most often a script that starts the workers at import, which every spawned worker repeats)."""
    if code < 0:
        return f"the worker process was killed ({_signal_name(-code)}; out of memory?) without a report"
    return (f"the worker process exited with code {code} before it could report (its output above says why). A script "
            "that splits the DiT must start it under `if __name__ == \"__main__\":`, since each worker process imports "
            "the script again.")


def check_degree(config: DiTConfig, world: int) -> None:
    """Sequence parallel trades rows for attention heads: the ranks must divide the model's heads."""
    heads = config.num_attention_heads
    if heads % world:
        counts = [str(p) for p in range(2, heads + 1) if heads % p == 0] or ["1"]
        listed = counts[0] if len(counts) == 1 else f"{', '.join(counts[:-1])} or {counts[-1]}"
        raise ValueError(f"{world} devices cannot split the model's {heads} attention heads evenly (each takes an equal "
                         f"share); use {listed} devices.")


class ParallelRunner:
    """The DiT over several devices (sequence parallel, optionally sharded weights), one worker each.

        with ParallelRunner(ModelSpec("/models/MiniMax-H3"), ["cuda:0", "cuda:1"]) as runner:
            latents = runner.sample(conditioning, seed=0, steps=50)

    `init_method` / `world_size`: a torch.distributed rendezvous shared with ranks started on other
    machines (`python -m h3_core.parallel`); by default a private one for these local workers only.
    `threads`: torch CPU threads per worker (CPU devices; default: the cores divided among them).
    `on_wait`: called every 0.2 s while the workers load (minutes for the real DiT): a host's cancel check;
    what it raises stops them at once.
    """

    def __init__(
        self,
        spec: ModelSpec,
        devices: Sequence[str | torch.device],
        shard_weights: bool = False,
        init_method: str | None = None,
        world_size: int | None = None,
        threads: int | None = None,
        on_wait=None,
    ):
        self.spec = spec
        self.devices = check_devices(devices, split=True)
        world = world_size or len(self.devices)
        if world < len(self.devices):
            raise ValueError(f"world_size {world} is smaller than the {len(self.devices)} local devices.")
        if world > len(self.devices) and init_method is None:
            raise ValueError(f"world_size {world} counts ranks on other machines, which meet this runner's "
                             "through init_method (e.g. tcp://NODE0:29500); give it.")
        check_degree(spec.dit_config(), world)  # a bad degree fails before any process starts
        if threads is None and self.devices[0].type == "cpu":
            threads = max(1, (os.cpu_count() or 1) // len(self.devices))
        tempdir = None
        if init_method is None:
            tempdir = tempfile.mkdtemp(prefix=RENDEZVOUS_PREFIX)
            init_method = "file://" + os.path.join(tempdir, "store")
        setups = [
            _Setup(rank, world, str(device), init_method, spec, shard_weights, threads, os.getpid())
            for rank, device in enumerate(self.devices)
        ]
        self._pool = _Pool(setups, tempdir)
        self._finalizer = weakref.finalize(self, self._pool.stop)  # on close(), garbage collection or exit
        self._pool.start()
        configs, notes = {}, {}
        try:
            while len(configs) < len(self.devices):
                _, rank, configs[rank], notes[rank] = self._pool.receive(on_wait)
        except BaseException:  # loading workers cannot answer a stop: ended now, not after its 30 s
            self._pool.stop(graceful=False)
            self.close()
            raise
        self.config: DiTConfig = configs[0]
        self.load_notes: list[str] = notes[0]  # rank 0's LoRA report and attention kernel, as one device says them
        self._loras: tuple = ((), None)  # what the workers have hooked in: ((LoRA, strength), ...), partition

    def use_loras(self, loras: Sequence[tuple], partition: str) -> None:
        """Hook these (LoRA, strength) adapters into every worker's DiT for the samples that follow
        (dynamic: the base weights stay as loaded); an empty list removes them. Sent only on a change.
        A bad adapter raises LoRAError and leaves the workers running without adapters."""
        from ..lora import LoRAError

        wanted = (tuple((lora, float(strength)) for lora, strength in loras), partition if loras else None)
        held, held_partition = self._loras
        if wanted[1] == held_partition and len(wanted[0]) == len(held) and all(
                a is b and s == t for (a, s), (b, t) in zip(wanted[0], held)):  # the same objects: already hooked
            return
        if self.closed:
            raise ParallelWorkerError("This parallel runner has been closed (after close() or a worker failure).")
        self._pool.put("loras", list(wanted[0]), partition)
        self._loras = ((), None)
        _, problem, warnings = self._pool.receive()
        if problem is not None:
            raise LoRAError(problem)
        for line in warnings:
            logging.getLogger("h3_core.lora").warning(line)
        self._loras = wanted  # holding the objects: an identity match can never be a recycled id

    @property
    def processes(self) -> list:
        return list(self._pool.processes)

    @property
    def closed(self) -> bool:
        return self._pool.stopped

    def sample(
        self,
        conditioning,
        seed: int | torch.Generator,
        steps: int = 50,
        video_shift: float = VIDEO_SHIFT,
        audio_shift: float = AUDIO_SHIFT,
        video_sigmas: Sequence[float] | None = None,
        audio_sigmas: Sequence[float] | None = None,
        callback=None,
        preview: bool = False,
        **options,
    ):
        """`pipeline.sample` on the workers; same arguments and result (AVLatents on the CPU). A
        generator `seed` is advanced as a local run would advance it.

        The callback runs here, once per step, with a StepState whose tensors are None unless `preview`
        (then rank 0 sends each step's rows, a device-to-host copy per step). A callback that raises
        stops every worker after the step they are in; the runner stays usable and the exception is
        re-raised. `interrupt()` does the same from another thread (InterruptedError)."""
        if self.closed:
            raise ParallelWorkerError("This parallel runner has been closed (after close() or a worker failure).")
        request = dict(conditioning=conditioning, seed=seed, steps=steps, video_shift=video_shift,
                       audio_shift=audio_shift, video_sigmas=video_sigmas, audio_sigmas=audio_sigmas, **options)
        layout = conditioning.layout.locked(options["keep"]) if options.get("keep") else conditioning.layout
        self._pool.interrupt.clear()
        self._pool.put("sample", request, preview)
        raised = None
        try:
            while True:
                kind, *rest = self._pool.receive()
                if kind == "step" and callback is not None and raised is None:
                    try:
                        callback(self._step_state(layout, *rest))
                    except BaseException as error:  # noqa: BLE001  the caller's way to stop
                        raised = error
                        self._pool.interrupt.set()
                elif kind in ("done", "interrupted", "failed"):
                    break
        except ParallelWorkerError as error:
            for late in getattr(error, "late_steps", []):  # steps finished before the failure still count
                if callback is not None and raised is None:
                    with contextlib.suppress(Exception):
                        callback(self._step_state(layout, *late))
            raise
        except BaseException:  # e.g. Ctrl-C while waiting: don't leave workers mid-request
            self.close()
            raise
        finally:
            self._pool.interrupt.clear()
        if raised is not None:
            raise raised
        if kind == "interrupted":
            raise InterruptedError(f"Sampling was interrupted after step {rest[0]}.")
        if kind == "failed":
            from ..pipeline import SamplingError

            raise SamplingError(rest[0])
        latents, generator_state = rest
        if generator_state is not None:
            seed.set_state(generator_state)
        return latents

    @staticmethod
    def _step_state(layout, step: int, total: int, schedule, rows: dict | None) -> StepState:
        """A step as one device's callback sees it, with the layout the workers sample (a kept modality locked)."""
        names = {f.name for f in dataclasses.fields(StepState)}
        values = dict.fromkeys(names - {"step", "total", "schedule"})
        values.update(rows or {})
        if "layout" in names:
            values["layout"] = layout
        return StepState(step=step, total=total, schedule=schedule, **values)

    def interrupt(self) -> None:
        """Stop the sample in progress after its current step (safe from any thread)."""
        self._pool.interrupt.set()

    def close(self) -> None:
        """Stop and reap every worker (idempotent)."""
        self._finalizer()

    def __enter__(self) -> "ParallelRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve_ranks(
    spec: ModelSpec,
    devices: Sequence[str],
    init_method: str,
    world_size: int,
    first_rank: int,
    shard_weights: bool = False,
) -> int:
    """Run ranks first_rank.. on this machine's `devices` for a runner on another machine (multi-node);
    they take requests from rank 0 over torch.distributed and return when it stops. Exit status: 0, or
    1 if a rank failed (its traceback is printed here; the caller's ranks then wait in a collective
    until their timeout)."""
    if not devices:
        raise ValueError("No devices to serve ranks on: give them, e.g. cuda:0,cuda:1.")
    devices = check_devices(devices, split=True)
    if first_rank < 1 or first_rank + len(devices) > world_size:
        raise ValueError(f"Ranks {first_rank}..{first_rank + len(devices) - 1} do not fit a world of {world_size} "
                         "whose rank 0 is the caller's first device.")
    check_degree(spec.dit_config(), world_size)
    ctx = mp.get_context("spawn")
    setups = [
        _Setup(first_rank + i, world_size, str(torch.device(d)), init_method, spec, shard_weights, None, os.getpid())
        for i, d in enumerate(devices)
    ]
    processes = [ctx.Process(target=_worker, args=(s, None, None, None), name=f"h3-worker-{s.rank}") for s in setups]
    for process in processes:
        process.start()
    try:
        for process in processes:
            process.join()
    except KeyboardInterrupt:
        for process in processes:
            process.terminate()
        for process in processes:
            process.join()
    return 0 if all(p.exitcode == 0 for p in processes) else 1
