"""The captured model's forward (fxrec/codegen.py): the model's own arguments, read by index."""

import re

import pickle

import pytest
import torch
from torch import nn

import fxrec


class Collide(nn.Module):
    """An argument named like the placeholder export gives the first element of a list."""

    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(20, 4)

    def forward(self, ids, ids_0):
        return self.e(ids[0]).sum(1) + self.e(ids[1]).sum(1) * 2 + self.e(ids_0).sum(1) * 3


class Optional_(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.EmbeddingBag(20, 4, mode="sum")

    def forward(self, feats, psw=None):
        return self.e(feats["a"], feats["off"], per_sample_weights=psw)


def test_argument_named_like_a_placeholder_is_read_before_it_is_rebound():
    model = Collide()
    x = ([torch.randint(0, 20, (3, 2)), torch.randint(0, 20, (3, 2))], torch.randint(0, 20, (3, 2)))
    fast = fxrec.transform(model, x, backend="fbgemm")
    y = ([torch.randint(0, 20, (5, 2)), torch.randint(0, 20, (5, 2))], torch.randint(0, 20, (5, 2)))
    torch.testing.assert_close(fast(*y), model(*y))
    torch.testing.assert_close(fxrec.export.torchscript(fast)(*y), model(*y))


def test_structure_is_checked_naming_the_input():
    model = Optional_()
    feats = {"a": torch.randint(0, 20, (6,)), "off": torch.tensor([0, 2, 4])}
    fast = fxrec.transform(model, (feats, None), backend="fbgemm")
    torch.testing.assert_close(fast(feats, None), model(feats))
    with pytest.raises(ValueError, match="input psw was None when the model was captured"):
        fast(feats, torch.rand(6))
    without = fxrec.transform(model, (feats,), backend="fbgemm")  # captured without the argument
    with pytest.raises(ValueError, match="input psw was left at its default None when the model was captured"):
        without(feats, torch.rand(6))
    with pytest.raises(ValueError, match="input feats must have 2 elements"):
        fast({**feats, "extra": torch.zeros(1)}, None)
    with pytest.raises(ValueError, match="input psw was None when the model was captured and must stay None, "
                                         r"got a tensor of shape \(6,\)"):
        fast(feats, torch.rand(6))


def test_structure_of_the_wrong_type_is_an_error_saying_what_was_given():
    """Not a list, a dict with other keys, a tensor where a list goes: a ValueError naming the input
    and what it got, from the forward's first lines (before any collective of a sharded model:
    tests/test_sharding.py), rather than a TypeError or KeyError from reading it. A tuple for a
    list, a dict's keys in another order, and other sequences and mappings, are the same input to the
    model and are taken."""
    model = Optional_()
    feats = {"a": torch.randint(0, 20, (6,)), "off": torch.tensor([0, 2, 4])}
    fast = fxrec.transform(model, (feats, None), backend="fbgemm")
    torch.testing.assert_close(fast({"off": feats["off"], "a": feats["a"]}, None), model(feats))
    for bad, got in ((None, "None"), ([feats["a"], feats["off"]], "a list of 2"),
                     ({"a": feats["a"], "of": feats["off"]}, "a dict with keys 'a', 'of'"),
                     (feats["a"], r"a tensor of shape \(6,\)"), ({}, "an empty dict")):
        with pytest.raises(ValueError, match=r"input feats must have 2 elements \(a dict with keys 'a', 'off'\), got "
                                             + got):
            fast(bad, None)
    import collections
    import types

    # what the model's own code reads alike is taken: a MappingProxyType for a dict, a deque for a list
    torch.testing.assert_close(fast(types.MappingProxyType(feats), None), model(feats))
    lists = DenseAndBags().eval()
    ids, offsets = dense_and_bags_inputs(0)
    fast = fxrec.transform(lists, (ids, offsets), backend="fbgemm")
    torch.testing.assert_close(fast(tuple(ids), tuple(offsets)), lists(ids, offsets))
    torch.testing.assert_close(fast(collections.deque(ids), offsets), lists(ids, offsets))
    for bad, got in ((None, "None"), (ids[0], r"a tensor of shape \(12,\)"), ({0: ids[0]}, "a dict with keys 0"),
                     (ids[:2], "a list of 2"), (torch.tensor(3), r"a tensor of shape \(\)"), ("abc", "a str"),
                     (b"abc", "a bytes")):
        with pytest.raises(ValueError, match=r"input ids must have 3 elements \(a list or tuple\), got " + got):
            fast(bad, offsets)


class DenseAndBags(nn.Module):
    def __init__(self):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(20, 4, mode="sum") for _ in range(3)])
        self.norm = nn.BatchNorm1d(12)
        self.top = nn.Linear(12, 1)

    def forward(self, ids, offsets):
        return self.top(self.norm(torch.cat([b(i, o) for b, i, o in zip(self.bags, ids, offsets)], 1)))


