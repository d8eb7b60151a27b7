"""Bad input gets an error that names the table/feature and says what was wrong."""

import pytest
import torch

import fxrec
from tests import models as M


class _Calls:
    """A transformed model called with autograd on (the training path) or off (the inference path)."""

    def __init__(self, mod, grad):
        self.mod, self.grad = mod, grad

    def __call__(self, *args):
        with torch.set_grad_enabled(self.grad):
            return self.mod(*args)

    def __getattr__(self, name):
        return getattr(self.mod, name)


@pytest.fixture(params=[("fbgemm", True), ("fbgemm", False), ("native", True), ("native", False), ("reference", True),
                        ("reference", False)],
                ids=lambda p: f"{p[0]}-{'train' if p[1] else 'eval'}")
def fast(request):
    backend, grad = request.param
    return _Calls(fxrec.transform(M.BagList(), M.bag_inputs(), backend=backend), grad)


def test_id_out_of_range_names_table_and_feature(fast):
    dense, ids, offs = M.bag_inputs()
    ids[1] = ids[1].clone()
    ids[1][0] = 80  # table bags.1 has 80 rows
    with pytest.raises(IndexError, match=r"feature 'ids_1'.*id 80.*table 'bags.1'.*80 rows"):
        fast(dense, ids, offs)


def test_negative_id_names_table(fast):
    dense, ids, offs = M.bag_inputs()
    ids[2] = ids[2].clone()
    ids[2][-1] = -3
    with pytest.raises(IndexError, match=r"id -3 in table 'bags.2'"):
        fast(dense, ids, offs)


def test_float_ids_are_rejected(fast):
    dense, ids, offs = M.bag_inputs()
    ids[0] = ids[0].float()
    with pytest.raises(TypeError, match=r"feature 'ids_0' \(table 'bags.0'\) got ids of dtype torch.float32"):
        fast(dense, ids, offs)


def test_float_offsets_are_rejected(fast):
    dense, ids, offs = M.bag_inputs()
    offs[2] = offs[2].float()
    with pytest.raises((TypeError, RuntimeError), match=r"feature 'ids_2' needs 1-D integer offsets|offsets"):
        fast(dense, ids, offs)


def test_offsets_that_do_not_match_ids(fast):
    dense, ids, offs = M.bag_inputs(empty_bags=False)
    offs[0] = offs[0].clone()
    offs[0][-1] = ids[0].numel() + 5
    with pytest.raises(ValueError, match=r"offsets of feature 'ids_0'.*table 'bags.0'"):
        fast(dense, ids, offs)
    offs = M.bag_inputs(empty_bags=False)[2]
    offs[1] = offs[1].flip(0)
    with pytest.raises(ValueError, match=r"offsets of feature 'ids_1'"):
        fast(dense, ids, offs)


def test_wrong_number_of_inputs(fast):
    dense, ids, offs = M.bag_inputs()
    with pytest.raises(Exception, match=r"(?i)argument|input|expected"):
        fast(dense, ids)
    with pytest.raises(ValueError, match="input ids must have 3 elements"):
        fast(dense, ids[:2], offs[:2])


def test_empty_bags_and_empty_batch_behave_as_pytorch(fast):
    model = M.BagList()
    fast.load_state_dict(model.state_dict())
    dense, ids, offs = M.bag_inputs()
    offs = [torch.zeros(6, dtype=torch.long) for _ in ids]  # every bag empty but the last
    torch.testing.assert_close(fast(dense, ids, offs), model(dense, ids, offs))
    empty = (torch.rand(0, 4), [torch.zeros(0, dtype=torch.long)] * 3, [torch.zeros(0, dtype=torch.long)] * 3)
    out = fast(*empty)
    torch.testing.assert_close(out, model(*empty))
    assert out.shape == (0, 32)


def test_capture_error_names_user_file_and_line():
    class Bad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.e = torch.nn.Embedding(10, 4)

        def forward(self, ids):
            if ids.sum().item() > 3:  # data-dependent control flow
                return self.e(ids)
            return self.e(ids) * 2

    with pytest.raises(fxrec.CaptureError, match=r"(?s)test_errors\.py:\d+.*item.*What to do"):
        fxrec.transform(Bad(), (torch.tensor([1, 2]),))


class _QuotedName(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tabs = torch.nn.ModuleDict({'user "id"': torch.nn.EmbeddingBag(10, 4, mode="sum")})

    def forward(self, i, o):
        return self.tabs['user "id"'](i, o)


def test_a_module_name_torch_cannot_write_into_code_is_a_capture_error_naming_it():
    """torch writes module names into its generated code unescaped: a bare SyntaxError before."""
    x = (torch.randint(0, 10, (6,)), torch.tensor([0, 2, 4]))
    for call in (lambda: fxrec.transform(_QuotedName(), x), lambda: fxrec.explain(_QuotedName(), x)):
        with pytest.raises(fxrec.CaptureError, match=r"module names \['tabs\.user \"id\"'\] hold quotes"):
            call()


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="backend"):
        fxrec.transform(M.BagList(), M.bag_inputs(), backend="gpu")


