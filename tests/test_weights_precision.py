"""transform(..., weights_precision="fp16"): fp32 tables stored in fp16 in fbgemm's TBE, trained by
an optimizer fused into its backward. The reference is the plain PyTorch model with the same
weights rounded to fp16: fbgemm reads fp16 rows into fp32 sums, and rounds each fused update
(computed in fp32) to the nearest fp16 on CPU (stochastically on CUDA: tests/test_gpu.py)."""

import copy
import pickle

import pytest
import torch

import fxrec
from fxrec.pass_infra import InputError
from tests import models as M
from tests.test_fused_optimizers import RowWiseAdagradReference

ROWS = (40, 30, 20)
OPTIMIZERS = {
    "sgd": (fxrec.optim.SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    "adagrad": (fxrec.optim.Adagrad(lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1)),
    "rowwise_adagrad": (fxrec.optim.RowWiseAdagrad(lr=0.1), lambda p: RowWiseAdagradReference(p, lr=0.1)),
}


def fp16_model(cfg=fxrec.optim.SGD(lr=0.1), seed=0, **kw):
    torch.manual_seed(seed)
    model = M.BagList(rows=ROWS)
    plain = copy.deepcopy(model)
    fast = fxrec.transform(model, M.bag_inputs(rows=ROWS), optimizer=cfg, weights_precision="fp16", **kw)
    return plain, fast


def tables(module):
    return {n: p for n, p in module.named_parameters() if n.startswith("bags.")}


def within_one_rounding_step(a: torch.Tensor, b: torch.Tensor, old: torch.Tensor, mantissa_bits: int = 10) -> bool:
    """|a - b| at most one fp16 spacing at the largest magnitude of the old row, the new ones and
    the step: fbgemm's CPU update of fp16 rows rounds in fp16 on the way (measured: a result near a
    rounding midpoint may go the other way, and one that cancels most of the old value carries the
    old value's rounding), where PyTorch's rounds its fp32 result once."""
    a, b, old = a.float(), b.float(), old.float()
    big = torch.stack([a.abs(), b.abs(), old.abs(), (b - old).abs()]).amax(0).clamp_min(2.0 ** -14)
    spacing = 2.0 ** (torch.floor(torch.log2(big)) - mantissa_bits)  # bf16: 7
    return bool(((a - b).abs() <= spacing).all())


def train_in_lock_step(plain, fast, torch_opt, inputs, steps=8, dtype=torch.float16, exact_lookups=True,
                       exact_updates=False) -> int:
    """Before each step the plain model takes fxrec's current rows (as fp32); both step on the same
    batch (``inputs(step)``); the lookups agree (exactly on CPU), every updated row is within one
    step of ``dtype`` of PyTorch's update rounded to it (``exact_updates``: is it), the dense layer
    as torch.optim's. Returns how many table updates moved a row."""
    tables = {n: p for n, p in plain.named_parameters() if n.startswith("bags.")}
    ref_opt = torch_opt(list(tables.values()))
    dense_ref = torch.optim.SGD(plain.dense.parameters(), lr=0.1)
    opt = fast.make_optimizer(torch.optim.SGD, lr=0.1)
    moved = 0
    for step in range(steps):
        x = inputs(step + 1)
        with torch.no_grad():
            for n, p in tables.items():
                p.copy_(fast.get_parameter(n).float())
        before = {n: fast.get_parameter(n).detach().clone() for n in tables}
        for o in (ref_opt, dense_ref, opt):
            o.zero_grad()
        out_ref, out = plain(*x), fast(*x)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, out_ref, rtol=0 if exact_lookups else 1e-5, atol=0 if exact_lookups else 1e-6)
        out_ref.sin().sum().backward()
        out.sin().sum().backward()
        for o in (ref_opt, dense_ref, opt):
            o.step()
        for n, p in tables.items():
            got = fast.get_parameter(n)
            assert got.dtype == dtype, n
            if exact_updates:
                assert torch.equal(got, p.detach().to(dtype)), (step, n)
            assert within_one_rounding_step(got, p.detach().to(dtype), before[n], 10 if dtype == torch.float16 else 7), \
                (step, n)
            moved += int((got != before[n]).any())
    for (n, a), (_, b) in zip(plain.dense.named_parameters(), fast.dense.named_parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=n)
    return moved


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_fused_step_is_the_plain_models_step_rounded_to_fp16(name):
    """Lock step (train_in_lock_step) over 8 steps: the lookups agree exactly, and every updated
    row is within one fp16 step of PyTorch's update rounded to fp16 (the optimizer states, fp32,
    follow their own updates)."""
    cfg, torch_opt = OPTIMIZERS[name]
    plain, fast = fp16_model(cfg)
    moved = train_in_lock_step(plain, fast, torch_opt, lambda s: M.bag_inputs(rows=ROWS, seed=s),
                               exact_updates=name == "rowwise_adagrad")  # measured bit for bit (docs say so)
    assert moved == 8 * len(ROWS)  # every table trained at every step


