"""Runtime modules for inference: a group of lookups on row-wise quantized tables.

The tables are quantized by fbgemm's ``IntNBitTableBatchedEmbeddingBagsCodegen`` and looked up
with its operator on buffers this module keeps (so they are its state); the fp32 weights are gone
from the model.
The call is the training group's call without the weights:
``group(ids_list, offsets_list, psw_list)``. Inputs are packed and checked exactly as for the
training groups, so padding, per-sample weights, 2-D ids and include_last_offset keep their
PyTorch meaning.

A table whose dim its dtype cannot store (fbgemm needs a multiple of 4 for int8, 8 for int4, 16
for int2, 2 for fp16) is stored with extra columns up to the next multiple, each a copy of the
row's first value, so the row's minimum and maximum, and with them its scale, bias and every
real column's quantized value, are what they would be without them; the lookup's output loses
those columns before anyone sees it (``q_columns``). A sequence group stores every table at the
widest such width (fbgemm's unpooled lookup has one width).
"""

from __future__ import annotations

import operator
from typing import List, Optional, Sequence

import torch

from ._tracing import exporting
from .group import EmbeddingGroup, group_forward
from .kernels import FBGEMM
from .kernels import fbgemm_nbit as _nbit
from .kernels import fbgemm_nbit_cache as _cache
from .group_packing import pack_pooled, pack_sequence, unpack_sequence
from .packing import padding_weights
from .specs import QUANT_DTYPES, FeatureSpec, GroupSpec, TableSpec, real_columns_index, stored_widths


def _attach_quantized_tbe(group, dtypes: Sequence[str], weights: Sequence[torch.Tensor], output_dtype: str) -> None:
    """Quantize ``weights`` into an fbgemm IntNBit TBE and keep only what its lookup operator
    reads: the quantized rows and the table layout as buffers of ``group``, the dims as ints.

    The fbgemm module itself is not kept: it holds an ``AtomicCounter`` script object that
    torch.export cannot trace, and its Python forward adds nothing when fxrec checks the ids.
    """
    for t, dt in zip(group.tables, dtypes):
        if dt not in QUANT_DTYPES:
            raise ValueError(f"fxrec: table '{t.name}': dtype must be one of {QUANT_DTYPES}, got {dt!r}")
    group.dtypes = list(dtypes)
    group.output_dtype = output_dtype
    stored = stored_dims(group.tables, dtypes, group.pooling)
    padded = [w if d == t.dim else torch.cat([w, w[:, :1].expand(-1, d - t.dim)], 1)
              for w, t, d in zip(weights, group.tables, stored)]
    group.q_packed = [(t.num_rows, d, dt) for t, d, dt in zip(group.tables, stored, dtypes)]
    # each table's placement on CUDA ("managed", "managed_caching": unified memory, decided by place_tables)
    group.q_where = tuple(t.placement if t.placement in _nbit.PLACEMENTS else "managed" for t in group.tables)
    device = weights[0].device
    tbe = _nbit.make_inference_tbe(
        group.q_packed, [f.table for f in group.features], group.pooling, device, padded, output_dtype,
        _nbit.placed_for(device, group.q_where),
    )
    group.register_buffer("q_columns", _real_columns(group, weights[0].device),
                          persistent=False)  # derived from the specs: not part of state_dict()
    group.register_buffer("q_weights", tbe.weights_host if tbe.host_size > 0 else tbe.weights_dev)
    group.q_placed = _nbit.placed_for(device, group.q_where)  # where the rows are now
    for name in ("weights_uvm", "weights_placements", "weights_offsets", "weights_tys", "D_offsets",
                 "lxu_cache_weights"):
        group.register_buffer(f"q_{name}", getattr(tbe, name))
    group.register_buffer("q_lxu_cache_locations", torch.empty(0, dtype=torch.int32, device=weights[0].device),
                          persistent=False)
    group.q_ints = {name: int(getattr(tbe, name)) for name in (
        "total_D", "max_int2_D", "max_int4_D", "max_int8_D", "max_float16_D", "max_float32_D",
        "output_dtype", "row_alignment", "max_float8_D", "fp8_exponent_bits", "fp8_exponent_bias",
        "pooling_mode")}
    # saved with the rows, so that a state_dict loads into a model packed for another device
    group.register_buffer("q_row_alignment", torch.tensor(group.q_ints["row_alignment"], dtype=torch.int64))
    group._set_cache()
    if "managed_caching" in group.q_placed:  # (fbgemm's module was built uncached: the placements say cached)
        group._restore_layout_buffers()


