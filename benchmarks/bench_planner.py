"""Planner time and balance on synthetic skewed tables. Writes JSON.

    .venv/bin/python benchmarks/bench_planner.py [--out benchmarks/results/planner.json]

Tables (fixed seed): rows log-uniform in 10^2..10^7, dims 16/32/64/128, ids per sample
Pareto(1.2) capped at 200 (a few very hot features, as in real CTR data), one or two features,
row-wise Adagrad state. For 100, 1,000 and 10,000 tables on 8, 32, 64 and 128 ranks, one host
and hosts of 8 ranks, with memory per rank set to twice the tables' bytes divided by the ranks
(the largest tables still fill a rank: memory binds there). Recorded per case: planner seconds (median of
``--repeats`` calls of fxrec.plan(tables=...), spec validation included; all are kept), balance (max / mean
of the per-rank estimated cost, summed here from the plan's shards), the estimated busiest-rank
cost, the largest memory use as a fraction of the limit, and how many tables got each sharding.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fxrec  # noqa: E402
from fxrec.planner import TableSpec  # noqa: E402

TABLES = (100, 1_000, 10_000)
RANKS = (8, 32, 64, 128)
RANKS_PER_HOST = (None, 8)
OPTIMIZER = "rowwise_adagrad"


def synthetic_tables(n: int, seed: int = 0):
    rng = random.Random(seed)
    return [
        TableSpec(f"t{i}", int(10 ** rng.uniform(2, 7)), rng.choice([16, 32, 64, 128]),
                  pooling_factor=min(rng.paretovariate(1.2), 200.0), num_features=rng.choice([1, 1, 2]))
        for i in range(n)
    ]


def run_case(tables, world: int, ranks_per_host, repeats: int) -> dict:
    need = sum(t.num_rows * t.dim * 4 + t.num_rows * 4 for t in tables)  # weights + row-wise Adagrad
    memory = int(2 * need / world)
    times = []
    plan = None
    for _ in range(repeats):
        gc.collect()  # start each call without the previous calls' garbage
        start = time.perf_counter()
        plan = fxrec.plan(tables=tables, world_size=world, ranks_per_host=ranks_per_host, memory_per_rank=memory,
                          optimizer=OPTIMIZER)
        times.append(time.perf_counter() - start)
    cost = [0.0] * world
    used = [0] * world
    for tp in plan.tables.values():
        for s in tp.shards:
            cost[s.rank] += s.cost_ms
            used[s.rank] += s.bytes
    mean = sum(cost) / world
    return {
        "tables": len(tables), "ranks": world, "ranks_per_host": ranks_per_host or world,
        "memory_per_rank_bytes": memory,
        "seconds_median": statistics.median(times), "seconds_all": times,
        "balance_max_over_mean": max(cost) / mean, "max_rank_cost_ms": max(cost), "mean_rank_cost_ms": mean,
        "max_memory_fraction": max(used) / memory,
        "shardings": dict(Counter(tp.sharding for tp in plan.tables.values())),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "planner.json"))
    ap.add_argument("--repeats", type=int, default=5, help="planner calls per case (10,000 tables: 1)")
    args = ap.parse_args()
    cases = []
    for n in TABLES:
        tables = synthetic_tables(n)
        for world in RANKS:
            for rph in RANKS_PER_HOST:
                if rph == world:
                    continue  # the same as one host
                r = run_case(tables, world, rph, args.repeats if n < 10_000 else 1)
                cases.append(r)
                print(f"{n:>6} tables {world:>4} ranks {r['ranks_per_host']:>4}/host: {r['seconds_median']:.3f} s, "
                      f"balance {r['balance_max_over_mean']:.3f}, {r['shardings']}", flush=True)
    out = {
        "benchmark": "fxrec.plan on synthetic skewed tables",
        "what": __doc__.split("\n\n")[2].replace("\n", " "),
        "machine": {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()},
        "optimizer": OPTIMIZER,
        "cases": cases,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
