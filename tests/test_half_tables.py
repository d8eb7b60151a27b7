"""fp16 tables in the user's own model (``nn.EmbeddingBag(..., dtype=torch.float16)``, or
``model.half()``): lowered into groups of their own, looked up by fbgemm's TBE on fp16 rows with fp16
outputs where that gives PyTorch's own numbers bit for bit (sums: bags, per-sample weights, single
ids, ``[B, L]`` ids, sequences), by PyTorch's own lookups elsewhere (mean pooling, and training,
whose fp16 gradients and torch.optim steps only PyTorch reproduces). The reference is always the
plain fp16 model. (fp32 tables stored in fp16 by ``weights_precision=`` are
tests/test_weights_precision.py.)"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxrec
from fxrec.pass_infra import InputError

HALF = torch.float16


class HalfTables(nn.Module):
    """Every lookup form fbgemm sums, and a mean bag; fp16 tables, an fp32 top."""

    def __init__(self, dtype=HALF, mean_bag=False):
        super().__init__()
        self.bag = nn.EmbeddingBag(100, 16, mode="sum", dtype=dtype)
        self.weighted = nn.EmbeddingBag(60, 8, mode="sum", dtype=dtype)
        self.single = nn.Embedding(40, 8, dtype=dtype)
        self.seq = nn.Embedding(30, 12, dtype=dtype)  # [B, L] ids summed over L
        self.padded = nn.EmbeddingBag(20, 4, mode="sum", padding_idx=0, dtype=dtype)
        self.mean = nn.EmbeddingBag(50, 10, mode="mean", dtype=dtype) if mean_bag else None
        self.top = nn.Linear(16 + 8 + 8 + 12 + 4 + (10 if mean_bag else 0), 1)

    def forward(self, ids, offs, wids, woffs, w, single, seq, pids, poffs, mids=None, moffs=None):
        parts = [self.bag(ids, offs), self.weighted(wids, woffs, per_sample_weights=w), self.single(single),
                 self.seq(seq).sum(1), self.padded(pids, poffs)]
        if self.mean is not None:
            parts.append(self.mean(mids, moffs))
        pooled = torch.cat(parts, 1)
        return pooled, self.top(pooled.float())


def batch(b, seed, mean_bag=False, psw_dtype=HALF):
    g = torch.Generator().manual_seed(seed)

    def bags(rows, most):
        lengths = torch.randint(0, most + 1, (b,), generator=g)
        return (torch.randint(0, rows, (int(lengths.sum()),), generator=g),
                torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]]))

    ids, offs = bags(100, 5)
    wids, woffs = bags(60, 4)
    pids, poffs = bags(20, 4)  # id 0 is the padding id
    x = (ids, offs, wids, woffs, torch.rand(wids.numel(), generator=g).to(psw_dtype),
         torch.randint(0, 40, (b,), generator=g), torch.randint(0, 30, (b, 3), generator=g), pids, poffs)
    return x + bags(50, 4) if mean_bag else x


def half_model(seed=0, mean_bag=False):
    torch.manual_seed(seed)
    return HalfTables(mean_bag=mean_bag)


def group_modules(fast):
    return [m for n, m in fast.named_modules() if n.startswith("fxrec_group")]


def assert_same(a, b):
    assert a[0].dtype == b[0].dtype == HALF
    assert torch.equal(a[0], b[0]), (a[0].float() - b[0].float()).abs().max()
    assert torch.equal(a[1], b[1])


def test_fp16_lookups_are_lowered_and_bf16_ones_left_with_their_reason():
    fast = fxrec.transform(half_model(), batch(4, 0), backend="fbgemm")
    report = str(fast.report)
    assert "left alone" not in report and "5 lowered" in report
    model = HalfTables(dtype=torch.bfloat16)
    x = batch(4, 0, psw_dtype=torch.bfloat16)
    report = str(fxrec.explain(model, x))
    assert "0 lowered" in report and "dtype torch.bfloat16: fxrec lowers float32 and float16 tables" in report


def test_fp16_tables_group_apart_from_fp32_ones():
    model = half_model()
    model.bag.float()  # one fp32 table among fp16 ones: its own group (one TBE stores one precision)
    fast = fxrec.transform(model, batch(4, 0), backend="fbgemm")
    tables = sorted(sorted(t.name for t in g.tables) for g in group_modules(fast))
    assert ["bag"] in tables and all("bag" not in t for t in tables if t != ["bag"])
    plain = copy.deepcopy(model)
    with torch.no_grad():
        fast.eval(), plain.eval()
        x = batch(7, 1)
        assert torch.equal(fast(*x)[0], plain(*x)[0])


@pytest.mark.parametrize("mode", ["training", "inference"])
@pytest.mark.parametrize("backend", ["fbgemm", "auto"])
def test_lookups_of_fp16_tables_give_the_plain_models_fp16_outputs_bit_for_bit(mode, backend):
    plain = half_model(mean_bag=True)
    fast = fxrec.transform(copy.deepcopy(plain), batch(8, 0, mean_bag=True), backend=backend, mode=mode)
    fast.eval(), plain.eval()
    with torch.no_grad():
        for b, seed in ((8, 1), (3, 2), (33, 3)):
            x = batch(b, seed, mean_bag=True)
            assert_same(fast(*x), plain(*x))
    if backend == "fbgemm":  # fbgemm's TBE ran the sum groups, on fp16 rows
        bound = [g for g in group_modules(fast) if g._bound is not None]
        assert len(bound) == 2 and all(g.pooling == "sum" for g in bound)
        for g in bound:
            assert all(w.dtype == HALF for w in g._bound.tbe.split_embedding_weights())
        assert [g.kernel_eval for g in group_modules(fast) if g.pooling == "mean"] == ["reference"]


def test_explain_for_cuda_puts_fp16_sums_on_fbgemm_and_means_and_training_on_pytorchs_lookups():
    report = fxrec.explain(half_model(mean_bag=True), batch(4, 0, mean_bag=True), device="cuda",
                           optimizer=fxrec.optim.SGD(lr=0.1))
    text = str(report)
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.strip().startswith("group_")}
    kernels = sorted((r[2], r[5], r[6]) for r in rows.values() if len(r) > 6)  # pooling, train, inference
    assert kernels == [("mean", "reference", "reference"), ("sum", "reference", "fbgemm"),
                       ("sum", "reference", "fbgemm")], text
    assert "fbgemm's kernels do not round fp16 gradients and updates as PyTorch does" in text
    assert "PyTorch's mean of fp16 rows rounds differently from fbgemm's" in text
    assert "fused sgd" not in text and "torch.optim in opt.step()" in text
    inference = str(fxrec.explain(half_model(), batch(4, 0), device="cuda", mode="inference"))
    assert inference.count(" fbgemm ") >= 2 and " reference " not in inference.split("Groups")[1].split("\n\n")[0]


class OddDims(nn.Module):
    """fp16 tables of dims fbgemm's TBE would store padded (6, 10), next to one it would not (8)."""

    def __init__(self):
        super().__init__()
        self.six = nn.EmbeddingBag(100, 6, mode="sum", dtype=HALF)
        self.ten = nn.EmbeddingBag(60, 10, mode="sum", dtype=HALF)
        self.eight = nn.EmbeddingBag(60, 8, mode="sum", dtype=HALF, padding_idx=0)

    def forward(self, ids, offs, wids, woffs):
        return torch.cat([self.six(ids, offs), self.ten(wids, woffs), self.eight(wids, woffs)], 1), None


