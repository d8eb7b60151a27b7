"""Which optimizer steps each embedding table of a transformed model: the record transform
leaves in ``gm.meta`` (``fxrec_table_optimizers``: each table's fxrec.optim optimizer and
gradient layout; ``fxrec_fused_groups``: the groups that update theirs inside backward), the
:func:`make_optimizer` that builds one optimizer from it, and :func:`fused_updates_off`."""

from __future__ import annotations

import contextlib
from typing import Dict

import torch
import torch.fx as fx

from .runtime.group import EmbeddingGroup
from .pass_infra import InputError
from .runtime.optimizer import CombinedOptimizer


@contextlib.contextmanager
def fused_updates_off(gm: torch.nn.Module):
    """Inside: fused groups give gradients instead of updating their tables in backward."""
    mods = [m for m in gm.modules() if isinstance(m, EmbeddingGroup)]
    before = [m.fused_enabled for m in mods]
    for m in mods:
        m.fused_enabled = False
    try:
        yield
    finally:
        for m, b in zip(mods, before):
            m.fused_enabled = b


def make_optimizer(transformed: torch.nn.Module, dense_optimizer=torch.optim.SGD, **kwargs) -> CombinedOptimizer:
    """One optimizer for a transformed model, usable with torch.optim.lr_scheduler.

    Parameters that are not embedding tables with an :mod:`fxrec.optim` optimizer get
    ``dense_optimizer(params, **kwargs)`` (frozen ones too, as ``torch.optim`` given ``model.parameters()``
    takes them). Tables whose optimizer is fused are updated inside
    backward (their learning rate is the fused group's ``"lr"`` in ``param_groups``); tables
    whose optimizer is not fused get the torch.optim namesake, stepped in ``step()``.
    """
    from .runtime.optimizer import Unit

    table_opts = transformed.meta.get("fxrec_table_optimizers", {})  # every table of the model, on every rank
    fused = []
    fused_names = set()
    for name, fqns in transformed.meta.get("fxrec_fused_groups", []):
        mod = transformed.get_submodule(name)
        if mod.fused_active:
            fused.append((name, mod, [transformed.get_parameter(f) for f in fqns], list(fqns)))
            fused_names.update(fqns)
    # One param group per table optimizer, in the order of the tables it first serves: the same on
    # every rank and under any plan, whichever tables a rank holds and fuses. (A table's sparse
    # flag here is its gradients' as lowered, which a plan changes: it splits a table optimizer
    # only where the torch class differs, Adam's, whose tables are never lowered so.)
    by_unit: Dict = {}
    for fqn, (opt, sparse) in table_opts.items():
        by_unit.setdefault((opt, sparse) if opt.SPARSE_CLASS else (opt, None), []).append((fqn, sparse))
    held = dict(transformed.named_parameters())  # with a plan: the tables this rank holds
    position = {f: i for i, f in enumerate(table_opts)}
    fallbacks, units = [], []
    for (opt, _), items in by_unit.items():
        mine = [(f, sparse) for f, sparse in items if f not in fused_names and f in held]
        if mine:
            fallbacks.append(opt.torch_optimizer([held[f] for f, _ in mine], sparse=any(sp for _, sp in mine)))
        members = {f for f, _ in items}
        units.append(Unit(items[0][0], opt.lr, len(fallbacks) - 1 if mine else None,
                          [i for i, (_, _, _, names) in enumerate(fused) if names and names[0] in members],
                          [f for f, _ in mine], position[mine[0][0]] if mine else 0))
    # (frozen ones too, as torch.optim(model.parameters()) takes them: they take no step while frozen, and
    # an optimizer made after a table was frozen has the groups of one made before, for its state_dict)
    dense_params = [p for n, p in transformed.named_parameters() if n not in table_opts]
    dense = dense_optimizer(dense_params, **kwargs) if dense_params else None
    return CombinedOptimizer(dense, fallbacks, fused, units)


