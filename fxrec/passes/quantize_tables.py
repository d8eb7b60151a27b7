"""quantize_tables: choose the storage dtype of every grouped table for inference.

``transform(model, inputs, mode="inference", quantize=...)`` with ``quantize`` one of:
``"int8"`` / ``"int4"`` / ``"int2"`` / ``"fp16"`` / ``"fp32"`` for every table, a dict from
table name or glob pattern to a dtype (first match wins; ``"*"`` for the rest), or ``"auto"``:
int8 (D + 4 bytes a row, D rounded up to 4: the row's int8 values and an fp16 scale and bias)
for tables of at least ``AUTO_MIN_BYTES`` of fp32 weights whose rows int8 makes smaller (dim 3
and up), fp32 for the others, which have nothing worth saving. The model's fp16 tables stay fp16
where it says fp32 (never widened), and under "auto" go int8 only from 64 KiB of fp16 weights
and where int8 rows are smaller even at CUDA's 16-byte alignment (dims 9 to 12, and 17 and up); a group
whose tables all stay fp16 is left unquantized (its lookups stay exact). Integer dtypes are quantized row-wise (each row its own scale and bias, computed from
the trained weights by fbgemm's quantize_embs), so they lose precision: the report gives the
error measured on the example inputs (measure_quantization).

Before/After: the graph is unchanged; ``GroupRecord.quant`` maps each table to its dtype.

A dim the dtype cannot store as it is (fbgemm needs a multiple of 4 for int8, 8 for int4, 16
for int2, 2 for fp16) is stored padded, without changing the real columns' values
(:mod:`fxrec.runtime.quantized`); the report gives the bytes as stored.

Not handled: quantizing for training (mode must be "inference"). A dict key that matches no
grouped table is an error that names it.
"""

from __future__ import annotations

import torch.fx as fx

from .. import meta
from ..pass_infra import InputError, PassContext, PassResult, compiler_pass
from ..table_keys import check_keys, deciding_key
from ..runtime.specs import QUANT_DTYPES, pad_dim

AUTO_MIN_BYTES = 64 * 1024


def check_quantize(spec, who: str, error=ValueError) -> None:
    """``error`` unless ``spec`` is a ``quantize=`` value: a dtype, "auto", or a dict of them."""
    values = [spec] if isinstance(spec, str) else list(spec.values()) if isinstance(spec, dict) else None
    if values is None or any(v not in QUANT_DTYPES + ("auto",) for v in values):
        raise error(f"{who}: quantize must be one of {QUANT_DTYPES + ('auto',)} or a dict of them, got {spec!r}")


def dtype_for(spec, table: str, param: str, rows: int, dim: int, half: bool = False):
    """The storage dtype of one table (``half``: the model holds it in fp16, which is then its
    "fp32": its rows are never widened, nothing would be gained)."""
    keep = "fp16" if half else "fp32"
    if isinstance(spec, str):
        if spec == "auto":
            # int8 stores a row in its dim rounded up to 4 bytes plus an fp16 scale and bias: for
            # dims of 1 and 2 that is not smaller than fp32. An fp16 table leaves its exact rows only
            # where int8 is smaller even at CUDA's 16-byte rows (dims 8 and 16 are not: 16 and 32 bytes, as in fp16)
            if half:
                saves = -(-(pad_dim(dim, 4) + 4) // 16) * 16 < dim * 2
                return "int8" if rows * dim * 2 >= AUTO_MIN_BYTES and saves else keep
            saves = pad_dim(dim, 4) + 4 < dim * 4
            return "int8" if rows * dim * 4 >= AUTO_MIN_BYTES and saves else keep
        return keep if spec == "fp32" else spec
    key = deciding_key(spec, table, param)
    return keep if key is None else dtype_for(spec[key], table, param, rows, dim, half)


@compiler_pass(needs=("groups",), provides=("quant",))
def quantize_tables(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    spec = ctx.config.quantize
    if spec is None:
        return PassResult(gm, False, {})
    if ctx.config.mode != "inference":
        raise InputError("fxrec: quantize= needs mode='inference' (quantized tables cannot be trained)")
    check_quantize(spec, "fxrec", InputError)
    if isinstance(spec, dict):  # every key decides for a table it quantizes (as optimizer= keys must)
        alone = sorted({r.table for r in meta.all_records(gm) if not r.lowerable})
        check_keys(spec, [(r.table, r.param) for gr in ctx.groups for r in gr.lookups], "fxrec: quantize", InputError,
                   "table fxrec groups", f" (left as written, so not quantized: {alone})" if alone else "")
    counts = {}
    for gr in ctx.groups:
        half = gr.lookups[0].half
        for rec in gr.lookups:
            gr.quant[rec.param] = dtype_for(spec, rec.table, rec.param, rec.num_rows, rec.dim, half)
        gr.lower = True
        if half and set(gr.quant.values()) == {"fp16"}:
            # fp16 tables kept as they are: the group stays the model's fp16 lookups (fbgemm's TBE
            # where it gives PyTorch's numbers, see choose_kernels), not fbgemm's inference kernel,
            # whose mean rounds otherwise than PyTorch's (tests/test_half_tables.py)
            counts["fp16_as_held"] = counts.get("fp16_as_held", 0) + len(gr.quant)
            gr.quant.clear()
            continue
        for dt in gr.quant.values():
            counts[dt] = counts.get(dt, 0) + 1
    return PassResult(gm, False, {f"tables_{k}": v for k, v in sorted(counts.items())})
