"""Inference on row-wise quantized tables: structure, exactness at fp32, error bounds, bytes."""

import io

import pytest
import torch
from torch import nn

import fxrec
from fxrec.testing import embedding_ops, group_calls
from tests import models as M

ROWS = (500, 800, 300)


def bound(weight: torch.Tensor, bits: int, bag_len: int) -> float:
    """Largest error a pooled bag of ``bag_len`` rows can have after row-wise ``bits``-bit
    quantization: half a step (row range / (2**bits - 1)) per element per row, plus the fp16
    rounding of the row's scale and bias (relative 2**-11, on up to |min| + range)."""
    lo, hi = weight.min(1).values, weight.max(1).values
    step = (hi - lo) / (2**bits - 1)
    per_row = step / 2 + 2**-11 * (lo.abs() + (hi - lo)) * 2
    return float(per_row.max()) * bag_len


@pytest.mark.parametrize("dtype,bits", [("int8", 8), ("int4", 4), ("int2", 2)])
def test_integer_errors_stay_within_what_rowwise_quantization_allows(dtype, bits):
    model = M.BagList(rows=ROWS, dim=16).eval()
    inputs = M.bag_inputs(rows=ROWS, max_len=4)
    fast = fxrec.transform(model, inputs, mode="inference", quantize=dtype)
    with torch.no_grad():
        diff = (fast(*inputs) - model(*inputs)).abs()
    for i, q in enumerate(fast.report.quantization):
        assert q.dtype == dtype
        b = bound(model.bags[i].weight.detach(), bits, bag_len=4)
        assert q.max_abs_error <= b, (q.table, q.max_abs_error, b)
        assert q.max_abs_error == pytest.approx(float(diff[:, 16 + 16 * i: 32 + 16 * i].max()), rel=1e-5, abs=1e-6)
    if dtype == "int8":
        assert max(q.max_abs_error for q in fast.report.quantization) < 0.05


def test_int8_takes_at_most_d_plus_16_bytes_a_row_and_fp32_params_are_gone():
    model = M.BagList(rows=ROWS, dim=128).eval()
    fast = fxrec.transform(model, M.bag_inputs(rows=ROWS), mode="inference", quantize="int8")
    for q in fast.report.quantization:
        assert q.bytes_stored <= q.rows * (q.dim + 16)
        assert q.bytes_stored / q.bytes_fp32 <= 0.29
    assert not any(k.startswith("bags.") for k in fast.state_dict())
    assert not embedding_ops(fast) and len(group_calls(fast)) == 1


@pytest.mark.parametrize("case", ["weighted_bags", "sequence_mean", "field_dict", "offset_fm"])
def test_fp32_storage_gives_the_plain_models_numbers(case):
    make = {
        "weighted_bags": (M.WeightedBags, M.weighted_inputs),
        "sequence_mean": (M.SequenceMean, M.seq_inputs),
        "field_dict": (M.FieldDict, M.field_inputs),
        "offset_fm": (M.OffsetFM, M.fm_inputs),
    }[case]
    model = make[0]().eval()
    fast = fxrec.transform(model, make[1](), mode="inference", quantize="fp32")
    assert not embedding_ops(fast)
    for seed in (1, 2):
        x = make[1](seed=seed)
        with torch.no_grad():
            torch.testing.assert_close(fast(*x), model(*x), rtol=1e-5, atol=1e-5)


def test_sequence_lookups_quantize_too():
    model = M.SequenceMean().eval()
    fast = fxrec.transform(model, M.seq_inputs(), mode="inference", quantize="int8")
    dtypes = {q.table: q.dtype for q in fast.report.quantization}
    assert dtypes == {"hist": "int8", "query": "int8", "attn": "int8"}
    with torch.no_grad():
        assert (fast(*M.seq_inputs(seed=3)) - model(*M.seq_inputs(seed=3))).abs().max() < 0.1


def test_per_table_dtypes_auto_and_fp16_output():
    model = M.BagList(rows=(5000, 800, 300), dim=16).eval()
    inputs = M.bag_inputs(rows=(5000, 800, 300))
    fast = fxrec.transform(model, inputs, mode="inference", quantize={"bags.0": "int4", "*": "fp16"})
    assert [q.dtype for q in fast.report.quantization] == ["int4", "fp16", "fp16"]
    auto = fxrec.transform(model, inputs, mode="inference", quantize="auto")
    # 5000 x 16 x 4 bytes = 320 KB: int8; the two small tables stay fp32
    assert [q.dtype for q in auto.report.quantization] == ["int8", "fp32", "fp32"]
    half = fxrec.transform(model, inputs, mode="inference", quantize="fp16", output_dtype="fp16")
    seen = []
    half.get_submodule("fxrec_group_0").register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    with torch.no_grad():
        out = half(*inputs)
    assert seen == [torch.float16]
    torch.testing.assert_close(out, model(*inputs), rtol=0, atol=0.02)
    assert "Quantization" in str(half.report)


class _OddBags(nn.Module):
    def __init__(self, dims, rows=300):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(rows, d, mode="sum") for d in dims])

    def forward(self, ids, offsets):
        return torch.cat([b(ids, offsets) for b in self.bags], 1)


class FloatTop(nn.Module):
    """Lookups concatenated, then ``.float()`` (a no-op on fp32, which torch.export records as a
    dtype check of the concatenation) into an fp32 layer."""

    def __init__(self):
        super().__init__()
        self.a = nn.EmbeddingBag(100, 16, mode="sum")
        self.b = nn.EmbeddingBag(50, 8, mode="mean")
        self.top = nn.Linear(24, 1)

    def forward(self, i, o, j, p):
        pooled = torch.cat([self.a(i, o), self.b(j, p)], 1)
        return self.top(pooled.float())


def test_fp16_outputs_of_a_model_that_converts_its_lookups_to_fp32_are_converted():
    """output_dtype="fp16" changes what the model computed in fp32: its recorded dtype checks go,
    its conversions stay (this failed in every call before)."""
    torch.manual_seed(0)
    model = FloatTop()
    x = (torch.randint(0, 100, (9,)), torch.tensor([0, 2, 5]), torch.randint(0, 50, (6,)), torch.tensor([0, 1, 4]))
    fp32 = fxrec.transform(model, x, mode="inference", quantize="fp16")
    half = fxrec.transform(model, x, mode="inference", quantize="fp16", output_dtype="fp16")
    assert not any(n.target is torch.ops.aten._assert_tensor_metadata.default for n in half.graph.nodes)
    with torch.no_grad():
        got, want = half(*x), fp32(*x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(want, model(*x), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype,dim,stored", [("int8", 6, 8), ("int4", 4, 8), ("int2", 10, 16), ("fp16", 5, 6),
                                              ("int8", 1, 4)])
