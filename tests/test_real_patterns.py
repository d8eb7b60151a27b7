"""Batch every lookup of real models: the patterns of tests/real_models.py, on every backend.

For each model, with the default backend, ``backend="fbgemm"`` (the GPU's lowering, run on CPU)
and ``backend="reference"``:

* no lookup is left as plain PyTorch (every report entry has a group);
* the lookups are in the fewest groups: one per pooling kind the model uses (sum, mean) plus, for
  unpooled (sequence) lookups, one per dim rounded up to a multiple of 4 (the expected number and
  the reason are written next to each model below);
* outputs and gradients equal the plain model's (``assert_matches``, the tolerance
  ``verify=True`` and tests/test_ctr_models.py use);
* ten training steps with each fused optimizer (SGD, Adagrad, row-wise Adagrad) give the tables
  and dense weights (plain SGD) of the plain model trained with torch.optim (row-wise Adagrad: the independent
  reference of tests/test_fused_optimizers.py, which averages ``g**2`` over the row's real dim),
  and the update is fused into backward;
* ``state_dict()`` has the plain model's keys, shapes and values.
"""

import copy
import functools
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import fxrec
from fxrec.testing import assert_matches
from tests import real_models as R
from tests.test_fused_optimizers import RowWiseAdagradReference


@dataclass(frozen=True)
class Pattern:
    model: Callable[[], nn.Module]
    inputs: Callable[..., tuple]  # (seed, batch=...) -> positional inputs
    groups: int  # the fewest groups, worked out by hand
    why: str


PATTERNS = {
    # a. FM family
    "a-deepfm-linear-dim1": Pattern(
        R.DeepFM, R.deepfm_inputs, 2,
        "sum: the dim-1 linear table summed over fields; sequence 12: the [B, F, 10] field embedding (10 -> 12)"),
    "a-wdl-linear-dim1": Pattern(
        R.WideDeep, R.wdl_inputs, 1,
        "sum: the dim-1 wide table summed over fields and the four dim-8 single-id deep tables"),
    "a-ffm-linear-dim1": Pattern(
        R.FieldAwareFM, R.ffm_inputs, 2,
        "sum: the dim-1 linear table summed over fields; sequence 8: the three [B, F, 8] field-aware tables"),
    # b. per-feature auto dims 6, 7, 9, 13, 102 (single ids) and 14 (a mean bag)
    "b-dcn-auto-dims": Pattern(
        R.DCN, R.dcn_inputs, 1,
        "mean: the dim-14 genres bag, and the single-id tables of dims 6, 7, 9, 13, 102 (one id is its own mean)"),
    # c. history and target share the item and category tables
    "c-din-shared-history-target": Pattern(
        R.DIN, R.din_inputs, 2,
        "sequence 8: item and category tables, history [B, L] and target [B] alike; sum: the user profile"),
    # d. the user tower mean-pools over the item tower's table
    "d-two-tower-emb-mean": Pattern(
        lambda: R.TwoTower("emb_mean"), functools.partial(R.two_tower_inputs, "emb_mean"), 2,
        "mean: the history over item_emb and (one id is its own mean) the item tower's item_emb lookup; "
        "sum: user id, tags bag, category"),
    "d-two-tower-bag-mean": Pattern(
        lambda: R.TwoTower("bag_mean"), functools.partial(R.two_tower_inputs, "bag_mean"), 2,
        "mean: the embedding_bag history over item_emb and the item tower's item_emb lookup; "
        "sum: user id, tags bag, category"),
    # e. user tables read a second time for the batch size
    "e-esmm-batch-size-lookups": Pattern(
        R.ESMM, R.esmm_inputs, 1, "sum: every table is single-id (the batch-size lookups included)"),
    # f. quotient-remainder tables
    "f-qr-embeddings": Pattern(
        R.QRModel, R.qr_inputs, 1, "sum: quotient, remainder and city tables are all single-id"),
    # g. dead lookups, a repeated identical lookup
    "g-dead-and-repeated-lookups": Pattern(
        R.DeadAndRepeated, R.dead_inputs, 1, "sum: every lookup (dead, repeated or not) is single-id"),
    # h. SASRec, dim 7
    "h-sasrec-dim7": Pattern(
        R.SASRec, R.sasrec_inputs, 2,
        "sequence 8: item (log, pos, neg) and position tables of dim 7 and the dim-5 category table; "
        "sequence 12: the dim-10 action-type table"),
}

