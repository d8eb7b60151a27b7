"""Sharded models on torch.distributed (gloo, CPU), several processes: each rank feeds its own
local batch and must get the single-process model's rows of the global batch, forward and after
ten SGD steps (tables gathered back and compared)."""

import contextlib
import copy
import json
import os
import tempfile
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fxrec

ROWS = (40, 64, 30, 50)
DIM = 8
LOCAL_B = 4


class Model(nn.Module):
    def __init__(self, mode="sum"):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(r, DIM, mode=mode) for r in ROWS[:3]])
        self.single = nn.Embedding(ROWS[3], DIM)
        self.top = nn.Linear(4 * DIM + 3, 1)

    def forward(self, dense, ids, offsets, single_ids):
        parts = [b(i, o) for b, i, o in zip(self.bags, ids, offsets)] + [self.single(single_ids), dense]
        return self.top(torch.cat(parts, 1)).squeeze(1)


def global_batch(batch, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = [torch.randint(0, 4, (batch,), generator=g) for _ in ROWS[:3]]
    ids = [torch.randint(0, r, (int(ln.sum()),), generator=g) for r, ln in zip(ROWS[:3], lengths)]
    offsets = [torch.cat([torch.zeros(1, dtype=torch.long), ln.cumsum(0)[:-1]]) for ln in lengths]
    return torch.rand(batch, 3, generator=g), ids, offsets, torch.randint(0, ROWS[3], (batch,), generator=g)


def local_batch(x, rank, batch):
    dense, ids, offsets, single = x
    lo, hi = rank * batch, (rank + 1) * batch
    l_ids, l_offs = [], []
    for i, o in zip(ids, offsets):
        ends = torch.cat([o[1:], torch.tensor([i.numel()])])
        l_ids.append(i[o[lo]:ends[hi - 1]] if hi > lo else i[:0])
        l_offs.append(o[lo:hi] - o[lo])
    return dense[lo:hi], l_ids, l_offs, single[lo:hi]


class _CountLookups(TorchDispatchMode):
    """Counts PyTorch's embedding ops run under it."""

    calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "embedding" in func.overloadpacket.__name__:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _worker(rank, world, init_file, pins, mode, steps, hosts=1, recompile=False):
    _train_and_compare(rank, world, init_file, pins, mode, steps, hosts, recompile)
    # torch 2.13 + gloo: a process sometimes aborts at interpreter exit ("terminate called without
    # an active exception", a gloo thread freeing tensors during shutdown); the work is done and
    # checked by now, so leave without the interpreter's teardown
    os._exit(0)


def _train_and_compare(rank, world, init_file, pins, mode, steps, hosts, recompile=False):
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = Model(mode)
        ref = Model(mode)
        ref.load_state_dict(model.state_dict())
        example = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)
        plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins=pins, hosts=hosts)
        fast = fxrec.transform(model, example, plan=plan)
        if recompile:  # as fx tooling does after editing the graph: the model has DDP's class by now
            fast.graph.eliminate_dead_code()
            fast.recompile()
        # the report of a sharded model prints, serialises and says how each group is sharded
        text, data = str(fast.report), json.loads(fast.report.to_json())
        sharded = {plan.tables[t].sharding for t in plan.tables}
        assert all(g["kernel_train"].startswith("sharded: ") for g in data["groups"]), data["groups"]
        assert all(k in text for k in sharded), text
        assert len(fast.report.lowered) + len(fast.report.left_alone) == len(fast.report.lookups) == 4
        names = [type(fast.get_submodule(n.target)).__name__ for n in fast.graph.nodes if n.op == "call_module"]
        # at most one input dist, lookup and output dist per group, whatever its tables' sharding types
        n_dists = names.count("PooledInputDist") + names.count("SequenceInputDist")
        assert names.count("PooledLookup") + names.count("SequenceLookup") == n_dists, names
        assert names.count("PooledOutputDist") + names.count("SequenceOutputDist") == n_dists, names
        assert 1 <= n_dists <= len(data["groups"]) or sharded == {"data_parallel"}, (names, data["groups"])
        kinds = {n.target: fxrec.viz.node_kind(fast, n) for n in fast.graph.nodes if n.op == "call_module"}
        assert all(k == "collective" for t, k in kinds.items() if t.endswith(("input_dist", "output_dist"))), kinds
        # each rank's local lookups are one call of its group module, on the kernel the rule gives
        from fxrec.runtime import kernels
        from fxrec.runtime.group import EmbeddingGroup

        lookups = [fast.get_submodule(t) for t in kinds if t.endswith("_lookup")]
        groups = [m.group for m in lookups if m.group is not None]
        assert all(isinstance(g, EmbeddingGroup) for g in groups), lookups
        want_kernel = "native" if kernels.get("native").available("cpu") is None else "reference"
        assert {g.kernel_train for g in groups} <= {want_kernel}, [g.kernel_train for g in groups]
        if want_kernel == "native":  # no PyTorch lookup runs but the data-parallel tables' own
            plain = sum(1 for n in fast.graph.nodes if n.op == "call_function" and "embedding" in str(n.target))
            with _CountLookups() as seen:
                fast(*example)
            assert seen.calls == plain, (seen.calls, plain)
        opt = torch.optim.SGD(fast.parameters(), lr=0.05)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        for step in range(steps):
            x = global_batch(LOCAL_B * world, step + 1)
            cot = torch.randn(LOCAL_B * world, generator=torch.Generator().manual_seed(100 + step))
            want = ref(*x)
            got = fast(*local_batch(x, rank, LOCAL_B))
            torch.testing.assert_close(got, want[rank * LOCAL_B:(rank + 1) * LOCAL_B], msg=f"step {step} forward")
            ref_opt.zero_grad()
            (want * cot).sum().backward()
            ref_opt.step()
            opt.zero_grad()
            (got * cot[rank * LOCAL_B:(rank + 1) * LOCAL_B]).sum().backward()
            opt.step()
        params = dict(fast.named_parameters())
        # no optimizer given: the plan counts each held table piece's weights and dense gradient
        held = sum((p.numel() + p.grad.numel()) * 4 for t in plan.tables for p in [params.get(f"{t}.weight")]
                   if p is not None)
        assert held == plan.rank_bytes()[rank], (held, plan.rank_bytes()[rank])
        for name, want in ref.state_dict().items():
            table = name.rsplit(".", 1)[0]
            tp = plan.tables.get(table)
            if tp is None or tp.sharding == "data_parallel":
                torch.testing.assert_close(params[name].detach(), want, msg=name)
            elif tp.sharding == "table_wise":
                assert (name in params) == (tp.shards[0].rank == rank), f"{name} on rank {rank}"
                if name in params:
                    torch.testing.assert_close(params[name].detach(), want, msg=name)
            elif tp.sharding == "column_wise":
                mine = [sh for sh in tp.shards if sh.rank == rank]
                assert (name in params) == bool(mine), f"{name} on rank {rank}"
                for sh in mine:
                    torch.testing.assert_close(params[name].detach(), want[:, sh.col_offset:sh.col_offset + sh.num_cols], msg=name)
            else:  # row-wise, table-row-wise: this rank's block of rows (none on another host: no parameter)
                mine = [sh for sh in tp.shards if sh.rank == rank]
                assert (name in params) == bool(mine), f"{name} on rank {rank}"
                for sh in mine:
                    torch.testing.assert_close(params[name].detach(), want[sh.row_offset:sh.row_offset + sh.num_rows],
                                               msg=name)
        dist.barrier()  # no rank tears gloo down while another still talks to it


