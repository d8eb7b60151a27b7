"""choose_kernels: decide per group which implementation runs: fbgemm's TBE, fxrec's own CPU
kernel, or PyTorch's lookups.

fbgemm's CPU TBE is not always faster than PyTorch's own per-table kernels (its CPU forward is
single-threaded, while ``embedding_bag`` uses every core), so fxrec must not assume it. With
``backend="auto"`` this pass runs the example inputs through the captured graph once (an FX
Interpreter that keeps each group's inputs), then times the implementations of every group on
them (fbgemm, native (on CPU, where fxrec's kernel is built), direct and plain for pooled
groups; fbgemm and plain for sequence groups), alternating (``rounds`` runs each, median),
separately for inference (forward under no_grad) and for training (forward and backward), and
keeps the faster one for each.

For inference, ``direct`` (the plain lookups into a reused output buffer: the same kernels,
fewer page faults) is kept over the plain loop when it measures within 10 % of it. A group whose plain
lookups win both ways is not lowered at all: its lookups stay in the graph
exactly as the user wrote them, so choosing "plain" costs nothing. ``backend="fbgemm"`` or
``"loop"`` forces one implementation everywhere (``"loop"`` still lowers, which is what tests
of the lowering want). Timings and choices go into the report.

Before/After: the graph is unchanged; each GroupRecord gets path_train, path_eval, lower, why.

Not handled: inputs whose sizes differ a lot from the example inputs (the choice is made on
these; pass a representative batch).
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from typing import Dict, List, Set

import torch
import torch.fx as fx

from .. import meta
from ..group_module import build_group_module, group_inputs, uses_outside_group
from ..pass_infra import PassContext, PassResult, compiler_pass
from ..report import GroupEntry
from ..runtime import _fbgemm, _native
from ..runtime.tbe import EmbeddingGroup
from ..verify import buffers_kept


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, wanted: Set[fx.Node]):
        super().__init__(gm)
        self.wanted = wanted
        self.values: Dict[fx.Node, object] = {}

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if n in self.wanted:
            self.values[n] = out
        return out


def _record_inputs(gm: fx.GraphModule, ctx: PassContext, groups: List[meta.GroupRecord]) -> Dict[fx.Node, object]:
    wanted = {
        x for g in groups for r in g.lookups
        for x in (r.weight, r.ids, r.offsets, r.per_sample_weights) if isinstance(x, fx.Node)
    }
    rec = _Recorder(gm, wanted)
    with torch.no_grad(), buffers_kept(gm):  # the transform must not count a batch or move statistics
        rec.run(*copy.deepcopy(ctx.example_args), **copy.deepcopy(ctx.example_kwargs))
    return rec.values


def _backward_ones(out, inputs=None) -> None:
    """Backward of a group's output with a cotangent of ones (into ``inputs`` only, if given)."""
    outs = out if isinstance(out, list) else [out]
    ones = [torch.ones_like(o) for o in outs]
    if inputs is None:
        torch.autograd.backward(outs, ones)
    else:
        torch.autograd.grad(outs, inputs, ones, allow_unused=True)


def _time_once(mod: EmbeddingGroup, args: tuple, path: str, train: bool) -> float:
    ids, offs, psw, params = args
    mod.set_paths(path, path)
    if train:
        # Same storage as the real parameters, so timing leaves no .grad on them.
        leaves = [p.detach().requires_grad_() for p in params]
        start = time.perf_counter()
        _backward_ones(mod(ids, offs, psw, leaves), leaves)
    else:
        start = time.perf_counter()
        with torch.no_grad():
            mod(ids, offs, psw, params)
    return time.perf_counter() - start


def _measure(mod: EmbeddingGroup, args: tuple, train: bool, rounds: int, paths) -> Dict[str, float]:
    times: Dict[str, List[float]] = {p: [] for p in paths}
    for p in times:  # warm-up; binds the TBE
        _time_once(mod, args, p, train)
    for _ in range(rounds):
        for p in times:
            times[p].append(_time_once(mod, args, p, train))
    return {p: statistics.median(v) * 1e3 for p, v in times.items()}


