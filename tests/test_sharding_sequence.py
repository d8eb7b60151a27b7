"""Unpooled (sequence) lookups of sharded tables, on torch.distributed (gloo, CPU): every rank
feeds its own local batch (ranks may feed sequences of different lengths) and must get what the
single-process model gives for that batch, forward, gradients through the collectives, and every
shard after training, unfused and with each fused optimizer."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fxrec

from .test_sharding import _FUSED, _held_part, error_of, gloo_group, message_of, spawn

ROWS = {"hist": 40, "cat": 30, "bag": 50}
B = 3


class SeqModel(nn.Module):
    """DIN-like: one table read as the target item (one id per sample) and as a history
    (``[B, L]``, one row per id, attended over); a second history table of dim 7 (stored at 8)
    in the same sequence group; a bag table."""

    def __init__(self):
        super().__init__()
        self.hist = nn.Embedding(ROWS["hist"], 8)
        self.cat = nn.Embedding(ROWS["cat"], 7)
        self.bag = nn.EmbeddingBag(ROWS["bag"], 8, mode="sum")
        self.top = nn.Linear(8 + 7 + 8 + 8, 1)

    def forward(self, target, hist, cats, bag_ids, bag_offsets):
        q = self.hist(target)                                   # [B, 8]
        h = self.hist(hist)                                     # [B, L, 8]
        att = torch.softmax((h * q[:, None]).sum(-1), 1)
        c = torch.tanh(self.cat(cats)).mean(1)                  # [B, L2, 7] -> [B, 7]
        u = self.bag(bag_ids, bag_offsets)
        return self.top(torch.cat([(att[..., None] * h).sum(1), c, u, q], 1)).squeeze(1)


def batch_of(rank: int, seed: int, uneven: bool = True):
    """Rank ``rank``'s local batch: with ``uneven``, its history lengths depend on the rank."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    L, L2 = (4 + rank, 2 + 2 * rank) if uneven else (4, 3)
    lengths = torch.randint(0, 3, (B,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    return (torch.randint(0, ROWS["hist"], (B,), generator=g), torch.randint(0, ROWS["hist"], (B, L), generator=g),
            torch.randint(0, ROWS["cat"], (B, L2), generator=g),
            torch.randint(0, ROWS["bag"], (int(lengths.sum()),), generator=g), offsets)


def global_of(xs):
    """The ranks' local batches (of one history length) as one global batch."""
    starts = [0]
    for x in xs[:-1]:
        starts.append(starts[-1] + x[3].numel())
    return (torch.cat([x[0] for x in xs]), torch.cat([x[1] for x in xs]), torch.cat([x[2] for x in xs]),
            torch.cat([x[3] for x in xs]), torch.cat([x[4] + s for x, s in zip(xs, starts)]))


def _worker(rank, world, init_file, pins, opt_name, steps, hosts):
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = SeqModel()
        fused = _FUSED[opt_name]() if opt_name else None
        example = batch_of(rank, 0, uneven=not fused)
        # the single-process model: the plain model run on every rank's batch in turn, or with a
        # fused optimizer the single-process fused model on the global batch
        single = fxrec.transform(copy.deepcopy(model), global_of([batch_of(r, 0, False) for r in range(world)]),
                                 optimizer=fused) if fused else copy.deepcopy(model)
        plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins=pins, hosts=hosts,
                          **({"optimizer": _FUSED[opt_name]()} if opt_name else {}))
        fast = fxrec.transform(model, example, plan=plan, optimizer=_FUSED[opt_name]() if opt_name else None)
        names = [type(fast.get_submodule(n.target)).__name__ for n in fast.graph.nodes if n.op == "call_module"]
        assert "SequenceInputDist" in names and "SequenceOutputDist" in names, names
        text = str(fast.report)  # the report prints, naming how the sequence tables are sharded
        assert all(plan.tables[t].sharding in text for t in ("hist", "cat")), text
        assert not any(n.op == "call_function" and "embedding" in str(n.target) and "bag" not in str(n.target)
                       for n in fast.graph.nodes), fast.code  # no plain unpooled lookup is left
        if opt_name:
            opt, ref_opt = fast.make_optimizer(lr=0.05), single.make_optimizer(lr=0.05)
            fused_tables = {f for _, fqns in fast.meta["fxrec_fused_groups"] for f in fqns}
            held = {n for n, p in fast.named_parameters() if p.numel()}  # table-row-wise: no rows on another host
            sharded = {f"{t}.weight" for t, tp in plan.tables.items() if tp.sharding != "data_parallel"}
            assert fused_tables == sharded & held, (fused_tables, sharded, held)
        else:
            opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (fast, single))
        for step in range(steps):
            # a fused update happens in each backward: the fused model takes the global batch at once
            xs = [batch_of(r, step + 1, uneven=not fused) for r in range(world)]
            cots = [torch.randn(B, generator=torch.Generator().manual_seed(100 * step + r)) for r in range(world)]
            wants = list(single(*global_of(xs)).split(B)) if fused else [single(*x) for x in xs]
            got = fast(*xs[rank])
            torch.testing.assert_close(got, wants[rank], rtol=1e-5, atol=1e-6, msg=f"step {step} forward")
            ref_opt.zero_grad()
            sum((w * c).sum() for w, c in zip(wants, cots)).backward()
            ref_opt.step()
            opt.zero_grad()
            (got * cots[rank]).sum().backward()
            opt.step()
        params = dict(fast.named_parameters())
        for name, want in single.state_dict().items():
            tp = plan.tables.get(name.rsplit(".", 1)[0])
            if tp is not None and tp.sharding == "table_wise" and tp.shards[0].rank != rank:
                assert name not in params, f"{name} is not rank {rank}'s"
                continue
            if tp is not None and not any(sh.rank == rank for sh in tp.shards):
                continue  # table-row-wise on another host
            torch.testing.assert_close(params[name].detach(), _held_part(want, tp, rank), rtol=1e-5, atol=1e-6,
                                       msg=name)
        dist.barrier()
    os._exit(0)


