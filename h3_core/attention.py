"""Attention behind one call, so backends can be swapped without touching the model.

H3 packs one request into a single attention document: full, bidirectional, unmasked, scale
1/sqrt(head_dim). Inputs and output are [batch, rows, heads, head_dim].

Backends: "sdpa" (torch; picks cuDNN / flash / efficient kernels itself, exact), "flash3"
(FlashAttention 3 for Hopper, exact, if `flash_attn_interface` is importable), "flash" (FlashAttention
2, exact, if `flash_attn` is importable), "sage" (SageAttention, 8-bit QK: lossy, opt-in only) and
"int8qk-fp8pv-lossy" (our Triton kernel, attention_8bit.py: int8 QK and FP8 PV on CUDA; lossy, opt-in).
"auto" takes the fastest exact one available: FlashAttention 3 on Hopper, else SDPA (on an H200,
SDPA's cuDNN kernel measured 578 TFLOP/s against 368 for FlashAttention 2's).
"""

from __future__ import annotations

import importlib.util
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger("h3_core")

EXACT_BACKENDS = ("sdpa", "flash3", "flash")
LOSSY_BACKENDS = ("sage", "int8qk-fp8pv-lossy")
_MODULES = {"flash3": "flash_attn_interface", "flash": "flash_attn", "sage": "sageattention", "int8qk-fp8pv-lossy": "triton"}


def available_backends() -> list[str]:
    """Backends importable here ("sdpa" always is)."""
    return ["sdpa"] + [name for name, module in _MODULES.items() if importlib.util.find_spec(module) is not None]


def resolve_backend(requested: str = "auto", device: torch.device | str | None = None) -> str:
    """The backend to use for `requested` ("auto" or a name); an unavailable name is an error."""
    known = ("auto",) + EXACT_BACKENDS + LOSSY_BACKENDS
    if requested not in known:
        raise ValueError(f"Unknown attention backend {requested!r}; choose one of {', '.join(known)}.")
    available = available_backends()
    if requested == "auto":
        device = torch.device(device) if device is not None else None
        hopper = device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
        chosen = "flash3" if hopper and "flash3" in available else "sdpa"
        log.info("attention backend: %s (auto; available: %s)", chosen, ", ".join(available))
        return chosen
    if requested not in available:
        raise ValueError(
            f"Attention backend {requested!r} needs the '{_MODULES[requested]}' package, which is not installed; "
            f"available here: {', '.join(available)}."
        )
    return requested


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, backend: str = "sdpa") -> torch.Tensor:
    """Full self-attention over the packed sequence; [B, S, H, D] in and out."""
    if backend == "sdpa":
        out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
        return out.transpose(1, 2)
    if backend == "flash3":
        import flash_attn_interface

        out = flash_attn_interface.flash_attn_func(query, key, value, causal=False)
        return out[0] if isinstance(out, tuple) else out
    if backend == "flash":
        import flash_attn

        return flash_attn.flash_attn_func(query, key, value, causal=False)
    if backend == "sage":
        import sageattention

        return sageattention.sageattn(query, key, value, tensor_layout="NHD", is_causal=False)
    if backend == "int8qk-fp8pv-lossy":
        from .attention_8bit import int8qk_fp8pv_attention

        return int8qk_fp8pv_attention(query, key, value)
    raise ValueError(f"Unknown attention backend {backend!r}; choose one of {', '.join(EXACT_BACKENDS + LOSSY_BACKENDS)}.")
