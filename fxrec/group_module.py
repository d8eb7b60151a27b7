"""Build the runtime module that runs one GroupRecord (shared by choose_kernels and lower_groups)."""

from __future__ import annotations

import operator
from typing import Collection, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from . import meta
from .dataflow import RESHAPES, SideEffects, carries_gradient, reads_contiguous
from .runtime.quantized import QuantizedPooledGroup, QuantizedSequenceGroup
from .runtime.group import EmbeddingGroup
from .runtime.specs import FeatureSpec, GroupSpec, TableSpec


def uses_outside_group(lookups: Sequence[meta.LookupRecord]) -> str:
    """The first table of ``lookups`` (a group's, or those grouping is placing together) whose weight
    feeds anything but these lookups (a tied output projection, a lookup left as it was, a block
    that reads it), or "". Such a table's update cannot be fused into the group's backward: it
    would miss that gradient, or change the weight another reader still needs in backward.

    (assign_optimizers asks a narrower question, before grouping: whether a gradient reaches the
    table from outside its lookups; the final graph's gradient layout is read in
    ``table_optimizers.dense_from_elsewhere``.)"""
    mine = {r.node for r in lookups}
    for r in lookups:
        if any(u not in mine for u in r.weight.users):
            return r.table
    return ""


def _specs(gr: meta.GroupRecord) -> Tuple[List[TableSpec], List[FeatureSpec], Dict[str, int]]:
    # A table whose optimizer could be fused gets sparse gradients when it is not fused: the
    # torch.optim update on them is the same arithmetic (rows without ids are left alone either
    # way) without a table-sized gradient. Not for fp16 tables: a sparse gradient's coalesce rounds
    # its fp16 sums otherwise than the dense gradient PyTorch gives (measured: different rows after a step).
    sparse_grads = (gr.optimizer is not None and gr.optimizer.fused_spec() is not None and not uses_outside_group(gr.lookups)
                    and not any(r.half for r in gr.lookups))
    tables: List[TableSpec] = []
    index: Dict[str, int] = {}
    features: List[FeatureSpec] = []
    for rec in gr.lookups:
        if rec.param not in index:
            index[rec.param] = len(tables)
            tables.append(TableSpec(rec.table, rec.num_rows, rec.dim, rec.sparse or sparse_grads,
                                    rec.dtype.replace("torch.", "") or "float32",
                                    gr.placements.get(rec.param, "device"), rec.weights))
        features.append(
            FeatureSpec(
                name=rec.feature, table=index[rec.param], form=rec.form, padding_idx=rec.padding_idx,
                include_last_offset=rec.include_last_offset, weighted=rec.weighted,
                grad=carries_gradient(rec.output),
            )
        )
    return tables, features, index


def group_spec(gr: meta.GroupRecord) -> GroupSpec:
    """What the kernels look at to say whether they support the group (no tensors)."""
    tables, features, _ = _specs(gr)
    return GroupSpec(tuple(tables), tuple(features), gr.pooling, quantized=bool(gr.quant))


def build_group_module(
    gr: meta.GroupRecord, with_optimizer: bool = True, weights: Optional[Dict[str, torch.Tensor]] = None,
    output_dtype: str = "fp32", reuse_output: bool = True,
) -> Tuple[EmbeddingGroup, Dict[str, int]]:
    """The runtime module for ``gr`` and the index of each table param in its weight list.

    ``with_optimizer=False`` builds it without the fused optimizer (for timing and checks that
    must not update the weights). A group with ``quant`` dtypes, given the fp32 ``weights`` by
    parameter name, becomes a quantized inference group (called without weights)."""
    tables, features, index = _specs(gr)
    if gr.quant and weights is not None:
        qcls = QuantizedSequenceGroup if gr.pooling == "none" else QuantizedPooledGroup
        order = sorted(index, key=index.get)
        if tables and tables[0].dtype == "float16":
            # the model's fp16 tables: quantized from their values, looked up in fp16 as the model's own
            # lookups give them (the graph after the group expects fp16, whatever output_dtype says);
            # each made fp32 only while it is quantized (fbgemm_nbit.make_inference_tbe), not all at once
            return qcls(tables, features, gr.pooling, [gr.quant[p] for p in order],
                        [weights[p] for p in order], "fp16", gr.cache_load_factor), index
        return qcls(tables, features, gr.pooling, [gr.quant[p] for p in order], [weights[p] for p in order],
                    output_dtype, gr.cache_load_factor), index
    mod = EmbeddingGroup(tables, features, gr.pooling, gr.kernel_train, gr.kernel_eval,
                         gr.fused if with_optimizer else None)
    mod.reuse_output = reuse_output
    mod.cache_load_factor = gr.cache_load_factor
    return mod, index


