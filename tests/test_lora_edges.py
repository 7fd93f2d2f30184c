"""LoRA / Turbo adapters at their edges: switched off (strength 0, schedule included), an application failing part
way (nothing stays behind on a shared model), files whose tensors or Turbo metadata are wrong or disagree with
their names, and the options a split DiT's workers load adapters with. Forwards are our own tiny model's
(test_lora proves the applied deltas against diffusers)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from lora_files import Spec, fused, random_spec, write_kohya, write_native, write_peft
from safetensors.torch import load_file, save_file
from test_fp8 import forward

from h3_core import lora as lora_module
from h3_core.config import TINY_DIT
from h3_core.lora import (
    LoRAError,
    applied_contracts,
    applied_loras,
    apply_loras,
    check_loras,
    load_lora,
    remove_loras,
    sampler_settings,
)
from h3_core.tiny import tiny_random_dit

TURBO_4STEP = "minimax_h3_fl2v_turbo_4step_v1.1_768p_bf16.safetensors"  # 5 points, video shift 6


class Stopped(Exception):
    """Raised by a stand-in to end a run once what a test looks at has happened."""


def _forward(model):
    return forward(model, times=(0.5, 0.25))


def _state(model):
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def test_a_turbo_adapter_at_strength_0_is_off_schedule_included(tmp_path):
    turbo = load_lora(write_peft(tmp_path / TURBO_4STEP, random_spec(TINY_DIT)))
    assert turbo.contract.steps == 5
    assert applied_contracts([(turbo, 0.0)]) == [] and applied_contracts([(turbo, -0.5)]) == [turbo.contract]
    assert sampler_settings(applied_contracts([(turbo, 0.0)])).steps == 50  # the base model's schedule
    model = tiny_random_dit()
    report = apply_loras(model, [(turbo, 0.0)], partition="fl2va")
    assert report.contracts == [] and report.sampler_settings().steps == 50
    assert "strength 0: nothing applied, its schedule not used" in report.loras[0].notes


def test_generate_with_a_turbo_adapter_at_strength_0_takes_the_base_schedule(tmp_path, capsys, monkeypatch):
    from h3_core import pipeline
    from h3_core.cli import main

    turbo = write_peft(tmp_path / TURBO_4STEP, random_spec(TINY_DIT, rank=4))

    def stop(*args, **kwargs):
        raise Stopped  # the schedule is reported by then; no need to sample it

    monkeypatch.setattr(pipeline, "load_sampling_dit", stop)
    with pytest.raises(Stopped):
        main(["generate", "--prompt", "A fox.", "--lora", f"{turbo}:0", "--save-latents",
              str(tmp_path / "o.safetensors")])
    err = capsys.readouterr().err
    assert "sampler: 50 sigma points (49 model calls), video shift 12, audio shift 3" in err
    assert "sampler: 50" in err and "5 sigma points" not in err


@pytest.mark.parametrize("mode", ["merge", "dynamic"])
def test_an_application_failing_part_way_leaves_the_model_as_it_was(tmp_path, monkeypatch, mode):
    """Out of memory on the device part way through (simulated at the third module): the modules done so far go
    back, so a model shared by later runs (ComfyUI's loaders share one) does not carry part of the adapter."""
    adapter = load_lora(write_peft(tmp_path / "style.safetensors", random_spec(TINY_DIT)))
    model = tiny_random_dit()
    before, plain = _state(model), _forward(model)
    calls = []
    target = "_DeltaHook" if mode == "dynamic" else "_summed_delta"
    real = getattr(lora_module, target)

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(lora_module, target, failing)
    with pytest.raises(torch.OutOfMemoryError):
        apply_loras(model, [adapter], partition="fl2va", mode=mode)
    assert len(calls) == 3 and applied_loras(model) == []
    assert all(not module._forward_hooks for module in model.modules())
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())
    assert all(torch.equal(a, b) for a, b in zip(_forward(model), plain))
    monkeypatch.setattr(lora_module, target, real)
    apply_loras(model, [adapter], partition="fl2va", mode=mode)  # and the adapter still applies whole afterwards
    assert not torch.equal(_forward(model)[0], plain[0])
    assert remove_loras(model) == 1 and all(torch.equal(a, b) for a, b in zip(_forward(model), plain))


def test_a_strength_that_is_no_number_is_refused_by_the_shape_check(tmp_path):
    adapter = load_lora(write_peft(tmp_path / "style.safetensors", random_spec(TINY_DIT)))
    for strength in (float("nan"), float("inf")):
        with pytest.raises(LoRAError, match=r"Strength of style\.safetensors must be a finite number"):
            check_loras(TINY_DIT, [(adapter, strength)], "fl2va")  # before any weight is read


