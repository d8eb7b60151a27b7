
import pytest
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
    assert groups == [["odd", "ok"]]  # max bag, max_norm and scale_grad_by_freq stay; dim 6 is lowered (pad_dim)


# --- the key function, one field at a time (as TorchRec tests its grouping key) -------------
BASE = dict(pooling="sum", per_sample_weights=None, dtype="float32", device="cpu", sparse=False, dim=8)


def fake_record(batch="s0", **kw):
    fields = dict(BASE, **kw)
    node = object()
    return meta.LookupRecord(batch=batch,
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


def test_pooled_lookups_share_a_key_only_over_one_batch_size_and_unpooled_ones_regardless():
    assert group_key(fake_record(batch="s0")) != group_key(fake_record(batch="s1"))
    assert group_key(fake_record(batch="s0", pooling="none")) == group_key(fake_record(batch="s1", pooling="none"))


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


# --- grouping across the whole graph -------------------------------------------------------
import json  # noqa: E402
import logging  # noqa: E402

import fxrec  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from fxrec.pass_infra import Config, PassContext, PassManager  # noqa: E402
from fxrec.report import Report  # noqa: E402
from fxrec.passes.merge_lookups import merge_lookups  # noqa: E402
from fxrec.testing import assert_matches, embedding_ops, group_calls  # noqa: E402


def grouped(model, inputs):
    """Groups (features per group), ctx and graph after annotate -> merge -> group."""
    gm, ctx = run_passes(captured(model, inputs), [annotate_lookups, merge_lookups, group_lookups], inputs)
    return [[r.feature for r in g.lookups] for g in ctx.groups], ctx, gm


def assert_inputs_before_users(gm):
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in gm.graph.nodes:
        for x in n.all_input_nodes:
            assert order[x] < order[n], f"{n.name} reads {x.name}, defined after it"
    assert list(gm.graph.nodes)[-1].op == "output"


def assert_groups_have_a_place(gm, ctx):
    """What lower_groups / shard_groups assume: every input of every member is defined before the
    first user of any member's output."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for gr in ctx.groups:
        own = {n for r in gr.lookups for n in r.nodes}
        users = [order[u] for r in gr.lookups for u in r.output.users if u not in own]
        inputs = [order[x] for r in gr.lookups for n in r.nodes for x in n.all_input_nodes if x not in own]
        if users:
            assert max(inputs) < min(users), gr.name


def transformed_all_lowered(model, inputs, *others, backend="fbgemm", groups=None):
    """transform with every pass checked against the model; every lookup lowered into the fewest
    groups; outputs and gradients equal to the plain model on other inputs too."""
    fast = fxrec.transform(model, inputs, backend=backend, check_passes=True, verify=True, timing_rounds=1)
    report = fast.report
    assert not report.left_alone, report
    assert not embedding_ops(fast)
    frag = report.fragmentation
    assert frag.groups == frag.fewest == len(group_calls(fast)), report
    if groups is not None:
        assert frag.groups == groups
    assert_matches(model, fast, *others)
    return fast


class DINApart(nn.Module):
    """DIN as written in real code: the history lookups, an MLP over them, and only then the
    target's ids computed and looked up (item and category tables shared by both)."""

    def __init__(self, items=100, cats=10, dim=8):
        super().__init__()
        self.item = nn.Embedding(items, dim, padding_idx=0)
        self.cat = nn.Embedding(cats, dim, padding_idx=0)
        self.hist_mlp = nn.Linear(2 * dim, 2 * dim)
        self.att = nn.Sequential(nn.Linear(4 * dim, 16), nn.Sigmoid(), nn.Linear(16, 1))
        self.out = nn.Linear(4 * dim, 1)

    def forward(self, hist_items, hist_cats, target):
        hist = torch.relu(self.hist_mlp(torch.cat([self.item(hist_items), self.cat(hist_cats)], -1)))
        t_item = target[:, 0] % 100  # computed after the history was used
        t_cat = target[:, 1] % 10
        cand = torch.cat([self.item(t_item), self.cat(t_cat)], -1)
        q = cand.unsqueeze(1).expand_as(hist)
        w = self.att(torch.cat([q, hist * q], -1)).squeeze(-1)
        w = w.masked_fill(hist_items == 0, -1e9).softmax(-1)
        return self.out(torch.cat([(w.unsqueeze(-1) * hist).sum(1), cand], -1))


def din_apart_inputs(seed=0, batch=4, length=5):
    g = torch.Generator().manual_seed(seed)
    hist = torch.randint(0, 100, (batch, length), generator=g)
    hist[:, :2] = 0
    target = torch.stack([torch.randint(1, 100, (batch,), generator=g), torch.randint(1, 10, (batch,), generator=g)], 1)
    return hist, torch.randint(0, 10, (batch, length), generator=g), target


def test_din_history_and_target_written_apart_share_one_group():
    groups, ctx, gm = grouped(DINApart(), din_apart_inputs())
    assert [[r.table for r in g.lookups] for g in ctx.groups] == [["item", "item", "cat", "cat"]]
    assert ctx.report.pass_runs[-1].stats["nodes_moved"] > 0  # the target's ids moved up
    assert_inputs_before_users(gm)
    assert_groups_have_a_place(gm, ctx)


@pytest.mark.parametrize("backend", ["fbgemm", "auto"])
def test_din_apart_lowers_every_lookup_and_matches(backend):
    model = DINApart()
    transformed_all_lowered(model, din_apart_inputs(), din_apart_inputs(1), din_apart_inputs(2, batch=1),
                            backend=backend, groups=1)


class TwoTower(nn.Module):
    """The user tower mean-pools the history over the item tower's table; the item tower looks the
    item up by one id (padding row 0 included)."""

    def __init__(self, users=30, items=50, cats=8, dim=8):
        super().__init__()
        self.user = nn.Embedding(users, dim)
        self.item = nn.Embedding(items, dim, padding_idx=0)
        self.item_cat = nn.Embedding(cats, dim)
        self.user_mlp = nn.Linear(2 * dim, dim)
        self.item_mlp = nn.Linear(2 * dim, dim)

    def user_tower(self, uid, hist):
        return self.user_mlp(torch.cat([self.user(uid), self.item(hist).mean(1)], 1))

    def item_tower(self, iid, cid):
        return self.item_mlp(torch.cat([self.item(iid), self.item_cat(cid)], 1))

    def forward(self, uid, hist, iid, cid):
        return (torch.relu(self.user_tower(uid, hist)) * torch.relu(self.item_tower(iid, cid))).sum(1)


def two_tower_inputs(seed=0, batch=5):
    g = torch.Generator().manual_seed(seed)
    hist = torch.randint(0, 50, (batch, 4), generator=g)
    hist[0, 0] = 0
    iid = torch.randint(0, 50, (batch,), generator=g)
    iid[min(1, batch - 1)] = 0
    return torch.randint(0, 30, (batch,), generator=g), hist, iid, torch.randint(0, 8, (batch,), generator=g)


def test_two_tower_one_id_lookups_join_the_mean_pooled_history():
    groups, ctx, gm = grouped(TwoTower(), two_tower_inputs())
    assert len(ctx.groups) == 1 and ctx.groups[0].pooling == "mean"
    pooling = {r.feature: (r.form, r.pooling) for r in ctx.groups[0].lookups}
    assert pooling == {"uid": ("single", "mean"), "hist": ("pooled_seq", "mean"), "iid": ("single", "mean"),
                       "cid": ("single", "mean")}
    assert gm.meta[meta.FRAGMENTATION] == meta.Fragmentation(groups=1, fewest=1, kinds=("mean",), splits=())


@pytest.mark.parametrize("backend", ["fbgemm", "auto"])
def test_two_tower_lowers_every_lookup_and_matches(backend):
    transformed_all_lowered(TwoTower(), two_tower_inputs(), two_tower_inputs(1), two_tower_inputs(2, batch=2),
                            backend=backend, groups=1)


def test_one_id_lookup_takes_the_mean_of_its_tables_other_lookups_but_keeps_sum_elsewhere():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.EmbeddingBag(20, 4, mode="mean")
            self.b = nn.EmbeddingBag(20, 4, mode="sum")
            self.c = nn.Embedding(20, 4)

        def forward(self, ids):
            one = ids[:, 0]
            return torch.cat([self.a(ids), F.embedding(one, self.a.weight), self.b(ids), self.c(one)], 1)

    inputs = (torch.tensor([[1, 2], [3, 4]]),)
    groups, ctx, _ = grouped(Mixed(), inputs)
    pooling = {(r.table, r.form): r.pooling for g in ctx.groups for r in g.lookups}
    # 'c' has only a one-id lookup, and a sum group exists: it stays sum
    assert pooling == {("a", "bag"): "mean", ("a", "single"): "mean", ("b", "bag"): "sum", ("c", "single"): "sum"}
    assert len(ctx.groups) == 2
    transformed_all_lowered(Mixed(), inputs, (torch.tensor([[7, 8], [9, 1], [0, 0]]),), backend="auto", groups=2)


class QR(nn.Module):
    """Quotient-remainder embeddings: two small tables looked up with ``ids // 4`` and ``ids % 4``,
    their rows multiplied."""

    def __init__(self, rows=64, dim=8):
        super().__init__()
        self.q = nn.EmbeddingBag(rows // 4, dim, mode="sum")
        self.r = nn.EmbeddingBag(4, dim, mode="sum")
        self.other = nn.EmbeddingBag(30, dim, mode="sum")
        self.top = nn.Linear(2 * dim, 1)

    def forward(self, ids, offsets, other, other_off):
        e = self.q(ids // 4, offsets) * self.r(ids % 4, offsets)
        return self.top(torch.cat([e, self.other(other, other_off)], 1))


def qr_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 64, (9,), generator=g), torch.tensor([0, 2, 5, 5]), torch.randint(0, 30, (6,), generator=g),
            torch.tensor([0, 1, 3, 4]))


def test_quotient_remainder_lookups_share_one_group_and_match():
    groups, _, _ = grouped(QR(), qr_inputs())
    assert [sorted(g) for g in groups] == [["floor_divide", "other", "remainder"]]
    transformed_all_lowered(QR(), qr_inputs(), qr_inputs(1), backend="auto", groups=1)


class Chain(nn.Module):
    """Lookup b (key: sum) waits for lookup m (key: mean) only; nothing connects b with a."""

    def __init__(self):
        super().__init__()
        self.a = nn.EmbeddingBag(10, 4, mode="sum")
        self.m = nn.EmbeddingBag(10, 4, mode="mean")
        self.b = nn.EmbeddingBag(10, 4, mode="sum")

    def forward(self, ids, offsets):
        x = self.m(ids, offsets)
        ids2 = (x.sum(1).abs() * 3).long().clamp(0, 9)
        return torch.cat([self.a(ids, offsets), x, self.b(ids2, torch.arange(ids2.numel()))], 1)


def test_a_lookup_late_because_of_another_key_still_joins_its_keys_group():
    inputs = (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 3]))
    groups, ctx, gm = grouped(Chain(), inputs)
    assert sorted(sorted(r.table for r in g.lookups) for g in ctx.groups) == [["a", "b"], ["m"]]
    assert gm.meta[meta.FRAGMENTATION].splits == ()
    assert_groups_have_a_place(gm, ctx)
    transformed_all_lowered(Chain(), inputs, (torch.tensor([5, 6, 7, 8, 9]), torch.tensor([0, 2, 2, 4])), groups=2)


