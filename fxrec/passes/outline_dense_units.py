"""outline_dense_units: give each dense submodule's operations back to a call of that submodule, so
that FSDP shards it as a unit of its own (``transform(plan=, dense="fsdp")``).

The transformed graph reads every parameter by ``get_attr`` and runs the captured operations; no
submodule's forward runs, so FSDP's per-module hooks (gather before its forward, free after it,
gather again for its backward, reduce-scatter after it) would never run either, and the whole
model would be one unit: every dense parameter whole on every rank for the whole step.

Before (gm.code)::

    mlp_0_weight = fxrec_attr(self, ('mlp', '0'), 'weight')
    ...
    linear = torch.ops.aten.linear.default(getitem_4, mlp_0_weight, mlp_0_bias)
    relu = torch.ops.aten.relu.default(linear)

After::

    mlp_0 = self.mlp.0(getitem_4)                      # FSDP's hooks run around this call
    relu = torch.ops.aten.relu.default(mlp_0)

and ``fast.mlp[0].forward`` is a :class:`UnitForward`: a graph of the operations moved, called
with the submodule, reading its parameters through :func:`fxrec.codegen.fxrec_attr` when it runs
(FSDP registers the gathered parameters on the module for the call, and its chunks after).

Units, by rule (``node.meta["nn_module_stack"]`` says which call of which module each operation
belongs to): walking the calls from the model's forward down, a submodule becomes a unit when

* it holds no embedding table or table shard (those stay out of FSDP), and holds a parameter;
* it is not one of torch's containers (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict``):
  their layers are the units, as FSDP is usually applied per layer or block;
* the model's forward calls it once (a module called twice, shared layers, would be gathered
  and freed twice per step; its operations stay in the model's own unit);
* its operations can be moved to one place: no operation outside it lies between two of them and
  depends on one and feeds another, none of those between has side effects (a grad mode switch,
  an in-place write, a random draw), and no operation outside it reads its parameters or buffers,
  nor does another module hold one of them (tied weights);
  it has no ``no_grad`` / autocast block, does not write its inputs in place, returns no view of
  its own parameters or buffers (FSDP frees the gathered parameters after the call), and no view
  it returns is written in place after it.

Where a submodule is not a unit, the walk goes on into the modules it calls. What no unit takes
stays in the model's own FSDP unit (the root), whole for the whole step.

Units are made only where they at least halve the dense parameter bytes whole at once (the
model's own unit plus its largest other unit, against all of them): each unit is gathered twice a
step (forward and backward) where the model's one unit is gathered once. Measured
(``benchmarks/bench_fsdp.py``, world size 2, gloo, Adam): with eight 1024 x 1024 layers the peak
of a step was 36-40 MB with units and 90 MB as one unit (DDP: 47 MB), each step 1.2x one unit's;
with two layers, one of them 89 % of the bytes, units lowered the peak by 3-5 % for 1.2x the
time, so that model stays one unit. Nothing is moved unless ``dense="fsdp"``.

``transform(fsdp_units=)`` replaces the halving rule (never the rest: it is what makes a unit
correct): ``"one"`` makes no unit, ``"every"`` every one the walk finds, and a list of submodule
paths exactly those, each checked first (a ValueError naming the first that cannot be a unit and
why, before anything moves; units do not nest, by name or by one's call running inside another's),
their moves rehearsed on a copy of the graph.
"""

from __future__ import annotations

import operator
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.fx as fx

from ..codegen import fxrec_attr
from ..dataflow import _is_view, is_impure, schema_args
from ..graph_module import HeldList

#: what the model's nn.Sequential / nn.ModuleList / nn.ModuleDict are in the transformed model
_CONTAINERS = (HeldList,)

#: ``node.meta`` key of a unit's call node: the submodule's path
UNIT = "fxrec_dense_unit"


class UnitForward:
    """A submodule's forward in a transformed model whose dense layers FSDP shards per unit: the
    captured operations of its one call (``graph_module``, whose first input is the submodule)."""

    def __init__(self, graph_module: fx.GraphModule, owner: torch.nn.Module, path: str):
        self.graph_module = graph_module
        self.path = path
        self.owner = owner  # (a cycle, the module holding this as its forward: a copy of the module copies both)

    def __call__(self, *args):
        return self.graph_module(self.owner, *args)

    @property
    def code(self) -> str:
        return self.graph_module.code

    def __repr__(self) -> str:
        return f"UnitForward('{self.path}': the captured operations of its call, as fxrec runs them)"


