"""The DiT under ComfyUI's model manager (fake_comfy), on the CPU: a memory budget too small for the
whole model makes the sampler stream blocks (BlockStreamer works on the CPU), with outputs bitwise those
of the resident model; the patcher reports the partial load; unloading, a failure and an interrupt each
remove the streamer and bring every block home, and the next run plans afresh. Two CPU devices (gloo)
give the single-device latents, and unloading or dropping the model leaves no worker process.

The tiny-random DiT has 2 blocks, too few for a streaming plan to beat keeping both (streaming holds
prefetch + 2 slots), so the streaming tests load a 4-block tiny checkpoint from a model folder."""

import dataclasses
import gc
import importlib
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
import fake_comfy  # noqa: E402

from h3_core.config import TINY_DIT  # noqa: E402
from h3_core.dit import H3DiT  # noqa: E402
from h3_core.memory_plan import (GIB, HEADROOM_BYTES, HEADROOM_FRACTION, expected_peak, plan_for,  # noqa: E402
                                 usable_bytes)
from h3_core.tiny import TINY_SEED, seeded_random_weights  # noqa: E402

FOUR_BLOCKS = "h3_tiny_4_blocks.safetensors"
CONFIG = dataclasses.replace(TINY_DIT, num_layers=4)
STEPS = 3


def write_four_blocks(folder: Path) -> Path:
    """The tiny DiT with 4 blocks as a ComfyUI single file (our module names are the release's)."""
    folder.mkdir(parents=True, exist_ok=True)
    model = seeded_random_weights(H3DiT(CONFIG), TINY_SEED)
    save_file({f"model.diffusion_model.{k}": v.contiguous() for k, v in model.state_dict().items()},
              str(folder / FOUR_BLOCKS))
    return folder / FOUR_BLOCKS


def streaming_budget(layout, steps: int = STEPS, resident: int = 0, prefetch: int = 1) -> float:
    """GiB in which the 4-block model (fp32: 4 bytes) plans `resident` blocks and AdaLN weights on the CPU
    (the rest streamed with `prefetch`; 4 resident and prefetch 0: only the AdaLN weights stay home)."""
    timesteps = int(layout.row_timesteps(0.5, 0.25)[0].numel())
    need = expected_peak(CONFIG, layout.sequence_length, resident, prefetch, True, max(steps - 1, 1), timesteps, 4)
    budget = (need + HEADROOM_BYTES + 4096) / (1 - HEADROOM_FRACTION) / GIB
    plan = plan_for(CONFIG, layout, steps, "cpu", budget, 4)
    assert (plan.resident_blocks, plan.prefetch, plan.offload_adaln, plan.fits) == (resident, prefetch, True, True)
    return budget


@pytest.fixture
def comfy(tmp_path):
    with fake_comfy.installed(tmp_path) as record:
        write_four_blocks(tmp_path / "diffusion_models")
        yield SimpleNamespace(record=record, tmp=tmp_path, mm=sys.modules["comfy.model_management"], **{
            name: importlib.import_module(f"nodes.{name}")
            for name in ("loaders", "conditioning", "sampler", "memory", "host_memory")})


def _load(c, checkpoint=FOUR_BLOCKS, **options):
    return c.loaders.H3ModelLoader.execute(checkpoint, "", "fl2va", "fp32", "auto", **options).values[0]


def _cond(c):
    text = c.loaders.H3TextEncoderLoader.execute("tiny-random", "", "", "bf16").values[0]
    vae = c.loaders.H3VAELoader.execute("tiny-random", "tiny-random", "").values[0]
    return c.conditioning.H3Conditioning.execute(text, "a fox on a beach", "t2va", "auto", 0, 0, 4.0, vae=vae).values[0]


def _sample(c, model, cond, seed=5):
    return c.sampler.H3Sampler.execute(model, cond, seed, STEPS, 0.0, 0.0).values[0][0]


def _same(a, b):
    return torch.equal(a["video"], b["video"]) and torch.equal(a["audio"], b["audio"])


def _close(a, b, tolerance=1e-5):
    """Worker processes give the one-process latents up to fp32 rounding (test_parallel.py's tolerance):
    their CPU thread counts differ from the caller's, and on many cores a GEMM's reduction order can too."""
    return all((a[key] - b[key]).abs().max().item() <= tolerance for key in ("video", "audio"))


def _clean(dit) -> bool:
    """No streaming hook left on any block."""
    return all(not block._forward_pre_hooks and not block._forward_hooks for block in dit.blocks)


def test_a_small_budget_streams_blocks_with_the_resident_results(comfy, caplog):
    c = comfy
    cond = _cond(c)
    resident = _load(c)
    expected = _sample(c, resident, cond)
    placement = resident.patcher.model
    assert placement.streamer is None and resident.patcher.loaded_size() == resident.patcher.model_size()

    budget = streaming_budget(cond.layout)
    model = _load(c, gpu_memory_gb=budget)
    patcher, placement = model.patcher, model.patcher.model
    with caplog.at_level("INFO", logger="h3"):
        got = _sample(c, model, cond)
        assert _same(got, expected)  # the same kernels on the same values
        assert placement.streamer is not None and placement.plan.streams and not _clean(model.dit)
        # the shared weights and the stream's slots, not the AdaLN weights or the 4 blocks; ComfyUI is told the
        # plan's share as the model's size (the whole DiT made it push out models that fit beside): all loaded
        assert 0 < patcher.loaded_size() == patcher.model_size() < placement.size
        assert patcher.loaded_size() == placement.size - placement.streamer.offloaded_bytes - sum(
            p.numel() * p.element_size() for m in model.dit.adaln_modules() for p in m.parameters())
        assert _same(_sample(c, model, cond), expected)  # the same plan again: nothing moves, same result

        c.mm.unload_all_models()  # /free, "Unload models": every registered model detaches
    lines = [r.getMessage() for r in caplog.records]
    assert any("0/4 blocks resident, rest streamed" in line for line in lines), lines
    assert any("unloaded from cpu to cpu" in line and "block streaming removed" in line for line in lines), lines
    assert placement.streamer is None and not placement.loaded and patcher.loaded_size() == 0 and _clean(model.dit)
    assert resident.patcher.loaded_size() == 0

    assert _same(_sample(c, model, cond), expected)  # the next run plans and streams afresh
    assert placement.streamer is not None


def test_streamed_blocks_are_pinned_within_comfyuis_pinned_memory_budget(comfy, monkeypatch):
    """The streamed blocks' CPU homes were all pinned whatever ComfyUI allowed (its budget keeps pinned memory
    under half the RAM on Windows; --disable-pinned-memory allows none). A streamed load now asks ComfyUI what
    is left of it and pins that much at most (offload.BlockStreamer's pin_bytes)."""
    from h3_core import offload

    c = comfy
    assert not hasattr(c.mm, "MAX_PINNED_MEMORY") and c.memory.pin_room() is None  # a ComfyUI without the budget
    monkeypatch.setattr(c.mm, "MAX_PINNED_MEMORY", -1, raising=False)  # --disable-pinned-memory, or no NVIDIA/AMD
    monkeypatch.setattr(c.mm, "TOTAL_PINNED_MEMORY", 0, raising=False)
    assert c.memory.pin_room() == 0
    monkeypatch.setattr(c.mm, "MAX_PINNED_MEMORY", 10 * GIB)
    monkeypatch.setattr(c.mm, "TOTAL_PINNED_MEMORY", 4 * GIB)  # other models' pins
    assert c.memory.pin_room() == 6 * GIB
    asked, real_place = [], offload.place
    monkeypatch.setattr(offload, "place", lambda *args, pin_bytes=None: asked.append(pin_bytes) or real_place(
        *args, pin_bytes=pin_bytes))
    cond = _cond(c)
    model = _load(c, gpu_memory_gb=streaming_budget(cond.layout))
    _sample(c, model, cond)
    assert model.patcher.model.streamer is not None and asked == [6 * GIB]


def test_h3s_pinned_slabs_are_counted_in_comfyuis_pinned_total(comfy, monkeypatch):
    """ComfyUI keeps its own pins within its budget by its count of them; H3's streamed blocks and parked AdaLN
    tables were pinned outside that count, so ComfyUI's pins and ours could each take the whole budget."""
    from h3_core import pinned

    c = comfy
    monkeypatch.setattr(c.mm, "MAX_PINNED_MEMORY", 10 * GIB, raising=False)
    monkeypatch.setattr(c.mm, "TOTAL_PINNED_MEMORY", 4 * GIB, raising=False)  # other models' pins
    slabs = pinned.PinnedSlabs(pinned.host_room(), allocate=lambda nbytes: torch.empty(nbytes, dtype=torch.uint8))
    assert slabs.room == 6 * GIB
    piece = slabs.take(GIB, 1)
    assert c.mm.TOTAL_PINNED_MEMORY == 5 * GIB and c.memory.pin_room() == 5 * GIB
    del slabs, piece  # given back
    assert c.mm.TOTAL_PINNED_MEMORY == 4 * GIB
    c.mm.TOTAL_PINNED_MEMORY = 0  # ComfyUI recounted its pins while ours were out: giving ours back stops at none
    c.memory.count_pins(-GIB)
    assert c.mm.TOTAL_PINNED_MEMORY == 0 and c.memory.pin_room() == 10 * GIB


