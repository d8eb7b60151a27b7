"""The pass order, decided here and only here.

1. annotate_lookups  — find every lookup first: every later pass reads its LookupRecords.
2. merge_lookups     — reads those records and removes lookups (repeated ones, unused ones) before
                       anything counts, groups or assigns them: every later pass sees one lookup
                       per distinct (table, inputs), and no dead one holds a table in a group.
3. assign_optimizers — the table's optimizer is part of the group key, so it comes before grouping.
   assign_precisions — so is the precision weights_precision= stores it in (training only).
4. group_lookups     — needs all records at once (keys, shared tables, data dependences); it
                       reorders the graph so every group has a place to stand, so it comes before
                       every pass that places a group's call (lower_groups, shard_groups).
5. quantize_tables   — inference only: the dtype of each grouped table, before choose_kernels
                       (quantized groups are not timed) and lower_groups (which builds them).
6. choose_kernels    — each group's kernels by the rule table (or autotune=True's measurement),
                       before lowering: lower_groups builds each group with its kernels.
7. place_tables      — CUDA with hbm_budget= only: which tables leave GPU memory depends on the
                       kernels (only fbgemm's TBE holds unified memory), and lower_groups builds
                       each group with its tables' places.
8. lower_groups      — rewrites only what was grouped and chosen; after it those lookups are gone.
9. fold_concat       — needs the group's column split that lower_groups emitted.
10. measure_quantization — inference with quantize= only: runs the final graph, so it comes last.

With a sharding plan: annotate_lookups → merge_lookups → assign_optimizers → (assign_precisions,
which leaves data-parallel tables fp32) → group_lookups →
(quantize_tables) → shard_groups → (place_shards) → fold_concat. quantize_tables comes before shard_groups, which
builds each rank's quantized groups from its shards; measure_quantization does not run (the
quantized lookups of one rank are not a model the example inputs can run alone). shard_groups takes the place of choose_kernels and lower_groups: every
rank must run the same graph shape (its collectives pair up across ranks), so nothing is chosen
by timing. place_shards (hbm_budget= only) follows shard_groups: it places the pieces of tables
this rank's local groups hold, once they are built, and checks they are what the plan gives it.
With dense="fsdp", outline_dense_units runs after the pipeline, once the rank's tensors are
allocated and just before FSDP is applied (fxrec/ranks.py): it moves only dense operations into
calls of their submodules, and the units it makes are what FSDP is given.

fxrec.explain runs the passes that decide, and none that build: annotate_lookups →
merge_lookups → assign_optimizers → (assign_precisions) → group_lookups → (quantize_tables) → choose_kernels →
(place_tables), for the device asked (with a plan: up to quantize_tables; the plan decides the rest) (merge_lookups and group_lookups change only the captured copy's graph).
"""

from __future__ import annotations

from typing import List

from .pass_infra import CompilerPass, Config
from .passes.annotate_lookups import annotate_lookups
from .passes.assign_precisions import assign_precisions
from .passes.assign_optimizers import assign_optimizers
from .passes.choose_kernels import choose_kernels
from .passes.fold_concat import fold_concat
from .passes.group_lookups import group_lookups
from .passes.lower_groups import lower_groups
from .passes.measure_quantization import measure_quantization
from .passes.merge_lookups import merge_lookups
from .passes.place_shards import place_shards
from .passes.place_tables import place_tables
from .passes.quantize_tables import quantize_tables
from .passes.shard_groups import shard_groups


def _deciding(config: Config) -> List[CompilerPass]:
    """The passes every pipeline starts with, up to grouping."""
    precisions = [assign_precisions] if config.weights_precision is not None else []
    return [annotate_lookups, merge_lookups, assign_optimizers, *precisions, group_lookups]


def default_pipeline(config: Config) -> List[CompilerPass]:
    if config.plan is not None:
        # sharded: every rank runs the same graph shape, so nothing is chosen by timing here;
        # shard_groups replaces choose_kernels + lower_groups, fold_concat still applies
        quant = [quantize_tables] if config.quantize is not None else []
        placing = [place_shards] if config.hbm_budget is not None else []
        return [*_deciding(config), *quant, shard_groups, *placing, fold_concat]
    passes = _deciding(config)
    if config.quantize is not None:
        passes.append(quantize_tables)
    passes.append(choose_kernels)
    if config.hbm_budget is not None:
        passes.append(place_tables)
    passes += [lower_groups, fold_concat]
    if config.quantize is not None:
        passes.append(measure_quantization)
    return passes


def explain_pipeline(config: Config) -> List[CompilerPass]:
    """The deciding passes only (fxrec.explain): nothing is lowered, built or allocated."""
    passes = _deciding(config)
    if config.quantize is not None:
        passes.append(quantize_tables)
    if config.plan is not None:
        return passes  # the plan decides; fxrec.explain describes it
    return passes + [choose_kernels] + ([place_tables] if config.hbm_budget is not None else [])
