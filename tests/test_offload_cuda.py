"""Block streaming on a CUDA device (pinned CPU homes, a side copy stream, parked AdaLN tables): the
same outputs as the resident model, and `unplace` leaves nothing pinned or hooked. Skipped without CUDA
(CI has none; run on a GPU machine: `python -m pytest tests/test_offload_cuda.py`)."""

import gc
from dataclasses import replace

import pytest
import torch

from h3_core.config import TINY_DIT
from h3_core.dit import H3DiT
from h3_core.layout import build_request_layout
from h3_core.memory_plan import MemoryPlan
from h3_core.noise import request_generator, target_noise
from h3_core.offload import place, unplace
from h3_core.sampler import DualClockSchedule, denoise
from h3_core.tiny import seeded_random_weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")


def _model() -> H3DiT:
    model = seeded_random_weights(H3DiT(replace(TINY_DIT, num_layers=4)), 11).set_dtype(torch.bfloat16)
    return model.eval().requires_grad_(False)


def _sample(model, offload_adaln: bool):
    layout = build_request_layout(128, 64, 124, torch.ones(6, dtype=torch.long))
    video, audio = target_noise(layout, request_generator(9))
    text = torch.randn(1, 6, TINY_DIT.text_dim, generator=torch.Generator().manual_seed(9)).to("cuda", torch.bfloat16)
    with torch.inference_mode():
        out = denoise(model, layout, text, video.cuda(), audio.cuda(), DualClockSchedule.build(5), offload_adaln=offload_adaln)
    torch.cuda.synchronize()
    return [t.cpu() for t in out]


@pytest.mark.parametrize("resident", [0, 1, 3])
def test_streamed_on_cuda_equals_resident_and_unplace_cleans_up(resident):
    expected = _sample(_model().cuda(), offload_adaln=False)
    model = _model()
    streamer = place(model, "cuda", MemoryPlan(resident, 1, True, 0, True))
    assert streamer is not None and all(
        view.is_pinned() for views in streamer.home.values() for view in views
    )
    got = _sample(model, offload_adaln=True)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    unplace(model, "cpu", streamer)
    assert not any(block._forward_pre_hooks for block in model.blocks)
    assert all(p.device.type == "cpu" and not p.is_pinned() for p in model.parameters())
    # placed again all resident, the model still computes the same
    assert place(model, "cuda", MemoryPlan(4, 0, False, 0, True)) is None
    assert all(torch.equal(a, b) for a, b in zip(expected, _sample(model, offload_adaln=False)))


def test_a_streamed_dit_parks_its_adaln_tables_even_when_the_caller_does_not_ask(monkeypatch):
    """A script calling denoise on a streamed DiT without offload_adaln kept the whole schedule's AdaLN tables on
    the small GPU (~1.8 GiB at 49 steps of the release model); weights kept on the CPU say to park them."""
    expected = _sample(_model().cuda(), offload_adaln=False)
    model = _model()
    streamer = place(model, "cuda", MemoryPlan(1, 1, True, 0, True))
    parked = []
    real = model.modulation_schedule
    monkeypatch.setattr(model, "modulation_schedule",
                        lambda steps, park_on_cpu=False: (parked.append(park_on_cpu), real(steps, park_on_cpu))[1])
    got = _sample(model, offload_adaln=False)
    assert parked == [True]
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert all(p.device.type == "cpu" for module in model.adaln_modules() for p in module.parameters())
    unplace(model, "cpu", streamer)


