"""Packing: a group's per-feature inputs as one flat ``indices`` / ``offsets`` (/ weights) input,
the layout fbgemm's TBE, fxrec's gradients and the quantized lookups all read.

Features are packed feature-major: bags ``f*B .. (f+1)*B`` belong to feature f. The one packing
of the project: :func:`pack_bags` and :func:`pack_rows` are plain typed functions that
TorchScript compiles, so the eager group module (through :mod:`fxrec.runtime.group_packing`, which
adds its checks) and the TorchScript serving modules
(:mod:`fxrec.runtime.serving`) run the same code. The common cases (plain bags, single ids,
``[B, L]`` ids) cost a constant number of tensor ops for the whole group, not a few per feature.
"""

from __future__ import annotations

from itertools import accumulate
from operator import attrgetter
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .device_ints import kept_split_on

#: FeatureSpec.form as the integer the scriptable packing takes.
FORM_CODES = {"bag": 0, "pooled_seq": 1, "single": 2, "seq": 3}

#: pack_bags' batch when only PyTorch's own kernels give the answer (features with different batch
#: sizes, a mean over [B, 0] ids, include_last_offset mean with ids after offsets[-1]); written as -1
#: inside pack_bags, since TorchScript reads no module globals.
NOT_PACKABLE = -1

_INTS = frozenset((torch.int64, torch.int32))
_FLOAT32 = {torch.float32}
_FLOAT16 = {torch.float16}
_dtype = attrgetter("dtype")
_device = attrgetter("device")


def weights_elsewhere(where: str, psw: Tensor, ids: Tensor) -> str:
    """The error for per-sample weights on another device than their ids (the kernels would read a
    meta tensor's memory, or another device's, as their own)."""
    return ("fxrec: per-sample weights of " + where + " are on " + str(psw.device) + " and its ids on "
            + str(ids.device) + ": give both on the device of the tables")


