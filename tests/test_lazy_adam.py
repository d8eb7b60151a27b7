"""fxrec.optim.LazyAdam and LazyLamb: fbgemm's Adam and LAMB (fused on CUDA only), their torch.optim
forms on CPU, and the decisions fxrec makes for them. The fused CUDA path is in tests/test_gpu.py."""

import copy
import inspect

import pytest
import torch

import fxrec
import fxrec.checkpoint_fused
from fxrec.optim import (LazyAdam, LazyAdamTorch, LazyLamb, LazyLambTorch, PartialRowWiseAdam,
                         PartialRowWiseAdamTorch, PartialRowWiseLamb, PartialRowWiseLambTorch)
from tests import models as M
from tests.test_fused_optimizers import ROWS, train_both


class LazyAdamReference(torch.optim.Optimizer):
    """fbgemm's Adam (its CUDA template, fbgemm_gpu/codegen/genscript/optimizers.py, v1.6.0) written
    out on dense gradients, independently of fxrec: at step t, for each row r with a non-zero
    gradient g: m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
    w -= lr * ((m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd * w). Other rows untouched."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                st["t"] += 1
                t = st["t"]
                g = p.grad.to_dense()
                for r in torch.nonzero(g.abs().sum(1)).flatten().tolist():
                    st["m"][r] = b1 * st["m"][r] + (1 - b1) * g[r]
                    st["v"][r] = b2 * st["v"][r] + (1 - b2) * self.second_moment(st["v"][r], g[r])
                    m_hat = st["m"][r] / (1 - b1 ** t)
                    v_hat = st["v"][r] / (1 - b2 ** t)
                    upd = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p[r]
                    p[r] -= group["lr"] * self.ratio(p[r], upd) * upd

    def ratio(self, w, upd) -> float:
        return 1.0

    def second_moment(self, v, g):
        return g * g


class PartialRowWiseAdamReference(LazyAdamReference):
    """fbgemm's partial row-wise Adam (the same template's ``partial_rowwise_adam()``): ``v`` one a row,
    ``beta2 * v + (1 - beta2) * mean(g^2 over the row)``, the rest as Adam's."""

    def second_moment(self, v, g):
        return v * 0 + g.pow(2).mean()


class LazyLambReference(LazyAdamReference):
    """fbgemm's LAMB (the same template's ``lamb()``): Adam's ``upd`` (it calls it r_t + wd * w),
    scaled per row by |w| / |upd|, the norms over the row, w before the update."""

    def ratio(self, w, upd) -> float:
        return float(w.pow(2).sum().sqrt()) / float(upd.pow(2).sum().sqrt())


class PartialRowWiseLambReference(LazyLambReference):
    """fbgemm's partial row-wise LAMB (``partial_rowwise_lamb()``): LAMB with the row-wise ``v``."""

    second_moment = PartialRowWiseAdamReference.second_moment


def _grads(shape, steps, seed, zero_rows=()):
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        x = torch.randn(shape, generator=g)
        for r in zero_rows:
            if s % 2 == 0:
                x[r] = 0.0
        out.append(x)
    return out


@pytest.mark.parametrize("sparse", [False, True], ids=["dense_grads", "sparse_grads"])
@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_when_every_row_is_in_every_batch_lazy_adam_is_torch_adamw(sparse, wd):
    w0 = torch.randn(12, 8)
    a, b = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    lazy = LazyAdamTorch([a], lr=0.01, weight_decay=wd)
    adamw = torch.optim.AdamW([b], lr=0.01, weight_decay=wd)
    for g in _grads((12, 8), 6, seed=1):
        a.grad = g.to_sparse(1) if sparse else g.clone()
        b.grad = g.clone()
        lazy.step()
        adamw.step()
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(lazy.state[a]["exp_avg_sq"], adamw.state[b]["exp_avg_sq"], rtol=1e-6, atol=1e-9)


def test_rows_outside_the_batch_and_their_state_stay_exactly_as_they_were():
    """Rows 0-4 are in every batch: they follow torch.optim.Adam on those rows alone; rows 5-9 never are."""
    w0 = torch.randn(10, 4)
    a = w0.clone().requires_grad_()
    sub = w0[:5].clone().requires_grad_()
    lazy, adam = LazyAdamTorch([a], lr=0.05), torch.optim.Adam([sub], lr=0.05)
    for g in _grads((5, 4), 5, seed=2):
        a.grad = torch.sparse_coo_tensor(torch.arange(5).unsqueeze(0), g, (10, 4))
        sub.grad = g.clone()
        lazy.step()
        adam.step()
    assert torch.equal(a.detach()[5:], w0[5:])
    assert not lazy.state[a]["exp_avg"][5:].any() and not lazy.state[a]["exp_avg_sq"][5:].any()
    torch.testing.assert_close(a.detach()[:5], sub.detach(), rtol=1e-6, atol=1e-7)


