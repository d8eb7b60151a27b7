"""The order a graph's nodes must keep, and moving them within it.

Passes that move nodes (group_lookups, to give each group one place to stand) or merge equal
computations (merge_lookups) need the same facts: what besides data flow orders two nodes. Here:

* :class:`SideEffects`: impure nodes (placeholders, in-place ops, random ops, asserts, module
  calls) keep their relative order; the output stays last; for an op that writes one of its
  arguments (schema ``alias_info.is_write``, e.g. an ``add_`` on an input), every other user of
  that argument (or of a view of it) stays on the side of the write it was on;
* :func:`reorder`: a stable topological sort under those edges, with extra "places" (a set of
  inputs that must all come before a set of users);
* :func:`reaches`: whether one node is reached from others, walking back;
* :func:`reads_contiguous`: whether a user needs a tensor laid out as a contiguous one;
* :func:`carries_gradient`: whether a gradient can flow back to a node's value;
* :func:`needs_gradient`: whether a node's value is computed from parameters that train.

These know nothing of lookups or groups.
"""

from __future__ import annotations

import heapq
import operator
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx

aten = torch.ops.aten

# Ops whose result may share storage with their first argument though their schema does not say so.
_MAY_ALIAS = {aten.reshape.default, aten.flatten.using_ints, aten.contiguous.default, aten.reshape_as.default,
              aten.view_as.default, aten.expand_as.default, aten.unflatten.int}

# Ops that need their first argument laid out as a contiguous tensor (as PyTorch's lookups give
# theirs): a view refuses some shapes of a column slice ("view size is not compatible with input
# tensor's size and stride"), and an ``as_strided`` reads memory by strides (other columns).
# Every other op gives the same values whatever the layout (``reshape`` copies where it must).
_READS_LAYOUT = {aten.view.default, aten.view.dtype, aten._unsafe_view.default, aten.view_as.default,
                 aten.view_copy.default, aten.as_strided.default, aten.as_strided_copy.default,
                 aten.view_as_complex.default}


# Ops that view their first argument where its layout allows and copy it otherwise: on a tensor
# whose layout depends on a size (a column slice is contiguous only for one row), torch.export
# guards that size to choose (``Guard failed: s != 1``); given a contiguous tensor, they view it.
RESHAPES = {aten.reshape.default, aten.flatten.using_ints, aten.reshape_as.default, aten.unflatten.int}


def is_impure(node: fx.Node) -> bool:
    """Whether ``node`` has an effect beyond its result (its place among such nodes is kept). A
    higher-order op (``torch.no_grad()`` / ``torch.autocast`` blocks, control flow) has one where
    its body does (:func:`hop_effects`)."""
    if node.op in ("placeholder", "output", "call_module", "call_method"):
        return True
    if node.op != "call_function":
        return False
    if isinstance(node.target, torch._ops.HigherOrderOperator):
        return hop_effects(node)[0]
    try:
        return node.is_impure()
    except Exception:  # noqa: BLE001 - what cannot be told is kept in place
        return True


