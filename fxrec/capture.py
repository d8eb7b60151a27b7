"""Capture a plain model as an FX GraphModule with torch.export (non-strict).

Non-strict export runs the model's Python as Python, so list and dict inputs, loops over
tables, modules built inside ``forward``, ids carried as floats and cast with ``.long()``, and
in-place writes to inputs all work (``torch.fx.symbolic_trace`` fails on most real CTR models).
Every tensor dimension is captured as dynamic where the model allows it (``Dim.AUTO``), so the
result takes other batch sizes and other numbers of ids; dims of size 0 or 1 in the example
inputs are fixed by torch.export (the report names them). The returned module is called exactly
like the original: same positional and keyword structure, inputs mutated as the model mutates
them.
"""

from __future__ import annotations

import copy
import inspect
import os
import traceback
from typing import Any, Dict, Tuple

import torch
import torch.fx as fx
from torch.export import Dim
from torch.utils import _pytree as pytree

from .codegen import StructuredCodeGen, supported


class CaptureError(RuntimeError):
    """The model could not be captured; the message names the user's file and line."""


_SKIP = (os.path.dirname(torch.__file__), os.path.dirname(__file__), os.path.dirname(os.__file__))


def _user_frame(exc: BaseException):
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if not f.filename.startswith(_SKIP) and "<" not in f.filename]
    return user[-1] if user else None


def _dynamic_shapes(model: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]):
    """Every dim of every tensor input dynamic where the model allows it."""

    def spec(x):
        if isinstance(x, torch.Tensor):
            return {i: Dim.AUTO for i in range(x.dim())} if x.dim() else None
        return None

    if not kwargs:
        return pytree.tree_map(spec, args)
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    return {name: pytree.tree_map(spec, value) for name, value in bound.arguments.items()}


def fixed_size_notes(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> list:
    """torch.export fixes every input dim whose example size is 0 or 1 (treating it as dynamic
    would change what squeeze, broadcasting and the like do): name each such dim."""
    notes = []
    flat, _ = pytree.tree_flatten_with_path((args, kwargs))
    for path, x in flat:
        if isinstance(x, torch.Tensor):
            for d, n in enumerate(x.shape):
                if n in (0, 1):
                    where = pytree.keystr(path)
                    notes.append(
                        f"input {where} has size {n} in dim {d} in the example inputs: the transformed model "
                        f"accepts only size {n} there (pass an example batch of 2 or more for a dynamic batch)"
                    )
    return notes


def capture(model: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> fx.GraphModule:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fxrec.transform needs an nn.Module, got {type(model).__name__}")
    try:
        ep = torch.export.export(
            model, copy.deepcopy(args), copy.deepcopy(kwargs), strict=False,
            dynamic_shapes=_dynamic_shapes(model, args, kwargs),
        )
    except Exception as e:
        frame = _user_frame(e)
        where = f"{frame.filename}:{frame.lineno} ({frame.line})" if frame else "inside torch.export"
        raise CaptureError(
            f"fxrec could not capture {type(model).__name__} at {where}: {type(e).__name__}: "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}\n"
            "What to do: run the model once on the same example inputs to check that they are what "
            "forward expects; keep data-dependent Python control flow (if on a tensor's value, "
            ".item(), .tolist()) out of forward or move it to the data loader; pass every tensor "
            "the model reads as an input rather than a global."
        ) from e
    gm = ep.module()
    _structured_forward(gm)
    return gm


def _structured_forward(gm: fx.GraphModule) -> None:
    """Give ``gm`` a ``forward`` that takes the model's own arguments and reads the tensors out of
    them by index (see :mod:`fxrec.codegen`), instead of export's per-call pytree flatten and
    structure check; list lengths are still checked, with a message that names the input."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is None or info.in_spec is None or not supported(info.in_spec) or not supported(info.out_spec):
        return  # namedtuples, OrderedDicts, ...: export's own pytree forward stays
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    none_leaves = [k for k, n in enumerate(placeholders) if "val" in n.meta and n.meta["val"] is None]
    gm.graph._codegen = StructuredCodeGen(info.in_spec, info.out_spec, info.orig_args, none_leaves=none_leaves)
    if hasattr(gm, "validate_inputs"):
        gm.validate_inputs = False  # the generated forward checks what it reads
    gm.recompile()
