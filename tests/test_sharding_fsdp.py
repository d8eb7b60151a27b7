"""``transform(plan=..., dense="fsdp")``: the parameters that are not table shards (dense layers,
data-parallel tables with dense gradients) sharded over the ranks by FSDP (torch's fully_shard on
the transformed model) instead of kept whole by DDP. gloo, world size 2, against the plain model
on the global batch."""

import copy
import os
import re

import pytest
import torch
import torch.distributed as dist

import fxrec

from .test_sharding import LOCAL_B, error_of, global_batch, gloo_group, local_batch, spawn
from .test_sharding_dense import SparseModel

DENSE = ("mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias")
WHOLE = ("bags.1.weight", "bags.2.weight")  # data-parallel tables (sparse and dense gradients): whole, summed by hooks


def _fsdp_model(rank, world, seed=0, optimizer=None, pins=None):
    """SparseModel, a copy of it, and it sharded with dense='fsdp': a row-wise table, a data-parallel
    table with sparse gradients, a data-parallel table with dense ones, a table-wise table."""
    torch.manual_seed(seed)
    model = SparseModel()
    ref = copy.deepcopy(model)
    example = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)
    pins = pins or {"bags.0": "row_wise", "bags.1": "data_parallel", "bags.2": "data_parallel",
                    "single": ("table_wise", 1)}
    plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins=pins)
    return model, ref, fxrec.transform(model, example, plan=plan, dense="fsdp", optimizer=optimizer)


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _steps(rank, world, fast, ref, opt, ref_opt, steps, first=1, label=""):
    for step in range(first, first + steps):
        x = global_batch(LOCAL_B * world, step)
        want = ref(*x)
        got = fast(*local_batch(x, rank, LOCAL_B))
        torch.testing.assert_close(got, want[rank * LOCAL_B:(rank + 1) * LOCAL_B], msg=lambda m: f"{label} step {step}: {m}")
        ref_opt.zero_grad()
        opt.zero_grad()
        want.sum().backward()
        got.sum().backward()
        ref_opt.step()
        opt.step()


def _worker(rank, world, init_file):
    with gloo_group(rank, world, init_file):
        model, ref, fast = _fsdp_model(rank, world)
        params = dict(fast.named_parameters())
        for name in DENSE:  # dim-0 chunks, rank 0 the first
            p = params[name]
            assert type(p).__name__ == "DTensor", (name, type(p))
            whole = ref.get_parameter(name).shape[0]
            assert p.to_local().shape[0] == min(-(-whole // world), whole - rank * -(-whole // world)), name
        for name in WHOLE:
            assert type(params[name]).__name__ == "Parameter", name
        assert fast.meta["fxrec_fsdp_units"] == []  # (mlp.0 is 97 % of the dense bytes: one unit gathers once)
        opt = torch.optim.SGD(fast.parameters(), lr=0.1)  # (not Adagrad or Adam: they hide a gradient's scale)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        _steps(rank, world, fast, ref, opt, ref_opt, 4)
        for name in DENSE + WHOLE:
            torch.testing.assert_close(_full(params[name]).detach(), ref.get_parameter(name).detach(), msg=name)
        dist.barrier()
    os._exit(0)


def test_fsdp_shards_the_dense_parameters_and_trains_as_the_plain_model():
    spawn(_worker, 2)


PLAN_B = {"bags.0": "table_wise", "bags.1": "data_parallel", "bags.2": "data_parallel", "single": "row_wise"}


def _checkpoint_worker(rank, world, init_file, path):
    """Train 2 steps with FSDP under one plan, save with the optimizer; resume under another plan
    with FSDP and with DDP, each 2 steps against the plain model trained on without a break."""
    with gloo_group(rank, world, init_file):
        model, ref, fast = _fsdp_model(rank, world)
        opt = torch.optim.Adagrad(fast.parameters(), lr=0.1)
        ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.1)
        _steps(rank, world, fast, ref, opt, ref_opt, 2)
        fxrec.checkpoint.save(fast, path + "/a", optimizer=opt)
        saved_ref = copy.deepcopy((ref.state_dict(), ref_opt.state_dict()))
        _steps(rank, world, fast, ref, opt, ref_opt, 2, first=3)
        after = copy.deepcopy((ref.state_dict(), ref_opt.state_dict()))
        for dense in ("fsdp", "ddp"):
            _, ref2, fast2 = _fsdp_model(rank, world, seed=5, pins=PLAN_B) if dense == "fsdp" else (None, None, None)
            if dense == "ddp":
                torch.manual_seed(5)
                m = SparseModel()
                example = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)
                plan = fxrec.plan(m, example, world_size=world, memory_per_rank="1GB", pins=PLAN_B)
                fast2, ref2 = fxrec.transform(m, example, plan=plan), copy.deepcopy(m)
            opt2 = torch.optim.Adagrad(fast2.parameters(), lr=0.1)
            fxrec.checkpoint.load(fast2, path + "/a", optimizer=opt2)
            ref2_opt = torch.optim.Adagrad(ref2.parameters(), lr=0.1)
            ref2.load_state_dict(saved_ref[0])
            ref2_opt.load_state_dict(copy.deepcopy(saved_ref[1]))  # (load_state_dict keeps the tensors given)
            _steps(rank, world, fast2, ref2, opt2, ref2_opt, 2, first=3, label=dense)
            for name, want in after[0].items():
                if name in ("bags.0.weight", "single.weight"):
                    continue  # (sharded tables: checked through the outputs)
                got = fast2.state_dict()[name]
                torch.testing.assert_close(_full(got), want, msg=f"{dense}: {name}")
        if dense == "ddp":  # the DDP model's checkpoint into an FSDP one
            fxrec.checkpoint.save(fast2, path + "/b", optimizer=opt2)
            _, ref3, fast3 = _fsdp_model(rank, world, seed=7)
            opt3 = torch.optim.Adagrad(fast3.parameters(), lr=0.1)
            fxrec.checkpoint.load(fast3, path + "/b", optimizer=opt3)
            ref3.load_state_dict(ref2.state_dict())
            ref3_opt = torch.optim.Adagrad(ref3.parameters(), lr=0.1)
            ref3_opt.load_state_dict(ref2_opt.state_dict())
            _steps(rank, world, fast3, ref3, opt3, ref3_opt, 2, first=5)
        dist.barrier()
    os._exit(0)