def test_a_row_in_the_batch_with_a_zero_gradient_moves_with_sparse_gradients():
    """The sparse gradient names the rows looked up: a zero-gradient row still decays its moments
    and moves by them (fbgemm's update), which is torch.optim.Adam's step for it."""
    w0 = torch.randn(6, 4)
    a, b = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    lazy, adam = LazyAdamTorch([a], lr=0.05), torch.optim.Adam([b], lr=0.05)
    for g in _grads((6, 4), 6, seed=3, zero_rows=(1, 4)):
        a.grad = torch.sparse_coo_tensor(torch.arange(6).unsqueeze(0), g, (6, 4))
        b.grad = g.clone()
        lazy.step()
        adam.step()
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_lazy_adam_on_cpu_trains_through_torch_optim_as_the_reference_does():
    cfg = LazyAdam(lr=0.01, weight_decay=0.01)
    ref, fast, opt = train_both(lambda: M.BagList(rows=ROWS), lambda s: M.bag_inputs(rows=ROWS, seed=s), cfg,
                                lambda p: LazyAdamReference(p, lr=0.01, weight_decay=0.01), steps=8, backend="auto")
    assert all("torch.optim in opt.step()" in g.optimizer for g in fast.report.groups)
    assert any(isinstance(o, LazyAdamTorch) for o in opt.fallbacks)
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=k)


def test_fxrec_checkpoint_carries_lazy_adam_state_to_another_model(tmp_path):
    model = M.BagList(rows=ROWS)
    example = M.bag_inputs(rows=ROWS)
    cfg = LazyAdam(lr=0.02)

    def run(m, o, steps):
        for s in steps:
            o.zero_grad()
            m(*M.bag_inputs(rows=ROWS, seed=s)).sin().sum().backward()
            o.step()

    a = fxrec.transform(model, example, optimizer=cfg)
    opt_a = a.make_optimizer(torch.optim.Adam, lr=1e-3)
    run(a, opt_a, range(4))
    fxrec.checkpoint.save(a, tmp_path / "ck", optimizer=opt_a)
    run(a, opt_a, range(4, 8))
    b = fxrec.transform(M.BagList(rows=ROWS), example, optimizer=cfg)
    opt_b = b.make_optimizer(torch.optim.Adam, lr=1e-3)
    fxrec.checkpoint.load(b, tmp_path / "ck", optimizer=opt_b)
    run(b, opt_b, range(4, 8))
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), k


class Unpooled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.items = torch.nn.Embedding(30, 8)
        self.users = torch.nn.Embedding(20, 8)

    def forward(self, items, users):
        return self.items(items) * self.users(users).unsqueeze(1)


def _lookup_models():
    return {
        "bags": (lambda: M.BagList(rows=ROWS), M.bag_inputs(rows=ROWS)),
        "fields": (M.FieldDict, M.field_inputs()),
        "shared": (M.SharedTables, M.shared_inputs()),
        "sequence": (Unpooled, (torch.randint(0, 30, (4, 5)), torch.randint(0, 20, (4,)))),
        "weighted": (M.WeightedBags, M.weighted_inputs()),
    }


@pytest.mark.parametrize("name", sorted(_lookup_models()))
@pytest.mark.parametrize("cfg", [LazyAdam(lr=0.01), LazyLamb(lr=0.01), PartialRowWiseAdam(lr=0.01),
                                 PartialRowWiseLamb(lr=0.01)], ids=lambda c: c.kind)
def test_explain_for_cuda_fuses_lazy_adam_and_lamb_into_fbgemm_on_every_group(name, cfg):
    model_fn, inputs = _lookup_models()[name]
    r = fxrec.explain(model_fn(), inputs, device="cuda", optimizer=cfg)
    assert r.groups
    for g in r.groups:
        assert (g.kernel_train, g.fused) == ("fbgemm", cfg.kind), g.why
        assert f"fused {cfg.kind} inside backward by fbgemm" in g.why and "fused into backward" in g.optimizer


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torch_adam_is_never_fused_and_lazy_adam_is_not_on_cpu(device):
    model_fn, inputs = _lookup_models()["bags"]
    for cfg in (fxrec.optim.Adam(lr=0.01), LazyAdam(lr=0.01)):
        r = fxrec.explain(model_fn(), inputs, device=device, optimizer=cfg)
        fused = device == "cuda" and isinstance(cfg, LazyAdam)
        for g in r.groups:
            assert (g.fused == "adam") == fused, g.why
            if not fused:
                assert "torch.optim in opt.step()" in g.optimizer
                assert ("CUDA only" if isinstance(cfg, LazyAdam) else "LazyAdam") in g.why


