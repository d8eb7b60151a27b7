"""train() / eval() for a captured model: which graph nodes follow a module's ``training`` flag.

torch.export captures a model in one mode: dropout and batch norm appear as
``aten.dropout.default(x, 0.5, True)`` and ``aten.batch_norm.default(..., True, ...)`` with the
flag of the mode the model was in, and batch norm's ``num_batches_tracked += 1`` is there in
training mode only. To make ``fast.eval()`` / ``fast.train()`` do what they do on the original
model, capture records what each mode needs instead of capturing twice:

* every mode flag of torch's dropout modules (all kinds), batch norm and instance norm with
  running statistics, and RReLU is replaced by the ``training`` attribute of that module, read
  when the model runs (a ``get_attr`` node of ``<module path>.training``); batch norm's counter
  becomes :func:`fxrec.runtime.modes.count_batch`, which counts in training mode only (the same
  ops called by the model's own code, ``F.dropout(x, 0.5)``, keep their flag: they drop in eval
  mode too, unless the code reads ``training``, below);
* while torch.export runs the model, every read of a module's ``training`` attribute is recorded
  (:class:`TrainingReads`). Reads by the modules above are accounted for. A read anywhere else
  (``if self.training:`` in the model's code, ``F.dropout(x, training=self.training)``, a
  MultiheadAttention fast path) may change the graph in ways no flag shows, so the model is
  captured a second time with every module in the other mode and the two graphs are compared:
  where they differ only in boolean arguments, or float ones (``nn.MultiheadAttention``'s dropout
  probability, 0 in eval mode), those arguments follow the flag of a module whose ``training``
  the code reads (:func:`_deciders`; :func:`fxrec.runtime.modes.evaluating` where the argument is
  the flag's negation, :func:`fxrec.runtime.modes.by_mode` for numbers), and where several such
  flags may decide it, a call with them in another combination than the two captured is refused
  (:func:`fxrec.runtime.modes.as_captured_or_flipped`); where they
  differ otherwise, the transformed model keeps the mode it was captured in and ``train()`` /
  ``eval()`` to the other mode raise :class:`ModeError` naming the modules and the code lines that
  read ``training`` (the report says so at transform time).

Each module's flag starts as the original module's (``model.tower.eval()`` before the transform
is kept). A module that only dropout or a functional call uses, and that holds no parameters, is
recreated as an empty ``nn.Module`` in the transformed model so that it has a flag to set.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from .runtime.modes import ModeError, as_captured, as_captured_or_flipped, by_mode, count_batch, evaluating

aten = torch.ops.aten


# op -> (index of its mode flag, index of an argument that must not be None for the flag to follow
# the mode: batch/instance norm without running statistics always use the batch's statistics)
MODE_OPS: Dict[object, Tuple[int, Optional[int]]] = {
    aten.dropout.default: (2, None),
    aten.feature_dropout.default: (2, None),
    aten.alpha_dropout.default: (2, None),
    aten.feature_alpha_dropout.default: (2, None),
    aten.rrelu.default: (3, None),
    aten.batch_norm.default: (5, 3),
    aten.instance_norm.default: (5, 3),
}

_KNOWN_READERS = (
    torch.nn.modules.dropout._DropoutNd,
    torch.nn.modules.batchnorm._BatchNorm,
    torch.nn.modules.instancenorm._InstanceNorm,
    torch.nn.RReLU,
)
_TORCH_DIR = os.path.dirname(torch.__file__)
_TORCH_NN = os.path.join(_TORCH_DIR, "nn", "modules")


@dataclass(frozen=True)
class ModeInfo:
    """What train() / eval() do on a transformed model (in ``gm.meta["fxrec_modes"]``).

    captured: the mode of the capture (``"training"`` / ``"eval"``).
    switchable: whether the other mode is available; ``why_not`` says why not.
    flags: per module path, the number of graph nodes that follow its ``training`` flag.
    """

    captured: str
    switchable: bool = True
    why_not: str = ""
    flags: Dict[str, int] = field(default_factory=dict)
    #: where the model's class (or a submodule's) overrides ``train()``: each module's flag after the
    #: model's ``train(True)`` and ``train(False)``, which ``fast.train()`` / ``eval()`` give too
    after_train: Optional[Dict[bool, Dict[str, bool]]] = None


def train_overrides(model: torch.nn.Module) -> Optional[Dict[bool, Dict[str, bool]]]:
    """Where a module of ``model`` overrides ``nn.Module.train`` (``def train(self, mode=True):
    super().train(mode); self.frozen.eval()``, a frozen backbone): each module's flag after
    ``model.train(True)`` and after ``model.train(False)``, found by calling them on the model and
    putting back every flag and every parameter's ``requires_grad`` after (an override that does
    more than that is not replayed). None where none overrides it."""
    if all(type(m).train is torch.nn.Module.train for m in model.modules()):
        return None
    flags = {m: m.__dict__.get("training", m.training) for m in model.modules()}
    grads = {p: p.requires_grad for p in model.parameters()}
    out: Dict[bool, Dict[str, bool]] = {}
    try:
        for mode in (True, False):
            model.train(mode)
            out[mode] = {path: m.training for path, m in model.named_modules()}
    finally:
        for m, f in flags.items():
            m.training = f
        for p, g in grads.items():
            p.requires_grad_(g)
    return out


# --------------------------------------------------------------------------- reads of .training
class TrainingReads:
    """Records who reads ``module.training`` while the model runs (see the module doc).

    Inside the ``with``, every module of ``model`` is given a subclass of its class (same name and
    module, so torch.export records the same types) whose ``training`` is a property that notes the
    reading frame. The classes are put back on exit.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.unknown: Dict[str, str] = {}  # module path -> "file:line" of the first unaccounted read
        self._paths = {id(m): p for p, m in model.named_modules()}
        self._saved: List[Tuple[torch.nn.Module, type]] = []
        self._classes: Dict[type, Optional[type]] = {}

    def _note(self, module: torch.nn.Module, frame) -> None:
        code = frame.f_code
        if _known_module(module) and code.co_filename.startswith(_TORCH_NN):
            return  # torch's dropout / norm modules reading their own flag: their ops carry it
        if code.co_filename == torch.nn.modules.module.__file__:
            return  # nn.Module itself (train(), repr)
        path = self._paths.get(id(module), "?")
        self.unknown.setdefault(path or "<model>", f"{os.path.basename(code.co_filename)}:{frame.f_lineno} "
                                f"({code.co_name})")

    def _recording_class(self, klass: type) -> Optional[type]:
        """``klass`` with a ``training`` property that notes its readers (None where it cannot be made)."""
        if klass in self._classes:
            return self._classes[klass]
        sub = None
        if not any("training" in vars(k) for k in klass.__mro__ if k not in (object, torch.nn.Module)):
            recorder = self

            def get(module):
                recorder._note(module, sys._getframe(1))
                return module.__dict__["training"]

            def set_(module, value):
                module.__dict__["training"] = value

            try:
                sub = type(klass.__name__, (klass,), {"training": property(get, set_), "__module__": klass.__module__,
                                                      "__qualname__": klass.__qualname__})
            except TypeError:  # a metaclass that refuses
                sub = None
        self._classes[klass] = sub
        return sub

    def __enter__(self) -> "TrainingReads":
        for m in self.model.modules():
            sub = self._recording_class(type(m))
            if sub is None:  # its reads cannot be seen: treated as the model's own code reading
                self.unknown.setdefault(self._paths.get(id(m), "?") or "<model>", f"class {type(m).__name__}")
                continue
            if "training" not in m.__dict__:
                continue
            self._saved.append((m, type(m)))
            m.__class__ = sub
        return self

    def __exit__(self, *exc) -> None:
        for m, klass in self._saved:
            m.__class__ = klass
        self._saved.clear()


