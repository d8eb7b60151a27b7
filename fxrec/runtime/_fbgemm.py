"""The one place that imports fbgemm_gpu.

Everything else in fxrec asks this module for fbgemm's table-batched embedding (TBE) and
its enums, so that a missing or mismatched install fails once, with a message that says
what to install, instead of somewhere deep inside a pass.
"""

from __future__ import annotations

import warnings
from typing import List, Optional, Sequence, Tuple

import torch

_IMPORT_ERROR: Optional[BaseException] = None

try:  # fbgemm prints version-table warnings at import on some torch releases; they are harmless
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm.*)
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            BoundsCheckMode,
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
except Exception as e:  # pragma: no cover - exercised only on broken installs
    _IMPORT_ERROR = e


def require_fbgemm() -> None:
    """Raise a clear error when fbgemm_gpu cannot be used with the installed torch."""
    if _IMPORT_ERROR is not None:
        raise ImportError(
            "fxrec needs fbgemm_gpu built for the installed torch "
            f"(torch {torch.__version__}): install 'fbgemm-gpu-cpu==1.8.0' for torch 2.13 "
            "on CPU-only machines, 'fbgemm-gpu==1.6.0' for torch 2.11 with CUDA. "
            f"Import failed with: {_IMPORT_ERROR!r}"
        ) from _IMPORT_ERROR


def fbgemm_available() -> bool:
    return _IMPORT_ERROR is None


# fbgemm's training TBE rejects embedding dims that are not a multiple of this.
TBE_DIM_ALIGNMENT = 4

POOLING_CODES = {"sum": 0, "mean": 1, "none": 2}


def make_training_tbe(
    rows_dims: Sequence[Tuple[int, int]],
    feature_table_map: List[int],
    pooling: str,
    device: torch.device,
    optimizer: str = "none",
    learning_rate: float = 0.0,
    eps: float = 1e-8,
) -> "SplitTableBatchedEmbeddingBagsCodegen":
    """Build fbgemm's SplitTableBatchedEmbeddingBagsCodegen for fp32 tables on `device`.

    ``optimizer="none"``: the module is used for its forward kernel only (fxrec computes
    PyTorch's gradients itself), so fbgemm gets exact SGD with learning rate zero, which never
    runs. Otherwise ``"sgd"``, ``"adagrad"`` or ``"rowwise_adagrad"``: the update fbgemm fuses
    into its backward, with ``learning_rate`` and ``eps``.
    """
    require_fbgemm()
    on_cpu = device.type == "cpu"
    location = EmbeddingLocation.HOST if on_cpu else EmbeddingLocation.DEVICE
    compute = ComputeDevice.CPU if on_cpu else ComputeDevice.CUDA
    mode = {"sum": PoolingMode.SUM, "mean": PoolingMode.MEAN, "none": PoolingMode.NONE}[pooling]
    kinds = {
        "none": EmbOptimType.EXACT_SGD,
        "sgd": EmbOptimType.EXACT_SGD,
        "adagrad": EmbOptimType.EXACT_ADAGRAD,
        "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(int(r), int(d), location, compute) for r, d in rows_dims],
            feature_table_map=list(feature_table_map),
            optimizer=kinds[optimizer],
            learning_rate=0.0 if optimizer == "none" else float(learning_rate),
            eps=float(eps),
            pooling_mode=mode,
            device=device if not on_cpu else None,
            # fxrec validates ids itself, with messages that name the table and feature.
            bounds_check_mode=BoundsCheckMode.NONE,
        )
    return tbe


QUANT_DTYPES = ("fp32", "fp16", "int8", "int4", "int2")


def make_inference_tbe(
    rows_dims_dtypes: Sequence[Tuple[int, int, str]],
    feature_table_map: List[int],
    pooling: str,
    device: torch.device,
    weights: Sequence[torch.Tensor],
    output_dtype: str = "fp32",
) -> "torch.nn.Module":
    """fbgemm's IntNBitTableBatchedEmbeddingBagsCodegen holding ``weights`` quantized row-wise
    to each table's dtype (fp32, fp16, int8, int4, int2; integer types get an fp16 scale and
    bias per row, as fbgemm's quantize_embs lays them out)."""
    require_fbgemm()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fbgemm_gpu.split_embedding_configs import SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
            IntNBitTableBatchedEmbeddingBagsCodegen,
        )
        from fbgemm_gpu.tbe.utils.quantize import quantize_embs

        types = {"fp32": SparseType.FP32, "fp16": SparseType.FP16, "int8": SparseType.INT8,
                 "int4": SparseType.INT4, "int2": SparseType.INT2}
        location = EmbeddingLocation.HOST if device.type == "cpu" else EmbeddingLocation.DEVICE
        mode = {"sum": PoolingMode.SUM, "mean": PoolingMode.MEAN, "none": PoolingMode.NONE}[pooling]
        tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
            [("", int(r), int(d), types[t], location) for r, d, t in rows_dims_dtypes],
            feature_table_map=list(feature_table_map),
            pooling_mode=mode,
            device=device,
            output_dtype=types[output_dtype],
            bounds_check_mode=BoundsCheckMode.NONE,
        )
        tbe.initialize_weights()
        tbe.assign_embedding_weights(
            [quantize_embs(w.detach().float().to(device), types[t]) for w, (_, _, t) in zip(weights, rows_dims_dtypes)]
        )
    return tbe


def quant_align(dtype: str) -> int:
    """The dim a table must be a multiple of to be stored in ``dtype``."""
    require_fbgemm()
    from fbgemm_gpu.split_embedding_configs import SparseType

    return {"fp32": SparseType.FP32, "fp16": SparseType.FP16, "int8": SparseType.INT8,
            "int4": SparseType.INT4, "int2": SparseType.INT2}[dtype].align_size()


def tbe_flat_weights(tbe: "SplitTableBatchedEmbeddingBagsCodegen") -> torch.Tensor:
    """The single flat fp32 storage that holds every table of `tbe`."""
    return tbe.weights_host if tbe.weights_host.numel() > 0 else tbe.weights_dev


def operator_libraries() -> List[str]:
    """Paths of fbgemm_gpu's operator libraries, in the order fbgemm_gpu loads them (for a C++
    program that must load them before a model that calls fbgemm's operators)."""
    require_fbgemm()
    import os

    here = os.path.dirname(fbgemm_gpu.__file__)
    names = getattr(fbgemm_gpu, "fbgemm_gpu_libraries", None) or []
    return [p for p in (os.path.join(here, f"{n}.so") for n in names) if os.path.exists(p)]
