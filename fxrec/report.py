"""The transform report: what was found, grouped, lowered, left alone, and why."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple


@dataclass(frozen=True)
class LookupEntry:
    """One lookup as the report shows it (plain data: it outlives the graph nodes it describes)."""

    table: str
    feature: str
    form: str
    pooling: str
    rows: int
    dim: int
    source: str
    group: Optional[str] = None
    reason: str = ""
    dtype: str = ""  # of the table's weight as written ("float32")

    @classmethod
    def of(cls, r, group: Optional[str]) -> "LookupEntry":
        """From a :class:`fxrec.meta.LookupRecord` (or a LookupEntry: the same, in ``group``)."""
        if isinstance(r, LookupEntry):
            return dataclasses.replace(r, group=group)
        return cls(r.table, r.feature, r.form, r.pooling, r.num_rows, r.dim, r.source, group, r.reason, r.dtype)


@dataclass
class PassRun:
    """One pass as the PassManager ran it: wall time in seconds, whether it changed the graph,
    and the stats it returned."""

    name: str
    seconds: float
    modified: bool = False
    stats: Dict[str, Any] = field(default_factory=dict)


@dataclass
class GroupEntry:
    """One group as decided (see :class:`fxrec.meta.GroupDecision`): its kernels for training and
    for inference ("plain": lookups left as written), what decided them and why."""

    name: str
    pooling: str
    tables: List[str]
    features: List[str]
    lowered: bool = True
    kernel_train: str = ""
    kernel_eval: str = ""
    why: str = ""
    timings_ms: Dict[str, float] = field(default_factory=dict)
    optimizer: str = ""  # the embedding optimizer and where it runs, if one was given
    decided_by: str = ""  # rule | backend='...' | autotune (measured) | autotune (cached) | sharding plan
    device: str = ""
    fused: str = ""  # the optimizer applied inside backward, if any
    dtypes: List[str] = field(default_factory=list)
    placement: str = ""
    quantized: bool = False  # an inference group of quantize='s tables (its dtypes are quantize='s names)
    # tables stored wider than their dim (a kernel's alignment): [table, dim, stored width, extra bytes]
    padding: List[Tuple[str, int, int, int]] = field(default_factory=list)


@dataclass
class QuantEntry:
    table: str
    dtype: str
    rows: int
    dim: int
    bytes_fp32: int  # the table's bytes as the model holds it (fp32; 2 bytes a value for its fp16 tables)
    bytes_stored: int  # its packed rows
    max_abs_error: Optional[float] = None
    mean_abs_error: Optional[float] = None
    fp32_kept: bool = False  # the model's rows kept too: the model reads the table outside its lookups


@dataclass
class Report:
    """Attached to every transformed model as ``fast.report``; ``print`` it to read it."""

    lookups: List[LookupEntry] = field(default_factory=list)
    groups: List[GroupEntry] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    passes: List[str] = field(default_factory=list)
    quantization: List[QuantEntry] = field(default_factory=list)
    pass_runs: List[PassRun] = field(default_factory=list)  # per pass: wall time and stats
    # When sharded: one entry per rank (its tables and memory); empty until fxrec shards.
    plan_per_rank: List[Dict[str, Any]] = field(default_factory=list)
    # Lookups merge_lookups took out (fxrec.meta.RemovedLookup: table, feature, source, what).
    removed: List[Any] = field(default_factory=list)
    # The groups made against the fewest possible, and why each extra one is apart
    # (fxrec.meta.Fragmentation: groups, fewest, kinds, splits); None when not grouped.
    fragmentation: Any = None

    @property
    def lowered(self) -> List[LookupEntry]:
        """Lookups that now run through a group module."""
        return [e for e in self.lookups if e.group is not None and self.group(e.group).lowered]

    @property
    def left_alone(self) -> List[LookupEntry]:
        """Lookups that stay in the graph as the user wrote them (see ``reason``)."""
        return [e for e in self.lookups if e.group is None or not self.group(e.group).lowered]

    def group(self, name: str) -> GroupEntry:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)

    @property
    def tables(self) -> List[Dict[str, Any]]:
        """One dict per embedding table, in the order first looked up: ``name``, ``rows``,
        ``dim``, ``pooling`` (of its lookups; comma-separated when they differ), ``dtype`` and
        ``bytes`` as stored in the transformed model (the quantized dtype and size when
        quantized), ``lookups`` (how many), ``features``, ``groups``."""
        quant = {q.table: q for q in self.quantization}
        # a lookup's table as weights_precision= stores it (the group's dtypes: one a lookup, by feature)
        stored = {f: _STORED[dt] for g in self.groups for f, dt in zip(g.features, g.dtypes) if dt in _STORED}
        # quantized tables the quantization pass has not measured (fxrec.explain): their dtype as
        # quantize= names it, and fbgemm's packed rows (the dim padded as the group stores it, a scale
        # and bias for integers, rounded to the row alignment: 16 bytes on CUDA)
        packed = {f: (dt, g) for g in self.groups if g.quantized for f, dt in zip(g.features, g.dtypes)}
        # a table stored wider than its dim (fbgemm's TBE pads it to a multiple of 4 columns)
        widths = {(g.name, name): w for g in self.groups for name, _, w, _ in g.padding}
        out: Dict[str, Dict[str, Any]] = {}
        for e in self.lookups:
            dtype = stored.get(e.feature) or e.dtype or "float32"
            t = out.setdefault(e.table, {
                "name": e.table, "rows": e.rows, "dim": e.dim, "pooling": [], "dtype": dtype,
                "bytes": e.rows * widths.get((e.group, e.table), e.dim) * _ITEMSIZE.get(dtype, 4), "lookups": 0,
                "features": [], "groups": [],
            })
            t["lookups"] += 1
            t["features"].append(e.feature)
            if e.pooling not in t["pooling"]:
                t["pooling"].append(e.pooling)
            if e.group is not None and e.group not in t["groups"]:
                t["groups"].append(e.group)
            if e.feature in packed and e.table not in quant:
                dt, g = packed[e.feature]
                width = next((w for name, _, w, _ in g.padding if name == e.table), e.dim)
                t["dtype"], t["bytes"] = dt, _packed_bytes(e.rows, width, dt, g.device)
        for name, t in out.items():
            t["pooling"] = ",".join(t["pooling"])
            if name in quant:
                t["dtype"], t["bytes"] = quant[name].dtype, quant[name].bytes_stored
        return list(out.values())

    def to_dict(self) -> Dict[str, Any]:
        """The report as plain data (what :meth:`to_json` writes); see :meth:`to_json`."""
        not_lowered = [
            {"table": e.table, "feature": e.feature, "source": e.source,
             "reason": e.reason if e.group is None else f"{e.group} kept plain: {self.group(e.group).why}"}
            for e in self.left_alone
        ]
        return {
            "summary": {
                "lookups": len(self.lookups), "lowered": len(self.lowered), "left_alone": len(self.left_alone),
                "groups_lowered": sum(g.lowered for g in self.groups),
            },
            "tables": self.tables,
            "lookups": [asdict(e) for e in self.lookups],
            "groups": [
                {**asdict(g), "became": _became(g, self.quantization)} for g in self.groups
            ],
            "not_lowered": not_lowered,
            "removed": [asdict(r) for r in self.removed],
            "fragmentation": asdict(self.fragmentation) if self.fragmentation is not None else None,
            "plan_per_rank": list(self.plan_per_rank),
            "quantization": [asdict(q) for q in self.quantization],
            "passes": [asdict(p) for p in self.pass_runs],
            "total_pass_seconds": sum(p.seconds for p in self.pass_runs),
            "notes": list(self.notes),
        }

    def to_json(self, indent: Optional[int] = 2) -> str:
        """The report as JSON text.

        Keys: ``summary`` (counts), ``tables`` (see :attr:`tables`), ``lookups`` (one per lookup:
        table, feature, form, pooling, rows, dim, dtype, source line, group or null, reason),
        ``groups`` (tables, features, train/inference paths, why, timings, optimizer, and
        ``became``: what the group is in the transformed model), ``not_lowered`` (table, feature
        and why, for every lookup left as written), ``removed`` (table, feature, source and what
        happened, for every lookup merged into an equal one or removed as unused),
        ``fragmentation`` (``groups`` made, the ``fewest`` possible, their ``kinds``, and
        ``splits``: why each extra group is apart; null when nothing was grouped),
        ``plan_per_rank`` (empty unless sharded),
        ``quantization`` (per table: dtype, bytes, max/mean abs error), ``passes`` (name, wall
        seconds, modified, stats, in run order), ``total_pass_seconds``, ``notes``.
        """
        return json.dumps(self.to_dict(), indent=indent, default=str)

    def __str__(self) -> str:
        lines = [
            f"fxrec report: {len(self.lookups)} embedding lookups found, "
            f"{len(self.lowered)} lowered into {sum(g.lowered for g in self.groups)} group(s), "
            f"{len(self.left_alone)} left as they were"
            + (f", {len(self.removed)} merged or removed (unused)" if self.removed else "")
        ]
        if self.lookups:
            rows = [("table", "feature", "form", "pooling", "rows x dim", "status", "where")]
            for e in self.lookups:
                if e.group is None:
                    status = f"left alone: {e.reason}"
                elif not self.group(e.group).lowered:
                    status = f"{e.group}, kept plain"
                else:
                    status = e.group
                rows.append((e.table, e.feature, e.form, e.pooling, f"{e.rows} x {e.dim}", status, e.source))
            lines.append("")
            lines.append("Lookups")
            lines.extend(_table(rows))
        if self.groups:
            rows = [("group", "device", "pooling", "tables", "features", "train kernel", "inference kernel",
                     "decided by")]
            for g in self.groups:
                rows.append((g.name, g.device, g.pooling, str(len(g.tables)), str(len(g.features)), g.kernel_train,
                             g.kernel_eval, g.decided_by))
            lines.append("")
            lines.append("Groups (kernels: " + "; ".join(f"'{k}' = {v}" for k, v in KERNEL_MEANINGS.items()) + ")")
            lines.extend(_table(rows))
            for g in self.groups:
                lines.append(f"  {g.name}: {', '.join(g.tables)}")
                lines.append(f"    why: {g.why}")
                if g.optimizer:
                    lines.append(f"    optimizer {g.optimizer}")
                stored = sorted({d for d in g.dtypes if d in ("fp16", "bf16")})
                if stored and g.fused:  # weights_precision= (trained; quantized tables have their own section)
                    lines.append(f"    weights stored in {', '.join(stored)} in fbgemm's TBE (weights_precision=)")
                if g.placement not in ("", "host", "device"):
                    lines.append(f"    placement: {g.placement}")
                if g.padding:
                    lines.append("    padded: " + ", ".join(f"{t} dim {d} stored as {w} (+{_bytes(b)})"
                                                       for t, d, w, b in g.padding))
        f = self.fragmentation
        if f is not None and f.groups:
            lines.append("")
            lines.append(f"Fragmentation: {f.groups} group(s) made, {f.fewest} the fewest possible "
                         f"(one per kind: {', '.join(f.kinds)})")
            lines.extend(f"  - {s}" for s in f.splits)
        if self.removed:
            rows = [("table", "feature", "what", "where")]
            rows.extend((r.table, r.feature, r.what, r.source) for r in self.removed)
            lines.append("")
            lines.append("Removed lookups (the model computes the same without them)")
            lines.extend(_table(rows))
        if self.quantization:
            rows = [("table", "dtype", "rows x dim", "bytes in model", "bytes stored", "of model", "max abs err",
                     "mean abs err")]
            for q in self.quantization:
                err = lambda x: "-" if x is None else f"{x:.3g}"  # noqa: E731
                stored = q.bytes_stored + (q.bytes_fp32 if q.fp32_kept else 0)
                rows.append((q.table, q.dtype, f"{q.rows} x {q.dim}", str(q.bytes_fp32),
                             f"{stored}{' *' if q.fp32_kept else ''}", f"{stored / q.bytes_fp32:.0%}",
                             err(q.max_abs_error), err(q.mean_abs_error)))
            lines.append("")
            lines.append("Quantization (errors: quantized vs the model's lookups on the example inputs)")
            lines.extend(_table(rows))
            if any(q.fp32_kept for q in self.quantization):
                lines.append("  * its packed rows and the model's rows too: the model reads the table outside its "
                             "lookups (tied weights, a slice of it), which read the model's rows")
        if self.notes:
            lines.append("")
            lines.append("Notes")
            lines.extend(f"  - {n}" for n in self.notes)
        if self.passes:
            lines.append("")
            lines.append("Passes: " + "; ".join(self.passes))
        if self.pass_runs:
            total = sum(p.seconds for p in self.pass_runs)
            lines.append(f"Pass wall time ({_seconds(total)} in all): "
                         + ", ".join(f"{p.name} {_seconds(p.seconds)}" for p in self.pass_runs))
        return "\n".join(lines)


#: What each kernel name in the report means (the names are fxrec.runtime.kernels.KERNEL_NAMES).
KERNEL_MEANINGS = {
    "native": "fxrec's C++ CPU kernel, every feature written straight into the group's output",
    "fbgemm": "one fbgemm table-batched embedding (TBE) call",
    "reference": "PyTorch's own lookups in the group module",
    "plain": "the original lookups left in the graph",
}


def build_report(gm, passes=(), pass_runs=(), notes=(), plan_per_rank=()) -> Report:
    """The report of a transformed (or explained) graph, from its meta alone: each group's
    :class:`fxrec.meta.GroupDecision` (on its call, its sharded modules, or its lookups when not
    lowered), the lookups left alone (their :class:`fxrec.meta.LookupRecord`), the quantized
    groups' measurements, and from ``gm.meta`` the lookups merge_lookups removed
    (:class:`fxrec.meta.RemovedLookup`) and the groups against the fewest possible
    (:class:`fxrec.meta.Fragmentation`). Every pipeline reports the same way."""
    from . import meta

    report = Report(notes=list(notes), passes=list(passes), pass_runs=list(pass_runs),
                    plan_per_rank=list(plan_per_rank), removed=list(getattr(gm, "meta", {}).get(meta.REMOVED, ())),
                    fragmentation=getattr(gm, "meta", {}).get(meta.FRAGMENTATION))
    seen = set()
    for n in gm.graph.nodes:
        d = n.meta.get(meta.DECISION)
        if d is not None:
            if d.group in seen:
                continue
            seen.add(d.group)
            report.lookups.extend(d.lookups)
            report.groups.append(GroupEntry(
                name=d.group, pooling=d.pooling, tables=list(dict.fromkeys(d.tables)), features=list(d.features),
                lowered=d.lowered, kernel_train=d.kernel_train, kernel_eval=d.kernel_eval, why=d.why,
                timings_ms=dict(d.timings_ms), optimizer=d.optimizer, decided_by=d.decided_by, device=d.device,
                fused=d.fused, dtypes=list(d.dtypes), placement=d.placement,
                quantized=getattr(d, "quantized", False),  # (older pickles have none)
                padding=[tuple(x) for x in getattr(d, "padding", ())],  # older pickles have none
            ))
        elif meta.LOOKUP in n.meta:
            # a LookupRecord, or its LookupEntry in a pickled model
            report.lookups.append(LookupEntry.of(n.meta[meta.LOOKUP], None))
        report.quantization.extend(n.meta.get(meta.QUANT, ()))
    report.lookups.extend(LookupEntry.of(r, None) for r in meta.hidden_records(gm))
    return report


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1}
#: weights_precision= names, as the dtype a table is stored in
_STORED = {"fp16": "float16", "bf16": "bfloat16"}


def _packed_bytes(rows: int, width: int, dtype: str, device: str) -> int:
    """A quantized table's bytes in fbgemm's inference TBE on ``device``."""
    import torch

    from .runtime.kernels.fbgemm_nbit import packed_bytes, row_alignment

    return packed_bytes([(rows, width, dtype)], row_alignment(torch.device(device or "cpu")))[0]


def _became(g: GroupEntry, quantization: List[QuantEntry]) -> str:
    if not g.lowered:
        return "plain lookups (left as written)"
    # (explain measures nothing: the group's own dtypes then)
    dtypes = sorted({q.dtype for q in quantization if q.table in g.tables} or (set(g.dtypes) if g.quantized else set()))
    if dtypes:
        return f"one quantized group module ({', '.join(dtypes)} tables)"
    if g.kernel_train.startswith("sharded"):
        return f"input-dist, lookup, output-dist modules ({g.kernel_train})"
    if g.kernel_train == g.kernel_eval:
        return f"one group module, kernel {g.kernel_train}"
    return f"one group module, kernel {g.kernel_train} in training, {g.kernel_eval} in inference"


def _seconds(s: float) -> str:
    if s < 0.01:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.2f} s"


def _table(rows) -> List[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    out = []
    for k, r in enumerate(rows):
        out.append("  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
        if k == 0:
            out.append("  " + "  ".join("-" * w for w in widths))
    return out
