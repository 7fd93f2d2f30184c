"""Attention behind one call, so backends can be swapped without touching the model.

H3 packs one request into a single attention document: full, bidirectional, unmasked, scale
1/sqrt(head_dim). Inputs and output are [batch, rows, heads, head_dim].

Backends: "sdpa" (torch; picks cuDNN / flash / efficient kernels itself, exact), "flash4"
(FlashAttention 4, the CuTe-DSL kernels of the `flash-attn-4` package, Hopper and Blackwell, exact),
"flash3" (FlashAttention 3 for Hopper, exact, if `flash_attn_interface` is importable), "flash"
(FlashAttention 2, exact, if `flash_attn` is importable), "sage" (SageAttention, 8-bit QK: lossy,
opt-in only), "int8qk-fp8pv-lossy" (our Triton kernel, attention_8bit.py: int8 QK and FP8 PV on
CUDA; lossy, opt-in) and "flash3-fp8-lossy" (FlashAttention 3's FP8 forward on q, k, v quantized per
head; lossy, opt-in). Kernels from packages run as one opaque op (`h3::kernel_attention`; FlashAttention
3 as `h3::flash3`, which also serves its FP8 forward after the quantization, fused by compiled blocks,
and the window's sliding-window calls), which torch.compile calls without tracing into them. "auto" takes the fastest exact one available for the
device: on Hopper FlashAttention 3, then 4 (H200, 38k rows: 699 and 687 TFLOP/s), on Blackwell
FlashAttention 4, else SDPA (572 TFLOP/s with cuDNN on the H200; FlashAttention 2 368).
A `window` (local_attention.py, lossy, opt-in) limits the target video rows to nearby video rows.
"""

from __future__ import annotations

import importlib
import logging

import torch
import torch.nn.functional as F

from .local_attention import check_backend as check_window_backend, windowed_attention

log = logging.getLogger("h3_core")

EXACT_BACKENDS = ("sdpa", "flash4", "flash3", "flash")
LOSSY_BACKENDS = ("sage", "int8qk-fp8pv-lossy", "flash3-fp8-lossy")
# The module each backend imports. FlashAttention 2 is named by its interface module: flash-attn-4
# installs `flash_attn` as a bare namespace (only `flash_attn.cute`), which must not count as FA2.
_MODULES = {
    "flash4": "flash_attn.cute", "flash3": "flash_attn_interface", "flash": "flash_attn.flash_attn_interface",
    "sage": "sageattention", "int8qk-fp8pv-lossy": "triton", "flash3-fp8-lossy": "flash_attn_interface",
}
_PACKAGES = {"flash4": "flash-attn-4", "flash3": "flash-attn-3 (hopper/ build)", "flash": "flash-attn",
             "sage": "sageattention", "int8qk-fp8pv-lossy": "triton",
             "flash3-fp8-lossy": "flash-attn-3 (hopper/ build)"}
_HOPPER_OR_NEWER = {"flash4": (9, 10), "flash3": (9,)}  # compute-capability majors each kernel is built for
_HALF_PRECISION = (torch.float16, torch.bfloat16)
# Kernels that take fp16 / bf16 activations only (FlashAttention's "only supports fp16, bf16"): a float32 DiT is
# refused them, and "auto" gives it sdpa. The lossy FP8 / int8 kernels quantize their inputs first.
_HALF_PRECISION_ONLY = ("flash4", "flash3", "flash", "sage")


def _importable(name: str, module: str) -> bool:
    """Whether the backend's module imports: found is not enough (flash-attn-4 without its CuTe DSL
    runtime, a FlashAttention 3 build with an unresolved symbol both fail only when imported)."""
    try:
        importlib.import_module(module)
        return True
    except Exception as error:  # noqa: BLE001  missing or broken: either way not offered
        log.debug("attention backend %s not usable: %s", name, error)
        return False


def available_backends() -> list[str]:
    """Backends importable here ("sdpa" always is)."""
    return ["sdpa"] + [name for name, module in _MODULES.items() if _importable(name, module)]


