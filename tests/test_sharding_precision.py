"""weights_precision= with a sharding plan (gloo, CPU, two and four processes): each rank stores
the shards it holds in fp16 in its group's fbgemm TBE, trained by the fused optimizer; the
data-parallel tables stay fp32. The reference is the single-process model transformed with the
same weights_precision (its tables in one fp16 TBE, tests/test_weights_precision.py compares that
with the plain model)."""

import copy
import os

import pytest
import torch
import torch.distributed as dist

import fxrec
from tests.test_sharding import (
    _FUSED, LOCAL_B, Model, _held_part, error_of, global_batch, gloo_group, held_bytes, local_batch, message_of,
    spawn,
)
from tests.test_weights_precision import within_one_rounding_step

PINS = {"bags.0": ("table_wise", 1), "bags.1": "row_wise", "single": "data_parallel",
        "bags.2": {"sharding": "column_wise", "ranks": [1, 0]}}
STEPS = 6


def _pins(opt_name):
    # row-wise Adagrad's per-row state needs whole rows: no column-wise table with it
    return dict(PINS, **({"bags.2": ("table_wise", 0)} if opt_name == "rowwise_adagrad" else {}))


def _train_worker(rank, world, init_file, opt_name):
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = Model()
        # the reference stores the tables the plan shards in fp16 and keeps the data-parallel one fp32
        single = fxrec.transform(copy.deepcopy(model), global_batch(LOCAL_B * world, 0), optimizer=_FUSED[opt_name](),
                                 weights_precision={"bags.*": "fp16"})
        example = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)
        plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins=_pins(opt_name),
                          optimizer=opt_name, weights_precision="fp16")
        fast = fxrec.transform(model, example, plan=plan, optimizer=_FUSED[opt_name](), weights_precision="fp16")
        params = dict(fast.named_parameters())
        # the sharded tables' pieces are fp16 (as the single-process model's tables), the
        # data-parallel one fp32
        assert {n: p.dtype for n, p in params.items() if not n.startswith("top.")} == {
            **{f"{t}.weight": torch.float16 for t, tp in plan.tables.items()
               if tp.sharding != "data_parallel" and f"{t}.weight" in params},
            "single.weight": torch.float32}
        for name, want in single.state_dict().items():  # the same fp16 rows to start from
            tp = plan.tables.get(name.rsplit(".", 1)[0])
            if name in params and tp is not None and tp.sharding != "data_parallel":
                assert torch.equal(params[name].detach(), _held_part(want, tp, rank)), name
        assert "weights stored in fp16 in fbgemm's TBE" in str(fast.report)
        opt, ref_opt = fast.make_optimizer(lr=0.05), single.make_optimizer(lr=0.05)
        moved = 0
        for step in range(STEPS):
            x = global_batch(LOCAL_B * world, step + 1)
            cot = torch.randn(LOCAL_B * world, generator=torch.Generator().manual_seed(100 + step))
            before = {n: _held_part(p.detach().clone(), plan.tables.get(n.rsplit(".", 1)[0]), rank)
                      for n, p in single.state_dict().items() if n in params}
            want = single(*x)
            got = fast(*local_batch(x, rank, LOCAL_B))
            torch.testing.assert_close(got, want[rank * LOCAL_B:(rank + 1) * LOCAL_B], rtol=1e-5, atol=1e-6,
                                       msg=f"step {step} forward")
            for o, loss in ((ref_opt, (want * cot).sum()), (opt, (got * cot[rank * LOCAL_B:(rank + 1) * LOCAL_B]).sum())):
                o.zero_grad()
                loss.backward()
                o.step()
            for name, want_p in single.state_dict().items():
                if name not in params:
                    continue
                tp = plan.tables.get(name.rsplit(".", 1)[0])
                got_p, want_p = params[name].detach(), _held_part(want_p, tp, rank)
                if tp is not None and tp.sharding != "data_parallel":
                    # the same fused fp16 update of the same rows, from gradients summed in another
                    # order (fp32 rounding): a result at a rounding midpoint may go the other way
                    # (measured here: none did)
                    assert within_one_rounding_step(got_p, want_p, before[name]), (step, name)
                    moved += int((got_p != before[name]).sum())
                else:
                    torch.testing.assert_close(got_p, want_p, rtol=1e-5, atol=1e-6, msg=f"step {step} {name}")
        assert moved > 100, moved  # the shards trained (a rank holds 376 or 696 fp16 values)
        held = held_bytes(fast, plan, opt)  # 2 bytes a stored value: the plan counted them so
        assert held == plan.rank_bytes()[rank], (held, plan.rank_bytes()[rank])
        dist.barrier()
    os._exit(0)


