"""annotate_lookups: find every embedding lookup and describe it in a LookupRecord.

Capture (torch.export) turns every way of writing a lookup into one of three ATen ops on a
weight parameter, so this pass looks only at those::

    nn.EmbeddingBag / F.embedding_bag      aten.embedding_bag.padding_idx (or .default, _embedding_bag)
        (2-D ids arrive as reshape(ids, [-1]) with arange offsets)
    nn.Embedding / F.embedding              aten.embedding.default
    nn.Embedding then .sum(1) / .mean(1)    aten.embedding + aten.sum.dim_IntList / aten.mean.dim
    weight[ids], index_select(weight, 0, ids)  aten.index.Tensor / aten.index_select (a 2-D parameter's
        rows by integer ids: what F.embedding reads, with a dense gradient)

Before (gm.code)::

    embedding_bag = torch.ops.aten.embedding_bag.padding_idx(bags_0_weight, ids, offs, False, 0, ...)
    getitem = embedding_bag[0]

After: the graph is unchanged; ``embedding_bag.meta["fxrec_lookup"]`` holds a LookupRecord with
table "bags.0", form "bag", pooling "sum", and ``reason == ""`` (lowerable).

Not handled (recorded with the reason, and left exactly as it was): ``mode="max"``,
``max_norm`` (the table is renormalised in place), ``scale_grad_by_freq``, weights that are not
parameters (buffers, or computed in forward), dtypes other than fp32 and fp16, a negative
``padding_idx`` on a bag. Any dim is lowered: a kernel that needs a multiple of 4 (fbgemm's TBE)
pads the table it stores (:func:`fxrec.runtime.specs.pad_dim`).
"""

from __future__ import annotations

import operator
import os
import re
from typing import Dict, Optional, Tuple

import torch
import torch.fx as fx

from .. import meta
from ..dataflow import bodies
from ..pass_infra import PassContext, PassResult, compiler_pass

aten = torch.ops.aten
_SET_GRAD = torch.ops.higher_order.wrap_with_set_grad_enabled

_BAG_OPS = {
    aten.embedding_bag.padding_idx,
    aten.embedding_bag.default,
    aten._embedding_bag.default,
}
_EMB_OPS = {aten.embedding.default}
# A parameter's rows read by indexing: ``weight[ids]`` (aten.index with one integer index) and
# ``torch.index_select(weight, 0, ids)`` are ``F.embedding(ids, weight)`` (a sampled-softmax
# negative, a table read row by row); recorded only for 2-D parameters of the model
_INDEX_OPS = {aten.index.Tensor, aten.index_select.default}
_LOOKUP_OPS = _BAG_OPS | _EMB_OPS | _INDEX_OPS
_POOL_OPS = {aten.sum.dim_IntList: "sum", aten.mean.dim: "mean"}
_MODE_NAMES = {0: "sum", 1: "mean", 2: "max"}
#: Table dtypes lowered: fp32, and fp16 (fbgemm's TBE stores fp16 rows and gives fp16 rows out, as
#: PyTorch's lookups do; other kernels decide what they take, choose_kernels). bf16 stays as written:
#: no fbgemm build fxrec runs has bf16 rows (its CPU build stores fp16; fbgemm-gpu 1.6.0's CUDA
#: forward has no bf16 kernel), so a group of them would run PyTorch's own lookups anyway.
LOWERED_DTYPES = (torch.float32, torch.float16)
# Ops that only re-view or re-type the ids; followed back to name a feature after its input.
_PASS_THROUGH = {
    aten.to.dtype, aten._to_copy.default, aten.reshape.default, aten.view.default,
    aten.flatten.using_ints, aten.contiguous.default, aten.clone.default, aten.squeeze.dim,
    aten.unsqueeze.default, aten.alias.default, aten.to.dtype_layout,
}

_TORCH_DIR = os.path.dirname(torch.__file__)
_FXREC_DIR = os.path.dirname(os.path.dirname(__file__))


