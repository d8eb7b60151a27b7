"""Factories for the ``fxrec`` command line: each returns ``(model, example_inputs)``.

    fxrec inspect examples/dlrm_factory.py:small
    fxrec draw examples/dlrm_factory.py:small --backend fbgemm --before annotate_lookups -o examples/img/dlrm_before.svg
    fxrec draw examples/dlrm_factory.py:small --backend fbgemm -o examples/img/dlrm_after.svg
    fxrec bench examples/dlrm_factory.py:small

(The pictures in examples/img are drawn with ``--backend fbgemm``, the kernel every group gets on
CUDA; on CPU the default puts fxrec's native kernel first.)
"""

from __future__ import annotations

import os
import sys
from typing import List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.dlrm import DLRM, make_batch, table_rows  # noqa: E402


def small(rows_cap: int = 1000, batch: int = 64, dim: int = 64) -> Tuple[DLRM, tuple]:
    """The README demo's DLRM (26 Criteo-like tables, dim 64) with every table capped at
    ``rows_cap`` rows, and one batch of ``batch`` one-hot bags: transforms in seconds."""
    torch.manual_seed(0)
    rows: List[int] = table_rows(cap=rows_cap)
    return DLRM(rows, dim=dim), make_batch(rows, batch=batch, ids_per_bag=1)


def demo() -> Tuple[DLRM, tuple]:
    """The demo's own sizes (tables up to 100k rows, batch 2048)."""
    return small(rows_cap=100_000, batch=2048)
