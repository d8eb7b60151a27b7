import torch

from fxrec import meta
from fxrec.passes.annotate_lookups import annotate_lookups
from fxrec.testing import captured, run_passes
from tests import models as M


def records(model, inputs):
    gm, _ = run_passes(captured(model, inputs), [annotate_lookups], inputs)
    return [n.meta[meta.LOOKUP] for n in gm.graph.nodes if meta.LOOKUP in n.meta], gm


def test_finds_bags_with_their_offsets():
    recs, gm = records(M.BagList(), M.bag_inputs())
    assert [(r.table, r.form, r.pooling, r.feature) for r in recs] == [
        ("bags.0", "bag", "sum", "ids_0"), ("bags.1", "bag", "sum", "ids_1"), ("bags.2", "bag", "sum", "ids_2")]
    assert [r.offsets.name for r in recs] == ["offsets_0", "offsets_1", "offsets_2"]
    assert all(r.lowerable and r.num_rows == n and r.dim == 8 for r, n in zip(recs, (50, 80, 30)))


def test_annotating_does_not_change_the_graph():
    gm0 = captured(M.BagList(), M.bag_inputs())
    before = gm0.code
    gm, _ = run_passes(gm0, [annotate_lookups], M.bag_inputs())
    assert gm.code == before


def test_field_columns_become_single_id_lookups_named_after_the_column():
    recs, _ = records(M.FieldDict(), M.field_inputs())
    assert [(r.table, r.form, r.feature) for r in recs] == [
        ("emb.user", "single", "x[:, 2:][:, 0]"), ("emb.item", "single", "x[:, 2:][:, 1]"),
        ("emb.city", "single", "x[:, 2:][:, 2]")]


def test_embedding_then_sum_or_mean_is_a_pooled_lookup_and_plain_sequence_stays_unpooled():
    recs, _ = records(M.SequenceMean(), M.seq_inputs())
    by = {r.table: r for r in recs}
    assert (by["hist"].form, by["hist"].pooling, by["hist"].padding_idx) == ("pooled_seq", "mean", 0)
    assert by["hist"].output.target is torch.ops.aten.mean.dim
    assert (by["query"].form, by["query"].pooling) == ("pooled_seq", "sum")
    assert (by["attn"].form, by["attn"].pooling) == ("seq", "none")


def test_does_not_pool_an_embedding_whose_output_has_other_users():
    recs, _ = records(M.OffsetFM(), M.fm_inputs())
    by = {r.table: r for r in recs}
    # e is used by sum(1) and by e * e: the [B, F, D] tensor is needed, so it stays a sequence lookup
    assert by["embedding"].form == "seq"
    assert by["linear"].form == "pooled_seq"


def test_weighted_include_last_offset_and_2d_bags():
    recs, _ = records(M.WeightedBags(), M.weighted_inputs())
    by = {r.table: r for r in recs}
    assert by["w1"].weighted and not by["w1"].include_last_offset
    assert by["w2"].weighted and by["w2"].include_last_offset
    assert by["b2d"].form == "bag" and by["b2d"].pooling == "mean" and by["b2d"].padding_idx == 3


def test_records_why_lookups_cannot_be_lowered():
    recs, _ = records(M.NotLowerable(), M.not_lowerable_inputs())
    reasons = {r.table: r.reason for r in recs}
    assert "mode='max'" in reasons["maxbag"]
    assert "max_norm" in reasons["renorm"]
    assert "scale_grad_by_freq" in reasons["freq"]
    assert reasons["odd"] == ""  # dim 6: lowered (a kernel that needs a multiple of 4 pads it)
    assert reasons["ok"] == ""


class BufferTable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("frozen", torch.randn(10, 4))
        self.h16 = torch.nn.Embedding(10, 4).half()
        self.b16 = torch.nn.Embedding(10, 4).bfloat16()
        self.f64 = torch.nn.Embedding(10, 4).double()

    def forward(self, ids):
        return (torch.nn.functional.embedding(ids, self.frozen) + self.h16(ids).float() + self.b16(ids).float()
                + self.f64(ids).float())


def test_buffers_and_tables_neither_fp32_nor_fp16_are_not_lowered():
    recs, _ = records(BufferTable(), (torch.tensor([1, 2]),))
    reasons = {r.table: r.reason for r in recs}
    assert "not a parameter" in reasons["frozen"]
    assert reasons["h16"] == ""  # fp16 tables are lowered (tests/test_half_tables.py)
    assert reasons["b16"] == "dtype torch.bfloat16: fxrec lowers float32 and float16 tables"
    assert reasons["f64"] == "dtype torch.float64: fxrec lowers float32 and float16 tables"


class _ReadsRows(torch.nn.Module):
    """A table's rows read by indexing, and indexing that is no lookup."""

    def __init__(self):
        super().__init__()
        self.item = torch.nn.Embedding(30, 8)
        self.pos = torch.nn.Parameter(torch.randn(10, 8))
        self.register_buffer("buf", torch.randn(10, 8))

    def forward(self, ids, seq, mask):
        neg = self.item.weight[ids]                              # [B, 8]: one row each
        hist = self.item.weight[seq].sum(1)                      # [B, L, 8] pooled by hand
        pos = torch.index_select(self.pos, 0, ids % 10)          # a parameter no embedding module holds: no table
        other = (self.pos * 2)[ids % 10] + self.buf[ids % 10]    # computed / a buffer: no table
        picked = self.item.weight[:, :4][ids]                    # (a slice: computed)
        masked = self.item.weight[mask].sum() + self.item.weight[:, ids % 8].sum()  # a mask, columns
        return neg + hist + pos + other + picked.sum() + masked


def test_rows_of_a_parameter_read_by_indexing_are_lookups_and_other_indexing_is_not():
    x = (torch.randint(0, 30, (4,)), torch.randint(0, 30, (4, 3)), torch.rand(30) > 0.5)
    recs, _ = records(_ReadsRows(), x)
    got = sorted((r.table, r.form, r.pooling, r.lowerable, r.sparse) for r in recs)
    assert got == [("item", "pooled_seq", "sum", True, False), ("item", "single", "sum", True, False)]


class _IndexedParameters(torch.nn.Module):
    """A raw parameter read by F.embedding and by indexing (a table), and a classifier's weight
    read by indexing (center loss: not a table, which optimizer= would claim)."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(30, 8))
        self.out = torch.nn.Linear(8, 5)

    def forward(self, ids, labels):
        x = torch.nn.functional.embedding(ids, self.table) + self.table[ids]
        return self.out(x) + self.out.weight[labels].sum(1, keepdim=True)


def test_indexing_is_a_lookup_only_of_an_embedding_modules_weight_or_of_a_table_an_embedding_op_reads():
    recs, _ = records(_IndexedParameters(), (torch.randint(0, 30, (4,)), torch.randint(0, 5, (4,))))
    assert sorted((r.table, r.node.target.__name__) for r in recs) == [("table", "embedding.default"),
                                                                       ("table", "index.Tensor")]
