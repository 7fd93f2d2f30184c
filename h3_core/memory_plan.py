"""How much of the DiT fits on the GPU for a request, and the peak memory to expect.

The estimate is built from the shapes, not guessed: weights by module, the block's activation peak
per packed row, the RoPE tables and the precomputed AdaLN tables of the whole schedule. A block's
peak is the larger of its two halves. Attention: the residual stream, the gate and the modulated input
(3 hidden) with the qkv output, normed q and k, rotated q, and k's rotation in flight (9 inner) plus the
bf16 cos/sin. SwiGLU: the same 3 hidden with fc1's output, silu(gate) and the product (4 ffn). At the
real config attention is the larger: 80,832 values a row, exactly what one block measured on the H200
(150,912 bytes a row above its input). A plan leaves `HEADROOM` of its budget for the allocator.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from .config import DiTConfig
from .dit import MODALITIES
from .runtime import GIB, fixed_allocator_segments

# Kept free inside every budget: the caching allocator's block rounding and fragmentation, and library
# workspaces (a 24 GiB cap ran out with 23.5 GiB allocated when the plan used the whole budget).
HEADROOM_FRACTION, HEADROOM_BYTES = 0.05, 256 * 2**20
# bytes a weight a GGUF linear holds besides the rebuilt weight while rebuilding it, uncompiled (the fp32 values
# and the codes; measured at fc1's size on an H200, the bf16 result aside: 4-5 for the Q and K types, 7.2 for
# IQ4_XS, whose codes are looked up as int32)
GGUF_REBUILD_BYTES = 8
# bytes a weight a weight-only stored linear holds at the peak of rebuilding it, uncompiled, measured at fc1's
# size on an H200 (bf16 compute): e4m3 8 (its fp32 copy and the scaled product), ConvRot int8 and int4 12 (the
# rotation's integers besides), NVFP4 10.13 (the codes' index and values in bf16 besides)
REBUILD_BYTES = {"fp8": 8, "int8": 12, "int4": 12, "nvfp4": 10.25}


@dataclass(frozen=True)
class MemoryPlan:
    resident_blocks: int  # blocks kept on the GPU; the rest stream from the CPU
    prefetch: int  # streamed blocks in flight besides the one computing
    offload_adaln: bool  # AdaLN weights kept on the CPU (tables precomputed before the loop)
    expected_peak_bytes: int
    fits: bool  # False: not even full streaming fits; expected_peak_bytes says what it would need

    @property
    def streams(self) -> bool:
        return self.prefetch > 0

    def describe(self, blocks: int) -> str:
        mode = "all blocks resident" if not self.streams else f"{self.resident_blocks}/{blocks} blocks resident, rest streamed"
        adaln = "AdaLN weights on the CPU" if self.offload_adaln else "AdaLN weights with the blocks"
        return f"{mode}, {adaln}; expected peak {self.expected_peak_bytes / GIB:.2f} GiB"


# How the block linears are held (fp8.held_format): "fp8" a byte a weight (e4m3, or int8), rebuilt for each
# matmul; "fp8-scaled" e4m3 in FP8 matmuls, their inputs quantized instead; "int8" ComfyUI's ConvRot-rotated int8
HELD_FORMATS = ("dense", "fp8", "fp8-scaled", "int8", "int4", "nvfp4", "gguf")
# cheapest to costliest: a model whose blocks are held differently is planned as its costliest
HELD_COST_ORDER = ("int4", "nvfp4", "fp8", "int8", "fp8-scaled", "dense")


def gguf_held(blocks) -> str:
    """The held format of GGUF linears (gguf_file.GGUFLinear), whose GGML types may differ by block: "gguf:<bytes
    a weight>" of the costliest block. `blocks`: (stored bytes, weights) of each block's linears."""
    return f"gguf:{max(size / weights for size, weights in blocks):.6g}"


def check_held(held: str) -> str:
    kind, _, size = held.partition(":")
    if kind not in HELD_FORMATS or (kind == "gguf") != bool(size):
        raise ValueError(f"Block linears are held as one of {', '.join(HELD_FORMATS)} (gguf as 'gguf:<bytes a "
                         f"weight>'), not {held!r}.")
    return kind


def _gguf_bytes_per_weight(held: str) -> float:
    return float(held.partition(":")[2])


