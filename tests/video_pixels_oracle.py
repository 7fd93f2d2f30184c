"""transformers' own Qwen3-VL video processor on the clips tests/test_text.py presents, recorded where torchvision
is installed (ComfyUI's Python has it): our torch-only video path is compared with the recording wherever the tests
run, torchvision or not (CI has none: PyPI's torchvision needs a CUDA torch). Record again with
`python tests/video_pixels_oracle.py` in a Python with torchvision, from the repository root."""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import torch

RECORDING = Path(__file__).parent / "data" / "qwen3vl_video_pixels.safetensors"
SIZES = {  # the tiny processor's pixel budget (clips made smaller), one that makes them larger, one capped per frame
    "tiny": {"shortest_edge": 1024, "longest_edge": 16384},
    "upscaled": {"shortest_edge": 30000, "longest_edge": 10**8},
    "capped": {"shortest_edge": 4096, "longest_edge": 8192},  # per frame: the floor, 1.05 x shortest_edge, wins
}
CAP_PIXELS_PER_FRAME = {"capped"}  # the sizes read with the processor's cap_pixels_per_frame set
CLIPS = [(3, 1, 64, 96), (5, 2, 70, 100)]  # frames, seed, height, width


def clip(frames: int, seed: int, height: int = 64, width: int = 96) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


def clips() -> list[np.ndarray]:
    return [clip(*spec) for spec in CLIPS]


def native_uint8_resize() -> bool:
    """Whether torchvision resizes uint8 natively on this CPU (else through float32: other roundings)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or platform.machine() in ("aarch64", "arm64")


def processor_config(size: str) -> dict:
    from h3_core.tiny_text import VIDEO_PROCESSOR

    return dict(VIDEO_PROCESSOR, size=SIZES[size], cap_pixels_per_frame=size in CAP_PIXELS_PER_FRAME)


def stock_pixels() -> dict[str, torch.Tensor]:
    """{size}.pixels / {size}.grid from transformers' Qwen3VLVideoProcessor (needs torchvision)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    recorded = {}
    for size in SIZES:
        config = processor_config(size)
        stock = Qwen3VLVideoProcessor(
            **{k: v for k, v in config.items() if not k.endswith("_class") and k != "video_processor_type"}
        )
        out = stock(videos=clips(), do_sample_frames=False, cap_pixels_per_frame=config["cap_pixels_per_frame"],
                    return_tensors="pt")
        recorded[f"{size}.pixels"] = out["pixel_values_videos"].contiguous()
        recorded[f"{size}.grid"] = out["video_grid_thw"].contiguous()
    return recorded


if __name__ == "__main__":
    import torchvision
    import transformers
    from safetensors.torch import save_file

    RECORDING.parent.mkdir(exist_ok=True)
    save_file(stock_pixels(), str(RECORDING), metadata={
        "transformers": transformers.__version__, "torchvision": torchvision.__version__,
        "native_uint8_resize": str(native_uint8_resize()),
    })
    print(f"wrote {RECORDING} ({RECORDING.stat().st_size} bytes)")
