"""Bags with a ``padding_idx`` on fbgemm's TBE, sum- and mean-pooled: their padding ids go to an
extra zero row of the table instead of being dropped (a mean bag's output is then rescaled to the
ids that are not padding) (dropping them waits for the device on CUDA;
fxrec/runtime/kernels/fbgemm_padding.py). Against the plain model and torch.optim, with the wait
counted as tests/test_host_syncs.py does."""

import copy

import pytest
import torch
from torch import nn

import fxrec
from fxrec.runtime._tracing import sync_free
from fxrec.testing import host_syncs


class PaddedBags(nn.Module):
    def __init__(self, b_dim=6, mode="sum"):
        super().__init__()
        self.a = nn.EmbeddingBag(40, 8, mode=mode, padding_idx=3)  # (mode: b has sample weights, so sum)
        self.b = nn.EmbeddingBag(30, b_dim, mode="sum", padding_idx=0)  # weighted: its own group; 6 is stored 8 wide
        self.c = nn.EmbeddingBag(20, 4, mode="sum")
        self.top = nn.Linear(12 + b_dim, 1)

    def forward(self, x, xo, y, yo, yw, z):
        return self.top(torch.cat([self.a(x, xo), self.b(y, yo, per_sample_weights=yw), self.c(z)], 1))


