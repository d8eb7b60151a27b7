"""The group module alone: each kernel against PyTorch's own lookups (the reference), values and grads."""

import pytest
import torch

from fxrec.runtime.group import EmbeddingGroup
from fxrec.runtime.specs import FeatureSpec, TableSpec


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


def eval_out(group_cls, tables, feats, pooling, ids, offs, psw, path):
    g = group_cls(tables, feats, pooling, path, path)
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(t.num_rows, t.dim, generator=gen) for t in tables]
    with torch.no_grad():
        return g(ids, offs, psw, params)


def assert_paths_agree(*args):
    """Every path gives the plain lookups' outputs and gradients (with autograd) and outputs
    (without); returns the fbgemm path's run."""
    a = run(*args, path="reference")
    want_eval = eval_out(*args, path="reference")
    paths = ["fbgemm"] + (["native"] if args[3] != "none" else [])
    for path in paths:
        b = run(*args, path=path)
        for x, y in zip(a[0], b[0]):
            torch.testing.assert_close(y, x, msg=lambda m: f"{path} output: {m}")
        for x, y in zip(a[1], b[1]):
            torch.testing.assert_close(y, x, msg=lambda m: f"{path} gradient: {m}")
        for x, y in zip(a[2], b[2]):
            if x is not None:
                torch.testing.assert_close(y, x, msg=lambda m: f"{path} sample-weight gradient: {m}")
        torch.testing.assert_close(eval_out(*args, path=path), want_eval, msg=lambda m: f"{path} inference: {m}")
    return run(*args, path="fbgemm")


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_mixed_dims_padding_duplicates_shared_tables(pooling):
    tables = [TableSpec("a", 50, 8), TableSpec("b", 30, 4, sparse=True), TableSpec("c", 20, 12)]
    feats = [
        FeatureSpec("fa", 0, "bag", padding_idx=3),
        FeatureSpec("fa2", 0, "single"),  # table a again (a table's features are adjacent in a group)
        FeatureSpec("fb", 1, "bag", include_last_offset=True),
        FeatureSpec("fc", 2, "pooled_seq", padding_idx=1),
    ]
    ids = [torch.tensor([3, 3, 3, 3, 7, 7, 7, 1, 2, 9, 9, 40]), torch.tensor([7, 7, 0, 49, 5]), torch.randint(0, 30, (9,)),
           torch.tensor([[1, 1, 2], [3, 1, 4], [5, 5, 5], [1, 1, 1], [0, 2, 19]])]
    offs = [torch.tensor([0, 2, 2, 7, 9]), None, torch.tensor([0, 1, 1, 4, 6, 9]), None]
    b = assert_paths_agree(EmbeddingGroup, tables, feats, pooling, ids, offs, [None] * 4)
    assert b[1][0][3].abs().max() == 0  # padding row 3 of table a gets no gradient from bag fa


def test_features_of_one_table_apart_are_refused():
    """fbgemm's kernels need a table's features adjacent (feature_table_map [0, 1, 0] gives wrong
    fused Adagrad updates on CPU); group_lookups orders them so, and the module refuses otherwise."""
    tables = [TableSpec("a", 10, 4), TableSpec("b", 10, 4)]
    feats = [FeatureSpec("a0", 0, "bag"), FeatureSpec("b1", 1, "bag"), FeatureSpec("a2", 0, "bag")]
    with pytest.raises(ValueError, match=r"ordered by table, got table order \[0, 1, 0\]"):
        EmbeddingGroup(tables, feats, "sum")


def test_weighted_bags_give_sample_weight_gradients():
    tables = [TableSpec("a", 50, 8), TableSpec("b", 30, 8)]
    feats = [FeatureSpec("fa", 0, "bag", weighted=True), FeatureSpec("fb", 1, "bag", weighted=True, padding_idx=2)]
    ids = [torch.randint(0, 50, (10,)), torch.tensor([2, 2, 5, 6, 2, 7])]
    offs = [torch.tensor([0, 3, 3, 8]), torch.tensor([0, 2, 4, 4])]
    psw = [torch.rand(10), torch.rand(6)]
    b = assert_paths_agree(EmbeddingGroup, tables, feats, "sum", ids, offs, psw)
    assert b[2][0] is not None and b[2][0].abs().sum() > 0