def test_a_dim_the_dtype_cannot_store_is_padded_without_changing_the_real_columns(dtype, dim, stored):
    """The padded table must give exactly what fbgemm gives for a table of the stored width whose
    extra columns repeat the row's first value (same min and max: same scale, bias and codes)."""
    torch.manual_seed(0)
    odd = _OddBags([dim, 8]).eval()
    wide = _OddBags([stored, 8]).eval()
    with torch.no_grad():
        w = odd.bags[0].weight
        wide.bags[0].weight.copy_(torch.cat([w, w[:, :1].expand(-1, stored - dim)], 1))
        wide.bags[1].weight.copy_(odd.bags[1].weight)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (40,), generator=g)
    offsets = torch.arange(0, 40, 4)
    q_odd = fxrec.transform(odd, (ids, offsets), mode="inference", quantize=dtype)
    q_wide = fxrec.transform(wide, (ids, offsets), mode="inference", quantize=dtype)
    assert not q_odd.report.left_alone
    with torch.no_grad():
        got, ref = q_odd(ids, offsets), q_wide(ids, offsets)
    assert got.shape == (10, dim + 8)
    assert torch.equal(got[:, :dim], ref[:, :dim]) and torch.equal(got[:, dim:], ref[:, stored:])
    from fxrec.export import torchscript

    assert torch.equal(torchscript(q_odd)(ids, offsets), got)  # the serving module drops the same columns
    entry = {q.table: q for q in q_odd.report.quantization}["bags.0"]
    assert entry.dim == dim and entry.max_abs_error is not None


def test_auto_keeps_dims_int8_would_not_shrink_in_fp32():
    from fxrec.passes.quantize_tables import dtype_for

    assert dtype_for("auto", "t", "t.weight", 1_000_000, 1) == "fp32"  # int8: 4 + 4 bytes a row > 4
    assert dtype_for("auto", "t", "t.weight", 1_000_000, 2) == "fp32"  # 4 + 4 = 8 bytes, as fp32
    assert dtype_for("auto", "t", "t.weight", 1_000_000, 3) == "int8"  # 4 + 4 < 12


def test_quantization_errors_are_named():
    model = M.BagList(rows=ROWS, dim=4).eval()
    inputs = M.bag_inputs(rows=ROWS)
    with pytest.raises(ValueError, match="needs mode='inference'"):
        fxrec.transform(model, inputs, quantize="int8")
    with pytest.raises(ValueError, match="quantize must be one of"):
        fxrec.transform(model, inputs, mode="inference", quantize="int3")
    # (a key that matched nothing left every table fp32 without a word)
    with pytest.raises(ValueError, match=r"quantize keys \['nosuch', 'tab\*'\] match no table fxrec groups; the "
                                         r"tables are \['bags.0', 'bags.1', 'bags.2'\]"):
        fxrec.transform(model, inputs, mode="inference", quantize={"bags.1": "int8", "nosuch": "int8", "tab*": "int4"})
    # (a key after a glob that already names its table was ignored: bags.0 quantized int8, not int4)
    with pytest.raises(ValueError, match=r"quantize key 'bags.0' decides for no table: every table it names "
                                         r"\(\['bags.0'\]\) an earlier key names \('\*'\).*put 'bags.0' first"):
        fxrec.transform(model, inputs, mode="inference", quantize={"*": "int8", "bags.0": "int4"})


def test_quantized_ids_out_of_range_are_named():
    model = M.BagList(rows=ROWS, dim=16).eval()
    fast = fxrec.transform(model, M.bag_inputs(rows=ROWS), mode="inference", quantize="int8")
    dense, ids, offs = M.bag_inputs(rows=ROWS)
    ids[1] = ids[1].clone()
    ids[1][0] = 800
    with pytest.raises(IndexError, match=r"id 800 in table 'bags.1'"):
        fast(dense, ids, offs)


def test_mean_bag_with_padding_and_last_offset_is_served_as_pytorch_computes_it(tmp_path):
    """With a padding_idx PyTorch runs the last bag to the end of the ids (mean included): the
    quantized group and its TorchScript twin pack it that way instead of refusing it."""
    torch.manual_seed(0)
    model = nn.EmbeddingBag(20, 8, mode="mean", include_last_offset=True, padding_idx=1).eval()
    ids, offsets = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6]), torch.tensor([0, 2, 3, 6])  # 2 ids after offsets[-1]
    fast = fxrec.transform(model, (ids, offsets), mode="inference", quantize="fp32")
    with torch.no_grad():
        want = model(ids, offsets)
        torch.testing.assert_close(fast(ids, offsets), want)
        torch.testing.assert_close(fxrec.export.torchscript(fast)(ids, offsets), want)


# ---------------------------------------------------------------- rows packed for a device
def _quantized_groups(fast):
    from fxrec.runtime.quantized import QuantizedPooledGroup, QuantizedSequenceGroup

    return [m for m in fast.modules() if isinstance(m, (QuantizedPooledGroup, QuantizedSequenceGroup))]


