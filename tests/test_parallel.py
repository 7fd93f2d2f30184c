"""Several worker processes (gloo on the CPU) give the single-process results.

Sequence parallel over 2 and 4 ranks (S = 717 and 725 rows: neither divides by 2 or 4, so padding is
exercised), FSDP-style sharded weights, interrupts that stop every rank at the same step, and worker
failures that come back with their rank and traceback and leave no process running.

Tolerance 1e-5 (fp32): the split only changes which rows a GEMM sees and which heads an attention
call holds, not the arithmetic of any row or head (in practice the results are bitwise equal).
"""

import dataclasses
import gc
import multiprocessing
import os
import re
import signal
import types

import pytest
import torch
import torch.distributed as dist

from parallel_faults import FailingSpec

from h3_core import pipeline
from h3_core.conditioning import Conditioning
from h3_core.config import TINY_DIT
from h3_core.layout import build_request_layout
from h3_core.parallel import ModelSpec, ParallelRunner, ParallelWorkerError
from h3_core.parallel.sharding import shard_blocks
from h3_core.pipeline import sample
from h3_core.placement import check_devices
from h3_core.tiny import TINY_RANDOM

HEADS4 = dataclasses.replace(TINY_DIT, num_attention_heads=4)  # TINY_DIT has 2 heads; 4 ranks need 4
SPEC = ModelSpec(TINY_RANDOM, dtype=torch.float32, attention="sdpa", config=HEADS4)
TOLERANCE = 1e-5
STEPS = 4  # sigma points: 3 forwards


def conditioning(keyframe: bool) -> Conditioning:
    """t2va (S = 717) or fl2va with a first keyframe (S = 725; visual-condition clock too)."""
    tags = torch.tensor([1, 1, 0, 0, 1, 1, 1])
    layout = build_request_layout(128, 64, 124, tags, keyframe_anchors=("first",) if keyframe else ())
    text = torch.randn(1, 7, HEADS4.text_dim, generator=torch.Generator().manual_seed(5))
    latents = [torch.randn(1, 24, 1, 4, 8, generator=torch.Generator().manual_seed(6))] if keyframe else []
    return Conditioning("fl2va" if keyframe else "t2va", 128, 64, 124, layout, text, tags, latents)


@pytest.fixture(scope="module")
def references():
    model = SPEC.load("cpu")
    return {keyframe: sample(model, conditioning(keyframe), seed=3, steps=STEPS) for keyframe in (False, True)}


def assert_close(got, want):
    for a, b in ((got.video, want.video), (got.audio, want.audio)):
        assert a.shape == b.shape
        assert a.numel() == 0 or (a - b).abs().max().item() <= TOLERANCE  # a held modality has no latents


def assert_all_gone(runner):
    for process in runner.processes:
        assert not process.is_alive() and process.exitcode is not None
        with pytest.raises(ProcessLookupError):  # reaped, not a zombie
            os.kill(process.pid, 0)


@pytest.fixture(scope="module")
def two_ranks():
    runner = ParallelRunner(SPEC, ["cpu", "cpu"], threads=1)
    yield runner
    runner.close()
    assert_all_gone(runner)


@pytest.mark.parametrize("keyframe", [False, True], ids=["t2va", "fl2va"])
def test_two_ranks_match_one_process(two_ranks, references, keyframe):
    steps = []
    latents = two_ranks.sample(conditioning(keyframe), 3, STEPS, callback=lambda state: steps.append(state.step))
    assert steps == [1, 2, 3]
    assert_close(latents, references[keyframe])


@pytest.mark.parametrize("keep", ["video", "audio"])
def test_a_kept_modality_splits_like_a_plain_request(two_ranks, keep):
    """keep= reaches the workers: the sound for a given video (or a video to a given sound) over two ranks."""
    from h3_core.output import AVLatents

    layout = conditioning(True).layout
    generator = torch.Generator().manual_seed(8)
    given = AVLatents(torch.randn(1, 24, layout.latent_frames, layout.latent_height, layout.latent_width,
                                  generator=generator),
                      torch.randn(2, 32, layout.audio_latents, generator=generator))
    expected = sample(SPEC.load("cpu"), conditioning(True), 3, STEPS, init=given, keep=keep)
    got = two_ranks.sample(conditioning(True), 3, STEPS, init=given, keep=keep)
    assert_close(got, expected)
    assert torch.equal(getattr(got, keep), getattr(given, keep))


def test_a_window_that_holds_its_video_splits_like_one_process(two_ranks):
    """A long video's kept-clip window (its layout locked to video, the clip its last visual condition): the
    ranks give one process's sound and no video latents (long_video keeps the clip)."""
    plain = conditioning(True)
    layout = plain.layout
    clip = torch.randn(1, 24, layout.latent_frames, layout.latent_height, layout.latent_width,
                       generator=torch.Generator().manual_seed(9))
    held = dataclasses.replace(plain, layout=layout.locked("video"),
                               visual_condition_latents=[*plain.visual_condition_latents, clip])
    expected = sample(SPEC.load("cpu"), held, 3, STEPS)
    got = two_ranks.sample(held, 3, STEPS)
    assert got.video.shape == (1, 24, 0, layout.latent_height, layout.latent_width)
    assert_close(got, expected)


def test_a_pruned_file_splits_with_sharded_weights_like_one_process(tmp_path):
    """A curve-form file (fp32 AdaLN over the table's columns) read by each worker, its weights sharded."""
    from test_curve_form import comfy_curve_file, curve_model

    from h3_core.dit import H3DiT
    from h3_core.tiny import seeded_random_weights

    path = tmp_path / "h3_fl2va_pruned_bf16.safetensors"
    comfy_curve_file(path, curve_model(seeded_random_weights(H3DiT(HEADS4), 1)))
    spec = dataclasses.replace(SPEC, source=str(path), config=None)
    expected = sample(spec.load("cpu"), conditioning(False), 3, STEPS)
    runner = ParallelRunner(spec, ["cpu", "cpu"], shard_weights=True, threads=1)
    try:
        assert_close(runner.sample(conditioning(False), 3, STEPS), expected)
    finally:
        runner.close()


