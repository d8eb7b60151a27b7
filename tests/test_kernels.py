"""Each kernel alone: what its supports() accepts and refuses, and its numbers against PyTorch's
own lookups written out in the test (not the reference kernel's code)."""

import pytest
import torch
import torch.nn.functional as F

import fxrec
from fxrec.runtime import kernels
from fxrec.runtime.group import EmbeddingGroup
from fxrec.runtime.kernels import native as native_mod
from fxrec.runtime.specs import FeatureSpec, FusedSpec, GroupSpec, TableSpec
from tests import models as M

POOLED = GroupSpec((TableSpec("a", 50, 8), TableSpec("b", 30, 4)),
                   (FeatureSpec("fa", 0, "bag"), FeatureSpec("fb", 1, "single")), "sum")
SEQ = GroupSpec((TableSpec("a", 50, 8),), (FeatureSpec("fa", 0, "seq"),), "none")
PADDED_SEQ = GroupSpec((TableSpec("a", 50, 8),), (FeatureSpec("fa", 0, "pooled_seq", padding_idx=0),), "sum")
QUANT = GroupSpec(POOLED.tables, POOLED.features, "sum", quantized=True)


def test_kernel_names_are_the_registry():
    assert kernels.KERNEL_NAMES == ("reference", "native", "fbgemm")
    for name in kernels.KERNEL_NAMES:
        assert kernels.get(name).name == name
    with pytest.raises(ValueError, match="kernel must be one of"):
        kernels.get("loop")


def test_reference_supports_everything_but_quantized_tables_and_adam():
    ref = kernels.get("reference")
    for device in ("cpu", "cuda"):
        for spec in (POOLED, SEQ, PADDED_SEQ):
            assert ref.supports(spec, device, "training", None) is None
            assert ref.supports(spec, device, "training", "sgd") is None
            assert ref.supports(spec, device, "training", "adagrad") is None  # states in fbgemm's TBE
            assert "not adam" in ref.supports(spec, device, "training", "adam")
    assert "quantized" in ref.supports(QUANT, "cpu", "inference", None)


def test_native_supports_pooled_float32_groups_on_cpu():
    nat = kernels.get("native")
    assert nat.supports(POOLED, "cpu", "training", "rowwise_adagrad") is None
    assert nat.supports(POOLED, "cpu", "inference", None) is None
    assert "CPU" in nat.supports(POOLED, "cuda", "training", None)
    assert "sequence" in nat.supports(SEQ, "cpu", "inference", None)
    half = GroupSpec((TableSpec("a", 50, 8, dtype="float16"),), (FeatureSpec("fa", 0, "bag"),), "sum")
    assert "float32" in nat.supports(half, "cpu", "inference", None)
    assert "quantized" in nat.supports(QUANT, "cpu", "inference", None)
    assert "no fused adam" in nat.supports(POOLED, "cpu", "training", "adam")


