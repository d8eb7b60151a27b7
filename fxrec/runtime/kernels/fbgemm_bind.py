"""The group's binding to fbgemm's training TBE: the group's weight parameters become views into
the TBE's flat weight buffer (:func:`ensure_bound`), so the kernel reads the user's weights and an
optimizer step or ``load_state_dict`` on them is what it sees next. Bound again whenever a
parameter no longer aliases the TBE; the fused states travel with the rows (:mod:`.fbgemm_states`).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import nn

from ..device_ints import refuse_in_capture
from ..specs import DIM_ALIGNMENT, STEPPED, stored_widths, table_dtype, weights_dtype
from . import FBGEMM
from .fbgemm_padding import zero_row_tables
from .fbgemm_states import moment_shapes, park, parks, set_tbe_step, tbe_step
from .fbgemm_tbe import fbgemm_available, make_training_tbe


class Bound:
    """fbgemm TBE whose flat weight buffer the group's parameters are views of."""

    def __init__(self, tbe: nn.Module, ptrs: List[int], optimizer: str, zero_rows: List[torch.Tensor],
                 parked: bool = False):
        self.tbe, self.ptrs, self.optimizer = tbe, ptrs, optimizer
        self.zero_rows = zero_rows  # the extra rows padding ids are sent to (zero_row_tables)
        self.parked = parked  # the fused states are on the group, not in this TBE (fbgemm_states)


def tbe_optimizer(group) -> str:
    """What the group's TBE is built with: the fused optimizer where fbgemm applies it or keeps
    its states (the Adagrads on any kernel), else "none" (forward only)."""
    f = group.fused
    if f is not None and (group.kernel_train == FBGEMM or f.kind != "sgd"):
        return f.kind
    return "none"


def usable(params: Sequence[torch.Tensor], group=None) -> bool:
    """Whether fbgemm can hold ``params``: of the dtype the group's tables were captured in (fp32 or
    fp16), or fp32 ones as ``group``'s weights_precision stores them. (fp32 parameters of fp16
    tables, after a ``.float()``, are not: the TBE would round them.)"""
    if not fbgemm_available() or not params:
        return False
    dev = params[0].device
    ok = (table_dtype(group) if group is not None else torch.float32, stored_dtype(group))
    return all(p.dtype in ok and p.device == dev and p.dim() == 2 for p in params)


def stored_dtype(group) -> torch.dtype:
    """The dtype of the group's rows in its TBE (and so of its parameters once bound): the
    weights_precision= one, else the tables' own (fp32, or fp16 in the user's model)."""
    if group is None:
        return torch.float32
    return weights_dtype(group.weights) or table_dtype(group)


def bound_tbe(group, params: Sequence[torch.Tensor]) -> Optional[nn.Module]:
    """The group's TBE while ``params`` are still its views (then fbgemm holds them), else None."""
    b = getattr(group, "_bound", None)
    return b.tbe if b is not None and b.ptrs == list(map(torch.Tensor.data_ptr, params)) else None


def ensure_bound(group, params: Sequence[torch.Tensor], device: Optional[torch.device] = None) -> nn.Module:
    """The group's TBE, bound to ``params`` (on their device; ``device``: on that one, the
    parameters then views of the TBE there)."""
    tbe = bound_tbe(group, params)
    if tbe is not None and (device is None or params[0].device == device):
        return tbe
    refuse_in_capture(group, params[0].device if device is None else device,
                      "its tables are bound into fbgemm's TBE there")
    with torch.inference_mode(False):  # (a first call under it would make the tables inference tensors)
        return _bind(group, params, device).tbe


