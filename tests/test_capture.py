"""Capture keeps every size dynamic that the model leaves free, with one size symbol per independent
size, and its speed-ups (fxrec/capture.py, "Capture time") change nothing else: the graph, the
input checks, torch's settings outside the capture."""

import contextlib
import copy
import dataclasses
import re
import threading
from typing import List

import pytest
import torch
from torch import nn

import fxrec
from fxrec import capture as C
from fxrec import capture_reshapes
from fxrec.testing import assert_matches, captured

from . import models

TABLES = 5


class Bags(nn.Module):
    """benchmarks/bench_lookups.py's PlainBags, smaller: a list of ids and one of offsets."""

    def __init__(self, tables=TABLES, rows=40, dim=4):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(tables)])

    def forward(self, ids: List[torch.Tensor], offsets: List[torch.Tensor]):
        return torch.cat([b(i, o) for b, i, o in zip(self.bags, ids, offsets)], 1)


def one_hot(batch, tables=TABLES, rows=40, seed=0):
    """One id per bag: every ids tensor has as many entries as every offsets tensor, the case where
    sizes that only happen to be equal could be taken for one."""
    g = torch.Generator().manual_seed(seed)
    return ([torch.randint(0, rows, (batch,), generator=g) for _ in range(tables)],
            [torch.arange(batch) for _ in range(tables)])


def ragged(batch, max_lens, rows=40, seed=0):
    """Feature k has 0..max_lens[k] ids per bag: different numbers of ids per feature in one call."""
    g = torch.Generator().manual_seed(seed)
    ids, offsets = [], []
    for m in max_lens:
        lengths = torch.randint(0, m + 1, (batch,), generator=g)
        ids.append(torch.randint(0, rows, (int(lengths.sum()),), generator=g))
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]]))
    return ids, offsets


def test_batch_and_each_features_number_of_ids_stay_dynamic():
    model = Bags()
    fast = fxrec.transform(model, one_hot(8), backend="fbgemm")
    calls = [
        one_hot(1, seed=1),
        one_hot(3, seed=2),
        ragged(5, (40, 0, 1, 3, 7), seed=3),   # feature 1 without any id, feature 0 with up to 40 a bag
        ragged(64, (1, 9, 2, 30, 4), seed=4),
    ]
    ids, offsets = calls[2]
    assert len({len(i) for i in ids}) == TABLES and len(ids[1]) == 0
    assert_matches(model, fast, *calls)


def test_example_inputs_that_share_a_tensor_are_captured_as_separate_inputs():
    """``[offsets] * 5``, a common way to write a batch of equal bags, gives torch.export one
    tensor five times, which it makes one placeholder: the captured model then read the first
    feature's offsets for all five at every call, a silently wrong answer for later batches whose
    offsets differ. The example is taken as five inputs; the exported program too."""
    model = Bags()
    g = torch.Generator().manual_seed(0)
    shared = torch.arange(0, 16, 2)
    example = ([torch.randint(0, 40, (16,), generator=g) for _ in range(TABLES)], [shared] * TABLES)
    dense = fxrec.transform(model, example, mode="inference")
    inputs = [ragged(6, (1, 3, 5, 2, 4), seed=s) for s in (1, 2)]
    assert all(len({tuple(o.tolist()) for o in offsets}) > 1 for _, offsets in inputs)
    assert_matches(model, dense, *inputs)
    assert_matches(model, fxrec.transform(model, example, backend="fbgemm"), *inputs)
    program = fxrec.export.program(model, example).module()
    for x in inputs:
        torch.testing.assert_close(program(*x), model(*x))
    assert example[1][0] is shared and example[1][4] is shared  # (the user's inputs are left as they were)


