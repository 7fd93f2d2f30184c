"""Block streaming gives the resident model's outputs; the memory planner's choices."""

from dataclasses import replace

import pytest
import torch

from h3_core.config import DiTConfig, TINY_DIT
from h3_core.memory_plan import GIB, activation_bytes, adaln_weight_bytes, block_weight_bytes, plan_memory
from h3_core.layout import build_request_layout
from h3_core.noise import request_generator, target_noise
from h3_core.offload import stream_blocks
from h3_core.sampler import DualClockSchedule, denoise
from h3_core.dit import H3DiT
from h3_core.tiny import tiny_random_dit


def run(model, **kwargs):
    layout = build_request_layout(128, 64, 124, torch.ones(6, dtype=torch.long))
    video, audio = target_noise(layout, request_generator(9))
    text = torch.randn(1, 6, 48, generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        return denoise(model, layout, text, video, audio, DualClockSchedule.build(4), **kwargs)


@pytest.mark.parametrize("resident, prefetch", [(0, 1), (1, 1), (0, 2)])
def test_streamed_equals_resident(resident, prefetch):
    config = replace(TINY_DIT, num_layers=4)

    def fresh():
        model = H3DiT(config).eval().requires_grad_(False)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
        return model

    expected = run(fresh())
    model = fresh()
    streamer = stream_blocks(model, "cpu", resident=resident, prefetch=prefetch)
    assert len(streamer.slots) == min(4 - resident, prefetch + 2)
    fetched = []
    real_fetch = streamer._fetch
    streamer._fetch = lambda i: (fetched.append(i), real_fetch(i))[1]
    got = run(model)
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
    # Every streamed block was fetched in each of the 3 forwards, and is back home afterwards.
    assert sorted(set(fetched)) == list(range(4))
    for index in streamer.home:
        block_params = [p for n, p in model.blocks[index].named_parameters() if not n.startswith("adaln_proj.")]
        assert all(p.data_ptr() == home.data_ptr() for p, home in zip(block_params, streamer.home[index]))
    streamer.remove()
    assert all(not block._forward_pre_hooks for block in model.blocks)


def test_streamer_rejects_bad_counts():
    model = tiny_random_dit()
    with pytest.raises(ValueError, match="between 0 and 2"):
        stream_blocks(model, "cpu", resident=3)
    with pytest.raises(ValueError, match="prefetch"):
        stream_blocks(model, "cpu", resident=0, prefetch=0)


REAL = DiTConfig()
ROWS_124F = 38_222  # 1344x768, 124 frames, 512 text rows


def test_real_config_sizes_match_the_fact_sheet():
    # 13,039,369,728 AdaLN parameters (bf16) plus the fp32 time embedder (A.1, A.2).
    embedder = 256 * 5376 + 5376 + 5376 * 2688 + 2688
    assert adaln_weight_bytes(REAL, 2) == 2 * 13_039_369_728 + 4 * embedder
    # 385,351,680 token-wise parameters per block (h3-model.md A.1) plus two norms and the q/k norms.
    assert block_weight_bytes(REAL, 2) == 2 * (385_351_680 + 2 * 5376 + 2 * 128)
    # The measured activation peak on the H200 was 6.6 GiB over 61.8 GiB of weights at 38,222 rows.
    assert 6.0 * GIB < activation_bytes(REAL, ROWS_124F, 2) < 6.8 * GIB


@pytest.mark.parametrize(
    "budget_gib, rows, all_resident",
    [(139, ROWS_124F, True), (60, ROWS_124F, True), (56, 63_704, True), (40, ROWS_124F, False),
     (24, ROWS_124F, False), (24, 63_704, False), (12, ROWS_124F, False), (16, 20_000, False)],
)
def test_planner_choices(budget_gib, rows, all_resident):
    budget = int(budget_gib * GIB)
    plan = plan_memory(REAL, rows, budget)
    block = block_weight_bytes(REAL, 2)
    assert plan.fits and plan.expected_peak_bytes <= budget
    assert plan.streams != all_resident
    if all_resident:
        assert plan.resident_blocks == 50
        # AdaLN weights (~24 GiB) stay on the GPU only when they fit beside everything else.
        assert plan.offload_adaln == (budget_gib < 100)
    else:  # maximal: one more resident block would not fit
        assert plan.expected_peak_bytes + block > budget
        assert 0 <= plan.resident_blocks < 50
    # More memory never means fewer resident blocks.
    assert plan_memory(REAL, rows, budget + 4 * GIB).resident_blocks >= plan.resident_blocks


def test_planner_says_when_nothing_fits():
    plan = plan_memory(REAL, 108_000, 8 * GIB)  # a 15 s clip in 8 GiB: activations alone exceed it
    assert not plan.fits and plan.resident_blocks == 0
    assert plan.expected_peak_bytes > 8 * GIB