def test_a_turbo_name_with_no_usable_step_count_is_refused_naming_the_file(tmp_path):
    spec = random_spec(TINY_DIT)
    for steps, calls in (("0step", 0), ("1000step", 1000), ("99999step", 99999)):
        name = f"minimax_h3_fl2v_turbo_{steps}_v1.0.safetensors"
        with pytest.raises(LoRAError, match=rf"minimax_h3_fl2v_turbo_{steps}_v1\.0 names a schedule of {calls} "
                                            r"model calls \(from its file name\); a schedule makes 1 to 999\."):
            load_lora(write_peft(tmp_path / name, spec))
    for calls in (1, 999):  # the ends of what a schedule makes
        name = f"minimax_h3_fl2v_turbo_{calls}step_v1.0.safetensors"
        assert load_lora(write_peft(tmp_path / name, spec)).contract.forwards == calls


def test_an_upper_case_suffix_keeps_a_release_name(tmp_path):
    turbo = load_lora(write_peft(tmp_path / TURBO_4STEP.replace(".safetensors", ".SAFETENSORS"), random_spec(TINY_DIT)))
    assert turbo.contract is not None and turbo.contract.steps == 5 and turbo.partition == "fl2va"
    # the release's alpha 8 (no alpha in the file) over each term's rank, not alpha = rank
    assert {term.scale for term in turbo.parts[None]} == {8 / term.rank for term in turbo.parts[None]} == {2.0, 4.0}


def _with_metadata(path, metadata):
    spec = fused(random_spec(TINY_DIT, shared_qkv_a=True))
    return write_native(path, spec, metadata=metadata)


def test_turbo_metadata_is_checked_and_weighed_against_the_name(tmp_path):
    with pytest.raises(LoRAError, match=r"base_schedule \[1\.0, nan, 0\.0\] must be strictly decreasing"):
        load_lora(_with_metadata(tmp_path / "a.safetensors", {"base_schedule": "1.0,nan,0.0"}))
    with pytest.raises(LoRAError, match=r"base_schedule \[1\.0, 0\.5, 0\.5, 0\.0\] must be strictly decreasing"):
        load_lora(_with_metadata(tmp_path / "a.safetensors", {"base_schedule": "1,0.5,0.5,0"}))  # a repeated point
    with pytest.raises(LoRAError, match=r"names task\(s\) 't2v' in 'tasks'; H3's tasks are t2va, fl2va, ref2va\."):
        load_lora(_with_metadata(tmp_path / "b.safetensors", {"base_schedule": "1,0.5,0", "tasks": "t2v"}))
    # a ladder in the metadata, the partition in the name: a ref2v Turbo stays a ref2va adapter
    ref2v = load_lora(_with_metadata(tmp_path / "minimax_h3_ref2v_turbo_4step_v0.1_bf16.safetensors",
                                     {"base_schedule": "1,0.75,0.5,0.25,0"}))
    assert ref2v.contract.identified_by == "metadata" and ref2v.partition == "ref2va" and ref2v.notes == []
    agreeing = load_lora(_with_metadata(tmp_path / "minimax_h3_fl2v_turbo_4step_v1.0_768p_bf16.safetensors",
                                        {"base_schedule": "1,0.75,0.5,0.25,0", "tasks": "fl2va"}))
    assert agreeing.contract.tasks == ("fl2va",) and agreeing.notes == []  # name and metadata agree: nothing to say
    with pytest.raises(LoRAError, match="distilled for ref2va .*not on fl2va"):
        check_loras(TINY_DIT, [(ref2v, 1.0)], "fl2va")
    disagreeing = load_lora(_with_metadata(tmp_path / "minimax_h3_fl2v_turbo_8step_v1.0_bf16.safetensors",
                                           {"base_schedule": "1,0.5,0", "tasks": "ref2va"}))
    assert disagreeing.contract.steps == 3 and disagreeing.partition == "ref2va"
    assert disagreeing.notes == ["its metadata names tasks ref2va, its file name t2va/fl2va: the metadata's are used",
                                 "its file name says 8 model calls, its metadata's base_schedule 2: the metadata's "
                                 "ladder is used"]
    # tasks over both partitions: it goes on either DiT
    both = load_lora(_with_metadata(tmp_path / "both.safetensors", {"base_schedule": "1,0.5,0", "tasks": "t2va,ref2va"}))
    assert both.partition is None
    for partition in ("fl2va", "ref2va"):
        check_loras(TINY_DIT, [(both, 1.0)], partition)


