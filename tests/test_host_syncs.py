"""The CUDA path waits for the device nowhere in fxrec's code (issue 15, proved on CPU).

Under :class:`fxrec.runtime._tracing.sync_free` the groups run on CPU exactly as they do on CUDA
(no tensor value read on the host: checks on the device, reported later), and
:func:`fxrec.testing.host_syncs` records every operation that would make a CUDA host wait (value
reads, value-sized outputs, tensors made from Python numbers). A training step and a quantized
inference call on ``backend="fbgemm"`` must record none in fxrec's code, and still give the plain
model's numbers; bad ids must still raise the error that names the feature.
"""

import copy

import pytest
import torch

import fxrec
from fxrec.runtime._tracing import sync_free
from fxrec.testing import host_syncs
from tests import models as M

CASES = {
    "bags": (M.BagList, M.bag_inputs),
    "fields": (M.FieldDict, M.field_inputs),
    "fm": (M.OffsetFM, M.fm_inputs),
    "shared": (M.SharedTables, M.shared_inputs),
}
OPTIMIZERS = {
    "none": lambda: None,  # PyTorch's gradients (fxrec's backward)
    "sgd": lambda: fxrec.optim.SGD(lr=0.1),
    "adagrad": lambda: fxrec.optim.Adagrad(lr=0.1),
    "rowwise_adagrad": lambda: fxrec.optim.RowWiseAdagrad(lr=0.1),
}


def _step(model, x):
    out = model(*x)
    out.sum().backward()
    return out.detach()


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_training_step_on_fbgemm_reads_no_value_on_the_host(case, opt):
    make, inputs = CASES[case]
    torch.manual_seed(0)
    model = make()
    plain = copy.deepcopy(model)
    fast = fxrec.transform(model, inputs(), optimizer=OPTIMIZERS[opt](), backend="fbgemm")
    with sync_free():
        _step(fast, inputs(seed=1))  # first call: builds the TBE and the device check
        x = inputs(seed=2)
        with host_syncs() as syncs:
            got = _step(fast, x)
    assert syncs.in_fxrec() == [], syncs.in_fxrec()
    # the same numbers (outputs, updated tables, gradients) as ordinary calls of a twin transformed alike
    twin = fxrec.transform(plain, inputs(), optimizer=OPTIMIZERS[opt](), backend="fbgemm")
    _step(twin, inputs(seed=1))
    torch.testing.assert_close(got, _step(twin, x), rtol=0, atol=0)
    torch.testing.assert_close(fast.state_dict(), twin.state_dict(), rtol=0, atol=0)
    grads = lambda m: {n: p.grad for n, p in m.named_parameters() if p.grad is not None}  # noqa: E731
    assert grads(fast).keys() == grads(twin).keys() and (grads(fast) or opt != "none")
    torch.testing.assert_close(grads(fast), grads(twin), rtol=0, atol=0)


@pytest.mark.parametrize("case", sorted(CASES) + ["sequence"])
def test_a_quantized_inference_call_reads_no_value_on_the_host(case):
    make, inputs = dict(CASES, sequence=(M.SequenceMean, M.seq_inputs))[case]
    model = make().eval()
    fast = fxrec.transform(model, inputs(), mode="inference", quantize="int8")
    x = inputs(seed=3)
    with torch.no_grad():
        want = fast(*x)
        with sync_free():
            fast(*x)
            with host_syncs() as syncs:
                got = fast(*x)
    assert syncs.in_fxrec() == [], syncs.in_fxrec()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_count_sees_what_an_ordinary_cpu_call_reads():
    """Without sync_free the CPU groups check ids by reading them (free on CPU): the count sees it,
    so a zero above is not the count failing to look."""
    model = M.BagList()
    fast = fxrec.transform(model, M.bag_inputs(), optimizer=fxrec.optim.SGD(lr=0.1), backend="fbgemm")
    with host_syncs() as syncs:
        _step(fast, M.bag_inputs(seed=1))
    kinds = {what for what, _ in syncs.in_fxrec()}
    assert "aten::_local_scalar_dense" in kinds, syncs.events


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("bad_id", [80, -1, -2, 2**62 + 3])
def test_bad_ids_checked_on_the_device_still_raise_the_error_naming_the_feature(quantized, bad_id):
    """-1 too: fbgemm's bounds check passes it by (a pruned row), and its CUDA training kernels
    would read before the table's rows."""
    model = M.BagList(rows=(50, 80, 30))
    x = M.bag_inputs(rows=(50, 80, 30))
    if quantized:
        fast = fxrec.transform(model.eval(), x, mode="inference", quantize="int8")
    else:
        fast = fxrec.transform(model, x, optimizer=fxrec.optim.SGD(lr=0.1), backend="fbgemm")
    dense, ids, offsets = x
    bad = [t.clone() for t in ids]
    bad[1][0] = bad_id  # table bags.1 has 80 rows
    with sync_free():
        fast(*x)
        with pytest.raises((ValueError, IndexError), match=rf"id {bad_id} in table 'bags\.1'"):
            fast(dense, bad, offsets)
        fast(*x)  # the next good batch runs


