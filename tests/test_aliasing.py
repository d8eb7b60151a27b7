"""What a model may do with its lookups' outputs and inputs, as in plain PyTorch: change an
output in place (``a += b``, ``a.mul_(2)``, ``torch.cat([a, b]).clamp_()``), change its ids in
place after a lookup read them, and read an output as a contiguous tensor (``.view``). Each is
compared with the plain model, on every backend, forward and (where PyTorch's own backward
allows it) gradients."""

import copy

import pytest
import torch
from torch import nn

import fxrec

BACKENDS = ["auto", "reference", "fbgemm", "native"]


def _kw(backend):
    return {} if backend == "auto" else {"backend": backend}


def ids_offsets(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 29, (7,), generator=g), torch.tensor([0, 2, 2, 5])


def check(model, x, backend, grads=True, **kw):
    """The transformed model's outputs (and gradients of the tables) equal the plain model's, on
    fresh copies of the inputs (a model that writes its inputs gets its own): bit for bit, but
    on fbgemm's TBE, whose fp32 sums are PyTorch's to rounding."""
    plain = copy.deepcopy(model)
    fast = fxrec.transform(model, tuple(t.clone() for t in x), **_kw(backend), **kw)
    for seed in (1, 2):
        batch = ids_offsets(seed)[:len(x)] if len(x) == 2 else x
        want = plain(*(t.clone() for t in batch))
        got = fast(*(t.clone() for t in batch))
        want, got = (want,) if torch.is_tensor(want) else want, (got,) if torch.is_tensor(got) else got
        for w, g in zip(want, got):
            if backend == "fbgemm":
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
            else:
                assert torch.equal(w, g), (w - g).abs().max()
        if grads and torch.is_grad_enabled() and kw.get("mode") != "inference":
            sum(w.sum() * (i + 1) for i, w in enumerate(want)).backward()
            sum(g.sum() * (i + 1) for i, g in enumerate(got)).backward()
            pg, fg = dict(plain.named_parameters()), dict(fast.named_parameters())
            for name, p in pg.items():
                torch.testing.assert_close(fg[name].grad, p.grad, msg=name)
                p.grad = None
                fg[name].grad = None


class AddInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.user, self.item = nn.EmbeddingBag(30, 4), nn.EmbeddingBag(30, 4)

    def forward(self, ids, offsets):
        a = self.user(ids, offsets)
        a += self.item(ids, offsets)
        return a


class ScaleInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.EmbeddingBag(30, 4)

    def forward(self, ids, offsets):
        a = self.e(ids, offsets)
        a.mul_(2)
        return a


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", [AddInPlace, ScaleInPlace])
def test_a_lookup_output_changed_in_place_gives_the_plain_models_outputs_and_gradients(model, backend):
    """(It failed in autograd: the lookups' outputs were views of one split of the group's output.)"""
    torch.manual_seed(0)
    check(model(), ids_offsets(), backend)
    with torch.no_grad():
        check(model(), ids_offsets(), backend)


class ClampedConcat(nn.Module):
    def __init__(self):
        super().__init__()
        self.user, self.item = nn.EmbeddingBag(30, 4), nn.EmbeddingBag(30, 4)

    def forward(self, ids, offsets):
        a, b = self.user(ids, offsets), self.item(ids, offsets)
        both = torch.cat([a, b], 1)
        both.clamp_(min=0)  # a and b are other tensors than their concatenation
        return both, a + b


class ConcatThenScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.user, self.item = nn.EmbeddingBag(30, 4), nn.EmbeddingBag(30, 4)

    def forward(self, ids, offsets):
        a, b = self.user(ids, offsets), self.item(ids, offsets)
        c = torch.cat([a, b], 1)
        a.mul_(2)  # after the concatenation copied it
        return c, a


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", [ClampedConcat, ConcatThenScale])
@pytest.mark.parametrize("mode", ["training", "inference"])
def test_a_concatenation_of_lookups_and_the_lookups_stay_separate_tensors(model, backend, mode):
    """(fold_concat made the concatenation the group's output and the lookups its slices: a write
    to one changed the other, up to 2.7 apart, silently.)"""
    torch.manual_seed(0)
    m = model()
    if mode == "inference":
        m.eval()
        with torch.no_grad():
            check(m, ids_offsets(), backend, mode="inference")
    else:
        check(m, ids_offsets(), backend)