def dense_and_bags_inputs(seed, batch=6):
    g = torch.Generator().manual_seed(seed)
    return ([torch.randint(0, 20, (batch * 2,), generator=g) for _ in range(3)],
            [torch.arange(0, batch * 2, 2) for _ in range(3)])


def test_parameters_and_buffers_are_read_through_the_module_dicts_and_are_the_models_own():
    model = DenseAndBags()
    ref = DenseAndBags()
    ref.load_state_dict(model.state_dict())
    fast = fxrec.transform(model, dense_and_bags_inputs(0))
    # a run of six or more reads in a row (at one depth) is one call (fxrec_attrs), the module
    # keys of each level in a tuple; shorter runs are read one by one
    assert "bags_0_weight = fxrec_attr(self, ('bags', '0'), 'weight')" in fast.code, fast.code
    assert re.search(r"norm_weight, norm_bias, top_weight, top_bias, .*= fxrec_attrs\(self, \(\), \(\('norm', "
                     r"'norm', 'top', 'top', ", fast.code), fast.code
    assert "getattr(self" not in fast.code and "self.top.weight" not in fast.code, fast.code
    for seed in (1, 2):
        x = dense_and_bags_inputs(seed)
        want, got = ref(*x), fast(*x)
        torch.testing.assert_close(got, want)
        want.sum().backward()
        got.sum().backward()
    for (n, a), (_, b) in zip(ref.named_parameters(), fast.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=n)  # the gradients reach the parameters fast holds
    for (n, a), (_, b) in zip(ref.named_buffers(), fast.named_buffers()):
        torch.testing.assert_close(b, a, msg=n)  # the running statistics were read and updated in place


def test_a_parameter_replaced_or_parametrized_after_transform_is_the_one_read():
    import torch.nn.utils.parametrize as P

    class Doubled(nn.Module):
        def forward(self, w):
            return 2 * w

    model = DenseAndBags().eval()
    fast = fxrec.transform(model, dense_and_bags_inputs(0))
    x = dense_and_bags_inputs(3)
    with torch.no_grad():
        new = nn.Parameter(torch.randn(1, 12))
        fast.top.weight = new  # a new Parameter object under the same name
        model.top.weight = new
        torch.testing.assert_close(fast(*x), model(*x))
        # parametrize moves the weight out of _parameters behind a property: read by getattr
        P.register_parametrization(fast.top, "weight", Doubled())
        assert "weight" not in fast.top._parameters
        expected = nn.functional.linear(model.norm(torch.cat([b(i, o) for b, i, o in zip(model.bags, *x)], 1)),
                                        2 * new, model.top.bias)
        torch.testing.assert_close(fast(*x), expected)


