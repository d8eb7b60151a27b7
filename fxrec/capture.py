"""Capture a plain model as an FX GraphModule with torch.export (non-strict).

Non-strict export runs the model's Python as Python, so list and dict inputs, loops over
tables, modules built inside ``forward``, ids carried as floats and cast with ``.long()``, and
in-place writes to inputs all work (``torch.fx.symbolic_trace`` fails on most real CTR models).
Every tensor dimension is captured as dynamic where the model allows it (``Dim.AUTO``), and
size-obliviously, so the result takes other batch sizes (1 included) and other numbers of ids;
dims of size 0 or 1 in the example inputs stay fixed (the report names them).
The returned :class:`~fxrec.graph_module.TransformedModule` is called exactly like the original
(same positional and keyword structure, inputs mutated as the model mutates them), checks its
inputs' sizes with errors that name the input (:class:`~fxrec.runtime.input_guards.InputGuards`),
and follows ``train()`` / ``eval()`` (:mod:`fxrec.modes`).

Capture time. With every size dynamic, torch.export's cost grows with the number of size symbols
(one per dynamic input dim): each new symbol goes through sympy's reasoning in the operations that
touch it, so a model with 256 ids and 256 offsets tensors took 7.5 s to capture against 1.6 s with
fixed sizes. Three things bring that to about 2.6 s, none changing the captured program (tests
compare it with torch's own): :func:`export_dynamic` leaves out work done per traced tensor whose
results fxrec never reads (:func:`_lean_tracing`), embedding bags are traced as one operator whose
sizes are computed directly instead of through aten's meta function and then put back as aten's
(:mod:`fxrec.capture_bags`; 2.2 s of the 4.5 s left before it), and :func:`capture` does not have
torch build the guard function that fxrec replaces (:func:`_unlifted`).
The symbols themselves stay: each ids tensor keeps its own (features take different numbers of
ids in one call), and the offsets' batch symbols become one where the model ties them (the
``torch.cat`` of the pooled outputs). Declaring that tie up front with one shared ``Dim`` saves
about a tenth (torch.export still makes a symbol per input and equates them afterwards) and would
tie inputs that a model leaves apart, so it is not done.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import inspect
import os
import re
import threading
import traceback
from itertools import chain
from typing import Any, Dict, List, Optional, Sequence, Tuple

import sympy
import torch
import torch.fx as fx
from torch.export import Dim
from torch.utils import _pytree as pytree
from torch.utils._sympy.printers import PythonPrinter

from . import meta
from .capture_bags import bags_of_rows, opaque_bags, restore_aten
from .capture_reshapes import reshape_by_copy, without_own_guards
from .codegen import StructuredCodeGen, leaf_paths, supported
from .graph_module import MODES_KEY, TransformedModule, adopt, hold_containers_like
from .modes import TrainingReads, bind_modes, train_overrides
from .runtime.input_guards import GUARDS_NAME, InputGuards


class CaptureError(RuntimeError):
    """The model could not be captured; the message names the user's file and line."""


_SKIP = (os.path.dirname(torch.__file__), os.path.dirname(__file__), os.path.dirname(os.__file__))


def _user_frame(exc: BaseException):
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if not f.filename.startswith(_SKIP) and "<" not in f.filename]
    return user[-1] if user else None


def _dynamic_shapes(model: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]):
    """Every dim of every tensor input dynamic where the model allows it, but those of size 0 or 1
    in the example: code such as ``x.squeeze(-1)`` depends on them being 1 (torch.export fixes them
    too; the report names them)."""

    def spec(x):
        if isinstance(x, torch.Tensor):
            return {i: Dim.AUTO for i in range(x.dim()) if x.shape[i] > 1} if x.dim() else None
        if _custom_node(x):  # torch takes a registered class's sizes as a list, in its flattened order
            return [shapes(c) for c in pytree.SUPPORTED_NODES[type(x)].flatten_fn(x)[0]]
        return None

    def shapes(tree):
        return pytree.tree_map(spec, tree, is_leaf=_custom_node)

    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        params = ()
    var_kw = [p.name for p in params if p.kind is p.VAR_KEYWORD]
    if var_kw and kwargs and var_kw[0] in inspect.signature(model.forward).bind(*args, **kwargs).arguments:
        raise CaptureError(f"fxrec: {type(model).__name__}.forward takes **{var_kw[0]}, for which torch.export "
                           "takes no dynamic sizes (it fails with 'Must provide a tree_name'): name the "
                           "arguments, or take them as one dict argument")
    if not kwargs and not any(p.kind is p.VAR_POSITIONAL for p in params):
        return shapes(args)
    bound = inspect.signature(model.forward).bind(*args, **kwargs)  # (*args: one tuple, as torch binds it)
    return {name: shapes(value) for name, value in bound.arguments.items()}


