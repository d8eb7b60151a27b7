"""The plain model vs fxrec on a GPU, on the shapes of the anchor figures. Writes JSON.

    make bench-gpu                  # GPU_PY=python3: torch 2.11 + CUDA and fbgemm-gpu 1.6.0 importable
    python3 benchmarks/bench_gpu.py [--out FILE] [--rounds 20] [--shapes onehot26,multihot64,small512]
    python3 benchmarks/bench_gpu.py --device cpu --scale 1000 --rounds 2 --out /tmp/x.json   # a smoke run

Shapes, variants and method follow ../shared/gpu/README.md's anchors (measured with fbgemm's TBE
directly), so the figures compare: the plain model is a ModuleList of nn.EmbeddingBag(mode="sum")
looked up in a loop then torch.cat; its training step is forward, backward (sparse gradients:
tables made with sparse=True) and torch.optim.SGD. fxrec's model is ``fxrec.transform`` of the same
tables with default arguments (forward), with ``optimizer=fxrec.optim.SGD`` (fused into backward),
and with ``mode="inference", quantize="int8"``. Each variant runs in turn, ``--rounds`` times, in
one process, timed with CUDA events (perf_counter on CPU); medians are reported. Outputs are
checked against the plain model before timing; the transform's wall time and its peak device
memory beyond the plain model (``torch.cuda.max_memory_allocated``) are recorded too.
``--scale N`` divides every shape's rows by N (smoke runs on small machines).
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

SHAPES = {  # ../shared/gpu/README.md's anchor configurations
    "onehot26": dict(tables=26, rows=1_000_000, dim=128, batch=16384, ids_per_bag=1),
    "multihot64": dict(tables=64, rows=500_000, dim=128, batch=8192, ids_per_bag=32),
    "small512": dict(tables=512, rows=10_000, dim=64, batch=2048, ids_per_bag=4),
}


class PlainBags(nn.Module):
    def __init__(self, tables, rows, dim, sparse):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(rows, dim, mode="sum", sparse=sparse) for _ in range(tables)])

    def forward(self, ids, offsets):
        return torch.cat([b(i, o) for b, i, o in zip(self.bags, ids, offsets)], 1)


def inputs(cfg, device, seed):
    g = torch.Generator().manual_seed(seed)
    n = cfg["batch"] * cfg["ids_per_bag"]
    ids = [torch.randint(0, cfg["rows"], (n,), generator=g).to(device) for _ in range(cfg["tables"])]
    offsets = [torch.arange(0, n, cfg["ids_per_bag"]).to(device) for _ in range(cfg["tables"])]
    return ids, offsets


class Timer:
    """Milliseconds of one call: CUDA events on a GPU, perf_counter on CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3


def medians(fns, rounds, timer):
    times = {k: [] for k in fns}
    for f in fns.values():  # warm-up
        f()
    for _ in range(rounds):
        for k, f in fns.items():
            times[k].append(timer(f))
    return {k: statistics.median(v) for k, v in times.items()}


def _peak_during(fn, device):
    """(result, seconds, peak bytes allocated beyond what was allocated before) of ``fn()``."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    t = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated() - before if device.type == "cuda" else None
    return out, seconds, peak


def bench_shape(name, cfg, rounds, device):
    timer = Timer(device)
    torch.manual_seed(0)
    plain = PlainBags(cfg["tables"], cfg["rows"], cfg["dim"], sparse=True).to(device)
    table_bytes = cfg["tables"] * cfg["rows"] * cfg["dim"] * 4
    example = inputs(cfg, device, seed=0)
    batch = inputs(cfg, device, seed=1)
    # forward variants first, then the fused one: at most the plain model and two copies at a time
    fast, t_fwd, peak_fwd = _peak_during(lambda: fxrec.transform(plain, example), device)
    plain.eval()
    int8, t_q, peak_q = _peak_during(lambda: fxrec.transform(plain, example, mode="inference", quantize="int8"),
                                     device)
    plain.train()
    with torch.no_grad():
        ref = plain(*batch)
        torch.testing.assert_close(fast(*batch), ref, msg=f"{name}: fxrec differs from plain")
        q_err = float((int8(*batch).float() - ref).abs().max())

    def fwd(m):
        def run():
            with torch.no_grad():
                m(*batch)
        return run

    forward = medians({"plain": fwd(plain), "fxrec": fwd(fast), "fxrec_int8": fwd(int8)}, rounds, timer)
    choice = fast.report.groups[0]
    del fast, int8
    fused, t_sgd, peak_sgd = _peak_during(lambda: fxrec.transform(plain, example, optimizer=fxrec.optim.SGD(lr=0.01)),
                                          device)
    with torch.no_grad():
        torch.testing.assert_close(fused(*batch), ref, msg=f"{name}: fxrec (fused SGD) differs from plain")
    opt = torch.optim.SGD(plain.parameters(), lr=0.01)
    cot = torch.randn_like(ref)

    def plain_step():
        opt.zero_grad(set_to_none=True)
        (plain(*batch) * cot).sum().backward()
        opt.step()

    def fused_step():
        (fused(*batch) * cot).sum().backward()

    train = medians({"plain_sgd_sparse_grads": plain_step, "fxrec_fused_sgd": fused_step}, rounds, timer)
    return {
        "config": cfg,
        "forward_ms": forward,
        "train_step_ms": train,
        "forward_speedup_vs_plain": {k: forward["plain"] / v for k, v in forward.items() if k != "plain"},
        "train_speedup_vs_plain": train["plain_sgd_sparse_grads"] / train["fxrec_fused_sgd"],
        "int8_max_abs_error": q_err,
        "kernel": {"train": choice.kernel_train, "inference": choice.kernel_eval, "why": choice.why},
        "transform_seconds": {"forward": t_fwd, "fused_sgd": t_sgd, "int8": t_q},
        "transform_peak_bytes_over_tables": None if peak_fwd is None else {
            "forward": peak_fwd / table_bytes, "fused_sgd": peak_sgd / table_bytes, "int8": peak_q / table_bytes},
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "gpu.json"))
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scale", type=int, default=1, help="divide every shape's rows by this")
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_gpu: no CUDA device here (--device cpu --scale 1000 runs a smoke test)")
    import fbgemm_gpu  # noqa: F401

    result = {
        "what": "plain nn.EmbeddingBag loop + cat vs fxrec.transform: forward, int8 forward, training step "
                "(plain: sparse gradients + torch.optim.SGD; fxrec: fused SGD); medians of alternating runs in one process",
        "command": "python3 " + " ".join(sys.argv),
        "machine": {"platform": platform.platform(), "device": str(device),
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                     "fbgemm_gpu": getattr(sys.modules["fbgemm_gpu"], "__version__", "?"), "fxrec": fxrec.__version__},
        "rounds": a.rounds,
        "scale": a.scale,
        "shapes": {},
    }
    for name in a.shapes.split(","):
        cfg = dict(SHAPES[name], rows=max(1, SHAPES[name]["rows"] // a.scale))
        result["shapes"][name] = r = bench_shape(name, cfg, a.rounds, device)
        print(f"{name}: forward {r['forward_ms']}, train {r['train_step_ms']}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
