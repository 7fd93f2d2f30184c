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


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("device, dtype", [("cpu", torch.float32), pytest.param("cuda", torch.float32, marks=CUDA),
                                           pytest.param("cuda", torch.bfloat16, marks=CUDA)])
def test_flex_kernel_equals_the_dense_reference(device, dtype):
    """Full and partly padded key tiles (FlexAttention's full and masked blocks) in one selection."""
    prefix, grid = (130, 64, 17), (9, 8, 12)
    tiles = vsa_tiles(prefix, grid, device)
    assert 0 < int((tiles.sizes == 64).sum()) < tiles.tiles
    query, key, value, gate = (x.to(device, dtype) for x in _inputs(tiles.slots.numel(), heads=4, dim=64))
    want = vsa_attention(query, key, value, tiles, 0.8, gate, kernel="dense")
    got = vsa_attention(query, key, value, tiles, 0.8, gate, kernel="flex")
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want.float(), atol=tolerance, rtol=tolerance)


# ---------------------------------------------------------------------------------------------
# In the DiT (sampler -> layout tiling -> each block's attention), without FastVideo


def _denoise(model, layout=None):
    from h3_core.layout import build_request_layout
    from h3_core.noise import request_generator, target_noise
    from h3_core.sampler import DualClockSchedule, denoise

    layout = layout or build_request_layout(128, 64, 124, torch.tensor([1, 1, 0, 0, 1, 1, 1]))
    device = model.condition_proj.weight.device
    video, audio = (x.to(device) for x in target_noise(layout, request_generator(5)))
    text = torch.randn(1, 7, 48, generator=torch.Generator().manual_seed(5)).to(device)
    with torch.inference_mode():
        return denoise(model, layout, text, video, audio, DualClockSchedule.build(3))


