"""Unified memory in a plan: with ``fxrec.plan(..., device="cuda", hbm_budget=)``, which of each
rank's shards live in GPU memory (HBM) and which in unified memory (host memory the GPU reads
over the bus, with an HBM cache), and what the cached ones add to the rank's step.

``memory_per_rank`` is then what a rank holds in all, GPU and host memory together, and
``hbm_budget`` the GPU memory of it. A rank's shards are placed by the rule
``transform(hbm_budget=)`` applies on each rank (:func:`fxrec.passes.place_tables.place`): all in
HBM, then, while over the budget, the largest shard that may move goes to unified memory. A
shard is counted as transform counts a rank's piece of a table (trained, with the plan's
optimizer): its rows at their stored width (padded to 4 columns, as fbgemm's TBE holds them), the
states of an optimizer fused into fbgemm's backward, or a dense gradient without one; it may
move only with a fused optimizer (then fbgemm alone reads and writes its rows). Data-parallel
tables count whole with their dense gradient and stay, as do shards wider than fbgemm's CUDA
kernels take and tables the model holds in fp16 (they train on PyTorch's lookups). In a plan for
serving (``quantize=``) a quantized piece is counted as transform counts it for serving
(place_tables.quantized_held: its packed rows, movable to unified memory with an HBM cache of them,
or without one where the budget is not met with it); data-parallel tables (the model's own rows)
and the model's fp16 tables kept fp16 stay, counted as transform counts the model's lookups (dims
rounded up to 4) or, where some fp16 table is quantized and transform may pack them instead, the
larger of that and their packed rows (transform may move those fbgemm's kernel reads, sum bags
and sequences of dims a multiple of 4, which a TableSpec does not tell apart: the plan then
counts more GPU memory than transform takes). Its packed pieces are counted in one TBE for each
kind above; transform keeps sum and mean bags in groups of their own (with a cache each), which a
TableSpec does not tell apart either: near the budget its caches, and so its placements, can
differ from the plan's (``fxrec.explain(plan=plan, mode="inference", ...)`` gives transform's).

An estimate, as the planner's other figures are: a rank's pieces are counted in one TBE for each
kind transform groups apart (pooled or not, stored precision, fused optimizer or not), with one
cache each at its widest cached width; transform may group them further (by dims and features),
so a cache here may differ from transform's by a few sets of 32 rows.
``fxrec.explain(model, example, plan=plan, device="cuda")`` gives transform's exact figures.

Cost: with ids uniform over a table's rows, ``cache_load_factor`` of a cached shard's row reads
and writes hit the cache; the rest cross the bus at ``uvm_bandwidth`` instead of
``memory_bandwidth``, and so do all reads and writes of a per-value optimizer state (fbgemm keeps
it in unified memory, uncached; a row-wise state stays in HBM):
``extra = ids * ((1 - lf) * 3 * c * w + 2 * b * c) * (1 / uvm - 1 / mem)`` for a shard of c
columns, w bytes a stored value and b bytes of optimizer state a value; served, a forward's reads
of q bytes a packed row, ``extra = ids * (1 - lf) * q * (1 / uvm - 1 / mem)`` (uncached: all of
them, ``lf`` 0).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from ..runtime.specs import CUDA_MAX_DIM, CUDA_WIDE_FUSED, pad_dim
from .cost import CUDA_FUSED_KINDS, OPTIMIZER_STATE, CostModel
from .specs import DATA_PARALLEL, TableSpec, Topology

#: a piece of a table on a rank: (spec, optimizer kind, sharding type, rows, columns)
Piece = Tuple[TableSpec, str, str, int, int]


def _fused(spec: TableSpec, opt: str, sharding: str, cols: int) -> Tuple[bool, bool]:
    """``(fused, movable)``: whether a kernel applies the optimizer to the piece inside backward
    (no gradient), and whether fbgemm's kernel alone reads and writes its rows. Pieces wider
    than fbgemm's CUDA kernels take run on PyTorch's lookups, which fuse SGD only there; no
    optimizer is fused into the model's own fp16 tables."""
    if sharding == DATA_PARALLEL or spec.dtype != "fp32":
        return False, False
    if pad_dim(cols) > CUDA_MAX_DIM:
        return opt in CUDA_WIDE_FUSED, False
    return opt in CUDA_FUSED_KINDS, opt in CUDA_FUSED_KINDS


