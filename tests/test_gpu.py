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
