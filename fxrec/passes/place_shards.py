"""place_shards: with a sharding plan and ``hbm_budget=`` (GPU memory per rank), decide which of
this rank's table pieces live in GPU memory (HBM) and which in unified memory, by place_tables'
rule (:func:`fxrec.passes.place_tables.place`) over what the rank holds.

What is counted on a rank: its local groups (one TBE each, with one cache for its cached tables)
as place_tables counts a group: the tables, column shards and row blocks the plan gives it, at
their stored width, with their fused optimizer's states, or their dense gradients where training
has no fused optimizer; quantized pieces as fbgemm packs them for CUDA (they may move as
place_tables moves a quantized table: their packed rows in unified memory, cached in HBM, or not
where the budget is not met with the cache); and the data-parallel tables of its groups, whole on every rank (they stay: the model's
own lookups, with dense gradients in training). A piece may move where fbgemm's kernel alone
reads and writes it (place_tables' rule). Each rank decides for itself: where a piece lives
changes no collective.

The decision is made from the plan (:func:`planned`), so ``fxrec.explain(plan=, device="cuda",
hbm_budget=)`` gives every rank's without a process group, and transform on a rank gives the
same; the pass checks that the rank's built groups hold what the plan says, then sets each
local group's placements (on CUDA; elsewhere the tables are in host memory and nothing moves).
A quantized local group, packed by shard_groups before this pass, is packed again with its moved
pieces' rows in unified memory (their rows never pass through GPU memory again).

Before/After: the graph is unchanged; each local group module (the ``group`` of a
``fxrec_shard_*_lookup`` module) gets ``placements`` and ``cache_load_factor`` (a quantized one
its placements and rows laid out by them), and the decision on its input dist says where this
rank's pieces are.

A plan made with ``hbm_budget=`` (:mod:`fxrec.planner.unified`) places its shards by the same rule,
and transform takes its budget where it is given none.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

import torch.fx as fx

from .. import meta
from ..pass_infra import InputError, PassContext, PassError, PassResult, compiler_pass
from . import choose_kernels
from .place_tables import Held, _fmt, held_of_module, place, placement_text, quantized_held, quantized_widths
from .shard_groups import _local_group, module_name
from .shard_plan import fused_spec, sharding_of


def _pieces(gr: meta.GroupRecord, plan, rank: int, recs) -> Tuple[list, list]:
    """What ``rank`` holds of the sharded lookups ``recs`` of ``gr``, as shard_groups hands them to
    its local group: ``(record, rows, cols)`` per piece and each piece's local table."""
    pieces, table_of, local = [], [], []
    for r in recs:
        tp = plan.tables[r.table]
        mine = [sh for sh in tp.shards if sh.rank == rank]
        # a row block of no rows: a pooled group holds it (an empty table), a sequence group not
        if not mine or (gr.pooling == "none" and not mine[0].num_rows):
            continue
        sh = mine[0]  # (one column shard of a table a rank: shard_groups refuses two)
        if r.param not in local:
            local.append(r.param)
        table_of.append(local.index(r.param))
        rows = r.num_rows if tp.sharding in ("table_wise", "column_wise") else sh.num_rows
        pieces.append((r, rows, sh.num_cols if tp.sharding == "column_wise" else r.dim))
    return pieces, table_of


def planned(ctx: PassContext, rank: int) -> List[Tuple[meta.GroupRecord, object, List[Held], bool]]:
    """Per group: the local group module ``rank`` would build (None: it holds no piece, or the
    pieces are quantized, whose module packs rows), what the rule counts on that rank, from the
    plan alone, and whether the group runs on CUDA (only those are placed)."""
    plan, training = ctx.config.plan, ctx.config.mode == "training"
    out = []
    for gr in ctx.groups:
        kinds = {id(r): sharding_of(ctx, r) for r in gr.lookups}
        recs = [r for r in gr.lookups if kinds[id(r)] != "data_parallel"]
        held: List[Held] = []
        group = None
        pieces, table_of = _pieces(gr, plan, rank, recs)
        if pieces and gr.quant:
            first = {}
            for (r, rows, cols), t in zip(pieces, table_of):
                first.setdefault(t, (r, rows, cols))
            shapes = [first[t] for t in range(len(first))]
            widths = quantized_widths([(cols, gr.quant[r.param]) for r, _, cols in shapes], gr.pooling)
            held = [quantized_held(r.table, r.table, rows, w, gr.quant[r.param])
                    for (r, rows, _), w in zip(shapes, widths)]
        elif pieces:
            half = gr.lookups[0].half
            pooling = "none" if gr.pooling == "none" else gr.pooling if half else "sum"
            weighted = gr.pooling != "none" and any(r.weighted for r in recs)
            group = _local_group(ctx, pieces, table_of, pooling, weighted, fused_spec(gr, plan))
            held = held_of_module(group, training)
        seen = set()
        for r in gr.lookups:  # data-parallel: whole on every rank, the model's own lookups
            if kinds[id(r)] == "data_parallel" and r.table not in seen:
                seen.add(r.table)
                held.append(Held(r.table, r.table, r.num_rows, r.dim, 2 if r.half else 4, "",
                                 training and r.grad and not r.sparse))
        out.append((gr, group, held, choose_kernels.target_device(ctx, gr.lookups[0].device) == "cuda"))
    return out