#: pytree's own containers, whose sizes torch.export takes in their own structure
_CONTAINERS = (list, tuple, dict, collections.OrderedDict, collections.defaultdict, collections.deque)


def _custom_node(x) -> bool:
    """A registered pytree class (``torch.export.register_dataclass``, ``register_pytree_node``)."""
    return (type(x) in pytree.SUPPORTED_NODES and type(x) not in _CONTAINERS
            and not (isinstance(x, tuple) and hasattr(type(x), "_fields")))


def export_dynamic(model: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], lean_bags: bool = False,
                   warn_as: str = ""):
    """torch.export, non-strict, every dim dynamic (see :func:`_dynamic_shapes`). Sizes are captured
    size-obliviously (torch's ``backed_size_oblivious``): without it, export takes every dynamic size
    to be 2 or more, so a model captured on a batch of 3 refuses a batch of 1. Where that capture
    fails, the ordinary one is tried (the report then names the sizes the model accepts).
    ``lean_bags``: embedding bags are traced as :mod:`fxrec.capture_bags` describes (same program,
    less time). ``warn_as``: a caller that reports no sizes (``fxrec.export.program``) is named in
    a warning when the ordinary capture is used."""
    dynamic = _dynamic_shapes(model, args, kwargs)

    def run():
        with _lean_tracing(), (opaque_bags() if lean_bags else contextlib.nullcontext()), \
                reshape_by_copy(), without_own_guards(), bags_of_rows():
            ep = torch.export.export(model, *_unaliased(copy.deepcopy((args, kwargs))), strict=False,
                                     dynamic_shapes=dynamic)
            if lean_bags:
                renamed = restore_aten(ep.graph_module)
                for spec in ep.graph_signature.output_specs:  # an output that was a bag's now is its getitem
                    if getattr(spec.arg, "name", None) in renamed:
                        spec.arg.name = renamed[spec.arg.name]
        return ep

    config = torch.fx.experimental._config
    if hasattr(config, "backed_size_oblivious"):
        try:
            with config.patch(backed_size_oblivious=True):
                return run()
        except Exception as e:  # noqa: BLE001 - the ordinary capture below says what is wrong
            if warn_as:
                import warnings

                first = (str(e).strip().splitlines() or [""])[0][:300]
                warnings.warn(f"{warn_as}: torch.export could not capture the sizes size-obliviously "
                              f"({type(e).__name__}: {first}); captured the ordinary way, which takes every "
                              "dynamic size to be at least 2 and may keep conditions of the example's sizes: "
                              "the program's range_constraints and guards say which sizes it accepts",
                              stacklevel=3)
    return run()


def _unaliased(tree):
    """``tree`` with each tensor that appears in it a second time (the same object, as in
    ``[offsets] * 3``) replaced by a copy. torch.export gives one tensor passed twice one
    placeholder, so the captured model would read that input for both places at every later
    call, however different the tensors it is given there."""
    seen = set()

    def one(x):
        if isinstance(x, torch.Tensor):
            if id(x) in seen:
                return x.detach().clone().requires_grad_(x.requires_grad)
            seen.add(id(x))
        return x

    return pytree.tree_map(one, tree)


