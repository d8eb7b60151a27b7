"""Sharded models whose tables the user holds in fp16 (``model.half()``), on torch.distributed
(gloo, CPU, two processes). fxrec shards such tables whole (table-wise, or data-parallel): each
bag is pooled on one rank by PyTorch's own fp16 lookup and travels as fp16, so every rank gets,
bit for bit, the plain fp16 model's rows of the global batch, and after torch.optim's steps its
tables. Row-wise and column-wise layouts are refused (and never planned), naming the table."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fxrec

from .test_sharding import LOCAL_B, ROWS, error_of, global_batch, gloo_group, local_batch, spawn

HALF = torch.float16
DIM = 8


class HalfModel(nn.Module):
    """The lookups of tests.test_sharding's model, every table fp16, their rows returned side by
    side (no dense layer: each output value is one lookup's, compared exactly)."""

    def __init__(self, mode="sum"):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(r, DIM, mode=mode, dtype=HALF) for r in ROWS[:3]])
        self.single = nn.Embedding(ROWS[3], DIM, dtype=HALF)

    def forward(self, ids, offsets, single_ids):
        return torch.cat([b(i, o) for b, i, o in zip(self.bags, ids, offsets)] + [self.single(single_ids)], 1)


def sparse_part(x):
    return x[1:]  # (tests.test_sharding's batches start with a dense input this model does not take)


OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.5),
              "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.5, eps=1e-3)}  # (eps: 1e-10 is 0 in fp16)
PINS = {"bags.0": ("table_wise", 1), "bags.1": ("table_wise", 0), "bags.2": "data_parallel",
        "single": ("table_wise", 1)}


def _train(rank, world, init_file, mode, opt_name, steps):
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = HalfModel(mode)
        ref = copy.deepcopy(model)
        plan = fxrec.plan(model, sparse_part(global_batch(LOCAL_B * world, 0)), world_size=world,
                          memory_per_rank="1GB", pins=PINS, batch_size=LOCAL_B)
        fast = fxrec.transform(model, sparse_part(local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)),
                               plan=plan)
        names = [type(fast.get_submodule(n.target)).__name__ for n in fast.graph.nodes if n.op == "call_module"]
        assert "PooledInputDist" in names and "PooledOutputDist" in names, names  # sharded, not left as written
        opt, ref_opt = OPTIMIZERS[opt_name](fast.parameters()), OPTIMIZERS[opt_name](ref.parameters())
        mine = slice(rank * LOCAL_B, (rank + 1) * LOCAL_B)
        for step in range(steps):
            x = global_batch(LOCAL_B * world, step + 1)
            cot = torch.randn(LOCAL_B * world, 4 * DIM, generator=torch.Generator().manual_seed(100 + step))
            want = ref(*sparse_part(x))
            got = fast(*sparse_part(local_batch(x, rank, LOCAL_B)))
            assert got.dtype == HALF
            # the data-parallel table's columns too: before any step its replica is the table
            assert torch.equal(got, want[mine]), f"step {step}: {(got.float() - want[mine].float()).abs().max()}"
            ref_opt.zero_grad()
            (want.float() * cot).sum().backward()
            ref_opt.step()
            opt.zero_grad()
            (got.float() * cot[mine]).sum().backward()
            opt.step()
        params = dict(fast.named_parameters())
        for name, want in ref.state_dict().items():
            tp = plan.tables[name.rsplit(".", 1)[0]]
            if tp.sharding == "table_wise":
                assert (name in params) == (tp.shards[0].rank == rank), f"{name} on rank {rank}"
                if name in params:
                    assert params[name].dtype == HALF
                    assert torch.equal(params[name].detach(), want), \
                        f"{name}: {(params[name].detach().float() - want.float()).abs().max()}"
            else:  # data-parallel: DDP averages the ranks' fp16 gradients, a rounding the model does not make
                torch.testing.assert_close(params[name].detach(), want, rtol=2e-3, atol=2e-3, msg=name)
        dist.barrier()
    os._exit(0)


@pytest.mark.parametrize("opt_name", ["sgd", "adagrad"])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_fp16_tables_sharded_table_wise_train_as_the_plain_fp16_model_bit_for_bit(mode, opt_name):
    spawn(_train, 2, mode, opt_name, 4)


