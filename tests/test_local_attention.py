"""The lossy windowed video attention (local_attention.py) against a dense masked softmax: the mask it
means, its chunked SDPA form, the log-sum-exp merge its FlashAttention 3 form relies on, the layouts'
trailing target video it needs, and the DiT/sampler plumbing (off by default; a window covering the
whole video is the exact path, bit for bit)."""

import functools
import logging

import pytest
import torch
import torch.nn.functional as F

from h3_core import attention as attention_module, local_attention
from h3_core.attention import attention, available_backends, resolve_backend
from h3_core.layout import ReferenceBlock, build_ref2va_layout, build_request_layout, build_t2va_layout, build_window_layout
from h3_core.local_attention import VideoWindow, merge_partials, window_mask
from h3_core.noise import request_generator, target_noise
from h3_core.sampler import DualClockSchedule, denoise
from h3_core.tiny import tiny_random_dit


def dense_reference(q, k, v, window):
    """Softmax over the allowed keys, float64, one [S, S] mask written out row by row."""
    rows = q.shape[1]
    allowed = torch.zeros(rows, rows, dtype=torch.bool)
    for i in range(rows):
        for j in range(rows):
            allowed[i, j] = j < window.start or i < window.start or abs(i - j) <= window.radius
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.double()), allowed


def qkv(rows, heads=3, dim=16, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, rows, heads, dim, generator=g) for _ in range(3)]


@pytest.mark.parametrize("start,radius", [(5, 7), (1, 1), (9, 64), (0, 3)])
def test_chunked_sdpa_window_equals_dense_masked_softmax(start, radius):
    q, k, v = qkv(150)
    window = VideoWindow(start, radius)
    expected, allowed = dense_reference(q, k, v, window)
    assert torch.equal(window_mask(range(150), range(150), window), allowed)
    out = attention(q, k, v, "sdpa", window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    full = attention(q, k, v, "sdpa")
    torch.testing.assert_close(out[:, :start], full[:, :start], atol=1e-5, rtol=1e-5)  # rows before the target: full
    assert (out[:, start:] - full[:, start:]).abs().max() > 1e-2  # target rows: the window changes them


def test_merging_partials_by_log_sum_exp_equals_attention_over_all_keys():
    q, k, v = qkv(40, seed=1)
    scale = q.shape[-1] ** -0.5

    def partial(keys):
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k[:, keys]) * scale
        return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v[:, keys]), scores.logsumexp(-1)

    first, second = partial(slice(0, 13)), partial(slice(13, 40))
    merged = merge_partials(*first, *second)
    torch.testing.assert_close(merged, attention(q, k, v, "sdpa"), atol=1e-5, rtol=1e-5)