class ShiftIdsBetween(nn.Module):
    def __init__(self):
        super().__init__()
        self.e, self.f = nn.EmbeddingBag(30, 4), nn.EmbeddingBag(30, 4)

    def forward(self, ids, offsets):
        a = self.e(ids, offsets)  # the ids as given
        ids.add_(1)
        b = self.f(ids, offsets)  # the ids shifted
        return torch.cat([a, b], 1)


class ClampIdsAfter(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(30, 4)
        self.lin = nn.Linear(4, 1)

    def forward(self, ids, offsets):
        a = self.e(ids)  # read before the write below, used after it
        ids.clamp_(max=9)
        return self.lin(a), ids


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", [ShiftIdsBetween, ClampIdsAfter])
def test_ids_written_in_place_after_a_lookup_read_them_are_read_as_they_were(model, backend):
    """(The group's call was placed before its output's first user, after the write: the lookup
    read the changed ids, up to 1.4 apart, silently.) Without gradients: PyTorch's own backward
    refuses ids changed after a lookup saved them."""
    torch.manual_seed(0)
    m = model().eval()
    with torch.no_grad():
        check(m, ids_offsets(), backend, mode="inference")
    check(model(), ids_offsets(), backend, grads=False)  # (training mode: the forward)


class FieldsFlattened(nn.Module):
    """DeepFM's field embeddings, flattened with ``view`` (PyTorch's output is contiguous)."""

    def __init__(self, dim):
        super().__init__()
        self.emb = nn.Embedding(50, dim)
        self.mlp = nn.Linear(3 * dim, 1)

    def forward(self, fields):
        return self.mlp(self.emb(fields).view(fields.shape[0], -1))


@pytest.mark.parametrize("kw", [dict(backend="fbgemm"), dict(optimizer=fxrec.optim.Adagrad(lr=0.1)),
                                dict(backend="fbgemm", optimizer=fxrec.optim.SGD(lr=0.1)),
                                dict(backend="fbgemm", mode="inference")], ids=["fbgemm", "adagrad", "fused_sgd", "inference"])
@pytest.mark.parametrize("dim", [5, 8])
def test_unpooled_rows_of_a_padded_table_are_contiguous_as_pytorchs(dim, kw):
    """A dim that is not a multiple of 4 is stored padded in fbgemm's TBE: the rows handed back
    are contiguous, as PyTorch's, so the model's ``view`` works (it failed)."""
    torch.manual_seed(0)
    model = FieldsFlattened(dim)
    fields = torch.randint(0, 50, (4, 3))
    fast = fxrec.transform(copy.deepcopy(model), (fields,), **kw)
    x = torch.randint(0, 50, (6, 3))
    torch.testing.assert_close(fast(x), model(x))


class BagFlattened(nn.Module):
    """A bag read with ``view`` beside another bag of its group (PyTorch's output is contiguous);
    ``view=False``: the same model with ``reshape``, which copies where it must."""

    def __init__(self, view=True):
        super().__init__()
        self.user, self.item = nn.EmbeddingBag(30, 4), nn.EmbeddingBag(30, 4)
        self.view = view

    def flat(self, t, *shape):
        return t.view(*shape) if self.view else t.reshape(*shape)

    def forward(self, ids, offsets):
        a, b = self.user(ids, offsets), self.item(ids, offsets)
        return a + self.flat(self.flat(b, -1), -1, 4)


class BagsViewedThroughViews(BagFlattened):
    """``view`` after other views, ``view_as``, after ``.contiguous()`` (the capture drops it: the
    tensor was contiguous), in a ``torch.no_grad()`` block, and of a concatenation of part of a
    group; lookups returned as they are."""

    def __init__(self, view=True):
        super().__init__(view)
        self.third = nn.EmbeddingBag(30, 4)

    def forward(self, ids, offsets):
        a, b, c = self.user(ids, offsets), self.item(ids, offsets), self.third(ids, offsets)
        with torch.no_grad():
            n = self.flat(c, -1).norm()
        x = self.flat(a.unsqueeze(1), -1) + self.flat(b.contiguous(), -1)
        x = x + self.flat(c.view_as(b) if self.view else c.reshape_as(b), -1)
        return x * n, self.flat(torch.cat([a, b], 1), -1), a, c


VIEWED = [BagFlattened, BagsViewedThroughViews]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", VIEWED)
def test_a_lookup_output_read_with_view_gives_the_plain_models_outputs_and_gradients(model, backend):
    """(The users were given column slices of the group's output, which ``view`` refuses: "view
    size is not compatible with input tensor's size and stride", on every backend.) A lookup
    returned is contiguous too, as PyTorch's."""
    torch.manual_seed(0)
    check(model(), ids_offsets(), backend)
    with torch.no_grad():
        check(model().eval(), ids_offsets(), backend, mode="inference")
    fast = fxrec.transform(model(), ids_offsets(), **_kw(backend))
    got = fast(*ids_offsets(1))
    assert all(t.is_contiguous() for t in ((got,) if torch.is_tensor(got) else got))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", VIEWED)
def test_a_lookup_output_read_with_view_trains_with_a_fused_optimizer_as_the_plain_model(model, backend):
    """Fused SGD (where the backend fuses it): the outputs and the tables after two steps are
    PyTorch's with torch.optim.SGD."""
    torch.manual_seed(0)
    plain = model()
    fast = fxrec.transform(copy.deepcopy(plain), ids_offsets(), optimizer=fxrec.optim.SGD(lr=0.1), **_kw(backend))
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    fast_opt = fxrec.make_optimizer(fast, torch.optim.SGD, lr=0.1)
    for seed in (1, 2):
        want, got = ((t,) if torch.is_tensor(t) else t for t in (plain(*ids_offsets(seed)), fast(*ids_offsets(seed))))
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
        opt.zero_grad()
        sum(w.square().sum() for w in want).backward()
        opt.step()
        fast_opt.zero_grad()
        sum(g.square().sum() for g in got).backward()
        fast_opt.step()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(fast.get_parameter(name), p, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("model", VIEWED)
def test_a_quantized_lookup_output_read_with_view_is_the_same_model_with_reshape(model):
    """int8 tables (inference): the model with ``view`` gives what the model with ``reshape``
    gives, bit for bit, and the plain model's outputs to int8's rounding. (transform raised:
    measure_quantization runs the model.)"""
    torch.manual_seed(0)
    plain = model().eval()
    twin = model(view=False).eval()
    twin.load_state_dict(plain.state_dict())
    fast, fast_twin = (fxrec.transform(copy.deepcopy(m), ids_offsets(), mode="inference", quantize="int8")
                       for m in (plain, twin))
    with torch.no_grad():
        for seed in (1, 2):
            want, got, same = plain(*ids_offsets(seed)), fast(*ids_offsets(seed)), fast_twin(*ids_offsets(seed))
            want, got, same = ((t,) if torch.is_tensor(t) else t for t in (want, got, same))
            for w, g, s in zip(want, got, same):
                torch.testing.assert_close(g, s, rtol=0, atol=0)
                torch.testing.assert_close(g, w, rtol=0, atol=0.05)


# --------------------------------------------------------------------------- sharded
class AddInPlaceBags(nn.Module):
    def __init__(self):
        super().__init__()
        from tests.test_sharding import DIM, ROWS

        self.bags = nn.ModuleList([nn.EmbeddingBag(r, DIM) for r in ROWS[:2]])
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, DIM))  # (a parameter on every rank)

    def forward(self, ids, offsets):
        a = self.bags[0](ids[0], offsets[0])
        a += self.bags[1](ids[1], offsets[1])
        return a * self.scale


