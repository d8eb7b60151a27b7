"""Placement search: a sharding type for every table, then a rank for every shard.

1. Fair share. ``target`` = (sum over tables of its cheapest total cost) / world_size: what each
   rank would carry with perfect balance.
2. Choice of sharding type, per table, against a threshold ``t = f * target``:
   among the types allowed and applicable whose largest shard fits in a rank's memory, those
   whose costliest shard is at most ``t`` compete on total cost (so small tables stay
   table-wise, or go data-parallel when replicating is cheaper in all than sending their
   lookups; a hot table is split just enough); if none is that cheap, the one with the cheapest
   costliest shard wins. Column-wise takes the fewest shards (widths multiples of 4, at most one
   per rank) that bring its widest shard under ``t`` and into memory; it is not considered for
   unpooled tables, nor for tables whose optimizer updates a row from the whole row
   (:data:`fxrec.runtime.specs.WHOLE_ROW`: row-wise Adagrad, LAMB, LARS-SGD, ...; a column_wise
   pin of one is an error). Data-parallel is only
   considered for tables taking at most :data:`DP_MEMORY_FRACTION` of a rank's memory (of its
   ``hbm_budget`` under one: a replica stays in GPU memory). Tables
   the model holds in fp16 are split only as :data:`~fxrec.planner.specs.HALF_SHARDINGS` says
   (table-wise, data-parallel: a bag pooled whole on one rank), and tables with a lookup that
   sharded lookups do not take (``padding_idx``, ``include_last_offset``:
   ``TableSpec.data_parallel_only``) are data-parallel. In a plan for serving, quantized tables
   are not data-parallel (a replica keeps the model's own lookups) and integer-quantized ones
   not column-wise (a row's scale and bias need the whole row): :meth:`_Table.may`.
   Pinned tables keep their type (and ranks, when given).
3. Placement. Row-wise, data-parallel and pinned-with-ranks shards go where they must. Then the
   movable units (a table-wise table, one column-wise shard, a table-row-wise table as a
   whole host) in decreasing estimated cost, each onto the least-loaded rank (host) with room
   (Graham's list scheduling: the busiest rank ends at most one shard above the mean). If memory
   stops that, the same units go in decreasing size onto the rank with the most free memory;
   if that fails too, the table that did not fit (and, doubling each time, the next largest
   movable tables) is demoted to a type that spreads its memory (row-wise) and placement is
   tried again; when nothing is left to demote, every table that may go row-wise is tried
   row-wise (:func:`_spread`), and if that does not fit either, :class:`PlanError` names the
   table, the bytes it needs, the most free memory it could get and how much is missing.
4. Steps 2-3 run for f in :data:`THRESHOLD_FRACTIONS`; the plan with the lowest busiest-rank cost
   (then lowest total) is kept. Under ``hbm_budget=`` (CUDA), each rank's shards are placed in GPU
   or unified memory by transform's rule (:mod:`fxrec.planner.unified`): a round whose rank cannot
   meet the budget is dropped, the cached shards' misses count in the costs compared, and each
   round is also tried with no table data-parallel that need not be (replicas stay in GPU memory).

Cost: O(T log T + T log W) per round for T tables on W ranks, plus O(W) per row-wise or
data-parallel table to write its shards, and O(W) scans only while memory is tight.
"""

from __future__ import annotations

import difflib
import heapq
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..runtime.specs import WHOLE_ROW
from .cost import CostModel
from . import unified
from .layout import column_splits, max_column_shards, row_block
from .specs import (
    COLUMN_WISE, DATA_PARALLEL, ROW_WISE, SHARDING_TYPES, TABLE_ROW_WISE, TABLE_WISE, PlanError, Shard,
    TablePlan, TableSpec, Topology, format_bytes,
)

#: Data-parallel (a replica on every rank) is considered only for tables whose replica takes at
#: most this fraction of a rank's memory.
DP_MEMORY_FRACTION = 0.01
#: Thresholds tried, as fractions of the fair share of cost per rank (step 4 of the docstring).
THRESHOLD_FRACTIONS = (1.0, 0.5, 0.25)
#: Order among otherwise equal choices: the simplest layout first.
_PREFERENCE = {TABLE_WISE: 0, COLUMN_WISE: 1, TABLE_ROW_WISE: 2, ROW_WISE: 3, DATA_PARALLEL: 4}
_MAX_DEMOTION_ROUNDS = 64