def pack_bags(ids_list: List[Tensor], offsets_list: List[Optional[Tensor]], psw_list: List[Optional[Tensor]],
              where: List[str], forms: List[int], pads: List[int], ilos: List[bool], mean: bool,
              any_weighted: bool, strict: bool, empty_means: bool, tracing: bool,
              keep_pads: Optional[List[bool]] = None
              ) -> Tuple[int, Tensor, Tensor, Optional[Tensor], List[int], Optional[Tensor]]:
    """``(batch, indices, offsets, per-sample weights, bounds, firsts)`` of a pooled group's inputs;
    feature ``f``'s ids are ``indices[bounds[f]:bounds[f + 1]]`` (known on the host: no value is
    read for them); ``firsts[f]`` is where its first bag starts in its own ids (0 unless its
    offsets are wrong: the caller checks, :func:`pack_pooled`), None when ``tracing`` or where no
    feature has offsets.

    ``batch`` is :data:`NOT_PACKABLE` where only PyTorch's own kernels reproduce the input (then
    the tensors are empty), 0 for an empty batch. ``where[i]`` names feature i in errors.
    ``empty_means``: pack a mean over ``[B, 0]`` ids as empty bags (the kernel gives 0; the caller
    writes PyTorch's NaN into those columns). ``strict``: raise, naming the feature, where the
    answer would be NOT_PACKABLE because of the input's values (a fused optimizer or a quantized
    table has no PyTorch kernel to fall back to). ``tracing``: torch.export is tracing (no value
    may be read: checks become ``_assert_async`` ops). Offsets must be given for bags.
    ``keep_pads[i]``: bag i keeps its padding ids in place instead of dropping them, which reads
    values: the caller sends them to a zero row (the training TBE:
    :mod:`fxrec.runtime.kernels.fbgemm_padding`) or weighs them 0 (quantized groups:
    :func:`padding_weights`).
    """
    if not torch.jit.is_scripting() and not tracing:
        uniform = _pack_uniform(ids_list, offsets_list, psw_list, forms, pads, ilos, any_weighted)
        if uniform is not None:
            return uniform
    starts: List[Tensor] = []  # per feature: where each of its B bags starts in its own ids
    bases: List[int] = []  # per feature: where its ids start in the packed ids
    flat_ids: List[Tensor] = []
    weights: List[Tensor] = []
    batch = -1
    base = 0
    bounds: List[int] = [0]
    dev = ids_list[0].device
    nothing = torch.empty(0, dtype=torch.long, device=dev)
    ranges: List[Tensor] = []  # arange(0, b * length, length) for the lengths seen: one per group, not per feature
    range_lengths: List[int] = []
    for i in range(len(ids_list)):
        ids = ids_list[i]
        psw = psw_list[i]
        form = forms[i]
        if psw is not None and psw.shape != ids.shape:
            # (as F.embedding_bag; the kernels would read weights past the end, or ignore some)
            raise ValueError("fxrec: per-sample weights of " + where[i] + " have shape " + str(list(psw.shape))
                             + ", its ids " + str(list(ids.shape)) + ": they must have the ids' shape")
        if psw is not None and psw.device != ids.device:
            raise ValueError(weights_elsewhere(where[i], psw, ids))
        if form == 0:  # bag
            flat = ids if ids.dim() == 1 else ids.reshape(-1)
            given = offsets_list[i]
            assert given is not None
            off = given if given.dtype == torch.long else given.long()
            ilo = ilos[i]
            pad = pads[i]
            n = flat.numel()
            if ilo and tracing:
                # an exported program cannot drop a data-dependent number of trailing ids: it
                # asserts there are none (offsets[-1] == number of ids)
                torch._assert_async(off[-1] == n, "fxrec: offsets[-1] of " + where[i] + " must equal its number of ids")
                off = torch.cat([off[:-1], off.new_full([1], n)])
            if ilo or pad >= 0:
                last = -1
                if ilo and not tracing and off.numel() > 0:
                    last = int(off[-1])
                    if last < 0 and pad < 0:  # (a padding_idx bag runs to the end of its ids, as PyTorch's)
                        raise ValueError("fxrec: offsets of " + where[i] + " end at " + str(last) + ": with "
                                         "include_last_offset=True the last offset is where the ids end, 0 to "
                                         + str(n))
                if last > n:
                    raise ValueError("fxrec: offsets of " + where[i] + " end at " + str(last) + ", past its "
                                     + str(n) + " ids")
                if last >= 0 and last < n and mean and pad < 0:
                    # PyTorch sums the last bag up to offsets[-1] but divides it by the number of
                    # ids to the end of the tensor (and its backward gives those ids gradients)
                    if strict:
                        raise ValueError(
                            "fxrec: " + where[i] + " has " + str(n - last) + " ids after offsets[-1] = " + str(last)
                            + " with include_last_offset=True and mean pooling, where PyTorch's mean divides the "
                            "last bag by the ids up to the end of the tensor; fused optimizers and quantized tables "
                            "do not reproduce that: pass only the ids up to offsets[-1]")
                    return -1, nothing, nothing, None, [0], None
                if not ilo:
                    off = torch.cat([off, off.new_full([1], n)])
                elif (pad >= 0 or tracing) and off.numel() > 0:
                    # as PyTorch does: with a padding_idx the last bag runs to the end of the ids
                    off = torch.cat([off[:-1], off.new_full([1], n)])
                elif off.numel() > 0:
                    flat = flat[: int(off[-1])]
                else:
                    flat = flat[:0]
                if pad >= 0 and keep_pads is not None and keep_pads[i]:
                    pass  # offsets past the ids: the packed offsets stop increasing, which the checks see
                elif pad >= 0:
                    if not tracing and (bool((off > flat.numel()).any()) or int(off[0]) != 0):
                        # (checked here: the offsets are renumbered below, and firsts would not see it)
                        raise ValueError("fxrec: offsets of " + where[i] + " do not match its " + str(flat.numel())
                                         + " ids: offsets must start at 0, never decrease and end at most there")
                    keep = flat != pad
                    kept_before = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), keep.long().cumsum(0)])
                    off = kept_before[off]
                    flat = flat[keep]
                    if psw is not None:
                        psw = psw.reshape(-1)[: keep.numel()][keep]
                off = off[:-1]
            b = off.numel()
            start = off
        elif form == 1:  # [B, L] ids pooled over L
            b = ids.shape[0]
            length = ids.shape[1]
            flat = ids.reshape(-1)
            if length == 0 and mean and not empty_means:
                return -1, nothing, nothing, None, [0], None  # PyTorch's mean of no rows is NaN
            start = _range(ranges, range_lengths, b, length, dev, tracing)
        else:  # one id per sample
            b = ids.shape[0]
            flat = ids
            start = _range(ranges, range_lengths, b, 1, dev, tracing)
        if batch < 0:
            batch = b
        elif b != batch:
            return -1, nothing, nothing, None, [0], None  # one TBE call needs one batch size
        n = flat.numel()
        flat_ids.append(flat)
        starts.append(start)
        bases.append(base)
        base += n
        bounds.append(base)
        if any_weighted:
            if psw is None:
                psw = torch.ones(n, dtype=torch.float32, device=dev)
            weights.append(psw.reshape(-1)[:n].float())
    if _no_bags(batch, tracing):
        return 0, nothing, nothing, None, [0], None  # an empty batch
    indices = torch.cat(flat_ids).long()  # int32 and int64 ids together make int64
    psw_all: Optional[Tensor] = None
    if any_weighted:
        psw_all = torch.cat(weights)
    if torch.jit.is_scripting() or tracing:
        return batch, indices, _offsets_one_by_one(starts, bases, base), psw_all, bounds, None
    offsets, firsts = _offsets_at_once(starts, batch, bases, base)
    return batch, indices, offsets, psw_all, bounds, firsts