# --------------------------------------------------------------------------- graph rewrite
def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def _full_args(node: fx.Node, upto: int) -> list:
    """The node's positional args, padded with the schema's defaults up to index ``upto``."""
    args = list(node.args)
    schema = node.target._schema
    for i in range(len(args), upto + 1):
        a = schema.arguments[i]
        args.append(node.kwargs[a.name] if a.name in node.kwargs else a.default_value)
    return args


def _known_module(m: Optional[torch.nn.Module]) -> bool:
    """Whether ``m`` is one of torch's dropout / norm modules running torch's own forward: the mode
    flags of its ops are its ``training`` flag. (A subclass with a forward of its own, and a batch
    norm with ``momentum=None``, whose running average depends on the mode in a way no flag
    shows, are not.)"""
    if not isinstance(m, _KNOWN_READERS) or not type(m).forward.__code__.co_filename.startswith(_TORCH_NN):
        return False
    return not (isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.momentum is None)


def _submodule(model: torch.nn.Module, path: str) -> Optional[torch.nn.Module]:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _mode_nodes(gm: fx.GraphModule, model: torch.nn.Module) -> List[fx.Node]:
    """The nodes of MODE_OPS run by torch's dropout / norm modules whose flag follows the module's
    mode (see MODE_OPS). The same ops called by the model's own code keep their flag unless the
    two captures show it following the mode: ``F.dropout(x, 0.5)`` drops in eval mode too."""
    out = []
    for n in gm.graph.nodes:
        spec = MODE_OPS.get(n.target) if n.op == "call_function" else None
        if spec is None or not _known_module(_submodule(model, _module_path(n))):
            continue
        flag, needs = spec
        args = _full_args(n, max(flag, needs or 0))
        if needs is not None and args[needs] is None:
            continue
        out.append(n)
    return out


