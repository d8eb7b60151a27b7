"""Random models against the plain PyTorch model, on every backend (the reliability fuzz).

Each example draws tables (dims that fbgemm takes and dims it does not), lookups of every form
(bags with sum / mean / per-sample weights / include_last_offset / 2-D ids, one id per row, [B, L]
ids pooled by hand, sequences), tables shared by several lookups, and the order in which the
lookups are concatenated, and where in forward each lookup is made (some after the dense part has
read the others, so a table is read at several places). Dims run from 1 to 16, multiples of 4 or
not (the kernels that need a multiple of 4 pad the tables they store). One model per example is
transformed on every backend and must give the plain model's outputs and gradients at batch sizes
1, 2, 5 and 8 (the example batch is 3), with and without autograd; and, with an embedding
optimizer per table (SGD, Adagrad or row-wise Adagrad), three training steps must give
torch.optim's tables.

CI runs a fixed set of 40 examples per test (``derandomize``) in about a minute and a half.
``FXREC_FUZZ_EXAMPLES=300 pytest tests/test_random_models.py`` runs more, with fresh random ones.
"""

import copy
import os

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings, strategies as st

import fxrec
from fxrec.testing import assert_matches
from tests.test_fused_optimizers import RowWiseAdagradReference

LOOKUP_KINDS = ["bag_sum", "bag_mean", "bag_weighted", "bag_last", "bag_2d", "emb_single", "emb_sum", "emb_mean",
                "emb_seq"]
BACKENDS = ["fbgemm", "native", "reference", "auto"]
_MORE = int(os.environ.get("FXREC_FUZZ_EXAMPLES", "0"))


def _settings(n: int):
    return settings(max_examples=_MORE or n, deadline=None, derandomize=not _MORE, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class RandomModel(torch.nn.Module):
    def __init__(self, tables, lookups, order, stages=None):
        super().__init__()
        self.tables = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(r, d)) for r, d in tables])
        self.lookups = lookups  # (kind, table index)
        self.order = order  # the order the lookups are concatenated in
        # Where in forward each lookup is made (0 for all when not given): the stage-0 lookups, then
        # the dense part reads their outputs, then the stage-1 lookups with their ids made only
        # there (``ids % rows``: the same ids). A table looked up in both stages is read before and
        # after computations that use its rows, as real models read a shared table.
        self.stages = list(stages) if stages is not None else [0] * len(lookups)
        self.rows = [r for r, _ in tables]
        self.dense = torch.nn.Linear(2, 3)

    def forward(self, dense, ids, offsets, weights):
        outs = {}
        h = self.dense(dense)
        for stage in (0, 1):
            if stage == 1 and outs and 1 in self.stages:
                h = h * torch.sigmoid(sum(o.sum(1, keepdim=True) for o in outs.values()))
            for k, (kind, t) in enumerate(self.lookups):
                if self.stages[k] != stage:
                    continue
                w = self.tables[t]
                x = ids[k] % self.rows[t] if stage == 1 else ids[k]
                if kind == "bag_2d":
                    outs[k] = F.embedding_bag(x, w, mode="sum")
                elif kind.startswith("bag"):
                    mode = "mean" if kind == "bag_mean" else "sum"
                    psw = weights[k] if kind == "bag_weighted" else None
                    outs[k] = F.embedding_bag(x, w, offsets[k], mode=mode, per_sample_weights=psw,
                                              include_last_offset=kind == "bag_last")
                elif kind == "emb_single":
                    outs[k] = F.embedding(x[:, 0], w)
                elif kind == "emb_sum":
                    outs[k] = F.embedding(x, w).sum(1)
                elif kind == "emb_mean":
                    outs[k] = F.embedding(x, w).mean(1)
                else:
                    outs[k] = F.embedding(x, w).flatten(1)
        return torch.cat([h] + [outs[i] for i in self.order], 1)


