"""The input-size checks of the serving forms: an exported program and a TorchScript module run
the transformed model's graph, which no longer holds the conditions the model's own code tested
on its inputs' sizes (a branch on ``ids.shape[1]`` was taken at capture) nor, for TorchScript, the
sizes capture fixed. :func:`serving_source` writes them, from a model's
:class:`~fxrec.runtime.input_guards.InputGuards`, as one function that TorchScript compiles and
that torch.export traces (its conditions on traced sizes become the program's guards).
"""

from __future__ import annotations

import linecache
import re
from typing import Dict, List, Tuple

import torch


#: where a message takes the size it got (a character no input name holds: a name may hold "{}")
_GOT = "\ue000"
#: functions a condition written into the TorchScript check may call (TorchScript's builtins)
_SCRIPT_CALLS = ("int", "float", "max", "min", "abs")


def _scriptable(condition: str) -> bool:
    """Whether TorchScript runs ``condition`` safely: sizes (``a3.size()[1]``, ``a3.dim()``, ``s2``),
    numbers, comparisons, and/or/not, + - * and the functions of :data:`_SCRIPT_CALLS`, and a
    division or modulo only by a number other than 0 (TorchScript's interpreter does not stop an
    integer division by a size of 0: it killed the process). Those left out are checked by the
    ops as they run, as before these checks."""
    import ast

    try:
        tree = ast.parse(condition, mode="eval")
    except SyntaxError:
        return False
    plain = (ast.Expression, ast.Compare, ast.BoolOp, ast.UnaryOp, ast.BinOp, ast.And, ast.Or, ast.Not, ast.USub,
             ast.UAdd, ast.Add, ast.Sub, ast.Mult, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Load)

    def ok(node) -> bool:
        if isinstance(node, ast.Constant):
            return type(node.value) in (int, float, bool)
        if isinstance(node, ast.Name):
            return re.fullmatch(r"[as]\d+", node.id) is not None
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
            right = node.right
            return ok(node.left) and isinstance(right, ast.Constant) and type(right.value) in (int, float) \
                and right.value != 0
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in _SCRIPT_CALLS and not node.keywords:
                return all(map(ok, node.args))
            one_dim = len(node.args) == 1 and isinstance(node.args[0], ast.Constant) and type(node.args[0].value) is int
            return isinstance(f, ast.Attribute) and f.attr in ("size", "dim") and not node.keywords \
                and (not node.args or f.attr == "size" and one_dim) \
                and isinstance(f.value, ast.Name) and re.fullmatch(r"a\d+", f.value.id) is not None
        if isinstance(node, ast.Subscript):  # a3.size()[1]
            return isinstance(node.value, ast.Call) and ok(node.value) and isinstance(node.slice, ast.Constant) \
                and type(node.slice.value) is int
        return isinstance(node, plain) and all(map(ok, ast.iter_child_nodes(node)))

    return ok(tree)
#: torch's spellings of what TorchScript writes otherwise (``int(W * 0.5)`` is exported as these)
_SCRIPT_SPELLING = (("math.trunc(", "int("), ("torch.sym_float(", "float("), ("torch.sym_int(", "int("))


