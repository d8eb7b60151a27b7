"""The quantized half of the ``fbgemm`` kernel: fbgemm_gpu's IntNBit table-batched embedding.

With :mod:`.fbgemm` the only import of fbgemm_gpu. The groups of :mod:`fxrec.runtime.quantized`
keep the TBE's buffers (not the module) and call :func:`int_nbit_lookup` on them; the TorchScript
serving modules call the same function.

**Rows are packed for a device.** fbgemm's lookup reads each quantized row at a stride rounded up
to a *row alignment*: 1 byte on CPU, 16 on CUDA, whose kernels load rows 16 bytes at a time (an
int8 row of dim 64 is 68 bytes packed for CPU, 80 for CUDA). A group packs for the device its
tables are on (:func:`row_alignment`), and moving it to another kind of device re-lays its rows
(:func:`relayout`), as it moves the placements fbgemm reads (host memory on CPU, device memory on
CUDA). A lookup on CUDA of rows packed for CPU (a TorchScript or exported program made on CPU and
moved) is refused with an error rather than read misaligned.

**Rows in unified memory.** On CUDA a table placed ``"managed"`` or ``"managed_caching"``
(``transform(hbm_budget=)``, see :mod:`fxrec.passes.place_tables`) keeps its rows in the group's
``uvm`` buffer: host memory mapped for the GPU (fbgemm's ``new_unified_tensor``, host-mapped, as
TorchRec's ``quant_uvm`` tables), which fbgemm's kernel reads over the bus where the placement
says so. ``"managed"`` reads them there at every lookup (fbgemm's ``MANAGED``);
``"managed_caching"`` (fbgemm's ``MANAGED_CACHING``, TorchRec's ``quant_uvm_caching``) keeps an
LRU cache of them in GPU memory, filled by fbgemm's caching lookup (:mod:`.fbgemm_nbit_cache`).
On CPU every table's rows are in the one host buffer (``HOST``): fbgemm's CPU
lookup derives a table's row count for its bounds check from the next table's offset, whichever
buffer that offset is in, so mixed placements there would refuse good ids.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .fbgemm_nbit_cache import caching_lookup
from .fbgemm_tbe import require_fbgemm


#: where a table's rows go ("device": GPU memory, or the host buffer on CPU)
PLACEMENTS = ("device", "managed", "managed_caching")


def row_alignment(device: torch.device) -> int:
    """The row alignment fbgemm's IntNBit lookup needs on ``device`` (its own constructor's
    choice: 1 on CPU, 16 on CUDA)."""
    return 1 if torch.device(device).type == "cpu" else 16


def _fbgemm_types():
    require_fbgemm()
    from fbgemm_gpu.split_embedding_configs import SparseType

    return {"fp32": SparseType.FP32, "fp16": SparseType.FP16, "int8": SparseType.INT8,
            "int4": SparseType.INT4, "int2": SparseType.INT2}


#: fbgemm's PlacementType values (embedding_common.h) of a table's rows: in ``dev_weights`` ...
_IN_DEV = (0, 3)  # DEVICE, HOST
# ... else (MANAGED 1, MANAGED_CACHING 2) in ``uvm_weights``


def _location(device: torch.device, where: str = "device"):
    """fbgemm's location for a table placed ``where`` (one of :data:`PLACEMENTS`) on ``device``:
    on CPU, HOST; on CUDA, DEVICE, MANAGED (unified memory) or MANAGED_CACHING (unified memory
    with an HBM cache)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation

    if where not in PLACEMENTS:
        raise ValueError(f"fxrec: a quantized table's placement must be one of {PLACEMENTS}, got {where!r}")
    if where == "managed":
        return EmbeddingLocation.MANAGED
    if where == "managed_caching":
        return EmbeddingLocation.MANAGED_CACHING
    return EmbeddingLocation.HOST if torch.device(device).type == "cpu" else EmbeddingLocation.DEVICE


def placed_for(device: torch.device, where: Sequence[str]) -> Tuple[str, ...]:
    """Where a group's tables go on ``device`` (``where``: their placements for CUDA): every table
    in the host buffer on CPU (see the module doc), as placed on CUDA."""
    return tuple("device" if torch.device(device).type != "cuda" else w for w in where)


