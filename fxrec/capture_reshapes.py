"""Reshapes of tensors whose layout depends on their sizes, traced on a copy while capturing.

A slice of columns (``ids[:, :3]``) or a transpose is contiguous for some sizes (one row) and not
for others, so torch's ``reshape`` of it views or copies by its sizes, and a size-oblivious
capture (:func:`fxrec.capture.export_dynamic`) writes that choice down as guards on the sizes
(``ids.size()[0] != 1``), which fxrec keeps as the transformed model's input checks.
:func:`reshape_by_copy`, on in every capture, traces such a reshape on a row-major copy where it
copies the example, which needs no guard. :func:`without_own_guards` traces a few ops (linear,
dropout, attention of such a tensor; einsum and recurrent cells of any sized tensor) without the
guards of the op's own workings, which the graph's one node of the op does not need (it decides
again at each call), and :func:`nodes_as_functions` does the same when a transformed model is
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
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    try:  # (not traced: the probe and the op on it were recorded in the graph, dead but run at every call)
        with disable_proxy_modes_tracing():
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


def _unguarded(t: torch.Tensor, min_dim: int, *others, layout: bool = True) -> Optional[object]:
    """The shape environment to trace an op of ``t`` in without guards, where ``t``'s contiguity
    depends on its sizes (``layout=False``: where it has a size symbol); None otherwise (traced as
    torch traces it)."""
    if not isinstance(t, torch.Tensor) or t.dim() < min_dim:
        return None
    if (_surely_contiguous(t) if layout else all(isinstance(d, int) for d in t.shape)):
        return None
    from torch._guards import detect_fake_mode

    return getattr(detect_fake_mode((t,) + others), "shape_env", None)


def _same_batch_dims(a: torch.Tensor, b: torch.Tensor) -> None:
    """Keep, as torch keeps them, the conditions that the batch dims (all but the last two, aligned
    from the right) of two attention operands are equal where they are at the example: the output's
    sizes are traced as one operand's, which a broadcast at another call (a query of batch 1 against
    keys of batch 3) would make wrong. Dims unequal at the example (grouped heads, a batch of 1
    broadcast) are left as traced."""
    for x, y in zip(reversed(a.shape[:-2]), reversed(b.shape[:-2])):
        try:
            same = _at_example(x) == _at_example(y)
        except _NoExampleValue:
            same = True
        if same:
            bool(x == y)


def _same_letter_dims(equation: str, operands) -> None:
    """Keep, as torch keeps them, the conditions that the dims an einsum ``equation`` names by one
    letter are equal where they are at the example (the output's sizes are traced as one operand's,
    which a broadcast of a size of 1 at another call would make wrong)."""
    seen = {}
    for letters, t in zip(equation.split("->")[0].replace(" ", "").split(","), operands):
        for letter, d in zip(letters, t.shape):
            if letter not in seen:
                seen[letter] = d
                continue
            try:
                same = _at_example(seen[letter]) == _at_example(d)
            except _NoExampleValue:
                same = True
            if same:
                bool(seen[letter] == d)


def _without_own_guards(op, name: str):
    if name == "linear":
        @functools.wraps(op)
        def traced(input, weight, bias=None):
            env = _unguarded(input, 3, weight) if _UNGUARDED.on() else None
            if env is None:
                return op(input, weight, bias)
            bool(input.shape[-1] == weight.shape[-1])  # (the condition the op needs, kept as torch keeps it)
            with env.suppress_guards():
                return op(input, weight, bias)
        return traced

    if name == "scaled_dot_product_attention":
        @functools.wraps(op)
        def traced_attention(query, key, value, *args, **kwargs):
            env = None
            if _UNGUARDED.on():
                env = next((e for e in (_unguarded(t, 1, query, key, value) for t in (query, key, value))
                            if e is not None), None)
            if env is None:
                return op(query, key, value, *args, **kwargs)
            bool(query.shape[-1] == key.shape[-1])  # (the conditions the op needs, kept as torch keeps them)
            bool(key.shape[-2] == value.shape[-2])
            _same_batch_dims(query, key)
            _same_batch_dims(key, value)
            with env.suppress_guards():
                return op(query, key, value, *args, **kwargs)
        return traced_attention

    if name in ("gru_cell", "lstm_cell"):
        @functools.wraps(op)
        def traced_cell(input, hx, w_ih, *args):
            env = None
            if _UNGUARDED.on() and isinstance(input, torch.Tensor):
                states = list(hx) if isinstance(hx, (list, tuple)) else [hx]
                env = _unguarded(input, 1, *states, layout=False)
                if env is not None:
                    bool(input.shape[-1] == w_ih.shape[-1])  # (the conditions the cell needs, kept)
                    for h in states:
                        bool(input.shape[0] == h.shape[0])
            if env is None:
                return op(input, hx, w_ih, *args)
            with env.suppress_guards():
                return op(input, hx, w_ih, *args)
        return traced_cell

    if name == "einsum":
        @functools.wraps(op)
        def traced_einsum(*args):
            env = None
            operands = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
            if _UNGUARDED.on() and args and isinstance(args[0], str) and "..." not in args[0] and operands \
                    and all(isinstance(t, torch.Tensor) for t in operands):
                env = next((e for e in (_unguarded(t, 1, *operands, layout=False) for t in operands)
                            if e is not None), None)
            if env is None:
                return op(*args)
            _same_letter_dims(args[0], operands)
            with env.suppress_guards():
                return op(*args)
        return traced_einsum

    @functools.wraps(op)
    def traced_dropout(input, p=0.5, training=True, inplace=False):
        env = _unguarded(input, 1) if _UNGUARDED.on() else None
        with env.suppress_guards() if env is not None else contextlib.nullcontext():
            return op(input, p, training, inplace)
    return traced_dropout


#: the ops :func:`without_own_guards` traces
_UNGUARDED = ThreadPatch([(torch.nn.functional, "linear"), (torch.nn.functional, "dropout"),
                          (torch.nn.functional, "scaled_dot_product_attention"), (torch, "einsum"),
                          (torch._VF, "gru_cell"), (torch._VF, "lstm_cell")], _without_own_guards)


def without_own_guards():
    """Within, this thread traces ``F.linear`` of a tensor of 3 or more dims (``nn.Linear``'s,
    ``nn.MultiheadAttention``'s), and ``F.dropout`` (``nn.Dropout``'s) and
    ``F.scaled_dot_product_attention`` of tensors, whose contiguity depends on their sizes (a
    transpose: ``[L, B, E]`` from ``[B, L, E]``, as attention takes it and gives it back), and
    ``torch.einsum`` (without ``...``) and ``torch._VF.gru_cell`` / ``lstm_cell`` (``nn.GRUCell``'s,
    ``nn.LSTMCell``'s) of tensors with a size symbol, without keeping the
    conditions on sizes that the op's own workings wrote down. torch's linear computes a contiguous
    input in one matrix multiply with the bias, another by ``matmul`` then the bias; dropout's mask
    checks its memory for overlap; attention with dropout reshapes its operands for its products;
    einsum treats a dim of size 1 as one to broadcast; the cells copy their result. Size-oblivious
    capture kept those as guards refusing a size of 1 (``ids.size()[0] != 1``, ``ids.size()[0] >=
    2``): a model with attention or a transformer layer refused a batch or a length of 1. The graph
    keeps one node of each (``aten.linear``, ``aten.dropout``, ``aten.scaled_dot_product_attention``,
    ``aten.einsum``, ``aten.gru_cell``, ``aten.lstm_cell``),
    which works again at each call as the model's own does (so the numbers are the model's, bit for
    bit), and the graph after it runs as the model's code runs on that result. The conditions the
    ops need of their operands' sizes (linear: the input's last dim is the weight's; attention: the
    query's last is the key's, the key's length the value's, their batch dims as at the example;
    einsum: the dims one letter names, as at the example; the cells: the input's width and batch,
    the state's batch) are kept, so the sizes traced for the
    result are its sizes at any call. A row-major copy, as
    :func:`reshape_by_copy` makes, would need no guard but change linear's numbers (one fused
    multiply-add against two steps: last bits differ)."""
    return _UNGUARDED()


def _linear(input, weight, bias=None):
    """``aten.linear`` of a transformed model's graph while it is exported again: ``F.linear``,
    which :func:`without_own_guards` traces."""
    return torch.nn.functional.linear(input, weight, bias)


def _dropout(input, p, train):
    """``aten.dropout`` of a transformed model's graph while it is exported again."""
    return torch.nn.functional.dropout(input, p, bool(train))