@contextlib.contextmanager
def _lean_tracing():
    """Within: torch.export does not do two things per traced tensor whose results fxrec never
    reads, and which cost most of the capture time once there are hundreds of size symbols
    (sympy reasoning on expressions of fresh symbols):

    * the fake-tensor cache, off (``torch._dynamo.config.fake_tensor_cache_enabled``): an entry is
      checked against the operator's output when it is made, and with a symbol per input an
      operator seldom meets the same sizes again, so entries cost and never pay back;
    * the memory format in each node's ``meta["tensor_meta"]``, not computed (three contiguity
      tests a tensor); ``meta["val"]``, which fxrec and torch read, keeps the full sizes and strides.

    Neither changes the captured graph. The second is switched for this thread only; the first is
    a torch config setting, process-wide while the capture runs (as ``backed_size_oblivious`` is).
    """
    import torch._dynamo.config as dynamo_config  # torch.export imports it anyway

    with contextlib.ExitStack() as stack:
        if hasattr(dynamo_config, "fake_tensor_cache_enabled"):
            stack.enter_context(dynamo_config.patch(fake_tensor_cache_enabled=False))
        if _install_lean_tensor_meta():
            previous = getattr(_LEAN, "active", False)
            _LEAN.active = True
            stack.callback(setattr, _LEAN, "active", previous)
        yield


_LEAN = threading.local()  # .active: this thread's capture leaves the memory format out
_LEAN_LOCK = threading.Lock()


def _install_lean_tensor_meta() -> bool:
    """Wrap the function torch's proxy tracer calls for ``meta["tensor_meta"]`` (once per process) so
    that it skips the memory format while this thread has ``_LEAN.active`` set, and is torch's own
    everywhere else. False where this torch has no such function (then nothing changes)."""
    from torch.fx.experimental import proxy_tensor

    with _LEAN_LOCK:
        full = getattr(proxy_tensor, "_extract_tensor_metadata", None)
        if full is None:
            return False
        if getattr(full, "_fxrec_lean", False):
            return True
        try:
            inspect.signature(full).bind(None, include_contiguity=False)
        except (TypeError, ValueError):
            return False

        @functools.wraps(full)
        def extract(result, include_contiguity=True):
            return full(result, include_contiguity=include_contiguity and not getattr(_LEAN, "active", False))

        extract._fxrec_lean = True
        proxy_tensor._extract_tensor_metadata = extract
        return True


def _unlifted(ep) -> fx.GraphModule:
    """``ep.module()`` without the guard function (``_guards_fn``) torch builds for it: capture puts
    :class:`InputGuards` in its place, and building it costs a second a few hundred inputs (torch
    formats every input path for every guard)."""
    if "check_guards" in inspect.signature(type(ep).module).parameters:
        return ep.module(check_guards=False)
    return ep.module()  # a torch without the argument builds no guard function


def _capture_error(model: torch.nn.Module, e: BaseException) -> CaptureError:
    frame = _user_frame(e)
    where = f"{frame.filename}:{frame.lineno} ({frame.line})" if frame else "inside torch.export"
    return CaptureError(
        f"fxrec could not capture {type(model).__name__} at {where}: {type(e).__name__}: "
        f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}\n"
        "What to do: run the model once on the same example inputs to check that they are what "
        "forward expects; keep data-dependent Python control flow (if on a tensor's value, "
        ".item(), .tolist()) out of forward or move it to the data loader; pass every tensor "
        "the model reads as an input rather than a global."
    )


def _refuse_wrapped(model: torch.nn.Module) -> None:
    """A submodule wrapped for data parallelism (DistributedDataParallel, FullyShardedDataParallel)
    runs communication in its forward, which torch.export does not capture: a CaptureError naming
    it, saying what to pass instead."""
    from torch.nn.parallel import DistributedDataParallel

    for name, m in model.named_modules():
        kind = type(m).__name__
        if isinstance(m, DistributedDataParallel) or kind == "FullyShardedDataParallel" or kind.startswith("FSDP"):
            where = f"submodule '{name}'" if name else "the model"
            raise CaptureError(
                f"fxrec: {where} is wrapped in {kind}, whose forward torch.export cannot capture. Pass the "
                "module it wraps (its .module): with a plan, fxrec sums the gradients of every parameter "
                "outside the sharded tables over ranks itself (DDP's reducer, docs/sharding.md); without one, wrap "
                "the transformed model instead (DistributedDataParallel(fxrec.transform(model, ...)))")