@dataclass(frozen=True)
class Pin:
    """A user's fixed choice for one table: its sharding type and, optionally, its ranks."""

    sharding: str
    ranks: Optional[Tuple[int, ...]] = None


# A piece of a table before it has a rank: (row_offset, num_rows, col_offset, num_cols, bytes, cost_ms)
Piece = Tuple[int, int, int, int, int, float]


class Option:
    """One way to shard one table: its pieces, and where they must go (``ranks``) if fixed.

    The summary (``max_cost``, ``total_cost``, ``max_bytes``) is known without the pieces, which
    a row-wise option only writes out (one per rank) when it is placed.
    """

    __slots__ = ("sharding", "k", "ranks", "max_cost", "total_cost", "max_bytes", "_pieces", "_make")

    def __init__(self, sharding: str, pieces: Optional[List[Piece]], ranks: Optional[Tuple[int, ...]], k: int = 1,
                 summary: Optional[Tuple[float, float, int]] = None, make=None):
        self.sharding = sharding
        self.k = k
        self.ranks = ranks
        self._pieces = pieces
        self._make = make
        if summary is None:
            summary = (max(p[5] for p in pieces), sum(p[5] for p in pieces), max(p[4] for p in pieces))
        self.max_cost, self.total_cost, self.max_bytes = summary

    @property
    def pieces(self) -> List[Piece]:
        if self._pieces is None:
            self._pieces = self._make()
        return self._pieces