def test_a_gguf_file_splits_with_sharded_weights_like_one_process(tmp_path):
    """A GGUF file (Q4_K block linears, held as their GGML blocks) read by each worker, its bytes sharded. One
    block's fc2 is Q6_K, as llama.cpp's *_M mixes have it: the blocks differ in size (every gather used the first
    block's, and the collective failed)."""
    pytest.importorskip("gguf", reason="GGUF files are written with the gguf package (a dependency)")
    import gguf_files

    from h3_core.dit import H3DiT
    from h3_core.tiny import seeded_random_weights

    config = dataclasses.replace(HEADS4, attention_head_dim=64, hidden_size=256, ffn_dim=256, rope_freq_dim=8)
    model = seeded_random_weights(H3DiT(config), 1)
    linears = {f"blocks.{i}.{leaf}.weight": "Q4_K" for i in range(config.num_layers)
               for leaf in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")}
    linears["blocks.1.mlp.fc2.weight"] = "Q6_K"
    path = tmp_path / "h3_fl2va-Q4_K_M.gguf"
    gguf_files.write_gguf(path, model.state_dict(), linears)
    spec = dataclasses.replace(SPEC, source=str(path), config=None)
    loaded = spec.load("cpu")
    assert loaded.blocks[1].mlp.fc2.held == "gguf"
    expected = sample(loaded, conditioning(False), 3, STEPS)
    runner = ParallelRunner(spec, ["cpu", "cpu"], shard_weights=True, threads=1)
    try:
        assert_close(runner.sample(conditioning(False), 3, STEPS), expected)
    finally:
        runner.close()


def test_four_ranks_with_sharded_weights_match_one_process(references):
    runner = ParallelRunner(SPEC, ["cpu"] * 4, shard_weights=True, threads=1)
    for keyframe in (False, True):
        assert_close(pipeline.sample(runner, conditioning(keyframe), 3, STEPS), references[keyframe])
    processes = runner.processes
    del runner  # unloading (the last reference dropped) stops the workers, as close() does
    gc.collect()
    assert_all_gone(types.SimpleNamespace(processes=processes))


def test_a_raising_callback_stops_every_rank_and_the_runner_stays_usable(two_ranks, references):
    class Stop(Exception):
        pass

    def stop_at_two(state):
        if state.step == 2:
            raise Stop

    with pytest.raises(Stop):
        two_ranks.sample(conditioning(False), 3, STEPS, callback=stop_at_two)
    assert all(p.is_alive() for p in two_ranks.processes)
    # interrupt() (safe from any thread, as a UI would call it): every rank stops after the same step,
    # long before the 29 forwards of this ladder are done
    with pytest.raises(InterruptedError, match=r"interrupted after step [1-9]\."):
        two_ranks.sample(conditioning(False), 3, 30, callback=lambda state: two_ranks.interrupt())
    assert_close(two_ranks.sample(conditioning(False), 3, STEPS), references[False])


def test_a_temporary_folder_with_url_characters_holds_the_rendezvous(tmp_path, monkeypatch, references):
    """The private rendezvous is opened as a path: a '?' or '#' in TMPDIR is part of the name (as a file:// URL
    it had cut the path and failed in the workers with an IndexError)."""
    import tempfile

    odd = tmp_path / "a?b#c %20"
    odd.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(odd))
    with ParallelRunner(SPEC, ["cpu", "cpu"], threads=1) as runner:
        assert [p.name for p in odd.iterdir()][0].startswith("h3-rendezvous-")
        assert_close(sample(runner, conditioning(False), 3, STEPS), references[False])
    assert not list(odd.iterdir())


def test_the_runner_says_what_rank_0_loaded_as_one_device_would(two_ranks):
    assert two_ranks.load_notes == ["attention: sdpa"]


def test_preview_steps_carry_the_rows(two_ranks):
    seen = []
    two_ranks.sample(conditioning(False), 3, STEPS, preview=True, callback=seen.append)
    assert [s.video_rows.shape[1] for s in seen] == [conditioning(False).layout.video_indices.numel()] * 3
    assert seen[-1].schedule.video.numel() == STEPS


def test_a_failure_while_loading_is_a_clear_error_and_no_worker_is_left(two_ranks):
    spec = FailingSpec(TINY_RANDOM, dtype=torch.float32, attention="sdpa", config=HEADS4, fail_call=0)
    with pytest.raises(ParallelWorkerError, match=r"(?s)rank 1 on cpu failed: RuntimeError: injected failure while "
                                                  r"loading.*traceback in the worker.*All workers have been stopped"):
        ParallelRunner(spec, ["cpu", "cpu"], threads=1)
    left = [p for p in multiprocessing.active_children() if p.name.startswith("h3-worker")]
    assert set(left) <= set(two_ranks.processes)


def test_a_worker_that_cannot_compile_is_said_as_compile_failing(monkeypatch, capsys):
    """torch.compile failing in a worker (no C++ compiler) reaches `h3 --compile` as the one-line --compile
    refusal a single device gives, not a worker traceback."""
    from h3_core.cli import main as h3

    spec = FailingSpec(TINY_RANDOM, dtype=torch.float32, attention="sdpa", config=HEADS4, compiling=True)
    with pytest.raises(ParallelWorkerError, match="rank 1 on cpu failed: InductorError") as caught:
        ParallelRunner(spec, ["cpu", "cpu"], threads=1)
    assert caught.value.compile_failed and caught.value.summary.startswith("InductorError: RuntimeError: No working C++")
    monkeypatch.setattr("h3_core.cli.generate_batch", lambda *a, **k: (_ for _ in ()).throw(caught.value))
    argv = ["generate", "--prompt", "x", "--save-latents", "x.safetensors", "--devices", "cpu,cpu"]
    assert h3(argv + ["--compile"]) == 2
    assert capsys.readouterr().err == ("h3: error: --compile: torch.compile cannot build the DiT's blocks here "
                                       "(InductorError: RuntimeError: No working C++ compiler found); drop --compile "
                                       "(it only speeds the steps up).\n")
    assert h3(argv) == 1  # without --compile the worker's error stays as it is
    assert "traceback in the worker" in capsys.readouterr().err


