"""Sharded models of forms the differential fuzzer found failing, on torch.distributed (gloo, CPU,
two processes), each against the single-process model of the global batch: batch norm after the
lookups (capture on placeholders failed on its running statistics), a table read only under
``torch.no_grad()`` (DDP waited for its gradient and the second step raised), a table with two
names sharded row-wise (the second name kept the whole, untrained table in ``state_dict``), and
a table looked up once detached (``fxrec.plan`` planned it sharded, which ``transform`` refuses)."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fxrec

from .test_sharding import error_of, gloo_group, spawn

B = 4  # per rank


class NoGrad(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.t = nn.EmbeddingBag(40, 8, mode="sum")
        self.u = nn.Embedding(30, 8)  # read only under no_grad: a gate no gradient reaches
        self.top = nn.Linear(8, 1)

    def forward(self, ids, offsets, y):
        with torch.no_grad():
            gate = torch.sigmoid(self.u(y).sum(1, keepdim=True))
        return self.top(self.t(ids, offsets) * gate).squeeze(1)


class Norm(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.t = nn.EmbeddingBag(40, 8, mode="sum")
        self.bn = nn.BatchNorm1d(8)
        self.top = nn.Linear(8, 1)

    def forward(self, ids, offsets, y):
        return self.top(self.bn(self.t(ids, offsets))).squeeze(1)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.t = nn.EmbeddingBag(40, 8, mode="sum")
        self.e = nn.Embedding(40, 8)
        self.e.weight = self.t.weight  # a history bag and the target item share the item table
        self.top = nn.Linear(16, 1)

    def forward(self, ids, offsets, y):
        return self.top(torch.cat([self.t(ids, offsets), self.e(y)], 1)).squeeze(1)


def batch(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 30, (2 * n,), generator=g)
    return ids, torch.arange(0, 2 * n, 2), torch.randint(0, 30, (n,), generator=g)


def mine(x, rank: int):
    ids, offsets, y = x
    return ids[rank * 2 * B:(rank + 1) * 2 * B], offsets[:B], y[rank * B:(rank + 1) * B]


def _worker(rank, world, init_file, form, root):
    with gloo_group(rank, world, init_file):
        model = {"no_grad": NoGrad, "norm": Norm, "tied": Tied}[form]()
        example = mine(batch(B * world, 0), rank)
        pins = {"t": "row_wise"} if form == "tied" else {"t": ("table_wise", 1)}  # (u: left as written)
        plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins=pins, batch_size=B)
        fast = fxrec.transform(model, example, plan=plan)
        single = copy.deepcopy(model)
        if form == "norm":  # batch norm takes each rank's own batch's statistics (as under DDP)
            x = mine(batch(B * world, 1), rank)
            torch.testing.assert_close(fast(*x), single(*x))
            torch.testing.assert_close(fast.get_buffer("bn.running_mean"), single.bn.running_mean)
            torch.testing.assert_close(fast.get_buffer("bn.running_var"), single.bn.running_var)
            fast(*x).sum().backward()  # (its gradients are summed over the ranks)
            dist.barrier()
            os._exit(0)
        opt = torch.optim.SGD(fast.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(single.parameters(), lr=0.1)
        for step in range(3):
            x = batch(B * world, step + 1)
            want, got = single(*x), fast(*mine(x, rank))
            torch.testing.assert_close(got, want[rank * B:(rank + 1) * B], msg=f"step {step}")
            for o, out in ((ref_opt, want), (opt, got)):
                o.zero_grad()
                (out * out).sum().backward()  # (a rank's share of the global batch's loss: DDP sums them)
                o.step()
        if form == "tied":
            sd = fast.state_dict()
            assert sd["t.weight"] is sd["e.weight"] or torch.equal(sd["t.weight"], sd["e.weight"])
            lo = plan.tables["t"].shards[rank].row_offset
            rows = sd["e.weight"].shape[0]
            torch.testing.assert_close(sd["e.weight"], single.t.weight.detach()[lo:lo + rows])
            fxrec.checkpoint.save(fast, os.path.join(root, "ckpt"))
            back = Tied()
            fxrec.checkpoint.load_into_model(back, os.path.join(root, "ckpt"))
            for name in ("t.weight", "e.weight"):  # (both names: the table, trained)
                torch.testing.assert_close(back.get_parameter(name), single.t.weight, msg=name)
        dist.barrier()
    os._exit(0)


@pytest.mark.parametrize("form", ["norm", "no_grad", "tied"])
def test_sharded_model_forms_train_as_one_process(form, tmp_path):
    spawn(_worker, 2, form, str(tmp_path))


class Detached(nn.Module):
    def __init__(self):
        super().__init__()
        self.t = nn.Embedding(20, 4)
        self.top = nn.Linear(4, 1)

    def forward(self, x, y):
        return self.top(self.t(x).sum(1).detach() * self.t(y))


def test_a_table_looked_up_detached_is_planned_data_parallel_when_it_has_an_optimizer():
    """With an optimizer, transform leaves a lookup no gradient reaches as written (its group's
    fused update would still step the rows), so the table is read outside its lookups and can
    only be data-parallel: fxrec.plan said table_wise, which transform(plan=) then refused."""
    x, y = torch.randint(0, 20, (4, 3)), torch.randint(0, 20, (4,))
    without = fxrec.plan(Detached(), (x, y), world_size=2, memory_per_rank="1GB")
    assert without.tables["t"].spec.data_parallel_only == ""
    for optimizer in ("sgd", fxrec.optim.SGD(lr=0.1), {"t": "adagrad"}):
        plan = fxrec.plan(Detached(), (x, y), world_size=2, memory_per_rank="1GB", optimizer=optimizer)
        tp = plan.tables["t"]
        assert tp.sharding == "data_parallel", (optimizer, tp.sharding)
        assert "feature 'x' is a lookup fxrec leaves as written (no gradient reaches its output" in \
            tp.spec.data_parallel_only, tp.spec.data_parallel_only


def _detached_planned_without_the_optimizer(rank, world):
    x, y = torch.randint(0, 20, (4, 3)), torch.randint(0, 20, (4,))
    plan = fxrec.plan(Detached(), (x, y), world_size=world, memory_per_rank="1GB")  # (no optimizer=: table_wise)
    fxrec.transform(Detached(), (x, y), plan=plan, optimizer=fxrec.optim.SGD(lr=0.1))


def test_transform_refusing_a_table_planned_without_its_optimizer_says_how_to_plan_it(tmp_path):
    msg = error_of(tmp_path, 2, _detached_planned_without_the_optimizer)
    assert "table 't' is also used outside its lookups" in msg, msg
    assert "feature 'x' makes no gradient" in msg and "fxrec.plan(..., optimizer=)" in msg, msg


class Learned(nn.Module):
    """A bag weighted per id by a score the model learns."""

    def __init__(self, no_grad=False):
        super().__init__()
        torch.manual_seed(0)
        self.t = nn.EmbeddingBag(20, 4, mode="sum")
        self.s = nn.Embedding(20, 1)
        self.no_grad = no_grad

    def forward(self, ids, offsets):
        with torch.set_grad_enabled(not self.no_grad):
            w = torch.sigmoid(self.s(ids).squeeze(1))
        return self.t(ids, offsets, per_sample_weights=w)


class ShapeOnly(Learned):
    """Weights of a trained value's shape only, which need no gradient (as in PyTorch)."""

    def forward(self, ids, offsets):
        score = self.s(ids).squeeze(1)
        w = torch.ones_like(score) + torch.full((score.shape[0],), 0.5) + score.new_zeros(score.shape)
        return self.t(ids, offsets, per_sample_weights=w) + score.sum()


