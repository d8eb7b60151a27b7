"""What a group of lookups is, as plain frozen data: its tables, its features, its fused optimizer.

The group module (:mod:`fxrec.runtime.group`) is built from these; the kernels
(:mod:`fxrec.runtime.kernels`) answer from them alone whether they can run a group, so a
decision can be made (and explained) for a device that is not present, without building anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


#: fbgemm's training TBE stores dims that are a multiple of this; fxrec pads other dims up to it.
DIM_ALIGNMENT = 4


# fbgemm's CUDA TBE takes dims up to 2048, but above 1024 (its legacy_max_embedding_dim) its pooled
# forward hands over to the experimental "TBE v2" kernel. On an H100 (fbgemm-gpu 1.6.0) that gave
# wrong sums for dims 1028, 1152 and 2048, one table or two, fbgemm called by hand without fxrec
# (max error 4.6 to 9.7 on N(0, 1) rows; dim 1024 exact): wider tables go to PyTorch's lookups,
# in groups of their own (group_lookups).
CUDA_MAX_DIM = 1024
#: What PyTorch's lookups (the reference kernel) fuse on CUDA, where wider tables run: SGD, which
#: keeps no state (the Adagrads' states live in fbgemm's TBE there, which cannot hold such tables).
CUDA_WIDE_FUSED = ("sgd",)


def pad_dim(dim: int, align: int = DIM_ALIGNMENT) -> int:
    """``dim`` rounded up to a multiple of ``align``: the width a table is stored with in a TBE
    (the extra columns are zeros no user sees)."""
    return -(-int(dim) // align) * align


def stored_widths(tables, pooling: str, aligns) -> list:
    """Per table, the width a TBE stores it with: its dim rounded up to its ``aligns`` entry; in
    a sequence group (one width per fbgemm module) the widest of those."""
    widths = [pad_dim(t.dim, a) for t, a in zip(tables, aligns)]
    return [max(widths)] * len(widths) if pooling == "none" else widths


def real_columns_index(tables, features, stored) -> list:
    """The columns of a pooled TBE output (features side by side at their tables' ``stored``
    widths) that hold the features' real dims, in order; empty when nothing is padded."""
    if all(w == t.dim for t, w in zip(tables, stored)):
        return []
    cols, at = [], 0
    for f in features:
        cols.extend(range(at, at + tables[f.table].dim))
        at += stored[f.table]
    return cols


@dataclass(frozen=True)
class FeatureSpec:
    """One lookup of a group, as the runtime needs it.

    form:
      ``bag``        1-D ids with offsets (``nn.EmbeddingBag`` / ``F.embedding_bag``)
      ``pooled_seq`` 2-D ``[B, L]`` ids pooled over L (``nn.Embedding`` then sum/mean over dim 1)
      ``single``     1-D ``[B]`` ids, one row each (``nn.Embedding`` on a column)
      ``seq``        ids of any shape, no pooling (``nn.Embedding`` sequence lookup)
    padding_idx: the table's padding row, or None. For ``bag`` it is excluded from the bag (as
      ``nn.EmbeddingBag`` does); for the other forms it is looked up but gets no gradient (as
      ``nn.Embedding`` does).
    """

    name: str
    table: int
    form: str
    padding_idx: Optional[int] = None
    include_last_offset: bool = False
    weighted: bool = False
    # False where no gradient can reach the lookup's output (the model detaches it, or passes it only
    # to a no_grad block or to integer results): as in PyTorch, its ids get no entry in the table's
    # sparse gradient (a zero entry would still move the row under a lazy optimizer such as SparseAdam)
    grad: bool = True


#: Where a table's rows live on a GPU (fbgemm's EmbeddingLocation): ``device`` (HBM), ``managed``
#: (unified memory in host RAM, read over the bus) or ``managed_caching`` (unified memory with a
#: cache of rows in HBM). On CPU every table is in host memory, whatever its placement says.
PLACEMENTS = ("device", "managed", "managed_caching")


@dataclass(frozen=True)
class TableSpec:
    name: str
    num_rows: int
    dim: int
    sparse: bool = False
    dtype: str = "float32"  # of the weight as the model held it when captured
    placement: str = "device"  # one of PLACEMENTS (fbgemm's TBE on CUDA; place_tables decides)
    weights: str = ""  # a WEIGHTS_PRECISIONS key: stored so by weights_precision=; "" as the model holds it


@dataclass(frozen=True)
class FusedSpec:
    """An optimizer applied inside backward: ``sgd``, ``adagrad``, ``rowwise_adagrad``, ``adam``,
    ``lamb`` (:class:`fxrec.optim.LazyAdam`, :class:`fxrec.optim.LazyLamb`: fbgemm's, CUDA only),
    their partial row-wise forms or ``lars_sgd`` (:class:`fxrec.optim.LarsSGD`, CUDA only),
    with its learning rate, eps, (Adam, LAMB) betas and decoupled weight decay, and (row-wise Adagrad)
    weight decay in ``weight_decay_mode`` and ``max_norm``. Which code applies it is the group's training
    kernel's business."""

    kind: str
    lr: float
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    #: row-wise Adagrad's: "l2" (the decay is added to the gradient, and so to the sum of squares)
    #: or "decoupled" (``w *= 1 - lr * weight_decay``); "" without weight decay
    weight_decay_mode: str = ""
    #: LARS-SGD's (:class:`fxrec.optim.LarsSGD`)
    momentum: float = 0.0
    eta: float = 0.0
    #: row-wise Adagrad's: after its update, a row whose L2 norm exceeds this is scaled down to it
    #: (fbgemm's ``max_norm``); 0 for none
    max_norm: float = 0.0

    @property
    def options(self) -> Tuple[str, ...]:
        """What the update does beyond its kind's plain arithmetic, which a kernel may lack
        (``Kernel.supports(options=)``): "weight decay" (row-wise Adagrad's, in
        ``weight_decay_mode``), "max_norm"."""
        return tuple(o for o, on in (("weight decay", self.weight_decay_mode), ("max_norm", self.max_norm)) if on)


