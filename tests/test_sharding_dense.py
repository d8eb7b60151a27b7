"""The parameters whole on every rank of a sharded model (dense layers, data-parallel tables):
their gradients are summed over ranks by DDP's reducer (torch's composable ``replicate``, with a
summing communication hook), except tables with sparse gradients, which keep a hook each that sums
them sparse (DDP's hooks cannot take sparse tensors). gloo, world size 2, against the plain model."""

import copy
import gc
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fxrec

from .test_sharding import LOCAL_B, error_of, global_batch, gloo_group, local_batch, spawn

ROWS = (40, 64, 30, 50)


class SparseModel(nn.Module):
    """A row-wise table, a data-parallel table with sparse gradients, a dense table, an MLP."""

    def __init__(self):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(ROWS[0], 8, mode="sum"),
                                   nn.EmbeddingBag(ROWS[1], 8, mode="sum", sparse=True),
                                   nn.EmbeddingBag(ROWS[2], 8, mode="mean")])
        self.single = nn.Embedding(ROWS[3], 8)
        self.mlp = nn.Sequential(nn.Linear(35, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, dense, ids, offsets, single_ids):
        parts = [b(i, o) for b, i, o in zip(self.bags, ids, offsets)] + [self.single(single_ids), dense]
        return self.mlp(torch.cat(parts, 1)).squeeze(1)


def _sharded_sparse_model(rank, world):
    """SparseModel, a copy of it, and it sharded: a row-wise, two data-parallel and a table-wise table."""
    torch.manual_seed(0)
    model = SparseModel()
    ref = copy.deepcopy(model)
    example = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)
    pins = {"bags.0": "row_wise", "bags.1": "data_parallel", "bags.2": "data_parallel", "single": ("table_wise", 1)}
    plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins=pins)
    return model, ref, fxrec.transform(model, example, plan=plan)


def _assert_whole_parameters_alike(fast, ref):
    """The parameters every rank holds whole (dense layers, data-parallel tables) equal the plain model's."""
    params = dict(fast.named_parameters())
    for name in ("mlp.0.weight", "mlp.2.bias", "bags.1.weight", "bags.2.weight"):
        torch.testing.assert_close(params[name].detach(), ref.get_parameter(name).detach(), msg=name)


