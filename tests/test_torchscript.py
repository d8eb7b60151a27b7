"""fxrec.export.torchscript: the transformed model scripts, saves, loads, and gives its outputs."""

import copy
import io
from typing import Dict

import pytest
import torch

import fxrec
from tests import models as M

ROWS = (500, 800, 300)

CASES = {
    "bags_fp32_fbgemm": (lambda: M.BagList(rows=ROWS, dim=16), lambda s, b=6: M.bag_inputs(rows=ROWS, batch=b, seed=s), dict(backend="fbgemm")),
    "bags_fp32_direct": (lambda: M.BagList(rows=ROWS, dim=16), lambda s, b=6: M.bag_inputs(rows=ROWS, batch=b, seed=s), dict(backend="reference")),
    "bags_int8": (lambda: M.BagList(rows=ROWS, dim=16), lambda s, b=6: M.bag_inputs(rows=ROWS, batch=b, seed=s),
                  dict(mode="inference", quantize="int8")),
    "bags_mixed_fp16_out": (lambda: M.BagList(rows=ROWS, dim=16), lambda s, b=6: M.bag_inputs(rows=ROWS, batch=b, seed=s),
                            dict(mode="inference", quantize={"bags.0": "int4", "*": "fp16"}, output_dtype="fp16")),
    "sequence_fp16": (M.SequenceMean, lambda s, b=5: M.seq_inputs(batch=b, seed=s), dict(mode="inference", quantize="fp16")),
    "sequence_fp32": (M.SequenceMean, lambda s, b=5: M.seq_inputs(batch=b, seed=s), dict(backend="fbgemm")),
    "weighted_int8": (M.WeightedBags, lambda s, b=4: M.weighted_inputs(batch=b, seed=s), dict(mode="inference", quantize="int8")),
    "weighted_fp32": (M.WeightedBags, lambda s, b=4: M.weighted_inputs(batch=b, seed=s), dict(backend="fbgemm")),
    "field_dict": (M.FieldDict, lambda s, b=7: M.field_inputs(batch=b, seed=s), dict(mode="inference", quantize="int8")),
    "shared_tables": (M.SharedTables, lambda s, b=4: M.shared_inputs(batch=b, seed=s), dict(mode="inference", quantize="int4")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_scripted_model_saves_loads_and_matches(case, tmp_path):
    make_model, make_inputs, kw = CASES[case]
    model = make_model().eval()
    fast = fxrec.transform(model, make_inputs(0), timing_rounds=1, **kw)
    fxrec.export.torchscript(fast, tmp_path / "model.pt")
    loaded = torch.jit.load(str(tmp_path / "model.pt"))
    for seed in (1, 2):
        x = make_inputs(seed)
        with torch.no_grad():
            want = fast(*x)
            got = loaded(*x)
        if "quantize" in kw:  # fbgemm's quantized operator on the same packed input: the same numbers
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        else:  # PyTorch's lookups in the script; the eager model may have run fbgemm's kernel
            torch.testing.assert_close(got, want)
    if "quantize" not in kw:
        with torch.no_grad():
            torch.testing.assert_close(loaded(*make_inputs(3)), model(*make_inputs(3)))


def test_scripted_graph_is_readable_and_keeps_the_call_signature():
    model = M.BagList(rows=ROWS, dim=16).eval()
    fast = fxrec.transform(model, M.bag_inputs(rows=ROWS), mode="inference", quantize="int8")
    gm = fxrec.export.scriptable(fast)
    assert "def forward(self, dense: torch.Tensor, ids: List[torch.Tensor], offsets: List[torch.Tensor])" in gm.code
    assert ".default(" not in gm.code and "tree_flatten_spec" not in gm.code
    sm = fxrec.export.torchscript(fast)
    x = M.bag_inputs(rows=ROWS, batch=3, seed=5)
    with pytest.raises(Exception, match="input ids must have 3 elements"):
        sm(x[0], x[1][:2], x[2])


def test_scripted_model_names_the_feature_of_a_bad_id():
    model = M.BagList(rows=ROWS, dim=16).eval()
    for kw in (dict(backend="fbgemm"), dict(mode="inference", quantize="int8")):
        sm = fxrec.export.torchscript(fxrec.transform(model, M.bag_inputs(rows=ROWS), **kw))
        dense, ids, offs = M.bag_inputs(rows=ROWS, seed=2)
        ids[1] = ids[1].clone()
        ids[1][0] = 800  # table bags.1 has 800 rows
        with pytest.raises(Exception, match=r"feature 'ids_1' \(table 'bags.1'\) looks up id 800"):
            sm(dense, ids, offs)
        ids[1] = ids[1].double()  # (the dtype was named by its number in TorchScript: "dtype 7")
        with pytest.raises(Exception, match=r"feature 'ids_1' \(table 'bags.1'\) got ids of dtype torch.float64; "
                                            r"embedding ids must be int64 or int32"):
            sm(dense, ids, offs)


class _TwoBags(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.EmbeddingBag(30, 8, mode="sum")
        self.b = torch.nn.EmbeddingBag(30, 8, mode="sum")

    def forward(self, ia, oa, ib, ob):
        return torch.cat([self.a(ia, oa), self.b(ib, ob)], 1)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_scripted_serving_names_the_feature_of_ids_of_another_shape_or_batch(quantize):
    """2-D ids with offsets: PyTorch and the eager model raise, the quantized scripted module pooled
    them as if flattened; features of different batch sizes failed in torch.cat naming none."""
    model = _TwoBags().eval()
    ids, offsets = torch.randint(0, 30, (12,)), torch.arange(0, 12, 3)
    scripted = fxrec.export.torchscript(fxrec.transform(model, (ids, offsets, ids, offsets), mode="inference",
                                                        quantize=quantize))
    with pytest.raises(Exception, match=r"input ia \(ids of feature 'ia', table 'a'\) has 2 dims; the model takes 1"):
        scripted(ids.view(4, 3), offsets, ids, offsets)
    with pytest.raises(Exception, match=r"input ob \(offsets of feature 'ib', table 'b'\) has size 3 in dim 0; it "
                                        "must equal oa's size in dim 0"):
        scripted(ids, offsets, ids, offsets[:3])
    with torch.no_grad():
        want = model(ids, offsets, ids, offsets)
    torch.testing.assert_close(scripted(ids, offsets, ids, offsets), want,
                               **({} if quantize is None else dict(rtol=0.05, atol=0.05)))


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_scripted_serving_refuses_ids_or_offsets_on_another_device_naming_the_feature(quantize):
    """Ids on meta failed in torch's .item() (no feature named); offsets too; per-sample weights on
    meta were read as weights by the fp32 module (a review found a garbage answer)."""
    model = _TwoBags().eval()
    ids, offsets = torch.randint(0, 30, (12,)), torch.arange(0, 12, 3)
    scripted = fxrec.export.torchscript(fxrec.transform(model, (ids, offsets, ids, offsets), mode="inference",
                                                        quantize=quantize))
    with pytest.raises(Exception, match=r"feature 'ib' \(table 'b'\) got ids on meta, but the table is on cpu"):
        scripted(ids, offsets, ids.to("meta"), offsets)
    with pytest.raises(Exception, match=r"feature 'ia' \(table 'a'\) got offsets on meta, but the table is on cpu"):
        scripted(ids, offsets.to("meta"), ids, offsets)
    weighted = _Weighted().eval()
    psw = torch.rand(12)
    scripted = fxrec.export.torchscript(fxrec.transform(weighted, (ids, offsets, psw), mode="inference",
                                                        quantize=quantize))
    with pytest.raises(Exception, match=r"feature 'ids' \(table 'bag'\) got per-sample weights on meta"):
        scripted(ids, offsets, psw.to("meta"))  # (fp32 read the meta tensor's memory as weights)
    torch.testing.assert_close(scripted(ids, offsets, psw), weighted(ids, offsets, psw),
                               **({} if quantize is None else dict(rtol=0.05, atol=0.05)))


def test_original_and_transformed_models_are_untouched_by_scripting():
    model = M.BagList(rows=ROWS, dim=16).eval()
    fast = fxrec.transform(model, M.bag_inputs(rows=ROWS), backend="fbgemm")
    before = fast.code
    fxrec.export.torchscript(fast)
    assert fast.code == before
    x = M.bag_inputs(rows=ROWS, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(fast(*x), model(*x))


class _Weighted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(30, 8, mode="sum")

    def forward(self, ids, offsets, psw):
        return self.bag(ids, offsets, per_sample_weights=psw)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_per_sample_weights_of_another_length_than_the_ids_are_refused_by_every_serving_form(quantize):
    """(A quantized TorchScript module or exported program read weights past the end of a short
    tensor, giving garbage, and ignored the extra ones of a long one.)"""
    model = _Weighted().eval()
    ids, offsets = torch.arange(1, 9), torch.tensor([0, 2, 4, 6])
    fast = fxrec.transform(model, (ids, offsets, torch.rand(8)), mode="inference", quantize=quantize)
    scripted = fxrec.export.torchscript(fast)
    exported = fxrec.export.program(fast, (ids, offsets, torch.rand(8))).module()
    with torch.no_grad():
        for n in (2, 20):
            psw = torch.rand(n)
            with pytest.raises(Exception, match=r"input psw \(per-sample weights of feature 'ids', table 'bag'\) has "
                                                rf"size {n} in dim 0; it must equal ids's size in dim 0"):
                scripted(ids, offsets, psw)
            with pytest.raises(Exception, match=r"Guard failed: psw.size\(\)\[0\] == ids.size\(\)\[0\]"):
                exported(ids, offsets, psw)
        psw = torch.rand(8)
        torch.testing.assert_close(scripted(ids, offsets, psw), fast(ids, offsets, psw), rtol=0, atol=0)


def test_a_model_with_a_no_grad_block_is_refused_by_the_torchscript_form_naming_the_block():
    """(torch.jit.script failed inside the block's body: "attribute lookup is not defined on builtin".)"""
    class WithBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.e = torch.nn.EmbeddingBag(30, 4, mode="sum")

        def forward(self, ids, offsets):
            with torch.no_grad():
                ids = ids.clamp(max=29)
            return self.e(ids, offsets)

    x = (torch.arange(6), torch.tensor([0, 2, 4]))
    fast = fxrec.transform(WithBlock(), x)
    with pytest.raises(ValueError, match=r"has a torch.no_grad\(\) / torch.enable_grad\(\) block .*serve it as a "
                                         r"torch.export program"):
        fxrec.export.torchscript(fast)
    torch.testing.assert_close(fxrec.export.program(fast, x).module()(*x), fast(*x), rtol=0, atol=0)


class _LastOffsetBag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.EmbeddingBag(40, 8, mode="sum", include_last_offset=True)

    def forward(self, i, o):
        return self.a(i, o)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_ids_after_the_last_offset_are_not_checked_by_the_scripted_form_as_pytorch_never_reads_them(quantize):
    """include_last_offset=True: PyTorch (and the eager model) ignore ids after offsets[-1], out of
    range or not; the TorchScript form refused them, naming an id nothing looks up."""
    model = _LastOffsetBag().eval()
    fast = fxrec.transform(model, (torch.randint(0, 40, (6,)), torch.tensor([0, 2, 4, 6])), mode="inference",
                           quantize=quantize)
    sm = fxrec.export.torchscript(fast)
    x = (torch.tensor([1, 2, 3, 4, 7, 8, 1000, -5]), torch.tensor([0, 2, 4, 6]))
    with torch.no_grad():
        torch.testing.assert_close(sm(*x), fast(*x), rtol=0, atol=0)
        if quantize is None:
            torch.testing.assert_close(sm(*x), model(*x), rtol=0, atol=0)
    bad = (torch.tensor([1, 2, 3, 1000, 7, 8, 9]), torch.tensor([0, 2, 4, 6]))  # 1000 is looked up
    with pytest.raises(Exception, match=r"feature 'i' \(table 'a'\) looks up id 1000"):
        sm(*bad)


class _LastOffsetPaddedBag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.EmbeddingBag(10, 8, mode="sum", include_last_offset=True, padding_idx=0)

    def forward(self, i, o):
        return self.a(i, o)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_with_a_padding_row_the_ids_after_the_last_offset_are_still_checked(quantize):
    """With a padding_idx PyTorch's last bag runs to the end of the ids, so a bad id there is read
    (and refused by PyTorch): the scripted form must refuse it too, not read out of the table."""
    model = _LastOffsetPaddedBag().eval()
    fast = fxrec.transform(model, (torch.randint(0, 10, (6,)), torch.tensor([0, 2, 4, 6])), mode="inference",
                           quantize=quantize)
    sm = fxrec.export.torchscript(fast)
    bad = (torch.tensor([1, 2, 3, 4, 5, 6, 12]), torch.tensor([0, 2, 4, 6]))
    with pytest.raises(Exception):
        model(*bad)
    with pytest.raises(Exception, match=r"feature 'i' \(table 'a'\) looks up id 12"):
        sm(*bad)


class _EmptyExtra(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(10, 4, mode="sum")

    def forward(self, ids, offsets, extra):
        out = self.bag(ids, offsets)
        for t in extra:
            out = out + t
        return out


class _HalfOfHistory(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(5, 6))
        self.top = torch.nn.Linear(12, 1)

    def forward(self, hist):
        o = torch.nn.functional.embedding(hist, self.w).flatten(1)
        return self.top(o[:, :max(1, o.shape[1] // 2)])


@pytest.mark.parametrize("case", ["empty_tuple", "sym_max"])
def test_empty_tuple_inputs_and_max_of_sizes_script(case):
    """An input that is an empty tuple wrote `Tuple[]` into the scripted forward (a SyntaxError in
    emit_scriptable); `max(1, o.shape[1] // 2)` on a dynamic size left torch.sym_max in the graph,
    which TorchScript does not know (found by the third fuzzer)."""
    torch.manual_seed(0)
    model, example = {"empty_tuple": (_EmptyExtra(), (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2]), ())),
                      "sym_max": (_HalfOfHistory(), (torch.randint(0, 5, (3, 4)),))}[case]
    scripted = fxrec.export.torchscript(fxrec.transform(model.eval(), example, mode="inference"))
    torch.testing.assert_close(scripted(*example), model(*example))
    if case == "sym_max":
        other = (torch.randint(0, 5, (2, 4)),)
        torch.testing.assert_close(scripted(*other), model(*other))


class _BranchOnSizes(torch.nn.Module):
    """Code that tests its inputs' sizes: capture takes the branch of the example's (L >= 3), and
    the dense input's width 1 is a constant of the captured graph."""

    def __init__(self):
        super().__init__()
        self.e = torch.nn.Embedding(50, 4)

    def forward(self, ids, dense):
        if ids.shape[1] > 2:
            return self.e(ids).sum(1) / dense.shape[1] + dense
        return self.e(ids).mean(1) * 100


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_the_serving_forms_refuse_the_sizes_the_model_was_not_captured_for(quantize):
    """The branch the model took at capture is all the graph holds: the exported program and the
    TorchScript module ran it on any size (L = 2: 90 off the plain model; dense of width 3: the
    division by 1 kept), where the eager transformed model says which input is wrong."""
    torch.manual_seed(0)
    model = _BranchOnSizes().eval()
    ex = (torch.randint(0, 50, (4, 3)), torch.randn(4, 1))
    fast = fxrec.transform(model, ex, mode="inference", quantize=quantize)
    scripted = fxrec.export.torchscript(fast)
    program = fxrec.export.program(fast, ex).module()
    for bad, scripted_says, program_says in (
            ((torch.randint(0, 50, (4, 2)), torch.randn(4, 1)),
             r"input ids \(ids of feature 'ids', table 'e'\) has size 2 in dim 1; the model accepts 3 or more there",
             r"ids.size\(\)\[1\] >= 3"),
            ((torch.randint(0, 50, (4, 3)), torch.randn(4, 3)),
             r"input dense has size 3 in dim 1; the model takes only 1 there", r"dense.size\(\)\[1\] == 1")):
        with pytest.raises(Exception, match=scripted_says):
            scripted(*bad)
        with pytest.raises(Exception, match=program_says):
            program(*bad)
    tol = {} if quantize is None else dict(rtol=0.05, atol=0.05)
    for x in ((torch.randint(0, 50, (2, 5)), torch.randn(2, 1)), ex):  # other sizes the model takes
        with torch.no_grad():
            want = model(*x)
        torch.testing.assert_close(scripted(*x), want, **tol)
        torch.testing.assert_close(program(*x), want, **tol)
    buf = io.BytesIO()
    torch.jit.save(scripted, buf)
    buf.seek(0)
    with pytest.raises(Exception, match="has size 2 in dim 1"):
        torch.jit.load(buf)(torch.randint(0, 50, (4, 2)), torch.randn(4, 1))
    copy.deepcopy(fast)  # (the guards' generated check is rebuilt, not copied)


class _ViewByBatch(torch.nn.Module):
    """``ids.view(B, -1)``: export states that the ids' count divides by B (a ``%`` of two sizes)."""

    def __init__(self):
        super().__init__()
        self.e = torch.nn.EmbeddingBag(20, 4, mode="sum")

    def forward(self, ids, dense):
        return self.e(ids.view(dense.shape[0], -1)) + dense


class _HalfWidth(torch.nn.Module):
    """``int(W * 0.5)``: the condition export writes reads ``math.trunc`` and ``torch.sym_float``."""

    def __init__(self):
        super().__init__()
        self.e = torch.nn.Embedding(20, 4)

    def forward(self, ids, dense):
        return self.e(ids).sum(1) * int(dense.shape[1] * 0.5) + dense[:, :1]


def test_the_serving_checks_build_for_conditions_torchscript_cannot_write_and_never_divide_by_a_zero_size():
    """A check of ``count % B == 0`` scripted killed the process at B = 0 (SIGFPE: TorchScript's
    interpreter does not stop an integer modulo by 0); ``math.trunc`` made export (NameError) and
    scripting (undefined value math) fail. Those left out of the scripted check, the ops still
    refuse what does not fit."""
    model = _ViewByBatch().eval()
    ex = (torch.randint(0, 20, (12,)), torch.randn(4, 4))
    scripted = fxrec.export.torchscript(fxrec.transform(model, ex, mode="inference"))
    with pytest.raises(Exception):
        scripted(torch.zeros(0, dtype=torch.long), torch.randn(0, 4))
    torch.testing.assert_close(scripted(*ex), model(*ex))
    model = _HalfWidth().eval()
    ex = (torch.randint(0, 20, (4, 5)), torch.randn(4, 6))
    fast = fxrec.transform(model, ex, mode="inference")
    forms = (fxrec.export.torchscript(fast), fxrec.export.program(fast, ex).module())
    for x in ((torch.randint(0, 20, (2, 3)), torch.randn(2, 6)), ex):
        for form in forms:
            torch.testing.assert_close(form(*x), model(*x))
    bad = (torch.randint(0, 20, (2, 3)), torch.randn(2, 10))  # another width: int(5.0) != int(3.0)
    with pytest.raises(Exception):
        fast(*bad)
    for form in forms:
        with pytest.raises(Exception):
            form(*bad)


class _EvenLength(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.e = torch.nn.Embedding(50, 4)

    def forward(self, ids, dense):
        if ids.shape[1] % 2 == 0:
            return self.e(ids).sum(1)
        return self.e(ids).mean(1) * 100


class _HalfLength(_EvenLength):
    def forward(self, ids, dense):
        if ids.shape[1] / 2 > 1.6:
            return self.e(ids).sum(1)
        return self.e(ids).mean(1) * 100


class _LongerOfTwo(_EvenLength):
    def forward(self, ids, dense):
        if max(ids.shape[1], dense.shape[1]) > 3:
            return self.e(ids).sum(1)
        return self.e(ids).mean(1) * 100


@pytest.mark.parametrize("cls", [_EvenLength, _HalfLength, _LongerOfTwo])
def test_the_scripted_check_keeps_conditions_dividing_by_a_number_and_of_max(cls):
    """``L % 2 == 0``, ``L / 2 > 1.6``, ``max(L, W) > 3``: left out of the TorchScript check (it kept
    no division and no function), the module ran the captured branch at L = 3 (up to 160 off the
    plain model); a division by a number other than 0 cannot stop the process, and TorchScript
    knows max (found by the serving hunt)."""
    torch.manual_seed(0)
    model = cls().eval()
    ex = (torch.randint(0, 50, (4, 4)), torch.ones(4, 2))
    scripted = fxrec.export.torchscript(fxrec.transform(model, ex, mode="inference"))
    with pytest.raises(Exception, match="the inputs' sizes do not meet"):
        scripted(torch.randint(0, 50, (4, 3)), torch.ones(4, 2))
    x = (torch.randint(0, 50, (3, 6)), torch.ones(3, 2))
    torch.testing.assert_close(scripted(*x), model(*x), rtol=0, atol=0)


class _KeyWithBraces(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.e = torch.nn.Embedding(50, 4)

    def forward(self, feats: Dict[str, torch.Tensor]):
        a = self.e(feats["u{}x"])
        return a.sum(1) if a.shape[1] > 2 else a.mean(1)


def test_the_scripted_checks_message_puts_the_size_after_an_input_name_holding_braces():
    """The size went into the first "{}" of the message, which was the dict key's (serving hunt)."""
    fast = fxrec.transform(_KeyWithBraces().eval(), ({"u{}x": torch.randint(0, 50, (4, 3))},), mode="inference")
    scripted = fxrec.export.torchscript(fast)
    with pytest.raises(Exception, match=r"input feats\[u\{\}x\] \(ids of feature .*\) has size 2 in dim 1; "):
        scripted({"u{}x": torch.randint(0, 50, (4, 2))})
    with pytest.raises(Exception, match=r"input feats\[u\{\}x\] \(ids of feature .*\) has 1 dims; the model takes 2"):
        scripted({"u{}x": torch.randint(0, 50, (4,))})
