"""The planner's data: what goes in (TableSpec, Topology) and what comes out (ShardingPlan).

Everything here is plain, frozen data that round-trips exactly through JSON, so a plan can be
made on one machine, saved, read by a person, and loaded by the shard pass on every rank::

    TableSpec   one embedding table: rows, dim, dtype, ids per sample, features, optimizer
    Topology    world size, ranks per host, memory per rank, bandwidths (and which were assumed)
    Shard       one piece of one table on one rank: rows [row_offset, +num_rows) x
                columns [col_offset, +num_cols), its bytes and its estimated cost
    TablePlan   a table, its sharding type and its shards
    ShardingPlan  all tables' plans + topology + batch size + notes; to_json/from_json,
                save/load, shards_on(rank), print() as a table

Units, used the same way everywhere in the planner: sizes are bytes; "GB", "MB", "KB", "TB" are
decimal (10**9, 10**6, 10**3, 10**12 bytes) and "GiB", "MiB", "KiB", "TiB" binary (2**30, ...);
bandwidths are GB/s = 10**9 bytes per second; estimated costs are milliseconds per training step.

Ranks are grouped into hosts in contiguous blocks: rank r is on host ``r // ranks_per_host``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, fields
from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple

from ..runtime.specs import QUANT_DTYPES

#: The sharding types, as spelled in pins, in plans and in JSON.
TABLE_WISE = "table_wise"
ROW_WISE = "row_wise"
COLUMN_WISE = "column_wise"
TABLE_ROW_WISE = "table_row_wise"
DATA_PARALLEL = "data_parallel"
SHARDING_TYPES = (TABLE_WISE, ROW_WISE, COLUMN_WISE, TABLE_ROW_WISE, DATA_PARALLEL)
#: How a table the model holds in fp16 may be sharded: whole, each bag pooled on one rank by
#: PyTorch's own fp16 lookup and sent as fp16 (bit for bit the model's numbers). Row-wise layouts
#: would add partial sums from several ranks, rounded otherwise than the model rounds; column
#: shards are updated by torch.optim's fp16 steps, which round some values of a narrower tensor
#: otherwise (PyTorch's vectorised loop and its scalar tail differ).
HALF_SHARDINGS = (TABLE_WISE, DATA_PARALLEL)
HALF_WHY = ("row-wise pieces would add partial sums from several ranks, and torch.optim's fp16 steps round some "
            "values of a column shard otherwise than of the whole table, so neither gives the model's numbers")

#: What a table's shards may be stored in for serving (TableSpec.quantize; "": not quantized).
QUANTIZED = ("",) + QUANT_DTYPES

#: Bytes per weight element of the table dtypes the planner knows.
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
_DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}

#: fbgemm's training TBE needs dims that are a multiple of 4: column-wise shard widths are too.
COLUMN_ALIGNMENT = 4

_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?\s*([A-Za-z]*)\s*$")

#: the most ranks a plan is made for (2**20: a plan lists figures per rank)
MAX_WORLD_SIZE = 2 ** 20

PLAN_FORMAT = "fxrec.sharding_plan"
PLAN_VERSION = 1


class PlanError(ValueError):
    """No plan satisfies the constraints. ``table`` is the table that does not fit,
    ``needed_bytes`` what its shard needs on one rank, ``free_bytes`` the most free memory it
    could get, ``missing_bytes`` the difference (all None when the error is not about memory)."""

    def __init__(self, message: str, table: Optional[str] = None, needed_bytes: Optional[int] = None,
                 free_bytes: Optional[int] = None):
        super().__init__(message)
        self.table = table
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes
        self.missing_bytes = None if needed_bytes is None or free_bytes is None else needed_bytes - free_bytes


def parse_bytes(value, what: str = "memory_per_rank", who: str = "fxrec.plan") -> int:
    """A byte count from an int (bytes) or a string such as ``"16GB"``, ``"512 MiB"``, ``"1.5e9"``.

    GB/MB/KB/TB are powers of ten, GiB/MiB/KiB/TiB powers of two (case does not matter).
    Raises ValueError for anything else (negative, zero, unknown unit, ``"16G"``, a bool).
    """
    if isinstance(value, bool):
        raise ValueError(f"{who}: {what} must be a number of bytes or a string like '16GB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{who}: {what} must be finite, got {value!r}")
        n = int(round(value))
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(3).lower() if m else None
        if m is None or (unit and unit not in _UNITS):
            raise ValueError(
                f"{who}: cannot read {what}={value!r}: write a number of bytes or a number with one of the "
                f"units B, KB, MB, GB, TB (powers of 10) or KiB, MiB, GiB, TiB (powers of 2), e.g. '16GB' or '512MiB'"
            )
        number = float(m.group(1) + (f"e{m.group(2)}" if m.group(2) else "")) * _UNITS[unit or "b"]
        if not number < 2 ** 63:  # (1e400 is inf)
            raise ValueError(f"{who}: {what} {value!r} is too large")
        n = int(round(number))
    else:
        raise ValueError(f"{who}: {what} must be an int (bytes) or a string like '16GB', got {type(value).__name__}")
    if n <= 0:
        raise ValueError(f"{who}: {what} must be positive, got {value!r}")
    return n


def format_bytes(n: float) -> str:
    """``1234567890`` -> ``'1.23 GB'`` (decimal units, as :func:`parse_bytes` reads them)."""
    n = float(n)
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}" if n / size < 100 else f"{n / size:.0f} {unit}"
    return f"{n:.0f} B"


@dataclass(frozen=True)
class TableSpec:
    """One embedding table as the planner sees it.

    ``pooling_factor``: average number of ids looked up in this table per sample, all its
    features together (a table read by two features of 3 and 1 ids per bag has 4.0).
    ``num_features``: how many features look it up; each gives one pooled row per sample.
    ``pooled``: False when the lookups return one row per id (sequence features).
    ``optimizer``: the table's optimizer kind when it differs from the plan's (see
    :data:`fxrec.planner.cost.OPTIMIZER_STATE`), else None.
    ``param``: the weight's name in the model's ``state_dict()`` when the table was found in a
    model (``"bags.0.weight"`` for table ``"bags.0"``), else None.
    ``weights``: ``"fp16"`` or ``"bf16"`` when ``transform(weights_precision=...)`` will store the
    table's shards at that precision (a data-parallel table stays as ``dtype`` says), else "".
    ``data_parallel_only``: why the table can only be data-parallel (a lookup with ``padding_idx``
    or ``include_last_offset``, which sharded lookups do not take), else "".
    ``quantize``: for a plan to serve with ``transform(mode="inference", quantize=...)``, the
    dtype its shards are stored in (``"int8"``, ``"int4"``, ``"int2"``, ``"fp16"``, ``"fp32"``: rows
    as fbgemm's IntNBit kernel packs them; a data-parallel table keeps the model's own lookups), else
    "" (a plan for training).
    """

    name: str
    num_rows: int
    dim: int
    pooling_factor: float = 1.0
    num_features: int = 1
    pooled: bool = True
    dtype: str = "fp32"
    optimizer: Optional[str] = None
    param: Optional[str] = None
    weights: str = ""
    data_parallel_only: str = ""
    quantize: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"fxrec.plan: a table needs a non-empty name, got {self.name!r}")
        for f in ("num_rows", "dim", "num_features"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"fxrec.plan: table {self.name!r}: {f} must be an int >= 1, got {v!r}")
        pf = self.pooling_factor
        if isinstance(pf, bool) or not isinstance(pf, (int, float)) or not math.isfinite(pf) or pf < 0:
            raise ValueError(f"fxrec.plan: table {self.name!r}: pooling_factor must be a number >= 0, got {pf!r}")
        object.__setattr__(self, "pooling_factor", float(pf))
        dtype = _DTYPE_ALIASES.get(str(self.dtype).replace("torch.", ""), str(self.dtype).replace("torch.", ""))
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"fxrec.plan: table {self.name!r}: dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        object.__setattr__(self, "dtype", dtype)
        if not isinstance(self.pooled, bool):
            raise ValueError(f"fxrec.plan: table {self.name!r}: pooled must be true or false, got {self.pooled!r}")
        if self.weights not in ("", "fp16", "bf16"):
            raise ValueError(f"fxrec.plan: table {self.name!r}: weights {self.weights!r} is not '', 'fp16' or 'bf16'")
        if self.weights and dtype != "fp32":
            raise ValueError(f"fxrec.plan: table {self.name!r}: weights {self.weights!r} stores an fp32 table at a "
                             f"lower precision, and the table is {dtype}")
        if self.quantize not in QUANTIZED:
            raise ValueError(f"fxrec.plan: table {self.name!r}: quantize {self.quantize!r} is not one of "
                             f"{['', *QUANTIZED[1:]]}")
        if self.quantize and (self.weights or self.optimizer not in (None, "none")):
            raise ValueError(f"fxrec.plan: table {self.name!r}: quantize {self.quantize!r} is for serving, and the "
                             f"spec also has " + (f"weights {self.weights!r}" if self.weights else
                                                  f"optimizer {self.optimizer!r}") + " (for training)")
        if self.data_parallel_only and not self.keeps_lookups:
            raise ValueError(f"fxrec.plan: table {self.name!r} can only be data_parallel ({self.data_parallel_only}), "
                             f"whose lookups stay the model's own, and it is to be served quantized {self.quantize}: "
                             f"leave it as it is ({self._as_held_hint()})")
        if self.quantize == "fp32" and dtype == "fp16":
            raise ValueError(f"fxrec.plan: table {self.name!r}: quantize 'fp32' would widen an fp16 table (fxrec keeps "
                             "its rows fp16: give 'fp16')")

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def stored_bytes(self, sharding: str) -> int:
        """Bytes of a weight element as a shard of ``sharding`` holds it: the precision
        ``weights_precision=`` stores a sharded table in; a data-parallel table as ``dtype``."""
        return DTYPE_BYTES[self.weights] if self.weights and sharding != DATA_PARALLEL else self.element_bytes

    def _as_held_hint(self) -> str:
        kept = "fp16" if self.dtype == "fp16" else "fp32"
        return f"quantize={{{self.name!r}: {kept!r}, ...}}: a dict's first key naming a table decides"

    def refusal(self, sharding: str) -> str:
        """Why fxrec cannot lay the table out as ``sharding``, or "": a table only data-parallel
        (``data_parallel_only``), the model's fp16 tables only as HALF_SHARDINGS, unpooled ones not
        column-wise; served quantized, not data-parallel unless kept as the model holds it (a
        replica keeps the model's own lookups), and not column-wise in an integer dtype (a row's
        scale and bias need the whole row). The one rule for the search and for pins."""
        if self.data_parallel_only and sharding != DATA_PARALLEL:
            return f"{self.data_parallel_only}: the table can only be data_parallel, not {sharding}"
        if self.dtype == "fp16" and sharding not in HALF_SHARDINGS:
            return (f"the table is fp16 in the model, which fxrec shards {' or '.join(HALF_SHARDINGS)} (whole on a "
                    f"rank), not {sharding}: {HALF_WHY}")
        if sharding == COLUMN_WISE and not self.pooled:
            return ("the table is looked up unpooled (one row per id), which fxrec shards table_wise, row_wise or "
                    "table_row_wise, not column_wise")
        whole = " or ".join(s for s in (TABLE_WISE, ROW_WISE) if self.dtype != "fp16" or s in HALF_SHARDINGS)
        if sharding == DATA_PARALLEL and not self.keeps_lookups:
            return (f"data_parallel keeps the model's own lookups, and the table is served quantized {self.quantize}: "
                    f"lay it out {whole}, or leave it as it is ({self._as_held_hint()})")
        if sharding == COLUMN_WISE and self.quantize.startswith("int"):
            return (f"column_wise, and the table is served quantized {self.quantize}, whose per-row scale and bias "
                    f"need the whole row: lay it out {whole}, or quantize it fp16 / fp32")
        return ""

    @property
    def keeps_lookups(self) -> bool:
        """Whether the table may be data-parallel where it is served: quantize= leaves it as the
        model holds it (fp32, or fp16 for the model's fp16 tables), so its lookups can stay the
        model's own, as a data-parallel table's do."""
        return self.quantize in ("", "fp32", "fp16" if self.dtype == "fp16" else "")

    @property
    def weight_bytes(self) -> int:
        return self.num_rows * self.dim * self.element_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        if not d["quantize"]:  # (a plan for training: readable by an fxrec from before plans for serving)
            del d["quantize"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TableSpec":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"fxrec.plan: unknown TableSpec fields {sorted(unknown)} in {d!r}")
        return cls(**d)


#: Bandwidths (GB/s) used when the topology does not give them, per device kind:
#: memory = effective bandwidth of embedding row reads on one rank; intra_host = what one rank
#: moves to the other ranks of its host; inter_host = what one rank moves to other hosts.
#: cpu: random row gathers reach about 20 GB/s on a server socket (well under its stream
#: bandwidth), shared-memory/loopback collectives about 10 GB/s, 100 Gbit/s Ethernet 12.5 GB/s.
#: cuda: a conservative HBM figure (1 TB/s, when the device cannot be asked), NVLink-class 100 GB/s
#: per rank within a host, 200 Gbit/s InfiniBand (25 GB/s) per rank between hosts.
DEFAULT_BANDWIDTHS = {
    "cpu": {"memory_bandwidth": 20.0, "intra_host_bandwidth": 10.0, "inter_host_bandwidth": 12.5},
    "cuda": {"memory_bandwidth": 1000.0, "intra_host_bandwidth": 100.0, "inter_host_bandwidth": 25.0},
}

#: GB/s of a GPU's reads of unified memory (host memory over PCIe 5.0 x16), where not given.
DEFAULT_UVM_BANDWIDTH = 50.0


@dataclass(frozen=True)
class Topology:
    """The machines a plan is for.

    ``memory_per_rank`` (bytes, or a string as :func:`parse_bytes` reads it) is the budget for
    embedding weights and their optimizer state on each rank: leave room for activations and
    dense parameters by giving less than the device has. Bandwidths are GB/s (10**9 bytes/s);
    those left as None are taken from :data:`DEFAULT_BANDWIDTHS` for ``device`` and named in
    ``assumed``, which the printed plan shows.

    ``hbm_budget`` (CUDA; bytes or a string): the GPU memory (HBM) of each rank for its tables;
    ``memory_per_rank`` is then what a rank holds in all, GPU and host memory together, and the
    shards beyond the budget go to unified memory with an HBM cache of ``cache_load_factor`` of
    their rows, by the rule ``transform(hbm_budget=)`` applies on each rank
    (:mod:`fxrec.planner.unified`). Their reads that miss the cache cross the bus at
    ``uvm_bandwidth`` GB/s (default :data:`DEFAULT_UVM_BANDWIDTH`, named in ``assumed``).
    """

    world_size: int
    memory_per_rank: int
    ranks_per_host: Optional[int] = None  # None: all ranks on one host
    device: str = "cpu"
    memory_bandwidth: Optional[float] = None
    intra_host_bandwidth: Optional[float] = None
    inter_host_bandwidth: Optional[float] = None
    assumed: Tuple[str, ...] = ()
    hbm_budget: Optional[int] = None
    cache_load_factor: float = 0.2
    uvm_bandwidth: Optional[float] = None

    def __post_init__(self):
        ws = self.world_size
        if isinstance(ws, bool) or not isinstance(ws, int) or ws < 1:
            raise ValueError(f"fxrec.plan: world_size must be an int >= 1, got {ws!r}")
        if ws > MAX_WORLD_SIZE:  # (a plan keeps figures per rank: a plan file edited to 10**12 took all memory)
            raise ValueError(f"fxrec.plan: world_size {ws} is more than the {MAX_WORLD_SIZE} ranks fxrec plans for")
        if self.device not in DEFAULT_BANDWIDTHS:
            raise ValueError(f"fxrec.plan: device must be one of {sorted(DEFAULT_BANDWIDTHS)}, got {self.device!r}")
        if self.memory_per_rank is None:
            raise ValueError(
                "fxrec.plan: memory_per_rank is required (e.g. memory_per_rank='16GB'); it is read from the device "
                "only by fxrec.plan(device='cuda') on a machine with CUDA"
            )
        object.__setattr__(self, "memory_per_rank", parse_bytes(self.memory_per_rank))
        rph = ws if self.ranks_per_host is None else self.ranks_per_host
        if isinstance(rph, bool) or not isinstance(rph, int) or rph < 1 or ws % rph:
            raise ValueError(
                f"fxrec.plan: ranks_per_host must divide world_size {ws} (hosts of equal size), got {self.ranks_per_host!r}"
            )
        object.__setattr__(self, "ranks_per_host", rph)
        assumed = list(self.assumed)
        for name, default in DEFAULT_BANDWIDTHS[self.device].items():
            v = getattr(self, name)
            if v is None:
                object.__setattr__(self, name, float(default))
                assumed.append(f"{name} {default:g} GB/s ({self.device} default)")
            elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"fxrec.plan: {name} must be a positive number of GB/s, got {v!r}")
            else:
                object.__setattr__(self, name, float(v))
        lf = self.cache_load_factor
        if isinstance(lf, bool) or not isinstance(lf, (int, float)) or not 0 < lf <= 1:
            raise ValueError(f"fxrec.plan: cache_load_factor must be a number in (0, 1], got {lf!r}")
        object.__setattr__(self, "cache_load_factor", float(lf))
        uvm = self.uvm_bandwidth
        if self.hbm_budget is None and (uvm is not None or self.cache_load_factor != 0.2):
            raise ValueError("fxrec.plan: cache_load_factor and uvm_bandwidth are for a plan with hbm_budget= "
                             "(they describe its unified memory)")
        if self.hbm_budget is not None:
            if self.device != "cuda":
                raise ValueError("fxrec.plan: hbm_budget= is the GPU memory of a rank's tables: it needs device='cuda'")
            object.__setattr__(self, "hbm_budget", parse_bytes(self.hbm_budget, "hbm_budget"))
            if uvm is None and not any(a.startswith("uvm_bandwidth ") for a in assumed):
                uvm = DEFAULT_UVM_BANDWIDTH
                assumed.append(f"uvm_bandwidth {uvm:g} GB/s (reads of unified memory over the bus; cuda default)")
        if uvm is not None:
            if isinstance(uvm, bool) or not isinstance(uvm, (int, float)) or not math.isfinite(uvm) or uvm <= 0:
                raise ValueError(f"fxrec.plan: uvm_bandwidth must be a positive number of GB/s, got {uvm!r}")
            object.__setattr__(self, "uvm_bandwidth", float(uvm))
        object.__setattr__(self, "assumed", tuple(assumed))

    @property
    def hosts(self) -> int:
        return self.world_size // self.ranks_per_host

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host

    def host_ranks(self, host: int) -> Tuple[int, ...]:
        p = self.ranks_per_host
        return tuple(range(host * p, (host + 1) * p))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["assumed"] = list(self.assumed)
        if self.hbm_budget is None:  # (as a plan file was before them: an older fxrec reads it)
            for k in ("hbm_budget", "cache_load_factor", "uvm_bandwidth"):
                del d[k]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Topology":
        d = dict(d)
        d["assumed"] = tuple(d.get("assumed", ()))
        return cls(**d)


class Shard(NamedTuple):
    """One piece of a table on one rank: rows ``[row_offset, row_offset + num_rows)`` and columns
    ``[col_offset, col_offset + num_cols)`` of the table ``table``. ``bytes`` is the memory it
    takes there (weights + optimizer state, + the dense gradient for data-parallel), ``cost_ms``
    its estimated share of that rank's step time. A row-wise shard may have ``num_rows == 0``
    (more ranks than row blocks); it is listed so that every rank of the table is named.
    (A NamedTuple: plans of thousands of tables hold hundreds of thousands of shards.)"""

    table: str
    rank: int
    row_offset: int
    num_rows: int
    col_offset: int
    num_cols: int
    bytes: int
    cost_ms: float

    def to_dict(self) -> dict:
        return {
            "rank": self.rank, "row_offset": self.row_offset, "num_rows": self.num_rows,
            "col_offset": self.col_offset, "num_cols": self.num_cols, "bytes": self.bytes, "cost_ms": self.cost_ms,
        }


@dataclass(frozen=True)
class TablePlan:
    """A table, how it is sharded, and its shards (in rank order for row-wise types, in column
    order for column-wise)."""

    spec: TableSpec
    sharding: str
    shards: Tuple[Shard, ...]
    optimizer: str = "none"
    pinned: bool = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def ranks(self) -> Tuple[int, ...]:
        return tuple(s.rank for s in self.shards)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    @property
    def cost_ms(self) -> float:
        return sum(s.cost_ms for s in self.shards)

    def to_dict(self) -> dict:
        d = self.spec.to_dict()  # ("optimizer": the spec's own; the one the plan sized it for apart)
        d.update(sharding=self.sharding, planned_optimizer=self.optimizer, pinned=self.pinned,
                 shards=[s.to_dict() for s in self.shards])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TablePlan":
        d = dict(d)
        sharding = d.pop("sharding")
        if sharding not in SHARDING_TYPES:
            raise ValueError(f"fxrec.plan: unknown sharding type {sharding!r} in a saved plan")
        # plans saved before "planned_optimizer" held the plan's under "optimizer" (the spec's was lost)
        optimizer = d.pop("planned_optimizer") if "planned_optimizer" in d else d.pop("optimizer")
        pinned = d.pop("pinned")
        shards = d.pop("shards")
        spec = TableSpec.from_dict(d)
        return cls(spec, sharding, tuple(Shard(table=spec.name, **s) for s in shards), optimizer, pinned)


def check_shards(tp: "TablePlan", topology: "Topology") -> None:
    """Raises ValueError naming the table where its shards are not the layout the shard pass
    cuts for its sharding type (:mod:`fxrec.planner.layout`; a plan edited by hand, or for
    another world size): a block of rows on another rank than the ids are sent to would give
    wrong outputs without an error."""
    from .layout import COLUMN_ALIGNMENT, row_blocks

    name, R, D, W = tp.spec.name, tp.spec.num_rows, tp.spec.dim, topology.world_size

    def bad(why: str):
        raise ValueError(f"fxrec.plan: table {name!r} is planned {tp.sharding}, but {why}")

    for sh in tp.shards:
        if sh.table != name:
            bad(f"one of its shards names table {sh.table!r}")
        for f in ("rank", "row_offset", "num_rows", "col_offset", "num_cols", "bytes"):
            v = getattr(sh, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                bad(f"a shard's {f} is {v!r}, not an int >= 0")
        if isinstance(sh.cost_ms, bool) or not isinstance(sh.cost_ms, (int, float)) or not math.isfinite(sh.cost_ms) \
                or sh.cost_ms < 0:
            bad(f"a shard's cost_ms is {sh.cost_ms!r}, not a number >= 0")
        if sh.rank >= W:
            bad(f"a shard is on rank {sh.rank}, outside world_size {W}")
    got = sorted((sh.rank, sh.row_offset, sh.num_rows, sh.col_offset, sh.num_cols) for sh in tp.shards)
    every = {"row_wise": W, "data_parallel": W, "table_row_wise": topology.ranks_per_host or W}.get(tp.sharding)
    if every is not None and len(got) != every:  # (first: the layouts below list every rank)
        bad(f"it has {len(got)} shards, where it has one on each of {every} ranks")
    if tp.sharding == "table_wise":
        if len(got) != 1 or got[0][1:] != (0, R, 0, D):
            bad(f"its shards are {got} (rank, row offset, rows, column offset, columns), not one of {R} x {D}")
    elif tp.sharding in ("row_wise", "table_row_wise"):
        ranks = tuple(g[0] for g in got)
        if tp.sharding == "row_wise":
            want_ranks = tuple(range(W))
        else:
            per = topology.ranks_per_host or W
            want_ranks = topology.host_ranks(ranks[0] // per) if ranks and topology.ranks_per_host else tuple(range(W))
        want = [(r, o, n, 0, D) for r, (o, n) in zip(want_ranks, row_blocks(R, len(want_ranks)))]
        if got != want:
            bad(f"its shards are {got} (rank, row offset, rows, column offset, columns), where the rows are cut "
                f"{want}: ids are sent to the ranks by that cut")
    elif tp.sharding == "column_wise":
        ranks = [g[0] for g in got]
        if len(set(ranks)) != len(ranks):
            bad(f"two of its column shards are on one rank ({ranks})")
        cols = sorted((g[3], g[4]) for g in got)
        edge = 0
        for off, width in cols:
            if off != edge or width <= 0 or width % COLUMN_ALIGNMENT:
                bad(f"its column shards {cols} (offset, columns) do not cut its {D} columns into consecutive pieces "
                    f"of a multiple of {COLUMN_ALIGNMENT} columns")
            edge += width
        if edge != D or any(g[1:3] != (0, R) for g in got):
            bad(f"its shards {got} (rank, row offset, rows, column offset, columns) do not cover its {R} x {D} "
                "exactly, each with every row")
    elif tp.sharding == "data_parallel":
        want = [(r, 0, R, 0, D) for r in range(W)]
        if got != want:
            bad(f"its shards are {got}, not the whole table on each of the {W} ranks")


@dataclass(frozen=True)
class ShardingPlan:
    """Where every embedding table goes: ``plan.tables[name]`` is a :class:`TablePlan`.

    ``print(plan)`` shows one line per table (table | sharding | ranks | shard sizes | bytes per
    rank | est. cost), then memory and estimated cost per rank, the balance (max / mean rank
    cost) and every figure that was assumed rather than given. ``plan.shards_on(rank)`` lists
    what one rank holds. ``save``/``load``/``to_json``/``from_json`` round-trip exactly.
    """

    topology: Topology
    tables: Dict[str, TablePlan]
    batch_size: int
    optimizer: str = "none"
    notes: Tuple[str, ...] = ()

    def __post_init__(self):
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"fxrec.plan: batch_size must be an int >= 1, got {self.batch_size!r}")
        if not isinstance(self.optimizer, str):
            raise ValueError(f"fxrec.plan: optimizer must be a string, got {self.optimizer!r}")
        if not isinstance(self.notes, tuple) or not all(isinstance(n, str) for n in self.notes):
            raise ValueError(f"fxrec.plan: notes must be strings, got {self.notes!r}")
        for tp in self.tables.values():
            check_shards(tp, self.topology)

    # ----------------------------------------------------------------- queries
    def __getitem__(self, table: str) -> TablePlan:
        return self.tables[table]

    def __contains__(self, table: str) -> bool:
        return table in self.tables

    def __len__(self) -> int:
        return len(self.tables)

    def shards_on(self, rank: int) -> List[Shard]:
        """The shards rank ``rank`` holds, in table order (the sharding type of each is
        ``plan[shard.table].sharding``)."""
        if not 0 <= rank < self.topology.world_size:
            raise ValueError(f"fxrec.plan: rank {rank} is outside world_size {self.topology.world_size}")
        return [s for tp in self.tables.values() for s in tp.shards if s.rank == rank]

    @property
    def serving(self) -> bool:
        """A plan made with ``quantize=``: shards sized as served (packed rows, no optimizer state
        or gradients), for ``transform(mode="inference", quantize=...)``."""
        return any(tp.spec.quantize for tp in self.tables.values())

    def quantized_text(self) -> str:
        kinds = sorted({tp.spec.quantize for tp in self.tables.values()})
        return "quantized " + ", ".join(kinds)

    def rank_bytes(self) -> List[int]:
        """Memory used on each rank (bytes), summed over the shards."""
        out = [0] * self.topology.world_size
        for tp in self.tables.values():
            for s in tp.shards:
                out[s.rank] += s.bytes
        return out

    def rank_cost_ms(self) -> List[float]:
        """Estimated cost of each rank (ms per step), summed over the shards."""
        out = [0.0] * self.topology.world_size
        for tp in self.tables.values():
            for s in tp.shards:
                out[s.rank] += s.cost_ms
        return out

    def unified_memory(self) -> List[Tuple[Dict[str, str], int]]:
        """With the topology's ``hbm_budget``: per rank, the tables whose shards there are in unified
        memory (name -> ``"managed_caching"``, or ``"managed"``: a quantized one without a cache)
        and the GPU memory its tables take, by the rule transform applies
        (:mod:`fxrec.planner.unified`); an empty list without a budget."""
        if self.topology.hbm_budget is None:
            return []
        from . import unified
        from .cost import CostModel

        cm = CostModel(self.topology, self.batch_size, [tp.spec for tp in self.tables.values() if tp.spec.quantize])

        on: List[list] = [[] for _ in range(self.topology.world_size)]
        for tp in self.tables.values():
            for s in tp.shards:
                if s.num_rows and s.num_cols:
                    on[s.rank].append((tp.spec, tp.optimizer, tp.sharding, s.num_rows, s.num_cols))
        return [unified.placements(mine, self.topology, cm) for mine in on]

    @property
    def max_cost_ms(self) -> float:
        """The estimated step time of the embeddings: the busiest rank's cost."""
        return max(self.rank_cost_ms())

    @property
    def balance(self) -> float:
        """max / mean of the per-rank estimated costs (1.0 is perfect; 1.0 when there is no cost)."""
        costs = self.rank_cost_ms()
        mean = sum(costs) / len(costs)
        return max(costs) / mean if mean > 0 else 1.0

    # ------------------------------------------------------------------- JSON
    def to_dict(self) -> dict:
        costs = self.rank_cost_ms()
        return {
            "format": PLAN_FORMAT, "version": PLAN_VERSION,
            "topology": self.topology.to_dict(), "batch_size": self.batch_size, "optimizer": self.optimizer,
            "notes": list(self.notes),
            "tables": [tp.to_dict() for tp in self.tables.values()],
            # Informative only (recomputed from the shards on load):
            "summary": {"rank_bytes": self.rank_bytes(), "rank_cost_ms": costs, "balance": self.balance},
        }

    def to_json(self, indent: Optional[int] = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> "ShardingPlan":
        if not isinstance(d, dict):
            raise ValueError(f"fxrec.plan: not a saved sharding plan (a JSON {type(d).__name__}, not an object)")
        if d.get("format") != PLAN_FORMAT:
            raise ValueError(f"fxrec.plan: not a saved sharding plan (format {d.get('format')!r})")
        if d.get("version") != PLAN_VERSION:
            raise ValueError(f"fxrec.plan: sharding plan version {d.get('version')!r}, this fxrec reads {PLAN_VERSION}")
        try:
            tables = [TablePlan.from_dict(t) for t in d["tables"]]
            plan = cls(
                topology=Topology.from_dict(d["topology"]), tables={t.name: t for t in tables},
                batch_size=d["batch_size"], optimizer=d["optimizer"],
                notes=tuple(d["notes"]) if isinstance(d["notes"], list) else d["notes"],
            )
        except (KeyError, TypeError, AttributeError) as e:  # (a file edited or cut: what is missing or odd)
            raise ValueError(f"fxrec.plan: not a valid sharding plan ({type(e).__name__}: {e})") from None
        twice = sorted({t.name for t in tables if sum(u.name == t.name for u in tables) > 1})
        if twice:
            raise ValueError(f"fxrec.plan: the saved plan lists tables {twice} more than once")
        over = [(r, b) for r, b in enumerate(plan.rank_bytes()) if b > plan.topology.memory_per_rank]
        if over:
            raise ValueError(f"fxrec.plan: the saved plan puts {over[0][1]} bytes on rank {over[0][0]}, more than its "
                             f"memory_per_rank ({plan.topology.memory_per_rank}): not a plan fxrec.plan makes")
        return plan

    @classmethod
    def from_json(cls, text: str) -> "ShardingPlan":
        return cls.from_dict(json.loads(text))

    def save(self, path) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())
            f.write("\n")

    @classmethod
    def load(cls, path) -> "ShardingPlan":
        with open(path) as f:
            return cls.from_json(f.read())

    # ------------------------------------------------------------------ print
    def __str__(self) -> str:
        return self.format()

    def format(self, max_tables: Optional[int] = None) -> str:
        """The printed plan; ``max_tables`` limits the table lines (the costliest are kept)."""
        topo = self.topology
        rows = []
        items = list(self.tables.values())
        if max_tables is not None and len(items) > max_tables:
            keep = {id(t) for t in sorted(items, key=lambda t: -t.cost_ms)[:max_tables]}
            items = [t for t in items if id(t) in keep]
        for tp in items:
            per_rank: Dict[int, int] = {}
            for s in tp.shards:
                per_rank[s.rank] = per_rank.get(s.rank, 0) + s.bytes
            rows.append((
                tp.name + (" (pinned)" if tp.pinned else ""),
                tp.sharding + (f", stored {tp.spec.weights}" if tp.spec.weights and tp.sharding != DATA_PARALLEL else "")
                + (f", {tp.spec.quantize}" if tp.spec.quantize and tp.sharding != DATA_PARALLEL else ""),
                _ranks_text(tp.ranks),
                _shapes_text(tp.shards), format_bytes(max(per_rank.values())) if per_rank else "0 B",
                f"{tp.cost_ms:.4g} ms",
            ))
        header = ("table", "sharding", "ranks", "shard sizes (rows x cols)", "bytes per rank (max)", "est. cost")
        out = [
            f"ShardingPlan: {_n(len(self.tables), 'table')} on {_n(topo.world_size, topo.device + ' rank')} "
            f"({topo.hosts} host{'s' if topo.hosts > 1 else ''} of {topo.ranks_per_host}), "
            f"{format_bytes(topo.memory_per_rank)} per rank, batch {self.batch_size} per rank, "
            + (f"for serving ({self.quantized_text()})" if self.serving else f"optimizer {self.optimizer}"),
        ]
        out += _table(header, rows)
        out.append("(est. cost: ms per step, summed over the table's shards; bytes per rank: the most it puts on one rank)")
        if max_tables is not None and len(self.tables) > len(items):
            out.append(f"... {len(self.tables) - len(items)} cheaper tables not shown")
        mem = self.rank_bytes()
        cost = self.rank_cost_ms()
        nshards = [0] * topo.world_size
        for tp in self.tables.values():
            for s in tp.shards:
                nshards[s.rank] += 1
        out.append("")
        rank_rows = [
            (str(r), str(topo.host_of(r)),
             f"{format_bytes(mem[r])} / {format_bytes(topo.memory_per_rank)} ({100 * mem[r] / topo.memory_per_rank:.1f}%)",
             f"{cost[r]:.4g} ms", str(nshards[r]))
            for r in range(topo.world_size)
        ]
        header = ("rank", "host", "memory used / limit", "est. cost", "shards")
        if topo.hbm_budget is not None:  # where each rank's tables live
            header += ("GPU memory / hbm_budget", "in unified memory")
            rank_rows = [row + (f"{format_bytes(need)} / {format_bytes(topo.hbm_budget)}",
                                ", ".join(sorted(where)[:4]) + (f", ... ({len(where)})" if len(where) > 4 else "") or "-")
                         for row, (where, need) in zip(rank_rows, self.unified_memory())]
        out += _table(header, rank_rows)
        mean = sum(cost) / len(cost)
        out.append(
            f"balance (max / mean est. cost): {self.balance:.3f}  (max {max(cost):.4g} ms on rank "
            f"{cost.index(max(cost))}, mean {mean:.4g} ms); memory: max {100 * max(mem) / topo.memory_per_rank:.1f}% "
            f"of the limit"
        )
        out.append(
            f"bandwidths (GB/s): memory {topo.memory_bandwidth:g}, within a host {topo.intra_host_bandwidth:g}, "
            f"between hosts {topo.inter_host_bandwidth:g}"
            + (f", unified memory {topo.uvm_bandwidth:g}" if topo.hbm_budget is not None else "")
        )
        if topo.hbm_budget is not None:
            out.append(f"hbm_budget {format_bytes(topo.hbm_budget)} a rank (memory used: GPU and host memory together); "
                       f"shards in unified memory have an HBM cache of {topo.cache_load_factor:g} of their rows, and their "
                       "est. cost counts the reads that miss it")
        assumed = list(topo.assumed) + list(self.notes)
        if assumed:
            out.append("assumed / notes:")
            out += [f"  - {a}" for a in assumed]
        return "\n".join(out)


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _ranks_text(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 3, 7] -> '0-3,7'."""
    rs = sorted(set(ranks))
    parts = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(parts)


def _shapes_text(shards: Iterable[Shard]) -> str:
    """Distinct shard shapes in order, with a count when repeated: '1563x64 (63), 1500x64'."""
    counts: Dict[Tuple[int, int], int] = {}
    for s in shards:
        counts[(s.num_rows, s.num_cols)] = counts.get((s.num_rows, s.num_cols), 0) + 1
    return ", ".join(f"{r}x{c}" + (f" ({n})" if n > 1 else "") for (r, c), n in counts.items())


def _table(header, rows) -> List[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
    line = lambda cells: " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [line(header), "-+-".join("-" * w for w in widths)] + [line(r) for r in rows]

