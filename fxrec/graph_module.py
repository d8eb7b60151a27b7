"""The module ``fxrec.transform`` returns: a ``torch.fx.GraphModule`` that behaves as an ``nn.Module``
in every way a training loop uses one.

torch.export's module (``ExportedProgram.module()``) raises on ``train()`` / ``eval()``, carries
forward hooks made of local lambdas (so ``pickle`` / ``torch.save`` fail), and a fx GraphModule
pickles by re-tracing its generated code (which fails for fxrec's ``forward``, whose list-length
checks cannot be traced symbolically). :class:`TransformedModule`:

* ``train(mode)`` / ``eval()`` are nn.Module's: every submodule's ``training`` flag is set, and the
  graph's dropout / batch-norm nodes read those flags (see :mod:`fxrec.modes`); a model that
  cannot switch raises :class:`fxrec.modes.ModeError`;
* ``pickle`` / ``torch.save`` / ``copy.deepcopy`` keep the class, the graph, the report and the
  fused optimizer states: the graph is pickled node by node (ATen operators by name; node
  metadata that holds fake tensors becomes meta-device tensors of the example sizes);
* ``make_optimizer(...)`` is :func:`fxrec.make_optimizer` on this model;
* ``.to()`` / ``.cuda()`` move the graph's tensor constants and the devices capture wrote into it
  with the parameters (a model transformed on CPU runs on CUDA after ``.cuda()``); tables placed
  in unified memory (``transform(..., device="cuda", hbm_budget=)`` of a model on CPU) go there
  straight from host memory, never through GPU memory (:meth:`EmbeddingGroup.bind_on`), and
  ``to_empty(device="cuda")`` of such a model (on meta, on the CPU or on the GPU already) gives them
  unified memory, not GPU memory (with ``recurse=False`` the tables are left to ``fn`` and bound
  at the first call);
* tables fbgemm caches in GPU memory (``hbm_budget=``, placement ``managed_caching``): their cached
  rows are written back before ``state_dict()``, a copy, a pickle or ``.to()`` reads the
  parameters, and written back and emptied before ``load_state_dict()`` (also one called on a
  module that holds this one) writes them (:func:`sync_caches`).
"""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any, Dict, Optional

import torch
import torch.fx as fx

MODES_KEY = "fxrec_modes"


