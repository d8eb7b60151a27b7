"""place_tables: which tables leave GPU memory under ``hbm_budget=`` (decided for CUDA on any
machine with fxrec.explain), and what it must leave alone. The GPU runs are in tests/test_gpu.py."""

import copy
import json
import math

import re

import pytest
import torch
from torch import nn

import fxrec
from fxrec.pass_infra import InputError

MB = 10**6


class ThreeTables(nn.Module):
    """1M x 128, 200k x 64 and 1000 x 16 bags, built on the meta device (nothing allocated)."""

    def __init__(self, wide_dim: int = 16):
        super().__init__()
        self.big = nn.EmbeddingBag(1_000_000, 128, mode="sum")
        self.mid = nn.EmbeddingBag(200_000, 64, mode="sum")
        self.small = nn.EmbeddingBag(1000, wide_dim, mode="sum")
        self.top = nn.Linear(128 + 64 + wide_dim, 1)

    def forward(self, a, b, c):
        return self.top(torch.cat([self.big(a), self.mid(b), self.small(c)], 1))


def meta_model(**kw):
    with torch.device("meta"):
        return ThreeTables(**kw)


INPUTS = tuple(torch.randint(0, 1000, (8, 3)) for _ in range(3))


def placements(report):
    """table -> placement, read from the report's text for each group."""
    out = {}
    for g in report.groups:
        for t in g.tables:
            out[t] = "device"
        if "(" in g.placement:
            for part in g.placement.split("(", 1)[1].split(";")[0].rstrip(")").split(", "):
                t, where = part.split(": ")
                out[t] = where
    return out


def cache_hbm(rows, width, lf=0.2):
    """fbgemm's cache for ``rows`` cached rows: sets of 32 rows at the widest width (fp32) with two
    int64 states each, and an int32 per cached table row (its index map)."""
    slots = math.ceil(int(rows * lf) / 32) * 32
    return slots * (width * 4 + 16) + rows * 4


def test_without_a_budget_every_table_stays_in_gpu_memory():
    r = fxrec.explain(meta_model(), INPUTS, device="cuda", optimizer=fxrec.optim.SGD(lr=0.1))
    assert {g.placement for g in r.groups} == {"device"}
    assert not any(p.startswith("place_tables") for p in r.passes)


def test_a_budget_the_tables_fit_moves_nothing():
    need = (1_000_000 * 128 + 200_000 * 64 + 1000 * 16) * 4
    r = fxrec.explain(meta_model(), INPUTS, device="cuda", optimizer=fxrec.optim.SGD(lr=0.1), hbm_budget=need)
    assert set(placements(r).values()) == {"device"}
    assert "tables_in_unified_memory=0" in r.passes[-1]


def hbm_of(report) -> int:
    (stats,) = [p for p in report.passes if p.startswith("place_tables")]
    return int(stats.split("tables_hbm_bytes=")[1].split(",")[0].rstrip(")"))


@pytest.mark.parametrize("budget_mb,moved", [(300, {"big"}), (150, {"big", "mid"})])
def test_the_largest_tables_leave_gpu_memory_first_until_the_rest_fits(budget_mb, moved):
    r = fxrec.explain(meta_model(), INPUTS, device="cuda", optimizer=fxrec.optim.SGD(lr=0.1),
                      hbm_budget=f"{budget_mb}MB")
    got = placements(r)
    assert {t for t, p in got.items() if p != "device"} == moved
    assert all(got[t] == "managed_caching" for t in moved)  # fused into fbgemm: fbgemm alone writes the rows
    # what that placement takes, written out: the tables left on the device plus the cache of the moved ones
    device = {"big": 1_000_000 * 128, "mid": 200_000 * 64, "small": 1000 * 16}
    rows = {"big": 1_000_000, "mid": 200_000}
    need = sum(4 * n for t, n in device.items() if t not in moved) + cache_hbm(sum(rows[t] for t in moved), 128)
    assert hbm_of(r) == need <= budget_mb * MB
    assert f"tables_in_unified_memory={len(moved)}" in r.passes[-1]


def test_a_row_wise_state_stays_in_gpu_memory_when_its_table_leaves():
    """fbgemm keeps row-wise optimizer states in HBM wherever the rows are."""
    r = fxrec.explain(meta_model(), INPUTS, device="cuda", optimizer=fxrec.optim.RowWiseAdagrad(), hbm_budget="150MB")
    assert {t for t, p in placements(r).items() if p != "device"} == {"big", "mid"}
    want = 1000 * (16 * 4 + 4) + cache_hbm(1_200_000, 128) + 1_200_000 * 4
    assert hbm_of(r) == want


