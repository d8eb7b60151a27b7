"""gloo's reduce-scatter against fxrec's (an all-to-all of the chunks and a local sum, as
``fxrec.runtime.sharded.PooledOutputDist`` adds a row-wise table's partial sums), at world size 2
on CPU, one thread per rank. Sizes are a row-wise output dist's partial sums (``[world * B, 64]`` fp32 rows, B the
local batch). Alternating calls in the same processes, a barrier before each, medians. JSON.

    .venv/bin/python benchmarks/bench_collectives.py [--out FILE] [--calls 100]
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

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from fxrec.runtime.collectives import all_to_all  # noqa: E402

# torch 2.13 renamed it (the old name warns); torch 2.11 has only the old one
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

ROWS = (64, 1024, 4096)  # world * B rows of 64 fp32 values: 16 KB, 256 KB, 1 MB
DIM = 64


def worker(rank, world, init_file, calls, out_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = []
    for rows in ROWS:
        x = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(rank))

        def gloo_own():
            out = x.new_empty(rows // world, DIM)
            _reduce_scatter_single(out, x)
            return out

        def fxrec_rs():
            n = rows // world
            return all_to_all(x, [n] * world, [n] * world, "bench").view(world, n, DIM).sum(0)

        # the same sums (world size 2: a + b either way)
        assert torch.equal(gloo_own(), fxrec_rs()), rows
        times = {"gloo_reduce_scatter": [], "fxrec_reduce_scatter": []}
        for _ in range(calls):
            for name, fn in (("gloo_reduce_scatter", gloo_own), ("fxrec_reduce_scatter", fxrec_rs)):
                dist.barrier()
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        results.append({"rows": rows, "bytes": rows * DIM * 4, "median_ms": med,
                        "speedup": med["gloo_reduce_scatter"] / med["fxrec_reduce_scatter"]})
    if rank == 0:
        with open(out_file, "w") as fh:
            json.dump(results, fh)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cpu_collectives.json"))
    ap.add_argument("--calls", type=int, default=100)
    a = ap.parse_args()
    fd, init_file = tempfile.mkstemp(prefix="fxrec_bench_")
    os.close(fd)
    os.remove(init_file)
    tmp = a.out + ".tmp"
    mp.spawn(worker, args=(2, init_file, a.calls, tmp), nprocs=2, join=True)
    with open(tmp) as fh:
        results = json.load(fh)
    os.remove(tmp)
    out = {"what": "reduce-scatter of [rows, 64] fp32 at world size 2, gloo on CPU, one thread per rank: gloo's own "
                   "vs fxrec's (all-to-all of the chunks and a local sum); median ms of alternating calls",
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
           "versions": {"torch": torch.__version__}, "calls": a.calls, "results": results}
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=2)
    for r in results:
        print(f"{r['bytes'] / 1024:.0f} KB: gloo {r['median_ms']['gloo_reduce_scatter']:.3f} ms, "
              f"fxrec {r['median_ms']['fxrec_reduce_scatter']:.3f} ms ({r['speedup']:.2f}x)")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
