"""Windowed attention for the target video rows: a lossy, opt-in speed path.

Full attention over ~38k rows is ~60% of a forward's time. Here each *target video* row attends every
row before the target video (text, conditioning, audio: a few hundred to a few thousand rows) and only
the target video rows within `radius` rows of itself; every other row still attends the whole
sequence. Video rows are frame-major, so `radius = frames * rows_per_frame` keeps the frames within
`frames` latent frames (4 pixel frames each) of a row: attention work falls to about
(2 * frames + 1) / latent_frames of full. This changes the model's outputs (it was trained with full
attention): how much it costs in quality can only be judged on real weights, so it is never a default.

The target video is the sequence's trailing run of rows (every layout in layout.py ends with it).
Backends: "flash3" and "flash3-fp8-lossy" run FlashAttention 3's sliding-window kernels (a build with
LOCAL enabled) and merge the window part with the prefix part by their log-sum-exps; "sdpa" computes
the same thing in query chunks with a boolean mask (correct anywhere, not faster).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

WINDOW_BACKENDS = ("sdpa", "flash3", "flash3-fp8-lossy")


@dataclass(frozen=True)
class VideoWindow:
    """Target video rows are rows [start, S); each attends rows [0, start) and the target rows within
    `radius` of its own position."""

    start: int
    radius: int

    @classmethod
    def for_frames(cls, frames: int, rows: int, start: int, rows_per_frame: int) -> "VideoWindow | None":
        """The window of `frames` latent frames for a sequence of `rows` whose target video starts at
        `start`; None when the window would cover every target row anyway (attention is then exact)."""
        radius = frames * rows_per_frame
        if frames <= 0 or radius >= rows - start - 1:
            return None
        return cls(start, radius)


def check_setting(frames, dense_steps=0) -> tuple[int, int]:
    """A window setting: a whole number of latent frames (0: full attention) and of leading forwards of
    each run that keep full attention; both >= 0."""
    for value, what in ((frames, "The attention window is a whole number of latent frames >= 0 (0: full attention)"),
                        (dense_steps, "The attention window's dense steps are a whole number of steps >= 0")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{what}, got {value!r}.")
    return frames, dense_steps


def dense_covers_run(frames: int, dense_steps: int, calls: int) -> str | None:
    """Why a window would never apply in a run of `calls` model calls (its dense steps cover them all: the run
    is exact while it is called lossy), or None."""
    if frames and dense_steps >= calls:
        return (f"The attention window's {dense_steps} dense steps keep full attention for all {calls} model calls "
                f"of this run, so the lossy window never applies; give fewer than {calls} dense steps, or no window.")
    return None


def check_backend(backend: str) -> None:
    """Refuse, before any work, a backend that cannot run the window: not one of WINDOW_BACKENDS, or a
    FlashAttention 3 build without its sliding-window kernels (a tiny call on the GPU tells)."""
    if backend not in WINDOW_BACKENDS:
        raise _not_a_window_backend(backend)
    if backend.startswith("flash3") and torch.cuda.is_available() and not _flash3_has_windows():
        raise ValueError("This FlashAttention 3 build has no sliding-window kernels (it was built with "
                         "FLASH_ATTENTION_DISABLE_LOCAL): rebuild it without that switch (README), or run the "
                         "window on the sdpa backend.")


@functools.cache
def _flash3_has_windows() -> bool:
    """Whether the installed FlashAttention 3 was built with its sliding-window kernels: one tiny call on
    the GPU, once a process."""
    q = torch.zeros(1, 256, 1, 128, dtype=torch.bfloat16, device="cuda")
    try:
        torch.ops.h3.flash3(q, q, q, 64, None, None, None)
    except RuntimeError as error:
        if "local attention" not in str(error):
            raise
        return False
    return True


def _not_a_window_backend(backend: str) -> ValueError:
    return ValueError(f"The attention window runs on the {', '.join(WINDOW_BACKENDS)} attention backends; "
                      f"{backend!r} is chosen.")


def window_mask(query_rows: range, key_rows: range, window: VideoWindow) -> torch.Tensor:
    """Which (query, key) pairs attend, as a bool [len(query_rows), len(key_rows)] (rows are sequence
    positions): keys before the target video always, target keys within the radius of a target query."""
    q = torch.arange(query_rows.start, query_rows.stop)[:, None]
    k = torch.arange(key_rows.start, key_rows.stop)[None, :]
    return (k < window.start) | (q < window.start) | ((q - k).abs() <= window.radius)


def windowed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, backend: str,
                       window: VideoWindow) -> torch.Tensor:
    """[B, S, H, D] in and out; rows before `window.start` get full attention, target rows the window."""
    from .attention import flash3_inputs, sdpa  # (attention.py imports this module)

    if backend not in WINDOW_BACKENDS:
        raise _not_a_window_backend(backend)
    start, dtype = window.start, query.dtype
    if backend == "sdpa":
        target = _sdpa_windowed(query[:, start:], key, value, window)
        prefix = sdpa(query[:, :start], key, value)
    else:  # FP8: one scale per head over all rows, then slices of it
        (query, key, value), scales = flash3_inputs(query, key, value, fp8=backend == "flash3-fp8-lossy")
        target, near_lse = torch.ops.h3.flash3(query[:, start:], key[:, start:], value[:, start:], window.radius, *scales)
        if start == 0:  # no rows before the target video
            return target.to(dtype)
        far, far_lse = torch.ops.h3.flash3(query[:, start:], key[:, :start], value[:, :start], -1, *scales)
        target = merge_partials(target, near_lse, far, far_lse)
        prefix, _ = torch.ops.h3.flash3(query[:, :start], key, value, -1, *scales)
    return torch.cat([prefix.to(dtype), target.to(dtype)], dim=1)


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over keys A and B from attention over each: outputs [B, S, H, D] weighted by their
    softmax mass (log-sum-exps [B, H, S], natural log); float32 out."""
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse).transpose(1, 2).unsqueeze(-1)
    weight_b = torch.exp(lse_b - lse).transpose(1, 2).unsqueeze(-1)
    return out_a.float() * weight_a + out_b.float() * weight_b


def _sdpa_windowed(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: VideoWindow) -> torch.Tensor:
    """Target queries [B, S - start, H, D] in chunks of `radius` rows: each against the prefix keys and
    the target keys that can fall in its window, masked."""
    from .attention import sdpa

    start, radius, rows = window.start, window.radius, key.shape[1]
    chunk = max(radius, 64)
    outs = []
    for first in range(start, rows, chunk):
        last = min(first + chunk, rows)
        low, high = max(start, first - radius), min(rows, last + radius)
        keys = torch.cat([key[:, :start], key[:, low:high]], dim=1)
        values = torch.cat([value[:, :start], value[:, low:high]], dim=1)
        near = window_mask(range(first, last), range(low, high), window)
        mask = torch.cat([torch.ones(last - first, start, dtype=torch.bool), near], dim=1).to(query.device)
        outs.append(sdpa(query[:, first - start:last - start], keys, values, mask))
    return torch.cat(outs, dim=1)