class ViewedBags(nn.Module):
    """Summed bags (a mean is divided by the bag's length after the output dist: a tensor of its
    own), one read with ``view``."""

    def __init__(self):
        super().__init__()
        from tests.test_sharding import DIM, ROWS

        self.bags = nn.ModuleList([nn.EmbeddingBag(r, DIM, mode="sum") for r in ROWS[:2]])
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, DIM))  # (a parameter on every rank)

    def forward(self, ids, offsets):
        a, b = self.bags[0](ids[0], offsets[0]), self.bags[1](ids[1], offsets[1])
        return (a + b.view(-1).view_as(a)) * self.scale


def _sharded_bags_trained(rank, world, init_file, model_cls):
    import os

    import torch.distributed as dist

    from tests.test_sharding import LOCAL_B, global_batch, gloo_group, local_batch

    def sparse(x):
        return x[1][:2], x[2][:2]

    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = model_cls()
        ref = copy.deepcopy(model)
        plan = fxrec.plan(model, sparse(global_batch(LOCAL_B * world, 0)), world_size=world, memory_per_rank="1GB",
                          pins={"bags.0": ("table_wise", 1), "bags.1": ("table_wise", 1)}, batch_size=LOCAL_B)  # (one rank: one split)
        fast = fxrec.transform(model, sparse(local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)), plan=plan)
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (fast, ref))
        mine = slice(rank * LOCAL_B, (rank + 1) * LOCAL_B)
        for step in range(3):
            x = global_batch(LOCAL_B * world, step + 1)
            want, got = ref(*sparse(x)), fast(*sparse(local_batch(x, rank, LOCAL_B)))
            torch.testing.assert_close(got, want[mine], msg=f"step {step}")
            ref_opt.zero_grad()
            want.square().sum().backward()
            ref_opt.step()
            opt.zero_grad()
            got.square().sum().backward()
            opt.step()
        for name, p in fast.named_parameters():
            torch.testing.assert_close(p.detach(), ref.get_parameter(name).detach(), msg=name)
        dist.barrier()
    os._exit(0)


