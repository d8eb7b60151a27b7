"""A code generator for captured graphs: ``forward`` takes the model's own arguments and reads the
input tensors out of them by index, instead of flattening them with pytree on every call.

torch.export's unlifted module writes ``fx_pytree.tree_flatten_spec(([dense, ids, offsets], {}),
self._in_spec)`` in its ``forward`` and checks the structure in a pre-hook: general, but it costs
a pytree walk per call (0.2-0.5 ms for a model with 53 input tensors here) and TorchScript cannot
compile it. :class:`StructuredCodeGen` writes instead::

    def forward(self, dense, ids, offsets):
        if (not isinstance(ids, (list, tuple)) and not fxrec_sequence(ids)) or len(ids) != 26:
            fxrec_input_error(self, 'fxrec: input ids must have 26 elements (a list or tuple)', ids)
        ids_0 = ids[0]
        ...
        return squeeze

``fxrec_input_error`` raises the ValueError, saying what was given (``got None``), and in a
sharded model first stops the other ranks (:func:`fxrec_input_error`); a dict is checked for its
captured keys. With ``typed=True`` the arguments carry TorchScript types (``ids:
List[torch.Tensor]``) and the checks raise plainly; the ``emit_scriptable`` pass uses that.

Untyped, a parameter is read with :func:`fxrec_attr` (``bags_0_weight = fxrec_attr(self, ('bags',
'0'), 'weight')``) where fx writes ``getattr(self.bags, "0").weight``: three
``nn.Module.__getattr__`` calls a table, each after a failed attribute lookup. For 512 tables
that was 1.0 ms of host time a call on Python 3.11 and 0.5 ms on 3.12, 0.1 ms this way
(measured on this project's CPU machine). A run of six or more such reads in a row, at one depth, is
one :func:`fxrec_attrs` call on the run's first line (the others become ``pass``), which reads the
module dicts by C-level ``map``s, the submodule they share once: ``bags_0_weight, ...,
bags_25_weight, = fxrec_attrs(self, ('bags',), (('0', ..., '25'),), ('weight', ..., 'weight'))``.
"""

from __future__ import annotations

import collections.abc
import builtins
import re
import typing
from itertools import repeat
from operator import attrgetter, getitem, is_
from typing import Any, List, Tuple

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .pass_infra import InputError
from .runtime._tracing import compiling
from .runtime.input_guards import GUARDS_NAME


def _children(spec) -> list:
    if hasattr(spec, "child"):
        return [spec.child(i) for i in range(spec.num_children)]
    return list(spec.children_specs)  # older torch


def _type_of(spec, where: str) -> str:
    if spec.is_leaf():
        return "torch.Tensor"
    kids = _children(spec)
    if spec.type is tuple:
        if not kids:
            return "Tuple[()]"  # (TorchScript's empty tuple type)
        return "Tuple[" + ", ".join(_type_of(k, f"{where}[{i}]") for i, k in enumerate(kids)) + "]"
    if spec.type in (list, dict):
        types = {_type_of(k, where) for k in kids}
        if len(types) > 1:
            raise InputError(f"fxrec: the elements of input '{where}' have different types {sorted(types)}; TorchScript needs one")
        inner = types.pop() if types else "torch.Tensor"
        if spec.type is list:
            return f"List[{inner}]"
        if not all(isinstance(k, str) for k in spec.context):
            raise InputError(f"fxrec: input '{where}' is a dict with keys that are not strings")
        return f"Dict[str, {inner}]"
    raise InputError(f"fxrec: input '{where}' is a {spec.type.__name__}; TorchScript inputs "
                     "must be tensors or lists, tuples or str-keyed dicts of them")


_CONTAINERS = (tuple, list, dict, type(None))


def supported(spec) -> bool:
    """Whether :class:`StructuredCodeGen` can write code for this input or output structure:
    tensors (leaves) in tuples, lists, dicts and Nones (not namedtuples, OrderedDicts, ...)."""
    return spec.is_leaf() or (spec.type in _CONTAINERS and all(supported(k) for k in _children(spec)))