def test_a_script_that_starts_workers_at_import_is_told_to_guard_it(tmp_path):
    """Each spawned worker imports the caller's script again: one without `if __name__ == "__main__":` makes the
    workers fail before they can report; the error says why, not 'out of memory?'."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text("import torch\n"
                      "from h3_core.parallel import ModelSpec, ParallelRunner\n"
                      "ParallelRunner(ModelSpec('tiny-random', dtype=torch.float32, attention='sdpa'), ['cpu', 'cpu'], "
                      "threads=1).close()\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 1
    assert re.search(r"ParallelWorkerError: H3 worker rank \d on cpu failed: the worker process exited with code 1 "
                     r"before it could report \(its output above says why\)\. A script that splits the DiT must "
                     r"start it under `if __name__ == \"__main__\":`", run.stderr), run.stderr[-3000:]
    assert "out of memory" not in run.stderr


def test_a_second_ctrl_c_while_stopping_still_ends_every_worker_and_the_rendezvous(tmp_path):
    """Ctrl-C, then Ctrl-C again while the workers are asked to finish: the second interrupt goes on up, and
    no worker or private rendezvous folder is left behind."""
    from h3_core.parallel.workers import RENDEZVOUS_PREFIX, _Pool, _Setup

    folder = tmp_path / f"{RENDEZVOUS_PREFIX}x"
    folder.mkdir()
    setups = [_Setup(rank, 2, "cpu", "file://" + str(folder / "store"), SPEC, False, 1, os.getpid()) for rank in (0, 1)]
    pool = _Pool(setups, str(folder))
    pool.start()

    def interrupted(*message):
        raise KeyboardInterrupt

    pool.put = interrupted
    with pytest.raises(KeyboardInterrupt):
        pool.stop()
    assert not folder.exists()
    for process in pool.processes:
        assert not process.is_alive() and process.exitcode is not None


def test_a_failure_mid_sample_stops_every_worker(references):
    spec = FailingSpec(TINY_RANDOM, dtype=torch.float32, attention="sdpa", config=HEADS4, fail_call=2)
    runner = ParallelRunner(spec, ["cpu", "cpu"], threads=1)
    steps = []
    with pytest.raises(ParallelWorkerError, match=r"(?s)rank 1 on cpu failed: RuntimeError: injected failure in a "
                                                  r"forward.*in hook"):
        runner.sample(conditioning(False), 3, STEPS, callback=lambda state: steps.append(state.step))
    # rank 0 waited in the second forward's all-to-all until it was stopped: it never reported step 2.
    # Its step-1 report and rank 1's error travel through one queue from two processes, so the error can
    # arrive first (seen once in CI); the runner then still delivers the late report before raising.
    assert steps == [1]
    assert runner.closed
    assert_all_gone(runner)
    with pytest.raises(ParallelWorkerError, match="closed"):
        runner.sample(conditioning(False), 3, STEPS)


def test_a_killed_worker_is_named_not_the_survivor_it_took_down(references):
    """A rank killed mid-run (the kernel's out-of-memory killer, say) makes its peer fail in a collective: the
    error names the killed rank and its signal first."""
    runner = ParallelRunner(SPEC, ["cpu", "cpu"], threads=1)

    def kill_rank_1(state):
        if state.step == 1:
            os.kill(runner.processes[1].pid, signal.SIGKILL)

    with pytest.raises(ParallelWorkerError, match=r"rank 1 on cpu (was killed \(SIGKILL; out of memory\?\), so|failed: "
                                                  r"the worker process was killed \(SIGKILL; out of memory\?\))"):
        runner.sample(conditioning(False), 3, 30, callback=kill_rank_1)
    assert runner.closed
    assert_all_gone(runner)


def test_bad_sample_arguments_leave_the_runner_running(two_ranks, references):
    """Checked in the caller, as on one device: in a worker they would end the runner (the model read again)."""
    good = conditioning(False)
    wide = dataclasses.replace(good, text_states=torch.randn(1, 7, HEADS4.text_dim + 8))
    locked = good.layout.locked("audio")  # a driving track's: its audio held
    driven = dataclasses.replace(good, layout=locked, audio_condition_rows=torch.zeros(
        1, locked.num_condition_audio_rows, good.audio_condition_rows.shape[-1]))
    kept = sample(two_ranks, good, 3, STEPS)
    for request, bad, message in ((good, dict(steps=1), "steps"), (good, dict(steps=STEPS, video_shift=-1.0), "shift"),
                                  (good, dict(steps=STEPS, keep="sound"), "keep"),
                                  (wide, dict(steps=STEPS), "text states are 56 wide, this DiT takes 48"),
                                  (driven, dict(steps=STEPS, init=kept, keep="video"), "already holds its audio")):
        with pytest.raises(ValueError, match=message):
            sample(two_ranks, request, 3, **bad)
    assert not two_ranks.closed and all(p.is_alive() for p in two_ranks.processes)
    assert_close(sample(two_ranks, conditioning(False), 3, STEPS), references[False])


def test_nan_latents_are_refused_and_the_workers_stay_up():
    """Every rank finds the NaN latents after the last step: said as on one device (SamplingError), and the
    workers serve the next request instead of ending (the model read again)."""
    from parallel_faults import NaNSpec

    from h3_core.pipeline import SamplingError

    spec = NaNSpec(**{f.name: getattr(SPEC, f.name) for f in dataclasses.fields(SPEC)})
    with pytest.raises(SamplingError, match="NaN or infinite latents"):
        sample(spec.load("cpu"), conditioning(False), 3, STEPS)
    runner = ParallelRunner(spec, ["cpu", "cpu"], threads=1)
    try:
        for _ in range(2):
            with pytest.raises(SamplingError, match="NaN or infinite latents"):
                sample(runner, conditioning(False), 3, STEPS)
        assert not runner.closed and all(p.is_alive() for p in runner.processes)
    finally:
        runner.close()


def test_a_worker_killed_by_a_real_time_signal_is_named_by_its_number():
    from h3_core.parallel.workers import _silent_exit

    assert "killed (signal 40; out of memory?)" in _silent_exit(-40)
    assert "killed (SIGKILL; out of memory?)" in _silent_exit(-9)


def test_bad_device_lists_are_refused_before_any_process_starts(monkeypatch, capsys):
    from h3_core.cli import main as h3
    from h3_core.parallel import serve_ranks

    with pytest.raises(ValueError, match=r"2 attention heads evenly \(each takes an equal share\); use 2 devices\."):
        ParallelRunner(ModelSpec(TINY_RANDOM), ["cpu"] * 4)
    with pytest.raises(ValueError, match="all CUDA devices or all 'cpu'"):
        ParallelRunner(SPEC, ["cpu", "cuda:0"])
    with pytest.raises(ValueError, match="world_size 2 counts ranks on other machines.*give it"):
        ParallelRunner(SPEC, ["cpu"], world_size=2)  # no rendezvous for them: it would wait forever
    with pytest.raises(ValueError, match="cuda:0 is named more than once in cuda:1, cuda:0, cuda; each worker needs "
                                         "a GPU of its own"):  # before asking whether they exist: none do here
        ParallelRunner(SPEC, ["cuda:1", "cuda:0", "cuda"])
    assert check_devices(" cpu, cpu ,", split=True) == [torch.device("cpu")] * 2  # a string is a comma-separated list
    assert check_devices(iter(["cpu", "cpu"]), split=True) == [torch.device("cpu")] * 2  # any iterable, read once
    with pytest.raises(ValueError, match=r"^'gpu', 'cuda:x': not a device name such as cpu, cuda or cuda:1\.$"):
        check_devices(["cpu", "gpu", "cuda:x"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # a worker's GPU is named by its index: set_device
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)  # refused a bare "cuda" after the workers started
    assert check_devices("cuda, cuda:1", split=True) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert check_devices(["cuda"]) == [torch.device("cuda")]  # one device: as given
    monkeypatch.undo()
    for kind in ("mps", "xpu"):  # a kind this torch cannot use: said at once, not a traceback from a model's load
        if not getattr(torch.backends if kind == "mps" else torch, kind).is_available():
            with pytest.raises(ValueError, match=f"^{kind}: this torch build has no {kind} device here; use cpu or "
                                                 "cuda"):
                check_devices([kind])
            assert h3(["generate", "--prompt", "x", "--save-latents", "x.safetensors", "--device", kind]) == 2
            assert f"h3: error: {kind}: this torch build has no {kind} device here" in capsys.readouterr().err
    with pytest.raises(ValueError, match="^meta is torch's device of shapes without data: nothing runs there"):
        check_devices(["meta"])
    assert h3(["generate", "--prompt", "x", "--save-latents", "x.safetensors", "--device", "meta"]) == 2
    assert "h3: error: meta is torch's device of shapes without data" in capsys.readouterr().err
    with pytest.raises(ValueError, match="must be all CUDA devices or all 'cpu'; got cpu, meta"):
        pipeline.check_settings(pipeline.GenerateSettings(devices=["cpu", "meta"]))  # before any model loads
    with pytest.raises(ValueError, match="No devices to serve"):
        serve_ranks(SPEC, [], "tcp://127.0.0.1:1", 2, 1)
    with pytest.raises(ValueError, match=r"2 attention heads evenly \(each takes an equal share\); use 2 devices\."):
        serve_ranks(ModelSpec(TINY_RANDOM), ["cpu"], "tcp://127.0.0.1:1", 3, 1)
    assert h3(["generate", "--prompt", "x", "--save-latents", "x.safetensors", "--devices", "cpu"]) == 2
    assert "h3: error: --devices splits the DiT over two or more devices, got 'cpu'" in capsys.readouterr().err
    monkeypatch.setattr("h3_core.cli.generate_batch", lambda *a, **k: (_ for _ in ()).throw(
        ParallelWorkerError("H3 worker rank 1 on cpu failed: RuntimeError: boom")))
    assert h3(["generate", "--prompt", "x", "--save-latents", "x.safetensors", "--devices", "cpu,cpu"]) == 1
    assert capsys.readouterr().err == "h3: error: H3 worker rank 1 on cpu failed: RuntimeError: boom\n"  # no traceback


def test_each_rank_keeps_its_own_share_of_a_units_bytes():
    """A unit's weights packed into bytes, padded to a multiple of P: rank r keeps bytes [r*n, (r+1)*n) as its
    own copy (a view would keep the whole buffer alive on every rank), the shards put back together as the
    all-gather does give every weight bitwise, and between forwards the parameters point at nothing."""
    from h3_core.offload import _packing
    from h3_core.parallel.sharding import _Unit

    g = torch.Generator().manual_seed(0)
    originals = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g).to(torch.bfloat16)]
    world, packed = 3, _packing(originals)[1]
    units = [_Unit([torch.nn.Parameter(t.clone(), requires_grad=False) for t in originals], world, rank, "cpu")
             for rank in range(world)]
    for unit in units:
        assert unit.whole_bytes == world * unit.shard_bytes and packed <= unit.whole_bytes < packed + world
        assert unit.shard.numel() == unit.shard.untyped_storage().nbytes() == unit.shard_bytes
        assert all(p.numel() == 0 for p in unit.params)
    units[1].point_into(torch.cat([unit.shard for unit in units]))
    for param, original in zip(units[1].params, originals):
        assert param.dtype == original.dtype and torch.equal(param, original)


def test_sharded_blocks_hold_only_their_shard_between_forwards(tmp_path, monkeypatch):
    """One rank (a world of 1, in this process), three blocks (two buffers take turns): the hooks gather, point,
    release and reuse buffers without changing a bit, every forward waits only for its first block's gather (each
    later one started while the block before computed), and no block weight is reachable between forwards."""
    import h3_core.parallel.sharding as sharding

    spec = dataclasses.replace(SPEC, config=dataclasses.replace(HEADS4, num_layers=3))
    want = sample(spec.load("cpu"), conditioning(True), seed=3, steps=STEPS)
    waited, gather = [], sharding.all_gather_single

    def recorded(*args, **kwargs):
        waited.append(kwargs.get("async_op") is False)  # a block's gather the forward waits for; AdaLN's pass none
        return gather(*args, **kwargs)

    monkeypatch.setattr(sharding, "all_gather_single", recorded)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = spec.load("cpu")
        sharder = shard_blocks(model, None, "cpu")
        forwards = []
        model.blocks[0].register_forward_pre_hook(lambda module, args: forwards.append(1))
        assert all(p.numel() == 0 for block in model.blocks for p in block.parameters())
        assert_close(sample(model, conditioning(True), seed=3, steps=STEPS), want)
        assert all(p.numel() == 0 for block in model.blocks for p in block.parameters())
        assert not sharder.pending
    finally:
        dist.destroy_process_group()
    assert forwards and sum(waited) == len(forwards)


def test_cli_shard_weights_needs_devices(capsys):
    from h3_core.cli import main as h3

    assert h3(["generate", "--prompt", "x", "--save-latents", "x.safetensors", "--shard-weights"]) == 2
    # the option's name alone: "shard_weights (--shard-weights)" was the engine's name, then the option's
    assert ("h3: error: --shard-weights splits the DiT's weights over several devices; give two or more with "
            "--devices.") in capsys.readouterr().err


def test_gpu_memory_with_devices_says_it_does_not_limit_the_split_dit(monkeypatch, capsys, tmp_path):
    """--gpu-memory places the text encoder; the split DiT is not streamed against it: said before the workers
    start (it was silently ignored)."""
    from h3_core import parallel
    from h3_core.cli import main as h3

    class Started(Exception):
        pass

    def runner(*args, **kwargs):
        raise Started

    monkeypatch.setattr(parallel, "ParallelRunner", runner)
    with pytest.raises(Started):
        h3(["generate", "--prompt", "x", "--steps", "2", "--save-latents", str(tmp_path / "x.safetensors"), "--devices",
            "cpu,cpu", "--gpu-memory", "0.001"])
    assert ("h3: memory: --gpu-memory (gpu_memory) placed the text encoder only; split over devices, the DiT is not "
            "streamed: each device holds its share whole") in capsys.readouterr().err


def test_loras_hooked_into_the_workers_match_one_process(two_ranks):
    """use_loras: the workers hook the adapters in (dynamic) and give the one-process LoRA result; sharded
    weights too; an empty list takes them out; an adapter that does not fit is refused with the
    LoRAError and the workers stay up without adapters."""
    from lora_files import fused, random_spec, write_native

    from h3_core.lora import LoRAError, apply_loras, load_lora, remove_loras

    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        good = load_lora(write_native(Path(tmp) / "good.safetensors", fused(random_spec(HEADS4, seed=8, shared_qkv_a=True))))
        wrong = dataclasses.replace(HEADS4, hidden_size=HEADS4.hidden_size * 2)
        bad = load_lora(write_native(Path(tmp) / "bad.safetensors", fused(random_spec(wrong, seed=8, shared_qkv_a=True))))
    model = SPEC.load("cpu")
    plain = sample(model, conditioning(False), seed=3, steps=STEPS)
    apply_loras(model, [(good, 0.7)], partition="fl2va", mode="dynamic")
    expected = sample(model, conditioning(False), seed=3, steps=STEPS)
    remove_loras(model)

    two_ranks.use_loras([(good, 0.7)], "fl2va")
    assert_close(sample(two_ranks, conditioning(False), seed=3, steps=STEPS), expected)
    two_ranks.use_loras([], "fl2va")
    assert_close(sample(two_ranks, conditioning(False), seed=3, steps=STEPS), plain)
    import logging

    warned = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("h3_core.lora").addHandler(handler)
    try:  # the workers' warnings are said once, in this process's log (ComfyUI's), as a one-device run says them
        two_ranks.use_loras([(good, 0.5), (good, 0.5)], "fl2va")
    finally:
        logging.getLogger("h3_core.lora").removeHandler(handler)
    assert warned == ["good.safetensors is applied 2 times: its deltas add up"]
    two_ranks.use_loras([], "fl2va")
    with pytest.raises(LoRAError):
        two_ranks.use_loras([(bad, 1.0)], "fl2va")
    assert all(p.is_alive() for p in two_ranks.processes)
    assert_close(sample(two_ranks, conditioning(False), seed=3, steps=STEPS), plain)

    sharded = ParallelRunner(SPEC, ["cpu", "cpu"], shard_weights=True, threads=1)
    try:
        sharded.use_loras([(good, 0.7)], "fl2va")
        assert_close(sample(sharded, conditioning(False), seed=3, steps=STEPS), expected)
    finally:
        sharded.close()


def test_a_runs_adapters_come_and_go_above_the_specs_own_loras(tmp_path):
    """use_loras([]) took out every LoRA on the workers' DiT, the spec's own too (merged at load): the runner then
    sampled the bare base model."""
    from lora_files import fused, random_spec, write_native

    from h3_core.lora import load_lora

    own = write_native(tmp_path / "own.safetensors", fused(random_spec(HEADS4, seed=8, shared_qkv_a=True)))
    other = load_lora(write_native(tmp_path / "other.safetensors", fused(random_spec(HEADS4, seed=9, shared_qkv_a=True))))
    runner = ParallelRunner(dataclasses.replace(SPEC, loras=((str(own), 0.7),)), ["cpu", "cpu"], threads=1)
    try:
        first = sample(runner, conditioning(False), seed=3, steps=STEPS)
        runner.use_loras([(other, 0.5)], "fl2va")
        runner.use_loras([], "fl2va")
        assert_close(sample(runner, conditioning(False), seed=3, steps=STEPS), first)
    finally:
        runner.close()


def test_a_sharded_worker_reads_onto_the_cpu_and_checks_fp8_matmuls_where_it_runs(monkeypatch, tmp_path):
    """Sharded workers read their model into CPU memory first: `fp8-lossy` was checked for FP8 matmuls there,
    which torch 2.11's CPU lacks, so every GPU worker refused it. The check is for the device it runs on."""
    from safetensors.torch import save_file

    from h3_core import fp8

    monkeypatch.setattr(fp8, "scaled_mm_supported", lambda kind, index=None: kind == "cuda")  # torch 2.11's CPU
    path = tmp_path / "h3_fl2va_bf16.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in SPEC.load("cpu").state_dict().items()}, str(path))
    for source in (TINY_RANDOM, str(path)):  # quantized after the load; as the file is read
        spec = dataclasses.replace(SPEC, source=source, dtype=torch.bfloat16, linears="fp8-lossy")
        with pytest.raises(ValueError, match="FP8 matmuls are not supported on cpu"):
            spec.load("cpu")
        model = spec.load("cpu", compute=torch.device("cuda", 0))
        fc1 = model.blocks[0].mlp.fc1
        assert isinstance(fc1, fp8.FP8Linear) and fc1.matmul == "scaled" and fc1.weight.device.type == "cpu"

    from h3_core.parallel import workers  # a sharded worker's load, as one rank of one (its GPU's sharding faked)

    sharded = []
    monkeypatch.setattr(workers.sharding, "shard_blocks", lambda dit, group, device: sharded.append(device))
    setup = workers._Setup(0, 1, "cuda:0", "", spec, True, None, os.getpid())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert isinstance(workers._load(setup, torch.device("cuda", 0), None, None).blocks[0].mlp.fc1, fp8.FP8Linear)
    finally:
        dist.destroy_process_group()
    assert sharded == [torch.device("cuda", 0)]


