"""fxrec.plan(quantize=...): plans for serving, shards sized as fbgemm's IntNBit kernel packs them,
laid out only as quantized serving runs them, and taken by transform only as planned."""

import json

import pytest
import torch

import fxrec
from fxrec.planner import TableSpec

from . import models as M


def _plan(specs, **kw):
    kw.setdefault("world_size", 2)
    kw.setdefault("memory_per_rank", "1GB")
    return fxrec.plan(tables=specs, **kw)


def _bytes_of(plan, table):
    return sum(s.bytes for s in plan[table].shards)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_shards_are_sized_as_packed_rows_with_no_optimizer_state_or_gradient(device):
    """Bytes a row, written out from fbgemm's IntNBit row layout (the dim rounded up to what the
    dtype needs, 1/2/4/8 bits or 2/4 bytes a value, an fp16 scale and bias of 4 bytes for the
    integer dtypes, the row rounded up to 16 bytes on CUDA)."""
    specs = [TableSpec("a", 100, 16, quantize="int8"), TableSpec("b", 100, 13, quantize="int4"),
             TableSpec("c", 100, 10, quantize="fp16"), TableSpec("d", 100, 8, quantize="fp32"),
             TableSpec("e", 100, 30, quantize="int2")]
    pins = {n: ("table_wise", 0) for n in "abcde"}
    plan = _plan(specs, pins=pins, device=device, memory_per_rank="1MB")
    cpu = {"a": 16 + 4, "b": 16 // 2 + 4, "c": 10 * 2, "d": 8 * 4, "e": 32 // 4 + 4}
    cuda = {"a": 32, "b": 16, "c": 32, "d": 32, "e": 16}
    want = cpu if device == "cpu" else cuda
    assert {n: _bytes_of(plan, n) for n in "abcde"} == {n: 100 * b for n, b in want.items()}
    assert plan.serving
    # the same tables for training: fp32 rows and, with no fused optimizer, a dense gradient
    train = _plan([TableSpec(s.name, s.num_rows, s.dim) for s in specs], pins=pins, device=device,
                  memory_per_rank="1MB")
    assert not train.serving
    if device == "cpu":
        assert _bytes_of(train, "a") == 100 * 16 * 4 * 2


def test_unpooled_tables_are_sized_at_the_width_of_the_group_they_may_share():
    """fbgemm stores a sequence group's tables at its widest stored width; the planner sized each
    table alone and under-counted (fp32 dims 7 and 8: 28000 + 32000 bytes planned, 64000 held;
    int8 beside int2: the int8 rows stored 16 wide). Pooled tables are stored each at its own."""
    pins = {n: ("table_wise", 0) for n in "abcd"}
    plan = _plan([TableSpec("a", 1000, 7, pooled=False, quantize="fp32"), TableSpec("b", 1000, 8, pooled=False, quantize="fp32"),
                  TableSpec("c", 1000, 7, quantize="fp32"), TableSpec("d", 1000, 12, pooled=False, quantize="fp32")], pins=pins)
    # a and b round up to 8 columns (one group: 8 wide), c is pooled (7 wide), d rounds up to 12 (its own group)
    assert [_bytes_of(plan, n) for n in "abcd"] == [32000, 32000, 28000, 48000]
    plan = _plan([TableSpec("a", 1000, 8, pooled=False, quantize="int8"), TableSpec("b", 1000, 8, pooled=False, quantize="int2")],
                 pins={"a": ("table_wise", 0), "b": ("table_wise", 0)})
    assert [_bytes_of(plan, n) for n in "ab"] == [1000 * (16 + 4), 1000 * (16 // 4 + 4)]


def test_the_models_fp16_tables_kept_fp16_are_its_lookups_not_packed_rows():
    """quantize_tables leaves a group of the model's fp16 tables, all kept fp16, as the model's
    lookups (their rows: 2 bytes a value; fbgemm's TBE holds them only at dims a multiple of 4,
    unpadded); packed fp16 rows were counted (16-byte rows on CUDA: twice the bytes at dim 4), and
    then dims rounded up to 4 (a serving fuzz: dim 1 planned 1200 bytes, 300 held). Where one is
    quantized, its group is fbgemm's IntNBit TBE: packed."""
    kept = _plan([TableSpec("h", 1000, 4, dtype="fp16", quantize="fp16"), TableSpec("k", 1000, 5, dtype="fp16", quantize="fp16")],
                 pins={"h": ("table_wise", 0), "k": ("table_wise", 0)}, device="cuda")
    assert [_bytes_of(kept, n) for n in "hk"] == [1000 * 4 * 2, 1000 * 5 * 2]
    mixed = _plan([TableSpec("h", 1000, 4, dtype="fp16", quantize="fp16"), TableSpec("k", 1000, 5, dtype="fp16", quantize="int8")],
                  pins={"h": ("table_wise", 0), "k": ("table_wise", 0)}, device="cuda")
    assert [_bytes_of(mixed, n) for n in "hk"] == [1000 * 16, 1000 * 16]


def test_a_row_wise_served_table_is_cut_in_packed_row_blocks():
    plan = _plan([TableSpec("a", 101, 16, quantize="int8")], pins={"a": "row_wise"})
    assert [(s.num_rows, s.bytes) for s in plan["a"].shards] == [(51, 51 * 20), (50, 50 * 20)]


def test_the_packed_sizes_are_what_transform_stores():
    """On CPU, the plan's table-wise bytes equal the report's bytes of the model transformed for
    serving with the same quantize= (its packed buffers)."""
    model, x = M.BagList(rows=(300, 200, 100), dim=13), M.bag_inputs(rows=(300, 200, 100))
    quantize = {"bags.0": "int8", "bags.1": "int4", "*": "fp16"}
    plan = fxrec.plan(model, x, world_size=2, memory_per_rank="1GB", quantize=quantize,
                      pins={f"bags.{i}": ("table_wise", 0) for i in range(3)})
    fast = fxrec.transform(model.eval(), x, mode="inference", quantize=quantize)
    stored = {t["name"]: (t["dtype"], t["bytes"]) for t in fast.report.tables}
    assert {n: (plan[n].spec.quantize, _bytes_of(plan, n)) for n in plan.tables} == stored
    # the model's own fp16 tables, kept fp16: its lookups, the rows as they are (dims 13 and 8)
    half = M.BagList(rows=(300, 200), dim=13)
    half.bags[0].half()
    half.bags[1] = torch.nn.EmbeddingBag(200, 8, mode="sum").half()
    x2 = M.bag_inputs(rows=(300, 200))
    plan = fxrec.plan(half, x2, world_size=2, memory_per_rank="1GB", quantize="fp16",
                      pins={"bags.0": ("table_wise", 0), "bags.1": ("table_wise", 1)})
    fast = fxrec.transform(half.eval(), x2, mode="inference", quantize="fp16")
    stored = {t["name"]: t["bytes"] for t in fast.report.tables}
    assert {n: _bytes_of(plan, n) for n in plan.tables} == stored == {"bags.0": 300 * 13 * 2, "bags.1": 200 * 8 * 2}


class _Seq(torch.nn.Module):
    """Two unpooled tables transform puts in one sequence group (dims 7 and 8 round up to 8)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Embedding(300, 7)
        self.b = torch.nn.Embedding(200, 8)

    def forward(self, ia, ib):
        return torch.cat([self.a(ia).flatten(1), self.b(ib).flatten(1)], 1)


@pytest.mark.parametrize("quantize", [{"a": "int8", "b": "int2"}, "fp32", {"a": "fp16", "b": "int4"}])
def test_the_packed_sizes_of_a_sequence_group_are_what_transform_stores(quantize):
    model, x = _Seq(), (torch.randint(0, 300, (4, 3)), torch.randint(0, 200, (4, 2)))
    plan = fxrec.plan(model, x, world_size=2, memory_per_rank="1GB", quantize=quantize,
                      pins={"a": ("table_wise", 0), "b": ("table_wise", 0)})
    fast = fxrec.transform(model.eval(), x, mode="inference", quantize=quantize)
    assert len(fast.report.groups) == 1
    stored = {t["name"]: t["bytes"] for t in fast.report.tables}
    assert {n: _bytes_of(plan, n) for n in plan.tables} == stored


def test_a_model_too_large_to_train_on_the_ranks_is_planned_for_serving_int8():
    specs = [TableSpec(f"t{i}", 20_000, 64) for i in range(4)]  # 5.12 MB of fp32 each
    with pytest.raises(fxrec.PlanError, match="does not fit"):
        _plan(specs, memory_per_rank="8MB")
    served = _plan([TableSpec(s.name, s.num_rows, s.dim, quantize="int8") for s in specs], memory_per_rank="8MB")
    assert max(served.rank_bytes()) <= 8_000_000
    assert sum(served.rank_bytes()) == 4 * 20_000 * (64 + 4)


def test_quantize_is_decided_per_table_by_transforms_rule():
    """"auto" and dicts: the dtypes transform's report gives for the same quantize=."""
    model = M.BagList(rows=(3000, 200, 30), dim=8)
    x = M.bag_inputs(rows=(3000, 200, 30))
    for quantize in ("auto", {"bags.1": "int4", "*": "auto"}, "fp16"):
        plan = fxrec.plan(model, x, world_size=2, memory_per_rank="1GB", quantize=quantize)
        report = fxrec.explain(model.eval(), x, mode="inference", quantize=quantize)
        assert {n: plan[n].spec.quantize for n in plan.tables} == {t["name"]: t["dtype"] for t in report.tables}
    assert fxrec.plan(model, x, world_size=2, memory_per_rank="1GB", quantize="auto")["bags.0"].spec.quantize == "int8"


def test_quantized_tables_are_not_data_parallel_and_integer_ones_not_column_wise():
    """Where a training plan makes a small table data-parallel and cuts a hot wide one by columns,
    a plan for serving int8 does neither; fp32 (kept as the model holds it) may be data-parallel,
    fp16 column-wise."""
    def specs(q=""):
        return [TableSpec("small", 10, 8, pooling_factor=1.0, quantize=q),
                TableSpec("hot", 100_000, 256, pooling_factor=50.0, quantize=q),
                TableSpec("other", 50_000, 16, quantize=q)]
    kw = dict(world_size=4, batch_size=4096)
    train = _plan(specs(), **kw)
    assert train["small"].sharding == "data_parallel" and train["hot"].sharding == "column_wise"
    int8 = _plan(specs("int8"), **kw)
    assert int8["small"].sharding != "data_parallel" and int8["hot"].sharding not in ("column_wise", "data_parallel")
    assert _plan(specs("fp32"), **kw)["small"].sharding == "data_parallel"
    assert _plan(specs("fp16"), **kw)["hot"].sharding == "column_wise"
    # over many shapes, never
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        n = int(torch.randint(2, 12, (1,), generator=g))
        got = _plan([TableSpec(f"t{i}", int(torch.randint(1, 5000, (1,), generator=g)), 4 * int(torch.randint(1, 64, (1,), generator=g)),
                               pooling_factor=float(torch.randint(1, 300, (1,), generator=g)),
                               quantize=["int8", "int4", "int2"][i % 3]) for i in range(n)],
                    world_size=int(torch.randint(1, 9, (1,), generator=g)), batch_size=2048, memory_per_rank="1GB")
        assert not {tp.sharding for tp in got.tables.values()} & {"data_parallel", "column_wise"}, got


def test_pins_and_specs_that_serving_cannot_run_are_refused_naming_the_table():
    with pytest.raises(ValueError, match=r"pin for 'a': data_parallel keeps the model's own lookups, and the table is "
                                         r"served quantized int8: lay it out table_wise or row_wise, or leave it as it "
                                         r"is \(quantize=\{'a': 'fp32', \.\.\.\}: a dict's first key"):
        _plan([TableSpec("a", 10, 8, quantize="int8")], pins={"a": "data_parallel"})
    with pytest.raises(ValueError, match=r"pin for 'h': data_parallel .* lay it out table_wise, or leave it as it is "
                                         r"\(quantize=\{'h': 'fp16', \.\.\.\}"):  # (fp16 in the model: whole on a rank)
        _plan([TableSpec("h", 10, 8, dtype="fp16", quantize="int8")], pins={"h": "data_parallel"})
    with pytest.raises(ValueError, match=r"pin for 'a': column_wise, and the table is served quantized int4, whose "
                                         r"per-row scale and bias need the whole row"):
        _plan([TableSpec("a", 10, 8, quantize="int4")], pins={"a": "column_wise"})
    with pytest.raises(ValueError, match=r"pin for 's': the table is looked up unpooled"):  # (not "quantize it fp16")
        _plan([TableSpec("s", 10, 8, pooled=False, quantize="int4")], pins={"s": "column_wise"})
    with pytest.raises(ValueError, match=r"none of the sharding types \['column_wise', 'data_parallel'\] applies to "
                                         r"table 'a' \(column_wise, and the table is served quantized int8.*; "
                                         r"data_parallel keeps the model's own lookups"):
        _plan([TableSpec("a", 10, 8, quantize="int8")], sharding_types=["column_wise", "data_parallel"])
    assert _plan([TableSpec("a", 10, 8, quantize="fp16")], pins={"a": "column_wise"})["a"].sharding == "column_wise"
    assert _plan([TableSpec("a", 10, 8, quantize="fp32")], pins={"a": "data_parallel"})["a"].sharding == "data_parallel"
    with pytest.raises(ValueError, match=r"table 'a': quantize 'int3' is not one of"):
        TableSpec("a", 10, 8, quantize="int3")
    with pytest.raises(ValueError, match=r"table 'a': quantize 'int8' is for serving, and the spec also has weights"):
        TableSpec("a", 10, 8, weights="fp16", quantize="int8")
    with pytest.raises(ValueError, match=r"table 'a': quantize 'int8' is for serving, and the spec also has optimizer"):
        TableSpec("a", 10, 8, optimizer="adagrad", quantize="int8")
    with pytest.raises(ValueError, match=r"table 'a': quantize 'fp32' would widen an fp16 table"):
        TableSpec("a", 10, 8, dtype="fp16", quantize="fp32")
    with pytest.raises(ValueError, match=r"tables \['a'\] have quantize and \['b'\] do not"):
        _plan([TableSpec("a", 10, 8, quantize="int8"), TableSpec("b", 10, 8)])


def test_a_table_that_can_only_be_data_parallel_must_stay_unquantized():
    """(A bag with padding_idx: sharded lookups do not take it; transform refuses the same.)"""
    model, x = M.WeightedBags(), M.weighted_inputs()
    with pytest.raises(ValueError, match=r"table 'b2d' can only be data_parallel \(.*padding_idx.*\), whose lookups "
                                         r"stay the model's own, and it is to be served quantized int8.*'b2d': 'fp32'"):
        fxrec.plan(model, x, world_size=2, memory_per_rank="1GB", quantize={"w2": "fp32", "*": "int8"})
    plan = fxrec.plan(model, x, world_size=2, memory_per_rank="1GB", quantize={"b2d": "fp32", "w2": "fp32", "*": "int8"})
    assert plan["b2d"].sharding == "data_parallel" and plan["w1"].sharding != "data_parallel"


def test_specs_that_carry_quantize_make_a_plan_for_serving_and_refuse_training_arguments():
    """(Only quantize= given was checked: an optimizer= with quantized specs was taken and ignored.)
    A spec's own quantize wins, as its weights do."""
    spec = dict(name="t", num_rows=1000, dim=64, quantize="int8")
    with pytest.raises(ValueError, match=r"quantize makes a plan for serving, and optimizer= is for training"):
        _plan([spec], optimizer="adagrad")
    plan = _plan([dict(spec, quantize="int2"), dict(spec, name="u")], quantize="int8")
    assert (plan["t"].spec.quantize, plan["u"].spec.quantize) == ("int2", "int8")


def test_plan_arguments_for_training_are_refused_with_quantize():
    model, x = M.BagList(), M.bag_inputs()
    for kw, what in ((dict(optimizer="adagrad"), "optimizer= is"), (dict(weights_precision="fp16"), "weights_precision= is")):
        with pytest.raises(ValueError, match=f"quantize makes a plan for serving, and {what} for training"):
            fxrec.plan(model, x, world_size=2, memory_per_rank="1GB", quantize="int8", **kw)
    with pytest.raises(ValueError, match=r"quantize must be one of .* got 'int3'"):
        fxrec.plan(model, x, world_size=2, memory_per_rank="1GB", quantize="int3")
    with pytest.raises(ValueError, match=r"fxrec.plan: quantize keys \['bag.0'\] match no table"):
        fxrec.plan(model, x, world_size=2, memory_per_rank="1GB", quantize={"bag.0": "int8"})


def test_transform_takes_a_plan_for_serving_only_as_planned():
    """(fxrec.explain(plan=) runs transform's refusals without a process group.)"""
    model, x = M.BagList(rows=(400, 300, 200)), M.bag_inputs(rows=(400, 300, 200))
    plan = fxrec.plan(model, x, world_size=2, memory_per_rank="1GB", quantize="int8")
    fxrec.explain(model.eval(), x, plan=plan, mode="inference", quantize="int8")
    with pytest.raises(ValueError, match=r"the plan was made for serving .*table 'bags\.0' sized as int8 rows.* and "
                                         r"transform trains: make the plan without quantize= for training"):
        fxrec.explain(model, x, plan=plan, optimizer=fxrec.optim.SGD(lr=0.1))
    with pytest.raises(ValueError, match=r"the plan sized table 'bags\.0' for serving int8 rows .* and transform stores "
                                         r"it int4: give fxrec.plan and transform the same quantize="):
        fxrec.explain(model.eval(), x, plan=plan, mode="inference", quantize="int4")
    with pytest.raises(ValueError, match=r"the plan sized table 'bags\.0' for serving int8 rows .* and transform does "
                                         r"not quantize it"):
        fxrec.explain(model.eval(), x, plan=plan, mode="inference")
    # a plan made for training still serves (it counted more than the packed rows take)
    fxrec.explain(model.eval(), x, plan=fxrec.plan(model, x, world_size=2, memory_per_rank="1GB"),
                  mode="inference", quantize="int8")


def test_a_plan_for_serving_round_trips_and_prints_its_dtypes(tmp_path):
    model, x = M.BagList(rows=(400, 300, 200)), M.bag_inputs(rows=(400, 300, 200))
    plan = fxrec.plan(model, x, world_size=2, memory_per_rank="1GB", quantize={"bags.0": "int4", "*": "int8"})
    plan.save(tmp_path / "p.json")
    back = fxrec.ShardingPlan.load(tmp_path / "p.json")
    assert back.to_dict() == plan.to_dict() and back.serving
    text = str(plan)
    assert "for serving (quantized int4, int8)" in text and "table_wise, int4" in text
    # a plan saved before TableSpec had quantize loads as a plan for training
    d = json.loads(fxrec.plan(model, x, world_size=2, memory_per_rank="1GB").to_json())
    # (a plan for training writes no quantize: an fxrec from before plans for serving reads it)
    assert not any("quantize" in t for t in (d["tables"].values() if isinstance(d["tables"], dict) else d["tables"]))
    old = fxrec.ShardingPlan.from_dict(d)
    assert not old.serving and "optimizer none" in str(old)


def _explained_placements(model, x, plan, quantize):
    """Per rank, transform's placements and the GPU memory its note gives (fxrec.explain runs
    place_shards' rule for every rank, on CUDA, without a GPU)."""
    import re

    report = fxrec.explain(model.eval(), x, plan=plan, mode="inference", quantize=quantize, device="cuda")
    out = {}
    for note in report.notes:
        m = re.match(r"rank (\d+) under hbm_budget=[^:]*: its tables take (.*?) of GPU memory", note)
        if m:
            found = re.findall(r"([\w.]+): (managed_caching|managed)\b", note)
            out[int(m.group(1))] = ({k: v for k, v in found if not re.fullmatch(r"group_\d+", k)}, m.group(2))
    return out


def _transform_needs(monkeypatch, model, x, plan, quantize):
    """Per rank, the GPU bytes transform's rule counts (place_shards.decide, as fxrec.explain runs it)."""
    from fxrec.passes import place_shards

    seen = {}
    decide = place_shards.decide

    def recording(ctx, rank):
        placements, need, groups = decide(ctx, rank)
        seen[rank] = need
        return placements, need, groups

    monkeypatch.setattr(place_shards, "decide", recording)
    fxrec.explain(model.eval(), x, plan=plan, mode="inference", quantize=quantize, device="cuda")
    return seen


class _Half(torch.nn.Module):
    """The model's own fp16 tables: a mean bag and a sum bag (transform groups them apart)."""

    def __init__(self, dims=(16, 35)):
        super().__init__()
        self.a = torch.nn.EmbeddingBag(1000, dims[0], mode="mean").half()
        self.b = torch.nn.EmbeddingBag(1000, dims[1], mode="sum").half()

    def forward(self, ia, ib):
        return torch.cat([self.a(ia), self.b(ib)], 1)


@pytest.mark.parametrize("quantize", ["fp16", {"a": "int8", "b": "fp16"}])
def test_the_models_fp16_tables_never_count_less_gpu_memory_than_transform_does(monkeypatch, quantize):
    """(A serving fuzz: transform counts the model's own fp16 lookups at dims rounded up to 4, where
    the plan counted their rows, and where one fp16 table is quantized it decides by group whether the
    others stay its lookups or are packed, where the plan assumed packed rows, movable uncached:
    fxrec.explain refused plans fxrec.plan made.) The plan's GPU bytes per rank are at least
    transform's, and transform meets the budget of a plan it is given."""
    model, x = _Half(), (torch.randint(0, 1000, (4, 3)), torch.randint(0, 1000, (4, 2)))
    for budget in ("200KB", "60KB", "40KB", "20KB"):
        try:
            plan = fxrec.plan(model, x, world_size=1, memory_per_rank="100MB", device="cuda", hbm_budget=budget,
                              quantize=quantize)
        except fxrec.PlanError:
            continue
        needs = _transform_needs(monkeypatch, model, x, plan, quantize)  # (raises where transform cannot)
        assert [need for _, need in plan.unified_memory()] >= [needs[0]], (budget, plan.unified_memory(), needs)


@pytest.mark.parametrize("budget", ["8MB", "1.5MB", "600KB", "300KB"])
def test_a_plan_for_serving_places_shards_in_unified_memory_as_transform_does(budget):
    """With hbm_budget= (CUDA), each rank's quantized pieces beyond the budget go to unified memory
    with an HBM cache, or without one where the budget is not met with it, by transform's rule
    (place_tables.quantized_held): the plan's placements and GPU memory per rank are the ones
    fxrec.explain gives for the same plan (transform's place_shards); the data-parallel fp32 table
    stays in GPU memory."""
    from fxrec.planner.specs import format_bytes

    rows = (20000, 15000, 1000)  # (bags.2, data-parallel fp32: 256 KB on every rank)
    model, x = M.BagList(rows=rows, dim=64), M.bag_inputs(rows=rows)
    quantize = {"bags.2": "fp32", "*": "int8"}
    pins = {"bags.0": ("table_wise", 0), "bags.1": "row_wise", "bags.2": "data_parallel"}
    plan = fxrec.plan(model, x, world_size=2, memory_per_rank="100MB", device="cuda", hbm_budget=budget,
                      quantize=quantize, pins=pins)
    planned = {r: (where, format_bytes(need)) for r, (where, need) in enumerate(plan.unified_memory())}
    assert planned == _explained_placements(model, x, plan, quantize)
    assert all("bags.2" not in where for where, _ in planned.values())
    # rank 0 holds bags.0 (1.6 MB packed), half of bags.1 (600 KB) and bags.2 (256 KB): the largest
    # goes first, cached; then, where caches do not fit, uncached, largest first (by hand from the rule)
    want = {"8MB": {}, "1.5MB": {"bags.0": "managed_caching"},
            "600KB": {"bags.0": "managed", "bags.1": "managed_caching"},
            "300KB": {"bags.0": "managed", "bags.1": "managed"}}[budget]
    assert planned[0][0] == want
    moved = set(want)
    # the reads that miss the cache cross the bus: a rank with a piece in unified memory costs more
    base = fxrec.plan(model, x, world_size=2, memory_per_rank="100MB", device="cuda", quantize=quantize, pins=pins)
    assert plan.rank_cost_ms()[0] > base.rank_cost_ms()[0] if moved else plan.rank_cost_ms() == base.rank_cost_ms()


def test_a_plan_for_serving_whose_rank_cannot_meet_the_budget_is_refused_naming_it():
    rows = (20000, 15000, 10000)
    model, x = M.BagList(rows=rows, dim=64), M.bag_inputs(rows=rows)
    with pytest.raises(fxrec.PlanError, match=r"rank 0's tables need .* more than hbm_budget=.*what stays in GPU memory: "
                                              r"\['bags\.2'\] \(data-parallel tables, the model's fp16 tables\)\. Raise "
                                              r"hbm_budget, lower cache_load_factor, quantize to fewer bits"):
        fxrec.plan(model, x, world_size=2, memory_per_rank="100MB", device="cuda", hbm_budget="100KB",
                   quantize={"bags.2": "fp32", "*": "int8"}, pins={"bags.2": "data_parallel"})
