"""Embedding bags captured as one opaque operator, put back as aten's own after capture.

Why. With a size symbol per input, tracing aten's ``embedding_bag`` costs about 8 ms a call on
fake tensors: its meta function and the checks around it compare fresh symbols through sympy. On
the 256-table benchmark model that was 2.2 s of a 4.5 s capture. While :func:`opaque_bags` is
active in a thread, ``torch.embedding_bag`` (what ``F.embedding_bag`` and ``nn.EmbeddingBag`` call
after their Python-level argument handling, which runs unchanged) records
``fxrec_capture::embedding_bag`` instead: the same schema as ``aten::embedding_bag.padding_idx``,
whose fake function computes the pooled output's size directly and keeps what aten checks and
evaluates on a model's inputs (dtypes, ``padding_idx`` range, per-sample weights,
``include_last_offset``, the strides aten tests), so capture errors and the captured input guards
stay what they were; the output requires grad where aten's would. :func:`restore_aten` then puts
``aten.embedding_bag.padding_idx`` and its four ``getitem`` nodes back, in every graph module
(``torch.no_grad()`` blocks and ``torch.cond`` branches have their own), with the values and
metadata torch records: the program is the one torch's own capture gives (tests compare the two)
but for the numbering of ``getitem`` nodes, and an exported program's signature is renamed to match.

Only calls with ``F.embedding_bag``'s positional form are recorded this way; any other call of
``torch.embedding_bag`` (and every call in another thread, or outside :func:`opaque_bags`) is
torch's own. While any thread captures, ``torch.embedding_bag`` is a Python function, which other
threads see (``torch.jit.script`` of code calling it fails until the capture ends).

:func:`bags_of_rows`, on in every capture: ``F.embedding_bag`` of ``[B, L]`` ids whose L is
computed from other sizes is traced with the offsets ``arange(B) * L`` rather than torch's
``arange(0, B * L, L)`` (same values; see there).
"""

from __future__ import annotations

import functools
import operator
import sys
from typing import Dict

import torch
import torch.fx as fx
from torch.fx.experimental import proxy_tensor

from .thread_patches import ThreadPatch

_MODE_SUM, _MODE_MEAN, _MODE_MAX = 0, 1, 2


def _bag(weight, indices, offsets, scale_grad_by_freq, mode, sparse, per_sample_weights, include_last_offset,
         padding_idx):
    """Eager form (only reached if a recorded node is run before :func:`restore_aten`): aten's."""
    return torch.ops.aten.embedding_bag.padding_idx(weight, indices, offsets, scale_grad_by_freq, mode, sparse,
                                                    per_sample_weights, include_last_offset, padding_idx)[0].clone()


def _bag_fake(weight, indices, offsets, scale_grad_by_freq, mode, sparse, per_sample_weights, include_last_offset,
              padding_idx):
    """The pooled output's size as aten's meta function gives it (torch/_meta_registrations.py,
    ``meta_embedding_bag``), with the checks a model's inputs can fail."""
    torch._check(indices.dtype in (torch.long, torch.int),
                 lambda: f"expected indices to be long or int, got {indices.dtype}")
    torch._check(offsets.dtype in (torch.long, torch.int),
                 lambda: f"expected offsets to be long or int, got {offsets.dtype}")
    torch._check(weight.dtype.is_floating_point, lambda: f"expected weight to be floating point type, got {weight.dtype}")
    torch._check(weight.dim() == 2, lambda: f"embedding_bag: weight must be 2-D, got {weight.dim()}-D")
    torch._check(indices.dim() == 1 and offsets.dim() == 1,
                 lambda: f"embedding_bag: expected 1-D indices and offsets, got {indices.dim()}-D and {offsets.dim()}-D")
    rows = weight.size(0)
    if padding_idx is not None:  # aten's composite checks it (F.embedding_bag does not)
        torch._check(-rows <= padding_idx < rows, lambda: f"padding_idx must be within the number of embeddings, "
                     f"-{rows} through {rows - 1}, but got {padding_idx}")
    # what aten's composite and meta function evaluate on the inputs' sizes and strides, so that the
    # same conditions on them are recorded (inputs with strides that are not 1 make some)
    for t in (offsets, indices):  # aten calls .contiguous(): the same test, without the op, and
        if not (type(t.stride(0)) is int and t.stride(0) == 1):  # free where the stride is a plain 1
            bool(t.is_contiguous())
    if offsets.device.type == "cpu":
        _fast_sum(weight, per_sample_weights, padding_idx)
    num_bags = offsets.size(0)
    if include_last_offset:
        torch._check(num_bags >= 1, lambda: "include_last_offset: numBags should be at least 1")
        num_bags = num_bags - 1
    if per_sample_weights is not None:
        torch._check(mode == _MODE_SUM, lambda: "embedding_bag: per_sample_weights only supported with mode='sum'")
        torch._check(per_sample_weights.dim() == 1,
                     lambda: f"expected per_sample_weights to be 1D tensor, got {per_sample_weights.dim()}D")
        torch._check(per_sample_weights.numel() == indices.numel(),
                     lambda: f"expected per_sample_weights.numel() ({per_sample_weights.numel()}) to be the same "
                     f"as indices.numel() ({indices.numel()})")
    return weight.new_empty(num_bags, weight.size(1))