def test_the_tables_are_fp16_rows_of_fbgemms_tbe_from_the_start():
    plain, fast = fp16_model()
    assert {n: v.dtype for n, v in fast.state_dict().items() if n.startswith("bags.")} == \
        {f"bags.{i}.weight": torch.float16 for i in range(3)}
    for n, p in tables(fast).items():  # the rounded weights the model had
        assert torch.equal(p, tables(plain)[n].detach().half()), n
    (group,) = [m for m in fast.modules() if type(m).__name__ == "EmbeddingGroup"]
    tbe = group._bound.tbe
    assert tbe.weights_host.dtype == torch.float16
    assert tbe.weights_host.numel() == sum(r * 8 for r in ROWS)  # dim 8: no padding, 2 bytes a value
    base = tbe.weights_host.data_ptr()
    for p in tables(fast).values():  # views of the TBE's rows
        assert base <= p.data_ptr() < base + tbe.weights_host.numel() * 2
    assert "weights stored in fp16 in fbgemm's TBE" in str(fast.report)
    assert [g.dtypes for g in fast.report.groups] == [["fp16"] * 3]


def test_a_dict_stores_only_the_tables_it_names_and_they_form_their_own_group():
    torch.manual_seed(0)
    fast = fxrec.transform(M.BagList(rows=ROWS), M.bag_inputs(rows=ROWS), optimizer=fxrec.optim.SGD(lr=0.1),
                           weights_precision={"bags.1": "fp16", "*": "fp32"})
    assert {n: p.dtype for n, p in tables(fast).items()} == {
        "bags.0.weight": torch.float32, "bags.1.weight": torch.float16, "bags.2.weight": torch.float32}
    assert sorted(tuple(g.dtypes) for g in fast.report.groups) == [("float32", "float32"), ("fp16",)]


def test_copies_checkpoints_and_export_keep_the_fp16_rows():
    _, fast = fp16_model(fxrec.optim.RowWiseAdagrad(lr=0.1))
    opt = fast.make_optimizer(torch.optim.SGD, lr=0.1)
    fast(*M.bag_inputs(rows=ROWS, seed=1)).sum().backward()
    opt.step()
    x = M.bag_inputs(rows=ROWS, seed=2)
    with torch.no_grad():
        want = fast(*x)
    for other in (copy.deepcopy(fast), pickle.loads(pickle.dumps(fast))):
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(fast.state_dict().values(),
                                                                           other.state_dict().values()))
        with torch.no_grad():
            assert torch.equal(other(*x), want)
    # serving goes through quantize="fp16" (fbgemm's inference TBE), from the fp16 values exactly
    for export in (lambda: fxrec.export.program(fast, x), lambda: fxrec.export.torchscript(fast)):
        with pytest.raises(InputError, match=r"stored in fp16 by fbgemm's training TBE .* "
                                                             r"mode='inference', quantize='fp16'"):
            export()
    plain = M.BagList(rows=ROWS)
    fxrec.write_back(fast, plain)  # fp16 values into fp32 tables, exactly
    served = fxrec.transform(plain, x, mode="inference", quantize="fp16")
    with torch.no_grad():
        assert torch.equal(served(*x), want)