def block_weight_bytes(config: DiTConfig, dtype_bytes: int, held: str = "dense", refiner: bool = False) -> int:
    """Attention + FFN + norms of one block (what streams; its AdaLN projection does not), with its VSA gate
    (`config.vsa_gates`, never quantized) unless it is a `refiner` block. `held` (HELD_FORMATS): the four
    linears in the model dtype; as FP8 or int8, in FP8 matmuls or not (fp8.FP8Linear: a byte a weight plus an
    fp32 scale per output channel); as int4 (the same, half a byte a weight); as NVFP4 (nvfp4.NVFP4Linear: half a
    byte a weight, an e4m3 scale per 16, an fp32 tensor scale, and room for an AWQ input scale); or as GGML blocks
    ("gguf:<bytes a weight>", scales included)."""
    h, inner, ffn, d = config.hidden_size, config.inner_dim, config.ffn_dim, config.attention_head_dim
    linears = h * 3 * inner + inner * h + h * 2 * ffn + ffn * h
    norms = dtype_bytes * (2 * h + 2 * d)
    gate = dtype_bytes * h * inner if config.vsa_gates and not refiner else 0
    if check_held(held) == "gguf":
        return math.ceil(linears * _gguf_bytes_per_weight(held)) + norms + gate
    if held in ("fp8", "fp8-scaled", "int8", "int4"):
        weights = linears // 2 if held == "int4" else linears
        return weights + 4 * (3 * inner + h + 2 * ffn + h) + norms + gate
    if held == "nvfp4":
        return linears * 9 // 16 + 4 * 4 + dtype_bytes * (h + inner + h + ffn) + norms + gate
    return dtype_bytes * linears + norms + gate


def shared_weight_bytes(config: DiTConfig, dtype_bytes: int) -> int:
    """Everything that stays on the GPU besides the blocks: refiner, input projections, final layer."""
    h = config.hidden_size
    refiner = config.num_refiner_layers * block_weight_bytes(config, dtype_bytes, refiner=True) + dtype_bytes * h
    projections = 4 * (config.video_patch_dim * h + config.audio_in_channels * h + 2 * h)  # fp32
    condition = dtype_bytes * (config.text_dim * h + h)
    final = dtype_bytes * h + 4 * (h * (config.video_patch_dim + config.audio_in_channels) + config.video_patch_dim + config.audio_in_channels)
    return refiner + projections + condition + final


def adaln_weight_bytes(config: DiTConfig, dtype_bytes: int) -> int:
    """The timestep-only weights: fp32 time embedder, every block's AdaLN projection and the final one
    (in the curve form: the fp32 table and fp32 projections of its few columns)."""
    h, e = config.hidden_size, config.time_embed_dim
    per_block = (e + 1) * 6 * MODALITIES * h
    projections = config.num_layers * per_block + (e + 1) * 2 * h
    if config.curve_form:
        return 4 * (config.adaln_curve_grid * e + projections)
    embedder = 4 * (config.freq_dim * config.time_embed_hidden_dim + config.time_embed_hidden_dim
                    + config.time_embed_hidden_dim * e + e)
    return embedder + dtype_bytes * projections


def activation_bytes(config: DiTConfig, rows: int, dtype_bytes: int, held: str = "dense") -> int:
    """Peak live activations of one block forward over `rows` packed rows (batch 1): its attention half's, or
    with stored linears (`held`) its FFN half's where that costs more (uncompiled). Weight-only linears
    rebuild fc1's weight beside the rows the FFN starts from (REBUILD_BYTES a weight), then fc2's beside fc1's
    output and the SwiGLU product; FP8 matmuls ("fp8-scaled") quantize fc2's input there instead (an fp32 copy
    and the e4m3 result). Measured on an H200 for each format at 1,034-38,222 rows (bench/held_block_peak.py):
    from 5 MiB below to 19 MiB above; GGUF up to 588 MiB above (every GGML type planned as the costliest)."""
    h, rope_width = config.hidden_size, 6 * config.rope_freq_dim
    # Video Sparse Attention (a VSA-trained model) also holds q, k, v, the gate and the output in padded tile
    # buffers, and the gate itself: measured 5.2 values a row more at the real size on an H200 (2.65 GiB, 38,222
    # rows), planned as 6
    sparse = 6 * config.inner_dim if config.vsa_gates else 0
    per_row = dtype_bytes * (3 * h + max(9 * config.inner_dim + 2 * rope_width + sparse, 4 * config.ffn_dim))
    rope = 2 * 4 * rope_width + 8  # cos and sin (fp32), and the int64 AdaLN row index
    fc1_weights = 2 * config.ffn_dim * config.hidden_size
    attention = rows * (per_row + rope)
    kind = check_held(held)
    if kind == "dense":
        return attention
    ffn_input = rows * (dtype_bytes * 4 * h + rope)  # the block's input, the residual, the normed and modulated rows
    swiglu = rows * dtype_bytes * 3 * config.ffn_dim  # fc1's output (gate and value) and their product
    if kind == "fp8-scaled":
        return max(attention, ffn_input + swiglu + rows * 5 * config.ffn_dim)
    rebuild = GGUF_REBUILD_BYTES + dtype_bytes if kind == "gguf" else REBUILD_BYTES[kind]
    return math.ceil(max(attention, ffn_input + rebuild * fc1_weights, ffn_input + swiglu + rebuild * fc1_weights / 2))


