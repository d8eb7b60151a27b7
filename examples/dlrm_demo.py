"""The README's demo: a plain DLRM model through fxrec.transform, checked, trained, and timed.

    make demo
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fxrec  # noqa: E402
from examples.dlrm import DLRM, make_batch, table_rows  # noqa: E402


def timed(fn, rounds):
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def alternate(fns, rounds=15):
    """Median seconds of each function, run in turn so that machine noise hits all alike."""
    times = {k: [] for k in fns}
    for f in fns.values():
        f()  # warm-up
    for _ in range(rounds):
        for k, f in fns.items():
            times[k] += timed(f, 1)
    return {k: statistics.median(v) for k, v in times.items()}


def main():
    torch.manual_seed(0)
    rows = table_rows(cap=100_000)
    model = DLRM(rows, dim=64)
    batch = make_batch(rows, batch=2048, ids_per_bag=1)
    print(f"DLRM: {len(rows)} tables, {sum(rows):,} rows x 64, batch 2048; plain nn.EmbeddingBag model\n")

    t = time.perf_counter()
    fast = fxrec.transform(model, batch, verify=True)
    print(f"fxrec.transform + verify: {time.perf_counter() - t:.1f} s (outputs and gradients match)\n")
    print(fast.report)
    print()

    # A few training steps, the same loop for both models.
    plain = copy.deepcopy(model)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    opts = {"plain": torch.optim.SGD(plain.parameters(), lr=0.05), "fxrec": torch.optim.SGD(fast.parameters(), lr=0.05)}
    print("step  loss(plain)  loss(fxrec)")
    for step in range(5):
        inputs = make_batch(rows, batch=2048, seed=100 + step)
        label = torch.randint(0, 2, (2048,), generator=torch.Generator().manual_seed(step)).float()
        losses = {}
        for name, m in (("plain", plain), ("fxrec", fast)):
            opts[name].zero_grad()
            loss = loss_fn(m(*inputs), label)
            loss.backward()
            opts[name].step()
            losses[name] = loss.item()
        print(f"{step:4d}  {losses['plain']:.6f}     {losses['fxrec']:.6f}")
        assert abs(losses["plain"] - losses["fxrec"]) < 1e-4, "training diverged from the plain model"

    inputs = make_batch(rows, batch=2048, seed=7)
    label = torch.rand(2048)

    def fwd(m):
        def run():
            with torch.no_grad():
                m(*inputs)
        return run

    def train(m, opt):
        def run():
            opt.zero_grad()
            loss_fn(m(*inputs), label).backward()
            opt.step()
        return run

    f = alternate({"plain": fwd(plain), "fxrec": fwd(fast)})
    s = alternate({"plain": train(plain, opts["plain"]), "fxrec": train(fast, opts["fxrec"])}, rounds=7)
    print(f"\nforward (no_grad), median of 15 alternating runs: plain {f['plain'] * 1e3:.2f} ms, "
          f"fxrec {f['fxrec'] * 1e3:.2f} ms, speed-up {f['plain'] / f['fxrec']:.2f}x")
    print(f"training step (fwd+bwd+SGD), median of 7:          plain {s['plain'] * 1e3:.2f} ms, "
          f"fxrec {s['fxrec'] * 1e3:.2f} ms, speed-up {s['plain'] / s['fxrec']:.2f}x")


if __name__ == "__main__":
    main()