def test_checkpoints_load_between_fp16_and_fp32_tables(tmp_path):
    plain, fast = fp16_model(fxrec.optim.RowWiseAdagrad(lr=0.1))
    opt = fast.make_optimizer(torch.optim.SGD, lr=0.1)
    fast(*M.bag_inputs(rows=ROWS, seed=1)).sum().backward()
    opt.step()
    fxrec.checkpoint.save_model(fast, tmp_path / "fp16")
    _, again = fp16_model(fxrec.optim.RowWiseAdagrad(lr=0.1), seed=5)
    fxrec.checkpoint.load_into_model(again, tmp_path / "fp16")
    for a, b in zip(fast.state_dict().values(), again.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b)
    into_plain = M.BagList(rows=ROWS)  # fp32 tables get the fp16 values exactly
    fxrec.checkpoint.load_into_model(into_plain, tmp_path / "fp16", strict=False)
    for n, p in tables(into_plain).items():
        assert p.dtype == torch.float32 and torch.equal(p, fast.get_parameter(n).float()), n
    fxrec.checkpoint.save_model(plain, tmp_path / "fp32")  # fp32 into fp16: rounded to nearest
    fxrec.checkpoint.load_into_model(again, tmp_path / "fp32", strict=False)
    for n, p in tables(again).items():
        assert p.dtype == torch.float16 and torch.equal(p, tables(plain)[n].detach().half()), n


def test_explain_for_cuda_stores_fp16_and_counts_two_bytes_a_value_against_the_budget():
    model = M.BagList(rows=(1000, 2000, 3000), dim=16)
    inputs = M.bag_inputs(rows=(1000, 2000, 3000))
    cfg = fxrec.optim.RowWiseAdagrad(lr=0.1)
    r = fxrec.explain(model, inputs, device="cuda", optimizer=cfg, weights_precision="fp16", hbm_budget="1GB")
    (g,) = r.groups
    assert (g.kernel_train, g.kernel_eval, g.fused, g.dtypes) == ("fbgemm", "fbgemm", "rowwise_adagrad", ["fp16"] * 3)
    (stats,) = [p for p in r.passes if p.startswith("place_tables")]
    hbm = int(stats.split("tables_hbm_bytes=")[1].split(",")[0].rstrip(")"))
    assert hbm == 6000 * 16 * 2 + 6000 * 4  # fp16 rows, one fp32 row-wise state a row
    r32 = fxrec.explain(model, inputs, device="cuda", optimizer=cfg, hbm_budget="1GB")
    (stats,) = [p for p in r32.passes if p.startswith("place_tables")]
    assert int(stats.split("tables_hbm_bytes=")[1].split(",")[0].rstrip(")")) == 6000 * 16 * 4 + 6000 * 4


def test_fused_adam_on_cuda_refuses_fp16_tables_and_the_other_stepped_optimizers_take_them():
    """fbgemm-gpu 1.6.0's Adam kernel fails on fp16 weights (seen on an H100: it wants an fp32 row
    counter and is handed an empty one of the weights' type); LAMB and the partial row-wise forms have
    no such state."""
    precision = "fp16"
    model, inputs = M.BagList(rows=ROWS), M.bag_inputs(rows=ROWS)
    with pytest.raises(InputError, match=rf"tables \['bags.0', 'bags.1', 'bags.2'\].*fbgemm's fused Adam fails on "
                                         rf"tables stored in {precision}"):
        fxrec.explain(model, inputs, device="cuda", optimizer=fxrec.optim.LazyAdam(), weights_precision=precision)
    for cfg in (fxrec.optim.LazyLamb(), fxrec.optim.PartialRowWiseAdam(), fxrec.optim.PartialRowWiseLamb()):
        (g,) = fxrec.explain(model, inputs, device="cuda", optimizer=cfg, weights_precision=precision).groups
        assert (g.kernel_train, g.fused, g.dtypes) == ("fbgemm", cfg.kind, [precision] * 3), g


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.EmbeddingBag(30, 8, mode="sum")

    def forward(self, ids, offsets):
        return self.emb(ids, offsets) @ self.emb.weight.t()  # the table also scores the rows


