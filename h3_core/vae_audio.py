"""The H3 audio VAE (h3-model.md C): 32 kHz waveforms <-> 40 Hz latents of 32 channels.

Data contract (model space):
- `encode(waveform)`: [2, N] or [B, 2, N] float in [-1, 1] at 32 kHz (left, right) -> normalized latents
  [.., 2, C, A] with C = 32 and A = ceil(N / 800); the waveform is zero right-padded to a multiple of 800.
- `decode(latents)`: normalized latents [.., 2, C, A] -> waveform [.., 2, 800 A] float32, clamped to [-1, 1].
  `decode_windows` yields the same waveform piece by piece from bounded windows.
- Normalization is per channel: `normalized = (posterior_mean - latents_mean) / latents_std`. The DiT's audio
  rows [2A, C] (channel-major: all left rows, then all right rows) are `layout.pack_audio` of [1, 2, C, A].

The model is mono: the two stereo channels are two batch items of one network, never mixed. Encoder: DAC
(weight-normed Conv1d + Snake, strides 2, 4, 4, 5, 5 = hop 800). `pre_block`: a causal-attention projection of
the 2048-wide trunk to the 32 latent channels. The posterior mean (`mean_proj`) is the latent; H3 never samples,
so the log-std head `logs_proj` of the checkpoint is not part of this model. Decoder: `dec_in_proj` then BigVGAN
(transposed-conv upsamplers 5, 5, 2, 2, 2, 2, 2; per stage the average of parallel AMP blocks of anti-aliased
SnakeBeta + dilated convolutions; clamp).

Weight norm: the checkpoints store `weight_g` / `weight_v`; the loader folds each pair once into a plain `weight`
(`g * v / ||v||`, the norm over every dim but 0), which is what the reference recomputes before every forward.
Precision: fp32 throughout. The release is fp32, and diffusers reports decodes about 20 dB quieter when the
Snake / weight-normed stack runs in bf16 (it pins these modules to fp32), so the loader keeps fp32 unless told
otherwise; inputs are cast to the weights' dtype and every output is float32. On CUDA, PyTorch's default lets
cuDNN run fp32 convolutions as TF32 (`torch.backends.cudnn.allow_tf32`); the reference runs under the same
default, and this module leaves that global flag to the caller.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .vae_video import LIBRARY_WORKSPACE_BYTES

SAMPLE_RATE = 32000
STEREO_CHANNELS = 2

# The released per-channel statistics of the posterior mean (audio_vae/config.json of the release).
RELEASED_LATENTS_MEAN = (
    -0.020211687488382354, 0.3876466479950502, -0.04398279799186767, -0.28591514936373,
    0.08179686214561671, -0.35782641352446604, 0.040623809960919084, -0.01552534501956604,
    -0.223362481667332, 0.1821006842509091, 0.2941778783780663, -0.07901167601970885,
    -0.056815072777201, -0.3699028221860095, -0.31616315591624855, 0.5905951377425391,
    -0.052139568068853864, 0.013673160263486295, -0.03691647864630577, 0.09732660653298163,
    -0.3394662328788498, -0.30685677538541667, -0.24504598907458763, -0.034698524462007344,
    0.02868032184767538, -0.21217779266454084, -0.1678263169941987, 0.3221287889040614,
    -0.1223055851554907, 0.4356604928128464, -0.0502599202236253, 0.3979258376211797,
)  # fmt: skip
RELEASED_LATENTS_STD = (
    1.6895524230479284, 2.76263727217653, 1.7945344281264435, 1.6801681847309828,
    1.6390226546605453, 2.7788298348882177, 1.7659090095747236, 1.6199757612137327,
    2.6336525640336896, 1.8539356672817833, 2.5056497896915633, 1.811019237886178,
    1.9579657790720237, 1.6685498243529284, 1.4922469314453364, 3.298670198067373,
    1.9491804496832168, 1.8720003270431442, 1.8334080103291832, 1.6488070416529093,
    1.6176957696319716, 1.9131449234774398, 1.5695245398428617, 1.6943659940415912,
    1.8318420762504692, 1.5540637421583379, 1.9344930328968526, 1.599198216109855,
    1.718045989838149, 1.6307219190837705, 1.8661226051202384, 1.5613768203168363,
)  # fmt: skip

# Fixed by the architecture (not in any config): the DAC residual units, the decoder's outer convolutions and
# BigVGAN's anti-aliased activation (2x Kaiser-sinc up/down-sampling with 12 taps).
RESIDUAL_DILATIONS = (1, 3, 9)
RESIDUAL_KERNEL = 7
DECODER_EDGE_KERNEL = 7  # conv_pre and conv_post
ENCODER_IN_KERNEL, ENCODER_OUT_KERNEL = 7, 3  # the encoder's first and last convolutions
ANTI_ALIAS_RATIO = 2
ANTI_ALIAS_KERNEL = 12  # even: the taps sit at half-integer times
UPSAMPLE_PAD = ANTI_ALIAS_KERNEL // ANTI_ALIAS_RATIO - 1  # 5 replicated input samples each side
UPSAMPLE_TAP_OFFSET = (ANTI_ALIAS_KERNEL - ANTI_ALIAS_RATIO) // 2  # 5
DOWNSAMPLE_PAD_LEFT = ANTI_ALIAS_KERNEL // 2 - 1  # 5 (and 6 on the right)
SNAKE_EPSILON = 1e-9
LAYER_NORM_EPSILON = 1e-5
MLP_RATIO = 2

# Latent frames a windowed decode produces per window: 5 s (plus the receptive field on both sides). The
# BigVGAN activations at 32 kHz set the decoder's memory, so the window, not the clip, sets the peak: a
# minute streams in the memory of five seconds (a whole 15 s stereo decode at the released size peaks at
# 0.3 GiB of fp32 activations on an H200; the 29-latent context costs ~30% more decoder work).
DECODE_WINDOW_LATENTS = 200
# The encoder's trunk runs in windows too: its first stages hold 64-128 channels at 32 kHz, so one pass
# over a 20 s stereo track at the released size took 1.54 GiB (CPU, fp32) and a 300 s driving soundtrack
# would take ~23 GiB; in 10 s windows (with 12 frames of context each side) 0.81 GiB whatever the length,
# bitwise equal on the CPU. Only the trunk is windowed: the causal attention after it sees every frame.
ENCODE_WINDOW_LATENTS = 400


def context_windows(frames: int, window: int, context: int = 0) -> list[tuple[int, int, int, int]]:
    """(start, stop, first, last) of each window over `frames` latent frames: it makes [start, stop), computed
    over [first, last), with `context` frames of its neighbours on each side. The encoder's trunk and the
    decoder go through them; a host counts them for a progress bar."""
    return [(start, min(start + window, frames), max(0, start - context), min(frames, start + window + context))
            for start in range(0, frames, window)]


@dataclass(frozen=True)
class AudioVAEConfig:
    """Shape of the audio VAE. Defaults are the release; field names follow diffusers' config.json."""

    encoder_dim: int = 64
    encoder_rates: tuple[int, ...] = (2, 4, 4, 5, 5)
    latent_dim: int = 2048
    latent_channels: int = 32
    num_attention_heads: int = 8
    decoder_dim: int = 1024
    decoder_rates: tuple[int, ...] = (5, 5, 2, 2, 2, 2, 2)
    decoder_kernel_sizes: tuple[int, ...] = (9, 9, 4, 4, 4, 4, 4)
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    sample_rate: int = SAMPLE_RATE
    latents_mean: tuple[float, ...] = RELEASED_LATENTS_MEAN
    latents_std: tuple[float, ...] = RELEASED_LATENTS_STD

    def __post_init__(self):
        def ints(values):
            return tuple(int(v) for v in values)

        object.__setattr__(self, "encoder_rates", ints(self.encoder_rates))
        object.__setattr__(self, "decoder_rates", ints(self.decoder_rates))
        object.__setattr__(self, "decoder_kernel_sizes", ints(self.decoder_kernel_sizes))
        object.__setattr__(self, "resblock_kernel_sizes", ints(self.resblock_kernel_sizes))
        object.__setattr__(self, "resblock_dilation_sizes", tuple(ints(d) for d in self.resblock_dilation_sizes))
        object.__setattr__(self, "latents_mean", tuple(float(v) for v in self.latents_mean))
        object.__setattr__(self, "latents_std", tuple(float(v) for v in self.latents_std))
        problems = []
        if math.prod(self.decoder_rates) != self.hop_length:
            problems.append(f"decoder_rates {self.decoder_rates} must upsample by the hop {self.hop_length}")
        if len(self.decoder_kernel_sizes) != len(self.decoder_rates):
            problems.append("decoder_kernel_sizes needs one kernel per decoder rate")
        if self.decoder_dim % 2 ** len(self.decoder_rates):
            problems.append(f"decoder_dim {self.decoder_dim} must halve {len(self.decoder_rates)} times")
        if len(self.resblock_dilation_sizes) != len(self.resblock_kernel_sizes):
            problems.append("resblock_dilation_sizes needs one dilation list per resblock kernel")
        if self.latent_dim % self.latent_channels or self.latent_dim % self.num_attention_heads:
            problems.append(
                f"latent_dim {self.latent_dim} must be a multiple of latent_channels ({self.latent_channels}) "
                f"and of num_attention_heads ({self.num_attention_heads})"
            )
        if len(self.latents_mean) != self.latent_channels or len(self.latents_std) != self.latent_channels:
            problems.append(f"latents_mean and latents_std need {self.latent_channels} values each")
        if any(not std > 0 for std in self.latents_std):
            problems.append("latents_std must be positive")
        if problems:
            raise ValueError("Invalid audio VAE config: " + "; ".join(problems) + ".")

    @property
    def hop_length(self) -> int:
        """Waveform samples per latent frame: 800 at the release (40 latents per second at 32 kHz)."""
        return math.prod(self.encoder_rates)

    @classmethod
    def from_dict(cls, raw: dict) -> AudioVAEConfig:
        """From a diffusers-style dict (`sampling_rate` is diffusers' spelling of `sample_rate`); unknown keys
        (class names, versions) are ignored."""
        fields = set(cls.__dataclass_fields__)
        values = {("sample_rate" if key == "sampling_rate" else key): value for key, value in raw.items()}
        return cls(**{key: value for key, value in values.items() if key in fields})


