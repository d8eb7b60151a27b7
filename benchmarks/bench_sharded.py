"""Per-step time of the demo DLRM at world size 2 on CPU (gloo): a mixed sharding plan (SGD on
the local shards' dense gradients, and row-wise Adagrad fused into backward) vs the same model
with every table data-parallel, and vs TorchRec's DistributedModelParallel on the same tables,
plan and optimizers (benchmarks/torchrec_peer.py; TorchRec is a benchmark-only dependency, left
out with --no-torchrec or when it does not import). All run in the same processes, alternating.
JSON.

    .venv/bin/python benchmarks/bench_sharded.py [--out FILE] [--steps 15] [--no-torchrec]

``dense_floor`` is the same step with every lookup free (the pooled rows given) and the dense
parameters under DDP: what every sharded variant, fxrec's or TorchRec's, adds its embedding work and
collectives to. The JSON says how many ms the issue's target (1.5x faster than TorchRec's fused
step) leaves above it.

A step is forward, backward (collectives included) and SGD on the local parameters, each rank on
its own local batch. Data-parallel keeps every table whole on every rank and all-reduces its full
gradient in backward; the mixed plan moves ids and pooled rows instead.

TorchRec variants: ``torchrec_dense_sgd`` (TorchRec's ``dense`` compute kernel: the tables get
gradients and SGD steps them: the peer of ``sharded_mixed``) and
``torchrec_fused_rowwise_adagrad`` (the ``fused`` kernel, fbgemm's EXACT_ROWWISE_ADAGRAD in
backward: the peer of ``sharded_mixed_fused_rowwise_adagrad``), each table sharded as fxrec's plan
shards it (type and ranks; ``--torchrec-map row_wise=table_wise`` would run a type as another:
the JSON's ``torchrec_plan`` says what ran). Their KeyedJaggedTensor is built once, outside the
timed steps, like fxrec's id lists. Before timing, every rank checks that each TorchRec model gives
its fxrec peer's output (and the plain model's) on the timed batch, and again on another batch
after one training step of both (the warm-up step); a mismatch stops the benchmark.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import fxrec  # noqa: E402
from examples.dlrm import DLRM, make_batch, table_rows  # noqa: E402
from examples.train_dist import local_slice, mixed_pins  # noqa: E402


TORCHREC_PEERS = {  # variant -> (TorchRec compute kernel, its fxrec peer)
    "torchrec_dense_sgd": ("dense", "sharded_mixed"),
    "torchrec_fused_rowwise_adagrad": ("fused", "sharded_mixed_fused_rowwise_adagrad"),
}
CHECK_RTOL, CHECK_ATOL = 1e-4, 1e-4  # outputs before training
STEP_CHECK_RTOL = 1e-3  # after one step (lr 0.1 on a summed loss: outputs grow large), atol relative to max|out|


def _import_torchrec_peer():
    try:
        logging.getLogger("torchrec").setLevel(logging.ERROR)  # its per-table info/warning lines
        warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecations, hit by TorchRec
        from benchmarks import torchrec_peer
        return torchrec_peer, None
    except Exception as e:  # noqa: BLE001 - a benchmark-only dependency: run without it, say why
        return None, f"{type(e).__name__}: {e}"


def _compare(got, want, rtol, atol):
    diff = (got - want).abs().max().item()
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
        ok, msg = True, ""
    except AssertionError as e:
        ok, msg = False, str(e).strip().splitlines()[0:3]
    return {"ok": ok, "max_abs_diff": diff, "max_abs": want.abs().max().item(), "rtol": rtol, "atol": atol,
            **({"error": msg} if not ok else {})}


class _Given(torch.nn.Module):
    """An embedding bag replaced by its pooled rows, given: a leaf that takes the gradient."""

    def __init__(self, rows: torch.Tensor):
        super().__init__()
        self.rows = rows

    def forward(self, ids, offsets):
        return self.rows


def dense_floor(model, local_b: int):
    """The demo model with every embedding lookup free (its pooled rows given) and its dense
    parameters under DDP: the step any sharded embedding implementation adds its work to. DDP
    averages (fxrec and TorchRec here sum): the same collective, the same cost."""
    import copy

    floor = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    floor.emb = torch.nn.ModuleList([_Given(torch.randn(local_b, b.embedding_dim, generator=g).requires_grad_())
                                     for b in model.emb])
    return torch.nn.parallel.DistributedDataParallel(floor)


def _same_plan(plan, torchrec_sharding) -> bool:
    """Every table (TorchRec's ``t{i}`` is fxrec's ``emb.{i}``) has the same sharding type on the same ranks."""
    def fx(i):
        tp = plan.tables[f"emb.{i}"]
        return tp.sharding, sorted({s.rank for s in tp.shards})

    return all((ps["type"], sorted(ps["ranks"])) == fx(t[1:]) for t, ps in torchrec_sharding.items())


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
    if args["only_mixed"]:  # what every fxrec version can run (compare_versions.sh)
        del plans["data_parallel"]
    models = {k: fxrec.transform(model, example, plan=p) for k, p in plans.items()}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in models.items()}
    fused = "sharded_mixed_fused_rowwise_adagrad"
    try:
        fused_plan = fxrec.plan(model, example, world_size=world, memory_per_rank="4GB", pins=mixed_pins(rows, world),
                                optimizer="rowwise_adagrad")  # (a plan sizes each table for its optimizer)
        models[fused] = fxrec.transform(model, example, plan=fused_plan, optimizer=fxrec.optim.RowWiseAdagrad(lr=0.1))
        opts[fused] = models[fused].make_optimizer(torch.optim.SGD, lr=0.1)
    except (ValueError, TypeError):  # an fxrec version without optimizers on a plan (compare_versions.sh)
        if not args["only_mixed"]:
            raise
    batch = local_slice(make_batch(rows, batch=local_b * world, seed=1), rank, local_b)
    if not args["only_mixed"]:
        models["dense_floor"] = dense_floor(model, local_b)
        opts["dense_floor"] = torch.optim.SGD(models["dense_floor"].parameters(), lr=0.1)
    inputs = {k: batch for k in models}

    tr_peer, tr_missing = (None, "--no-torchrec") if not args["torchrec"] else _import_torchrec_peer()
    tr_info, checks = {}, {}
    if tr_peer is not None:
        fallback = dict(kv.split("=", 1) for kv in args["torchrec_map"])
        kjt = tr_peer.to_kjt(batch[1], batch[2])  # built once, as fxrec's id lists are
        for name, (kernel, peer) in TORCHREC_PEERS.items():
            models[name], opts[name], tr_info[name] = tr_peer.build_dmp(model, plans["sharded_mixed"], kernel, lr=0.1,
                                                                        fallback=fallback)
            tr_info[name]["peer_of"] = peer
            inputs[name] = (batch[0], kjt)
        with torch.no_grad():  # the same computation: outputs before any training step
            plain = model(*batch)
            for name, (_, peer) in TORCHREC_PEERS.items():
                out = models[name](*inputs[name])
                want = models[peer](*batch)
                checks[f"{name}_vs_{peer}_before_training"] = _compare(out, want, CHECK_RTOL, CHECK_ATOL)
                checks[f"{name}_vs_plain_model_before_training"] = _compare(out, plain, CHECK_RTOL, CHECK_ATOL)

    # a bounded loss (the sum of the logits grows without bound at lr 0.1: inf/NaN by step 15)
    labels = (torch.rand(local_b, generator=torch.Generator().manual_seed(7 + rank)) < 0.5).float()

    def step(k):
        opts[k].zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(models[k](*inputs[k]), labels, reduction="sum").backward()
        opts[k].step()

    times = {k: [] for k in models}
    for k in models:  # warm-up: one training step of every model, on the same batch
        step(k)
    if tr_peer is not None:  # ... which leaves each TorchRec model equal to its fxrec peer
        other = local_slice(make_batch(rows, batch=local_b * world, seed=2), rank, local_b)
        other_kjt = tr_peer.to_kjt(other[1], other[2])
        with torch.no_grad():
            for name, (_, peer) in TORCHREC_PEERS.items():
                want = models[peer](*other)
                atol = STEP_CHECK_RTOL * max(1.0, want.abs().max().item())
                checks[f"{name}_vs_{peer}_after_one_step"] = _compare(models[name](other[0], other_kjt), want,
                                                                      STEP_CHECK_RTOL, atol)
        all_checks = [None] * world
        dist.all_gather_object(all_checks, checks)
        bad = [(r, k, c) for r, cs in enumerate(all_checks) for k, c in cs.items() if not c["ok"]]
        if bad:
            raise AssertionError(f"rank {rank}: TorchRec's model does not compute what fxrec's does: {bad}")
    for _ in range(args["steps"]):
        for k in models:
            dist.barrier()
            t = time.perf_counter()
            step(k)
            dist.barrier()
            times[k].append(time.perf_counter() - t)
    if rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        res = {"step_ms": med, "all_step_ms": {k: [x * 1e3 for x in v] for k, v in times.items()}}
        if not args["only_mixed"]:
            res.update({"speedup_sharded_vs_data_parallel": med["data_parallel"] / med["sharded_mixed"],
                        "speedup_fused_rowwise_vs_data_parallel": med["data_parallel"] / med[fused]})
        if tr_peer is not None:
            tr_fused, tr_dense = "torchrec_fused_rowwise_adagrad", "torchrec_dense_sgd"
            ran = tr_info[tr_fused]["sharding"]
            res.update({
                # TorchRec step time / fxrec step time (> 1: fxrec is faster); the target is >= 1.5
                "speedup_fused_rowwise_vs_torchrec_fused_rowwise": med[tr_fused] / med[fused],
                "speedup_sharded_vs_torchrec_dense_sgd": med[tr_dense] / med["sharded_mixed"],
                "ratio_fused_rowwise_ms_over_torchrec_fused_rowwise_ms": med[fused] / med[tr_fused],
                "ratio_sharded_ms_over_torchrec_dense_sgd_ms": med["sharded_mixed"] / med[tr_dense],
                "target_fused_rowwise_1_5x_faster_than_torchrec": med[tr_fused] / med[fused] >= 1.5,
                # what 1.5x leaves for all embedding work and its collectives, over the dense floor
                "target_ms": med[tr_fused] / 1.5,
                "ms_left_for_embeddings_at_target": med[tr_fused] / 1.5 - med["dense_floor"],
                "fused_rowwise_ms_over_dense_floor": med[fused] - med["dense_floor"],
                "torchrec_fused_rowwise_ms_over_dense_floor": med[tr_fused] - med["dense_floor"],
                "fxrec_plan": {t: tp.sharding for t, tp in plans["sharded_mixed"].tables.items()},
                "torchrec_plan": {f"emb.{t[1:]}": ps["type"] for t, ps in ran.items()},
                "torchrec_plan_same_as_fxrec": _same_plan(plans["sharded_mixed"], ran),
                "torchrec_compute_kernels": {name: sorted({ps["compute_kernel"] for ps in info["sharding"].values()})
                                             for name, info in tr_info.items()},
                "torchrec": tr_info,
                "torchrec_check": {"passed": True, "per_rank": all_checks},
            })
        else:
            res["torchrec"] = {"skipped": tr_missing}
        with open(out_file, "w") as fh:
            json.dump(res, fh)
    dist.destroy_process_group()


def _dist_version(*names):
    from importlib.metadata import PackageNotFoundError, version

    for n in names:
        try:
            return version(n)
        except PackageNotFoundError:
            pass
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cpu_sharded.json"))
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--local-batch", type=int, default=512)
    ap.add_argument("--cap", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--no-torchrec", action="store_true", help="leave out the TorchRec peer")
    ap.add_argument("--only-mixed", action="store_true",
                    help="only the mixed plan (SGD; fused row-wise Adagrad where this fxrec version has it), no "
                         "data-parallel, no TorchRec: for compare_versions.sh")
    ap.add_argument("--torchrec-map", action="append", default=[], metavar="TYPE=TYPE",
                    help="run fxrec's sharding type as another one in TorchRec (e.g. row_wise=table_wise)")
    a = ap.parse_args()
    args = {"steps": a.steps, "local_batch": a.local_batch, "cap": a.cap, "dim": a.dim,
            "torchrec": not (a.no_torchrec or a.only_mixed), "torchrec_map": a.torchrec_map, "only_mixed": a.only_mixed}
    fd, init_file = tempfile.mkstemp(prefix="fxrec_bench_")
    os.close(fd)
    os.remove(init_file)
    tmp_out = a.out + ".tmp"
    mp.spawn(worker, args=(2, init_file, args, tmp_out), nprocs=2, join=True)
    with open(tmp_out) as fh:
        res = json.load(fh)
    os.remove(tmp_out)
    versions = {"torch": torch.__version__, "fxrec": fxrec.__version__,
                "torchrec": _dist_version("torchrec"), "fbgemm_gpu": _dist_version("fbgemm-gpu-cpu", "fbgemm-gpu")}
    result = {
        "what": "demo DLRM, world size 2, gloo on CPU, one thread per rank: mixed sharding plan vs all tables "
                "data-parallel" + (" vs TorchRec DistributedModelParallel on the same plan and optimizers"
                                   if "torchrec_plan" in res else "")
                + "; median ms of alternating steps (forward, backward, SGD)",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "versions": versions,
        "config": args, **res,
    }
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(f"step ms: {res['step_ms']}" + (f" | sharded vs data-parallel: {res['speedup_sharded_vs_data_parallel']:.2f}x"
                                          if "speedup_sharded_vs_data_parallel" in res else ""))
    if "torchrec_plan" in res:
        print(f"fused row-wise Adagrad vs TorchRec fused row-wise Adagrad: "
              f"{res['speedup_fused_rowwise_vs_torchrec_fused_rowwise']:.2f}x | SGD vs TorchRec dense SGD: "
              f"{res['speedup_sharded_vs_torchrec_dense_sgd']:.2f}x | TorchRec ran {res['torchrec_compute_kernels']}, "
              f"sharding {sorted(set(res['torchrec_plan'].values()))}; check passed")
    else:
        print(f"TorchRec peer skipped: {res['torchrec']['skipped']}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
