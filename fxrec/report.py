"""The transform report: what was found, grouped, lowered, left alone, and why."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional


@dataclass
class LookupEntry:
    table: str
    feature: str
    form: str
    pooling: str
    rows: int
    dim: int
    source: str
    group: Optional[str] = None
    reason: str = ""


@dataclass
class GroupEntry:
    name: str
    pooling: str
    tables: List[str]
    features: List[str]
    lowered: bool = True
    path_train: str = ""
    path_eval: str = ""
    why: str = ""
    timings_ms: Dict[str, float] = field(default_factory=dict)
    optimizer: str = ""  # the embedding optimizer and where it runs, if one was given


@dataclass
class QuantEntry:
    table: str
    dtype: str
    rows: int
    dim: int
    bytes_fp32: int
    bytes_stored: int
    max_abs_error: Optional[float] = None
    mean_abs_error: Optional[float] = None


@dataclass
class Report:
    """Attached to every transformed model as ``fast.report``; ``print`` it to read it."""

    lookups: List[LookupEntry] = field(default_factory=list)
    groups: List[GroupEntry] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    passes: List[str] = field(default_factory=list)
    quantization: List[QuantEntry] = field(default_factory=list)

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

    def __str__(self) -> str:
        lines = [
            f"fxrec report: {len(self.lookups)} embedding lookups found, "
            f"{len(self.lowered)} lowered into {sum(g.lowered for g in self.groups)} group(s), "
            f"{len(self.left_alone)} left as they were"
        ]
        if self.lookups:
            rows = [("table", "feature", "form", "pooling", "rows x dim", "status", "where")]
            for e in self.lookups:
                if e.group is None:
                    status = f"left alone: {e.reason}"
                elif not self.group(e.group).lowered:
                    status = f"{e.group}, kept plain (faster)"
                else:
                    status = e.group
                rows.append((e.table, e.feature, e.form, e.pooling, f"{e.rows} x {e.dim}", status, e.source))
            lines.append("")
            lines.append("Lookups")
            lines.extend(_table(rows))
        if self.groups:
            rows = [("group", "pooling", "tables", "features", "train path", "inference path", "why")]
            for g in self.groups:
                rows.append(
                    (g.name, g.pooling, str(len(g.tables)), str(len(g.features)), g.path_train, g.path_eval, g.why)
                )
            lines.append("")
            lines.append("Groups (paths: 'fbgemm' = one fbgemm TBE; 'direct' = PyTorch's per-table kernels writing into "
                         "one output; 'plain' = the original lookups, kept because they were faster)")
            lines.extend(_table(rows))
            for g in self.groups:
                lines.append(f"  {g.name}: {', '.join(g.tables)}")
                if g.optimizer:
                    lines.append(f"    optimizer {g.optimizer}")
        if self.quantization:
            rows = [("table", "dtype", "rows x dim", "bytes fp32", "bytes stored", "of fp32", "max abs err", "mean abs err")]
            for q in self.quantization:
                err = lambda x: "-" if x is None else f"{x:.3g}"  # noqa: E731
                rows.append((q.table, q.dtype, f"{q.rows} x {q.dim}", str(q.bytes_fp32), str(q.bytes_stored),
                             f"{q.bytes_stored / q.bytes_fp32:.0%}", err(q.max_abs_error), err(q.mean_abs_error)))
            lines.append("")
            lines.append("Quantization (errors: quantized vs fp32 lookups on the example inputs)")
            lines.extend(_table(rows))
        if self.notes:
            lines.append("")
            lines.append("Notes")
            lines.extend(f"  - {n}" for n in self.notes)
        if self.passes:
            lines.append("")
            lines.append("Passes: " + "; ".join(self.passes))
        return "\n".join(lines)


def _table(rows) -> List[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    out = []
    for k, r in enumerate(rows):
        out.append("  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
        if k == 0:
            out.append("  " + "  ".join("-" * w for w in widths))
    return out