class _Table:
    """A table with its cost model terms; builds its options (cached when they do not depend on
    the threshold)."""

    def __init__(self, index: int, spec: TableSpec, opt: str, pin: Optional[Pin], cm: CostModel):
        self.index = index
        self.spec = spec
        self.opt = opt
        self.pin = pin
        self.cm = cm
        self._cache: Dict[Tuple[str, int], Option] = {}

    def cost(self, sharding: str, rows: int, cols: int) -> float:
        return self.cm.shard_cost(self.spec, self.opt, sharding, rows, cols)

    def may(self, sharding: str) -> bool:
        """Whether fxrec can lay the table out as ``sharding`` (:meth:`TableSpec.refusal`)."""
        return not self.spec.refusal(sharding)

    def nbytes(self, sharding: str, rows: int, cols: int) -> int:
        return self.cm.shard_bytes(self.spec, self.opt, sharding, rows, cols)

    def _rows_option(self, sharding: str, ranks: Tuple[int, ...], fixed: bool) -> Option:
        """row_wise over ``ranks`` (all ranks) or table_row_wise over one host's ranks: blocks of
        ceil(R / n) rows, then one partial block, then empty shards (see layout.row_blocks)."""
        R, D, n = self.spec.num_rows, self.spec.dim, len(ranks)
        block = row_block(R, n)
        full, rem = divmod(R, block)
        bb, cb = self.nbytes(sharding, block, D), self.cost(sharding, block, D)
        br, cr = self.nbytes(sharding, rem, D), self.cost(sharding, rem, D)
        b0, c0 = self.nbytes(sharding, 0, D), self.cost(sharding, 0, D)
        empty = n - full - (1 if rem else 0)

        def make() -> List[Piece]:
            pieces = [(i * block, block, 0, D, bb, cb) for i in range(full)]
            if rem:
                pieces.append((full * block, rem, 0, D, br, cr))
            pieces += [(R, 0, 0, D, b0, c0)] * empty
            return pieces

        summary = (cb, full * cb + (cr if rem else 0.0) + empty * c0, bb)
        return Option(sharding, None, ranks if fixed else None, summary=summary, make=make)

    def option(self, sharding: str, k: int = 1, ranks: Optional[Tuple[int, ...]] = None) -> Option:
        key = (sharding, k, ranks)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        R, D = self.spec.num_rows, self.spec.dim
        topo = self.cm.topology
        if sharding == TABLE_WISE:
            opt = Option(sharding, [(0, R, 0, D, self.nbytes(sharding, R, D), self.cost(sharding, R, D))], ranks)
        elif sharding == COLUMN_WISE:
            pieces = [(0, R, off, w, self.nbytes(sharding, R, w), self.cost(sharding, R, w))
                      for off, w in column_splits(D, k)]
            opt = Option(sharding, pieces, ranks, k)
        elif sharding == ROW_WISE:
            opt = self._rows_option(sharding, tuple(range(topo.world_size)), fixed=True)
        elif sharding == TABLE_ROW_WISE:
            # Pieces are the same on every host; ranks stay None (movable) unless pinned.
            opt = self._rows_option(sharding, ranks or topo.host_ranks(0), fixed=ranks is not None)
        elif sharding == DATA_PARALLEL:
            piece = (0, R, 0, D, self.nbytes(sharding, R, D), self.cost(sharding, R, D))
            W = topo.world_size
            opt = Option(sharding, None, tuple(range(W)), summary=(piece[5], piece[5] * W, piece[4]),
                         make=lambda: [piece] * W)
        else:  # pragma: no cover - callers check
            raise ValueError(sharding)
        self._cache[key] = opt
        return opt

    def column_shards(self, threshold: float, memory: int, kmax: int) -> int:
        """Fewest column shards (2..kmax) whose widest shard costs at most ``threshold`` and fits
        ``memory`` (the widest shard shrinks as k grows, so a binary search finds it); kmax when
        none does."""
        units = max_column_shards(self.spec.dim)
        R = self.spec.num_rows

        def ok(k: int) -> bool:
            width = -(-units // k) * 4
            return (self.cost(COLUMN_WISE, R, width) <= threshold
                    and self.nbytes(COLUMN_WISE, R, width) <= memory)

        lo, hi = 2, kmax
        if not ok(hi):
            return kmax
        while lo < hi:
            mid = (lo + hi) // 2
            if ok(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo


def normalize_pins(pins, names: Sequence[str], topology: Topology, specs: Dict[str, TableSpec],
                   left: Optional[Dict[str, str]] = None) -> Dict[str, Pin]:
    """Check and normalise ``pins``: ``{table: "row_wise"}``, ``{table: ("table_wise", 3)}``,
    ``{table: {"sharding": "column_wise", "ranks": [0, 1]}}`` or :class:`Pin` values. ``left``: the
    model's tables transform leaves as written (-> why), which a pin may not name."""
    out: Dict[str, Pin] = {}
    W = topology.world_size
    if pins is not None and not isinstance(pins, dict):
        raise ValueError(f"fxrec.plan: pins must be a dict of table -> sharding ({{'bags.0': 'row_wise'}}), got "
                         f"{type(pins).__name__} {pins!r}"[:300])
    for name, value in (pins or {}).items():
        if name in (left or {}):
            raise ValueError(f"fxrec.plan: pins names table {name!r}, which fxrec leaves as written ({left[name]}), "
                             "so it is not sharded: it stays the model's own on every rank")
        if name not in specs:
            close = difflib.get_close_matches(str(name), list(names), n=3)
            hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
            raise ValueError(f"fxrec.plan: pins names table {name!r}, which is not among the {len(names)} tables{hint}")
        if isinstance(value, Pin):
            sharding, ranks = value.sharding, value.ranks
        elif isinstance(value, str):
            sharding, ranks = value, None
        elif isinstance(value, dict):
            extra = set(value) - {"sharding", "ranks"}
            if "sharding" not in value or extra:
                raise ValueError(f"fxrec.plan: pin for {name!r} must have 'sharding' (and optionally 'ranks'), got {value!r}")
            sharding, ranks = value["sharding"], value.get("ranks")
        elif isinstance(value, (tuple, list)) and len(value) == 2:
            sharding, ranks = value
        else:
            raise ValueError(f"fxrec.plan: cannot read the pin for {name!r}: {value!r}")
        if sharding not in SHARDING_TYPES:
            raise ValueError(
                f"fxrec.plan: pin for table {name!r}: unknown sharding type {sharding!r}; use one of {list(SHARDING_TYPES)}"
            )
        if ranks is not None:
            if isinstance(ranks, int):  # (a bool too: refused below as no rank)
                ranks = (ranks,)
            try:
                ranks = tuple(ranks)
            except TypeError:
                raise ValueError(f"fxrec.plan: pin for {name!r}: ranks {ranks!r} must be a rank or a list of ranks "
                                 f"in 0..{W - 1}") from None
            bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < W]
            if bad or not ranks:
                raise ValueError(f"fxrec.plan: pin for {name!r}: ranks {list(ranks)} must be ranks in 0..{W - 1}")
            if len(set(ranks)) != len(ranks):
                raise ValueError(f"fxrec.plan: pin for {name!r}: ranks {list(ranks)} repeat a rank")
        spec = specs[name]
        if sharding == TABLE_WISE and ranks is not None and len(ranks) != 1:
            raise ValueError(f"fxrec.plan: pin for {name!r}: table_wise takes one rank, got {list(ranks)}")
        if sharding in (ROW_WISE, DATA_PARALLEL) and ranks is not None and ranks != tuple(range(W)):
            raise ValueError(f"fxrec.plan: pin for {name!r}: {sharding} uses all ranks 0..{W - 1} in order, got {list(ranks)}")
        why = spec.refusal(sharding)
        if why:
            raise ValueError(f"fxrec.plan: pin for {name!r}: {why}")
        if sharding == COLUMN_WISE:
            units = max_column_shards(spec.dim)
            if units == 0:
                raise ValueError(f"fxrec.plan: pin for {name!r}: column_wise needs a dim that is a multiple of 4, got {spec.dim}")
            if ranks is not None and len(ranks) > units:
                raise ValueError(f"fxrec.plan: pin for {name!r}: dim {spec.dim} gives at most {units} column shards, "
                                 f"not {len(ranks)}")
        if sharding == TABLE_ROW_WISE and ranks is not None:
            host = topology.host_of(ranks[0])
            if ranks != topology.host_ranks(host):
                raise ValueError(f"fxrec.plan: pin for {name!r}: table_row_wise ranks must be one host's ranks in order, "
                                 f"e.g. {list(topology.host_ranks(host))}, got {list(ranks)}")
        out[name] = Pin(sharding, ranks)
    return out


class _NoFit(Exception):
    def __init__(self, table: _Table, option: Option, needed: int, free: int, rank: Optional[int]):
        super().__init__(table.spec.name)
        self.table, self.option, self.needed, self.free, self.rank = table, option, needed, free, rank


def search(specs: Sequence[TableSpec], topology: Topology, batch_size: int, optimizers: Sequence[str],
           pins: Dict[str, Pin], allowed: Sequence[str]) -> Dict[str, TablePlan]:
    """Plan every table (see the module docstring); ``optimizers[i]`` is table i's optimizer kind.
    Specs with ``quantize`` make a plan for serving (the cost model's)."""
    cm = CostModel(topology, batch_size, [s for s in specs if s.quantize])
    tables = [_Table(i, s, optimizers[i], pins.get(s.name), cm) for i, s in enumerate(specs)]
    if not tables:
        return {}
    for t in tables:
        if t.pin is not None and t.pin.sharding == COLUMN_WISE and t.opt in WHOLE_ROW:
            raise ValueError(f"fxrec.plan: pin for {t.spec.name!r}: column_wise, and its optimizer ({t.opt}) updates a "
                             "row from the whole row (a mean or norms over it), which no column shard holds; pin it "
                             "table_wise or row_wise, or use another optimizer")
    allowed = [t for t in SHARDING_TYPES if t in set(allowed)]
    W, mem = topology.world_size, topology.memory_per_rank
    cheapest = 0.0
    for t in tables:
        opts = _candidates(t, float("inf"), allowed)
        fits = [o for o in opts if o.max_bytes <= mem]
        cheapest += min(o.total_cost for o in (fits or opts))
    target = cheapest / W
    total_bytes = sum(t.nbytes(TABLE_WISE, t.spec.num_rows, t.spec.dim) for t in tables)
    if total_bytes > W * mem:
        # Cannot fit however it is cut: name the table that a memory-first placement fails on.
        choices = [_choose(t, target, allowed) for t in tables]
        try:
            _place(tables, choices, topology, by_memory=True)
        except _NoFit as nf:
            raise _plan_error(nf, tables, topology) from None
    best = None
    error: Optional[PlanError] = None
    seen = set()
    # under a budget of GPU memory, data-parallel tables stay there whole on every rank: each round
    # is also tried with the tables that need not be data-parallel laid out otherwise
    variants = (False, True) if topology.hbm_budget is not None else (False,)
    rounds = [(f, spread) for f in THRESHOLD_FRACTIONS for spread in variants]
    for f, spread in rounds:
        choices = [_choose(t, target * f, allowed) for t in tables]
        if spread:
            no_dp = [s for s in allowed if s != DATA_PARALLEL]
            choices = [_choose(t, target * f, no_dp) if c.sharding == DATA_PARALLEL and t.pin is None
                       and not t.spec.data_parallel_only and no_dp else c for t, c in zip(tables, choices)]
        key = tuple((c.sharding, c.k) for c in choices)
        if key in seen:
            continue
        seen.add(key)
        try:
            placed, loads = _place_with_fallback(tables, choices, allowed, topology)
            extra = _unified(tables, *placed, cm) if topology.hbm_budget is not None else {}
        except PlanError as e:  # (the error of the round that came closest)
            if error is None or None not in (e.missing_bytes, error.missing_bytes) and e.missing_bytes < error.missing_bytes:
                error = e
            continue
        for (_, r), ms in extra.items():
            loads[r] += ms
        score = (max(loads), sum(loads))
        if best is None or score < best[0]:
            best = (score, placed, extra)
    if best is None:
        raise error
    (choices, assigned), extra = best[1], best[2]
    out: Dict[str, TablePlan] = {}
    for i, (t, c, pieces) in enumerate(zip(tables, choices, assigned)):
        if pieces is None:  # a data-parallel replica on every rank
            pieces = list(zip(c.ranks, c.pieces))
        if c.sharding == COLUMN_WISE:
            pieces = sorted(pieces, key=lambda rp: rp[1][2])
        name = t.spec.name
        shards = tuple(Shard(name, r, p[0], p[1], p[2], p[3], p[4], p[5] + extra.get((i, r), 0.0)) for r, p in pieces)
        out[name] = TablePlan(t.spec, c.sharding, shards, t.opt, t.pin is not None)
    return out


def _unified(tables: List[_Table], choices: List[Option], assigned, cm: CostModel) -> Dict[Tuple[int, int], float]:
    """Under the topology's ``hbm_budget``: what each shard in unified memory adds to its rank's
    step, by (table index, rank) (:mod:`fxrec.planner.unified`); a PlanError naming a rank whose
    tables cannot meet the budget."""
    topo = cm.topology
    on: List[List[Tuple[int, tuple]]] = [[] for _ in range(topo.world_size)]
    for i, (t, c, pieces) in enumerate(zip(tables, choices, assigned)):
        for r, p in (zip(c.ranks, c.pieces) if pieces is None else pieces):
            if p[1] and p[3]:
                on[r].append((i, (t.spec, t.opt, c.sharding, p[1], p[3])))
    extra = {}
    for r, mine in enumerate(on):
        where, need = unified.placements([p for _, p in mine], topo, cm)
        if need > topo.hbm_budget:
            raise PlanError(unified.over_budget(r, need, topo, [p for _, p in mine], cm), needed_bytes=need,
                            free_bytes=topo.hbm_budget)
        for i, p in mine:
            if p[0].name in where:
                extra[(i, r)] = unified.cached_extra_ms(cm, p, where[p[0].name])
    return extra


def _candidates(t: _Table, threshold: float, allowed: Sequence[str]) -> List[Option]:
    spec, topo = t.spec, t.cm.topology
    W, mem = topo.world_size, topo.memory_per_rank
    if t.pin is not None:
        p = t.pin
        if p.sharding == COLUMN_WISE:
            units = max_column_shards(spec.dim)
            k = len(p.ranks) if p.ranks else (t.column_shards(threshold, mem, min(units, W)) if min(units, W) >= 2 else 1)
            return [t.option(COLUMN_WISE, k, p.ranks)]
        if p.sharding == TABLE_ROW_WISE:
            return [t.option(TABLE_ROW_WISE, 1, p.ranks)]
        return [t.option(p.sharding, 1, p.ranks if p.sharding == TABLE_WISE else None)]
    if spec.data_parallel_only:
        if DATA_PARALLEL not in allowed:
            raise ValueError(f"fxrec.plan: table {spec.name!r} can only be data_parallel ({spec.data_parallel_only}), "
                             f"which the allowed sharding types {list(allowed)} leave out")
        return [t.option(DATA_PARALLEL)]
    if TABLE_WISE in allowed:
        tw = t.option(TABLE_WISE)
        if tw.max_bytes <= mem and tw.max_cost <= threshold:
            # Every split layout costs at least as much in all as table-wise (the same lookups;
            # ids sent to each column shard, partial sums from each row shard), so only
            # data-parallel can beat table-wise here.
            out = [tw]
            if DATA_PARALLEL in allowed and t.may(DATA_PARALLEL):
                dp = t.option(DATA_PARALLEL)
                if dp.max_bytes <= DP_MEMORY_FRACTION * _replica_room(topo):
                    out.append(dp)
            return out
    out: List[Option] = []
    fallback: List[Option] = []  # (left out by a preference below, unless nothing else applies)
    for s in allowed:
        if not t.may(s):
            continue
        if s == COLUMN_WISE:
            # unpooled lookups are not sharded by columns (fxrec's runtime sends whole rows back), nor
            # tables whose optimizer updates a row from the whole row (WHOLE_ROW)
            kmax = min(max_column_shards(spec.dim), W) if spec.pooled and t.opt not in WHOLE_ROW else 0
            if kmax >= 2:
                out.append(t.option(COLUMN_WISE, t.column_shards(threshold, mem, kmax)))
        elif s == ROW_WISE:  # (on one rank: the whole table in one piece, table-wise without the split)
            (out if W > 1 or TABLE_WISE not in allowed else fallback).append(t.option(ROW_WISE))
        elif s == TABLE_ROW_WISE:  # (on one host, or one rank a host, it is row-wise)
            (out if topo.hosts > 1 and topo.ranks_per_host > 1 else fallback).append(t.option(TABLE_ROW_WISE))
        elif s == DATA_PARALLEL:  # (a replica on every rank: for small tables)
            o = t.option(DATA_PARALLEL)
            (out if o.max_bytes <= DP_MEMORY_FRACTION * _replica_room(topo) or len(allowed) == 1
             else fallback).append(o)
        else:
            out.append(t.option(s))
    out = out or fallback
    if not out:
        why = "; ".join(filter(None, (spec.refusal(s) for s in allowed)))
        raise ValueError(f"fxrec.plan: none of the sharding types {list(allowed)} applies to table {spec.name!r}"
                         + (f" ({why})" if why else ""))
    return out


def _replica_room(topology: Topology) -> int:
    """The memory a data-parallel replica is measured against: a rank's, or under a budget of GPU
    memory that budget (a replica stays in GPU memory)."""
    budget = topology.hbm_budget
    return topology.memory_per_rank if budget is None else min(budget, topology.memory_per_rank)


def _choose(t: _Table, threshold: float, allowed: Sequence[str]) -> Option:
    opts = _candidates(t, threshold, allowed)
    if len(opts) == 1:
        return opts[0]
    mem = t.cm.topology.memory_per_rank
    fits = [o for o in opts if o.max_bytes <= mem]
    if not fits:  # placement will fail and say by how much; fail with the smallest shard
        return min(opts, key=lambda o: (o.max_bytes, _PREFERENCE[o.sharding]))
    cheap = [o for o in fits if o.max_cost <= threshold]
    if cheap:
        return min(cheap, key=lambda o: (o.total_cost, _PREFERENCE[o.sharding]))
    return min(fits, key=lambda o: (o.max_cost, o.total_cost, _PREFERENCE[o.sharding]))


def _demoted(t: _Table, current: Option, allowed: Sequence[str]) -> Optional[Option]:
    """A layout of ``t`` that spreads its memory more than ``current`` does, or None."""
    if t.pin is not None or t.spec.data_parallel_only:
        return None
    topo = t.cm.topology
    order = [TABLE_WISE, ROW_WISE] if current.sharding == DATA_PARALLEL else [ROW_WISE, COLUMN_WISE, TABLE_ROW_WISE]
    for s in order:
        if s not in allowed or s == current.sharding or not t.may(s):
            continue
        if s == COLUMN_WISE:
            kmax = min(max_column_shards(t.spec.dim), topo.world_size)
            if kmax < 2 or kmax <= current.k and current.sharding == COLUMN_WISE:
                continue
            o = t.option(COLUMN_WISE, kmax)
        elif s == TABLE_ROW_WISE:
            if topo.hosts == 1 or topo.ranks_per_host == 1:
                continue
            o = t.option(TABLE_ROW_WISE)
        else:
            o = t.option(s)
        if o.max_bytes < current.max_bytes or current.sharding == DATA_PARALLEL:
            return o
    return None


def _place_with_fallback(tables: List[_Table], choices: List[Option], allowed, topology: Topology):
    choices = list(choices)
    batch = 1
    for _ in range(_MAX_DEMOTION_ROUNDS):
        try:
            return _place(tables, choices, topology, by_memory=False)
        except _NoFit:
            pass
        try:
            return _place(tables, choices, topology, by_memory=True)
        except _NoFit as nf:
            fail = nf
        first = _demoted(fail.table, choices[fail.table.index], allowed)
        if first is None:
            # A fixed shard that cannot spread further: free the replicas of data-parallel tables.
            dps = [i for i, c in enumerate(choices) if c.sharding == DATA_PARALLEL and tables[i].pin is None]
            demoted = [(i, _demoted(tables[i], choices[i], allowed)) for i in dps] if fail.rank is not None else []
            if not any(d is not None for _, d in demoted):
                spread = _spread(tables, choices, allowed, topology)
                if spread is not None:
                    return spread
                raise _plan_error(fail, tables, topology)
            for i, d in demoted:
                if d is not None:
                    choices[i] = d
            continue
        choices[fail.table.index] = first
        # Demote the next largest movable tables too, twice as many each round.
        rest = sorted(
            (i for i, c in enumerate(choices) if c.ranks is None and tables[i].pin is None),
            key=lambda i: -choices[i].max_bytes,
        )
        for i in rest[: batch - 1]:
            d = _demoted(tables[i], choices[i], allowed)
            if d is not None:
                choices[i] = d
        batch *= 2
    spread = _spread(tables, choices, allowed, topology)
    if spread is not None:
        return spread
    raise _plan_error(fail, tables, topology)


def _spread(tables: List[_Table], choices: List[Option], allowed, topology: Topology):
    """The last try before giving up: every table that may go row-wise, row-wise (each rank an
    even share of its rows: the layout that spreads memory the most), the others as they are.
    (Demoting one table at a time can stop short: the table that does not fit may have no layout
    with smaller shards while another table's could make room.)"""
    spread = list(choices)
    for i, t in enumerate(tables):
        if t.pin is None and not t.spec.data_parallel_only and ROW_WISE in allowed and t.may(ROW_WISE):
            spread[i] = t.option(ROW_WISE)
    if spread == list(choices):
        return None
    try:
        return _place(tables, spread, topology, by_memory=True)
    except _NoFit:
        return None


def _plan_error(nf: _NoFit, tables: List[_Table], topology: Topology) -> PlanError:
    name = nf.table.spec.name
    total = sum(t.cm.shard_bytes(t.spec, t.opt, TABLE_WISE, t.spec.num_rows, t.spec.dim) for t in tables)
    W, mem = topology.world_size, topology.memory_per_rank
    pinned = " (pinned)" if nf.table.pin is not None else ""
    where = (f"on rank {nf.rank}, which has {format_bytes(nf.free)} ({nf.free} bytes) free"
             if nf.rank is not None else
             f"on one rank, and the most free memory on any rank it may use is {format_bytes(nf.free)} "
             f"({nf.free} bytes)")
    missing = nf.needed - nf.free
    msg = (
        f"fxrec.plan: table {name!r} does not fit: as {nf.option.sharding}{pinned} a shard of it needs "
        f"{format_bytes(nf.needed)} ({nf.needed} bytes) {where} after placing the tables before it: "
        f"{format_bytes(missing)} ({missing} bytes) missing. In all the {len(tables)} tables need "
        f"{format_bytes(total)} (weights + optimizer state, before replicas) and {W} ranks have "
        f"{format_bytes(W * mem)} ({W} x {format_bytes(mem)}). Give more memory_per_rank, more ranks or "
        f"an optimizer with less state" + ("." if nf.option.sharding == ROW_WISE or nf.table.pin is None else
                                           f", or pin {name!r} to a layout that spreads it (row_wise).")
    )
    if nf.table.spec.data_parallel_only:  # more ranks do not help a table every rank holds whole
        msg += (f" {name!r} can only be data_parallel ({nf.table.spec.data_parallel_only}): every rank holds all of "
                "it, so more ranks do not help; change that lookup so the table can be sharded")
    return PlanError(msg, table=name, needed_bytes=nf.needed, free_bytes=nf.free)


def _place(tables: List[_Table], choices: List[Option], topology: Topology, by_memory: bool):
    """Give every piece a rank; returns ((choices, [(rank, piece)] per table), per-rank cost) or
    raises _NoFit."""
    W, mem = topology.world_size, topology.memory_per_rank
    loads = [0.0] * W
    used = [0] * W
    assigned: List[List[Tuple[int, Piece]]] = [[] for _ in tables]

    # 1. Shards whose ranks are fixed: pinned tables first, so their errors name them, then
    # data-parallel replicas (the same on every rank: added up once), then row-wise.
    fixed = [i for i, c in enumerate(choices) if c.ranks is not None]
    fixed.sort(key=lambda i: (tables[i].pin is None, choices[i].sharding != DATA_PARALLEL))
    replicated_bytes, replicated_cost = 0, 0.0
    fullest = None
    for i in fixed:
        c = choices[i]
        if c.sharding == DATA_PARALLEL and tables[i].pin is None:
            if fullest is None:
                fullest = max(range(W), key=lambda r: used[r])
            b = c.max_bytes
            if used[fullest] + replicated_bytes + b > mem:
                raise _NoFit(tables[i], c, b, mem - used[fullest] - replicated_bytes, fullest)
            replicated_bytes += b
            replicated_cost += c.max_cost
            assigned[i] = None  # every rank: written out when the plan is built
            continue
        if fullest is not None and replicated_bytes:
            for r in range(W):
                used[r] += replicated_bytes
                loads[r] += replicated_cost
            replicated_bytes, replicated_cost = 0, 0.0
        for r, p in zip(c.ranks, c.pieces):
            if used[r] + p[4] > mem:
                raise _NoFit(tables[i], c, p[4], mem - used[r], r)
            used[r] += p[4]
            loads[r] += p[5]
            assigned[i].append((r, p))
    if replicated_bytes:
        for r in range(W):
            used[r] += replicated_bytes
            loads[r] += replicated_cost

    # 2. Movable units, largest first.
    units = []  # (sort key, table index, piece index or -1 for a whole host)
    for i, c in enumerate(choices):
        if c.ranks is not None:
            continue
        if c.sharding == TABLE_ROW_WISE:
            units.append((-(c.max_bytes if by_memory else c.max_cost), i, -1))
        else:
            for j, p in enumerate(c.pieces):
                units.append((-(p[4] if by_memory else p[5]), i, j))
    units.sort()

    # Heaps with lazy deletion: an entry is current while it matches loads/used.
    heap = [((-(mem - used[r]), loads[r]) if by_memory else (loads[r], -(mem - used[r])), r) for r in range(W)]
    heapq.heapify(heap)

    def key_of(r):
        return (-(mem - used[r]), loads[r]) if by_memory else (loads[r], -(mem - used[r]))

    for _, i, j in units:
        c = choices[i]
        t = tables[i]
        if j < 0:  # table_row_wise: a whole host
            best_h, best_key = None, None
            for h in range(topology.hosts):
                ranks = topology.host_ranks(h)
                if any(used[r] + p[4] > mem for r, p in zip(ranks, c.pieces)):
                    continue
                k = (-min(mem - used[r] for r in ranks), sum(loads[r] for r in ranks)) if by_memory else \
                    (sum(loads[r] for r in ranks), -min(mem - used[r] for r in ranks))
                if best_key is None or k < best_key:
                    best_h, best_key = h, k
            if best_h is None:  # report the roomiest host's tightest rank
                free = max(min(mem - used[r] for r in topology.host_ranks(h)) for h in range(topology.hosts))
                raise _NoFit(t, c, c.max_bytes, free, None)
            for r, p in zip(topology.host_ranks(best_h), c.pieces):
                used[r] += p[4]
                loads[r] += p[5]
                assigned[i].append((r, p))
                heapq.heappush(heap, (key_of(r), r))
            continue
        p = c.pieces[j]
        taken = {r for r, _ in assigned[i]}
        skipped = []
        chosen = None
        while heap:
            k, r = heapq.heappop(heap)
            if k != key_of(r):
                continue  # stale
            if used[r] + p[4] <= mem and r not in taken:
                chosen = r
                break
            skipped.append((k, r))
        for e in skipped:
            heapq.heappush(heap, e)
        if chosen is None:
            free = max((mem - used[r] for r in range(W) if r not in taken), default=0)
            raise _NoFit(t, c, p[4], free, None)
        used[chosen] += p[4]
        loads[chosen] += p[5]
        assigned[i].append((chosen, p))
        heapq.heappush(heap, (key_of(chosen), chosen))

    return (choices, assigned), loads
