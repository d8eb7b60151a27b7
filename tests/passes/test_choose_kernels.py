"""choose_kernels: kernels by the rule table, decisions as frozen records, autotune opt-in and cached."""

import dataclasses
import json

import pytest
import torch
from torch import nn

import fxrec
from fxrec import meta
from fxrec.passes.annotate_lookups import annotate_lookups
from fxrec.passes.assign_optimizers import assign_optimizers
from fxrec.passes.choose_kernels import RULES, choose_kernels
from fxrec.passes.fold_concat import fold_concat
from fxrec.passes.group_lookups import group_lookups
from fxrec.passes.lower_groups import lower_groups
from fxrec.runtime.kernels import native
from fxrec.testing import assert_matches, captured, group_calls, run_passes
from tests import models as M

PIPE = [annotate_lookups, group_lookups, choose_kernels, lower_groups, fold_concat]


def kernels_of(fast):
    return [(g.kernel_train, g.kernel_eval) for g in fast.report.groups]


def test_rule_table_names_every_device_and_mode():
    for device in ("cpu", "cuda"):
        for mode in ("training", "inference"):
            assert RULES[(device, mode, None)], (device, mode)
    assert RULES[("cuda", "training", None)][0] == "fbgemm"


def test_cpu_rowwise_adagrad_has_a_line_of_its_own():
    """fbgemm's fused row-wise Adagrad measured faster on CPU: it goes first for that optimizer only."""
    inputs = M.bag_inputs()
    fast = fxrec.transform(M.BagList(), inputs, optimizer=fxrec.optim.RowWiseAdagrad(lr=0.1))
    assert [(g.kernel_train, g.fused) for g in fast.report.groups] == [("fbgemm", "rowwise_adagrad")]
    want = "native" if native.available() else "reference"
    assert fast.report.groups[0].kernel_eval == want  # inference keeps its own line


def test_cpu_pooled_groups_run_the_native_kernel_when_it_is_built():
    inputs = M.bag_inputs()
    model = M.BagList()
    fast = fxrec.transform(model, inputs)
    want = "native" if native.available() else "reference"
    assert kernels_of(fast) == [(want, want)]
    assert fast.report.groups[0].decided_by == "rule"
    assert fast.report.groups[0].timings_ms == {}  # nothing was measured
    assert_matches(model, fast, inputs)


def test_cpu_sequence_groups_run_the_reference_and_fbgemm_for_adagrad():
    inputs = M.seq_inputs()
    plain = fxrec.transform(M.SequenceMean(), inputs)
    seq = [g for g in plain.report.groups if g.pooling == "none"]
    assert seq and all(g.kernel_train == "reference" for g in seq)
    fused = fxrec.transform(M.SequenceMean(), inputs, optimizer=fxrec.optim.Adagrad(lr=0.1))
    seq = [g for g in fused.report.groups if g.pooling == "none"]
    assert all(g.kernel_train == "fbgemm" and g.fused == "adagrad" for g in seq), fused.report
    assert all("not native" in g.why for g in seq)  # says why the native kernel was passed over


def test_forced_backend_goes_first_where_it_supports_the_group():
    for backend in ("fbgemm", "native", "reference"):
        inputs = M.bag_inputs()
        gm, ctx = run_passes(captured(M.BagList(), inputs), PIPE, inputs, backend=backend)
        mod = gm.get_submodule(group_calls(gm)[0].target)
        want = backend if backend != "native" or native.available() else "reference"
        assert (mod.kernel_train, mod.kernel_eval) == (want, want)
        assert ctx.groups[0].decision.decided_by == f"backend={backend!r}"


def test_three_transforms_give_the_same_decisions():
    from examples.dlrm_factory import small

    model, inputs = small(rows_cap=2000, batch=64)
    reports = [fxrec.transform(model, inputs, optimizer=fxrec.optim.SGD(lr=0.01)).report for _ in range(3)]
    decided = [json.dumps(r.to_dict()["groups"], sort_keys=True) for r in reports]
    assert decided[0] == decided[1] == decided[2]


