"""Host ints on a device without the host waiting: sent from pinned memory by a non-blocking copy
(:func:`ints_on`), or kept from an earlier call that sent the same ints (:func:`kept_ints_on`);
a module's own constant ints, made once per device (:func:`consts_on`)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, List, Tuple, Union

import torch

#: the ints sent last by :func:`kept_ints_on`, on their device: (device, stream, *values) -> (tensor,
#: its last value as a 1-element view, the others as a column view): see :func:`kept_split_on`
KEPT: "OrderedDict[tuple, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]" = OrderedDict()
#: how many :data:`KEPT` holds (a few KB each), the least recently used dropped first. Dropping one
#: is safe: it was made on the stream of its key and is read only there, so the caching allocator
#: hands its memory out again only after the kernels queued there before.
KEEP = 64


def ints_on(values: List[int], device: torch.device) -> torch.Tensor:
    """Host ints as an int64 tensor on ``device``, sent from pinned memory without the host
    waiting (the caching host allocator keeps the block until the copy has run)."""
    host = torch.tensor(values, dtype=torch.long, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def kept_ints_on(values: List[int], device: torch.device) -> torch.Tensor:
    """:func:`ints_on`, the tensor kept for the next call with the same ints (a training loop's
    batches of one shape: no copy at all). Not to be written. On CUDA a kept tensor is used only
    on the stream it was sent on (the copy is ordered before every use there; another stream
    could read it before it lands); not inside a CUDA graph (a replay would read a tensor this
    may drop)."""
    return _kept(values, device)[0]


def kept_split_on(values: List[int], device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`kept_ints_on`'s tensor as the two views packing reads, kept with it: ``t[-1:]`` and
    ``t[:-1].view(-1, 1)`` (no view op a call). At least two ints."""
    kept = _kept(values, device)
    return kept[1], kept[2]


def _kept(values: List[int], device: torch.device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    key = (device, stream, *values)
    kept = KEPT.pop(key, None)  # (then put back as the most recent: no step another thread can undo)
    if kept is not None:
        KEPT[key] = kept
        return kept
    sent = ints_on(values, device)
    kept = (sent, sent[-1:], sent[:-1].view(-1, 1))
    if KEEP > 0:
        KEPT[key] = kept
        while len(KEPT) > KEEP:
            KEPT.popitem(last=False)
    return kept


class PerDevice(dict):
    """A module's tensors made once per device from what it holds (see :func:`consts_on`). Not
    pickled or copied: ``torch.load``'s ``map_location`` would move the tensors and leave their
    keys (a tensor on meta, or on another GPU, found under the device a call runs on); each is
    made again where it is next needed."""

    def __reduce__(self):
        return (PerDevice, ())


def consts_on(module, name: str, device: torch.device, values: Union[List[int], Callable[[], List[int]]]
              ) -> torch.Tensor:
    """``values`` (or what calling it gives) as an int64 tensor on ``device``, made once per
    ``module``, ``name`` and device (a copy from the host each call would make the host wait for
    the device) and kept in the module's :class:`PerDevice`. Not to be written."""
    cache = module.__dict__.get("_fxrec_consts")
    if cache is None:
        cache = module.__dict__["_fxrec_consts"] = PerDevice()
    t = cache.get((name, device))
    if t is None:
        refuse_in_capture(module, device, "its constant index tensors are made there")
        t = cache[(name, device)] = torch.tensor(values() if callable(values) else values, dtype=torch.long).to(device)
    return t


def refuse_in_capture(module, device: torch.device, what: str) -> None:
    """A module's first call on a CUDA device makes what it keeps there (``what``): allocations
    and copies from the host, which a CUDA graph capture cannot hold (torch's error names no
    table, and what was allocated would live in the graph's memory pool). Refused, naming the
    module's tables, and what to do; nothing where no capture is under way."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        tables = getattr(module, "tables", None)
        # (a group's tables are TableSpecs; a sharded input dist keeps their names)
        who = f"the group of tables {[getattr(t, 'name', t) for t in tables]}" if tables else type(module).__name__
        raise RuntimeError(
            f"fxrec: {who} is called on {device} inside a CUDA graph capture without a call there before it (or "
            f"after a .to(), copy or reload), and {what} (allocations and copies from the host, which a capture "
            "cannot hold): call the model once outside the capture first, on inputs of the same form (the warm-up "
            "of torch's CUDA-graph recipe), then capture it")
