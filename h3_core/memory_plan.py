"""How much of the DiT fits on the GPU for a request, and the peak memory to expect.

The estimate is built from the shapes, not guessed: weights by module, the block's activation peak
per packed row (inside the SwiGLU: the residual stream, the modulated input, three gathered AdaLN
rows, fc1's output, silu(gate) and the product: 5 hidden + 4 ffn values per row), the RoPE tables
and the precomputed AdaLN tables of the whole schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import DiTConfig
from .dit import MODALITIES

GIB = 2**30


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
        adaln = "AdaLN weights on the CPU" if self.offload_adaln else "AdaLN weights on the GPU"
        return f"{mode}, {adaln}; expected peak {self.expected_peak_bytes / GIB:.2f} GiB"


def block_weight_bytes(config: DiTConfig, dtype_bytes: int) -> int:
    """Attention + FFN + norms of one block (what streams; its AdaLN projection does not)."""
    h, inner, ffn, d = config.hidden_size, config.inner_dim, config.ffn_dim, config.attention_head_dim
    return dtype_bytes * (h * 3 * inner + inner * h + h * 2 * ffn + ffn * h + 2 * h + 2 * d)


def shared_weight_bytes(config: DiTConfig, dtype_bytes: int) -> int:
    """Everything that stays on the GPU besides the blocks: refiner, input projections, final layer."""
    h = config.hidden_size
    refiner = config.num_refiner_layers * block_weight_bytes(config, dtype_bytes) + dtype_bytes * h
    projections = 4 * (config.video_patch_dim * h + config.audio_in_channels * h + 2 * h)  # fp32
    condition = dtype_bytes * (config.text_dim * h + h)
    final = dtype_bytes * h + 4 * (h * (config.video_patch_dim + config.audio_in_channels) + config.video_patch_dim + config.audio_in_channels)
    return refiner + projections + condition + final


def adaln_weight_bytes(config: DiTConfig, dtype_bytes: int) -> int:
    """The timestep-only weights: fp32 time embedder, every block's AdaLN projection and the final one."""
    h, e = config.hidden_size, config.time_embed_dim
    embedder = 4 * (config.freq_dim * config.time_embed_hidden_dim + config.time_embed_hidden_dim
                    + config.time_embed_hidden_dim * e + e)
    per_block = (e + 1) * 6 * MODALITIES * h
    return embedder + dtype_bytes * (config.num_layers * per_block + (e + 1) * 2 * h)


def activation_bytes(config: DiTConfig, rows: int, dtype_bytes: int) -> int:
    """Peak live activations of one block forward over `rows` packed rows (batch 1)."""
    per_row = dtype_bytes * (5 * config.hidden_size + 4 * config.ffn_dim)
    rope = 2 * 4 * 6 * config.rope_freq_dim  # cos and sin, fp32
    return rows * (per_row + rope)


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
) -> int:
    """Peak GPU bytes of a denoise with this placement (prefetch 0 = no streaming)."""
    block = block_weight_bytes(config, dtype_bytes)
    in_flight = (prefetch + 2) * block if prefetch else 0  # BlockStreamer's bound on streamed blocks on the GPU
    return (
        shared_weight_bytes(config, dtype_bytes)
        + activation_bytes(config, rows, dtype_bytes)
        + modulation_bytes(config, steps, timesteps_per_step, dtype_bytes)
        + resident_blocks * block
        + in_flight
        + (0 if offload_adaln else adaln_weight_bytes(config, dtype_bytes))
    )


def plan_memory(
    config: DiTConfig,
    rows: int,
    budget_bytes: int,
    steps: int = 49,
    timesteps_per_step: int = 4,
    dtype_bytes: int = 2,
    prefetch: int = 1,
) -> MemoryPlan:
    """The most resident blocks that fit in `budget_bytes` (free GPU memory for this run): everything
    resident if it fits, then everything but the AdaLN weights, then as many blocks as fit, streaming the rest."""
    blocks = config.num_layers

    def peak(resident: int, streaming: int, offload_adaln: bool) -> int:
        return expected_peak(config, rows, resident, streaming, offload_adaln, steps, timesteps_per_step, dtype_bytes)

    for offload_adaln in (False, True):
        if peak(blocks, 0, offload_adaln) <= budget_bytes:
            return MemoryPlan(blocks, 0, offload_adaln, peak(blocks, 0, offload_adaln), True)
    block = block_weight_bytes(config, dtype_bytes)
    spare = budget_bytes - peak(0, prefetch, True)
    resident = max(0, min(blocks - 1, spare // block))
    return MemoryPlan(int(resident), prefetch, True, peak(resident, prefetch, True), peak(resident, prefetch, True) <= budget_bytes)