def _leaf_paths(spec, expr: str, out: List[Tuple[str, Any]]) -> None:
    """(access expression, spec of the container it checks) for every leaf, in pytree order."""
    if spec.is_leaf():
        out.append((expr, None))
        return
    for i, kid in enumerate(_children(spec)):
        key = repr(spec.context[i]) if spec.type is dict else str(i)
        _leaf_paths(kid, f"{expr}[{key}]", out)


def arg_specs(in_spec, arg_names: List[str]) -> List[Tuple[str, Any]]:
    """(argument name, its spec) of each positional and keyword argument of ``forward``."""
    if in_spec.type is tuple and in_spec.num_children == 2 and _children(in_spec)[1].type is dict:
        args_spec, kwargs_spec = _children(in_spec)
        names = list(arg_names[: args_spec.num_children]) + list(kwargs_spec.context)
        return list(zip(names, _children(args_spec) + _children(kwargs_spec)))
    return list(zip(arg_names, _children(in_spec)))


def leaf_paths(in_spec, arg_names: List[str]) -> List[str]:
    """Each input tensor's access expression (``dense``, ``ids[2]``, ``feats['user']``), in the
    order of the graph's placeholders."""
    out: List[Tuple[str, Any]] = []
    for name, spec in arg_specs(in_spec, arg_names):
        _leaf_paths(spec, name, out)
    return [expr for expr, _ in out]


def fxrec_attr(root, modules: Tuple[str, ...], name: str):
    """``root.<modules...>.<name>``, as fx's ``getattr`` chain reads it, through the module dicts
    where they hold it: a chain of submodules (``_modules``) ending in a parameter or buffer.
    Anything else (a parameter or buffer registered as None, an attribute set on an instance, a
    property such as torch.nn.utils.parametrize puts in place of a parameter, which it takes out
    of ``_parameters``) is read by ``getattr``. The dicts never hold a name the module's class
    has (nn.Module's register_parameter, register_buffer and add_module refuse one), so the two
    reads agree; a class given such an attribute by hand after the name was registered is not
    followed."""
    mod = root
    for m in modules:
        mod = mod._modules.get(m)
        if mod is None:
            break
    else:
        got = mod._parameters.get(name)
        if got is None:
            got = mod._buffers.get(name)
        if got is not None:
            return got
    for m in modules:
        root = getattr(root, m)
    return getattr(root, name)


_MODULES, _PARAMETERS, _BUFFERS = attrgetter("_modules"), attrgetter("_parameters"), attrgetter("_buffers")
#: what the generated forward takes where the model was captured with a dict (a MappingProxyType, ...)
MAPPINGS = (dict, collections.abc.Mapping)


def fxrec_grad_block(enable: bool, body, *args, **kwargs):
    """torch's ``wrap_with_set_grad_enabled`` (a ``torch.no_grad()`` / ``enable_grad()`` block of
    the model, captured as one call of its body), giving the grad mode back when the body raises:
    torch's own leaves it set, so one failed call (a bad input inside a no_grad block) turned
    autograd off for the process, and the next training step built no graph."""
    with torch.set_grad_enabled(enable):
        return body(*args, **kwargs)


_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default


def fxrec_tensor_check(where: str, t, *args, **kwargs):
    """torch.export's ``_assert_tensor_metadata`` (the dtype, device and layout it recorded of a
    tensor the model converts with ``.to()`` / ``.long()`` / ``.float()``; a conversion that
    changed nothing at capture is not in the graph, so the check must hold), raising an error that
    names the model's line (``where``) and what differs, where torch's says only ``Tensor dtype
    mismatch! Expected: Float, Got: c10::Half``."""
    try:
        return _ASSERT_METADATA(t, *args, **kwargs)
    except RuntimeError as e:
        if compiling() or not isinstance(t, torch.Tensor):
            raise
        want = {"dtype": kwargs.get("dtype"), "device": kwargs.get("device"), "layout": kwargs.get("layout")}
        got = {"dtype": t.dtype, "device": t.device, "layout": t.layout}
        recorded = torch.device(want["device"]) if want["device"] is not None else None
        differ = [k for k in ("dtype", "layout") if want[k] is not None and want[k] != got[k]]
        if recorded is not None and (recorded.type, recorded.index) not in ((t.device.type, t.device.index),
                                                                              (t.device.type, None)):
            differ.append("device")
        said = lambda d: " and ".join(f"{k} {str(d[k]).replace('torch.', '')}" for k in differ or want)  # noqa: E731
        if "dtype" in differ:
            raise TypeError(
                f"fxrec: {where} was captured converting a tensor of {said(want)} and gets one of {said(got)}: the "
                "graph holds that conversion as captured. Call the model with inputs of the example's dtypes (to run "
                "it in another dtype, convert the plain model, .half() or .to(dtype), and transform that)") from e
        raise ValueError(f"fxrec: {where} was captured converting a tensor of {said(want)} and gets one of "
                         f"{said(got)}: move the inputs where the model is, or the model where they are") from e