@pytest.mark.parametrize("opt_name", ["sgd", "rowwise_adagrad"])
def test_a_mixed_plan_stores_its_shards_in_fp16_and_trains_as_one_process(opt_name):
    """Table-wise, row-wise, column-wise (not with row-wise Adagrad) and data-parallel tables at
    once, fused: 6 steps give the single-process fp16 model's outputs, every shard within one
    fp16 step of its rows there, and each rank holds the bytes the fp16 plan says."""
    spawn(_train_worker, 2, opt_name)


def _fused_states(m) -> dict:
    """Each table's (this rank's piece's) fused optimizer state, by parameter name."""
    out = {}
    for name, fqns in m.meta["fxrec_fused_groups"]:
        per_table = m.get_submodule(name).optimizer_states([m.get_parameter(f) for f in fqns])
        out.update({f: st["sum"].detach().clone() for f, st in zip(fqns, per_table)})
    return out


_G = 24  # the global batch of the checkpoint test, at every world size


def _ckpt_worker(rank, world, init_file, ckpt, phase):
    """phase 0 (world size 2): 3 steps under plan A, save. phase 1 (world size 4): load under plan
    B, where every table moves, and into one process; the shards and fused states are the saved
    ones exactly, and 3 more steps go as in one process."""
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = Model()
        b = _G // world
        example = local_batch(global_batch(_G, 0), rank, b)
        pins = ({"bags.0": ("table_wise", 1), "bags.1": "row_wise", "bags.2": ("table_wise", 0), "single": "data_parallel"}
                if phase == 0 else
                {"bags.0": "row_wise", "bags.1": ("table_wise", 3), "bags.2": "row_wise", "single": "data_parallel"})
        plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins=pins,
                          optimizer="rowwise_adagrad", weights_precision="fp16")
        fast = fxrec.transform(copy.deepcopy(model), example, plan=plan, optimizer=_FUSED["rowwise_adagrad"](),
                               weights_precision="fp16")
        opt = fast.make_optimizer(lr=0.05)

        def step(m, o, s, whole):
            x = global_batch(_G, s + 1)
            cot = torch.randn(_G, generator=torch.Generator().manual_seed(100 + s))
            loss = (m(*x) * cot).sum() if whole else (m(*local_batch(x, rank, b)) * cot[rank * b:(rank + 1) * b]).sum()
            o.zero_grad()
            loss.backward()
            o.step()

        if phase == 0:
            for s in range(3):
                step(fast, opt, s, False)
            fxrec.checkpoint.save(fast, ckpt)
        else:
            fxrec.checkpoint.load(fast, ckpt)
            one = fxrec.transform(copy.deepcopy(model), global_batch(_G, 0), optimizer=_FUSED["rowwise_adagrad"](),
                                  weights_precision={"bags.*": "fp16"})
            fxrec.checkpoint.load_into_model(one, ckpt)
            one_opt = one.make_optimizer(lr=0.05)
            params = dict(fast.named_parameters())
            mine, whole = _fused_states(fast), _fused_states(one)
            assert set(mine) == {n for n in params if n.startswith("bags.")}, sorted(mine)
            for name, state in mine.items():  # row-wise Adagrad's fp32 state of the rows held here
                assert torch.equal(state, _held_part(whole[name], plan.tables[name.rsplit(".", 1)[0]], rank)), name
            for s in range(3, 6):
                before = {n: p.detach().clone() for n, p in params.items()}
                with torch.no_grad():
                    want = one(*global_batch(_G, s + 1))
                    got = fast(*local_batch(global_batch(_G, s + 1), rank, b))
                torch.testing.assert_close(got, want[rank * b:(rank + 1) * b], rtol=1e-5, atol=1e-6, msg=f"step {s}")
                for name, want_p in one.state_dict().items():
                    tp = plan.tables.get(name.rsplit(".", 1)[0])
                    if name not in params or tp is None or tp.sharding == "data_parallel":
                        continue
                    assert params[name].dtype == torch.float16, name
                    held = _held_part(want_p, tp, rank)
                    if s == 3:  # as loaded: the saved fp16 rows exactly
                        assert torch.equal(params[name].detach(), held), name
                    else:
                        assert within_one_rounding_step(params[name].detach(), held, before[name]), (s, name)
                step(fast, opt, s, False)
                step(one, one_opt, s, True)
        dist.barrier()
    os._exit(0)


