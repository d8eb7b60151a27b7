"""fbgemm's dense TBE backward (TorchRec's dense kernel): the dense gradients of a pooled group
bound to a TBE on CUDA, every table at once, for training without a fused optimizer
(:class:`fxrec.runtime.grad.LookupWithGrads` asks here first)."""

from __future__ import annotations

from typing import List, Optional

import torch

from .fbgemm import real_columns_on
from .fbgemm_tbe import tbe_flat_weights


def dense_grads_by_kernel(group, grad_out: torch.Tensor, need) -> bool:
    """Dense gradients of a pooled group bound to a TBE on CUDA, every table wanting one: fbgemm's
    dense TBE backward (TorchRec's dense kernel; one launch for every table) instead of a gather
    and an ``index_add_`` per table. Not for nn.Embedding padding rows (they get no gradient in
    PyTorch; fbgemm would give them one) nor sparse tables (COO gradients)."""
    return (
        group.pooling != "none" and grad_out.device.type == "cuda" and grad_out.dtype == torch.float32
        and all(need[t] and not spec.sparse for t, spec in enumerate(group.tables))
        and not group.spec.padded_rows and group._bound is not None
        and all(spec.placement == "device" for spec in group.tables)  # the operator reads HBM rows only
        and tbe_flat_weights(group._bound.tbe).device == grad_out.device
        and not torch.is_grad_enabled()  # backward(create_graph=True) needs differentiable PyTorch ops
    )


def dense_grads(group, grad_out: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
                psw: Optional[torch.Tensor]) -> List[torch.Tensor]:
    """Per table, the dense ``[rows, dim]`` gradient of the group's pooled lookups on the packed
    input, by fbgemm's dense TBE operator on the bound TBE's weights and layout: its forward is
    run again here with autograd, and its backward gives the gradient of the whole flat buffer,
    of which each table's is a view (its real columns)."""
    tbe = group._bound.tbe
    flat = tbe_flat_weights(tbe).detach().requires_grad_()  # the same storage, a leaf here
    cols = real_columns_on(group, grad_out.device)  # (made at the forward: no copy from the host here)
    if cols is not None:  # the output had its padding columns dropped: they get a zero gradient
        grad_out = grad_out.new_zeros(grad_out.shape[0], int(tbe.total_D)).index_copy_(1, cols, grad_out)
    with torch.enable_grad():
        out = torch.ops.fbgemm.dense_embedding_codegen_lookup_function(
            dev_weights=flat, weights_offsets=tbe.weights_offsets, D_offsets=tbe.D_offsets, total_D=tbe.total_D,
            max_D=tbe.max_D, hash_size_cumsum=tbe.hash_size_cumsum, total_hash_size_bits=tbe.total_hash_size_bits,
            indices=indices, offsets=offsets, pooling_mode=tbe.pooling_mode,
            indice_weights=None if psw is None else psw.detach(), feature_requires_grad=None)
        (flat_grad,) = torch.autograd.grad(out, flat, grad_out)
    grads = []
    for t, view in zip(group.tables, tbe.split_embedding_weights()):
        g = flat_grad.as_strided(view.shape, view.stride(), view.storage_offset() - flat.storage_offset())
        grads.append(g[: t.num_rows, : t.dim])  # its real rows (a zero row may follow) and columns
    return grads
