"""The plain model, fbgemm's TBE written by hand, and fxrec on a GPU, on the shapes of the anchor
figures. Writes JSON.

    make bench-gpu                  # GPU_PY=python3: torch 2.11 + CUDA and fbgemm-gpu 1.6.0 importable
    python3 benchmarks/bench_gpu.py [--out FILE] [--rounds 20] [--shapes onehot26,multihot64,small512] [--no-compile]
    python3 benchmarks/bench_gpu.py --device cpu --scale 1000 --rounds 2 --out /tmp/x.json   # a smoke run

Shapes, variants and method follow ../shared/gpu/README.md's anchors, so the figures compare:
- ``plain``: a ModuleList of nn.EmbeddingBag(mode="sum") looked up in a loop then torch.cat; its
  training step is forward, backward (sparse gradients: tables made with sparse=True) and
  torch.optim.SGD (or torch.optim.Adagrad, the nearest torch has to row-wise Adagrad);
  ``*_cuda_graph`` (CUDA only) replays the plain forward, and the TBE's and fxrec's forwards and
  training steps, as CUDA graphs captured on the benchmark's batch (a capture that fails is
  written to ``cuda_graph_errors`` and its variant left out), ``plain_compiled`` is torch.compile of
  it (skipped with --no-compile: compiling 512 tables takes minutes);
- ``tbe``: one SplitTableBatchedEmbeddingBagsCodegen over the same tables, written by hand against
  fbgemm's API and fed ids and offsets already packed the way it wants them (what fxrec does for
  the user is the difference); ``tbe_int8``: fbgemm's IntNBitTableBatchedEmbeddingBagsCodegen
  over the same tables quantized to int8 by fbgemm's ``quantize_embs`` (its defaults otherwise,
  the bounds check included), fed the same packed ids, the peer of fxrec's int8 model (their
  outputs are checked equal to the last bit);
- ``fxrec``: ``fxrec.transform`` of the plain model with default arguments (forward), with
  ``optimizer=fxrec.optim.SGD`` / ``RowWiseAdagrad`` (fused into backward), and with
  ``mode="inference", quantize="int8"``; it is fed the model's own inputs (lists of id tensors).
Each variant runs in turn, ``--rounds`` times, in one process, timed with CUDA events
(perf_counter on CPU); medians are reported, of one call (the host's work for it counts in full)
and of ``--queue`` calls queued back to back, as a training loop runs them (``*_queued``), with
the host's time to queue them (``*_host_ms_queued``: where it exceeds the device's, the host's
Python is what the queued figure measures). Outputs are checked against the plain model before
timing; a device-to-device copy is timed in the same run (the bandwidth the multi-hot forward is
compared with), and the transform's wall time and its peak device memory beyond the plain model
(``torch.cuda.max_memory_allocated``) are recorded. The JSON is written after every shape.
``--scale N`` divides every shape's rows by N (smoke runs on small machines).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import warnings

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fxrec  # noqa: E402

SHAPES = {  # ../shared/gpu/README.md's anchor configurations
    "onehot26": dict(tables=26, rows=1_000_000, dim=128, batch=16384, ids_per_bag=1),
    "multihot64": dict(tables=64, rows=500_000, dim=128, batch=8192, ids_per_bag=32),
    "small512": dict(tables=512, rows=10_000, dim=64, batch=2048, ids_per_bag=4),
}
LR = 0.01


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


def packed(ids, offsets):
    """fbgemm's TBE input: every table's ids in one tensor, and T*B+1 offsets into it."""
    starts = [0]
    for i in ids[:-1]:
        starts.append(starts[-1] + i.numel())
    flat_offsets = torch.cat([o + s for o, s in zip(offsets, starts)] + [offsets[0].new_tensor([starts[-1] + ids[-1].numel()])])
    return torch.cat(ids), flat_offsets


def hand_written_tbe(plain, cfg, device, optimizer):
    """fbgemm's training TBE over ``plain``'s tables (its rows copied in), fused ``optimizer``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (ComputeDevice,
                                                                            SplitTableBatchedEmbeddingBagsCodegen)
    on_cpu = device.type == "cpu"
    where = (EmbeddingLocation.HOST, ComputeDevice.CPU) if on_cpu else (EmbeddingLocation.DEVICE, ComputeDevice.CUDA)
    kind = {"sgd": EmbOptimType.EXACT_SGD, "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}[optimizer]
    tbe = SplitTableBatchedEmbeddingBagsCodegen([(cfg["rows"], cfg["dim"], *where)] * cfg["tables"], optimizer=kind,
                                                learning_rate=LR, eps=1e-8, pooling_mode=PoolingMode.SUM,
                                                device=None if on_cpu else device)
    with torch.no_grad():
        for w, bag in zip(tbe.split_embedding_weights(), plain.bags):
            w.copy_(bag.weight)
    return tbe


def hand_written_nbit(plain, cfg, device, dtype="int8"):
    """fbgemm's inference TBE (IntNBitTableBatchedEmbeddingBagsCodegen) over ``plain``'s tables,
    quantized row-wise to ``dtype`` by fbgemm's ``quantize_embs``, rows aligned for ``device``,
    fp32 out (as fxrec's model and the plain one give), its other arguments fbgemm's defaults (its
    bounds check included): the quantized lookup a user writes by hand, fed ids and offsets
    already packed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fbgemm_gpu.split_embedding_configs import SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen
        from fbgemm_gpu.tbe.utils.quantize import quantize_embs
    kind = {"fp32": SparseType.FP32, "fp16": SparseType.FP16, "int8": SparseType.INT8, "int4": SparseType.INT4}[dtype]
    on_cpu = device.type == "cpu"
    where = EmbeddingLocation.HOST if on_cpu else EmbeddingLocation.DEVICE
    tbe = IntNBitTableBatchedEmbeddingBagsCodegen([("", cfg["rows"], cfg["dim"], kind, where)] * cfg["tables"],
                                                  pooling_mode=PoolingMode.SUM, output_dtype=SparseType.FP32,
                                                  device=device, row_alignment=1 if on_cpu else 16)
    tbe.initialize_weights()
    tbe.assign_embedding_weights([quantize_embs(b.weight.detach().float(), kind) for b in plain.bags])
    return tbe


class Timer:
    """Milliseconds of one call: CUDA events on a GPU, perf_counter on CPU. ``host_ms``: the host's
    time for the last call, from its start until it returned, before waiting for the device (on
    CPU, the same as the call)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.host_ms = 0.0

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t = time.perf_counter()
            fn()
            self.host_ms = (time.perf_counter() - t) * 1e3
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t = time.perf_counter()
        fn()
        self.host_ms = (time.perf_counter() - t) * 1e3
        return self.host_ms


def medians(fns, rounds, timer, queue=1, host=None):
    """Median ms of one call of each of ``fns``, run in turn ``rounds`` times after one warm-up
    each. ``queue`` > 1: each timing covers that many calls queued back to back (nothing waits
    between them, as in a training loop), divided by ``queue``: the host's work for one call then
    overlaps the device's for the one before. ``host``: a dict that gets, per function, the median
    of the host's time to queue one call (the host's work alone: where it exceeds the device's,
    the host is what the queued timing measures)."""
    times = {k: [] for k in fns}
    hosts = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(rounds):
        for k, f in fns.items():
            times[k].append(timer(lambda: [f() for _ in range(queue)]) / queue)
            hosts[k].append(timer.host_ms / queue)
    if host is not None:
        host.update({k: statistics.median(v) for k, v in hosts.items()})
    return {k: statistics.median(v) for k, v in times.items()}


def _peak_during(fn, device):
    """(result, seconds, peak bytes allocated beyond what was allocated before) of ``fn()``."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    t = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated() - before if device.type == "cuda" else None
    return out, seconds, peak


def free(device):
    """Give back the memory of models just deleted (a GraphModule is freed by the cycle collector)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def copy_bandwidth(device, timer, rounds):
    """Bytes read + written per second by a 2 GiB device-to-device copy (the forward's yardstick)."""
    if device.type != "cuda":
        return None
    src = torch.empty(1 << 29, device=device)
    dst = torch.empty_like(src)
    ms = medians({"copy": lambda: dst.copy_(src)}, rounds, timer)["copy"]
    del src, dst
    return 2 * (1 << 31) / (ms / 1e3)


def cuda_graph(fn, errors, key):
    """``(graph, what the captured call returned)``: ``fn`` captured as a CUDA graph after a warm-up
    call on a side stream (torch's recipe; the warm-up runs it once more, a training step trains).
    ``(None, None)`` where capture fails, the error kept in ``errors[key]`` for the JSON: the
    run goes on without that variant."""
    before = torch.cuda.current_stream()
    first = []  # the call's own error (a failed capture's end raises another, which would hide it)
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(before)
        with torch.cuda.stream(stream):
            fn()
        before.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            try:
                out = fn()
            except Exception as e:  # noqa: BLE001
                first.append(e)
                raise
    except Exception as e:  # noqa: BLE001 - reported in the JSON
        e = first[0] if first else e
        errors[key] = f"{type(e).__name__}: {e}"[:800]
        torch.cuda.set_stream(before)  # (torch's graph context leaves its stream current when its end fails)
        torch.cuda.synchronize()
        return None, None
    return graph, out


def train_steps(models, batch, cot, plain, plain_opt):
    """Training-step closures: the plain model with ``plain_opt``; fused ones (fxrec's, the hand TBE)."""

    def plain_step():
        plain_opt.zero_grad(set_to_none=True)
        (plain(*batch) * cot).sum().backward()
        plain_opt.step()

    steps = {"plain": plain_step}
    for name, (m, x) in models.items():
        steps[name] = (lambda m=m, x=x: (m(*x) * cot).sum().backward())
    return steps


def bench_shape(name, cfg, rounds, device, compile_plain, queue):
    """One shape. Memory: the plain model and at most two more copies of its tables at a time
    (plus torch.optim.Adagrad's state when it trains), so multihot64 fits an 80 GB GPU; and the
    CUDA graphs' memory pools of the variants being timed (their outputs and, for a training
    step, its backward's temporaries), given back before the next ones are made."""
    timer = Timer(device)
    torch.manual_seed(0)
    with torch.device(device):  # the tables are made and initialised where they live
        plain = PlainBags(cfg["tables"], cfg["rows"], cfg["dim"], sparse=True)
    table_bytes = cfg["tables"] * cfg["rows"] * cfg["dim"] * 4
    example = inputs(cfg, device, seed=0)
    batch = inputs(cfg, device, seed=1)
    flat = packed(*batch)
    with torch.no_grad():
        ref = plain(*batch)
    transform_s, peaks = {}, {}

    def transformed(key, **kw):
        """fxrec's model, checked against the plain one (its first call moves the rows into the TBE)."""
        m, transform_s[key], peaks[key] = _peak_during(lambda: fxrec.transform(plain, example, **kw), device)
        with torch.no_grad():
            out = m(*batch)
        if key != "int8":
            torch.testing.assert_close(out, plain(*batch), msg=f"{name}: fxrec ({key}) differs from plain")
        return m, out

    fast, _ = transformed("forward")
    plain.eval()
    int8, q_out = transformed("int8", mode="inference", quantize="int8")
    plain.train()
    q_err = float((q_out.float() - ref).abs().max())
    tbe = hand_written_tbe(plain, cfg, device, "sgd")
    tbe_int8 = hand_written_nbit(plain, cfg, device, "int8")
    with torch.no_grad():
        torch.testing.assert_close(tbe(*flat), ref, msg=f"{name}: the hand-written TBE differs from plain")
        # the same rows quantized the same way, looked up by the same operator: equal to the last bit
        torch.testing.assert_close(tbe_int8(*flat), q_out, rtol=0, atol=0,
                                   msg=f"{name}: the hand-written int8 TBE differs from fxrec's int8 model")

    def fwd(m, x):
        def run():
            with torch.no_grad():
                return m(*x)
        return run

    fns = {"plain": fwd(plain, batch), "tbe": fwd(tbe, flat), "fxrec": fwd(fast, batch),
           "tbe_int8": fwd(tbe_int8, flat), "fxrec_int8": fwd(int8, batch)}
    graphs, graph_errors = [], {}
    if device.type == "cuda":
        # Each forward replayed as a CUDA graph: the host's work is one replay call a step. fxrec's
        # is checked against the plain model after a replay.
        for key in ("plain", "tbe", "fxrec", "tbe_int8", "fxrec_int8"):
            graph, out = cuda_graph(fns[key], graph_errors, "forward_" + key)
            if graph is None:
                continue
            graphs.append(graph)
            fns[key + "_cuda_graph"] = graph.replay
            if key == "fxrec":
                graph.replay()
                torch.testing.assert_close(out, ref, msg=f"{name}: fxrec replayed as a CUDA graph differs from plain")
            if key == "fxrec_int8":
                graph.replay()
                torch.testing.assert_close(out, q_out, rtol=0, atol=0,
                                           msg=f"{name}: fxrec's int8 model replayed as a CUDA graph differs from it eager")
        graph = out = None  # (the graphs are held in `graphs` until the forwards are timed)
    if compile_plain:
        compiled = torch.compile(plain)
        fns["plain_compiled"] = fwd(compiled, batch)
    forward = medians(fns, rounds, timer)
    forward_host = {}
    forward_queued = medians(fns, max(1, rounds // 2), timer, queue, forward_host) if queue > 1 else None
    choice = fast.report.groups[0]
    kernel = {"train": choice.kernel_train, "inference": choice.kernel_eval, "why": choice.why}
    del fast, int8, fns, choice, tbe, tbe_int8
    graphs.clear()
    free(device)
    cot = torch.randn_like(ref)
    train, train_queued, train_host = {}, {}, {}
    for opt_name, fused_cfg, plain_opt_class in (
            ("sgd", fxrec.optim.SGD(lr=LR), torch.optim.SGD),
            ("rowwise_adagrad", fxrec.optim.RowWiseAdagrad(lr=LR, eps=1e-8), torch.optim.Adagrad)):
        fused, _ = transformed(opt_name, optimizer=fused_cfg)
        tbe = hand_written_tbe(plain, cfg, device, opt_name)
        plain_opt = plain_opt_class(plain.parameters(), lr=LR)  # Adagrad's state: a table-sized sum
        steps = train_steps({"tbe": (tbe, flat), "fxrec": (fused, batch)}, batch, cot, plain, plain_opt)
        if device.type == "cuda":  # forward, backward and the fused update replayed as one graph
            for key in ("tbe", "fxrec"):
                graph, _ = cuda_graph(steps[key], graph_errors, f"train_{opt_name}_{key}")
                if graph is not None:
                    graphs.append(graph)
                    steps[key + "_cuda_graph"] = graph.replay
                graph = None  # (held in `graphs` until this optimizer's steps are timed)
        train[opt_name] = medians(steps, rounds, timer)
        if queue > 1:
            train_host[opt_name] = {}
            train_queued[opt_name] = medians(steps, max(1, rounds // 2), timer, queue, train_host[opt_name])
        del fused, tbe, plain_opt, steps
        graphs.clear()
        free(device)
    def graphed_over(times, base, key="fxrec"):
        """fxrec (``key``) replayed as a CUDA graph over ``base`` (the TBE by hand, eager or replayed)."""
        mine = key + "_cuda_graph"
        return times[mine] / times[base] if mine in times and base in times else None

    fwd_bytes = cfg["tables"] * cfg["batch"] * cfg["ids_per_bag"] * cfg["dim"] * 4
    return {
        "config": cfg,
        "forward_ms": forward,
        "train_step_ms": train,
        "forward_ms_queued": forward_queued,
        "train_step_ms_queued": train_queued or None,
        # the host's time to queue one call, of the queued timings (CUDA: before waiting for the device)
        "forward_host_ms_queued": forward_host or None,
        "train_step_host_ms_queued": train_host or None,
        "forward_speedup_vs_plain": {k: forward["plain"] / v for k, v in forward.items() if k != "plain"},
        "train_speedup_vs_plain": {o: {k: t["plain"] / v for k, v in t.items() if k != "plain"} for o, t in train.items()},
        "fxrec_over_tbe": {"forward": forward["fxrec"] / forward["tbe"],
                           "forward_int8": forward["fxrec_int8"] / forward["tbe_int8"],
                           **{f"train_{o}": t["fxrec"] / t["tbe"] for o, t in train.items()}},
        "fxrec_over_tbe_queued": None if not train_queued else {
            "forward": forward_queued["fxrec"] / forward_queued["tbe"],
            "forward_int8": forward_queued["fxrec_int8"] / forward_queued["tbe_int8"],
            **{f"train_{o}": t["fxrec"] / t["tbe"] for o, t in train_queued.items()}},
        # fxrec replayed as a CUDA graph, over the TBE by hand called eagerly and replayed alike
        "fxrec_cuda_graph_over_tbe": None if device.type != "cuda" else {
            "forward": graphed_over(forward, "tbe"), "forward_int8": graphed_over(forward, "tbe_int8", "fxrec_int8"), **{f"train_{o}": graphed_over(t, "tbe") for o, t in train.items()}},
        "fxrec_cuda_graph_over_tbe_cuda_graph": None if device.type != "cuda" else {
            "forward": graphed_over(forward, "tbe_cuda_graph"),
            "forward_int8": graphed_over(forward, "tbe_int8_cuda_graph", "fxrec_int8"),
            **{f"train_{o}": graphed_over(t, "tbe_cuda_graph") for o, t in train.items()}},
        "cuda_graph_errors": graph_errors or None,
        "forward_rows_read_bytes_per_s": {k: fwd_bytes / (forward[k] / 1e3) for k in ("tbe", "fxrec")},
        "int8_max_abs_error": q_err,
        "kernel": kernel,
        "transform_seconds": transform_s,
        "transform_peak_bytes_over_tables": None if device.type != "cuda" else {k: v / table_bytes for k, v in peaks.items()},
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "gpu.json"))
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scale", type=int, default=1, help="divide every shape's rows by this")
    ap.add_argument("--queue", type=int, default=10, help="also time this many calls queued back to back (1: not)")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="leave out torch.compile of the plain model")
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_gpu: no CUDA device here (--device cpu --scale 1000 runs a smoke test)")
    import fbgemm_gpu  # noqa: F401

    timer = Timer(device)
    bandwidth = copy_bandwidth(device, timer, a.rounds)
    result = {
        "what": "plain nn.EmbeddingBag loop + cat, fbgemm's TBE by hand, and fxrec.transform: forward, int8 forward, "
                "training step (plain: sparse gradients + torch.optim.SGD / Adagrad; TBE and fxrec: fused SGD / "
                "row-wise Adagrad); medians of alternating runs in one process",
        "command": "python3 " + " ".join(sys.argv),
        "machine": {"platform": platform.platform(), "device": str(device),
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                     "fbgemm_gpu": getattr(sys.modules["fbgemm_gpu"], "__version__", "?"), "fxrec": fxrec.__version__},
        "rounds": a.rounds,
        "queue": a.queue,
        "scale": a.scale,
        "copy_bytes_per_s": bandwidth,
        "shapes": {},
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    for name in a.shapes.split(","):
        cfg = dict(SHAPES[name], rows=max(1, SHAPES[name]["rows"] // a.scale))
        result["shapes"][name] = r = bench_shape(name, cfg, a.rounds, device, a.compile, a.queue)
        if bandwidth:
            r["forward_read_fraction_of_copy"] = {k: v / bandwidth for k, v in r["forward_rows_read_bytes_per_s"].items()}
        print(f"{name}: forward {r['forward_ms']}, train {r['train_step_ms']}", flush=True)
        with open(a.out, "w") as fh:  # after every shape: a run cut short keeps what it measured
            json.dump(result, fh, indent=2)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("wrote", a.out)


if __name__ == "__main__":
    main()