class TransformedModule(fx.GraphModule):
    """A GraphModule made by :func:`fxrec.transform` (see the module doc)."""

    def train(self, mode: bool = True):
        from .modes import check_switch

        info = self.meta.get(MODES_KEY)
        check_switch(info, bool(mode))
        out = super().train(mode)
        for path, flag in ((getattr(info, "after_train", None) or {}).get(bool(mode)) or {}).items():
            try:  # (the model's own train() override, replayed: a frozen submodule stays in eval mode)
                self.get_submodule(path).training = flag
            except AttributeError:  # (a module the transformed model does not hold)
                pass
        return out

    def recompile(self):
        # A class made around fx's own for this module (torch's composable replicate, which a
        # plan's model is given: DDP for its dense parameters) lacks fx's call chain of its own;
        # fx would build one whose super() call comes back to it forever. Share the inner one.
        cls = type(self)
        if "_wrapped_call" not in vars(cls):
            inner = next((b for b in cls.__mro__[1:] if "_wrapped_call" in vars(b)), None)
            if inner is not None:
                cls._wrapped_call = vars(inner)["_wrapped_call"]
        return super().recompile()

    def make_optimizer(self, dense_optimizer=torch.optim.SGD, **kwargs):
        """:func:`fxrec.make_optimizer` for this model."""
        from .table_optimizers import make_optimizer

        return make_optimizer(self, dense_optimizer, **kwargs)

    def state_dict(self, *args, **kwargs):
        sync_caches(self)
        return super().state_dict(*args, **kwargs)

    def _load_from_state_dict(self, *args, **kwargs):
        # load_state_dict (this module's or a parent's) reaches this module before its children,
        # whose parameters it writes: empty the caches first (their updates written back), so
        # nothing cached is older than what is loaded
        sync_caches(self, drop=True)
        local_metadata = args[2] if len(args) > 2 else kwargs.get("local_metadata", {})
        if local_metadata.get("assign_to_params_buffers") and any(t.is_meta for t in (*self.parameters(), *self.buffers())):
            # (what assign does not reach: the graph's constants and devices, a quantized group's
            # derived buffers, stay on meta; the first call then fails, blaming the inputs)
            raise ValueError("fxrec: load_state_dict(..., assign=True) onto a transformed model on meta is not "
                             "supported: give it memory first with .to_empty(device=...), then load_state_dict(...)")
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, *args, **kwargs):
        sync_caches(self, drop=True)  # .to() / .cuda() / .half() copy the parameters
        before = _tensors_device(self)
        probe = fn(torch.empty(0, device=before)) if before is not None else None
        after = probe.device if isinstance(probe, torch.Tensor) else before
        kept = set()
        recurse = args[0] if args else kwargs.get("recurse", True)
        # (a change of dtype, .half() or .double(): nothing bound first, fn makes new tables anyway)
        same_dtype = isinstance(probe, torch.Tensor) and probe.dtype == torch.get_default_dtype()
        if before is not None and after is not None and after.type == "cuda" and recurse and same_dtype:
            if before.type != "meta":  # tables placed in unified memory: straight there, first (or
                for group, params in groups_with_tables(self):  # there already: kept, not given GPU
                    if params and group.bind_on(params, after):  # memory by to_empty)
                        kept.update(map(id, params))
            else:  # from meta (to_empty)
                kept = _bind_unified_from_meta(self, after)
        if kept:  # (fn would give them GPU memory: to_empty's new tensors)
            fn = _leaving_bound(fn, kept)
        out = super()._apply(fn, *args, **kwargs)
        self._move_constants(fn)
        self._move_device_args(before, after)
        return out

    def _move_device_args(self, before, after) -> None:
        """The devices written into the graph at capture (``device=`` of a factory op: the
        ``arange`` of F.embedding_bag's offsets for 2-D ids, a ``torch.zeros(..., device=x.device)``
        in forward) follow ``.to()`` / ``.cuda()`` from the device the parameters were on
        (``before``) to where they go, as torch.export's ``move_to_device_pass`` moves an exported
        program's: the plain model's tensors made in forward follow its inputs. Devices other
        than ``before`` are left as written. Capture cannot tell ``device=x.device`` from a
        literal ``device="cpu"``: a model that moves something to the capture device itself
        (``.cpu()`` of a model transformed on CPU) moves it to the new device instead; transform
        such a model on the device it runs on."""
        if before is None or after is None or after == before:
            return
        for gm in [m for m in self.modules() if isinstance(m, fx.GraphModule)]:  # (no_grad / autocast blocks: nested)
            changed = False
            for node in gm.graph.nodes:
                dev = node.kwargs.get("device") if node.op == "call_function" else None
                if dev is not None and _same_device(dev, before):
                    node.kwargs = {**node.kwargs, "device": after}
                    changed = True
            if changed:
                gm.recompile()

    def _move_constants(self, fn) -> None:
        """The graph's tensor constants (``lifted_tensor_0``: a ``torch.tensor(..., device=x.device)``
        in forward, made once at capture) follow ``.to()`` / ``.cuda()`` to the parameters' device,
        as the plain model's tensor made in forward follows its inputs; their dtype stays, as that
        tensor's does under ``.half()``. (Not buffers: state_dict() keeps the plain model's keys.)
        They are part of the code, not state: one sent to meta keeps its values on the host
        (``_fxrec_constants_kept``), which a move back (``to_empty``) restores, where a buffer
        would be left uninitialised."""
        kept = self.__dict__.setdefault(_KEPT, {})
        for name, mod, leaf, value in _graph_constants(self):
            moved = fn(value)
            if not isinstance(moved, torch.Tensor) or moved.device == value.device:
                continue
            if moved.is_meta:
                kept[name] = value.detach().cpu()
                setattr(mod, leaf, value.to("meta"))
            elif value.is_meta:
                setattr(mod, leaf, kept.pop(name).to(moved.device) if name in kept else moved)
            else:
                setattr(mod, leaf, value.to(moved.device))

    def __deepcopy__(self, memo):
        sync_caches(self)
        kept = {name for name, _ in self.named_buffers()}
        out = adopt(super().__deepcopy__(memo))
        # fx's copy registers the graph's tensor constants (lifted_tensor_0: a torch.tensor(...) in
        # forward) as buffers, which state_dict() then lists: plain attributes again, as in the original
        for name in [n for n, _ in out.named_buffers() if n not in kept]:
            owner, _, leaf = name.rpartition(".")
            mod = out.get_submodule(owner) if owner else out
            setattr(mod, leaf, mod._buffers.pop(leaf))
        out.__dict__[_KEPT] = copy.deepcopy(self.__dict__.get(_KEPT, {}), memo)  # (fx copies only what the graph reads)
        return out

    def __reduce__(self):
        sync_caches(self)
        state = {k: v for k, v in self.__dict__.items() if k not in _NOT_PICKLED}
        state["meta"] = _picklable_graph_meta(self.meta)
        # the constants' values also as bytes, which torch.load's map_location does not move: a
        # model loaded on meta keeps them for to_empty (see _move_constants)
        kept = self.__dict__.get(_KEPT, {})
        state[_KEPT] = {name: _tensor_bytes(kept.get(name, value)) for name, _, _, value in _graph_constants(self)
                        if not value.is_meta or name in kept}
        pickled_on = _tensors_device(self)
        return (_rebuild, (state, _encode_graph(self.graph), str(pickled_on) if pickled_on is not None else None))

    def __copy__(self):  # a shallow copy would share the graph; make it a deep one
        return copy.deepcopy(self)


