"""Fused embedding optimizers: 20 training steps against torch.optim on the plain model."""

import copy
import dataclasses
import inspect
import re

import pytest
import torch
from torch import nn

import fxrec
from fxrec.pass_infra import InputError
from fxrec.optim import RowWiseAdagradTorch
from fxrec.testing import group_calls
from tests import models as M

ROWS = (40, 30, 20)


class RowWiseAdagradReference(torch.optim.Optimizer):
    """fbgemm's row-wise Adagrad written out on dense gradients, independently of fxrec:
    per row r: sum[r] += mean(g[r]**2);  w[r] -= lr * g[r] / (sqrt(sum[r]) + eps), rows with g == 0 untouched.
    With weight decay (fbgemm's optimizers.py, rowwise_adagrad): "l2" uses g + wd * w in place of
    g throughout; "decoupled" first shrinks the row by lr * wd. With max_norm (its split_post_update),
    an updated row whose L2 norm is over max_norm is then multiplied by max_norm / norm."""

    def __init__(self, params, lr, eps=1e-8, weight_decay=0.0, mode="l2", max_norm=0.0):
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay, mode=mode, max_norm=max_norm))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                s = self.state[p].setdefault("sum", torch.zeros(p.shape[0], device=p.device))
                g = p.grad.to_dense()
                touched = g.abs().sum(1) > 0
                w = p[touched]
                g = g[touched]
                if group["mode"] == "l2":
                    g = g + wd * w
                elif wd:
                    w = w * (1 - lr * wd)
                s[touched] += (g ** 2).mean(1)
                w = w - lr * g / (s[touched].sqrt() + eps).unsqueeze(1)
                if group["max_norm"]:
                    norm = (w ** 2).sum(1, keepdim=True).sqrt()
                    over = (norm > group["max_norm"]).squeeze(1)
                    w[over] = w[over] * (group["max_norm"] / norm[over])
                p[touched] = w


def duplicate_heavy_inputs(seed, batch=6):
    """Bag inputs with empty bags and ids repeated within bags and across the batch."""
    dense, ids, offs = M.bag_inputs(rows=ROWS, batch=batch, seed=seed)
    ids = [torch.where(torch.rand(i.shape, generator=torch.Generator().manual_seed(seed)) < 0.5, i % 3, i) for i in ids]
    return dense, ids, offs


CASES = {
    "sgd": (fxrec.optim.SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1), "fused"),
    "adagrad": (fxrec.optim.Adagrad(lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1), "fused"),
    "adagrad_eps": (fxrec.optim.Adagrad(lr=0.1, eps=1e-3), lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-3), "fused"),
    "rowwise_adagrad": (fxrec.optim.RowWiseAdagrad(lr=0.1), lambda p: RowWiseAdagradReference(p, lr=0.1), "fused"),
    "adam_fallback": (fxrec.optim.Adam(lr=0.01), lambda p: torch.optim.Adam(p, lr=0.01), "fallback"),
    "sgd_momentum_fallback": (fxrec.optim.SGD(lr=0.1, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "fallback"),
}


def train_both(model_fn, inputs_fn, opt_cfg, torch_opt, steps=20, backend="fbgemm", **transform_kw):
    model = model_fn()
    fast = fxrec.transform(model, inputs_fn(0), optimizer=opt_cfg, backend=backend, **transform_kw)
    ref = copy.deepcopy(model)
    tables = {n for n, _ in ref.named_parameters() if n in fast.meta["fxrec_table_optimizers"]}
    ref_opts = [torch_opt([p for n, p in ref.named_parameters() if n in tables])]
    dense = [p for n, p in ref.named_parameters() if n not in tables]
    if dense:
        ref_opts.append(torch.optim.Adam(dense, lr=1e-3))
    opt = fast.make_optimizer(torch.optim.Adam, lr=1e-3)
    for step in range(steps):
        x = inputs_fn(step + 1)
        for o in ref_opts:
            o.zero_grad()
        ref(*x).sin().sum().backward()
        for o in ref_opts:
            o.step()
        opt.zero_grad()
        fast(*x).sin().sum().backward()
        opt.step()
    return ref, fast, opt


@pytest.mark.parametrize("case", sorted(CASES))
def test_twenty_steps_match_torch_optim(case):
    opt_cfg, torch_opt, where = CASES[case]
    ref, fast, opt = train_both(lambda: M.BagList(rows=ROWS), duplicate_heavy_inputs, opt_cfg, torch_opt)
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=k)
    assert where in ("fused" if "fused" in fast.report.groups[0].optimizer else "fallback")
    if where == "fused":
        assert all(fast.get_parameter(f"bags.{i}.weight").grad is None for i in range(3))


def test_shared_table_repeated_across_features_fused_rowwise():
    ref, fast, _ = train_both(
        M.SharedTables, lambda s: M.shared_inputs(seed=s), fxrec.optim.RowWiseAdagrad(lr=0.2),
        lambda p: RowWiseAdagradReference(p, lr=0.2),
    )
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=k)


@pytest.mark.parametrize("decay", [None, "l2", "decoupled"])
@pytest.mark.parametrize("sparse", [False, True])
def test_torch_rowwise_fallback_matches_the_reference(sparse, decay):
    """RowWiseAdagrad's torch.optim fallback (where no kernel fuses it) against the reference,
    with each weight decay mode."""
    model = M.BagList(rows=ROWS)
    for b in model.bags:
        b.sparse = sparse
    ref = copy.deepcopy(model)
    wd = 0.5 if decay else 0.0
    cfg = fxrec.optim.RowWiseAdagrad(lr=0.1, weight_decay=wd, weight_decay_mode=decay or "l2")
    opt = cfg.torch_optimizer(list(model.bags.parameters()), sparse=sparse)
    assert isinstance(opt, RowWiseAdagradTorch)
    ref_opt = RowWiseAdagradReference(list(ref.bags.parameters()), lr=0.1, weight_decay=wd, mode=decay or "l2")
    for step in range(10):
        x = duplicate_heavy_inputs(step)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(*x).sin().sum().backward()
            o.step()
    for (k, a), (_, b) in zip(ref.state_dict().items(), model.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=k)


def test_lr_scheduler_changes_the_fused_learning_rate():
    model = M.BagList(rows=ROWS)
    fast = fxrec.transform(model, M.bag_inputs(rows=ROWS), optimizer=fxrec.optim.SGD(lr=0.1), backend="fbgemm")
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = fast.make_optimizer(torch.optim.SGD, lr=0.1)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (ref_opt, opt)]
    for step in range(8):
        x = M.bag_inputs(rows=ROWS, seed=step)
        for m, o, s in ((ref, ref_opt, scheds[0]), (fast, opt, scheds[1])):
            o.zero_grad()
            m(*x).sin().sum().backward()
            o.step()
            s.step()
    assert opt.fused_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4)
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=k)


@pytest.mark.parametrize("backend", ["fbgemm", "native"])
@pytest.mark.parametrize("opt_cfg", [fxrec.optim.Adagrad(lr=0.1), fxrec.optim.RowWiseAdagrad(lr=0.1), fxrec.optim.Adam(lr=0.01)],
                         ids=["adagrad", "rowwise", "adam_fallback"])
def test_checkpoint_round_trip_mid_training_gives_the_same_trajectory(opt_cfg, backend, tmp_path):
    """fbgemm's fused kernels and fxrec's native ones keep the states in the same place."""
    model = M.BagList(rows=ROWS)
    example = M.bag_inputs(rows=ROWS)

    def run(m, o, steps):
        for s in steps:
            o.zero_grad()
            m(*duplicate_heavy_inputs(s)).sin().sum().backward()
            o.step()

    a = fxrec.transform(model, example, optimizer=opt_cfg, backend=backend)
    opt_a = a.make_optimizer(torch.optim.Adam, lr=1e-3)
    run(a, opt_a, range(5))
    torch.save({"model": a.state_dict(), "opt": opt_a.state_dict()}, tmp_path / "ckpt.pt")
    run(a, opt_a, range(5, 10))

    b = fxrec.transform(M.BagList(rows=ROWS), example, optimizer=opt_cfg, backend=backend)
    opt_b = b.make_optimizer(torch.optim.Adam, lr=1e-3)
    ckpt = torch.load(tmp_path / "ckpt.pt")
    b.load_state_dict(ckpt["model"])
    opt_b.load_state_dict(ckpt["opt"])
    run(b, opt_b, range(5, 10))
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), k
    if "fused" in a.report.groups[0].optimizer:
        assert any(k.endswith(".sum") for k in ckpt["opt"]["fused"])


def test_per_table_optimizers_split_groups_and_bad_keys_are_named():
    model = M.BagList(rows=ROWS)
    inputs = M.bag_inputs(rows=ROWS)
    spec = {"bags.0": fxrec.optim.SGD(lr=0.1), "bags.[12]": fxrec.optim.RowWiseAdagrad(lr=0.1)}
    fast = fxrec.transform(model, inputs, optimizer=spec, backend="fbgemm")
    assert sorted(tuple(g.tables) for g in fast.report.groups) == [("bags.0",), ("bags.1", "bags.2")]
    assert len(group_calls(fast)) == 2
    with pytest.raises(ValueError, match=r"\['emb\.\*'\] match no embedding table"):
        fxrec.transform(model, inputs, optimizer={"emb.*": fxrec.optim.SGD()})
    # the audit's case: a later key for one table after a glob naming it was called a key that "matches no
    # table", while the table it names is listed; the first key that names a table decides for it
    with pytest.raises(ValueError, match=r"optimizer key 'bags.0' decides for no table: every table it names "
                                         r"\(\['bags.0'\]\) an earlier key names \('bags.\*'\).*put 'bags.0' first"):
        fxrec.transform(model, inputs, optimizer={"bags.*": fxrec.optim.Adagrad(lr=0.1), "bags.0": fxrec.optim.SGD()})
    sgd = fxrec.optim.SGD(lr=0.1)
    # a later key giving its tables what the earlier one gives them is taken (nothing is lost)
    fxrec.transform(model, inputs, optimizer={"bags.*": sgd, "bags.0": sgd, "bags.0.weight": fxrec.optim.SGD(lr=0.1)})
    # two keys of one optimizer, each deciding for its own tables
    fast = fxrec.transform(model, inputs, optimizer={"bags.[01]": sgd, "bags.2": sgd})
    assert fast.report.groups and all("sgd" in g.optimizer.lower() for g in fast.report.groups), fast.report.groups
    with pytest.raises(TypeError, match="fxrec.optim"):
        fxrec.transform(model, inputs, optimizer=torch.optim.SGD)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_the_combined_optimizer_copied_with_its_model_steps_the_copy_as_the_original_steps_itself(how):
    """torch.optim.Optimizer's pickled state keeps defaults, state and param_groups only: a copy of
    make_optimizer()'s optimizer had lost its dense, fallback and fused parts, and its first
    zero_grad() raised AttributeError (found by the differential fuzzer)."""
    import io

    model = M.BagList(rows=ROWS)
    inputs = M.bag_inputs(rows=ROWS)
    spec = {"bags.0": fxrec.optim.Adagrad(lr=0.1), "bags.*": fxrec.optim.SGD(lr=0.05)}
    fast = fxrec.transform(model, inputs, optimizer=spec)
    opt = fast.make_optimizer(torch.optim.Adagrad, lr=0.1)

    def step(m, o, seed):
        o.zero_grad()
        m(*M.bag_inputs(rows=ROWS, seed=seed)).pow(2).sum().backward()
        o.step()

    for seed in range(2):
        step(fast, opt, seed)
    if how == "deepcopy":
        fast2, opt2 = copy.deepcopy((fast, opt))
    else:
        buf = io.BytesIO()
        torch.save({"m": fast, "o": opt}, buf)
        buf.seek(0)
        both = torch.load(buf, weights_only=False)
        fast2, opt2 = both["m"], both["o"]
    for seed in range(2, 5):
        step(fast2, opt2, seed)
        step(fast, opt, seed)
    for (k, x), (_, y) in zip(fast.state_dict().items(), fast2.state_dict().items()):
        assert torch.equal(x, y), k
    assert not torch.equal(fast2.state_dict()["bags.0.weight"], model.state_dict()["bags.0.weight"])


