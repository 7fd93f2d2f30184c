"""LyCORIS LoKr and LoHa adapters (what musubi-tuner's and LyCORIS's trainers write, and ComfyUI applies): read
in the kohya and diffusers spellings, merged onto the right rows (== an independent merge by the formulas ComfyUI
applies: kron(W1, W2) and (w1_a w1_b) * (w2_a w2_b), times alpha / rank where the file gives an alpha and the
factors are decomposed), dynamic output == merged output, removal restores. With COMFYUI_PATH, ComfyUI's own
weight adapters are the oracle for the same tensors.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from reference_checkpoints import reference_dit
from safetensors.torch import save_file
from test_lora import assert_weights, dit_outputs_close, ours_from, packed, run_ours

from h3_core.checkpoint import convert_state_dict
from h3_core.config import TINY_DIT
from h3_core.lora import FACTORED_CHUNK_ELEMENTS, LoRAError, apply_loras, hooked_bytes, load_lora, remove_loras


def _random(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.1


# module -> (kind, factors, alpha or None): out = a*c and in = b*d (LoKr), [out, r] / [r, in] (LoHa)
DIFFUSERS_SPEC = {
    "transformer_blocks.0.attn.to_q": ("lokr", {"w1": (4, 8), "w2_a": (16, 2), "w2_b": (2, 8)}, 4.0),  # scale 2
    "transformer_blocks.0.ff.net.0.proj": ("lokr", {"w1_a": (8, 2), "w1_b": (2, 4), "w2_a": (32, 3), "w2_b": (3, 16)},
                                           6.0),  # [value; gate] rows in the file; the rank is w2's: scale 2
    "transformer_blocks.1.attn.to_out.0": ("hada", {"w1_a": (64, 4), "w1_b": (4, 64), "w2_a": (64, 4),
                                                    "w2_b": (4, 64)}, 2.0),  # scale 0.5
    "transformer_blocks.1.ff.net.2": ("lokr", {"w1": (8, 8), "w2": (8, 16)}, None),  # whole factors: scale 1
}
NATIVE_SPEC = {
    "blocks.0.attn.qkv_proj": ("lokr", {"w1_a": (12, 2), "w1_b": (2, 8), "w2": (16, 8)}, 8.0),  # stacked q; k; v
    "blocks.1.mlp.fc1": ("hada", {"w1_a": (256, 2), "w1_b": (2, 64), "w2_a": (256, 3), "w2_b": (3, 64)}, None),
    "blocks.1.attn.out_proj": ("lokr", {"w1": (8, 4), "w2_a": (8, 5), "w2_b": (5, 16)}, 10.0),  # scale 2
    "blocks.0.mlp.fc2": ("lokr", {"w1_a": (8, 2), "w1_b": (2, 8), "w2_a": (8, 3), "w2_b": (3, 16)}, 6.0),  # w2's rank
}


def tensors_of(spec, key_of, seed=0):
    """{file key: tensor} and {module: factors} of a spec, every factor random."""
    tensors, factors = {}, {}
    for number, (module, (kind, shapes, alpha)) in enumerate(spec.items()):
        factors[module] = {name: _random(*shape, seed=seed + 10 * number + i) for i, (name, shape) in
                           enumerate(shapes.items())}
        for name, tensor in factors[module].items():
            tensors[f"{key_of(module)}.{kind}_{name}"] = tensor
        if alpha is not None:
            tensors[f"{key_of(module)}.alpha"] = torch.tensor(alpha)
    return tensors, factors


def delta_of(kind, factors, alpha):
    """The formulas, on their own: LoKr kron(W1, W2), LoHa (w1_a w1_b) * (w2_a w2_b), times alpha / rank (rank:
    w2_b's rows if W2 is decomposed, else w1_b's; LoHa w1_b's) where there is an alpha and a rank, else 1."""
    f = {name: tensor.double() for name, tensor in factors.items()}
    if kind == "lokr":
        w1 = f["w1"] if "w1" in f else f["w1_a"] @ f["w1_b"]
        w2 = f["w2"] if "w2" in f else f["w2_a"] @ f["w2_b"]
        rank = f["w2_b"].shape[0] if "w2" not in f else f["w1_b"].shape[0] if "w1" not in f else None
        delta = torch.kron(w1, w2)
    else:
        rank, delta = f["w1_b"].shape[0], (f["w1_a"] @ f["w1_b"]) * (f["w2_a"] @ f["w2_b"])
    return delta * (alpha / rank if alpha is not None and rank else 1.0)


def write(path, tensors):
    save_file(tensors, str(path))
    return path


def kohya_key(module):
    return "lora_unet_" + module.replace(".", "_")


@pytest.mark.parametrize("spelling", ["diffusers", "simpletuner-lycoris", "kohya"])
def test_lokr_and_loha_merge_dynamic_and_remove(tmp_path, spelling):
    """SimpleTuner writes LyCORIS adapters of the diffusers transformer as `lycoris_<its name, '.' -> '_'>`: read as
    the same modules (once refused: no key named an H3 module)."""
    reference = reference_dit(TINY_DIT, seed=1)
    if spelling != "kohya":
        prefixed = spelling == "diffusers"
        tensors, factors = tensors_of(DIFFUSERS_SPEC, lambda module: f"transformer.{module}" if prefixed
                                      else "lycoris_" + module.replace(".", "_"))
        merged = {k: v.clone().double() for k, v in reference.state_dict().items()}
        for module, (kind, _, alpha) in DIFFUSERS_SPEC.items():
            merged[f"{module}.weight"] += 0.7 * delta_of(kind, factors[module], alpha)
        expected = convert_state_dict({k: v.float() for k, v in merged.items()}, "diffusers",
                                      head_dim=TINY_DIT.attention_head_dim)
    else:
        tensors, factors = tensors_of(NATIVE_SPEC, kohya_key)
        expected = {k: v.clone() for k, v in ours_from(reference, TINY_DIT).state_dict().items()}
        for module, (kind, _, alpha) in NATIVE_SPEC.items():
            expected[f"{module}.weight"] = (expected[f"{module}.weight"].double()
                                            + 0.7 * delta_of(kind, factors[module], alpha)).float()
    lora = load_lora(write(tmp_path / "lycoris.safetensors", tensors))
    assert lora.format == spelling
    model = ours_from(reference, TINY_DIT)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = packed(TINY_DIT)
    plain = run_ours(model, inputs)

    apply_loras(model, [(lora, 0.7)], partition="fl2va", mode="merge")
    assert_weights(model, expected, atol=1e-5)
    merged_out = run_ours(model, inputs)
    assert not dit_outputs_close(merged_out, plain, atol=1e-4)  # the adapter really changes the output
    remove_loras(model)
    assert all(torch.equal(v, base[k]) for k, v in model.state_dict().items())

    apply_loras(model, [(lora, 0.7)], partition="fl2va", mode="dynamic")
    assert all(torch.equal(v, base[k]) for k, v in model.state_dict().items())  # dynamic: weights untouched
    assert dit_outputs_close(run_ours(model, inputs), merged_out)
    remove_loras(model)
    assert all(torch.equal(a, b) for a, b in zip(run_ours(model, inputs), plain))

    # what the hooks hold: LoKr's W1 and W2 whole, LoHa's four factors
    spec = NATIVE_SPEC if spelling == "kohya" else DIFFUSERS_SPEC
    held = 0
    for module, (kind, shapes, _) in spec.items():
        f = factors[module]
        if kind == "lokr":
            held += sum((f[w] if w in f else f[f"{w}_a"] @ f[f"{w}_b"]).numel() for w in ("w1", "w2"))
        else:
            held += sum(t.numel() for t in f.values())
    # while a layer runs: a LoHa's rank r1 * r2 pair (both LoHas here are cheaper so) and a slice of its product
    # with x, or a LoKr's slice of x W2^T
    pairs = max(shapes["w1_b"][0] * shapes["w2_b"][0] * (shapes["w1_a"][0] + shapes["w1_b"][1])
                for kind, shapes, _ in spec.values() if kind == "hada")
    assert hooked_bytes([(lora, 0.7)], "fl2va", 2) == 2 * (held + pairs + FACTORED_CHUNK_ELEMENTS)


def test_a_loha_too_wide_for_its_low_rank_form_is_hooked_through_its_dense_delta(tmp_path):
    """A LoHa whose rank r1 * r2 pair would cost more than its layer (r1 * r2 * (out + in) >= out * in) is hooked
    through its dense delta, made at each forward: the merged output, and the memory plan counts that delta and
    the two products it is made from."""
    spec = {"blocks.1.attn.out_proj": ("hada", {"w1_a": (64, 8), "w1_b": (8, 64), "w2_a": (64, 8), "w2_b": (8, 64)},
                                       None)}  # 8 * 8 * (64 + 64) > 64 * 64
    tensors, factors = tensors_of(spec, kohya_key)
    lora = load_lora(write(tmp_path / "wide.safetensors", tensors))
    model = ours_from(reference_dit(TINY_DIT, seed=1), TINY_DIT)
    inputs = packed(TINY_DIT)
    plain = run_ours(model, inputs)
    apply_loras(model, [(lora, 0.7)], partition="fl2va", mode="merge")
    merged_out = run_ours(model, inputs)
    assert not dit_outputs_close(merged_out, plain, atol=1e-4)
    remove_loras(model)
    apply_loras(model, [(lora, 0.7)], partition="fl2va", mode="dynamic")
    assert dit_outputs_close(run_ours(model, inputs), merged_out)
    held = sum(t.numel() for t in factors["blocks.1.attn.out_proj"].values())
    assert hooked_bytes([(lora, 0.7)], "fl2va", 2) == 2 * (held + 3 * 64 * 64)


def test_lokr_on_interleaved_qkv_rows_is_reordered(tmp_path):
    """A DiffSynth-spelled (peft `.default.` over native names) fused qkv holds per-head interleaved rows: a LoKr
    delta there is reordered as a whole (its factors cannot be), merged and hooked alike."""
    head_dim = TINY_DIT.attention_head_dim
    tensors, factors = tensors_of({"blocks.0.attn.qkv_proj": NATIVE_SPEC["blocks.0.attn.qkv_proj"]},
                                  lambda module: f"{module}.default")
    tensors = {key.replace(".default.lokr", ".lokr").replace(".default.alpha", ".alpha"): value
               for key, value in tensors.items()}
    tensors["blocks.0.attn.out_proj.lora_A.default.weight"] = torch.zeros(2, 64)  # the peft infix says DiffSynth
    tensors["blocks.0.attn.out_proj.lora_B.default.weight"] = torch.zeros(64, 2)
    lora = load_lora(write(tmp_path / "diffsynth.safetensors", tensors))
    assert lora.format == "diffsynth"
    reference = reference_dit(TINY_DIT, seed=1)
    model = ours_from(reference, TINY_DIT)
    weight = model.blocks[0].attn.qkv_proj.weight.clone().double()
    delta = delta_of("lokr", factors["blocks.0.attn.qkv_proj"], 8.0)
    heads = delta.shape[0] // (3 * head_dim)
    stacked = delta.view(heads, 3, head_dim, -1).transpose(0, 1).reshape(delta.shape)  # [h: q k v] -> [q; k; v]
    inputs = packed(TINY_DIT)
    apply_loras(model, [lora], partition="fl2va")
    assert (model.blocks[0].attn.qkv_proj.weight.double() - (weight + stacked)).abs().max() < 1e-6
    merged = run_ours(model, inputs)
    remove_loras(model)
    apply_loras(model, [lora], partition="fl2va", mode="dynamic")
    assert dit_outputs_close(run_ours(model, inputs), merged)


@pytest.mark.parametrize("tensors, message", [
    ({"lora_unet_blocks_0_attn_out_proj.lokr_w1": torch.zeros(4, 8)}, "lacks its lokr_w2 or lokr_w2_a\\+lokr_w2_b"),
    ({"lora_unet_blocks_0_attn_out_proj.hada_w1_a": torch.zeros(64, 2),
      "lora_unet_blocks_0_attn_out_proj.hada_w1_b": torch.zeros(2, 64)}, "lacks its hada_w1_a\\+hada_w1_b\\+hada_w2_a"),
    ({"lora_unet_blocks_0_attn_out_proj.lokr_w1": torch.zeros(4, 8),
      "lora_unet_blocks_0_attn_out_proj.lokr_w2_a": torch.zeros(16, 2),
      "lora_unet_blocks_0_attn_out_proj.lokr_w2_b": torch.zeros(3, 8)}, "lokr factors of .* do not fit together"),
    ({"lora_unet_blocks_0_attn_out_proj.hada_w1_a": torch.zeros(64, 2),  # each pair whole, the products unequal
      "lora_unet_blocks_0_attn_out_proj.hada_w1_b": torch.zeros(2, 64),
      "lora_unet_blocks_0_attn_out_proj.hada_w2_a": torch.zeros(32, 2),
      "lora_unet_blocks_0_attn_out_proj.hada_w2_b": torch.zeros(2, 64)}, "loha factors of .* do not fit together"),
    ({"lora_unet_blocks_0_attn_out_proj.lokr_w1": torch.zeros(4, 8),
      "lora_unet_blocks_0_attn_out_proj.lokr_w2": torch.zeros(16, 4)}, "has input width 32; 'blocks.0.attn.out_proj' "
                                                                        "takes 64"),
    ({"lora_unet_blocks_0_attn_out_proj.lokr_w1": torch.zeros(4, 4),
      "lora_unet_blocks_0_attn_out_proj.lokr_w2": torch.zeros(8, 16)}, "has 32 output rows; 'blocks.0.attn.out_proj"),
    ({"lora_unet_blocks_0_attn_out_proj.lokr_w1": torch.zeros(4, 8),
      "lora_unet_blocks_0_attn_out_proj.lokr_w2": torch.zeros(16, 8),
      "lora_unet_blocks_0_attn_out_proj.lokr_t2": torch.zeros(2, 2, 1, 1)}, "Tucker core, made for convolutions"),
    ({"lora_unet_blocks_0_norm1.lokr_w1": torch.zeros(1, 8), "lora_unet_blocks_0_norm1.lokr_w2": torch.zeros(1, 8)},
     "an RMSNorm; they target Linear layers"),
    ({"lora_unet_blocks_0_attn_out_proj.lokr_w1": torch.zeros(4, 8),
      "lora_unet_blocks_0_attn_out_proj.hada_w2_a": torch.zeros(16, 8)}, "mixes LoKr \\(lokr_\\) and LoHa"),
])
def test_broken_lycoris_modules_are_refused_by_name(tmp_path, tensors, message):
    with pytest.raises(LoRAError, match=message):
        lora = load_lora(write(tmp_path / "broken.safetensors", tensors))
        apply_loras(ours_from(reference_dit(TINY_DIT, seed=1), TINY_DIT), [lora], partition="fl2va")


COMFYUI = os.environ.get("COMFYUI_PATH")
# run apart, with --cpu, so that ComfyUI's own modules load untouched by the other tests' stand-ins
COMFY_MERGE = r"""
import sys
comfyui, lora, weights, out, strength, *keys = sys.argv[1:]
sys.path.insert(0, comfyui)
import comfy.options
comfy.options.enable_args_parsing()
sys.argv = ["main.py", "--cpu"]
from safetensors.torch import load_file, save_file
from comfy.weight_adapter.loha import LoHaAdapter
from comfy.weight_adapter.lokr import LoKrAdapter
tensors, weights, merged = load_file(lora), load_file(weights), {}
for key in keys:
    adapter = LoKrAdapter if any(k.startswith(key + ".lokr_") for k in tensors) else LoHaAdapter
    alpha = tensors[key + ".alpha"].item() if key + ".alpha" in tensors else None
    merged[key] = adapter.load(key, tensors, alpha, None).calculate_weight(
        weights[key].clone(), key, float(strength), 1.0, None, lambda a: a)
save_file(merged, out)
"""


@pytest.mark.skipif(not COMFYUI, reason="set COMFYUI_PATH to a ComfyUI checkout to check against its LoKr / LoHa "
                                        "weight adapters")
def test_comfyui_weight_adapters_merge_what_we_merge(tmp_path):
    """ComfyUI's own LoKr / LoHa adapters (comfy.weight_adapter), given the same tensors, change each weight as
    our merge does."""
    from safetensors.torch import load_file

    tensors, _ = tensors_of(NATIVE_SPEC, kohya_key)
    path = write(tmp_path / "lycoris.safetensors", tensors)
    model = ours_from(reference_dit(TINY_DIT, seed=1), TINY_DIT)
    keys = {kohya_key(module): module for module in NATIVE_SPEC}
    save_file({key: model.get_submodule(module).weight.clone() for key, module in keys.items()},
              str(tmp_path / "weights.safetensors"))
    script = tmp_path / "comfy_merge.py"
    script.write_text(COMFY_MERGE)
    subprocess.run([sys.executable, str(script), COMFYUI, str(path), str(tmp_path / "weights.safetensors"),
                    str(tmp_path / "theirs.safetensors"), "0.7", *keys], check=True, cwd=COMFYUI)
    theirs = load_file(str(tmp_path / "theirs.safetensors"))
    apply_loras(model, [(load_lora(path), 0.7)], partition="fl2va")
    for key, module in keys.items():
        assert (model.get_submodule(module).weight - theirs[key]).abs().max() < 1e-6, module
