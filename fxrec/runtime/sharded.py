"""Runtime modules of a sharded group: input dist, local lookup, output dist (one set per
sharding type), called by the graph that ``shard_groups`` writes for one rank.

Every rank feeds its own local batch of ``B`` samples. A pooled feature's ids travel as
``lengths`` (ids per bag) and ``values`` (the ids), with per-sample weights alongside.

Table-wise (a table lives whole on its owner rank):
  * :class:`TableWiseInputDist` sends each owner the ids of its features for this rank's batch
    (all-to-all of the counts, then of lengths, values and weights) and orders what arrives as
    one global batch per owned feature (source rank major): ``W * B`` bags.
  * :class:`PooledLookup` pools them on the owned tables: ``[W * B, sum of owned dims]``, by
    one call of the rank's group module (:class:`~fxrec.runtime.group.EmbeddingGroup`, on the
    kernel the rule gives: native on CPU, fbgemm on CUDA).
  * :class:`TableWiseOutputDist` sends every source rank its ``B`` rows back (all-to-all; in
    backward the gradients go the other way): one ``[B, dim]`` per lookup.
Row-wise (rows ``[r * block, (r + 1) * block)`` of a table live on rank r; table-row-wise: the
same over the ranks of one host, the others holding no rows and adding zeros to the sums):
  * :class:`RowWiseInputDist` bucketizes every id to the rank holding its row (local row =
    id - r * block; fbgemm's ``block_bucketize_sparse_features``) and sends each rank its ids,
    bag by bag.
  * :class:`PooledLookup` sums the rows it holds per bag: partial sums ``[W * B, sum of dims]``,
    by one call of the rank's group module.
  * :class:`RowWiseOutputDist` adds the partial sums of all ranks and gives each rank its own
    ``B`` rows (reduce-scatter; all-gather in backward), one ``[B, dim]`` per lookup; mean
    pooling divides by the bag's length.
Unpooled (sequence) features, of table-wise, row-wise and table-row-wise tables alike:
  * :class:`SequenceInputDist` sends every id to the rank of its row's block (a table-wise table
    is one block on its owner; fbgemm's bucketize remembers where each id went).
  * :class:`SequenceLookup` looks the received ids' rows up by one call of the rank's unpooled
    group module.
  * :class:`SequenceOutputDist` sends every row back (all-to-all) to its id's place:
    ``ids.shape + [dim]`` per feature, as ``nn.Embedding`` gives.
All collectives are in :mod:`fxrec.runtime.collectives`. Every rank must call a group's modules
in the same order with the same batch size. These modules know nothing of graphs or passes.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import nn

from .collectives import all_gather_ints, all_to_all, reduce_scatter
from .grad import clamped_by
from .kernels.fbgemm_ops import bucketize_rows, source_major_to_feature_major

_MODES = {"sum": 0, "mean": 1}


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    if x.numel() > 1:
        torch.cumsum(x[:-1], 0, out=out[1:])
    return out


def feature_lengths(form: str, ids: torch.Tensor, offsets: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(ids per bag ``[B]``, ids ``[n]``) of one pooled feature, both int64."""
    if form == "bag":
        off = offsets.long()
        ends = torch.cat([off[1:], off.new_full((1,), ids.numel())]) if off.numel() else off
        return ends - off, ids.reshape(-1).long()
    if form == "pooled_seq":
        b, length = ids.shape
        return torch.full((b,), length, dtype=torch.long, device=ids.device), ids.reshape(-1).long()
    return torch.ones(ids.shape[0], dtype=torch.long, device=ids.device), ids.reshape(-1).long()


def _regroup_index(lengths: torch.Tensor, world: int, nfeat: int, batch: int, n: int):
    """Bags received as (source rank, feature, sample) -> (feature, source rank, sample): the new
    lengths, and the index that takes the received ids into the new order."""
    lens = lengths.view(world, nfeat, batch)
    starts = _exclusive_cumsum(lengths).view(world, nfeat, batch)
    new_lens = lens.permute(1, 0, 2).reshape(-1)
    new_starts = starts.permute(1, 0, 2).reshape(-1)
    idx = torch.repeat_interleave(new_starts - _exclusive_cumsum(new_lens), new_lens, output_size=n) + torch.arange(n, device=lengths.device)
    return new_lens, idx


