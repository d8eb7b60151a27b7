"""Installation that cannot silently degrade: each extra resolves the torch its fbgemm build is
made for (pip's own resolver, in a dry run), and a broken fbgemm on a GPU is an error naming the
versions, not a quiet fallback to PyTorch's lookups."""

import json
import os
import subprocess
import sys

import pytest

from fxrec.passes.choose_kernels import kernel_order, pick
from fxrec.runtime.kernels import fbgemm_tbe
from fxrec.runtime.specs import FeatureSpec, GroupSpec, TableSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = GroupSpec((TableSpec("t", 100, 16),), (FeatureSpec("f", 0, "bag"),), "sum")


@pytest.mark.parametrize("extra,want", [("cuda", ("fbgemm_gpu", "1.6.0", "2.11.")),
                                        ("cpu", ("fbgemm_gpu_cpu", "1.8.0", "2.13."))])
def test_each_extra_resolves_the_torch_its_fbgemm_is_built_for(tmp_path, extra, want):
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--disable-pip-version-check", "--report", str(report), f".[{extra}]"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    picked = {i["metadata"]["name"].replace("-", "_").lower(): i["metadata"]["version"]
              for i in json.loads(report.read_text())["install"]}
    name, fbgemm_version, torch_prefix = want
    assert picked.get(name) == fbgemm_version, picked
    assert picked["torch"].startswith(torch_prefix), picked["torch"]


def test_a_broken_fbgemm_is_an_error_on_cuda_and_a_named_fallback_on_cpu(monkeypatch):
    monkeypatch.setattr(fbgemm_tbe, "_IMPORT_ERROR", ImportError("undefined symbol: _ZN3c10 (built for another torch)"))
    with pytest.raises(ImportError, match=r"fbgemm-gpu==1\.6\.0' for torch 2\.11.*undefined symbol"):
        pick(SPEC, "cuda", "training", None, kernel_order("cuda", "training", "auto"), True)
    # on CPU the rule's next kernel runs the group, and the decision says why fbgemm was passed over
    chosen, passed = pick(SPEC, "cpu", "training", None, ("fbgemm", "reference"), True)
    assert chosen == "reference" and "fbgemm_gpu does not import" in passed[0], (chosen, passed)


def test_fxrec_imports_and_runs_on_cpu_where_fbgemm_gpu_does_not_import_at_all():
    """A real failed import (a fresh interpreter where ``import fbgemm_gpu`` raises): ``import
    fxrec`` works, a CPU model runs on the other kernels and gives the plain model's outputs, and
    asking for fbgemm is the error that names what to install."""
    import subprocess
    import sys

    code = """
import sys
sys.modules["fbgemm_gpu"] = None  # import fbgemm_gpu -> ImportError
import torch, fxrec
from tests import models as M
model, x = M.BagList(), M.bag_inputs()
fast = fxrec.transform(model, x)
torch.testing.assert_close(fast(*x), model(*x))
print("kernels", sorted({g.kernel_train for g in fast.report.groups}))
try:
    fxrec.transform(model, x, backend="fbgemm", quantize="int8", mode="inference")
except Exception as e:  # the pass error that carries fbgemm's import error
    print("refused:", type(e).__name__, e)
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "kernels ['native']" in r.stdout or "kernels ['reference']" in r.stdout, r.stdout
    assert "fxrec needs fbgemm_gpu built for the installed torch" in r.stdout.split("refused:")[1], r.stdout