def test_fp8_linears_with_sharded_weights_match_one_process():
    """FP8 block linears (e4m3 weights + fp32 scales, `--linears fp8-weights-lossy`) shard like bf16
    ones: two ranks holding half of every block give the one-process FP8 result."""
    spec = dataclasses.replace(SPEC, linears="fp8-weights-lossy")
    model = spec.load("cpu")
    assert any(p.dtype == torch.float8_e4m3fn for p in model.blocks[0].parameters())
    expected = sample(model, conditioning(False), seed=3, steps=STEPS)
    runner = ParallelRunner(spec, ["cpu", "cpu"], shard_weights=True, threads=1)
    try:
        assert_close(sample(runner, conditioning(False), seed=3, steps=STEPS), expected)
    finally:
        runner.close()


def test_compiled_blocks_with_sharded_weights_match_one_process(references):
    """Sharded blocks run their compiled forward (the gathers hook the block and its AdaLN projection,
    around the graph): the one-process result up to float rounding."""
    runner = ParallelRunner(dataclasses.replace(SPEC, compile=True), ["cpu", "cpu"], shard_weights=True, threads=1)
    try:
        assert_close(pipeline.sample(runner, conditioning(False), 3, STEPS), references[False])
    finally:
        runner.close()


def test_the_attention_window_splits_like_full_attention(references):
    """The lossy attention window (set in the spec) over two ranks: each rank's heads still see every
    row, so the one-process windowed result comes back; and it is not the full-attention one."""
    spec = dataclasses.replace(SPEC, attention_window=2)
    expected = sample(spec.load("cpu"), conditioning(True), seed=3, steps=STEPS)
    assert (expected.video - references[True].video).abs().max() > 1e-4
    runner = ParallelRunner(spec, ["cpu", "cpu"], threads=1)
    try:
        assert_close(sample(runner, conditioning(True), seed=3, steps=STEPS), expected)
    finally:
        runner.close()