@pytest.mark.parametrize("case,kw,match", [
    ("no optimizer", {}, r"weights_precision='fp16' for tables \['bags.0', 'bags.1', 'bags.2'\], which only fbgemm's TBE "
                         r"stores, and fbgemm cannot run them here \(not fbgemm: tables stored in fp16 train only with an "
                         r"optimizer fused into fbgemm's backward\)"),
    ("bf16 on cpu", dict(optimizer=fxrec.optim.SGD(lr=0.1), weights_precision="bf16"),
     r"fbgemm's CPU build stores fp16, not bf16"),
    ("adam on cpu", dict(optimizer=fxrec.optim.LazyAdam()), r"fbgemm fuses adam on CUDA only"),
    ("inference", dict(mode="inference"), r"weights_precision= is for training; to serve tables in fp16 use "
                                           r"mode='inference', quantize='fp16'"),
    ("unknown", dict(weights_precision="int8"), r"weights_precision must be one of \('fp32', 'fp16', 'bf16'\)"),
    ("unused key", dict(optimizer=fxrec.optim.SGD(lr=0.1), weights_precision={"bags.9": "fp16"}),
     r"weights_precision keys \['bags.9'\] match no embedding table"),
    ("shadowed key", dict(optimizer=fxrec.optim.SGD(lr=0.1), weights_precision={"bags.*": "fp16", "bags.1": "fp32"}),
     r"weights_precision key 'bags.1' decides for no table: every table it names \(\['bags.1'\]\) an earlier key "
     r"names \('bags.\*'\)"),
    ("verify", dict(optimizer=fxrec.optim.SGD(lr=0.1), verify=True), r"verify= and check_passes= compare with"),
    ("check_passes", dict(optimizer=fxrec.optim.SGD(lr=0.1), check_passes=True), r"verify= and check_passes="),
])
def test_what_cannot_be_stored_lower_is_an_error_naming_the_tables(case, kw, match):
    kw = {"weights_precision": "fp16", **kw}
    with pytest.raises(InputError, match=match):
        fxrec.transform(M.BagList(rows=ROWS), M.bag_inputs(rows=ROWS), **kw)


