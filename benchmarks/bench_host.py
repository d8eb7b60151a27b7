"""Host time of a transformed model's call, each change to the host's per-call work on and off,
alternating in one process. Writes JSON.

    python3 benchmarks/bench_host.py --device cuda --out benchmarks/results/gpu_host.json
    python3 benchmarks/bench_host.py --device cpu --scale 100 --threads 1 --out benchmarks/results/cpu_host.json

The host's time to queue 20 calls, divided by 20 (on CUDA the device is waited for only between
blocks), median of ``--rounds`` alternating rounds (and ``*_saved_ms``, the median of each round's
off minus on, which a drift of the machine's speed during the run does not move): a forward
under no_grad, and a training step
(forward and backward, fused SGD), on fbgemm's TBE (the kernel every group gets on CUDA; on CPU
too, with ``--backend fbgemm``, the default). ``--ab`` picks the changes, each measured on its own
against the model with only it turned off:

* ``attr``: the generated forward reads each table's weight by ``fxrec_attr`` (fxrec's codegen),
  off: fx's own ``getattr`` chain (``fxrec.codegen._fast_attr_lines`` turned off, the same
  GraphModules recompiled);
* ``attrs``: a run of weight reads in a row is one ``fxrec_attrs`` call (C-level maps over the
  module dicts), off: one ``fxrec_attr`` call per weight;
* ``guards``: the input size check reads every input's dims and sizes by C-level maps and
  compares whole tuples (``fxrec.runtime.input_guards.InputGuards._build``), off: a few
  generated lines per input, as it was written before (:func:`one_line_per_input`);
* ``packing``: groups of one form packed in list-level steps
  (``fxrec.runtime.packing._pack_uniform``), off: the loop over features;
* ``bases``: where each feature's ids start in the packed ids stays on the device from one call
  to the next of the same layout (``fxrec.runtime.device_ints.kept_ints_on``), off: sent every call;
* ``views``: the packed offsets' views of the kept starts are kept with them
  (``fxrec.runtime.device_ints.kept_split_on``) and the offsets are viewed as ``[F, B]`` in one
  op, five tensor ops where there were nine; off: :func:`offsets_with_view_ops`, as it was;
* ``checker``: the device's bounds check calls fbgemm's operator looked up once
  (``fxrec.runtime.kernels.fbgemm_ops.bounds_checker``), off: ``bounds_check``, which imports and
  looks it up at each call;
* ``hostview``: the device check's count is read on the host through a NumPy view made once
  (``DeviceBoundsCheck._host_values``), off: ``Tensor.numpy()`` at each read (a detach dispatched);
* ``isparam``: a fused group's check that its tables are the model's parameters reads their types
  by a C-level map (``FusedUpdates._check_fused``), off: Parameter's ``isinstance`` per table.

``--clock thread`` times the host's work by the thread's CPU time instead of the wall clock (on a
machine other processes share, time spent descheduled is left out; on CPU only).

``--sync-free`` (CPU) runs the groups as they run on CUDA (``fxrec.runtime._tracing.sync_free``:
no value read on the host, the bounds check on the device), so the host's work is CUDA's but
for the kernel launches themselves.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import contextlib
from contextlib import contextmanager

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fxrec  # noqa: E402
import fxrec.codegen as codegen  # noqa: E402
from benchmarks.bench_gpu import SHAPES, PlainBags, inputs  # noqa: E402
from fxrec.runtime import device_ints, packing  # noqa: E402
from fxrec.runtime._tracing import sync_free  # noqa: E402


CLOCK = [time.perf_counter]
CALLS = [20]


def host_ms(fn, device, calls=None) -> float:
    calls = calls or CALLS[0]
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    clock = CLOCK[0]
    t = clock()
    for _ in range(calls):
        fn()
    ms = (clock() - t) / calls * 1e3
    if device.type == "cuda":
        torch.cuda.synchronize()
    return ms


def one_line_per_input(guards):
    """The input size check as it was written before the C-level reads (``--ab guards``' off
    form): a few generated lines per input, reading each one's ``.shape``."""
    from fxrec.runtime.input_guards import _namespace

    assert not guards.values, "bench_host: the benchmark's models have no inputs that are not tensors"
    bound = guards._symbol_sources()
    lines = ["def _check(" + ", ".join(f"a{k}" for k in range(len(guards.paths))) + "):"]
    for k, shape in enumerate(guards.shapes):
        lines += [f"    t{k} = a{k}.shape", f"    if len(t{k}) != {len(shape)}: return False"]
        for d, sym in enumerate(shape):
            if isinstance(sym, int):
                lines.append(f"    if t{k}[{d}] != {sym}: return False")
            elif sym is not None:
                first = bound.get(sym) == f"a{k}.size({d})"
                lines.append(f"    {sym} = t{k}[{d}]" if first else f"    if t{k}[{d}] != ({sym}): return False")
    for sym, (lo, hi) in sorted(guards.ranges.items()):
        if sym in bound and lo > 0:
            lines.append(f"    if {sym} < {lo}: return False")
        if sym in bound and hi is not None:
            lines.append(f"    if {sym} > {hi}: return False")
    lines += [f"    if not ({c}): return False" for c in guards.conditions if not guards._implied(c)]
    ns = _namespace()
    exec("\n".join(lines + ["    return True"]), ns)  # noqa: S102 - the benchmark's own code
    return ns["_check"]


