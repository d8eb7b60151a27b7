"""Packing: a group's per-feature inputs as one flat ``indices`` / ``offsets`` (/ weights) input,
the layout fbgemm's TBE, fxrec's gradients and the quantized lookups all read.

Features are packed feature-major: bags ``f*B .. (f+1)*B`` belong to feature f. The one packing
of the project: the group module, its kernels and the sharded lookups call these functions.
"""

from __future__ import annotations

from typing import List

import torch

from ._tracing import exporting


def pack_pooled(group, ids_list, offsets_list, psw_list, empty_means: bool = False, strict: bool = False):
    """One indices/offsets/weights input for the TBE, or None when only the loop fits.

    ``empty_means``: pack a mean over ``[B, 0]`` ids as empty bags (the kernel gives 0; the
    caller writes PyTorch's NaN into those columns) instead of returning None. ``strict``: raise,
    naming the feature, where the answer would be None for an input only PyTorch's own kernels
    reproduce (the caller has no such fallback: a fused optimizer, a quantized table).

    Features are packed feature-major: bags ``f*B .. (f+1)*B`` belong to feature f. The
    common cases (plain bags, single ids, [B, L] ids) cost a constant number of tensor ops
    for the whole group, not a few per feature.
    """
    starts: List[torch.Tensor] = []  # per feature: where each of its B bags starts
    flat_ids: List[torch.Tensor] = []
    weights: List[torch.Tensor] = []
    batch = -1
    any_weighted = any(f.weighted for f in group.features)
    for f, ids, off, psw in zip(group.features, ids_list, offsets_list, psw_list):
        if ids.dtype not in (torch.int64, torch.int32):
            group._check_ids(f, ids)  # raises, naming the feature
        dev = ids.device
        if f.form == "bag":
            flat = ids.reshape(-1)
            if off is None or off.dtype not in (torch.int64, torch.int32):
                group._check_inputs(ids_list, offsets_list)  # raises, naming the feature
            if off.dtype != torch.int64:
                off = off.long()
            if f.include_last_offset and exporting():
                # an exported program cannot drop a data-dependent number of trailing ids:
                # it asserts there are none (offsets[-1] == number of ids)
                torch._assert_async(off[-1] == flat.numel(),
                                    f"fxrec: offsets[-1] of feature '{f.name}' must equal its number of ids")
                off = torch.cat([off[:-1], off.new_full((1,), flat.numel())])
            if f.include_last_offset or f.padding_idx is not None:
                last = int(off[-1]) if f.include_last_offset and not exporting() and off.numel() else None
                if last is not None and last > flat.numel():
                    raise ValueError(
                        f"fxrec: offsets of feature '{f.name}' (table '{group.tables[f.table].name}') end "
                        f"at {last}, past its {flat.numel()} ids"
                    )
                if last is not None and last < flat.numel() and group.pooling == "mean":
                    # PyTorch sums the last bag up to offsets[-1] but divides it by the number of
                    # ids to the end of the tensor (and its backward gives those ids gradients)
                    if strict:
                        raise ValueError(
                            f"fxrec: feature '{f.name}' (table '{group.tables[f.table].name}') has "
                            f"{flat.numel() - last} ids after offsets[-1] = {last} with include_last_offset=True "
                            "and mean pooling, where PyTorch's mean divides the last bag by the ids up to the "
                            "end of the tensor; fused optimizers and quantized tables do not reproduce that: "
                            "pass only the ids up to offsets[-1]")
                    return None
                if not f.include_last_offset:
                    off = torch.cat([off, off.new_full((1,), flat.numel())])
                elif (f.padding_idx is not None or exporting()) and off.numel():
                    # as PyTorch does: with a padding_idx the last bag runs to the end of the ids
                    off = torch.cat([off[:-1], off.new_full((1,), flat.numel())])
                else:
                    flat = flat[: int(off[-1])] if off.numel() else flat[:0]
                if f.padding_idx is not None:
                    if not exporting() and bool((off > flat.numel()).any()):
                        group._check_offsets(f, flat, off)  # raises, naming the feature
                    keep = flat != f.padding_idx
                    kept_before = torch.cat([keep.new_zeros(1, dtype=torch.long), keep.long().cumsum(0)])
                    off = kept_before[off]
                    flat = flat[keep]
                    if psw is not None:
                        psw = psw.reshape(-1)[: keep.numel()][keep]
                off = off[:-1]
            b = off.numel()
            start = off
        elif f.form == "pooled_seq":
            b, length = ids.shape
            flat = ids.reshape(-1)
            if length == 0 and group.pooling == "mean" and not empty_means:
                return None  # PyTorch's mean of no rows is NaN; only its own kernels give that
            start = (torch.arange(0, b * length, length, device=dev) if length
                     else torch.zeros(b, dtype=torch.long, device=dev))
        else:  # single
            b = ids.shape[0]
            flat = ids
            start = torch.arange(b, device=dev)
        if batch < 0:
            batch = b
        elif b != batch:
            return None  # features with different batch sizes: TBE needs one B
        flat_ids.append(flat if flat.dtype == torch.int64 else flat.long())
        starts.append(start)
        if any_weighted:
            if psw is None:
                psw = torch.ones(flat.numel(), dtype=torch.float32, device=flat.device)
            weights.append(psw.reshape(-1)[: flat.numel()].float())
    if batch <= 0:
        return None  # empty batch: PyTorch's own kernels give the exact empty result
    indices = torch.cat(flat_ids)
    bases = [0]
    for x in flat_ids[:-1]:
        bases.append(bases[-1] + x.numel())
    all_starts = torch.cat(starts)
    nfeat = len(flat_ids)
    firsts = all_starts.view(nfeat, batch)[:, 0]
    if not exporting() and bool((firsts != 0).any()):
        bad = int(torch.nonzero(firsts)[0, 0])
        f = group.features[bad]
        raise ValueError(
            f"fxrec: offsets of feature '{f.name}' (table '{group.tables[f.table].name}') must "
            f"start at 0, got {int(firsts[bad])}"
        )
    offsets = torch.empty(nfeat * batch + 1, dtype=torch.long, device=indices.device)
    base = torch.tensor(bases, dtype=torch.long, device=indices.device)
    torch.add(all_starts.view(nfeat, batch), base.unsqueeze(1), out=offsets[:-1].view(nfeat, batch))
    offsets[-1] = indices.numel()
    psw = torch.cat(weights) if any_weighted else None
    return indices, offsets, psw, batch



def pack_sequence(group, ids_list):
    """Packed nobag input: feature f gets max(counts) bags, the first counts[f] of length one."""
    counts = [ids.numel() for ids in ids_list]
    bmax = max(counts)
    dev = ids_list[0].device
    counts_t = torch.tensor(counts, device=dev)
    all_len = (torch.arange(bmax, device=dev) < counts_t.unsqueeze(1)).long().reshape(-1)
    indices = torch.cat([ids.reshape(-1).long() for ids in ids_list])
    if not exporting():
        lo, hi = torch.aminmax(indices)
        if int(lo) < 0 or int(hi) >= group._min_rows:
            for f, ids in zip(group.features, ids_list):
                group._check_ids(f, ids)
    offsets = torch.zeros(all_len.numel() + 1, dtype=torch.long, device=dev)
    torch.cumsum(all_len, 0, out=offsets[1:])
    return indices, offsets, bmax

def unpack_sequence(group, out, ids_list) -> List[torch.Tensor]:
    d = group.tables[0].dim
    return [
        part.reshape(tuple(ids.shape) + (d,))
        for part, ids in zip(torch.split(out, [ids.numel() for ids in ids_list], 0), ids_list)
    ]
