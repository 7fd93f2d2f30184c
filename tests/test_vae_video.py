"""The native video VAE against diffusers' `AutoencoderKLMiniMaxH3` at the tiny config (h3-model.md J,
real 16x / 4x factors), plus the tile and chunk arithmetic and the streaming decode.

One random diffusers state dict is loaded into both models, into ours through the key mapping.
Tolerance: both sides run the same operations in the same order and dtypes (convolutions, norms,
SDPA, blend weights), so fp32 outputs of magnitude ~1-3 must agree to 1e-5 absolute (room only for
a BLAS that sums in another order; here they are bitwise equal). The bf16 decode must agree to one
bf16 step (2^-7 relative) everywhere and exactly almost everywhere (here: bitwise everywhere).
"""

import diffusers
import pytest
import torch
from diffusers.modular_pipelines.minimax_h3.encoders import encode_vae_condition
from video_vae_checkpoints import reference_video_vae, tiny_config, write_diffusers_folder

from h3_core.vae_video import (
    FP32_MODULES,
    IMAGENET_MEAN,
    IMAGENET_STD,
    VideoVAE,
    VideoVAEConfig,
    encode_condition,
    fp16_round_trip,
    frames_to_model_space,
    model_space_to_frames,
)
from h3_core.vae_video_checkpoint import convert_state_dict, load_video_vae
from h3_core.vae_video_tiling import TemporalChunking, split_tiles

ATOL = 1e-5
SMALL_TILES = {"tile_size": 48, "tile_min_overlap": 16}  # tiles of 3x3 latents, the same code paths as 256
# Overlaps of 2/3 of a tile: a middle tile's top strip (blended with the tile above) and its bottom
# strip (blended into the tile below) share rows, so the order of blending shows.
WIDE_OVERLAPS = {"tile_size": 48, "tile_min_overlap": 32}


@pytest.fixture(scope="module")
def config():
    return tiny_config(seed=5)


@pytest.fixture(scope="module")
def reference(config):
    return reference_video_vae(config, seed=7)


@pytest.fixture(scope="module")
def ours(reference, config):
    model = VideoVAE(config).eval().requires_grad_(False)
    model.load_state_dict(convert_state_dict(reference.state_dict(), "diffusers", config))
    return model


def with_tiles(model: VideoVAE, **tiles) -> VideoVAE:
    other = VideoVAE(model.config.replace(**tiles)).eval().requires_grad_(False)
    other.load_state_dict(model.state_dict())
    return other


def reference_tiling(reference, tiles: dict | None):
    """Give diffusers the same tiling: None = untiled, {} = the release's 256/64, else our overrides."""
    if tiles is None:
        reference.disable_tiling()
    else:
        size, overlap = tiles.get("tile_size", 256), tiles.get("tile_min_overlap", 64)
        reference.enable_tiling(size, size, overlap, overlap)


def assert_close(ours_out, reference_out):
    assert ours_out.shape == reference_out.shape
    assert (ours_out.float() - reference_out.float()).abs().max().item() <= ATOL


# -- arithmetic -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "length, starts, overlaps",
    [
        (1344, (0, 176, 352, 528, 704, 896, 1088), (80, 80, 80, 80, 64, 64)),
        (768, (0, 160, 336, 512), (96, 80, 80)),
        (320, (0, 64), (192,)),
        (256, (0,), ()),
    ],
)
def test_tile_starts_match_the_fact_sheet(length, starts, overlaps):
    layout = split_tiles(length, 256, 64, 16)
    assert layout.starts == starts and layout.overlaps == overlaps
    assert layout.starts[-1] + layout.size == length  # the last tile ends on the frame edge


@pytest.mark.parametrize("tile, overlap", [(256, 256), (256, 0), (256, 40), (250, 64)])
def test_tile_settings_off_the_latent_grid_are_refused(tile, overlap):
    """A changed config.json: overlap == tile hung the decode, 0 lost half the frame, 40 misaligned the tiles."""
    with pytest.raises(ValueError, match=rf"multiples of its 16-pixel latent grid.*got tile {tile}, overlap {overlap}"):
        VideoVAEConfig(tile_size=tile, tile_min_overlap=overlap)