def group_inputs(gr: meta.GroupRecord, index: Dict[str, int], value) -> tuple:
    """The group module's call arguments, with ``value(node)`` giving each input (quantized
    groups take no weights)."""
    weights = [None] * len(index)
    for rec in gr.lookups:
        weights[index[rec.param]] = value(rec.weight)
    inputs = (
        [value(r.ids) for r in gr.lookups],
        [value(r.offsets) for r in gr.lookups],
        [value(r.per_sample_weights) for r in gr.lookups],
    )
    return inputs if gr.quant else inputs + (weights,)


def call_anchor(graph: fx.Graph, recs: Sequence[meta.LookupRecord], effects: SideEffects) -> fx.Node:
    """The node a group's call goes right before: the first that must run after its lookups, a
    user of one of their outputs or what side effects order after one (an in-place write to the
    ids it read: the call reads them as the lookup did); with neither, the node after the last
    lookup's output. group_lookups ordered the graph so that everything the call reads, and what
    side effects order before its lookups, comes earlier. ``effects``: the graph's side effects
    before this pass changed it."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    own = {n for r in recs for n in r.nodes}
    after = [u for r in recs for u in r.output.users if u not in own]
    after += [w for n in own for w in effects.followers(n) if w not in own and w in pos]
    return min(after, key=pos.__getitem__) if after else recs[-1].output.next


def hand_outputs(graph: fx.Graph, call: fx.Node, recs: Sequence[meta.LookupRecord], pooled: bool = True,
                 written: Collection[fx.Node] = ()) -> None:
    """Give each lookup's users its part of ``call``'s output (inserted at the graph's current
    insertion point): item i of one ``split_with_sizes`` of a pooled ``[B, sum of dims]`` output
    by columns (not one slice each: the backward of k slices of a tensor makes k zero tensors of
    its whole size, a split's one ``cat``), else item i of a list; the parts carry the original
    output's ``val`` and name it as their origin. The parts are not laid out as the lookups'
    outputs were (a column slice of the group's output; a piece of what the output dist received),
    so a part is copied where that shows:

    * an output the model writes in place (in ``written``: ``a += b``) is given a copy of its part
      (``aten.clone``), a tensor of its own as the lookup's was (autograd refuses in-place writes
      to a split's parts, and the write would reach the other parts' storage);
    * the users that read an output as a contiguous tensor (``b.view(-1)``, and the model's
      caller where it is returned: ``dataflow.reads_contiguous``) are given it made contiguous
      (``aten.contiguous``: a copy only where the part is not); where the part is a column slice
      (a pooled group of several features), they and its reshapes (``dataflow.RESHAPES``) are
      given a copy (``aten.clone``), as contiguous() and reshape would make for any batch but 1,
      which an exported program would otherwise fix at capture; the other users read the part
      itself (a ``cat`` of it stays foldable: fold_concat)."""
    if pooled:
        call = graph.call_function(torch.ops.aten.split_with_sizes.default, (call, [r.dim for r in recs], 1))
        call.meta[meta.ORIGIN] = [r.output.name for r in recs]
    for i, rec in enumerate(recs):
        out = graph.call_function(operator.getitem, (call, i))
        parts = [out]
        readers = []
        if rec.output in written:
            out = graph.call_function(torch.ops.aten.clone.default, (out,))
            parts.append(out)
        else:
            # a pooled group's part is a column slice (of several features): contiguous only for one
            # row, so a reshape of it views or copies by the batch size, which an exported program
            # would fix at capture (refusing a batch of 1); it is given a copy, as it would make one
            sliced = pooled and len(recs) > 1
            readers = [u for u in rec.output.users if reads_contiguous(rec.output, u)
                       or (sliced and u.target in RESHAPES and u.args and u.args[0] is rec.output)]
            if readers and sliced:  # (a copy whatever the batch: contiguous() would guard it, as above)
                parts.append(graph.call_function(torch.ops.aten.clone.default, (out,),
                                                 {"memory_format": torch.contiguous_format}))
            elif readers:
                parts.append(graph.call_function(torch.ops.aten.contiguous.default, (out,)))
        for part in parts:
            part.meta[meta.ORIGIN] = [rec.output.name]
            if "val" in rec.output.meta:
                part.meta["val"] = rec.output.meta["val"]
        rec.output.replace_all_uses_with(out)
        for u in readers:
            u.replace_input_with(out, parts[-1])


def drop_dtype_asserts_after(call: fx.Node) -> None:
    """``output_dtype="fp16"`` (lower_groups, shard_groups): the group's call gives fp16 where the
    model's lookups gave fp32, so the dtype checks torch.export recorded for ``.to()`` calls on
    what the model computes from them (``_assert_tensor_metadata(x, dtype=torch.float32)`` before
    a ``.float()`` that became a no-op) would fail on every call; they go (the conversions
    themselves stay, and convert)."""
    seen, todo = set(), [call]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in seen:
                seen.add(u)
                todo.append(u)
    for n in seen:
        if n.op == "call_function" and n.target is torch.ops.aten._assert_tensor_metadata.default and "dtype" in n.kwargs:
            n.graph.erase_node(n)