_NAMES = {"fbgemm": "fbgemm", "native": "native", "direct": "direct", "loop": "plain"}
TIE = 1.10  # measurements within 10 % of the fastest count as ties on these noisy machines


def _fastest(times: Dict[str, float], prefer=None) -> str:
    """The fastest path; ``prefer`` instead of the plain loop when within the noise of it."""
    best = min(times, key=times.get)
    if best == "loop" and prefer is not None and times[prefer] <= TIE * times[best]:
        return prefer
    return best


_OWN_UPDATES = {"direct": ("sgd",), "native": ("sgd", "adagrad", "rowwise_adagrad")}


def _native_fits(gr: meta.GroupRecord, params) -> bool:
    return gr.pooling != "none" and all(p.device.type == "cpu" for p in params) and _native.available()


@compiler_pass(needs=("groups",), provides=("paths",))
def choose_kernels(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    backend = ctx.config.backend
    if not _fbgemm.fbgemm_available():
        backend = "loop"
        ctx.report.notes.append("fbgemm_gpu is not importable: every group runs the plain lookups")
    if any(g.pooling != "none" for g in ctx.groups) and any(p.device.type == "cpu" for p in gm.parameters()):
        # build fxrec's kernels now (once per machine), not in the first backward
        if not _native.load():
            ctx.report.notes.append(
                f"fxrec's native CPU kernels are not available ({_native.why_unavailable()}): "
                "groups use fbgemm, direct or the plain lookups instead"
            )
    timed = [g for g in ctx.groups if not g.quant]
    values = _record_inputs(gm, ctx, timed) if backend == "auto" and timed else {}
    stats = {"fbgemm_fwd": 0, "native_fwd": 0, "direct_fwd": 0, "fbgemm_train": 0, "native_train": 0,
             "direct_train": 0, "kept_plain": 0}
    for gr in ctx.groups:
        if gr.quant:
            gr.path_train = gr.path_eval = "fbgemm"
            gr.why = "quantized for inference: fbgemm's IntNBit TBE"
        elif backend in ("fbgemm", "native", "direct", "loop"):
            pooled_only = backend in ("native", "direct") and gr.pooling == "none"
            gr.path_train = gr.path_eval = "fbgemm" if pooled_only else backend
            gr.why = f"backend={backend!r} was asked for"
            if backend == "native" and not pooled_only and not _native.available():
                gr.why += (f" but fxrec's kernels are not available ({_native.why_unavailable()}): the lookups run "
                           "PyTorch's kernels (a fused Adagrad, fbgemm's)")
        elif not all(r.ids in values for r in gr.lookups):
            gr.path_train = gr.path_eval = "loop"
            gr.lower = False
            gr.why = "not reached by the example inputs, so not measured: kept as plain lookups"
        else:
            mod, index = build_group_module(gr, with_optimizer=False, reuse_output=ctx.config.reuse_outputs)
            args = group_inputs(gr, index, lambda n: values.get(n) if isinstance(n, fx.Node) else n)
            paths = ("fbgemm", "direct", "loop") if gr.pooling != "none" else ("fbgemm", "loop")
            if _native_fits(gr, args[3]):
                paths = ("native", *paths)
            t_eval = _measure(mod, args, False, ctx.config.timing_rounds, paths)
            trains = any(p.requires_grad for p in args[3])
            t_train = _measure(mod, args, True, ctx.config.timing_rounds, paths) if trains else t_eval
            # direct runs the plain lookups' kernels into a reused buffer: never more work than the
            # plain loop, so within the timing noise (10 %) of it, it is preferred for inference
            prefer = "direct" if "direct" in t_eval and ctx.config.reuse_outputs else None
            gr.path_eval = _fastest(t_eval, prefer)
            gr.path_train = min(t_train, key=t_train.get)
            gr.lower = (gr.path_eval, gr.path_train) != ("loop", "loop")
            gr.timings_ms = {f"fwd_{_NAMES[p]}": t for p, t in t_eval.items()}
            gr.timings_ms.update({f"train_{_NAMES[p]}": t for p, t in t_train.items()})
            gr.why = (
                "measured on the example inputs: forward "
                + " vs ".join(f"{_NAMES[p]} {t:.3g} ms" for p, t in t_eval.items())
                + "; forward+backward "
                + " vs ".join(f"{_NAMES[p]} {t:.3g} ms" for p, t in t_train.items())
            )
        _choose_optimizer_path(gr, backend, values, ctx.config.timing_rounds)
        if not gr.lower and gr.timings_ms:
            gr.why += ": plain lookups are fastest both ways, kept as they were"
        for p in ("fbgemm", "native", "direct"):
            stats[f"{p}_fwd"] += gr.lower and gr.path_eval == p
            stats[f"{p}_train"] += gr.lower and gr.path_train == p
        stats["kept_plain"] += not gr.lower
        ctx.report.groups.append(
            GroupEntry(
                name=gr.name, pooling=gr.pooling, tables=[r.table for r in gr.lookups if r.table],
                features=[r.feature for r in gr.lookups], lowered=gr.lower,
                path_train=gr.path_train if gr.lower else "plain", path_eval=gr.path_eval if gr.lower else "plain",
                why=gr.why, timings_ms=dict(gr.timings_ms), optimizer=_optimizer_text(gr),
            )
        )
    return PassResult(gm, False, {"groups": len(ctx.groups), **stats})


def _choose_optimizer_path(gr: meta.GroupRecord, backend: str, values: Dict, rounds: int) -> None:
    """Where the group's optimizer runs: fused into fbgemm's backward, or torch.optim in step().

    With backend="auto" and an optimizer fbgemm can fuse, one training step of the group is timed
    on copies of its tables: fused by fbgemm (forward + backward with the update), fused by fxrec
    (SGD only: the faster forward, and index_add_ of the gradient rows in backward), by fxrec's
    native kernels (on CPU where they are built: SGD, Adagrad, row-wise Adagrad), and the
    fallback (forward + backward with sparse gradients + the torch.optim step); the fastest is
    kept. Groups that fbgemm's fused kernels would get wrong are not given to them: a table
    also used outside its lookups (its other gradient would be lost) and an nn.Embedding
    padding row (fbgemm would update it).
    """
    opt = gr.optimizer
    gr.fused = None
    if opt is None:
        return
    spec = opt.fused_spec()
    if spec is None:
        gr.why += f"; optimizer: {opt.fused_unsupported_reason()}, so torch.optim in opt.step()"
        return
    outside = uses_outside_group(gr)
    if outside:
        gr.why += (f"; optimizer: table '{outside}' is also used outside its lookups, and a fused update "
                   "would miss that gradient, so torch.optim in opt.step()")
        return
    gr.lower = True  # keeps the module's sparse gradients for the fallback
    padded = next((r.table for r in gr.lookups if r.padding_idx is not None and r.form != "bag"), "")
    if padded and spec.kind != "sgd":
        gr.why += (f"; optimizer: nn.Embedding '{padded}' has a padding row, which fbgemm's fused "
                   f"{spec.kind} would update, so torch.optim in opt.step()")
        return
    if padded:  # fxrec's own fused SGD leaves the padding row alone; fbgemm's would not
        spec = dataclasses.replace(spec, impl="torch")
    # fxrec's fused SGD ("torch") runs after the faster of the forwards that feed fxrec's backward.
    if gr.pooling == "none" or backend == "fbgemm":
        torch_fwd = "fbgemm"
    elif backend in ("direct", "native"):
        torch_fwd = "direct"
    else:
        t = gr.timings_ms
        torch_fwd = "fbgemm" if t.get("fwd_fbgemm", 1.0) < t.get("fwd_direct", 0.0) else "direct"
    own = backend in ("direct", "native") and gr.pooling != "none"  # no fbgemm kernels for this group
    # fxrec's own updates: SGD ("torch": index_add_), SGD and the Adagrads ("native" kernels)
    if backend == "loop" or (own and spec.kind not in _OWN_UPDATES[backend]):
        gr.why += f"; optimizer: backend={backend!r}, so torch.optim in opt.step()"
        return
    if own:
        spec = dataclasses.replace(spec, impl="native" if backend == "native" else "torch")

    def train_path(s) -> str:
        return {"torch": torch_fwd, "native": "native"}.get(s.impl, "fbgemm")

    if backend == "auto" and all(r.ids in values for r in gr.lookups):
        native = spec.kind in _OWN_UPDATES["native"] and _native_fits(
            gr, [values[r.weight] for r in gr.lookups if isinstance(r.weight, fx.Node) and r.weight in values])
        t = _time_optimizer_paths(gr, spec, values, rounds, torch_fwd, native)
        gr.timings_ms.update({f"step_{k}": v for k, v in t.items()})
        best = min(t, key=t.get)
        measured = ", ".join(f"{k} {v:.3g} ms" for k, v in t.items())
        if best == "fallback":
            gr.why += f"; optimizer: torch.optim in opt.step() on sparse gradients, measured fastest a step ({measured})"
            return
        if best in ("fused_torch", "fused_native"):
            spec = dataclasses.replace(spec, impl=best[len("fused_"):])
        gr.fused, gr.path_train = spec, train_path(spec)
        gr.why += f"; optimizer: fused {spec.kind} inside backward by {spec.impl}, measured fastest a step ({measured})"
        return
    gr.why += f"; optimizer: fused {spec.kind} inside backward"
    gr.fused, gr.path_train = spec, train_path(spec)


def _time_optimizer_paths(gr: meta.GroupRecord, spec, values: Dict, rounds: int, torch_fwd: str,
                          native: bool) -> Dict[str, float]:
    def scratch():
        _, index = build_group_module(gr, with_optimizer=False)
        args = group_inputs(gr, index, lambda n: values.get(n) if isinstance(n, fx.Node) else n)
        params = [torch.nn.Parameter(p.detach().clone()) for p in args[3]]
        return args[:3] + (params,)

    saved = (gr.fused, gr.path_train)
    impls = {} if spec.impl == "torch" else {"fused": spec}
    if spec.kind == "sgd":
        impls["fused_torch"] = dataclasses.replace(spec, impl="torch")
    if native:
        impls["fused_native"] = dataclasses.replace(spec, impl="native")
    fns = {}
    for name, variant in impls.items():
        gr.fused, gr.path_train = variant, {"torch": torch_fwd, "native": "native"}.get(variant.impl, "fbgemm")
        mod, _ = build_group_module(gr)
        fns[name] = (lambda m, a: lambda: _backward_ones(m(*a)))(mod, scratch())
    gr.fused, gr.path_train = saved
    fallback_mod, _ = build_group_module(gr, with_optimizer=False)
    fallback_args = scratch()
    fallback_opt = gr.optimizer.torch_optimizer(fallback_args[3], sparse=True)

    def fallback_step():
        fallback_opt.zero_grad(set_to_none=True)
        _backward_ones(fallback_mod(*fallback_args))
        fallback_opt.step()

    fns["fallback"] = fallback_step
    times: Dict[str, List[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(rounds):
        for k, f in fns.items():
            start = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def _optimizer_text(gr: meta.GroupRecord) -> str:
    if gr.optimizer is None:
        return ""
    where = "fused into backward" if gr.fused is not None else "torch.optim in opt.step()"
    return f"{gr.optimizer.describe()}: {where}"
