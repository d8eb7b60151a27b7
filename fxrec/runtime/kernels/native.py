"""The ``native`` kernel: fxrec's own C++ CPU kernels (``fxrec/csrc/pooled.cpp``).

For pooled groups on CPU: every feature's ids are read as given and the pooled rows written
straight into their columns of the output (no per-table outputs, no cat, no packing). In
inference it writes into the group's reused output buffer; in training its forward feeds
fxrec's gradients (:mod:`fxrec.runtime.grad`), whose dense table gradients it also makes, and
with a fused optimizer (SGD, Adagrad, row-wise Adagrad) its backward kernels update the
looked-up rows, never making a gradient. The Adagrads' states are kept in the group's bound
fbgemm TBE, so a call these kernels cannot take runs the reference kernel's update on the same
states.

The C++ library is built on first use and may be missing (:mod:`.native_build` says how and
why); then the rule table picks another kernel (the report says so).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from operator import attrgetter
from typing import List, Optional

import torch
from torch import Tensor

from .. import _tracing
from . import NATIVE, Kernel
from .native_build import available, load, ops, why_unavailable


@dataclass
class NativeCall:
    """One group call's inputs as fxrec's kernels take them: per feature its ids (int64,
    contiguous), offsets (bags with 1-D ids) or None, per-sample weights or None,
    include_last_offset, padding row (-1: none) and form (0 bag, 1 pooled_seq, 2 single)."""

    weights: List[torch.Tensor]
    table_of_feature: List[int]
    ids: List[torch.Tensor]
    offsets: List[Optional[torch.Tensor]]
    psw: List[Optional[torch.Tensor]]
    include_last: List[int]
    padding: List[int]
    form: List[int]
    mean: int
    batch: int

    def features(self) -> tuple:
        """The kernels' per-feature arguments, in their order."""
        return (self.table_of_feature, self.ids, self.offsets, self.psw, self.include_last, self.padding,
                self.form, self.mean)


def _rows_contiguous(t: torch.Tensor) -> bool:
    """A 2-D tensor whose rows the kernels can read: each row contiguous, rows not overlapping
    (``stride(1) == 1``, ``stride(0) >= size(1)``), e.g. ``padded[:, :dim]`` of a table stored
    padded to a wider ``[rows, pad_dim]``; a dim of size 1 may carry any stride."""
    if t.dim() != 2:
        return False
    if t.is_contiguous():
        return True
    rows, dim = t.shape
    return (t.stride(1) == 1 or dim <= 1) and (rows <= 1 or t.stride(0) >= dim)


def native_call(group, ids_list, offsets_list, psw_list, params) -> Optional[NativeCall]:
    """The group's inputs as fxrec's kernels take them, or None where they do not apply (no
    kernel built, not CPU float32, tracing, an empty batch, batch sizes that differ, odd
    shapes, or a PyTorch corner case only its own kernels reproduce); the caller then runs
    another path."""
    if _tracing.exporting() or torch.jit.is_tracing() or _tracing.compiling():
        return None
    if group._plain_bags:
        call = _plain_call(group, ids_list, offsets_list, psw_list, params)
        if call is not None:
            return call
    return _call_by_feature(group, ids_list, offsets_list, psw_list, params)


_INT64, _FLOAT32 = {torch.int64}, {torch.float32}
_dtype, _on_cpu = attrgetter("dtype"), attrgetter("is_cpu")