BACKENDS = {"default": {}, "fbgemm": {"backend": "fbgemm"}, "reference": {"backend": "reference"}}

# eps=1e-3 for the Adagrads: with the default eps a row's first update is lr * g / (|g| + 1e-10), which
# for a gradient of rounding size (~1e-9, from cancellation in the towers) turns the last bits of g
# into differences of 1e-4 in the weight. A larger eps keeps the update a smooth function of g; the
# real-dim average of row-wise Adagrad (g**2 summed over 7 columns divided by 7, not 8) still
# changes the result by several percent.
OPTIMIZERS = {
    "sgd": (lambda: fxrec.optim.SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    "adagrad": (lambda: fxrec.optim.Adagrad(lr=0.1, eps=1e-3), lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-3)),
    "rowwise_adagrad": (lambda: fxrec.optim.RowWiseAdagrad(lr=0.1, eps=1e-3),
                        lambda p: RowWiseAdagradReference(p, lr=0.1, eps=1e-3)),
}

pattern_ids = pytest.mark.parametrize("name", list(PATTERNS))
backend_ids = pytest.mark.parametrize("backend", list(BACKENDS))


def _plain(name: str) -> nn.Module:
    torch.manual_seed(0)
    return PATTERNS[name].model()


@functools.lru_cache(maxsize=None)
def _transformed(name: str, backend: str):
    """(plain model, transformed model) without an optimizer; shared by the tests that only read."""
    model = _plain(name)
    return model, fxrec.transform(model, PATTERNS[name].inputs(0), **BACKENDS[backend])


def _loss(out, seed: int) -> torch.Tensor:
    """A fixed random weighting of every output (the same in both models): gradients stay
    bounded, so ten steps do not blow rounding differences up."""
    g = torch.Generator().manual_seed(seed)
    leaves = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    return sum((x * torch.randn(x.shape, generator=g)).sum() / x.shape[0] for x in leaves)  # mean over the batch


def _table_names(model: nn.Module):
    return {f"{m_name}.weight" for m_name, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}


@pattern_ids
@backend_ids
def test_no_lookup_is_left_plain(name, backend):
    _, fast = _transformed(name, backend)
    report = fast.report
    plain = [(e.table, e.feature, e.reason) for e in report.lookups if e.group is None]
    assert not plain, f"lookups left as plain PyTorch: {plain}\n{report}"
    kept = [(e.table, e.feature) for e in report.left_alone]
    assert not kept, f"lookups in groups kept plain: {kept}\n{report}"


@pattern_ids
@backend_ids
def test_fewest_groups(name, backend):
    _, fast = _transformed(name, backend)
    p = PATTERNS[name]
    got = len(fast.report.groups)
    assert got == p.groups, f"{got} groups, expected {p.groups} ({p.why})\n{fast.report}"


@pattern_ids
@backend_ids
def test_outputs_and_gradients_match_plain(name, backend):
    model, fast = _transformed(name, backend)
    inputs = PATTERNS[name].inputs
    assert_matches(model, fast, inputs(0), inputs(1), inputs(2, batch=5), inputs(3, batch=3))


@pattern_ids
@backend_ids
def test_state_dict_is_the_plain_models(name, backend):
    model, fast = _transformed(name, backend)
    want, got = model.state_dict(), fast.state_dict()
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].shape == v.shape, f"{k}: {tuple(got[k].shape)} != {tuple(v.shape)}"
        assert torch.equal(got[k], v), k