@pytest.mark.parametrize("model_fn", [half_model, OddDims], ids=["dims_of_4", "padded_dims"])
def test_fp16_tables_train_with_torch_optim_exactly_as_the_plain_model_with_eval_calls_between_steps(model_fn):
    """A fused optimizer asked for: refused for fp16 tables (the report says why), torch.optim steps
    them. An eval() call binds fbgemm's TBE to the tables, which must not change the next steps
    (tables of dims fbgemm stores padded stay on PyTorch's lookups: torch.optim's fp16 steps round
    otherwise on the strided rows their parameters would become)."""
    torch.manual_seed(0)
    plain = model_fn()
    inputs = (lambda b, s: batch(b, s)) if model_fn is half_model else (lambda b, s: batch(b, s)[:4])
    fast = fxrec.transform(copy.deepcopy(plain), inputs(8, 0), backend="fbgemm", optimizer=fxrec.optim.SGD(lr=0.5))
    assert all(g.fused is None for g in group_modules(fast))
    if model_fn is OddDims:
        kernels = {tuple(t.name for t in g.tables): g.kernel_eval for g in group_modules(fast)}
        assert kernels == {("six", "ten", "eight"): "reference"}, kernels
    opt = fast.make_optimizer(torch.optim.SGD, lr=0.5)
    ref = torch.optim.SGD(plain.parameters(), lr=0.5)
    for step in range(4):
        x = inputs(16, 10 + step)
        fast.train(), plain.train()
        a, b = fast(*x), plain(*x)
        assert torch.equal(a[0], b[0])
        for o, out in ((opt, a), (ref, b)):
            o.zero_grad()
            loss = out[0].float().square().sum()
            (loss if out[1] is None else loss + out[1].sum()).backward()
            o.step()
        for (n, p), q in zip(fast.named_parameters(), plain.parameters()):
            assert p.dtype == q.dtype and torch.equal(p, q), (step, n)
        fast.eval(), plain.eval()
        with torch.no_grad():
            y = inputs(5, 30 + step)
            assert torch.equal(fast(*y)[0], plain(*y)[0])
    if model_fn is OddDims:
        return
    fast.eval(), plain.eval()  # fbgemm's TBE takes the trained rows for inference
    with torch.no_grad():
        x = batch(9, 20)
        assert_same(fast(*x), plain(*x))
    assert any(g._bound is not None for g in group_modules(fast))
    state = fast.state_dict()
    assert all(state[k].dtype == v.dtype and torch.equal(state[k], v) for k, v in plain.state_dict().items())