def test_fbgemm_supports_what_its_kernels_take():
    fb = kernels.get("fbgemm")
    assert fb.supports(POOLED, "cuda", "training", "adagrad") is None
    assert fb.supports(SEQ, "cpu", "training", "rowwise_adagrad") is None
    odd = GroupSpec((TableSpec("a", 50, 6),), (FeatureSpec("fa", 0, "bag"),), "sum")
    assert fb.supports(odd, "cuda", "inference", None) is None  # stored padded to 8 columns
    assert fb.supports(odd, "cuda", "training", "adagrad") is None  # a zero column stays zero
    assert "average the squared gradient" in fb.supports(odd, "cuda", "training", "rowwise_adagrad")
    # a sequence group stores its tables at the widest (8): row-wise Adagrad then averages over 8
    seq_mixed = GroupSpec((TableSpec("a", 50, 7), TableSpec("b", 50, 8)),
                          (FeatureSpec("fa", 0, "seq"), FeatureSpec("fb", 1, "seq")), "none")
    assert "['a']" in fb.supports(seq_mixed, "cpu", "training", "rowwise_adagrad")
    edge = GroupSpec((TableSpec("a", 50, 1023),), (FeatureSpec("fa", 0, "bag"),), "sum")
    assert "1024" not in (fb.supports(edge, "cuda", "inference", None) or "")  # 1024 once padded
    over = GroupSpec((TableSpec("a", 50, 1025),), (FeatureSpec("fa", 0, "bag"),), "sum")
    assert "up to 1024" in fb.supports(over, "cuda", "inference", None)
    wide = GroupSpec((TableSpec("a", 50, 4096),), (FeatureSpec("fa", 0, "bag"),), "sum")
    assert fb.supports(wide, "cpu", "inference", None) is None
    assert "up to 1024" in fb.supports(wide, "cuda", "inference", None)
    # quantized groups: fbgemm's inference kernels (no "TBE v2"), up to fbgemm's 2048
    quant_wide = GroupSpec((TableSpec("a", 50, 1536),), (FeatureSpec("fa", 0, "bag"),), "sum", quantized=True)
    assert fb.supports(quant_wide, "cuda", "inference", None) is None
    quant_over = GroupSpec((TableSpec("a", 50, 2052),), (FeatureSpec("fa", 0, "bag"),), "sum", quantized=True)
    assert "up to 2048" in fb.supports(quant_over, "cuda", "inference", None)
    assert "padding row" in fb.supports(PADDED_SEQ, "cuda", "training", "adagrad")
    assert fb.supports(PADDED_SEQ, "cuda", "training", None) is None  # gradients are PyTorch's there
    assert fb.supports(QUANT, "cuda", "inference", None) is None
    assert "inference" in fb.supports(QUANT, "cpu", "training", None)
    assert "tpu" in fb.supports(POOLED, "tpu", "inference", None)


def test_native_reports_why_it_is_not_available_only_for_cpu():
    nat = kernels.get("native")
    assert nat.available("cuda") is None  # not asked of this machine: explain decides for devices not here
    if native_mod.available():
        assert nat.available("cpu") is None


# ------------------------------------------------------------------------------------- numerics
TABLES = [TableSpec("a", 50, 8), TableSpec("b", 30, 4)]
FEATURES = [FeatureSpec("fa", 0, "bag", padding_idx=3), FeatureSpec("fa2", 0, "single"),
            FeatureSpec("fb", 1, "pooled_seq")]


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 50, (11,), generator=g), torch.randint(0, 50, (4,), generator=g),
           torch.randint(0, 30, (4, 3), generator=g)]
    offs = [torch.tensor([0, 3, 3, 8]), None, None]
    return ids, offs, [None, None, None]


def plain(params, ids, offs, pooling):
    """What the user's model computes, written out."""
    a = F.embedding_bag(ids[0], params[0], offs[0], mode=pooling, padding_idx=3)
    b = F.embedding(ids[1], params[0])
    c = F.embedding(ids[2], params[1])
    return torch.cat([a, b, c.sum(1) if pooling == "sum" else c.mean(1)], 1)


def kernel_names():
    return ["reference", "fbgemm"] + (["native"] if native_mod.available() else [])


@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("name", kernel_names())
def test_each_kernel_gives_pytorchs_outputs_and_gradients(name, pooling):
    group = EmbeddingGroup(TABLES, FEATURES, pooling, name, name)
    base = [torch.randn(t.num_rows, t.dim, generator=torch.Generator().manual_seed(7)) for t in TABLES]
    ids, offs, psw = inputs()
    kernel = kernels.get(name)
    with torch.no_grad():
        got = kernel.run(group, ids, offs, psw, [p.clone() for p in base], training=False)
    torch.testing.assert_close(got, plain(base, ids, offs, pooling), rtol=1e-6, atol=1e-6)
    mine = [p.clone().requires_grad_() for p in base]
    theirs = [p.clone().requires_grad_() for p in base]
    cot = torch.randn(4, 20, generator=torch.Generator().manual_seed(3))
    (kernel.run(group, ids, offs, psw, mine, training=True) * cot).sum().backward()
    (plain(theirs, ids, offs, pooling) * cot).sum().backward()
    for x, y in zip(mine, theirs):
        torch.testing.assert_close(x.grad.to_dense(), y.grad, rtol=1e-5, atol=1e-6)
    assert mine[0].grad[3].abs().max() == 0  # the bag's padding row gets no gradient


