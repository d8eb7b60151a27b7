"""Small recommendation models in the shapes public repositories give them (used by
tests/test_real_patterns.py).

Each model is written the way CTR / sequential-recommendation code is commonly written: field
offsets added to ids, a dim-1 "linear" table beside the field embeddings, per-feature "auto" dims,
one item table read by the history and by the target, towers as methods of one module, lookups
done only to read a batch size, quotient-remainder tables, lookups whose result is dropped. Every
model comes with an ``*_inputs(seed, batch)`` function that draws one batch (ids in range).
"""

from typing import Dict

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------------------
# a. FM family: a dim-1 "linear" table over all fields, summed, beside a wider field embedding


class LinearPart(nn.Module):
    """The first-order term: one weight per (field, value), summed over the fields, plus a bias."""

    def __init__(self, field_dims):
        super().__init__()
        self.weights = nn.Embedding(int(sum(field_dims)), 1)
        self.bias = nn.Parameter(torch.zeros(1))
        self.starts = np.concatenate([[0], np.cumsum(field_dims)[:-1]]).astype(np.int64)

    def forward(self, fields):  # fields: [B, F] ids, each column in its own field's range
        idx = fields + fields.new_tensor(self.starts)[None, :]
        return self.weights(idx).sum(dim=1) + self.bias  # [B, 1]


class FieldEmbedding(nn.Module):
    """All fields in one table; a field's ids are shifted by the sizes of the fields before it."""

    def __init__(self, field_dims, dim):
        super().__init__()
        self.table = nn.Embedding(int(sum(field_dims)), dim)
        self.register_buffer("starts", torch.tensor([0] + list(np.cumsum(field_dims)[:-1])), persistent=False)
        nn.init.xavier_uniform_(self.table.weight)

    def forward(self, fields):
        return self.table(fields + self.starts)  # [B, F, D]


