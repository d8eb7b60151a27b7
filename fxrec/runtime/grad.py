"""The one PyTorch-gradient backward of a group, and the reference kernel's fused updates that share it.

:class:`LookupWithGrads` runs any kernel's forward without autograd and gives, in backward, the
gradients ``nn.EmbeddingBag`` / ``nn.Embedding`` would give: for each table a dense
``[rows, dim]`` gradient, or a sparse COO one for tables created with ``sparse=True``; and the
gradient of the per-sample weights. With a fused optimizer that no kernel of its own applies
(the reference kernel's), backward updates the looked-up rows instead and returns no table
gradient: SGD adds ``-lr * gradient`` (``index_add_``, PyTorch's multi-threaded kernel); Adagrad
and row-wise Adagrad first sum each row's gradient over the batch (a stable sort + ``index_add_``,
as a sparse gradient's coalesce does), then apply torch.optim.Adagrad's update, or the row-wise
one averaged over the table's dim, to those rows and their states (kept in the group's bound
fbgemm TBE, as for the other kernels), nothing read on the host (:func:`adagrad_rows`). This
path runs only where fbgemm's kernel cannot compute the update exactly. Dense gradients of a pooled group
come from its kernel where it has a backward of its own: fxrec's native kernel on CPU, fbgemm's
dense TBE operator on CUDA (:func:`fxrec.runtime.kernels.fbgemm_dense.dense_grads`).
"""

from __future__ import annotations

from typing import List, Optional

import torch

from .kernels import fbgemm_dense, native


