"""Pictures of fxrec graphs: what the compiler found and what it made of it.

    fxrec.viz.draw(fast, "graph.svg")          # or .png / .pdf / .dot
    fxrec.transform(model, inputs, dump_dir="dump")   # 00_captured.svg, 01_annotate_lookups.svg, ...

Every node is coloured by its kind (:func:`node_kind`): dense ops, embedding lookups still in the
graph, fxrec's TBE groups, quantized groups, collectives. Labels give shapes and dtypes where
torch recorded them (``node.meta["val"]`` / ``["tensor_meta"]``). Graphs stay readable when they
are large: dense ops are drawn inside one cluster per submodule (``node.meta["nn_module_stack"]``),
and when there are many of them each run of dense ops of one submodule becomes a single box;
parameters are folded into the labels of the nodes that read them, ``getitem`` of a multi-output
node into the edge it feeds, and list inputs (``ids_0 … ids_25``) into one input node.

Building the DOT text needs only the ``graphviz`` Python package (a dependency of fxrec);
rendering it (SVG, PNG, PDF) needs Graphviz's ``dot`` program: ``apt-get install graphviz`` on
Debian/Ubuntu (``brew install graphviz``, ``conda install graphviz`` elsewhere).
"""

from __future__ import annotations

import operator
import os
import re
import shutil
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.fx as fx

from . import meta
from .runtime.quantized import QuantizedPooledGroup, QuantizedSequenceGroup
from .runtime.group import EmbeddingGroup

__all__ = [
    "KINDS", "KIND_COLORS", "GraphvizMissing", "node_kind", "to_dot", "draw", "render",
    "check_graphviz", "pass_dumper",
]

INSTALL = (
    "install Graphviz: the 'dot' program from your system's package manager (Debian/Ubuntu: "
    "'apt-get install graphviz'; macOS: 'brew install graphviz'; conda: 'conda install graphviz') "
    "and the Python binding from PyPI ('pip install graphviz', a dependency of fxrec)"
)

#: Every kind :func:`node_kind` returns, in legend order.
KINDS = ("input", "output", "param", "dense", "lookup", "group", "quantized", "collective")

#: Fill colour of each node kind.
KIND_COLORS: Dict[str, str] = {
    "input": "#e0e0e0",
    "output": "#e0e0e0",
    "param": "#f5f5f5",
    "dense": "#cfe2f3",
    "lookup": "#f9cb9c",
    "group": "#93c47d",
    "quantized": "#b4a7d6",
    "collective": "#ea9999",
}

_KIND_SHAPES = {
    "input": "ellipse", "output": "ellipse", "param": "note", "dense": "box", "lookup": "box",
    "group": "box3d", "quantized": "box3d", "collective": "hexagon",
}

_LEGEND_TEXT = {
    "input": "input", "output": "output", "param": "parameter", "dense": "dense op",
    "lookup": "embedding lookup", "group": "fxrec TBE group", "quantized": "quantized group",
    "collective": "collective",
}

# ATen packets that are embedding lookups, and the torch-level functions of graphs that were
# traced without decomposition (torch.fx.symbolic_trace).
_LOOKUP_PACKETS = {"embedding", "embedding_bag", "_embedding_bag", "_embedding_bag_forward_only"}
_LOOKUP_FUNCTIONS = {
    torch.nn.functional.embedding, torch.nn.functional.embedding_bag, torch.embedding, torch.embedding_bag,
}

_DTYPES = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "b8",
}

#: Above this many dense ops, ``collapse="auto"`` draws each run of a submodule's ops as one box.
COLLAPSE_ABOVE = 40


class GraphvizMissing(RuntimeError):
    """Graphviz (the ``dot`` program or the ``graphviz`` Python package) is not installed."""


# --------------------------------------------------------------------------------------------
# Node kinds
# --------------------------------------------------------------------------------------------


def _module(gm: fx.GraphModule, node: fx.Node) -> Optional[torch.nn.Module]:
    try:
        return gm.get_submodule(str(node.target))
    except AttributeError:
        return None


def _is_lookup_target(target) -> bool:
    packet = getattr(target, "_overloadpacket", None)
    if packet is not None:
        return getattr(packet, "__name__", "") in _LOOKUP_PACKETS and "aten" in str(getattr(target, "namespace", "aten"))
    return target in _LOOKUP_FUNCTIONS