def _where(node: fx.Node) -> str:
    """The model's line a node comes from (``models.py:41 `ids = x[:, 2:].long()```), from the
    stack trace capture recorded; else the node's name."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', node.meta.get("stack_trace") or "")
    if not frames:
        return f"the graph's {node.name}"
    path, line, code = frames[-1]
    return f"{path.replace(chr(92), '/').rsplit('/', 1)[-1]}:{line} `{code.strip()}`"


def _named_tensor_checks(src: str, nodes, fn: str) -> str:
    """``src`` with each ``_assert_tensor_metadata`` line calling :func:`fxrec_tensor_check`, known
    to the code as ``fn``, with the model's line it checks for."""
    where = {n.name: _where(n) for n in nodes if n.op == "call_function" and n.target is _ASSERT_METADATA}
    if not where:
        return src
    lines = src.split("\n")
    for i, line in enumerate(lines):
        m = _ASSERT_LINE.match(line)
        if m and m.group(2) in where:
            lines[i] = f"{m.group(1)}{fn}({where[m.group(2)]!r}, {m.group(3)})"
    return "\n".join(lines)


#: how fx writes a call of _assert_tensor_metadata (indent, its node's name, the arguments)
_ASSERT_LINE = re.compile(r"(\s*)([A-Za-z_][A-Za-z0-9_]*) = [A-Za-z_][A-Za-z0-9_]*\.ops\.aten\._assert_tensor_metadata"
                          r"\.default\((.*)\);  \2 = None$")