def inputs(seed):
    """Padding ids in most bags, a bag of padding ids only (bag 2 of ``a``), an empty bag (of ``b``)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 8, (24,), generator=g)
    x[::3] = 3
    x[6:9] = 3
    xo = torch.tensor([0, 3, 6, 9, 15, 20])
    y = torch.randint(0, 5, (18,), generator=g)
    y[::2] = 0
    yo = torch.tensor([0, 2, 2, 10, 12, 18])
    yw = torch.rand(18, generator=g)
    z = torch.randint(0, 20, (6, 2), generator=g)
    return x, xo, y, yo, yw, z


OPTIMIZERS = {
    "sgd": (fxrec.optim.SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    "adagrad": (fxrec.optim.Adagrad(lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1)),
    "rowwise_adagrad": (fxrec.optim.RowWiseAdagrad(lr=0.1), None),
}


def pair(opt_name, mode="sum"):
    torch.manual_seed(0)
    # fbgemm's row-wise Adagrad is not used on tables stored wider than their dim
    model = PaddedBags(b_dim=8 if opt_name == "rowwise_adagrad" else 6, mode=mode)
    ref = copy.deepcopy(model)
    cfg, torch_opt = OPTIMIZERS[opt_name]
    fast = fxrec.transform(model, inputs(0), optimizer=cfg, backend="fbgemm")
    assert all(g.kernel_train == "fbgemm" and g.fused == opt_name for g in fast.report.groups), fast.report.groups
    tables = set(fast.meta["fxrec_table_optimizers"])
    if torch_opt is None:
        from tests.test_fused_optimizers import RowWiseAdagradReference

        torch_opt = lambda p: RowWiseAdagradReference(p, lr=0.1)  # noqa: E731
    ref_opts = [torch_opt([p for n, p in ref.named_parameters() if n in tables]),
                torch.optim.SGD([p for n, p in ref.named_parameters() if n not in tables], lr=0.01)]
    return ref, ref_opts, fast, fast.make_optimizer(torch.optim.SGD, lr=0.01)


def step(model, opts, x, loss=lambda out: out.sin().sum()):
    for o in opts:
        o.zero_grad()
    out = model(*x)
    loss(out).backward()
    for o in opts:
        o.step()
    return out.detach()


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_fused_training_with_padding_ids_matches_torch_optim_and_never_moves_the_padding_row(opt_name, mode):
    ref, ref_opts, fast, opt = pair(opt_name, mode)
    pads = {"a.weight": 3, "b.weight": 0}
    before = {n: fast.state_dict()[n][i].clone() for n, i in pads.items()}
    for s in range(6):
        x = inputs(s + 1)
        torch.testing.assert_close(step(fast, [opt], x), step(ref, ref_opts, x))
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, msg=k)
    for n, i in pads.items():
        assert torch.equal(fast.state_dict()[n][i], before[n]), n
    # the TBE holds one row more than the table, which the parameter does not show
    group = next(m for name, m in fast.named_modules() if name.startswith("fxrec_group") and "a" in
                 [t.name for t in m.tables])
    assert group._bound.tbe.split_embedding_weights()[0].shape[0] == 41
    assert fast.state_dict()["a.weight"].shape == (40, 8)
    if opt_name != "sgd":
        states = opt.state_dict()["fused"]
        assert states["a.weight.sum"].shape[0] == 40


class RawBags(PaddedBags):
    def forward(self, x, xo, y, yo, yw, z):
        return torch.cat([self.a(x, xo), self.b(y, yo, per_sample_weights=yw), self.c(z)], 1)


def test_an_inf_gradient_on_a_bag_of_padding_ids_leaves_every_row_as_pytorch_does():
    """PyTorch leaves the padding ids out, so an inf gradient of a bag of only padding ids
    reaches no row. Here it reaches the zero row, which is zeroed before it is read again."""
    torch.manual_seed(0)
    ref = RawBags()
    fast = fxrec.transform(copy.deepcopy(ref), inputs(0), optimizer=fxrec.optim.SGD(lr=0.1), backend="fbgemm")
    ref_opt = torch.optim.SGD([ref.a.weight, ref.b.weight, ref.c.weight], lr=0.1)
    opt = fast.make_optimizer(torch.optim.SGD, lr=0.01)
    g = torch.zeros(6, 18)
    g[2, :8] = float("inf")  # bag 2 of feature a holds padding ids only
    x = inputs(1)
    assert bool((x[0][6:9] == 3).all())
    for model, o in ((ref, ref_opt), (fast, opt)):
        o.zero_grad()
        model(*x).backward(g)
        o.step()
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, msg=k)
    x2 = inputs(2)
    torch.testing.assert_close(fast(*x2), ref(*x2))


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_a_fused_step_with_padding_ids_reads_no_value_on_the_host(opt_name, mode):
    _, _, fast, opt = pair(opt_name, mode)
    twin = copy.deepcopy(fast)
    twin_opt = twin.make_optimizer(torch.optim.SGD, lr=0.01)
    with sync_free():
        step(fast, [opt], inputs(1))  # first call: builds the TBE and the device check
        x = inputs(2)
        with host_syncs() as syncs:
            got = step(fast, [opt], x)
    assert syncs.in_fxrec() == [], syncs.in_fxrec()
    step(twin, [twin_opt], inputs(1))
    torch.testing.assert_close(got, step(twin, [twin_opt], x), rtol=0, atol=0)
    torch.testing.assert_close(fast.state_dict(), twin.state_dict(), rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_fp32_inference_on_fbgemm_with_padding_ids_reads_no_value_and_matches_the_model(mode):
    torch.manual_seed(0)
    model = PaddedBags(mode=mode).eval()
    fast = fxrec.transform(model, inputs(0), mode="inference", backend="fbgemm")
    assert all(g.kernel_eval == "fbgemm" for g in fast.report.groups)
    x = inputs(3)
    with torch.no_grad():
        want = model(*x)
        with sync_free():
            fast(*x)
            with host_syncs() as syncs:
                got = fast(*x)
    assert syncs.in_fxrec() == [], syncs.in_fxrec()
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("create_graph", [False, True], ids=["fxrec_kernel_grads", "pytorch_op_grads"])
def test_training_with_pytorchs_gradients_sends_padding_ids_to_the_zero_row_and_gives_pytorchs_gradients(create_graph, mode):
    """fxrec's backward gives the zero row's id no gradient: the tables' and the sample weights'
    gradients are PyTorch's (from fxrec's C++ kernel, or from PyTorch ops when the gradient must
    itself be differentiable), and the step reads no value on the host."""
    torch.manual_seed(0)
    model = PaddedBags(mode=mode)
    fast = fxrec.transform(copy.deepcopy(model), inputs(0), backend="fbgemm")
    x = list(inputs(4))
    weights = []
    for m in (model, fast):
        w = x[4].clone().requires_grad_()
        m(*x[:4], w, x[5]).sin().sum().backward(create_graph=create_graph)
        weights.append(w)
    for (n, a), (_, b) in zip(model.named_parameters(), fast.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=n)
    torch.testing.assert_close(weights[1].grad, weights[0].grad)
    assert not fast.a.weight.grad[3].any() and not fast.b.weight.grad[0].any()
    with sync_free():
        fast(*x).sum().backward()
        with host_syncs() as syncs:
            fast(*inputs(5)).sum().backward()
    assert syncs.in_fxrec() == [], syncs.in_fxrec()


def test_sparse_gradients_still_leave_the_padding_ids_out():
    """PyTorch's sparse gradient of a bag has no entry for its padding ids (a lazy optimizer
    would move a row with a zero entry): those tables drop them, as before (one wait on CUDA)."""
    torch.manual_seed(0)
    model = PaddedBags()
    model.a.sparse = True
    fast = fxrec.transform(copy.deepcopy(model), inputs(0), backend="fbgemm")
    x = inputs(4)
    model(*x).sin().sum().backward()
    fast(*x).sin().sum().backward()
    want, got = model.a.weight.grad.coalesce(), fast.a.weight.grad.coalesce()
    assert torch.equal(got.indices(), want.indices()) and 3 not in got.indices()
    torch.testing.assert_close(got.values(), want.values())


class PaddedSequences(nn.Module):
    """nn.Embedding's padding ids in [B, L] sequences pooled by the model's own code."""

    def __init__(self, sparse, pool):
        super().__init__()
        self.pool = pool
        # (from_pretrained: the padding row is not zero, so a step that moves it shows)
        self.e = nn.Embedding.from_pretrained(torch.randn(30, 8), freeze=False, padding_idx=0, sparse=sparse)

    def forward(self, x):
        y = self.e(x)
        return y.sum(1) if self.pool == "sum" else y.mean(1)


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
@pytest.mark.parametrize("pool", ["sum", "mean"])
@pytest.mark.parametrize("opt_name", ["none", "lazy_adam", "partial_rowwise_adam"])
def test_sparse_gradients_of_sequences_leave_their_padding_ids_out(sparse, pool, opt_name):
    """The lookups of [B, L] sequences kept their padding ids in sparse gradients (as zero entries):
    a lazy optimizer with weight decay then moved the padding row, where PyTorch's leaves it."""
    torch.manual_seed(0)
    model = PaddedSequences(sparse, pool)
    opts = {"lazy_adam": (fxrec.optim.LazyAdam, fxrec.optim.LazyAdamTorch),
            "partial_rowwise_adam": (fxrec.optim.PartialRowWiseAdam, fxrec.optim.PartialRowWiseAdamTorch)}
    g = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, 30, (4, 3), generator=g) for _ in range(3)]
    for x in xs:
        x[:, 0] = 0
    pad = model.e.weight[0].detach().clone()
    if opt_name == "none":
        fast = fxrec.transform(copy.deepcopy(model), (xs[0],))
        model(xs[1]).sin().sum().backward()
        fast(xs[1]).sin().sum().backward()
        want, got = model.e.weight.grad, fast.e.weight.grad
        if sparse:
            want, got = want.coalesce(), got.coalesce()
            assert torch.equal(got.indices(), want.indices()) and 0 not in got.indices()
            want, got = want.values(), got.values()
        torch.testing.assert_close(got, want)
        return
    ours, theirs = opts[opt_name]
    fast = fxrec.transform(copy.deepcopy(model), (xs[0],), optimizer=ours(lr=0.1, weight_decay=0.1))
    opt = fast.make_optimizer()
    ref = theirs(model.parameters(), lr=0.1, weight_decay=0.1)
    for x in xs:
        model(x).sin().sum().backward()
        fast(x).sin().sum().backward()
        ref.step(), ref.zero_grad()
        opt.step(), opt.zero_grad()
    assert torch.equal(fast.state_dict()["e.weight"][0], pad)
    torch.testing.assert_close(fast.state_dict()["e.weight"], model.e.weight)