def offsets_with_view_ops(starts, batch, bases, total):
    """``fxrec.runtime.packing._offsets_at_once`` as it was before ``views`` (``--ab views``' off
    form): the kept starts sliced and viewed, and the offsets sliced and viewed, at each call."""
    dev = starts[0].device
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        unshifted = torch.cat(starts).view(len(starts), batch)
        return packing._offsets_one_by_one(list(unshifted.unbind(0)), bases, total), unshifted[:, 0]
    shift = device_ints.kept_ints_on(bases + [total], dev)
    offsets = torch.cat(starts + [shift[-1:]])
    grid = offsets[:-1].view(len(starts), batch)
    firsts = grid[:, 0].clone()
    grid.add_(shift[:-1].view(-1, 1))
    return offsets, firsts


def check_fused_by_isinstance(self, params) -> None:
    """``FusedUpdates._check_fused`` (runtime/group_fused.py) as it was before ``isparam`` (its off form): Parameter's
    ``isinstance`` for every table (the other checks as they are; none fails in the benchmark)."""
    from fxrec.runtime.group_fused import _LOWER, DistributedDataParallel, _is_leaf, _syncs_any

    if not all(map(_is_leaf, params)):
        raise AssertionError("bench_host: computed tables")
    if not all(isinstance(p, torch.nn.Parameter) for p in params):
        raise AssertionError("bench_host: not parameters")
    if params and params[0].dtype in _LOWER and not self.half and not self.weights:
        raise AssertionError("bench_host: fp16 tables")
    ddp = DistributedDataParallel._active_ddp_module
    if ddp is not None and ddp.process_group.size() > 1 and _syncs_any(ddp, params):
        raise AssertionError("bench_host: DDP")


@contextmanager
def _recompiled_with(models, rewrite, leaves_out: str):
    """The models' code regenerated with ``rewrite`` in place of fxrec's ``_fast_attr_lines``
    (their code then has no ``leaves_out``), and regenerated again as it was afterwards."""
    fast = codegen._fast_attr_lines
    codegen._fast_attr_lines = lambda src, nodes, root, fn="fxrec_attr", fn_many="": rewrite(fast, src, nodes, root, fn)
    try:
        for m in models:
            m.recompile()
            assert leaves_out not in m.code
        yield
    finally:
        codegen._fast_attr_lines = fast
        for m in models:
            m.recompile()


@contextmanager
def turned_off(change: str, models):
    """The models as they were before ``change`` (``a+b``: before both)."""
    if "+" in change:
        with contextlib.ExitStack() as stack:
            for one in change.split("+"):
                stack.enter_context(turned_off(one, models))
            yield
        return
    if change == "attr":  # fx's getattr chain
        with _recompiled_with(models, lambda fast, src, *rest: src, "fxrec_attr("):
            yield
    elif change == "attrs":  # fxrec_attr, one call a read
        with _recompiled_with(models, lambda fast, src, nodes, root, fn: fast(src, nodes, root, fn), "fxrec_attrs("):
            yield
    elif change == "guards":
        checks = [m.fxrec_check_inputs for m in models]
        fns = [g._fn for g in checks]
        try:
            for g in checks:
                g._fn = one_line_per_input(g)
            yield
        finally:
            for g, fn in zip(checks, fns):
                g._fn = fn
    elif change == "packing":
        uniform = packing._pack_uniform
        packing._pack_uniform = lambda *args: None
        try:
            yield
        finally:
            packing._pack_uniform = uniform
    elif change == "bases":
        kept = device_ints.KEEP
        device_ints.KEEP = 0
        device_ints.KEPT.clear()
        try:
            yield
        finally:
            device_ints.KEEP = kept
    elif change == "views":
        at_once = packing._offsets_at_once
        packing._offsets_at_once = offsets_with_view_ops
        try:
            yield
        finally:
            packing._offsets_at_once = at_once
    elif change == "checker":
        from fxrec.runtime.kernels.fbgemm_ops import bounds_check

        states = [s for m in models for s in (g.__dict__.get("_device_bounds") for g in m.modules()) if s is not None]
        assert states, "bench_host: no device check to turn off (run with --sync-free, or on CUDA)"
        checkers = [s._bounds_check for s in states]
        try:
            for s in states:
                s._bounds_check = bounds_check
            yield
        finally:
            for s, c in zip(states, checkers):
                s._bounds_check = c
    elif change == "hostview":
        states = [s for m in models for s in (g.__dict__.get("_device_bounds") for g in m.modules()) if s is not None]
        assert states, "bench_host: no device check to turn off (run with --sync-free, or on CUDA)"

        class EachRead:  # the count read as before: Tensor.numpy() at each read
            def __init__(self, state):
                self.state = state

            def __getitem__(self, i):
                return self.state.host.numpy()[i]

        views = [s._host_values for s in states]
        try:
            for s in states:
                s._host_values = EachRead(s)
            yield
        finally:
            for s, v in zip(states, views):
                s._host_values = v
    elif change == "isparam":
        from fxrec.runtime.group import EmbeddingGroup

        fast = EmbeddingGroup._check_fused
        EmbeddingGroup._check_fused = check_fused_by_isinstance
        try:
            yield
        finally:
            EmbeddingGroup._check_fused = fast
    else:
        raise ValueError(f"bench_host: no change called {change!r}")


