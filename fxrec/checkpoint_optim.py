"""The optimizer that ``opt.step()`` runs, in :mod:`fxrec.checkpoint` (``optimizer=``).

What is saved, keyed by parameter name (never by torch.optim's index, which depends on which
parameters a rank holds and how the optimizer grouped them; a table fused on one side and
stepped by torch.optim on the other carries a state both keep, :data:`CONVERTED`):

* Each per-element state of a parameter (a tensor of the parameter's shape: Adam's ``exp_avg``
  and ``exp_avg_sq``, Adagrad's ``sum``, SGD's ``momentum_buffer``) is the DCP entry
  ``<param fqn>.fxrec_optim.<state>``, a global tensor like its parameter: cut like the table by
  the shard layout (the same pieces and planner as the table), written once for a parameter
  whole on every rank. A per-row state (``[rows]`` of a ``[rows, dim]`` parameter, e.g.
  :class:`fxrec.optim.RowWiseAdagradTorch`'s ``sum``) is a ``[rows, 1]`` column cut by the
  table's rows, as a fused row-wise Adagrad state is.
* Any other tensor state (Adam's ``step``) is the same kind of entry, written whole, once: for a
  sharded table every rank that holds part of it must hold the same value (checked when saving).
* ``fxrec_optimizer.json`` in the checkpoint directory (plain JSON, covered by the checksums):
  for each parameter the hyperparameters of its param group (every entry but ``params`` and
  ``param_names``; numbers, strings, booleans, None, tensors and tuples/lists/dicts of them, a
  group stored once and referred to by number), the kind of each tensor state (``param``,
  ``rows``, ``tensor``), its non-tensor states (e.g. SparseAdam's integer ``step``), and for tables
  whose optimizer is fused (their state travels as ``<table>.fxrec_fused.<state>``) just the fused
  group's ``lr``. Nothing in it is code: the loader builds numbers, strings, lists and tensors.

Loading builds, for every torch optimizer inside the given one (``fast.make_optimizer``'s dense
and fallback optimizers, or the optimizer itself), a state dict in torch.optim's format with the
saved states of the parameters it holds now and its own groups with the saved hyperparameters
put over theirs, and hands it to its ``load_state_dict`` (which casts to the parameters' dtype and
device, as ever). The fused groups of a ``CombinedOptimizer`` get their saved ``lr``. A
parameter group's hyperparameters come from its parameters' records, which must agree (they
came from one group when saved, unless the optimizer groups its parameters otherwise now).
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .checkpoint import (FUSED_TAG, OPTIM_TAG, CheckpointError, _fmt, _is_dtensor, _pieces_of, _read_metadata,
                         _state_cut)
from .runtime.optimizer import UNIT_KEYS, CombinedOptimizer, fused_hyperparameters

INFO_FILE = "fxrec_optimizer.json"
FORMAT = "fxrec-optimizer/1"
KINDS = ("param", "rows", "tensor")


# --------------------------------------------------------------------------- plain values
def _encode(value):
    """``value`` as JSON: numbers, strings, booleans and None as they are, a list as a list, a
    tuple as ``{"tuple": [...]}``, a dict with string keys as ``{"dict": {...}}``, a tensor as
    ``{"tensor": [...], "dtype": "float32"}``. Raises TypeError for anything else."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, tuple):
        return {"tuple": [_encode(v) for v in value]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: _encode(v) for k, v in value.items()}}
    if isinstance(value, torch.Tensor) and not value.is_sparse:
        return {"tensor": value.detach().cpu().tolist(), "dtype": str(value.dtype).replace("torch.", "")}
    raise TypeError(type(value).__name__)


def _decode(value):
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"tuple"} and isinstance(value["tuple"], list):
            return tuple(_decode(v) for v in value["tuple"])
        if set(value) == {"dict"} and isinstance(value["dict"], dict):
            return {k: _decode(v) for k, v in value["dict"].items()}
        if set(value) == {"tensor", "dtype"}:
            dtype = getattr(torch, str(value["dtype"]), None)
            if isinstance(dtype, torch.dtype):
                return torch.tensor(value["tensor"], dtype=dtype)
        raise ValueError(f"{value!r} is not a value fxrec.checkpoint writes")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"{value!r} is not a value fxrec.checkpoint writes")


