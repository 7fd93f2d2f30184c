"""cuBLASLt's candidate kernels for the DiT block's four GEMMs, timed under sustained load against torch's
own choice (`F.linear`, i.e. cuBLAS): is there a bf16 kernel that does the same product in less time at the
H200's power cap?

    python bench/gemm_algos.py --rows 38222 --candidates 24 --sustain 3.0

For each GEMM (qkv 5376->21504, out 7168->5376, fc1 5376->28672, fc2 14336->5376) it asks cuBLASLt's
heuristic for up to `--candidates` algorithms, also tries each with every cluster shape the algorithm
accepts, times each briefly, then runs the fastest few and `F.linear` back to back for `--sustain` seconds
each (the clock settles at the power cap within a second) and prints one JSON line per GEMM: ms per call
in the settled part, and the largest difference to `F.linear`'s output. cuBLASLt is reached through ctypes
(the library torch itself loads); nothing here is used by the engine.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time

import torch
import torch.nn.functional as F
from fa3_build_ab import time_call  # bench/ is on the path when this file runs as a script

CUBLAS_COMPUTE_32F = 68
CUDA_R_32F, CUDA_R_16BF = 0, 14
DESC_TRANSA, DESC_TRANSB = 3, 4
OP_N, OP_T = 0, 1
PREF_MAX_WORKSPACE_BYTES = 1
CAP_CTA_SWIZZLING_SUPPORT = 2
CONFIG_ID, CONFIG_TILE_ID, CONFIG_SPLITK_NUM, CONFIG_CTA_SWIZZLING = 0, 1, 2, 4
CONFIG_STAGES_ID, CONFIG_CLUSTER_SHAPE_ID = 6, 8
CLUSTER_SHAPES = {2: "1x1", 3: "2x1", 4: "4x1", 5: "1x2", 6: "2x2"}
WORKSPACE_BYTES = 64 << 20

SHAPES = {"qkv": (5376, 21504), "out": (7168, 5376), "fc1": (5376, 28672), "fc2": (14336, 5376)}


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def load_cublaslt() -> ctypes.CDLL:
    """The libcublasLt torch has loaded (read from this process's memory map after one matmul)."""
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcublasLt.so" in line}
    if not paths:
        raise RuntimeError("libcublasLt is not loaded in this process")
    return ctypes.CDLL(sorted(paths)[0])


def check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with cublasStatus {status}")


class LtGemm:
    """y = x @ w.T for one (rows, in, out) shape: torch's row-major tensors seen column-major as w^T-op x."""

    def __init__(self, lt: ctypes.CDLL, rows: int, in_features: int, out_features: int):
        self.lt = lt
        self.handle = ctypes.c_void_p()
        check(lt.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.desc = ctypes.c_void_p()
        check(lt.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate")
        for attribute, op in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N)):
            value = ctypes.c_int32(op)
            check(lt.cublasLtMatmulDescSetAttribute(self.desc, attribute, ctypes.byref(value), ctypes.c_size_t(4)),
                  "DescSetAttribute")
        self.a, self.b, self.d = (ctypes.c_void_p() for _ in range(3))
        for layout, (r, c, ld) in ((self.a, (in_features, out_features, in_features)),
                                   (self.b, (in_features, rows, in_features)),
                                   (self.d, (out_features, rows, out_features))):
            check(lt.cublasLtMatrixLayoutCreate(ctypes.byref(layout), CUDA_R_16BF, ctypes.c_uint64(r),
                                                ctypes.c_uint64(c), ctypes.c_int64(ld)), "MatrixLayoutCreate")
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def heuristic(self, count: int) -> list[HeuristicResult]:
        preference = ctypes.c_void_p()
        check(self.lt.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)), "PreferenceCreate")
        limit = ctypes.c_uint64(WORKSPACE_BYTES)
        check(self.lt.cublasLtMatmulPreferenceSetAttribute(preference, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit),
                                                              ctypes.c_size_t(8)),
              "PreferenceSetAttribute")
        results = (HeuristicResult * count)()
        returned = ctypes.c_int()
        check(self.lt.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a, self.b, self.d, self.d, preference,
                                                     count, results, ctypes.byref(returned)), "AlgoGetHeuristic")
        return [results[i] for i in range(returned.value) if results[i].state == 0]

    def config(self, algo: Algo) -> dict:
        values = {}
        for name, attribute, kind in (("id", CONFIG_ID, ctypes.c_int32), ("tile", CONFIG_TILE_ID, ctypes.c_uint32),
                                      ("splitk", CONFIG_SPLITK_NUM, ctypes.c_int32),
                                      ("swizzle", CONFIG_CTA_SWIZZLING, ctypes.c_uint32),
                                      ("stages", CONFIG_STAGES_ID, ctypes.c_uint32),
                                      ("cluster", CONFIG_CLUSTER_SHAPE_ID, ctypes.c_uint16)):
            value, written = kind(), ctypes.c_size_t()
            status = self.lt.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attribute, ctypes.byref(value),
                                                                   ctypes.c_size_t(ctypes.sizeof(kind)),
                                                                   ctypes.byref(written))
            values[name] = value.value if status == 0 else None
        return values

    def with_cluster(self, algo: Algo, shape: int) -> Algo | None:
        """A copy of `algo` with another cluster shape, if cuBLASLt accepts it for this problem."""
        variant = Algo()
        ctypes.memmove(ctypes.byref(variant), ctypes.byref(algo), ctypes.sizeof(Algo))
        value = ctypes.c_uint16(shape)
        if self.lt.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(variant), CONFIG_CLUSTER_SHAPE_ID,
                                                        ctypes.byref(value), ctypes.c_size_t(2)) != 0:
            return None
        result = HeuristicResult()
        if self.lt.cublasLtMatmulAlgoCheck(self.handle, self.desc, self.a, self.b, self.d, self.d,
                                           ctypes.byref(variant), ctypes.byref(result)) != 0:
            return None
        return variant if result.workspace_size <= WORKSPACE_BYTES else None

    def run(self, algo: Algo, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        check(self.lt.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(w.data_ptr()),
                                     self.a, ctypes.c_void_p(x.data_ptr()), self.b, ctypes.byref(self.beta),
                                     ctypes.c_void_p(y.data_ptr()), self.d, ctypes.c_void_p(y.data_ptr()), self.d,
                                     ctypes.byref(algo), ctypes.c_void_p(self.workspace.data_ptr()),
                                     ctypes.c_size_t(WORKSPACE_BYTES), stream), "cublasLtMatmul")