def _plain_call(group, ids_list, offsets_list, psw_list, params) -> Optional[NativeCall]:
    """:func:`native_call`'s answer for the common group, in list-level steps (a few C-level reads
    of each tensor, no Python work per feature): bags without a padding_idx or
    include_last_offset (``group._plain_bags``), each given 1-D int64 ids and offsets, contiguous,
    on the CPU, one batch size B > 0, no per-sample weights, contiguous float32 tables. None for
    anything else: :func:`_call_by_feature` then answers (its checks included). The same call
    either way (``tests/test_native.py`` compares them); the tables are passed as they are,
    not detached: the kernels run with gradients off (inference, or inside an autograd
    Function), and read them only."""
    n = len(ids_list)
    if (psw_list.count(None) != n or set(map(_dtype, params)) != _FLOAT32 or not all(map(_on_cpu, params))
            or not all(map(Tensor.is_contiguous, params))):
        return None
    try:
        if (set(map(_dtype, ids_list)) != _INT64 or set(map(_dtype, offsets_list)) != _INT64
                or not all(map(_on_cpu, ids_list)) or not all(map(_on_cpu, offsets_list))
                or list(map(Tensor.dim, ids_list)).count(1) != n or list(map(Tensor.dim, offsets_list)).count(1) != n
                or not all(map(Tensor.is_contiguous, ids_list)) or not all(map(Tensor.is_contiguous, offsets_list))):
            return None
    except (TypeError, AttributeError):  # offsets None ([B, L] ids)
        return None
    batches = list(map(Tensor.numel, offsets_list))
    batch = batches[0]
    if batch <= 0 or batches.count(batch) != n or not available():
        return None
    return NativeCall(list(params), group._table_of, list(ids_list), list(offsets_list), [None] * n, [0] * n,
                      [-1] * n, [0] * n, int(group.pooling == "mean"), batch)


def _call_by_feature(group, ids_list, offsets_list, psw_list, params) -> Optional[NativeCall]:
    """:func:`native_call`'s answer feature by feature: every form the kernels take, and every
    check that sends a call elsewhere."""
    weights = []
    for p in params:
        if p.device.type != "cpu" or p.dtype != torch.float32 or not _rows_contiguous(p):
            return None
        weights.append(p.detach())  # as it is: a padded table's [:, :dim] view is read in place
    if not available():
        return None
    mean = group.pooling == "mean"
    ids_n, offs_n, psw_n, last, pad, form = [], [], [], [], [], []
    batch = -1
    for f, ids, off, psw in zip(group.features, ids_list, offsets_list, psw_list):
        if ids.device.type != "cpu" or ids.dtype not in (torch.int64, torch.int32):
            return None
        if f.form == "bag":
            if off is not None:
                if (ids.dim() != 1 or off.dim() != 1 or off.device.type != "cpu"
                        or off.dtype not in (torch.int64, torch.int32)):
                    return None
                if f.include_last_offset and f.padding_idx is not None:
                    return None  # PyTorch then runs the last bag to the end of the ids
                if f.include_last_offset and mean and off.numel() and int(off[-1]) < ids.numel():
                    return None  # PyTorch's mean then divides the last bag by the ids to the end
                b = off.numel() - 1 if f.include_last_offset else off.numel()
                off = off.long().contiguous()
            elif ids.dim() == 2 and ids.shape[1] > 0:
                b = ids.shape[0]
            else:
                return None  # PyTorch refuses [B, 0] bags; its own kernels say so
            kind = 0
        elif f.form == "pooled_seq":
            if ids.dim() != 2 or (mean and ids.shape[1] == 0):
                return None  # PyTorch's mean of no rows is NaN
            b, kind, off = ids.shape[0], 1, None
        elif f.form == "single":
            if ids.dim() != 1:
                return None
            b, kind, off = ids.shape[0], 2, None
        else:
            return None
        if psw is not None:
            if mean or psw.device.type != "cpu" or psw.dtype != torch.float32 or psw.shape != ids.shape:
                return None  # PyTorch's kernels give the answer or the error
            psw = psw.detach().reshape(-1).contiguous()
        if batch >= 0 and b != batch:
            return None
        batch = b
        ids_n.append(ids.long().contiguous())
        offs_n.append(off)
        psw_n.append(psw)
        last.append(int(f.include_last_offset and off is not None))
        pad.append(-1 if f.padding_idx is None else int(f.padding_idx))
        form.append(kind)
    if batch <= 0:
        return None  # empty batch: PyTorch's own kernels give the exact empty result
    return NativeCall(weights, [f.table for f in group.features], ids_n, offs_n, psw_n, last, pad, form, int(mean),
                      batch)