#: how fx writes a call of the block (its module read by whatever name ``torch`` has there)
_GRAD_BLOCK_CALL = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\.ops\.higher_order\.wrap_with_set_grad_enabled\(")


def fxrec_sequence(x) -> bool:
    """Whether the generated forward takes ``x`` where the model was captured with a list or tuple
    (after those two, which it tests first itself): another sequence the model's code indexes alike
    (a deque, a tensor of at least one dim for a list of its rows), not a str or bytes."""
    if isinstance(x, torch.Tensor):
        return x.dim() > 0
    return isinstance(x, collections.abc.Sequence) and not isinstance(x, (str, bytes, bytearray))


#: fewer reads than this in a row are made one by one (fxrec_attrs costs about as much as five
#: fxrec_attr calls before its first read)
MIN_RUN = 6


def fxrec_attrs(root, prefix: Tuple[str, ...], levels: Tuple[Tuple[str, ...], ...], names: Tuple[str, ...]
                ) -> List[Any]:
    """:func:`fxrec_attr` of several attributes under one submodule (``prefix``, the path they
    share) at one depth: the k-th is ``root.<prefix...>.<levels[0][k]>.<levels[1][k]>...
    <names[k]>``. The module dicts are read by C-level ``map``s, with no Python work per attribute
    where they hold every one; anything else is read by :func:`fxrec_attr`, so the answer is the
    same. (512 tables' weights under one ModuleList, on this project's CPU: 0.06 ms, against 0.12
    ms for 512 fxrec_attr calls in a loop.)"""
    if compiling():  # (torch.compile does not follow attrgetter: the same reads one by one)
        return [fxrec_attr(root, prefix + path, name) for path, name in zip(_varying(levels, names), names)]
    try:
        start = root
        for key in prefix:
            start = start._modules[key]
        if levels:
            mods = list(map(start._modules.__getitem__, levels[0]))
            for keys in levels[1:]:
                mods = list(map(getitem, map(_MODULES, mods), keys))
        else:
            mods = [start] * len(names)
        got = list(map(dict.get, map(_PARAMETERS, mods), names))
        if any(map(is_, got, repeat(None))):  # buffers, or what only getattr finds
            got = [g if g is not None else b for g, b in zip(got, map(dict.get, map(_BUFFERS, mods), names))]
    except (KeyError, AttributeError, TypeError):  # a module missing or replaced by something else
        got = [None] * len(names)
    if any(map(is_, got, repeat(None))):
        got = [g if g is not None else fxrec_attr(root, prefix + path, name)
               for g, path, name in zip(got, _varying(levels, names), names)]
    return got


def _varying(levels: Tuple[Tuple[str, ...], ...], names: Tuple[str, ...]) -> List[Tuple[str, ...]]:
    """Each attribute's module path below the shared prefix, from :func:`fxrec_attrs`' levels."""
    return list(zip(*levels)) if levels else [()] * len(names)


_NOTHING = object()


class _Unset:
    """The default the generated forward gives an argument the model may be called without but
    was captured with (``fxrec_unset``): seen there, it raises the error that says so."""

    def __repr__(self) -> str:
        return "fxrec_unset"


_UNSET = _Unset()


def fxrec_input_error(root, message: str, got=_NOTHING):
    """Raise the ValueError ``message`` of an input whose structure the model was not captured for
    (not a list or dict, one of another length or keys, an input that must stay None), followed by
    a word on ``got``, what was given there. In a sharded model this rank first joins the step's
    first exchange with its input flag set, as the input checks do for sizes
    (:meth:`fxrec.runtime.input_guards.InputGuards._stop_every_rank`), so the other ranks stop too
    instead of waiting until the timeout."""
    error = ValueError(message if got is _NOTHING else f"{message}, got {_described(got)}")
    guards = root._modules.get(GUARDS_NAME)
    if guards is not None and hasattr(guards, "_stop_every_rank"):
        # (no input tensor to go by: the exchange runs where the model's tables are)
        table = next(root.parameters(), None)
        guards._stop_every_rank(error, (), None if table is None else table.device)
    raise error


def _described(x) -> str:
    """A few words on an input that was given where a list or dict goes."""
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of {len(x)}"
    if isinstance(x, dict):
        return f"a dict with keys {', '.join(map(repr, list(x)[:8]))}" + (" ..." if len(x) > 8 else "") if x else "an empty dict"
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    if x is None:
        return "None"
    kind = type(x).__name__
    kind = f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind}"
    if isinstance(x, (bool, int, float, complex)) or (isinstance(x, str) and len(x) <= 40):
        return f"{kind} ({x!r})"  # (a value fixed at capture: the one given is what the user needs to see)
    return kind