def node_kind(gm: fx.GraphModule, node: fx.Node) -> str:
    """The kind of one node of an fxrec (or any torch.fx) graph, one of :data:`KINDS`.

    * ``"input"`` / ``"output"``: placeholder / output nodes.
    * ``"param"``: ``get_attr`` nodes (parameters, buffers, constants).
    * ``"lookup"``: ``aten.embedding`` / ``aten.embedding_bag*`` calls still in the graph (and
      ``F.embedding*``, ``nn.Embedding`` / ``nn.EmbeddingBag`` modules of symbolically traced graphs).
    * ``"quantized"``: calls of fxrec's quantized inference groups
      (:class:`~fxrec.runtime.quantized.QuantizedPooledGroup`, ``QuantizedSequenceGroup``).
    * ``"group"``: calls of any other :class:`~fxrec.runtime.group.EmbeddingGroup` (fxrec's TBE groups).
    * ``"collective"``: a ``call_function`` whose target has the attribute ``_fxrec_collective``
      set to True, or a ``call_module`` whose module's class sets ``_fxrec_collective = True``
      (the contract fxrec's distributed runtime follows).
    * ``"dense"``: everything else.
    """
    if node.op == "placeholder":
        return "input"
    if node.op == "output":
        return "output"
    if node.op == "get_attr":
        return "param"
    if node.op == "call_function":
        if getattr(node.target, "_fxrec_collective", False) is True:
            return "collective"
        if _is_lookup_target(node.target):
            return "lookup"
        return "dense"
    if node.op == "call_module":
        mod = _module(gm, node)
        if mod is None:
            return "dense"
        if getattr(type(mod), "_fxrec_collective", False) is True:
            return "collective"
        if isinstance(mod, (QuantizedPooledGroup, QuantizedSequenceGroup)):
            return "quantized"
        if isinstance(mod, EmbeddingGroup):
            return "group"
        if isinstance(mod, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
            return "lookup"
    return "dense"


# --------------------------------------------------------------------------------------------
# Labels
# --------------------------------------------------------------------------------------------


def _dim(d) -> str:
    return str(d)


def _fmt_value(v, depth: int = 0) -> Optional[str]:
    """Shape and dtype of a recorded value: ``f32[s0, 64]``; sequences as ``(a, b, …)``."""
    if isinstance(v, torch.Tensor):
        return f"{_DTYPES.get(v.dtype, str(v.dtype).replace('torch.', ''))}[{', '.join(_dim(d) for d in v.shape)}]"
    shape, dtype = getattr(v, "shape", None), getattr(v, "dtype", None)
    if shape is not None and isinstance(dtype, torch.dtype):  # TensorMetadata
        return f"{_DTYPES.get(dtype, str(dtype).replace('torch.', ''))}[{', '.join(_dim(d) for d in shape)}]"
    if isinstance(v, (torch.SymInt, int)) and not isinstance(v, bool):
        return f"int {v}"
    if isinstance(v, (list, tuple)) and depth == 0 and v:
        parts = [p for p in (_fmt_value(x, 1) for x in v[:3]) if p]
        if not parts:
            return None
        more = f", … {len(v)} in all" if len(v) > 3 else ""
        return "(" + ", ".join(parts) + more + ")"
    return None


def value_text(node: fx.Node) -> Optional[str]:
    """Shape and dtype of a node's output where torch recorded them, else None."""
    for key in ("val", "tensor_meta"):
        if key in node.meta and node.meta[key] is not None:
            text = _fmt_value(node.meta[key])
            if text:
                return text
    return None


def _op_name(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_function":
        t = node.target
        if t is operator.getitem:
            return f"getitem [{node.args[1]}]" if len(node.args) > 1 else "getitem"
        packet = getattr(t, "_overloadpacket", None)
        if packet is not None:
            return getattr(packet, "__name__", str(t))
        return getattr(t, "__name__", str(t))
    if node.op == "call_method":
        return f".{node.target}()"
    if node.op == "call_module":
        mod = _module(gm, node)
        return f"{node.target} ({type(mod).__name__})" if mod is not None else str(node.target)
    return str(node.target)


def _table_of(weight) -> str:
    if isinstance(weight, fx.Node) and weight.op == "get_attr":
        t = str(weight.target)
        return t[: -len(".weight")] if t.endswith(".weight") else t
    return "(computed weight)"


def _wrap(names: Sequence[str], per_line: int = 4) -> List[str]:
    return [", ".join(names[i:i + per_line]) for i in range(0, len(names), per_line)]


def _lookup_lines(gm: fx.GraphModule, node: fx.Node) -> List[str]:
    rec = node.meta.get(meta.LOOKUP)
    if rec is not None:
        rows = getattr(rec, "num_rows", None) or getattr(rec, "rows", 0)  # a LookupEntry in a pickled model
        lines = [f"{_op_name(gm, node)} · {rec.table}", f"{rows}×{rec.dim}, {rec.form}, {rec.pooling}"]
        if rec.reason:
            lines.append(f"not lowered: {rec.reason}"[:80])
        return lines
    if node.op == "call_module":
        mod = _module(gm, node)
        return [f"{node.target} ({type(mod).__name__})", f"{mod.weight.shape[0]}×{mod.weight.shape[1]}"]
    weight = node.args[0] if node.args else node.kwargs.get("weight")
    if node.op == "call_function" and getattr(node.target, "_overloadpacket", None) is None:
        # F.embedding(input, weight) / F.embedding_bag(input, weight, ...)
        weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    first = f"{_op_name(gm, node)} · {_table_of(weight)}"
    second = ""
    if isinstance(weight, fx.Node) and isinstance(weight.meta.get("val"), torch.Tensor):
        shape = weight.meta["val"].shape
        second = f"{_dim(shape[0])}×{_dim(shape[1])}" if len(shape) == 2 else ""
    if "bag" in _op_name(gm, node):
        mode = node.args[4] if len(node.args) > 4 else node.kwargs.get("mode", 0)
        pooling = {0: "sum", 1: "mean", 2: "max"}.get(mode, str(mode))
        second = f"{second}, {pooling}" if second else pooling
    return [first, second] if second else [first]


def _group_lines(gm: fx.GraphModule, node: fx.Node, kind: str) -> List[str]:
    mod = _module(gm, node)
    names = [t.name for t in mod.tables]
    lines = [f"{node.target} · {type(mod).__name__}",
             f"{mod.pooling}, {len(names)} table(s), {len(mod.features)} feature(s)"]
    lines += [f"tables: {chunk}" if i == 0 else f"  {chunk}" for i, chunk in enumerate(_wrap(names))]
    if kind == "quantized":
        dtypes = Counter(getattr(mod, "dtypes", []))
        lines.append("quantized: " + ", ".join(f"{d} ×{n}" for d, n in dtypes.items())
                     + f"; output {getattr(mod, 'output_dtype', 'fp32')}")
    else:
        lines.append(f"kernel train: {mod.kernel_train} · eval: {mod.kernel_eval}")
        if getattr(mod, "fused", None) is not None:
            lines.append(f"fused optimizer: {mod.fused.kind}")
    return lines


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _label(lines: Sequence[str]) -> str:
    return "\\n".join(_escape(x) for x in lines if x)


def _html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


# --------------------------------------------------------------------------------------------
# Layout model: which nodes are drawn, merged, folded
# --------------------------------------------------------------------------------------------


def _submodule(node: fx.Node, depth: int) -> Optional[Tuple[str, str]]:
    """(path, class name) of the node's submodule ``depth`` levels below the root, or
    ``("", root class)`` for ops of the root's own forward, or None when nothing is recorded."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        if node.op == "call_module":
            path = ".".join(str(node.target).split(".")[:depth])
            return (path, "")
        return None
    entries = list(stack.values())
    inner_path = str(entries[-1][0])
    parts = [p for p in inner_path.split(".") if p] if inner_path else []
    key = ".".join(parts[:depth])
    cls = ""
    for path, c in entries:
        if str(path) == key:
            cls = c if isinstance(c, str) else getattr(c, "__name__", str(c))
            cls = cls.rsplit(".", 1)[-1]
    return key, cls


@dataclass
class _Drawn:
    id: str
    kind: str
    lines: List[str]
    tooltip: str = ""
    cluster: Optional[Tuple[str, str]] = None
    members: List[fx.Node] = field(default_factory=list)


def _group_inputs(placeholders: List[fx.Node]) -> Dict[str, List[fx.Node]]:
    """Placeholders named ``<base>_<k>`` (a list input flattened by torch.export), three or
    more per base, by base."""
    by_base: Dict[str, List[fx.Node]] = OrderedDict()
    for n in placeholders:
        m = re.fullmatch(r"(.+?)_(\d+)", n.name)
        if m:
            by_base.setdefault(m.group(1), []).append(n)
    return {b: ns for b, ns in by_base.items() if len(ns) >= 3}


def _hidden_export_check(gm: fx.GraphModule, node: fx.Node) -> bool:
    return node.op == "call_module" and str(node.target) == "_guards_fn" and not node.users


def to_dot(
    gm: fx.GraphModule,
    *,
    title: Optional[str] = None,
    collapse: Union[bool, str] = "auto",
    depth: int = 1,
    show_params: bool = False,
    group_inputs: bool = True,
    rankdir: str = "TB",
    stagger: int = 4,
) -> str:
    """The DOT source of a picture of ``gm`` (no Graphviz program needed to build it).

    Args:
      gm: a ``torch.fx.GraphModule``: a model returned by :func:`fxrec.transform`, or any
        graph (the dumps of ``transform(..., dump_dir=...)`` draw the graph after every pass).
      title: a caption drawn above the legend.
      collapse: ``True``: each run of consecutive dense ops of one submodule becomes one box
        (op counts and the run's output shape); ``False``: every op is drawn, inside one
        cluster per submodule; ``"auto"``: collapse when there are more than
        :data:`COLLAPSE_ABOVE` dense ops.
      depth: how deep a submodule is that ops are clustered by: 1 = children of the root model
        (``bottom``, ``top``), 2 = their children (``bottom.0``), ...
      show_params: draw ``get_attr`` nodes (by default they are folded into their users' labels:
        the table of a lookup, the tables of a group).
      group_inputs: draw the inputs of one flattened list (``ids_0`` … ``ids_25``) as one node.
      rankdir: Graphviz's layout direction, ``"TB"`` (top to bottom) or ``"LR"``.
      stagger: a node feeding more than ``2 * stagger`` boxes (a list of ids feeding 26
        lookups) places them on ``stagger`` rows instead of one very wide one; 1 turns it off.
    """
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(
            f"fxrec.viz needs a torch.fx.GraphModule (a model returned by fxrec.transform, or "
            f"torch.fx.symbolic_trace(model)), got {type(gm).__name__}"
        )
    if collapse not in (True, False, "auto"):
        raise ValueError(f"fxrec.viz: collapse must be True, False or 'auto', got {collapse!r}")
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"fxrec.viz: depth must be an int of 1 or more, got {depth!r}")
    if rankdir not in ("TB", "LR", "BT", "RL"):
        raise ValueError(f"fxrec.viz: rankdir must be 'TB', 'LR', 'BT' or 'RL', got {rankdir!r}")
    if not isinstance(stagger, int) or stagger < 1:
        raise ValueError(f"fxrec.viz: stagger must be an int of 1 or more, got {stagger!r}")
    graphviz = _import_graphviz()

    nodes = list(gm.graph.nodes)
    kinds = {n: node_kind(gm, n) for n in nodes}
    drawn_of: Dict[fx.Node, _Drawn] = {}  # node -> the box it is drawn in
    edge_index: Dict[fx.Node, int] = {}  # folded getitem -> its index (edge label)
    order: List[_Drawn] = []

    taken = {n.name for n in nodes}

    def fresh(name: str) -> str:  # a box id that no node of the graph has
        while name in taken:
            name += "_"
        taken.add(name)
        return name

    def add(d: _Drawn) -> _Drawn:
        order.append(d)
        for m in d.members:
            drawn_of[m] = d
        return d

    # Inputs, merged per flattened list.
    placeholders = [n for n in nodes if n.op == "placeholder"]
    merged = _group_inputs(placeholders) if group_inputs else {}
    merged_of = {n: base for base, ns in merged.items() for n in ns}
    for base, ns in merged.items():
        shapes = list(OrderedDict.fromkeys(value_text(n) or "?" for n in ns))
        shape_text = shapes[0] if len(shapes) == 1 else f"{shapes[0]} … {shapes[-1]}"
        add(_Drawn(fresh(f"input_{base}"), "input",
                   [f"{base}: {len(ns)} tensors", f"{ns[0].name} … {ns[-1].name}", shape_text],
                   tooltip=", ".join(n.name for n in ns), members=list(ns)))

    dense_count = sum(
        1 for n in nodes if kinds[n] == "dense" and not _hidden_export_check(gm, n)
        and not (n.target is operator.getitem and n.op == "call_function")
    )
    do_collapse = collapse is True or (collapse == "auto" and dense_count > COLLAPSE_ABOVE)

    run: Optional[_Drawn] = None
    run_key = None
    runs: List[_Drawn] = []
    for n in nodes:
        kind = kinds[n]
        if n in merged_of:
            continue
        if _hidden_export_check(gm, n):
            continue
        if kind == "param" and not show_params:
            continue
        if (n.op == "call_function" and n.target is operator.getitem and n.args
                and isinstance(n.args[0], fx.Node) and n.args[0] in drawn_of):
            # a getitem of a drawn multi-output node: the edge from that node is labelled instead
            drawn_of[n] = drawn_of[n.args[0]]
            edge_index[n] = n.args[1] if len(n.args) > 1 else 0
            continue
        if kind == "dense":
            sub = _submodule(n, depth)
            if do_collapse and sub is not None:
                if run is not None and run_key == sub:
                    run.members.append(n)
                    drawn_of[n] = run
                    continue
                run = add(_Drawn(fresh(f"run_{n.name}"), "dense", [], members=[n]))
                run_key = sub
                runs.append(run)
                continue
            run = None
            d = add(_Drawn(n.name, "dense", [_op_name(gm, n), value_text(n) or ""],
                           tooltip=f"{n.name}: {n.format_node()}", members=[n]))
            if sub is not None and sub[0]:
                d.cluster = sub
            continue
        run = None
        if kind == "input":
            lines = [n.name, value_text(n) or ""]
        elif kind == "output":
            lines = ["output"]
        elif kind == "param":
            lines = [str(n.target), value_text(n) or ""]
        elif kind == "lookup":
            lines = _lookup_lines(gm, n) + [value_text(n) or ""]
            if lines[-1].startswith("("):  # embedding_bag's 4 outputs: show the pooled one
                val = n.meta.get("val")
                lines[-1] = _fmt_value(val[0]) if isinstance(val, (list, tuple)) and val else lines[-1]
        elif kind in ("group", "quantized"):
            lines = _group_lines(gm, n, kind) + [value_text(n) or ""]
        else:  # collective
            lines = [f"{n.name} · {_op_name(gm, n)}", value_text(n) or ""]
        d = add(_Drawn(n.name, kind, lines, tooltip=f"{n.name}: {n.format_node()}", members=[n]))
        if kind == "lookup":
            sub = _submodule(n, depth)
            if sub is not None and sub[0]:
                d.cluster = sub

    # Labels of collapsed runs: the submodule, its op counts, the run's output.
    for r in runs:
        sub = _submodule(r.members[0], depth)
        where = sub[0] or "forward"
        cls = sub[1]
        ops = Counter(_op_name(gm, m).split(" [")[0] for m in r.members
                      if not (m.op == "call_function" and m.target is operator.getitem))
        op_text = ", ".join(f"{k} ×{v}" if v > 1 else k for k, v in ops.most_common(4))
        if len(ops) > 4:
            op_text += ", …"
        inside = set(r.members)
        outs = [m for m in r.members if any(u not in inside and drawn_of.get(u) is not r for u in m.users)]
        out_text = value_text(outs[-1]) if len(outs) == 1 else (f"{len(outs)} outputs" if outs else "")
        r.lines = [f"{where} ({cls})" if cls else where, f"{len(r.members)} ops: {op_text}",
                   f"→ {out_text}" if out_text else ""]
        r.tooltip = ", ".join(m.name for m in r.members)
        if len(r.members) == 1:
            m = r.members[0]
            r.id = m.name
            r.lines = [_op_name(gm, m), value_text(m) or ""]
            if sub[0]:
                r.cluster = sub

    # Edges between drawn boxes.
    edges: "OrderedDict[Tuple[str, str], Optional[str]]" = OrderedDict()
    multi_index: Dict[str, set] = {}
    for n, idx in edge_index.items():
        if n.users:
            multi_index.setdefault(drawn_of[n].id, set()).add(idx)
    edge_items: "OrderedDict[Tuple[str, str], List]" = OrderedDict()
    for d in order:
        for m in d.members:
            for a in m.all_input_nodes:
                src = drawn_of.get(a)
                if src is None or src is d:
                    continue
                items = edge_items.setdefault((src.id, d.id), [])
                if a in edge_index and len(multi_index.get(src.id, ())) > 1 and edge_index[a] not in items:
                    items.append(edge_index[a])
    for key, items in edge_items.items():
        edges[key] = f"[{', '.join(str(i) for i in sorted(items, key=str))}]" if items else None
    # Clusters: the submodule of each dense op and lookup that is drawn on its own.
    clusters: "OrderedDict[Tuple[str, str], List[_Drawn]]" = OrderedDict()
    for d in order:
        if d.cluster is not None:
            clusters.setdefault(d.cluster, []).append(d)
    for key, members in list(clusters.items()):  # a box of one is no clearer than the box itself
        if len(members) == 1:
            members[0].cluster = None
            del clusters[key]
    cluster_name = {
        key: f"cluster_{i}_{re.sub(r'[^0-9A-Za-z_]', '_', key[0])}" for i, key in enumerate(clusters)
    }

    # Wide fan-outs (one list input feeding 26 lookups) are stacked in columns by invisible
    # edges (box j above box j + columns), `stagger` rows deep.
    successors: Dict[str, List[str]] = OrderedDict()
    for a, b in edges:
        successors.setdefault(a, []).append(b)
    invisible: List[Tuple[str, str]] = []
    stacked: set = set()
    if stagger > 1:
        for a, bs in successors.items():
            bs = [b for b in bs if b not in stacked]
            if len(bs) > 2 * stagger:
                columns = -(-len(bs) // stagger)
                for j in range(len(bs) - columns):
                    invisible.append((bs[j], bs[j + columns]))
                stacked.update(bs)

    # One edge, to or from the cluster's border, for a node outside a cluster of 3 or more
    # boxes that feeds every one of them (or is fed by every one): labelled with the count.
    bundled: "OrderedDict[Tuple[str, str], Dict[str, str]]" = OrderedDict()
    replaced: set = set()
    for key, members in clusters.items():
        ids = [d.id for d in members]
        if len(ids) < 3:
            continue
        inside = set(ids)
        for src in {a for (a, b) in edges if b in inside and a not in inside}:
            if all((src, m) in edges for m in ids):
                bundled[(src, ids[0])] = {"lhead": cluster_name[key], "label": f"×{len(ids)}"}
                replaced.update((src, m) for m in ids)
        for dst in {b for (a, b) in edges if a in inside and b not in inside}:
            if all((m, dst) in edges for m in ids):
                bundled[(ids[-1], dst)] = {"ltail": cluster_name[key], "label": f"×{len(ids)}"}
                replaced.update((m, dst) for m in ids)

    # The DOT text.
    g = graphviz.Digraph("fxrec", graph_attr={
        "rankdir": rankdir, "fontname": "Helvetica", "fontsize": "11", "nodesep": "0.25",
        "ranksep": "0.35", "labelloc": "t", "compound": "true",
    }, node_attr={"fontname": "Helvetica", "fontsize": "10", "style": "rounded,filled", "penwidth": "0.8"},
        edge_attr={"color": "#555555", "arrowsize": "0.6", "fontname": "Helvetica", "fontsize": "9"})
    present = [k for k in KINDS if any(d.kind == k for d in order)]
    g.attr(label=_legend(title, present))

    def node_stmt(target, d: _Drawn):
        extra = {"class": f"fxrec-{d.kind}"}
        if d.kind in ("group", "quantized", "collective"):
            extra.update(style="filled", margin="0.2,0.1", penwidth="1.2")
        target.node(d.id, label=_label(d.lines), shape=_KIND_SHAPES[d.kind], fillcolor=KIND_COLORS[d.kind],
                    tooltip=_escape(d.tooltip[:500]), **extra)

    for d in order:
        if d.cluster is None:
            node_stmt(g, d)
    for key, members in clusters.items():
        path, cls = key
        with g.subgraph(name=cluster_name[key]) as c:
            c.attr(label=_escape(f"{path} ({cls})" if cls else path), style="rounded,dashed",
                   color="#6f8fb0", fontcolor="#3d5a78", fontsize="10")
            # dot lays out a stacked grid right to left in the order the boxes are written
            grid = [d for d in members if d.id in stacked]
            for d in [d for d in members if d.id not in stacked] + grid[::-1]:
                node_stmt(c, d)
    for (a, b), label in edges.items():
        if (a, b) not in replaced:
            g.edge(a, b, **({"label": label} if label is not None else {}))
    for (a, b), attrs in bundled.items():
        g.edge(a, b, **attrs)
    for a, b in invisible:
        g.edge(a, b, style="invis", weight="10")
    return g.source


def _legend(title: Optional[str], kinds: Sequence[str]) -> str:
    cells = "".join(
        f'<td bgcolor="{KIND_COLORS[k]}" border="1">{_html(_LEGEND_TEXT[k])}</td>' for k in kinds
    )
    rows = ""
    if title:
        rows += f'<tr><td colspan="{max(len(kinds), 1)}" border="0"><b>{_html(title)}</b></td></tr>'
    rows += f"<tr>{cells}</tr>"
    return f'<<table border="0" cellspacing="3" cellpadding="3">{rows}</table>>'


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def _import_graphviz():
    try:
        import graphviz
    except ImportError as e:
        raise GraphvizMissing(f"fxrec.viz needs the graphviz Python package, which is not installed: {INSTALL}") from e
    return graphviz


def check_graphviz() -> None:
    """Raise :class:`GraphvizMissing` with the install instruction unless both the ``graphviz``
    Python package and Graphviz's ``dot`` program are there."""
    _import_graphviz()
    if shutil.which("dot") is None:
        raise GraphvizMissing(f"fxrec.viz needs Graphviz's 'dot' program, which is not on PATH: {INSTALL}")


_FORMATS = ("svg", "png", "pdf", "dot")


def render(dot_source: str, path: Union[str, os.PathLike], format: Optional[str] = None) -> str:
    """Write DOT source to ``path`` as SVG, PNG or PDF (by ``format`` or the file's suffix), or
    as the DOT text itself for ``.dot``/``.gv``. Returns the path."""
    path = os.fspath(path)
    fmt = (format or os.path.splitext(path)[1].lstrip(".")).lower()
    fmt = "dot" if fmt == "gv" else fmt
    if fmt not in _FORMATS:
        raise ValueError(
            f"fxrec.viz: cannot write {path!r}: the format must be one of {', '.join(_FORMATS)} "
            f"(given by format= or by the file's suffix), got {fmt or 'no suffix'!r}"
        )
    if fmt == "dot":
        with open(path, "w") as f:
            f.write(dot_source)
        return path
    check_graphviz()
    graphviz = _import_graphviz()
    try:
        data = graphviz.Source(dot_source).pipe(format=fmt)
    except graphviz.ExecutableNotFound as e:  # dot vanished between the check and the call
        raise GraphvizMissing(f"fxrec.viz: Graphviz's 'dot' program could not be run: {INSTALL}") from e
    with open(path, "wb") as f:
        f.write(data)
    return path


def draw(gm: fx.GraphModule, path: Union[str, os.PathLike], *, format: Optional[str] = None, **options) -> str:
    """Draw ``gm`` to ``path`` (``.svg``, ``.png``, ``.pdf``, or ``.dot`` for the source only).

    ``options`` are those of :func:`to_dot` (``title``, ``collapse``, ``depth``, ``show_params``,
    ``group_inputs``, ``rankdir``). Raises :class:`GraphvizMissing`, saying how to install it,
    when Graphviz is not there. Returns the path written.
    """
    return render(to_dot(gm, **options), path, format)


def pass_dumper(dump_dir: Union[str, os.PathLike]) -> Callable[[int, str, fx.GraphModule], None]:
    """The PassManager hook behind ``fxrec.transform(..., dump_dir=...)``.

    The hook, called as ``hook(index, name, gm)`` with index 0 / name ``"captured"`` before the
    first pass and ``index = 1, 2, ...`` after each pass, writes ``NN_<name>.txt`` (``gm.code``),
    ``NN_<name>.svg`` (the picture) and ``NN_<name>.dot`` (its source, to render otherwise).
    Checks that Graphviz is installed and creates the directory when called, so a missing
    ``dot`` fails before any work is done.
    """
    check_graphviz()
    dump_dir = os.fspath(dump_dir)
    os.makedirs(dump_dir, exist_ok=True)

    def hook(index: int, name: str, gm: fx.GraphModule) -> None:
        stem = os.path.join(dump_dir, f"{index:02d}_{name}")
        with open(stem + ".txt", "w") as f:
            f.write(gm.code)
        title = "captured graph" if index == 0 else f"after pass {index}: {name}"
        source = to_dot(gm, title=title)
        with open(stem + ".dot", "w") as f:
            f.write(source)
        render(source, stem + ".svg")

    return hook
