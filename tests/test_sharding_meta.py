"""Models built on the meta device, transformed with a plan: each rank allocates only what it
holds (checked in bytes, and by the peak memory of a rank that does not own a 1 GB table),
initialised by the tables' own reset_parameters, the whole tensors equal on every rank, and
after ``fxrec.checkpoint.load`` the model trains exactly as the plain model."""

import os
import resource

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fxrec

from tests import models as M

from .test_sharding import LOCAL_B, Model, global_batch, gloo_group, local_batch, spawn

PINS = {"bags.0": ("table_wise", 1), "bags.1": "row_wise", "bags.2": {"sharding": "column_wise", "ranks": [1, 0]},
        "single": "data_parallel"}


def _held_bytes(fast: nn.Module) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in list(fast.parameters()) + list(fast.buffers())}
    return sum(storages.values())


def _worker(rank, world, init_file, ckpt):
    with gloo_group(rank, world, init_file):
        torch.manual_seed(rank)  # every rank draws other numbers: the whole tensors must still agree
        with torch.device("meta"):
            model = Model()
        example = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)
        plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins=PINS)
        fast = fxrec.transform(model, example, plan=plan)
        assert all(p.is_meta for p in model.parameters())  # the user's model is untouched
        params = dict(fast.named_parameters())
        # this rank holds its shards and the whole tensors, and nothing else
        want = 0
        for t, tp in plan.tables.items():
            for sh in tp.shards:
                if sh.rank == rank or tp.sharding == "data_parallel":
                    want += sh.num_rows * sh.num_cols * 4
                    break
        want += sum(p.numel() * 4 for n, p in fast.named_parameters() if n.startswith("top."))
        assert _held_bytes(fast) == want, (_held_bytes(fast), want)
        # the tables' own initialiser ran on the shards (nn.EmbeddingBag: normal_)
        for name, p in params.items():
            if name.startswith("bags.") and p.numel() >= 100:
                assert 0.7 < float(p.detach().std()) < 1.3, (name, float(p.detach().std()))
        # the tensors whole on every rank are the same on every rank
        for name in ("top.weight", "top.bias", "single.weight"):
            gathered = [torch.empty_like(params[name]) for _ in range(world)]
            dist.all_gather(gathered, params[name].detach().contiguous())
            assert all(torch.equal(g, gathered[0]) for g in gathered), name
        # trained values from the single-process model's checkpoint: then exactly the plain model
        fxrec.checkpoint.load(fast, ckpt)
        torch.manual_seed(0)
        ref = Model()
        opt, ref_opt = torch.optim.SGD(fast.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)
        for step in range(3):
            x = global_batch(LOCAL_B * world, step + 1)
            want_out = ref(*x)
            got = fast(*local_batch(x, rank, LOCAL_B))
            torch.testing.assert_close(got, want_out[rank * LOCAL_B:(rank + 1) * LOCAL_B], msg=f"step {step}")
            for o, loss in ((ref_opt, want_out.sum()), (opt, got.sum())):
                o.zero_grad()
                loss.backward()
                o.step()
        dist.barrier()
    os._exit(0)


def test_a_meta_model_allocates_only_its_shards_and_trains_after_loading_a_checkpoint(tmp_path):
    torch.manual_seed(0)
    fxrec.checkpoint.save_model(Model(), tmp_path / "ckpt")
    spawn(_worker, 2, str(tmp_path / "ckpt"))



def _same_seed_worker(rank, world, init_file):
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)  # the same seed on every rank, as DDP training scripts do
        with torch.device("meta"):
            model = Model()
        example = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)
        plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins=PINS)
        fast = fxrec.transform(model, example, plan=plan)
        for name in ("bags.1.weight", "bags.2.weight"):  # row-wise, column-wise
            mine = fast.get_parameter(name).detach().clone()
            shards = [None] * world
            dist.all_gather_object(shards, mine)
            a, b = shards[0], shards[1]
            rows = min(a.shape[0], b.shape[0])
            assert not torch.equal(a[:rows], b[:rows]), f"{name}: rank 0's and rank 1's shards drew the same numbers"
        dist.barrier()
    os._exit(0)