def _calls(node: fx.Node) -> List[Tuple[str, str]]:
    """(call key, module path) of each module call the node runs in, outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    return [(str(k), str(v[0])) for k, v in stack.items()]


def _under(name: str, path: str) -> bool:
    return path == "" or name == path or name.startswith(path + ".")


def _rel(target: str, path: str) -> Tuple[Tuple[str, ...], str]:
    parts = target[len(path) + 1:].split(".")
    return tuple(parts[:-1]), parts[-1]


def outline_dense_units(gm: fx.GraphModule, leave: Set[str], choose=None) -> List[str]:
    """Move each dense unit's operations into a call of its submodule (see the module doc).
    ``leave``: the names of the table parameters (and shards). ``choose``: None (the rule),
    ``"one"`` (no unit but the model's own), ``"every"`` (every submodule the walk finds, whether or
    not they halve the bytes) or a list of submodule paths, each of which must be able to be a unit
    (else a ValueError naming it and why; ``transform(fsdp_units=)``). Returns the units' paths,
    in the order their calls run."""
    if choose == "one":
        return []
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    members: Dict[str, List[fx.Node]] = {}
    paths: Dict[str, Set[str]] = {}  # path -> its call keys
    children: Dict[str, List[str]] = {"": []}
    for n in graph.nodes:
        calls = _calls(n)
        for i, (key, path) in enumerate(calls):
            members.setdefault(key, []).append(n)
            paths.setdefault(path, set()).add(key)
            parent = calls[i - 1][1] if i else None
            if parent is not None and path != parent and path not in children.setdefault(parent, []):
                children[parent].append(path)
    params = {n: p for n, p in gm.named_parameters() if n not in leave}

    def why_not(path: str, module) -> Optional[str]:
        """Why ``path`` cannot be a unit; None where it can."""
        held = sorted(t for t in leave if _under(t, path))
        if held:
            return f"it holds the embedding table {held[0]!r} (tables stay out of FSDP)"
        if not any(_under(p, path) for p in params):
            return "it holds no dense parameter"
        if isinstance(module, _CONTAINERS):
            return f"it is the model's {module._fxrec_kind} (its layers can be units)"
        if path not in paths:
            return "the model's forward runs none of its operations (captured)"
        if len(paths[path]) > 1:
            return f"the model's forward calls it {len(paths[path])} times (a unit is called once)"
        return _outline(gm, path, members[next(iter(paths[path]))], order, move=False)

    if isinstance(choose, (list, tuple)):
        return _named_units(gm, list(choose), why_not, lambda u: members[next(iter(paths[u]))], set(paths))
    found: List[str] = []
    todo = list(children.get("", []))
    while todo:
        path = todo.pop(0)
        module = _module(gm, path)
        if module is None:
            continue
        if why_not(path, module) is None:
            found.append(path)
            continue
        if any(_under(p, path) for p in params):
            todo.extend(children.get(path, []))
    size = {u: sum(p.numel() * p.element_size() for n, p in params.items() if _under(n, u)) for u in found}
    if not found or (choose != "every" and
                     not halves(list(size.values()), sum(p.numel() * p.element_size() for p in params.values()))):
        return []  # (one unit gathers once a step)
    # (checked again as each moves: one whose operations lie between another's, moved first, is left
    # alone now, and the size rule was judged with it; the numbers are the model's either way)
    units = []
    for u in found:  # (the order anew for each: a move puts nodes before the call it makes)
        order = {n: i for i, n in enumerate(graph.nodes)}
        if _outline(gm, u, members[next(iter(paths[u]))], order, move=True) is None:
            units.append(u)
    return _finish(gm, units)


def _named_units(gm: fx.GraphModule, names: List[str], why_not, ops_of, called: Set[str]) -> List[str]:
    """The units ``transform(fsdp_units=[...])`` names, each checked (a ValueError naming the first
    that cannot be one, and why), then moved: first on a copy of the graph, so that a name another's
    move would leave unable to be one is an error before the model changes. ``called``: the
    submodules the forward calls."""
    for i, u in enumerate(names):
        if u == "":
            raise ValueError("fxrec: fsdp_units: '' is the model itself, always a unit: its own, for what no other takes")
        module = _module(gm, u)
        if module is None and u in called:  # (the transformed model keeps only modules holding tensors)
            raise ValueError(f"fxrec: fsdp_units: submodule {u!r} cannot be an FSDP unit: it holds no dense parameter")
        if module is None:
            raise ValueError(f"fxrec: fsdp_units: the model has no submodule {u!r} that its forward calls")
        why = why_not(u, module)
        if why is not None:
            raise ValueError(f"fxrec: fsdp_units: submodule {u!r} cannot be an FSDP unit: {why}")
    for i, u in enumerate(names):  # (by name, or called from inside the other's call: a module passed to it)
        for v in names[i + 1:]:
            outer, inner = (u, v) if _under(v, u) or set(ops_of(v)) <= set(ops_of(u)) else (v, u)
            if _under(inner, outer) or set(ops_of(u)) & set(ops_of(v)):
                raise ValueError(f"fxrec: fsdp_units: {inner!r} runs inside the call of {outer!r}, also named: units "
                                 "do not nest (name the outer module or the inner ones)")
    trial = fx.Graph()
    copies: Dict[fx.Node, fx.Node] = {}
    trial.output(trial.graph_copy(gm.graph, copies))
    for k, u in enumerate(names):  # (a rehearsal: the same moves on the copy, the modules left alone)
        order = {n: i for i, n in enumerate(trial.nodes)}
        why = _outline(gm, u, [copies[n] for n in ops_of(u)], order, move=True, graph=trial)
        if why is not None:  # (another unit's move left this one's operations apart)
            raise ValueError(f"fxrec: fsdp_units: submodule {u!r} cannot be an FSDP unit once "
                             f"{', '.join(repr(v) for v in names[:k])} {'is' if k == 1 else 'are'}: {why}")
    for u in names:
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        why = _outline(gm, u, ops_of(u), order, move=True)
        assert why is None, (u, why)  # (the rehearsal made the same moves)
    return _finish(gm, names)


def _finish(gm: fx.GraphModule, units: List[str]) -> List[str]:
    if units:
        at = {n.meta[UNIT]: i for i, n in enumerate(gm.graph.nodes) if UNIT in n.meta}
        units.sort(key=at.__getitem__)
        gm.graph.lint()
        gm.recompile()
    return units


def halves(unit_bytes: List[int], total: int) -> bool:
    """Whether units of these sizes at least halve the dense bytes whole at once: the model's own
    unit (what no unit takes) and the largest other, against all ``total`` of them."""
    return (total - sum(unit_bytes)) + max(unit_bytes) <= total / 2


def _flag(node: fx.Node) -> bool:
    """A module's ``training`` flag (fxrec.modes): read where the model runs, passed to the unit."""
    return str(node.target).rpartition(".")[2] == "training"


