"""Checkpoints of sharded and single-process models with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a DCP directory holding every table as its global (logical) tensor and every
other parameter and buffer once. It does not remember the plan or the world size that wrote it:
DCP reads, for each rank, just the rows and columns that rank's pieces need, so a checkpoint
written under one plan loads under any other plan and world size, and into the plain model.

    fxrec.checkpoint.save(fast, "ckpt/step_100")           # sharded run, every rank (collective)

    fast2 = fxrec.transform(model, example, plan=other_plan)  # another plan / world size, every rank
    fxrec.checkpoint.load(fast2, "ckpt/step_100")

    fxrec.checkpoint.load_into_model(model, "ckpt/step_100")  # one process, no process group
    fxrec.checkpoint.save_model(model, "ckpt/init")           # loads into a sharded model with load()

    fxrec.checkpoint.save(fast, "ckpt/step_100", optimizer=opt)   # with the optimizer's state
    fxrec.checkpoint.load(fast2, "ckpt/step_100", optimizer=fast2.make_optimizer(torch.optim.Adam))

What a rank holds comes from ``fast.meta["fxrec_shard_layout"]`` (written by the shard pass):
``{param_fqn: ((rows, dim), [(row_offset, num_rows, col_offset, num_cols, local_col_offset), ...])}``;
piece ``i`` is ``param[:num_rows, local_col_offset:local_col_offset + num_cols]`` of this rank's
parameter and covers ``[row_offset:row_offset + num_rows, col_offset:col_offset + num_cols]`` of
the table. The pieces are handed to DCP directly as shard chunks by a small save / load planner
(``WriteItem`` / ``ReadItem`` over ``ChunkStorageMetadata``): no ShardedTensor (deprecated in
torch 2.13, one all-gather per table to build) and no DTensor (its ``Shard(0)`` cannot say "this
table lives on rank 3 only" or place column pieces at arbitrary offsets). Pieces that several
ranks hold identically (data-parallel tables, dense parameters) are written once (DCP dedups).
The states of fused embedding optimizers (Adagrad's, row-wise Adagrad's) are part of them, as
entries ``<table fqn>.fxrec_fused.<state>``: Adagrad's shaped and cut like its table, row-wise
Adagrad's as a ``[rows, 1]`` column cut by the table's rows, so they reshard with the weights;
a fused Adam's step count (one per group) as ``<table fqn>.fxrec_fused.step`` for each of the
group's tables, whole (the ranks that hold parts of a table must agree on it when saving, and the
tables of one group on loading). They are optional both ways: a checkpoint without them loads
into a fused model (its states are left as they are), and one with them loads into a model
without (they are skipped); a checkpoint with another fused optimizer's states for a table (say
Adagrad's ``sum`` where the model's Adam needs ``exp_avg``, ``exp_avg_sq`` and ``step``) is an
error naming the table (``strict=False`` leaves that table's states as they are).

The optimizer that ``opt.step()`` runs (``fast.make_optimizer(...)``: the dense optimizer and the
torch.optim fallbacks of tables fxrec does not fuse; or any torch.optim optimizer) is saved with
``optimizer=opt`` and loaded with ``optimizer=opt`` (a fresh one, built for the loading model),
keyed by parameter name (:mod:`fxrec.checkpoint_optim`): a state of its parameter's shape (Adam's
``exp_avg``) is the entry ``<param fqn>.fxrec_optim.<state>``, cut like the parameter by the same
pieces and planner (a per-row ``[rows]`` state as a ``[rows, 1]`` column, like row-wise Adagrad's);
other states (Adam's ``step``) are written once; the param groups' hyperparameters (``lr``, ...),
the kinds of the states and non-tensor states are plain JSON in ``fxrec_optimizer.json``, restored
on load (as torch.optim's ``load_state_dict`` does: a scheduler resumes with its own state_dict).
Optional both ways too: with ``optimizer=`` and a checkpoint without its state, ``strict=True``
raises naming what is missing.

Safe and all-or-nothing: :func:`save` / :func:`save_model` write into ``<path>.fxrec-partial`` and
rename it to ``path`` when every file is written, with ``fxrec_checksums.json`` (the SHA-256 and size
of every file). Loading verifies every file against it before anything is read into the model, reads
DCP's ``.metadata`` with an unpickler that builds only DCP's own metadata classes (DCP itself would
unpickle anything), reads non-tensor entries with ``torch.load(weights_only=True)``, and loads into
staging copies that are copied into the model only when the whole load succeeded: a failed load leaves
the model as it was and raises :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
import warnings
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["save", "load", "save_model", "load_into_model", "verify", "add_checksums", "CheckpointError"]

LAYOUT_KEY = "fxrec_shard_layout"
#: The parameters ``transform(dense="fsdp")`` has FSDP shard (DTensors; never a table); written by fxrec.ranks.
FSDP_KEY = "fxrec_fsdp_params"
#: Marks a fused optimizer's state entry: ``<table fqn>.fxrec_fused.<state name>``.
FUSED_TAG = ".fxrec_fused."
#: A fused optimizer's step count (fbgemm's Adam): ``<table fqn>.fxrec_fused.step``, int64 ``[1]``.
STEP_STATE = "step"
#: Marks a state entry of the optimizer given as ``optimizer=``: ``<param fqn>.fxrec_optim.<state name>``.
OPTIM_TAG = ".fxrec_optim."
_NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"

# the directory's files (integrity, all-or-nothing writes) and DCP's planners, in their own modules
from .checkpoint_files import (CHECKSUMS, _PARTIAL, CheckpointError, _commit, _read_metadata,  # noqa: E402
                               add_checksums, check_replaceable, verify)
from .checkpoint_planners import _dcp, _Pieces, _planners  # noqa: E402

# --------------------------------------------------------------------------- what a model holds
def _layout(module: torch.nn.Module) -> dict:
    meta = getattr(module, "meta", None)
    return dict(meta.get(LAYOUT_KEY, {})) if isinstance(meta, dict) else {}


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _sharded_again(module: torch.nn.Module) -> None:
    """A model whose other parameters FSDP shards (``transform(dense="fsdp")``) with them sharded
    (DTensors, which its optimizer holds), as DCP reads and writes them: FSDP keeps them whole
    between a forward and its backward."""
    meta = getattr(module, "meta", None)
    if isinstance(meta, dict) and meta.get(FSDP_KEY):
        from torch.distributed.fsdp import FSDPModule

        for m in module.modules():  # (reshard is per unit)
            if isinstance(m, FSDPModule):
                m.reshard()


def _state_cut(fqn: str, layout: dict, per_row: bool):
    """The layout of an optimizer state kept beside the table ``fqn``: cut like the table (a state
    of the table's shape), or (``per_row``) a ``[rows, 1]`` column cut by the table's rows. The one
    rule for fused states and for those of ``optimizer=``."""
    (rows, dim), pieces = layout[fqn]
    if not per_row:
        return (rows, dim), pieces
    if any(n and cols and (col, cols) != (0, dim) for _, n, col, cols, _ in pieces):
        raise CheckpointError(f"fxrec.checkpoint: table '{fqn}' is split by columns here, so a per-row optimizer "
                              "state (one value for the whole row) cannot be cut like it")
    return (rows, 1), [(ro, n, 0, 1, 0) for ro, n, _, _, _ in pieces]


def _pieces_of(module: torch.nn.Module, layout: dict, tensors: Optional[Dict[str, torch.Tensor]] = None) -> _Pieces:
    """This rank's table pieces as views of its parameters (see the module doc), or of
    ``tensors[fqn]`` where given (a fused optimizer's state)."""
    out: _Pieces = {}
    for fqn, (shape, pieces) in sorted(layout.items()):
        size = torch.Size(shape)
        views = []
        param = None
        # (an empty row block, a row-wise table's trailing ranks', holds nothing: a sequence group
        # keeps no parameter for it)
        pieces = [p for p in pieces if p[1] and p[3]]
        if pieces and tensors is not None and fqn in tensors:
            param = tensors[fqn].detach()
        elif pieces:
            try:
                param = module.get_parameter(fqn).detach()
            except AttributeError as e:
                raise CheckpointError(f"fxrec.checkpoint: the shard layout gives this rank pieces of table '{fqn}', "
                                      "but the model has no such parameter") from e
        for row_off, rows, col_off, cols, local_col in pieces:
            if rows > param.shape[0] or local_col + cols > param.shape[1] or \
                    row_off + rows > size[0] or col_off + cols > size[1]:
                raise CheckpointError(
                    f"fxrec.checkpoint: piece rows {row_off}+{rows}, cols {col_off}+{cols} (local col {local_col}) of "
                    f"table '{fqn}' ({size[0]} x {size[1]}) does not fit this rank's parameter "
                    f"{tuple(param.shape)}")
            views.append((torch.Size([row_off, col_off]), torch.Size([rows, cols]),
                          param[:rows, local_col:local_col + cols]))
        out[fqn] = (size, views)
    return out


def _whole_state(module: torch.nn.Module, layout: dict) -> Dict[str, torch.Tensor]:
    """Every state_dict entry that is not a planned table (whole on every rank), sharing storage."""
    return {k: v for k, v in module.state_dict().items() if k not in layout}


def _table_names(module: torch.nn.Module, layout: dict) -> set:
    names = set(layout)
    for prefix, m in module.named_modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
            names.add(f"{prefix}.weight" if prefix else "weight")
    return names


def _fmt(shape) -> str:
    return " x ".join(str(int(s)) for s in shape) if len(shape) == 2 else str(tuple(int(s) for s in shape))


def _check_fits(path, expected: Dict[str, Optional[torch.Size]], tables: set, strict: bool,
                optimizer_problems: Sequence[str] = ()) -> set:
    """Raise CheckpointError naming every entry the checkpoint has with another shape and (strict)
    every entry it lacks or has and the model does not, and ``optimizer_problems``; return the
    checkpoint's keys. Reads only the checkpoint's metadata file, before any collective; what a
    rank holds (its tables' fused states, its optimizer) differs by rank: see load."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"fxrec.checkpoint: no checkpoint directory at {path!s}")
    md = _read_metadata(path).state_dict_metadata
    problems = []
    other = _fused.other_states(expected, md)  # (their states are reported below, not by shape)
    for key, shape in sorted(expected.items()):
        if FUSED_TAG in key and key.split(FUSED_TAG)[0] in other:
            continue
        what = "table" if key in tables else "entry"
        got = md.get(key)
        if got is None:
            if strict and FUSED_TAG not in key:  # fused optimizer states are optional
                problems.append(f"the checkpoint has no {what} '{key}' (the model's is "
                                f"{_fmt(shape) if shape is not None else 'not a tensor'})")
        elif shape is not None:
            if not isinstance(got, _dcp().TensorStorageMetadata):
                problems.append(f"{what} '{key}' is not a tensor in the checkpoint; the model's is {_fmt(shape)}")
            elif tuple(got.size) != tuple(shape):
                problems.append(f"{what} '{key}' is {_fmt(got.size)} in the checkpoint and {_fmt(shape)} in the model")
            else:
                gap = _uncovered(got)
                if gap:
                    problems.append(f"{what} '{key}' ({_fmt(shape)}): {gap}")
    if strict:
        extra = sorted(k for k in set(md) - set(expected) if not _is_optimizer_entry(k))
        if extra:
            problems.append(f"the checkpoint has entries the model does not: {extra} (strict=False ignores them)")
    if strict:
        problems += [f"table '{fqn}' has the fused optimizer states {', '.join(there)} in the checkpoint, another "
                     f"optimizer's than the model's fused one, which keeps {', '.join(here)} (strict=False leaves them "
                     "as they are)"
                     for fqn, (there, here) in other.items()]
    problems += list(optimizer_problems)
    if problems:
        what = "the model and its optimizer" if optimizer_problems else "the model"
        raise CheckpointError(f"fxrec.checkpoint: {path!s} does not fit {what}: " + "; ".join(problems))
    return {k for k in md if FUSED_TAG not in k or k.split(FUSED_TAG)[0] not in other}


def _is_optimizer_entry(key: str) -> bool:
    """An optimizer state entry (fused, or of ``optimizer=``): checked apart from the model's."""
    return FUSED_TAG in key or OPTIM_TAG in key


def _expected(whole: Dict[str, torch.Tensor], layout: dict) -> Dict[str, Optional[torch.Size]]:
    out = {k: (v.shape if isinstance(v, torch.Tensor) else None) for k, v in whole.items()}
    out.update({fqn: torch.Size(shape) for fqn, (shape, _) in layout.items()})
    return out


def _check_collective(fn_name: str, layout: dict, fast: torch.nn.Module) -> None:
    quantize = getattr(fast, "meta", {}).get("fxrec_quantize") if layout else None
    if quantize is not None:  # (on every rank alike, before any collective)
        raise CheckpointError(f"fxrec.checkpoint.{fn_name}: the model is sharded and quantized for serving "
                              f"(quantize={quantize!r}): its shards are packed rows, which checkpoints do not hold; "
                              "checkpoint the model it serves (trained, unquantized), and serve that by "
                              "fxrec.checkpoint.load_into_model into the plain model, then "
                              "fxrec.transform(..., mode='inference', quantize=..., plan=...)")
    if layout and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"fxrec.checkpoint.{fn_name}: the model is sharded (transformed with plan=): call it on "
                           "every rank of the initialised process group; for a single-process model use "
                           f"{'save_model' if fn_name == 'save' else 'load_into_model'}")


# --------------------------------------------------------------------------- API
def save(fast: torch.nn.Module, path, *, optimizer: Optional[torch.optim.Optimizer] = None,
         process_group=None) -> None:
    """Write a model sharded with ``fxrec.transform(..., plan=...)`` to the DCP directory ``path``.

    Collective: every rank of the process group calls it, with the same ``path`` (a directory all
    ranks can write; shared storage across hosts). Each table is stored as its global tensor made
    of the pieces the ranks hold; every other parameter and buffer (whole on every rank) once.
    Load it with :func:`load` under any plan and world size, or with :func:`load_into_model`
    into the single-process model. ::

        fast = fxrec.transform(model, local_example, plan=plan)
        opt = fast.make_optimizer(torch.optim.Adam, lr=1e-3)
        ...train...
        fxrec.checkpoint.save(fast, f"ckpt/step_{step}", optimizer=opt)     # on every rank

    ``optimizer``: also write the state of the optimizer that ``opt.step()`` runs (the one
    ``fast.make_optimizer`` returns, or any ``torch.optim`` optimizer over the model's parameters),
    keyed by parameter name, its per-element states cut like the parameters (see the module doc).
    The ranks must agree on what they keep once (e.g. Adam's ``step`` of a sharded table), else
    :class:`CheckpointError` on every rank, before anything is written.
    """
    path = os.path.normpath(os.fspath(path))
    layout = _layout(fast)
    _check_collective("save", layout, fast)
    _sharded_again(fast)
    if not (dist.is_available() and dist.is_initialized()):
        return save_model(fast, path, optimizer=optimizer)  # an unsharded model in a single process
    state_layout, sharded_states, whole_states = _fused.split_states(_fused.states(fast), layout, fast)
    pieces = {**_pieces_of(fast, layout), **_pieces_of(fast, state_layout, sharded_states)}
    steps = _fused.steps(fast)
    _fused.agreed_steps(steps, process_group)
    whole = {**_whole_state(fast, layout), **whole_states, **steps}
    saved = None
    if optimizer is not None:  # collective: the ranks' parts gathered, the same on every rank
        from . import checkpoint_optim

        saved = checkpoint_optim.collect(fast, optimizer, layout, distributed=True, process_group=process_group)
        pieces.update(saved.pieces(fast))
        whole.update(saved.whole)
    rank = dist.get_rank(process_group)
    tmp = str(path) + _PARTIAL
    _one_directory(tmp, path, rank, process_group)
    _dcp().save(whole, checkpoint_id=tmp, planner=_planners()[0](pieces), process_group=process_group)
    error = [None]
    if rank == 0:  # DCP's save returns on every rank after rank 0 wrote the metadata
        try:
            if saved is not None:
                saved.write(tmp)
            _commit(tmp, str(path))
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            error[0] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(error, src=dist.get_global_rank(process_group, 0) if process_group else 0,
                               group=process_group)
    if error[0] is not None:
        raise CheckpointError(f"fxrec.checkpoint.save: rank 0 could not finish {path!s}: {error[0]}")


def load(fast: torch.nn.Module, path, *, strict: bool = True, optimizer: Optional[torch.optim.Optimizer] = None,
         process_group=None) -> None:
    """Fill a sharded model's parameters and buffers in place from the DCP checkpoint at ``path``.

    Collective: every rank calls it. The checkpoint may come from :func:`save` under any plan and
    world size, or from :func:`save_model` (one process): each rank reads just the rows and
    columns of its own pieces. Raises :class:`CheckpointError` (on every rank, before any data is
    read) naming each table or entry the checkpoint has with another shape, both shapes given,
    and with ``strict=True`` (default) each one it lacks and those the model does not have
    (``strict=False`` leaves the former as they are and ignores the latter). ::

        fast = fxrec.transform(model, local_example, plan=new_plan)   # another plan / world size
        opt = fast.make_optimizer(torch.optim.Adam, lr=1e-3)
        fxrec.checkpoint.load(fast, "ckpt/step_100", optimizer=opt)  # on every rank

    ``optimizer``: also fill the state of this optimizer (built for ``fast``, before its first
    step) from the checkpoint's, by parameter name, each rank reading the rows its parameters
    hold, and restore its param groups' hyperparameters (``lr``, ...) as saved, so that an LR
    scheduler whose own ``state_dict`` is restored goes on where it was. With ``strict=True`` a
    checkpoint saved without it, or without the state of one of its parameters, raises
    :class:`CheckpointError` naming them (``strict=False`` leaves those as they are); a state of
    another shape always does, naming the parameter, the state and both shapes.
    """
    path = os.path.normpath(os.fspath(path))
    layout = _layout(fast)
    _check_collective("load", layout, fast)
    _sharded_again(fast)
    if strict:
        _refuse_float_rows_into_packed(fast, path)
    if not (dist.is_available() and dist.is_initialized()):  # an unsharded model in a single process
        return load_into_model(fast, path, strict=strict, optimizer=optimizer)
    state_layout, sharded_states, whole_states = _fused.split_states(_fused.states(fast), layout, fast)
    pieces = {**_pieces_of(fast, layout), **_pieces_of(fast, state_layout, sharded_states)}
    whole = {**_whole_state(fast, layout), **whole_states, **_fused.steps(fast)}
    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    _agree(lambda: verify(path, part=(rank, world)), process_group)  # each rank hashes its share
    _same_checkpoint(path, process_group)
    def fits():
        return _fits(fast, optimizer, path, _expected(whole, {**layout, **state_layout}), _table_names(fast, layout),
                     layout, strict)

    found = []  # what each rank holds differs (its fused states, its optimizer): every rank raises when one does
    _agree(lambda: found.append(fits()), process_group,
           other="another rank found that the checkpoint does not fit its model or optimizer (its error says "
                 "why); nothing was loaded")
    keys, opt_load = found[0]
    _read_converted(opt_load, pieces, whole)
    pieces = {k: v for k, v in pieces.items() if k in keys}  # strict=False: tables it lacks stay as they are
    staged_pieces = {k: (size, [(o, n, _staging(v)) for o, n, v in views]) for k, (size, views) in pieces.items()}
    read = whole
    if opt_load is not None:  # read with the model's entries, into fresh tensors of their own
        staged_pieces.update(opt_load.pieces(fast))
        read = {**whole, **opt_load.whole}
        keys = keys | set(opt_load.whole)
    staged = _load_staged(read, keys, path, _planners()[1](staged_pieces), no_dist=False, process_group=process_group)
    steps = []
    _agree(lambda: steps.extend(_fused.steps_to_set(fast, staged)), process_group,
           other="another rank found the checkpoint's fused optimizer steps disagree (its error says where); "
                 "nothing was loaded")
    _fused.set_steps(steps)
    with torch.no_grad():  # every rank read everything: now the model changes
        for k, (_, views) in pieces.items():
            for (_, _, view), (_, _, new) in zip(views, staged_pieces[k][1]):
                view.copy_(new)
    _copy_back(fast, whole, staged)
    if opt_load is not None:
        opt_load.apply(staged)


def save_model(model: torch.nn.Module, path, *, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Write a single-process model (full tables; a plain model or ``fxrec.transform`` without a
    plan) to the DCP directory ``path``, in the format :func:`load` reads into a sharded model.

    Needs no process group; when one is initialised, only the calling process writes. ::

        fxrec.checkpoint.save_model(model, "ckpt/init")
        # later, on every rank of a sharded run:
        fxrec.checkpoint.load(fxrec.transform(model, local_example, plan=plan), "ckpt/init")

    ``optimizer``: also write its state, as :func:`save` does (``fast.make_optimizer(...)``'s, or
    any ``torch.optim`` optimizer over the model's parameters); :func:`load` reshards it.
    """
    path = os.path.normpath(os.fspath(path))
    layout = _layout(model)
    if any(_is_partial(shape, pieces) for shape, pieces in layout.values()):
        raise RuntimeError("fxrec.checkpoint.save_model: the model is sharded (transformed with plan=): "
                           "use fxrec.checkpoint.save on every rank")
    check_replaceable(path)  # before anything is written (again when the write is done)
    tmp = str(path) + _PARTIAL
    shutil.rmtree(tmp, ignore_errors=True)  # left by a save that did not finish
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
        dcp = _dcp()
        states = {**_fused.states(model), **_fused.steps(model)}  # first: it may bind the tables to their TBE
        saved = None
        if optimizer is not None:
            from . import checkpoint_optim

            saved = checkpoint_optim.collect(model, optimizer, {}, distributed=False)
            states.update(saved.whole)
        dcp.save({**model.state_dict(), **states}, checkpoint_id=tmp,
                 planner=dcp.DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
    if saved is not None:
        saved.write(tmp)
    _commit(tmp, str(path))


def load_into_model(model: torch.nn.Module, path, *, strict: bool = True,
                    optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Load a checkpoint written by :func:`save` (any plan, any world size) or :func:`save_model`
    into a single-process model with full tables, in place. Needs no process group. ::

        model = MyModel()                                   # e.g. for evaluation
        fxrec.checkpoint.load_into_model(model, "ckpt/step_100")
        fast = fxrec.transform(model, example)              # or fxrec.transform(..., mode="inference")

    Raises :class:`CheckpointError` naming each table or entry the checkpoint has with another
    shape (both shapes given), and with ``strict=True`` (default) each one it lacks and those the
    model does not have; and naming the file when one is damaged or missing (the model is then
    left as it was). ``optimizer``: also fill this optimizer's state and hyperparameters from the
    checkpoint's, as :func:`load` does (the same errors).
    """
    path = os.path.normpath(os.fspath(path))
    layout = _layout(model)
    if any(_is_partial(shape, pieces) for shape, pieces in layout.values()):
        raise RuntimeError("fxrec.checkpoint.load_into_model: the model is sharded (transformed with plan=): "
                           "use fxrec.checkpoint.load on every rank")
    if strict:
        _refuse_float_rows_into_packed(model, path)
    states = {**_fused.states(model), **_fused.steps(model)}  # first: it may bind the tables to their TBE
    state = {**model.state_dict(), **states}
    verify(path)
    as_saved = _packed_rows_as_saved(state, path)
    keys, opt_load = _fits(model, optimizer, path, _expected({**state, **as_saved}, {}), _table_names(model, {}), {},
                           strict)
    _read_converted(opt_load, state)
    read = {**state, **as_saved}
    if opt_load is not None:  # every state whole: one process holds whole parameters
        read = {**read, **opt_load.whole}
        keys = keys | set(opt_load.whole)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
        planner = _planners()[2](flatten_state_dict=False, allow_partial_load=not strict)
        staged = _load_staged(read, keys, path, planner, no_dist=True, process_group=None)
    from .graph_module import sync_caches

    _refuse_packed_rows_of_other_tables(model, staged, path)
    _fused.set_steps(_fused.steps_to_set(model, staged))  # first: the steps may not fit
    sync_caches(model, drop=True)  # tables fbgemm caches in GPU memory: empty the cache before the write
    _copy_back(model, state, staged)
    if opt_load is not None:
        opt_load.apply(staged)


# --------------------------------------------------------------------------- helpers
def _read_converted(opt_load, *entries: dict) -> None:
    """In ``entries`` (entry -> the tensor it is read into), each fused state the checkpoint holds as
    the torch optimizer's (the table was stepped by torch.optim when saved: checkpoint_optim.CONVERTED)
    under that optimizer's entry, so that it is read from there."""
    for fused_entry, entry in (opt_load.fused_from.items() if opt_load is not None else ()):
        for d in entries:
            if fused_entry in d:
                d[entry] = d.pop(fused_entry)


def _fits(module, optimizer, path, expected, tables, layout, strict):
    """Check the checkpoint against the model and (given) the optimizer, raising one
    CheckpointError naming every problem of both; return (the checkpoint's keys, the planned
    optimizer load or None)."""
    problems: List[str] = []
    opt_load = None
    if optimizer is not None:
        from . import checkpoint_optim

        opt_load = checkpoint_optim.plan_load(module, optimizer, path, layout, strict, problems)
        if opt_load is not None:  # (a fused state held as the torch optimizer's: checked under that entry)
            expected = {opt_load.fused_from.get(k, k): v for k, v in expected.items()}
    return _check_fits(path, expected, tables, strict, problems), opt_load


_MARK = ".fxrec-rank0"


def _one_directory(tmp: str, path: str, rank: int, process_group) -> None:
    """Rank 0 makes the save's directory afresh (a save that did not finish may have left one) and
    marks it; every rank must see that mark at its own ``path``: the same directory, on storage
    they share (under whatever mount point). Else CheckpointError on every rank before anything is
    written: rank 0 would commit a checkpoint naming files another rank wrote elsewhere."""
    token = [None, None]  # (the mark, or rank 0's error making the directory)
    if rank == 0:
        try:
            check_replaceable(path)  # (again when the write is done)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            token[0] = uuid.uuid4().hex
            with open(os.path.join(tmp, _MARK), "w") as fh:
                fh.write(token[0])
        except (OSError, CheckpointError) as e:
            token[1] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(token, src=dist.get_global_rank(process_group, 0) if process_group else 0,
                               group=process_group)
    if token[1] is not None:  # every rank raises it (they would otherwise wait for rank 0)
        if token[1].startswith("CheckpointError: "):  # (check_replaceable: the path names itself)
            raise CheckpointError(token[1][len("CheckpointError: "):] + "; nothing was written")
        raise CheckpointError(f"fxrec.checkpoint.save: rank 0 could not make {tmp}: {token[1]}; nothing was written")

    def sees_it():
        try:
            with open(os.path.join(tmp, _MARK)) as fh:
                ok = fh.read() == token[0]
        except OSError:
            ok = False
        if not ok:
            raise CheckpointError(f"fxrec.checkpoint.save: rank {rank} does not see rank 0's checkpoint directory at "
                                  f"{path!s}: every rank must give the same directory, on storage all ranks share "
                                  "(e.g. a path made on rank 0 and sent to the others with dist.broadcast_object_list)")

    try:
        _agree(sees_it, process_group, other="another rank does not see rank 0's checkpoint directory at its path "
                                             "(its error names it); nothing was written")
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if rank == 0:
        os.remove(os.path.join(tmp, _MARK))
    dist.barrier(group=process_group)


def _same_checkpoint(path: str, process_group) -> None:
    """Every rank of a load must read one checkpoint (copies of it at other paths are fine): the
    digests of their checksum lists must agree, else CheckpointError on every rank naming each
    rank's path, before anything is read."""
    try:
        with open(os.path.join(path, CHECKSUMS), "rb") as fh:
            digest = hashlib.sha256(fh.read()).hexdigest()
    except OSError:
        digest = None  # (an older fxrec's or DCP's own checkpoint: nothing to compare)
    seen = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(seen, (digest, path), group=process_group)
    if len({d for d, _ in seen}) > 1:
        given = ", ".join(f"rank {r} {p!r}" for r, (_, p) in enumerate(seen))
        raise CheckpointError(f"fxrec.checkpoint.load: the ranks read different checkpoints ({given}); every rank "
                              "must load the same one")


def _is_partial(shape, pieces) -> bool:
    return not (len(pieces) == 1 and tuple(pieces[0][:4]) == (0, shape[0], 0, shape[1]))


def _agree(check, process_group, other: str = "another rank found the checkpoint damaged or missing (its error "
                                                  "names the file); nothing was loaded") -> None:
    """Run ``check`` on every rank; when it raises on any rank, raise on every rank (the others
    would otherwise wait in DCP's collectives for the one that left): its own error on that rank,
    ``CheckpointError(other)`` on the others."""
    error: Optional[BaseException] = None
    try:
        check()
    except Exception as e:  # noqa: BLE001 - any failure on one rank stops them all
        error = e
    backend = dist.get_backend(process_group)
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    flag = torch.tensor([0 if error is None else 1], device=dev)
    dist.all_reduce(flag, group=process_group)
    if error is not None:
        raise error
    if int(flag.item()):
        raise CheckpointError(f"fxrec.checkpoint: {other}")


def _uncovered(tm) -> str:
    """What is wrong with how the saved pieces (chunks) of one tensor in a checkpoint's metadata
    cover it, or "": each inside the tensor, none overlapping another, together every value (a
    piece missing would leave values of the staging tensor unset; DCP reads what the pieces hold).
    The pieces' edges cut the tensor into cells, each piece covering whole cells: a cell covered
    twice is an overlap, one never covered a gap (time linear in the cells, as many as the pieces
    in a checkpoint of row or column shards)."""
    import bisect
    import itertools
    import math

    size = tuple(tm.size)
    boxes = []
    for c in tm.chunks:
        lo, n = tuple(c.offsets), tuple(c.sizes)
        if len(lo) != len(size) or len(n) != len(size) or any(o < 0 or k < 0 or o + k > d
                                                               for o, k, d in zip(lo, n, size)):
            return f"a saved piece at {list(lo)} of size {list(n)} lies outside it"
        if all(n):
            boxes.append((lo, n))
    cuts = [sorted({0, d} | {lo[k] for lo, _ in boxes} | {lo[k] + n[k] for lo, n in boxes}) for k, d in enumerate(size)]
    owner: dict = {}
    for lo, n in boxes:
        spans = [range(bisect.bisect_left(cut, o), bisect.bisect_left(cut, o + k)) for cut, o, k in zip(cuts, lo, n)]
        for cell in itertools.product(*spans):
            if cell in owner:
                return f"saved pieces at {list(owner[cell])} and {list(lo)} overlap"
            owner[cell] = lo
    if len(owner) != math.prod(len(cut) - 1 for cut in cuts):
        held, numel = sum(math.prod(n) for _, n in boxes), math.prod(size)
        return (f"the saved pieces hold {held} of its {numel} values, so some would be left unset "
                "(a checkpoint written incompletely or by another tool)")
    return ""


def _staging(v: torch.Tensor) -> torch.Tensor:
    """A tensor to read ``v``'s entry into before the model takes it: in host memory where ``v`` is
    on a GPU (staged there, a load held a second copy of the model's tables in GPU memory while it
    ran; DCP reads the files into host memory first either way)."""
    return torch.empty_like(v, device="cpu") if v.is_cuda else torch.empty_like(v)


def _load_staged(state: Dict[str, torch.Tensor], keys: set, path, planner, *, no_dist: bool,
                 process_group) -> Dict[str, object]:
    """DCP's load of the entries in ``keys`` into new tensors shaped like ``state``'s (the model is not
    touched); raises CheckpointError naming the path when DCP fails (its CheckpointException is a
    BaseException that ``except Exception`` would not catch)."""
    from torch.distributed.checkpoint.api import CheckpointException

    staged = {k: (_staging(v) if isinstance(v, torch.Tensor) else v) for k, v in state.items() if k in keys}
    try:
        _dcp().load(staged, checkpoint_id=path, planner=planner, storage_reader=_planners()[3](path),
                    no_dist=no_dist, process_group=process_group)
    except (Exception, CheckpointException) as e:
        lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
        why = lines[-1] if lines else ""  # DCP's text ends with the underlying error
        raise CheckpointError(f"fxrec.checkpoint: reading {path!s} failed, nothing was loaded: "
                              f"{type(e).__name__}: {why}") from e
    return staged


# A quantized group's packed rows and their layout: loaded through its load_state_dict, which packs
# them again when they were saved for another device (fxrec.runtime.quantized).
_PACKED_ROWS = ("q_weights", "q_weights_uvm", "q_weights_offsets", "q_weights_placements", "q_row_alignment",
                "q_weights_tys", "q_D_offsets")


def _packed_rows_as_saved(state: Dict[str, torch.Tensor], path: str) -> Dict[str, torch.Tensor]:
    """Staging tensors of the checkpoint's sizes for the packed rows of quantized groups (their
    bytes differ with the device they were packed for: row alignment, rows in unified memory),
    where the checkpoint holds them at another size than the model; the group's load packs them
    again (:func:`_refuse_packed_rows_of_other_tables` checks them first)."""
    md = _read_metadata(path).state_dict_metadata
    out = {}
    for k, v in state.items():
        got = md.get(k)
        if (k.rsplit(".", 1)[-1] in ("q_weights", "q_weights_uvm") and isinstance(v, torch.Tensor)
                and isinstance(got, _dcp().TensorStorageMetadata) and len(got.size) == 1
                and tuple(got.size) != tuple(v.shape)):
            out[k] = torch.empty(tuple(got.size), dtype=v.dtype)
    return out


def _refuse_packed_rows_of_other_tables(module: torch.nn.Module, staged: Dict[str, object], path) -> None:
    """A CheckpointError, before anything is written, where a quantized group's staged rows do not
    fit its tables as the checkpoint's own layout packs them."""
    problems = []
    for name, m in module.named_modules():
        if hasattr(m, "saved_layout_problem"):
            prefix = f"{name}." if name else ""
            mine = {k[len(prefix):]: v for k, v in staged.items() if k.startswith(prefix) and "." not in k[len(prefix):]}
            if "q_weights" in mine and "q_weights_placements" in mine:
                problem = m.saved_layout_problem(mine)
                if problem:
                    problems.append(f"'{prefix}': " + problem.replace("fxrec: ", "", 1))
    if problems:
        raise CheckpointError(f"fxrec.checkpoint: {path!s} does not fit the model, nothing was loaded: "
                              + "; ".join(problems))


def _refuse_float_rows_into_packed(module: torch.nn.Module, path: str) -> None:
    """(strict) A CheckpointError, before anything is read, where the model holds quantized rows the
    checkpoint does not (saved from float tables, or without the tables): transform makes them from
    float tables. strict=False loads the rest and leaves the quantized rows as they are."""
    packed = [k for k in module.state_dict(keep_vars=True) if k.rsplit(".", 1)[-1] == "q_weights"]
    if not packed:
        return
    saved = set(_read_metadata(path).state_dict_metadata)
    if any(k not in saved for k in packed):
        raise CheckpointError(
            f"fxrec.checkpoint: {path!s} holds no quantized rows of this model's tables (transformed with "
            "quantize=), which transform makes from float tables: load the checkpoint into the plain model "
            "(fxrec.checkpoint.load_into_model(model, path)) and transform that with quantize= (strict=False loads "
            "the rest and leaves the quantized rows as they are)")


def _copy_back(module: torch.nn.Module, state: Dict[str, torch.Tensor], staged: Dict[str, object]) -> None:
    """The staged tensors into the state dict's tensors (which share storage with the module's);
    non-tensor entries (``get_extra_state``) and quantized rows through ``load_state_dict``."""
    through = {k: v for k, v in staged.items()
               if not isinstance(v, torch.Tensor) or k.rsplit(".", 1)[-1] in _PACKED_ROWS}
    with torch.no_grad():
        for k, v in staged.items():
            if k not in through and isinstance(v, torch.Tensor) and isinstance(state.get(k), torch.Tensor):
                state[k].copy_(v)
    if through:
        module.load_state_dict(through, strict=False)


# the fused optimizers' states (a module of their own; it reads this one's names at call time)
from . import checkpoint_fused as _fused  # noqa: E402
