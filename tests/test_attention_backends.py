"""Attention backend discovery and the FlashAttention 4 wrapper, on the CPU with stand-in packages:
flash-attn-4 installs `flash_attn` as a bare namespace (only `flash_attn.cute`), which must not pass for
FlashAttention 2; a flash-attn-4 that is found but cannot import (its CuTe DSL runtime missing) is not
offered; "auto" prefers FlashAttention 4 on Hopper/Blackwell only; the kernel is one opaque op that
torch.compile traces without a graph break."""

import re
import sys

import pytest
import torch

from fa3_stand_in import FA3_STAND_IN

from h3_core import attention as attention_module
from h3_core.attention import attention, available_backends, query_rows, resolve_backend
from h3_core.tiny import tiny_random_dit

STAND_IN = '''
import torch.nn.functional as F

def flash_attn_func(q, k, v, causal=False):
    CALLS.append(q.shape)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    return out, None

CALLS = []
'''


@pytest.fixture
def fake_flash4(tmp_path, monkeypatch):
    """A `flash_attn` namespace holding a `cute` package, as flash-attn-4 installs it."""

    def install(body: str):
        cute = tmp_path / "flash_attn" / "cute"
        cute.mkdir(parents=True)
        (cute / "__init__.py").write_text(body)
        (cute / "interface.py").write_text("")
        monkeypatch.syspath_prepend(str(tmp_path))
        for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
            monkeypatch.delitem(sys.modules, name)
        return tmp_path

    yield install
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        del sys.modules[name]


def test_flash4_namespace_is_not_flash_attention_2(fake_flash4):
    fake_flash4(STAND_IN)
    available = available_backends()
    assert "flash4" in available and "flash" not in available
    with pytest.raises(ValueError, match="'flash-attn' package"):
        resolve_backend("flash")


def test_a_flash4_that_cannot_import_is_not_offered(fake_flash4):
    fake_flash4("import cutlass_runtime_that_is_missing\n")
    assert "flash4" not in available_backends()
    with pytest.raises(ValueError, match="'flash-attn-4' package"):
        resolve_backend("flash4")
    assert resolve_backend("auto", "cpu") == "sdpa"


@pytest.mark.parametrize("major, expected", [(9, "flash4"), (10, "flash4"), (8, "sdpa"), (12, "sdpa")])
def test_auto_prefers_flash4_on_hopper_and_blackwell(fake_flash4, monkeypatch, major, expected):
    fake_flash4(STAND_IN)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # no FlashAttention 3 (a GPU machine may have one)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    assert resolve_backend("auto", "cuda:0") == expected
    assert resolve_backend("auto", "cpu") == "sdpa"


def test_flash4_is_one_opaque_op_equal_to_sdpa(fake_flash4):
    fake_flash4(STAND_IN)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 37, 2, 32, generator=g) for _ in range(3))
    expected = attention(q, k, v, "sdpa")
    assert torch.equal(attention(q, k, v, "flash4"), expected)
    from flash_attn.cute import CALLS

    calls = len(CALLS)
    compiled = torch.compile(lambda a, b, c: attention(a, b, c, "flash4") * 2, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(q, k, v), expected * 2)  # fullgraph: no break into the kernel's Python
    assert len(CALLS) > calls
    meta = torch.ops.h3.kernel_attention(*(t.to("meta") for t in (q, k, v)), "flash4")
    assert meta.shape == q.shape and meta.device.type == "meta"


def test_a_missing_backend_names_the_package_to_install():
    available = available_backends()
    for name in attention_module.EXACT_BACKENDS + attention_module.LOSSY_BACKENDS:
        if name not in available:
            with pytest.raises(ValueError, match=re.escape(f"'{attention_module._PACKAGES[name]}' package")):
                resolve_backend(name)


