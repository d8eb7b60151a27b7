"""How long fxrec.transform takes against TorchRec's set-up of the same tables, and how much memory
a transform takes beyond the model itself. Writes JSON.

    make bench-transform            # or: .venv/bin/python benchmarks/bench_transform.py [--out FILE]
                                    #     [--rounds N] [--skip-torchrec] [--skip-memory]

1. Transform time. On the three shapes of bench_lookups.py (same SHAPES, PlainBags, inputs):
   ``fxrec.transform(plain, example, optimizer=fxrec.optim.SGD(lr=0.01))`` (every other argument
   at its default) against TorchRec's set-up of the same tables, timed from the plain module to a
   ready model: an EmbeddingBagCollection of the same tables built on the meta device (TorchRec's
   usual way), fused SGD lr 0.01 via ``apply_optimizer_in_backward``, ``DistributedModelParallel``
   on a 1-rank gloo process group on CPU (its planner, sharding and the fbgemm TBE it allocates),
   then the plain module's weights loaded with ``load_state_dict``; the process group is made
   once, before any timing. One untimed warm-up of each first (fxrec builds its C++ kernel once
   per machine and caches it; TorchRec imports and plans lazily), whose models are checked: both
   give the plain model's output, and one training step (fused SGD inside backward) gives both
   the same updated table. Then ``--rounds`` rounds, the two in turn (the order swapped every
   round), each model freed before the next; medians reported, ratio = fxrec / torchrec.

2. Peak memory of transform. A model of 2 GB of tables (26 nn.EmbeddingBag of 300_000 x 64 fp32)
   and a small MLP on their pooled outputs, transformed with ``optimizer=fxrec.optim.SGD(lr=0.01)``:
   default arguments, ``copy_model=False`` (the model is handed over), ``backend="fbgemm"`` and,
   for reference, TorchRec's set-up of (1). Each case in a fresh subprocess: build the model,
   read the resident set size (RSS), reset the kernel's peak (VmHWM, by writing 5 to
   /proc/self/clear_refs) and sample RSS every 2 ms in a thread, transform, take the larger of the
   two peaks. Reported: table bytes, RSS before, peak during, (peak - before) / table bytes, RSS
   after, RSS after the original model is dropped, transform seconds, and whether the transformed
   model gives the output the model gave before the transform.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from types import SimpleNamespace

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import fxrec  # noqa: E402
from benchmarks.bench_lookups import SHAPES, PlainBags, inputs  # noqa: E402

MEMORY_CFG = dict(tables=26, rows=300_000, dim=64, batch=2048, ids_per_bag=1, mlp_hidden=256)
MEMORY_CASES = {
    "fxrec_default": dict(),
    "fxrec_copy_model_false": dict(copy_model=False),
    "fxrec_fbgemm": dict(backend="fbgemm"),
    "fxrec_fbgemm_copy_model_false": dict(backend="fbgemm", copy_model=False),
    "torchrec_dmp": None,  # reference: TorchRec's set-up of the same tables (as in part 1)
}


# ------------------------------------------------------------------------------------------ TorchRec


def load_torchrec():
    """The TorchRec pieces the set-up uses, or (None, the import error)."""
    try:
        import torchrec
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    except Exception as e:  # noqa: BLE001 - any import failure is reported, the fxrec side goes on
        return None, f"{type(e).__name__}: {e}"
    return SimpleNamespace(
        version=getattr(torchrec, "__version__", "?"), EmbeddingBagCollection=EmbeddingBagCollection,
        EmbeddingBagConfig=EmbeddingBagConfig, KeyedJaggedTensor=KeyedJaggedTensor, PoolingType=PoolingType,
        DistributedModelParallel=DistributedModelParallel, apply_optimizer_in_backward=apply_optimizer_in_backward,
    ), None


def init_gloo() -> None:
    """A 1-rank gloo process group on a free local port (once per process)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)


def torchrec_setup(tr, bags, parts=None):
    """TorchRec's set-up of ``bags`` (a list of nn.EmbeddingBag, mode sum): EBC on meta, fused SGD
    lr 0.01 applied in backward, DMP on CPU, the plain weights loaded. ``parts``: a dict that gets
    the seconds of each step."""
    t0 = time.perf_counter()
    tables = [
        tr.EmbeddingBagConfig(name=f"t{i}", embedding_dim=b.embedding_dim, num_embeddings=b.num_embeddings,
                              feature_names=[f"f{i}"], pooling=tr.PoolingType.SUM)
        for i, b in enumerate(bags)
    ]
    ebc = tr.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    tr.apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.01})
    t1 = time.perf_counter()
    dmp = tr.DistributedModelParallel(ebc, device=torch.device("cpu"))
    t2 = time.perf_counter()
    dmp.load_state_dict({f"embedding_bags.t{i}.weight": b.weight.detach() for i, b in enumerate(bags)}, strict=False)
    t3 = time.perf_counter()
    if parts is not None:
        parts.update(ebc_on_meta_and_optimizer=t1 - t0, dmp=t2 - t1, load_plain_weights=t3 - t2)
    return dmp