@contextlib.contextmanager
def gloo_group(rank: int, world: int, init_file: str, seconds: int = 120):
    """A test worker's process group: gloo, meeting through ``init_file``, torn down however the
    worker's body ends."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=seconds))
    try:
        yield
    finally:
        dist.destroy_process_group()


def spawn(fn, world, *args):
    """Run ``fn(rank, world, init_file, *args)`` in ``world`` processes meeting through a fresh file."""
    fd, init_file = tempfile.mkstemp(prefix="fxrec_dist_")
    os.close(fd)
    os.remove(init_file)
    try:
        mp.spawn(fn, args=(world, init_file, *args), nprocs=world, join=True)
    finally:
        if os.path.exists(init_file):  # the workers leave without the FileStore's clean-up
            os.remove(init_file)


def run_world(world, pins, mode="sum", steps=10, hosts=1, recompile=False):
    spawn(_worker, world, pins, mode, steps, hosts, recompile)


@pytest.mark.parametrize("sharding", ["table_wise", "column_wise", "row_wise", "data_parallel"])
def test_each_sharding_type_matches_single_process_at_world_2(sharding):
    pin = {"table_wise": lambda i: ("table_wise", i % 2),
           "column_wise": lambda i: {"sharding": "column_wise", "ranks": [i % 2, 1 - i % 2]}}.get(sharding, lambda i: sharding)
    pins = {f"bags.{i}": pin(i) for i in range(3)}
    pins["single"] = pin(1)
    run_world(2, pins)


def test_mixed_plan_with_mean_pooling_at_world_2():
    run_world(2, {"bags.0": ("table_wise", 1), "bags.1": "row_wise", "bags.2": {"sharding": "column_wise", "ranks": [1, 0]},
                  "single": "data_parallel"}, mode="mean")


def test_a_sharded_model_recompiled_after_transform_still_trains_as_one_process():
    """fx's recompile on the class torch's replicate gives the model recursed forever."""
    run_world(2, {"bags.0": ("table_wise", 1), "bags.1": "row_wise", "bags.2": "data_parallel",
                  "single": ("table_wise", 0)}, steps=3, recompile=True)


def test_mixed_plan_on_two_hosts_at_world_4():
    run_world(4, {"bags.0": ("table_wise", 3), "bags.1": "row_wise", "bags.2": "table_row_wise",
                  "single": {"sharding": "column_wise", "ranks": [2, 1]}}, steps=4, hosts=2)


def test_plan_needs_an_initialised_process_group():
    model = Model()
    example = local_batch(global_batch(8, 0), 0, 8)
    plan = fxrec.plan(model, example, world_size=2, memory_per_rank="1GB")
    with pytest.raises(RuntimeError, match="init_process_group"):
        fxrec.transform(model, example, plan=plan)


def _late_worker(rank, world, init_file, result_file, pins, backward):
    """Rank 1 never reaches the step (or, ``backward``, its backward: as one whose input guard
    refused its input would not), but stays alive (so rank 0 sees a timeout, not a closed
    connection) until rank 0 has written what it caught."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=4))
    torch.manual_seed(0)
    model = Model()
    example = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)
    plan = fxrec.plan(model, global_batch(LOCAL_B * world, 0), world_size=world, memory_per_rank="1GB",
                      pins=pins, batch_size=LOCAL_B)  # (the same plan on every rank)
    fast = fxrec.transform(model, example, plan=plan)
    if rank == 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(result_file) and time.monotonic() < deadline:
            time.sleep(0.1)
    else:
        text = "no error"
        try:
            out = fast(*example)
            if backward:
                out.sum().backward()
        except Exception as e:  # noqa: BLE001 - (DDP raises its hook's error as its own RuntimeError)
            text = f"{type(e).__name__}: {e}"
        with open(result_file + ".part", "w") as fh:
            fh.write(text)
        os.replace(result_file + ".part", result_file)
    # A process group with a timed-out collective cannot be torn down cleanly (gloo may abort in
    # its destructor): leave without running destructors.
    os._exit(0)


def test_a_rank_that_does_not_arrive_fails_the_others_with_a_timeout_error(tmp_path):
    result = tmp_path / "error.txt"
    spawn(_late_worker, 2, str(result), {"bags.0": "row_wise"}, False)
    text = result.read_text()
    assert text.startswith("CollectiveError: "), text
    assert "rank 0" in text and "input_dist" in text and "did not reach" in text, text


def test_a_rank_waiting_in_ddps_gradient_sum_fails_with_fxrecs_error(tmp_path):
    """With every table data-parallel there is no input dist to stop the other ranks at: a rank
    that stops before backward leaves them waiting in DDP's sum of the dense gradients until the
    timeout; the error they get says so in fxrec's words (it was gloo's bare timeout)."""
    result = tmp_path / "error.txt"
    spawn(_late_worker, 2, str(result), {name: "data_parallel" for name in ("bags.0", "bags.1", "bags.2", "single")},
          True)
    text = result.read_text()
    assert "CollectiveError: fxrec: all_reduce in the dense parameters' gradients (DDP) failed on rank 0" in text, text
    assert "another rank did not reach the same step" in text, text


def _uneven_worker(rank, world, init_file, result_file):
    with gloo_group(rank, world, init_file, 60):
        torch.manual_seed(0)
        model = Model()
        example = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)
        plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins={"bags.0": ("table_wise", 0)})
        fast = fxrec.transform(model, example, plan=plan)
        b = LOCAL_B + rank  # rank 1 feeds one sample more
        try:
            fast(*local_batch(global_batch(b * world, 1), rank, b))
        except ValueError as e:
            with open(f"{result_file}.{rank}", "w") as fh:
                fh.write(str(e))
        dist.barrier()
    os._exit(0)  # (torch 2.13 + gloo: a process sometimes aborts in its destructors at exit)


def test_batch_sizes_that_differ_between_ranks_are_rejected_on_every_rank(tmp_path):
    result = tmp_path / "error"
    spawn(_uneven_worker, 2, str(result))
    for rank in (0, 1):
        text = (tmp_path / f"error.{rank}").read_text()
        assert "different sizes [4, 5]" in text and "same batch size on every rank" in text, text


def _held_part(whole: torch.Tensor, tp, rank: int) -> torch.Tensor:
    """The part of a table (``tp``: its plan, None for a dense parameter) this rank holds."""
    if tp is None or tp.sharding in ("table_wise", "data_parallel"):
        return whole
    sh = next(s for s in tp.shards if s.rank == rank)
    if tp.sharding == "column_wise":
        return whole[:, sh.col_offset:sh.col_offset + sh.num_cols]
    return whole[sh.row_offset:sh.row_offset + sh.num_rows]  # row-wise, table-row-wise


_FUSED = {"sgd": lambda: fxrec.optim.SGD(lr=0.1), "adagrad": lambda: fxrec.optim.Adagrad(lr=0.1),
          "rowwise_adagrad": lambda: fxrec.optim.RowWiseAdagrad(lr=0.1),
          # (the rows start at norms around 2.8: the cap moves most rows a step touches)
          "rowwise_adagrad_max_norm": lambda: fxrec.optim.RowWiseAdagrad(lr=0.1, max_norm=1.5)}


def _fused_worker(rank, world, init_file, pins, opt_name, steps, backend="auto"):
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = Model()
        single = fxrec.transform(copy.deepcopy(model), global_batch(LOCAL_B * world, 0), optimizer=_FUSED[opt_name]())
        example = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)
        plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins=pins, optimizer=_FUSED[opt_name]())
        fast = fxrec.transform(model, example, plan=plan, optimizer=_FUSED[opt_name](), backend=backend)
        opt, ref_opt = fast.make_optimizer(lr=0.05), single.make_optimizer(lr=0.05)
        if backend == "fbgemm":  # the GPU's lowering: every local group on fbgemm's TBE, fused by it
            groups = [m.group for _, m in fast.named_modules() if getattr(m, "group", None) is not None]
            assert groups and all(g.kernel_train == "fbgemm" for g in groups), [g.kernel_train for g in groups]
        # every sharded table's rows are updated inside backward by its rank's group kernel
        fused_tables = {f for _, fqns in fast.meta["fxrec_fused_groups"] for f in fqns}
        sharded = {f"{t}.weight" for t, tp in plan.tables.items() if tp.sharding != "data_parallel"}
        held = {n for n, _ in fast.named_parameters()}
        assert fused_tables == sharded & held, (fused_tables, sharded, held)
        # each rank's report says where the optimizer runs as explain(plan=) does (it said nothing: the
        # decision a data-parallel lookup kept, without the optimizer, came first in the graph), and
        # that the data-parallel tables are torch.optim's
        said = [(g.tables, g.fused, g.optimizer) for g in fast.report.groups if g.kernel_train.startswith("sharded")]
        explained = fxrec.explain(model, example, plan=plan, optimizer=_FUSED[opt_name](), backend=backend)
        assert said == [(g.tables, g.fused, g.optimizer) for g in explained.groups
                        if g.kernel_train.startswith("sharded")], said
        assert all(f and o.endswith("; data-parallel tables ['single']: torch.optim in opt.step()") for t, f, o in said
                   if "single" in t), said
        for step in range(steps):
            x = global_batch(LOCAL_B * world, step + 1)
            cot = torch.randn(LOCAL_B * world, generator=torch.Generator().manual_seed(100 + step))
            want = single(*x)
            got = fast(*local_batch(x, rank, LOCAL_B))
            torch.testing.assert_close(got, want[rank * LOCAL_B:(rank + 1) * LOCAL_B], msg=f"step {step} forward")
            for o, loss in ((ref_opt, (want * cot).sum()), (opt, (got * cot[rank * LOCAL_B:(rank + 1) * LOCAL_B]).sum())):
                o.zero_grad()
                loss.backward()
                o.step()
        params = dict(fast.named_parameters())
        held = held_bytes(fast, plan, opt)
        assert held == plan.rank_bytes()[rank], (held, plan.rank_bytes()[rank])
        for name, want in single.state_dict().items():
            tp = plan.tables.get(name.rsplit(".", 1)[0])
            if name in params:
                torch.testing.assert_close(params[name].detach(), _held_part(want, tp, rank), rtol=1e-5, atol=1e-6,
                                           msg=name)
        dist.barrier()
    os._exit(0)