def test_the_planner_shards_fp16_tables_only_whole():
    """However large the table, fxrec.plan gives an fp16 table table_wise or data_parallel; one that
    fits no rank whole is a plan error naming it, where its fp32 twin goes row-wise."""
    x = sparse_part(global_batch(LOCAL_B * 2, 0))
    plan = fxrec.plan(HalfModel(), x, world_size=4, memory_per_rank="1GB")
    assert {tp.sharding for tp in plan.tables.values()} <= {"table_wise", "data_parallel"}

    class Big(nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.big = nn.EmbeddingBag(2_000_000, 64, dtype=dtype, device="meta")

        def forward(self, ids, offsets):
            return self.big(ids, offsets)

    ids, offsets = torch.randint(0, 100, (8,)), torch.tensor([0, 3, 5])
    # 2M x 64 at 4 bytes: 512 MB, over the 300 MB a rank has, whole or as a replica
    fp32 = fxrec.plan(Big(torch.float32), (ids, offsets), world_size=4, memory_per_rank="300MB")
    assert fp32.tables["big"].sharding in ("row_wise", "column_wise")
    # in fp16 it is 256 MB of rows, and their gradient as much: it fits no rank whole
    with pytest.raises(Exception, match="'big'"):
        fxrec.plan(Big(HALF), (ids, offsets), world_size=4, memory_per_rank="300MB")


@pytest.mark.parametrize("sharding", ["row_wise", "column_wise", "table_row_wise"])
def test_a_pin_that_splits_an_fp16_table_is_refused_naming_it(sharding):
    x = sparse_part(global_batch(LOCAL_B * 4, 0))
    with pytest.raises(ValueError, match=rf"pin for 'bags.1': the table is fp16 in the model, which fxrec shards "
                                         rf"table_wise or data_parallel \(whole on a rank\), not {sharding}"):
        fxrec.plan(HalfModel(), x, world_size=4, memory_per_rank="1GB", pins={"bags.1": sharding}, hosts=2)


def _planned_for_fp32_then_made_fp16(rank, world, sharding):
    model = HalfModel().float()  # the plan is made for the fp32 model ...
    plan = fxrec.plan(model, sparse_part(global_batch(LOCAL_B * world, 0)), world_size=world, memory_per_rank="1GB",
                      pins={**PINS, "bags.1": sharding}, batch_size=LOCAL_B)
    model.half()  # ... and given to its fp16 twin
    fxrec.transform(model, sparse_part(local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)), plan=plan)


@pytest.mark.parametrize("sharding", ["row_wise", "column_wise"])
def test_transform_refuses_a_plan_that_splits_an_fp16_table_naming_it(tmp_path, sharding):
    msg = error_of(tmp_path, 2, _planned_for_fp32_then_made_fp16, sharding)
    assert f"table 'bags.1' is float16 in the model and planned {sharding}; fxrec shards fp16 tables table_wise " \
           "or data_parallel" in msg, msg


class HalfSequence(nn.Module):
    """Unpooled lookups of two fp16 tables (a history ``[B, L]`` and one id per sample), the rows
    returned as the model's own (``[B, L + 1, 8]``)."""

    def __init__(self):
        super().__init__()
        self.hist = nn.Embedding(40, DIM, dtype=HALF)
        self.item = nn.Embedding(30, DIM, dtype=HALF)

    def forward(self, hist, item):
        return torch.cat([self.hist(hist), self.item(item)[:, None]], 1)


def _sequence_batch(batch, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 40, (batch, 5), generator=g), torch.randint(0, 30, (batch,), generator=g)


def _train_sequence(rank, world, init_file, steps):
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = HalfSequence()
        ref = copy.deepcopy(model)
        mine = slice(rank * LOCAL_B, (rank + 1) * LOCAL_B)
        plan = fxrec.plan(model, _sequence_batch(LOCAL_B * world, 0), world_size=world, memory_per_rank="1GB",
                          pins={"hist": ("table_wise", 1), "item": ("table_wise", 0)}, batch_size=LOCAL_B)
        fast = fxrec.transform(model, tuple(t[mine] for t in _sequence_batch(LOCAL_B * world, 0)), plan=plan)
        names = [type(fast.get_submodule(n.target)).__name__ for n in fast.graph.nodes if n.op == "call_module"]
        assert "SequenceInputDist" in names, names
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (fast, ref))
        for step in range(steps):
            x = _sequence_batch(LOCAL_B * world, step + 1)
            cot = torch.randn(LOCAL_B * world, 6, DIM, generator=torch.Generator().manual_seed(100 + step))
            want, got = ref(*x), fast(*(t[mine] for t in x))
            assert got.dtype == HALF and torch.equal(got, want[mine]), f"step {step}"
            ref_opt.zero_grad()
            (want.float() * cot).sum().backward()
            ref_opt.step()
            opt.zero_grad()
            (got.float() * cot[mine]).sum().backward()
            opt.step()
        params = dict(fast.named_parameters())
        for name, want in ref.state_dict().items():
            if name in params:
                assert torch.equal(params[name].detach(), want), name
        assert len(params) == 1, list(params)  # one table a rank
        dist.barrier()
    os._exit(0)