def test_dependent_lookups_of_one_key_make_two_groups_and_the_report_says_why():
    inputs = (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 3]))
    groups, ctx, gm = grouped(Dependent(), inputs)
    assert [[r.table for r in g.lookups] for g in ctx.groups] == [["first", "third"], ["second"]]
    frag = gm.meta[meta.FRAGMENTATION]
    assert (frag.groups, frag.fewest) == (2, 1)
    (split,) = frag.splits
    assert split.startswith("group_1 apart from group_0: depends on the output of group_0 (feature ")
    assert "reads 'ids'" in split
    fast = fxrec.transform(Dependent(), inputs, backend="fbgemm")
    assert fast.report.fragmentation == frag
    text = str(fast.report)
    assert "Fragmentation: 2 group(s) made, 1 the fewest possible (one per kind: sum)" in text
    assert split in text
    assert json.loads(fast.report.to_json())["fragmentation"]["splits"] == [split]


def test_a_table_whose_ids_come_from_its_own_lookup_stays_plain_with_the_reason():
    class SelfDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.t = nn.EmbeddingBag(10, 4, mode="sum")
            self.u = nn.EmbeddingBag(10, 4, mode="sum")

        def forward(self, ids, offsets):
            a = self.t(ids, offsets)
            again = (a.sum(1).abs() * 3).long().clamp(0, 9)
            return torch.cat([a, self.t(again, torch.arange(again.numel())), self.u(ids, offsets)], 1)

    inputs = (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 3]))
    groups, ctx, gm = grouped(SelfDependent(), inputs)
    assert [[r.table for r in g.lookups] for g in ctx.groups] == [["t", "u"]]
    (plain,) = [n.meta[meta.LOOKUP] for n in gm.graph.nodes if meta.LOOKUP in n.meta and n.meta[meta.LOOKUP].reason]
    assert plain.table == "t"
    assert plain.reason.startswith("table 't' is batched in group_0 (feature 'ids'), and this lookup cannot run in "
                                   "that call: its ids are computed from the output of that table's lookup 'ids'")
    model = SelfDependent()
    fast = fxrec.transform(model, inputs, backend="fbgemm", check_passes=True)
    assert [e.table for e in fast.report.left_alone] == ["t"]
    assert_matches(model, fast, inputs, (torch.tensor([5, 6, 7, 8, 9]), torch.tensor([0, 2, 2, 4])))