def _real_columns(group, device: torch.device) -> torch.Tensor:
    """The columns of a pooled group's lookup that are its tables' own (none kept where every
    table is stored at its dim, and in a sequence group)."""
    stored = [d for _, d, _ in group.q_packed]
    cols = real_columns_index(group.tables, group.features, stored) if group.pooling != "none" else []
    return torch.tensor(cols, dtype=torch.long, device=device)


def stored_dims(tables: Sequence[TableSpec], dtypes: Sequence[str], pooling: str) -> List[int]:
    """Per table, the width it is stored with: its dim rounded up to what its dtype needs (in a
    sequence group the widest)."""
    return stored_widths(tables, pooling, [_nbit.quant_align(dt) for dt in dtypes])


def _lookup(group, indices: torch.Tensor, offsets: torch.Tensor, psw: Optional[torch.Tensor],
            summed: bool = False) -> torch.Tensor:
    """fbgemm's quantized TBE lookup operator on the group's buffers (pooled: padding columns
    dropped); ``summed``: sum-pooled whatever the group's pooling (``psw`` then weighs a mean).
    Exported, cached tables are read uncached (:func:`fxrec.runtime.kernels.fbgemm_nbit_cache.uncached`)."""
    *bufs, columns = _LOOKUP_BUFFERS(group._buffers)  # (one C-level read: nn.Module's __getattr__ is ~2 us each)
    if exporting() and "managed_caching" in group._places_now():
        bufs = _cache.uncached(bufs)
    q = {**group.q_ints, "pooling_mode": _nbit.SUM_POOLING} if summed else group.q_ints
    out = _nbit.int_nbit_lookup(q, bufs, indices, offsets, psw)
    return out.index_select(1, columns) if columns.numel() else out


#: the buffers fbgemm's quantized lookup reads, in its order, then the output columns kept
#: (``q_lxu_cache_weights``, fbgemm's module's own empty cache, stays in the state_dict, unread)
_LOOKUP_BUFFERS = operator.itemgetter(
    "q_weights", "q_weights_uvm", "q_weights_placements", "q_weights_offsets", "q_weights_tys", "q_D_offsets",
    "q_cache_weights", "q_lxu_cache_locations", *_cache.CACHE_BUFFERS[1:], "q_columns")