def test_streamed_blocks_beyond_the_pinned_budget_copy_from_ordinary_memory():
    """A host's pinned-memory budget (ComfyUI's: under half the RAM on Windows, none with
    --disable-pinned-memory) pins only the streamed blocks that fit it; the rest copy from pageable memory,
    and the outputs are still the resident model's."""
    from h3_core.offload import _packing, _streamed_parameters
    from h3_core.pinned import slab_bytes

    expected = _sample(_model().cuda(), offload_adaln=False)
    model = _model()
    block = _packing(_streamed_parameters(model.blocks[1]))[1]  # a streamed block's CPU home, as packed
    one = slab_bytes(block, 1, None)  # what pinning one block alone takes
    for budget, pinned in ((one, 1), (one - 1, 0), (0, 0)):
        streamer = place(model, "cuda", MemoryPlan(1, 1, True, 0, True), pin_bytes=budget)
        homes = [views[0].is_pinned() for _, views in sorted(streamer.home.items())]
        assert streamer.pinned_blocks == pinned and homes == [True] * pinned + [False] * (3 - pinned)
        got = _sample(model, offload_adaln=True)
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
        unplace(model, "cpu", streamer)
        assert all(p.device.type == "cpu" and not p.is_pinned() for p in model.parameters())


def test_streamed_blocks_read_from_a_file_stream_from_its_pages_and_go_back_to_them(tmp_path):
    """A DiT read onto the CPU holds its file's pages (safetensors maps the file). Pinned blocks are copies,
    and unplace gives each its weights as read again (not a third copy); unpinned ones stream from those pages,
    read ahead by the OS. Outputs are the resident model's either way."""
    from safetensors.torch import save_file

    from h3_core.checkpoint import DiTReader
    from h3_core.offload import _streamed_parameters
    from h3_core.runtime import file_mapped_ranges, in_mapped_file

    expected = _sample(_model().cuda(), offload_adaln=False)
    path = tmp_path / "dit.safetensors"
    save_file(_model().state_dict(), str(path))
    model = DiTReader(path, config=_model().config).read("cpu")
    read = {i: [p.data_ptr() for p in _streamed_parameters(block)] for i, block in enumerate(model.blocks)}
    for pin_bytes, pinned in ((None, 3), (0, 0)):
        streamer = place(model, "cuda", MemoryPlan(1, 1, True, 0, True), pin_bytes=pin_bytes)
        assert streamer.pinned_blocks == pinned and sorted(streamer.on_file) == ([] if pinned else [1, 2, 3])
        assert all(torch.equal(a, b) for a, b in zip(expected, _sample(model, offload_adaln=True), strict=True))
        unplace(model, "cpu", streamer)
        mapped = file_mapped_ranges()
        for index in (1, 2, 3):
            weights = _streamed_parameters(model.blocks[index])
            assert [p.data_ptr() for p in weights] == read[index]
            assert all(in_mapped_file(p.data, mapped) and not p.is_pinned() for p in weights)


def test_text_encoder_streams_its_layers_through_the_gpu():
    from h3_core.tiny_text import tiny_random_text_encoder

    resident = tiny_random_text_encoder().to("cuda")
    presentation = resident.present("t2va", "a fox trots along the beach")
    expected = resident.encode(presentation).prompt_embeds.cpu()
    streamed = tiny_random_text_encoder().stream_layers("cuda")
    got = streamed.encode(presentation).prompt_embeds
    assert got.device.type == "cpu" and torch.equal(expected, got)  # states in CPU memory, held by hosts' caches
    assert all(p.device.type == "cpu" for p in streamed.model.language_model.layers.parameters())
    assert streamed.model.language_model.embed_tokens.weight.device.type == "cuda"
    layers = streamed.model.language_model.layers

    def fails(module, args):
        raise RuntimeError("out of memory inside the layer")

    hook = layers[5].register_forward_pre_hook(fails)  # the layer's copy has arrived on the GPU
    try:
        with pytest.raises(RuntimeError, match="inside the layer"):
            streamed.forget().encode(presentation)
    finally:
        hook.remove()
    assert all(p.device.type == "cpu" for p in layers.parameters())  # sent back all the same


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_text_encoder_spreads_its_layers_over_two_gpus():
    from h3_core.tiny_text import tiny_random_text_encoder

    resident = tiny_random_text_encoder().to("cuda:0")
    presentation = resident.present("t2va", "a fox trots along the beach")
    expected = resident.encode(presentation).prompt_embeds.cpu()
    spread = tiny_random_text_encoder().spread_layers(["cuda:0", "cuda:1"], [18, 32])
    got = spread.encode(presentation).prompt_embeds
    layers = spread.model.language_model.layers
    assert got.device.type == "cpu" and torch.equal(expected, got)
    assert [str(p.device) for layer in (layers[17], layers[18]) for p in list(layer.parameters())[:1]] == ["cuda:0", "cuda:1"]
    assert spread.model.language_model.embed_tokens.weight.device == torch.device("cuda:0")
    on_second = sum(p.numel() * p.element_size() for p in layers[18:].parameters())
    held = torch.cuda.memory_allocated(1)  # those layers, and cuBLAS's workspace (kept by torch's allocator)
    del layers
    spread.release()
    assert torch.cuda.memory_allocated(1) <= held - on_second