def test_bag_pooled_and_unpooled_lookups_of_one_table_leave_one_plain_naming_the_cause():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.t = nn.Embedding(10, 4)

        def forward(self, seq, one, ids, offsets):
            bag = torch.nn.functional.embedding_bag(ids, self.t.weight, offsets, mode="sum")
            return torch.cat([self.t(seq).flatten(1), self.t(one), bag], 1)

    inputs = (torch.randint(0, 10, (3, 2)), torch.randint(0, 10, (3,)), torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]))
    groups, ctx, gm = grouped(Mixed(), inputs)
    assert [[(r.form, r.pooling) for r in g.lookups] for g in ctx.groups] == [[("seq", "none"), ("seq", "none")]]
    (plain,) = [n.meta[meta.LOOKUP] for n in gm.graph.nodes if meta.LOOKUP in n.meta and n.meta[meta.LOOKUP].reason]
    assert plain.reason == ("table 't' is batched in group_0 with its lookups unpooled (feature 'seq'); this one is "
                            "pooled by sum, and a table is stored in one group")


class PooledAndUnpooled(nn.Module):
    """One table looked up unpooled (attention over a history) and over [B, L] ids pooled by the
    model's own sum and mean."""

    def __init__(self):
        super().__init__()
        self.t = nn.Embedding(300, 8)
        self.other = nn.Embedding(50, 8)

    def forward(self, hist, clicks, cand):
        seq = self.t(hist)  # [B, L, 8]
        return torch.cat([(seq * self.t(cand).unsqueeze(1)).sum(1), self.t(clicks).sum(1), self.t(clicks).mean(1),
                          self.other(clicks).sum(1)], 1)