def test_bad_ids_of_a_sequence_feature_checked_on_the_device_name_it():
    model = M.SequenceMean().eval()
    x = M.seq_inputs()
    fast = fxrec.transform(model, x, mode="inference", quantize="int8")
    hist = x[0].clone()
    hist[0, 0] = 50
    with sync_free(), pytest.raises(IndexError, match=r"id 50 in table 'hist'"):
        fast(hist, *x[1:])


def test_a_torchscript_serving_call_reads_values_a_constant_number_of_times():
    """The TorchScript serving modules cannot defer a report (no events in TorchScript): they
    check every feature on the device into one flag and read it once (the packing reads one
    more on CPU only), however many features the group has; the errors still name the feature."""
    counts = {}
    for rows in ((50, 80, 30), (50, 80, 30, 20, 60, 70)):
        model = M.BagList(rows=rows).eval()
        fast = fxrec.transform(model, M.bag_inputs(rows=rows), mode="inference", quantize="int8")
        scripted = fxrec.export.torchscript(fast)
        x = M.bag_inputs(rows=rows, seed=1)
        scripted(*x)
        with host_syncs() as syncs:
            out = scripted(*x)
        counts[len(rows)] = len(syncs.events)
        torch.testing.assert_close(out, fast(*x), rtol=0, atol=0)
        dense, ids, offsets = x
        bad = [t.clone() for t in ids]
        bad[2][0] = 30
        with pytest.raises(Exception, match=r"feature 'ids_2' \(table 'bags\.2'\) looks up id 30"):
            scripted(dense, bad, offsets)
    assert counts[3] == counts[6] <= 2, counts


def test_every_bad_batch_is_reported_not_only_the_first():
    """fbgemm's bounds check zeroes its count each call: the group keeps its own total."""
    model = M.BagList(rows=(50, 80, 30), dim=6)  # dim 6: stored padded (the count also sees index_select)
    x = M.bag_inputs(rows=(50, 80, 30))
    fast = fxrec.transform(model, x, optimizer=fxrec.optim.SGD(lr=0.1), backend="fbgemm")
    dense, ids, offsets = x
    bad = [t.clone() for t in ids]
    bad[1][0] = 80
    with sync_free():
        for _ in range(3):
            with pytest.raises(IndexError, match=r"id 80 in table 'bags\.1'"):
                fast(dense, bad, offsets)
            fast(*x)
        with host_syncs() as syncs:
            fast(*x)
    assert syncs.in_fxrec() == [], syncs.in_fxrec()