def test_the_layout_tiles_its_rows_as_fastvideo_packs_them():
    from h3_core.layout import ReferenceBlock, build_ref2va_layout, build_request_layout

    layout = build_request_layout(128, 64, 124, torch.ones(7, dtype=torch.long))
    tiles, grid = layout.vsa_tiles(), (layout.latent_frames, layout.latent_height // 2, layout.latent_width // 2)
    want = vsa_tiles((7, 0, layout.audio_indices.numel()), grid)
    assert torch.equal(tiles.slots, want.slots) and torch.equal(tiles.sizes, want.sizes)
    assert tiles.prefix_tiles == 1 + 7  # 7 text rows; 414 audio rows in 7 tiles
    references = build_ref2va_layout([1] * 5, [ReferenceBlock.image(4, 6), ReferenceBlock.video(2, 4, 6, 3),
                                               ReferenceBlock.audio(5)], 4, 4, 6, 9)
    with pytest.raises(ValueError, match=r"needs rows packed as \[text \| condition video \| audio \| video\]"):
        references.vsa_tiles()


def test_sparse_attention_in_the_dit(monkeypatch):
    """Sparsity 0 attends every tile: the full-attention run. Sparsity 0.5 thins it (every block of every forward
    calls VSA with the layout's tiling); zero gates leave it alone, and a model's gates are computed from each
    block's attention input."""
    from dataclasses import replace

    from h3_core import dit as dit_module
    from h3_core.config import TINY_DIT
    from h3_core.dit import H3DiT
    from h3_core.tiny import seeded_random_weights, tiny_random_dit

    model = tiny_random_dit()
    assert model.sparse_attention is None  # off by default
    exact = _denoise(model)
    for a, b in zip(exact, _denoise(model.set_sparse_attention(0.0))):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    calls = []
    original = dit_module.vsa_attention
    monkeypatch.setattr(dit_module, "vsa_attention", lambda *a: calls.append(a) or original(*a))
    thinned = _denoise(model.set_sparse_attention(0.5))
    assert len(calls) == 2 * len(model.blocks) and {c[4] for c in calls} == {0.5} and {c[5] for c in calls} == {None}
    assert len({id(c[3]) for c in calls}) == 1  # one tiling for the run
    assert all((a - b).abs().max() > 1e-4 for a, b in zip(exact, thinned))

    gated = seeded_random_weights(H3DiT(replace(TINY_DIT, vsa_gates=True)), 11).eval().requires_grad_(False)
    state = model.state_dict()
    gates = {k: v.clone() for k, v in gated.state_dict().items() if "gate_compress" in k}
    assert len(gates) == len(model.blocks)
    gated.load_state_dict({**state, **{k: torch.zeros_like(v) for k, v in gates.items()}})
    gated.set_sparse_attention(0.5)
    calls.clear()
    for a, b in zip(thinned, _denoise(gated)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert all(c[5] is not None and not c[5].any() for c in calls)
    gated.load_state_dict({**state, **gates})
    calls.clear()
    opened = _denoise(gated)
    assert all((a - b).abs().max() > 1e-4 for a, b in zip(thinned, opened))
    inputs = []
    hook = gated.blocks[0].attn.register_forward_hook(lambda module, args, out: inputs.append(args[0]))
    calls.clear()
    _denoise(gated)
    hook.remove()
    weight = gated.blocks[0].attn.gate_compress.weight
    torch.testing.assert_close(calls[0][5].flatten(2), inputs[0] @ weight.T)


def test_sparse_attention_setting_is_checked():
    from h3_core.tiny import tiny_random_dit

    model = tiny_random_dit()
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="0 <= sparsity < 1"):
            model.set_sparse_attention(bad)
    model.set_sparse_attention(0.5).set_attention_window(2)
    with pytest.raises(ValueError, match="set one of them"):
        _denoise(model)


def test_the_vsa_students_ladder_is_the_published_one():
    """FastH3 8-Step V2's unshifted ladder under shifts 10 / 3: the values h3-model.md D computes."""
    from h3_core.lora import VSA_STUDENT_CONTRACT

    video, audio = VSA_STUDENT_CONTRACT.sigmas()
    assert VSA_STUDENT_CONTRACT.forwards == 8 and VSA_STUDENT_CONTRACT.tasks == ("t2va",)
    want_video = (0.9999, 0.98579, 0.96758, 0.94317, 0.90909, 0.85714, 0.76923, 0.58824, 0.0)
    want_audio = (0.99967, 0.95415, 0.89952, 0.83274, 0.75, 0.64286, 0.5, 0.3, 0.0)
    assert torch.allclose(torch.tensor(video, dtype=torch.float64), torch.tensor(want_video, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(torch.tensor(audio, dtype=torch.float64), torch.tensor(want_audio, dtype=torch.float64), atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_blocks_run_sparse_attention_as_eager_ones_do():
    """Compiled blocks trace Video Sparse Attention (FlexAttention inside the block's graph): the eager run's
    latents, up to the compiled kernels' rounding."""
    from dataclasses import replace

    from h3_core.config import TINY_DIT
    from h3_core.dit import H3DiT
    from h3_core.tiny import TINY_SEED, seeded_random_weights

    model = seeded_random_weights(H3DiT(replace(TINY_DIT, vsa_gates=True)), TINY_SEED).cuda().eval()
    model.requires_grad_(False).set_sparse_attention(0.5)
    eager = [x.cpu() for x in _denoise(model)]
    compiled = [x.cpu() for x in _denoise(model.compile_blocks())]
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


def test_block_lists_hold_each_query_tiles_selected_key_tiles_in_order():
    from h3_core.sparse_attention import _block_lists

    chosen = torch.rand(2, 3, 40, 40, generator=torch.Generator().manual_seed(4)) < 0.3
    counts, lists = _block_lists(chosen)
    assert torch.equal(counts, chosen.sum(dim=-1).int())
    for b, h, row in zip(*(index.flatten() for index in torch.meshgrid(
            torch.arange(2), torch.arange(3), torch.arange(40), indexing="ij"))):
        assert lists[b, h, row, :counts[b, h, row]].tolist() == chosen[b, h, row].nonzero().flatten().tolist()