def test_fxrec_attr_reads_what_getattr_reads_where_the_module_dicts_do_not_hold_the_name():
    from fxrec.codegen import fxrec_attr

    m = nn.Sequential(nn.Linear(3, 2))
    assert fxrec_attr(m, ("0",), "weight") is m[0].weight
    m[0].register_buffer("scale", torch.ones(2))
    assert fxrec_attr(m, ("0",), "scale") is m[0].scale
    m[0].__dict__["const"] = torch.zeros(1)  # an instance attribute, as fx keeps tensor constants
    assert fxrec_attr(m, ("0",), "const") is m[0].const
    m[0].register_parameter("gone", None)
    assert fxrec_attr(m, ("0",), "gone") is None
    m.register_module("later", None)
    assert fxrec_attr(m, (), "later") is None
    with pytest.raises(AttributeError):
        fxrec_attr(m, ("1",), "weight")
    with pytest.raises(AttributeError):
        fxrec_attr(m, ("later",), "weight")
    # what the dicts are trusted for: nn.Module never registers a name its class has, so a class
    # attribute (which getattr would find first) cannot hide a registered parameter or submodule

    class WithProperty(nn.Module):
        @property
        def w(self):
            return None

    with pytest.raises(KeyError, match="already exists"):
        WithProperty().register_parameter("w", nn.Parameter(torch.ones(1)))
    with pytest.raises(KeyError, match="already exists"):
        WithProperty().add_module("w", nn.Linear(1, 1))


class NamedLikeTheReader(nn.Module):
    """An input and a parameter named like the function the generated forward reads parameters with."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 4, mode="sum")
        self.fxrec_attr = nn.Parameter(torch.rand(4))
        self.fxrec_attrs = nn.Parameter(torch.rand(4))
        self.top = nn.Linear(4 + 3, 1)
        self.towers = nn.ModuleList([nn.Linear(1, 1) for _ in range(3)])  # six reads in a row: fxrec_attrs

    def forward(self, ids, offsets, fxrec_attr):
        out = self.top(torch.cat([self.bag(ids, offsets) * self.fxrec_attr * self.fxrec_attrs, fxrec_attr], 1))
        return out + sum(t(fxrec_attr[:, :1]) for t in self.towers)


def test_a_model_with_names_like_the_attribute_reader_runs():
    """fx gives the readers other names in the code (fxrec_attrs_1) when the graph has the names."""
    model = NamedLikeTheReader()
    x = (torch.randint(0, 20, (12,)), torch.arange(0, 12, 2), torch.rand(6, 3))
    fast = fxrec.transform(model, x)
    reader = re.search(r"= (fxrec_attr_\d+)\(self, \('bag',\), 'weight'\)", fast.code)
    assert reader and reader[1] != "fxrec_attr_1", fast.code  # (the parameter's node took _1)
    # (the towers' six reads share their ModuleList: read once, as the prefix)
    assert re.search(r"= fxrec_attrs_\d+\(self, \('towers',\), \(\('0', '0', '1', '1', '2', '2'\),\), ",
                     fast.code), fast.code
    torch.testing.assert_close(fast(*x), model(*x))


class NamedLikeTheRaiser(nn.Module):
    """An input named like the function the generated forward raises structure errors with."""

    def __init__(self):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(20, 4, mode="sum") for _ in range(2)])

    def forward(self, ids, fxrec_input_error):
        return torch.cat([b(i) for b, i in zip(self.bags, ids)], 1) * fxrec_input_error


class ListsNamedLikeTheFunctions(nn.Module):
    """List inputs (no graph node has their name) named like the generated code's functions."""

    def __init__(self):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(20, 4, mode="sum") for _ in range(2)])

    def forward(self, fxrec_attr, fxrec_input_error):
        return torch.cat([b(i) for b, i in zip(self.bags, fxrec_attr)], 1) * fxrec_input_error[0]


@pytest.mark.parametrize("make", [NamedLikeTheRaiser, ListsNamedLikeTheFunctions])
def test_inputs_named_like_the_generated_codes_functions_do_not_hide_them(make):
    """fx names the functions apart from every argument, a list one included: the code raises the
    structure error (not "'list' object is not callable") and reads the weights."""
    model = make()
    ids = [torch.randint(0, 20, (3, 2)) for _ in range(2)]
    scale = [torch.rand(3, 8)] if make is ListsNamedLikeTheFunctions else torch.rand(3, 8)
    fast = fxrec.transform(model, (ids, scale))
    torch.testing.assert_close(fast(ids, scale), model(ids, scale))
    name = "fxrec_attr" if make is ListsNamedLikeTheFunctions else "ids"
    with pytest.raises(ValueError, match=f"input {name} must have 2 elements"):
        fast(ids[:1], scale)
    if make is ListsNamedLikeTheFunctions:
        with pytest.raises(ValueError, match="input fxrec_input_error must have 1 elements"):
            fast(ids, scale * 2)


