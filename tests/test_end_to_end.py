"""End to end: model styles as people write them, transformed and compared with the plain model."""

import copy

import pytest
import torch
from torch import nn

import fxrec
from fxrec.testing import assert_matches, embedding_ops, group_calls
from tests import models as M

BACKENDS = ["fbgemm", "native", "reference", "auto"]

CASES = {
    "bag_list": (M.BagList, lambda s: M.bag_inputs(seed=s)),
    "bag_list_mean": (lambda: M.BagList(mode="mean"), lambda s: M.bag_inputs(seed=s)),
    "field_dict": (M.FieldDict, lambda s: M.field_inputs(seed=s)),
    "offset_fm": (M.OffsetFM, lambda s: M.fm_inputs(seed=s)),
    "shared_tables": (M.SharedTables, lambda s: M.shared_inputs(seed=s)),
    "sequence_mean": (M.SequenceMean, lambda s: M.seq_inputs(seed=s)),
    "weighted_bags": (M.WeightedBags, lambda s: M.weighted_inputs(seed=s)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_model_styles_match_plain_model(case, backend):
    make_model, make_inputs = CASES[case]
    model = make_model()
    fast = fxrec.transform(model, make_inputs(0), backend=backend, verify=True, timing_rounds=1)
    if backend != "auto":  # auto may keep plain lookups where they measured faster
        assert not embedding_ops(fast), f"{case}: a lookup was left in the graph\n{fast.code}"
        assert group_calls(fast), f"{case}: no group module in the graph"
        assert not fast.report.left_alone
    assert all(e.group is not None for e in fast.report.lookups)
    # other inputs than the example ones: other batch sizes and numbers of ids
    assert_matches(model, fast, make_inputs(1), make_inputs(2))
    # inference (no autograd: the eval path, which may reuse its output buffer between calls)
    with torch.no_grad():
        for seed in (1, 2, 1):
            outs = [fast(*make_inputs(seed)), fast(*make_inputs(seed + 10))]
            torch.testing.assert_close(outs, [model(*make_inputs(seed)), model(*make_inputs(seed + 10))])


def test_weighted_bags_give_per_sample_weight_gradients():
    model = M.WeightedBags()
    inputs = M.weighted_inputs()
    fast = fxrec.transform(model, inputs, backend="fbgemm")
    a = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    b = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    g = torch.randn(4, 24)
    (model(*a) * g).sum().backward()
    (fast(*b) * g).sum().backward()
    for x, y in zip(a, b):
        if x.is_floating_point():
            torch.testing.assert_close(y.grad, x.grad)


def test_demo_dlrm_lowers_all_26_tables_into_one_tbe():
    from examples.dlrm import DLRM, make_batch, table_rows

    rows = table_rows(cap=2000)
    model = DLRM(rows, dim=16)
    batch = make_batch(rows, batch=32, ids_per_bag=2)
    fast = fxrec.transform(model, batch, backend="fbgemm", verify=True)
    assert len(group_calls(fast)) == 1
    assert len(fast.report.lowered) == 26
    assert_matches(model, fast, make_batch(rows, batch=17, ids_per_bag=3, seed=3))


def test_not_lowerable_lookups_are_left_alone_with_reasons():
    model = M.NotLowerable()
    inputs = M.not_lowerable_inputs()
    fast = fxrec.transform(model, inputs, backend="fbgemm")
    reasons = {e.table: e.reason for e in fast.report.left_alone}
    assert set(reasons) == {"maxbag", "renorm", "freq"}  # "odd" (dim 6) is lowered, padded to 8
    assert "max" in reasons["maxbag"]
    assert "max_norm" in reasons["renorm"]
    assert "scale_grad_by_freq" in reasons["freq"]
    assert sorted(e.table for e in fast.report.lowered) == ["odd", "ok"]
    ref = copy.deepcopy(model)  # max_norm renormalises weights in forward: compare fresh copies
    assert_matches(ref, fast, inputs)
    for name in reasons:
        assert name in str(fast.report)


def test_original_model_is_untouched_and_two_transforms_are_independent():
    model = M.BagList()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = M.bag_inputs()
    a = fxrec.transform(model, inputs, backend="fbgemm")
    b = fxrec.transform(model, inputs, backend="fbgemm")
    a(*inputs).sum().backward()
    with torch.no_grad():
        for p in a.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for k, v in b.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not torch.equal(a.state_dict()["bags.0.weight"], before["bags.0.weight"])


def test_state_dict_keys_checkpoint_round_trip_and_write_back():
    model = M.BagList()
    inputs = M.bag_inputs()
    fast = fxrec.transform(model, inputs, backend="fbgemm")
    assert list(fast.state_dict()) == list(model.state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(fast.state_dict()[k], v)
    # a checkpoint of another plain model loads into the transformed one, and is used by the TBE
    other = M.BagList()
    fast.load_state_dict(other.state_dict())
    torch.testing.assert_close(fast(*inputs), other(*inputs))
    # train the transformed model a step, then write the weights back into a plain model
    opt = torch.optim.SGD(fast.parameters(), lr=0.1)
    fast(*inputs).pow(2).sum().backward()
    opt.step()
    fxrec.write_back(fast, other)
    torch.testing.assert_close(other(*inputs), fast(*inputs))


def test_write_back_into_a_model_it_does_not_fit_writes_nothing():
    """write_back loaded what matched, then raised: the target was left half written. A model
    quantized for serving raised "state_dict keys differ" without saying why."""
    model = M.BagList(rows=(50, 80, 30))
    fast = fxrec.transform(model, M.bag_inputs(rows=(50, 80, 30)), backend="fbgemm")
    with torch.no_grad():
        for p in fast.parameters():
            p.add_(1.0)
    for target, error, match in ((M.BagList(rows=(50, 80)), KeyError, r"\['bags.2.weight'\] are not in the target"),
                                 (M.BagList(rows=(50, 80, 31)), ValueError,
                                  r"differ in shape.*bags.2.weight \(30, 8\) vs \(31, 8\); nothing was written")):
        before = copy.deepcopy(target.state_dict())
        with pytest.raises(error, match=match):
            fxrec.write_back(fast, target)
        for k, v in target.state_dict().items():
            assert torch.equal(v, before[k]), k  # (bags.0 and bags.1 were overwritten)
    served = fxrec.transform(model.eval(), M.bag_inputs(rows=(50, 80, 30)), mode="inference", quantize="int8")
    with pytest.raises(ValueError, match=r"quantized for serving: it holds the tables \['bags.0', 'bags.1', 'bags.2'\] "
                                         r"as quantized rows"):
        fxrec.write_back(served, M.BagList(rows=(50, 80, 30)))


def test_training_with_torch_optim_matches_plain_model_over_steps():
    model = M.BagList(rows=(40, 30, 20))
    fast = fxrec.transform(model, M.bag_inputs(rows=(40, 30, 20)), backend="fbgemm")
    ref = copy.deepcopy(model)
    opt_a = torch.optim.Adagrad(ref.parameters(), lr=0.1)
    opt_b = torch.optim.Adagrad(fast.parameters(), lr=0.1)
    for step in range(10):
        inputs = M.bag_inputs(rows=(40, 30, 20), seed=step)
        for m, o in ((ref, opt_a), (fast, opt_b)):
            o.zero_grad()
            m(*inputs).sin().sum().backward()
            o.step()
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=k)


def test_backward_alone_changes_no_weight():
    """fbgemm's training TBE would apply SGD in backward; fxrec must not."""
    model = M.BagList()
    inputs = M.bag_inputs()
    fast = fxrec.transform(model, inputs, backend="fbgemm")
    before = {k: v.clone() for k, v in fast.state_dict().items()}
    for _ in range(3):
        fast(*inputs).sum().backward()
    for k, v in fast.state_dict().items():
        assert torch.equal(v, before[k]), k


class SparseBags(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.EmbeddingBag(30, 8, mode="sum", sparse=True)
        self.b = torch.nn.Embedding(20, 8, sparse=True)

    def forward(self, ids, offsets, col):
        return torch.cat([self.a(ids, offsets), self.b(col)], 1)


def test_sparse_tables_get_sparse_gradients():
    model = SparseBags()
    inputs = (torch.tensor([1, 2, 2, 5, 7]), torch.tensor([0, 2, 2]), torch.tensor([3, 3, 9]))
    fast = fxrec.transform(model, inputs, backend="fbgemm", verify=True)
    fast(*inputs).sum().backward()
    assert fast.get_parameter("a.weight").grad.is_sparse
    assert fast.get_parameter("b.weight").grad.is_sparse
    model(*inputs).sum().backward()
    torch.testing.assert_close(fast.get_parameter("a.weight").grad.to_dense(), model.a.weight.grad.to_dense())
    opt = torch.optim.SparseAdam(list(fast.parameters()), lr=0.01)
    opt.step()  # the sparse gradient is usable by torch's sparse optimizers


class _MaskedSeq(torch.nn.Module):
    def __init__(self, form):
        super().__init__()
        self.form = form
        self.t = torch.nn.Embedding(25, 5, sparse=True) if form == "seq" else \
            torch.nn.EmbeddingBag(25, 5, mode="sum", sparse=True)

    def forward(self, x):
        if self.form == "seq":
            return (self.t(x) * (x != 0).unsqueeze(-1).float()).sum(1)
        return self.t(x) * 2


@pytest.mark.parametrize("backend", ["fbgemm", "native", "reference"])
@pytest.mark.parametrize("form", ["seq", "bag"])
def test_a_sparse_gradient_of_one_row_of_a_padded_table_reads_only_its_row(backend, form):
    """dim 5 is stored padded to 8: the gradient's one row was a [1, 5] view of stride (8, 1),
    whose size-1 dim's stride PyTorch's sparse kernels use anyway, reading past its storage into
    the next row of ``to_dense()`` and ``add_`` (found by the differential fuzzer)."""
    torch.manual_seed(0)
    model = _MaskedSeq(form)
    fast = fxrec.transform(model, (torch.tensor([[21], [15], [0], [2]]),), backend=backend)
    x = torch.tensor([[7]])
    model(x).sum().backward()
    fast(x).sum().backward()
    grad, want = fast.get_parameter("t.weight").grad, model.t.weight.grad
    assert grad.is_sparse and grad._values().stride() == (5, 1), grad._values().stride()
    for _ in range(20):
        [torch.randn(1000) * 1e3 for _ in range(10)]  # (allocations: what lies past a storage changes)
        assert torch.equal(grad.to_dense(), want.to_dense())
        assert torch.equal(torch.zeros(25, 5).add_(grad), torch.zeros(25, 5).add_(want))


class _OneLookupDetached(torch.nn.Module):
    """A sparse table looked up twice, one result detached or only read by argmax (a stop-gradient
    on a shared item table); a second table looked up only detached."""

    def __init__(self, form, how):
        super().__init__()
        self.form, self.how = form, how
        if form == "bag":
            self.a = torch.nn.EmbeddingBag(20, 4, mode="sum", sparse=True)
            self.b = torch.nn.EmbeddingBag(20, 4, mode="sum")
        else:
            self.a = torch.nn.Embedding(20, 4, sparse=True)
            self.b = torch.nn.Embedding(20, 4)

    def forward(self, i1, i2):
        look = (lambda t, i: t(i, torch.tensor([0, 1]))) if self.form == "bag" else (lambda t, i: t(i))
        other, off = look(self.a, i2), look(self.b, i2)
        if self.how == "detach":
            return look(self.a, i1) + other.detach() + off.detach()
        if self.how == "float_argmax":  # (.float() of a float tensor captures as an assert of its dtype and a to)
            return look(self.a, i1) + other.float().argmax(-1, keepdim=True) + off.float().argmax(-1, keepdim=True)
        return look(self.a, i1) + other.argmax(-1, keepdim=True) + off.argmax(-1, keepdim=True)


@pytest.mark.parametrize("backend", ["fbgemm", "native", "reference"])
@pytest.mark.parametrize("form", ["bag", "seq"])
@pytest.mark.parametrize("how", ["detach", "argmax", "float_argmax"])
def test_a_lookup_no_gradient_reaches_adds_nothing_to_its_tables_gradient(backend, form, how):
    """As in PyTorch: the sparse gradient has entries only for the ids of lookups a gradient
    reaches (a zero entry would move the row under SparseAdam), and a table whose every lookup is
    detached gets no gradient at all."""
    torch.manual_seed(0)
    model = _OneLookupDetached(form, how)
    x = (torch.tensor([1, 2, 3]), torch.tensor([7, 8, 9]))
    fast = fxrec.transform(model, x, backend=backend)
    model(*x).sum().backward()
    fast(*x).sum().backward()
    grad = fast.get_parameter("a.weight").grad
    assert grad.is_sparse and sorted(grad.coalesce().indices()[0].tolist()) == [1, 2, 3]
    assert model.b.weight.grad is None and fast.get_parameter("b.weight").grad is None
    # and two steps of SparseAdam on both move the same rows by the same amounts
    ref = copy.deepcopy(model)
    fast = fxrec.transform(model, x, backend=backend)
    opts = [torch.optim.SparseAdam([m.get_parameter("a.weight")], lr=0.1) for m in (ref, fast)]
    for xs in [x[::-1], x]:
        for m, o in zip((ref, fast), opts):
            o.zero_grad()
            m(*xs).sum().backward()
            o.step()
    assert torch.equal(fast.get_parameter("a.weight"), ref.a.weight)


class _IndexedTable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(40, 8, mode="sum")
        self.item = torch.nn.Embedding(30, 8)
        self.top = torch.nn.Linear(16, 1)

    def forward(self, ids, item_ids, neg):
        scores = (self.item.weight[item_ids].unsqueeze(1) * torch.index_select(self.item.weight, 0, neg)).sum()
        return self.top(torch.cat([self.bag(ids), self.item.weight[item_ids]], 1)) + scores


def _indexed_batch(seed, batch=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 40, (batch, 3), generator=g), torch.randint(0, 30, (batch,), generator=g),
            torch.randint(0, 30, (5,), generator=g))


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_a_table_read_by_indexing_its_weight_is_a_table_the_optimizer_trains(backend):
    """emb.weight[ids] and index_select(emb.weight, 0, ids) were no lookups: left out of the
    report, and optimizer= (for every table) left the table to the dense optimizer (0.19 off the
    plain model trained with Adagrad after three steps); naming it was an error."""
    torch.manual_seed(0)
    model = _IndexedTable()
    ref = copy.deepcopy(model)
    fast = fxrec.transform(model, _indexed_batch(0), optimizer={"item": fxrec.optim.Adagrad(lr=0.1),
                                                                "bag": fxrec.optim.Adagrad(lr=0.1)}, backend=backend)
    # (item's negatives are over another batch size than the group's: left as written, with the reason)
    assert sorted((e.table, e.feature) for e in fast.report.lookups) == [("bag", "ids"), ("item", "item_ids"),
                                                                         ("item", "neg")]
    opt = fast.make_optimizer(torch.optim.SGD, lr=0.05)
    ref_opts = [torch.optim.Adagrad([ref.bag.weight, ref.item.weight], lr=0.1), torch.optim.SGD(ref.top.parameters(), lr=0.05)]
    for step in range(3):
        x = _indexed_batch(step + 1)
        torch.testing.assert_close(fast(*x), ref(*x))
        ref(*x).sum().backward()
        fast(*x).sum().backward()
        for o in [opt] + ref_opts:
            o.step()
            o.zero_grad()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(fast.state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=k)
    # (PyTorch's indexing wraps a negative id around; a lookup names it)
    ids, item_ids, neg = _indexed_batch(9)
    with pytest.raises(IndexError, match=r"feature 'item_ids' looks up id -1 in table 'item'"):
        fast(ids, torch.cat([item_ids[:-1], torch.tensor([-1])]), neg)


def test_deepcopy_and_param_data_replacement_rebind_the_tbe():
    model = M.BagList()
    inputs = M.bag_inputs()
    fast = fxrec.transform(model, inputs, backend="fbgemm")
    twin = copy.deepcopy(fast)
    with torch.no_grad():
        twin.get_parameter("bags.1.weight").mul_(2)
    assert not torch.allclose(twin(*inputs), fast(*inputs))
    torch.testing.assert_close(fast(*inputs), model(*inputs))
    # replacing a parameter's data (as .to() does) must not leave the TBE reading stale weights
    new = torch.randn(80, 8)
    fast.get_parameter("bags.1.weight").data = new.clone()
    model.bags[1].weight.data = new.clone()
    torch.testing.assert_close(fast(*inputs), model(*inputs))


def test_report_names_groups_kernels_and_sources():
    fast = fxrec.transform(M.BagList(), M.bag_inputs())
    text = str(fast.report)
    assert "3 embedding lookups found" in text
    g = fast.report.groups[0]
    assert g.kernel_eval in ("native", "reference") and g.kernel_train in ("native", "reference")
    assert g.decided_by == "rule" and g.why.startswith("rule: ") and g.device == "cpu"
    assert f"{g.kernel_train}" in text and "decided by" in text
    assert all(e.source.startswith("models.py:") for e in fast.report.lookups)
    assert fast.report.lookups[0].feature == "ids_0"


def test_eval_mode_and_no_grad_use_inference_path():
    model = M.BagList().eval()
    inputs = M.bag_inputs()
    fast = fxrec.transform(model, inputs, backend="fbgemm")
    with torch.no_grad():
        torch.testing.assert_close(fast(*inputs), model(*inputs))


def test_any_batch_size_after_an_example_batch_of_two_or_more():
    """Capture is size-oblivious: an example batch of 4 does not make the batch 2 or more
    (torch.export's default); an example batch of 1 fixes it, and the report says so."""
    model = M.FieldDict()
    one = fxrec.transform(model, M.field_inputs(batch=1), backend="fbgemm")
    assert any("input x accepts only size 1 in dim 0" in n for n in one.report.notes), one.report.notes
    assert_matches(model, one, M.field_inputs(batch=1, seed=2))
    with pytest.raises(ValueError, match=r"input x has size 3 in dim 0; the model was captured with a fixed size 1 "
                                         r"there \(capture fixes a size of 0 or 1 in the example.*transform with an "
                                         r"example of 2 or more there\)"):
        one(*M.field_inputs(batch=3, seed=1))
    fast = fxrec.transform(model, M.field_inputs(batch=4), backend="fbgemm")
    # (the batch is free; x's columns meet conditions of the model's code: it reads some of them)
    assert not any("accepts only size" in n for n in fast.report.notes), fast.report.notes
    assert any(n.startswith("input sizes: 1 dynamic size(s) that take any value (batch 1 included)")
               for n in fast.report.notes), fast.report.notes
    # x dim 1's condition, as torch.export keeps it: torch 2.13 as a condition on a dynamic size (a second
    # dynamic size, its size 1 refused), torch 2.11 as that size's range (2 or more)
    assert any(n.startswith("size 1 in x dim 1 is refused") or n.startswith("the model accepts sizes 2 or more in x dim 1")
               for n in fast.report.notes), fast.report.notes
    with pytest.raises(ValueError, match=r"the inputs break \d+ conditions on their sizes .*: \(1\) .*x\.size\(\)\[1\].*"
                                         r" \(here x\.size\(\)\[1\] = 1\)$"  # torch 2.13
                                         r"|input x has size 1 in dim 1; the model accepts 2 or more there$"):  # 2.11
        fast(M.field_inputs(batch=3)[0][:, :1])
    assert any(n.startswith("input sizes: ") and "fixed: x dim 0 = 1" in n for n in one.report.notes), one.report.notes
    assert_matches(model, fast, *(M.field_inputs(batch=b, seed=b) for b in (1, 2, 3, 7)))


class _Transposed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c = torch.nn.EmbeddingBag(30, 8, mode="sum")

    def forward(self, x):  # x: [L, B] ids
        return self.c(x.t())


class _TransposedReshaped(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c = torch.nn.EmbeddingBag(30, 8, mode="sum")

    def forward(self, x):  # x: [L, B] ids, reshaped to the shape they have (a view of the transpose)
        return self.c(x.t().reshape(x.shape[1], x.shape[0]))


def test_the_report_lists_the_size_conditions_capture_kept():
    """torch.export's capture of a reshape that views a transposed [B, L] tensor keeps the
    condition that neither dim is 1: the report said every dynamic size took any value, batch 1
    included, and batch 1 was refused. (A bag of the transpose itself now takes both: capture
    flattens it on a copy, fxrec.capture_reshapes.reshape_by_copy.)"""
    model = _TransposedReshaped()
    fast = fxrec.transform(model, (torch.randint(0, 30, (3, 4)),))
    notes = fast.report.notes
    assert not any("batch 1 included" in n for n in notes), notes
    assert any("size 1 in x dim 1 is refused: the model's code needs x.size()[1] != 1" in n for n in notes), notes
    with pytest.raises(ValueError, match=r"x\.size\(\)\[1\] != 1"):
        fast(torch.randint(0, 30, (3, 1)))
    x = torch.randint(0, 30, (3, 5))
    torch.testing.assert_close(fast(x), model(x), rtol=1e-6, atol=1e-6)
    plain = _Transposed()
    fast = fxrec.transform(plain, (torch.randint(0, 30, (3, 4)),))
    assert any("take any value (batch 1 included)" in n for n in fast.report.notes), fast.report.notes
    for shape in ((3, 1), (1, 4), (1, 1)):
        x = torch.randint(0, 30, shape)
        torch.testing.assert_close(fast(x), plain(x), rtol=1e-6, atol=1e-6)


class _SlicedBagAndCheck(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(40, 4)
        self.e = torch.nn.Embedding(40, 4)

    def forward(self, h):
        b, length = h.shape
        torch._check(length % 3 == 0)
        return self.bag(h[:, :2]) + self.e(h.reshape(b, length // 3, 3)).sum((1, 2))


def test_the_report_claims_no_size_takes_any_value_where_its_probe_cannot_tell():
    """Conditions its probe of sizes 16 and 1 cannot try (here 16 breaks L % 3 == 0): the report
    said both sizes took any value, batch 1 included, and batch 1 was refused; the model's own
    check was not named. Batch 1 is now taken."""
    model = _SlicedBagAndCheck()
    fast = fxrec.transform(model, (torch.randint(0, 40, (4, 6)),))
    notes = fast.report.notes
    assert not any("any value" in n for n in notes), notes
    assert any(n.startswith("input sizes: 2 dynamic size(s), under conditions of the model's code") for n in notes), notes
    assert any("the model's code needs (h.size()[1] % 3) == 0" in n for n in notes), notes
    # (the bag of h[:, :2] kept batch 1 out, `h.size()[0] != 1`, until capture flattened it on a copy)
    x = torch.randint(0, 40, (1, 6))
    torch.testing.assert_close(fast(x), model(x), rtol=1e-6, atol=1e-6)


def test_symbolic_traced_graph_module_with_call_module_lookups():
    """A model the user already traced with torch.fx (lookups as call_module nodes) is lowered too."""

    class Small(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.EmbeddingBag(10, 4), torch.nn.Embedding(10, 4)

        def forward(self, i, o, c):
            return torch.cat([self.a(i, o), self.b(c)], 1)

    traced = torch.fx.symbolic_trace(Small())
    assert sum(n.op == "call_module" for n in traced.graph.nodes) == 2
    inputs = (torch.tensor([1, 2, 3]), torch.tensor([0, 2]), torch.tensor([4, 5]))
    fast = fxrec.transform(traced, inputs, backend="fbgemm", verify=True)
    assert len(fast.report.lowered) == 2 and not embedding_ops(fast)


def test_copy_model_false_hands_the_tables_over_without_a_copy():
    model = M.BagList()
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    fast = fxrec.transform(model, M.bag_inputs(), copy_model=False, optimizer=fxrec.optim.SGD(lr=0.5))
    assert {n: fast.get_parameter(n).data_ptr() for n in ptrs} == ptrs  # the same storage
    before = model.bags[0].weight.detach().clone()
    fast(*M.bag_inputs(seed=1)).sum().backward()  # fused SGD updates the shared tables
    assert not torch.equal(model.bags[0].weight.detach(), before)


def test_default_transform_copies_the_tables_once_and_leaves_the_model_alone():
    model = M.BagList()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    fast = fxrec.transform(model, M.bag_inputs(), optimizer=fxrec.optim.SGD(lr=0.5))
    assert all(fast.get_parameter(n).data_ptr() != p.data_ptr() for n, p in model.named_parameters())
    fast(*M.bag_inputs(seed=1)).sum().backward()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())


def test_verify_compares_with_the_model_itself_and_puts_its_gradients_back():
    model = M.BagList()
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    fxrec.transform(model, M.bag_inputs(), verify=True, check_passes=True)
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in model.parameters())


class RenormedDict(nn.Module):
    """A max_norm table renormalises the rows it reads, in forward; the features come in a dict."""

    def __init__(self):
        super().__init__()
        self.a = nn.EmbeddingBag(30, 8, max_norm=0.5)
        self.b = nn.EmbeddingBag(30, 8)

    def forward(self, feats):
        return torch.cat([self.a(*feats["x"]), self.b(*feats["y"])], 1)


class HalvedDict(RenormedDict):
    """A table written in a no_grad block in forward (captured as a higher-order op's body)."""

    def forward(self, feats):
        with torch.no_grad():
            self.a.weight.mul_(0.5)
        return torch.cat([self.a(*feats["x"]), self.b(*feats["y"])], 1)


class TiedRenorm(nn.Module):
    """A max_norm table that backward reads too (the output layer): restored only after backward."""

    def __init__(self):
        super().__init__()
        self.a = nn.Embedding(30, 8, max_norm=0.5)
        self.mix = nn.Linear(8, 8)

    def forward(self, feats):
        return self.mix(self.a(feats["x"][0]).sum(0, keepdim=True)) @ self.a.weight.t() + feats["y"][0].sum()


@pytest.mark.parametrize("kw", [dict(verify=True), dict(check_passes=True), dict(autotune=True), {}],
                         ids=["verify", "check_passes", "autotune", "dict-order-probe"])
@pytest.mark.parametrize("cls", [RenormedDict, HalvedDict, TiedRenorm])
def test_transform_leaves_a_table_forward_writes_as_it_was_in_both_models(kw, cls):
    """verify=, check_passes=, autotune= and the dict-order probe run the model's forward, which
    renormalised the example's rows of the user's table (verify) or of the transformed one; a
    table backward reads was restored before it (verify failed), and a no_grad block's write was
    not seen."""
    torch.manual_seed(0)
    model = cls()
    g = torch.Generator().manual_seed(1)
    ids, offsets = torch.randint(0, 30, (12,), generator=g), torch.arange(0, 12, 3)
    x = ({"x": (ids, offsets), "y": (ids.flip(0), offsets)},)
    before = model.a.weight.detach().clone()
    fast = fxrec.transform(model, x, **kw)
    assert torch.equal(model.a.weight, before)
    assert torch.equal(fast.state_dict()["a.weight"], before)
    torch.testing.assert_close(fast(*x), model(*x))
    torch.testing.assert_close(fast.state_dict()["a.weight"], model.a.weight)
    assert not torch.equal(model.a.weight, before)  # (forward does write the table)


@pytest.mark.parametrize("backend", ["auto", "reference", "fbgemm"])
@pytest.mark.parametrize("opt", [fxrec.optim.SGD(lr=0.5), fxrec.optim.Adagrad(lr=0.5), fxrec.optim.RowWiseAdagrad(lr=0.5)],
                         ids=["sgd", "adagrad", "rowwise_adagrad"])
def test_check_passes_with_a_fused_optimizer_compares_gradients_and_updates_nothing(backend, opt):
    """As verify=: the groups give gradients while the passes are checked (it failed: 'no gradient
    in the transformed model', the fused update having taken them), and no table is updated."""
    model = M.BagList()
    kw = {} if backend == "auto" else {"backend": backend}
    fast = fxrec.transform(model, M.bag_inputs(), optimizer=opt, check_passes=True, **kw)
    for k, v in model.state_dict().items():
        assert torch.equal(fast.state_dict()[k], v), k
    assert all(p.grad is None for p in fast.parameters())
    assert fast.meta["fxrec_fused_groups"], "the optimizer is still fused"


@pytest.mark.parametrize("backend", ["auto", "fbgemm", "native", "reference"])
def test_functional_call_with_other_tensors_is_refused_by_a_fused_group_and_changes_nothing(backend):
    """Outside torch.func transforms the fused update wrote the caller's tensors in place (they got
    no .grad) and moved the model's optimizer state. Without an optimizer they get gradients."""
    from torch.func import functional_call

    x = M.bag_inputs(seed=3)
    fast = fxrec.transform(M.BagList(), M.bag_inputs(), backend=backend, optimizer=fxrec.optim.Adagrad(lr=0.1))
    before = {k: v.detach().clone() for k, v in fast.state_dict().items()}
    params = {k: v.detach().clone().requires_grad_() for k, v in fast.named_parameters()}
    mine = {k: v.detach().clone() for k, v in params.items()}
    with pytest.raises(RuntimeError, match=r"given tensors that are not the model's parameters .*torch\.func\.grad"):
        functional_call(fast, params, x).sum().backward()
    for k, v in fast.state_dict().items():
        assert torch.equal(v, before[k]), k
    for k, v in params.items():
        assert torch.equal(v, mine[k]), k
    model = M.BagList()
    plain = fxrec.transform(model, M.bag_inputs(), backend=backend)
    params = {k: v.detach().clone().requires_grad_() for k, v in plain.named_parameters()}
    functional_call(plain, params, x).sum().backward()
    want = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    functional_call(model, want, x).sum().backward()
    for k, v in want.items():
        torch.testing.assert_close(params[k].grad, v.grad, msg=k)


@pytest.mark.parametrize("backend", ["auto", "fbgemm", "native", "reference"])
@pytest.mark.parametrize("fused", [False, True])
def test_torch_func_grad_over_the_transformed_model_gives_the_plain_models_gradients(backend, fused):
    """Under torch.func transforms the groups run PyTorch's own lookups, which those transforms
    differentiate (fxrec's autograd functions failed inside them, and fbgemm's binding of the
    tables); nothing is updated by a fused optimizer there, as nothing is in a functional call."""
    from torch.func import functional_call, grad

    model = M.BagList()
    x = M.bag_inputs(seed=3)
    fast = fxrec.transform(model, M.bag_inputs(), backend=backend,
                           optimizer=fxrec.optim.SGD(lr=0.1) if fused else None)
    before = {k: v.detach().clone() for k, v in fast.state_dict().items()}

    def grads(m):
        params = {k: v.detach() for k, v in m.named_parameters()}
        return grad(lambda p: functional_call(m, p, x).sin().sum())(params)

    want, got = grads(model), grads(fast)
    assert want.keys() == got.keys()
    for k in want:  # (a table with an fxrec optimizer gets its gradient sparse, as its torch.optim fallback does)
        assert got[k].is_sparse == (fused and k.startswith("bags")), k
        torch.testing.assert_close(got[k].to_dense(), want[k], rtol=1e-5, atol=1e-6, msg=k)
    for k, v in fast.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_explain_takes_every_argument_of_transform_that_shapes_the_report():
    """explain had no max_gradient= or output_dtype=, though it gives the report transform would."""
    import inspect

    built_only = {"verify", "check_passes", "rtol", "atol", "copy_model", "dump_dir", "logger", "autotune",
                  "timing_rounds", "reuse_outputs"}
    missing = set(inspect.signature(fxrec.transform).parameters) - set(inspect.signature(fxrec.explain).parameters)
    assert missing <= built_only, missing - built_only
    model, x = M.BagList(), M.bag_inputs()
    said = fxrec.explain(model, x, max_gradient=0.5).notes
    made = fxrec.transform(model, x, max_gradient=0.5).report.notes
    assert [n for n in said if "max_gradient" in n] == [n for n in made if "max_gradient" in n] != []
    with pytest.raises(ValueError, match="output_dtype is the dtype of quantized tables' lookups"):
        fxrec.explain(model, x, output_dtype="fp16")
    with pytest.raises(ValueError, match="max_gradient clamps the gradients of training"):
        fxrec.explain(model.eval(), x, mode="inference", max_gradient=0.5)
    said = fxrec.explain(model.eval(), x, mode="inference", quantize="int8", output_dtype="fp16")
    made = fxrec.transform(model.eval(), x, mode="inference", quantize="int8", output_dtype="fp16").report
    assert [g.kernel_eval for g in said.groups] == [g.kernel_eval for g in made.groups]