def test_a_sharded_lookup_output_changed_in_place_trains_as_the_plain_model():
    """The output dist's tensors may be written in place as the lookups' (world size 2, both
    tables on one rank, three SGD steps)."""
    from tests.test_sharding import spawn

    spawn(_sharded_bags_trained, 2, AddInPlaceBags)


def test_a_sharded_lookup_output_read_with_view_trains_as_the_plain_model():
    """Both tables on one rank: the output dist's tensors are column slices of what it received,
    which ``view`` refuses (it failed); those read with ``view`` are made contiguous."""
    from tests.test_sharding import spawn

    spawn(_sharded_bags_trained, 2, ViewedBags)


def _sharded_ids_shifted_between(rank, world, init_file):
    import os

    import torch.distributed as dist

    from tests.test_sharding import gloo_group

    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = ShiftIdsBetween().eval()
        ids, offsets = ids_offsets()
        plan = fxrec.plan(model, (ids.clone(), offsets), world_size=world, memory_per_rank="1GB",
                          pins={"e": ("table_wise", 0), "f": ("table_wise", 1)})
        fast = fxrec.transform(model, (ids.clone(), offsets), plan=plan, mode="inference")
        with torch.no_grad():
            for seed in (1, 2):  # (every rank feeds the same batch: its rows are the model's)
                ids, offsets = ids_offsets(seed)
                assert torch.equal(fast(ids.clone(), offsets), model(ids.clone(), offsets)), seed
        dist.barrier()
    os._exit(0)


def test_sharded_lookups_read_ids_as_they_were_before_a_later_in_place_write():
    """The input dist is placed before the write that follows its lookups (it was placed before
    their output's first user, after the write: the first table's rows were read at shifted ids)."""
    from tests.test_sharding import spawn

    spawn(_sharded_ids_shifted_between, 2)


class SameLookupTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.EmbeddingBag(30, 4)

    def forward(self, ids, offsets):
        a = self.e(ids, offsets)
        b = self.e(ids, offsets)  # the same lookup: merged, unless one is written
        a += 1
        return a, b


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_lookup_repeated_and_one_copy_written_in_place_stays_two_tensors(backend):
    """(merge_lookups made them one output, and the write reached the other: b came back 1.0 off.)"""
    torch.manual_seed(0)
    check(SameLookupTwice(), ids_offsets(), backend)
    with torch.no_grad():
        check(SameLookupTwice(), ids_offsets(), backend)


class ScaledRows(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = nn.Embedding(40, 8)
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 8))  # (a parameter on every rank)

    def forward(self, seq):
        e = self.s(seq)
        e.mul_(2)
        return e * self.w


class FlattenedRows(nn.Module):
    """A table of dim 7 beside one of dim 8, read with ``view``: sharded, their rows travel at one
    width (8), and the narrower table's are a slice of what arrived."""

    def __init__(self):
        super().__init__()
        self.s, self.t = nn.Embedding(40, 8), nn.Embedding(40, 7)
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 8))  # (a parameter on every rank)

    def forward(self, seq):
        return self.s(seq) * self.w + self.t(seq).view(-1).square().sum()


def _sharded_rows_trained(rank, world, init_file, model_cls):
    import os

    import torch.distributed as dist

    from tests.test_sharding import gloo_group

    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = model_cls()
        ref = copy.deepcopy(model)
        seq = torch.randint(0, 40, (4, 3), generator=torch.Generator().manual_seed(1))
        pins = {name: ("table_wise", 1) for name, m in model.named_children() if isinstance(m, nn.Embedding)}
        plan = fxrec.plan(model, (seq,), world_size=world, memory_per_rank="1GB", pins=pins)
        fast = fxrec.transform(model, (seq,), plan=plan)
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (fast, ref))
        for step in range(3):  # (every rank feeds the same batch: the plain model's rows, and twice its gradient)
            x = torch.randint(0, 40, (4, 3), generator=torch.Generator().manual_seed(step + 2))
            want, got = ref(x), fast(x)
            torch.testing.assert_close(got, want, msg=f"step {step}")
            ref_opt.zero_grad()
            (want.square().sum() * world).backward()
            ref_opt.step()
            opt.zero_grad()
            got.square().sum().backward()
            opt.step()
        for name, p in fast.named_parameters():
            torch.testing.assert_close(p.detach(), ref.get_parameter(name).detach(), msg=name)
        dist.barrier()
    os._exit(0)


def test_sharded_unpooled_rows_changed_in_place_train_as_the_plain_model():
    """(The output dist's rows were views: autograd refused the in-place write.)"""
    from tests.test_sharding import spawn

    spawn(_sharded_rows_trained, 2, ScaledRows)


def test_sharded_unpooled_rows_read_with_view_train_as_the_plain_model():
    """(The narrower table's rows were handed on as a slice: ``view`` refused them.)"""
    from tests.test_sharding import spawn

    spawn(_sharded_rows_trained, 2, FlattenedRows)


class ReluAfterConcat(nn.Module):
    """DLRM-like: the lookups concatenated, then nn.ReLU(inplace=True): nothing else reads them."""

    def __init__(self):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(30, 4) for _ in range(3)])
        self.mlp = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(12, 2))

    def forward(self, ids, offsets):
        return self.mlp(torch.cat([b(ids, offsets) for b in self.bags], 1))


class TwoConcatsOneWritten(nn.Module):
    def __init__(self):
        super().__init__()
        self.user, self.item = nn.EmbeddingBag(30, 4), nn.EmbeddingBag(30, 4)

    def forward(self, ids, offsets):
        a, b = self.user(ids, offsets), self.item(ids, offsets)
        kept = torch.cat([a, b], 1)
        written = torch.cat([a, b], 1)
        written.clamp_(min=0)
        return kept, written


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_concatenation_written_in_place_that_nothing_else_reads_is_the_groups_output(backend):
    """The write reaches nothing the model reads: no copy (the group's output is written), and the
    plain model's numbers; with two concatenations of the same lookups, the written one is a copy."""
    torch.manual_seed(0)
    fast = fxrec.transform(ReluAfterConcat(), ids_offsets(), **_kw(backend))
    assert "split_with_sizes" not in fast.code and "aten.cat" not in fast.code, fast.code
    check(ReluAfterConcat(), ids_offsets(), backend)
    check(TwoConcatsOneWritten(), ids_offsets(), backend)
    with torch.no_grad():
        check(TwoConcatsOneWritten().eval(), ids_offsets(), backend, mode="inference")