def _regroup(lengths: torch.Tensor, values: torch.Tensor, weights: Optional[torch.Tensor], world: int, nfeat: int,
             batch: int):
    """Bags received as (source rank, feature, sample) -> (feature, source rank, sample)."""
    if nfeat == 0:
        return lengths, values, weights
    return source_major_to_feature_major(lengths, values, weights, world, nfeat, batch)


def _check_ids(pairs, names: List[str], rows: List[int], order: List[int]) -> None:
    """Ids out of range fail here, on the rank that was fed them, naming the feature (on another
    rank they would fail far from their cause, and this rank would wait for it). Every feature is
    checked on its device into one flag, read once; the loop that names the feature runs only
    when it is false."""
    flags = [((vals < 0) | (vals >= rows[i])).any() for i, (_, vals) in zip(order, pairs) if vals.numel()]
    if not flags or not bool(torch.stack(flags).any()):
        return
    for i, (_, vals) in zip(order, pairs):
        if vals.numel():
            lo, hi = (int(x) for x in torch.aminmax(vals))
            if lo < 0 or hi >= rows[i]:
                raise IndexError(f"fxrec: feature '{names[i]}' looks up id {lo if lo < 0 else hi} in a table of "
                                 f"{rows[i]} rows (valid ids: 0..{rows[i] - 1})")


def _check_sample_weights(psw_list, names: List[str], order: List[int]) -> None:
    if torch.is_grad_enabled():
        for i in order:
            if psw_list[i] is not None and psw_list[i].requires_grad:
                raise ValueError(f"fxrec: feature '{names[i]}' has per-sample weights that need a gradient; "
                                 "sharded tables take fixed weights only for now (plan the table data_parallel)")


def _check_batch(batches: List[int], where: str) -> int:
    if len(set(batches)) != 1:
        raise ValueError(
            f"fxrec: {where}: the ranks fed local batches of different sizes {batches}; a sharded model "
            "needs the same batch size on every rank (pad the last batch, or drop it)"
        )
    return batches[0]


def _block_sizes(dist_module: nn.Module, device: torch.device) -> torch.Tensor:
    """An input dist's ``blocks`` as a tensor on ``device`` (made once per device)."""
    t = dist_module._blocks_on.get(device)
    if t is None:
        t = dist_module._blocks_on[device] = torch.tensor(dist_module.blocks, dtype=torch.long, device=device)
    return t


class TableWiseInputDist(nn.Module):
    """Send each owner rank the ids of its features (see the module doc)."""

    _fxrec_collective = True

    def __init__(self, name: str, forms: List[str], owners: List[int], weighted: bool, rank: int, world: int,
                 names: List[str], rows: List[int]):
        super().__init__()
        self.name, self.forms, self.owners, self.weighted = name, list(forms), list(owners), weighted
        self.names, self.rows = list(names), list(rows)
        self.rank, self.world = rank, world
        # features in the order they are sent: by owner rank, then group order
        self.send_order = sorted(range(len(forms)), key=lambda i: (owners[i], i))
        self.per_rank = [sum(1 for o in owners if o == r) for r in range(world)]

    def forward(self, ids_list, offsets_list, psw_list):
        pairs = [feature_lengths(self.forms[i], ids_list[i], offsets_list[i]) for i in self.send_order]
        _check_ids(pairs, self.names, self.rows, self.send_order)
        _check_sample_weights(psw_list, self.names, self.send_order)
        batch = int(pairs[0][0].numel()) if pairs else 0
        lengths = torch.cat([p[0] for p in pairs])
        values = torch.cat([p[1] for p in pairs])
        weights = None
        if self.weighted:
            weights = torch.cat([
                (psw_list[i].reshape(-1).float() if psw_list[i] is not None else torch.ones(p[1].numel(), device=p[1].device))
                for i, p in zip(self.send_order, pairs)
            ])
        # values per destination rank
        per_feature = torch.stack([p[0].sum() for p in pairs]).tolist() if pairs else []
        send_values = [0] * self.world
        for i, n in zip(self.send_order, per_feature):
            send_values[self.owners[i]] += int(n)
        info = all_gather_ints([batch] + send_values, values.device, f"{self.name} (counts)")
        batch = _check_batch([row[0] for row in info], self.name)
        recv_values = [row[1 + self.rank] for row in info]
        mine = self.per_rank[self.rank]
        lengths = all_to_all(lengths, [mine * batch] * self.world, [n * batch for n in self.per_rank],
                             f"{self.name} (lengths)")
        values = all_to_all(values, recv_values, send_values, f"{self.name} (ids)")
        if weights is not None:
            weights = all_to_all(weights, recv_values, send_values, f"{self.name} (weights)")
        lengths, values, weights = _regroup(lengths, values, weights, self.world, mine, batch)
        return lengths, values, weights, batch


