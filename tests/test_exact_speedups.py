"""Speed paths: precomputed AdaLN tables (and offloaded AdaLN weights) and the choice of attention
backend, which must not change a single bit; compiled blocks, which must match up to float rounding."""

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


def _generate(tmp_path, notes=None, **settings):
    from h3_core import pipeline
    from h3_core.conditioning import Request

    request = Request("t2va", "a fox on the beach", duration=4)
    (result,) = pipeline.generate(request, "tiny-random", pipeline.GenerateSettings(steps=3, **settings),
                                  save_latents=tmp_path / f"{len(list(tmp_path.iterdir()))}.safetensors", notes=notes)
    return result.latents


def test_generate_compiles_blocks_resident_or_streamed(tmp_path, monkeypatch):
    """`compile` (h3 generate --compile): the compiled blocks give the eager latents up to float rounding,
    resident or streamed from CPU memory (the streaming hooks run around the compiled forward)."""
    from h3_core import pipeline
    from h3_core.memory_plan import MemoryPlan

    eager = _generate(tmp_path)
    for plan in (None, MemoryPlan(1, 1, True, 0, True)):
        if plan is not None:
            monkeypatch.setattr(pipeline, "plan_for", lambda *args, **kwargs: plan)
        notes = []
        compiled = _generate(tmp_path, notes=notes.append, compile=True)
        assert "blocks compiled (the first step pays the compile)" in notes
        assert "attention: sdpa (auto: the fastest exact kernel installed)" in notes  # named for the user
        assert torch.allclose(eager.video, compiled.video, atol=1e-4)
        assert torch.allclose(eager.audio, compiled.audio, atol=1e-4)


def test_compiled_blocks_run_their_graph_unless_a_module_it_runs_is_hooked():
    """A block's compiled forward is skipped (eager) while a submodule it runs carries a hook (a dynamic
    LoRA: the graph would not see it), but not for hooks on its AdaLN projection, which the forward never
    calls (sharded weights gather it there; on 2x H200 sharded blocks ran eager at 3.15 s a step before)."""
    model = tiny_random_dit(torch.float32).compile_blocks()
    graph_runs = set()
    for index, block in enumerate(model.blocks):
        block.forward.compiled = lambda *args, index=index, eager=block.forward.eager: graph_runs.add(index) or eager(*args)
    model.blocks[0].adaln_proj.register_forward_pre_hook(lambda module, args: None)
    run(model)
    assert graph_runs == set(range(len(model.blocks)))
    graph_runs.clear()
    model.blocks[0].attn.qkv_proj.register_forward_pre_hook(lambda module, args: None)
    run(model)
    assert graph_runs == set(range(1, len(model.blocks)))


def test_worker_model_spec_compiles_when_asked(monkeypatch):
    from h3_core.dit import H3DiT
    from h3_core.parallel import ModelSpec

    compiled = []
    monkeypatch.setattr(H3DiT, "compile_blocks", lambda self, *a, **k: compiled.append(self) or self)
    plain = ModelSpec("tiny-random", dtype=torch.float32).load("cpu")
    assert compiled == []
    model = ModelSpec("tiny-random", dtype=torch.float32, compile=True).load("cpu")
    assert compiled == [model] and model is not plain