def test_fused_training_leaves_the_original_model_and_other_transforms_alone():
    model = M.BagList(rows=ROWS)
    before = copy.deepcopy(model.state_dict())
    inputs = M.bag_inputs(rows=ROWS)
    a = fxrec.transform(model, inputs, optimizer=fxrec.optim.Adagrad(lr=0.5), backend="fbgemm", verify=True)
    b = fxrec.transform(model, inputs, optimizer=fxrec.optim.Adagrad(lr=0.5), backend="fbgemm")
    a(*inputs).sum().backward()  # the update happens here
    assert not torch.equal(a.state_dict()["bags.0.weight"], before["bags.0.weight"])
    for k, v in before.items():
        assert torch.equal(model.state_dict()[k], v), k
        assert torch.equal(b.state_dict()[k], v), k


def test_deepcopy_keeps_the_fused_optimizer_state():
    model = M.BagList(rows=ROWS)
    fast = fxrec.transform(model, M.bag_inputs(rows=ROWS), optimizer=fxrec.optim.Adagrad(lr=0.5), backend="fbgemm")
    opt = fast.make_optimizer()
    for s in range(3):
        opt.zero_grad()
        fast(*M.bag_inputs(rows=ROWS, seed=s)).sum().backward()
        opt.step()
    twin = copy.deepcopy(fast)
    twin_opt = twin.make_optimizer()
    for m, o in ((fast, opt), (twin, twin_opt)):
        o.zero_grad()
        m(*M.bag_inputs(rows=ROWS, seed=9)).sum().backward()
        o.step()
    for (k, x), (_, y) in zip(fast.state_dict().items(), twin.state_dict().items()):
        assert torch.equal(x, y), k
    assert torch.equal(opt.state_dict()["fused"]["bags.0.weight.sum"], twin_opt.state_dict()["fused"]["bags.0.weight.sum"])


def test_report_says_where_each_optimizer_runs():
    fast = fxrec.transform(M.BagList(rows=ROWS), M.bag_inputs(rows=ROWS),
                           optimizer={"bags.0": fxrec.optim.SGD(lr=0.1, weight_decay=0.01), "bags.*": fxrec.optim.SGD(lr=0.1)},
                           backend="fbgemm")
    text = str(fast.report)
    assert "weight_decay=0.01, nesterov=False): torch.optim in opt.step()" in text
    assert "SGD(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False): fused into backward" in text


def test_table_left_as_it_was_still_gets_its_optimizer_from_make_optimizer():
    """mode="max" bags are not lowered; their optimizer runs as torch.optim.Adagrad in step()."""
    model = M.BagList(rows=ROWS, mode="max")
    ref, fast, opt = train_both(lambda: model, lambda s: M.bag_inputs(rows=ROWS, seed=s),
                                fxrec.optim.Adagrad(lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1), steps=5)
    assert len(fast.report.left_alone) == 3
    assert [type(o).__name__ for o in opt.fallbacks] == ["Adagrad"]
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=k)


def test_make_optimizer_holds_frozen_parameters_as_torch_optim_does():
    """A table frozen mid-training was left out of an optimizer made after (docs: every parameter
    that is not a table with an fxrec optimizer): the state_dict of one made before did not load into
    it (torch's 'parameter group that doesn't match the size'). From a fuzz of training loops."""
    model = M.BagList(rows=ROWS)
    x = M.bag_inputs(rows=ROWS)
    fast = fxrec.transform(model, x)
    opt = fast.make_optimizer(torch.optim.Adam, lr=0.1)
    fast(*x).sum().backward()
    opt.step()
    fast.get_parameter("bags.1.weight").requires_grad_(False)
    again = fxrec.transform(model, x)
    again.load_state_dict(fast.state_dict())
    again.get_parameter("bags.1.weight").requires_grad_(False)
    opt2 = again.make_optimizer(torch.optim.Adam, lr=0.1)
    assert sum(len(g["params"]) for g in opt2.param_groups) == len(list(again.parameters()))
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # (as from a file: torch's load shares the tensors)
    frozen = again.get_parameter("bags.1.weight").detach().clone()
    for m, o in ((fast, opt), (again, opt2)):
        o.zero_grad()
        m(*M.bag_inputs(rows=ROWS, seed=1)).sum().backward()
        o.step()
    for (k, a), (_, b) in zip(fast.state_dict().items(), again.state_dict().items()):
        torch.testing.assert_close(b, a, msg=k)
    # frozen, it took no step (Adam's moments of it kept)
    assert torch.equal(again.get_parameter("bags.1.weight"), frozen)


@pytest.mark.parametrize("opt_cfg,torch_opt", [
    (fxrec.optim.SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    (fxrec.optim.RowWiseAdagrad(lr=0.1), lambda p: RowWiseAdagradReference(p, lr=0.1)),
], ids=["sgd", "rowwise"])
def test_default_rule_fuses_the_optimizer_and_matches_torch(opt_cfg, torch_opt):
    ref, fast, opt = train_both(lambda: M.BagList(rows=ROWS), duplicate_heavy_inputs, opt_cfg, torch_opt, steps=10,
                                backend="auto")
    g = fast.report.groups[0]
    assert "fused into backward" in g.optimizer and g.fused and g.decided_by == "rule"
    assert bool(opt.fused) and not opt.fallbacks
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=k)


def autograd_node_names(out):
    seen, todo, names = set(), [out.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


def with_torch_sgd(fast, impl="torch"):
    """Switch every fused SGD group to fxrec's own fused update: ``"torch"`` (the reference
    kernel: PyTorch's forward, index_add_ of the rows in fxrec's backward) or ``"native"``
    (fxrec's kernels, pooled groups only; sequence groups keep the reference)."""
    for m in fast.modules():
        if getattr(m, "fused", None) is not None:
            native = impl == "native" and m.pooling != "none"
            m.set_kernels("native" if native else "reference", m.kernel_eval)
    return fast


@pytest.mark.parametrize("impl", ["torch", "native"])
@pytest.mark.parametrize("kernel_eval", ["fbgemm", "reference"])
@pytest.mark.parametrize("case", ["bag_list", "bag_list_mean", "shared", "weighted", "sequence"])
def test_fxrec_fused_sgd_matches_torch_sgd(case, kernel_eval, impl):
    makers = {
        "bag_list": (lambda: M.BagList(rows=ROWS), duplicate_heavy_inputs),
        "bag_list_mean": (lambda: M.BagList(rows=ROWS, mode="mean"), duplicate_heavy_inputs),
        "shared": (M.SharedTables, lambda s: M.shared_inputs(seed=s)),
        "weighted": (M.WeightedBags, lambda s: M.weighted_inputs(seed=s)),
        "sequence": (M.SequenceMean, lambda s: M.seq_inputs(seed=s)),
    }
    model_fn, inputs_fn = makers[case]
    model = model_fn()
    fast = with_torch_sgd(fxrec.transform(model, inputs_fn(0), optimizer=fxrec.optim.SGD(lr=0.1), backend="fbgemm"), impl)
    for m in fast.modules():
        if getattr(m, "fused", None) is not None:
            m.set_kernels(m.kernel_train, kernel_eval)
    ref = copy.deepcopy(model)
    tables = set(fast.meta["fxrec_table_optimizers"])
    ref_opt = torch.optim.SGD([p for n, p in ref.named_parameters() if n in tables], lr=0.1)
    ref_dense = [p for n, p in ref.named_parameters() if n not in tables]
    ref_dense_opt = torch.optim.SGD(ref_dense, lr=0.1) if ref_dense else None
    opt = fast.make_optimizer(torch.optim.SGD, lr=0.1)
    expected = {"torch": "LookupWithGradsBackward", "native": "NativeFusedFunctionBackward"}[impl]
    assert expected in autograd_node_names(fast(*inputs_fn(1)))  # the update under test really runs
    for step in range(20):
        x = inputs_fn(step + 1)
        ref_opt.zero_grad()
        if ref_dense_opt:
            ref_dense_opt.zero_grad()
        ref(*x).sin().sum().backward()
        ref_opt.step()
        if ref_dense_opt:
            ref_dense_opt.step()
        opt.zero_grad()
        fast(*x).sin().sum().backward()
        opt.step()
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=k)
    assert all(fast.get_parameter(n).grad is None for n in tables)


@pytest.mark.parametrize("name", ["SGD", "Adagrad", "RowWiseAdagrad", "Adam"])
def test_issue_training_loop_with_scheduler_resumes_exactly(name):
    """The loop of examples/train_fused.py (make_optimizer, StepLR, checkpoint mid-way) on a
    small DLRM: the resumed run ends on the same bits as the uninterrupted one."""
    from examples.train_fused import OPTIMIZERS, run

    same, loss, resumed_loss = run(name, OPTIMIZERS[name], cap=300, steps=6, batch=32, verbose=False)
    assert same and loss == resumed_loss


