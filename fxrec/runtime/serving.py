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


from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .kernels.fbgemm_nbit import clone_rows, int_nbit_lookup
from .kernels.fbgemm_nbit_cache import CACHE_BUFFERS
from .kernels.reference import lookup_each
from .packing import FORM_CODES, pack_bags, pack_rows, padding_weights, unpack_rows

# TorchScript reads no module globals: the forms are written as these literals in the methods
_Q_INTS = ("total_D", "max_int2_D", "max_int4_D", "max_int8_D", "max_float16_D", "max_float32_D",
           "output_dtype", "row_alignment", "max_float8_D", "fp8_exponent_bits", "fp8_exponent_bias",
           "pooling_mode")
_Q_BUFFERS = ("q_weights", "q_weights_uvm", "q_weights_placements", "q_weights_offsets", "q_weights_tys",
              "q_D_offsets", "q_lxu_cache_weights", "q_lxu_cache_locations", "q_columns", *CACHE_BUFFERS)
#: derived, not saved with the rows (a cache's own copy: the serving module fills its own)
_Q_DERIVED = ("q_lxu_cache_locations", "q_columns", *CACHE_BUFFERS)


def _dtype_name(dt: torch.dtype) -> str:
    """A dtype's name, in TorchScript too (where ``str`` gives its number)."""
    known = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
             torch.bool]
    names = ["float32", "float64", "float16", "bfloat16", "uint8", "int8", "int16", "bool"]
    for i in range(len(known)):
        if dt == known[i]:
            return "torch." + names[i]
    return str(dt)