def test_sequence_group_any_shape_with_padding():
    tables = [TableSpec("a", 50, 8), TableSpec("b", 30, 8)]
    feats = [FeatureSpec("fa", 0, "seq", padding_idx=2), FeatureSpec("fa2", 0, "seq"), FeatureSpec("fb", 1, "seq")]
    ids = [torch.tensor([[2, 3, 4], [2, 2, 9]]), torch.randint(0, 50, (2, 2, 2)), torch.randint(0, 30, (7,))]
    b = assert_paths_agree(EmbeddingGroup, tables, feats, "none", ids, [None] * 3, [None] * 3)
    assert [tuple(o.shape) for o in b[0]] == [(2, 3, 8), (2, 2, 2, 8), (7, 8)]
    assert b[1][0][2].abs().max() == 0


def test_fbgemm_path_reads_the_parameters_storage():
    tables = [TableSpec("a", 10, 4), TableSpec("b", 6, 4)]
    feats = [FeatureSpec("fa", 0, "single"), FeatureSpec("fb", 1, "single")]
    g = EmbeddingGroup(tables, feats, "sum", "fbgemm", "fbgemm")
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
    g = EmbeddingGroup(tables, feats, "sum", "fbgemm", "fbgemm")
    params = [torch.randn(10, 4), torch.randn(6, 4)]
    with pytest.raises(RuntimeError, match="(?i)size"):  # torch.cat's own error, as in the plain model
        g([torch.tensor([1, 2]), torch.tensor([5])], [None, None], [None, None], params)


def test_sequence_group_refuses_features_not_ordered_by_table():
    tables = [TableSpec("a", 50, 8), TableSpec("b", 30, 8)]
    feats = [FeatureSpec("fa", 0, "seq"), FeatureSpec("fb", 1, "seq"), FeatureSpec("fa2", 0, "seq")]
    with pytest.raises(ValueError, match="ordered by table"):
        EmbeddingGroup(tables, feats, "none")


def test_reference_inference_into_a_reused_buffer_is_bit_exact_for_bags_and_single_ids():
    """In inference the reference kernel runs PyTorch's own kernels (embedding_bag, index_select)
    into one reused output: exactly the plain lookups' concatenation."""
    tables = [TableSpec("a", 50, 8), TableSpec("b", 30, 4)]
    feats = [FeatureSpec("fa", 0, "bag", padding_idx=3, weighted=True), FeatureSpec("fa2", 0, "single"),
             FeatureSpec("fb", 1, "bag", include_last_offset=True)]
    ids = [torch.tensor([3, 1, 3, 7, 7, 2]), torch.tensor([7, 0, 49]), torch.randint(0, 30, (9,), dtype=torch.int32)]
    offs = [torch.tensor([0, 2, 2]), None, torch.tensor([0, 1, 4, 9], dtype=torch.int32)]
    psw = [torch.rand(6), None, None]
    for pooling in ("sum", "mean"):
        if pooling == "mean":  # per-sample weights are for sum pooling only
            feats[0] = FeatureSpec("fa", 0, "bag", padding_idx=3)
            psw = [None] * 3
        got = eval_out(EmbeddingGroup, tables, feats, pooling, ids, offs, psw, "reference")
        params = [torch.randn(t.num_rows, t.dim, generator=g) for g in [torch.Generator().manual_seed(0)]
                  for t in tables]
        want = torch.cat([torch.nn.functional.embedding_bag(ids[0], params[0], offs[0], mode=pooling, padding_idx=3,
                                                            per_sample_weights=psw[0]),
                          torch.nn.functional.embedding(ids[1], params[0]),
                          torch.nn.functional.embedding_bag(ids[2], params[1], offs[2], mode=pooling,
                                                            include_last_offset=True)], 1)
        assert torch.equal(got, want), pooling


def _direct_group():
    tables = [TableSpec("a", 100, 8), TableSpec("b", 60, 4)]
    feats = [FeatureSpec("fa", 0, "bag"), FeatureSpec("fb", 1, "single")]
    g = EmbeddingGroup(tables, feats, "sum", "reference", "reference")
    params = [torch.randn(100, 8), torch.randn(60, 4)]
    return g, params


def _direct_inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 100, (12,), generator=gen), torch.randint(0, 60, (4,), generator=gen)], \
        [torch.tensor([0, 3, 3, 7]), None], [None, None]


def _plain(g, params, ids, offs, psw):
    with torch.no_grad():
        return g.lookups(ids, offs, psw, params)