def test_one_symbol_for_the_batch_and_one_per_ids_tensor():
    """The design (see fxrec/capture.py): each ids tensor its own size symbol; the offsets, whose
    pooled rows the model concatenates, one symbol between them. Even where the example gives all
    of them the same size."""
    guards = C.input_guards(captured(Bags(), one_hot(8)))
    size = {path: shape[0] for path, shape in zip(guards.paths, guards.shapes)}
    ids = [size[f"ids[{k}]"] for k in range(TABLES)]
    batch = {size[f"offsets[{k}]"] for k in range(TABLES)}
    assert all(isinstance(s, str) and s.isidentifier() for s in ids + list(batch)), size
    assert len(batch) == 1 and len(set(ids)) == TABLES and not batch & set(ids), size
    assert len({s for shape in guards.shapes for s in shape}) == TABLES + 1


def test_torch_builds_no_guard_function_that_capture_would_replace(monkeypatch):
    from torch.export import _unlift

    if not hasattr(_unlift, "_convert_guards_code_to_fn"):
        pytest.skip("this torch builds its guard function elsewhere")
    built = []
    real = _unlift._convert_guards_code_to_fn
    monkeypatch.setattr(_unlift, "_convert_guards_code_to_fn", lambda *a, **k: built.append(1) or real(*a, **k))
    gm = captured(Bags(), one_hot(8))
    assert not built and not hasattr(gm, "_guards_fn")
    assert C.input_guards(gm) is not None
    ids, offsets = one_hot(8)
    with pytest.raises(ValueError, match=r"input offsets\[2\] has size 7 in dim 0"):
        gm(ids, offsets[:2] + [offsets[2][:-1]] + offsets[3:])


def _formats(ep_or_gm) -> list:
    return [n.meta["tensor_meta"].memory_format for n in ep_or_gm.graph.nodes
            if n.op == "call_function" and isinstance(n.meta.get("tensor_meta"), tuple)]


class Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x).relu()


def test_capture_leaves_torch_settings_and_other_exports_as_they_were():
    cache = torch._dynamo.config.fake_tensor_cache_enabled
    oblivious = torch.fx.experimental._config.backed_size_oblivious
    gm = captured(Bags(), one_hot(8))
    # what the passes read is all there: every tensor a node makes has its fake value
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is not torch.ops.aten.sym_size.int:
            assert "val" in n.meta, n
    assert torch._dynamo.config.fake_tensor_cache_enabled == cache
    assert torch.fx.experimental._config.backed_size_oblivious == oblivious
    # torch.export outside fxrec's capture records the memory format, as always
    formats = _formats(torch.export.export(Lin(), (torch.randn(5, 4),), strict=False))
    assert formats and all(f == torch.contiguous_format for f in formats)


def test_memory_formats_are_left_out_in_the_capturing_thread_only():
    seen = {}

    def other_thread():
        seen["other"] = _formats(torch.export.export(Lin(), (torch.randn(5, 4),), strict=False))

    with C._lean_tracing():
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        seen["here"] = _formats(torch.export.export(Lin(), (torch.randn(5, 4),), strict=False))
    assert seen["other"] and all(f == torch.contiguous_format for f in seen["other"])
    if C._install_lean_tensor_meta():  # (a torch without the function keeps the formats everywhere)
        assert seen["here"] and all(f is None for f in seen["here"])


def test_capture_with_the_speed_ups_gives_the_same_graph_as_without(monkeypatch):
    model, example = Bags(), one_hot(8)
    lean = captured(model, example)
    monkeypatch.setattr(C, "_lean_tracing", contextlib.nullcontext)
    monkeypatch.setattr(C, "_unlifted", lambda ep: ep.module())
    plain = captured(model, example)
    assert lean.code == plain.code
    assert C.input_guards(lean).shapes == C.input_guards(plain).shapes
    assert C.input_guards(lean).conditions == C.input_guards(plain).conditions