def _table_specs(rows_dims_dtypes: Sequence[Tuple[int, int, str]], device, where: Sequence[str]) -> list:
    """fbgemm's IntNBit table specs of these tables on ``device``, each placed where ``where``
    says ("device" for every table where it is empty)."""
    types = _fbgemm_types()
    where = tuple(where) or ("device",) * len(rows_dims_dtypes)
    return [("", int(r), int(d), types[t], _location(device, w)) for (r, d, t), w in zip(rows_dims_dtypes, where)]


def unified_bytes(size: int, device: torch.device) -> torch.Tensor:
    """``size`` zero bytes in unified memory for ``device`` (host memory the GPU reads; fbgemm's
    host-mapped ``new_unified_tensor``); on CPU, ordinary host memory."""
    device = torch.device(device)
    if device.type != "cuda" or size == 0:
        return torch.zeros(size, dtype=torch.uint8, device=device)
    proto = torch.zeros(1, dtype=torch.uint8, device=device)
    return torch.ops.fbgemm.new_unified_tensor(proto, [int(size)], True).zero_()


def in_unified_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` is a unified-memory tensor (fbgemm's ``is_uvm_tensor``; False on CPU)."""
    return t.device.type == "cuda" and bool(torch.ops.fbgemm.is_uvm_tensor(t))


def clone_rows(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in the same kind of memory (unified memory stays unified)."""
    if in_unified_memory(t):
        return unified_bytes(t.numel(), t.device).copy_(t)
    return t.clone()


def make_inference_tbe(
    rows_dims_dtypes: Sequence[Tuple[int, int, str]],
    feature_table_map: List[int],
    pooling: str,
    device: torch.device,
    weights: Sequence[torch.Tensor],
    output_dtype: str = "fp32",
    where: Sequence[str] = (),
) -> "torch.nn.Module":
    """fbgemm's IntNBitTableBatchedEmbeddingBagsCodegen on ``device``, rows packed for it, holding
    ``weights`` quantized row-wise to each table's dtype (fp32, fp16, int8, int4, int2; integers
    with an fp16 scale and bias per row: fbgemm's quantize_embs); ``where``: each table's
    placement ("device", default, "managed" or "managed_caching": unified memory, host-mapped, on
    CUDA; the module builds no cache, the group keeps its own: :func:`.fbgemm_nbit_cache.cache_buffers`)."""
    types = _fbgemm_types()
    where = tuple("managed" if w == "managed_caching" else w for w in where)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
            IntNBitTableBatchedEmbeddingBagsCodegen,
        )
        from fbgemm_gpu.tbe.utils.quantize import quantize_embs

        mode = {"sum": PoolingMode.SUM, "mean": PoolingMode.MEAN, "none": PoolingMode.NONE}[pooling]
        tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
            _table_specs(rows_dims_dtypes, device, where),
            feature_table_map=list(feature_table_map),
            pooling_mode=mode,
            device=device,
            output_dtype=types[output_dtype],
            bounds_check_mode=BoundsCheckMode.NONE,
            row_alignment=row_alignment(device),
            uvm_host_mapped=True,
        )
        tbe.initialize_weights()
        tbe.assign_embedding_weights(
            [quantize_embs(w.detach().float().to(device), types[t]) for w, (_, _, t) in zip(weights, rows_dims_dtypes)]
        )
    return tbe


def relayout(rows_dims_dtypes: Sequence[Tuple[int, int, str]], feature_table_map: Sequence[int],
             buffers: Tuple[torch.Tensor, torch.Tensor], placements: torch.Tensor, offsets: torch.Tensor,
             alignment: int, device: torch.device, where: Sequence[str] = (),
             new_alignment: Optional[int] = None):
    """The packed rows of ``buffers`` (``(dev, uvm)`` uint8, rows at ``alignment``; ``placements``
    and ``offsets`` per feature, as fbgemm keeps them: which buffer, and the byte where the
    feature's table starts there) packed again for ``device``: at ``new_alignment`` (default: the
    device's), each table where ``where`` says ("device", the default, or "managed": in the uvm
    buffer, unified memory on CUDA; "managed_caching" too), in the placements and table offsets fbgemm's IntNBit TBE gives
    that layout. Returns ``(dev, uvm, placements, offsets)`` on ``device``, the last two per
    feature; each row's bytes are copied unchanged, the padding is zero. A table's rows cross
    devices in one contiguous copy, restrided on the side that is host memory (no second copy of
    a table in GPU memory). From buffers on meta, ``dev`` is on meta (to_empty gives it memory)
    and ``uvm`` zero."""
    require_fbgemm()
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
        rounded_row_size_in_bytes,
        unpadded_row_size_in_bytes,
    )

    types = _fbgemm_types()
    device = torch.device(device)
    where = tuple(where) or ("device",) * len(rows_dims_dtypes)
    new_alignment = row_alignment(device) if new_alignment is None else int(new_alignment)
    new = layout(rows_dims_dtypes, feature_table_map, device, where, new_alignment)
    # from meta (to_empty of a model loaded there): no rows to copy (a state_dict brings them), and
    # the buffer to_empty gives memory stays on meta until it does (not allocated twice)
    empty = buffers[0].is_meta or placements.is_meta or offsets.is_meta
    dev = torch.zeros(new.dev_size, dtype=torch.uint8, device="meta" if empty else device)
    uvm = unified_bytes(new.uvm_size, device)
    ftm = list(feature_table_map)
    first = [ftm.index(t) for t in range(len(rows_dims_dtypes))]
    old_starts, old_places = ([], []) if empty else (offsets.tolist(), placements.tolist())
    for t, (rows, dim, dtype) in enumerate([] if empty else rows_dims_dtypes):
        src = buffers[0] if old_places[first[t]] in _IN_DEV else buffers[1]
        dst = dev if where[t] == "device" else uvm
        old, start = old_starts[first[t]], new.offsets[first[t]]
        used = unpadded_row_size_in_bytes(dim, types[dtype])
        was = rounded_row_size_in_bytes(dim, types[dtype], alignment)
        now = rounded_row_size_in_bytes(dim, types[dtype], new_alignment)
        _copy_rows(dst[start:start + rows * now], src[old:old + rows * was], rows, used, was, now)
    return (dev, uvm, torch.tensor(new.placements, dtype=torch.int32, device=device),
            torch.tensor(new.offsets, dtype=torch.int64, device=device))


class Layout(NamedTuple):
    """Where fbgemm's IntNBit TBE keeps a group's packed tables (its constructor's own state):
    the bytes of its ``(dev, uvm)`` buffers (``dev``: the host buffer on CPU), and per feature the
    buffer its table is in (fbgemm's placement: HOST 3, DEVICE 0, MANAGED 1, MANAGED_CACHING 2), the byte where the
    table starts there, its type, and the features' output columns (``D_offsets``)."""

    dev_size: int
    uvm_size: int
    placements: List[int]
    offsets: List[int]
    tys: List[int]
    D_offsets: List[int]


def layout(rows_dims_dtypes: Sequence[Tuple[int, int, str]], feature_table_map: Sequence[int],
           device: torch.device, where: Sequence[str], alignment: int) -> Layout:
    """The :class:`Layout` of these tables (rows, stored dim, dtype) on ``device`` (its kind),
    placed where ``where`` says, rows at ``alignment`` bytes: fbgemm's ``nbit_construct_split_state``
    and its constructor's per-feature lists, read from the tables and not from any buffer."""
    require_fbgemm()
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import nbit_construct_split_state

    on_cpu = torch.device(device).type == "cpu"
    state = nbit_construct_split_state(_table_specs(rows_dims_dtypes, "cpu" if on_cpu else "cuda", where),
                                       cacheable=True, row_alignment=int(alignment))
    types = _fbgemm_types()
    ftm = list(feature_table_map)
    code = [int(types[t].as_int()) if hasattr(types[t], "as_int") else int(types[t].value)
            for _, _, t in rows_dims_dtypes]
    columns = [0]
    for t in ftm:
        columns.append(columns[-1] + int(rows_dims_dtypes[t][1]))
    return Layout(state.host_size if on_cpu else state.dev_size, state.uvm_size,
                  [int(state.placements[t].value) for t in ftm], [int(state.offsets[t]) for t in ftm],
                  [code[t] for t in ftm], columns)


def saved_sizes(rows_dims_dtypes: Sequence[Tuple[int, int, str]], feature_table_map: Sequence[int],
                placements: Sequence[int], alignment: int) -> Tuple[int, int, List[int]]:
    """The bytes of the ``(dev, uvm)`` buffers of these tables packed at ``alignment`` with these
    per-feature ``placements`` (fbgemm's values: HOST 3 on CPU, DEVICE 0 on CUDA, MANAGED 1 and
    MANAGED_CACHING 2 in the uvm buffer), and the per-feature offsets: what a state_dict saved with
    that layout holds."""
    ftm = list(feature_table_map)
    per_table = [int(placements[ftm.index(t)]) for t in range(len(rows_dims_dtypes))]
    device = "cpu" if 3 in per_table else "cuda"
    where = ["device" if p in _IN_DEV else "managed_caching" if p == 2 else "managed" for p in per_table]
    saved = layout(rows_dims_dtypes, ftm, torch.device(device), where, alignment)
    return saved.dev_size, saved.uvm_size, saved.offsets


def _copy_rows(dst: torch.Tensor, src: torch.Tensor, rows: int, used: int, was: int, now: int) -> None:
    """``rows`` rows of ``src`` (``was`` bytes apart) into ``dst`` (``now`` apart), their first
    ``used`` bytes (the rest zero)."""
    if was == now:
        dst.copy_(src)
        return
    # restrided in host memory, unless both sides are in GPU memory (unified memory is host memory)
    on_gpu = src.device.type == "cuda" and dst.device.type == "cuda" and not in_unified_memory(dst)
    side = dst.device if on_gpu else torch.device("cpu")
    tmp = torch.zeros(rows, now, dtype=torch.uint8, device=side)
    tmp[:, :used] = src.to(side).view(rows, was)[:, :used]  # (a contiguous slice crosses)
    dst.copy_(tmp.view(-1))


def packed_bytes(rows_dims_dtypes: Sequence[Tuple[int, int, str]], alignment: int) -> List[int]:
    """Bytes each table's rows take packed at ``alignment`` (scale and bias included)."""
    require_fbgemm()
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import rounded_row_size_in_bytes

    types = _fbgemm_types()
    return [int(r) * rounded_row_size_in_bytes(int(d), types[t], alignment) for r, d, t in rows_dims_dtypes]


#: fbgemm's PoolingMode.SUM (an int, as its lookup operator takes it)
SUM_POOLING = 0

def int_nbit_lookup(q: Dict[str, int], weights: List[torch.Tensor], indices: torch.Tensor,
                    offsets: torch.Tensor, psw: Optional[torch.Tensor]) -> torch.Tensor:
    """fbgemm's quantized TBE lookup on a group's buffers: ``weights`` are, in order, the
    quantized rows, uvm rows, placements, offsets, types, D offsets, the cached rows, cache
    locations (empty: the lookup finds them), then the rest of :data:`.fbgemm_nbit_cache.CACHE_BUFFERS` (the ``q_*``
    buffers); ``q`` its ints. With cached rows (tables placed ``"managed_caching"``, on CUDA),
    fbgemm's caching lookup, which fills the cache first; else its plain one. A typed function
    TorchScript compiles: the eager quantized groups and their serving twins call it alike."""
    if weights[0].device.type == "cuda" and q["row_alignment"] % 16 != 0:
        raise RuntimeError(
            "fxrec: these quantized tables were packed for CPU (row alignment 1) and CUDA's lookup needs rows "
            "aligned to 16 bytes: move the fxrec model to CUDA (model.to('cuda') packs them again) before "
            "scripting or exporting it for CUDA, or transform it on CUDA"
        )
    if weights[6].numel() > 0 and indices.is_cuda:  # (on CPU fbgemm's operator would ignore it, warning each call)
        return caching_lookup(q, weights, indices, offsets, psw)
    return torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function(
        dev_weights=weights[0], uvm_weights=weights[1], weights_placements=weights[2], weights_offsets=weights[3],
        weights_tys=weights[4], D_offsets=weights[5], total_D=q["total_D"],
        max_int2_D=q["max_int2_D"], max_int4_D=q["max_int4_D"], max_int8_D=q["max_int8_D"],
        max_float16_D=q["max_float16_D"], max_float32_D=q["max_float32_D"],
        indices=indices.int(), offsets=offsets.int(), pooling_mode=q["pooling_mode"], indice_weights=psw,
        output_dtype=q["output_dtype"], lxu_cache_weights=weights[6], lxu_cache_locations=weights[7],
        row_alignment=q["row_alignment"], max_float8_D=q["max_float8_D"], fp8_exponent_bits=q["fp8_exponent_bits"],
        fp8_exponent_bias=q["fp8_exponent_bias"],
    )


def quant_align(dtype: str) -> int:
    """The dim a table must be a multiple of to be stored in ``dtype``."""
    return _fbgemm_types()[dtype].align_size()