def test_a_padding_row_keeps_lazy_adam_out_of_fbgemm_on_cuda():
    """fbgemm's fused update would train an nn.Embedding padding row; PyTorch gives it no gradient."""
    class Padded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(20, 8, padding_idx=0)

        def forward(self, ids):
            return self.emb(ids).sum(1)

    r = fxrec.explain(Padded(), (torch.randint(0, 20, (4, 3)),), device="cuda", optimizer=LazyAdam())
    (g,) = r.groups
    assert g.fused == "" and "padding row" in g.why and "torch.optim in opt.step()" in g.optimizer


def test_fbgemm_takes_the_adam_arguments_fxrec_passes_and_its_cpu_build_is_refused_by_name():
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    from fxrec.runtime.kernels.fbgemm_tbe import make_training_tbe
    from fxrec.runtime.specs import FusedSpec

    params = inspect.signature(SplitTableBatchedEmbeddingBagsCodegen.__init__).parameters
    assert {"beta1", "beta2", "weight_decay", "eps", "learning_rate"} <= set(params)
    with pytest.raises(ValueError, match="CPU build has no fused adam"):
        make_training_tbe([(10, 4)], [0], "sum", torch.device("cpu"), FusedSpec("adam", 0.01))


def test_a_group_fused_with_adam_on_cuda_and_moved_to_cpu_says_why_it_cannot_train():
    from fxrec.runtime.group import EmbeddingGroup
    from fxrec.runtime.specs import FeatureSpec, FusedSpec, TableSpec

    g = EmbeddingGroup([TableSpec("t", 10, 4)], [FeatureSpec("f", 0, "bag")], "sum", "fbgemm", "fbgemm",
                       fused=FusedSpec("adam", 0.01))
    w = torch.nn.Parameter(torch.randn(10, 4))
    with pytest.raises(RuntimeError, match=r"tables \['t'\].*fused adam runs on CUDA only"):
        g([torch.tensor([1, 2, 3])], [torch.tensor([0, 2])], [None], [w])


@pytest.mark.parametrize("bad", [dict(betas=(1.0, 0.999)), dict(betas=(0.9, -0.1)), dict(eps=-1.0), dict(lr=-1.0)])
def test_bad_lazy_adam_arguments_are_refused(bad):
    with pytest.raises(ValueError, match="LazyAdam"):
        LazyAdam(**bad)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("cfg,state", [(fxrec.optim.Adam(), 8 * 16), (LazyAdam(), 8 * 16), (LazyLamb(), 8 * 16),
                                       (PartialRowWiseAdam(), 4 * 16 + 4), (PartialRowWiseLamb(), 4 * 16 + 4)],
                         ids=["torch_adam", "lazy_adam", "lamb", "partial_rowwise_adam", "partial_rowwise_lamb"])
def test_the_planner_sizes_the_adam_and_lamb_kinds_and_their_gradient_where_they_make_one(cfg, state, device):
    """A row-wise shard's bytes: weights, state (per row), and the shard's dense gradient where the
    runtime makes one: torch.optim.Adam always, the lazy kinds on CPU (fbgemm fuses them on CUDA only)."""
    from fxrec.planner import TableSpec

    plan = fxrec.plan(tables=[TableSpec("t", 1000, 16)], world_size=2, device=device, memory_per_rank="1GB",
                      optimizer=cfg, pins={"t": "row_wise"})
    grad = 16 * 4 if device == "cpu" or isinstance(cfg, fxrec.optim.Adam) else 0
    assert [s.bytes for s in plan["t"].shards] == [500 * (16 * 4 + state + grad)] * 2


def test_betas_given_as_a_list_are_a_tuple_and_the_optimizer_stays_hashable():
    cfg = LazyAdam(betas=[0.8, 0.95])
    assert cfg.betas == (0.8, 0.95) and hash(cfg) == hash(LazyAdam(betas=(0.8, 0.95)))
    assert fxrec.optim.Adam(betas=[0.5, 0.6]).betas == (0.5, 0.6)
    with pytest.raises(ValueError, match="LazyAdam betas must be two numbers"):
        LazyAdam(betas=(0.9,))


# ------------------------------------------------- a LazyAdam model made on a GPU, then on the CPU
# No GPU here: the kernels are decided as on CUDA (what transform decides for tables on a GPU),
# and the model then runs on the CPU, where fbgemm has no Adam: as one trained on a GPU and
# moved to the CPU to be evaluated or saved.
@pytest.fixture
def decided_for_cuda(monkeypatch):
    from fxrec.passes import choose_kernels

    monkeypatch.setattr(choose_kernels, "target_device", lambda ctx, tables_device: "cuda")