def _tensors_device(module: torch.nn.Module):
    """The device of the module's first parameter or buffer (None: it has none)."""
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return None


def _same_device(written, device: torch.device) -> bool:
    """Whether a device argument written in the graph (a torch.device or a string) is ``device``
    (``cuda`` and ``cuda:0`` alike where ``device`` is the current one)."""
    try:
        written = torch.device(written)
    except (TypeError, RuntimeError):
        return False
    if written.type != device.type:
        return False
    if written.index is None or device.index is None:
        current = torch.cuda.current_device() if device.type == "cuda" and torch.cuda.is_available() else 0
        return (written.index if written.index is not None else current) == (
            device.index if device.index is not None else current)
    return written.index == device.index


def sync_caches(module: torch.nn.Module, drop: bool = False) -> None:
    """Write the HBM caches of every group of ``module`` back to its tables' parameters (and,
    with ``drop``, then empty them). Nothing for groups without cached tables. Call it before
    reading a cached table's parameter directly, and with ``drop=True`` before writing one (a
    write back afterwards would put the cached rows over what was written)."""
    for m in module.modules():
        sync = getattr(m, "sync_cache", None)
        if callable(sync) and m is not module:
            sync(drop=drop)


def check_bounds(module: torch.nn.Module) -> None:
    """Wait for the device, then raise the error a call raises (``IndexError`` naming the
    feature, the table and the id; a ``ValueError`` with the count where the inputs the group last
    saw no longer hold them) if any group of ``module`` has met ids or offsets outside its tables
    that no call has reported yet. On CUDA a group checks its ids on the device (fbgemm's bounds
    check: a bad id reads row 0 and is counted) and a call reports what earlier calls counted;
    calls replayed in a CUDA graph report nothing, so call this after replaying (the group's
    inputs are then the graph's own, holding the last replay's values). Nothing to do on CPU,
    where a call reports its own bad ids."""
    from .runtime.checks import InputChecks

    for m in module.modules():
        if isinstance(m, InputChecks):
            m.raise_pending()


