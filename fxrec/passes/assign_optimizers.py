"""assign_optimizers: give every lookup the embedding optimizer the user chose for its table.

``transform(..., optimizer=fxrec.optim.RowWiseAdagrad(lr=0.05))`` applies to every table;
a dict maps table names (``"bags.0"``), parameter names (``"bags.0.weight"``) or glob patterns
(``"bags.*"``) to optimizers, the first matching key winning. The optimizer becomes part of the
group key, so groups split where tables want different optimizers.

Before/After: the graph is unchanged; ``LookupRecord.optimizer`` is set.

A lookup no gradient reaches (its output detached, or read only by a ``torch.no_grad()`` block or
an integer result) of a table with an optimizer is left as written, with the reason: PyTorch gives
its rows no gradient, and an optimizer fused into its group's backward would still update them.

Not handled: a dict key that matches no table is an error that names the key.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .. import meta
from ..dataflow import block_reads, carries_gradient
from ..optim import check_spec, resolve
from ..pass_infra import InputError, PassContext, PassResult, compiler_pass
from ..table_keys import check_keys


#: why a lookup no gradient reaches is left as written when its table has an optimizer
NO_GRADIENT = ("no gradient reaches its output (detached, or read only by a no_grad block or integer results), "
               "and the table's optimizer would update the rows it reads in a group's backward: left as written")


def makes_no_gradient(rec: meta.LookupRecord) -> bool:
    """Whether a lookup fxrec would group makes no gradient though outside a no_grad block: its
    output is detached (or read only by a no_grad block, an integer result). Its rows get no
    gradient in PyTorch, and an optimizer fused into the group's backward would still update them
    (weight decay, moments): with an optimizer for its table it is left as written
    (:data:`NO_GRADIENT`; fxrec.plan then plans the table data-parallel)."""
    return rec.grad and rec.lowerable and not carries_gradient(rec.output)


@compiler_pass(needs=(meta.LOOKUP,), provides=("optimizers",))
def assign_optimizers(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    spec = ctx.config.optimizer
    check_spec(spec)
    if spec is None:
        return PassResult(gm, False, {})
    assigned = 0
    records = meta.all_records(gm)
    if isinstance(spec, dict):
        check_keys(spec, [(r.table, r.param) for r in records], "fxrec: optimizer", InputError, "embedding table")
    elsewhere = _read_elsewhere(records)
    for rec in records:  # (lookups left in no_grad / autocast blocks too: theirs as torch.optim)
        opt = resolve(spec, rec.table, rec.param)
        if opt is None:
            continue
        # a lookup that makes no gradient (in a no_grad block, or detached) needs no optimizer, but
        # its table does where something else reads it with one (a tied output layer)
        mine = opt if rec.param in elsewhere else None
        if not rec.grad:
            if mine is not None:
                rec.node.meta[meta.LOOKUP] = dataclasses.replace(rec, optimizer=mine)
            continue
        if makes_no_gradient(rec):
            rec.node.meta[meta.LOOKUP] = dataclasses.replace(rec, grad=False, optimizer=mine, reason=NO_GRADIENT)
            continue
        rec.node.meta[meta.LOOKUP] = dataclasses.replace(rec, optimizer=opt)
        assigned += 1
    return PassResult(gm, False, {"lookups_with_optimizer": assigned})


def _read_elsewhere(records) -> set:
    """The tables (parameter names) the graph also reads outside their lookups (a tied output
    layer, ``x @ emb.weight.t()``, also one in an autocast block): something there may carry a
    gradient to them. (A no_grad block's reads carry none; a block's lookups have their records.)"""
    lookups = {r.node for r in records}
    out = set()
    for r in records:
        w = r.weight
        if isinstance(w, fx.Node) and any(
                u not in lookups and (block_reads(u, w) if isinstance(u.target, torch._ops.HigherOrderOperator) else True)
                for u in w.users):
            out.add(r.param)
    return out
