"""Whether torch is tracing the model (torch.export, torch.compile): the group modules then
run what those tracers can follow (PyTorch's own lookups), and skip checks that read values."""

from __future__ import annotations

import torch


def exporting() -> bool:
    """Inside torch.export tracing: checks that read tensor values (data-dependent) are skipped,
    and fp32 groups run their plain lookups, which export as ATen ops."""
    # the flag itself, not is_exporting(): torch 2.11's torch.compile folds that call to True (2.13
    # reads the flag), so fxrec would skip its input checks and run export's forms under it
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    if isinstance(flag, bool):
        return flag
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return bool(is_exporting and is_exporting())


_PEEK = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)


def functorch_active() -> bool:
    """Inside a torch.func transform (grad, vjp, jacrev, vmap): the group modules then run
    PyTorch's own lookups, which those transforms follow (fxrec's autograd functions and fbgemm's
    binding of the tables do not). One C call (~30 ns)."""
    return _PEEK is not None and _PEEK() is not None


def compiling() -> bool:
    is_compiling = getattr(torch.compiler, "is_compiling", None)
    return bool(is_compiling and is_compiling())


_SYNC_FREE = [False]


def reads_values(device: torch.device) -> bool:
    """Whether a group may read tensor values on the host for its checks: on CPU, where that
    costs nothing, unless :func:`sync_free` is on; never on other devices (reading a CUDA tensor's
    value makes the host wait for the device) nor while exporting."""
    return device.type == "cpu" and not _SYNC_FREE[0] and not exporting()


class sync_free:
    """Within ``with sync_free():`` the groups run on CPU exactly as on CUDA: no tensor value is
    read on the host in a call (checks run on the device and report later; see
    :mod:`fxrec.runtime.checks`). What tests use to prove the CUDA path free of host
    synchronisations on a machine without a GPU (with :func:`fxrec.testing.host_syncs`)."""

    def __enter__(self):
        self._before = _SYNC_FREE[0]
        _SYNC_FREE[0] = True
        return self

    def __exit__(self, *exc):
        _SYNC_FREE[0] = self._before
        return False