def _fast_attr_lines(src: str, nodes, root_module: str, fn: str = "fxrec_attr", fn_many: str = "") -> str:
    """``src`` with each get_attr node's line reading through :func:`fxrec_attr`, known to the
    code as ``fn``; with ``fn_many`` (:func:`fxrec_attrs`' name there), each run of ``MIN_RUN`` or
    more such lines in a row, at one depth, read by one call of it on the run's first line, the others
    left as ``pass`` (the line numbers fx maps to nodes stay)."""
    rewrite = {}
    for node in nodes:
        if node.op == "get_attr" and isinstance(node.target, str):
            fx_form = fx.graph._format_target(root_module, node.target)
            *modules, name = node.target.split(".")
            rewrite[repr(node)] = (" = " + fx_form, tuple(modules), name)
    if not rewrite:
        return src
    lines = src.split("\n")
    found = []  # (line index, indent, assigned name, modules, attribute name)
    for i, line in enumerate(lines):
        m = _ASSIGNED.match(line)
        if m and m.group(1) in rewrite:
            old, modules, name = rewrite[m.group(1)]
            if line.endswith(old):
                found.append((i, line[: len(line) - len(line.lstrip())], m.group(1), modules, name))
    runs: List[list] = []
    for item in found:
        last = runs[-1][-1] if runs else None
        if fn_many and last is not None and item[0] == last[0] + 1 and len(item[3]) == len(last[3]):
            runs[-1].append(item)
        else:
            runs.append([item])
    for run in [r for long in runs for r in ([long] if len(long) >= MIN_RUN else [[item] for item in long])]:
        i, indent, var, modules, name = run[0]
        if len(run) == 1:
            lines[i] = f"{indent}{var} = {fn}({root_module}, {modules!r}, {name!r})"
            continue
        levels = tuple(zip(*(r[3] for r in run)))
        shared = 0  # the levels every read of the run has alike: read once
        while shared < len(levels) and len(set(levels[shared])) == 1:
            shared += 1
        prefix = tuple(keys[0] for keys in levels[:shared])
        names = tuple(r[4] for r in run)
        lines[i] = (f"{indent}{', '.join(r[2] for r in run)}, = {fn_many}({root_module}, {prefix!r}, "
                    f"{levels[shared:]!r}, {names!r})")
        for r in run[1:]:
            lines[r[0]] = f"{indent}pass"
    return "\n".join(lines)


#: the names generated code reads globally that an argument can hide: fx's own (torch, device,
#: inf, nan, NoneType, pytree, fx_pytree) and Python's builtins (isinstance, len, type, ...)
_GLOBAL_NAMES = {k: v for k, v in vars(builtins).items() if not k.startswith("_")}
_GLOBAL_NAMES.update({k: getattr(v, "obj", v) for k, v in getattr(fx.graph, "_custom_builtins", {}).items()})
#: of those, what the TorchScript form's code can read (its checks, fx's code for the graph): an
#: argument named so takes another name there (the others, ``input``, ``id``, keep theirs)
_READ_WHEN_TYPED = set(getattr(fx.graph, "_custom_builtins", {})) | {
    "len", "isinstance", "list", "tuple", "type", "getattr", "slice", "int", "float", "bool", "str", "range",
    "min", "max", "abs", "ValueError", "RuntimeError", "AssertionError", "Exception"}

def _give_back(src: str, func: str, prologue: int, shadowed: dict, nodes) -> str:
    """``src`` with each global name an argument hides (``shadowed``: name -> (alias, object)) given
    back its object once the inputs are read: after the ``prologue`` lines of the function's own
    checks and bindings, and after fx's renaming of those inputs (``device_1 = device``)."""
    lines = src.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith(f"def {func}("))
    renames = {f"{n.name} = {n.target}" for n in nodes if n.op == "placeholder" and n.target in shadowed}
    at = start + 1 + prologue
    for i in range(at, len(lines)):
        if lines[i].strip() in renames:
            at = i + 1
    give = [f"    {name} = {alias}" for name, (alias, _) in shadowed.items()]
    return "\n".join(lines[:at] + give + lines[at:])


_ASSIGNED = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\b")


