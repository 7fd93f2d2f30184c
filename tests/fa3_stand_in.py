"""A stand-in for FlashAttention 3's `flash_attn_interface` (CI has no GPU): the call signature H3 uses,
including the FP8 descales, sliding windows and the log-sum-exp, computed in float32 on the CPU."""

FA3_STAND_IN = '''
import torch

CALLS = []
QUERY_ROWS = []

def flash_attn_func(q, k, v, causal=False, q_descale=None, k_descale=None, v_descale=None, window_size=(-1, -1),
                    return_attn_probs=False):
    CALLS.append((q.dtype, q_descale is not None))
    QUERY_ROWS.append(q.shape[1])
    dtype = torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype
    if q_descale is not None:  # dequantize as the FP8 kernel's scales do
        q, k, v = (t.float() * d[:, None, :, None] for t, d in ((q, q_descale), (k, k_descale), (v, v_descale)))
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / q.shape[-1] ** 0.5
    if window_size != (-1, -1):  # keys within window_size of the query's position (rows aligned at the start)
        i, j = torch.arange(q.shape[1])[:, None], torch.arange(k.shape[1])[None, :]
        scores = scores.masked_fill((j < i - window_size[0]) | (j > i + window_size[1]), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.float()).to(dtype).contiguous()  # as FA3's
    return (out, scores.logsumexp(-1).contiguous()) if return_attn_probs else out
'''