def test_the_shards_of_a_meta_table_draw_other_numbers_on_each_rank_seeded_alike():
    """Every rank seeded alike (DDP's practice) initialised each rank's row block and column shard
    with the same numbers: rows 0-4 of the table repeated rows 5-9."""
    spawn(_same_seed_worker, 2)

class _Big(nn.Module):
    def __init__(self):
        super().__init__()
        self.big = nn.EmbeddingBag(8_000_000, 32, mode="sum")  # 1 GB
        self.small = nn.EmbeddingBag(100, 32, mode="sum")
        self.top = nn.Linear(64, 1)

    def forward(self, a, ao, b, bo):
        return self.top(torch.cat([self.big(a, ao), self.small(b, bo)], 1))


def _big_worker(rank, world, init_file, on_meta, fp16=False):
    with gloo_group(rank, world, init_file, 300):
        with torch.device("meta" if on_meta else "cpu"):
            model = _Big()
        ex = (torch.tensor([1, 7_999_999]), torch.tensor([0, 1]), torch.tensor([3, 4]), torch.tensor([0, 1]))
        stored = {"weights_precision": "fp16"} if fp16 else {}
        plan = fxrec.plan(model, ex, world_size=world, memory_per_rank="4GB",
                          pins={"big": ("table_wise", 1), "small": ("table_wise", 0)}, **stored)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if fp16:  # stored in fp16 by its fused TBE: made in fp16 (512 MB), copied once into the TBE
            fast = fxrec.transform(model, ex, plan=plan, optimizer=fxrec.optim.SGD(lr=0.1), **stored)
            out = fast(*ex)
            out.sum().backward()
            grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
            if rank == 0:
                assert grown < 300 * 2**20, f"rank 0's peak memory grew by {grown / 2**20:.0f} MB"
            else:  # never the 1 GB of fp32 rows: the fp16 table and, while it is copied, the TBE's
                assert fast.get_parameter("big.weight").dtype == torch.float16
                assert grown < 2**30 + 300 * 2**20, f"rank 1's peak memory grew by {grown / 2**20:.0f} MB"
        else:
            fast = fxrec.transform(model, ex, plan=plan)
            out = fast(*ex)
            grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
            out.sum().backward()  # (the owner's unfused table then gets its dense gradient: 1 GB more)
            if rank == 0:
                grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
            if rank == 0:  # never holds the 1 GB table, not even for a moment
                assert "big.weight" not in dict(fast.named_parameters())
                assert grown < 300 * 2**20, f"rank 0's peak memory grew by {grown / 2**20:.0f} MB"
            else:  # holds it once: the model's own table (real) is not copied a second time
                assert fast.get_parameter("big.weight").shape == (8_000_000, 32)
                assert grown < 2**30 + 300 * 2**20, f"rank 1's peak memory grew by {grown / 2**20:.0f} MB"
                if not on_meta:
                    torch.testing.assert_close(fast.get_parameter("big.weight")[::100_000].detach(),
                                               model.big.weight[::100_000].detach(), rtol=0, atol=0)
        dist.barrier()
    os._exit(0)


@pytest.mark.parametrize("on_meta", [True, False], ids=["meta", "real"])
def test_a_rank_allocates_a_table_only_if_it_owns_it_and_only_once(on_meta):
    """A 1 GB table planned table-wise on rank 1: rank 0's peak memory does not grow by it during
    transform and a step (a meta model: it never exists there; a real one: the model's table is
    never copied), rank 1's grows by at most one copy by transform and forward."""
    spawn(_big_worker, 2, on_meta)


def test_a_meta_table_stored_in_fp16_is_never_made_in_fp32():
    """The same table on meta with weights_precision="fp16": rank 1 makes it in fp16 and copies it
    into its TBE (2 x 512 MB at the peak; made in fp32 first it would be 1 GB + 512 MB)."""
    spawn(_big_worker, 2, True, True)