def test_a_dict_key_like_the_functions_call_is_read_as_it_is():
    key = "fxrec_input_error(self, x)"

    class Keyed(nn.Module):
        def __init__(self):
            super().__init__()
            self.e = nn.EmbeddingBag(20, 4, mode="sum")

        def forward(self, feats, fxrec_input_error):
            return self.e(feats[key]) * fxrec_input_error

    model = Keyed()
    x = ({key: torch.randint(0, 20, (3, 2))}, torch.rand(3, 4))
    fast = fxrec.transform(model, x)
    torch.testing.assert_close(fast(*x), model(*x))


def test_fxrec_attrs_reads_what_fxrec_attr_reads_one_by_one():
    """The batched read: the module dicts by C-level maps, and anything they do not hold (a buffer,
    an instance attribute, a parameter behind a property, a module missing or registered as None)
    as fxrec_attr reads it, or its error."""
    import torch.nn.utils.parametrize as P

    from fxrec.codegen import fxrec_attr, fxrec_attrs

    class Doubled(nn.Module):
        def forward(self, w):
            return 2 * w

    m = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2), nn.Linear(2, 2), nn.Linear(2, 1))
    m[2].__dict__["const"] = torch.zeros(1)
    P.register_parametrization(m[3], "weight", Doubled())
    paths = [(("0",), "weight"), (("1",), "running_mean"), (("2",), "const"), (("3",), "weight"), (("0",), "bias"),
             (("1",), "training")]
    levels = tuple(zip(*(p for p, _ in paths)))
    got = fxrec_attrs(m, (), levels, tuple(n for _, n in paths))
    for (path, name), g in zip(paths, got):
        want = fxrec_attr(m, path, name)
        assert g is want or torch.equal(g, want), (path, name)  # (the parametrized weight is made at each read)
    assert got[0] is m[0].weight and got[1] is m[1].running_mean and got[5] is True
    torch.testing.assert_close(got[3], 2 * m[3].parametrizations.weight.original)
    assert fxrec_attrs(m, (), (), ("training",)) == [True]  # depth 0: the root's own
    outer = nn.Sequential(m)  # a shared prefix: read once, the rest as before
    for g, want in zip(fxrec_attrs(outer, ("0",), levels, tuple(n for _, n in paths)), got):
        assert g is want or torch.equal(g, want)
    m.register_module("gone", None)
    for bad in (("9",), ("gone",)):
        with pytest.raises(AttributeError):
            fxrec_attrs(m, (), (("0",) + bad,), ("weight", "weight"))
        with pytest.raises(AttributeError):
            fxrec_attrs(outer, ("0",) + bad, (), ("weight",))


def test_buffers_are_read_through_the_dicts_too():
    from fxrec.codegen import fxrec_attr

    m = nn.Sequential(nn.BatchNorm1d(3))
    assert fxrec_attr(m, ("0",), "running_mean") is m[0].running_mean
    assert fxrec_attr(m, ("0",), "training") is True  # not a tensor: getattr's answer


class OptionalInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.EmbeddingBag(20, 4, mode="sum")

    def forward(self, ids, dense=None, scale: float = 1.0, tag: str = "x"):
        out = self.e(ids) * scale
        return out if dense is None else out + dense


