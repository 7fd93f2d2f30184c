"""The audio VAE against diffusers' AutoencoderKLMiniMaxH3Audio and the H3 pipeline blocks around it, and the
windowed decode against the whole decode.

Tolerance: both sides run the same fp32 operations on bit-identical weights (the loader folds weight norm with
torch's own kernel), so on one machine the results agree to the bit or within a few ulps where a kernel blocks
its sums differently (attention on differently strided views, convolutions over different lengths). 1e-5
absolute, on values of order 1, leaves room for that and for other CPUs, and still fails at any real mistake.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from audio_vae_checkpoints import TINY_AUDIO_VAE, reference_audio_vae, write_diffusers_folder
from diffusers.modular_pipelines import SequentialPipelineBlocks
from diffusers.modular_pipelines.minimax_h3.decoders import MiniMaxH3AfterDenoiseStep, MiniMaxH3AudioDecodeStep
from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VAReferenceEncoderStep
from diffusers.modular_pipelines.minimax_h3.references import MiniMaxH3AudioReference
from torch import nn

from h3_core.layout import pack_audio, unpack_audio
from h3_core.vae_audio import AudioVAEConfig, KaiserDownsample, KaiserUpsample, decode_context, encode_context
from h3_core.vae_audio_checkpoint import load_audio_vae

ATOL = 1e-5
HOP = 800


@pytest.fixture(scope="module")
def reference():
    model = reference_audio_vae(TINY_AUDIO_VAE, seed=3)
    with torch.no_grad():  # a louder output stage, so part of every decode is clamped to [-1, 1]
        model.decoder.conv_post.weight_g.mul_(8.0)
    return model


@pytest.fixture(scope="module")
def ours(reference, tmp_path_factory):
    folder = write_diffusers_folder(tmp_path_factory.mktemp("vae") / "audio_vae", reference)
    return load_audio_vae(folder)


@pytest.fixture(scope="module")
def waveform():
    """1.47 s of stereo at 32 kHz, not a whole number of hops (47,123 samples -> 59 latents)."""
    generator = torch.Generator().manual_seed(5)
    time = torch.arange(47_123) / 32_000
    tones = torch.stack([torch.sin(2 * math.pi * 220 * time), torch.sin(2 * math.pi * 331 * time + 1)])
    return (0.6 * tones + 0.3 * torch.rand(2, time.numel(), generator=generator) - 0.15).clamp(-1, 1)


@pytest.fixture(scope="module")
def rows():
    """Denoised audio rows as the DiT leaves them: [2A, 32], channel-major (left rows, then right rows)."""
    return torch.randn(2 * 60, 32, generator=torch.Generator().manual_seed(6))


def test_posterior_mean_matches_reference(reference, ours, waveform):
    expected = reference.encode(waveform[:, None]).latent_dist.mode()
    got = ours.encode_mono(waveform[:, None])
    assert got.shape == (2, 32, math.ceil(waveform.shape[-1] / HOP)) == expected.shape
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_encode_matches_reference_pipeline(reference, ours, waveform):
    """The Ref2VA reference-encoder block: stereo as two batch items, posterior mean, normalization, [2A, 32]."""
    block = MiniMaxH3Ref2VAReferenceEncoderStep().init_pipeline()
    block.update_components(audio_vae=reference)
    reference_audio = MiniMaxH3AudioReference(audio=waveform, sample_rate=32_000)
    (expected,) = block(normalized_references=[reference_audio], output="audio_condition_latents")
    latents = ours.encode(waveform)
    assert latents.shape == (2, 32, 59)
    torch.testing.assert_close(pack_audio(latents[None])[0], expected, atol=ATOL, rtol=0)


def test_encode_zero_pads_to_the_hop_and_batches(ours, waveform):
    padded = F.pad(waveform, (0, -waveform.shape[-1] % HOP))
    assert torch.equal(ours.encode(waveform), ours.encode(padded))
    swapped = waveform.flip(0)
    batch = ours.encode(torch.stack([waveform, swapped]))  # [B, 2, N]: every item and channel on its own
    assert batch.shape == (2, 2, 32, 59)
    torch.testing.assert_close(batch[0], ours.encode(waveform), atol=ATOL, rtol=0)
    torch.testing.assert_close(batch[1], batch[0].flip(0), atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kaiser_resampling_keeps_constants_and_the_reference_taps(reference, dtype):
    """The filters are computed, not loaded: they equal the reference's buffers bit for bit, and with unit DC
    gain (and replicated edges) a constant signal passes the 2x up- and downsampler unchanged, in any dtype."""
    activation = reference.decoder.activation_post
    assert torch.equal(KaiserUpsample().filter, activation.upsample.filter)
    assert torch.equal(KaiserDownsample().filter, activation.downsample.lowpass.filter)
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3  # a few bf16 roundings of taps and sums
    constant = torch.full((1, 3, 16), 0.375, dtype=dtype)
    upsampled = KaiserUpsample()(constant)
    assert upsampled.shape == (1, 3, 32) and upsampled.dtype == dtype
    torch.testing.assert_close(upsampled.float(), torch.full((1, 3, 32), 0.375), atol=tolerance, rtol=0)
    torch.testing.assert_close(KaiserDownsample()(upsampled).float(), constant.float(), atol=tolerance, rtol=0)


def test_encode_and_decode_refuse_other_layouts(ours, waveform):
    for bad in (waveform[:1], waveform[0], waveform[:, :0]):
        with pytest.raises(ValueError, match="stereo waveform"):
            ours.encode(bad)
    with pytest.raises(ValueError, match=r"normalized latents \[2, 32, A\]"):
        ours.decode(torch.zeros(32, 2, 10))


def test_decode_matches_reference_pipeline(reference, ours, rows):
    """After-denoise (rows -> [2, 32, A]) and audio-decode blocks (denormalize, decode, [1, 2, 800A], clamp)."""
    blocks = SequentialPipelineBlocks.from_blocks_dict(
        {"after_denoise": MiniMaxH3AfterDenoiseStep(), "decode": MiniMaxH3AudioDecodeStep()}
    ).init_pipeline()
    blocks.update_components(audio_vae=reference)
    expected = blocks(
        latents=torch.zeros(4, 96),  # one 2x2 latent frame of video rows, which the audio path ignores
        num_latent_frames=1,
        latent_height=2,
        latent_width=2,
        audio_latents=rows,
        num_audio_latents=60,
        output="audio",
    )
    waveform = ours.decode(unpack_audio(rows[None]))
    assert waveform.shape == expected.shape == (1, 2, 60 * HOP)
    assert waveform.dtype == torch.float32
    clipped = waveform.abs() == 1.0
    assert 0 < clipped.float().mean() < 0.5  # the clamp is exercised, the rest is signal
    torch.testing.assert_close(waveform, expected, atol=ATOL, rtol=0)


def test_windowed_decode_equals_whole_decode(ours):
    latents = torch.randn(2, 32, 90, generator=torch.Generator().manual_seed(8))  # unbatched stereo
    whole = ours.decode_mono(ours.denormalize(latents))[:, 0]  # one pass over all 90 frames
    # Windows 0-35, 35-70, 70-90, decoded from frames 0-64, 6-90 and 41-90 (29 frames of context).
    pieces = list(ours.decode_windows(latents, window=35))
    assert [piece.shape for piece in pieces] == [(2, 35 * HOP), (2, 35 * HOP), (2, 20 * HOP)]
    torch.testing.assert_close(torch.cat(pieces, dim=-1), whole, atol=ATOL, rtol=0)


def test_decode_context_is_exactly_the_receptive_field(ours):
    """Emulate one window on the whole decode: every layer's input outside the window (on that layer's own grid)
    becomes NaN, which poisons every output sample that reads it. With the computed context the window's core
    frame stays clean; one frame less and it is poisoned."""
    assert ours.decode_context == decode_context(AudioVAEConfig()) == 29  # the tiny model keeps the release's geometry
    frames, core = 70, 35
    latents = torch.randn(1, 32, frames, generator=torch.Generator().manual_seed(7))

    def core_is_clean(context: int) -> bool:
        def outside_window_to_nan(module, inputs):
            (x,) = inputs
            density = x.shape[-1] // frames  # samples per latent frame on this layer's grid
            x = x.clone()
            x[..., : (core - context) * density] = float("nan")
            x[..., (core + 1 + context) * density :] = float("nan")
            return (x,)

        kinds = (nn.Conv1d, nn.ConvTranspose1d, KaiserUpsample, KaiserDownsample)
        layers = [ours.dec_in_proj] + [module for module in ours.decoder.modules() if isinstance(module, kinds)]
        hooks = [layer.register_forward_pre_hook(outside_window_to_nan) for layer in layers]
        try:
            waveform = ours.decode_mono(latents)
        finally:
            for hook in hooks:
                hook.remove()
        return not waveform[..., core * HOP : (core + 1) * HOP].isnan().any()

    assert core_is_clean(ours.decode_context)
    assert not core_is_clean(ours.decode_context - 1)


def test_windowed_encoder_trunk_equals_one_pass(ours, waveform):
    """encode_mono runs the trunk in windows (a 300 s track would not fit otherwise); with a small window the
    pieces still give the one-pass trunk, and the posterior means match the reference above."""
    mono = torch.nn.functional.pad(waveform.reshape(2, 1, -1), (0, -waveform.shape[-1] % HOP))  # 59 frames
    whole = ours.encoder(mono)
    calls = []
    hook = ours.encoder.register_forward_pre_hook(lambda module, inputs: calls.append(inputs[0].shape[-1] // HOP))
    try:
        windowed = ours.encode_trunk(mono, window=20)
    finally:
        hook.remove()
    assert calls == [20 + 12, 12 + 20 + 12, 12 + 19]  # frames 0-20, 20-40, 40-59, each with 12 of context
    torch.testing.assert_close(windowed, whole, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="at least one latent frame"):
        ours.encode_trunk(mono, window=0)


def test_encode_context_is_exactly_the_receptive_field(ours):
    """As for the decode: every trunk convolution's input outside a one-frame window (plus context, on that
    layer's own grid) becomes NaN. With the computed context the frame stays clean; one less poisons it."""
    assert ours.encode_context == encode_context(AudioVAEConfig()) == 12
    frames, core = 40, 20
    mono = torch.randn(1, 1, frames * HOP, generator=torch.Generator().manual_seed(9))

    def core_is_clean(context: int) -> bool:
        def outside_window_to_nan(module, inputs):
            (x,) = inputs
            density = x.shape[-1] // frames
            x = x.clone()
            x[..., : (core - context) * density] = float("nan")
            x[..., (core + 1 + context) * density :] = float("nan")
            return (x,)

        hooks = [m.register_forward_pre_hook(outside_window_to_nan) for m in ours.encoder.modules()
                 if isinstance(m, nn.Conv1d)]
        try:
            trunk = ours.encoder(mono)
        finally:
            for hook in hooks:
                hook.remove()
        return not trunk[..., core].isnan().any()

    assert core_is_clean(ours.encode_context)
    assert not core_is_clean(ours.encode_context - 1)
