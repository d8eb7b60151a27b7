"""shard_groups: rewrite each group for one rank of a sharding plan, with visible collectives.

Runs instead of choose_kernels / lower_groups when ``transform(..., plan=...)`` is given, inside
an initialised torch.distributed process group. For rank r:

* pooled lookups of table-wise, column-wise, row-wise and table-row-wise tables: one
  ``input_dist -> lookup -> output_dist`` set per group (PooledInputDist, PooledLookup,
  PooledOutputDist), each collective being a wait for every rank. Each lookup is one piece per
  column shard (table-wise: one; column-wise: one per shard, each a table on its rank, under the
  table's own name) or one piece of row blocks (row-wise: from rank 0; table-row-wise: over one
  host's ranks; rank r's parameter becomes its block of rows, under the table's own name), and
  every id goes to the rank of its row's block, a table-wise table or column shard being one
  block of the whole table on its rank (bucketize + all-to-all; an all-to-all back that adds a
  row-wise piece's partial sums); tables a rank holds nothing of leave its model;
* unpooled (sequence) groups: the same for table-wise, row-wise and table-row-wise tables
  (SequenceInputDist, ...): each id goes to the rank of its row's block, its row comes back to its
  place (all-to-all both ways); column-wise is refused for them;
* each rank's local lookups (its tables, column shards and row blocks; sequence rows) are one
  call of a group module (:class:`~fxrec.runtime.group.EmbeddingGroup`) on the kernel the rule
  table gives, with the group's fused optimizer applied inside backward to the rows the rank
  holds (row-wise Adagrad is refused on column-wise tables: its per-row state needs the whole
  row);
* data-parallel: the lookups stay as the user wrote them; the table is whole on every rank and
  its gradient is summed over ranks (as every parameter outside the sharded tables is; see
  fxrec.ranks).

Before (gm.code)::

    embedding_bag = torch.ops.aten.embedding_bag.padding_idx(emb_0_weight, ids_0, offsets_0, ...)
    getitem = embedding_bag[0]
    embedding_bag_1 = torch.ops.aten.embedding_bag.padding_idx(emb_1_weight, ids_1, offsets_1, ...)
    getitem_3 = embedding_bag_1[0]
    cat = torch.ops.aten.cat.default([getitem, getitem_3], 1)

After, on rank 0 of a plan with emb.0 table-wise on rank 1 and emb.1 row-wise::

    fxrec_shard_group_0_input_dist = self.fxrec_shard_group_0_input_dist([ids_0, ids_1], [offsets_0, offsets_1], [None, None])
    fxrec_shard_group_0_lookup = self.fxrec_shard_group_0_lookup(fxrec_shard_group_0_input_dist, [emb_1_weight])
    fxrec_shard_group_0_output_dist = self.fxrec_shard_group_0_output_dist(fxrec_shard_group_0_lookup, ...)
    getitem = fxrec_shard_group_0_output_dist[0]
    getitem_1 = fxrec_shard_group_0_output_dist[1]
    cat = torch.ops.aten.cat.default([getitem, getitem_1], 1)

Each output dist gives one tensor per lookup (not column slices of one: the backward of k slices
of a ``[B, k * D]`` tensor would make k zero tensors of its whole size).

Table-row-wise tables: the ranks of other hosts hold none of the table's rows and take no part in
its sums; the hierarchical exchange inside a host first is not done.

Not handled (InputError naming the table): two column shards of one table on one rank, unpooled
lookups of a column-wise table, bags with ``padding_idx`` or ``include_last_offset``, tables the
plan does not name, and tables it names that the model does not look up.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.fx as fx

from .. import meta
from ..dataflow import SideEffects
from ..group_module import call_anchor, drop_dtype_asserts_after, hand_outputs
from ..pass_infra import PassContext, PassResult, compiler_pass
from ..runtime.input_guards import GUARDS_NAME
from ..runtime.group import EmbeddingGroup
from ..runtime.kernels import REFERENCE
from ..runtime.quantized import QuantizedPooledGroup, QuantizedSequenceGroup
from ..runtime.sharded import PooledInputDist, PooledLookup, PooledOutputDist
from ..runtime.sharded_sequence import SequenceInputDist, SequenceLookup, SequenceOutputDist
from ..runtime.specs import FeatureSpec, GroupSpec, TableSpec, weights_dtype
from . import choose_kernels
from .choose_kernels import check_stored, kernel_order, pass_over_frozen, pick
from .shard_plan import check_plan, decision_of, fused_spec, plan_decision, with_local


def _out_dtype(ctx: PassContext, gr: meta.GroupRecord) -> torch.dtype:
    """The dtype of the rows a group's lookups give (every rank must send the same): fp16 for the
    model's fp16 tables, as their lookups give."""
    if gr.lookups and gr.lookups[0].half:
        return torch.float16
    return torch.float16 if gr.quant and ctx.config.output_dtype == "fp16" else torch.float32