def bench_shape(cfg, device, rounds, changes, backend):
    torch.manual_seed(0)
    with torch.device(device):
        plain = PlainBags(cfg["tables"], cfg["rows"], cfg["dim"], sparse=True)
    x = inputs(cfg, device, 0)
    fwd = fxrec.transform(plain, x, backend=backend)
    sgd = fxrec.transform(plain, x, optimizer=fxrec.optim.SGD(lr=0.01), backend=backend)
    kernels = {g.kernel_train for g in fwd.report.groups} | {g.kernel_train for g in sgd.report.groups}

    def forward():
        with torch.no_grad():
            fwd(*x)

    def step():
        sgd(*x).sum().backward()

    out = {"config": cfg, "kernels": sorted(kernels)}
    for _ in range(2):  # warm up (fbgemm's first calls, the allocators) before the first change's rounds
        host_ms(forward, device)
        host_ms(step, device)
    for change in changes:
        times = {f"{k}_{form}_host_ms": [] for k in ("forward", "sgd_step") for form in ("on", "off")}
        for _ in range(rounds):
            for form in ("on", "off"):
                if form == "on":
                    times["forward_on_host_ms"].append(host_ms(forward, device))
                    times["sgd_step_on_host_ms"].append(host_ms(step, device))
                    continue
                with turned_off(change, (fwd, sgd)):
                    times["forward_off_host_ms"].append(host_ms(forward, device))
                    times["sgd_step_off_host_ms"].append(host_ms(step, device))
        out[change] = {k: statistics.median(v) for k, v in times.items()}
        for k in ("forward", "sgd_step"):  # the median of each round's own difference (robust to drift)
            diffs = [off - on for on, off in zip(times[f"{k}_on_host_ms"], times[f"{k}_off_host_ms"])]
            out[change][f"{k}_saved_ms"] = statistics.median(diffs)
            # how often the change was faster in a round (0.5: no difference the rounds can tell)
            out[change][f"{k}_rounds_faster"] = sum(d > 0 for d in diffs) / len(diffs)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--shapes", default="small512,onehot26")
    ap.add_argument("--ab", default=None,
                    help="the changes to turn off and on, comma-separated (a+b: both off together); default: every "
                         "one (checker and hostview only where the groups check on the device: CUDA, or --sync-free)")
    ap.add_argument("--backend", default="fbgemm")
    ap.add_argument("--scale", type=int, default=1, help="divide every shape's rows (and batch) by this")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch's intra-op threads (0: torch's default); on CPU 1 keeps the kernels' own "
                         "threads from adding noise to the host times")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="wall: perf_counter; thread: the thread's CPU time (CPU only: leaves out time descheduled)")
    ap.add_argument("--calls", type=int, default=20, help="calls timed per round and form")
    ap.add_argument("--sync-free", action="store_true",
                    help="on CPU, run the groups as on CUDA (nothing read on the host; the bounds check on the device)")
    a = ap.parse_args()
    if a.sync_free and a.device != "cpu":
        sys.exit("bench_host: --sync-free is for --device cpu (on CUDA the groups run so anyway)")
    if a.clock == "thread":
        if a.device != "cpu":
            sys.exit("bench_host: --clock thread is for --device cpu (on CUDA the host's time includes its waits)")
        CLOCK[0] = time.thread_time
    CALLS[0] = a.calls
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_host: no CUDA device here")
    if a.ab is None:
        a.ab = "attr,attrs,guards,packing,bases,views,isparam" + (
            ",checker,hostview" if device.type == "cuda" or a.sync_free else "")
    changes = a.ab.split(",")
    result = {"what": "host ms per queued call, each change on and off (off: the model without that change only)",
              "command": "python3 " + " ".join(sys.argv),
              "machine": {"platform": platform.platform(), "python": platform.python_version(),
                          "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
              "versions": {"torch": torch.__version__, "fxrec": fxrec.__version__}, "rounds": a.rounds,
              "threads": torch.get_num_threads(), "sync_free": a.sync_free, "clock": a.clock, "calls": a.calls,
              "shapes": {}}
    for name in a.shapes.split(","):
        cfg = dict(SHAPES[name])
        cfg["rows"] = max(1, cfg["rows"] // a.scale)
        cfg["batch"] = max(2, cfg["batch"] // a.scale)
        with sync_free() if a.sync_free else contextlib.nullcontext():
            result["shapes"][name] = r = bench_shape(cfg, device, a.rounds, changes, a.backend)
        for change in changes:
            print(name, change, {k: round(v, 3) for k, v in r[change].items()}, flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