def groups_with_tables(module: torch.nn.Module):
    """``(group, its tables' parameters)`` for every group of ``module``'s graphs (nested ones
    too), a sharded model's local lookups' groups included."""
    from .runtime.group import EmbeddingGroup

    for gm in [m for m in module.modules() if isinstance(m, fx.GraphModule)]:
        for n in gm.graph.nodes:
            if n.op != "call_module":
                continue
            mod = gm.get_submodule(n.target)
            if isinstance(mod, EmbeddingGroup) and len(n.args) > 3:
                group, weights = mod, n.args[3]
            elif isinstance(getattr(mod, "group", None), EmbeddingGroup) and len(n.args) > 1:
                group, weights = mod.group, n.args[1]  # a sharded model's local lookups
            else:
                continue
            if not all(isinstance(w, fx.Node) and w.op == "get_attr" for w in weights):
                continue
            try:
                params = [gm.get_parameter(w.target) for w in weights]
            except AttributeError:  # (not parameters: the group's kernels take them as they are)
                continue
            yield group, params


def _leaving_bound(fn, kept: set):
    """``fn`` of ``_apply`` for every tensor but the parameters ``kept`` (ids), tables just bound in
    unified memory on the device ``fn`` moves to: those are left as they are where ``fn`` would
    give them only new memory on that device (``to_empty``'s new tensors: GPU memory; ``.to()``
    returns them as they are), decided on an empty tensor of their kind, never on the table (its
    copy would be the GPU memory avoided). Where ``fn`` also changes their dtype (``.to(device,
    dtype)``), ``fn`` applies, as before."""

    def apply(t):
        if id(t) in kept:
            probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
            if isinstance(probe, torch.Tensor) and probe.dtype == t.dtype and probe.device == t.device:
                return t.detach()
        return fn(t)

    return apply


def _bind_unified_from_meta(module: torch.nn.Module, device: torch.device) -> set:
    """A model on meta given memory on CUDA ``device`` (``to_empty``): the tables of each group
    that keeps tables in unified memory there become new parameters in host memory
    (uninitialised, as to_empty gives; under every name, in place, so the parameters' order
    stays), bound into the group's TBE on ``device`` (``EmbeddingGroup.bind_on``), so their rows
    are in unified memory, never in GPU memory. (A meta parameter cannot take host memory as its
    data: to_empty itself makes new parameters off meta.) The ids of those parameters, which
    ``_apply`` must then leave as they are."""
    kept = set()
    for group, params in groups_with_tables(module):
        if not params or not all(p.is_meta for p in params) or not group.places_unified(device):
            continue
        group._bound = None  # (a TBE kept through a .to("meta"): freed first, not carried)
        new = {id(p): torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
               for p in params}
        owners = [(mod, name, new[id(p)]) for mod in module.modules() for name, p in mod._parameters.items()
                  if p is not None and id(p) in new]
        for mod, name, p in owners:
            mod._parameters[name] = p
        fresh = [new[id(p)] for p in params]
        group.bind_on(fresh, device)
        kept.update(map(id, fresh))
    return kept


def bind_staged(gm: fx.GraphModule) -> None:
    """A sharded rank's pieces that shard_groups held in host memory because they go to unified
    memory (``fxrec.passes.shard_groups.STAGED``): each of their groups bound now on its GPU, the
    rows copied from host memory straight to where they are placed (``EmbeddingGroup.bind_on``)."""
    from .passes.shard_groups import STAGED

    staged = gm.meta.pop(STAGED, None)
    if staged is None:
        return
    device, tables = torch.device(staged[0]), set(staged[1])
    for group, params in groups_with_tables(gm):
        if not params or not tables.intersection(t.name for t in group.tables):
            continue
        if params[0].device == device:
            continue  # (bound already: a group called twice in the graph)
        if not group.bind_on(params, device):
            raise RuntimeError(f"fxrec: tables {[t.name for t in group.tables]} were held in host memory for "
                               f"unified memory on {device}, and their group does not place them there: a bug in fxrec")


