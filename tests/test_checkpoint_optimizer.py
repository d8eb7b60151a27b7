"""fxrec.checkpoint with optimizer=: the state of the optimizer that opt.step() runs (dense Adam,
torch.optim fallbacks of tables, fused groups' lr) is saved by parameter name and resumes training
as if it had never stopped: in one process bit for bit, from world size 2 to world size 4 under
another plan and into one process as the uninterrupted single-process run (to float rounding)."""

import copy
import gc
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fxrec
from fxrec.checkpoint import CheckpointError
from fxrec.optim import RowWiseAdagradTorch
from tests.test_sharding import (_CKPT_G, Model, _held_part, _train_fused, global_batch, gloo_group, local_batch,
                                  spawn)

# Every kind of optimizer state: torch.optim Adam on three tables (fxrec never fuses Adam on CPU),
# Adagrad with lr_decay (not fused: its step matters) on one, and bags.1 with no fxrec optimizer,
# so that it trains with the dense optimizer (torch.optim.Adam) with the dense layer.
TABLE_OPT = {"bags.0": fxrec.optim.Adam(lr=0.05), "bags.2": fxrec.optim.Adam(lr=0.05),
             "single": fxrec.optim.Adagrad(lr=0.1, lr_decay=0.01)}
PLAN_A = {"bags.0": ("table_wise", 1), "bags.1": "row_wise", "bags.2": "data_parallel", "single": "row_wise"}
PLAN_B = {"bags.0": "row_wise", "bags.1": ("table_wise", 3), "bags.2": "row_wise", "single": ("table_wise", 2)}
TOL = dict(rtol=1e-5, atol=1e-6)


def single_process(model, table_opt=TABLE_OPT):
    fast = fxrec.transform(copy.deepcopy(model), global_batch(_CKPT_G, 0), optimizer=table_opt)
    return fast, fast.make_optimizer(torch.optim.Adam, lr=0.01)


def sharded(model, world, rank, pins):
    example = local_batch(global_batch(_CKPT_G, 0), rank, _CKPT_G // world)
    plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins=pins, optimizer=TABLE_OPT)
    fast = fxrec.transform(copy.deepcopy(model), example, plan=plan, optimizer=TABLE_OPT)
    return fast, fast.make_optimizer(torch.optim.Adam, lr=0.01), plan


def model(seed):
    torch.manual_seed(seed)
    return Model()


def states(module, optimizers):
    """{param fqn: {state name: value}} of the torch optimizers (by the test's own bookkeeping)."""
    names = {id(p): n for n, p in module.named_parameters()}
    return {names[id(p)]: dict(st) for o in optimizers for p, st in o.state.items()}


def subs(opt):
    return ([opt.dense] if opt.dense is not None else []) + opt.fallbacks


def assert_same(a, b, what):
    assert a.keys() == b.keys(), (what, sorted(a), sorted(b))
    for k in a:
        if isinstance(a[k], dict):
            assert_same(a[k], b[k], f"{what} {k}")
        else:
            assert torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])), f"{what} {k}"


def assert_holds(fast, opt_states, ref, ref_states, plan, rank, what):
    """fast's parameters and optimizer states are this rank's parts of the single-process ones."""
    params = dict(fast.named_parameters())
    for name, want in ref.state_dict().items():
        tp = plan.tables.get(name.rsplit(".", 1)[0])
        if name in params:
            torch.testing.assert_close(params[name].detach(), _held_part(want, tp, rank), **TOL, msg=f"{what}: {name}")
    for name, st in opt_states.items():
        tp = plan.tables.get(name.rsplit(".", 1)[0])
        assert st.keys() == ref_states[name].keys(), (what, name, st.keys())
        for k, v in st.items():
            want = ref_states[name][k]
            want = want if v.dim() == 0 else _held_part(want, tp, rank)
            torch.testing.assert_close(v, want, **TOL, msg=f"{what}: state {k} of {name}")


# --------------------------------------------------------------------------- one process
def test_single_process_resume_equals_uninterrupted_training_bit_for_bit(tmp_path):
    """A fused table (Adagrad), torch.optim fallbacks (Adam, SGD with momentum), the dense Adam
    and an LR scheduler: 3 steps, save, load into another model's transform, 3 more steps: the
    same parameters, states and learning rates as 6 uninterrupted steps."""
    table_opt = {"bags.0": fxrec.optim.Adagrad(lr=0.1), "bags.1": fxrec.optim.Adam(lr=0.05),
                 "single": fxrec.optim.SGD(lr=0.1, momentum=0.9)}

    def make(m):
        fast, opt = single_process(m, table_opt)
        return fast, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    def run(fast, opt, sched, first, steps):
        for step in range(first, first + steps):
            _train_fused(1, 1)(fast, opt, step)
            sched.step()

    ref, ref_opt, ref_sched = make(model(0))
    run(ref, ref_opt, ref_sched, 0, 6)

    a, a_opt, a_sched = make(model(0))
    assert a_opt.fused and a_opt.fallbacks and a_opt.dense is not None, a_opt
    run(a, a_opt, a_sched, 0, 3)
    fxrec.checkpoint.save_model(a, tmp_path / "ckpt", optimizer=a_opt)
    sched_state = a_sched.state_dict()

    b, b_opt, b_sched = make(model(1))  # other initial values, fresh optimizer state and lr
    fxrec.checkpoint.load_into_model(b, tmp_path / "ckpt", optimizer=b_opt)
    b_sched.load_state_dict(sched_state)
    assert [g["lr"] for g in b_opt.param_groups] == [g["lr"] for g in a_opt.param_groups]
    run(b, b_opt, b_sched, 3, 3)
    assert_same(b.state_dict(), ref.state_dict(), "parameters")
    assert_same(states(b, subs(b_opt)), states(ref, subs(ref_opt)), "optimizer state")
    assert [g["lr"] for g in b_opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]

    # the test sees a missing state: without optimizer= the same checkpoint resumes differently
    c, c_opt, c_sched = make(model(1))
    fxrec.checkpoint.load_into_model(c, tmp_path / "ckpt")
    c_sched.load_state_dict(sched_state)
    run(c, c_opt, c_sched, 3, 3)
    assert not torch.equal(c.state_dict()["top.weight"], ref.state_dict()["top.weight"])


