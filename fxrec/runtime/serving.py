"""TorchScript-compatible group modules, for serving a transformed model without Python.

``fxrec.export.torchscript`` swaps every group module of a transformed model for one of these
before ``torch.jit.script``. They compute what the group modules compute in inference (no
autograd, no kernel choice, no output-buffer reuse), in the subset of Python that TorchScript
compiles: fp32 groups run PyTorch's own lookups (``embedding_bag`` / ``embedding``) one feature
after the other; quantized groups pack the features' ids into one indices/offsets pair, as the
eager quantized groups do, and call fbgemm's quantized TBE operator on their buffers. Bad ids
and offsets raise errors that name the feature and table, in C++ too.

The call takes only the inputs that exist: ``offsets`` and ``per_sample_weights`` hold the
tensors of the features that have them, in feature order (``off_index`` / ``psw_index`` map a
feature to its entry, -1 where it has none); ``weights`` are the fp32 tables (empty for
quantized groups). These modules know nothing of graphs or passes.
"""


from typing import Dict, List, Optional

import torch
from torch import Tensor, nn

# TorchScript reads no module globals: the forms are written as these literals in the methods
FORM_CODES = {"bag": 0, "pooled_seq": 1, "single": 2, "seq": 3}
_Q_INTS = ("total_D", "max_int2_D", "max_int4_D", "max_int8_D", "max_float16_D", "max_float32_D",
           "output_dtype", "row_alignment", "max_float8_D", "fp8_exponent_bits", "fp8_exponent_bias",
           "pooling_mode")
_Q_BUFFERS = ("q_weights", "q_weights_uvm", "q_weights_placements", "q_weights_offsets", "q_weights_tys",
              "q_D_offsets", "q_lxu_cache_weights", "q_lxu_cache_locations")


class _ServingGroup(nn.Module):
    """Specs as plain lists (what TorchScript can hold), input checks, and the quantized buffers."""

    names: List[str]
    table_names: List[str]
    rows: List[int]
    feature_table: List[int]
    forms: List[int]
    pads: List[int]
    ilos: List[bool]
    dims: List[int]
    off_index: List[int]
    psw_index: List[int]
    q: Dict[str, int]

    def __init__(self, group: nn.Module, off_index: List[int], psw_index: List[int]):
        super().__init__()
        self.names: List[str] = [f.name for f in group.features]
        self.table_names: List[str] = [group.tables[f.table].name for f in group.features]
        self.rows: List[int] = [group.tables[f.table].num_rows for f in group.features]
        self.feature_table: List[int] = [f.table for f in group.features]
        self.forms: List[int] = [FORM_CODES[f.form] for f in group.features]
        self.pads: List[int] = [-1 if f.padding_idx is None else int(f.padding_idx) for f in group.features]
        self.ilos: List[bool] = [bool(f.include_last_offset) for f in group.features]
        self.dims: List[int] = [group.tables[f.table].dim for f in group.features]
        self.off_index: List[int] = off_index
        self.psw_index: List[int] = psw_index
        self.any_weighted: bool = any(i >= 0 for i in psw_index)
        self.mode: int = {"sum": 0, "mean": 1, "none": 0}[group.pooling]
        self.quantized: bool = hasattr(group, "q_ints")
        self.q: Dict[str, int] = dict(group.q_ints) if self.quantized else {}
        self.fp16_out: bool = self.quantized and group.output_dtype == "fp16"
        for name in _Q_BUFFERS:
            src = getattr(group, name) if self.quantized else torch.empty(0)
            self.register_buffer(name, src.clone(), persistent=name != "q_lxu_cache_locations")

    def _check(self, ids_list: List[Tensor], offsets_list: List[Tensor]) -> None:
        if len(ids_list) != len(self.names):
            raise ValueError("fxrec: group of tables " + str(self.table_names) + " expects "
                             + str(len(self.names)) + " id tensors, got " + str(len(ids_list)))
        for i in range(len(self.names)):
            ids = ids_list[i]
            where = "feature '" + self.names[i] + "' (table '" + self.table_names[i] + "')"
            if ids.dtype != torch.int64 and ids.dtype != torch.int32:
                raise TypeError("fxrec: " + where + " got ids of dtype " + str(ids.dtype)
                                + "; embedding ids must be int64 or int32")
            if ids.numel() > 0:
                lo = int(ids.min())
                hi = int(ids.max())
                if lo < 0 or hi >= self.rows[i]:
                    bad = lo if lo < 0 else hi
                    raise IndexError("fxrec: " + where + " looks up id " + str(bad) + ", the table has "
                                     + str(self.rows[i]) + " rows")
            k = self.off_index[i]
            if k >= 0:
                off = offsets_list[k]
                if off.dim() != 1 or (off.dtype != torch.int64 and off.dtype != torch.int32):
                    raise TypeError("fxrec: " + where + " needs 1-D integer offsets")
                if off.numel() > 0:
                    ok = int(off[0]) == 0 and int(off[-1]) <= ids.numel()
                    if off.numel() > 1:
                        ok = ok and bool((off[1:] >= off[:-1]).all())
                    if not ok:
                        raise ValueError("fxrec: offsets of " + where + " do not match its " + str(ids.numel())
                                         + " ids: they must start at 0, never decrease and end at most there")

    def _quantized_lookup(self, indices: Tensor, offsets: Tensor, psw: Optional[Tensor]) -> Tensor:
        q = self.q
        return torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function(
            dev_weights=self.q_weights, uvm_weights=self.q_weights_uvm,
            weights_placements=self.q_weights_placements, weights_offsets=self.q_weights_offsets,
            weights_tys=self.q_weights_tys, D_offsets=self.q_D_offsets, total_D=q["total_D"],
            max_int2_D=q["max_int2_D"], max_int4_D=q["max_int4_D"], max_int8_D=q["max_int8_D"],
            max_float16_D=q["max_float16_D"], max_float32_D=q["max_float32_D"],
            indices=indices.int(), offsets=offsets.int(), pooling_mode=q["pooling_mode"], indice_weights=psw,
            output_dtype=q["output_dtype"], lxu_cache_weights=self.q_lxu_cache_weights,
            lxu_cache_locations=self.q_lxu_cache_locations, row_alignment=q["row_alignment"],
            max_float8_D=q["max_float8_D"], fp8_exponent_bits=q["fp8_exponent_bits"],
            fp8_exponent_bias=q["fp8_exponent_bias"],
        )

    def _out_dtype(self) -> torch.dtype:
        return torch.float16 if self.fp16_out else torch.float32