class _Quantized:
    @property
    def spec(self) -> GroupSpec:
        return GroupSpec(tuple(self.tables), tuple(self.features), self.pooling, quantized=True)

    @property
    def table_nbytes(self) -> List[int]:
        """Bytes each table takes as packed now (rows x stored row, scale and bias included)."""
        return _nbit.packed_bytes(self.q_packed, self.q_ints["row_alignment"])

    def _apply(self, fn, *args, **kwargs):
        """As nn.Module's; where the rows go to a device that needs another row alignment (CPU <->
        CUDA) or other placements (unified memory on CUDA, none on CPU), they are packed for it
        first, straight from where they are (rows bound for unified memory never pass through GPU
        memory; see :mod:`.kernels.fbgemm_nbit`)."""
        rows = self.q_weights
        probe = fn(torch.empty(0, dtype=torch.uint8, device=self.q_weights.device))
        device = probe.device if isinstance(probe, torch.Tensor) else self.q_weights.device
        if self._packed_otherwise_than(device) or (  # (another GPU: its unified memory, its cache)
                device.type == "cuda" and device != self.q_weights.device
                and any(w != "device" for w in _nbit.placed_for(device, self._cuda_places()))):
            self._pack_for(device)
        # left as they are by fn: the cache (derived; made where the rows go, below) and rows in
        # unified memory, where they go, which stay there: fn's own tensor (to_empty's, from meta)
        # would be GPU memory, which tables placed out of it must never take
        kept = {n: self._buffers[n] for n in _cache.CACHE_BUFFERS if n in self._buffers}
        uvm = self._buffers.get("q_weights_uvm")
        if uvm is not None and uvm.device == device and _nbit.in_unified_memory(uvm):
            kept["q_weights_uvm"] = uvm
        for n in kept:
            del self._buffers[n]
        try:
            out = super()._apply(fn, *args, **kwargs)
        finally:
            self._buffers.update(kept)
        if self.q_weights is not rows:
            # new tensors (a move, or to_empty: the rows are then memory as it was found, as a
            # plain model's tables are): the buffers that say where each table's rows are come
            # from the tables now, not at load_state_dict (read as to_empty found them, fbgemm's
            # lookup would read out of bounds); after a move, the same values again, in place;
            # the cache made where the rows are now (to meta: its memory freed) or emptied (rows it
            # may no longer hold)
            if not self.q_weights.is_meta:
                self._restore_layout_buffers()
            if "q_cache_state" not in kept or self.q_cache_state.device != self.q_weights.device:
                self._set_cache()
            elif not self.q_weights.is_meta:
                self._empty_cache()
        return out

    def _packed_otherwise_than(self, device: torch.device) -> bool:
        """Whether the rows are packed at another row alignment or placements than ``device``
        (CPU or CUDA) takes them at."""
        return device.type in ("cpu", "cuda") and (
            _nbit.row_alignment(device) != self.q_ints["row_alignment"]
            or _nbit.placed_for(device, self._cuda_places()) != self._places_now())

    def _cuda_places(self):
        return getattr(self, "q_where", ("device",) * len(self.tables))  # (pickled before fxrec kept it)

    def _places_now(self):
        return getattr(self, "q_placed", ("device",) * len(self.tables))

    def _pack_for(self, device: torch.device) -> None:
        placed = _nbit.placed_for(device, self._cuda_places())
        (self.q_weights, self.q_weights_uvm, self.q_weights_placements, self.q_weights_offsets) = _nbit.relayout(
            self.q_packed, [f.table for f in self.features], (self.q_weights, self.q_weights_uvm),
            self.q_weights_placements, self.q_weights_offsets, self.q_ints["row_alignment"], device, placed)
        self.q_placed = placed
        self.q_ints = {**self.q_ints, "row_alignment": _nbit.row_alignment(device)}
        self.q_row_alignment = torch.tensor(self.q_ints["row_alignment"], dtype=torch.int64, device=device)
        self._set_cache()

    def _set_cache(self) -> None:
        """The HBM cache of the tables placed ``"managed_caching"`` where the rows are now (CUDA;
        elsewhere empty buffers), empty: :func:`fxrec.runtime.kernels.fbgemm_nbit_cache.cache_buffers`,
        ``cache_load_factor`` of their rows. Not in the state_dict (the rows are)."""
        bufs, total = _cache.cache_buffers(self.q_packed, [f.table for f in self.features], self._places_now(),
                                          getattr(self, "cache_load_factor", 0.2), self.q_weights.device)
        for name, value in bufs.items():
            self.register_buffer(name, value, persistent=False)
        self.q_ints = {**self.q_ints, "total_cache_hash_size": total}

    def _empty_cache(self) -> None:
        """Every cache row empty and unused (in place), so nothing is read from it that the rows in
        unified memory no longer hold."""
        if self.q_cache_state.numel():
            self.q_cache_state.fill_(-1)
            self.q_cache_lru.zero_()

    def __getstate__(self):
        """Rows in unified memory are copied (``copy.deepcopy``, pickling) from a host copy, which
        :meth:`__setstate__` puts back in unified memory: a tensor's own copy would be made in GPU
        memory, which such tables were placed out of."""
        state = super().__getstate__()
        uvm = state.get("_buffers", {}).get("q_weights_uvm")
        if uvm is not None and _nbit.in_unified_memory(uvm):
            state = {**state, "_buffers": {**state["_buffers"], "q_weights_uvm": uvm.cpu()},
                     "_fxrec_unified_on": uvm.device}
        return state

    def __setstate__(self, state):
        device = state.pop("_fxrec_unified_on", None)
        super().__setstate__(state)
        if "q_cache_weights" not in self._buffers:  # (pickled before fxrec kept a cache: none)
            self._set_cache()
        uvm = self._buffers.get("q_weights_uvm")
        here = self.q_weights.device  # (torch.load's map_location moved the other buffers)
        unified = device is not None and uvm is not None
        if unified and here.type == "cuda":
            self.q_weights_uvm = _nbit.unified_bytes(uvm.numel(), here).copy_(uvm)
        elif (unified and here.type == "cpu") or self._packed_otherwise_than(here):
            # loaded on another kind of device (torch.load's map_location): rows packed there as
            # .to() packs them (CUDA reads rows 16 bytes at a time, a CPU at 1; unified memory
            # only on CUDA), not read at the stride of the device they were saved on
            self._pack_for(here)

    def saved_layout_problem(self, state_dict, prefix: str = "") -> str:
        """Where ``state_dict`` (this group's entries under ``prefix``) holds packed rows of other
        tables than this group's: other dtypes, other dims, or rows that do not fit them as its
        own layout (its placements and row alignment) packs them. What is wrong, naming the
        tables; else ""."""
        mine = self._layout()  # (from the tables, not the buffers: a model on meta then to_empty has none)
        tys = state_dict.get(prefix + "q_weights_tys")
        if tys is not None and (tys.dim() != 1 or tys.tolist() != mine.tys):
            # (rows of other dtypes of the same bytes would load, and be read by this model's widths)
            names = {int(ty.as_int()) if hasattr(ty, "as_int") else int(ty.value): n
                     for n, ty in _nbit._fbgemm_types().items()}
            saved = [names.get(int(c), str(int(c))) for c in tys.tolist()]
            differ = [f"'{t.name}' saved as {a}, stored here as {b}"
                      for t, a, b in zip(self.tables, saved, self.dtypes) if a != b] or [f"saved as {saved}"]
            return (f"fxrec: {prefix}q_weights holds tables of other dtypes than this model stores them in "
                    f"({'; '.join(differ)}): transform with the quantize= the state_dict was saved with")
        dims = state_dict.get(prefix + "q_D_offsets")
        if dims is not None and (dims.dim() != 1 or dims.tolist() != mine.D_offsets):
            return (f"fxrec: {prefix}q_D_offsets {dims.tolist()} are not the tables' {self._names()} "
                    f"({mine.D_offsets}): the rows were saved from tables of other dims")
        if prefix + "q_weights" not in state_dict or prefix + "q_weights_placements" not in state_dict:
            return ""  # (a partial state_dict: the rows are not loaded)
        try:
            places = state_dict[prefix + "q_weights_placements"].tolist()
            alignment = int(state_dict.get(prefix + "q_row_alignment", self.q_ints["row_alignment"]))
            dev, uvm, offsets = _nbit.saved_sizes(self.q_packed, [f.table for f in self.features], places, alignment)
        except (KeyError, ValueError, IndexError, TypeError, RuntimeError) as e:
            return f"fxrec: {prefix}q_weights_placements does not describe the tables {self._names()}: {e}"
        got = tuple(int(state_dict[prefix + n].numel()) if prefix + n in state_dict else 0
                    for n in ("q_weights", "q_weights_uvm"))
        saved = state_dict.get(prefix + "q_weights_offsets")
        if got != (dev, uvm) or saved is None or saved.tolist() != offsets:
            return (f"fxrec: {prefix}q_weights and q_weights_uvm hold {got[0]} and {got[1]} bytes at offsets "
                    f"{None if saved is None else saved.tolist()}, where the tables {self._names()} (rows, stored "
                    f"dims and dtypes {self.q_packed}) packed at {alignment} bytes with their saved placements take "
                    f"{dev} and {uvm} at {offsets}: the rows were saved from other tables")
        return ""

    def _names(self) -> List[str]:
        return [t.name for t in self.tables]

    def _layout(self) -> "_nbit.Layout":
        """The layout of this group's rows as packed now (its device's kind, placements and row
        alignment), from its tables."""
        return _nbit.layout(self.q_packed, [f.table for f in self.features], self.q_weights.device,
                            self._places_now(), self.q_ints["row_alignment"])

    def _restore_layout_buffers(self) -> None:
        """The buffers that describe the rows' layout, written from the tables: after ``to_empty``
        (a model loaded on meta) they hold whatever memory they were given, and the ones a
        state_dict does not hold (``q_columns``) would be read as they are."""
        mine, device = self._layout(), self.q_weights.device
        for name, value in (
                ("q_weights_placements", torch.tensor(mine.placements, dtype=torch.int32)),
                ("q_weights_offsets", torch.tensor(mine.offsets, dtype=torch.int64)),
                ("q_weights_tys", torch.tensor(mine.tys, dtype=torch.uint8)),
                ("q_D_offsets", torch.tensor(mine.D_offsets, dtype=torch.int32)),
                ("q_columns", _real_columns(self, torch.device("cpu"))),
                ("q_row_alignment", torch.tensor(self.q_ints["row_alignment"], dtype=torch.int64))):
            buf = getattr(self, name)
            if buf.shape == value.shape and buf.dtype == value.dtype and not buf.is_meta:
                buf.copy_(value)  # (in place: a CUDA graph captured before reads these very tensors)
            else:
                setattr(self, name, value.to(device if name != "q_row_alignment" else buf.device))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Rows saved packed for another device or placement (their ``q_row_alignment`` and
        placements) are packed again for this one's before they load, once
        :meth:`saved_layout_problem` finds them the rows of this group's tables; a state_dict
        without the alignment (saved before fxrec kept it) is read at this model's."""
        key = prefix + "q_row_alignment"
        mine = self.q_ints["row_alignment"]
        names = [prefix + n for n in ("q_weights", "q_weights_uvm", "q_weights_placements", "q_weights_offsets")]
        problem = self.saved_layout_problem(state_dict, prefix)
        if problem:
            args[-1].append(problem)
            return
        if self.q_weights.is_meta:  # (nothing to write: torch's load into meta, which copies nothing)
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
            return
        self._restore_layout_buffers()
        if prefix + "q_weights" in state_dict and all(n in state_dict for n in names[2:]):
            saved = int(state_dict[key]) if key in state_dict else mine
            places = state_dict[names[2]]
            if saved != mine or places.tolist() != self.q_weights_placements.tolist():
                uvm = state_dict.get(names[1], torch.zeros(0, dtype=torch.uint8))
                packed = _nbit.relayout(self.q_packed, [f.table for f in self.features],
                                        (state_dict[names[0]], uvm), places, state_dict[names[3]], saved,
                                        self.q_weights.device, self._places_now())
                state_dict.update(zip(names, packed))
        state_dict[key] = torch.tensor(mine, dtype=torch.int64)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._empty_cache()  # (the rows it holds may have changed)