# ----------------------------------------------------------------------------------------------
# Activations


class Snake(nn.Module):
    """DAC's Snake on [B, C, T]: `x + sin(alpha x)^2 / alpha`, `alpha` [1, C, 1] stored as is."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.empty(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.alpha + SNAKE_EPSILON).reciprocal() * torch.sin(self.alpha * x).pow(2)


class SnakeBeta(nn.Module):
    """BigVGAN's SnakeBeta on [B, C, T]: `x + sin(e^alpha x)^2 / e^beta`; `alpha`, `beta` [C] in log space."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.empty(channels))
        self.beta = nn.Parameter(torch.empty(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frequency = self.alpha.exp()[None, :, None]
        magnitude = self.beta.exp()[None, :, None]
        return x + (magnitude + SNAKE_EPSILON).reciprocal() * torch.sin(frequency * x).pow(2)


def kaiser_sinc_lowpass(cutoff: float, half_width: float, kernel_size: int) -> torch.Tensor:
    """A Kaiser-windowed sinc low-pass filter [kernel_size], float32, summing to 1.

    The design of alias-free-torch, which BigVGAN was trained with: Kaiser's empirical beta for the attenuation
    of a transition band `half_width` wide; for an even size the taps sit at half-integer times. The arithmetic
    order matches it, so the taps equal the checkpoint's stored `filter` buffers.
    """
    half_size = kernel_size // 2
    attenuation = 2.285 * (half_size - 1) * math.pi * (4 * half_width) + 7.95
    if attenuation > 50.0:
        beta = 0.1102 * (attenuation - 8.7)
    elif attenuation >= 21.0:
        beta = 0.5842 * (attenuation - 21) ** 0.4 + 0.07886 * (attenuation - 21.0)
    else:
        beta = 0.0
    window = torch.kaiser_window(kernel_size, beta=beta, periodic=False, device="cpu")
    if kernel_size % 2 == 0:
        times = torch.arange(-half_size, half_size, device="cpu") + 0.5
    else:
        times = torch.arange(kernel_size, device="cpu") - half_size
    taps = 2 * cutoff * window * torch.sinc(2 * cutoff * times)
    return taps / taps.sum()  # unit DC gain: a constant passes through the resampler unchanged


class KaiserFilter(nn.Module):
    """The fixed Kaiser-sinc low-pass both 2x resamplers use (a function of the architecture, kept as a
    non-persistent buffer)."""

    def __init__(self):
        super().__init__()
        taps = kaiser_sinc_lowpass(0.5 / ANTI_ALIAS_RATIO, 0.6 / ANTI_ALIAS_RATIO, ANTI_ALIAS_KERNEL)
        self.register_buffer("filter", taps.view(1, 1, -1), persistent=False)


class KaiserUpsample(KaiserFilter):
    """Depthwise 2x upsampling through the Kaiser low-pass: [B, C, T] -> [B, C, 2T].

    Edges are replicate-padded by `UPSAMPLE_PAD` input samples and the transposed convolution's overhang is
    cropped; output sample n reads input samples m with n = 2m - UPSAMPLE_TAP_OFFSET + j, j < 12. The filter
    (cutoff 0.25, transition band 0.3 of the high rate) is a function of the architecture, not learnt: a
    non-persistent buffer (the loader checks the checkpoints' copies against it).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels = x.shape[1]
        x = F.pad(x, (UPSAMPLE_PAD, UPSAMPLE_PAD), mode="replicate")
        taps = self.filter.to(x.dtype).expand(channels, -1, -1)
        # The filter has unit DC gain at the high rate; the ratio restores the level of the zero-stuffed signal.
        x = ANTI_ALIAS_RATIO * F.conv_transpose1d(x, taps, stride=ANTI_ALIAS_RATIO, groups=channels)
        crop = UPSAMPLE_PAD * ANTI_ALIAS_RATIO + UPSAMPLE_TAP_OFFSET
        return x[..., crop : x.shape[-1] - crop]


class KaiserDownsample(KaiserFilter):
    """Depthwise Kaiser low-pass then 2x decimation: [B, C, 2T] -> [B, C, T], replicate-padded edges; output
    sample q reads input samples 2q - DOWNSAMPLE_PAD_LEFT + j, j < 12."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels = x.shape[1]
        x = F.pad(x, (DOWNSAMPLE_PAD_LEFT, ANTI_ALIAS_KERNEL - 1 - DOWNSAMPLE_PAD_LEFT), mode="replicate")
        taps = self.filter.to(x.dtype).expand(channels, -1, -1)
        return F.conv1d(x, taps, stride=ANTI_ALIAS_RATIO, groups=channels)


class AntiAliasedSnakeBeta(nn.Module):
    """SnakeBeta evaluated at twice the rate (upsample, activate, downsample), so the harmonics the periodic
    nonlinearity creates above the Nyquist frequency are filtered instead of folding back as aliases."""

    def __init__(self, channels: int):
        super().__init__()
        self.act = SnakeBeta(channels)
        self.upsample = KaiserUpsample()
        self.downsample = KaiserDownsample()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.downsample(self.act(self.upsample(x)))


# ----------------------------------------------------------------------------------------------
# Encoder: DAC


def same_padding(kernel_size: int, dilation: int = 1) -> int:
    """Padding that keeps the length of an odd-kernel convolution."""
    return (kernel_size - 1) * dilation // 2


def downsample_padding(stride: int) -> int:
    """Padding of an encoder block's strided convolution (kernel 2 stride): the length divides exactly."""
    return math.ceil(stride / 2)


class ResidualUnit(nn.Module):
    """`x + conv1x1(snake(conv7_dilated(snake(x))))`; the padding keeps the length, so no crop is needed."""

    def __init__(self, channels: int, dilation: int):
        super().__init__()
        self.block = nn.Sequential(
            Snake(channels),
            nn.Conv1d(
                channels, channels, RESIDUAL_KERNEL, dilation=dilation, padding=same_padding(RESIDUAL_KERNEL, dilation)
            ),
            Snake(channels),
            nn.Conv1d(channels, channels, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


class EncoderBlock(nn.Module):
    """Three residual units (dilations 1, 3, 9) at `channels // 2`, then Snake and a strided convolution
    (kernel 2s, padding ceil(s/2)) that doubles the channels and divides the length by the stride s."""

    def __init__(self, channels: int, stride: int):
        super().__init__()
        half = channels // 2
        self.block = nn.Sequential(
            *(ResidualUnit(half, dilation) for dilation in RESIDUAL_DILATIONS),
            Snake(half),
            nn.Conv1d(half, channels, 2 * stride, stride=stride, padding=downsample_padding(stride)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class Encoder(nn.Module):
    """[B, 1, N] (N a multiple of the hop) -> [B, latent_dim, N / hop]."""

    def __init__(self, config: AudioVAEConfig):
        super().__init__()
        width = config.encoder_dim
        layers: list[nn.Module] = [nn.Conv1d(1, width, ENCODER_IN_KERNEL, padding=same_padding(ENCODER_IN_KERNEL))]
        for stride in config.encoder_rates:
            width *= 2
            layers.append(EncoderBlock(width, stride))
        layers += [Snake(width), nn.Conv1d(width, config.latent_dim, ENCODER_OUT_KERNEL,
                                           padding=same_padding(ENCODER_OUT_KERNEL))]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


# ----------------------------------------------------------------------------------------------
# pre_block: causal-attention projection latent_dim -> latent_channels


class NarrowingCausalAttention(nn.Module):
    """Causal self-attention over time whose heads are averaged, not concatenated: [B, T, D] -> [B, T, C].

    qkv is one bias-less Linear(D, 3D); the q and v biases are parameters and the k bias a stored zero buffer
    (`zero_k_bias`, kept because the checkpoints carry it). After causal SDPA ([B, H, T, D/H], scale
    1/sqrt(D/H)) the H heads are averaged to [B, T, D/H], adjacent features are average-pooled down to C,
    then Linear(C, C). Causal: a latent frame attends to itself and earlier frames only.
    """

    def __init__(self, in_dim: int, out_dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.out_dim = out_dim
        self.qkv = nn.Linear(in_dim, 3 * in_dim, bias=False)
        self.q_bias = nn.Parameter(torch.empty(in_dim))
        self.v_bias = nn.Parameter(torch.empty(in_dim))
        self.register_buffer("zero_k_bias", torch.empty(in_dim))
        self.proj = nn.Linear(out_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, frames, width = x.shape
        bias = torch.cat((self.q_bias, self.zero_k_bias, self.v_bias))
        qkv = F.linear(x, self.qkv.weight, bias).view(batch, frames, 3, self.num_heads, width // self.num_heads)
        query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, T, D/H]
        attended = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        pooled = F.adaptive_avg_pool1d(attended.mean(dim=1), self.out_dim)
        return self.proj(pooled)


class GeGLU(nn.Module):
    """`w2(gelu_tanh(w0(n)) * w1(n))` with n = its own LayerNorm of the input (a second norm in the reference,
    on top of the block's `norm2`)."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(width, eps=LAYER_NORM_EPSILON)
        self.w0 = nn.Linear(width, hidden)
        self.w1 = nn.Linear(width, hidden)
        self.w2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        return self.w2(F.gelu(self.w0(x), approximate="tanh") * self.w1(x))


class AttentionProjection(nn.Module):
    """[B, T, latent_dim] -> [B, T, latent_channels]: `y = proj(norm3(x)) + attn(norm1(x))`,
    then `y + mlp(norm2(y))`."""

    def __init__(self, in_dim: int, out_dim: int, num_heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(in_dim, eps=LAYER_NORM_EPSILON)
        self.attn = NarrowingCausalAttention(in_dim, out_dim, num_heads)
        self.proj = nn.Linear(in_dim, out_dim)
        self.norm3 = nn.LayerNorm(in_dim, eps=LAYER_NORM_EPSILON)
        self.norm2 = nn.LayerNorm(out_dim, eps=LAYER_NORM_EPSILON)
        self.mlp = GeGLU(out_dim, MLP_RATIO * out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(self.norm3(x)) + self.attn(self.norm1(x))
        return y + self.mlp(self.norm2(y))


# ----------------------------------------------------------------------------------------------
# Decoder: BigVGAN


class AMPBlock(nn.Module):
    """Anti-aliased multi-periodicity block: for each dilation d in turn,
    `x = x + conv_k(act(conv_k_dilated_d(act(x))))`, every convolution behind its own anti-aliased SnakeBeta."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]):
        super().__init__()
        self.convs1 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, dilation=d, padding=same_padding(kernel_size, d))
            for d in dilations
        )
        self.convs2 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, padding=same_padding(kernel_size)) for _ in dilations
        )
        # Checkpoint order: activations[2i] precedes convs1[i], activations[2i + 1] precedes convs2[i].
        self.activations = nn.ModuleList(AntiAliasedSnakeBeta(channels) for _ in range(2 * len(dilations)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, (dilated, plain) in enumerate(zip(self.convs1, self.convs2)):
            x = x + plain(self.activations[2 * i + 1](dilated(self.activations[2 * i](x))))
        return x


class BigVGANDecoder(nn.Module):
    """[B, latent_dim, A] -> [B, 1, hop A] in [-1, 1].

    conv_pre (k7) to decoder_dim; per stage a transposed convolution (rate u, kernel k, padding (k - u) // 2)
    halving the channels, then the mean of the parallel AMP blocks; anti-aliased SnakeBeta, conv_post (k7, no
    bias), clamp. Each upsampler sits alone in a ModuleList, as in the checkpoint (`ups.<i>.0`).
    """

    def __init__(self, config: AudioVAEConfig):
        super().__init__()
        width = config.decoder_dim
        edge_padding = same_padding(DECODER_EDGE_KERNEL)
        self.conv_pre = nn.Conv1d(config.latent_dim, width, DECODER_EDGE_KERNEL, padding=edge_padding)
        self.ups = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        for rate, kernel in zip(config.decoder_rates, config.decoder_kernel_sizes):
            upsampler = nn.ConvTranspose1d(width, width // 2, kernel, rate, padding=(kernel - rate) // 2)
            self.ups.append(nn.ModuleList([upsampler]))
            width //= 2
            for block_kernel, dilations in zip(config.resblock_kernel_sizes, config.resblock_dilation_sizes):
                self.resblocks.append(AMPBlock(width, block_kernel, dilations))
        self.blocks_per_stage = len(config.resblock_kernel_sizes)
        self.activation_post = AntiAliasedSnakeBeta(width)
        self.conv_post = nn.Conv1d(width, 1, DECODER_EDGE_KERNEL, padding=edge_padding, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_pre(x)
        for stage, upsampler in enumerate(self.ups):
            x = upsampler[0](x)
            blocks = self.resblocks[stage * self.blocks_per_stage : (stage + 1) * self.blocks_per_stage]
            total = blocks[0](x)
            for block in blocks[1:]:
                total = total + block(x)
            x = total / self.blocks_per_stage
        x = self.conv_post(self.activation_post(x))
        return x.clamp(-1.0, 1.0)


# ----------------------------------------------------------------------------------------------
# Receptive fields: the context that makes windowed encodes and decodes equal one pass


def _conv_inputs(span: tuple[int, int], kernel: int, stride: int, dilation: int, padding: int) -> tuple[int, int]:
    """Input samples (unpadded coordinates) that output samples `span` of a convolution read."""
    first, last = span
    return stride * first - padding, stride * last - padding + (kernel - 1) * dilation


def _transposed_conv_inputs(span: tuple[int, int], kernel: int, stride: int, padding: int) -> tuple[int, int]:
    """Input samples that output samples `span` of a transposed convolution read (n = stride m - padding + j)."""
    first, last = span
    return -((kernel - 1 - first - padding) // stride), (last + padding) // stride


def _frames_beyond(span: tuple[int, int], density: int) -> int:
    """How many latent frames beyond latent frame 0 samples `span` reach, on a grid of `density` samples a frame."""
    first, last = span
    return max(-(first // density), -(-(last + 1) // density) - 1)


def encode_context(config: AudioVAEConfig) -> int:
    """Latent frames of context on each side that make a windowed encoder trunk equal the whole trunk.

    Traces, backwards from one latent frame through every convolution of the trunk, which samples it reads
    on each layer's own grid; windows start on latent frames, so every grid lines up with the whole
    pass, and only the zeros a window pads at its edges differ. 12 at the release."""
    density, span = 1, (0, 0)
    span = _conv_inputs(span, ENCODER_OUT_KERNEL, 1, 1, same_padding(ENCODER_OUT_KERNEL))
    needed = _frames_beyond(span, density)
    for stride in reversed(config.encoder_rates):
        density *= stride
        span = _conv_inputs(span, 2 * stride, stride, 1, downsample_padding(stride))
        needed = max(needed, _frames_beyond(span, density))
        for dilation in reversed(RESIDUAL_DILATIONS):  # residual: the identity path reads the span itself too
            inner = _conv_inputs(span, RESIDUAL_KERNEL, 1, dilation, same_padding(RESIDUAL_KERNEL, dilation))
            span = (min(span[0], inner[0]), max(span[1], inner[1]))
            needed = max(needed, _frames_beyond(span, density))
    span = _conv_inputs(span, ENCODER_IN_KERNEL, 1, 1, same_padding(ENCODER_IN_KERNEL))
    return max(needed, _frames_beyond(span, density))


def encode_working_bytes(config: AudioVAEConfig, samples: int, channels: int = STEREO_CHANNELS,
                         dtype_bytes: int = 4) -> int:
    """Device memory `AudioVAE.encode` of a `channels` x `samples` track needs besides the weights (in bytes
    of the VAE's dtype, float32 by default), so a host can free weights + this first. An upper bound read off
    the code:

    - the track on the device and its copy padded to the hop;
    - the trunk, one window at a time (`ENCODE_WINDOW_LATENTS` plus the context each side): at most five of
      its largest activations at once (a block's input, a residual unit's input, the dilated conv's output
      and two of Snake's temporaries), beside the finished windows' outputs;
    - then the attention projection over every latent frame: the trunk, its norm, q, k and v, the attention
      output and, should a kernel want them contiguous, copies of q, k and v (nine trunk-sized tensors);
    - besides: the math libraries' workspaces (`LIBRARY_WORKSPACE_BYTES`) under cuDNN's heuristics (torch's
      default, and ComfyUI's but for `--fast autotune`: benchmarked kernels took up to 0.47 GiB more here).

    bench/vae_encode_memory.py checks it on the H200 against the peak allocated less the weights: a 20 s track
    0.80 GiB measured, 0.89 bound; 120 s 0.91 and 1.00."""
    if samples < 1 or channels < 1:
        raise ValueError(f"An encode needs a sound, got {channels} channels of {samples} samples.")
    hop = config.hop_length
    frames = math.ceil(samples / hop)
    track = channels * frames * hop * dtype_bytes
    window = (min(frames, ENCODE_WINDOW_LATENTS) + 2 * encode_context(config)) * hop
    width, length, largest = config.encoder_dim, window, config.encoder_dim * window
    for stride in config.encoder_rates:  # each block's residual units run at half its width, before its stride
        largest = max(largest, width * length)
        width, length = 2 * width, math.ceil(length / stride)
    trunk = channels * config.latent_dim * frames * dtype_bytes
    windows = 5 * channels * largest * dtype_bytes + trunk
    return LIBRARY_WORKSPACE_BYTES + 2 * track + max(windows, 9 * trunk)

def decode_context(config: AudioVAEConfig) -> int:
    """Latent frames of context on each side that make a windowed decode equal the whole decode.

    Traces, backwards through every layer of the decoder, which samples the output samples of one latent frame
    read, on each layer's own grid (`density` samples per latent frame; twice that inside an anti-aliased
    activation). A window's layers only see the window's samples and pad the rest (zeros or replicated edges),
    so the context must cover the read span on *every* grid, not only on the latent one. 29 at the release.
    """
    needed = 0

    def reads(span: tuple[int, int], density: int) -> tuple[int, int]:
        nonlocal needed
        needed = max(needed, _frames_beyond(span, density))
        return span

    def through_activation(span, density):  # backwards: the downsampler, then the upsampler
        span = _conv_inputs(span, ANTI_ALIAS_KERNEL, ANTI_ALIAS_RATIO, 1, DOWNSAMPLE_PAD_LEFT)
        span = reads(span, ANTI_ALIAS_RATIO * density)
        span = _transposed_conv_inputs(span, ANTI_ALIAS_KERNEL, ANTI_ALIAS_RATIO, UPSAMPLE_TAP_OFFSET)
        return reads(span, density)

    def through_conv(span, density, kernel, dilation=1):
        return reads(_conv_inputs(span, kernel, 1, dilation, same_padding(kernel, dilation)), density)

    density = config.hop_length
    span = reads((0, density - 1), density)
    span = through_activation(through_conv(span, density, DECODER_EDGE_KERNEL), density)
    for rate, kernel in reversed(list(zip(config.decoder_rates, config.decoder_kernel_sizes))):
        block_spans = []
        for block_kernel, dilations in zip(config.resblock_kernel_sizes, config.resblock_dilation_sizes):
            block_span = span
            for dilation in reversed(dilations):  # residual: the identity path reads the span itself too
                inner = through_conv(block_span, density, block_kernel)
                inner = through_conv(through_activation(inner, density), density, block_kernel, dilation)
                inner = through_activation(inner, density)
                block_span = (min(block_span[0], inner[0]), max(block_span[1], inner[1]))
            block_spans.append(block_span)
        span = (min(s[0] for s in block_spans), max(s[1] for s in block_spans))
        density //= rate
        span = reads(_transposed_conv_inputs(span, kernel, rate, (kernel - rate) // 2), density)
    through_conv(span, density, DECODER_EDGE_KERNEL)
    return needed


# ----------------------------------------------------------------------------------------------
# The autoencoder


class AudioVAE(nn.Module):
    """The H3 audio VAE; see the module docstring for the data contract."""

    def __init__(self, config: AudioVAEConfig = AudioVAEConfig()):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.pre_block = AttentionProjection(config.latent_dim, config.latent_channels, config.num_attention_heads)
        self.mean_proj = nn.Conv1d(config.latent_channels, config.latent_channels, 1)
        self.dec_in_proj = nn.Conv1d(config.latent_channels, config.latent_dim, 1)
        self.decoder = BigVGANDecoder(config)
        self.encode_context = encode_context(config)
        self.decode_context = decode_context(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.mean_proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.mean_proj.weight.device

    # Mono, unnormalized: what the network itself computes.

    @torch.no_grad()
    def encode_mono(self, waveform: torch.Tensor) -> torch.Tensor:
        """[B, 1, N] -> posterior mean [B, C, ceil(N / hop)] float32, after zero right-padding to the hop."""
        hop = self.config.hop_length
        waveform = F.pad(waveform.to(self.device, self.dtype), (0, -waveform.shape[-1] % hop))
        trunk = self.encode_trunk(waveform)  # [B, latent_dim, A]
        projected = self.pre_block(trunk.transpose(1, 2)).transpose(1, 2)  # [B, C, A]
        return self.mean_proj(projected).float()

    @torch.no_grad()
    def encode_trunk(self, waveform: torch.Tensor, window: int = ENCODE_WINDOW_LATENTS,
                     context: int | None = None) -> torch.Tensor:
        """The convolutional encoder over [B, 1, hop A] -> [B, latent_dim, A], `window` latent frames at a
        time, each computed with `context` frames of its neighbours (default: `encode_context`, the trunk's
        receptive field): equal to one pass to float rounding, in the memory of one window."""
        if window < 1:
            raise ValueError(f"window must be at least one latent frame, got {window}.")
        hop, context = self.config.hop_length, self.encode_context if context is None else context
        frames = waveform.shape[-1] // hop
        pieces = []
        for start, stop, first, last in context_windows(frames, window, context):
            pieces.append(self.encoder(waveform[..., first * hop : last * hop])[..., start - first : stop - first])
        return torch.cat(pieces, dim=-1)

    @torch.no_grad()
    def decode_mono(self, latents: torch.Tensor) -> torch.Tensor:
        """Posterior-space latents [B, C, A] -> waveform [B, 1, hop A] float32 in [-1, 1], in one pass."""
        latents = latents.to(self.device, self.dtype)
        return self.decoder(self.dec_in_proj(latents)).float()

    # Stereo, normalized: the model space the DiT works in.

    def _statistics(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        mean = torch.tensor(self.config.latents_mean, dtype=torch.float32, device=device)[:, None]
        std = torch.tensor(self.config.latents_std, dtype=torch.float32, device=device)[:, None]
        return mean, std

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        """Posterior means [.., C, A] -> normalized latents, float32: `(x - latents_mean) / latents_std`."""
        mean, std = self._statistics(latents.device)
        return (latents.float() - mean) / std

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalized latents [.., C, A] -> posterior space, float32: `x * latents_std + latents_mean`."""
        mean, std = self._statistics(latents.device)
        return latents.float() * std + mean

    def encode(self, waveform: torch.Tensor) -> torch.Tensor:
        """Stereo waveform [2, N] or [B, 2, N] at the config's sample rate -> normalized latents [.., 2, C, A]."""
        if waveform.ndim not in (2, 3) or waveform.shape[-2] != STEREO_CHANNELS or waveform.shape[-1] == 0:
            raise ValueError(
                f"encode takes a stereo waveform [2, N] or [B, 2, N] with N > 0, got {list(waveform.shape)}; "
                "repeat a mono channel to make it stereo, as the reference does."
            )
        lead = waveform.shape[:-2]
        posterior = self.encode_mono(waveform.reshape(-1, 1, waveform.shape[-1]))
        return self.normalize(posterior).reshape(*lead, STEREO_CHANNELS, *posterior.shape[1:])

    def decode_windows(
        self, latents: torch.Tensor, window: int = DECODE_WINDOW_LATENTS, context: int | None = None
    ) -> Iterator[torch.Tensor]:
        """Yield the waveform of normalized latents [.., 2, C, A] in order, `window` latent frames
        (hop * window samples, [.., 2, hop * window]) at a time; the last piece may be shorter.

        Each window is decoded with `context` latent frames of its neighbours on both sides (default: the
        decoder's receptive field, `decode_context`), which makes the concatenated pieces equal the whole decode
        to float rounding. Memory is bounded by `window + 2 * context` frames whatever the length.
        """
        if latents.ndim not in (3, 4) or latents.shape[-3:-1] != (STEREO_CHANNELS, self.config.latent_channels):
            raise ValueError(
                f"decode takes normalized latents [2, {self.config.latent_channels}, A] or "
                f"[B, 2, {self.config.latent_channels}, A], got {list(latents.shape)}."
            )
        if window < 1:
            raise ValueError(f"window must be at least one latent frame, got {window}.")
        context = self.decode_context if context is None else context
        lead, frames, hop = latents.shape[:-3], latents.shape[-1], self.config.hop_length
        mono = self.denormalize(latents).reshape(-1, self.config.latent_channels, frames)
        for start, stop, first, last in context_windows(frames, window, context):
            waveform = self.decode_mono(mono[..., first:last])
            piece = waveform[..., (start - first) * hop : (stop - first) * hop]
            yield piece.reshape(*lead, STEREO_CHANNELS, piece.shape[-1]).contiguous()

    def decode(self, latents: torch.Tensor, window: int = DECODE_WINDOW_LATENTS) -> torch.Tensor:
        """Normalized latents [.., 2, C, A] -> waveform [.., 2, hop A] float32 in [-1, 1] (windowed, exact)."""
        return torch.cat(list(self.decode_windows(latents, window)), dim=-1)