def test_a_table_whose_per_sample_weights_need_a_gradient_is_planned_data_parallel_and_refused_sharded():
    """Sharded lookups take fixed per-sample weights: fxrec.plan sharded such a table, and the
    first training call then raised; transform with a plan that shards it refuses, naming it."""
    x = (torch.randint(0, 20, (8,)), torch.arange(0, 8, 2))
    tp = fxrec.plan(Learned(), x, world_size=2, memory_per_rank="1GB").tables["t"]
    assert tp.sharding == "data_parallel", tp.sharding
    assert "per-sample weights that need a gradient" in tp.spec.data_parallel_only, tp.spec.data_parallel_only
    fixed = Learned()
    fixed.s.weight.requires_grad_(False)
    for model in (fixed, Learned(no_grad=True), ShapeOnly()):  # (weights that need no gradient: the table shards)
        assert fxrec.plan(model, x, world_size=2, memory_per_rank="1GB",
                          pins={"t": "row_wise"}).tables["t"].sharding == "row_wise"
    plan = fxrec.plan(fixed, x, world_size=2, memory_per_rank="1GB", pins={"t": "row_wise"})
    with pytest.raises(ValueError, match="feature 'ids#2' of table 't' has per-sample weights that need a "
                                         "gradient, and the plan shards the table row_wise.*data_parallel"):
        fxrec.explain(Learned(), x, plan=plan)
    assert fxrec.explain(Learned(), x, plan=plan, mode="inference").groups  # (no gradient in inference)