def _a_view(node: fx.Node) -> bool:
    return any(_is_view(a, node) for a in node.all_input_nodes)


def _views(starts: List[fx.Node], inside: Set[fx.Node]) -> Set[fx.Node]:
    """``starts`` and the nodes in ``inside`` that may share their memory (views of views...)."""
    seen, todo = set(starts), list(starts)
    while todo:
        x = todo.pop()
        for u in x.users:
            if u in inside and u not in seen and _is_view(x, u):
                seen.add(u)
                todo.append(u)
    return seen


def _written(starts: List[fx.Node], where) -> bool:
    """Whether a node ``where`` takes writes in place to one of ``starts`` or a view of one."""
    seen, todo = set(starts), list(starts)
    while todo:
        x = todo.pop()
        for u in x.users:
            if where(u) and any(a.alias_info is not None and a.alias_info.is_write and x in nodes
                                for a, nodes in schema_args(u)):
                return True
            if u not in seen and _is_view(x, u):
                seen.add(u)
                todo.append(u)
    return False


def _module(gm: fx.GraphModule, path: str) -> Optional[torch.nn.Module]:
    try:
        return gm.get_submodule(path)
    except AttributeError:
        return None


def _read_outside(attr: fx.Node) -> str:
    if any(isinstance(u.target, torch._ops.HigherOrderOperator) for u in attr.users):
        return "its parameters are read in a no_grad / autocast block of the model (called there, or read)"
    return f"its {attr.target!r} is read outside its call too"


