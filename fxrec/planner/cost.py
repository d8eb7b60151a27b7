"""Memory and cost model of one shard: bytes it takes on its rank, milliseconds it adds to its
rank's training step. Deliberately simple: a rough, documented estimate to balance ranks with,
not a simulator.

Notation: W ranks, P ranks per host, B samples per rank per step (``batch_size``), G = B * W
samples per step in all; a table has R rows, D columns, e bytes per element (4 for fp32; the
rows a sharded shard stores and reads count w bytes: 2 for ``weights_precision="fp16"``, else
w = e; outputs and gradients travel at e), L ids
per sample (``pooling_factor``, all its features together), F features; its output rows per
sample are O = F (pooled) or O = L (sequence lookups). Optimizer state per row is
``s(c) = a + b * c`` bytes for a shard of c columns (:data:`OPTIMIZER_STATE`, fp32 state).
Bandwidths are the topology's: ``mem`` (row reads on one rank), ``intra`` (to the other ranks of
the host), ``inter`` (to other hosts), all GB/s.

Memory (bytes) of a shard of r rows and c columns::

    r * c * w  +  r * s(c)  (+ r * c * e: the shard's dense gradient, for data-parallel tables, and
                             for sharded ones whose optimizer is not fused: "none", "sgd_momentum",
                             "adam" (torch.optim.Adam), and on CPU the lazy Adam and LAMB kinds;
                             SGD, Adagrad and row-wise Adagrad are applied inside backward, and on
                             CUDA the lazy Adam and LAMB kinds too: no gradient)

Cost (ms per step) = lookup + communication + a fixed overhead, charged to the rank that holds
the shard::

    lookup(n ids, c cols) = n * (3 * c * w + 2 * s(c)) / mem
        forward reads each row once; backward reads and writes it and its optimizer state.
    spread(x bytes)       = x / W * ((P - 1) / intra + (W - P) / inter)
        x exchanged evenly with all W ranks (the 1/W kept by the rank itself is free).

    table_wise, a column_wise shard of c columns (all G * L ids come to this rank):
        lookup(G*L, c) + spread(8*G*L  +  2 * G*O*c*e)
        int64 ids in (all-to-all), outputs out and their gradients back (all-to-all).
    row_wise shard of r rows (ids assumed uniform over rows: it gets n = G*L*r/R of them):
        lookup(n, D) + spread(8*n + 2*G*F*D*e)                     pooled: partial sums for all G
                                                                    samples out (all-to-all, added on
                                                                    the sample's rank), gradients back
        lookup(n, D) + spread(8*n + 2*n*D*e)                        sequence: one row per id
    table_row_wise shard of r rows on a host of P ranks:
        lookup(n, D) + spread(8*n + 2*G*F*D*e/P) + 2*G*F*D*e*(P-1)/P/intra
        partial sums reduce-scattered inside the host, then sent on as one slice per rank (the
        runtime sends them straight to every rank instead: this exchange is not built).
    data_parallel (every rank):
        2*B*L*D*e/mem  +  R * (3*D*e + 2*s(D)) / mem  +  2*(W-1)/W * R*D*e / ring
        local lookups and their dense gradient, a dense optimizer step over every row, and a
        ring all-reduce of the full gradient (ring = inter when there are several hosts, else intra).

Every shard that holds rows also costs a fixed :data:`SHARD_OVERHEAD_MS` (its share of kernel
launches, id bucketing and output slicing): it keeps tiny tables whole, and is negligible next to
the lookups of a real table.

A plan for serving (``quantize=``; :attr:`TableSpec.quantize`) counts what serving holds and
does: a sharded shard's rows as fbgemm's IntNBit kernel packs them for the topology's device,
q(c) bytes a row (fbgemm's own row sizes: the stored width, a scale and bias of 4 bytes for the
integer dtypes, the row rounded up to 16 bytes on CUDA), at the width the group stores: c rounded
up to what the dtype needs (int8 4, int4 8, int2 16, fp16 2), and for unpooled tables the widest
of the unpooled tables they may share a group with (one model dtype, dims rounding up to one
multiple of 4: fbgemm stores a sequence group at one width); the model's fp16 tables kept fp16
(every one of them ``"fp16"``: their groups stay the model's lookups) at their dim, 2 bytes each
(where some fp16 table is quantized, transform decides by group, which a TableSpec does not say:
the larger of the two). No optimizer state and no gradient; a data-parallel shard the model's own rows; the
cost is the forward's alone::

    memory r * q(c) (sharded), R * D * e (data-parallel)
    lookup(n ids, c cols) = n * q(c) / mem
    and the exchanges above one way (ids in, outputs out: no gradients back); data-parallel
    B*L*D*e/mem.

With ``hbm_budget=`` (CUDA), a shard the rule puts in unified memory also costs its reads that miss
its HBM cache at the bus's bandwidth (:mod:`fxrec.planner.unified`).

Left out: latency of collectives, hot rows (ids are taken as uniform over rows: a cache hits
``cache_load_factor`` of them), skew in the id distribution, input/output buffers' memory. A
shard with no rows costs nothing.
"""

