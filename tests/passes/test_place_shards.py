"""place_shards: with a plan, ``hbm_budget=`` is each rank's GPU memory, and each rank places the
pieces of tables it holds by place_tables' rule (decided for CUDA on any machine with
fxrec.explain, every rank's from the plan alone). The GPU run is in tests/test_gpu.py."""

import pytest
import torch

import fxrec
from fxrec.pass_infra import InputError
from tests.passes.test_place_tables import INPUTS, ThreeTables, cache_hbm, meta_model

MB = 10**6
# big 1M x 128 split in row blocks of 500k, mid 200k x 64 whole on rank 1, small 1000 x 16 on every rank
PINS = {"big": "row_wise", "mid": ("table_wise", 1), "small": "data_parallel"}
SGD = fxrec.optim.SGD(lr=0.1)


def plan_of(pins=PINS, optimizer=SGD, model=None, **kw):
    return fxrec.plan(model or meta_model(), INPUTS, world_size=2, memory_per_rank="2GB", pins=pins,
                      optimizer=optimizer, **kw)


def rank_notes(report):
    """rank -> (HBM bytes it needs as written, its placement text), from the explain notes."""
    out = {}
    for n in report.notes:
        if n.startswith("rank ") and "under hbm_budget=" in n:
            rank = int(n.split()[1])
            out[rank] = n.split("; ", 1)[1]
    return out


def test_each_rank_moves_its_own_largest_pieces_until_they_fit():
    # rank 0: big's first 500k rows and small (data-parallel: whole, and its dense gradient: it
    # trains with torch.optim); rank 1: big's other rows, mid and small
    small = 1000 * 16 * 4 * 2
    plan = plan_of()
    r = fxrec.explain(meta_model(), INPUTS, device="cuda", plan=plan, optimizer=SGD, hbm_budget="300MB")
    notes = rank_notes(r)
    assert notes[0] == "group_0: device"
    assert notes[1] == "group_0: device+managed_caching (big: managed_caching; HBM cache 0.2 of the cached rows)"
    text = {int(n.split()[1]): n for n in r.notes if "under hbm_budget=" in n}
    assert f"take {fxrec.planner.format_bytes(500_000 * 128 * 4 + small)} of" in text[0], text[0]
    need1 = cache_hbm(500_000, 128) + 200_000 * 64 * 4 + small
    assert f"take {fxrec.planner.format_bytes(need1)} of" in text[1], text[1]
    r = fxrec.explain(meta_model(), INPUTS, device="cuda", plan=plan, optimizer=SGD, hbm_budget="100MB")
    assert rank_notes(r)[1].startswith("group_0: device+managed_caching (big: managed_caching, mid: managed_caching;")


def test_a_column_shard_counts_its_own_columns():
    """big split in two column shards of 64: each rank holds 1M x 64 (Adagrad: a state a value)."""
    pins = {"big": {"sharding": "column_wise", "ranks": [0, 1]}, "mid": ("table_wise", 1), "small": "data_parallel"}
    opt = fxrec.optim.Adagrad(lr=0.1)
    plan = plan_of(pins, opt)
    on_device = 1_000_000 * 64 * 8 + 1000 * 16 * 8
    r = fxrec.explain(meta_model(), INPUTS, device="cuda", plan=plan, optimizer=opt, hbm_budget=on_device)
    assert rank_notes(r)[0] == "group_0: device"
    r = fxrec.explain(meta_model(), INPUTS, device="cuda", plan=plan, optimizer=opt, hbm_budget=on_device - 1)
    assert rank_notes(r)[0].startswith("group_0: device+managed_caching (big: managed_caching;")
    text = next(n for n in r.notes if n.startswith("rank 0 under"))
    assert f"take {fxrec.planner.format_bytes(cache_hbm(1_000_000, 64) + 1000 * 16 * 8)} of" in text, text