def pooled_and_unpooled_inputs(seed=0, batch=4):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 300, (batch, 5), generator=g), torch.randint(0, 50, (batch, 3), generator=g),
            torch.randint(0, 300, (batch,), generator=g))


def test_ids_pooled_by_the_models_sum_or_mean_join_the_unpooled_lookups_of_their_table():
    """(One of the two kinds was left as written: its table's fp32 rows kept for it, also when the
    table was quantized; a fuzz of the serving forms found it.)"""
    _, ctx, gm = grouped(PooledAndUnpooled(), pooled_and_unpooled_inputs())
    forms = sorted((r.table, r.form, r.pooling) for g in ctx.groups for r in g.lookups)
    assert forms == [("other", "pooled_seq", "sum"), ("t", "seq", "none"), ("t", "seq", "none"),
                     ("t", "seq", "none"), ("t", "seq", "none")], forms
    assert not [n for n in gm.graph.nodes if meta.LOOKUP in n.meta and n.meta[meta.LOOKUP].reason]
    pooled = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in
              (torch.ops.aten.sum.dim_IntList, torch.ops.aten.mean.dim)]
    # the model's own sum and mean of t's rows stay in the graph (three: the attention's, clicks' two);
    # other's sum is its lookup's pooling
    assert len([n for n in pooled if meta.LOOKUP not in n.args[0].meta or
                n.args[0].meta[meta.LOOKUP].table == "t"]) == 3, [n.format_node() for n in pooled]


@pytest.mark.parametrize("optimizer", [None, "sgd"])
def test_pooled_and_unpooled_lookups_of_one_table_lower_into_one_group_bit_for_bit(optimizer):
    model = PooledAndUnpooled()
    ref = __import__("copy").deepcopy(model)
    fast = fxrec.transform(model, pooled_and_unpooled_inputs(),
                           optimizer=fxrec.optim.SGD(lr=0.5) if optimizer else None)
    assert not fast.report.left_alone and not embedding_ops(fast)
    for seed in (1, 2):
        x = pooled_and_unpooled_inputs(seed, batch=3)
        want, got = ref(*x), fast(*x)
        exact = not optimizer or seed == 1  # (fused SGD adds a row's gradients in its own order)
        torch.testing.assert_close(got, want, rtol=0 if exact else 1e-6, atol=0 if exact else 1e-6)
        want.square().sum().backward()
        got.square().sum().backward()
        if optimizer:  # (fused: fast's tables stepped in backward; the plain model's by SGD)
            with torch.no_grad():
                for p in ref.parameters():
                    p -= 0.5 * p.grad
                    p.grad = None
        else:
            for (n, a), (_, b) in zip(fast.named_parameters(), ref.named_parameters()):
                torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=n)
    if optimizer:
        torch.testing.assert_close(fast.get_parameter("t.weight"), ref.t.weight, rtol=1e-6, atol=1e-7)


class SumAndMean(nn.Module):
    """One table's [B, L] ids summed in one place and averaged in another (no unpooled lookup),
    a second table summed only."""

    def __init__(self):
        super().__init__()
        self.t, self.u = nn.Embedding(300, 8), nn.Embedding(40, 8)

    def forward(self, a, b):
        return torch.cat([self.t(a).sum(1), self.t(b).mean(1), self.u(b).sum(1)], 1)


def test_ids_pooled_by_sum_and_by_mean_of_one_table_are_looked_up_unpooled_and_match_bit_for_bit():
    """(One of the two was left as written: a review's fuzz of the change above found it.)"""
    g = torch.Generator().manual_seed(0)
    x = (torch.randint(0, 40, (4, 3), generator=g), torch.randint(0, 40, (4, 5), generator=g))
    _, ctx, _ = grouped(SumAndMean(), x)
    forms = sorted((r.table, r.form, r.pooling) for gr in ctx.groups for r in gr.lookups)
    assert forms == [("t", "seq", "none"), ("t", "seq", "none"), ("u", "pooled_seq", "sum")], forms
    model = SumAndMean()
    fast = fxrec.transform(model, x)
    assert not fast.report.left_alone
    y = (torch.randint(0, 40, (2, 4), generator=g), torch.randint(0, 40, (2, 2), generator=g))
    want, got = model(*y), fast(*y)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    want.square().sum().backward()
    got.square().sum().backward()
    for (n, a), (_, b) in zip(fast.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=n)
    served = fxrec.transform(model.eval(), x, mode="inference", quantize="int8")
    assert not served.report.left_alone and not [k for k in served.state_dict() if k.startswith("t.")]