def test_per_sample_weights_of_another_dtype_than_an_fp16_table_are_named():
    plain = half_model()
    fast = fxrec.transform(copy.deepcopy(plain), batch(4, 0), backend="fbgemm")
    x = list(batch(4, 1))
    x[4] = x[4].float()
    with pytest.raises(RuntimeError):  # (PyTorch refuses it too)
        plain(*x)
    with pytest.raises(TypeError, match="feature 'wids' .table 'weighted'. got per-sample weights of dtype torch.float32; they must be torch.float16"):
        fast(*x)


def test_fp32_parameters_of_a_group_of_fp16_tables_are_not_rounded_into_an_fp16_tbe():
    """(The transformed graph itself keeps the dtypes it was captured with, as torch.export's do.)"""
    from fxrec.runtime.kernels.fbgemm_bind import usable

    fast = fxrec.transform(half_model(), batch(4, 0), backend="fbgemm", mode="inference")
    group = next(g for g in group_modules(fast) if g._any_weighted is False)
    params = [p.detach() for p in group_params(fast, group)]
    assert usable(params, group)
    assert not usable([p.float() for p in params], group)


def group_params(fast, group):
    names = {t.name for t in group.tables}
    return [p for n, p in fast.named_parameters() if n.rsplit(".", 1)[0].replace("_", ".") in names
            or n.rsplit(".", 1)[0] in names]