# --------------------------------------------------------------------------- the optimizer's parts
def _parts(optimizer) -> Tuple[List[torch.optim.Optimizer], List[dict]]:
    """(the torch optimizers ``optimizer.step()`` runs, the fused groups of a CombinedOptimizer)."""
    if isinstance(optimizer, CombinedOptimizer):
        subs = ([optimizer.dense] if optimizer.dense is not None else []) + list(optimizer.fallbacks)
        return subs, list(optimizer.fused_groups)
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer], []
    raise TypeError("fxrec.checkpoint: optimizer= takes a torch.optim.Optimizer (e.g. fast.make_optimizer(...)), "
                    f"got {type(optimizer).__name__}")


def _names(module: torch.nn.Module) -> Dict[int, str]:
    return {id(p): n for n, p in module.named_parameters()}


def _fqn(names: Dict[int, str], p: torch.Tensor) -> str:
    fqn = names.get(id(p))
    if fqn is None:
        raise CheckpointError(f"fxrec.checkpoint: the optimizer holds a parameter of shape {_fmt(p.shape)} that is not "
                              "one of the model's parameters (build the optimizer for this model)")
    return fqn


def _kind(state: torch.Tensor, p: torch.Tensor) -> str:
    if state.shape == p.shape:
        return "param"
    if p.dim() == 2 and state.dim() == 1 and state.shape[0] == p.shape[0]:
        return "rows"
    return "tensor"


def _hyperparameters(group: dict, fqn: str) -> dict:
    out = {}
    for k, v in group.items():
        if k in UNIT_KEYS or k == "param_names":  # (fxrec's own keys of a group are not hyperparameters)
            continue
        try:
            out[k] = _encode(v)
        except TypeError as e:
            warnings.warn(f"fxrec.checkpoint: hyperparameter '{k}' of the param group of '{fqn}' is a {e}, which a "
                          "checkpoint does not hold (numbers, strings, booleans, None, tensors and lists, tuples and "
                          "dicts of them): not saved, a load keeps the optimizer's own", stacklevel=4)
    return out


# --------------------------------------------------------------------------- saving
@dataclass
class Saved:
    """One rank's part of a checkpoint's optimizer state."""

    records: Dict[str, dict] = field(default_factory=dict)  # param fqn -> {"group", "states", "values"[, "fused"]}
    whole: Dict[str, torch.Tensor] = field(default_factory=dict)  # entry -> tensor written whole
    cut: Dict[str, tuple] = field(default_factory=dict)  # entry -> its layout (cut like its table)
    cut_tensors: Dict[str, torch.Tensor] = field(default_factory=dict)  # entry -> this rank's 2-D tensor
    agreed: Dict[str, torch.Tensor] = field(default_factory=dict)  # entry -> value the ranks must agree on

    def pieces(self, module: torch.nn.Module):
        return _pieces_of(module, self.cut, self.cut_tensors)

    def write(self, directory: str) -> None:
        """``fxrec_optimizer.json`` into ``directory``: each distinct group once, referred to by number."""
        groups: List[dict] = []
        params = {}
        for fqn, rec in sorted(self.records.items()):
            if rec["group"] not in groups:
                groups.append(rec["group"])
            params[fqn] = {**rec, "group": groups.index(rec["group"])}
        with open(os.path.join(directory, INFO_FILE), "w") as f:
            json.dump({"format": FORMAT, "groups": groups, "params": params}, f, indent=1, sort_keys=True)


def _steppers(optimizer) -> Dict[str, str]:
    """What steps each fused table of a CombinedOptimizer (by fqn): ``"fused <kind>"``."""
    if not isinstance(optimizer, CombinedOptimizer):
        return {}
    return {f: f"fused {mod.fused.kind}" for _, mod, _, fqns in optimizer.fused for f in fqns}


