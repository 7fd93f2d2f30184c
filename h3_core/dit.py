"""The H3 diffusion transformer, with the original checkpoint's module names.

One packed sequence of S rows (text | conditioning | audio | video) runs through a token refiner
(text only), 50 AdaLN-modulated blocks of full self-attention, and a final layer. Shapes:

    video_rows   [B, Nv, C*4]   patchified video latents (conditioning rows first), fp32 in
    audio_rows   [B, Na, Ca]    channel-major audio latents, fp32 in
    text_states  [B, T, text_dim]
    timesteps    [K]            the distinct t = 1 - sigma values of this step (t = 1 is clean)
    timestep_indices, token_tags [S]; position_ids [S, 3] (t, h, w); *_indices: row positions
    -> video velocity [B, Nv, C*4], audio velocity [B, Na, Ca], fp32 (data-ward: x0 = x_t + sigma*v)

Precision policy (the checkpoint's): the patch projections, the time embedder and the two output
heads are fp32; everything else runs in the model dtype (bf16 for the release). Module names equal
the original keys, with `attn.qkv_proj` held in the stacked [q; k; v] row order.

Curve form (`config.curve_form`, the community's "pruned" files, h3-model.md I.2): the time embedder and
the SiLU before each AdaLN projection are replaced by a table of the projection's input sampled over
t in [0, 1] (`adaln_t_table`, read by linear interpolation), and the projections take its few columns
instead of 2688, in fp32 as ComfyUI's model runs them. Everything else is the same model.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import qk_norm_rope
from .attention import attention, query_rows, resolve_backend
from .local_attention import VideoWindow, check_backend as check_window_backend, check_setting as check_window_setting
from .rope import apply_rope
from .sparse_attention import STUDENT_SPARSITY, SparsePlan, VSATiles, check_sparsity, vsa_attention
from .config import DiTConfig
from .fp8 import compute_dtype
from .layout import RowClock
from .pinned import PinnedSlabs, host_room, park_table
from .runtime import pinnable_bytes

MODALITIES = 3  # AdaLN table rows per timestep: 0 video, 1 text, 2 audio
_COMPILED_TABLE_ROWS = MODALITIES * len(RowClock)  # a step has at most one distinct timestep per row clock
# Compiled blocks share one cache of graphs (one per code object, whatever the model). The row count is dynamic in
# them, so one graph serves every sequence length (canvas, duration, references, prompt length); what still makes
# new graphs (an attention window's size, a shape the kernels specialize on) may make up to this many. Past dynamo's
# own limit (8) a new one ran eager for the rest of the process: slower, and another result than in a fresh one.
_COMPILED_GRAPHS = 64
FP32_MODULES = ("video_patch_proj", "audio_patch_proj", "time_embedder", "final_layer.video_out", "final_layer.audio_out")


def fp32_modules(config: DiTConfig) -> tuple[str, ...]:
    """Name prefixes of the modules held in fp32: FP32_MODULES, and in the curve form every AdaLN projection."""
    if not config.curve_form:
        return FP32_MODULES
    return (*FP32_MODULES, *(f"blocks.{i}.adaln_proj." for i in range(config.num_layers)), "final_layer.adaln_proj.")


def timestep_features(timesteps: torch.Tensor, dim: int) -> torch.Tensor:
    """[K] -> [K, dim]: [cos(t f_i), sin(t f_i)], f_i = 10000^(-i / (dim/2)); t unscaled in [0, 1]."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half)
    angles = timesteps.float()[:, None] * freqs[None, :]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


def rope_inverse_frequencies(config: DiTConfig) -> torch.Tensor:
    """theta^(-i/f) for i < f, shared by the t, h and w axes (the release ships it as `rope.inv_freq`)."""
    f = config.rope_freq_dim
    return 1.0 / (config.rope_theta ** (torch.arange(0, 2 * f, 2, dtype=torch.float32) / (2 * f)))


