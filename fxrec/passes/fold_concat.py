"""fold_concat: give a concatenation the group's output directly instead of its slices.

Before (gm.code)::

    split_with_sizes = torch.ops.aten.split_with_sizes.default(fxrec_group_0, [8, 8], 1)
    getitem = split_with_sizes[0]
    getitem_1 = split_with_sizes[1]
    cat = torch.ops.aten.cat.default([dense, getitem, getitem_1], 1)

After::

    cat = torch.ops.aten.cat.default([dense, fxrec_group_0], 1)

A run of consecutive arguments that are adjacent column parts of one group output becomes
that output when the run covers all its columns (a cat of nothing else disappears entirely),
or one slice when it covers part of them. Parts (and splits) left without users are removed.

``torch.stack(..., dim=1)`` of [B, D] tensors (DLRM's interaction input) is folded the same way
when a run covers a whole group whose tables all have dim D: the group output is reshaped to
[B, k, D] and concatenated with the other tensors unsqueezed.

A concatenation the model writes in place (``torch.cat([a, b], 1).clamp_(min=0)``, an
``nn.ReLU(inplace=True)`` after it) becomes the group's output itself only where nothing else
reads that output or the lookups' parts of it: the write would reach them, and in the model they
are other tensors than their concatenation (a lookup output the model writes is a copy, and never
folded: lower_groups). Nor does a concatenation of part of a group's columns become a slice of
its output where it is read as a contiguous tensor (``torch.cat([a, b], 1).view(-1)``, or
returned: ``dataflow.reads_contiguous``): the slice is not one.

Not handled: concatenations along another dim, slices out of column order, partial runs in a
stack.
"""

from __future__ import annotations

import operator
from typing import List, Optional, Tuple

import torch
import torch.fx as fx

from .. import meta
from ..dataflow import SideEffects, reads_contiguous
from ..pass_infra import PassContext, PassResult, compiler_pass

aten = torch.ops.aten


def _group_slice(n) -> Optional[Tuple[fx.Node, int, int]]:
    """(group output, first column, end column) of item i of the column split that
    lower_groups / shard_groups handed a lookup's user (both carry the lookups they replace as
    their origin), not of a split the user wrote; None for anything else."""
    if not (isinstance(n, fx.Node) and n.op == "call_function" and n.target is operator.getitem
            and meta.ORIGIN in n.meta and isinstance(n.args[0], fx.Node)):
        return None
    split, i = n.args
    if not (split.op == "call_function" and split.target is aten.split_with_sizes.default and len(split.args) == 3
            and split.args[2] == 1 and isinstance(split.args[0], fx.Node) and split.args[0].op == "call_module"
            and meta.ORIGIN in split.meta and meta.ORIGIN in split.args[0].meta):
        return None
    sizes = split.args[1]
    start = sum(sizes[:i])
    return split.args[0], start, start + sizes[i]


def _width(gm: fx.GraphModule, group: fx.Node) -> int:
    return sum(gm.get_submodule(group.target).dims)