def _counter_adds(gm: fx.GraphModule, of: Optional[set] = None) -> List[fx.Node]:
    """Batch norms' ``num_batches_tracked += 1`` in the captured graph, in graph order: on the
    buffer, or on the previous one's result (a batch norm called twice). ``of``: only those of
    these buffers (their targets)."""
    out: List[fx.Node] = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is aten.add_.Tensor and isinstance(n.args[0], fx.Node) and (
                n.args[0] in out or n.args[0].op == "get_attr" and str(n.args[0].target).endswith("num_batches_tracked")
                and (of is None or n.args[0].target in of)):
            out.append(n)
    return out


def _input_checks(gm: fx.GraphModule) -> List[fx.Node]:
    """export's guard call, or fxrec's input checks that replace it."""
    return [n for n in gm.graph.nodes if n.op == "call_module" and n.target in ("_guards_fn", "fxrec_check_inputs")]


def _flag_diffs(a: fx.GraphModule, b: fx.GraphModule, ruled: set) -> Optional[List[Tuple[fx.Node, int, object]]]:
    """Where graphs ``a`` and ``b`` (one model captured in both modes) differ only in boolean
    arguments, or in float ones: the (node of ``a``, argument index, ``b``'s value) of each argument
    that differs; None when they differ otherwise. The flags of the ``ruled`` nodes (bound by rule)
    and batch-norm counters are left out."""
    skip_a, skip_b = set(_counter_adds(a)) | set(_input_checks(a)), set(_counter_adds(b)) | set(_input_checks(b))
    copies_a, copies_b = _row_major_copies(a), _row_major_copies(b, runs=False)
    na = [n for n in a.graph.nodes if n not in skip_a and n not in copies_a]
    nb = [n for n in b.graph.nodes if n not in skip_b and n not in copies_b]
    if len(na) != len(nb):
        return None
    index_a, index_b = _places(a, na, copies_a), _places(b, nb, copies_b)
    diffs = []
    for x, y in zip(na, nb):
        if (x.op, x.target) != (y.op, y.target):
            return None
        if x.op == "call_function" and isinstance(x.target, torch._ops.OpOverload):
            # an argument left at its default in one capture is written out in the other
            upto = max(len(x.args), len(y.args)) - 1
            if x.target in MODE_OPS:
                upto = max(upto, MODE_OPS[x.target][0], MODE_OPS[x.target][1] or 0)
            ax, ay = _full_args(x, upto), _full_args(y, upto)
        else:
            ax, ay = list(x.args), list(y.args)
        if len(ax) != len(ay) or set(x.kwargs) != set(y.kwargs):
            return None
        pairs = list(zip(ax, ay)) + [(x.kwargs[k], y.kwargs[k]) for k in x.kwargs]
        for i, (u, v) in enumerate(pairs):
            eq = _same(u, v, index_a, index_b)
            if eq:
                continue
            if isinstance(u, bool) and isinstance(v, bool) and i < len(ax):
                if not (x in ruled and i == MODE_OPS[x.target][0]):
                    diffs.append((x, i, v))
                continue
            if type(u) is float and type(v) is float and i < len(ax):
                diffs.append((x, i, v))
                continue
            return None
    return diffs