class StructuredCodeGen(fx.graph.CodeGen):
    """Writes ``forward`` with the model's own arguments (typed for TorchScript when ``typed``)
    and returns the model's own output structure."""

    def __init__(self, in_spec, out_spec, arg_names: List[str], typed: bool = False, none_leaves=(), defaults=(),
                 dict_order: bool = False, optional=()):
        super().__init__()
        # (name, its default in the model's signature, whether the example gave it at that default
        # None) of arguments the example gave that the model lets a call leave out: left out here
        # they are an error saying so, not Python's TypeError (or, given None, None again)
        self.optional = list(optional)
        # the model's output depends on the order of its dicts' keys (its code iterates them): a
        # dict must come in the captured order (otherwise any order: the graph reads them by key)
        self.dict_order = dict_order
        self.in_spec, self.out_spec, self.arg_names, self.typed = in_spec, out_spec, list(arg_names), typed
        self.none_leaves = set(none_leaves)  # input leaves that were None when the model was captured
        # (name, value): the model's trailing arguments the example left at their defaults (None,
        # bool, int, float, str), taken as the model takes them and held at those values
        self.defaults = list(defaults)

    def _arg_specs(self):
        return arg_specs(self.in_spec, self.arg_names)

    def _gen_python_code(self, nodes, root_module, *args, **kwargs):
        # fx's namespace of the code's names: the arguments are reserved in it before fxrec's
        # functions are named (additional_globals), so an input called fxrec_attr or
        # fxrec_input_error, even a list that is no graph node, cannot hide one
        namespace = args[0] if args else kwargs.get("namespace")
        self._namespace = namespace if hasattr(namespace, "create_name") else None  # (torch 2.11 and 2.13 pass it)
        try:
            code = super()._gen_python_code(nodes, root_module, *args, **kwargs)
            shadowed, prologue = getattr(self, "_shadowed", {}), getattr(self, "_prologue", 0)
            renamed = getattr(self, "_renamed", {})
            for alias, obj in shadowed.values():
                code.globals[alias] = obj
        finally:
            del self._namespace  # (not kept: the code generator is pickled with the graph)
            for k in ("_shadowed", "_prologue", "_renamed"):
                self.__dict__.pop(k, None)
        # (fx names its globals apart from the graph's names: a model with an input or a parameter
        # called fxrec_attr gets the function as fxrec_attr_1)
        fn = next((k for k, v in code.globals.items() if v is fxrec_attr), None)
        many = next((k for k, v in code.globals.items() if v is fxrec_attrs), "")
        if not self.typed and fn is not None:  # TorchScript reads attributes its own way, not these dicts
            code.src = _fast_attr_lines(code.src, nodes, root_module, fn, many)
        check = next((k for k, v in code.globals.items() if v is fxrec_tensor_check), None)
        if not self.typed and check is not None:
            code.src = _named_tensor_checks(code.src, nodes, check)
        block = next((k for k, v in code.globals.items() if v is fxrec_grad_block), None)
        if block is not None:
            code.src = _GRAD_BLOCK_CALL.sub(f"{block}(", code.src)
        if shadowed:
            code.src = _give_back(code.src, self._func_name, prologue, shadowed, nodes)
        if renamed:  # fx's renaming of those inputs reads the arguments' new names
            for n in nodes:
                if n.op == "placeholder" and n.target in renamed:
                    code.src = code.src.replace(f"\n    {n.name} = {n.target}\n", f"\n    {n.name} = {renamed[n.target]}\n")
        return code

    def gen_fn_def(self, free_vars, maybe_return_annotation, **kwargs) -> str:
        leaves = [v.split(":")[0].split("#")[0].strip() for v in free_vars if v != "self"]
        # an argument named as a name the code reads globally (torch, device, inf; Python's builtins)
        # hides it: fx names its graph input apart (device_1), and once the inputs are bound the
        # name is given back its object, read through an alias; the checks before use the alias
        # (TorchScript has no such alias: there the argument takes another name, and is passed by place)
        self._shadowed, self._renamed = {}, {}
        for name in [n for n, _ in self._arg_specs()] + [n for n, _ in getattr(self, "defaults", ())]:
            if name in _GLOBAL_NAMES:
                # (a name of its own: fx's namespace would hand back the name it knows the object by)
                if self.typed:
                    if name in _READ_WHEN_TYPED:
                        self._renamed[name] = self._global(f"{name}_arg", object())
                else:
                    self._shadowed[name] = (self._global(f"fxrec_global_{name}", object()), _GLOBAL_NAMES[name])
        params, lines, paths = [], [], []
        specs = self._arg_specs()
        # name -> (its default as written, whether the example gave it at that default None)
        optional = {o[0]: (o[1], len(o) > 2 and o[2]) for o in getattr(self, "optional", ())}  # (older pickles: none)
        first_optional = len(specs)
        while not self.typed and first_optional > 0 and specs[first_optional - 1][0] in optional:
            first_optional -= 1  # (only a trailing run: an argument without a default cannot follow one)
        for k, (name, spec) in enumerate(specs):
            given_name = name
            name = self._renamed.get(name, name)
            params.append(f"{name}: {_type_of(spec, name)}" if self.typed else name)
            default, none_given = optional.get(given_name, ("", False))
            if k >= first_optional and none_given:  # (None then, which the graph does not read: the same call)
                params[-1] += "=None"
            elif k >= first_optional:
                unset = self._global("fxrec_unset", _UNSET)
                params[-1] += f"={unset}"
                lines.append(f"if {name} is {unset}: " + self._raise(
                    f"fxrec: input {given_name} was given when the model was captured, and the transformed model "
                    f"reads it: pass it (left out, the model takes its default {default}, which is "
                    "another graph: transform with an example that leaves it out for those calls)"))
            _leaf_paths(spec, name, paths)
            self._length_checks(spec, name, lines)
        if len(paths) != len(leaves):
            raise InputError(f"fxrec: {len(paths)} input tensors in the call, {len(leaves)} in the graph")
        for name, value in ([] if self.typed else getattr(self, "defaults", ())):  # (older pickles: none)
            params.append(f"{name}={value!r}")
            other = f"{name} is not None" if value is None else \
                f"{self._b('type')}({name}) is not {self._b(type(value).__name__)} or {name} != {value!r}"
            lines.append(f"if {other}: " + self._raise(
                f"fxrec: input {name} was left at its default {value!r} when the model was captured and must stay "
                "so (transform with it given, to pass it)", name))
        for k, (expr, _) in enumerate(paths):
            if k in self.none_leaves:
                shown = self._shown(expr)
                lines.append(f"if {expr} is not None: " + self._raise(
                    f"fxrec: input {shown} was None when the model was captured and must stay None", expr))
        bind = [(leaf, expr) for leaf, (expr, _) in zip(leaves, paths) if leaf != expr and leaf not in self._renamed]
        if bind:  # one assignment: every input is read before any name is rebound
            lines.append(", ".join(b[0] for b in bind) + ", = " + ", ".join(b[1] for b in bind) + ",")
        self._prologue = len(lines)
        head = f"def {self._func_name}(self, {', '.join(params)}){maybe_return_annotation}:"
        return head + "".join(f"\n    {line}" for line in lines)

    def _shown(self, expr: str) -> str:
        """``expr`` (an input, or a part of one) as errors name it: by the model's argument names."""
        shown = expr.replace("'", "")
        for name, renamed in getattr(self, "_renamed", {}).items():
            if shown == renamed or shown.startswith(renamed + "["):
                return name + shown[len(renamed):]
        return shown

    def _b(self, name: str) -> str:
        """How the code's first lines (before the inputs are bound) read the global ``name``."""
        return self._shadowed[name][0] if name in getattr(self, "_shadowed", {}) else name

    def _global(self, name: str, obj) -> str:
        """The name the code knows one of :meth:`additional_globals` by: fx's for it (fx knows it by
        the object, and gives another name where an input or node has this one)."""
        namespace = getattr(self, "_namespace", None)
        return name if namespace is None else namespace.create_name(name, obj)

    def _raise(self, message: str, got: str = "") -> str:
        """The statement that raises ``message``: through :func:`fxrec_input_error` (every rank of a
        sharded model stops; ``got``, an expression, is described after the message), or a plain
        raise in the typed (TorchScript) form."""
        if self.typed:
            return f"raise ValueError({message!r})"
        name = self._global("fxrec_input_error", fxrec_input_error)
        return f"{name}(self, {message!r}{', ' + got if got else ''})"

    def _length_checks(self, spec, expr: str, lines: List[str]) -> None:
        if spec.is_leaf():
            return
        shown = self._shown(expr)
        if spec.type is type(None):
            lines.append(f"if {expr} is not None: " + self._raise(
                f"fxrec: input {shown} was None when the model was captured and must stay None", expr))
            return
        n = spec.num_children
        if self.typed:  # (TorchScript checks the types itself)
            lines.append(f"if {self._b('len')}({expr}) != {n}: " + self._raise(f"fxrec: input {shown} must have {n} elements"))
            if spec.type is dict and getattr(self, "dict_order", False) and n > 1:
                order = "[" + ", ".join(repr(k) for k in spec.context) + "]"
                lines.append(f"if {self._b('list')}({expr}.keys()) != {order}: " + self._raise(
                    f"fxrec: input {shown} has its keys in another order than the example's "
                    f"({', '.join(map(repr, spec.context))}), and the model's output depends on that order: pass the "
                    "keys in the example's order"))
        elif spec.type is dict:  # the captured keys, in any order
            keys = "{" + ", ".join(repr(k) for k in spec.context) + "}" if n else "set()"
            kinds = self._global("fxrec_mappings", MAPPINGS)
            lines.append(f"if not {self._b('isinstance')}({expr}, {kinds}) or {expr}.keys() != {keys}: " + self._raise(
                f"fxrec: input {shown} must have {n} elements (a dict with keys {', '.join(map(repr, spec.context))})",
                expr))
            if getattr(self, "dict_order", False) and n > 1:  # (older pickles have no dict_order)
                order = "[" + ", ".join(repr(k) for k in spec.context) + "]"
                lines.append(f"if {self._b('list')}({expr}) != {order}: " + self._raise(
                    f"fxrec: input {shown} has its keys in another order than the example's "
                    f"({', '.join(map(repr, spec.context))}), and the model's output depends on that order (its code "
                    "iterates the dict: found on the example inputs); the transformed model follows the example's "
                    "order, so pass the keys in that order", expr))
        else:  # a list or a tuple (or what the model's own code indexes alike)
            other = self._global("fxrec_sequence", fxrec_sequence)
            lines.append(f"if (not {self._b('isinstance')}({expr}, ({self._b('list')}, {self._b('tuple')})) and not "
                         f"{other}({expr})) or {self._b('len')}({expr}) != {n}: "
                         + self._raise(f"fxrec: input {shown} must have {n} elements (a list or tuple)", expr))
        for i, kid in enumerate(_children(spec)):
            key = repr(spec.context[i]) if spec.type is dict else str(i)
            self._length_checks(kid, f"{expr}[{key}]", lines)

    def generate_output(self, output_args, *args, **kwargs) -> str:
        leaves = list(output_args) if isinstance(output_args, (list, tuple)) else [output_args]
        it = iter(leaves)

        def build(spec) -> str:
            if spec.is_leaf():
                return repr(next(it))
            if spec.type is type(None):
                return "None"
            parts = [build(k) for k in _children(spec)]
            if spec.type is tuple:
                return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"
            if spec.type is list:
                return "[" + ", ".join(parts) + "]"
            if spec.type is dict:
                return "{" + ", ".join(f"{k!r}: {p}" for k, p in zip(spec.context, parts)) + "}"
            raise InputError(f"fxrec: the model returns a {spec.type.__name__}; TorchScript "
                             "outputs must be tensors or lists, tuples or str-keyed dicts of them")

        return "return " + build(self.out_spec)

    # for fx.Interpreter and friends, which run the graph on flat placeholders
    def process_inputs(self, *args: Any) -> Any:
        return pytree.arg_tree_leaves(*args)

    def process_outputs(self, out: Any) -> Any:
        return pytree.tree_unflatten(out if isinstance(out, (list, tuple)) else [out], self.out_spec)

    def additional_globals(self):
        namespace = getattr(self, "_namespace", None)
        if namespace is not None:
            for name, _ in self._arg_specs():
                namespace.create_name(name, None)  # (one already a node's name just takes up a spare one)
        return [("List", typing.List), ("Dict", typing.Dict), ("Tuple", typing.Tuple), ("Optional", typing.Optional),
                ("fxrec_attr", fxrec_attr), ("fxrec_attrs", fxrec_attrs), ("fxrec_input_error", fxrec_input_error),
                ("fxrec_sequence", fxrec_sequence), ("fxrec_mappings", MAPPINGS), ("fxrec_unset", _UNSET),
                ("fxrec_grad_block", fxrec_grad_block), ("fxrec_tensor_check", fxrec_tensor_check)]