@compiler_pass(needs=("fxrec_origin",))
def fold_concat(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    graph = gm.graph
    folded = 0
    written = SideEffects(list(graph.nodes)).written  # (their concatenation stays a copy)
    for cat in list(graph.nodes):
        if cat.op != "call_function" or cat.target is not aten.cat.default:
            continue
        dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
        val = cat.meta.get("val")
        ndim = val.dim() if val is not None else 2
        if dim not in (1, 1 - ndim) or ndim != 2:
            continue
        out: List = []
        changed = False
        parts: List[fx.Node] = []  # the group's parts this cat's folding takes
        for group, start, end, nodes in _runs(gm, list(cat.args[0])):
            if group is None or (len(nodes) == 1 and end - start < _width(gm, group)):
                out.extend(nodes)
            elif end - start == _width(gm, group):  # all of the group's columns: its output
                out.append(group)
                parts += nodes
                changed = True
            else:  # several adjacent slices of the group: one wider slice (made below)
                out.append((group, start, end))
                parts += nodes
                changed = True
        if not changed or (len(out) == 1 and cat in written and _read_elsewhere(cat, parts)):
            continue
        if len(out) == 1 and isinstance(out[0], tuple) and any(reads_contiguous(cat, u) for u in cat.users):
            continue  # a slice of the group's output is not contiguous; the concatenation is
        with graph.inserting_before(cat):
            out = [graph.call_function(aten.slice.Tensor, (x[0], 1, x[1], x[2])) if isinstance(x, tuple) else x
                   for x in out]
        folded += 1
        if len(out) == 1:
            cat.replace_all_uses_with(out[0])
            graph.erase_node(cat)
        else:
            cat.args = (out,) + tuple(cat.args[1:])
    for stack in list(graph.nodes):
        if stack.op == "call_function" and stack.target is aten.stack.default:
            folded += _fold_stack(gm, stack, written)
    removed = 0
    for n in reversed(list(graph.nodes)):
        if _group_slice(n) is not None and not n.users:
            split = n.args[0]
            graph.erase_node(n)
            removed += 1
            if not split.users:  # every column went to a folded cat
                graph.erase_node(split)
    return PassResult(gm, folded > 0 or removed > 0, {"cats_folded": folded, "slices_removed": removed})


def _read_elsewhere(cat: fx.Node, parts: List[fx.Node]) -> bool:
    """Whether anything but ``cat`` reads the group output that would replace it (or a slice of it):
    the parts ``cat`` takes, the other lookups' parts, or the output itself (another concatenation
    folded into it before)."""
    if any(u is not cat for p in parts for u in p.users):
        return True
    taken = set(parts)
    for split in {p.args[0] for p in parts}:
        if any(u is not split for u in split.args[0].users):  # the output, read whole elsewhere
            return True
        if any(u not in taken and u.users for u in split.users):  # another lookup's part of it
            return True
    return False


def _fold_stack(gm: fx.GraphModule, stack: fx.Node, written) -> int:
    """``stack([x, s_0 .. s_k], 1)`` of [B, D] tensors, where s_0..s_k are all columns of one
    group whose tables all have dim D, becomes ``cat([x.unsqueeze(1), g.reshape(-1, k+1, D)], 1)``:
    the group output is reshaped in place instead of being sliced and copied column by column."""
    graph = gm.graph
    dim = stack.args[1] if len(stack.args) > 1 else stack.kwargs.get("dim", 0)
    if dim not in (1, -2):
        return 0
    parts: List = []
    changed = False
    for group, start, end, nodes in _runs(gm, list(stack.args[0])):
        dims = gm.get_submodule(group.target).dims if group is not None else []
        if group is not None and end - start == sum(dims) and len(set(dims)) == 1:
            parts.append(("group", group, len(dims), dims[0]))
            changed = True
        else:
            parts.extend(("one", t) for t in nodes)
    if not changed or (len(parts) == 1 and stack in written):
        return 0
    with graph.inserting_before(stack):
        pieces = []
        for p in parts:
            if p[0] == "one":
                pieces.append(graph.call_function(aten.unsqueeze.default, (p[1], 1)))
            else:
                pieces.append(graph.call_function(aten.reshape.default, (p[1], [-1, p[2], p[3]])))
        new = pieces[0] if len(pieces) == 1 else graph.call_function(aten.cat.default, (pieces, 1))
    new.meta.update({k: v for k, v in stack.meta.items() if k in ("val", "stack_trace")})
    stack.replace_all_uses_with(new)
    graph.erase_node(stack)
    return 1


def _runs(gm: fx.GraphModule, tensors: List):
    """Split a cat/stack argument list into runs: (group, start, end, nodes) for consecutive
    adjacent column slices of one group output, (None, 0, 0, [node]) for anything else."""
    i = 0
    while i < len(tensors):
        s = _group_slice(tensors[i])
        if s is None:
            yield None, 0, 0, [tensors[i]]
            i += 1
            continue
        group, start, end = s
        j = i + 1
        while j < len(tensors):
            t = _group_slice(tensors[j])
            if t is None or t[0] is not group or t[1] != end:
                break
            end = t[2]
            j += 1
        yield group, start, end, tensors[i:j]
        i = j
