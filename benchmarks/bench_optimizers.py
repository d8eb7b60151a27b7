"""Training step with each embedding optimizer: plain model + torch.optim vs fxrec. Writes JSON.

    .venv/bin/python benchmarks/bench_optimizers.py [--out FILE] [--rounds N]

The plain model is a ModuleList of nn.EmbeddingBag(mode="sum", sparse=True) (sparse gradients,
the fast way to train it with torch.optim), looked up in a loop then torch.cat, trained by the
torch optimizer (SGD, Adagrad, fxrec's RowWiseAdagradTorch for row-wise Adagrad, SparseAdam for
Adam). fxrec transforms the same model with optimizer=fxrec.optim.X: "auto" (the default: kernel
and fused optimizer by the rule table of fxrec/passes/choose_kernels.py) and "fused"
(backend="fbgemm", fused where fbgemm has the optimizer); ``--reference`` adds "fxrec_reference"
(backend="reference": the fused updates of fxrec/runtime/grad.py). One step = zero_grad, forward, backward, step; the variants run in turn in
one process, medians reported, speed-up = plain / variant.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fxrec  # noqa: E402
from benchmarks.bench_lookups import SHAPES, inputs, median_ms  # noqa: E402
from fxrec.optim import RowWiseAdagradTorch  # noqa: E402

OPTIMIZERS = {
    "sgd": (lambda: fxrec.optim.SGD(lr=0.01), lambda p: torch.optim.SGD(p, lr=0.01)),
    "adagrad": (lambda: fxrec.optim.Adagrad(lr=0.01), lambda p: torch.optim.Adagrad(p, lr=0.01)),
    "rowwise_adagrad": (lambda: fxrec.optim.RowWiseAdagrad(lr=0.01), lambda p: RowWiseAdagradTorch(p, lr=0.01)),
    "adam": (lambda: fxrec.optim.Adam(lr=0.001), lambda p: torch.optim.SparseAdam(p, lr=0.001)),
}


class SparseBags(nn.Module):
    def __init__(self, tables, rows, dim):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(rows, dim, mode="sum", sparse=True) for _ in range(tables)])

    def forward(self, ids, offsets):
        return torch.cat([b(i, o) for b, i, o in zip(self.bags, ids, offsets)], 1)


def bench(shape, opt_name, rounds, reference=False):
    cfg = SHAPES[shape]
    torch.manual_seed(0)
    plain = SparseBags(cfg["tables"], cfg["rows"], cfg["dim"])
    example = inputs(cfg["tables"], cfg["rows"], cfg["batch"], cfg["ids_per_bag"], seed=0)
    make_cfg, make_torch = OPTIMIZERS[opt_name]
    auto = fxrec.transform(plain, example, optimizer=make_cfg(), backend="auto")
    fused = fxrec.transform(plain, example, optimizer=make_cfg(), backend="fbgemm")
    opts = {"plain": make_torch(list(plain.parameters())), "fxrec_auto": auto.make_optimizer(),
            "fxrec_fused": fused.make_optimizer()}
    models = {"plain": plain, "fxrec_auto": auto, "fxrec_fused": fused}
    if reference:
        models["fxrec_reference"] = fxrec.transform(plain, example, optimizer=make_cfg(), backend="reference")
        opts["fxrec_reference"] = models["fxrec_reference"].make_optimizer()
    batch = inputs(cfg["tables"], cfg["rows"], cfg["batch"], cfg["ids_per_bag"], seed=1)
    cot = torch.randn(cfg["batch"], cfg["tables"] * cfg["dim"])

    def step(k):
        def run():
            opts[k].zero_grad(set_to_none=True)
            (models[k](*batch) * cot).sum().backward()
            opts[k].step()
        return run

    ms = median_ms({k: step(k) for k in models}, rounds)
    g = auto.report.groups[0]
    return {
        "step_ms": ms,
        "speedup_vs_plain": {k: ms["plain"] / v for k, v in ms.items() if k != "plain"},
        "auto_choice": g.optimizer,
        "auto_why": g.why,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu_optimizers.json"))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    ap.add_argument("--reference", action="store_true", help="also time backend='reference' (fxrec's PyTorch fused updates)")
    a = ap.parse_args()
    import fbgemm_gpu

    result = {
        "what": "training step (zero_grad, fwd, bwd, step): plain sparse-gradient model + torch.optim vs fxrec "
                "(auto; fused forced); medians of alternating runs in one process",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "versions": {"torch": torch.__version__, "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "?"), "fxrec": fxrec.__version__},
        "rounds": a.rounds,
        "shapes": {name: SHAPES[name] for name in a.shapes.split(",")},
        "results": {},
    }
    for shape in a.shapes.split(","):
        for opt_name in a.optimizers.split(","):
            r = bench(shape, opt_name, a.rounds, a.reference)
            result["results"][f"{shape}/{opt_name}"] = r
            print(f"{shape:11s} {opt_name:16s} ms: " + ", ".join(f"{k} {v:.1f}" for k, v in r["step_ms"].items())
                  + " | speed-up " + ", ".join(f"{k} {v:.2f}x" for k, v in r["speedup_vs_plain"].items())
                  + f" | auto: {r['auto_choice'].split(': ')[-1]}", flush=True)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