def _give_fp16(graph: fx.Graph, r: meta.LookupRecord) -> None:
    """``output_dtype="fp16"``: a data-parallel lookup, which stays the model's own fp32 lookup,
    gives its users its output rounded to fp16, as one process's quantized group gives them
    (fbgemm's lookup pools in fp32 and rounds once, at the end: so does this)."""
    out = r.output
    with graph.inserting_after(out):
        half = graph.call_function(torch.ops.aten._to_copy.default, (out,), {"dtype": torch.float16})
    half.meta[meta.ORIGIN] = [out.name]
    if "val" in out.meta:
        half.meta["val"] = out.meta["val"].to(torch.float16)
    out.replace_all_uses_with(half, delete_user_cb=lambda u: u is not half)
    drop_dtype_asserts_after(half)


def _local_group(ctx: PassContext, pieces, table_of, pooling: str, weighted: bool, fused=None,
                 gm: fx.GraphModule = None, quant: dict = None, output: str = "") -> EmbeddingGroup:
    """The group module of what one rank looks up locally: ``pieces`` are ``(lookup record, rows,
    dim)`` as this rank holds them (a shard's rows and columns), one feature each, ``table_of``
    each piece's index into the rank's local tables. Its kernels by the rule table (the same on
    every rank: they do not change the collectives); ``fused`` (a FusedSpec) is applied inside
    backward to the rows this rank holds, by the first kernel of the rule that fuses it (None:
    no kernel does, and the tables' optimizer runs unfused in ``opt.step()``). ``output``: a
    quantized group's output dtype ("fp32", "fp16"; "": ``transform``'s)."""
    tables, features = {}, []
    for (r, rows, dim), t in zip(pieces, table_of):
        tables.setdefault(t, TableSpec(r.table, int(rows), int(dim), sparse=r.sparse, dtype=r.dtype, weights=r.weights))
        # (the model's fp16 tables, trained: the owner runs its lookups as the model wrote them, their
        # ids sent flat, so that forward and backward round as the model's do; other pieces, and
        # quantized ones, are bags)
        own = r.half and not quant and r.form in ("pooled_seq", "single")
        form = "seq" if pooling == "none" else r.form if own else "bag"
        features.append(FeatureSpec(r.feature, t, form, weighted=weighted))
    specs = [tables[t] for t in range(len(tables))]
    if quant:  # inference on quantized tables: fbgemm's IntNBit TBE of this rank's pieces
        first = {t: r for (r, _, _), t in zip(pieces, table_of)}
        qcls = QuantizedSequenceGroup if pooling == "none" else QuantizedPooledGroup
        return qcls(specs, features, pooling, [quant[first[t].param] for t in range(len(specs))],
                    [gm.get_parameter(first[t].param).detach() for t in range(len(specs))],
                    output or ctx.config.output_dtype, ctx.config.cache_load_factor)
    device = choose_kernels.target_device(ctx, pieces[0][0].device)
    spec = GroupSpec(tuple(specs), tuple(features), pooling)
    frozen = [r.table for r, _, _ in pieces if r.frozen]
    chosen = []
    for mode in ("training", "inference"):
        kind = fused.kind if fused is not None and mode == "training" else None
        order, over_frozen = pass_over_frozen(kernel_order(device, mode, ctx.config.backend, kind), kind, frozen,
                                    [r.table for r, _, _ in pieces], weighted, ctx.config.backend)
        if any(f.form == "pooled_seq" for f in features):  # (ids sent flat: only PyTorch's lookups take them)
            order = (REFERENCE,)
        k, passed = pick(spec, device, mode, kind, order, True, fused.options if kind is not None else ())
        passed = over_frozen + passed  # (a refusal below says why fbgemm was passed over)
        if k is None and kind is not None:
            if spec.weights:  # stored lower: only fbgemm's TBE, with its fused update, holds the shards
                check_stored(spec, "", k, passed)
            fused = None  # no kernel fuses it here: torch.optim on the shards in opt.step()
            k, passed = pick(spec, device, mode, None, kernel_order(device, mode, ctx.config.backend), True)
            passed = over_frozen + passed
        if spec.weights:
            check_stored(spec, "", k, passed)
        chosen.append(k or REFERENCE)
    return EmbeddingGroup(specs, features, pooling, *chosen, fused=fused)


