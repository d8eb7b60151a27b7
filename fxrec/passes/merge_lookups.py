"""merge_lookups: one lookup for lookups repeated with the same inputs, none for unused ones.

Real models look a table up twice with the same ids (a multi-task model whose towers each look
up the user features; a lookup written again only to read ``.shape[0]``), or look it up and never
use the result. Two lookups of one table with the same ids (the same node, or equal computations
of them: ``x[:, 0].long()`` written twice), the same offsets and per-sample weights, and the same
form, pooling, padding_idx and include_last_offset are one lookup: the users of the second read
the first's output, and the second's nodes are erased. A lookup whose result nothing uses is
erased (with the id computations only it used). A lookup whose output the model writes in place
(``a += 1``) is not merged: the other lookup's output is another tensor, which the write must not
reach.

Numbers do not change: the one lookup's output has the users of both, so autograd sums both
uses into the table's gradient, as it did for the two lookups (to fp32 rounding: the two uses'
gradients are summed before the table's rows get them). In training, lookups of the model's fp16
tables are not merged: summed in fp16, those gradients round otherwise than PyTorch's (up to three
fp16 steps apart, measured), and fp16 tables are lowered bit for bit.

Before (gm.code)::

    embedding = torch.ops.aten.embedding.default(user_weight, u)          # result unused
    embedding_1 = torch.ops.aten.embedding.default(user_weight, u)
    embedding_2 = torch.ops.aten.embedding.default(user_weight, u)
    add = torch.ops.aten.add.Tensor(linear(embedding_1), embedding_2)

After::

    embedding_1 = torch.ops.aten.embedding.default(user_weight, u)
    add = torch.ops.aten.add.Tensor(linear(embedding_1), embedding_1)

``gm.meta["fxrec_removed_lookups"]`` lists what was removed (:class:`fxrec.meta.RemovedLookup`:
table, feature, source line, "merged into <feature>" / "result unused: removed"); the report
shows it.

Not handled: lookups with a reason (left as they were, used or not).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch.fx as fx

from .. import meta
from ..dataflow import SideEffects, is_impure
from ..pass_infra import PassContext, PassResult, compiler_pass


def _frozen(v):
    """``v`` as a hashable value (nodes by their canonical node), or raise TypeError."""
    if isinstance(v, (list, tuple)):
        return (type(v).__name__,) + tuple(_frozen(x) for x in v)
    if isinstance(v, dict):
        return ("dict",) + tuple(sorted((k, _frozen(x)) for k, x in v.items()))
    if isinstance(v, slice):
        return ("slice", _frozen(v.start), _frozen(v.stop), _frozen(v.step))
    hash(v)
    return v


def _canonical(nodes: List[fx.Node], effects: SideEffects) -> Dict[fx.Node, fx.Node]:
    """Each node's first equal computation: the same pure op on canonically equal arguments
    (nothing written in place, nothing random), else the node itself."""
    canon: Dict[fx.Node, fx.Node] = {}
    seen: Dict[tuple, fx.Node] = {}
    for n in nodes:
        rep = n
        if (n.op == "call_function" and n not in effects.written and not is_impure(n)
                and not any(x in effects.written for x in n.all_input_nodes)):
            try:
                key = (n.target, _frozen(fx.node.map_arg(n.args, lambda a: canon[a])),
                       _frozen(fx.node.map_arg(n.kwargs, lambda a: canon[a])))
                rep = seen.setdefault(key, n)
            except TypeError:
                pass
        canon[n] = rep
    return canon


def _erase_dead_inputs(graph: fx.Graph, inputs: List[fx.Node]) -> None:
    """Erase what only the erased nodes read: pure computations and parameter reads left unused."""
    todo = list(inputs)
    erased = set()
    while todo:
        n = todo.pop()
        if n in erased or n.users or n.op not in ("call_function", "get_attr"):
            continue
        if n.op == "call_function" and is_impure(n):
            continue
        todo.extend(n.all_input_nodes)
        graph.erase_node(n)
        erased.add(n)


def _erase(graph: fx.Graph, rec: meta.LookupRecord) -> None:
    own = set(rec.nodes)
    inputs = [x for n in rec.nodes for x in n.all_input_nodes if x not in own]
    for n in rec.nodes:  # users first: getitems / the pooling before the lookup itself
        graph.erase_node(n)
    _erase_dead_inputs(graph, inputs)


@compiler_pass(needs=(meta.LOOKUP,), provides=(meta.REMOVED,))
def merge_lookups(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    graph = gm.graph
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    records = [n.meta[meta.LOOKUP] for n in nodes if meta.LOOKUP in n.meta and n.meta[meta.LOOKUP].lowerable]
    removed: List[meta.RemovedLookup] = list(gm.meta.get(meta.REMOVED, ()))
    n_dead = n_merged = 0
    training = ctx.config.mode == "training"

    live = []
    for rec in records:
        if any(u not in rec.nodes for u in rec.output.users):
            live.append(rec)
            continue
        _erase(graph, rec)
        removed.append(meta.RemovedLookup(rec.table, rec.feature, rec.source, "result unused: removed"))
        ctx.logger.debug("%s (%s): result unused, removed", rec.feature, rec.table)
        n_dead += 1

    if len(live) > 1:
        nodes = [n for n in graph.nodes]
        effects = SideEffects(nodes)
        canon = _canonical(nodes, effects)

        def c(x) -> Optional[fx.Node]:
            return canon.get(x, x) if isinstance(x, fx.Node) else x

        first: Dict[tuple, meta.LookupRecord] = {}
        # the lookup whose output comes first stays: the others' users all come after it
        for rec in sorted(live, key=lambda r: pos[r.output]):
            if rec.output in effects.written:
                continue  # the model writes this output in place: the other lookup's is another tensor
            if any(x in effects.written for x in (rec.ids, rec.offsets, rec.per_sample_weights, rec.weight)):
                continue  # its inputs are written in place (they, or an input they may share memory with)
            if training and rec.half:
                continue  # an fp16 table: the one lookup's backward would sum both uses' gradients in fp16
                # before they reach the table, which rounds otherwise than PyTorch's two backwards
            key = (rec.param, c(rec.ids), c(rec.offsets), c(rec.per_sample_weights), rec.form, rec.pooling,
                   rec.padding_idx, rec.include_last_offset, rec.sparse)
            keep = first.setdefault(key, rec)
            if keep is rec:
                continue
            rec.output.replace_all_uses_with(keep.output)
            _erase(graph, rec)
            removed.append(meta.RemovedLookup(rec.table, rec.feature, rec.source, f"merged into {keep.feature}"))
            ctx.logger.debug("%s (%s): merged into %s", rec.feature, rec.table, keep.feature)
            n_merged += 1

    gm.meta[meta.REMOVED] = tuple(removed)
    return PassResult(gm, bool(n_dead or n_merged), {"merged": n_merged, "unused_removed": n_dead})