def test_quantized_pieces_count_as_fbgemm_packs_them_and_move_cached_then_uncached():
    """int8 rows of 128: 144 bytes at CUDA's 16-byte alignment; mid and small stay fp32 (mid packed
    in the same IntNBit TBE as big, 256-byte rows; small data-parallel: the model's own lookups).
    Beyond the budget, the largest packed pieces go to unified memory with an HBM cache (0.2 of
    their rows in sets of 32, at the widest cached row, two int64 states a cache row, an int32 a
    table row: fbgemm's), then, where that is still over, without it ("managed": no HBM); the
    data-parallel table stays."""
    model = ThreeTables()
    plan = plan_of(optimizer=None, model=model)
    q = {"big": "int8", "mid": "fp32", "small": "fp32"}
    small = 1000 * 16 * 4
    cached = "group_0: device+managed_caching (big: managed_caching; HBM cache 0.2 of the cached rows)"
    r = fxrec.explain(model, INPUTS, device="cuda", plan=plan, mode="inference", quantize=q, hbm_budget="1GB")
    assert "take 72.1 MB of" in next(n for n in r.notes if n.startswith("rank 0 under"))  # 500k x 144 + small
    assert rank_notes(r) == {0: "group_0: device", 1: "group_0: device"}
    budget = 500_000 * 144 + small  # rank 0's exactly; rank 1 (mid's 51.2 MB more) moves its block of big only
    r = fxrec.explain(model, INPUTS, device="cuda", plan=plan, mode="inference", quantize=q, hbm_budget=budget)
    assert rank_notes(r) == {0: "group_0: device", 1: cached}, r.notes
    big_cache = 100_000 * (144 + 16) + 500_000 * 4  # 3125 sets of 32 rows of 144 bytes
    text = next(n for n in r.notes if n.startswith("rank 1 under"))
    assert f"take {fxrec.planner.format_bytes(big_cache + 200_000 * 256 + small)} of" in text, text
    r = fxrec.explain(model, INPUTS, device="cuda", plan=plan, mode="inference", quantize=q, hbm_budget=budget - 1)
    assert rank_notes(r) == {0: cached, 1: cached}
    r = fxrec.explain(model, INPUTS, device="cuda", plan=plan, mode="inference", quantize=q, hbm_budget="50MB")
    assert rank_notes(r) == {0: cached, 1: "group_0: device+managed_caching (big: managed_caching, mid: managed_caching; "
                                           "HBM cache 0.2 of the cached rows)"}, r.notes
    text = next(n for n in r.notes if n.startswith("rank 1 under"))  # (one cache: 700k rows, rows of 256 bytes)
    assert f"take {fxrec.planner.format_bytes(140_000 * (256 + 16) + 700_000 * 4 + small)} of" in text, text
    with pytest.raises(InputError, match="rank 0's embedding tables need 64 KB .*shard the data-parallel tables"):
        fxrec.explain(model, INPUTS, device="cuda", plan=plan, mode="inference", quantize=q, hbm_budget=small - 1)
    pins = {"big": "row_wise", "mid": "row_wise", "small": ("table_wise", 0)}
    r = fxrec.explain(model, INPUTS, device="cuda", plan=plan_of(pins, None, model), mode="inference",
                      quantize="int8", hbm_budget="1MB")
    # (rank 0: small's 1000 int8 rows of 32 bytes fit once big's and mid's blocks moved, without a cache)
    assert rank_notes(r) == {0: "group_0: device+managed (big: managed, mid: managed)",
                             1: "group_0: managed (big: managed, mid: managed)"}, r.notes


def test_explain_refuses_the_quantized_plans_transform_refuses():
    model = ThreeTables()
    with pytest.raises(InputError, match="'small' is planned data_parallel"):
        fxrec.explain(model, INPUTS, device="cuda", plan=plan_of(optimizer=None, model=model), mode="inference",
                      quantize="int8", hbm_budget="1GB")


def test_a_rank_whose_pieces_do_not_fit_is_named_with_its_bytes_and_what_would_help():
    with pytest.raises(InputError, match=r"^fxrec: rank 0's embedding tables need .* more than hbm_budget=10 MB: "
                                         r"raise the budget, lower cache_load_factor, shard the data-parallel tables "
                                         r"\['small'\], or shard the tables over more GPUs$"):
        fxrec.explain(meta_model(), INPUTS, device="cuda", plan=plan_of(), optimizer=SGD, hbm_budget="10MB")


def test_every_rank_is_checked_and_the_first_eight_are_noted():
    """12 ranks, big row-wise: rank 11 holds the last rows and mid too, over a budget the others meet."""
    pins = {"big": "row_wise", "mid": ("table_wise", 11), "small": "data_parallel"}
    plan = fxrec.plan(meta_model(), INPUTS, world_size=12, memory_per_rank="2GB", pins=pins, optimizer=SGD)
    block = 1_000_000 // 12 + 1
    fits = (block * 128 + 1000 * 16 * 2) * 4 + 10 * MB  # the other ranks, not rank 11 (51.2 MB of mid more)
    with pytest.raises(InputError, match="rank 11's embedding tables"):
        fxrec.explain(meta_model(), INPUTS, device="cuda", plan=plan, optimizer=SGD, hbm_budget=fits,
                      cache_load_factor=1.0)
    r = fxrec.explain(meta_model(), INPUTS, device="cuda", plan=plan, optimizer=SGD, hbm_budget="1GB")
    assert sorted(rank_notes(r)) == list(range(8))


def test_training_with_pytorchs_gradients_keeps_the_pieces_in_gpu_memory():
    plan = plan_of(optimizer=None)
    r = fxrec.explain(meta_model(), INPUTS, device="cuda", plan=plan, hbm_budget="1GB")
    assert rank_notes(r) == {0: "group_0: device", 1: "group_0: device"}
    # rank 0: 500k x 128 rows and as large a gradient, which no placement moves
    with pytest.raises(InputError, match="rank 0's embedding tables need 512 MB .*cache_load_factor, fuse the optimizer"):
        fxrec.explain(meta_model(), INPUTS, device="cuda", plan=plan, hbm_budget="400MB")