#: gm.meta key: ``(CUDA device, tables)`` where this rank holds pieces in host memory during
#: transform that go to unified memory (:func:`_host_staged`); ``fxrec.api`` binds them.
STAGED = "fxrec_host_staged"


def _host_staged(ctx: PassContext) -> Optional[Tuple[str, Tuple[str, ...]]]:
    """The tables whose pieces this rank allocates in host memory, not GPU memory: on CUDA with
    ``hbm_budget=``, every piece of each local group that place_shards gives unified memory
    (decided from the plan alone, :func:`fxrec.passes.place_shards.decide`; all of the group's
    pieces, which its one TBE binds together). Once ``materialize`` has filled them, ``fxrec.api``
    binds each such group on the GPU (``EmbeddingGroup.bind_on``): the rows go from host memory
    straight to where they are placed, so a rank's pieces in unified memory never pass through
    GPU memory (allocated on the GPU first, a rank needed GPU memory for all its pieces at once,
    the budget notwithstanding). Quantized pieces are packed as before (place_shards moves their
    packed rows). ``(the groups' CUDA device, the tables)``; None elsewhere (CPU, no budget,
    ``explain``'s decisions for a device), and with ``check_passes=True``, whose checks run the
    model between the passes, before the binding (the pieces are then allocated on the GPU)."""
    if not ctx.config.hbm_budget or ctx.config.device is not None or ctx.config.plan is None \
            or ctx.config.check_numerics \
            or not any(choose_kernels.target_device(ctx, gr.lookups[0].device) == "cuda" for gr in ctx.groups):
        return None
    from .place_shards import decide

    placements, _, groups = decide(ctx, ctx.config.rank)
    moved = [gr for gr, group, _, cuda in groups
             if cuda and group is not None and any(t.name in placements for t in group.tables)]
    if not moved:
        return None
    return moved[0].lookups[0].device, tuple(sorted({r.table for gr in moved for r in gr.lookups}))


def _piece_device(gm: fx.GraphModule, r: meta.LookupRecord, full: torch.Tensor) -> torch.device:
    """Where this rank allocates its piece of ``r``'s table: host memory for the tables
    :func:`_host_staged` names, else where the table's placeholder is."""
    staged = gm.meta.get(STAGED)
    return torch.device("cpu") if staged is not None and r.table in staged[1] else full.device


