"""fxrec's own CPU kernels (fxrec/csrc/pooled.cpp) against PyTorch's lookups.

The "native" path must give what the plain model gives (bit for bit for unweighted sums, whose
rows are added in the same order), name the feature on bad input, and leave the corner cases it
does not reproduce to the other paths.
"""

import copy
import os
import shutil
import subprocess
import sys

import pytest
import torch
from torch import nn

import fxrec
from fxrec.runtime.kernels import native as _native
from fxrec.runtime.kernels import native_build as _native_build
from tests import models as M
from tests.test_fused_optimizers import autograd_node_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HAVE_CXX = bool(os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++"))


@pytest.fixture
def kernel():
    """The kernels must build wherever a compiler is (a failed build is a bug, not a skip)."""
    if not HAVE_CXX:
        pytest.skip("no C++ compiler on this machine: fxrec's kernels cannot be built")
    assert _native.available(), _native.why_unavailable()


needs_kernel = pytest.mark.usefixtures("kernel")


def native(model, inputs, **kw):
    fast = fxrec.transform(model, inputs, backend="native", **kw)
    assert {g.kernel_eval for g in fast.report.groups if g.pooling != "none"} == {"native"}, fast.report
    return fast


def group_modules(fast):
    return [m for m in fast.modules() if hasattr(m, "kernel_eval") and hasattr(m, "features")]


class Bags(nn.Module):
    """One EmbeddingBag per (dim, mode) in a loop, including dims the kernel has no register
    path for (12 is not a multiple of 8; 200 is not specialised)."""

    def __init__(self, dims=(16, 32, 64, 128, 12, 200, 3), rows=37, mode="sum", **kw):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(rows, d, mode=mode, **kw) for d in dims])

    def forward(self, ids, offsets):
        return torch.cat([b(i, o) for b, i, o in zip(self.bags, ids, offsets)], 1)


def bag_lists(n, rows=37, batch=9, seed=0, max_len=5):
    g = torch.Generator().manual_seed(seed)
    lengths = [torch.randint(0, max_len + 1, (batch,), generator=g) for _ in range(n)]  # empty bags too
    ids = [torch.randint(0, rows, (int(l.sum()),), generator=g) for l in lengths]
    offs = [torch.cat([torch.zeros(1, dtype=torch.long), l.cumsum(0)[:-1]]) for l in lengths]
    return ids, offs


@needs_kernel
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_bags_of_every_dim_match_pytorch_in_inference(mode):
    model = Bags(mode=mode)
    fast = native(model, bag_lists(7))
    for seed in (1, 2):
        x = bag_lists(7, seed=seed)
        with torch.no_grad():
            got, want = fast(*x), model(*x)
        assert torch.equal(got, want)  # same rows added in the same order, then divided by the count