def _fused_specs(optimizer) -> Dict[str, object]:
    """The FusedSpec of each fused table of a CombinedOptimizer (by fqn)."""
    if not isinstance(optimizer, CombinedOptimizer):
        return {}
    return {f: mod.fused for _, mod, _, fqns in optimizer.fused for f in fqns}


def _collect_local(module: torch.nn.Module, optimizer, layout: dict) -> Saved:
    names = _names(module)
    subs, fused = _parts(optimizer)
    steppers = _steppers(optimizer)
    specs = _fused_specs(optimizer)
    out = Saved()
    for o in subs:
        sd = o.state_dict()  # torch's format: states by index, in the order of the groups' params
        flat = [p for g in o.param_groups for p in g["params"]]
        for key in sd["state"]:
            if not isinstance(key, int) or not 0 <= key < len(flat):
                raise CheckpointError(f"fxrec.checkpoint: {type(o).__name__} keeps state under {key!r}, not under a "
                                      "parameter: a checkpoint does not hold it")
        for group in sd["param_groups"]:
            for i in group["params"]:
                p = flat[i]
                fqn = _fqn(names, p)
                rec = {"group": _hyperparameters(group, fqn), "states": {}, "values": {}, "optimizer": type(o).__name__}
                for name, v in sd["state"].get(i, {}).items():
                    if not isinstance(name, str) or OPTIM_TAG in name:
                        raise CheckpointError(f"fxrec.checkpoint: {type(o).__name__}'s state {name!r} of parameter "
                                              f"'{fqn}' is not named by a string a checkpoint can hold")
                    if not isinstance(v, torch.Tensor):
                        try:
                            rec["values"][name] = _encode(v)
                        except TypeError as e:
                            raise CheckpointError(f"fxrec.checkpoint: optimizer state '{name}' of parameter '{fqn}' is "
                                                  f"a {e}, which a checkpoint does not hold") from e
                        continue
                    entry = f"{fqn}{OPTIM_TAG}{name}"
                    kind = rec["states"][name] = _kind(v, p)
                    if v.is_sparse:  # (torch.optim.SGD's momentum of a sparse gradient): saved dense, loaded sparse
                        rec.setdefault("sparse", {})[name] = v.sparse_dim()
                        v = v.to_dense()
                    t = v.detach().unsqueeze(1) if kind == "rows" else v.detach()
                    if fqn in layout and kind != "tensor":
                        out.cut[entry] = _state_cut(fqn, layout, per_row=kind == "rows")
                        out.cut_tensors[entry] = t
                    else:
                        out.whole[entry] = t
                        if fqn in layout:  # kept once for a table the ranks hold parts of
                            out.agreed[entry] = t
                out.records[fqn] = rec
    # A table optimizer whose fallback steps some tables on this rank shares the fallback's param
    # group, with the torch form's fixed settings (eps, weight_decay, ...); a rank whose tables are
    # all fused has no fallback and none of them: a fused table's record keeps only what its fused
    # group has on every rank (lr, and what a scheduler adds), so that the ranks' records agree.
    fixed = {id(o.param_groups[0]): set(o.defaults) - {"lr"}
             for o in getattr(optimizer, "fallbacks", []) if o.param_groups}
    for group in fused:  # their states (and a fused Adam's step count) are the tables' fxrec_fused entries
        drop = fixed.get(id(group), set())
        hps = _hyperparameters({k: v for k, v in fused_hyperparameters(group).items() if k not in drop},
                               group["tables"][0] if group["tables"] else "")
        for fqn in group["tables"]:
            out.records[fqn] = {"group": hps, "states": {}, "values": {}, "fused": True, "optimizer": steppers[fqn],
                                "settings": fused_settings(specs[fqn])}
    return out


