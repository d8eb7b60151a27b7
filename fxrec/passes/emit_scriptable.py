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
  resolves by schema; ``sym_size`` becomes ``size``; export's shape-assertion nodes go (TorchScript
  checks shapes as the ops run), and the input-size checks become a function TorchScript compiles
  (:mod:`fxrec.runtime.size_checks`: the sizes capture fixed and the
  conditions the model's code tested, which the graph no longer holds);
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

import torch
import torch.fx as fx

from ..codegen import StructuredCodeGen
from ..pass_infra import InputError, PassContext, PassResult, compiler_pass
from ..runtime.input_guards import InputGuards
from ..runtime.size_checks import serving_check
from ..runtime.serving import ServingPooledGroup, ServingSequenceGroup
from ..runtime.group import EmbeddingGroup

aten = torch.ops.aten

# export's runtime checks: dropped (TorchScript's ops check shapes as they run)
_DROPPED = {"_assert_scalar", "_assert_tensor_metadata", "sym_constrain_range_for_size", "sym_constrain_range",
            "_assert_async"}


# export's symbolic-size ops, and the ones TorchScript knows
_SYM_TO_INT = {"sym_size": aten.size, "sym_numel": aten.numel, "sym_stride": aten.stride,
               "sym_storage_offset": aten.storage_offset}


# torch's functions on symbolic ints that the graph may call (``max(1, x.shape[1] // 2)`` on a
# dynamic size), as the builtins TorchScript knows
_SYM_BUILTINS = {torch.sym_max: max, torch.sym_min: min}


def _serving_module(group: EmbeddingGroup, offsets: list, psws: list):
    off_index, psw_index, kept_offs, kept_psw = [], [], [], []
    for o, w in zip(offsets, psws):
        off_index.append(len(kept_offs) if o is not None else -1)
        if o is not None:
            kept_offs.append(o)
        psw_index.append(len(kept_psw) if w is not None else -1)
        if w is not None:
            kept_psw.append(w)
    cls = ServingSequenceGroup if group.pooling == "none" else ServingPooledGroup
    return cls(group, off_index, psw_index), kept_offs, kept_psw


@compiler_pass()
def emit_scriptable(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    info = gm.graph._codegen
    if not isinstance(info, StructuredCodeGen):
        raise InputError("fxrec.export.torchscript needs a model made by fxrec.transform whose inputs and "
                         "outputs are tensors in tuples, lists and str-keyed dicts")
    for n in gm.graph.nodes:
        if n.op == "placeholder" and not isinstance(n.meta.get("val"), torch.Tensor):
            raise InputError(f"fxrec.export.torchscript: input '{n.name}' is not a tensor "
                             f"({type(n.meta.get('val')).__name__}); only tensor inputs are supported")
    gm = copy.deepcopy(gm)
    graph = gm.graph
    stats = {"groups": 0, "dropped_checks": 0}
    for n in list(graph.nodes):
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), InputGuards):
            # its sizes, shapes and conditions as a function TorchScript compiles (the graph has
            # lost the branches the model's code took on them at capture)
            fn, tensors = serving_check(gm.get_submodule(n.target), scripted=True)
            with graph.inserting_before(n):
                graph.call_function(fn, tuple(n.args[k] for k in tensors))
            graph.erase_node(n)
            stats["size_checks"] = stats.get("size_checks", 0) + 1
        elif n.op == "call_function" and n.target in _SYM_BUILTINS:
            n.target = _SYM_BUILTINS[n.target]
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
                if mod.stored_lower():
                    raise InputError(mod.stored_lower())
                ids, offsets, psws = n.args[0], n.args[1], n.args[2]
                weights = list(n.args[3]) if len(n.args) > 3 else []
                serving, kept_offs, kept_psw = _serving_module(mod, offsets, psws)
                gm.add_submodule(n.target, serving)
                n.args = (list(ids), kept_offs, kept_psw, [] if serving.quantized else weights)
                stats["groups"] += 1
    for name, mod in list(gm.named_children()):
        if isinstance(mod, InputGuards):
            delattr(gm, name)
    graph._codegen = StructuredCodeGen(info.in_spec, info.out_spec, info.arg_names, typed=True,
                                       none_leaves=info.none_leaves, dict_order=getattr(info, "dict_order", False))
    return PassResult(fx.GraphModule(gm, graph, class_name="FxrecScriptable"), True, stats)