def bind_tables(module: torch.nn.Module) -> None:
    """Move the tables of every group of ``module`` that holds them in an fbgemm TBE into it now
    (their parameters become views of its rows), as the group's first call would. Until then, and
    again after ``.to()``, a copy or unpickling, a tensor taken from the model (a ``state_dict()``
    value, ``param.detach()``) is the parameter's storage before the move, which the kernel does not
    read: call this before taking one. (``transform`` does not do it itself: on a GPU the move
    would double the tables' memory while the copy it made of the model is still held.)"""
    from .runtime.kernels import FBGEMM
    from .runtime.kernels.fbgemm_bind import ensure_bound, tbe_optimizer, usable

    for group, params in groups_with_tables(module):
        if not (FBGEMM in (group.kernel_train, group.kernel_eval) or group.weights
                or tbe_optimizer(group) != "none"):
            continue
        if params and params[0].device.type in ("cpu", "cuda") and usable(params, group):
            ensure_bound(group, params)


#: where a TransformedModule on meta keeps its graph constants' values (see _move_constants)
_KEPT = "_fxrec_constants_kept"


def _graph_constants(gm: fx.GraphModule):
    """``(target, owner module, attribute, tensor)`` of each tensor the graph reads by ``get_attr``
    that is neither a parameter nor a buffer: constants capture made (``lifted_tensor_0``)."""
    owned = {id(t) for t in gm.parameters()} | {id(t) for t in gm.buffers()}
    out = []
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        owner, _, leaf = node.target.rpartition(".")
        try:
            mod = gm.get_submodule(owner) if owner else gm
        except AttributeError:
            continue
        value = mod.__dict__.get(leaf)
        if isinstance(value, torch.Tensor) and id(value) not in owned:
            out.append((node.target, mod, leaf, value))
    return out


def _tensor_bytes(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t.detach().cpu().clone(), buf)
    return buf.getvalue()


def _tensor_from_bytes(b: bytes) -> torch.Tensor:
    return torch.load(io.BytesIO(b), map_location="cpu", weights_only=True)


_NOT_PICKLED = {"_graph", "_code", "_lineno_map", "_prologue_start", "shape_env", "range_constraints", "meta"}


def adopt(gm: fx.GraphModule) -> TransformedModule:
    """Make ``gm`` (in place) a :class:`TransformedModule`: its own class (fx gives every
    GraphModule one, for its generated ``forward``), nn.Module's train/eval, no export hooks."""
    gm.__class__ = type("GraphModuleImpl", (TransformedModule,), {})
    for attr in ("train", "eval"):
        gm.__dict__.pop(attr, None)
    for hooks in (gm._forward_pre_hooks, gm._forward_hooks):
        for key, fn in list(hooks.items()):
            if getattr(fn, "__module__", "").startswith("torch.export"):
                del hooks[key]
    gm.recompile()
    return gm


# --------------------------------------------------------------------------- containers
class HeldList(torch.nn.Module):
    """What an ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ParameterList`` of the model becomes in the transformed model:
    the holder of its parameters and buffers, indexed as the model's was (``fast.bags[0].weight``,
    ``fast.top[-1]``, ``len(fast.bags)``, ``for bag in fast.bags``). A member that holds no
    parameter or buffer (an ``nn.ReLU``) is not kept (the graph runs its ops): asking for it is a
    KeyError saying so. (fx makes every such holder a plain ``nn.Module``.)"""

    def _fxrec_key(self, idx) -> str:
        keys = self.__dict__["_fxrec_keys"]
        if isinstance(idx, str) and idx in keys:
            return idx
        if isinstance(idx, bool) or not isinstance(idx, int):
            raise TypeError(f"fxrec: {type(self).__name__} takes an int index, got {type(idx).__name__}")
        if not -len(keys) <= idx < len(keys):
            raise IndexError(f"fxrec: index {idx} is out of range for a {len(keys)}-member {self._fxrec_kind}")
        return keys[idx]

    @property
    def _fxrec_kind(self) -> str:
        return self.__dict__.get("_fxrec_container", "container")

    def __getitem__(self, idx):
        key = self._fxrec_key(idx)
        if key in self._parameters:  # (an nn.ParameterList / ParameterDict member)
            return self._parameters[key]
        if key not in self._modules:
            raise KeyError(f"fxrec: member {key!r} of this {self._fxrec_kind} holds no parameters or buffers, so the "
                           "transformed model does not keep it (its graph runs that module's ops)")
        return self._modules[key]

    def __len__(self) -> int:
        return len(self.__dict__["_fxrec_keys"])

    def __iter__(self):
        return (self[k] for k in self.__dict__["_fxrec_keys"])


