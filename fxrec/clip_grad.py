"""``fxrec.clip_grad_norm_``: gradient clipping by the norm the single-process model's gradients
have, also when the model is sharded over ranks.

``torch.nn.utils.clip_grad_norm_(fast.parameters(), ...)`` on a sharded model computes, on each
rank, the norm of what that rank holds: its own table shards and every whole parameter. The
ranks then clip by different factors and their copies of the whole parameters drift apart
(measured: two ranks got norms 14.0825 and 14.0857 where the plain model's is 14.0874); with
``transform(plan=..., dense="fsdp")`` it raises (FSDP's DTensors mixed with plain tensors); and a
table with sparse gradients is refused by torch's norm ("linalg_vector_norm ... SparseCPU").

Here every gradient counts once: a rank's table shards (the rows or columns only it holds) and
its chunks of FSDP's parameters are summed over ranks (one all-reduce of a scalar), the whole
parameters (the same summed gradient on every rank) are counted as they are, sparse gradients by
their coalesced values. Every rank gets the same norm and scales its gradients by the same
factor, ``max_norm / (norm + 1e-6)`` where that is below 1, as torch's does. Tables whose optimizer
is fused into backward have no gradient and take no part (as with torch's).
"""

from __future__ import annotations

import math
from typing import Iterable, List, Tuple

import torch
import torch.distributed as dist

from .pass_infra import InputError
from .runtime.collectives import _fail


def _parts(model: torch.nn.Module) -> Tuple[List[Tuple[str, torch.Tensor]], List[Tuple[str, torch.Tensor]]]:
    """``(pieces, whole)``: the gradients (name, tensor) this rank alone holds a part of (table
    shards; FSDP's chunks, as their local tensors) and those every rank holds whole."""
    meta = getattr(model, "meta", None)
    sharded = set(meta.get("fxrec_sharded_params", {})) if isinstance(meta, dict) else set()
    fsdp = set(meta.get("fxrec_fsdp_params", ())) if isinstance(meta, dict) else set()
    pieces, whole = [], []
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        if name in fsdp:
            pieces.append((name, g.to_local() if hasattr(g, "to_local") else g))
        elif name in sharded:
            pieces.append((name, g))
        else:
            whole.append((name, g))
    return pieces, whole


def _values(g: torch.Tensor) -> torch.Tensor:
    return g.coalesce().values() if g.is_sparse else g


def _norm_of(grads: Iterable[torch.Tensor], norm_type: float, device) -> torch.Tensor:
    """The sum of ``|g|**p`` over ``grads`` (``p = inf``: their largest ``|g|``), in fp32."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        v = _values(g)
        if not v.numel():
            continue
        v = v.detach().float().abs()
        total = torch.maximum(total, v.max()) if math.isinf(norm_type) else total + v.pow(norm_type).sum()
    return total


def clip_grad_norm_(model: torch.nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale the gradients of ``model``'s parameters in place so that their norm is at most
    ``max_norm``, and return that norm (before scaling), as
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` does on the single-process model.

    ``model``: a transformed model (with a plan: call it on every rank, after ``backward`` and
    before ``opt.step()``; it all-reduces one number) or any ``nn.Module``. ``norm_type``: a
    positive number or ``inf``. ``error_if_nonfinite``: raise when the norm is inf or NaN (on
    every rank, as they share it). With a plan, call it after a backward that summed the whole
    parameters' gradients over ranks (not between micro-batches with gradient sync off, whose
    whole gradients are still each rank's own).
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm >= 0:
        raise InputError(f"fxrec.clip_grad_norm_: max_norm must be a number >= 0, got {max_norm!r}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
        raise InputError(f"fxrec.clip_grad_norm_: norm_type must be a number > 0 or inf, got {norm_type!r}")
    if not isinstance(model, torch.nn.Module):
        raise InputError("fxrec.clip_grad_norm_: pass the model (its sharded tables and whole parameters count "
                         f"differently), got {type(model).__name__}")
    norm_type = float(norm_type)
    pieces, whole = _parts(model)
    grads = [g for _, g in pieces + whole]
    device = grads[0].device if grads else next((p.device for p in model.parameters()), torch.device("cpu"))
    mine = _norm_of([g for _, g in pieces], norm_type, device)
    meta = getattr(model, "meta", None)
    if isinstance(meta, dict) and (meta.get("fxrec_sharded_params") or meta.get("fxrec_fsdp_params")) \
            and dist.is_available() and dist.is_initialized():
        try:
            dist.all_reduce(mine, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
        except Exception as e:  # noqa: BLE001 - re-raised naming the step
            raise _fail("all_reduce", "fxrec.clip_grad_norm_ (the norm of the table shards)", e) from e
    same = _norm_of([g for _, g in whole], norm_type, device)
    if math.isinf(norm_type):
        total = torch.maximum(mine, same)
    else:
        total = (mine + same).pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"fxrec.clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
                           f"{float(total)}, so they cannot be clipped (error_if_nonfinite=False scales them anyway)")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:  # (a sparse gradient's values too, coalesced or not)
            g.mul_(coef.to(g.dtype))
    return total