def _hold_rows(gm: fx.GraphModule, r: meta.LookupRecord, tp, rank: int, sharded_params: dict) -> int:
    """Make a row-wise (or table-row-wise) table's parameter this rank's block of rows (none, for
    a table-row-wise table of another host), under the table's own name; its number of rows."""
    sh = {s.rank: s for s in tp.shards}.get(rank)
    lo, n = (sh.row_offset, sh.num_rows) if sh is not None else (0, 0)
    if r.param not in sharded_params:
        full = gm.get_parameter(r.param)
        block = full.detach()[lo:lo + n].to(_piece_device(gm, r, full), _stored_dtype(r, full), copy=True)
        _set_param(gm, r.param, torch.nn.Parameter(block, requires_grad=full.requires_grad))
    return n


def _stored_dtype(r: meta.LookupRecord, param: torch.Tensor) -> torch.dtype:
    """The dtype a shard of ``r``'s table is made in on this rank: the precision
    ``weights_precision=`` stores it in (so its rows never exist in fp32 here), else its own."""
    return weights_dtype(r.weights) or param.dtype


def _own_whole(gm: fx.GraphModule, r: meta.LookupRecord) -> None:
    """A table this rank holds whole (table-wise), stored at a lower precision or staged in host
    memory (:func:`_host_staged`): its placeholder (filled by ``materialize``) takes that dtype and
    device, so the table is allocated only so."""
    full = gm.get_parameter(r.param)
    dtype, device = _stored_dtype(r, full), _piece_device(gm, r, full)
    if full.dtype != dtype or full.device != device:
        value = full.detach().to(device, dtype) if 0 not in full.stride() else \
            torch.zeros((), dtype=dtype, device=device).expand(full.shape)  # (a placeholder stays one)
        _set_param(gm, r.param, torch.nn.Parameter(value, requires_grad=full.requires_grad))


def _sequence_modules(ctx: PassContext, gm: fx.GraphModule, gr: meta.GroupRecord, recs, name: str,
                      sharded_params: dict):
    """The modules of an unpooled group's sharded lookups, and the weights this rank looks up.
    Table-wise, row-wise and table-row-wise tables all take one rule (SequenceInputDist): ids go
    to the rank of their row's block, a table-wise table being one block on its owner."""
    plan, rank = ctx.config.plan, ctx.config.rank
    world = plan.topology.world_size
    blocks, bases, local, held, pieces = [], [], [], [], []
    for i, r in enumerate(recs):
        tp = plan.tables[r.table]
        if tp.sharding == "table_wise":
            blocks.append(r.num_rows)
            bases.append(tp.shards[0].rank)
            n = r.num_rows if tp.shards[0].rank == rank else 0
            if n and r.param not in sharded_params:
                _own_whole(gm, r)
        else:
            blocks.append(max(1, min(tp.shards, key=lambda x: x.rank).num_rows))
            bases.append(min(sh.rank for sh in tp.shards))
            n = _hold_rows(gm, r, tp, rank, sharded_params)
        sharded_params[r.param] = tp.sharding
        if n:
            if r.weight not in local:
                local.append(r.weight)
            held.append(i)
            pieces.append((r, n, r.dim))
    table_of = [local.index(recs[i].weight) for i in held]
    fused = fused_spec(gr, plan)  # (on every rank, as for pooled groups)
    # (quantized: rows of the dtype SequenceLookup hands on, fp16 for the model's fp16 tables, on every rank)
    group = _local_group(ctx, pieces, table_of, "none", False, fused, gm, gr.quant,
                         "fp16" if gr.lookups[0].half else "") if held else None
    mods = (SequenceInputDist(f"{name}_input_dist", blocks, bases, rank, world, [r.feature for r in recs],
                              [r.num_rows for r in recs], [r.table for r in recs]),
            SequenceLookup(group, held, [r.dim for r in recs], _out_dtype(ctx, gr)),
            SequenceOutputDist(f"{name}_output_dist", [r.dim for r in recs], rank, world))
    return mods, local