def test_fp16_shards_checkpoint_at_world_2_and_load_at_world_4_under_another_plan(tmp_path):
    """Save a row-wise Adagrad fp16 model at world size 2, load it at world size 4 with every
    sharded table moved (table-wise <-> row-wise) and into one process: the fp16 rows come back
    exactly, and training goes on as in the one process."""
    ckpt = str(tmp_path / "ckpt")
    spawn(_ckpt_worker, 2, ckpt, 0)
    spawn(_ckpt_worker, 4, ckpt, 1)


def _refusals(rank, world):
    """Every refusal's message, in one ValueError."""
    model = Model()
    example = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)
    sgd = fxrec.optim.SGD(lr=0.1)
    msgs = []
    for plan_wp, kw in (
            ("fp16", {"optimizer": sgd, "weights_precision": {"bags.*": "fp16", "single": "fp16"}}),
            ("fp16", {"optimizer": sgd, "weights_precision": {"bags.*": "fp16", "sing*": "fp16"}}),
            ("fp16", {"weights_precision": "fp16"}),  # no fused optimizer: torch.optim would step fp16 shards
            ("fp16", {"optimizer": sgd}),  # the plan counts fp16 rows, transform would hold fp32 ones
            (None, {"optimizer": sgd, "weights_precision": "fp16"})):  # and the other way round
        plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins=PINS,
                          weights_precision=plan_wp)
        msgs.append(message_of(lambda: fxrec.transform(copy.deepcopy(model), example, plan=plan, **kw)))
    raise ValueError(" || ".join(msgs))


def test_refusals_name_the_table_and_what_to_do(tmp_path):
    """A dict key naming only data-parallel tables (exactly or by a glob), fp16 shards without a
    fused optimizer, and a plan and transform that disagree on the precision."""
    named, globbed, unfused, plan_only, transform_only = error_of(tmp_path, 2, _refusals).split(" || ")
    for msg, key in ((named, "'single'"), (globbed, "'sing*'")):
        assert f"weights_precision key {key} names only the tables ['single'], which the plan makes data_parallel" \
            in msg, msg
    assert "weights_precision='fp16' for tables" in unfused and "fbgemm cannot run them here" in unfused, unfused
    assert "the plan counts table 'bags.0' stored in fp16" in plan_only and "stores it as the model holds it" in \
        plan_only and "same weights_precision=" in plan_only, plan_only
    assert "the plan counts table 'bags.0' stored as the model holds it" in transform_only and "stores it in fp16" \
        in transform_only, transform_only


