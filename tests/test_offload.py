"""Block streaming gives the resident model's outputs; the memory planner's choices."""

import gc
import sys
import weakref
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from h3_core.config import DiTConfig, TINY_DIT
from h3_core.memory_plan import (GIB, MemoryPlan, activation_bytes, adaln_weight_bytes, block_weight_bytes, plan_memory,
                                 usable_bytes)
from h3_core.layout import build_request_layout
from h3_core.noise import request_generator, target_noise
from h3_core.offload import is_streamed, stream_blocks
from h3_core.sampler import DualClockSchedule, denoise
from h3_core.dit import H3DiT
from h3_core.tiny import seeded_random_weights, tiny_random_dit


def _tiny_dit(layers: int, seed: int = 1) -> H3DiT:
    """The tiny DiT with `layers` blocks of seeded random weights, for inference."""
    return seeded_random_weights(H3DiT(replace(TINY_DIT, num_layers=layers)), seed).eval().requires_grad_(False)


def run(model, **kwargs):
    layout = build_request_layout(128, 64, 124, torch.ones(6, dtype=torch.long))
    video, audio = target_noise(layout, request_generator(9))
    text = torch.randn(1, 6, 48, generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        return denoise(model, layout, text, video, audio, DualClockSchedule.build(4), **kwargs)


@pytest.mark.parametrize("resident, prefetch", [(0, 1), (1, 1), (0, 2), (2, 1)])
def test_streamed_equals_resident(resident, prefetch):
    expected = run(_tiny_dit(4))
    model = _tiny_dit(4)
    streamer = stream_blocks(model, "cpu", resident=resident, prefetch=prefetch)
    assert len(streamer.slots) == min(4 - resident, prefetch + 2)
    fetched = []
    real_fetch = streamer._fetch
    streamer._fetch = lambda i: (fetched.append(i), real_fetch(i))[1]
    got = run(model)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    # Every streamed block was fetched in each of the 3 forwards, and is back home afterwards.
    assert sorted(set(fetched)) == list(range(4))
    for index in streamer.home:
        block_params = [p for n, p in model.blocks[index].named_parameters() if not n.startswith("adaln_proj.")]
        assert all(p.data_ptr() == home.data_ptr() for p, home in zip(block_params, streamer.home[index]))
    streamer.remove()
    assert all(not block._forward_pre_hooks for block in model.blocks)
    assert streamer.slots == [] and streamer.loaded == {}  # the GPU slots go with the hooks


def test_a_forward_that_failed_part_way_leaves_no_stale_block_in_the_slots():
    """A block failing mid-forward (an out-of-memory) skipped the hooks that mark its slot free: the next forward
    through the same streamer (h3 generate's next job of a batch) took other blocks' weights for blocks marked as
    still loaded, silently."""
    expected = run(_tiny_dit(6, seed=7))
    model = _tiny_dit(6, seed=7)
    streamer = stream_blocks(model, "cpu", resident=0, prefetch=1)
    model.blocks[2].forward = lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("out of memory (injected)"))
    with pytest.raises(RuntimeError, match="injected"):
        run(model)
    assert streamer.loaded  # blocks 2 and 3 were in slots when it failed
    del model.blocks[2].forward
    for a, b in zip(expected, run(model)):
        assert torch.equal(a, b)
    streamer.remove()


def test_removing_the_streamer_after_a_failed_forward_sends_every_block_home():
    """`remove()` right after a forward that failed (ComfyUI freeing the model after an out-of-memory) left the
    blocks that were in slots pointing into slots no one holds; every block must be back at its CPU weights, and
    a copy still queued must finish before the slots are given back."""
    model = _tiny_dit(4, seed=3)
    streamer = stream_blocks(model, "cpu", resident=0, prefetch=1)
    model.blocks[2].forward = lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("out of memory (injected)"))
    with pytest.raises(RuntimeError, match="injected"):
        run(model)
    del model.blocks[2].forward
    assert streamer.loaded
    homes = {index: [view.data_ptr() for view in views] for index, views in streamer.home.items()}
    streamer.copy_stream = SimpleNamespace(synchronized=0)
    streamer.copy_stream.synchronize = lambda: setattr(streamer.copy_stream, "synchronized", 1)
    streamer.remove()
    assert streamer.copy_stream.synchronized
    for index, block in enumerate(model.blocks):
        params = [p for n, p in block.named_parameters() if not n.startswith("adaln_proj.")]
        assert [p.data_ptr() for p in params] == homes[index], f"block {index} still points into a slot"


def test_streamed_blocks_not_pinned_stay_the_files_pages(tmp_path):
    """Weights read as stored are views of the file mapped into memory (safetensors): the OS's file cache,
    which a host short of memory drops and reads from disk again. Blocks streamed unpinned (past a host's
    pinned budget; every block on a CPU device) copy from there: before, each was copied into memory the
    process holds (a 32 GB host with the bf16 DiT streamed: swapping or stopped). Same outputs."""
    from safetensors.torch import save_file

    from h3_core.checkpoint import DiTReader
    from h3_core.offload import _streamed_parameters, unplace
    from h3_core.runtime import file_mapped_ranges, in_mapped_file

    config = replace(TINY_DIT, num_layers=4)
    expected = run(_tiny_dit(4))
    path = tmp_path / "dit.safetensors"
    save_file(_tiny_dit(4).state_dict(), str(path))
    model = DiTReader(path, config=config).read("cpu")
    as_read = {i: [p.data for p in _streamed_parameters(block)] for i, block in enumerate(model.blocks)}
    mapped = file_mapped_ranges()
    assert all(in_mapped_file(t, mapped) for weights in as_read.values() for t in weights)
    assert not in_mapped_file(torch.ones(1 << 16), mapped) and not in_mapped_file(torch.empty(0), mapped)

    streamer = stream_blocks(model, "cpu", resident=1)
    assert streamer.pinned_blocks == 0 and sorted(streamer.home) == [1, 2, 3]
    for index, homes in streamer.home.items():
        assert [t.data_ptr() for t in homes] == [t.data_ptr() for t in as_read[index]]
    # Close, not bit-equal: a safetensors file aligns its tensors to 8 bytes, not 64, and on some CPUs (AVX2)
    # MKL's matmul sums such inputs in another order: 1e-6 apart unstreamed too, equal once cloned to aligned memory.
    for a, b in zip(expected, run(model), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    unplace(model, "cpu", streamer)
    for index in (1, 2, 3):
        now = _streamed_parameters(model.blocks[index])
        assert [p.data_ptr() for p in now] == [t.data_ptr() for t in as_read[index]]


def _resident_pages(tensor) -> float:
    """The share of a mapped tensor's pages in the OS's file cache (mincore)."""
    import ctypes
    import os

    libc, page = ctypes.CDLL(None, use_errno=True), os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page * page
    pages = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size() - start) // page)
    vector = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vector) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vector) / pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="read-ahead advice and mincore are Linux's")
