"""The pass order, decided here and only here.

1. annotate_lookups  — find every lookup first: every later pass reads its LookupRecords.
2. assign_optimizers — the table's optimizer is part of the group key, so it comes before grouping.
3. group_lookups     — needs all records at once (keys, shared tables, data dependences).
4. quantize_tables   — inference only: the dtype of each grouped table, before choose_kernels
                       (quantized groups are not timed) and lower_groups (which builds them).
5. choose_kernels    — times fbgemm against the plain lookups per group on the example inputs,
                       before lowering, so that a group where plain wins both ways is never
                       lowered (it costs nothing) and lower_groups knows each group's paths.
6. lower_groups      — rewrites only what was grouped and chosen; after it those lookups are gone.
7. fold_concat       — needs the group's slice nodes that lower_groups emitted.
8. measure_quantization — inference with quantize= only: runs the final graph, so it comes last.
"""

from __future__ import annotations

from typing import List

from .pass_infra import CompilerPass, Config
from .passes.annotate_lookups import annotate_lookups
from .passes.assign_optimizers import assign_optimizers
from .passes.choose_kernels import choose_kernels
from .passes.fold_concat import fold_concat
from .passes.group_lookups import group_lookups
from .passes.lower_groups import lower_groups
from .passes.measure_quantization import measure_quantization
from .passes.quantize_tables import quantize_tables


def default_pipeline(config: Config) -> List[CompilerPass]:
    passes = [annotate_lookups, assign_optimizers, group_lookups]
    if config.quantize is not None:
        passes.append(quantize_tables)
    passes += [choose_kernels, lower_groups, fold_concat]
    if config.quantize is not None:
        passes.append(measure_quantization)
    return passes