@pytest.mark.parametrize("case", ["int8", "int4", "fp16", "int8_shared"])
def test_rows_packed_again_at_cudas_alignment_are_fbgemms_own_packing_and_read_the_same(case):
    """What a move to CUDA does to the rows, done on CPU: packed again at 16 bytes, they are byte
    for byte what fbgemm's IntNBit TBE packs at row alignment 16 (offsets and placements per
    feature, a table looked up by two features included), every row starts on a 16-byte
    boundary, and fbgemm's lookup told the new alignment gives the same outputs."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen
    from fbgemm_gpu.tbe.utils.quantize import quantize_embs

    from fxrec.runtime.kernels import fbgemm_nbit

    dtype = case.split("_")[0]
    if case.endswith("shared"):  # features -> tables [0, 0, 1]
        model, inputs = M.SharedTables(dim=24).eval(), M.shared_inputs()
    else:  # int8 rows of 28 bytes, int4 of 16, fp16 of 48
        model, inputs = M.BagList(rows=ROWS, dim=24).eval(), M.bag_inputs(rows=ROWS, max_len=4)
    fast = fxrec.transform(model, inputs, mode="inference", quantize=dtype)
    (group,) = _quantized_groups(fast)
    ftm = [f.table for f in group.features]
    assert group.q_ints["row_alignment"] == 1 and (ftm == [0, 0, 1]) == case.endswith("shared")
    with torch.no_grad():
        before = fast(*inputs)
    weights, _, placements, offsets = fbgemm_nbit.relayout(
        group.q_packed, ftm, (group.q_weights, group.q_weights_uvm), group.q_weights_placements,
        group.q_weights_offsets, 1, torch.device("cpu"), new_alignment=16)

    ty = {"int8": SparseType.INT8, "int4": SparseType.INT4, "fp16": SparseType.FP16}[dtype]
    tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
        [("", r, d, ty, EmbeddingLocation.HOST) for r, d, _ in group.q_packed], feature_table_map=ftm,
        device="cpu", row_alignment=16)
    tbe.initialize_weights()
    params = dict(model.named_parameters())
    tbe.assign_embedding_weights([quantize_embs(params[t.name + ".weight"].detach(), ty) for t in group.tables])
    assert torch.equal(weights, tbe.weights_host) and torch.equal(offsets, tbe.weights_offsets)
    assert torch.equal(placements, tbe.weights_placements)
    row_bytes = fbgemm_nbit.packed_bytes(group.q_packed, 16)
    for (rows, _, _), start, nbytes in zip(group.q_packed, [offsets[ftm.index(t)] for t in range(len(row_bytes))],
                                           row_bytes):
        assert start % 16 == 0 and (nbytes // rows) % 16 == 0
    # int8 rows (28 bytes) grow to 32; int4 (16) and fp16 (48) rows are already whole 16-byte lines
    assert (sum(row_bytes) > sum(fbgemm_nbit.packed_bytes(group.q_packed, 1))) == (dtype == "int8")

    group.q_weights, group.q_weights_offsets = weights, offsets
    group.q_ints = {**group.q_ints, "row_alignment": 16}
    with torch.no_grad():
        assert torch.equal(fast(*inputs), before)
    back = fbgemm_nbit.relayout(group.q_packed, ftm, (weights, group.q_weights_uvm), placements, offsets, 16,
                                torch.device("cpu"))
    (fresh,) = _quantized_groups(fxrec.transform(model, inputs, mode="inference", quantize=dtype))
    assert torch.equal(back[0], fresh.q_weights) and torch.equal(back[3], fresh.q_weights_offsets)
    assert torch.equal(back[2], fresh.q_weights_placements) and back[1].numel() == 0


def _pack_as_cuda_does(group) -> None:
    """The group's rows packed again at 16 bytes, on the CPU: as a model moved to CUDA has them."""
    from fxrec.runtime.kernels import fbgemm_nbit

    weights, _, placements, offsets = fbgemm_nbit.relayout(
        group.q_packed, [f.table for f in group.features], (group.q_weights, group.q_weights_uvm),
        group.q_weights_placements, group.q_weights_offsets, 1, torch.device("cpu"), new_alignment=16)
    group.q_weights, group.q_weights_offsets, group.q_weights_placements = weights, offsets, placements
    group.q_ints = {**group.q_ints, "row_alignment": 16}
    group.q_row_alignment = torch.tensor(16)


def test_a_model_pickled_with_rows_packed_for_cuda_and_loaded_on_cpu_packs_them_for_the_cpu():
    """torch.load(map_location=) of a quantized model pickled on CUDA (rows at 16 bytes) kept that
    stride; loaded on CUDA from CPU, rows at 1 byte would be read 16 at a time. Unpickling packs the
    rows for the device they land on, as .to() does. (Here: rows packed at 16 bytes on the CPU,
    as a model saved on CUDA and loaded with map_location="cpu" has them.)"""
    model, inputs = M.BagList(rows=ROWS, dim=24).eval(), M.bag_inputs(rows=ROWS, max_len=4)
    fast = fxrec.transform(model, inputs, mode="inference", quantize="int8")
    (group,) = _quantized_groups(fast)
    with torch.no_grad():
        before = fast(*inputs)
    cpu_bytes, cpu_weights = group.table_nbytes, group.q_weights.clone()
    _pack_as_cuda_does(group)
    assert sum(group.table_nbytes) > sum(cpu_bytes)  # (int8 rows of 28 bytes: 32 at CUDA's stride)
    buf = io.BytesIO()
    torch.save(fast, buf)
    buf.seek(0)
    back = torch.load(buf, map_location="cpu", weights_only=False)
    (loaded,) = _quantized_groups(back)
    assert loaded.q_ints["row_alignment"] == 1 and int(loaded.q_row_alignment) == 1
    assert loaded.table_nbytes == cpu_bytes and torch.equal(loaded.q_weights, cpu_weights)
    with torch.no_grad():
        assert torch.equal(back(*inputs), before)


def test_rows_packed_again_from_meta_are_allocated_once_by_to_empty():
    """From buffers on meta (a model loaded there, then to_empty) there are no rows to copy: the
    packed buffer stays on meta for to_empty to give memory, not zero-filled first and dropped."""
    from fxrec.runtime.kernels import fbgemm_nbit

    fast = fxrec.transform(M.BagList(rows=ROWS, dim=24).eval(), M.bag_inputs(rows=ROWS), mode="inference",
                           quantize="int8")
    (group,) = _quantized_groups(fast)
    meta = [t.to("meta") for t in (group.q_weights, group.q_weights_uvm, group.q_weights_placements,
                                   group.q_weights_offsets)]
    dev, uvm, places, offsets = fbgemm_nbit.relayout(group.q_packed, [f.table for f in group.features], meta[:2],
                                                     meta[2], meta[3], 16, torch.device("cpu"))
    assert dev.is_meta and dev.numel() == group.q_weights.numel() and uvm.numel() == 0
    assert torch.equal(places, group.q_weights_placements) and torch.equal(offsets, group.q_weights_offsets)


def _meta_case(case):
    """The quantized model of a meta-loading case, and its inputs: bags (int8, or int4 whose dim 12
    is stored padded, its columns kept by q_columns) or sequences."""
    if case == "int8_sequence":
        model, inputs, dtype = M.SequenceMean().eval(), M.seq_inputs(), "int8"
    else:
        dim, dtype = (12, "int4") if case.startswith("int4") else (16, "int8")
        model, inputs = M.BagList(rows=ROWS, dim=dim).eval(), M.bag_inputs(rows=ROWS, max_len=4)
    return fxrec.transform(model, inputs, mode="inference", quantize=dtype), inputs


@pytest.mark.parametrize("case", ["int8_bags", "int4_padded_columns", "int8_sequence", "int4_packed_for_cuda"])
def test_a_model_loaded_on_meta_then_to_empty_takes_its_state_dict(case):
    """A pickled quantized model loaded on meta (torch.load(map_location="meta")), given memory by
    to_empty and its rows by load_state_dict, answers as the model saved. to_empty leaves the buffers
    that describe the layout as uninitialised memory: the load was refused as "tables of other
    dtypes", and the columns a padded table drops (not in the state_dict) would be read as they are."""
    fast, inputs = _meta_case(case)
    groups = _quantized_groups(fast)
    assert groups and (case != "int4_padded_columns" or groups[0].q_columns.numel() > 0)
    if case == "int4_packed_for_cuda":
        for g in groups:
            _pack_as_cuda_does(g)
    with torch.no_grad():
        want = fast(*inputs)
    state = {k: v.clone() for k, v in fast.state_dict().items()}
    buf = io.BytesIO()
    torch.save(fast, buf)
    buf.seek(0)
    there = torch.load(buf, map_location="meta", weights_only=False)
    assert all(t.is_meta for t in there.state_dict().values())
    there.load_state_dict(state)  # (onto meta: copies nothing, as torch's load does; it failed reading meta)
    assert all(t.is_meta for t in there.state_dict().values())
    here = there.to_empty(device="cpu")
    for g in _quantized_groups(here):  # what uninitialised memory may hold
        for name, b in g.named_buffers():
            if b.is_floating_point() or b.dtype in (torch.int32, torch.int64, torch.uint8):
                b.fill_(7)
    assert not here.load_state_dict(state).missing_keys
    (loaded, *_), = [_quantized_groups(here)]
    assert loaded.q_ints["row_alignment"] == 1
    with torch.no_grad():
        assert torch.equal(here(*inputs), want)


