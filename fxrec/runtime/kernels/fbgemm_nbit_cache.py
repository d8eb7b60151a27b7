"""The HBM cache of quantized rows in unified memory, for :mod:`.fbgemm_nbit`'s lookup.

A table placed ``"managed_caching"`` on CUDA (``transform(hbm_budget=)``, see
:mod:`fxrec.passes.place_tables`) keeps its packed rows in the group's unified-memory buffer and
an LRU cache of them in GPU memory, as fbgemm's ``IntNBitTableBatchedEmbeddingBagsCodegen`` keeps
one (TorchRec's ``quant_uvm_caching``): :func:`cache_layout` and :func:`cache_buffers` lay it out as
fbgemm does (``cache_load_factor`` of the cached rows, in sets of :data:`CACHE_WAYS`), and
:func:`caching_lookup` calls fbgemm's caching lookup
(``int_nbit_split_embedding_uvm_caching_codegen_lookup_function``: it finds each id's cache row,
admits the missing ones, evicting the least recently used, then looks up, in one operator; a row
it cannot admit, every way of its set taken by the same call, is read from unified memory). The
cache is the group's state but not in its state_dict; it starts empty and is emptied when the rows
change (``load_state_dict``, ``to_empty``). An exported program reads the rows without it
(:func:`uncached`).
"""

from __future__ import annotations

import contextlib
import math
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .fbgemm_tbe import require_fbgemm

#: fbgemm's caches are set-associative with this many ways, a warp's threads (its default: 32 on
#: CUDA, 64 on ROCm; the caching lookup of quantized rows fills sets of exactly that many): their
#: rows come in multiples of it.
CACHE_WAYS = 64 if torch.version.hip else 32

#: the cache's buffers of a quantized group, in the order :func:`~.fbgemm_nbit.int_nbit_lookup`
#: takes them after the rows' (weights[6], then [8:]): the cached rows, the cached tables' row offsets per feature,
#: each cached row's feature, the cache's rows (their ids) and their last use
CACHE_BUFFERS = ("q_cache_weights", "q_cache_hash_size_cumsum", "q_cache_index_table_map", "q_cache_state",
                 "q_cache_lru")


class CacheLayout(NamedTuple):
    """An IntNBit TBE's HBM cache of its ``managed_caching`` tables, as fbgemm lays it out:
    ``sets`` of :data:`CACHE_WAYS` rows of ``width`` bytes; per feature, where its table's rows
    start among the cached rows (-1: not cached), then their count (``cumsum``); each cached row's
    feature (``table_map``); the count of cached rows (``total``)."""

    sets: int
    width: int
    cumsum: List[int]
    table_map: List[int]
    total: int


def cache_layout(rows_dims_dtypes: Sequence[Tuple[int, int, str]], feature_table_map: Sequence[int],
                 where: Sequence[str], load_factor: float) -> Optional[CacheLayout]:
    """The :class:`CacheLayout` of the tables placed ``"managed_caching"`` (None: none is):
    ``load_factor`` of the cached rows, rounded up to whole sets, each row as wide as the widest
    cached table's packed row (16-byte rows, scale and bias included); the rows' offsets and
    feature map are fbgemm's own (``construct_cache_state``)."""
    cached = [w == "managed_caching" for w in (tuple(where) or ("device",) * len(rows_dims_dtypes))]
    if not any(cached):
        return None
    require_fbgemm()
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, construct_cache_state
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import rounded_row_size_in_bytes

    types = _types()
    state = construct_cache_state([int(r) for r, _, _ in rows_dims_dtypes],
                                  [EmbeddingLocation.MANAGED_CACHING if c else EmbeddingLocation.DEVICE for c in cached],
                                  list(feature_table_map))
    total = int(state.total_cache_hash_size)
    sets = max(1, math.ceil(int(total * float(load_factor)) / CACHE_WAYS))
    width = max(rounded_row_size_in_bytes(int(d), types[t], 16) for (_, d, t), c in zip(rows_dims_dtypes, cached) if c)
    return CacheLayout(sets, width, list(state.cache_hash_size_cumsum), list(state.cache_index_table_map), total)


