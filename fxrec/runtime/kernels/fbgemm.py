"""The ``fbgemm`` kernel: fbgemm_gpu's table-batched embedding (TBE), built by :mod:`.fbgemm_tbe`
(where fbgemm_gpu is imported: a missing or mismatched install fails there once, saying what to
install); :mod:`.fbgemm_nbit` is its quantized half. A group's weight parameters are views into
the TBE's flat weight buffer (:mod:`.fbgemm_bind`). A table whose dim is not a multiple of 4 is
stored with zero columns up to the next one (:func:`.fbgemm_bind.tbe_dims`; a sequence group's
tables all at the widest): its parameter is the view of its real columns, and the TBE's output
loses the padding columns (:func:`real_columns`), so they get no gradient and no update. Row-wise
Adagrad would average the squared gradient over the stored width: fbgemm's fused kernel is not
used for it on padded tables (:meth:`FbgemmKernel.supports`). Without a fused optimizer the
gradients are PyTorch's (:class:`fxrec.runtime.grad.LookupWithGrads`); with one, fbgemm's backward
applies it (its states: :mod:`.fbgemm_states`).
"""

from __future__ import annotations

from operator import attrgetter
from typing import List, Optional, Tuple

import torch

from ..device_ints import consts_on
from .fbgemm_bind import bound_tbe, ensure_bound, tbe_dims, tbe_optimizer, usable
from .fbgemm_padding import keeps_padding, mean_without_padding, send_padding_to_zero_rows
from .fbgemm_states import count_tbe_step, parks
from ..specs import CUDA_MAX_DIM, CUDA_ONLY, ROW_MEAN, STEPPED, real_columns_index
from . import FBGEMM, Kernel
from .fbgemm_tbe import CPU_OPTIMIZERS, fbgemm_available, import_error, require_fbgemm


def operator_libraries() -> List[str]:
    """Paths of fbgemm_gpu's operator libraries in its load order (for a C++ program to load first)."""
    require_fbgemm()
    import os

    import fbgemm_gpu

    here = os.path.dirname(fbgemm_gpu.__file__)
    names = getattr(fbgemm_gpu, "fbgemm_gpu_libraries", None) or []
    return [p for p in (os.path.join(here, f"{n}.so") for n in names) if os.path.exists(p)]


_requires_grad = attrgetter("requires_grad")


def real_columns_on(group, device: torch.device) -> Optional[torch.Tensor]:
    """Where a pooled TBE output's real columns are among its stored ones (a long tensor on
    ``device``, made once per device: no host-to-device copy a call), or None where none is
    padding."""
    idx = consts_on(group, "tbe_columns", device, lambda: real_columns_index(group.tables, group.features,
                                                                           tbe_dims(group)))
    return idx if idx.numel() else None


def real_columns(group, out: torch.Tensor) -> torch.Tensor:
    """A pooled TBE output ``[B, sum of stored widths]`` as the group's ``[B, sum of dims]``: the
    padding columns dropped (one index_select; its backward gives them a zero gradient)."""
    if group.pooling == "none":
        return out  # unpack_sequence takes each feature's columns
    idx = real_columns_on(group, out.device)
    return out if idx is None else out.index_select(1, idx)