def test_cached_tables_keep_dropping_padding_ids_and_mean_bags_no_longer_do():
    from fxrec.runtime.kernels.fbgemm_padding import zero_row_tables
    from fxrec.runtime.specs import FeatureSpec, GroupSpec, TableSpec

    bag = FeatureSpec("f", 0, "bag", padding_idx=1)
    assert zero_row_tables(GroupSpec((TableSpec("t", 10, 4),), (bag,), "sum")) == [True]
    assert zero_row_tables(GroupSpec((TableSpec("t", 10, 4),), (bag,), "mean")) == [True]
    assert zero_row_tables(GroupSpec((TableSpec("t", 10, 4, placement="managed_caching"),), (bag,), "sum")) == [False]
    single = FeatureSpec("f", 0, "single", padding_idx=1)  # nn.Embedding: looked up, no gradient
    assert zero_row_tables(GroupSpec((TableSpec("t", 10, 4),), (single,), "sum")) == [False]


def test_a_checkpoint_of_a_model_with_zero_rows_loads_into_the_plain_model(tmp_path):
    _, _, fast, opt = pair("adagrad")
    step(fast, [opt], inputs(1))
    fxrec.checkpoint.save(fast, tmp_path / "ck", optimizer=opt)
    plain = PaddedBags()
    fxrec.checkpoint.load_into_model(plain, tmp_path / "ck")
    for (k, a), (_, b) in zip(fast.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b), k