def test_quantized_fp16_tables_serve_fp16_outputs():
    plain = half_model()
    for quantize in ("fp16", "int8"):
        fast = fxrec.transform(copy.deepcopy(plain), batch(4, 0), mode="inference", quantize=quantize)
        with torch.no_grad():
            x = batch(12, 1)
            a, b = fast(*x), plain(*x)
        assert a[0].dtype == HALF
        if quantize == "fp16":  # the rows as they are, summed as PyTorch sums them
            assert torch.equal(a[0], b[0])
        else:
            assert (a[0].float() - b[0].float()).abs().max() < 0.1


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_an_exported_or_scripted_fp16_model_serves_what_the_transformed_one_does(quantize):
    plain = half_model()
    fast = fxrec.transform(copy.deepcopy(plain), batch(4, 0), backend="fbgemm", mode="inference", quantize=quantize)
    program = fxrec.export.program(fast, batch(4, 0))
    scripted = fxrec.export.torchscript(fast)
    with torch.no_grad():
        x = batch(10, 1)
        want = fast(*x)
        if quantize is None:
            assert_same(want, plain(*x))
        assert_same(program.module()(*x), want)
        assert_same(scripted(*x), want)
        bad = list(x)
        bad[4] = bad[4].float()
        with pytest.raises(Exception, match="feature 'wids' .table 'weighted'. got per-sample weights that are not "
                                            "torch.float16"):
            scripted(*bad)


def test_weights_precision_still_refuses_an_fp16_table():
    with pytest.raises(InputError, match="weights_precision='fp16' for table 'bag', which is float16"):
        fxrec.transform(half_model(), batch(4, 0), optimizer=fxrec.optim.SGD(lr=0.1), weights_precision="fp16")


def test_fp16_tables_kept_as_they_are_by_quantize_stay_the_models_own_lookups():
    """quantize="fp32" (or "auto", or a dict giving them "fp32") keeps an fp16 table fp16, never
    widened; a group whose tables all stay fp16 is not quantized, so its mean bags stay exact."""
    plain = half_model(mean_bag=True)
    x = batch(4, 0, mean_bag=True)
    for quantize in ("fp32", "fp16", "auto", {"*": "fp32"}):
        fast = fxrec.transform(copy.deepcopy(plain), x, mode="inference", quantize=quantize)
        assert not any(hasattr(g, "q_ints") for g in group_modules(fast)), quantize
        with torch.no_grad():
            y = batch(40, 1, mean_bag=True)
            assert_same(fast(*y), plain(*y))
    fast = fxrec.transform(copy.deepcopy(plain), x, mode="inference", quantize={"bag": "int8"})
    quantized = [sorted(t.name for t in g.tables) for g in group_modules(fast) if hasattr(g, "q_ints")]
    assert quantized == [["bag", "padded", "seq", "single"]]  # (the others of its group are stored fp16)


def test_per_sample_weights_of_fp32_tables_stored_in_fp16_stay_float32():
    from tests import models as M

    model = M.WeightedBags()
    x = list(M.weighted_inputs())
    fast = fxrec.transform(model, x, optimizer=fxrec.optim.SGD(lr=0.1), weights_precision="fp16", backend="fbgemm")
    fast(*x)
    fast.eval()
    fast(*x)
    bad = list(x)
    bad[2] = x[2].half()
    with pytest.raises(TypeError, match="got per-sample weights of dtype torch.float16; they must be torch.float32"):
        fast(*bad)


def test_an_hbm_budget_counts_fp16_tables_and_their_gradients_at_two_bytes_a_value():
    class Big(nn.Module):
        def __init__(self):
            super().__init__()
            self.t = nn.EmbeddingBag(100_000, 64, mode="sum", dtype=HALF)

        def forward(self, ids, offs):
            return self.t(ids, offs)

    x = (torch.randint(0, 100_000, (10,)), torch.tensor([0, 4, 7]))
    need = 100_000 * 64 * (2 + 2)  # the rows and their dense fp16 gradient (25.6 MB; at 4 bytes a gradient value 38.4)
    fxrec.explain(Big(), x, device="cuda", hbm_budget=int(need * 1.05))
    with pytest.raises(Exception, match="need 25.6 MB of GPU memory") as e:
        fxrec.explain(Big(), x, device="cuda", hbm_budget=int(need * 0.95))
    # fp16 tables cannot take a fused optimizer: the error does not suggest one, and says why they stay
    assert "fuse the optimizer" not in str(e.value)
    assert "fp16 tables ['t'] train on PyTorch's lookups" in str(e.value)
    with pytest.raises(Exception, match="fuse the optimizer") as e32:  # the same table in fp32 could fuse
        fxrec.explain(Big().float(), x, device="cuda", hbm_budget=int(need * 0.95))
    assert "fp16 tables" not in str(e32.value)


