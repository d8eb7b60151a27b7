"""Bags with a ``padding_idx`` on fbgemm's TBE without a wait for the device.

PyTorch leaves a bag's padding ids out of it. Dropping them from the packed input makes a tensor
whose size depends on the ids' values, which on CUDA waits for the device on every call. fxrec
sends them instead to one extra row at the end of their table in the TBE, kept at zero: the bag
sums the same rows, the table's own rows get no gradient from them, and a fused update of the
extra row (an inf gradient makes it inf or NaN) is undone by zeroing it before the next call
that reads it. The user's parameter is the view of the table's own rows. A mean-pooled bag's
padding ids still count in fbgemm's mean (it divides by the bag's length): its output is then
multiplied by ``length / ids that are not padding`` (:func:`mean_without_padding`), on the
device, which also gives its rows PyTorch's gradient (``grad / ids that are not padding``).
"""

from __future__ import annotations

from typing import List, Optional

import torch

from ..device_ints import consts_on


def kept_pads(group) -> List[bool]:
    """Per feature, whether its bags keep their padding ids in packing: sent to the zero row of
    their table (:func:`zero_row_tables`) instead of dropped."""
    extra = zero_row_tables(group)
    return [f.form == "bag" and f.padding_idx is not None and extra[f.table] for f in group.features]


def zero_row_tables(group) -> List[bool]:
    """Per table, whether its TBE rows end with one extra row kept at zero, where the padding ids
    of its sum-pooled bags are sent (:func:`send_padding_to_zero_rows`): the bag then sums the
    same rows as PyTorch's, which leaves those ids out, and fbgemm's fused update of that row
    touches no row of the table (mean bags: :func:`mean_without_padding` too). Dropping the ids
    instead makes a tensor of data-dependent size: a wait for the device on every call. Not for
    tables cached in HBM (the row is zeroed in their unified memory, under the cache)."""
    known = group.__dict__.get("_zero_row_tables")
    if known is not None:
        return known
    mine = [False] * len(group.tables)
    if group.pooling in ("sum", "mean"):
        for f in group.features:
            if f.form == "bag" and f.padding_idx is not None and group.tables[f.table].placement != "managed_caching":
                mine[f.table] = True
    if hasattr(group, "_bound"):  # a group module (its specs never change), not a GroupSpec
        group._zero_row_tables = mine
    return mine


def send_padding_to_zero_rows(group, indices: torch.Tensor, psw: Optional[torch.Tensor], bounds: List[int]):
    """The packed input with every padding id of a bag of a :func:`zero_row_tables` table sent to
    its table's zero row (its per-sample weight set to 0, so an inf or NaN weight stays out of
    the sum, as PyTorch leaves it out); the other ids as they were. On the device, no value
    read. ``indices`` was packed with those ids kept (``pack_pooled(..., keep_padding=True)``)."""
    extra = zero_row_tables(group)
    for i, f in enumerate(group.features):  # (in place: both are fresh tensors of the packing)
        if f.form == "bag" and f.padding_idx is not None and extra[f.table]:
            seg = indices[bounds[i]: bounds[i + 1]]
            pad = seg == f.padding_idx
            seg.masked_fill_(pad, group.tables[f.table].num_rows)
            if psw is not None:
                psw[bounds[i]: bounds[i + 1]].masked_fill_(pad, 0.0)
    return indices, psw


def keeps_padding(group, training: bool) -> bool:
    """Whether this fbgemm call of the group sends padding ids to zero rows instead of dropping
    them: in inference, fused training, and training with PyTorch's gradients (fxrec's backward
    then gives the zero row's id no gradient: grad.no_grad_ids) unless a table with a zero row
    gets sparse gradients (PyTorch's leave the padding ids out of the sparse tensor altogether,
    which a lazy optimizer can tell from a zero entry)."""
    extra = zero_row_tables(group)
    if not any(extra):
        return False
    return not training or group.fused_active or not any(t.sparse for t, e in zip(group.tables, extra) if e)


def mean_without_padding(group, indices: torch.Tensor, offsets: torch.Tensor, bounds: List[int],
                         batch: int) -> torch.Tensor:
    """``[batch, sum of dims]``: what multiplies fbgemm's mean-pooled output so each bag is the
    mean of its ids that are not padding, as PyTorch's (``indices`` with the padding ids sent to
    the zero rows: :func:`send_padding_to_zero_rows`; ``bounds``: each feature's ids in them).
    Per bag ``length / ids that are not padding`` (1 for bags without padding; a bag of padding
    alone is 0 either way, its rows being zero). A few ops for the group, on the device."""
    extra = zero_row_tables(group)
    keep = torch.ones(indices.numel(), dtype=torch.long, device=indices.device)
    for i, f in enumerate(group.features):
        if f.form == "bag" and f.padding_idx is not None and extra[f.table]:
            keep[bounds[i]: bounds[i + 1]] = indices[bounds[i]: bounds[i + 1]] != group.tables[f.table].num_rows
    before = torch.cat([keep.new_zeros(1), keep.cumsum(0)])  # ids that are not padding before each place
    kept = before[offsets[1:]] - before[offsets[:-1]]
    per_bag = offsets.diff().to(torch.float32) / kept.clamp(min=1).to(torch.float32)
    return per_bag.view(len(group.features), batch).t().index_select(1, _column_features(group, indices.device))


def _column_features(group, device: torch.device) -> torch.Tensor:
    """Per output column, its feature (made once per device: a copy the device is waited for once)."""
    return consts_on(group, "column_features", device, lambda: [i for i, d in enumerate(group.dims) for _ in range(d)])