def _name_of(root: nn.Module, mod: nn.Module) -> str:
    return next(n for n, m in root.named_modules() if m is mod)


def held_bytes(fast, plan, opt) -> int:
    """What the runtime holds on this rank, in the planner's terms (after a training step): every
    table piece's weights (as stored), its optimizer state (fused: in the group module;
    data-parallel: torch.optim's), and a data-parallel table's dense gradient (a fused shard makes
    none)."""
    params = dict(fast.named_parameters())
    held = 0
    for _, mod in fast.named_modules():
        g = getattr(mod, "group", None)
        if g is not None and g.fused is not None:
            ws = [params[n] for n in dict(fast.meta["fxrec_fused_groups"]).get(_name_of(fast, mod) + ".group", [])]
            held += sum(s.numel() * s.element_size() for st in g.optimizer_states(ws) for s in st.values())
    for t, tp in plan.tables.items():
        p = params.get(f"{t}.weight")
        if p is None:
            continue
        held += p.numel() * p.element_size()
        if tp.sharding == "data_parallel":
            held += p.grad.numel() * p.grad.element_size()
            held += sum(s["sum"].numel() * s["sum"].element_size() for o in opt.fallbacks for q, s in o.state.items()
                        if q is p)
    return held


class _PretrainedAndNew(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.f = nn.EmbeddingBag.from_pretrained(torch.randn(ROWS[0], DIM), freeze=True, mode="sum")
        self.u = nn.EmbeddingBag(ROWS[0], DIM, mode="sum")

    def forward(self, ids, offsets):
        return torch.cat([self.f(ids, offsets), self.u(ids, offsets)], 1)


def _frozen_worker(rank, world, init_file, sharding, result_file):
    with gloo_group(rank, world, init_file):
        batch = global_batch(LOCAL_B * world, 0)
        x = (batch[1][0], batch[2][0])
        local = local_batch(batch, rank, LOCAL_B)
        example = (local[1][0], local[2][0])
        pins = {"f": ("table_wise", 0), "u": ("table_wise", 0)} if sharding == "table_wise" else \
            {"f": sharding, "u": sharding}
        plan = fxrec.plan(_PretrainedAndNew(), example, world_size=world, memory_per_rank="1GB", pins=pins,
                          optimizer="rowwise_adagrad")
        opt = fxrec.optim.RowWiseAdagrad(lr=0.1)
        fast = fxrec.transform(_PretrainedAndNew(), example, plan=plan, optimizer=opt)
        single = fxrec.transform(_PretrainedAndNew(), x, optimizer=fxrec.optim.RowWiseAdagrad(lr=0.1))
        kernels = [m.group.kernel_train for m in fast.modules() if getattr(m, "group", None) is not None]
        params = dict(fast.named_parameters())
        frozen = params["f.weight"].detach().clone() if "f.weight" in params else None
        for step in range(3):
            batch = global_batch(LOCAL_B * world, step + 1)
            want = single(batch[1][0], batch[2][0])
            local = local_batch(batch, rank, LOCAL_B)
            got = fast(local[1][0], local[2][0])
            torch.testing.assert_close(got, want[rank * LOCAL_B:(rank + 1) * LOCAL_B], msg=f"step {step}")
            (want * want).sum().backward()
            (got * got).sum().backward()
        if frozen is not None:
            assert torch.equal(params["f.weight"], frozen)
            lo = plan.tables["u"].shards[rank].row_offset if sharding == "row_wise" else 0
            u = params["u.weight"].detach()
            torch.testing.assert_close(u, single.get_parameter("u.weight").detach()[lo:lo + u.shape[0]], rtol=1e-5,
                                       atol=1e-6)
        refused = ""
        try:
            fxrec.transform(_PretrainedAndNew(), example, plan=plan, optimizer=fxrec.optim.RowWiseAdagrad(lr=0.1),
                            backend="fbgemm")
        except ValueError as e:  # (fxrec's InputError)
            refused = str(e)
        half = ""  # (stored fp16, only fbgemm's fused kernel holds the tables: refused, saying why)
        try:
            fxrec.transform(_PretrainedAndNew(), example, optimizer=fxrec.optim.RowWiseAdagrad(lr=0.1),
                            weights_precision="fp16",
                            plan=fxrec.plan(_PretrainedAndNew(), example, world_size=world, memory_per_rank="1GB",
                                            pins=pins, optimizer="rowwise_adagrad", weights_precision="fp16"))
        except ValueError as e:
            half = str(e)
        with open(f"{result_file}.{rank}", "w") as fh:
            json.dump({"kernels": kernels, "refused": refused, "half": half}, fh)
        dist.barrier()
    os._exit(0)


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_a_table_frozen_beside_a_trained_one_keeps_each_ranks_group_off_fbgemms_fused_kernel(sharding, tmp_path):
    """A table frozen before transform beside one trained with fused row-wise Adagrad, both sharded:
    each rank's local group went to fbgemm's fused kernel, which would update the frozen rows, and
    the first training call failed on the ranks holding both (the same rule as one process now
    passes fbgemm over there). Three steps equal the single-process model, the frozen rows stay,
    and a forced backend="fbgemm" is refused at transform on every rank, as is weights_precision="fp16"
    (which only fbgemm's fused kernel stores), saying why."""
    out = str(tmp_path / "res")
    spawn(_frozen_worker, 2, sharding, out)
    for rank in range(2):
        with open(f"{out}.{rank}") as fh:
            res = json.load(fh)
        if sharding == "row_wise" or rank == 0:  # (table_wise: both on rank 0, rank 1 holds nothing)
            assert res["kernels"] and "fbgemm" not in res["kernels"], res
        assert ("tables ['f'] are frozen (requires_grad=False) and fbgemm's fused kernel would update them"
                in res["refused"]) or "transform failed on rank(s)" in res["refused"], res
        assert ("tables ['f'] are frozen (requires_grad=False) and fbgemm's fused kernel would update them"
                in res["half"]) or "transform failed on rank(s)" in res["half"], res  # (it said "the None kernel")


@pytest.mark.parametrize("opt_name,backend", [(o, b) for o in _FUSED for b in ("auto", "fbgemm", "reference")
                                              if (o, b) != ("rowwise_adagrad_max_norm", "fbgemm")])
def test_fused_optimizers_on_a_mixed_plan_match_the_single_process_fused_model(opt_name, backend):
    """Every sharding type at once (column-wise not with row-wise Adagrad, which it refuses), each
    optimizer fused: 6 steps equal the single-process fused model, on every shard, and each rank
    holds the bytes the plan says. (backend="reference": the Adagrads' rows were given a dense
    gradient by the native kernel instead of their update, and never moved. max_norm is not
    fbgemm's on CPU: its CPU build ignores it.)"""
    pins = {"bags.0": ("table_wise", 1), "bags.1": "row_wise", "single": "data_parallel",
            "bags.2": ("table_wise", 0) if opt_name.startswith("rowwise_adagrad") else {"sharding": "column_wise", "ranks": [1, 0]}}
    spawn(_fused_worker, 2, pins, opt_name, 6, backend)


def _error_worker(rank, world, init_file, result_file, attempt, args):
    with gloo_group(rank, world, init_file, 60):
        try:
            attempt(rank, world, *args)
            msg = "no error"
        except (ValueError, IndexError, TypeError) as e:
            msg = str(e)
        if rank == 0:
            with open(result_file, "w") as fh:
                fh.write(msg)
        dist.barrier()
    os._exit(0)


def message_of(call) -> str:
    """The message of the error ``call()`` raises (ValueError, IndexError or TypeError, as
    :func:`error_of` catches), or "no error": a worker's messages, one case at a time."""
    try:
        call()
    except (ValueError, IndexError, TypeError) as e:
        return str(e)
    return "no error"


def error_of(tmp_path, world, attempt, *args) -> str:
    """The message of the ValueError (or IndexError, TypeError) that ``attempt(rank, world, *args)``
    (a module-level function) raises on rank 0 of ``world`` processes, or "no error"."""
    result = tmp_path / "msg"
    spawn(_error_worker, world, str(result), attempt, args)
    return result.read_text()


def _whole_row_optimizer_on_column_wise(rank, world, name):
    model = Model()
    example = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)
    plan = fxrec.plan(model, global_batch(LOCAL_B * world, 0), world_size=world, memory_per_rank="1GB",
                      pins={"bags.1": {"sharding": "column_wise", "ranks": [0, 1]}},
                      batch_size=LOCAL_B)  # (the same plan on every rank; planned without the optimizer)
    opt = {"row-wise Adagrad": fxrec.optim.RowWiseAdagrad(lr=0.1), "LAMB": fxrec.optim.LazyLamb(lr=0.1),
           "LARS-SGD": fxrec.optim.LarsSGD(lr=0.1)}[name]
    fxrec.transform(model, example, plan=plan, optimizer=opt)