def _made_for_cuda(cfg=LazyAdam(lr=0.01), rows=ROWS, **kw):
    fast = fxrec.transform(M.BagList(rows=rows, **kw), M.bag_inputs(rows=rows), optimizer=cfg)
    assert all((g.fused, g.kernel_train) == (cfg.kind, "fbgemm") for g in fast.report.groups)
    return fast


def _adam_groups(fast):
    from fxrec.runtime.group import EmbeddingGroup

    out = []
    for name, fqns in fast.meta["fxrec_fused_groups"]:
        g = fast.get_submodule(name)
        assert isinstance(g, EmbeddingGroup)
        out.append((g, [fast.get_parameter(f) for f in fqns]))
    return out


def _fill_states(fast, step, seed):
    """Distinct Adam moments and ``step`` in every group (as training on the GPU would leave)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for g, params in _adam_groups(fast):
            for states in g.optimizer_states(params):
                for t in states.values():
                    t.copy_(torch.rand(t.shape, generator=gen))
            g.set_fused_step(params, step)


def _states(fast):
    return [(g.fused_step(p), [{k: v.clone() for k, v in s.items()} for s in g.optimizer_states(p)])
            for g, p in _adam_groups(fast)]


def _assert_same_states(a, b):
    assert len(a) == len(b)
    for (step_a, tables_a), (step_b, tables_b) in zip(a, b):
        assert step_a == step_b
        for sa, sb in zip(tables_a, tables_b):
            assert sa.keys() == sb.keys() == {"exp_avg", "exp_avg_sq"}
            for k in sa:
                assert torch.equal(sa[k], sb[k]), k


def test_a_lazy_adam_model_on_the_cpu_serves_keeps_its_states_and_refuses_to_train(decided_for_cuda):
    fast = _made_for_cuda()
    plain = M.BagList(rows=ROWS)
    plain.load_state_dict(fast.state_dict())
    x = M.bag_inputs(rows=ROWS, seed=3)
    with torch.no_grad():
        assert torch.equal(fast(*x), plain(*x))
    for (g, params), t in zip(_adam_groups(fast), [ROWS]):
        assert g.fused_step(params) == 0
        for s, rows in zip(g.optimizer_states(params), t):  # zeros of the table's shape until a GPU fills them
            assert {k: tuple(v.shape) for k, v in s.items()} == {"exp_avg": (rows, 8), "exp_avg_sq": (rows, 8)}
            assert all(not v.any() for v in s.values())
    _fill_states(fast, 7, seed=0)
    before = _states(fast)
    twin = copy.deepcopy(fast)
    _assert_same_states(_states(twin), before)
    with pytest.raises(RuntimeError, match=r"tables \[.*\] train with a fused optimizer, but fbgemm's fused adam runs on "
                                           r"CUDA only, not cpu"):
        fast(*x).sum().backward()
    _assert_same_states(_states(fast), before)


def test_a_checkpoint_without_optimizer_carries_the_fused_adam_step(decided_for_cuda, tmp_path):
    a = _made_for_cuda()
    _fill_states(a, 7, seed=0)
    fxrec.checkpoint.save_model(a, tmp_path / "ck")  # no optimizer=: the step is a fused entry of each table
    from fxrec.checkpoint import _read_metadata

    md = _read_metadata(str(tmp_path / "ck")).state_dict_metadata
    steps = sorted(k for k in md if k.endswith(".fxrec_fused.step"))
    assert steps == [f"bags.{i}.weight.fxrec_fused.step" for i in range(3)]
    b = _made_for_cuda()
    fxrec.checkpoint.load_into_model(b, tmp_path / "ck")
    _assert_same_states(_states(b), _states(a))
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), k


def test_fused_states_of_another_optimizer_in_a_checkpoint_are_refused_by_table(decided_for_cuda, tmp_path):
    """Adagrad's ``sum`` cannot stand for Adam's moments, nor Adam's for Adagrad's ``sum``: an error naming
    the table, not a load that leaves the states as they were without a word."""
    adagrad = fxrec.transform(M.BagList(rows=ROWS), M.bag_inputs(rows=ROWS), optimizer=fxrec.optim.Adagrad(lr=0.1))
    opt = adagrad.make_optimizer(torch.optim.SGD, lr=0.1)
    adagrad(*M.bag_inputs(rows=ROWS, seed=1)).sum().backward()
    opt.step()
    fxrec.checkpoint.save_model(adagrad, tmp_path / "adagrad")
    adam = _made_for_cuda()
    _fill_states(adam, 3, seed=1)
    before = _states(adam)
    with pytest.raises(fxrec.checkpoint.CheckpointError,
                       match=r"table 'bags.0.weight' has the fused optimizer states sum \[40, 8\] in the checkpoint, "
                             r"another optimizer's than the model's fused one, which keeps exp_avg \[40, 8\], "
                             r"exp_avg_sq \[40, 8\], step \[1\]"):
        fxrec.checkpoint.load_into_model(adam, tmp_path / "adagrad")
    _assert_same_states(_states(adam), before)
    fxrec.checkpoint.load_into_model(adam, tmp_path / "adagrad", strict=False)  # the weights; the states stay
    _assert_same_states(_states(adam), before)
    assert torch.equal(adam.state_dict()["bags.0.weight"], adagrad.state_dict()["bags.0.weight"])
    fxrec.checkpoint.save_model(adam, tmp_path / "adam")
    with pytest.raises(fxrec.checkpoint.CheckpointError, match=r"table 'bags.0.weight' has the fused optimizer states "
                                                               r"exp_avg \[40, 8\], exp_avg_sq \[40, 8\], step \[1\] "
                                                               r"in the checkpoint"):
        fxrec.checkpoint.load_into_model(adagrad, tmp_path / "adam")


@pytest.mark.parametrize("saved, loaded", [("Adagrad", "RowWiseAdagrad"), ("RowWiseAdagrad", "Adagrad")])
def test_a_fused_state_of_the_same_name_and_another_shape_is_another_optimizers(saved, loaded, tmp_path):
    """Adagrad's ``[rows, dim]`` ``sum`` and row-wise Adagrad's ``[rows, 1]`` one: the error names
    the table as another optimizer's states (it was a shape error that strict=False raised too),
    and strict=False loads the weights and leaves the states as they are."""
    x = M.bag_inputs(rows=ROWS)
    a = fxrec.transform(M.BagList(rows=ROWS), x, optimizer=getattr(fxrec.optim, saved)(lr=0.1))
    a(*M.bag_inputs(rows=ROWS, seed=1)).sum().backward()
    fxrec.checkpoint.save_model(a, tmp_path / "ck")
    b = fxrec.transform(M.BagList(rows=ROWS), x, optimizer=getattr(fxrec.optim, loaded)(lr=0.1))
    b(*M.bag_inputs(rows=ROWS, seed=2)).sum().backward()
    before = {k: v.clone() for k, v in fxrec.checkpoint_fused.states(b).items()}
    shapes = {"Adagrad": r"sum \[40, 8\]", "RowWiseAdagrad": r"sum \[40, 1\]"}  # (bags.0: 40 rows of 8)
    with pytest.raises(fxrec.checkpoint.CheckpointError, match=rf"table 'bags.0.weight' has the fused optimizer "
                                                               rf"states {shapes[saved]} in the checkpoint, another "
                                                               rf"optimizer's than the model's fused one, which keeps "
                                                               rf"{shapes[loaded]} \("):
        fxrec.checkpoint.load_into_model(b, tmp_path / "ck")
    fxrec.checkpoint.load_into_model(b, tmp_path / "ck", strict=False)
    for k, v in fxrec.checkpoint_fused.states(b).items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(b.state_dict()["bags.0.weight"], a.state_dict()["bags.0.weight"])


def test_moments_saved_without_a_step_count_load_and_the_step_stays(decided_for_cuda, tmp_path, monkeypatch):
    """Fewer fused states than the model keeps (a checkpoint written before the step was an entry)
    is not another optimizer's: the moments load, the step stays as it was."""
    a = _made_for_cuda()
    _fill_states(a, 9, seed=3)
    with monkeypatch.context() as m:
        m.setattr(fxrec.checkpoint_fused, "steps", lambda module: {})  # as fxrec wrote them before
        fxrec.checkpoint.save_model(a, tmp_path / "ck")
    b = _made_for_cuda()
    _fill_states(b, 4, seed=5)
    fxrec.checkpoint.load_into_model(b, tmp_path / "ck")
    (step_a, tables_a), (step_b, tables_b) = _states(a)[0], _states(b)[0]
    assert (step_a, step_b) == (9, 4)
    _assert_same_states([(0, tables_a)], [(0, tables_b)])


