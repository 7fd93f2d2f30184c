"""The worker processes on real GPUs (NCCL): 2 and 4 ranks, with and without sharded weights, give what
one process on one GPU gives; so does a rank served by `python -m h3_core.parallel` (the multi-machine path). Skipped without enough CUDA devices (CI has none); run on a multi-GPU
machine: `python -m pytest tests/test_parallel_cuda.py`.

Tolerance 1e-4 (fp32) rather than the CPU tests' 1e-5: on a GPU, cuBLAS and the attention kernels pick
their tiling by shape, and a rank's GEMMs see a quarter of the rows, so the same sums can round
differently; a wrong split (rows, heads or pad rows mixed up) is off by order 1.
"""

import pytest
import torch

from test_parallel import SPEC, STEPS, assert_all_gone, check_a_served_rank, conditioning

from h3_core import pipeline
from h3_core.conditioning import Conditioning
from h3_core.layout import build_request_layout
from h3_core.parallel import ParallelRunner

TOLERANCE = 1e-4

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two or more CUDA devices (CI has none)")


@pytest.fixture(scope="module")
def one_gpu():
    model = SPEC.load("cuda:0")
    results = {keyframe: pipeline.sample(model, conditioning(keyframe), 3, STEPS) for keyframe in (False, True)}
    del model
    torch.cuda.empty_cache()
    return results


@two_gpus
@pytest.mark.parametrize("gpus", [2, 4], ids=["2gpus", "4gpus"])
@pytest.mark.parametrize("shard", [False, True], ids=["sequence", "sharded"])
def test_gpu_ranks_match_one_gpu(one_gpu, gpus, shard):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA devices; {torch.cuda.device_count()} visible")
    runner = ParallelRunner(SPEC, [f"cuda:{i}" for i in range(gpus)], shard_weights=shard)
    try:
        for keyframe in (False, True):
            steps = []
            got = runner.sample(conditioning(keyframe), 3, STEPS, callback=lambda state: steps.append(state.step))
            want = one_gpu[keyframe]
            assert steps == list(range(1, STEPS))
            for a, b in ((got.video, want.video), (got.audio, want.audio)):
                assert a.shape == b.shape
                assert (a.float().cpu() - b.float().cpu()).abs().max().item() <= TOLERANCE
    finally:
        runner.close()
    assert_all_gone(runner)


@two_gpus
def test_a_rank_served_by_another_process_tree_matches_one_gpu():
    """As on two machines, over NCCL: rank 0 in the runner on cuda:0, rank 1 on cuda:1 served by `python -m
    h3_core.parallel`, meeting at a TCP rendezvous."""
    check_a_served_rank("cuda:0", "cuda:1", TOLERANCE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
def test_a_worker_hands_its_cached_gpu_memory_back_after_each_request():
    """Rank 0 shares its GPU with the host (ComfyUI's text encoder and VAEs), which reads free memory from the
    device: a worker's cached activations looked used to it, for as long as the workers lived. The worker's
    own use is read through NVML, so that other tests on the same GPU (pytest -n) do not count."""
    pynvml = pytest.importorskip("pynvml", reason="reads one process's GPU memory (nvidia-ml-py)")
    tags = torch.tensor([1, 1, 0, 0, 1, 1, 1])
    layout = build_request_layout(1344, 768, 124, tags)  # ~38k rows: activations of some MiB even at tiny width
    text = torch.randn(1, 7, SPEC.config.text_dim, generator=torch.Generator().manual_seed(5))
    request = Conditioning("t2va", 1344, 768, 124, layout, text, tags, [])
    pynvml.nvmlInit()
    runner = ParallelRunner(SPEC, ["cuda:0"])
    try:
        worker = runner._pool.processes[0].pid
        gpus = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        used = lambda: sum(p.usedGpuMemory for gpu in gpus  # noqa: E731
                           for p in pynvml.nvmlDeviceGetComputeRunningProcesses(gpu) if p.pid == worker)
        runner.sample(conditioning(False), 3, STEPS)  # a small request loads the kernels (their code stays)
        before = used()
        assert before > 0  # the worker is seen (its CUDA context alone is some hundred MiB)
        runner.sample(request, 3, STEPS)
        assert used() - before <= 64 * 2**20  # kept, the large one's cache took ~270 MB
    finally:
        runner.close()
        pynvml.nvmlShutdown()
