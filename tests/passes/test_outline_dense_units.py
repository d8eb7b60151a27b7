"""outline_dense_units: the operations of each dense submodule's call become a call of that
submodule (its forward: a graph of them), so that FSDP can shard it as a unit; what cannot move
stays. One process here (no FSDP): structure, numbers against the plain model, the cases left
alone. FSDP over them: tests/test_sharding_fsdp.py."""

import copy
import re

import pytest

import torch
from torch import nn

import fxrec
from fxrec.passes.outline_dense_units import UNIT, UnitForward, outline_dense_units
from fxrec.testing import assert_matches

IDS = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1, 2]])


def _outlined(model, *inputs):
    """The model transformed in one process, its dense units outlined (tables left out)."""
    fast = fxrec.transform(model, inputs)
    tables = {n for n, _ in fast.named_parameters() if n.startswith("emb")}
    return fast, outline_dense_units(fast, tables)


def _unit_calls(fast):
    return [n.target for n in fast.graph.nodes if n.op == "call_module" and UNIT in n.meta]


class Mlp(nn.Module):
    def __init__(self, inplace=False):
        super().__init__()
        self.emb = nn.EmbeddingBag(20, 8, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=inplace), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

    def forward(self, ids):
        return self.mlp(self.emb(ids))


def test_each_layer_of_a_sequential_is_a_unit_and_the_numbers_are_the_models():
    torch.manual_seed(0)
    model = Mlp()
    fast, units = _outlined(copy.deepcopy(model), IDS)
    assert units == ["mlp.0", "mlp.2", "mlp.4"]  # (the Sequential is a container: its layers are the units)
    assert _unit_calls(fast) == units
    linears = [n for n in fast.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.linear.default]
    assert not linears  # every linear moved into its unit
    assert not [n for n in fast.graph.nodes if n.op == "get_attr" and str(n.target).startswith("mlp")]
    fwd = fast.mlp[0].forward
    assert isinstance(fwd, UnitForward) and "aten.linear.default" in fwd.code
    assert "self.mlp" in fast.code
    assert_matches(model, fast, (IDS,), (IDS[:2],))


def test_a_layer_whose_output_is_written_in_place_after_it_stays_a_unit():
    torch.manual_seed(0)
    model = Mlp(inplace=True)  # (ReLU(inplace=True) writes mlp.0's output: not a view, FSDP's hook holds)
    fast, units = _outlined(copy.deepcopy(model), IDS)
    assert units == ["mlp.0", "mlp.2", "mlp.4"]
    assert_matches(model, fast, (IDS,))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.norm(self.drop(torch.relu(self.lin(x)))) + x


class Blocks(nn.Module):
    """Blocks under a ModuleList (each a unit), a layer called twice, a table-holding tower."""

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(20, 8, mode="sum")
        self.blocks = nn.ModuleList([Block(), Block(), Block()])
        self.shared = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.out(self.shared(self.shared(x)))


def test_blocks_are_units_a_layer_called_twice_is_not_and_modes_still_switch():
    torch.manual_seed(0)
    model = Blocks()
    fast, units = _outlined(copy.deepcopy(model), IDS)
    assert units == ["blocks.0", "blocks.1", "blocks.2", "out"]
    assert [n for n in fast.graph.nodes if n.op == "get_attr" and n.target == "shared.weight"]
    assert "num_batches_tracked" in fast.blocks[0].forward.code  # (batch norm's counter moved with it)
    assert_matches(model, fast, (IDS,))
    torch.manual_seed(1)
    want = model(IDS)
    torch.manual_seed(1)
    got = fast(IDS)  # training: dropout and the batch's statistics, the running ones updated
    torch.testing.assert_close(got, want)
    for name, b in model.named_buffers():
        torch.testing.assert_close(fast.get_buffer(name), b, msg=name)
    model.eval()
    fast.eval()  # the units' dropout and batch norm read their module's flag when they run
    torch.testing.assert_close(fast(IDS), model(IDS))


def _layers(n):
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(n)])


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(20, 8, mode="sum")
        self.proj = nn.Linear(8, 8)

    def forward(self, ids):
        return self.proj(self.emb(ids))


class TableInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.tower = Tower()
        self.head = _layers(3)

    def forward(self, ids):
        return self.head(self.tower(ids))


def test_a_module_holding_a_table_is_not_a_unit_the_layers_it_calls_are():
    torch.manual_seed(0)
    model = TableInside()
    fast = fxrec.transform(copy.deepcopy(model), (IDS,))
    units = outline_dense_units(fast, {"tower.emb.weight"})
    assert units == ["tower.proj", "head.0", "head.1", "head.2"]
    assert_matches(model, fast, (IDS,))


class Tied(nn.Module):
    """The head reads the projection's weight outside the projection's call."""

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(20, 8, mode="sum")
        self.proj = nn.Linear(8, 8)
        self.head = _layers(4)

    def forward(self, ids):
        x = self.proj(self.emb(ids))
        return self.head(x) + (x @ self.proj.weight).sum(1, keepdim=True)


def test_a_layer_whose_parameter_is_read_outside_its_call_is_left_alone():
    torch.manual_seed(0)
    model = Tied()
    fast, units = _outlined(copy.deepcopy(model), IDS)
    assert units == ["head.0", "head.1", "head.2", "head.3"]
    assert [n for n in fast.graph.nodes if n.op == "get_attr" and n.target == "proj.weight"]
    assert_matches(model, fast, (IDS,))


class WritesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x.relu_())


class WritesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(20, 8, mode="sum")
        self.layer = WritesInput()
        self.head = _layers(2)

    def forward(self, ids):
        return self.head(self.layer(self.emb(ids) * 1.0))


def test_a_layer_that_writes_its_input_in_place_is_left_alone():
    torch.manual_seed(0)
    model = WritesItsInput()
    fast, units = _outlined(copy.deepcopy(model), IDS)
    assert units == ["layer.lin", "head.0", "head.1"]  # (the layer's own relu_ stays in the model, before its lin's call)
    assert_matches(model, fast, (IDS,))


class NoGradInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.stat = nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            s = self.stat(x)
        return self.lin(x) + s


class WithNoGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(20, 8, mode="sum")
        self.layer = NoGradInside()
        self.head = _layers(4)

    def forward(self, ids):
        return self.head(self.layer(self.emb(ids))).sum(1)


def test_a_no_grad_block_stays_in_the_model():
    torch.manual_seed(0)
    model = WithNoGrad()
    fast, units = _outlined(copy.deepcopy(model), IDS)
    assert units == ["layer.lin", "head.0", "head.1", "head.2", "head.3"]  # (layer.stat runs in the block)
    assert_matches(model, fast, (IDS,))


def test_nothing_dense_nothing_outlined():
    model = nn.EmbeddingBag(20, 8, mode="sum")
    fast = fxrec.transform(copy.deepcopy(model), (IDS,))
    before = fast.code
    assert outline_dense_units(fast, {"weight"}) == []
    assert fast.code == before


class Lopsided(nn.Module):
    """Two layers, one of them most of the bytes: units would not halve what is gathered at once."""

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(20, 8, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, ids):
        return self.mlp(self.emb(ids))


def test_units_that_would_not_halve_the_bytes_gathered_at_once_are_not_made():
    model = Lopsided()  # mlp.0: 576 of 641 parameters (90 %) > half
    fast, units = _outlined(copy.deepcopy(model), IDS)
    before = fast.code
    assert units == []
    assert fast.code == before and not _unit_calls(fast)
    two = Mlp()  # three layers of 72: the model's own unit holds nothing, the largest is a third
    fast2, units2 = _outlined(two, IDS)
    assert units2 == ["mlp.0", "mlp.2", "mlp.4"]


class ReturnsItsWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x), self.lin.weight.t()


