"""Windows and macOS: what the engine reads of the system where Linux's /proc and Unix's `resource` are absent,
FP8 on a device with no FP8 tensors (MPS), JSON read as UTF-8 whatever the locale's encoding, and Windows' files
(one held open cannot be replaced; names ignore case; backslashes in paths; output in cp1252)."""

import contextlib
import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from h3_core import fp8, media_write, runtime
from h3_core.cli import main
from h3_core.media_read import probe


def _no_proc(monkeypatch):
    real = Path.read_text

    def read_text(self, *args, **kwargs):
        if str(self).startswith("/proc/"):
            raise FileNotFoundError(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)


def test_available_memory_comes_from_psutil_where_there_is_no_proc(monkeypatch):
    """Without it the host-memory room, warning and pinning cap all thought memory unlimited (Windows, macOS)."""
    _no_proc(monkeypatch)
    monkeypatch.setitem(sys.modules, "psutil", types.SimpleNamespace(
        virtual_memory=lambda: types.SimpleNamespace(available=12 * 2**30)))
    assert runtime.host_memory_available() == 12 * 2**30
    assert runtime.pinnable_bytes(None) == 8 * 2**30  # less the 4 GiB reserve
    assert "12.0 GiB is available" in runtime.host_memory_warning(20 * 2**30, "The DiT")
    monkeypatch.setitem(sys.modules, "psutil", None)  # not installed: not known
    assert runtime.host_memory_available() is None


def test_the_command_line_imports_without_unix_resource_module():
    """`import resource` at the top of the CLI stopped `h3` (and python -m h3_core.parallel) on Windows."""
    code = ("import sys; sys.modules['resource'] = None\n"
            "import torch, h3_core.cli as cli, h3_core.parallel.__main__\n"
            "print(cli._peak(torch.device('cpu')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "peak RSS not measured here"


def test_fp8_matmuls_are_unsupported_where_fp8_tensors_raise_type_error(monkeypatch):
    """MPS makes no FP8 tensor (a TypeError): the check answered with a traceback, not False."""
    def no_fp8(*args, dtype=None, **kwargs):
        raise TypeError("Trying to convert Float8_e4m3fn to the MPS backend but it does not have support for that dtype.")

    monkeypatch.setattr(fp8.torch, "zeros", no_fp8)
    assert fp8.scaled_mm_supported("mps") is False


def test_json_is_read_as_utf8_whatever_the_locale(tmp_path):
    """Windows' default text encoding is cp1252: a config with non-ASCII UTF-8 was garbled or refused. Python's
    warning for a file opened in the locale's encoding, made an error for the engine's modules, shows it here."""
    (tmp_path / "config.json").write_text(json.dumps({"note": "модель 模型"}, ensure_ascii=False), encoding="utf-8")
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"note": "模型"}, ensure_ascii=False),
                                                      encoding="utf-8")
    code = ("import warnings, pathlib\n"
            "from h3_core.weights import read_json\n"
            "from h3_core.prompt import read_processor_configs\n"
            "warnings.simplefilter('error', EncodingWarning)\n"
            f"folder = pathlib.Path({str(tmp_path)!r})\n"
            "assert read_json(folder / 'config.json')['note'] == 'модель 模型'\n"
            "assert read_processor_configs(folder)[0]['note'] == '模型'\n")
    done = subprocess.run([sys.executable, "-X", "warn_default_encoding", "-c", code], capture_output=True, text=True,
                          encoding="utf-8", timeout=300)
    assert done.returncode == 0, done.stderr


def _held_open(monkeypatch, held: Path):
    """os.replace as Windows does it onto a file another program has open (a player showing the last clip)."""
    real = media_write.os.replace

    def replace(source, target):
        if Path(target) == held:
            raise PermissionError(13, "The process cannot access the file because it is being used by another "
                                      "process", str(target))
        return real(source, target)

    monkeypatch.setattr(media_write.os, "replace", replace)


def test_a_finished_clip_is_kept_under_a_free_name_where_its_own_is_held_open(tmp_path, monkeypatch, caplog):
    """The finished temporary file was deleted with the failed replace: the whole render lost."""
    held = tmp_path / "clip.mp4"
    held.write_bytes(b"the last clip")
    (tmp_path / "clip (1).mp4").write_bytes(b"an earlier one")
    _held_open(monkeypatch, held)
    frames = np.random.default_rng(0).integers(0, 256, (3, 64, 96, 3), dtype=np.uint8)
    written = media_write.write_mp4(held, frames)
    assert written == tmp_path / "clip (2).mp4"
    assert probe(written).video.frame_count == 3
    assert held.read_bytes() == b"the last clip" and (tmp_path / "clip (1).mp4").read_bytes() == b"an earlier one"
    assert not list(tmp_path.glob("*.part"))
    assert "Could not replace" in caplog.text and "clip (2).mp4" in caplog.text


