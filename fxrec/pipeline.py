"""The pass order, decided here and only here.

1. annotate_lookups  — find every lookup first: every later pass reads its LookupRecords.
2. assign_optimizers — the table's optimizer is part of the group key, so it comes before grouping.
3. group_lookups     — needs all records at once (keys, shared tables, data dependences).
4. choose_kernels    — times fbgemm against the plain lookups per group on the example inputs,
                       before lowering, so that a group where plain wins both ways is never
                       lowered (it costs nothing) and lower_groups knows each group's paths.
5. lower_groups      — rewrites only what was grouped and chosen; after it those lookups are gone.
6. fold_concat       — needs the group's slice nodes that lower_groups emitted.
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


def default_pipeline(config: Config) -> List[CompilerPass]:
    return [annotate_lookups, assign_optimizers, group_lookups, choose_kernels, lower_groups, fold_concat]
