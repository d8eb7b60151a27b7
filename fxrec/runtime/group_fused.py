"""The group module's fused optimizer: its learning rate, its states and step count as the
kernel keeps them, and the checks that refuse a training call whose fused update would not be
what the model asks for (a mixin of :class:`~fxrec.runtime.group.EmbeddingGroup`; the update
itself is the kernel's).
"""

from __future__ import annotations

import dataclasses
from operator import attrgetter
from typing import List, Optional, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from .specs import FUSED_STATE_NAMES, STEPPED


_is_leaf = attrgetter("is_leaf")
_LOWER = (torch.float16, torch.bfloat16)
_PARAMETER = {torch.nn.Parameter}


def _syncs_any(ddp, params) -> bool:
    """Whether DDP ``ddp`` averages the gradient of any of ``params`` (the tables it ignores, and those
    of modules it was told to leave, as fxrec's sharded models do, it does not)."""
    params_now = getattr(ddp, "_module_parameters", ())
    kept = ddp.__dict__.get("_fxrec_synced")
    if kept is None or kept[0] is not params_now:  # (once per DDP and list of its parameters)
        kept = ddp.__dict__["_fxrec_synced"] = (params_now, {id(p) for p in params_now})
    return any(id(p) in kept[1] for p in params)


class FusedUpdates:
    """Mixed into :class:`~fxrec.runtime.group.EmbeddingGroup` (uses its ``fused``, ``tables``,
    ``_bound``)."""

    @property
    def fused_active(self) -> bool:
        """Training updates the tables inside backward (no gradients reach the parameters)."""
        return self.fused is not None and self.fused_enabled

    def set_learning_rate(self, lr: float) -> None:
        """Learning rate of the fused optimizer (from the next backward on)."""
        if self.fused is None:
            raise RuntimeError(f"fxrec: tables {[t.name for t in self.tables]} have no fused optimizer")
        if lr != self.fused.lr:
            self.fused = dataclasses.replace(self.fused, lr=float(lr))
            if self._bound is not None and self._bound.optimizer != "none":
                self._bound.tbe.set_learning_rate(float(lr))

    def optimizer_states(self, params: Sequence[torch.Tensor]) -> List[dict]:
        """Per table, the fused optimizer's state tensors by name (views: writes go to the kernel)."""
        names = FUSED_STATE_NAMES[self.fused.kind] if self.fused is not None else ()
        if not names:
            return [{} for _ in self.tables]
        from .kernels.fbgemm_bind import ensure_bound
        from .kernels.fbgemm_states import split_states

        states = split_states(self, ensure_bound(self, params))
        # a padded table's element-wise state: the view of its real rows and columns, as its weight
        # (its TBE may hold an extra row, fxrec.runtime.kernels.fbgemm_padding)
        return [dict(zip(names, [s[: t.num_rows, : t.dim] if s.dim() == 2 else s[: t.num_rows] for s in per_table]))
                for t, per_table in zip(self.tables, states)]

    def fused_step(self, params: Sequence[torch.Tensor]) -> Optional[int]:
        """The step count of a fused optimizer that keeps one (Adam: fbgemm's ``iter``), else None."""
        if self.fused is None or self.fused.kind not in STEPPED:
            return None
        from .kernels.fbgemm_bind import ensure_bound
        from .kernels.fbgemm_states import group_step

        return group_step(self, ensure_bound(self, params))

    def set_fused_step(self, params: Sequence[torch.Tensor], step: int) -> None:
        if self.fused is None or self.fused.kind not in STEPPED:
            raise RuntimeError(f"fxrec: tables {[t.name for t in self.tables]} have no fused optimizer with a step count")
        from .kernels.fbgemm_bind import ensure_bound
        from .kernels.fbgemm_states import set_group_step

        set_group_step(self, ensure_bound(self, params), step)

    def fused_unusable(self, why: str):
        raise RuntimeError(
            f"fxrec: tables {[t.name for t in self.tables]} train with a fused optimizer, but {why}; "
            "transform without optimizer= to use torch.optim instead"
        )

    def _check_fused(self, params) -> None:
        """Refuses a training call whose fused update would not be what the model asks for."""
        if not all(map(_is_leaf, params)):
            computed = [t.name for t, p in zip(self.tables, params) if not p.is_leaf]
            self.fused_unusable(f"tables {computed} are computed (a parametrization registered on them?), and a fused "
                                "update would change the computed values, not the parameters they come from")
        # (every one exactly a Parameter, read by a C-level map; else Parameter's isinstance, a Python
        # __instancecheck__ per table, which also takes subclasses and tensors marked _is_param)
        if not (set(map(type, params)) <= _PARAMETER or all(isinstance(p, torch.nn.Parameter) for p in params)):
            self.fused_unusable("it is given tensors that are not the model's parameters "
                                "(torch.func.functional_call?): the fused update would write them in place, and the "
                                "model's optimizer state would move. For their gradients, call it under a torch.func "
                                "transform (torch.func.grad), which fuses nothing")
        if params and params[0].dtype in _LOWER and not self.half and not self.weights:
            self.fused_unusable(
                f"they are now {params[0].dtype} (a .half() / .to() after transform?), and fxrec fuses no optimizer "
                "into such tables: its update of fp16 rows rounds otherwise than torch.optim's. Transform the "
                "converted model, or keep the tables float32 (weights_precision='fp16' stores them in fp16)")
        ddp = DistributedDataParallel._active_ddp_module  # (set in a DDP's forward, also replicate()'s)
        if ddp is not None and ddp.process_group.size() > 1 and _syncs_any(ddp, params):
            self.fused_unusable(
                f"the model runs in DistributedDataParallel over {ddp.process_group.size()} ranks, which averages "
                "gradients, and a fused optimizer leaves these tables none: each rank would update its own copy "
                "from its own batch, and the copies would drift apart. To train tables over ranks, transform with "
                "plan= (fxrec.plan: fxrec shards or replicates them and keeps them in step) and without DDP")