def collect(module: torch.nn.Module, optimizer, layout: dict, *, distributed: bool, process_group=None) -> Saved:
    """What :func:`fxrec.checkpoint.save` writes for ``optimizer``. ``distributed``: collective;
    every rank's records are gathered and merged (the same on every rank, written by rank 0),
    and every rank raises when one failed or when two disagree on a record or a kept-once value."""
    if not distributed:
        return _collect_local(module, optimizer, layout)
    mine, error = None, None
    try:
        mine = _collect_local(module, optimizer, layout)
    except Exception as e:  # noqa: BLE001 - the other ranks must not wait in the gather for this one
        error = e
    world = dist.get_world_size(process_group)
    gathered: List[Optional[tuple]] = [None] * world
    dist.all_gather_object(gathered, (f"{type(error).__name__}: {error}" if error else None,
                                      mine.records if mine else None,
                                      {k: v.cpu() for k, v in mine.agreed.items()} if mine else None),
                           group=process_group)
    if error is not None:
        raise error
    failed = [(r, msg) for r, (msg, _, _) in enumerate(gathered) if msg]
    if failed:
        raise CheckpointError(f"fxrec.checkpoint.save: rank {failed[0][0]} could not collect the optimizer state "
                              f"({failed[0][1]}); nothing was written")
    records, agreed = {}, {}
    for r, (_, recs, values) in enumerate(gathered):
        for fqn, rec in recs.items():
            if fqn in records and records[fqn][1] != rec:
                raise CheckpointError(
                    f"fxrec.checkpoint.save: ranks {records[fqn][0]} and {r} hold different optimizer records for "
                    f"'{fqn}' ({records[fqn][1]} and {rec}): its optimizer, hyperparameters and state names must be "
                    "the same on every rank that holds part of it; nothing was written")
            records.setdefault(fqn, (r, rec))
        for entry, t in values.items():
            if entry in agreed and not (agreed[entry][1].shape == t.shape and torch.equal(agreed[entry][1], t)):
                fqn, name = entry.split(OPTIM_TAG, 1)
                raise CheckpointError(
                    f"fxrec.checkpoint.save: optimizer state '{name}' of '{fqn}' is kept once for the whole table, but "
                    f"ranks {agreed[entry][0]} and {r} hold different values ({agreed[entry][1].tolist()} and "
                    f"{t.tolist()}); nothing was written")
            agreed.setdefault(entry, (r, t))
    mine.records = {fqn: rec for fqn, (_, rec) in records.items()}
    return mine


# --------------------------------------------------------------------------- loading
def read_records(path: str) -> Optional[Dict[str, dict]]:
    """The checkpoint's optimizer records by parameter fqn (groups inlined), or None when it
    holds no optimizer state. Raises CheckpointError naming the file when it is not fxrec's."""
    file = os.path.join(path, INFO_FILE)
    if not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            data = json.load(f)
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, not {FORMAT!r}")
        groups = data["groups"]  # as written (compared as such), decoded when used
        for g in groups:
            for v in g.values():
                _decode(v)
        out = {}
        for fqn, rec in data["params"].items():
            states, values = dict(rec["states"]), {k: _decode(v) for k, v in rec["values"].items()}
            if any(k not in KINDS for k in states.values()) or not all(isinstance(k, str) for k in states):
                raise ValueError(f"the states of '{fqn}' are {states!r}")
            # states saved dense, loaded sparse with that many sparse dims
            sparse = {str(k): int(d) for k, d in rec.get("sparse", {}).items() if k in states}
            stepper = rec.get("optimizer")  # (None in checkpoints written before it was recorded)
            if stepper is not None and not isinstance(stepper, str):
                raise ValueError(f"the optimizer of '{fqn}' is {stepper!r}")
            settings = rec.get("settings")  # (a fused table's: None in checkpoints written before they were kept)
            if settings is not None and not (isinstance(settings, dict) and all(
                    isinstance(v, (int, float, str)) and not isinstance(v, bool) for v in settings.values())):
                raise ValueError(f"the fused settings of '{fqn}' are {settings!r}")
            out[str(fqn)] = {"group": groups[int(rec["group"])], "states": states, "values": values,
                             "fused": rec.get("fused") is True, "sparse": sparse, "optimizer": stepper,
                             "settings": settings}
    except Exception as e:  # noqa: BLE001 - damaged, or not written by fxrec
        raise CheckpointError(f"fxrec.checkpoint: {file} cannot be read as a checkpoint's optimizer state: "
                              f"{type(e).__name__}: {e}") from e
    return out