def test_a_distilled_ladder_stays_when_steps_asks_for_its_own_length(tmp_path):
    meta = {"base_schedule": "1.0,0.7,0.4,0.15,0.0", "tasks": "t2va"}
    contract = load_lora(_with_metadata(tmp_path / "flash.safetensors", meta)).contract
    own = sampler_settings(contract)
    same = sampler_settings(contract, steps=5)
    assert same.video_sigmas == own.video_sigmas is not None and same.notes == ()
    other = sampler_settings(contract, steps=6)
    assert other.video_sigmas is None and "steps=6 overrides the contract's 5" in other.notes[0]
    # a ladder given is weighed against the contract's ladder for that clock (video shift 12, audio 3)
    assert sampler_settings(contract, video_sigmas=own.video_sigmas, audio_sigmas=own.audio_sigmas).notes == ()
    halved = [sigma / 2 if 0 < sigma < 1 else sigma for sigma in own.video_sigmas]
    (note,) = sampler_settings(contract, video_sigmas=halved).notes
    assert note.startswith("user video_sigmas=[1, 0.48276, 0.44444, 0.33962, 0] overrides the contract's "
                           "[1, 0.96552, 0.88889, 0.67925, 0] ")


def test_tensors_holding_nan_are_refused(tmp_path):
    path = write_peft(tmp_path / "diverged.safetensors", random_spec(TINY_DIT))
    tensors = load_file(str(path))
    key = sorted(tensors)[3]
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(path))
    with pytest.raises(LoRAError, match=rf"'{key}' of diverged\.safetensors holds NaN or infinite values"):
        load_lora(path)


def test_factors_stored_as_fp8_apply_as_their_values_and_a_nan_among_them_is_refused(tmp_path):
    """FP8 LoRAs exist (adapters cut for FP8 checkpoints); torch has no isfinite of FP8, so the file's check
    reads them widened."""
    path = write_peft(tmp_path / "fp8.safetensors", random_spec(TINY_DIT))
    tensors = {key: tensor.to(torch.float8_e4m3fn) for key, tensor in load_file(str(path)).items()}
    save_file(tensors, str(path))
    widened = tmp_path / "widened.safetensors"
    save_file({key: tensor.float() for key, tensor in tensors.items()}, str(widened))
    merged = []
    for adapter in (path, widened):
        model = tiny_random_dit()
        apply_loras(model, [(load_lora(adapter), 0.7)], partition="fl2va", mode="merge")
        merged.append(model.state_dict())
    assert merged[0].keys() == merged[1].keys()
    assert all(torch.equal(merged[0][key], merged[1][key]) for key in merged[0])
    plain = tiny_random_dit().state_dict()
    assert sum(not torch.equal(merged[0][key], plain[key]) for key in plain) > 10  # the adapter was applied
    key = sorted(tensors)[3]
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(path))
    with pytest.raises(LoRAError, match=rf"'{key}' of fp8\.safetensors holds NaN or infinite values"):
        load_lora(path)