# Names of the fused optimizer's states per table, in split_optimizer_states() order.
FUSED_STATE_NAMES = {"sgd": (), "adagrad": ("sum",), "rowwise_adagrad": ("sum",), "adam": ("exp_avg", "exp_avg_sq"),
                     "lamb": ("exp_avg", "exp_avg_sq"), "partial_rowwise_adam": ("exp_avg", "exp_avg_sq"),
                     "partial_rowwise_lamb": ("exp_avg", "exp_avg_sq"), "lars_sgd": ("momentum_buffer",)}

#: ``weights_precision=``: an fp32 table stored in fbgemm's TBE at a lower precision (its parameter
#: becomes a view of those rows); the lookups still give fp32.
WEIGHTS_PRECISIONS = {"fp16": "float16", "bf16": "bfloat16"}


def weights_dtype(weights: str):
    """The torch dtype of a table stored as ``weights`` (a WEIGHTS_PRECISIONS key), None for ""."""
    import torch

    return getattr(torch, WEIGHTS_PRECISIONS[weights]) if weights else None


def table_dtype(group):
    """The torch dtype of a group's (or GroupSpec's) tables as the user's model holds them: float32,
    or float16 (one per group: the dtype is part of the group key)."""
    import torch

    return getattr(torch, group.tables[0].dtype) if group.tables else torch.float32

#: Bytes of a fused optimizer's fp32 states as (per row, per value of the row): Adagrad a sum a
#: value, row-wise Adagrad one a row, Adam and LAMB two moments a value, their partial row-wise
#: forms one a value and one a row, LARS-SGD a momentum a value. The one table the planner, place_tables and the report use.
FUSED_STATE_BYTES = {"sgd": (0, 0), "adagrad": (0, 4), "rowwise_adagrad": (4, 0), "adam": (0, 8), "lamb": (0, 8),
                     "partial_rowwise_adam": (4, 4), "partial_rowwise_lamb": (4, 4), "lars_sgd": (0, 4)}

#: Fused optimizers that also keep a step count (one per group: fbgemm's ``iter``, for bias correction).
#: The dtypes ``quantize=`` stores a table in for serving (fbgemm's IntNBit kernel's).
QUANT_DTYPES = ("fp32", "fp16", "int8", "int4", "int2")
STEPPED = ("adam", "lamb", "partial_rowwise_adam", "partial_rowwise_lamb")

#: Fused optimizers only fbgemm's CUDA build has (its CPU build: SGD and the Adagrads).
CUDA_ONLY = STEPPED + ("lars_sgd",)

#: Fused optimizers with a per-row state that averages over the row (as fbgemm stores it: padded).
ROW_MEAN = ("rowwise_adagrad", "partial_rowwise_adam", "partial_rowwise_lamb")

#: Optimizers whose update of a row reads the whole row: a mean over it (ROW_MEAN) or its norms
#: (LAMB's and LARS-SGD's trust ratios). A column shard holds part of the row: not on column-wise tables.
WHOLE_ROW = ROW_MEAN + ("lamb", "lars_sgd")


@dataclass(frozen=True)
class GroupSpec:
    """Everything a kernel's ``supports()`` may look at: no tensors, no modules."""

    tables: Tuple[TableSpec, ...]
    features: Tuple[FeatureSpec, ...]
    pooling: str  # sum | mean | none
    quantized: bool = False

    @property
    def pooled(self) -> bool:
        return self.pooling != "none"

    @property
    def weights(self) -> str:
        """The precision (WEIGHTS_PRECISIONS) its tables are stored in by ``weights_precision=``,
        or "" (as the model holds them). One per group: it is part of the group key."""
        return self.tables[0].weights if self.tables else ""

    @property
    def half(self) -> bool:
        """The user's model holds the tables in fp16 (not stored so by weights_precision=): the
        lookups give fp16 rows, as PyTorch's do."""
        return bool(self.tables) and self.tables[0].dtype == "float16"

    @property
    def row_bytes(self) -> int:
        """Bytes of one value of a table as the group's TBE stores it (fp32 4, fp16 and bf16 2)."""
        return 2 if self.weights or self.half else 4

    @property
    def padded_rows(self) -> Tuple[str, ...]:
        """Tables looked up by nn.Embedding with a padding row (that row gets no gradient)."""
        return tuple(sorted({self.tables[f.table].name for f in self.features
                             if f.padding_idx is not None and f.form != "bag"}))
