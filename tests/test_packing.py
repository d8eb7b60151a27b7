"""The one packing (fxrec.runtime.packing.pack_bags): a group's per-feature inputs as fbgemm's flat
ids and offsets, against the layout written out here feature by feature. The common groups (one
form, no padding_idx or include_last_offset, one batch size) are packed in list-level steps
(_pack_uniform); everything else by the loop over features. Both must give the layout below."""

import collections

import pytest
import torch
from torch import nn

import fxrec
from fxrec.runtime import device_ints, packing

BAG, POOLED_SEQ, SINGLE = (packing.FORM_CODES[k] for k in ("bag", "pooled_seq", "single"))


def written_out(ids_list, offsets_list, psw_list, forms):
    """fbgemm's input, feature-major: each feature's ids after the ones before, its bags' starts
    moved by that many; every id's weight (1 where a feature has none)."""
    indices, starts, weights, base = [], [], [], 0
    for ids, off, psw, form in zip(ids_list, offsets_list, psw_list, forms):
        flat = ids.reshape(-1)
        if form == BAG:
            bag_starts = off.long()
        elif form == POOLED_SEQ:
            bag_starts = torch.arange(ids.shape[0]) * ids.shape[1]
        else:
            bag_starts = torch.arange(ids.shape[0])
        indices.append(flat.long())
        starts.append(bag_starts + base)
        weights.append(torch.ones(flat.numel()) if psw is None else psw.reshape(-1).float())
        base += flat.numel()
    return torch.cat(indices), torch.cat(starts + [torch.tensor([base])]), torch.cat(weights)


def pack(ids_list, offsets_list, psw_list, forms, weighted):
    n = len(ids_list)
    return packing.pack_bags(ids_list, offsets_list, psw_list, [f"feature 'f{i}'" for i in range(n)], forms,
                             [-1] * n, [False] * n, False, weighted, False, False, False)


@pytest.fixture
def uniform_calls(monkeypatch):
    """What the list-level packing answered, call by call (None: it handed the group to the loop)."""
    seen = []
    real = packing._pack_uniform

    def spy(*args):
        out = real(*args)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(packing, "_pack_uniform", spy)
    return seen


def _bags(g, batch, lengths, dtypes):
    ids, offs = [], []
    for n_ids, dtype in zip(lengths, dtypes):
        ids.append(torch.randint(0, 30, (n_ids,), generator=g).to(dtype))
        cuts = torch.sort(torch.randint(0, n_ids + 1, (batch - 1,), generator=g)).values
        offs.append(torch.cat([torch.zeros(1, dtype=torch.long), cuts]).to(dtype))
    return ids, offs


CASES = {
    # name: a maker of (ids, offsets, weights), every one in the list-level form (its form: FORMS)
    "bags": lambda g: (*_bags(g, 4, [7, 0, 12, 4], [torch.long] * 4), [None] * 4),
    "bags_int32_and_int64": lambda g: (*_bags(g, 3, [5, 9, 2], [torch.int32, torch.long, torch.int32]), [None] * 3),
    "weighted_bags": lambda g: (*_bags(g, 4, [6, 3], [torch.long] * 2),
                                [torch.rand(6, generator=g), torch.rand(3, generator=g)]),
    "pooled_seq": lambda g: ([torch.randint(0, 50, (5, 3), generator=g) for _ in range(3)], [None] * 3, [None] * 3),
    "weighted_pooled_seq": lambda g: ([torch.randint(0, 50, (5, 3), generator=g) for _ in range(2)], [None] * 2,
                                      [torch.rand(5, 3, generator=g) for _ in range(2)]),
    "single": lambda g: ([torch.randint(0, 50, (6,), generator=g).int() for _ in range(4)], [None] * 4, [None] * 4),
}
FORMS = {"bags": BAG, "bags_int32_and_int64": BAG, "weighted_bags": BAG, "pooled_seq": POOLED_SEQ,
         "weighted_pooled_seq": POOLED_SEQ, "single": SINGLE}