def test_video_decode_threads_on_cuda_give_the_single_stream_frames():
    """The multi-device decode's threads on a CUDA device (named twice: one shared replica, two threads)
    give the single-device stream's frames bitwise."""
    from h3_core.tiny import tiny_random_video_vae

    vae = tiny_random_video_vae("cuda")
    latents = torch.randn(1, vae.config.latent_channels, 5 * 4 + 2, 4, 6, generator=torch.Generator().manual_seed(1)).cuda()
    expected = torch.cat(list(vae.decode_stream(latents)), dim=2)
    got = torch.cat(list(vae.decode_stream(latents, devices=["cuda:0", "cuda:0"])), dim=2)
    assert got.device.type == "cuda" and torch.equal(expected, got)


def test_empty_caches_returns_the_pinned_homes_of_streamed_blocks():
    """Freed pinned memory stays cached by torch's host allocator, resident in the process, until
    `empty_caches` hands it back (a streamed 24 GiB run kept 39 GiB after its DiT was dropped)."""
    from h3_core.runtime import empty_caches

    stats = getattr(torch.cuda, "host_memory_stats", None)
    key = "allocated_bytes.current"  # pinned bytes the host allocator owns: in use and cached
    if stats is None or key not in stats():
        pytest.skip("this torch reports no host allocator statistics")
    empty_caches()
    before = stats()[key]
    model = _model()
    streamer = place(model, "cuda", MemoryPlan(0, 1, False, 0, True))
    held = stats()[key] - before
    assert held > 0
    unplace(model, "cpu", streamer)  # hands each block's pinned home back as it empties: not twice in memory
    assert stats()[key] == before
    streamer = place(model, "cuda", MemoryPlan(0, 1, False, 0, True))
    del model, streamer  # dropped without unplace: freed, but still cached (resident)
    gc.collect()
    assert stats()[key] - before == held
    empty_caches(torch.device("cuda"))
    assert stats()[key] == before


def test_a_released_dit_frees_its_pinned_memory_and_is_read_again_onto_the_gpu(tmp_path):
    """A DiT placed from a DiTReader (ComfyUI's loader): the first load reads it into CPU memory for a
    streaming plan; `release_weights` takes the hooks off and gives the pinned homes back to the system;
    the next load, planned whole, reads it straight onto the GPU. Every run gives the resident output."""
    from safetensors.torch import save_file

    from h3_core.checkpoint import DiTReader
    from h3_core.placement import DiTPlacement
    from h3_core.runtime import empty_caches

    path = tmp_path / "h3_tiny_4_blocks.safetensors"
    save_file({name: t.contiguous() for name, t in _model().state_dict().items()}, str(path))
    expected = _sample(_model().cuda(), offload_adaln=False)
    stats = getattr(torch.cuda, "host_memory_stats", lambda: {})
    key = "allocated_bytes.current"
    empty_caches(torch.device("cuda"))
    before = stats().get(key)

    reader = DiTReader(path, device="cuda")
    placement = DiTPlacement("tiny", reader.model, "cuda", "cpu", reader=reader)
    unread = placement.size
    placement.use(MemoryPlan(1, 1, True, 0, True))
    placement.load()
    assert placement.streamer is not None and reader.is_read
    read = sum(t.numel() * t.element_size() for t in [*reader.model.parameters(), *reader.model.buffers()])
    assert unread == read  # sized before the read as it is read
    assert all(view.is_pinned() for views in placement.streamer.home.values() for view in views)
    assert all(torch.equal(a, b) for a, b in zip(expected, _sample(reader.model, offload_adaln=True)))

    assert placement.release_weights() > 0
    assert not reader.is_read and not placement.loaded and placement.streamer is None
    assert not any(block._forward_pre_hooks for block in reader.model.blocks)
    if before is not None:
        assert stats()[key] == before  # the pinned homes went back to the system

    placement.use(None)
    placement.load()
    assert all(p.device.type == "cuda" for p in reader.model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(expected, _sample(reader.model, offload_adaln=False)))