class HeldDict(HeldList):
    """An ``nn.ModuleDict`` of the model in the transformed model (see :class:`HeldList`): indexed
    by key, iterated over its keys, with ``keys()`` / ``values()`` / ``items()``."""

    def _fxrec_key(self, idx) -> str:
        if idx not in self.__dict__["_fxrec_keys"]:
            raise KeyError(f"fxrec: {idx!r} is not a key of this ModuleDict; its keys are {self.__dict__['_fxrec_keys']}")
        return idx

    def __iter__(self):
        return iter(self.__dict__["_fxrec_keys"])

    def __contains__(self, key) -> bool:
        return key in self.__dict__["_fxrec_keys"]

    def keys(self):
        return list(self.__dict__["_fxrec_keys"])

    def values(self):
        return [self[k] for k in self.keys()]

    def items(self):
        return [(k, self[k]) for k in self.keys()]


def hold_containers_like(gm: torch.nn.Module, model: torch.nn.Module) -> None:
    """The holders in ``gm`` of the model's ModuleLists, Sequentials and ModuleDicts become
    :class:`HeldList` / :class:`HeldDict`, indexed as the model's are."""
    for name, mod in model.named_modules():
        lists = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ParameterList)
        dicts = (torch.nn.ModuleDict, torch.nn.ParameterDict)
        if not name or not isinstance(mod, lists + dicts):
            continue
        try:
            holder = gm.get_submodule(name)
        except AttributeError:
            continue  # (holds nothing the graph reads)
        if type(holder) is not torch.nn.Module:
            continue
        holder.__class__ = HeldDict if isinstance(mod, dicts) else HeldList
        holder.__dict__["_fxrec_keys"] = list(mod._parameters if isinstance(mod, (torch.nn.ParameterList, torch.nn.ParameterDict))
                                              else mod._modules)
        holder.__dict__["_fxrec_container"] = type(mod).__name__


# --------------------------------------------------------------------------- pickling
class _Ref:
    """A reference to another node (by name) in an encoded graph."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __reduce__(self):
        return (_Ref, (self.name,))


class _Format:
    """A ``torch.memory_format`` argument in an encoded graph (``clone(memory_format=...)`` of a
    non-contiguous input): by name, since ``torch.save``'s pickler cannot take the object itself
    (``pickle`` can)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __reduce__(self):
        return (_Format, (self.name,))


def _encode_arg(a):
    if isinstance(a, fx.Node):
        return _Ref(a.name)
    if isinstance(a, torch.memory_format):
        return _Format(str(a).rpartition(".")[2])
    return a


def _encode_target(t) -> Any:
    if isinstance(t, torch._ops.OpOverload):
        ns, name = t._schema.name.split("::")
        return ("__op__", ns, name, t._overloadname)
    if isinstance(t, torch._ops.OpOverloadPacket):
        ns, name = t._qualified_op_name.split("::")
        return ("__packet__", ns, name)
    if isinstance(t, torch._ops.HigherOrderOperator):
        return ("__hop__", t.name())
    return t


def _decode_target(t) -> Any:
    if isinstance(t, tuple) and t and t[0] == "__op__":
        return getattr(getattr(getattr(torch.ops, t[1]), t[2]), t[3])
    if isinstance(t, tuple) and t and t[0] == "__packet__":
        return getattr(getattr(torch.ops, t[1]), t[2])
    if isinstance(t, tuple) and t and t[0] == "__hop__":
        return getattr(torch.ops.higher_order, t[1])
    return t


def _hint(s) -> int:
    if isinstance(s, torch.SymInt):
        h = getattr(s.node, "hint", None)
        return int(h) if h is not None else 2
    return int(s)