def make_inputs(tables, lookups, batch, seed, empty_first_bag=False):
    g = torch.Generator().manual_seed(seed)
    ids, offsets, weights = [], [], []
    for kind, t in lookups:
        rows = tables[t][0]
        if kind.startswith("bag") and kind != "bag_2d":
            lengths = torch.randint(1, 4, (batch,), generator=g)
            if empty_first_bag:
                lengths[0] = 0
            n = int(lengths.sum())
            ids.append(torch.randint(0, rows, (n,), generator=g))
            starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
            offsets.append(starts if kind == "bag_last" else starts[:-1])
            weights.append(torch.rand(n, generator=g))
        else:
            ids.append(torch.randint(0, rows, (batch, 3), generator=g))
            offsets.append(torch.zeros(1, dtype=torch.long))
            weights.append(torch.zeros(1))
    return torch.rand(batch, 2, generator=g), ids, offsets, weights


# Dims fbgemm's TBE stores as they are and dims it must pad (1, 2, 3, 5, 6, 7, 10, 13: the dim-1
# linear parts of FM models, auto dims like 6 * vocab ** 0.25, odd sequence dims).
DIMS = [1, 2, 3, 4, 5, 6, 7, 8, 8, 10, 12, 13, 16]


@st.composite
def models(draw):
    """Tables, lookups (kind, table), the concatenation order and each lookup's stage in forward;
    half the lookups share one kind, so that groups of several tables, and tables looked up several
    times in one group, are common; lookups at stage 1 are made after the dense part has read the
    others (a table shared by both stages is read at several places)."""
    n_tables = draw(st.integers(1, 4))
    tables = [(draw(st.integers(2, 30)), draw(st.sampled_from(DIMS))) for _ in range(n_tables)]
    n_lookups = draw(st.integers(1, 6))
    base = draw(st.sampled_from(LOOKUP_KINDS))
    lookups = [(draw(st.one_of(st.just(base), st.sampled_from(LOOKUP_KINDS))), draw(st.integers(0, n_tables - 1)))
               for _ in range(n_lookups)]
    order = draw(st.permutations(range(n_lookups)))
    stages = draw(st.lists(st.integers(0, 1), min_size=n_lookups, max_size=n_lookups))
    return tables, lookups, order, stages


def _unpack(spec):
    """(tables, lookups, order, stages) from a drawn spec or an explicit example (no stages: all 0)."""
    tables, lookups, order, *rest = spec
    return tables, lookups, order, (rest[0] if rest else [0] * len(lookups))


optimizer_kinds = st.one_of(st.sampled_from(["sgd", "adagrad", "rowwise_adagrad"]).map(lambda k: [k] * 4),
                            st.lists(st.sampled_from(["sgd", "adagrad", "rowwise_adagrad"]), min_size=4, max_size=4))


@_settings(40)
@given(models(), st.integers(0, 1000))
# a DIN-like table read by a sequence and, later, by one id per row, beside a dim-1 linear part
@example(([(10, 7), (12, 1)], [("emb_seq", 0), ("emb_sum", 1), ("emb_single", 0)], [0, 1, 2], [0, 0, 1]), 0)
def test_random_models_match_plain_on_every_backend(spec, seed):
    tables, lookups, order, stages = _unpack(spec)
    torch.manual_seed(seed)
    model = RandomModel(tables, lookups, order, stages)
    example = make_inputs(tables, lookups, 3, seed)
    others = [make_inputs(tables, lookups, b, seed + b, empty_first_bag=b > 1) for b in (1, 2, 5, 8)]
    for backend in BACKENDS:
        fast = fxrec.transform(model, example, backend=backend, timing_rounds=1)
        assert len(fast.report.lookups) == len(lookups)
        for e in fast.report.left_alone:  # only what fbgemm cannot take, with the reason
            assert "multiple of 4" in e.reason or "already batched" in e.reason or "batched in" in e.reason \
                or e.group is not None, e.reason
        assert_matches(model, fast, example, *others)
        with torch.no_grad():
            for x in others:
                torch.testing.assert_close(fast(*x), model(*x), rtol=1.3e-6, atol=1e-5, msg=backend)