def test_fp8_per_head_in_chunks_equals_all_heads_at_once():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 40, 19, 16, generator=g) * torch.rand(19, generator=g)[None, None, :, None] * 9).bfloat16()
    quantized, descale = attention_module.fp8_per_head(x, heads_per_chunk=4)  # 19 heads: a partial last chunk
    scale = 448.0 / x.abs().amax(dim=(1, 3)).float()
    whole = (x.float() * scale[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    assert torch.equal(quantized.view(torch.uint8), whole.view(torch.uint8))
    assert torch.equal(descale, 1.0 / scale)


def test_fp8_per_head_round_trip():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 50, 3, 16, generator=g) * torch.tensor([0.1, 1.0, 30.0])[None, None, :, None]
    quantized, descale = attention_module.fp8_per_head(x)
    assert quantized.dtype == torch.float8_e4m3fn and descale.shape == (1, 3)
    restored = quantized.float() * descale[:, None, :, None]
    for head in range(3):  # e4m3 keeps ~2 significant digits of every head, whatever its scale
        error = (restored[:, :, head] - x[:, :, head]).abs().max() / x[:, :, head].abs().max()
        assert error < 0.07


def test_flash3_fp8_is_lossy_opt_in_and_close(tmp_path, monkeypatch):
    (tmp_path / "flash_attn_interface.py").write_text(FA3_STAND_IN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn_interface", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert "flash3-fp8-lossy" in attention_module.LOSSY_BACKENDS
    assert resolve_backend("auto", "cuda:0") in ("flash3", "flash4")  # never the lossy one
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 64, 2, 32, generator=g) for _ in range(3))
    exact = attention(q, k, v, "sdpa")
    got = attention(q, k, v, "flash3-fp8-lossy")
    import flash_attn_interface

    assert flash_attn_interface.CALLS[-1] == (torch.float8_e4m3fn, True)
    assert got.dtype == q.dtype and torch.nn.functional.cosine_similarity(got.flatten(), exact.flatten(), dim=0) > 0.99
    assert (got - exact).norm() / exact.norm() < 0.1  # the size too: cosine alone passes a scaled output
    assert not torch.equal(got, exact)
    # Compiled: the quantization is traced (Inductor fuses it), the kernel stays one opaque op, and the
    # result is the eager one bitwise.
    calls = len(flash_attn_interface.CALLS)
    compiled = torch.compile(lambda a, b, c: attention(a, b, c, "flash3-fp8-lossy"), fullgraph=True)
    assert torch.equal(compiled(q, k, v), got) and len(flash_attn_interface.CALLS) > calls
    meta, _ = torch.ops.h3.flash3(*(t.to("meta", torch.float8_e4m3fn) for t in (q, k, v)), -1,
                                  *(torch.ones(1, 2, device="meta") for _ in range(3)))
    assert meta.shape == q.shape and meta.dtype == torch.bfloat16
    sys.modules.pop("flash_attn_interface", None)


def test_flash3_pads_queries_to_an_even_tile_count(tmp_path, monkeypatch):
    """FA3 pairs CTAs into clusters only for an even number of 128-row query tiles: odd counts get zero
    query rows appended, which are cut from the result (out and log-sum-exp, contiguous as declared)."""
    (tmp_path / "flash_attn_interface.py").write_text(FA3_STAND_IN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn_interface", raising=False)
    import flash_attn_interface

    g = torch.Generator().manual_seed(3)
    for rows, sent in ((100, 256), (300, 512), (256, 256), (200, 200)):
        q, k, v = (torch.randn(1, rows, 2, 128, generator=g).bfloat16() for _ in range(3))
        out, lse = torch.ops.h3.flash3(q, k, v, -1, None, None, None)
        assert flash_attn_interface.QUERY_ROWS[-1] == sent
        assert out.shape == q.shape and lse.shape == (1, 2, rows) and out.is_contiguous() and lse.is_contiguous()
        assert torch.allclose(out.float(), attention(q, k, v, "sdpa").float(), atol=2e-2)
        compiled = torch.compile(lambda a, b, c: torch.ops.h3.flash3(a, b, c, -1, None, None, None)[0], fullgraph=True)
        assert torch.equal(compiled(q, k, v), out)
    q, k, v = (torch.randn(1, 100, 2, 64, generator=g).bfloat16() for _ in range(3))
    torch.ops.h3.flash3(q, k, v, -1, None, None, None)  # head_dim 64: other tiles, left as it is
    assert flash_attn_interface.QUERY_ROWS[-1] == 100
    q, k, v = (torch.randn(1, 100, 2, 128, generator=g).bfloat16() for _ in range(3))
    torch.ops.h3.flash3(q, k, v, 8, None, None, None)  # a window: FA3 never pairs CTAs there
    assert flash_attn_interface.QUERY_ROWS[-1] == 100
    sys.modules.pop("flash_attn_interface", None)


def test_query_rows_pads_only_for_flash3_full_attention(tmp_path, monkeypatch):
    """`query_rows` tells a caller that writes q anyway (compiled blocks) how many rows FA3 wants; q given
    that padded is passed on as it is, not padded again."""
    assert query_rows("flash3", None, 300, 128, torch.bfloat16) == 512  # 3 tiles -> 4
    assert query_rows("flash3", None, 256, 128, torch.float16) == 256  # even already
    for backend, window, head_dim, dtype in (("sdpa", None, 128, torch.bfloat16), ("flash3-fp8-lossy", None, 128, torch.bfloat16),
                                             ("flash3", object(), 128, torch.bfloat16), ("flash3", None, 64, torch.bfloat16),
                                             ("flash3", None, 128, torch.float32)):
        assert query_rows(backend, window, 300, head_dim, dtype) == 300
    (tmp_path / "flash_attn_interface.py").write_text(FA3_STAND_IN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn_interface", raising=False)
    import flash_attn_interface

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 300, 2, 128, generator=g).bfloat16() for _ in range(3))
    padded = torch.cat([q, q.new_zeros(1, 212, 2, 128)], dim=1)
    out = attention(padded, k, v, "flash3")
    assert flash_attn_interface.QUERY_ROWS[-1] == 512 and out.shape == (1, 512, 2, 128)
    assert torch.equal(out[:, :300], attention(q, k, v, "flash3"))
    sys.modules.pop("flash_attn_interface", None)