@torch.jit.unused
def _pack_uniform(ids_list: List[Tensor], offsets_list: List[Optional[Tensor]], psw_list: List[Optional[Tensor]],
                  forms: List[int], pads: List[int], ilos: List[bool], any_weighted: bool
                  ) -> Optional[Tuple[int, Tensor, Tensor, Optional[Tensor], List[int], Optional[Tensor]]]:
    """:func:`pack_bags`' answer for the common group, in list-level steps with no Python work per
    feature but a few C-level reads of each tensor's size: every feature of one form (bags, ``[B,
    L]`` ids with one L > 0, or single ids), no ``padding_idx`` or ``include_last_offset``, one
    batch size B > 0, ids of the dims that form has, integer offsets, and per-sample weights
    either absent or float32 on every feature in the shape of its ids. None for anything else:
    the feature-by-feature loop then gives the answer (its checks and messages included). The
    same tensors result either way (``tests/test_packing.py`` compares the two), but
    ``firsts``: None for ``[B, L]`` and single ids (they have no offsets; the loop gives zeros)."""
    n_features = len(forms)
    if n_features == 0 or pads.count(-1) != n_features or ilos.count(False) != n_features:
        return None
    form = forms[0]
    if forms.count(form) != n_features:
        return None
    dims = list(map(Tensor.dim, ids_list))
    if dims.count(2 if form == 1 else 1) != n_features:
        return None
    counts = list(map(Tensor.numel, ids_list))
    psw_all: Optional[Tensor] = None
    if any_weighted:  # (of one dtype, float32 or an fp16 table's float16: others are converted one by one, by the loop)
        try:
            if (list(map(Tensor.dim, psw_list)) != dims or list(map(Tensor.numel, psw_list)) != counts
                    or list(map(len, psw_list)) != list(map(len, ids_list))
                    or set(map(_dtype, psw_list)) not in (_FLOAT32, _FLOAT16)
                    or list(map(_device, psw_list)) != list(map(_device, ids_list))):
                return None
        except TypeError:  # a feature without weights (None)
            return None
    bounds = list(accumulate(counts, initial=0))
    total = bounds[-1]
    if form == 0:
        try:
            batches = list(map(Tensor.numel, offsets_list))
            if (list(map(Tensor.dim, offsets_list)).count(1) != n_features
                    or not set(map(_dtype, offsets_list)) <= _INTS):
                return None  # (integer offsets only: cat would take a float's dtype before .long())
        except TypeError:  # offsets None
            return None
        batch = batches[0]
        if batch == 0 or batches.count(batch) != n_features:
            return None
        indices = torch.cat(ids_list).long()
        offsets, firsts = _offsets_at_once(offsets_list, batch, bounds[:-1], total)
    else:
        batch = len(ids_list[0])
        if batch == 0 or counts.count(counts[0]) != n_features or list(map(len, ids_list)).count(batch) != n_features:
            return None
        length = counts[0] // batch
        if length == 0:
            return None
        indices = torch.cat(ids_list).reshape(-1).long()
        offsets, firsts = torch.arange(0, total + 1, length, device=indices.device), None
    if any_weighted:
        psw_all = torch.cat(psw_list).reshape(-1).float()
    return batch, indices, offsets, psw_all, bounds, firsts