class QuantizedPooledGroup(_Quantized, EmbeddingGroup):
    """Pooled lookups (sum or mean) on quantized tables; returns ``[B, sum of dims]``."""

    def __init__(self, tables: Sequence[TableSpec], features: Sequence[FeatureSpec], pooling: str,
                 dtypes: Sequence[str], weights: Sequence[torch.Tensor], output_dtype: str = "fp32",
                 cache_load_factor: float = 0.2):
        super().__init__(tables, features, pooling, FBGEMM, FBGEMM)
        self.cache_load_factor = float(cache_load_factor)  # (of the tables placed "managed_caching")
        _attach_quantized_tbe(self, dtypes, weights, output_dtype)

    @group_forward
    def forward(self, ids_list: List[torch.Tensor], offsets_list: List[Optional[torch.Tensor]],
                psw_list: List[Optional[torch.Tensor]]) -> torch.Tensor:
        self._check_count(ids_list)
        padded = self._padded_bags
        packed = pack_pooled(self, ids_list, offsets_list, psw_list, empty_means=True, strict=True,
                             keep_padding=padded)
        if packed is None:
            from .kernels.reference import batch_of

            # an empty batch (an include_last_offset bag's ids after offsets[-1] too: PyTorch drops them)
            batch = batch_of(self, ids_list, offsets_list)
            if batch == 0 or all(ids.numel() == 0 for ids in ids_list):
                if batch < 0:
                    batch = ids_list[0].shape[0] if ids_list and ids_list[0].dim() else 0
                return torch.zeros(batch, sum(self.dims), device=ids_list[0].device, dtype=self._out_dtype())
            raise ValueError(
                f"fxrec: the features of the quantized group of tables {[t.name for t in self.tables]} "
                "have different batch sizes; one TBE needs one"
            )
        indices, offsets, psw, batch, bounds = packed
        if padded:  # the padding ids stay, weighing 0 (mean: the others 1 / ids that are not padding)
            psw = padding_weights(indices, offsets, psw, bounds, self._forms, self._pads, self.pooling == "mean")
        out = _lookup(self, indices, offsets, psw, summed=padded)
        return self._nan_where_mean_of_none(out, ids_list)  # a mean of no rows, as PyTorch gives it

    def _out_dtype(self) -> torch.dtype:
        return torch.float16 if self.output_dtype == "fp16" else torch.float32


