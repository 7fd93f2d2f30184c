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
