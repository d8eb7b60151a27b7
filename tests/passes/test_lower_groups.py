import torch

from fxrec import meta
from fxrec.passes.annotate_lookups import annotate_lookups
from fxrec.passes.choose_kernels import choose_kernels
from fxrec.passes.group_lookups import group_lookups
from fxrec.passes.lower_groups import lower_groups
from fxrec.testing import assert_matches, calls, captured, embedding_ops, group_calls, run_passes
from tests import models as M

aten = torch.ops.aten
PIPE = [annotate_lookups, group_lookups, choose_kernels, lower_groups]


def lowered(model, inputs):
    gm, ctx = run_passes(captured(model, inputs), PIPE, inputs)
    return gm, ctx


def test_replaces_lookups_by_one_group_call_and_one_column_split():
    model, inputs = M.BagList(), M.bag_inputs()
    gm, _ = lowered(model, inputs)
    assert not embedding_ops(gm)
    (call,) = group_calls(gm)
    assert gm.get_submodule(call.target).pooling == "sum"
    # one split by columns, one part per lookup (k slices would make k whole-width zero gradients)
    (split,) = call.users
    assert split.target is aten.split_with_sizes.default and split.args[1:] == ([8, 8, 8], 1)
    assert sorted(n.args[1] for n in split.users) == [0, 1, 2]
    assert call.meta[meta.ORIGIN] == ["embedding_bag", "embedding_bag_1", "embedding_bag_2"]
    assert_matches(model, gm, inputs, M.bag_inputs(seed=5, batch=3))


def test_weights_stay_the_models_parameters_and_state_dict_keys_do_not_change():
    model, inputs = M.SharedTables(), M.shared_inputs()
    gm, _ = lowered(model, inputs)
    (call,) = group_calls(gm)
    weights = call.args[3]
    assert [w.op for w in weights] == ["get_attr", "get_attr"]
    assert [w.target for w in weights] == ["item.weight", "cat.weight"]
    assert list(gm.state_dict()) == list(model.state_dict())
    assert_matches(model, gm, inputs)


def test_sequence_groups_hand_each_user_its_own_tensor():
    model, inputs = M.SequenceMean(), M.seq_inputs()
    gm, _ = lowered(model, inputs)
    seq_calls = [c for c in group_calls(gm) if gm.get_submodule(c.target).pooling == "none"]
    assert len(seq_calls) == 1
    assert all(u.target.__name__ == "getitem" for u in seq_calls[0].users)
    assert not calls(gm, [aten.mean.dim])  # the hand-written mean pooling is gone
    assert_matches(model, gm, inputs, M.seq_inputs(batch=2, seed=4))


def test_group_node_is_placed_before_the_first_user_of_any_member():
    model = M.BagList()
    inputs = M.bag_inputs()
    gm, _ = lowered(model, inputs)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    (call,) = group_calls(gm)
    for arg in call.all_input_nodes:
        assert order[arg] < order[call]
    first_user = min(order[u] for s in call.users for u in s.users)
    assert order[call] < first_user


def test_leaves_ungrouped_lookups_untouched():
    model, inputs = M.NotLowerable(), M.not_lowerable_inputs()
    gm, _ = lowered(model, inputs)
    assert len(embedding_ops(gm)) == 3  # max bag, max_norm, scale_grad_by_freq (dim 6 is lowered)
    assert len(group_calls(gm)) == 1


class _Uses(torch.nn.Module):
    """One table looked up five times: by the output, detached, only into an argmax, only in a
    no_grad block, and by nothing that reaches the output."""

    def __init__(self):
        super().__init__()
        self.t = torch.nn.EmbeddingBag(20, 4, mode="sum")

    def forward(self, a, b, c, d, e, offsets):
        kept, detached, arg, blocked, dead = (self.t(x, offsets) for x in (a, b, c, d, e))
        with torch.no_grad():
            z = blocked * 2
        dead * 3
        return kept + detached.detach() + arg.argmax(1, keepdim=True) + z


def test_features_no_gradient_reaches_are_marked_and_the_others_are_not():
    ids = [torch.tensor([i, i + 1, i + 2, i + 3]) for i in range(0, 15, 3)]
    inputs = (*ids, torch.tensor([0, 2]))
    model = _Uses()
    gm, _ = lowered(model, inputs)
    (call,) = group_calls(gm)
    grads = [f.grad for f in gm.get_submodule(call.target).features]
    # the dead lookup is dropped by no pass in this pipeline: it stays, marked
    assert grads == [True, False, False, False, False]
    assert_matches(model, gm, inputs, inputs)


class _ClampedInNoGrad(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.e = torch.nn.Embedding(20, 4)

    def forward(self, ids):
        x = self.e(ids)
        with torch.no_grad():
            x.clamp_(-0.5, 0.5)  # in place, not recorded: x still carries the table's gradient
        return x


def test_a_lookup_written_in_place_in_a_no_grad_block_still_carries_its_gradient():
    ids = torch.tensor([1, 2, 3])
    model = _ClampedInNoGrad()
    gm, _ = lowered(model, (ids,))
    (call,) = group_calls(gm)
    assert [f.grad for f in gm.get_submodule(call.target).features] == [True]
    assert_matches(model, gm, (ids,), (ids,))