def resolve_backend(requested: str = "auto", device: torch.device | str | None = None, window: bool = False,
                    dtype: torch.dtype | None = None) -> str:
    """The backend to use for `requested` ("auto" or a name); an unavailable name is an error. `window`:
    it must run the attention window (local_attention.py), and "auto" picks among those that can. `dtype`: the
    DiT's compute dtype where known (None: not yet known), since FlashAttention and SageAttention run fp16 / bf16
    only."""
    known = ("auto",) + EXACT_BACKENDS + LOSSY_BACKENDS
    if requested not in known:
        raise ValueError(f"Unknown attention backend {requested!r}; choose one of {', '.join(known)}.")
    full_precision = dtype is not None and dtype not in _HALF_PRECISION
    if full_precision and requested in _HALF_PRECISION_ONLY:
        raise ValueError(f"Attention backend {requested!r} runs fp16 or bf16 only, and this DiT computes in "
                         f"{str(dtype).removeprefix('torch.')}: choose sdpa (or auto), or a bf16 / fp16 model dtype.")
    available = available_backends()
    if requested == "auto":
        device = torch.device(device) if device is not None else None
        major = torch.cuda.get_device_capability(device)[0] if device is not None and device.type == "cuda" else None
        fitting = [name for name in ("flash3", "flash4") if name in available and major in _HOPPER_OR_NEWER[name]
                   and not full_precision]
        if window:
            fitting = [name for name in fitting if _runs_window(name)]
        chosen = fitting[0] if fitting else "sdpa"
        log.info("attention backend: %s (auto; available: %s)", chosen, ", ".join(available))
        if window and chosen == "sdpa" and device is not None and device.type == "cuda":
            log.warning("The attention window runs on sdpa here (no FlashAttention 3 with sliding-window kernels): "
                        "same result, but slower than full attention, not faster.")
        return chosen
    if requested not in available:
        raise ValueError(
            f"Attention backend {requested!r} needs the '{_PACKAGES[requested]}' package, which is not installed; "
            f"available here: {', '.join(available)}."
        )
    if window:
        check_window_backend(requested)
    return requested


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """torch's scaled_dot_product_attention on [B, S, H, D] in and out (it takes heads first)."""
    out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


def _runs_window(name: str) -> bool:
    try:
        check_window_backend(name)
        return True
    except ValueError as error:
        log.info("attention backend %s cannot run the attention window: %s", name, error)
        return False


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, backend: str = "sdpa",
              window=None) -> torch.Tensor:
    """Full self-attention over the packed sequence; [B, S, H, D] in and out. `window`: a
    local_attention.VideoWindow, the lossy windowed attention for the target video rows."""
    if window is not None:
        return windowed_attention(query, key, value, backend, window)
    if backend == "sdpa":
        return sdpa(query, key, value)
    if backend in ("flash3", "flash3-fp8-lossy"):
        (q, k, v), descales = flash3_inputs(query, key, value, fp8=backend == "flash3-fp8-lossy")
        return torch.ops.h3.flash3(q, k, v, -1, *descales)[0].to(query.dtype)
    if backend == "int8qk-fp8pv-lossy":
        from .attention_8bit import int8qk_fp8pv_attention

        return int8qk_fp8pv_attention(query, key, value)
    if backend in _MODULES:
        return torch.ops.h3.kernel_attention(query, key, value, backend)
    raise ValueError(f"Unknown attention backend {backend!r}; choose one of {', '.join(EXACT_BACKENDS + LOSSY_BACKENDS)}.")


@torch.library.custom_op("h3::kernel_attention", mutates_args=())
def _kernel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, backend: str) -> torch.Tensor:
    """An installed attention package's kernel as one opaque op, so torch.compile'd blocks call the kernel
    instead of tracing the Python (CuTe DSL, ctypes, Triton launchers) behind it."""
    if backend == "flash4":
        return _flash4(query, key, value)
    if backend == "flash":
        import flash_attn

        return flash_attn.flash_attn_func(query, key, value, causal=False)
    if backend == "sage":
        import sageattention

        return sageattention.sageattn(query, key.clone(), value, tensor_layout="NHD", is_causal=False)  # smooths k in place
    raise ValueError(f"Unknown attention backend {backend!r}.")


