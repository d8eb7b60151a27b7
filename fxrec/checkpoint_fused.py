"""The fused optimizers' states in :mod:`fxrec.checkpoint`: the entries
``<table fqn>.fxrec_fused.<state>`` (the format is in that module's doc), read from and written
into the groups' TBEs, cut like their tables for a sharded model, and the step count of the
optimizers that keep one, which the ranks and a group's tables must agree on."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .checkpoint import FUSED_TAG, STEP_STATE, CheckpointError, _state_cut


def states(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every fused optimizer state of ``module`` as a 2-D tensor sharing the state's storage, by
    entry name (see :mod:`fxrec.checkpoint`): Adagrad's ``[rows, dim]``, row-wise Adagrad's ``[rows, 1]``.
    Call it before taking views of the parameters: a group not yet bound to its TBE binds here,
    and its parameters' storage moves."""
    out: Dict[str, torch.Tensor] = {}
    for group, fqns, params in groups(module):
        for fqn, per_table in zip(fqns, group.optimizer_states(params)):
            for state, t in per_table.items():
                out[f"{fqn}{FUSED_TAG}{state}"] = t if t.dim() == 2 else t.unsqueeze(1)
    return out


def groups(module: torch.nn.Module):
    """(group module, its tables' fqns, their parameters) of each group with a fused optimizer."""
    meta = getattr(module, "meta", None)
    for name, fqns in (meta.get("fxrec_fused_groups", []) if isinstance(meta, dict) else []):
        group = module.get_submodule(name)
        if group.fused is not None:
            yield group, fqns, [module.get_parameter(f) for f in fqns]


def steps(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The step entries of the groups whose fused optimizer counts steps (reads the device)."""
    out = {}
    for group, fqns, params in groups(module):
        step = group.fused_step(params)
        if step is not None:
            out.update({f"{fqn}{FUSED_TAG}{STEP_STATE}": torch.tensor([step], dtype=torch.int64) for fqn in fqns})
    return out


def steps_to_set(module: torch.nn.Module, staged: Dict[str, object]) -> list:
    """(group, params, step) for each stepped group whose tables' entries were read, to give to
    :func:`set_steps`; CheckpointError when the tables of one group disagree."""
    todo = []
    for group, fqns, params in groups(module):
        got = {f: int(staged[k][0]) for f in fqns for k in [f"{f}{FUSED_TAG}{STEP_STATE}"]
               if isinstance(staged.get(k), torch.Tensor)}
        if len(set(got.values())) > 1:
            raise CheckpointError(f"fxrec.checkpoint: tables {sorted(got)} share one fused optimizer step count here, "
                                  f"but the checkpoint has the steps {got}; nothing was loaded")
        if got:
            todo.append((group, params, next(iter(got.values()))))
    return todo


def set_steps(todo: list) -> None:
    for group, params, step in todo:
        group.set_fused_step(params, step)


def agreed_steps(steps: Dict[str, torch.Tensor], process_group) -> None:
    """Collective: CheckpointError on every rank when two ranks hold different steps for a table."""
    gathered: List[Optional[dict]] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, {k: int(v[0]) for k, v in steps.items()}, group=process_group)
    seen: Dict[str, Tuple[int, int]] = {}
    for rank, mine in enumerate(gathered):
        for k, v in sorted(mine.items()):
            if k in seen and seen[k][1] != v:
                raise CheckpointError(
                    f"fxrec.checkpoint.save: ranks {seen[k][0]} and {rank} hold the fused optimizer step counts "
                    f"{seen[k][1]} and {v} for table '{k.split(FUSED_TAG)[0]}'; nothing was written")
            seen.setdefault(k, (rank, v))


def split_states(states: Dict[str, torch.Tensor], layout: dict,
                  module: torch.nn.Module) -> Tuple[dict, Dict[str, torch.Tensor], dict]:
    """(layout of the states of sharded tables, cut as their tables' rows (and columns); those
    states by entry; the states of whole tables, by entry). A state is per-row where it is
    narrower than this rank's part of its table (on a column shard an element-wise state is as
    wide as the shard, not the table)."""
    state_layout, sharded, whole = {}, {}, {}
    for key, t in states.items():
        fqn = key.split(FUSED_TAG)[0]
        if fqn not in layout:
            whole[key] = t
            continue
        dim, local = layout[fqn][0][1], module.get_parameter(fqn).shape[1]
        state_layout[key] = _state_cut(fqn, layout, per_row=t.shape[1] != local or dim == 1)
        sharded[key] = t
    return state_layout, sharded, whole


def other_states(expected, md) -> Dict[str, Tuple[List[str], List[str]]]:
    """Tables with fused states here and in the checkpoint where the checkpoint has one the model's
    optimizer does not keep, or one of another shape (another fused optimizer saved them: row-wise
    Adagrad's ``[rows, 1]`` ``sum`` where Adagrad keeps ``[rows, dim]``): fqn -> (the checkpoint's
    states, the model's, each named with its shape). Fewer (no step count) is not another
    optimizer: those load."""
    def names(keys):
        out: Dict[str, set] = {}
        for k in keys:
            if FUSED_TAG in k:
                fqn, state = k.split(FUSED_TAG, 1)
                out.setdefault(fqn, set()).add(state)
        return out

    def reshaped(fqn: str, states: set) -> bool:
        for state in states:
            key = f"{fqn}{FUSED_TAG}{state}"
            shape, got = expected.get(key), getattr(md.get(key), "size", None)
            if shape is not None and got is not None and tuple(got) != tuple(shape):
                return True
        return False

    def resized(fqn: str) -> bool:  # the table itself: reported as such, its states follow it
        shape, got = expected.get(fqn), getattr(md.get(fqn), "size", None)
        return shape is not None and got is not None and tuple(got) != tuple(shape)

    def shown(fqn: str, states: set, sizes) -> List[str]:  # each state with its shape: "sum [1000, 1]"
        out = []
        for state in sorted(states):
            size = sizes(f"{fqn}{FUSED_TAG}{state}")
            out.append(f"{state} {list(size)}" if size is not None else state)
        return out

    here, there = names(expected), names(md)
    return {fqn: (shown(fqn, there[fqn], lambda k: getattr(md.get(k), "size", None)),
                  shown(fqn, states, expected.get))
            for fqn, states in here.items()
            if fqn in there and (there[fqn] - states or (reshaped(fqn, states & there[fqn]) and not resized(fqn)))}