@pytest.mark.parametrize("name", kernel_names())
def test_each_kernel_applies_the_fused_sgd_as_torch_optim(name):
    group = EmbeddingGroup(TABLES, FEATURES, "sum", name, name, fused=FusedSpec("sgd", 0.5))
    base = [torch.randn(t.num_rows, t.dim, generator=torch.Generator().manual_seed(7)) for t in TABLES]
    ids, offs, psw = inputs(1)
    mine = [torch.nn.Parameter(p.clone()) for p in base]
    theirs = [torch.nn.Parameter(p.clone()) for p in base]
    group(ids, offs, psw, mine).sum().backward()
    assert all(p.grad is None for p in mine)  # updated in backward, no gradient made
    plain(theirs, ids, offs, "sum").sum().backward()
    torch.optim.SGD(theirs, lr=0.5).step()
    for x, y in zip(mine, theirs):
        torch.testing.assert_close(x.detach(), y.detach(), rtol=1e-5, atol=1e-6)


def test_kernels_hand_back_inputs_they_do_not_take():
    """Features with different batch sizes: fbgemm and native return None (one TBE call needs one
    batch size), and the group runs PyTorch's own lookups, which raise as the plain model does."""
    group = EmbeddingGroup(TABLES[:1], [FeatureSpec("fa", 0, "single"), FeatureSpec("fa2", 0, "single")], "sum",
                           "fbgemm", "fbgemm")
    params = [torch.randn(50, 8)]
    ids = [torch.tensor([1, 2]), torch.tensor([3])]
    for name in kernel_names()[1:]:
        with torch.no_grad():
            assert kernels.get(name).run(group, ids, [None, None], [None, None], params, training=False) is None
    with torch.no_grad(), pytest.raises(RuntimeError, match="(?i)size"):
        group(ids, [None, None], [None, None], params)


def test_fbgemm_kernel_hands_back_tables_it_cannot_hold():
    group = EmbeddingGroup(TABLES[:1], FEATURES[:1], "sum", "fbgemm", "fbgemm")
    ids, offs, psw = inputs()
    with torch.no_grad():
        assert kernels.get("fbgemm").run(group, ids[:1], offs[:1], psw[:1], [torch.randn(50, 8).double()],
                                         training=False) is None


ODD_TABLES = [TableSpec("a", 50, 5), TableSpec("b", 30, 3)]


def plain_odd(params, ids, offs):
    a = F.embedding_bag(ids[0], params[0], offs[0], mode="sum")
    b = F.embedding(ids[1], params[0])
    c = F.embedding(ids[2], params[1]).sum(1)
    return torch.cat([a, b, c], 1)


