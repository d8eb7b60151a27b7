"""lower_groups: replace each group of lookups by one call of a runtime group module.

Before (gm.code)::

    embedding_bag = torch.ops.aten.embedding_bag.padding_idx(bags_0_weight, ids_0, offs_0, ...)
    getitem = embedding_bag[0]
    embedding_bag_1 = torch.ops.aten.embedding_bag.padding_idx(bags_1_weight, ids_1, offs_1, ...)
    getitem_4 = embedding_bag_1[0]
    cat = torch.ops.aten.cat.default([getitem, getitem_4, linear], 1)

After::

    fxrec_group_0 = self.fxrec_group_0([ids_0, ids_1], [offs_0, offs_1], [None, None],
                                       [bags_0_weight, bags_1_weight])
    split_with_sizes = torch.ops.aten.split_with_sizes.default(fxrec_group_0, [8, 8], 1)
    getitem = split_with_sizes[0]
    getitem_1 = split_with_sizes[1]
    cat = torch.ops.aten.cat.default([getitem, getitem_1, linear], 1)

(fold_concat then turns the two parts in the cat back into ``fxrec_group_0``.) The weights
stay the user's parameters, passed in from their original ``get_attr`` nodes, so
``state_dict()`` keeps its keys and gradients land on the original parameters. Sequence groups
return one tensor per feature, taken with ``getitem``.

The group node is placed right before the first node that must follow its lookups: a user of
a member's output, or an in-place write that side effects order after a member (to the ids it
read); group_lookups guaranteed every input is defined before that point. An output the model
writes in place (``a += b``) is handed a copy of its part (``aten.clone``), a tensor of its own.

Groups that quantize_tables gave dtypes become quantized inference groups (called without
weights); the fp32 parameters they replace are removed from the model when nothing else reads them.
Where such a group serves fp16 (``output_dtype="fp16"``) for fp32 tables, the dtype checks
torch.export recorded on what the model computes from its outputs (``_assert_tensor_metadata``
before a ``.float()`` it made a no-op) are removed; the conversions stay.

The group's decision record (``meta.DECISION``) moves from its lookups to the call.

Not handled: lookups without a group (left as they were).
"""

from __future__ import annotations


import torch.fx as fx

from .. import meta
from ..pass_infra import PassContext, PassResult, compiler_pass
from ..dataflow import SideEffects
from ..group_module import build_group_module, call_anchor, drop_dtype_asserts_after, group_inputs, hand_outputs



@compiler_pass(needs=("groups", "paths"), provides=(meta.ORIGIN,))
def lower_groups(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    graph = gm.graph
    lowered = 0
    effects = SideEffects(list(graph.nodes))
    for gr in ctx.groups:
        if not gr.lower:
            continue
        weights = None
        if gr.quant:
            weights = {p: gm.get_parameter(p).detach() for p in gr.quant}
            ctx.fp32_weights.update(weights)
        module, index = build_group_module(gr, weights=weights, output_dtype=ctx.config.output_dtype,
                                           reuse_output=ctx.config.reuse_outputs)
        name = f"fxrec_{gr.name}"
        gm.add_submodule(name, module)
        gr.module = name
        with graph.inserting_before(call_anchor(graph, gr.lookups, effects)):
            call = graph.call_module(name, group_inputs(gr, index, lambda n: n))
            call.meta[meta.ORIGIN] = [rec.node.name for rec in gr.lookups]
            call.meta[meta.DECISION] = gr.decision
            if "stack_trace" in gr.lookups[0].node.meta:
                call.meta["stack_trace"] = gr.lookups[0].node.meta["stack_trace"]
            hand_outputs(graph, call, gr.lookups, pooled=gr.pooling != "none", written=effects.written)
        for rec in gr.lookups:
            for n in rec.nodes:  # users first: getitems / sum before the lookup itself
                graph.erase_node(n)
            lowered += 1
            if getattr(module, "output_dtype", "fp32") == "fp16" and not gr.lookups[0].half:
                drop_dtype_asserts_after(call)
    removed = _drop_quantized_weights(gm, ctx)
    n_groups = sum(1 for g in ctx.groups if g.lower)
    stats = {"groups": n_groups, "lookups_lowered": lowered}
    if removed:
        stats["fp32_tables_removed"] = removed
    return PassResult(gm, lowered > 0, stats)


def _drop_quantized_weights(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Quantized tables live in their group's TBE: remove the fp32 parameters nothing reads now."""
    removed = 0
    for n in list(gm.graph.nodes):
        if n.op == "get_attr" and n.target in ctx.fp32_weights and not n.users:
            gm.graph.erase_node(n)
            if not any(m.op == "get_attr" and m.target == n.target for m in gm.graph.nodes):
                owner, _, attr = n.target.rpartition(".")
                delattr(gm.get_submodule(owner) if owner else gm, attr)
                removed += 1
    return removed