class FusedAndHalf(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.EmbeddingBag(10, 4, mode="sum")
        self.h = nn.EmbeddingBag(10, 4, mode="sum", dtype=torch.float16)  # (never fused: torch.optim's)
        self.top = nn.Linear(8, 1)

    def forward(self, ids, offsets):
        return self.top(torch.cat([self.a(ids, offsets), self.h(ids, offsets).float()], 1)).squeeze(1)


def _fused_and_half(rank, world, init_file, root):
    with gloo_group(rank, world, init_file):
        def bags(seed):
            g = torch.Generator().manual_seed(seed)
            return torch.randint(0, 10, (2 * B,), generator=g), torch.arange(B) * 2

        model = FusedAndHalf()
        plan = fxrec.plan(model, bags(0), world_size=world, memory_per_rank="1GB", optimizer="rowwise_adagrad",
                          pins={"a": "row_wise", "h": ("table_wise", 1)}, batch_size=B)
        fast = fxrec.transform(model, bags(rank), plan=plan, optimizer=fxrec.optim.RowWiseAdagrad(lr=0.1))
        opt = fast.make_optimizer(torch.optim.SGD, lr=0.05)
        for step in range(2):
            opt.zero_grad()
            fast(*bags(10 + 2 * step + rank)).sum().backward()
            opt.step()
        path = os.path.join(root, "ckpt")
        fxrec.checkpoint.save(fast, path, optimizer=opt)  # (raised: the ranks' records for 'a' differed)
        lo = plan.tables["a"].shards[rank].row_offset
        torch.save((lo, fast.get_parameter("a.weight").detach()), os.path.join(root, f"a.{rank}"))
        dist.barrier()
    os._exit(0)


def test_a_fused_table_optimizer_that_also_steps_an_fp16_table_on_one_rank_checkpoints(tmp_path):
    """Row-wise Adagrad fused for an fp32 table sharded row-wise, and (torch.optim's form) for an
    fp16 table on rank 1 only: rank 1's param group carries the torch form's settings, and the
    ranks' optimizer records for the fused table differed, so save raised on every rank; a
    checkpoint saved so loaded into one process was refused (found by the sharded fuzzer)."""
    spawn(_fused_and_half, 2, str(tmp_path))
    # into one process, where 'a' and 'h' share the table optimizer's param group
    def bags(seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, 10, (2 * B,), generator=g), torch.arange(B) * 2

    one = fxrec.transform(FusedAndHalf(), bags(0), optimizer=fxrec.optim.RowWiseAdagrad(lr=0.1))
    one_opt = one.make_optimizer(torch.optim.SGD, lr=0.05)
    fxrec.checkpoint.load(one, str(tmp_path / "ckpt"), optimizer=one_opt)
    for rank in range(2):
        lo, rows = torch.load(tmp_path / f"a.{rank}")
        assert torch.equal(one.get_parameter("a.weight")[lo:lo + rows.shape[0]], rows)