def bodies(node: fx.Node) -> List[Tuple[fx.GraphModule, List[Optional[fx.Node]]]]:
    """The graphs a higher-order op's call runs (its GraphModule arguments), each with the outer
    node each of its placeholders takes (the operands after the body, in order; None where
    unknown). Empty for any other node."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return []
    root = node.graph.owning_module
    name = getattr(node.target, "__name__", "")
    out = []
    for i, a in enumerate(node.args):
        if not isinstance(a, fx.Node) or a.op != "get_attr" or root is None:
            continue
        try:
            sub = root.get_submodule(a.target)
        except AttributeError:
            continue
        if isinstance(sub, fx.GraphModule):
            if name in _FLAT_OPERANDS:  # the operands follow the body
                given = list(node.args[i + 1:])
            elif name == "cond" and len(node.args) > 3 and isinstance(node.args[3], (list, tuple)):
                given = list(node.args[3])  # cond(pred, true_fn, false_fn, operands)
            else:
                given = []  # an op whose operands fxrec does not know how to read: unknown
            operands = [x if isinstance(x, fx.Node) else None for x in given]
            holders = [n for n in sub.graph.nodes if n.op == "placeholder"]
            out.append((sub, [operands[k] if k < len(operands) else None for k in range(len(holders))]))
    return out


#: higher-order ops called as (..., body, *operands): the body's placeholders take the operands
_FLAT_OPERANDS = ("wrap_with_set_grad_enabled", "wrap_with_autocast")


def hop_effects(node: fx.Node) -> Tuple[bool, List[fx.Node], List[fx.Node]]:
    """``(impure, written, aliased)`` of a higher-order op's call, from the graphs it runs:
    whether they hold an impure node (an assert, a random op) or a write to what they are given;
    the operands they write in place (or a view of); the operands their results may share memory
    with (a view of one returned). Where no body can be read: impure, writing and sharing every
    operand."""
    found = bodies(node)
    if not found or any(o is None for _, operands in found for o in operands):
        operands = [x for x in node.all_input_nodes if x.op != "get_attr" or not _is_body(node, x)]
        return True, operands, operands
    impure, written, aliased = False, [], []
    for body, operands in found:
        nodes = list(body.graph.nodes)
        effects = SideEffects(nodes)  # (its bodies' higher-order ops read once each, in there)
        impure = impure or any(n.op != "placeholder" for n in effects.impure)
        returned = {effects.alias_root(x) for x in nodes[-1].all_input_nodes} if nodes[-1].op == "output" else set()
        holders = [n for n in nodes if n.op == "placeholder"]
        for h, o in zip(holders, operands):
            if h in effects.written:
                written.append(o)
            if effects.alias_root(h) in returned:
                aliased.append(o)
    return impure or bool(written), written, aliased


def _is_body(node: fx.Node, a: fx.Node) -> bool:
    root = node.graph.owning_module
    try:
        return root is not None and isinstance(root.get_submodule(a.target), fx.GraphModule)
    except AttributeError:
        return False


def schema_args(node: fx.Node):
    """(schema argument, the nodes passed for it) of an ATen op's call."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return
    for i, a in enumerate(schema.arguments):
        val = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
        nodes = [v for v in (val if isinstance(val, (list, tuple)) else (val,)) if isinstance(v, fx.Node)]
        if nodes:
            yield a, nodes