def test_read_ahead_brings_a_mapped_files_pages_in(tmp_path):
    """The advice covers the whole tensor: Linux reads at most its read-ahead size (often 128 KiB) a call, and
    one call for the whole range had brought in 16 of 256 MiB here."""
    import os
    import time

    from safetensors import safe_open
    from safetensors.torch import save_file

    from h3_core.runtime import read_ahead

    path = tmp_path / "weights.safetensors"
    save_file({"w": torch.randn(16, 1024, 1024)}, str(path))  # 64 MiB
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        with safe_open(path, "pt") as handle:
            tensor = handle.get_tensor("w")
        if _resident_pages(tensor) > 0.1:
            pytest.skip(f"the OS kept {path}'s pages when asked to drop them (a memory file system?)")
        assert read_ahead([tensor])
        deadline = time.monotonic() + 10
        while _resident_pages(tensor) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        # all of it, but for the few pages a busy machine's memory pressure may take back while we look (0.9986 of
        # them once, beside another test suite); one call for the whole range brought in 0.06
        assert _resident_pages(tensor) > 0.99
    finally:
        os.close(descriptor)


def test_streamed_blocks_on_file_are_read_ahead_before_their_copy(tmp_path, monkeypatch):
    """Each unpinned block whose weights are a file's pages is advised READ_AHEAD_BLOCKS blocks before it is
    copied (into the next forward too), once a forward; blocks not on a file are not."""
    from safetensors.torch import save_file

    from h3_core import offload
    from h3_core.checkpoint import DiTReader

    config = replace(TINY_DIT, num_layers=6)
    path = tmp_path / "dit.safetensors"
    save_file(_tiny_dit(6).state_dict(), str(path))
    model = DiTReader(path, config=config).read("cpu")
    events = []
    monkeypatch.setattr(offload, "read_ahead", lambda tensors: events.append(("read", len(tensors))) or True)
    streamer = stream_blocks(model, "cpu", resident=1)
    assert sorted(streamer.on_file) == [1, 2, 3, 4, 5]
    real_advise, real_fetch = streamer._advise, streamer._fetch
    streamer._advise = lambda i: (events.append(("advise", i)), real_advise(i))
    streamer._fetch = lambda i: (events.append(("fetch", i)) if i in streamer.home and i not in streamer.loaded
                                 else None, real_fetch(i))
    for index, block in enumerate(model.blocks):  # after the streamer's own hooks
        block.register_forward_pre_hook(lambda module, args, index=index: events.append(("run", index)))
    run(model)
    streamer.reader.shutdown(wait=True)
    advised = [i for kind, i in events if kind == "advise" and i in streamer.on_file]
    fetched = [i for kind, i in events if kind == "fetch"]
    assert fetched == [1, 2, 3, 4, 5] * 3  # three forwards
    assert sorted(advised) == sorted([1, 2, 3, 4, 5] * 3)  # once a forward each
    for index in (1, 2, 3, 4, 5):  # after the first forward, each copy is advised since the one before, while
        copies = [n for n, event in enumerate(events) if event == ("fetch", index)]  # two blocks run
        for before, copy in zip(copies, copies[1:]):
            advice = max(n for n in range(before, copy) if events[n] == ("advise", index))
            assert sum(kind == "run" for kind, _ in events[advice:copy]) == offload.READ_AHEAD_BLOCKS == 2
    weights = len(offload._streamed_parameters(model.blocks[1]))
    assert [event for event in events if event[0] == "read"] == [("read", weights)] * 15
    offload.unplace(model, "cpu", streamer)
    assert streamer.reader is None


def test_streamed_blocks_are_pinned_only_within_the_memory_the_system_has_available(monkeypatch):
    """Pinned memory can be neither swapped nor dropped: `h3 generate` pinned every streamed block (~25 GB of a
    bf16 DiT on a 24 GB card) whatever the host had. place() now pins at most what is available less 4 GiB,
    within a host's own budget too; where the system does not say, the budget alone."""
    from h3_core import offload, runtime

    asked = []
    monkeypatch.setattr(offload, "stream_blocks", lambda *args: asked.append(args[-1]))
    plan = MemoryPlan(1, 1, True, 0, True)
    for available, budget, pinned in ((10 * GIB, None, 6 * GIB), (10 * GIB, 2 * GIB, 2 * GIB),
                                      (10 * GIB, 9 * GIB, 6 * GIB), (3 * GIB, None, 0), (None, None, None),
                                      (None, 5 * GIB, 5 * GIB)):
        monkeypatch.setattr(runtime, "host_memory_available", lambda: available)
        offload.place(tiny_random_dit(), "cpu", plan, pin_bytes=budget)
        assert asked.pop() == pinned


def test_a_dit_that_already_streams_is_not_streamed_again():
    model = _tiny_dit(3)
    streamer = stream_blocks(model, "cpu", resident=1)
    with pytest.raises(ValueError, match="already stream"):
        stream_blocks(model, "cpu", resident=0)
    streamer.remove()
    stream_blocks(model, "cpu", resident=0).remove()  # once removed, it may stream again


def test_an_old_streamers_second_remove_leaves_the_new_one_streaming():
    """remove() unmarks the model only where it is this streamer's: a streamer removed again after the model was
    streamed anew (a cleanup running twice) must not make the new streamer's blocks look unstreamed."""
    model = _tiny_dit(4)
    old = stream_blocks(model, "cpu", resident=1)
    old.remove()
    new = stream_blocks(model, "cpu", resident=0)
    assert len(new.slots) == 3  # by default one block is copied ahead: its slot, the computing one's and one free
    old.remove()
    assert is_streamed(model)
    new.remove()
    assert not is_streamed(model)


