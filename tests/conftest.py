import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_cuda: needs a CUDA GPU (run by `make test-gpu`)")


def pytest_collection_modifyitems(config, items):
    """``requires_cuda`` tests are skipped without a GPU, and shown as skipped. Under
    ``FXREC_REQUIRE_CUDA=1`` (``make test-gpu``) a missing GPU is an error instead: the GPU suite
    never passes by skipping everything."""
    if torch.cuda.is_available():
        return
    if os.environ.get("FXREC_REQUIRE_CUDA") == "1":
        raise pytest.UsageError("FXREC_REQUIRE_CUDA=1 but torch.cuda.is_available() is False "
                                f"(torch {torch.__version__}): this machine cannot run the GPU suite")
    skip = pytest.mark.skip(reason="needs a CUDA GPU (make test-gpu)")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)