class Small(nn.Module):
    def __init__(self, rows=10, out=4):
        super().__init__()
        self.emb = nn.Embedding(rows, 3)
        self.lin = nn.Linear(3, out)

    def forward(self, ids):
        return self.lin(self.emb(ids)).sum()


def _steps(m, opts, first, n):
    for s in range(first, first + n):
        ids = torch.randint(0, m.emb.num_embeddings, (6,), generator=torch.Generator().manual_seed(s))
        for o in opts:
            o.zero_grad()
        m(ids).backward()
        for o in opts:
            o.step()


def test_a_plain_torch_optimizer_with_two_groups_and_a_per_row_state(tmp_path):
    """Any torch.optim optimizer over a plain model: two param groups keep their own (saved)
    hyperparameters; RowWiseAdagradTorch's [rows] state round-trips."""
    def make(seed, lrs):
        torch.manual_seed(seed)
        m = Small()
        sgd = torch.optim.SGD([{"params": m.lin.parameters(), "lr": lrs[0], "momentum": 0.9},
                               {"params": [m.emb.weight], "lr": lrs[1]}])
        return m, sgd

    ref, ref_opt = make(0, (0.1, 0.2))
    _steps(ref, [ref_opt], 0, 6)
    a, a_opt = make(0, (0.1, 0.2))
    _steps(a, [a_opt], 0, 3)
    fxrec.checkpoint.save_model(a, tmp_path / "sgd", optimizer=a_opt)
    b, b_opt = make(1, (0.5, 0.5))  # the checkpoint's learning rates win, as with torch's load_state_dict
    fxrec.checkpoint.load_into_model(b, tmp_path / "sgd", optimizer=b_opt)
    assert [g["lr"] for g in b_opt.param_groups] == [0.1, 0.2]
    _steps(b, [b_opt], 3, 3)
    assert_same(b.state_dict(), ref.state_dict(), "sgd parameters")
    assert_same(states(b, [b_opt]), states(ref, [ref_opt]), "sgd state")

    ref, a = Small(), Small()
    a.load_state_dict(ref.state_dict())
    ref_rw, a_rw = RowWiseAdagradTorch([ref.emb.weight], lr=0.3), RowWiseAdagradTorch([a.emb.weight], lr=0.3)
    _steps(ref, [ref_rw], 0, 4)
    _steps(a, [a_rw], 0, 2)
    assert a_rw.state[a.emb.weight]["sum"].shape == (10,)
    fxrec.checkpoint.save_model(a, tmp_path / "rw", optimizer=a_rw)
    b = Small()
    b_rw = RowWiseAdagradTorch([b.emb.weight], lr=0.3)
    fxrec.checkpoint.load_into_model(b, tmp_path / "rw", optimizer=b_rw)
    _steps(b, [b_rw], 2, 2)
    assert_same(b.state_dict(), ref.state_dict(), "row-wise parameters")
    assert_same(states(b, [b_rw]), states(ref, [ref_rw]), "row-wise state")


