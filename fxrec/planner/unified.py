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
kernels take and tables the model holds in fp16 (they train on PyTorch's lookups).

An estimate, as the planner's other figures are: the rank's cached shards share one cache here
(at their widest width), where transform gives each of a rank's TBEs its own, sized by what it
caches; so a cache here may differ from transform's by a few sets of 32 rows.
``fxrec.explain(model, example, plan=plan, device="cuda")`` gives transform's exact figures.

Cost: with ids uniform over a table's rows, ``cache_load_factor`` of a cached shard's row reads
and writes hit the cache; the rest cross the bus at ``uvm_bandwidth`` instead of
``memory_bandwidth``: ``extra = ids * (1 - lf) * (3 * c * w + 2 * b * c) * (1 / uvm - 1 / mem)``
for a shard of c columns, w bytes a stored value and b bytes of optimizer state a value (a
row-wise state stays in HBM).
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from ..runtime.specs import CUDA_MAX_DIM, pad_dim
from .cost import CUDA_FUSED_KINDS, OPTIMIZER_STATE, CostModel
from .specs import DATA_PARALLEL, TableSpec, Topology

#: a piece of a table on a rank: (spec, optimizer kind, sharding type, rows, columns)
Piece = Tuple[TableSpec, str, str, int, int]


def _fused(spec: TableSpec, opt: str, sharding: str, cols: int) -> bool:
    """Whether fbgemm's CUDA backward applies the optimizer to the piece (transform fuses no
    optimizer into the model's fp16 tables, nor into pieces its CUDA kernels do not take)."""
    return (sharding != DATA_PARALLEL and opt in CUDA_FUSED_KINDS and spec.dtype == "fp32"
            and pad_dim(cols) <= CUDA_MAX_DIM)


def held(piece: Piece):
    """The piece as place_tables' rule counts it (keyed by its table's name)."""
    from ..passes.place_tables import Held

    spec, opt, sharding, rows, cols = piece
    if sharding == DATA_PARALLEL:
        return Held(spec.name, spec.name, spec.num_rows, spec.dim, spec.element_bytes, "", True)
    fused = _fused(spec, opt, sharding, cols)
    width = pad_dim(cols) if pad_dim(cols) <= CUDA_MAX_DIM else cols
    return Held(spec.name, spec.name, rows, width, spec.stored_bytes(sharding),
                ("adam" if opt == "lazy_adam" else opt) if fused else "", not fused, None, fused)


def placements(pieces: Sequence[Piece], topology: Topology) -> Tuple[Dict[str, str], int]:
    """Where one rank's ``pieces`` live under the topology's ``hbm_budget``: ``(table ->
    "managed_caching" for those in unified memory, the HBM they take)``; the caller compares the
    HBM with the budget."""
    from ..passes.place_tables import place

    return place([[held(p) for p in pieces]], topology.hbm_budget, topology.cache_load_factor)


def cached_extra_ms(cm: CostModel, piece: Piece) -> float:
    """What a piece adds to its rank's step in unified memory (ms; see the module doc)."""
    spec, opt, sharding, rows, cols = piece
    topo = cm.topology
    b = OPTIMIZER_STATE[opt][1]
    per_id = 3 * cols * spec.stored_bytes(sharding) + 2 * b * cols
    to_bytes_per_ms = 1e9 / 1e3
    slower = 1 / (topo.uvm_bandwidth * to_bytes_per_ms) - 1 / cm.mem_bw
    return cm.ids(spec, sharding, rows) * (1 - topo.cache_load_factor) * per_id * max(slower, 0.0)


def over_budget(rank: int, need: int, topology: Topology, pieces: Sequence[Piece]) -> str:
    """The words of a plan error for a rank whose tables cannot meet the budget."""
    from .specs import format_bytes

    stay = sorted({p[0].name for p in pieces if not held(p).movable})
    return (f"fxrec.plan: rank {rank}'s tables need {format_bytes(need)} of GPU memory with every shard that may "
            f"leave it in unified memory (cache_load_factor={topology.cache_load_factor:g}), more than "
            f"hbm_budget={format_bytes(topology.hbm_budget)}; "
            + (f"what stays in GPU memory: {_listed(stay)} (data-parallel tables, and shards trained without an "
               "optimizer fused into fbgemm's backward)" if stay else "the HBM caches alone take more")
            + ". Raise hbm_budget, lower cache_load_factor, fuse the optimizer, shard the data-parallel tables, or "
            "use more ranks")


def _listed(names: List[str], most: int = 8) -> str:
    return repr(names[:most])[:-1] + (f", ... {len(names) - most} more]" if len(names) > most else "]")