def capture(model: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any],
            for_calls: bool = True) -> TransformedModule:
    """``model`` (which fxrec owns: a copy of the user's) as a :class:`TransformedModule` (see the
    module doc). ``for_calls``: learn what calling the graph needs: whether the model's dicts' key
    order matters (:func:`_dict_order_matters`, two runs of the model) and the input conditions of its
    other mode (:func:`_bind_mode_conditions`, a second capture); fxrec.explain, whose graph is never
    called, leaves them out."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fxrec.transform needs an nn.Module, got {type(model).__name__}")
    _check_call(model, args, kwargs)
    _refuse_wrapped(model)
    reads = TrainingReads(model)
    held = {n for n, _ in model.named_modules()} | {n for n, _ in model.named_parameters()}
    try:
        with reads:
            ep = export_dynamic(model, args, kwargs, lean_bags=True)
    except CaptureError:  # (fxrec's own, saying what to do)
        raise
    except Exception as e:
        raise _capture_error(model, e) from e
    made = sorted(({n for n, _ in model.named_modules()} | {n for n, _ in model.named_parameters()}) - held)
    if made:
        # (their weights are then drawn anew in the graph at every call, and trained by nothing)
        raise CaptureError(f"fxrec: the model's forward created {made[:6]}{' ...' if len(made) > 6 else ''} while it "
                           "was captured; a transformed model cannot hold what its forward creates: run the model "
                           "once on an example input before fxrec.transform, so that they exist")
    try:
        gm = _unlifted(ep)
    except SyntaxError as e:  # torch writes module names into generated code unescaped
        odd = [n for n, _ in model.named_modules() if any(c in n for c in "\"'\\\n\r")]
        raise CaptureError(f"fxrec: torch.export's code for this model does not compile ({e.msg}); "
                           + (f"module names {odd[:3]} hold quotes, backslashes or line breaks, which torch "
                              "writes into that code as they are: rename them" if odd else "")) from e
    _one_name_per_tensor(gm)
    gm.meta[meta.EMBEDDING_WEIGHTS] = _embedding_weights(model)
    paths = _install_input_guards(gm, ep)
    _name_inputs(gm, paths)
    _structured_forward(gm, _defaults_left(model, args, kwargs),
                        for_calls and _dict_order_matters(model, args, kwargs, gm), _given_with_defaults(model, args, kwargs))
    adopt(gm)  # (which recompiles: the two above change the graph and its code generator without)
    hold_containers_like(gm, model)

    other: Dict[str, Any] = {}

    def recapture() -> fx.GraphModule:  # every module in the other mode than its own (once)
        if "gm" not in other:
            flags = {m: m.training for m in model.modules()}
            for m, f in flags.items():
                m.training = not f
            try:
                with reads:  # (the readers of the other mode too: code that reads a flag only there)
                    other["ep"] = export_dynamic(model, args, kwargs, lean_bags=True)
                other["gm"] = _unlifted(other["ep"])
                _one_name_per_tensor(other["gm"])  # (as the captured graph: a tied table is one node)
                other["gm"].recompile()
            finally:
                for m, f in flags.items():
                    m.training = f
        return other["gm"]

    gm.meta[MODES_KEY] = info = bind_modes(gm, model, reads, recapture, train_overrides(model))
    if for_calls and info.switchable:
        _bind_mode_conditions(gm, paths, recapture, other, model.training)
    return gm


#: ops whose size checks hold in one mode only (batch norm's and instance norm's `more than 1 value
#: per channel`, in training mode)
_CHECKED_IN_ONE_MODE = (torch.ops.aten.batch_norm.default, torch.ops.aten.instance_norm.default)


def _bind_mode_conditions(gm: fx.GraphModule, paths: List[str], recapture, other: Dict[str, Any],
                          training: bool) -> None:
    """Give the input guards the size conditions of the model's other mode where they differ from the
    captured mode's, and the flags of the modules that follow the mode, so that ``fast.eval()`` after a
    training-mode capture takes a batch of 1 that only batch norm's training-mode check refused, and
    ``fast.train()`` after an eval-mode capture refuses one (batch norm would otherwise train on it and
    write NaN into its running variance, where the plain model raises). The other mode's conditions
    come from capturing the model in it (a second export), done only where a batch or instance norm
    follows the mode: their checks are the ones known to differ, and their flags are the ones read."""
    guards = input_guards(gm)
    # the flags of the norms that follow the mode (a dropout's mode changes no size condition)
    flags = list({n.args[5]: None for n in gm.graph.nodes if n.op == "call_function" and n.target in _CHECKED_IN_ONE_MODE
                  and len(n.args) > 5 and isinstance(n.args[5], fx.Node) and n.args[5].op == "get_attr"})
    call = next((n for n in gm.graph.nodes if n.op == "call_module" and n.target == GUARDS_NAME), None)
    if guards is None or call is None or not flags:
        return
    try:
        recapture()
    except Exception:  # noqa: BLE001 - the other mode cannot be captured: the captured mode's conditions stay
        return
    theirs = _export_conditions(other["ep"], paths)
    if set(theirs) == set(guards.conditions):
        return
    guards.set_other_mode(not training, theirs)
    call.kwargs = {"modes": tuple(flags)}
    first = min(flags, key=lambda n: list(gm.graph.nodes).index(n))
    if list(gm.graph.nodes).index(first) > list(gm.graph.nodes).index(call):  # (the flags are read first)
        for f in flags:
            call.prepend(f)
    gm.recompile()


def _name_inputs(gm: fx.GraphModule, paths: List[str]) -> None:
    """Each input placeholder's name as the model spells it (``meta.INPUT_NAME``), where it differs
    from torch.export's only in case: export lower-cases them (``userIds`` became feature ``userids``
    in the report and in errors)."""
    from . import meta

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(paths) != len(placeholders):
        return
    for n, path in zip(placeholders, paths):
        spelled = re.sub(r"[^0-9A-Za-z_]+", "_", path.replace("'", "")).strip("_")
        if spelled != n.name and spelled.lower() == n.name.lower():
            n.meta[meta.INPUT_NAME] = spelled


def _one_name_per_tensor(gm: fx.GraphModule) -> None:
    """One ``get_attr`` node per parameter or buffer, by the name ``named_parameters()`` gives it:
    torch.export reads a tied weight (``out.weight = emb.weight``, two tables sharing one) by each
    module's own name, which made two tables of one, named after the alias that state_dict's keys
    and ``optimizer=`` do not use. The caller recompiles ``gm``."""
    canonical = {id(t): n for n, t in chain(gm.named_parameters(), gm.named_buffers())}
    first: Dict[str, fx.Node] = {}
    for n in list(gm.graph.nodes):
        if n.op != "get_attr" or not isinstance(n.target, str):
            continue
        try:
            t = gm.get_parameter(n.target)
        except AttributeError:
            try:
                t = gm.get_buffer(n.target)
            except AttributeError:
                continue
        name = canonical.get(id(t), n.target)
        if name in first:
            n.replace_all_uses_with(first[name])
            gm.graph.erase_node(n)
        else:
            first[name] = n
            n.target = name


def _check_call(model: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    """The example inputs must fit the model's ``forward`` (else export's own error, which does not say
    that ``example_inputs`` are the positional arguments)."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return  # (a forward inspect cannot read: export says what it finds)
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        from .pass_infra import InputError

        raise InputError(
            f"fxrec: the example inputs do not fit {type(model).__name__}.forward{sig}: {e} ({len(args)} positional "
            "given). example_inputs are forward's positional arguments, a tuple (a list is taken as one too): "
            "for one argument that is a list, pass ([...],)") from None