def _row_major_copies(gm: fx.GraphModule, runs: bool = True) -> set:
    """The row-major copies in ``gm``, as capture makes of a tensor laid out otherwise before
    reshaping it (:func:`fxrec.capture_reshapes.reshape_by_copy`; the model's own
    ``clone(memory_format=torch.contiguous_format)`` looks the same), where neither the tensor nor
    the copy is written in place, with their views: there the copy has the tensor's values at every
    read, and a graph with it computes what one without it does. The layout of a tensor (an
    attention kernel's output) differs between the modes, and with it whether capture copies it.
    ``runs=False``: ``gm`` is the other mode's capture, which does not run: a copy there that a
    ``view`` reads is kept (the captured graph runs that view on the tensor itself, which in the
    other mode is laid out so that it cannot be viewed: torch 2.11 records a reshape of a
    tensor contiguous at the example as a view)."""
    from .dataflow import SideEffects

    written = None
    out = set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is aten.clone.default and \
                n.kwargs.get("memory_format") is torch.contiguous_format and isinstance(n.args[0], fx.Node):
            written = SideEffects(list(gm.graph.nodes)).written if written is None else written
            if n not in written and n.args[0] not in written and \
                    (runs or not any(u.target is aten.view.default for u in n.users)):
                out.add(n)
    return out


def _places(gm: fx.GraphModule, kept: List[fx.Node], copies: set) -> Dict[fx.Node, int]:
    """Each of ``kept``'s place; a row-major copy's (``copies``) is its tensor's."""
    places = {n: i for i, n in enumerate(kept)}
    for n in gm.graph.nodes:
        if n in copies and n.args[0] in places:
            places[n] = places[n.args[0]]
    return places


def _same(u, v, index_a, index_b) -> bool:
    if isinstance(u, fx.Node) or isinstance(v, fx.Node):
        return isinstance(u, fx.Node) and isinstance(v, fx.Node) and index_a.get(u) == index_b.get(v)
    if isinstance(u, (list, tuple)) and isinstance(v, (list, tuple)):
        return len(u) == len(v) and all(_same(p, q, index_a, index_b) for p, q in zip(u, v))
    if isinstance(u, dict) and isinstance(v, dict):
        return u.keys() == v.keys() and all(_same(u[k], v[k], index_a, index_b) for k in u)
    if isinstance(u, torch.Tensor) or isinstance(v, torch.Tensor):
        return u is v
    return type(u) is type(v) and u == v


def _deciders(node: fx.Node, readers: List[str]) -> List[str]:
    """The modules whose ``training`` flags may decide an argument of ``node`` that differs by mode,
    among ``readers`` (the modules whose flag the model's code reads), the one it follows first:
    those that run the op (its module stack), innermost first; else the model itself where its own
    code reads its flag (a number or flag a parent chooses and passes down); else every reader.
    Only the two captured combinations of their flags are known (the model's, and each flipped):
    the argument follows the first one's flag, and a call with them in another combination is
    refused (:func:`fxrec.runtime.modes.as_captured_or_flipped`). Empty: none can be told."""
    stack = [str(v[0]) for v in (node.meta.get("nn_module_stack") or {}).values()]
    on_stack = [p for p in reversed(stack) if p in readers]
    if on_stack:
        return on_stack
    if "" in readers:
        return [""]
    return [] if "?" in readers else list(readers)


