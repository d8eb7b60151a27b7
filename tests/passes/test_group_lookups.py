
import torch
from hypothesis import given, strategies as st

from fxrec import meta
from fxrec.passes.annotate_lookups import annotate_lookups
from fxrec.passes.group_lookups import group_key, group_lookups
from fxrec.testing import captured, run_passes
from tests import models as M


def groups_of(model, inputs):
    gm, ctx = run_passes(captured(model, inputs), [annotate_lookups, group_lookups], inputs)
    return [[r.table for r in g.lookups] for g in ctx.groups], ctx, gm


def test_groups_all_compatible_bags_into_one():
    groups, _, _ = groups_of(M.BagList(), M.bag_inputs())
    assert groups == [["bags.0", "bags.1", "bags.2"]]


def test_does_not_group_different_pooling_or_weighting():
    groups, ctx, _ = groups_of(M.WeightedBags(), M.weighted_inputs())
    assert sorted(groups) == [["b2d"], ["w1", "w2"]]
    keys = {tuple(g): gr.key for g, gr in zip(groups, ctx.groups)}
    assert keys[("w1", "w2")][:2] == ("sum", True)


def test_shared_table_is_one_table_of_the_group():
    groups, ctx, _ = groups_of(M.SharedTables(), M.shared_inputs())
    assert groups == [["item", "item", "cat"]]
    assert ctx.groups[0].tables == ["item.weight", "cat.weight"]


def test_sequence_lookups_group_by_dim():
    class Seqs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = torch.nn.Embedding(10, 8), torch.nn.Embedding(10, 8), torch.nn.Embedding(10, 4)

        def forward(self, x):
            return self.a(x).sum(-1) + self.b(x).sum(-1) + self.c(x).sum(-1)

    groups, _, _ = groups_of(Seqs(), (torch.randint(0, 10, (3, 5)),))
    assert sorted(groups) == [["a", "b"], ["c"]]


class Dependent(torch.nn.Module):
    """The second lookup's ids are computed from the first lookup's output."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.EmbeddingBag(10, 4, mode="sum")
        self.second = torch.nn.EmbeddingBag(10, 4, mode="sum")
        self.third = torch.nn.EmbeddingBag(10, 4, mode="sum")

    def forward(self, ids, offsets):
        a = self.first(ids, offsets)
        ids2 = (a.sum(1).abs() * 3).long().clamp(0, 9)
        b = self.second(ids2, torch.arange(ids2.numel()))
        c = self.third(ids, offsets)
        return torch.cat([a, b, c], 1)


def test_never_groups_a_lookup_with_one_it_depends_on():
    inputs = (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 3]))
    groups, _, _ = groups_of(Dependent(), inputs)
    flat = [t for g in groups for t in g]
    assert sorted(flat) == ["first", "second", "third"]
    for g in groups:
        assert not ("first" in g and "second" in g)


def test_dependent_model_still_matches_after_lowering():
    import fxrec
    from fxrec.testing import assert_matches

    inputs = (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 3]))
    model = Dependent()
    fast = fxrec.transform(model, inputs, backend="fbgemm", check_passes=True)
    assert_matches(model, fast, inputs, (torch.tensor([5, 6, 7, 8, 9]), torch.tensor([0, 2, 2, 4])))


def test_left_alone_lookups_are_not_grouped():
    groups, _, _ = groups_of(M.NotLowerable(), M.not_lowerable_inputs())
    assert groups == [["ok"]]


# --- the key function, one field at a time (as TorchRec tests its grouping key) -------------
BASE = dict(pooling="sum", per_sample_weights=None, dtype="float32", device="cpu", sparse=False, dim=8)


def fake_record(**kw):
    fields = dict(BASE, **kw)
    node = object()
    return meta.LookupRecord(
        node=node, table="t", param="t.weight", feature="f", form="bag", pooling=fields["pooling"], num_rows=10,
        dim=fields["dim"], dtype=fields["dtype"], device=fields["device"], weight=node, ids=node, offsets=None,
        per_sample_weights=fields["per_sample_weights"], output=node, nodes=(), sparse=fields["sparse"],
    )


@given(
    field=st.sampled_from(["pooling", "per_sample_weights", "dtype", "device", "sparse"]),
    dim=st.sampled_from([4, 8, 16]),
)
def test_key_differs_when_one_grouping_field_differs(field, dim):
    other = {"pooling": "mean", "per_sample_weights": object(), "dtype": "float16", "device": "cuda:0", "sparse": True}
    a = fake_record(dim=dim)
    b = fake_record(dim=dim, **{field: other[field]})
    assert group_key(a) != group_key(b)


@given(d1=st.sampled_from([4, 8, 12, 64]), d2=st.sampled_from([4, 8, 12, 64]), pooling=st.sampled_from(["sum", "mean"]))
def test_pooled_lookups_of_any_dims_share_a_key(d1, d2, pooling):
    assert group_key(fake_record(dim=d1, pooling=pooling)) == group_key(fake_record(dim=d2, pooling=pooling))


@given(d1=st.sampled_from([4, 8, 12]), d2=st.sampled_from([4, 8, 12]))
def test_sequence_lookups_share_a_key_only_with_equal_dims(d1, d2):
    same = group_key(fake_record(dim=d1, pooling="none")) == group_key(fake_record(dim=d2, pooling="none"))
    assert same == (d1 == d2)


def test_candidate_lookup_joins_the_history_sequence_of_its_table():
    from tests.test_ctr_models import DIN, din_inputs

    groups, ctx, gm = groups_of(DIN(), din_inputs(0))
    # one sequence TBE: histories and candidates, each table's lookups side by side (fbgemm needs that)
    assert groups == [["item", "item", "cat", "cat"]]
    forms = {(r.table, r.form) for n in gm.graph.nodes if meta.LOOKUP in n.meta for r in [n.meta[meta.LOOKUP]]}
    assert forms == {("item", "seq"), ("cat", "seq")}