class LookupWithGrads(torch.autograd.Function):
    """A kernel's forward (packed input) with PyTorch's gradients.

    ``forward()`` computes the output without autograd (for fbgemm's TBE: so its fused-update
    backward is never built); ``indices`` / ``offsets`` / ``psw`` are the packed input
    (:mod:`fxrec.runtime.packing`), which backward reads, and ``layout`` its bags per feature and
    each feature's bounds in ``indices`` (host ints, so backward reads no value to slice them),
    and optionally whether the padding ids of some bags were sent to their table's zero row
    (:mod:`fxrec.runtime.kernels.fbgemm_padding`: id ``num_rows``, which gets no gradient).
    """

    @staticmethod
    def forward(ctx, group, forward, layout, indices, offsets, psw, *params):
        with torch.no_grad():
            out = forward()
        ctx.group = group
        ctx.batch, ctx.bounds = layout[0], layout[1]
        ctx.zero_row = len(layout) > 2 and bool(layout[2])
        if group.fused_active or not (psw is not None and ctx.needs_input_grad[5]):
            # Backward reads the rows only for the per-sample weights' gradient, as PyTorch's
            # does: otherwise they are not saved, so a write to a table between forward and
            # backward is allowed, as in the plain model. (A fused call here is the reference
            # kernel's, whose backward updates them in place: a second forward before backward,
            # e.g. fast(pos) + fast(neg), must not trip autograd's version check.)
            ctx.save_for_backward(indices, offsets, psw)
            ctx.params = params
        else:
            ctx.save_for_backward(indices, offsets, psw, *params)
            ctx.params = None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        group = ctx.group
        indices, offsets, psw, *params = ctx.saved_tensors
        if ctx.params is not None:
            params = list(ctx.params)
        batch = ctx.batch
        n = indices.numel()
        dev = indices.device
        lengths = offsets.diff()
        # Features are packed feature-major, so feature i owns indices bounds[i]:bounds[i+1].
        bounds = ctx.bounds

        # Per-index scale: the sample weight, 1/len for mean pooling, 0 for a padding row.
        scale: Optional[torch.Tensor] = psw
        if group.pooling == "mean":
            bag = torch.repeat_interleave(
                torch.arange(lengths.numel(), device=dev), lengths, output_size=n
            )
            inv = (1.0 / lengths.clamp(min=1).to(grad_out.dtype))[bag]
            scale = inv if scale is None else scale * inv
        # per feature, the id that gets no gradient: nn.Embedding's padding row, or the zero row
        # a bag's padding ids were sent to; -1 for none
        skip = no_grad_ids(group, ctx.zero_row)
        for i, f in enumerate(group.features):
            if skip[i] >= 0:
                if scale is None:
                    scale = torch.ones(n, dtype=grad_out.dtype, device=dev)
                s, e = bounds[i], bounds[i + 1]
                scale = scale.clone() if scale is psw else scale
                scale[s:e] = scale[s:e] * (indices[s:e] != skip[i])

        # fxrec's own fused SGD: no gradient is made, the rows are updated below. The -lr factor
        # goes on grad_out ([B, sum of dims]) before the rows are gathered, unless the
        # per-sample-weight gradient needs the unscaled rows.
        fused = group.fused if group.fused_active else None
        sgd_lr = fused.lr if fused is not None and fused.kind == "sgd" else None
        # the Adagrads' states (binding first: it may move the parameters' storage)
        states = ([s["sum"] for s in group.optimizer_states(params)]
                  if fused is not None and fused.kind != "sgd" else None)
        prescaled = sgd_lr is not None and not (psw is not None and ctx.needs_input_grad[5])
        if prescaled:
            grad_out = grad_out * (-sgd_lr)

        # Gradient row for every looked-up index: the grad of its bag, in its feature's columns
        # (made when first needed).
        pieces: dict = {}
        cols = [0]
        for d in group.dims:
            cols.append(cols[-1] + d)
        bag_row: Optional[torch.Tensor] = None

        def piece(i: int) -> torch.Tensor:
            nonlocal bag_row
            if i not in pieces:
                if group.pooling == "none":  # the packed rows may be stored wider than the feature
                    pieces[i] = grad_out[bounds[i] : bounds[i + 1], : group.dims[i]]
                else:
                    if bag_row is None:
                        bag_row = torch.repeat_interleave(
                            torch.arange(lengths.numel(), device=dev) % batch, lengths, output_size=n
                        )
                    pieces[i] = grad_out[:, cols[i] : cols[i + 1]].index_select(0, bag_row[bounds[i] : bounds[i + 1]])
            return pieces[i]

        def rows_of(i: int) -> torch.Tensor:
            if scale is None:
                return piece(i)
            rows = piece(i) * scale[bounds[i] : bounds[i + 1]].unsqueeze(1)
            if skip[i] >= 0:
                # exactly zero for the padding row, even where grad_out holds inf or NaN
                pad = indices[bounds[i] : bounds[i + 1]] == skip[i]
                rows = rows.masked_fill(pad.unsqueeze(1), 0.0)
            return rows

        def table_ids(i: int) -> torch.Tensor:
            """Feature i's ids as rows of its table (a zero row's id, whose gradient rows are
            zero, as row 0)."""
            ids = indices[bounds[i] : bounds[i + 1]]
            f = group.features[i]
            return ids.masked_fill(ids == skip[i], 0) if skip[i] == group.tables[f.table].num_rows else ids

        grad_psw = None
        if psw is not None and ctx.needs_input_grad[5]:
            if group.fused_active and torch.is_grad_enabled():
                raise RuntimeError(
                    f"fxrec: tables {[t.name for t in group.tables]} train with a fused optimizer, which updates them "
                    "in this backward: a backward with create_graph=True through their per-sample weights' gradient "
                    "would leave the tables' part of a second backward unapplied; transform without optimizer= for it")
            parts = []
            for i, f in enumerate(group.features):
                # (under create_graph a function of the rows too, so a second backward reaches them)
                part = (params[f.table][table_ids(i)] * piece(i)).sum(1)
                if ctx.zero_row and skip[i] >= 0:  # a bag's padding ids: no gradient, as PyTorch's
                    part = part.masked_fill(indices[bounds[i] : bounds[i + 1]] == skip[i], 0.0)
                parts.append(part)
            grad_psw = torch.cat(parts)

        # The fused SGD update comes after the per-sample-weight gradient, which reads the
        # weights before the update.
        grads: List[Optional[torch.Tensor]] = [None] * len(params)
        need = ctx.needs_input_grad[6:]
        if fused is None and native.dense_grads_by_kernel(group, grad_out, need):  # (a fused update makes none)
            grads = native.dense_grads(group, grad_out, indices, offsets, scale, bounds, batch, skip)
        elif fused is None and fbgemm_dense.dense_grads_by_kernel(group, grad_out, need):
            grads = fbgemm_dense.dense_grads(group, grad_out, indices, offsets, psw)
        for t, (spec, p) in enumerate(zip(group.tables, params)):
            if not need[t]:
                continue
            mine = group._features_of_table[t]
            if sgd_lr is None and states is None:
                # as PyTorch's: a lookup no gradient reaches (FeatureSpec.grad) adds no entry to a
                # sparse gradient, and a table none of whose lookups it reaches gets no gradient
                mine = group._grad_features_of_table[t]
                if not mine:
                    grads[t] = None
                    continue
            if grads[t] is not None:
                continue
            if len(mine) == 1:  # one feature: no copy (the rows may be a view of grad_out)
                ids_t = table_ids(mine[0])
                rows_t = rows_of(mine[0])
            else:
                ids_t = torch.cat([table_ids(i) for i in mine])
                rows_t = torch.cat([rows_of(i) for i in mine])
            if sgd_lr is not None:
                with torch.no_grad():
                    # index_add_ with alpha= is several times slower than scaling first
                    p.index_add_(0, ids_t, rows_t if prescaled else rows_t * (-sgd_lr))
            elif states is not None:
                keep = None
                if any(skip[i] >= 0 for i in mine):
                    # as PyTorch's: no step for a padding id, whose gradient is zero (a zero
                    # gradient is no step for Adagrad, but weight decay and max_norm would move
                    # the row), nor for a zero row's id (table_ids reads it as row 0)
                    keep = torch.cat([indices[bounds[i] : bounds[i + 1]] != skip[i] for i in mine])
                with torch.no_grad():
                    adagrad_rows(p.detach(), states[t], ids_t, rows_t, fused, keep)
            elif spec.sparse:
                if any(skip[i] >= 0 for i in mine):
                    # as PyTorch's: no entry for a padding id (a lazy optimizer would step its row)
                    keep = torch.cat([indices[bounds[i] : bounds[i + 1]] != skip[i] for i in mine]).nonzero()[:, 0]
                    ids_t, rows_t = ids_t.index_select(0, keep), rows_t.index_select(0, keep)  # (one wait)
                # values with the strides of a new tensor: rows read from a padded output (dim 5 stored
                # as 8) have stride (8, 1), which PyTorch's sparse kernels also use on a dim of size 1,
                # reading past the storage (a copy also keeps a sequence's rows from aliasing grad_out)
                standard = rows_t.stride() == (rows_t.shape[1], 1)
                as_is = len(mine) > 1 or (group.pooling != "none" and standard)  # (a new tensor, or a pooled one's)
                grads[t] = torch.sparse_coo_tensor(
                    ids_t.unsqueeze(0), rows_t if as_is else rows_t.clone(memory_format=torch.contiguous_format),
                    (spec.num_rows, spec.dim), device=p.device, check_invariants=False,
                )
            else:
                grads[t] = torch.zeros(
                    spec.num_rows, spec.dim, dtype=p.dtype, device=p.device
                ).index_add_(0, ids_t, rows_t)
        return (None, None, None, None, None, grad_psw, *grads)