def test_quantized_tables_count_as_fbgemm_packs_them_for_cuda():
    """int8 rows: dim + 4 bytes of scale and bias, rounded up to 16 bytes (1M x 144 + 200k x 80 + 1000 x 32)."""
    r = fxrec.explain(ThreeTables(), INPUTS, device="cuda", mode="inference", quantize="int8", hbm_budget="200MB")
    assert set(placements(r).values()) == {"device"}
    assert hbm_of(r) == 1_000_000 * 144 + 200_000 * 80 + 1000 * 32


def test_quantized_tables_beyond_the_budget_go_to_unified_memory_cached_then_uncached():
    """Serving quantized, fbgemm's IntNBit kernel alone reads the rows: the largest go to unified
    memory with an HBM cache of their packed rows (0.2 of the rows, in sets of 32, at the widest
    cached row, two int64 states a cache row and an int32 a table row: fbgemm's IntNBit cache), until
    the rest fits; where it still does not, the moved ones go without their cache, largest first
    ("managed": no HBM). int8 rows: 144 bytes at dim 128, 80 at 64, 32 at 16 (16-byte rows)."""
    r = fxrec.explain(ThreeTables(), INPUTS, device="cuda", mode="inference", quantize="int8", hbm_budget="100MB")
    assert placements(r) == {"big": "managed_caching", "mid": "device", "small": "device"}
    assert hbm_of(r) == 200_000 * (144 + 16) + 1_000_000 * 4 + 200_000 * 80 + 1000 * 32
    r = fxrec.explain(ThreeTables(), INPUTS, device="cuda", mode="inference", quantize="int8", hbm_budget="10MB")
    # (big and mid cached together: 43 MB of cache; big's dropped, mid's 40k rows of 80 bytes fit)
    assert placements(r) == {"big": "managed", "mid": "managed_caching", "small": "device"}
    assert hbm_of(r) == 40_000 * (80 + 16) + 200_000 * 4 + 1000 * 32
    r = fxrec.explain(ThreeTables(), INPUTS, device="cuda", mode="inference", quantize="int8", hbm_budget="1MB")
    assert placements(r) == {"big": "managed", "mid": "managed", "small": "device"}
    assert hbm_of(r) == 1000 * 32


def test_tables_moved_while_the_caches_held_the_budget_come_back_once_they_are_dropped():
    """20k, 300 and 200 int8 rows of 80 bytes under 100 kB: the big table's cache (464 kB) does not
    fit, so the small ones move too before the caches are dropped, largest first (the big table's
    alone is enough); then the small ones fit in HBM again and come back."""
    from tests import models as M

    rows = (20_000, 300, 200)
    r = fxrec.explain(M.BagList(rows=rows, dim=64).eval(), M.bag_inputs(rows=rows), device="cuda", mode="inference",
                      quantize="int8", hbm_budget=100_000)
    assert placements(r) == {"bags.0": "managed", "bags.1": "device", "bags.2": "device"}
    assert hbm_of(r) == (300 + 200) * 80


def test_optimizer_states_count_against_the_budget():
    """Adam keeps two moments a weight: with them the mid table no longer fits beside the cache."""
    sgd = fxrec.explain(meta_model(), INPUTS, device="cuda", optimizer=fxrec.optim.SGD(lr=0.1), hbm_budget="250MB")
    adam = fxrec.explain(meta_model(), INPUTS, device="cuda", optimizer=fxrec.optim.LazyAdam(), hbm_budget="250MB")
    assert placements(sgd)["mid"] == "device" and placements(adam)["mid"] == "managed_caching"


def test_training_with_pytorchs_gradients_keeps_its_tables_and_counts_their_gradients():
    """torch.optim's update writes the parameters and their gradients are table-sized in HBM
    wherever the rows live: such tables stay, and a budget they do not fit is an error."""
    weights = (1_000_000 * 128 + 200_000 * 64 + 1000 * 16) * 4
    r = fxrec.explain(meta_model(), INPUTS, device="cuda", hbm_budget=2 * weights)
    assert set(placements(r).values()) == {"device"} and hbm_of(r) == 2 * weights
    with pytest.raises(InputError, match="dense gradients where training has no fused optimizer"):
        fxrec.explain(meta_model(), INPUTS, device="cuda", hbm_budget="300MB")