@dataclass
class _Target:
    """One torch optimizer's load: per parameter (in its groups' order) the states to give it
    (name -> ("piece", tensor, kind, sparse dims, param) | ("whole", entry, kind, sparse dims, param) | ("value", value);
    sparse dims 0: loaded dense) or None (kept),
    and per group the hyperparameters to put over its own (or None)."""

    optimizer: torch.optim.Optimizer
    states: List[Optional[dict]]
    groups: List[Optional[dict]]


@dataclass
class Load:
    """A planned load of an optimizer's state: what to read, then :meth:`apply`."""

    optimizer: object
    whole: Dict[str, torch.Tensor] = field(default_factory=dict)  # entry -> tensor of its shape to read into
    cut: Dict[str, tuple] = field(default_factory=dict)
    cut_tensors: Dict[str, torch.Tensor] = field(default_factory=dict)
    targets: List[_Target] = field(default_factory=list)
    fused_lr: List[Tuple[dict, dict]] = field(default_factory=list)  # (fused group, its saved hyperparameters)
    # a fused state entry -> the torch optimizer's entry to read it from (CONVERTED)
    fused_from: Dict[str, str] = field(default_factory=dict)

    def pieces(self, module: torch.nn.Module):
        return _pieces_of(module, self.cut, self.cut_tensors)

    def apply(self, staged: Dict[str, object]) -> None:
        """Into the optimizer: each torch optimizer's ``load_state_dict`` with the read states."""
        def value(spec):
            if spec[0] == "value":
                return spec[1]
            t = spec[1] if spec[0] == "piece" else staged[spec[1]]
            if _is_dtensor(spec[4]) and spec[2] != "tensor" and not _is_dtensor(t):
                t = _sharded_like(spec[4], t, spec[2])  # the state of a parameter FSDP shards: a DTensor like it
            t = t.squeeze(1) if spec[2] == "rows" else t
            return t.to_sparse(spec[3]) if spec[3] else t

        for target in self.targets:
            o, state, groups, i = target.optimizer, {}, [], 0
            for g, hps in zip(o.param_groups, target.groups):
                ids = []
                for p in g["params"]:
                    got = target.states[i]
                    if got:
                        state[i] = {name: value(spec) for name, spec in got.items()}
                    elif got is None and p in o.state:  # not in the checkpoint (strict=False): kept as it is
                        state[i] = o.state[p]
                    ids.append(i)
                    i += 1
                groups.append({**{k: v for k, v in g.items() if k != "params"}, **(hps or {}), "params": ids})
            o.load_state_dict({"state": state, "param_groups": groups})
        if isinstance(self.optimizer, CombinedOptimizer):
            self.optimizer._collect_groups()  # load_state_dict replaced the sub-optimizers' group dicts
            current = {u.name: u.group for u in self.optimizer.units}  # (a fused group's may be one of those)
            for group, hps in self.fused_lr:
                current.get(group.get("fxrec_fused"), group).update(hps)
            self.optimizer._sync_fused_lr()


def _sharded_like(p: torch.Tensor, local: torch.Tensor, kind: str) -> torch.Tensor:
    """``local`` (this rank's rows of a state of the DTensor parameter ``p``: FSDP's dim-0 chunk; a
    per-row state as a ``[rows, 1]`` column) as a DTensor sharded as ``p`` is."""
    from torch.distributed.tensor import DTensor

    shape = (p.shape[0], 1) if kind == "rows" else tuple(p.shape)
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


#: steppers with no state, the same update fused or stepped by torch.optim (a table may move between
#: the two with the plan: data-parallel tables are stepped by torch.optim), where torch.optim's SGD
#: has no momentum, weight decay, nesterov or maximize (fbgemm's exact SGD has none of them)
_STATELESS = {"SGD", "fused sgd"}