def no_grad_ids(group, zero_row: bool) -> List[int]:
    """Per feature, the id its lookups give no gradient: nn.Embedding's padding row, or (when
    ``zero_row``: this call's bags sent their padding ids to their table's zero row) that row,
    ``num_rows``; -1 for none. (Bags that dropped their padding ids have none left.)"""
    from .kernels.fbgemm_padding import zero_row_tables

    extra = zero_row_tables(group) if zero_row else [False] * len(group.tables)
    out = []
    for f in group.features:
        if f.padding_idx is not None and f.form != "bag":
            out.append(int(f.padding_idx))
        elif f.padding_idx is not None and extra[f.table]:
            out.append(group.tables[f.table].num_rows)
        else:
            out.append(-1)
    return out


def adagrad_rows(weight: torch.Tensor, state: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, fused,
                 keep: Optional[torch.Tensor] = None) -> None:
    """Adagrad (``fused.kind == "adagrad"``: torch.optim.Adagrad's arithmetic) or row-wise
    Adagrad on the rows ``ids`` looked up with gradient rows ``rows``: each row's gradient summed
    over its lookups first, then ``state += g*g`` (row-wise: the mean of ``g*g`` over the row),
    ``weight -= lr * g / (sqrt(state) + eps)``, row-wise with the weight decay and ``max_norm`` of
    :class:`fxrec.optim.RowWiseAdagrad`. In place, on ``weight`` and ``state``. ``keep``: per
    lookup, whether it steps its row (a row none of whose lookups is kept is left as it is: a
    padding id's, whose zero gradient is no Adagrad step, but weight decay and max_norm would move
    it); the gradient rows of the lookups not kept must be zero (the caller's masked_fill: a row
    with lookups of both kinds sums them all).

    Nothing is read on the host (on CUDA nothing waits for the device), so the number of rows
    looked up is not known: the ids are sorted (stably: each row's gradients are summed in the
    order of its lookups) and summed into as many slots as lookups, the first slots the rows.
    Row-wise Adagrad without decay or max_norm then adds each row's step to it from its slot (the
    other slots add exactly zero); the other forms write rows (``index_copy_``), every lookup
    computing its row's update from its row's summed gradient, the lookups of one row alike, so
    each row is written the same values however often it is looked up. Either way the same
    arithmetic as a step on the distinct rows, bit for bit on CPU (``tests/test_host_syncs.py``),
    at up to 2x its work where ids repeat a lot."""
    n = ids.numel()
    if n == 0:
        return
    sid, order = torch.sort(ids.long(), stable=True)  # (index_copy_ takes int64 rows)
    first = torch.ones(n, dtype=torch.bool, device=ids.device)
    first[1:] = sid[1:] != sid[:-1]
    seg = first.cumsum(0) - 1  # each sorted lookup's row among the rows looked up (its slot)
    g = rows.new_zeros(n, rows.shape[1]).index_add_(0, seg, rows.index_select(0, order))  # per slot
    kept = None
    if keep is not None:  # per slot: whether any lookup of its row is kept
        kept = torch.zeros(n, dtype=torch.int64, device=ids.device).index_add_(0, seg, keep.index_select(0, order).long()) > 0
    if fused.kind == "rowwise_adagrad" and not fused.weight_decay_mode and not fused.max_norm:
        # the plain row-wise step adds to its row and state: once for each row, from its slot, and
        # exactly zero from the slots past the last row (all of them writing row 0) and the rows
        # not stepped
        row = torch.zeros_like(sid).scatter_(0, seg, sid)
        live = torch.arange(n, device=ids.device) <= seg[-1]
        live = live if kept is None else live & kept
        x = (g * g).mean(1)
        s = state.index_select(0, row) + x
        mult = torch.where(live, fused.lr / (s.sqrt() + fused.eps), 0.0).unsqueeze(1)  # (g is 0 where not live)
        state.index_add_(0, row, torch.where(live, x, 0.0))
        weight.index_add_(0, row, g * -mult)
        return
    g = g.index_select(0, seg)  # per lookup (the others write the rows: index_copy_)
    stepped = None if kept is None else kept.index_select(0, seg)
    w = weight.index_select(0, sid)
    s0 = state.index_select(0, sid)
    if fused.kind == "rowwise_adagrad":
        wd, mode, max_norm = fused.weight_decay, fused.weight_decay_mode, fused.max_norm
        decayed = g + wd * w if mode == "l2" else g
        s = s0 + (decayed * decayed).mean(1)
        mult = (fused.lr / (s.sqrt() + fused.eps)).unsqueeze(1)
        if mode:  # fbgemm's form: w = (1 - c) * w - mult * g
            keep_w = 1 - (mult * wd if mode == "l2" else fused.lr * wd)
            new = keep_w * w - mult * g
        else:
            new = w + g * -mult
        if max_norm:
            new = renorm_rows(new, max_norm)
    else:
        s = s0.addcmul(g, g)
        new = w + (g / s.sqrt().add_(fused.eps)) * (-fused.lr)
    if stepped is not None:
        s = torch.where(stepped if s.dim() == 1 else stepped.unsqueeze(1), s, s0)
        new = torch.where(stepped.unsqueeze(1), new, w)
    state.index_copy_(0, sid, s)
    weight.index_copy_(0, sid, new)