def test_sample_weights_of_padding_ids_get_pytorchs_zero_gradient_from_the_fused_kernel():
    torch.manual_seed(0)
    model = PaddedBags()
    ref = copy.deepcopy(model)
    fast = fxrec.transform(model, inputs(0), optimizer=fxrec.optim.SGD(lr=0.1), backend="fbgemm")
    x = list(inputs(1))
    grads = []
    for m in (ref, fast):
        w = x[4].clone().requires_grad_()
        m(*x[:4], w, x[5]).sin().sum().backward()
        grads.append(w.grad)
    torch.testing.assert_close(grads[1], grads[0])
    assert not grads[1][x[2] == 0].any() and grads[1][x[2] != 0].abs().sum() > 0


class _QuantPadded(nn.Module):
    """Bags with a padding_idx, sum and mean, with include_last_offset on one."""

    def __init__(self, last_offset=True):
        super().__init__()
        self.s = nn.EmbeddingBag(40, 8, mode="sum", padding_idx=3)
        self.m = nn.EmbeddingBag(30, 8, mode="mean", padding_idx=0)
        self.ml = nn.EmbeddingBag(30, 8, mode="mean", padding_idx=2, include_last_offset=last_offset)

    def forward(self, x, xo, y, yo, z, zo):
        return torch.cat([self.s(x, xo), self.m(y, yo), self.ml(z, zo)], 1)


def _quant_inputs(seed, last_offset=True):
    """Padding ids in most bags, bags of padding alone, empty bags."""
    x, xo, y, yo, _, _ = inputs(seed)
    z = y.clone()
    z[::3] = 2
    return x, xo, y % 30, yo, z, torch.cat([yo, torch.tensor([z.numel()])]) if last_offset else yo


@pytest.mark.parametrize("last_offset", [False, True])
@pytest.mark.parametrize("quantize", ["fp32", "int8"])
def test_quantized_bags_with_padding_ids_read_no_value_and_serve_pytorchs_answer(quantize, last_offset):
    """Quantized groups keep the padding ids in place, weighing 0 (a mean: the others 1 / ids that
    are not padding), a sum-pooled lookup: no value read on the host, the TorchScript serving
    module's numbers exactly, and the plain model's (fp32 rows: to rounding; int8: to the
    quantization's error). An include_last_offset bag still has its offsets[-1] read (checked
    against its ids): that one read is all the count sees."""
    torch.manual_seed(0)
    model = _QuantPadded(last_offset).eval()
    fast = fxrec.transform(model, _quant_inputs(0, last_offset), mode="inference", quantize=quantize)
    scripted = fxrec.export.torchscript(fast)
    x = _quant_inputs(5, last_offset)
    with torch.no_grad():
        want = model(*x)
        with sync_free():
            fast(*x)
            with host_syncs() as syncs:
                got = fast(*x)
        served = scripted(*x)
    reads = [w for _, w in syncs.in_fxrec()]
    assert len(reads) == int(last_offset) and all(w.startswith("fxrec/runtime/packing.py") for w in reads), reads
    torch.testing.assert_close(served, got, rtol=0, atol=0)
    tol = dict(rtol=1e-5, atol=1e-6) if quantize == "fp32" else dict(rtol=0.05, atol=0.05)
    torch.testing.assert_close(got, want, **tol)


def test_an_inf_sample_weight_on_a_padding_id_stays_out_of_a_quantized_bag():
    class Weighted(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.EmbeddingBag(20, 8, mode="sum", padding_idx=1)

        def forward(self, ids, offs, psw):
            return self.w(ids, offs, per_sample_weights=psw)

    torch.manual_seed(0)
    model = Weighted().eval()
    ids, offs = torch.tensor([1, 4, 1, 5, 6]), torch.tensor([0, 2, 3])
    psw = torch.tensor([float("inf"), 0.5, float("nan"), 2.0, 1.0])
    fast = fxrec.transform(model, (ids, offs, psw), mode="inference", quantize="fp32")
    with torch.no_grad():
        want = model(ids, offs, psw)
        assert torch.isfinite(want).all()
        torch.testing.assert_close(fast(ids, offs, psw), want)
        torch.testing.assert_close(fxrec.export.torchscript(fast)(ids, offs, psw), want)
