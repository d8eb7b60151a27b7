"""measure_quantization: how far each quantized table's lookups are from the fp32 ones.

Runs the example inputs through the transformed model once, keeps each quantized group's
inputs, and computes every feature both ways: through the quantized TBE, and with PyTorch's
own lookups on the fp32 weights the table had before quantization. The report gets, per table:
dtype, bytes before (fp32) and after (as stored, scale and bias included), and the largest and
mean absolute difference over that table's outputs.

Before/After: the graph is unchanged. Afterwards the fp32 weights are dropped from the context.

Not handled: tables the example inputs do not look up (reported with no error figures).
"""

from __future__ import annotations

import copy
from typing import Dict

import torch
import torch.fx as fx

from .. import meta
from ..pass_infra import InputError, PassContext, PassResult, compiler_pass
from ..report import QuantEntry
from ..runtime.quantized import QuantizedPooledGroup, QuantizedSequenceGroup


@compiler_pass(needs=("quant",))
def measure_quantization(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    groups = {n: m for n, m in gm.named_children() if isinstance(m, (QuantizedPooledGroup, QuantizedSequenceGroup))}
    if not groups:
        return PassResult(gm, False, {})
    seen: Dict[str, tuple] = {}
    handles = [m.register_forward_pre_hook(lambda mod, a, n=n: seen.setdefault(n, a)) for n, m in groups.items()]
    try:
        with torch.no_grad():
            gm(*copy.deepcopy(ctx.example_args), **copy.deepcopy(ctx.example_kwargs))
    except RuntimeError as e:
        if ctx.config.output_dtype != "fp16" or not any(w in str(e) for w in ("dtype", "Half", "half")):
            raise
        raise InputError(f"fxrec: output_dtype='fp16' gives the lookups' outputs in fp16, and the model's code fails "
                         f"on them ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): convert them "
                         "with .float() where the model needs fp32, or keep output_dtype='fp32'") from e
    finally:
        for h in handles:
            h.remove()
    params = {g.module: [p for p in g.quant] for g in ctx.groups if g.quant}
    worst = 0.0
    calls = {n.target: n for n in gm.graph.nodes if n.op == "call_module" and n.target in groups}
    measured = 0
    for name, mod in groups.items():
        # the fp32 weights in the module's table order (the table names map back to parameters)
        fp32 = [ctx.fp32_weights[_param_of(t.name, params[name])] for t in mod.tables]
        sizes = mod.table_nbytes
        errs: Dict[int, list] = {}
        if name in seen:
            ids, offs, psw = seen[name]
            with torch.no_grad():
                got = mod(ids, offs, psw)
                want = mod.lookups(ids, offs, psw, fp32)
            if isinstance(got, torch.Tensor):
                got, want = torch.split(got.float(), mod.dims, 1), torch.split(want, mod.dims, 1)
            for f, g, w in zip(mod.features, got, want):
                if g.numel():
                    errs.setdefault(f.table, []).append((g.float() - w).abs().reshape(-1))
        entries = []
        read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}  # (lower_groups dropped the unread ones)
        for t, spec in enumerate(mod.tables):
            e = torch.cat(errs[t]) if t in errs else None
            entry = QuantEntry(
                table=spec.name, dtype=mod.dtypes[t], rows=spec.num_rows, dim=spec.dim,
                bytes_fp32=spec.num_rows * spec.dim * (2 if spec.dtype == "float16" else 4), bytes_stored=sizes[t],
                max_abs_error=float(e.max()) if e is not None else None,
                mean_abs_error=float(e.mean()) if e is not None else None,
                fp32_kept=_param_of(spec.name, params[name]) in read,
            )
            entries.append(entry)
            worst = max(worst, entry.max_abs_error or 0.0)
        calls[name].meta[meta.QUANT] = tuple(entries)
        measured += len(entries)
    ctx.fp32_weights.clear()
    return PassResult(gm, False, {"tables": measured, "worst_max_abs_error": f"{worst:.3g}"})


def _param_of(table: str, params) -> str:
    for p in params:
        if p == table or p == table + ".weight":
            return p
    raise KeyError(table)
