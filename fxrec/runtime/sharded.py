"""Runtime modules of a sharded group's pooled lookups: input dist, local lookup, output dist,
called by the graph that ``shard_groups`` writes for one rank (one set per group, whatever its
tables' sharding types; each collective costs every rank a wait for the others, so a group's ids
travel in one exchange and its pooled rows in one more).

Every rank feeds its own local batch of ``B`` samples. A pooled feature's ids travel as
``lengths`` (ids per bag) and ``values`` (the ids), with per-sample weights alongside. What one
rank holds of a lookup's table is a *piece*, and one rule places every piece: its rows lie in
blocks of ``blocks[p]`` rows on ranks ``bases[p], bases[p] + 1, ...``:

  * table-wise: one piece, one block of the whole table on its owner;
  * column-wise: one piece per column shard, each one block of the whole table on its rank (a
    lookup's ids go to each of them, and its pieces come back side by side in column order);
  * row-wise: one piece, the planner's blocks from rank 0; table-row-wise: from the host's first
    rank (the other hosts' ranks hold none of its rows).

  * :class:`PooledInputDist` bucketizes every id to the rank of its row's block (local row = id -
    block start; fbgemm's ``block_bucketize_sparse_features``) and sends each rank its ids, bag by
    bag, with one exchange of the counts (and every rank's input check) and one all-to-all.
  * :class:`PooledLookup` sums them on the pieces the rank holds, by one call of the rank's group
    module (:class:`~fxrec.runtime.group.EmbeddingGroup`, on the kernel the rule gives: native on
    CPU, fbgemm on CUDA): ``[W * B, sum of its pieces' dims]``, whole sums of its tables and column
    shards, partial sums of its row blocks.
  * :class:`PooledOutputDist` sends every source rank its ``B`` rows back (all-to-all; in backward
    the gradients go the other way) and adds each piece's partial sums (a row-wise table's
    reduce-scatter, as an all-to-all and a local sum on every backend): one ``[B, dim]`` per
    lookup; mean pooling divides by the bag's length.

Unpooled (sequence) features: :mod:`fxrec.runtime.sharded_sequence`, by the same rule. The input
dists check their features' ids and offsets on the device into one flag (:func:`input_flag`),
which every rank learns with the counts: the rank fed a rejected input raises the error naming
the feature, the others stop too (:func:`stop_if_rejected`). All collectives are in
:mod:`fxrec.runtime.collectives`. Every rank must call a group's modules in the same order with
the same batch size. These modules know nothing of graphs or passes.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from .collectives import all_gather_ints, all_to_all, all_to_all_together, ints_on
from .device_ints import consts_on
from .grad import clamped_by
from .kernels.fbgemm_ops import bucketize_rows, source_major_to_feature_major
from .packing import FORM_CODES, pack_bags
from .sharded_inputs import (check_batch, check_input_devices, check_input_dtypes, check_sample_weights, harmless_if,
                             input_flag, name_bad_input, refuse_with_the_others, stop_if_rejected)


def _packed(dist_module: nn.Module, ids_list, offsets_list, psw_list, order: List[int], weighted: bool):
    """The pooled features ``order`` of one input dist as bags, by the project's one packing
    (:func:`~fxrec.runtime.packing.pack_bags`): ``(lengths [F * B] feature-major, ids, per-sample
    weights (``weighted``: 1 for a feature without), each feature's number of ids (known on the
    host: nothing is read), B, each feature's first offset (None for an empty batch, or where no
    feature has offsets), the feature (0..F-1) of each id)``."""
    ids = [ids_list[i] for i in order]
    offs = [offsets_list[i] for i in order]
    psw = [psw_list[i] for i in order]
    n = len(order)
    fixed = dist_module.__dict__.setdefault("_packing_args", {}).get(tuple(order))
    if fixed is None:  # what pack_bags is told of the features: the same every call
        fixed = dist_module._packing_args[tuple(order)] = (
            [f"feature '{dist_module.names[i]}'" for i in order], [FORM_CODES[dist_module.forms[i]] for i in order],
            [-1] * n, [False] * n)
    batch, values, offsets, weights, bounds, firsts = pack_bags(ids, offs, psw, *fixed, False, weighted, False, True,
                                                                False)
    if batch < 0:
        sizes = {dist_module.names[i]: int(off.numel() if off is not None else x.shape[0])
                 for i, x, off in zip(order, ids, offs)}
        raise ValueError(f"fxrec: {dist_module.name}: features of one sharded group need one batch size, got {sizes}")
    if batch == 0:  # an empty batch (the other ranks must have one too: checked with the counts)
        dev = ids[0].device
        empty = torch.zeros(0, dtype=torch.long, device=dev)
        return empty, empty, (torch.zeros(0, device=dev) if weighted else None), [0] * n, 0, None, empty
    counts = [bounds[k + 1] - bounds[k] for k in range(n)]
    feature_of = consts_on(dist_module, "features", values.device, list(range(n))).repeat_interleave(
        ints_on(counts, values.device), output_size=values.numel())  # (by the host's counts: exact whatever the offsets)
    return offsets.diff(), values, weights, counts, batch, firsts, feature_of


def _regroup(lengths: torch.Tensor, values: torch.Tensor, weights: Optional[torch.Tensor], world: int, nfeat: int,
             batch: int):
    """Bags received as (source rank, feature, sample) -> (feature, source rank, sample)."""
    if nfeat == 0:
        return lengths, values, weights
    return source_major_to_feature_major(lengths, values, weights, world, nfeat, batch)


def _send_bags(lengths: torch.Tensor, values: torch.Tensor, weights: Optional[torch.Tensor], lengths_in: List[int],
               lengths_out: List[int], values_in: List[int], values_out: List[int], name: str):
    """Bags to their ranks by one all-to-all: ``lengths_out[r]`` lengths and ``values_out[r]`` ids
    (and weights) go to rank r; ``*_in[r]`` arrive from it. Returns what arrived."""
    sent = [lengths, values] + ([weights] if weights is not None else [])
    got = all_to_all_together(sent, [lengths_in, values_in, values_in][:len(sent)],
                              [lengths_out, values_out, values_out][:len(sent)], f"{name} (bags)")
    return got[0], got[1], (got[2] if weights is not None else None)


class PooledInputDist(nn.Module):
    """Send every id of the pooled pieces to the rank holding its row, bag by bag (see the module
    doc); ids are bucketed by fbgemm's ``block_bucketize_sparse_features``, one rule for every
    sharding type: piece ``p``'s rows lie in blocks of ``blocks[p]`` rows on ranks ``bases[p],
    bases[p] + 1, ...``."""

    _fxrec_collective = True
    #: the dtype the pieces' per-sample weights must have (the tables' in the model); they travel
    #: as float32, which holds fp16 ones exactly
    psw_dtype = torch.float32
    tables: Optional[List[str]] = None  # each feature's table, for errors (None: pickled before they were kept)

    def __init__(self, name: str, forms: List[str], blocks: List[int], bases: List[int], weighted: bool, rank: int,
                 world: int, names: List[str], rows: List[int], psw_dtype: torch.dtype = torch.float32,
                 tables: Optional[List[str]] = None):
        super().__init__()
        self.name, self.forms, self.blocks, self.bases, self.weighted = name, list(forms), list(blocks), list(bases), weighted
        self.names, self.rows = list(names), list(rows)
        self.tables, self.rank, self.world = tables, rank, world
        self.psw_dtype = psw_dtype

    def exchange_shape(self):
        """``(ints each rank sends, where its input flag is)`` in the exchange of the counts:
        ``[batch, flag, ids per (destination, piece)]``."""
        return 2 + self.world * len(self.forms), 1

    def forward(self, ids_list, offsets_list, psw_list):
        nfeat = len(self.forms)
        order = list(range(nfeat))
        try:  # (anything failing before the exchange fails on every rank: see refuse_with_the_others)
            check_input_devices(self, (ids_list, offsets_list, psw_list), self.names)
            check_input_dtypes(ids_list, offsets_list, psw_list, self.names, order, self.psw_dtype)
            check_sample_weights(psw_list, self.names, order)
            lengths, values, weights, counts, batch, firsts, feature_of = _packed(self, ids_list, offsets_list,
                                                                                  psw_list, order, self.weighted)
            dev = values.device
            local = lengths.view(nfeat, batch)  # this rank's bag lengths (mean pooling divides by them)
            flag = input_flag(values, feature_of, consts_on(self, "rows", dev, self.rows), lengths, firsts) if batch \
                else torch.zeros((), dtype=torch.long, device=dev)
            ids = values
            if any(self.bases):  # bucket = id // block + base, local row unchanged: shift the ids by base blocks
                ids = values + consts_on(self, "shift", dev, [b * k for b, k in zip(self.bases, self.blocks)])[feature_of]
            send_lengths, send_values, send_weights, _ = bucketize_rows(
                *harmless_if(flag, lengths, ids), consts_on(self, "blocks", dev, self.blocks), self.world, weights)
            per_dest_piece = send_lengths.view(self.world, nfeat, batch).sum(2).view(-1).to(torch.long)
            mine = torch.cat([ints_on([batch], dev), flag.view(1), per_dest_piece])
        except Exception as e:  # noqa: BLE001
            refuse_with_the_others(e, *self.exchange_shape(), ids_list[0].device, self.name, self.rank)
            raise
        # one exchange: every rank's batch, input check and ids per (destination, piece); a rank fed
        # rejected input bucketized harmless stand-ins, and every rank stops here
        info = all_gather_ints(mine, dev, f"{self.name} (counts)")
        stop_if_rejected([row[1] for row in info], self.name, self.rank,
                          lambda: name_bad_input(values, counts, self.names, self.rows, order, lengths, firsts,
                                                  self.tables))
        batch = check_batch([row[0] for row in info], self.name)
        info = [row[2:] for row in info]
        mine = info[self.rank]
        per_dest = [sum(mine[d * nfeat:(d + 1) * nfeat]) for d in range(self.world)]
        to_me = [row[self.rank * nfeat:(self.rank + 1) * nfeat] for row in info]  # per source, per piece
        recv = [sum(c) for c in to_me]
        per_piece = [sum(c[f] for c in to_me) for f in range(nfeat)]
        lengths, vals, w = _send_bags(send_lengths, send_values, send_weights if self.weighted else None,
                                      [nfeat * batch] * self.world, [nfeat * batch] * self.world, recv, per_dest,
                                      self.name)
        lengths, vals, w = _regroup(lengths, vals, w, self.world, nfeat, batch)
        return lengths, vals, w, batch, per_piece, local


def _call(group: nn.Module, inputs: tuple, weights: List[torch.Tensor]):
    """A local group's call: an fp32 group takes the rank's tables as its weights; a quantized
    group (inference) holds its own and is given none."""
    return group(*inputs, weights) if weights else group(*inputs)


class PooledLookup(nn.Module):
    """The received bags (``W * B`` per piece, pieces one after the other, bags source-major) of
    the pieces ``held`` here, summed by one call of ``group``: an
    :class:`~fxrec.runtime.group.EmbeddingGroup` of this rank's tables, column shards and row
    blocks (None when it holds none), on its kernel. ``[W * B, sum of the held pieces' dims]``:
    whole sums of its tables and column shards, partial sums of its row blocks."""

    def __init__(self, group: Optional[nn.Module], world: int, held: List[int]):
        super().__init__()
        self.group, self.world, self.held = group, world, list(held)

    def forward(self, dist_out, weights: List[torch.Tensor]) -> Optional[torch.Tensor]:
        if self.group is None:
            return None
        lengths, values, psw, batch, counts = dist_out[:5]  # (ids per piece: told by the input dist)
        lens = lengths.view(len(counts), self.world * batch)
        starts = lens.cumsum(1) - lens  # each piece's bag starts in its own ids
        parts = torch.split(values, counts)
        if psw is not None and self.group.half:
            psw = psw.half()  # (sent as float32: the model's fp16 weights, exactly)
        ws = torch.split(psw, counts) if psw is not None else None
        return _call(self.group, ([parts[p] for p in self.held], [starts[p] for p in self.held],
                                  [ws[p] if ws is not None else None for p in self.held]), weights)


class PooledOutputDist(nn.Module):
    """Give every rank its ``B`` rows of each pooled lookup: one ``[B, dim]`` per lookup (a
    column-wise lookup's pieces side by side), by one all-to-all: each rank sends source rank s
    its rows ``[s * B, (s + 1) * B)`` of what it looked up, and the receiver adds, in rank order,
    the pieces of the ranks holding each piece (one for a table or column shard: taken as it is;
    the row blocks' ranks for a row-wise table: a reduce-scatter). In backward the gradients go
    the other way. Mean pooling divides by the bag's length here."""

    _fxrec_collective = True

    def __init__(self, name: str, dims: List[int], holders: List[List[int]], rank: int, world: int,
                 pieces_per_output: List[int], pooling: str, dtype: torch.dtype = torch.float32,
                 out_dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.dtype = dtype  # of the rows sent (a rank that holds nothing sends none of it)
        self.out_dtype = out_dtype or dtype  # of the rows given (quantized fp16 serving: sums sent in fp32)
        self.name, self.dims, self.holders, self.rank, self.world = name, list(dims), [list(h) for h in holders], rank, world
        self.pooling = pooling
        self.held_by = [[p for p in range(len(dims)) if r in holders[p]] for r in range(world)]  # pieces, in order
        self.width_of = [sum(dims[p] for p in held) for held in self.held_by]
        self.pieces_per_output = list(pieces_per_output)

    def forward(self, looked: Optional[torch.Tensor], dist_out) -> List[torch.Tensor]:
        batch = dist_out[3]
        send = looked.reshape(-1) if looked is not None else torch.zeros(0, dtype=self.dtype, device=dist_out[1].device)
        if torch.is_grad_enabled() and not send.requires_grad:
            send = send.detach().requires_grad_()  # every rank joins the backward all-to-all
        mine = self.width_of[self.rank] * batch
        recv = all_to_all(send, [w * batch for w in self.width_of], [mine] * self.world, self.name)
        got: List[dict] = [{} for _ in self.dims]  # piece -> rank -> [B, dim]
        for r, blk in enumerate(torch.split(recv, [w * batch for w in self.width_of])):
            if self.held_by[r]:
                parts = torch.split(blk.view(batch, self.width_of[r]), [self.dims[p] for p in self.held_by[r]], 1)
                for p, part in zip(self.held_by[r], parts):
                    got[p][r] = part
        pieces = []
        # mean: each bag's length on this rank, [pieces, B, 1], made once for all the pieces
        lens = dist_out[5].clamp(min=1).to(self.dtype).unsqueeze(2) if self.pooling == "mean" else None
        for p, by_rank in enumerate(got):
            parts = [by_rank[r] for r in sorted(by_rank)]
            piece = parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)
            if lens is not None:
                piece = piece / lens[p]
            pieces.append(piece if piece.dtype == self.out_dtype else piece.to(self.out_dtype))
        outs, at = [], 0
        for k in self.pieces_per_output:
            outs.append(pieces[at] if k == 1 else torch.cat(pieces[at:at + k], 1))
            at += k
        return clamped_by(self, outs)  # (transform(max_gradient=))