@pytest.mark.parametrize("kind", [None, "sgd", "adagrad"])
def test_fbgemm_stores_odd_dims_padded_and_users_see_only_the_real_columns(kind):
    """dims 5 and 3 are stored as 8 and 4 columns in the TBE: the parameters are views of the real
    columns, outputs and updates are PyTorch's, the padding columns stay zero, and the Adagrad
    state a user reads has the table's shape."""
    fused = FusedSpec(kind, 0.5) if kind else None
    feats = [FeatureSpec("fa", 0, "bag"), FeatureSpec("fa2", 0, "single"), FeatureSpec("fb", 1, "pooled_seq")]
    group = EmbeddingGroup(ODD_TABLES, feats, "sum", "fbgemm", "fbgemm", fused=fused)
    base = [torch.randn(t.num_rows, t.dim, generator=torch.Generator().manual_seed(7)) for t in ODD_TABLES]
    ids, offs, psw = inputs(2)
    mine = [torch.nn.Parameter(p.clone()) for p in base]
    theirs = [torch.nn.Parameter(p.clone()) for p in base]
    cot = torch.randn(4, 13, generator=torch.Generator().manual_seed(3))
    theirs_opt = torch.optim.Adagrad(theirs, lr=0.5, eps=1e-8) if kind == "adagrad" else torch.optim.SGD(theirs, lr=0.5)
    mine_opt = torch.optim.SGD(mine, lr=0.5) if kind is None else None  # fused: updated inside backward
    for _ in range(3):
        (group(ids, offs, psw, mine) * cot).sum().backward()
        (plain_odd(theirs, ids, offs) * cot).sum().backward()
        for opt in (mine_opt, theirs_opt):
            if opt is not None:
                opt.step()
                opt.zero_grad()
    for x, y, t in zip(mine, theirs, ODD_TABLES):
        assert x.shape == (t.num_rows, t.dim) and x.stride(0) == -(-t.dim // 4) * 4  # a view into the TBE
        torch.testing.assert_close(x.detach(), y.detach(), rtol=1e-5, atol=1e-6)
    stored = group._bound.tbe.split_embedding_weights()
    assert [tuple(w.shape) for w in stored] == [(50, 8), (30, 4)]
    assert stored[0][:, 5:].abs().max() == 0 and stored[1][:, 3:].abs().max() == 0
    if kind == "adagrad":
        states = [s["sum"] for s in group.optimizer_states(mine)]
        assert [tuple(s.shape) for s in states] == [(50, 5), (30, 3)]
        assert group._bound.tbe.split_optimizer_states()[0][0][:, 5:].abs().max() == 0


@pytest.mark.parametrize("kind", ["adagrad", "rowwise_adagrad"])
def test_reference_fuses_the_adagrads_exactly_where_fbgemm_would_not(kind):
    """A sequence group with a padding row and dims 7 and 5 (stored at 8): fbgemm's kernel would
    train the padding row and average row-wise over 8 columns; the reference kernel's update is
    torch.optim.Adagrad's (or the row-wise one over the real dim, written out here), and leaves
    the padding row alone."""
    tables = [TableSpec("a", 40, 7), TableSpec("b", 30, 5)]
    feats = [FeatureSpec("fa", 0, "seq", padding_idx=0), FeatureSpec("fb", 1, "seq")]
    spec = GroupSpec(tuple(tables), tuple(feats), "none")
    assert kernels.get("fbgemm").supports(spec, "cuda", "training", kind) is not None
    assert kernels.get("reference").supports(spec, "cuda", "training", kind) is None
    group = EmbeddingGroup(tables, feats, "none", "reference", "reference", fused=FusedSpec(kind, 0.3, 1e-3))
    base = [torch.randn(t.num_rows, t.dim, generator=torch.Generator().manual_seed(5)) for t in tables]
    mine = [torch.nn.Parameter(p.clone()) for p in base]
    theirs = [p.clone() for p in base]
    states = [torch.zeros(40, 7) if kind == "adagrad" else torch.zeros(40), torch.zeros(30, 5) if kind == "adagrad"
              else torch.zeros(30)]
    g = torch.Generator().manual_seed(9)
    for _ in range(4):
        ids = [torch.randint(0, 40, (3, 6), generator=g), torch.randint(0, 30, (3, 2), generator=g)]
        cots = [torch.randn(3, 6, 7, generator=g), torch.randn(3, 2, 5, generator=g)]
        outs = group(ids, [None, None], [None, None], mine)
        sum((o * c).sum() for o, c in zip(outs, cots)).backward()
        ws = [w.clone().requires_grad_() for w in theirs]
        ref_outs = [F.embedding(ids[0], ws[0], padding_idx=0), F.embedding(ids[1], ws[1])]
        sum((o * c).sum() for o, c in zip(ref_outs, cots)).backward()
        for t in range(2):
            grad = ws[t].grad
            touched = grad.abs().sum(1) > 0
            if kind == "adagrad":
                states[t] += grad * grad
                theirs[t] = theirs[t] - 0.3 * grad / (states[t].sqrt() + 1e-3)
            else:
                states[t] += torch.where(touched, (grad * grad).mean(1), 0.0)
                theirs[t] = theirs[t] - (0.3 / (states[t].sqrt() + 1e-3)).unsqueeze(1) * grad
    assert all(p.grad is None for p in mine)
    for x, y in zip(mine, theirs):
        torch.testing.assert_close(x.detach(), y, rtol=1e-5, atol=1e-6)
    assert torch.equal(mine[0].detach()[0], base[0][0])  # the padding row
    got = [s["sum"] for s in group.optimizer_states(mine)]
    for x, y in zip(got, states):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_fbgemm_bucketize_sends_each_id_to_its_row_block_in_bag_order():
    """The row-wise input dist's bucketing (fbgemm's block_bucketize_sparse_features), against the
    rule written out: bucket id // block (blocks cover every row, as the planner cuts them), local
    row id - bucket * block, lengths by (bucket, feature, bag), a bag's ids and weights in their order."""
    from fxrec.runtime.kernels.fbgemm_ops import bucketize_rows

    g = torch.Generator().manual_seed(4)
    world, batch, blocks = 3, 5, [4, 7]
    lengths = torch.randint(0, 4, (2 * batch,), generator=g)
    rows = [10, 21]
    ids = torch.cat([torch.randint(0, rows[f], (int(lengths[f * batch:(f + 1) * batch].sum()),), generator=g)
                     for f in range(2)])
    weights = torch.rand(ids.numel(), generator=g)
    got_len, got_ids, got_w, _ = bucketize_rows(lengths, ids, torch.tensor(blocks), world, weights)
    want = {(r, f, b): [] for r in range(world) for f in range(2) for b in range(batch)}
    at = 0
    for f in range(2):
        for b in range(batch):
            for _ in range(int(lengths[f * batch + b])):
                i = int(ids[at])
                r = i // blocks[f]
                want[(r, f, b)].append((i - r * blocks[f], float(weights[at])))
                at += 1
    keys = sorted(want)
    assert got_len.tolist() == [len(want[k]) for k in keys]
    assert got_ids.tolist() == [i for k in keys for i, _ in want[k]]
    assert torch.allclose(got_w, torch.tensor([w for k in keys for _, w in want[k]]))


def test_fbgemm_bucketize_of_a_sequence_says_where_each_id_went():
    """The sequence input dist's bucketing: one bag per feature (all its ids), ids shifted by a
    base of blocks (table-wise: a block of the whole table on its owner); ``where[i]`` is the
    position id ``i`` took, and holds its local row."""
    from fxrec.runtime.kernels.fbgemm_ops import bucketize_rows

    g = torch.Generator().manual_seed(5)
    world, rows, blocks, bases = 3, [9, 20, 7], [9, 7, 3], [2, 0, 0]  # table-wise on 2, row-wise, row-wise
    ids = [torch.randint(0, r, (n,), generator=g) for r, n in zip(rows, (6, 11, 0))]
    shifted = torch.cat([i + b * k for i, b, k in zip(ids, bases, blocks)])
    lengths = torch.tensor([i.numel() for i in ids])
    got_len, got_ids, _, where = bucketize_rows(lengths, shifted, torch.tensor(blocks), world, None, sequence=True)
    flat = torch.cat(ids)
    feat = torch.cat([torch.full((i.numel(),), f) for f, i in enumerate(ids)])
    dest = torch.tensor([bases[f] + int(i) // blocks[f] for f, i in zip(feat.tolist(), flat)])
    local = torch.tensor([int(i) % blocks[f] for f, i in zip(feat.tolist(), flat)])
    assert got_len.tolist() == [int(((dest == d) & (feat == f)).sum()) for d in range(world) for f in range(3)]
    assert sorted(where.tolist()) == list(range(flat.numel()))
    assert torch.equal(got_ids[where], local)
    # by destination, then feature, then the ids' own order
    order = sorted(range(flat.numel()), key=lambda i: (int(dest[i]), int(feat[i]), i))
    assert where.tolist() == [order.index(i) for i in range(flat.numel())]


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_fbgemm_dense_backward_gives_pytorchs_gradients(pooling):
    """The CUDA backward without a fused optimizer (fbgemm's dense TBE operator on the bound
    TBE's weights), run here on CPU: the gradients PyTorch gives, a table stored padded (dim 6 in
    8 columns) and a bag's padding ids included."""
    from fxrec.runtime.kernels import fbgemm, fbgemm_dense
    from fxrec.runtime.group_packing import pack_pooled

    tables = [TableSpec("a", 50, 8), TableSpec("b", 30, 6)]
    group = EmbeddingGroup(tables, FEATURES, pooling, "fbgemm", "fbgemm")
    base = [torch.randn(t.num_rows, t.dim, generator=torch.Generator().manual_seed(7)) for t in tables]
    ids, offs, psw = inputs()
    params = [p.clone().requires_grad_() for p in base]
    kernels.get("fbgemm").run(group, ids, offs, psw, params, training=True)  # binds the TBE
    indices, offsets, packed_psw, _, _ = pack_pooled(group, ids, offs, psw)
    cot = torch.randn(4, 22, generator=torch.Generator().manual_seed(3))
    got = fbgemm_dense.dense_grads(group, cot, indices, offsets, packed_psw)
    theirs = [p.clone().requires_grad_() for p in base]
    (plain(theirs, ids, offs, pooling) * cot).sum().backward()
    for g, p, t in zip(got, theirs, tables):
        assert g.shape == (t.num_rows, t.dim)
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)


def test_fbgemm_dense_backward_weighs_each_id_by_its_sample_weight():
    from fxrec.runtime.kernels import fbgemm, fbgemm_dense
    from fxrec.runtime.group_packing import pack_pooled

    tables = [TableSpec("a", 40, 4)]
    group = EmbeddingGroup(tables, [FeatureSpec("w", 0, "bag", weighted=True)], "sum", "fbgemm", "fbgemm")
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 4, generator=g)
    ids, offs, w = torch.randint(0, 40, (9,), generator=g), torch.tensor([0, 2, 2, 7]), torch.rand(9, generator=g)
    kernels.get("fbgemm").run(group, [ids], [offs], [w], [weight.clone().requires_grad_()], training=True)
    indices, offsets, packed_psw, _, _ = pack_pooled(group, [ids], [offs], [w])
    cot = torch.randn(4, 4, generator=g)
    (got,) = fbgemm_dense.dense_grads(group, cot, indices, offsets, packed_psw)
    theirs = weight.clone().requires_grad_()
    (F.embedding_bag(ids, theirs, offs, mode="sum", per_sample_weights=w) * cot).sum().backward()
    torch.testing.assert_close(got, theirs.grad, rtol=1e-5, atol=1e-6)


def test_bind_tables_makes_tensors_taken_before_the_first_call_the_rows_the_kernel_reads():
    """On fbgemm's kernel the first call moves the tables into the TBE: a state_dict() taken before
    it is the old storage (training did not show in it, writes through it were not read).
    fxrec.graph_module.bind_tables moves them first."""
    from fxrec.graph_module import bind_tables

    model = M.BagList(rows=(50, 40, 30))
    x = M.bag_inputs(rows=(50, 40, 30))
    fast = fxrec.transform(model, x, backend="fbgemm")
    bind_tables(fast)
    early = fast.state_dict()
    opt = torch.optim.SGD(fast.parameters(), lr=0.1)
    fast(*x).sum().backward()
    opt.step()
    torch.testing.assert_close(early["bags.0.weight"], fast.state_dict()["bags.0.weight"], rtol=0, atol=0)
    with torch.no_grad():
        early["bags.1.weight"].zero_()
        out = fast(*x)
    assert not fast.get_parameter("bags.1.weight").any() and out.shape[0] > 0


class _TableBetween(torch.nn.Module):
    """A table registered between two other parameters of its module (their order must stay)."""

    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(8))
        self.table = torch.nn.Parameter(torch.randn(50, 8))
        self.scale = torch.nn.Parameter(torch.ones(8))
        self.e = torch.nn.EmbeddingBag(40, 8, mode="sum")

    def forward(self, ids, offsets, ids2, offsets2):
        own = F.embedding_bag(ids, self.table, offsets, mode="sum") * self.scale + self.bias
        return torch.cat([own, self.e(ids2, offsets2)], 1)