def bind_modes(gm: fx.GraphModule, model: torch.nn.Module, reads: TrainingReads,
               recapture: Callable[[], fx.GraphModule],
               after_train: Optional[Dict[bool, Dict[str, bool]]] = None) -> ModeInfo:
    """Rewrite ``gm`` (``model`` captured in its current mode) so its mode-dependent nodes read
    their module's ``training`` flag; see the module doc. ``recapture()`` captures the model with
    every module in the other mode than its own (called only when the model's own code reads ``training``)."""
    captured = "training" if model.training else "eval"
    ruled = _mode_nodes(gm, model)
    extra: List[Tuple[fx.Node, int, object]] = []
    owner: Dict[Tuple[fx.Node, int], str] = {}
    readers: List[str] = []
    valid: List[str] = []
    mixed = False
    deciders: Dict[Tuple[fx.Node, int], List[str]] = {}
    why_not = ""
    if reads.unknown:
        todo = f"transform the model in that mode for it (fxrec.transform(model.{'eval' if captured == 'training' else 'train'}(), ...))"
        other: object
        try:
            other = recapture()  # (its reads of training are noted too)
        except Exception as e:  # noqa: BLE001 - the other mode cannot be captured at all (said below)
            other = e
        where = ", ".join(f"'{p}' ({w})" for p, w in sorted(reads.unknown.items()))
        readers = sorted("" if p == "<model>" else p for p in reads.unknown)
        try:
            if isinstance(other, Exception):
                raise other
            diffs = _flag_diffs(gm, other, set(ruled))
            what = "computes something else in the other mode than flags or numbers of its operations"
            deciders = {(n, i): _deciders(n, readers) for n, i, _ in diffs or ()}
            if any(not d for d in deciders.values()):
                diffs, what = None, "reads it in a module outside the model"
            valid = [r for r in readers if r != "?" and _submodule(model, r) is not None]
            mixed = len({model.get_submodule(r).training for r in valid}) > 1
            unused = sorted(set(valid) - set().union(*deciders.values())) if diffs else []
            if diffs and after_train is not None:  # (its train() gives other flags than each flipped)
                diffs, what = None, ("overrides train(), whose flags the other mode's capture (every module "
                                     "flipped) does not have")
            if mixed and unused:  # (train()/eval() of the whole model reach a combination neither capture had)
                diffs, what = None, (f"was captured with the modules whose flag it reads in different modes, and the "
                                     f"flag of {', '.join(repr(u or '<model>') for u in unused)} may decide a value "
                                     "of another module's operation, which train() / eval() of the whole model "
                                     "would not show")
                todo = "transform it with them in one mode for train() / eval() to switch it"
            owner = {k: d[0] for k, d in deciders.items()}
        except Exception as e:  # noqa: BLE001 - the other mode cannot be captured at all
            first = (str(e).strip().splitlines() or [""])[0][:300]
            diffs, what = None, f"cannot be captured in the other mode ({type(e).__name__}: {first})"
        if diffs is None:
            why_not = f"the model's code reads `training` ({where}) and {what}; {todo}"
        else:
            extra = diffs
    flags: Dict[str, int] = {}
    graph = gm.graph
    flag_nodes: Dict[str, fx.Node] = {}
    erased = False
    counted: set = set()  # the num_batches_tracked buffers count_batch now counts

    def flag_node(path: str) -> fx.Node:
        if path not in flag_nodes:
            _ensure_module(gm, model, path)
            first = next(n for n in graph.nodes if n.op != "placeholder")
            with graph.inserting_before(first):
                # (create_node: graph.get_attr warns for attributes that are not tensors or modules)
                flag_nodes[path] = graph.create_node("get_attr", f"{path}.training" if path else "training")
        return flag_nodes[path]

    def flag_of(node: fx.Node, path: Optional[str] = None) -> fx.Node:
        path = _module_path(node) if path is None else path
        flags[path] = flags.get(path, 0) + 1
        return flag_node(path)

    if not why_not:
        for n in ruled:
            flag, needs = MODE_OPS[n.target]
            args = _full_args(n, max(flag, needs or 0))
            args[flag] = flag_of(n)
            n.args, n.kwargs = tuple(args), {k: v for k, v in n.kwargs.items()
                                             if k not in {a.name for a in n.target._schema.arguments[: len(args)]}}
            if n.target is aten.batch_norm.default:
                counted.add(_count_batches(gm, n, args[flag]))
        for n, i, theirs in extra:
            args = _full_args(n, max(i, len(n.args) - 1)) if isinstance(n.target, torch._ops.OpOverload) \
                else list(n.args)
            path = owner[(n, i)]  # (the module whose flag the model's code reads for it)
            module = _submodule(model, path)
            if module is None:  # (a path the reads name always exists; be safe)
                why_not = f"node {n.name} follows the mode of '{path}', which is not the model's"
                break
            flag = flag_of(n, path)
            if type(args[i]) is float:  # (its value in the module's mode, and the other's)
                values = (args[i], theirs) if module.training else (theirs, args[i])
                with graph.inserting_before(n):
                    flag = graph.call_function(by_mode, (flag,) + values)
            elif args[i] != module.training:  # `not self.training`: the argument is the flag's negation
                with graph.inserting_before(n):
                    flag = graph.call_function(evaluating, (flag,))
            args[i] = flag
            n.args = tuple(args)
            if n.target is aten.batch_norm.default and i == MODE_OPS[n.target][0]:
                counted.add(_count_batches(gm, n, flag))
        for add in reversed(_counter_adds(gm, counted)):  # counters replaced above (the last of a chain first)
            if not add.users:
                graph.erase_node(add)
                erased = True
        # (captured with them in one mode: any reader switched alone is a combination neither capture had;
        # in different modes: the flags that may decide each value)
        groups = [] if why_not else [tuple(valid)] if not mixed and len(valid) > 1 else \
            sorted({tuple(sorted(d)) for d in deciders.values() if len(d) > 1})
        for together in groups:  # (only their captured combination and its flip are known: checked at each call)
            modes = [flag_node(p) for p in together]
            with graph.inserting_before(next(n for n in graph.nodes if n.op != "placeholder" and n not in modes)):
                graph.call_function(as_captured_or_flipped, (modes, [model.get_submodule(p).training for p in together],
                                                             ", ".join(repr(p or "<model>") for p in together)))
    # (a submodule switched alone, which train() / eval() of the model cannot refuse; the model's own flag
    # they refuse to change)
    readers_here = [r for r in readers if r not in ("?", "") and _submodule(model, r) is not None]
    if why_not and readers_here:
        modes = [flag_node(p) for p in readers_here]
        with graph.inserting_before(next(n for n in graph.nodes if n.op != "placeholder" and n not in modes)):
            graph.call_function(as_captured, (modes, [model.get_submodule(p).training for p in readers_here],
                                              ", ".join(repr(p or "<model>") for p in readers_here)))
    if flag_nodes or erased:  # the graph changed
        gm.recompile()
    for path in flag_nodes:
        gm.get_submodule(path).training = model.get_submodule(path).training
    gm.training = model.training
    return ModeInfo(captured=captured, switchable=not why_not, why_not=why_not, flags=flags, after_train=after_train)


