"""The runtime group modules alone: fbgemm path against the plain-lookup path, values and grads."""

import pytest
import torch

from fxrec.runtime.tbe import FeatureSpec, PooledEmbeddingGroup, SequenceEmbeddingGroup, TableSpec


def run(group_cls, tables, feats, pooling, ids, offs, psw, path, seed=1):
    g = group_cls(tables, feats, pooling, path, path)
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(t.num_rows, t.dim, generator=gen).requires_grad_() for t in tables]
    psw = [None if w is None else w.clone().requires_grad_() for w in psw]
    out = g(ids, offs, psw, params)
    outs = out if isinstance(out, list) else [out]
    cot = [torch.randn(o.shape, generator=torch.Generator().manual_seed(seed)) for o in outs]
    sum((o * c).sum() for o, c in zip(outs, cot)).backward()
    grads = [p.grad.to_dense() for p in params]
    return outs, grads, [None if w is None else w.grad for w in psw], params


def assert_paths_agree(*args):
    a = run(*args, path="loop")
    b = run(*args, path="fbgemm")
    for x, y in zip(a[0], b[0]):
        torch.testing.assert_close(y, x)
    for x, y in zip(a[1], b[1]):
        torch.testing.assert_close(y, x)
    for x, y in zip(a[2], b[2]):
        if x is not None:
            torch.testing.assert_close(y, x)
    return b


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_mixed_dims_padding_duplicates_shared_tables(pooling):
    tables = [TableSpec("a", 50, 8), TableSpec("b", 30, 4, sparse=True), TableSpec("c", 20, 12)]
    feats = [
        FeatureSpec("fa", 0, "bag", padding_idx=3),
        FeatureSpec("fb", 1, "bag", include_last_offset=True),
        FeatureSpec("fc", 2, "pooled_seq", padding_idx=1),
        FeatureSpec("fa2", 0, "single"),  # table a again
    ]
    ids = [torch.tensor([3, 3, 3, 3, 7, 7, 7, 1, 2, 9, 9, 40]), torch.randint(0, 30, (9,)),
           torch.tensor([[1, 1, 2], [3, 1, 4], [5, 5, 5], [1, 1, 1], [0, 2, 19]]), torch.tensor([7, 7, 0, 49, 5])]
    offs = [torch.tensor([0, 2, 2, 7, 9]), torch.tensor([0, 1, 1, 4, 6, 9]), None, None]
    b = assert_paths_agree(PooledEmbeddingGroup, tables, feats, pooling, ids, offs, [None] * 4)
    assert b[1][0][3].abs().max() == 0  # padding row 3 of table a gets no gradient from bag fa


def test_weighted_bags_give_sample_weight_gradients():
    tables = [TableSpec("a", 50, 8), TableSpec("b", 30, 8)]
    feats = [FeatureSpec("fa", 0, "bag", weighted=True), FeatureSpec("fb", 1, "bag", weighted=True, padding_idx=2)]
    ids = [torch.randint(0, 50, (10,)), torch.tensor([2, 2, 5, 6, 2, 7])]
    offs = [torch.tensor([0, 3, 3, 8]), torch.tensor([0, 2, 4, 4])]
    psw = [torch.rand(10), torch.rand(6)]
    b = assert_paths_agree(PooledEmbeddingGroup, tables, feats, "sum", ids, offs, psw)
    assert b[2][0] is not None and b[2][0].abs().sum() > 0


def test_sequence_group_any_shape_with_padding():
    tables = [TableSpec("a", 50, 8), TableSpec("b", 30, 8)]
    feats = [FeatureSpec("fa", 0, "seq", padding_idx=2), FeatureSpec("fa2", 0, "seq"), FeatureSpec("fb", 1, "seq")]
    ids = [torch.tensor([[2, 3, 4], [2, 2, 9]]), torch.randint(0, 50, (2, 2, 2)), torch.randint(0, 30, (7,))]
    b = assert_paths_agree(SequenceEmbeddingGroup, tables, feats, "none", ids, [None] * 3, [None] * 3)
    assert [tuple(o.shape) for o in b[0]] == [(2, 3, 8), (2, 2, 2, 8), (7, 8)]
    assert b[1][0][2].abs().max() == 0


def test_fbgemm_path_reads_the_parameters_storage():
    tables = [TableSpec("a", 10, 4), TableSpec("b", 6, 4)]
    feats = [FeatureSpec("fa", 0, "single"), FeatureSpec("fb", 1, "single")]
    g = PooledEmbeddingGroup(tables, feats, "sum", "fbgemm", "fbgemm")
    params = [torch.nn.Parameter(torch.randn(10, 4)), torch.nn.Parameter(torch.randn(6, 4))]
    ids = [torch.tensor([1, 2]), torch.tensor([5, 0])]
    g(ids, [None, None], [None, None], params)
    with torch.no_grad():
        params[1][5] = 100.0  # an optimizer step or load_state_dict writes in place
    out = g(ids, [None, None], [None, None], params)
    assert torch.equal(out[0, 4:], torch.full((4,), 100.0))


def test_batch_sizes_that_differ_between_features_fall_back_to_plain_lookups():
    tables = [TableSpec("a", 10, 4), TableSpec("b", 6, 4)]
    feats = [FeatureSpec("fa", 0, "single"), FeatureSpec("fb", 1, "single")]
    g = PooledEmbeddingGroup(tables, feats, "sum", "fbgemm", "fbgemm")
    params = [torch.randn(10, 4), torch.randn(6, 4)]
    with pytest.raises(RuntimeError, match="(?i)size"):  # torch.cat's own error, as in the plain model
        g([torch.tensor([1, 2]), torch.tensor([5])], [None, None], [None, None], params)


def test_sequence_group_refuses_features_not_ordered_by_table():
    tables = [TableSpec("a", 50, 8), TableSpec("b", 30, 8)]
    feats = [FeatureSpec("fa", 0, "seq"), FeatureSpec("fb", 1, "seq"), FeatureSpec("fa2", 0, "seq")]
    with pytest.raises(ValueError, match="ordered by table"):
        SequenceEmbeddingGroup(tables, feats)
