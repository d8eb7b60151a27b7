"""group_lookups: put lookups that can share one fbgemm TBE into groups.

A pure key function decides what may share a TBE (:func:`group_key`); a greedy walk in graph
order then adds each lookup to the first open group of its key that it can join:

* it must not depend on the output of any lookup already in the group (networkx reachability
  on the graph's data-flow edges), and
* the group must keep a place to stand: after every input of every member and before the first
  user of any member's output.

Within a group, the lookups of one table are next to each other (:func:`_tables_adjacent`):
fbgemm's kernels need every table's features adjacent in ``feature_table_map`` (its CPU backward
and nobag forward read wrong rows otherwise, and fused Adagrad updates go wrong silently), as
TorchRec lays them out. The group's output columns follow that order; a concatenation that
listed a table's features apart gets their slices back in its own order.

Each table (weight parameter) belongs to one group only, because its storage becomes part of
that group's TBE; a lookup of a table already owned by a group of another key is left as it
was, with the reason. (One-id lookups of a table that is also looked up unpooled are made
unpooled first, so the usual history + candidate sharing stays in one group.)

Before: lookups annotated by annotate_lookups. After: the graph is unchanged;
``ctx.groups`` holds GroupRecords and each member node carries ``meta["fxrec_group"]``. Members
are ordered as the first ``torch.cat`` that consumes them lists them (then made table-adjacent),
so the group's output can usually replace that cat's arguments without reordering.

Not handled: lookups whose record has a reason (left alone).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Set, Tuple

import networkx as nx
import torch
import torch.fx as fx

from .. import meta
from ..pass_infra import PassContext, PassResult, compiler_pass


def group_key(rec: meta.LookupRecord) -> tuple:
    """What must be equal for two lookups to share one TBE.

    pooling (one TBE pools one way), weighted or not, dtype and device (one weight buffer),
    sparse gradient or not (one gradient layout), for unpooled lookups the dim (fbgemm's
    sequence TBE has one dim for all its tables), and the optimizer (one TBE runs one).
    """
    return (
        rec.pooling,
        rec.weighted,
        rec.dtype,
        rec.device,
        rec.sparse,
        rec.dim if rec.pooling == "none" else None,
        rec.optimizer,
    )


def build_dataflow(gm: fx.GraphModule) -> nx.DiGraph:
    g = nx.DiGraph()
    for n in gm.graph.nodes:
        g.add_node(n)
        for u in n.users:
            g.add_edge(n, u)
    return g


def _inputs(rec: meta.LookupRecord) -> List[fx.Node]:
    return [x for x in (rec.weight, rec.ids, rec.offsets, rec.per_sample_weights) if isinstance(x, fx.Node)]


class _Open:
    def __init__(self, rec_pos: Dict[fx.Node, int]):
        self.members: List[meta.LookupRecord] = []
        self.last_input = -1  # latest position of any member's input
        self.first_use = 1 << 60  # earliest position of any user of any member's output
        self.pos = rec_pos


@compiler_pass(needs=(meta.LOOKUP,), provides=(meta.GROUP, "groups"))
def group_lookups(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    flow = build_dataflow(gm)
    _single_ids_join_sequences(gm)
    open_groups: Dict[tuple, List[_Open]] = {}
    owner: Dict[str, tuple] = {}  # table param -> key of the group that owns it
    n_split = 0
    for node in gm.graph.nodes:
        rec: Optional[meta.LookupRecord] = node.meta.get(meta.LOOKUP)
        if rec is None or not rec.lowerable:
            continue
        key = group_key(rec)
        if rec.param in owner and owner[rec.param] != key:
            rec = dataclasses.replace(
                rec,
                reason=f"table '{rec.table}' is already batched with lookups of another kind "
                f"(pooling/weights/sparsity differ: {owner[rec.param]} vs {key})",
            )
            node.meta[meta.LOOKUP] = rec
            ctx.logger.debug("%s not grouped: %s", rec.feature, rec.reason)
            continue
        owner[rec.param] = key
        ancestors: Optional[Set[fx.Node]] = None
        last_in = max(pos[x] for x in _inputs(rec))
        first_use = min((pos[u] for u in rec.output.users), default=1 << 60)
        placed = False
        for og in open_groups.setdefault(key, []):
            if max(og.last_input, last_in) >= min(og.first_use, first_use):
                continue
            if ancestors is None:
                ancestors = nx.ancestors(flow, node)
            if any(m.output in ancestors or m.node in ancestors for m in og.members):
                ctx.logger.debug("%s not grouped with %s: depends on its output", rec.feature, og.members[0].feature)
                continue
            # A table shared by two features must live in the group that owns it.
            og.members.append(rec)
            og.last_input = max(og.last_input, last_in)
            og.first_use = min(og.first_use, first_use)
            placed = True
            break
        if not placed:
            if open_groups[key]:
                n_split += 1
            og = _Open(pos)
            og.members.append(rec)
            og.last_input, og.first_use = last_in, first_use
            open_groups[key].append(og)

    # A table must sit in exactly one group: move later lookups of a table into its first group
    # when they can stand there, else leave them as they were.
    groups: List[meta.GroupRecord] = []
    table_group: Dict[str, meta.GroupRecord] = {}
    for key, ogs in open_groups.items():
        for og in ogs:
            members = []
            for rec in og.members:
                g = table_group.get(rec.param)
                if g is not None:
                    rec = dataclasses.replace(
                        rec, reason=f"table '{rec.table}' is batched in {g.name}, and this lookup "
                        "cannot be placed with it (data dependence or placement)"
                    )
                    rec.node.meta[meta.LOOKUP] = rec
                    continue
                members.append(rec)
            if not members:
                continue
            gr = meta.GroupRecord(name=f"group_{len(groups)}", key=key, lookups=_tables_adjacent(_column_order(members, pos)))
            for rec in members:
                table_group.setdefault(rec.param, gr)
            groups.append(gr)
    for gr in groups:
        for rec in gr.lookups:
            rec.node.meta[meta.GROUP] = gr.name
    ctx.groups = groups
    return PassResult(
        gm, False, {"groups": len(groups), "grouped": sum(len(g.lookups) for g in groups), "split_by_deps": n_split}
    )


def _single_ids_join_sequences(gm: fx.GraphModule) -> None:
    """A table looked up unpooled (a behaviour sequence) and with one id per row (the candidate,
    as DIN does) can sit in one TBE only if both lookups are unpooled: a one-id lookup of
    such a table becomes a sequence lookup of [B] ids (same numbers, [B, D] out)."""
    records = [n.meta[meta.LOOKUP] for n in gm.graph.nodes if meta.LOOKUP in n.meta]
    seq_tables = {r.param for r in records if r.lowerable and r.form == "seq"}
    for r in records:
        if r.lowerable and r.form == "single" and r.param in seq_tables:
            r.node.meta[meta.LOOKUP] = dataclasses.replace(r, form="seq", pooling="none")


def _column_order(members: List[meta.LookupRecord], pos: Dict[fx.Node, int]) -> List[meta.LookupRecord]:
    """Order members as the first concatenation that consumes them lists them."""

    def where(rec: meta.LookupRecord) -> Tuple[int, int, int]:
        best = (1 << 60, 0, pos[rec.node])
        for u in rec.output.users:
            if u.op == "call_function" and u.target is torch.ops.aten.cat.default:
                tensors = u.args[0]
                for i, t in enumerate(tensors):
                    if t is rec.output:
                        best = min(best, (pos[u], i, pos[rec.node]))
        return best

    return sorted(members, key=where)


def _tables_adjacent(members: List[meta.LookupRecord]) -> List[meta.LookupRecord]:
    """Each table's lookups next to each other, tables in order of their first lookup, lookups of
    one table in their given order: ``[a0, b1, a2]`` becomes ``[a0, a2, b1]``."""
    first: Dict[str, int] = {}
    for rec in members:
        first.setdefault(rec.param, len(first))
    return sorted(members, key=lambda r: first[r.param])  # stable