def _count_batches(gm: fx.GraphModule, bn: fx.Node, flag: fx.Node) -> Optional[str]:
    """Before a batch norm that follows the mode: count the batch in training mode (as the module
    does). Returns the counter's target (None: the batch norm has none)."""
    running_mean = bn.args[3]
    if not (isinstance(running_mean, fx.Node) and running_mean.op == "get_attr"):
        return None
    owner = str(running_mean.target).rpartition(".")[0]
    target = f"{owner}.num_batches_tracked" if owner else "num_batches_tracked"
    try:
        gm.get_buffer(target)
    except AttributeError:
        return None
    graph = gm.graph
    counter = next((n for n in graph.nodes if n.op == "get_attr" and n.target == target), None)
    with graph.inserting_before(bn):
        if counter is None:
            counter = graph.get_attr(target)
        call = graph.call_function(count_batch, (counter, flag))
    call.meta["nn_module_stack"] = bn.meta.get("nn_module_stack", {})
    return target


def _ensure_module(gm: fx.GraphModule, model: torch.nn.Module, path: str) -> None:
    """A module at ``path`` in ``gm`` to hold the flag (an empty one where the capture made none)."""
    if not path:
        return
    try:
        gm.get_submodule(path)
    except AttributeError:
        gm.add_submodule(path, torch.nn.Module())


def check_switch(info: Optional[ModeInfo], mode: bool) -> None:
    """Raise ModeError when ``info`` says the model cannot go to ``mode``."""
    if info is None or info.switchable:
        return
    if mode != (info.captured == "training"):
        raise ModeError(f"fxrec: this model was captured in {info.captured} mode and cannot switch to "
                        f"{'training' if mode else 'eval'} mode: {info.why_not}")
