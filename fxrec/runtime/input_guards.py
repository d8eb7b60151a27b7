"""The transformed model's input checks: the sizes it was captured for, with errors that say which
input is wrong and how.

torch.export records what a captured model assumes of its inputs' sizes: each input's number of
dims, the sizes it fixed, the sizes that must be equal (a feature's ids and its per-sample weights),
sizes derived from others, the range of each dynamic size, and conditions the model's own code
tested (``if x.shape[0] % 2``). Its guard function checks them but reports a failure as
``AssertionError: Guard failed: psw.size()[0] == ids[2].size()[0]``, and cannot be pickled.
:class:`InputGuards` checks the same facts: a generated Python function answers ok / not ok in a
few comparisons per input; only when it says no does :meth:`InputGuards.explain` work out which
input broke which fact, naming the input (``ids[2]``) and what it feeds (``ids of feature
'ids_2', table 'bags.2'``). It is plain data (strings and ints) and the function is rebuilt from
it after ``pickle`` / ``torch.load``.
"""

from __future__ import annotations

import math
import re
from itertools import chain
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from ._tracing import compiling, exporting

#: a condition export states that two inputs' dims are equal: ``a4.size()[0] == a3.size()[0]``
_SAME_DIM = re.compile(r"a(\d+)\.size\(\)\[(\d+)\] == a(\d+)\.size\(\)\[(\d+)\]")


#: the name of a captured model's InputGuards submodule
GUARDS_NAME = "fxrec_check_inputs"


class InputShapeError(ValueError):
    """Inputs whose sizes (or fixed values) the transformed model was not captured for."""


# a fixed size, a Python expression over size symbols ("s0", "2*s0"), or None (not checked)
Size = Union[int, str, None]


def _namespace() -> dict:
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    return {**SYMPY_INTERP, "math": math, "inf": float("inf")}


