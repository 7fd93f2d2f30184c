"""The fused q/k RMSNorm + RoPE step that compiled blocks use on CUDA (h3_core/qk_norm_rope.py): its
arithmetic (the torch reference) against the eager path on the CPU; the Triton kernel against that
reference, and a compiled DiT against the eager one, on a CUDA device (skipped without one)."""

from dataclasses import replace

import pytest
import torch

from h3_core import qk_norm_rope as fused
from h3_core.attention import available_backends
from h3_core.config import TINY_DIT, DiTConfig
from h3_core.dit import Attention, rope_inverse_frequencies, rope_tables
from h3_core.rope import apply_rope
from h3_core.tiny import seeded_random_weights

cuda = pytest.mark.skipif(not torch.cuda.is_available() or fused.triton is None,
                          reason="needs a CUDA device and Triton (CI has neither)")


def case(batch: int, rows: int, heads: int, head_dim: int, device="cpu", seed=0):
    """qkv with a row offset and spread (so the norm matters), norm weights, and RoPE tables of real positions."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(batch, rows, 3 * heads * head_dim, generator=g) * 3 + 0.5).bfloat16()
    weights = [(1 + 0.3 * torch.randn(head_dim, generator=g)).bfloat16() for _ in range(2)]
    positions = torch.stack([torch.arange(rows) // 7, torch.arange(rows) % 7, torch.arange(rows) % 5], -1)
    config = DiTConfig() if head_dim >= 96 else TINY_DIT  # the release rotates 96 of 128 channels
    cos, sin = (t.bfloat16() for t in rope_tables(positions, rope_inverse_frequencies(config)))
    return [t.to(device) for t in (qkv, *weights, cos, sin)]


def eager(qkv, q_weight, k_weight, cos, sin, heads, eps):
    batch, rows, _ = qkv.shape
    q, k, _ = qkv.view(batch, rows, 3, heads, -1).unbind(2)
    norm = lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)  # noqa: E731  nn.RMSNorm's call
    return apply_rope(norm(q, q_weight), cos, sin), apply_rope(norm(k, k_weight), cos, sin)


@pytest.mark.parametrize("batch, rows, heads", [(1, 37, 3), (2, 50, 2)])
def test_reference_is_the_eager_path_up_to_bf16_rounding(batch, rows, heads):
    qkv, wq, wk, cos, sin = case(batch, rows, heads, TINY_DIT.attention_head_dim)
    for got, want in zip(fused.qk_norm_rope_reference(qkv, wq, wk, cos, sin, heads, 1e-5),
                         eager(qkv, wq, wk, cos, sin, heads, 1e-5)):
        assert got.shape == want.shape == (batch, rows, heads, TINY_DIT.attention_head_dim) and got.dtype == torch.bfloat16
        # eager rounds after the norm and after each RoPE product; the reference once
        assert torch.allclose(got.float(), want.float(), rtol=0.02, atol=0.04)
    # the same arithmetic: the eager path in float32, rounded once at the end, is the reference to the bit
    in_float32 = eager(*(t.float() for t in (qkv, wq, wk, cos, sin)), heads, 1e-5)
    for got, want in zip(fused.qk_norm_rope_reference(qkv, wq, wk, cos, sin, heads, 1e-5), in_float32):
        assert torch.equal(got, want.bfloat16())


def test_not_offered_without_cuda_or_for_odd_head_sizes():
    assert not fused.available(torch.zeros(1), 128)
    if torch.cuda.is_available() and fused.triton is not None:
        assert fused.available(torch.zeros(1, device="cuda"), 128) and not fused.available(torch.zeros(1, device="cuda"), 96)


@cuda
@pytest.mark.parametrize("batch, rows, heads, head_dim, padding",
                         [(1, 4099, 4, 128, 0), (2, 333, 3, 64, 0), (1, 31, 56, 128, 0), (1, 4099, 4, 128, 93),
                          (2, 333, 3, 64, 51)])
def test_kernel_matches_the_reference(batch, rows, heads, head_dim, padding):
    qkv, wq, wk, cos, sin = case(batch, rows, heads, head_dim, "cuda")
    q, k = torch.ops.h3.qk_norm_rope(qkv, wq, wk, cos, sin, heads, 1e-5, rows + padding)
    want_q, want_k = fused.qk_norm_rope_reference(qkv, wq, wk, cos, sin, heads, 1e-5)
    assert q.is_contiguous() and k.is_contiguous() and q.shape == (batch, rows + padding, heads, head_dim)
    assert k.shape == want_k.shape
    assert not q[:, rows:].any()  # the padding rows are zeros, in every batch entry
    for g, w in ((q[:, :rows], want_q), (k, want_k)):
        # the same float32 arithmetic, summed in another order: at most one bf16 step apart
        assert torch.allclose(g.float(), w.float(), rtol=2**-7, atol=1e-6), (g.float() - w.float()).abs().max()


def test_kernel_refuses_fewer_query_rows_than_rows():
    qkv, wq, wk, cos, sin = case(1, 37, 3, TINY_DIT.attention_head_dim)
    with pytest.raises(ValueError, match=r"query_rows \(36\) must be at least the 37 rows"):
        fused.qk_norm_rope(qkv, wq, wk, cos, sin, 3, 1e-5, 36)


@cuda
def test_compiled_attention_uses_the_kernel_and_matches_eager():
    torch.manual_seed(0)
    attn = seeded_random_weights(Attention(TINY_DIT), 4).to("cuda", torch.bfloat16)
    rows = 300
    positions = torch.stack([torch.arange(rows) // 20, torch.arange(rows) % 20, torch.arange(rows) % 4], -1)
    rope = tuple(t.to("cuda", torch.bfloat16) for t in rope_tables(positions, rope_inverse_frequencies(TINY_DIT)))
    x = torch.randn(1, rows, TINY_DIT.hidden_size, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(attn, fullgraph=True)
    with torch.no_grad():
        want = attn(x, rope).float()
        compiled(x, rope)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            got = compiled(x, rope).float()
            torch.cuda.synchronize()
    assert any("_norm_rope" in event.name for event in prof.events())
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.9999
    assert (got - want).norm() / want.norm() < 0.01  # the size too (bf16 rounding is ~0.4%)


@cuda
@pytest.mark.skipif(not torch.cuda.is_available() or "flash3" not in available_backends(), reason="needs FlashAttention 3")
def test_compiled_flash3_attention_writes_q_padded_and_matches_eager(monkeypatch):
    """At head_dim 128 with an odd tile count, the kernel writes q into FA3's padded buffer: FA3 gets the
    padded rows without a copy of q, and the block's output equals eager SDPA's up to bf16 rounding."""
    import flash_attn_interface

    config = replace(TINY_DIT, attention_head_dim=128, num_attention_heads=2, rope_freq_dim=16)
    attn = seeded_random_weights(Attention(config), 4).to("cuda", torch.bfloat16)
    rows = 300  # 3 query tiles of 128 -> 4
    positions = torch.stack([torch.arange(rows) // 20, torch.arange(rows) % 20, torch.arange(rows) % 4], -1)
    rope = tuple(t.to("cuda", torch.bfloat16) for t in rope_tables(positions, rope_inverse_frequencies(config)))
    x = torch.randn(1, rows, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = attn(x, rope).float()
        attn.backend = "flash3"
        sent, call = [], flash_attn_interface.flash_attn_func
        monkeypatch.setattr(flash_attn_interface, "flash_attn_func", lambda q, *a, **kw: sent.append(q) or call(q, *a, **kw))
        got = torch.compile(attn, fullgraph=True)(x, rope).float()
    assert got.shape == want.shape and sent[-1].shape[1] == 512 and not sent[-1][:, rows:].any()
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.9999
    assert (got - want).norm() / want.norm() < 0.01  # the size too (bf16 rounding is ~0.4%)
