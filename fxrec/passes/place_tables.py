"""place_tables: on CUDA with ``hbm_budget=``, decide which tables live in GPU memory (HBM) and
which in unified memory (host RAM the GPU reads over the bus), so that the tables fit the budget.

What is counted (:func:`hbm_bytes`), per table in HBM: its rows at their stored width, fp32 or as
``weights_precision=`` stores them (or its quantized rows as fbgemm packs them for CUDA), its fused optimizer's states, and in training
without a fused optimizer its dense gradient (a table with sparse gradients: none). A table in
unified memory costs its share of its group's HBM cache (``cache_load_factor`` of the cached
rows, in sets of 32 rows at the group's widest cached width and its precision, two int64 states a
cache row and an int32 a table row: fbgemm's) and a row-wise optimizer state, which fbgemm keeps in HBM. Not
counted: torch.optim's own states, activations, per-batch workspaces.

The rule (no measurement): every table starts in HBM. While the count exceeds the budget, the
next largest table that may move (ties by name) goes to unified memory as ``managed_caching``
(rows in unified memory, an LRU cache of them in HBM), unless that saves no HBM (a small table
cached at its group's widest width). A table may move where fbgemm's kernel alone reads and
writes its rows: an fp32 group on the fbgemm kernel in inference, or in training with an
optimizer fused into fbgemm's backward (for training and inference). Training with PyTorch's
gradients keeps its tables in HBM: their gradients and torch.optim's states are table-sized in
HBM wherever the rows live. Quantized tables (inference: fbgemm's IntNBit kernel alone reads
them) move as ``managed_caching`` too: their packed rows in unified memory, an LRU cache of them
in HBM (``cache_load_factor`` of the cached rows at the widest cached packed row, 16-byte rows,
with fbgemm's two int64 states a cache row and an int32 map entry a table row), filled by
fbgemm's caching lookup (:mod:`fxrec.runtime.kernels.fbgemm_nbit`). Where the budget is still not
met with every movable table moved, the quantized tables go to unified memory without a cache,
largest first, until it is (``managed``: read over the bus at each lookup, no HBM at all); then
the moved tables that fit in HBM again come back, smallest first. A sharded model's pieces are
placed per rank by the same rule (place_shards). If the budget is not met, that is an error giving
the bytes needed.

Before/After: the graph is unchanged; each GroupRecord gets ``placements`` (param -> placement)
and ``cache_load_factor``, and its decision's ``placement`` says where its tables are.

With a sharding plan, place_shards applies the same rule (:func:`place`) on each rank to the
pieces of tables it holds.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Dict, List, Optional, Sequence, Tuple

import torch.fx as fx

from .. import meta
from ..pass_infra import InputError, PassContext, PassResult, compiler_pass
from ..runtime.kernels import FBGEMM
from ..runtime.specs import FUSED_STATE_BYTES, pad_dim

from ..runtime.kernels.fbgemm_nbit_cache import CACHE_WAYS  # noqa: E402  (fbgemm's ways a cache set)


def table_bytes(rows: int, width: int, fused: str = "", gradient: bool = False, weight_bytes: int = 4) -> int:
    """HBM bytes of a table held on the device (``weight_bytes`` an element: 4 fp32, 2 fp16/bf16),
    the states of its fused optimizer (``fused``: a FusedSpec kind, "" for none; fp32) and
    (``gradient``) a dense gradient of it, of the table's dtype (tables stored lower by
    weights_precision= have none: they train fused)."""
    b, a = FUSED_STATE_BYTES[fused] if fused else (0, 0)
    return rows * (width * (weight_bytes + a + (weight_bytes if gradient else 0)) + b)


def cache_bytes(caching: List[Tuple[int, int]], load_factor: float, weight_bytes: int = 4) -> int:
    """HBM bytes of one TBE's cache for its ``managed_caching`` tables (``(rows, stored width)``):
    ``load_factor`` of their rows (rounded up to whole sets) at the widest width, in the tables'
    precision (``weight_bytes`` an element), with two int64 states a cache row, and an int32 a
    table row (fbgemm's cache index map)."""
    if not caching:
        return 0
    rows = sum(r for r, _ in caching)
    slots = max(1, math.ceil(int(rows * load_factor) / CACHE_WAYS)) * CACHE_WAYS
    return slots * (max(w for _, w in caching) * weight_bytes + 16) + rows * 4


@dataclasses.dataclass(frozen=True)
class Held:
    """One table as the rule counts it (in a sharded model: the piece of it one rank holds):
    ``rows`` at its stored ``width`` of ``weight_bytes`` a value, its fused optimizer's states
    (``fused``: a FusedSpec kind, "" for none), ``gradient``: a dense gradient of it in HBM,
    ``packed``: a quantized table's bytes as fbgemm packs them for CUDA (None: not quantized),
    ``movable``: fbgemm's kernel alone reads and writes its rows, ``moves_to``: the placement it
    takes when it leaves HBM. ``key`` names it in the placements (unique among the tables placed
    together). A quantized table's ``width`` is its packed row's bytes, ``weight_bytes`` 1 (what
    its cache rows hold: :func:`quantized_held`)."""

    key: str
    name: str
    rows: int
    width: int
    weight_bytes: int = 4
    fused: str = ""
    gradient: bool = False
    packed: Optional[int] = None
    movable: bool = False
    moves_to: str = "managed_caching"
    uncached: str = ""  # where it goes without its cache, if the budget is not met with it ("": nowhere)

    @property
    def nbytes(self) -> int:
        """Its bytes in HBM, states and gradient included."""
        if self.packed is not None:
            return self.packed
        return table_bytes(self.rows, self.width, self.fused, self.gradient, self.weight_bytes)


def hbm_bytes(groups: Sequence[Sequence[Held]], placements: Dict[str, str], load_factor: float) -> int:
    """The HBM the tables take with ``placements`` (key -> placement; absent: device); each entry
    of ``groups`` is the tables of one TBE, which holds one cache for its cached tables."""
    total = 0
    for tables in groups:
        caching = []
        for t in tables:
            where = placements.get(t.key, "device")
            if where == "device":
                total += t.nbytes
            elif where == "managed":  # (quantized rows in unified memory, no cache)
                continue
            else:  # managed_caching: a row-wise state stays in HBM
                caching.append(t)
                total += t.rows * (FUSED_STATE_BYTES[t.fused][0] if t.fused else 0)
        if caching:  # (one precision a TBE)
            total += cache_bytes([(t.rows, t.width) for t in caching], load_factor, caching[0].weight_bytes)
    return total


def place(groups: Sequence[Sequence[Held]], budget: int, load_factor: float) -> Tuple[Dict[str, str], int]:
    """The rule: every table starts in HBM; while the count exceeds ``budget``, the next largest
    movable table (ties by name) goes to unified memory as its ``moves_to`` says, unless that saves
    no HBM; then, while it still exceeds it, the next largest table that may go without a cache
    (``uncached``: a quantized one, moved or not) does; and where that was needed, the moved tables
    that fit in HBM again come back, smallest first. Returns the placements (key ->
    "managed_caching" or "managed") and the HBM they need, which the caller compares with the
    budget (the error's words are its own)."""
    placements: Dict[str, str] = {}
    candidates = sorted((t for tables in groups for t in tables if t.movable),
                        key=lambda t: (-(t.packed if t.packed is not None else
                                         table_bytes(t.rows, t.width, t.fused, weight_bytes=t.weight_bytes)), t.name))
    need = hbm_bytes(groups, placements, load_factor)
    for t in candidates:
        if need <= budget:
            break
        placements[t.key] = t.moves_to
        moved = hbm_bytes(groups, placements, load_factor)
        if moved < need:
            need = moved
        else:  # a small table cached at its group's widest width can cost more than it saves
            del placements[t.key]
    dropped = False
    for t in candidates:  # still over: the tables that may go without a cache do (moved or not), largest first
        if need <= budget:
            break
        if t.uncached and placements.get(t.key, t.moves_to) == t.moves_to:
            placements[t.key] = t.uncached
            need = hbm_bytes(groups, placements, load_factor)
            dropped = True
    if dropped and need <= budget:  # the moves the caches made needless: back in HBM, smallest first,
        for t in reversed(candidates):  # where they still fit
            was = placements.pop(t.key, None)
            if was is not None and hbm_bytes(groups, placements, load_factor) > budget:
                placements[t.key] = was
        need = hbm_bytes(groups, placements, load_factor)
    return placements, need


def placement_text(names: Sequence[Tuple[str, str]], placements: Dict[str, str], load_factor: float) -> str:
    """A group's placement as the report gives it, ``names`` its tables' ``(key, name)``:
    ``device``, ``managed_caching`` or ``device+managed_caching``, with the cached tables named."""
    moved = [(k, n) for k, n in names if k in placements]
    where = sorted({placements[k] for k, _ in moved} | ({"device"} if len(moved) < len(names) else set()))
    text = "+".join(where)
    if moved:
        text += " (" + ", ".join(f"{n}: {placements[k]}" for k, n in moved)
        text += f"; HBM cache {load_factor:g} of the cached rows)" if "managed_caching" in where else ")"
    return text


def quantized_held(key: str, name: str, rows: int, dim: int, dtype: str) -> Held:
    """A quantized table (or piece) stored ``dim`` wide as the rule counts it: its rows as fbgemm's IntNBit packs them
    for CUDA (16-byte rows, scale and bias included), movable (fbgemm's kernel alone reads them)
    to unified memory with an HBM cache of its packed rows, or without one (``managed``) where the
    budget is not met with it."""
    from ..runtime.kernels.fbgemm_nbit import packed_bytes, row_alignment

    (n,) = packed_bytes([(rows, dim, dtype)], row_alignment("cuda"))
    row = packed_bytes([(1, dim, dtype)], row_alignment("cuda"))[0]
    return Held(key, name, rows, row, 1, packed=n, movable=True, moves_to="managed_caching", uncached="managed")


def quantized_widths(dims_dtypes: Sequence[Tuple[int, str]], pooling: str) -> List[int]:
    """The widths fbgemm's IntNBit TBE stores quantized tables of these dims and dtypes with: each
    dim rounded up to what its dtype needs, in a sequence group the widest of them
    (:func:`fxrec.runtime.quantized.stored_dims`)."""
    from ..runtime.kernels.fbgemm_nbit import quant_align
    from ..runtime.specs import stored_widths

    return stored_widths([types.SimpleNamespace(dim=d) for d, _ in dims_dtypes], pooling,
                         [quant_align(dt) for _, dt in dims_dtypes])


def held_of_group(gr, training: bool) -> List[Held]:
    """The tables of a group record as the rule counts them (keyed by parameter name)."""
    if gr.quant:  # inference on fbgemm's IntNBit kernel: its rows may leave HBM, at their stored widths
        tables = _tables(gr)
        widths = quantized_widths([(rec.dim, gr.quant[p]) for p, rec in tables], gr.pooling)
        return [quantized_held(p, rec.table, rec.num_rows, w, gr.quant[p]) for (p, rec), w in zip(tables, widths)]
    movable = _movable(gr, training)
    wb = gr.lookups[0].stored_bytes if gr.lookups else 4  # (fp16 or weights_precision: one per group)
    fused = gr.fused.kind if gr.fused is not None else ""
    return [Held(p, rec.table, rec.num_rows, pad_dim(rec.dim), wb, fused,
                 training and gr.fused is None and not rec.sparse, None, movable)
            for p, rec in _tables(gr)]


def held_of_module(group, training: bool) -> List[Held]:
    """The tables of a built :class:`~fxrec.runtime.group.EmbeddingGroup` (a rank's local group
    under a plan) as the rule counts them, keyed by table name, by its kernels (a rank's quantized
    pieces are counted from the plan: :func:`fxrec.passes.place_shards.planned`)."""
    fused = group.fused.kind if group.fused is not None else ""
    if training:
        movable = bool(fused) and group.kernel_train == FBGEMM and group.kernel_eval == FBGEMM
    else:
        movable = group.kernel_eval == FBGEMM
    wb = 2 if group.weights or group.half else 4
    return [Held(t.name, t.name, t.num_rows, pad_dim(t.dim), wb, fused, training and not fused and not t.sparse, None,
                 movable and t.dtype in ("float32", "float16"))
            for t in group.tables]


def _tables(gr):
    seen = {}
    for r in gr.lookups:
        seen.setdefault(r.param, r)
    return list(seen.items())


def _movable(gr, training: bool) -> bool:
    """Whether the tables of ``gr`` may leave HBM: fbgemm's kernel alone reads and writes them (fp32
    tables, and the model's fp16 ones, which in training run PyTorch's lookups and so stay)."""
    if not gr.lower or gr.quant or any(r.dtype.replace("torch.", "") not in ("", "float32", "float16")
                                       for r in gr.lookups):
        return False
    if training:
        return gr.fused is not None and gr.kernel_train == FBGEMM and gr.kernel_eval == FBGEMM
    return gr.kernel_eval == FBGEMM


def _advice(groups, training: bool) -> str:
    """What may bring the tables within the budget, for the error: fusing an optimizer only where
    a group trains without one and could have one (the model's fp16 tables cannot: they train on
    PyTorch's lookups, and stay in HBM with their dense gradients)."""
    ways = ["raise the budget", "lower cache_load_factor"]
    unfused = [gr for gr in groups if training and gr.fused is None and gr.lower and not gr.quant]
    half = sorted({r.table for gr in unfused for r in gr.lookups if r.half})
    if any(not r.half for gr in unfused for r in gr.lookups):
        ways.append("fuse the optimizer (optimizer=)")
    ways.append("or shard the tables over GPUs with a plan")
    text = ", ".join(ways)
    if half:
        text += (f" (the model's fp16 tables {half} train on PyTorch's lookups: they stay in GPU memory with "
                 "their dense gradients, and no optimizer is fused into them)")
    return text


def _fmt(n: int) -> str:
    from ..planner.specs import format_bytes

    return format_bytes(n)


@compiler_pass(needs=("groups", "paths"), provides=("placements",))
def place_tables(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    budget, lf = ctx.config.hbm_budget, ctx.config.cache_load_factor
    groups = [gr for gr in ctx.groups if gr.decision is not None and gr.decision.device == "cuda"]
    if budget is None or not groups:
        return PassResult(gm, False, {})
    training = ctx.config.mode == "training"
    placements, need = place([held_of_group(gr, training) for gr in groups], budget, lf)
    if need > budget:
        raise InputError(
            f"fxrec: the embedding tables need {_fmt(need)} of GPU memory (weights, fused optimizer states, and "
            f"dense gradients where training has no fused optimizer) with every table that may leave it, and saves "
            f"memory doing so, in unified memory (cache_load_factor={lf}), more than hbm_budget={_fmt(budget)}: "
            + _advice(groups, training))
    moved = 0
    for gr in groups:
        gr.placements = {p: placements[p] for p, _ in _tables(gr) if p in placements}
        gr.cache_load_factor = lf
        moved += len(gr.placements)
        gr.decision = dataclasses.replace(
            gr.decision, placement=placement_text([(p, rec.table) for p, rec in _tables(gr)], placements, lf))
        for r in gr.lookups:
            r.node.meta[meta.DECISION] = gr.decision
    return PassResult(gm, False, {"hbm_budget": _fmt(budget), "tables_hbm": _fmt(need), "tables_hbm_bytes": need,
                                  "tables_in_unified_memory": moved})