class SumAndMean(torch.nn.Module):
    """Two bags looked up by two groups (sum, mean) or, with ``mode="sum"`` for both, by one."""

    def __init__(self, second="mean"):
        super().__init__()
        self.a = torch.nn.EmbeddingBag(20, 8, mode="sum")
        self.b = torch.nn.EmbeddingBag(30, 8, mode=second)

    def forward(self, x, y):
        return self.a(x) + self.b(y)


def test_tables_of_one_group_with_different_steps_in_the_checkpoint_are_an_error(decided_for_cuda, tmp_path):
    x = (torch.randint(0, 20, (4, 3)), torch.randint(0, 30, (4, 2)))
    two = fxrec.transform(SumAndMean(), x, optimizer=LazyAdam())
    (ga, pa), (gb, pb) = _adam_groups(two)
    ga.set_fused_step(pa, 4)
    gb.set_fused_step(pb, 5)
    fxrec.checkpoint.save_model(two, tmp_path / "ck")
    one = fxrec.transform(SumAndMean("sum"), x, optimizer=LazyAdam())
    ((g, p),) = _adam_groups(one)
    with pytest.raises(fxrec.checkpoint.CheckpointError, match=r"tables \['a.weight', 'b.weight'\] share one fused "
                                                               r"optimizer step count here, but the checkpoint has "
                                                               r"the steps \{'a.weight': 4, 'b.weight': 5\}"):
        fxrec.checkpoint.load_into_model(one, tmp_path / "ck")
    assert g.fused_step(p) == 0