def test_unpooled_lookups_of_fp16_tables_sharded_table_wise_train_as_the_plain_model_bit_for_bit():
    spawn(_train_sequence, 2, 3)


def _quantized_with_a_data_parallel_table(rank, world, init_file, result_file):
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = HalfModel().eval()
        plan = fxrec.plan(model, sparse_part(global_batch(LOCAL_B * world, 0)), world_size=world,
                          memory_per_rank="1GB", pins=PINS, batch_size=LOCAL_B)
        example = sparse_part(local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B))
        try:
            fxrec.transform(model, example, mode="inference", quantize="int8", plan=plan)
            msg = "no error"
        except ValueError as e:
            msg = str(e)
        # the data-parallel table left as the model holds it (not named: it stays fp16), the others int8
        named = {"bags.0": "int8", "bags.1": "int8", "single": "int8"}
        fast = fxrec.transform(model, example, mode="inference", quantize=named, plan=plan)
        single = fxrec.transform(copy.deepcopy(model), sparse_part(global_batch(LOCAL_B * world, 0)), mode="inference",
                                 quantize=named)
        x = global_batch(LOCAL_B * world, 5)
        with torch.no_grad():
            got = fast(*sparse_part(local_batch(x, rank, LOCAL_B)))
            want = single(*sparse_part(x))[rank * LOCAL_B:(rank + 1) * LOCAL_B]
        assert got.dtype == HALF and torch.equal(got, want), (got.float() - want.float()).abs().max()
        if rank == 0:
            with open(result_file, "w") as fh:
                fh.write(msg)
        dist.barrier()
    os._exit(0)


def test_quantized_serving_of_fp16_tables_with_a_data_parallel_one(tmp_path):
    """int8 asked of the data-parallel fp16 table is refused naming it and the layout that serves
    it (table_wise: not row_wise, which fp16 tables do not take); left unnamed it stays fp16 (it
    was refused too, for the 'fp16' its dtype keeps), and the rows equal one process's."""
    result = tmp_path / "msg"
    spawn(_quantized_with_a_data_parallel_table, 2, str(result))
    msg = result.read_text()
    assert "table 'bags.2' is planned data_parallel, whose lookups stay the model's own (float16), and quantize= " \
           "asks for int8: plan it table_wise, or leave it as it is" in msg, msg
    assert "(quantize={'bags.2': 'fp16', ...}: a dict's first key naming a table decides)" in msg, msg  # (its kept dtype)


class WeightedHalf(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.EmbeddingBag(30, DIM, mode="sum", dtype=HALF)
        self.u = nn.EmbeddingBag(20, DIM, mode="sum", dtype=HALF)

    def forward(self, ids, offsets, psw):
        return torch.cat([self.w(ids, offsets, per_sample_weights=psw), self.u(ids % 20, offsets)], 1)


def _weighted_batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 30, (8,), generator=g), torch.tensor([0, 2, 5, 6]), torch.rand(8, generator=g).half()


def _train_weighted(rank, world, init_file, result_file):
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = WeightedHalf()
        ref = copy.deepcopy(model)
        plan = fxrec.plan(model, _weighted_batch(0), world_size=world, memory_per_rank="1GB",
                          pins={"w": ("table_wise", 0), "u": ("table_wise", 1)})
        fast = fxrec.transform(model, _weighted_batch(0), plan=plan)
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (fast, ref))
        for step in range(3):  # each rank its own batch; the plain model the two, rank 0's first
            xs = [_weighted_batch(10 * step + r + 1) for r in range(world)]
            whole = (torch.cat([x[0] for x in xs]), torch.cat([x[1] + 8 * r for r, x in enumerate(xs)]),
                     torch.cat([x[2] for x in xs]))
            want, got = ref(*whole), fast(*xs[rank])
            assert got.dtype == HALF and torch.equal(got, want[4 * rank:4 * (rank + 1)]), f"step {step}"
            ref_opt.zero_grad()
            want.float().square().sum().backward()
            ref_opt.step()
            opt.zero_grad()
            got.float().square().sum().backward()
            opt.step()
        for name, p in fast.named_parameters():
            assert torch.equal(p.detach(), ref.get_parameter(name).detach()), name
        ids, offsets, psw = _weighted_batch(9)
        try:  # fp32 weights on rank 1 alone: both ranks stop, rank 1 naming the feature
            fast(ids, offsets, psw.float() if rank == 1 else psw)
            msg = "no error"
        except (TypeError, ValueError) as e:
            msg = str(e)
        with open(f"{result_file}.{rank}", "w") as fh:
            fh.write(msg)
        dist.barrier()
    os._exit(0)