def modulation_bytes(config: DiTConfig, steps: int, timesteps_per_step: int, dtype_bytes: int) -> int:
    """The precomputed AdaLN tables of a whole schedule."""
    per_timestep = config.num_layers * MODALITIES * 6 * config.hidden_size + 2 * config.hidden_size
    return steps * timesteps_per_step * per_timestep * dtype_bytes


def expected_peak(
    config: DiTConfig,
    rows: int,
    resident_blocks: int,
    prefetch: int,
    offload_adaln: bool,
    steps: int = 49,
    timesteps_per_step: int = 4,
    dtype_bytes: int = 2,
    held: str = "dense",
    adaln_bytes: int | None = None,
) -> int:
    """Peak GPU bytes of a denoise with this placement (prefetch 0 = no streaming); `held`: how the block
    linears are held (HELD_FORMATS); `adaln_bytes`: what the timestep-only weights take as the file holds them
    (a quantized file may hold its AdaLN projections quantized; None: `adaln_weight_bytes`, in the model dtype)."""
    block = block_weight_bytes(config, dtype_bytes, held)
    in_flight = (prefetch + 2) * block if prefetch else 0  # BlockStreamer's bound on streamed blocks on the GPU
    return (
        shared_weight_bytes(config, dtype_bytes)
        + activation_bytes(config, rows, dtype_bytes, held)
        # with the AdaLN weights offloaded the schedule's tables wait on the CPU: one step's on the device
        + modulation_bytes(config, 1 if offload_adaln else steps, timesteps_per_step, dtype_bytes)
        + resident_blocks * block
        + in_flight
        + (0 if offload_adaln else adaln_weight_bytes(config, dtype_bytes) if adaln_bytes is None else adaln_bytes)
    )