def test_pinned_blocks_take_no_more_than_the_budget_counts():
    """torch's pinned allocator rounds each request up to a power of two: a real bf16 block (735 MiB) pinned
    alone took 1 GiB, so a 3 GiB budget pinned four blocks in 4 GiB. Carved from slabs, the budget is what is
    pinned: three blocks here (2 + 1 GiB), and a budget of none pins six in 5 GiB, not 6."""
    from h3_core.config import DiTConfig
    from h3_core.runtime import empty_caches

    stats = getattr(torch.cuda, "host_memory_stats", None)
    key = "allocated_bytes.current"
    if stats is None or key not in stats():
        pytest.skip("this torch reports no host allocator statistics")
    with torch.device("meta"):  # the real width, six blocks; their values do not matter here
        model = H3DiT(replace(DiTConfig(), num_layers=6)).set_dtype(torch.bfloat16)
    model = model.to_empty(device="cpu").eval().requires_grad_(False)
    empty_caches(torch.device("cuda"))
    before = stats()[key]
    for budget, pinned, held in ((3 * 2**30, 3, 3 * 2**30), (None, 6, 5 * 2**30)):
        streamer = place(model, "cuda", MemoryPlan(0, 1, False, 0, True), pin_bytes=budget)
        assert streamer.pinned_blocks == pinned and stats()[key] - before == held
        unplace(model, "cpu", streamer)
        empty_caches(torch.device("cuda"))
        assert stats()[key] == before


