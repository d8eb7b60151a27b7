"""What ``transform(plan=..., dense="fsdp")`` saves and costs against the default ``"ddp"``, at world
size 2 on CPU (gloo): a DLRM-like model with wide dense layers, its tables sharded by one plan,
trained with ``torch.optim.Adam`` over all its parameters. Both variants are built in the same two processes
and run alternating, ``--steps`` timed steps each after a warm-up. JSON.

    .venv/bin/python benchmarks/bench_fsdp.py [--out FILE] [--steps 10] [--hidden 2048] [--layers 1]

Per rank it reports the bytes held between steps (after ``opt.step()`` and ``zero_grad()``): the
dense parameters (this rank's FSDP chunks, or whole) and their Adam states, counted from the
tensors themselves; the table shards are the same in both. The peak of a step above what was
held at its start: every allocation and free of the step in order, as torch's profiler records
them (``profile_memory=True``), summed, the median of three steps; frees of memory allocated
before the step are not recorded, so it is an upper bound. With units FSDP gathers one layer at a time (each of the
MLP's linear layers can be a unit of its own). Two more variants show what fxrec's rule for
units decides between: ``fsdp_one_unit`` (``fsdp_units="one"``, the whole model one unit) and
``fsdp_every_unit`` (``fsdp_units="every"``, every submodule that can be a unit, whether or not
they halve the bytes gathered at once). And
the median step time (forward, backward with its collectives, Adam's step) of each, with the
ratios to DDP's.
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
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import fxrec  # noqa: E402

TABLES = (20_000, 20_000, 5_000, 5_000, 1_000, 1_000, 500, 500)
DIM = 32


class WideDLRM(nn.Module):
    """Eight tables of dim 32 and a top MLP over their pooled rows: a layer to ``hidden`` wide,
    ``layers`` layers ``hidden`` x ``hidden``, and one to 1."""

    def __init__(self, hidden: int, layers: int = 1):
        super().__init__()
        self.emb = nn.ModuleList(nn.EmbeddingBag(r, DIM, mode="sum") for r in TABLES)
        mid = [m for _ in range(layers) for m in (nn.Linear(hidden, hidden), nn.ReLU())]
        self.top = nn.Sequential(nn.Linear(len(TABLES) * DIM, hidden), nn.ReLU(), *mid, nn.Linear(hidden, 1))

    def forward(self, ids):
        return self.top(torch.cat([e(i) for e, i in zip(self.emb, ids)], 1)).squeeze(1)


def batch(b: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, r, (b, 4), generator=g) for r in TABLES]


def held_bytes(model: nn.Module, opt: torch.optim.Optimizer, names) -> dict:
    """Bytes this rank holds of the parameters ``names`` and of their optimizer states."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    params = dict(model.named_parameters())
    mine = {id(params[n]) for n in names}
    p_bytes = sum(local(params[n]).nbytes for n in names)
    s_bytes = 0
    for p, state in opt.state.items():
        if id(p) in mine:
            s_bytes += sum(local(v).nbytes for v in state.values() if isinstance(v, torch.Tensor) and v.dim())
    return {"params": p_bytes, "optimizer_states": s_bytes, "total": p_bytes + s_bytes}


def step_peak(run) -> int:
    """The most bytes allocated at once during ``run()`` above what was allocated when it began:
    the profiler's memory events (every allocation and free on the CPU) summed in their order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    now = top = 0
    for _, nbytes in events:  # (frees are negative)
        now += nbytes
        top = max(top, now)
    return top


def _worker(rank: int, world: int, init_file: str, a, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                           timeout=timedelta(seconds=300))
    local_b = a.local_batch
    torch.manual_seed(0)
    model = WideDLRM(a.hidden, a.layers)
    example = ([i[rank * local_b:(rank + 1) * local_b] for i in batch(local_b * world, 0)],)
    plan = fxrec.plan(model, (batch(local_b * world, 0),), world_size=world, memory_per_rank="4GB",
                      batch_size=local_b, pins={"emb.0": "row_wise", "emb.1": "row_wise"})
    dense_names = [n for n, _ in model.named_parameters() if n.startswith("top.")]
    variants = {}
    units = {"fsdp_one_unit": "one", "fsdp_every_unit": "every"}
    for dense in ("ddp", "fsdp", "fsdp_one_unit", "fsdp_every_unit"):
        fast = fxrec.transform(model, example, plan=plan, dense=dense.partition("_")[0], fsdp_units=units.get(dense))
        variants[dense] = (fast, torch.optim.Adam(fast.parameters(), lr=1e-3))
    times = {k: [] for k in variants}

    def step(k, seed):
        fast, opt = variants[k]
        x = [i[rank * local_b:(rank + 1) * local_b] for i in batch(local_b * world, seed)]
        t = time.perf_counter()
        fast(x).sum().backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t

    for k in variants:  # warm-up (DDP's buckets, FSDP's lazy init, Adam's states)
        step(k, 1)
    peak = {k: statistics.median(step_peak(lambda: step(k, 1)) for _ in range(3)) for k in variants}
    for s in range(a.steps):
        for k in (list(variants) if s % 2 == 0 else list(variants)[::-1]):
            dist.barrier()
            times[k].append(step(k, s + 2))
    held = {k: held_bytes(f, o, dense_names) for k, (f, o) in variants.items()}
    every = [None] * world
    dist.all_gather_object(every, {"held": held, "step_peak_above_start": peak,
                                   "median_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()}})
    if rank == 0:
        whole = sum(p.nbytes for n, p in model.named_parameters() if n.startswith("top."))
        result = {
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
            "command": "benchmarks/bench_fsdp.py " + " ".join(sys.argv[1:]),
            "world_size": world, "local_batch": local_b, "hidden": a.hidden, "layers": a.layers, "steps": a.steps,
            "dense_param_bytes_whole": whole,
            "per_rank": every,
            "held_ratio_fsdp_to_ddp": [r["held"]["fsdp"]["total"] / r["held"]["ddp"]["total"] for r in every],
            "step_peak_ratio_to_ddp": {k: [r["step_peak_above_start"][k] / r["step_peak_above_start"]["ddp"]
                                           for r in every] for k in variants if k != "ddp"},
            "step_ratio_to_ddp": {k: [r["median_ms"][k] / r["median_ms"]["ddp"] for r in every]
                                  for k in variants if k != "ddp"},
            "units": {k: variants[k][0].meta["fxrec_fsdp_units"] for k in variants if k != "ddp"},
        }
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
        print(json.dumps({k: result[k] for k in ("dense_param_bytes_whole", "held_ratio_fsdp_to_ddp",
                                                 "step_peak_ratio_to_ddp", "step_ratio_to_ddp", "units")}, indent=2))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cpu_fsdp.json"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=1, help="hidden x hidden layers in the top MLP")
    ap.add_argument("--local-batch", type=int, default=256)
    a = ap.parse_args()
    fd, init_file = tempfile.mkstemp(prefix="fxrec_bench_fsdp_")
    os.close(fd)
    os.remove(init_file)
    try:
        mp.spawn(_worker, args=(2, init_file, a, a.out), nprocs=2, join=True)
    finally:
        if os.path.exists(init_file):
            os.remove(init_file)


if __name__ == "__main__":
    main()