def _outline(gm: fx.GraphModule, path: str, ops: List[fx.Node], order: Dict[fx.Node, int], move: bool,
             graph: Optional[fx.Graph] = None) -> Optional[str]:
    """Why ``ops`` (the operations of ``path``'s one call) cannot move into its forward, or None
    where they can; with ``move``, move them. ``graph``: a copy of ``gm``'s to move them in, the
    module's forward left as it is (a rehearsal)."""
    rehearsal = graph is not None
    graph = gm.graph if graph is None else graph
    inside = set(ops)
    if any(isinstance(n.target, torch._ops.HigherOrderOperator) for n in ops):
        return "it has a no_grad / autocast block"  # (its body is the model's attribute)
    other = next((n for n in ops if n.op not in ("call_function", "call_method")), None)
    if other is not None:
        return f"its operations include {other.op} {other.name}"
    module = gm.get_submodule(path)
    mine = {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}
    held = list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False))
    tied = next((n for n, t in held if id(t) in mine and not n.startswith(path + ".")), None)
    if tied is not None:  # (tied weights: FSDP would manage the parameter twice)
        return f"it shares a parameter or buffer with another module ({tied!r}: tied)"
    # the attributes its operations read: the submodule's own move with them
    reads = sorted({a for n in ops for a in n.all_input_nodes if a.op == "get_attr"}, key=order.__getitem__)
    own = [a for a in reads if isinstance(a.target, str) and _under(a.target, path) and not _flag(a)]
    read = next((a for a in own if any(u not in inside for u in a.users)), None)
    if read is not None:  # something else reads them (they would be freed, or gathered twice)
        return _read_outside(read)
    for n in graph.nodes:  # nothing else reads its parameters or buffers, nor the module itself
        if n.op == "get_attr" and n not in own and isinstance(n.target, str) and _under(n.target, path) \
                and not _flag(n):
            if n.users:
                return _read_outside(n)
        if n.op == "call_module" and _under(str(n.target), path):
            return f"the graph calls {n.target!r} ({n.name})"
    inside |= set(own)
    first, last = min(ops, key=order.__getitem__), max(ops, key=order.__getitem__)
    before, after = [], set()
    n = first
    while n is not last:
        n = n.next
        if n not in inside:
            if is_impure(n):
                return f"{n.name}, an operation with side effects outside it, runs between its operations"
            if any(a in inside or a in after for a in n.all_input_nodes):
                after.add(n)
            else:
                before.append(n)
    apart = next((a for o in ops for a in o.all_input_nodes if a in after), None)
    if apart is not None:  # a node outside it between two of its operations: it cannot be one call
        return f"{apart.name}, outside it, takes one of its results and feeds another of its operations"
    inputs: List[fx.Node] = []
    for o in ops:
        for a in o.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [o for o in ops if any(u not in inside for u in o.users)]
    # (FSDP's hooks on an input written in place inside it, or on a view it returns written, would be lost)
    if _written(inputs, lambda u: u in inside):
        return "it writes one of its inputs in place"
    if _written([o for o in outputs if _a_view(o)], lambda u: True):
        return "a view it returns is written in place after it"
    if _views(own, inside) & set(outputs):
        return "it returns a view of its own parameter or buffer"  # (FSDP frees the gathered one after it)
    if not move:
        return None

    sub = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    unit = sub.placeholder("unit")
    for a in inputs:
        env[a] = sub.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for a in own:
        mods, name = _rel(a.target, path)
        env[a] = sub.create_node("call_function", fxrec_attr, (unit, mods, name), name=a.name)
        env[a].meta = dict(a.meta)
    for o in ops:
        env[o] = sub.node_copy(o, lambda x: env[x])
    sub.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
    sub.lint()
    if not rehearsal:
        object.__setattr__(module, "forward", UnitForward(fx.GraphModule(torch.nn.Module(), sub), module, path))

    for b in before:
        first.prepend(b)
    with graph.inserting_before(first):
        call = graph.call_module(path, tuple(inputs))
    call.meta["nn_module_stack"] = {k: v for k, v in (first.meta.get("nn_module_stack") or {}).items()
                                    if str(v[0]) != path and not _under(str(v[0]), path + ".")}
    call.meta[UNIT] = path
    if len(outputs) == 1:
        call.meta["val"] = outputs[0].meta.get("val")
        outputs[0].replace_all_uses_with(call, delete_user_cb=lambda u: u not in inside)
    else:
        at = call
        for i, o in enumerate(outputs):
            with graph.inserting_after(at):
                at = graph.call_function(operator.getitem, (call, i))
            at.meta["val"] = o.meta.get("val")
            o.replace_all_uses_with(at, delete_user_cb=lambda u: u not in inside)
    for o in reversed(ops):
        graph.erase_node(o)
    for a in own:
        graph.erase_node(a)
    return None