def test_on_cpu_a_budget_with_a_plan_places_nothing():
    r = fxrec.explain(meta_model(), INPUTS, device="cpu", plan=plan_of(), optimizer=SGD, hbm_budget="1KB")
    assert not rank_notes(r)
    assert any("no group runs on CUDA here (cpu): it changed nothing" in n for n in r.notes), r.notes


# --- a sharded run at world size 2 on gloo: the budget changes nothing on CPU, and the check that
# each rank's built groups hold what the plan gives it (which explain's decision reads) runs


def _worker(rank, world, init_file, result_dir):
    import os

    from fxrec.pass_infra import PassError
    from fxrec.passes import place_shards
    from tests import test_sharding as S

    torch.set_num_threads(1)
    with S.gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = S.Model()
        example = S.local_batch(S.global_batch(S.LOCAL_B * world, 0), rank, S.LOCAL_B)
        pins = {"bags.0": ("table_wise", 1), "bags.1": "row_wise", "bags.2": {"sharding": "column_wise", "ranks": [1, 0]},
                "single": "row_wise"}
        plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins=pins, optimizer="sgd")
        runs = [fxrec.transform(model, example, plan=plan, optimizer=fxrec.optim.SGD(lr=0.1), **kw)
                for kw in ({}, {"hbm_budget": "1KB"})]
        for step in range(3):
            x = S.local_batch(S.global_batch(S.LOCAL_B * world, step + 1), rank, S.LOCAL_B)
            outs = [m(*x) for m in runs]
            assert torch.equal(outs[0], outs[1]), step
            for o in outs:
                o.sum().backward()
        for (k, a), (_, b) in zip(runs[0].state_dict().items(), runs[1].state_dict().items()):
            assert torch.equal(a, b), k
        # the check reads the built groups against the plan: a rank reading one row less is caught
        real = place_shards._pieces

        def off_by_one(*args):
            pieces, table_of = real(*args)
            return [(r, rows - 1 if r.table == "bags.1" else rows, cols) for r, rows, cols in pieces], table_of

        place_shards._pieces = off_by_one
        try:
            fxrec.transform(model, example, plan=plan, optimizer=fxrec.optim.SGD(lr=0.1), hbm_budget="1KB")
        except PassError as e:
            assert "is not what the plan gives it" in str(e), e
        else:
            raise AssertionError("the check passed groups the plan does not give")
        finally:
            place_shards._pieces = real
        with open(os.path.join(result_dir, f"ok.{rank}"), "w") as fh:
            fh.write("ok")
    # (torch 2.13 + gloo sometimes aborts at interpreter exit, a gloo thread freeing tensors during
    # shutdown, as tests/test_sharding.py's workers note: the work is checked, leave without it)
    os._exit(0)


def test_a_sharded_model_with_a_budget_runs_as_without_on_cpu_and_its_groups_are_checked(tmp_path):
    from tests.test_sharding import spawn

    spawn(_worker, 2, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.0", "ok.1"]


def test_a_quantized_local_group_takes_its_placements_and_keeps_its_outputs():
    """What the pass does to a rank's quantized local group on CUDA, done on CPU (where every table
    is in host memory): its moved tables placed "managed", which the layout for CUDA reads (their
    rows in the uvm buffer), the rows packed again from where they are, the outputs unchanged; the
    same placements again change nothing."""
    from fxrec.passes.place_shards import _place_quantized
    from fxrec.runtime.kernels import fbgemm_nbit
    from tests import models as M
    from tests.test_quantize import _quantized_groups

    rows = (50, 30, 20)
    model = M.BagList(rows=rows, dim=24).eval()
    x = M.bag_inputs(rows=rows, max_len=4)
    fast = fxrec.transform(model, x, mode="inference", quantize="int8")
    (group,) = _quantized_groups(fast)
    with torch.no_grad():
        want = fast(*x)
    names = [t.name for t in group.tables]
    _place_quantized(group, {names[0]: "managed", names[2]: "managed"}, 0.2)
    assert [t.placement for t in group.tables] == ["managed", "device", "managed"]
    assert group.q_where == ("managed", "device", "managed")
    assert group.q_weights_uvm.numel() == 0 and set(group.q_weights_placements.tolist()) == {3}  # (CPU: HOST)
    rows_now = group.q_weights
    with torch.no_grad():
        torch.testing.assert_close(fast(*x), want, rtol=0, atol=0)
    _place_quantized(group, {names[0]: "managed", names[2]: "managed"}, 0.2)
    assert group.q_weights is rows_now
    ftm = [f.table for f in group.features]
    _, uvm, places, _ = fbgemm_nbit.relayout(
        group.q_packed, ftm, (group.q_weights, group.q_weights_uvm), group.q_weights_placements,
        group.q_weights_offsets, 1, torch.device("cpu"), group.q_where, new_alignment=16)
    assert places.tolist() == [1 if group.q_where[t] == "managed" else 3 for t in ftm]  # MANAGED 1, HOST 3
    assert (50 + 20) * 32 <= uvm.numel() < (50 + 30 + 20) * 32  # int8 at dim 24: 28 bytes, rows of 32