class TiedOutput(torch.nn.Module):
    """The item table is also the output projection: its gradient has two sources."""

    def __init__(self):
        super().__init__()
        self.item = torch.nn.EmbeddingBag(30, 8, mode="sum")
        self.other = torch.nn.EmbeddingBag(20, 8, mode="sum")

    def forward(self, ids, offsets):
        h = self.item(ids, offsets) + self.other(ids % 20, offsets)
        return h @ self.item.weight.t()


def test_table_also_used_outside_its_lookups_is_not_fused():
    inputs_fn = lambda s: (torch.randint(0, 30, (9,), generator=torch.Generator().manual_seed(s)), torch.tensor([0, 2, 5]))  # noqa: E731
    # (3 steps: the tied output's growth amplifies fbgemm's rounding of the other table's fused
    # update; on fbgemm-gpu-cpu 1.6 10 steps grew it past the tolerance)
    ref, fast, opt = train_both(TiedOutput, inputs_fn, fxrec.optim.SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1), steps=3)
    (g,) = [g for g in fast.report.groups if "item" in g.tables]
    assert "table 'item' is also used outside its lookups" in g.why and g.tables == ["item"]
    # (a group of its own: the other table keeps its fused update)
    assert opt.fused and opt.fallbacks
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=k)


class PaddedSequence(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hist = torch.nn.Embedding(50, 8, padding_idx=0)
        self.item = torch.nn.Embedding(30, 8)

    def forward(self, hist, item):
        return torch.cat([self.hist(hist).sum(1), self.item(item)], 1)


def padded_inputs(s):
    g = torch.Generator().manual_seed(s)
    hist = torch.randint(0, 50, (6, 4), generator=g)
    hist[:, :2] = 0  # plenty of padding
    return hist, torch.randint(0, 30, (6,), generator=g)


@pytest.mark.parametrize("opt_cfg,torch_opt", [
    (fxrec.optim.SGD(lr=0.5), lambda p: torch.optim.SGD(p, lr=0.5)),
    (fxrec.optim.Adagrad(lr=0.5), lambda p: torch.optim.Adagrad(p, lr=0.5)),
], ids=["sgd", "adagrad"])
@pytest.mark.parametrize("backend", ["fbgemm", "native", "auto"])
def test_padding_row_is_never_trained(opt_cfg, torch_opt, backend):
    """fbgemm's fused kernels know no padding row: fxrec must not let them update it."""
    ref, fast, _ = train_both(PaddedSequence, padded_inputs, opt_cfg, torch_opt, steps=5, backend=backend,
                              timing_rounds=2)
    assert torch.equal(fast.state_dict()["hist.weight"][0], ref.hist.weight.detach()[0])
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=k)


@pytest.mark.parametrize("impl", ["torch", "native"])
def test_fxrec_fused_sgd_survives_two_forwards_before_backward(impl):
    model = M.BagList(rows=ROWS)
    fast = with_torch_sgd(fxrec.transform(model, M.bag_inputs(rows=ROWS), optimizer=fxrec.optim.SGD(lr=0.1), backend="fbgemm"), impl)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = fast.make_optimizer(torch.optim.SGD, lr=0.1)
    a, b = M.bag_inputs(rows=ROWS, seed=1), M.bag_inputs(rows=ROWS, seed=2)
    (ref(*a).sum() + ref(*b).pow(2).sum()).backward()
    ref_opt.step()
    (fast(*a).sum() + fast(*b).pow(2).sum()).backward()  # pairwise loss: two forwards, one backward
    opt.step()
    for (k, x), (_, y) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5, msg=k)


class _SeqAndPooled(torch.nn.Module):
    """An unpooled sequence lookup (a sequence group) beside pooled ones, no padding rows."""

    def __init__(self):
        super().__init__()
        self.seq = torch.nn.Embedding(40, 8)
        self.bag = torch.nn.Embedding(30, 8)

    def forward(self, s, b):
        return torch.cat([self.seq(s).sum(1) * 0.5 + self.seq(s)[:, 0], self.bag(b).sum(1)], 1)


def _seq_pooled_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 40, (5, 3), generator=g), torch.randint(0, 30, (5, 2), generator=g)


@pytest.mark.parametrize("backend", ["reference", "native"])
@pytest.mark.parametrize("opt", ["sgd", "adagrad"])
def test_reference_and_native_first_keep_the_optimizer_exact(opt, backend):
    """backend='reference': SGD is fxrec's fused update after PyTorch's lookups; Adagrad, which
    the reference cannot fuse, goes to the next kernel of the rule (native for pooled groups,
    fbgemm for sequence groups). backend='native': sequence groups fall to the rule's next."""
    cfg, ref_opt = {
        "sgd": (fxrec.optim.SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
        "adagrad": (fxrec.optim.Adagrad(lr=0.1, eps=1e-8), lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-8)),
    }[opt]
    ref, fast, _ = train_both(_SeqAndPooled, _seq_pooled_inputs, cfg, ref_opt, steps=10, backend=backend)
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=k)


ADAGRADS = {
    "adagrad": (lambda: fxrec.optim.Adagrad(lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1)),
    "adagrad_eps": (lambda: fxrec.optim.Adagrad(lr=0.1, eps=1e-3), lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-3)),
    "rowwise_adagrad": (lambda: fxrec.optim.RowWiseAdagrad(lr=0.1), lambda p: RowWiseAdagradReference(p, lr=0.1)),
}
STYLES = {
    "bag_list": (lambda: M.BagList(rows=ROWS), duplicate_heavy_inputs),
    "bag_list_mean": (lambda: M.BagList(rows=ROWS, mode="mean"), duplicate_heavy_inputs),
    "shared": (M.SharedTables, lambda s: M.shared_inputs(seed=s)),
    "weighted": (M.WeightedBags, lambda s: M.weighted_inputs(seed=s)),
}


@pytest.mark.parametrize("style", sorted(STYLES))
@pytest.mark.parametrize("opt", sorted(ADAGRADS))
def test_native_adagrads_match_torch_optim(opt, style):
    """fxrec's Adagrad kernels (backend="native"): 20 steps against torch.optim.Adagrad / the
    row-wise reference, with duplicate ids, empty bags, a shared table, mean pooling, weights."""
    cfg, ref_opt = ADAGRADS[opt]
    model_fn, inputs_fn = STYLES[style]
    ref, fast, _ = train_both(model_fn, inputs_fn, cfg(), ref_opt, backend="native")
    assert "NativeFusedFunctionBackward" in autograd_node_names(fast(*inputs_fn(1)))
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=k)


@pytest.mark.parametrize("opt", ["adagrad", "rowwise_adagrad"])
def test_native_adagrad_hands_a_call_it_cannot_take_to_fbgemm_on_the_same_state(opt):
    """Per-sample weights that need a gradient: that step runs fbgemm's fused kernel, on the
    states the native kernel keeps, so the trajectory stays torch.optim's."""
    cfg, ref_opt = ADAGRADS[opt]

    def inputs(s):
        x = list(M.weighted_inputs(seed=s))
        if s % 2:
            x[2] = x[2].clone().requires_grad_()
        return tuple(x)

    ref, fast, _ = train_both(M.WeightedBags, inputs, cfg(), ref_opt, steps=10, backend="native")
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=k)


@pytest.mark.parametrize("opt", ["sgd", "adagrad", "rowwise_adagrad"])
def test_native_fused_update_leaves_a_frozen_table_alone(opt):
    cfg, ref_opt = {**ADAGRADS, "sgd": (lambda: fxrec.optim.SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1))}[opt]

    def model_fn():
        m = M.BagList(rows=ROWS)
        m.bags[0].weight.requires_grad_(False)  # pretrained, frozen
        return m

    ref, fast, _ = train_both(model_fn, duplicate_heavy_inputs, cfg(), ref_opt, steps=5, backend="native")
    assert "NativeFusedFunctionBackward" in autograd_node_names(fast(*duplicate_heavy_inputs(1)))
    assert torch.equal(fast.state_dict()["bags.0.weight"], ref.bags[0].weight)  # never updated, in either
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=k)


def test_fbgemm_fused_kernel_refuses_a_frozen_table_by_name():
    model = M.BagList(rows=ROWS)
    fast = fxrec.transform(model, M.bag_inputs(rows=ROWS), optimizer=fxrec.optim.Adagrad(lr=0.1), backend="fbgemm")
    fast.get_parameter("bags.1.weight").requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"\['bags\.1'\] are frozen"):
        fast(*M.bag_inputs(rows=ROWS, seed=1)).sum().backward()


@pytest.mark.parametrize("opt", [fxrec.optim.SGD(lr=0.1), None], ids=["fused_sgd", "no_optimizer"])
def test_every_table_frozen_leaves_them_alone_and_trains_the_dense_layer(opt):
    """Fine-tuning the dense layers over frozen tables: fbgemm's TBE still looks them up, its
    backward never runs (it would apply the fused update), and the output needs a gradient only
    through the dense layer, as in PyTorch."""
    model = M.BagList(rows=ROWS)
    fast = fxrec.transform(model, M.bag_inputs(rows=ROWS), optimizer=opt, backend="fbgemm")
    tables = [f"bags.{i}.weight" for i in range(len(ROWS))]
    for n in tables:
        fast.get_parameter(n).requires_grad_(False)
        model.get_parameter(n).requires_grad_(False)
    before = {n: fast.get_parameter(n).detach().clone() for n in tables}
    x = M.bag_inputs(rows=ROWS, seed=2)
    fast(*x).sum().backward()
    model(*x).sum().backward()
    assert all(torch.equal(fast.get_parameter(n), before[n]) for n in tables)
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(fast.get_parameter(n).grad, p.grad, msg=n)
    # the group's own output needs no gradient when no table does
    assert not fast.fxrec_group_0(x[1], x[2], [None] * len(ROWS), [fast.get_parameter(n) for n in tables]).requires_grad


class _PaddedBesideLastOffset(torch.nn.Module):
    """A bag the native kernel hands to another kernel on every call (include_last_offset with a
    padding_idx) in one group with nn.Embedding's padding row."""

    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(10, 4, mode="sum", include_last_offset=True, padding_idx=1)
        self.seq = torch.nn.Embedding(10, 4, padding_idx=0)

    def forward(self, ids, offsets, hist):
        return torch.cat([self.bag(ids, offsets), self.seq(hist).sum(1)], 1)