class _ServingGroup(nn.Module):
    """Specs as plain lists (what TorchScript can hold), input checks, and the quantized buffers."""

    names: List[str]
    where: List[str]
    no_sparse: List[bool]
    pooling: str
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
        self.where: List[str] = list(group._where)
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
        self.pooling: str = group.pooling
        self.no_sparse: List[bool] = [False for _ in group.tables]  # serving makes no gradients
        self.quantized: bool = hasattr(group, "q_ints")
        self.q: Dict[str, int] = dict(group.q_ints) if self.quantized else {}
        self.fp16_out: bool = self.quantized and group.output_dtype == "fp16"
        # the tables' dtype in the user's model, which their per-sample weights must have (fp32 or fp16)
        self.half_tables: bool = bool(group.half)
        # quantized bags with a padding_idx keep their padding ids, weighing 0 (packing.padding_weights)
        self.keep_pads: List[bool] = [self.quantized and f.form == "bag" and f.padding_idx is not None
                                      for f in group.features]
        self.padded: bool = any(self.keep_pads)
        for name in _Q_BUFFERS:
            src = getattr(group, name) if self.quantized else torch.empty(0, dtype=torch.long)
            # (rows in unified memory stay there; a saved script loads them in GPU memory)
            self.register_buffer(name, clone_rows(src), persistent=name not in _Q_DERIVED)

    def _check(self, ids_list: List[Tensor], offsets_list: List[Tensor], psw_list: List[Tensor],
               weights: List[Tensor]) -> None:
        """Counts, dtypes and shapes (no value read), then every id and offset of every feature
        checked on its device into one flag, read once (one host wait a call on CUDA, where the
        per-feature reads made several a feature); when it is false, :meth:`_name_bad_input`
        raises the error that names the feature."""
        if len(ids_list) != len(self.names):
            raise ValueError("fxrec: group of tables " + str(self.table_names) + " expects "
                             + str(len(self.names)) + " id tensors, got " + str(len(ids_list)))
        ok: Optional[Tensor] = None
        dev = weights[0].device if len(weights) > 0 else self.q_D_offsets.device  # (where the tables are)
        for i in range(len(self.names)):
            ids = ids_list[i]
            where = "feature '" + self.names[i] + "' (table '" + self.table_names[i] + "')"
            k = self.off_index[i]
            w = self.psw_index[i]
            for what, t in (("ids", ids), ("offsets", offsets_list[k] if k >= 0 else ids),
                            ("per-sample weights", psw_list[w] if w >= 0 else ids)):
                if t.device != dev:  # (meta ids failed in .item() below; meta weights were read as garbage)
                    raise ValueError("fxrec: " + where + " got " + what + " on " + str(t.device)
                                     + ", but the table is on " + str(dev) + ": move the inputs to " + str(dev))
            if ids.dtype != torch.int64 and ids.dtype != torch.int32:
                raise TypeError("fxrec: " + where + " got ids of dtype " + _dtype_name(ids.dtype)
                                + "; embedding ids must be int64 or int32")
            want = 2 if self.forms[i] == 1 else (1 if k >= 0 or self.forms[i] == 2 else ids.dim())
            if ids.dim() != want:  # (2-D ids with offsets: pooled as if flattened, where PyTorch raises)
                raise ValueError("fxrec: " + where + " got ids of shape " + str(list(ids.shape)) + "; it takes "
                                 + str(want) + "-D ids" + (" with offsets" if k >= 0 else ""))
            inside = (ids >= 0) & (ids < self.rows[i])
            if k >= 0:
                off = offsets_list[k]
                if off.dim() != 1 or (off.dtype != torch.int64 and off.dtype != torch.int32):
                    raise TypeError("fxrec: " + where + " needs 1-D integer offsets")
                # (ids after offsets[-1] are not looked up, as in PyTorch, unless the table has a
                # padding row: PyTorch's last bag then runs to the end of the ids)
                if self.ilos[i] and self.pads[i] < 0 and off.numel() > 0:
                    inside = inside | (torch.arange(ids.numel(), device=ids.device) >= off[-1])
            good = inside.all()
            if k >= 0:
                off = offsets_list[k]
                if off.numel() > 0:
                    good = good & (off[0] == 0) & (off[-1] <= ids.numel()) & (off[1:] >= off[:-1]).all()
            ok = good if ok is None else ok & good
        if ok is not None and not bool(ok):
            self._name_bad_input(ids_list, offsets_list)

    def _name_bad_input(self, ids_list: List[Tensor], offsets_list: List[Tensor]) -> None:
        for i in range(len(self.names)):
            ids = ids_list[i]
            where = "feature '" + self.names[i] + "' (table '" + self.table_names[i] + "')"
            k = self.off_index[i]
            if k >= 0 and self.ilos[i] and self.pads[i] < 0 and offsets_list[k].dim() == 1 and offsets_list[k].numel() > 0:
                ids = ids[:max(int(offsets_list[k][-1]), 0)]  # (the ids looked up: none after offsets[-1])
            if ids.numel() > 0:
                lo = int(ids.min())
                hi = int(ids.max())
                if lo < 0 or hi >= self.rows[i]:
                    bad = lo if lo < 0 else hi
                    raise IndexError("fxrec: " + where + " looks up id " + str(bad) + ", the table has "
                                     + str(self.rows[i]) + " rows")
            ids = ids_list[i]
            if k >= 0:
                off = offsets_list[k]
                if off.numel() > 0:
                    ok = int(off[0]) == 0 and int(off[-1]) <= ids.numel()
                    if off.numel() > 1:
                        ok = ok and bool((off[1:] >= off[:-1]).all())
                    if not ok:
                        raise ValueError("fxrec: offsets of " + where + " do not match its " + str(ids.numel())
                                         + " ids: they must start at 0, never decrease and end at most there")
        raise ValueError("fxrec: invalid ids or offsets for tables " + str(self.table_names))

    def _per_feature(self, ids_list: List[Tensor], offsets_list: List[Tensor], psw_list: List[Tensor]
                     ) -> Tuple[List[Optional[Tensor]], List[Optional[Tensor]]]:
        """Each feature's offsets and per-sample weights, None where it has none."""
        offs: List[Optional[Tensor]] = []
        psws: List[Optional[Tensor]] = []
        for i in range(len(self.names)):
            k = self.off_index[i]
            offs.append(offsets_list[k] if k >= 0 else None)
            w = self.psw_index[i]
            want = torch.float16 if self.half_tables else torch.float32
            if w >= 0 and psw_list[w].dtype != want:  # (as the eager group's _check_weights)
                raise TypeError("fxrec: feature '" + self.names[i] + "' (table '" + self.table_names[i]
                                + "') got per-sample weights that are not "
                                + ("torch.float16" if self.half_tables else "torch.float32") + ", the dtype of its table")
            if w >= 0 and psw_list[w].shape != ids_list[i].shape:  # (as pack_bags: named here for fp32 groups too)
                raise ValueError("fxrec: per-sample weights of " + self.where[i] + " have shape "
                                 + str(list(psw_list[w].shape)) + ", its ids " + str(list(ids_list[i].shape))
                                 + ": they must have the ids' shape")
            psws.append(psw_list[w] if w >= 0 else None)
        return offs, psws

    def _quantized_lookup(self, indices: Tensor, offsets: Tensor, psw: Optional[Tensor], summed: bool = False) -> Tensor:
        bufs = [self.q_weights, self.q_weights_uvm, self.q_weights_placements, self.q_weights_offsets,
                self.q_weights_tys, self.q_D_offsets, self.q_cache_weights, self.q_lxu_cache_locations,
                self.q_cache_hash_size_cumsum, self.q_cache_index_table_map, self.q_cache_state, self.q_cache_lru]
        q = self.q
        if summed:  # sum-pooled whatever the group's pooling (psw weighs a mean: padding_weights)
            q = dict(self.q)
            q["pooling_mode"] = 0  # fbgemm's PoolingMode.SUM
        out = int_nbit_lookup(q, bufs, indices, offsets, psw)
        if self.q_columns.numel() > 0:  # tables stored padded (see fxrec.runtime.quantized)
            out = out.index_select(1, self.q_columns)
        return out

    def _out_dtype(self) -> torch.dtype:
        return torch.float16 if self.fp16_out else torch.float32


