"""The dual-clock flow sampler: one sigma ladder per modality, Euler steps in fp32.

H3's convention: t = 1 - sigma, t = 1 is clean. The DiT predicts a data-ward velocity, so
x0 = x_t + sigma * v, and an Euler step blends x_next = r * x_t + (1 - r) * x0 with r = s_next / s.
Video rows and text run on the video clock (shift 12), audio rows on the audio clock (shift 3);
conditioning rows are never written (their timesteps come from the layout's row clocks).
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from . import geometry
from .layout import unpatchify
from .local_attention import dense_covers_run

log = logging.getLogger("h3_core")

VIDEO_SHIFT = 12.0
AUDIO_SHIFT = 3.0


def sigma_ladder(points: int, shift: float) -> torch.Tensor:
    """`points` sigmas from 1 to 0 inclusive (so points - 1 model calls), shifted, duplicates collapsed.

    The grid is built in fp32 on the CPU so the schedule never depends on the device.
    """
    check_steps(points)
    return _shifted_grid(points, shift)


def _shifted_grid(points: int, shift: float) -> torch.Tensor:
    check_shift(shift)
    return torch.unique_consecutive(shift_time(torch.linspace(1.0, 0.0, int(points), dtype=torch.float32), shift))


def shift_time(u, shift: float):
    """The rectified-flow time shift s = shift * u / (1 + (shift - 1) * u) of a position u in [0, 1] (a float or a
    tensor), for uniform grids here and published ladders (lora.py) alike."""
    return shift * u / (1 + (shift - 1) * u)


# Bounds of what a user may ask for (the release runs 50 points at shifts 12 / 3): a shift of 1e39 made NaN sigmas,
# 1e-10 an infinite one; a billion points ran for hours before the first step
MAX_STEPS = 1000
MAX_DENOISE_POINTS = 100 * MAX_STEPS  # the longer ladder denoise < 1 cuts its last steps from (built, never run)
MIN_SHIFT, MAX_SHIFT = 0.01, 100.0


def check_steps(points: int) -> None:
    if isinstance(points, bool) or not isinstance(points, numbers.Integral) or not 2 <= points <= MAX_STEPS:
        raise ValueError(f"steps counts sigma points including the final 0, so it must be an integer from 2 to "
                         f"{MAX_STEPS}; got {points!r}.")


def check_shift(shift: float, name: str = "shift", bounded: bool = False) -> None:
    """The shift formula takes any positive number (the reference's parity tests use 1e9); `bounded`: a user's
    setting, within MIN_SHIFT..MAX_SHIFT."""
    if isinstance(shift, bool) or not isinstance(shift, numbers.Real):
        raise ValueError(f"{name} must be a number, got {shift!r}.")
    if bounded and not (math.isfinite(shift) and MIN_SHIFT <= shift <= MAX_SHIFT):
        raise ValueError(f"{name} must be a number from {MIN_SHIFT:g} to {MAX_SHIFT:g}, got {shift}.")
    if not (math.isfinite(shift) and shift > 0):
        raise ValueError(f"{name} must be a positive number, got {shift}.")


def custom_ladder(sigmas: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """User sigmas, used verbatim: at least two, strictly decreasing, ending at exactly 0."""
    ladder = torch.as_tensor(sigmas, dtype=torch.float32).flatten().cpu()
    if ladder.numel() < 2 or not bool((ladder[1:] < ladder[:-1]).all()) or ladder[-1].item() != 0.0:
        raise ValueError(f"Custom sigmas must be at least two strictly decreasing values ending at 0.0; got {ladder.tolist()}.")
    if ladder[0].item() > 1.0:
        raise ValueError(f"Custom sigmas must not exceed 1.0 (pure noise); got {ladder[0].item()}.")
    if ladder.numel() > MAX_STEPS:
        raise ValueError(f"Custom sigmas have {ladder.numel()} points; at most {MAX_STEPS} are allowed (each point but "
                         "the last is one model call).")
    return ladder


@dataclass(frozen=True)
class DualClockSchedule:
    """The two ladders of one request; both have the same point count unless de-duplication shortened one."""

    video: torch.Tensor
    audio: torch.Tensor

    @classmethod
    def build(
        cls,
        steps: int = 50,
        video_shift: float = VIDEO_SHIFT,
        audio_shift: float = AUDIO_SHIFT,
        video_sigmas: Sequence[float] | None = None,
        audio_sigmas: Sequence[float] | None = None,
        denoise: float = 1.0,
    ) -> "DualClockSchedule":
        """`denoise` < 1 runs only the last `steps` points of a longer ladder (steps / denoise points), the
        way image samplers refine a given latent; explicit ladders say where they start themselves."""
        for name, shift in (("video_shift", video_shift), ("audio_shift", audio_shift)):
            check_shift(shift, name)
        if isinstance(denoise, bool) or not isinstance(denoise, numbers.Real) or not 0.0 < denoise <= 1.0:
            raise ValueError(f"denoise must be in (0, 1], got {denoise!r}.")
        if denoise < 1.0 and (video_sigmas is not None or audio_sigmas is not None):
            raise ValueError("denoise < 1 cuts the automatic ladders; with explicit sigmas (custom ones, or a Turbo "
                             "adapter's own ladder) start the ladder lower instead and keep denoise at 1.")
        given = [torch.as_tensor(ladder).numel() for ladder in (video_sigmas, audio_sigmas) if ladder is not None]
        if len(given) == 2 and given[0] != given[1]:
            raise ValueError(f"video_sigmas has {given[0]} points and audio_sigmas {given[1]}: the two ladders are "
                             "walked together, so the longer one would stop before 0; give both the same count.")
        if len(given) == 1:  # the automatic ladder walks as many points as the given one
            steps = given[0]
        if not given:  # what runs: a small denoise builds a longer ladder, but only its last `steps` points run
            check_steps(steps)
        points = steps if denoise == 1.0 else round((steps - 1) / denoise) + 1
        if denoise < 1.0 and points == steps:  # the whole ladder, from pure noise: the latent would go unused
            most = next(d / 100 for d in range(99, 0, -1) if round((steps - 1) / (d / 100)) + 1 > steps)
            raise ValueError(f"denoise {denoise:g} with {steps} steps rounds to the whole {steps}-point ladder, which "
                             f"starts from pure noise: the latent would not be used. Lower denoise to {most:g} or "
                             "less, or give more steps.")
        if points > MAX_DENOISE_POINTS:
            raise ValueError(f"denoise {denoise:g} with {steps} steps runs the end of a {points}-point ladder; at most "
                             f"{MAX_DENOISE_POINTS} are built: raise denoise to at least "
                             f"{(steps - 1) / (MAX_DENOISE_POINTS - 1):.2g}.")
        video = custom_ladder(video_sigmas) if video_sigmas is not None else _shifted_grid(points, video_shift)[-steps:]
        audio = custom_ladder(audio_sigmas) if audio_sigmas is not None else _shifted_grid(points, audio_shift)[-steps:]
        return cls(video, audio)

    @property
    def num_calls(self) -> int:
        """Model calls; like the reference, the two ladders are walked together up to the shorter one."""
        return min(self.video.numel(), self.audio.numel()) - 1

    def timesteps(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (t_video, t_audio) fp32 scalars the model sees at `step`."""
        return 1.0 - self.video[step], 1.0 - self.audio[step]


def euler_step(
    x: torch.Tensor, velocity: torch.Tensor, t: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor
) -> torch.Tensor:
    """One eta = 0 step. x0 uses sigma = 1 - t as the model saw it; the blend ratio uses the ladder
    (the two differ in the last fp32 bit below 0.5, and the reference keeps both)."""
    compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    denoised = x + (1 - t.to(x.device, x.dtype)) * velocity
    ratio = sigma_next.to(x.device, compute) / sigma.to(x.device, compute)
    return (ratio * x.to(compute) + (1.0 - ratio) * denoised.to(compute)).to(x.dtype)


@dataclass
class StepState:
    """What a per-step callback sees: progress, the current rows (for previews), and the ladders. The row
    tensors are the loop's own, updated in place by the next step: clone what a callback keeps."""

    step: int
    total: int
    video_rows: torch.Tensor
    audio_rows: torch.Tensor
    schedule: DualClockSchedule
    video_velocity: torch.Tensor | None = None  # this step's prediction, all video rows
    layout: Any = None
    ladder_step: int | None = None  # this run's step on the ladders when `step` counts over several runs


    def video_estimate_frame(self, index: int | None = None) -> torch.Tensor:
        """The clean-video estimate of one target latent frame (default: the middle one), [C, h, w] fp32 on
        the CPU, for previews. After the step x = x0 - sigma_next * v, so x0 = x + sigma_next * v; only that
        frame's rows are touched."""
        layout = self.layout
        _, ph, pw = geometry.PATCH_SIZE
        per_frame = (layout.latent_height // ph) * (layout.latent_width // pw)
        index = layout.latent_frames // 2 if index is None else index
        start = layout.num_condition_video_rows + index * per_frame
        rows = self.video_rows[:1, start : start + per_frame].float()
        sigma = self.schedule.video[self.step if self.ladder_step is None else self.ladder_step]
        rows = rows + sigma.to(rows.device) * self.video_velocity[:1, start : start + per_frame].float()
        return unpatchify(rows, 1, layout.latent_height, layout.latent_width)[0, :, 0].cpu()


StepCallback = Callable[[StepState], None]


def _adaln_kept_away(dit, device: torch.device) -> bool:
    """Whether `dit`'s AdaLN weights are somewhere other than `device` (offload.stream_blocks keeps them on the CPU)."""
    modules = dit.adaln_modules() if hasattr(dit, "adaln_modules") else []
    return any(p.device != device for module in modules for p in module.parameters())


def denoise(
    dit,
    layout,
    text_states: torch.Tensor,
    video_rows: torch.Tensor,
    audio_rows: torch.Tensor,
    schedule: DualClockSchedule,
    callback: StepCallback | None = None,
    reuse_adaln: bool = True,
    offload_adaln: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the whole ladder. video_rows [B, Nv, C*4] and audio_rows [B, Na, Ca] (fp32, conditioning
    rows first, as the layout orders them) are updated in place and returned. A callback may raise to
    stop (interrupt); the rows then hold the last completed step.

    `reuse_adaln` computes every step's AdaLN tables before the loop (exactly what each forward would
    compute); `offload_adaln` then keeps the AdaLN weights on the CPU during the loop (~24 GiB freed on
    the release model), and the tables too; it is on wherever the AdaLN weights already are off the device."""
    n_video, n_audio = layout.num_condition_video_rows, layout.num_condition_audio_rows
    device = video_rows.device
    on_device = layout.to(device)
    total = schedule.num_calls
    idle_window = dense_covers_run(getattr(dit, "attention_window", 0), getattr(dit, "attention_window_dense_steps", 0),
                                   total)
    if idle_window:  # a warning, not a refusal: one loader may serve a 50-step and an 8-step sampler
        log.warning("H3: %s", idle_window)
    # Per-row timesteps for every step, planned on the CPU layout: no device sync inside the loop.
    on_cpu = layout.to("cpu")
    plan = []
    for step in range(total):
        t_video, t_audio = schedule.timesteps(step)
        timesteps, indices = on_cpu.row_timesteps(float(t_video), float(t_audio))
        plan.append((t_video, t_audio, timesteps.to(device), indices.to(device)))
    # Video Sparse Attention (a VSA-trained model): the rows' tiling, made once for the run
    sparse = {"sparse_tiles": on_device.vsa_tiles()} if getattr(dit, "sparse_attention", None) is not None else {}
    # AdaLN weights kept off the compute device (a streamed DiT) say the device has no room for every step's tables
    offload_adaln = offload_adaln or _adaln_kept_away(dit, device)
    offloaded = dit.adaln_offloaded() if (reuse_adaln and offload_adaln) else contextlib.nullcontext()
    with offloaded:
        # With the AdaLN weights offloaded (small GPUs) the schedule's tables wait on the CPU too.
        parked = offload_adaln and device.type == "cuda"
        modulations = dit.modulation_schedule([p[2] for p in plan], park_on_cpu=parked) if reuse_adaln else [None] * total
        for step, (t_video, t_audio, timesteps, timestep_indices) in enumerate(plan):
            video_velocity, audio_velocity = dit(
                video_rows=video_rows,
                audio_rows=audio_rows,
                text_states=text_states,
                timesteps=timesteps,
                timestep_indices=timestep_indices,
                token_tags=on_device.token_tags,
                position_ids=on_device.position_ids,
                video_indices=on_device.video_indices,
                audio_indices=on_device.audio_indices,
                text_indices=on_device.text_indices,
                modulation=modulations[step].to(device) if parked else modulations[step],
                # without the target video's span the DiT attends fully: so it does in a window's dense steps
                target_video=layout.target_video_span if step >= getattr(dit, "attention_window_dense_steps", 0) else None,
                **sparse,
            )
            modulations[step] = None  # each step's tables are used once
            video_rows[:, n_video:] = euler_step(
                video_rows[:, n_video:], video_velocity[:, n_video:].float(), t_video,
                schedule.video[step], schedule.video[step + 1],
            )
            audio_rows[:, n_audio:] = euler_step(
                audio_rows[:, n_audio:], audio_velocity[:, n_audio:].float(), t_audio,
                schedule.audio[step], schedule.audio[step + 1],
            )
            if callback is not None:
                callback(StepState(step + 1, total, video_rows, audio_rows, schedule, video_velocity, layout))
    return video_rows, audio_rows