def _padded_beside_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 10, (7,), generator=g), torch.tensor([0, 2, 2, 5]),
            torch.cat([torch.zeros(3, 1, dtype=torch.long), torch.randint(0, 10, (3, 2), generator=g)], 1))


@pytest.mark.parametrize("opt", ["adagrad", "rowwise_adagrad"])
def test_adagrad_never_trains_a_padding_row_through_a_fallback_kernel(opt):
    """fbgemm's fused Adagrad would update nn.Embedding's padding row: the group is fused by
    fxrec's kernels (native, or the reference for the calls native hands back: include_last_offset
    beside a padding row), which leave the row alone, on the states in fbgemm's TBE."""
    cfg, ref_opt = ADAGRADS[opt]
    ref, fast, _ = train_both(_PaddedBesideLastOffset, _padded_beside_inputs, cfg(), ref_opt, steps=5, backend="auto")
    g = fast.report.groups[0]
    assert g.fused == opt and g.kernel_train in ("native", "reference"), g
    if opt == "rowwise_adagrad":
        assert "padding row" in g.why, g  # fbgemm (first in the rule) was passed over, and why
    assert torch.equal(fast.state_dict()["seq.weight"][0], torch.zeros(4))
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=k)


def test_fused_sgd_still_updates_when_fbgemm_cannot_take_a_call(monkeypatch):
    """A group on fbgemm's fused SGD whose call falls to PyTorch's lookups: fxrec's backward
    applies the update (no gradient is left for nobody to apply)."""
    from fxrec.runtime.kernels import fbgemm as fbgemm_kernel

    model = M.BagList(rows=ROWS)
    fast = fxrec.transform(model, M.bag_inputs(rows=ROWS), optimizer=fxrec.optim.SGD(lr=0.1), backend="fbgemm")
    assert fast.report.groups[0].kernel_train == "fbgemm"
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = fast.make_optimizer(torch.optim.SGD, lr=0.1)
    monkeypatch.setattr(fbgemm_kernel, "usable", lambda params, group=None: False)
    for step in range(3):
        x = M.bag_inputs(rows=ROWS, seed=step + 1)
        for m, o in ((ref, ref_opt), (fast, opt)):
            o.zero_grad()
            m(*x).sin().sum().backward()
            o.step()
    assert all(p.grad is None for n, p in fast.named_parameters() if n.startswith("bags"))
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=k)


@pytest.mark.parametrize("backend", ["native", "reference"])
@pytest.mark.parametrize("mode", ["l2", "decoupled"])
@pytest.mark.parametrize("style", ["bag_list", "shared", "weighted"])
def test_rowwise_adagrad_with_weight_decay_matches_the_written_out_update_on_every_kernel(style, mode, backend):
    """RowWiseAdagrad(weight_decay=, weight_decay_mode=) fused by fxrec's native kernel and the
    reference's update (fbgemm's CUDA kernel: tests/test_gpu.py): 20 steps against the reference
    written out from fbgemm's optimizer source (large decay, so a kernel that ignored it would fail)."""
    model_fn, inputs_fn = STYLES[style]
    cfg = fxrec.optim.RowWiseAdagrad(lr=0.1, weight_decay=0.5, weight_decay_mode=mode)
    ref, fast, _ = train_both(model_fn, inputs_fn, cfg,
                              lambda p: RowWiseAdagradReference(p, lr=0.1, weight_decay=0.5, mode=mode), backend=backend)
    assert {g.kernel_train for g in fast.report.groups} == {backend}, fast.report.groups
    assert all("fused" in g.optimizer for g in fast.report.groups)
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=k)
    plain, _, _ = train_both(model_fn, inputs_fn, fxrec.optim.RowWiseAdagrad(lr=0.1),
                             lambda p: RowWiseAdagradReference(p, lr=0.1), backend=backend)
    tables = list(fast.meta["fxrec_table_optimizers"])
    assert all(not torch.allclose(plain.state_dict()[k], ref.state_dict()[k], rtol=1e-3, atol=1e-3) for k in tables)


@pytest.mark.parametrize("backend", ["native", "reference"])
@pytest.mark.parametrize("decay", ["", "l2", "decoupled"])
@pytest.mark.parametrize("style", ["bag_list", "shared", "weighted"])
def test_rowwise_adagrad_with_max_norm_matches_the_written_out_update_on_every_kernel(style, decay, backend):
    """RowWiseAdagrad(max_norm=) fused by fxrec's native kernel and the reference's update (fbgemm's
    CUDA kernel: tests/test_gpu.py; its CPU kernel ignores max_norm): 20 steps against the update
    written out from fbgemm's source, alone and after weight decay. The cap is small enough that
    most rows the steps touch are over it: every such row ends at norm max_norm, the rows no step
    touched keep theirs, and the model trained without it differs."""
    model_fn, inputs_fn = STYLES[style]
    wd = 0.5 if decay else 0.0
    cfg = fxrec.optim.RowWiseAdagrad(lr=0.1, weight_decay=wd, weight_decay_mode=decay or "l2", max_norm=1.5)
    torch.manual_seed(7)
    start = model_fn().state_dict()
    torch.manual_seed(7)  # (train_both makes the same model first)
    ref, fast, _ = train_both(model_fn, inputs_fn, cfg, lambda p: RowWiseAdagradReference(
        p, lr=0.1, weight_decay=wd, mode=decay or "l2", max_norm=1.5), backend=backend)
    assert {g.kernel_train for g in fast.report.groups} == {backend}, fast.report.groups
    assert all("fused" in g.optimizer for g in fast.report.groups)
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=k)
    tables = list(fast.meta["fxrec_table_optimizers"])
    capped = 0
    for k in tables:
        w, w0 = fast.state_dict()[k], start[k]
        moved = (w != w0).any(1)
        assert (w[moved].norm(dim=1) <= 1.5 * (1 + 1e-5)).all(), k
        assert torch.equal(w[~moved], w0[~moved]), k
        capped += int(torch.isclose(w[moved].norm(dim=1), torch.tensor(1.5)).sum())
    assert capped >= 10, capped
    plain, _, _ = train_both(model_fn, inputs_fn, dataclasses.replace(cfg, max_norm=0.0), lambda p: RowWiseAdagradReference(
        p, lr=0.1, weight_decay=wd, mode=decay or "l2"), backend=backend)
    assert all(not torch.allclose(plain.state_dict()[k], ref.state_dict()[k], rtol=1e-3, atol=1e-3) for k in tables)


class _PaddedRows(nn.Module):
    """Padding rows that hold values (a pretrained table): a sequence lookup, its pooled form,
    and a bag, each with padding_idx 1 set to [3, 0, 0, 0]."""

    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(10, 4, padding_idx=1)
        self.s = nn.Embedding(10, 4, padding_idx=1)
        self.b = nn.EmbeddingBag(10, 4, mode="sum", padding_idx=1)
        with torch.no_grad():
            for m in (self.e, self.s, self.b):
                m.weight[1] = torch.tensor([3.0, 0.0, 0.0, 0.0])

    def forward(self, ids, bag_ids, offsets):
        return torch.cat([self.e(ids).flatten(1), self.s(ids).sum(1), self.b(bag_ids, offsets)], 1)


def _padded_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 10, (3, 3), generator=g)
    ids[0, 1] = 1  # a padding id in every batch
    bag_ids = torch.cat([torch.tensor([1]), torch.randint(0, 10, (5,), generator=g)])
    return ids, bag_ids, torch.tensor([0, 2, 4])


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("cfg", [dict(max_norm=0.5), dict(weight_decay=0.1, weight_decay_mode="decoupled"),
                                 dict(weight_decay=0.1)], ids=["max_norm", "decoupled", "l2"])
def test_a_padding_row_is_never_stepped_decayed_or_capped_by_a_fused_rowwise_adagrad(cfg, backend):
    """PyTorch gives a padding row no gradient, so no optimizer step moves it; with weight decay
    or max_norm a step on its zero gradient would (the reference's update stepped every id of the
    batch, padding ids too: sequence lookups, whatever the backend). 10 steps against the update
    written out, which steps only rows with a gradient; the padding rows keep [3, 0, 0, 0] and a
    state of 0."""
    opt = fxrec.optim.RowWiseAdagrad(lr=0.1, **cfg)
    ref_kw = dict(lr=0.1, weight_decay=cfg.get("weight_decay", 0.0), mode=cfg.get("weight_decay_mode", "l2"),
                  max_norm=cfg.get("max_norm", 0.0))
    ref, fast, _ = train_both(_PaddedRows, _padded_inputs, opt, lambda p: RowWiseAdagradReference(p, **ref_kw),
                              steps=10, backend=backend)
    assert all("fused" in g.optimizer for g in fast.report.groups), fast.report.groups
    for k in ("e.weight", "s.weight", "b.weight"):
        assert torch.equal(fast.state_dict()[k][1], torch.tensor([3.0, 0.0, 0.0, 0.0])), k
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=k)


def test_rowwise_adagrad_weight_decay_arguments_are_checked():
    with pytest.raises(ValueError, match="weight_decay_mode must be one of .*'l2', 'decoupled'.*got 'cowclip'"):
        fxrec.optim.RowWiseAdagrad(weight_decay=0.1, weight_decay_mode="cowclip")
    with pytest.raises(ValueError, match="weight_decay must be a number >= 0"):
        fxrec.optim.RowWiseAdagrad(weight_decay=-1.0)
    for bad in (-1.0, float("nan"), "2"):
        with pytest.raises(ValueError, match=f"RowWiseAdagrad max_norm must be a number >= 0, got {bad!r}"):
            fxrec.optim.RowWiseAdagrad(max_norm=bad)
    assert fxrec.optim.RowWiseAdagrad(lr=0.1).fused_spec().weight_decay_mode == ""
    assert fxrec.optim.RowWiseAdagrad(lr=0.1).fused_spec().options == ()
    assert fxrec.optim.RowWiseAdagrad(lr=0.1, max_norm=2).fused_spec().max_norm == 2.0
    assert fxrec.optim.RowWiseAdagrad(lr=0.1, weight_decay=0.1, weight_decay_mode="decoupled").fused_spec().weight_decay_mode == "decoupled"


