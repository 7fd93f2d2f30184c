"""The text encoder from ComfyUI's int8 ConvRot and NVFP4 files and from llama.cpp GGUF files, held as the loader
holds them (int8 / NVFP4 / GGML blocks, rebuilt as used) against bf16: seconds per prompt and GPU memory, resident and with its decoder layers
streamed from CPU memory (a small GPU), at the real size (Qwen3-VL-32B cut after layer 50, random weights).
One JSON line per case.

    PYTHONPATH=.:bench python bench/text_encoder_quantized.py --repeat-prompt 1 8

The int8 weights are the bf16 model's own, rotated in groups of `--group` input columns and rounded to int8
with a scale per row, as ComfyUI's files are made; the int8 encoder's prompt states are compared with the
bf16 encoder's (cosine). The NVFP4 and GGUF weights are random codes and scales (timing only, no cosine). The
tokenizer is the embedded tiny one, so token counts are printed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from dit_forward import GGML_SCALE_FIELDS, fill_random_ggml
from full_pipeline import PROMPT, text_encoder
from h3_core.fp8 import FP8Linear, hadamard
from h3_core.gguf_file import GGUFEntry, GGUFLinear
from h3_core.gguf_quants import BLOCKS
from h3_core.nvfp4 import NVFP4Entry, NVFP4Linear, round_up
from h3_core.tiny_text import write_processor, write_tokenizer

GIB = 2**30


def to_int8_convrot(model: torch.nn.Module, group: int) -> int:
    """Every decoder linear replaced by a kept-int8 FP8Linear holding its ConvRot-rotated, int8-rounded weight
    (one scale per row); returns how many."""
    layers = model.language_model.layers
    names = [name for name, module in layers.named_modules() if isinstance(module, torch.nn.Linear)]
    for name in names:
        linear = layers.get_submodule(name)
        out_features, in_features = linear.weight.shape
        rotated = (linear.weight.float().reshape(out_features, -1, group) @ hadamard(group, linear.weight.device)
                   ).reshape(out_features, in_features)
        scale = rotated.abs().amax(dim=1) / 127.0
        int8 = FP8Linear(in_features, out_features, linear.bias is not None, True, linear.weight.dtype,
                         weight_dtype=torch.int8, device=linear.weight.device, rotation=group)
        int8.weight.data = (rotated / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        int8.weight_scale.data = scale
        if linear.bias is not None:
            int8.bias.data = linear.bias.data
        layers.set_submodule(name, int8)
        del rotated, linear
    torch.cuda.empty_cache()
    return len(names)


def to_random_nvfp4(model: torch.nn.Module) -> int:
    """Every decoder linear (bf16 or int8) replaced by an AWQ-smoothed NVFP4Linear with random codes and scales."""
    layers = model.language_model.layers
    names = [name for name, module in layers.named_modules() if isinstance(module, (torch.nn.Linear, FP8Linear))]
    for name in names:
        old = layers.get_submodule(name)
        rows, columns, device = round_up(old.out_features, 16), round_up(old.in_features, 16), old.weight.device
        entry = NVFP4Entry((rows, columns // 2), (round_up(rows, 128), round_up(columns // 16, 4)), (), True)
        new = NVFP4Linear(old.in_features, old.out_features, entry, old.bias is not None, torch.bfloat16, device)
        new.weight.data = torch.randint(0, 256, entry.weight, dtype=torch.uint8, device=device)
        new.weight_scale.data = torch.rand(entry.weight_scale, device=device).add_(0.5).to(torch.float8_e4m3fn)
        new.weight_scale_2.data = torch.tensor(0.002, device=device)
        new.pre_quant_scale.data = torch.ones(old.in_features, dtype=torch.bfloat16, device=device)
        if old.bias is not None:
            new.bias.data = old.bias.data
        layers.set_submodule(name, new)
    torch.cuda.empty_cache()
    return len(names)


def to_random_gguf(model: torch.nn.Module, qtype: str) -> int:
    """Every decoder linear replaced by a GGUFLinear of random `qtype` blocks whose fp16 scales are ~1e-3."""
    layers = model.language_model.layers
    kinds = (torch.nn.Linear, FP8Linear, NVFP4Linear, GGUFLinear)
    names = [name for name, module in layers.named_modules() if isinstance(module, kinds)]
    _, size = BLOCKS[qtype]
    generator = torch.Generator(next(layers.parameters()).device).manual_seed(1)
    for name in names:
        old = layers.get_submodule(name)
        entry = GGUFEntry(qtype, (old.out_features, old.in_features), (old.out_features, old.in_features))
        new = GGUFLinear(old.in_features, old.out_features, entry, old.bias is not None, torch.bfloat16,
                         old.weight.device)
        new.weight.data = torch.empty(entry.raw_shape, dtype=torch.uint8, device=old.weight.device)
        fill_random_ggml(new.weight.data.view(-1, size), qtype, generator)
        if old.bias is not None:
            new.bias.data = old.bias.data
        layers.set_submodule(name, new)
    torch.cuda.empty_cache()
    return len(names)


def timed_encode(encoder, presentation, repeats: int):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, states = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        states = encoder.encode(presentation).prompt_embeds
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], states, torch.cuda.max_memory_allocated() / GIB


def weight_gib(model) -> float:
    return sum(p.numel() * p.element_size() for p in model.parameters()) / GIB


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat-prompt", type=int, nargs="+", default=[1, 8], help="prompt lengths (x the fox prompt)")
    parser.add_argument("--group", type=int, default=256, help="ConvRot group size (input columns)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gguf-types", nargs="*", default=["Q8_0", "Q4_K"], choices=sorted(GGML_SCALE_FIELDS),
                        help="GGML block types to time after the ComfyUI files' cases")
    parser.add_argument("--only-gguf", action="store_true", help="skip the int8 and NVFP4 cases")
    args = parser.parse_args()
    device = torch.device("cuda")
    folder = Path(tempfile.mkdtemp(prefix="h3-bench-tok-"))
    write_tokenizer(folder)
    write_processor(folder, nested=True)
    encoder = text_encoder(folder, device, torch.bfloat16, tiny=False)
    shutil.rmtree(folder, ignore_errors=True)
    presentations = {n: encoder.present("t2va", " ".join([PROMPT] * n)) for n in args.repeat_prompt}
    reference = {}

    def run(case: str, streamed: bool):
        model = encoder.model
        if streamed:
            encoder.to("cpu").stream_layers(device)
        for n, presentation in presentations.items():
            seconds, states, peak = timed_encode(encoder, presentation, args.repeats)
            row = {"case": case, "streamed": streamed, "tokens": presentation.num_tokens, "s_per_prompt": round(seconds, 4),
                   "peak_gib": round(peak, 2), "weights_gib": round(weight_gib(model), 2)}
            if case == "bf16":
                reference[n] = states.float()
            elif case.startswith("int8"):
                row["cosine_vs_bf16"] = round(torch.nn.functional.cosine_similarity(
                    states.float().flatten(), reference[n].flatten(), dim=0).item(), 6)
            print(json.dumps(row), flush=True)
        if streamed:
            encoder.to(device)

    run("bf16", streamed=False)
    run("bf16", streamed=True)
    if not args.only_gguf:
        count = to_int8_convrot(encoder.model, args.group)
        print(json.dumps({"int8_linears": count, "group": args.group}), flush=True)
        run("int8 kept", streamed=False)
        run("int8 kept", streamed=True)
        count = to_random_nvfp4(encoder.model)
        print(json.dumps({"nvfp4_linears": count}), flush=True)
        run("nvfp4 kept (random)", streamed=False)
        run("nvfp4 kept (random)", streamed=True)
    for qtype in args.gguf_types:
        count = to_random_gguf(encoder.model, qtype)
        print(json.dumps({"gguf_linears": count, "type": qtype}), flush=True)
        run(f"gguf {qtype} kept (random)", streamed=False)
        run(f"gguf {qtype} kept (random)", streamed=True)


if __name__ == "__main__":
    main()
