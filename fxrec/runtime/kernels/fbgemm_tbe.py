"""fbgemm_gpu's training TBE module: the import of fbgemm_gpu (with :mod:`.fbgemm_nbit`'s, the
only one), a clear error where it fails, the module built for a group's tables, and its storage
and cache. :mod:`.fbgemm` binds a group to it and runs it."""

from __future__ import annotations

import warnings
from typing import List, Optional, Sequence, Tuple

import torch

from ..specs import STEPPED, FusedSpec

#: The optimizers fbgemm's CPU build fuses into its backward (its CUDA build: these and specs.CUDA_ONLY).
CPU_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")

_IMPORT_ERROR: Optional[BaseException] = None

try:  # fbgemm prints version-table warnings at import on some torch releases; they are harmless
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm.*)
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            BoundsCheckMode,
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
            WeightDecayMode,
        )
except Exception as e:  # pragma: no cover - exercised only on broken installs
    _IMPORT_ERROR = e


def require_fbgemm() -> None:
    """Raise a clear error when fbgemm_gpu cannot be used with the installed torch."""
    if _IMPORT_ERROR is not None:
        raise ImportError(
            "fxrec needs fbgemm_gpu built for the installed torch "
            f"(torch {torch.__version__}): install 'fbgemm-gpu-cpu==1.8.0' for torch 2.13 "
            "on CPU-only machines, 'fbgemm-gpu==1.6.0' for torch 2.11 with CUDA "
            "(pip install -e '.[cpu]' or '.[cuda]' pins both). "
            f"Import failed with: {_IMPORT_ERROR!r}"
        ) from _IMPORT_ERROR


def fbgemm_available() -> bool:
    return _IMPORT_ERROR is None


def import_error() -> Optional[BaseException]:
    """Why fbgemm_gpu did not import (None: it did)."""
    return _IMPORT_ERROR


def make_training_tbe(
    rows_dims: Sequence[Tuple[int, int]],
    feature_table_map: List[int],
    pooling: str,
    device: torch.device,
    fused: Optional[FusedSpec] = None,
    placements: Optional[Sequence[str]] = None,
    cache_load_factor: float = 0.2,
    weights: str = "",
    half_out: bool = False,
) -> "SplitTableBatchedEmbeddingBagsCodegen":
    """Build fbgemm's SplitTableBatchedEmbeddingBagsCodegen for fp32 or fp16 tables on `device` (stored
    in ``weights``, "fp16", where given: fbgemm's ``weights_precision``; outputs fp32, or fp16 with
    ``half_out``: the user's own fp16 tables, whose lookups give fp16 as PyTorch's do).

    ``fused=None``: the module is used for its forward kernel only (fxrec computes PyTorch's
    gradients itself), so fbgemm gets exact SGD with learning rate zero, which never runs.
    Otherwise the update fbgemm fuses into its backward (``adam`` on CUDA only), with the spec's
    arguments. ``placements``: per table, where its rows live on CUDA (specs.PLACEMENTS; default
    ``device``), with an HBM cache of ``cache_load_factor`` of the cached rows; on CPU, host memory.
    """
    require_fbgemm()
    on_cpu = device.type == "cpu"
    kind = fused.kind if fused is not None else "none"
    placements = list(placements or ["device"] * len(rows_dims))
    if on_cpu and kind not in CPU_OPTIMIZERS + ("none",):
        raise ValueError(f"fxrec: fbgemm's CPU build has no fused {kind}; it runs on CUDA only")
    where = {"device": EmbeddingLocation.DEVICE, "managed": EmbeddingLocation.MANAGED,
             "managed_caching": EmbeddingLocation.MANAGED_CACHING}
    locations = [EmbeddingLocation.HOST if on_cpu else where[p] for p in placements]
    compute = ComputeDevice.CPU if on_cpu else ComputeDevice.CUDA
    mode = {"sum": PoolingMode.SUM, "mean": PoolingMode.MEAN, "none": PoolingMode.NONE}[pooling]
    kinds = {"none": EmbOptimType.EXACT_SGD, "sgd": EmbOptimType.EXACT_SGD, "adagrad": EmbOptimType.EXACT_ADAGRAD,
             "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "adam": EmbOptimType.ADAM, "lamb": EmbOptimType.LAMB,
             "partial_rowwise_adam": EmbOptimType.PARTIAL_ROWWISE_ADAM,
             "partial_rowwise_lamb": EmbOptimType.PARTIAL_ROWWISE_LAMB, "lars_sgd": EmbOptimType.LARS_SGD}
    args = dict(learning_rate=0.0) if fused is None else dict(learning_rate=float(fused.lr), eps=float(fused.eps))
    if kind in STEPPED:  # fbgemm's Adam and LAMB read weight_decay themselves (decoupled: see LazyAdam)
        args.update(beta1=float(fused.beta1), beta2=float(fused.beta2), weight_decay=float(fused.weight_decay))
    elif kind == "lars_sgd":
        args.update(eta=float(fused.eta), momentum=float(fused.momentum), weight_decay=float(fused.weight_decay))
    elif kind == "rowwise_adagrad":
        if fused.weight_decay_mode:
            modes = {"l2": WeightDecayMode.L2, "decoupled": WeightDecayMode.DECOUPLE}
            args.update(weight_decay=float(fused.weight_decay), weight_decay_mode=modes[fused.weight_decay_mode])
        if fused.max_norm:  # (fbgemm's CUDA kernel caps the updated rows; its CPU build ignores it)
            args.update(max_norm=float(fused.max_norm))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(int(r), int(d), loc, compute) for (r, d), loc in zip(rows_dims, locations)],
            feature_table_map=list(feature_table_map),
            optimizer=kinds[kind],
            **args,
            pooling_mode=mode,
            cache_load_factor=float(cache_load_factor),
            weights_precision=SparseType.FP16 if weights == "fp16" else SparseType.FP32,  # (bf16: refused)
            output_dtype=SparseType.FP16 if half_out else SparseType.FP32,
            device=device if not on_cpu else None,
            # fxrec validates ids itself, with messages that name the table and feature.
            bounds_check_mode=BoundsCheckMode.NONE,
        )
    return tbe


def sync_cache(tbe, drop: bool) -> None:
    """fbgemm's ``flush`` (cached rows written back) and, with ``drop``, ``reset_cache_states``."""
    tbe.flush()
    if drop:
        tbe.reset_cache_states()


def tbe_flat_weights(tbe: "SplitTableBatchedEmbeddingBagsCodegen") -> torch.Tensor:
    """The single flat fp32 storage that holds every table of `tbe`."""
    return tbe.weights_host if tbe.weights_host.numel() > 0 else tbe.weights_dev