def _call(group: nn.Module, inputs: tuple, weights: List[torch.Tensor]):
    """A local group's call: an fp32 group takes the rank's tables as its weights; a quantized
    group (inference) holds its own and is given none."""
    return group(*inputs, weights) if weights else group(*inputs)


class PooledLookup(nn.Module):
    """The received bags (``W * B`` per feature, features one after the other, bags source-major)
    pooled by one call of ``group``: an :class:`~fxrec.runtime.group.EmbeddingGroup` of the tables
    and column shards this rank owns (table-wise; None when it owns none), or of its row blocks,
    pooled by sum (row-wise: partial sums), on its kernel. ``[W * B, sum of its dims]``."""

    def __init__(self, group: Optional[nn.Module], world: int):
        super().__init__()
        self.group, self.world = group, world

    def forward(self, dist_out, weights: List[torch.Tensor]) -> Optional[torch.Tensor]:
        if self.group is None:
            return None
        lengths, values, psw, batch = dist_out[:4]
        nfeat = len(self.group.features)
        lens = lengths.view(nfeat, self.world * batch)
        counts = lens.sum(1).tolist()
        ws = list(torch.split(psw, counts)) if psw is not None else [None] * nfeat
        return _call(self.group, (list(torch.split(values, counts)), [_exclusive_cumsum(ln) for ln in lens], ws),
                     weights)