def rope_tables(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(t, h, w) positions [S, 3] -> cos, sin [S, 6f]: f angles per axis, concatenated, then duplicated."""
    angles = position_ids.to(torch.float32)[:, :, None] * inv_freq[None, None, :]  # [S, 3, f]
    angles = angles.flatten(1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


class Attention(nn.Module):
    """Self-attention with a fused stacked qkv projection, per-head RMSNorm on q and k, optional RoPE."""

    def __init__(self, config: DiTConfig, gated: bool = False):
        super().__init__()
        self.heads, self.head_dim = config.num_attention_heads, config.attention_head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.inner_dim, bias=False)
        self.q_norm = nn.RMSNorm(config.attention_head_dim, eps=config.qk_norm_eps)
        self.k_norm = nn.RMSNorm(config.attention_head_dim, eps=config.qk_norm_eps)
        self.out_proj = nn.Linear(config.inner_dim, config.hidden_size, bias=False)
        # VSA-trained checkpoints' blocks: the gate of the sparse attention's compressed branch, from the block's input
        self.gate_compress = nn.Linear(config.hidden_size, config.inner_dim, bias=False) if gated else None
        self.backend = "sdpa"
        self.sequence_parallel = None  # set on the blocks' attention by parallel.sequence.enable

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                window: VideoWindow | SparsePlan | None = None) -> torch.Tensor:
        """`window`: the lossy attention window, or Video Sparse Attention's plan for this forward."""
        batch, rows, _ = x.shape
        qkv = self.qkv_proj(x)
        q, k, v = qkv.view(batch, rows, 3, self.heads, self.head_dim).unbind(2)
        if isinstance(window, SparsePlan):
            return self._sparse(x, *self._norm_rope(q, k, rope), v, window)
        if rope is not None and torch.compiler.is_compiling() and qk_norm_rope.available(qkv, self.head_dim):
            # compiled on CUDA: one kernel instead of Inductor's three (equal up to bf16 rounding), writing
            # q with the padding rows the attention kernel wants (cut from its output below)
            q_rows = rows
            if self.sequence_parallel is None:
                q_rows = query_rows(self.backend, window, rows, self.head_dim, qkv.dtype)
            q, k = torch.ops.h3.qk_norm_rope(qkv, self.q_norm.weight, self.k_norm.weight, *rope, self.heads,
                                             self.q_norm.eps, q_rows)
        else:
            q, k = self._norm_rope(q, k, rope)
        if self.sequence_parallel is None:
            out = attention(q, k, v, self.backend, window)[:, :rows]
        else:  # this rank holds a slice of the rows: trade rows for heads around the attention
            out = self.sequence_parallel.attention(q, k, v, self.backend, window)
        return self.out_proj(out.reshape(batch, rows, -1))

    def _norm_rope(self, q: torch.Tensor, k: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = self.q_norm(q), self.k_norm(k)
        return (q, k) if rope is None else (apply_rope(q, *rope), apply_rope(k, *rope))

    def _sparse(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SparsePlan) -> torch.Tensor:
        """Video Sparse Attention, its compressed branch gated by `gate_compress(x)` if the model has it (under the
        sequence-parallel split, over this rank's heads and every row)."""
        batch, rows, _ = x.shape
        gate = None if self.gate_compress is None else self.gate_compress(x).view(batch, rows, self.heads, self.head_dim)
        if self.sequence_parallel is None:
            out = vsa_attention(q, k, v, plan.tiles, plan.sparsity, gate)
        else:
            out = self.sequence_parallel.sparse_attention(q, k, v, gate, plan)
        return self.out_proj(out.reshape(batch, rows, -1))


class SwiGLU(nn.Module):
    """fc2(silu(gate) * value) with fc1 rows stored as [gate; value]."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, 2 * config.ffn_dim, bias=False)
        self.fc2 = nn.Linear(config.ffn_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * value)


class RefinerBlock(nn.Module):
    """Plain pre-norm block over the text rows: no RoPE, no AdaLN."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.norm1 = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = Attention(config)
        self.norm2 = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TokenRefiner(nn.Module):
    def __init__(self, config: DiTConfig):
        super().__init__()
        self.blocks = nn.ModuleList(RefinerBlock(config) for _ in range(config.num_refiner_layers))
        self.final_norm = nn.RMSNorm(config.hidden_size, eps=config.final_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.final_norm(x)


class TimeEmbedder(nn.Module):
    """Sinusoidal features -> proj_in -> SiLU -> proj_out, all fp32; one embedding per distinct timestep."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.freq_dim = config.freq_dim
        self.proj_in = nn.Linear(config.freq_dim, config.time_embed_hidden_dim)
        self.proj_out = nn.Linear(config.time_embed_hidden_dim, config.time_embed_dim)

    @property
    def device(self) -> torch.device:
        return self.proj_in.weight.device

    def forward(self, timesteps: torch.Tensor) -> torch.Tensor:
        features = timestep_features(timesteps, self.freq_dim).to(self.proj_in.weight.dtype)
        return self.proj_out(F.silu(self.proj_in(features)))


class CurveTimeEmbedder(nn.Module):
    """The curve form's stand-in for the time embedder and SiLU: `table` [grid, width] (fp32, the file's
    `adaln_t_table`) holds the AdaLN input at t = i / (grid - 1); t in between is linearly interpolated,
    clamped to [0, 1], t = 1 read on the last interval (as ComfyUI's MiniMax H3 model reads it)."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.register_buffer("table", torch.zeros(config.adaln_curve_grid, config.time_embed_dim))

    @property
    def device(self) -> torch.device:
        return self.table.device

    def forward(self, timesteps: torch.Tensor) -> torch.Tensor:
        table = self.table.to(timesteps.device)  # ~33 KB: read where the timesteps are, wherever it is kept
        last = table.shape[0] - 1
        position = timesteps.float().clamp(0.0, 1.0) * last
        lower = position.floor().long().clamp(max=last - 1)
        return torch.lerp(table[lower], table[lower + 1], (position - lower)[:, None])


class AdaLNProjection(nn.Module):
    """temb [K, E] -> table [K * rows_per_timestep, width]; table row timestep_index * rows + tag.
    `silu`: False in the curve form, whose table already holds the projection's input."""

    def __init__(self, in_features: int, out_features: int, rows_per_timestep: int, silu: bool = True):
        super().__init__()
        self.rows_per_timestep = rows_per_timestep
        self.silu = silu
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, temb: torch.Tensor) -> torch.Tensor:
        # SiLU at temb's fp32 precision, cast only after: every block reads the same temb, so an early
        # rounding would bias all blocks' modulations alike (the reference's order).
        table = self.linear((F.silu(temb) if self.silu else temb).to(compute_dtype(self.linear)))
        return table.view(temb.shape[0] * self.rows_per_timestep, -1)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1.0 + scale) + shift


class Block(nn.Module):
    """AdaLN block: modulation rows are picked per packed row from the (timestep, modality) table."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.norm1 = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = Attention(config, gated=config.vsa_gates)
        self.norm2 = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = SwiGLU(config)
        self.adaln_proj = AdaLNProjection(config.time_embed_dim, 6 * MODALITIES * config.hidden_size, MODALITIES,
                                          silu=not config.curve_form)

    def forward(self, x, table: torch.Tensor, adaln_index: torch.Tensor, rope, window: VideoWindow | None = None) -> torch.Tensor:
        """table [3K, 6H] from `adaln_proj`; adaln_index [S] = timestep_index * 3 + tag."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = table.chunk(6, dim=-1)
        pick = lambda param: param.index_select(0, adaln_index)  # noqa: E731  [S, H]
        x = x + pick(gate_msa) * self.attn(modulate(self.norm1(x), pick(shift_msa), pick(scale_msa)), rope, window)
        x = x + pick(gate_mlp) * self.mlp(modulate(self.norm2(x), pick(shift_mlp), pick(scale_mlp)))
        return x


class FinalLayer(nn.Module):
    """Shift/scale RMSNorm indexed by timestep only (no modality), then the fp32 video and audio heads."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.final_norm_eps)
        self.adaln_proj = AdaLNProjection(config.time_embed_dim, 2 * config.hidden_size, 1, silu=not config.curve_form)
        self.video_out = nn.Linear(config.hidden_size, config.video_patch_dim)
        self.audio_out = nn.Linear(config.hidden_size, config.audio_in_channels)

    def forward(self, x, table, timestep_indices, video_indices, audio_indices):
        """table [K, 2H] from `adaln_proj` (shift first, then scale)."""
        shift, scale = table.chunk(2, dim=-1)
        x = modulate(self.norm(x), shift.index_select(0, timestep_indices), scale.index_select(0, timestep_indices))
        video = x.index_select(1, video_indices).to(self.video_out.weight.dtype)
        audio = x.index_select(1, audio_indices).to(self.audio_out.weight.dtype)
        return self.video_out(video), self.audio_out(audio)


@dataclass
class Modulation:
    """Every AdaLN table of one step: they depend only on the step's timesteps, so they can be computed
    for a whole schedule up front (and the ~13B AdaLN weights released) without changing any output."""

    blocks: list[torch.Tensor]  # per block [3K, 6H]
    final: torch.Tensor  # [K, 2H]

    def to(self, device: torch.device | str) -> "Modulation":
        """The tables on `device` (asynchronous from pinned CPU memory, where the sampler parks them)."""
        return Modulation([table.to(device, non_blocking=True) for table in self.blocks],
                          self.final.to(device, non_blocking=True))


@contextlib.contextmanager
def _visiting(module: nn.Module, device: torch.device):
    """Run `module` on `device` for the duration from a temporary copy of its weights; the home copies
    are put back untouched (no copy back, and pinned CPU memory stays pinned)."""
    params = [p for p in module.parameters() if p.device != device]
    home = [p.data for p in params]
    for param in params:
        param.data = param.data.to(device, non_blocking=True)
    try:
        yield module
    finally:
        for param, data in zip(params, home):
            param.data = data


class _CompiledForward:
    """A block's compiled forward, used while none of the submodules it runs carries a hook: the graph does
    not see hooks added after it was traced (dynamic LoRA adapters), so such a block runs its eager forward.
    Its AdaLN projection does not count: the forward takes the finished table (`H3DiT.modulation` calls
    the projection), so hooks there (sharded weights gathered for it, AdaLN LoRAs) leave the graph valid.

    The graph is traced for a table of `_COMPILED_TABLE_ROWS` rows: a step has 1 to 4 distinct timesteps
    (one per row clock in use; the first step of a text-to-video run has 1, the rest 2), and each count
    would otherwise compile its own graph. The zero rows it adds are never picked (adaln_index < the real row count)."""

    def __init__(self, block: nn.Module, compiled):
        self.block, self.eager, self.compiled = block, block.forward, compiled
        self.table_only = set(block.adaln_proj.modules())  # a module put there later counts (runs eager): safe

    def __call__(self, x, table, adaln_index, rope, window=None):
        inner = (m for m in self.block.modules() if m is not self.block and m not in self.table_only)
        if any(module._forward_hooks or module._forward_pre_hooks for module in inner):
            return self.eager(x, table, adaln_index, rope, window)
        padded = F.pad(table, (0, 0, 0, max(0, _COMPILED_TABLE_ROWS - table.shape[0])))  # never cut a larger table
        for rows, dim in ((x, 1), (adaln_index, 0), *((part, 0) for part in rope or ())):  # S, whatever it is
            torch._dynamo.maybe_mark_dynamic(rows, dim)
        limit = max(_COMPILED_GRAPHS, torch._dynamo.config.recompile_limit)
        with torch._dynamo.config.patch(recompile_limit=limit):
            return self.compiled(x, padded, adaln_index, rope, window)


class H3DiT(nn.Module):
    """The MiniMax-H3 DiT (`MiniMaxH3DiTModel`); see the module docstring for the data contract."""

    def __init__(self, config: DiTConfig = DiTConfig()):
        super().__init__()
        self.config = config
        self.video_patch_proj = nn.Linear(config.video_patch_dim, config.hidden_size)
        self.audio_patch_proj = nn.Linear(config.audio_in_channels, config.hidden_size)
        self.condition_proj = nn.Linear(config.text_dim, config.hidden_size)
        self.time_embedder = CurveTimeEmbedder(config) if config.curve_form else TimeEmbedder(config)
        self.token_refiner = TokenRefiner(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.final_layer = FinalLayer(config)
        self.register_buffer("rope_inv_freq", rope_inverse_frequencies(config), persistent=False)
        self.sequence_parallel = None  # parallel.sequence.SequenceParallel when split over ranks
        self.attention_window = 0  # latent frames; > 0: the lossy windowed video attention (set_attention_window)
        self.attention_window_dense_steps = 0  # leading forwards of each sampler run that keep full attention
        # Video Sparse Attention's sparsity (set_sparse_attention): a VSA-trained model (its gates) runs as trained
        self.sparse_attention: float | None = STUDENT_SPARSITY if config.vsa_gates else None
        self._between_blocks: Callable[[], None] | None = None  # checked_between_blocks

    @classmethod
    def build(cls, config: DiTConfig, dtype: torch.dtype = torch.bfloat16, device="cpu") -> "H3DiT":
        """A model with random init in the release's precision policy (`device="meta"` allocates nothing)."""
        with torch.device(device):
            model = cls(config)
        model.set_dtype(dtype)
        return model

    def set_dtype(self, dtype: torch.dtype) -> "H3DiT":
        """Cast everything but the fp32 modules (patch projections, time embedder, heads) to `dtype`."""
        for name, module in self.named_children():
            if name == "final_layer":
                module.norm.to(dtype)
                module.adaln_proj.to(dtype)
            elif name not in FP32_MODULES:
                module.to(dtype)
        if self.config.curve_form:  # its AdaLN projections stay fp32 (a few MB)
            for module in self.adaln_modules():
                module.float()
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.condition_proj.weight.dtype

    @property
    def attention_dtype(self) -> torch.dtype:
        """What the attention kernels are given: the blocks' qkv output, in that linear's compute dtype (a file read
        at its stored dtypes may keep other tensors in fp32)."""
        return compute_dtype(self.blocks[0].attn.qkv_proj) if len(self.blocks) else self.dtype

    def set_attention_backend(self, requested: str = "auto") -> str:
        """Use `requested` ("auto" = fastest exact available) in every attention; returns the name chosen."""
        backend = resolve_backend(requested, self.condition_proj.weight.device, window=bool(self.attention_window),
                                  dtype=self.attention_dtype)
        for module in self.modules():
            if isinstance(module, Attention):
                module.backend = backend
        return backend

    def set_attention_window(self, frames: int, dense_steps: int = 0) -> "H3DiT":
        """Lossy, opt-in: target video rows attend only the target video within `frames` latent frames of
        themselves (plus every text, conditioning and audio row); 0 restores full attention. The first
        `dense_steps` forwards of each sampler run keep full attention (the early, noisiest steps set
        the layout). See local_attention.py. Set it before `set_attention_backend`, whose "auto" then
        picks a backend that runs the window (`set_attention` sets both in that order)."""
        if check_window_setting(frames, dense_steps)[0]:
            check_window_backend(self.blocks[0].attn.backend if len(self.blocks) else "sdpa")
        self.attention_window, self.attention_window_dense_steps = frames, dense_steps
        return self

    def set_sparse_attention(self, sparsity: float | None) -> "H3DiT":
        """Video Sparse Attention (sparse_attention.py) with `sparsity` (the share of video key tiles each video
        query tile leaves out; a model built with VSA gates starts at what it was trained with, 0.8 for FastH3
        8-Step V2); None restores full attention. Forwards use it when given their rows' tiling."""
        self.sparse_attention = None if sparsity is None else check_sparsity(sparsity)
        return self

    def set_attention(self, backend: str = "auto", window: int = 0, dense_steps: int = 0) -> str:
        """Both attention settings at once, whatever was set before: the (lossy, opt-in) window, then the
        backend, whose "auto" picks one that runs that window (a named one that cannot is refused, and
        the model keeps its previous settings). Returns the backend's name."""
        window, dense_steps = check_window_setting(window, dense_steps)
        chosen = resolve_backend(backend, self.condition_proj.weight.device, window=window > 0,  # may refuse
                                 dtype=self.attention_dtype)
        self.attention_window, self.attention_window_dense_steps = window, dense_steps
        return self.set_attention_backend(chosen)

    def compile_blocks(self, mode: str = "default") -> "H3DiT":
        """torch.compile each repeated block's forward (one graph, reused by every block): fuses norms,
        modulation, RoPE and SwiGLU. Only `forward` is compiled, so hooks on a block (block streaming,
        sharded weights) run eagerly around the graph. Not bitwise exact (fused bf16 rounding; max |diff|
        0.003 on the H200 benchmark) and the first forward pays the compile, so it is opt-in."""
        for block in self.blocks:
            if not isinstance(block.forward, _CompiledForward):
                block.forward = _CompiledForward(block, torch.compile(block.forward, mode=mode, dynamic=False))
        return self

    def set_compiled(self, compiled: bool) -> "H3DiT":
        """`compile_blocks`, or the eager forwards back (a host switching per run); a block's compiled forward is
        kept aside, so asking for it again does not compile again."""
        for block in self.blocks:
            current = block.__dict__.get("forward")
            if compiled and not isinstance(current, _CompiledForward):
                kept = block.__dict__.pop("_h3_compiled", None)
                if kept is not None:
                    block.forward = kept
            elif not compiled and isinstance(current, _CompiledForward):
                block.__dict__["_h3_compiled"] = block.__dict__.pop("forward")
        return self.compile_blocks() if compiled else self

    def modulation(self, timesteps: torch.Tensor) -> Modulation:
        """[K] distinct timesteps -> every block's AdaLN table and the final layer's, as `forward` computes them."""
        temb = self.time_embedder(timesteps.to(self.time_embedder.device))
        return Modulation([self._block_table(block, temb) for block in self.blocks], self.final_layer.adaln_proj(temb))

    def _block_table(self, block: Block, temb: torch.Tensor) -> torch.Tensor:
        """A block's table in the model dtype: the curve form's fp32 projection is cast after, as ComfyUI's model
        casts a block's rows to the stream's dtype (the full model's is in it already). The final layer's table
        is left as made: there ComfyUI's curve form modulates in fp32."""
        table = block.adaln_proj(temb)
        return table.to(self.dtype) if self.config.curve_form else table

    def adaln_modules(self) -> list[nn.Module]:
        """The timestep-only part of the model (~13B of the 33B parameters in the release)."""
        return [self.time_embedder, *(block.adaln_proj for block in self.blocks), self.final_layer.adaln_proj]

    @contextlib.contextmanager
    def checked_between_blocks(self, check: Callable[[], None]):
        """Call `check` after every block while inside (outside any compiled code): a host's interrupt check, so a
        long forward (a large canvas: minutes) stops within a block, not at the next step; its raise ends the
        forward."""
        self._between_blocks = check
        try:
            yield self
        finally:
            self._between_blocks = None

    @contextlib.contextmanager
    def adaln_offloaded(self, device: str | torch.device = "cpu"):
        """Keep the AdaLN weights on `device` (the CPU) for the duration; `modulation_schedule` still
        computes the tables on the compute device, one module visiting it at a time. Each module goes back
        where it was: weights a memory plan keeps on the CPU (offload.place) must not land on a small GPU."""
        homes = [next(itertools.chain(module.parameters(), module.buffers())).device for module in self.adaln_modules()]
        for module in self.adaln_modules():
            module.to(device)
        try:
            yield self
        finally:
            for module, home in zip(self.adaln_modules(), homes):
                module.to(home)

    def modulation_schedule(self, timesteps_per_step: list[torch.Tensor], park_on_cpu: bool = False) -> list[Modulation]:
        """Every step's tables, bitwise what `modulation` computes per step on the timesteps' device.
        Done module by module, so AdaLN weights kept elsewhere visit the compute device one at a time.
        `park_on_cpu`: each module's tables go to pinned CPU memory as soon as they are made (a 49-step
        schedule's are ~1.8 GiB at the real config), slices of a few slabs (a table pinned alone would be
        rounded up to a power of two), within the host's pinned-memory room (the rest in ordinary CPU memory);
        the sampler brings one step's back at a time."""
        device = timesteps_per_step[0].device
        slabs = PinnedSlabs(pinnable_bytes(host_room())) if park_on_cpu and device.type == "cuda" else None

        def park(table: torch.Tensor, left: int) -> torch.Tensor:
            """`table` pinned, one of `left` more of its size (what the slabs are planned for)."""
            return table if slabs is None else park_table(slabs, table, left)

        with _visiting(self.time_embedder, device):
            tembs = [self.time_embedder(t) for t in timesteps_per_step]
        per_block = []
        for index, block in enumerate(self.blocks):
            left = (len(self.blocks) - index) * len(tembs)  # block tables still to park, this one's included
            with _visiting(block.adaln_proj, device):
                per_block.append([park(self._block_table(block, temb), left - s) for s, temb in enumerate(tembs)])
        with _visiting(self.final_layer.adaln_proj, device):
            finals = [park(self.final_layer.adaln_proj(temb), len(tembs) - s) for s, temb in enumerate(tembs)]
        return [Modulation([tables[s] for tables in per_block], finals[s]) for s in range(len(tembs))]

    def forward(
        self,
        video_rows: torch.Tensor,
        audio_rows: torch.Tensor,
        text_states: torch.Tensor,
        timesteps: torch.Tensor,
        timestep_indices: torch.Tensor,
        token_tags: torch.Tensor,
        position_ids: torch.Tensor,
        video_indices: torch.Tensor,
        audio_indices: torch.Tensor,
        text_indices: torch.Tensor,
        modulation: Modulation | None = None,
        target_video: tuple[int, int] | None = None,
        sparse_tiles: VSATiles | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`modulation`: this step's precomputed tables (from `modulation(timesteps)`); computed here if None.
        `target_video`: (its first row, rows per latent frame) when the target video is the sequence's
        trailing run of rows (layout.PackedLayout.target_video_span); the attention window needs it.
        `sparse_tiles`: the rows' tiling (layout.PackedLayout.vsa_tiles) when `set_sparse_attention` is on."""
        rows = position_ids.shape[0]
        if position_ids.shape != (rows, 3) or token_tags.shape != (rows,) or timestep_indices.shape != (rows,):
            raise ValueError(
                f"position_ids must be [S, 3] with token_tags and timestep_indices [S]; got "
                f"{list(position_ids.shape)}, {list(token_tags.shape)}, {list(timestep_indices.shape)}."
            )
        rope = rope_tables(position_ids, self.rope_inv_freq)

        video = self.video_patch_proj(video_rows.to(self.video_patch_proj.weight.dtype))
        audio = self.audio_patch_proj(audio_rows.to(self.audio_patch_proj.weight.dtype))
        text = self.token_refiner(self.condition_proj(text_states.to(self.condition_proj.weight.dtype)))

        x = text.new_zeros(text.shape[0], rows, text.shape[-1])
        x = x.index_copy(1, text_indices, text)
        x = x.index_copy(1, video_indices, video.to(x.dtype))
        x = x.index_copy(1, audio_indices, audio.to(x.dtype))
        del video, audio, text  # the fp32 video projection alone is ~0.7 GiB at 5 s; not needed past here
        rope = tuple(table.to(x.dtype) for table in rope)  # once, not for q and k in every block

        if modulation is None:
            modulation = self.modulation(timesteps)
        adaln_index = timestep_indices * MODALITIES + token_tags
        window = None
        if self.attention_window and target_video is not None:
            window = VideoWindow.for_frames(self.attention_window, rows, *target_video)
        if self.sparse_attention is not None and sparse_tiles is not None:
            if window is not None:
                raise ValueError("The attention window and Video Sparse Attention are two ways to thin the attention; "
                                 "set one of them.")
            window = SparsePlan(sparse_tiles, self.sparse_attention)
        parallel = self.sequence_parallel
        if parallel is not None:  # each rank runs the blocks on its slice of the rows
            x, adaln_index, rope = parallel.split(x, adaln_index, rope)
        for block, table in zip(self.blocks, modulation.blocks, strict=True):
            x = block(x, table, adaln_index, rope, window)
            if self._between_blocks is not None:
                self._between_blocks()
        if parallel is not None:
            x = parallel.gather(x)
        return self.final_layer(x, modulation.final, timestep_indices, video_indices, audio_indices)
