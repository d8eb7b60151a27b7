"""choose_kernels: decide, per group, the kernel it runs in training and in inference, and whether
its optimizer runs inside backward, by the rule table below (or, with ``autotune=True``, by
timing on the example inputs, cached on disk).

A decision is a lookup: :data:`RULES` maps (device, mode) to the kernels in order of preference,
and the first whose ``supports(group, device, mode, optimizer)`` is None (and whose code is on
this machine, when deciding for it) runs the group. ``backend="<kernel>"`` puts that kernel
first. The same model and inputs always get the same decisions: nothing is measured unless
``autotune=True`` asks for it. The decision is a frozen :class:`fxrec.meta.GroupDecision` in the
meta of the group's lookup nodes (lower_groups moves it to the group's call); the report is built
from those after the pipeline.

Before/After: the graph is unchanged; each GroupRecord gets kernel_train, kernel_eval, fused,
decision.

Not handled: devices other than cpu and cuda (the reference kernel runs there).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch.fx as fx

from .. import meta
from ..report import LookupEntry
from ..group_module import group_spec, uses_outside_group
from ..pass_infra import InputError, PassContext, PassResult, compiler_pass
from ..runtime import kernels
from ..runtime.kernels import FBGEMM, NATIVE, REFERENCE
from ..runtime.specs import FUSED_STATE_BYTES

#: (device, mode, fused optimizer) -> kernels in order of preference; ``None`` as the optimizer is
#: the line for every optimizer without one of its own. Figures: benchmarks/results/cpu.json and
#: cpu_optimizers.json (``make bench``, benchmarks/bench_optimizers.py; 2-core CPU, docs/benchmarks.md),
#: and the in-process alternating timings autotune makes (ms per call or step).
RULES = {
    # fbgemm's TBE is written for GPUs (one launch for every table, fused optimizers in its
    # backward); the reference runs what fbgemm cannot (other dtypes, dims over 1024).
    ("cuda", "training", None): (FBGEMM, REFERENCE),
    ("cuda", "inference", None): (FBGEMM, REFERENCE),
    # CPU, pooled groups: fxrec's native kernel is the fastest forward on all three shapes
    # (onehot26 3.34 vs fbgemm 5.91 vs plain 4.23; multihot16 8.76 vs 16.5 vs 9.31; small256 18.0 vs
    # 31.0 vs 25.8), the fastest training step with dense gradients (79 vs 91; 63 vs 71; 91 vs 101)
    # and with fused SGD and Adagrad. Sequence groups: PyTorch's own F.embedding (the reference);
    # fbgemm where only it fuses the optimizer (a sequence group with Adagrad).
    ("cpu", "training", None): (NATIVE, REFERENCE, FBGEMM),
    ("cpu", "inference", None): (NATIVE, REFERENCE, FBGEMM),
    # CPU, row-wise Adagrad: fbgemm's fused step measured faster or equal (onehot26 6.72 vs native
    # 7.39; multihot16 26.7 vs 36.2; small256 73.4 vs 71.0); both keep the same states.
    ("cpu", "training", "rowwise_adagrad"): (FBGEMM, NATIVE, REFERENCE),
    # CPU, Adagrad: the native kernel for pooled groups (as above), fbgemm's for sequence groups;
    # the reference (PyTorch ops, one unique() a table) where neither is exact: on a padding row.
    ("cpu", "training", "adagrad"): (NATIVE, FBGEMM, REFERENCE),
}


def kernel_order(device: str, mode: str, backend: str, optimizer: Optional[str] = None) -> Tuple[str, ...]:
    """The kernels the rule table (and ``backend``) gives, in order of preference."""
    order = RULES.get((device, mode, optimizer)) or RULES.get((device, mode, None), (REFERENCE,))
    if backend != "auto":
        order = (backend,) + tuple(k for k in order if k != backend)
    return order


def pick(spec, device: str, mode: str, optimizer: Optional[str], order, on_this_machine: bool,
         options: Tuple[str, ...] = ()) -> Tuple[Optional[str], List[str]]:
    """The first kernel of ``order`` that supports the group (and is there, ``on_this_machine``),
    and why each one before it was passed over."""
    passed = []
    for name in order:
        k = kernels.get(name)
        why = k.supports(spec, device, mode, optimizer, options=options)
        if why is None and on_this_machine:
            why = k.available(device)
        if why is None:
            return name, passed
        passed.append(f"not {name}: {why}")
    return None, passed


def pass_over_frozen(order, kind: Optional[str], frozen, tables, weighted: bool, backend: str):
    """``order`` without fbgemm where its fused kernel would update frozen tables (it updates every
    table of its TBE), and the reason as the report gives it: ``frozen`` are the names of those of
    ``tables`` whose weights do not require grad. A group all of whose tables are frozen runs no
    fused backward (nothing to update), unless per-sample weights that need a gradient bring one.
    A forced ``backend="fbgemm"`` is refused."""
    some = frozen and (len(set(frozen)) < len(set(tables)) or weighted)
    if kind is None or not some or FBGEMM not in order:
        return order, []
    said = f"tables {sorted(set(frozen))} are frozen (requires_grad=False) and fbgemm's fused kernel would update them"
    if backend == FBGEMM:
        raise InputError(f"fxrec: {said}; give them no optimizer (optimizer={{name: ...}} for the others), "
                         "or transform with another backend")
    return tuple(k for k in order if k != FBGEMM), [f"not {FBGEMM}: {said}"]


def target_device(ctx: PassContext, tables_device: str) -> str:
    """The device the kernels are chosen for: explain's ``device=``, else where the tables are."""
    return ctx.config.device or tables_device.split(":")[0]