def _pooled_modules(ctx: PassContext, gm: fx.GraphModule, gr: meta.GroupRecord, recs, name: str,
                    sharded_params: dict):
    """The modules of a pooled group's sharded lookups, the weights this rank looks up, and the
    input dist's arguments. One rule for every sharding type (PooledInputDist): each lookup is one
    piece per shard of columns (table-wise: one; column-wise: one per column shard, each a block
    of the whole table on its rank) or one piece of row blocks (row-wise, table-row-wise), and
    ids go to the rank of their row's block."""
    plan, rank = ctx.config.plan, ctx.config.rank
    world = plan.topology.world_size
    pieces = []  # (record, rows per block, first block's rank, ranks holding it, its dim)
    per_lookup = []
    for r in recs:
        tp = plan.tables[r.table]
        if tp.sharding in ("table_wise", "column_wise"):
            shards = sorted(tp.shards, key=lambda x: x.col_offset)
            pieces += [(r, r.num_rows, sh.rank, [sh.rank], sh.num_cols) for sh in shards]
            per_lookup.append(len(shards))
        else:  # row-wise, table-row-wise
            first = min(tp.shards, key=lambda x: x.rank)
            pieces.append((r, max(1, first.num_rows), first.rank, sorted({sh.rank for sh in tp.shards}), r.dim))
            per_lookup.append(1)
    local, table_of, shapes, held = [], [], [], []  # this rank's tables; its pieces' tables, shapes, places
    for p, (r, _, _, holders, cols) in enumerate(pieces):
        tp = plan.tables[r.table]
        if tp.sharding in ("row_wise", "table_row_wise"):
            n = _hold_rows(gm, r, tp, rank, sharded_params)  # (none, on another host's rank)
        elif rank not in holders:
            n = 0
        elif tp.sharding == "table_wise":
            n = r.num_rows
            _own_whole(gm, r)
        else:  # this rank's column shard, under the table's own name
            n = r.num_rows
            if r.param not in sharded_params:
                full = gm.get_parameter(r.param)
                sh = next(sh for sh in tp.shards if sh.rank == rank)
                part = full.detach()[:, sh.col_offset:sh.col_offset + sh.num_cols].to(
                    _piece_device(gm, r, full), _stored_dtype(r, full), copy=True)
                _set_param(gm, r.param, torch.nn.Parameter(part, requires_grad=full.requires_grad))
        if tp.sharding != "column_wise" or rank in holders:  # (a column shard is cut once, on its rank)
            sharded_params[r.param] = tp.sharding
        if rank in holders:
            if r.weight not in local:
                local.append(r.weight)
            table_of.append(local.index(r.weight))
            shapes.append((r, n, cols))
            held.append(p)
    for r in recs:
        sharded_params[r.param] = plan.tables[r.table].sharding
    weighted = any(r.weighted for r in recs)
    # sums only: a mean is the sum over the bag's ids, which may lie on several ranks, divided by
    # its length after the output dist. Quantized groups serving fp16: sums that are added or
    # divided travel in fp32 and are rounded once, at the end (an fp16 sum can overflow where the
    # mean does not, and adding rounded partial sums rounds twice). The model's fp16 tables are
    # whole on one rank (HALF_SHARDINGS): each bag is pooled there by PyTorch's own fp16 lookup,
    # mean included, and its rows travel as that lookup rounded them (forward and backward the
    # model's own arithmetic).
    out_dtype = _out_dtype(ctx, gr)
    half = gr.lookups[0].half
    summed = gr.pooling == "mean" or any(len(holders) > 1 for *_, holders, _ in pieces)
    sent = torch.float32 if summed and not half else out_dtype
    pooled_here = gr.pooling if half else "sum"
    fused = fused_spec(gr, plan)  # (on every rank: a refusal must stop every rank, also one holding nothing)
    # (quantized: rows of the dtype the output dist sends, on every rank, a rank holding nothing too)
    group = _local_group(ctx, shapes, table_of, pooled_here, weighted, fused, gm, gr.quant,
                         "fp32" if sent == torch.float32 else "fp16" if half else "") if held else None
    mods = (PooledInputDist(f"{name}_input_dist", [r.form for r, *_ in pieces], [b for _, b, *_ in pieces],
                            [base for _, _, base, *_ in pieces], weighted, rank, world, [r.feature for r, *_ in pieces],
                            [r.num_rows for r, *_ in pieces], torch.float16 if half else torch.float32,
                            [r.table for r, *_ in pieces]),
            PooledLookup(group, world, held),
            PooledOutputDist(f"{name}_output_dist", [c for *_, c in pieces], [h for *_, h, _ in pieces], rank, world,
                             per_lookup, "sum" if pooled_here == "mean" else gr.pooling, sent, out_dtype))
    args = ([r.ids for r, *_ in pieces], [r.offsets for r, *_ in pieces], [r.per_sample_weights for r, *_ in pieces])
    return mods, local, args