def test_a_comfyui_leaves_no_pinned_memory_host_behind(tmp_path):
    """The nodes tell the engine of ComfyUI's pinned-memory budget while they are loaded, not after."""
    from h3_core import pinned

    with fake_comfy.installed(tmp_path):
        importlib.import_module("nodes.memory")
        assert pinned.host is not None and pinned.host.room() is None  # this ComfyUI has no budget
    assert pinned.host is None


def test_a_plan_that_only_keeps_the_adaln_weights_home_moves_only_them(comfy, caplog):
    c = comfy
    cond = _cond(c)
    expected = _sample(c, _load(c), cond)
    model = _load(c, gpu_memory_gb=streaming_budget(cond.layout, resident=4, prefetch=0))
    patcher, placement = model.patcher, model.patcher.model
    adaln = sum(p.numel() * p.element_size() for m in model.dit.adaln_modules() for p in m.parameters())
    with caplog.at_level("INFO", logger="h3"):
        assert _same(_sample(c, model, cond), expected)  # offload_adaln: tables made module by module
        assert placement.streamer is None and patcher.loaded_size() == patcher.model_size() == placement.size - adaln
        roomy = _load(c)  # the same weights without a budget: the next plan keeps everything on the device
        assert roomy.patcher is patcher and placement.budget_gib is not None
        assert _same(_sample(c, roomy, cond), expected)
        assert patcher.loaded_size() == patcher.model_size() == placement.size
    lines = [r.getMessage() for r in caplog.records]
    assert any("AdaLN weights moved to cpu" in line for line in lines) and not any("unloaded" in line for line in lines)


def test_a_pruned_single_file_loads_and_samples(comfy):
    """A curve-form ("pruned") file in models/diffusion_models, spelled as Comfy-Org ships them: the Model
    Loader reads it and the sampler gives what the engine gives on the same file."""
    from test_curve_form import comfy_curve_file, curve_model

    from h3_core.checkpoint import load_dit
    from h3_core.pipeline import sample

    c = comfy
    path = c.tmp / "diffusion_models" / "h3_tiny_fl2va_pruned_bf16.safetensors"
    comfy_curve_file(path, curve_model(seeded_random_weights(H3DiT(CONFIG), TINY_SEED)))
    model = _load(c, path.name)
    assert model.dit.config.adaln_curve_grid == 1025
    cond = _cond(c)
    expected = sample(load_dit(path, dtype=torch.float32), cond, 5, STEPS)
    assert _same(_sample(c, model, cond), {"video": expected.video, "audio": expected.audio})


def test_failure_and_interrupt_remove_the_streamer(comfy):
    c = comfy
    cond = _cond(c)
    expected = _sample(c, _load(c), cond)
    model = _load(c, gpu_memory_gb=streaming_budget(cond.layout))
    placement = model.patcher.model

    c.record.progress.clear()
    c.record.interrupt_after = 1
    with pytest.raises(c.mm.InterruptProcessingException):
        _sample(c, model, cond)
    assert placement.streamer is None and not placement.loaded and _clean(model.dit)
    c.record.interrupt_after = None

    def fail(module, args):  # a failure inside a forward: a streamed block still points into its slot
        raise RuntimeError("out of memory (injected)")

    hook = model.dit.blocks[2].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="injected"):
        _sample(c, model, cond)
    hook.remove()
    assert placement.streamer is None and not placement.loaded and _clean(model.dit)
    assert _same(_sample(c, model, cond), expected)  # every block got its own weights back


def test_the_long_video_node_samples_by_the_plan(comfy):
    """H3 Continuation plans for its largest window and streams as the sampler does, with the same result."""
    from h3_core.long_video import LongVideoRequest, encode_long_video
    from h3_core.pipeline import largest_layout
    from nodes.convert import build_request

    c = comfy
    node = importlib.import_module("nodes.long_video").H3Continuation
    text = c.loaders.H3TextEncoderLoader.execute("tiny-random", "", "", "bf16").values[0]
    prompt, seconds, window, overlap, steps = "a fox on a beach", 8.0, 107, 22, 2
    args = (text, prompt, "t2va", seconds, "continuation", window, overlap, 3, steps, 0.0, 0.0, "auto", 0, 0)
    expected, frames = node.execute(_load(c), *args).values
    request = LongVideoRequest(build_request("t2va", prompt, duration=seconds), "continuation", window, overlap)
    layout = largest_layout(encode_long_video(request, text.encoder, None, None, rules=text.canvas))
    model = _load(c, gpu_memory_gb=streaming_budget(layout, steps))
    got, got_frames = node.execute(model, *args).values
    assert model.patcher.model.streamer is not None and model.patcher.model.plan.streams
    assert got_frames == frames > window and _same(got, expected)


def test_a_budget_too_small_is_refused_before_anything_moves(comfy):
    c = comfy
    cond = _cond(c)
    model = _load(c, gpu_memory_gb=0.25)  # less than the allocator's headroom alone
    loads = len(c.record.loaded)
    with pytest.raises(ValueError, match=r"needs about \d+\.\d MiB on cpu even with every DiT block streamed.*the "
                                         r"budget set \(0\.25 GiB: 0\.0 MiB left for the DiT after the allocator's headroom"):
        _sample(c, model, cond)
    assert len(c.record.loaded) == loads and model.patcher.model.plan is None  # nothing was placed


def test_the_loader_reads_no_weight_and_the_first_run_reads_them(comfy, monkeypatch):
    """The loader reads the file's headers only; the weights are read at the first run (by then the prompt
    is encoded and the text encoder's memory can be free), once, into the same modules."""
    c = comfy
    model = _load(c)
    reader = model.patcher.model.reader
    assert reader.model is model.dit and all(t.is_meta for t in model.dit.state_dict().values())
    assert c.record.loaded == []  # nothing registered as loaded yet
    cond = _cond(c)
    reads = []
    read = reader.read
    monkeypatch.setattr(reader, "read", lambda device, on_tensor=None: reads.append(torch.device(device)) or
                        read(device, on_tensor))
    tensors = len(model.dit.state_dict())
    c.record.progress.clear()
    c.record.interrupt_after = 5  # cancel while the weights are read: nothing half-read stays
    with pytest.raises(c.mm.InterruptProcessingException):
        _sample(c, model, cond)
    assert c.record.progress == [(done, tensors, None) for done in range(1, 6)] and not reader.is_read
    c.record.interrupt_after = None
    c.record.progress.clear()
    first = _sample(c, model, cond)
    # a bar over the tensors read, then the sampler's over its steps
    assert c.record.progress[:tensors] == [(done, tensors, None) for done in range(1, tensors + 1)]
    sampler = c.record.progress[tensors:]
    assert sampler and all(total == sampler[-1][0] != tensors for _, total, _ in sampler)
    assert reads == [torch.device("cpu")] * 2 and reader.is_read
    assert _same(_sample(c, model, cond), first) and len(reads) == 2
    eager = _load(c, "tiny-random")  # a different model: the first run really used the file's weights
    assert not _same(_sample(c, eager, _cond(c)), first)

    # unread, a bf16 model is already sized (and planned) as bf16: what ComfyUI is told is what will arrive
    bf16 = c.loaders.H3ModelLoader.execute(FOUR_BLOCKS, "", "fl2va", "bf16", "auto").values[0]
    unread = bf16.patcher.model.size
    bf16.patcher.model.reader.read("cpu")
    assert unread == sum(t.numel() * t.element_size() for t in list(bf16.dit.parameters()) + list(bf16.dit.buffers()))
    assert bf16.dit.dtype == torch.bfloat16 and unread < bf16.patcher.model.reader.nbytes * 1.01