def _einsum(equation, tensors, path=None):
    """``aten.einsum`` of a transformed model's graph while it is exported again."""
    return torch.einsum(equation, list(tensors))


def _gru_cell(*args):
    """``aten.gru_cell`` of a transformed model's graph while it is exported again."""
    return torch._VF.gru_cell(*args)


def _lstm_cell(*args):
    """``aten.lstm_cell`` of a transformed model's graph while it is exported again."""
    return torch._VF.lstm_cell(*args)


def _attention(*args, **kwargs):
    """``aten.scaled_dot_product_attention`` of a transformed model's graph while it is exported again."""
    return torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)


#: the graph's ops :func:`nodes_as_functions` gives back to the functions capture traced
_AS_FUNCTIONS = {torch.ops.aten.linear.default: _linear, torch.ops.aten.dropout.default: _dropout,
                 torch.ops.aten.scaled_dot_product_attention.default: _attention,
                 torch.ops.aten.einsum.default: _einsum, torch.ops.aten.gru_cell.default: _gru_cell,
                 torch.ops.aten.lstm_cell.default: _lstm_cell}


@contextlib.contextmanager
def nodes_as_functions(model: torch.nn.Module):
    """Within, each node of ``model``'s graphs of an op :func:`without_own_guards` traces calls the
    function capture traced (:data:`_AS_FUNCTIONS`), so that exporting the transformed model
    (``fxrec.export.program``) traces them as the capture did, without guards from their own
    workings (:func:`without_own_guards`); the exported program records the aten ops again. The
    graphs are put back after."""
    changed = []
    for gm in model.modules():
        if isinstance(gm, torch.fx.GraphModule):
            nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _AS_FUNCTIONS]
            for n in nodes:
                n.target = _AS_FUNCTIONS[n.target]
            if nodes:
                changed.append((gm, nodes))
                gm.recompile()
    try:
        yield
    finally:
        back = {f: op for op, f in _AS_FUNCTIONS.items()}
        for gm, nodes in changed:
            for n in nodes:
                n.target = back[n.target]
            gm.recompile()