class WeightedAndNot(nn.Module):
    """One table looked up by a weighted and an unweighted sum bag, another unweighted."""

    def __init__(self):
        super().__init__()
        self.b, self.c = nn.EmbeddingBag(300, 16, mode="sum"), nn.EmbeddingBag(50, 16, mode="sum")

    def forward(self, a, ao, b, bo, w):
        return torch.cat([self.b(a, ao), self.b(b, bo, per_sample_weights=w), self.c(a % 50, ao)], 1)


def weighted_and_not_inputs(seed, n=4):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randint(0, 300, (3 * n,), generator=g), torch.randint(0, 300, (2 * n,), generator=g)
    return a, torch.arange(0, 3 * n, 3), b, torch.arange(0, 2 * n, 2), torch.rand(2 * n, generator=g)


@pytest.mark.parametrize("backend", ["reference", "auto", "fbgemm"])
def test_an_unweighted_bag_of_a_table_also_looked_up_weighted_joins_it_with_weights_of_one(backend):
    """(One of the two was left as written: its fp32 rows stayed in a quantized model, and the
    table could only be data-parallel in a plan.) Weights of 1 multiply exactly: the forward is the
    plain model's bit for bit; the table's gradient is too on PyTorch's lookups, and within rounding
    on the kernels that add both lookups' rows in one pass (as for any table two features read)."""
    _, ctx, gm = grouped(WeightedAndNot(), weighted_and_not_inputs(0))
    keys = sorted((r.table, r.weighted) for gr in ctx.groups for r in gr.lookups)
    assert keys == [("b", True), ("b", True), ("c", False)], keys
    ones = [n for n in gm.graph.nodes if n.target is torch.ops.aten.ones_like.default]
    assert len(ones) == 1 and ones[0].kwargs["dtype"] == torch.float32
    run = next(r for r in ctx.report.pass_runs if r.name == "group_lookups")
    assert run.modified and "ones_like" in gm.code  # (recompiled: the pass said it changed nothing)
    model = WeightedAndNot()
    ref = __import__("copy").deepcopy(model)
    fast = fxrec.transform(model, weighted_and_not_inputs(0), backend=backend)
    assert not fast.report.left_alone and not embedding_ops(fast)
    exact = backend == "reference"
    for seed in (1, 2):
        x = weighted_and_not_inputs(seed, 5)
        want, got = ref(*x), fast(*x)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        want.square().sum().backward()
        got.square().sum().backward()
        for (n, a), (_, b) in zip(fast.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=0 if exact else 1e-6, atol=0 if exact else 1e-6, msg=n)


def test_an_unweighted_bag_written_after_the_weighted_ones_users_joins_them_in_order():
    """(Its weights of one were first made beside the bag only, where the group's call, placed at
    the weighted bag, came before them: lower_groups failed on a random model.)"""
    class Late(nn.Module):
        def __init__(self):
            super().__init__()
            self.t = nn.EmbeddingBag(20, 1, mode="sum")
            self.dense = nn.Linear(3, 1)

        def forward(self, dense, a, ao, b, bo, w):
            gate = torch.sigmoid(self.t(b, bo, per_sample_weights=w).sum(1, keepdim=True))
            return torch.cat([self.dense(dense) * gate, self.t(a % 2, ao)], 1)

    def inputs(seed, n=3):
        g = torch.Generator().manual_seed(seed)
        return (torch.rand(n, 3, generator=g), torch.randint(0, 20, (2 * n,), generator=g), torch.arange(0, 2 * n, 2),
                torch.randint(0, 20, (n,), generator=g), torch.arange(n), torch.rand(n, generator=g))

    model = Late()
    fast = transformed_all_lowered(model, inputs(0), inputs(1), inputs(2, 5), backend="reference", groups=1)
    assert [n.target for n in fast.graph.nodes].count(torch.ops.aten.ones_like.default) == 1


def test_an_unweighted_bag_left_as_written_keeps_no_weights_of_one():
    """A table read mostly unpooled: both its bags are left as written, the unweighted one as the
    model wrote it (it kept the weights of one made for joining, and the report called it
    weighted; from a final review)."""
    class Mostly(nn.Module):
        def __init__(self):
            super().__init__()
            self.t = nn.EmbeddingBag(50, 4, mode="sum")

        def forward(self, h1, h2, h3, a, ao, b, bo, w):
            seq = (F.embedding(h1, self.t.weight) + F.embedding(h2, self.t.weight) + F.embedding(h3, self.t.weight))
            return torch.cat([seq.sum(1), self.t(a, ao), self.t(b, bo, per_sample_weights=w)], 1)

    def inputs(seed, n=3):
        g = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.randint(0, 50, s, generator=g)  # noqa: E731
        return (r(n, 2), r(n, 2), r(n, 2), r(2 * n), torch.arange(0, 2 * n, 2), r(2 * n), torch.arange(0, 2 * n, 2),
                torch.rand(2 * n, generator=g))

    model = Mostly()
    fast = fxrec.transform(model, inputs(0))
    assert not [n for n in fast.graph.nodes if n.target is torch.ops.aten.ones_like.default]
    reasons = {e.feature: e.reason for e in fast.report.left_alone}
    assert set(reasons) == {"a", "b"} and "weighted" not in reasons["a"].split("this one is")[1], reasons
    torch.testing.assert_close(fast(*inputs(1)), model(*inputs(1)), rtol=0, atol=0)