_OPTIMIZERS = {
    "sgd": (lambda: fxrec.optim.SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    "adagrad": (lambda: fxrec.optim.Adagrad(lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1)),
    "rowwise_adagrad": (lambda: fxrec.optim.RowWiseAdagrad(lr=0.1), lambda p: RowWiseAdagradReference(p, lr=0.1)),
}


@_settings(40)
@given(models(), optimizer_kinds, st.integers(0, 1000), st.sampled_from(BACKENDS))
# the cases of the reliability issue: a table's features apart in a pooled group (fbgemm's fused
# Adagrad wrong, row-wise Adagrad raising) and in a sequence group
@example(([(10, 4), (12, 4)], [("bag_sum", 0), ("bag_sum", 1), ("bag_sum", 0)], [0, 1, 2]), ["adagrad"] * 4, 0, "fbgemm")
@example(([(10, 4), (12, 4)], [("bag_sum", 0), ("bag_sum", 1), ("bag_sum", 0)], [0, 1, 2]), ["rowwise_adagrad"] * 4, 0,
         "auto")
@example(([(2, 3), (2, 3), (2, 4), (2, 4)], [("emb_seq", 0), ("emb_seq", 2), ("emb_seq", 3), ("emb_seq", 2)],
          [0, 1, 2, 3]), ["sgd"] * 4, 0, "fbgemm")
# odd dims read at two places in forward: a sequence table of dim 7 (history, then target) and a
# mean bag of dim 6 whose table is also read by one id per row
@example(([(10, 7), (12, 6)], [("emb_seq", 0), ("bag_mean", 1), ("emb_single", 0), ("emb_single", 1)],
          [0, 1, 2, 3], [0, 0, 1, 1]), ["rowwise_adagrad"] * 4, 0, "fbgemm")
@example(([(10, 7), (12, 6)], [("emb_seq", 0), ("bag_mean", 1), ("emb_single", 0), ("emb_single", 1)],
          [0, 1, 2, 3], [0, 0, 1, 1]), ["adagrad"] * 4, 0, "auto")
def test_random_models_train_as_torch_optim(spec, kinds, seed, backend):
    """Per-table fused optimizers (or their fallbacks) over three steps equal torch.optim on the
    plain model, whatever the order of the features and however tables are shared."""
    tables, lookups, order, stages = _unpack(spec)
    torch.manual_seed(seed)
    model = RandomModel(tables, lookups, order, stages)
    used = sorted({t for _, t in lookups})
    per_table = {f"tables.{t}": _OPTIMIZERS[kinds[t]][0]() for t in used}
    fast = fxrec.transform(model, make_inputs(tables, lookups, 3, seed), optimizer=per_table, backend=backend,
                           timing_rounds=1)
    ref = copy.deepcopy(model)
    ref_opts = [_OPTIMIZERS[kinds[t]][1]([ref.tables[t]]) for t in used]
    ref_opts.append(torch.optim.SGD(ref.dense.parameters(), lr=0.1))
    opt = fast.make_optimizer(torch.optim.SGD, lr=0.1)
    for step in range(3):
        x = make_inputs(tables, lookups, 4, seed + 10 + step)
        cot = torch.randn(model(*x).shape, generator=torch.Generator().manual_seed(step))
        for o in ref_opts:
            o.zero_grad()
        (ref(*x) * cot).sum().backward()
        for o in ref_opts:
            o.step()
        opt.zero_grad()
        (fast(*x) * cot).sum().backward()
        opt.step()
        got = fast.state_dict()
        assert set(got) == set(ref.state_dict())
        for k, a in ref.state_dict().items():
            torch.testing.assert_close(got[k], a, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{k} after step {step} ({backend}, {kinds}): {m}")
