"""Property-based: random models (tables, dims, pooling, shared tables, forms) match after transform."""

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st

import fxrec
from fxrec.testing import assert_matches

LOOKUP_KINDS = ["bag_sum", "bag_mean", "bag_weighted", "emb_single", "emb_sum", "emb_mean", "emb_seq"]


class RandomModel(torch.nn.Module):
    def __init__(self, tables, lookups):
        super().__init__()
        self.tables = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(r, d)) for r, d in tables])
        self.lookups = lookups  # (kind, table index)

    def forward(self, ids, offsets, weights):
        outs = []
        for k, (kind, t) in enumerate(self.lookups):
            w = self.tables[t]
            if kind.startswith("bag"):
                mode = "mean" if kind == "bag_mean" else "sum"
                psw = weights[k] if kind == "bag_weighted" else None
                outs.append(F.embedding_bag(ids[k], w, offsets[k], mode=mode, per_sample_weights=psw))
            elif kind == "emb_single":
                outs.append(F.embedding(ids[k][:, 0], w))
            elif kind == "emb_sum":
                outs.append(F.embedding(ids[k], w).sum(1))
            elif kind == "emb_mean":
                outs.append(F.embedding(ids[k], w).mean(1))
            else:
                outs.append(F.embedding(ids[k], w).flatten(1))
        return torch.cat(outs, 1)


def make_inputs(tables, lookups, batch, seed):
    g = torch.Generator().manual_seed(seed)
    ids, offsets, weights = [], [], []
    for kind, t in lookups:
        rows = tables[t][0]
        if kind.startswith("bag"):
            lengths = torch.randint(1, 4, (batch,), generator=g)
            n = int(lengths.sum())
            ids.append(torch.randint(0, rows, (n,), generator=g))
            offsets.append(torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]]))
            weights.append(torch.rand(n, generator=g))
        else:
            ids.append(torch.randint(0, rows, (batch, 3), generator=g))
            offsets.append(torch.zeros(1, dtype=torch.long))
            weights.append(torch.zeros(1))
    return ids, offsets, weights


@st.composite
def models(draw):
    n_tables = draw(st.integers(1, 4))
    tables = [(draw(st.integers(2, 30)), draw(st.sampled_from([3, 4, 6, 8, 12, 16]))) for _ in range(n_tables)]
    n_lookups = draw(st.integers(1, 5))
    lookups = [(draw(st.sampled_from(LOOKUP_KINDS)), draw(st.integers(0, n_tables - 1))) for _ in range(n_lookups)]
    return tables, lookups, draw(st.sampled_from(["fbgemm", "loop"]))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(models(), st.integers(2, 5), st.integers(0, 1000))
def test_random_models_match_plain(spec, batch, seed):
    tables, lookups, backend = spec
    torch.manual_seed(seed)
    model = RandomModel(tables, lookups)
    inputs = make_inputs(tables, lookups, batch, seed)
    fast = fxrec.transform(model, inputs, backend=backend)
    lowerable = sum(1 for kind, t in lookups if tables[t][1] % 4 == 0)
    assert len(fast.report.lookups) == len(lookups)
    # every lookup on a dim that fbgemm takes is lowered, unless its table is owned by a group
    # of another kind (reported with that reason)
    for e in fast.report.left_alone:
        assert "multiple of 4" in e.reason or "already batched" in e.reason or "batched in" in e.reason, e.reason
    assert len(fast.report.lowered) <= lowerable
    # another batch, with empty bags this time
    other = make_inputs(tables, lookups, batch + 2, seed + 1)
    for k, (kind, _) in enumerate(lookups):
        if kind.startswith("bag"):
            other[1][k][1] = other[1][k][0]  # bag 0 empty
    assert_matches(model, fast, inputs, other)
