"""Quantized serving with a sharding plan (gloo, CPU): each rank's shards are quantized by
fbgemm's IntNBit TBE and every rank gets the single-process quantized model's rows of the global
batch, for pooled (table-wise, row-wise, column-wise fp16) and sequence features."""

import os

import pytest
import torch
import torch.distributed as dist

import fxrec

from .test_sharding import LOCAL_B, Model, error_of, global_batch, gloo_group, local_batch, spawn
from .test_sharding_sequence import SeqModel, batch_of, global_of


class _Fp16Model(Model):
    """The pooled model's lookups only, summed (output_dtype="fp16": the rows stay fp16)."""

    def forward(self, dense, ids, offsets, single_ids):
        parts = [b(i, o) for b, i, o in zip(self.bags, ids, offsets)] + [self.single(single_ids)]
        return torch.cat(parts, 1).sum(1)


class _FloatModel(Model):
    """The lookups concatenated and converted with ``.float()`` (a no-op on fp32, which torch.export
    records as a dtype check), then the model's fp32 top."""

    def forward(self, dense, ids, offsets, single_ids):
        parts = [b(i, o) for b, i, o in zip(self.bags, ids, offsets)] + [self.single(single_ids)]
        return self.top(torch.cat([torch.cat(parts, 1).float(), dense], 1)).squeeze(1)


class _Fp16SeqModel(SeqModel):
    """The sequence model's lookups only, unpooled rows flattened and summed."""

    def forward(self, target, hist, cats, bag_ids, bag_offsets):
        parts = [self.hist(target), self.hist(hist).flatten(1), self.cat(cats).flatten(1), self.bag(bag_ids, bag_offsets)]
        return torch.cat(parts, 1).sum(1)


def _worker(rank, world, init_file, which, pins, quantize, output_dtype="fp32", serving=True):
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        if which in ("pooled", "float"):
            model = _FloatModel() if which == "float" else Model() if output_dtype == "fp32" else _Fp16Model()
            batches = [global_batch(LOCAL_B * world, s) for s in range(3)]
            local = [local_batch(x, rank, LOCAL_B) for x in batches]
            b = LOCAL_B
        else:
            model = SeqModel() if output_dtype == "fp32" else _Fp16SeqModel()
            local = [batch_of(rank, s, uneven=False) for s in range(3)]
            batches = [global_of([batch_of(r, s, uneven=False) for r in range(world)]) for s in range(3)]
            b = local[0][0].shape[0]
        kw = dict(mode="inference", quantize=quantize, output_dtype=output_dtype)
        single = fxrec.transform(model, batches[0], **kw)
        # (a plan for serving, sized as served; or one made for training, which serving takes too)
        plan = fxrec.plan(model, local[0], world_size=world, memory_per_rank="1GB", pins=pins,
                          quantize=quantize if serving else None)
        assert plan.serving == serving
        fast = fxrec.transform(model, local[0], plan=plan, **kw)
        from fxrec.runtime.quantized import QuantizedPooledGroup, QuantizedSequenceGroup

        groups = [m.group for _, m in fast.named_modules() if getattr(m, "group", None) is not None]
        assert all(isinstance(g, (QuantizedPooledGroup, QuantizedSequenceGroup)) for g in groups), groups
        holds = any(sh.rank == rank and sh.num_rows for tp in plan.tables.values() if tp.sharding != "data_parallel"
                    for sh in tp.shards)
        assert bool(groups) == holds, (groups, rank)
        # the fp32 tables of the sharded tables are gone: each rank keeps its quantized shards only
        sharded = {f"{t}.weight" for t, tp in plan.tables.items() if tp.sharding != "data_parallel"}
        assert not sharded & {n for n, _ in fast.named_parameters()}, list(fast.named_parameters())
        with torch.no_grad():
            for x, lx in zip(batches, local):
                want = single(*x)[rank * b:(rank + 1) * b]
                got = fast(*lx)
                tol = dict(rtol=2e-3, atol=2e-3) if output_dtype == "fp16" else {}  # fp16 partial sums
                torch.testing.assert_close(got, want, **tol)
        dist.barrier()
    os._exit(0)