class QuantizedSequenceGroup(_Quantized, EmbeddingGroup):
    """Unpooled lookups on quantized tables; returns one tensor per feature."""

    def __init__(self, tables: Sequence[TableSpec], features: Sequence[FeatureSpec], pooling: str,
                 dtypes: Sequence[str], weights: Sequence[torch.Tensor], output_dtype: str = "fp32",
                 cache_load_factor: float = 0.2):
        super().__init__(tables, features, pooling, FBGEMM, FBGEMM)
        self.cache_load_factor = float(cache_load_factor)  # (of the tables placed "managed_caching")
        _attach_quantized_tbe(self, dtypes, weights, output_dtype)

    @group_forward
    def forward(self, ids_list: List[torch.Tensor], offsets_list: List[Optional[torch.Tensor]],
                psw_list: List[Optional[torch.Tensor]]) -> List[torch.Tensor]:
        self._check_count(ids_list)
        for f, ids in zip(self.features, ids_list):
            if ids.dtype not in (torch.int64, torch.int32):
                self._check_ids(f, ids)
        if not exporting() and max(ids.numel() for ids in ids_list) == 0:  # (no branch on a traced size)
            dt = torch.float16 if self.output_dtype == "fp16" else torch.float32
            return [torch.zeros(tuple(ids.shape) + (d,), dtype=dt, device=ids.device) for ids, d in zip(ids_list, self.dims)]
        indices, offsets, _, _ = pack_sequence(self, ids_list)
        return unpack_sequence(self, _lookup(self, indices, offsets, None), ids_list)
