"""assign_precisions: give every lookup the precision ``weights_precision=`` stores its table in.

``transform(..., optimizer=..., weights_precision="fp16")`` stores every fp32 table in fbgemm's
TBE in fp16 (``"bf16"`` is accepted here and refused by choose_kernels: no fbgemm build fxrec runs has bf16 rows): half the memory and bandwidth, for rows rounded to
that precision (on CUDA fbgemm's fused update rounds stochastically). The lookups still give
fp32. A dict maps table names, parameter names or glob patterns to ``"fp32"``, ``"fp16"`` or
``"bf16"``, the first matching key winning; tables no key names stay fp32. The precision becomes
part of the group key: one TBE stores one precision.

Before/After: the graph is unchanged; ``LookupRecord.weights`` is set ("" for fp32).

With a sharding plan the tables it shards (table-, column-, row-, table-row-wise) are stored so
on the ranks that hold them; a table the plan makes data-parallel stays fp32 (its lookups stay the
model's own, on whole tables every rank holds), and a dict key that names only such tables is an
error.

Not handled, each an error naming what was asked: inference (serve with ``quantize="fp16"``, the
inference TBE's fp16 rows), a table that is not fp32, a dict key that names no table. Which groups
fbgemm can then run is ``choose_kernels``' rule; a group it cannot run stored so is an error
there, never a silent fp32 table.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from .. import meta
from ..pass_infra import InputError, PassContext, PassResult, compiler_pass
from ..table_keys import check_keys, deciding_key
from ..runtime.specs import WEIGHTS_PRECISIONS

CHOICES = ("fp32",) + tuple(WEIGHTS_PRECISIONS)


def check_weights_precision(spec, mode: str, compares: bool = False) -> None:
    """Errors for a ``weights_precision=`` that no table could be given (``compares``: verify=
    or check_passes=, which compare with the fp32 model)."""
    if spec is None:
        return
    values = [spec] if isinstance(spec, str) else list(spec.values()) if isinstance(spec, dict) else None
    if values is None or any(v not in CHOICES for v in values):
        raise InputError(f"fxrec: weights_precision must be one of {CHOICES} or a dict of them, got {spec!r}")
    if all(v == "fp32" for v in values):
        return  # nothing stored lower
    if mode != "training":
        raise InputError("fxrec: weights_precision= is for training; to serve tables in fp16 use "
                         "mode='inference', quantize='fp16' (fbgemm's inference TBE)")
    if compares:
        raise InputError("fxrec: verify= and check_passes= compare with the model's fp32 tables, which "
                         "weights_precision= rounds: transform without them (tests/test_weights_precision.py "
                         "compares with the plain model on rounded weights instead)")


def precision_for(spec, table: str, param: str) -> str:
    if isinstance(spec, str):
        return spec
    key = deciding_key(spec, table, param)
    return "fp32" if key is None else spec[key]


@compiler_pass(needs=(meta.LOOKUP,), provides=("precisions",))
def assign_precisions(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    spec = ctx.config.weights_precision
    check_weights_precision(spec, ctx.config.mode)
    if spec is None:
        return PassResult(gm, False, {})
    plan = ctx.config.plan
    if isinstance(spec, dict):
        tables = [(n.meta[meta.LOOKUP].table, n.meta[meta.LOOKUP].param) for n in gm.graph.nodes if meta.LOOKUP in n.meta]
        check_keys(spec, tables, "fxrec: weights_precision", InputError, "embedding table")
    counts = {}
    stored_by, kept_by = {}, {}  # dict key deciding -> tables it stores lower / data-parallel ones it cannot
    for node in gm.graph.nodes:
        rec = node.meta.get(meta.LOOKUP)
        if rec is None:
            continue
        want = precision_for(spec, rec.table, rec.param)
        if want == "fp32":
            continue
        key = deciding_key(spec, rec.table, rec.param) if isinstance(spec, dict) else None
        tp = plan.tables.get(rec.table) if plan is not None else None
        if tp is not None and tp.sharding == "data_parallel":
            kept_by.setdefault(key, set()).add(rec.table)
            counts["data_parallel_fp32"] = counts.get("data_parallel_fp32", 0) + 1
            continue
        stored_by.setdefault(key, set()).add(rec.table)
        if rec.dtype.replace("torch.", "") != "float32":
            raise InputError(f"fxrec: weights_precision={want!r} for table '{rec.table}', which is "
                             f"{rec.dtype.replace('torch.', '')}: it stores fp32 tables at a lower precision")
        if not rec.lowerable:
            raise InputError(f"fxrec: weights_precision={want!r} for table '{rec.table}', but its lookup of "
                             f"{rec.feature} stays as written ({rec.reason}) and would read its rows at that precision")
        node.meta[meta.LOOKUP] = dataclasses.replace(rec, weights=want)
        counts[want] = counts.get(want, 0) + 1
    only_dp = {k: sorted(t) for k, t in kept_by.items() if k is not None and k not in stored_by}
    if only_dp:
        k, tables = next(iter(only_dp.items()))
        raise InputError(f"fxrec: weights_precision key {k!r} names only the tables {tables}, which the plan makes "
                         "data_parallel: their lookups stay the model's own, on the fp32 tables every rank holds; "
                         f"plan them table_wise, row_wise or column_wise to store them in {spec[k]}")
    return PassResult(gm, False, {f"lookups_{k}": v for k, v in sorted(counts.items())})