class ServingPooledGroup(_ServingGroup):
    """Pooled lookups (sum or mean); returns ``[B, sum of dims]``."""

    def forward(self, ids_list: List[Tensor], offsets_list: List[Tensor], psw_list: List[Tensor],
                weights: List[Tensor]) -> Tensor:
        self._check(ids_list, offsets_list)
        if not self.quantized:
            outs: List[Tensor] = []
            for i in range(len(self.names)):
                w = weights[self.feature_table[i]]
                ids = ids_list[i]
                form = self.forms[i]
                if form == 0:  # bag
                    psw: Optional[Tensor] = None
                    if self.psw_index[i] >= 0:
                        psw = psw_list[self.psw_index[i]]
                    pad: Optional[int] = None
                    if self.pads[i] >= 0:
                        pad = self.pads[i]
                    outs.append(torch.embedding_bag(w, ids, offsets_list[self.off_index[i]], False, self.mode, False,
                                                    psw, self.ilos[i], pad)[0])
                elif form == 2:  # single id
                    outs.append(torch.embedding(w, ids))
                else:
                    e = torch.embedding(w, ids)
                    outs.append(e.sum(1) if self.mode == 0 else e.mean(1))
            return torch.cat(outs, 1)
        return self._pack_and_lookup(ids_list, offsets_list, psw_list)

    def _pack_and_lookup(self, ids_list: List[Tensor], offsets_list: List[Tensor], psw_list: List[Tensor]) -> Tensor:
        """The eager quantized group's packing: features side by side, bags feature-major."""
        batch = -1
        nan_cols: List[int] = []  # features that mean-pool [B, 0] ids: NaN, as PyTorch gives it
        col = 0
        flats: List[Tensor] = []
        starts: List[Tensor] = []
        sample_weights: List[Tensor] = []
        for i in range(len(self.names)):
            ids = ids_list[i]
            dev = ids.device
            form = self.forms[i]
            psw: Optional[Tensor] = None
            if self.psw_index[i] >= 0:
                psw = psw_list[self.psw_index[i]].reshape(-1)
            if form == 0:  # bag
                flat = ids.reshape(-1).long()
                off = offsets_list[self.off_index[i]].long()
                ilo = self.ilos[i]
                pad = self.pads[i]
                if ilo or pad >= 0:
                    n = flat.numel()
                    if not ilo:
                        off = torch.cat([off, off.new_full([1], n)])
                    elif pad >= 0 and off.numel() > 0:
                        off = torch.cat([off[:-1], off.new_full([1], n)])  # as PyTorch: the last bag runs to the end
                    elif off.numel() > 0:
                        if self.mode == 1 and int(off[-1]) < n:
                            raise ValueError("fxrec: feature '" + self.names[i] + "' has ids after offsets[-1] with "
                                             "include_last_offset=True and mean pooling, where PyTorch divides the "
                                             "last bag by the ids up to the end of the tensor; quantized tables do "
                                             "not reproduce that: pass only the ids up to offsets[-1]")
                        flat = flat[: int(off[-1])]
                    else:
                        flat = flat[:0]
                    if pad >= 0:
                        keep = flat != pad
                        kept_before = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), keep.long().cumsum(0)])
                        off = kept_before[off]
                        flat = flat[keep]
                        if psw is not None:
                            psw = psw[: keep.numel()][keep]
                    off = off[:-1]
                b = off.numel()
                start = off
            elif form == 1:  # [B, L] ids pooled over L
                b = ids.shape[0]
                length = ids.shape[1]
                flat = ids.reshape(-1).long()
                if length == 0 and self.mode == 1:  # PyTorch's mean of no rows is NaN
                    for c in range(col, col + self.dims[i]):
                        nan_cols.append(c)
                if length > 0:
                    start = torch.arange(0, b * length, length, device=dev)
                else:
                    start = torch.zeros(b, dtype=torch.long, device=dev)
            else:
                b = ids.shape[0]
                flat = ids.reshape(-1).long()
                start = torch.arange(b, device=dev)
            if batch < 0:
                batch = b
            elif b != batch:
                raise ValueError("fxrec: the features of the group of tables " + str(self.table_names)
                                 + " have different batch sizes")
            col += self.dims[i]
            flats.append(flat)
            starts.append(start)
            if self.any_weighted:
                if psw is None:
                    psw = torch.ones(flat.numel(), dtype=torch.float32, device=dev)
                sample_weights.append(psw[: flat.numel()].float())
        if batch <= 0:
            return torch.zeros(0, sum(self.dims), dtype=self._out_dtype(), device=ids_list[0].device)
        indices = torch.cat(flats)
        bases: List[int] = [0]
        for x in flats[:-1]:
            bases.append(bases[-1] + x.numel())
        base = torch.tensor(bases, dtype=torch.long, device=indices.device).unsqueeze(1)
        offsets = torch.cat([(torch.stack(starts) + base).reshape(-1),
                             torch.full([1], indices.numel(), dtype=torch.long, device=indices.device)])
        psw_all: Optional[Tensor] = None
        if self.any_weighted:
            psw_all = torch.cat(sample_weights)
        out = self._quantized_lookup(indices, offsets, psw_all)
        if len(nan_cols) > 0:
            out[:, nan_cols] = float("nan")
        return out


