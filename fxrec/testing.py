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