def test_fsdp_checkpoints_resume_under_another_plan_with_fsdp_and_ddp_and_in_one_process(tmp_path):
    spawn(_checkpoint_worker, 2, str(tmp_path))
    torch.manual_seed(0)
    model = SparseModel()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    fxrec.checkpoint.load_into_model(model, str(tmp_path / "a"), optimizer=opt)
    torch.manual_seed(0)  # the plain model trained 2 steps on the global batch
    ref = SparseModel()
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.1)
    for step in (1, 2):
        ref_opt.zero_grad()
        ref(*global_batch(LOCAL_B * 2, step)).sum().backward()
        ref_opt.step()
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], want, msg=name)
    for a, b in zip(opt.state_dict()["state"].values(), ref_opt.state_dict()["state"].values()):
        torch.testing.assert_close(a["sum"].to_dense(), b["sum"].to_dense())


def _fused_worker(rank, world, init_file):
    """Fused Adagrad on the tables, SGD with momentum on the rest (FSDP's DTensors) through
    make_optimizer."""
    with gloo_group(rank, world, init_file):
        pins = {"bags.0": "row_wise", "bags.1": "table_wise", "bags.2": "data_parallel", "single": ("table_wise", 1)}
        model, ref, fast = _fsdp_model(rank, world, optimizer=fxrec.optim.Adagrad(lr=0.1), pins=pins)
        assert any(getattr(m, "fused_active", False) for m in fast.modules())  # (Adagrad fused into backward)
        opt = fast.make_optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)
        tables = [p for n, p in ref.named_parameters() if n.startswith(("bags", "single"))]
        dense = [p for n, p in ref.named_parameters() if not n.startswith(("bags", "single"))]
        ref_tables = torch.optim.Adagrad(tables, lr=0.1)
        ref_dense = torch.optim.SGD(dense, lr=0.05, momentum=0.9)
        for step in range(1, 4):
            ref_tables.zero_grad()
            ref_dense.zero_grad()
            opt.zero_grad()
            x = global_batch(LOCAL_B * world, step)
            want = ref(*x)
            got = fast(*local_batch(x, rank, LOCAL_B))
            torch.testing.assert_close(got, want[rank * LOCAL_B:(rank + 1) * LOCAL_B], msg=f"step {step}")
            want.sum().backward()
            got.sum().backward()
            ref_tables.step()
            ref_dense.step()
            opt.step()
        params = dict(fast.named_parameters())
        for name in ("mlp.0.weight", "mlp.2.bias", "bags.2.weight"):
            torch.testing.assert_close(_full(params[name]).detach(), ref.get_parameter(name).detach(), msg=name)
        dist.barrier()
    os._exit(0)


def test_fsdp_with_fused_table_optimizers_and_make_optimizer_trains_as_the_plain_model():
    spawn(_fused_worker, 2)