def user_source(node: fx.Node) -> str:
    """'file.py:LINE' of the innermost frame of the user's code that made ``node``."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
    for path, line in reversed(frames):
        if not path.startswith(_TORCH_DIR) and not path.startswith(_FXREC_DIR):
            return f"{os.path.basename(path)}:{line}"
    if frames:
        return f"{os.path.basename(frames[-1][0])}:{frames[-1][1]}"
    return ""


def describe_ids(node: fx.Node, depth: int = 0, outer: Optional[Dict[fx.Node, fx.Node]] = None) -> str:
    """A readable name for an ids input: ``ids_list_0``, ``feats[:, 3]``, ``x[:, 0:3]`` (``outer``:
    a higher-order op's body placeholders, as the nodes outside they take)."""
    if depth > 12 or not isinstance(node, fx.Node):
        return str(node)
    if node.op == "placeholder":  # (by the model's argument: fx renames a node named like a global, device_1)
        if outer and node in outer:
            return describe_ids(outer[node], depth + 1)
        return node.meta.get(meta.INPUT_NAME, str(node.target))
    if node.op == "call_function":
        if node.target in _PASS_THROUGH:
            return describe_ids(node.args[0], depth + 1, outer)
        if node.target == aten.select.int:
            _, dim, idx = node.args[:3]
            return f"{describe_ids(node.args[0], depth + 1, outer)}[{':, ' * dim}{idx}]"
        if node.target == aten.slice.Tensor:
            args = list(node.args) + [0, None, None][len(node.args) - 1 :]
            src, dim, start, end = args[:4]
            if (start in (0, None)) and (end is None or (isinstance(end, int) and end >= 2**62)):
                return describe_ids(src, depth + 1, outer)
            s = "" if start in (0, None) else start
            e = "" if end is None or (isinstance(end, int) and end >= 2**62) else end
            return f"{describe_ids(src, depth + 1, outer)}[{':, ' * dim}{s}:{e}]"
    return node.name


def _param_fqn(gm: fx.GraphModule, node: fx.Node) -> Optional[str]:
    if node.op != "get_attr":
        return None
    try:
        p = gm.get_parameter(node.target)
    except AttributeError:
        return None
    return node.target if isinstance(p, torch.nn.Parameter) else None


_ALIAS_OPS = {
    aten.detach.default, aten.alias.default, aten.view.default, aten.slice.Tensor, aten.select.int,
    aten.t.default, aten.transpose.int, aten.reshape.default, aten.narrow.default,
}


def _mutated_in_graph(weight: fx.Node) -> Optional[str]:
    """Why the table is written in forward (following views of it, and into the blocks it is
    given to: a lookup with max_norm inside a no_grad block), or None."""
    table, users = _closure(weight)
    for u in users:
        if u.op != "call_function":
            continue
        name = getattr(u.target, "__name__", str(u.target))
        if "embedding_renorm" in name:
            return "max_norm renormalises the table in place during forward"
        schema = getattr(u.target, "_schema", None)
        if schema is None:
            continue
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write and i < len(u.args) and u.args[i] in table:
                return f"the table is modified in place by {name} in forward"
    return None


def _written_in_a_block(gm: fx.GraphModule, weight: fx.Node) -> Optional[tuple]:
    """(the parameter's get_attr node, the op) where ``weight`` is a parameter an op of a ``no_grad``
    block (``torch.no_grad(): self.emb.weight.mul_(0.5)``, captured as a higher-order op with a body)
    writes in place and returns; else None."""
    if not (weight.op == "call_function" and weight.target is operator.getitem and isinstance(weight.args[0], fx.Node)):
        return None
    block, k = weight.args[0], weight.args[1]
    if block.op != "call_function" or block.target is not _SET_GRAD or len(block.args) < 2 \
            or not isinstance(block.args[1], fx.Node) or block.args[1].op != "get_attr":
        return None
    body = getattr(gm, str(block.args[1].target), None)
    if not isinstance(body, fx.GraphModule):
        return None
    out = next(n for n in body.graph.nodes if n.op == "output").args[0]
    res = out[k] if isinstance(out, (tuple, list)) and isinstance(k, int) and k < len(out) else None
    schema = getattr(getattr(res, "target", None), "_schema", None)
    if schema is None or not res.args or not schema.arguments or schema.arguments[0].alias_info is None \
            or not schema.arguments[0].alias_info.is_write or res.args[0].op != "placeholder":
        return None
    inputs = [n for n in body.graph.nodes if n.op == "placeholder"]
    j = inputs.index(res.args[0])
    src = block.args[2 + j] if 2 + j < len(block.args) else None
    if isinstance(src, fx.Node) and _param_fqn(gm, src) is not None:
        return src, getattr(res.target, "__name__", str(res.target))
    return None


def _arg(node: fx.Node, i: int, name: str, default):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def apart_on_ranks(rec: meta.LookupRecord) -> Optional[str]:
    """Why a lookup run as written on every rank of a plan (its table whole on each, the gradients
    summed) would not train as one process on the global batch does, or None: ``scale_grad_by_freq``
    scales the gradient by the id counts of each rank's own batch, and a table written in forward
    (``max_norm``'s renormalisation) is written on each rank for that rank's ids only, so the copies
    part."""
    if rec.node.op == "call_function" and rec.node.target not in _INDEX_OPS and \
            _arg(rec.node, 3, "scale_grad_by_freq", False):
        return "scale_grad_by_freq scales its gradient by the id counts of each rank's own batch"
    if isinstance(rec.weight, fx.Node):
        mutated = _mutated_in_graph(rec.weight)
        if mutated:
            return mutated.replace("renormalises the table in place during forward",
                                   "renormalises in place the rows each rank's own batch reads") + \
                " (on each rank for its own ids, so the copies part)"
    return None


def block_operands(gm: fx.GraphModule) -> Dict[fx.Node, fx.Node]:
    """Each placeholder of a block's body (a no_grad / autocast block, nested ones too) -> the node
    of the graph around it that the block gives it."""
    out: Dict[fx.Node, fx.Node] = {}
    todo = [gm.graph]
    while todo:
        for n in todo.pop().nodes:
            for body, operands in bodies(n):
                holders = [h for h in body.graph.nodes if h.op == "placeholder"]
                out.update({h: o for h, o in zip(holders, operands) if o is not None})
                todo.append(body.graph)
    return out


def _renorm(node: fx.Node) -> bool:
    return node.op == "call_function" and "embedding_renorm" in getattr(node.target, "__name__", str(node.target))


def _closure(weight: fx.Node) -> Tuple[set, list]:
    """The nodes that are the table ``weight``: it, its views, and the placeholders of the blocks
    it is given to (and theirs), and the users that read it into none of those (a block fxrec cannot
    look into is such a user), in the order found."""
    seen, todo, others = {weight}, [weight], {}
    while todo:
        cur = todo.pop(0)
        for u in cur.users:
            nxt = [u] if u.op == "call_function" and u.target in _ALIAS_OPS else []
            for body, given in bodies(u):
                holders = [h for h in body.graph.nodes if h.op == "placeholder"]
                nxt += [h for h, o in zip(holders, given) if o is cur]
            if not nxt:
                others[u] = None
            for x in nxt:
                if x not in seen:
                    seen.add(x)
                    todo.append(x)
    return seen, list(others)


def read_unrenormalised(weight: fx.Node, lookups, operands: Dict[fx.Node, fx.Node]) -> bool:
    """Whether the table ``weight`` (a lookup record's) is read anywhere (following views of it,
    into and out of blocks: ``operands`` is :func:`block_operands`) but by max_norm's
    renormalisation and the lookups of ``lookups`` it renormalises for (those given the ids a
    renormalisation was given): a plain lookup of the table, or the model's own read of it."""
    while weight in operands:  # (the table as the outermost graph holds it)
        weight = operands[weight]
    _, users = _closure(weight)
    renormed = {u.args[1] for u in users if _renorm(u) and len(u.args) > 1}
    return any(not (_renorm(u) or (u in lookups and len(u.args) > 1 and u.args[1] in renormed)) for u in users)


@compiler_pass(provides=(meta.LOOKUP,))
def annotate_lookups(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    found = 0
    left = 0
    names: Dict[str, int] = {}
    # max_gradient= clamps the gradient of each lookup's output as the model wrote it: of a
    # ``[B, L, D]`` lookup whose mean is taken, each row's, which a mean folded into the lookup
    # (one gradient a bag, divided by L after the clamp) would not give; a sum's rows all take
    # the bag's gradient, so a folded sum clamps the same
    fold_mean = not (ctx.config.max_gradient and ctx.config.mode == "training")
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _LOOKUP_OPS:
            continue
        rec = _record(gm, node, fold_mean=fold_mean)
        if rec is None:
            continue
        base = rec.feature
        names[base] = names.get(base, 0) + 1
        if names[base] > 1:
            rec = _replace(rec, feature=f"{base}#{names[base]}")
        node.meta[meta.LOOKUP] = rec
        found += 1
        if not rec.lowerable:
            left += 1
            ctx.logger.debug("%s (%s) not lowered: %s", rec.table, rec.feature, rec.reason)
    hidden = _annotate_hidden(gm, gm.graph.nodes, {}, names, True, fold_mean)
    for rec in hidden:
        ctx.logger.debug("%s (%s) not lowered: %s", rec.table, rec.feature, rec.reason)
    return PassResult(gm, False, {"lookups": found + len(hidden), "not_lowerable": left + len(hidden)})


#: what a higher-order op's body is in the user's code, for the reason its lookups are left alone
_BLOCKS = {"wrap_with_set_grad_enabled": "a torch.no_grad() / torch.enable_grad() block",
           "wrap_with_autocast": "a torch.autocast block"}


def _annotate_hidden(gm: fx.GraphModule, nodes, outer: Dict[fx.Node, fx.Node], names: Dict[str, int], grad: bool,
                     fold_mean: bool = True):
    """Records for the lookups inside the bodies of higher-order ops among ``nodes`` (``torch.no_grad()``
    and ``torch.autocast`` blocks, at any depth): left as written, with the reason; ``outer`` maps a
    body's placeholders to the nodes of ``gm``'s graph they take (their weight is ``gm``'s parameter);
    ``grad``: whether gradients are on around ``nodes``."""
    found = []
    for node in list(nodes):
        for body, operands in bodies(node):
            holders = [n for n in body.graph.nodes if n.op == "placeholder"]
            inner = {h: outer.get(o, o) for h, o in zip(holders, operands) if o is not None}
            name = getattr(node.target, "__name__", str(node.target))
            block = _BLOCKS.get(name, f"a {name} block")
            inside = bool(node.args[0]) if name == "wrap_with_set_grad_enabled" and node.args else grad
            for n in body.graph.nodes:
                if n.op != "call_function" or n.target not in _LOOKUP_OPS:
                    continue
                rec = _record(gm, n, weight=inner.get(n.args[0]), fold_mean=fold_mean)
                if rec is None:
                    continue
                base = describe_ids(rec.ids, outer=inner)  # (named by what the block is given)
                names[base] = names.get(base, 0) + 1
                why = f"inside {block}, where fxrec does not lower lookups"
                rec = _replace(rec, feature=base if names[base] == 1 else f"{base}#{names[base]}",
                               reason=why + (f"; {rec.reason}" if rec.reason else ""), grad=inside)
                n.meta[meta.LOOKUP] = rec
                found.append(rec)
            found += _annotate_hidden(gm, body.graph.nodes, inner, names, inside, fold_mean)
    return found


def _replace(rec: meta.LookupRecord, **kw) -> meta.LookupRecord:
    import dataclasses

    return dataclasses.replace(rec, **kw)


def _a_table(gm: fx.GraphModule, weight: fx.Node, fqn: Optional[str], wval: torch.Tensor) -> bool:
    """Whether a float parameter read by indexing is a table: an nn.Embedding / nn.EmbeddingBag's
    weight, or one an embedding op also reads (``F.embedding(ids, self.table)``). (A classifier's
    weight read as ``self.out.weight[labels]`` is not: ``optimizer=`` would claim it.)"""
    if fqn is None or not wval.is_floating_point():
        return False
    if fqn in gm.meta.get(meta.EMBEDDING_WEIGHTS, ()):
        return True
    return any(u.op == "call_function" and u.target in _BAG_OPS | _EMB_OPS and u.args and u.args[0] is weight
               for u in weight.users)


def _index_ids(node: fx.Node) -> Optional[fx.Node]:
    """The ids of ``weight[ids]`` (one index tensor, of int64 or int32: not a mask, nor ``[:, ids]``)
    or of ``index_select(weight, 0, ids)``; else None."""
    if node.target is aten.index_select.default:
        ids = node.args[2] if len(node.args) > 2 else None
        if _arg(node, 1, "dim", None) not in (0, -2):
            return None
    else:
        index = node.args[1] if len(node.args) > 1 else None
        if not isinstance(index, (list, tuple)) or len(index) != 1:
            return None
        ids = index[0]
    val = ids.meta.get("val") if isinstance(ids, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dtype not in (torch.int64, torch.int32):
        return None
    return ids


def _record(gm: fx.GraphModule, node: fx.Node, weight: Optional[fx.Node] = None,
            fold_mean: bool = True) -> Optional[meta.LookupRecord]:
    """``weight``: the node of ``gm``'s graph the lookup's weight is (for a lookup in the body of a
    higher-order op, whose weight is a placeholder of the body), by default its own argument."""
    weight = node.args[0] if weight is None else weight
    ids = _index_ids(node) if node.target in _INDEX_OPS else node.args[1]
    if not isinstance(weight, fx.Node) or not isinstance(ids, fx.Node):
        return None
    wval = weight.meta.get("val")
    if wval is None or wval.dim() != 2:
        return None
    fqn = _param_fqn(gm, weight)
    if node.target in _INDEX_OPS and not _a_table(gm, weight, fqn, wval):
        return None  # (indexing some other tensor: not a table's lookup)
    reasons = []
    written = _written_in_a_block(gm, weight) if fqn is None else None
    if written is not None:  # the table itself, written in place in a no_grad block: left alone, its own name
        fqn = _param_fqn(gm, written[0])
        reasons.append(f"the table is modified in place by {written[1]} in forward")
    param = fqn if fqn is not None else weight.name
    table = param[: -len(".weight")] if param.endswith(".weight") else param
    num_rows, dim = int(wval.shape[0]), int(wval.shape[1])
    if fqn is None:
        reasons.append("the weight is not a parameter of the model (a buffer, or computed in forward)")
    if wval.dtype not in LOWERED_DTYPES:
        reasons.append(f"dtype {wval.dtype}: fxrec lowers float32 and float16 tables")
    mutated = _mutated_in_graph(weight)
    if mutated:
        reasons.append(mutated)

    common = dict(
        table=table, param=param, feature=describe_ids(ids), num_rows=num_rows, dim=dim,
        dtype=str(wval.dtype).replace("torch.", ""), device=str(wval.device), weight=weight,
        ids=ids, source=user_source(node),
        frozen=fqn is not None and not gm.get_parameter(fqn).requires_grad,
    )
    if node.target in _BAG_OPS:
        offsets = _arg(node, 2, "offsets", None)
        sgf = _arg(node, 3, "scale_grad_by_freq", False)
        mode = _arg(node, 4, "mode", 0)
        sparse = _arg(node, 5, "sparse", False)
        psw = _arg(node, 6, "per_sample_weights", None)
        ilo = _arg(node, 7, "include_last_offset", False)
        pad = _arg(node, 8, "padding_idx", None)
        pooling = _MODE_NAMES.get(mode, str(mode))
        if pooling == "max":
            reasons.append("mode='max' (fbgemm TBE pools by sum or mean)")
        if sgf:
            reasons.append("scale_grad_by_freq=True")
        if pad is not None and pad < 0:
            reasons.append(f"negative padding_idx {pad}")
        getitems = {u.args[1]: u for u in node.users if u.op == "call_function" and u.target.__name__ == "getitem"}
        if any(len(u.users) for i, u in getitems.items() if i != 0) or len(getitems) != len(node.users):
            reasons.append("uses embedding_bag's offset2bag/bag_size/max_indices outputs")
        output = getitems.get(0)
        if output is None:
            return None
        if ids.meta.get("val") is not None and ids.meta["val"].dim() != 1:
            reasons.append("ids are not 1-D")
        return meta.LookupRecord(
            node=node, form="bag", pooling=pooling, offsets=offsets, per_sample_weights=psw,
            output=output, nodes=tuple(getitems.values()) + (node,), padding_idx=pad,
            include_last_offset=bool(ilo), sparse=bool(sparse), reason="; ".join(reasons), **common,
        )

    # aten.embedding(weight, ids, padding_idx=-1, scale_grad_by_freq=False, sparse=False); an
    # index form is one without a padding row, with a dense gradient
    indexed = node.target in _INDEX_OPS
    pad = -1 if indexed else _arg(node, 2, "padding_idx", -1)
    sgf = False if indexed else _arg(node, 3, "scale_grad_by_freq", False)
    sparse = False if indexed else _arg(node, 4, "sparse", False)
    if sgf:
        reasons.append("scale_grad_by_freq=True")
    pad = None if pad is None or pad < 0 else int(pad)
    ival = ids.meta.get("val")
    ndim = ival.dim() if ival is not None else -1
    form, pooling, output, nodes = "seq", "none", node, (node,)
    if ndim == 1:
        form, pooling = "single", "sum"
    elif ndim == 2 and len(node.users) == 1:
        user = next(iter(node.users))
        if user.op == "call_function" and user.target in _POOL_OPS:
            dims = _arg(user, 1, "dim", None)
            keepdim = _arg(user, 2, "keepdim", False)
            dtype = user.kwargs.get("dtype")
            if dims is not None and list(dims) in ([1], [-2]) and not keepdim and dtype is None \
                    and (fold_mean or _POOL_OPS[user.target] != "mean"):
                form, pooling, output, nodes = "pooled_seq", _POOL_OPS[user.target], user, (user, node)
    return meta.LookupRecord(
        node=node, form=form, pooling=pooling, offsets=None, per_sample_weights=None, output=output,
        nodes=nodes, padding_idx=pad, sparse=bool(sparse), reason="; ".join(reasons), **common,
    )