ERROR_PINS = {"bags.0": ("table_wise", 1), "bags.1": "row_wise", "bags.2": ("table_wise", 0), "single": "data_parallel"}


def sharded_for(model, rank: int, world: int, pins: dict):
    """``model`` transformed for ``rank`` under one plan with every table pinned (``pins``), made
    from the global batch with ``LOCAL_B`` samples a rank: the same plan on every rank."""
    plan = fxrec.plan(model, global_batch(LOCAL_B * world, 0), world_size=world, memory_per_rank="1GB", pins=pins,
                      batch_size=LOCAL_B)
    return fxrec.transform(model, local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B), plan=plan)


def _ids_out_of_range(rank, world):
    fast = sharded_for(Model(), rank, world, {**ERROR_PINS, "single": "table_wise"})
    dense, ids, offsets, single = local_batch(global_batch(LOCAL_B * world, 1), rank, LOCAL_B)
    single = single.clone()
    single[1] = ROWS[3] + 2  # every rank feeds one id past the end of table 'single'
    fast(dense, ids, offsets, single)


def _bad_offsets(rank, world):
    """Rank 0's message of each case, in one ValueError, for a table-wise (feature 0) and a row-wise
    table (feature 1): offsets that do not start at 0 (fed to rank 0 only), that decrease (fed to
    rank 1 only), that run past no ids at all (rank 0 only), and features of one batch with different
    batch sizes (every rank)."""
    fast = sharded_for(Model(), rank, world, ERROR_PINS)
    dense, _, _, single = local_batch(global_batch(LOCAL_B * world, 1), rank, LOCAL_B)
    msgs = []
    for f in (0, 1):
        for bad, on, no_ids in (([1, 2, 3, 4], (0,), False), ([0, 3, 2, 5], (1,), False), ([0, 0, 0, 2], (0,), True),
                                ([0, 1, 2], (0, 1), False)):
            ids = [torch.arange(6) % 30 for _ in range(3)]
            offs = [torch.tensor([0, 1, 2, 3]) for _ in range(3)]
            if rank in on:
                offs[f] = torch.tensor(bad)
                if no_ids:
                    ids[f] = ids[f][:0]
            msgs.append(message_of(lambda: fast(dense, ids, offs, single)))
    raise ValueError(" || ".join(msgs))


def test_bad_offsets_fail_on_the_rank_fed_them_naming_the_feature_and_the_other_ranks_stop_too(tmp_path):
    msgs = error_of(tmp_path, 2, _bad_offsets).split(" || ")
    for f, (start, decrease, past_nothing, batch) in zip((0, 1), (msgs[0:4], msgs[4:8])):
        assert f"offsets of feature 'ids_{f}' must start at 0, got 1" in start, start
        # rank 1 was fed them: rank 0 stops at the same step instead of waiting for it
        assert "rank(s) [1] were fed input they reject" in decrease, decrease
        assert f"offsets of feature 'ids_{f}' decrease or run past its 0 ids" in past_nothing, past_nothing
        # (the model's input guards see this one first)
        assert f"offsets of feature 'ids_{f}', table 'bags.{f}') has size 3 in dim 0" in batch, batch


def _two_batch_sizes(rank, world):
    """An input dist called directly (what the model's input guards leave to it): features of
    two batch sizes fed to rank 0, then to rank 1; rank 0's messages."""
    from fxrec.runtime.sharded import PooledInputDist

    good = ([torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])], [torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2])])
    bad = ([torch.tensor([1, 2, 3]), torch.tensor([4, 5])], [torch.tensor([0, 1, 2]), torch.tensor([0, 1])])
    # a table-wise piece on rank 1 (one block of 10 rows) and a row-wise one (blocks of 5 from rank 0)
    dist_module = PooledInputDist("g", ["bag", "bag"], [10, 5], [1, 0], False, rank, world, ["a", "b"], [10, 10])
    msgs = []
    for on in (0, 1):
        ids, offsets = bad if rank == on else good
        msgs.append(message_of(lambda: dist_module(ids, offsets, [None, None])))
    dist_module(*good, [None, None])  # every rank still runs a good call
    raise ValueError(" || ".join(msgs))


def test_an_input_dist_called_with_features_of_two_batch_sizes_names_them_and_every_rank_stops(tmp_path):
    here, there = error_of(tmp_path, 2, _two_batch_sizes).split(" || ")
    assert "g: features of one sharded group need one batch size, got {'a': 3, 'b': 2}" in here, here
    assert "g: rank(s) [1] were fed input they reject" in there, there


def _plans_that_differ(rank, world):
    model = Model()
    example = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)
    pins = {"bags.0": ("table_wise", 1), "bags.1": "row_wise", "single": "data_parallel",
            "bags.2": ("table_wise", 0) if rank == 0 else "row_wise"}
    fxrec.transform(model, example, plan=fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins=pins))


def test_ranks_given_different_plans_are_told_so_naming_a_table(tmp_path):
    """(Collectives of other sizes would abort gloo's process, or hang NCCL.)"""
    msg = error_of(tmp_path, 2, _plans_that_differ)
    assert ("the ranks were given different sharding plans: for table 'bags.2', rank 0 plans it table_wise (30 x 8; "
            "rank 0: rows 0+30, cols 0+8), rank 1 plans it row_wise (30 x 8; rank 0: rows 0+15, cols 0+8, rank 1: rows "
            "15+15, cols 0+8)") in msg and "plan.save" in msg, msg


def _row_wise_ids_out_of_range(rank, world):
    """Rank 0's message of each case for the row-wise table bags.1: a negative id fed to rank 1
    only, an id past the end fed to rank 0 only; then a good batch, which every rank still runs."""
    torch.manual_seed(0)
    model, ref = Model(), Model()
    ref.load_state_dict(model.state_dict())  # (transform takes the model's tables to slice them)
    fast = sharded_for(model, rank, world, ERROR_PINS)
    dense, ids, offsets, single = local_batch(global_batch(LOCAL_B * world, 1), rank, LOCAL_B)
    msgs = []
    for bad_id, on in ((-3, 1), (ROWS[1] + 5, 0)):
        bad = [i.clone() for i in ids]
        if rank == on:
            bad[1][0] = bad_id
        msgs.append(message_of(lambda: fast(dense, bad, offsets, single)))
    torch.testing.assert_close(fast(dense, ids, offsets, single), ref(dense, ids, offsets, single))
    raise ValueError(" || ".join(msgs))