def _offsets_one_by_one(starts: List[Tensor], bases: List[int], total: int) -> Tensor:
    """The packed offsets with one add per feature (see :func:`_offsets_at_once` for where)."""
    end = torch.full([1], total, dtype=torch.long, device=starts[0].device)
    return torch.cat([s + b for s, b in zip(starts, bases)] + [end])


@torch.jit.unused
def _offsets_at_once(starts: List[Tensor], batch: int, bases: List[int], total: int) -> Tuple[Tensor, Optional[Tensor]]:
    """``(offsets, firsts)``: every feature's bag starts (``starts``, each feature's ``batch``
    offsets as given) moved by where its ids start in the packed ids (``bases``), in one add for
    the group, and each feature's first start as it was given. Three tensor ops whatever the
    number of features (kernel launches on CUDA): one concatenation (ending with ``total``), one
    copy of the firsts, one add. The ids' starts are sent to the device once per layout and
    stream (:func:`~fxrec.runtime.device_ints.kept_split_on`). Not inside a CUDA graph (a replay
    would read a tensor the cache may drop), nor in torch.export (the ints are symbolic there),
    nor in TorchScript: those add one by one."""
    dev = starts[0].device
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        unshifted = torch.cat(starts).view(len(starts), batch)
        return _offsets_one_by_one(list(unshifted.unbind(0)), bases, total), unshifted[:, 0]  # (host time: once)
    end, column = kept_split_on(bases + [total], dev)  # (views kept with the ints: no view op a call)
    offsets = torch.cat(starts + [end])  # (int32 starts become int64 here: the shift is)
    grid = offsets.as_strided((len(starts), batch), (batch, 1))  # offsets[:-1] as [F, B], in one op
    firsts = grid.select(1, 0).clone()
    grid.add_(column)
    return offsets, firsts


