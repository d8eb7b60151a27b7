"""The input checks of a sharded group's input dists (:mod:`fxrec.runtime.sharded`,
:mod:`fxrec.runtime.sharded_sequence`): on the host, the dtypes, devices, batch sizes and
per-sample weights, each raising an error naming the feature; on the device, one flag for ids out
of their table's range and offsets that do not start at 0 or decrease (:func:`input_flag`), which
every rank learns with the counts, so that every rank stops where any one's input was rejected
(:func:`stop_if_rejected`), the rank fed it naming the feature (:func:`name_bad_input`).
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

from .collectives import all_gather_ints, usable_device


def harmless_if(flag: torch.Tensor, lengths: torch.Tensor, ids: torch.Tensor):
    """``(lengths, ids)`` as they are where ``flag`` (a device scalar, not read) is 0; else bags
    that fbgemm's bucketize takes whatever the input was: every id in the first bag, and each id
    0. The rank then sends nothing: every rank learns the flag with the counts and stops."""
    if lengths.numel() == 0:
        return lengths, ids
    stand_in = torch.zeros_like(lengths)
    stand_in[0] = ids.numel()
    ok = flag.eq(0)
    return torch.where(ok, lengths, stand_in), torch.where(ok, ids, torch.zeros_like(ids))


def input_flag(values: torch.Tensor, feature_of: torch.Tensor, rows_t: torch.Tensor,
                lengths: Optional[torch.Tensor] = None, firsts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """1 (an int64 scalar on the device, nothing read) where an id is out of its table's range, or,
    for bags, an offset does not start at 0 or decreases (also with no ids at all: bags [0, 2] of
    nothing); else 0. ``values``: the features' ids one after the other; ``feature_of``: each id's
    feature; ``rows_t``: the features' table rows, on the device."""
    flags = [((values < 0) | (values >= rows_t[feature_of])).any()] if values.numel() else []
    if lengths is not None and lengths.numel():
        flags.append((lengths < 0).any())
    if firsts is not None:
        flags.append(firsts.ne(0).any())
    if not flags:
        return torch.zeros((), dtype=torch.long, device=values.device)
    return torch.stack(flags).any().long()


def name_bad_input(values: torch.Tensor, counts: List[int], names: List[str], rows: List[int], order: List[int],
                    lengths: Optional[torch.Tensor] = None, firsts: Optional[torch.Tensor] = None,
                    tables: Optional[List[str]] = None) -> None:
    """Raise the error naming the feature (and its table) whose input :func:`input_flag` rejected
    (feature ``order[k]`` has ``counts[k]`` ids); run only once the flag is set."""
    at = 0
    for k, (i, n) in enumerate(zip(order, counts)):
        part = values[at:at + n]
        at += n
        if firsts is not None and int(firsts[k]) != 0:
            raise ValueError(f"fxrec: offsets of feature '{names[i]}' must start at 0, got {int(firsts[k])}")
        if n:
            lo, hi = (int(x) for x in torch.aminmax(part))
            if lo < 0 or hi >= rows[i]:
                table = f"table '{tables[i]}', which has" if tables else "a table of"
                raise IndexError(f"fxrec: feature '{names[i]}' looks up id {lo if lo < 0 else hi} in {table} "
                                 f"{rows[i]} rows (valid ids: 0..{rows[i] - 1})")
    bad = (lengths.view(len(order), -1) < 0).any(1).tolist() if lengths is not None else [False]
    k = bad.index(True) if True in bad else 0
    raise ValueError(f"fxrec: offsets of feature '{names[order[k]]}' decrease or run past its {counts[k]} ids "
                     "(offsets must start at 0, never decrease and end at most at the number of ids)")


def stop_if_rejected(flags: List[int], name: str, rank: int, name_mine) -> None:
    """Every rank stops where any rank's input check failed (``flags``: each rank's
    :func:`input_flag`, or :func:`refuse_with_the_others`'s, exchanged with the counts): the rank
    fed the input raises the error naming its feature (``name_mine``), the others say which rank
    it was, instead of waiting for it in the next collective until the timeout."""
    bad = [r for r, f in enumerate(flags) if f]
    if not bad:
        return
    if rank in bad:
        name_mine()
    raise ValueError(f"fxrec: {name}: rank(s) {bad} were fed input they reject (their error names the "
                     "feature); this rank stops too")