def _plain_sgd(hps: dict) -> bool:
    return not any(hps.get(k) for k in ("momentum", "weight_decay", "nesterov", "maximize"))


#: A fused optimizer and the torch optimizer that steps the same tables where nothing fuses it (a
#: data-parallel table under a plan; fxrec.optim's ``torch_optimizer``), which keep one state of one
#: meaning: (the torch optimizer, the state's name, its kind: Adagrad's ``sum`` per element, ``[rows,
#: dim]``; row-wise Adagrad's per row, a ``[rows, 1]`` column in the checkpoint either way). A table
#: that moves between the two (data-parallel under one plan, fused under another or in one process)
#: carries it over, read from the other's entry, where the two do the same update.
CONVERTED = {"fused adagrad": ("Adagrad", "sum", "param"), "fused rowwise_adagrad": ("RowWiseAdagradTorch", "sum", "rows")}


def fused_settings(spec) -> dict:
    """What a fused optimizer's update reads besides its lr (a FusedSpec's), as its records keep it."""
    return {"eps": spec.eps, "weight_decay": spec.weight_decay, "weight_decay_mode": spec.weight_decay_mode,
            "max_norm": spec.max_norm}


def _differences(torch_kind: str, torch_group: dict, fused: Optional[dict]) -> List[str]:
    """Where the torch form (its param group) does another update than the fused one (``fused``:
    its :func:`fused_settings`; None in a checkpoint written before they were kept: the torch
    form's own settings that no fused form has are still checked)."""
    if torch_kind == "Adagrad":  # the fused one is torch.optim.Adagrad's arithmetic, eps alone
        want = {"lr_decay": 0.0, "weight_decay": 0.0, "initial_accumulator_value": 0.0, "maximize": False}
        if fused is not None:
            want["eps"] = fused["eps"]
    else:
        want = {} if fused is None else {"eps": fused["eps"], "weight_decay": fused["weight_decay"],
                                         "max_norm": fused["max_norm"]}
        if fused is not None and fused["weight_decay"]:
            want["weight_decay_mode"] = fused["weight_decay_mode"]
    return [f"{k} {torch_group[k]!r} against {v!r}" for k, v in want.items()
            if k in torch_group and torch_group[k] != v]


def _converted(rec: dict, fqn: str, fused_here: bool, stepper: str, torch_group: dict,
               fused_spec=None, fused_group: Optional[dict] = None) -> Tuple[Optional[dict], str]:
    """``rec`` (saved fused where the table is stepped by torch.optim here, or the other way round)
    as a record this side reads, where the two keep the same state (CONVERTED) and do the same
    update; else (None, why not, or "" where they keep no state in common). ``torch_group``: the
    torch form's param group (saved, or here); ``fused_spec``: the fused one here (FusedSpec);
    ``fused_group``: its param group. A torch.optim Adagrad here starts its ``step`` at 0 (the fused
    one counts none; only lr_decay, which the fused one has not, reads it)."""
    fused_kind, torch_kind = (stepper, rec["optimizer"]) if fused_here else (rec["optimizer"], stepper)
    same = CONVERTED.get(fused_kind)
    if same is None or same[0] != torch_kind:
        return None, ""
    fused = fused_settings(fused_spec) if fused_here else rec.get("settings")
    differ = _differences(torch_kind, torch_group, fused)
    if differ:
        return None, f"the two do other updates ({', '.join(differ)})"
    name, kind = same[1], same[2]
    if fused_here:  # the fused state read from the torch optimizer's entry; the group's lr and what it shares
        group = {k: v for k, v in rec["group"].items() if fused_group is None or k in fused_group}
        read = (f"{fqn}{FUSED_TAG}{name}", f"{fqn}{OPTIM_TAG}{name}") if name in rec["states"] else None
        return {**rec, "group": group, "from": read}, ""
    values = {"step": torch.tensor(0.0)} if torch_kind == "Adagrad" else {}
    return {**rec, "states": {name: kind}, "values": values, "sparse": {},
            "entries": {name: f"{fqn}{FUSED_TAG}{name}"}}, ""


