"""A fused optimizer's states and step count, where they live: in the group's fbgemm TBE, or
parked beside it when the tables are on a device whose fbgemm cannot run that optimizer.

fbgemm's Adam, LAMB, their partial row-wise forms and LARS-SGD (``fxrec.optim.LazyAdam``, ``LazyLamb``,
``PartialRowWiseAdam``, ``PartialRowWiseLamb``, ``LarsSGD``) run on CUDA only. A group trained with one and then moved to the CPU (to evaluate, to save) binds a
forward-only TBE there and keeps the moments (LARS-SGD: the momentum) and the step count on the group, on the tables' device (``group._carry_states``,
``group._carry_step``): the checkpoint and ``state_dict`` read and write them as ever, a training
step on that device is an error naming the tables, and the next binding on CUDA takes them into
its TBE.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

from ..specs import CUDA_ONLY


def tbe_step(tbe) -> int:
    """A fused Adam's step count: fbgemm's ``iter`` (reads a device value)."""
    return int(tbe.iter.item())


def set_tbe_step(tbe, step: int) -> None:
    """``iter`` and the host copy fbgemm's forward counts with (it reads ``iter`` only while 0).
    The copy is made outside inference mode: fbgemm adds to it in place at each forward, which
    torch refuses on an inference tensor outside inference mode (a checkpoint loaded under it)."""
    tbe.iter.fill_(int(step))
    with torch.inference_mode(False):
        tbe.iter_cpu = torch.full((1,), int(step), dtype=torch.int64)


def count_tbe_step(tbe) -> None:
    """Count one training step that did not reach fbgemm's forward (no ids, empty batch), as its
    forward would have: the group's count stays one per step, the same on every rank. Reads the
    device only while the host copy is 0 (the first count after a bind), as fbgemm does."""
    with torch.inference_mode(False):  # (its host copy no inference tensor: see set_tbe_step)
        if int(tbe.iter_cpu.item()) == 0:  # the host copy: fbgemm takes ``iter`` while it is 0
            tbe.iter_cpu = tbe.iter.detach().cpu().clone()
        tbe.iter_cpu.add_(1)
        tbe.iter.add_(1)


def parks(opt: str, device: torch.device) -> bool:
    """Whether a group whose TBE would run fused ``opt`` keeps its states aside on ``device``."""
    return opt in CUDA_ONLY and device.type != "cuda"


def park(group, old_states, step: int, shapes: Sequence[Sequence[tuple]], device: torch.device) -> None:
    """Keep the states (per table, as fbgemm splits them; zeros when there are none yet, of
    ``shapes``) and the step on the group, on ``device``."""
    if old_states:
        group._carry_states = [[s.detach().to(device, copy=True) for s in t] for t in old_states]
    else:
        group._carry_states = [[torch.zeros(s, dtype=torch.float32, device=device) for s in t] for t in shapes]
    group._carry_step = int(step or 0)


def moment_shapes(opt: str, rows_dims: Sequence[tuple]) -> List[List[tuple]]:
    """fbgemm's states of each table for ``opt`` (``momentum1``, ``momentum2``): each like the table
    (Adam, LAMB), or ``momentum2`` one a row (their partial row-wise forms); LARS-SGD's
    ``momentum1`` alone, like the table."""
    if opt == "lars_sgd":  # momentum1 only
        return [[(int(r), int(d))] for r, d in rows_dims]
    rowwise = opt in ("partial_rowwise_adam", "partial_rowwise_lamb")
    return [[(int(r), int(d)), (int(r),) if rowwise else (int(r), int(d))] for r, d in rows_dims]


def split_states(group, tbe) -> List[List[torch.Tensor]]:
    """Per table, the fused optimizer's state tensors, where they live."""
    if group._bound.parked:
        return group._carry_states
    return tbe.split_optimizer_states()


def group_step(group, tbe) -> int:
    return group._carry_step if group._bound.parked else tbe_step(tbe)


def set_group_step(group, tbe, step: int) -> None:
    if group._bound.parked:
        group._carry_step = int(step)
    else:
        set_tbe_step(tbe, step)