def _device(gr: meta.GroupRecord, ctx: PassContext) -> str:
    return target_device(ctx, gr.lookups[0].device)


def decide(gr: meta.GroupRecord, ctx: PassContext, frozen: Tuple[str, ...] = ()) -> meta.GroupDecision:
    """Kernels and fused optimizer for ``gr`` by rule; sets them on the record too. ``frozen``: its
    tables whose weights do not require grad, which fbgemm's fused kernel would update (it updates
    every table of its TBE): by rule another kernel fuses the optimizer, or torch.optim steps the
    others; a forced ``backend="fbgemm"`` is refused."""
    device = _device(gr, ctx)
    here = ctx.config.device is None
    backend = ctx.config.backend
    spec = group_spec(gr)
    training = ctx.config.mode == "training"
    why: List[str] = []
    opt = gr.optimizer
    fused = opt.fused_spec() if opt is not None else None
    if opt is not None and fused is None:
        why.append(f"optimizer: {opt.fused_unsupported_reason()}, so torch.optim in opt.step()")
    outside = uses_outside_group(gr.lookups) if fused is not None else ""
    if outside:
        why.append(f"optimizer: table '{outside}' is also used outside its lookups, and a fused update would miss "
                   "that gradient, so torch.optim in opt.step()")
        fused = None
    k_eval, passed_eval = pick(spec, device, "inference", None, kernel_order(device, "inference", backend), here)
    k_train, passed_train = k_eval, []
    if training:
        kind = fused.kind if fused is not None else None
        order = kernel_order(device, "training", backend, kind)
        order, skipped_frozen = pass_over_frozen(order, kind, frozen, {r.table for r in gr.lookups},
                                                 any(r.weighted for r in gr.lookups), backend)
        k_train, passed_train = pick(spec, device, "training", kind, order, here,
                                     fused.options if fused is not None else ())
        passed_train = skipped_frozen + passed_train
        if spec.weights:
            check_stored(spec, outside, k_train, passed_train)
        if k_train is None and fused is not None:
            why.append(f"optimizer: no kernel fuses {fused.kind} here ({'; '.join(passed_train)}), so torch.optim "
                       "in opt.step()")
            fused = None
            k_train, passed_train = pick(spec, device, "training", None, kernel_order(device, "training", backend), here)
    if spec.weights:
        check_stored(spec, "", k_eval, passed_eval)
    k_train, k_eval = k_train or REFERENCE, k_eval or REFERENCE
    gr.kernel_train, gr.kernel_eval = k_train, k_eval
    gr.fused = fused if training else None
    by = "rule" if backend == "auto" else f"backend={backend!r}"
    head = (f"{by}: {k_train} for training, {k_eval} for inference" if training and k_train != k_eval
            else f"{by}: {k_eval}")
    skipped = passed_train + [p for p in passed_eval if p not in passed_train]
    text = "; ".join([head + (f" ({'; '.join(skipped)})" if skipped else "")] + why)
    if gr.fused is not None:
        text += f"; optimizer: fused {gr.fused.kind} inside backward by {k_train}"
    return meta.GroupDecision(
        group=gr.name, pooling=gr.pooling, lookups=tuple(LookupEntry.of(r, gr.name) for r in gr.lookups),
        device=device, kernel_train=k_train if training else k_eval, kernel_eval=k_eval, decided_by=by, why=text,
        fused=gr.fused.kind if gr.fused else "", fused_by=k_train if gr.fused else "",
        optimizer=_optimizer_text(gr),
        dtypes=tuple(gr.quant.get(p) or t.weights or t.dtype for p, t in zip(gr.tables, spec.tables)),
        placement="device" if device == "cuda" else "host", quantized=bool(gr.quant),
        padding=_padding(gr, spec, k_train if training else None, k_eval),
    )