class UsesAReturnedWeight(nn.Module):
    """A layer returning a view of its own weight, read after its call (found by a review: FSDP
    freed the gathered weight after the call, and the view read freed memory)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(20, 8, mode="sum")
        self.a = ReturnsItsWeight()
        self.head = _layers(3)

    def forward(self, ids):
        y, wt = self.a(self.emb(ids))
        return self.head(y) @ wt


def test_a_layer_returning_a_view_of_its_own_weight_is_left_alone():
    torch.manual_seed(0)
    model = UsesAReturnedWeight()
    fast, units = _outlined(copy.deepcopy(model), IDS)
    assert units == ["head.0", "head.1", "head.2"]  # (nor a.lin: a reads its weight outside its call)
    assert_matches(model, fast, (IDS,))


def test_an_outlined_model_copies_and_pickles_with_its_units():
    import io

    torch.manual_seed(0)
    model = Mlp()
    fast, units = _outlined(copy.deepcopy(model), IDS)
    twin = copy.deepcopy(fast)
    assert twin.mlp[0].forward.owner is twin.mlp[0]  # (the copy's units run on the copy's parameters)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    assert twin(IDS).abs().sum() == 0 and fast(IDS).abs().sum() > 0
    buf = io.BytesIO()
    torch.save(fast, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert back.mlp[2].forward.owner is back.mlp[2]
    assert_matches(model, back, (IDS,))


class TiedAcross(nn.Module):
    """The decoder's weight is the encoder's (found by a review: the decoder became a unit, and FSDP
    then met the one parameter in two units)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(20, 8, mode="sum")
        self.enc = nn.Linear(8, 8)
        self.mid = _layers(4)
        self.dec = nn.Linear(8, 8)
        self.dec.weight = self.enc.weight

    def forward(self, ids):
        return self.dec(self.mid(self.enc(self.emb(ids))))


def test_modules_sharing_a_parameter_are_left_alone():
    torch.manual_seed(0)
    model = TiedAcross()
    fast, units = _outlined(copy.deepcopy(model), IDS)
    assert fast.dec._parameters["weight"] is fast.enc._parameters["weight"]  # (both hold it)
    assert units == ["mid.0", "mid.1", "mid.2", "mid.3"]
    assert_matches(model, fast, (IDS,))


class TwoArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, y):
        return self.l2(torch.relu(self.l1(x)) + y)


class Interleaved(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(20, 8, mode="sum")
        self.b, self.c = TwoArgs(), TwoArgs()

    def forward(self, ids):
        x = self.emb(ids)
        y = x * 3
        return self.b(x, y) + self.c(x, y).sigmoid()


def test_an_operation_of_the_model_between_a_units_operations_moves_before_its_call():
    """(An earlier pass may order the graph so: here by hand.) The model's `x * 3`, which b's
    operations read, placed between them: it moves before b's call."""
    torch.manual_seed(0)
    model = Interleaved()
    fast = fxrec.transform(copy.deepcopy(model), (IDS,))
    mul = next(n for n in fast.graph.nodes if n.target is torch.ops.aten.mul.Tensor)
    relu = next(n for n in fast.graph.nodes if n.target is torch.ops.aten.relu.default)
    relu.append(mul)
    fast.recompile()
    assert outline_dense_units(fast, {"emb.weight"}) == ["b", "c"]
    nodes = list(fast.graph.nodes)
    call_b = next(n for n in nodes if n.op == "call_module" and n.target == "b")
    assert nodes.index(mul) < nodes.index(call_b) and call_b.args[1] is mul
    assert_matches(model, fast, (IDS,), (IDS[:2],))


# fsdp_units= (transform(dense="fsdp", fsdp_units=...)): the choice against the rule


def _chosen(model, choose, tables=("emb.weight",)):
    fast = fxrec.transform(copy.deepcopy(model), (IDS,))
    return fast, outline_dense_units(fast, set(tables), choose)


def test_every_makes_the_units_the_halving_rule_would_not_and_one_makes_none():
    torch.manual_seed(0)
    model = Lopsided()  # (the rule: no units, mlp.0 is 90 % of the bytes)
    fast, units = _chosen(model, "every")
    assert units == ["mlp.0", "mlp.2"] and _unit_calls(fast) == units
    assert_matches(model, fast, (IDS,))
    fast, units = _chosen(Mlp(), "one")  # (the rule: three units)
    assert units == [] and not _unit_calls(fast)


def test_named_units_are_made_as_named_and_the_rest_stays_in_the_model():
    torch.manual_seed(0)
    model = Blocks()
    fast, units = _chosen(model, ["out", "blocks.1"])
    assert units == ["blocks.1", "out"]  # (in the order their calls run)
    assert _unit_calls(fast) == units
    assert [n for n in fast.graph.nodes if n.op == "get_attr" and n.target == "blocks.0.lin.weight"]
    assert isinstance(fast.blocks[1].forward, UnitForward)
    assert not isinstance(fast.blocks[0].forward, UnitForward)
    assert_matches(model, fast, (IDS,))
    fast, units = _chosen(model, ["blocks.0.lin", "blocks.0.norm"])  # (inside a block the rule would take whole)
    assert units == ["blocks.0.lin", "blocks.0.norm"]
    assert_matches(model, fast, (IDS,))


class Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x)


