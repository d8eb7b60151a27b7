"""A DLRM-style click-through model written the plain way: no TorchRec, no fxrec.

Dense features go through a bottom MLP; 26 sparse features (Criteo-like cardinalities, scaled
down to fit a laptop) are looked up in a ModuleList of nn.EmbeddingBag; the pooled embeddings
and the dense vector interact by pairwise dot products; a top MLP gives the click logit.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch import nn

# Criteo Kaggle cardinalities, capped at 100k rows per table so the model fits anywhere.
CRITEO_ROWS = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
    14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]


def table_rows(cap: int = 100_000) -> List[int]:
    return [min(r, cap) for r in CRITEO_ROWS]


def mlp(sizes: List[int]) -> nn.Sequential:
    layers: List[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class DLRM(nn.Module):
    def __init__(self, rows: List[int] = None, dim: int = 64, dense_in: int = 13):
        super().__init__()
        rows = rows or table_rows()
        self.emb = nn.ModuleList([nn.EmbeddingBag(r, dim, mode="sum") for r in rows])
        self.bottom = mlp([dense_in, 256, 128, dim])
        n = len(rows) + 1
        self.top = mlp([dim + n * (n - 1) // 2, 256, 128, 1])

    def forward(self, dense: torch.Tensor, ids: List[torch.Tensor], offsets: List[torch.Tensor]) -> torch.Tensor:
        x = self.bottom(dense)
        pooled = [bag(i, o) for bag, i, o in zip(self.emb, ids, offsets)]
        feats = torch.stack([x] + pooled, dim=1)  # [B, 27, D]
        inter = torch.bmm(feats, feats.transpose(1, 2))
        li, lj = torch.tril_indices(feats.shape[1], feats.shape[1], offset=-1)
        z = torch.cat([x, inter[:, li, lj]], dim=1)
        return self.top(z).squeeze(1)


def make_batch(
    rows: List[int], batch: int = 512, ids_per_bag: int = 1, dense_in: int = 13, seed: int = 0
) -> Tuple[torch.Tensor, List[torch.Tensor], List[torch.Tensor]]:
    """Random inputs of the model's shape: one-hot (or fixed multi-hot) bags per feature."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.rand(batch, dense_in, generator=g)
    ids = [torch.randint(0, r, (batch * ids_per_bag,), generator=g) for r in rows]
    offsets = [torch.arange(0, batch * ids_per_bag, ids_per_bag) for _ in rows]
    return dense, ids, offsets
