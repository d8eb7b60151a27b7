"""benchmarks/bench_gpu.py (``make bench-gpu``) runs end to end: on CPU, on a shape scaled down, it
checks each fxrec variant against the plain model and writes its JSON (the GPU figures come from
the same code with --device cuda)."""

import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(os.path.dirname(HERE), "benchmarks", "bench_gpu.py")


def test_the_gpu_benchmark_runs_on_cpu_scaled_down_and_writes_its_figures(tmp_path):
    out = tmp_path / "gpu.json"
    r = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--scale", "2000", "--rounds", "2",
                        "--shapes", "onehot26", "--no-compile", "--queue", "2", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    shape = result["shapes"]["onehot26"]
    assert shape["config"]["rows"] == 500 and result["machine"]["device"] == "cpu"
    # no CUDA graph, not compiled; fbgemm's int8 TBE by hand beside fxrec's int8 model (their outputs
    # checked equal in the script, which would have exited non-zero)
    assert set(shape["forward_ms"]) == {"plain", "tbe", "fxrec", "tbe_int8", "fxrec_int8"}
    assert set(shape["fxrec_over_tbe"]) == {"forward", "forward_int8", "train_sgd", "train_rowwise_adagrad"}
    assert shape["fxrec_over_tbe"]["forward_int8"] == shape["forward_ms"]["fxrec_int8"] / shape["forward_ms"]["tbe_int8"]
    assert set(shape["train_step_ms"]) == {"sgd", "rowwise_adagrad"}
    assert all(set(t) == {"plain", "tbe", "fxrec"} for t in shape["train_step_ms"].values())
    times = list(shape["forward_ms"].values()) + [v for t in shape["train_step_ms"].values() for v in t.values()]
    assert all(v > 0 for v in times)
    assert set(shape["forward_ms_queued"]) == set(shape["forward_ms"]) and set(shape["train_step_ms_queued"]) == {
        "sgd", "rowwise_adagrad"}
    # the host's share: on CPU the whole call, so the same median as the queued timing
    assert shape["forward_host_ms_queued"] == shape["forward_ms_queued"]
    assert shape["train_step_host_ms_queued"] == shape["train_step_ms_queued"]
    assert result["copy_bytes_per_s"] is None and "forward_read_fraction_of_copy" not in shape  # CUDA only
    assert 0 < shape["int8_max_abs_error"] < 0.1
    assert shape["transform_peak_bytes_over_tables"] is None  # measured on CUDA only


def test_the_inference_benchmark_times_fxrec_beside_fbgemms_tbe_by_hand(tmp_path):
    out = tmp_path / "inference.json"
    script = os.path.join(os.path.dirname(HERE), "benchmarks", "bench_inference.py")
    r = subprocess.run([sys.executable, script, "--rounds", "1", "--shapes", "onehot26_b64", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    shape = json.loads(out.read_text())["shapes"]["onehot26_b64"]
    assert shape["config"]["batch"] == 64
    dtypes = ("fp32", "fp16", "int8", "int4")
    assert set(shape["forward_ms"]) == {"plain", "fxrec_auto"} | {f"{p}_{d}" for p in ("fxrec", "tbe") for d in dtypes}
    assert all(v > 0 for v in shape["forward_ms"].values())
    assert set(shape["fxrec_over_tbe"]) == set(dtypes)
    assert shape["max_abs_diff_vs_plain"]["fxrec_fp32"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="there is a GPU here")
def test_without_a_gpu_the_benchmark_says_so():
    r = subprocess.run([sys.executable, SCRIPT, "--device", "cuda", "--out", os.devnull], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "no CUDA device" in r.stderr


def test_the_host_benchmark_runs_on_cpu_and_turns_each_change_off_and_on(tmp_path):
    out = tmp_path / "host.json"
    script = os.path.join(os.path.dirname(HERE), "benchmarks", "bench_host.py")
    r = subprocess.run([sys.executable, script, "--device", "cpu", "--scale", "1000", "--rounds", "1",
                        "--shapes", "onehot26", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    shape = json.loads(out.read_text())["shapes"]["onehot26"]
    assert shape["kernels"] == ["fbgemm"]
    keys = {f"{k}_{f}_host_ms" for k in ("forward", "sgd_step") for f in ("on", "off")}
    for change in ("attr", "attrs", "guards", "packing", "views", "isparam"):
        assert set(shape[change]) == keys | {"forward_saved_ms", "sgd_step_saved_ms", "forward_rounds_faster",
                                             "sgd_step_rounds_faster"}, change
        assert all(shape[change][k] > 0 for k in keys), change
    # the changes to the device's check, where the groups check on the device (as on CUDA), and two together
    r = subprocess.run([sys.executable, script, "--device", "cpu", "--scale", "1000", "--rounds", "1", "--sync-free",
                        "--clock", "thread", "--ab", "checker,hostview,views+isparam", "--shapes", "onehot26",
                        "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    shape = json.loads(out.read_text())["shapes"]["onehot26"]
    for change in ("checker", "hostview", "views+isparam"):
        assert all(shape[change][k] > 0 for k in keys), change


def test_the_gpu_make_targets_collect_only_the_cuda_test_files_and_bench_as_the_anchors_were_measured():
    """make test-gpu imports only the files holding requires_cuda tests (the others import
    hypothesis, which a GPU machine may lack: collection stopped there), every one of them; make
    bench-gpu times as the anchor figures were measured, without the minutes of torch.compile."""
    root = os.path.dirname(HERE)
    test = subprocess.run(["make", "-n", "test-gpu", "GPU_PY=true"], cwd=root, capture_output=True, text=True)
    assert test.returncode == 0, test.stderr
    files = {w for w in test.stdout.split() if w.startswith("tests/")}
    marker = "mark." + "requires_cuda"  # (split: this file holds no such test)
    holding = set()
    for d in ("tests", "tests/passes"):
        for name in os.listdir(os.path.join(root, d)):
            path = os.path.join(d, name)
            if name.endswith(".py") and marker in open(os.path.join(root, path)).read():
                holding.add(path)
    assert files == holding and "tests/test_gpu.py" in files, (files, holding)
    assert not any("import hypothesis" in open(os.path.join(root, f)).read() for f in files)
    bench = subprocess.run(["make", "-n", "bench-gpu", "GPU_PY=true"], cwd=root, capture_output=True, text=True)
    assert "benchmarks/bench_gpu.py --no-compile --rounds 10 --queue 10" in bench.stdout, bench.stdout