@pytest.mark.parametrize("flat_prefix", ["lora_unet_", "lycoris_"])
@pytest.mark.parametrize("spelling", ["native", "diffusers"])
def test_every_linear_flattened_is_read_as_that_linear(tmp_path, flat_prefix, spelling):
    """A flattened key (kohya's lora_unet_, SimpleTuner's lycoris_: every '.' turned '_') names the same module, with
    the same q / k / v part and SwiGLU row order, as the dotted name it flattens, in either spelling: every Linear
    of our tiny DiT and of diffusers' is tried."""
    from reference_checkpoints import reference_dit

    model = tiny_random_dit() if spelling == "native" else reference_dit(TINY_DIT)
    linears = {name: module for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    dotted_prefix = "diffusion_model." if spelling == "native" else "transformer."

    def read(name_of, down, up):
        tensors, random = {}, torch.Generator().manual_seed(0)
        for name, linear in linears.items():
            tensors[f"{name_of(name)}.{down}"] = torch.randn(1, linear.in_features, generator=random)
            tensors[f"{name_of(name)}.{up}"] = torch.randn(linear.out_features, 1, generator=random)
        save_file(tensors, str(tmp_path / "adapter.safetensors"))
        terms = [term for terms in load_lora(tmp_path / "adapter.safetensors").parts.values() for term in terms]
        return {(term.target, term.part): (term.down, term.up) for term in terms}, len(terms)

    flattened, count = read(lambda name: flat_prefix + name.replace(".", "_"), "lora_down.weight", "lora_up.weight")
    dotted, _ = read(lambda name: dotted_prefix + name, "lora_A.weight", "lora_B.weight")
    assert count == len(linears) and flattened.keys() == dotted.keys()
    for module, (down, up) in dotted.items():  # SwiGLU B rows swapped alike
        assert torch.equal(flattened[module][0], down) and torch.equal(flattened[module][1], up), module


def test_a_kohya_file_with_text_encoder_keys_follows_the_unknown_keys_rule(tmp_path):
    modules = fused(random_spec(TINY_DIT, shared_qkv_a=True))
    path = write_kohya(tmp_path / "kohya.safetensors", modules, {name: 4.0 for name in modules})
    tensors = load_file(str(path))
    tensors["lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"] = torch.zeros(4, 8)
    tensors["lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight"] = torch.zeros(8, 4)
    save_file(tensors, str(path))
    with pytest.raises(LoRAError, match=r"2 tensor\(s\) of kohya\.safetensors name no MiniMax-H3 module: "
                                        r"lora_te_text_model_encoder_layers_0_mlp_fc1"):
        load_lora(path)
    loaded = load_lora(path, unknown="warn")
    assert loaded.format.startswith("kohya") and sum(len(terms) for terms in loaded.parts.values()) > 0
    assert any(note.startswith("NOT LOADED") and "lora_te_text_model" in note for note in loaded.notes)
    # a file none of whose keys name an H3 module (an SDXL LoRA) is no H3 LoRA, even with unknown keys allowed
    sdxl = {"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.zeros(4, 8),
            "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": torch.zeros(8, 4),
            "lora_unet_down_blocks_0_attentions_0_proj_in.alpha": torch.tensor(4.0)}
    save_file(sdxl, str(tmp_path / "sdxl_style.safetensors"))
    for unknown in ("warn", "error"):  # under "error" it said to load with unknown='warn', which led here
        with pytest.raises(LoRAError, match=r"None of the 3 tensor\(s\) of sdxl_style.safetensors name a MiniMax-H3 "
                                            r"module: it is not an H3 LoRA"):
            load_lora(tmp_path / "sdxl_style.safetensors", unknown=unknown)


def test_a_native_fc1_under_diffusers_block_names_keeps_its_halves(tmp_path):
    """Only diffusers' `ff.net.0.proj` stores SwiGLU rows [value; gate]; a native `mlp.fc1` spelled under
    diffusers block names (a hybrid some exports use) was half-swapped as if it were one."""
    generator = torch.Generator().manual_seed(3)
    down, up = torch.randn(4, 48, generator=generator), torch.randn(256, 4, generator=generator)
    for name, source in (("native", "blocks.0.mlp.fc1"), ("hybrid", "transformer_blocks.0.mlp.fc1")):
        save_file({f"{source}.lora_A.weight": down, f"{source}.lora_B.weight": up}, str(tmp_path / f"{name}.safetensors"))
    terms = [load_lora(tmp_path / f"{name}.safetensors").parts[None] for name in ("native", "hybrid")]
    assert [(t.target, torch.equal(t.up, up)) for t in terms[0]] == [("blocks.0.mlp.fc1", True)]
    assert [(t.target, torch.equal(t.up, up)) for t in terms[1]] == [("blocks.0.mlp.fc1", True)]


def test_a_pruned_model_refuses_a_time_embedder_delta_saying_why(tmp_path):
    from test_curve_form import curve_model

    curve = curve_model(tiny_random_dit())
    delta = {"time_embedder.linear_1.diff": torch.zeros(TINY_DIT.time_embed_hidden_dim, TINY_DIT.freq_dim)}
    save_file(delta, str(tmp_path / "dense.safetensors"))
    adapter = load_lora(tmp_path / "dense.safetensors")
    with pytest.raises(LoRAError, match=r"this model is a pruned \(curve-form\) checkpoint, which has no time embedder"):
        apply_loras(curve, [adapter], partition="fl2va")
    apply_loras(tiny_random_dit(), [adapter], partition="fl2va")  # the full model takes it


def test_split_workers_load_adapters_with_the_unknown_keys_rule(tmp_path, monkeypatch):
    """`h3 generate --devices ... --lora-unknown-keys warn`: the workers load the adapter the same way (they
    refused its stray keys, naming the option already given)."""
    from h3_core import parallel
    from h3_core.cli import main
    from h3_core.parallel import ModelSpec
    from h3_core.tiny import TINY_RANDOM

    path = write_peft(tmp_path / "stray.safetensors", random_spec(TINY_DIT))
    tensors = load_file(str(path))
    tensors["transformer_blocks.0.attn.to_qq.lora_A.default.weight"] = torch.zeros(4, 64)
    tensors["transformer_blocks.0.attn.to_qq.lora_B.default.weight"] = torch.zeros(64, 4)
    save_file(tensors, str(path))
    spec = ModelSpec(TINY_RANDOM, loras=((str(path), 1.0),), dtype=torch.float32)
    with pytest.raises(LoRAError, match="to_qq"):
        spec.load("cpu")
    model = dataclasses.replace(spec, lora_unknown_keys="warn").load("cpu")
    assert applied_loras(model) == [("merge", ["stray.safetensors@1"])]

    given = []

    class Runner:
        def __init__(self, spec, devices, shard_weights):
            given.append(spec)
            raise Stopped  # the spec is what this test is about

    monkeypatch.setattr(parallel, "ParallelRunner", Runner)
    with pytest.raises(Stopped):
            main(["generate", "--prompt", "A fox.", "--steps", "3", "--devices", "cpu,cpu", "--lora", str(path),
              "--lora-unknown-keys", "warn", "--save-latents", str(tmp_path / "o.safetensors")])
    assert [s.lora_unknown_keys for s in given] == ["warn"]


def test_an_adapter_distilled_for_another_task_on_the_same_dit_is_warned_about(tmp_path, capsys, monkeypatch):
    """FlashGen's T2VA ladder on an FL2VA request runs (same DiT), but not on what it was trained for: said."""
    from h3_core import pipeline
    from h3_core.cli import main
    from h3_core.lora import task_warnings

    flash = load_lora(_with_metadata(tmp_path / "flash.safetensors", {"base_schedule": "1,0.5,0", "tasks": "t2va"}))
    assert task_warnings([flash.contract], "t2va") == []
    assert task_warnings([flash.contract], "fl2va") == ["flash was distilled for t2va, not fl2va: expect weaker results"]

    def stop(*args, **kwargs):
        raise Stopped

    monkeypatch.setattr(pipeline, "load_sampling_dit", stop)
    image = tmp_path / "first.png"
    from PIL import Image

    Image.new("RGB", (64, 64), "red").save(image)
    with pytest.raises(Stopped):
        main(["generate", "--task", "fl2va", "--first-image", str(image), "--prompt", "A fox.", "--lora",
              str(tmp_path / "flash.safetensors"), "--save-latents", str(tmp_path / "o.safetensors")])
    assert "warning: flash was distilled for t2va, not fl2va: expect weaker results" in capsys.readouterr().err


def test_a_model_file_given_as_a_lora_is_refused_from_its_names(tmp_path, monkeypatch):
    """A DiT (~65 GB) picked as a LoRA was read whole before its names were found to be no LoRA's."""
    import contextlib
    from types import SimpleNamespace

    from h3_core import lora_formats, weights

    path = tmp_path / "minimax_h3_fl2va_bf16.safetensors"
    save_file({key: value.contiguous() for key, value in tiny_random_dit().state_dict().items()}, str(path))
    opened = weights.open_safetensors

    @contextlib.contextmanager
    def names_only(file):  # the refusal may read the names, not the tensors
        with opened(file) as handle:
            yield SimpleNamespace(keys=handle.keys, metadata=handle.metadata,
                                  get_tensor=lambda key: pytest.fail(f"{key} was read"))

    monkeypatch.setattr(lora_formats, "open_safetensors", names_only)
    with pytest.raises(LoRAError, match="holds no LoRA factors: none of its .* tensor names ends as a LoRA's do .* Is "
                                        "it a model file"):
        load_lora(path)


def test_lora_factors_stored_as_integers_are_refused(tmp_path):
    """int / bool / uint8 factors were applied as numbers, silently (a damaged or foreign file)."""
    path = write_peft(tmp_path / "ints.safetensors", random_spec(TINY_DIT))
    tensors = load_file(str(path))
    key = next(key for key in tensors if key.endswith("lora_A.default.weight"))
    tensors[key] = tensors[key].to(torch.int32)
    save_file(tensors, str(path))
    with pytest.raises(LoRAError, match=f"'{key}' of ints.safetensors is stored as int32; LoRA factors"):
        load_lora(path)


def test_hooked_factors_follow_the_activations_device_once(tmp_path):
    """h3 generate hooks adapters while the DiT is still in CPU memory, then places it on the GPU: the factors
    stayed in (pageable) CPU memory and were copied to the GPU at every forward of every hooked module."""
    model = tiny_random_dit()
    adapter = load_lora(write_peft(tmp_path / "style.safetensors", random_spec(TINY_DIT)))
    apply_loras(model, [(adapter, 1.0)], partition="fl2va", mode="dynamic")
    module = model.blocks[0].attn.qkv_proj
    (hook,) = [hook for hook in module._forward_hooks.values() if isinstance(hook, lora_module._DeltaHook)]
    x = torch.empty(1, 3, module.in_features, device="meta")
    hook(module, (x,), torch.empty(1, 3, module.out_features, device="meta"))
    factors = [t for term in hook.terms for t in term[3:] if t is not None]
    assert factors and all(t.device.type == "meta" for t in factors)  # kept there for the next forward


def test_a_lycoris_adapter_is_named_as_such(tmp_path):
    """OFT / BOFT and GLoRA (which ComfyUI also applies) were told their keys named no H3 module (LoKr and LoHa
    are read: test_lora_lycoris.py)."""
    for name, keys in (("oft", ["oft_blocks", "alpha"]), ("glora", ["a1.weight", "a2.weight", "b1.weight", "b2.weight"])):
        save_file({f"diffusion_model.blocks.0.attn.qkv_proj.{key}": torch.zeros(2, 2) for key in keys},
                  str(tmp_path / f"{name}.safetensors"))
        with pytest.raises(LoRAError, match=rf"{name}.safetensors is a LyCORIS adapter of another kind than LoRA, "
                                            r"LoKr or LoHa \(OFT, BOFT or GLoRA"):
            load_lora(tmp_path / f"{name}.safetensors")


def test_a_diffusers_lora_with_another_components_keys_follows_the_unknown_keys_rule(tmp_path):
    """A trainer that also trained the text encoder writes its keys beside the transformer's: refused outright,
    where kohya's lora_te_ keys follow the unknown-keys rule (reported and left out under warn)."""
    from lora_files import write_diffusers

    path = write_diffusers(tmp_path / "both.safetensors", {"transformer": random_spec(TINY_DIT)})
    tensors = load_file(str(path))
    tensors["text_encoder.layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 8)
    tensors["text_encoder.layers.0.self_attn.q_proj.lora_B.weight"] = torch.zeros(8, 4)
    save_file(tensors, str(path))
    with pytest.raises(LoRAError, match="2 tensor.s. of both.safetensors carry no component prefix beside ones that "
                                        "do .e.g. 'text_encoder.layers.0.self_attn.q_proj.lora_A.weight'.; .* unknown="):
        load_lora(path)
    lora = load_lora(path, unknown="warn")
    assert lora.parts[None] and any(note.startswith("NOT LOADED: 2 tensor(s)") for note in lora.notes)


@pytest.mark.parametrize("unknown", ["error", "warn"])
def test_a_peft_dora_adapter_is_refused_as_dora(tmp_path, unknown):
    """peft and diffusers save DoRA's magnitudes as lora_magnitude_vector (kohya's dora_scale was known): refused
    as names of no module, and under unknown='warn' loaded as a plain LoRA without them (wrong output)."""
    module = "transformer.blocks.0.attn.qkv_proj"
    save_file({f"{module}.lora_A.weight": torch.zeros(4, 96), f"{module}.lora_B.weight": torch.zeros(288, 4),
               f"{module}.lora_magnitude_vector": torch.ones(288)}, str(tmp_path / "dora.safetensors"))
    with pytest.raises(LoRAError, match="lora_magnitude_vector' is a DoRA magnitude vector; DoRA adapters are not"):
        load_lora(tmp_path / "dora.safetensors", unknown=unknown)


def test_a_lora_warning_is_said_once_by_the_command_and_by_split_workers(tmp_path, capsys, monkeypatch):
    """The command prints the LoRA report (its warnings included) as status lines; the engine's logger does not
    print the same warning again underneath. Split over devices, rank 0's report and attention kernel come back
    to the caller as one device's load says them (each worker had printed the warning itself)."""
    from h3_core.cli import main
    from h3_core.parallel import ModelSpec
    from h3_core.tiny import TINY_RANDOM

    import logging

    monkeypatch.setattr(logging.root, "handlers", [])  # as a command has it: no handler but Python's last resort
    style = write_peft(tmp_path / "style.safetensors", random_spec(TINY_DIT))
    warning = "style.safetensors is applied 2 times: its deltas add up"
    assert main(["generate", "--prompt", "A fox.", "--steps", "2", "--lora", str(style), "--lora", str(style),
                 "--save-latents", str(tmp_path / "o.safetensors")]) == 0
    error = capsys.readouterr().err
    assert error.count(warning) == 1 and f"h3:   warning: {warning}" in error, error
    twice = ((str(style), 1.0), (str(style), 1.0))
    notes = ModelSpec(TINY_RANDOM, loras=twice, dtype=torch.float32, attention="sdpa").load("cpu").load_notes
    assert notes[0] == "LoRA on fl2va (merge):" and f"  warning: {warning}" in notes and notes[-1] == "attention: sdpa"


def _copied_pages_kib(path) -> int:
    """Pages of `path`'s mappings this process has written: each became its own anonymous copy, held until the
    file is unmapped (smaps' Anonymous; not Private_Dirty, which also counts a freshly written file's pages)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if not line[0].isupper():  # a mapping's header: address range, ..., path
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Anonymous:"):
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads the mappings' pages from /proc")
def test_a_merge_into_weights_read_from_a_file_writes_none_of_its_pages(tmp_path):
    """A DiT read from safetensors is the file's pages, mapped copy-on-write: merging a LoRA into them in place
    made each merged page the process's own, kept for as long as the file stayed mapped (the streamed blocks'
    copies went to the GPU or pinned memory, the merged pages stayed: tens of GB at the real size). The merged
    weights are new tensors instead; the same values."""
    from h3_core.checkpoint import DiTReader
    from h3_core.dit import H3DiT
    from h3_core.tiny import seeded_random_weights

    config = dataclasses.replace(TINY_DIT, hidden_size=512, attention_head_dim=64, num_attention_heads=8,
                                 ffn_dim=1024, num_layers=2)
    path = tmp_path / "dit.safetensors"
    save_file(seeded_random_weights(H3DiT(config), 1).state_dict(), str(path))
    lora = load_lora(write_peft(tmp_path / "lora.safetensors", random_spec(config)))
    in_memory = seeded_random_weights(H3DiT(config), 1)
    apply_loras(in_memory, [(lora, 1.0)], partition="fl2va", mode="merge", backup=False)
    model = DiTReader(path, config=config).read("cpu")
    apply_loras(model, [(lora, 1.0)], partition="fl2va", mode="merge", backup=False)
    assert _copied_pages_kib(path) == 0
    merged = dict(in_memory.named_parameters())
    assert all(torch.equal(param, merged[name]) for name, param in model.named_parameters())
    remove_loras(model)  # taken out again from the new tensors
    base = dict(DiTReader(path, config=config).read("cpu").named_parameters())
    assert all(torch.allclose(param, base[name], atol=1e-2) for name, param in model.named_parameters())


def test_a_merge_into_a_streamed_dit_is_refused_and_allowed_once_it_is_unplaced(tmp_path):
    """A streamed block's weights are the streamer's homes: a merge written elsewhere (a file's pages get new
    tensors) never reached the forward, and one written into a pinned home was undone when the DiT was unplaced
    (its weights given back as read), while `applied_loras` still listed it. Refused, with what to do instead."""
    from h3_core.offload import is_streamed, stream_blocks, unplace

    model = tiny_random_dit()
    lora = load_lora(write_peft(tmp_path / "lora.safetensors", random_spec(TINY_DIT)))
    apply_loras(model, [(lora, 1.0)], partition="fl2va", mode="merge", backup=False)
    streamer = stream_blocks(model, "cpu", resident=1)
    assert is_streamed(model)
    with pytest.raises(LoRAError, match="cannot be taken out of a DiT whose blocks are streamed: unplace it first"):
        remove_loras(model)
    with pytest.raises(LoRAError, match="cannot be merged into a DiT whose blocks are streamed"):
        apply_loras(model, [(lora, 1.0)], partition="fl2va", mode="merge")
    apply_loras(model, [(lora, 1.0)], partition="fl2va", mode="dynamic")  # hooks: fine while streamed
    unplace(model, "cpu", streamer)
    assert not is_streamed(model) and remove_loras(model) == 2
    apply_loras(model, [(lora, 1.0)], partition="fl2va", mode="merge")


def test_a_lora_is_applied_only_for_the_partition_its_dit_was_loaded_as(tmp_path):
    """apply_loras(partition=) names which of a file's layers to take: a ref2va-only adapter merged silently into an
    fl2va DiT (19 modules changed) when it was named; now the DiT's own partition must be the one named."""
    from lora_files import write_diffusers

    from h3_core.checkpoint import load_dit

    path = write_diffusers(tmp_path / "ref_only.safetensors", {"transformer_ref": random_spec(TINY_DIT)})
    lora = load_lora(path)
    fl2va = load_dit("tiny-random", partition="fl2va")
    before = {name: tensor.clone() for name, tensor in fl2va.state_dict().items()}
    with pytest.raises(LoRAError, match=r"^This DiT was loaded as the fl2va partition; applying the ref2va layers"):
        apply_loras(fl2va, [(lora, 1.0)], partition="ref2va")
    assert all(torch.equal(tensor, before[name]) for name, tensor in fl2va.state_dict().items())
    ref2va = load_dit("tiny-random", partition="ref2va")
    assert apply_loras(ref2va, [(lora, 1.0)], partition="ref2va").loras[0].modules > 0  # its own: applied


def test_apply_loras_given_a_path_or_one_lora_says_what_to_pass(tmp_path):
    path = write_peft(tmp_path / "style.safetensors", random_spec(TINY_DIT))
    adapter, model = load_lora(path), tiny_random_dit()
    for given, said in ((path, r"got the path '.*style\.safetensors': read it with load_lora\(path\) and pass "
                               r"\[lora\]"),
                        (str(path), r"got the path '.*style\.safetensors'"),
                        (adapter, r"got one LoRA: pass \[lora\] or \[\(lora, strength\)\]"),
                        ([(adapter, 1.0, "merge")], r"got tuple of 3"),
                        ([1.0], r"got float\."),
                        ([(str(path), 1.0)], r"takes LoRA objects from load_lora \(or \(lora, strength\) pairs\), "
                                             r"got str\.")):
        with pytest.raises(LoRAError, match=said):
            apply_loras(model, given, partition="fl2va")
    assert applied_loras(model) == []


def test_a_strength_that_overflows_the_merged_weights_is_refused_leaving_them_as_they_were(tmp_path):
    """Merged at 1e10 into float16 weights (its largest value is 65504), a delta is infinite: every step would
    give NaN, found only when sampling ends. Dynamic adapters are not checked here (theirs is made at each forward)."""
    adapter = load_lora(write_peft(tmp_path / "style.safetensors", random_spec(TINY_DIT)))
    model = tiny_random_dit().to(torch.float16)
    before = _state(model)
    with pytest.raises(LoRAError, match=r"gives infinite or NaN weights in float16: a strength too large "
                                        r"for it, or values in the adapter that are not finite\. Nothing was applied"):
        apply_loras(model, [(adapter, 1e10)], partition="fl2va")
    assert applied_loras(model) == []
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())
    apply_loras(model, [(adapter, 2.0)], partition="fl2va")  # a usual strength still merges
    assert applied_loras(model) != []