def test_a_step_with_no_ids_counts_as_fbgemm_counts_one():
    """fbgemm's Adam forward adds one to ``iter`` (and its host copy, taken from ``iter`` while 0);
    a step that never reaches it (no ids for the group) must count the same, so the ranks agree."""
    from fxrec.runtime.kernels.fbgemm_tbe import make_training_tbe
    from fxrec.runtime.kernels.fbgemm_states import count_tbe_step, set_tbe_step

    tbe = make_training_tbe([(10, 4)], [0], "sum", torch.device("cpu"))
    tbe.iter.fill_(5)  # loaded; the host copy still 0
    count_tbe_step(tbe)
    assert (int(tbe.iter), int(tbe.iter_cpu)) == (6, 6)
    set_tbe_step(tbe, 2)
    count_tbe_step(tbe)
    assert (int(tbe.iter), int(tbe.iter_cpu)) == (3, 3)


def test_a_step_count_set_or_counted_under_inference_mode_still_counts_outside_it():
    """fbgemm's forward adds one to the host copy in place at every training call, which torch
    refuses on an inference tensor outside inference mode: a step set (a checkpoint loaded) or
    counted under ``torch.inference_mode()`` must leave an ordinary tensor there."""
    from fxrec.runtime.kernels.fbgemm_tbe import make_training_tbe
    from fxrec.runtime.kernels.fbgemm_states import count_tbe_step, set_tbe_step

    tbe = make_training_tbe([(10, 4)], [0], "sum", torch.device("cpu"))
    with torch.inference_mode():
        set_tbe_step(tbe, 4)
        count_tbe_step(tbe)
    assert not tbe.iter_cpu.is_inference()
    tbe.iter_cpu.add_(1)  # as fbgemm's next forward does
    assert (int(tbe.iter), int(tbe.iter_cpu)) == (5, 6)


def _sharded_steps(rank, world, root):
    """World 2, Adam decided as on CUDA (see decided_for_cuda): each rank's groups keep the step; a
    checkpoint carries it to another plan, and ranks that disagree on a table's step cannot save."""
    import os

    from fxrec.passes import choose_kernels
    from tests import test_checkpoint as C

    choose_kernels.target_device = lambda ctx, tables_device: "cuda"  # this worker process only

    def made(plan, seed):
        torch.manual_seed(seed)
        model = C.Model()
        example = C.local_batch(C.global_batch(C.LOCAL_B * world, 0), rank, C.LOCAL_B)
        plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins=plan)
        return fxrec.transform(model, example, plan=plan, optimizer={"bags.*": LazyAdam(lr=0.01)})

    a = made(C.PLAN_A, 0)
    assert _adam_groups(a)
    for g, p in _adam_groups(a):
        g.set_fused_step(p, 6)
    fxrec.checkpoint.save(a, os.path.join(root, "a"))
    b = made(C.PLAN_B, 1)
    fxrec.checkpoint.load(b, os.path.join(root, "a"))
    steps = {t.name: g.fused_step(p) for g, p in _adam_groups(b) for t in g.tables}
    # bags.2 was data-parallel under plan A (torch.optim, no fused step saved); under plan B it is
    # row-wise, its block in the rank's one group with the table-wise table there, whose step it shares
    assert steps == ({"bags.0": 6, "bags.2": 6} if rank == 0 else {"bags.1": 6, "bags.2": 6}), steps
    if rank == 1:
        for g, p in _adam_groups(a):
            g.set_fused_step(p, 7)
    with pytest.raises(fxrec.checkpoint.CheckpointError, match=r"ranks 0 and 1 hold the fused optimizer step counts 6 "
                                                               r"and 7 for table 'bags.1.weight'; nothing was written"):
        fxrec.checkpoint.save(a, os.path.join(root, "b"))
    assert not os.path.exists(os.path.join(root, "b"))
    # bags.0 fused with Adagrad now, on rank 0 only (plan B): rank 0 finds Adam's states where it
    # keeps Adagrad's, rank 1 finds nothing wrong; both raise, neither waits in DCP's read
    torch.manual_seed(2)
    model = C.Model()
    example = C.local_batch(C.global_batch(C.LOCAL_B * world, 0), rank, C.LOCAL_B)
    plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins=C.PLAN_B)
    mixed = fxrec.transform(model, example, plan=plan,
                            optimizer={"bags.0": fxrec.optim.Adagrad(lr=0.1), "bags.*": LazyAdam(lr=0.01)})
    why = r"table 'bags.0.weight' has the fused optimizer states" if rank == 0 else r"another rank found"
    with pytest.raises(fxrec.checkpoint.CheckpointError, match=why):
        fxrec.checkpoint.load(mixed, os.path.join(root, "a"))