def test_inference_caches_the_rows_it_moves():
    r = fxrec.explain(meta_model(), INPUTS, device="cuda", mode="inference", hbm_budget="300MB")
    assert placements(r)["big"] == "managed_caching"


class SkipModel(nn.Module):
    """``x`` (2000 x 16) shares a group with a 1M x 128 table, ``y`` (1000 x 32, as many bytes) is
    alone in a mean group: cached, x would cost more than it saves (the group's cache rows are 128
    wide), y less."""

    def __init__(self):
        super().__init__()
        self.big = nn.EmbeddingBag(1_000_000, 128, mode="sum")
        self.x = nn.EmbeddingBag(2000, 16, mode="sum")
        self.y = nn.EmbeddingBag(1000, 32, mode="mean")

    def forward(self, a, b, c):
        return torch.cat([self.big(a), self.x(b), self.y(c)], 1)


def test_a_table_that_would_cost_more_cached_stays_and_the_next_one_moves():
    with torch.device("meta"):
        model = SkipModel()
    r = fxrec.explain(model, INPUTS, device="cuda", optimizer=fxrec.optim.SGD(lr=0.1), hbm_budget=109_800_000)
    assert placements(r) == {"big": "managed_caching", "x": "device", "y": "managed_caching"}
    assert hbm_of(r) == cache_hbm(1_000_000, 128) + 2000 * 16 * 4 + cache_hbm(1000, 32)


def test_the_decision_is_the_same_every_time():
    runs = [fxrec.explain(meta_model(), INPUTS, device="cuda", optimizer=fxrec.optim.SGD(lr=0.1), hbm_budget="150MB")
            for _ in range(2)]
    assert [g.placement for g in runs[0].groups] == [g.placement for g in runs[1].groups]


class BigAndWide(nn.Module):
    def __init__(self):
        super().__init__()
        self.big = nn.EmbeddingBag(1_000_000, 128, mode="sum")
        self.wide = nn.EmbeddingBag(20_000, 2100, mode="mean")  # its own group: another pooling

    def forward(self, a, b):
        return torch.cat([self.big(a), self.wide(b)], 1)


def test_tables_only_pytorch_can_hold_stay_in_gpu_memory_and_count():
    """dims over 1024 run on the reference kernel (PyTorch's lookups): no unified memory there,
    and its 168 MB stay in the budget: 300 MB leaves too little for the big table on the device."""
    with torch.device("meta"):
        model = BigAndWide()
    r = fxrec.explain(model, INPUTS[:2], device="cuda", mode="inference", hbm_budget="300MB")
    got = placements(r)
    assert got == {"big": "managed_caching", "wide": "device"}
    assert [g.kernel_eval for g in r.groups] == ["fbgemm", "reference"]


def test_a_budget_no_placement_meets_is_an_error_with_the_bytes():
    """(A ValueError of the user's setting, not a PassError, which says fxrec failed.)"""
    with pytest.raises(InputError, match=r"^fxrec: the embedding tables need 1\d\d MB of GPU memory.*hbm_budget=10 MB"):
        fxrec.explain(meta_model(), INPUTS, device="cuda", optimizer=fxrec.optim.SGD(lr=0.1), hbm_budget="10MB")


@pytest.mark.parametrize("kw,match", [
    (dict(hbm_budget="lots"), "hbm_budget"),
    (dict(hbm_budget=-5), "hbm_budget"),
    (dict(hbm_budget="1GB", cache_load_factor=0), "cache_load_factor"),
    (dict(hbm_budget="1GB", cache_load_factor=1.5), "cache_load_factor"),
    (dict(hbm_budget="1GB", cache_load_factor=True), "cache_load_factor"),
])
def test_bad_placement_arguments_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        fxrec.explain(meta_model(), INPUTS, device="cuda", **kw)


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.EmbeddingBag(50, 8, mode="sum")
        self.b = nn.EmbeddingBag(30, 4, mode="mean")

    def forward(self, x, y):
        return torch.cat([self.a(x), self.b(y)], 1)