class SideEffects:
    """The ordering edges that side effects add to the data flow of ``nodes`` (the graph's nodes in
    order): ``preds[n]`` are the nodes that must stay before ``n`` besides its inputs. Every edge
    goes forward in the given order. ``written`` holds every node whose value an op writes in
    place (with its views): two equal computations on them are not the same value."""

    def __init__(self, nodes: Sequence[fx.Node]):
        pos = {n: i for i, n in enumerate(nodes)}
        parent: Dict[fx.Node, fx.Node] = {}

        def find(x):
            root = x
            while parent.get(root, root) is not root:
                root = parent[root]
            while parent.get(x, x) is not root:
                parent[x], x = root, parent[x]
            return root

        def union(a, b):
            ra, rb = find(a), find(b)
            if ra is not rb:
                parent[ra] = rb

        writes: List[Tuple[fx.Node, List[fx.Node], bool]] = []  # (writer, what it writes, a real write)
        impure: List[fx.Node] = []
        for n in nodes:
            if n.op in ("output", "placeholder", "get_attr"):
                if n.op == "placeholder":
                    impure.append(n)
                continue
            if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator):
                hop_impure, hop_written, hop_aliased = hop_effects(n)  # (once: it reads the bodies)
                if hop_impure:
                    impure.append(n)
                for x in hop_aliased:  # its results are (views of) these
                    union(n, x)
                if hop_written:
                    writes.append((n, hop_written, True))
                continue
            if is_impure(n):
                impure.append(n)
            if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node):
                union(n, n.args[0])
                continue
            if n.op == "call_function" and n.target in _MAY_ALIAS and n.args and isinstance(n.args[0], fx.Node):
                union(n, n.args[0])
            schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
            if schema is None:
                if is_impure(n) and n.all_input_nodes:
                    # an effect we cannot see into keeps its place with respect to everything that
                    # reads what it is given; a Python function (a batch counter) may write them
                    writes.append((n, list(n.all_input_nodes), n.op == "call_function"))
                continue
            returns_alias = any(r.alias_info is not None for r in schema.returns)
            w: List[fx.Node] = []
            for a, arg_nodes in schema_args(n):
                if a.alias_info is None:
                    continue
                if returns_alias:
                    for x in arg_nodes:
                        union(n, x)
                if a.alias_info.is_write:
                    w.extend(arg_nodes)
            if w:
                writes.append((n, w, True))

        # The model's inputs may share memory at call time (the same tensor passed twice, or a view
        # of another input): where one is written in place, every input may be.
        inputs = [n for n in nodes if n.op == "placeholder"]
        if any(real and find(x) in {find(p) for p in inputs} for _, ws, real in writes for x in ws):
            for p in inputs[1:]:
                union(p, inputs[0])
        self.alias_root = find  # the node standing for everything that may share memory with a node
        self.impure = impure  # the impure nodes, in order (placeholders included)
        self.preds: Dict[fx.Node, List[fx.Node]] = {}
        for a, b in zip(impure, impure[1:]):
            self.preds.setdefault(b, []).append(a)
        roots = {find(x) for _, ws, _ in writes for x in ws}
        members: Dict[fx.Node, List[fx.Node]] = {}
        for n in nodes:
            r = find(n)
            if r in roots:
                members.setdefault(r, []).append(n)
        self.written: Set[fx.Node] = set()
        for w, targets, real in writes:
            for root in {find(x) for x in targets}:
                if real:
                    self.written.update(members[root])
                for m in members[root]:
                    for u in m.users:
                        if u is w or u.op == "output":
                            continue
                        if pos[u] < pos[w]:
                            self.preds.setdefault(w, []).append(u)
                        else:
                            self.preds.setdefault(u, []).append(w)
        self._succs: Dict[fx.Node, List[fx.Node]] = {}
        for b, ps in self.preds.items():
            for a in ps:
                self._succs.setdefault(a, []).append(b)

    def all_preds(self, n: fx.Node) -> List[fx.Node]:
        extra = self.preds.get(n)
        return n.all_input_nodes + extra if extra else n.all_input_nodes

    def followers(self, n: fx.Node) -> List[fx.Node]:
        """The nodes that must stay after ``n`` besides its data users (an in-place write to what
        ``n`` reads, a later side effect): ``preds`` read the other way."""
        return self._succs.get(n, [])


def reaches(start: fx.Node, targets: Set[fx.Node], preds: Callable[[fx.Node], List[fx.Node]]) -> Optional[fx.Node]:
    """A node of ``targets`` from which ``start`` is reached (walking back over ``preds``), or None."""
    seen = {start}
    todo = list(preds(start))
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in targets:
            return n
        todo.extend(preds(n))
    return None