def test_weighted_bags_of_fp16_tables_sharded_take_fp16_weights_and_train_bit_for_bit(tmp_path):
    """(The input dist wanted float32 weights, which the plain fp16 model refuses.) A rank given
    fp32 weights names the feature, and the other rank stops with it."""
    spawn(_train_weighted, 2, str(tmp_path / "msg"))
    mine = (tmp_path / "msg.1").read_text()
    assert "feature 'ids' got per-sample weights of dtype torch.float32; they must be torch.float16" in mine, mine
    other = (tmp_path / "msg.0").read_text()
    assert "rank(s) [1] were fed input they reject" in other, other


def _quantized_on_one_rank(rank, world, init_file):
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = WeightedHalf().eval()
        x = _weighted_batch(0)
        plan = fxrec.plan(model, x, world_size=world, memory_per_rank="1GB",
                          pins={"w": ("table_wise", 0), "u": ("table_wise", 0)})
        fast = fxrec.transform(model, x, mode="inference", quantize="int8", plan=plan)
        single = fxrec.transform(copy.deepcopy(model), x, mode="inference", quantize="int8")
        with torch.no_grad():  # (every rank feeds the same batch)
            for seed in (1, 2):
                got, want = fast(*_weighted_batch(seed)), single(*_weighted_batch(seed))
                assert got.dtype == HALF and torch.equal(got, want), seed
        dist.barrier()
    os._exit(0)


def test_int8_serving_of_fp16_tables_when_a_rank_holds_none_of_a_group():
    """Rank 1 holds no table: its output dist expects the fp16 rows the owner sends (the owner's
    quantized group gave fp32 rows, and gloo aborted the process on the size mismatch)."""
    spawn(_quantized_on_one_rank, 2)


class HandPooled(nn.Module):
    """fp16 tables looked up as nn.Embedding: [B, L] ids pooled by hand (sum and mean), and one id
    a sample from a table of few rows (many ids repeat in a batch)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Embedding(30, DIM, dtype=HALF)
        self.b = nn.Embedding(30, DIM, dtype=HALF)
        self.c = nn.Embedding(5, DIM, dtype=HALF)

    def forward(self, x, y):
        return torch.cat([self.a(x).sum(1), self.b(x).mean(1), self.c(y)], 1)


def _hand_pooled(rank, world, init_file):
    with gloo_group(rank, world, init_file):
        def batch(step):
            g = torch.Generator().manual_seed(step)
            return torch.randint(0, 30, (LOCAL_B * world, 6), generator=g), torch.randint(0, 5, (LOCAL_B * world,), generator=g)

        mine = slice(rank * LOCAL_B, (rank + 1) * LOCAL_B)
        model = HandPooled()
        ref = copy.deepcopy(model)
        x, y = batch(0)
        plan = fxrec.plan(model, (x[mine], y[mine]), world_size=world, memory_per_rank="1GB", batch_size=LOCAL_B,
                          pins={"a": ("table_wise", 0), "b": ("table_wise", 1), "c": ("table_wise", 1)})
        fast = fxrec.transform(model, (x[mine], y[mine]), plan=plan)
        opt, ref_opt = torch.optim.SGD(fast.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
        for step in range(3):
            x, y = batch(step + 1)
            cot = torch.randn(LOCAL_B * world, 3 * DIM, generator=torch.Generator().manual_seed(100 + step))
            want, got = ref(x, y), fast(x[mine], y[mine])
            assert torch.equal(got, want[mine]), f"step {step}"
            for o, out, c in ((ref_opt, want, cot), (opt, got, cot[mine])):
                o.zero_grad()
                (out.float() * c).sum().backward()
                o.step()
        for name, p in fast.named_parameters():
            assert torch.equal(p.detach(), ref.get_parameter(name).detach()), \
                f"{name}: {(p.detach().float() - ref.get_parameter(name).detach().float()).abs().max()}"
        dist.barrier()
    os._exit(0)


def test_fp16_tables_looked_up_by_nn_embedding_and_pooled_by_hand_train_bit_for_bit_sharded():
    """emb(x).sum(1), emb(x).mean(1) and emb(y) of fp16 tables sharded table-wise: the owner pooled
    them as bags, and embedding_bag's backward adds a row's fp16 gradients otherwise than
    embedding's (the table's gradient was one or two fp16 steps off in most batches; found by the
    differential fuzzer). The owner now runs the model's own lookups on the ids sent to it."""
    spawn(_hand_pooled, 2)