class PartOfAGroupWritten(nn.Module):
    """Two of a group's three lookups concatenated and written in place; the third read apart."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.EmbeddingBag(30, 4), nn.EmbeddingBag(30, 4), nn.EmbeddingBag(30, 4)
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, ids, offsets):
        a, b, c = self.a(ids, offsets), self.b(ids, offsets), self.c(ids, offsets)
        x = torch.cat([a, b], 1)
        x.relu_()
        return x.sum(1) + (c * self.w).sum(1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_concatenation_of_part_of_a_group_written_in_place_stays_a_copy(backend):
    """Folded into a slice of the group's output, the write would reach the third lookup's part."""
    torch.manual_seed(0)
    check(PartOfAGroupWritten(), ids_offsets(), backend)


class _WriteInNoGrad(nn.Module):
    """A lookup, then an in-place write inside a ``torch.no_grad()`` block (captured as one
    higher-order op whose body writes), then a lookup that must see the write."""

    def __init__(self, what):
        super().__init__()
        self.e = nn.Embedding(50, 4)
        self.what = what

    def forward(self, ids):
        first = self.e(ids)
        with torch.no_grad():
            if self.what == "ids":
                ids.add_(1)
            else:
                self.e.weight.mul_(0.5)
        return first, self.e(ids)


@pytest.mark.parametrize("what", ["ids", "weight"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_in_place_write_inside_a_no_grad_block_stays_between_the_lookups(what, backend):
    torch.manual_seed(0)
    model = _WriteInNoGrad(what)
    plain = copy.deepcopy(model)
    ids = torch.randint(0, 40, (10,))
    fast = fxrec.transform(model, (ids.clone(),), **_kw(backend))
    want, got = plain(ids.clone()), fast(ids.clone())
    assert not torch.equal(want[0], want[1])  # (the write changes what the second lookup reads)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fast.e.weight, plain.e.weight, rtol=0, atol=0)


def test_a_table_written_in_a_no_grad_block_keeps_its_name_and_its_table_optimizer():
    """The lookup after the write reads the block's output: the table was reported as 'getitem', as
    no parameter, and make_optimizer gave it to the dense optimizer instead of optimizer=."""
    torch.manual_seed(0)
    model = _WriteInNoGrad("weight")
    plain = copy.deepcopy(model)
    fast = fxrec.transform(model, (torch.randint(0, 40, (10,)),), optimizer=fxrec.optim.Adagrad(lr=0.1))
    assert {e.table for e in fast.report.lookups} == {"e"}
    assert any("modified in place by mul_" in e.reason for e in fast.report.lookups)
    opt = fast.make_optimizer(torch.optim.SGD, lr=0.5)
    ref = torch.optim.Adagrad(plain.parameters(), lr=0.1)
    for step in range(3):
        ids = torch.randint(0, 40, (10,), generator=torch.Generator().manual_seed(step))
        sum(o.square().sum() for o in plain(ids.clone())).backward()
        sum(o.square().sum() for o in fast(ids.clone())).backward()
        ref.step(), ref.zero_grad()
        opt.step(), opt.zero_grad()
    torch.testing.assert_close(fast.e.weight, plain.e.weight)


class _WritesOneInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(50, 4)

    def forward(self, a, b):
        first = self.e(b)
        a.fill_(3)
        return first, self.e(b)


@pytest.mark.parametrize("alias", ["same", "view"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_that_share_memory_with_one_written_in_place_give_the_plain_models_outputs(alias, backend):
    """Captured on separate inputs, called with the same tensor twice (or a view of the other):
    the write to ``a`` is a write to ``b``, so the lookups of ``b`` stay on either side of it,
    and stay two lookups."""
    torch.manual_seed(0)
    model = _WritesOneInput()
    plain = copy.deepcopy(model)
    x = torch.randint(0, 40, (6, 2))

    def args():
        t = x.clone()
        return (t, t) if alias == "same" else (t, t[:, 0])

    fast = fxrec.transform(model, tuple(t.clone() for t in args()), **_kw(backend))

    want, got = plain(*args()), fast(*args())
    assert not torch.equal(want[0], want[1])
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    assert got[0].data_ptr() != got[1].data_ptr()


class _ViewFromNoGrad(nn.Module):
    """A view of an input made inside a ``torch.no_grad()`` block, written in place after it: a
    write to the input, between the lookups of it."""

    def __init__(self):
        super().__init__()
        self.e = nn.EmbeddingBag(50, 4, mode="sum")
        self.f = nn.EmbeddingBag(50, 4, mode="sum")

    def forward(self, ids, off, ids2, off2):
        first = self.e(ids, off)
        with torch.no_grad():
            v = ids.view(-1)
        v.clamp_(max=10)
        return torch.cat([first, self.f(ids, off), self.f(ids2, off2)], 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_view_made_in_a_no_grad_block_and_written_after_it_is_a_write_to_its_input(backend):
    """(The block's result was not known to share memory with what it was given: the lookup
    after the write moved before it.)"""
    torch.manual_seed(0)
    model = _ViewFromNoGrad()
    plain = copy.deepcopy(model)
    x = (torch.randint(0, 40, (10,)), torch.tensor([0, 3, 6]), torch.randint(0, 40, (4,)), torch.tensor([0, 1, 2]))
    fast = fxrec.transform(model, tuple(t.clone() for t in x), **_kw(backend))
    want, got = plain(*(t.clone() for t in x)), fast(*(t.clone() for t in x))
    assert not torch.equal(want[:, :4], want[:, 4:8])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


class _WritesThroughReshapes(nn.Module):
    """Writes through results of reshapes that view their tensor at the example's sizes: a slice
    flattened over one dim (flatten gives the slice itself) and a transpose reshaped to the shape
    it has. Capture flattens tensors of size-dependent layouts on a copy only where the reshape
    copies the example (fxrec.capture_reshapes.reshape_by_copy): here the writes must reach x and h."""

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(50, 4, mode="sum")
        self.lin = nn.Linear(5, 4)
        self.top = nn.Linear(4, 1)

    def forward(self, ids, x):
        x[:, :3].flatten(1).mul_(2)
        h = self.lin(x) + self.emb(ids)
        h.t().reshape(4, h.shape[0]).mul_(2)
        return self.top(h) + torch.flatten(input=x[:, 3:], start_dim=1).sum(1, keepdim=True)


def test_writes_through_a_reshape_that_views_reach_the_tensor_and_keyword_inputs_work():
    """(the review: capture copied every tensor of a size-dependent layout before a reshape, so a
    write through a flatten or reshape that views it in the model was lost, outputs and gradients
    wrong; and ``torch.flatten(input=...)`` failed to capture)"""
    torch.manual_seed(0)
    model = _WritesThroughReshapes()
    twin = copy.deepcopy(model)
    fast = fxrec.transform(model, (torch.randint(0, 50, (4, 2)), torch.randn(4, 5)))
    for b in (4, 3):
        ids, x = torch.randint(0, 50, (b, 2)), torch.randn(b, 5)
        xa, xb = x.clone(), x.clone()
        fast.zero_grad()
        twin.zero_grad()
        got, want = fast(ids, xa), twin(ids, xb)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(xa, xb)  # (the input written as the model writes it)
        got.sum().backward()
        want.sum().backward()
        grads = dict(twin.named_parameters())
        for name, p in fast.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(p.grad, grads[name].grad, msg=name)