def run_tbe(group, tbe, layout, indices, offsets, psw, params, training: bool):
    """The TBE on a packed input (``layout``: bags per feature and each feature's bounds in
    ``indices``, see :func:`fxrec.runtime.packing.pack_bags`): with the fused optimizer in training
    (fbgemm's backward updates the tables), else through LookupWithGrads (PyTorch's gradients);
    padding columns dropped."""
    from ..grad import LookupWithGrads

    if training and group.fused_active:
        frozen = [] if all(map(_requires_grad, params)) else [
            t.name for t, p in zip(group.tables, params) if not p.requires_grad]
        if frozen:
            group.fused_unusable(
                f"tables {frozen} are frozen (requires_grad=False) and fbgemm's fused kernel would update "
                "them; give them no optimizer (optimizer={name: ...} for the others), or use backend='native' on CPU"
            )
        if indices.is_cuda and group._bound is not None and group._bound.optimizer in STEPPED \
                and torch.cuda.is_current_stream_capturing():
            group.fused_unusable(
                f"fbgemm's fused {group._bound.optimizer} reads its step count on the host at each call, and a "
                "CUDA graph would replay the step count of its capture (its bias correction wrong from the second "
                "replay on); train it without a CUDA graph")
        return real_columns(group, tbe(indices, offsets, per_sample_weights=psw))

    def forward():  # fbgemm counts a fused Adam's step at every forward: a call with no update keeps it
        if group._bound is not None and group._bound.optimizer in STEPPED:
            # (outside inference mode: a copy made under it is an inference tensor, and fbgemm's
            # next forward adds to iter_cpu in place, which torch refuses on one outside it)
            with torch.inference_mode(False):
                step, host = tbe.iter.clone(), tbe.iter_cpu.clone()
            try:
                return plain_forward()
            finally:
                tbe.iter.copy_(step)
                tbe.iter_cpu = host
        return plain_forward()

    def plain_forward():
        if torch.is_inference_mode_enabled():
            # fbgemm's training TBE registers its CPU forward behind autograd only, which
            # inference mode (and its tensors) skip: outside it, on ordinary copies of the
            # (small) index tensors, under no_grad, the same kernel runs
            with torch.inference_mode(False), torch.no_grad():
                return real_columns(group, tbe(indices.clone(), offsets.clone(),
                                               per_sample_weights=None if psw is None else psw.clone()))
        return real_columns(group, tbe(indices, offsets, per_sample_weights=psw))

    if not training:  # nothing wants a gradient: no autograd function over every parameter
        with torch.no_grad():  # (frozen tables with grad on: fbgemm's own backward would update them)
            return forward()
    return LookupWithGrads.apply(group, forward, layout, indices, offsets, psw, *params)


def states_refusal(group, device: str, mode: str, optimizer: Optional[str]) -> Optional[str]:
    """Why a kernel that applies a fused Adagrad itself (native, reference) cannot fuse it into
    ``group``: the states live in an fbgemm TBE of the group, which must be able to hold them.
    None for other optimizers, and where it can."""
    if optimizer not in ("adagrad", "rowwise_adagrad"):
        return None
    why = KERNEL.supports(group, device, mode, optimizer, states_only=True)
    return None if why is None else f"a fused {optimizer} keeps its states in fbgemm's TBE, and {why}"


def half_refusal(group, mode: str) -> Optional[str]:
    """Why fbgemm's TBE cannot run a group of the user's fp16 tables as PyTorch does, or None.
    Its forward on fp16 rows gives PyTorch's fp16 outputs bit for bit where it sums (bags, ``[B,
    L]`` ids and sequences, with and without per-sample weights: measured on CPU, 128,000 values
    each; tests/test_half_tables.py). Not where it means bags: PyTorch's CPU mean rounds the
    sum to fp16 before dividing, fbgemm rounds the exact mean once (26,908 of 128,000 values one
    fp16 step apart; on CUDA not checked, so refused there too). Nor in training: fbgemm's fused
    update of fp16 rows rounds otherwise than torch.optim does (89 of 800 values apart after one
    SGD step, mostly ties broken the other way), and PyTorch's own fp16 gradients come from PyTorch's lookups (the
    reference kernel gives them; on fbgemm's TBE, train fp32 tables stored in fp16 with
    ``weights_precision="fp16"``). Nor for dims that are not a multiple of 4 (see below)."""
    if mode == "training":
        return ("fbgemm's kernels do not round fp16 gradients and updates as PyTorch does (fp32 tables stored "
                "in fp16 by weights_precision='fp16' train on its fused update)")
    if group.pooling == "mean":
        return "PyTorch's mean of fp16 rows rounds differently from fbgemm's (its sum is exact)"
    padded = [t.name for t, w in zip(group.tables, tbe_dims(group)) if w != t.dim]
    if padded:
        # bound to the TBE, a parameter is a strided view of its padded rows, and PyTorch's fp16 add_ (torch.optim's
        # step after an eval() call) rounds otherwise on strided rows than on the model's own (measured on CPU)
        return (f"fp16 tables {padded} would be stored padded to a multiple of 4 columns, and torch.optim's fp16 "
                "steps round otherwise on such rows")
    return None