@needs_kernel
def test_bags_with_padding_and_mean_leave_the_padding_row_out_of_the_count():
    model = Bags(dims=(8, 12), mode="mean", padding_idx=2)
    ids, offs = bag_lists(2, seed=3)
    ids = [torch.where(i % 3 == 0, torch.full_like(i, 2), i) for i in ids]
    ids[0][: offs[0][2]] = 2  # whole bags of padding: zeros, as PyTorch gives
    fast = native(model, (ids, offs))
    with torch.no_grad():
        torch.testing.assert_close(fast(ids, offs), model(ids, offs), rtol=1e-6, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("case", ["weighted", "sequence", "fields", "fm", "shared", "bag_list"])
def test_model_styles_match_in_inference_and_training(case):
    """Inference on the native kernel; training on its forward with fxrec's gradients."""
    model, inputs = {
        "weighted": (M.WeightedBags(), lambda s: M.weighted_inputs(seed=s)),
        "sequence": (M.SequenceMean(), lambda s: M.seq_inputs(seed=s)),
        "fields": (M.FieldDict(), lambda s: M.field_inputs(seed=s)),
        "fm": (M.OffsetFM(), lambda s: M.fm_inputs(seed=s)),
        "shared": (M.SharedTables(), lambda s: M.shared_inputs(seed=s)),
        "bag_list": (M.BagList(), lambda s: M.bag_inputs(seed=s)),
    }[case]
    fast = native(model, inputs(0))
    x = inputs(1)
    with torch.no_grad():
        torch.testing.assert_close(fast(*x), model(*x), rtol=1e-6, atol=1e-6)
    ref_out = model(*x)
    out = fast(*x)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    cot = torch.randn_like(out)
    (out * cot).sum().backward()
    (ref_out * cot).sum().backward()
    for (name, p), q in zip(fast.named_parameters(), model.parameters()):
        a, b = p.grad, q.grad
        if a is None or b is None:
            assert a is None and b is None, name
            continue
        torch.testing.assert_close(a.to_dense(), b.to_dense(), rtol=1e-5, atol=1e-6, msg=name)


@needs_kernel
def test_include_last_offset_ignores_ids_after_the_last_offset():
    bag = nn.EmbeddingBag(20, 8, mode="sum", include_last_offset=True)
    model = Bags(dims=(8,))
    model.bags[0] = bag
    ids = [torch.tensor([1, 2, 3, 4, 5, 19, 18])]
    offs = [torch.tensor([0, 2, 2, 5])]  # 3 bags; ids 19, 18 are past the last offset
    fast = native(model, (ids, offs))
    with torch.no_grad():
        assert torch.equal(fast(ids, offs), model(ids, offs))


@needs_kernel
def test_int32_ids_and_offsets_and_one_thread_give_the_same_answer():
    model = Bags(dims=(16, 12))
    ids, offs = bag_lists(2, seed=4)
    fast = native(model, (ids, offs))
    with torch.no_grad():
        want = model(ids, offs)
        assert torch.equal(fast([i.int() for i in ids], [o.int() for o in offs]), want)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert torch.equal(fast(ids, offs), want)
        finally:
            torch.set_num_threads(threads)


@needs_kernel
def test_reused_output_is_not_overwritten_while_the_caller_holds_it():
    model = Bags(dims=(16, 32))
    fast = native(model, bag_lists(2))
    with torch.no_grad():
        a = fast(*bag_lists(2, seed=1))
        a_copy = a.clone()
        b = fast(*bag_lists(2, seed=2))
        assert a.data_ptr() != b.data_ptr()
        assert torch.equal(a, a_copy)
        del a
        c = fast(*bag_lists(2, seed=3))
        assert torch.equal(c, model(*bag_lists(2, seed=3)))


@needs_kernel
@pytest.mark.parametrize("bad,match", [
    ("big_id", r"feature 'ids_1'.*table 'bags\.1'"),
    ("negative_id", r"feature 'ids_0'.*table 'bags\.0'"),
    ("offsets_not_from_zero", r"ids_0|bags\.0"),
    ("decreasing_offsets", r"ids_1|bags\.1"),
])
def test_bad_input_names_the_feature_and_table(bad, match):
    model = Bags(dims=(16, 32))
    ids, offs = bag_lists(2, seed=5, max_len=3)
    fast = native(model, (ids, offs))
    ids = [i.clone() for i in ids]
    offs = [o.clone() for o in offs]
    if bad == "big_id":
        ids[1][0] = 37
    elif bad == "negative_id":
        ids[0][-1] = -1
    elif bad == "offsets_not_from_zero":
        offs[0][0] = 1
    else:
        ids[1] = torch.arange(10) % 37
        offs[1] = torch.tensor([0, 5, 2, 6, 7, 8, 8, 9, 9])
    with torch.no_grad(), pytest.raises((IndexError, ValueError, RuntimeError), match=match):
        fast(ids, offs)
    with pytest.raises((IndexError, ValueError, RuntimeError), match=match):
        fast(ids, offs)


@needs_kernel
def test_corner_cases_it_does_not_reproduce_fall_back_to_pytorch():
    """An empty batch, features with different batch sizes and a mean over no ids are left to
    PyTorch's own kernels (exact empty / NaN results)."""
    model = M.SequenceMean()
    fast = native(model, M.seq_inputs())
    hist, query, seq = M.seq_inputs(seed=1)
    with torch.no_grad():
        e = [hist[:0], query[:0], seq[:0]]
        assert fast(*e).shape == model(*e).shape == (0, 24)
        empty_len = [hist[:, :0], query, seq]
        torch.testing.assert_close(fast(*empty_len), model(*empty_len), equal_nan=True)
    bags = Bags(dims=(16, 16))
    fb = native(bags, bag_lists(2))
    ids, offs = bag_lists(2, seed=2)
    ids[1], offs[1] = ids[1][:3], torch.tensor([0, 1, 2])  # 3 bags beside 9
    with torch.no_grad(), pytest.raises(Exception):
        bags(ids, offs)
    with torch.no_grad(), pytest.raises(Exception):
        fb(ids, offs)


@needs_kernel
def test_the_rule_runs_pooled_groups_on_the_native_kernel_and_says_so():
    fast = fxrec.transform(Bags(dims=(16, 32)), bag_lists(2))
    g = fast.report.groups[0]
    assert (g.kernel_train, g.kernel_eval, g.decided_by) == ("native", "native", "rule") and "native" in g.why


@needs_kernel
def test_fused_sgd_on_the_native_kernels_never_makes_a_gradient():
    model = Bags(dims=(16, 12))
    fast = fxrec.transform(model, bag_lists(2), backend="native", optimizer=fxrec.optim.SGD(lr=0.5))
    out = fast(*bag_lists(2, seed=1))
    assert "NativeFusedFunctionBackward" in autograd_node_names(out)
    before = [p.detach().clone() for p in fast.parameters()]
    out.sum().backward()
    assert all(p.grad is None for p in fast.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(before, fast.parameters()))


def test_without_the_kernel_backend_native_runs_the_plain_lookups_and_says_why():
    code = (
        "import torch, fxrec\n"
        "from tests.test_native import Bags, bag_lists\n"
        "from fxrec.runtime.kernels import native as _native\n"
        "assert not _native.available() and 'FXREC_NATIVE=0' in _native.why_unavailable()\n"
        "m = Bags(dims=(16, 32))\n"
        "f = fxrec.transform(m, bag_lists(2), backend='native', optimizer=fxrec.optim.SGD(lr=0.1))\n"
        "g = f.report.groups[0]\n"
        "assert 'not native: ' in g.why and 'FXREC_NATIVE=0' in g.why, g.why\n"
        "assert g.kernel_train == 'reference', g\n"
        "x = bag_lists(2, seed=1)\n"
        "with torch.no_grad():\n"
        "    assert torch.equal(f(*x), m(*x))\n"
        "a = fxrec.transform(m, bag_lists(2)).report.groups[0]\n"
        "assert a.kernel_train == 'reference' and 'not available' in a.why, a\n"
        "print('ok')\n"
    )
    env = dict(os.environ, FXREC_NATIVE="0")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_a_failed_build_is_reported_not_raised(tmp_path):
    """A compiler that fails leaves the kernels unavailable with the compiler's words."""
    fake = tmp_path / "g++"
    fake.write_text("#!/bin/sh\necho 'no compiler here' >&2\nexit 1\n")
    fake.chmod(0o755)
    code = (
        "from fxrec.runtime.kernels import native as _native\n"
        "assert not _native.available()\n"
        "print(_native.why_unavailable())\n"
    )
    env = dict(os.environ, CXX=str(fake), TORCH_EXTENSIONS_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "building fxrec's kernels failed" in r.stdout and "no compiler here" in r.stdout


@needs_kernel
def test_kernel_weights_are_checked():
    out = torch.empty(2, 4)
    with pytest.raises(RuntimeError, match="contiguous 2-D float32"):
        _native.ops().pooled_forward(out, [torch.zeros(5, 4, dtype=torch.float64)], [0], [torch.tensor([0, 1])],
                                     [torch.tensor([0, 1])], [None], [0], [-1], [0], 0)


def sgd_pair(lr=0.1):
    model = Bags(dims=(16, 12))
    fast = fxrec.transform(model, bag_lists(2), backend="native", optimizer=fxrec.optim.SGD(lr=lr))
    ref = copy.deepcopy(model)
    return model, fast, fast.make_optimizer(), ref, torch.optim.SGD(ref.parameters(), lr=lr)


@needs_kernel
def test_ids_changed_in_place_before_backward_raise_as_pytorch_does():
    _, fast, _, ref, _ = sgd_pair()
    for m in (ref, fast):
        ids, offs = bag_lists(2, seed=1)
        out = m(ids, offs)
        ids[0].fill_(0)  # e.g. a reused input buffer refilled before backward
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


@needs_kernel
@pytest.mark.parametrize("between", ["optimizer_state_dict", "eval_forward_on_fbgemm"])
def test_update_lands_when_the_tables_are_rebound_between_forward_and_backward(between):
    """Binding the group to fbgemm's buffer (opt.state_dict(), an eval forward on fbgemm)
    moves the parameters' storage; the fused update must follow it."""
    _, fast, opt, ref, ref_opt = sgd_pair()
    for g in group_modules(fast):
        g.set_kernels(g.kernel_train, "fbgemm")
    for step in range(3):
        x = bag_lists(2, seed=step + 1)
        out = fast(*x)
        if between == "optimizer_state_dict":
            opt.state_dict()
        else:
            with torch.no_grad():
                fast(*bag_lists(2, seed=9))
        out.sin().sum().backward()
        opt.step()
        ref_opt.zero_grad()
        ref(*x).sin().sum().backward()
        ref_opt.step()
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=k)


@needs_kernel
def test_per_sample_weights_of_another_shape_are_refused_as_pytorch_does():
    model = M.WeightedBags()
    x = list(M.weighted_inputs())
    fast = native(model, tuple(x))
    x[2] = x[2].view(-1, 1)  # 9 weights for 9 ids, but [9, 1]
    with torch.no_grad():
        with pytest.raises(Exception, match="per_sample_weights"):
            model(*x)
        with pytest.raises(ValueError, match=r"input psw1 \(per-sample weights of feature 'ids1', table 'w1'\) "
                                             r"has 2 dims \(shape \(9, 1\)\); the model was captured with 1"):
            fast(*x)


@needs_kernel
@pytest.mark.parametrize("backend", ["fbgemm", "reference", "native"])
def test_dense_gradients_come_from_the_kernel_and_match_pytorch(backend):
    """Without a fused optimizer every path's backward gives dense tables their gradient by
    fxrec's kernel; a group with a sparse table keeps the gathered rows."""
    from fxrec.runtime.kernels.native import dense_grads_by_kernel as _dense_grads_by_kernel

    model = M.SequenceMean()  # padding row in a mean, a sum, and an unpooled sequence group
    fast = fxrec.transform(model, M.seq_inputs(), backend=backend)
    pooled = [g for g in group_modules(fast) if g.pooling != "none"]
    with torch.no_grad():  # as in backward without create_graph
        assert pooled and all(_dense_grads_by_kernel(g, torch.zeros(2, sum(g.dims)), [True] * len(g.tables))
                              for g in pooled)
    x = M.seq_inputs(seed=3)
    cot = torch.randn(5, 24)
    (fast(*x) * cot).sum().backward()
    (model(*x) * cot).sum().backward()
    for (name, p), q in zip(fast.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert torch.count_nonzero(fast.get_parameter("hist.weight").grad[0]) == 0  # padding row

    sparse = nn.ModuleDict({"a": nn.EmbeddingBag(20, 8, sparse=True), "b": nn.EmbeddingBag(20, 8)})
    g = group_modules(fxrec.transform(_TwoBags(sparse), (torch.tensor([1, 2]), torch.tensor([0, 1])), backend="fbgemm"))[0]
    with torch.no_grad():
        assert not _dense_grads_by_kernel(g, torch.zeros(2, 16), [True, True])


class _TwoBags(nn.Module):
    def __init__(self, bags):
        super().__init__()
        self.bags = bags

    def forward(self, ids, offsets):
        return torch.cat([self.bags["a"](ids, offsets), self.bags["b"](ids, offsets)], 1)


class _PooledByHand(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(20, 8, padding_idx=0)
        self.s = nn.Embedding(30, 8)
        self.frozen = nn.Embedding(10, 8)

    def forward(self, x, y):
        return torch.cat([self.e(x).sum(1), self.s(y), self.frozen(y % 10)], 1)


@pytest.mark.parametrize("backend", ["fbgemm", "native"])
def test_second_order_gradients_match_pytorch(backend):
    """backward(create_graph=True) (a gradient penalty) needs differentiable gradients: the
    kernel is not used there."""
    model = _PooledByHand()  # every table trains: the kernel's case in first-order backward
    x = (torch.randint(0, 20, (4, 3)), torch.randint(0, 30, (4,)))
    fast = fxrec.transform(model, x, backend=backend)
    for m in (model, fast):
        out = m(*x)
        loss = (out.sin() * torch.arange(out.numel()).view_as(out).cos()).sum()  # g depends on W
        (g,) = torch.autograd.grad(loss, [m.get_parameter("e.weight")], create_graph=True)
        (loss + 0.1 * g.pow(2).sum()).backward()
    torch.testing.assert_close(fast.get_parameter("e.weight").grad, model.e.weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("frozen", [False, True])
def test_padding_row_gets_zero_gradient_even_from_inf(frozen):
    """The kernel skips the padding row; the gathered-rows route (a frozen table in the group)
    must give exactly zero too, not 0 * inf = NaN."""
    model = _PooledByHand()
    model.frozen.weight.requires_grad_(not frozen)
    x = (torch.tensor([[0, 3, 0], [5, 0, 2]]), torch.tensor([1, 2]))
    fast = fxrec.transform(model, x, backend="fbgemm")
    cot = torch.ones(2, 24)
    cot[0, 0] = float("inf")
    for m in (model, fast):
        (m(*x) * cot).sum().backward()
    assert torch.equal(fast.get_parameter("e.weight").grad[0], torch.zeros(8))
    assert torch.equal(model.e.weight.grad[0], torch.zeros(8))


# Tables stored padded (fbgemm's TBE keeps odd dims padded to a multiple of 4): the kernels take
# the user's parameter as the view padded[:, :dim] (rows strided, columns contiguous), and an
# element-wise Adagrad state as the same kind of view of a [rows, pad_dim] buffer.

STRIDED = [(1, 4), (3, 4), (5, 8), (7, 8), (10, 12), (13, 16), (3, 16), (16, 24), (32, 48), (12, 16)]
SENTINEL = 123.0


def padded_views(seed, rows=23, layouts=STRIDED, fill=SENTINEL):
    """Per (dim, pad): a [rows, pad] buffer of `fill` whose first dim columns are random, and
    its [:, :dim] view."""
    g = torch.Generator().manual_seed(seed)
    bufs = []
    for d, pad in layouts:
        buf = torch.full((rows, pad), fill)
        buf[:, :d] = torch.randn(rows, d, generator=g)
        bufs.append(buf)
    return bufs, [b[:, :d] for b, (d, _) in zip(bufs, layouts)]


def every_form(n_tables, rows=23, batch=6, seed=0, psw=False):
    """Per table four features: a bag with offsets (empty bags, a padding row), a [B, 3] bag, a
    [B, 4] pooled_seq and a single id; the kernels' per-feature arguments."""
    g = torch.Generator().manual_seed(seed)
    tof, ids, offs, w, last, pad, form = [], [], [], [], [], [], []
    for t in range(n_tables):
        lengths = torch.randint(0, 5, (batch,), generator=g)
        bag_ids = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
        cases = [
            (bag_ids, torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]]), 2, 0),
            (torch.randint(0, rows, (batch, 3), generator=g), None, -1, 0),
            (torch.randint(0, rows, (batch, 4), generator=g), None, -1, 1),
            (torch.randint(0, rows, (batch,), generator=g), None, -1, 2),
        ]
        for i, o, p, k in cases:
            tof.append(t)
            ids.append(i)
            offs.append(o)
            w.append(torch.rand(i.numel(), generator=g) if psw else None)
            last.append(0)
            pad.append(p)
            form.append(k)
    return tof, ids, offs, w, last, pad, form


def assert_padding_untouched(bufs, layouts=STRIDED, fill=SENTINEL):
    for b, (d, _) in zip(bufs, layouts):
        assert torch.equal(b[:, d:], torch.full_like(b[:, d:], fill)), (d, b.shape)


@needs_kernel
def test_padded_views_are_strided_as_fbgemm_will_store_them():
    bufs, views = padded_views(0)
    for v, (d, pad) in zip(views, STRIDED):
        assert v.stride() == (pad, 1) and not v.is_contiguous()
        assert _native._rows_contiguous(v)
    assert not _native._rows_contiguous(torch.zeros(4, 6).t())  # columns strided
    assert not _native._rows_contiguous(torch.zeros(4, 6)[:, ::2])
    assert not _native._rows_contiguous(torch.zeros(1, 4).expand(5, 4))  # rows overlap


@needs_kernel
@pytest.mark.parametrize("mean,psw", [(0, False), (1, False), (0, True)])
def test_forward_on_row_strided_tables_is_bitwise_the_forward_on_contiguous_copies(mean, psw):
    bufs, views = padded_views(1)
    copies = [v.contiguous() for v in views]
    tof, ids, offs, w, last, pad, form = every_form(len(views), seed=2, psw=psw)
    total = sum(STRIDED[t][0] for t in tof)
    got, want = torch.full((6, total), -1.0), torch.full((6, total), -2.0)
    _native.ops().pooled_forward(got, views, tof, ids, offs, w, last, pad, form, mean)
    _native.ops().pooled_forward(want, copies, tof, ids, offs, w, last, pad, form, mean)
    assert torch.equal(got, want)
    assert_padding_untouched(bufs)
    if not mean and not psw:  # and PyTorch's own sum of the same rows, in the same order
        cols, col = [], 0
        for t, i, o, p, k in zip(tof, ids, offs, pad, form):
            d = STRIDED[t][0]
            if o is not None:
                ref = torch.nn.functional.embedding_bag(i, copies[t], o, mode="sum", padding_idx=p)
            elif k == 2:
                ref = copies[t][i]
            else:
                ref = torch.nn.functional.embedding_bag(i, copies[t], mode="sum") if k == 0 else copies[t][i].sum(1)
            assert torch.equal(got[:, col : col + d], ref), (t, k)
            col += d


@needs_kernel
def test_forward_threads_see_the_same_strided_rows():
    """One thread and many (the bags split over threads) read the same rows."""
    bufs, views = padded_views(3, rows=50)
    tof, ids, offs, w, last, pad, form = every_form(len(views), rows=50, batch=300, seed=4)
    total = sum(STRIDED[t][0] for t in tof)
    outs = []
    threads = torch.get_num_threads()
    for n in (1, max(2, threads)):
        torch.set_num_threads(n)
        try:
            out = torch.empty(300, total)
            _native.ops().pooled_forward(out, views, tof, ids, offs, w, last, pad, form, 0)
            outs.append(out)
        finally:
            torch.set_num_threads(threads)
    want = torch.empty(300, total)
    _native.ops().pooled_forward(want, [v.contiguous() for v in views], tof, ids, offs, w, last, pad, form, 0)
    assert torch.equal(outs[0], want) and torch.equal(outs[1], want)
    assert_padding_untouched(bufs)


@needs_kernel
@pytest.mark.parametrize("mean,psw", [(0, False), (1, False), (0, True)])
def test_sgd_update_on_row_strided_tables_is_bitwise_the_update_of_contiguous_copies(mean, psw):
    bufs, views = padded_views(5)
    copies = [v.contiguous() for v in views]
    before = [b.clone() for b in bufs]
    tof, ids, offs, w, last, pad, form = every_form(len(views), seed=6, psw=psw)
    grad_out = torch.randn(6, sum(STRIDED[t][0] for t in tof), generator=torch.Generator().manual_seed(7))
    update = [int(t != 2) for t in range(len(views))]  # table 2 frozen
    _native.ops().sgd_update(views, grad_out, 0.25, update, tof, ids, offs, w, last, pad, form, mean)
    _native.ops().sgd_update(copies, grad_out, 0.25, update, tof, ids, offs, w, last, pad, form, mean)
    for t, (v, c) in enumerate(zip(views, copies)):
        assert torch.equal(v, c), t
        assert torch.equal(v, before[t][:, : STRIDED[t][0]]) == (not update[t]), t
    assert_padding_untouched(bufs)


@needs_kernel
def test_dense_gradient_into_row_strided_zeros_is_the_gradient_into_contiguous_zeros():
    """sgd_update with lr = -1 on zeros (fxrec's dense gradients) on padded zeros."""
    bufs, views = padded_views(8, fill=0.0)
    for v in views:
        v.zero_()
    copies = [v.contiguous() for v in views]
    tof, ids, offs, w, last, pad, form = every_form(len(views), seed=9, psw=True)
    grad_out = torch.randn(6, sum(STRIDED[t][0] for t in tof), generator=torch.Generator().manual_seed(10))
    update = [1] * len(views)
    _native.ops().sgd_update(views, grad_out, -1.0, update, tof, ids, offs, w, last, pad, form, 0)
    _native.ops().sgd_update(copies, grad_out, -1.0, update, tof, ids, offs, w, last, pad, form, 0)
    assert all(torch.equal(v, c) for v, c in zip(views, copies))
    assert any(torch.count_nonzero(v) for v in views)
    assert_padding_untouched(bufs, fill=0.0)


@needs_kernel
@pytest.mark.parametrize("state_layout", ["contiguous_2d", "flat"])
@pytest.mark.parametrize("mean,psw", [(0, False), (1, False), (0, True)])
def test_adagrad_on_row_strided_tables_and_states_is_bitwise_the_update_of_contiguous_copies(mean, psw,
                                                                                            state_layout):
    bufs, views = padded_views(11)
    sbufs, states = padded_views(12)
    for s in states:
        s.copy_(s.abs())  # a sum of squares
    copies = [v.contiguous() for v in views]
    s_copies = [s.contiguous() if state_layout == "contiguous_2d" else s.contiguous().view(-1) for s in states]
    tof, ids, offs, w, last, pad, form = every_form(len(views), seed=13, psw=psw)
    grad_out = torch.randn(6, sum(STRIDED[t][0] for t in tof), generator=torch.Generator().manual_seed(14))
    update = [int(t != 3) for t in range(len(views))]
    for ws, ss in ((views, states), (copies, s_copies)):
        _native.ops().adagrad_update(ws, ss, grad_out, 0.1, 1e-8, 0, 0.0, 0, 0.0, update, tof, ids, offs, w, last, pad, form,
                                     mean)
    for t in range(len(views)):
        assert torch.equal(views[t], copies[t]), t
        assert torch.equal(states[t], s_copies[t].view_as(states[t])), t
    assert_padding_untouched(bufs)
    assert_padding_untouched(sbufs)


@needs_kernel
@pytest.mark.parametrize("mean,psw", [(0, False), (1, False), (0, True)])
def test_rowwise_adagrad_on_row_strided_tables_is_bitwise_the_update_of_contiguous_copies(mean, psw):
    bufs, views = padded_views(15)
    g = torch.Generator().manual_seed(16)
    states = [torch.rand(v.shape[0], generator=g) for v in views]
    copies = [v.contiguous() for v in views]
    s_copies = [s.clone() for s in states]
    frozen = (views[0].clone(), states[0].clone())
    tof, ids, offs, w, last, pad, form = every_form(len(views), seed=17, psw=psw)
    grad_out = torch.randn(6, sum(STRIDED[t][0] for t in tof), generator=g)
    update = [int(t != 0) for t in range(len(views))]
    for ws, ss in ((views, states), (copies, s_copies)):
        _native.ops().adagrad_update(ws, ss, grad_out, 0.1, 1e-8, 1, 0.0, 0, 0.0, update, tof, ids, offs, w, last, pad, form,
                                     mean)
    for t in range(len(views)):
        assert torch.equal(views[t], copies[t]) and torch.equal(states[t], s_copies[t]), t
    assert torch.equal(views[0], frozen[0]) and torch.equal(states[0], frozen[1])  # not updated
    assert_padding_untouched(bufs)


@needs_kernel
def test_rowwise_adagrad_on_a_padded_table_averages_over_the_real_dim():
    """state += mean over the dim of g*g: the view's dim, not the padded width."""
    layouts = [(3, 4), (5, 8), (13, 16), (10, 16)]
    bufs, views = padded_views(18, rows=12, layouts=layouts)
    g = torch.Generator().manual_seed(19)
    ids = [torch.randperm(12, generator=g)[:5] for _ in layouts]  # one lookup per row: g is grad_out's row
    states = [torch.rand(12, generator=g) for _ in layouts]
    grad_out = torch.randn(5, sum(d for d, _ in layouts), generator=g)
    want_w, want_s, col = [], [], 0
    for v, s, i, (d, _) in zip(views, states, ids, layouts):
        gr = grad_out[:, col : col + d]
        ws, ss = v.clone(), s.clone()
        ss[i] += (gr * gr).mean(1)
        ws[i] -= (0.1 / (ss[i].sqrt() + 1e-8))[:, None] * gr
        want_w.append(ws)
        want_s.append(ss)
        col += d
    n = len(layouts)
    _native.ops().adagrad_update(views, states, grad_out, 0.1, 1e-8, 1, 0.0, 0, 0.0, [1] * n, list(range(n)), ids, [None] * n,
                                 [None] * n, [0] * n, [-1] * n, [2] * n, 0)
    for t in range(n):
        torch.testing.assert_close(states[t], want_s[t], rtol=1e-6, atol=0)
        torch.testing.assert_close(views[t], want_w[t], rtol=1e-6, atol=1e-7)
    assert_padding_untouched(bufs, layouts)


@needs_kernel
def test_kernels_refuse_tables_and_states_whose_rows_are_not_contiguous():
    out = torch.empty(2, 4)
    args = ([0], [torch.tensor([0, 1])], [torch.tensor([0, 1])], [None], [0], [-1], [0], 0)
    for bad in (torch.zeros(8, 5).t()[:, :4], torch.zeros(5, 8)[:, ::2], torch.zeros(1, 4).expand(5, 4)):
        with pytest.raises(RuntimeError, match="row-contiguous 2-D float32"):
            _native.ops().pooled_forward(out, [bad], *args)
    w = torch.zeros(5, 4)
    feats = ([1], [0], [torch.tensor([0, 1])], [torch.tensor([0, 1])], [None], [0], [-1], [0], 0)
    for state in (torch.zeros(5, 8)[:, ::2], torch.zeros(5, 8), torch.zeros(5, 8)[:, :3], torch.zeros(4, 4)):
        with pytest.raises(RuntimeError, match="Adagrad state of table 0"):
            _native.ops().adagrad_update([w], [state], out, 0.1, 1e-8, 0, 0.0, 0, 0.0, *feats)
    with pytest.raises(RuntimeError, match="Adagrad state of table 0"):
        _native.ops().adagrad_update([w], [torch.zeros(5, 2)[:, 0]], out, 0.1, 1e-8, 1, 0.0, 0, 0.0, *feats)


@needs_kernel
def test_a_group_takes_row_strided_parameters_on_the_native_kernel():
    """native_call takes padded[:, :dim] parameters as they are: the forward reads them in
    place and a fused SGD's backward updates them in the padded buffer."""
    layouts = [(3, 4), (5, 8), (16, 20)]
    model = Bags(dims=[d for d, _ in layouts])
    fast = fxrec.transform(model, bag_lists(3), backend="native", optimizer=fxrec.optim.SGD(lr=0.5))
    (group,) = group_modules(fast)
    bufs, views = padded_views(20, rows=37, layouts=layouts)
    params = [nn.Parameter(v) for v in views]
    assert all(p.data_ptr() == v.data_ptr() and p.stride() == v.stride() for p, v in zip(params, views))
    copies = [nn.Parameter(v.detach().clone()) for v in views]
    before = [v.clone() for v in views]
    ids, offs = bag_lists(3, seed=21)
    assert _native.native_call(group, ids, offs, [None] * 3, params) is not None
    with torch.no_grad():
        assert torch.equal(group(ids, offs, [None] * 3, params), group(ids, offs, [None] * 3, copies))
    outs = [group(ids, offs, [None] * 3, ps) for ps in (params, copies)]
    assert all("NativeFusedFunctionBackward" in autograd_node_names(o) for o in outs)
    cot = torch.randn_like(outs[0])
    for o in outs:
        (o * cot).sum().backward()
    for p, c, v, b in zip(params, copies, views, before):
        assert p.grad is None and torch.equal(v, c.detach()) and not torch.equal(v, b)
    assert_padding_untouched(bufs, layouts)


def test_the_extensions_name_differs_between_checkouts_and_torch_installs(monkeypatch):
    """Two checkouts (or environments) on one machine shared one extension name, and torch rebuilt
    the library (~10 s) each time use passed between them: the name now carries the source's path
    and torch's as well as the CPU's features, and stays the same for the same ones."""
    here = _native_build._build_tag()
    assert here == _native_build._build_tag()
    monkeypatch.setattr(_native_build, "_SOURCE", "/elsewhere/fxrec/csrc/pooled.cpp")
    elsewhere = _native_build._build_tag()
    monkeypatch.setattr(torch, "__file__", "/another/env/torch/__init__.py")
    assert len({here, elsewhere, _native_build._build_tag()}) == 3


@needs_kernel
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_the_list_level_reading_of_a_call_is_the_feature_by_feature_one_or_steps_aside(mode):
    """native_call reads a group of plain bags (no padding_idx, no include_last_offset) at once
    (_plain_call): where it answers, the call is the one _call_by_feature makes (the same ids,
    offsets, tables and per-feature arguments); where the inputs are anything else it steps
    aside (None) and the feature-by-feature reading answers, as it always did."""
    model = Bags(dims=(16, 8, 12), mode=mode)
    fast = fxrec.transform(model, bag_lists(3), backend="native", mode="inference")
    (group,) = group_modules(fast)
    assert group._plain_bags and group._table_of == [0, 1, 2]
    params = [fast.get_parameter(f"bags.{i}.weight") for i in range(3)]
    ids, offs = bag_lists(3, seed=4)
    fields = ("table_of_feature", "include_last", "padding", "form", "mean", "batch")
    quick, slow = (f(group, ids, offs, [None] * 3, params) for f in (_native._plain_call, _native._call_by_feature))
    assert quick is not None and all(getattr(quick, k) == getattr(slow, k) for k in fields), (quick, slow)
    assert all(a is b for a, b in zip(quick.ids, slow.ids)) and all(a is b for a, b in zip(quick.offsets, slow.offsets))
    assert quick.psw == slow.psw == [None] * 3
    assert all(torch.equal(a, b) and a.data_ptr() == b.data_ptr() for a, b in zip(quick.weights, slow.weights))
    with torch.no_grad():
        torch.testing.assert_close(fast(ids, offs), model(ids, offs), rtol=1e-6, atol=1e-6)
    other = {
        "int32 ids": ([i.int() for i in ids], offs),
        "int32 offsets": (ids, [o.int() for o in offs]),
        "strided ids": ([torch.stack([i, i], 1)[:, 0] for i in ids], offs),
        "batch sizes that differ": (ids, offs[:2] + [offs[2][:-1]]),
        "an empty batch": ([i[:0] for i in ids], [o[:0] for o in offs]),
        "[B, L] ids": ([torch.randint(0, 37, (9, 2)) for _ in range(3)], [None] * 3),
    }
    for what, (i, o) in other.items():
        assert _native._plain_call(group, i, o, [None] * 3, params) is None, what
        if what in ("batch sizes that differ", "[B, L] ids"):
            continue  # (the model's input guards refuse them before any kernel)
        with torch.no_grad():  # (the model's answer: through the other reading, or another kernel)
            torch.testing.assert_close(fast(i, o), model(i, o), rtol=1e-6, atol=1e-6, msg=what)
    weighted = [torch.rand(i.shape) for i in ids]
    assert _native._plain_call(group, ids, offs, weighted, params) is None
    padded = [torch.zeros(37, 24)[:, :d].copy_(p.detach()) for p, d in zip(params, (16, 8, 12))]
    assert _native._plain_call(group, ids, offs, [None] * 3, padded) is None
    assert _native.native_call(group, ids, offs, [None] * 3, padded) is not None
    for kw in (dict(padding_idx=0), dict(include_last_offset=True)):
        assert not group_modules(fxrec.transform(Bags(dims=(8, 8), **kw), bag_lists(2), backend="native"))[0]._plain_bags
