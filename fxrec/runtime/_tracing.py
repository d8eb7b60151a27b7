"""Whether torch is tracing the model (torch.export, torch.compile): the group modules then
run what those tracers can follow (PyTorch's own lookups), and skip checks that read values."""

from __future__ import annotations

import torch


def exporting() -> bool:
    """Inside torch.export tracing: checks that read tensor values (data-dependent) are skipped,
    and fp32 groups run their plain lookups, which export as ATen ops."""
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return bool(is_exporting and is_exporting())


def compiling() -> bool:
    is_compiling = getattr(torch.compiler, "is_compiling", None)
    return bool(is_compiling and is_compiling())