def _between_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 50, (10,), generator=g), torch.tensor([0, 3, 6, 8]),
            torch.randint(0, 40, (9,), generator=g), torch.tensor([0, 2, 5, 7]))


def test_tables_bound_for_unified_memory_from_meta_take_new_host_parameters_in_place(monkeypatch):
    """What to_empty(device="cuda") of a model on meta does to the tables its groups keep in
    unified memory (fxrec.graph_module._bind_unified_from_meta; on CUDA in tests/test_gpu.py):
    new parameters in host memory under every name, in the order the module had them (a meta
    parameter cannot take host memory as its data), bound into a new TBE (the one kept through
    .to("meta") freed, its optimizer states not carried). Run here on the CPU, with the groups
    told they place tables there: everything else is the real path. After load_state_dict the
    model answers as the one saved."""
    from fxrec.graph_module import _bind_unified_from_meta

    monkeypatch.setattr(EmbeddingGroup, "places_unified", lambda self, device: device.type == "cpu")
    torch.manual_seed(0)
    fast = fxrec.transform(_TableBetween(), _between_inputs(0), optimizer=fxrec.optim.RowWiseAdagrad(lr=0.1),
                           backend="fbgemm")
    fast(*_between_inputs(1)).sum().backward()
    with torch.no_grad():
        want = fast(*_between_inputs(2))
    state = {k: v.detach().clone() for k, v in fast.state_dict().items()}
    names = [n for n, _ in fast.named_parameters()]
    fast.to("meta")
    (group,) = [m for m in fast.modules() if isinstance(m, EmbeddingGroup)]
    old = group._bound
    kept = _bind_unified_from_meta(fast, torch.device("cpu"))
    params = dict(fast.named_parameters())
    assert list(params) == names
    assert kept == {id(params["table"]), id(params["e.weight"])}
    assert all(not p.is_meta for n, p in params.items() if n in ("table", "e.weight"))
    assert all(p.is_meta for n, p in params.items() if n not in ("table", "e.weight"))
    assert group._bound is not None and group._bound is not old
    assert all(not s.any() for states in group._bound.tbe.split_optimizer_states() for s in states)
    rows = group._bound.tbe.split_embedding_weights()
    assert {r.data_ptr() for r in rows} == {params["table"].data_ptr(), params["e.weight"].data_ptr()}
    fast.to_empty(device="cpu")
    fast.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(fast(*_between_inputs(2)), want)