def input_guards(gm: torch.nn.Module) -> Optional[InputGuards]:
    """The input checks of a captured model (None if it has none)."""
    mod = getattr(gm, GUARDS_NAME, None)
    return mod if isinstance(mod, InputGuards) else None


def _export_conditions(ep, paths: List[str]) -> List[str]:
    """export's guards of ``ep`` on its inputs' sizes other than their shapes and ranges, over the
    inputs named ``a0``, ``a1``, ... (export names them ``L['ids'][2]``; ``paths`` are the inputs' paths
    in that form, in order)."""
    sources = sorted(((f"L[{p.split('[', 1)[0]!r}]" + p[len(p.split("[", 1)[0]):], f"a{k}")
                      for k, p in enumerate(paths)), key=lambda x: -len(x[0]))
    conditions = []
    for g in getattr(ep, "_guards_code", None) or []:
        for src, arg in sources:
            g = g.replace(src, arg)
        if "L[" not in g:
            conditions.append(g)
    return conditions


def _install_input_guards(gm: fx.GraphModule, ep) -> List[str]:
    """Put :class:`InputGuards` where export's guard function (``_guards_fn``) goes, built from the
    same facts: the placeholders' symbolic shapes, the range of each size, and export's other guards.
    (:func:`_unlifted` asks torch not to build its own; one it builds anyway is removed.) The caller
    recompiles ``gm``. Returns the inputs' paths (``ids[2]``), in order."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not placeholders:
        return []
    info = getattr(gm.graph._codegen, "pytree_info", None)
    try:
        paths = leaf_paths(info.in_spec, info.orig_args)
    except Exception:  # noqa: BLE001 - structures the code generator does not take
        paths = []
    if len(paths) != len(placeholders):
        paths = [n.name for n in placeholders]
    exprs: List[Optional[list]] = []
    values = {}
    for k, n in enumerate(placeholders):
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            if isinstance(val, (bool, int, float, str)):  # baked into the graph at capture
                values[k] = val
            exprs.append(None)
            continue
        exprs.append([sympy.sympify(s.node.expr) if isinstance(s, torch.SymInt) else sympy.Integer(int(s))
                      for s in val.shape])
    bound = {e for dims in exprs if dims for e in dims if isinstance(e, sympy.Symbol)}
    printer = PythonPrinter()

    def size(e):
        if isinstance(e, sympy.Integer):
            return int(e)
        if isinstance(e, sympy.Symbol):
            return str(e)
        # a size derived from others; checked where every symbol it uses is bound by some input
        return printer.doprint(e) if e.free_symbols <= bound else None

    shapes = [None if dims is None else [size(e) for e in dims] for dims in exprs]
    ranges = {}
    for sym, vr in (getattr(ep, "range_constraints", None) or {}).items():
        if sym in bound:
            # (torch's int_oo, "no bound", is not a sympy Integer)
            lo = int(vr.lower) if isinstance(vr.lower, sympy.Integer) else 0
            hi = int(vr.upper) if isinstance(vr.upper, sympy.Integer) else None
            ranges[str(sym)] = (max(lo, 0), hi)
    conditions = _export_conditions(ep, paths)
    guards = InputGuards([p.replace("'", "") for p in paths], shapes, ranges, conditions, values)
    for old in [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "_guards_fn"]:
        gm.graph.erase_node(old)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    gm.add_submodule(GUARDS_NAME, guards)
    with gm.graph.inserting_after(placeholders[-1]):
        gm.graph.call_module(GUARDS_NAME, tuple(placeholders))  # the whole model's: no nn_module_stack
    return paths


def accepted_sizes(gm: torch.nn.Module) -> List[str]:
    """Report notes: the input sizes the captured model accepts: a summary line, then every
    restriction (a fixed size of 0 or 1, a size that must be at least 2, an upper bound)."""
    guards = input_guards(gm)
    if guards is None:
        return []
    symbols = {s for shape in guards.shapes for s in (shape or ()) if isinstance(s, str) and s.isidentifier()}
    free = [s for s in symbols if guards.ranges.get(s, (0, None))[0] <= 1 and guards.ranges.get(s, (0, None))[1] is None]
    fixed = [(guards.paths[k], d, s) for k, shape in enumerate(guards.shapes) for d, s in enumerate(shape or ())
             if isinstance(s, int)]
    shown = ", ".join(f"{p} dim {d} = {v}" for p, d, v in fixed[:6]) + (f" and {len(fixed) - 6} more" if len(fixed) > 6
                                                                         else "")
    # export's other conditions on the sizes: those a size of 1 breaks (a transposed [B, L] bag's
    # `!= 1`), found by trying each size at 1 with the others at 16
    refused = _refused_at_one(guards, symbols)
    if refused is None:  # conditions the probe cannot try: named as they are, no claim of any value
        conds = [re.sub(r"\ba(\d+)\b", lambda m: guards.paths[int(m.group(1))], c) + guards._mode_only(c)
                 for c in guards.conditions if not guards._implied(c)]
        notes = [f"input sizes: {len(symbols)} dynamic size(s), under conditions of the model's code (below)"
                 + (f"; fixed: {shown}" if fixed else "")]
        notes += [f"the model's code needs {c} (a condition torch.export's capture of it kept: its own, or of a "
                  "torch function it calls)" for c in conds]
        return notes + _bounds_and_fixed(guards)
    free = [s for s in free if s not in refused]
    parts = [f"{len(free)} dynamic size(s) that take any value (batch 1 included)"] if free or not refused else []
    if refused:
        parts.append(f"{len(refused)} {'more ' if free else ''}dynamic size(s) that conditions of the model's code "
                     "restrict (below)")
    notes = ["input sizes: " + ", ".join(parts) + (f"; fixed: {shown}" if fixed else "")]
    for sym, conds in sorted(refused.items()):
        named = [re.sub(r"\ba(\d+)\b", lambda m: guards.paths[int(m.group(1))], c) + guards._mode_only(c)
                 for c in conds]
        notes.append(f"size 1 in {guards.sizes_of(sym)} is refused: the model's code needs {' and '.join(named)} "
                     "(conditions torch.export's capture of it kept; other sizes may break them too)")
    return notes + _bounds_and_fixed(guards)


def _bounds_and_fixed(guards) -> List[str]:
    """Report notes: each size's bounds, and each dim fixed at 0 or 1."""
    notes = []
    for s, (lo, hi) in sorted(guards.ranges.items()):
        if lo > 1 or hi is not None:
            where = guards.sizes_of(s)
            span = f"{lo} to {hi}" if hi is not None else f"{lo} or more"
            notes.append(f"the model accepts sizes {span} in {where} (a condition of its code, kept at capture)")
    for k, shape in enumerate(guards.shapes):
        for d, s in enumerate(shape or ()):
            if s in (0, 1):
                notes.append(f"input {guards.paths[k]} accepts only size {s} in dim {d} (fixed at capture)")
    return notes


