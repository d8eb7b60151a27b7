"""fxrec.plan(..., device="cuda", hbm_budget=): memory_per_rank is a rank's GPU and host memory
together; each rank's shards beyond the budget go to unified memory by the rule transform applies
on each rank, and their est. cost counts the reads that miss the HBM cache. The bytes and
milliseconds expected here are written out from the definitions (fbgemm's cache: sets of 32 rows
at the cached width with two int64 states a row, and an int32 a table row)."""

import json

import pytest
import torch

import fxrec
from fxrec.planner import PlanError, ShardingPlan, TableSpec
from fxrec.pass_infra import InputError
from fxrec.planner.cost import CostModel
from tests.passes.test_place_shards import PINS, SGD, rank_notes
from tests.passes.test_place_tables import INPUTS, cache_hbm, meta_model

MB = 10**6
# big 1M x 64 on rank 0, small 1000 x 64 on rank 1, both table-wise, batch 512 a rank, one id a sample
TABLES = [TableSpec("big", 1_000_000, 64), TableSpec("small", 1000, 64)]
PINNED = {"big": ("table_wise", 0), "small": ("table_wise", 1)}


def plan_of(optimizer="sgd", **kw):
    return fxrec.plan(tables=TABLES, world_size=2, memory_per_rank="1GB", device="cuda", pins=PINNED,
                      optimizer=optimizer, batch_size=512, memory_bandwidth=1000, **kw)


def test_a_shard_beyond_the_budget_goes_to_unified_memory_and_costs_its_cache_misses():
    without, plan = plan_of(), plan_of(hbm_budget="100MB")
    # big (256 MB, fused SGD: no state) leaves; its cache: 200k rows of 64 fp32 values and two int64
    # states, and an int32 for each of its 1M rows
    cache = 200_000 * (64 * 4 + 16) + 1_000_000 * 4
    assert cache == cache_hbm(1_000_000, 64) == 58_400_000
    assert plan.unified_memory() == [({"big": "managed_caching"}, cache), ({}, 1000 * 64 * 4)]
    # memory_per_rank counts the rows wherever they are
    assert plan.rank_bytes() == without.rank_bytes() == [1_000_000 * 64 * 4, 1000 * 64 * 4]
    # 1024 ids a step (2 ranks x 512, one each), 80 % missing the cache, 3 x 64 x 4 bytes each,
    # at 50 GB/s (the default, noted) instead of 1000
    extra = 1024 * 0.8 * (3 * 64 * 4) * (1 / 50e6 - 1 / 1000e6)
    assert plan["big"].cost_ms == pytest.approx(without["big"].cost_ms + extra, rel=1e-12)
    assert plan["small"].cost_ms == without["small"].cost_ms
    text = str(plan)
    assert "58.4 MB / 100 MB" in text and "| big" in text, text
    assert "uvm_bandwidth 50 GB/s (reads of unified memory over the bus; cuda default)" in text


def test_a_slower_bus_or_a_larger_cache_changes_the_cost_by_the_formula():
    without = plan_of()["big"].cost_ms
    for lf, uvm in ((0.5, 50), (0.2, 25)):
        plan = plan_of(hbm_budget="200MB", cache_load_factor=lf, uvm_bandwidth=uvm)
        extra = 1024 * (1 - lf) * (3 * 64 * 4) * (1 / (uvm * 1e6) - 1 / 1000e6)
        assert plan["big"].cost_ms == pytest.approx(without + extra, rel=1e-12)
        assert not any("uvm_bandwidth" in a for a in plan.topology.assumed)
    # Adagrad's state (4 bytes a value) is in unified memory too, uncached: read and written per id
    plan = plan_of("adagrad", hbm_budget="300MB")
    assert plan.unified_memory()[0][0] == {"big": "managed_caching"}
    extra = 1024 * (0.8 * 3 * 64 * 4 + 2 * 4 * 64) * (1 / 50e6 - 1 / 1000e6)
    assert plan["big"].cost_ms == pytest.approx(plan_of("adagrad")["big"].cost_ms + extra, rel=1e-12)


def test_row_wise_adagrads_state_stays_in_gpu_memory_and_the_rows_move():
    plan = plan_of("rowwise_adagrad", hbm_budget="100MB")
    # the state (4 bytes a row) stays in HBM beside the cache, and crosses no bus
    assert plan.unified_memory()[0] == ({"big": "managed_caching"}, cache_hbm(1_000_000, 64) + 1_000_000 * 4)
    extra = 1024 * 0.8 * (3 * 64 * 4) * (1 / 50e6 - 1 / 1000e6)
    assert plan["big"].cost_ms == pytest.approx(plan_of("rowwise_adagrad")["big"].cost_ms + extra, rel=1e-12)