def test_a_quantized_table_looked_up_weighted_and_not_keeps_no_fp32_rows_and_scripts():
    model = WeightedAndNot().eval()
    fast = fxrec.transform(model, weighted_and_not_inputs(0), mode="inference", quantize="int8")
    assert not fast.report.left_alone and not [k for k in fast.state_dict() if k.startswith("b.")]
    x = weighted_and_not_inputs(3, 6)
    with torch.no_grad():
        torch.testing.assert_close(fast(*x), model(*x), rtol=0.05, atol=0.05)
        torch.testing.assert_close(fxrec.export.torchscript(fast)(*x), fast(*x), rtol=0, atol=0)


def test_a_quantized_table_looked_up_pooled_and_unpooled_keeps_no_fp32_rows():
    model = PooledAndUnpooled().eval()
    fast = fxrec.transform(model, pooled_and_unpooled_inputs(), mode="inference", quantize="int8")
    assert not fast.report.left_alone and not [k for k in fast.state_dict() if k.startswith("t.")]
    x = pooled_and_unpooled_inputs(3)
    with torch.no_grad():
        torch.testing.assert_close(fast(*x), model(*x), rtol=0.05, atol=0.05)


def test_other_keys_are_split_with_the_reason():
    _, _, gm = grouped(M.WeightedBags(), M.weighted_inputs())
    frag = gm.meta[meta.FRAGMENTATION]
    assert (frag.groups, frag.fewest, frag.kinds) == (2, 2, ("sum", "mean"))  # one per pooling kind
    assert frag.splits == ()

    class Kinds(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.EmbeddingBag(10, 4, mode="sum")
            self.w = nn.EmbeddingBag(10, 4, mode="sum")
            self.s = nn.EmbeddingBag(10, 4, mode="sum", sparse=True)

        def forward(self, ids, offsets, psw):
            return torch.cat([self.a(ids, offsets), self.w(ids, offsets, per_sample_weights=psw), self.s(ids, offsets)], 1)

    _, _, gm = grouped(Kinds(), (torch.tensor([1, 2, 3]), torch.tensor([0, 1]), torch.rand(3)))
    assert gm.meta[meta.FRAGMENTATION].splits == ("group_1 apart from group_0: weighted vs unweighted",
                                                  "group_2 apart from group_0: sparse gradients differ")


def test_a_group_apart_for_its_optimizer_says_so():
    from fxrec.passes.assign_optimizers import assign_optimizers

    optimizer = {"bags.0": fxrec.optim.SGD(lr=0.1), "bags.*": fxrec.optim.Adagrad(lr=0.1)}
    ctx = PassContext(config=Config(optimizer=optimizer), report=Report(), logger=logging.getLogger("fxrec.test"))
    gm = PassManager([annotate_lookups, merge_lookups, assign_optimizers, group_lookups]).run(
        captured(M.BagList(), M.bag_inputs()), ctx)
    assert [[r.table for r in g.lookups] for g in ctx.groups] == [["bags.0"], ["bags.1", "bags.2"]]
    (split,) = gm.meta[meta.FRAGMENTATION].splits
    assert split.startswith("group_1 apart from group_0: optimizer differs (optimizer Adagrad(lr=0.1")
    assert "vs optimizer SGD(lr=0.1" in split


class TiedOutput(nn.Module):
    """Three tables; the middle one is also the output layer (SASRec's tied item table)."""

    def __init__(self):
        super().__init__()
        self.a, self.item, self.c = (nn.EmbeddingBag(50, 8, mode="sum") for _ in range(3))

    def forward(self, ids, offsets):
        x = self.a(ids, offsets) + self.item(ids, offsets) + self.c(ids, offsets)
        return x @ self.item.weight.t()


@pytest.mark.parametrize("optimizer", [None, "sgd"])
def test_a_table_used_outside_its_lookups_takes_a_group_of_its_own_only_with_an_optimizer(optimizer):
    """Its fused update would miss that gradient, so its group steps with torch.optim: in one group
    with it, the other tables lost their fused update too. Without an optimizer nothing is fused,
    and the tables stay in one group."""
    from fxrec.passes.assign_optimizers import assign_optimizers

    opt = fxrec.optim.SGD(lr=0.1) if optimizer else None
    ctx = PassContext(config=Config(optimizer=opt), report=Report(), logger=logging.getLogger("fxrec.test"))
    x = (torch.randint(0, 50, (6,)), torch.tensor([0, 2, 4]))
    gm = PassManager([annotate_lookups, merge_lookups, assign_optimizers, group_lookups]).run(captured(TiedOutput(), x), ctx)
    got = [[r.table for r in g.lookups] for g in ctx.groups]
    if optimizer is None:
        assert got == [["a", "item", "c"]] and not gm.meta[meta.FRAGMENTATION].splits
        return
    assert sorted(got) == [["a", "c"], ["item"]]
    (split,) = gm.meta[meta.FRAGMENTATION].splits
    assert "table 'item' is also used outside its lookups" in split and "keeps the other tables' update fused" in split


class InPlace(nn.Module):
    """An input written in place between lookups: the read before the write stays before it, the
    ids computed after it stay after it."""

    def __init__(self):
        super().__init__()
        self.item = nn.Embedding(100, 4)
        self.other = nn.Embedding(100, 4)

    def forward(self, hist, counts):
        h = self.item(hist).sum(1)
        y = h * counts.float().sum()  # reads counts before the write
        counts.add_(1)
        t = self.other((counts * 7) % 100)  # ids from counts after the write
        return y + t


def _order_around_writes(gm):
    """For each in-place write to an input: which readers of that input (or of the write's result)
    come before the write."""
    nodes = list(gm.graph.nodes)
    out = {}
    for w in nodes:
        if w.target is torch.ops.aten.add_.Tensor:
            readers = {u for x in (w.args[0], w) for u in x.users if u is not w and u.op != "output"}
            out[w.name] = {u.name: nodes.index(u) < nodes.index(w) for u in readers}
    return out


def test_reordering_keeps_an_in_place_write_to_an_input_in_its_place():
    inputs = (torch.randint(0, 100, (3, 4)), torch.tensor([3, 5, 7]))
    gm = captured(InPlace(), inputs)
    before = _order_around_writes(gm)
    assert sorted(before["add_"].values()) == [False, True, True, True]  # the check, an assert, the read; after: * 7
    gm, ctx = run_passes(gm, [annotate_lookups, merge_lookups, group_lookups], inputs)
    # hist may be counts at call time (the same tensor passed twice): its lookup stays before the
    # write and the other table's (ids computed after it) after, so they cannot share one call
    assert [[r.table for r in g.lookups] for g in ctx.groups] == [["item"], ["other"]]
    assert_inputs_before_users(gm)
    assert_groups_have_a_place(gm, ctx)
    assert _order_around_writes(gm) == before

    model = InPlace()
    fast = fxrec.transform(model, inputs, backend="fbgemm", check_passes=True)
    assert not fast.report.left_alone
    for x in (inputs, (torch.randint(0, 100, (2, 4)), torch.tensor([1, 2]))):
        a, b = [t.clone() for t in x], [t.clone() for t in x]
        torch.testing.assert_close(fast(*b), model(*a))
        assert torch.equal(a[1], b[1])  # the input was written the same way
    assert_matches(model, fast, inputs)


def test_side_effect_order_alone_keeps_two_lookups_of_one_key_apart():
    class Ordered(nn.Module):
        def __init__(self):
            super().__init__()
            self.item = nn.Embedding(100, 4)
            self.other = nn.Embedding(100, 4)

        def forward(self, hist, counts):
            h = self.item(hist).sum(1)
            s = (h.sum(1) + counts.float()).sum()  # reads counts before the write, and needs h
            counts.add_(1)
            return h * s + self.other((counts * 7) % 100)

    inputs = (torch.randint(0, 100, (3, 4)), torch.tensor([3, 5, 7]))
    before = _order_around_writes(captured(Ordered(), inputs))
    groups, ctx, gm = grouped(Ordered(), inputs)
    assert _order_around_writes(gm) == before
    assert len(ctx.groups) == 2  # one group would need the read that needs h after the write
    (split,) = gm.meta[meta.FRAGMENTATION].splits
    assert "in-place writes or random numbers order them" in split
    model = Ordered()
    fast = fxrec.transform(model, inputs, backend="fbgemm", check_passes=True)
    a, b = [t.clone() for t in inputs], [t.clone() for t in inputs]
    torch.testing.assert_close(fast(*b), model(*a))
    assert torch.equal(a[1], b[1])


def test_grouping_a_large_graph_is_fast():
    class Wide(nn.Module):
        def __init__(self, n=200):
            super().__init__()
            self.tables = nn.ModuleList(nn.Embedding(20, 4) for _ in range(n))
            self.mlps = nn.ModuleList(nn.Linear(4, 4) for _ in range(n))

        def forward(self, ids):
            outs = []
            for k, (t, m) in enumerate(zip(self.tables, self.mlps)):
                i = (ids[:, k % ids.shape[1]] + k) % 20
                if k % 50 == 49:  # now and then, ids computed from the lookup before
                    i = (outs[-1].sum(1).abs() * 3).long() % 20
                outs.append(torch.relu(m(t(i))))
            return torch.stack(outs, 1).sum(1)

    inputs = (torch.randint(0, 20, (3, 7)),)
    gm = captured(Wide(), inputs)
    assert len(gm.graph.nodes) > 2000
    gm, ctx = run_passes(gm, [annotate_lookups, merge_lookups, group_lookups], inputs)
    assert len(ctx.groups) == 2  # the lookups of ids from another lookup, and all the others
    assert_groups_have_a_place(gm, ctx)
    seconds = {p.name: p.seconds for p in ctx.report.pass_runs}
    assert seconds["group_lookups"] < 5 and seconds["merge_lookups"] < 5, seconds


class TwoBatches(torch.nn.Module):
    """A user's history bags and the candidates' bags: pooled lookups over two batch sizes, which
    the model's code never ties (it sums each over its batch), so a group of them could not
    return one [B, sum of dims] tensor. The transformed model used to fail on its own example."""

    def __init__(self):
        super().__init__()
        self.user = torch.nn.EmbeddingBag(20, 4)
        self.item = torch.nn.EmbeddingBag(30, 4)
        self.other = torch.nn.EmbeddingBag(25, 4)

    def forward(self, hist, hist_offsets, cand, cand_offsets):
        return (self.user(hist, hist_offsets).sum(0) + self.item(cand, cand_offsets).sum(0)
                + self.other(cand % 25, cand_offsets).mean(0))


def two_batches(seed, users=5, items=3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 20, (2 * users,), generator=g), torch.arange(0, 2 * users, 2),
            torch.randint(0, 30, (3 * items,), generator=g), torch.arange(0, 3 * items, 3))


