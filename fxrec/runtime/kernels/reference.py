"""The ``reference`` kernel: PyTorch's own lookups, one per feature, as the user's model runs them.

Bit for bit what the plain model computes (``F.embedding_bag`` / ``F.embedding``, then ``cat``
for pooled groups), so it is also what torch.export and TorchScript trace, the oracle ``verify``
compares with, and what every group runs on an input no other kernel takes. Two things it adds:

* in inference, a pooled group on CPU writes into an output buffer it keeps between calls and
  reuses when nothing refers to the previous result any more (see
  :class:`~fxrec.runtime.output_buffer.ReusedOutput`): the same kernels without page-faulting a
  fresh output of tens of MB every call;
* in training with a fused optimizer, the forward feeds fxrec's backward
  (:class:`~fxrec.runtime.grad.LookupWithGrads`), which updates the looked-up rows and makes no
  table gradient: SGD by ``index_add_`` of ``-lr * gradient``; Adagrad and row-wise Adagrad on
  each row's summed gradient, their states in the group's bound fbgemm TBE (as on the other
  kernels). It fuses what fbgemm's kernel cannot compute exactly (row-wise Adagrad on a table
  stored padded, an ``nn.Embedding`` padding row) and takes every call the chosen kernel hands
  back.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .._tracing import reads_values
from . import REFERENCE, Kernel


def lookup_each(ids_list: List[Tensor], offsets_list: List[Optional[Tensor]], psw_list: List[Optional[Tensor]],
                weights: List[Tensor], table_of: List[int], forms: List[int], pads: List[int], ilos: List[bool],
                sparse: List[bool], pooling: str) -> List[Tensor]:
    """Each feature's lookup as the user's model makes it (``forms``: 0 bag, 1 ``[B, L]`` ids
    pooled over L, 2 and 3 one row per id), one tensor per feature. A plain typed function:
    TorchScript compiles it, so the serving modules run the same lookups."""
    outs: List[Tensor] = []
    for i in range(len(ids_list)):
        t = table_of[i]
        w = weights[t]
        pad: Optional[int] = None
        if pads[i] >= 0:
            pad = pads[i]
        if forms[i] == 0:
            outs.append(F.embedding_bag(ids_list[i], w, offsets_list[i], mode=pooling, sparse=sparse[t],
                                        per_sample_weights=psw_list[i], include_last_offset=ilos[i], padding_idx=pad))
        elif forms[i] == 1 and ids_list[i].dim() == 1:
            outs.append(_pool_flat(ids_list[i], offsets_list[i], w, pad, sparse[t], pooling))
        else:
            e = F.embedding(ids_list[i], w, padding_idx=pad, sparse=sparse[t])
            if forms[i] == 1:
                e = e.sum(1) if pooling == "sum" else e.mean(1)
            outs.append(e)
    return outs


def _pool_flat(ids: Tensor, offsets: Optional[Tensor], w: Tensor, pad: Optional[int], sparse: bool,
               pooling: str) -> Tensor:
    """``[B, L]`` ids pooled over L (``emb(ids).sum(1)`` / ``.mean(1)``) as they reach the rank that
    owns a sharded fp16 table: flat, each bag's start in ``offsets`` (the bags of several ranks,
    whose L may differ). The model's arithmetic: each id's row by ``F.embedding``, whose backward
    (a row's gradients added in order) ``embedding_bag``'s does not give in fp16; summed in float32
    and rounded once, as ``sum(1)`` / ``mean(1)`` of fp16 rows do on CPU; a bag's gradient given
    to each of its ids (``mean``: divided by its length, in float32, rounded once)."""
    if offsets is None:
        raise ValueError("fxrec: [B, L] ids sent flat need their bags' offsets")
    bags = offsets.numel()
    if ids.numel() == 0:  # (segment_reduce takes no empty input): empty bags' sums, and means (NaN)
        empty = F.embedding(ids, w, padding_idx=pad, sparse=sparse)
        return empty.new_full([bags, w.shape[1]], float("nan") if pooling == "mean" else 0.0) + empty.sum()
    ends = torch.cat([offsets[1:], torch.full([1], ids.numel(), dtype=offsets.dtype, device=offsets.device)])
    rows = F.embedding(ids, w, padding_idx=pad, sparse=sparse).float()
    return torch.segment_reduce(rows, pooling, lengths=ends - offsets).to(w.dtype)


def lookups(group, ids_list, offsets_list, psw_list, params, out: Optional[torch.Tensor] = None):
    """The original lookups, one after the other: for pooled groups concatenated (into ``out``
    when given), for sequence groups one tensor per feature."""
    weights, table_of, sparse = params, group._table_of, group._sparse
    if group._no_grad_features and torch.is_grad_enabled():
        # a lookup no gradient reaches (FeatureSpec.grad) reads its table detached: as in PyTorch,
        # its ids get no entry in the table's gradient (the split of the outputs would give them zeros)
        weights, table_of, sparse = list(params), list(table_of), list(sparse)
        for i in group._no_grad_features:
            weights.append(params[table_of[i]].detach())
            sparse.append(sparse[table_of[i]])
            table_of[i] = len(weights) - 1
    outs = lookup_each(ids_list, offsets_list, psw_list, weights, table_of, group._forms, group._pads,
                       group._ilos, sparse, group.pooling)
    if group.pooling == "none":
        return outs
    return torch.cat(outs, 1) if out is None else torch.cat(outs, 1, out=out)


def _empty_batch(group, ids_list, offsets_list, psw_list, params):
    """An empty batch of a group with a fused optimizer: nothing to update, so the (empty) outputs
    leave the tables out of autograd; where gradients are recorded they still require one, so that
    ``loss.backward()`` runs as on the plain model (it raised: "does not require grad")."""
    with torch.no_grad():
        out = lookups(group, ids_list, offsets_list, psw_list, params)
    if not torch.is_grad_enabled():
        return out
    # (a clone of a leaf that requires grad: a tensor the model may write in place, as the lookups' own)
    return [o.requires_grad_().clone() for o in out] if isinstance(out, list) else out.requires_grad_().clone()


def batch_of(group, ids_list, offsets_list) -> int:
    """The one batch size of a pooled group's features, or -1 where they differ or a shape is odd."""
    batch = -1
    for f, ids, off in zip(group.features, ids_list, offsets_list):
        if f.form == "bag":
            if off is None or off.dim() != 1 or ids.dim() != 1:
                return -1
            b = off.numel() - 1 if f.include_last_offset else off.numel()
        elif ids.dim() != (1 if f.form == "single" else 2):
            return -1
        else:
            b = ids.shape[0]
        if batch >= 0 and b != batch:
            return -1
        batch = b
    return batch


def _into_reused(group, ids_list, offsets_list, psw_list, params) -> Optional[torch.Tensor]:
    """The lookups concatenated into the group's reused output buffer; None where only a fresh
    output gives PyTorch's own answer (an empty batch, batch sizes that differ, odd shapes)."""
    batch = batch_of(group, ids_list, offsets_list)
    if batch <= 0:
        return None
    w0 = params[0]
    out = group._out.take([batch, sum(group.dims)], w0.dtype, w0.device)
    return lookups(group, ids_list, offsets_list, psw_list, params, out=out)


def _fused(group, ids_list, offsets_list, psw_list, params):
    """Training with a fused SGD: the lookups' forward, fxrec's backward updating the rows."""
    from ..grad import LookupWithGrads
    from ..group_packing import pack_pooled, pack_sequence, unpack_sequence

    if group.pooling == "none":
        if max(ids.numel() for ids in ids_list) == 0:
            return None
        indices, offsets, bmax, bounds = pack_sequence(group, ids_list)

        width = max(group.dims)

        def forward():  # every feature's rows, packed at the widest dim (unpack_sequence narrows them)
            rows = [params[f.table][ids.reshape(-1)] for f, ids in zip(group.features, ids_list)]
            return torch.cat([r if d == width else F.pad(r, (0, width - d)) for r, d in zip(rows, group.dims)])

        out = LookupWithGrads.apply(group, forward, (bmax, bounds), indices, offsets, None, *params)
        return unpack_sequence(group, out, ids_list)
    packed = pack_pooled(group, ids_list, offsets_list, psw_list, strict=True)
    if packed is None:
        return None
    indices, offsets, psw, batch, bounds = packed

    def forward():
        return lookups(group, ids_list, offsets_list, psw_list, params)

    return LookupWithGrads.apply(group, forward, (batch, bounds), indices, offsets, psw, *params)


class ReferenceKernel(Kernel):
    name = REFERENCE

    OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")

    def supports(self, group, device, mode, optimizer, *, options=()):  # (row-wise Adagrad's options: grad.adagrad_rows)
        if group.quantized:
            return "quantized tables are fbgemm's IntNBit"
        if group.weights:
            return f"tables stored in {group.weights} (weights_precision=) are fbgemm's TBE's"
        if optimizer is not None and optimizer not in self.OPTIMIZERS:
            return f"fxrec fuses {', '.join(self.OPTIMIZERS)} onto PyTorch's lookups, not {optimizer}"
        if optimizer is not None and group.half:
            # (its update, index_add_ of -lr * gradient, rounds twice in fp16 where torch.optim rounds once)
            return "fxrec's fused update does not round fp16 rows as torch.optim does"
        from .fbgemm import states_refusal

        return states_refusal(group, device, mode, optimizer)

    def run(self, group, ids_list, offsets_list, psw_list, params, training):
        if params and any(ids.device != params[0].device for ids in ids_list):
            # PyTorch's lookups take meta ids with CPU tables and return meta rows: say so instead
            # (the other kernels hand such inputs here)
            group._check_devices(ids_list, offsets_list, psw_list, params, ValueError("device mismatch"))
        if training and group.fused_active:
            if group.fused.kind not in self.OPTIMIZERS:  # fbgemm's alone (Adam) and it handed this call back
                if any(ids.numel() for ids in ids_list):
                    group.fused_unusable(f"only fbgemm's kernel fuses {group.fused.kind}, and it cannot take this call "
                                         "(features with different batch sizes, or tables not float32 on one device)")
                return _empty_batch(group, ids_list, offsets_list, psw_list, params)
            if group.fused.kind != "sgd":
                from .fbgemm_bind import ensure_bound, usable

                if not usable(params, group):
                    group.fused_unusable("its states live in fbgemm's TBE, which cannot hold these tables (fbgemm "
                                         "missing, or tables not float32 on one device)")
                ensure_bound(group, params)  # the states; the parameters become views of the TBE
            out = _fused(group, ids_list, offsets_list, psw_list, params)
            if out is not None:
                return out
            if any(ids.numel() for ids in ids_list):
                group.fused_unusable("its features have different batch sizes (or a [B, 0] id tensor is mean-pooled)")
            return _empty_batch(group, ids_list, offsets_list, psw_list, params)
        _check_offsets_order(group, ids_list, offsets_list)
        try:
            if not training and group.pooling != "none" and group.reuse_output:
                out = _into_reused(group, ids_list, offsets_list, psw_list, params)
                if out is not None:
                    return out
            return lookups(group, ids_list, offsets_list, psw_list, params)
        except (IndexError, RuntimeError, TypeError, ValueError):
            # PyTorch's own kernels checked the inputs; say which feature and table was wrong.
            group._check_inputs(ids_list, offsets_list)
            raise


def _check_offsets_order(group, ids_list, offsets_list) -> None:
    """Offsets that decrease: PyTorch's lookups take them and return memory never written (the
    other kernels' packed checks refuse them); the named error instead, where values may be read
    (CPU: one comparison a bag feature; on CUDA it would make the host wait)."""
    if not group._bag_features or not reads_values(ids_list[0].device):
        return
    for i in group._bag_features:
        off = offsets_list[i]
        if off is not None and off.dim() == 1 and off.numel() > 1 and bool((off[1:] < off[:-1]).any()):
            group._check_inputs(ids_list, offsets_list)  # raises, naming the feature


KERNEL = ReferenceKernel()
