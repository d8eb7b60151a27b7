"""Inference on row-wise quantized tables: structure, exactness at fp32, error bounds, bytes."""

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
