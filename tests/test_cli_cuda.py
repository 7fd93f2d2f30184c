"""`h3 generate` on CUDA devices, as a user runs it: one GPU, and split over two when there are two.
Skipped without CUDA (CI has none); run on a GPU machine: `python -m pytest tests/test_cli_cuda.py`."""

import av
import pytest
import torch

from h3_core.cli import main

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")


def _generate(tmp_path, capsys, *extra):
    out = tmp_path / f"fox{len(extra)}.mp4"
    assert main(["generate", "--prompt", "A red fox trots along the beach.", "--steps", "4", "--out", str(out), *extra]) == 0
    assert "peak GPU" in capsys.readouterr().out
    with av.open(str(out)) as container:
        kinds = sorted(stream.type for stream in container.streams)
        frames = sum(1 for _ in container.decode(video=0))
    assert kinds == ["audio", "video"] and frames > 0
    return out


def test_generate_on_one_gpu(tmp_path, capsys):
    _generate(tmp_path, capsys, "--device", "cuda:0")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_generate_split_over_two_gpus(tmp_path, capsys):
    _generate(tmp_path, capsys, "--devices", "cuda:0,cuda:1")


def _allocator_after_generate(tmp_path, allocator_conf: str | None) -> str:
    """Run `h3 generate` on one GPU in a fresh process (torch reads its allocator settings when CUDA starts)
    and report whether a tensor made after it lives in an expandable segment."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from h3_core.runtime import ALLOCATOR_VARIABLES

    script = ("import sys, torch; from h3_core.cli import main; code = main(sys.argv[1:]); "
              "kept = torch.ones(1 << 20, device='cuda:0'); "
              "print('RESULT', code, all(s.get('is_expandable', False) for s in torch.cuda.memory_snapshot()))")
    env = {name: value for name, value in os.environ.items() if name not in ALLOCATOR_VARIABLES}
    if allocator_conf is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = allocator_conf
    argv = [sys.executable, "-c", script, "generate", "--prompt", "A red fox.", "--steps", "2", "--device", "cuda:0",
            "--gpu-memory", "8", "--out", str(tmp_path / "fox.mp4")]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1],
                          timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert lines, done.stdout[-2000:] + done.stderr[-2000:]
    return lines[-1]


def test_one_gpu_generate_uses_expandable_segments_unless_the_user_configured_the_allocator(tmp_path):
    """Fixed segments fragmented a streamed DiT on a 24 GiB budget into running out of memory, so the CLI
    asks torch for expandable ones before CUDA starts; a user's own allocator setting is left alone."""
    assert _allocator_after_generate(tmp_path, None) == "RESULT 0 True"
    assert _allocator_after_generate(tmp_path, "expandable_segments:False") == "RESULT 0 False"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_batch_split_over_two_gpus_equals_its_jobs_alone(tmp_path, capsys):
    """--batch with --devices: the workers hold the DiT for both jobs (the first decoded beside them) and
    leave before the last decode; each job's latents equal its own run's."""
    from safetensors.torch import load_file

    split = ["--devices", "cuda:0,cuda:1", "--steps", "4"]
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"--prompt 'a fox' --seed 1 --out {tmp_path}/a.mp4 --save-latents {tmp_path}/a.safetensors\n"
                    f"--prompt 'rain' --duration 4 --save-latents {tmp_path}/b.safetensors --out {tmp_path}/b.mp4\n")
    assert main(["generate", "--batch", str(jobs), *split]) == 0
    assert main(["generate", "--prompt", "rain", "--duration", "4", *split,
                 "--save-latents", str(tmp_path / "alone.safetensors")]) == 0
    capsys.readouterr()
    batch, alone = load_file(str(tmp_path / "b.safetensors")), load_file(str(tmp_path / "alone.safetensors"))
    assert torch.equal(batch["video"], alone["video"]) and torch.equal(batch["audio"], alone["audio"])
    for name in ("a.mp4", "b.mp4"):
        with av.open(str(tmp_path / name)) as container:
            assert sum(1 for _ in container.decode(video=0)) > 0
