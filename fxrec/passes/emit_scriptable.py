"""emit_scriptable: rewrite a transformed model into a GraphModule that ``torch.jit.script`` takes.

Run by :func:`fxrec.export.torchscript` on a copy of a transformed model, not by ``transform``.
A model captured by torch.export cannot be scripted as it is: its ``forward`` flattens the
inputs with pytree ("Expected a single top-level function", torch/export/_unlift.py), its
ATen calls name overloads (``aten.linear.default``), which TorchScript does not resolve, and
its group modules are Python. This pass

* gives the graph a code generator that writes a typed ``forward`` with the model's own
  arguments (``dense: Tensor, ids: List[Tensor], offsets: List[Tensor]``, dicts of tensors as
  ``Dict[str, Tensor]``) and takes the leaves out by index, checking list lengths, and returns
  the model's own output structure;
* calls every ATen op through its overload packet (``torch.ops.aten.linear``), which TorchScript
  resolves by schema; ``sym_size`` becomes ``size``; export's guard and shape-assertion nodes go
  (TorchScript checks shapes as the ops run);
* swaps each group module for its :mod:`fxrec.runtime.serving` twin, passing only the offsets
  and per-sample weights that exist.

Before (gm.code)::

    def forward(self, dense, ids, offsets):
        dense, ids_0, ids_1, offsets_0, offsets_1, = fx_pytree.tree_flatten_spec(([dense, ids, offsets], {}), self._in_spec)
        linear = torch.ops.aten.linear.default(dense, w, b)
        fxrec_group_0 = self.fxrec_group_0([ids_0, ids_1], [offsets_0, offsets_1], [None, None])

After::

    def forward(self, dense: torch.Tensor, ids: List[torch.Tensor], offsets: List[torch.Tensor]):
        if len(ids) != 2: raise ValueError(...)
        ids_0 = ids[0]
        ...
        linear = torch.ops.aten.linear(dense, w, b)
        fxrec_group_0 = self.fxrec_group_0([ids_0, ids_1], [offsets_0, offsets_1], [], [])

Not handled (an error names the input or node): inputs that are not tensors or lists, tuples or
str-keyed dicts of them; group modules other than fxrec's; Python functions in the graph that
TorchScript cannot compile (torch.jit.script names them).
"""

from __future__ import annotations

import copy
import typing
from typing import Any, List, Tuple

import torch
import torch.fx as fx

from ..pass_infra import InputError, PassContext, PassResult, compiler_pass
from ..runtime.serving import ServingPooledGroup, ServingSequenceGroup
from ..runtime.tbe import EmbeddingGroup, SequenceEmbeddingGroup

aten = torch.ops.aten

# export's runtime checks: dropped (TorchScript's ops check shapes as they run)
_DROPPED = {"_assert_scalar", "_assert_tensor_metadata", "sym_constrain_range_for_size", "sym_constrain_range",
            "_assert_async"}


# export's symbolic-size ops, and the ones TorchScript knows
_SYM_TO_INT = {"sym_size": aten.size, "sym_numel": aten.numel, "sym_stride": aten.stride,
               "sym_storage_offset": aten.storage_offset}


def _children(spec) -> list:
    if hasattr(spec, "child"):
        return [spec.child(i) for i in range(spec.num_children)]
    return list(spec.children_specs)  # older torch


def _type_of(spec, where: str) -> str:
    if spec.is_leaf():
        return "torch.Tensor"
    kids = _children(spec)
    if spec.type is tuple:
        return "Tuple[" + ", ".join(_type_of(k, f"{where}[{i}]") for i, k in enumerate(kids)) + "]"
    if spec.type in (list, dict):
        types = {_type_of(k, where) for k in kids}
        if len(types) > 1:
            raise InputError(f"fxrec.export.torchscript: the elements of input '{where}' have different types {sorted(types)}; TorchScript needs one")
        inner = types.pop() if types else "torch.Tensor"
        if spec.type is list:
            return f"List[{inner}]"
        if not all(isinstance(k, str) for k in spec.context):
            raise InputError(f"fxrec.export.torchscript: input '{where}' is a dict with keys that are not strings")
        return f"Dict[str, {inner}]"
    raise InputError(f"fxrec.export.torchscript: input '{where}' is a {spec.type.__name__}; TorchScript inputs "
                     "must be tensors or lists, tuples or str-keyed dicts of them")


def _leaf_paths(spec, expr: str, out: List[Tuple[str, Any]]) -> None:
    """(access expression, spec of the container it checks) for every leaf, in pytree order."""
    if spec.is_leaf():
        out.append((expr, None))
        return
    for i, kid in enumerate(_children(spec)):
        key = repr(spec.context[i]) if spec.type is dict else str(i)
        _leaf_paths(kid, f"{expr}[{key}]", out)