def test_generate_says_where_its_clip_went_when_the_out_file_is_held_open(tmp_path, monkeypatch, capsys):
    from test_cli import readme_main_command, with_option

    held = tmp_path / "fox.mp4"
    held.write_bytes(b"the last clip")
    _held_open(monkeypatch, held)
    argv = with_option(readme_main_command(), "--out", str(held)) + ["--steps", "2", "--duration", "4"]
    assert main(argv) == 0
    said = capsys.readouterr()
    kept = tmp_path / "fox (1).mp4"
    assert said.out.startswith(f"{kept}: ") and "the clip was saved as" in said.err
    assert f", {probe(kept).video.frame_count} frames at 224x128; " in said.out and held.read_bytes() == b"the last clip"


def test_a_name_the_output_encoding_lacks_is_escaped_not_an_error(tmp_path):
    """Windows writes redirected output in cp1252: printing a Chinese file name failed the finished run."""
    out = tmp_path / "模型.safetensors"
    done = subprocess.run([sys.executable, "-m", "h3_core.cli", "denoise", "--steps", "2", "--save-latents", str(out)],
                          capture_output=True, env={**os.environ, "PYTHONIOENCODING": "cp1252"}, timeout=300)
    assert done.returncode == 0, done.stderr.decode("cp1252", "replace")
    assert done.stdout.decode("cp1252").startswith(f"{tmp_path}/\\u6a21\\u578b.safetensors: ") and out.is_file()


def test_a_batch_lines_windows_paths_keep_their_backslashes(tmp_path, monkeypatch):
    """Batch lines were split as a POSIX shell splits them everywhere: on Windows C:\\clips\\fox.mp4 became
    C:clipsfox.mp4. There a backslash is a path's, as in its own command prompt; the comment rule agrees."""
    from h3_core import cli

    monkeypatch.setattr(cli, "BATCH_ESCAPE", "")  # as on Windows
    jobs_file = tmp_path / "jobs.txt"
    jobs_file.write_text('--out C:\\clips\\fox.mp4 --prompt "files in C:\\dir\\" --seed 4  # take #1\n'
                         '--prompt \'he said "hi"\' --out b.mp4\n')
    fox, quoted = cli._batch_jobs(cli.build_parser().parse_args(["generate", "--batch", str(jobs_file)]))
    assert (fox.request.prompt, str(fox.out), fox.seed) == ("files in C:\\dir\\", "C:\\clips\\fox.mp4", 4)
    assert quoted.request.prompt == 'he said "hi"'


def test_two_batch_lines_writing_one_name_in_two_cases_are_refused_where_names_ignore_case(tmp_path, monkeypatch,
                                                                                           capsys):
    """Windows names ignore case: Take.mp4 and take.mp4 are one file, and the second job overwrote the first."""
    from h3_core import pipeline

    for name in ("load_text_encoder_for", "load_vaes", "load_sampling_dit"):
        monkeypatch.setattr(pipeline, name, lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(os.path, "normcase", lambda path: os.fspath(path).lower())  # ntpath's, less its slashes
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"--prompt x --out {tmp_path}/Take.mp4\n--prompt y --out {tmp_path}/take.mp4\n")
    assert main(["generate", "--batch", str(jobs), "--steps", "2", "--duration", "4"]) == 2
    assert re.search(r"lines 1 and 2 both write \S*take.mp4", capsys.readouterr().err)


def test_a_ranks_lora_keeps_its_windows_drive(monkeypatch, capsys):
    """python -m h3_core.parallel split --lora at its last colon: C:\\loras\\a.safetensors became path 'C' and a
    traceback for its 'strength'. It reads --lora as h3 generate does."""
    import importlib

    ranks = importlib.import_module("h3_core.parallel.__main__")
    seen = []
    monkeypatch.setattr(ranks, "serve_ranks", lambda spec, *rest: seen.append(spec.loras) or 0)
    common = ["--model", "tiny-random", "--devices", "cpu", "--init-method", "tcp://a:1", "--world-size", "2",
              "--first-rank", "1"]
    assert ranks.main(common + ["--lora", "C:\\loras\\a.safetensors", "--lora", "C:\\loras\\b.safetensors:0.5"]) == 0
    assert seen == [(("C:\\loras\\a.safetensors", 1.0), ("C:\\loras\\b.safetensors", 0.5))]
    with pytest.raises(SystemExit) as stop:  # said by its parser, with its usage
        ranks.main(common + ["--lora", "b.safetensors:strong"])
    said = capsys.readouterr().err
    assert stop.value.code == 2 and "usage:" in said
    assert "--lora 'b.safetensors:strong': the strength after ':' must be a number." in said