def test_check_bounds_names_what_the_device_counted_and_no_call_reported():
    """A call replayed in a CUDA graph runs the device's bounds check and nothing on the host
    (tests/test_gpu.py replays one). Here that check runs by itself on a bad batch in the
    group's kept inputs: fxrec.graph_module.check_bounds raises the error naming the feature,
    once, and nothing where nothing was counted."""
    model = M.BagList(rows=(50, 80, 30))
    x = M.bag_inputs(rows=(50, 80, 30), empty_bags=False)
    fast = fxrec.transform(model, x, optimizer=fxrec.optim.SGD(lr=0.1), backend="fbgemm")
    dense, ids, offsets = x
    with sync_free():
        fast(*x)
    fxrec.graph_module.check_bounds(fast)
    [group] = [m for m in fast.modules() if m.__dict__.get("_device_bounds") is not None]
    state = group._device_bounds
    ids[1][0] = 80  # table bags.1 has 80 rows; the kept inputs are the call's own tensors, as a graph's are
    starts = torch.tensor([0, ids[0].numel(), ids[0].numel() + ids[1].numel()])
    packed = torch.cat([o + s for o, s in zip(offsets, starts)] + [torch.tensor([sum(i.numel() for i in ids)])])
    state.check(torch.cat(ids), packed, None, ids, offsets)  # what a replay runs
    with pytest.raises(IndexError, match=r"id 80 in table 'bags\.1'"):
        fxrec.graph_module.check_bounds(fast)
    fxrec.graph_module.check_bounds(fast)  # reported once
    ids[1][0] = 0
    state.check(torch.cat(ids), packed, None, ids, offsets)
    fxrec.graph_module.check_bounds(fast)  # nothing new counted


def test_offsets_that_do_not_start_at_zero_are_named_without_reading_them():
    model = M.BagList(rows=(50, 80, 30))
    x = M.bag_inputs(rows=(50, 80, 30), empty_bags=False)
    fast = fxrec.transform(model, x, optimizer=fxrec.optim.SGD(lr=0.1), backend="fbgemm")
    dense, ids, offsets = x
    shifted = [o.clone() for o in offsets]
    shifted[2] = shifted[2] + 1
    with sync_free(), pytest.raises(ValueError, match=r"offsets of feature '.*2'.*start at 0"):
        fast(dense, ids, shifted)