def plan_load(module: torch.nn.Module, optimizer, path: str, layout: dict, strict: bool,
              problems: List[str]) -> Optional[Load]:
    """What :func:`fxrec.checkpoint.load` reads for ``optimizer`` on this rank (``layout``: its
    shard layout, {} in one process), or None (nothing to load). Every way the checkpoint does not
    fit the optimizer goes to ``problems``; reads only the checkpoint's metadata and JSON."""
    records = read_records(path)
    if records is None:
        if strict:
            problems.append("the checkpoint holds no optimizer state (it was saved without optimizer=; strict=False "
                            "loads the model and leaves the optimizer as it is)")
        return None
    md = _read_metadata(path).state_dict_metadata
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    names = _names(module)
    subs, fused = _parts(optimizer)
    tables = getattr(module, "meta", {}).get("fxrec_table_optimizers", {})  # fqn -> (optimizer, sparse)
    out = Load(optimizer)
    missing: List[str] = []

    steppers = _steppers(optimizer)
    specs = _fused_specs(optimizer)
    # A table frozen here (requires_grad=False) is stepped by nothing, fused or not: a state that
    # does not fit (another optimizer, fused against torch.optim) or none is no error (it moves
    # between fused and data-parallel groups), and one that fits is loaded (read once it trains again)
    frozen = {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}

    def usable(fqn: str, fused_here: bool, stepper: str, group_here: Optional[dict] = None) -> Optional[dict]:
        """The checkpoint's record for ``fqn`` as this side reads it, or None (nothing loaded)."""
        rec = records.get(fqn)
        if rec is None:
            if fqn not in frozen:
                missing.append(fqn)
        elif (rec["fused"] != fused_here or rec["optimizer"] not in (None, stepper)) and fqn in frozen:
            return None
        elif rec["fused"] != fused_here:
            torch_side = group_here if rec["fused"] else {k: _decode(v) for k, v in rec["group"].items()}
            if not rec["states"] and {rec["optimizer"], stepper} <= _STATELESS and _plain_sgd(torch_side or {}):
                return rec  # plain SGD, fused or not, keeps no state: its learning rate is all there is
            converted, why = _converted(rec, fqn, fused_here, stepper, torch_side or {}, specs.get(fqn),
                                        group_here if fused_here else None)
            if converted is not None:
                return converted
            if strict:
                problems.append(
                    f"'{fqn}' was saved with {'a fused' if rec['fused'] else 'a torch.optim'} optimizer and is "
                    f"{'fused' if fused_here else 'stepped by torch.optim'} here"
                    + (f" with {rec['optimizer'] if fused_here else stepper}: {why}" if why else "")
                    + ": its state is not converted (strict=False leaves it as it is)")
            return None
        elif rec["optimizer"] is not None and rec["optimizer"] != stepper:
            if strict:  # another optimizer's states and hyperparameters (Adam's into SGD's) would be taken as its own
                problems.append(f"'{fqn}' was saved with the state of {rec['optimizer']} and is stepped by {stepper} "
                                "here: its state and hyperparameters are not converted (strict=False leaves them as "
                                "they are)")
            return None
        return rec

    for o in subs:
        target = _Target(o, [], [])
        for g in o.param_groups:
            hps: Dict[str, dict] = {}
            for p in g["params"]:
                fqn = _fqn(names, p)
                rec = usable(fqn, False, type(o).__name__, g)
                if rec is None:
                    target.states.append(None)
                    continue
                hps[fqn] = rec["group"]
                got: dict = {name: ("value", v) for name, v in rec["values"].items()}
                # loaded sparse where saved so, unless the table here makes dense gradients (sparse=False)
                sparse = rec.get("sparse", {}) if tables.get(fqn, (None, True))[1] else {}
                for name, kind in rec["states"].items():
                    entry = rec.get("entries", {}).get(name, f"{fqn}{OPTIM_TAG}{name}")
                    meta = md.get(entry)
                    if not isinstance(meta, TensorStorageMetadata):
                        problems.append(f"optimizer state '{name}' of parameter '{fqn}' is listed in {INFO_FILE} but "
                                        f"the checkpoint has no tensor '{entry}'")
                        continue
                    size = tuple(layout[fqn][0]) if fqn in layout else tuple(p.shape)
                    own = o.state.get(p, {}).get(name)
                    want = {"param": size, "rows": (size[0], 1) if len(size) == 2 else None,
                            "tensor": tuple(own.shape) if isinstance(own, torch.Tensor) else None}[kind]
                    if (want is None and kind == "rows") or (want is not None and tuple(meta.size) != want):
                        problems.append(f"optimizer state '{name}' of parameter '{fqn}' is {_fmt(meta.size)} in the "
                                        f"checkpoint and {_fmt(want) if want else 'not per-row'} in the model"
                                        + ("" if kind == "param" else f" (parameter {_fmt(size)})"))
                        continue
                    dtype = meta.properties.dtype
                    if fqn in layout and kind != "tensor":  # this rank's rows (and columns) of it
                        try:
                            out.cut[entry] = _state_cut(fqn, layout, per_row=kind == "rows")
                        except CheckpointError as e:
                            problems.append(str(e).replace("fxrec.checkpoint: ", ""))
                            continue
                        local = (p.shape[0], 1) if kind == "rows" else tuple(p.shape)
                        t = out.cut_tensors[entry] = torch.empty(local, dtype=dtype, device=p.device)
                        got[name] = ("piece", t, kind, sparse.get(name, 0), p)
                    elif _is_dtensor(p) and kind != "tensor":  # FSDP's: DCP reads this rank's chunk of it
                        out.whole[entry] = _sharded_like(p, torch.empty(
                            (p.to_local().shape[0],) + ((1,) if kind == "rows" else tuple(p.shape[1:])),
                            dtype=dtype, device=p.device), kind)
                        got[name] = ("whole", entry, kind, sparse.get(name, 0), p)
                    else:  # zero strides: _load_staged allocates the tensor it reads into
                        out.whole[entry] = torch.empty((), dtype=dtype, device=p.device).expand(tuple(meta.size))
                        got[name] = ("whole", entry, kind, sparse.get(name, 0), p)
                target.states.append(got)
            target.groups.append(_group_hyperparameters(hps, strict, problems))
        out.targets.append(target)
    for g in fused:
        recs = {fqn: rec for fqn in g["tables"] for rec in [usable(fqn, True, steppers[fqn], g)] if rec is not None}
        hps = {fqn: rec["group"] for fqn, rec in recs.items()}
        out.fused_from.update(rec["from"] for rec in recs.values() if rec.get("from"))
        saved = _group_hyperparameters(hps, strict, problems)
        if saved:
            out.fused_lr.append((g, saved))
    if missing and strict:
        problems.append(f"the checkpoint has no optimizer state for parameters {sorted(missing)} (strict=False "
                        "leaves theirs as it is)")
    return out


def _group_hyperparameters(saved: Dict[str, dict], strict: bool, problems: List[str]) -> Optional[dict]:
    """The saved hyperparameters of one param group from its parameters' records (``saved``: fqn
    -> encoded hyperparameters), decoded; None when none was saved. A problem when they differ
    (strict), else the first parameter's. A key one record lacks is no difference: a table saved
    fused keeps only what its fused group has on every rank (lr, a scheduler's keys), not the
    torch form's fixed settings that a table stepped by torch.optim records."""
    if not saved:
        return None
    (first, hps), *others = saved.items()
    merged = dict(hps)
    for fqn, other in others:
        diff = sorted(k for k in set(hps) & set(other) if hps[k] != other[k])
        if diff and strict:
            problems.append(f"parameters '{first}' and '{fqn}' are in one param group here but were saved with other "
                            f"hyperparameters {diff}")
            break
        merged.update({k: v for k, v in other.items() if k not in merged})
    return {k: _decode(v) for k, v in merged.items()}
