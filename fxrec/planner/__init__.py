"""Sharding planner: which rank holds which piece of every embedding table.

    plan = fxrec.plan(model, example_inputs, world_size=4, memory_per_rank="16GB")
    plan = fxrec.plan(tables=[fxrec.TableSpec("t0", 10**6, 128, pooling_factor=20)], world_size=64,
                      memory_per_rank="80GB", device="cuda")
    print(plan); plan.save("plan.json"); plan = fxrec.ShardingPlan.load("plan.json")
    plan.shards_on(rank)   # what one rank holds

Modules: ``specs`` (the data: TableSpec, Topology, Shard, TablePlan, ShardingPlan, PlanError,
byte sizes), ``layout`` (the exact shard layout of each sharding type), ``cost`` (memory and
estimated cost of a shard, with the formulas), ``search`` (choice of sharding type and
placement), ``detect`` (tables of a model via fxrec's capture and annotate_lookups), ``api``
(:func:`plan`). Pure Python; nothing here imports fbgemm or touches a graph it is given.
"""

from .api import plan
from .cost import OPTIMIZER_STATE, CostModel
from .layout import column_splits, row_blocks
from .search import Pin
from .specs import (
    SHARDING_TYPES, PlanError, Shard, ShardingPlan, TablePlan, TableSpec, Topology, format_bytes, parse_bytes,
)

__all__ = [
    "plan", "ShardingPlan", "TablePlan", "TableSpec", "Topology", "Shard", "Pin", "PlanError", "SHARDING_TYPES",
    "OPTIMIZER_STATE", "CostModel", "row_blocks", "column_splits", "parse_bytes", "format_bytes",
]
