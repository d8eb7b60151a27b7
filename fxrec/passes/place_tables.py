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
HBM wherever the rows live. If the budget is not met, that is an error giving the bytes needed.

Before/After: the graph is unchanged; each GroupRecord gets ``placements`` (param -> placement)
and ``cache_load_factor``, and its decision's ``placement`` says where its tables are.

Not handled: with a sharding plan the planner places the tables (``hbm_budget`` is refused).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Tuple

import torch.fx as fx

from .. import meta
from ..pass_infra import InputError, PassContext, PassResult, compiler_pass
from ..runtime.kernels import FBGEMM
from ..runtime.specs import FUSED_STATE_BYTES, pad_dim

#: fbgemm's cache is set-associative with this many ways (DEFAULT_ASSOC on CUDA): its rows come in
#: multiples of it.
CACHE_WAYS = 32


def table_bytes(rows: int, width: int, fused, gradient: bool = False, weight_bytes: int = 4) -> int:
    """HBM bytes of a table held on the device (``weight_bytes`` an element: 4 fp32, 2 fp16/bf16),
    its fused optimizer's states (fp32) and (``gradient``) a dense gradient of it, of the table's
    dtype (tables stored lower by weights_precision= have none: they train fused)."""
    b, a = FUSED_STATE_BYTES[fused.kind] if fused is not None else (0, 0)
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


def hbm_bytes(groups, placements: Dict[str, str], load_factor: float, training: bool) -> int:
    """The HBM the groups' tables take with ``placements`` (param -> placement; absent: device)."""
    total = 0
    for gr in groups:
        caching = []
        quant = _quantized_bytes(gr) if gr.quant else {}
        wb = gr.lookups[0].stored_bytes if gr.lookups else 4  # (fp16 or weights_precision: one per group)
        for p, rec in _tables(gr):
            width = pad_dim(rec.dim)
            if p in quant:
                total += quant[p]
            elif placements.get(p, "device") == "device":
                grad = training and gr.fused is None and not rec.sparse
                total += table_bytes(rec.num_rows, width, gr.fused, grad, wb)
            else:  # managed_caching: a row-wise state stays in HBM
                caching.append((rec.num_rows, width))
                total += rec.num_rows * (FUSED_STATE_BYTES[gr.fused.kind][0] if gr.fused is not None else 0)
        total += cache_bytes(caching, load_factor, wb)
    return total


def _quantized_bytes(gr) -> Dict[str, int]:
    """Quantized tables' bytes as fbgemm's IntNBit packs them for CUDA (16-byte rows)."""
    from ..runtime.kernels.fbgemm_nbit import packed_bytes, row_alignment

    tables = _tables(gr)
    sizes = packed_bytes([(rec.num_rows, rec.dim, gr.quant[p]) for p, rec in tables], row_alignment("cuda"))
    return {p: n for (p, _), n in zip(tables, sizes)}


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
    placements: Dict[str, str] = {}
    candidates = sorted(((gr, p, rec) for gr in groups if _movable(gr, training) for p, rec in _tables(gr)),
                        key=lambda c: (-table_bytes(c[2].num_rows, pad_dim(c[2].dim), c[0].fused,
                                                          weight_bytes=c[2].stored_bytes), c[2].table))
    need = hbm_bytes(groups, placements, lf, training)
    for gr, p, rec in candidates:
        if need <= budget:
            break
        placements[p] = "managed_caching"
        moved = hbm_bytes(groups, placements, lf, training)
        if moved < need:
            need = moved
        else:  # a small table cached at its group's widest width can cost more than it saves
            del placements[p]
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
        where = sorted(set(gr.placements.values()) | ({"device"} if len(gr.placements) < len(_tables(gr)) else set()))
        text = "+".join(where)
        if gr.placements:
            text += " (" + ", ".join(f"{rec.table}: {gr.placements[p]}" for p, rec in _tables(gr) if p in gr.placements)
            text += f"; HBM cache {lf:g} of the cached rows)" if "managed_caching" in where else ")"
        gr.decision = dataclasses.replace(gr.decision, placement=text)
        for r in gr.lookups:
            r.node.meta[meta.DECISION] = gr.decision
    return PassResult(gm, False, {"hbm_budget": _fmt(budget), "tables_hbm": _fmt(need), "tables_hbm_bytes": need,
                                  "tables_in_unified_memory": moved})