def test_a_rank_whose_tables_cannot_meet_the_budget_is_named():
    # without a fused optimizer big keeps its dense gradient and stays: 512 MB on rank 0
    with pytest.raises(PlanError, match=r"^fxrec.plan: rank 0's tables need 512 MB of GPU memory .* more than "
                                        r"hbm_budget=100 MB; what stays in GPU memory: \['big'\]") as e:
        plan_of("none", hbm_budget="100MB")
    assert e.value.needed_bytes == 512 * MB and e.value.free_bytes == 100 * MB
    # a data-parallel table is whole on every rank, with its gradient
    with pytest.raises(PlanError, match=r"rank 0's tables need .* what stays in GPU memory: \['big'\]"):
        fxrec.plan(tables=TABLES, world_size=2, memory_per_rank="1GB", device="cuda", optimizer="sgd",
                   pins={"big": "data_parallel"}, hbm_budget="100MB")


def test_the_search_keeps_a_layout_that_meets_the_budget():
    """Six 1M x 64 tables without a fused optimizer (512 MB each with its gradient: nothing may
    move) on 4 ranks: whole, two ranks hold two (1024 MB); a budget of 800 MB takes the layout
    that splits them (768 MB a rank)."""
    tables = [TableSpec(f"t{i}", 1_000_000, 64) for i in range(6)]
    kw = dict(tables=tables, world_size=4, memory_per_rank="2GB", device="cuda", batch_size=512, optimizer="none",
              sharding_types=["table_wise", "row_wise"], memory_bandwidth=1000)
    assert {tp.sharding for tp in fxrec.plan(**kw).tables.values()} == {"table_wise"}
    plan = fxrec.plan(**kw, hbm_budget="800MB")
    assert {tp.sharding for tp in plan.tables.values()} == {"row_wise"}
    assert plan.unified_memory() == [({}, 6 * 250_000 * 64 * 8)] * 4
    with pytest.raises(PlanError, match="rank 0's tables need"):
        fxrec.plan(**kw, hbm_budget="700MB")
    with pytest.raises(PlanError, match=r"rank 0's tables need 140 MB .*hbm_budget=100 MB; the HBM caches alone take"):
        plan_of(hbm_budget="100MB", cache_load_factor=0.5)  # big's cache: 500k x 272 + 1M x 4 bytes


def test_the_search_weighs_what_the_misses_cost():
    """Tables of 1M..6M x 128 with fused row-wise Adagrad: the whole-table layout chosen without a
    budget puts a table in unified memory on three ranks, where all its ids miss at the bus's speed;
    with the budget, the search keeps a layout whose busiest rank costs less than that one would."""
    tables = [TableSpec(f"t{i}", 1_000_000 * (i + 1), 128, pooling_factor=4) for i in range(6)]
    kw = dict(tables=tables, world_size=4, memory_per_rank="16GB", device="cuda", optimizer="rowwise_adagrad",
              batch_size=4096, memory_bandwidth=1000)
    whole = fxrec.plan(**kw)
    pins = {n: ("table_wise", tp.shards[0].rank) for n, tp in whole.tables.items()}
    assert {tp.sharding for tp in whole.tables.values()} == {"table_wise"}
    pinned = fxrec.plan(**kw, pins=pins, hbm_budget="2GB")
    assert sum(len(where) for where, _ in pinned.unified_memory()) == 3
    plan = fxrec.plan(**kw, hbm_budget="2GB")
    assert plan.max_cost_ms < pinned.max_cost_ms
    assert all(need <= 2 * 10**9 for _, need in plan.unified_memory())


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="hbm_budget= is the GPU memory of a rank's tables: it needs device='cuda'"):
        fxrec.plan(tables=TABLES, world_size=2, memory_per_rank="1GB", hbm_budget="1GB")
    with pytest.raises(ValueError, match="with hbm_budget=, memory_per_rank is what a rank holds in all"):
        fxrec.plan(tables=TABLES, world_size=2, device="cuda", hbm_budget="1GB", memory_bandwidth=1000)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="cache_load_factor must be a number in"):
            plan_of(hbm_budget="1GB", cache_load_factor=bad)
    with pytest.raises(ValueError, match="uvm_bandwidth must be a positive number"):
        plan_of(hbm_budget="1GB", uvm_bandwidth=-1)
    with pytest.raises(ValueError, match=r"pass either topology= or \['hbm_budget'\], not both"):
        fxrec.plan(tables=TABLES, topology=plan_of().topology, hbm_budget="1GB")
    for kw in (dict(cache_load_factor=0.5), dict(uvm_bandwidth=10)):
        with pytest.raises(ValueError, match="cache_load_factor and uvm_bandwidth are for a plan with hbm_budget="):
            plan_of(**kw)


