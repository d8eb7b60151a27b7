"""The C++ program of examples/inference_cpp serves models written by fxrec.export.torchscript.

It is built with g++ against the libtorch inside the installed torch package, loads fbgemm_gpu's
operator libraries, runs the scripted model on inputs written by torch.save, and its outputs must
equal Python's.
"""

import os
import shutil
import subprocess
import sys

import pytest
import torch

import fxrec
from examples.dlrm import DLRM, make_batch
from tests import models as M

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD = os.path.join(os.path.dirname(HERE), "examples", "inference_cpp", "build.sh")


@pytest.fixture(scope="module")
def infer_binary(tmp_path_factory):
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler (g++) on this machine: the C++ loader cannot be built")
    out = str(tmp_path_factory.mktemp("cpp") / "fxrec_infer")
    r = subprocess.run(["bash", BUILD, sys.executable, out], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def run_cpp(binary, model_path, inputs, tmp_path, device=None):
    torch.save(tuple(inputs), tmp_path / "inputs.pt")
    where = ["--device", device] if device else []
    r = subprocess.run([binary, *where, str(model_path), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt"),
                        *fxrec.export.fbgemm_libraries()], capture_output=True, text=True)
    return r, (torch.load(tmp_path / "out.pt") if r.returncode == 0 else None)


@pytest.mark.parametrize("kw", [dict(mode="inference", quantize="int8"), dict(backend="fbgemm"),
                                dict(mode="inference", quantize={"emb.0": "int4", "*": "fp16"})],
                         ids=["int8", "fp32", "mixed"])
def test_demo_model_in_cpp_matches_python(infer_binary, kw, tmp_path):
    rows = [1000, 50, 300, 2000]
    model = DLRM(rows, dim=16).eval()
    fast = fxrec.transform(model, make_batch(rows, batch=32), timing_rounds=1, **kw)
    fxrec.export.torchscript(fast, tmp_path / "model.pt")
    for batch, seed in ((17, 1), (64, 2)):
        x = make_batch(rows, batch=batch, seed=seed)
        r, out = run_cpp(infer_binary, tmp_path / "model.pt", x, tmp_path)
        assert r.returncode == 0, r.stderr
        with torch.no_grad():
            want = torch.jit.load(str(tmp_path / "model.pt"))(*x)
            torch.testing.assert_close(out, want, rtol=0, atol=0)  # the same program, the same kernels
            torch.testing.assert_close(out, fast(*x), rtol=1e-5, atol=1e-5)


def test_sequence_and_weighted_models_in_cpp(infer_binary, tmp_path):
    for model, make in ((M.SequenceMean().eval(), M.seq_inputs), (M.WeightedBags().eval(), M.weighted_inputs)):
        fast = fxrec.transform(model, make(), mode="inference", quantize="fp16")
        fxrec.export.torchscript(fast, tmp_path / "model.pt")
        x = make(seed=3)
        r, out = run_cpp(infer_binary, tmp_path / "model.pt", x, tmp_path)
        assert r.returncode == 0, r.stderr
        with torch.no_grad():
            torch.testing.assert_close(out, fast(*x), rtol=0, atol=0)


def test_cpp_reports_a_bad_id_naming_the_feature(infer_binary, tmp_path):
    model = M.BagList().eval()
    fast = fxrec.transform(model, M.bag_inputs(), mode="inference", quantize="int8")
    fxrec.export.torchscript(fast, tmp_path / "model.pt")
    dense, ids, offs = M.bag_inputs(seed=2)
    ids[2] = ids[2].clone()
    ids[2][0] = 30  # table bags.2 has 30 rows
    r, _ = run_cpp(infer_binary, tmp_path / "model.pt", (dense, ids, offs), tmp_path)
    assert r.returncode == 1
    assert "feature 'ids_2' (table 'bags.2') looks up id 30" in r.stderr


def test_aoti_package_in_cpp_matches_python(infer_binary, tmp_path):
    """AOTInductor: torch.export program -> aoti_compile_and_package -> C++ AOTIModelPackageLoader."""
    rows = [1000, 50, 300, 2000]
    model = DLRM(rows, dim=16).eval()
    fast = fxrec.transform(model, make_batch(rows, batch=32), mode="inference", quantize="int8")
    path = fxrec.export.aoti(fast, make_batch(rows, batch=32), tmp_path / "model.pt2")
    for batch, seed in ((1, 0), (17, 1), (64, 2)):  # other batch sizes than the example's (checked: 1 too)
        x = make_batch(rows, batch=batch, seed=seed)
        r, out = run_cpp(infer_binary, path, x, tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        with torch.no_grad():
            torch.testing.assert_close(out[0], fast(*x), rtol=1e-5, atol=1e-5)
    # the package checks its inputs (the program turns AOTInductor's checks on): int32 ids where it
    # was compiled for int64 are an error naming the feature, not ids read as int64
    dense, ids, offsets = make_batch(rows, batch=17, seed=3)
    ids[2] = ids[2].int()
    r, _ = run_cpp(infer_binary, path, (dense, ids, offsets), tmp_path)
    assert r.returncode == 1, r.stdout
    assert "input ids[2] (ids of feature" in r.stderr and "unmatched dtype" in r.stderr, r.stderr[-3000:]


def test_cpp_runs_on_the_device_it_is_given(infer_binary, tmp_path):
    """``--device cpu`` loads the model and moves the inputs there (the path --device cuda takes);
    an unknown device is an error that names it."""
    model = M.BagList().eval()
    fast = fxrec.transform(model, M.bag_inputs(), mode="inference", quantize="int8")
    fxrec.export.torchscript(fast, tmp_path / "model.pt")
    x = M.bag_inputs(seed=4)
    r, out = run_cpp(infer_binary, tmp_path / "model.pt", x, tmp_path, device="cpu")
    assert r.returncode == 0, r.stderr
    with torch.no_grad():
        torch.testing.assert_close(out, fast(*x), rtol=0, atol=0)
    r, _ = run_cpp(infer_binary, tmp_path / "model.pt", x, tmp_path, device="tpu:7")
    assert r.returncode == 2 and "--device tpu:7 is not a device" in r.stderr, r.stderr


@pytest.mark.requires_cuda
def test_cpp_serves_on_cuda_what_was_scripted_on_cuda_and_refuses_a_cpu_packing(infer_binary, tmp_path):
    model = M.BagList(dim=24).eval()
    fast = fxrec.transform(model, M.bag_inputs(), mode="inference", quantize="int8")
    x = M.bag_inputs(seed=4)
    fxrec.export.torchscript(fast, tmp_path / "cpu.pt")
    fxrec.export.torchscript(fast.cuda(), tmp_path / "cuda.pt")
    with torch.no_grad():  # on CUDA (fbgemm dequantizes in half precision there: not the CPU's figures)
        want = fast(*[[t.cuda() for t in v] if isinstance(v, list) else v.cuda() for v in x]).cpu()
    r, out = run_cpp(infer_binary, tmp_path / "cuda.pt", x, tmp_path, device="cuda")
    assert r.returncode == 0, r.stderr
    torch.testing.assert_close(out.cpu(), want, rtol=0, atol=0)
    r, _ = run_cpp(infer_binary, tmp_path / "cpu.pt", x, tmp_path, device="cuda")
    assert r.returncode == 1 and "packed for CPU" in r.stderr, r.stderr
