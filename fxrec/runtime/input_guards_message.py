"""The message of :class:`~fxrec.runtime.input_guards.InputGuards` when inputs do not fit: every
broken fact in words, each input named by its path and what it feeds (``ids[2]`` (ids of feature
'ids_2', table 'bags.2')), sizes and conditions written over the inputs, not export's symbols.
Worked out only once the check has said no.
"""

from __future__ import annotations

import math
import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .input_guards import Size, _namespace


#: why a size of 2 or more in the example is fixed in the captured model
FIXED_BY_CODE = ("the model fixed it when captured: a layer's size there (an nn.Linear's in_features), nn.GRU / "
                 "nn.LSTM / nn.RNN over that dim (torch.export fixes their sequence length), a Python loop over "
                 "that size, or a size written in its code")


def explain(guards, inputs: Sequence, modes: Sequence[bool] = ()) -> str:
    """Every fact of ``guards`` (an :class:`~fxrec.runtime.input_guards.InputGuards`) that ``inputs``
    break, in words (``modes``: as for its forward)."""
    if len(inputs) != len(guards.paths):
        return f"fxrec: the model takes {len(guards.paths)} input tensors, got {len(inputs)}"
    problems: List[str] = []
    for k, v in sorted(guards.values.items()):
        x = inputs[k]
        same = (isinstance(x, float) and math.isnan(x)) if isinstance(v, float) and math.isnan(v) else \
            (type(x) is type(v) and x == v)
        if not same:
            problems.append(f"{guards._name(k)} is {x!r}; the model was captured with {v!r} there (an input that "
                            "is not a tensor is fixed at capture: transform again for another value)")
    seen: Dict[str, Tuple[int, int, int]] = {}  # symbol -> (value, input, dim) of its first binding
    sharing: Dict[str, List[Tuple[int, int, int]]] = {}  # symbol -> every (value, input, dim) it sizes
    for k, (shape, x) in enumerate(zip(guards.shapes, inputs)):
        if shape is None:
            continue
        if not isinstance(x, torch.Tensor):
            kind = type(x).__name__
            problems.append(f"{guards._name(k)} is {'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind}, not a tensor")
            continue
        if x.dim() != len(shape):
            problems.append(f"{guards._name(k)} has {x.dim()} dims (shape {tuple(x.shape)}); the model was "
                            f"captured with {len(shape)} (shape {_shown(shape)})")
            continue
        for d, s in enumerate(shape):
            got = int(x.size(d))
            if s is None:
                continue
            if isinstance(s, int):
                if got != s:
                    why = (" (capture fixes a size of 0 or 1 in the example, which code such as squeeze() may "
                           "depend on: transform with an example of 2 or more there)" if s in (0, 1) else
                           f" ({FIXED_BY_CODE})")
                    problems.append(f"{guards._name(k)} has size {got} in dim {d}; the model was captured with "
                                    f"a fixed size {s} there{why}")
            elif s.isidentifier():
                seen.setdefault(s, (got, k, d))
                sharing.setdefault(s, []).append((got, k, d))
    for s, places in sharing.items():
        problems.extend(_unequal(guards, places))
    values = {s: v[0] for s, v in seen.items()}
    if not problems:
        for k, (shape, x) in enumerate(zip(guards.shapes, inputs)):
            for d, s in enumerate(shape or ()):
                if isinstance(s, str) and not s.isidentifier():
                    want = _eval(s, values)
                    if want is not None and int(x.size(d)) != want:
                        problems.append(f"{guards._name(k)} has size {int(x.size(d))} in dim {d}; the model was "
                                        f"captured with {_in_words(guards, s)} there, {want} for these inputs")
        for s, (lo, hi) in sorted(guards.ranges.items()):
            if s in values and (values[s] < lo or (hi is not None and values[s] > hi)):
                _, k, d = seen[s]
                span = f"{lo} to {hi}" if hi is not None else f"{lo} or more"
                problems.append(f"{guards._name(k)} has size {values[s]} in dim {d}; the model accepts {span} there")
    if not problems:
        broken: Dict[str, List[str]] = {}  # why -> the conditions broken so, each in words
        here: Dict[str, int] = {}  # the sizes they read, as these inputs have them
        for c in guards.active(modes):
            try:
                ok = bool(eval(c, _namespace(), {f"a{k}": x for k, x in enumerate(inputs)}))  # noqa: S307
                why = "relied"
            except ZeroDivisionError:
                ok, why = False, "make a size the model's code divides by 0"
            except Exception:  # noqa: BLE001 - an input that is not a tensor: named above
                ok, why = False, "do not fit a condition on their sizes"
            if not ok:  # (with what the inputs it names feed)
                fed = [f"{guards.paths[k]}: {guards.roles[k]}" for k in sorted({int(a) for a in re.findall(r"\ba(\d+)\b", c)})
                       if k in guards.roles]
                broken.setdefault(why, []).append(f"{_in_words(guards, c)}{guards._mode_only(c)}"
                                                  + (f" ({'; '.join(fed)})" if fed else ""))
                for k, d in re.findall(r"\ba(\d+)\.size\(\)\[(\d+)\]", c):
                    x = inputs[int(k)]
                    if isinstance(x, torch.Tensor) and int(d) < x.dim():
                        here[f"{guards.paths[int(k)]}.size()[{d}]"] = int(x.size(int(d)))
        for why, conditions in broken.items():
            if why == "relied":  # (one sentence for them all: the conditions numbered when several)
                why = (f"break {'a condition' if len(conditions) == 1 else f'{len(conditions)} conditions'} on "
                       "their sizes that the model's code (or a torch function it calls) relied on when it was captured")
            listed = conditions[0] if len(conditions) == 1 else \
                " ".join(f"({i}) {c}" for i, c in enumerate(conditions, 1))
            problems.append(f"the inputs {why}: {listed}")
        if here:
            problems[-1] += " (here " + ", ".join(f"{k} = {v}" for k, v in here.items()) + ")"
    if not problems:
        problems.append("the inputs do not fit the sizes the model was captured for")
    return "fxrec: " + "; ".join(problems)



