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
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .fbgemm_tbe import require_fbgemm

QUANT_DTYPES = ("fp32", "fp16", "int8", "int4", "int2")


def row_alignment(device: torch.device) -> int:
    """The row alignment fbgemm's IntNBit lookup needs on ``device`` (its own constructor's
    choice: 1 on CPU, 16 on CUDA)."""
    return 1 if torch.device(device).type == "cpu" else 16


def _fbgemm_types():
    require_fbgemm()
    from fbgemm_gpu.split_embedding_configs import SparseType

    return {"fp32": SparseType.FP32, "fp16": SparseType.FP16, "int8": SparseType.INT8,
            "int4": SparseType.INT4, "int2": SparseType.INT2}


def _location(device: torch.device):
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation

    return EmbeddingLocation.HOST if torch.device(device).type == "cpu" else EmbeddingLocation.DEVICE


def make_inference_tbe(
    rows_dims_dtypes: Sequence[Tuple[int, int, str]],
    feature_table_map: List[int],
    pooling: str,
    device: torch.device,
    weights: Sequence[torch.Tensor],
    output_dtype: str = "fp32",
) -> "torch.nn.Module":
    """fbgemm's IntNBitTableBatchedEmbeddingBagsCodegen on ``device``, rows packed for it, holding
    ``weights`` quantized row-wise to each table's dtype (fp32, fp16, int8, int4, int2; integers
    with an fp16 scale and bias per row: fbgemm's quantize_embs)."""
    types = _fbgemm_types()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
            IntNBitTableBatchedEmbeddingBagsCodegen,
        )
        from fbgemm_gpu.tbe.utils.quantize import quantize_embs

        mode = {"sum": PoolingMode.SUM, "mean": PoolingMode.MEAN, "none": PoolingMode.NONE}[pooling]
        tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
            [("", int(r), int(d), types[t], _location(device)) for r, d, t in rows_dims_dtypes],
            feature_table_map=list(feature_table_map),
            pooling_mode=mode,
            device=device,
            output_dtype=types[output_dtype],
            bounds_check_mode=BoundsCheckMode.NONE,
            row_alignment=row_alignment(device),
        )
        tbe.initialize_weights()
        tbe.assign_embedding_weights(
            [quantize_embs(w.detach().float().to(device), types[t]) for w, (_, _, t) in zip(weights, rows_dims_dtypes)]
        )
    return tbe


def relayout(rows_dims_dtypes: Sequence[Tuple[int, int, str]], feature_table_map: Sequence[int],
             weights: torch.Tensor, offsets: torch.Tensor, alignment: int, device: torch.device,
             new_alignment: Optional[int] = None):
    """The packed rows ``weights`` (uint8, rows at ``alignment``; ``offsets`` per feature, as
    fbgemm keeps them: the byte where the feature's table starts) packed again for ``device``: at
    ``new_alignment`` (default: the device's), in the placements and table offsets fbgemm's
    IntNBit TBE gives that device. Returns ``(weights, placements, offsets)`` on ``device``, the
    last two per feature; each row's bytes are copied unchanged, the padding is zero.
    """
    require_fbgemm()
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
        nbit_construct_split_state,
        rounded_row_size_in_bytes,
        unpadded_row_size_in_bytes,
    )

    types = _fbgemm_types()
    new_alignment = row_alignment(device) if new_alignment is None else int(new_alignment)
    specs = [("", int(r), int(d), types[t], _location(device)) for r, d, t in rows_dims_dtypes]
    state = nbit_construct_split_state(specs, cacheable=False, row_alignment=new_alignment)
    size = state.host_size if torch.device(device).type == "cpu" else state.dev_size
    out = torch.zeros(size, dtype=torch.uint8, device=device)
    source = weights.to(device)
    per_feature = offsets.tolist()
    old_starts = [per_feature[list(feature_table_map).index(t)] for t in range(len(rows_dims_dtypes))]
    for (rows, dim, dtype), old, new in zip(rows_dims_dtypes, old_starts, state.offsets):
        used = unpadded_row_size_in_bytes(dim, types[dtype])
        was = rounded_row_size_in_bytes(dim, types[dtype], alignment)
        now = rounded_row_size_in_bytes(dim, types[dtype], new_alignment)
        out[new:new + rows * now].view(rows, now)[:, :used] = source[old:old + rows * was].view(rows, was)[:, :used]
    placements = torch.tensor([state.placements[t].value for t in feature_table_map], dtype=torch.int32,
                              device=device)
    return out, placements, torch.tensor([state.offsets[t] for t in feature_table_map], dtype=torch.int64,
                                         device=device)


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
    quantized rows, uvm rows, placements, offsets, types, D offsets, cache weights and cache
    locations (the ``q_*`` buffers); ``q`` its ints. A typed function TorchScript compiles: the
    eager quantized groups and their serving twins call it alike."""
    if weights[0].device.type == "cuda" and q["row_alignment"] % 16 != 0:
        raise RuntimeError(
            "fxrec: these quantized tables were packed for CPU (row alignment 1) and CUDA's lookup needs rows "
            "aligned to 16 bytes: move the fxrec model to CUDA (model.to('cuda') packs them again) before "
            "scripting or exporting it for CUDA, or transform it on CUDA"
        )
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
