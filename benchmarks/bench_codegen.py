"""Host time of a transformed model's call with the generated forward reading each table's weight
by ``fxrec_attr`` (fxrec's codegen) and by fx's own ``getattr`` chain, alternating in one process.
Writes JSON.

    python3 benchmarks/bench_codegen.py --device cuda --out benchmarks/results/gpu_codegen.json
    python3 benchmarks/bench_codegen.py --device cpu --scale 100 --out benchmarks/results/cpu_codegen.json

The host's time to queue 20 calls, divided by 20 (on CUDA the device is waited for only between
blocks), median of ``--rounds`` alternating rounds: a forward under no_grad, and a training step
(forward and backward, fused SGD). fx's form is had by turning fxrec's rewrite of the get_attr
lines off (``fxrec.codegen._fast_attr_lines``) and recompiling the same GraphModules.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fxrec  # noqa: E402
import fxrec.codegen as codegen  # noqa: E402
from benchmarks.bench_gpu import SHAPES, PlainBags, inputs  # noqa: E402

FORMS = ("fxrec_attr", "fx_getattr")


def host_ms(fn, device, calls=20) -> float:
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    ms = (time.perf_counter() - t) / calls * 1e3
    if device.type == "cuda":
        torch.cuda.synchronize()
    return ms


def bench_shape(cfg, device, rounds):
    torch.manual_seed(0)
    with torch.device(device):
        plain = PlainBags(cfg["tables"], cfg["rows"], cfg["dim"], sparse=True)
    x = inputs(cfg, device, 0)
    fwd = fxrec.transform(plain, x)
    sgd = fxrec.transform(plain, x, optimizer=fxrec.optim.SGD(lr=0.01))

    def forward():
        with torch.no_grad():
            fwd(*x)

    def step():
        sgd(*x).sum().backward()

    rewrite = codegen._fast_attr_lines
    times = {f"{k}_{form}_host_ms": [] for k in ("forward", "sgd_step") for form in FORMS}
    try:
        for _ in range(rounds):
            for form in FORMS:
                codegen._fast_attr_lines = rewrite if form == "fxrec_attr" else (lambda src, *rest: src)
                fwd.recompile()
                sgd.recompile()
                assert ("fxrec_attr(" in fwd.code) == (form == "fxrec_attr"), fwd.code[:2000]
                times[f"forward_{form}_host_ms"].append(host_ms(forward, device))
                times[f"sgd_step_{form}_host_ms"].append(host_ms(step, device))
    finally:
        codegen._fast_attr_lines = rewrite
    return {"config": cfg, **{k: statistics.median(v) for k, v in times.items()}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--shapes", default="small512,onehot26")
    ap.add_argument("--scale", type=int, default=1, help="divide every shape's rows (and batch) by this")
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_codegen: no CUDA device here")
    result = {"what": "host ms per queued call, fxrec_attr vs fx's getattr chain in the generated forward",
              "command": "python3 " + " ".join(sys.argv),
              "machine": {"platform": platform.platform(), "python": platform.python_version(),
                          "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
              "versions": {"torch": torch.__version__, "fxrec": fxrec.__version__}, "rounds": a.rounds, "shapes": {}}
    for name in a.shapes.split(","):
        cfg = dict(SHAPES[name])
        cfg["rows"] = max(1, cfg["rows"] // a.scale)
        cfg["batch"] = max(2, cfg["batch"] // a.scale)
        result["shapes"][name] = r = bench_shape(cfg, device, a.rounds)
        print(name, {k: round(v, 3) for k, v in r.items() if k != "config"}, flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