def test_temporal_recipe_numbers():
    chunking = TemporalChunking(clip_length=17, token_drop=3, frames_per_latent=4)
    assert (chunking.latents_per_chunk, chunking.overlap_latents) == (5, 2)
    assert (chunking.lead_frames, chunking.crossfade_frames) == (3, 5)
    for n in range(1, 9):  # 17n + 5 frames <-> 5n + 2 latents, decoded in n chunks
        assert chunking.padding_and_chunks(5 * n + 2) == (0, n)
        assert chunking.num_frames(5 * n + 2) == 17 * n + 5


def test_release_model_on_meta():
    release = VideoVAEConfig()
    assert (release.decoder_dim, release.rope_dim, release.spatial_ratio, release.temporal_ratio) == (2048, 48, 16, 4)
    assert release.temporal_chunking.num_frames(37) == 124  # 1344x768 target: 37 latents -> 124 frames
    model = VideoVAE.build(release, torch.bfloat16, device="meta")
    params = dict(model.named_parameters())
    fp32_bytes = 4 * (sum(p.numel() for p in params.values()) + release.decoder_dim)  # + decoder.mask_token
    assert round(fp32_bytes / 2**30, 2) == 9.70  # the release's source/model.safetensors: 9.700 GiB
    assert params["decoder.transformer_blocks.35.attn.to_qkv.weight"].shape == (6144, 2048)
    assert params["decoder.transformer_blocks.0.ff.w1.weight"].dtype == torch.bfloat16
    assert params["encoder.down.5.block.1.conv2.weight"].dtype == torch.float32


# -- parity with diffusers --------------------------------------------------------------------