class _Flagged(torch.nn.Module):
    """A bag with a padding_idx (summed) and [B, L] ids averaged by hand: one quantized group with
    padded bags, one that mean-pools [B, L] ids."""

    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(20, 8, mode="sum", padding_idx=0)
        self.e = torch.nn.Embedding(30, 8)

    def forward(self, ids, offsets, seq):
        return torch.cat([self.bag(ids, offsets), self.e(seq).mean(1)], 1)


@pytest.mark.parametrize("which", ["mean_bags", "padded_bag_and_mean_of_rows"])
def test_a_group_pickled_before_it_kept_its_feature_flags_works_them_out_when_loaded(which):
    """The flags a group reads per call (padded bags, means of [B, 0] ids) are set at init; a group
    pickled before they were is given them as it loads, and answers as before."""
    if which == "mean_bags":
        model, inputs = M.BagList(rows=ROWS, dim=8, mode="mean").eval(), M.bag_inputs(rows=ROWS, max_len=4)
    else:
        model = _Flagged().eval()
        inputs = (torch.tensor([0, 3, 0, 5, 7]), torch.tensor([0, 2, 2, 4]), torch.randint(0, 30, (4, 3)))
    fast = fxrec.transform(model, inputs, mode="inference", quantize="int8")
    with torch.no_grad():
        want = fast(*inputs)
    flags = set()
    kept = ("_padded_bags", "_means_of_seqs", "_plain_bags", "_table_of")
    for i, (name, group) in enumerate([(n, m) for n, m in fast.named_children() if m in _quantized_groups(fast)]):
        state = group.__getstate__()
        for attr in kept[2:] if i % 2 else kept:  # (pickled before any flag was kept; or with the first two only)
            del state[attr]
        old = type(group).__new__(type(group))
        old.__setstate__(state)
        assert [getattr(old, a) for a in kept] == [getattr(group, a) for a in kept]
        flags |= {(a, getattr(group, a)) for a in ("_padded_bags", "_means_of_seqs")}
        setattr(fast, name, old)
    if which != "mean_bags":  # (each flag set on one of its groups)
        assert ("_padded_bags", True) in flags and ("_means_of_seqs", True) in flags
    with torch.no_grad():
        torch.testing.assert_close(fast(*inputs), want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("case", ["int8_bags", "int4_padded_columns", "int8_sequence"])
@pytest.mark.parametrize("start", ["meta", "cpu"])
def test_to_empty_lays_the_rows_out_before_any_state_dict_loads(case, start):
    """After to_empty (from meta, or of a model on the CPU), before load_state_dict, the rows are
    whatever memory held (as a plain model's tables are), but the buffers that say where each
    table's rows start, their dtypes, widths and kept columns are the tables' own: read as to_empty
    left them, fbgemm's lookup read out of bounds (a call died of SIGFPE on this CPU, or failed
    on a placement). A call then runs, on the rows as found."""
    fast, inputs = _meta_case(case)
    with torch.no_grad():
        want = fast(*inputs)
    buf = io.BytesIO()
    torch.save(fast, buf)
    buf.seek(0)
    here = torch.load(buf, map_location=start, weights_only=False).to_empty(device="cpu")
    layout = ("q_weights_placements", "q_weights_offsets", "q_weights_tys", "q_D_offsets", "q_columns",
              "q_row_alignment")
    for mine, theirs in zip(_quantized_groups(here), _quantized_groups(fast)):
        for name in layout:
            assert torch.equal(getattr(mine, name), getattr(theirs, name)), name
        assert mine.q_weights.shape == theirs.q_weights.shape
        mine.q_weights.zero_()  # (rows of zeros, scales and biases included: every lookup gives 0)
    for p in here.parameters():  # (the dense layer's, as to_empty left them too)
        p.data.zero_()
    with torch.no_grad():
        got = here(*inputs)
    for g, w in zip(got if isinstance(got, (list, tuple)) else [got], want if isinstance(want, (list, tuple)) else [want]):
        assert g.shape == w.shape and not g.nan_to_num().any()  # (a mean of no ids: NaN, as PyTorch's)


@pytest.mark.parametrize("where", [("managed", "managed", "managed"), ("managed", "device", "managed")],
                         ids=["all_managed", "mixed"])
def test_rows_laid_out_for_unified_memory_are_read_where_each_placement_says(where):
    """On CUDA a table placed "managed" (hbm_budget=) keeps its rows in the group's uvm buffer, and
    fbgemm's kernels read the buffer its placement names (DEVICE 0 and HOST 3: dev; MANAGED 1 and
    MANAGED_CACHING 2: uvm). Laid out so on CPU at CUDA's 16-byte rows: each table's rows, read
    where its placement and offset say, are fbgemm's own 16-byte packing of that table; fbgemm's
    CPU lookup reads an all-managed layout as it reads the host one; laid out back, the host
    packing returns byte for byte, and a state_dict of such a layout loads into a CPU model."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen
    from fbgemm_gpu.tbe.utils.quantize import quantize_embs

    from fxrec.runtime.kernels import fbgemm_nbit

    model = M.BagList(rows=ROWS, dim=24).eval()
    x = M.bag_inputs(rows=ROWS, max_len=4)
    fast = fxrec.transform(model, x, mode="inference", quantize="int8")
    (group,) = _quantized_groups(fast)
    ftm = [f.table for f in group.features]
    with torch.no_grad():
        want = fast(*x)
    host = group.q_weights.clone()
    dev, uvm, places, offsets = fbgemm_nbit.relayout(
        group.q_packed, ftm, (group.q_weights, group.q_weights_uvm), group.q_weights_placements,
        group.q_weights_offsets, 1, torch.device("cpu"), where, new_alignment=16)
    assert places.tolist() == [1 if where[t] == "managed" else 3 for t in ftm]

    tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
        [("", r, d, SparseType.INT8, EmbeddingLocation.HOST) for r, d, _ in group.q_packed], feature_table_map=ftm,
        device="cpu", row_alignment=16)
    tbe.initialize_weights()
    params = dict(model.named_parameters())
    tbe.assign_embedding_weights([quantize_embs(params[t.name + ".weight"].detach(), SparseType.INT8)
                                  for t in group.tables])
    for f, t in enumerate(ftm):
        rows, now = group.q_packed[t][0], 32  # int8 at dim 24: 24 + 4 bytes, 16-byte rows
        mine = (dev if places[f] in (0, 3) else uvm)[offsets[f]:offsets[f] + rows * now]
        fbgemms = tbe.weights_host[tbe.weights_offsets[f]:tbe.weights_offsets[f] + rows * now]
        assert torch.equal(mine, fbgemms), f"table {t}"
    assert uvm.numel() >= sum(group.q_packed[t][0] * 32 for t in range(3) if where[t] == "managed")

    state = fast.state_dict()
    name = next(n for n, m in fast.named_modules() if m is group)
    state.update({f"{name}.q_weights": dev, f"{name}.q_weights_uvm": uvm, f"{name}.q_weights_placements": places,
                  f"{name}.q_weights_offsets": offsets, f"{name}.q_row_alignment": torch.tensor(16)})
    if all(w == "managed" for w in where):  # (CPU's lookup: one buffer a call, see fbgemm_nbit)
        group.q_weights, group.q_weights_uvm, group.q_weights_placements, group.q_weights_offsets = (
            dev, uvm, places, offsets)
        group.q_ints = {**group.q_ints, "row_alignment": 16}
        with torch.no_grad():
            torch.testing.assert_close(fast(*x), want, rtol=0, atol=0)
    back = fbgemm_nbit.relayout(group.q_packed, ftm, (dev, uvm), places, offsets, 16, torch.device("cpu"))
    assert torch.equal(back[0], host) and back[1].numel() == 0 and set(back[2].tolist()) == {3}

    fresh = fxrec.transform(model, x, mode="inference", quantize="int8")
    fresh.load_state_dict(state)
    (loaded,) = _quantized_groups(fresh)
    assert torch.equal(loaded.q_weights, host) and loaded.q_weights_uvm.numel() == 0
    with torch.no_grad():
        torch.testing.assert_close(fresh(*x), want, rtol=0, atol=0)


def test_a_move_within_one_kind_of_device_keeps_the_packing():
    model = M.BagList(rows=ROWS, dim=16).eval()
    fast = fxrec.transform(model, M.bag_inputs(rows=ROWS), mode="inference", quantize="int8")
    (group,) = _quantized_groups(fast)
    packed = group.q_weights
    fast.to("cpu").float()
    assert group.q_weights is packed and group.q_ints["row_alignment"] == 1
    assert [q.bytes_stored for q in fast.report.quantization] == [r * 20 for r in ROWS]  # 16 + fp16 scale, bias


@pytest.mark.parametrize("rows", [ROWS, (1, 2, 3)], ids=["tables", "tiny_tables"])
def test_a_state_dict_saved_packed_for_cuda_loads_into_a_cpu_model(rows):
    """The rows of a quantized state_dict are packed for the device they were on; it carries
    that packing's alignment, and a model on another device packs them again as they load. Tiny
    tables (both packings round to the same bytes) would otherwise load and be misread."""
    from fxrec.runtime.kernels import fbgemm_nbit

    model = M.BagList(rows=rows, dim=24).eval()
    x = M.bag_inputs(rows=rows)
    fast = fxrec.transform(model, x, mode="inference", quantize="int8")
    with torch.no_grad():
        want = fast(*x)
    state = fast.state_dict()
    (group,) = _quantized_groups(fast)
    name = next(n for n, m in fast.named_modules() if m is group)
    w, _, p, o = fbgemm_nbit.relayout(
        group.q_packed, [f.table for f in group.features], (state[f"{name}.q_weights"], state[f"{name}.q_weights_uvm"]),
        state[f"{name}.q_weights_placements"], state[f"{name}.q_weights_offsets"], 1, torch.device("cpu"),
        new_alignment=16)
    assert not torch.equal(w, state[f"{name}.q_weights"])  # another packing of the same rows
    state.update({f"{name}.q_weights": w, f"{name}.q_weights_placements": p, f"{name}.q_weights_offsets": o,
                  f"{name}.q_row_alignment": torch.tensor(16)})
    fresh = fxrec.transform(M.BagList(rows=rows, dim=24).eval(), x, mode="inference", quantize="int8")
    fresh.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(fresh(*x), want, rtol=0, atol=0)


@pytest.mark.parametrize("rows,where", [((1, 2, 3), ()), (ROWS, ()), (ROWS, ("managed", "device", "managed"))],
                         ids=["tiny_tables", "tables", "tables_in_unified_memory"])
def test_a_checkpoint_of_rows_packed_for_cuda_loads_into_a_cpu_model(tmp_path, rows, where):
    """fxrec.checkpoint reads quantized rows at the size they were saved with (CUDA's 16-byte rows
    take more bytes, unified memory puts some in the uvm buffer) and loads them through the
    group's own load, which packs them again for this device. Before, only tiny tables (both
    packings the same size) loaded; the others were refused as another shape."""
    from fxrec.runtime.kernels import fbgemm_nbit

    x = M.bag_inputs(rows=rows)
    fast = fxrec.transform(M.BagList(rows=rows, dim=24).eval(), x, mode="inference", quantize="int8")
    with torch.no_grad():
        want = fast(*x)
    (group,) = _quantized_groups(fast)
    # the model's rows packed as on CUDA
    packed = fbgemm_nbit.relayout(
        group.q_packed, [f.table for f in group.features], (group.q_weights, group.q_weights_uvm),
        group.q_weights_placements, group.q_weights_offsets, 1, torch.device("cpu"), where, new_alignment=16)
    group.q_weights, group.q_weights_uvm, group.q_weights_placements, group.q_weights_offsets = packed
    group.q_ints = {**group.q_ints, "row_alignment": 16}
    group.q_row_alignment = torch.tensor(16)
    if not where:  # (CPU's lookup reads one buffer a call, see fbgemm_nbit)
        with torch.no_grad():
            torch.testing.assert_close(fast(*x), want, rtol=0, atol=0)
    fxrec.checkpoint.save_model(fast, tmp_path / "ckpt")
    fresh = fxrec.transform(M.BagList(rows=rows, dim=24).eval(), x, mode="inference", quantize="int8")
    fxrec.checkpoint.load_into_model(fresh, tmp_path / "ckpt")
    (loaded,) = _quantized_groups(fresh)
    assert loaded.q_ints["row_alignment"] == 1 and int(loaded.q_row_alignment) == 1
    assert loaded.q_weights_uvm.numel() == 0
    with torch.no_grad():
        torch.testing.assert_close(fresh(*x), want, rtol=0, atol=0)


class _TwoBags(nn.Module):
    def __init__(self, rows, dims):
        super().__init__()
        self.a = nn.EmbeddingBag(rows[0], dims[0], mode="sum")
        self.b = nn.EmbeddingBag(rows[1], dims[1], mode="sum")

    def forward(self, x, y):
        return torch.cat([self.a(x), self.b(y)], 1)


@pytest.mark.parametrize("layout", ["cpu", "cuda", "cuda_managed"])
@pytest.mark.parametrize("other", ["more_rows", "swapped_rows", "swapped_dims"])
def test_a_checkpoint_of_other_tables_is_refused_before_anything_loads(tmp_path, other, layout):
    """Quantized rows are read at the size they were saved with and checked against the tables as
    the checkpoint's own layout packs them (row offsets, dims, dtypes): another model's rows are
    refused naming the group's tables, and the model is left as it was. (Tables of swapped dims
    or rows, packed as on CUDA, took the same bytes and loaded: the review.)"""
    from fxrec.runtime.kernels import fbgemm_nbit

    x = (torch.randint(0, 40, (6, 2)), torch.randint(0, 40, (6, 3)))
    # (swapped rows or dims take the same bytes in all: only the offsets or dims tell them apart)
    (rows, dims), (saved_rows, saved_dims) = {
        "more_rows": (((40, 60), (56, 24)), ((47, 60), (56, 24))),
        "swapped_rows": (((40, 60), (24, 24)), ((60, 40), (24, 24))),
        "swapped_dims": (((40, 40), (56, 24)), ((40, 40), (24, 56)))}[other]
    fast = fxrec.transform(_TwoBags(saved_rows, saved_dims).eval(), x, mode="inference", quantize="int8")
    if layout != "cpu":
        (group,) = _quantized_groups(fast)
        packed = fbgemm_nbit.relayout(
            group.q_packed, [f.table for f in group.features], (group.q_weights, group.q_weights_uvm),
            group.q_weights_placements, group.q_weights_offsets, 1, torch.device("cpu"),
            ("managed", "device") if layout == "cuda_managed" else (), new_alignment=16)
        group.q_weights, group.q_weights_uvm, group.q_weights_placements, group.q_weights_offsets = packed
        group.q_row_alignment = torch.tensor(16)
    fxrec.checkpoint.save_model(fast, tmp_path / "ckpt")
    fresh = fxrec.transform(_TwoBags(rows, dims).eval(), x, mode="inference", quantize="int8")
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(fxrec.checkpoint.CheckpointError, match=r"\['a', 'b'\]|other shape|is \(.*\) in the checkpoint"):
        fxrec.checkpoint.load_into_model(fresh, tmp_path / "ckpt")
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    with pytest.raises(RuntimeError, match=r"\['a', 'b'\]|size mismatch"):
        fresh.load_state_dict(fast.state_dict())


def test_a_checkpoint_of_rows_packed_for_cuda_loads_with_its_optimizer(tmp_path):
    """load_into_model(optimizer=) read the checkpoint's packed rows at the model's size (the review)."""
    from fxrec.runtime.kernels import fbgemm_nbit

    x = M.bag_inputs(rows=ROWS)
    fast = fxrec.transform(M.BagList(rows=ROWS, dim=24).eval(), x, mode="inference", quantize="int8")
    with torch.no_grad():
        want = fast(*x)
    opt = torch.optim.SGD(fast.parameters(), lr=0.1)
    (group,) = _quantized_groups(fast)
    packed = fbgemm_nbit.relayout(
        group.q_packed, [f.table for f in group.features], (group.q_weights, group.q_weights_uvm),
        group.q_weights_placements, group.q_weights_offsets, 1, torch.device("cpu"), new_alignment=16)
    group.q_weights, group.q_weights_uvm, group.q_weights_placements, group.q_weights_offsets = packed
    group.q_row_alignment = torch.tensor(16)
    fxrec.checkpoint.save_model(fast, tmp_path / "ckpt", optimizer=opt)
    fresh = fxrec.transform(M.BagList(rows=ROWS, dim=24).eval(), x, mode="inference", quantize="int8")
    fxrec.checkpoint.load_into_model(fresh, tmp_path / "ckpt", optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1))
    with torch.no_grad():
        torch.testing.assert_close(fresh(*x), want, rtol=0, atol=0)


def test_a_state_dict_of_other_quantized_dtypes_is_refused_naming_the_tables():
    """int8 rows of dim 4 take the bytes fp16 rows do: they loaded into an fp16 model, which read
    them as fp16 (wrong outputs; the report still said fp16)."""
    model = M.BagList(rows=ROWS, dim=4).eval()
    inputs = M.bag_inputs(rows=ROWS)
    int8 = fxrec.transform(model, inputs, mode="inference", quantize="int8")
    fp16 = fxrec.transform(model, inputs, mode="inference", quantize={"bags.0": "int8", "*": "fp16"})
    before = fp16(*inputs)
    with pytest.raises(RuntimeError, match=r"q_weights holds tables of other dtypes than this model stores them in "
                                           r"\('bags.1' saved as int8, stored here as fp16; 'bags.2' saved as int8, "
                                           r"stored here as fp16\)"):
        fp16.load_state_dict(int8.state_dict())
    torch.testing.assert_close(fp16(*inputs), before, rtol=0, atol=0)
    fp16.load_state_dict(fxrec.transform(model, inputs, mode="inference",
                                         quantize={"bags.0": "int8", "*": "fp16"}).state_dict())


class _FourWidths(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.EmbeddingBag(1000, 18, mode="sum")
        self.b = torch.nn.EmbeddingBag(100, 12, mode="sum")
        self.c = torch.nn.EmbeddingBag(50, 20, mode="sum")
        self.d = torch.nn.EmbeddingBag(30, 5, mode="sum")

    def forward(self, i, o):
        return torch.cat([self.a(i, o), self.b(i % 100, o), self.c(i % 50, o), self.d(i % 30, o)], 1)


@pytest.mark.parametrize("quantize", ["int8", "int4", "int2", "fp16", "fp32",
                                      {"a": "int8", "b": "int4", "c": "int2", "d": "fp16"},
                                      {"a": "fp16", "b": "fp32", "c": "int8", "d": "int8"}])
def test_explain_gives_the_dtypes_and_bytes_transform_stores(quantize):
    """explain runs no quantization: it reported integer-quantized tables as fp32 (float32, 4 bytes
    a value), quantize="fp16" tables as float16 at their unpadded size, and "fp32" ones as
    float32, where transform says fp16 and fp32. On CUDA the rows are packed at 16 bytes (fbgemm's
    own sizes, the dims padded to the dtype's multiple)."""
    from fbgemm_gpu.split_embedding_configs import SparseType

    from fxrec.runtime.kernels.fbgemm_nbit import packed_bytes

    x = (torch.randint(0, 1000, (8,)), torch.arange(0, 8, 2))
    said_report = fxrec.explain(_FourWidths().eval(), x, device="cpu", mode="inference", quantize=quantize)
    made_report = fxrec.transform(_FourWidths().eval(), x, mode="inference", quantize=quantize).report
    said, made = said_report.tables, made_report.tables
    assert [(t["dtype"], t["bytes"]) for t in said] == [(t["dtype"], t["bytes"]) for t in made]
    # (explain said "one group module, kernel fbgemm" where transform says quantized, from its measurements)
    became = [g["became"] for g in said_report.to_dict()["groups"]]
    assert became == [g["became"] for g in made_report.to_dict()["groups"]] and "quantized" in became[0]
    assert [t["dtype"] for t in made] == [quantize if isinstance(quantize, str) else quantize[n] for n in "abcd"]
    cuda = fxrec.explain(_FourWidths().eval(), x, device="cuda", mode="inference", quantize=quantize).tables
    pad = {dt: SparseType(dt).align_size() for dt in ("fp32", "fp16", "int8", "int4", "int2")}
    want = [packed_bytes([(t["rows"], -(-t["dim"] // pad[t["dtype"]]) * pad[t["dtype"]], t["dtype"])], 16)[0]
            for t in made]
    assert [t["bytes"] for t in cuda] == want


@pytest.mark.parametrize("check", ["verify", "check_passes"])
@pytest.mark.parametrize("quantize", ["int8", "fp32"])
def test_verify_and_check_passes_with_quantize_are_refused_pointing_at_the_measured_errors(check, quantize):
    """They compare table gradients, which quantized tables have none of: both crashed inside the
    diagnosis (EmbeddingGroup.lookups() missing 'params'; check_passes blamed lower_groups)."""
    model = nn.EmbeddingBag(300, 12, mode="sum").eval()
    x = (torch.randint(0, 300, (8,)), torch.arange(4) * 2)
    with pytest.raises(ValueError, match=r"verify and check_passes .* quantize= stores the tables quantized .*"
                                              r"fast.report.quantization"):
        fxrec.transform(model, x, mode="inference", quantize=quantize, **{check: True})


def test_fp16_outputs_the_models_code_cannot_take_are_named_as_output_dtypes_doing():
    """(A PassError from measure_quantization with torch's bare dtype message.)"""
    class Linear(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.EmbeddingBag(300, 12, mode="sum")
            self.lin = nn.Linear(12, 1)

        def forward(self, ids, offs):
            return self.lin(self.a(ids, offs))

    x = (torch.randint(0, 300, (8,)), torch.arange(4) * 2)
    with pytest.raises(ValueError, match=r"output_dtype='fp16' gives the lookups' outputs in fp16, and the model's "
                                         r"code fails on them \(RuntimeError: mat1 and mat2 must have the same dtype"):
        fxrec.transform(Linear().eval(), x, mode="inference", quantize="int8", output_dtype="fp16")
    fast = fxrec.transform(Linear().eval(), x, mode="inference", quantize="int8")  # fp32 outputs: fine
    assert fast(*x).dtype == torch.float32


def test_output_dtype_without_quantize_is_refused():
    """(It was ignored: the outputs stayed fp32.)"""
    x = (torch.randint(0, 300, (8,)), torch.arange(4) * 2)
    with pytest.raises(ValueError, match=r"output_dtype is the dtype of quantized tables' lookups: it needs quantize="):
        fxrec.transform(nn.EmbeddingBag(300, 12).eval(), x, mode="inference", output_dtype="fp16")


# --- the HBM cache of quantized rows in unified memory ("managed_caching"; runs on CUDA only:
# tests/test_gpu.py; here its layout, and its lookup's arguments through fbgemm's CPU operator,
# which takes the cache and reads the rows without it)

def test_the_hbm_cache_of_quantized_rows_is_laid_out_as_fbgemms():
    """fbgemm's IntNBit cache: load_factor of the cached rows, in sets of 32, each row as wide as
    the widest cached packed row (16-byte rows, 4 bytes of scale and bias); per feature, where its
    table's rows start among the cached ones (-1: not cached), then their count; each cached row's
    feature (the last one reading its table). On meta its sizes; on CPU nothing."""
    from fxrec.runtime.kernels import fbgemm_nbit_cache as nb

    tables = [(10, 64, "int8"), (20, 32, "int4"), (5, 64, "int8")]
    ftm = [0, 1, 2, 0]  # (table 0 read by features 0 and 3)
    assert nb.cache_layout(tables, ftm, ("device",) * 3, 0.2) is None
    # 15 cached rows, int(7.5) = 7: one set; int8 at 64: 68 bytes, 80 at 16-byte rows
    assert nb.cache_layout(tables, ftm, ("managed_caching", "device", "managed_caching"), 0.5) == \
        (1, 80, [0, -1, 10, 0, 15], [3] * 10 + [2] * 5, 15)
    wide = [(1000, 128, "int8"), (3000, 32, "int4")]  # 132 -> 144 bytes; 20 -> 32
    lay = nb.cache_layout(wide, [0, 1], ("managed_caching",) * 2, 0.2)
    assert lay == (25, 144, [0, 1000, 4000], [0] * 1000 + [1] * 3000, 4000)  # 800 rows: 25 sets
    bufs, total = nb.cache_buffers(wide, [0, 1], ("managed_caching",) * 2, 0.2, torch.device("meta"))
    assert total == 4000 and list(bufs) == list(nb.CACHE_BUFFERS)
    assert [(tuple(b.shape), b.dtype) for b in bufs.values()] == [
        ((800, 144), torch.uint8), ((3,), torch.int64), ((4000,), torch.int32), ((25, 32), torch.int64),
        ((25, 32), torch.int64)]
    bufs, total = nb.cache_buffers(wide, [0, 1], ("managed_caching",) * 2, 0.2, torch.device("cpu"))
    assert total == 0 and all(b.numel() == 0 for b in bufs.values())


def _served_int8():
    """A BagList served int8 on CPU: (model, inputs, transformed, its outputs, its one group)."""
    rows = (50, 30, 20)
    model = M.BagList(rows=rows, dim=24).eval()
    x = M.bag_inputs(rows=rows, max_len=4)
    fast = fxrec.transform(model, x, mode="inference", quantize="int8")
    with torch.no_grad():
        want = fast(*x)
    (group,) = _quantized_groups(fast)
    return model, x, fast, want, group


def _with_a_cache(group, load_factor=0.5):
    """Give a quantized group on CPU the cache buffers it would have on CUDA with every table
    cached (fbgemm's CPU operator takes them and reads the rows as they are)."""
    from fxrec.runtime.kernels import fbgemm_nbit_cache as nb

    lay = nb.cache_layout(group.q_packed, [f.table for f in group.features],
                          ("managed_caching",) * len(group.tables), load_factor)
    group.q_cache_weights = torch.zeros(lay.sets * nb.CACHE_WAYS, lay.width, dtype=torch.uint8)
    group.q_cache_hash_size_cumsum = torch.tensor(lay.cumsum, dtype=torch.int64)
    group.q_cache_index_table_map = torch.tensor(lay.table_map, dtype=torch.int32)
    group.q_cache_state = torch.full((lay.sets, nb.CACHE_WAYS), -1, dtype=torch.int64)
    group.q_cache_lru = torch.zeros(lay.sets, nb.CACHE_WAYS, dtype=torch.int64)
    group.q_ints = {**group.q_ints, "total_cache_hash_size": lay.total}


def _ops_called(fn):
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Log():
        out = fn()
    return out, seen


def test_fbgemms_caching_lookup_takes_every_argument_fxrec_gives_it():
    """fbgemm's caching lookup (cache fill, then lookup: one operator), as fxrec calls it with a
    group's buffers and its cache's: TorchScript compiles the call against the operator's schema
    (names and types), and fbgemm's CPU form of it takes them all and reads the rows without the
    cache, as the plain lookup does. (On CUDA: tests/test_gpu.py.) On CPU a group never calls it:
    its cache would be ignored, with a warning at every call."""
    from fxrec.runtime.kernels import fbgemm_nbit_cache as nb
    from fxrec.runtime.kernels.fbgemm_nbit import int_nbit_lookup
    from fxrec.runtime.quantized import _LOOKUP_BUFFERS

    _, x, fast, want, group = _served_int8()
    assert group.q_cache_weights.numel() == 0 and group.q_ints["total_cache_hash_size"] == 0  # (CPU: none)
    _with_a_cache(group)
    with torch.no_grad():
        got, ops = _ops_called(lambda: fast(*x))
    assert not any("uvm_caching" in o for o in ops) and "fbgemm.int_nbit_split_embedding_codegen_lookup_function" in ops
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    *bufs, _ = _LOOKUP_BUFFERS(group._buffers)
    indices, offsets = torch.tensor([1, 2, 3, 4, 5, 6]), torch.arange(7)  # (3 features, batch 2, one id a bag)
    plain = int_nbit_lookup(group.q_ints, bufs, indices, offsets, None)
    scripted = torch.jit.script(nb.caching_lookup)
    for fn in (nb.caching_lookup, scripted):
        out, ops = _ops_called(lambda: fn(group.q_ints, bufs, indices, offsets, None))
        assert "fbgemm.int_nbit_split_embedding_uvm_caching_codegen_lookup_function" in ops, ops
        torch.testing.assert_close(out, plain, rtol=0, atol=0)


def test_an_exported_program_keeps_no_cache_and_reads_cached_rows_uncached():
    """torch.export keeps a module's buffers as the program's constants: the quantized groups'
    caches are set aside while it traces (the program reads cached rows uncached: fbgemm's caching
    operator has no meta kernel), and put back after; the rows read as MANAGED (1), not
    MANAGED_CACHING (2), whose kernel would read cache locations the program does not make."""
    from fxrec.runtime.kernels import fbgemm_nbit_cache as nb

    _, x, fast, want, group = _served_int8()
    _with_a_cache(group)
    cache = group.q_cache_weights
    program = fxrec.export.program(fast, x)
    assert group.q_cache_weights is cache
    sizes = {tuple(t.shape) for t in [*program.state_dict.values(), *program.constants.values()]
             if isinstance(t, torch.Tensor)}
    assert tuple(cache.shape) not in sizes and tuple(group.q_cache_state.shape) not in sizes, sizes
    with torch.no_grad():
        torch.testing.assert_close(program.module()(*x), want, rtol=0, atol=0)
    places = torch.tensor([2, 0, 3, 2], dtype=torch.int32)
    out = nb.uncached([torch.empty(0)] * 2 + [places] + [torch.empty(0)] * 3 + [cache] + [torch.empty(0)] * 5)
    assert out[2].tolist() == [1, 0, 3, 1] and out[6].numel() == 0 and out[6].dtype == torch.uint8


def test_a_quantized_groups_cache_is_not_saved_and_is_emptied_when_its_rows_change():
    """The cache is derived state: not in the state_dict, emptied (every cache row free) by
    load_state_dict and to_empty, whose rows it may no longer hold; a group pickled before it had
    one gets an empty one."""
    import pickle

    model, x, fast, want, group = _served_int8()
    state = fast.state_dict()
    assert not any("q_cache_" in k for k in state)
    _with_a_cache(group)
    group.q_cache_state.fill_(7)
    group.q_cache_lru.fill_(3)
    fast.load_state_dict(state)
    assert (group.q_cache_state == -1).all() and (group.q_cache_lru == 0).all()
    group.q_cache_state.fill_(7)
    fast.to_empty(device="cpu")
    assert (group.q_cache_state == -1).all()
    fast.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(fast(*x), want, rtol=0, atol=0)
    old = fxrec.transform(model, x, mode="inference", quantize="int8")
    (g,) = _quantized_groups(old)
    for name in [n for n in g._buffers if n.startswith("q_cache_")]:
        del g._buffers[name]
    g.q_ints = {k: v for k, v in g.q_ints.items() if k != "total_cache_hash_size"}
    back = pickle.loads(pickle.dumps(old))
    (g,) = _quantized_groups(back)
    assert g.q_cache_weights.numel() == 0 and g.q_ints["total_cache_hash_size"] == 0
    with torch.no_grad():
        torch.testing.assert_close(back(*x), want, rtol=0, atol=0)


class TiedOutput(torch.nn.Module):
    """An item table looked up, and read whole as the output layer (as BERT4Rec ties them)."""

    def __init__(self):
        super().__init__()
        self.item = torch.nn.Embedding(40, 8)
        self.other = torch.nn.Embedding(30, 8)

    def forward(self, seq, ids):
        h = self.item(seq).mean(1) + self.other(ids)
        return h @ self.item.weight.T


def test_the_report_counts_the_model_rows_a_quantized_table_keeps_for_reads_outside_its_lookups():
    """It showed 38 % of the model's bytes for such a table, while its fp32 rows stayed too (found by
    a fuzz of sequence models)."""
    torch.manual_seed(0)
    model = TiedOutput().eval()
    x = (torch.randint(0, 40, (4, 3)), torch.randint(0, 30, (4,)))
    fast = fxrec.transform(model, x, mode="inference", quantize="int8")
    entries = {q.table: q for q in fast.report.quantization}
    assert entries["item"].fp32_kept and not entries["other"].fp32_kept
    assert "item.weight" in dict(fast.named_parameters()) and "other.weight" not in dict(fast.named_parameters())
    text = str(fast.report)
    quantization = text[text.index("Quantization"):]
    line = next(line for line in quantization.splitlines() if line.strip().startswith("item "))
    assert f"{entries['item'].bytes_stored + 40 * 8 * 4} *" in line, line
    assert "the model reads the table outside its lookups" in quantization
    torch.testing.assert_close(fast(*x), model(*x), atol=0.05, rtol=0.05)