class InputGuards(torch.nn.Module):
    """Checks the flat input tensors of a captured graph (see the module doc).

    Args:
      paths: each input's name as the user passes it (``dense``, ``ids[2]``, ``feats['user']``).
      shapes: each input's captured shape (None: not a tensor, not checked): per dim a fixed size,
        an expression over size symbols (a lone symbol binds it), or None (any size).
      ranges: the sizes each symbol may take, ``(low, high)``, ``high`` None for no bound.
      conditions: further Python expressions over the inputs (``a3.size()[0] % 2 == 0``, inputs
        named ``a0``, ``a1``, ... in order) that the model's code relied on.
      values: the inputs that are not tensors (ints, floats, bools, strings), by index, with the
        value the graph was captured with: it holds only for that value.
    """

    def __init__(self, paths: Sequence[str], shapes: Sequence[Optional[Sequence[Size]]],
                 ranges: Dict[str, Tuple[int, Optional[int]]], conditions: Sequence[str] = (),
                 values: Optional[Dict[int, object]] = None):
        super().__init__()
        self.paths = list(paths)
        self.shapes = [None if s is None else list(s) for s in shapes]
        self.ranges = dict(ranges)
        self.conditions = list(conditions)
        self.values = dict(values or {})
        self.roles: Dict[int, str] = {}  # input index -> what it feeds, filled in after the passes
        # a sharded model's first exchange of a step, (input dist, ints sent, flag at, rank): set
        # by shard_groups; a rank whose inputs fail joins it (see forward)
        self.first_exchange: Optional[Tuple[str, int, int, int]] = None
        # (training flag of the other mode, its conditions) where they differ from ``conditions``:
        # set by capture, whose call then passes the mode-following modules' flags (see active)
        self.other_mode: Optional[Tuple[bool, List[str]]] = None
        self._fn = self._build()
        self._fns: Dict[Tuple[str, ...], object] = {}

    def set_other_mode(self, training: bool, conditions: Sequence[str]) -> None:
        """The conditions of the other mode (``training``): batch norm refuses batch 1 in training only."""
        self.other_mode = (bool(training), list(conditions))
        self._fns = {}

    def active(self, modes: Sequence[bool] = ()) -> List[str]:
        """The conditions for mode-following modules with the ``training`` flags ``modes``: the other
        mode's when all are in it, both modes' when they are mixed, else the captured mode's."""
        other = getattr(self, "other_mode", None)  # (absent from guards pickled before it was)
        there = [bool(m) == other[0] for m in modes] if other else []
        if not any(there):
            return self.conditions
        return other[1] if all(there) else self.conditions + [c for c in other[1] if c not in self.conditions]

    def _mode_only(self, condition: str) -> str:
        other = getattr(self, "other_mode", None)
        if other is None or (condition in self.conditions) == (condition in other[1]):
            return ""
        return f" (in {'training' if (condition in other[1]) == other[0] else 'eval'} mode only)"

    def _check_fn(self, modes: Sequence[bool]):
        conditions = self.active(modes)
        if conditions is not self.conditions and tuple(conditions) not in self._fns:
            self._fns[tuple(conditions)] = self._build(conditions)
        return self._fn if conditions is self.conditions else self._fns[tuple(conditions)]

    # ------------------------------------------------------------------ the fast check
    def _symbol_sources(self) -> Dict[str, str]:
        """Each symbol's first binding: ``"a1.size(0)"``."""
        out: Dict[str, str] = {}
        for k, shape in enumerate(self.shapes):
            for d, s in enumerate(shape or ()):
                if isinstance(s, str) and s.isidentifier() and s not in out:
                    out[s] = f"a{k}.size({d})"
        return out

    def sizes_of(self, symbol: str) -> str:
        """The input dims that share size ``symbol``, in words."""
        where = [f"{self.paths[k]} dim {d}" for k, shape in enumerate(self.shapes) for d, s in enumerate(shape or ())
                 if s == symbol]
        return ", ".join(where[:4]) + (f" and {len(where) - 4} more" if len(where) > 4 else "")

    def _implied(self, condition: str) -> bool:
        """Whether ``condition`` says two inputs' dims are equal that the shapes already give one
        symbol (export states both ways; 511 such conditions took a 512-feature model ~1 ms a call)."""
        m = _SAME_DIM.fullmatch(condition)
        if m is None:
            return False
        (x, dx), (y, dy) = (int(m[1]), int(m[2])), (int(m[3]), int(m[4]))
        sx = self.shapes[x] if x < len(self.shapes) else None
        sy = self.shapes[y] if y < len(self.shapes) else None
        if not sx or not sy or dx >= len(sx) or dy >= len(sy):
            return False
        return isinstance(sx[dx], str) and sx[dx] == sy[dy]

    def _build(self, conditions: Optional[List[str]] = None):
        """The check as one generated function of the inputs, ``_check(*a)``, that reads each tensor
        input's dims and sizes by C-level ``map``s (a 1-D input's size is its ``numel``, the
        cheapest read) into one list ``z``, then compares whole tuples of it: the fixed sizes
        with the captured ones, every size that shares a symbol with that symbol's first
        binding (one comparison for all), each range's bound against the least or greatest of
        its symbols. Derived sizes, values and conditions are a line each. Only builtins and
        tuple displays: torch.compile traces it without a graph break."""
        conditions = self.conditions if conditions is None else conditions
        bound = self._symbol_sources()
        ns = _namespace()
        lines = ["def _check(*a):"]
        tensors = [k for k, shape in enumerate(self.shapes) if shape is not None]

        def picker(ks: List[int]) -> str:  # the expression of a tuple of a's elements
            if ks == list(range(len(self.paths))):
                return "a"
            return "(" + "".join(f"a[{k}], " for k in ks) + ")"

        at: Dict[Tuple[int, int], int] = {}  # (input, dim) -> its place in z
        if tensors:
            ns["_fx_dims"] = [len(self.shapes[k]) for k in tensors]
            lines.append(f"    if list(map(_fx_dim, {picker(tensors)})) != _fx_dims: return False")
            checked = [k for k in tensors if any(s is not None for s in self.shapes[k])]
            one_d = [k for k in checked if len(self.shapes[k]) == 1]
            more = [k for k in checked if len(self.shapes[k]) > 1]
            parts = []
            if one_d:
                parts.append(f"list(map(_fx_numel, {picker(one_d)}))")
                at.update({(k, 0): i for i, k in enumerate(one_d)})
            if more:
                parts.append(f"list(chain.from_iterable(map(_fx_size, {picker(more)})))")
                place = len(one_d)
                for k in more:
                    for d in range(len(self.shapes[k])):
                        at[(k, d)] = place
                        place += 1
            if parts:
                lines.append("    z = " + " + ".join(parts))

        def getter(places: List[int]) -> str:  # (a tuple display: torch.compile traces it)
            return "(" + "".join(f"z[{i}], " for i in places) + ")"

        fixed = [(at[(k, d)], s) for k in tensors for d, s in enumerate(self.shapes[k]) if isinstance(s, int)]
        if fixed:
            ns["_fx_fixed"] = tuple(v for _, v in fixed)
            lines.append(f"    if {getter([i for i, _ in fixed])} != _fx_fixed: return False")
        first = {s: at[(int(m[1]), int(m[2]))] for s, src in bound.items()
                 for m in [re.fullmatch(r"a(\d+)\.size\((\d+)\)", src)]}
        same = [(at[(k, d)], first[s]) for k in tensors for d, s in enumerate(self.shapes[k])
                if isinstance(s, str) and s in first and at[(k, d)] != first[s]]
        if same:
            lines.append(f"    if {getter([i for i, _ in same])} != "
                         f"{getter([j for _, j in same])}: return False")
        derived = [(at[(k, d)], s) for k in tensors for d, s in enumerate(self.shapes[k])
                   if isinstance(s, str) and s not in first]
        for sym in sorted(first):  # the symbols the lines below name
            if any(re.search(rf"\b{re.escape(sym)}\b", e) for _, e in derived) or any(
                    re.search(rf"\b{re.escape(sym)}\b", c) for c in conditions):
                lines.append(f"    {sym} = z[{first[sym]}]")
        for i, expr in derived:
            lines.append(f"    if z[{i}] != ({expr}): return False")
        lows: Dict[int, List[int]] = {}
        highs: Dict[int, List[int]] = {}
        for sym, (lo, hi) in sorted(self.ranges.items()):
            if sym in first and lo > 0:
                lows.setdefault(lo, []).append(first[sym])
            if sym in first and hi is not None:
                highs.setdefault(hi, []).append(first[sym])
        for lo, places in sorted(lows.items()):
            lines.append(f"    if min({getter(places)}) < {lo}: return False")
        for hi, places in sorted(highs.items()):
            lines.append(f"    if max({getter(places)}) > {hi}: return False")
        named = {int(m) for c in conditions if not self._implied(c) for m in re.findall(r"\ba(\d+)\b", c)}
        named |= set(self.values)
        for k in sorted(named):
            lines.append(f"    a{k} = a[{k}]")
        for k, v in sorted(self.values.items()):
            if isinstance(v, float) and math.isnan(v):
                lines.append(f"    if not (isinstance(a{k}, float) and math.isnan(a{k})): return False")
            else:
                lines.append(f"    if type(a{k}) is not {type(v).__name__} or a{k} != {v!r}: return False")
        for c in conditions:
            if not self._implied(c):
                lines.append(f"    if not ({c}): return False")
        lines.append("    return True")
        ns.update(_fx_dim=torch.Tensor.dim, _fx_numel=torch.Tensor.numel, _fx_size=torch.Tensor.size, chain=chain)
        exec("\n".join(lines), ns)  # noqa: S102 - code made from the captured shapes above
        return ns["_check"]

    def forward(self, *inputs, modes: Sequence[bool] = ()) -> None:
        """Raise InputShapeError naming what is wrong unless ``inputs`` fit; ``modes``: the
        ``training`` flags of the modules that follow the mode (see :meth:`active`)."""
        if exporting():  # (the graph lost the conditions the code tested: traced, they become guards)
            from .size_checks import traced_check

            return traced_check(self, inputs)
        if torch.jit.is_tracing():
            return
        check = self._check_fn(modes)
        if compiling():  # torch.compile traces the check: its comparisons become its guards
            # (a None or an int where a tensor goes fails the check's size reads: named here first)
            tensors = all(isinstance(x, torch.Tensor) for x, shape in zip(inputs, self.shapes) if shape is not None)
            if len(inputs) != len(self.paths) or not tensors or not check(*inputs):
                raise InputShapeError(self.explain(inputs, modes))
            return
        try:
            ok = len(inputs) == len(self.paths) and check(*inputs)
        except Exception:  # noqa: BLE001 - e.g. a condition divides by a size that is 0 here
            ok = False
        if not ok:
            error = InputShapeError(self.explain(inputs, modes))
            self._stop_every_rank(error, inputs)
            raise error

    def _stop_every_rank(self, error: ValueError, inputs: Sequence, device: Optional[torch.device] = None) -> None:
        """In a sharded model the other ranks are by now waiting in the first input dist's exchange
        of the counts: this rank joins it with its input flag set and raises ``error`` there, and
        they stop too, naming this rank (instead of waiting until the timeout, or pairing that
        exchange with this rank's next step). Nothing in an unsharded model. The exchange runs
        on the inputs' device, or ``device`` where no input tensor is given."""
        first = getattr(self, "first_exchange", None)  # (absent from guards pickled before it was)
        import torch.distributed as dist

        if first is None or not dist.is_available() or not dist.is_initialized():
            return
        from .sharded_inputs import refuse_with_the_others

        name, width, flag_at, rank = first
        device = next((x.device for x in inputs if isinstance(x, torch.Tensor)), device or torch.device("cpu"))
        if dist.get_backend() == "nccl" and device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        refuse_with_the_others(error, width, flag_at, device, name, rank)

    # ------------------------------------------------------------------ the message
    def _name(self, k: int) -> str:
        role = self.roles.get(k)
        return f"input {self.paths[k]}" + (f" ({role})" if role else "")

    def explain(self, inputs: Sequence, modes: Sequence[bool] = ()) -> str:
        """Every broken fact, in words (``modes``: as for :meth:`forward`)."""
        from .input_guards_message import explain

        return explain(self, inputs, modes)

    # ------------------------------------------------------------------ pickle / deepcopy
    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_fn", None)
        state.pop("_fns", None)
        state.pop("_serving", None)  # (size_checks' generated function)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._fn = self._build()
        self._fns = {}

    def extra_repr(self) -> str:
        return f"inputs={len(self.paths)}, conditions={len(self.conditions)}"