def test_pooled_lookups_of_different_batch_sizes_are_grouped_apart_and_the_report_says_why():
    groups, ctx, gm = groups_of(TwoBatches(), two_batches(0))
    assert sorted(groups) == [["item", "other"], ["user"]]
    frag = gm.meta[meta.FRAGMENTATION]
    assert (frag.groups, frag.fewest) == (2, 2)
    # the sizes are symbolic in the capture: each is named by the first feature read over it
    assert sorted(frag.kinds) == ["mean over the batch of feature 'cand'", "mean over the batch of feature 'hist'"], \
        frag.kinds
    for backend in ("fbgemm", "native", "reference"):
        model = TwoBatches()
        fast = fxrec.transform(model, two_batches(0), backend=backend)
        for seed, users, items in ((1, 5, 3), (2, 1, 4), (3, 6, 6)):  # equal sizes too: still apart, still right
            x = two_batches(seed, users, items)
            torch.testing.assert_close(fast(*x), model(*x), msg=backend)


def test_pooled_lookups_the_model_concatenates_share_one_batch_size_and_one_group():
    """The common case the batch size in the key must not split: outputs concatenated along dim 1
    (export ties their batch sizes into one symbol), even where the example's ids counts differ."""
    groups, ctx, _ = groups_of(M.BagList(), M.bag_inputs())
    assert groups == [["bags.0", "bags.1", "bags.2"]]
    assert len({g.key[-1] for g in ctx.groups}) == 1 and ctx.groups[0].key[-1] not in ("", None)