def test_row_wise_ids_out_of_range_stop_every_rank_naming_the_feature(tmp_path):
    """fbgemm's bucketize runs before the ranks learn of the bad ids: it is fed harmless stand-ins,
    and every rank stops at the counts' exchange; the model then runs a good batch."""
    negative, past = error_of(tmp_path, 2, _row_wise_ids_out_of_range).split(" || ")
    assert "rank(s) [1] were fed input they reject" in negative, negative
    assert f"feature 'ids_1' looks up id {ROWS[1] + 5} in table 'bags.1', which has {ROWS[1]} rows" in past, past


class WeightedSharded(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.EmbeddingBag(40, DIM, mode="sum")
        self.top = nn.Linear(DIM, 1)

    def forward(self, ids, offsets, psw):
        return self.top(self.w(ids, offsets, per_sample_weights=psw)).squeeze(1)


def _inputs_refused_on_the_host(rank, world):
    """Rank 0's message of each case, fed to one rank: float ids of a row-wise table (rank 1),
    float offsets of a table-wise one (rank 0), float ids of a row-wise sequence feature (rank 0
    and rank 1 in turn), per-sample weights that need a gradient (rank 1, then rank 0) or are
    float64 (rank 0); then good batches, which every rank still runs as the plain model does."""
    torch.manual_seed(0)
    model, ref = Model(), Model()
    ref.load_state_dict(model.state_dict())
    fast = sharded_for(model, rank, world, {**ERROR_PINS, "single": "row_wise"})
    x = global_batch(LOCAL_B * world, 1)
    dense, ids, offsets, single = local_batch(x, rank, LOCAL_B)
    cases = [(1, lambda: (dense, [ids[0], ids[1].float(), ids[2]], offsets, single)),
             (0, lambda: (dense, ids, [offsets[0].float(), offsets[1], offsets[2]], single)),
             (0, lambda: (dense, ids, offsets, single.float())),
             (1, lambda: (dense, ids, offsets, single.float())),
             (1, lambda: (dense, [ids[0], ids[1].to("meta"), ids[2]], offsets, single)),
             (0, lambda: (dense, ids, [offsets[0], offsets[1], offsets[2].to("meta")], single)),
             (0, lambda: (dense, [i.to("meta") for i in ids], [o.to("meta") for o in offsets], single))]
    msgs = []
    for on, bad in cases:
        msgs.append(message_of(lambda: fast(*(bad() if rank == on else (dense, ids, offsets, single)))))
    torch.testing.assert_close(fast(dense, ids, offsets, single), ref(*x)[rank * LOCAL_B:(rank + 1) * LOCAL_B])
    weighted = WeightedSharded()
    wx = [torch.randint(0, 40, (2 * LOCAL_B,)), torch.arange(0, 2 * LOCAL_B, 2), torch.rand(2 * LOCAL_B)]
    wplan = fxrec.plan(weighted, wx, world_size=world, memory_per_rank="1GB", pins={"w": ("table_wise", 0)})
    wfast = fxrec.transform(weighted, wx, plan=wplan)
    for on, bad in ((1, lambda: wx[2].clone().requires_grad_()), (0, lambda: wx[2].clone().requires_grad_()),
                    (0, lambda: wx[2].double())):
        msgs.append(message_of(lambda: wfast(wx[0], wx[1], bad() if rank == on else wx[2])))
    wfast(*wx)
    raise ValueError(" || ".join(msgs))


def _wrong_sizes_on_one_rank(rank, world, pins):
    """Rank 0's message of each case: dense inputs of the wrong width fed to rank 1, then to rank
    0, then a batch whose dense input and ids disagree in size (rank 1), a list of ids one short
    (rank 1), a list of offsets one long (rank 0) and None for the ids (rank 1); then three training steps
    on good batches, which must match the single-process model (a rank that raised before the
    first exchange used to leave the others waiting there, and their wait was answered by its
    next step)."""
    torch.manual_seed(0)
    model, ref = Model(), Model()
    ref.load_state_dict(model.state_dict())
    fast = sharded_for(model, rank, world, pins)
    dense, ids, offsets, single = local_batch(global_batch(LOCAL_B * world, 1), rank, LOCAL_B)
    cases = [(1, lambda: (torch.rand(LOCAL_B, 5), ids, offsets, single)),
             (0, lambda: (torch.rand(LOCAL_B, 5), ids, offsets, single)),
             (1, lambda: (dense[:-1], ids, offsets, single)),
             (1, lambda: (dense, ids[:-1], offsets, single)),  # lists of another length: the forward's first lines
             (0, lambda: (dense, ids, offsets + [offsets[0]], single)),
             (1, lambda: (dense, None, offsets, single))]  # no list at all (len(None) used to fail on rank 1 alone)
    msgs = []
    for on, bad in cases:
        msgs.append(message_of(lambda: fast(*(bad() if rank == on else (dense, ids, offsets, single)))))
    opt, ref_opt = torch.optim.SGD(fast.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(3):
        x = global_batch(LOCAL_B * world, step + 2)
        want, got = ref(*x), fast(*local_batch(x, rank, LOCAL_B))
        torch.testing.assert_close(got, want[rank * LOCAL_B:(rank + 1) * LOCAL_B], msg=f"step {step}")
        for o, out in ((ref_opt, want.sum()), (opt, got.sum())):
            o.zero_grad()
            out.backward()
            o.step()
    raise ValueError(" || ".join(msgs))


def test_inputs_of_the_wrong_size_on_one_rank_stop_every_rank_at_the_first_exchange(tmp_path):
    """The model's input guards raise before any collective; in a sharded model the rank fed the
    input joins the first input dist's exchange and every rank stops there (a sequence dist's:
    tests/test_sharding_sequence.py)."""
    pins = {**ERROR_PINS, "single": "row_wise"}
    msgs = error_of(tmp_path, 2, _wrong_sizes_on_one_rank, pins).split(" || ")
    there, here, mismatched, short_there, long_here, none_there = msgs
    assert "rank(s) [1] were fed input they reject" in there, there
    assert "input dense" in here and "size 5 in dim 1" in here, here
    assert "rank(s) [1] were fed input they reject" in mismatched, mismatched
    assert "rank(s) [1] were fed input they reject" in short_there, short_there
    assert "input offsets must have 3 elements (a list or tuple), got a list of 4" in long_here, long_here
    assert "rank(s) [1] were fed input they reject" in none_there, none_there


def test_inputs_refused_on_the_host_stop_every_rank_naming_the_feature(tmp_path):
    """Checks made before the exchange (dtypes, per-sample weights that need a gradient) stop every
    rank at the counts' exchange, as the checks on the device do: the other ranks do not wait for
    the rank fed the input until the timeout. (Float ids used to be cast to int64 by the packing,
    and the sharded model gave an answer where the plain model refuses them.)"""
    msgs = error_of(tmp_path, 2, _inputs_refused_on_the_host).split(" || ")
    (float_ids, float_offsets, seq_here, seq_there, device_there, device_here, meta_here, psw_there, psw_here,
     psw_double) = msgs
    stopped = "rank(s) [1] were fed input they reject"
    assert stopped in float_ids, float_ids
    # (inputs on another device were refused after the host checks, on that rank alone: its
    # collectives then paired with the other ranks' next call)
    assert stopped in device_there, device_there
    assert ("feature 'ids_2' got offsets on meta; a sharded group takes every input on cpu (where feature 'ids_0' "
            "has its ids)") in device_here, device_here
    # (every input on meta: the exchange itself failed on that rank, after every check)
    assert "feature 'ids_0' got ids on meta, which hold no values to look up" in meta_here, meta_here
    assert "feature 'ids_0' got offsets of dtype torch.float32; offsets must be int64 or int32" in float_offsets
    assert "feature 'single_ids' got ids of dtype torch.float32; embedding ids must be int64 or int32" in seq_here
    assert stopped in seq_there, seq_there
    assert stopped in psw_there, psw_there
    assert "feature 'ids' has per-sample weights that need a gradient" in psw_here, psw_here
    assert "feature 'ids' got per-sample weights of dtype torch.float64; they must be torch.float32" in psw_double


def test_ids_out_of_range_fail_on_the_rank_fed_them_naming_the_feature(tmp_path):
    msg = error_of(tmp_path, 2, _ids_out_of_range)
    assert "feature 'single_ids'" in msg and f"looks up id {ROWS[3] + 2} in table 'single', which has {ROWS[3]} rows" \
        in msg, msg  # (the table was not named: one process names it)


def test_rowwise_adagrad_on_a_column_wise_table_is_refused_naming_it(tmp_path):
    msg = error_of(tmp_path, 2, _whole_row_optimizer_on_column_wise, "row-wise Adagrad")
    assert "['bags.1']" in msg and "column_wise" in msg and "row-wise Adagrad" in msg, msg
    # (the plan was made without it: the message says what would have helped, which
    # tests/test_planner.py checks: test_the_planner_does_not_split_by_columns_a_table_whose_...)
    assert "the plan was made without optimizer=" in msg, msg


@pytest.mark.parametrize("name", ["LAMB", "LARS-SGD"])
def test_an_optimizer_whose_trust_ratio_reads_the_whole_row_is_refused_on_a_column_wise_table(tmp_path, name):
    """Fused (CUDA) or not (CPU: its torch.optim form on each shard), each column shard would take
    its own ratio of norms over its columns: another update than one process's."""
    msg = error_of(tmp_path, 2, _whole_row_optimizer_on_column_wise, name)
    assert f"tables ['bags.1'] are planned column_wise and train with {name}, whose trust ratio takes norms over " \
           "the whole row" in msg, msg


def _refused_on_every_rank(rank, world):
    """World 3, the column-wise table on ranks 0 and 1 only: rank 2 holds nothing of the group."""
    model = Model()
    example = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)
    plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB",
                      pins={"bags.0": "data_parallel", "bags.1": {"sharding": "column_wise", "ranks": [0, 1]},
                            "bags.2": "data_parallel", "single": "data_parallel"})
    try:
        fxrec.transform(model, example, plan=plan, optimizer=fxrec.optim.LazyLamb(lr=0.1))
        msg = "no error"
    except ValueError as e:
        msg = str(e)
    msgs = [None] * world
    dist.all_gather_object(msgs, msg)  # (a rank that went on would be in another collective: a timeout)
    raise ValueError(" || ".join(msgs))


