"""fxrec.optim.LarsSGD: fbgemm's LARS-SGD (fused on CUDA only), its torch.optim form on CPU, and the
decisions fxrec makes for it. The fused CUDA path is in tests/test_gpu.py."""

import inspect

import pytest
import torch

import fxrec
from fxrec.optim import LarsSGD, LarsSGDTorch
from tests import models as M
from tests.test_fused_optimizers import ROWS, train_both
from tests.test_lazy_adam import _adam_groups, _made_for_cuda, decided_for_cuda  # noqa: F401 (a fixture)


class LarsReference(torch.optim.Optimizer):
    """fbgemm's LARS-SGD (its CUDA template, fbgemm_gpu/codegen/genscript/optimizers.py ``lars_sgd()``,
    v1.6.0) written out row by row on dense gradients, independently of fxrec: for each row r with a
    non-zero gradient g (summed over the batch), w its weights before the update,
    lr_r = lr * eta * |w| / (|g| + wd * |w|); m = momentum * m + lr_r * (g + wd * w); w -= m."""

    def __init__(self, params, lr, eta, momentum, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, eta=eta, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, eta, mom, wd = group["lr"], group["eta"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["m"] = torch.zeros_like(p)
                g = p.grad.to_dense()
                for r in torch.nonzero(g.abs().sum(1)).flatten().tolist():
                    w_norm = float(p[r].pow(2).sum().sqrt())
                    g_norm = float(g[r].pow(2).sum().sqrt())
                    lr_r = lr * eta * w_norm / (g_norm + wd * w_norm)
                    st["m"][r] = mom * st["m"][r] + lr_r * (g[r] + wd * p[r])
                    p[r] -= st["m"][r]


@pytest.mark.parametrize("sparse", [False, True], ids=["dense_grads", "sparse_grads"])
@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_lars_sgd_torch_is_fbgemms_update_written_out(sparse, wd):
    """Rows 0-2 are never in the batch: they and their momentum stay; the others follow the reference."""
    w0 = torch.randn(10, 8)
    a, b = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    hps = dict(lr=0.5, eta=0.02, momentum=0.8, weight_decay=wd)
    opt, ref = LarsSGDTorch([a], **hps), LarsReference([b], **hps)
    gen = torch.Generator().manual_seed(4)
    for _ in range(6):
        g = torch.randn(10, 8, generator=gen)
        g[:3] = 0.0
        a.grad = torch.sparse_coo_tensor(torch.arange(3, 10).unsqueeze(0), g[3:], (10, 8)) if sparse else g.clone()
        b.grad = g.clone()
        opt.step()
        ref.step()
    assert torch.equal(a.detach()[:3], w0[:3]) and not opt.state[a]["momentum_buffer"][:3].any()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.state[a]["momentum_buffer"], ref.state[b]["m"], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(a.detach()[3:], w0[3:])


def test_a_row_looked_up_three_times_takes_one_update_of_its_summed_gradient():
    """fbgemm sums a row's gradient over the batch before the update (one trust ratio per row)."""
    w0 = torch.randn(5, 4)
    a, b = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    opt, ref = LarsSGDTorch([a], lr=1.0, eta=0.1, momentum=0.5), LarsReference([b], lr=1.0, eta=0.1, momentum=0.5)
    ids = torch.tensor([1, 1, 1, 4])
    torch.nn.functional.embedding(ids, a, sparse=True).sum().backward()  # row 1 three times
    torch.nn.functional.embedding(ids, b).sum().backward()
    opt.step()
    ref.step()
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_lars_sgd_on_cpu_trains_through_torch_optim_as_the_reference_does():
    cfg = LarsSGD(lr=0.5, eta=0.02, momentum=0.8, weight_decay=0.01)
    ref, fast, opt = train_both(lambda: M.BagList(rows=ROWS), lambda s: M.bag_inputs(rows=ROWS, seed=s), cfg,
                                lambda p: LarsReference(p, lr=0.5, eta=0.02, momentum=0.8, weight_decay=0.01),
                                steps=8, backend="auto")
    assert all("torch.optim in opt.step()" in g.optimizer and "CUDA only" in g.why for g in fast.report.groups)
    assert any(isinstance(o, LarsSGDTorch) for o in opt.fallbacks)
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("name", ["bags", "fields", "shared", "sequence", "weighted"])
def test_explain_for_cuda_fuses_lars_sgd_into_fbgemm_on_every_group(name):
    from tests.test_lazy_adam import _lookup_models

    model_fn, inputs = _lookup_models()[name]
    r = fxrec.explain(model_fn(), inputs, device="cuda", optimizer=LarsSGD())
    assert r.groups
    for g in r.groups:
        assert (g.kernel_train, g.fused) == ("fbgemm", "lars_sgd"), g.why
        assert "fused lars_sgd inside backward by fbgemm" in g.why and "fused into backward" in g.optimizer


def test_fbgemm_is_built_with_the_lars_arguments_on_cuda_and_its_cpu_build_is_refused_by_name(monkeypatch):
    """What make_training_tbe hands fbgemm's constructor for a CUDA device (recorded, no GPU
    needed): LARS_SGD and the configuration's lr, eta, momentum and weight decay, arguments the
    constructor takes."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    from fxrec.runtime.kernels import fbgemm_tbe
    from fxrec.runtime.kernels.fbgemm_tbe import make_training_tbe

    spec = LarsSGD(lr=0.3, eta=0.01, momentum=0.7, weight_decay=0.1).fused_spec()
    assert (spec.kind, spec.lr, spec.eta, spec.momentum, spec.weight_decay) == ("lars_sgd", 0.3, 0.01, 0.7, 0.1)
    seen = {}

    def record(*args, **kwargs):
        seen.update(args=args, kwargs=kwargs)
        return "tbe"

    monkeypatch.setattr(fbgemm_tbe, "SplitTableBatchedEmbeddingBagsCodegen", record)
    assert make_training_tbe([(10, 4)], [0], "sum", torch.device("cuda"), spec) == "tbe"
    kw = seen["kwargs"]
    assert kw["optimizer"] == EmbOptimType.LARS_SGD
    assert (kw["learning_rate"], kw["eta"], kw["momentum"], kw["weight_decay"]) == (0.3, 0.01, 0.7, 0.1)
    inspect.signature(SplitTableBatchedEmbeddingBagsCodegen.__init__).bind(None, *seen["args"], **kw)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="CPU build has no fused lars_sgd"):
        make_training_tbe([(10, 4)], [0], "sum", torch.device("cpu"), spec)


@pytest.mark.parametrize("bad", [dict(momentum=1.0), dict(momentum=-0.1), dict(eta=-1.0), dict(lr=-1.0),
                                 dict(weight_decay=-0.5)])
def test_bad_lars_sgd_arguments_are_refused(bad):
    with pytest.raises(ValueError, match="LarsSGD"):
        LarsSGD(**bad)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_planner_sizes_lars_sgds_momentum_and_the_gradient_it_makes_on_cpu(device):
    from fxrec.planner import TableSpec
    from fxrec.planner.cost import optimizer_kind

    assert optimizer_kind(LarsSGD()) == "lars_sgd"
    plan = fxrec.plan(tables=[TableSpec("t", 1000, 16)], world_size=2, device=device, memory_per_rank="1GB",
                      optimizer=LarsSGD(), pins={"t": "row_wise"})
    grad = 16 * 4 if device == "cpu" else 0  # fused on CUDA: no gradient
    assert [s.bytes for s in plan["t"].shards] == [500 * (16 * 4 + 16 * 4 + grad)] * 2


def _momenta(fast):
    return [[{k: v.clone() for k, v in st.items()} for st in g.optimizer_states(p)] for g, p in _adam_groups(fast)]


def test_a_lars_sgd_model_made_for_cuda_keeps_its_momentum_through_a_checkpoint(decided_for_cuda, tmp_path):
    """Decided as on CUDA, held on the CPU: the momentum waits on the group (one state like the
    table, no step count), a training step there names the tables, and a checkpoint carries it."""
    a = _made_for_cuda(LarsSGD(lr=0.1))
    assert {g.fused for g in a.report.groups} == {"lars_sgd"}
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for g, params in _adam_groups(a):
            assert g.fused_step(params) is None
            for st, t in zip(g.optimizer_states(params), g.tables):
                assert list(st) == ["momentum_buffer"] and tuple(st["momentum_buffer"].shape) == (t.num_rows, t.dim)
                st["momentum_buffer"].copy_(torch.rand(st["momentum_buffer"].shape, generator=gen))
    with pytest.raises(RuntimeError, match="fused lars_sgd runs on CUDA only, not cpu"):
        a(*M.bag_inputs(rows=ROWS, seed=1)).sum().backward()
    fxrec.checkpoint.save_model(a, tmp_path / "ck")
    b = _made_for_cuda(LarsSGD(lr=0.1))
    fxrec.checkpoint.load_into_model(b, tmp_path / "ck")
    got, want = _momenta(b), _momenta(a)
    assert len(got) == len(want) and all(torch.equal(x["momentum_buffer"], y["momentum_buffer"])
                                         for gx, gy in zip(got, want) for x, y in zip(gx, gy))
    assert any(bool(x["momentum_buffer"].any()) for gx in got for x in gx)
