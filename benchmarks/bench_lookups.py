"""Plain loop of nn.EmbeddingBag vs fxrec, forward and training step, on three shapes. Writes JSON.

    make bench                      # or: .venv/bin/python benchmarks/bench_lookups.py --out FILE

Each shape: the plain model (a ModuleList of nn.EmbeddingBag(mode="sum") looked up in a loop,
then torch.cat), fxrec.transform of it with backend="auto" (what users get), the same with
reuse_outputs=False (every call allocates its output, as the plain model does), and with
backend="fbgemm" (fbgemm's TBE forced, for reference). All three run in one process, in turn,
``--rounds`` times; the medians are reported, with speed-up = plain / variant.
A training step is forward, backward (dense gradients, as the plain model has) and
torch.optim.SGD.step().
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fxrec  # noqa: E402

SHAPES = {
    "onehot26": dict(tables=26, rows=100_000, dim=64, batch=2048, ids_per_bag=1),
    "multihot16": dict(tables=16, rows=100_000, dim=64, batch=2048, ids_per_bag=16),
    "small256": dict(tables=256, rows=5_000, dim=32, batch=2048, ids_per_bag=4),
}


class PlainBags(nn.Module):
    def __init__(self, tables, rows, dim):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(tables)])

    def forward(self, ids, offsets):
        return torch.cat([b(i, o) for b, i, o in zip(self.bags, ids, offsets)], 1)


def inputs(tables, rows, batch, ids_per_bag, seed):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, rows, (batch * ids_per_bag,), generator=g) for _ in range(tables)]
    offsets = [torch.arange(0, batch * ids_per_bag, ids_per_bag) for _ in range(tables)]
    return ids, offsets


def median_ms(fns, rounds):
    times = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(rounds):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def bench_shape(name, cfg, rounds):
    torch.manual_seed(0)
    plain = PlainBags(cfg["tables"], cfg["rows"], cfg["dim"])
    example = inputs(cfg["tables"], cfg["rows"], cfg["batch"], cfg["ids_per_bag"], seed=0)
    t = time.perf_counter()
    auto = fxrec.transform(plain, example, backend="auto")
    transform_s = time.perf_counter() - t
    forced = fxrec.transform(plain, example, backend="fbgemm")
    no_reuse = fxrec.transform(plain, example, backend="auto", reuse_outputs=False)
    models = {"plain": plain, "fxrec_auto": auto, "fxrec_auto_no_reuse": no_reuse, "fxrec_fbgemm": forced}
    batch = inputs(cfg["tables"], cfg["rows"], cfg["batch"], cfg["ids_per_bag"], seed=1)
    ref = plain(*batch)
    for k, m in models.items():
        torch.testing.assert_close(m(*batch), ref, msg=f"{name}: {k} differs from plain")

    def fwd(m):
        def run():
            with torch.no_grad():
                m(*batch)
        return run

    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
    cot = torch.randn_like(ref)

    def step(k):
        m, opt = models[k], opts[k]

        def run():
            opt.zero_grad(set_to_none=True)
            (m(*batch) * cot).sum().backward()
            opt.step()
        return run

    f = median_ms({k: fwd(m) for k, m in models.items()}, rounds)
    s = median_ms({k: step(k) for k in models}, max(3, rounds // 2))
    g = auto.report.groups[0]
    return {
        "config": cfg,
        "forward_ms": f,
        "train_step_ms": s,
        "forward_speedup_vs_plain": {k: f["plain"] / v for k, v in f.items() if k != "plain"},
        "train_speedup_vs_plain": {k: s["plain"] / v for k, v in s.items() if k != "plain"},
        "auto_choice": {"lowered": g.lowered, "train": g.kernel_train, "inference": g.kernel_eval, "why": g.why},
        "transform_seconds_auto": transform_s,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu.json"))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    a = ap.parse_args()
    import fbgemm_gpu  # noqa: F401

    result = {
        "what": "plain nn.EmbeddingBag loop + cat vs fxrec.transform (auto, auto without output reuse, fbgemm forced); medians of alternating runs in one process",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "device": "cpu"},
        "versions": {"torch": torch.__version__, "fbgemm_gpu": getattr(sys.modules["fbgemm_gpu"], "__version__", "?"),
                     "fxrec": fxrec.__version__},
        "rounds": a.rounds,
        "shapes": {},
    }
    for name in a.shapes.split(","):
        r = bench_shape(name, SHAPES[name], a.rounds)
        result["shapes"][name] = r
        print(f"{name:11s} forward ms: " + ", ".join(f"{k} {v:.2f}" for k, v in r["forward_ms"].items())
              + " | speed-up " + ", ".join(f"{k} {v:.2f}x" for k, v in r["forward_speedup_vs_plain"].items()), flush=True)
        print(f"{'':11s} train   ms: " + ", ".join(f"{k} {v:.2f}" for k, v in r["train_step_ms"].items())
              + " | speed-up " + ", ".join(f"{k} {v:.2f}x" for k, v in r["train_speedup_vs_plain"].items()), flush=True)
        print(f"{'':11s} auto chose: lowered={r['auto_choice']['lowered']} train={r['auto_choice']['train']} "
              f"inference={r['auto_choice']['inference']}", flush=True)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