def test_a_placement_out_of_memory_at_its_slots_holds_no_pinned_memory(monkeypatch):
    """The blocks were pinned before the GPU slots ran out of memory: the failed placement kept them pinned (and
    the model marked loaded). Undone, nothing stays pinned, hooked or on the GPU."""
    from h3_core.runtime import empty_caches

    model = _model()
    empty_caches(torch.device("cuda"))
    allocated = torch.cuda.memory_allocated()
    real_empty = torch.empty

    def no_room_on_the_gpu(*args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            raise torch.OutOfMemoryError("CUDA out of memory (the slots)")
        return real_empty(*args, device=device, **kwargs)

    monkeypatch.setattr(torch, "empty", no_room_on_the_gpu)
    with pytest.raises(torch.OutOfMemoryError):
        place(model, "cuda", MemoryPlan(1, 1, True, 0, True))
    monkeypatch.undo()
    assert all(p.device.type == "cpu" and not p.is_pinned() for p in model.parameters())
    assert not any(block._forward_pre_hooks or block._forward_hooks for block in model.blocks)
    empty_caches(torch.device("cuda"))
    assert torch.cuda.memory_allocated() == allocated


def test_parked_adaln_tables_are_the_tables_in_pinned_slabs():
    """A 49-step schedule parks ~2,500 AdaLN tables in pinned memory; pinned one by one, each was rounded up to a
    power of two. In slices of slabs they take little more than their size, and are the same tables."""
    from h3_core.config import DiTConfig
    from h3_core.runtime import empty_caches

    model = _model().cuda()
    steps = [torch.tensor([0.1 * s, 0.2], device="cuda") for s in range(5)]
    with torch.inference_mode():
        kept, parked = model.modulation_schedule(steps), model.modulation_schedule(steps, park_on_cpu=True)
    for ours, theirs in zip(parked, kept):
        assert all(a.is_pinned() and torch.equal(a.cuda(), b) for a, b in zip(ours.blocks, theirs.blocks))
        assert ours.final.is_pinned() and torch.equal(ours.final.cuda(), theirs.final)

    stats = getattr(torch.cuda, "host_memory_stats", None)
    key = "allocated_bytes.current"
    if stats is None or key not in stats():
        pytest.skip("this torch reports no host allocator statistics")
    with torch.device("meta"):  # the real width, six blocks: real tables' sizes
        real = H3DiT(replace(DiTConfig(), num_layers=6)).set_dtype(torch.bfloat16)
    real = real.to_empty(device="cuda").eval().requires_grad_(False)
    del parked, kept
    empty_caches(torch.device("cuda"))
    before = stats()[key]
    with torch.inference_mode():
        parked = real.modulation_schedule([torch.tensor([0.02 * s, 0.5], device="cuda") for s in range(49)],
                                          park_on_cpu=True)
    tables = sum(t.numel() * t.element_size() for m in parked for t in [*m.blocks, m.final])
    assert tables <= stats()[key] - before <= 1.1 * tables


def test_a_hosts_pinned_memory_count_and_room_cover_streamed_blocks_and_parked_tables(monkeypatch):
    """A host that budgets pinned memory (ComfyUI) is told of every slab H3 pins, the streamed blocks' and the
    parked AdaLN tables', and of its release; tables past its room wait in ordinary memory (they were pinned
    whatever it allowed), the same outputs either way."""
    from h3_core import pinned

    expected = _sample(_model().cuda(), offload_adaln=False)
    counted, room = [], [None]
    monkeypatch.setattr(pinned, "host", pinned.HostPins(lambda: room[0], counted.append))
    model = _model()
    streamer = place(model, "cuda", MemoryPlan(1, 1, True, 0, True), pin_bytes=pinned.host_room())
    assert streamer.pinned_blocks == 3 and sum(counted) > 0
    held = sum(counted)
    steps = [torch.tensor([0.1 * s, 0.2], device="cuda") for s in range(5)]
    with torch.inference_mode():
        tables = model.modulation_schedule(steps, park_on_cpu=True)
    assert tables[0].final.is_pinned() and sum(counted) > held  # the tables' slabs counted too
    tables = None
    assert sum(counted) == held
    assert all(torch.equal(a, b) for a, b in zip(expected, _sample(model, offload_adaln=True), strict=True))
    assert sum(counted) == held  # a run's parked tables given back at its end
    unplace(model, "cpu", streamer)
    assert sum(counted) == 0 and min(counted) < 0

    room[0] = 0  # ComfyUI's --disable-pinned-memory
    with torch.inference_mode():
        tables = model.cuda().modulation_schedule(steps, park_on_cpu=True)
    assert not any(t.is_pinned() for m in tables for t in [*m.blocks, m.final]) and sum(counted) == 0
    assert all(torch.equal(a, b) for a, b in zip(expected, _sample(model, offload_adaln=True), strict=True))


def test_a_dit_waiting_on_the_cpu_is_checked_for_fp8_matmuls_where_it_runs(monkeypatch):
    """A streamed (or AdaLN-offloaded) DiT is read into CPU memory first; `fp8-lossy` linears made after the load
    (tiny-random, or with LoRAs merged) were checked for FP8 matmuls on the CPU, which torch 2.11's lacks, so the
    run was refused on a GPU that has them."""
    from test_parallel import conditioning

    from h3_core import fp8, pipeline
    from h3_core.offload import unplace

    monkeypatch.setattr(fp8, "scaled_mm_supported", lambda kind, index=None: kind == "cuda")  # torch 2.11's CPU
    monkeypatch.setattr(pipeline, "sampling_plan", lambda *args, **kwargs: MemoryPlan(1, 1, True, 0, True))
    source = pipeline.resolve_model_source("tiny-random", "fl2va")
    settings = pipeline.GenerateSettings(device="cuda", linears="fp8-lossy")
    request = conditioning(False)
    dit, plan, streamer = pipeline.load_sampling_dit(source, None, "fl2va", settings, (), request, 3, lambda line: None)
    try:
        assert plan.streams and isinstance(dit.blocks[1].mlp.fc1, fp8.FP8Linear)
    finally:
        unplace(dit, "cpu", streamer)