def test_streaming_puts_the_shared_parts_on_the_device_and_every_adaln_projection_on_the_cpu():
    """The AdaLN projections (the time embedder, each block's, the final layer's) stay on the CPU: the sampler's
    tables bring each over once; the rest of the final layer, the other shared parts and the rope table go to the
    device; the streamed blocks keep their CPU homes. ("meta" stands in for a GPU.)"""
    model = _tiny_dit(3)
    streamer = stream_blocks(model, "meta", resident=0)
    adaln = {id(p) for module in model.adaln_modules() for p in module.parameters()}
    streamed = {id(p) for block in model.blocks for p in block.parameters()}
    for name, param in model.named_parameters():
        where = "cpu" if id(param) in adaln or id(param) in streamed else "meta"
        assert param.device.type == where, f"{name} is on {param.device.type}, expected {where}"
    assert model.rope_inv_freq.device.type == "meta"
    streamer.remove()


def test_the_bytes_a_plan_keeps_off_the_device_are_known_before_placing():
    """streamed_bytes (what ComfyUI is told before the model moves) equals what the streamer then keeps off the
    device: the streamed blocks less their prefetch + 2 slots; nothing when every block stays."""
    from h3_core.offload import streamed_bytes

    model = _tiny_dit(6)
    for resident, prefetch in ((0, 1), (1, 1), (2, 1), (0, 2)):
        streamer = stream_blocks(model, "cpu", resident=resident, prefetch=prefetch)
        plan = MemoryPlan(resident, prefetch, True, 0, True)
        assert streamed_bytes(model, plan) == streamer.offloaded_bytes > 0, (resident, prefetch)
        streamer.remove()
    assert streamed_bytes(model, MemoryPlan(6, 1, True, 0, True)) == 0  # streams, but every block is resident
    assert streamed_bytes(model, MemoryPlan(0, 0, True, 0, True)) == 0


def test_the_weights_are_read_onto_the_device_only_where_the_plan_keeps_them_all_there():
    from h3_core.offload import load_device

    for prefetch, offload_adaln, where in ((0, False, "cuda"), (0, True, "cpu"), (1, False, "cpu"), (1, True, "cpu")):
        plan = MemoryPlan(1, prefetch, offload_adaln, 0, True)
        assert load_device(plan, "cuda") == torch.device(where), (prefetch, offload_adaln)


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
    # One block measured 150,912 bytes a row above its input on the H200 (bench/offload_bench.py), whose
    # peak is in attention: 3 hidden + 9 inner + 2 x 96 bf16 values a row, input included.
    rope_and_index = 2 * 4 * 96 + 8
    assert activation_bytes(REAL, ROWS_124F, 2) == ROWS_124F * (150_912 + 2 * 5376 + rope_and_index)


# One real-config block on an H200 (bench/held_block_peak.py, 2026-12-03): peak allocated above its input, plus the
# input, cos/sin and row index, by how its linears are held; (packed rows, bytes) at 512x512 x 39 frames, 768x768
# x 56 and 1344x768 x 124. GGUF: Q4_K (0.5625 bytes a weight) and IQ4_XS (0.53125).
BLOCK_PEAKS_H200 = {
    "dense": [(3714, 603302416), (10490, 1708573136), (38222, 6209570928)],
    "fp8-scaled": [(3714, 750187536), (10490, 2116259792), (38222, 7701750384)],
    "fp8": [(3714, 1395739152), (10490, 1979537872), (38222, 6209570928)],
    "int8": [(3714, 2012416528), (10490, 2310470096), (38222, 6209570928)],
    "int4": [(3714, 2012416528), (10490, 2310012368), (38222, 6209570928)],
    "nvfp4": [(3714, 1723288080), (10490, 2142854608), (38222, 6209570928)],
    "gguf:0.5625": [(3714, 1087457808), (10490, 1826445776), (38222, 6209570928)],
    "gguf:0.53125": [(3714, 1578781712), (10490, 2070601680), (38222, 6209570928)],
}


@pytest.mark.parametrize("held", list(BLOCK_PEAKS_H200))
def test_activation_plan_matches_one_block_measured_for_each_held_format(held):
    """The plan follows each format's own peak: FP8 matmuls' quantized fc2 input, weight-only linears'
    rebuilt weights at small row counts (e4m3 8 bytes a weight, ConvRot int8 and int4 12). Before, every FP8
    kind was planned alike: 2.5 GiB high at 1344x768 x 124, and up to 765 MiB low for int8 at small ones."""
    mib = 2**20
    above = 600 * mib if held.startswith("gguf") else 20 * mib  # every GGML type planned at 10 bytes a weight
    for rows, measured in BLOCK_PEAKS_H200[held]:
        planned = activation_bytes(REAL, rows, 2, held)
        assert -5 * mib <= planned - measured <= above, (held, rows, (planned - measured) / mib)


@pytest.mark.parametrize(
    "budget_gib, rows, all_resident",
    [(139, ROWS_124F, True), (60, ROWS_124F, True), (56, 63_704, True), (40, ROWS_124F, False),
     (24, ROWS_124F, False), (24, 63_704, False), (12, ROWS_124F, False), (16, 20_000, False)],
)
def test_planner_choices(budget_gib, rows, all_resident):
    budget = int(budget_gib * GIB)
    plan = plan_memory(REAL, rows, budget)
    block = block_weight_bytes(REAL, 2)
    assert plan.fits and plan.expected_peak_bytes <= usable_bytes(budget) < budget - 256 * 2**20
    assert plan.streams != all_resident
    if all_resident:
        assert plan.resident_blocks == 50
        # AdaLN weights (~24 GiB) stay on the GPU only when they fit beside everything else.
        assert plan.offload_adaln == (budget_gib < 100)
    else:  # maximal: one more resident block would not fit
        assert plan.expected_peak_bytes + block > usable_bytes(budget)
        assert 0 <= plan.resident_blocks < 50
    # More memory never means fewer resident blocks.
    assert plan_memory(REAL, rows, budget + 4 * GIB).resident_blocks >= plan.resident_blocks


def test_planner_says_when_nothing_fits():
    plan = plan_memory(REAL, 108_000, 8 * GIB)  # a 15 s clip in 8 GiB: activations alone exceed it
    assert not plan.fits and plan.resident_blocks == 0
    assert plan.expected_peak_bytes > 8 * GIB