def test_decision_is_a_frozen_record_on_the_group_call():
    inputs = M.bag_inputs()
    gm, ctx = run_passes(captured(M.BagList(), inputs), PIPE, inputs)
    call = group_calls(gm)[0]
    d = call.meta[meta.DECISION]
    assert isinstance(d, meta.GroupDecision) and d is ctx.groups[0].decision
    assert d.group == "group_0" and d.tables == ("bags.0", "bags.1", "bags.2") and len(d.lookups) == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.kernel_train = "reference"


def test_choose_kernels_leaves_the_graph_and_the_report_alone():
    inputs = M.bag_inputs()
    gm, ctx = run_passes(captured(M.BagList(), inputs), [annotate_lookups, group_lookups], inputs)
    before = gm.code
    res = choose_kernels(gm, ctx)
    assert not res.modified and gm.code == before
    assert ctx.report.groups == [] and ctx.report.notes == []  # the report is built from the graph later
    assert all(meta.DECISION in r.node.meta for r in ctx.groups[0].lookups)


def test_transform_trains_no_weight_and_leaves_no_gradient():
    model = M.BagList()
    inputs = M.bag_inputs()
    fast = fxrec.transform(model, inputs, autotune=False, optimizer=fxrec.optim.Adagrad(lr=0.5))
    assert all(p.grad is None for p in fast.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(fast.state_dict()[k], v), k


def test_autotune_measures_once_then_reads_its_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FXREC_CACHE", str(tmp_path))
    model, inputs = M.BagList(), M.bag_inputs()
    first = fxrec.transform(model, inputs, autotune=True, timing_rounds=1, optimizer=fxrec.optim.SGD(lr=0.1))
    g1 = first.report.groups[0]
    assert g1.decided_by == "autotune (measured)"
    assert {"fwd_reference", "fwd_fbgemm", "train_reference", "train_fbgemm"} <= set(g1.timings_ms)
    assert (tmp_path / "autotune.json").exists()
    second = fxrec.transform(model, inputs, autotune=True, timing_rounds=1, optimizer=fxrec.optim.SGD(lr=0.1))
    g2 = second.report.groups[0]
    assert g2.decided_by == "autotune (cached)"
    assert (g2.kernel_train, g2.kernel_eval) == (g1.kernel_train, g1.kernel_eval)
    # autotune copies the tables it times: the model is not trained by it
    for k, v in model.state_dict().items():
        assert torch.equal(second.state_dict()[k], v), k
    with torch.no_grad():
        torch.testing.assert_close(second(*inputs), model(*inputs))


class Dim3(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.e = torch.nn.EmbeddingBag(20, 3, mode="sum")

    def forward(self, ids, offsets):
        return self.e(ids, offsets)


@pytest.mark.parametrize("content", ["[]", "null", '{"x": 1}', "7"])
def test_an_autotune_cache_of_another_shape_is_measured_over(content, tmp_path, monkeypatch):
    """The cache file is the user's: valid JSON of another shape crashed transform (AttributeError)."""
    monkeypatch.setenv("FXREC_CACHE", str(tmp_path))
    (tmp_path / "autotune.json").write_text(content)
    ids, offsets = torch.randint(0, 20, (16,)), torch.arange(0, 16, 2)
    fast = fxrec.transform(Dim3(), (ids, offsets), autotune=True, timing_rounds=1)
    assert fast.report.groups[0].decided_by == "autotune (measured)"


@pytest.mark.parametrize("spoil", [lambda e: {**e, "train": "fbgemm"}, lambda e: {**e, "train": "nonesuch"},
                                   lambda e: "native", lambda e: {}, lambda e: {k: v for k, v in e.items() if k != "why"},
                                   lambda e: {**e, "timings_ms": [1]}],
                         ids=["unsupported_kernel", "unknown_kernel", "a_string", "empty", "no_why", "bad_timings"])
def test_a_cached_entry_is_used_only_where_its_kernels_take_the_group(spoil, tmp_path, monkeypatch):
    """An entry naming fbgemm for row-wise Adagrad on a dim-3 table (fbgemm would average over the
    padded row: 0.125 off after one step, silently) or malformed: measured again, and the
    training equals the independent row-wise Adagrad."""
    import copy
    import json

    from fxrec.optim import RowWiseAdagradTorch

    monkeypatch.setenv("FXREC_CACHE", str(tmp_path))
    torch.manual_seed(0)
    model = Dim3()
    ids, offsets = torch.randint(0, 20, (16,)), torch.arange(0, 16, 2)
    opt = fxrec.optim.RowWiseAdagrad(lr=0.5)
    fxrec.transform(model, (ids, offsets), optimizer=opt, autotune=True, timing_rounds=1)
    path = tmp_path / "autotune.json"
    cache = json.loads(path.read_text())
    path.write_text(json.dumps({k: spoil(v) for k, v in cache.items()}))
    fast = fxrec.transform(model, (ids, offsets), optimizer=opt, autotune=True, timing_rounds=1)
    group = fast.report.groups[0]
    assert group.decided_by == "autotune (measured)" and group.kernel_train != "fbgemm", group
    ref = copy.deepcopy(model)
    ref_opt = RowWiseAdagradTorch(ref.parameters(), lr=0.5)
    cot = torch.randn(8, 3)
    ref(ids, offsets).backward(cot)
    ref_opt.step()
    fast(ids, offsets).backward(cot)
    torch.testing.assert_close(fast.get_parameter("e.weight"), ref.e.weight)


def test_autotune_keeps_the_rule_choice_within_the_noise():
    from fxrec.autotune import _fastest

    assert _fastest({"fbgemm": 1.0, "native": 1.05, "reference": 2.0}, "native") == "native"
    assert _fastest({"fbgemm": 1.0, "native": 1.2, "reference": 2.0}, "native") == "fbgemm"


class Padded(nn.Module):
    def __init__(self):
        super().__init__()
        self.items = nn.Embedding(40, 8, padding_idx=0)
        self.users = nn.EmbeddingBag(30, 8, mode="sum")

    def forward(self, hist, users, offsets):
        return torch.cat([self.items(hist).sum(1), self.users(users, offsets)], 1)


def padded_inputs():
    return (torch.randint(0, 40, (4, 3)), torch.randint(0, 30, (6,)), torch.tensor([0, 2, 3, 5]))


@pytest.mark.parametrize("opt", ["sgd", "adagrad", "rowwise_adagrad"])
def test_explain_for_cuda_puts_every_group_on_fbgemm_with_its_fused_optimizer(opt):
    optimizer = {"sgd": fxrec.optim.SGD(lr=0.1), "adagrad": fxrec.optim.Adagrad(lr=0.1),
                 "rowwise_adagrad": fxrec.optim.RowWiseAdagrad(lr=0.1)}[opt]
    from examples.dlrm_factory import small

    model, inputs = small(rows_cap=500, batch=8)
    r = fxrec.explain(model, inputs, device="cuda", optimizer=optimizer)
    assert r.groups and all((g.kernel_train, g.kernel_eval, g.device) == ("fbgemm", "fbgemm", "cuda") for g in r.groups)
    assert all(g.fused == opt and g.placement == "device" for g in r.groups)
    json.loads(r.to_json())  # serialises


def test_explain_for_cuda_says_where_fbgemm_cannot_fuse():
    r = fxrec.explain(Padded(), padded_inputs(), device="cuda", optimizer=fxrec.optim.Adagrad(lr=0.1))
    g = r.group(next(e.group for e in r.lookups if e.table == "items"))
    # fbgemm's fused Adagrad would update nn.Embedding's padding row: the reference fuses it there
    assert (g.kernel_train, g.fused) == ("reference", "adagrad") and "padding row" in g.why, g
    r = fxrec.explain(Padded(), padded_inputs(), device="cuda", optimizer=fxrec.optim.SGD(lr=0.1))
    g = r.group(next(e.group for e in r.lookups if e.table == "items"))
    assert (g.kernel_train, g.fused) == ("reference", "sgd")  # fxrec's SGD leaves the padding row alone


def test_explain_builds_nothing_and_leaves_the_model_alone():
    model = M.BagList()
    ptrs = [p.data_ptr() for p in model.parameters()]
    r = fxrec.explain(model, M.bag_inputs(), device="cuda", optimizer=fxrec.optim.SGD(lr=0.1))
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    assert all(p.grad is None for p in model.parameters())
    assert "nothing was built" in str(r)
    # the same decisions transform makes, for the device at hand
    here = fxrec.explain(model, M.bag_inputs(), optimizer=fxrec.optim.SGD(lr=0.1))
    fast = fxrec.transform(model, M.bag_inputs(), optimizer=fxrec.optim.SGD(lr=0.1))
    assert kernels_of(fast) == [(g.kernel_train, g.kernel_eval) for g in here.groups]


def test_explain_refuses_an_unknown_device():
    with pytest.raises(ValueError, match="device must be one of"):
        fxrec.explain(M.BagList(), M.bag_inputs(), device="tpu")


def test_assign_then_choose_on_a_pass_list():
    inputs = M.bag_inputs()
    gm, ctx = run_passes(captured(M.BagList(), inputs), [annotate_lookups, assign_optimizers, group_lookups,
                                                         choose_kernels], inputs)
    assert ctx.groups[0].decision.kernel_train == ctx.groups[0].kernel_train


def test_explain_takes_a_model_on_the_meta_device():
    """Tables far larger than this machine's memory, never allocated: the decisions for CUDA."""

    class Huge(nn.Module):
        def __init__(self):
            super().__init__()
            self.bags = nn.ModuleList(nn.EmbeddingBag(10_000_000, 128) for _ in range(3))

        def forward(self, ids, offsets):
            return torch.cat([b(i, o) for b, i, o in zip(self.bags, ids, offsets)], 1)

    with torch.device("meta"):
        model = Huge()
    x = ([torch.randint(0, 1000, (8,)) for _ in range(3)], [torch.arange(0, 8, 2) for _ in range(3)])
    r = fxrec.explain(model, x, device="cuda", optimizer=fxrec.optim.RowWiseAdagrad(lr=0.1))
    (g,) = r.groups
    assert (g.kernel_train, g.fused, g.device) == ("fbgemm", "rowwise_adagrad", "cuda")
    assert r.tables[0]["bytes"] == 10_000_000 * 128 * 4


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_explain_for_cuda_inference_runs_every_group_on_fbgemm(quantize):
    from examples.dlrm_factory import small

    model, inputs = small(rows_cap=500, batch=8)
    r = fxrec.explain(model, inputs, device="cuda", mode="inference", quantize=quantize)
    assert r.groups and all((g.kernel_eval, g.device, g.placement) == ("fbgemm", "cuda", "device") for g in r.groups)
    want = "int8" if quantize else "float32"
    assert all(set(g.dtypes) == {want} for g in r.groups), [g.dtypes for g in r.groups]


class OneWideTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.narrow = nn.EmbeddingBag(1000, 64, mode="sum")
        self.wide = nn.EmbeddingBag(10, 2048, mode="sum")

    def forward(self, ids, offsets):
        return torch.cat([self.narrow(ids, offsets), self.wide(ids % 10, offsets)], 1)


def test_a_table_wider_than_fbgemms_cuda_kernels_take_is_grouped_apart_and_takes_only_itself_to_pytorch():
    """(On CUDA it took its whole group to PyTorch's lookups, the narrow table's fused LazyAdam too,
    and made weights_precision= refuse every table of the group.)"""
    x = (torch.randint(0, 1000, (8,)), torch.tensor([0, 3, 5]))
    report = fxrec.explain(OneWideTable(), x, device="cuda", optimizer=fxrec.optim.LazyAdam(lr=0.01))
    kernels = {tuple(g.tables): g.kernel_train for g in report.groups}
    assert kernels == {("narrow",): "fbgemm", ("wide",): "reference"}, kernels
    assert any("wider than 1024 columns" in s for s in report.fragmentation.splits), report.fragmentation
    fxrec.explain(OneWideTable(), x, device="cuda", optimizer=fxrec.optim.SGD(lr=0.1),
                  weights_precision={"narrow": "fp16"})
