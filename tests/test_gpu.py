"""The CUDA path, on a GPU (``requires_cuda``: skipped without one; ``make test-gpu`` runs them and
fails on a machine without a GPU). Each test compares with the plain PyTorch model on the same
GPU. Written against fbgemm-gpu 1.6.0's CUDA API; no GPU was at hand when they were written."""

import copy

import pytest
import torch
from torch.utils._pytree import tree_map

import fxrec
from tests import models as M
from tests.test_fused_optimizers import RowWiseAdagradReference

pytestmark = pytest.mark.requires_cuda
ROWS = (40, 30, 20)


def cuda(x):
    return tree_map(lambda t: t.cuda() if isinstance(t, torch.Tensor) else t, x)


def groups(fast):
    from fxrec.runtime.group import EmbeddingGroup

    return [m for _, m in fast.named_modules() if isinstance(m, EmbeddingGroup)]


@pytest.mark.parametrize("name", ["bags", "fields", "shared", "sequence", "weighted"])
def test_forward_and_gradients_equal_the_plain_model_on_fbgemm(name):
    model_fn, inputs_fn = {
        "bags": (lambda: M.BagList(rows=ROWS), lambda s: M.bag_inputs(rows=ROWS, seed=s)),
        "fields": (M.FieldDict, lambda s: M.field_inputs(seed=s)),
        "shared": (M.SharedTables, lambda s: M.shared_inputs(seed=s)),
        "sequence": (M.SequenceMean, lambda s: M.seq_inputs(seed=s)),
        "weighted": (M.WeightedBags, lambda s: M.weighted_inputs(seed=s)),
    }[name]
    model = model_fn().cuda()
    fast = fxrec.transform(model, cuda(inputs_fn(0)))
    assert groups(fast) and all(g.kernel_train == "fbgemm" for g in groups(fast)), [g.kernel_train for g in groups(fast)]
    for seed in (1, 2):
        x = cuda(inputs_fn(seed))
        want, got = model(*x), fast(*x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        model.zero_grad()
        fast.zero_grad()
        want.sin().sum().backward()
        got.sin().sum().backward()
        for (n, a), (_, b) in zip(model.named_parameters(), fast.named_parameters()):
            ga, gb = a.grad, b.grad
            ga = ga.to_dense() if ga is not None and ga.is_sparse else ga
            gb = gb.to_dense() if gb is not None and gb.is_sparse else gb
            torch.testing.assert_close(gb, ga, rtol=1e-5, atol=1e-5, msg=n)


@pytest.mark.parametrize("opt_name", ["sgd", "adagrad", "rowwise_adagrad"])
def test_fused_optimizers_on_the_gpu_match_torch_optim_over_ten_steps(opt_name):
    fused, torch_opt = {
        "sgd": (fxrec.optim.SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
        "adagrad": (fxrec.optim.Adagrad(lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1)),
        "rowwise_adagrad": (fxrec.optim.RowWiseAdagrad(lr=0.1), lambda p: RowWiseAdagradReference(p, lr=0.1)),
    }[opt_name]
    model = M.BagList(rows=ROWS).cuda()
    fast = fxrec.transform(model, cuda(M.bag_inputs(rows=ROWS, seed=0)), optimizer=fused)
    assert all(g.fused is not None and g.kernel_train == "fbgemm" for g in groups(fast))
    ref = copy.deepcopy(model)
    tables = set(fast.meta["fxrec_table_optimizers"])
    ref_opt = torch_opt([p for n, p in ref.named_parameters() if n in tables])
    ref_dense = torch.optim.SGD([p for n, p in ref.named_parameters() if n not in tables], lr=0.01)
    opt = fast.make_optimizer(torch.optim.SGD, lr=0.01)
    for step in range(10):
        x = cuda(M.bag_inputs(rows=ROWS, seed=step + 1))
        for o in (ref_opt, ref_dense, opt):
            o.zero_grad()
        ref(*x).sin().sum().backward()
        fast(*x).sin().sum().backward()
        for o in (ref_opt, ref_dense, opt):
            o.step()
    for (n, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=n)


def test_quantized_groups_built_on_the_gpu_equal_those_built_on_cpu():
    model = M.BagList(rows=ROWS)
    x = M.bag_inputs(rows=ROWS, seed=3)
    on_cpu = fxrec.transform(model, x, mode="inference", quantize="int8")
    on_gpu = fxrec.transform(copy.deepcopy(model).cuda(), cuda(x), mode="inference", quantize="int8")
    with torch.no_grad():
        torch.testing.assert_close(on_gpu(*cuda(x)).cpu(), on_cpu(*x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_groups_built_on_cpu_and_moved_pack_their_rows_for_cuda(dtype):
    """int8 at dim 24: 28-byte rows on CPU, which CUDA's 16-byte loads cannot read; moved, the
    rows are packed again at 16 bytes and read what the CPU model reads; moved back, the CPU
    packing returns byte for byte. A TorchScript module made on CPU and moved is refused."""
    model = M.BagList(rows=ROWS, dim=24).eval()
    x = M.bag_inputs(rows=ROWS, seed=3)
    fast = fxrec.transform(model, x, mode="inference", quantize=dtype)
    with torch.no_grad():
        want = fast(*x)
    cpu_bytes = [g.q_weights.clone() for g in groups(fast)]
    scripted = fxrec.export.torchscript(fast)
    fast.cuda()
    assert all(g.q_ints["row_alignment"] == 16 and g.q_weights.is_cuda for g in groups(fast))
    with torch.no_grad():
        torch.testing.assert_close(fast(*cuda(x)).cpu(), want, rtol=0, atol=0)
    fast.cpu()
    assert all(torch.equal(g.q_weights, b) for g, b in zip(groups(fast), cpu_bytes))
    with pytest.raises(RuntimeError, match="packed for CPU"):
        scripted.cuda()(*cuda(x))


def test_autotune_times_the_gpu_kernels_with_cuda_events(tmp_path, monkeypatch):
    monkeypatch.setenv("FXREC_CACHE", str(tmp_path))
    model = M.BagList(rows=ROWS).cuda()
    fast = fxrec.transform(model, cuda(M.bag_inputs(rows=ROWS, seed=0)), autotune=True)
    x = cuda(M.bag_inputs(rows=ROWS, seed=1))
    torch.testing.assert_close(fast(*x), model(*x), rtol=1e-5, atol=1e-5)
    assert all(g.decided_by == "autotune (measured)" and g.timings_ms for g in fast.report.groups), fast.report.groups


def test_a_training_step_and_a_quantized_call_never_wait_for_the_gpu():
    """The GPU counterpart of tests/test_host_syncs.py: CUDA's sync debug mode raises on any
    operation that makes the host wait."""
    model = M.BagList(rows=ROWS).cuda()
    fast = fxrec.transform(model, cuda(M.bag_inputs(rows=ROWS)), optimizer=fxrec.optim.SGD(lr=0.1))
    served = fxrec.transform(copy.deepcopy(model).eval(), cuda(M.bag_inputs(rows=ROWS)), mode="inference",
                             quantize="int8")
    x = cuda(M.bag_inputs(rows=ROWS, seed=5))
    fast(*x).sum().backward()  # first calls build the TBEs and the device checks
    with torch.no_grad():
        served(*x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fast(*x).sum().backward()
        with torch.no_grad():
            served(*x)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_bad_ids_on_the_gpu_raise_the_named_error_at_the_next_call():
    model = M.BagList(rows=ROWS).cuda()
    fast = fxrec.transform(model, cuda(M.bag_inputs(rows=ROWS)), optimizer=fxrec.optim.SGD(lr=0.1))
    dense, ids, offsets = cuda(M.bag_inputs(rows=ROWS, seed=6))
    bad = [t.clone() for t in ids]
    bad[0][0] = ROWS[0]
    fast(dense, bad, offsets)  # runs (the bad id reads row 0); the count reaches the host later
    torch.cuda.synchronize()
    with pytest.raises(IndexError, match=rf"id {ROWS[0]} in table 'bags\.0'"):
        fast(dense, ids, offsets)


def test_quantized_inference_replays_as_a_cuda_graph():
    model = M.BagList(rows=ROWS).cuda().eval()
    x = cuda(M.bag_inputs(rows=ROWS, seed=7, empty_bags=False))
    fast = fxrec.transform(model, x, mode="inference", quantize="int8")
    dense, ids, offsets = x
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fast(*x)  # warm-up off the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fast(dense, ids, offsets)
        # new values in the same tensors (a graph replays on fixed addresses and sizes)
        dense.copy_(torch.rand_like(dense))
        for t, rows in zip(ids, ROWS):
            t.copy_(torch.randint_like(t, 0, rows))
        graph.replay()
        torch.testing.assert_close(out, fast(dense, ids, offsets), rtol=0, atol=0)
        torch.testing.assert_close(out.float(), model(dense, ids, offsets), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("dim", [2048, 2052])
def test_dims_up_to_fbgemms_cuda_limit_run_on_the_tbe_and_wider_ones_on_the_reference(dim):
    model = M.BagList(rows=(20, 30), dim=dim).cuda()
    x = cuda(M.bag_inputs(rows=(20, 30)))
    fast = fxrec.transform(model, x)
    kernel = {g.kernel_train for g in fast.report.groups}
    assert kernel == ({"fbgemm"} if dim == 2048 else {"reference"}), fast.report.groups
    out = fast(*x)
    torch.testing.assert_close(out, model(*x), rtol=1e-5, atol=1e-5)
    out.sum().backward()


def test_transform_on_the_gpu_needs_at_most_one_more_copy_of_the_tables():
    """Peak device memory of transform beyond the model: one copy of the tables (the transformed
    model's own; the user's stays) and a little for the example batch, not the 6-8x of timing
    runs; with a fused optimizer the states come on top (SGD has none)."""
    rows, dim = (200_000, 100_000, 50_000), 64
    model = M.BagList(rows=rows, dim=dim).cuda()
    x = cuda(M.bag_inputs(rows=rows, batch=256))
    table_bytes = sum(rows) * dim * 4
    for kw in ({}, {"optimizer": fxrec.optim.SGD(lr=0.1)}):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fast = fxrec.transform(model, x, **kw)
        peak = torch.cuda.max_memory_allocated() - before
        assert peak <= 1.25 * table_bytes, (kw, peak / table_bytes)
        del fast
