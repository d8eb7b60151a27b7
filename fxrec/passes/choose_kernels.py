"""choose_kernels: decide per group whether fbgemm's TBE or the plain lookups run.

fbgemm's CPU TBE is not always faster than PyTorch's own per-table kernels (its CPU forward is
single-threaded, while ``embedding_bag`` uses every core), so fxrec must not assume it. With
``backend="auto"`` this pass runs the example inputs through the transformed model once to
capture each group's real inputs, then times both implementations of every group on them,
alternating (``rounds`` runs each, median), separately for inference (forward under no_grad)
and for training (forward and backward), and keeps the faster one. The timings and the choice
go into the report. ``backend="fbgemm"`` or ``"loop"`` forces one implementation everywhere.

Before/After: the graph is unchanged; each group module's ``path_train`` / ``path_eval`` are set.

Not handled: inputs whose sizes differ a lot from the example inputs (the choice is made on
these; pass a representative batch).
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Dict, List

import torch
import torch.fx as fx

from ..pass_infra import PassContext, PassResult, compiler_pass
from ..report import GroupEntry
from ..runtime import _fbgemm
from ..runtime.tbe import EmbeddingGroup


def _capture_inputs(gm: fx.GraphModule, ctx: PassContext, names: List[str]) -> Dict[str, tuple]:
    seen: Dict[str, tuple] = {}
    handles = []
    for name in names:
        mod = gm.get_submodule(name)

        def hook(m, args, name=name):
            seen.setdefault(name, args)

        handles.append(mod.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            gm(*copy.deepcopy(ctx.example_args), **copy.deepcopy(ctx.example_kwargs))
    finally:
        for h in handles:
            h.remove()
    return seen


def _time_once(mod: EmbeddingGroup, args: tuple, path: str, train: bool) -> float:
    ids, offs, psw, params = args
    mod.set_paths(path, path)
    if train:
        leaves = [p.detach().requires_grad_() for p in params]
        # Same storage as the real parameters: the fbgemm binding stays valid.
        start = time.perf_counter()
        out = mod(ids, offs, psw, leaves)
        outs = out if isinstance(out, list) else [out]
        torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs], allow_unused=True)
    else:
        start = time.perf_counter()
        with torch.no_grad():
            mod(ids, offs, psw, params)
    return time.perf_counter() - start


def _measure(mod: EmbeddingGroup, args: tuple, train: bool, rounds: int) -> Dict[str, float]:
    times: Dict[str, List[float]] = {"fbgemm": [], "loop": []}
    for p in times:  # warm-up; binds the TBE
        _time_once(mod, args, p, train)
    for _ in range(rounds):
        for p in times:
            times[p].append(_time_once(mod, args, p, train))
    return {p: statistics.median(v) * 1e3 for p, v in times.items()}


@compiler_pass(needs=("fxrec_origin",))
def choose_kernels(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    names = [n.target for n in gm.graph.nodes if n.op == "call_module" and str(n.target).startswith("fxrec_group_")]
    backend = ctx.config.backend
    if not _fbgemm.fbgemm_available():
        backend = "loop"
        ctx.report.notes.append("fbgemm_gpu is not importable: every group runs the plain lookups")
    inputs = _capture_inputs(gm, ctx, names) if backend == "auto" and names else {}
    stats = {"fbgemm": 0, "loop": 0}
    for name in names:
        mod: EmbeddingGroup = gm.get_submodule(name)
        entry = GroupEntry(
            name=name[len("fxrec_"):], pooling=mod.pooling, tables=[t.name for t in mod.tables],
            features=[f.name for f in mod.features],
        )
        if backend in ("fbgemm", "loop"):
            mod.set_paths(backend, backend)
            entry.why = f"backend={backend!r} was asked for"
        elif name not in inputs:
            mod.set_paths("loop", "loop")
            entry.why = "not reached by the example inputs, so not measured: plain lookups"
        else:
            args = inputs[name]
            t_eval = _measure(mod, args, False, ctx.config.timing_rounds)
            train_needed = any(p.requires_grad for p in args[3])
            t_train = _measure(mod, args, True, ctx.config.timing_rounds) if train_needed else t_eval
            path_eval = min(t_eval, key=t_eval.get)
            path_train = min(t_train, key=t_train.get)
            mod.set_paths(path_train, path_eval)
            entry.timings_ms = {
                "fwd_fbgemm": t_eval["fbgemm"], "fwd_loop": t_eval["loop"],
                "train_fbgemm": t_train["fbgemm"], "train_loop": t_train["loop"],
            }
            entry.why = (
                f"measured on the example inputs: forward fbgemm {t_eval['fbgemm']:.3g} ms vs plain "
                f"{t_eval['loop']:.3g} ms; forward+backward fbgemm {t_train['fbgemm']:.3g} ms vs plain "
                f"{t_train['loop']:.3g} ms"
            )
        entry.path_train, entry.path_eval = mod.path_train, mod.path_eval
        stats[mod.path_eval] += 1
        ctx.report.groups.append(entry)
    return PassResult(gm, False, {"groups_fbgemm_fwd": stats["fbgemm"], "groups_loop_fwd": stats["loop"]})