def to_kjt(tr, ids, offsets):
    lengths = torch.cat([torch.diff(o, append=torch.tensor([len(i)])) for i, o in zip(ids, offsets)])
    return tr.KeyedJaggedTensor.from_lengths_sync(keys=[f"f{k}" for k in range(len(ids))], values=torch.cat(ids),
                                                  lengths=lengths)


def torchrec_forward(tr, dmp, ids, offsets):
    out = dmp(to_kjt(tr, ids, offsets))
    out = out.wait() if hasattr(out, "wait") else out
    return out.values()


def torchrec_table(dmp, i):
    w = dmp.state_dict()[f"embedding_bags.t{i}.weight"]
    return w.local_shards()[0].tensor if hasattr(w, "local_shards") else w


# ------------------------------------------------------------------------------------ part 1: time


def fxrec_cache_state():
    d = os.environ.get("FXREC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "fxrec")
    try:
        libs = sorted(f for f in os.listdir(d) if f.endswith(".so"))
    except OSError:
        libs = []
    return {"dir": d, "kernel_libraries": libs}


def group_choice(gm):
    try:
        g = gm.report.groups[0]
        return {"lowered": g.lowered,
                "train": g.kernel_train,
                "inference": g.kernel_eval, "why": g.why}
    except Exception as e:  # noqa: BLE001 - the report's layout is not what is measured
        return {"error": f"{type(e).__name__}: {e}"}


def checks(name, cfg, plain, gm, dmp, tr):
    """The warm-up models: outputs equal to the plain model's, one fused-SGD step gives the same
    table in both. Errors are recorded, not raised."""
    res = {}
    batch = inputs(cfg["tables"], cfg["rows"], cfg["batch"], cfg["ids_per_bag"], seed=1)
    with torch.no_grad():
        ref = plain(*batch)
    try:
        torch.testing.assert_close(gm(*batch), ref)
        res["fxrec_output_equals_plain"] = True
    except Exception as e:  # noqa: BLE001
        res["fxrec_output_equals_plain"] = f"{type(e).__name__}: {e}"
    if dmp is None:
        return res
    try:
        torch.testing.assert_close(torchrec_forward(tr, dmp, *batch), ref)
        res["torchrec_output_equals_plain"] = True
    except Exception as e:  # noqa: BLE001
        res["torchrec_output_equals_plain"] = f"{type(e).__name__}: {e}"
    try:
        cot = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
        (gm(*batch) * cot).sum().backward()
        (torchrec_forward(tr, dmp, *batch) * cot).sum().backward()
        a = gm.state_dict()["bags.0.weight"]
        b = torchrec_table(dmp, 0)
        moved = (a - plain.bags[0].weight.detach()).abs().max().item()
        res["one_sgd_step_table0"] = {"max_abs_diff_fxrec_vs_torchrec": (a - b).abs().max().item(),
                                      "max_abs_change_from_plain": moved}
    except Exception as e:  # noqa: BLE001
        res["one_sgd_step_table0"] = f"{type(e).__name__}: {e}"
    return res


def time_shape(name, cfg, rounds, tr):
    torch.manual_seed(0)
    plain = PlainBags(cfg["tables"], cfg["rows"], cfg["dim"])
    example = inputs(cfg["tables"], cfg["rows"], cfg["batch"], cfg["ids_per_bag"], seed=0)

    def run_fxrec():
        return fxrec.transform(plain, example, optimizer=fxrec.optim.SGD(lr=0.01))

    def run_torchrec():
        return torchrec_setup(tr, list(plain.bags))

    fns = {"fxrec": run_fxrec}
    if tr is not None:
        fns["torchrec"] = run_torchrec
    out = {"config": cfg, "warmup_seconds": {}}
    t = time.perf_counter()
    gm = run_fxrec()
    out["warmup_seconds"]["fxrec"] = time.perf_counter() - t
    out["fxrec_choice"] = group_choice(gm)
    dmp = None
    if tr is not None:
        parts = {}
        t = time.perf_counter()
        dmp = torchrec_setup(tr, list(plain.bags), parts)
        out["warmup_seconds"]["torchrec"] = time.perf_counter() - t
        out["torchrec_warmup_parts_seconds"] = parts
        try:
            out["torchrec_plan"] = {k: {"sharding": v.sharding_type, "kernel": v.compute_kernel}
                                    for k, v in list(dmp.plan.plan[""].items())[:1]}
        except Exception:  # noqa: BLE001
            pass
    out["checks"] = checks(name, cfg, plain, gm, dmp, tr)
    del gm, dmp
    gc.collect()
    times = {k: [] for k in fns}
    for r in range(rounds):
        order = list(fns) if r % 2 == 0 else list(reversed(fns))
        for k in order:
            gc.collect()
            t = time.perf_counter()
            m = fns[k]()
            times[k].append(time.perf_counter() - t)
            del m
    out["seconds"] = times
    out["median_seconds"] = {k: statistics.median(v) for k, v in times.items()}
    if "torchrec" in times:
        out["ratio_fxrec_over_torchrec"] = out["median_seconds"]["fxrec"] / out["median_seconds"]["torchrec"]
    return out


# ---------------------------------------------------------------------------------- part 2: memory


class BigModel(nn.Module):
    """26 tables of 300_000 x 64 (2 GB fp32), pooled by sum, and a small MLP on the pooled outputs."""

    def __init__(self, tables, rows, dim, mlp_hidden, **_):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(tables)])
        self.mlp = nn.Sequential(nn.Linear(tables * dim, mlp_hidden), nn.ReLU(), nn.Linear(mlp_hidden, 1))

    def forward(self, ids, offsets):
        return self.mlp(torch.cat([b(i, o) for b, i, o in zip(self.bags, ids, offsets)], 1))


PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * PAGE


def hwm_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return -1


def reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


class Sampler(threading.Thread):
    def __init__(self, every_s=0.002):
        super().__init__(daemon=True)
        self.every, self.peak, self.stop_flag, self.samples = every_s, rss_bytes(), False, 0

    def run(self):
        while not self.stop_flag:
            self.peak = max(self.peak, rss_bytes())
            self.samples += 1
            time.sleep(self.every)


def memory_case(case: str) -> dict:
    """One case, in this (fresh) process; the result is printed as the last line of stdout."""
    cfg = MEMORY_CFG
    kw = MEMORY_CASES[case]
    res = {"case": case}
    tr = None
    if kw is None:
        tr, err = load_torchrec()
        if tr is None:
            return {"case": case, "error": err}
        init_gloo()
    else:
        res["transform_kwargs"] = {"optimizer": "fxrec.optim.SGD(lr=0.01)", **kw}
    torch.manual_seed(0)
    model = BigModel(**cfg)
    example = inputs(cfg["tables"], cfg["rows"], cfg["batch"], cfg["ids_per_bag"], seed=0)
    batch = inputs(cfg["tables"], cfg["rows"], cfg["batch"], cfg["ids_per_bag"], seed=1)
    with torch.no_grad():  # the answer the transformed model must give (the model may be handed over)
        ref = torch.cat([b(i, o) for b, i, o in zip(model.bags, *batch)], 1) if tr else model(*batch)
    res["table_bytes"] = sum(b.weight.numel() * b.weight.element_size() for b in model.bags)
    res["model_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    gc.collect()
    before = rss_bytes()
    res["hwm_reset"] = reset_hwm()
    sampler = Sampler()
    sampler.start()
    t = time.perf_counter()
    try:
        if tr is None:
            new = fxrec.transform(model, example, optimizer=fxrec.optim.SGD(lr=0.01), **kw)
        else:
            new = torchrec_setup(tr, list(model.bags))
    except TypeError as e:
        sampler.stop_flag = True
        return {**res, "error": f"TypeError: {e}"}
    seconds = time.perf_counter() - t
    sampler.stop_flag = True
    sampler.join()
    hwm = hwm_bytes() if res["hwm_reset"] else -1
    peak = max(hwm, sampler.peak)
    after = rss_bytes()
    del model
    gc.collect()
    after_release = rss_bytes()
    with torch.no_grad():
        got = torchrec_forward(tr, new, *batch) if tr else new(*batch)
    res.update(
        rss_before=before, rss_peak=peak, rss_peak_vmhwm=hwm, rss_peak_sampled=sampler.peak, samples=sampler.samples,
        rss_after=after, rss_after_original_dropped=after_release,
        peak_beyond_model_over_table_bytes=(peak - before) / res["table_bytes"],
        after_beyond_model_over_table_bytes=(after - before) / res["table_bytes"],
        after_original_dropped_beyond_model_over_table_bytes=(after_release - before) / res["table_bytes"],
        transform_seconds=seconds,
        output_equals_before=bool(torch.allclose(got, ref, rtol=1.3e-6, atol=1e-5)),
    )
    if tr is None:
        res["choice"] = group_choice(new)
    return res


def run_memory_case(case: str, timeout_s: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-case", case]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"case": case, "error": f"timed out after {timeout_s} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"case": case, "error": f"exit {p.returncode}", "stderr_tail": p.stderr[-3000:]}
    return json.loads(lines[-1])


# -------------------------------------------------------------------------------------------- main


def gib(b):
    return b / 2**30


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "cpu_transform.json"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--skip-torchrec", action="store_true", help="time fxrec only")
    ap.add_argument("--skip-memory", action="store_true", help="skip the 2 GB peak-memory part")
    ap.add_argument("--memory-cases", default=",".join(MEMORY_CASES))
    ap.add_argument("--memory-timeout", type=int, default=1800, help="seconds per memory case")
    ap.add_argument("--memory-case", help=argparse.SUPPRESS)  # internal: one case, in a subprocess
    a = ap.parse_args()
    if a.memory_case:
        try:
            res = memory_case(a.memory_case)
        except Exception as e:  # noqa: BLE001
            res = {"case": a.memory_case, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        print(json.dumps(res), flush=True)
        return

    import fbgemm_gpu  # noqa: F401

    tr, tr_error = (None, "skipped (--skip-torchrec)") if a.skip_torchrec else load_torchrec()
    versions = {"torch": torch.__version__, "fbgemm_gpu": getattr(sys.modules["fbgemm_gpu"], "__version__", "?"),
                "fxrec": fxrec.__version__, "torchrec": tr.version if tr else None, "python": platform.python_version()}
    try:
        import tensordict

        versions["tensordict"] = tensordict.__version__
    except Exception:  # noqa: BLE001
        pass
    result = {
        "what": "time of fxrec.transform(plain, example, optimizer=fxrec.optim.SGD(lr=0.01)) vs TorchRec's set-up of "
                "the same tables (EBC on meta + apply_optimizer_in_backward(SGD, lr=0.01) + DistributedModelParallel "
                "on a 1-rank gloo group on CPU + the plain weights loaded), medians of alternating runs in one process "
                "after one untimed warm-up of each; and peak resident memory of a transform of 2 GB of tables beyond "
                "the model itself, one fresh subprocess per case",
        "command": shlex.join([os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(ROOT) else sys.executable]
                              + sys.argv),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "memory_gib": round(os.sysconf("SC_PHYS_PAGES") * PAGE / 2**30, 1), "device": "cpu",
                    "loadavg_at_start": os.getloadavg()},
        "versions": versions,
        "rounds": a.rounds,
    }
    if tr is None:
        result["torchrec_unavailable"] = tr_error
    else:
        result["torchrec_install"] = ("pip install -e '.[cpu,bench]' then pip install --no-deps torchrec==1.8.0 "
                                      "(torchrec's own requirement 'fbgemm-gpu' would pull the CUDA build over "
                                      "fbgemm-gpu-cpu)")
        init_gloo()
    result["fxrec_kernel_cache_before_warmup"] = fxrec_cache_state()
    result["fxrec_kernel_build"] = ("fxrec's C++ kernel is built once per machine and cached (the "
                                    "fxrec_kernel_cache_* entries); the untimed warm-up loads or builds it, so no timed run includes a build")
    result["transform_time"] = {}
    for name in a.shapes.split(","):
        r = time_shape(name, SHAPES[name], a.rounds, tr)
        result["transform_time"][name] = r
        med = r["median_seconds"]
        print(f"{name:11s} transform s (median of {a.rounds}): " + ", ".join(f"{k} {v:.2f}" for k, v in med.items())
              + (f" | fxrec/torchrec {r['ratio_fxrec_over_torchrec']:.2f}x" if "ratio_fxrec_over_torchrec" in r else "")
              + f" | checks {r['checks']}", flush=True)
    result["fxrec_kernel_cache_after"] = fxrec_cache_state()
    if not a.skip_memory:
        result["memory"] = {"config": MEMORY_CFG, "cases": {}}
        for case in a.memory_cases.split(","):
            if case == "torchrec_dmp" and tr is None:
                continue
            r = run_memory_case(case, a.memory_timeout)
            result["memory"]["cases"][case] = r
            if "error" in r:
                print(f"memory {case}: ERROR {r['error']}", flush=True)
            else:
                print(f"memory {case}: tables {gib(r['table_bytes']):.2f} GiB, RSS before {gib(r['rss_before']):.2f} GiB, "
                      f"peak {gib(r['rss_peak']):.2f} GiB -> (peak-before)/tables "
                      f"{r['peak_beyond_model_over_table_bytes']:.2f}x, after (original dropped) "
                      f"{r['after_original_dropped_beyond_model_over_table_bytes']:.2f}x, {r['transform_seconds']:.1f} s, "
                      f"output ok {r['output_equals_before']}", flush=True)
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