def test_flash3_window_calls_and_merge_on_a_stand_in_kernel(tmp_path, monkeypatch):
    """The FlashAttention 3 form (prefix over all keys; target over its sliding window and over the
    prefix, merged by log-sum-exp), eager and compiled, on a float32 CPU stand-in of FA3's interface:
    the chunked SDPA window's result; the FP8 form close to it."""
    import sys

    from fa3_stand_in import FA3_STAND_IN

    (tmp_path / "flash_attn_interface.py").write_text(FA3_STAND_IN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn_interface", raising=False)
    q, k, v = qkv(150, seed=2)
    window = VideoWindow(9, 20)
    expected = attention(q, k, v, "sdpa", window)
    compiled = torch.compile(functools.partial(attention, backend="flash3", window=window), fullgraph=True)
    for got in (attention(q, k, v, "flash3", window), compiled(q, k, v)):
        assert got.dtype == q.dtype
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    fp8 = attention(q, k, v, "flash3-fp8-lossy", window)
    assert fp8.dtype == q.dtype and F.cosine_similarity(fp8.flatten(), expected.flatten(), dim=0) > 0.99
    assert (fp8 - expected).norm() / expected.norm() < 0.1  # the size too: cosine alone passes a scaled output
    import flash_attn_interface

    assert [call[0] for call in flash_attn_interface.CALLS[-3:]] == [torch.float8_e4m3fn] * 3  # three calls
    sys.modules.pop("flash_attn_interface", None)


def test_window_of_frames_is_none_when_it_covers_the_whole_video():
    assert VideoWindow.for_frames(0, 100, 10, 9) is None
    assert VideoWindow.for_frames(10, 100, 10, 9) is None  # 90 target rows: a radius of 90 covers them
    assert VideoWindow.for_frames(2, 100, 10, 9) == VideoWindow(10, 18)


def test_other_backends_are_refused_with_the_supported_list():
    q, k, v = qkv(20)
    with pytest.raises(ValueError, match="sdpa, flash3, flash3-fp8-lossy attention backends; 'sage' is chosen"):
        attention(q, k, v, "sage", VideoWindow(4, 3))


LAYOUTS = {
    "t2va": lambda: build_request_layout(128, 64, 124, torch.ones(7, dtype=torch.long)),
    "fl2va": lambda: build_t2va_layout([1] * 5, 4, 4, 6, 9, keyframe_anchors=("first", "last")),
    "ref2va": lambda: build_ref2va_layout([1] * 5, [ReferenceBlock.image(4, 6), ReferenceBlock.video(2, 4, 6, 3),
                                                    ReferenceBlock.audio(5)], 4, 4, 6, 9),
    "window": lambda: build_window_layout([1] * 5, [ReferenceBlock.image(4, 6)], 4, 4, 6, 9,
                                          time_offset=3.0, guide_latent_frames=2, guide_audio_latents=4),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_layout_ends_with_its_target_video_frame_major(name):
    layout = LAYOUTS[name]()
    start, rows_per_frame = layout.target_video_span
    assert rows_per_frame == (layout.latent_height // 2) * (layout.latent_width // 2)
    assert torch.equal(layout.target_video_indices, torch.arange(start, layout.sequence_length))
    frame_times = layout.position_ids[start:, 0].reshape(layout.latent_frames, rows_per_frame)
    assert (frame_times == frame_times[:, :1]).all() and (frame_times[1:, 0] > frame_times[:-1, 0]).all()


def run(model):
    layout = build_request_layout(128, 64, 124, torch.tensor([1, 1, 0, 0, 1, 1, 1]))
    video, audio = target_noise(layout, request_generator(5))
    text = torch.randn(1, 7, 48, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        return denoise(model, layout, text, video, audio, DualClockSchedule.build(3))


def test_sampler_runs_the_window_and_a_covering_window_is_the_exact_path(monkeypatch, caplog):
    model = tiny_random_dit()
    assert model.attention_window == 0  # off by default
    exact = run(model)
    assert all(torch.equal(a, b) for a, b in zip(exact, run(model.set_attention_window(40))))  # 32 latent frames
    seen = []
    original = local_attention.windowed_attention
    monkeypatch.setattr(attention_module, "windowed_attention", lambda *a: seen.append(a[-1]) or original(*a))
    windowed = run(model.set_attention_window(2))
    assert seen and set(seen) == {VideoWindow(7 + 414, 2 * 8)}  # text 7 + audio 2 x 207 rows; 2 frames of 2 x 4 rows
    assert all((a - b).abs().max() > 1e-4 for a, b in zip(exact, windowed))

    seen.clear()
    late = run(model.set_attention_window(2, dense_steps=1))  # the first of the 2 forwards: full attention
    assert len(seen) == len(model.blocks)  # only the second forward's blocks ran the window
    assert all((a - b).abs().max() > 1e-6 for a, b in zip(late, exact))
    assert all((a - b).abs().max() > 1e-6 for a, b in zip(late, windowed))
    with caplog.at_level(logging.WARNING, logger="h3_core"):
        never = run(model.set_attention_window(2, dense_steps=2))
    assert all(torch.equal(a, b) for a, b in zip(exact, never))
    assert "dense steps keep full attention for all 2 model calls of this run, so the lossy window never" in caplog.text

    def dense(q, k, v, backend, window):  # the dense reference in the DiT: same result
        return dense_reference(q, k, v, window)[0].to(q.dtype)

    monkeypatch.setattr(attention_module, "windowed_attention", dense)
    for a, b in zip(windowed, run(model.set_attention_window(2))):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_window_setting_is_checked():
    model = tiny_random_dit()
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="whole number of latent frames"):
            model.set_attention_window(bad)
        with pytest.raises(ValueError, match="dense steps are a whole number of steps >= 0"):
            model.set_attention_window(2, dense_steps=bad)
    for block in model.blocks:
        block.attn.backend = "flash"
    with pytest.raises(ValueError, match="runs on the sdpa, flash3, flash3-fp8-lossy attention backends; 'flash' is chosen"):
        model.set_attention_window(2)
    model.set_attention_window(0)  # full attention on any backend


def test_set_attention_sets_the_window_then_a_backend_that_runs_it():
    model = tiny_random_dit()
    for block in model.blocks:
        block.attn.backend = "flash"  # a backend without windows, chosen earlier
    assert model.set_attention("auto", 2, dense_steps=1) == "sdpa"  # auto picks one that runs the window
    assert (model.attention_window, model.attention_window_dense_steps) == (2, 1)
    assert {block.attn.backend for block in model.blocks} == {"sdpa"}
    with pytest.raises(ValueError, match="'flash'"):  # not installed here (in CI), or not one that runs windows
        model.set_attention("flash", 3)
    assert (model.attention_window, model.attention_window_dense_steps) == (2, 1)  # unchanged by the refusal
    with pytest.raises(ValueError, match="whole number of latent frames"):
        model.set_attention("sdpa", -1)
    assert model.set_attention() == "sdpa" and model.attention_window == 0  # defaults: full attention, auto


needs_flash3 = pytest.mark.skipif(not torch.cuda.is_available() or "flash3" not in available_backends(),
                                  reason="needs CUDA and a FlashAttention 3 build (CI has neither)")


@needs_flash3
@pytest.mark.parametrize("backend, min_cosine", [("flash3", 0.99999), ("flash3-fp8-lossy", 0.99)])
def test_flash3_window_matches_the_chunked_sdpa_window(backend, min_cosine):
    local_attention.check_backend(backend)  # this build has the sliding-window kernels
    g = torch.Generator("cuda").manual_seed(4)
    q, k, v = (torch.randn(2, 5000, 4, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    window = VideoWindow(613, 1000)
    expected = attention(q, k, v, "sdpa", window).float()
    compiled = torch.compile(functools.partial(attention, backend=backend, window=window), fullgraph=True)
    for got in (attention(q, k, v, backend, window).float(), compiled(q, k, v).float()):
        assert got.shape == expected.shape
        assert F.cosine_similarity(got.flatten(), expected.flatten(), dim=0).item() > min_cosine
        assert ((got - expected).norm() / expected.norm()).item() < 0.1
        if backend == "flash3":
            assert (got - expected).abs().max().item() < 5e-3
    full = attention(q, k, v, "sdpa").float()
    assert F.cosine_similarity(full[:, 613:].flatten(), expected[:, 613:].flatten(), dim=0).item() < 0.99  # it is a window


def test_generate_runs_the_window_when_asked_and_refuses_a_bad_one_first(tmp_path, monkeypatch):
    from h3_core import pipeline
    from h3_core.conditioning import Request, RequestError
    from h3_core.memory_plan import MemoryPlan

    def generate(**settings):
        notes = []
        (result,) = pipeline.generate(Request("t2va", "a fox on the beach", duration=4), "tiny-random",
                                      pipeline.GenerateSettings(steps=3, **settings), notes=notes.append,
                                      save_latents=tmp_path / f"{len(list(tmp_path.iterdir()))}.safetensors")
        return result.latents, notes

    exact, exact_notes = generate()
    windowed, notes = generate(attention_window=1)
    assert "attention window: 1 latent frames around each target video row (lossy)" in notes
    _, notes = generate(attention_window=1, attention_window_dense_steps=1)
    assert "attention window: 1 latent frames around each target video row (lossy), full attention for the first 1 steps" in notes
    assert not any("attention window" in line for line in exact_notes)
    assert (exact.video - windowed.video).abs().max() > 1e-4
    monkeypatch.setattr(pipeline, "plan_for", lambda *args, **kwargs: MemoryPlan(1, 1, True, 0, True))
    streamed, notes = generate(attention_window=1)  # blocks streamed from CPU memory: the same window
    assert torch.equal(streamed.video, windowed.video) and torch.equal(streamed.audio, windowed.audio)
    monkeypatch.setattr(pipeline, "DiTReader", lambda *a, **k: pytest.fail("the DiT was read"))
    # dense steps covering all the run's model calls: a run called lossy that is exact, refused (it ran)
    with pytest.raises(RequestError, match=r"2 dense steps keep full attention for all 2 model calls .* "
                                           r"\(--attention-window-dense-steps; --steps counts the sigma points"):
        generate(attention_window=1, attention_window_dense_steps=2)
    monkeypatch.setattr(pipeline, "resolve_model_source", lambda *a: pytest.fail("model looked up for a bad request"))
    with pytest.raises(RequestError, match="whole number of latent frames >= 0"):
        generate(attention_window=-2)
    with pytest.raises(RequestError, match="dense steps are a whole number"):
        generate(attention_window=2, attention_window_dense_steps=-1)


def test_backend_resolution_with_a_window():
    assert resolve_backend("auto", "cpu", window=True) == "sdpa"
    assert resolve_backend("sdpa", "cpu", window=True) == "sdpa"


def test_worker_spec_sets_the_window():
    from h3_core.parallel import ModelSpec

    loaded = ModelSpec("tiny-random", dtype=torch.float32, attention_window=3, attention_window_dense_steps=4).load("cpu")
    assert (loaded.attention_window, loaded.attention_window_dense_steps) == (3, 4)


def test_cli_window_option(tmp_path, capsys):
    from safetensors.torch import load_file

    from h3_core.cli import main

    base = ["denoise", "--width", "128", "--height", "64", "--duration", "5", "--steps", "3"]
    assert main(base + ["--save-latents", str(tmp_path / "full.safetensors")]) == 0
    assert main(base + ["--attention-window-lossy", "2", "--save-latents", str(tmp_path / "window.safetensors")]) == 0
    full, window = load_file(str(tmp_path / "full.safetensors")), load_file(str(tmp_path / "window.safetensors"))
    assert (full["video"] - window["video"]).abs().max() > 1e-4
    assert main(base + ["--attention-window-lossy", "-1", "--save-latents", str(tmp_path / "bad.safetensors")]) == 2
    assert "whole number of latent frames >= 0" in capsys.readouterr().err and not (tmp_path / "bad.safetensors").exists()
    dense = base + ["--attention-window-lossy", "2", "--attention-window-dense-steps", "2"]
    assert main(dense + ["--save-latents", str(tmp_path / "dense.safetensors")]) == 2  # 2 forwards, both full
    assert "full attention for all 2 model calls" in capsys.readouterr().err
    assert not (tmp_path / "dense.safetensors").exists()