def test_tables_bound_in_unified_memory_are_left_by_to_empty_but_not_by_a_change_of_dtype():
    """_apply's function for a model whose tables were just bound in unified memory
    (fxrec.graph_module._leaving_bound): where it would only give them new memory on their device
    (to_empty's), they are left as they are (on CUDA that memory would be GPU memory: the real run
    is in tests/test_gpu.py); where it changes their dtype, or for any other tensor, it applies."""
    from fxrec.graph_module import _leaving_bound

    table, other = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(3))
    empty = _leaving_bound(lambda t: torch.empty_like(t, device="cpu"), {id(table)})
    kept = empty(table)
    assert kept.data_ptr() == table.data_ptr() and torch.equal(kept, table)
    assert empty(other).data_ptr() != other.data_ptr()
    half = _leaving_bound(lambda t: t.half(), {id(table)})(table)
    assert half.dtype == torch.float16 and torch.equal(half, table.detach().half())


def test_bind_on_leaves_a_group_given_no_tables_or_tables_of_another_dtype(monkeypatch):
    """What a move binds first (EmbeddingGroup.bind_on), for a group told it places tables in
    unified memory (here on the CPU; on CUDA in tests/test_gpu.py): nothing for no tables (a
    sharded quantized lookup's, which bound an unused fp32 TBE of its tables on every .cuda()), nor
    for tables of another dtype than the TBE holds (after .double(): bound, they became fp32)."""
    monkeypatch.setattr(EmbeddingGroup, "places_unified", lambda self, device: device.type == "cpu")
    fast = fxrec.transform(_TableBetween(), _between_inputs(0), optimizer=fxrec.optim.RowWiseAdagrad(lr=0.1),
                           backend="fbgemm")
    from fxrec.graph_module import groups_with_tables

    ((group, params),) = list(groups_with_tables(fast))
    cpu = torch.device("cpu")
    assert not group.bind_on([], cpu) and group._bound is None
    wide = [torch.nn.Parameter(p.detach().double()) for p in params]
    assert not group.bind_on(wide, cpu) and group._bound is None and all(p.dtype == torch.float64 for p in wide)
    assert group.bind_on(params, cpu) and group._bound is not None  # (the tables as transformed: bound)