def _padding(gr: meta.GroupRecord, spec, k_train: Optional[str], k_eval: str) -> tuple:
    """The tables the group will store wider than their dim, and the bytes that costs: quantized
    tables at their dtype's alignment; fp32 tables wherever an fbgemm TBE holds them (the fbgemm
    kernel, or the Adagrads' states); their element-wise states (Adagrad's, the Adam and LAMB
    moments) are padded as well."""
    if gr.quant:
        from ..runtime.quantized import stored_dims

        dtypes = [gr.quant[p] for p in gr.tables]
        stored = stored_dims(spec.tables, dtypes, spec.pooling)
        col_bytes = [{"fp32": 4.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5, "int2": 0.25}[d] for d in dtypes]
    elif FBGEMM in (k_train, k_eval) or (gr.fused is not None and gr.fused.kind != "sgd"):
        from ..runtime.kernels.fbgemm_bind import tbe_dims

        stored = tbe_dims(spec)
        state = FUSED_STATE_BYTES[gr.fused.kind][1] if gr.fused is not None else 0  # per padded value
        col_bytes = [state + float(spec.row_bytes)] * len(stored)
    else:
        return ()
    return tuple((t.name, t.dim, w, int(t.num_rows * (w - t.dim) * b))
                 for t, w, b in zip(spec.tables, stored, col_bytes) if w != t.dim)


@compiler_pass(needs=("groups",), provides=("paths",))
def choose_kernels(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    stats = {k: 0 for k in kernels.KERNEL_NAMES}
    tuned = None
    if ctx.config.autotune and ctx.config.device is None and ctx.config.backend == "auto":  # a forced backend wins
        from ..autotune import Autotuner

        tuned = Autotuner(gm, ctx)
    refused: List[str] = []  # (weights_precision= on groups fbgemm cannot store so: every one named at once)
    for gr in ctx.groups:
        frozen = tuple(sorted({r.table for r in gr.lookups if r.frozen}))
        try:
            decision = decide(gr, ctx, frozen)
        except StoredPrecisionError as e:
            refused.append(str(e))
            continue
        if tuned is not None and not gr.quant and not any(r.weights for r in gr.lookups):  # those have one kernel
            decision = tuned.tune(gr, decision)
        gr.decision = decision
        for r in gr.lookups:
            r.node.meta[meta.DECISION] = decision
        stats[gr.kernel_train if ctx.config.mode == "training" else gr.kernel_eval] += 1
    if refused:
        raise InputError(refused[0] if len(refused) == 1 else
                         f"fxrec: weights_precision= cannot store {len(refused)} groups' tables so:\n  "
                         + "\n  ".join(m.removeprefix("fxrec: ") for m in refused))
    return PassResult(gm, False, {"groups": len(ctx.groups), **{k: v for k, v in stats.items() if v}})


class StoredPrecisionError(InputError):
    """:func:`check_stored`'s refusal of one group (the pass names every group's at once)."""


def check_stored(spec, outside: str, kernel: Optional[str], passed: List[str]) -> None:
    """Tables ``weights_precision=`` stores at a lower precision exist only in fbgemm's TBE: an
    InputError naming them unless fbgemm runs the group (in training: with its fused optimizer)
    and nothing else reads the tables."""
    names = [t.name for t in spec.tables]
    if outside:
        raise StoredPrecisionError(f"fxrec: weights_precision={spec.weights!r} for tables {names}, but table '{outside}' is "
                         "also used outside its lookups, which would read its rows at that precision")
    if kernel != FBGEMM:
        why = "; ".join(p for p in passed if p.startswith(f"not {FBGEMM}")) or f"the {kernel} kernel was chosen"
        raise StoredPrecisionError(f"fxrec: weights_precision={spec.weights!r} for tables {names}, which only fbgemm's TBE "
                         f"stores, and fbgemm cannot run them here ({why})")


def _optimizer_text(gr: meta.GroupRecord) -> str:
    if gr.optimizer is None:
        return ""
    where = "fused into backward" if gr.fused is not None else "torch.optim in opt.step()"
    return f"{gr.optimizer.describe()}: {where}"


def replace_kernels(gr: meta.GroupRecord, decision: meta.GroupDecision, k_train: str, k_eval: str, by: str,
                    why: str, timings: dict) -> meta.GroupDecision:
    """The decision with other kernels (autotune's measurement)."""
    gr.kernel_train, gr.kernel_eval = k_train, k_eval
    return dataclasses.replace(decision, kernel_train=k_train, kernel_eval=k_eval, decided_by=by,
                               why=why, fused_by=k_train if decision.fused else "",
                               timings_ms=tuple(sorted(timings.items())))
