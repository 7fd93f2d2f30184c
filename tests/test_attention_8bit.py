"""The int8-QK / FP8-PV Triton attention (h3_core/attention_8bit.py) run by Triton's CPU interpreter:
its quantizers bit for bit against torch, and its output against exact attention and against a torch
emulation of the same quantization. Skipped where Triton is not installed (it is on the GPU machine).

The interpreter runs in a subprocess (TRITON_INTERPRET must be set before Triton compiles anything),
with two fixes: its float -> e4m3 cast truncates and can carry into the wrong binade, so casts to and
from e4m3 go through torch's (round-to-nearest-even, like the GPU's); and its scalars are 1-element
arrays, which newer numpy refuses to turn into loop bounds."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import math
    import numpy as np, torch, torch.nn.functional as F
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    original = interpreter._convert_float

    def convert(data, src, dst, rounding):
        if dst == tl.float8e4nv and src in (tl.float32, tl.float16):
            values = np.frombuffer(data.tobytes(), dtype=np.float32 if src == tl.float32 else np.float16).copy()
            return torch.from_numpy(values).to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(data.shape)
        if src == tl.float8e4nv and dst == tl.float16:
            raw = torch.from_numpy(np.frombuffer(data.tobytes(), dtype=np.uint8).copy()).view(torch.float8_e4m3fn)
            return raw.to(torch.float16).view(torch.int16).numpy().view(np.uint16).reshape(data.shape)
        return original(data, src, dst, rounding)

    interpreter._convert_float = convert
    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_index(tensor, scope):  # scalars are 1-element arrays there, which numpy >= 2.4 won't int()
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_tensor_index
    from h3_core.attention_8bit import int8qk_fp8pv_attention, quantize_qkv

    def emulate(q, k, v):
        scale = 1.4426950408889634 / math.sqrt(q.shape[-1])
        rows = lambda x, s: (torch.round(x / s).clamp(-127, 127), s)
        qf, kf = q.float() * scale, k.float() - k.float().mean(1, keepdim=True)
        qi, qs = rows(qf, (qf.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-12))
        ki, ks = rows(kf, (kf.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-12))
        vs = (v.float().abs().amax(1, keepdim=True) / 448).clamp(min=1e-12)
        vq = (v.float() / vs).to(torch.float8_e4m3fn)
        p = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", qi * qs, ki * ks) * math.log(2), -1)
        return torch.einsum("bhqk,bkhd->bqhd", p, vq.float() * vs), (qi, qs, ki, ks, vq, vs)

    torch.manual_seed(0)
    cos = lambda a, b: F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()
    for batch, rows, heads, dim, spread in [(1, 200, 2, 64, 1.0), (2, 130, 3, 64, 2.0), (1, 192, 1, 128, 1.0)]:
        q, k, v = (torch.randn(batch, rows, heads, dim) * spread).bfloat16(), (torch.randn(batch, rows, heads, dim) + 0.5).bfloat16(), torch.randn(batch, rows, heads, dim).bfloat16()
        out = int8qk_fp8pv_attention(q, k, v, block_m=64, block_n=64, num_warps=4).float()
        exact = F.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v))).transpose(1, 2)
        emulated, (qi, qs, ki, ks, vq, vs) = emulate(q, k, v)
        q8, q_scale, k8, k_scale, v8, v_scale = quantize_qkv(q, k, v)
        for got, want in ((q8, qi), (k8, ki)):  # off by one only where x / scale sits on a rounding edge
            off = (got.float() - want).abs()
            assert off.max() <= 1 and (off > 0).float().mean() < 1e-3
        assert torch.allclose(q_scale, qs[..., 0], rtol=1e-6, atol=0) and torch.allclose(k_scale, ks[..., 0], rtol=1e-6, atol=0)
        assert torch.equal(v8.view(torch.uint8), vq.permute(0, 2, 3, 1).contiguous().view(torch.uint8))
        # what is left between kernel and emulation: P in e4m3 and the online (blockwise) softmax
        assert cos(out, emulated) > 0.9995, cos(out, emulated)
        assert cos(out, exact) > 0.999, cos(out, exact)
    print("ok")
""")


def test_kernel_in_the_triton_interpreter():
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