def test_arguments_the_example_left_at_their_defaults_are_taken_as_the_model_takes_them():
    """Given or not, by position or by name, at their defaults: the model's answer. Another value
    is an error naming the argument (the captured graph did not read it); an argument the example
    gave stays required, as it is a tensor the graph reads."""
    model = OptionalInputs()
    ids = torch.randint(0, 20, (3, 2))
    fast = fxrec.transform(model, (ids,))
    want = model(ids)
    for call in (lambda f: f(ids), lambda f: f(ids, None), lambda f: f(ids, dense=None), lambda f: f(ids, None, 1.0),
                 lambda f: f(ids, scale=1.0, tag="x")):
        torch.testing.assert_close(call(fast), want)
    # (the value given is named: "got a float" did not say which)
    for bad, name, got in (((ids, torch.ones(3, 4)), "dense", r"a tensor of shape \(3, 4\)"),
                           ((ids, None, 2.0), "scale", r"a float \(2.0\)"), ((ids, None, 1), "scale", r"an int \(1\)"),
                           ((ids, None, 1.0, "y"), "tag", r"a str \('y'\)")):
        with pytest.raises(ValueError, match=rf"input {name} was left at its default .* when the model was captured "
                                             rf"and must stay so \(transform with it given, to pass it\), got {got}$"):
            fast(*bad)
    given = fxrec.transform(model, (ids, torch.ones(3, 4)))
    torch.testing.assert_close(given(ids, torch.ones(3, 4)), model(ids, torch.ones(3, 4)))
    with pytest.raises(ValueError, match="input dense was given when the model was captured"):
        given(ids)


class NamedLikeGlobals(nn.Module):
    """Arguments named like what generated code reads globally: fx's own names (``device``,
    ``torch``, ``inf``) and Python's builtins, one a list (``len``), one a dict (``isinstance``),
    one left at its default (``type``); Avazu-style feature names."""

    def __init__(self):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(30, 8, mode="sum") for _ in range(5)])

    def forward(self, device, torch, inf, len, isinstance, type=2):
        pooled = [self.bags[0](device), self.bags[1](torch), self.bags[2](inf.clamp(max=29)),
                  self.bags[3](len[0]), self.bags[4](isinstance["a"])]
        return globals()["torch"].cat(pooled, 1).clamp(max=float("inf")) * type


def test_arguments_named_like_the_codes_globals_do_not_hide_them():
    """(an argument named device made the code call the tensor: "'Tensor' object is not callable")"""
    model = NamedLikeGlobals()

    def batch(b, seed):
        g = torch.Generator().manual_seed(seed)
        ids = [torch.randint(0, 30, (b, 3), generator=g) for _ in range(5)]
        return ids[0], ids[1], ids[2], [ids[3]], {"a": ids[4]}

    fast = fxrec.transform(model, batch(4, 0))
    # features are named by the model's arguments, not fx's names for them (device_1)
    assert {e.feature for e in fast.report.lookups} >= {"device", "torch", "len_0"}
    for b in (4, 7):
        x = batch(b, b)
        torch.testing.assert_close(fast(*x), model(*x), rtol=0, atol=0)
        names = ("device", "torch", "inf", "len", "isinstance")
        torch.testing.assert_close(fast(**dict(zip(names, x))), model(*x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="input len must have 1 elements"):
        fast(*batch(4, 1)[:3], [], {"a": batch(4, 1)[0]})
    with pytest.raises(ValueError, match="input type was left at its default 2"):
        fast(*batch(4, 1), type=3)
    torch.testing.assert_close(fxrec.export.torchscript(fast)(*batch(5, 2)), model(*batch(5, 2)), rtol=0, atol=0)


class BuiltinNamedArguments(torch.nn.Module):
    """Arguments named like builtins the TorchScript form's code does not read (input, id), and one
    it does (len, a list)."""

    def __init__(self):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(30, 8, mode="sum") for _ in range(3)])

    def forward(self, input, id, len):
        return torch.cat([self.bags[0](input), self.bags[1](id), self.bags[2](len[0])], 1)


def test_the_torchscript_form_keeps_argument_names_it_can_and_names_the_models_in_errors():
    """(Every builtin-named argument was renamed, so ``scripted(input=...)`` failed, and errors said
    ``input len_arg``.)"""
    model = BuiltinNamedArguments()
    x = [torch.randint(0, 30, (4, 3)) for _ in range(3)]
    scripted = fxrec.export.torchscript(fxrec.transform(model, (x[0], x[1], [x[2]])))
    torch.testing.assert_close(scripted(input=x[0], id=x[1], len_arg=[x[2]]), model(x[0], x[1], [x[2]]),
                               rtol=0, atol=0)
    with pytest.raises(Exception, match="input len must have 1 elements"):
        scripted(x[0], x[1], [])


class IteratesItsDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.tables = nn.ModuleDict({k: nn.EmbeddingBag(50, 4) for k in ("user", "item")})

    def forward(self, feats):
        return torch.cat([self.tables[k](v) for k, v in feats.items()], 1)


def test_a_model_that_iterates_its_dict_takes_it_only_in_the_examples_key_order():
    """The graph reads a dict by key in the captured order: another order gave the example
    order's numbers where the model gives others (its concatenation follows the dict). A model
    that reads its dict by key takes any order (test above)."""
    model = IteratesItsDict()
    fast = fxrec.transform(model, ({"user": torch.randint(0, 50, (4, 3)), "item": torch.randint(0, 50, (4, 3))},))
    u, i = torch.randint(0, 50, (2, 3)), torch.randint(0, 50, (2, 3))
    torch.testing.assert_close(fast({"user": u, "item": i}), model({"user": u, "item": i}), rtol=0, atol=0)
    scripted = fxrec.export.torchscript(fast)
    torch.testing.assert_close(scripted({"user": u, "item": i}), model({"user": u, "item": i}), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"input feats has its keys in another order than the example's \('user', "
                                         r"'item'\), and the model's output depends on that order .* got a dict with "
                                         r"keys 'item', 'user'"):
        fast({"item": i, "user": u})
    with pytest.raises(Exception, match="input feats has its keys in another order than the example's"):
        scripted({"item": i, "user": u})


class UnpacksItsDict(nn.Module):
    """Unpacks the dict's values by position: the reversed order fails in the model itself."""

    def __init__(self):
        super().__init__()
        self.b = nn.EmbeddingBag(50, 8)
        self.la = nn.Linear(4, 1)
        self.lb = nn.Linear(8, 1)

    def forward(self, feats):
        dense, ids = feats.values()
        return self.la(dense) + self.lb(self.b(ids))