def test_an_hbm_budget_moves_fp16_tables_served_by_fbgemm_to_unified_memory_and_keeps_trained_ones():
    """Inference on fbgemm's TBE: the largest fp16 table leaves HBM (cached in fp16). Training runs
    PyTorch's lookups on them, which read the rows where they are: nothing moves, the budget is refused."""
    from tests.passes.test_place_tables import INPUTS, meta_model, placements

    model = meta_model().half()
    report = fxrec.explain(model, INPUTS, device="cuda", mode="inference", hbm_budget="100MB")
    assert placements(report) == {"big": "managed_caching", "mid": "device", "small": "device"}
    assert [g.kernel_eval for g in report.groups] == ["fbgemm"]
    fits = fxrec.explain(meta_model().half(), INPUTS, device="cuda", mode="inference", hbm_budget="300MB")
    assert set(placements(fits).values()) == {"device"}  # 256 + 25.6 + small MB at 2 bytes a value: it fits
    with pytest.raises(Exception, match="GPU memory"):
        fxrec.explain(meta_model().half(), INPUTS, device="cuda", hbm_budget="300MB")  # (training: and gradients)


def test_gradients_through_a_model_of_fp16_tables_transformed_for_inference_are_pytorchs():
    """Inference groups run fbgemm's TBE; a call with gradients on goes to PyTorch's lookups."""
    plain = half_model()
    fast = fxrec.transform(copy.deepcopy(plain), batch(4, 0), backend="fbgemm", mode="inference")
    x = batch(12, 1)
    for model in (fast, plain):
        out = model(*x)
        (out[1].sum() + out[0].float().square().sum()).backward()
    for (n, p), q in zip(fast.named_parameters(), plain.parameters()):
        assert p.grad is not None and p.grad.dtype == q.grad.dtype and torch.equal(p.grad, q.grad), n


@pytest.mark.parametrize("dim, want", [(8, "fp16"), (16, "fp16"), (7, "fp16"), (12, "int8"), (32, "int8")])
def test_auto_quantizes_an_fp16_table_only_where_int8_rows_are_smaller_at_cudas_alignment(dim, want):
    """int8 rows are D + 4 bytes rounded up to 16 on CUDA: for dims 8 and 16 as many bytes as fp16 rows."""
    from fxrec.passes.quantize_tables import dtype_for

    assert dtype_for("auto", "t", "t.weight", 8192, dim, half=True) == want
    assert dtype_for("auto", "t", "t.weight", 100, dim, half=True) == "fp16"  # (under 64 KiB)
    assert dtype_for("fp32", "t", "t.weight", 8192, dim, half=True) == "fp16"
    assert dtype_for({"x": "int8"}, "t", "t.weight", 8192, dim, half=True) == "fp16"


def test_the_quantization_report_counts_an_fp16_tables_bytes_as_the_model_holds_them():
    fast = fxrec.transform(half_model(), batch(4, 0), mode="inference", quantize={"bag": "int8"})
    entries = {q.table: q for q in fast.report.quantization}
    assert entries["bag"].bytes_fp32 == 100 * 16 * 2 and entries["single"].bytes_fp32 == 40 * 8 * 2
    assert entries["single"].bytes_stored >= entries["single"].bytes_fp32  # (kept fp16: nothing saved)
    assert "bytes in model" in str(fast.report)


def test_a_group_pickled_before_its_per_sample_weight_dtypes_were_kept_checks_them_as_fp32():
    import pickle
    from tests import models as M

    fast = fxrec.transform(M.WeightedBags(), M.weighted_inputs(), backend="fbgemm")
    for g in group_modules(fast):
        del g.__dict__["_psw_dtypes"]  # as a group pickled before the attribute was
    fast = pickle.loads(pickle.dumps(fast))
    x = list(M.weighted_inputs())
    fast(*x)
    x[2] = x[2].half()
    with pytest.raises(TypeError, match="they must be torch.float32"):
        fast(*x)