def _accumulating_worker(rank, world, init_file):
    """Micro-batches with FSDP's gradient sync on for each, and off but for the last; two losses'
    backward calls through one forward: the sums of the plain model's gradients."""
    with gloo_group(rank, world, init_file):
        model, ref, fast = _fsdp_model(rank, world)
        opt = torch.optim.SGD(fast.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(3):
            opt.zero_grad()
            ref_opt.zero_grad()
            if step == 2:  # one forward, two losses' backward calls
                x = global_batch(LOCAL_B * world, 99)
                want, got = ref(*x), fast(*local_batch(x, rank, LOCAL_B))
                for loss in (lambda y: y.sum(), lambda y: (y * y).sum()):
                    loss(want).backward(retain_graph=True)
                    loss(got).backward(retain_graph=True)
            for micro in range(3 if step < 2 else 0):
                x = global_batch(LOCAL_B * world, 10 * step + micro + 1)
                if step == 1:  # (FSDP's own accumulation: sync for the last micro-batch only)
                    fast.set_requires_gradient_sync(micro == 2)
                ref(*x).sum().backward()
                fast(*local_batch(x, rank, LOCAL_B)).sum().backward()
            fast.set_requires_gradient_sync(True)
            ref_opt.step()
            opt.step()
        for name in DENSE + WHOLE:
            torch.testing.assert_close(_full(dict(fast.named_parameters())[name]).detach(),
                                       ref.get_parameter(name).detach(), msg=name)
        dist.barrier()
    os._exit(0)


def test_fsdp_sums_gradients_of_micro_batches_and_of_two_backward_calls_as_the_plain_model():
    spawn(_accumulating_worker, 2)


# ------------------------------------------------------------------ fxrec.clip_grad_norm_
def plain_clip(model, max_norm, norm_type=2.0):
    """torch's clip_grad_norm_ on the plain model, its sparse gradients counted dense (torch's own
    refuses them)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    dense = [g.to_dense() if g.is_sparse else g for g in grads]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in dense]), norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total


def _clip_worker(rank, world, init_file, dense, norm_type):
    """Three steps with the gradients clipped (to a norm below theirs) before SGD's step, against the
    plain model clipped the same way on the global batch: the same norm on every rank, the same
    parameters after."""
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = SparseModel()
        ref = copy.deepcopy(model)
        example = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)
        pins = {"bags.0": "row_wise", "bags.1": "data_parallel", "bags.2": "data_parallel",
                "single": {"sharding": "column_wise", "ranks": [0, 1]}}
        plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins=pins)
        fast = fxrec.transform(model, example, plan=plan, dense=dense)
        opt, ref_opt = torch.optim.SGD(fast.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(1, 4):
            opt.zero_grad()
            ref_opt.zero_grad()
            x = global_batch(LOCAL_B * world, step)
            ref(*x).sum().backward()
            fast(*local_batch(x, rank, LOCAL_B)).sum().backward()
            want = plain_clip(ref, 0.5, norm_type)
            got = fxrec.clip_grad_norm_(fast, 0.5, norm_type)
            assert want > 0.5, want  # (it clips)
            torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=0, msg=f"step {step}")
            every = [torch.zeros(()) for _ in range(world)]
            dist.all_gather(every, got)
            assert all(torch.equal(e, every[0]) for e in every), every  # the same factor on every rank
            ref_opt.step()
            opt.step()
        params = dict(fast.named_parameters())
        for name in DENSE + WHOLE:
            torch.testing.assert_close(_full(params[name]).detach(), ref.get_parameter(name).detach(), msg=name)
        x = global_batch(LOCAL_B * world, 9)  # (the sharded tables: through the outputs)
        torch.testing.assert_close(fast(*local_batch(x, rank, LOCAL_B)), ref(*x)[rank * LOCAL_B:(rank + 1) * LOCAL_B])
        dist.barrier()
    os._exit(0)


@pytest.mark.parametrize("dense,norm_type", [("ddp", 2.0), ("fsdp", 2.0), ("ddp", float("inf")), ("fsdp", 1.0)])
def test_clip_grad_norm_clips_a_sharded_model_by_the_plain_models_norm(dense, norm_type):
    spawn(_clip_worker, 2, dense, norm_type)


def test_clip_grad_norm_in_one_process_is_torchs_with_sparse_gradients_and_fused_tables_left_out():
    torch.manual_seed(0)
    model = SparseModel()
    ref = copy.deepcopy(model)
    fast = fxrec.transform(model, global_batch(8, 0))
    x = global_batch(8, 1)
    ref(*x).sum().backward()
    fast(*x).sum().backward()
    torch.testing.assert_close(fxrec.clip_grad_norm_(fast, 0.3), plain_clip(ref, 0.3).float(), rtol=1e-6, atol=0)
    for (n, a), (_, b) in zip(fast.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(a.grad.to_dense(), b.grad.to_dense(), msg=n)
    ref.zero_grad()  # (the test's plain_clip is torch's, where torch's takes the gradients)
    ref(*x).sum().backward()
    ref.bags[1].weight.grad = None
    twin = copy.deepcopy(ref)
    for a, b in zip(ref.parameters(), twin.parameters()):
        b.grad = None if a.grad is None else a.grad.clone()
    torch.testing.assert_close(plain_clip(ref, 0.3), torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.3))
    for a, b in zip(ref.parameters(), twin.parameters()):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad)
    fused = fxrec.transform(model, global_batch(8, 0), optimizer=fxrec.optim.SGD(lr=0.1))
    fused(*x).sum().backward()
    assert fused.get_parameter("bags.0.weight").grad is None  # (updated in backward: no gradient to clip)
    rest = [p.grad for n, p in fused.named_parameters() if p.grad is not None]
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.to_dense()) for g in rest]))
    torch.testing.assert_close(fxrec.clip_grad_norm_(fused, 1e9), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("args,words", [((-1.0,), "max_norm must be a number >= 0"),
                                        ((1.0, 0), "norm_type must be a number > 0"),
                                        ((float("nan"),), "max_norm must be")])
def test_clip_grad_norm_refuses_bad_arguments(args, words):
    with pytest.raises(fxrec.InputError, match=words):
        fxrec.clip_grad_norm_(SparseModel(), *args)


def test_clip_grad_norm_raises_on_a_non_finite_norm_when_asked():
    model = SparseModel()
    model.mlp[0].weight.grad = torch.full_like(model.mlp[0].weight, float("inf"))
    with pytest.raises(RuntimeError, match="total norm of order 2.0 of the gradients is inf"):
        fxrec.clip_grad_norm_(model, 1.0, error_if_nonfinite=True)
    assert fxrec.clip_grad_norm_(model, 1.0).isinf()


# ------------------------------------------------------------------ refusals and the report
def test_dense_fsdp_needs_a_plan_and_dense_takes_ddp_or_fsdp():
    model = SparseModel()
    with pytest.raises(ValueError, match="dense='fsdp' shards the model's other parameters over the ranks of a "
                                         "sharding plan.*fully_shard yourself"):
        fxrec.transform(model, global_batch(8, 0), dense="fsdp")
    with pytest.raises(ValueError, match=r"dense must be one of \('ddp', 'fsdp'\), got 'zero3'"):
        fxrec.transform(model, global_batch(8, 0), dense="zero3")


def _inference_fsdp(rank, world):
    model = SparseModel()
    example = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)
    plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins={"bags.0": "row_wise"})
    fxrec.transform(model, example, plan=plan, mode="inference", dense="fsdp")


def test_dense_fsdp_is_refused_for_inference(tmp_path):
    msg = error_of(tmp_path, 2, _inference_fsdp)
    assert "dense='fsdp' shards the parameters trained over ranks; mode='inference'" in msg, msg


def _report_worker(rank, world, init_file, out):
    with gloo_group(rank, world, init_file):
        _, _, fast = _fsdp_model(rank, world)
        if rank == 0:
            with open(out, "w") as f:
                f.write(str(fast.report))
        dist.barrier()
    os._exit(0)


def test_the_report_says_fsdp_shards_the_other_parameters(tmp_path):
    spawn(_report_worker, 2, str(tmp_path / "report.txt"))
    text = (tmp_path / "report.txt").read_text()
    assert "rank 0 of 2: holds bags.0 (row_wise, rows 0..19); the parameters that are not tables are sharded over " \
           "the ranks by FSDP" in text, text
    assert "FSDP: the whole model is one unit" in text, text


# ------------------------------------------------------------------ found by a review
def _rowwise_worker(rank, world, init_file, path):
    """Row-wise Adagrad fused into the sharded tables' backward, its torch form stepping the
    data-parallel ones (whole rows: they are not FSDP's), SGD the rest; an evaluation forward
    under no_grad between steps leaves the dense parameters sharded, and the checkpoint then saved
    resumes in a new model as the plain model trains on."""
    from tests.test_fused_optimizers import RowWiseAdagradReference

    with gloo_group(rank, world, init_file):
        pins = {"bags.0": "row_wise", "bags.1": "data_parallel", "bags.2": "data_parallel", "single": "table_wise"}
        _, ref, fast = _fsdp_model(rank, world, optimizer=fxrec.optim.RowWiseAdagrad(lr=0.1), pins=pins)
        tables = [p for n, p in ref.named_parameters() if n.startswith(("bags", "single"))]
        dense = [p for n, p in ref.named_parameters() if not n.startswith(("bags", "single"))]
        ref_opts = [RowWiseAdagradReference(tables, lr=0.1, eps=1e-8), torch.optim.SGD(dense, lr=0.1)]

        def steps(fast, opt, first, n):
            for step in range(first, first + n):
                x = global_batch(LOCAL_B * world, step)
                want, got = ref(*x), fast(*local_batch(x, rank, LOCAL_B))
                torch.testing.assert_close(got, want[rank * LOCAL_B:(rank + 1) * LOCAL_B], msg=f"step {step}")
                for o in ref_opts:
                    o.zero_grad()
                opt.zero_grad()
                want.sum().backward()
                got.sum().backward()
                for o in ref_opts:
                    o.step()
                opt.step()
                fast.eval()
                with torch.no_grad():
                    fast(*local_batch(x, rank, LOCAL_B))
                fast.train()
                assert type(fast.get_parameter("mlp.0.weight")).__name__ == "DTensor"  # sharded again

        opt = fast.make_optimizer(torch.optim.SGD, lr=0.1)
        steps(fast, opt, 1, 2)
        fxrec.checkpoint.save(fast, path, optimizer=opt)
        _, _, fast2 = _fsdp_model(rank, world, seed=3, optimizer=fxrec.optim.RowWiseAdagrad(lr=0.1), pins=pins)
        opt2 = fast2.make_optimizer(torch.optim.SGD, lr=0.1)
        fxrec.checkpoint.load(fast2, path, optimizer=opt2)
        steps(fast2, opt2, 3, 2)
        dist.barrier()
    os._exit(0)


def test_fsdp_with_row_wise_adagrad_fallbacks_on_data_parallel_tables_trains_evaluates_and_resumes(tmp_path):
    spawn(_rowwise_worker, 2, str(tmp_path / "ckpt"))


class TiedTables(torch.nn.Module):
    """Two bags sharing one weight, a third table, a linear layer."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.EmbeddingBag(30, 8, mode="sum") for _ in range(3))
        self.b.weight = self.a.weight
        self.mlp = torch.nn.Linear(24, 1)

    def forward(self, x, y, z):
        return self.mlp(torch.cat([self.a(x), self.b(y), self.c(z)], 1)).squeeze(1)


def _tied_batch(seed, batch):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, 30, (batch, 3), generator=g) for _ in range(3))


