"""The sharding plan as shard_groups reads it: each lookup's sharding, checked against the model
(sizes, optimizer, weights_precision, the forms sharded lookups take), every refusal of a plan
for this model (:func:`check_plan`: transform and ``fxrec.explain(plan=)`` refuse the same,
naming the table), and the decision the report shows for a group under it (:func:`plan_decision`).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import torch.fx as fx

from .. import meta
from ..dataflow import carries_gradient
from ..pass_infra import InputError, PassContext
from ..planner.specs import HALF_SHARDINGS, HALF_WHY
from ..report import LookupEntry
from ..runtime.specs import CUDA_MAX_DIM, CUDA_WIDE_FUSED, ROW_MEAN, WHOLE_ROW, pad_dim
from .annotate_lookups import apart_on_ranks, block_operands, read_unrenormalised
from .assign_optimizers import NO_GRADIENT


SUPPORTED = ("table_wise", "column_wise", "row_wise", "table_row_wise", "data_parallel")


def sharding_of(ctx: PassContext, rec: meta.LookupRecord) -> str:
    plan = ctx.config.plan
    if rec.table not in plan.tables:
        raise InputError(f"fxrec: the plan does not name table '{rec.table}' (feature '{rec.feature}'); "
                         "make the plan from this model")
    tp = plan.tables[rec.table]
    if tp.sharding not in SUPPORTED:
        raise InputError(f"fxrec: table '{rec.table}' is planned {tp.sharding}; the shard pass runs "
                         f"{', '.join(SUPPORTED)} for now (pin another sharding for it)")
    if (tp.spec.num_rows, tp.spec.dim) != (rec.num_rows, rec.dim):
        raise InputError(f"fxrec: the plan has table '{rec.table}' as {tp.spec.num_rows} x {tp.spec.dim}, "
                         f"the model as {rec.num_rows} x {rec.dim}")
    if tp.spec.quantize and ctx.config.mode != "inference":
        raise InputError(f"fxrec: the plan was made for serving (fxrec.plan(quantize=...): table '{rec.table}' sized "
                         f"as {tp.spec.quantize} rows, without optimizer state or gradients), and transform trains: "
                         "make the plan without quantize= for training")
    from ..planner.cost import optimizer_kind

    trains = optimizer_kind(rec.optimizer)
    if ctx.config.mode == "training" and tp.optimizer != trains:  # (its state, or a dense gradient, is not
        # what the plan counted on each rank; serving holds no optimizer, whatever the plan was made for)
        said = (f"the plan sized table '{rec.table}' for optimizer '{tp.optimizer}' (fxrec.plan(optimizer=...)), "
                f"and transform trains it with '{trains}', whose memory on each rank is another")
        if tp.optimizer != "none":
            raise InputError(f"fxrec: {said}: give fxrec.plan and transform the same optimizer")
        import warnings

        warnings.warn(f"fxrec: {said} (the plan was made without optimizer=): the ranks may hold more than it "
                      "counts; make it with the optimizer transform trains with", stacklevel=2)
    if tp.sharding == "column_wise" and len({sh.rank for sh in tp.shards}) != len(tp.shards):
        raise InputError(f"fxrec: table '{rec.table}' is planned column_wise with two shards on one rank; "
                         "each column shard needs its own rank")
    if tp.sharding != "data_parallel":
        if rec.half and tp.sharding not in HALF_SHARDINGS:
            raise InputError(f"fxrec: table '{rec.table}' is float16 in the model and planned {tp.sharding}; fxrec "
                             f"shards fp16 tables {' or '.join(HALF_SHARDINGS)} (whole on a rank): {HALF_WHY}")
        if tp.spec.weights != rec.weights:
            def said(w):
                return f"in {w}" if w else "as the model holds it"
            raise InputError(f"fxrec: the plan counts table '{rec.table}' stored {said(tp.spec.weights)} "
                             f"(fxrec.plan(weights_precision=...)), and transform stores it {said(rec.weights)}: "
                             "give fxrec.plan and transform the same weights_precision=")
        if rec.pooling == "none" and tp.sharding == "column_wise":
            raise InputError(f"fxrec: table '{rec.table}' is looked up unpooled (feature '{rec.feature}') and planned "
                             "column_wise; unpooled lookups of sharded tables run table_wise, row_wise or "
                             "table_row_wise for now: pin one of those (or data_parallel)")
        if rec.padding_idx is not None or rec.include_last_offset:
            raise InputError(f"fxrec: feature '{rec.feature}' of table '{rec.table}' uses padding_idx or "
                             "include_last_offset, which sharded lookups do not take yet: plan it data_parallel")
        if rec.learned_weights and ctx.config.mode == "training":
            raise InputError(f"fxrec: feature '{rec.feature}' of table '{rec.table}' has per-sample weights that need "
                             f"a gradient, and the plan shards the table {tp.sharding}; sharded tables take fixed "
                             "weights only for now: plan it data_parallel")
    return tp.sharding


def check_quantized(gr: meta.GroupRecord, kinds: dict, plan, quantizes: bool) -> None:
    """What a plan can serve quantized: row-wise quantization keeps a scale and bias per row,
    which a column shard cannot compute (so integer dtypes are not column-wise); data-parallel
    tables keep the user's fp32 lookups. A plan made for serving (``fxrec.plan(quantize=)``)
    sized each table for one dtype: transform must store it in that one (``quantizes``: transform
    was given quantize=; the model's fp16 tables kept fp16 leave ``gr.quant``)."""
    for r in gr.lookups:
        dt = gr.quant.get(r.param)
        planned = plan.tables[r.table].spec.quantize
        if planned:
            got = dt or ("fp16" if r.half and quantizes else "")
            if got != planned:
                raise InputError(f"fxrec: the plan sized table '{r.table}' for serving {planned} rows "
                                 f"(fxrec.plan(quantize=...)), and transform "
                                 + (f"stores it {got}" if got else "does not quantize it")
                                 + ": give fxrec.plan and transform the same quantize=")
        if dt in ("int8", "int4", "int2") and kinds[id(r)] == "column_wise":
            raise InputError(f"fxrec: table '{r.table}' is planned column_wise and quantized {dt}, whose per-row "
                             "scale and bias need the whole row: plan it table_wise or row_wise, or quantize it "
                             "fp16 / fp32")
        if dt not in (None, "fp32", "fp16" if r.half else None) and kinds[id(r)] == "data_parallel":
            where = "table_wise" if r.half else "table_wise or row_wise"
            raise InputError(f"fxrec: table '{r.table}' is planned data_parallel, whose lookups stay the model's own "
                             f"({r.dtype.replace('torch.', '')}), and quantize= asks for {dt}: plan it {where}, or "
                             f"leave it as it is (quantize={{'{r.table}': '{'fp16' if r.half else 'fp32'}', ...}}: a "
                             "dict's first key naming a table decides)")


def _optimizer_text(gr: meta.GroupRecord, fused: str, half: bool, replicated) -> str:
    """Where the group's optimizer runs, as the report says it: fused into backward or in
    opt.step(), and the data-parallel tables (``replicated``) in opt.step() beside fused ones."""
    if gr.optimizer is None:
        return ""
    text = f"{gr.optimizer.describe()}: " + ("fused into backward" if fused else "torch.optim in opt.step()")
    if not fused and half:
        text += " (no kernel fuses an update of the model's fp16 tables as torch.optim rounds it)"
    dp = sorted(set(replicated))
    if fused and dp:
        text += f"; data-parallel tables {dp}: torch.optim in opt.step()"
    return text


def with_local(decision: meta.GroupDecision, gr: meta.GroupRecord, group, short: str, replicated) -> meta.GroupDecision:
    """The decision with what this rank's local lookups run on, and the optimizer's place (a group
    of data-parallel tables only, ``group`` None: torch.optim's)."""
    if group is None:
        return dataclasses.replace(decision, optimizer=_optimizer_text(gr, "", False, replicated))
    fused = group.fused.kind if group.fused is not None else ""
    return dataclasses.replace(decision, fused=fused, fused_by=group.kernel_train if fused else "",
                               optimizer=_optimizer_text(gr, fused, group.half, replicated),
                               why=f"{decision.why}; this rank's {short} lookups: one {group.kernel_train} call")


def fused_spec(gr: meta.GroupRecord, plan):
    """The group's fused optimizer, if its optimizer can be fused (a group has one). Optimizers
    whose update of a row reads the whole row are refused on column-wise tables, fused or not (a
    column shard sees only its columns): row-wise Adagrad and partial row-wise Adam and LAMB keep
    one state per row, the mean of the squared gradient over the row; LAMB and LARS-SGD scale
    each row by a ratio of norms over the row."""
    opt = gr.optimizer
    spec = opt.fused_spec() if opt is not None else None
    if spec is not None and spec.kind in WHOLE_ROW:
        cols = [r.table for r in gr.lookups if plan.tables[r.table].sharding == "column_wise"]
        if cols:
            name = {"rowwise_adagrad": "row-wise Adagrad", "partial_rowwise_adam": "partial row-wise Adam",
                    "partial_rowwise_lamb": "partial row-wise LAMB", "lamb": "LAMB", "lars_sgd": "LARS-SGD"}[spec.kind]
            what = ("whose per-row state averages over the whole row" if spec.kind in ROW_MEAN else
                    "whose trust ratio takes norms over the whole row")
            hint = ""
            if getattr(plan, "optimizer", None) == "none":  # planned as if for SGD
                hint = (" (the plan was made without optimizer=; given the optimizer transform gets, fxrec.plan "
                        "keeps such tables off column_wise and refuses a column_wise pin for them)")
            raise InputError(f"fxrec: tables {sorted(set(cols))} are planned column_wise and train with {name}, "
                             f"{what}, which no column shard holds; plan them table_wise or row_wise, or use "
                             f"another optimizer{hint}")
    return spec


def plan_decision(gr: meta.GroupRecord, plan, device: Optional[str] = None) -> meta.GroupDecision:
    """The group's decision under ``plan`` on ``device`` (default: its tables'), for fxrec.explain:
    without checking or rewriting; the optimizer fused where the rule table's kernels for that
    device fuse it (fbgemm's: on CUDA its Adam, LAMB and LARS-SGD too), as the ranks' local
    groups would."""
    from ..runtime.kernels.fbgemm import KERNEL

    d = decision_of(gr, [plan.tables[r.table].sharding if r.table in plan.tables else "data_parallel"
                       for r in gr.lookups], device)
    if gr.optimizer is None:
        return d
    spec = fused_spec(gr, plan)
    # the local group holds the sharded tables; data-parallel ones stay the model's (torch.optim),
    # and no kernel fuses an update of the model's own fp16 tables as torch.optim rounds it
    sharded = [r for r in gr.lookups if r.table in plan.tables and plan.tables[r.table].sharding != "data_parallel"]
    # (fbgemm's CUDA kernels take pieces up to CUDA_MAX_DIM wide: a wider one runs its local group on
    # PyTorch's lookups, which fuse only SGD there, torch.optim in opt.step() otherwise, as pick() decides)
    wide = d.device == "cuda" and any(pad_dim(max(sh.num_cols for sh in plan.tables[r.table].shards)) > CUDA_MAX_DIM
                                      for r in sharded)
    kinds = CUDA_WIDE_FUSED if wide else KERNEL.CUDA_OPTIMIZERS if d.device == "cuda" else KERNEL.CPU_OPTIMIZERS
    half = any(r.half for r in sharded)
    fused = spec.kind if spec is not None and sharded and not half and spec.kind in kinds else ""
    replicated = [r.table for r in gr.lookups if r not in sharded]
    return dataclasses.replace(d, fused=fused, optimizer=_optimizer_text(gr, fused, half, replicated))


def decision_of(gr: meta.GroupRecord, kinds, device: Optional[str] = None) -> meta.GroupDecision:
    """The group's decision under the plan: how each of its tables is sharded."""
    # data-parallel lookups stay the user's lookups (whole tables, gradients summed over ranks)
    sharded = sorted({k for k in kinds if k != "data_parallel"})
    kernel = "sharded: " + ", ".join(sorted(set(kinds)))
    device = device or gr.lookups[0].device.split(":")[0]
    return meta.GroupDecision(
        group=gr.name, pooling=gr.pooling, lookups=tuple(LookupEntry.of(r, gr.name) for r in gr.lookups),
        device=device, kernel_train=kernel, kernel_eval=kernel, decided_by="sharding plan",
        why="sharding plan: " + "; ".join(f"{r.table} {k}" for r, k in zip(gr.lookups, kinds)),
        dtypes=tuple(r.weights or r.dtype for r in gr.lookups), lowered=bool(sharded),
        placement="device" if device == "cuda" else "host",
    )


def refuse_apart(gm: fx.GraphModule, ctx: PassContext) -> None:
    """An InputError naming the tables fxrec leaves as written that would part on the ranks
    (annotate_lookups.apart_on_ranks): in training, those that train; frozen tables, tables no
    gradient reaches, and every table in inference keep one process's outputs and are taken,
    unless max_norm writes them in forward and the model also reads them outside their lookups."""
    records = meta.all_records(gm)
    params = dict(gm.named_parameters())
    trained = {r.param for r in records if r.grad and carries_gradient(r.output)
               and getattr(params.get(r.param), "requires_grad", True)}
    lookups = {}
    for r in records:
        lookups.setdefault(r.param, set()).add(r.node)
    operands = block_operands(gm)
    apart = {}
    for r in records:
        why = apart_on_ranks(r)
        if not why:
            continue
        if ctx.config.mode == "training" and r.param in trained:
            apart.setdefault(r.table, why)
        elif "max_norm" in why and isinstance(r.weight, fx.Node) and \
                read_unrenormalised(r.weight, lookups[r.param], operands):
            # (frozen, or in inference: the lookups give one process's outputs, a row being
            # renormalised before each read; the table itself differs on each rank)
            apart.setdefault(r.table, why + ", and the model reads the table outside the lookups that "
                             "renormalise it too, where each rank's copy differs from one process's")
    if apart:
        raise InputError("fxrec: with a plan, tables fxrec leaves as written are whole on every rank, their "
                         "gradients summed, and these would not give one process's results: "
                         + "; ".join(f"'{t}': {why}" for t, why in sorted(apart.items()))
                         + ". Run them without a plan, or without that option")


def refuse_unknown_tables(gm: fx.GraphModule, ctx: PassContext) -> None:
    """An InputError naming the tables the plan names and the model does not look up (a plan made
    for another model: its bytes and costs counted tables that are not there), or shards though
    fxrec leaves all their lookups as written (each rank then holds them whole)."""
    have = {r.table for r in meta.all_records(gm)}
    unknown = sorted(set(ctx.config.plan.tables) - have)
    if unknown:
        raise InputError(f"fxrec: the plan names table(s) {unknown} that the model does not look up (its tables: "
                         f"{sorted(have)}): make the plan for this model (fxrec.plan(model, ...))")
    records = meta.all_records(gm)
    lowered = {r.table for r in records if not r.reason}
    left = {r.table: r for r in records if r.reason and r.table not in lowered}
    for t in sorted(set(ctx.config.plan.tables) & set(left)):
        sharding = ctx.config.plan.tables[t].sharding
        if sharding != "data_parallel":  # (whole on every rank is what it stays: a plan so says the truth)
            raise InputError(f"fxrec: the plan shards table '{t}' {sharding}, but fxrec leaves its lookups as written "
                             f"(feature '{left[t].feature}': {left[t].reason}), so it stays whole on every rank and the "
                             "plan's bytes are not what each rank holds: make the plan from the model "
                             "(fxrec.plan(model, ...) leaves such tables out), or plan it data_parallel")


def refuse_outside_uses(gm: fx.GraphModule, gr, kinds: dict) -> None:
    """A table the plan shards (``kinds``: each lookup's sharding) must be read only by its group's
    lookups: else an InputError naming it (``fxrec.explain(plan=)`` refuses the same)."""
    mine = {r.node for r in gr.lookups}
    for r in gr.lookups:
        if kinds[id(r)] != "data_parallel" and any(u not in mine for u in r.weight.users):
            left = next((o for o in meta.all_records(gm) if o.param == r.param and o.reason == NO_GRADIENT), None)
            raise InputError(f"fxrec: table '{r.table}' is also used outside its lookups (tied weights, or a "
                             "lookup fxrec leaves alone); a sharded table is only looked up: plan it data_parallel"
                             + ("" if left is None else
                                f" (feature '{left.feature}' makes no gradient, and with optimizer= its lookup is "
                                "left as written; fxrec.plan(..., optimizer=) given the same optimizer plans the "
                                "table so)"))


def check_plan(gm: fx.GraphModule, ctx: PassContext) -> Dict[str, Dict[int, str]]:
    """Every refusal of ``ctx.config.plan`` for this model (an InputError naming the table), in one
    order for transform and ``fxrec.explain``; per group, each lookup's sharding (by ``id`` of its
    record)."""
    refuse_apart(gm, ctx)
    refuse_unknown_tables(gm, ctx)
    planned = {}
    for gr in ctx.groups:
        kinds = planned[gr.name] = {id(r): sharding_of(ctx, r) for r in gr.lookups}
        refuse_outside_uses(gm, gr, kinds)
        check_quantized(gr, kinds, ctx.config.plan, ctx.config.quantize is not None)
    return planned
