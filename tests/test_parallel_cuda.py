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
from h3_core.parallel import ParallelRunner

TOLERANCE = 1e-4

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two or more CUDA devices (CI has none)")


@pytest.fixture(scope="module")
def one_gpu():
    model = SPEC.load("cuda:0")
    results = {keyframe: pipeline.sample(model, conditioning(keyframe), 3, STEPS) for keyframe in (False, True)}
    del model
    torch.cuda.empty_cache()
    return results


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


def test_a_rank_served_by_another_process_tree_matches_one_gpu():
    """As on two machines, over NCCL: rank 0 in the runner on cuda:0, rank 1 on cuda:1 served by `python -m
    h3_core.parallel`, meeting at a TCP rendezvous."""
    check_a_served_rank("cuda:0", "cuda:1", TOLERANCE)