def _refused_at_one(guards, symbols) -> Optional[Dict[str, List[str]]]:
    """Per dynamic size (symbol), the conditions of ``guards`` that inputs with that size 1 and
    every other size 16 (a size's own bounds respected) break, where 16 everywhere keeps them:
    what a batch (or length) of 1 meets. Conditions that only say two sizes are equal are left
    out (setting one of them alone to 1 breaks them, not the model). None where the conditions
    cannot be evaluated so (or 16 everywhere breaks one): no claim either way."""
    from .runtime.input_guards import _namespace

    ref = re.compile(r"\ba\d+\.size\(\)\[\d+\]")

    def restricts(c: str) -> bool:
        if "==" in c and not re.search(r"[<>]|!=", c):
            left, right = c.split("==", 1)
            return not (ref.search(left) and ref.search(right))  # a size against a number
        return True

    kept = [c for c in guards.conditions if not guards._implied(c) and restricts(c)]
    if not kept:
        return {}
    if any(shape is None for shape in guards.shapes):
        return None
    ns = _namespace()

    def broken(values: Dict[str, int]) -> List[str]:
        env = {**ns, **values}
        fakes = {}
        for k, shape in enumerate(guards.shapes):
            dims = [x if isinstance(x, int) else int(eval(x, env)) for x in shape]  # noqa: S307 - export's own
            fakes[f"a{k}"] = torch.empty([max(d, 0) for d in dims], device="meta")
        env.update(fakes)
        return [c for c in kept if not eval(c, env)]  # noqa: S307 - export's own conditions (how they are checked)

    def typical(sym: str) -> int:
        lo, hi = guards.ranges.get(sym, (0, None))
        return max(lo, 16) if hi is None else min(max(lo, 16), hi)

    try:
        base = {sym: typical(sym) for sym in symbols}
        if broken(base):
            return None
        out = {}
        for sym in sorted(symbols):
            if guards.ranges.get(sym, (0, None))[0] <= 1:
                failed = broken({**base, sym: 1})
                if failed:
                    out[sym] = failed
        return out
    except Exception:  # noqa: BLE001 - a condition this probe cannot evaluate: no claim either way
        return None