@pytest.mark.parametrize("case", sorted(CASES))
def test_common_groups_pack_in_list_level_steps_as_written_out(case, uniform_calls):
    ids, offs, psw = CASES[case](torch.Generator().manual_seed(0))
    forms = [FORMS[case]] * len(ids)
    weighted = any(p is not None for p in psw)
    batch, indices, offsets, weights, bounds, _ = pack(ids, offs, psw, forms, weighted)
    assert uniform_calls == [True]
    want_indices, want_offsets, want_weights = written_out(ids, offs, psw, forms)
    assert batch == (offs[0].numel() if forms[0] == BAG else ids[0].shape[0])
    assert indices.dtype == offsets.dtype == torch.long
    torch.testing.assert_close(indices, want_indices, rtol=0, atol=0)
    torch.testing.assert_close(offsets, want_offsets, rtol=0, atol=0)
    assert bounds == [0, *torch.tensor([i.numel() for i in ids]).cumsum(0).tolist()]
    if weighted:
        assert weights.dtype == torch.float32
        torch.testing.assert_close(weights, want_weights, rtol=0, atol=0)
    else:
        assert weights is None


def _mixed(g):
    ids, offs = _bags(g, 3, [4, 6], [torch.long] * 2)
    return ids + [torch.randint(0, 50, (3, 2), generator=g), torch.randint(0, 50, (3,), generator=g)], \
        offs + [None, None], [None] * 4, [BAG, BAG, POOLED_SEQ, SINGLE]


def _one_weighted(g):
    ids, offs = _bags(g, 3, [4, 6], [torch.long] * 2)
    return ids, offs, [torch.rand(4, generator=g), None], [BAG, BAG]


def _two_lengths(g):
    return [torch.randint(0, 50, (4, 2), generator=g), torch.randint(0, 50, (4, 5), generator=g)], [None] * 2, \
        [None] * 2, [POOLED_SEQ] * 2


def _weights_of_two_dtypes(g):
    # each feature's weights made float32 on their own: an int64 weight of 70000 next to float16
    # ones would be inf in float16, where a cat of the two would first put it
    ids, offs = _bags(g, 3, [2, 1], [torch.long] * 2)
    return ids, offs, [torch.tensor([70000, 2049]), torch.tensor([1.0], dtype=torch.float16)], [BAG, BAG]


@pytest.mark.parametrize("make", [_mixed, _one_weighted, _two_lengths, _weights_of_two_dtypes],
                         ids=["mixed_forms", "one_feature_weighted", "two_lengths", "weights_of_two_dtypes"])
def test_other_groups_take_the_loop_with_the_layout_written_out(make, uniform_calls):
    ids, offs, psw, forms = make(torch.Generator().manual_seed(1))
    weighted = any(p is not None for p in psw)
    batch, indices, offsets, weights, _, _ = pack(ids, offs, psw, forms, weighted)
    assert uniform_calls == [False]
    want_indices, want_offsets, want_weights = written_out(ids, offs, psw, forms)
    assert batch == (4 if make is _two_lengths else 3)
    torch.testing.assert_close(indices, want_indices, rtol=0, atol=0)
    torch.testing.assert_close(offsets, want_offsets, rtol=0, atol=0)
    if weighted:
        torch.testing.assert_close(weights, want_weights, rtol=0, atol=0)


def test_features_of_two_batch_sizes_are_not_packable_either_way(uniform_calls):
    g = torch.Generator().manual_seed(2)
    ids, offs = _bags(g, 3, [4, 6], [torch.long] * 2)
    offs[1] = offs[1][:2]
    assert pack(ids, offs, [None] * 2, [BAG] * 2, False)[0] == packing.NOT_PACKABLE
    single = [torch.zeros(3, dtype=torch.long), torch.zeros(2, dtype=torch.long)]
    assert pack(single, [None] * 2, [None] * 2, [SINGLE] * 2, False)[0] == packing.NOT_PACKABLE
    assert uniform_calls == [False, False]


def test_an_empty_batch_is_packed_as_empty(uniform_calls):
    ids = [torch.zeros(0, dtype=torch.long)] * 2
    offs = [torch.zeros(0, dtype=torch.long)] * 2
    assert pack(ids, offs, [None] * 2, [BAG] * 2, False)[0] == 0
    assert uniform_calls == [False]