def test_a_refused_optimizer_stops_every_rank_also_one_holding_nothing_of_the_group(tmp_path):
    msgs = error_of(tmp_path, 3, _refused_on_every_rank).split(" || ")
    assert len(msgs) == 3 and all("tables ['bags.1'] are planned column_wise and train with LAMB" in m for m in msgs), msgs


def _one_rank_fails_early(rank, world, how):
    """Rank 1 alone fails before the passes: its capture (a dense input of another width in its local
    example, which the model's Linear refuses) or an argument check (a mode its call misspells).
    Every rank's message and rank 0's seconds."""
    model = Model()
    plan = fxrec.plan(model, global_batch(LOCAL_B * world, 0), world_size=world, memory_per_rank="1GB", pins=ERROR_PINS,
                      batch_size=LOCAL_B)
    dense, ids, offsets, single = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)
    kw = {}
    if rank == 1 and how == "capture":
        dense = torch.cat([dense, dense[:, :1]], 1)
    if rank == 1 and how == "argument":
        kw = dict(mode="inferenc")
    start = time.monotonic()
    try:
        fxrec.transform(model, (dense, ids, offsets, single), plan=plan, **kw)
        msg = "no error"
    except Exception as e:  # noqa: BLE001 - the capture's is a CaptureError
        msg = f"{type(e).__name__}: {e}"
    msgs = [None] * world
    dist.all_gather_object(msgs, msg)
    raise ValueError(" || ".join(msgs + [f"{time.monotonic() - start:.1f}"]))


@pytest.mark.parametrize("how", ["capture", "argument"])
def test_a_rank_whose_capture_or_arguments_fail_stops_every_rank_at_once(tmp_path, how):
    """The capture and the argument checks ran outside the exchange that stops every rank: rank 0
    waited in the passes' exchange until the process group's timeout (30 minutes by default)."""
    here, there, seconds = error_of(tmp_path, 2, _one_rank_fails_early, how).split(" || ")
    assert "InputError: fxrec: transform failed on rank(s) [1]" in here, here
    assert ("CaptureError" if how == "capture" else "mode must be 'training' or 'inference'") in there, there
    assert float(seconds) < 30, seconds  # (the test's process group waits 60 s)


def _settings_that_differ(rank, world, which):
    model = Model()
    if which == "model" and rank == 1:
        model.bags[2] = nn.EmbeddingBag(ROWS[2], DIM, mode="mean")
        model.extra = nn.Linear(2, 2)
    plan = fxrec.plan(Model(), global_batch(LOCAL_B * world, 0), world_size=world, memory_per_rank="1GB",
                      pins=ERROR_PINS, batch_size=LOCAL_B)
    kw = {"mode": dict(mode="inference" if rank else "training"),
          "lr": dict(optimizer=fxrec.optim.Adagrad(lr=0.1 if rank else 0.2)),
          "max_gradient": dict(max_gradient=1.0 if rank else None),
          "same_dict": dict(optimizer=dict(sorted({n: fxrec.optim.Adagrad(lr=0.1) for n in
                                                   ("bags.0", "bags.1", "bags.2", "single")}.items(), reverse=rank == 1))),
          "model": {}}[which]
    fxrec.transform(model, local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B), plan=plan, **kw)


@pytest.mark.parametrize("which,said", [
    ("mode", "the ranks called transform differently: mode is 'training' on rank 0 and 'inference' on rank 1"),
    ("lr", "the ranks called transform differently: optimizer is Adagrad(lr=0.2"),
    ("max_gradient", "the ranks called transform differently: max_gradient is None on rank 0 and 1.0 on rank 1"),
    ("model", "the ranks transformed different models: of 'extra.bias', rank 0 has none and rank 1 has it [2] float32"),
    ("same_dict", "no error"),
])
def test_ranks_that_call_transform_differently_are_told_which_setting_differs(tmp_path, which, said):
    """Only the plans were compared: another mode on one rank built other collectives (gloo aborted
    rank 0's process), and another learning rate or max_gradient, or another model, went unnoticed.
    The same dict of optimizers built in another order on each rank is the same setting."""
    msg = error_of(tmp_path, 2, _settings_that_differ, which)
    assert said in msg, msg


class _RowsApart(nn.Module):
    """A max_norm table and a scale_grad_by_freq bag, which fxrec leaves as written, beside a sharded one."""

    def __init__(self):
        super().__init__()
        self.norm = nn.Embedding(10, 4, max_norm=1.0)
        self.freq = nn.EmbeddingBag(10, 4, mode="sum", scale_grad_by_freq=True)
        self.other = nn.EmbeddingBag(10, 4, mode="sum")
        self.top = nn.Linear(12, 1)

    def forward(self, ids, offsets):
        return self.top(torch.cat([self.norm(ids[::2]), self.freq(ids, offsets), self.other(ids, offsets)], 1))


def _tables_apart_on_ranks(rank, world):
    torch.manual_seed(0)
    model = _RowsApart()
    x = (torch.randint(0, 10, (8,)), torch.arange(0, 8, 2))
    plan = fxrec.plan(model, x, world_size=world, memory_per_rank="1GB", pins={"other": "row_wise"})
    msgs = [message_of(lambda: fxrec.transform(model, x, plan=plan))]
    frozen = copy.deepcopy(model)  # (frozen tables train nothing: their outputs are one process's)
    frozen.norm.weight.requires_grad_(False)
    frozen.freq.weight.requires_grad_(False)
    msgs.append(message_of(lambda: fxrec.transform(frozen, x, plan=plan)))
    fast = fxrec.transform(model, x, plan=plan, mode="inference")  # (rows renormalised before each read: as one process)
    with torch.no_grad():
        msgs.append(str(torch.allclose(fast(*x), model(*x))))
    whole = _ReadWhole()
    whole.load_state_dict(frozen.state_dict())
    whole.requires_grad_(False).top.requires_grad_(True)
    msgs.append(message_of(lambda: fxrec.transform(whole, x, plan=plan)))  # (each rank's copy read whole)
    raise ValueError(" || ".join(msgs))