def fused_groups(gm: fx.GraphModule) -> list:
    """(group module's name, its tables' parameter names) of every group with a fused optimizer:
    the group calls (weights as 4th argument), and with a plan each rank's local lookup group
    (its lookup module's ``group``, weights as the call's 2nd argument)."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_module":
            continue
        mod = gm.get_submodule(n.target)
        if isinstance(mod, EmbeddingGroup) and len(n.args) > 3 and mod.fused is not None:
            out.append((n.target, [w.target for w in n.args[3]]))
        elif isinstance(getattr(mod, "group", None), EmbeddingGroup) and mod.group.fused is not None:
            out.append((f"{n.target}.group", [w.target for w in n.args[1]]))
    return out


def dense_from_elsewhere(gm: fx.GraphModule, tables: set) -> set:
    """The tables of ``tables`` whose ``.grad`` comes out dense whatever layout their groups give them: the graph
    also reads them with a dense gradient outside the groups (a tied output layer, ``weight[ids]``
    or an ``nn.Embedding`` lookup without ``sparse=True`` left as written), so their torch.optim
    step must take a dense one (torch.optim.Adam, not SparseAdam). Reads no gradient reaches
    (a detached lookup, a no_grad block) do not count."""
    from .dataflow import block_reads, carries_gradient

    sparse_ops = {torch.ops.aten.embedding.default: 4, torch.ops.aten.embedding_bag.default: 5,
                  torch.ops.aten.embedding_bag.padding_idx: 5, torch.ops.aten._embedding_bag.default: 5}
    out = set()
    for n in gm.graph.nodes:
        if n.op != "get_attr" or n.target not in tables:
            continue
        for u in n.users:
            if u.op == "call_module" and isinstance(gm.get_submodule(u.target), EmbeddingGroup):
                continue
            if u.op == "call_function" and isinstance(u.target, torch._ops.HigherOrderOperator):
                if not block_reads(u, n):
                    continue  # (a no_grad block, or only lookups in the block: their records give their layout)
                out.add(n.target)  # (a tied output layer in an autocast block: a dense gradient)
                continue
            k = sparse_ops.get(u.target) if u.op == "call_function" else None
            if k is not None and len(u.args) > k and u.args[k] is True:
                continue  # (a sparse lookup left as written: its gradient is sparse)
            if u.op == "call_function" and not carries_gradient(u):
                continue
            out.add(n.target)
    return out


def record_table_optimizers(gm: fx.GraphModule, records, sharded: bool) -> None:
    """Put in ``gm.meta`` each table's optimizer with the layout of its gradient
    (``fxrec_table_optimizers``: parameter name -> (optimizer, sparse)) and the groups that fuse
    theirs (``fxrec_fused_groups``), for :func:`make_optimizer`, from the lookup ``records`` the
    graph had before lowering (those in no_grad / autocast blocks too). A table stepped by
    torch.optim whose optimizer cannot take its gradient's layout is an error naming it."""
    with_opt = {r.param for r in records if r.optimizer is not None}
    # (a sparse table read elsewhere too: its .grad is dense)
    dense_grads = dense_from_elsewhere(gm, with_opt) if not sharded else set()
    table_opts = {r.param: (r.optimizer, r.sparse and r.param not in dense_grads) for r in records
                  if r.optimizer is not None}
    for n in gm.graph.nodes:  # lowered tables: the gradient layout their group module gives
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), EmbeddingGroup) and len(n.args) > 3:
            for w, spec in zip(n.args[3], gm.get_submodule(n.target).tables):
                if w.target in table_opts:
                    table_opts[w.target] = (table_opts[w.target][0], spec.sparse and w.target not in dense_grads)
    fused = fused_groups(gm)
    fused_fqns = {f for _, fs in fused for f in fs}
    for fqn, (opt, sparse) in table_opts.items():
        why = opt.sparse_refusal() if sparse and fqn not in fused_fqns else ""
        if why:
            raise InputError(f"fxrec: table '{fqn[:-len('.weight')] if fqn.endswith('.weight') else fqn}' cannot "
                             f"train with {opt.describe()}: {why}")
    gm.meta["fxrec_table_optimizers"] = table_opts
    gm.meta["fxrec_fused_groups"] = fused