class AutocastBetween(nn.Module):
    """A torch.autocast block between two lookups that writes nothing it is given (an assert of a
    dtype, a ReLU in place on its own result, dropout inside): the lookups still form one group."""

    def __init__(self):
        super().__init__()
        self.a = nn.EmbeddingBag(50, 8, mode="sum")
        self.b = nn.EmbeddingBag(50, 8, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Dropout(0.0))

    def forward(self, dense, ids_a, off_a, ids_b, off_b):
        x = self.a(ids_a, off_a)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            d = self.mlp(dense).float()
        return torch.cat([x, self.b(ids_b, off_b), d], 1)


def test_a_block_that_writes_nothing_it_is_given_leaves_the_lookups_around_it_one_group():
    """(Any effect inside the block made it write everything it was given, every model input with
    it: the lookups around it split in two groups.)"""
    g = torch.Generator().manual_seed(0)
    inputs = (torch.rand(4, 4, generator=g), torch.randint(0, 50, (9,), generator=g), torch.tensor([0, 2, 5, 7]),
              torch.randint(0, 50, (6,), generator=g), torch.tensor([0, 1, 3, 4]))
    gm, ctx = run_passes(captured(AutocastBetween(), inputs), [annotate_lookups, merge_lookups, group_lookups], inputs)
    assert [[r.table for r in gr.lookups] for gr in ctx.groups] == [["a", "b"]]
    assert_inputs_before_users(gm)


class WeightedAndPlain(torch.nn.Module):
    """One table read by a weighted 1-D bag and an unweighted [B, L] bag whose batch sizes nothing ties."""

    def __init__(self):
        super().__init__()
        self.t = torch.nn.EmbeddingBag(50, 8, mode="sum")

    def forward(self, ids, offsets, weights, rows):
        return self.t(ids, offsets, per_sample_weights=weights).sum() + self.t(rows).sum()


def test_a_lookup_left_alone_for_another_batch_size_names_the_features_not_symbolic_sizes():
    """The reason named the sizes the capture left symbolic: "over a batch of s13" vs "over a batch of
    ((s17*s78 + s78 - 1)//s78)", which no user can read."""
    import re
    x = (torch.randint(0, 50, (12,)), torch.tensor([0, 3, 6, 9]), torch.rand(12), torch.randint(0, 50, (4, 3)))
    _, _, gm = groups_of(WeightedAndPlain(), x)
    (plain,) = [n.meta[meta.LOOKUP] for n in gm.graph.nodes if meta.LOOKUP in n.meta and n.meta[meta.LOOKUP].reason]
    assert plain.feature == "rows", plain
    reason = plain.reason
    assert "over the batch of feature 'ids'" in reason and "over the batch of feature 'rows'" in reason, reason
    assert not re.search(r"\bs\d+\b", reason), reason