def test_tables_whose_lookups_would_part_the_ranks_copies_are_refused_in_training(tmp_path):
    """Left as written on every rank of a plan, max_norm renormalised each rank's own rows in place
    (the copies parted: 1.0 apart after 3 steps) and scale_grad_by_freq scaled by each rank's own
    counts (0.23 off the plain model), without a word (found by a composition hunt)."""
    training, frozen, inference_same, read_whole = error_of(tmp_path, 2, _tables_apart_on_ranks).split(" || ")
    assert frozen == "no error", frozen
    assert "'norm': max_norm renormalises" in read_whole and "reads the table outside the lookups" in read_whole, read_whole
    assert "'freq'" not in read_whole, read_whole  # (frozen: its outputs are one process's)
    assert "'freq': scale_grad_by_freq scales its gradient by the id counts of each rank's own batch" in training, training
    assert "'norm': max_norm renormalises in place the rows each rank's own batch reads" in training, training
    assert inference_same == "True"


def test_explain_with_a_plan_gives_the_refusal_of_tables_that_would_part_the_ranks_copies():
    """(explain described such a plan as if transform would take it.)"""
    model = _RowsApart()
    x = (torch.randint(0, 10, (8,)), torch.arange(0, 8, 2))
    plan = fxrec.plan(model, x, world_size=2, memory_per_rank="1GB", pins={"other": "row_wise"})
    with pytest.raises(ValueError, match="'freq': scale_grad_by_freq scales its gradient by the id counts"):
        fxrec.explain(model, x, plan=plan)
    assert fxrec.explain(model, x, plan=plan, mode="inference").groups


class _ReadWhole(_RowsApart):
    def forward(self, ids, offsets):
        return super().forward(ids, offsets) + self.norm.weight.sum()


class _ReadPlain(_RowsApart):  # a lookup of the table without max_norm beside the one with it
    def forward(self, ids, offsets):
        return super().forward(ids, offsets) + F.embedding(ids[1::2], self.norm.weight).sum(1, keepdim=True)


class _ReadBlock(_RowsApart):  # the max_norm lookup in a no_grad block, the weight read outside it
    def forward(self, ids, offsets):
        with torch.no_grad():
            n = self.norm(ids[::2])
        return self.top(torch.cat([n, self.freq(ids, offsets), self.other(ids, offsets)], 1)) + self.norm.weight.sum()


class _ReadFreq(_RowsApart):
    def forward(self, ids, offsets):
        return super().forward(ids, offsets) + self.freq.weight.sum()


@pytest.mark.parametrize("form", [_ReadWhole, _ReadPlain, _ReadBlock])
@pytest.mark.parametrize("mode", ["training", "inference"])
def test_a_max_norm_table_also_read_outside_its_lookups_is_refused_frozen_and_in_inference(mode, form):
    """Each rank renormalises the rows its own batch reads, so the copies part; the lookups still
    give one process's outputs, but the model's own read of the whole weight did not (0.5 off at
    the first step, 2.6 at the third), nor a lookup of it without max_norm (0.51 off), nor a read
    outside the no_grad block the max_norm lookup is in (0.37 off: the block was not looked into)."""
    torch.manual_seed(0)
    model = form()
    model.requires_grad_(False).top.requires_grad_(True)
    x = (torch.randint(0, 10, (8,)), torch.arange(0, 8, 2))
    plan = fxrec.plan(model, x, world_size=2, memory_per_rank="1GB", pins={"other": "row_wise"})
    with pytest.raises(ValueError, match=r"'norm': max_norm renormalises.*reads the table outside the lookups that "
                                         r"renormalise it") as e:
        fxrec.explain(model, x, plan=plan, mode=mode)
    assert "'freq'" not in str(e.value)
    other = _ReadFreq()
    other.requires_grad_(False).top.requires_grad_(True)
    assert fxrec.explain(other, x, plan=plan, mode=mode).groups  # (no max_norm: every rank's copy is the same)


_CKPT_G = 24  # the global batch of the checkpoint test, at every world size


def _train_fused(steps, world, rank=None):
    """A function training a model ``steps`` steps on global batches of ``_CKPT_G``: the whole
    batch (``rank`` None), or this rank's part."""
    b = _CKPT_G // world

    def run(fast, opt, first):
        for step in range(first, first + steps):
            x = global_batch(_CKPT_G, step + 1)
            cot = torch.randn(_CKPT_G, generator=torch.Generator().manual_seed(100 + step))
            if rank is None:
                loss = (fast(*x) * cot).sum()
            else:
                loss = (fast(*local_batch(x, rank, b)) * cot[rank * b:(rank + 1) * b]).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return run


def _ckpt_worker(rank, world, init_file, opt_name, ckpt, phase):
    """phase 0 (world size 2): 3 steps under plan A, save. phase 1 (world size 4): load under plan
    B (and into one process), 3 more steps; both equal 6 uninterrupted single-process fused steps."""
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = Model()
        example = local_batch(global_batch(_CKPT_G, 0), rank, _CKPT_G // world)
        pins = ({"bags.0": ("table_wise", 1), "bags.1": "row_wise", "bags.2": ("table_wise", 0), "single": "row_wise"}
                if phase == 0 else
                {"bags.0": "row_wise", "bags.1": ("table_wise", 3), "bags.2": "row_wise", "single": ("table_wise", 2)})
        plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins=pins, optimizer=_FUSED[opt_name]())
        fast = fxrec.transform(copy.deepcopy(model), example, plan=plan, optimizer=_FUSED[opt_name]())
        opt = fast.make_optimizer(lr=0.05)
        run = _train_fused(3, world, rank)
        if phase == 0:
            run(fast, opt, 0)
            fxrec.checkpoint.save(fast, ckpt)
        else:
            fxrec.checkpoint.load(fast, ckpt)
            run(fast, opt, 3)
            one = fxrec.transform(copy.deepcopy(model), global_batch(_CKPT_G, 0), optimizer=_FUSED[opt_name]())
            fxrec.checkpoint.load_into_model(one, ckpt)  # the same checkpoint into one process
            one_opt = one.make_optimizer(lr=0.05)
            _train_fused(3, 1)(one, one_opt, 3)
            ref = fxrec.transform(copy.deepcopy(model), global_batch(_CKPT_G, 0), optimizer=_FUSED[opt_name]())
            _train_fused(6, 1)(ref, ref.make_optimizer(lr=0.05), 0)  # uninterrupted
            params = dict(fast.named_parameters())
            for name, want in ref.state_dict().items():
                torch.testing.assert_close(one.state_dict()[name], want, rtol=1e-5, atol=1e-6, msg=f"one process: {name}")
                tp = plan.tables.get(name.rsplit(".", 1)[0])
                if name in params:
                    torch.testing.assert_close(params[name].detach(), _held_part(want, tp, rank), rtol=1e-5,
                                               atol=1e-6, msg=f"rank {rank}: {name}")
        dist.barrier()
    os._exit(0)


@pytest.mark.parametrize("opt_name", ["adagrad", "rowwise_adagrad"])
def test_fused_states_checkpoint_reshards_and_training_continues_exactly(opt_name, tmp_path):
    """Save a fused model at world size 2 under one plan, load it at world size 4 under another
    (every table moves between table-wise and row-wise) and into one process: 3 more steps on
    each equal 6 uninterrupted steps of the single-process fused model."""
    ckpt = str(tmp_path / "ckpt")
    spawn(_ckpt_worker, 2, opt_name, ckpt, 0)
    spawn(_ckpt_worker, 4, opt_name, ckpt, 1)