def _hand_pooled_int8(rank, world, init_file):
    with gloo_group(rank, world, init_file):
        g = torch.Generator().manual_seed(3)
        x, y = torch.randint(0, 30, (LOCAL_B * world, 6), generator=g), torch.randint(0, 5, (LOCAL_B * world,), generator=g)
        mine = slice(rank * LOCAL_B, (rank + 1) * LOCAL_B)
        plan = fxrec.plan(HandPooled(), (x[mine], y[mine]), world_size=world, memory_per_rank="1GB",
                          batch_size=LOCAL_B, pins={"a": ("table_wise", 0), "b": ("table_wise", 1), "c": ("table_wise", 1)})
        fast = fxrec.transform(HandPooled(), (x[mine], y[mine]), plan=plan, mode="inference", quantize="int8")
        with torch.no_grad():
            got = fast(x[mine], y[mine])
        torch.save(got, os.path.join(os.path.dirname(init_file), f"fxrec_hand_int8.{rank}.{os.getppid()}"))
        dist.barrier()
    os._exit(0)


def test_fp16_tables_looked_up_by_nn_embedding_serve_quantized_sharded_as_in_one_process():
    """The same lookups served int8 under a plan: quantized pieces stay bags (the lookups kept as the
    model wrote them are the trained fp16 tables'; the owner's packing of quantized [B, L] ids sent
    flat raised IndexError)."""
    import tempfile

    spawn(_hand_pooled_int8, 2)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 30, (LOCAL_B * 2, 6), generator=g), torch.randint(0, 5, (LOCAL_B * 2,), generator=g)
    one = fxrec.transform(HandPooled(), (x, y), mode="inference", quantize="int8")
    with torch.no_grad():
        want = one(x, y)
    for rank in range(2):
        path = os.path.join(tempfile.gettempdir(), f"fxrec_hand_int8.{rank}.{os.getpid()}")
        got = torch.load(path)
        os.remove(path)
        torch.testing.assert_close(got, want[rank * LOCAL_B:(rank + 1) * LOCAL_B], msg=f"rank {rank}")


def _hand_pooled_eval(rank, world, init_file):
    with gloo_group(rank, world, init_file):
        g = torch.Generator().manual_seed(4)
        x, y = torch.randint(0, 30, (LOCAL_B * world, 6), generator=g), torch.randint(0, 5, (LOCAL_B * world,), generator=g)
        mine = slice(rank * LOCAL_B, (rank + 1) * LOCAL_B)
        plan = fxrec.plan(HandPooled(), (x[mine], y[mine]), world_size=world, memory_per_rank="1GB",
                          batch_size=LOCAL_B, pins={"a": ("table_wise", 0), "b": ("table_wise", 1), "c": ("table_wise", 1)})
        # backend="fbgemm": the inference kernel CUDA's rule puts first, here on CPU
        fast = fxrec.transform(HandPooled(), (x[mine], y[mine]), plan=plan, backend="fbgemm").eval()
        with torch.no_grad():
            got = fast(x[mine], y[mine])
        assert torch.equal(got, HandPooled()(x, y)[mine])
        dist.barrier()
    os._exit(0)


def test_fp16_tables_looked_up_by_nn_embedding_sharded_give_the_plain_outputs_in_eval_on_fbgemm():
    """In eval the owner's group took fbgemm's kernel (CUDA's first for inference), whose packing
    cannot take [B, L] ids sent flat: IndexError on the owner, the other rank waiting (a regression
    of 5b7dfbb, found by the review). Groups with such lookups keep PyTorch's lookups in both modes."""
    spawn(_hand_pooled_eval, 2)