def _unequal(guards, places: List[Tuple[int, int, int]]) -> List[str]:
    """The inputs whose size differs where the model was captured with one size: those off
    the size most of them have (the first input's where as many have each), each against
    an input that has it; four named, the rest counted."""
    counts: Dict[int, int] = {}
    for got, _, _ in places:
        counts[got] = counts.get(got, 0) + 1
    if len(counts) == 1:
        return []
    usual = max(counts, key=lambda v: (counts[v], v == places[0][0]))
    _, j, e = next(p for p in places if p[0] == usual)
    odd = [p for p in places if p[0] != usual]
    out = [f"{guards._name(k)} has size {got} in dim {d}, but {guards._name(j)} has {usual} in dim {e}; the model "
           "was captured with these two equal" for got, k, d in odd[:4]]
    if len(odd) > 4:
        out.append(f"{len(odd) - 4} more inputs differ from {guards._name(j)} in that size")
    return out


def _shown(shape: Sequence[Size]) -> str:
    return "(" + ", ".join(str(s) if isinstance(s, int) else "any" for s in shape) + ("," if len(shape) == 1 else "") + ")"



def _in_words(guards, expr: str) -> str:
    """An expression with each input ``aK`` and symbol written as the input it comes from."""
    bound = guards._symbol_sources()

    def name(m):
        tok = m.group(0)
        if tok in bound:
            k, d = re.match(r"a(\d+)\.size\((\d+)\)", bound[tok]).groups()
            return f"{guards.paths[int(k)]}.size({d})"
        if re.fullmatch(r"a\d+", tok):
            return guards.paths[int(tok[1:])]
        return tok

    return re.sub(r"\b[A-Za-z_]\w*\b", name, expr)



def _eval(expr: str, values: Dict[str, int]) -> Optional[int]:
    try:
        return int(eval(expr, _namespace(), dict(values)))  # noqa: S307
    except Exception:  # noqa: BLE001 - a symbol no input binds
        return None
