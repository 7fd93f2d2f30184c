"""One real-config block's activation peak for each way its linears are held, at packed row counts from a
256x256 clip to 1344x768 x 124 frames: the ground truth for memory_plan.activation_bytes. Each JSON line gives
the peak allocated above the block's input ("measured") and that plus the input, cos/sin and row index, which
is what activation_bytes counts. Random codes and scales: memory does not depend on the values. CUDA only.

    PYTHONPATH=.:bench python bench/held_block_peak.py
"""
import copy
import json
from dataclasses import replace

import torch

from dit_forward import build_ours, make_layout, stored_blocks
from h3_core import fp8
from h3_core.config import DiTConfig
from h3_core.dit import rope_tables
from h3_core.memory_plan import activation_bytes

config = replace(DiTConfig(), num_layers=1)
dense = build_ours(config).cuda()
SIZES = [(256, 256, 22), (512, 512, 39), (768, 768, 56), (768, 768, 124), (1344, 768, 124)]
layouts = [make_layout(f, 512, w, h) for w, h, f in SIZES]


def int8_blocks(model):
    for layer in fp8.block_linear_names(model):
        linear = model.get_submodule(layer)
        module = fp8.FP8Linear(linear.in_features, linear.out_features, weight_dtype=torch.int8, device="cuda",
                               rotation=256)
        module.weight.copy_(torch.randint(-127, 128, module.weight.shape, device="cuda", dtype=torch.int8))
        module.weight_scale.fill_(0.001)
        model.set_submodule(layer, module)
    return model


FORMATS = {
    "dense": lambda m: m,
    "fp8-scaled": lambda m: (fp8.quantize_blocks(m, "scaled"), m)[1],
    "fp8": lambda m: (fp8.quantize_blocks(m, "dequantize"), m)[1],
    "int8-convrot": int8_blocks,
    "int4": lambda m: stored_blocks(m, "int4"),
    "nvfp4": lambda m: stored_blocks(m, "nvfp4"),
    "gguf-Q4_K": lambda m: stored_blocks(m, "gguf-Q4_K"),
    "gguf-Q8_0": lambda m: stored_blocks(m, "gguf-Q8_0"),
    "gguf-IQ4_XS": lambda m: stored_blocks(m, "gguf-IQ4_XS"),
}
for name, make in FORMATS.items():
    model = make(dense if name == "dense" else copy.deepcopy(dense))
    block = model.blocks[0]
    held = fp8.held_format(model)
    for layout in layouts:
        rows = layout.sequence_length
        k = 3
        x = torch.randn(1, rows, config.hidden_size, device="cuda", dtype=torch.bfloat16)
        table = torch.randn(3 * k, 6 * config.hidden_size, device="cuda", dtype=torch.bfloat16) * 0.05
        index = torch.zeros(rows, dtype=torch.long, device="cuda")
        rope = rope_tables(layout.position_ids.cuda(), model.rope_inv_freq)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            out = block(x, table, index, rope)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        rope_bytes = sum(t.numel() * t.element_size() for t in (rope if isinstance(rope, (tuple, list)) else [rope]))
        counted = peak + x.numel() * x.element_size() + rope_bytes + index.numel() * index.element_size()
        print(json.dumps({"format": name, "held": held, "rows": rows, "measured": peak,
                          "measured_plus_input_rope_index": counted,
                          "planned": activation_bytes(config, rows, 2, held)}), flush=True)
        del x, out, rope
    if name != "dense":
        del model
    torch.cuda.empty_cache()