def test_include_last_offset_bags_with_ids_after_the_last_offset_give_pytorchs_answer():
    """Such bags are valid PyTorch input: the trailing ids are dropped, which needs offsets[-1] on
    the host (one documented wait), not a device assert."""
    bag = torch.nn.EmbeddingBag(40, 4, mode="sum", include_last_offset=True)

    class Last(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = bag

        def forward(self, ids, offsets):
            return self.bag(ids, offsets)

    model = Last()
    ids, offsets = torch.randint(0, 40, (9,)), torch.tensor([0, 2, 5, 7])  # ids 7, 8 follow offsets[-1]
    fast = fxrec.transform(model, (ids, offsets), optimizer=fxrec.optim.SGD(lr=0.1), backend="fbgemm")
    with sync_free():
        got = fast(ids, offsets)
    torch.testing.assert_close(got, model(ids, offsets), rtol=1e-6, atol=1e-6)


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _ops_per_call(features: int, opt) -> int:
    """Tensor ops of one training step with ``opt`` fused, or of one forward without a fused optimizer
    (whose CPU backward makes each table's gradient on its own; on CUDA fbgemm's dense kernel makes them
    all in one launch, see fxrec/runtime/kernels/fbgemm_dense.py)."""
    rows = (30,) * features
    fast = fxrec.transform(M.BagList(rows=rows, dim=8), M.bag_inputs(rows=rows), optimizer=opt, backend="fbgemm")
    x = M.bag_inputs(rows=rows, seed=1, empty_bags=False)

    def call():
        if opt is None:
            with torch.no_grad():
                return fast(*x)
        return _step(fast, x)

    with sync_free():
        call()
        with _CountOps() as ops:
            call()
    return ops.n


@pytest.mark.parametrize("opt", [None, fxrec.optim.SGD(lr=0.1)], ids=["forward", "fused_sgd_step"])
def test_the_tensor_ops_of_a_call_do_not_grow_with_the_features(opt):
    """Each tensor op is a kernel launch on CUDA (and host time): a group of 64 features costs the
    ops one of 4 does. Measured on an H100 before: 512 features took 1554 ops and 10.8 ms a forward
    against fbgemm's 0.75 ms by hand."""
    small, large = _ops_per_call(4, opt), _ops_per_call(64, opt)
    assert large == small, (small, large)



class _SparseSequences(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Embedding(30, 8, padding_idx=0, sparse=True)
        self.b = torch.nn.Embedding(30, 8, sparse=True)

    def forward(self, x, y):
        return torch.cat([self.a(x), self.b(y)], 2).sum(1)


def test_sparse_gradients_wait_once_a_table_with_padding_ids_and_never_without():
    """A sparse gradient leaves its padding ids out, as PyTorch's does: that takes a boolean mask,
    which waits for the device, once a backward for each sparse table with a padding_idx (documented
    in docs/gpu.md); sparse tables without one wait nowhere."""
    def inp(s):
        g = torch.Generator().manual_seed(s)
        return torch.randint(0, 30, (4, 5), generator=g), torch.randint(0, 30, (4, 5), generator=g)

    fast = fxrec.transform(_SparseSequences(), inp(0), backend="fbgemm")
    with sync_free():
        _step(fast, inp(1))
        with host_syncs() as syncs:
            _step(fast, inp(2))
    assert [(what, where.split(":")[0]) for what, where in syncs.in_fxrec()] == \
        [("aten::nonzero", "fxrec/runtime/grad.py")]  # (table a's; b has no padding_idx)


class _SharedPadded(torch.nn.Module):
    """One table read by two sequence lookups, one of them with padding_idx 0 (its padding ids
    step no row; the other lookup's ids 0 do), beside a bag."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(30, 8))
        self.b = torch.nn.EmbeddingBag(40, 8, mode="sum")

    def forward(self, x, z, y):
        a = torch.nn.functional.embedding(x, self.w, padding_idx=0).sum(1)
        c = torch.nn.functional.embedding(z, self.w).sum(1)
        return torch.cat([a, c, self.b(y)], 1)


def _shared_padded_inputs(s):
    g = torch.Generator().manual_seed(s)
    x = torch.randint(0, 30, (6, 5), generator=g)
    x[:, :2] = 0  # padding ids in every step
    z = torch.randint(0, 30, (6, 3), generator=g)
    z[0, 0] = 0  # row 0 stepped by the other lookup
    return x, z, torch.randint(0, 40, (6, 3), generator=g)


@pytest.mark.parametrize("opt", ["adagrad", "rowwise_adagrad", "rowwise_adagrad_decay_max_norm"])
def test_the_reference_kernels_fused_adagrad_reads_no_value_on_the_host(opt):
    """The reference kernel's fused Adagrads (the update where fbgemm's kernel would not be
    exact, e.g. a padding row) sum each row's gradient and step its row with nothing read on the
    host: before, torch.unique and the padding ids' boolean mask each waited for the device, on
    every table, every step. Four steps against the plain model with the torch optimizer of the
    same arithmetic (the padding row stepped only through the lookup that has no padding_idx)."""
    from fxrec.optim import RowWiseAdagradTorch

    cfg, ref_opt = {
        "adagrad": (fxrec.optim.Adagrad(lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1)),
        "rowwise_adagrad": (fxrec.optim.RowWiseAdagrad(lr=0.1), lambda p: RowWiseAdagradTorch(p, lr=0.1)),
        "rowwise_adagrad_decay_max_norm": (
            fxrec.optim.RowWiseAdagrad(lr=0.1, weight_decay=0.05, weight_decay_mode="decoupled", max_norm=0.9),
            lambda p: RowWiseAdagradTorch(p, lr=0.1, weight_decay=0.05, weight_decay_mode="decoupled", max_norm=0.9)),
    }[opt]
    torch.manual_seed(0)
    model = _SharedPadded()
    plain = copy.deepcopy(model)
    row0 = model.w.detach()[0].clone()
    fast = fxrec.transform(model, _shared_padded_inputs(0), optimizer=cfg, backend="reference")
    assert [g.kernel_train for g in fast.report.groups] == ["reference"] * len(fast.report.groups)
    ref = ref_opt(list(plain.parameters()))
    counted = []
    for step in range(4):
        x = _shared_padded_inputs(step + 1)
        ref.zero_grad()
        plain(*x).sin().sum().backward()
        ref.step()
        with sync_free(), host_syncs() as syncs:
            fast(*x).sin().sum().backward()
        if step:  # (the first call makes the device check's counters)
            counted += syncs.in_fxrec()
    assert counted == [], counted
    got = fast.state_dict()
    for k, want in plain.state_dict().items():
        torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-6, msg=k)
    assert not torch.equal(got["w"][0], row0)  # (stepped through the lookup without padding_idx)


def _distinct_rows_step(weight, state, ids, rows, fused, keep):
    """The step written on the distinct rows (torch.unique: it waits for the device on CUDA),
    what adagrad_rows computes without knowing how many rows there are."""
    from fxrec.runtime.grad import renorm_rows

    if keep is not None:
        ids, rows = ids[keep], rows[keep]
    uniq, inv = torch.unique(ids, return_inverse=True)
    g = rows.new_zeros(uniq.numel(), rows.shape[1]).index_add_(0, inv, rows)
    w, s0 = weight[uniq], state[uniq]
    if fused.kind == "adagrad":
        s = s0.addcmul(g, g)
        new = w + (g / s.sqrt().add_(fused.eps)) * (-fused.lr)
    else:
        wd, mode = fused.weight_decay, fused.weight_decay_mode
        d = g + wd * w if mode == "l2" else g
        s = s0 + (d * d).mean(1)
        mult = (fused.lr / (s.sqrt() + fused.eps)).unsqueeze(1)
        new = (1 - (mult * wd if mode == "l2" else fused.lr * wd)) * w - mult * g if mode else w + g * -mult
        new = renorm_rows(new, fused.max_norm) if fused.max_norm else new
    state[uniq], weight[uniq] = s, new


@pytest.mark.parametrize("form", ["adagrad", "rowwise", "rowwise_l2", "rowwise_decoupled_max_norm"])
@pytest.mark.parametrize("masked", [False, True])
def test_the_fused_adagrad_step_over_slots_is_the_step_over_the_distinct_rows_bit_for_bit(form, masked):
    """adagrad_rows sums into as many slots as lookups (the count of distinct rows would be a
    host read) and writes each row once in effect: the same values, bit for bit, as the step
    written on the distinct rows, ids repeated many times, some rows only looked up by lookups not
    kept (a padding id's: left as they are), one row both kept and not."""
    from types import SimpleNamespace

    from fxrec.runtime.grad import adagrad_rows

    fused = SimpleNamespace(kind="adagrad" if form == "adagrad" else "rowwise_adagrad", lr=0.3, eps=1e-8,
                            weight_decay=0.0 if form in ("adagrad", "rowwise") else 0.1,
                            weight_decay_mode={"rowwise_l2": "l2", "rowwise_decoupled_max_norm": "decoupled"}.get(form, ""),
                            max_norm=0.7 if form.endswith("max_norm") else 0.0)
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 6, generator=g)
    state = torch.rand(40, 6, generator=g) if form == "adagrad" else torch.rand(40, generator=g)
    ids = torch.randint(0, 12, (300,), generator=g)  # (rows 12..39 never looked up)
    rows = torch.randn(300, 6, generator=g)
    keep = None
    if masked:
        keep = ids != 5
        keep[torch.nonzero(ids == 7)[0]] = False  # row 7: one lookup not kept, the others kept
        rows[~keep] = 0.0
    want_w, want_s = weight.clone(), state.clone()
    _distinct_rows_step(want_w, want_s, ids, rows, fused, keep)
    adagrad_rows(weight, state, ids, rows, fused, keep)
    assert torch.equal(weight, want_w) and torch.equal(state, want_s)
    assert not torch.equal(weight[:12], torch.randn(40, 6, generator=torch.Generator().manual_seed(3))[:12])