def _planned(make, batch, pins, rank, world, fsdp_units=None):
    """``make()`` (seed 0), a copy of it, this rank's slice of a global batch, the plan (``pins``)
    and the model transformed with dense='fsdp' (and ``fsdp_units``) on this rank's slice of
    ``batch(0, ...)``."""
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    local = lambda x: tuple(t[rank * LOCAL_B:(rank + 1) * LOCAL_B] for t in x)  # noqa: E731
    plan = fxrec.plan(model, local(batch(0, LOCAL_B * world)), world_size=world, memory_per_rank="1GB", pins=pins)
    return ref, local, plan, fxrec.transform(model, local(batch(0, LOCAL_B * world)), plan=plan, dense="fsdp",
                                             fsdp_units=fsdp_units)


def _tied_worker(rank, world, init_file, path):
    with gloo_group(rank, world, init_file):
        ref, local, _, fast = _planned(TiedTables, _tied_batch, {"a": "data_parallel", "c": "row_wise"}, rank, world)
        opt, ref_opt = torch.optim.SGD(fast.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in (1, 2):
            x = _tied_batch(step, LOCAL_B * world)
            opt.zero_grad()
            ref_opt.zero_grad()
            ref(*x).sum().backward()
            fast(*local(x)).sum().backward()
            opt.step()
            ref_opt.step()
        fxrec.checkpoint.save(fast, path)
        torch.testing.assert_close(fast(*local(_tied_batch(9, LOCAL_B * world))),
                                   ref(*_tied_batch(9, LOCAL_B * world))[rank * LOCAL_B:(rank + 1) * LOCAL_B])
        dist.barrier()
    os._exit(0)


def _loads_as_trained(make, batch, steps, path) -> None:
    """A checkpoint of ``steps`` SGD steps (lr 0.1, seed 0) on the global batches ``batch(step, 2 *
    LOCAL_B)``, loaded into a fresh ``make()`` in one process, holds what the plain model trained
    so holds."""
    torch.manual_seed(0)
    model, ref = make(), make()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in steps:
        opt.zero_grad()
        ref(*batch(step, LOCAL_B * 2)).sum().backward()
        opt.step()
    fxrec.checkpoint.load_into_model(model, path)
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], want, msg=name)