def test_optimizer_state_is_optional_both_ways_and_errors_name_what_does_not_fit(tmp_path):
    torch.manual_seed(0)
    m = Small()
    adam = torch.optim.Adam(m.parameters(), lr=0.1)
    _steps(m, [adam], 0, 2)
    saved = copy.deepcopy(m.state_dict())
    fxrec.checkpoint.save_model(m, tmp_path / "plain")
    fxrec.checkpoint.save_model(m, tmp_path / "with", optimizer=adam)
    lin_only = torch.optim.Adam(m.lin.parameters(), lr=0.1)
    _steps(m, [lin_only], 2, 1)
    fxrec.checkpoint.save_model(m, tmp_path / "lin_only", optimizer=lin_only)

    # a checkpoint without optimizer state: strict names it, strict=False loads the model alone
    b = Small()
    b_adam = torch.optim.Adam(b.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        fxrec.checkpoint.load_into_model(b, tmp_path / "plain", optimizer=b_adam)
    fxrec.checkpoint.load_into_model(b, tmp_path / "plain", optimizer=b_adam, strict=False)
    assert not b_adam.state
    assert_same(b.state_dict(), saved, "model loaded without optimizer state")
    # one with it loads without optimizer=
    fxrec.checkpoint.load_into_model(b, tmp_path / "with")
    assert not b_adam.state
    # an optimizer holding a parameter the checkpoint has no state for: named
    with pytest.raises(CheckpointError, match=r"no optimizer state for parameters \['emb.weight'\]"):
        fxrec.checkpoint.load_into_model(b, tmp_path / "lin_only", optimizer=b_adam)
    fxrec.checkpoint.load_into_model(b, tmp_path / "lin_only", optimizer=b_adam, strict=False)
    assert set(states(b, [b_adam])) == {"lin.weight", "lin.bias"}

    # a state of another shape: the parameter, the state and both shapes
    wide = Small(out=5)
    with pytest.raises(CheckpointError) as err:
        fxrec.checkpoint.load_into_model(wide, tmp_path / "with", optimizer=torch.optim.Adam(wide.parameters()))
    msg = str(err.value)  # the model's entries and the optimizer's states, in one error
    assert "optimizer state 'exp_avg' of parameter 'lin.weight' is 4 x 3 in the checkpoint and 5 x 3 in the model" \
        in msg, msg
    assert "optimizer state 'exp_avg_sq' of parameter 'lin.bias' is (4,) in the checkpoint and (5,)" in msg, msg
    assert "entry 'lin.weight' is 4 x 3 in the checkpoint and 5 x 3 in the model" in msg, msg

    # the optimizer's record is plain JSON: anything but what a save writes is refused, naming the file
    odd = tmp_path / "odd"
    shutil.copytree(tmp_path / "with", odd)
    file = odd / "fxrec_optimizer.json"
    file.write_text(file.read_text().replace('"lr": 0.1', '"lr": {"tensor": [0.1], "dtype": "Size"}'))
    fxrec.checkpoint.add_checksums(odd)
    with pytest.raises(CheckpointError, match="fxrec_optimizer.json cannot be read"):
        fxrec.checkpoint.load_into_model(b, odd, optimizer=b_adam)


# --------------------------------------------------------------------------- world 2 -> world 4
def _world_2(rank, world, init_file, root):
    """Plan A: 3 steps, save; the uninterrupted run goes on 3 steps. A fresh model loads it and
    its 3 steps equal those bit for bit. It then loads the one-process checkpoint and trains 3
    steps like the single-process model. Last, one RowWiseAdagradTorch step (per-row states of
    sharded tables), saved."""
    with gloo_group(rank, world, init_file):
        run = _train_fused(3, world, rank)
        fast, opt, plan = sharded(model(0), world, rank, PLAN_A)
        assert len(opt.fallbacks) == 2 and not opt.fused, opt  # Adam and Adagrad on this rank's tables
        run(fast, opt, 0)
        fxrec.checkpoint.save(fast, os.path.join(root, "a"), optimizer=opt)
        run(fast, opt, 3)

        fast2, opt2, _ = sharded(model(1), world, rank, PLAN_A)
        fxrec.checkpoint.load(fast2, os.path.join(root, "a"), optimizer=opt2)
        run(fast2, opt2, 3)
        assert_same(fast2.state_dict(), fast.state_dict(), f"rank {rank}: parameters after resuming")
        assert_same(states(fast2, subs(opt2)), states(fast, subs(opt)), f"rank {rank}: optimizer state")

        fxrec.checkpoint.load(fast2, os.path.join(root, "single"), optimizer=opt2)  # one process -> world 2
        run(fast2, opt2, 3)
        ref, ref_opt = single_process(model(0))
        _train_fused(6, 1)(ref, ref_opt, 0)
        assert_holds(fast2, states(fast2, subs(opt2)), ref, states(ref, subs(ref_opt)), plan, rank, "one process -> 2")

        tables = [p for n, p in fast2.named_parameters() if not n.startswith("top.")]
        rw = RowWiseAdagradTorch(tables, lr=0.2)
        _train_fused(1, world, rank)(fast2, rw, 6)
        fxrec.checkpoint.save(fast2, os.path.join(root, "rw"), optimizer=rw)

        if rank == 1:  # the ranks holding parts of a table must agree on its hyperparameters
            rw.param_groups[0]["lr"] = 0.3
        with pytest.raises(CheckpointError, match="ranks 0 and 1 hold different optimizer records"):
            fxrec.checkpoint.save(fast2, os.path.join(root, "bad"), optimizer=rw)
        assert not os.path.exists(os.path.join(root, "bad"))
        dist.barrier()
    os._exit(0)


def _world_4(rank, world, init_file, root):
    """Plan B (every table moves): load, 3 steps: the single-process model's 6 steps. Then the
    row-wise Adagrad checkpoint: its per-row states cut by plan B's rows."""
    with gloo_group(rank, world, init_file):
        fast, opt, plan = sharded(model(2), world, rank, PLAN_B)
        fxrec.checkpoint.load(fast, os.path.join(root, "a"), optimizer=opt)
        _train_fused(3, world, rank)(fast, opt, 3)
        ref, ref_opt = single_process(model(0))
        _train_fused(6, 1)(ref, ref_opt, 0)
        assert_holds(fast, states(fast, subs(opt)), ref, states(ref, subs(ref_opt)), plan, rank, "world 2 -> 4")

        ref_tables = [p for n, p in ref.named_parameters() if not n.startswith("top.")]
        ref_rw = RowWiseAdagradTorch(ref_tables, lr=0.2)
        _train_fused(1, 1)(ref, ref_rw, 6)
        rw = RowWiseAdagradTorch([p for n, p in fast.named_parameters() if not n.startswith("top.")], lr=0.2)
        fxrec.checkpoint.load(fast, os.path.join(root, "rw"), optimizer=rw)
        held = states(fast, [rw])
        assert held and all(st["sum"].dim() == 1 for st in held.values()), held
        assert_holds(fast, held, ref, states(ref, [ref_rw]), plan, rank, "per-row states, world 2 -> 4")
        dist.barrier()
    os._exit(0)


def test_sharded_optimizer_state_resumes_at_world_4_under_another_plan_and_in_one_process(tmp_path):
    """Dense Adam and torch.optim Adam / Adagrad on table-wise, row-wise and data-parallel tables
    at world size 2; resumed at world size 4 where every table changes its sharding, and in one
    process: 3 more steps equal 6 uninterrupted single-process steps (parameters and every
    optimizer state). At world size 2 under the same plan the resumed run is bit for bit the
    uninterrupted one, and a one-process checkpoint resumes there too."""
    one, one_opt = single_process(model(0))
    _train_fused(3, 1)(one, one_opt, 0)
    fxrec.checkpoint.save_model(one, tmp_path / "single", optimizer=one_opt)

    spawn(_world_2, 2, str(tmp_path))
    spawn(_world_4, 4, str(tmp_path))

    ref, ref_opt = single_process(model(0))
    _train_fused(6, 1)(ref, ref_opt, 0)
    back, back_opt = single_process(model(3))
    fxrec.checkpoint.load_into_model(back, tmp_path / "a", optimizer=back_opt)  # world 2 -> one process
    _train_fused(3, 1)(back, back_opt, 3)
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], want, **TOL, msg=name)
    got, want = states(back, subs(back_opt)), states(ref, subs(ref_opt))
    assert got.keys() == want.keys()
    for name in got:
        for k in got[name]:
            torch.testing.assert_close(got[name][k], want[name][k], **TOL, msg=f"{k} of {name}")