class DeepFM(nn.Module):
    FIELDS = (12, 20, 7, 30)

    def __init__(self, dim=10):
        super().__init__()
        self.linear = LinearPart(self.FIELDS)
        self.embed = FieldEmbedding(self.FIELDS, dim)
        self.dnn = nn.Sequential(nn.Linear(len(self.FIELDS) * dim, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, fields):
        v = self.embed(fields)
        sum_sq = v.sum(dim=1).pow(2)
        sq_sum = v.pow(2).sum(dim=1)
        fm = 0.5 * (sum_sq - sq_sum).sum(dim=1, keepdim=True)
        logit = self.linear(fields) + fm + self.dnn(v.reshape(v.shape[0], -1))
        return torch.sigmoid(logit.squeeze(1))


def fields_inputs(field_dims, seed, batch=16):
    g = _gen(seed)
    return (torch.stack([torch.randint(0, d, (batch,), generator=g) for d in field_dims], dim=1),)


def deepfm_inputs(seed, batch=16):
    return fields_inputs(DeepFM.FIELDS, seed, batch)


class WideDeep(nn.Module):
    """Wide: the shared dim-1 table summed over fields (+ a linear on dense features);
    deep: one dim-8 table per field, looked up column by column, concatenated with the dense."""

    VOCAB = {"user": 25, "item": 40, "city": 9, "device": 4}
    DENSE = 3

    def __init__(self, dim=8):
        super().__init__()
        self.names = list(self.VOCAB)
        self.wide_sparse = LinearPart(list(self.VOCAB.values()))
        self.wide_dense = nn.Linear(self.DENSE, 1, bias=False)
        self.deep_embeddings = nn.ModuleDict({k: nn.Embedding(v, dim) for k, v in self.VOCAB.items()})
        self.deep = nn.Sequential(nn.Linear(dim * len(self.VOCAB) + self.DENSE, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, sparse, dense):
        wide = self.wide_sparse(sparse) + self.wide_dense(dense)
        deep_in = [self.deep_embeddings[name](sparse[:, j]) for j, name in enumerate(self.names)]
        deep = self.deep(torch.cat(deep_in + [dense], dim=-1))
        return torch.sigmoid(wide + deep)


def wdl_inputs(seed, batch=16):
    (sparse,) = fields_inputs(list(WideDeep.VOCAB.values()), seed, batch)
    return sparse, torch.rand(batch, WideDeep.DENSE, generator=_gen(seed + 1000))


class FieldAwareFM(nn.Module):
    """FFM: one dim-8 table per field, each looked up with all fields' ids; field i's vector for
    field j meets field j's vector for field i."""

    FIELDS = (10, 6, 15)

    def __init__(self, dim=8):
        super().__init__()
        self.linear = LinearPart(self.FIELDS)
        self.tables = nn.ModuleList([FieldEmbedding(self.FIELDS, dim) for _ in self.FIELDS])

    def forward(self, fields):
        per_field = [t(fields) for t in self.tables]  # each [B, F, D]
        pairs = []
        n = len(self.FIELDS)
        for i in range(n - 1):
            for j in range(i + 1, n):
                pairs.append(per_field[j][:, i] * per_field[i][:, j])
        ffm = torch.stack(pairs, dim=1).sum(dim=(1, 2)).unsqueeze(1)
        return torch.sigmoid(self.linear(fields) + ffm).squeeze(1)


def ffm_inputs(seed, batch=16):
    return fields_inputs(FieldAwareFM.FIELDS, seed, batch)


# --------------------------------------------------------------------------------------------
# b. DCN with per-feature "auto" dims


def auto_dim(vocab: int) -> int:
    return int(6 * vocab ** 0.25)


class DCN(nn.Module):
    """Deep & Cross: every sparse feature gets ``6 * vocab ** 0.25`` columns (6, 7, 9, 13, 102
    here), the multi-valued one is averaged by an EmbeddingBag; all are concatenated with the
    dense features and fed to a cross network and a DNN."""

    SINGLE = {"is_new": 1, "gender": 2, "weekday": 6, "age_bucket": 23, "item_id": 84000}
    MULTI = {"genres": 30}
    DENSE = 3

    def __init__(self, n_cross=2):
        super().__init__()
        self.embedding_dict = nn.ModuleDict({k: nn.Embedding(v, auto_dim(v)) for k, v in self.SINGLE.items()})
        for k, v in self.MULTI.items():
            self.embedding_dict[k] = nn.EmbeddingBag(v, auto_dim(v), mode="mean")
        width = sum(auto_dim(v) for v in {**self.SINGLE, **self.MULTI}.values()) + self.DENSE
        self.cross_w = nn.ParameterList([nn.Parameter(torch.randn(width, 1) * 0.05) for _ in range(n_cross)])
        self.cross_b = nn.ParameterList([nn.Parameter(torch.zeros(width)) for _ in range(n_cross)])
        self.dnn = nn.Sequential(nn.Linear(width, 16), nn.ReLU())
        self.out = nn.Linear(width + 16, 1)

    def forward(self, x: Dict[str, torch.Tensor]):
        emb_list = [self.embedding_dict[k](x[k]) for k in self.SINGLE]
        emb_list += [self.embedding_dict[k](x[k], x[k + "_offsets"]) for k in self.MULTI]
        x0 = torch.cat(emb_list + [x["dense"]], dim=1)
        xl = x0
        for w, b in zip(self.cross_w, self.cross_b):
            xl = x0 * (xl @ w) + b + xl
        return torch.sigmoid(self.out(torch.cat([xl, self.dnn(x0)], dim=1)))


def dcn_inputs(seed, batch=16):
    g = _gen(seed)
    x = {k: torch.randint(0, v, (batch,), generator=g) for k, v in DCN.SINGLE.items()}
    for k, v in DCN.MULTI.items():
        lengths = torch.randint(1, 4, (batch,), generator=g)
        x[k] = torch.randint(0, v, (int(lengths.sum()),), generator=g)
        x[k + "_offsets"] = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    x["dense"] = torch.rand(batch, DCN.DENSE, generator=g)
    return (x,)


# --------------------------------------------------------------------------------------------
# c. DIN: the item and category tables read by the history ([B, L]) and by the target ([B])


class ActivationUnit(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(4 * dim, 16), nn.Sigmoid(), nn.Linear(16, 1))

    def forward(self, query, keys):  # [B, D], [B, L, D]
        q = query.unsqueeze(1).expand(-1, keys.shape[1], -1)
        return self.mlp(torch.cat([q, keys, q - keys, q * keys], dim=-1)).squeeze(-1)  # [B, L]


class DIN(nn.Module):
    """The input is one [B, 3 + 2L] id matrix: user, target item, target category, the item
    history, the category history; each lookup slices its columns where it happens (so the
    history's ids are made after the target's embedding is already in use)."""

    N_USERS, N_ITEMS, N_CATS, HIST = 30, 60, 12, 5

    def __init__(self, dim=8):
        super().__init__()
        self.user_emb = nn.Embedding(self.N_USERS, dim)
        self.item_emb = nn.Embedding(self.N_ITEMS, dim)
        self.cate_emb = nn.Embedding(self.N_CATS, dim)
        self.query_proj = nn.Linear(2 * dim, 2 * dim)
        self.attention = ActivationUnit(2 * dim)
        self.mlp = nn.Sequential(nn.Linear(5 * dim, 16), nn.PReLU(), nn.Linear(16, 1))

    def embed_target(self, x):
        return torch.cat([self.item_emb(x[:, 1]), self.cate_emb(x[:, 2])], dim=-1)

    def embed_history(self, x):
        items = x[:, 3:3 + self.HIST]
        cates = x[:, 3 + self.HIST:3 + 2 * self.HIST]
        return torch.cat([self.item_emb(items), self.cate_emb(cates)], dim=-1), items > 0

    def forward(self, x):
        target = self.embed_target(x)
        query = torch.tanh(self.query_proj(target))
        history, mask = self.embed_history(x)
        scores = self.attention(query, history).masked_fill(~mask, -1e9).softmax(dim=-1)
        interest = (scores.unsqueeze(-1) * history).sum(dim=1)
        user = self.user_emb(x[:, 0])
        return torch.sigmoid(self.mlp(torch.cat([user, interest, target], dim=-1)))


def din_inputs(seed, batch=12):
    g = _gen(seed)
    L = DIN.HIST
    hist_items = torch.randint(1, DIN.N_ITEMS, (batch, L), generator=g)
    hist_cats = torch.randint(0, DIN.N_CATS, (batch, L), generator=g)
    lengths = torch.randint(1, L + 1, (batch,), generator=g)
    hist_items[torch.arange(L)[None, :] >= lengths[:, None]] = 0  # left-aligned, zero-padded
    cols = [torch.randint(0, DIN.N_USERS, (batch, 1), generator=g),
            torch.randint(1, DIN.N_ITEMS, (batch, 1), generator=g),
            torch.randint(0, DIN.N_CATS, (batch, 1), generator=g), hist_items, hist_cats]
    return (torch.cat(cols, dim=1),)


# --------------------------------------------------------------------------------------------
# d. two towers: the user tower averages the history over the item tower's table


class TwoTower(nn.Module):
    """``history="emb_mean"``: ``item_emb(hist).mean(1)`` on [B, L] ids; ``history="bag_mean"``:
    ``F.embedding_bag(ids, item_emb.weight, offsets, mode="mean")`` on variable-length histories.
    The item tower reads the same table with one id per row."""

    N_USERS, N_ITEMS, N_CATS, N_TAGS, HIST = 30, 80, 10, 15, 4

    def __init__(self, history="emb_mean", dim=16):
        super().__init__()
        self.history = history
        self.user_emb = nn.Embedding(self.N_USERS, dim)
        self.tag_bag = nn.EmbeddingBag(self.N_TAGS, 8, mode="sum")
        self.item_emb = nn.Embedding(self.N_ITEMS, dim)
        self.cat_emb = nn.Embedding(self.N_CATS, 8)
        self.user_mlp = nn.Sequential(nn.Linear(2 * dim + 8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.item_mlp = nn.Sequential(nn.Linear(dim + 8, 16), nn.ReLU(), nn.Linear(16, 8))

    def user_tower(self, user, hist, hist_offsets, tags, tag_offsets):
        if self.history == "emb_mean":
            behaviour = self.item_emb(hist).mean(1)
        else:
            behaviour = F.embedding_bag(hist, self.item_emb.weight, hist_offsets, mode="mean")
        u = torch.cat([self.user_emb(user), behaviour, self.tag_bag(tags, tag_offsets)], dim=1)
        return F.normalize(self.user_mlp(u), dim=-1)

    def item_tower(self, item, cat):
        return F.normalize(self.item_mlp(torch.cat([self.item_emb(item), self.cat_emb(cat)], dim=1)), dim=-1)

    def forward(self, user, hist, hist_offsets, tags, tag_offsets, item, cat):
        return (self.user_tower(user, hist, hist_offsets, tags, tag_offsets) * self.item_tower(item, cat)).sum(-1)


def two_tower_inputs(history, seed, batch=12):
    g = _gen(seed)
    T = TwoTower
    if history == "emb_mean":
        hist = torch.randint(0, T.N_ITEMS, (batch, T.HIST), generator=g)
        hist_offsets = torch.zeros(1, dtype=torch.long)  # unused
    else:
        lengths = torch.randint(1, T.HIST + 1, (batch,), generator=g)
        hist = torch.randint(0, T.N_ITEMS, (int(lengths.sum()),), generator=g)
        hist_offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    tag_lengths = torch.randint(0, 3, (batch,), generator=g)
    tags = torch.randint(0, T.N_TAGS, (int(tag_lengths.sum()),), generator=g)
    tag_offsets = torch.cat([torch.zeros(1, dtype=torch.long), tag_lengths.cumsum(0)[:-1]])
    return (torch.randint(0, T.N_USERS, (batch,), generator=g), hist, hist_offsets, tags, tag_offsets,
            torch.randint(0, T.N_ITEMS, (batch,), generator=g), torch.randint(0, T.N_CATS, (batch,), generator=g))


# --------------------------------------------------------------------------------------------
# e. ESMM: each user table is looked up a second time only to read the batch size


class ESMM(nn.Module):
    USER = {"user_id": 40, "age": 7, "gender": 3}
    ITEM = {"item_id": 50, "shop_id": 9}

    def __init__(self, dim=8):
        super().__init__()
        self.user_embeddings = nn.ModuleDict({k: nn.Embedding(v, dim) for k, v in self.USER.items()})
        self.item_embeddings = nn.ModuleDict({k: nn.Embedding(v, dim) for k, v in self.ITEM.items()})
        width = dim * (len(self.USER) + len(self.ITEM))
        self.task_bias = nn.Parameter(torch.zeros(1, 2))
        self.ctr_tower = nn.Sequential(nn.Linear(width, 16), nn.ReLU(), nn.Linear(16, 1))
        self.cvr_tower = nn.Sequential(nn.Linear(width, 16), nn.ReLU(), nn.Linear(16, 1))

    def batch_size(self, feats):
        sizes = [self.user_embeddings[k](feats[k]).shape[0] for k in self.USER]
        return sizes[0]

    def forward(self, feats: Dict[str, torch.Tensor]):
        bias = self.task_bias.expand(self.batch_size(feats), 2)
        user = torch.cat([self.user_embeddings[k](feats[k]) for k in self.USER], dim=1)
        item = torch.cat([self.item_embeddings[k](feats[k]) for k in self.ITEM], dim=1)
        shared = torch.cat([user, item], dim=1)
        p_ctr = torch.sigmoid(self.ctr_tower(shared).squeeze(1) + bias[:, 0])
        p_cvr = torch.sigmoid(self.cvr_tower(shared).squeeze(1) + bias[:, 1])
        return p_ctr, p_ctr * p_cvr


def esmm_inputs(seed, batch=16):
    g = _gen(seed)
    return ({k: torch.randint(0, v, (batch,), generator=g) for k, v in {**ESMM.USER, **ESMM.ITEM}.items()},)


# --------------------------------------------------------------------------------------------
# f. quotient-remainder embeddings


class QREmbedding(nn.Module):
    """A table of ``num`` rows stored as ``ceil(num / c)`` quotient rows times ``c`` remainder rows."""

    def __init__(self, num, dim, collisions=4):
        super().__init__()
        self.collisions = collisions
        self.q_table = nn.Embedding((num + collisions - 1) // collisions, dim)
        self.r_table = nn.Embedding(collisions, dim)

    def forward(self, ids):
        return self.q_table(ids // self.collisions) * self.r_table(ids % self.collisions)


class QRModel(nn.Module):
    VOCAB = {"user": (200, 16), "item": (120, 16), "city": (30, 8)}

    def __init__(self):
        super().__init__()
        self.emb = nn.ModuleDict({
            "user": QREmbedding(*self.VOCAB["user"]), "item": QREmbedding(*self.VOCAB["item"]),
            "city": nn.Embedding(*self.VOCAB["city"]),
        })
        self.mlp = nn.Sequential(nn.Linear(sum(d for _, d in self.VOCAB.values()), 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, user, item, city):
        return self.mlp(torch.cat([self.emb["user"](user), self.emb["item"](item), self.emb["city"](city)], dim=1))


def qr_inputs(seed, batch=16):
    g = _gen(seed)
    return tuple(torch.randint(0, n, (batch,), generator=g) for n, _ in QRModel.VOCAB.values())


# --------------------------------------------------------------------------------------------
# g. dead lookups and a repeated identical lookup


class DeadAndRepeated(nn.Module):
    def __init__(self):
        super().__init__()
        self.user = nn.Embedding(30, 8)
        self.item = nn.Embedding(40, 8)
        self.context = nn.Embedding(10, 4)
        self.legacy = nn.Embedding(20, 8)  # only read by a lookup whose result is dropped
        self.out = nn.Linear(20, 1)

    def forward(self, user, item, ctx):
        u = self.user(user)
        old = self.legacy(item % 20)  # noqa: F841  (left over from an earlier version)
        i = self.item(item)
        c = self.context(ctx)
        self.user(user)  # dead: the result is thrown away
        i_again = self.item(item)  # the same table with the same ids tensor, a second time
        return self.out(torch.cat([u, i, c], dim=1)) + (i_again * u).sum(1, keepdim=True)


def dead_inputs(seed, batch=16):
    g = _gen(seed)
    return (torch.randint(0, 30, (batch,), generator=g), torch.randint(0, 40, (batch,), generator=g),
            torch.randint(0, 10, (batch,), generator=g))


# --------------------------------------------------------------------------------------------
# h. SASRec with dim 7, side sequences of dims 5 and 10


class SASRec(nn.Module):
    N_ITEMS, N_CATS, N_TYPES, MAX_LEN = 50, 8, 4, 6

    def __init__(self, hidden=7, cat_dim=5, type_dim=10):
        super().__init__()
        self.item_emb = nn.Embedding(self.N_ITEMS + 1, hidden)  # 0: no item
        self.pos_emb = nn.Embedding(self.MAX_LEN, hidden)
        self.cat_emb = nn.Embedding(self.N_CATS, cat_dim)
        self.type_emb = nn.Embedding(self.N_TYPES, type_dim)
        self.cat_proj = nn.Linear(cat_dim, hidden)
        self.type_proj = nn.Linear(type_dim, hidden)
        self.attn_norm = nn.LayerNorm(hidden)
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.ffn_norm = nn.LayerNorm(hidden)
        self.ffn = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
        self.last_norm = nn.LayerNorm(hidden)

    def log2feats(self, log_seqs, cat_seqs, type_seqs):
        seqs = self.item_emb(log_seqs) * self.item_emb.embedding_dim ** 0.5
        positions = torch.arange(log_seqs.shape[1], device=log_seqs.device).unsqueeze(0).expand_as(log_seqs)
        seqs = seqs + self.pos_emb(positions)
        seqs = seqs + self.cat_proj(self.cat_emb(cat_seqs)) + self.type_proj(self.type_emb(type_seqs))
        seqs = seqs * (log_seqs != 0).unsqueeze(-1)
        L = seqs.shape[1]
        future = ~torch.tril(torch.ones(L, L, dtype=torch.bool, device=seqs.device))
        q = self.attn_norm(seqs)
        scores = self.query(q) @ self.key(seqs).transpose(1, 2) / seqs.shape[-1] ** 0.5
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        seqs = q + weights @ self.value(seqs)
        seqs = seqs + self.ffn(self.ffn_norm(seqs))
        seqs = seqs * (log_seqs != 0).unsqueeze(-1)
        return self.last_norm(seqs)

    def forward(self, log_seqs, cat_seqs, type_seqs, pos_seqs, neg_seqs):
        feats = self.log2feats(log_seqs, cat_seqs, type_seqs)
        pos_logits = (feats * self.item_emb(pos_seqs)).sum(dim=-1)
        neg_logits = (feats * self.item_emb(neg_seqs)).sum(dim=-1)
        return pos_logits, neg_logits


def sasrec_inputs(seed, batch=8):
    g = _gen(seed)
    S, L = SASRec, SASRec.MAX_LEN
    log = torch.randint(1, S.N_ITEMS + 1, (batch, L), generator=g)
    lengths = torch.randint(1, L + 1, (batch,), generator=g)
    log[torch.arange(L)[None, :] < (L - lengths)[:, None]] = 0  # right-aligned, zero-padded on the left
    cats = torch.randint(0, S.N_CATS, (batch, L), generator=g)
    types = torch.randint(0, S.N_TYPES, (batch, L), generator=g)
    pos = torch.randint(1, S.N_ITEMS + 1, (batch, L), generator=g)  # the next items
    neg = torch.randint(1, S.N_ITEMS + 1, (batch, L), generator=g)  # sampled negatives
    return log, cats, types, pos, neg
