"""Runtime modules of a sharded group's unpooled (sequence) features, of table-wise, row-wise and
table-row-wise tables alike (the pooled ones: :mod:`fxrec.runtime.sharded`):

  * :class:`SequenceInputDist` sends every id to the rank of its row's block (a table-wise table
    is one block on its owner; fbgemm's bucketize remembers where each id went).
  * :class:`SequenceLookup` looks the received ids' rows up by one call of the rank's unpooled
    group module.
  * :class:`SequenceOutputDist` sends every row back (all-to-all) to its id's place:
    ``ids.shape + [dim]`` per feature, as ``nn.Embedding`` gives.

Every rank must call a group's modules in the same order. These modules know nothing of graphs
or passes.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from .collectives import all_gather_ints, all_to_all, ints_on
from .grad import clamped_by
from .kernels.fbgemm_ops import bucketize_rows
from .device_ints import consts_on
from .sharded import _call
from .sharded_inputs import (check_input_devices, check_input_dtypes, input_flag, name_bad_input,
                             refuse_with_the_others, stop_if_rejected)


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    if x.numel() > 1:
        torch.cumsum(x[:-1], 0, out=out[1:])
    return out


def _regroup_index(lengths: torch.Tensor, world: int, nfeat: int, batch: int, n: int):
    """Bags received as (source rank, feature, sample) -> (feature, source rank, sample): the new
    lengths, and the index that takes the received ids into the new order."""
    lens = lengths.view(world, nfeat, batch)
    starts = _exclusive_cumsum(lengths).view(world, nfeat, batch)
    new_lens = lens.permute(1, 0, 2).reshape(-1)
    new_starts = starts.permute(1, 0, 2).reshape(-1)
    idx = torch.repeat_interleave(new_starts - _exclusive_cumsum(new_lens), new_lens, output_size=n) + torch.arange(n, device=lengths.device)
    return new_lens, idx


class SequenceInputDist(nn.Module):
    """Send every id of the unpooled features to the rank holding its row (see the module doc).

    One rule for every sharding type: feature ``f``'s rows lie in blocks of ``blocks[f]`` rows on
    ranks ``bases[f], bases[f] + 1, ...`` (table-wise: one block of the whole table on its owner;
    row-wise: the planner's blocks from rank 0; table-row-wise: from the host's first rank), and
    fbgemm's bucketize sends each id to its block's rank as the local row, remembering where each
    id went so that its row comes back to its place. Ranks may feed ids of different shapes."""

    _fxrec_collective = True

    tables: Optional[List[str]] = None  # (None: pickled before they were kept)

    def __init__(self, name: str, blocks: List[int], bases: List[int], rank: int, world: int,
                 names: List[str], rows: List[int], tables: Optional[List[str]] = None):
        super().__init__()
        self.name, self.blocks, self.bases = name, list(blocks), list(bases)
        self.names, self.rows, self.rank, self.world = list(names), list(rows), rank, world
        self.tables = tables  # each feature's table, for errors

    def exchange_shape(self):
        """``(ints each rank sends, where its input flag is)`` in the exchange of the counts:
        ``[flag, ids per (destination, feature)]``."""
        return 1 + self.world * len(self.blocks), 0

    def forward(self, ids_list, offsets_list, psw_list):
        nfeat = len(self.blocks)
        try:  # (anything failing before the exchange fails on every rank: see refuse_with_the_others)
            check_input_devices(self, (ids_list,), self.names)
            check_input_dtypes(ids_list, [None] * nfeat, [None] * nfeat, self.names, list(range(nfeat)))
            values = torch.cat([ids.reshape(-1) for ids in ids_list]).long()  # int32 and int64 ids together: int64
            dev = values.device
            sizes = [ids.numel() for ids in ids_list]
            lengths = ints_on(sizes, dev)  # ids per feature: one bag each
            feature_of = torch.arange(nfeat, device=dev).repeat_interleave(lengths, output_size=values.numel())
            flag = input_flag(values, feature_of, consts_on(self, "rows", dev, self.rows))
            ids = values
            if any(self.bases):  # a block's rank is its bucket (see PooledInputDist)
                ids = values + consts_on(self, "shift", dev, [b * k for b, k in zip(self.bases, self.blocks)])[feature_of]
            harmless = torch.where(flag.eq(0), ids, torch.zeros_like(ids))
            send_lengths, send_values, _, where = bucketize_rows(lengths, harmless,
                                                                 consts_on(self, "blocks", dev, self.blocks),
                                                                 self.world, None, sequence=True)
            mine = torch.cat([flag.view(1), send_lengths.to(torch.long)])
        except Exception as e:  # noqa: BLE001
            refuse_with_the_others(e, *self.exchange_shape(), ids_list[0].device, self.name, self.rank)
            raise
        # one exchange: every rank's input check and ids per [destination rank, feature]; a rank fed
        # rejected ids bucketized zeros in their place, and every rank stops here
        info = all_gather_ints(mine, dev, f"{self.name} (counts)")
        stop_if_rejected([row[0] for row in info], self.name, self.rank,
                          lambda: name_bad_input(values, sizes, self.names, self.rows, list(range(nfeat)),
                                                          tables=self.tables))
        info = [row[1:] for row in info]
        counts = info[self.rank]
        recv = [info[s][self.rank * nfeat:(self.rank + 1) * nfeat] for s in range(self.world)]
        got = all_to_all(send_values, [sum(c) for c in recv],
                         [sum(counts[d * nfeat:(d + 1) * nfeat]) for d in range(self.world)], f"{self.name} (ids)")
        # received (source, feature) -> (feature, source); ``back`` puts rows into arrival order again
        flat = ints_on([c for row in recv for c in row], dev)
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