def test_a_machine_serving_ranks_takes_the_callers_model_options(monkeypatch):
    """`python -m h3_core.parallel` on another machine must build the same DiT as the caller's ModelSpec."""
    import h3_core.parallel.__main__ as serve

    seen = {}
    monkeypatch.setattr(serve, "serve_ranks", lambda spec, devices, *rest: seen.update(spec=spec, devices=devices) or 0)
    argv = ["--model", "tiny-random", "--devices", "cpu,cpu", "--init-method", "tcp://x:1", "--world-size", "4",
            "--first-rank", "2", "--linears", "fp8-weights-lossy", "--compile", "--attention-window-lossy", "8",
            "--attention-window-dense-steps", "3", "--attention", "sdpa"]
    assert serve.main(argv) == 0
    spec = seen["spec"]
    assert (spec.linears, spec.compile, spec.attention_window, spec.attention_window_dense_steps, spec.attention) == (
        "fp8-weights-lossy", True, 8, 3, "sdpa") and seen["devices"] == ["cpu", "cpu"]
    assert serve.main(argv + ["--shard-weights"]) == 0 and seen["spec"].compile  # compiled sharded blocks too


def check_a_served_rank(local: str, served: str, tolerance: float = TOLERANCE, other_options: tuple = ()) -> None:
    """The multi-machine path run on one machine: rank 0 in a runner on `local`, rank 1 on `served` in the
    process tree of `python -m h3_core.parallel` (as on a second machine), meeting at a TCP rendezvous. The
    result equals one process's on `local`, and the serving side exits cleanly when the runner closes; served
    with `other_options` than the runner's, both sides refuse, naming the option."""
    import socket
    import subprocess
    import sys

    spec = ModelSpec(TINY_RANDOM, dtype=torch.float32, attention="sdpa")  # the serving side builds TINY_DIT too
    expected = sample(spec.load(local), conditioning(False), seed=3, steps=STEPS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_method = f"tcp://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "h3_core.parallel", "--model", TINY_RANDOM, "--dtype", "fp32", "--attention", "sdpa",
         "--devices", served, "--init-method", init_method, "--world-size", "2", "--first-rank", "1", *other_options],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    runner = None
    try:
        if other_options:
            with pytest.raises(ParallelWorkerError, match=r"different model options \(attention_window: rank 0 0, rank "
                                                          r"1 2; attention_window_dense_steps: rank 0 0, rank 1 1\)"):
                ParallelRunner(spec, [local], init_method=init_method, world_size=2, threads=1)
            assert server.wait(timeout=120) == 1
            return
        runner = ParallelRunner(spec, [local], init_method=init_method, world_size=2, threads=1)
        got = sample(runner, conditioning(False), seed=3, steps=STEPS)
        for a, b in ((got.video, expected.video), (got.audio, expected.audio)):
            assert a.shape == b.shape and (a.float().cpu() - b.float().cpu()).abs().max().item() <= tolerance
    finally:
        if runner is not None:
            runner.close()
        try:
            output = server.communicate(timeout=120)[0]
        except subprocess.TimeoutExpired:
            server.kill()
            output = server.communicate()[0]
    assert server.returncode == 0, output