def decide(ctx: PassContext, rank: int) -> Tuple[Dict[str, str], int, list]:
    """``(placements, HBM needed, planned(ctx, rank))`` for ``rank``; an InputError naming the
    rank where the budget cannot be met."""
    budget, lf = ctx.config.hbm_budget, ctx.config.cache_load_factor
    groups = planned(ctx, rank)
    placements, need = place([held for _, _, held, cuda in groups if cuda], budget, lf)
    if need > budget:
        raise InputError(
            f"fxrec: rank {rank}'s embedding tables need {_fmt(need)} of GPU memory (its pieces of the sharded "
            f"tables, with their fused optimizer's states or, training without one, their dense gradients, and its "
            f"data-parallel tables) with every piece that may leave it, and saves memory doing so, in unified "
            f"memory (cache_load_factor={lf}), more than hbm_budget={_fmt(budget)}: "
            + _advice(groups, ctx.config.mode == "training", ctx.config.plan))
    return placements, need, groups


def _advice(groups, training: bool, plan) -> str:
    """What may bring a rank's tables within the budget, from what it would build: fusing an
    optimizer only where a local group trains without one and could (not the model's fp16 tables,
    which train on PyTorch's lookups), sharding the data-parallel tables where training holds their
    dense gradients."""
    from ..runtime.group import EmbeddingGroup

    ways = ["raise the budget", "lower cache_load_factor"]
    built = [g for _, g, _, cuda in groups if cuda and isinstance(g, EmbeddingGroup)]
    if training and any(g.fused is None and not g.half for g in built):
        ways.append("fuse the optimizer (optimizer=)")
    whole = sorted({r.table for gr, _, _, cuda in groups if cuda for r in gr.lookups
                    if plan.tables[r.table].sharding == "data_parallel"})
    if whole:
        ways.append(f"shard the data-parallel tables {whole}")
    ways.append("or shard the tables over more GPUs")
    return ", ".join(ways)


def rank_text(placements: Dict[str, str], held: List[Held], load_factor: float) -> str:
    """Where a group's pieces on a rank are, as the report says it ("device" where the rank holds
    none)."""
    names = [(t.key, t.name) for t in held]
    return placement_text(names, placements, load_factor) if names else "device"


def _place_quantized(group, placements: Dict[str, str], load_factor: float) -> None:
    """A rank's quantized local group (packed by shard_groups with every piece in GPU memory)
    with its moved pieces' rows in unified memory: packed again, straight from where the rows
    are, as ``.to()`` packs them (and its cache made, for pieces placed ``managed_caching``)."""
    tables = [dataclasses.replace(t, placement=placements.get(t.name, "device")) for t in group.tables]
    if tables == list(group.tables):
        return
    group.tables = tables
    group.cache_load_factor = load_factor
    group.q_where = tuple(t.placement for t in tables)
    group._pack_for(group.q_weights.device)


@compiler_pass(needs=("groups", "sharded"), provides=("placements",))
def place_shards(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    rank, lf = ctx.config.rank, ctx.config.cache_load_factor
    placements, need, groups = decide(ctx, rank)
    moved = 0
    for gr, expected, held, cuda in groups:
        lookup = getattr(gm, f"{module_name(gr)}_lookup", None)
        group = getattr(lookup, "group", None)
        if gr.quant and cuda and group is not None:
            _place_quantized(group, placements, lf)
            moved += sum(t.name in placements for t in group.tables)
        elif expected is not None:
            built = (group.tables, group.kernel_train, group.kernel_eval, group.fused) if group is not None else None
            if built != (expected.tables, expected.kernel_train, expected.kernel_eval, expected.fused):
                raise PassError(f"place_shards: rank {rank}'s local group of {gr.name} is not what the plan gives it "
                                f"(built {built}, planned {expected.tables}): a bug in fxrec")
            if not cuda:  # (host memory: nothing to place)
                continue
            group.tables = [dataclasses.replace(t, placement=placements.get(t.name, "device")) for t in group.tables]
            group.cache_load_factor = lf
            moved += sum(t.name in placements for t in group.tables)
        if cuda:  # (the input dist's decision, and its data-parallel lookups')
            text = rank_text(placements, held, lf)
            for n in gm.graph.nodes:
                d = n.meta.get(meta.DECISION)
                if d is not None and d.group == gr.name:
                    n.meta[meta.DECISION] = dataclasses.replace(d, placement=text)
    if not any(cuda for *_, cuda in groups):
        return PassResult(gm, False, {})
    return PassResult(gm, False, {"hbm_budget": _fmt(ctx.config.hbm_budget), "tables_hbm": _fmt(need),
                                  "tables_hbm_bytes": need, "tables_in_unified_memory": moved})