def test_fsdp_with_tied_data_parallel_tables_trains_and_saves_for_one_process(tmp_path):
    spawn(_tied_worker, 2, str(tmp_path / "ckpt"))
    _loads_as_trained(TiedTables, _tied_batch, (1, 2), str(tmp_path / "ckpt"))


def test_explain_says_what_transform_says_of_dense_fsdp_for_every_rank():
    model = SparseModel()
    example = local_batch(global_batch(LOCAL_B * 2, 0), 0, LOCAL_B)
    plan = fxrec.plan(model, example, world_size=2, memory_per_rank="1GB", pins={"bags.0": "row_wise"})
    notes = [n for n in fxrec.explain(model, example, plan=plan, dense="fsdp").notes if n.startswith("rank ")]
    assert len(notes) == 2 and all("the parameters that are not tables are sharded over the ranks by FSDP" in n
                                   for n in notes), notes
    assert [n for n in fxrec.explain(model, example, plan=plan, dense="fsdp").notes if n.startswith("FSDP")] \
        == [fxrec.ranks.units_note([])]
    towers = fxrec.plan(Tower(), _tower_batch(0, LOCAL_B), world_size=2, memory_per_rank="1GB", pins={"emb": "row_wise"})
    assert [n for n in fxrec.explain(Tower(), _tower_batch(0, LOCAL_B), plan=towers, dense="fsdp").notes
            if n.startswith("FSDP")] == [
        "FSDP units (by rule): blocks.0, blocks.1, blocks.2, head (each gathered whole for its own call in forward and again in "
        "backward, and freed after); the other dense parameters are the model's own unit, whole for the step"]
    ddp = fxrec.explain(model, example, plan=plan).notes
    assert len([n for n in ddp if n.startswith("rank ")]) == 2 and not any("FSDP" in n for n in ddp), ddp
    with pytest.raises(ValueError, match="dense='fsdp' shards the model's other parameters"):
        fxrec.explain(model, example, dense="fsdp")