def test_fbgemms_cpu_kernel_ignores_weight_decay_so_another_kernel_fuses_it():
    """fbgemm-gpu-cpu's row-wise Adagrad takes weight_decay and updates as without it (checked
    here by hand, so the refusal goes when fbgemm fixes it); backend="fbgemm" then runs the next
    kernel, and the report says why. On CUDA fbgemm's kernel is the choice."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen, WeightDecayMode)
    rows = []
    for wd, mode, cap in ((0.0, WeightDecayMode.NONE, 0.0), (0.5, WeightDecayMode.L2, 0.0),
                          (0.5, WeightDecayMode.DECOUPLE, 0.0), (0.0, WeightDecayMode.NONE, 0.01)):
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(10, 8, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            learning_rate=0.1, eps=1e-8, weight_decay=wd, weight_decay_mode=mode, max_norm=cap,
            pooling_mode=PoolingMode.SUM)
        with torch.no_grad():
            tbe.split_embedding_weights()[0].copy_(torch.arange(1.0, 81.0).view(10, 8) / 80)
        tbe(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3])).sum().backward()
        rows.append(tbe.split_embedding_weights()[0].clone())
    assert torch.equal(rows[0], rows[1]) and torch.equal(rows[0], rows[2]), "fbgemm's CPU kernel applies weight decay now"
    assert torch.equal(rows[0], rows[3]), "fbgemm's CPU kernel applies max_norm now"
    assert rows[0][1:4].norm(dim=1).min() > 0.1  # (so a cap of 0.01 would have shown)
    x = duplicate_heavy_inputs(0)
    for cfg, said in ((fxrec.optim.RowWiseAdagrad(lr=0.1, weight_decay=0.5), "weight decay (its CUDA build applies it)"),
                      (fxrec.optim.RowWiseAdagrad(lr=0.1, max_norm=1.0), "max_norm (its CUDA build applies it)"),
                      (fxrec.optim.RowWiseAdagrad(lr=0.1, weight_decay=0.5, max_norm=1.0),
                       "weight decay and max_norm (its CUDA build applies them)")):
        fast = fxrec.transform(M.BagList(rows=ROWS), x, optimizer=cfg, backend="fbgemm")
        (g,) = fast.report.groups
        assert g.kernel_train == "native" and f"fbgemm's CPU build ignores rowwise_adagrad's {said}" in g.why, g
        on_gpu = fxrec.explain(M.BagList(rows=ROWS), x, device="cuda", optimizer=cfg)
        assert {(g.kernel_train, g.fused) for g in on_gpu.groups} == {("fbgemm", "rowwise_adagrad")}, on_gpu.groups


@pytest.mark.parametrize("cfg", [dict(max_norm=1.5), dict(weight_decay=0.5), dict(weight_decay=0.5, max_norm=1.5)],
                         ids=["max_norm", "decay", "both"])
def test_a_group_whose_fbgemm_kernel_was_chosen_for_cuda_still_caps_and_decays_on_the_cpu(cfg):
    """A model transformed for CUDA keeps fbgemm as its training kernel; moved to the CPU (or
    unpickled on a CPU machine), fbgemm's CPU build would step its rows as without weight decay
    and max_norm. There the call goes to the reference's update, on the same states: 20 steps
    equal the update written out. (The CUDA choice is made here by setting the kernel, as
    transform on a GPU sets it.)"""
    opt = fxrec.optim.RowWiseAdagrad(lr=0.1, **cfg)
    ref_kw = dict(lr=0.1, weight_decay=cfg.get("weight_decay", 0.0), max_norm=cfg.get("max_norm", 0.0))
    torch.manual_seed(3)
    ref, _, _ = train_both(lambda: M.BagList(rows=ROWS), duplicate_heavy_inputs, opt,
                           lambda p: RowWiseAdagradReference(p, **ref_kw), backend="native")
    torch.manual_seed(3)  # (the same model again)
    fast = fxrec.transform(M.BagList(rows=ROWS), duplicate_heavy_inputs(0), optimizer=opt, backend="native")
    (g,) = [m for m in fast.modules() if type(m).__name__ == "EmbeddingGroup"]
    g.kernel_train = "fbgemm"
    fast_opt = fast.make_optimizer(torch.optim.Adam, lr=1e-3)
    for step in range(20):
        x = duplicate_heavy_inputs(step + 1)
        fast_opt.zero_grad()
        fast(*x).sin().sum().backward()
        fast_opt.step()
    assert g._bound is not None  # (its states are in fbgemm's TBE, as a group trained on fbgemm keeps them)
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=k)


def test_tables_fbgemm_stores_in_fp16_refuse_a_cpu_step_that_would_drop_max_norm_naming_them():
    """The same on tables stored in fp16 (weights_precision=), which only fbgemm's TBE holds: no
    other kernel can step them, and fbgemm's CPU build would drop max_norm, so the call is refused
    naming the tables and why (it was sent on and refused for features of different batch sizes)."""
    fast = fxrec.transform(M.BagList(rows=ROWS), duplicate_heavy_inputs(0), optimizer=fxrec.optim.RowWiseAdagrad(lr=0.1),
                           backend="fbgemm", weights_precision="fp16")
    (g,) = [m for m in fast.modules() if type(m).__name__ == "EmbeddingGroup"]
    assert g.kernel_train == "fbgemm" and g.weights == "fp16"
    g.fused = dataclasses.replace(g.fused, max_norm=1.0)  # (as transform on a GPU gives it)
    with pytest.raises(RuntimeError, match=r"tables \['bags.0', 'bags.1', 'bags.2'\] train with a fused optimizer, "
                                           r"but fbgemm's CPU build ignores its max_norm, and tables .* are held by"):
        fast(*duplicate_heavy_inputs(1)).sum().backward()


def test_fbgemms_tbe_is_given_max_norm():
    """What fxrec builds fbgemm's TBE with (the same call on CUDA, where its kernel applies it):
    max_norm reaches fbgemm's optimizer arguments, beside the weight decay."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

    from fxrec.runtime.kernels.fbgemm_tbe import make_training_tbe
    from fxrec.runtime.specs import FusedSpec

    for spec, cap, mode in ((FusedSpec("rowwise_adagrad", 0.1, max_norm=2.5), 2.5, WeightDecayMode.NONE),
                            (FusedSpec("rowwise_adagrad", 0.1, weight_decay=0.1, weight_decay_mode="decoupled",
                                       max_norm=0.75), 0.75, WeightDecayMode.DECOUPLE),
                            (FusedSpec("rowwise_adagrad", 0.1), 0.0, WeightDecayMode.NONE)):
        tbe = make_training_tbe([(10, 8)], [0], "sum", torch.device("cpu"), spec)
        assert tbe.optimizer_args.max_norm == cap and tbe.optimizer_args.weight_decay_mode == mode.value, spec


@pytest.mark.parametrize("wd,mode,cap", [(0.0, "l2", 0.0), (0.1, "l2", 0.0), (0.1, "decoupled", 0.0), (0.0, "l2", 2.0),
                                         (0.1, "l2", 2.0)])
def test_rowwise_adagrad_torch_steps_a_dense_gradient_as_its_rows_and_reads_nothing_on_the_host(wd, mode, cap):
    """The fallback (data-parallel tables of a plan, tables fbgemm does not fuse) on a dense
    gradient: the written-out update, the same numbers as on the gradient's rows given sparse,
    and, as on CUDA (``sync_free``: every row at once, those without a gradient masked), no value
    read on the host."""
    from fxrec.runtime._tracing import sync_free
    from fxrec.testing import host_syncs

    w0 = torch.randn(12, 8)
    params = [w0.clone().requires_grad_() for _ in range(4)]
    dense, as_cuda, sparse = (RowWiseAdagradTorch([p], lr=0.3, weight_decay=wd, weight_decay_mode=mode, max_norm=cap)
                              for p in params[:3])
    ref = RowWiseAdagradReference([params[3]], lr=0.3, weight_decay=wd, mode=mode, max_norm=cap)
    gen = torch.Generator().manual_seed(5)
    for step in range(5):
        g = torch.randn(12, 8, generator=gen)
        g[[0, 3 + step % 4]] = 0.0  # rows without a gradient this step: left alone, not decayed
        rows = torch.nonzero(g.abs().sum(1)).squeeze(1)
        params[0].grad, params[1].grad, params[3].grad = g.clone(), g.clone(), g.clone()
        params[2].grad = torch.sparse_coo_tensor(rows.unsqueeze(0), g[rows], (12, 8))
        dense.step()
        with sync_free(), host_syncs() as syncs:
            as_cuda.step()
        assert syncs.in_fxrec() == [], syncs.in_fxrec()
        sparse.step()
        ref.step()
    for other, opt in ((params[1], as_cuda), (params[2], sparse)):
        assert torch.equal(params[0], other) and torch.equal(dense.state[params[0]]["sum"], opt.state[other]["sum"])
    assert torch.equal(params[0].detach()[0], w0[0])
    torch.testing.assert_close(params[0], params[3], rtol=1e-6, atol=1e-6)
    if cap:  # (every row but row 0 had a gradient at some step; most start over the cap)
        assert (params[0].detach()[1:].norm(dim=1) <= cap * (1 + 1e-6)).all() and (w0.norm(dim=1) > cap).sum() > 6


@pytest.mark.parametrize("name", ["lazy_adam", "lamb", "partial_rowwise_lamb", "lars_sgd"])
def test_the_other_fallbacks_step_a_dense_gradient_as_on_cuda_with_the_same_numbers_and_no_host_read(name):
    """LazyAdamTorch, LazyLambTorch, PartialRowWiseLambTorch and LarsSGDTorch share update_rows:
    on a dense gradient as on CUDA (every row, masked), as on CPU (its rows found), and on the
    rows given sparse, the same numbers bit for bit; as on CUDA nothing read on the host."""
    from fxrec.optim import LarsSGDTorch, LazyAdamTorch, LazyLambTorch, PartialRowWiseLambTorch
    from fxrec.runtime._tracing import sync_free
    from fxrec.testing import host_syncs

    make = {"lazy_adam": lambda p: LazyAdamTorch(p, lr=0.05, weight_decay=0.01),
            "lamb": lambda p: LazyLambTorch(p, lr=0.05, weight_decay=0.01),
            "partial_rowwise_lamb": lambda p: PartialRowWiseLambTorch(p, lr=0.05),
            "lars_sgd": lambda p: LarsSGDTorch(p, lr=0.5, eta=0.02, momentum=0.8, weight_decay=0.01)}[name]
    import fxrec.optim

    step_line = 1 + inspect.getsource(fxrec.optim).splitlines().index('                t = int(state["step"].item())')
    w0 = torch.randn(12, 8)
    params = [w0.clone().requires_grad_() for _ in range(3)]
    opts = [make([p]) for p in params]
    gen = torch.Generator().manual_seed(6)
    for step in range(4):
        g = torch.randn(12, 8, generator=gen)
        g[[1, 4 + step % 3]] = 0.0
        rows = torch.nonzero(g.abs().sum(1)).squeeze(1)
        params[0].grad, params[1].grad = g.clone(), g.clone()
        params[2].grad = torch.sparse_coo_tensor(rows.unsqueeze(0), g[rows], (12, 8))
        opts[0].step()
        with sync_free(), host_syncs() as syncs:
            opts[1].step()
        # the Adam kinds read their step count: a CPU tensor, as torch.optim keeps it (no device wait)
        want = [] if name == "lars_sgd" else [("aten::_local_scalar_dense", f"fxrec/optim.py:{step_line}")]
        assert syncs.in_fxrec() == want, syncs.in_fxrec()
        assert name == "lars_sgd" or opts[1].state[params[1]]["step"].device.type == "cpu"
        opts[2].step()
    assert torch.equal(params[0].detach()[1], w0[1])
    for other, opt in zip(params[1:], opts[1:]):
        assert torch.equal(params[0], other)
        for k, v in opts[0].state[params[0]].items():
            assert torch.equal(v, opt.state[other][k]), k


