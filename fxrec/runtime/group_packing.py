"""The eager group module's entry points to the one packing (:mod:`fxrec.runtime.packing`): the same
functions, with the group's input checks around them, each error naming the feature
(:meth:`fxrec.runtime.checks.InputChecks._validate_packed`; on CUDA, and under ``sync_free``, the
checks run on the device and report later). The kernels and the quantized group call these; the
TorchScript serving modules call the packing itself, with their own checks.
"""

from __future__ import annotations

from typing import List

import torch

from ._tracing import exporting, reads_values
from .kernels.fbgemm_padding import kept_pads
from .packing import _INTS, _dtype, _no_bags, pack_bags, pack_rows, unpack_rows


def pack_pooled(group, ids_list, offsets_list, psw_list, empty_means: bool = False, strict: bool = False,
                keep_padding: bool = False):
    """:func:`pack_bags` for an eager group module, with its inputs checked (naming the feature, see
    :meth:`fxrec.runtime.checks.InputChecks._validate_packed`): ``(indices, offsets, psw, batch,
    bounds)``, or None where the group runs PyTorch's own kernels instead (an empty batch
    included). ``keep_padding``: the bags whose tables have a zero row in the group's TBE keep
    their padding ids (fbgemm_padding)."""
    if not _all_ints(ids_list, offsets_list, group._bag_features):
        for f, ids, off in zip(group.features, ids_list, offsets_list):
            if ids.dtype not in _INTS:
                group._check_ids(f, ids)  # raises, naming the feature
            if f.form == "bag" and (off is None or off.dtype not in _INTS):
                group._check_inputs(ids_list, offsets_list)  # raises, naming the feature
    batch, indices, offsets, psw, bounds, firsts = pack_bags(
        ids_list, offsets_list, psw_list, group._where, group._forms, group._pads, group._ilos,
        group.pooling == "mean", group._any_weighted, strict, empty_means, exporting(),
        kept_pads(group) if keep_padding else None)
    if _no_bags(batch, exporting()):
        return None
    if firsts is not None and reads_values(indices.device) and bool(firsts.ne(0).any()):
        i = next(i for i in group._bag_features if int(offsets_list[i][0]) != 0)
        raise ValueError("fxrec: offsets of " + group._where[i] + " must start at 0, got " + str(int(offsets_list[i][0])))
    group._validate_packed(indices, offsets, ids_list, offsets_list, psw, firsts)
    return indices, offsets, psw, batch, bounds


def _all_ints(ids_list, offsets_list, bag_features: List[int]) -> bool:
    """Whether every feature's ids, and every bag's offsets, are int64 or int32 (C-level reads)."""
    if not set(map(_dtype, ids_list)) <= _INTS:
        return False
    bags = offsets_list if len(bag_features) == len(offsets_list) else [offsets_list[i] for i in bag_features]
    try:
        return set(map(_dtype, bags)) <= _INTS
    except AttributeError:  # offsets None
        return False


def pack_sequence(group, ids_list):
    """:func:`pack_rows` for an eager group module, with its ids checked (naming the feature):
    ``(indices, offsets, bags per feature, bounds)`` (see :func:`pack_bags` for ``bounds``)."""
    indices, offsets, bmax = pack_rows(ids_list)
    bounds = [0]
    for ids in ids_list:
        bounds.append(bounds[-1] + ids.numel())
    if exporting():
        return indices, offsets, bmax, bounds
    if not reads_values(indices.device):
        group._check_on_device(indices, offsets, None, ids_list, None)
    else:
        lo, hi = torch.aminmax(indices)
        if int(lo) < 0 or int(hi) >= group._min_rows:
            for f, ids in zip(group.features, ids_list):
                group._check_ids(f, ids)
    return indices, offsets, bmax, bounds


def unpack_sequence(group, out, ids_list) -> List[torch.Tensor]:
    return unpack_rows(out, ids_list, group.dims)