def module_name(gr: meta.GroupRecord) -> str:
    """The prefix of the modules shard_groups gives a group (``_input_dist``, ``_lookup``, ``_output_dist``)."""
    return f"fxrec_shard_{gr.name}"


#: the meta key of a transform's parameters with more than one name (a tied weight, a module held
#: twice): fqn -> every name of that parameter, set by shard_groups for its own use
_ALIASES = "fxrec_param_aliases"


def _aliases(gm: fx.GraphModule) -> dict:
    names: dict = {}
    for n, p in gm.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return {n: tuple(ns) for ns in names.values() if len(ns) > 1 for n in ns}


def _set_param(gm: fx.GraphModule, fqn: str, value) -> None:
    """``value`` as the parameter ``fqn`` under each of its names (a shard of a tied table is the
    table under both: the other name kept the whole table, untrained, in state_dict)."""
    for name in gm.meta.get(_ALIASES, {}).get(fqn, (fqn,)):
        owner, _, attr = name.rpartition(".")
        mod = gm.get_submodule(owner) if owner else gm
        if value is None:
            delattr(mod, attr)
        else:
            setattr(mod, attr, value)


@compiler_pass(needs=("groups",), provides=(meta.ORIGIN, "sharded"))
def shard_groups(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    plan, rank = ctx.config.plan, ctx.config.rank
    graph = gm.graph
    stats = {"table_wise": 0, "column_wise": 0, "row_wise": 0, "table_row_wise": 0, "data_parallel": 0}
    sharded_params = {}  # fqn -> sharding, for the gradient hooks and the report
    effects = SideEffects(list(graph.nodes))
    planned = check_plan(gm, ctx)
    gm.meta[_ALIASES] = _aliases(gm)
    staged = _host_staged(ctx)
    if staged is not None:
        gm.meta[STAGED] = staged
    for gr in ctx.groups:
        kinds = planned[gr.name]
        decision = decision_of(gr, [kinds[id(r)] for r in gr.lookups])
        replicated = [r.table for r in gr.lookups if kinds[id(r)] == "data_parallel"]
        for r in gr.lookups:
            # (stays on data-parallel lookups, which are not rewritten; with this rank's local group's
            # kernel and optimizer once it is built, below)
            r.node.meta[meta.DECISION] = with_local(decision, gr, None, "", replicated)
            stats[kinds[id(r)]] = stats.get(kinds[id(r)], 0) + 1
        anchor = call_anchor(graph, gr.lookups, effects)
        recs = [r for r in gr.lookups if kinds[id(r)] != "data_parallel"]
        if recs:
            name = module_name(gr)
            if gr.pooling == "none":
                mods, local = _sequence_modules(ctx, gm, gr, recs, name, sharded_params)
                args = ([r.ids for r in recs], [r.offsets for r in recs], [r.per_sample_weights for r in recs])
            else:
                mods, local, args = _pooled_modules(ctx, gm, gr, recs, name, sharded_params)
            for suffix, mod in zip(("input_dist", "lookup", "output_dist"), mods):
                gm.add_submodule(f"{name}_{suffix}", mod)
            with graph.inserting_before(anchor):
                din = graph.call_module(f"{name}_input_dist", args)
                look = graph.call_module(f"{name}_lookup", (din, [] if gr.quant else local))  # quantized: no fp32
                out = graph.call_module(f"{name}_output_dist", (look, din))
                for n in (din, look, out):
                    n.meta[meta.ORIGIN] = [r.node.name for r in recs]
                # (a rank holding none of the group's shards says what the ranks holding them do)
                here = with_local(decision, gr, mods[1].group, "sequence" if gr.pooling == "none" else "pooled",
                                   replicated) if mods[1].group is not None else plan_decision(gr, ctx.config.plan)
                din.meta[meta.DECISION] = here
                for r in gr.lookups:
                    if kinds[id(r)] == "data_parallel":
                        r.node.meta[meta.DECISION] = here
                # one output per lookup (not column slices of one tensor: the backward of k slices
                # of a [B, k * D] tensor makes k zero tensors of its whole size)
                hand_outputs(graph, out, recs, pooled=False, written=effects.written)
            if gr.quant and _out_dtype(ctx, gr) == torch.float16:
                drop_dtype_asserts_after(out)
            for r in recs:
                for n in r.nodes:
                    graph.erase_node(n)
        if gr.quant and _out_dtype(ctx, gr) == torch.float16:
            for r in gr.lookups:
                if kinds[id(r)] == "data_parallel" and r.param in gr.quant and not r.half:
                    _give_fp16(graph, r)
    # tables this rank does not hold leave the model (a table-row-wise table's, on another host's
    # rank; quantized: the fp32 tables of every shard)
    removed = 0
    for n in list(graph.nodes):
        kind = sharded_params.get(n.target)
        if n.op == "get_attr" and kind and not n.users:
            graph.erase_node(n)
            if not any(m.op == "get_attr" and m.target == n.target for m in graph.nodes):
                _set_param(gm, n.target, None)
                removed += 1
    aliases = gm.meta.pop(_ALIASES)
    for fqn, kind in list(sharded_params.items()):  # (every name of a tied table is that table's shard)
        sharded_params.update({a: kind for a in aliases.get(fqn, ())})
    gm.meta["fxrec_sharded_params"] = sharded_params
    # What each planned table's parameter holds on this rank, for checkpoints: fqn -> (global
    # shape, [(row_offset, num_rows, col_offset, num_cols, local_col_offset)]); [] = not held here.
    layout = {}
    for gr in ctx.groups:
        for r in gr.lookups:
            tp = plan.tables[r.table]
            pieces = [(0, r.num_rows, 0, r.dim, 0)]
            if tp.sharding == "table_wise":
                pieces = pieces if tp.shards[0].rank == rank else []
            elif tp.sharding == "column_wise":
                pieces = [(0, r.num_rows, sh.col_offset, sh.num_cols, 0) for sh in tp.shards if sh.rank == rank]
            elif tp.sharding in ("row_wise", "table_row_wise"):
                pieces = [(sh.row_offset, sh.num_rows, 0, r.dim, 0) for sh in tp.shards if sh.rank == rank]
            for name in aliases.get(r.param, (r.param,)):
                layout[name] = ((r.num_rows, r.dim), pieces)
    gm.meta["fxrec_shard_layout"] = layout
    stats["tables_not_on_this_rank"] = removed
    _guards_join_the_first_exchange(gm, rank)
    return PassResult(gm, True, stats)


def _guards_join_the_first_exchange(gm: fx.GraphModule, rank: int) -> None:
    """The model's input guards raise on the rank fed the wrong sizes, before any collective: in a
    sharded model they are told the step's first exchange (the first input dist in graph order),
    which that rank joins with its flag set, so that every rank stops there."""
    guards = getattr(gm, GUARDS_NAME, None)
    if guards is None or not hasattr(guards, "first_exchange"):
        return
    first = next((n for n in gm.graph.nodes if n.op == "call_module"
                  and isinstance(gm.get_submodule(n.target), (PooledInputDist, SequenceInputDist))), None)
    if first is not None:
        dist_module = gm.get_submodule(first.target)
        guards.first_exchange = (dist_module.name, *dist_module.exchange_shape(), rank)