@pytest.mark.parametrize("make,name", [
    (lambda: fxrec.optim.SGD(lr=-0.1), "SGD lr"), (lambda: fxrec.optim.SGD(lr="0.1"), "SGD lr"),
    (lambda: fxrec.optim.SGD(lr=0.1, momentum=-1.0), "SGD momentum"),
    (lambda: fxrec.optim.Adagrad(lr=-0.1), "Adagrad lr"), (lambda: fxrec.optim.Adagrad(eps=-1.0), "Adagrad eps"),
    (lambda: fxrec.optim.Adagrad(lr=float("nan")), "Adagrad lr"),
    (lambda: fxrec.optim.RowWiseAdagrad(lr="0.1"), "RowWiseAdagrad lr"),
    (lambda: fxrec.optim.RowWiseAdagrad(weight_decay=-1.0), "RowWiseAdagrad weight_decay"),
    (lambda: fxrec.optim.Adam(lr=-1.0), "Adam lr"), (lambda: fxrec.optim.Adam(eps=-1.0), "Adam eps"),
    (lambda: fxrec.optim.Adam(weight_decay=float("nan")), "Adam weight_decay"),
    (lambda: fxrec.optim.LazyAdam(lr="0.1"), "LazyAdam lr"),
])
def test_optimizer_arguments_torch_optim_refuses_are_refused_naming_them(make, name):
    """A fused SGD with lr=-0.1 ran gradient ascent, where torch.optim.SGD refuses it."""
    with pytest.raises(ValueError, match=rf"fxrec: {name} must be a number >= 0"):
        make()
    with pytest.raises(ValueError, match="nesterov"):
        fxrec.optim.SGD(lr=0.1, nesterov=True)


@pytest.mark.parametrize("betas", [(1.5, 0.9), (0.9, 1.0), (-0.1, 0.9)])
def test_adam_betas_torch_optim_refuses_are_refused_when_made(betas):
    """fxrec.optim.Adam took them, and torch.optim.Adam refused them only at make_optimizer, naming no table."""
    with pytest.raises(ValueError, match=re.escape(f"fxrec: Adam betas must be in [0, 1), got {betas}")):
        fxrec.optim.Adam(betas=betas)
    with pytest.raises(ValueError):
        torch.optim.Adam([torch.zeros(1, requires_grad=True)], betas=betas)  # (what torch refuses too)


def test_optimizer_arguments_torch_optim_takes_are_taken():
    """numpy scalars and 0-dim tensors, as torch.optim takes them (a first form of the checks
    refused them)."""
    import numpy as np

    for lr in (np.float32(0.1), np.int64(1), torch.tensor(0.1), 0):
        for make in (fxrec.optim.SGD, fxrec.optim.Adagrad, fxrec.optim.RowWiseAdagrad):
            make(lr=lr)
    fxrec.optim.SGD(lr=0.1, dampening=-0.1)  # (torch.optim.SGD does not check it)


class EmptyTableFirst(nn.Module):
    """A table of 0 rows (as a row-wise piece of a table with fewer rows than ranks is) before a
    table of 41: fbgemm's CPU TBE updated wrong rows of the second, and failed on a group of the
    empty table alone; fxrec stores one zero row for it that no id reaches."""

    def __init__(self, alone=False):
        super().__init__()
        self.small = nn.EmbeddingBag(0, 8, mode="sum")
        self.big = None if alone else nn.EmbeddingBag(41, 12, mode="sum")

    def forward(self, ids_s, off_s, ids_b, off_b):
        if self.big is None:
            return self.small(ids_s, off_s)
        return torch.cat([self.small(ids_s, off_s), self.big(ids_b, off_b)], 1)


@pytest.mark.parametrize("alone", [False, True], ids=["before_another", "alone"])
@pytest.mark.parametrize("case", ["sgd", "rowwise_adagrad"])
def test_an_empty_table_trains_fused_on_fbgemm_beside_others_as_torch_optim(case, alone):
    fused, torch_opt, _ = CASES[case]
    torch.manual_seed(0)
    model = EmptyTableFirst(alone)
    plain = copy.deepcopy(model)
    ref_opt = torch_opt(plain.parameters())
    g = torch.Generator().manual_seed(1)

    def batch():
        return (torch.zeros(0, dtype=torch.long), torch.zeros(4, dtype=torch.long),
                torch.randint(0, 41, (9,), generator=g), torch.tensor([0, 2, 2, 6]))

    fast = fxrec.transform(model, batch(), optimizer=fused, backend="fbgemm")
    assert fast.report.groups[0].kernel_train == "fbgemm"
    for _ in range(3):
        x = batch()
        want, got = plain(*x), fast(*x)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        (want * torch.arange(want.shape[1])).sum().backward()
        (got * torch.arange(got.shape[1])).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(fast.get_parameter(name), p, rtol=1e-6, atol=1e-6, msg=name)


class InBlocks(nn.Module):
    """Lookups inside a torch.autocast block and a torch.no_grad() block (each captured as a
    higher-order op whose body fxrec does not lower), one outside."""

    def __init__(self):
        super().__init__()
        self.cast = nn.EmbeddingBag(30, 4, mode="sum")
        self.frozen = nn.EmbeddingBag(30, 4, mode="sum")
        self.free = nn.EmbeddingBag(30, 4, mode="sum")
        self.top = nn.Linear(12, 1)

    def forward(self, ids, offsets):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
            a = self.cast(ids, offsets)
        with torch.no_grad():
            b = self.frozen(ids, offsets)
        return self.top(torch.cat([a, b, self.free(ids, offsets)], 1))


