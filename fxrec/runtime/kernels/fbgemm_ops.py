"""fbgemm's sparse operators that fxrec calls outside a TBE: the bucketing of ids by row block
and the reordering of the bags that arrive (sharded groups, :mod:`fxrec.runtime.sharded`), and the
bounds check on the device (:mod:`fxrec.runtime.checks`)."""

from __future__ import annotations

from typing import Optional

import torch

from .fbgemm_tbe import require_fbgemm


def bucketize_rows(lengths: torch.Tensor, ids: torch.Tensor, blocks: torch.Tensor, world: int,
                   weights: Optional[torch.Tensor], sequence: bool = False):
    """fbgemm's ``block_bucketize_sparse_features`` (CPU and CUDA): bags given feature-major by ``lengths``
    ``[F * B]`` and their ``ids``, each id sent to bucket ``id // blocks[f]`` as the local row ``id - bucket *
    blocks[f]`` (ids below ``world * blocks[f]``: fbgemm hashes larger ones). Returns ``(lengths [world * F * B],
    ids, weights, where)`` by bucket, feature, bag, a bag's ids in order; ``where[i]``: where id ``i`` went
    (``sequence=True``; else None)."""
    require_fbgemm()
    new_lengths, new_ids, new_weights, _, where = torch.ops.fbgemm.block_bucketize_sparse_features(
        lengths, ids, False, sequence, blocks, world, weights)
    return new_lengths, new_ids, new_weights, where


def source_major_to_feature_major(lengths: torch.Tensor, values: torch.Tensor, weights: Optional[torch.Tensor],
                                  world: int, nfeat: int, batch: int):
    """fbgemm's ``permute_2D_sparse_data`` (CPU and CUDA): bags received as (source rank, feature,
    sample) by ``lengths`` ``[world * nfeat * batch]`` and their ``values`` (and ``weights``),
    reordered to (feature, source rank, sample). Returns ``(lengths, values, weights)``. The
    number of values is given, so nothing is read from the device."""
    require_fbgemm()
    order = torch.arange(world * nfeat, dtype=torch.int32, device=lengths.device).view(world, nfeat).t().reshape(-1)
    new_lengths, new_values, new_weights = torch.ops.fbgemm.permute_2D_sparse_data(
        order, lengths.view(world * nfeat, batch), values, weights, values.numel())
    return new_lengths.reshape(-1), new_values, new_weights


def bounds_check(rows_per_feature: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
                 counter: torch.Tensor, psw: Optional[torch.Tensor]) -> None:
    """fbgemm's ``bounds_check_indices`` in warning mode on packed input (``F * B + 1`` offsets,
    ``rows_per_feature`` [F] int64): on the input's device, without waiting, ids outside their
    feature's table become 0 and offsets out of range are fixed, in place; ``counter`` [1] int64
    is set to how many were (fbgemm zeroes it first)."""
    require_fbgemm()
    from .fbgemm_tbe import BoundsCheckMode  # (imported from fbgemm_gpu: there only when it imports)

    torch.ops.fbgemm.bounds_check_indices(rows_per_feature, indices, offsets, BoundsCheckMode.WARNING.value,
                                          counter, psw)


def bounds_checker():
    """:func:`bounds_check` with fbgemm's operator and mode looked up once (the device check calls
    it at every call of a group: no import or attribute lookups there)."""
    require_fbgemm()
    from .fbgemm_tbe import BoundsCheckMode

    op, mode = torch.ops.fbgemm.bounds_check_indices, BoundsCheckMode.WARNING.value

    def check(rows_per_feature: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
              counter: torch.Tensor, psw: Optional[torch.Tensor]) -> None:
        op(rows_per_feature, indices, offsets, mode, counter, psw)

    return check
