"""Per-step time of the demo DLRM at world size 2 on CPU (gloo): a mixed sharding plan (SGD on
the local shards' dense gradients, and row-wise Adagrad fused into backward) vs the same model
with every table data-parallel. All run in the same processes, alternating. JSON.

    .venv/bin/python benchmarks/bench_sharded.py [--out FILE] [--steps 15]

A step is forward, backward (collectives included) and SGD on the local parameters, each rank on
its own local batch. Data-parallel keeps every table whole on every rank and all-reduces its full
gradient in backward; the mixed plan moves ids and pooled rows instead.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import fxrec  # noqa: E402
from examples.dlrm import DLRM, make_batch, table_rows  # noqa: E402
from examples.train_dist import local_slice, mixed_pins  # noqa: E402


def worker(rank, world, init_file, args, out_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    rows = table_rows(args["cap"])
    torch.manual_seed(0)
    model = DLRM(rows, dim=args["dim"])
    local_b = args["local_batch"]
    example = local_slice(make_batch(rows, batch=local_b * world, seed=0), rank, local_b)
    plans = {
        "sharded_mixed": fxrec.plan(model, example, world_size=world, memory_per_rank="4GB", pins=mixed_pins(rows, world)),
        "data_parallel": fxrec.plan(model, example, world_size=world, memory_per_rank="4GB",
                                    pins={f"emb.{i}": "data_parallel" for i in range(len(rows))}),
    }
    models = {k: fxrec.transform(model, example, plan=p) for k, p in plans.items()}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in models.items()}
    fused = "sharded_mixed_fused_rowwise_adagrad"
    models[fused] = fxrec.transform(model, example, plan=plans["sharded_mixed"],
                                    optimizer=fxrec.optim.RowWiseAdagrad(lr=0.1))
    opts[fused] = models[fused].make_optimizer(torch.optim.SGD, lr=0.1)
    batch = local_slice(make_batch(rows, batch=local_b * world, seed=1), rank, local_b)

    def step(k):
        opts[k].zero_grad()
        models[k](*batch).sum().backward()
        opts[k].step()

    times = {k: [] for k in models}
    for k in models:
        step(k)
    for _ in range(args["steps"]):
        for k in models:
            dist.barrier()
            t = time.perf_counter()
            step(k)
            dist.barrier()
            times[k].append(time.perf_counter() - t)
    if rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        with open(out_file, "w") as fh:
            json.dump({"step_ms": med, "speedup_sharded_vs_data_parallel": med["data_parallel"] / med["sharded_mixed"],
                       "speedup_fused_rowwise_vs_data_parallel": med["data_parallel"] / med[fused],
                       "all_step_ms": {k: [x * 1e3 for x in v] for k, v in times.items()}}, fh)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cpu_sharded.json"))
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--local-batch", type=int, default=512)
    ap.add_argument("--cap", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=64)
    a = ap.parse_args()
    args = {"steps": a.steps, "local_batch": a.local_batch, "cap": a.cap, "dim": a.dim}
    fd, init_file = tempfile.mkstemp(prefix="fxrec_bench_")
    os.close(fd)
    os.remove(init_file)
    tmp_out = a.out + ".tmp"
    mp.spawn(worker, args=(2, init_file, args, tmp_out), nprocs=2, join=True)
    with open(tmp_out) as fh:
        res = json.load(fh)
    os.remove(tmp_out)
    result = {
        "what": "demo DLRM, world size 2, gloo on CPU, one thread per rank: mixed sharding plan vs all tables data-parallel; "
                "median ms of alternating steps (forward, backward, SGD)",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "versions": {"torch": torch.__version__, "fxrec": fxrec.__version__},
        "config": args, **res,
    }
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(f"step ms: {res['step_ms']} | sharded vs data-parallel: {res['speedup_sharded_vs_data_parallel']:.2f}x")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