def test_sharded_checkpoints_carry_the_fused_adam_step_and_ranks_must_agree_on_it(tmp_path):
    from tests import test_checkpoint as C

    C.spawn(_sharded_steps, 2, tmp_path)


# ---------------------------------------------------------------------------------- LazyLamb
@pytest.mark.parametrize("sparse", [False, True], ids=["dense_grads", "sparse_grads"])
@pytest.mark.parametrize("wd", [0.0, 0.01])
@pytest.mark.parametrize("kind", ["lamb", "partial_rowwise_adam", "partial_rowwise_lamb"])
def test_lazy_lamb_and_the_partial_rowwise_forms_are_fbgemms_updates_written_out(kind, sparse, wd):
    """Rows 0-2 are never in the batch: they and their moments stay; the others follow the reference."""
    cls, ref_cls = {"lamb": (LazyLambTorch, LazyLambReference),
                    "partial_rowwise_adam": (PartialRowWiseAdamTorch, PartialRowWiseAdamReference),
                    "partial_rowwise_lamb": (PartialRowWiseLambTorch, PartialRowWiseLambReference)}[kind]
    w0 = torch.randn(10, 8)
    a, b = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    hps = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=wd)
    opt, ref = cls([a], **hps), ref_cls([b], **hps)
    for g in _grads((10, 8), 6, seed=4):
        g[:3] = 0.0
        a.grad = torch.sparse_coo_tensor(torch.arange(3, 10).unsqueeze(0), g[3:], (10, 8)) if sparse else g.clone()
        b.grad = g.clone()
        opt.step()
        ref.step()
    assert tuple(opt.state[a]["exp_avg_sq"].shape) == ((10,) if kind.startswith("partial") else (10, 8))
    assert torch.equal(a.detach()[:3], w0[:3]) and not opt.state[a]["exp_avg"][:3].any()
    assert not opt.state[a]["exp_avg_sq"][:3].any()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(a.detach()[3:], w0[3:])


def test_lazy_lamb_on_cpu_trains_through_torch_optim_as_the_reference_does():
    cfg = LazyLamb(lr=0.01, weight_decay=0.01)
    ref, fast, opt = train_both(lambda: M.BagList(rows=ROWS), lambda s: M.bag_inputs(rows=ROWS, seed=s), cfg,
                                lambda p: LazyLambReference(p, lr=0.01, weight_decay=0.01), steps=8, backend="auto")
    assert all("torch.optim in opt.step()" in g.optimizer and "CUDA only" in g.why for g in fast.report.groups)
    assert any(isinstance(o, LazyLambTorch) for o in opt.fallbacks)
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=k)


def test_fbgemm_takes_lamb_on_cuda_only_and_fxrec_sizes_its_two_moments():
    from fxrec.planner.cost import optimizer_kind, optimizer_state_bytes
    from fxrec.runtime.kernels.fbgemm_tbe import make_training_tbe
    from fxrec.runtime.specs import FusedSpec

    with pytest.raises(ValueError, match="CPU build has no fused lamb"):
        make_training_tbe([(10, 4)], [0], "sum", torch.device("cpu"), FusedSpec("lamb", 0.01))
    assert optimizer_kind(LazyLamb()) == "lamb" and optimizer_state_bytes("lamb", 100, 16) == 100 * 16 * 8
    with pytest.raises(ValueError, match="LazyLamb betas must be in"):
        LazyLamb(betas=(0.9, 1.0))


def test_a_lazy_lamb_model_made_for_cuda_keeps_its_moments_and_step_through_a_checkpoint(decided_for_cuda, tmp_path):
    a = _made_for_cuda(LazyLamb(lr=0.01))
    assert {g.fused for g in a.report.groups} == {"lamb"}
    _fill_states(a, 5, seed=2)
    with pytest.raises(RuntimeError, match="fused lamb runs on CUDA only, not cpu"):
        a(*M.bag_inputs(rows=ROWS, seed=1)).sum().backward()
    fxrec.checkpoint.save_model(a, tmp_path / "ck")
    b = _made_for_cuda(LazyLamb(lr=0.01))
    fxrec.checkpoint.load_into_model(b, tmp_path / "ck")
    _assert_same_states(_states(b), _states(a))