def plan_memory(
    config: DiTConfig,
    rows: int,
    budget_bytes: int,
    steps: int = 49,
    timesteps_per_step: int = 4,
    dtype_bytes: int = 2,
    prefetch: int = 1,
    held: str = "dense",
    fixed_segments: bool = False,
    adaln_bytes: int | None = None,
) -> MemoryPlan:
    """The most resident blocks that fit in `budget_bytes` (free GPU memory for this run) less the
    allocator's headroom: everything resident if it fits, then everything but the AdaLN weights, then as
    many blocks as fit, streaming the rest. `fixed_segments`: torch's allocator without expandable
    segments, which strands freed activation memory in pieces too small for the next block's; one
    block's activations more are kept free for it (measured, a whole 1344x768 5 s request streamed for
    24 GiB: 4.7 GiB reserved beyond the 22.4 allocated; with expandable segments 1.1 GiB)."""
    if prefetch < 1:
        raise ValueError(f"prefetch must be at least 1 block, got {prefetch}.")
    blocks = config.num_layers
    budget_bytes = usable_bytes(budget_bytes)
    reserve = activation_bytes(config, rows, dtype_bytes, held) if fixed_segments else 0  # counted in the peak

    def peak(resident: int, streaming: int, offload_adaln: bool) -> int:
        return reserve + expected_peak(config, rows, resident, streaming, offload_adaln, steps, timesteps_per_step,
                                     dtype_bytes, held, adaln_bytes)

    for offload_adaln in (False, True):
        if peak(blocks, 0, offload_adaln) <= budget_bytes:
            return MemoryPlan(blocks, 0, offload_adaln, peak(blocks, 0, offload_adaln), True)
    block = block_weight_bytes(config, dtype_bytes, held)
    spare = budget_bytes - peak(0, prefetch, True)
    resident = max(0, min(blocks - 1, spare // block))
    return MemoryPlan(int(resident), prefetch, True, peak(resident, prefetch, True), peak(resident, prefetch, True) <= budget_bytes)


def size_text(nbytes: float) -> str:
    """An amount of memory for a message: GiB, or MiB below 0.1 GiB (a small budget's '0.00 GiB' said nothing)."""
    return f"{nbytes / GIB:.2f} GiB" if abs(nbytes) >= 0.1 * GIB else f"{nbytes / 2**20:.1f} MiB"


def does_not_fit(plan: MemoryPlan, where: str, budget: str, budget_bytes: int | None, other_bytes: int = 0) -> str:
    """Why a request is refused when even every block streamed does not fit: what it needs, the budget, and
    what of it is left for the DiT after LoRA factors (they come off the budget first, as `plan_for` counts)
    and the allocator's headroom."""
    after = (f"LoRA factors' {size_text(other_bytes)} and " if other_bytes else "") + (
        f"the allocator's headroom ({HEADROOM_FRACTION:.0%} and {HEADROOM_BYTES // 2**20} MiB)")
    room = "" if budget_bytes is None else (
        f" ({size_text(budget_bytes)}: {size_text(max(usable_bytes(budget_bytes - other_bytes), 0))} left for the "
        f"DiT after {after})")
    return (f"This request needs about {size_text(plan.expected_peak_bytes)} on {where} even with every DiT block "
            f"streamed from the CPU, more than {budget}{room}; shorten it, use a smaller canvas, or allow more GPU "
            "memory.")


def usable_bytes(budget_bytes: int) -> int:
    """What a plan may fill of `budget_bytes`: the rest is the allocator's headroom."""
    return int(budget_bytes * (1 - HEADROOM_FRACTION)) - HEADROOM_BYTES


def working_bytes(config: DiTConfig, rows: int, steps: int, dtype_bytes: int = 2, timesteps_per_step: int = 4) -> int:
    """What a denoise needs on the device besides the weights: one block's activations and the AdaLN
    tables of the schedule. Hosts free this much before sampling."""
    return activation_bytes(config, rows, dtype_bytes) + modulation_bytes(config, steps, timesteps_per_step, dtype_bytes)


def free_bytes(device) -> int:
    """Memory this process can still use on a CUDA `device`: what the driver has free plus what torch's
    caching allocator holds unused (it hands that back first)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"free_bytes measures a CUDA device, not {device}.")
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def total_bytes(device) -> int | None:
    """All the memory a CUDA `device` has (None where CUDA is not here: a plan made for another machine)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)


MAX_BUDGET_GIB = 2**20  # a PiB: larger is a typo (and overflows as bytes)


def check_budget(budget_gib: float | None, device=None) -> None:
    """A budget given is a positive number of GiB, and no more than a CUDA `device` has (the model placed for it
    as it stood ran out of memory part way)."""
    if budget_gib is not None and not (isinstance(budget_gib, numbers.Real) and not isinstance(budget_gib, bool)
                                       and math.isfinite(budget_gib) and 0 < budget_gib <= MAX_BUDGET_GIB):
        raise ValueError(f"The GPU memory budget must be a positive number of GiB, got {budget_gib!r} (at most "
                         f"{MAX_BUDGET_GIB:,}).")
    import torch

    if budget_gib is None or device is None or torch.device(device).type != "cuda":
        return
    whole = total_bytes(device)
    if whole is not None and budget_gib * GIB > whole:
        raise ValueError(f"The GPU memory budget ({budget_gib:g} GiB) is more than {device} has "
                         f"({whole / GIB:.1f} GiB in all); give at most that, or none (0 in the H3 loaders) for what "
                         "is free.")


def plan_for(config: DiTConfig, layout, steps: int, device, budget_gib: float | None = None,
             dtype_bytes: int = 2, held: str = "dense", adaln_bytes: int | None = None,
             other_bytes: int = 0) -> MemoryPlan:
    """The plan for sampling `layout` (a PackedLayout; for a long video its largest window's) with a
    `steps`-point ladder on `device`. `budget_gib`: memory to plan for (None: what the device has free;
    the CPU is not limited); `held`, `adaln_bytes`: as `expected_peak`; `other_bytes`: held on the device
    besides the DiT for the run (hooked LoRA factors). Hosts call it before loading, so a
    request that cannot fit is refused before the weights are read. On CUDA the plan allows for the allocator
    the environment sets up."""
    import torch

    device = torch.device(device)
    check_budget(budget_gib, device)
    if budget_gib is not None:
        budget = int(budget_gib * GIB)
    else:
        budget = free_bytes(device) if device.type == "cuda" else 1 << 62
    budget -= other_bytes
    timesteps, _ = layout.to("cpu").row_timesteps(0.5, 0.25)  # distinct timesteps of one step (clocks apart)
    return plan_memory(config, layout.sequence_length, budget, max(steps - 1, 1), int(timesteps.numel()),
                       dtype_bytes, held=held, fixed_segments=device.type == "cuda" and fixed_allocator_segments(),
                       adaln_bytes=adaln_bytes)