def _plain_val(v):
    """A fake tensor as a meta-device tensor of its example sizes; SymInts as their example value."""
    if isinstance(v, torch.Tensor):
        return torch.empty([_hint(s) for s in v.shape], dtype=v.dtype, device="meta")
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return None
    if isinstance(v, (list, tuple)):
        return type(v)(_plain_val(x) for x in v)
    if v is None or isinstance(v, (int, float, bool, str)):
        return v
    return None


def _node_meta(meta: dict) -> dict:
    out = {}
    if "val" in meta:
        out["val"] = _plain_val(meta["val"])
    for key in ("stack_trace", "fxrec_origin", "fxrec_decision", "fxrec_quant"):  # plain, frozen records
        if key in meta:
            out[key] = meta[key]
    if "fxrec_lookup" in meta:  # a lookup left as written: what the report says of it (no graph nodes)
        from .report import LookupEntry

        out["fxrec_lookup"] = LookupEntry.of(meta["fxrec_lookup"], None)
    if "nn_module_stack" in meta:
        out["nn_module_stack"] = {k: (p, t if isinstance(t, str) else f"{t.__module__}.{t.__qualname__}")
                                  for k, (p, t) in meta["nn_module_stack"].items()}
    return out


def _encode_graph(graph: fx.Graph) -> Dict[str, Any]:
    nodes = []
    for n in graph.nodes:
        args = fx.node.map_aggregate(n.args, _encode_arg)
        kwargs = fx.node.map_aggregate(n.kwargs, _encode_arg)
        nodes.append((n.op, n.name, _encode_target(n.target), args, kwargs, _node_meta(n.meta)))
    return {"nodes": nodes, "codegen": graph._codegen}


def _decode_graph(data: Dict[str, Any]) -> fx.Graph:
    graph = fx.Graph()
    graph._codegen = data["codegen"]
    made: Dict[str, fx.Node] = {}

    def resolve(a):
        if isinstance(a, _Ref):
            return made[a.name]
        if isinstance(a, _Format):
            return getattr(torch, a.name)
        if isinstance(a, (list, tuple)):
            return type(a)(resolve(x) for x in a)
        if isinstance(a, dict):
            return {k: resolve(v) for k, v in a.items()}
        return a

    for op, name, target, args, kwargs, meta in data["nodes"]:
        node = graph.create_node(op, _decode_target(target), resolve(args), resolve(kwargs), name=name)
        node.meta.update(meta)
        made[name] = node
    return graph


def _picklable_graph_meta(meta: dict) -> dict:
    """fxrec's records and the preserved attributes (the report); what does not pickle is left out."""
    out: Dict[str, Any] = {}
    for key, value in meta.items():
        if key == "_user_preserved_attributes":
            value = {k: v for k, v in value.items() if _pickles(v)}
        elif not (key.startswith("fxrec") and _pickles(value)):
            continue
        out[key] = value
    return out


def _pickles(v) -> bool:
    try:
        pickle.dumps(v)
        return True
    except Exception:  # noqa: BLE001 - whatever cannot be pickled is left out
        return False


def _rebuild(state: Dict[str, Any], graph_data: Dict[str, Any], pickled_on: Optional[str] = None) -> TransformedModule:
    gm = TransformedModule.__new__(TransformedModule)
    gm.__dict__.update(state)
    gm.meta = state.get("meta", {})
    for k, v in gm.meta.get("_user_preserved_attributes", {}).items():
        setattr(gm, k, v)
    gm.graph = _decode_graph(graph_data)  # the setter recompiles
    saved = state.get(_KEPT, {})
    gm.__dict__[_KEPT] = {name: _tensor_from_bytes(saved[name]) for name, _, _, value in _graph_constants(gm)
                          if value.is_meta and isinstance(saved.get(name), bytes)}
    if pickled_on is not None:  # loaded elsewhere (torch.load's map_location): the graph's devices follow, as .to()'s
        gm._move_device_args(torch.device(pickled_on), _tensors_device(gm))
    return gm
