"""The output buffer a group keeps between inference calls and hands out again once nothing
refers to the previous result (see :class:`ReusedOutput`)."""

from __future__ import annotations

import sys
import threading
from typing import List, Optional

import torch

from ._tracing import compiling


def _storage_use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _storage_object_held(t: torch.Tensor) -> bool:
    """Whether Python code holds ``t.untyped_storage()`` (or a TypedStorage of it). That object
    does not count in the storage's use count; torch keeps one Python object per storage while
    anything refers to it, so its reference count says (2 here: the call's result and the argument)."""
    return sys.getrefcount(t.untyped_storage()) > 2


class ReusedOutput:
    """An output buffer kept between calls and handed out again once nothing refers to it.

    A fresh ``[B, sum of dims]`` tensor of tens of MB costs a page fault per 4 KiB page on
    every call (on the 256-table benchmark shape here, 64 MB: from nothing to half of the plain
    model's forward time, depending on the machine's state). The buffer is reused only when the previous result is gone: every
    tensor that can see the buffer (the result, views of it, autograd's saved copies) holds a
    reference to its storage, so the storage's use count tells whether anything still does; a
    Python storage object (``out.untyped_storage()``) held without the tensor is checked too.
    Otherwise a new buffer is made (and kept). The buffer is never handed out on other devices
    (CUDA's caching allocator already reuses memory, in stream order), across an inference-mode
    boundary, or when this torch has no storage use count. Safe under threads: the check and
    the hand-out happen under one lock. Costs one output's memory between calls.
    """

    _available = hasattr(torch._C, "_storage_Use_Count")

    def __init__(self) -> None:
        self._buf: Optional[torch.Tensor] = None
        self._free_count = 0
        self._lock = threading.Lock()

    def take(self, shape: List[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu" or not self._available or torch.jit.is_tracing() or compiling():
            return torch.empty(shape, dtype=dtype, device=device)
        with self._lock:
            b = self._buf
            if not (
                b is not None and list(b.shape) == list(shape) and b.dtype == dtype
                and b.is_inference() == torch.is_inference_mode_enabled()
                and not b.is_shared()  # sent to another process: it may still read it
                and _storage_use_count(b) == self._free_count
                and not _storage_object_held(b)
            ):
                b = torch.empty(shape, dtype=dtype, device=device)
                self._buf = b
                self._free_count = _storage_use_count(b)
            # a new tensor (detached: in-place autograd on it never reaches the kept buffer);
            # while it or anything made from it lives, the count is above free
            return b.detach().view(shape)

    def __reduce__(self):  # deepcopy / pickle: a new, empty buffer
        return (ReusedOutput, ())
