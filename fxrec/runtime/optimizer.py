"""One optimizer for a transformed model: dense parameters, fallback tables, fused tables.

``CombinedOptimizer`` is a ``torch.optim.Optimizer`` so that ``torch.optim.lr_scheduler`` works
on it. Its ``param_groups`` are the dense optimizer's groups, then one group per table
optimizer of the model (each distinct optimizer given to ``transform`` for tables, in the order
of the tables it first serves): the same groups, in the same order, on every rank of a sharded
model and under any plan, device or world size, so a scheduler's state (its per-group lists,
``base_lrs``) resumes onto the groups it was saved from. A table optimizer's group drives the
tables it serves however they train here: the torch.optim fallback of tables it does not fuse
(the group is that optimizer's own, so it carries its hyperparameters and ``params``) and the
fused TBEs of the tables it fuses (updated inside backward; changing the group's ``"lr"``, by hand
or by a scheduler, reaches their kernels at the next forward). A group of a table optimizer
this rank holds no tables of has no ``params``.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .group import EmbeddingGroup

#: Keys fxrec adds to a table optimizer's param group (not hyperparameters).
UNIT_KEYS = ("params", "tables", "fxrec_fused")


class Unit:
    """One table optimizer of the model on this rank: its param group (``group``: the fallback
    optimizer's own dict where this rank has tables it does not fuse, else one of its own), the
    index of that fallback in ``CombinedOptimizer.fallbacks`` (or None), and those of its fused
    groups in ``CombinedOptimizer.fused``."""

    def __init__(self, name: str, lr: float, fallback: Optional[int], fused: Sequence[int],
                 fallback_tables: Sequence[str] = (), order: int = 0):
        self.name, self.fallback, self.fused = name, fallback, list(fused)
        # the tables its fallback steps, and where the first of them is in the model's table order
        # (how the fallbacks were ordered before they were saved by their tables)
        self.fallback_tables, self.order = list(fallback_tables), order
        self.group: dict = {"params": [], "lr": float(lr)}


class FollowLearningRate:
    """Forward pre-hook of a fused group: its learning rate follows its table optimizer's param
    group (schedulers set ``"lr"`` there). A link to one optimizer: a copy or a pickled group does
    not carry it (see ``EmbeddingGroup.__getstate__``) and keeps the learning rate it had."""

    fxrec_optimizer_link = True

    def __init__(self, unit: Unit):
        self.unit = unit

    def __call__(self, module, args) -> None:
        module.set_learning_rate(self.unit.group["lr"])


def fused_hyperparameters(group: dict) -> dict:
    """A table optimizer's group's hyperparameters (``lr``, and what schedulers add:
    ``initial_lr``), without its parameters and fxrec's own keys."""
    return {k: v for k, v in group.items() if k not in UNIT_KEYS}


class CombinedOptimizer(torch.optim.Optimizer):
    def __init__(
        self,
        dense: Optional[torch.optim.Optimizer],
        fallbacks: Sequence[torch.optim.Optimizer],
        fused: Sequence[Tuple[str, EmbeddingGroup, List[torch.nn.Parameter], List[str]]],
        units: Optional[Sequence[Unit]] = None,
    ):
        # torch.optim.Optimizer.__init__ sets up the hook tables that step() wrappers and
        # schedulers use; the real groups are the sub-optimizers' own dicts, shared below.
        super().__init__([torch.zeros(0, requires_grad=True)], {})
        self.dense = dense
        self.fallbacks = list(fallbacks)
        self.fused = list(fused)
        if units is None:  # one unit per fallback and per fused group, in that order
            units = [Unit(f"fallback {i}", o.param_groups[0]["lr"], i, [], order=i) for i, o in enumerate(self.fallbacks)]
            units += [Unit(name, mod.fused.lr, None, [i]) for i, (name, mod, _, _) in enumerate(self.fused)]
        self.units = list(units)
        for unit in self.units:
            for i in unit.fused:
                _, mod, _, _ = self.fused[i]
                old = getattr(mod, "_fxrec_lr_hook", None)
                if old is not None:
                    old.remove()
                mod._fxrec_lr_hook = mod.register_forward_pre_hook(FollowLearningRate(unit))
        self._collect_groups()
        self.state = {}

    def __getstate__(self):
        # (torch.optim.Optimizer keeps only defaults, state and param_groups: a copy, or a pickle,
        # of this one lost its dense and fallback optimizers and fused groups, and failed at its
        # first step. Copied with the model, as ``copy.deepcopy((model, opt))`` or one
        # ``torch.save`` of both, it steps the copied model's tables.)
        return self.__dict__.copy()

    @property
    def fused_groups(self) -> List[dict]:
        """The param groups of the table optimizers that fuse tables on this rank."""
        return [u.group for u in self.units if u.fused]

    def _collect_groups(self) -> None:
        # The sub-optimizers' own dicts, so a scheduler's change of "lr" is what they use.
        # (torch.optim.Optimizer.load_state_dict replaces those dicts: collected again there.)
        for unit in self.units:
            if unit.fallback is not None:
                unit.group = self.fallbacks[unit.fallback].param_groups[0]
            else:
                unit.group["params"] = [p for i in unit.fused for p in self.fused[i][2]]
            unit.group["fxrec_fused"] = unit.name
            unit.group["tables"] = [f for i in unit.fused for f in self.fused[i][3]]
        self.param_groups = (list(self.dense.param_groups) if self.dense is not None else []) + [
            u.group for u in self.units]

    def _sync_fused_lr(self) -> None:
        for unit in self.units:
            for i in unit.fused:
                self.fused[i][1].set_learning_rate(unit.group["lr"])

    def _unit_of(self) -> Dict[str, Unit]:
        """Each fused group's (by name) table optimizer."""
        return {self.fused[i][0]: unit for unit in self.units for i in unit.fused}

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.dense is not None:
            self.dense.step()
        for o in self.fallbacks:
            o.step()
        self._sync_fused_lr()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.dense is not None:
            self.dense.zero_grad(set_to_none=set_to_none)
        for o in self.fallbacks:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict:
        fused_state = {}
        for name, mod, params, names in self.fused:
            for fqn, states in zip(names, mod.optimizer_states(params)):
                for k, v in states.items():
                    fused_state[f"{fqn}.{k}"] = v.detach().clone()
        return {
            "dense": self.dense.state_dict() if self.dense is not None else None,
            "fallback": [o.state_dict() for o in self.fallbacks],
            # the tables each steps: a load matches them by these, not by position
            "fallback_tables": [self._fallback_unit(i).fallback_tables for i in range(len(self.fallbacks))],
            "fused": fused_state,
            "fused_lr": {name: unit.group["lr"] for name, unit in self._unit_of().items()},
            # every other hyperparameter of the fused groups' table optimizers (a scheduler's initial_lr)
            "fused_groups": {name: fused_hyperparameters(unit.group) for name, unit in self._unit_of().items()},
            "fused_step": self.fused_steps(),
        }

    def fused_steps(self) -> Dict[str, int]:
        """The step count of each fused group whose optimizer keeps one (Adam), by group name."""
        steps = {}
        for name, mod, params, _ in self.fused:
            step = mod.fused_step(params)
            if step is not None:
                steps[name] = step
        return steps

    def set_fused_steps(self, steps: Dict[str, int], only_given: bool = False) -> None:
        """Set the step counts of the fused groups that keep one; a missing one is an error
        unless ``only_given``."""
        for name, mod, params, _ in self.fused:
            if mod.fused_step(params) is not None:
                if name not in steps and only_given:
                    continue
                if name not in steps:
                    raise KeyError(f"fxrec: the step count of fused group '{name}' is missing from the checkpoint")
                mod.set_fused_step(params, int(steps[name]))

    def load_state_dict(self, state_dict: Dict) -> None:
        if (state_dict.get("dense") is None) != (self.dense is None) or len(state_dict["fallback"]) != len(self.fallbacks):
            raise ValueError("fxrec: this optimizer state was saved from an optimizer of another shape")
        saved = state_dict["fused"]
        fused = [(f"{fqn}.{k}", v) for _, mod, params, names in self.fused
                 for fqn, states in zip(names, mod.optimizer_states(params)) for k, v in states.items()]
        for key, v in fused:  # all checked before anything is loaded
            if key not in saved:
                raise KeyError(f"fxrec: optimizer state '{key}' is missing from the checkpoint")
            if tuple(saved[key].shape) != tuple(v.shape):  # e.g. a partial row-wise Adam's [rows]
                raise ValueError(f"fxrec: optimizer state '{key}' is {tuple(saved[key].shape)} in the state dict and "
                                 f"{tuple(v.shape)} here (another fused optimizer's?); nothing was loaded")
        order = self._saved_fallback_order(state_dict)
        if self.dense is not None:
            self.dense.load_state_dict(state_dict["dense"])
        for i, sd in zip(order, state_dict["fallback"]):
            self.fallbacks[i].load_state_dict(sd)
        self._collect_groups()
        with torch.no_grad():
            for key, v in fused:
                v.copy_(saved[key])
        self.set_fused_steps(state_dict.get("fused_step", {}), only_given=True)
        for name, unit in self._unit_of().items():
            unit.group.update(state_dict.get("fused_groups", {}).get(name, {}))
            if name in state_dict.get("fused_lr", {}):
                unit.group["lr"] = state_dict["fused_lr"][name]
        self._sync_fused_lr()

    def _fallback_unit(self, i: int) -> Unit:
        return next(u for u in self.units if u.fallback == i)

    def _saved_fallback_order(self, state_dict: Dict) -> List[int]:
        """Which of this optimizer's fallbacks each saved one is: by the tables it steps, or, in a
        state saved before those were recorded, in the order of each one's first table."""
        saved = state_dict.get("fallback_tables")
        if saved is None or not any(saved):
            return [u.fallback for u in sorted((u for u in self.units if u.fallback is not None), key=lambda u: u.order)]
        mine = {tuple(u.fallback_tables): u.fallback for u in self.units if u.fallback is not None}
        order = [mine.get(tuple(tables)) for tables in saved]
        if None in order or sorted(order) != list(range(len(self.fallbacks))):
            raise ValueError(f"fxrec: this optimizer state was saved with torch.optim fallbacks stepping the tables "
                             f"{saved}, and this optimizer's step {[u.fallback_tables for u in self.units if u.fallback is not None]}"
                             "; nothing was loaded")
        return order

    def add_param_group(self, param_group: dict) -> None:
        """Into the dense optimizer (its step and zero_grad are this one's): torch.optim's
        ``add_param_group`` on this optimizer's list would add a group nothing steps."""
        if not hasattr(self, "units"):  # (torch.optim.Optimizer.__init__'s own call)
            return super().add_param_group(param_group)
        if self.dense is None:
            raise ValueError("fxrec: this optimizer has no dense optimizer to add a param group to (the model had no "
                             "dense parameters when make_optimizer made it): make another optimizer for the new "
                             "parameters")
        self.dense.add_param_group(param_group)
        self._collect_groups()

    def __repr__(self) -> str:
        parts = [f"dense: {type(self.dense).__name__ if self.dense is not None else None}"]
        parts += [f"fallback: {type(o).__name__} ({sum(len(g['params']) for g in o.param_groups)} tables)" for o in self.fallbacks]
        parts += [f"fused {m.fused.kind} in {n}: {len(p)} tables" for n, m, p, _ in self.fused]
        return "CombinedOptimizer(" + "; ".join(parts) + ")"