def native_forward(group, call: NativeCall, ids_list, offsets_list, reuse: bool) -> torch.Tensor:
    """The pooled rows of every feature, written by the kernel straight into their columns of
    a ``[B, sum of dims]`` output (the group's reused buffer when ``reuse``)."""
    shape = [call.batch, sum(group.dims)]
    w0 = call.weights[0]
    out = group._out.take(shape, w0.dtype, w0.device) if reuse else torch.empty(shape, dtype=w0.dtype)
    try:
        ops().pooled_forward(out, call.weights, *call.features())
    except (IndexError, RuntimeError) as e:
        _raise_named(group, e, ids_list, offsets_list)
    return out


def fused_fits(params, psw_list) -> bool:
    """fxrec's update kernels give no per-sample-weight gradient (frozen tables they skip)."""
    return any(p.requires_grad for p in params) and not any(w is not None and w.requires_grad for w in psw_list)


def _raise_named(group, e: Exception, ids_list, offsets_list):
    """The kernel refused its input: say which feature and table, as the other paths do."""
    group._check_inputs(ids_list, offsets_list)  # raises, naming the feature, for the usual faults
    msg = str(e).split("\n")[0]
    m = re.search(r"feature (\d+)", msg)
    if m and int(m.group(1)) < len(group.features):
        f = group.features[int(m.group(1))]
        msg = msg.replace(f"feature {m.group(1)}", f"feature '{f.name}' (table '{group.tables[f.table].name}')")
    raise (IndexError if isinstance(e, IndexError) else ValueError)(msg.replace("fxrec kernel:", "fxrec:")) from e


def dense_grads_by_kernel(group, grad_out: torch.Tensor, need) -> bool:
    """Dense gradients of a pooled group on CPU, every table wanting one: fxrec's kernel adds
    the rows straight into them (no gathered copy of the rows, no index_add_)."""
    return (
        group.pooling != "none" and grad_out.device.type == "cpu" and grad_out.dtype == torch.float32
        and all(need[t] and not spec.sparse for t, spec in enumerate(group.tables))
        # backward(create_graph=True): the gradient must itself be differentiable (PyTorch ops)
        and not torch.is_grad_enabled()
        and available()
    )


def dense_grads(group, grad_out, indices, offsets, scale, bounds, batch, skip) -> List[torch.Tensor]:
    """``zeros + sum of gradient rows`` per table, by fxrec's update kernel with lr = -1 on the
    packed input: each feature's slice of the ids, its bags, and the per-index scale (sample
    weight, 1/len for mean). ``skip``: per feature the id that gets no gradient (the padding row
    of ``nn.Embedding``, or the zero row a bag's padding ids were sent to), -1 for none; other
    bags had their padding ids removed when packed."""
    grads = [torch.zeros(t.num_rows, t.dim, dtype=grad_out.dtype) for t in group.tables]
    nf = len(group.features)
    ids = [indices[bounds[i] : bounds[i + 1]] for i in range(nf)]
    offs = [offsets[i * batch : (i + 1) * batch] - bounds[i] for i in range(nf)]
    psw = [None if scale is None else scale[bounds[i] : bounds[i + 1]] for i in range(nf)]
    zeros = [0] * nf
    # form 0 ("bag"): the kernel skips the given id in a bag, before it checks its range
    ops().sgd_update(grads, grad_out.contiguous(), -1.0, [1] * len(grads), [f.table for f in group.features],
                             ids, offs, psw, zeros, list(skip), zeros, 0)
    return grads


