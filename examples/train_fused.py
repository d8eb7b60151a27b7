"""The training loop of issue 3, unchanged, on the demo DLRM with each embedding optimizer.

    .venv/bin/python examples/train_fused.py

For each of SGD, Adagrad, RowWiseAdagrad and Adam: transform with optimizer=fxrec.optim.X
(backend="fbgemm", so that the resumed model runs the same kernels),
build one optimizer with fast.make_optimizer(torch.optim.Adam, lr=1e-3), train with a StepLR
schedule, save a checkpoint mid-way and load it into a fresh transformed model, and check that
the resumed run ends on exactly the same weights.
"""

from __future__ import annotations

import io
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fxrec  # noqa: E402
from examples.dlrm import DLRM, make_batch, table_rows  # noqa: E402

OPTIMIZERS = {
    "SGD": fxrec.optim.SGD(lr=0.05),
    "Adagrad": fxrec.optim.Adagrad(lr=0.05),
    "RowWiseAdagrad": fxrec.optim.RowWiseAdagrad(lr=0.05),
    "Adam": fxrec.optim.Adam(lr=1e-3),
}


def train(fast, opt, sched, rows, steps, batch):
    loss_fn = torch.nn.BCEWithLogitsLoss()
    loss = None
    for step in steps:
        inputs = make_batch(rows, batch=batch, ids_per_bag=2, seed=step)
        label = torch.randint(0, 2, (batch,), generator=torch.Generator().manual_seed(step)).float()
        loss = loss_fn(fast(*inputs), label)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return loss.item()


def run(name, embedding_optimizer, cap=5_000, steps=10, batch=256, verbose=True):
    rows = table_rows(cap=cap)
    torch.manual_seed(0)
    model = DLRM(rows, dim=16)
    example = make_batch(rows, batch=batch, ids_per_bag=2)

    def fresh():
        # backend="fbgemm": fbgemm's TBE, the kernel a GPU runs, on CPU as well ("auto" would pick
        # fxrec's native kernel here; either way both runs use the same kernels, so the resumed
        # run ends to the last bit as the uninterrupted one)
        fast = fxrec.transform(model, example, optimizer=embedding_optimizer, backend="fbgemm")
        opt = fast.make_optimizer(torch.optim.Adam, lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return fast, opt, sched

    fast, opt, sched = fresh()
    half = steps // 2
    train(fast, opt, sched, rows, range(half), batch)
    buf = io.BytesIO()
    torch.save({"model": fast.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    loss = train(fast, opt, sched, rows, range(half, steps), batch)

    resumed, opt2, sched2 = fresh()
    buf.seek(0)
    ckpt = torch.load(buf)
    resumed.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])
    loss2 = train(resumed, opt2, sched2, rows, range(half, steps), batch)
    same = all(torch.equal(a, b) for a, b in zip(fast.state_dict().values(), resumed.state_dict().values()))
    if verbose:
        print(f"{name:15s} final loss {loss:.5f}; resumed from step {half}: {loss2:.5f}; "
              f"weights identical: {same}; {fast.report.groups[0].optimizer}")
    return same, loss, loss2


def main():
    ok = True
    for name, o in OPTIMIZERS.items():
        same, _, _ = run(name, o)
        ok &= same
    if not ok:
        raise SystemExit("a resumed run differed from the uninterrupted one")


if __name__ == "__main__":
    main()