@pytest.mark.parametrize(
    "frames, height, width, tiles",
    [
        (39, 32, 48, None),  # three 17-frame clips, the last padded, 3 latents dropped -> 12
        (1, 32, 48, None),  # a keyframe: spatial path only, 1 -> 1
        (5, 64, 96, SMALL_TILES),  # 2 x 3 tiles with unequal overlaps, blended in latent space
        (1, 288, 320, {}),  # the release's 256 px tiles: 2 x 2
    ],
)
def test_encode_matches_reference(reference, ours, frames, height, width, tiles):
    pixels = torch.randn(1, 3, frames, height, width)
    model = ours if not tiles else with_tiles(ours, **tiles)
    reference_tiling(reference, tiles)
    expected = reference.encode(pixels).latent_dist
    posterior = model.encode(pixels, tiled=tiles is not None)
    assert posterior.mean.shape[2] == (1 if frames == 1 else (frames - 5) // 17 * 5 + 2)
    assert_close(posterior.mean, expected.mean)
    assert_close(posterior.logvar, expected.logvar)


@pytest.mark.parametrize("mode", ["reflect", "replicate", "constant"])
def test_an_encode_too_large_for_32_bit_indexing_is_made_in_bands_equal_to_the_reference(monkeypatch, mode):
    """A convolution whose padded input or output passes the 32-bit index limit runs in bands of output rows
    (limits lowered here so the tiny model meets them): equal to diffusers' whole padded convolution, stride 2
    and its one-sided bottom / right pad included, in each padding mode that can be banded."""
    import h3_core.vae_video as vae_video

    config = tiny_config(seed=5, spatial_padding_mode=mode)
    reference = reference_video_vae(config, seed=9)
    model = VideoVAE(config).eval().requires_grad_(False)
    model.load_state_dict(convert_state_dict(reference.state_dict(), "diffusers", config))
    pixels = torch.randn(1, 3, 22, 35, 50)  # odd height: the stride-2 pads' bottom row lands in the last band
    reference_tiling(reference, None)
    expected = reference.encode(pixels).latent_dist
    bands = []
    banded = vae_video.CausalConv3d._forward_in_bands

    def counted(self, x, out_h, band_rows):
        bands.append(-(-out_h // band_rows))
        return banded(self, x, out_h, band_rows)

    monkeypatch.setattr(vae_video, "INDEX_LIMIT", 3000)
    monkeypatch.setattr(vae_video, "BAND_VALUES", 6000)
    monkeypatch.setattr(vae_video.CausalConv3d, "_forward_in_bands", counted)
    posterior = model.encode(pixels, tiled=False)
    convolutions = sum(isinstance(m, vae_video.CausalConv3d) for m in model.encoder.modules())
    assert len(bands) >= convolutions and max(bands) >= 4  # every convolution banded (twice: two clips)
    assert_close(posterior.mean, expected.mean)
    assert_close(posterior.logvar, expected.logvar)


@pytest.mark.parametrize(
    "latent_frames, height, width, tiles",
    [
        (12, 2, 3, None),  # two chunks cross-faded, then the closing tail: 39 frames
        (9, 2, 3, None),  # padded to whole chunks; the padding's frames are cut (30 frames)
        (7, 5, 6, WIDE_OVERLAPS),  # 3 x 4 tiles blended in pixel space; a tile's strips overlap
        (7, 16, 18, {}),  # the release's 256 px tiles over 256 x 288 px
    ],
)
def test_decode_matches_reference(reference, ours, latent_frames, height, width, tiles):
    latents = torch.randn(1, ours.config.latent_channels, latent_frames, height, width)
    model = ours if not tiles else with_tiles(ours, **tiles)
    reference_tiling(reference, tiles)
    expected = reference.decode(latents).sample
    decoded = model.decode(latents, tiled=tiles is not None)
    assert decoded.shape[2] == ours.config.temporal_chunking.num_frames(latent_frames)
    assert_close(decoded, expected)


@pytest.mark.parametrize("tiles", [None, SMALL_TILES])
def test_streamed_decode_gives_the_reference_decode_steps_frames(reference, ours, tiles):
    """The whole last stage as the release's pipeline runs it (MiniMaxH3VideoDecodeStep: denormalize, decode,
    frames to 8 bits): output.decode_video's uint8 frames, chunk by chunk, are its PIL frames exactly."""
    import numpy as np
    from diffusers.modular_pipelines.minimax_h3.decoders import MiniMaxH3VideoDecodeStep

    from h3_core.output import decode_video

    model = ours if not tiles else with_tiles(ours, **tiles)
    reference_tiling(reference, tiles)
    step = MiniMaxH3VideoDecodeStep().init_pipeline()
    step.update_components(vae=reference)
    latents = torch.randn(1, ours.config.latent_channels, 12, 5, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = np.stack([np.asarray(image) for image in step(latents=latents, output_type="pil",
                                                                 output="videos")[0]])
    frames = torch.cat(list(decode_video(model, latents, tiled=tiles is not None))).numpy()
    assert frames.shape == expected.shape == (39, 80, 96, 3)
    assert np.array_equal(frames, expected)


@pytest.mark.parametrize("frames", [1, 22])
def test_condition_recipe_matches_reference(reference, ours, frames):
    """uint8 -> ImageNet space -> encode -> posterior sample under seed 42 -> fp16 round trip -> normalize."""
    reference_tiling(reference, {})
    pixels = torch.randint(0, 256, (1, 3, frames, 32, 48), dtype=torch.uint8)
    expected = encode_vae_condition(reference, pixels, IMAGENET_MEAN, IMAGENET_STD, 42)
    latents = encode_condition(ours, pixels)
    # Equal moments and equal noise give equal samples; the fp16 rounding can only amplify a last-bit
    # difference to one fp16 step, which never happens here.
    assert torch.equal(latents, expected)
    assert not torch.equal(latents, encode_condition(ours, pixels, seed=43))  # the seed is used
    done = []  # a host's progress: the frames encoded after each 17-frame clip, the latents unchanged
    assert torch.equal(encode_condition(ours, pixels, on_clip=done.append), expected)
    assert done == ([] if frames == 1 else [17, 22])


def test_reduced_precision_policy_matches_reference(tmp_path, reference, config):
    """bf16 decoder linears, fp32 encoder / norms / layer scales: the same dtypes per tensor as
    diffusers' `from_pretrained(torch_dtype=bf16)`, and the same bf16 decode."""
    write_diffusers_folder(tmp_path / "vae", reference)
    expected_model = diffusers.AutoencoderKLMiniMaxH3.from_pretrained(tmp_path / "vae", torch_dtype=torch.bfloat16)
    model = load_video_vae(tmp_path, dtype=torch.bfloat16)
    expected_sd = convert_state_dict(expected_model.state_dict(), "diffusers", config)
    expected_dtypes = {name: tensor.dtype for name, tensor in expected_sd.items()}
    assert {name: tensor.dtype for name, tensor in model.state_dict().items()} == expected_dtypes
    assert {torch.float32, torch.bfloat16} == set(expected_dtypes.values())
    for name, dtype in expected_dtypes.items():  # FP32_MODULES states diffusers' policy
        assert (dtype == torch.float32) == any(part in FP32_MODULES for part in name.split(".")), name

    latents = torch.randn(1, config.latent_channels, 12, 2, 3)
    expected = expected_model.decode(latents).sample
    decoded = model.decode(latents)
    assert decoded.dtype == expected.dtype == torch.bfloat16
    assert torch.allclose(decoded.float(), expected.float(), rtol=2**-7, atol=ATOL)
    assert (decoded == expected).float().mean() > 0.99


# -- streaming decode -------------------------------------------------------------------------


def test_stream_yields_finished_chunks_and_equals_whole_decode(ours):
    latents = torch.randn(1, ours.config.latent_channels, 12, 2, 3)  # 39 frames
    calls = []
    decoder_forward = ours.decoder.forward
    ours.decoder.forward = lambda z: calls.append(z.shape[2]) or decoder_forward(z)
    try:
        stream = ours.decode_stream(latents, tiled=False)
        first = next(stream)
        assert calls == [7]  # the first block is out after one 7-latent chunk, before the rest is decoded
        assert torch.is_grad_enabled()  # the stream's no_grad does not leak into the consumer
        blocks = [first, *stream]
    finally:
        del ours.decoder.forward
    assert calls == [7, 7]
    assert [b.shape[2] for b in blocks] == [17, 17, 5]  # never more than one chunk's frames at a time
    assert torch.equal(torch.cat(blocks, dim=2), ours.decode(latents, tiled=False))


def test_stream_cuts_padding_frames_from_the_last_blocks(ours):
    latents = torch.randn(1, ours.config.latent_channels, 8, 2, 3)  # padded by 4 latents -> 26 frames
    blocks = list(ours.decode_stream(latents, tiled=False))
    assert [b.shape[2] for b in blocks] == [17, 9]


def test_decode_refuses_too_few_latents(ours):
    with pytest.raises(ValueError, match="at least 3 latent frames"):
        ours.decode(torch.zeros(1, ours.config.latent_channels, 2, 2, 3))


# -- pixel and latent spaces ------------------------------------------------------------------


def test_pixel_and_latent_normalization(ours, config):
    frames = torch.randint(0, 256, (1, 3, 2, 4, 5), dtype=torch.uint8)
    model_space = frames_to_model_space(frames)
    assert torch.equal(model_space, frames_to_model_space(frames.float() / 255.0))
    imagenet_mean, imagenet_std = (torch.tensor(v).view(1, 3, 1, 1, 1) for v in (IMAGENET_MEAN, IMAGENET_STD))
    expected = (frames.float() / 255.0 - imagenet_mean) / imagenet_std
    assert torch.allclose(model_space, expected, atol=1e-6)
    assert torch.allclose(model_space_to_frames(model_space), frames.float() / 255.0, atol=1e-6)
    assert model_space_to_frames(torch.full((1, 3, 1, 1, 1), 50.0)).max() == 1.0  # clamped

    latents = torch.randn(1, config.latent_channels, 2, 2, 3)
    normalized = ours.normalize_latents(latents)
    mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(config.latents_std).view(1, -1, 1, 1, 1)
    assert torch.equal(normalized, (latents - mean) / std)
    assert torch.allclose(ours.denormalize_latents(normalized), latents, atol=1e-6)

    rounded = fp16_round_trip(latents)
    assert rounded.dtype == torch.float32 and torch.equal(rounded, latents.half().float())