def test_a_model_that_fails_on_its_dict_in_another_order_transforms_and_takes_the_examples_order():
    """(transform raised the model's own error from its run on the reversed keys.)"""
    model = UnpacksItsDict()
    x = {"dense": torch.randn(4, 4), "ids": torch.randint(0, 50, (4, 3))}
    fast = fxrec.transform(model, (x,))
    torch.testing.assert_close(fast(x), model(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="input feats has its keys in another order than the example's"):
        fast({"ids": x["ids"], "dense": x["dense"]})


class CountsRealCalls(IteratesItsDict):
    """IteratesItsDict, counting the calls on real tensors (capture traces on fake ones)."""

    calls = 0

    def forward(self, feats):
        if not isinstance(feats["user"], torch._subclasses.FakeTensor):
            type(self).calls += 1
        return super().forward(feats)


def test_only_transform_runs_the_model_to_learn_whether_its_dict_order_matters():
    """explain's graph is never called: it leaves the two runs of the model out."""
    x = ({"user": torch.randint(0, 50, (4, 3)), "item": torch.randint(0, 50, (4, 3))},)
    CountsRealCalls.calls = 0
    fxrec.explain(CountsRealCalls(), x)
    assert CountsRealCalls.calls == 0
    fxrec.transform(CountsRealCalls(), x)
    # the example's order, the keys reversed, and (the outputs differ) the example's order again
    assert CountsRealCalls.calls == 3


class ReadsByKeyNotBitForBit(nn.Module):
    """Reads its dict by key, and its runs differ in the last bits (as CUDA's atomic adds do)."""

    def __init__(self):
        super().__init__()
        self.tables = nn.ModuleDict({k: nn.EmbeddingBag(50, 4) for k in ("user", "item")})
        self.runs = 0

    def forward(self, feats):
        self.runs += 1
        out = torch.cat([self.tables["user"](feats["user"]), self.tables["item"](feats["item"])], 1)
        return out * (1.0 + 1e-7 * (self.runs % 3))


def test_a_model_whose_runs_differ_in_the_last_bits_is_not_taken_for_one_whose_dict_order_matters():
    """Two runs on the same dict that differ (CUDA's index_add_ / scatter_add_) made the exact
    comparison of the two orders fail, and the model refused its dict in any other key order."""
    model = ReadsByKeyNotBitForBit()
    u, i = torch.randint(0, 50, (4, 3)), torch.randint(0, 50, (4, 3))
    fast = fxrec.transform(model, ({"user": u, "item": i},))
    torch.testing.assert_close(fast({"item": i, "user": u}), fast({"user": u, "item": i}), rtol=0, atol=0)


class OptionalContext(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(50, 8)
        self.c = nn.Linear(4, 8)

    def forward(self, ids, context=None):
        z = self.e(ids)
        return z + self.c(context) if context is not None else z


def test_an_argument_given_at_capture_that_the_model_lets_a_call_leave_out_is_named_when_left_out():
    """(It was Python's bare TypeError: "forward() missing 1 required positional argument".)"""
    model = OptionalContext()
    fast = fxrec.transform(model, (torch.randint(0, 50, (8,)), torch.randn(8, 4)))
    ids, ctx = torch.randint(0, 50, (4,)), torch.randn(4, 4)
    for m in (fast, pickle.loads(pickle.dumps(fast))):
        torch.testing.assert_close(m(ids, ctx), model(ids, ctx), rtol=0, atol=0)
        torch.testing.assert_close(m(ids, context=ctx), model(ids, ctx), rtol=0, atol=0)
        with pytest.raises(ValueError, match=r"input context was given when the model was captured, and the "
                                             r"transformed model reads it: pass it \(left out, the model takes its "
                                             r"default None"):
            m(ids)
    scripted = fxrec.export.torchscript(fast)
    torch.testing.assert_close(scripted(ids, ctx), model(ids, ctx), rtol=0, atol=0)
    # given at its default None: the graph does not read it, and a call may leave it out
    none_given = fxrec.transform(model, (torch.randint(0, 50, (8,)), None))
    torch.testing.assert_close(none_given(ids), model(ids), rtol=0, atol=0)
    torch.testing.assert_close(none_given(ids, None), model(ids), rtol=0, atol=0)


class GradBlocks(nn.Module):
    """A lookup in a no_grad block (left as written: its bad offsets raise inside the block), and
    an input named like the function the code calls the blocks by."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 4, mode="sum")
        self.lin = nn.Linear(4, 1)

    def forward(self, ids, offsets, fxrec_grad_block):
        with torch.no_grad():
            e = self.bag(ids, offsets)
        with torch.enable_grad():
            e = e * fxrec_grad_block
        return self.lin(e)


def test_a_call_that_raises_inside_a_no_grad_block_gives_the_grad_mode_back():
    """torch's wrap_with_set_grad_enabled, which the captured block is, leaves the grad mode set
    when its body raises: one bad input turned autograd off for the process, and the next
    training step's output did not require grad."""
    torch.manual_seed(0)
    model = GradBlocks()
    x = (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2]), torch.rand(2, 4))
    fast = fxrec.transform(model, x)
    assert re.search(r"= fxrec_grad_block_\d+\(False, ", fast.code) and "wrap_with_set_grad_enabled" not in fast.code
    with pytest.raises(RuntimeError):
        fast(x[0], torch.tensor([0, 9]), x[2])  # offsets past the ids: raised inside the block
    assert torch.is_grad_enabled()
    with torch.no_grad():
        with pytest.raises(RuntimeError):
            fast(x[0], torch.tensor([0, 9]), x[2])
        assert not torch.is_grad_enabled()  # (the mode the call was made in)
    out = fast(*x)
    torch.testing.assert_close(out, model(*x))
    out.sum().backward()
    assert fast.lin.weight.grad is not None
    again = pickle.loads(pickle.dumps(fast))  # (the code is made again from the graph)
    torch.testing.assert_close(again(*x), model(*x))
    ep = fxrec.export.program(fast, x)  # (traced through the function: the block again)
    torch.testing.assert_close(ep.module()(*x), model(*x))
