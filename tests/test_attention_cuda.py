"""Exact attention kernels on a CUDA device agree with torch's SDPA, alone and inside the DiT (eager and
compiled). Skipped without CUDA (CI has none) or without the kernel's package; run on a GPU machine with
flash-attn-4 or FlashAttention 3 installed: `python -m pytest tests/test_attention_cuda.py`."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from h3_core.attention import attention, available_backends, resolve_backend
from h3_core.config import TINY_DIT
from h3_core.dit import H3DiT
from h3_core.layout import build_request_layout
from h3_core.tiny import seeded_random_weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
needs_flash4 = pytest.mark.skipif(
    not torch.cuda.is_available() or "flash4" not in available_backends(), reason="needs flash-attn-4 importable"
)


@needs_flash4
@pytest.mark.parametrize("rows, head_dim", [(4099, 128), (333, 64)])
def test_flash4_matches_sdpa(rows, head_dim):
    g = torch.Generator("cuda").manual_seed(3)
    q, k, v = (torch.randn(1, rows, 4, head_dim, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    expected = attention(q, k, v, "sdpa").float()
    got = attention(q, k, v, "flash4").float()
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 2e-3
    assert F.cosine_similarity(got.flatten(), expected.flatten(), dim=0).item() > 0.99999


@pytest.mark.skipif(not torch.cuda.is_available() or "flash3" not in available_backends(), reason="needs FlashAttention 3")
@pytest.mark.parametrize("rows", [4099, 4352, 38222])  # 33 query tiles (odd: q is padded), 34, 299
def test_flash3_matches_sdpa(rows):
    g = torch.Generator("cuda").manual_seed(3)
    q, k, v = (torch.randn(1, rows, 4, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    expected = attention(q, k, v, "sdpa").float()
    got = attention(q, k, v, "flash3").float()
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 2e-3
    assert F.cosine_similarity(got.flatten(), expected.flatten(), dim=0).item() > 0.99999


@needs_flash4
def test_auto_picks_a_flash_kernel_on_hopper_or_blackwell():
    major = torch.cuda.get_device_capability()[0]
    hopper_fa3 = major == 9 and "flash3" in available_backends()
    assert resolve_backend("auto", "cuda") == ("flash3" if hopper_fa3 else "flash4" if major in (9, 10) else "sdpa")


@needs_flash4
def test_dit_with_flash4_eager_and_compiled_matches_sdpa():
    model = seeded_random_weights(H3DiT(replace(TINY_DIT, num_layers=3)), 5).set_dtype(torch.bfloat16)
    model = model.eval().requires_grad_(False).cuda()
    layout = build_request_layout(128, 64, 124, torch.ones(6, dtype=torch.long)).to("cuda")
    timesteps, indices = layout.row_timesteps(0.4, 0.6)
    g = torch.Generator("cuda").manual_seed(4)
    inputs = dict(
        video_rows=torch.randn(1, layout.video_indices.numel(), TINY_DIT.video_patch_dim, device="cuda", generator=g),
        audio_rows=torch.randn(1, layout.audio_indices.numel(), TINY_DIT.audio_in_channels, device="cuda", generator=g),
        text_states=torch.randn(1, 6, TINY_DIT.text_dim, device="cuda", generator=g).bfloat16(),
        timesteps=timesteps.cuda(), timestep_indices=indices.cuda(), token_tags=layout.token_tags,
        position_ids=layout.position_ids, video_indices=layout.video_indices, audio_indices=layout.audio_indices,
        text_indices=layout.text_indices,
    )
    with torch.inference_mode():
        model.set_attention_backend("sdpa")
        expected = model(**inputs)
        model.set_attention_backend("flash4")
        eager = model(**inputs)
        compiled = model.compile_blocks()(**inputs)
    for reference in expected:
        assert torch.isfinite(reference).all()
    for got in (eager, compiled):
        for a, b in zip(expected, got, strict=True):
            assert F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item() > 0.9999
            assert (a - b).abs().max().item() < 0.05 * a.abs().max().item()
