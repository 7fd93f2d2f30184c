"""Video Sparse Attention (h3_core/sparse_attention.py) against FastVideo's own VSA code for H3, the
reference FastH3 8-Step V2 was trained with (tests/fastvideo_vsa.py; FASTVIDEO_SRC, set by .ci/run)."""

import pytest
import torch

import fastvideo_vsa
from h3_core.sparse_attention import TILE_ROWS, select_tiles, tile_means, to_tiles, vsa_attention, vsa_tiles

# (text, condition video, audio) rows, then a video grid (t, h, w) in patches: partial boxes on every edge,
# segments that are not multiples of 64, and one without condition rows (t2va)
CASES = [((70, 0, 30), (5, 6, 9)), ((130, 64, 1), (4, 8, 4)), ((3, 0, 0), (9, 5, 7))]


@pytest.fixture(scope="module")
def fastvideo():
    folder = fastvideo_vsa.source_folder()
    if folder is None:
        pytest.skip("FASTVIDEO_SRC is not set to an unpacked FastVideo 0.2.1 (.ci/run sets it): no VSA oracle")
    return fastvideo_vsa.load(folder)


def _inputs(rows, heads=3, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, rows, heads, dim, generator=g) for _ in range(4)]


@pytest.mark.parametrize("prefix,grid", CASES)
def test_tiles_are_fastvideos(fastvideo, prefix, grid):
    tiles = vsa_tiles(prefix, grid)
    geometry = fastvideo._h3_tile_geometry(tuple(s for s in prefix if s), grid, torch.device("cpu"), (4, 4, 4))
    _, sizes, slots, prefix_tiles, video_tiles = geometry
    assert torch.equal(tiles.sizes, sizes) and torch.equal(tiles.slots, slots)
    assert (tiles.prefix_tiles, tiles.video_tiles) == (prefix_tiles, video_tiles)


@pytest.mark.parametrize("prefix,grid", CASES)
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.8])
@pytest.mark.parametrize("gated", [False, True])
def test_vsa_equals_fastvideos(fastvideo, prefix, grid, sparsity, gated):
    """Same tiles, tile scores, selection, compressed branch and gate: the same output (the attention over
    the chosen tiles is a masked dense one on both sides here)."""
    rows = sum(prefix) + grid[0] * grid[1] * grid[2]
    query, key, value, gate = _inputs(rows)
    gate = gate if gated else None
    want = fastvideo_vsa.reference_vsa(fastvideo, query, key, value, gate, prefix, grid, sparsity)
    got = vsa_attention(query, key, value, vsa_tiles(prefix, grid), sparsity, gate, kernel="dense")
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_selection_keeps_prefix_and_the_best_video_tiles():
    """Independently of FastVideo: prefix queries and keys are always in; each video query tile keeps the
    k best-scoring video key tiles; zero sparsity is dense attention."""
    prefix, grid = (70, 0, 30), (5, 6, 9)
    tiles = vsa_tiles(prefix, grid)
    assert tiles.prefix_tiles == 3 and tiles.video_tiles == 2 * 2 * 3
    query, key, value, _ = _inputs(tiles.slots.numel())
    scores = torch.randn(1, 3, tiles.tiles, tiles.tiles)
    chosen = select_tiles(scores, tiles, 0.75)
    assert chosen[..., :3, :].all() and chosen[..., :3].all()
    video = chosen[..., 3:, 3:]
    assert (video.sum(-1) == 3).all()  # ceil(0.25 x 12)
    best = scores[..., 3:, 3:].topk(3, dim=-1).indices
    assert torch.gather(video, -1, best).all()
    dense = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (query, key, value)))
    got = vsa_attention(query, key, value, tiles, 0.0, kernel="dense")
    assert torch.allclose(got, dense.transpose(1, 2), atol=1e-5)
    means = tile_means(to_tiles(query, tiles), tiles)
    first_video = to_tiles(query, tiles)[0, 3 * TILE_ROWS: 3 * TILE_ROWS + int(tiles.sizes[3])]
    assert torch.allclose(means[0, :, 3], first_video.mean(0).float(), atol=1e-6)


def test_bad_settings_are_refused():
    tiles = vsa_tiles((10, 0, 5), (4, 4, 4))
    query = torch.zeros(1, 79, 2, 8)
    for sparsity in (-0.1, 1.0):
        with pytest.raises(ValueError, match="0 <= sparsity < 1"):
            vsa_attention(query, query, query, tiles, sparsity)
    with pytest.raises(ValueError, match="made for 79 rows, got 78"):
        vsa_attention(query[:, :78], query[:, :78], query[:, :78], tiles, 0.5)
    with pytest.raises(ValueError, match="choose auto, dense or flex"):
        vsa_attention(query, query, query, tiles, 0.5, kernel="triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_kernel_equals_the_dense_reference_on_cuda(dtype):
    prefix, grid = (130, 64, 17), (9, 8, 12)
    tiles = vsa_tiles(prefix, grid, "cuda")
    query, key, value, gate = (x.to("cuda", dtype) for x in _inputs(tiles.slots.numel(), heads=4, dim=64))
    want = vsa_attention(query, key, value, tiles, 0.8, gate, kernel="dense")
    got = vsa_attention(query, key, value, tiles, 0.8, gate, kernel="flex")
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want.float(), atol=tolerance, rtol=tolerance)
