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
