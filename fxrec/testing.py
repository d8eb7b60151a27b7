"""Helpers for tests of fxrec and of models that use it: run one pass, count ops, compare."""

from __future__ import annotations

import copy
import logging
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch
import torch.fx as fx

from .capture import capture
from .pass_infra import CompilerPass, Config, PassContext, PassManager
from .report import Report
from .verify import compare_models


def captured(model: torch.nn.Module, args: tuple, kwargs: Optional[Dict[str, Any]] = None) -> fx.GraphModule:
    """The model as fxrec captures it, before any pass."""
    return capture(copy.deepcopy(model), args, dict(kwargs or {}))


def run_passes(
    gm: fx.GraphModule, passes: Sequence[CompilerPass], args: tuple = (), kwargs: Optional[Dict[str, Any]] = None,
    backend: str = "fbgemm",
) -> tuple:
    """Run ``passes`` in order on ``gm``; returns (gm, ctx)."""
    ctx = PassContext(
        config=Config(backend=backend, timing_rounds=2), report=Report(), example_args=args,
        example_kwargs=dict(kwargs or {}), logger=logging.getLogger("fxrec.test"),
    )
    gm = PassManager(passes).run(gm, ctx)
    return gm, ctx


def calls(gm: fx.GraphModule, targets: Iterable) -> List[fx.Node]:
    targets = set(targets)
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


def group_calls(gm: fx.GraphModule) -> List[fx.Node]:
    from .runtime.group import EmbeddingGroup

    return [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), EmbeddingGroup)]


def embedding_ops(gm: fx.GraphModule) -> List[fx.Node]:
    aten = torch.ops.aten
    return calls(gm, [aten.embedding.default, aten.embedding_bag.padding_idx, aten.embedding_bag.default, aten._embedding_bag.default])


def assert_matches(reference: torch.nn.Module, transformed: torch.nn.Module, *inputs_list, rtol=1.3e-6, atol=1e-5):
    """Outputs and parameter gradients of ``transformed`` equal ``reference`` on every input set."""
    for inputs in inputs_list:
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        compare_models(reference, transformed, args, {}, rtol=rtol, atol=atol)


class HostSyncs:
    """Host synchronisations seen inside a ``with`` block (:func:`host_syncs`): ``events`` is a list
    of ``(what, where)``; ``where`` is the innermost frame in fxrec's own code (``file:line``), or
    ``"outside fxrec"`` (torch's or fbgemm's own Python, e.g. fbgemm's reads of its CPU-resident
    step counter, which do not wait for a device)."""

    def __init__(self):
        self.events: List[tuple] = []

    def in_fxrec(self) -> List[tuple]:
        return [e for e in self.events if e[1] != "outside fxrec"]


# What makes the host wait for a device: reading a value (item, bool(), int(), tolist), ops whose
# output size depends on values (nonzero, boolean-mask indexing, masked_select, unique,
# repeat_interleave without output_size), and a tensor made from Python numbers (a copy from
# pageable host memory on CUDA) unless it is made in pinned memory where there is a GPU.
_SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2",
             "aten::unique_consecutive", "aten::repeat_interleave.Tensor")


def host_syncs():
    """A context manager that records every host-synchronising operation run inside it, on any
    device (on CPU the same operations run, they just cost nothing): it counts what a CUDA step
    would wait on. See :class:`HostSyncs`."""
    import contextlib
    import os
    import traceback
    from unittest import mock

    from torch.utils._python_dispatch import TorchDispatchMode

    here = os.path.dirname(os.path.abspath(__file__))
    record = HostSyncs()

    def where() -> str:
        for f in reversed(traceback.extract_stack()[:-2]):
            if f.filename.startswith(here) and not f.filename.endswith("testing.py"):
                return f"{os.path.relpath(f.filename, os.path.dirname(here))}:{f.lineno}"
            if f"{os.sep}fbgemm_gpu{os.sep}" in f.filename:  # fbgemm's own Python, called by fxrec or not
                break
        return "outside fxrec"

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name + (f".{func._overloadname}" if func._overloadname == "Tensor" else "")
            indices = args[1] if name.startswith("aten::index") and len(args) > 1 else None
            boolean_index = isinstance(indices, (list, tuple)) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
            sized = name == "aten::repeat_interleave.Tensor" and (kwargs or {}).get("output_size") is not None
            if (name in _SYNC_OPS and not sized) or boolean_index:
                record.events.append((name if not boolean_index else "boolean-mask indexing", where()))
            return func(*args, **(kwargs or {}))

    tolist, tensor = torch.Tensor.tolist, torch.tensor

    def counted_tolist(self):
        record.events.append(("Tensor.tolist", where()))
        return tolist(self)

    def counted_tensor(data, *args, **kwargs):
        # made with pin_memory= given: the caller pins it where there is a GPU and copies it with
        # non_blocking=True, which does not wait (fxrec.runtime.device_ints.ints_on)
        if not isinstance(data, torch.Tensor) and "pin_memory" not in kwargs:
            record.events.append(("torch.tensor(python values)", where()))
        return tensor(data, *args, **kwargs)

    @contextlib.contextmanager
    def run():
        with mock.patch.object(torch.Tensor, "tolist", counted_tolist), mock.patch.object(torch, "tensor", counted_tensor):
            with Mode():
                yield record

    return run()