def renorm_rows(w: torch.Tensor, max_norm: float) -> torch.Tensor:
    """fbgemm's ``max_norm`` (row-wise Adagrad's, after the update): each row of ``w`` whose L2
    norm exceeds ``max_norm`` scaled by ``max_norm / norm``, the others as they are (a new tensor;
    nothing read on the host)."""
    norm = torch.linalg.vector_norm(w, dim=1, keepdim=True)
    return torch.where(norm > max_norm, w * (max_norm / norm), w)


class _Clamp:
    """A gradient hook: the gradient clamped elementwise to ``[-limit, limit]``. (A hook, not an
    autograd function returning its input: that output would be a view, and the model could no
    longer change it in place, e.g. ``relu_()`` on the lookups' output.)"""

    def __init__(self, limit: float):
        self.limit = limit

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        return grad.clamp(-self.limit, self.limit)


def _clamped(x: torch.Tensor, limit: float) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        x.register_hook(_Clamp(limit))
    return x


class ClampGradient(torch.nn.Module):
    """After a lookup that no group runs (a table left as written, or data-parallel in a plan):
    its output, with the gradient clamped as :func:`clamped_by` clamps (nothing is done where no
    gradient is wanted: inference, torch.export, TorchScript)."""

    def __init__(self):
        super().__init__()
        self.max_gradient = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():
            return x
        return self._clamped(x)

    @torch.jit.unused
    def _clamped(self, x: torch.Tensor) -> torch.Tensor:
        return clamped_by(self, x)


def clamped_by(module: torch.nn.Module, out):
    """``out`` (a tensor, or a list of them: a group's, an output dist's or a lookup's output) with
    its gradient clamped elementwise to ``[-module.max_gradient, module.max_gradient]``
    (``transform(max_gradient=)``, fbgemm's ``gradient_clipping``; 0 or not set: as it is). A
    sharded lookup's output dist and its rank's group both clamp, which changes nothing more: the
    group's outputs' gradient is the dist's values moved, or divided by a bag length (mean pooling)."""
    limit = module.__dict__.get("max_gradient", 0.0)
    if not limit:
        return out
    if isinstance(out, torch.Tensor):
        return _clamped(out, limit)
    return type(out)(_clamped(o, limit) for o in out)