class NativeFusedFunction(torch.autograd.Function):
    """fxrec's kernels with a fused optimizer: forward pools the rows into a new output;
    backward applies SGD (``-lr * gradient`` added into the looked-up rows), Adagrad or row-wise
    Adagrad (each row's gradient summed over the batch first, the state in the bound TBE) to
    every table, the padding row of ``nn.Embedding`` excepted (PyTorch gives it no gradient),
    and returns no gradients.

    The ids, offsets and per-sample weights are saved for backward, so changing them in place
    before backward raises autograd's "modified by an inplace operation", as PyTorch's own
    lookups do. The tables are not saved (backward updates them in place, and a second forward
    before the backward must not trip the version check): backward reads the parameters'
    storage as it is then (it may have been rebound to fbgemm's buffer meanwhile), and bumps
    their version after the update.
    """

    @staticmethod
    def forward(ctx, group, call: NativeCall, ids_list, offsets_list, *params):
        ctx.group = group
        ctx.params = params
        ctx.call = call
        offs = [o for o in call.offsets if o is not None]
        psw = [w for w in call.psw if w is not None]
        ctx.save_for_backward(*call.ids, *offs, *psw)
        return native_forward(group, call, ids_list, offsets_list, reuse=False)

    @staticmethod
    def backward(ctx, grad_out):
        group, call = ctx.group, ctx.call
        saved = list(ctx.saved_tensors)
        n = len(call.ids)
        ids, rest = saved[:n], saved[n:]
        offs = [rest.pop(0) if o is not None else None for o in call.offsets]
        psw = [rest.pop(0) if w is not None else None for w in call.psw]
        tof, last, pad, form, mean = call.table_of_feature, call.include_last, call.padding, call.form, call.mean
        spec = group.fused
        states = None
        if spec.kind != "sgd":  # first: binding may move the parameters' storage
            # as they are: an element-wise state may be a [rows, dim] view of a padded buffer
            states = [s["sum"] for s in group.optimizer_states(ctx.params)]
        weights = [p.detach() for p in ctx.params]
        # a frozen table (requires_grad=False) is left alone, as torch.optim would leave it
        features = ([int(p.requires_grad) for p in ctx.params], tof, ids, offs, psw, last, pad, form, mean)
        with torch.no_grad():
            if states is None:
                ops().sgd_update(weights, grad_out.contiguous(), float(spec.lr), *features)
            else:
                decay = {"": 0, "l2": 1, "decoupled": 2}[spec.weight_decay_mode]  # fbgemm's WeightDecayMode
                ops().adagrad_update(weights, states, grad_out.contiguous(), float(spec.lr), float(spec.eps),
                                     int(spec.kind == "rowwise_adagrad"), float(spec.weight_decay), decay,
                                     float(spec.max_norm), *features)
        bump = getattr(torch.autograd.graph, "increment_version", None)
        if bump is not None:
            for p in ctx.params:
                bump(p)
        return (None, None, None, None, *([None] * len(ctx.params)))


class NativeKernel(Kernel):
    """fxrec's C++ kernels: pooled groups of float32 tables on CPU."""

    name = NATIVE
    OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")

    def supports(self, group, device, mode, optimizer, *, options=()):  # (row-wise Adagrad's options: adagrad_update)
        if device != "cpu":
            return "fxrec's native kernels are CPU code"
        if not group.pooled:
            return "fxrec's native kernels pool (sum or mean); sequence lookups are not theirs"
        if group.quantized:
            return "quantized tables are fbgemm's IntNBit"
        if any(t.dtype != "float32" for t in group.tables) or group.weights:
            return "fxrec's native kernels take float32 tables"
        if optimizer is not None and optimizer not in self.OPTIMIZERS:
            return f"fxrec's native kernels have no fused {optimizer}"
        # a call these kernels cannot take goes to the reference kernel, which applies the update
        # the same way on the same states
        from .fbgemm import states_refusal

        return states_refusal(group, device, mode, optimizer)

    def available(self, device):
        return None if device != "cpu" or load() else f"fxrec's native kernels are not available ({why_unavailable()})"

    def run(self, group, ids_list, offsets_list, psw_list, params, training):
        from ..grad import LookupWithGrads
        from ..group_packing import pack_pooled
        from .fbgemm_bind import ensure_bound

        call = native_call(group, ids_list, offsets_list, psw_list, params)
        if call is None:
            return None
        if not training:
            return native_forward(group, call, ids_list, offsets_list, reuse=group.reuse_output)
        if group.fused_active:
            if not fused_fits(params, psw_list):
                return None  # a per-sample-weight gradient: the group runs another kernel
            if group.fused.kind != "sgd":
                ensure_bound(group, params)  # the Adagrad states live in the bound TBE
            return NativeFusedFunction.apply(group, call, ids_list, offsets_list, *params)
        packed = pack_pooled(group, ids_list, offsets_list, psw_list)
        if packed is None:
            return None
        indices, offsets, psw, batch, bounds = packed

        def forward():
            return native_forward(group, call, ids_list, offsets_list, reuse=False)

        return LookupWithGrads.apply(group, forward, (batch, bounds), indices, offsets, psw, *params)


KERNEL = NativeKernel()