def _fast_sum(weight, per_sample_weights, padding_idx) -> bool:
    """aten's CPU test for its index-select sum (``is_fast_path`` in ``meta_embedding_bag``), in its
    order; aten has made a negative ``padding_idx`` a row number (and None -1) by then."""
    pad = -1 if padding_idx is None else padding_idx % weight.size(0)
    return bool(weight.dtype in (torch.float, torch.half) and weight.stride(1) == 1 and pad < 0
                and (per_sample_weights is None or per_sample_weights.stride(0) == 1))


def _other_outputs(output, weight, indices, offsets, mode, per_sample_weights, include_last_offset, padding_idx,
                   made: dict):
    """aten's offset2bag, bag_size and max_indices for these arguments, as fake tensors of the sizes
    its meta functions give (``meta_embedding_bag``, and ``_embedding_bag_forward_only``'s for a
    weight that does not require grad): they go in the restored node's ``meta["val"]``. Nothing
    reads them, so one fake tensor serves every node with the same sizes, dtype and device
    (``made``): making one costs as much as a traced operator."""
    num_bags, dim = output.size(0), output.size(1)

    def empty(like, *sizes):
        key = (like.dtype, like.device, tuple(s.node.expr if isinstance(s, torch.SymInt) else int(s) for s in sizes))
        if key not in made:
            with output.fake_mode:
                made[key] = like.new_empty(sizes)
        return made[key]

    if offsets.device.type != "cpu":
        return (empty(indices, indices.size(0)), empty(indices, offsets.size(0)),
                empty(indices, num_bags, dim) if mode == _MODE_MAX else empty(indices, 0))
    fast_sum = _fast_sum(weight, per_sample_weights, padding_idx)
    offset2bag = empty(offsets, indices.size(0) if mode in (_MODE_MEAN, _MODE_MAX) or not fast_sum else 0)
    bag_size = empty(offsets, num_bags if weight.requires_grad else offsets.size(0))
    max_indices = empty(offsets, num_bags, dim) if mode == _MODE_MAX else empty(offsets, num_bags)
    return offset2bag, bag_size, max_indices


def _define() -> None:
    """The operator, once per process (importing this module again keeps the first definition)."""
    try:
        torch.ops.fxrec_capture.embedding_bag.default
        return
    except (AttributeError, RuntimeError):
        pass
    # torch.library's lower-level API rather than ``custom_op``: that one wraps every call in an
    # autograd.Function, a tenth of the capture time here; capture never differentiates this op
    global _LIB
    _LIB = torch.library.Library("fxrec_capture", "DEF")
    _LIB.define("embedding_bag(Tensor weight, Tensor indices, Tensor offsets, bool scale_grad_by_freq, int mode, "
                "bool sparse, Tensor? per_sample_weights, bool include_last_offset, int? padding_idx) -> Tensor")
    torch.library.impl(_LIB, "embedding_bag", "CompositeExplicitAutograd")(_bag)
    torch.library.register_fake("fxrec_capture::embedding_bag", _bag_fake, lib=_LIB)