def cache_buffers(rows_dims_dtypes: Sequence[Tuple[int, int, str]], feature_table_map: Sequence[int],
                  where: Sequence[str], load_factor: float, device: torch.device) -> Tuple[Dict[str, torch.Tensor], int]:
    """The HBM cache of the tables placed ``"managed_caching"`` (on CUDA, or meta: its sizes;
    elsewhere, or with none, empty buffers), as fbgemm's IntNBit TBE keeps one for its caching
    lookup (:func:`cache_layout`), every cache row empty (-1) and unused (0). Returns the buffers
    by :data:`CACHE_BUFFERS` name and the number of cached table rows."""
    device = torch.device(device)
    lay = cache_layout(rows_dims_dtypes, feature_table_map, where, load_factor) \
        if device.type in ("cuda", "meta") else None
    if lay is None:
        return {"q_cache_weights": torch.zeros(0, 0, dtype=torch.uint8, device=device),
                "q_cache_hash_size_cumsum": torch.zeros(0, dtype=torch.int64, device=device),
                "q_cache_index_table_map": torch.zeros(0, dtype=torch.int32, device=device),
                "q_cache_state": torch.zeros(0, 0, dtype=torch.int64, device=device),
                "q_cache_lru": torch.zeros(0, 0, dtype=torch.int64, device=device)}, 0
    return {"q_cache_weights": torch.zeros(lay.sets * CACHE_WAYS, lay.width, dtype=torch.uint8, device=device),
            "q_cache_hash_size_cumsum": torch.tensor(lay.cumsum, dtype=torch.int64, device=device),
            "q_cache_index_table_map": torch.tensor(lay.table_map, dtype=torch.int32, device=device),
            "q_cache_state": torch.full((lay.sets, CACHE_WAYS), -1, dtype=torch.int64, device=device),
            "q_cache_lru": torch.zeros(lay.sets, CACHE_WAYS, dtype=torch.int64, device=device)}, lay.total


def uncached(weights: List[torch.Tensor]) -> List[torch.Tensor]:
    """:func:`~.fbgemm_nbit.int_nbit_lookup`'s ``weights`` read without the cache: the cached
    tables' rows from unified memory (placement MANAGED_CACHING 2 read as MANAGED 1, whose kernel reads no cache
    locations), the cache left out (a new empty tensor: nothing of it is read or kept). What an
    exported program calls (fbgemm's caching lookup has no meta kernel for torch.export to trace);
    the same rows, so the same outputs."""
    out = list(weights)
    out[2] = torch.where(weights[2] == 2, torch.ones_like(weights[2]), weights[2])
    out[6] = torch.zeros(0, 0, dtype=torch.uint8, device=weights[6].device)
    return out



@contextlib.contextmanager
def caches_left_out(model: torch.nn.Module):
    """The HBM caches of ``model``'s quantized groups set aside while it is exported: an exported
    program reads their rows uncached (:func:`uncached`), and
    torch.export keeps a module's buffers as the program's constants, read or not (the cache would
    take its HBM in the program and its bytes in the file)."""
    kept = []
    for m in model.modules():
        cache = m._buffers.get("q_cache_weights")  # (a quantized group's)
        if cache is not None and cache.numel():
            kept.append((m, {n: m._buffers[n] for n in CACHE_BUFFERS}))
            empty, _ = cache_buffers(m.q_packed, [f.table for f in m.features], (), 0.0, cache.device)
            m._buffers.update(empty)
    try:
        yield
    finally:
        for m, bufs in kept:
            m._buffers.update(bufs)

def caching_lookup(q: Dict[str, int], weights: List[torch.Tensor], indices: torch.Tensor, offsets: torch.Tensor,
                   psw: Optional[torch.Tensor]) -> torch.Tensor:
    """fbgemm's caching lookup of quantized rows (:func:`~.fbgemm_nbit.int_nbit_lookup`'s with
    cached rows): its cache filled with the rows the ids read, evicting the least recently used, then the lookup,
    cached rows read from the cache (one operator)."""
    # (row_alignment given: the operator's default, -1, reaches its cache fill as a value)
    return torch.ops.fbgemm.int_nbit_split_embedding_uvm_caching_codegen_lookup_function(
        dev_weights=weights[0], uvm_weights=weights[1], weights_placements=weights[2],
        weights_offsets=weights[3], weights_tys=weights[4], D_offsets=weights[5], total_D=q["total_D"],
        max_int2_D=q["max_int2_D"], max_int4_D=q["max_int4_D"], max_int8_D=q["max_int8_D"],
        max_float16_D=q["max_float16_D"], max_float32_D=q["max_float32_D"],
        indices=indices.int(), offsets=offsets.int(), pooling_mode=q["pooling_mode"], indice_weights=psw,
        output_dtype=q["output_dtype"], lxu_cache_weights=weights[6], lxu_cache_locations=None,
        row_alignment=q["row_alignment"], max_float8_D=q["max_float8_D"], fp8_exponent_bits=q["fp8_exponent_bits"],
        fp8_exponent_bias=q["fp8_exponent_bias"], cache_hash_size_cumsum=weights[8],
        total_cache_hash_size=q["total_cache_hash_size"], cache_index_table_map=weights[9],
        lxu_cache_state=weights[10], lxu_state=weights[11],
    )


def _types():
    from .fbgemm_nbit import _fbgemm_types

    return _fbgemm_types()