_INTS = (torch.int64, torch.int32)


def check_input_dtypes(ids_list, offsets_list, psw_list, names: List[str], order: List[int],
                        psw_dtype: torch.dtype = torch.float32) -> None:
    """Ids and offsets of int64 or int32, as nn.Embedding and nn.EmbeddingBag take, and per-sample
    weights of ``psw_dtype``, the sharded tables' dtype in the model (float32, or float16 for the
    model's fp16 tables), as nn.EmbeddingBag wants its weight's (packing casts ids to int64 and
    weights to float32, so a float id would be truncated, not refused): else a TypeError naming
    the feature."""
    for i in order:
        ids, off = ids_list[i], offsets_list[i]
        if ids.dtype not in _INTS:
            raise TypeError(f"fxrec: feature '{names[i]}' got ids of dtype {ids.dtype}; embedding ids must be int64 "
                            "or int32 (cast them with .long() in the model)")
        if off is not None and off.dtype not in _INTS:
            raise TypeError(f"fxrec: feature '{names[i]}' got offsets of dtype {off.dtype}; offsets must be int64 "
                            "or int32")
        psw = psw_list[i]
        if psw is not None and psw.dtype != psw_dtype:
            raise TypeError(f"fxrec: feature '{names[i]}' got per-sample weights of dtype {psw.dtype}; they must be "
                            f"{psw_dtype}, the dtype of its table")


def check_input_devices(module: nn.Module, tensor_lists, names: List[str]) -> None:
    """Every id, offset and per-sample weight of an input dist on one device: under NCCL this rank's
    current GPU (its collectives exchange there), else the first ids' device. Else a ValueError
    naming the feature, raised before the exchange with the other host checks."""
    want = module.__dict__.get("_nccl_device")
    if want is None:  # (the process group's backend, read once)
        nccl = dist.is_initialized() and str(dist.get_backend()) == "nccl"
        want = module._nccl_device = torch.device("cuda", torch.cuda.current_device()) if nccl else False
    target = want or tensor_lists[0][0].device
    if {t.device for ts in tensor_lists for t in ts if t is not None} == {target} and target.type != "meta":
        return
    if target.type == "meta":
        raise ValueError(f"fxrec: feature '{names[0]}' got ids on meta, which hold no values to look up")
    for what, tensors in zip(("ids", "offsets", "per-sample weights"), tensor_lists):
        for name, t in zip(names, tensors):
            if t is not None and t.device != target:
                where = "this rank's GPU, where NCCL exchanges" if want else f"where feature '{names[0]}' has its ids"
                raise ValueError(f"fxrec: feature '{name}' got {what} on {t.device}; a sharded group takes every "
                                 f"input on {target} ({where})")


def refuse_with_the_others(error: BaseException, width: int, flag_at: int, device: torch.device, name: str,
                           rank: int) -> None:
    """A rank whose input a check on the host refused (``error``, raised before the exchange):
    it joins the exchange of the counts (``width`` ints, its flag at ``flag_at``, the rest 0; an
    input dist's :meth:`~PooledInputDist.exchange_shape`) and raises ``error``; every other rank
    learns the flag there and stops too, as for a check on the device, instead of waiting for this
    rank until the timeout. Also what the model's input guards do in a sharded model, at the
    first input dist's exchange (:class:`~fxrec.runtime.input_guards.InputGuards`)."""
    row = [0] * width
    row[flag_at] = 1
    info = all_gather_ints(row, usable_device(device), f"{name} (counts)")

    def mine():
        raise error

    stop_if_rejected([r[flag_at] for r in info], name, rank, mine)


def check_sample_weights(psw_list, names: List[str], order: List[int]) -> None:
    if torch.is_grad_enabled():
        for i in order:
            if psw_list[i] is not None and psw_list[i].requires_grad:
                raise ValueError(f"fxrec: feature '{names[i]}' has per-sample weights that need a gradient; "
                                 "sharded tables take fixed weights only for now (plan the table data_parallel)")


def check_batch(batches: List[int], where: str) -> int:
    if len(set(batches)) != 1:
        raise ValueError(
            f"fxrec: {where}: the ranks fed local batches of different sizes {batches}; a sharded model "
            "needs the same batch size on every rank (pad the last batch, or drop it)"
        )
    return batches[0]