@pattern_ids
def test_fbgemm_backend_runs_every_group_on_fbgemm(name):
    """backend="fbgemm" is the lowering a GPU gets: every group trains and infers on fbgemm's TBE
    (odd dims padded), nothing falls to another kernel."""
    _, fast = _transformed(name, "fbgemm")
    off = [(g.name, g.kernel_train, g.kernel_eval, g.why) for g in fast.report.groups
           if (g.kernel_train, g.kernel_eval) != ("fbgemm", "fbgemm")]
    assert not off, f"{off}\n{fast.report}"


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pattern_ids
@backend_ids
def test_ten_fused_steps_match_torch_optim(name, backend, opt):
    p = PATTERNS[name]
    fx_opt, torch_opt = OPTIMIZERS[opt]
    model = _plain(name)
    fast = fxrec.transform(model, p.inputs(0), optimizer=fx_opt(), **BACKENDS[backend])
    ref = copy.deepcopy(model)
    tables = _table_names(ref)
    # Dense weights take plain SGD: Adam would turn the rounding noise of gradients that are zero
    # in exact arithmetic (the bias before DIN's softmax, SASRec's key bias) into lr-sized steps.
    ref_opts = [torch_opt([q for n, q in ref.named_parameters() if n in tables]),
                torch.optim.SGD([q for n, q in ref.named_parameters() if n not in tables], lr=0.01)]
    opt_ = fast.make_optimizer(torch.optim.SGD, lr=0.01)
    for step in range(10):
        x = p.inputs(step + 1)
        for o in ref_opts:
            o.zero_grad()
        _loss(ref(*x), step).backward()
        for o in ref_opts:
            o.step()
        opt_.zero_grad()
        _loss(fast(*x), step).backward()
        opt_.step()
    got = fast.state_dict()
    assert sorted(got) == sorted(ref.state_dict())
    for k, a in ref.state_dict().items():
        torch.testing.assert_close(got[k], a, rtol=1e-5, atol=1e-5, msg=lambda m: f"{k} after 10 steps of {opt}: {m}")
    not_fused = [(g.name, g.optimizer) for g in fast.report.groups if not g.fused]
    assert not not_fused, f"{opt} not fused into backward: {not_fused}\n{fast.report}"


# --------------------------------------------------------------------------- tied weights
class TiedOutput(nn.Module):
    """SASRec-style: the item table is also the output layer's weight (scores over every item)."""

    def __init__(self):
        super().__init__()
        self.items = nn.Embedding(30, 8)
        self.out = nn.Linear(8, 30, bias=False)
        self.out.weight = self.items.weight
        self.mix = nn.Linear(8, 8)

    def forward(self, seq):
        return self.out(self.mix(self.items(seq).mean(1)))


class TiedTables(nn.Module):
    """Two features read one table through two modules that share its weight."""

    def __init__(self):
        super().__init__()
        self.query = nn.Embedding(30, 8)
        self.doc = nn.Embedding(30, 8)
        self.doc.weight = self.query.weight
        self.mix = nn.Linear(16, 1)

    def forward(self, q, d):
        return self.mix(torch.cat([self.query(q).mean(1), self.doc(d).sum(1)], 1))


def _tied_inputs(cls, seed):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, 30, (4, 3), generator=g)
    return (seq,) if cls is TiedOutput else (seq, torch.randint(0, 30, (4, 2), generator=g))


@pytest.mark.parametrize("cls", [TiedOutput, TiedTables])
@pytest.mark.parametrize("table_opt, torch_opt", [
    (lambda: fxrec.optim.Adagrad(lr=0.1), lambda ps: torch.optim.Adagrad(ps, lr=0.1)),
    (lambda: {"query": fxrec.optim.Adam(lr=0.01), "items.weight": fxrec.optim.Adam(lr=0.01)},
     lambda ps: torch.optim.Adam(ps, lr=0.01)),
], ids=["adagrad", "adam-by-name"])
def test_a_tied_table_trains_with_the_table_optimizer_under_its_own_name(cls, table_opt, torch_opt):
    """torch.export reads a tied weight by each module's name: fxrec made two tables of it, named after
    the alias state_dict and optimizer= do not use, and make_optimizer gave it to the dense optimizer."""
    torch.manual_seed(0)
    model = cls()
    table = "items" if cls is TiedOutput else "query"
    opt_arg = table_opt()
    if isinstance(opt_arg, dict):
        opt_arg = {k: v for k, v in opt_arg.items() if k.split(".")[0] == table}
    fast = fxrec.transform(model, _tied_inputs(cls, 0), optimizer=opt_arg)
    assert {r.table for r in fast.report.lookups} == {table}  # one table, by the name named_parameters() gives
    dense = [p for n, p in model.named_parameters() if not n.startswith(table)]
    ref_opts = [torch_opt([getattr(model, table).weight]), torch.optim.SGD(dense, lr=0.05)]
    opt = fast.make_optimizer(torch.optim.SGD, lr=0.05)
    for step in range(3):
        x = _tied_inputs(cls, step + 1)
        model(*x).square().sum().backward()
        fast(*x).square().sum().backward()
        for o in ref_opts:
            o.step(), o.zero_grad()
        opt.step(), opt.zero_grad()
    torch.testing.assert_close(fast.state_dict()[f"{table}.weight"], getattr(model, table).weight)
    torch.testing.assert_close(fast.state_dict()["mix.weight"], model.mix.weight)