class CallsAnother(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, other):
        return self.l2(other(self.l1(x)))


class PassedIn(nn.Module):
    """``b`` runs inside ``a``'s call (passed to it), though its name is not under ``a``."""

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(20, 8, mode="sum")
        self.a, self.b, self.out = CallsAnother(), Lin(), nn.Linear(8, 1)

    def forward(self, ids):
        return self.out(self.a(self.emb(ids), self.b))


def test_a_module_passed_to_another_can_be_a_unit_beside_the_others_layers():
    torch.manual_seed(0)
    model = PassedIn()
    fast, units = _chosen(model, ["b", "a.l1", "a.l2"])
    assert units == ["a.l1", "b", "a.l2"]
    assert_matches(model, fast, (IDS,))


@pytest.mark.parametrize("model, names, words", [
    (Blocks, ["shared"], "'shared' cannot be an FSDP unit: the model's forward calls it 2 times"),
    (Blocks, ["blocks"], "'blocks' cannot be an FSDP unit: it is the model's ModuleList (its layers can be units)"),
    (Blocks, ["emb"], "'emb' cannot be an FSDP unit: it holds the embedding table 'emb.weight'"),
    (Blocks, ["blocks.0.drop"], "'blocks.0.drop' cannot be an FSDP unit: it holds no dense parameter"),
    (Blocks, ["blocks.9"], "the model has no submodule 'blocks.9' that its forward calls"),
    (Blocks, [""], "'' is the model itself, always a unit"),
    (Blocks, ["blocks.0", "blocks.0.lin"], "'blocks.0.lin' runs inside the call of 'blocks.0', also named: units do not nest"),
    (Tied, ["proj"], "'proj' cannot be an FSDP unit: its 'proj.weight' is read outside its call too"),
    (WritesItsInput, ["layer"], "'layer' cannot be an FSDP unit: it writes one of its inputs in place"),
    (WithNoGrad, ["layer"], "'layer' cannot be an FSDP unit: it has a no_grad / autocast block"),
    (WithNoGrad, ["layer.stat"], "'layer.stat' cannot be an FSDP unit: its parameters are read in a no_grad / "
                                 "autocast block of the model"),
    (PassedIn, ["b", "a"], "'b' runs inside the call of 'a', also named: units do not nest"),
    (PassedIn, ["a", "b.lin"], "'b.lin' runs inside the call of 'a', also named: units do not nest"),
])
def test_a_named_unit_that_cannot_be_one_is_an_error_naming_it_and_why(model, names, words):
    torch.manual_seed(0)
    fast = fxrec.transform(model(), (IDS,))
    before = fast.code
    nodes = [(n.op, n.target, n.args) for n in fast.graph.nodes]
    forwards = {name: m.forward for name, m in fast.named_modules()}
    with pytest.raises(ValueError, match=re.escape(words)):
        outline_dense_units(fast, {"emb.weight"}, names)
    assert fast.code == before  # (checked before anything moves: the graph and every module's forward too)
    assert [(n.op, n.target, n.args) for n in fast.graph.nodes] == nodes
    assert {name: m.forward for name, m in fast.named_modules()} == forwards