def test_auto_attention_follows_the_dtype_a_file_is_read_in(comfy, tmp_path, monkeypatch):
    """weight_dtype "checkpoint" leaves the dtype to the file: "auto" was resolved before it was known, so an fp32
    file on a Hopper GPU with FlashAttention 3 got flash3 and was refused ("runs fp16 or bf16 only") for a kernel the
    user never named. Now auto is resolved for what the read DiT computes in (the headers say it before any read)."""
    from fa3_stand_in import FA3_STAND_IN

    c = comfy
    (tmp_path / "flash_attn_interface.py").write_text(FA3_STAND_IN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn_interface", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(c.loaders, "device", lambda: torch.device("cuda:0"))  # nothing is read or placed on it
    stored = c.loaders.H3ModelLoader.execute(FOUR_BLOCKS, "", "fl2va", "checkpoint", "auto").values[0]
    assert stored.dit.attention_dtype == torch.float32  # the file's dtype, from its headers
    assert stored.run.attention == "sdpa" == stored.dit.blocks[0].attn.backend
    bf16 = c.loaders.H3ModelLoader.execute(FOUR_BLOCKS, "", "fl2va", "bf16", "auto").values[0]
    assert bf16.run.attention == "flash3" == bf16.dit.blocks[0].attn.backend
    with pytest.raises(ValueError, match="'flash3' runs fp16 or bf16 only.*float32"):
        c.loaders.H3ModelLoader.execute(FOUR_BLOCKS, "", "fl2va", "checkpoint", "flash3")
    sys.modules.pop("flash_attn_interface", None)


def test_a_kernel_without_the_window_is_refused_only_with_one(comfy, monkeypatch):
    """FlashAttention 2 cannot run the attention window: with one asked for it is refused before the file is
    read; without one it loads (the window check must not stand in the way of a kernel that runs no window)."""
    import types

    for name in ("flash_attn", "flash_attn.flash_attn_interface"):  # stand-ins: present, never called here
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    loader = comfy.loaders.H3ModelLoader
    flash = loader.execute(FOUR_BLOCKS, "", "fl2va", "bf16", "flash").values[0]
    assert flash.run.attention == "flash" and flash.name.endswith(FOUR_BLOCKS)  # the name ComfyUI's reports show
    said = "The attention window runs on the sdpa, flash3, flash3-fp8-lossy attention backends; 'flash' is chosen"
    with monkeypatch.context() as patch, pytest.raises(ValueError, match=said):
        patch.setattr(comfy.loaders, "locate_dit", lambda *_: pytest.fail("the file was read before the kernel check"))
        loader.execute(FOUR_BLOCKS, "", "fl2va", "bf16", "flash", attention_window_lossy=1)


def test_loader_input_checks(comfy):
    c = comfy
    from h3_core.dit import _CompiledForward

    compiled = _load(c, "tiny-random", compile=True)  # compiled at each run (test_nodes_execute), traced at the first
    assert compiled.run.compile and not _load(c, "tiny-random").run.compile
    assert not any(isinstance(block.forward, _CompiledForward) for block in compiled.dit.blocks)
    with pytest.raises(ValueError, match="cuda:0 alone is one device"):
        _load(c, "tiny-random", devices="cuda:0")
    with pytest.raises(ValueError, match="shard_weights .* list them in devices"):
        _load(c, "tiny-random", shard_weights=True)
    with pytest.raises(ValueError, match="gpu_memory_gb streams blocks on one device"):
        _load(c, "tiny-random", devices="cpu,cpu", gpu_memory_gb=4.0)
    with pytest.raises(ValueError, match="not a list of device names"):
        _load(c, "tiny-random", devices="gpu0,gpu1")
    with pytest.raises(ValueError, match="cuda:6 does not exist here"):
        _load(c, "tiny-random", devices="cuda:6,cuda:7")


def _gone(processes) -> bool:
    for process in processes:
        if process.is_alive() or process.exitcode is None:
            return False
        try:
            os.kill(process.pid, 0)
            return False  # a zombie, not reaped
        except ProcessLookupError:
            pass
    return True


def test_a_split_models_hooked_lora_factors_are_room_asked_of_comfyui(comfy, monkeypatch):
    """Every worker holds a hooked LoRA's factors on its device (a Turbo export's ~1.8 GiB), the first beside
    ComfyUI's models: ComfyUI was asked for room for the workers' share of the DiT and activations only."""
    from lora_files import fused, random_spec, write_native

    from h3_core.lora import hooked_bytes

    c = comfy
    asked = []
    monkeypatch.setattr(c.memory, "place", lambda patchers, working=0: asked.append(working))  # no workers start
    split = _load(c, "tiny-random", devices="cpu,cpu")
    write_native(c.tmp / "loras" / "style.safetensors", fused(random_spec(split.dit.config, seed=4, shared_qkv_a=True)),
                 prefix="diffusion_model.")
    split_lora = c.sampler.H3LoRAApply.execute(split, "style.safetensors", 0.8).values[0]
    layout = _cond(c).layout
    asked.clear()  # the text encoder's and VAEs' placements
    for handle in (split, split_lora):
        with c.memory.dit_for_run(handle, layout, STEPS):
            pass
    factors = hooked_bytes(split_lora.loras, "fl2va", 4)  # tiny-random on the CPU: fp32
    assert factors > 0 and asked[1] - asked[0] == factors


def test_a_dit_run_on_the_cpu_asks_comfyui_to_free_nothing(comfy):
    """Room is made on a GPU only, as ComfyUI's own loads do (load_models_gpu frees no CPU memory): a CPU run asks
    no other model to leave."""
    c = comfy
    model = _load(c, "tiny-random")
    layout = _cond(c).layout
    c.record.freed.clear()
    with c.memory.dit_for_run(model, layout, STEPS) as plan:
        assert not plan.streams
    assert c.record.freed == []


def test_two_cpu_devices_give_the_single_device_latents_and_unloading_stops_the_workers(comfy, caplog):
    c = comfy
    cond = _cond(c)
    expected = _sample(c, _load(c, "tiny-random"), cond)
    with caplog.at_level("INFO", logger="h3"):
        split = _load(c, "tiny-random", devices="cpu, cpu")
        placement = split.patcher.model
        processes = placement.runner.processes
        assert split.split and len(processes) == 2 and all(p.is_alive() for p in processes)
        c.record.progress.clear()
        assert _close(_sample(c, split, cond), expected)
        assert [value for value, _, preview in c.record.progress] == [1, 2] and c.record.progress[-1][2][0] == "JPEG"

        c.record.progress.clear()
        c.record.interrupt_after = 1  # ComfyUI's interrupt, raised in the step callback, stops every worker
        with pytest.raises(c.mm.InterruptProcessingException):
            _sample(c, split, cond)
        c.record.interrupt_after = None
        assert all(p.is_alive() for p in processes)

        # a LoRA on the split model: the workers hook it in, as one device does; a run without it drops it
        from lora_files import fused, random_spec, write_native

        write_native(c.tmp / "loras" / "style.safetensors", fused(random_spec(split.dit.config, seed=4, shared_qkv_a=True)),
                     prefix="diffusion_model.")
        one = _load(c, "tiny-random")
        with_lora = _sample(c, c.sampler.H3LoRAApply.execute(one, "style.safetensors", 0.8).values[0], cond)
        assert not _same(with_lora, expected)
        split_lora = c.sampler.H3LoRAApply.execute(split, "style.safetensors", 0.8).values[0]
        assert _close(_sample(c, split_lora, cond), with_lora)
        assert _close(_sample(c, split, cond), expected)

        c.mm.unload_all_models()
        assert placement.runner is None and _gone(processes)
        assert _close(_sample(c, split, cond), expected)  # the next run starts them again
        died = placement.runner.processes
        os.kill(died[1].pid, signal.SIGKILL)  # a worker killed while idle (for memory, say)
        died[1].join()
        assert _close(_sample(c, split, cond), expected)  # the next run starts them again, not fails
        assert placement.runner.processes != died and _gone(died)
    lines = [r.getMessage() for r in caplog.records]
    assert any("workers started on cpu, cpu" in line for line in lines), lines
    assert any("workers on cpu, cpu stopped" in line for line in lines), lines

    processes = placement.runner.processes
    del split, split_lora, placement
    c.record.loaded.clear()
    gc.collect()  # the loader's output dropped (ComfyUI's cache let it go): the workers stop with it
    assert _gone(processes)


def test_adaln_weights_go_back_where_they_were():
    """The sampler's offload_adaln must leave AdaLN weights a plan keeps on the CPU there, not move them to
    the compute device (a 'meta' stand-in for a GPU, so this runs on the CPU)."""
    from h3_core.tiny import tiny_random_dit

    dit = tiny_random_dit()
    dit.condition_proj.to("meta")  # where the compute-side weights live
    with dit.adaln_offloaded():
        pass
    assert all(p.device.type == "cpu" for m in dit.adaln_modules() for p in m.parameters())


def test_unplace_restores_a_block_left_in_its_slot():
    from h3_core.offload import _streamed_parameters, stream_blocks, unplace

    dit = seeded_random_weights(H3DiT(CONFIG), TINY_SEED)
    before = {k: v.clone() for k, v in dit.state_dict().items()}
    streamer = stream_blocks(dit, "cpu", resident=1)
    slots = list(streamer.slots)
    streamer._before(2)(dit.blocks[2], ())  # block 2 computes from a slot, as when a forward fails inside it

    def in_a_slot(param) -> bool:
        return any(s.data_ptr() <= param.data_ptr() < s.data_ptr() + s.numel() for s in slots)

    assert all(in_a_slot(p) for p in _streamed_parameters(dit.blocks[2]))
    unplace(dit, "cpu", streamer)
    assert _clean(dit) and streamer.slots == [] and streamer.home == {}
    assert not any(in_a_slot(p) for p in dit.parameters())
    assert all(torch.equal(before[k], v) for k, v in dit.state_dict().items())


# ----------------------------------------------------------------------------------------------
# The text encoder and the VAE decode on a small GPU


def _encode(c, text, vae):
    return c.conditioning.H3Conditioning.execute(text, "a fox on a beach", "t2va", "auto", 0, 0, 4.0,
                                                 vae=vae).values[0]


def _layers_hooked(encoder) -> bool:
    layers = encoder.model.language_model.layers
    return any(layer._forward_pre_hooks or layer._forward_hooks for layer in layers)


def test_a_small_text_encoder_budget_streams_its_layers_with_the_resident_conditioning(comfy, caplog):
    """gpu_memory_gb below the encoder's weights + activations: it is read to the CPU, ComfyUI sees only
    the resident part (embedding, vision tower) loaded, each decoder layer visits the compute device while
    it runs, and the conditioning is bitwise the resident encoder's; unloading removes the hooks."""
    c = comfy
    vae = c.loaders.H3VAELoader.execute("tiny-random", "tiny-random", "").values[0]
    resident = c.loaders.H3TextEncoderLoader.execute("tiny-random", "", "", "bf16").values[0]
    assert not resident.patcher.model.stream and not _layers_hooked(resident.encoder)
    expected = _encode(c, resident, vae)
    rows = expected.text_states.shape[1]  # room for encoding this prompt: ComfyUI unloads other models for it
    assert c.record.loaded[-1][1] == resident.encoder.encoding_bytes(rows) == 2 * GIB  # a short prompt's floor

    with caplog.at_level("INFO", logger="h3"):
        text = c.loaders.H3TextEncoderLoader.execute("tiny-random", "", "", "bf16", gpu_memory_gb=1.0).values[0]
        patcher, placement = text.patcher, text.patcher.model
        layers = text.encoder.model.language_model.layers
        layer_bytes = sum(p.numel() * p.element_size() for p in layers.parameters())
        assert placement.stream and _layers_hooked(text.encoder)
        assert patcher.loaded_size() == patcher.model_size() == resident.patcher.model_size() - layer_bytes
        # placed with room for its layers in flight and a short prompt's encode
        assert c.record.loaded[-1] == (["H3 text encoder (tiny-random)"],
                                       placement.working_bytes + text.encoder.encoding_bytes(0))
        got = _encode(c, text, vae)
        assert c.record.loaded[-1] == (["H3 text encoder (tiny-random)", "H3 VAEs (tiny-random + tiny-random)"],
                                       placement.working_bytes + 2 * GIB)  # two layers in flight + activations
        assert placement.working_bytes == 2 * sum(p.numel() * p.element_size() for p in layers[0].parameters())
        assert text.encoder._visits.visits == len(layers)  # every layer visited once for the one prompt
        assert torch.equal(got.text_states, expected.text_states)
        assert torch.equal(got.text_tags, expected.text_tags)

        c.mm.unload_all_models()  # /free, "Unload models"
        assert not _layers_hooked(text.encoder) and text.encoder._visits is None and patcher.loaded_size() == 0
    lines = [r.getMessage() for r in caplog.records]
    assert any("text encoder: " in line and "does not fit in 1.00 GiB on cpu (less the allocator's headroom: 0.70)" in line for line in lines), lines
    assert any("decoder layers stay in CPU memory" in line for line in lines), lines
    assert any("H3 text encoder (tiny-random) unloaded" in line and "layer streaming removed" in line
               for line in lines), lines

    text.encoder.forget()  # the same prompt again would need no encoder at all
    again = _encode(c, text, vae)  # the next prompt streams again
    assert _layers_hooked(text.encoder) and torch.equal(again.text_states, expected.text_states)


def test_encoding_a_long_presentation_asks_for_room_by_its_rows(comfy, monkeypatch):
    """Nine release-size image references are ~66,000 rows, ~11 GiB of activations for the 32B (0.18 GiB per
    1,000 rows measured on an H200); a fixed 2 GiB (or nothing, resident) left the rest to an out-of-memory."""
    c = comfy
    vae = c.loaders.H3VAELoader.execute("tiny-random", "tiny-random", "").values[0]
    text = c.loaders.H3TextEncoderLoader.execute("tiny-random", "", "", "bf16").values[0]
    encoder = text.encoder
    assert encoder.encoding_bytes(10**7) == 10**7 * encoder._row_bytes > 2 * GIB
    config = encoder.model.config.text_config  # the 32B's widths in bf16: the measured figure
    monkeypatch.setattr(config, "intermediate_size", 25600)
    monkeypatch.setattr(config, "hidden_size", 5120)
    real = type(encoder)(encoder.model, encoder.presenter)
    itemsize = encoder.model.language_model.embed_tokens.weight.element_size()  # the tiny one is fp32 here
    assert real.encoding_bytes(66_000) / GIB == pytest.approx(0.18 * 66 * itemsize / 2, rel=0.03)
    rows = []
    monkeypatch.setattr(type(encoder), "encoding_bytes", lambda self, n: rows.append(n) or 7 * GIB)
    _encode(c, text, vae)
    assert rows and c.record.loaded[-1][1] == 7 * GIB


def test_the_text_encoder_streams_when_it_does_not_fit_what_comfyui_has_free(comfy, caplog, monkeypatch):
    c = comfy
    streams = c.memory.text_encoder_streams
    monkeypatch.setattr(c.mm, "extra_reserved_memory", lambda: GIB // 2)  # ComfyUI's --reserve-vram: not room
    c.record.free_bytes = 24 * GIB + c.mm.extra_reserved_memory()
    with caplog.at_level("INFO", logger="h3"):
        assert streams(50 * GIB, "cuda:0", None)
    assert caplog.messages[-1].startswith("H3: text encoder: 50.00 GiB does not fit in 24.00 GiB on cuda:0 (less the "
                                          f"allocator's headroom: {usable_bytes(24 * GIB) / GIB:.2f}); its decoder layers")
    assert c.record.freed[-1] == (50 * GIB, "cuda:0")  # other models were asked to leave first
    c.record.free_bytes = 80 * GIB
    assert not streams(50 * GIB, "cuda:0", None)
    assert streams(50 * GIB, "cuda:0", 40.0)  # a budget wins over what is free
    assert not streams(50 * GIB, "cpu", None)  # a CPU host has nothing to stream to
    assert streams(3 * GIB, "cpu", 1.0)  # a budget is honoured anywhere (this is how the CPU tests stream)
    fits = usable_bytes(4 * GIB)  # all a 4 GiB budget holds, less the allocator's headroom
    assert not streams(fits, "cpu", 4.0) and streams(fits + 1, "cpu", 4.0)
    c.record.free_bytes = 4 * GIB + c.mm.extra_reserved_memory()
    assert not streams(fits, "cuda:0", None) and streams(fits + 1, "cuda:0", None)


def test_the_vaes_beside_and_what_is_already_placed_count_for_a_resident_encoder(comfy, monkeypatch):
    """At an encode, a resident encoder (placed for a short prompt alone) is checked again with the VAE beside it:
    what our models already hold counts as room and is kept, the VAE's bytes and the prompt's count against it."""
    c = comfy
    freed = []
    monkeypatch.setattr(c.mm, "free_memory", lambda nbytes, device, keep_loaded=(), **_: freed.append(
        (nbytes, str(device), [entry.model for entry in keep_loaded])))
    class Resident:  # our encoder's patcher, as ComfyUI's registry holds it
        def loaded_size(self):
            return 16 * GIB

    encoder = Resident()
    c.mm.current_loaded_models = [fake_comfy.LoadedModel(encoder)]
    c.record.free_bytes = 8 * GIB  # a 24 GiB card with the 16 GiB encoder on it
    streams = c.memory.text_encoder_streams
    assert not streams(18 * GIB, "cuda:0", None, held=[encoder])  # the encoder and a short prompt: it fits
    assert freed[-1] == (2 * GIB, "cuda:0", [encoder])  # only the prompt's room was asked for, the encoder kept
    assert streams(18 * GIB, "cuda:0", None, beside=6 * GIB, held=[encoder])  # the VAEs beside it do not fit
    assert freed[-1] == (8 * GIB, "cuda:0", [encoder])
    assert not streams(18 * GIB, "cuda:0", 20.0, beside=6 * GIB, held=[encoder])  # its own budget has no VAE
    assert freed[-1] == (2 * GIB, "cuda:0", [encoder])  # within a budget too, only the prompt's room was asked for


def test_an_encode_that_does_not_fit_beside_a_resident_encoder_streams_it_from_then_on(comfy, monkeypatch, caplog):
    """The loader placed the encoder whole for a short prompt within its budget; a long presentation (nine
    pictures: ~11 GiB for the 32B) would not fit there, so the encoder goes back to CPU memory and its layers
    stream, with the resident encoder's conditioning; before, it stayed whole and ran out of device memory."""
    c = comfy
    vae = c.loaders.H3VAELoader.execute("tiny-random", "tiny-random", "").values[0]
    text = c.loaders.H3TextEncoderLoader.execute("tiny-random", "", "", "bf16", gpu_memory_gb=4.0).values[0]
    placement = text.patcher.model
    assert not placement.stream and not _layers_hooked(text.encoder)
    expected = _encode(c, text, vae)  # a short prompt: 2 GiB beside the weights, within 4 GiB
    assert not placement.stream and not _layers_hooked(text.encoder)

    text.encoder.forget()
    monkeypatch.setattr(type(text.encoder), "encoding_bytes", lambda self, rows: 4 * GIB)
    with caplog.at_level("INFO", logger="h3"):
        got = _encode(c, text, vae)
    assert placement.stream and _layers_hooked(text.encoder) and text.encoder._visits.visits > 0
    assert c.record.loaded[-1][1] == placement.working_bytes + 4 * GIB
    assert torch.equal(got.text_states, expected.text_states)
    assert any("does not fit in 4.00 GiB" in r.getMessage() for r in caplog.records)
    c.mm.unload_all_models()
    assert not _layers_hooked(text.encoder) and text.patcher.loaded_size() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
def test_on_a_gpu_a_resident_encoder_without_room_beside_the_vaes_streams(comfy, monkeypatch):
    """The same on a real GPU and without a budget: ComfyUI reports too little free beside our encoder and VAEs
    for the prompt's activations, so the encoder's layers stream from CPU memory, with the same conditioning."""
    c = comfy
    monkeypatch.setattr(c.mm, "get_torch_device", lambda: torch.device("cuda", 0))
    vae = c.loaders.H3VAELoader.execute("tiny-random", "tiny-random", "").values[0]
    text = c.loaders.H3TextEncoderLoader.execute("tiny-random", "", "", "bf16").values[0]
    placement = text.patcher.model
    c.record.free_bytes = 3 * GIB  # room for a short prompt's 2 GiB
    expected = _encode(c, text, vae)
    assert not placement.stream and placement.loaded and placement.device.type == "cuda"
    c.record.free_bytes = GIB // 2
    text.encoder.forget()
    got = _encode(c, text, vae)
    assert placement.stream and text.encoder._visits.visits > 0
    assert all(p.device.type == "cpu" for p in text.encoder.model.language_model.layers.parameters())
    assert text.encoder.model.language_model.embed_tokens.weight.device.type == "cuda"
    assert torch.equal(got.text_states, expected.text_states)
    c.mm.unload_all_models()


def test_vae_decode_asks_comfyui_for_its_working_memory(comfy):
    from nodes.convert import empty_latent

    from h3_core.vae_video import decode_working_bytes

    c = comfy
    output, long_video = importlib.import_module("nodes.output"), importlib.import_module("nodes.long_video")
    vae = c.loaders.H3VAELoader.execute("tiny-random", "tiny-random", "").values[0]
    latent = {**empty_latent(224, 128, 22), "empty": False}  # zeros, decoded here only for the memory asked
    _, _, frames, height, width = latent["video"].shape
    want = decode_working_bytes(vae.video.config, frames, height, width, 4)
    images, _ = output.H3VAEDecode.execute(vae, latent).values
    assert images.shape[0] == 22 and want > 0
    assert c.record.loaded[-1] == (["H3 VAEs (tiny-random + tiny-random)"], want)
    long_video.H3SaveMP4.execute(vae, latent, "H3/long")
    assert c.record.loaded[-1] == (["H3 VAEs (tiny-random + tiny-random)"], want)
    small_tiles = dataclasses.replace(vae.video.config, tile_size=64, tile_min_overlap=16)  # tiles the frames
    tiled, untiled = (decode_working_bytes(dataclasses.replace(small_tiles, decoder_tiling=flag), frames, height, width, 4)
                      for flag in (True, False))
    assert tiled < untiled
    handle = SimpleNamespace(video=SimpleNamespace(config=small_tiles, decoder=vae.video.decoder))
    asked = [c.memory.decode_working_bytes(handle, latent["video"], flag) for flag in (None, True, False)]
    assert asked == [tiled, tiled, untiled]


def test_vae_encodes_ask_comfyui_for_their_working_memory(comfy):
    """H3 VAE Encode, H3 Add Guide and the encodes of keyframes and references asked ComfyUI for the VAEs'
    weights alone: beside a DiT that left a few GiB, a 1344x768 clip's encode (~4 GiB of activations) ran out of
    memory instead of ComfyUI unloading the DiT first."""
    from h3_core.clip_latents import clip_encode_bytes
    from h3_core.guides import guide_encode_bytes

    c = comfy
    latent = importlib.import_module("nodes.latent")
    vae = c.loaders.H3VAELoader.execute("tiny-random", "tiny-random", "").values[0]
    name = ["H3 VAEs (tiny-random + tiny-random)"]
    clip = latent.H3VAEEncode.execute(vae, images=torch.rand(110, 128, 224, 3), frame_rate=24.0, width=224,
                                      height=128).values[0]
    want = clip_encode_bytes(vae.video, vae.audio, 107, 224, 128)
    assert clip["video"].shape[2] == 32 and c.record.loaded[-1] == (name, want) and want > 0
    cond = _encode(c, c.loaders.H3TextEncoderLoader.execute("tiny-random", "", "", "bf16").values[0], vae)
    sound = {"waveform": torch.randn(1, 2, 48000) * 0.1, "sample_rate": 48000}
    c.conditioning.H3AddGuide.execute(cond, vae, 20, image=torch.rand(1, 128, 224, 3), audio=sound)
    want = guide_encode_bytes(np.zeros((1, 128, 224, 3), np.uint8), sound["waveform"][0], 48000, 224, 128,
                              vae.video, vae.audio)
    assert c.record.loaded[-1] == (name, want) and want > 0
    c.memory.place_for_encoding(None, vae, 0, 5 * GIB)  # what encode_request says its VAE encodes take
    assert c.record.loaded[-1] == (name, 5 * GIB)


# Measured on an H200 (bench/vae_decode.py, 2026-11-29 session 4): `output.decode_video` of 1344x768,
# 124 frames peaked at 11.31 GiB allocated with 9.70 GiB of fp32 video-VAE weights, and at 6.13 GiB
# with 5.19 GiB of weights for the bf16 decoder (the audio VAE already freed). The estimate must bound
# both, within 1.6x.
MEASURED_DECODE_WORKING_GIB = {4: 11.31 - 9.70, 2: 6.13 - 5.19}
DECODE_MARGIN = 1.6


def test_the_decode_working_memory_estimate():
    from h3_core import geometry
    from h3_core.vae_video import VideoVAEConfig, decode_working_bytes

    config = VideoVAEConfig()
    height, width = geometry.latent_size(1344, 768)
    for dtype_bytes, measured in MEASURED_DECODE_WORKING_GIB.items():
        at_measured = decode_working_bytes(config, geometry.latent_frames(124), height, width, dtype_bytes) / GIB
        assert measured <= at_measured <= DECODE_MARGIN * measured, (dtype_bytes, at_measured)
    # monotone in the canvas (each side, latent by latent) and in the frames (flat: one clip at a time)
    for fixed in (2, 8, 16, 31, 48, 84):
        sizes = [decode_working_bytes(config, 7, fixed, side) for side in range(1, 100)]
        assert sizes == sorted(sizes)
        sizes = [decode_working_bytes(config, 7, side, fixed) for side in range(1, 100)]
        assert sizes == sorted(sizes)
    frames = [decode_working_bytes(config, latents, 48, 84) for latents in (3, 7, 12, 37, 92, 400)]
    assert frames == sorted(frames) and frames[0] == frames[-1]
    # fp16 outputs halve the pixel buffers but not the float32 residual stream
    assert decode_working_bytes(config, 7, 48, 84, 2) < decode_working_bytes(config, 7, 48, 84, 4)
    with pytest.raises(ValueError, match="latents in every dimension"):
        decode_working_bytes(config, 0, 48, 84)


# Measured on an H200 (bench/vae_encode_memory.py, 2026-12-05 session 43, cuDNN's heuristics): peak allocated less
# the weights, GiB. Video: (frames, height, width, tiled); audio: seconds of a stereo track at 32 kHz.
MEASURED_VIDEO_ENCODE_GIB = {(17, 768, 1344, True): 4.645, (17, 1344, 768, True): 4.645, (17, 992, 992, True): 4.634,
                             (17, 512, 512, True): 4.461, (17, 320, 320, True): 4.421, (17, 512, 512, False): 17.602,
                             (1, 768, 1344, True): 0.396, (1, 512, 512, True): 0.384, (1, 768, 1344, False): 5.935,
                             (1, 320, 320, False): 0.593}
MEASURED_AUDIO_ENCODE_GIB = {5.2: 0.402, 20.0: 0.798, 120.0: 0.905}
ENCODE_MARGIN = 1.3


def test_the_encode_working_memory_estimates():
    from h3_core.vae_audio import AudioVAEConfig
    from h3_core.vae_audio import encode_working_bytes as audio_bytes
    from h3_core.vae_video import VideoVAEConfig
    from h3_core.vae_video import encode_working_bytes as video_bytes

    video, audio = VideoVAEConfig(), AudioVAEConfig()
    for (frames, height, width, tiled), measured in MEASURED_VIDEO_ENCODE_GIB.items():
        bound = video_bytes(video, frames, height, width, tiled) / GIB
        assert measured <= bound <= ENCODE_MARGIN * measured, (frames, height, width, tiled, bound)
    for seconds, measured in MEASURED_AUDIO_ENCODE_GIB.items():
        bound = audio_bytes(audio, int(seconds * 32000)) / GIB
        assert measured <= bound <= ENCODE_MARGIN * measured, (seconds, bound)
    # tiles bound a clip's encode whatever the canvas; a clip's moments grow with its length (300 s: 7200 frames)
    assert video_bytes(video, 17, 768, 1344) == video_bytes(video, 17, 768, 1344, True)
    lengths = [video_bytes(video, frames, 768, 1344) for frames in (17, 124, 7200)]
    assert lengths == sorted(set(lengths)) and lengths[1] - lengths[0] < 2**27
    assert video_bytes(video, 1, 768, 1344, False) > 4 * video_bytes(video, 1, 768, 1344)  # a lone frame, untiled
    # the trunk's windows bound the audio encode; the attention over every frame grows with the track
    assert audio_bytes(audio, 32000 * 300) > audio_bytes(audio, 32000 * 20) > audio_bytes(audio, 32000)
    with pytest.raises(ValueError, match="pixels in every dimension"):
        video_bytes(video, 0, 768, 1344)
    with pytest.raises(ValueError, match="needs a sound"):
        audio_bytes(audio, 0)


def test_fp8_linears_from_a_file_sample_with_a_lora(comfy):
    """The Model Loader's linears fp8-weights-lossy on a real file: the block linears load as FP8 (ComfyUI
    is told the smaller size), the sampler runs them close to, not equal to, the dense linears, and a
    LoRA applies dynamically without touching the cached FP8 weights."""
    from lora_files import random_spec, write_peft

    from h3_core.fp8 import FP8Linear

    c = comfy
    cond = _cond(c)
    dense = _load(c)
    expected = _sample(c, dense, cond)
    model = _load(c, linears="fp8-weights-lossy")
    block = model.dit.blocks[0]
    for linear in (block.attn.qkv_proj, block.attn.out_proj, block.mlp.fc1, block.mlp.fc2):
        assert isinstance(linear, FP8Linear) and linear.weight.dtype == torch.float8_e4m3fn
    assert model.patcher.model_size() < dense.patcher.model_size()
    got = _sample(c, model, cond)
    assert not _same(got, expected)
    for key in ("video", "audio"):
        assert torch.nn.functional.cosine_similarity(got[key].flatten(), expected[key].flatten(), dim=0) > 0.99

    write_peft(c.tmp / "loras" / "style.safetensors", random_spec(CONFIG, seed=3))
    stored = {k: v.clone() for k, v in model.dit.state_dict().items()}
    styled = c.sampler.H3LoRAApply.execute(model, "style.safetensors", 1.0).values[0]
    assert not _same(_sample(c, styled, cond), got)
    assert all(torch.equal(stored[k], v) for k, v in model.dit.state_dict().items())
    assert _same(_sample(c, model, cond), got)  # the hooks left with the run


def test_fp8_matmuls_are_refused_before_loading_where_the_device_lacks_them(comfy, monkeypatch):
    from h3_core import fp8

    monkeypatch.setattr(fp8, "scaled_mm_supported", lambda *device: False)
    read = []
    monkeypatch.setattr(comfy.loaders, "DiTReader", lambda *a, **k: read.append(a))
    with pytest.raises(ValueError, match="FP8 matmuls are not supported on cpu.*fp8-weights-lossy"):
        _load(comfy, linears="fp8-lossy")
    assert read == []


def test_a_dit_read_into_more_cpu_memory_than_is_available_is_warned_about(comfy, caplog, monkeypatch):
    """Reading a DiT into CPU memory the system does not have swaps or gets ComfyUI stopped: the log says so,
    with what it needs and what is available (Linux MemAvailable), before the read at the first run."""
    from h3_core import runtime

    cond = _cond(comfy)
    size = sum(f.stat().st_size for f in (comfy.tmp / "diffusion_models").rglob("*.safetensors"))
    monkeypatch.setattr(runtime, "host_memory_available", lambda: size // 2)
    with caplog.at_level("WARNING", logger="h3"):
        _sample(comfy, _load(comfy), cond)
    assert any("needs about" in r.message and "GiB of CPU memory" in r.message and "Free other models" in r.message
               for r in caplog.records), caplog.text
    caplog.clear()
    monkeypatch.setattr(runtime, "host_memory_available", lambda: size + comfy.host_memory.HEADROOM)
    with caplog.at_level("WARNING", logger="h3"):
        _sample(comfy, _load(comfy), cond)
    assert not any("GiB of CPU memory" in r.message for r in caplog.records)


def _file_text_encoder(c):
    """A tiny Qwen3-VL written as the release lays it out and loaded with its layers streamed (a budget too
    small for it), so its weights wait in CPU memory and can be read again from the files; on the tiny
    canvas, as the tiny DiT needs."""
    import tiny_qwen

    from h3_core.pipeline import TINY_CANVAS

    tokenizer = tiny_qwen.write_tokenizer(c.tmp / "tok")
    qwen = tiny_qwen.random_model(tiny_qwen.config_dict(tokenizer, hidden=CONFIG.text_dim), seed=3)
    release = tiny_qwen.write_original_release(c.tmp / "MiniMax-H3", qwen, tokenizer)
    text = c.loaders.H3TextEncoderLoader.execute("tiny-random", str(release), "", "fp32", gpu_memory_gb=0.001)
    return dataclasses.replace(text.values[0], canvas=TINY_CANVAS)


def test_outputs_comfyui_drops_for_room_give_their_pinned_memory_back(comfy, monkeypatch):
    """A DiT among the cached outputs ComfyUI drops for room leaves its streamed blocks' pinned memory in torch's
    host allocator, resident and of no use to the read that asked for the room, unless it is handed back."""
    from h3_core import runtime

    events = []
    comfy_memory = SimpleNamespace(extra_ram_release=lambda target, free_active=False: events.append("dropped"))
    monkeypatch.setitem(sys.modules, "comfy.memory_management", comfy_memory)
    monkeypatch.setattr(runtime, "host_memory_available", lambda: 0)
    monkeypatch.setattr(runtime, "empty_host_cache", lambda: events.append("pinned memory handed back"))
    comfy.host_memory.make_host_room(2**30)
    assert events == ["dropped", "pinned memory handed back"]


def test_our_models_take_turns_in_cpu_memory_too_small_for_both(comfy, caplog, monkeypatch):
    """With no CPU memory to spare, the streamed text encoder and the DiT each let go of their weights
    while the other reads, and are read again from their files when next needed (a new prompt, the next
    run); the latents are those of a machine with room for both. ComfyUI's own cache is asked first."""
    from h3_core import runtime

    c = comfy
    asked = []
    comfy_memory = SimpleNamespace(extra_ram_release=lambda target, free_active=False: asked.append(target))
    monkeypatch.setitem(sys.modules, "comfy.memory_management", comfy_memory)
    available = [0]
    monkeypatch.setattr(runtime, "host_memory_available", lambda: available[0])
    vae = c.loaders.H3VAELoader.execute("tiny-random", "tiny-random", "").values[0]
    text = _file_text_encoder(c)
    encoder, dit_placement = text.encoder, None
    tensors = len(encoder.model.state_dict())  # the loader's read had a progress bar
    assert c.record.progress == [(done, tensors, None) for done in range(1, tensors + 1)]

    def encode(prompt):
        return c.conditioning.H3Conditioning.execute(text, prompt, "t2va", "auto", 0, 0, 4.0, vae=vae).values[0]

    fox = encode("a fox on a beach")
    model = _load(c)
    dit_placement = model.patcher.model
    with caplog.at_level("INFO", logger="h3"):
        first = _sample(c, model, fox)  # the DiT's read makes the idle encoder let go
        assert encoder.model is None and dit_placement.reader.is_read
        c.record.progress.clear()
        heron = encode("a heron in the reeds")  # the encoder is read again; the idle DiT lets go
        assert encoder.model is not None and not dit_placement.reader.is_read
        assert c.record.progress[:tensors] == [(done, tensors, None) for done in range(1, tensors + 1)]
        weights = sum(t.numel() * t.element_size() for t in [*encoder.model.parameters(), *encoder.model.buffers()])
        assert asked[-1] == weights + c.host_memory.HEADROOM  # room asked for all of it, streamed layers too
        second = _sample(c, model, heron)
        assert encoder.model is None and dit_placement.reader.is_read
    released = [r.message for r in caplog.records if "let go of its weights" in r.message]
    assert len(released) == 3 and "text encoder" in released[0] and "H3 DiT" in released[1], released
    assert asked and all(target >= c.host_memory.HEADROOM for target in asked)

    available[0] = 1 << 50  # room for both: nothing lets go, and the results are the same
    assert _same(_sample(c, model, encode("a fox on a beach")), first)
    assert _same(_sample(c, model, encode("a heron in the reeds")), second)
    assert encoder.model is None and dit_placement.reader.is_read  # both prompts remembered: no read for them
    encode("a crane at dawn")
    assert encoder.model is not None  # a new one reads the encoder again
    assert not _same(first, second)


def test_our_models_let_go_largest_first_only_until_a_read_fits(comfy, monkeypatch):
    """A read that does not fit with its headroom asks ComfyUI's cache first, then our models that can be read
    again let go, largest first, and no more of them than it takes; not the model that needs the room, and none
    when others may not; whether it fits is said."""
    from h3_core import runtime

    host, free = comfy.host_memory, [10 * GIB]

    class Held:  # a placement's part here: its CPU bytes, whether it can be read again, letting go
        def __init__(self, size, releasable=True):
            self.host_bytes, self.releasable = size, releasable

        def release_weights(self):
            free[0], self.host_bytes = free[0] + self.host_bytes, 0

    big, small, kept = Held(40 * GIB), Held(20 * GIB), Held(60 * GIB, releasable=False)
    for placement in (big, small, kept):
        host.track(placement)
    monkeypatch.setattr(runtime, "host_memory_available", lambda: free[0])
    asked = []  # ComfyUI's cache, asked first (here it frees nothing)
    monkeypatch.setitem(sys.modules, "comfy.memory_management",
                        SimpleNamespace(extra_ram_release=lambda target, free_active=False: asked.append(target)))
    assert host.make_host_room(6 * GIB) and free == [10 * GIB] and asked == []  # fits with 4 GiB of headroom
    assert not host.make_host_room(7 * GIB, others=False) and free == [10 * GIB]  # 11 GiB: ours left alone
    assert asked == [11 * GIB]
    assert host.make_host_room(30 * GIB)  # the big one went: 50 GiB free holds 30 and the 4 of headroom
    assert (big.host_bytes, small.host_bytes, kept.host_bytes) == (0, 20 * GIB, 60 * GIB)
    assert not host.make_host_room(60 * GIB, needing=small) and small.host_bytes == 20 * GIB  # not for itself


def test_a_model_unloaded_without_cpu_room_to_wait_in_lets_go_instead(comfy, caplog, monkeypatch):
    """ComfyUI unloading a model from the GPU moves it into CPU memory. Without room for it there, a model
    that can be read again lets go of its weights instead (and no other model is let go of for it: another
    is about to run), and its next load reads it again. With room, it waits in CPU memory as before."""
    from h3_core import runtime
    from h3_core.checkpoint import DiTReader
    from h3_core.placement import DiTPlacement

    path = comfy.tmp / "diffusion_models" / FOUR_BLOCKS
    idle = DiTReader(path, dtype=torch.float32)
    idle.read("cpu")
    comfy.host_memory.track(DiTPlacement("idle", idle.model, "cpu", "cpu", reader=idle))
    reader = DiTReader(path, dtype=torch.float32)
    # "cpu:0" stands for a GPU: a device other than the one it waits on, so unloading moves it
    placement = DiTPlacement("parked", reader.model, torch.device("cpu", 0), "cpu", reader=reader)
    comfy.host_memory.track(placement)
    placement.load()
    expected = {name: t.clone() for name, t in reader.model.state_dict().items()}

    monkeypatch.setattr(runtime, "host_memory_available", lambda: 0)
    with caplog.at_level("INFO", logger="h3"):
        assert placement.offload() == placement.size
    assert not reader.is_read and not placement.loaded and idle.is_read
    assert any("parked let go of its weights" in r.message for r in caplog.records), caplog.text

    monkeypatch.setattr(runtime, "host_memory_available", lambda: 1 << 50)
    placement.load()
    got = reader.model.state_dict()
    assert all(torch.equal(got[name], t) for name, t in expected.items())
    placement.offload()
    assert reader.is_read and not placement.loaded  # room enough: it waits in CPU memory


def test_a_text_encoder_unloaded_without_cpu_room_lets_go_instead(comfy, monkeypatch):
    """The same for a text encoder resident on the GPU: without room in CPU memory, unloading lets go of its
    weights, and the next encode reads them again onto the device and gives the same conditioning."""
    from h3_core import runtime
    from h3_core.placement import TextEncoderPlacement

    text = _file_text_encoder(comfy)  # streamed there; here the same encoder resident on "cpu:0"
    encoder = text.encoder
    encoder.to("cpu")
    placement = TextEncoderPlacement("text", encoder, torch.device("cpu", 0), "cpu", loaded=True)
    comfy.host_memory.track(placement)
    presentation = encoder.present("t2va", "a fox on a beach")
    expected = encoder.encode(presentation).prompt_embeds
    monkeypatch.setattr(runtime, "host_memory_available", lambda: 0)
    assert placement.offload() == placement.size
    assert encoder.model is None and not placement.loaded
    monkeypatch.setattr(runtime, "host_memory_available", lambda: 1 << 50)
    placement.load()
    assert torch.equal(encoder.forget().encode(presentation).prompt_embeds, expected)  # read again, run again


def test_h3_generate_notes_a_dit_bigger_than_the_available_cpu_memory(tmp_path, monkeypatch):
    """The CLI's side of the warning above: `h3 generate` reading the DiT into CPU memory says it in a note."""
    from h3_core import pipeline, runtime
    from h3_core.checkpoint import locate_dit

    path = write_four_blocks(tmp_path)
    monkeypatch.setattr(runtime, "host_memory_available", lambda: path.stat().st_size // 2)
    source = pipeline.ModelSource(str(path), path)  # the DiT alone: what load_sampling_dit reads
    layout = _cond_layout()
    notes, read = [], []
    dit, _, streamer = pipeline.load_sampling_dit(
        source, locate_dit(path, "fl2va"), "fl2va", pipeline.GenerateSettings(steps=STEPS, dtype=torch.float32),
        [], SimpleNamespace(layout=layout), STEPS, notes.append, lambda *step: read.append(step))
    assert streamer is None and len(dit.blocks) == 4
    tensors = len(dit.state_dict())  # the CLI's "read DiT" bar
    assert read == [(done, tensors) for done in range(1, tensors + 1)]
    assert any(note.startswith("memory: The DiT needs about") and "GiB of CPU memory" in note for note in notes), notes


def _cond_layout():
    from h3_core.layout import build_request_layout

    return build_request_layout(224, 128, 107, torch.ones(6, dtype=torch.long))


def test_a_streamed_text_encoder_read_into_too_little_cpu_memory_is_warned_about(comfy, caplog, monkeypatch):
    import tiny_qwen

    from h3_core import runtime

    tokenizer = tiny_qwen.write_tokenizer(comfy.tmp / "tok")
    model = tiny_qwen.random_model(tiny_qwen.config_dict(tokenizer), seed=3)
    release = tiny_qwen.write_original_release(comfy.tmp / "MiniMax-H3", model, tokenizer)
    monkeypatch.setattr(runtime, "host_memory_available", lambda: 1024)
    with caplog.at_level("WARNING", logger="h3"):  # a budget too small for it: its layers will stream
        comfy.loaders.H3TextEncoderLoader.execute("tiny-random", str(release), "", "bf16", gpu_memory_gb=0.001)
    assert any(r.message.startswith("H3: The text encoder needs about") for r in caplog.records), caplog.text


def test_a_vsa_student_samples_on_its_ladder_with_sparse_attention(comfy, monkeypatch):
    """A DiT file carrying VSA gates (FastH3 8-Step V2): the loader turns its Video Sparse Attention on and
    refuses the attention window; the sampler's automatic steps are its contract's 8 forwards, every block through
    VSA with its gate; split over two devices it samples the same."""
    from h3_core import dit as dit_module

    c = comfy
    name = "h3_tiny_vsa_student.safetensors"
    student = seeded_random_weights(H3DiT(dataclasses.replace(CONFIG, vsa_gates=True)), TINY_SEED)
    save_file({f"model.diffusion_model.{k}": v.contiguous() for k, v in student.state_dict().items()},
              str(c.tmp / "diffusion_models" / name))
    with pytest.raises(ValueError, match="Video Sparse Attention gates"):
        _load(c, name, attention_window_lossy=2)
    model = _load(c, name)
    assert model.vsa_student and model.dit.sparse_attention == 0.8 and not _load(c).vsa_student
    calls = []
    real = dit_module.vsa_attention
    monkeypatch.setattr(dit_module, "vsa_attention", lambda *a: calls.append(a) or real(*a))
    cond = _cond(c)
    one = c.sampler.H3Sampler.execute(model, cond, 5, 0, 0.0, 0.0).values[0][0]
    assert len(calls) == 8 * CONFIG.num_layers and {call[4] for call in calls} == {0.8}
    assert all(call[5] is not None for call in calls)
    text = c.loaders.H3TextEncoderLoader.execute("tiny-random", "", "", "bf16").values[0]
    # its encode (a step per text encoder layer), then a sampling step: 8 a window too
    c.record.interrupt_after = len(c.record.progress) + text.encoder.layer + 1
    with pytest.raises(c.memory.mm.InterruptProcessingException):
        importlib.import_module("nodes.long_video").H3Continuation.execute(
            model, text, "a fox on a beach", "t2va", 8.0, "continuation", 107, 22, 3, 0, 0.0, 0.0, "auto", 0, 0)
    c.record.interrupt_after = None
    assert c.record.progress[-1][:2] == (1, 2 * 8)
    split = _load(c, name, devices="cpu,cpu")
    assert split.split and split.vsa_student
    two = c.sampler.H3Sampler.execute(split, cond, 5, 0, 0.0, 0.0).values[0][0]
    assert all(torch.allclose(two[key], one[key], rtol=1e-4, atol=1e-5) for key in ("video", "audio"))


def test_an_nvfp4_dit_file_stays_nvfp4_and_samples_as_its_dense_weights(comfy):
    """Comfy-Org's nvfp4 DiT files through the Model Loader: the block linears are held NVFP4 (the memory plan
    counts them so) and the sampler's latents are those of a dense file holding the weights they stand for."""
    import nvfp4_files

    from h3_core.fp8 import held_format
    from h3_core.nvfp4 import NVFP4Linear

    c = comfy
    tensors = {k: v.contiguous() for k, v in seeded_random_weights(H3DiT(CONFIG), TINY_SEED).state_dict().items()}
    dense = dict(tensors)
    layers = [f"blocks.{i}.{leaf}" for i in range(CONFIG.num_layers)
              for leaf in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")]
    for layer, (values, _) in nvfp4_files.quantize_layers(tensors, layers).items():
        dense[f"{layer}.weight"] = values.float()
    for name, state in (("h3_tiny_nvfp4.safetensors", tensors), ("h3_tiny_dense.safetensors", dense)):
        save_file({f"model.diffusion_model.{k}": v for k, v in state.items()}, str(c.tmp / "diffusion_models" / name))
    quantized, plain = _load(c, "h3_tiny_nvfp4.safetensors"), _load(c, "h3_tiny_dense.safetensors")
    assert all(isinstance(quantized.dit.get_submodule(layer), NVFP4Linear) for layer in layers)
    assert held_format(quantized.dit) == "nvfp4" and held_format(plain.dit) == "dense"
    cond = _cond(c)
    a, b = _sample(c, quantized, cond), _sample(c, plain, cond)
    assert all(torch.allclose(a[key], b[key], rtol=1e-5, atol=1e-6) for key in ("video", "audio"))


def test_a_gguf_file_is_listed_and_samples_as_the_engine_does(comfy):
    """ComfyUI lists only its own weight suffixes; the Model Loader also offers the .gguf files of
    models/diffusion_models, and samples them as the engine does."""
    import gguf_files

    from h3_core.checkpoint import load_dit
    from h3_core.pipeline import sample

    c = comfy
    path = c.tmp / "diffusion_models" / "h3_tiny_4_blocks-Q8_0.gguf"
    model = seeded_random_weights(H3DiT(CONFIG), TINY_SEED)
    linears = {f"blocks.{i}.{leaf}.weight": "Q8_0" for i in range(4)
               for leaf in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")}
    gguf_files.write_gguf(path, model.state_dict(), linears, prefix="model.diffusion_model.")
    assert path.name in c.loaders.H3ModelLoader.define_schema().inputs[0].options["options"]
    loaded = _load(c, path.name)
    assert loaded.dit.blocks[3].mlp.fc1.held == "gguf"
    cond = _cond(c)
    expected = sample(load_dit(path, dtype=torch.float32), cond, 5, STEPS)
    assert _same(_sample(c, loaded, cond), {"video": expected.video, "audio": expected.audio})


def test_a_budget_larger_than_the_gpu_is_refused_by_the_loaders_before_any_read(comfy, monkeypatch):
    """gpu_memory_gb 32 on a 24 GiB card: the text encoder 'fitted' it, was read onto the GPU and ran out of memory
    part way (the DiT's plan refused it only at the sampler). Both loaders now say so before reading anything."""
    from h3_core import memory_plan

    monkeypatch.setattr(comfy.mm, "get_torch_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(memory_plan, "total_bytes", lambda device: 24 * GIB)
    reads = []
    monkeypatch.setattr(comfy.loaders, "load_text_encoder", lambda *args, **kwargs: reads.append(args))
    refused = r"The GPU memory budget \(32 GiB\) is more than cuda:0 has \(24.0 GiB in all\); give at most that"
    with pytest.raises(ValueError, match=refused):
        comfy.loaders.H3TextEncoderLoader.execute("tiny-random", "", "", "bf16", gpu_memory_gb=32.0)
    with pytest.raises(ValueError, match=refused):
        _load(comfy, gpu_memory_gb=32.0)
    assert not reads and not comfy.record.loaded


def test_cancel_while_a_split_models_workers_load_stops_them_at_once(comfy, monkeypatch):
    """Reading the real DiT takes each worker minutes; ComfyUI's Cancel was not heard until they had all loaded
    (then a graceful stop waited 30 s more for workers that could not answer it). Now it ends them at once."""
    import multiprocessing
    import time

    from parallel_faults import SlowSpec

    c = comfy
    monkeypatch.setattr(c.loaders, "ModelSpec", lambda *args, **kwargs: SlowSpec(*args, seconds=60.0, **kwargs))
    c.record.interrupt_after = 0  # Cancel pressed as the loader runs
    started = time.monotonic()
    with pytest.raises(c.mm.InterruptProcessingException):
        _load(c, "tiny-random", devices="cpu,cpu")
    assert time.monotonic() - started < 30 and not multiprocessing.active_children()


def test_a_split_model_keeping_a_clips_video_previews_nothing_as_one_device(comfy):
    """The workers sample the layout with the kept video locked; the previews were drawn from the unlocked one, an
    'estimate' of the clip that is kept as it is (one device shows none)."""
    c = comfy
    cond = _cond(c)
    one = _load(c, "tiny-random")
    latent = c.sampler.H3Sampler.execute(one, cond, 5, STEPS, 0.0, 0.0).values[0][0]
    previews = []
    for model in (one, _load(c, "tiny-random", devices="cpu,cpu")):
        c.record.progress.clear()
        c.sampler.H3Sampler.execute(model, cond, 6, STEPS, 0.0, 0.0, latent=latent, keep="video")
        previews.append([preview for _, _, preview in c.record.progress])
    c.mm.unload_all_models()
    assert previews[0] == previews[1] == [None] * (STEPS - 1)