def serving_source(guards, name: str = "fxrec_check_sizes", scripted: bool = False) -> Tuple[str, List[int]]:
    """Python source of a function of the tensor inputs (``a3: torch.Tensor``, ...), which
    TorchScript also compiles, that raises a ValueError naming the input unless their sizes
    fit: each input's number of dims, the sizes capture fixed, sizes shared or derived, the
    range of each size, and the eval-mode conditions the model's code relied on. Export and
    TorchScript take the model's graph, where those conditions are no longer written (a branch
    on a size was taken at capture): without this check they would run the captured branch on
    any size. Returns the source and the indices of the inputs it takes, in order."""
    tensors = [k for k, sh in enumerate(guards.shapes) if sh is not None]
    lines = [f"def {name}({', '.join(f'a{k}: torch.Tensor' for k in tensors)}) -> None:"]

    def check(ok: str, message: str, got: str = "") -> None:
        if scripted:
            for theirs, ours in _SCRIPT_SPELLING:
                ok = ok.replace(theirs, ours)
            if not _scriptable(ok):
                return
        head, _, tail = ("fxrec: " + message).partition(_GOT)
        text = f"{head!r} + str({got}) + {tail!r}" if got else repr(head)
        lines.extend([f"    if not ({ok}):", f"        raise ValueError({text})"])

    for k in tensors:
        n = len(guards.shapes[k])
        check(f"a{k}.dim() == {n}", f"{guards._name(k)} has {_GOT} dims; the model takes {n}", f"a{k}.dim()")
    bound: Dict[str, str] = {}
    for k in tensors:
        for d, sz in enumerate(guards.shapes[k]):
            if isinstance(sz, str) and sz.isidentifier() and sz not in bound:
                bound[sz] = f"a{k}.size({d})"
                lines.append(f"    {sz} = a{k}.size({d})")
    for k in tensors:
        for d, sz in enumerate(guards.shapes[k]):
            where = f"{guards._name(k)} has size {_GOT} in dim {d}"
            if isinstance(sz, int):
                check(f"a{k}.size({d}) == {sz}", f"{where}; the model takes only {sz} there (the size it was "
                      "captured with)", f"a{k}.size({d})")
            elif isinstance(sz, str) and bound.get(sz) != f"a{k}.size({d})":
                if sz in bound:  # a size shared with another input's
                    j, e = (int(x) for x in re.fullmatch(r"a(\d+)\.size\((\d+)\)", bound[sz]).groups())
                    said = f"it must equal {guards.paths[j]}'s size in dim {e}"
                else:
                    said = f"the model takes {_sizes_said(guards, sz)} there"
                check(f"a{k}.size({d}) == ({sz})", f"{where}; {said}", f"a{k}.size({d})")
    for sym, (lo, hi) in sorted(guards.ranges.items()):
        if sym not in bound:
            continue
        k, d = (int(x) for x in re.fullmatch(r"a(\d+)\.size\((\d+)\)", bound[sym]).groups())
        where = f"{guards._name(k)} has size {_GOT} in dim {d}"
        if lo > 0:
            check(f"{sym} >= {lo}", f"{where}; the model accepts {lo} or more there", sym)
        if hi is not None:
            check(f"{sym} <= {hi}", f"{where}; the model accepts at most {hi} there", sym)
    for c in _eval_conditions(guards):
        if not guards._implied(c):
            named = sorted({int(m) for m in re.findall(r"\ba(\d+)\b", c)})
            said = ", ".join(f"a{m} = {guards.paths[m]}" for m in named if m < len(guards.paths))
            check(c, f"the inputs' sizes do not meet {c} ({said}), which the model's code relied on when "
                  "it was captured")
    if len(lines) == 1:
        lines.append("    pass")
    return "\n".join(lines) + "\n", tensors


def serving_check(guards, scripted: bool = False):
    """:func:`serving_source` as a function (its source kept where ``inspect`` finds it, so
    that TorchScript compiles it: ``scripted``, with what TorchScript runs) and the indices of
    the inputs it takes."""
    from .input_guards import _namespace

    src, tensors = serving_source(guards, scripted=scripted)
    filename = f"<fxrec input sizes {id(guards)}{' scripted' if scripted else ''}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    ns = {**_namespace(), "torch": torch}
    exec(compile(src, filename, "exec"), ns)  # noqa: S102 - code made from the captured shapes
    fn = ns["fxrec_check_sizes"]
    fn.__module__ = __name__
    return fn, tensors


def _sizes_said(guards, expr: str) -> str:
    """A derived size in words: ``2*s0`` with its symbols' inputs named."""
    return f"{expr} (" + "; ".join(f"{s}: {guards.sizes_of(s)}" for s in sorted(set(re.findall(r"\bs\d+\b", expr)))) + ")"


def _eval_conditions(guards) -> List[str]:
    """The conditions of eval mode, which the serving forms run in (InputGuards.active)."""
    other = getattr(guards, "other_mode", None)
    return other[1] if other is not None and other[0] is False else guards.conditions


def traced_check(guards, inputs) -> None:
    """While torch.export traces the model: the check on the traced sizes, which the tracer
    records as the program's guards."""
    fn = guards.__dict__.get("_serving")
    if fn is None:
        fn = guards.__dict__["_serving"] = serving_check(guards)
    fn[0](*[inputs[k] for k in fn[1]])