def _watched_worker(ready):
    """A worker whose parent's id never changes, as on Windows, where an ended process's id stays its child's
    getppid."""
    from h3_core.parallel import workers

    parent = os.getppid()
    workers.os.getppid = lambda: parent
    workers._watch_parent(parent, "tcp://127.0.0.1:1")
    ready.set()
    time.sleep(120)


def _launcher(ready, pid):
    child = multiprocessing.get_context("spawn").Process(target=_watched_worker, args=(ready,))
    child.start()
    pid.value = child.pid
    ready.wait(120)
    os._exit(0)  # gone without stopping its worker (killed, crashed)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the worker's state from /proc")
def test_a_worker_exits_when_its_parent_is_gone_though_the_parent_id_stays():
    """Workers watched getppid, which on Windows keeps the ended parent's id: they outlived it for good."""
    context = multiprocessing.get_context("spawn")
    ready, pid = context.Event(), context.Value("i", 0)
    launcher = context.Process(target=_launcher, args=(ready, pid))
    launcher.start()
    launcher.join(120)
    assert ready.is_set()
    status = Path(f"/proc/{pid.value}/stat")
    deadline = time.monotonic() + 20
    try:
        while status.exists() and status.read_text().split(") ")[-1][0] != "Z" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not status.exists() or status.read_text().split(") ")[-1][0] == "Z", "the worker outlived its parent"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid.value, 9)


def test_a_dit_split_over_gpus_is_refused_at_once_without_nccl(monkeypatch, tmp_path, capsys):
    """Windows' and macOS' torch have no NCCL: the workers started, loaded, then failed in their process group."""
    from h3_core.placement import check_devices

    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # a CPU-only build: the missing GPUs are the news
    with pytest.raises(ValueError, match="cuda:0 does not exist here: this machine has 0 CUDA device"):
        check_devices("cuda:0,cuda:1", split=True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # a Windows machine's two GPUs
    with pytest.raises(ValueError, match="Splitting the DiT over GPUs needs NCCL, which this torch build lacks"):
        check_devices("cuda:0,cuda:1", split=True)
    assert check_devices("cpu,cpu", split=True) == [torch.device("cpu")] * 2  # gloo, everywhere
    argv = ["generate", "--prompt", "x", "--devices", "cuda:0,cuda:1", "--out", str(tmp_path / "x.mp4")]
    assert main(argv) == 2 and "needs NCCL" in capsys.readouterr().err


def test_a_layout_goes_to_mps_without_float64_and_gives_the_same_rotary_tables(monkeypatch):
    """MPS has no float64: moving the layout's float64 positions there raised a TypeError at the first step.
    They go as float32, which is what the DiT reads them in: the same tables."""
    from h3_core.dit import rope_tables
    from h3_core.layout import build_request_layout

    layout = build_request_layout(128, 64, 124, torch.ones(6, dtype=torch.long))
    moved_dtypes = []
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        device = args[0] if args else kwargs.get("device")
        if isinstance(device, (str, torch.device)) and torch.device(device).type == "mps":
            if self.dtype == torch.float64:
                raise TypeError("Cannot convert a MPS Tensor to float64 dtype as the MPS framework doesn't "
                                "support float64. Please use float32 instead.")
            moved_dtypes.append(self.dtype)
            return real_to(self, "cpu")  # stands in for the Mac's GPU
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    on_mps = layout.to("mps")
    monkeypatch.undo()
    assert torch.float32 in moved_dtypes and on_mps.position_ids.dtype == torch.float32
    inv_freq = torch.rand(8)
    for ours, theirs in zip(rope_tables(on_mps.position_ids, inv_freq), rope_tables(layout.position_ids, inv_freq)):
        assert torch.equal(ours, theirs)


def test_expandable_segments_only_before_cuda_runs(monkeypatch):
    """h3's main called in a process whose CUDA already runs (fixed segments): it set the variable all the same,
    and the plans of later runs in that process trusted it (no room left for fragmentation)."""
    monkeypatch.setattr(runtime, "EXPANDABLE_SEGMENTS", True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    environ = {}
    assert not runtime.use_expandable_segments(environ) and environ == {}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert runtime.use_expandable_segments(environ) and environ == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_windows_and_macos_have_no_expandable_segments(monkeypatch):
    """torch's CUDA allocator has expandable segments on Linux only: elsewhere h3 set the variable anyway (torch
    warned and kept fixed segments), and memory plans trusted it and left no room for fragmentation."""
    from h3_core import environment

    monkeypatch.setattr(runtime, "EXPANDABLE_SEGMENTS", False)  # as on Windows
    environ = {}
    assert not runtime.use_expandable_segments(environ) and environ == {}
    assert runtime.fixed_allocator_segments({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert not runtime.fixed_allocator_segments({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})
    for name in runtime.ALLOCATOR_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert environment._allocator() == "torch's default (fixed segments)"