def test_a_name_in_lightx2v_form_that_was_never_published_is_read_with_a_note(tmp_path):
    unpublished = load_lora(write_peft(tmp_path / "minimax_h3_fl2v_turbo_6step_v1.0_bf16.safetensors",
                                       random_spec(TINY_DIT)))
    assert (unpublished.contract.steps, unpublished.contract.video_shift) == (7, 12.0)
    assert unpublished.notes == ["minimax_h3_fl2v_turbo_6step_v1.0_bf16.safetensors follows LightX2V's Turbo naming "
                                 "but is not a published artifact; its schedule is read from the name pattern"]


def test_a_q_factor_with_the_wrong_row_count_is_refused_naming_the_rows_of_each_part(tmp_path):
    generator = torch.Generator().manual_seed(3)
    factors = {"transformer_blocks.0.attn.to_q": (torch.randn(4, TINY_DIT.hidden_size, generator=generator),
                                                  torch.randn(32, 4, generator=generator))}  # q has 64 rows
    adapter = load_lora(write_peft(tmp_path / "q.safetensors", Spec(factors)))
    with pytest.raises(LoRAError, match=r"^'transformer_blocks\.0\.attn\.to_q\.lora_B\.default\.weight' of "
                                        r"q\.safetensors has 32 output rows for the q part of "
                                        r"'blocks\.0\.attn\.qkv_proj', whose stacked q/k/v weight has 192 rows "
                                        r"\(64 per part\)\.$"):
        check_loras(TINY_DIT, [(adapter, 1.0)], "fl2va")


