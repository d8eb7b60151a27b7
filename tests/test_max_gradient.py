"""``transform(max_gradient=)``: every embedding lookup output's gradient clamped elementwise, as
fbgemm's ``gradient_clipping`` does, on every kernel, optimizer path and sharding type. The
reference is the plain model with a hook that clamps each nn.EmbeddingBag / nn.Embedding output's
gradient (written here, independently of fxrec), and fbgemm's own clipping called by hand."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

import fxrec
from tests import models as M
from tests.test_fused_optimizers import RowWiseAdagradReference, duplicate_heavy_inputs
from tests.test_sharding import LOCAL_B, Model, global_batch, gloo_group, local_batch, spawn

ROWS = (40, 30, 20)
LIMIT = 0.02


def clamp_lookup_gradients(model: nn.Module, limit: float) -> nn.Module:
    def hook(mod, inputs, out):
        if out.requires_grad:
            out.register_hook(lambda g: g.clamp(-limit, limit))

    for m in model.modules():
        if isinstance(m, (nn.EmbeddingBag, nn.Embedding)):
            m.register_forward_hook(hook)
    return model


OPTIMIZERS = {
    "none": (None, lambda p: torch.optim.SGD(p, lr=0.5)),
    "sgd": (fxrec.optim.SGD(lr=0.5), lambda p: torch.optim.SGD(p, lr=0.5)),
    "rowwise_adagrad": (fxrec.optim.RowWiseAdagrad(lr=0.1), lambda p: RowWiseAdagradReference(p, lr=0.1)),
    "adam_fallback": (fxrec.optim.Adam(lr=0.01), lambda p: torch.optim.Adam(p, lr=0.01)),
}


@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("backend", ["native", "reference", "fbgemm"])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_clamped_lookup_gradients_train_as_the_plain_model_with_clamped_outputs(opt, backend, pooling):
    train_clamped_against_the_plain_model(opt, backend, pooling)


def train_clamped_against_the_plain_model(opt, backend, pooling, device="cpu"):
    """Ten steps of fxrec with max_gradient= against the plain model with clamped lookup outputs
    (and the plain model unclamped, to show the clamp mattered); ``device``: where all three run
    (tests/test_gpu.py runs this on CUDA)."""
    cfg, make_ref_opt = OPTIMIZERS[opt]
    model = M.BagList(rows=ROWS, mode=pooling).to(device)
    ref = clamp_lookup_gradients(copy.deepcopy(model), LIMIT)
    unclamped = copy.deepcopy(model)
    to = lambda x: tree_map(lambda t: t.to(device), x)  # noqa: E731
    fast = fxrec.transform(model, to(duplicate_heavy_inputs(0)), optimizer=cfg, backend=backend, max_gradient=LIMIT)
    assert "clamped to [-0.02, 0.02]" in str(fast.report)
    tables = [f"bags.{i}.weight" for i in range(3)]
    ref_opts = [make_ref_opt([p for n, p in ref.named_parameters() if n in tables]),
                torch.optim.SGD([p for n, p in ref.named_parameters() if n not in tables], lr=0.5)]
    plain_opts = [make_ref_opt([p for n, p in unclamped.named_parameters() if n in tables]),
                  torch.optim.SGD([p for n, p in unclamped.named_parameters() if n not in tables], lr=0.5)]
    opt_fast = fast.make_optimizer(torch.optim.SGD, lr=0.5) if cfg is not None else torch.optim.SGD(fast.parameters(), lr=0.5)
    for step in range(10):
        x = to(duplicate_heavy_inputs(step + 1))
        for m, opts in ((ref, ref_opts), (unclamped, plain_opts), (fast, [opt_fast])):
            for o in opts:
                o.zero_grad()
            m(*x).sin().sum().backward()
            for o in opts:
                o.step()
    want, got, plain = ref.state_dict(), fast.state_dict(), unclamped.state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    assert all(not torch.allclose(plain[k], want[k], atol=1e-4) for k in tables)  # the clamp did something


def test_the_clamp_is_fbgemms_own_gradient_clipping():
    """fbgemm's TBE by hand, gradient_clipping=True with max_gradient, fused row-wise Adagrad, one
    step: the rows fxrec's model (fbgemm's kernel, max_gradient=) ends with."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (ComputeDevice,
                                                                            SplitTableBatchedEmbeddingBagsCodegen)
    model = M.BagList(rows=ROWS)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(r, 8, EmbeddingLocation.HOST, ComputeDevice.CPU) for r in ROWS], optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.1, eps=1e-8, pooling_mode=PoolingMode.SUM, gradient_clipping=True, max_gradient=LIMIT)
    with torch.no_grad():
        for w, b in zip(tbe.split_embedding_weights(), model.bags):
            w.copy_(b.weight)
    fast = fxrec.transform(model, duplicate_heavy_inputs(0), optimizer=fxrec.optim.RowWiseAdagrad(lr=0.1),
                           backend="fbgemm", max_gradient=LIMIT)
    assert {g.kernel_train for g in fast.report.groups} == {"fbgemm"}
    dense, ids, offsets = duplicate_heavy_inputs(1)
    starts = [0]
    for i in ids[:-1]:
        starts.append(starts[-1] + i.numel())
    flat_offsets = torch.cat([o + s for o, s in zip(offsets, starts)] + [torch.tensor([starts[-1] + ids[-1].numel()])])
    cot = torch.randn(dense.shape[0], 8 + 3 * 8, generator=torch.Generator().manual_seed(3))
    tbe(torch.cat(ids), flat_offsets).mul(cot[:, 8:]).sum().backward()
    (fast(dense, ids, offsets) * cot).sum().backward()  # (BagList's first 8 columns: its dense layer)
    for i, w in enumerate(tbe.split_embedding_weights()):
        torch.testing.assert_close(fast.state_dict()[f"bags.{i}.weight"], w, rtol=1e-6, atol=1e-7, msg=f"table {i}")