def carries_gradient(node: fx.Node) -> bool:
    """Whether a gradient can reach ``node``'s value: False only where every chain of its users
    ends at a ``detach``, a ``torch.no_grad()`` block that neither writes it in place nor hands it
    back, a result of integer or bool dtype (``argmax``,
    a comparison) or a result nothing uses; True where one reaches the graph's output, a side
    effect or anything else (what cannot be told carries one)."""
    seen: Set[fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            if u.op != "call_function":
                return True  # the output, a module call
            if u.target is aten.detach.default:
                continue
            if getattr(u.target, "__name__", "") == "wrap_with_set_grad_enabled" and u.args and u.args[0] is False:
                _, written, aliased = hop_effects(u)
                if n in written or n in aliased:
                    return True  # (written in place in there, or handed back: the value still carries one)
                continue
            val = u.meta.get("val")
            if isinstance(val, torch.Tensor) and not (val.is_floating_point() or val.is_complex()):
                continue
            if _only_checks(u):
                continue  # (``x.float()`` of a float tensor captures as such an assert beside the ``to``)
            if isinstance(u.target, torch._ops.HigherOrderOperator) or is_impure(u):
                return True
            todo.append(u)
    return False


#: ops whose result reads only the shape (and dtype, device) of their tensor argument
_SHAPE_ONLY = {getattr(aten, op).default for op in ("ones_like", "zeros_like", "empty_like", "full_like", "rand_like",
                                                     "randn_like", "new_ones", "new_zeros", "new_empty", "new_full")
               if hasattr(getattr(aten, op, None), "default")}


def needs_gradient(node: fx.Node) -> bool:
    """Whether ``node``'s value needs a gradient: computed, in float, from a parameter that
    requires grad (a ``get_attr`` whose value does), not through a ``detach``, a result of a
    ``torch.no_grad()`` block or an integer or bool result. The graph's inputs are taken as not
    needing one (a tensor given that does is told at the call)."""
    seen: Set[fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and not (val.is_floating_point() or val.is_complex()):
            continue
        if val is not None and not isinstance(val, (torch.Tensor, tuple, list)):
            continue  # a size or another number: no gradient flows through it
        if n.op == "call_function" and n.target in _SHAPE_ONLY:
            continue  # (a new tensor of another's shape: ones_like(x) needs no gradient)
        if n.op == "get_attr":
            if bool(getattr(val, "requires_grad", False)):
                return True
            continue
        if n.op != "call_function" or n.target is aten.detach.default:
            continue
        if n.target is operator.getitem and isinstance(n.args[0], fx.Node) and \
                getattr(n.args[0].target, "__name__", "") == "wrap_with_set_grad_enabled" and \
                n.args[0].args and n.args[0].args[0] is False:
            continue  # (a result of a no_grad block)
        todo.extend(n.all_input_nodes)
    return False


def block_reads(hop: fx.Node, operand: fx.Node) -> bool:
    """Whether the higher-order op ``hop`` (a ``torch.no_grad()`` or ``torch.autocast`` block)
    reads ``operand`` other than by the lookups inside it (their records say how) in a way a
    gradient may reach it: a tied output layer in an autocast block does; a no_grad block that
    neither writes it nor hands it back does not. Where the body cannot be read: it does."""
    if getattr(hop.target, "__name__", "") == "wrap_with_set_grad_enabled" and hop.args and hop.args[0] is False:
        _, written, aliased = hop_effects(hop)
        return operand in written or operand in aliased
    found = bodies(hop)
    if not found:
        return True
    from . import meta

    for body, operands in found:
        holders = [n for n in body.graph.nodes if n.op == "placeholder"]
        for h, o in zip(holders, operands):
            if o is None:
                return True
            if o is not operand:
                continue
            for u in h.users:
                if meta.LOOKUP in u.meta:
                    continue
                if isinstance(u.target, torch._ops.HigherOrderOperator):
                    if block_reads(u, h):
                        return True
                    continue
                return True
    return False


def _only_checks(node: fx.Node) -> bool:
    """Whether ``node`` is an ATen op that returns nothing and writes none of its arguments: a check
    of its inputs (``_assert_tensor_metadata``, ``_assert_async``), impure only in that it may
    raise. No value, and so no gradient, flows through it."""
    schema = getattr(node.target, "_schema", None)
    return (schema is not None and not schema.returns
            and not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments))


def reads_contiguous(node: fx.Node, user: fx.Node, top: bool = True) -> bool:
    """Whether ``user`` needs ``node``'s value laid out as a contiguous tensor, itself or through
    views of it that it (or what reads them) makes: an op of ``_READS_LAYOUT`` (a ``.view``; the
    ``.contiguous()`` the model wrote before it is gone from the capture when its tensor was
    contiguous there), a higher-order op whose body does (or whose body cannot be read), or, with
    ``top``, the graph's output (the caller gets the tensor and may ``.view`` it too). Following
    ``aten.contiguous`` stops: what it gives is contiguous."""
    todo, seen = [(node, user)], set()
    while todo:
        x, u = todo.pop()
        if (x, u) in seen:
            continue
        seen.add((x, u))
        if u.op == "output":
            if top:
                return True
            continue
        if u.op != "call_function":
            continue
        if u.target in _READS_LAYOUT and u.args and u.args[0] is x:
            return True
        if isinstance(u.target, torch._ops.HigherOrderOperator):
            found = bodies(u)
            if not found or any(o is None for _, operands in found for o in operands):
                return True
            for body, operands in found:
                holders = [n for n in body.graph.nodes if n.op == "placeholder"]
                if any(o is x and any(reads_contiguous(h, w, top=False) for w in h.users)
                       for h, o in zip(holders, operands)):
                    return True
            if x in hop_effects(u)[2]:  # its results are views of x
                todo.extend((u, w) for w in u.users)
        elif _is_view(x, u):
            todo.extend((u, w) for w in u.users)
    return False


def _is_view(x: fx.Node, u: fx.Node) -> bool:
    """Whether ``u``'s result may share memory with ``x`` (the same tensor, or a view of it)."""
    if u.target is aten.contiguous.default:
        return False
    if u.target is operator.getitem or u.target in _MAY_ALIAS:
        return bool(u.args) and u.args[0] is x
    schema = getattr(u.target, "_schema", None)
    if schema is None or not any(r.alias_info is not None for r in schema.returns):
        return False
    return any(a.alias_info is not None and x in nodes for a, nodes in schema_args(u))


def reorder(graph: fx.Graph, nodes: List[fx.Node], effects: SideEffects,
            places: Sequence[Tuple[Set[fx.Node], Set[fx.Node]]]) -> int:
    """Move ``nodes`` (the graph's nodes in order, output last) into a stable topological order of
    their data flow and side effects in which, for each ``(inputs, users)`` of ``places``, every
    input comes before every user: a place where one call can stand that reads all the inputs
    and feeds all the users. Kahn's algorithm, ties broken by the original position, so a graph
    already in such an order is left as it is. Returns how many nodes changed place."""
    out_node = nodes[-1]
    assert out_node.op == "output"
    real = nodes[:-1]
    index = {n: i for i, n in enumerate(real)}
    n_real = len(real)
    succ: List[List[int]] = [[] for _ in range(n_real + len(places))]
    indeg = [0] * (n_real + len(places))

    def edge(a: int, b: int) -> None:
        succ[a].append(b)
        indeg[b] += 1

    for n in real:
        for p in set(effects.all_preds(n)):
            edge(index[p], index[n])
    for k, (ins, users) in enumerate(places):
        v = n_real + k
        for x in ins:
            edge(index[x], v)
        for u in users:
            if u is not out_node:
                edge(v, index[u])
    heap = [(i, i) for i in range(n_real) if indeg[i] == 0] + [(-1, v) for v in range(n_real, len(indeg)) if indeg[v] == 0]
    heapq.heapify(heap)
    order: List[int] = []
    while heap:
        _, i = heapq.heappop(heap)
        if i < n_real:
            order.append(i)
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                heapq.heappush(heap, (j if j < n_real else -1, j))
    if len(order) != n_real:
        raise RuntimeError("fxrec: no order of the graph's nodes gives every call a place (a cycle through one)")
    moved = sum(1 for k, i in enumerate(order) if k != i)
    if moved:
        for i in order:
            out_node.prepend(real[i])
    return moved