def _bind(group, params: Sequence[torch.Tensor], device: Optional[torch.device] = None) -> Bound:
    """Move the group's weights into one fbgemm TBE and make the parameters views of it
    (``device``: a TBE on that device, the rows copied there from where they are: to CUDA, tables
    placed in unified memory go there without passing through GPU memory).

    Called on first use and again whenever a parameter no longer aliases the TBE (after
    ``.to(device)``, ``deepcopy``, or a ``param.data = ...`` by the user), so the kernel can
    never read stale weights. The old storage is freed as the parameters move (no second copy
    is kept).
    """
    for t, p in zip(group.tables, params):
        if tuple(p.shape) != (t.num_rows, t.dim):
            raise ValueError(
                f"fxrec: weight of table '{t.name}' has shape {tuple(p.shape)}, expected "
                f"({t.num_rows}, {t.dim}) as when the model was transformed"
            )
    device = params[0].device if device is None else device
    opt = tbe_optimizer(group)
    parked = parks(opt, device)  # a forward-only TBE; the states wait on the group
    fused = group.fused if opt != "none" and not parked else None
    extra = zero_row_tables(group)
    # an empty table (a row-wise piece of a table with fewer rows than ranks) is stored with one
    # zero row no id reaches: fbgemm's CPU TBE updates wrong rows of the tables after a 0-row one,
    # and fails on a TBE of 0-row tables alone (found by a sharded run at world size 2)
    rows_dims = [(max(t.num_rows + e, 1), d) for t, e, d in zip(group.tables, extra, tbe_dims(group))]
    tbe = make_training_tbe(
        rows_dims,
        [f.table for f in group.features],
        group.pooling, device, fused, [t.placement for t in group.tables],
        getattr(group, "cache_load_factor", 0.2), group.weights or ("fp16" if group.half else ""), group.half,
    )
    views = tbe.split_embedding_weights()
    old = group._bound
    same = old is not None and not old.parked and opt != "none" and old.optimizer == opt
    old_states = old.tbe.split_optimizer_states() if same else group._carry_states
    if old_states and any(s.is_meta for states in old_states for s in states):
        # from meta (to_empty of a model loaded there): no values to carry; the states start as
        # fbgemm makes them, as a new optimizer's do (opt.load_state_dict brings saved ones)
        old_states, step = None, (0 if opt in STEPPED else None)
    else:
        step = (tbe_step(old.tbe) if same else getattr(group, "_carry_step", 0)) if opt in STEPPED else None
    zero_rows = []
    with torch.no_grad():
        for t, p, v, e in zip(group.tables, params, views, extra):
            if e:
                zero_rows.append(v[t.num_rows:])
            if p.device != v.device and tuple(v.shape) != (t.num_rows, t.dim) and v.is_contiguous():
                # rows from another device into a padded slot: padded on the host first, then one
                # contiguous copy (a copy into the slot's strided view would stage the whole table
                # in GPU memory, which tables placed in unified memory must never pass through)
                src = torch.zeros(v.shape, dtype=v.dtype, device=p.device)
                src[: t.num_rows, : t.dim].copy_(p.detach())
                v.copy_(src)
                del src
                p.data = v[: t.num_rows, : t.dim]
                continue
            if v.shape[0] != t.num_rows:
                v[t.num_rows:].zero_()
                v = v[: t.num_rows]
            if v.shape[1] != t.dim:
                v[:, t.dim:].zero_()
                v = v[:, : t.dim]
            v.copy_(p.detach())
            p.data = v
        if fused and old_states:
            for new_t, old_t in zip(tbe.split_optimizer_states(), old_states):
                for n, o in zip(new_t, old_t):
                    rows = min(n.shape[0], o.shape[0])  # an extra zero row's state need not travel
                    n[:rows].copy_(o[:rows])
        if parked:
            park(group, old_states, step, moment_shapes(opt, rows_dims), device)
        elif step:
            set_tbe_step(tbe, step)
    if not parked:
        group._carry_states = None
        group._carry_step = 0
    group._bound = Bound(tbe, [p.data_ptr() for p in params], "none" if parked else opt, zero_rows, parked)
    return group._bound


def tbe_dims(group) -> List[int]:
    """Per table, the width it is stored with in the group's (or GroupSpec's) training TBE."""
    return stored_widths(group.tables, group.pooling, [DIM_ALIGNMENT] * len(group.tables))