def test_a_transformed_model_gives_the_plain_models_numbers_through_both_packings(monkeypatch):
    """The same model, the list-level packing on and off: the plain model's outputs and gradients."""
    torch.manual_seed(0)
    plain = nn.ModuleList([nn.EmbeddingBag(30, 8, mode="sum") for _ in range(5)])

    class Bags(nn.Module):
        def __init__(self):
            super().__init__()
            self.bags = plain

        def forward(self, ids, offsets):
            return torch.cat([b(i, o) for b, i, o in zip(self.bags, ids, offsets)], 1)

    model = Bags()
    g = torch.Generator().manual_seed(3)
    ids, offs = _bags(g, 4, [6, 2, 9, 4, 5], [torch.long] * 5)
    want = model(ids, offs)
    want.sum().backward()
    grads = [b.weight.grad.clone() for b in plain]
    for on in (True, False):
        if not on:
            monkeypatch.setattr(packing, "_pack_uniform", lambda *a: None)
        fast = fxrec.transform(model, (ids, offs), backend="fbgemm")
        out = fast(ids, offs)
        out.sum().backward()
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        for k, grad in enumerate(grads):
            b = getattr(fast.bags, str(k))
            torch.testing.assert_close(b.weight.grad.to_dense(), grad, rtol=1e-6, atol=1e-6)


def test_a_layout_seen_before_reuses_its_starts_on_the_device_and_gives_the_same_offsets(monkeypatch):
    """Where each feature's ids start stays on the device from one call to the next of the same
    layout (no copy at all in a training loop of one batch shape); a new layout is sent and kept,
    the least recently used of device_ints.KEEP dropped. The offsets are the written-out ones every
    time, and the inputs are left as they were."""
    monkeypatch.setattr(device_ints, "KEPT", collections.OrderedDict())
    g = torch.Generator().manual_seed(3)
    ids, offs = _bags(g, 4, [5, 7, 2], [torch.int64, torch.int32, torch.int64])
    given = [o.clone() for o in offs]
    want = written_out(ids, offs, [None] * 3, [BAG] * 3)[1]
    first = pack(ids, offs, [None] * 3, [BAG] * 3, False)
    assert len(device_ints.KEPT) == 1
    kept = next(iter(device_ints.KEPT.values()))
    second = pack(ids, offs, [None] * 3, [BAG] * 3, False)
    assert len(device_ints.KEPT) == 1 and next(iter(device_ints.KEPT.values())) is kept
    for got in (first, second):
        assert torch.equal(got[2], want) and got[2].dtype == torch.int64
        assert got[5].tolist() == [0, 0, 0]  # each feature's first offset, as given
    assert all(torch.equal(o, w) for o, w in zip(offs, given))
    ids2, offs2 = _bags(g, 4, [3, 7, 2], [torch.int64] * 3)  # another layout: sent, and kept too
    assert torch.equal(pack(ids2, offs2, [None] * 3, [BAG] * 3, False)[2],
                       written_out(ids2, offs2, [None] * 3, [BAG] * 3)[1])
    assert len(device_ints.KEPT) == 2
    monkeypatch.setattr(device_ints, "KEEP", 2)
    pack(ids, offs, [None] * 3, [BAG] * 3, False)  # the first layout, used again: the most recent
    ids3, offs3 = _bags(g, 4, [4, 4, 4], [torch.int64] * 3)
    assert torch.equal(pack(ids3, offs3, [None] * 3, [BAG] * 3, False)[2],
                       written_out(ids3, offs3, [None] * 3, [BAG] * 3)[1])
    # the second layout's starts were dropped, the first's (used again) and the third's kept
    assert [list(k[2:]) for k in device_ints.KEPT] == [[0, 5, 12, 14], [0, 4, 8, 12]]  # (starts, then the total)
    assert next(iter(device_ints.KEPT.values())) is kept


def test_offsets_that_do_not_start_at_zero_are_given_as_firsts_by_both_packings(uniform_calls):
    """(The caller raises, naming the feature: pack_pooled, or the sharded input check.)"""
    g = torch.Generator().manual_seed(4)
    ids, offs = _bags(g, 3, [6, 6], [torch.int64] * 2)
    offs[1] = offs[1] + 1
    got = pack(ids, offs, [None] * 2, [BAG] * 2, False)
    assert got[5].tolist() == [0, 1]
    # the loop (a feature of another form beside them): the same
    single = torch.tensor([1, 2, 3])
    got = pack(ids + [single], offs + [None], [None] * 3, [BAG, BAG, SINGLE], False)
    assert got[5].tolist() == [0, 1, 0]
    assert uniform_calls == [True, False]