@pytest.mark.parametrize("quantize,pins", [
    ("int8", {"bags.0": ("table_wise", 1), "bags.1": "row_wise", "bags.2": ("table_wise", 0), "single": "row_wise"}),
    ("int4", {"bags.0": "row_wise", "bags.1": ("table_wise", 0), "bags.2": "row_wise", "single": ("table_wise", 1)}),
    ({"bags.2": "fp16", "single": "fp32", "*": "int8"},
     {"bags.0": ("table_wise", 1), "bags.1": "row_wise", "bags.2": {"sharding": "column_wise", "ranks": [1, 0]},
      "single": "data_parallel"}),
], ids=["int8", "int4", "fp16_column_wise_and_fp32_data_parallel"])
def test_quantized_sharded_serving_equals_single_process_quantized_serving(quantize, pins):
    spawn(_worker, 2, "pooled", pins, quantize)


def test_a_plan_made_for_training_serves_quantized_too():
    spawn(_worker, 2, "pooled", {"bags.0": "row_wise", "bags.1": ("table_wise", 0), "bags.2": "row_wise",
                                 "single": "data_parallel"}, {"single": "fp32", "*": "int8"}, "fp32", False)


def test_quantized_sharded_sequence_features_equal_single_process_quantized_serving():
    spawn(_worker, 2, "sequence", {"hist": "row_wise", "cat": ("table_wise", 1), "bag": ("table_wise", 0)}, "int8")


def test_fp16_outputs_that_the_model_converts_to_fp32_are_converted():
    """(Its recorded dtype checks after the sharded groups go, as after unsharded ones: tests/test_quantize.py.)"""
    spawn(_worker, 2, "float", {"bags.0": ("table_wise", 1), "bags.1": "row_wise", "bags.2": ("table_wise", 0),
                                "single": ("table_wise", 1)}, "int8", "fp16")


def test_fp16_outputs_when_a_rank_owns_no_table_wise_table():
    """Rank 0 owns no table-wise table and no sequence table: it still sends (no) rows in fp16."""
    spawn(_worker, 2, "pooled", {"bags.0": ("table_wise", 1), "bags.1": ("table_wise", 1), "bags.2": "row_wise",
                                 "single": ("table_wise", 1)}, "int8", "fp16")
    spawn(_worker, 2, "sequence", {"hist": ("table_wise", 1), "cat": ("table_wise", 1), "bag": ("table_wise", 1)},
          "int8", "fp16")


def test_fp16_outputs_of_data_parallel_tables_are_fp16_as_in_one_process():
    """A data-parallel table stays the model's own fp32 lookup; with output_dtype="fp16" it gives
    its rows rounded to fp16, as one process's quantized group does (it gave fp32, and the whole
    output became fp32: found by a fuzz against one process). Pooled bags, single ids, and the
    sequence model's unpooled rows."""
    spawn(_worker, 2, "pooled", {"bags.0": ("table_wise", 1), "bags.1": "data_parallel", "bags.2": "row_wise",
                                 "single": "data_parallel"},
          {"bags.1": "fp32", "single": "fp32", "*": "int8"}, "fp16")
    spawn(_worker, 2, "sequence", {"hist": "row_wise", "cat": "data_parallel", "bag": ("table_wise", 0)},
          {"cat": "fp32", "*": "int8"}, "fp16")


class _MeanOf300(torch.nn.Module):
    """Mean bags whose sums pass fp16's range (300 ids of 300.0: 90000 > 65504) and whose means do not."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.EmbeddingBag(40, 8, mode="mean")
        self.b = torch.nn.EmbeddingBag(30, 8, mode="mean")
        with torch.no_grad():
            self.a.weight.fill_(300.0)

    def forward(self, ia, oa, ib, ob):
        return torch.cat([self.a(ia, oa), self.b(ib, ob)], 1)


def _mean_fp16_worker(rank, world, init_file, pin):
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = _MeanOf300()
        g = torch.Generator().manual_seed(rank)
        b = 3
        x = (torch.randint(0, 40, (300 * b,), generator=g), torch.arange(0, 300 * b, 300),
             torch.randint(0, 30, (2 * b,), generator=g), torch.arange(0, 2 * b, 2))
        kw = dict(mode="inference", quantize="fp16", output_dtype="fp16")
        single = fxrec.transform(model, x, **kw)
        plan = fxrec.plan(model, x, world_size=world, memory_per_rank="1GB", pins={"a": pin, "b": ("table_wise", 0)})
        fast = fxrec.transform(model, x, plan=plan, **kw)
        with torch.no_grad():
            got, want = fast(*x), single(*x)
        assert got.dtype == torch.float16 and bool(torch.all(got[:, :8] == 300.0)), got[:, :8]
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        dist.barrier()
    os._exit(0)


@pytest.mark.parametrize("pin", [("table_wise", 1), "row_wise", {"sharding": "column_wise", "ranks": [1, 0]}],
                         ids=["table_wise", "row_wise", "column_wise"])
def test_fp16_outputs_of_mean_bags_whose_sums_pass_fp16s_range(pin):
    """Sums that are divided (mean) or added (row-wise partial sums) travel in fp32 and are rounded
    to fp16 once, after: the single-process quantized model's answer, not inf."""
    spawn(_mean_fp16_worker, 2, pin)