def _host_waits_worker(rank, world, init_file, result_file):
    from fxrec.runtime._tracing import sync_free
    from fxrec.testing import host_syncs

    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = Model()
        example = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)
        pins = {"bags.0": ("table_wise", 1), "bags.1": "row_wise", "bags.2": ("table_wise", 0), "single": "table_wise"}
        plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins=pins, optimizer="sgd")
        fast = fxrec.transform(model, example, plan=plan, optimizer=fxrec.optim.SGD(lr=0.1), backend="fbgemm")
        opt = fast.make_optimizer(lr=0.05)
        x = local_batch(global_batch(LOCAL_B * world, 1), rank, LOCAL_B)

        def step():
            opt.zero_grad()
            fast(*x).sum().backward()
            opt.step()

        with sync_free():  # the groups run on CPU as on CUDA: they read no value
            step()
            with host_syncs() as syncs:
                step()
        from fxrec.runtime.sharded import PooledInputDist

        dists = sum(isinstance(m, PooledInputDist) for m in fast.modules())
        if rank == 0:
            with open(result_file, "w") as fh:
                json.dump({"events": syncs.in_fxrec(), "dists": dists}, fh)
        dist.barrier()
    os._exit(0)


def test_a_sharded_training_step_waits_for_the_device_only_for_the_counts_its_all_to_alls_need(tmp_path):
    """A plan with table-wise and row-wise tables, fused SGD on fbgemm: the only values read are the
    exchanged counts, one all-gather for the group's one input dist (ids per destination and piece,
    and the input check; fbgemm's bucketize is fed harmless stand-ins where the check failed): what
    the all-to-alls of variable size need. No id check, no count of the lookups, no copy from
    pageable host memory."""
    result = tmp_path / "syncs.json"
    spawn(_host_waits_worker, 2, str(result))
    got = json.loads(result.read_text())
    events, dists = got["events"], got["dists"]
    assert dists == 1, dists  # (one pooled group, table-wise and row-wise tables)
    assert all(what == "Tensor.tolist" and where.startswith("fxrec/runtime/collectives.py")
               for what, where in events), events
    assert len(events) == 1, events


def _plan_then_transform_padded(rank, world, init_file):
    from tests.test_planner import PaddedAndLastOffset, _padded_example

    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = PaddedAndLastOffset()
        x = _padded_example()
        plan = fxrec.plan(model, x, world_size=world, memory_per_rank="1GB")
        fast = fxrec.transform(model, x, plan=plan)  # (every rank feeds the same batch)
        torch.testing.assert_close(fast(*x), model(*x))
        dist.barrier()
    os._exit(0)


def test_a_plan_made_by_fxrec_plan_for_tables_with_padding_idx_or_include_last_offset_transforms():
    """fxrec.plan keeps them data_parallel, which transform takes (it planned them column_wise,
    and transform refused its own plan)."""
    spawn(_plan_then_transform_padded, 2)


def _plan_of_tables_read_beyond_their_group(rank, world):
    from tests.test_planner import ReadBeyondItsGroup

    torch.manual_seed(0)
    model = ReadBeyondItsGroup()
    x = (torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]), torch.tensor([0, 2, 4, 6]), torch.rand(8))
    plan = fxrec.plan(model, x, world_size=world, memory_per_rank="1GB", pins={"a": "row_wise"})
    fast = fxrec.transform(model, x, plan=plan)
    torch.testing.assert_close(fast(*x), model(*x), rtol=1e-6, atol=1e-6)


def test_transform_takes_the_plan_the_planner_makes_for_tables_read_beyond_their_group(tmp_path):
    """(transform refused it: the planner had planned such tables split, or left them out)"""
    assert error_of(tmp_path, 2, _plan_of_tables_read_beyond_their_group) == "no error"


class _TwoBagsOfOneTable(nn.Module):
    """A weighted sum bag of table 't' and a second bag of it over [B, L] ids, pooled by ``second``."""

    def __init__(self, second="sum"):
        super().__init__()
        self.t = nn.EmbeddingBag(40, 8, mode="sum")
        self.top = nn.Linear(16, 1)
        self.second = second

    def forward(self, ids, offs, w, rows):
        return self.top(torch.cat([self.t(ids, offs, per_sample_weights=w),
                                   F.embedding_bag(rows, self.t.weight, mode=self.second)], 1)).squeeze(1)


def test_explain_refuses_a_plan_that_shards_a_table_read_outside_its_lookups():
    """A table read by a sum bag and a max bag keeps the max one as written (fxrec has no max
    pooling), so it can only be data-parallel; a plan made from table specs shards it. transform
    refused the plan, and fxrec.explain(plan=) reported it as fine (found by the sharded fuzzer,
    with a weighted and an unweighted bag, which now share the table's group: the plan takes it)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randint(0, 40, (8,), generator=g), torch.arange(4) * 2, torch.rand(8, generator=g),
         torch.randint(0, 40, (4, 3), generator=g))
    plan = fxrec.plan(tables=[fxrec.TableSpec("t", 40, 8)], world_size=2, memory_per_rank="1GB", pins={"t": "row_wise"})
    with pytest.raises(fxrec.InputError, match=r"table 't' is also used outside its lookups .* plan it data_parallel"):
        fxrec.explain(_TwoBagsOfOneTable("max"), x, plan=plan)
    fxrec.explain(_TwoBagsOfOneTable("max"), x,
                  plan=fxrec.plan(_TwoBagsOfOneTable("max"), x, world_size=2, memory_per_rank="1GB"))
    report = fxrec.explain(_TwoBagsOfOneTable(), x, plan=plan)  # (its unweighted bag joins with weights of one)
    assert not report.left_alone and {e.table for e in report.lookups} == {"t"}


def _ddp_around_a_sharded_model(rank, world, init_file, result_file):
    from torch.nn.parallel import DistributedDataParallel

    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = Model()
        x = global_batch(LOCAL_B * world, 0)
        example = local_batch(x, rank, LOCAL_B)
        plan = fxrec.plan(model, x, world_size=world, memory_per_rank="1GB", pins={"bags.0": "row_wise"})
        fast = fxrec.transform(model, example, plan=plan, optimizer=fxrec.optim.SGD(lr=0.1))
        with torch.no_grad():
            before = fast(*example)
        try:
            DistributedDataParallel(fast)
            msg = "no error"
        except RuntimeError as e:
            msg = str(e)
        with torch.no_grad():
            unchanged = torch.equal(fast(*example), before)
        ignored = fast._ddp_params_and_buffers_to_ignore
        if rank == 0:
            with open(result_file, "w") as fh:
                fh.write(f"{unchanged}|{sorted(n for n, _ in fast.named_parameters()) == sorted(set(ignored) & {n for n, _ in fast.named_parameters()})}|{msg}")
        dist.barrier()
    os._exit(0)


def test_a_sharded_model_wrapped_in_ddp_is_refused_before_ddp_touches_its_shards(tmp_path):
    """A sharded model keeps its own parameters in step over ranks; DDP around it broadcast rank 0's
    row block over rank 1's and averaged what was summed: wrong outputs, no error (found by the
    sharded fuzzer). DDP now leaves every parameter (the model's _ddp_params_and_buffers_to_ignore)
    and so refuses it at once, and the model answers as before."""
    result = tmp_path / "msg"
    spawn(_ddp_around_a_sharded_model, 2, str(result))
    unchanged, all_ignored, msg = result.read_text().split("|", 2)
    assert "DistributedDataParallel is not needed" in msg, msg
    assert unchanged == "True" and all_ignored == "True"


def _plan_with_a_ghost_table(world):
    model = Model()
    x = global_batch(LOCAL_B * world, 0)
    plan = fxrec.plan(model, x, world_size=world, memory_per_rank="1GB")
    d = plan.to_dict()
    ghost = json.loads(json.dumps(d["tables"][0]))
    ghost.update(name="ghost", param="ghost.weight")
    d["tables"].append(ghost)
    return model, x, fxrec.ShardingPlan.from_dict(d)


def _transform_with_a_ghost_table(rank, world):
    model, x, plan = _plan_with_a_ghost_table(world)
    fxrec.transform(model, local_batch(x, rank, LOCAL_B), plan=plan)


def test_a_plan_naming_a_table_the_model_does_not_have_is_refused(tmp_path):
    """(A plan made for another model, or hand-edited: its tables' bytes and costs were counted, and
    transform and explain took it without a word; found by the sharded fuzzer.)"""
    model, x, plan = _plan_with_a_ghost_table(2)
    with pytest.raises(fxrec.pass_infra.InputError, match=r"the plan names table\(s\) \['ghost'\] that the model "
                                                          r"does not look up"):
        fxrec.explain(model, x, plan=plan)
    assert "the plan names table(s) ['ghost']" in error_of(tmp_path, 2, _transform_with_a_ghost_table)