class _SparseMomentum(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(50, 8, mode="sum", sparse=True)
        self.top = nn.Linear(8, 1)

    def forward(self, ids, offsets):
        return self.top(self.bag(ids, offsets))


def test_a_sparse_momentum_buffer_is_saved_dense_and_resumes_sparse(tmp_path):
    """torch.optim.SGD keeps the momentum of a sparse=True table's gradients as a sparse tensor,
    which DCP cannot write (the save died inside it, leaving a partial directory)."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 50, (12,), generator=g), torch.arange(0, 12, 3)) for _ in range(4)]

    def make():
        torch.manual_seed(0)
        fast = fxrec.transform(_SparseMomentum(), batches[0], optimizer=fxrec.optim.SGD(lr=0.1, momentum=0.9))
        return fast, fast.make_optimizer(torch.optim.SGD, lr=0.1)

    def step(fast, opt, x):
        opt.zero_grad()
        fast(*x).sum().backward()
        opt.step()

    fast, opt = make()
    for x in batches[:2]:
        step(fast, opt, x)
    fxrec.checkpoint.save(fast, str(tmp_path / "ck"), optimizer=opt)
    again, again_opt = make()
    fxrec.checkpoint.load(again, str(tmp_path / "ck"), optimizer=again_opt)
    [state] = again_opt.fallbacks[0].state.values()
    assert state["momentum_buffer"].is_sparse
    [before] = opt.fallbacks[0].state.values()
    torch.testing.assert_close(state["momentum_buffer"].to_dense(), before["momentum_buffer"].to_dense(), rtol=0, atol=0)
    for x in batches[2:]:
        step(fast, opt, x)
        step(again, again_opt, x)
    for (name, a), (_, b) in zip(fast.state_dict().items(), again.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)


def test_a_sparse_momentum_loads_dense_into_a_table_made_dense(tmp_path):
    """A model whose table was made dense (sparse=False) resumes from a checkpoint of its sparse
    form: the momentum loads dense (a sparse one failed at the first step: add(sparse, dense))."""
    x = (torch.randint(0, 50, (12,)), torch.arange(0, 12, 3))

    def make(sparse):
        torch.manual_seed(0)
        model = _SparseMomentum()
        model.bag.sparse = sparse
        fast = fxrec.transform(model, x, optimizer=fxrec.optim.SGD(lr=0.1, momentum=0.9))
        return fast, fast.make_optimizer(torch.optim.SGD, lr=0.1)

    fast, opt = make(True)
    fast(*x).sum().backward()
    opt.step()
    fxrec.checkpoint.save(fast, str(tmp_path / "ck"), optimizer=opt)
    dense, dense_opt = make(False)
    fxrec.checkpoint.load(dense, str(tmp_path / "ck"), optimizer=dense_opt)
    [state] = dense_opt.fallbacks[0].state.values()
    assert not state["momentum_buffer"].is_sparse
    dense(*x).sum().backward()
    dense_opt.step()


# Two table optimizers of other learning rates (two param groups), fused on CPU; bags.1 and single
# train with the dense optimizer.
SCHED_OPT = {"bags.0": fxrec.optim.SGD(lr=0.1), "bags.2": fxrec.optim.Adagrad(lr=0.3)}


def _sched_run(fast, rank, world, steps, lam=lambda e: 0.5 ** e, opt=None, sched=None):
    opt = opt or fast.make_optimizer(torch.optim.SGD, lr=0.01)
    sched = sched or torch.optim.lr_scheduler.LambdaLR(opt, lam)
    for s in steps:
        x = global_batch(_CKPT_G, s) if world == 1 else local_batch(global_batch(_CKPT_G, s), rank, _CKPT_G // world)
        opt.zero_grad()
        fast(*x).sum().backward()
        opt.step()
        sched.step()
    return opt, sched


def _table_lrs(opt):
    return {t: g["lr"] for g in opt.param_groups for t in g.get("tables") or [None]}


def _sched_worker(rank, world, init_file, root, pins, phase):
    with gloo_group(rank, world, init_file):
        example = local_batch(global_batch(_CKPT_G, 0), rank, _CKPT_G // world)
        plan = fxrec.plan(model(0), example, world_size=world, memory_per_rank="1GB", pins=pins, optimizer=SCHED_OPT)
        fast = fxrec.transform(model(0), example, plan=plan, optimizer=SCHED_OPT)
        if phase == "save":
            opt, sched = _sched_run(fast, rank, world, range(2))
            fxrec.checkpoint.save(fast, os.path.join(root, "ck"), optimizer=opt)
            if rank == 0:
                torch.save(sched.state_dict(), os.path.join(root, "sched.pt"))
        else:
            opt = fast.make_optimizer(torch.optim.SGD, lr=0.01)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5 ** e)
            fxrec.checkpoint.load(fast, os.path.join(root, "ck"), optimizer=opt)
            sched.load_state_dict(torch.load(os.path.join(root, "sched.pt")))
            _sched_run(fast, rank, world, range(2, 4), opt=opt, sched=sched)
            torch.save([g["lr"] for g in opt.param_groups], os.path.join(root, f"lrs_{rank}.pt"))
        # the model (its DDP reducer) freed while the process group lives: freed after it, gloo's
        # teardown can deadlock or abort (tests/test_ddp.py)
        del fast, opt, sched
        gc.collect()


def test_a_scheduler_resumes_onto_the_same_groups_on_every_rank_and_under_another_plan(tmp_path):
    """One param group per table optimizer, the same list on every rank whatever tables it holds:
    a LambdaLR (per-group lists: base_lrs) saved on rank 0 resumes on every rank, with the owners
    of the tables swapped, as in one uninterrupted process. (The groups were one per fused group a
    rank held: rank 1 resumed table bags.0 at bags.2's rate.)"""
    single = fxrec.transform(model(0), global_batch(_CKPT_G, 0), optimizer=SCHED_OPT)
    want, _ = _sched_run(single, 0, 1, range(4))
    want = [g["lr"] for g in want.param_groups]
    assert len(want) == 3 and want[1] != want[2], want  # the dense group, then SGD's and Adagrad's
    spawn(_sched_worker, 2, str(tmp_path), {"bags.0": ("table_wise", 1), "bags.2": ("table_wise", 0)}, "save")
    spawn(_sched_worker, 2, str(tmp_path), {"bags.0": ("table_wise", 0), "bags.2": ("table_wise", 1)}, "load")
    for rank in range(2):
        assert torch.load(tmp_path / f"lrs_{rank}.pt") == pytest.approx(want), rank


def test_the_param_groups_are_the_dense_optimizers_then_one_per_table_optimizer():
    """In the order of the tables each first serves; the tables it fuses listed under "tables",
    those it steps by torch.optim (Adam, never fused on CPU) as its group's params."""
    opts = {"bags.0": fxrec.optim.SGD(lr=0.1), "bags.1": fxrec.optim.Adam(lr=0.05),
            "bags.2": fxrec.optim.SGD(lr=0.1), "single": fxrec.optim.Adagrad(lr=0.3)}
    fast = fxrec.transform(model(0), global_batch(_CKPT_G, 0), optimizer=opts)
    opt = fast.make_optimizer(torch.optim.SGD, lr=0.01)
    names = {id(p): n for n, p in fast.named_parameters()}
    groups = [(g["lr"], sorted(g["tables"]), sorted(names[id(p)] for p in g["params"])) for g in opt.param_groups[1:]]
    assert groups == [(0.1, ["bags.0.weight", "bags.2.weight"], ["bags.0.weight", "bags.2.weight"]),
                      (0.05, [], ["bags.1.weight"]),
                      (0.3, ["single.weight"], ["single.weight"])], groups
    assert sorted(names[id(p)] for p in opt.param_groups[0]["params"]) == ["top.bias", "top.weight"]


class _One(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(10, 8, mode="sum")
        self.top = nn.Linear(8, 1)

    def forward(self, ids, offsets):
        return self.top(self.emb(ids, offsets)).sum()


@pytest.mark.parametrize("saved, loaded, what", [
    ("LazyAdam", "PartialRowWiseAdam", "LazyAdamTorch and is stepped by PartialRowWiseAdamTorch"),
    ("LazyAdam", "SGD", "LazyAdamTorch and is stepped by SGD"),
    ("PartialRowWiseAdam", "LazyAdam", "PartialRowWiseAdamTorch and is stepped by LazyAdamTorch"),
    ("Adagrad", "SGD", "fused adagrad and is stepped by fused sgd"),
])
def test_another_optimizers_state_is_refused_naming_both_and_left_alone_without_strict(tmp_path, saved, loaded, what):
    """Adam's moments were taken for SGD's (its momentum restarted, its lr Adam's), a per-row
    state loaded where a per-element one belongs (failing at the next step), a fused Adagrad's lr
    given to a fused SGD."""
    ids, offsets = torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([0, 2, 4])
    kwargs = {"SGD": dict(lr=0.5, momentum=0.9) if saved != "Adagrad" else dict(lr=0.5)}

    def make(kind):
        torch.manual_seed(0)
        fast = fxrec.transform(_One(), (ids, offsets), optimizer=getattr(fxrec.optim, kind)(**kwargs.get(kind, {"lr": 0.05})))
        return fast, fast.make_optimizer(torch.optim.SGD, lr=0.01)

    fast, opt = make(saved)
    for _ in range(2):
        opt.zero_grad()
        fast(ids, offsets).backward()
        opt.step()
    fxrec.checkpoint.save_model(fast, tmp_path / "ck", optimizer=opt)
    again, again_opt = make(loaded)
    with pytest.raises(CheckpointError, match=rf"'emb\.weight' was saved with the state of {what} here"):
        fxrec.checkpoint.load_into_model(again, tmp_path / "ck", optimizer=again_opt)
    lrs = [g["lr"] for g in again_opt.param_groups]
    fxrec.checkpoint.load_into_model(again, tmp_path / "ck", optimizer=again_opt, strict=False)
    assert [g["lr"] for g in again_opt.param_groups] == lrs  # the table's group kept its own
    for _ in range(2):  # and it trains
        again_opt.zero_grad()
        again(ids, offsets).backward()
        again_opt.step()


class _SumAndMean(nn.Module):
    """One SGD for a sum bag (fused) and a mean bag whose weight is also read outside its lookup
    (left as written: stepped by torch.optim with dense gradients)."""

    def __init__(self):
        super().__init__()
        self.a = nn.EmbeddingBag(20, 8, mode="sum")
        self.c = nn.EmbeddingBag(20, 8, mode="mean")
        self.top = nn.Linear(16, 1)

    def forward(self, ids, offsets):
        y = torch.cat([self.a(ids, offsets), self.c(ids, offsets)], 1)
        return self.top(y).sum() + 0.01 * self.c.weight.sum()


def test_one_table_optimizer_is_one_group_however_its_tables_are_lowered():
    """Its tables' gradients are sparse where lowered and dense where not (and under a plan, dense
    for both): keyed by that, one optimizer made two groups here and one under a plan. Only a
    torch class that depends on it (Adam's SparseAdam) splits a group."""
    ids, offsets = torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([0, 2, 4])
    fast = fxrec.transform(_SumAndMean(), (ids, offsets), optimizer=fxrec.optim.SGD(lr=0.1))
    opt = fast.make_optimizer(torch.optim.SGD, lr=0.01)
    names = {id(p): n for n, p in fast.named_parameters()}
    assert [(g["lr"], g["tables"], [names[id(p)] for p in g["params"]]) for g in opt.param_groups[1:]] == [
        (0.1, ["a.weight"], ["c.weight"])]


def test_a_saved_state_loads_into_the_fallbacks_that_step_its_tables():
    """Matched by the tables each steps (they were matched by position, which another ordering of
    the table optimizers changed); a state saved before the tables were recorded loads by their
    order; one whose tables are not this optimizer's is refused before anything is loaded."""
    opts = {"bags.0": fxrec.optim.Adam(lr=0.05), "bags.2": fxrec.optim.Adagrad(lr=0.1, lr_decay=0.01)}
    fast, opt = single_process(model(0), opts)
    x = global_batch(_CKPT_G, 1)
    opt.zero_grad()
    fast(*x).sum().backward()
    opt.step()
    sd = opt.state_dict()
    assert sd["fallback_tables"] == [["bags.0.weight"], ["bags.2.weight"]]
    for saved in (sd, {k: v for k, v in sd.items() if k != "fallback_tables"}):
        again, again_opt = single_process(model(0), opts)
        again_opt.load_state_dict(copy.deepcopy(saved))
        for a, b in zip(again_opt.fallbacks, opt.fallbacks):
            assert type(a) is type(b) and a.param_groups[0]["lr"] == b.param_groups[0]["lr"]
            assert [sorted(s) for s in a.state.values()] == [sorted(s) for s in b.state.values()]
    wrong = dict(sd, fallback_tables=[["bags.2.weight"], ["bags.9.weight"]])
    again, again_opt = single_process(model(0), opts)
    with pytest.raises(ValueError, match=r"stepping the tables \[\['bags.2.weight'\], \['bags.9.weight'\]\]"):
        again_opt.load_state_dict(wrong)


# fxrec.optim.SGD, without state: fused in one process, stepped by torch.optim where data-parallel
SGD_OPT = {"bags.0": fxrec.optim.SGD(lr=0.1), "bags.2": fxrec.optim.SGD(lr=0.1)}


def _sgd_worker(rank, world, init_file, root, phase):
    with gloo_group(rank, world, init_file):
        example = local_batch(global_batch(_CKPT_G, 0), rank, _CKPT_G // world)
        pins = {"bags.0": "data_parallel", "bags.1": ("table_wise", 0), "bags.2": ("table_wise", 1), "single": "row_wise"}
        plan = fxrec.plan(model(0), example, world_size=world, memory_per_rank="1GB", pins=pins, optimizer=SGD_OPT)
        fast = fxrec.transform(model(0), example, plan=plan, optimizer=SGD_OPT)
        opt = fast.make_optimizer(torch.optim.SGD, lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5 ** e)
        if phase == "save":
            _sched_run(fast, rank, world, range(2), opt=opt, sched=sched)
            fxrec.checkpoint.save(fast, os.path.join(root, "saved_sharded"), optimizer=opt)
        else:
            fxrec.checkpoint.load(fast, os.path.join(root, "saved_single"), optimizer=opt)  # strict
            sched.load_state_dict(torch.load(os.path.join(root, "sched.pt")))
            _sched_run(fast, rank, world, range(2, 4), opt=opt, sched=sched)
            fxrec.checkpoint.save(fast, os.path.join(root, "resumed_sharded"))
        del fast, opt, sched
        gc.collect()


def test_a_table_trained_with_sgd_moves_between_data_parallel_and_fused(tmp_path):
    """Plain SGD has no state, so a table stepped by torch.optim where it was data-parallel resumes fused
    in one process, and back (strict loads refused it: 'saved with a torch.optim optimizer and is fused
    here'), as the uninterrupted run."""
    single = fxrec.transform(model(0), global_batch(_CKPT_G, 0), optimizer=SGD_OPT)
    assert {t for _, _, _, ts in single.make_optimizer().fused for t in ts} == {"bags.0.weight", "bags.2.weight"}
    want_opt, _ = _sched_run(single, 0, 1, range(4))
    spawn(_sgd_worker, 2, str(tmp_path), "save")
    resumed = fxrec.transform(model(0), global_batch(_CKPT_G, 0), optimizer=SGD_OPT)
    opt = resumed.make_optimizer(torch.optim.SGD, lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5 ** e)
    fxrec.checkpoint.load(resumed, str(tmp_path / "saved_sharded"), optimizer=opt)  # strict
    sched.last_epoch, sched._step_count = 2, 3  # (the schedule's place: two steps were taken)
    torch.save(sched.state_dict(), tmp_path / "sched.pt")
    fxrec.checkpoint.save(resumed, str(tmp_path / "saved_single"), optimizer=opt)
    _sched_run(resumed, 0, 1, range(2, 4), opt=opt, sched=sched)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([g["lr"] for g in want_opt.param_groups])
    for k, v in single.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[k], v, **TOL, msg=k)
    spawn(_sgd_worker, 2, str(tmp_path), "load")  # and back: fused in one process, data-parallel at world 2
    back = fxrec.transform(model(0), global_batch(_CKPT_G, 0))
    fxrec.checkpoint.load_into_model(back, str(tmp_path / "resumed_sharded"))
    for k, v in single.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v, **TOL, msg=k)


class _OneBag(nn.Module):
    def __init__(self, rows):
        super().__init__()
        self.a = nn.EmbeddingBag(rows, 8, mode="sum")
        self.top = nn.Linear(8, 1)

    def forward(self, i, o):
        return self.top(self.a(i, o)).squeeze(1)


def test_a_resized_table_with_fused_states_is_named_without_blaming_another_optimizer(tmp_path):
    """Its fused Adagrad states, resized with it, were called another optimizer's."""
    x = (torch.randint(0, 40, (8,)), torch.arange(0, 8, 2))
    fast = fxrec.transform(_OneBag(40), x, optimizer=fxrec.optim.Adagrad(lr=0.1))
    fast(*x).sum().backward()
    fxrec.checkpoint.save_model(fast, tmp_path / "ck")
    bigger = fxrec.transform(_OneBag(41), x, optimizer=fxrec.optim.Adagrad(lr=0.1))
    with pytest.raises(CheckpointError, match=r"'a\.weight' is 40 x 8 in the checkpoint and 41 x 8 in the model") as e:
        fxrec.checkpoint.load_into_model(bigger, tmp_path / "ck")
    assert "another optimizer" not in str(e.value)


def test_a_table_stepped_by_torch_sgd_with_weight_decay_is_not_taken_as_plain_sgd_by_a_fused_one(tmp_path):
    """Only plain SGD crosses between torch.optim and fused: weight decay (or momentum, nesterov,
    maximize), which fbgemm's exact SGD has not, was taken into the fused group (review of 2c22493)."""
    x = (torch.randint(0, 40, (8,)), torch.arange(0, 8, 2))
    src = fxrec.transform(_OneBag(40), x)
    opt = src.make_optimizer(torch.optim.SGD, lr=0.05, weight_decay=0.1)  # the table too, with weight decay
    src(*x).sum().backward()
    opt.step()
    fxrec.checkpoint.save(src, str(tmp_path / "ck"), optimizer=opt)
    dst = fxrec.transform(_OneBag(40), x, optimizer={"a": fxrec.optim.SGD(lr=0.5)})
    with pytest.raises(CheckpointError, match=r"'a\.weight' was saved with a torch\.optim optimizer and is fused here"):
        fxrec.checkpoint.load(dst, str(tmp_path / "ck"), optimizer=dst.make_optimizer(torch.optim.SGD, lr=0.05,
                                                                                       weight_decay=0.1))


class _WithFrozen(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.u = nn.EmbeddingBag(20, 4, mode="sum")
        self.f = nn.EmbeddingBag(20, 4, mode="sum")  # pretrained, frozen: nothing steps it
        self.v = nn.EmbeddingBag(20, 4, mode="sum")
        self.f.weight.requires_grad_(False)

    def forward(self, ids, offsets):
        return self.u(ids, offsets) + self.f(ids, offsets) + self.v(ids, offsets)


_FROZEN_X = (torch.arange(16) % 20, torch.arange(0, 16, 2))


def _frozen_worker(rank, world, init_file, root, phase):
    with gloo_group(rank, world, init_file):
        x = (_FROZEN_X[0][rank * 8:(rank + 1) * 8], _FROZEN_X[1][:4])
        pins = {"f": "data_parallel", "u": ("table_wise", 0), "v": ("table_wise", 1)}
        plan = fxrec.plan(_WithFrozen(), x, world_size=world, memory_per_rank="1GB", pins=pins, optimizer="adagrad")
        fast = fxrec.transform(_WithFrozen(), x, plan=plan, optimizer=fxrec.optim.Adagrad(lr=0.1))
        opt = fast.make_optimizer(torch.optim.SGD, lr=0.1)
        if phase == "save":
            (fast(*x) ** 2).sum().backward()
            opt.step()
            fxrec.checkpoint.save(fast, os.path.join(root, "sharded"), optimizer=opt)
        else:
            fxrec.checkpoint.load(fast, os.path.join(root, "single"), optimizer=opt)  # strict
            fxrec.checkpoint.save(fast, os.path.join(root, "back"), optimizer=opt)


def test_a_frozen_table_moves_between_data_parallel_and_a_fused_group_with_the_optimizer_state(tmp_path):
    """A frozen table has no optimizer state: data-parallel at world 2 (stepped by nothing) and in a
    fused group in one process, a strict load refused it ('saved with a torch.optim optimizer and
    is fused here'). The trained tables' fused states still move with it; thawed, its Adagrad state
    moves too."""
    spawn(_frozen_worker, 2, str(tmp_path), "save")
    single = fxrec.transform(_WithFrozen(), _FROZEN_X, optimizer=fxrec.optim.Adagrad(lr=0.1))
    opt = single.make_optimizer(torch.optim.SGD, lr=0.1)
    assert {t for _, _, _, ts in opt.fused for t in ts} >= {"u.weight", "f.weight", "v.weight"}
    fxrec.checkpoint.load(single, str(tmp_path / "sharded"), optimizer=opt)  # strict
    want = _WithFrozen()
    want_opt = torch.optim.Adagrad([want.u.weight, want.v.weight], lr=0.1, eps=1e-10)
    for step in range(2):  # the step the two ranks took, and one more: it reads the loaded Adagrad sums
        (want(*_FROZEN_X) ** 2).sum().backward()
        want_opt.step()
        want_opt.zero_grad()
    (single(*_FROZEN_X) ** 2).sum().backward()
    opt.step()
    for name in ("u", "v", "f"):
        torch.testing.assert_close(single.get_parameter(f"{name}.weight"), getattr(want, name).weight, **TOL)
    assert torch.equal(single.get_parameter("f.weight"), _WithFrozen().f.weight)
    fxrec.checkpoint.save(single, str(tmp_path / "single"), optimizer=opt)
    spawn(_frozen_worker, 2, str(tmp_path), "load")  # and back, strict
    assert os.path.isdir(tmp_path / "back")
    # trained here: torch's Adagrad kept a state for it when it was data-parallel (never stepped: zeros),
    # which the fused Adagrad takes (tests/test_checkpoint_optimizer.py::test_an_adagrad_state_moves_...)
    thawed = _WithFrozen()
    thawed.f.weight.requires_grad_(True)
    fast = fxrec.transform(thawed, _FROZEN_X, optimizer=fxrec.optim.Adagrad(lr=0.1))
    fxrec.checkpoint.load(fast, str(tmp_path / "sharded"), optimizer=fast.make_optimizer(torch.optim.SGD, lr=0.1))
    from fxrec.checkpoint_fused import states as fused_states

    assert torch.equal(fused_states(fast)["f.weight.fxrec_fused.sum"], torch.zeros(20, 4))


def test_a_state_saved_for_a_table_frozen_when_loaded_is_loaded_for_when_it_trains_again(tmp_path):
    """Frozen when loaded (embeddings held still for a warm-up after a resume), a table's saved
    state that fits is loaded: it was left out, and the table trained on from a fresh state once
    unfrozen (0.086 off)."""
    def fresh(frozen):
        model = _WithFrozen()
        model.f.weight.requires_grad_(not frozen)
        fast = fxrec.transform(model, _FROZEN_X, optimizer=fxrec.optim.Adagrad(lr=0.1))
        return fast, fast.make_optimizer(torch.optim.SGD, lr=0.1)

    fast, opt = fresh(False)
    for _ in range(2):
        (fast(*_FROZEN_X) ** 2).sum().backward()
        opt.step()
    fxrec.checkpoint.save(fast, str(tmp_path / "ck"), optimizer=opt)
    results = []
    for frozen_at_load in (False, True):
        fast, opt = fresh(frozen_at_load)
        fxrec.checkpoint.load(fast, str(tmp_path / "ck"), optimizer=opt)  # strict
        fast.get_parameter("f.weight").requires_grad_(True)
        (fast(*_FROZEN_X) ** 2).sum().backward()
        opt.step()
        results.append(fast.get_parameter("f.weight").detach().clone())
    assert torch.equal(results[0], results[1])


class _Bag(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.EmbeddingBag(40, 8, mode="sum")

    def forward(self, ids, offsets):
        return self.emb(ids, offsets)


_BAG_X = [(torch.randint(0, 40, (12,), generator=torch.Generator().manual_seed(s)), torch.arange(0, 12, 3))
          for s in range(4)]
_FUSED_KINDS = {"adagrad": lambda: fxrec.optim.Adagrad(lr=0.1), "rowwise_adagrad": lambda: fxrec.optim.RowWiseAdagrad(lr=0.1),
                "rowwise_adagrad_decay_max_norm": lambda: fxrec.optim.RowWiseAdagrad(
                    lr=0.1, weight_decay=0.05, weight_decay_mode="decoupled", max_norm=1.5)}


def _stepped_by(side, kind):
    """The table fused into backward, or stepped by the torch optimizer fxrec gives it where nothing
    fuses it (a data-parallel table under a plan: fxrec.optim's torch_optimizer)."""
    if side == "fused":
        fast = fxrec.transform(_Bag(), _BAG_X[0], optimizer=_FUSED_KINDS[kind]())
        opt = fast.make_optimizer(torch.optim.SGD, lr=0.01)
        assert opt.fused and not opt.fallbacks
        return fast, opt
    fast = fxrec.transform(_Bag(), _BAG_X[0])
    return fast, _FUSED_KINDS[kind]().torch_optimizer([fast.get_parameter("emb.weight")])


def _bag_steps(fast, opt, steps):
    for s in steps:
        opt.zero_grad()
        cot = torch.randn(4, 8, generator=torch.Generator().manual_seed(50 + s))
        (fast(*_BAG_X[s]) * cot).sum().backward()
        opt.step()


@pytest.mark.parametrize("kind", ["adagrad", "rowwise_adagrad", "rowwise_adagrad_decay_max_norm"])
@pytest.mark.parametrize("saved, loaded", [("torch", "fused"), ("fused", "torch")])
def test_an_adagrad_state_moves_between_torch_optim_and_fused(tmp_path, kind, saved, loaded):
    """A table stepped by torch.optim where it was saved (data-parallel under a plan) resumes fused
    (in one process, under another plan), and back: the two keep one state (Adagrad's sum per
    element, row-wise Adagrad's per row), read from the other's entry. Strict loads refused it
    ('its state is not converted'); strict=False left the state behind: the steps after differ."""
    want, want_opt = _stepped_by(loaded, kind)
    _bag_steps(want, want_opt, range(4))  # uninterrupted
    first, first_opt = _stepped_by(saved, kind)
    _bag_steps(first, first_opt, range(2))
    fxrec.checkpoint.save_model(first, tmp_path / "ck", optimizer=first_opt)
    then, then_opt = _stepped_by(loaded, kind)
    fxrec.checkpoint.load_into_model(then, tmp_path / "ck", optimizer=then_opt)
    _bag_steps(then, then_opt, range(2, 4))
    torch.testing.assert_close(then.get_parameter("emb.weight"), want.get_parameter("emb.weight"), **TOL)
    if loaded == "torch" and kind == "adagrad":  # torch's Adagrad counts its steps from 0 here (only lr_decay reads it)
        assert [float(st["step"]) for st in then_opt.state.values()] == [2.0]


def test_an_adagrad_state_is_not_taken_by_a_torch_adagrad_with_lr_decay(tmp_path):
    """(Its step count, which lr_decay reads, was never kept by the fused one.)"""
    first, first_opt = _stepped_by("fused", "adagrad")
    _bag_steps(first, first_opt, range(2))
    fxrec.checkpoint.save_model(first, tmp_path / "ck", optimizer=first_opt)
    then = fxrec.transform(_Bag(), _BAG_X[0])
    opt = fxrec.optim.Adagrad(lr=0.1, lr_decay=0.01).torch_optimizer([then.get_parameter("emb.weight")])
    with pytest.raises(CheckpointError, match=r"'emb\.weight' was saved with a fused optimizer and is stepped by "
                                              r"torch\.optim here with Adagrad: the two do other updates \(lr_decay "
                                              r"0\.01 against 0\.0\): its state is not converted"):
        fxrec.checkpoint.load_into_model(then, tmp_path / "ck", optimizer=opt)


@pytest.mark.parametrize("saved, loaded, differ", [
    (("torch", lambda p: fxrec.optim.RowWiseAdagradTorch(p, lr=0.1, eps=1e-2)), ("fused", "rowwise_adagrad"),
     r"eps 0\.01 against 1e-08"),
    (("torch", lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.5)), ("fused", "adagrad"),
     r"initial_accumulator_value 0\.5 against 0\.0"),
    (("fused", "rowwise_adagrad_decay_max_norm"), ("torch", lambda p: fxrec.optim.RowWiseAdagradTorch(p, lr=0.1)),
     r"weight_decay 0\.0 against 0\.05, max_norm 0\.0 against 1\.5"),
    (("fused", "adagrad"), ("torch", lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-3)), r"eps 0\.001 against 1e-10"),
], ids=["rowwise_eps", "adagrad_initial_accumulator", "rowwise_decay", "adagrad_eps"])
def test_an_adagrad_state_is_not_converted_between_forms_that_do_other_updates(tmp_path, saved, loaded, differ):
    """(Review: the torch form's saved settings were dropped for the fused one's, and the other way
    round, without a word.) The fused settings are kept in the checkpoint's records."""
    def side(how):
        if how[0] == "fused":
            fast = fxrec.transform(_Bag(), _BAG_X[0], optimizer=_FUSED_KINDS[how[1]]())
            return fast, fast.make_optimizer(torch.optim.SGD, lr=0.01)
        fast = fxrec.transform(_Bag(), _BAG_X[0])
        return fast, how[1]([fast.get_parameter("emb.weight")])

    first, first_opt = side(saved)
    _bag_steps(first, first_opt, range(2))
    fxrec.checkpoint.save_model(first, tmp_path / "ck", optimizer=first_opt)
    then, then_opt = side(loaded)
    with pytest.raises(CheckpointError, match=r"'emb\.weight' was saved with a (fused|torch\.optim) optimizer and is "
                                              r".* here with .*: the two do other updates \(" + differ
                                              + r".*\): its state is not converted"):
        fxrec.checkpoint.load_into_model(then, tmp_path / "ck", optimizer=then_opt)