class ServingSequenceGroup(_ServingGroup):
    """Unpooled lookups; returns one ``[*ids.shape, dim]`` tensor per feature."""

    def forward(self, ids_list: List[Tensor], offsets_list: List[Tensor], psw_list: List[Tensor],
                weights: List[Tensor]) -> List[Tensor]:
        self._check(ids_list, offsets_list)
        outs: List[Tensor] = []
        if not self.quantized:
            for i in range(len(self.names)):
                outs.append(torch.embedding(weights[self.feature_table[i]], ids_list[i]))
            return outs
        counts: List[int] = [ids.numel() for ids in ids_list]
        bmax = max(counts)
        dim = self.dims[0]
        if bmax == 0:
            for ids in ids_list:
                outs.append(torch.zeros(ids.shape + [dim], dtype=self._out_dtype(), device=ids.device))
            return outs
        dev = ids_list[0].device
        counts_t = torch.tensor(counts, device=dev)
        lengths = (torch.arange(bmax, device=dev) < counts_t.unsqueeze(1)).long().reshape(-1)
        indices = torch.cat([ids.reshape(-1).long() for ids in ids_list])
        offsets = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), lengths.cumsum(0)])
        out = self._quantized_lookup(indices, offsets, None)
        start = 0
        for i in range(len(ids_list)):
            outs.append(out[start: start + counts[i]].reshape(ids_list[i].shape + [dim]))
            start += counts[i]
        return outs