class TableWiseOutputDist(nn.Module):
    """Give every rank its rows of the pooled features back: one ``[B, dim]`` per lookup (a
    column-wise lookup's pieces side by side). Each owner sends source rank s its rows
    ``[s * B, (s + 1) * B)`` as they are (no copy); the receiver splits them by feature."""

    _fxrec_collective = True

    def __init__(self, name: str, dims: List[int], owners: List[int], rank: int, world: int,
                 pieces_per_output: Optional[List[int]] = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.dtype = dtype  # of the rows sent (a rank that owns nothing sends none of it)
        self.name, self.dims, self.owners, self.rank, self.world = name, list(dims), list(owners), rank, world
        self.width_of = [sum(dims[i] for i in range(len(dims)) if owners[i] == r) for r in range(world)]
        self.owned = [[i for i in range(len(dims)) if owners[i] == r] for r in range(world)]  # pieces, in order
        self.pieces_per_output = list(pieces_per_output or [1] * len(dims))

    def forward(self, looked: Optional[torch.Tensor], dist_out) -> List[torch.Tensor]:
        batch = dist_out[3]
        send = looked.reshape(-1) if looked is not None else torch.zeros(0, dtype=self.dtype, device=dist_out[1].device)
        if torch.is_grad_enabled() and not send.requires_grad:
            send = send.detach().requires_grad_()  # every rank joins the backward all-to-all
        mine = self.width_of[self.rank] * batch
        recv = all_to_all(send, [w * batch for w in self.width_of], [mine] * self.world, self.name)
        cols: List[Optional[torch.Tensor]] = [None] * len(self.dims)
        for r, blk in enumerate(torch.split(recv, [w * batch for w in self.width_of])):
            if self.owned[r]:
                parts = torch.split(blk.view(batch, self.width_of[r]), [self.dims[i] for i in self.owned[r]], 1)
                for i, part in zip(self.owned[r], parts):
                    cols[i] = part
        outs, at = [], 0
        for k in self.pieces_per_output:
            outs.append(cols[at] if k == 1 else torch.cat(cols[at:at + k], 1))
            at += k
        return clamped_by(self, outs)  # (transform(max_gradient=))


class RowWiseInputDist(nn.Module):
    """Send every id to the rank holding its row, bag by bag (see the module doc); ids are bucketed
    by fbgemm's ``block_bucketize_sparse_features``."""

    _fxrec_collective = True

    def __init__(self, name: str, forms: List[str], blocks: List[int], weighted: bool, rank: int, world: int,
                 names: List[str], rows: List[int], bases: Optional[List[int]] = None):
        super().__init__()
        self.name, self.forms, self.blocks, self.weighted = name, list(forms), list(blocks), weighted
        self.names, self.rows = list(names), list(rows)
        # first rank of each feature's row blocks: 0 for row-wise, the host's first rank for table-row-wise
        self.bases = list(bases) if bases is not None else [0] * len(forms)
        self.rank, self.world = rank, world
        self._blocks_on: dict = {}

    def forward(self, ids_list, offsets_list, psw_list):
        nfeat = len(self.forms)
        pairs = [feature_lengths(self.forms[i], ids_list[i], offsets_list[i]) for i in range(nfeat)]
        _check_ids(pairs, self.names, self.rows, list(range(nfeat)))
        _check_sample_weights(psw_list, self.names, list(range(nfeat)))
        batch = int(pairs[0][0].numel())
        weights = None
        if self.weighted:
            weights = torch.cat([psw_list[f].reshape(-1).float() if psw_list[f] is not None
                                 else torch.ones(vals.numel(), device=vals.device) for f, (_, vals) in enumerate(pairs)])
        # fbgemm's bucketize: a table-row-wise table's blocks start at its host's first rank, so its
        # ids are shifted by that many blocks (bucket = id // block + base; local row unchanged)
        shifted = [vals + self.bases[f] * self.blocks[f] if self.bases[f] else vals for f, (_, vals) in enumerate(pairs)]
        dev = pairs[0][1].device
        send_lengths, send_values, send_weights, _ = bucketize_rows(
            torch.cat([ln for ln, _ in pairs]), torch.cat(shifted), _block_sizes(self, dev), self.world, weights)
        per_dest = send_lengths.view(self.world, nfeat * batch).sum(1).tolist()
        info = all_gather_ints([batch] + per_dest, send_values.device, f"{self.name} (counts)")
        batch = _check_batch([row[0] for row in info], self.name)
        recv = [row[1 + self.rank] for row in info]
        lengths = all_to_all(send_lengths, [nfeat * batch] * self.world, [nfeat * batch] * self.world,
                             f"{self.name} (lengths)")
        vals = all_to_all(send_values, recv, per_dest, f"{self.name} (ids)")
        w = all_to_all(send_weights, recv, per_dest, f"{self.name} (weights)") if self.weighted else None
        lengths, vals, w = _regroup(lengths, vals, w, self.world, nfeat, batch)
        return lengths, vals, w, batch, torch.stack([p[0] for p in pairs])


class RowWiseOutputDist(nn.Module):
    """Sum the partial sums over ranks and keep this rank's ``B`` rows (reduce-scatter): one
    ``[B, dim]`` per lookup."""

    _fxrec_collective = True

    def __init__(self, name: str, dims: List[int], pooling: str):
        super().__init__()
        self.name, self.dims, self.pooling = name, list(dims), pooling

    def _dims_on(self, device: torch.device) -> torch.Tensor:  # made once: one wait for the device
        cache = self.__dict__.setdefault("_dims_cache", {})
        if device not in cache:
            cache[device] = torch.tensor(self.dims, dtype=torch.long).to(device)
        return cache[device]

    def forward(self, partial: torch.Tensor, dist_out) -> List[torch.Tensor]:
        if torch.is_grad_enabled() and not partial.requires_grad:
            partial = partial.detach().requires_grad_()  # every rank joins the backward all-gather
        out = reduce_scatter(partial, self.name)
        if self.pooling == "mean":
            local_lengths = dist_out[4]  # [features, B]: this rank's bag lengths before bucketizing
            scale = torch.repeat_interleave(1.0 / local_lengths.clamp(min=1).to(out.dtype), self._dims_on(out.device),
                                            dim=0, output_size=sum(self.dims))  # (sizes given: nothing read)
            out = out * scale.t()
        return clamped_by(self, list(torch.split(out, self.dims, 1)))


class SequenceInputDist(nn.Module):
    """Send every id of the unpooled features to the rank holding its row (see the module doc).

    One rule for every sharding type: feature ``f``'s rows lie in blocks of ``blocks[f]`` rows on
    ranks ``bases[f], bases[f] + 1, ...`` (table-wise: one block of the whole table on its owner;
    row-wise: the planner's blocks from rank 0; table-row-wise: from the host's first rank), and
    fbgemm's bucketize sends each id to its block's rank as the local row, remembering where each
    id went so that its row comes back to its place. Ranks may feed ids of different shapes."""

    _fxrec_collective = True

    def __init__(self, name: str, blocks: List[int], bases: List[int], rank: int, world: int,
                 names: List[str], rows: List[int]):
        super().__init__()
        self.name, self.blocks, self.bases = name, list(blocks), list(bases)
        self.names, self.rows, self.rank, self.world = list(names), list(rows), rank, world
        self._blocks_on: dict = {}

    def forward(self, ids_list, offsets_list, psw_list):
        nfeat = len(self.blocks)
        vals = [ids.reshape(-1).long() for ids in ids_list]
        _check_ids([(None, v) for v in vals], self.names, self.rows, list(range(nfeat)))
        dev = vals[0].device
        shifted = torch.cat([v + self.bases[f] * self.blocks[f] if self.bases[f] else v for f, v in enumerate(vals)])
        lengths = torch.tensor([v.numel() for v in vals], dtype=torch.long, device=dev)
        send_lengths, send_values, _, where = bucketize_rows(lengths, shifted, _block_sizes(self, dev), self.world,
                                                             None, sequence=True)
        counts = send_lengths.tolist()  # [destination rank, feature]
        info = all_gather_ints(counts, dev, f"{self.name} (counts)")
        recv = [info[s][self.rank * nfeat:(self.rank + 1) * nfeat] for s in range(self.world)]
        got = all_to_all(send_values, [sum(c) for c in recv],
                         [sum(counts[d * nfeat:(d + 1) * nfeat]) for d in range(self.world)], f"{self.name} (ids)")
        # received (source, feature) -> (feature, source); ``back`` puts rows into arrival order again
        flat = torch.tensor([c for row in recv for c in row], dtype=torch.long, device=dev)
        _, idx = _regroup_index(flat, self.world, nfeat, 1, got.numel())
        back = torch.empty_like(idx)
        back[idx] = torch.arange(idx.numel(), device=dev)
        per_feature = [sum(recv[s][f] for s in range(self.world)) for f in range(nfeat)]
        return (got[idx], per_feature, back, recv, where, counts, [tuple(ids.shape) for ids in ids_list])


class SequenceLookup(nn.Module):
    """The rows of the received ids, one tensor ``[n, dim]`` per feature, by one call of ``group``
    (an unpooled :class:`~fxrec.runtime.group.EmbeddingGroup` of the tables and row blocks this
    rank holds, features ``held`` of the dist's; None when it holds none)."""

    def __init__(self, group: Optional[nn.Module], held: List[int], dims: List[int], dtype: torch.dtype = torch.float32):
        super().__init__()
        self.group, self.held, self.dims, self.dtype = group, list(held), list(dims), dtype

    def forward(self, dist_out, weights: List[torch.Tensor]) -> List[torch.Tensor]:
        values, per_feature = dist_out[0], dist_out[1]
        parts = list(torch.split(values, per_feature))
        out = [values.new_zeros((0, d), dtype=self.dtype) for d in self.dims]  # nothing comes for the others
        if self.group is not None:
            n = len(self.held)
            rows = _call(self.group, ([parts[f] for f in self.held], [None] * n, [None] * n), weights)
            for f, r in zip(self.held, rows):
                out[f] = r
        return out


class SequenceOutputDist(nn.Module):
    """Send every row back to the rank whose id it is, and put it in the id's place:
    one ``ids.shape + [dim]`` tensor per feature, as ``nn.Embedding`` gives."""

    _fxrec_collective = True

    def __init__(self, name: str, dims: List[int], rank: int, world: int):
        super().__init__()
        self.name, self.dims, self.rank, self.world = name, list(dims), rank, world
        self.width = max(dims)  # rows travel at one width, narrower ones padded with zeros

    def forward(self, looked: List[torch.Tensor], dist_out) -> List[torch.Tensor]:
        _, _, back, recv, where, counts, shapes = dist_out
        nfeat, w = len(self.dims), self.width
        rows = torch.cat([r if r.shape[1] == w else torch.nn.functional.pad(r, (0, w - r.shape[1])) for r in looked])
        send = rows[back]  # arrival order: by source rank, then feature
        if torch.is_grad_enabled() and not send.requires_grad:
            send = send.detach().requires_grad_()  # every rank joins the backward all-to-all
        got = all_to_all(send, [sum(counts[d * nfeat:(d + 1) * nfeat]) for d in range(self.world)],
                         [sum(c) for c in recv], self.name)
        mine = got[where]  # each id's row in the id's place
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        return clamped_by(self, [part[:, :d].reshape(s + (d,)) for part, d, s in zip(torch.split(mine, sizes), self.dims, shapes)])
