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
