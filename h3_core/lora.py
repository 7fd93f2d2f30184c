"""LoRA and Turbo adapters on the native DiT: load, apply (merged or dynamic), remove, sampler defaults.

    lora = load_lora("minimax_h3_fl2v_turbo_8step_v1.0_bf16.safetensors")     # any layout (lora_formats)
    report = apply_loras(dit, [(lora, 1.0), (style, 0.7)], partition="fl2va")  # mode="merge" | "dynamic"
    settings = report.sampler_settings()       # the Turbo contract's steps / shifts / ladders, or 50/12/3
    schedule = settings.schedule()             # a DualClockSchedule
    remove_loras(dit)                          # back to the base weights

Data contract. For each low-rank term on a parameter W [out, in] of our model:
`W[rows] += strength * alpha / rank * B @ A`, A [rank, in], B [rows, rank], where `rows` is all of W,
or one of the q/k/v thirds of the stacked `attn.qkv_proj`. Dense terms add `strength * delta`; LoKr / LoHa
terms their delta (lora_formats), made for one layer at a time (a dynamic LoKr never makes it: x's width is
seen as [b, d] and multiplied by W1 and W2).

- "merge" (default): all deltas of one parameter are summed in fp32 and added to W in fp32, then cast
  back to W's dtype once (one rounding, whatever the number of adapters). `backup=True` keeps a CPU
  copy of each touched parameter, so `remove_loras` restores the base bitwise; `backup=False` keeps
  nothing and removes by subtracting the same fp32 delta (exact up to fp32 rounding; in bf16 within one
  bf16 step of max(|W|, |W + delta|) per apply/remove cycle, since it rounds twice).
- "dynamic": weights stay untouched; a forward hook on each target module adds
  `strength * scale * (x A^T) B^T` (or the dense delta's contribution) to its output, computed in the
  module's weight dtype. Module names, `.weight` and state_dict are unchanged, so checkpoint tools,
  offloading and torch.compile keep working; removal drops the hooks. Merged and dynamic outputs are
  equal up to float rounding.

Applications stack: each `apply_loras` call is undone by `remove_loras` in reverse order. Tables
precomputed from the AdaLN weights (`H3DiT.modulation`) must be recomputed after applying or removing.
The partition is a required argument: an adapter whose release or file names the other partition's
task is refused, because it loads without error there and silently degrades the output.

Turbo contracts (`TurboContract`, h3-model.md H.3/H.4): the steps, video / audio shifts or explicit
base ladder a distilled release was trained for, from its metadata (`base_schedule`, `tasks`), its
published file name, or (FastH3) its published folder name. They are offered as defaults
(`sampler_settings`); a user value wins and is reported; a file nothing identifies is applied as a
plain LoRA and the report says no schedule was found.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .fp8 import StoredLinear, compute_dtype
from .keymap import deinterleave_qkv, swap_halves
from .lora_formats import (
    FACTORED_KINDS,
    LIGHTX2V_NAME,
    PARTITIONS,
    TASKS,
    TASKS_OF_PARTITION,
    LoRAError,
    ParsedLoRA,
    Term,
    adapter_stem,
    parse_lora,
    read_safetensors,
)
from .runtime import file_mapped_ranges, in_mapped_file
from .sampler import AUDIO_SHIFT, MAX_STEPS, VIDEO_SHIFT, DualClockSchedule, shift_time

__all__ = [
    "LoRA", "LoRAError", "LoRAReport", "SamplerSettings", "TurboContract",
    "applied_contracts", "applied_loras", "apply_loras", "hooked_bytes", "load_lora", "remove_loras",
    "sampler_settings", "task_warnings",
]

logger = logging.getLogger(__name__)
LINEARS = (nn.Linear, StoredLinear)  # what a LoRA term may target besides RMSNorm (FP8, int8, int4, NVFP4 too)
DEFAULT_STEPS = 50
_STATE = "_h3_lora_stack"  # attribute on the model: the applications, newest last


# ---------------------------------------------------------------------------------------------------
# Turbo / distilled-release contracts (h3-model.md H.3, H.4, D).
LIGHTX2V_PUBLISHED = {  # (task, forwards, version, 768p) of h3-model.md H.3
    ("fl2v", 4, "0.1", False), ("fl2v", 4, "1.0", True), ("fl2v", 4, "1.1", True), ("fl2v", 4, "1.2", True),
    ("fl2v", 8, "1.0", False), ("fl2v", 8, "1.0", True), ("ref2v", 4, "0.1", False), ("ref2v", 8, "1.0", True),
}
FLASHGEN_FILE = "minimax_h3_t2va_flashgen_4step_v1.0_768p_bf16"
FLASHGEN_BASE_SCHEDULE = (1.0, 0.7, 0.4, 0.15, 0.0)
LARRYVRH_FILE = "minimax_h3_turbo_v4_step600_ema"
FASTH3_4STEP_PATH = "fasth3-4-step"  # FastVideo/FastVideo-FastH3-4-step-Preview-v1-LoRA/<variant>/adapter_model.safetensors


@dataclass(frozen=True)
class TurboContract:
    """The sampler settings a distilled adapter was trained for.

    `steps` counts sigma points including the final 0 (as `DualClockSchedule.build` does), so the
    model runs `steps - 1` forwards. `base_sigmas`, when set, is an unshifted ladder from the release
    (FlashGen's `base_schedule`) that each modality's shift is applied on top of.
    """

    artifact: str
    identified_by: str  # "file name", "metadata", "folder name"
    steps: int
    video_shift: float = VIDEO_SHIFT
    audio_shift: float = AUDIO_SHIFT
    base_sigmas: tuple[float, ...] | None = None
    tasks: tuple[str, ...] = ()  # empty: the release does not say

    def __post_init__(self):
        if not 2 <= self.steps <= MAX_STEPS:
            raise LoRAError(f"{self.artifact} names a schedule of {self.steps - 1} model calls (from its "
                            f"{self.identified_by}); a schedule makes 1 to {MAX_STEPS - 1}.")

    @property
    def forwards(self) -> int:
        return self.steps - 1

    @property
    def partition(self) -> str | None:
        """The DiT partition the tasks run on, or None when the release names no task."""
        for partition, tasks in TASKS_OF_PARTITION.items():
            if self.tasks and set(self.tasks) <= set(tasks):
                return partition
        return None

    def sigmas(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """(video, audio) explicit ladders from `base_sigmas` with the shifts applied; None without a base."""
        if self.base_sigmas is None:
            return None
        return shifted(self.base_sigmas, self.video_shift), shifted(self.base_sigmas, self.audio_shift)

    def describe(self) -> str:
        ladder = f", base ladder {list(self.base_sigmas)}" if self.base_sigmas else ""
        tasks = f", tasks {'/'.join(self.tasks)}" if self.tasks else ""
        return (f"{self.artifact}: {self.forwards} forwards ({self.steps} sigma points), video shift "
                f"{self.video_shift:g}, audio shift {self.audio_shift:g}{ladder}{tasks} (from its {self.identified_by})")


def shifted(base: tuple[float, ...], shift: float) -> tuple[float, ...]:
    """`shift_time` of each base position u, in Python floats (the ladder is handed on as custom sigmas)."""
    return tuple(shift_time(float(u), shift) for u in base)


# ---------------------------------------------------------------------------------------------------
def identify_contract(path: Path, metadata: dict[str, str]) -> tuple[TurboContract | None, list[str]]:
    """The published release a file is, from its metadata, name or folder; (contract or None, notes)."""
    notes = []
    name = adapter_stem(path)
    named, named_notes = _contract_of_name(path, name)
    base = metadata.get("base_schedule")
    if base is None:
        return named, named_notes
    ladder = _parse_ladder(base)
    tasks = tuple(t.strip().lower() for t in metadata.get("tasks", "").split(",") if t.strip())
    unknown = [task for task in tasks if task not in TASKS]
    if unknown:
        raise LoRAError(f"{path.name}'s metadata names task(s) {', '.join(map(repr, unknown))} in 'tasks'; "
                        f"H3's tasks are {', '.join(TASKS)}.")
    if named is not None:
        if not tasks:
            tasks = named.tasks  # the name still says which DiT it was made for
        elif named.tasks and not set(tasks) & set(named.tasks):
            notes.append(f"its metadata names tasks {'/'.join(tasks)}, its file name {'/'.join(named.tasks)}: the "
                         "metadata's are used")
        if named.steps != len(ladder):
            notes.append(f"its file name says {named.forwards} model calls, its metadata's base_schedule "
                         f"{len(ladder) - 1}: the metadata's ladder is used")
    return TurboContract(name or "adapter", "metadata", len(ladder), base_sigmas=ladder, tasks=tasks), notes


def _contract_of_name(path: Path, name: str) -> tuple[TurboContract | None, list[str]]:
    """The published release a file's name (or folder) says it is; (contract or None, notes)."""
    notes = []
    match = LIGHTX2V_NAME.fullmatch(name)
    if match:
        forwards, version, tags = int(match.group("steps")), match.group("version"), match.group("tags")
        hi_res = "_768p" in tags
        if (match.group("task"), forwards, version, hi_res) not in LIGHTX2V_PUBLISHED:
            notes.append(f"{path.name} follows LightX2V's Turbo naming but is not a published artifact; its schedule "
                         "is read from the name pattern")
        tasks = TASKS_OF_PARTITION["fl2va" if match.group("task") == "fl2v" else "ref2va"]
        return TurboContract(name, "file name", forwards + 1, video_shift=6.0 if hi_res else VIDEO_SHIFT, tasks=tasks), notes
    if name == FLASHGEN_FILE:
        return TurboContract(name, "file name", len(FLASHGEN_BASE_SCHEDULE), base_sigmas=FLASHGEN_BASE_SCHEDULE,
                             tasks=("t2va",)), notes
    if name == LARRYVRH_FILE:
        return TurboContract(name, "file name", 9), notes
    if any(FASTH3_4STEP_PATH in part.lower() for part in path.parts):  # the HF cache: models--...--<repo>/snapshots/
        return TurboContract("FastVideo FastH3 4-step preview", "folder name", 5, tasks=("t2va",)), notes
    return None, notes


def _parse_ladder(raw: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in str(raw).replace("[", "").replace("]", "").split(",") if v.strip())
    except ValueError:
        raise LoRAError(f"The file's base_schedule {raw!r} is not a comma-separated list of numbers.") from None
    if (len(values) < 2 or not all(map(math.isfinite, values)) or values[-1] != 0.0 or values[0] > 1.0
            or any(a <= b for a, b in pairwise(values))):
        raise LoRAError(f"The file's base_schedule {list(values)} must be strictly decreasing from at most 1.0 to 0.0.")
    return values


@dataclass
class LoRA:
    """A loaded adapter: its terms in our module names (`parts`, see `lora_formats.ParsedLoRA`)."""

    name: str
    path: Path | None
    format: str
    parts: dict[str | None, list[Term]]
    metadata: dict[str, str]
    contract: TurboContract | None
    notes: list[str]
    alpha_summary: str

    @property
    def partition(self) -> str | None:
        """The partition the file or its release names, or None when it names none."""
        named = {p for p in self.parts if p is not None}
        if self.contract is not None and self.contract.partition is not None:
            named.add(self.contract.partition)
        return named.pop() if len(named) == 1 else None

    def terms_for(self, partition: str) -> list[Term]:
        """The terms to apply on `partition`'s DiT; refuses an adapter made for the other partition."""
        if partition not in PARTITIONS:
            raise LoRAError(f"partition must be one of {', '.join(PARTITIONS)}, got {partition!r}.")
        contract = self.contract
        if contract is not None and contract.tasks and not set(contract.tasks) & set(TASKS_OF_PARTITION[partition]):
            raise LoRAError(
                f"{self.name} was distilled for {'/'.join(contract.tasks)} (from its {contract.identified_by}), which runs on "
                f"the {contract.partition or 'other'} DiT, not on {partition}. Load it on a {contract.partition} model, "
                f"or use the {partition} release of this adapter."
            )
        if None in self.parts:
            return self.parts[None]
        if partition not in self.parts:
            other = ", ".join(p for p in self.parts if p)
            raise LoRAError(f"{self.name} holds layers only for the {other} partition (its diffusers component prefix), "
                            f"not for {partition}.")
        return self.parts[partition]

    def describe(self) -> str:
        count = sum(len(terms) for terms in self.parts.values())
        return f"{self.name} ({self.format}, {count} terms; alpha: {self.alpha_summary or 'n/a'})"


def load_lora(
    path: str | Path,
    alpha: float | None = None,
    qkv_layout: str | None = None,
    unknown: str = "error",
) -> LoRA:
    """Read a LoRA safetensors file of any known layout (see `lora_formats`).

    `alpha` overrides every module's alpha (reported); `qkv_layout` ("stacked" / "interleaved")
    overrides the fused-qkv B row order the format implies; `unknown="warn"` loads a file whose
    extra keys name no H3 module and reports them instead of refusing it.
    """
    path = Path(path).expanduser()
    tensors, metadata = read_safetensors(path)
    parsed: ParsedLoRA = parse_lora(tensors, metadata, path, alpha=alpha, qkv_layout=qkv_layout, unknown=unknown)
    contract, notes = identify_contract(path, metadata)
    lora = LoRA(path.name, path, parsed.format, parsed.parts, parsed.metadata, contract, notes + parsed.notes,
                parsed.alpha_summary)
    for note in parsed.notes:
        if note.startswith("NOT LOADED"):
            logger.warning("%s: %s", path.name, note)
    return lora


# ---------------------------------------------------------------------------------------------------
@dataclass
class _Resolved:
    """One term checked against the model: where it goes and how strong it is."""

    module: nn.Module
    target: str
    param: str
    rows: slice
    scale: float  # strength * alpha / rank (strength for a dense delta)
    down: torch.Tensor | None  # A [rank, in]
    up: torch.Tensor | None  # B [rows, rank] in stacked order
    delta: torch.Tensor | None
    factored: Term | None = None  # a LoKr / LoHa term, its delta made when needed (never for the whole model)
    order: torch.Tensor | None = None  # with `factored`: its delta's rows, in our order (None: as they are)

    def dense(self, device: torch.device) -> torch.Tensor:
        """This term's fp32 delta for its rows, strength included, computed on `device`."""
        if self.factored is not None:
            delta = self.factored.factored_delta(device)
            return (delta if self.order is None else delta[self.order.to(device)]) * self.scale
        if self.delta is not None:
            return self.delta.to(device, torch.float32) * self.scale
        return (self.up.to(device, torch.float32) @ self.down.to(device, torch.float32)) * self.scale


def _declared_shape(module: nn.Module, name: str, param: torch.Tensor) -> tuple[int, ...]:
    """The parameter's shape as its module declares it: sharded block weights (parallel/sharding.py) are
    empty between forwards, yet a dynamic adapter still fits them."""
    if isinstance(module, LINEARS):
        return (module.out_features, module.in_features) if name == "weight" else (module.out_features,)
    if isinstance(module, nn.RMSNorm):
        return tuple(module.normalized_shape)
    return tuple(param.shape)


def _resolve(model: nn.Module, lora: LoRA, term: Term, strength: float, weights: bool = True) -> _Resolved:
    """`term` checked against `model`; `weights=False` checks shapes only (a meta-built model will do)."""
    what = f"'{term.keys[0]}' of {lora.name}"
    try:
        module = model.get_submodule(term.target)
    except AttributeError:
        if getattr(getattr(model, "config", None), "curve_form", False) and term.target.startswith("time_embedder."):
            raise LoRAError(f"{what} targets '{term.target}', but this model is a pruned (curve-form) checkpoint, "
                            "which has no time embedder (a sampled curve of the AdaLN input replaces it): use the "
                            "adapter with the full checkpoint.") from None
        raise LoRAError(f"{what} targets '{term.target}', which this model does not have (it has "
                        f"{len(getattr(model, 'blocks', []))} blocks); the LoRA was made for a different model size.") from None
    if not isinstance(module, (*LINEARS, nn.RMSNorm)):
        raise LoRAError(f"{what} targets '{term.target}', a {type(module).__name__}; only Linear and RMSNorm modules are supported.")
    param = getattr(module, term.param, None)
    if param is None:
        raise LoRAError(f"{what} is a {term.param} delta, but '{term.target}' has no {term.param}.")
    if weights and param.device.type == "meta":
        raise LoRAError(f"'{term.target}' is on the meta device; load the model's weights before applying LoRAs.")
    head_dim = getattr(getattr(model, "config", None), "attention_head_dim", None)
    shape = _declared_shape(module, term.param, param)
    rows_total = shape[0]
    up, down, delta = term.up, term.down, term.delta
    factored = term.kind in FACTORED_KINDS
    out_rows, in_width = term.factored_shape if factored else ((up if up is not None else delta).shape[0], None)
    order = swap_halves(torch.arange(out_rows)) if factored and term.swap_halves else None
    if term.qkv_rows == "interleaved":
        if head_dim is None or rows_total % (3 * head_dim):
            raise LoRAError(f"{what} has per-head interleaved qkv rows, but the model's attention_head_dim is unknown "
                            f"or does not divide {rows_total} rows into q/k/v heads.")
        if up is not None:
            up = deinterleave_qkv(up, head_dim)
        if delta is not None:
            delta = deinterleave_qkv(delta, head_dim)
        if factored:  # a row order, not the factors: kron(W1, W2)'s rows cannot be reordered through W1 and W2
            order = deinterleave_qkv(torch.arange(out_rows) if order is None else order, head_dim)
    counted = f"'{term.keys[1 if up is not None else 0]}' of {lora.name}"  # a low-rank pair's rows are in B
    if factored:
        counted = f"the {term.kind} of '{term.keys[0].rsplit('.', 1)[0]}' in {lora.name}"
    if term.part is not None:
        if 3 * out_rows != rows_total:
            raise LoRAError(f"{counted} has {out_rows} output rows for the {term.part} part of '{term.target}', whose "
                            f"stacked q/k/v weight has {rows_total} rows ({rows_total // 3} per part).")
        start = "qkv".index(term.part) * out_rows
        rows = slice(start, start + out_rows)
    else:
        if out_rows != rows_total:
            raise LoRAError(f"{counted} has {out_rows} output rows; '{term.target}.{term.param}' has {rows_total}.")
        rows = slice(0, rows_total)
    if term.kind == "lowrank":
        if down.shape[1] != shape[1]:
            curve = (getattr(getattr(model, "config", None), "curve_form", False)
                     and ".adaln_proj." in f".{term.target}." and shape[1] < down.shape[1])
            raise LoRAError(f"{what} has input width {down.shape[1]}; '{term.target}' takes {shape[1]}." + (
                " This model is a pruned (curve-form) checkpoint, whose AdaLN projections read a few curve columns "
                "instead of the time embedding the adapter was trained on: use it with the full checkpoint."
                if curve else ""))
        scale = strength * term.alpha / term.rank
    elif factored:
        if in_width != shape[1]:
            raise LoRAError(f"{counted} has input width {in_width}; '{term.target}' takes {shape[1]}.")
        scale = strength * term.scale
        return _Resolved(module, term.target, term.param, rows, scale, None, None, None, term, order)
    else:
        if tuple(delta.shape[1:]) != shape[1:]:
            raise LoRAError(f"{what} has shape {list(delta.shape)}; '{term.target}.{term.param}' is {list(shape)}.")
        scale = strength
    return _Resolved(module, term.target, term.param, rows, scale, down, up, delta)


# ---------------------------------------------------------------------------------------------------
class _DeltaHook:
    """Forward hook adding the unmerged adapters' contribution to one module's output.

    Linear: y += scale * (x A^T) B^T on the term's output rows (dense: x D^T, bias + db; LoKr: W1 X W2^T; LoHa: as
    a rank r1 * r2 pair or its dense delta).
    RMSNorm: y += normalize(x) * D (RMSNorm is linear in its weight, so this is exact).
    """

    def __init__(self, module: nn.Module, resolved: list[_Resolved]):
        dtype = compute_dtype(module)
        device = module.weight.device
        self.terms = [
            (r.param, r.rows, r.scale,
             None if r.down is None else r.down.to(device, dtype),
             None if r.up is None else r.up.to(device, dtype),
             None if r.delta is None else r.delta.to(device, dtype))
            for r in resolved if r.factored is None
        ]
        # LoKr: (W1, W2) made once, small; LoHa: its four factors, its rank r1 * r2 pair or its delta made at each
        # forward (never kept), its row order moved into w1_a and w2_a (a Hadamard product's rows are its factors' rows)
        self.factored = []
        for r in resolved:
            if r.factored is None:
                continue
            if r.factored.kind == "lokr":
                factors, order = tuple(w.to(dtype) for w in r.factored.kronecker_factors(device)), r.order
            else:
                f = r.factored.factors
                w1_a, w2_a = (f["w1_a"], f["w2_a"]) if r.order is None else (f["w1_a"][r.order], f["w2_a"][r.order])
                factors, order = tuple(t.to(device, dtype) for t in (w1_a, f["w1_b"], w2_a, f["w2_b"])), None
            self.factored.append((r.rows, r.scale, r.factored.kind, order, factors))

    def __call__(self, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        out = output.clone() if torch.is_grad_enabled() else output  # in place only where autograd cannot see it
        if any(t is not None and t.device != x.device for term in self.terms for t in term[3:]):
            # hooked while the model was elsewhere (the CPU, before placing): moved once, not at every forward
            self.terms = [(*term[:3], *(None if t is None else t.to(x.device) for t in term[3:])) for term in self.terms]
        for param, rows, scale, down, up, delta in self.terms:
            if down is not None:
                _add_linear(out, rows, x.to(down.dtype), up, scale, down)
            elif param == "bias":
                out[..., rows] += (delta * scale).to(out.dtype)
            elif isinstance(module, LINEARS):
                _add_linear(out, rows, x.to(delta.dtype), delta, scale)
            else:
                out[..., rows] += (F.rms_norm(x, module.normalized_shape, delta.to(x.dtype), module.eps)
                                   * scale).to(out.dtype)
        for index, (rows, scale, kind, order, factors) in enumerate(self.factored):
            if any(t.device != x.device for t in factors):  # moved once, as the factors above
                factors = tuple(t.to(x.device) for t in factors)
                self.factored[index] = (rows, scale, kind, order, factors)
            x_in = x.to(factors[0].dtype)
            if kind == "loha":  # made for this layer at each forward, never kept: as a low-rank pair where cheaper
                w1_a, w1_b, w2_a, w2_b = factors
                if loha_is_low_rank(w1_a.shape[0], w1_b.shape[1], w1_b.shape[0], w2_b.shape[0]):
                    up, down = loha_low_rank_factors(*factors)
                    _add_linear(out, rows, x_in, up, scale, down)
                else:
                    _add_linear(out, rows, x_in, (w1_a @ w1_b) * (w2_a @ w2_b), scale)  # its dense delta
                continue
            target = out[..., rows]
            if target.dtype == x_in.dtype and _add_kronecker(target, x_in, *factors, order, scale):
                continue
            contribution = _kronecker_product(x_in, *factors)
            if order is not None:
                contribution = contribution[..., order.to(x.device)]
            out[..., rows] += (contribution * scale).to(out.dtype)
        return out


FACTORED_CHUNK_ELEMENTS = 2**25  # a dynamic LoKr's or LoHa's slice of temporaries: 64 MiB in bf16, whatever the rows


def _add_kronecker(target: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                   order: torch.Tensor | None, scale: float) -> bool:
    """target += scale * x kron(W1, W2)^T in place (as `_add_product`), a slice of tokens at a time so that its
    temporaries stay under FACTORED_CHUNK_ELEMENTS: W1 (X W2^T) as batched GEMMs into `target` seen as [tokens, a, c];
    with an `order` of our rows (diffusers' SwiGLU halves, interleaved qkv heads), the slice's product reordered and
    added. False where `target` cannot be seen as a matrix."""
    try:
        matrix = target.view(-1, target.shape[-1])
    except RuntimeError:
        return False
    grouped = x.reshape(-1, w1.shape[1], w2.shape[1])  # [tokens, b, d]
    # X W2^T [step, b, c]; with an order also the product and its reordered copy [step, a * c] each
    step = max(1, FACTORED_CHUNK_ELEMENTS // (w1.shape[1] * w2.shape[0] if order is None else 2 * matrix.shape[1]))
    for start in range(0, matrix.shape[0], step):
        inner = torch.matmul(grouped[start : start + step], w2.t())
        rows = matrix[start : start + step]
        if order is None:
            rows.view(-1, w1.shape[0], w2.shape[0]).baddbmm_(w1.expand(inner.shape[0], *w1.shape), inner, alpha=scale)
        else:
            rows.add_(torch.matmul(w1, inner).reshape(rows.shape)[:, order.to(x.device)], alpha=scale)
        del inner  # freed before the next slice's is made
    return True


def _kronecker_product(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """x kron(W1, W2)^T without making the kron (x's last dim seen as [b, d]: W1 X W2^T)."""
    grouped = x.reshape(*x.shape[:-1], w1.shape[1], w2.shape[1])  # [..., b, d]
    product = torch.matmul(w1, torch.matmul(grouped, w2.t()))  # [..., a, c]
    return product.reshape(*x.shape[:-1], w1.shape[0] * w2.shape[0])


def _add_linear(out: torch.Tensor, rows: slice, x: torch.Tensor, up: torch.Tensor, scale: float,
                down: torch.Tensor | None = None) -> None:
    """out[..., rows] += scale * x D^T (D = `up`, or `up` @ `down`): in place where the output allows
    (`_add_product`), else as a plain sum."""
    target = out[..., rows]
    if target.dtype == x.dtype and _add_product(target, x, up, scale, down):
        return
    out[..., rows] += (F.linear(x if down is None else F.linear(x, down), up) * scale).to(out.dtype)


def _add_product(target: torch.Tensor, x: torch.Tensor, up: torch.Tensor, scale: float,
                 down: torch.Tensor | None = None) -> bool:
    """target += scale * x D^T in place, D = `up` (a dense delta) or `up` @ `down` (low-rank, its [tokens, rank]
    product made FACTORED_CHUNK_ELEMENTS at a time), GEMMs into `target` (a view of the hooked output): no temporary
    of the output's width (two of them at fc1, 4.1 GiB at a 5 s clip's rows on an H200, were not in the memory
    plan). False where `target` cannot be seen as a matrix in place."""
    try:
        matrix = target.view(-1, target.shape[-1])
    except RuntimeError:
        return False
    flat = x.reshape(-1, x.shape[-1])
    if down is None:
        matrix.addmm_(flat, up.t(), alpha=scale)
        return True
    step = max(1, FACTORED_CHUNK_ELEMENTS // down.shape[0])
    for start in range(0, flat.shape[0], step):
        low = F.linear(flat[start : start + step], down)
        if low.dtype != matrix.dtype:  # under autocast: the first slice says so, before anything is added
            return False
        matrix[start : start + step].addmm_(low, up.t(), alpha=scale)
    return True


def loha_is_low_rank(out_features: int, in_features: int, rank1: int, rank2: int) -> bool:
    """Whether a hooked LoHa is cheaper added as a rank1 * rank2 product (`loha_low_rank_factors`) than through its
    dense delta (a second GEMM the size of its layer's, +67-127% on an H100): fewer multiply-adds per token."""
    return rank1 * rank2 * (out_features + in_features) < out_features * in_features


def loha_low_rank_factors(w1_a: torch.Tensor, w1_b: torch.Tensor, w2_a: torch.Tensor,
                          w2_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(U [out, r1 * r2], V [r1 * r2, in]) with U V = (w1_a w1_b) * (w2_a w2_b): the Hadamard product of two sums of
    r1 and r2 outer products is the sum of the r1 * r2 outer products of the factors' elementwise products."""
    up = (w1_a[:, :, None] * w2_a[:, None, :]).flatten(1)
    down = (w1_b[:, None, :] * w2_b[None, :, :]).flatten(0, 1)
    return up, down


def loha_transient_elements(term: Term) -> int:
    """The most a hooked LoHa makes while its layer runs: U, V and a slice of x V^T, or its delta and the two
    products it is made from."""
    (out_features, in_features), f = term.factored_shape, term.factors
    rank1, rank2 = f["w1_b"].shape[0], f["w2_b"].shape[0]
    if loha_is_low_rank(out_features, in_features, rank1, rank2):
        return rank1 * rank2 * (out_features + in_features) + FACTORED_CHUNK_ELEMENTS
    return 3 * out_features * in_features


@dataclass
class _Application:
    mode: str
    entries: list  # merge: (module, param name, fp32 delta or None, backup or None); dynamic: hook handles
    names: list[str]


# ---------------------------------------------------------------------------------------------------
@dataclass
class AppliedLoRA:
    """What one adapter did: for the CLI/node report."""

    name: str
    format: str
    strength: float
    modules: int
    alpha: str
    contract: TurboContract | None
    notes: list[str]


@dataclass
class LoRAReport:
    """The result of `apply_loras`. `contract` is the one Turbo contract of the applied adapters (None
    when none has one, or when they disagree: then `warnings` says so)."""

    partition: str
    mode: str
    loras: list[AppliedLoRA]
    warnings: list[str]
    contracts: list[TurboContract] = field(default_factory=list)

    @property
    def contract(self) -> TurboContract | None:
        distinct = {(c.steps, c.video_shift, c.audio_shift, c.base_sigmas) for c in self.contracts}
        return self.contracts[0] if len(distinct) == 1 else None

    def sampler_settings(self, **overrides) -> SamplerSettings:
        return sampler_settings(self.contracts, **overrides)

    def lines(self) -> list[str]:
        """Human-readable report, one line per fact."""
        out = [f"LoRA on {self.partition} ({self.mode}):"]
        for item in self.loras:
            out.append(f"  {item.name}: {item.format}, strength {item.strength:g}, {item.modules} modules, alpha: {item.alpha}")
            out.append(f"    schedule: {item.contract.describe() if item.contract else 'no schedule found (plain LoRA)'}")
            out += [f"    note: {note}" for note in item.notes]
        out += [f"  warning: {w}" for w in self.warnings]
        return out


def run_mode(model: nn.Module) -> str:
    """How a run applies LoRAs to a freshly loaded `model`: merged into its weights, unless it holds linears as a
    file stores them (FP8, int8, int4, NVFP4, GGUF), which a merge would have to quantize again: then hooked
    ("dynamic")."""
    return "dynamic" if any(isinstance(module, StoredLinear) for module in model.modules()) else "merge"


def apply_loras(
    model: nn.Module,
    loras: Sequence[tuple[LoRA, float] | LoRA],
    *,
    partition: str,
    mode: str = "merge",
    backup: bool = True,
) -> LoRAReport:
    """Apply adapters (each with a strength; a bare LoRA means strength 1) to `model` of `partition`.

    Every term is checked against the model before any weight changes, so an error leaves the model
    as it was. See the module docstring for the merge / dynamic contracts.
    """
    if mode not in ("merge", "dynamic"):
        raise LoRAError(f"mode must be 'merge' or 'dynamic', got {mode!r}.")
    if partition not in PARTITIONS:
        raise LoRAError(f"partition must be one of {', '.join(PARTITIONS)}, got {partition!r}.")
    loaded_as = getattr(model, "partition", None)  # a loaded DiT knows its partition (sample() checks it too)
    if loaded_as in PARTITIONS and loaded_as != partition:
        raise LoRAError(f"This DiT was loaded as the {loaded_as} partition; applying the {partition} layers to it "
                        f"would merge another transformer's adapter into it. Give partition={loaded_as!r}.")
    if mode == "merge":
        _refuse_streamed(model, "merged into")
    if isinstance(loras, (str, Path)):  # else its letters were taken as (lora, strength) pairs
        raise LoRAError(f"apply_loras takes loaded LoRAs, got the path {str(loras)!r}: read it with load_lora(path) "
                        "and pass [lora] or [(lora, strength)].")
    if isinstance(loras, LoRA) or not isinstance(loras, Iterable):
        raise LoRAError(f"apply_loras takes a list of LoRAs or (lora, strength) pairs, got one "
                        f"{type(loras).__name__}: pass [lora] or [(lora, strength)].")
    pairs = [(item, 1.0) if isinstance(item, LoRA) else _pair(item) for item in loras]
    report = LoRAReport(partition, mode, [], [])
    by_module: dict[tuple[str, str], list[_Resolved]] = {}
    for lora, strength in pairs:
        if not isinstance(lora, LoRA):
            raise LoRAError(f"apply_loras takes LoRA objects from load_lora (or (lora, strength) pairs), got {type(lora).__name__}.")
        if not math.isfinite(float(strength)):
            raise LoRAError(f"Strength of {lora.name} must be a finite number, got {strength!r}.")
        terms = lora.terms_for(partition)
        notes = list(lora.notes)
        if len(lora.parts) > 1:
            notes.append(f"layers for {', '.join(p for p in lora.parts if p != partition)} not applied (file holds both partitions)")
        if lora.contract is None:  # the usual case (a style LoRA): its report line says so, not a warning
            logger.info("%s: no schedule found in its metadata or name; applied as a plain LoRA", lora.name)
        elif float(strength) != 0.0:
            report.contracts.append(lora.contract)
        modules = {t.target for t in terms}
        report.loras.append(AppliedLoRA(lora.name, lora.format, float(strength), len(modules), lora.alpha_summary,
                                        lora.contract, notes))
        if float(strength) == 0.0:
            notes.append("strength 0: nothing applied" + (", its schedule not used" if lora.contract else ""))
            continue
        for term in terms:
            resolved = _resolve(model, lora, term, float(strength))
            by_module.setdefault((term.target, term.param), []).append(resolved)
    paths = [lora.path for lora, _ in pairs]
    for path in dict.fromkeys(p for p in paths if paths.count(p) > 1):
        report.warnings.append(f"{Path(path).name} is applied {paths.count(path)} times: its deltas add up")
    if len(report.contracts) > 1 and report.contract is None:
        report.warnings.append("the applied adapters were distilled for different schedules: "
                               + "; ".join(c.describe() for c in report.contracts))
    names = [f"{item.name}@{item.strength:g}" for item in report.loras]
    with torch.no_grad():
        application = (_merge if mode == "merge" else _hook)(by_module, backup)
    application.names = names
    model.__dict__.setdefault(_STATE, []).append(application)
    for line in report.warnings:
        logger.warning(line)
    return report


def _pair(item) -> tuple:
    """One (lora, strength) pair of apply_loras' list, refused clearly when it is anything else."""
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise LoRAError(f"apply_loras takes LoRA objects from load_lora (or (lora, strength) pairs), got "
                        f"{type(item).__name__}" + (f" of {len(item)}" if isinstance(item, (tuple, list)) else "")
                        + ".")
    return tuple(item)


def check_loras(model, loras: Sequence[tuple[LoRA, float]], partition: str) -> None:
    """Every term of `loras` fits `model` (an H3DiT, its weights read or not, or the DiTConfig of one), from
    shapes only: an adapter for another model is refused before tens of GB of weights are read."""
    if not isinstance(model, nn.Module):
        from .dit import H3DiT

        with torch.device("meta"):
            model = H3DiT(model)
    for lora, strength in loras:
        if not math.isfinite(float(strength)):
            raise LoRAError(f"Strength of {lora.name} must be a finite number, got {strength!r}.")
        terms = lora.terms_for(partition)  # an adapter for the other partition is refused whatever its strength
        for term in terms if float(strength) != 0.0 else ():
            _resolve(model, lora, term, float(strength), weights=False)


def applied_contracts(loras: Sequence[tuple[LoRA, float]]) -> list[TurboContract]:
    """The Turbo contracts of the adapters in (LoRA, strength) pairs that act: strength 0 switches an adapter
    off, its schedule too (as a ComfyUI user turns a LoRA off)."""
    return [lora.contract for lora, strength in loras if lora.contract is not None and float(strength) != 0.0]


def hooked_bytes(loras: Sequence[tuple[LoRA, float]], partition: str, element_size: int,
                 fp32_modules: tuple[str, ...] = ()) -> int:
    """Device bytes the factors of `loras` take when hooked into a resident DiT (each held in the compute dtype of
    its module: `element_size` bytes, 4 under the name prefixes `fp32_modules` (dit.fp32_modules)), with the most
    one layer's LoKr / LoHa makes while it runs: a memory plan counts them (the Turbo exports' are ~1.8 GiB)."""
    total = transient = 0
    for lora, strength in loras:
        if float(strength) != 0.0:
            for term in lora.terms_for(partition):
                size = 4 if term.target.startswith(fp32_modules) else element_size
                held = sum(t.numel() for t in (term.down, term.up, term.delta) if t is not None)
                if term.kind == "lokr":  # W1 and W2, kept whole; a slice of x W2^T while its layer runs
                    held += sum(w.numel() for w in term.kronecker_factors(device="meta"))
                    transient = max(transient, FACTORED_CHUNK_ELEMENTS * size)
                elif term.kind == "loha":  # its factors, and what it makes while its layer runs
                    held += sum(t.numel() for t in term.factors.values())
                    transient = max(transient, loha_transient_elements(term) * size)
                total += held * size
    return total + transient


def task_warnings(contracts: Sequence[TurboContract], task: str) -> list[str]:
    """A line for each contract distilled for other tasks than `task` on the same DiT (FlashGen's T2VA ladder on
    an FL2VA request, say): it runs, but on a schedule not trained for what is asked."""
    return [f"{contract.artifact} was distilled for {'/'.join(contract.tasks)}, not {task}: expect weaker results"
            for contract in contracts if contract.tasks and task not in contract.tasks]


def _summed_delta(param: torch.Tensor, resolved: list[_Resolved]) -> torch.Tensor:
    """All terms on one parameter, summed in fp32 on its device."""
    delta = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
    for r in resolved:
        delta[r.rows] += r.dense(param.device)
    return delta


def _merge(by_module: dict, backup: bool) -> _Application:
    """One parameter at a time, so at most one fp32 delta is alive. Without a backup the terms are kept
    (they are small) and the delta is recomputed at removal."""
    stored = [target for (target, _), resolved in by_module.items() if isinstance(resolved[0].module, StoredLinear)]
    if stored:  # refused before any weight changes
        raise LoRAError(f"'{stored[0]}' holds FP8 / int8 / int4 / NVFP4 weights, which a LoRA cannot be merged into "
                        "without quantizing again; apply it dynamically (as ComfyUI's LoRA node does), or load with "
                        "linears 'dense'.")
    application = _Application("merge", [], [])
    mapped = file_mapped_ranges()
    try:
        for (_, param_name), resolved in by_module.items():
            param = getattr(resolved[0].module, param_name)
            saved = param.detach().to("cpu", copy=True) if backup else None
            merged = (param.float() + _summed_delta(param, resolved)).to(param.dtype)
            if not torch.isfinite(merged).all():  # else every step gives NaN, found only once sampling ends
                raise LoRAError(f"Merging the LoRA into {resolved[0].target}.{param_name} gives infinite or NaN "
                                f"weights in {str(param.dtype).removeprefix('torch.')}: a strength too large for "
                                "it, or values in the adapter that are not finite. Nothing was applied.")
            if in_mapped_file(param, mapped):  # a safetensors / GGUF file's pages, mapped copy-on-write:
                param.data = merged  # written, each would become the process's own until the file is unmapped
            else:
                param.copy_(merged)
            application.entries.append((resolved[0].module, param_name, None if backup else resolved, saved))
    except BaseException:  # out of memory part way, say: the parameters done so far go back
        _undo(application)
        raise
    return application


def _refuse_streamed(model: nn.Module, what: str) -> None:
    """A merge changes weights in place, but a streamed block's weights are the streamer's copies (its pinned or
    file-backed homes, given back as read when it is unplaced): the change would be lost, or lost later."""
    from .offload import is_streamed

    if is_streamed(model):
        raise LoRAError(f"A LoRA cannot be {what} a DiT whose blocks are streamed: unplace it first (offload.unplace), "
                        "or apply the LoRA with mode='dynamic'.")


def _hook(by_module: dict, backup: bool) -> _Application:
    grouped: dict[nn.Module, list[_Resolved]] = {}
    for resolved in by_module.values():
        grouped.setdefault(resolved[0].module, []).extend(resolved)
    application = _Application("dynamic", [], [])
    try:
        for module, resolved in grouped.items():
            application.entries.append(module.register_forward_hook(_DeltaHook(module, resolved)))
    except BaseException:  # a factor that did not fit on the device, say: no hook stays behind
        _undo(application)
        raise
    return application


def _undo(application: _Application) -> None:
    """Take one application's hooks off, or its merged deltas out, newest first."""
    if application.mode == "dynamic":
        for handle in application.entries:
            handle.remove()
        return
    for module, param_name, resolved, saved in reversed(application.entries):
        param = getattr(module, param_name)
        if saved is not None:
            param.copy_(saved.to(param.device))
        else:
            param.copy_((param.float() - _summed_delta(param, resolved)).to(param.dtype))


def remove_loras(model: nn.Module, keep: int = 0) -> int:
    """Undo the `apply_loras` on `model` newest first, all but the first `keep` (a split model's workers keep the
    adapters merged at load while those of its runs change); returns how many applications were undone."""
    stack = model.__dict__.get(_STATE, [])
    undone = stack[keep:]
    if any(application.mode == "merge" for application in undone):
        _refuse_streamed(model, "taken out of")
        present = {id(module) for module in model.modules()}
        gone = [module for application in undone if application.mode == "merge"
                for module, *_ in application.entries if id(module) not in present]
        if gone:  # checked before any is undone: half a removal would leave neither model
            raise LoRAError(f"{len(gone)} layer(s) a LoRA was merged into were replaced since (e.g. by an FP8 linear "
                            "mode); the merge cannot be taken out of them. Read the DiT again for its base weights.")
    with torch.no_grad():
        while len(stack) > keep:
            _undo(stack.pop())
    return len(undone)


def applied_loras(model: nn.Module) -> list[tuple[str, list[str]]]:
    """(mode, ["name@strength", ...]) of each application still on `model`, oldest first."""
    return [(a.mode, list(a.names)) for a in model.__dict__.get(_STATE, [])]


# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SamplerSettings:
    """Sampler defaults for a request: what `DualClockSchedule.build` takes, and where they came from."""

    steps: int
    video_shift: float
    audio_shift: float
    video_sigmas: tuple[float, ...] | None
    audio_sigmas: tuple[float, ...] | None
    source: str
    notes: tuple[str, ...] = ()

    def schedule(self) -> DualClockSchedule:
        return DualClockSchedule.build(self.steps, self.video_shift, self.audio_shift, self.video_sigmas, self.audio_sigmas)


# FastVideo's FastH3 8-Step V2, a full transformer with a VSA gate in every block (h3-model.md D, H.4): its
# published unshifted ladder with shifts 10 / 3, guidance 1, trained on T2VA with sparsity 0.8
VSA_STUDENT_CONTRACT = TurboContract("FastVideo FastH3 8-Step V2", "VSA gates", 9, video_shift=10.0, audio_shift=3.0,
                                     base_sigmas=(0.999, 0.874, 0.749, 0.624, 0.5, 0.375, 0.25, 0.125, 0.0),
                                     tasks=("t2va",))


def sampler_settings(
    contracts: TurboContract | Sequence[TurboContract] | None = None,
    steps: int | None = None,
    video_shift: float | None = None,
    audio_shift: float | None = None,
    video_sigmas: Sequence[float] | None = None,
    audio_sigmas: Sequence[float] | None = None,
) -> SamplerSettings:
    """The contract's settings as defaults, each user value overriding it with a note saying so.

    Without a contract: the base model's 50 points and shifts 12 / 3. A contract with a base ladder
    (FlashGen) gives explicit ladders under the shifts in force; a user step count other than its length
    replaces that ladder with the uniform one. Several different contracts without user steps and both shifts
    (or both ladders) are an error: there is no right schedule to pick.
    """
    if isinstance(contracts, TurboContract):
        contracts = [contracts]
    contracts = list(contracts or [])
    distinct = {(c.steps, c.video_shift, c.audio_shift, c.base_sigmas): c for c in contracts}
    user = dict(steps=steps, video_shift=video_shift, audio_shift=audio_shift, video_sigmas=video_sigmas, audio_sigmas=audio_sigmas)
    ladders_given = video_sigmas is not None and audio_sigmas is not None
    if len(distinct) > 1 and not (ladders_given or steps is not None and video_shift is not None and audio_shift is not None):
        raise LoRAError("The adapters were distilled for different schedules ("
                        + "; ".join(c.describe() for c in distinct.values())
                        + "). Give steps and both shifts, or both sigma ladders, explicitly.")
    notes = []
    if len(distinct) > 1:
        defaults = dict(steps=None, video_shift=None, audio_shift=None, video_sigmas=None, audio_sigmas=None)
        source = "user settings (the adapters' contracts disagree)"
        notes.append("adapters distilled for different schedules: " + "; ".join(c.describe() for c in distinct.values()))
    elif distinct:
        contract = next(iter(distinct.values()))
        ladders = contract.sigmas()
        defaults = dict(steps=contract.steps, video_shift=contract.video_shift, audio_shift=contract.audio_shift,
                        video_sigmas=ladders[0] if ladders else None, audio_sigmas=ladders[1] if ladders else None)
        source = f"Turbo contract of {contract.artifact}"
        for name, value in user.items():
            if value is not None and _differs(value, defaults[name]):
                # a contract without a ladder of its own was distilled for its steps and shifts
                theirs = (f"{contract.steps}-point ladder at video shift {contract.video_shift:g}, audio shift "
                          f"{contract.audio_shift:g}") if defaults[name] is None else _show(defaults[name])
                notes.append(f"user {name}={_show(value)} overrides the contract's {theirs} "
                             f"({contract.artifact} was distilled for the latter)")
        if contract.base_sigmas is not None:
            if steps is not None and steps != contract.steps:
                # another step count asks for a uniform ladder; the release's ladder no longer applies
                defaults["video_sigmas"] = defaults["audio_sigmas"] = None
            else:
                # the release's base ladder under the shifts in force (the user's, if given)
                defaults["video_sigmas"] = shifted(contract.base_sigmas, video_shift or contract.video_shift)
                defaults["audio_sigmas"] = shifted(contract.base_sigmas, audio_shift or contract.audio_shift)
    else:
        defaults = dict(steps=DEFAULT_STEPS, video_shift=VIDEO_SHIFT, audio_shift=AUDIO_SHIFT, video_sigmas=None, audio_sigmas=None)
        source = "base model defaults: no Turbo contract"
    chosen = {name: (user[name] if user[name] is not None else defaults[name]) for name in defaults}
    ladder = chosen["video_sigmas"] if chosen["video_sigmas"] is not None else chosen["audio_sigmas"]
    if ladder is not None:  # a ladder walks its own points (DualClockSchedule.build): what memory plans count
        chosen["steps"] = len(ladder)
    chosen["video_shift"] = VIDEO_SHIFT if chosen["video_shift"] is None else chosen["video_shift"]
    chosen["audio_shift"] = AUDIO_SHIFT if chosen["audio_shift"] is None else chosen["audio_shift"]
    for name in ("video_sigmas", "audio_sigmas"):
        if chosen[name] is not None:
            chosen[name] = tuple(float(v) for v in chosen[name])
    return SamplerSettings(int(chosen["steps"]), float(chosen["video_shift"]), float(chosen["audio_shift"]),
                           chosen["video_sigmas"], chosen["audio_sigmas"], source, tuple(notes))


def _differs(a, b) -> bool:
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return b is None or len(a) != len(b) or any(abs(float(x) - float(y)) > 1e-9 for x, y in zip(a, b))
    return b is None or abs(float(a) - float(b)) > 1e-9


def _show(value) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(f"{float(v):.5g}" for v in value) + "]"
    return f"{value:g}" if isinstance(value, float) else str(value)