def _worker(rank, world, init_file):
    with gloo_group(rank, world, init_file):
        model, ref, fast = _sharded_sparse_model(rank, world)
        assert type(fast).__name__.startswith("DDP"), type(fast)  # DDP's reducer, in place
        try:  # (torch's size mismatch from load_state_dict, which did not say what to do)
            fxrec.write_back(fast, copy.deepcopy(model))
            raise AssertionError("write_back of a sharded model was taken")
        except ValueError as e:
            assert "a sharded model holds only this rank's shards" in str(e) and "load_into_model" in str(e), e
        opt, ref_opt = torch.optim.SGD(fast.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(5):
            x = global_batch(LOCAL_B * world, step + 1)
            want = ref(*x)
            got = fast(*local_batch(x, rank, LOCAL_B))
            torch.testing.assert_close(got, want[rank * LOCAL_B:(rank + 1) * LOCAL_B], msg=f"step {step}")
            ref_opt.zero_grad()
            want.sum().backward()
            opt.zero_grad()
            got.sum().backward()
            assert fast.get_parameter("bags.1.weight").grad.is_sparse  # summed sparse, as the model makes it
            ref_opt.step()
            opt.step()
        _assert_whole_parameters_alike(fast, ref)
        dist.barrier()
    os._exit(0)


def test_dense_and_data_parallel_gradients_are_summed_over_ranks_by_ddp_and_sparse_ones_by_hooks():
    spawn(_worker, 2)


class RootTable(nn.Module):
    """A table held by the model itself, beside a dense parameter of the model itself."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(40, 8))
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, ids, offsets):
        return (F.embedding_bag(ids, self.table, offsets, mode="sum") * self.scale).sum(1)


def _transform_root_table(rank, world):
    model = RootTable()
    example = (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2]))
    plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins={"table": "row_wise"})
    fxrec.transform(model, example, plan=plan)


def test_a_module_holding_a_sharded_table_and_a_dense_parameter_is_refused_naming_both(tmp_path):
    msg = error_of(tmp_path, 2, _transform_root_table)
    assert "['table']" in msg and "'scale'" in msg and "modules of their own" in msg, msg


def _accumulating_worker(rank, world, init_file, how):
    """Three steps of SparseModel, each with two backward calls: ``accumulate``, forward and
    backward on two micro-batches then one step (``.grad`` zeroed to None or to zeros between
    steps); ``retain``, one forward and two losses' backward calls (retain_graph)."""
    with gloo_group(rank, world, init_file):
        model, ref, fast = _sharded_sparse_model(rank, world)
        opt, ref_opt = torch.optim.SGD(fast.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(3):
            zeros = how == "accumulate_zeros"
            ref_opt.zero_grad(set_to_none=not zeros)
            opt.zero_grad(set_to_none=not zeros)
            if how in ("retain", "retain_no_grad_between"):
                x = global_batch(LOCAL_B * world, step + 1)
                want, got = ref(*x), fast(*local_batch(x, rank, LOCAL_B))
                for k, loss in enumerate((lambda y: y.sum(), lambda y: (y * y).sum())):
                    if k and how == "retain_no_grad_between":  # (DDP's state is not reset by it)
                        with torch.no_grad():
                            fast(*local_batch(x, rank, LOCAL_B))
                    loss(want).backward(retain_graph=True)
                    loss(got).backward(retain_graph=True)
            elif how == "no_sync":  # DDP's own accumulation: sync off but for the last micro-batch
                for micro in range(3):
                    x = global_batch(LOCAL_B * world, 10 * step + micro + 1)
                    fast.set_requires_gradient_sync(micro == 2)
                    ref(*x).sum().backward()
                    fast(*local_batch(x, rank, LOCAL_B)).sum().backward()
            else:
                for micro in range(2):
                    x = global_batch(LOCAL_B * world, 10 * step + micro + 1)
                    ref(*x).sum().backward()
                    fast(*local_batch(x, rank, LOCAL_B)).sum().backward()
            for name in ("mlp.0.weight", "mlp.2.bias", "bags.2.weight"):  # (DDP's; bags.1's hook sums anyway)
                torch.testing.assert_close(fast.get_parameter(name).grad, ref.get_parameter(name).grad,
                                           msg=f"step {step}: {name}")
            ref_opt.step()
            opt.step()
        _assert_whole_parameters_alike(fast, ref)
        dist.barrier()
    os._exit(0)


@pytest.mark.parametrize("how", ["accumulate", "accumulate_zeros", "retain", "retain_no_grad_between", "no_sync"])
def test_two_backward_calls_a_step_give_one_process_gradients(how):
    """DDP all-reduces each .grad as it stands after a backward: with gradient accumulation the
    first micro-batch's sum was counted once per rank (12 where one process has 8), and a second
    backward through one forward was not summed over ranks at all. DDP's own no_sync accumulation,
    and a no_grad forward between two backward calls, keep working (a first form of the fix lost
    their gradients)."""
    spawn(_accumulating_worker, 2, how)


def _sparse_sum_worker(rank, world, init_file):
    from fxrec.runtime.collectives import sparse_sum

    with gloo_group(rank, world, init_file):
        rows = {0: [[3, 1, 3, 7]], 1: [[]], 2: [[7, 0]]}[rank]  # overlapping rows; none on rank 1
        g = torch.Generator().manual_seed(rank)
        grad = torch.sparse_coo_tensor(torch.tensor(rows, dtype=torch.long).view(1, -1),
                                       torch.randn(len(rows[0]), 5, generator=g), (10, 5))
        got = sparse_sum(grad, "a test gradient")
        want = torch.zeros(10, 5)
        for r in range(world):
            rr = {0: [3, 1, 3, 7], 1: [], 2: [7, 0]}[r]
            want.index_add_(0, torch.tensor(rr, dtype=torch.long), torch.randn(len(rr), 5, generator=torch.Generator().manual_seed(r)))
        assert got.is_sparse and got.is_coalesced()
        assert got.indices()[0].tolist() == [0, 1, 3, 7]  # the rows some rank holds, each once
        torch.testing.assert_close(got.to_dense(), want)
        dist.barrier()
    os._exit(0)


def test_a_sparse_gradient_is_summed_over_ranks_sparse_by_gathering_rows():
    """NCCL has no sparse all-reduce: the sum was dense there (a table-sized gradient, which
    torch.optim.SparseAdam refuses, so Adam on a sparse=True table failed at its first step). Rows
    are gathered and coalesced instead, on every backend; here gloo, one rank holding no rows."""
    spawn(_sparse_sum_worker, 3)


def test_under_nccl_a_rank_whose_current_cuda_device_tables_or_inputs_disagree_is_told_what_to_do():
    """(NCCL, read from torch's sources: object collectives and DDP use the current CUDA device, and
    NCCL takes CUDA tensors only; without torch.cuda.set_device every rank of a host runs on cuda:0,
    which NCCL refuses or hangs on.) A CPU check of the rule: no GPU here."""
    from fxrec.runtime.collectives import check_rank_device

    cuda = [torch.device("cuda", 1)]
    check_rank_device("nccl", 1, 1, cuda, cuda)  # as it should be
    check_rank_device("gloo", 0, 1, [torch.device("cpu")], [torch.device("cpu")])  # not NCCL: nothing
    with pytest.raises(ValueError, match=r"this rank \(LOCAL_RANK=1\) has cuda:0 as its current CUDA device.*"
                                         r"torch.cuda.set_device\(local_rank\)"):
        check_rank_device("nccl", 0, 1, [torch.device("cuda", 0)], [torch.device("cuda", 0)])
    with pytest.raises(ValueError, match=r"the model's tensors are on \['cuda:0'\].*current CUDA device, cuda:1"):
        check_rank_device("nccl", 1, None, [torch.device("cuda", 0)], cuda)
    with pytest.raises(ValueError, match=r"the example inputs are on \['cpu'\]"):
        check_rank_device("nccl", 1, 1, cuda, [torch.device("cpu")])


def test_the_two_gpu_nccl_worker_runs_on_gloo(tmp_path):
    """tests/test_gpu.py's two-GPU test has never run (the GPU machines have one GPU): its worker,
    the same code on gloo and the CPU, so that it is known to be right but for NCCL itself."""
    from tests.test_gpu import TWO_GPU_PINS, _nccl_worker

    spawn(_nccl_worker, 2, str(tmp_path), TWO_GPU_PINS, "sgd", "gloo")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.0", "ok.1"]


def test_the_nccl_worker_with_fsdp_dense_layers_and_clipping_runs_on_gloo(tmp_path):
    """The worker of tests/test_gpu.py's FSDP test (world size 1 there), at world size 2 on gloo."""
    from tests.test_gpu import ONE_GPU_PINS, _nccl_worker

    spawn(_nccl_worker, 2, str(tmp_path), dict(ONE_GPU_PINS), "sgd", "gloo", "fsdp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.0", "ok.1"]


class _TwoHeadsAndASpare(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(40, 8, mode="sum")
        self.h1 = nn.Linear(8, 1)
        self.h2 = nn.Linear(8, 1)
        self.spare = nn.Linear(2, 2)  # never used

    def forward(self, ids, offsets):
        e = self.bag(ids, offsets)
        return self.h1(e).squeeze(1), self.h2(e).squeeze(1)


def _spare_worker(rank, world, init_file):
    def batch(seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, 40, (12,), generator=g), torch.arange(0, 12, 3)

    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = _TwoHeadsAndASpare()
        ref = copy.deepcopy(model)
        plan = fxrec.plan(model, batch(rank), world_size=world, memory_per_rank="1GB", pins={"bag": "row_wise"})
        fast = fxrec.transform(model, batch(rank), plan=plan)
        opt, ref_opt = torch.optim.SGD(fast.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(2):
            for micro in range(2):
                xs = [batch(10 * step + 3 * micro + r + 1) for r in range(world)]
                a, b = fast(*xs[rank])
                (a.sum() + (b * b).sum()).backward()
                for x in xs:
                    ra, rb = ref(*x)
                    (ra.sum() + (rb * rb).sum()).backward()
            for name in ("h1.weight", "h2.weight", "h2.bias"):
                torch.testing.assert_close(fast.get_parameter(name).grad, ref.get_parameter(name).grad, msg=name)
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        del fast, opt
        gc.collect()
        dist.barrier()
    os._exit(0)


def test_a_dense_parameter_the_forward_never_uses_is_left_out_of_ddps_reduction():
    """Export keeps a get_attr for every parameter, read or not: fxrec took every parameter to be
    used, and DDP failed at the second step ("Expected to have finished reduction")."""
    spawn(_spare_worker, 2)