def test_the_serving_command_help_shows_its_whole_example(capsys):
    from h3_core.parallel.__main__ import main as serve

    with pytest.raises(SystemExit):
        serve(["--help"])
    assert "--init-method tcp://NODE0:29500 --world-size 8 --first-rank 4" in capsys.readouterr().out


def test_ranks_served_from_another_process_join_over_tcp_and_match_one_process():
    check_a_served_rank("cpu", "cpu")


def test_ranks_served_with_other_model_options_are_refused():
    """Served with an attention window the runner lacks, the ranks would compute another model: refused."""
    check_a_served_rank("cpu", "cpu", other_options=("--attention-window-lossy", "2",
                                                     "--attention-window-dense-steps", "1"))


def _serve_rank_1(spec_args: list[str], init_method: str):
    """`python -m h3_core.parallel` serving rank 1 of 2 on the CPU, as a second machine would."""
    import subprocess
    import sys

    return subprocess.Popen(
        [sys.executable, "-m", "h3_core.parallel", "--model", TINY_RANDOM, "--dtype", "fp32", "--attention", "sdpa",
         "--devices", "cpu", "--init-method", init_method, "--world-size", "2", "--first-rank", "1", *spec_args],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)


def _tcp_rendezvous() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_a_rank_on_another_machine_that_fails_is_named_with_its_error(tmp_path):
    """A served rank has no queue to the caller: its failure (here its copy of the adapter is damaged) reaches
    the caller through the rendezvous store, named with its rank and error, not as rank 0 losing its connection;
    one that goes away without a word (killed) is said to be on another machine."""
    from lora_files import fused, random_spec, write_native

    (tmp_path / "here").mkdir()
    good = write_native(tmp_path / "here" / "adapter.safetensors", fused(random_spec(TINY_DIT, seed=8, shared_qkv_a=True)))
    damaged = tmp_path / "there" / "adapter.safetensors"  # compared by file name: the same adapter, it seems
    damaged.parent.mkdir()
    damaged.write_bytes(good.read_bytes()[:200])
    spec = ModelSpec(TINY_RANDOM, dtype=torch.float32, attention="sdpa", loras=((str(good), 0.7),))
    init_method = _tcp_rendezvous()
    server = _serve_rank_1(["--lora", f"{damaged}:0.7"], init_method)
    try:
        with pytest.raises(ParallelWorkerError) as failed:
            ParallelRunner(spec, ["cpu"], init_method=init_method, world_size=2, threads=1)
        assert server.wait(timeout=120) == 1
    finally:
        server.kill()
    message = str(failed.value)
    assert re.search(r"^H3 worker rank 1 on cpu of \S+ failed \(CheckpointError: .*there/adapter\.safetensors is not a "
                     r"readable safetensors file.*\), so H3 worker rank 0 on cpu failed: ", message), message

    spec = ModelSpec(TINY_RANDOM, dtype=torch.float32, attention="sdpa")
    init_method = _tcp_rendezvous()
    server = _serve_rank_1([], init_method)
    try:
        runner = ParallelRunner(spec, ["cpu"], init_method=init_method, world_size=2, threads=1)
        os.killpg(server.pid, signal.SIGKILL)  # the machine's ranks gone at once, no report left
        server.wait(timeout=60)
        with pytest.raises(ParallelWorkerError, match=r"^a rank on another machine \(rank 1, served by `python -m "
                                                      r"h3_core.parallel` there\) went away without a report"):
            sample(runner, conditioning(False), seed=3, steps=STEPS)
        assert runner.closed
    finally:
        server.kill()


