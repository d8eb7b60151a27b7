"""Train the demo DLRM sharded over ranks with torch.distributed, and check it against one process.

    torchrun --nproc_per_node 2 examples/train_dist.py            # gloo on CPU
    torchrun --nnodes 2 --nproc_per_node 8 ... examples/train_dist.py --backend nccl   # the same, multi-host

With ``--backend nccl`` each rank runs on ``cuda:LOCAL_RANK`` (``torch.cuda.set_device`` first; the
model and every batch there), as NCCL needs. (Not yet run on GPUs: none was at hand.)

Every rank feeds its own slice of the global batch. The plan mixes sharding types (the largest
table row-wise, the next ones table-wise, the small ones data-parallel); ``--check`` also trains
the plain model on the whole global batch in every process and compares outputs at every step
and the tables at the end. The loss sums over the global batch and divides by its size, so the
gradients summed over ranks are the single-process gradients.

``--dense fsdp`` shards the dense layers over the ranks too (FSDP; ``transform(dense="fsdp")``);
``--clip 1.0`` clips the gradients to that norm with ``fxrec.clip_grad_norm_`` (the plain model with
torch's). ``--serve int8`` then checkpoints the trained model (``fxrec.checkpoint.save``, every rank), loads it
into the plain model (``load_into_model``) and serves it quantized over the same ranks on a plan made
for serving (``fxrec.plan(..., quantize="int8")``), comparing every rank's outputs with one
process's int8 model of the same weights. The checkpoint goes to ``--ckpt-dir``, a directory every
rank sees (shared storage across hosts); without it, a temporary directory of rank 0's, which only
the ranks of one host see (``fxrec.checkpoint.save`` refuses it, on every rank, otherwise).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fxrec  # noqa: E402
from examples.dlrm import DLRM, make_batch, table_rows  # noqa: E402


def local_slice(batch, rank, local_b):
    dense, ids, offsets = batch  # one id per bag: offsets are arange
    lo, hi = rank * local_b, (rank + 1) * local_b
    return dense[lo:hi], [i[lo:hi] for i in ids], [torch.arange(local_b) for _ in offsets]


def mixed_pins(rows, world):
    order = sorted(range(len(rows)), key=lambda i: -rows[i])
    pins = {f"emb.{order[0]}": "row_wise"}
    for k, i in enumerate(order[1:5]):
        pins[f"emb.{i}"] = ("table_wise", k % world)
    for i in order[-6:]:
        pins[f"emb.{i}"] = "data_parallel"
    return pins


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--local-batch", type=int, default=128)
    ap.add_argument("--cap", type=int, default=20_000, help="rows per table at most")
    ap.add_argument("--check", action="store_true", help="compare with the single-process model")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a rank waits for the others")
    ap.add_argument("--serve", default=None, metavar="DTYPE",
                    help="then checkpoint, and serve quantized (int8, int4, fp16, ...) on a plan for serving")
    ap.add_argument("--ckpt-dir", default=None, metavar="DIR",
                    help="--serve's checkpoint directory, which every rank sees (default: a temporary one: one host)")
    ap.add_argument("--dense", default="ddp", choices=("ddp", "fsdp"),
                    help="the dense layers whole on every rank (DDP), or sharded over the ranks (FSDP)")
    ap.add_argument("--clip", type=float, default=None, metavar="MAX_NORM",
                    help="clip the gradients to this norm (fxrec.clip_grad_norm_: the single-process model's norm)")
    a = ap.parse_args()
    device = torch.device("cpu")
    if a.backend == "nccl":  # NCCL runs on CUDA tensors: this rank's GPU, for the model and every batch
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(a.backend, timeout=timedelta(seconds=a.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = table_rows(a.cap)
    torch.manual_seed(0)
    model = DLRM(rows, dim=16).to(device)
    ref = DLRM(rows, dim=16).to(device)
    ref.load_state_dict(model.state_dict())
    global_b = a.local_batch * world

    def on_device(batch):
        return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, batch)

    whole = make_batch(rows, batch=global_b, seed=0)
    example = on_device(local_slice(whole, rank, a.local_batch))
    # every rank must run the same plan: made from the same (global) batch on every rank
    plan = fxrec.plan(model, on_device(whole), world_size=world, memory_per_rank="4GB", pins=mixed_pins(rows, world),
                      batch_size=a.local_batch, device="cuda" if a.backend == "nccl" else "cpu")
    fast = fxrec.transform(model, example, plan=plan, dense=a.dense)
    if rank == 0:
        print(plan)
        print("rank 0's graph, embedding part:")
        print("\n".join(line for line in fast.code.splitlines() if "fxrec_shard" in line or "embedding" in line))
    opt = torch.optim.SGD(fast.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    loss_fn = torch.nn.BCEWithLogitsLoss(reduction="sum")
    worst, times = 0.0, []
    for step in range(a.steps):
        batch = on_device(make_batch(rows, batch=global_b, seed=step + 1))
        label = (torch.rand(global_b, generator=torch.Generator().manual_seed(1000 + step)) < 0.3).float().to(device)
        lo, hi = rank * a.local_batch, (rank + 1) * a.local_batch
        t = time.perf_counter()
        out = fast(*local_slice(batch, rank, a.local_batch))
        loss = loss_fn(out, label[lo:hi]) / global_b
        opt.zero_grad()
        loss.backward()
        if a.clip is not None:
            norm = fxrec.clip_grad_norm_(fast, a.clip)
            if rank == 0 and step == 0:
                print(f"gradient norm at the first step: {float(norm):.4g} (clipped to {a.clip:g})")
        opt.step()
        times.append(time.perf_counter() - t)
        if a.check:
            want = ref(*batch)
            worst = max(worst, float((out.detach() - want[lo:hi].detach()).abs().max()))
            ref_opt.zero_grad()
            (loss_fn(want, label) / global_b).backward()
            if a.clip is not None:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), a.clip)
            ref_opt.step()
    if a.check:
        params = dict(fast.named_parameters())
        for name, want in ref.state_dict().items():
            table = name.rsplit(".", 1)[0]
            tp = plan.tables.get(table)
            if name not in params:
                continue  # a table-wise table another rank holds
            if tp is not None and tp.sharding == "row_wise":
                s = tp.shards[rank]
                want = want[s.row_offset:s.row_offset + s.num_rows]
            got = params[name].detach()
            got = got.full_tensor() if hasattr(got, "full_tensor") else got  # (--dense fsdp: this rank's chunk)
            worst = max(worst, float((got - want).abs().max()))
    t = torch.tensor([worst], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        times.sort()
        print(f"world {world}: {a.steps} steps, median step {times[len(times) // 2] * 1e3:.1f} ms"
              + (f"; largest difference from the single-process model (outputs and tables): {float(t):.3g}"
                 if a.check else ""))
    ok = not a.check or float(t) < 1e-4
    if a.serve:
        ok = serve(fast, rows, a, rank, world, whole, on_device) and ok
    dist.destroy_process_group()
    # (os._exit, not sys.exit: with torch 2.13 and gloo a process sometimes aborts at interpreter
    # exit after destroy_process_group, a gloo thread freeing tensors; docs/sharding.md, Limits)
    sys.stdout.flush()
    os._exit(0 if ok else 1)


def serve(fast, rows, a, rank, world, whole, on_device) -> bool:
    """Checkpoint the trained model, load it into the plain model and serve it quantized over the
    ranks on a plan for serving; True where every rank's outputs are one process's."""
    import tempfile

    where = [a.ckpt_dir or (tempfile.mkdtemp(prefix="fxrec_train_dist_") if rank == 0 else None)]
    dist.broadcast_object_list(where)  # (a temporary directory of rank 0's: the ranks of its host see it)
    path = os.path.join(where[0], "trained")
    fxrec.checkpoint.save(fast, path)
    model = DLRM(rows, dim=16)
    fxrec.checkpoint.load_into_model(model, path)
    model = model.to(on_device(whole)[0].device).eval()
    example = on_device(local_slice(whole, rank, a.local_batch))
    plan = fxrec.plan(model, on_device(whole), world_size=world, memory_per_rank="4GB", quantize=a.serve,
                      batch_size=a.local_batch, device="cuda" if a.backend == "nccl" else "cpu")
    served = fxrec.transform(model, example, mode="inference", quantize=a.serve, plan=plan)
    single = fxrec.transform(model, on_device(whole), mode="inference", quantize=a.serve)
    batch = on_device(make_batch(rows, batch=a.local_batch * world, seed=99))
    lo, hi = rank * a.local_batch, (rank + 1) * a.local_batch
    with torch.no_grad():
        diff = float((served(*local_slice(batch, rank, a.local_batch)) - single(*batch)[lo:hi]).abs().max())
    t = torch.tensor([diff], device=batch[0].device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # (every rank has read the checkpoint)
    if rank == 0:
        import shutil

        if not a.ckpt_dir:
            shutil.rmtree(where[0], ignore_errors=True)
        print(plan.format(max_tables=6))
        print(f"served {a.serve} over {world} ranks from the checkpoint: largest difference from one process's "
              f"{a.serve} model: {float(t):.3g}")
    return float(t) < 1e-4


if __name__ == "__main__":
    main()