class _PaddedOnRankOne(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.EmbeddingBag(10, 8, mode="sum")
        self.b = torch.nn.EmbeddingBag(7, 5, mode="sum")  # dim 5: stored padded in fbgemm's TBE

    def forward(self, a, ao, b, bo):
        return torch.cat([self.a(a, ao), self.b(b, bo)], 1)


def _refused_where_the_table_is(rank, world):
    model = _PaddedOnRankOne()
    ex = (torch.tensor([1, 2, 7, 9, 3, 0]), torch.tensor([0, 2, 4]), torch.tensor([1, 2, 5, 4]), torch.tensor([0, 1, 3]))
    opt = fxrec.optim.RowWiseAdagrad(lr=0.1)
    plan = fxrec.plan(model, ex, world_size=world, memory_per_rank="1GB", batch_size=3, optimizer=opt,
                      weights_precision="fp16", pins={"a": ("table_wise", 0), "b": ("table_wise", 1)})
    fxrec.transform(model, ex, plan=plan, optimizer=opt, weights_precision="fp16")


def test_a_refusal_on_the_rank_that_holds_the_table_stops_every_rank_at_once(tmp_path):
    """Only rank 1 holds table 'b', which fbgemm cannot store in fp16 for row-wise Adagrad: rank 0
    went on and waited in DDP's set-up for the process group's timeout (30 minutes by default)."""
    msg = error_of(tmp_path, 2, _refused_where_the_table_is)
    assert msg == "fxrec: transform failed on rank(s) [1] (their error says why); this rank stops with them", msg


def _meta_and_sequence_worker(rank, world, init_file):
    from tests import test_sharding_sequence as S

    with gloo_group(rank, world, init_file):
        with torch.device("meta"):  # a model that never exists whole: each rank makes its fp16 shards
            model = Model()
        example = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)
        plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins=PINS, optimizer="sgd",
                          weights_precision="fp16")
        fast = fxrec.transform(model, example, plan=plan, optimizer=fxrec.optim.SGD(lr=0.1), weights_precision="fp16")
        for name, p in fast.named_parameters():
            if name.startswith("bags."):  # nn.EmbeddingBag's own initialiser (normal_), stored in fp16
                assert p.dtype == torch.float16 and 0.7 < float(p.float().std()) < 1.3, (name, p.dtype)
        assert fast.get_parameter("single.weight").dtype == torch.float32
        # sequence (unpooled) features of row-wise and table-wise tables, stored in fp16
        torch.manual_seed(0)
        seq = S.SeqModel()
        pins = {"hist": "row_wise", "cat": ("table_wise", 1), "bag": ("table_wise", 0)}
        one = fxrec.transform(copy.deepcopy(seq), S.global_of([S.batch_of(r, 0, uneven=False) for r in range(world)]),
                              optimizer=fxrec.optim.SGD(lr=0.1), weights_precision="fp16")
        splan = fxrec.plan(seq, S.batch_of(rank, 0), world_size=world, memory_per_rank="1GB", pins=pins,
                           optimizer="sgd", weights_precision="fp16")
        sharded = fxrec.transform(seq, S.batch_of(rank, 0), plan=splan, optimizer=fxrec.optim.SGD(lr=0.1),
                                  weights_precision="fp16")
        assert {n: p.dtype for n, p in sharded.named_parameters() if not n.startswith("top.")} == \
            {n: torch.float16 for n in ("hist.weight", "cat.weight" if rank == 1 else "bag.weight")}
        opt, one_opt = sharded.make_optimizer(lr=0.05), one.make_optimizer(lr=0.05)
        for step in range(3):
            xs = [S.batch_of(r, step + 1, uneven=False) for r in range(world)]
            want, got = one(*S.global_of(xs)), sharded(*xs[rank])
            torch.testing.assert_close(got, want[rank * S.B:(rank + 1) * S.B], rtol=1e-5, atol=1e-6, msg=f"step {step}")
            for o, out in ((one_opt, want), (opt, got)):
                o.zero_grad()
                out.sum().backward()
                o.step()
        dist.barrier()
    os._exit(0)


def test_a_meta_model_and_sequence_features_store_their_shards_in_fp16():
    """A model built on meta gets fp16 shards from the tables' own initialiser; sequence features
    of row-wise and table-wise fp16 tables give the single-process fp16 model's outputs over 3 steps."""
    spawn(_meta_and_sequence_worker, 2)