def test_a_dynamic_norm_delta_fits_a_block_whose_weights_are_empty_between_forwards(tmp_path):
    """A split DiT's sharded blocks (parallel/sharding.py) point their weights at empty tensors between forwards:
    a dynamic adapter is weighed against the shapes the modules declare, so a dense RMSNorm delta still fits."""
    generator = torch.Generator().manual_seed(5)
    delta = {"transformer_blocks.0.attn.norm_q.diff": 0.1 * torch.randn(TINY_DIT.attention_head_dim, generator=generator)}
    save_file(delta, str(tmp_path / "norm.safetensors"))
    adapter = load_lora(tmp_path / "norm.safetensors")
    model = tiny_random_dit()
    norm = model.get_submodule("blocks.0.attn.q_norm")
    whole = norm.weight.data
    norm.weight.data = torch.empty(0)  # as sharding leaves it
    apply_loras(model, [adapter], partition="fl2va", mode="dynamic")
    norm.weight.data = whole  # as the gather before a forward fills it
    dynamic = torch.cat([out.flatten() for out in _forward(model)])
    remove_loras(model)
    plain = torch.cat([out.flatten() for out in _forward(model)])
    apply_loras(model, [adapter], partition="fl2va")
    merged = torch.cat([out.flatten() for out in _forward(model)])
    assert not torch.equal(dynamic, plain)
    torch.testing.assert_close(dynamic, merged)


def test_a_dense_delta_of_another_shape_is_refused_naming_both_shapes(tmp_path):
    """Checked against the model's shapes before any weight is read."""
    width = TINY_DIT.video_patch_dim
    for name, shape, said in (
            ("wide", (TINY_DIT.hidden_size, width + 1), r"has shape \[64, 97\]; 'video_patch_proj\.weight' is \[64, 96\]\.$"),
            ("tall", (TINY_DIT.hidden_size + 1, width), r"has 65 output rows; 'video_patch_proj\.weight' has 64\.$")):
        save_file({"proj_in.diff": torch.zeros(shape)}, str(tmp_path / f"{name}.safetensors"))
        with pytest.raises(LoRAError, match=rf"^'proj_in\.diff' of {name}\.safetensors {said}"):
            check_loras(TINY_DIT, [(load_lora(tmp_path / f"{name}.safetensors"), 1.0)], "fl2va")