def test_on_cpu_a_budget_changes_nothing():
    model = Small()
    x, y = torch.randint(0, 50, (6, 3)), torch.randint(0, 30, (6, 2))
    fast = fxrec.transform(model, (x, y), hbm_budget=1, optimizer=fxrec.optim.SGD(lr=0.1))
    assert {g.placement for g in fast.report.groups} == {"host"}
    torch.testing.assert_close(fast(x, y), model(x, y))


def test_a_group_told_to_cache_on_cuda_runs_from_host_memory_on_cpu_and_syncs_as_a_no_op():
    """The runtime half on CPU: a table placed managed_caching is plain host memory there; the
    sync points (state_dict, load_state_dict, deepcopy) run fbgemm's flush and reset on it."""
    from fxrec.runtime.group import EmbeddingGroup
    from fxrec.runtime.specs import FeatureSpec, FusedSpec, TableSpec

    g = EmbeddingGroup([TableSpec("t", 10, 4, placement="managed_caching")], [FeatureSpec("f", 0, "bag")], "sum",
                       "fbgemm", "fbgemm", fused=FusedSpec("sgd", 0.5))
    w0 = torch.randn(10, 4)
    w = nn.Parameter(w0.clone())
    ids, offs = torch.tensor([1, 2, 2]), torch.tensor([0, 1])
    g([ids], [offs], [None], [w]).sum().backward()
    g.sync_cache(drop=True)
    want = w0.clone()
    want[1] -= 0.5
    want[2] -= 1.0
    torch.testing.assert_close(w.detach(), want)
    twin = copy.deepcopy(g)
    assert twin.tables[0].placement == "managed_caching"


def test_hbm_budget_where_no_group_runs_on_cuda_is_noted_as_changing_nothing():
    """(explain(device="cpu", hbm_budget=...) said nothing of it.)"""
    r = fxrec.explain(ThreeTables(), INPUTS, device="cpu", hbm_budget="1KB")
    assert any("hbm_budget= places tables in GPU memory, and no group runs on CUDA here (cpu): it changed nothing"
               in n for n in r.notes), r.notes
    r = fxrec.explain(ThreeTables(), INPUTS, device="cuda", mode="inference", quantize="int8", hbm_budget="200MB")
    assert not any("hbm_budget=" in n for n in r.notes), r.notes


# --- transform(..., device="cuda") of a model on CPU: decided for CUDA, then moved, the tables in
# unified memory straight from host memory (the move itself: tests/test_gpu.py)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_transform_for_cuda_without_a_gpu_is_refused_pointing_at_explain():
    model = Small()
    x = (torch.randint(0, 50, (6, 3)), torch.randint(0, 30, (6, 2)))
    with pytest.raises(InputError, match=r"device='cuda', and no CUDA device is available here; fxrec.explain\("):
        fxrec.transform(model, x, device="cuda", hbm_budget="1KB", optimizer=fxrec.optim.SGD(lr=0.1))


def test_transform_device_arguments():
    model = Small()
    x = (torch.randint(0, 50, (6, 3)), torch.randint(0, 30, (6, 2)))
    with pytest.raises(ValueError, match=r"device must be one of \('cpu', 'cuda'\).*got 'tpu'"):
        fxrec.transform(model, x, device="tpu")
    here = fxrec.transform(model, x, device="cpu", hbm_budget=1, optimizer=fxrec.optim.SGD(lr=0.1))
    assert {g.placement for g in here.report.groups} == {"host"}
    torch.testing.assert_close(here(*x), model(*x))
    plan = fxrec.plan(model, x, world_size=2, memory_per_rank="1GB")
    from fxrec.arguments import check_target_device

    with pytest.raises(InputError, match=r"transform\(plan=..., device='cuda'\) of a model on cpu: each rank"):
        check_target_device("cuda", model, plan)
    with pytest.raises(InputError, match=r"autotune=True times the kernels where the model is \(cpu\), and device='cuda'"):
        fxrec.transform(model, x, device="cuda", autotune=True)