@pytest.mark.parametrize("pins", [
    {"hist": ("table_wise", 1), "cat": "row_wise", "bag": ("table_wise", 0)},
    {"hist": "row_wise", "cat": ("table_wise", 0), "bag": "data_parallel"},
], ids=["hist_table_wise", "hist_row_wise"])
def test_sequence_features_of_sharded_tables_match_the_single_process_model(pins):
    spawn(_worker, 2, pins, None, 6, 1)


@pytest.mark.parametrize("opt_name", list(_FUSED))
def test_sequence_features_with_fused_optimizers_match_the_single_process_fused_model(opt_name):
    pins = {"hist": "row_wise", "cat": ("table_wise", 1), "bag": ("table_wise", 0)}
    spawn(_worker, 2, pins, opt_name, 4, 1)


def test_sequence_features_table_row_wise_on_two_hosts_at_world_4():
    """Rows of one table over the ranks of one host (the other host's ranks hold none and get
    their rows from it), and a row-wise table over all four ranks, with fused row-wise Adagrad."""
    pins = {"hist": {"sharding": "table_row_wise", "ranks": [2, 3]}, "cat": "row_wise", "bag": ("table_wise", 3)}
    spawn(_worker, 4, pins, "rowwise_adagrad", 3, 2)


def test_the_planner_does_not_shard_unpooled_tables_by_columns():
    from fxrec.planner import TableSpec

    with pytest.raises(ValueError, match="'hist'.*unpooled.*not column_wise"):
        fxrec.plan(tables=[TableSpec("hist", 1000, 64, pooled=False)], world_size=2, memory_per_rank="1GB",
                   pins={"hist": "column_wise"})
    plan = fxrec.plan(tables=[TableSpec("hist", 10**6, 256, pooled=False, pooling_factor=50.0)], world_size=4,
                      memory_per_rank="600MB")
    assert plan.tables["hist"].sharding != "column_wise", plan.tables["hist"]
    wide = fxrec.plan(tables=[TableSpec("hist", 10**6, 256, pooling_factor=50.0)], world_size=4,
                      memory_per_rank="600MB")
    assert wide.tables["hist"].sharding == "column_wise", wide.tables["hist"]  # what the rule excludes above


def _column_wise_unpooled(rank, world):
    from fxrec.planner import TableSpec

    # a plan made from table specs that say (wrongly) the history table is pooled
    plan = fxrec.plan(tables=[TableSpec("hist", 40, 8), TableSpec("cat", 30, 7), TableSpec("bag", 50, 8)],
                      world_size=world, memory_per_rank="1GB",
                      pins={"hist": {"sharding": "column_wise", "ranks": [0, 1]}, "cat": ("table_wise", 0),
                            "bag": ("table_wise", 1)})
    fxrec.transform(SeqModel(), batch_of(rank, 0), plan=plan)


def test_a_column_wise_plan_of_an_unpooled_table_is_refused_naming_it(tmp_path):
    msg = error_of(tmp_path, 2, _column_wise_unpooled)
    assert "'hist'" in msg and "unpooled" in msg and "column_wise" in msg, msg


def _wrong_sizes_on_one_rank(rank, world):
    """Rank 0's messages: a target batch one short fed to rank 1, then to rank 0; then a good
    batch, which every rank runs as the plain model does."""
    torch.manual_seed(0)
    model, ref = SeqModel(), SeqModel()
    ref.load_state_dict(model.state_dict())
    xs = [batch_of(r, 0, uneven=False) for r in range(world)]
    plan = fxrec.plan(model, xs[rank], world_size=world, memory_per_rank="1GB",
                      pins={"hist": "row_wise", "cat": ("table_wise", 1), "bag": ("table_wise", 0)})
    fast = fxrec.transform(model, xs[rank], plan=plan)
    first = fast.fxrec_check_inputs.first_exchange
    assert first is not None and first[0].endswith("input_dist") and first[2] == 0, first  # a sequence dist's
    x = xs[rank]
    msgs = []
    for on in (1, 0):
        msgs.append(message_of(lambda: fast(*((x[0][:-1],) + x[1:] if rank == on else x))))
    good = [batch_of(r, 1, uneven=False) for r in range(world)]
    torch.testing.assert_close(fast(*good[rank]), ref(*global_of(good))[rank * B:(rank + 1) * B])
    raise ValueError(" || ".join(msgs))


def test_inputs_of_the_wrong_size_on_one_rank_stop_every_rank_at_the_first_sequence_exchange(tmp_path):
    there, here = error_of(tmp_path, 2, _wrong_sizes_on_one_rank).split(" || ")
    assert "rank(s) [1] were fed input they reject" in there, there
    assert "input target" in here, here