def _serve_quantized(rank, world, pins, quantize):
    model = Model()
    example = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)
    plan = fxrec.plan(model, global_batch(LOCAL_B * world, 0), world_size=world, memory_per_rank="1GB", pins=pins,
                      batch_size=LOCAL_B)  # (the same plan on every rank)
    fxrec.transform(model, example, mode="inference", quantize=quantize, plan=plan)


@pytest.mark.parametrize("pins,want", [
    ({"bags.1": {"sharding": "column_wise", "ranks": [0, 1]}}, ["'bags.1'", "column_wise", "int8", "scale"]),
    ({"single": "data_parallel", "bags.0": "row_wise"}, ["'single'", "data_parallel", "fp32"]),
], ids=["int8_column_wise", "int8_data_parallel"])
def test_what_a_plan_cannot_serve_quantized_is_refused_naming_the_table(tmp_path, pins, want):
    msg = error_of(tmp_path, 2, _serve_quantized, pins, "int8")
    assert all(w in msg for w in want), msg


def _int8_row_wise(rank, world):
    """The model served int8 with bags.0 row-wise, for this rank: (model, local example, served model)."""
    model = Model()
    example = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)
    plan = fxrec.plan(model, global_batch(LOCAL_B * world, 0), world_size=world, memory_per_rank="1GB",
                      pins={"bags.0": "row_wise"}, batch_size=LOCAL_B)
    fast = fxrec.transform(model, example, mode="inference", quantize="int8", plan=plan)
    return model, example, fast


def _export_sharded(rank, world):
    model, example, fast = _int8_row_wise(rank, world)
    msgs = []
    for call in (lambda: fxrec.export.torchscript(fast), lambda: fxrec.export.program(fast, example)):
        try:
            call()
            msgs.append("no error")
        except ValueError as e:
            msgs.append(str(e))
    # a plan that keeps every table whole has no collectives: it exports
    whole = fxrec.plan(model, global_batch(LOCAL_B * world, 0), world_size=world, memory_per_rank="1GB",
                       pins={t: "data_parallel" for t in ("bags.0", "bags.1", "bags.2", "single")}, batch_size=LOCAL_B)
    dp = fxrec.transform(model, example, mode="inference", plan=whole)
    torch.testing.assert_close(fxrec.export.torchscript(dp)(*example), model(*example))
    raise ValueError(" || ".join(msgs))


def test_exporting_a_sharded_model_is_refused_saying_how_to_serve_it(tmp_path):
    """It failed inside TorchScript (try blocks) and torch.export (a data-dependent guard) with
    their own errors (found by a composition hunt). A plan without collectives exports."""
    script, prog = error_of(tmp_path, 2, _export_sharded).split(" || ")
    for who, msg in (("torchscript", script), ("program", prog)):
        assert f"fxrec.export.{who}: the model is sharded over ranks" in msg and "without a plan" in msg, msg


def _checkpoint_quantized_sharded(rank, world, path):
    _, _, fast = _int8_row_wise(rank, world)
    msgs = []
    for call in (lambda: fxrec.checkpoint.save(fast, os.path.join(path, "q")),
                 lambda: fxrec.checkpoint.load(fast, os.path.join(path, "q"))):
        try:
            call()
            msgs.append("no error")
        except fxrec.checkpoint.CheckpointError as e:
            msgs.append(str(e))
    dist.barrier()  # (every rank refused before any collective: none waits for another)
    raise ValueError(" || ".join(msgs))


def test_checkpoints_of_a_sharded_quantized_model_are_refused_saying_how_to_serve_one(tmp_path):
    """Save said "the shard layout gives this rank pieces of table 'bags.0.weight', but the model has no
    such parameter", and load of a one-process int8 checkpoint "holds no quantized rows" (found by the
    sharded fuzzer): the shards are packed rows, which checkpoints do not hold."""
    save, load = error_of(tmp_path, 2, _checkpoint_quantized_sharded, str(tmp_path)).split(" || ")
    for who, msg in (("save", save), ("load", load)):
        assert f"fxrec.checkpoint.{who}: the model is sharded and quantized for serving (quantize='int8')" in msg, msg
        assert "load_into_model" in msg, msg