class ScriptableCodeGen(fx.graph.CodeGen):
    """Writes ``forward`` with the model's own typed arguments and output structure."""

    def __init__(self, in_spec, out_spec, arg_names: List[str]):
        super().__init__()
        self.in_spec, self.out_spec, self.arg_names = in_spec, out_spec, list(arg_names)

    def _arg_specs(self):
        spec = self.in_spec
        if spec.type is tuple and spec.num_children == 2 and _children(spec)[1].type is dict:
            args_spec, kwargs_spec = _children(spec)
            names = self.arg_names[: args_spec.num_children] + list(kwargs_spec.context)
            return list(zip(names, _children(args_spec) + _children(kwargs_spec)))
        return list(zip(self.arg_names, _children(spec)))

    def gen_fn_def(self, free_vars, maybe_return_annotation, **kwargs) -> str:
        leaves = [v.split(":")[0].split("#")[0].strip() for v in free_vars if v != "self"]
        params, lines, paths = [], [], []
        for name, spec in self._arg_specs():
            params.append(f"{name}: {_type_of(spec, name)}")
            _leaf_paths(spec, name, paths)
            self._length_checks(spec, name, lines)
        if len(paths) != len(leaves):
            raise InputError(f"fxrec.export.torchscript: {len(paths)} input tensors in the call, {len(leaves)} in the graph")
        lines += [f"{leaf} = {expr}" for leaf, (expr, _) in zip(leaves, paths)]
        head = f"def {self._func_name}(self, {', '.join(params)}){maybe_return_annotation}:"
        return head + "".join(f"\n    {line}" for line in lines)

    def _length_checks(self, spec, expr: str, lines: List[str]) -> None:
        if spec.is_leaf():
            return
        if spec.type is list:
            n = spec.num_children
            lines.append(f"if len({expr}) != {n}: raise ValueError('fxrec: input {expr} must have {n} elements')")
        for i, kid in enumerate(_children(spec)):
            key = repr(spec.context[i]) if spec.type is dict else str(i)
            self._length_checks(kid, f"{expr}[{key}]", lines)

    def generate_output(self, output_args, *args, **kwargs) -> str:
        leaves = list(output_args) if isinstance(output_args, (list, tuple)) else [output_args]
        it = iter(leaves)

        def build(spec) -> str:
            if spec.is_leaf():
                return repr(next(it))
            parts = [build(k) for k in _children(spec)]
            if spec.type is tuple:
                return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"
            if spec.type is list:
                return "[" + ", ".join(parts) + "]"
            if spec.type is dict:
                return "{" + ", ".join(f"{k!r}: {p}" for k, p in zip(spec.context, parts)) + "}"
            raise InputError(f"fxrec.export.torchscript: the model returns a {spec.type.__name__}; TorchScript "
                             "outputs must be tensors or lists, tuples or str-keyed dicts of them")

        return "return " + build(self.out_spec)

    def additional_globals(self):
        return [("List", typing.List), ("Dict", typing.Dict), ("Tuple", typing.Tuple), ("Optional", typing.Optional)]


def _serving_module(group: EmbeddingGroup, offsets: list, psws: list):
    off_index, psw_index, kept_offs, kept_psw = [], [], [], []
    for o, w in zip(offsets, psws):
        off_index.append(len(kept_offs) if o is not None else -1)
        if o is not None:
            kept_offs.append(o)
        psw_index.append(len(kept_psw) if w is not None else -1)
        if w is not None:
            kept_psw.append(w)
    cls = ServingSequenceGroup if isinstance(group, SequenceEmbeddingGroup) else ServingPooledGroup
    return cls(group, off_index, psw_index), kept_offs, kept_psw


@compiler_pass()
def emit_scriptable(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is None or info.in_spec is None:
        raise InputError("fxrec.export.torchscript needs a model made by fxrec.transform")
    for n in gm.graph.nodes:
        if n.op == "placeholder" and not isinstance(n.meta.get("val"), torch.Tensor):
            raise InputError(f"fxrec.export.torchscript: input '{n.name}' is not a tensor "
                             f"({type(n.meta.get('val')).__name__}); only tensor inputs are supported")
    gm = copy.deepcopy(gm)
    graph = gm.graph
    stats = {"groups": 0, "dropped_checks": 0}
    for n in list(graph.nodes):
        if n.op == "call_module" and n.target == "_guards_fn":
            graph.erase_node(n)
            stats["dropped_checks"] += 1
        elif n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            name = n.target._schema.name.split("::")[-1]
            if name in _DROPPED and not n.users:
                graph.erase_node(n)
                stats["dropped_checks"] += 1
            elif name in _SYM_TO_INT:
                n.target = _SYM_TO_INT[name]
            else:
                n.target = n.target.overloadpacket
        elif n.op == "call_module":
            mod = gm.get_submodule(n.target)
            if isinstance(mod, EmbeddingGroup):
                ids, offsets, psws = n.args[0], n.args[1], n.args[2]
                weights = list(n.args[3]) if len(n.args) > 3 else []
                serving, kept_offs, kept_psw = _serving_module(mod, offsets, psws)
                gm.add_submodule(n.target, serving)
                n.args = (list(ids), kept_offs, kept_psw, [] if serving.quantized else weights)
                stats["groups"] += 1
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    graph._codegen = ScriptableCodeGen(info.in_spec, info.out_spec, info.orig_args)
    return PassResult(fx.GraphModule(gm, graph, class_name="FxrecScriptable"), True, stats)