def test_transform_and_explain_take_a_torch_device_and_a_gpu_index():
    """device= as torch.device or "cuda:N" is the device its str names; anything else (another
    type, a malformed name, a number) is refused naming what was given."""
    model = Small()
    x = (torch.randint(0, 50, (6, 3)), torch.randint(0, 30, (6, 2)))
    for d in (torch.device("cpu"), "cpu:0"):
        here = fxrec.transform(model, x, device=d)
        torch.testing.assert_close(here(*x), model(*x))
    said = [json.loads(fxrec.explain(model, x, device=d).to_json()) for d in (torch.device("cuda", 0), "cuda", None)]
    assert said[0]["groups"] == said[1]["groups"] != said[2]["groups"]  # (decided for CUDA, not for the CPU)
    for bad in ("tpu", "cuda:x", 3, torch.device("meta")):
        with pytest.raises(ValueError, match=r"device must be one of \('cpu', 'cuda'\).*got " + re.escape(repr(bad))):
            fxrec.transform(model, x, device=bad)
        with pytest.raises(ValueError, match=r"device must be one of .*got " + re.escape(repr(bad))):
            fxrec.explain(model, x, device=bad)
    if not torch.cuda.is_available():
        for d in (torch.device("cuda"), "cuda:1"):
            with pytest.raises(InputError, match=r"device=.*no CUDA device is available here"):
                fxrec.transform(model, x, device=d)


def test_the_groups_a_move_binds_first_are_found_with_their_tables():
    """What .to("cuda") binds before moving the rest: each group the graph calls, with the model's
    own table parameters; nothing for a CPU target or tables placed in GPU memory."""
    from fxrec.graph_module import groups_with_tables
    from fxrec.runtime.group import EmbeddingGroup

    model = Small()
    x = (torch.randint(0, 50, (6, 3)), torch.randint(0, 30, (6, 2)))
    fast = fxrec.transform(model, x, backend="fbgemm")
    found = list(groups_with_tables(fast))
    assert [type(g) for g, _ in found] == [EmbeddingGroup] * len(fast.report.groups)
    params = {id(p): n for n, p in fast.named_parameters()}
    assert sorted(params[id(p)] for _, ps in found for p in ps) == sorted(
        n for n, _ in model.named_parameters())
    for g, ps in found:
        assert not g.bind_on(ps, torch.device("cpu")) and not g.bind_on(ps, torch.device("cuda"))  # (placed "device")


class _TwoSequences(nn.Module):
    """Unpooled lookups of dim 12, one table served int8 and one int4: one sequence group, which
    stores both at 16 (int4 needs a multiple of 8, and fbgemm's unpooled lookup has one width)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Embedding(100_000, 12)
        self.b = nn.Embedding(1000, 12)

    def forward(self, a, b):
        return self.a(a).sum() + self.b(b).sum()


def test_quantized_sequence_tables_count_at_their_groups_stored_width():
    """What a sequence group's quantized rows and cache take in HBM: at the group's stored width
    (int8 at 16: 20 bytes, 32-byte rows; int4 at 16: 12 bytes, 16-byte rows). Counted at its own dim,
    the int8 table's 100k rows were 16 bytes each, and its cache's too."""
    x = (torch.randint(0, 1000, (4, 3)), torch.randint(0, 1000, (4, 3)))
    kw = dict(device="cuda", mode="inference", quantize={"a": "int8", "b": "int4"})
    r = fxrec.explain(_TwoSequences().eval(), x, hbm_budget="1GB", **kw)
    assert [g.tables for g in r.groups] == [["a", "b"]]
    assert hbm_of(r) == 100_000 * 32 + 1000 * 16
    r = fxrec.explain(_TwoSequences().eval(), x, hbm_budget="2MB", **kw)
    assert placements(r) == {"a": "managed_caching", "b": "device"}
    assert hbm_of(r) == 20_000 * (32 + 16) + 100_000 * 4 + 1000 * 16  # (the cache's rows 32 bytes)


def test_a_quantized_table_kept_in_hbm_by_its_cache_goes_uncached_where_the_budget_needs_it():
    """A small table whose cache at its group's widest row would cost more than it saves stays in
    HBM while caches are tried; once they do not meet the budget, it may go to unified memory
    uncached like the others (it was left in HBM, and the budget refused, before)."""
    from fxrec.passes.place_tables import place, quantized_held

    a = quantized_held("A", "A", 160, 128, "int8")  # 160 rows of 144 bytes: a cache of one set
    b = quantized_held("B", "B", 10, 8, "int8")  # 10 rows of 16 bytes: a second set if cached with A
    assert place([[a, b]], 100, 0.2) == ({"A": "managed", "B": "managed"}, 0)
    assert place([[a, b]], 10 * 16, 0.2) == ({"A": "managed"}, 10 * 16)
