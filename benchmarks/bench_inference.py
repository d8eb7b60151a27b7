"""Inference latency and model bytes: plain fp32 model vs fxrec fp32 / fp16 / int8 / int4. JSON.

    .venv/bin/python benchmarks/bench_inference.py [--out FILE] [--rounds N]

Same shapes and plain model as bench_lookups.py, in eval mode under no_grad. "fxrec_auto" is
transform(mode="inference") without quantization (kernel by the rule table); the others
are transform(mode="inference", quantize=dtype) on fbgemm's IntNBit TBE; "tbe_<dtype>" is that
TBE written by hand over the same tables (``benchmarks.bench_gpu.hand_written_nbit``: fbgemm's
own quantization and defaults, its bounds check included), fed ids and offsets packed
beforehand, so ``fxrec_over_tbe`` is the cost of what fxrec does for the user (its outputs are
checked equal to fxrec's to the last bit). Bytes are the
embedding storage (fp32 tables for plain, stored quantized bytes from the report otherwise).
Alternating runs in one process, medians; speed-up = plain / variant.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fxrec  # noqa: E402
from benchmarks.bench_gpu import hand_written_nbit, packed  # noqa: E402
from benchmarks.bench_lookups import SHAPES, PlainBags, inputs, median_ms  # noqa: E402


#: bench_lookups' shapes, and onehot26 at a serving batch (64 requests), where the host's work
#: around the lookup shows
INFERENCE_SHAPES = {**SHAPES, "onehot26_b64": {**SHAPES["onehot26"], "batch": 64}}
#: the dtypes quantized by fxrec, and by fbgemm's TBE written by hand
DTYPES = ("fp32", "fp16", "int8", "int4")


def bench(shape, rounds):
    cfg = INFERENCE_SHAPES[shape]
    torch.manual_seed(0)
    plain = PlainBags(cfg["tables"], cfg["rows"], cfg["dim"]).eval()
    example = inputs(cfg["tables"], cfg["rows"], cfg["batch"], cfg["ids_per_bag"], seed=0)
    models = {"plain": plain, "fxrec_auto": fxrec.transform(plain, example, mode="inference")}
    for dt in DTYPES:
        models[f"fxrec_{dt}"] = fxrec.transform(plain, example, mode="inference", quantize=dt)
    batch = inputs(cfg["tables"], cfg["rows"], cfg["batch"], cfg["ids_per_bag"], seed=1)
    flat = packed(*batch)
    hand = {dt: hand_written_nbit(plain, cfg, torch.device("cpu"), dt) for dt in DTYPES}
    with torch.no_grad():
        ref = plain(*batch)
        err = {k: float((m(*batch) - ref).abs().max()) for k, m in models.items()}
        for dt, tbe in hand.items():  # the same rows, quantized alike, through the same operator
            torch.testing.assert_close(tbe(*flat), models[f"fxrec_{dt}"](*batch), rtol=0, atol=0,
                                       msg=f"{shape}: fbgemm's {dt} TBE by hand differs from fxrec's {dt} model")
        fns = {k: (lambda m=m: m(*batch)) for k, m in models.items()}
        fns.update({f"tbe_{dt}": (lambda t=tbe: t(*flat)) for dt, tbe in hand.items()})
        ms = median_ms(fns, rounds)
    fp32_bytes = cfg["tables"] * cfg["rows"] * cfg["dim"] * 4
    nbytes = {"plain": fp32_bytes, "fxrec_auto": fp32_bytes}
    for k, m in models.items():
        if m is not plain and m.report.quantization:
            nbytes[k] = sum(q.bytes_stored for q in m.report.quantization)
    return {
        "config": cfg,
        "forward_ms": ms,
        "speedup_vs_plain": {k: ms["plain"] / v for k, v in ms.items() if k != "plain"},
        "fxrec_over_tbe": {dt: ms[f"fxrec_{dt}"] / ms[f"tbe_{dt}"] for dt in hand},
        "embedding_bytes": nbytes,
        "bytes_vs_fp32": {k: v / fp32_bytes for k, v in nbytes.items()},
        "max_abs_diff_vs_plain": err,
        "auto_choice": [{"group": g.name, "inference": g.kernel_eval, "lowered": g.lowered, "why": g.why}
                        for g in models["fxrec_auto"].report.groups],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu_inference.json"))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--shapes", default=",".join(INFERENCE_SHAPES))
    a = ap.parse_args()
    import fbgemm_gpu

    result = {
        "what": "eval forward under no_grad: plain fp32 model vs fxrec inference (fp32 auto, quantized fp32/fp16/int8/int4)",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "versions": {"torch": torch.__version__, "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "?"), "fxrec": fxrec.__version__},
        "rounds": a.rounds,
        "shapes": {},
    }
    for shape in a.shapes.split(","):
        r = bench(shape, a.rounds)
        result["shapes"][shape] = r
        print(f"{shape:11s} ms: " + ", ".join(f"{k} {v:.2f}" for k, v in r["forward_ms"].items()), flush=True)
        print(f"{'':11s} fxrec / TBE by hand: " + ", ".join(f"{k} {v:.2f}x" for k, v in r["fxrec_over_tbe"].items()), flush=True)
        print(f"{'':11s} speed-up: " + ", ".join(f"{k} {v:.2f}x" for k, v in r["speedup_vs_plain"].items())
              + " | bytes: " + ", ".join(f"{k} {v:.0%}" for k, v in r["bytes_vs_fp32"].items()), flush=True)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