# ------------------------------------------------------------------------- PartialRowWiseAdam
def test_partial_rowwise_adam_trains_through_transform_and_fuses_on_cuda_except_padded_tables():
    cfg = PartialRowWiseAdam(lr=0.01)
    ref, fast, opt = train_both(lambda: M.BagList(rows=ROWS), lambda s: M.bag_inputs(rows=ROWS, seed=s), cfg,
                                lambda p: PartialRowWiseAdamReference(p, lr=0.01), steps=8, backend="auto")
    assert any(isinstance(o, PartialRowWiseAdamTorch) for o in opt.fallbacks)
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=k)
    r = fxrec.explain(M.BagList(rows=ROWS), M.bag_inputs(rows=ROWS), device="cuda", optimizer=cfg)
    assert [(g.kernel_train, g.fused) for g in r.groups] == [("fbgemm", "partial_rowwise_adam")]
    from fxrec.planner.cost import optimizer_kind, optimizer_state_bytes

    for c in (cfg, PartialRowWiseLamb(lr=0.01)):  # fbgemm averages over the padded width: not fused
        r = fxrec.explain(M.BagList(rows=ROWS, dim=6), M.bag_inputs(rows=ROWS), device="cuda", optimizer=c)
        (g,) = r.groups
        assert g.fused == "" and "stored padded to a multiple of 4 columns" in g.why, g.why
        assert optimizer_kind(c) == c.kind
        assert optimizer_state_bytes(c.kind, 100, 16) == 100 * 16 * 4 + 100 * 4


def test_a_partial_rowwise_adam_model_made_for_cuda_checkpoints_its_row_moments(decided_for_cuda, tmp_path):
    a = _made_for_cuda(PartialRowWiseAdam(lr=0.01))
    states = _states(a)
    assert [tuple(t.shape) for t in states[0][1][0].values()] == [(ROWS[0], 8), (ROWS[0],)]
    _fill_states(a, 4, seed=6)
    fxrec.checkpoint.save_model(a, tmp_path / "ck")
    b = _made_for_cuda(PartialRowWiseAdam(lr=0.01))
    fxrec.checkpoint.load_into_model(b, tmp_path / "ck")
    _assert_same_states(_states(b), _states(a))


def _column_wise_row_means(rank, world, root):
    from tests import test_checkpoint as C

    torch.manual_seed(0)
    model = C.Model()
    example = C.local_batch(C.global_batch(C.LOCAL_B * world, 0), rank, C.LOCAL_B)
    plan = fxrec.plan(model, C.global_batch(C.LOCAL_B * world, 0), world_size=world, memory_per_rank="1GB",
                      pins={"bags.1": "column_wise"}, batch_size=C.LOCAL_B)  # (the same plan on every rank)
    # (row-wise Adagrad's refusal: tests/test_sharding.py)
    with pytest.raises(fxrec.pass_infra.InputError, match=r"tables \['bags.1'\] are planned column_wise and train "
                                                          r"with partial row-wise Adam, whose per-row state"):
        fxrec.transform(model, example, plan=plan, optimizer={"bags.1": PartialRowWiseAdam(lr=0.1)})


def test_a_per_row_mean_optimizer_on_a_column_wise_table_is_refused(tmp_path):
    from tests import test_checkpoint as C

    C.spawn(_column_wise_row_means, 2, tmp_path)


def test_an_optimizer_state_dict_of_other_state_shapes_is_refused_before_anything_loads(decided_for_cuda):
    """PartialRowWiseAdam's exp_avg_sq is one a row; LazyAdam's the table's shape: same names, and a
    table as wide as it is long would take the one for the other without a word."""
    rows = (8, 8, 8)  # rows == dim: [rows] broadcasts into [rows, dim]
    a = _made_for_cuda(PartialRowWiseAdam(lr=0.01), rows=rows)
    b = _made_for_cuda(LazyAdam(lr=0.01), rows=rows)
    _fill_states(a, 3, seed=7)
    before = _states(b)
    with pytest.raises(ValueError, match=r"optimizer state 'bags.0.weight.exp_avg_sq' is \(8,\) in the state dict "
                                         r"and \(8, 8\) here"):
        b.make_optimizer(torch.optim.SGD, lr=0.1).load_state_dict(a.make_optimizer(torch.optim.SGD, lr=0.1).state_dict())
    _assert_same_states(_states(b), before)