def held(piece: Piece, cm: Optional[CostModel] = None):
    """The piece as place_tables' rule counts it (keyed by its table's name; its width padded
    to 4 columns, as transform counts it; ``cm``: a plan for serving's, where it counts as served)."""
    from ..passes.place_tables import Held, quantized_held

    spec, opt, sharding, rows, cols = piece
    if cm is not None and cm.serving:
        if sharding == DATA_PARALLEL:  # the model's own rows (no gradient when serving)
            return Held(spec.name, spec.name, spec.num_rows, spec.dim, spec.element_bytes)
        kept = cm.kept_fp16(spec)
        if kept:  # the model's own fp16 lookups (as transform counts them: 4-column rows), or packed: the larger
            most = max(cm.served_row(spec, cols), pad_dim(cols) * 2) if kept == "either" else pad_dim(cols) * 2
            return Held(spec.name, spec.name, rows, pad_dim(cols), 2, packed=rows * most)
        return quantized_held(spec.name, spec.name, rows, cm.served_width(spec, cols), spec.quantize)
    if sharding == DATA_PARALLEL:
        return Held(spec.name, spec.name, spec.num_rows, spec.dim, spec.element_bytes, "", True)
    fused, movable = _fused(spec, opt, sharding, cols)
    return Held(spec.name, spec.name, rows, pad_dim(cols), spec.stored_bytes(sharding),
                ("adam" if opt == "lazy_adam" else opt) if fused else "", not fused, None, movable)


def placements(pieces: Sequence[Piece], topology: Topology, cm: CostModel) -> Tuple[Dict[str, str], int]:
    """Where one rank's ``pieces`` live under the topology's ``hbm_budget``: ``(table ->
    "managed_caching" for those in unified memory, or "managed" for quantized ones without a cache,
    the HBM they take)``; the caller compares the HBM with the budget. Pieces are counted in one
    TBE (one cache) for each kind transform groups apart: pooled or not, stored precision,
    optimizer fused or not; served, pooled or not (unpooled: by dims rounding up to one multiple
    of 4), model dtype, packed or not."""
    from ..passes.place_tables import place

    groups: Dict[tuple, list] = {}
    for p in pieces:
        h = held(p, cm)
        spec = p[0]
        key = ((spec.pooled, 0 if spec.pooled else pad_dim(spec.dim), spec.dtype, h.packed is not None) if cm.serving
               else (spec.pooled, h.weight_bytes, h.fused))
        groups.setdefault(key, []).append(h)
    return place(list(groups.values()), topology.hbm_budget, topology.cache_load_factor)


def cached_extra_ms(cm: CostModel, piece: Piece, where: str = "managed_caching") -> float:
    """What a piece adds to its rank's step in unified memory (ms; see the module doc), placed
    ``where`` ("managed": without a cache)."""
    spec, opt, sharding, rows, cols = piece
    topo = cm.topology
    missed = 1 - topo.cache_load_factor if where == "managed_caching" else 1.0
    if cm.serving:
        over_bus = missed * cm.served_row(spec, cols)
    else:
        b = OPTIMIZER_STATE[opt][1]
        over_bus = missed * 3 * cols * spec.stored_bytes(sharding) + 2 * b * cols
    to_bytes_per_ms = 1e9 / 1e3
    slower = 1 / (topo.uvm_bandwidth * to_bytes_per_ms) - 1 / cm.mem_bw
    return cm.ids(spec, sharding, rows) * over_bus * max(slower, 0.0)


def over_budget(rank: int, need: int, topology: Topology, pieces: Sequence[Piece], cm: CostModel) -> str:
    """The words of a plan error for a rank whose tables cannot meet the budget."""
    from .specs import format_bytes

    stay = sorted({p[0].name for p in pieces if not held(p, cm).movable})
    ways = ["raise hbm_budget", "lower cache_load_factor"]
    if cm.serving:
        ways.append("quantize to fewer bits")
    elif any(p[2] != DATA_PARALLEL and p[0].dtype == "fp32" and pad_dim(p[4]) <= CUDA_MAX_DIM and not held(p).fused
             for p in pieces):  # (a fused optimizer would let such a piece move)
        ways.append("fuse the optimizer")
    if any(p[2] == DATA_PARALLEL for p in pieces):
        ways.append("shard the data-parallel tables")
    return (f"fxrec.plan: rank {rank}'s tables need {format_bytes(need)} of GPU memory with every shard that may "
            f"leave it in unified memory (cache_load_factor={topology.cache_load_factor:g}), more than "
            f"hbm_budget={format_bytes(topology.hbm_budget)}; "
            + (f"what stays in GPU memory: {_listed(stay)} (data-parallel tables, the model's fp16 tables"
               + (")" if cm.serving else ", and shards trained without an optimizer fused into fbgemm's backward)")
               if stay
               else "the HBM caches alone take more")
            + ". " + ", ".join(ways).capitalize() + ", or use more ranks")


def _listed(names: List[str], most: int = 8) -> str:
    return repr(names[:most])[:-1] + (f", ... {len(names) - most} more]" if len(names) > most else "]")
