"""Reshapes of tensors whose layout depends on their sizes, traced on a copy while capturing.

A slice of columns (``ids[:, :3]``) or a transpose is contiguous for some sizes (one row) and not
for others, so torch's ``reshape`` of it views or copies by its sizes, and a size-oblivious
capture (:func:`fxrec.capture.export_dynamic`) writes that choice down as guards on the sizes
(``ids.size()[0] != 1``), which fxrec keeps as the transformed model's input checks.
:func:`reshape_by_copy`, on in every capture, traces such a reshape on a row-major copy where it
copies the example, which needs no guard. :func:`linear_without_layout_guards` traces a linear
layer of such a tensor without the guards of linear's own choice of computation (its result is the
same either way), and :func:`linear_nodes_as_functions` does the same when a transformed model is
exported again.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
import torch._prims_common

from .thread_patches import ThreadPatch


def _surely_contiguous(t: torch.Tensor) -> bool:
    """Whether ``t``'s sizes and strides are contiguous for every value of their size symbols
    (False where that depends on them), asking torch nothing it would record as a guard."""
    return bool(torch._prims_common.is_contiguous_or_false(t))


class _NoExampleValue(Exception):
    pass


def _at_example(v):
    """``v`` with each size at its example value (a tensor: an empty meta tensor of those sizes)."""
    if isinstance(v, torch.SymInt):
        hint = getattr(v.node, "hint", None)
        if hint is None:  # (an unbacked size: torch 2.11 sizes a slice so)
            raise _NoExampleValue
        return int(hint)
    if isinstance(v, torch.Tensor):
        return torch.empty([_at_example(s) for s in v.shape], device="meta")
    if isinstance(v, list):
        return [_at_example(x) for x in v]
    if isinstance(v, tuple):  # (torch.Size too)
        return tuple(_at_example(x) for x in v)
    if isinstance(v, dict):
        return {k: _at_example(x) for k, x in v.items()}
    return v


def _views_at_example(op, t: torch.Tensor, args, kwargs) -> Optional[bool]:
    """Whether ``op(t, *args, **kwargs)`` gives ``t`` or a view of it (no copy) at the example's
    sizes and strides, asked of an empty meta tensor laid out so; None where a size has no example
    value; True where the op fails there (torch's own call then raises what it raises)."""
    try:
        probe = torch.empty_strided([_at_example(s) for s in t.shape], [_at_example(s) for s in t.stride()],
                                    device="meta")
        out = op(probe, *_at_example(tuple(args)), **_at_example(dict(kwargs)))
    except _NoExampleValue:
        return None
    except Exception:  # noqa: BLE001 - the op itself raises it below
        return True
    return out is probe or (isinstance(out, torch.Tensor) and out._is_view())


def _flattens_nothing(t: torch.Tensor, args, kwargs) -> bool:
    """Whether ``flatten(t, *args, **kwargs)`` flattens one dim or none: it gives ``t`` itself."""
    start = kwargs.get("start_dim", args[0] if len(args) > 0 else 0)
    end = kwargs.get("end_dim", args[1] if len(args) > 1 else -1)
    if not isinstance(start, int) or not isinstance(end, int):
        return False  # (named dims: torch's own)
    n = max(t.dim(), 1)
    return start % n == end % n


def _by_copy(op, name: str):
    contiguous = name == "contiguous"
    flatten = name == "flatten"

    @functools.wraps(op)
    def traced(*args, **kwargs):
        if _BY_COPY.on():
            key = None if args else "input" if "input" in kwargs else "self" if "self" in kwargs else None
            t = args[0] if args else kwargs.get(key) if key else None
            rest = args[1:] if args else ()
            other = {k: v for k, v in kwargs.items() if k != key}
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and not _surely_contiguous(t) \
                    and not (contiguous and (rest or other.get("memory_format", torch.contiguous_format)
                                             is not torch.contiguous_format)) \
                    and not (flatten and _flattens_nothing(t, rest, other)) \
                    and not _views_at_example(op, t, rest, other):
                # (where the op views the example, it is left as torch traces it: a write through
                # the view must reach the tensor, as in the model)
                t = t.clone(memory_format=torch.contiguous_format)
                return op(t, *rest, **other)
        return op(*args, **kwargs)

    return traced


#: the ops :func:`reshape_by_copy` traces on a copy
_BY_COPY = ThreadPatch([(torch.Tensor, "reshape"), (torch.Tensor, "flatten"), (torch.Tensor, "ravel"),
                        (torch.Tensor, "reshape_as"), (torch.Tensor, "contiguous"), (torch, "reshape"),
                        (torch, "flatten"), (torch, "ravel")], _by_copy)


def reshape_by_copy():
    """Within, this thread traces a reshape (``reshape``, ``flatten``, ``ravel``, ``reshape_as``,
    the ``torch.`` functions too) or ``contiguous()`` of a tensor whose contiguity depends on its
    sizes (a slice of columns ``ids[:, :3]``, a transpose), where the op copies the example, as a
    row-major copy (``clone``) then that op, which on the copy is a view. Where the op views the
    example, it is traced as torch traces it (a write through the view reaches the tensor, as in
    the model). Size-oblivious capture traces such a reshape with guards that refuse a size of 1
    (``ids.size()[0] != 1``) or a slice that takes a whole dim
    (``ids.size()[1] != min(3, ids.size()[1])``), which the captured model, and its exported
    program, then kept as input checks: a transformed ``bag(ids[:, :3])`` refused a batch of one,
    which the plain model takes. The copy needs no guard, and costs what the reshape of such a
    tensor costs (it copies it too; a call whose tensor happens to be contiguous, as a slice of one
    row, copies where the reshape would not: a model that writes in place through such a reshape's
    result reaches its input at a batch of 1 but not in the transformed model).
    ``F.embedding_bag``'s flattening of ``[B, L]`` ids and fxrec's own packing (while exporting)
    are among them. See :mod:`fxrec.thread_patches`."""
    return _BY_COPY()


def _layout_free(op, name: str):
    @functools.wraps(op)
    def traced(input, weight, bias=None):
        if _LINEAR.on() and isinstance(input, torch.Tensor) and input.dim() >= 3 and not _surely_contiguous(input):
            from torch._guards import detect_fake_mode

            env = getattr(detect_fake_mode((input, weight)), "shape_env", None)
            if env is not None:
                bool(input.shape[-1] == weight.shape[-1])  # (the condition the op needs, kept as torch keeps it)
                with env.suppress_guards():
                    return op(input, weight, bias)
        return op(input, weight, bias)

    return traced


#: the ops :func:`linear_without_layout_guards` traces
_LINEAR = ThreadPatch([(torch.nn.functional, "linear")], _layout_free)


def linear_without_layout_guards():
    """Within, this thread traces ``F.linear`` (``nn.Linear``'s, ``nn.MultiheadAttention``'s) of
    a tensor of 3 or more dims whose contiguity depends on its sizes (a transpose: ``[L, B, E]``
    from ``[B, L, E]``, as attention takes it) without keeping the conditions on its sizes that
    choosing its own way of computing wrote down: torch's linear computes a contiguous input in one
    matrix multiply with the bias, another by ``matmul`` then the bias, and size-oblivious capture
    kept that choice as guards refusing a size of 1 (``ids.size()[0] != 1``) where the input is
    contiguous. The graph keeps one ``aten.linear`` node, which chooses again at each call as the
    model's own does (so the numbers are the model's, bit for bit), and its result is a new
    contiguous tensor of the same sizes either way. The condition the op needs (the input's last
    dim is the weight's) is kept. A row-major copy, as :func:`reshape_by_copy` makes, would need no
    guard but change the numbers (one fused multiply-add against two steps: last bits differ)."""
    return _LINEAR()


def _linear(input, weight, bias=None):
    """``aten.linear`` of a transformed model's graph while it is exported again: ``F.linear``,
    which :func:`linear_without_layout_guards` traces."""
    return torch.nn.functional.linear(input, weight, bias)


@contextlib.contextmanager
def linear_nodes_as_functions(model: torch.nn.Module):
    """Within, each ``aten.linear`` node of ``model``'s graphs calls ``F.linear`` (:func:`_linear`),
    so that exporting the transformed model (``fxrec.export.program``) traces it as the capture did,
    without guards from its choice of computation (:func:`linear_without_layout_guards`); the
    exported program records ``aten.linear`` again. The graphs are put back after."""
    changed = []
    for gm in model.modules():
        if isinstance(gm, torch.fx.GraphModule):
            nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.linear.default]
            for n in nodes:
                n.target = _linear
            if nodes:
                changed.append((gm, nodes))
                gm.recompile()
    try:
        yield
    finally:
        for gm, nodes in changed:
            for n in nodes:
                n.target = torch.ops.aten.linear.default
            gm.recompile()
