"""What this machine gives H3 (`h3 env`): versions, devices, the attention kernels and media encoders a run
would use, and the memory there is. One report to paste into a bug report, and a quick check after an
install that the fast paths are really there (a FlashAttention build that does not import is not offered)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys

import torch

from . import attention
from .fp8 import scaled_mm_supported
from .geometry import canvas_size
from .runtime import GIB, host_memory_available

# distributions whose versions matter to a run (None where not installed)
PACKAGES = ("comfyui-h3", "torch", "transformers", "safetensors", "huggingface_hub", "av", "numpy", "pillow", "gguf",
            "triton", "flash-attn-4", "flash-attn-3", "flash-attn", "sageattention", "diffusers")
# environment variables that change what a run does
SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "CUDA_VISIBLE_DEVICES", "HF_HOME", "HF_HUB_OFFLINE", "COMFYUI_PATH")


def package_version(distribution: str) -> str | None:
    """The installed version of `distribution`, or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _device(index: int) -> dict:
    properties = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    device = torch.device("cuda", index)
    return {
        "device": str(device),
        "name": properties.name,
        "compute_capability": f"{properties.major}.{properties.minor}",
        "memory_gib": round(total / GIB, 2),
        "free_gib": round(free / GIB, 2),
        "attention_auto": attention.resolve_backend("auto", device),
        "fp8_matmuls": scaled_mm_supported("cuda", index),
    }


def _media() -> dict:
    """The encoders an MP4 would be written with (the H.264 one opened at the 16:9 canvas), or why none."""
    from .media_write import EncoderUnavailableError, pick_aac_encoder, pick_h264_encoder

    found = {}
    for kind, pick in (("h264_encoder", lambda: pick_h264_encoder(*canvas_size("16:9"))), ("aac_encoder", pick_aac_encoder)):
        try:
            found[kind] = pick()
        except EncoderUnavailableError as error:
            found[kind] = f"none: {error}"
    return found


def report() -> dict:
    """The whole report, as JSON-ready values. Probing CUDA initializes it (nothing is allocated)."""
    cuda = torch.cuda.is_available()
    memory = host_memory_available()
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {name: package_version(name) for name in PACKAGES},
        "torch_cuda": torch.version.cuda,
        "cuda_devices": [_device(index) for index in range(torch.cuda.device_count())] if cuda else [],
        "attention_available": attention.available_backends(),
        "attention_auto_cpu": attention.resolve_backend("auto", "cpu"),
        "fp8_matmuls_cpu": scaled_mm_supported("cpu"),
        "media": _media(),
        "host_memory_available_gib": None if memory is None else round(memory / GIB, 2),
        "settings": {name: os.environ.get(name) for name in SETTINGS},
        "cuda_allocator_h3_generate": _allocator(),
    }


def _allocator() -> str:
    """The CUDA allocator a one-device `h3 generate` runs with (runtime.use_expandable_segments)."""
    from .runtime import ALLOCATOR_VARIABLES, EXPANDABLE_SEGMENTS

    configured = [f"{name}={os.environ[name]}" for name in ALLOCATOR_VARIABLES if os.environ.get(name)]
    if configured:
        return ", ".join(configured) + " (yours)"
    return "expandable_segments:True (set by h3)" if EXPANDABLE_SEGMENTS else "torch's default (fixed segments)"