_LITERALS = (type(None), bool, int, float, str)


def _defaults_left(model: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> List[Tuple[str, Any]]:
    """The arguments of ``model.forward`` after every one the example gave, left at their
    defaults, when those are plain values (None, a bool, int, float or str; not NaN): the
    transformed model takes them too, at those values (``fast(ids, dense=None)`` as the model)."""
    try:
        sig = inspect.signature(model.forward)
        given = set(sig.bind(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return []
    params = list(sig.parameters.values())
    last = max((i for i, p in enumerate(params) if p.name in given), default=-1)
    out = []
    for p in params[last + 1:]:
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) or p.default is p.empty:
            return []
        v = p.default
        if type(v) not in _LITERALS or (isinstance(v, float) and v != v):
            return []
        out.append((p.name, v))
    return out


def _given_with_defaults(model: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> List[tuple]:
    """(name, its default as written, whether the example gave it at that default None) of the forward's
    arguments the example gives that have a default."""
    try:
        sig = inspect.signature(model.forward)
        given = sig.bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return []
    return [(p.name, repr(p.default), given[p.name] is None and p.default is None)
            for p in sig.parameters.values()
            if p.name in given and p.default is not p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _embedding_weights(model: torch.nn.Module) -> List[str]:
    """Every name of the weights of the model's nn.Embedding / nn.EmbeddingBag modules (a tied one
    under each of its names)."""
    ids = {id(m.weight) for m in model.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))}
    return sorted(n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in ids)


def _reordered(tree):
    """``tree`` with every dict of two or more keys in the reverse order (nothing else changed)."""
    if type(tree) is dict:
        items = [(k, _reordered(v)) for k, v in tree.items()]
        return dict(reversed(items)) if len(items) > 1 else dict(items)
    if type(tree) in (list, tuple):
        return type(tree)(_reordered(x) for x in tree)
    return tree


def _dict_order_matters(model: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                        gm: Optional[fx.GraphModule] = None) -> bool:
    """Whether the model's output depends on the order of the keys of its dict inputs (its code
    iterates one: ``for k, v in feats.items()``), found by running it on the example with every
    dict of two or more keys reversed (random state and buffers kept). The captured graph reads a
    dict by key in the captured order whatever order it is given, so such a model takes its dicts
    only in that order. True, without a run, for a model with tensors on the meta device."""
    if not _has_dicts((args, kwargs)):
        return False
    if any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        return True
    from .verify import buffers_kept, written_in_forward

    written = written_in_forward(gm) if gm is not None else []  # (its capture: what forward writes)
    outs = []

    def run(tree):
        with buffers_kept(model, params=written), torch.no_grad():
            torch.manual_seed(0)
            a, k = copy.deepcopy(tree)
            outs.append(model(*a, **k))

    for tree in ((args, kwargs), _reordered((args, kwargs))):
        try:
            run(tree)
        except Exception:  # noqa: BLE001 - e.g. `dense, ids = feats.values()`: the order matters
            if not outs:
                raise
            return True
    if pytree.tree_structure(outs[0]) != pytree.tree_structure(outs[1]):  # (an output dict in the input's order)
        return True
    if _same(outs[1], outs[0]):  # exactly: the transformed model computes in the example's order, bit for bit
        return False
    # A model whose runs differ in the same order (CUDA's atomic adds: index_add_, scatter_add_) is
    # not told apart by exact equality: where a second run in the example's order differs too,
    # the reordered run is compared as close, not equal
    run((args, kwargs))
    return _same(outs[2], outs[0]) or not _same(outs[1], outs[0], exact=False)


def _same(a, b, exact: bool = True) -> bool:
    try:
        torch.testing.assert_close(a, b, equal_nan=True, **({"rtol": 0, "atol": 0} if exact else {}))
    except (AssertionError, TypeError, ValueError):
        return False
    return True


def _has_dicts(tree) -> bool:
    if isinstance(tree, dict):
        return len(tree) > 1 or any(_has_dicts(v) for v in tree.values())
    if type(tree) in (list, tuple):
        return any(_has_dicts(x) for x in tree)
    return False


def _structured_forward(gm: fx.GraphModule, defaults: Sequence[Tuple[str, Any]] = (), dict_order: bool = False,
                        optional: Sequence[tuple] = ()) -> None:
    """Give ``gm`` a ``forward`` that takes the model's own arguments and reads the tensors out of
    them by index (see :mod:`fxrec.codegen`), instead of export's per-call pytree flatten and
    structure check; list lengths are still checked, with a message that names the input. The caller
    recompiles ``gm``."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is None or info.in_spec is None or not supported(info.in_spec) or not supported(info.out_spec):
        return  # namedtuples, OrderedDicts, ...: export's own pytree forward stays
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    none_leaves = [k for k, n in enumerate(placeholders) if "val" in n.meta and n.meta["val"] is None]
    gm.graph._codegen = StructuredCodeGen(info.in_spec, info.out_spec, info.orig_args, none_leaves=none_leaves,
                                          defaults=defaults, dict_order=dict_order, optional=optional)
    if hasattr(gm, "validate_inputs"):
        gm.validate_inputs = False  # the generated forward checks what it reads