@pytest.mark.parametrize("major, expected", [(9, "flash3"), (10, "flash4"), (8, "sdpa")])
def test_auto_prefers_flash3_then_flash4_on_hopper(fake_flash4, tmp_path, monkeypatch, major, expected):
    fake_flash4(STAND_IN)
    (tmp_path / "flash_attn_interface.py").write_text(FA3_STAND_IN)
    monkeypatch.delitem(sys.modules, "flash_attn_interface", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    assert {"flash3", "flash4", "flash3-fp8-lossy"} <= set(available_backends())
    assert resolve_backend("auto", "cuda:0") == expected
    sys.modules.pop("flash_attn_interface", None)


@pytest.mark.parametrize("major", [9, 10])
def test_a_float32_dit_gets_sdpa_from_auto_and_is_refused_flash_kernels(fake_flash4, tmp_path, monkeypatch, major):
    """FlashAttention (and SageAttention) run fp16 / bf16 only: "auto" picked FA3 / FA4 for an fp32 DiT on
    Hopper / Blackwell, whose first attention then failed ("only supports fp16, bf16"); now auto gives it sdpa and
    a named half-precision kernel is refused before any weight is read (the lossy FP8 / int8 ones quantize first)."""
    fake_flash4(STAND_IN)
    (tmp_path / "flash_attn_interface.py").write_text(FA3_STAND_IN)
    monkeypatch.delitem(sys.modules, "flash_attn_interface", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    fast = "flash3" if major == 9 else "flash4"
    for dtype in (torch.bfloat16, torch.float16, None):
        assert resolve_backend("auto", "cuda:0", dtype=dtype) == fast
    assert resolve_backend("auto", "cuda:0", dtype=torch.float32) == "sdpa"
    for name in ("flash3", "flash4"):
        with pytest.raises(ValueError, match=f"'{name}' runs fp16 or bf16 only.*float32.*sdpa"):
            resolve_backend(name, "cuda:0", dtype=torch.float32)
        assert resolve_backend(name, "cuda:0", dtype=torch.bfloat16) == name
    assert resolve_backend("flash3-fp8-lossy", "cuda:0", dtype=torch.float32) == "flash3-fp8-lossy"
    dit = tiny_random_dit(torch.float32)  # the model says its own dtype
    with pytest.raises(ValueError, match="runs fp16 or bf16 only"):
        dit.set_attention("flash3")
    with pytest.raises(ValueError, match="runs fp16 or bf16 only"):
        dit.set_attention_backend("flash4")
    assert dit.blocks[0].attn.backend == "sdpa"  # kept
    assert tiny_random_dit(torch.bfloat16).set_attention("flash3") == "flash3"
    sys.modules.pop("flash_attn_interface", None)


def test_a_broken_flash3_build_is_not_offered(tmp_path, monkeypatch):
    """A FlashAttention 3 build whose extension fails to load (seen: an unresolved libtorch_cuda symbol)
    is found on the path but must not be chosen by auto."""
    (tmp_path / "flash_attn_interface.py").write_text(
        "raise ImportError('_C.abi3.so: undefined symbol: aoti_torch_get_current_cuda_stream')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn_interface", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert not {"flash3", "flash3-fp8-lossy"} & set(available_backends())
    assert resolve_backend("auto", "cuda:0") in ("sdpa", "flash4")
