"""Compare a transformed model against the original: outputs, and gradients of every parameter."""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Dict, Iterator, List, Sequence, Tuple

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree


class VerificationError(AssertionError):
    """The transformed model disagrees with the original; the message names what and by how much."""


def _float_leaves(out) -> List[torch.Tensor]:
    return [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor) and x.is_floating_point()]


@contextlib.contextmanager
def buffers_kept(*modules: torch.nn.Module, params: Sequence[str] = ()) -> Iterator[None]:
    """Run models without leaving a trace in their buffers (batch norm's running statistics and
    counter, anything the model's code updates in place), in the tables their forward writes (the
    rows a ``max_norm`` table renormalises, the parameters ``params`` names), or in torch's random
    state."""
    from .runtime.group import EmbeddingGroup  # (its buffers are tables: never written by a forward)

    saved = [(b, b.detach().clone()) for m in modules for sub in m.modules() if not isinstance(sub, EmbeddingGroup)
             for b in sub.buffers(recurse=False)]
    saved += [(p, p.detach().clone()) for p in _written_params(modules, params)]
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):  # (manual_seed inside also seeds every CUDA device)
        try:
            yield
        finally:
            with torch.no_grad():
                for b, old in saved:
                    b.copy_(old)


def written_in_forward(gm: torch.nn.Module) -> List[str]:
    """The parameters a captured graph's forward writes in place (``max_norm``'s renormalisation,
    a weight changed under ``no_grad``), by name."""
    from .dataflow import hop_effects
    from .passes.annotate_lookups import _mutated_in_graph

    graph = getattr(gm, "graph", None)
    if not isinstance(graph, fx.Graph):
        return []
    named = {n for n, _ in gm.named_parameters()}
    out = [n.target for n in graph.nodes if n.op == "get_attr" and n.target in named and _mutated_in_graph(n)]
    for block in graph.nodes:  # written in a higher-order op's body (torch.no_grad(): self.emb.weight.mul_(0.5))
        if block.op == "call_function" and isinstance(block.target, torch._ops.HigherOrderOperator):
            out += [o.target for o in hop_effects(block)[1]
                    if o.op == "get_attr" and o.target in named and o.target not in out]
    return out


def _written_params(modules, names: Sequence[str]) -> List[torch.Tensor]:
    found: Dict[int, torch.Tensor] = {}
    for m in modules:
        held = dict(m.named_parameters())
        for p in [held[n] for n in names if n in held] + [
                sub.weight for sub in m.modules() if getattr(sub, "max_norm", None) is not None
                and isinstance(getattr(sub, "weight", None), torch.Tensor)]:
            found[id(p)] = p
    return list(found.values())


def _run(model, args, kwargs, seed: int, written: Sequence[str] = ()):
    for p in model.parameters():
        p.grad = None
    with buffers_kept(model, params=written):  # (restored after backward, which may read what forward wrote)
        torch.manual_seed(seed)  # the same dropout masks in both models
        out = model(*copy.deepcopy(args), **copy.deepcopy(kwargs))
        leaves = _float_leaves(out)
        g = torch.Generator().manual_seed(seed)
        loss = None
        for x in leaves:
            if x.requires_grad:
                cot = torch.randn(x.shape, generator=g, dtype=x.dtype).to(x.device)
                term = (x * cot).sum()
                loss = term if loss is None else loss + term
        if loss is not None:
            loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads[name] = p.grad.to_dense() if p.grad.is_sparse else p.grad.clone()
        p.grad = None
    return [x.detach() for x in leaves], grads