def test_max_gradient_is_checked():
    model, x = M.BagList(rows=ROWS), duplicate_heavy_inputs(0)
    for bad in (0, -1.0, float("inf"), float("nan"), "1", True):
        with pytest.raises(ValueError, match="max_gradient must be a positive number"):
            fxrec.transform(model, x, max_gradient=bad)
    with pytest.raises(ValueError, match="mode='inference' makes none"):
        fxrec.transform(model.eval(), x, mode="inference", max_gradient=1.0)


def _sharded_worker(rank, world, init_file, mode):
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = Model(mode)
        ref = clamp_lookup_gradients(copy.deepcopy(model), LIMIT)
        example = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)
        pins = {"bags.0": ("table_wise", 1), "bags.1": "row_wise",
                "bags.2": {"sharding": "column_wise", "ranks": [0, 1]}, "single": "data_parallel"}
        plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins=pins)
        fast = fxrec.transform(model, example, plan=plan, max_gradient=LIMIT)
        opt, ref_opt = torch.optim.SGD(fast.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
        for step in range(5):
            x = global_batch(LOCAL_B * world, step + 1)
            cot = torch.randn(LOCAL_B * world, generator=torch.Generator().manual_seed(100 + step))
            want = ref(*x)
            got = fast(*local_batch(x, rank, LOCAL_B))
            ref_opt.zero_grad()
            (want * cot * 50).sum().backward()  # gradients well past the limit
            ref_opt.step()
            opt.zero_grad()
            (got * cot[rank * LOCAL_B:(rank + 1) * LOCAL_B] * 50).sum().backward()
            opt.step()
        params = dict(fast.named_parameters())
        for name, want in ref.state_dict().items():
            tp = plan.tables.get(name.rsplit(".", 1)[0])
            mine = [sh for sh in tp.shards if sh.rank == rank] if tp is not None else []
            if tp is None or tp.sharding == "data_parallel":
                torch.testing.assert_close(params[name].detach(), want, msg=name)
            elif tp.sharding == "table_wise":
                if mine:
                    torch.testing.assert_close(params[name].detach(), want, msg=name)
            elif tp.sharding == "column_wise":
                for sh in mine:
                    torch.testing.assert_close(params[name].detach(), want[:, sh.col_offset:sh.col_offset + sh.num_cols],
                                               msg=name)
            else:
                lo, n = (mine[0].row_offset, mine[0].num_rows) if mine else (0, 0)
                torch.testing.assert_close(params[name].detach(), want[lo:lo + n], msg=name)
        dist.barrier()
    os._exit(0)  # (gloo's teardown at exit: see tests/test_sharding.py)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_a_sharded_model_clamps_as_the_single_process_model_does(mode):
    """Table-wise, row-wise (mean pooling: the clamp is on the mean's gradient, before the
    division by the bag's length), column-wise and data-parallel tables at world size 2."""
    spawn(_sharded_worker, 2, mode)


class _LeftAlone(nn.Module):
    """``b`` (max_norm) is a lookup fxrec leaves as written."""

    def __init__(self):
        super().__init__()
        self.a = nn.EmbeddingBag(20, 4, mode="sum")
        self.b = nn.Embedding(20, 4, max_norm=1.0)

    def forward(self, ids, offs, single):
        return torch.cat([self.a(ids, offs), self.b(single)], 1)


def test_a_lookup_left_as_written_is_clamped_too_and_the_model_still_exports():
    torch.manual_seed(0)
    model = _LeftAlone()
    ref = clamp_lookup_gradients(copy.deepcopy(model), LIMIT)
    x = (torch.randint(0, 20, (8,)), torch.tensor([0, 2, 4, 6]), torch.randint(0, 20, (4,)))
    fast = fxrec.transform(model, x, max_gradient=LIMIT)
    assert any(isinstance(m, fxrec.runtime.grad.ClampGradient) for m in fast.modules())
    cot = torch.randn(4, 8)
    (fast(*x) * cot).sum().backward()
    (ref(*x) * cot).sum().backward()
    for name, p in ref.named_parameters():
        g = fast.get_parameter(name).grad
        torch.testing.assert_close(g.to_dense() if g.is_sparse else g, p.grad, msg=name)
    fast.eval()
    with torch.no_grad():
        want = fast(*x)
        torch.testing.assert_close(fxrec.export.torchscript(fast)(*x), want)
        torch.testing.assert_close(fxrec.export.program(fast, x).module()(*x), want)


class _InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(20, 4, mode="mean") for _ in range(2)])
        self.z = nn.Embedding(10, 4, max_norm=1.0)  # left as written

    def forward(self, ids, offs, single):
        z = self.z(single)
        z.add_(1)
        return torch.cat([torch.cat([b(i, o) for b, i, o in zip(self.bags, ids, offs)], 1).relu_(), z], 1)