class AutocastTable(torch.nn.Module):
    """A table looked up only inside a torch.autocast block (left as written), one sharded, a linear layer."""

    def __init__(self, sparse):
        super().__init__()
        self.a = torch.nn.EmbeddingBag(64, 4, mode="sum")
        self.h = torch.nn.EmbeddingBag(64, 4, mode="sum", sparse=sparse)
        self.top = torch.nn.Linear(8, 1)

    def forward(self, ids, off, hids, hoff):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.h(hids, hoff)
        return self.top(torch.cat([self.a(ids, off), y.float()], 1)).squeeze(1)


def _autocast_batch(seed, batch):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 64, (2 * batch,), generator=g), torch.arange(0, 2 * batch, 2),
            torch.randint(0, 64, (2 * batch,), generator=g), torch.arange(0, 2 * batch, 2))


def _autocast_worker(rank, world, init_file, sparse):
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = AutocastTable(sparse)
        ref = copy.deepcopy(model)
        plan = fxrec.plan(model, _autocast_batch(0, 4), world_size=world, memory_per_rank="1GB", pins={"a": "row_wise"})
        fast = fxrec.transform(model, _autocast_batch(rank, 4), plan=plan, dense="fsdp")
        assert type(fast.get_parameter("h.weight")).__name__ == "Parameter"  # a table: whole, not FSDP's
        assert type(fast.get_parameter("top.weight")).__name__ == "DTensor"
        opt, ref_opt = torch.optim.SGD(fast.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in (1, 2):
            x = [_autocast_batch(10 * step + r, 4) for r in range(world)]
            opt.zero_grad()
            ref_opt.zero_grad()
            sum(ref(*b).sum() for b in x).backward()
            fast(*x[rank]).sum().backward()
            opt.step()
            ref_opt.step()
        torch.testing.assert_close(fast.get_parameter("h.weight").detach(), ref.h.weight.detach())
        dist.barrier()
    os._exit(0)


@pytest.mark.parametrize("sparse", [False, True])
def test_fsdp_keeps_a_table_read_only_in_an_autocast_block_whole(sparse):
    """(FSDP was given it, as a dense layer: a chunk, and for sparse gradients a failed backward;
    from a final review.)"""
    spawn(_autocast_worker, 2, sparse)


# ------------------------------------------------------------------ FSDP units (outline_dense_units)
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.lin = torch.nn.Linear(8, 8)
        self.act = torch.nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(self.lin(self.norm(x))) + x


class Tower(torch.nn.Module):
    """A row-wise table under blocks (each an FSDP unit), a layer called twice (in the model's own
    unit, with the head's bias scale) and a head."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.EmbeddingBag(40, 8, mode="sum")
        self.blocks = torch.nn.ModuleList([Block(), Block(), Block()])
        self.shared = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)
        self.scale = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return (self.head(self.shared(self.shared(x))) * self.scale).squeeze(1)


def _tower_batch(seed, batch):
    return (torch.randint(0, 40, (batch, 3), generator=torch.Generator().manual_seed(seed)),)


def _tower_steps(fast, ref, local, rank, world, steps, evaluate=False):
    """SGD steps (lr 0.1) of the sharded ``fast`` and the plain ``ref`` on the global batches of
    ``steps``, this rank's outputs against the plain model's; with ``evaluate``, an evaluation
    forward after each (every unit freed again after it). Returns ``fast``'s optimizer."""
    opt, ref_opt = torch.optim.SGD(fast.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    mine = slice(rank * LOCAL_B, (rank + 1) * LOCAL_B)
    for step in steps:
        x = _tower_batch(step, LOCAL_B * world)
        opt.zero_grad()
        ref_opt.zero_grad()
        want = ref(*x)
        got = fast(*local(x))
        torch.testing.assert_close(got, want[mine], msg=f"step {step}")
        want.sum().backward()
        got.sum().backward()
        opt.step()
        ref_opt.step()
        if evaluate:
            with torch.no_grad():
                torch.testing.assert_close(fast(*local(_tower_batch(50, LOCAL_B * world))),
                                           ref(*_tower_batch(50, LOCAL_B * world))[mine])
    return opt


def _units_worker(rank, world, init_file, path):
    with gloo_group(rank, world, init_file):
        ref, local, plan, fast = _planned(Tower, _tower_batch, {"emb": "row_wise"}, rank, world)
        assert fast.meta["fxrec_fsdp_units"] == ["blocks.0", "blocks.1", "blocks.2", "head"]
        seen = []

        def held(module, args):  # (after FSDP's own pre-forward hook: blocks.2 gathered, blocks.0 freed again)
            seen.append((type(fast.blocks[0].lin._parameters["weight"]).__name__,
                         type(module.lin._parameters["weight"]).__name__))

        hook = fast.blocks[2].register_forward_pre_hook(held)
        opt = _tower_steps(fast, ref, local, rank, world, (1, 2, 3), evaluate=True)
        hook.remove()
        assert seen == [("DTensor", "Parameter")] * 6, seen  # (3 training and 3 evaluation forwards)
        fxrec.checkpoint.save(fast, path, optimizer=opt)
        for name, p in ref.named_parameters():
            if name != "emb.weight":
                torch.testing.assert_close(_full(fast.get_parameter(name)).detach(), p.detach(), msg=name)
        torch.manual_seed(3)  # into another model with units: its parameters and optimizer from the checkpoint
        other = fxrec.transform(Tower(), local(_tower_batch(0, LOCAL_B * world)), plan=plan, dense="fsdp")
        other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
        fxrec.checkpoint.load(other, path, optimizer=other_opt)
        x = _tower_batch(60, LOCAL_B * world)
        torch.testing.assert_close(other(*local(x)), fast(*local(x)))
        dist.barrier()
    os._exit(0)


def test_fsdp_units_train_evaluate_and_save_as_the_plain_model(tmp_path):
    spawn(_units_worker, 2, str(tmp_path / "ckpt"))
    _loads_as_trained(Tower, _tower_batch, (1, 2, 3), str(tmp_path / "ckpt"))


def _named_units_worker(rank, world, init_file, path):
    with gloo_group(rank, world, init_file):
        names = ["head", "blocks.1.lin", "blocks.2"]  # (a layer inside a block, a block, the head: the rest the model's)
        ref, local, plan, fast = _planned(Tower, _tower_batch, {"emb": "row_wise"}, rank, world, fsdp_units=names)
        assert fast.meta["fxrec_fsdp_units"] == ["blocks.1.lin", "blocks.2", "head"]
        assert "FSDP units (as fsdp_units names them): blocks.1.lin, blocks.2, head" in str(fast.report)
        seen = []
        hook = fast.blocks[2].register_forward_pre_hook(  # (blocks.1.lin freed again; blocks.0, the model's, whole)
            lambda m, a: seen.append(tuple(type(fast.blocks[i].lin._parameters["weight"]).__name__ for i in (0, 1, 2))))
        opt = _tower_steps(fast, ref, local, rank, world, (1, 2))
        hook.remove()
        assert seen == [("Parameter", "DTensor", "Parameter")] * 2, seen
        fxrec.checkpoint.save(fast, path, optimizer=opt)
        one = fxrec.transform(Tower(), local(_tower_batch(0, LOCAL_B * world)), plan=plan, dense="fsdp", fsdp_units="one")
        assert one.meta["fxrec_fsdp_units"] == [] and "fsdp_units='one'" in str(one.report)
        fxrec.checkpoint.load(one, path)  # (into the model as one unit)
        x = _tower_batch(60, LOCAL_B * world)
        torch.testing.assert_close(one(*local(x)), fast(*local(x)))
        # ranks that choose other units are refused, naming the setting, on both
        with pytest.raises(ValueError, match="the ranks called transform differently: fsdp_units is None on rank 0 and .every. on rank 1"):
            fxrec.transform(Tower(), local(_tower_batch(0, LOCAL_B * world)), plan=plan, dense="fsdp",
                            fsdp_units="every" if rank else None)
        with pytest.raises(ValueError, match=re.escape("fsdp_units: submodule 'shared' cannot be an FSDP unit: the "
                                                       "model's forward calls it 2 times")):
            fxrec.transform(Tower(), local(_tower_batch(0, LOCAL_B * world)), plan=plan, dense="fsdp",
                            fsdp_units=["shared"])
        dist.barrier()
    os._exit(0)


def test_fsdp_units_named_by_the_user_train_as_the_plain_model_and_load_as_one_unit(tmp_path):
    spawn(_named_units_worker, 2, str(tmp_path / "ckpt"))
    _loads_as_trained(Tower, _tower_batch, (1, 2), str(tmp_path / "ckpt"))


def test_fsdp_units_is_checked_before_anything_runs():
    model = SparseModel()
    example = local_batch(global_batch(LOCAL_B * 2, 0), 0, LOCAL_B)
    plan = fxrec.plan(model, example, world_size=2, memory_per_rank="1GB")
    for kwargs, words in [
        (dict(fsdp_units="one"), "fsdp_units= chooses the FSDP units of dense='fsdp'; dense is 'ddp'"),
        (dict(dense="fsdp", fsdp_units="all"), "fsdp_units must be None (the rule), one of ('one', 'every') or a list"),
        (dict(dense="fsdp", fsdp_units=["mlp.0", 2]), "a list of submodule names (strings"),
        (dict(dense="fsdp", fsdp_units="mlp.0"), "fsdp_units must be None (the rule), one of ('one', 'every')"),
        (dict(dense="fsdp", fsdp_units=["mlp.0", "mlp.0"]), "fsdp_units names 'mlp.0' twice"),
    ]:
        with pytest.raises(ValueError, match=re.escape(words)):  # (transform's check, the same function)
            fxrec.explain(model, example, plan=plan, **kwargs)
    with pytest.raises(ValueError, match=re.escape("submodule 'mlp.1' cannot be an FSDP unit: it holds no dense parameter")):
        fxrec.explain(model, example, plan=plan, dense="fsdp", fsdp_units=["mlp.1"])
    notes = fxrec.explain(model, example, plan=plan, dense="fsdp", fsdp_units="every").notes
    assert [n for n in notes if n.startswith("FSDP")] == [
        "FSDP units (every submodule that can be one): mlp.0, mlp.2 (each gathered whole for its own call in forward "
        "and again in backward, and freed after); the other dense parameters are the model's own unit, whole for the step"]


def test_the_gpu_units_worker_runs_on_gloo(tmp_path):
    """tests/test_gpu.py's FSDP-units test (world size 1 on NCCL there), at world size 2 on gloo."""
    from tests.test_gpu import _fsdp_units_worker

    spawn(_fsdp_units_worker, 2, str(tmp_path), "gloo")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.0", "ok.1"]


class ScaledNorm(torch.nn.Module):
    """Batch norm's buffers, a buffer of the model's own and a 0-dim parameter beside a table."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.EmbeddingBag(40, 8, mode="sum")
        self.norm = torch.nn.BatchNorm1d(8)
        self.lin = torch.nn.Linear(8, 1)
        self.register_buffer("shift", torch.randn(8))
        self.scale = torch.nn.Parameter(torch.randn(()))

    def forward(self, ids):
        return (self.lin(self.norm(self.emb(ids)) + self.shift) * self.scale).squeeze(1)


class RootTable(torch.nn.Module):
    """A table the model holds itself (read by F.embedding_bag), batch norm's buffers, a layer."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Parameter(torch.randn(40, 8))
        self.norm = torch.nn.BatchNorm1d(8)
        self.lin = torch.nn.Linear(8, 1)

    def forward(self, ids):
        return self.lin(self.norm(torch.nn.functional.embedding_bag(ids, self.emb, mode="sum"))).squeeze(1)


class OnlyScalar(torch.nn.Module):
    """Nothing for FSDP to shard: a 0-dim parameter and a buffer beside a table."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.EmbeddingBag(40, 8, mode="sum")
        self.register_buffer("shift", torch.randn(8))
        self.scale = torch.nn.Parameter(torch.randn(()))

    def forward(self, ids):
        return ((self.emb(ids) + self.shift) * self.scale).sum(1)


BROADCAST = {"ScaledNorm": (ScaledNorm, ("scale", "shift", "norm.running_mean", "norm.running_var", "lin.bias",
                                         "lin.weight")),
             "RootTable": (RootTable, ("norm.running_mean", "norm.running_var", "lin.weight")),
             "OnlyScalar": (OnlyScalar, ("scale", "shift"))}


def _broadcast_worker(rank, world, init_file, which):
    make, names = BROADCAST[which]
    with gloo_group(rank, world, init_file):
        torch.manual_seed(rank)  # each rank its own values: transform gives every rank rank 0's
        model = make()
        with torch.no_grad():
            for name, b in model.named_buffers():
                if b.is_floating_point():
                    b.normal_()
        want = [{n: t.clone() for n, t in list(model.named_parameters()) + list(model.named_buffers())}]
        dist.broadcast_object_list(want, 0)
        batch = _tower_batch(0, LOCAL_B)
        plan = fxrec.plan(model, batch, world_size=world, memory_per_rank="1GB", pins={"emb": "row_wise"})
        fast = fxrec.transform(model, batch, plan=plan, dense="fsdp")
        params = dict(fast.named_parameters())
        for name in names:
            got = _full(params[name]) if name in params else fast.get_buffer(name)
            torch.testing.assert_close(got.detach(), want[0][name], msg=f"rank {rank}: {name}")
        dist.barrier()
    os._exit(0)


@pytest.mark.parametrize("which", sorted(BROADCAST))
def test_fsdp_starts_every_rank_from_rank_0s_buffers_and_0_dim_parameters(which):
    """Found by reviews: with a 0-dim parameter of the model itself, neither it nor any buffer was
    broadcast from rank 0 (its name made the whole model count as a table's module); a table the
    model holds itself did the same; with nothing for FSDP to shard, nothing was broadcast."""
    spawn(_broadcast_worker, 2, which)