def test_a_plan_with_a_budget_round_trips_and_an_older_file_has_none():
    plan = plan_of(hbm_budget="200MB", cache_load_factor=0.5)
    back = ShardingPlan.from_json(plan.to_json())
    assert back.topology == plan.topology and back.unified_memory() == plan.unified_memory()
    assert back.to_json() == plan.to_json()
    old = json.loads(plan_of().to_json())
    # a plan without a budget is written as before the budget was: an older fxrec reads it
    assert not {"hbm_budget", "cache_load_factor", "uvm_bandwidth"} & set(old["topology"])
    older = ShardingPlan.from_dict(old)
    assert older.topology.hbm_budget is None and older.unified_memory() == []


def test_transform_takes_the_plans_budget_and_places_as_the_plan_says():
    """The model of tests/passes/test_place_shards.py: the planner's placements on each rank are
    what explain(plan=) gives for CUDA, without a budget passed to it; one passed wins."""
    plan = fxrec.plan(meta_model(), INPUTS, world_size=2, memory_per_rank="2GB", device="cuda", pins=PINS,
                      optimizer=SGD, hbm_budget="300MB", memory_bandwidth=1000)
    assert [sorted(where) for where, _ in plan.unified_memory()] == [[], ["big"]]
    r = fxrec.explain(meta_model(), INPUTS, device="cuda", plan=plan, optimizer=SGD)
    assert rank_notes(r) == {0: "group_0: device",
                             1: "group_0: device+managed_caching (big: managed_caching; HBM cache 0.2 of the cached rows)"}
    for rank, (_, need) in enumerate(plan.unified_memory()):
        text = next(n for n in r.notes if n.startswith(f"rank {rank} under hbm_budget=300 MB"))
        assert f"take {fxrec.planner.format_bytes(need)} of" in text, text
    r = fxrec.explain(meta_model(), INPUTS, device="cuda", plan=plan, optimizer=SGD, hbm_budget="1GB")
    assert rank_notes(r) == {0: "group_0: device", 1: "group_0: device"}
    r = fxrec.explain(meta_model(), INPUTS, device="cuda", plan=plan, optimizer=SGD, cache_load_factor=0.5)
    assert "HBM cache 0.5 of the cached rows" in rank_notes(r)[1]


def test_cost_model_ids_a_shard_looks_up():
    cm = CostModel(plan_of().topology, 512)
    spec = TableSpec("t", 1000, 8, pooling_factor=3)
    assert cm.ids(spec, "table_wise", 1000) == cm.ids(spec, "column_wise", 1000) == 2 * 512 * 3
    assert cm.ids(spec, "row_wise", 250) == 2 * 512 * 3 / 4
    assert cm.ids(spec, "data_parallel", 1000) == 512 * 3


class _Two(torch.nn.Module):
    def __init__(self, dim_b=128):
        super().__init__()
        self.a = torch.nn.EmbeddingBag(1_000_000, 128, mode="sum")
        self.b = torch.nn.EmbeddingBag(1_000_000 if dim_b <= 1024 else 100_000, dim_b, mode="sum")

    def forward(self, a, b):
        return self.a(a) .sum() + self.b(b).sum()


@pytest.mark.parametrize("case", ["fp16_and_fp32", "wide_sgd", "wide_adagrad"])
def test_a_rank_with_tables_of_two_kinds_is_counted_as_transform_counts_it(case):
    """One rank's pieces in TBEs of different precisions have a cache each (the plan counted the fp32
    table's cache at 2 bytes a value: 116.8 MB where transform needs 168 MB); a piece wider than
    fbgemm's CUDA kernels runs on PyTorch's lookups, which fuse SGD there and nothing else (found
    by the review). The plan's figures are transform's, and a budget between them is refused by both."""
    with torch.device("meta"):
        model = _Two(1030 if case.startswith("wide") else 128)
    x = (torch.randint(0, 1000, (8, 3)), torch.randint(0, 1000, (8, 3)))
    opt = fxrec.optim.Adagrad(lr=0.1) if case == "wide_adagrad" else SGD
    wp = {"a": "fp16"} if case == "fp16_and_fp32" else None
    kw = dict(world_size=2, memory_per_rank="10GB", device="cuda", pins={"a": ("table_wise", 0), "b": ("table_wise", 0)},
              optimizer=opt, weights_precision=wp, memory_bandwidth=1000)
    for budget in ("150MB", "700MB"):
        try:
            plan = fxrec.plan(model, x, **kw, hbm_budget=budget)
        except PlanError as e:
            with pytest.raises(InputError, match="rank 0's embedding tables need"):
                fxrec.explain(model, x, device="cuda", plan=fxrec.plan(model, x, **kw), optimizer=opt,
                              weights_precision=wp, hbm_budget=budget)
            assert e.needed_bytes > 10**6
            continue
        r = fxrec.explain(model, x, device="cuda", plan=plan, optimizer=opt, weights_precision=wp)
        text = next(n for n in r.notes if n.startswith("rank 0 under hbm_budget="))
        where, need = plan.unified_memory()[0]
        assert f"take {fxrec.planner.format_bytes(need)} of" in text, (text, need)
        assert all(f"{t}: managed_caching" in text for t in where), (text, where)