_LIB = None
_define()
_FUNCTIONAL_BAG = torch.nn.functional.embedding_bag.__code__


def _wrap(original, name: str = "embedding_bag"):
    @functools.wraps(original)
    def embedding_bag(*args, **kwargs):
        # only F.embedding_bag's own call, which keeps the pooled output and drops the other three
        if _BAGS.on() and len(args) == 9 and not kwargs and sys._getframe(1).f_code is _FUNCTIONAL_BAG:
            pooled = torch.ops.fxrec_capture.embedding_bag.default(*args)
            weight, per_sample_weights = args[0], args[6]
            if torch.is_grad_enabled() and (weight.requires_grad or (per_sample_weights is not None
                                                                     and per_sample_weights.requires_grad)):
                # as aten's output would (the operator has no autograd formula: capture never
                # differentiates it), so that the model's code and what follows see it as torch does
                pooled.requires_grad_(True)
            return pooled, None, None, None
        return original(*args, **kwargs)

    return embedding_bag


_BAGS = ThreadPatch([(torch, "embedding_bag")], _wrap)


def opaque_bags():
    """Within, this thread's ``torch.embedding_bag`` calls record the opaque operator (module doc)."""
    return _BAGS()


def _bags_of_rows(original, name: str = "embedding_bag"):
    @functools.wraps(original)
    def embedding_bag(input, weight, offsets=None, max_norm=None, norm_type=2, scale_grad_by_freq=False, mode="mean",
                      sparse=False, per_sample_weights=None, include_last_offset=False, padding_idx=None):
        if _ROWS.on() and offsets is None and isinstance(input, torch.Tensor) and input.dim() == 2 \
                and not _a_size_of_its_own(input.shape[1]) \
                and not input.is_nested and isinstance(weight, torch.Tensor) and weight.dim() == 2 \
                and not (weight.dtype == torch.long and input.is_floating_point()) \
                and (per_sample_weights is None or per_sample_weights.shape == input.shape):
            b, length = input.shape  # (L a size symbol: a fixed L, 0 included, is torch's own)
            # the length torch's arange computes, checked as it checks it: L = 0 then divides by 0,
            # which the captured model's input checks report naming the ids (a plain L != 0 would
            # be taken as true by the size-oblivious capture, and leave no check)
            torch._check((input.numel() + length - 1) // length >= 0)
            offsets = torch.arange(b, dtype=input.dtype, device=input.device) * length
            input = input.reshape(-1)
            if per_sample_weights is not None:
                per_sample_weights = per_sample_weights.reshape(-1)
            include_last_offset = False
        return original(input, weight, offsets, max_norm, norm_type, scale_grad_by_freq, mode, sparse,
                        per_sample_weights, include_last_offset, padding_idx)

    return embedding_bag


def _a_size_of_its_own(size) -> bool:
    """A fixed size, or an input's own size symbol: not one computed from others (``min(3, s)`` of
    a slice of columns), nor one that stands for such a size unknown at capture (torch 2.11 gives a
    slice's size an unbacked symbol)."""
    if not isinstance(size, torch.SymInt):
        return True
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return bool(getattr(size.node.expr, "is_Symbol", False)) and not free_unbacked_symbols(size)


_ROWS = ThreadPatch([(torch.nn.functional, "embedding_bag")], _bags_of_rows)


def bags_of_rows():
    """Within, this thread's ``F.embedding_bag`` of ``[B, L]`` ids (what ``nn.EmbeddingBag`` does
    with them) whose L is computed from other sizes (a slice of columns ``bag(ids[:, :3])``: L is
    ``min(3, s)``) is traced with the offsets ``arange(B) * L``, where torch writes ``arange(0, B *
    L, L)``: the same values, but a range of B elements, not one whose length divides by L. torch
    2.11 cannot capture that length size-obliviously (a data-dependent guard, and capture fell back
    to sizes of 2 or more). Where L is an input's own size (``bag(ids)``) torch's own form is kept:
    the product is one more op per feature and call (0.2 ms more a call for 26 such features on
    this 2-core CPU). PyTorch's refusal of ``L = 0`` ("step must be nonzero") is kept: the range's
    length is checked as torch's arange checks it, a division by L that the transformed model's
    input checks report naming the ids. Ids of other shapes, offsets given, nested tensors and bad
    arguments go to torch's own function unchanged."""
    return _ROWS()


def restore_aten(root: fx.GraphModule) -> Dict[str, str]:
    """In ``root`` and every graph module under it (the bodies of ``torch.no_grad()`` blocks,
    ``torch.cond`` branches, ...): make every node that recorded the opaque operator aten's
    ``embedding_bag.padding_idx`` (same arguments: the schemas match) followed by ``getitem`` 0 to 3,
    as torch's own capture records it (the pooled output, then offset2bag, bag_size and
    max_indices, which nothing uses), and recompile what changed. Returns, for ``root``'s graph,
    each such node's name -> the name of the getitem that now holds its pooled output (an exported
    program's signature names its outputs)."""
    renamed: Dict[str, str] = {}
    made: dict = {}
    for gm in list(root.modules()):
        if isinstance(gm, fx.GraphModule):
            moved = _restore_graph(gm.graph, made)
            if moved:
                gm.recompile()
            if gm is root:
                renamed = moved
    return renamed


def _requires_grad(arg) -> bool:
    """Whether the traced value of a node argument required grad (its tensor_meta says, else its value)."""
    if not isinstance(arg, fx.Node):
        return False
    record = arg.meta.get("tensor_meta")
    if record is not None and hasattr(record, "requires_grad"):
        return bool(record.requires_grad)
    val = arg.meta.get("val")
    return isinstance(val, torch.Tensor) and val.requires_grad


def _restore_graph(graph: fx.Graph, made: dict) -> Dict[str, str]:
    opaque = torch.ops.fxrec_capture.embedding_bag.default
    # what torch's tracer records as each tensor's "tensor_meta" (fxrec's capture may have wrapped it)
    tensor_meta = getattr(proxy_tensor, "_extract_tensor_metadata", None)
    moved: Dict[str, str] = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not opaque:
            continue
        items = []
        for k in range(4):
            with graph.inserting_after(items[-1] if items else node):
                items.append(graph.call_function(operator.getitem, (node, k)))
        node.replace_all_uses_with(items[0], delete_user_cb=lambda user: user not in items)
        node.target = torch.ops.aten.embedding_bag.padding_idx
        # a custom operator's records, which aten's node has not: "eager_input_vals" wherever this
        # node's meta dict is (torch's passes may share it, with the node a higher-order op's
        # output becomes), "tensor_meta" of the single output it had here only
        node.meta.pop("eager_input_vals", None)
        node.meta = dict(node.meta)
        node.meta.pop("tensor_meta", None)
        weight, indices, offsets, _, mode, _, per_sample_weights, include_last_offset, padding_idx = (
            a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args)
        output = node.meta.get("val")
        vals = [output]
        if isinstance(output, torch.Tensor) and hasattr(output, "fake_mode"):
            vals += _other_outputs(output, weight, indices, offsets, mode, per_sample_weights, include_last_offset,
                                   padding_idx, made)
            node.meta["val"] = tuple(vals)
        # torch's pooled output requires grad where its weight (or sample weights) does (the
        # recorded value, taken before the wrapper marked it, does not say so); under no_grad torch's
        # does not, which this metadata, read by nothing in fxrec, then overstates
        grads = _requires_grad(node.args[0]) or _requires_grad(node.args[6])
        for k, (item, val) in enumerate(zip(items, vals + [None] * 4)):
            item.meta.update({key: v for key, v in node.meta.items() if key != "val"})
            if val is not None:
                item.meta["val"] = val
                if tensor_meta is not None:
                    record = tensor_meta(val)
                    item.meta["tensor_meta"] = record._replace(requires_grad=True) if k == 0 and grads else record
        moved[node.name] = items[0].name
    return moved