def padding_weights(indices: Tensor, offsets: Tensor, psw: Optional[Tensor], bounds: List[int], forms: List[int],
                    pads: List[int], mean: bool) -> Tensor:
    """Per-sample weights that give a sum-pooled lookup of ids packed with their padding ids in
    place (``keep_pads``) PyTorch's answer for bags with a ``padding_idx``: 0 for a padding id,
    and for a mean 1 / (ids of the bag that are not padding) for the others (``psw`` multiplied
    in). Dropping the ids instead makes a tensor of data-dependent size, a wait for the device on
    every call on CUDA; this is a few ops on the device, nothing read. The quantized groups and
    their serving twins call it alike."""
    keep = torch.ones(indices.numel(), dtype=torch.float32, device=indices.device)
    for i in range(len(forms)):
        if forms[i] == 0 and pads[i] >= 0:
            keep[bounds[i]:bounds[i + 1]] = (indices[bounds[i]:bounds[i + 1]] != pads[i]).to(torch.float32)
    if mean:
        counted = keep.to(torch.long)  # (counted in integers: exact however many ids)
        before = torch.cat([counted.new_zeros(1), counted.cumsum(0)])
        kept = (before[offsets[1:]] - before[offsets[:-1]]).clamp(min=1).to(torch.float32)
        # each id's bag: how many bags end at or before it (not repeat_interleave, whose size
        # torch.export leaves unbacked, failing the capture of a quantized program)
        bag = torch.searchsorted(offsets[1:], torch.arange(indices.numel(), device=indices.device), right=True)
        keep = keep / kept[bag]
    if psw is not None:  # (where, not a product: an inf or NaN weight of a padding id stays out, as in PyTorch)
        keep = torch.where(keep == 0, keep, psw * keep)
    return keep


def _range(ranges: List[Tensor], lengths: List[int], b: int, length: int, dev: torch.device, tracing: bool = False):
    """``[0, length, 2 * length, ...]`` (b of them; zeros for length 0), made once per length and call
    (``tracing``: each time, as torch.export would keep a comparison of two lengths as a guard). A
    product, not ``arange``'s step: torch.export writes no guard dividing by a length that may be 0."""
    for k in range(len(lengths)):
        if not tracing and lengths[k] == length and ranges[k].numel() == b:
            return ranges[k]
    r = torch.arange(b, device=dev) * length
    ranges.append(r)
    lengths.append(length)
    return r


def pack_rows(ids_list: List[Tensor]) -> Tuple[Tensor, Tensor, int]:
    """Unpooled (sequence) input: feature f gets max(counts) bags, the first counts[f] of length
    one; ``(indices, offsets, max count)``."""
    counts: List[int] = [ids.numel() for ids in ids_list]
    bmax = max(counts)
    dev = ids_list[0].device
    lengths = torch.zeros(len(counts), bmax, dtype=torch.long, device=dev)
    for f in range(len(counts)):  # (no tensor made from the Python counts: that is a copy the device waits for)
        lengths[f, :counts[f]] = 1
    # (1-D ids as they are: export guards a reshape of a strided x[:, 0] against a batch of 1)
    indices = torch.cat([(ids if ids.dim() == 1 else ids.reshape(-1)).long() for ids in ids_list])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), lengths.reshape(-1).cumsum(0)])
    return indices, offsets, bmax


def unpack_rows(out: Tensor, ids_list: List[Tensor], dims: List[int]) -> List[Tensor]:
    """The packed unpooled rows back as one ``[*ids.shape, dims[i]]`` tensor per feature (a
    feature's first ``dims[i]`` columns: the packed rows may be stored wider; then copied, so the
    rows are contiguous as PyTorch's lookup gives them and the model may ``view`` them)."""
    outs: List[Tensor] = []
    start = 0
    for i in range(len(ids_list)):
        ids = ids_list[i]
        n = ids.numel()
        rows = out[start:start + n]
        if dims[i] != out.shape[1]:
            # (a copy whatever the number of rows: contiguous() copies only where a view is not
            # contiguous, which for one row it is, so torch.export would fix that number)
            rows = rows[:, :dims[i]].clone(memory_format=torch.contiguous_format)
        outs.append(rows.reshape(list(ids.shape) + [dims[i]]))
        start += n
    return outs


def _no_bags(batch: int, tracing: bool) -> bool:
    """Whether the batch is empty; never a branch on a dynamic batch export traces (an include_last_offset
    bag's, offsets' size - 1, would be guarded > 0: the program would refuse batch 0, which the kernels take)."""
    return batch <= 0 if not tracing or isinstance(batch, int) else False