def test_compiled_blocks_share_one_graph_and_respect_hooks_added_later(tmp_path):
    """compile_blocks: one graph serves every block and every step's timestep count; block-level hooks
    (streaming) run around it; a block whose submodules gained hooks after tracing (a dynamic LoRA) runs
    eagerly, so the adapter is never silently skipped; once removed, the graph is used again."""
    from dataclasses import replace

    from lora_files import fused, random_spec, write_native
    from torch._dynamo.utils import counters

    from h3_core.config import TINY_DIT
    from h3_core.dit import H3DiT
    from h3_core.lora import apply_loras, load_lora, remove_loras
    from h3_core.tiny import seeded_random_weights

    config = replace(TINY_DIT, num_layers=3)
    make = lambda: seeded_random_weights(H3DiT(config), 3).eval().requires_grad_(False)  # noqa: E731
    layout = build_request_layout(128, 64, 124, torch.ones(6, dtype=torch.long))
    timesteps, indices = layout.row_timesteps(0.4, 0.6)
    g = torch.Generator().manual_seed(0)
    inputs = dict(
        video_rows=torch.randn(1, layout.video_indices.numel(), config.video_patch_dim, generator=g),
        audio_rows=torch.randn(1, layout.audio_indices.numel(), config.audio_in_channels, generator=g),
        text_states=torch.randn(1, 6, config.text_dim, generator=g), timesteps=timesteps, timestep_indices=indices,
        token_tags=layout.token_tags, position_ids=layout.position_ids, video_indices=layout.video_indices,
        audio_indices=layout.audio_indices, text_indices=layout.text_indices,
    )
    lora = load_lora(write_native(tmp_path / "style.safetensors", fused(random_spec(config, seed=4, shared_qkv_a=True))))
    eager_model, model = make(), make().compile_blocks()
    close = lambda a, b: all(torch.allclose(x, y, atol=1e-4) for x, y in zip(a, b))  # noqa: E731
    torch._dynamo.reset()  # an earlier test's graph (any length) would serve this one
    counters.clear()
    with torch.inference_mode():
        plain = eager_model(**inputs)
        assert close(model(**inputs), plain)
        assert counters["stats"]["unique_graphs"] == 1  # three blocks, one graph
        one_timestep = dict(inputs, **dict(zip(("timesteps", "timestep_indices"), layout.row_timesteps(0.5, 0.5))))
        assert one_timestep["timesteps"].numel() == 1 and timesteps.numel() == 2  # a first step's count, then the rest's
        assert close(model(**one_timestep), eager_model(**one_timestep))
        assert counters["stats"]["unique_graphs"] == 1  # and still one graph
        apply_loras(eager_model, [(lora, 0.8)], partition="fl2va", mode="dynamic")
        apply_loras(model, [(lora, 0.8)], partition="fl2va", mode="dynamic")
        adapted = eager_model(**inputs)
        assert not close(adapted, plain)
        assert all(torch.equal(x, y) for x, y in zip(model(**inputs), adapted))  # eager blocks: bitwise
        remove_loras(model)
        assert close(model(**inputs), plain) and counters["stats"]["unique_graphs"] == 1


def test_compiled_blocks_serve_every_length_with_one_graph(monkeypatch):
    """The row count is dynamic in the compiled block: a graph per sequence length (canvas, duration, prompt
    length) cost a compile at each new prompt length, and past dynamo's limit of graphs (8 by default, 1 here)
    a new one ran eager for the rest of the process, slower and unlike the same request in a fresh one."""
    import torch._dynamo.config
    from torch._dynamo.utils import counters

    from h3_core.tiny import tiny_random_dit

    def run(dit, lengths):
        torch._dynamo.reset()
        counters.clear()
        hidden = dit.config.hidden_size
        with torch.inference_mode():
            for rows in lengths:
                x, table = torch.randn(1, rows, hidden), torch.randn(6, 6 * hidden)
                index = torch.randint(0, 6, (rows,))
                assert torch.allclose(dit.blocks[0](x, table, index, None), eager.blocks[0](x, table, index, None),
                                      atol=1e-4)
        return counters["stats"]["unique_graphs"]

    eager, dit = tiny_random_dit(torch.float32), tiny_random_dit(torch.float32).compile_blocks()
    with torch._dynamo.config.patch(recompile_limit=1):
        assert run(dit, (40, 48, 1000)) == 1
        # what still makes new graphs is compiled past dynamo's limit, its own setting left as it was
        monkeypatch.setattr(torch._dynamo, "maybe_mark_dynamic", lambda *args: None)
        assert run(dit, (40, 48)) == 2 and torch._dynamo.config.recompile_limit == 1


def test_compiled_blocks_can_be_switched_off_and_on_again():
    """set_compiled(False) gives back the eager forwards; True again reuses the kept compiled ones (no new compile)."""
    from h3_core.tiny import tiny_random_dit

    dit = tiny_random_dit(torch.float32)
    dit.set_compiled(True)
    compiled = [block.forward for block in dit.blocks]
    assert all(type(forward).__name__ == "_CompiledForward" for forward in compiled)
    dit.set_compiled(False)
    assert all("forward" not in block.__dict__ and block.forward.__func__ is type(block).forward for block in dit.blocks)
    dit.set_compiled(True)
    assert [block.forward for block in dit.blocks] == compiled