class _WeightedTop(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(50, 8, mode="sum")
        self.top = torch.nn.Linear(8, 1)

    def forward(self, ids, offsets, w):
        return self.top(torch.tanh(self.bag(ids, offsets, per_sample_weights=w)))


@pytest.mark.parametrize("backend", ["auto", "fbgemm", "native"])
def test_a_second_backward_through_the_sample_weights_gradient_reaches_the_table(backend):
    """A penalty on the per-sample weights' gradient (create_graph=True): that gradient is a
    function of the table's rows, so the second backward gives the table a gradient. PyTorch's
    own lookup has no such double backward (it raises); the answer is the same model written with
    ops that have one."""
    torch.manual_seed(0)
    model = _WeightedTop()
    B, L = 4, 3
    ids, offsets, w0 = torch.randint(0, 50, (B * L,)), torch.arange(0, B * L, L), torch.rand(B * L)

    def written_out(w):
        return model.top(torch.tanh((model.bag.weight[ids] * w[:, None]).view(B, L, 8).sum(1)))

    fast = fxrec.transform(model, (ids, offsets, w0), backend=backend)
    grads = []
    for m, f in ((model, written_out), (fast, lambda w: fast(ids, offsets, w))):
        w = w0.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(f(w).sum(), [w], create_graph=True)
        m.zero_grad()
        (g ** 2).sum().backward()
        grads.append(dict(m.named_parameters())["bag.weight"].grad)
    assert grads[0].abs().max() > 0.1
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)


