"""Tables of a model, as the planner needs them, found by fxrec's own detection.

The model is captured (on a copy) exactly as :func:`fxrec.transform` captures it and its
deciding passes up to grouping run (``annotate_lookups``, ``merge_lookups``, ``group_lookups``);
the :class:`fxrec.meta.LookupRecord` per lookup gives the table,
rows, dim, dtype, feature and form. A table looked up by several features appears once, with
one entry per feature. The ids per sample of each feature are read from the sizes the example
inputs had (torch.export keeps them as the hints of the symbolic sizes):

    bag (ids + offsets)     len(ids) / number of bags (len(offsets), minus 1 with include_last_offset)
    single ([B] ids)        1
    pooled_seq ([B, L])     L
    seq ([B, L, ...])       ids / B, and the table's lookups return one row per id (not pooled)

The passes that decide which lookups transform groups run too (``merge_lookups``,
``group_lookups``). A table none of whose lookups is grouped (see ``LookupRecord.reason``) is not
planned: it stays an ordinary parameter; the plan's notes name it. A table with a grouped lookup
whose weight is also read elsewhere (a lookup left as written, tied weights, the model's own use
of it) can only be data-parallel: sharded tables are only looked up.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch


@dataclass
class FoundTable:
    """A table found in the model: one ``(feature, ids per sample or None, pooled)`` per lookup."""

    name: str
    param: str
    num_rows: int
    dim: int
    dtype: str
    lookups: List[Tuple[str, Optional[float], bool]] = field(default_factory=list)
    data_parallel_only: str = ""  # why sharded lookups cannot take it (see planner.specs.TableSpec)


def _hint(size) -> Optional[int]:
    """The example value of a (symbolic) size, or None when it is not known."""
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt):
        hint = getattr(size.node, "hint", None)
        return int(hint) if isinstance(hint, int) else None
    return None


def _shape(node) -> Optional[List[Optional[int]]]:
    val = node.meta.get("val") if node is not None and hasattr(node, "meta") else None
    if val is None or not hasattr(val, "shape"):
        return None
    return [_hint(s) for s in val.shape]


def _numel(shape) -> Optional[int]:
    if shape is None or any(s is None for s in shape):
        return None
    n = 1
    for s in shape:
        n *= s
    return n


def _ids_per_sample(rec) -> Tuple[Optional[float], Optional[int]]:
    """(ids per sample, samples) of one lookup on the example inputs (None where unknown)."""
    ids = _shape(rec.ids)
    if rec.form == "bag":
        n = _numel(ids)
        offs = _shape(rec.offsets) if rec.offsets is not None else None
        if offs is None or n is None or len(offs) != 1 or offs[0] is None:
            return None, None
        bags = offs[0] - (1 if rec.include_last_offset else 0)
        return (n / bags if bags > 0 else None), (bags if bags > 0 else None)
    if ids is None or not ids or ids[0] is None:
        return (1.0 if rec.form == "single" else None), None
    batch = ids[0]
    if rec.form == "single":
        return 1.0, batch
    n = _numel(ids)
    if n is None or batch == 0:
        return None, batch or None
    return n / batch, batch


def find_tables(model: torch.nn.Module, example_inputs, example_kwargs=None,
                logger: Optional[logging.Logger] = None,
                optimized: Callable[[str, str], bool] = lambda table, param: False,
                ) -> Tuple[List[FoundTable], List[str], Optional[int], Dict[str, str]]:
    """Capture ``model`` on its example inputs and return (tables, notes, batch size of the
    examples or None, the tables transform leaves as written -> why). The model is not modified. ``optimized``: whether a table is trained with
    an optimizer (transform then leaves its lookups that make no gradient as written:
    assign_optimizers.makes_no_gradient)."""
    from .. import meta
    from ..capture import capture
    from ..materialize import working_copy
    from ..pass_infra import Config, PassContext, PassManager
    from ..passes.annotate_lookups import annotate_lookups
    from ..passes.assign_optimizers import NO_GRADIENT, makes_no_gradient
    from ..passes.group_lookups import group_lookups
    from ..passes.merge_lookups import merge_lookups
    from ..report import Report

    if isinstance(example_inputs, tuple):
        args = example_inputs
    elif isinstance(example_inputs, list):
        args = tuple(example_inputs)
    else:
        args = (example_inputs,)
    kwargs: Dict[str, Any] = dict(example_kwargs or {})
    gm = capture(working_copy(model, args), args, kwargs)  # a meta model: no table allocated
    ctx = PassContext(config=Config(), report=Report(), example_args=args, example_kwargs=kwargs,
                      logger=logger or logging.getLogger("fxrec"))
    gm = PassManager([annotate_lookups, merge_lookups, group_lookups]).run(gm, ctx)
    records = [dataclasses.replace(r, reason=NO_GRADIENT) if optimized(r.table, r.param) and makes_no_gradient(r) else r
               for r in meta.all_records(gm)]
    grouped = {r.table for r in records if r.lowerable}
    tables: Dict[str, FoundTable] = {}
    skipped: Dict[str, str] = {}
    batch: Optional[int] = None
    for rec in records:
        if rec.table not in grouped:
            skipped.setdefault(rec.table, rec.reason)
            continue
        if not rec.lowerable:
            continue
        per_sample, samples = _ids_per_sample(rec)
        if batch is None and samples:
            batch = samples
        t = tables.get(rec.table)
        if t is None:
            t = tables[rec.table] = FoundTable(rec.table, rec.param, rec.num_rows, rec.dim, rec.dtype)
        t.lookups.append((rec.feature, per_sample, rec.pooling != "none"))
        if (rec.padding_idx is not None or rec.include_last_offset) and not t.data_parallel_only:
            t.data_parallel_only = (f"feature '{rec.feature}' uses "
                                    + ("padding_idx" if rec.padding_idx is not None else "include_last_offset")
                                    + ", which sharded lookups do not take yet")
        if rec.learned_weights and not t.data_parallel_only:
            t.data_parallel_only = (f"feature '{rec.feature}' has per-sample weights that need a gradient, which "
                                    "sharded lookups do not take yet (they take fixed weights)")
    for name, t in tables.items():  # the weight read by more than the lookups transform groups: every rank holds it
        mine = {r.node for r in records if r.table == name and r.lowerable}
        outside = [u for r in records if r.table == name and r.lowerable for u in r.weight.users if u not in mine]
        if outside and not t.data_parallel_only:
            alone = next((r for r in records if r.table == name and not r.lowerable), None)
            t.data_parallel_only = (f"feature '{alone.feature}' is a lookup fxrec leaves as written ({alone.reason})"
                                    if alone is not None else
                                    "its weight is also read outside its lookups (tied weights, or the model's own "
                                    "use of it)") + ", and sharded tables are only looked up"
    notes = [f"table {name!r} is not planned (fxrec leaves it as it is: {why})"
             for name, why in skipped.items()]
    return list(tables.values()), notes, batch, skipped