def test_fixed_allocator_segments_keep_one_block_of_activations_spare():
    """With torch's default (fixed-size) segments a whole request streamed for 24 GiB reserved 4.7 GiB
    beyond what it allocated: the plan keeps one block's activations (about 5.8 GiB at 124 frames) free for that."""
    from h3_core.runtime import fixed_allocator_segments

    plain, fixed = plan_memory(REAL, ROWS_124F, 24 * GIB), plan_memory(REAL, ROWS_124F, 24 * GIB, fixed_segments=True)
    spare = activation_bytes(REAL, ROWS_124F, 2)
    assert round(spare / GIB, 1) == 5.8  # the README's figure
    assert fixed.resident_blocks < plain.resident_blocks
    assert fixed.expected_peak_bytes <= usable_bytes(24 * GIB)  # its peak counts the block kept spare
    assert fixed.expected_peak_bytes - spare <= usable_bytes(24 * GIB) - spare < plain.expected_peak_bytes
    # a refusal quotes a need above the budget (it quoted 9.41 GiB against 11.15 usable, the spare block unsaid)
    small = plan_memory(REAL, ROWS_124F, 12 * GIB, fixed_segments=True)
    assert not small.fits and small.expected_peak_bytes > usable_bytes(12 * GIB)
    with pytest.raises(ValueError, match="prefetch must be at least 1 block, got 0"):
        plan_memory(REAL, ROWS_124F, 24 * GIB, prefetch=0)  # it planned resident blocks with nothing streaming
    assert fixed_allocator_segments({})
    assert fixed_allocator_segments({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"})
    assert not fixed_allocator_segments({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert not fixed_allocator_segments({"PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.6, expandable_segments:true"})
    assert not fixed_allocator_segments({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})  # ComfyUI's default


def test_plan_for_a_layout_and_place_by_it(monkeypatch):
    """plan_for reads the rows and per-step timesteps from the layout; place() then streams or keeps
    everything resident, and the outputs equal the unplaced model's."""
    from h3_core import memory_plan
    from h3_core.layout import build_request_layout
    from h3_core.memory_plan import plan_for
    from h3_core.offload import load_device

    layout = build_request_layout(1344, 768, 124, torch.ones(512, dtype=torch.long))
    assert layout.sequence_length == ROWS_124F
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    small = plan_for(REAL, layout, 50, "cuda", budget_gib=24)
    assert small.streams and small == plan_memory(REAL, ROWS_124F, 24 * GIB, 49, 2)
    besides = plan_for(REAL, layout, 50, "cuda", budget_gib=24, other_bytes=2 * GIB)  # hooked LoRA factors, say
    assert besides == plan_memory(REAL, ROWS_124F, 22 * GIB, 49, 2) and besides.resident_blocks < small.resident_blocks
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # torch's default: fixed-size segments
    assert plan_for(REAL, layout, 50, "cuda", budget_gib=24) == plan_memory(REAL, ROWS_124F, 24 * GIB, 49, 2,
                                                                            fixed_segments=True)
    big = plan_for(REAL, layout, 50, "cpu")
    assert not big.streams and not big.offload_adaln
    assert load_device(big, "cuda") == torch.device("cuda") and load_device(small, "cuda") == torch.device("cpu")
    with pytest.raises(ValueError, match="positive number of GiB"):
        plan_for(REAL, layout, 50, "cuda", budget_gib=0)
    # a budget the GPU cannot hold (32 on a 24 GiB card) was planned for as it stood: an OOM mid-run
    monkeypatch.setattr(memory_plan, "total_bytes", lambda device: 24 * GIB)
    with pytest.raises(ValueError, match=r"The GPU memory budget \(32 GiB\) is more than cuda has \(24.0 GiB in all\); "
                                         r"give at most that, or none \(0 in the H3 loaders\) for what is free"):
        plan_for(REAL, layout, 50, "cuda", budget_gib=32)
    assert plan_for(REAL, layout, 50, "cuda", budget_gib=24).streams  # the whole card: planned as before


def test_the_run_plans_the_dit_in_the_dtype_it_is_read_in(monkeypatch):
    """generate / h3 generate --dtype fp32 read the DiT in float32 but planned it in bf16 (2 bytes a weight): a
    plan of every block resident that peaked at twice its weights."""
    from h3_core import memory_plan, pipeline
    from h3_core.layout import build_request_layout
    from h3_core.memory_plan import plan_for

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setattr(memory_plan, "total_bytes", lambda device: 80 * GIB)  # an 80 GiB card, whichever runs this
    told = []  # what a GGUF file's plain block linears are counted at
    monkeypatch.setattr(pipeline, "held_linears",  # a bf16 release's files
                        lambda source, linears, dtype_bytes: told.append(dtype_bytes) or "dense")
    monkeypatch.setattr(pipeline, "holds_stored_linears", lambda source: False)
    release = SimpleNamespace(config=REAL)
    layout = build_request_layout(1344, 768, 124, torch.ones(512, dtype=torch.long))
    plans = {}
    for dtype, itemsize in ((torch.float32, 4), (torch.bfloat16, 2)):
        settings = pipeline.GenerateSettings(device="cuda", dtype=dtype, gpu_memory=80)
        plans[itemsize] = pipeline.sampling_plan(REAL, release, "fl2va", settings, [], layout, 50)
        assert plans[itemsize] == plan_for(REAL, layout, 50, "cuda", 80, dtype_bytes=itemsize)
    assert not plans[2].streams and plans[4].streams  # bf16 fits 80 GiB; float32 does not
    assert told == [4, 2]


@pytest.mark.parametrize("streams", [True, False])
def test_place_follows_the_plan(streams):
    """A streamed plan installs the streamer; a resident plan with AdaLN offloaded moves everything but
    the AdaLN weights. Either way the sampler's outputs equal the unplaced model's."""
    from h3_core.offload import place

    expected = run(tiny_random_dit())
    model = tiny_random_dit()
    plan = MemoryPlan(1 if streams else 2, 1 if streams else 0, True, 0, True)
    streamer = place(model, "cpu", plan)
    assert (streamer is not None) == streams
    got = run(model, offload_adaln=True)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    if streamer is not None:
        assert sorted(streamer.home) == [1]
        streamer.remove()


def _tiny_generate(tmp_path, **settings):
    from h3_core import pipeline
    from h3_core.conditioning import Request

    request = Request("t2va", "a fox on the beach", duration=4)
    (result,) = pipeline.generate(request, "tiny-random", pipeline.GenerateSettings(steps=3, **settings),
                                  save_latents=tmp_path / f"{len(list(tmp_path.iterdir()))}.safetensors")
    return result.latents


def test_generate_streams_when_the_plan_says_so(tmp_path, monkeypatch):
    """generate() places the DiT by the plan: a streamed placement gives the resident latents bitwise,
    and a budget nothing fits in is refused before any DiT weight is read."""
    from h3_core import pipeline
    from h3_core.conditioning import RequestError
    from h3_core.output import AVLatents

    resident = _tiny_generate(tmp_path)
    placed, alive_at_save = [], []
    real_place, real_save = pipeline.place, AVLatents.save

    def place(*args):
        streamer = real_place(*args)
        placed.append(weakref.ref(streamer))
        return streamer

    def save(latents, *args, **kwargs):  # after sampling: the streamer (and the blocks it holds) must be gone
        gc.collect()
        alive_at_save.append(placed[-1]())
        return real_save(latents, *args, **kwargs)

    emptied_when = []  # whether the streamer was gone at each emptying of the caches once it was placed
    real_empty = pipeline.empty_caches

    def empty_caches(device=None):
        real_empty(device)  # collects first
        if placed:
            emptied_when.append(placed[-1]() is None)

    monkeypatch.setattr(pipeline, "plan_for", lambda *args, **kwargs: MemoryPlan(1, 1, True, 0, True))
    monkeypatch.setattr(pipeline, "place", place)
    monkeypatch.setattr(pipeline, "empty_caches", empty_caches)
    monkeypatch.setattr(AVLatents, "save", save)
    streamed = _tiny_generate(tmp_path)
    assert placed and alive_at_save == [None]  # streamed, then dropped before the outputs are written
    # the caches were emptied after the DiT was dropped (before, its pinned blocks went to torch's host cache after
    # the only emptying, which ran while generate's own names still held it, and stayed there)
    assert True in emptied_when
    assert torch.equal(resident.video, streamed.video) and torch.equal(resident.audio, streamed.audio)
    monkeypatch.undo()
    monkeypatch.setattr(pipeline, "DiTReader", lambda *a, **k: pytest.fail("weights read for a request that cannot fit"))
    with pytest.raises(RequestError, match="even with every DiT block streamed"):
        _tiny_generate(tmp_path, gpu_memory=1e-6)


def test_a_budget_too_small_for_the_sampling_is_refused_before_the_text_encoder(tmp_path, monkeypatch):
    """--gpu-memory below what the DiT needs even streamed was refused only once the prompt was encoded: after
    reading and running the 51 GB text encoder. The rows the clip alone takes are planned before any model."""
    from h3_core import pipeline
    from h3_core.conditioning import RequestError

    monkeypatch.setattr(pipeline, "load_text_encoder_for",
                        lambda *a, **k: pytest.fail("the text encoder loaded for a request that cannot fit"))
    for budget, said in ((1e-6, "0.0 MiB"), (0.05, "51.2 MiB")):  # needs less than 0.05 GiB, not less than it
        # holds past the headroom; amounts below 0.1 GiB in MiB (they read "0.00 GiB")
        with pytest.raises(RequestError, match=r"needs about \d+\.\d MiB on cpu, before any model loads, even with "
                                               r"every DiT block streamed from the CPU, more than --gpu-memory "
                                               rf"\({said}: 0\.0 MiB left for the DiT after the allocator's "
                                               r"headroom \(5% and 256 MiB\)\)"):
            _tiny_generate(tmp_path, gpu_memory=budget)


def test_the_plan_before_any_model_counts_the_keyframes_rows(tmp_path, monkeypatch):
    """fl2va's keyframes are rows of the sampling too (a latent frame each): the plan made before any model
    loads counts them, so it differs from the one after encoding by the prompt's rows alone."""
    from PIL import Image

    from h3_core import pipeline
    from h3_core.conditioning import Request

    planned, real_plan = [], pipeline.sampling_plan
    monkeypatch.setattr(pipeline, "sampling_plan", lambda config, source, partition, settings, loras, layout, *rest:
                        planned.append(layout) or real_plan(config, source, partition, settings, loras, layout, *rest))
    picture = Image.new("RGB", (96, 64), "teal")
    request = Request("fl2va", "a fox on the beach", first_image=picture, last_image=picture, duration=4)
    pipeline.generate(request, "tiny-random", pipeline.GenerateSettings(steps=2), save_latents=tmp_path / "a.safetensors")
    before, after = planned[0], planned[-1]
    assert len(planned) == 2 and before.num_condition_video_rows == after.num_condition_video_rows > 0
    assert before.sequence_length == after.sequence_length - after.num_text_rows + 1


def test_the_plan_before_any_model_counts_the_references_their_sizes_fix(tmp_path, monkeypatch):
    """ref2va's references are rows of the sampling too (up to 7,296 an image at the release's size; a video
    reference as many as the clip): the plan made before any model loads counted none. Images are counted
    exactly (the prompt's rows are then the only difference); a video at the frames its seconds surely hold,
    never more than it gets."""
    import numpy as np
    from PIL import Image

    from h3_core import pipeline
    from h3_core.conditioning import Request
    from h3_core.references import DecodedAudio, DecodedVideo

    planned, real_plan = [], pipeline.sampling_plan
    monkeypatch.setattr(pipeline, "sampling_plan", lambda config, source, partition, settings, loras, layout, *rest:
                        planned.append(layout) or real_plan(config, source, partition, settings, loras, layout, *rest))
    wide, tall = Image.new("RGB", (120, 64), "teal"), Image.new("RGB", (64, 96), "tan")
    clip = DecodedVideo(np.full((90, 48, 80, 3), 90, dtype=np.uint8), 30.0)  # 3 s at 30 fps
    voice = DecodedAudio(np.zeros(32000 * 2, dtype=np.float32), 32000)

    def plans(references):
        planned.clear()
        request = Request("ref2va", "a fox on the beach", references=references, duration=4)
        pipeline.generate(request, "tiny-random", pipeline.GenerateSettings(steps=2),
                          save_latents=tmp_path / f"{len(list(tmp_path.iterdir()))}.safetensors")
        assert len(planned) == 2
        return planned[0], planned[-1]

    before, after = plans([("image", wide), ("image", tall)])
    assert before.num_condition_video_rows == after.num_condition_video_rows > 0
    assert before.sequence_length == after.sequence_length - after.num_text_rows + 1
    images = before.sequence_length
    before, after = plans([("image", wide), ("image", tall), ("video", clip), ("audio", voice)])
    assert images < before.sequence_length <= after.sequence_length - after.num_text_rows + 1


def test_the_plan_before_any_model_counts_the_guides_pictures(tmp_path, monkeypatch):
    """A guide's picture is rows of the sampling too (an image one latent frame, a clip its own): the plan made
    before any model loads counts them, so with pictures alone it differs from the one after encoding by the
    prompt's rows; a guide's sound (a few rows) is left out, never over-counted."""
    import numpy as np
    from PIL import Image

    from h3_core import pipeline
    from h3_core.conditioning import Request
    from h3_core.guides import GuideMedia

    planned, real_plan = [], pipeline.sampling_plan
    monkeypatch.setattr(pipeline, "sampling_plan", lambda config, source, partition, settings, loras, layout, *rest:
                        planned.append(layout) or real_plan(config, source, partition, settings, loras, layout, *rest))
    still = GuideMedia(30, Image.new("RGB", (96, 64), "teal"))
    clip = GuideMedia(-22, np.full((22, 64, 96, 3), 90, dtype=np.uint8))
    sound = GuideMedia(60, waveform=np.zeros((2, 32000), dtype=np.float32), sample_rate=32000)
    for guides, exact in (([still, clip], True), ([still, clip, sound], False)):
        planned.clear()
        request = Request("t2va", "a fox on the beach", guides=guides, duration=4)
        pipeline.generate(request, "tiny-random", pipeline.GenerateSettings(steps=2),
                          save_latents=tmp_path / f"{len(guides)}.safetensors")
        before, after = planned[0], planned[-1]
        assert len(planned) == 2 and before.num_condition_video_rows == after.num_condition_video_rows > 0
        prompt = after.num_text_rows - 1
        assert (before.sequence_length == after.sequence_length - prompt) if exact else (
            before.sequence_length < after.sequence_length - prompt)


@pytest.mark.parametrize("mode, seconds", [("full", 20), ("continuation", 532 / 24)])  # windows 0-276, 255-531
def test_the_plan_before_any_model_counts_a_long_videos_largest_window(tmp_path, monkeypatch, mode, seconds):
    """A long video's plan before any model loads was the first window's request: at most one request's 362
    frames (a full 20 s video has 481), without the latent tail and the guides' pictures of later windows. A job
    that cannot fit was let through until the text encoder had run. It is now the largest window's rows but for
    the prompt's."""
    from PIL import Image

    from h3_core import pipeline
    from h3_core.conditioning import Request
    from h3_core.guides import GuideMedia
    from h3_core.long_video import LongVideoRequest, encode_long_video
    from h3_core.tiny import tiny_random_video_vae
    from h3_core.tiny_text import tiny_random_text_encoder

    class Stop(Exception):
        pass

    planned, real_plan = [], pipeline.sampling_plan
    monkeypatch.setattr(pipeline, "sampling_plan", lambda config, source, partition, settings, loras, layout, *rest:
                        planned.append(layout) or real_plan(config, source, partition, settings, loras, layout, *rest))
    monkeypatch.setattr(pipeline, "load_text_encoder_for", lambda *a, **k: (_ for _ in ()).throw(Stop()))
    guide = GuideMedia(400, Image.new("RGB", (96, 64), "teal"))  # in the second window of the continuation
    request = LongVideoRequest(Request("t2va", "a fox on the beach", duration=seconds), mode=mode, guides=[guide])
    with pytest.raises(Stop):
        pipeline.generate(request, "tiny-random", pipeline.GenerateSettings(steps=2),
                          save_latents=tmp_path / "a.safetensors")
    encoded = encode_long_video(request, tiny_random_text_encoder(), tiny_random_video_vae("cpu"), None,
                                rules=pipeline.canvas_rules("tiny-random"))
    largest = pipeline.largest_layout(encoded)
    assert len(planned) == 1 and largest.latent_frames == planned[0].latent_frames
    assert planned[0].sequence_length == largest.sequence_length - largest.num_text_rows + 1
    if mode == "continuation":  # the second window is the largest: a latent tail, then the guide's frame
        assert largest.num_condition_video_rows == (7 + 1) * (8 // 2) * (14 // 2)  # 2x2 patches


def test_the_text_encoder_is_placed_in_what_the_vaes_leave_of_the_budget(monkeypatch):
    """The VAEs (~5.75 GiB at the release's size) sit beside the text encoder while it encodes: an int8 encoder
    (25 GiB) was kept resident in a 30 GiB --gpu-memory as if they were not there, and the run went over it."""
    from h3_core import pipeline

    loaded = []

    class Encoder:
        def stream_layers(self, device):
            loaded.append(("streams on", str(device)))
            return self

    monkeypatch.setattr(pipeline, "text_encoder_sizes", lambda path, dtype: (1 * GIB, 24 * GIB // 50))
    monkeypatch.setattr(pipeline, "load_text_encoder", lambda path, dtype, device, **_: loaded.append(str(device))
                        or Encoder())
    source = SimpleNamespace(tiny=False, text_encoder="qwen3vl_32b_minimax_h3_int8_convrot.safetensors", tokenizer=None)
    settings = pipeline.GenerateSettings(device="cuda", gpu_memory=30)
    notes = []
    pipeline.load_text_encoder_for(source, settings, notes.append)
    assert loaded == ["cuda"]  # alone, 27 GiB fit 30
    loaded.clear()
    pipeline.load_text_encoder_for(source, settings, notes.append, beside=int(5.75 * GIB))
    assert loaded == ["cpu", ("streams on", "cuda")]
    assert "does not fit in 24.2 GiB" in notes[-1]


def test_removing_hooks_cancels_the_read_aheads_still_queued():
    """A read-ahead still queued when the hooks come off (the model about to let go of its mapped file) must not
    run: remove() cancels it, waiting only for the one already reading."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from h3_core.offload import LayerVisits

    model = _tiny_dit(2)
    streamer = stream_blocks(model, "cpu", resident=0)
    streamer.reader = ThreadPoolExecutor(1)  # as where blocks are a file's pages
    for hooked in (streamer, LayerVisits([torch.nn.Linear(2, 2)], "cpu")):
        reading, ran = threading.Event(), []
        current = hooked.reader.submit(reading.wait)
        hooked.reader.submit(ran.append, "queued read-ahead")
        threading.Timer(0.2, reading.set).start()
        hooked.remove()
        assert current.done() and ran == [] and hooked.reader is None


def test_text_encoder_layers_visit_the_device_one_at_a_time():
    """stream_layers: the same prompt states as the resident encoder, every one of the 50 layers visited
    once per prompt, and the layers' weights still at home afterwards; to() ends the streaming."""
    from h3_core.tiny_text import tiny_random_text_encoder

    encoder = tiny_random_text_encoder()
    presentation = encoder.present("t2va", "a fox trots along the beach")
    expected = encoder.encode(presentation).prompt_embeds
    layers = encoder.model.language_model.layers
    homes = [p.data_ptr() for p in layers.parameters()]
    encoder.stream_layers("cpu").forget()  # run again, not remembered
    got = encoder.encode(presentation).prompt_embeds
    assert torch.equal(expected, got)
    assert encoder._visits.visits == len(layers) == 50
    assert [p.data_ptr() for p in layers.parameters()] == homes
    encoder.to("cpu")
    assert not any(layer._forward_pre_hooks or layer._forward_hooks for layer in layers)


def test_text_encoder_layers_are_read_ahead_two_layers_early(monkeypatch, tmp_path):
    """Arriving at a layer asks the disk for the layer after next, those of its weights that are a mapped file's
    pages only (a streamed encoder read as stored, on a host short of memory)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from h3_core import offload
    from h3_core.tiny_text import tiny_random_text_encoder

    encoder = tiny_random_text_encoder()
    layers = encoder.model.language_model.layers
    events = []
    monkeypatch.setattr(offload, "_read_ahead_mapped", lambda tensors: events.append(
        ("ahead", next(i for i, layer in enumerate(layers) if {p.data_ptr() for p in layer.parameters()}
                       == {t.data_ptr() for t in tensors}))))
    for index, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda module, args, index=index: events.append(("run", index)))
    visits = encoder.stream_layers("cpu").forget()._visits
    threaded = visits.reader
    visits.reader = SimpleNamespace(submit=lambda call, *args: call(*args))  # in order, for the record
    encoder.encode(encoder.present("t2va", "a fox trots along the beach"))
    assert events == [event for i in range(50) for event in [("run", i)] + ([("ahead", i + 2)] if i < 48 else [])]
    visits.reader = threaded
    encoder.to("cpu")
    assert visits.reader is None and not visits.hooks

    path = tmp_path / "w.safetensors"
    save_file({"w": torch.ones(1 << 16)}, str(path))
    with safe_open(path, "pt") as handle:
        mapped = handle.get_tensor("w")
    advised = []
    monkeypatch.undo()
    monkeypatch.setattr(offload, "read_ahead", lambda tensors: advised.append(tensors))
    offload._read_ahead_mapped([torch.ones(1 << 16), mapped])
    offload._read_ahead_mapped([torch.ones(1 << 16)])
    assert len(advised) == 1 and len(advised[0]) == 1 and advised[0][0] is mapped


def test_a_stopped_streamed_encode_leaves_no_layer_visiting():
    """An interrupt between layers stops before the next layer's copy to the device; an error inside a layer (after
    its copy arrived) sends the copy back all the same: a layer left visiting stayed on the GPU, counted nowhere,
    one more at each cancelled prompt. (tests/test_offload_cuda.py checks the devices on a GPU.)"""
    from h3_core.tiny_text import tiny_random_text_encoder

    encoder = tiny_random_text_encoder().stream_layers("cpu")
    presentation = encoder.present("t2va", "a fox trots along the beach")
    layers = encoder.model.language_model.layers

    def stop_at_the_sixth(layers_done):
        if layers_done == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        encoder.encode(presentation, stop_at_the_sixth)
    assert encoder._visits.visits == 5 and encoder._visits.homes == {}  # the sixth layer never came

    def fails(module, args):
        raise RuntimeError("out of memory inside the layer")

    hook = layers[3].register_forward_pre_hook(fails)  # after the visit's own hook: the layer has arrived
    try:
        with pytest.raises(RuntimeError, match="inside the layer"):
            encoder.encode(presentation)
    finally:
        hook.remove()
    assert encoder._visits.homes == {}
    expected = tiny_random_text_encoder().encode(presentation).prompt_embeds
    assert torch.equal(encoder.encode(presentation).prompt_embeds, expected) and encoder._visits.homes == {}


def test_text_encoder_layers_spread_over_devices():
    """spread_layers: the same prompt states as one device, a hook (moving the hidden state, masks and
    rotary tables) on every layer past the first device's, none after to(); counts that do not cover the
    layers exactly are refused. (All devices are the CPU here; tests/test_offload_cuda.py spreads over
    two GPUs.)"""
    from h3_core.tiny_text import tiny_random_text_encoder

    encoder = tiny_random_text_encoder()
    presentation = encoder.present("t2va", "a fox trots along the beach")
    expected = encoder.encode(presentation).prompt_embeds
    layers = encoder.model.language_model.layers
    encoder.spread_layers(["cpu", "cpu", "cpu"], [20, 0, 30])
    assert [i for i, layer in enumerate(layers) if layer._forward_pre_hooks] == list(range(20, 50))
    assert torch.equal(expected, encoder.forget().encode(presentation).prompt_embeds)
    for counts in ([20, 20], [25, 26], [-1, 51]):
        with pytest.raises(ValueError, match="one layer count .* 50 layers in all"):
            encoder.spread_layers(["cpu", "cpu"], counts)
    encoder.to("cpu")
    assert not any(layer._forward_pre_hooks for layer in layers)
    encoder.release()
    assert encoder.model is None


@pytest.mark.parametrize("room, counts", [
    ([10, 10], [10, 0]),         # the first holds them all
    ([4, 3, 9], [4, 3, 3]),      # filled in order
    ([4.5, 5.9, 9], [4, 5, 1]),  # whole layers only
    ([-3, 10], [0, 10]),         # a first device already full of the rest of the encoder takes none
    ([4, 5], None),              # 9 < 10: they do not fit
])
def test_spread_counts_fill_the_devices_in_order(room, counts):
    from h3_core.text import spread_counts

    assert spread_counts(10, 100, [int(r * 100) for r in room]) == counts


def test_a_placement_plan_counts_hooked_factors_within_a_set_budget():
    """ComfyUI's loader with gpu_memory_gb set planned the DiT for the whole budget, the LoRA factors hooked on
    its resident blocks uncounted (without a budget they were taken from the free memory)."""
    from h3_core.conditioning import RequestError
    from h3_core.placement import DiTPlacement

    layout = build_request_layout(128, 64, 124, torch.ones(6, dtype=torch.long))
    placement = DiTPlacement("tiny", tiny_random_dit(), "cpu", "cpu", budget_gib=0.5)
    assert placement.plan_request(layout, 3).fits
    with pytest.raises(RequestError, match=r"needs about \d\.\d MiB on cpu .* more than the budget set \(0\.50 GiB: "
                                           r"0\.0 MiB left for the DiT after LoRA factors' 0\.49 GiB and the "
                                           r"allocator's headroom \(5% and 256 MiB\)\)"):
        placement.plan_request(layout, 3, other_bytes=int(0.49 * GIB))


def test_unplace_hands_back_each_blocks_pinned_home_as_it_empties(monkeypatch):
    """Freed pinned memory waits in torch's host cache: emptied only after every block had its pageable copy, an
    unload held the streamed blocks twice in CPU memory (an H200: 28.75 GiB peak for 18.65 GiB streamed; 19.36
    GiB handing each block's home back as it empties)."""
    from h3_core import offload

    model = _tiny_dit(4)
    streamer = stream_blocks(model, "cpu", resident=1)
    homes = []
    monkeypatch.setattr(offload, "empty_host_cache", lambda: homes.append(len(streamer.home)))
    offload.unplace(model, "cpu", streamer)
    assert homes == [2, 1, 0]  # after each of the 3 streamed blocks, not once at the end


@pytest.mark.parametrize("failing", ["_packing", "hooks"])
def test_a_placement_that_fails_partway_is_undone_and_loads_again(monkeypatch, failing):
    """Out of memory partway through placing the blocks (a slot, a pinned buffer) left the DiT marked loaded but
    half-placed, without the streaming hooks: the host saw nothing to load, so every later run of it failed
    (blocks on two devices) until the host let the model go. Now the move is undone: not loaded, every weight
    home, no hooks; the next load places it and samples as the resident model."""
    from h3_core import offload
    from h3_core.placement import DiTPlacement

    expected = run(_tiny_dit(4))
    model = _tiny_dit(4)
    weights = {name: param.data for name, param in model.named_parameters()}
    placement = DiTPlacement("H3 DiT", model, "cpu", "cpu")
    placement.use(MemoryPlan(1, 1, True, 0, True))
    # the third block's packing (before its pinned buffer), or its forward hook (the others' hooks on)
    real = offload._packing if failing == "_packing" else offload.BlockStreamer._after
    calls = []

    def out_of_memory_at_the_third_block(*args):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real(*args)

    where = offload if failing == "_packing" else offload.BlockStreamer
    monkeypatch.setattr(where, "_packing" if failing == "_packing" else "_after", out_of_memory_at_the_third_block)
    with pytest.raises(torch.OutOfMemoryError):
        placement.load()
    assert not placement.loaded and placement.streamer is None and placement.loaded_bytes == 0
    assert all(not block._forward_pre_hooks and not block._forward_hooks for block in model.blocks)
    assert all(torch.equal(param, weights[name]) for name, param in model.named_parameters())
    monkeypatch.undo()
    assert placement.load() > 0 and placement.streamer is not None
    for a, b in zip(expected, run(model), strict=True):
        assert torch.equal(a, b)


class _FailingMove(torch.nn.Linear):
    def to(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")


def test_a_model_whose_move_fails_partway_stays_where_it_was(monkeypatch):
    """The same for a model moved whole (a VAE, a text encoder that fits): `loaded` unchanged, each part that
    had moved sent back."""
    from h3_core.placement import Placement

    first, second = torch.nn.Linear(2, 2), _FailingMove(2, 2)
    moves = []
    real_to = torch.nn.Linear.to
    monkeypatch.setattr(torch.nn.Linear, "to", lambda self, device: moves.append(str(device)) or real_to(self, device))
    placement = Placement("H3 VAEs", [first, second], "cpu:0", "cpu")
    with pytest.raises(torch.OutOfMemoryError):
        placement.load()
    assert not placement.loaded and moves == ["cpu:0", "cpu"]


def test_with_the_gpu_as_offload_device_a_partly_held_model_waits_in_cpu_memory(monkeypatch):
    """ComfyUI's --highvram and --gpu-only make the GPU itself the offload device. 'Unloading' a streamed DiT
    there moved its streamed blocks (tens of GiB) onto the GPU: out of memory at the first VAE decode, and the model
    stuck. A streamed model (or streamed text encoder) now waits in CPU memory; a whole one stays, as those modes
    keep ComfyUI's own. The size a host is told is what the plan keeps on the device, `loaded_bytes` once loaded."""
    from h3_core import offload
    from h3_core.placement import DiTPlacement, TextEncoderPlacement
    from h3_core.tiny_text import tiny_random_text_encoder

    gpu = torch.device("cpu", 0)  # stands for a GPU: a device other than the CPU, where tensors can still go
    homes = []
    real_unplace = offload.unplace
    monkeypatch.setattr(offload, "unplace", lambda dit, device, streamer=None: (
        homes.append(torch.device(device)), real_unplace(dit, device, streamer)))
    model = _tiny_dit(4)
    placement = DiTPlacement("H3 DiT", model, gpu, gpu)
    for plan, home in ((MemoryPlan(1, 1, True, 0, True), torch.device("cpu")),  # streamed
                       (MemoryPlan(4, 0, True, 0, True), torch.device("cpu")),  # AdaLN weights parked
                       (MemoryPlan(4, 0, False, 0, True), gpu)):  # whole: kept where it is
        placement.use(plan)
        assert placement.planned_bytes < placement.size or home == gpu
        placement.load()
        assert placement.loaded_bytes == placement.planned_bytes
        placement.offload()
        assert homes.pop() == home

    encoder = tiny_random_text_encoder(device="cpu")
    moved = []
    monkeypatch.setattr(encoder, "to", lambda device: moved.append(torch.device(device)))
    streamed = TextEncoderPlacement("text", encoder, gpu, gpu, stream=True)
    streamed.load()
    streamed.offload()
    assert moved == [torch.device("cpu")]