class _ZeroedRow(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.t = torch.nn.EmbeddingBag(30, 8, mode="sum")
        self.top = torch.nn.Linear(8, 1)

    def forward(self, ids, offsets):
        y = self.top(self.t(ids, offsets))
        with torch.no_grad():
            self.t.weight[0].zero_()  # a reserved row kept at zero, after the lookup
        return y


@pytest.mark.parametrize("backend", ["auto", "fbgemm", "native", "reference"])
def test_a_table_written_between_forward_and_backward_trains_as_the_plain_model(backend):
    """Without per-sample weights that want a gradient, backward does not read the rows (nor does
    PyTorch's): writing them in place after the lookup is allowed, in the model or between the
    calls."""
    torch.manual_seed(0)
    model = _ZeroedRow()
    ids, offsets = torch.randint(0, 30, (12,)), torch.arange(0, 12, 3)
    fast = fxrec.transform(model, (ids, offsets), backend=backend)
    for m in (model, fast):
        y = m(ids, offsets)
        with torch.no_grad():
            m.get_parameter("t.weight").mul_(0.5)
        y.sum().backward()
    for (n, a), (_, b) in zip(model.named_parameters(), fast.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-6, msg=n)
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("backend", ["auto", "native", "reference"])
def test_a_second_backward_through_the_sample_weights_gradient_of_fused_tables_is_refused(backend):
    """A fused optimizer updates the tables in the first backward: the second's part for them
    would be a table-sized gradient nothing applies (it was left in .grad)."""
    torch.manual_seed(0)
    ids, offsets, w0 = torch.randint(0, 50, (12,)), torch.arange(0, 12, 3), torch.rand(12)
    fast = fxrec.transform(_WeightedTop(), (ids, offsets, w0), backend=backend, optimizer=fxrec.optim.SGD(lr=0.1))
    w = w0.clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"tables \['bag'\] train with a fused optimizer.*create_graph=True"):
        torch.autograd.grad(fast(ids, offsets, w).sum(), [w], create_graph=True)
    (g,) = torch.autograd.grad(fast(ids, offsets, w).sum(), [w])  # without create_graph: as before
    assert g.shape == w.shape