@_kernel_attention.register_fake
def _(query, key, value, backend):
    return torch.empty_like(query)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _flash4(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    from flash_attn.cute import flash_attn_func, interface

    if query.shape[-1] == 128 and query.is_cuda and torch.cuda.get_device_capability(query.device)[0] == 9:
        try:  # Hopper, head_dim 128: 192x128 tiles, P from shared memory: 687 vs 667 TFLOP/s on an H200
            return interface._flash_attn_fwd(query, key, value, causal=False, tile_mn=(192, 128),
                                              mma_pv_is_rs=False, intra_wg_overlap=True)[0]
        except (AttributeError, TypeError):  # a flash-attn-4 whose private entry point changed: its defaults
            pass
    return _first(flash_attn_func(query, key, value, causal=False))


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def fp8_per_head(tensor: torch.Tensor, heads_per_chunk: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S, H, D] -> (e4m3 values, fp32 descale [B, H]): one scale per batch and head, from its amax.
    Eagerly a few heads at a time, so the fp32 intermediate is a slice of the rows, not a copy of them
    all; under torch.compile one expression, which Inductor fuses without any intermediate."""
    amax = torch.maximum(tensor.amax(dim=(1, 3)), -tensor.amin(dim=(1, 3))).float().clamp_min(1e-12)
    scale = FP8_MAX / amax
    if torch.compiler.is_compiling():
        quantized = (tensor.float() * scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return quantized, 1.0 / scale
    quantized = torch.empty(tensor.shape, dtype=torch.float8_e4m3fn, device=tensor.device)
    for start in range(0, tensor.shape[2], heads_per_chunk):
        heads = slice(start, start + heads_per_chunk)
        scaled = tensor[:, :, heads].float() * scale[:, None, heads, None]
        quantized[:, :, heads] = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quantized, 1.0 / scale


def flash3_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, fp8: bool):
    """(q, k, v), (their descales) as `h3::flash3` takes them: e4m3 with one scale per head for the FP8
    forward (quantized outside the op, so a compiled block fuses it into its RoPE kernel), else as given."""
    if not fp8:
        return (query, key, value), (None, None, None)
    (q, q_descale), (k, k_descale), (v, v_descale) = (fp8_per_head(t) for t in (query, key, value))
    return (q, k, v), (q_descale, k_descale, v_descale)


@torch.library.custom_op("h3::flash3", mutates_args=())
def _flash3(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, radius: int, q_descale: torch.Tensor | None,
            k_descale: torch.Tensor | None, v_descale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention 3 on q [B, Sq, H, D] and k, v [B, Sk, H, D] (bf16 / fp16, or e4m3 with fp32 descales
    [B, H]). radius -1: every key; else a sliding window, keys within `radius` positions of the query
    (rows aligned at their start). Returns (out: the inputs' dtype, bf16 for e4m3; fp32 log-sum-exp
    [B, H, Sq], which FA3 computes anyway)."""
    import flash_attn_interface

    if radius >= 0 and key.shape[1] != query.shape[1]:
        raise ValueError("A windowed FlashAttention 3 call needs as many key rows as query rows.")
    rows = query.shape[1]
    if radius < 0:
        query = pad_to_even_query_tiles(query)
    out, lse = flash_attn_interface.flash_attn_func(query, key, value, causal=False, window_size=(radius, radius),
                                                    q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                                                    return_attn_probs=True)
    if out.shape[1] != rows:
        out, lse = out[:, :rows].contiguous(), lse[:, :, :rows].contiguous()
    return out, lse


FLASH3_QUERY_TILE = 128  # FlashAttention 3's query tile on Hopper at head_dim 128, bf16 / fp16


def query_rows(backend: str, window, rows: int, head_dim: int, dtype: torch.dtype) -> int:
    """The query rows `attention` runs best with for `rows` keys: more (zeros after the real ones) only where
    FlashAttention 3's full-attention forward would pad q itself. A caller that writes q anyway can write it
    padded, saving that copy; the output then has the padded rows too, to be cut off."""
    if backend != "flash3" or window is not None:
        return rows
    return flash3_query_rows(rows, head_dim, dtype)


def flash3_query_rows(rows: int, head_dim: int, dtype: torch.dtype) -> int:
    """`rows` rounded up to an even number of query tiles. Only then does FlashAttention 3's full-attention
    forward pair CTAs in 2-CTA clusters that share each K/V load (in a build with clusters, the default).
    On an H200 a compiled 124-frame forward (38,222 rows, 299 tiles) went from 5.144 to 5.111 s with a
    copy of q into the padded buffer included (bench/RESULTS.md)."""
    if dtype not in _HALF_PRECISION or head_dim != 128:
        return rows  # other tiles; and FA3 pairs 8-bit CTAs only at head_dim 192
    tiles = -(-rows // FLASH3_QUERY_TILE)
    return rows if tiles % 2 == 0 else (tiles + 1) * FLASH3_QUERY_TILE


def pad_to_even_query_tiles(query: torch.Tensor) -> torch.Tensor:
    """q with the zero rows `flash3_query_rows` asks for appended (none if it is padded already)."""
    rows = flash3_query_rows(query.shape[1], query.shape[-1], query.dtype)
    if rows == query.shape[1]:
        return query
    return torch.cat([query, query.new_zeros(query.shape[0], rows - query.shape[1], *query.shape[2:])], dim=1)


@_flash3.register_fake
def _(query, key, value, radius, q_descale, k_descale, v_descale):
    batch, rows, heads, _ = query.shape
    dtype = torch.bfloat16 if query.dtype == torch.float8_e4m3fn else query.dtype
    return (torch.empty(query.shape, dtype=dtype, device=query.device),
            torch.empty(batch, heads, rows, dtype=torch.float32, device=query.device))