def test_train_eval_capture_in_the_other_mode_still_works():
    """A model whose code reads `training` is captured again in the other mode (fxrec/modes.py);
    that capture goes through the same path."""

    class Reads(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = nn.EmbeddingBag(20, 4, mode="sum")

        def forward(self, ids, offsets):
            return nn.functional.dropout(self.bag(ids, offsets), 0.5, training=self.training)

    model = Reads()
    example = (torch.randint(0, 20, (12,)), torch.arange(0, 12, 2))
    fast = fxrec.transform(copy.deepcopy(model), example, backend="fbgemm")
    modes = fast.meta["fxrec_modes"]
    assert modes.switchable and modes.flags  # the two captures compared: the dropout follows the mode
    fast.eval()
    model.eval()
    torch.testing.assert_close(fast(*example), model(*example))


class BagForms(nn.Module):
    """Every way into ``torch.embedding_bag`` that capture records opaquely, and two it must not:
    a direct call that reads ``bag_size`` and a bag with ``max_norm`` (renormalised in place)."""

    def __init__(self):
        super().__init__()
        self.mean = nn.EmbeddingBag(30, 4, mode="mean")
        self.max = nn.EmbeddingBag(30, 4, mode="max")
        self.weighted = nn.EmbeddingBag(30, 4, mode="sum")
        self.last = nn.EmbeddingBag(30, 4, mode="sum", include_last_offset=True)
        self.padded = nn.EmbeddingBag(30, 4, mode="sum", padding_idx=2)
        self.frozen = nn.EmbeddingBag(30, 4, mode="sum")
        self.frozen.weight.requires_grad_(False)
        self.normed = nn.EmbeddingBag(30, 4, mode="sum", max_norm=1.0)
        self.raw = nn.Parameter(torch.randn(30, 4))

    def forward(self, ids, offsets, psw, ids2d):
        direct = torch.embedding_bag(self.raw, ids, offsets, False, 0, False, None, False, None)
        return torch.cat([
            self.mean(ids, offsets), self.max(ids, offsets), self.weighted(ids, offsets, per_sample_weights=psw),
            self.last(ids, torch.cat([offsets, offsets.new_full((1,), ids.size(0))])),
            self.padded(ids2d), self.frozen(ids, offsets), self.normed(ids, offsets),
            nn.functional.embedding_bag(ids, self.raw, offsets, mode="sum"),
            direct[0] * direct[2].unsqueeze(1).float(),
        ], 1)


def bag_form_inputs(batch=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 30, (3 * batch,), generator=g)
    return (ids, torch.arange(0, 3 * batch, 3), torch.rand(3 * batch, generator=g),
            torch.randint(0, 30, (batch, 3), generator=g))


def _node_records(ep):
    def val(v):
        if isinstance(v, torch.Tensor):
            return (str(v), tuple(str(s) for s in v.stride()), v.dtype, v.device)
        if isinstance(v, (tuple, list)):
            return tuple(val(x) for x in v)
        return v

    return [(n.name, n.op, str(n.target), str(n.args), val(n.meta.get("val")), sorted(n.meta),
             str(n.meta.get("nn_module_stack")), n.meta.get("torch_fn"))
            for n in ep.graph.nodes]


@pytest.mark.parametrize("make", [
    lambda: (BagForms(), bag_form_inputs()),
    lambda: (Bags(), one_hot(8)),
    lambda: (models.BagList(), models.bag_inputs()),
    lambda: (models.WeightedBags(), models.weighted_inputs()),
    lambda: (models.SharedTables(), models.shared_inputs()),
    lambda: (models.NotLowerable(), models.not_lowerable_inputs()),
    lambda: (models.FieldDict(), models.field_inputs()),
], ids=["bag_forms", "bags", "bag_list", "weighted", "shared", "not_lowerable", "field_dict"])
def test_bags_captured_opaquely_give_torchs_own_graph(make, monkeypatch):
    """fxrec/capture_bags.py: the graph, every node's fake value (sizes, strides, dtype), metadata
    keys, names and module stack, and the input checks are what torch's own capture gives."""
    model, example = make()
    lean = C.export_dynamic(model, example, {}, lean_bags=True)
    plain = C.export_dynamic(model, example, {})
    assert lean.graph_module.code == plain.graph_module.code
    assert _node_records(lean) == _node_records(plain)
    assert str(lean.range_constraints) == str(plain.range_constraints)
    assert "fxrec_capture" not in lean.graph_module.code
    gm = captured(model, example)
    monkeypatch.setattr(C, "opaque_bags", contextlib.nullcontext)
    reference = captured(model, example)
    assert gm.code == reference.code
    for attr in ("shapes", "ranges", "conditions"):
        assert getattr(C.input_guards(gm), attr) == getattr(C.input_guards(reference), attr)
    torch.testing.assert_close(gm(*example), model(*example))


def test_bags_are_recorded_opaquely_only_inside_the_capture_and_in_its_thread():
    from fxrec import capture_bags

    original = torch.embedding_bag
    seen = {}

    def other_thread():
        seen["other"] = torch.embedding_bag is original or _calls_aten()

    def _calls_aten():
        ep = torch.export.export(Bags(2), one_hot(4, tables=2), strict=False)
        return "fxrec_capture" not in ep.graph_module.code and "aten.embedding_bag" in ep.graph_module.code

    with capture_bags.opaque_bags():
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        # eager calls in the capturing thread are torch's own numbers
        bags = Bags(2)
        ids, offsets = one_hot(4, tables=2)
        out = bags(ids, offsets)
    assert seen["other"]
    assert torch.embedding_bag is original
    torch.testing.assert_close(out, Bags.forward(bags, ids, offsets))


def test_reshapes_are_traced_on_a_copy_only_inside_the_capture_and_in_its_thread():
    """fxrec.capture_reshapes.reshape_by_copy: in the capturing thread, a reshape of a tensor whose
    contiguity depends on its sizes is traced as clone then reshape (no guard on a size of 1); in
    another thread at the same time, and after the capture, reshape is torch's own."""
    from torch.export import Dim
    from torch.fx.experimental import _config as config

    class Cols(nn.Module):
        def forward(self, x):
            return x[:, :2].reshape(-1) * 1

    def guards_and_clones():
        with config.patch(backed_size_oblivious=True):
            ep = torch.export.export(Cols(), (torch.zeros(4, 5),), strict=False,
                                     dynamic_shapes=({0: Dim.AUTO, 1: Dim.AUTO},))
        code = ep.graph_module.code
        return "aten.clone" in code, ep.module()

    seen = {}
    plain = torch.Tensor.reshape
    before = guards_and_clones()  # (torch 2.11 crashed where a process's first export ran in another thread)
    with capture_reshapes.reshape_by_copy():
        def other():  # (torch's functions taken by keyword too, in a thread that is not capturing)
            seen.update(other=guards_and_clones(), kw=torch.reshape(input=torch.arange(4), shape=(2, 2)))

        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
        inside = guards_and_clones()
        y = torch.arange(6.).view(2, 3).t()
        assert torch.equal(y.reshape(-1), torch.tensor([0., 3., 1., 4., 2., 5.]))  # (eager: torch's numbers)
    after = guards_and_clones()
    assert inside[0] and not seen["other"][0] and not after[0] and not before[0]
    assert torch.equal(seen["kw"], torch.arange(4).view(2, 2))
    assert torch.equal(inside[1](torch.zeros(1, 5)), torch.zeros(2))  # (torch 2.13's own refuses a batch of 1)
    assert torch.Tensor.reshape is plain and "reshape" not in vars(torch.Tensor)


class RowBags(nn.Module):
    """A bag of ``ids[:, :3]`` (its L is ``min(3, s)``), weighted or not; ``whole``: of ``ids``."""

    def __init__(self, weighted=False, whole=False):
        super().__init__()
        self.weighted, self.whole = weighted, whole
        self.bag = nn.EmbeddingBag(30, 4, mode="sum" if weighted else "mean")

    def forward(self, ids, w=None):
        ids = ids if self.whole else ids[:, :3]
        return self.bag(ids, per_sample_weights=w[:, :3]) if self.weighted else self.bag(ids)


def test_a_bag_of_a_slice_of_columns_is_captured_with_offsets_as_a_product_and_keeps_torchs_refusals():
    """F.embedding_bag of ``[B, L]`` ids writes its offsets ``arange(0, B * L, L)``, whose length
    torch 2.11 could not capture size-obliviously where L is ``min(3, s)``; capture writes
    ``arange(B) * L`` there (fxrec.capture_bags.bags_of_rows), and torch's own form where L is the
    input's own size (one op fewer a call). The values are torch's, and so are its refusals: L = 0
    (as a division by 0 naming the ids), offsets with 2-D ids, weights of another shape."""
    model = RowBags()
    gm = captured(model, (torch.randint(0, 30, (4, 5)),))
    targets = {n.target for n in gm.graph.nodes}
    assert torch.ops.aten.arange.default in targets and torch.ops.aten.arange.start_step not in targets
    whole = {n.target for n in captured(RowBags(whole=True), (torch.randint(0, 30, (4, 5)),)).graph.nodes}
    assert torch.ops.aten.arange.start_step in whole and torch.ops.aten.mul.Tensor not in whole
    for shape in ((1, 5), (5, 1), (2, 7), (0, 2), (3, 3)):
        x = torch.randint(0, 30, shape)
        torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13):
        refused = pytest.raises(ValueError, match=r"divides by 0.*ids\.size\(\)\[1\]")
    else:  # torch 2.11 sizes the slice by an unbacked symbol: the check is a runtime assertion in the graph
        refused = pytest.raises(ZeroDivisionError)
    with refused:
        gm(torch.zeros(3, 0, dtype=torch.long))
    with pytest.raises(RuntimeError, match="step must be nonzero"):
        model(torch.zeros(3, 0, dtype=torch.long))
    with pytest.raises(C.CaptureError, match="step must be nonzero"):
        captured(model, (torch.zeros(4, 0, dtype=torch.long),))
    weighted = RowBags(weighted=True)
    x, w = torch.randint(0, 30, (4, 5)), torch.rand(4, 5)
    gw = captured(weighted, (x, w))
    torch.testing.assert_close(gw(x, w), weighted(x, w), rtol=0, atol=0)
    with pytest.raises(C.CaptureError, match="same shape as the input"):
        captured(weighted, (x, torch.rand(4, 2)))

    class WithOffsets(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = nn.EmbeddingBag(30, 4)

        def forward(self, ids, offsets):
            return self.bag(ids, offsets)

    with pytest.raises(C.CaptureError, match="if input is 2D, then offsets has to be None"):
        captured(WithOffsets(), (x, torch.tensor([0, 2])))


def test_a_bad_bag_input_is_still_a_capture_error_naming_the_line():
    class FloatIds(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = nn.EmbeddingBag(10, 4, mode="sum")

        def forward(self, ids, offsets, psw):
            return self.bag(ids, offsets, per_sample_weights=psw)

    ids, offsets = torch.randint(0, 10, (6,)), torch.arange(0, 6, 2)
    with pytest.raises(C.CaptureError, match="per_sample_weights .* same shape as the input"):
        captured(FloatIds(), (ids, offsets, torch.rand(5)))
    with pytest.raises(C.CaptureError, match="long or int"):
        captured(FloatIds(), (ids.float(), offsets, torch.rand(6)))


class InsideBlocks(nn.Module):
    """Bags whose graphs torch.export nests: in a ``torch.no_grad()`` block of forward, and one
    whose pooled output is returned as it is (the exported program's signature names it)."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.EmbeddingBag(30, 4, mode="sum")
        self.live = nn.EmbeddingBag(30, 4, mode="mean")

    def forward(self, ids, offsets):
        with torch.no_grad():
            fixed = self.frozen(ids, offsets) * 2
        return {"live": self.live(ids, offsets), "fixed": fixed}


def test_bags_in_nested_graphs_and_returned_as_outputs_are_put_back():
    import io

    model, example = InsideBlocks(), (torch.randint(0, 30, (12,)), torch.arange(0, 12, 3))
    lean = C.export_dynamic(model, example, {}, lean_bags=True)
    plain = C.export_dynamic(model, example, {})
    def codes(ep):  # getitems are numbered in the order they were made: the opaque bags' come last
        return [re.sub(r"getitem(_\d+)?", "getitem", m.code) for m in ep.graph_module.modules()
                if isinstance(m, torch.fx.GraphModule)]

    assert len(codes(lean)) > 1 and not any("fxrec_capture" in c for c in codes(lean))
    assert codes(lean) == codes(plain)
    assert [(s.kind, re.sub(r"getitem(_\d+)?", "getitem", s.arg.name)) for s in lean.graph_signature.output_specs] \
        == [(s.kind, re.sub(r"getitem(_\d+)?", "getitem", s.arg.name)) for s in plain.graph_signature.output_specs]
    lean.validate()
    torch.export.save(lean, io.BytesIO())  # a program without fxrec's operator: it saves (and loads anywhere)
    gm = captured(model, example)
    assert "fxrec_capture" not in str([m.code for m in gm.modules() if isinstance(m, torch.fx.GraphModule)])
    for key, want in model(*example).items():
        torch.testing.assert_close(gm(*example)[key], want)


class Strided(nn.Module):
    """Ids and offsets that are views with strides other than 1, and a negative padding_idx."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(30, 4, mode="sum")
        self.weight = nn.Parameter(torch.randn(30, 4))

    def forward(self, x, offsets, psw):
        return torch.cat([self.bag(x[:, 0], offsets[::2]),
                          nn.functional.embedding_bag(x[:, 1], self.weight, offsets[::2], mode="sum",
                                                      per_sample_weights=psw[:, 1], padding_idx=-1)], 1)


def test_strided_inputs_and_negative_padding_give_torchs_guards_and_values(monkeypatch):
    model = Strided()
    example = (torch.randint(0, 30, (12, 3)), torch.arange(0, 12, 3).repeat_interleave(2), torch.rand(12, 3))
    lean = C.export_dynamic(model, example, {}, lean_bags=True)
    plain = C.export_dynamic(model, example, {})
    assert _node_records(lean) == _node_records(plain)
    gm = captured(model, example)
    monkeypatch.setattr(C, "opaque_bags", contextlib.nullcontext)
    reference = captured(model, example)
    for attr in ("shapes", "ranges", "conditions"):
        assert getattr(C.input_guards(gm), attr) == getattr(C.input_guards(reference), attr)


def test_a_padding_idx_outside_the_table_is_a_capture_error():
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(30, 4))

        def forward(self, ids, offsets):
            return nn.functional.embedding_bag(ids, self.weight, offsets, mode="sum", padding_idx=30)

    with pytest.raises(C.CaptureError, match="padding_idx must be within the number of embeddings"):
        captured(Functional(), (torch.randint(0, 30, (6,)), torch.arange(0, 6, 2)))


class LazyTables(nn.Module):
    """Tables made by forward's first call."""

    def __init__(self):
        super().__init__()
        self.tables = nn.ModuleDict()

    def forward(self, feats):
        for k in feats:
            if k not in self.tables:
                self.tables[k] = nn.EmbeddingBag(50, 4)
        return torch.cat([self.tables[k](v) for k, v in feats.items()], 1)


def test_modules_the_forward_creates_while_captured_are_refused_by_name():
    """(The transformed model held no parameters and drew its tables anew at every call; the
    report named them after the init op, 'normal_'.) Run once first, the model transforms."""
    x = ({"a": torch.randint(0, 50, (4, 3)), "b": torch.randint(0, 50, (4, 2))},)
    with pytest.raises(fxrec.CaptureError, match=r"the model's forward created \['tables.a', 'tables.a.weight', "
                                                 r"'tables.b', 'tables.b.weight'\] while it was captured.*run the model "
                                                 r"once on an example input before fxrec.transform"):
        fxrec.transform(LazyTables(), x)
    model = LazyTables()
    model(*x)
    fast = fxrec.transform(model, x)
    torch.testing.assert_close(fast(*x), model(*x), rtol=0, atol=0)
    assert [t for t in fast.report.tables] and {t["name"] for t in fast.report.tables} == {"tables.a", "tables.b"}


@dataclasses.dataclass
class _Feature:
    values: torch.Tensor
    offsets: torch.Tensor


torch.export.register_dataclass(_Feature)


class _DataclassInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(50, 8, mode="sum")

    def forward(self, f: _Feature):
        return self.bag(f.values, f.offsets)


class _VarArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.t = nn.ModuleList(nn.EmbeddingBag(50, 4) for _ in range(2))

    def forward(self, *ids):
        return torch.cat([t(i) for t, i in zip(self.t, ids)], 1)


class _VarKeywords(nn.Module):
    def __init__(self):
        super().__init__()
        self.t = nn.ModuleDict({k: nn.EmbeddingBag(50, 4) for k in "ab"})

    def forward(self, **feats):
        return torch.cat([self.t[k](feats[k]) for k in sorted(feats)], 1)


def test_inputs_of_a_registered_dataclass_and_a_varargs_forward_are_captured_with_dynamic_sizes():
    """torch.export takes both; fxrec failed inside it ('Node type mismatch; expected list',
    'inputs has 1 elements, but dynamic_shapes has 2'): its dynamic sizes did not have torch's form."""
    model = _DataclassInput()
    fast = fxrec.transform(model, (_Feature(torch.randint(0, 50, (8,)), torch.arange(0, 8, 2)),))
    x = _Feature(torch.randint(0, 50, (3,)), torch.tensor([0]))  # another batch and number of ids
    torch.testing.assert_close(fast(x), model(x), rtol=0, atol=0)
    fast(x).sum().backward()
    model(x).sum().backward()
    torch.testing.assert_close(fast.get_parameter("bag.weight").grad, model.bag.weight.grad)
    model = _VarArgs()
    fast = fxrec.transform(model, tuple(torch.randint(0, 50, (4, 3)) for _ in range(2)))
    x = tuple(torch.randint(0, 50, (1, 5)) for _ in range(2))
    torch.testing.assert_close(fast(*x), model(*x), rtol=0, atol=0)
    assert fast.report.groups and all(g.lowered for g in fast.report.groups)


def test_a_var_keyword_forward_is_refused_saying_what_to_do():
    """(torch.export takes no dynamic sizes for **kwargs: 'Must provide a tree_name'.)"""
    ids = {k: torch.randint(0, 50, (4, 3)) for k in "ab"}
    with pytest.raises(fxrec.CaptureError, match=r"_VarKeywords.forward takes \*\*feats, for which torch.export takes "
                                                 r"no dynamic sizes .* name the arguments, or take them as one dict"):
        fxrec.transform(_VarKeywords(), (), ids)


class _NamedAndVarKeywords(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(50, 4)

    def forward(self, ids, offsets=None, **extra):
        return self.bag(ids, offsets)


def test_keywords_that_bind_to_named_arguments_of_a_forward_with_var_keywords_are_taken():
    """(A first form of the **kwargs refusal refused any keyword given to such a forward.)"""
    model = _NamedAndVarKeywords()
    ids, offsets = torch.randint(0, 50, (8,)), torch.arange(0, 8, 2)
    fast = fxrec.transform(model, (ids,), {"offsets": offsets})
    x = (torch.randint(0, 50, (5,)),), {"offsets": torch.tensor([0, 2])}
    torch.testing.assert_close(fast(*x[0], **x[1]), model(*x[0], **x[1]), rtol=0, atol=0)
