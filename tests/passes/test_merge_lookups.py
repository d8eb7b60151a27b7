import copy
import json
import pickle

import pytest
import torch
from torch import nn

import fxrec
from fxrec import meta
from fxrec.passes.annotate_lookups import annotate_lookups
from fxrec.passes.group_lookups import group_lookups
from fxrec.passes.merge_lookups import merge_lookups
from fxrec.testing import assert_matches, captured, embedding_ops, group_calls, run_passes

aten = torch.ops.aten


def merged(model, inputs):
    gm, ctx = run_passes(captured(model, inputs), [annotate_lookups, merge_lookups], inputs)
    lookups = [n.meta[meta.LOOKUP] for n in gm.graph.nodes if meta.LOOKUP in n.meta]
    return gm, ctx, lookups


def all_lowered(model, inputs, *others, backend="fbgemm", groups=1):
    fast = fxrec.transform(model, inputs, backend=backend, check_passes=True, verify=True, timing_rounds=1)
    assert not fast.report.left_alone, fast.report
    assert not embedding_ops(fast)
    assert len(group_calls(fast)) == fast.report.fragmentation.groups == fast.report.fragmentation.fewest == groups
    assert_matches(model, fast, inputs, *others)
    return fast


class Dead(nn.Module):
    """A lookup whose result is never used (left over from an experiment), with ids computed for it
    alone."""

    def __init__(self):
        super().__init__()
        self.user = nn.Embedding(20, 8)
        self.old = nn.Embedding(30, 8)
        self.top = nn.Linear(8, 1)

    def forward(self, uid, extra):
        unused = self.old((extra * 3) % 30)  # noqa: F841
        return self.top(self.user(uid))


def dead_inputs(seed=0, batch=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 20, (batch,), generator=g), torch.randint(0, 30, (batch,), generator=g)


def test_an_unused_lookup_is_removed_with_its_own_id_computations():
    gm, _, lookups = merged(Dead(), dead_inputs())
    assert [r.table for r in lookups] == ["user"]
    assert not [n for n in gm.graph.nodes if n.target in (aten.mul.Tensor, aten.remainder.Scalar)]
    assert not [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "old.weight"]
    assert gm.meta[meta.REMOVED] == (meta.RemovedLookup("old", "remainder", "test_merge_lookups.py:45",
                                                        "result unused: removed"),)


@pytest.mark.parametrize("backend", ["fbgemm", "auto"])
def test_dead_lookup_model_lowers_the_rest_and_matches(backend):
    fast = all_lowered(Dead(), dead_inputs(), dead_inputs(1, batch=2), backend=backend)
    assert [(r.table, r.what) for r in fast.report.removed] == [("old", "result unused: removed")]
    text = str(fast.report)
    assert "1 merged or removed (unused)" in text.splitlines()[0]
    assert "Removed lookups" in text and "result unused: removed" in text
    assert json.loads(fast.report.to_json())["removed"] == [
        {"table": "old", "feature": "remainder", "source": "test_merge_lookups.py:45", "what": "result unused: removed"}]


class Repeated(nn.Module):
    """The same table looked up twice with the same ids (and with equal id computations)."""

    def __init__(self):
        super().__init__()
        self.item = nn.EmbeddingBag(40, 8, mode="sum")
        self.cat = nn.Embedding(10, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, ids, offsets, feats):
        x = self.a(self.item(ids, offsets)) + self.b(self.item(ids, offsets))
        y = self.cat(feats[:, 0].long()) * self.cat(feats[:, 0].long()).sigmoid()
        return torch.cat([x, y], 1)


def repeated_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 40, (7,), generator=g), torch.tensor([0, 2, 2, 5]),
            torch.randint(0, 10, (4, 2), generator=g).float())


def test_a_repeated_lookup_is_merged_into_the_first():
    gm, _, lookups = merged(Repeated(), repeated_inputs())
    assert [(r.table, r.feature) for r in lookups] == [("item", "ids"), ("cat", "feats[:, 0]")]
    item, cat = lookups
    assert [u.target for u in item.output.users] == [aten.linear.default] * 2
    assert len(cat.output.users) == 2
    assert [(r.table, r.what) for r in gm.meta[meta.REMOVED]] == [
        ("item", "merged into ids"), ("cat", "merged into feats[:, 0]")]
    assert len([n for n in gm.graph.nodes if n.target is aten._to_copy.default or n.target is aten.to.dtype]) <= 1


@pytest.mark.parametrize("backend", ["fbgemm", "auto"])
def test_repeated_lookups_model_matches_gradients_summed_over_both_uses(backend):
    all_lowered(Repeated(), repeated_inputs(), repeated_inputs(1), backend=backend)