from __future__ import annotations

from typing import Dict, Sequence, Tuple

from ..runtime.specs import CUDA_MAX_DIM, CUDA_WIDE_FUSED, FUSED_STATE_BYTES, pad_dim
from .specs import (
    COLUMN_WISE, DATA_PARALLEL, ROW_WISE, TABLE_ROW_WISE, TABLE_WISE, TableSpec, Topology,
)

#: Optimizer state as (bytes per row, bytes per row and column), fp32: none, SGD with momentum a
#: buffer like the weights, and the fused optimizers' (:data:`fxrec.runtime.specs.FUSED_STATE_BYTES`).
#: "adam" is torch.optim.Adam (a dense gradient); "lazy_adam" fxrec.optim.LazyAdam (fbgemm's Adam).
OPTIMIZER_STATE: Dict[str, Tuple[int, int]] = {"none": (0, 0), "sgd_momentum": (0, 4), **FUSED_STATE_BYTES,
                                               "lazy_adam": FUSED_STATE_BYTES["adam"]}
#: Kinds transform(plan=..., optimizer=...) applies inside backward on sharded tables (no gradient):
#: SGD and the Adagrads on every device, the lazy Adam and LAMB kinds and LARS-SGD on CUDA (fbgemm's CUDA build).
FUSED_KINDS = ("sgd", "adagrad", "rowwise_adagrad")
CUDA_FUSED_KINDS = FUSED_KINDS + ("lazy_adam", "lamb", "partial_rowwise_adam", "partial_rowwise_lamb", "lars_sgd")
_OPTIMIZER_ALIASES = {"row_wise_adagrad": "rowwise_adagrad", "rowwiseadagrad": "rowwise_adagrad", "": "none"}

ID_BYTES = 8  # int64 ids
#: Fixed cost of every non-empty shard, ms per step (a rough figure: a few microseconds).
SHARD_OVERHEAD_MS = 0.002


def optimizer_kind(optimizer) -> str:
    """The state kind of an optimizer: None, one of :data:`OPTIMIZER_STATE`'s names, or an
    :mod:`fxrec.optim` optimizer (SGD, SGD with momentum, Adagrad, RowWiseAdagrad, Adam, LazyAdam, LazyLamb, PartialRowWise*,
    LarsSGD)."""
    if optimizer is None:
        return "none"
    if isinstance(optimizer, str):
        kind = optimizer.strip().lower()
        kind = _OPTIMIZER_ALIASES.get(kind, kind)
        if kind not in OPTIMIZER_STATE:
            raise ValueError(f"fxrec.plan: unknown optimizer {optimizer!r}; use one of {sorted(OPTIMIZER_STATE)}")
        return kind
    from .. import optim

    if isinstance(optimizer, optim.SGD):
        return "sgd_momentum" if optimizer.momentum else "sgd"
    if isinstance(optimizer, optim.RowWiseAdagrad):
        return "rowwise_adagrad"
    if isinstance(optimizer, optim.Adagrad):
        return "adagrad"
    if isinstance(optimizer, optim.Adam):
        return "adam"
    if isinstance(optimizer, optim.LazyAdam):
        return "lazy_adam"
    if isinstance(optimizer, (optim.LazyLamb, optim.PartialRowWiseAdam, optim.PartialRowWiseLamb, optim.LarsSGD)):
        return optimizer.kind
    raise ValueError(
        f"fxrec.plan: cannot size the state of optimizer {optimizer!r}; pass one of {sorted(OPTIMIZER_STATE)} "
        "or an fxrec.optim optimizer"
    )


def optimizer_state_bytes(kind: str, rows: int, cols: int) -> int:
    """Bytes of optimizer state for ``rows`` x ``cols`` weights."""
    a, b = OPTIMIZER_STATE[kind]
    return rows * (a + b * cols)