def test_output_buffer_is_reused_only_when_nothing_refers_to_it():
    g, params = _direct_group()
    with torch.no_grad():
        first = g(*_direct_inputs(1), params)
        kept = first.clone()
        second = g(*_direct_inputs(2), params)  # `first` is alive: a new buffer
        assert second.data_ptr() != first.data_ptr()
        assert torch.equal(first, kept)
        view = second[:, :8]  # a view keeps the buffer too
        second_ptr = second.data_ptr()
        del second
        third = g(*_direct_inputs(3), params)
        assert third.data_ptr() != second_ptr
        assert torch.equal(view, _plain(g, params, *_direct_inputs(2))[:, :8])
        del view, third
        fourth = g(*_direct_inputs(4), params)  # nothing refers to the kept buffer: reused
        ptr = fourth.data_ptr()
        torch.testing.assert_close(fourth, _plain(g, params, *_direct_inputs(4)), rtol=0, atol=0)
        del fourth
        fifth = g(*_direct_inputs(5), params)
        assert fifth.data_ptr() == ptr
        torch.testing.assert_close(fifth, _plain(g, params, *_direct_inputs(5)), rtol=0, atol=0)


def test_output_buffer_not_reused_when_turned_off_or_saved_by_autograd():
    g, params = _direct_group()
    g.reuse_output = False
    with torch.no_grad():
        ptr = g(*_direct_inputs(1), params).data_ptr()
        out = g(*_direct_inputs(2), params)
    torch.testing.assert_close(out, _plain(g, params, *_direct_inputs(2)))
    g.reuse_output = True
    # frozen tables, trained dense layer: the dense op saves the group's output for backward
    lin = torch.nn.Linear(12, 1)
    with torch.no_grad():
        g(*_direct_inputs(1), params)  # makes the buffer
    loss1 = lin(g(*_direct_inputs(1), params)).sum()
    loss2 = lin(g(*_direct_inputs(2), params)).sum()  # must not overwrite what loss1's graph saved
    loss1.backward()
    want = _plain(g, params, *_direct_inputs(1)).sum(0)
    torch.testing.assert_close(lin.weight.grad[0], want)
    del ptr, loss2


def test_output_buffer_across_inference_mode():
    g, params = _direct_group()
    with torch.inference_mode():
        a = g(*_direct_inputs(1), params)
        assert a.is_inference()
        del a
    lin = torch.nn.Linear(12, 1)
    out = g(*_direct_inputs(2), params)  # outside inference mode: not an inference tensor
    assert not out.is_inference()
    lin(out).sum().backward()  # usable by autograd
    with torch.inference_mode():
        torch.testing.assert_close(g(*_direct_inputs(3), params), _plain(g, params, *_direct_inputs(3)))


def test_output_buffer_under_threads():
    import threading
    g, params = _direct_group()
    wants = {s: _plain(g, params, *_direct_inputs(s)) for s in range(8)}
    errors = []

    def work(seed):
        try:
            for _ in range(200):
                with torch.no_grad():
                    out = g(*_direct_inputs(seed), params)
                    if not torch.equal(out, wants[seed]):
                        errors.append(seed)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_group_with_output_buffer_deepcopies():
    import copy
    g, params = _direct_group()
    with torch.no_grad():
        g(*_direct_inputs(1), params)
    h = copy.deepcopy(g)
    with torch.no_grad():
        torch.testing.assert_close(h(*_direct_inputs(2), params), _plain(g, params, *_direct_inputs(2)))


def test_output_buffer_survives_in_place_autograd_and_is_not_reused_once_shared():
    g, params = _direct_group()
    gate = torch.ones(12, requires_grad=True)
    with torch.no_grad():
        g(*_direct_inputs(1), params)
    y = g(*_direct_inputs(1), params)  # frozen tables: the inference path, with grad mode on
    y.mul_(gate)  # autograd records an in-place op on the result
    del y
    torch.testing.assert_close(g(*_direct_inputs(2), params).detach(), _plain(g, params, *_direct_inputs(2)))
    with torch.no_grad():
        shared = g(*_direct_inputs(3), params)
        shared.share_memory_()  # e.g. put on a torch.multiprocessing queue
        ptr = shared.data_ptr()
        del shared
        assert g(*_direct_inputs(4), params).data_ptr() != ptr