def brief_ms(call) -> float:
    """A few calls right after one another, as short timings are usually taken (the clock still high)."""
    return time_call(call, repeats=6)


def sustained_ms(call, seconds: float, settle: float = 1.2) -> float:
    """Mean ms per call after the first `settle` seconds of back-to-back calls (the clock has dropped to
    what the power cap allows by then)."""
    began = time.perf_counter()
    while time.perf_counter() - began < settle:
        for _ in range(10):
            call()
        torch.cuda.synchronize()
    calls = 0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    began = time.perf_counter()
    while time.perf_counter() - began < seconds - settle:
        for _ in range(10):
            call()
        calls += 10
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=38222)
    parser.add_argument("--gemms", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--candidates", type=int, default=24)
    parser.add_argument("--finalists", type=int, default=4)
    parser.add_argument("--sustain", type=float, default=3.0)
    args = parser.parse_args()
    lt = load_cublaslt()
    torch.manual_seed(0)
    for name in args.gemms:
        in_features, out_features = SHAPES[name]
        x = torch.randn(args.rows, in_features, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) * 0.02
        y = torch.empty(args.rows, out_features, device="cuda", dtype=torch.bfloat16)
        expected = F.linear(x, w)
        gemm = LtGemm(lt, args.rows, in_features, out_features)
        candidates = []
        for rank, result in enumerate(gemm.heuristic(args.candidates)):
            candidates.append((f"h{rank}", result.algo))
            for shape in CLUSTER_SHAPES:
                variant = gemm.with_cluster(result.algo, shape)
                if variant is not None and gemm.config(variant)["cluster"] != gemm.config(result.algo)["cluster"]:
                    candidates.append((f"h{rank}c{CLUSTER_SHAPES[shape]}", variant))
        brief = []
        for label, algo in candidates:
            try:
                ms = brief_ms(lambda: gemm.run(algo, x, w, y))  # noqa: B023
            except RuntimeError as error:
                brief.append({"label": label, "error": str(error)})
                continue
            brief.append({"label": label, "ms": round(ms, 3), "max_abs_diff": (y.float() - expected.float()).abs().max().item(),
                          **gemm.config(algo)})
        torch_ms = brief_ms(lambda: F.linear(x, w))
        timed = sorted((b for b in brief if "ms" in b), key=lambda b: b["ms"])[: args.finalists]
        by_label = dict(candidates)
        sustained = {"torch": round(sustained_ms(lambda: F.linear(x, w), args.sustain), 3)}
        for entry in timed:
            algo = by_label[entry["label"]]
            sustained[entry["label"]] = round(sustained_ms(lambda: gemm.run(algo, x, w, y), args.sustain), 3)  # noqa: B023
        sustained["torch_again"] = round(sustained_ms(lambda: F.linear(x, w), args.sustain), 3)
        print(json.dumps({"gemm": name, "rows": args.rows, "in": in_features, "out": out_features,
                          "torch_brief_ms": round(torch_ms, 3), "sustained_ms": sustained, "brief": brief}), flush=True)
        del x, w, y, expected, gemm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