def compare_models(
    reference: torch.nn.Module, transformed: torch.nn.Module, args: Tuple[Any, ...],
    kwargs: Dict[str, Any], rtol: float = 1.3e-6, atol: float = 1e-5, seed: int = 0,
) -> Dict[str, float]:
    """Raise VerificationError unless outputs and parameter gradients agree; return the max diffs."""
    written = written_in_forward(transformed)  # (left as they were in both models)
    ref_out, ref_grads = _run(reference, args, kwargs, seed, written)
    new_out, new_grads = _run(transformed, args, kwargs, seed, written)
    problems: List[str] = []
    diffs: Dict[str, float] = {}
    if len(ref_out) != len(new_out):
        raise VerificationError(f"fxrec verify: the original returns {len(ref_out)} float tensors, the transformed model {len(new_out)}")
    for i, (a, b) in enumerate(zip(ref_out, new_out)):
        if a.shape != b.shape:
            problems.append(f"output {i}: shape {tuple(b.shape)} != {tuple(a.shape)}")
            continue
        d = (a - b).abs().max().item() if a.numel() else 0.0
        diffs[f"output {i}"] = d
        if not torch.allclose(a, b, rtol=rtol, atol=atol):
            problems.append(f"output {i}: largest difference {d:.3g}")
    for name in sorted(set(ref_grads) | set(new_grads)):
        if name not in new_grads or name not in ref_grads:
            side = "transformed model" if name not in new_grads else "original model"
            problems.append(f"table/parameter '{name}': no gradient in the {side}")
            continue
        a, b = ref_grads[name], new_grads[name]
        d = (a - b).abs().max().item() if a.numel() else 0.0
        diffs[name] = d
        if not torch.allclose(a, b, rtol=rtol, atol=atol * 10):
            problems.append(f"gradient of '{name}': largest difference {d:.3g}")
    if problems:
        problems += _differing_weights(reference, transformed) or _diagnose_groups(transformed, args, kwargs, rtol, atol)
        raise VerificationError("fxrec verify failed:\n  " + "\n  ".join(problems))
    return diffs


def _differing_weights(reference: torch.nn.Module, transformed: torch.nn.Module) -> List[str]:
    """The parameters and buffers of one name and shape in both models whose values differ: the two
    models were not compared from the same weights (four named, the rest counted)."""
    mine = transformed.state_dict()
    out = []
    for name, a in reference.state_dict().items():
        b = mine.get(name)
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.shape != b.shape:
            continue
        with torch.no_grad():
            if torch.equal(a.detach().cpu(), b.detach().cpu().to(a.dtype)):
                continue
            d = (a.detach().cpu().double() - b.detach().cpu().double()).abs().max().item() \
                if a.is_floating_point() else float("nan")
        out.append(f"'{name}' holds other values in the transformed model than in the original (largest "
                   f"difference {d:.3g}): the two were not compared from the same weights")
    return out[:4] + ([f"{len(out) - 4} more parameters or buffers differ"] if len(out) > 4 else [])


def _diagnose_groups(gm: torch.nn.Module, args, kwargs, rtol: float, atol: float) -> List[str]:
    """Name the tables whose lowered lookup disagrees with the plain lookup on these inputs."""
    from .runtime.group import EmbeddingGroup

    groups = {n: m for n, m in gm.named_modules() if isinstance(m, EmbeddingGroup)}
    if not groups:
        return []
    seen: Dict[str, tuple] = {}
    handles = [m.register_forward_pre_hook(lambda mod, a, n=n: seen.setdefault(n, a)) for n, m in groups.items()]
    try:
        with torch.no_grad():
            gm(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    finally:
        for h in handles:
            h.remove()
    found: List[str] = []
    for name, a in seen.items():
        mod = groups[name]
        with torch.no_grad():
            got = mod(*a)
            want = mod.lookups(*a)
        if isinstance(got, torch.Tensor):
            got = list(torch.split(got, mod.dims, 1))
            want = list(torch.split(want, mod.dims, 1))
        for f, x, y in zip(mod.features, got, want):
            if not torch.allclose(x, y, rtol=rtol, atol=atol):
                d = (x - y).abs().max().item()
                found.append(
                    f"table '{mod.tables[f.table].name}' (feature '{f.name}', {name}): the "
                    f"{mod.kernel_eval} kernel differs from the plain lookup by {d:.3g}"
                )
    if not found:
        found.append("every lowered lookup matches the plain lookup on these inputs: the difference comes from elsewhere in the model")
    return found