@pytest.mark.parametrize("kw,error,match", [
    (dict(autotune=True, timing_rounds=0), ValueError, "timing_rounds must be an int of at least 1.*got 0"),
    (dict(timing_rounds=-2), ValueError, "timing_rounds must be an int of at least 1"),
    (dict(verify=True, rtol=-1e-3), ValueError, "rtol must be a number of at least 0"),
    (dict(verify=True, atol=float("nan")), ValueError, "atol must be a number of at least 0"),
    (dict(logger="fxrec"), TypeError, "logger must be a logging.Logger.*got str"),
])
def test_transforms_own_settings_are_checked_naming_the_argument(kw, error, match):
    """timing_rounds=0 with autotune ended in a PassError of choose_kernels (no median of no rounds);
    a negative rtol in torch's own error, a logger given as a string in an AttributeError."""
    with pytest.raises(error, match=match):
        fxrec.transform(M.BagList(), M.bag_inputs(), **kw)


def test_a_logger_adapter_and_a_numpy_int_are_taken():
    import logging

    import numpy as np

    model = M.BagList()
    fast = fxrec.transform(model, M.bag_inputs(), logger=logging.LoggerAdapter(logging.getLogger("x"), {}),
                           timing_rounds=np.int64(2))
    torch.testing.assert_close(fast(*M.bag_inputs()), model(*M.bag_inputs()))


def test_verify_reports_the_table_and_difference():
    model = M.BagList()
    inputs = M.bag_inputs()
    fast = fxrec.transform(model, inputs, backend="fbgemm")
    other = M.BagList()  # other weights: outputs differ, and no lowered lookup is to blame
    with pytest.raises(fxrec.VerificationError, match=r"(?s)largest difference.*'bags.0.weight' holds other values in "
                       r"the transformed model.*not compared from the same weights") as e:
        fxrec.compare_models(other, fast, inputs, {})
    assert "kernel differs" not in str(e.value) and "comes from elsewhere" not in str(e.value), e.value
    # one row of one table changed in the transformed model (as the audit did): that table is named
    edited = fxrec.transform(model, inputs, backend="fbgemm")
    with torch.no_grad():
        edited.bags[1].weight[3] += 1.0
    with pytest.raises(fxrec.VerificationError, match=r"'bags.1.weight' holds other values.*difference 1\b") as e:
        fxrec.compare_models(model, edited, inputs, {})
    assert "bags.0" not in str(e.value) and "bags.2" not in str(e.value), e.value
    # Fault injection: give the TBE its own stale copy of the weights, then change one row of it.
    group = fast.get_submodule("fxrec_group_0")
    tbe = group._bound.tbe
    tbe.weights_host.data = tbe.weights_host.data.clone()
    with torch.no_grad():
        start = 50 * 8 + 80 * 8  # bags.2 is the third table in the flat buffer
        tbe.weights_host.data[start : start + 30 * 8] += 1.0
    with pytest.raises(fxrec.VerificationError, match=r"table 'bags.2' \(feature 'ids_2'"):
        fxrec.compare_models(model, fast, inputs, {})


def test_sequence_lookup_out_of_range_names_table():
    model = M.SequenceMean()
    inputs = M.seq_inputs()
    for backend in ("fbgemm", "reference"):
        fast = fxrec.transform(model, inputs, backend=backend)
        bad = list(inputs)
        bad[2] = bad[2].clone()
        bad[2][0, 0] = 40  # table attn has 40 rows
        with pytest.raises(IndexError, match=r"id 40 in table 'attn'"):
            fast(*bad)