def test_lookups_in_autocast_and_no_grad_blocks_are_reported_and_keep_their_optimizer():
    """(They were not found at all: the report said nothing of them, and make_optimizer gave their
    tables the dense optimizer instead of the one asked for.)"""
    torch.manual_seed(0)
    model = InBlocks()
    plain = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)

    def batch():
        return torch.randint(0, 30, (8,), generator=g), torch.tensor([0, 3, 3, 6])

    fast = fxrec.transform(model, batch(), optimizer=fxrec.optim.SGD(lr=0.1))
    why = {e.table: e.reason for e in fast.report.left_alone}
    assert why == {"cast": "inside a torch.autocast block, where fxrec does not lower lookups",
                   "frozen": "inside a torch.no_grad() / torch.enable_grad() block, where fxrec does not lower lookups"}
    assert {e.table: e.feature for e in fast.report.left_alone} == {"cast": "ids#2", "frozen": "ids#3"}
    opt = fast.make_optimizer(torch.optim.Adam, lr=1e-3)
    tables = [plain.cast.weight, plain.frozen.weight, plain.free.weight]
    ref = [torch.optim.SGD(tables, lr=0.1), torch.optim.Adam(plain.top.parameters(), lr=1e-3)]
    for _ in range(3):
        x = batch()
        for o in ref:
            o.zero_grad()
        plain(*x).sum().backward()
        for o in ref:
            o.step()
        opt.zero_grad()
        fast(*x).sum().backward()
        opt.step()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(fast.get_parameter(name), p, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("kw", [dict(weight_decay=0.5), dict(amsgrad=True)], ids=["weight_decay", "amsgrad"])
def test_adam_arguments_sparse_adam_lacks_are_refused_for_a_sparse_table(kw):
    """Adam on a sparse=True table runs as torch.optim.SparseAdam, which has no weight decay and no
    amsgrad: refused, naming the table (they were dropped without a word)."""
    model = M.BagList(rows=ROWS)
    for bag in model.bags:
        bag.sparse = True
    name = next(iter(kw))
    with pytest.raises(ValueError, match=rf"table 'bags.0' cannot train with Adam\(.*\): its gradients are sparse "
                                         rf"\(sparse=True\), where Adam runs as torch.optim.SparseAdam, which has no {name}"):
        fxrec.transform(model, M.bag_inputs(rows=ROWS), optimizer=fxrec.optim.Adam(lr=0.01, **kw))
    fxrec.transform(model, M.bag_inputs(rows=ROWS), optimizer=fxrec.optim.Adam(lr=0.01))  # (without them: SparseAdam)


@pytest.mark.parametrize("how", ["state_dict", "checkpoint"])
def test_a_scheduler_resumes_on_the_fused_groups_after_a_load(how, tmp_path):
    """A scheduler keeps ``initial_lr`` in every param group; a load kept only a fused group's
    ``lr``, so ``StepLR(opt, ..., last_epoch=n)`` (torch's resume) raised KeyError for it."""
    model = M.BagList(rows=ROWS)
    x = M.bag_inputs(rows=ROWS)

    def fresh():
        fast = fxrec.transform(copy.deepcopy(model), x, optimizer=fxrec.optim.Adagrad(lr=0.1))
        return fast, fast.make_optimizer(torch.optim.SGD, lr=0.05)

    fast, opt = fresh()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        opt.zero_grad()
        fast(*x).sum().backward()
        opt.step()
        sched.step()
    again, again_opt = fresh()
    if how == "state_dict":
        again.load_state_dict(fast.state_dict())
        again_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    else:
        fxrec.checkpoint.save(fast, str(tmp_path / "ck"), optimizer=opt)
        fxrec.checkpoint.load(again, str(tmp_path / "ck"), optimizer=again_opt)
    assert [g["initial_lr"] for g in again_opt.param_groups] == [g["initial_lr"] for g in opt.param_groups]
    resumed = torch.optim.lr_scheduler.StepLR(again_opt, step_size=1, gamma=0.5, last_epoch=2)
    resumed.load_state_dict(sched.state_dict())
    for g, want in zip(again_opt.param_groups, opt.param_groups):
        g["lr"] = want["lr"]  # (the constructor stepped once more)
    resumed.step()
    sched.step()
    assert [g["lr"] for g in again_opt.param_groups] == [g["lr"] for g in opt.param_groups]


def test_a_param_group_added_to_the_combined_optimizer_is_stepped_and_zeroed():
    """(It was appended to a list nothing steps: the new parameters never moved, their gradients
    piled up.)"""
    model = M.BagList(rows=ROWS)
    x = M.bag_inputs(rows=ROWS)
    fast = fxrec.transform(model, x, optimizer=fxrec.optim.SGD(lr=0.1))
    head = nn.Linear(fast(*x).shape[1], 1)
    plain_head = copy.deepcopy(head)
    opt = fast.make_optimizer(torch.optim.SGD, lr=0.05)
    opt.add_param_group({"params": head.parameters(), "lr": 0.2})
    assert opt.param_groups[-2]["lr"] == 0.2  # (the dense optimizer's, before the fused group)
    plain_opt = torch.optim.SGD(plain_head.parameters(), lr=0.2)
    for _ in range(3):
        out = fast(*x).detach()
        opt.zero_grad()
        plain_opt.zero_grad()
        head(out).sum().backward()
        plain_head(out).sum().backward()
        opt.step()
        plain_opt.step()
    torch.testing.assert_close(head.weight, plain_head.weight, rtol=0, atol=0)
    opt.zero_grad()
    assert head.weight.grad is None
    with pytest.raises(ValueError, match="no dense optimizer to add a param group to"):
        from fxrec.runtime.optimizer import CombinedOptimizer
        CombinedOptimizer(None, [], []).add_param_group({"params": [torch.zeros(1, requires_grad=True)]})


@pytest.mark.parametrize("make", [lambda: fxrec.optim.SGD(lr=0.1, weight_decay=0.01),
                                  lambda: fxrec.optim.Adagrad(lr=0.1, weight_decay=0.01)], ids=["sgd", "adagrad"])
def test_weight_decay_torch_optim_cannot_apply_to_sparse_gradients_is_refused_naming_the_table(make):
    """(transform took it, and the first step() failed inside torch without naming the table.)"""
    model = M.BagList(rows=ROWS)
    for bag in model.bags:
        bag.sparse = True
    with pytest.raises(ValueError, match=r"table 'bags.0' cannot train with .*: its gradients are sparse \(sparse=True\), "
                                         r"which torch.optim.\w+'s weight_decay cannot take"):
        fxrec.transform(model, M.bag_inputs(rows=ROWS), optimizer=make())


def test_a_sparse_table_looked_up_only_in_a_no_grad_block_needs_no_optimizer():
    """It makes no gradient: no optimizer is asked of it (Adam with weight decay was refused for it)."""
    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.frozen = nn.EmbeddingBag(50, 8, mode="sum", sparse=True)
            self.e = nn.EmbeddingBag(50, 8, mode="sum")

        def forward(self, ids, off):
            with torch.no_grad():
                a = self.frozen(ids, off)
            return a + self.e(ids, off)

    x = (torch.randint(0, 50, (12,)), torch.arange(0, 12, 3))
    fast = fxrec.transform(Frozen(), x, optimizer=fxrec.optim.Adam(lr=0.01, weight_decay=0.01))
    assert set(fast.meta["fxrec_table_optimizers"]) == {"e.weight"}


class _DetachedLookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.EmbeddingBag(20, 4, mode="sum")

    def forward(self, i1, i2):
        off = torch.tensor([0, 1])
        return self.a(i1, off) + self.a(i2, off).detach()


@pytest.mark.parametrize("backend", ["fbgemm", "native", "reference"])
def test_a_fused_update_leaves_the_rows_of_a_detached_lookup_alone(backend):
    """PyTorch gives the rows a detached lookup reads no gradient; row-wise Adagrad's weight decay,
    fused into the group's backward, moved them (0.24 after two steps): such a lookup is left as
    written, with the reason, and the model trains as torch.optim's row-wise Adagrad steps it."""
    torch.manual_seed(0)
    model = _DetachedLookup()
    x = (torch.tensor([1, 2, 3]), torch.tensor([7, 8, 9]))
    w0 = model.a.weight.detach().clone()
    fast = fxrec.transform(model, x, backend=backend, optimizer=fxrec.optim.RowWiseAdagrad(lr=0.1, weight_decay=0.1))
    (left,) = [e for e in fast.report.lookups if e.reason]
    assert "no gradient reaches its output" in left.reason
    opt = fast.make_optimizer(torch.optim.SGD, lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        fast(*x).sum().backward()
        opt.step()
    w = fast.get_parameter("a.weight").detach()
    assert torch.equal(w[7:10], w0[7:10]) and not torch.equal(w[1:4], w0[1:4])


def test_a_tied_table_steps_with_torch_optim_and_leaves_the_others_fused():
    from tests.passes.test_group_lookups import TiedOutput

    torch.manual_seed(0)
    model = TiedOutput()
    ref = copy.deepcopy(model)
    x = (torch.randint(0, 50, (6,)), torch.tensor([0, 2, 4]))
    fast = fxrec.transform(model, x, optimizer=fxrec.optim.Adagrad(lr=0.1), backend="fbgemm")
    fused = {t: "fused" in g.optimizer for g in fast.report.groups for t in g.tables}
    assert fused == {"a": True, "c": True, "item": False}
    opt = fast.make_optimizer(torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.1)
    for step in range(3):
        xs = (torch.randint(0, 50, (6,), generator=torch.Generator().manual_seed(step)), x[1])
        for m, o in ((ref, ref_opt), (fast, opt)):
            o.zero_grad()
            m(*xs).square().sum().backward()
            o.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(fast.state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=k)


class _TiedWithSideLookup(nn.Module):
    """A tied output layer, and a lookup of the same table no gradient reaches."""

    def __init__(self, how, sparse=False, tied_in_autocast=False):
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(9, 4, sparse=sparse)
        self.proj = nn.Linear(3, 4)
        self.tied_in_autocast = tied_in_autocast

    def forward(self, dense, ids):
        if self.how == "no_grad":
            with torch.no_grad():
                side = self.emb(ids) * 2
        elif self.how == "detach":
            side = self.emb(ids).detach()
        else:
            side = self.emb(ids)
        if self.tied_in_autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return (self.proj(dense) @ self.emb.weight.t()).float(), side
        return self.proj(dense) @ self.emb.weight.t(), side


@pytest.mark.parametrize("tied_in_autocast", [False, True], ids=["tied", "tied_in_autocast"])
@pytest.mark.parametrize("how", ["detach", "no_grad"])
def test_a_tied_table_whose_lookups_make_no_gradient_still_gets_its_optimizer(how, tied_in_autocast):
    """Its only lookup needed no optimizer, so the table had none, and make_optimizer gave the tied
    layer's gradient to the dense optimizer (12.8 off the plain model after two steps; with the
    tied layer in an autocast block too, whose reads were not counted)."""
    torch.manual_seed(0)
    fast = _tied_side_trains_as_plain(_TiedWithSideLookup(how, tied_in_autocast=tied_in_autocast),
                                      fxrec.optim.Adagrad(lr=0.1), torch.optim.Adagrad)
    assert "emb.weight" in fast.meta["fxrec_table_optimizers"]


def _tied_side_trains_as_plain(model, table_opt, torch_cls):
    """Two steps of ``model`` transformed with ``table_opt`` (dense: SGD) against the plain model
    with ``torch_cls`` on the table: the weights must agree. Returns the transformed model."""
    torch.manual_seed(0)
    ref = copy.deepcopy(model)
    x = (torch.randn(3, 3), torch.randint(0, 9, (3,)))
    fast = fxrec.transform(model, x, optimizer=table_opt)
    opt = fast.make_optimizer(torch.optim.SGD, lr=0.5)
    ref_opts = [torch_cls([ref.emb.weight], lr=0.1), torch.optim.SGD(ref.proj.parameters(), lr=0.5)]
    for _ in range(2):
        for m, os_ in ((ref, ref_opts), (fast, [opt])):
            out, side = m(*x)
            (out.sum() + side.sum()).backward()  # (side carries no gradient where it is detached)
            for o in os_:
                o.step()
                o.zero_grad()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(fast.state_dict()[k], v, rtol=1e-6, atol=1e-6, msg=k)
    return fast


@pytest.mark.parametrize("tied_in_autocast", [False, True], ids=["tied", "tied_in_autocast"])
def test_a_sparse_table_also_read_by_a_tied_layer_steps_its_dense_gradient_with_adam(tied_in_autocast):
    """Its gradient is dense (PyTorch's too): the torch.optim step chosen by its sparse=True was
    SparseAdam, which refused it at the first step (also where the tied layer is in an autocast
    block, whose reads were not counted)."""
    torch.manual_seed(0)
    _tied_side_trains_as_plain(_TiedWithSideLookup("used", sparse=True, tied_in_autocast=tied_in_autocast),
                               fxrec.optim.Adam(lr=0.1), torch.optim.Adam)


def test_a_table_parametrized_after_transform_is_refused_by_the_fused_update():
    """The fused update would write the computed weight, not the parameter: the table was silently
    never trained."""
    class Scale(nn.Module):
        def forward(self, w):
            return w * 2

    fast = fxrec.transform(M.BagList(rows=ROWS), M.bag_inputs(rows=ROWS), optimizer=fxrec.optim.SGD(lr=0.1))
    torch.nn.utils.parametrize.register_parametrization(getattr(fast.bags, "0"), "weight", Scale())
    with pytest.raises(RuntimeError, match=r"tables \['bags.0'\] are computed \(a parametrization registered on them\?\)"):
        fast(*M.bag_inputs(rows=ROWS)).sum().backward()
    with torch.no_grad():  # (inference reads the computed weight, as the plain model would)
        fast(*M.bag_inputs(rows=ROWS))


@pytest.mark.parametrize("how", ["verify", "check_passes"])
def test_verifying_a_transform_of_a_fused_transformed_model_leaves_it_alone(how):
    """(verify ran the given model's fused update: its tables changed, and verify failed with
    'no gradient in the original model'.)"""
    x = M.bag_inputs(rows=ROWS)
    first = fxrec.transform(M.BagList(rows=ROWS), x, optimizer=fxrec.optim.SGD(lr=0.1))
    before = {k: v.clone() for k, v in first.state_dict().items()}
    fxrec.transform(first, x, **{how: True})
    for k, v in first.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("backend", ["auto", "fbgemm", "native"])
@pytest.mark.parametrize("weighted", [False, True])
def test_a_fused_model_converted_to_fp16_after_transform_refuses_to_train_naming_the_tables(backend, weighted):
    """fxrec fuses no optimizer into fp16 tables (its update rounds otherwise than torch.optim's):
    a model made fp16 by .half() after transform is refused at its first training call, not
    stepped off by an fp16 step here and there (nor failing inside index_add_ with weights);
    evaluating it is allowed."""
    if weighted:
        model, x = M.WeightedBags(), M.weighted_inputs()
    else:
        model, x = M.BagList(), M.bag_inputs()
    fast = fxrec.transform(model, x, optimizer=fxrec.optim.SGD(lr=0.1), backend=backend).half()
    half = tuple(t.half() if t.is_floating_point() else t for t in x) if weighted else (x[0].half(), x[1], x[2])
    with pytest.raises(RuntimeError, match=r"tables \[.*\] train with a fused optimizer, but they are now "
                                           r"torch\.float16 \(a \.half\(\) / \.to\(\) after transform\?\)"):
        fast(*half)
    with torch.no_grad():
        torch.testing.assert_close(fast(*half), model.half()(*half), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["SGD", "Adagrad", "Adam"])
def test_each_optimizer_takes_every_argument_of_its_torch_optim_namesake_with_its_defaults(name):
    """The docs say so; maximize, foreach, fused, differentiable (and Adam's capturable and
    decoupled_weight_decay) were a TypeError."""
    ours = inspect.signature(getattr(fxrec.optim, name)).parameters
    theirs = {k: p for k, p in inspect.signature(getattr(torch.optim, name)).parameters.items() if k != "params"}
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"fxrec.optim.{name} lacks torch.optim.{name}'s {missing}"
    for k, p in theirs.items():
        assert ours[k].default == p.default or (isinstance(p.default, tuple) and tuple(ours[k].default) == p.default), k


@pytest.mark.parametrize("opt_cfg,torch_opt,fused", [
    (fxrec.optim.SGD(lr=0.1, maximize=True), lambda p: torch.optim.SGD(p, lr=0.1, maximize=True), False),
    (fxrec.optim.Adagrad(lr=0.1, maximize=True), lambda p: torch.optim.Adagrad(p, lr=0.1, maximize=True), False),
    (fxrec.optim.SGD(lr=0.1, momentum=0.9, foreach=False),
     lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False), False),
    (fxrec.optim.SGD(lr=0.1, foreach=True), lambda p: torch.optim.SGD(p, lr=0.1, foreach=True), True),
    (fxrec.optim.Adagrad(lr=0.1, fused=True), lambda p: torch.optim.Adagrad(p, lr=0.1, fused=True), True),
    (fxrec.optim.Adam(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True),
     lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1), False),
    (fxrec.optim.Adam(lr=0.01, maximize=True, foreach=False), lambda p: torch.optim.Adam(p, lr=0.01, maximize=True), False),
], ids=["sgd_maximize", "adagrad_maximize", "sgd_momentum_foreach", "sgd_foreach", "adagrad_fused",
        "adam_decoupled", "adam_maximize"])
