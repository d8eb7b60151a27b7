import torch

from fxrec.passes.annotate_lookups import annotate_lookups
from fxrec.passes.fold_concat import fold_concat
from fxrec.passes.choose_kernels import choose_kernels
from fxrec.passes.group_lookups import group_lookups
from fxrec.passes.lower_groups import lower_groups
from fxrec.testing import assert_matches, calls, captured, group_calls, run_passes
from tests import models as M

aten = torch.ops.aten
PIPE = [annotate_lookups, group_lookups, choose_kernels, lower_groups, fold_concat]


def test_cat_of_all_group_columns_takes_the_group_output():
    model, inputs = M.BagList(), M.bag_inputs()
    gm, _ = run_passes(captured(model, inputs), PIPE, inputs)
    (call,) = group_calls(gm)
    (cat,) = calls(gm, [aten.cat.default])
    assert cat.args[0][1] is call
    assert not calls(gm, [aten.slice.Tensor])
    assert_matches(model, gm, inputs)


class OnlyEmbeddings(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.EmbeddingBag(10, 4), torch.nn.EmbeddingBag(10, 8)

    def forward(self, i, o):
        return torch.cat([self.a(i, o), self.b(i, o)], 1)


def test_cat_of_nothing_but_the_group_disappears():
    inputs = (torch.tensor([1, 2, 3]), torch.tensor([0, 2]))
    model = OnlyEmbeddings()
    gm, _ = run_passes(captured(model, inputs), PIPE, inputs)
    assert not calls(gm, [aten.cat.default])
    assert_matches(model, gm, inputs)


class Reordered(torch.nn.Module):
    """The cat lists the features in another order than their lookups, with a dense in between."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.EmbeddingBag(10, 4) for _ in range(3))

    def forward(self, i, o, x):
        ea, eb, ec = self.a(i, o), self.b(i, o), self.c(i, o)
        return torch.cat([ec, ea, x, eb], 1), torch.cat([eb, ea], 1)


def test_partial_runs_fold_to_one_slice_and_out_of_order_runs_stay():
    inputs = (torch.tensor([1, 2, 3]), torch.tensor([0, 2]), torch.rand(2, 3))
    model = Reordered()
    gm, _ = run_passes(captured(model, inputs), PIPE, inputs)
    cat1, cat2 = calls(gm, [aten.cat.default])
    # group columns follow the first cat: c, a, b. [ec, ea] is one slice; eb stays; cat2 is out of order.
    assert len(cat1.args[0]) == 3
    assert cat1.args[0][0].target is aten.slice.Tensor and cat1.args[0][0].args[2:] == (0, 8)
    assert len(cat2.args[0]) == 2
    assert_matches(model, gm, inputs)


def test_stack_of_a_whole_group_becomes_a_reshape_of_its_output():
    from examples.dlrm import DLRM, make_batch

    rows = [20, 30, 40]
    model = DLRM(rows, dim=8)
    inputs = make_batch(rows, batch=5, ids_per_bag=2)
    gm, _ = run_passes(captured(model, inputs), PIPE, inputs)
    assert not calls(gm, [aten.stack.default])
    (call,) = group_calls(gm)
    (reshape,) = [u for u in call.users if u.target is aten.reshape.default]
    assert reshape.args[1][1:] == [3, 8]
    assert all(n.args[0] is not call for n in calls(gm, [aten.slice.Tensor]))  # no column slices left
    assert_matches(model, gm, inputs, make_batch(rows, batch=3, ids_per_bag=1, seed=2))


class MixedDimsStack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.EmbeddingBag(10, 4), torch.nn.EmbeddingBag(10, 8)

    def forward(self, i, o):
        return torch.stack([self.a(i, o), self.b(i, o)[:, :4]], 1)


def test_does_not_fold_a_stack_that_is_not_a_whole_group_of_one_dim():
    inputs = (torch.tensor([1, 2, 3]), torch.tensor([0, 2]))
    model = MixedDimsStack()
    gm, _ = run_passes(captured(model, inputs), PIPE, inputs)
    assert len(calls(gm, [aten.stack.default])) == 1
    assert_matches(model, gm, inputs)