class ServingPooledGroup(_ServingGroup):
    """Pooled lookups (sum or mean); returns ``[B, sum of dims]``."""

    def forward(self, ids_list: List[Tensor], offsets_list: List[Tensor], psw_list: List[Tensor],
                weights: List[Tensor]) -> Tensor:
        self._check(ids_list, offsets_list, psw_list, weights)
        if not self.quantized:  # the reference kernel's lookups (the same function)
            offs, psws = self._per_feature(ids_list, offsets_list, psw_list)
            outs = lookup_each(ids_list, offs, psws, weights, self.feature_table, self.forms, self.pads,
                               self.ilos, self.no_sparse, self.pooling)
            batches = [o.shape[0] for o in outs]
            if min(batches) != max(batches):  # (torch.cat's own error names no feature)
                raise ValueError("fxrec: the features " + str(self.names) + " of the group of tables "
                                 + str(self.table_names) + " have different batch sizes " + str(batches))
            return torch.cat(outs, 1)
        return self._pack_and_lookup(ids_list, offsets_list, psw_list)

    def _pack_and_lookup(self, ids_list: List[Tensor], offsets_list: List[Tensor], psw_list: List[Tensor]) -> Tensor:
        """The eager quantized group's packing (the same function), then fbgemm's lookup."""
        offs, psws = self._per_feature(ids_list, offsets_list, psw_list)
        nan_cols: List[int] = []  # features that mean-pool [B, 0] ids: NaN, as PyTorch gives it
        col = 0
        for i in range(len(self.names)):
            ids = ids_list[i]
            if self.forms[i] == 1 and self.mode == 1 and ids.dim() == 2 and ids.shape[1] == 0:
                for c in range(col, col + self.dims[i]):
                    nan_cols.append(c)
            col += self.dims[i]
        batch, indices, offsets, psw, bounds, _ = pack_bags(ids_list, offs, psws, self.where, self.forms, self.pads,
                                                         self.ilos, self.mode == 1, self.any_weighted, True, True,
                                                         False, self.keep_pads)
        if batch < 0:
            raise ValueError("fxrec: the features of the group of tables " + str(self.table_names)
                             + " have different batch sizes")
        if batch == 0:
            return torch.zeros(0, sum(self.dims), dtype=self._out_dtype(), device=ids_list[0].device)
        if self.padded:  # as the eager quantized group: padding ids in place, weighing 0
            psw = padding_weights(indices, offsets, psw, bounds, self.forms, self.pads, self.mode == 1)
        out = self._quantized_lookup(indices, offsets, psw, self.padded)
        if len(nan_cols) > 0:
            out[:, nan_cols] = float("nan")
        return out


class ServingSequenceGroup(_ServingGroup):
    """Unpooled lookups; returns one ``[*ids.shape, dim]`` tensor per feature."""

    def forward(self, ids_list: List[Tensor], offsets_list: List[Tensor], psw_list: List[Tensor],
                weights: List[Tensor]) -> List[Tensor]:
        self._check(ids_list, offsets_list, psw_list, weights)
        outs: List[Tensor] = []
        if not self.quantized:  # the reference kernel's lookups (the same function)
            offs, psws = self._per_feature(ids_list, offsets_list, psw_list)
            return lookup_each(ids_list, offs, psws, weights, self.feature_table, self.forms, self.pads, self.ilos,
                               self.no_sparse, self.pooling)
        counts: List[int] = [ids.numel() for ids in ids_list]
        bmax = max(counts)
        if bmax == 0:
            for i, ids in enumerate(ids_list):
                outs.append(torch.zeros(ids.shape + [self.dims[i]], dtype=self._out_dtype(), device=ids.device))
            return outs
        indices, offsets, _ = pack_rows(ids_list)
        return unpack_rows(self._quantized_lookup(indices, offsets, None), ids_list, self.dims)