def test_lookups_that_differ_in_anything_are_not_merged():
    class Different(nn.Module):
        def __init__(self):
            super().__init__()
            self.t = nn.EmbeddingBag(20, 4, mode="sum")

        def forward(self, ids, offsets, offsets2, psw):
            t = self.t.weight
            F = nn.functional
            return torch.cat([
                F.embedding_bag(ids, t, offsets, mode="sum"),
                F.embedding_bag(ids, t, offsets2, mode="sum"),  # other offsets
                F.embedding_bag(ids, t, offsets, mode="mean"),  # other pooling
                F.embedding_bag(ids, t, offsets, mode="sum", per_sample_weights=psw),  # weighted
                F.embedding_bag(ids, t, offsets, mode="sum", padding_idx=3),  # a padding row
                F.embedding_bag(ids, t, offsets, mode="sum"),  # the first again: merged
            ], 1)

    inputs = (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 3]), torch.tensor([0, 2, 2]), torch.rand(4))
    gm, _, lookups = merged(Different(), inputs)
    assert len(lookups) == 5
    assert [r.what for r in gm.meta[meta.REMOVED]] == ["merged into ids"]
    model = Different()
    fast = fxrec.transform(model, inputs, backend="auto", check_passes=True)
    assert_matches(model, fast, inputs)


class MultiTask(nn.Module):
    """Each task's tower looks the user features up again; the batch size is read from yet another
    lookup of one of them."""

    def __init__(self, dim=8):
        super().__init__()
        self.user = nn.ModuleDict({"age": nn.Embedding(10, dim), "city": nn.Embedding(20, dim)})
        self.item = nn.Embedding(40, dim)
        self.towers = nn.ModuleList(nn.Linear(3 * dim, 1) for _ in range(2))

    def forward(self, feats):
        n = self.user["age"](feats["age"]).shape[0]
        outs = []
        for tower in self.towers:
            x = torch.cat([self.user[k](feats[k]) for k in ("age", "city")] + [self.item(feats["item"])], 1)
            outs.append(tower(x))
        return torch.cat(outs, 1) + torch.zeros(n, 1)


def multitask_inputs(seed=0, batch=4):
    g = torch.Generator().manual_seed(seed)
    return ({"age": torch.randint(0, 10, (batch,), generator=g), "city": torch.randint(0, 20, (batch,), generator=g),
             "item": torch.randint(0, 40, (batch,), generator=g)},)


def test_multitask_lookups_repeated_per_task_run_once_in_one_group():
    gm, ctx = run_passes(captured(MultiTask(), multitask_inputs()), [annotate_lookups, merge_lookups, group_lookups],
                         multitask_inputs())
    assert [[r.table for r in g.lookups] for g in ctx.groups] == [["user.age", "user.city", "item"]]
    assert sorted(r.what for r in gm.meta[meta.REMOVED]) == [
        "merged into feats_age#2", "merged into feats_city", "merged into feats_item", "result unused: removed"]


@pytest.mark.parametrize("backend", ["fbgemm", "auto"])
def test_multitask_model_lowers_every_lookup_and_matches(backend):
    all_lowered(MultiTask(), multitask_inputs(), multitask_inputs(1, batch=1), multitask_inputs(2, batch=6),
                backend=backend)


def test_ids_written_in_place_between_two_lookups_are_not_the_same_ids():
    class Written(nn.Module):
        def __init__(self):
            super().__init__()
            self.t = nn.Embedding(20, 4)

        def forward(self, ids):
            a = self.t(ids % 20)
            ids.add_(1)
            return a + self.t(ids % 20)

    inputs = (torch.tensor([1, 2, 19]),)
    gm, _, lookups = merged(Written(), inputs)
    assert len(lookups) == 2 and not gm.meta[meta.REMOVED]
    model = Written()
    fast = fxrec.transform(model, inputs, backend="auto", check_passes=True)
    a, b = torch.tensor([1, 2, 19]), torch.tensor([1, 2, 19])
    torch.testing.assert_close(fast(b), model(a))
    assert torch.equal(a, b)


def test_removed_lookups_survive_pickle_and_deepcopy():
    fast = fxrec.transform(Dead(), dead_inputs(), backend="auto")
    for other in (pickle.loads(pickle.dumps(fast)), copy.deepcopy(fast)):
        assert other.report.removed == fast.report.removed
        assert other.report.fragmentation == fast.report.fragmentation
        assert other.meta[meta.REMOVED] == fast.meta[meta.REMOVED]


def test_explain_reports_merges_and_fragmentation_too():
    report = fxrec.explain(MultiTask(), multitask_inputs(), device="cuda")
    assert len(report.removed) == 4
    assert (report.fragmentation.groups, report.fragmentation.fewest) == (1, 1)