class _SameLookupTwice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(3, 12).half()

    def forward(self, ids):
        w = self.emb.weight
        return torch.cat([F.embedding_bag(ids, w, mode="sum"), F.embedding_bag(ids, w, mode="sum")], 1)


def test_the_same_lookup_of_an_fp16_table_written_twice_trains_bit_for_bit():
    """merge_lookups made the two lookups one, whose backward summed both uses' gradients in fp16
    before the table got them: up to three fp16 steps off PyTorch's two backwards, and verify=True
    refused the model (found by the third fuzzer). In training they stay two lookups."""
    for seed in range(6):
        torch.manual_seed(seed)
        model = _SameLookupTwice()
        ids = torch.randint(0, 3, (8, 4))
        fast = fxrec.transform(model, (ids,), verify=True)
        cot = torch.randn(8, 24).half()
        (model(ids) * cot).sum().backward()
        (fast(ids) * cot).sum().backward()
        assert torch.equal(fast.get_parameter("emb.weight").grad, model.emb.weight.grad), seed
    inference = fxrec.transform(model, (ids,), mode="inference")  # (no gradient: merged, the same outputs)
    assert [r.what for r in inference.report.removed] == ["merged into ids"]
    assert torch.equal(inference(ids), model(ids))


class _MixedHalfLookups(nn.Module):
    """An fp16 table read by lookups fxrec would group (a single id, [B, L] ids) and by bags it
    leaves as written."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, 8, dtype=torch.float16)

    def forward(self, single, ids1, offs1, ids2, offs2, seq):
        w = self.emb.weight
        return torch.cat([self.emb(single), F.embedding_bag(ids1, w, offs1, mode="sum"),
                          F.embedding_bag(ids2, w, offs2, mode="mean", include_last_offset=True, padding_idx=0),
                          self.emb(seq).flatten(1)], 1).float()


def _mixed_inputs(g, b):
    l1, l2 = torch.randint(1, 4, (b,), generator=g), torch.randint(1, 4, (b,), generator=g)
    zero = torch.zeros(1, dtype=torch.long)
    return (torch.randint(0, 8, (b,), generator=g),
            torch.randint(0, 8, (int(l1.sum()),), generator=g), torch.cat([zero, l1.cumsum(0)[:-1]]),
            torch.randint(0, 8, (int(l2.sum()),), generator=g), torch.cat([zero, l2.cumsum(0)]),
            torch.randint(0, 8, (b, 2), generator=g))


def test_an_fp16_table_with_a_lookup_left_as_written_keeps_every_lookup_as_written_in_training():
    """Grouped, the other lookups' backward ran in another order among the bags', and the table's
    fp16 gradient rounded otherwise: one fp16 step off (0.125) in 30 batches (found by the
    differential fuzzer). In inference the group stays."""
    torch.manual_seed(0)
    model = _MixedHalfLookups()
    g = torch.Generator().manual_seed(1)
    fast = fxrec.transform(model, _mixed_inputs(g, 3), backend="reference")
    assert [r.group for r in fast.report.lookups] == [None] * 4, fast.report
    assert any("is fp16 in the model and its lookup" in r.reason for r in fast.report.lookups)
    for _ in range(30):
        x = _mixed_inputs(g, 5)
        model.emb.weight.grad = None
        fast.get_parameter("emb.weight").grad = None
        cot = torch.randn(5, 40, generator=g)
        (model(*x) * cot).sum().backward()
        (fast(*x) * cot).sum().backward()
        assert torch.equal(fast.get_parameter("emb.weight").grad, model.emb.weight.grad)
    served = fxrec.transform(model, _mixed_inputs(g, 3), mode="inference")
    assert sum(r.group is not None for r in served.report.lookups) == 2