def test_torch_optim_options_train_as_torch_optim_does(opt_cfg, torch_opt, fused):
    """maximize ascends (off fbgemm's fused update, which has none); foreach and fused pick
    torch.optim's implementation, and leave fbgemm's fused update as it was; Adam's
    decoupled_weight_decay is AdamW."""
    ref, fast, _ = train_both(lambda: M.BagList(rows=ROWS), duplicate_heavy_inputs, opt_cfg, torch_opt, steps=4)
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=k)
    said = fast.report.groups[0].optimizer
    assert ("fused" in said) == fused, said
    if "maximize" in opt_cfg.describe():
        assert "maximize=True" in said
    if "maximize" in opt_cfg.describe() and not isinstance(opt_cfg, fxrec.optim.Adam):  # (Adam: never fused)
        assert "fbgemm's update has no maximize" in fast.report.groups[0].why


@pytest.mark.parametrize("make,what", [
    (lambda: fxrec.optim.SGD(lr=0.1, momentum=0.5, fused=True), r"which torch.optim.SGD cannot take with fused=True"),
    (lambda: fxrec.optim.Adagrad(lr=0.1, lr_decay=0.1, fused=True), r"which torch.optim.Adagrad cannot take with fused=True"),
    (lambda: fxrec.optim.Adam(lr=0.1, foreach=True), r"where Adam runs as torch.optim.SparseAdam, which has no foreach"),
    (lambda: fxrec.optim.Adam(lr=0.1, capturable=True), r"where Adam runs as torch.optim.SparseAdam, which has no capturable"),
], ids=["sgd", "adagrad", "adam_foreach", "adam_capturable"])
def test_torch_optim_options_its_sparse_step_cannot_take_are_refused_naming_the_table(make, what):
    """(torch.optim failed at the first step() without naming the table, or SparseAdam dropped them.)"""
    model = M.BagList(rows=ROWS)
    for bag in model.bags:
        bag.sparse = True
    with pytest.raises(ValueError, match=r"table 'bags.0' cannot train with .*: its gradients are sparse \(sparse=True\), "
                                         + what):
        fxrec.transform(model, M.bag_inputs(rows=ROWS), optimizer=make())


class FactorisedBags(nn.Module):
    """Matrix factorisation: no dense layer, so the lookups are all that backward reaches."""

    def __init__(self):
        super().__init__()
        self.user = nn.EmbeddingBag(30, 8)
        self.item = nn.Embedding(40, 8)

    def forward(self, ids, offsets, item):
        return (self.user(ids, offsets) * self.item(item)).sum(1)


@pytest.mark.parametrize("backend", ["auto", "reference", "fbgemm", "native"])
@pytest.mark.parametrize("opt", [fxrec.optim.SGD(lr=0.1), fxrec.optim.Adagrad(lr=0.1), fxrec.optim.RowWiseAdagrad(lr=0.1)],
                         ids=["sgd", "adagrad", "rowwise_adagrad"])
def test_an_empty_batch_backpropagates_through_fused_groups_and_updates_nothing(backend, opt):
    """The plain model's loss on an empty batch back-propagates; with a fused optimizer the output
    had no grad_fn and loss.backward() raised."""
    model = FactorisedBags()
    g = torch.Generator().manual_seed(0)
    x = (torch.randint(0, 30, (12,), generator=g), torch.arange(0, 12, 3), torch.randint(0, 40, (4,), generator=g))
    kw = {} if backend == "auto" else {"backend": backend}
    fast = fxrec.transform(model, x, optimizer=copy.deepcopy(opt), **kw)
    empty = (torch.zeros(0, dtype=torch.long),) * 3
    model(*empty).sum().backward()
    before = {k: v.clone() for k, v in fast.state_dict().items()}
    out = fast(*empty)
    assert out.shape == (0,) and out.requires_grad
    out.sum().backward()
    for k, v in fast.state_dict().items():
        assert torch.equal(v, before[k]), k
    with torch.no_grad():
        assert not fast(*empty).requires_grad
    fast(*x).sum().backward()  # and the next batch trains
    assert not torch.equal(fast.state_dict()["user.weight"], before["user.weight"])
    relu = fxrec.transform(ReluOfBags(), x[:2], optimizer=copy.deepcopy(opt), **kw)  # (written in place: no leaf)
    relu(*empty[:2]).sum().backward()


class ReluOfBags(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.EmbeddingBag(30, 8)
        self.b = nn.EmbeddingBag(30, 8)
        self.top = nn.Linear(16, 1)

    def forward(self, ids, offsets):
        return self.top(torch.relu_(torch.cat([self.a(ids, offsets), self.b(ids, offsets)], 1)))


class _PretrainedAndNew(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.f = torch.nn.Embedding.from_pretrained(torch.randn(20, 8), freeze=True)
        self.u = torch.nn.Embedding(20, 8)

    def forward(self, y):
        return torch.cat([self.f(y).sum(1), self.u(y).sum(1)], 1)


def test_a_table_frozen_at_transform_keeps_the_rule_off_fbgemms_fused_kernel():
    """A table frozen before transform beside one that trains, row-wise Adagrad, backend="auto": the
    rule put the group on fbgemm's fused kernel, which would update the frozen table, and the first
    training call failed (found by the differential fuzzer). The rule now passes fbgemm over for it
    (the report says why) and trains as the native kernel does; a forced backend="fbgemm" is refused
    at transform."""
    y = torch.randint(0, 20, (4, 3))
    runs = {b: fxrec.transform(_PretrainedAndNew(), (y,), backend=b, optimizer=fxrec.optim.RowWiseAdagrad(lr=0.1))
            for b in ("auto", "native")}
    (group,) = runs["auto"].report.groups
    assert group.kernel_train != "fbgemm" and group.fused == "rowwise_adagrad", group
    assert "not fbgemm: tables ['f'] are frozen (requires_grad=False)" in group.why, group.why
    frozen = runs["auto"].get_parameter("f.weight").detach().clone()
    for step in range(3):
        x = torch.randint(0, 20, (4, 3), generator=torch.Generator().manual_seed(step))
        for fast in runs.values():
            fast(x).sum().backward()
    assert torch.equal(runs["auto"].get_parameter("f.weight"), frozen)
    assert torch.equal(runs["auto"].get_parameter("u.weight"), runs["native"].get_parameter("u.weight"))
    cuda = fxrec.explain(_PretrainedAndNew(), (y,), device="cuda", optimizer=fxrec.optim.RowWiseAdagrad(lr=0.1))
    # (on CUDA PyTorch's lookups fuse it, its states kept in an fbgemm TBE that does no lookup)
    assert cuda.groups[0].kernel_train == "reference" and "not fbgemm: tables ['f'] are frozen" in cuda.groups[0].why, \
        cuda.groups[0]
    with pytest.raises(InputError, match=r"tables \['f'\] are frozen \(requires_grad=False\) and fbgemm's fused"):
        fxrec.transform(_PretrainedAndNew(), (y,), backend="fbgemm", optimizer=fxrec.optim.RowWiseAdagrad(lr=0.1))