# CUDA_MAX_DIM (fxrec.runtime.specs): the widest table fxrec gives fbgemm's CUDA training TBE.
# fbgemm's max_D, for its inference (IntNBit) kernels, which do not use "TBE v2" (not run above 1024 on a GPU).
CUDA_MAX_DIM_QUANTIZED = 2048


class FbgemmKernel(Kernel):
    """fbgemm's TBE: one kernel call for every feature of the group; fused SGD, Adagrad and row-wise
    Adagrad in its backward (its CPU build's three), on CUDA also Adam, LAMB, their partial row-wise
    forms and LARS-SGD."""

    name = FBGEMM
    CPU_OPTIMIZERS = CPU_OPTIMIZERS
    CUDA_OPTIMIZERS = CPU_OPTIMIZERS + CUDA_ONLY

    def supports(self, group, device, mode, optimizer, *, options: Tuple[str, ...] = (), states_only: bool = False):
        """``states_only``: whether a TBE of this group can keep the fused optimizer's states
        for a kernel that applies the update itself (fxrec's native and reference kernels, which
        average a row-wise Adagrad over the table's real dim and leave a padding row alone)."""
        if device not in ("cpu", "cuda"):
            return f"fbgemm runs on cpu and cuda, not {device}"
        stored = tbe_dims(group)
        limit = CUDA_MAX_DIM_QUANTIZED if group.quantized else CUDA_MAX_DIM
        if device == "cuda" and max(stored) > limit:
            return f"fbgemm's CUDA kernels take dims up to {limit}" + ("" if group.quantized else " correctly")
        if group.quantized:
            return None if mode == "inference" else "quantized tables are for inference"
        if any(t.dtype not in ("float32", "float16") for t in group.tables):
            return "fxrec gives fbgemm float32 and float16 tables only"
        if group.half:
            why = half_refusal(group, mode)
            if why:
                return why
        if group.weights == "bf16":  # seen on an H100: "batched_embedding_forward_kernel_2" not implemented for 'BFloat16'
            return ("fbgemm's CPU build stores fp16, not bf16" if device == "cpu" else
                    "fbgemm-gpu 1.6.0's CUDA forward has no bf16 rows (fp16 works)")
        if group.weights and mode == "training" and optimizer is None:
            return f"tables stored in {group.weights} train only with an optimizer fused into fbgemm's backward"
        if optimizer is not None and optimizer not in (self.CUDA_OPTIMIZERS if device == "cuda" else self.CPU_OPTIMIZERS):
            if optimizer in self.CUDA_OPTIMIZERS:
                return f"fbgemm fuses {optimizer} on CUDA only (its CPU build trains with SGD and the Adagrads)"
            return f"fbgemm has no fused {optimizer}"
        if options and device == "cpu" and not states_only:
            # fbgemm-gpu-cpu 1.8.0 takes weight_decay, weight_decay_mode and max_norm and updates the
            # rows exactly as without them (checked by hand: tests/test_fused_optimizers.py)
            return (f"fbgemm's CPU build ignores {optimizer}'s {' and '.join(options)} (its CUDA build applies "
                    f"{'them' if len(options) > 1 else 'it'})")
        if group.weights and optimizer == "adam" and not states_only:
            # fbgemm-gpu 1.6.0 passes Adam's absent row counter as an empty tensor of the weights' type,
            # and its kernel wants fp32: "Expected tensor 'row_counter_dev' to have scalar type Float"
            return (f"fbgemm's fused Adam fails on tables stored in {group.weights} (its kernel reads a row counter "
                    "of the weights' type); PartialRowWiseAdam and LazyLamb train them")
        padded = [t.name for t, w in zip(group.tables, stored) if w != t.dim]
        if optimizer in ROW_MEAN and padded and not states_only:
            return (f"tables {padded} are stored padded to a multiple of 4 columns, and fbgemm's {optimizer} "
                    "would average the squared gradient over the padded row, not the table's dim")
        if optimizer is not None and group.padded_rows and not states_only:
            return (f"nn.Embedding {list(group.padded_rows)} has a padding row, which fbgemm's fused {optimizer} "
                    "would update (PyTorch gives it no gradient)")
        return None

    def available(self, device):
        if device == "cuda":
            require_fbgemm()  # on a GPU fbgemm is the kernel: a broken install is an error, not a fallback
        return None if fbgemm_available() else f"fbgemm_gpu does not import ({import_error()!r})"

    def run(self, group, ids_list, offsets_list, psw_list, params, training):
        from ..group_packing import pack_pooled, pack_sequence, unpack_sequence

        if training and group.half:  # (a model transformed for inference, called with gradients on)
            return None  # PyTorch's lookups give PyTorch's fp16 gradients (half_refusal)

        tbe = bound_tbe(group, params)  # (one look at the parameters a call)
        if tbe is None and not usable(params, group):
            return None
        fused = training and group.fused_active
        if fused and parks(tbe_optimizer(group), params[0].device):
            group.fused_unusable(f"fbgemm's fused {group.fused.kind} runs on CUDA only, not {params[0].device}")
        if fused and group.fused.options and params[0].device.type == "cpu":
            # (a group whose kernel was chosen for CUDA, moved to the CPU): fbgemm's CPU build
            # would update as without them; the reference applies the whole update, on the same
            # states, where the tables are the parameters' own
            held = [t.name for t in group.tables if t.placement == "managed_caching" or t.weights]
            if held:
                group.fused_unusable(f"fbgemm's CPU build ignores its {' and '.join(group.fused.options)}, and tables "
                                     f"{held} are held by fbgemm's TBE (stored lower or cached), where no other kernel "
                                     "can update them; train them on CUDA")
            return None
        if group.pooling != "none":
            keep = keeps_padding(group, training)
            packed = pack_pooled(group, ids_list, offsets_list, psw_list, strict=fused, keep_padding=keep)
            if packed is None:  # an empty batch (counts a step), or what PyTorch's kernels must run
                return count_step(group, params, fused and all(i.numel() == 0 for i in ids_list))
            indices, offsets, psw, batch, bounds = packed
            tbe = tbe if tbe is not None else ensure_bound(group, params)
            if keep:
                indices, psw = send_padding_to_zero_rows(group, indices, psw, bounds)
                if group._bound.optimizer != "none":  # a fused update may have moved them
                    for z in group._bound.zero_rows:
                        z.zero_()
            out = run_tbe(group, tbe, (batch, bounds, keep), indices, offsets, psw, params, training)
            if keep and group.pooling == "mean":  # fbgemm's mean counted the padding ids
                out = out * mean_without_padding(group, indices, offsets, bounds, batch)
            return out
        if max(ids.numel() for ids in ids_list) == 0:
            return count_step(group, params, fused)
        tbe = tbe if tbe is not None else ensure_bound(group, params)
        indices, offsets, bmax, bounds = pack_sequence(group, ids_list)
        out = run_tbe(group, tbe, (bmax, bounds), indices, offsets, None, params, training)
        return unpack_sequence(group, out, ids_list)


KERNEL = FbgemmKernel()


def count_step(group, params, fused: bool) -> None:
    """No TBE call (no ids): a fused Adam still counts the step."""
    if fused and tbe_optimizer(group) in STEPPED:
        count_tbe_step(ensure_bound(group, params))