@pytest.mark.parametrize("backend", ["native", "fbgemm", "reference"])
def test_the_lookups_outputs_can_still_be_changed_in_place(backend):
    """The clamp is a gradient hook: an in-place op on a lookup's output (relu_ on the group's
    folded cat, add_ on a lookup left as written) trains as the plain model does."""
    torch.manual_seed(0)
    model = _InPlace()
    ref = clamp_lookup_gradients(copy.deepcopy(model), LIMIT)
    x = ([torch.randint(0, 20, (8,)), torch.randint(0, 20, (8,))], [torch.tensor([0, 2, 4, 6])] * 2,
         torch.randint(0, 10, (4,)))
    fast = fxrec.transform(model, x, max_gradient=LIMIT, backend=backend)
    cot = torch.randn(4, 12) * 10
    (fast(*x) * cot).sum().backward()
    (ref(*x) * cot).sum().backward()
    for name, p in ref.named_parameters():
        g = fast.get_parameter(name).grad
        torch.testing.assert_close(g.to_dense() if g.is_sparse else g, p.grad, msg=name)


class _SeqPooledAndInABlock(nn.Module):
    """``[B, L]`` lookups whose mean and sum the model takes, and a bag inside an autocast block."""

    def __init__(self):
        super().__init__()
        self.m = nn.Embedding(20, 4)
        self.s = nn.Embedding(20, 4)
        self.b = nn.EmbeddingBag(20, 4, mode="sum")
        self.proj = nn.Linear(3, 4)

    def forward(self, ids, dense):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inside = self.b(ids).float()
        return torch.cat([self.m(ids).mean(1), self.s(ids).sum(1), inside * self.proj(dense)], 1) * 10


def test_a_mean_of_a_lookup_and_a_lookup_inside_an_autocast_block_are_clamped_as_the_model_wrote_them():
    """The clamp is of each lookup's output as written: a ``[B, L, D]`` lookup's rows before its
    mean (folded into a bag, the bag's gradient was clamped before it was divided by L: 0.04
    where the plain model's rows gave 0.2), and a lookup inside an autocast block (not clamped:
    29.4 where the plain model gave 1.5)."""
    torch.manual_seed(0)
    model = _SeqPooledAndInABlock()
    ref = clamp_lookup_gradients(copy.deepcopy(model), LIMIT)
    x = (torch.randint(0, 20, (4, 5)), torch.randn(4, 3))
    fast = fxrec.transform(model, x, max_gradient=LIMIT)
    for twin in (fast, copy.deepcopy(fast)):
        cot = torch.randn(4, 12)
        for m in (twin, ref):
            m.zero_grad()
            (m(*x) * cot).sum().backward()
        for name, p in ref.named_parameters():
            g = twin.get_parameter(name).grad
            torch.testing.assert_close(g.to_dense() if g.is_sparse else g, p.grad, msg=name)
    # without max_gradient the mean is folded into the lookup (one bag per row of ids)
    forms = {e.table: e.form for e in fxrec.transform(model, x).report.lookups}
    assert forms["m"] == forms["s"] == "pooled_seq", forms
    forms = {e.table: e.form for e in fast.report.lookups}
    assert (forms["m"], forms["s"]) == ("seq", "pooled_seq"), forms
