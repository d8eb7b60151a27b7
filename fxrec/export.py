"""Export a transformed model for serving.

``fxrec.export.program(fast, example_inputs, "model.pt2")``: ``torch.export`` of the model, every
input dim dynamic where the model allows (so other batch sizes run), saved when a path is given.
Quantized groups export as fbgemm's quantized lookup operator on their own buffers; fp32 groups
export as their plain ATen lookups (``aten.embedding_bag``). Input checks that read tensor
values are left out of the exported program (export cannot trace them). Load with
``torch.export.load(path)`` after ``import fbgemm_gpu`` (which registers fbgemm's operators).

Not yet: ``torch.jit.script`` (fails on the exported module: "Expected a single top-level
function", torch/export/_unlift.py) and the C++ loaders.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Optional

import torch

from .capture import _dynamic_shapes


def program(model: torch.nn.Module, example_inputs, path: Optional[str] = None,
            example_kwargs: Optional[Dict[str, Any]] = None) -> torch.export.ExportedProgram:
    args = example_inputs if isinstance(example_inputs, tuple) else tuple(example_inputs) \
        if isinstance(example_inputs, list) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    with torch.no_grad():
        ep = torch.export.export(model, copy.deepcopy(args), copy.deepcopy(kwargs), strict=False,
                                 dynamic_shapes=_dynamic_shapes(model, args, kwargs))
    if path is not None:
        torch.export.save(ep, path)
    return ep
