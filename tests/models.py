"""Model styles as people really write them (used by the end-to-end and pass tests)."""

from typing import List

import torch
from torch import nn


class BagList(nn.Module):
    """ModuleList of EmbeddingBags looked up in a loop over lists of ids/offsets, then cat."""

    def __init__(self, rows=(50, 80, 30), dim=8, mode="sum", dense_in=4):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(r, dim, mode=mode) for r in rows])
        self.dense = nn.Linear(dense_in, dim)

    def forward(self, dense, ids: List[torch.Tensor], offsets: List[torch.Tensor]):
        pooled = [b(i, o) for b, i, o in zip(self.bags, ids, offsets)]
        return torch.cat([self.dense(dense)] + pooled, dim=1)


def bag_inputs(rows=(50, 80, 30), batch=6, max_len=4, dense_in=4, seed=0, empty_bags=True):
    g = torch.Generator().manual_seed(seed)
    lengths = [torch.randint(0 if empty_bags else 1, max_len + 1, (batch,), generator=g) for _ in rows]
    ids = [torch.randint(0, r, (int(l.sum()),), generator=g) for r, l in zip(rows, lengths)]
    offsets = [torch.cat([torch.zeros(1, dtype=torch.long), l.cumsum(0)[:-1]]) for l in lengths]
    return torch.rand(batch, dense_in, generator=g), ids, offsets


class FieldDict(nn.Module):
    """ModuleDict of Embeddings keyed by feature name, fed from float columns cast with .long()."""

    def __init__(self, rows=None, dim=4):
        super().__init__()
        rows = rows or {"user": 40, "item": 60, "city": 12}
        self.names = list(rows)
        self.emb = nn.ModuleDict({k: nn.Embedding(r, dim) for k, r in rows.items()})
        self.out = nn.Linear(dim * len(rows) + 2, 1)

    def forward(self, x):
        ids = x[:, 2:].long()
        cols = [self.emb[k](ids[:, j]) for j, k in enumerate(self.names)]
        return self.out(torch.cat([x[:, :2]] + cols, dim=1))


def field_inputs(rows=(40, 60, 12), batch=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    cols = [torch.randint(0, r, (batch, 1), generator=g).float() for r in rows]
    return (torch.cat([torch.rand(batch, 2, generator=g)] + cols, dim=1),)


class OffsetFM(nn.Module):
    """One Embedding over all fields with per-field offsets added to the ids (FM-style)."""

    def __init__(self, field_dims=(10, 20, 30), dim=8):
        super().__init__()
        self.embedding = nn.Embedding(sum(field_dims), dim)
        self.register_buffer("offsets", torch.tensor((0, *torch.tensor(field_dims).cumsum(0)[:-1].tolist())))
        self.linear = nn.Embedding(sum(field_dims), 4)

    def forward(self, x):
        x = x + self.offsets.unsqueeze(0)
        e = self.embedding(x)  # [B, F, D]
        square_of_sum = e.sum(dim=1) ** 2
        sum_of_square = (e * e).sum(dim=1)
        return 0.5 * (square_of_sum - sum_of_square).sum(1, keepdim=True) + self.linear(x).sum(dim=1).sum(1, keepdim=True)


def fm_inputs(field_dims=(10, 20, 30), batch=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.stack([torch.randint(0, d, (batch,), generator=g) for d in field_dims], 1),)


class SharedTables(nn.Module):
    """One table used by several features (user history and candidate share the item table)."""

    def __init__(self, items=100, dim=8):
        super().__init__()
        self.item = nn.EmbeddingBag(items, dim, mode="sum")
        self.cat = nn.EmbeddingBag(20, dim, mode="sum")

    def forward(self, hist, hist_off, cand, cand_off, cat_ids, cat_off):
        return torch.cat([self.item(hist, hist_off), self.item(cand, cand_off), self.cat(cat_ids, cat_off)], 1)


def shared_inputs(batch=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    hist = torch.randint(0, 100, (10,), generator=g)
    cand = torch.randint(0, 100, (batch,), generator=g)
    cat_ids = torch.randint(0, 20, (6,), generator=g)
    return (hist, torch.tensor([0, 3, 3, 7]), cand, torch.arange(batch), cat_ids, torch.tensor([0, 1, 2, 4]))


class SequenceMean(nn.Module):
    """Sequence features with mean pooling by hand, plus a sequence output kept unpooled."""

    def __init__(self, dim=8):
        super().__init__()
        self.hist = nn.Embedding(50, dim, padding_idx=0)
        self.query = nn.Embedding(30, dim)
        self.attn = nn.Embedding(40, dim)

    def forward(self, hist_ids, query_ids, seq_ids):
        h = self.hist(hist_ids).mean(dim=1)
        q = self.query(query_ids).sum(1)
        s = self.attn(seq_ids)  # [B, L, D], used unpooled
        scores = (s * q.unsqueeze(1)).sum(-1).softmax(-1)
        return torch.cat([h, q, (scores.unsqueeze(-1) * s).sum(1)], 1)


def seq_inputs(batch=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    hist = torch.randint(0, 50, (batch, 6), generator=g)
    hist[0, :3] = 0  # padding
    return hist, torch.randint(0, 30, (batch, 2), generator=g), torch.randint(0, 40, (batch, 3), generator=g)


class WeightedBags(nn.Module):
    """Weighted bags (per_sample_weights), a 2-D [B, L] bag input and include_last_offset."""

    def __init__(self, dim=8):
        super().__init__()
        self.w1 = nn.EmbeddingBag(60, dim, mode="sum")
        self.w2 = nn.EmbeddingBag(40, dim, mode="sum", include_last_offset=True)
        self.b2d = nn.EmbeddingBag(25, dim, mode="mean", padding_idx=3)

    def forward(self, ids1, off1, psw1, ids2, off2, psw2, ids2d):
        return torch.cat([self.w1(ids1, off1, per_sample_weights=psw1), self.w2(ids2, off2, per_sample_weights=psw2), self.b2d(ids2d)], 1)


def weighted_inputs(batch=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids1 = torch.randint(0, 60, (9,), generator=g)
    ids2 = torch.randint(0, 40, (7,), generator=g)
    ids2d = torch.randint(0, 25, (batch, 3), generator=g)
    ids2d[1] = 3  # a bag of only padding
    return (ids1, torch.tensor([0, 2, 2, 5]), torch.rand(9, generator=g), ids2, torch.tensor([0, 1, 4, 4, 7]),
            torch.rand(7, generator=g), ids2d)


class NotLowerable(nn.Module):
    """Lookups fxrec must leave exactly as they were."""

    def __init__(self):
        super().__init__()
        self.maxbag = nn.EmbeddingBag(20, 8, mode="max")
        self.renorm = nn.Embedding(20, 8, max_norm=1.0)
        self.freq = nn.Embedding(20, 8, scale_grad_by_freq=True)
        self.odd = nn.EmbeddingBag(20, 6, mode="sum")
        self.ok = nn.EmbeddingBag(20, 8, mode="sum")

    def forward(self, ids, offsets, col):
        return torch.cat([self.maxbag(ids, offsets), self.renorm(col), self.freq(col), self.odd(ids, offsets), self.ok(ids, offsets)], 1)


def not_lowerable_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 20, (8,), generator=g), torch.tensor([0, 3, 5]), torch.randint(0, 20, (3,), generator=g)
