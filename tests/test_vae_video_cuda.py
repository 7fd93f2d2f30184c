"""The video encoder past 2^31 values on a CUDA device (CI has none: these skip there, saying so).

CUDA kernels that index with 32 bits refuse such tensors (F.pad: "input tensor must fit into 32-bit index math").
An untiled 17-frame 1344x768 clip meets them in the first level (128 channels at full size), so those convolutions
run in bands of output rows (`CausalConv3d._forward_in_bands`). Tolerance: cuDNN may pick another algorithm for a
band's shape than for the whole, so sums may round differently (fp32: 1e-4 of the output's largest value)."""

import pytest
import torch

import h3_core.vae_video as vae_video
from h3_core.tiny import seeded_random_weights
from h3_core.vae_video import CausalConv3d, Downsample, VideoVAE, VideoVAEConfig, frames_to_model_space

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")


@pytest.mark.parametrize("kind", ["resnet conv", "conv_in", "downsample"])
def test_banded_convolutions_equal_the_whole_on_cuda(monkeypatch, kind):
    torch.manual_seed(0)
    conv, shape = {
        "resnet conv": (CausalConv3d(128, 128, 3, spatial_padding=1), (1, 128, 17, 257, 384)),
        "conv_in": (CausalConv3d(3, 128, 3, spatial_padding=1), (1, 3, 17, 256, 384)),
        "downsample": (Downsample(128, 2, 2, "reflect"), (1, 128, 17, 257, 385)),  # odd sides: one-sided pads
    }[kind]
    conv = conv.cuda().requires_grad_(False)
    x = torch.randn(shape, device="cuda")
    whole = conv(x)
    monkeypatch.setattr(vae_video, "INDEX_LIMIT", 10**6)
    monkeypatch.setattr(vae_video, "BAND_VALUES", 2 * 10**7)
    banded = conv(x)
    assert banded.shape == whole.shape
    assert (banded - whole).abs().max().item() <= 1e-4 * whole.abs().max().item()


def test_an_untiled_release_size_clip_encodes(monkeypatch):
    """17 frames of 1344x768 untiled at the release config (random weights): it used to fail in F.pad."""
    if torch.cuda.get_device_properties(0).total_memory < 70 * 2**30:
        pytest.skip("needs a GPU of 70 GiB or more (the untiled encode peaks near 60 GiB)")
    bands = []
    banded = CausalConv3d._forward_in_bands

    def counted(self, x, out_h, band_rows):
        bands.append(out_h)
        return banded(self, x, out_h, band_rows)

    monkeypatch.setattr(CausalConv3d, "_forward_in_bands", counted)
    vae = seeded_random_weights(VideoVAE(VideoVAEConfig()), 1).set_dtype(torch.bfloat16).cuda().eval()
    clip = torch.randint(0, 256, (1, 3, 17, 768, 1344), dtype=torch.uint8)
    moments = vae.encode_moments(clip, tiled=False, prepare=frames_to_model_space)
    assert bands and max(bands) == 768  # the full-size convolutions were banded
    tiled = vae.encode_moments(clip, tiled=True, prepare=frames_to_model_space)
    assert moments.shape == tiled.shape == (1, 48, 2, 48, 84) and torch.isfinite(moments).all()
    assert torch.nn.functional.cosine_similarity(moments.flatten(), tiled.flatten(), dim=0) > 0.9  # tiles blend