def test_a_rank_that_lost_a_peer_names_the_rank_that_failed_on_its_own(monkeypatch):
    """Reports through the store: a rank whose collective lost a peer names the rank that failed on its own first
    (not a bystander that also lost it); a rank that failed on its own names nobody; a report written while a rank
    waits for one (PEER_WAIT_S) is named; a store that stops answering does not hold a failing rank past
    EXCHANGE_LIMIT_S."""
    import threading
    import time

    from h3_core.parallel import peer_reports

    store = dist.HashStore()
    lost = RuntimeError("[pair.cc:553] Connection closed by peer [10.0.0.2]:4242")
    assert peer_reports.exchange(store, 1, 4, "cuda:0", lost, f"RuntimeError: {lost}") == []  # none told yet
    assert peer_reports.exchange(store, 3, 4, "cuda:1", MemoryError("CUDA out of memory"), "MemoryError: CUDA out "
                                 "of memory") == []  # its own failure: it waits for nobody
    peers = peer_reports.exchange(store, 0, 4, "cuda:0", lost, f"RuntimeError: {lost}")
    assert [(rank, summary.split(":")[0]) for rank, _, summary in peers] == [(3, "MemoryError"), (1, "RuntimeError")]
    assert peers[0][1].startswith("cuda:1 of ")
    peer_reports.forget(store, 3)
    assert [rank for rank, *_ in peer_reports.exchange(store, 2, 4, "cpu", lost, "x")] == [0, 1]
    assert peer_reports.lost_a_peer("DistBackendError: [Rank 0] Watchdog caught collective operation timeout")
    later = dist.HashStore()  # the failing rank's report written while the one that lost it waits for it
    teller = threading.Timer(0.3, peer_reports.exchange, (later, 2, 3, "cpu", MemoryError("out"), "MemoryError: out"))
    teller.start()
    assert [rank for rank, *_ in peer_reports.exchange(later, 0, 3, "cpu", lost, "x")] == [2]
    teller.join()

    class Stopped:  # its host frozen: every call blocks
        def __getattr__(self, name):
            return lambda *args: threading.Event().wait()

    monkeypatch.setattr(peer_reports, "EXCHANGE_LIMIT_S", 0.5)
    start = time.monotonic()
    assert peer_reports.exchange(Stopped(), 0, 2, "cpu", lost, "x") == []
    assert time.monotonic() - start < 2