def test_a_meta_model_without_a_plan_is_refused():
    with torch.device("meta"):
        model = Model()
    example = global_batch(LOCAL_B, 0)
    with pytest.raises(ValueError, match="meta device.*plan="):
        fxrec.transform(model, example)


def test_a_meta_tensor_whose_module_cannot_initialise_it_is_refused_naming_it():
    from fxrec.materialize import materialize, with_placeholders

    class Raw(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(torch.empty(10, 4, device="meta"))

    model = Raw()
    work = with_placeholders(model, torch.device("cpu"))
    assert work.table.untyped_storage().nbytes() == 4  # a placeholder: one element
    with pytest.raises(ValueError, match=r"\['table'\].*meta device.*reset_parameters"):
        materialize(work, model, {}, {})


class _Scaled(nn.Module):
    writes = ()

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(10, 4)
        self.register_buffer("scale", torch.empty(4))
        self.register_buffer("count", torch.empty(2, dtype=torch.long))
        self.register_buffer("flags", torch.empty(3, dtype=torch.uint8))

    def reset_parameters(self):
        if "scale" in self.writes:
            self.scale.fill_(2.0)
        if "count" in self.writes:
            self.count.fill_(torch.iinfo(torch.long).min)  # (written: the value fxrec fills with)
        self.flags.zero_()  # (written: uint8's lowest value)


class _BiasOnly(nn.Linear):
    def reset_parameters(self):
        nn.init.zeros_(self.bias)


class _TiedHead(nn.Module):
    """An output layer tied to the table, whose own reset_parameters writes its bias only."""

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(10, 4)
        self.head = _BiasOnly(4, 10)
        self.head.weight = self.emb.weight


class _Replaces(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(3))

    def reset_parameters(self):
        self.w = nn.Parameter(torch.ones(3))


def test_a_meta_tensor_its_modules_reset_parameters_leaves_unwritten_is_refused_naming_it():
    """(Such a buffer kept the allocation's leftover memory, then rank 0's broadcast: no error.)
    Values a module writes that are the ones fxrec fills with are written (a second run tells),
    a tensor tied to another module's is written by either, and a reset_parameters() that puts
    a new tensor in place of the one it is given is refused saying so."""
    from fxrec.materialize import materialize, with_placeholders

    def run(model):
        work = with_placeholders(model, torch.device("cpu"))
        materialize(work, model, {}, {})
        return work

    for writes, left in (((), r"\['scale', 'count'\]"), (("count",), r"\['scale'\]"), (("scale",), r"\['count'\]")):
        with torch.device("meta"):
            model = _Scaled()
        model.writes = writes
        with pytest.raises(ValueError, match=left + r" are on the meta device.*\['_Scaled'\] does not write"):
            run(model)
    model.writes = ("scale", "count")
    work = run(model)
    assert torch.equal(work.scale, torch.full((4,), 2.0)) and torch.equal(work.flags, torch.zeros(3, dtype=torch.uint8))
    assert torch.equal(work.count, torch.full((2,), torch.iinfo(torch.long).min))
    assert torch.isfinite(work.emb.weight).all()  # (its own module's reset_parameters wrote it)
    with torch.device("meta"):
        tied = _TiedHead()
    work = run(tied)
    assert work.head.weight is work.emb.weight and torch.isfinite(work.emb.weight).all()
    assert torch.equal(work.head.bias, torch.zeros(10))
    with torch.device("meta"):
        replaces = _Replaces()
    with pytest.raises(ValueError, match=r"\['w'\].*puts new tensors in their place instead of writing them"):
        run(replaces)


def test_the_check_for_unwritten_values_reads_every_chunk():
    from fxrec.materialize import _holds

    t = torch.zeros(10)
    assert not _holds(t, float("nan"), chunk=3)
    t[9] = float("nan")  # (in the last, short chunk)
    assert _holds(t, float("nan"), chunk=3) and _holds(t, 0.0, chunk=3)
    assert _holds(torch.tensor([5, 6, 7, -1]), -1, chunk=3) and not _holds(torch.tensor([], dtype=torch.long), -1)


class _OneRankFails(nn.Module):
    def __init__(self):
        super().__init__()
        self.t = nn.EmbeddingBag(10, 4, mode="sum")
        self.register_buffer("scale", torch.empty(4))

    def forward(self, ids, offsets):
        return self.t(ids, offsets) * self.scale

    def reset_parameters(self):
        if dist.get_rank() == 0:
            self.scale.fill_(1.0)


def _one_rank_fails(rank, world, init_file, out):
    with gloo_group(rank, world, init_file):
        with torch.device("meta"):
            model = _OneRankFails()
        x = (torch.randint(0, 10, (8,)), torch.arange(0, 8, 2))
        plan = fxrec.plan(model, x, world_size=world, memory_per_rank="1GB", pins={"t": "row_wise"})
        try:
            fxrec.transform(model, x, plan=plan)
            msg = "no error"
        except ValueError as e:
            msg = str(e)
        with open(f"{out}.{rank}", "w") as fh:
            fh.write(msg)
        dist.barrier()
    os._exit(0)


def test_a_meta_tensor_left_unwritten_on_one_rank_stops_every_rank(tmp_path):
    """The refusal came on one rank only, and the other waited for it in the broadcast."""
    out = str(tmp_path / "msg")
    spawn(_one_rank_fails, 2, out)
    mine, other = (open(f"{out}.{r}").read() for r in (1, 0))
    assert "['scale'] are on the meta device" in mine, mine
    assert "initialising the meta tensors failed on rank(s) [1]" in other, other


def test_a_meta_model_is_explained_as_a_real_one():
    torch.manual_seed(0)
    real = Model()
    with torch.device("meta"):
        model = Model()
    example = global_batch(LOCAL_B, 0)
    a, b = fxrec.explain(model, example), fxrec.explain(real, example)
    assert [(g.name, g.kernel_train, g.tables) for g in a.groups] == [(g.name, g.kernel_train, g.tables) for g in b.groups]


def test_explain_with_a_plan_describes_the_device_asked_for_and_where_the_optimizer_runs():
    """(It gave the tables' device, cpu, and no optimizer, under notes saying "explained for cuda".)"""
    model = M.BagList(rows=(50, 40, 30))
    x = M.bag_inputs(rows=(50, 40, 30))
    plan = fxrec.plan(model, x, world_size=2, memory_per_rank="1GB", device="cuda", memory_bandwidth=1e12,
                      pins={"bags.0": "row_wise", "bags.1": "table_wise", "bags.2": "table_wise"})
    for opt, fused in ((fxrec.optim.LazyAdam(lr=0.1), "adam"), (fxrec.optim.SGD(lr=0.1, momentum=0.9), "")):
        report = fxrec.explain(model, x, device="cuda", plan=plan, optimizer=opt)
        (group,) = [g for g in report.groups if g.lowered]
        assert (group.device, group.placement, group.fused) == ("cuda", "device", fused)
        assert group.optimizer.endswith("fused into backward" if fused else "torch.optim in opt.step()")


def test_explain_with_a_plan_fuses_nothing_for_data_parallel_tables():
    """(It said "fused into backward" where transform(plan=) steps them with torch.optim.)"""
    model = M.BagList(rows=(50, 40, 30))
    x = M.bag_inputs(rows=(50, 40, 30))
    plan = fxrec.plan(model, x, world_size=2, memory_per_rank="1GB",
                      pins={t: "data_parallel" for t in ("bags.0", "bags.1", "bags.2")})
    report = fxrec.explain(model, x, plan=plan, optimizer=fxrec.optim.SGD(lr=0.1))
    assert [(g.fused, g.optimizer.endswith("torch.optim in opt.step()")) for g in report.groups] == [("", True)]