def test_a_table_read_outside_its_lookups_or_left_as_written_is_not_stored_lower():
    with pytest.raises(InputError, match=r"table 'emb' is also used outside its lookups"):
        fxrec.transform(Tied(), (torch.randint(0, 30, (6,)), torch.tensor([0, 2, 4])),
                        optimizer=fxrec.optim.SGD(lr=0.1), weights_precision="fp16")
    with pytest.raises(InputError, match=r"table 'maxbag', but its lookup of .* stays as written"):
        fxrec.transform(M.NotLowerable(), M.not_lowerable_inputs(), optimizer=fxrec.optim.SGD(lr=0.1),
                        weights_precision={"maxbag": "fp16", "ok": "fp16"})
    half = torch.nn.EmbeddingBag(10, 8, mode="sum").half()

    class Half(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.h = half

        def forward(self, ids, offsets):
            return self.h(ids, offsets)

    with pytest.raises(InputError, match=r"weights_precision='fp16' for table 'h', which is float16"):
        fxrec.transform(Half(), (torch.tensor([1, 2]), torch.tensor([0, 1])), optimizer=fxrec.optim.SGD(lr=0.1),
                        weights_precision="fp16")


def test_fp32_for_every_table_changes_nothing_in_any_mode():
    x = M.bag_inputs(rows=ROWS)
    for kw in (dict(mode="inference"), dict(optimizer=fxrec.optim.SGD(lr=0.1))):
        fast = fxrec.transform(M.BagList(rows=ROWS), x, weights_precision="fp32", **kw)
        assert all(p.dtype == torch.float32 for p in fast.parameters())


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_bf16_is_refused_on_both_devices_naming_the_tables(device):
    """fbgemm's CPU build has no bf16 rows; fbgemm-gpu 1.6.0's CUDA forward neither (seen on an H100)."""
    why = {"cpu": "fbgemm's CPU build stores fp16, not bf16", "cuda": "fbgemm-gpu 1.6.0's CUDA forward has no bf16 rows"}
    with pytest.raises(InputError, match=r"weights_precision='bf16' for tables \['bags.0', 'bags.1', 'bags.2'\].*"
                                         + why[device]):
        fxrec.explain(M.BagList(rows=ROWS), M.bag_inputs(rows=ROWS), device=device,
                      optimizer=fxrec.optim.SGD(lr=0.1), weights_precision="bf16")


def test_the_reports_tables_give_the_stored_dtype_and_bytes():
    """report.tables says dtype and bytes as stored in the transformed model: fp16 rows, 2 bytes a
    value, for the tables weights_precision= names (it said float32), the others as the model."""
    model = M.BagList(rows=(40, 30, 20))
    fast = fxrec.transform(model, M.bag_inputs(rows=(40, 30, 20)), optimizer=fxrec.optim.SGD(lr=0.1),
                           weights_precision={"bags.0": "fp16"})
    tables = {t["name"]: t for t in fast.report.tables}
    dim = tables["bags.0"]["dim"]
    assert (tables["bags.0"]["dtype"], tables["bags.0"]["bytes"]) == ("float16", 40 * dim * 2)
    assert fast.get_parameter("bags.0.weight").dtype == torch.float16
    assert (tables["bags.1"]["dtype"], tables["bags.1"]["bytes"]) == ("float32", 30 * dim * 4)


def test_a_model_converted_to_another_dtype_is_told_why_its_fp16_rows_cannot_run():
    """(The error blamed features of different batch sizes.)"""
    plain, fast = fp16_model()
    fast.double()
    dense, ids, offsets = M.bag_inputs(rows=ROWS)
    with pytest.raises(ValueError, match=r"stored in fp16 by fbgemm's kernel, which cannot take their parameters as "
                                         r"they are now \(torch.float64 on cpu"):
        fast(dense.double(), ids, offsets)
    fast.float()
    fast(*M.bag_inputs(rows=ROWS))


class _OddWidths(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.EmbeddingBag(500, 5, mode="sum")  # stored 8 wide in fbgemm's TBE
        self.b = torch.nn.EmbeddingBag(500, 12, mode="sum")

    def forward(self, i, o):
        return torch.cat([self.a(i, o), self.b(i, o)], 1)


@pytest.mark.parametrize("precision", [None, "fp16"])
def test_the_reports_table_bytes_count_the_columns_the_tbe_pads(precision):
    """report.tables gave rows x dim for a table fbgemm stores padded (dim 5 in 8 columns)."""
    x = (torch.randint(0, 500, (12,)), torch.arange(0, 12, 3))
    kw = {} if precision is None else {"weights_precision": precision}
    fast = fxrec.transform(_OddWidths(), x, backend="fbgemm", optimizer=fxrec.optim.SGD(lr=0.1), **kw)
    fxrec.graph_module.bind_tables(fast)
    for t in fast.report.tables:
        p = fast.get_parameter(t["name"] + ".weight")
        assert t["bytes"] == p.shape[0] * p.stride(0) * p.element_size(), t
    said = fxrec.explain(_OddWidths(), x, device="cuda", optimizer=fxrec.optim.SGD(lr=0.1), **kw).tables
    assert [t["bytes"] for t in said] == [t["bytes"] for t in fast.report.tables]


def test_a_refusal_names_the_tables_of_every_group_it_refuses():
    """Tables of two groups (sum and mean pooling) in bf16: one error names both groups' tables
    (it named only the first group's, so a user fixed one and met the next)."""
    class TwoPoolings(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.s = torch.nn.EmbeddingBag(10, 4, mode="sum")
            self.m = torch.nn.EmbeddingBag(10, 8, mode="mean")

        def forward(self, ids, offsets):
            return torch.cat([self.s(ids, offsets), self.m(ids, offsets)], 1)

    with pytest.raises(InputError) as err:
        fxrec.transform(TwoPoolings(), (torch.tensor([1, 2, 3]), torch.tensor([0, 2])),
                        optimizer=fxrec.optim.SGD(lr=0.1), weights_precision="bf16")
    assert "2 groups" in str(err.value)
    assert "tables ['s']" in str(err.value) and "tables ['m']" in str(err.value)