def test_a_batch_starts_the_workers_again_after_one_fails(tmp_path, monkeypatch):
    """A worker failure ends its runner: the batch reports that job (on_failure) and starts the workers again
    for the next, instead of failing every later job on a closed runner."""
    import h3_core.parallel as parallel

    made = []

    class FirstFails(ParallelRunner):
        def __init__(self, spec, devices, *args, **kwargs):
            if not made:
                fields = {field.name: getattr(spec, field.name) for field in dataclasses.fields(spec)}
                spec = FailingSpec(**fields, fail_call=2)
            made.append(spec)
            super().__init__(spec, devices, *args, threads=1, **kwargs)

    monkeypatch.setattr(parallel, "ParallelRunner", FirstFails)
    failed = []
    jobs = [pipeline.Job(pipeline.Request("t2va", prompt, duration=4), save_latents=tmp_path / f"{n}.safetensors")
            for n, prompt in enumerate(("a fox", "a cat"))]
    results = pipeline.generate_batch(jobs, TINY_RANDOM, pipeline.GenerateSettings(steps=3, devices=["cpu", "cpu"]),
                                      on_failure=lambda name, job, error: failed.append((name, error)))
    assert [name for name, _ in failed] == ["job 1"] and isinstance(failed[0][1], ParallelWorkerError)
    assert len(made) == 2 and [r.latents_path for r in results] == [tmp_path / "1.safetensors"]
    assert (tmp_path / "1.safetensors").exists() and not (tmp_path / "0.safetensors").exists()


def test_workers_ignore_ctrl_c_from_their_first_instruction(tmp_path):
    """Ctrl-C goes to the whole foreground process group: workers still importing torch must not print a
    KeyboardInterrupt each (the caller stops them), so they start with SIGINT already ignored."""
    from h3_core.parallel.workers import _Pool, _Setup

    setups = [_Setup(rank, 2, "cpu", "file://" + str(tmp_path / "store"), SPEC, False, 1, os.getpid()) for rank in (0, 1)]
    pool = _Pool(setups, None)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as an interactive caller has it (CI's
    pool.start()                                                       # background run ignores it from the start)
    try:
        for process in pool.processes:  # read at once: long before the worker's own code runs
            ignored = next(line for line in open(f"/proc/{process.pid}/status") if line.startswith("SigIgn:"))
            assert int(ignored.split()[1], 16) & (1 << (signal.SIGINT - 1)), ignored
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the caller's own is back
    finally:
        signal.signal(signal.SIGINT, before)
        pool.stop(graceful=False)


def test_a_killed_caller_leaves_no_worker_and_no_rendezvous_folder(tmp_path):
    """SIGKILL of the process holding a runner (no finalizer runs): its workers exit and take the private
    rendezvous folder with them."""
    import subprocess
    import sys
    import time

    script = ("import sys, tempfile, torch\n"
              "from h3_core.parallel import ModelSpec, ParallelRunner\n"
              "runner = ParallelRunner(ModelSpec('tiny-random', dtype=torch.float32, attention='sdpa'), ['cpu', 'cpu'], "
              "threads=1)\n"
              "print(tempfile.gettempdir(), *(p.pid for p in runner.processes), flush=True)\n"
              "sys.stdin.read()\n")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    caller = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=env)
    _, *pids = caller.stdout.readline().split()
    assert len(pids) == 2 and [p.name for p in tmp_path.iterdir() if p.name.startswith("h3-rendezvous-")]
    caller.kill()
    caller.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(p.name.startswith("h3-rendezvous-") for p in tmp_path.iterdir()):
        time.sleep(0.2)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("h3-rendezvous-")]
    for pid in map(int, pids):
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"worker {pid} outlived its caller")


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
def test_a_split_dit_read_as_stored_is_sized_in_the_files_dtype(tmp_path, stored):
    """A split DiT whose loader reads the file as stored (weight_dtype "checkpoint") computes in the file's dtype:
    it was sized and planned as bf16 whatever the file held (an fp32 file's weights at half their bytes)."""
    from safetensors.torch import save_file

    from h3_core.placement import RunnerPlacement
    from h3_core.tiny import tiny_random_dit

    path = tmp_path / "dit.safetensors"
    save_file({f"model.diffusion_model.{key}": value.contiguous()
               for key, value in tiny_random_dit(stored).state_dict().items()}, str(path))
    as_stored = RunnerPlacement("H3 DiT", ModelSpec(str(path), dtype=None), ["cpu", "cpu"])
    named = RunnerPlacement("H3 DiT", ModelSpec(str(path), dtype=stored), ["cpu", "cpu"])
    assert as_stored.dtype == stored == named.dtype and as_stored.size == named.size
    assert ModelSpec(str(path), dtype=None).held_linears() == "dense"
