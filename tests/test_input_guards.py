"""InputGuards' generated check (fxrec/runtime/input_guards.py) against the facts written out one
by one here: random captured shapes (fixed sizes, shared size symbols, sizes derived from them,
dims left free), ranges, fixed non-tensor values and conditions, and random inputs that keep or
break them. The check reads the inputs by C-level maps and compares whole tuples; it must answer
exactly as the facts do, and where it says no, ``explain`` must name a broken fact."""

import math
import random

import pytest
import torch

from fxrec.runtime.input_guards import InputGuards

SYMBOLS = ["s0", "s1", "s2", "s7"]
DERIVED = ["2*s0", "s1 + 1", "s0*s1"]


def facts_hold(g: InputGuards, inputs) -> bool:
    """The captured facts, checked one by one (the semantics the generated check must have)."""
    if len(inputs) != len(g.paths):
        return False
    env = {}
    for k, shape in enumerate(g.shapes):
        if shape is None:
            continue
        x = inputs[k]
        if not isinstance(x, torch.Tensor) or x.dim() != len(shape):
            return False
        for d, s in enumerate(shape):
            if isinstance(s, int) and x.size(d) != s:
                return False
            if isinstance(s, str) and s.isidentifier():
                if env.setdefault(s, x.size(d)) != x.size(d):
                    return False
    for k, shape in enumerate(g.shapes):
        for d, s in enumerate(shape or ()):
            if isinstance(s, str) and not s.isidentifier() and inputs[k].size(d) != eval(s, {}, dict(env)):
                return False
    for sym, (lo, hi) in g.ranges.items():
        if sym in env and (env[sym] < lo or (hi is not None and env[sym] > hi)):
            return False
    for k, v in g.values.items():
        if type(inputs[k]) is not type(v) or inputs[k] != v:
            return False
    scope = {f"a{k}": x for k, x in enumerate(inputs)}
    return all(eval(c, {"math": math}, scope) for c in g.conditions)


def random_guards(rng: random.Random) -> InputGuards:
    n = rng.randint(1, 7)
    shapes, values = [], {}
    used = set()
    for k in range(n):
        kind = rng.random()
        if kind < 0.1:
            shapes.append(None)
            values[k] = rng.choice([3, 0.5, True, "mean"])
            continue
        dims = rng.choice([0, 1, 1, 1, 2, 3])
        shape = []
        for _ in range(dims):
            r = rng.random()
            if r < 0.25:
                shape.append(rng.randint(0, 4))
            elif r < 0.75:
                shape.append(rng.choice(SYMBOLS))
                used.add(shape[-1])
            elif r < 0.85 and {"s0", "s1"} <= used:
                shape.append(rng.choice(DERIVED))
            else:
                shape.append(None)
        shapes.append(shape)
    ranges = {s: (rng.choice([0, 0, 1, 2]), rng.choice([None, None, 6])) for s in used}
    conditions = []
    sized = [k for k, sh in enumerate(shapes) if sh]
    if sized and rng.random() < 0.5:
        k = rng.choice(sized)
        conditions.append(f"a{k}.size()[0] % 2 == 0")
    if len(sized) > 1 and rng.random() < 0.3:  # the form export states equal dims in
        conditions.append(f"a{sized[0]}.size()[0] == a{sized[1]}.size()[0]")
    return InputGuards([f"x{k}" for k in range(n)], shapes, ranges, conditions, values)


def random_inputs(g: InputGuards, rng: random.Random, keep: bool):
    """Inputs near the captured facts: sizes drawn so that most fit (``keep``) or any may break."""
    env = {s: rng.randint(1, 6) for s in SYMBOLS}
    out = []
    for k, shape in enumerate(g.shapes):
        if shape is None:
            v = g.values[k]
            out.append(v if keep or rng.random() < 0.7 else rng.choice([4, 0.25, False, "sum", None]))
            continue
        if not keep and rng.random() < 0.1:
            out.append(rng.choice([None, 3, [1, 2]]))  # not a tensor
            continue
        sizes = []
        for s in shape:
            if isinstance(s, int):
                sizes.append(s)
            elif s is None:
                sizes.append(rng.randint(0, 5))
            else:
                sizes.append(eval(s, {}, dict(env)))
            if not keep and rng.random() < 0.15:
                sizes[-1] = max(0, sizes[-1] + rng.choice([-1, 1, 2]))
        if not keep and rng.random() < 0.05:
            sizes.append(1)  # one dim too many
        out.append(torch.zeros(sizes))
    if not keep and rng.random() < 0.03:
        out.pop()
    return out


def answer(g: InputGuards, inputs) -> bool:
    try:
        return len(inputs) == len(g.paths) and bool(g._fn(*inputs))
    except Exception:  # noqa: BLE001 - forward counts any failure of the check as a no
        return False


@pytest.mark.parametrize("seed", range(8))
def test_the_check_answers_as_the_facts_one_by_one(seed):
    rng = random.Random(seed)
    said = {True: 0, False: 0}
    for _ in range(300):
        g = random_guards(rng)
        for keep in (True, False):
            x = random_inputs(g, rng, keep)
            want = facts_hold(g, x) if len(x) == len(g.paths) else False
            assert answer(g, x) == want, (g.shapes, g.ranges, g.values, g.conditions,
                                          [getattr(v, "shape", v) for v in x])
            said[want] += 1
            if not want:
                with pytest.raises(ValueError, match="fxrec: "):
                    g(*x)
    assert min(said.values()) > 100, said  # both answers were exercised


def test_many_inputs_that_share_one_size_are_checked_in_one_comparison():
    """The case the tuple comparisons are for: 1,024 inputs, 512 of them one symbol (the offsets of
    a 512-feature model), each of the others its own; one input off by one is found wherever it is."""
    shapes = [[f"i{k}"] for k in range(512)] + [["b"]] * 512
    g = InputGuards([f"x{k}" for k in range(1024)], shapes, {"b": (2, None)})
    good = [torch.zeros(k % 7) for k in range(512)] + [torch.zeros(9)] * 512
    assert answer(g, good)
    for k in (512, 700, 1023):
        bad = list(good)
        bad[k] = torch.zeros(8)
        assert not answer(g, bad)
        with pytest.raises(ValueError) as e:
            g(*bad)
        other = 513 if k == 512 else 512
        assert str(e.value) == (f"fxrec: input x{k} has size 8 in dim 0, but input x{other} has 9 in dim 0; the "
                                "model was captured with these two equal")  # the odd one named, not the 511 others
    several = list(good)
    several[600:610] = [torch.zeros(3)] * 10
    with pytest.raises(ValueError, match="input x603 has size 3.*; 6 more inputs differ from input x512 in that size$"):
        g(*several)
    short = [torch.zeros(k % 7) for k in range(512)] + [torch.zeros(1)] * 512
    assert not answer(g, short)  # below the range's 2
