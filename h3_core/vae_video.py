"""The H3 video VAE: a causal 3D-CNN encoder and a non-causal ViT decoder (h3-model.md B).

Data contract (C = 24 latent channels, f16 spatial, t4 temporal compression):

    frames       [B, 3, F, H, W]  uint8 0..255 or float 0..1 RGB (the caller's frames)
    model space  [B, 3, F, H, W]  float32, ImageNet-normalized: (rgb01 - mean) / std; encode takes
                                  it, decode returns it (`frames_to_model_space`, `model_space_to_frames`)
    moments      [B, 2C, L, H/16, W/16]  posterior mean and log-variance (`Posterior`)
    latents      [B, C, L, h, w]  raw VAE latents; the DiT sees them normalized per channel with the
                                  release's `latents_mean` / `latents_std` (`normalize_latents`)
    F = 17n + 5 frames <-> L = 5n + 2 latents; one frame encodes to one latent (keyframes, images).

Module names are the original release's (`encoder.down.{i}.block.{j}`, `decoder.x_embedder`,
`attn.to_qkv` per-head interleaved, `ff.w1` = [gate; up]): the original folder and ComfyUI's single
file load by name alone, only diffusers' layout is mapped (vae_video_checkpoint.py).

Precision policy (the reference's, diffusers `_keep_in_fp32_modules`): `FP32_MODULES` stay float32
whatever dtype the model is given; every other parameter (post_quant_conv, the decoder's embedder,
register tokens, attention / feed-forward linears and proj_out) takes the model dtype. At run time
the encoder runs in its own dtype, norms compute in float32, the decoder's residual stream is
float32 (the layer scales are), and each linear sees its input cast to its own dtype.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .attention import attention
from .rope import apply_rope
from .vae_video_tiling import TemporalChunking, decode_tiled, encode_tiled, split_tiles

# Per-channel latent statistics of the release (`video_vae/config.json`): the DiT works on
# (latents - mean) / std.
RELEASE_LATENTS_MEAN = (
    0.858090341091156, -0.9606591463088989, 1.0661640167236328, -0.5090325474739075,
    -0.2727581858634949, -1.3675414323806763, -0.2553254961967468, -0.26907554268836975,
    -0.5376840829849243, -0.0464097298681736, 0.6657370328903198, 0.19690127670764923,
    -0.5460608005523682, -0.4035342037677765, -0.23683024942874908, 0.25928452610969543,
    -0.30133944749832153, 0.211341992020607, -1.1206848621368408, 0.3581933379173279,
    -0.04225143790245056, 0.2604829967021942, 0.22864092886447906, 0.7056031823158264,
)  # fmt: skip
RELEASE_LATENTS_STD = (
    1.2223774194717407, 1.2767263650894165, 1.6831774711608887, 1.7549455165863037,
    1.5636216402053833, 2.194143533706665, 0.9653137922286987, 1.0569885969161987,
    0.841948926448822, 0.7729952931404114, 1.8955937623977661, 0.946841835975647,
    0.7996809482574463, 0.44988900423049927, 0.7197399735450745, 0.6936293244361877,
    2.961095094680786, 2.7694199085235596, 3.0496184825897217, 2.1088054180145264,
    3.276226282119751, 3.1627357006073, 2.2816812992095947, 2.6127843856811523,
)  # fmt: skip
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# Keyframes and references are encoded with a posterior *sample* under this seed, independent of
# the request's seed (diffusers `keyframe_encode_seed`).
CONDITION_ENCODE_SEED = 42
# Modules (any component of a parameter's dotted name) that stay float32 under every model dtype.
FP32_MODULES = ("encoder", "quant_conv", "norm1", "norm2", "norm_out", "scale1", "scale2")


def keeps_fp32(parameter_name: str) -> bool:
    return any(part in FP32_MODULES for part in parameter_name.split("."))


@dataclass(frozen=True)
class VideoVAEConfig:
    """Shape and recipe of the video VAE. Defaults are the release; field names follow diffusers'
    `AutoencoderKLMiniMaxH3` config, plus the release wrapper's tiling settings."""

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 24
    block_out_channels: tuple[int, ...] = (128, 256, 256, 512, 512, 1024)
    layers_per_block: int = 2
    spatial_downsample_factors: tuple[int, ...] = (2, 2, 2, 2, 1, 1)
    temporal_downsample_factors: tuple[int, ...] = (1, 2, 2, 1, 1, 1)
    norm_num_groups: int = 32
    norm_eps: float = 1e-6
    spatial_padding_mode: str = "reflect"
    decoder_num_layers: int = 36
    decoder_num_attention_heads: int = 32
    decoder_attention_head_dim: int = 64
    decoder_num_register_tokens: int = 4
    decoder_ffn_mult: int = 4
    decoder_rope_theta: float = 100.0
    decoder_rope_dim_ratio: float = 0.75
    decoder_norm_eps: float = 1e-5
    clip_length: int = 17
    token_drop: int = 3
    latents_mean: tuple[float, ...] = RELEASE_LATENTS_MEAN
    latents_std: tuple[float, ...] = RELEASE_LATENTS_STD
    tile_size: int = 256
    tile_min_overlap: int = 64
    encoder_tiling: bool = True
    decoder_tiling: bool = True

    def __post_init__(self):
        for name in ("block_out_channels", "spatial_downsample_factors", "temporal_downsample_factors"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        for name in ("latents_mean", "latents_std"):
            object.__setattr__(self, name, tuple(float(v) for v in getattr(self, name)))
        levels = len(self.block_out_channels)
        if not len(self.spatial_downsample_factors) == len(self.temporal_downsample_factors) == levels:
            raise ValueError("block_out_channels and both downsample factor lists need one entry per level.")
        if len(self.latents_mean) != self.latent_channels or len(self.latents_std) != self.latent_channels:
            raise ValueError(f"latents_mean and latents_std need one value per channel ({self.latent_channels}).")
        if self.rope_dim % 6:
            raise ValueError(
                f"decoder_attention_head_dim * decoder_rope_dim_ratio = {self.rope_dim} must be divisible by 6 "
                "(cos/sin halves over three axes)."
            )
        ratio = self.spatial_ratio  # tiles are cut on the latent grid: else a decode hangs or loses pixels
        if not (0 < self.tile_min_overlap < self.tile_size and self.tile_size % ratio == 0
                and self.tile_min_overlap % ratio == 0):
            raise ValueError(f"The VAE's tiles must be multiples of its {ratio}-pixel latent grid, their minimum "
                             f"overlap too, more than 0 and less than the tile (the release: 256 and 64); got tile "
                             f"{self.tile_size}, overlap {self.tile_min_overlap}.")

    @property
    def spatial_ratio(self) -> int:
        return math.prod(self.spatial_downsample_factors)

    @property
    def temporal_ratio(self) -> int:
        return math.prod(self.temporal_downsample_factors)

    @property
    def decoder_dim(self) -> int:
        return self.decoder_num_attention_heads * self.decoder_attention_head_dim

    @property
    def rope_dim(self) -> int:
        """Channels of each head that RoPE rotates (48 of 64 in the release); the rest pass through."""
        return int(self.decoder_attention_head_dim * self.decoder_rope_dim_ratio)

    @property
    def temporal_chunking(self) -> TemporalChunking:
        return TemporalChunking(self.clip_length, self.token_drop, self.temporal_ratio)

    def replace(self, **changes) -> VideoVAEConfig:
        return dataclasses.replace(self, **changes)


# The fact sheet's CPU recipe (h3-model.md J): the real 16x spatial / 4x temporal factors and the
# 17-frame clips on tiny widths; 2 heads of 16 leave 4 unrotated channels per head.
TINY_VIDEO_VAE = VideoVAEConfig(
    block_out_channels=(8, 8, 16, 16, 16, 16),
    layers_per_block=1,
    norm_num_groups=4,
    decoder_num_layers=1,
    decoder_num_attention_heads=2,
    decoder_attention_head_dim=16,
)


# ----------------------------------------------------------------------------------------------
# Encoder: causal 3D CNN


# A CUDA kernel indexing with 32 bits refuses a larger tensor (F.pad: "input tensor must fit into 32-bit index
# math"): an untiled 17-frame 1344x768 clip pads 128 channels at full size to 2.5e9 values. A convolution whose
# padded input or output would pass `INDEX_LIMIT` is made in bands of output rows of at most `BAND_VALUES`.
INDEX_LIMIT = 2**31 - 1
BAND_VALUES = 2**30
# Padding modes whose edge rows come from the rows next to that edge, so a band can be padded on its own.
BANDABLE_PADDING = frozenset({"reflect", "replicate", "constant"})


class CausalConv3d(nn.Conv3d):
    """Conv3d with spatial padding (reflect in the release; symmetric but for Downsample's) and causal temporal
    padding: kernel_t - 1 zero frames in front, none behind, so frame t never sees frames after t.

    `spatial_padding`: pixels on every side, or (left, right, top, bottom) as F.pad orders them."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, spatial_padding=0, padding_mode="reflect"):
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=0)
        pads = (spatial_padding,) * 4 if isinstance(spatial_padding, int) else tuple(spatial_padding)
        self.spatial_padding = pads
        self.spatial_padding_mode = padding_mode

    def _pad(self, x: torch.Tensor, top: int, bottom: int) -> torch.Tensor:
        left, right = self.spatial_padding[:2]
        if left or right or top or bottom:
            x = F.pad(x, (left, right, top, bottom, 0, 0), mode=self.spatial_padding_mode)
        if self.kernel_size[0] > 1:
            x = F.pad(x, (0, 0, 0, 0, self.kernel_size[0] - 1, 0))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        left, right, top, bottom = self.spatial_padding
        batch, _, frames, height, width = x.shape
        (kt, kh, kw), (st, sh, sw) = self.kernel_size, self.stride
        padded_row = x.shape[1] * (frames + kt - 1) * (width + left + right)
        out_row = self.out_channels * ((frames - 1) // st + 1) * ((width + left + right - kw) // sw + 1)
        out_h = (height + top + bottom - kh) // sh + 1
        fits = batch * max(padded_row * (height + top + bottom), out_row * out_h) <= INDEX_LIMIT
        if fits or self.spatial_padding_mode not in BANDABLE_PADDING:
            return F.conv3d(self._pad(x, top, bottom), self.weight, self.bias, self.stride)
        return self._forward_in_bands(x, out_h, max(1, BAND_VALUES // (batch * max(sh * padded_row, out_row))))

    def _forward_in_bands(self, x: torch.Tensor, out_h: int, band_rows: int) -> torch.Tensor:
        """The same convolution, `band_rows` output rows at a time: each band reads the input rows its kernel
        covers and pads only where they meet the picture's edge, as the whole would be padded there."""
        top, height, kh, sh = self.spatial_padding[2], x.shape[3], self.kernel_size[1], self.stride[1]
        out = None
        for first in range(0, out_h, band_rows):
            last = min(first + band_rows, out_h)
            low, high = first * sh - top, (last - 1) * sh + kh - top  # input rows, padding rows outside 0..height
            rows = x[:, :, :, max(low, 0):min(high, height)].contiguous()  # a view would span all of x's indices
            band = F.conv3d(self._pad(rows, max(-low, 0), max(high - height, 0)), self.weight, self.bias, self.stride)
            if out is None:
                out = band.new_empty(*band.shape[:3], out_h, band.shape[4])
            out[:, :, :, first:last] = band
        return out


class FrameGroupNorm(nn.GroupNorm):
    """GroupNorm with statistics per frame (time folded into the batch): frames never mix."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames = x.shape[2]
        x = rearrange(x, "b c t h w -> (b t) c h w")
        x = F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        return rearrange(x, "(b t) c h w -> b c t h w", t=frames)


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, config: VideoVAEConfig):
        super().__init__()
        groups, eps, mode = config.norm_num_groups, config.norm_eps, config.spatial_padding_mode
        self.norm1 = FrameGroupNorm(groups, in_channels, eps=eps)
        self.conv1 = CausalConv3d(in_channels, out_channels, 3, spatial_padding=1, padding_mode=mode)
        self.norm2 = FrameGroupNorm(groups, out_channels, eps=eps)
        self.conv2 = CausalConv3d(out_channels, out_channels, 3, spatial_padding=1, padding_mode=mode)
        self.nin_shortcut = CausalConv3d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        shortcut = x if self.nin_shortcut is None else self.nin_shortcut(x)
        return shortcut + h


class Downsample(nn.Module):
    """Strided 3x3x3 conv, stride (t, s, s). A spatial stride of 2 pads one pixel (the config's mode) at the
    bottom and right only, so a side n becomes ceil(n / 2)."""

    def __init__(self, channels: int, temporal_stride: int, spatial_stride: int, padding_mode: str):
        super().__init__()
        pad = 1 if spatial_stride == 2 else 0
        self.conv = CausalConv3d(channels, channels, 3, stride=(temporal_stride, spatial_stride, spatial_stride),
                                 spatial_padding=(0, pad, 0, pad), padding_mode=padding_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class EncoderLevel(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, level: int, config: VideoVAEConfig):
        super().__init__()
        self.block = nn.ModuleList(
            ResnetBlock(in_channels if j == 0 else out_channels, out_channels, config)
            for j in range(config.layers_per_block)
        )
        temporal, spatial = config.temporal_downsample_factors[level], config.spatial_downsample_factors[level]
        self.downsample = None
        if temporal * spatial > 1:
            self.downsample = Downsample(out_channels, temporal, spatial, config.spatial_padding_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.block:
            x = block(x)
        return x if self.downsample is None else self.downsample(x)


class Encoder(nn.Module):
    """Pixels [B, 3, T, H, W] -> [B, 2C, T', ceil(H/16), ceil(W/16)]; each temporal stride 2 maps T to
    ceil(T / 2) (17 -> 9 -> 5, 1 -> 1). conv_in, the levels, a per-frame norm, SiLU, conv_out."""

    def __init__(self, config: VideoVAEConfig):
        super().__init__()
        channels = config.block_out_channels
        mode = config.spatial_padding_mode
        self.conv_in = CausalConv3d(config.in_channels, channels[0], 3, spatial_padding=1, padding_mode=mode)
        inputs = (channels[0],) + channels[:-1]
        self.down = nn.ModuleList(EncoderLevel(inputs[i], channels[i], i, config) for i in range(len(channels)))
        self.norm_out = FrameGroupNorm(config.norm_num_groups, channels[-1], eps=config.norm_eps)
        self.conv_out = CausalConv3d(channels[-1], 2 * config.latent_channels, 3, spatial_padding=1, padding_mode=mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for level in self.down:
            x = level(x)
        return self.conv_out(F.silu(self.norm_out(x)))


# ----------------------------------------------------------------------------------------------
# Decoder: ViT over latent voxels


class Fp32RMSNorm(nn.RMSNorm):
    """RMSNorm computed in float32 whatever the input and weight dtypes; returns float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float() if self.weight is not None else None
        return F.rms_norm(x.float(), self.normalized_shape, weight, self.eps)


class Fp32LayerNorm(nn.LayerNorm):
    """LayerNorm computed in float32; returns float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(), self.eps)


def decoder_rope(frames: int, height: int, width: int, extra_tokens: int, config: VideoVAEConfig, device):
    """cos, sin [t*h*w + extra, rope_dim] for the decoder's tokens.

    Each axis of size n has coordinates (i + 0.5) / n * 2 - 1 in [-1, 1): normalized by the tile's
    own extent. Angle = 2*pi * coordinate * theta^(-k*6/rope_dim), k < rope_dim/6; the t, h, w
    angles are concatenated, then duplicated (rotate-half pairs). Registers and the zero token sit
    at position 0 (no rotation).
    """
    exponents = torch.arange(0, 1, 6 / config.rope_dim, dtype=torch.float32, device=device)
    inv_freq = 1.0 / config.decoder_rope_theta**exponents
    axes = [torch.arange(0.5, n, dtype=torch.float32, device=device) / n * 2.0 - 1.0 for n in (frames, height, width)]
    positions = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).flatten(0, 2)
    positions = torch.cat([positions, positions.new_zeros(extra_tokens, 3)])
    angles = (2.0 * math.pi * positions[:, :, None] * inv_freq).flatten(1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


class DecoderAttention(nn.Module):
    """Full self-attention; `to_qkv` rows are per-head interleaved [h0: q k v, h1: q k v, ...] as in
    the release; q and k get an RMSNorm without weight, computed in float32, then RoPE."""

    def __init__(self, config: VideoVAEConfig):
        super().__init__()
        self.heads, self.head_dim = config.decoder_num_attention_heads, config.decoder_attention_head_dim
        self.eps = config.decoder_norm_eps
        self.to_qkv = nn.Linear(config.decoder_dim, 3 * config.decoder_dim)
        self.to_out = nn.Linear(config.decoder_dim, config.decoder_dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q, k, v = self.to_qkv(x).view(batch, tokens, self.heads, 3, self.head_dim).unbind(3)
        q = F.rms_norm(q.float(), (self.head_dim,), eps=self.eps).to(v.dtype)
        k = F.rms_norm(k.float(), (self.head_dim,), eps=self.eps).to(v.dtype)
        out = attention(apply_rope(q, *rope), apply_rope(k, *rope), v)
        return self.to_out(out.reshape(batch, tokens, -1))


class FeedForward(nn.Module):
    """w2(silu(gate) * up) with `w1` rows stored [gate; up], biases on both linears."""

    def __init__(self, config: VideoVAEConfig):
        super().__init__()
        inner = config.decoder_ffn_mult * config.decoder_dim
        self.w1 = nn.Linear(config.decoder_dim, 2 * inner)
        self.w2 = nn.Linear(inner, config.decoder_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class DecoderBlock(nn.Module):
    """h += Attn(RMSNorm1(h)) * scale1; h += FF(RMSNorm2(h)) * scale2, with h in float32."""

    def __init__(self, config: VideoVAEConfig):
        super().__init__()
        dim = config.decoder_dim
        self.norm1 = Fp32RMSNorm(dim, eps=config.decoder_norm_eps)
        self.attn = DecoderAttention(config)
        self.scale1 = nn.Parameter(torch.zeros(dim))
        self.norm2 = Fp32RMSNorm(dim, eps=config.decoder_norm_eps)
        self.ff = FeedForward(config)
        self.scale2 = nn.Parameter(torch.zeros(dim))

    def forward(self, h: torch.Tensor, rope) -> torch.Tensor:
        # The linears run in their own dtype; their outputs are scaled and added in float32, so a
        # reduced-precision decoder rounds each branch once, never the running sum.
        compute = self.attn.to_qkv.weight.dtype
        h = h.float() + self.attn(self.norm1(h).to(compute), rope).float() * self.scale1.float()
        return h + self.ff(self.norm2(h).to(compute)).float() * self.scale2.float()


class ViTDecoder(nn.Module):
    """Latents [B, C, t, h, w] -> model-space pixels [B, 3, 4t, 16h, 16w].

    Every latent voxel is a token (t, h, w row-major), followed by the register tokens and one
    all-zero token; after the blocks the extra tokens are dropped and each voxel token expands to a
    4 x 16 x 16 RGB block (proj_out channels ordered (c, dt, dy, dx)).
    """

    def __init__(self, config: VideoVAEConfig):
        super().__init__()
        self.config = config
        dim = config.decoder_dim
        self.x_embedder = nn.Linear(config.latent_channels, dim)
        self.register_tokens = nn.Parameter(torch.zeros(1, config.decoder_num_register_tokens, dim))
        self.transformer_blocks = nn.ModuleList(DecoderBlock(config) for _ in range(config.decoder_num_layers))
        self.norm_out = Fp32LayerNorm(dim, eps=config.decoder_norm_eps)
        patch_volume = config.temporal_ratio * config.spatial_ratio**2
        self.proj_out = nn.Linear(dim, config.out_channels * patch_volume)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        batch, _, frames, height, width = latents.shape
        tokens = rearrange(latents, "b c t h w -> b (t h w) c")
        h = self.x_embedder(tokens.to(self.x_embedder.weight.dtype))
        registers = self.register_tokens.to(h.dtype).expand(batch, -1, -1)
        h = torch.cat([h, registers, h.new_zeros(batch, 1, h.shape[-1])], dim=1)
        rope = decoder_rope(frames, height, width, registers.shape[1] + 1, self.config, latents.device)
        for block in self.transformer_blocks:
            h = block(h, rope)
        h = self.norm_out(h[:, : tokens.shape[1]])
        pixels = self.proj_out(h.to(self.proj_out.weight.dtype))
        pt, ps = self.config.temporal_ratio, self.config.spatial_ratio
        return rearrange(
            pixels,
            "b (t h w) (c pt py px) -> b c (t pt) (h py) (w px)",
            t=frames, h=height, w=width, pt=pt, py=ps, px=ps,
        )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# The autoencoder


@dataclass
class Posterior:
    """The encoder's diagonal Gaussian over latents: mean and log-variance (clamped to [-30, 20])."""

    mean: torch.Tensor
    logvar: torch.Tensor

    @classmethod
    def from_moments(cls, moments: torch.Tensor) -> Posterior:
        mean, logvar = moments.chunk(2, dim=1)
        return cls(mean, logvar.clamp(-30.0, 20.0))

    def sample(self, generator: torch.Generator) -> torch.Tensor:
        """mean + exp(logvar / 2) * eps, eps drawn in one `torch.randn` of the mean's shape and dtype on
        the generator's device (a CPU generator gives the same bits on every device), then moved."""
        noise = torch.randn(self.mean.shape, generator=generator, dtype=self.mean.dtype, device=generator.device)
        return self.mean + torch.exp(0.5 * self.logvar) * noise.to(self.mean.device)


class VideoVAE(nn.Module):
    """The MiniMax-H3 video VAE (`AutoencoderKLMiniMaxH3`); see the module docstring for the contract."""

    def __init__(self, config: VideoVAEConfig = VideoVAEConfig()):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.quant_conv = nn.Conv3d(2 * config.latent_channels, 2 * config.latent_channels, 1)
        self.post_quant_conv = nn.Conv3d(config.latent_channels, config.latent_channels, 1)
        self.decoder = ViTDecoder(config)

    @classmethod
    def build(cls, config: VideoVAEConfig, dtype: torch.dtype = torch.float32, device="cpu") -> VideoVAE:
        """A randomly initialized model in the precision policy (`device="meta"` allocates nothing)."""
        with torch.device(device):
            model = cls(config)
        return model.set_dtype(dtype)

    def set_dtype(self, dtype: torch.dtype) -> VideoVAE:
        """Cast every parameter outside `FP32_MODULES` to `dtype`; those stay float32."""
        for name, param in self.named_parameters():
            param.data = param.data.to(torch.float32 if keeps_fp32(name) else dtype)
        return self

    @property
    def dtype(self) -> torch.dtype:
        """The decoder's linear dtype (the model dtype of the precision policy)."""
        return self.decoder.x_embedder.weight.dtype

    # -- latent space ---------------------------------------------------------------------------

    def _latent_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = torch.tensor(self.config.latents_mean, dtype=torch.float32, device=like.device)
        std = torch.tensor(self.config.latents_std, dtype=torch.float32, device=like.device)
        return mean.view(1, -1, 1, 1, 1), std.view(1, -1, 1, 1, 1)

    def normalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Raw latents -> the DiT's space: (z - latents_mean) / latents_std per channel (float32)."""
        mean, std = self._latent_stats(latents)
        return (latents.float() - mean) / std

    def denormalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The DiT's latents -> raw VAE latents: z * latents_std + latents_mean (float32)."""
        mean, std = self._latent_stats(latents)
        return latents.float() * std + mean

    # -- encode ---------------------------------------------------------------------------------

    def _encode_clip(self, pixels: torch.Tensor, tiled: bool) -> torch.Tensor:
        def encode_tile(x):
            return self.quant_conv(self.encoder(x))

        if not tiled:
            return encode_tile(pixels)
        config = self.config
        return encode_tiled(encode_tile, pixels, config.tile_size, config.tile_min_overlap, config.spatial_ratio)

    @torch.no_grad()
    def encode_moments(self, pixels: torch.Tensor, tiled: bool | None = None,
                       prepare: Callable[[torch.Tensor], torch.Tensor] | None = None,
                       on_clip: Callable[[int], None] | None = None) -> torch.Tensor:
        """Model-space pixels [B, 3, F, H, W] -> moments [B, 2C, L, H/16, W/16], in 17-frame clips
        (one frame alone), each clip spatially tiled unless `tiled=False` (default: the config's).

        `prepare` (elementwise, e.g. `frames_to_model_space`) turns each clip into model space after it
        reaches the VAE's device: a long clip can stay uint8 in CPU memory, one clip at a time on the device.
        `on_clip(frames encoded so far)` after each 17-frame clip of a video (`TemporalChunking.encode_clips`)."""
        return self.config.temporal_chunking.encode(self._clip_encoder(tiled, prepare), pixels, on_clip)

    @torch.no_grad()
    def encode_moments_of_clips(self, clips: Iterable[torch.Tensor], tiled: bool | None = None,
                                prepare: Callable[[torch.Tensor], torch.Tensor] | None = None,
                                on_clip: Callable[[int], None] | None = None) -> torch.Tensor:
        """`encode_moments` of a video given as its consecutive 17-frame clips [B, 3, 17, H, W] (the last may
        be shorter; `TemporalChunking.encode_clips`): made one at a time by the caller, e.g. as a file is
        decoded, so the frames are never all in memory."""
        return self.config.temporal_chunking.encode_clips(self._clip_encoder(tiled, prepare), clips, on_clip)

    def _clip_encoder(self, tiled: bool | None, prepare: Callable[[torch.Tensor], torch.Tensor] | None):
        tiled = self.config.encoder_tiling if tiled is None else tiled
        weight = self.encoder.conv_in.weight

        def encode_clip(clip: torch.Tensor) -> torch.Tensor:
            clip = clip.to(weight.device)
            return self._encode_clip((clip if prepare is None else prepare(clip)).to(weight.dtype), tiled)

        return encode_clip

    def encode(self, pixels: torch.Tensor, tiled: bool | None = None,
               prepare: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Posterior:
        return Posterior.from_moments(self.encode_moments(pixels, tiled, prepare))

    # -- decode ---------------------------------------------------------------------------------

    def _decode_clip(self, latents: torch.Tensor, tiled: bool) -> torch.Tensor:
        def decode_tile(z):
            return self.decoder(self.post_quant_conv(z))

        if not tiled:
            return decode_tile(latents)
        config = self.config
        return decode_tiled(decode_tile, latents, config.tile_size, config.tile_min_overlap, config.spatial_ratio)

    @torch.no_grad()  # on a generator, torch disables grad only while the generator runs
    def decode_stream(self, latents: torch.Tensor, tiled: bool | None = None,
                      devices: Sequence[str | torch.device] | None = None) -> Iterator[torch.Tensor]:
        """Raw latents [B, C, L, h, w] (L >= 3) -> model-space frame blocks [B, 3, n <= 17, 16h, 16w],
        yielded as each temporal chunk is finished; concatenated along dim 2 they are `decode`. Blocks
        come in the decoder's output dtype (proj_out's), on the latents' device.

        `devices` (two or more): the temporal clips, which are independent, are decoded on all of them
        at once (`decode_on_devices`); the same operations per clip, stitched here in order."""
        tiled = self.config.decoder_tiling if tiled is None else tiled
        latents = latents.to(self.post_quant_conv.weight.dtype)
        chunking = self.config.temporal_chunking
        if devices is None or len(devices) < 2:
            yield from chunking.decode(lambda clip: self._decode_clip(clip, tiled), latents)
            return
        home = latents.device
        yield from chunking.decode_clips(lambda clips: decode_on_devices(self, clips, devices, tiled, home), latents)

    def decode(self, latents: torch.Tensor, tiled: bool | None = None) -> torch.Tensor:
        """Raw latents [B, C, L, h, w] -> model-space frames [B, 3, F, 16h, 16w] (L = 5n + 2 -> F = 17n + 5)."""
        return torch.cat(list(self.decode_stream(latents, tiled)), dim=2)


def replicate(vae: VideoVAE, device: str | torch.device) -> VideoVAE:
    """A copy of `vae` on `device` for a decode thread. Each tensor is copied straight to `device`
    (seeded into deepcopy's memo), so the source device never holds a second copy; on the same device
    the copy shares the weights."""
    device = torch.device(device)
    memo = {}
    for tensor in itertools.chain(vae.parameters(), vae.buffers()):
        moved = tensor.detach().to(device)
        memo[id(tensor)] = nn.Parameter(moved, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else moved
    return copy.deepcopy(vae, memo)


def decode_on_devices(vae: VideoVAE, clips: Iterator[torch.Tensor], devices: Sequence[str | torch.device],
                      tiled: bool, home: torch.device) -> Iterator[torch.Tensor]:
    """Decode latent clips round-robin over `devices`, one thread and one `replicate` of `vae` per
    device (a device named twice shares its replica), and yield each clip's frames in order, on `home`.

    Clip i + n is queued on a device only when clip i (same device) is the next to be taken, so at
    most one clip runs per device and at most n + 1 decoded clips wait on `home`: memory stays bounded
    whatever the video's length. Worker threads are no_grad (grad mode is thread-local) and set their
    CUDA device; an error in one is raised here as the original exception, and on any exit the
    queued clips are cancelled and the threads joined."""
    devices = [torch.device(d) for d in devices]
    replicas = {device: replicate(vae, device) for device in dict.fromkeys(devices)}

    def decoder(device: torch.device):
        model = replicas[device]

        def decode(clip: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return model._decode_clip(clip.to(device), tiled).to(home)

        return decode

    def enter(device: torch.device):
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)

    decoders = [decoder(device) for device in devices]
    pools = [ThreadPoolExecutor(1, f"h3-vae-decode-{i}", enter, (device,)) for i, device in enumerate(devices)]
    pending = deque()
    try:
        for index, clip in enumerate(clips):
            lane = index % len(devices)
            pending.append(pools[lane].submit(decoders[lane], clip))
            if len(pending) > len(devices):
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for pool in pools:
            pool.shutdown(wait=True, cancel_futures=True)


# cuBLAS / cuBLASLt and cuDNN workspaces the decode's kernels allocate through torch (the H200's decode
# peaks sat 55-65 MiB above the activations counted below, in float32 and bf16 alike).
LIBRARY_WORKSPACE_BYTES = 64 * 2**20


def decode_working_bytes(config: VideoVAEConfig, latent_frames: int, latent_height: int, latent_width: int,
                         dtype_bytes: int = 4) -> int:
    """Device memory a streamed decode (`decode_stream`, the release's chunks and tiles) needs besides the
    weights, so a host can free weights + this before decoding. An upper bound read off the code, counted
    in bytes of the decoder's output dtype (`dtype_bytes`; the residual stream is float32 whatever it is):

    - a decode clip is `latents_per_chunk + overlap_latents` latents (7: 28 frames) whatever the length,
      so the bound does not grow with `latent_frames` (each block goes to the CPU as it is done);
    - while a chunk is stitched, the previous chunk's 28 frames, its 17-frame head and 5-frame tail are
      still referenced by the generator (1 + 22/28 chunks);
    - stitching peaks at the last concatenation: the finished rows, their concatenation (2 chunks) and
      the last row's whole tiles; or, while the last tile runs, one chunk of rows, that row's tiles and
      the tile's activations: the FFN's float32 residual stream and its norm, w1's output, silu(gate) and
      their product (4 x ffn inner) per token, the tile's pixels twice (proj_out and its rearrangement)
      and the RoPE tables. Attention's scores are not materialized (SDPA's fused kernels);
    - besides: the math libraries' workspaces (cuBLAS, cuDNN: `LIBRARY_WORKSPACE_BYTES`) and
      `output.decode_video`'s conversion of a 17-frame block to uint8 (one float32 copy, then the bytes).

    At 1344x768 (48x84 latents), 124 frames, the H200 measured (bench/vae_decode.py, peak allocated
    less the weights) 1.61 GiB with the float32 decoder and 0.94 GiB with bf16 linears; this bound is
    1.67 and 0.99 GiB. The audio VAE decodes first, in small windows, and is not counted."""
    if latent_frames < 1 or latent_height < 1 or latent_width < 1:
        raise ValueError(f"A decode needs latents in every dimension, got "
                         f"{latent_frames}x{latent_height}x{latent_width}.")
    chunking, ratio = config.temporal_chunking, config.spatial_ratio
    clip_frames = (chunking.latents_per_chunk + chunking.overlap_latents) * config.temporal_ratio
    height, width = latent_height * ratio, latent_width * ratio
    if config.decoder_tiling:
        rows = split_tiles(height, config.tile_size, config.tile_min_overlap, ratio)
        cols = split_tiles(width, config.tile_size, config.tile_min_overlap, ratio)
        tile_h, tile_w, columns = rows.size, cols.size, len(cols.starts)
    else:
        tile_h, tile_w, columns = height, width, 1

    def pixels(frames: int, h: int, w: int) -> int:
        return config.out_channels * frames * h * w * dtype_bytes

    chunk = pixels(clip_frames, height, width)
    part, lead = chunking.part_frames, chunking.lead_frames
    tail = max(min(clip_frames, 2 * part) - part - lead, 0)
    kept = chunk + pixels(part - lead, height, width) + pixels(tail, height, width)  # frames, head, tail
    row_tiles = columns * pixels(clip_frames, tile_h, tile_w)
    tokens = (clip_frames // config.temporal_ratio * (tile_h // ratio) * (tile_w // ratio)
              + config.decoder_num_register_tokens + 1)
    dim, inner = config.decoder_dim, config.decoder_ffn_mult * config.decoder_dim
    per_token = 4 * 2 * dim + dtype_bytes * (4 * inner + dim) + 4 * 2 * config.rope_dim
    tile_work = tokens * per_token + 2 * pixels(clip_frames, tile_h, tile_w)
    to_uint8 = (4 + 1) * config.out_channels * (part - lead) * height * width  # the largest block: a head
    return LIBRARY_WORKSPACE_BYTES + to_uint8 + kept + row_tiles + max(2 * chunk, chunk + tile_work)



def encode_working_bytes(config: VideoVAEConfig, frames: int, height: int, width: int,
                         tiled: bool | None = None) -> int:
    """Device memory encoding `frames` frames of `height` x `width` pixels (H3 VAE Encode's clip, a keyframe or
    a reference) needs besides the weights, so a host can free weights + this first. An upper bound read off
    the code; the encoder is float32 under every model dtype (`FP32_MODULES`):

    - clips go through one at a time (17 frames, or 1 alone), each spatially tiled unless `tiled` is False
      (None: the config's); the clip is on the device as it came (uint8 at most: 1 byte a value) and in
      model space (float32), the tile a view of it;
    - the peak is in the first level's second ResnetBlock at its second conv (block_out_channels[0] at full
      size): conv_in's output (still the Encoder's), the block's input, conv1's output and norm2 + SiLU's are
      held; the conv's input is padded by a pixel each side and by kernel - 1 = 2 frames in front (a lone frame
      triples there), and the 3-D convolution holds that input and its output twice each (the H200 measured
      cuDNN's float32 kernel converting both). GroupNorm's contiguous copy comes earlier and smaller; deeper
      levels hold fewer bytes (channels double as the area quarters);
    - the moments of the whole clip (2C channels) three times over: their concatenation beside the clips'
      list, then the posterior sample's temporaries before the latents go to the CPU;
    - besides: the math libraries' workspaces (`LIBRARY_WORKSPACE_BYTES`) under cuDNN's heuristics (torch's
      default, and ComfyUI's but for `--fast autotune`, whose benchmarked kernels take what workspace they like).

    bench/vae_encode_memory.py checks it on the H200 against the peak allocated less the weights: 1344x768,
    17 frames, tiled: 4.65 GiB measured, 4.71 bound; a lone frame untiled 5.94 and 6.00; 17 frames untiled (its
    full-size convolutions in bands, `CausalConv3d`) 64.4 and 69.3 on an H100."""
    if frames < 1 or height < 1 or width < 1:
        raise ValueError(f"An encode needs pixels in every dimension, got {frames}x{height}x{width}.")
    tiled = config.encoder_tiling if tiled is None else tiled
    ratio = config.spatial_ratio
    tile_h = split_tiles(height, config.tile_size, config.tile_min_overlap, ratio).size if tiled else height
    tile_w = split_tiles(width, config.tile_size, config.tile_min_overlap, ratio).size if tiled else width
    clip_frames = 1 if frames == 1 else config.clip_length
    values = config.in_channels * clip_frames * height * width
    clip = values * (1 + 4)
    channels = config.block_out_channels[0]
    activation = channels * clip_frames * tile_h * tile_w * 4
    padded = channels * (clip_frames + 2) * (tile_h + 2) * (tile_w + 2) * 4
    clips = 1 if frames == 1 else math.ceil(frames / config.clip_length)
    latent_frames = clips * config.temporal_chunking.latents_per_chunk
    moments = 2 * config.latent_channels * latent_frames * math.ceil(height / ratio) * math.ceil(width / ratio) * 4
    return LIBRARY_WORKSPACE_BYTES + clip + 6 * activation + 2 * padded + 3 * moments

# ----------------------------------------------------------------------------------------------
# Pixels and the conditioning recipe


def _imagenet_stats(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float32, device=like.device).view(1, 3, 1, 1, 1)
    std = torch.tensor(IMAGENET_STD, dtype=torch.float32, device=like.device).view(1, 3, 1, 1, 1)
    return mean, std


def frames_to_model_space(frames: torch.Tensor) -> torch.Tensor:
    """[B, 3, F, H, W] uint8 (0..255) or float (0..1) RGB -> float32 (rgb01 - mean) / std."""
    rgb = frames.float() / 255.0 if frames.dtype == torch.uint8 else frames.float()
    mean, std = _imagenet_stats(rgb)
    return (rgb - mean) / std


def model_space_to_frames(pixels: torch.Tensor) -> torch.Tensor:
    """Decoder output -> float32 RGB in [0, 1]: x * std + mean, clamped; in place on one float32 copy,
    as a decoded block is hundreds of MB."""
    mean, std = _imagenet_stats(pixels)
    return pixels.to(torch.float32, copy=True).mul_(std).add_(mean).clamp_(0.0, 1.0)


def fp16_round_trip(latents: torch.Tensor) -> torch.Tensor:
    """Round to float16 and back to float32, as the release stores conditioning latents (~11 bits)."""
    return latents.to(torch.float16).float()


def encode_condition(vae: VideoVAE, frames: torch.Tensor, seed: int = CONDITION_ENCODE_SEED,
                     on_clip: Callable[[int], None] | None = None) -> torch.Tensor:
    """The release's conditioning recipe for keyframes and image / video references.

    frames [1, 3, F, H, W] (uint8 or 0..1; F = 1 for an image, 17n + 5 for a video) -> normalized
    float32 latents [1, C, L, H/16, W/16]: ImageNet-normalize, encode (tiled as configured),
    *sample* the posterior with a fresh CPU generator seeded `seed` (not the request's), round to
    float16 and back, then normalize with latents_mean / latents_std. `on_clip(done)`: the frames encoded
    so far, after each 17-frame clip of a video (progress; a host may raise there to stop).
    """
    moments = vae.encode_moments(frames, prepare=frames_to_model_space, on_clip=on_clip)
    return condition_latents(vae, moments, seed)


def condition_latents(vae: VideoVAE, moments: torch.Tensor, seed: int = CONDITION_ENCODE_SEED) -> torch.Tensor:
    """`encode_condition` after the encoder: moments [1, 2C, L, h, w] -> normalized float32 latents (the
    posterior sampled in one draw over all L, so a video encoded clip by clip gets the same noise)."""
    latents = Posterior.from_moments(moments).sample(torch.Generator().manual_seed(seed))
    return vae.normalize_latents(fp16_round_trip(latents))
