"""place_tables: on CUDA with ``hbm_budget=``, decide which tables live in GPU memory (HBM) and
which in unified memory (host RAM the GPU reads over the bus), so that the tables fit the budget.

The rule (no measurement): every table starts on the device. While the tables' HBM bytes
(:func:`hbm_bytes`) exceed the budget, the next largest table that an fbgemm TBE holds (fp32
groups on the fbgemm kernel; ties by name) moves to unified memory, unless that saves no HBM (a
small table cached at its group's widest width):

* ``managed_caching`` where only fbgemm's kernel writes its rows between the points where fxrec
  writes its HBM cache back (a group trained with an optimizer fused into fbgemm's backward, or
  one served in inference): its rows in unified memory, a cache of ``cache_load_factor`` of them
  in HBM (fbgemm's LRU cache);
* ``managed`` otherwise (training with PyTorch's gradients, whose torch.optim step writes the
  parameters themselves: a cache would go stale): the rows read from unified memory directly.

If the budget is not met with every such table moved, that is an error giving the bytes needed.
Before/After: the graph is unchanged; each GroupRecord gets ``placements`` (param -> placement)
and ``cache_load_factor``, and its decision's ``placement`` says where its tables are.

Not handled: quantized groups (IntNBit) and groups on other kernels stay in HBM and count
against the budget; with a sharding plan the planner places the tables (``hbm_budget`` is refused).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Tuple

import torch.fx as fx

from .. import meta
from ..pass_infra import PassContext, PassResult, compiler_pass
from ..runtime.kernels import FBGEMM
from ..runtime.specs import pad_dim

#: fbgemm's cache is set-associative with this many ways (DEFAULT_ASSOC on CUDA): its rows come in
#: multiples of it.
CACHE_WAYS = 32
#: Optimizer state bytes per stored element (a) and per row (b) of a table, by fused optimizer.
STATE_BYTES = {None: (0, 0), "sgd": (0, 0), "adagrad": (4, 0), "rowwise_adagrad": (0, 4), "adam": (8, 0)}


def table_bytes(rows: int, width: int, fused) -> int:
    """HBM bytes of an fp32 table held on the device, and its fused optimizer's states."""
    a, b = STATE_BYTES[fused.kind if fused is not None else None]
    return rows * (width * (4 + a) + b)


def cache_bytes(caching: List[Tuple[int, int]], load_factor: float) -> int:
    """HBM bytes of one TBE's cache for its ``managed_caching`` tables (``(rows, stored width)``):
    ``load_factor`` of their rows (rounded up to whole sets) at the widest width, fp32, with two
    int64 states a cache row, and an int32 a table row (fbgemm's cache index map)."""
    if not caching:
        return 0
    rows = sum(r for r, _ in caching)
    slots = max(1, math.ceil(int(rows * load_factor) / CACHE_WAYS)) * CACHE_WAYS
    return slots * (max(w for _, w in caching) * 4 + 16) + rows * 4


def hbm_bytes(groups, placements: Dict[str, str], load_factor: float) -> int:
    """The HBM the groups' tables take with ``placements`` (param -> placement; absent: device)."""
    total = 0
    for gr in groups:
        caching = []
        for p, rec in _tables(gr):
            where = placements.get(p, "device")
            width = pad_dim(rec.dim)
            if where == "device":
                total += table_bytes(rec.num_rows, width, gr.fused)
            elif where == "managed_caching":
                caching.append((rec.num_rows, width))
        total += cache_bytes(caching, load_factor)
    return total


def _tables(gr):
    seen = {}
    for r in gr.lookups:
        seen.setdefault(r.param, r)
    return list(seen.items())


def _movable(gr, training: bool) -> str:
    """Where a table of ``gr`` goes when it leaves HBM: "" (it cannot), managed or managed_caching."""
    kernel = gr.kernel_train if training else gr.kernel_eval
    if not gr.lower or gr.quant or kernel != FBGEMM or any(r.dtype.replace("torch.", "") not in ("", "float32") for r in gr.lookups):
        return ""
    return "managed_caching" if (gr.fused is not None or not training) else "managed"


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
    placements: Dict[str, str] = {}
    candidates = sorted(((gr, p, rec) for gr in groups if _movable(gr, training) for p, rec in _tables(gr)),
                        key=lambda c: (-table_bytes(c[2].num_rows, pad_dim(c[2].dim), c[0].fused), c[2].table))
    need = hbm_bytes(groups, placements, lf)
    for gr, p, rec in candidates:
        if need <= budget:
            break
        placements[p] = _movable(gr, training)
        moved = hbm_bytes(groups, placements, lf)
        if moved < need:
            need = moved
        else:  # a small table cached at its group's widest width can cost more than it saves
            del placements[p]
    if need > budget:
        raise ValueError(
            f"fxrec: the embedding tables need {_fmt(need)} of GPU memory even with every table fbgemm holds that "
            f"saves memory there in unified memory (cache_load_factor={lf}), more than hbm_budget={_fmt(budget)}: "
            "raise the budget, lower cache_load_factor, or shard the tables over GPUs with a plan")
    moved = 0
    for gr in groups:
        gr.placements = {p: placements[p] for p, _ in _tables(gr) if p in placements}
        gr.cache_load_factor = lf
        moved += len(gr.placements)
        where = sorted(set(gr.placements.values()) | ({"device"} if len(gr.placements) < len(_tables(gr)) else set()))
        text = "+".join(where)
        if gr.placements:
            text += " (" + ", ".join(f"{rec.table}: {gr.placements[p]}" for p, rec in _tables(gr) if p in gr.placements)
            text += f"; HBM cache {lf:g} of the cached rows)" if "managed_caching" in where else ")"
        gr.decision = dataclasses.replace(gr.decision, placement=text)
        for r in gr.lookups:
            r.node.meta[meta.DECISION] = gr.decision
    return PassResult(gm, False, {"hbm_budget": _fmt(budget), "tables_hbm": _fmt(need), "tables_in_unified_memory": moved})