class CostModel:
    """Bytes and estimated ms per step of shards, for one topology and batch size (see the
    module docstring for the formulas)."""

    def __init__(self, topology: Topology, batch_size: int, served: Sequence[TableSpec] = ()):
        """``served``: the tables of a plan for serving (their ``quantize`` set), else none."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"fxrec.plan: batch_size must be an int >= 1, got {batch_size!r}")
        self.topology = topology
        W = self.world_size = topology.world_size
        P = self.ranks_per_host = topology.ranks_per_host
        self.batch_size = batch_size
        self.global_batch = batch_size * W
        to_bytes_per_ms = 1e9 / 1e3
        self.mem_bw = topology.memory_bandwidth * to_bytes_per_ms
        self.intra_bw = topology.intra_host_bandwidth * to_bytes_per_ms
        self.inter_bw = topology.inter_host_bandwidth * to_bytes_per_ms
        # ms per byte exchanged evenly with every rank / with the ranks of one's host
        self.spread = ((P - 1) / self.intra_bw + (W - P) / self.inter_bw) / W
        self.host_spread = (P - 1) / P / self.intra_bw
        ring_bw = self.inter_bw if topology.hosts > 1 else self.intra_bw
        self.allreduce = 2 * (W - 1) / W / ring_bw
        self.serving = bool(served)  # (quantize=: forward only, packed rows)
        # the model's fp16 tables all kept fp16: quantize_tables leaves their groups the model's lookups
        self._fp16_kept = all(s.quantize == "fp16" for s in served if s.dtype == "fp16")
        self._widths = _sequence_widths(served, self._fp16_kept)
        self._rows: Dict[Tuple[str, int], int] = {}

    def kept_fp16(self, spec: TableSpec) -> str:
        """How the model's fp16 table ``spec`` kept fp16 is served: "kept" (the model's own lookups:
        every fp16 table is kept fp16), "either" (some other fp16 table is quantized: transform
        decides by group, which a TableSpec does not say: its own lookups or packed fp16 rows), or ""
        (not such a table: packed)."""
        if spec.dtype != "fp16" or spec.quantize != "fp16":
            return ""
        return "kept" if self._fp16_kept else "either"

    def served_width(self, spec: TableSpec, cols: int) -> int:
        """The width a sharded piece of ``cols`` columns of ``spec`` is stored at, served packed."""
        from ..passes.place_tables import quantized_widths

        return self._widths.get(spec.name) or quantized_widths([(cols, spec.quantize)], "sum")[0]

    def served_row(self, spec: TableSpec, cols: int) -> int:
        """Bytes of one row of ``cols`` columns of a sharded ``spec`` as served (see the module
        docstring; fbgemm_nbit.packed_bytes for packed rows; cached)."""
        key = (spec.name, cols)
        n = self._rows.get(key)
        if n is None:
            kept = self.kept_fp16(spec)
            n = 0
            if kept != "kept":
                from ..runtime.kernels.fbgemm_nbit import packed_bytes, row_alignment

                n = packed_bytes([(1, self.served_width(spec, cols), spec.quantize)],
                                 row_alignment(self.topology.device))[0]
            if kept:  # (fbgemm's TBE takes them only at dims a multiple of 4: not padded); "either": the larger
                n = max(n, cols * 2)
            self._rows[key] = n
        return n

    # ---------------------------------------------------------------- memory
    def shard_bytes(self, spec: TableSpec, opt: str, sharding: str, rows: int, cols: int) -> int:
        """Memory of a shard of ``rows`` x ``cols`` of ``spec`` sharded as ``sharding``."""
        if self.serving:  # rows as served (sharded), the model's own (data-parallel)
            return rows * (cols * spec.element_bytes if sharding == DATA_PARALLEL else self.served_row(spec, cols))
        a, b = OPTIMIZER_STATE[opt]
        cuda = self.topology.device == "cuda"
        # fbgemm's CUDA kernels take dims up to CUDA_MAX_DIM: a wider piece runs on PyTorch's lookups,
        # which fuse SGD there (CUDA_WIDE_FUSED); other optimizers: a dense gradient and torch.optim's
        # state (its local group's other tables too: not counted)
        wide = cuda and pad_dim(cols) > CUDA_MAX_DIM
        fused = CUDA_WIDE_FUSED if wide else CUDA_FUSED_KINDS if cuda else FUSED_KINDS
        # fbgemm's TBE holds a shard's rows padded to a multiple of 4 columns: on CUDA every sharded
        # table, on CPU those whose Adagrad states it keeps and those stored in fp16/bf16
        # (weights_precision=: only its TBE holds them so); the fused state it keeps is padded
        # too. Data-parallel tables stay the model's, torch.optim's states and gradients are of
        # the real columns.
        in_tbe = not wide and sharding != DATA_PARALLEL and (cuda or opt in ("adagrad", "rowwise_adagrad")
                                                             or bool(spec.weights))
        stored = pad_dim(cols) if in_tbe else cols
        state = stored if in_tbe and opt in fused else cols
        n = rows * stored * spec.stored_bytes(sharding) + rows * (a + b * state)
        if sharding == DATA_PARALLEL or opt not in fused:
            n += rows * cols * spec.element_bytes  # the dense gradient (a data-parallel shard is the whole table)
        return n

    # ------------------------------------------------------------------ cost
    def lookup_ms(self, spec: TableSpec, opt: str, ids: float, cols: int) -> float:
        """A sharded lookup's reads and update (rows as stored: weights_precision=; serving: its
        reads of packed rows)."""
        if self.serving:
            return ids * self.served_row(spec, cols) / self.mem_bw
        a, b = OPTIMIZER_STATE[opt]
        return ids * (3 * cols * spec.stored_bytes(ROW_WISE) + 2 * (a + b * cols)) / self.mem_bw

    def shard_cost(self, spec: TableSpec, opt: str, sharding: str, rows: int, cols: int) -> float:
        """Estimated ms per step that a shard of ``rows`` x ``cols`` adds to its rank."""
        if rows == 0 or cols == 0:
            return 0.0
        return SHARD_OVERHEAD_MS + self._variable_cost(spec, opt, sharding, rows, cols)

    def ids(self, spec: TableSpec, sharding: str, rows: int) -> float:
        """Ids a shard of ``rows`` rows looks up a step (a row-wise one: ids uniform over rows)."""
        G, L = self.global_batch, spec.pooling_factor
        if sharding in (ROW_WISE, TABLE_ROW_WISE):
            return G * L * rows / spec.num_rows
        return self.batch_size * L if sharding == DATA_PARALLEL else G * L

    def _variable_cost(self, spec: TableSpec, opt: str, sharding: str, rows: int, cols: int) -> float:
        G, L, e, D = self.global_batch, spec.pooling_factor, spec.element_bytes, spec.dim
        out_rows = spec.num_features if spec.pooled else L
        ids = self.ids(spec, sharding, rows)
        ways = 1 if self.serving else 2  # outputs out, and in training their gradients back
        if sharding in (TABLE_WISE, COLUMN_WISE):
            return self.lookup_ms(spec, opt, ids, cols) + self.spread * (ID_BYTES * ids + ways * G * out_rows * cols * e)
        if sharding == ROW_WISE:
            out = ways * G * spec.num_features * D * e if spec.pooled else ways * ids * D * e
            return self.lookup_ms(spec, opt, ids, D) + self.spread * (ID_BYTES * ids + out)
        if sharding == TABLE_ROW_WISE:
            if not spec.pooled:
                return self.lookup_ms(spec, opt, ids, D) + self.spread * (ID_BYTES * ids + ways * ids * D * e)
            partial = ways * G * spec.num_features * D * e
            P = self.ranks_per_host
            return (self.lookup_ms(spec, opt, ids, D) + self.spread * (ID_BYTES * ids + partial / P)
                    + self.host_spread * partial)
        if sharding == DATA_PARALLEL:
            if self.serving:  # local lookups alone
                return self.batch_size * L * D * e / self.mem_bw
            a, b = OPTIMIZER_STATE[opt]
            R = spec.num_rows
            local = 2 * self.batch_size * L * D * e / self.mem_bw
            update = R * (3 * D * e + 2 * (a + b * D)) / self.mem_bw
            return local + update + self.allreduce * R * D * e
        raise ValueError(f"fxrec.plan: unknown sharding type {sharding!r}")


def _sequence_widths(served: Sequence[TableSpec], fp16_kept: bool) -> Dict[str, int]:
    """Per unpooled table served packed, the width its group stores: the widest of the unpooled
    tables of its model dtype whose dims round up to its multiple of 4 (transform may group them:
    place_tables.quantized_widths of a sequence group; a group of fewer is never wider)."""
    groups: Dict[Tuple[int, str], list] = {}
    for s in served:
        if not s.pooled and not (s.dtype == "fp16" and s.quantize == "fp16" and fp16_kept):
            groups.setdefault((pad_dim(s.dim), s.dtype), []).append(s)
    if not groups:
        return {}
    from ..passes.place_tables import quantized_widths

    return {s.name: w for g in groups.values() for s, w in zip(g, quantized_widths([(s.dim, s.quantize) for s in g],
                                                                                    "none"))}