class TwoPooled(torch.nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.e, self.f = torch.nn.Embedding(20, 8), torch.nn.Embedding(20, 8)

    def forward(self, a, b):
        pool = (lambda t: t.sum(1)) if self.mode == "sum" else (lambda t: t.mean(1))
        return torch.cat([pool(self.e(a)), pool(self.f(b))], 1)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_rows_with_no_ids_pool_as_pytorch_does(mode):
    model = TwoPooled(mode)
    fast = fxrec.transform(model, (torch.randint(0, 20, (4, 3)), torch.randint(0, 20, (4, 2))), backend="fbgemm")
    x = (torch.randint(0, 20, (4, 3)), torch.zeros(4, 0, dtype=torch.long))
    torch.testing.assert_close(fast(*x), model(*x), equal_nan=True)


@pytest.mark.parametrize("backend", ["fbgemm", "native", "reference"])
def test_include_last_offset_with_padding_and_bad_offsets(backend):
    class Bag(torch.nn.Module):
        def __init__(self, pad):
            super().__init__()
            self.b = torch.nn.EmbeddingBag(10, 8, mode="sum", include_last_offset=True, padding_idx=pad)

        def forward(self, ids, offsets):
            return self.b(ids, offsets)

    ids = torch.tensor([1, 2, 3, 3, 0, 5, 3, 7])
    for pad in (3, None):
        model = Bag(pad)
        fast = fxrec.transform(model, (ids, torch.tensor([0, 2, 2, 5, 8])), backend=backend)
        # trailing ids after offsets[-1]: PyTorch counts them in the last bag with a padding_idx, not without
        torch.testing.assert_close(fast(ids, torch.tensor([0, 2, 2, 5, 6])), model(ids, torch.tensor([0, 2, 2, 5, 6])))
        with pytest.raises((ValueError, RuntimeError), match=r"offsets of feature 'ids' \(table 'b'\)|offsets\[-1\] can not be greater"):
            fast(ids, torch.tensor([0, 2, 2, 5, 9]))
        for last in (-1, 4):  # before the last bag's start: PyTorch refuses it (with a padding_idx it ignores it)
            if pad is None:
                with pytest.raises((ValueError, RuntimeError), match=r"offsets of feature 'ids' \(table 'b'\)"):
                    fast(ids, torch.tensor([0, 2, 2, 5, last]))  # (-1 dropped the last id and answered)


@pytest.mark.parametrize("serve", ["eager", "torchscript"])
def test_include_last_offset_with_a_negative_last_offset_is_refused_in_quantized_serving(serve):
    """(Found by the differential fuzzer: the quantized group dropped the last id and answered.)"""
    bag = torch.nn.EmbeddingBag(7, 8, mode="sum", include_last_offset=True).eval()
    ids, off = torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([0, 2, 4, 6])
    fast = fxrec.transform(bag, (ids, off), mode="inference", quantize="int8")
    served = fxrec.export.torchscript(fast) if serve == "torchscript" else fast
    with pytest.raises((ValueError, torch.jit.Error), match=r"offsets of feature .* (end at -1|do not match its 6 ids)"):
        served(ids, torch.tensor([0, 2, 4, -1]))


def test_example_inputs_that_do_not_fit_forward_say_they_are_its_positional_arguments():
    """(A list of three tensors for forward(self, ids) failed inside torch.export: "too many
    positional arguments".)"""
    class ListModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bags = torch.nn.ModuleList(torch.nn.EmbeddingBag(10, 4, mode="sum") for _ in range(3))

        def forward(self, ids):
            return torch.cat([b(i) for b, i in zip(self.bags, ids)], 1)

    ids = [torch.randint(0, 10, (4, 2)) for _ in range(3)]
    with pytest.raises(fxrec.pass_infra.InputError,
                       match=r"the example inputs do not fit ListModel.forward\(ids\): too many positional arguments "
                             r"\(3 positional given\)\. .*for one argument that is a list, pass \(\[\.\.\.\],\)"):
        fxrec.transform(ListModel(), ids)
    model = ListModel()
    torch.testing.assert_close(fxrec.transform(model, (ids,))(ids), model(ids), rtol=0, atol=0)


def test_per_sample_weights_follow_the_tables_dtype_after_double():
    """After ``.double()`` the tables are fp64, and so must their per-sample weights be, as for the
    plain model (fp64 weights were refused as not float32)."""
    from tests.test_torchscript import _Weighted

    model = _Weighted()
    ids, offsets, psw = torch.arange(1, 9), torch.tensor([0, 2, 4, 6]), torch.rand(8)
    fast = fxrec.transform(model, (ids, offsets, psw)).double()
    model.double()
    torch.testing.assert_close(fast(ids, offsets, psw.double()), model(ids, offsets, psw.double()), rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"feature 'ids' \(table 'bag'\) got per-sample weights of dtype torch.float32; "
                                        r"they must be torch.float64"):
        fast(ids, offsets, psw)


@pytest.mark.parametrize("form", ["default", "fbgemm", "reference", "fused", "int8", "int8_torchscript"])
def test_per_sample_weights_on_another_device_than_their_ids_are_refused_naming_the_feature(form):
    """(They were read: the meta tensor's memory taken as weights, a garbage answer on every kernel
    but fbgemm's training one, and in the TorchScript serving module; plain PyTorch reads garbage too.)"""
    from tests.test_torchscript import _Weighted

    model = _Weighted()
    ids, offsets, psw = torch.arange(1, 9), torch.tensor([0, 2, 4, 6]), torch.rand(8)
    kwargs = {"default": {}, "fbgemm": dict(backend="fbgemm"), "reference": dict(backend="reference"),
              "fused": dict(optimizer=fxrec.optim.SGD(lr=0.1)),
              "int8": dict(mode="inference", quantize="int8"), "int8_torchscript": dict(mode="inference", quantize="int8")}
    fast = fxrec.transform(model.eval() if "int8" in form else model, (ids, offsets, psw), **kwargs[form])
    if form == "int8_torchscript":
        fast = fxrec.export.torchscript(fast)
    torch.testing.assert_close(fast(ids, offsets, psw), fast(ids, offsets, psw.clone()))  # (it runs with them)
    with pytest.raises((ValueError, torch.jit.Error),
                       match=r"feature 'ids' \(table 'bag'\) got per-sample weights on meta, but the table is on cpu"):
        fast(ids, offsets, psw.to("meta"))
    with pytest.raises((ValueError, torch.jit.Error), match=r"feature 'ids' \(table 'bag'\) got ids on meta, but the table "
                                                            "is on cpu"):
        fast(ids.to("meta"), offsets, psw)


def test_example_inputs_on_the_meta_device_are_refused():
    """(They were taken, and the first real call failed naming offsets 'on meta' it was not given.)"""
    model = torch.nn.EmbeddingBag(50, 4)
    x = (torch.randint(0, 50, (8,), device="meta"), torch.arange(0, 8, 2, device="meta"))
    with pytest.raises(ValueError, match="fxrec: example inputs on the meta device"):
        fxrec.transform(model, x)


class CamelCaseInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.user = torch.nn.EmbeddingBag(30, 4)
        self.item = torch.nn.EmbeddingBag(30, 4)

    def forward(self, userIds, feats):  # noqa: N803 - as models name them
        return torch.cat([self.user(userIds), self.item(feats["ItemIDs"])], 1)


@pytest.mark.parametrize("backend", ["fbgemm", "native", "reference"])
def test_features_keep_the_case_of_the_models_names(backend):
    """torch.export lower-cases its input names: the report and errors said feature 'userids'."""
    x = torch.randint(0, 30, (4, 2))
    fast = fxrec.transform(CamelCaseInputs(), (x, {"ItemIDs": x, "Other": x}), backend=backend)
    assert sorted(r.feature for r in fast.report.lookups) == ["feats_ItemIDs", "userIds"]
    bad = x.clone()
    bad[0, 0] = 30
    with pytest.raises(IndexError, match=r"feature 'userIds'.*id 30.*table 'user'"):
        fast(bad, {"ItemIDs": x, "Other": x})


class _TwoDimBags(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.EmbeddingBag(10, 4, mode="sum")
        self.b = torch.nn.EmbeddingBag(10, 4, mode="sum")

    def forward(self, ids, offs, ids2):
        return torch.cat([self.a(ids, offs), self.b(ids2)], 1)


def test_input_size_errors_say_what_the_ids_of_a_2d_bag_feed():
    """The [B, L] ids of an EmbeddingBag are flattened by the lookup: their errors named the input
    only, and a condition between two inputs named neither's feature."""
    x = (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2]), torch.tensor([[1, 2], [3, 4]]))
    fast = fxrec.transform(_TwoDimBags(), x)
    with pytest.raises(ValueError, match=r"input ids2 \(ids of feature 'ids2', table 'b'\) has 1 dims"):
        fast(x[0], x[1], x[2].flatten())
    with pytest.raises(ValueError, match=r"break a condition on their sizes.*\(offs: offsets of feature 'ids', table "
                                         r"'a'; ids2: ids of feature 'ids2', table 'b'\)"):
        fast(x[0], x[1], torch.tensor([[1, 2], [3, 4], [5, 6]]))


def test_a_dtype_the_graph_holds_a_conversion_for_is_named_with_the_models_line():
    """torch.export records, for a conversion the model makes (``x[:, 2:].long()``), the dtype it
    was captured with; a call with another (after ``.half()`` of the transformed model) failed with
    torch's ``Tensor dtype mismatch! Expected: Float, Got: c10::Half``, naming nothing. The error
    names the model's line and both dtypes, and what to do, which works."""
    model, x = M.FieldDict(), M.field_inputs()
    fast = fxrec.transform(model, x)
    torch.testing.assert_close(fast(*x), model(*x), rtol=0, atol=0)
    fast.half()
    with pytest.raises(TypeError, match=r"models\.py:\d+ `ids = x\[:, 2:\]\.long\(\)` was captured converting a "
                                        r"tensor of dtype float32 and gets one of dtype float16.*transform that"):
        fast(x[0].half())
    model.half()
    half = fxrec.transform(model, (x[0].half(),))
    assert torch.equal(half(x[0].half()), model(x[0].half()))
