"""Speed paths that must not change a single bit: precomputed AdaLN tables (and offloaded AdaLN
weights), and the choice of attention backend."""

import pytest
import torch

from h3_core.attention import available_backends, resolve_backend
from h3_core.layout import build_request_layout
from h3_core.noise import request_generator, target_noise
from h3_core.sampler import DualClockSchedule, denoise
from h3_core.tiny import tiny_random_dit


def run(model, **kwargs):
    tags = torch.tensor([1, 1, 0, 0, 1, 1, 1])
    layout = build_request_layout(128, 64, 124, tags)
    video, audio = target_noise(layout, request_generator(5))
    text = torch.randn(1, 7, 48, generator=torch.Generator().manual_seed(5)).to(model.dtype)
    with torch.inference_mode():
        return denoise(model, layout, text, video, audio, DualClockSchedule.build(5), **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_precomputed_adaln_tables_are_bitwise_identical(dtype):
    model = tiny_random_dit(dtype)
    plain = run(model, reuse_adaln=False)
    reused = run(model, reuse_adaln=True)
    offloaded = run(model, reuse_adaln=True, offload_adaln=True)
    for a, b, c in zip(plain, reused, offloaded):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert model.blocks[0].adaln_proj.linear.weight.device.type == "cpu"  # restored home after the run


def test_loop_never_touches_adaln_weights_when_tables_are_precomputed():
    model = tiny_random_dit()
    calls = []
    hooks = [m.register_forward_hook(lambda *_: calls.append(1)) for m in model.adaln_modules()]
    seen_during_loop = []
    run(model, reuse_adaln=True, callback=lambda state: seen_during_loop.append(len(calls)))
    steps, modules = 4, len(model.adaln_modules())
    assert seen_during_loop == [steps * modules] * steps  # all computed before step 1, none after
    calls.clear()
    run(model, reuse_adaln=False, callback=lambda state: seen_during_loop.append(len(calls)))
    assert seen_during_loop[steps:] == [modules * s for s in range(1, steps + 1)]  # plain path: one set per step
    for hook in hooks:
        hook.remove()


def test_auto_backend_is_exact_and_named():
    assert resolve_backend("auto", "cpu") == "sdpa"
    assert "sdpa" in available_backends()
    model = tiny_random_dit()
    assert model.set_attention_backend("auto") == "sdpa"
    assert {m.backend for m in model.modules() if hasattr(m, "backend")} == {"sdpa"}


def test_unknown_or_missing_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="choose one of"):
        resolve_backend("xformers")
    if "sage" not in available_backends():
        with pytest.raises(ValueError, match="'sageattention' package"):
            resolve_backend("sage")
