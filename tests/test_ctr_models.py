"""CTR models written the way public repositories write them (not the styles fxrec was tuned on)."""

import numpy as np
import pytest
import torch
from torch import nn

import fxrec
from fxrec.testing import assert_matches, embedding_ops


class FeaturesEmbedding(nn.Module):
    """pytorch-fm style: one table, numpy field offsets, ids arrive as a [B, F] long tensor."""

    def __init__(self, field_dims, dim):
        super().__init__()
        self.embedding = nn.Embedding(sum(field_dims), dim)
        self.offsets = np.array((0, *np.cumsum(field_dims)[:-1]), dtype=np.int64)
        nn.init.xavier_uniform_(self.embedding.weight.data)

    def forward(self, x):
        x = x + x.new_tensor(self.offsets).unsqueeze(0)
        return self.embedding(x)


class DeepFM(nn.Module):
    def __init__(self, field_dims=(30, 40, 20, 10), dim=8):
        super().__init__()
        self.linear = FeaturesEmbedding(field_dims, 1)
        self.bias = nn.Parameter(torch.zeros(1))
        self.embedding = FeaturesEmbedding(field_dims, dim)
        self.mlp = nn.Sequential(nn.Linear(len(field_dims) * dim, 16), nn.ReLU(), nn.Dropout(0.0), nn.Linear(16, 1))
        self.embed_output_dim = len(field_dims) * dim

    def forward(self, x):
        embed_x = self.embedding(x)
        square_of_sum = torch.sum(embed_x, dim=1) ** 2
        sum_of_square = torch.sum(embed_x ** 2, dim=1)
        fm = 0.5 * torch.sum(square_of_sum - sum_of_square, dim=1, keepdim=True)
        lin = torch.sum(self.linear(x), dim=1) + self.bias
        return torch.sigmoid((lin + fm + self.mlp(embed_x.view(-1, self.embed_output_dim))).squeeze(1))


class DCNv2(nn.Module):
    """Dict of sparse features, an embedding per feature built in a loop, cross layers."""

    def __init__(self, vocab=None, dim=8, n_cross=2):
        super().__init__()
        self.vocab = vocab or {"user_id": 50, "item_id": 70, "cat": 12, "hour": 24}
        self.embs = nn.ModuleDict({k: nn.Embedding(v, dim) for k, v in self.vocab.items()})
        d = dim * len(self.vocab) + 3
        self.cross = nn.ModuleList([nn.Linear(d, d) for _ in range(n_cross)])
        self.out = nn.Linear(d, 1)

    def forward(self, features):
        sparse = [self.embs[k](features[k].squeeze(-1)) for k in self.vocab]
        x0 = torch.cat(sparse + [features["dense"]], dim=-1)
        x = x0
        for layer in self.cross:
            x = x0 * layer(x) + x
        return self.out(x)


class DIN(nn.Module):
    """Behaviour sequence and candidate share the item table; attention over the history."""

    def __init__(self, items=100, cats=10, dim=8):
        super().__init__()
        self.item = nn.Embedding(items, dim, padding_idx=0)
        self.cat = nn.Embedding(cats, dim, padding_idx=0)
        self.att = nn.Sequential(nn.Linear(4 * dim, 16), nn.Sigmoid(), nn.Linear(16, 1))
        self.out = nn.Linear(4 * dim, 1)

    def forward(self, hist_items, hist_cats, cand_item, cand_cat):
        hist = torch.cat([self.item(hist_items), self.cat(hist_cats)], -1)  # [B, L, 2D]
        cand = torch.cat([self.item(cand_item), self.cat(cand_cat)], -1)  # [B, 2D]
        q = cand.unsqueeze(1).expand_as(hist)
        w = self.att(torch.cat([q, hist * q], -1)).squeeze(-1)
        w = w.masked_fill(hist_items == 0, -1e9).softmax(-1)
        user = (w.unsqueeze(-1) * hist).sum(1)
        return self.out(torch.cat([user, cand], -1))


def deepfm_inputs(seed, batch=6):
    g = torch.Generator().manual_seed(seed)
    return (torch.stack([torch.randint(0, d, (batch,), generator=g) for d in (30, 40, 20, 10)], 1),)


def dcn_inputs(seed, batch=5):
    g = torch.Generator().manual_seed(seed)
    feats = {k: torch.randint(0, v, (batch, 1), generator=g) for k, v in {"user_id": 50, "item_id": 70, "cat": 12, "hour": 24}.items()}
    feats["dense"] = torch.rand(batch, 3, generator=g)
    return (feats,)


def din_inputs(seed, batch=4, length=5):
    g = torch.Generator().manual_seed(seed)
    hist = torch.randint(0, 100, (batch, length), generator=g)
    hist[:, :2] = 0
    return hist, torch.randint(0, 10, (batch, length), generator=g), torch.randint(1, 100, (batch,), generator=g), \
        torch.randint(1, 10, (batch,), generator=g)


@pytest.mark.parametrize("backend", ["fbgemm", "auto"])
@pytest.mark.parametrize("name,model_fn,inputs_fn", [
    ("deepfm", DeepFM, deepfm_inputs), ("dcnv2", DCNv2, dcn_inputs), ("din", DIN, din_inputs),
])
def test_real_style_ctr_models(name, model_fn, inputs_fn, backend):
    model = model_fn()
    fast = fxrec.transform(model, inputs_fn(0), backend=backend, verify=True, timing_rounds=1)
    assert len(fast.report.lookups) >= 2
    # every lookup lowered (DeepFM's dim-1 linear table too: stored padded to 4 columns)
    assert not fast.report.left_alone, fast.report
    assert not embedding_ops(fast)
    frag = fast.report.fragmentation  # the fewest groups: one per pooling kind / sequence dim
    assert frag.groups == frag.fewest == len(fast.report.groups), fast.report
    assert_matches(model, fast, inputs_fn(1), inputs_fn(2))


def test_din_trains_with_a_fused_optimizer_like_the_plain_model():
    import copy

    model = DIN()
    fast = fxrec.transform(model, din_inputs(0), optimizer=fxrec.optim.SGD(lr=0.1), backend="fbgemm")
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = fast.make_optimizer(torch.optim.SGD, lr=0.1)
    for s in range(5):
        x = din_inputs(s + 1)
        ref_opt.zero_grad()
        ref(*x).sum().backward()
        ref_opt.step()
        opt.zero_grad()
        fast(*x).sum().backward()
        opt.step()
    for (k, a), (_, b) in zip(ref.state_dict().items(), fast.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=k)
