"""The transformed model as an nn.Module in every way a training loop uses one, and bad input named
everywhere (the reliability issue). Each test compares against the plain PyTorch model."""

import contextlib
import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxrec
from fxrec.modes import ModeError
from fxrec.testing import assert_matches, group_calls
from tests import models as M

BACKENDS = ["fbgemm", "native", "reference", "auto"]


# --------------------------------------------------------------------------- train() / eval()
class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        # a functional dropout that follows the module's mode, as CTR code often writes it
        return F.dropout(self.drop(self.lin(x)), 0.2, training=self.training)


class WithModes(nn.Module):
    """Dropout modules, a functional dropout on self.training, batch norm with running statistics,
    batch norm without (always the batch's statistics) and a sub-module set to eval on its own."""

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(30, 4, mode="sum")
        self.bn = nn.BatchNorm1d(4)
        self.bn_batch = nn.BatchNorm1d(4, track_running_stats=False)
        self.towers = nn.ModuleList([Tower(), Tower()])
        self.out = nn.Linear(8, 1)

    def forward(self, dense, ids, offsets):
        x = torch.cat([self.bn(dense), self.bn_batch(self.emb(ids, offsets))], 1)
        for t in self.towers:
            x = t(x)
        return self.out(x)


def mode_inputs(batch=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 4, generator=g), torch.randint(0, 30, (2 * batch,), generator=g), \
        torch.arange(0, 2 * batch, 2)


def run_seeded(model, x, seed):
    torch.manual_seed(seed)
    return model(*x)


@pytest.mark.parametrize("captured_in", ["train", "eval"])
def test_train_and_eval_switch_dropout_and_batch_norm_as_the_original(captured_in):
    model = WithModes().train(captured_in == "train")
    model.towers[1].eval()  # kept through the transform: tower 1 stays in eval mode until switched
    fast = fxrec.transform(model, mode_inputs(), backend="fbgemm")
    ref = copy.deepcopy(model)
    assert fast.get_submodule("towers.1").training is False and fast.get_submodule("towers.0").training is (captured_in == "train")
    for step, mode in enumerate(["train", "eval", "train", "eval", "train"]):
        for m in (fast, ref):
            getattr(m, mode)()
        x = mode_inputs(seed=step + 1)
        torch.testing.assert_close(run_seeded(fast, x, step), run_seeded(ref, x, step), msg=f"step {step} {mode}")
    for name in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        torch.testing.assert_close(fast.get_buffer(name), ref.get_buffer(name), msg=name)
    assert int(fast.bn.num_batches_tracked) == 3  # three training calls; transform itself counted none
    assert any("train()/eval() switch" in n for n in fast.report.notes), fast.report.notes


class SubclassedNorm(nn.BatchNorm1d):
    """A batch norm with a forward of its own (its flags are found by capturing the other mode)."""

    def forward(self, x):
        return super().forward(x) * 1.0


class OwnCounter(nn.Module):
    """A module of the model's own with a buffer named like batch norm's counter, counted by its code."""

    def __init__(self):
        super().__init__()
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def forward(self, x):
        self.num_batches_tracked.add_(1)
        return x


class NormsCalledTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(30, 4, mode="sum")
        self.bn = nn.BatchNorm1d(4)
        self.sub = SubclassedNorm(4)
        self.own = OwnCounter()
        self.lin = nn.Linear(4, 4)

    def forward(self, ids, offsets):
        x = self.sub(self.bn(self.emb(ids, offsets)))
        return self.own(self.sub(self.bn(self.lin(x))))


def test_batch_norms_called_twice_count_each_call_and_a_counter_of_the_models_own_counts():
    """Found by a fuzz: a batch norm called twice counted 4 batches a forward where the plain model
    counts 2 (the captured counter of its second call stayed beside fxrec's), and a subclassed one
    called twice could not switch to eval; a buffer of the model's own named num_batches_tracked
    lost its count."""
    model = NormsCalledTwice()
    fast = fxrec.transform(copy.deepcopy(model), mode_inputs()[1:])
    ref = copy.deepcopy(model)
    for step, mode in enumerate(["train", "train", "eval", "train"]):
        for m in (fast, ref):
            getattr(m, mode)()
        x = mode_inputs(seed=step + 1)[1:]
        torch.testing.assert_close(fast(*x), ref(*x), msg=f"step {step} {mode}")
    for name in ("bn.running_mean", "bn.num_batches_tracked", "sub.running_var", "sub.num_batches_tracked",
                 "own.num_batches_tracked"):
        torch.testing.assert_close(fast.get_buffer(name), ref.get_buffer(name), msg=name)
    assert int(fast.bn.num_batches_tracked) == 6 and int(fast.own.num_batches_tracked) == 4


class NormedBags(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(30, 4, mode="sum")
        self.bn = nn.BatchNorm1d(4)
        self.bn2 = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(4, 1)

    def forward(self, ids, offsets):
        return self.out(self.drop(self.bn2(self.bn(self.emb(ids, offsets)))))


@pytest.mark.parametrize("captured_in", ["train", "eval"])
def test_batch_one_is_refused_in_training_mode_only_as_batch_norm_refuses_it(captured_in):
    """torch's batch norm refuses one value per channel in training mode only. A training-mode capture
    kept that check in eval mode (batch 1 refused after .eval()); an eval-mode capture had none, and
    after .train() a batch of 1 wrote NaN into the running variance where the plain model raises."""
    model = NormedBags().train(captured_in == "train")
    fast = fxrec.transform(model, mode_inputs()[1:], backend="fbgemm")
    one = mode_inputs(batch=1, seed=5)[1:]
    for step, m in enumerate([fast, copy.deepcopy(fast), pickle.loads(pickle.dumps(fast))]):
        for x in (m, model):
            x.eval()
        torch.testing.assert_close(m(*one), model(*one), msg=f"copy {step}")  # (dropout off in eval)
        for x in (m, model):
            x.train()
        with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
            model(*one)
        with pytest.raises(ValueError, match=r"offsets.size\(\)\[0\] != 1 \(in training mode only\)"):
            m(*one)
        for name in ("bn.running_var", "bn2.running_var", "bn.running_mean"):  # (the plain bn counted the refused call)
            torch.testing.assert_close(m.get_buffer(name), model.get_buffer(name), msg=name)
    fast.train(), model.train()
    fast.bn.eval(), model.bn.eval()  # modes mixed: bn2 still refuses
    with pytest.raises(ValueError, match="in training mode only"):
        fast(*one)
    fast.bn2.eval(), model.bn2.eval()  # every batch norm in eval: taken, in a model in training mode
    torch.testing.assert_close(run_seeded(fast, one, 7), run_seeded(model, one, 7))
    fast.eval(), model.eval()
    fast.drop.train(), model.drop.train()  # (dropout's mode changes no size condition: Monte Carlo dropout)
    torch.testing.assert_close(run_seeded(fast, one, 8), run_seeded(model, one, 8))


def test_a_parent_module_switches_the_transformed_model():
    fast = fxrec.transform(WithModes(), mode_inputs(), backend="native")
    parent = nn.Sequential()
    parent.add_module("fast", fast)
    parent.eval()
    assert not fast.training and not fast.get_submodule("towers.0.drop").training
    x = mode_inputs(seed=3)
    torch.testing.assert_close(run_seeded(fast, x, 0), run_seeded(fast, x, 1))  # no dropout in eval
    parent.train()
    assert not torch.equal(run_seeded(fast, x, 0), run_seeded(fast, x, 1))


class AlwaysDrops(nn.Module):
    """F.dropout without training=: drops in eval mode too, in PyTorch and in the transformed model."""

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(30, 4)

    def forward(self, ids, offsets):
        return F.dropout(self.emb(ids, offsets), 0.5)


def test_a_functional_dropout_that_ignores_the_mode_keeps_dropping_in_eval():
    model = AlwaysDrops()
    fast = fxrec.transform(model, mode_inputs()[1:], backend="fbgemm")
    x = mode_inputs(seed=4)[1:]
    for m in (fast, model):
        m.eval()
    torch.testing.assert_close(run_seeded(fast, x, 1), run_seeded(model, x, 1))
    assert not torch.equal(run_seeded(fast, x, 1), run_seeded(fast, x, 2))


class NegatedFlag(nn.Module):
    """The model's code passes `not self.training`: the argument is the flag's negation."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 4)

    def forward(self, ids):
        e = self.emb(ids)
        return torch.cat([torch.std(e, 1, unbiased=not self.training), e.sum(1)], 1)


class MyNorm(nn.BatchNorm1d):
    def forward(self, x):  # a forward of its own, calling torch's
        return super().forward(x) * 2


class MyDrop(nn.Dropout):
    def forward(self, x):
        return super().forward(x) + 1


class Subclassed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(30, 4)
        self.norm = MyNorm(4)
        self.drop = MyDrop(0.5)

    def forward(self, ids, offsets):
        return self.drop(self.norm(self.emb(ids, offsets)))


class TiedDropout(nn.Module):
    """A tied table (an output embedding sharing the item table) and F.dropout(training=self.training):
    the other mode's capture read the table by both names, so the two graphs seemed to differ in
    more than the flag, and .eval() raised ModeError (found by the differential fuzzer)."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(30, 4, mode="sum")
        self.emb = nn.Embedding(30, 4)
        self.emb.weight = self.bag.weight
        self.top = nn.Linear(4, 1)

    def forward(self, ids, offsets):
        h = self.bag(ids, offsets) * self.emb(ids[:offsets.numel()])
        return self.top(F.dropout(h, 0.2, training=self.training))


class ScaledInTraining(nn.Module):
    """A number the code chooses by mode (0.5 in training, 2.0 in eval), in a submodule and the model."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(30, 4, mode="sum")
        self.head = Scale()

    def forward(self, ids, offsets):
        return self.head(self.bag(ids, offsets)) * (3.0 if self.training else 0.25)


class Scale(nn.Module):
    def forward(self, x):
        return x * (0.5 if self.training else 2.0)


@pytest.mark.parametrize("model_fn, inputs", [(NegatedFlag, lambda s: (torch.randint(0, 30, (5, 3), generator=s),)),
                                              (Subclassed, lambda s: mode_inputs(seed=int(s.initial_seed()))[1:]),
                                              (TiedDropout, lambda s: mode_inputs(seed=int(s.initial_seed()))[1:]),
                                              (ScaledInTraining, lambda s: mode_inputs(seed=int(s.initial_seed()))[1:])],
                         ids=["not-training", "subclasses", "tied-table", "numbers"])
def test_flags_the_models_code_passes_follow_the_mode_with_their_sign(model_fn, inputs):
    model = model_fn()
    fast = fxrec.transform(model, inputs(torch.Generator().manual_seed(0)), backend="fbgemm")
    assert fast.meta["fxrec_modes"].switchable, fast.report.notes
    for step, mode in enumerate(["train", "eval", "train", "eval"]):
        for m in (fast, model):
            getattr(m, mode)()
        x = inputs(torch.Generator().manual_seed(step + 1))
        torch.testing.assert_close(run_seeded(fast, x, step), run_seeded(model, x, step), msg=f"{mode} {step}")
    for name, b in model.named_buffers():
        torch.testing.assert_close(fast.get_buffer(name), b, msg=name)


class Transformer(nn.Module):
    """A transformer layer over a behaviour sequence (attention's dropout probability is a number
    its code sets to 0 in eval mode; the encoder's own code reads ``training`` too), as in BST."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 8, padding_idx=0)
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True)
        self.top = nn.Linear(8, 1)

    def forward(self, seq):
        return self.top(self.enc(self.emb(seq), src_key_padding_mask=seq == 0)[:, 0]).squeeze(1)


@pytest.mark.parametrize("captured_in", ["train", "eval"])
def test_a_transformer_layer_switches_modes_at_any_batch_and_length(captured_in):
    """It was captured in one mode only (ModeError: the attention's dropout probability, 0.1 in
    training and 0 in eval, is a number, and the two captures' copies before a reshape differed);
    and refused a batch or a length of 1 (found by a fuzz of well-known models)."""
    torch.manual_seed(0)
    model = getattr(Transformer(), captured_in)()
    seq = lambda b, n, s: torch.randint(1, 30, (b, n), generator=torch.Generator().manual_seed(s))  # noqa: E731
    fast = fxrec.transform(model, (seq(4, 5, 0),))
    if captured_in == "eval" and torch.__version__ < "2.13":
        # torch 2.11 records the reshape of attention's output, contiguous at the example in eval mode,
        # as a view, which the layout attention's dropout gives in training mode cannot take
        assert not fast.meta["fxrec_modes"].switchable
        with pytest.raises(ModeError, match="captured in eval mode and cannot switch to training mode"):
            fast.train()
        return
    assert fast.meta["fxrec_modes"].switchable, fast.report.notes
    assert "by_mode" in fast.code and "device(type='meta')" not in fast.code  # (no probe of capture's left in it)
    assert [n for n in fast.report.notes if n.startswith("train()/eval() switch 4 node(s) of 4 module(s) that follow "
                                                           "the mode") and n.endswith("the flags of 'enc', "
                                                           "'enc.self_attn' decide values together: they must switch "
                                                           "together (another combination raises ModeError)")], \
        fast.report.notes
    for step, mode in enumerate(["train", "eval", "train", "eval"]):
        for m in (fast, model):
            getattr(m, mode)()
        for b, n in ((1, 1), (1, 4), (3, 1), (5, 6)):
            x = (seq(b, n, step + b + n),)  # (gradients on: under no_grad attention takes torch's fused kernel)
            torch.testing.assert_close(run_seeded(fast, x, step), run_seeded(model, x, step), rtol=0, atol=0,
                                       msg=f"{mode} {step} {b} {n}")


class Tempered(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(30, 4, mode="sum")
        self.lin = nn.Linear(4, 3)

    def forward(self, ids, offsets, t, drop):
        return F.dropout(torch.softmax(self.lin(self.bag(ids, offsets)) / t, -1), 0.5, training=drop)


class ParentChooses(nn.Module):
    """The parent reads its own flag and passes a number and a flag to the child, whose ops use them."""

    def __init__(self):
        super().__init__()
        self.head = Tempered()

    def forward(self, ids, offsets):
        return self.head(ids, offsets, 0.5 if self.training else 1.0, self.training)


def test_a_number_and_a_flag_the_parent_passes_follow_the_parents_mode_not_the_childs():
    """They followed the innermost module of the op (the child): after head.eval() alone the
    transformed model divided by 1.0 and kept dropping where the model did not (found by a review)."""
    model = ParentChooses()
    fast = fxrec.transform(model, mode_inputs()[1:])
    assert fast.meta["fxrec_modes"].switchable, fast.report.notes
    switches = [lambda m: m.train(), lambda m: m.eval(), lambda m: (m.train(), m.head.eval()),
                lambda m: (m.eval(), m.head.train())]
    for step, switch in enumerate(switches):
        switch(model)
        switch(fast)
        x = mode_inputs(seed=step + 1)[1:]
        torch.testing.assert_close(run_seeded(fast, x, step), run_seeded(model, x, step), rtol=0, atol=0,
                                   msg=str(step))


class CopiesInOneMode(nn.Module):
    """A copy taken in training mode only, before a write in place to what it copies."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(30, 4, mode="sum")

    def forward(self, ids, offsets):
        base = self.bag(ids, offsets) * 1.0
        h = base.transpose(0, 1)
        s = h.clone(memory_format=torch.contiguous_format) if self.training else h
        base.mul_(2)
        return s.sum(0)


def test_a_copy_in_one_mode_before_a_write_in_place_keeps_the_captured_mode():
    """Copies were left out of the comparison of the two modes' graphs, so these compared equal, and
    eval mode gave the training copy's values (found by a review): they are left out only where
    neither the tensor nor the copy is written in place."""
    model = CopiesInOneMode()
    fast = fxrec.transform(model, mode_inputs()[1:])
    with pytest.raises(ModeError, match="captured in training mode and cannot switch to eval mode"):
        fast.eval()
    torch.testing.assert_close(fast(*mode_inputs(seed=1)[1:]), model(*mode_inputs(seed=1)[1:]))


class Flagged(nn.Module):
    """A module with no parameters whose flag the model's code reads."""


class NestedChoice(nn.Module):
    """A dropout probability chosen from two submodules' flags (one read only when the other is off)."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(30, 4, mode="sum")
        self.a, self.b = Flagged(), Flagged()

    def forward(self, ids, offsets):
        p = 0.1 if self.a.training else (0.6 if self.b.training else 0.9)
        return F.dropout(self.bag(ids, offsets), p)


def test_a_value_two_modules_flags_decide_follows_them_switched_together_and_refuses_them_apart():
    """Only the captured combination of their flags and its flip are known: a submodule switched
    alone gave the value of the other combination (found by a review), as did a capture with them in
    different modes switched with the model."""
    model = NestedChoice()
    fast = fxrec.transform(model, mode_inputs()[1:])
    for step, mode in enumerate(["eval", "train", "eval"]):
        for m in (fast, model):
            getattr(m, mode)()
        x = mode_inputs(seed=step + 1)[1:]
        torch.testing.assert_close(run_seeded(fast, x, step), run_seeded(model, x, step), rtol=0, atol=0)
    fast.train()
    fast.a.eval()
    with pytest.raises(ModeError, match=r"reads the training flag of 'a', 'b' for one value.*another combination now"):
        fast(*mode_inputs()[1:])
    mixed = NestedChoice()
    mixed.b.eval()
    fast = fxrec.transform(mixed, mode_inputs()[1:])
    torch.testing.assert_close(run_seeded(fast, mode_inputs()[1:], 0), run_seeded(mixed, mode_inputs()[1:], 0))
    fast.eval()  # (a and b both off: neither combination captured)
    with pytest.raises(ModeError, match="another combination now"):
        fast(*mode_inputs()[1:])


class Sibling(nn.Module):
    def scale(self):
        return 2.0 if self.training else 3.0


class ScaledBySibling(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, h, s):
        return F.dropout(self.lin(h), 0.5, self.training) * s


class SiblingDecides(nn.Module):
    """A sibling's flag decides a number another module's operation uses (its own flag its dropout)."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(30, 4, mode="sum")
        self.sib, self.child = Sibling(), ScaledBySibling()

    def forward(self, ids, offsets):
        return self.child(self.bag(ids, offsets), self.sib.scale())


def test_a_value_another_modules_flag_decides_in_a_model_captured_with_them_in_different_modes_is_refused():
    """Captured with the sibling in eval mode, train() / eval() of the whole model reach combinations
    neither capture had, and the transformed model multiplied by the wrong number (found by a review);
    captured in one mode they switch, and the sibling switched alone is refused."""
    mixed = SiblingDecides()
    mixed.sib.eval()
    fast = fxrec.transform(mixed, mode_inputs()[1:])
    assert not fast.meta["fxrec_modes"].switchable
    with pytest.raises(ModeError, match=r"flag of 'sib' may decide a value of another module's operation"):
        fast.eval()
    model = SiblingDecides()
    fast = fxrec.transform(model, mode_inputs()[1:])
    for step, mode in enumerate(["eval", "train"]):
        for m in (fast, model):
            getattr(m, mode)()
        x = mode_inputs(seed=step + 1)[1:]
        torch.testing.assert_close(run_seeded(fast, x, step), run_seeded(model, x, step), rtol=0, atol=0)
    fast.sib.eval()
    with pytest.raises(ModeError, match="another combination now"):
        fast(*mode_inputs()[1:])


class FrozenBackbone(nn.Module):
    """train() overridden to keep a pretrained part (with batch norm) in eval mode, as users freeze one."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(30, 4, mode="sum")
        self.frozen = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.head = nn.Sequential(nn.Dropout(0.3), nn.Linear(4, 2))

    def train(self, mode=True):
        super().train(mode)
        self.frozen.eval()
        return self

    def forward(self, ids, offsets):
        return self.head(self.frozen(self.bag(ids, offsets)))


@pytest.mark.parametrize("captured_in", ["train", "eval"])
def test_the_models_own_train_override_is_followed(captured_in):
    """fast.train() set every module's flag as nn.Module.train does, so the frozen batch norm trained
    on the batch and moved its running statistics where the model's did not (found by a review)."""
    torch.manual_seed(0)
    model = getattr(FrozenBackbone(), captured_in)()
    fast = fxrec.transform(model, mode_inputs()[1:])
    for step, mode in enumerate(["train", "eval", "train"]):
        for m in (fast, model):
            getattr(m, mode)()
        assert fast.frozen[1].training is False
        x = mode_inputs(seed=step + 1)[1:]
        torch.testing.assert_close(run_seeded(fast, x, step), run_seeded(model, x, step), rtol=0, atol=0)
    for name, b in model.named_buffers():
        torch.testing.assert_close(fast.get_buffer(name), b, msg=name)
    assert [p.requires_grad for p in model.parameters()] == [True] * len(list(model.parameters()))


class Branches(nn.Module):
    def forward(self, x):
        return x * 2 if self.training else x + 1


class ChildBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(30, 4, mode="sum")
        self.child = Branches()

    def forward(self, ids, offsets):
        return self.child(self.bag(ids, offsets))


def test_a_model_that_cannot_switch_refuses_a_submodule_switched_alone():
    """train() / eval() of the model raise ModeError; a submodule switched alone went unnoticed and
    the captured mode's code ran."""
    model = ChildBranches()
    fast = fxrec.transform(model, mode_inputs()[1:])
    assert not fast.meta["fxrec_modes"].switchable
    fast.child.eval()
    with pytest.raises(ModeError, match=r"reads the training flag of 'child'.*in the modes they were captured in"):
        fast(*mode_inputs()[1:])
    fast.child.train()
    torch.testing.assert_close(fast(*mode_inputs()[1:]), model(*mode_inputs()[1:]))


def test_batch_norm_with_a_cumulative_average_keeps_its_captured_mode():
    """momentum=None: the running average depends on the mode in a way no flag shows, and torch.export
    cannot capture it in training mode at all."""
    model = nn.Sequential(nn.EmbeddingBag(30, 4), nn.BatchNorm1d(4, momentum=None)).eval()

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, ids, offsets):
            return self.m[1](self.m[0](ids, offsets))

    wrapped = Wrap().eval()
    fast = fxrec.transform(wrapped, mode_inputs()[1:], backend="fbgemm")
    with pytest.raises(ModeError, match=r"captured in eval mode and cannot switch to training mode.*cannot be "
                                        r"captured in the other mode"):
        fast.train()
    torch.testing.assert_close(fast(*mode_inputs(seed=1)[1:]), wrapped(*mode_inputs(seed=1)[1:]))


class ModeBranch(nn.Module):
    """Computes something else in training mode than dropout: cannot be switched by flags."""

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(30, 4)

    def forward(self, ids, offsets):
        e = self.emb(ids, offsets)
        return e * 2 if self.training else e + 1


def test_a_model_whose_code_branches_on_training_refuses_the_other_mode_by_name():
    model = ModeBranch()
    fast = fxrec.transform(model, mode_inputs()[1:], backend="fbgemm")
    assert any("reads `training`" in n and "test_reliability.py" in n for n in fast.report.notes), fast.report.notes
    with pytest.raises(ModeError, match=r"captured in training mode and cannot switch to eval mode.*test_reliability"):
        fast.eval()
    fast.train()  # the captured mode stays available, and computes what the model does in it
    x = mode_inputs(seed=2)[1:]
    torch.testing.assert_close(fast(*x), model(*x))


# --------------------------------------------------------------------------- inference mode
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make", [(M.BagList, M.bag_inputs), (M.SequenceMean, M.seq_inputs),
                                  (M.WeightedBags, M.weighted_inputs)], ids=["bags", "sequence", "weighted"])
def test_inference_mode_on_every_backend(backend, make):
    model_fn, inputs = make
    model = model_fn().eval()
    fast = fxrec.transform(model, inputs(), backend=backend, timing_rounds=1)
    x = inputs(seed=5)
    with torch.inference_mode():
        got = fast(*x)
    torch.testing.assert_close(got, model(*x))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt", [None, "sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("on_device", [False, True], ids=["cpu", "as-on-cuda"])
def test_a_first_call_under_inference_mode_leaves_the_model_trainable(backend, opt, on_device):
    """A validation pass before training (or after deepcopy / .to()): fbgemm's TBE was built in
    inference mode, the tables became inference tensors, and the next training step failed
    ("Inference tensors cannot be saved for backward"; row-wise Adagrad failed in the call).
    ``as-on-cuda``: the groups run as on CUDA (sync_free), where the device's bounds check, built
    at the first call, was made of inference tensors that its next training call writes."""
    from fxrec.runtime._tracing import sync_free

    with sync_free() if on_device else contextlib.nullcontext():
        _first_call_under_inference_mode(backend, opt)


def _first_call_under_inference_mode(backend, opt):
    torch.manual_seed(0)
    model = M.BagList()
    table_opt = {None: None, "sgd": fxrec.optim.SGD(lr=0.1), "rowwise_adagrad": fxrec.optim.RowWiseAdagrad(lr=0.1)}[opt]
    fast = fxrec.transform(copy.deepcopy(model), M.bag_inputs(), optimizer=table_opt, backend=backend)
    ref = fxrec.transform(copy.deepcopy(model), M.bag_inputs(), optimizer=table_opt, backend=backend)
    for m in (fast, copy.deepcopy(fast)):
        with torch.inference_mode():
            torch.testing.assert_close(m(*M.bag_inputs(seed=1)), ref(*M.bag_inputs(seed=1)))
        assert not any(p.is_inference() for p in m.parameters())
    opts = [m.make_optimizer(torch.optim.SGD, lr=0.1) for m in (fast, ref)]
    for step in range(2):
        x = M.bag_inputs(seed=2 + step)
        for m, o in zip((fast, ref), opts):
            m(*x).square().sum().backward()
            o.step(), o.zero_grad()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(fast.state_dict()[k], v, msg=k)
    fast.requires_grad_(True)


def test_inference_mode_on_quantized_groups():
    model = M.BagList().eval()
    fast = fxrec.transform(model, M.bag_inputs(), mode="inference", quantize="fp32")
    x = M.bag_inputs(seed=5)
    with torch.inference_mode():
        torch.testing.assert_close(fast(*x), model(*x))


# --------------------------------------------------------------------------- pickle, deepcopy, compile
class Containers(nn.Module):
    def __init__(self):
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(20, 4, mode="sum") for _ in range(2))
        self.top = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 1))
        self.heads = nn.ModuleDict({"ctr": nn.Linear(1, 1), "cvr": nn.Linear(1, 1)})

    def forward(self, a, b):
        x = self.top(torch.cat([self.bags[0](a), self.bags[1](b)], 1))
        return self.heads["ctr"](x) + self.heads["cvr"](x)


def test_module_lists_sequentials_and_dicts_are_indexed_as_the_models_were():
    """fx made every holder a plain nn.Module: fast.bags[0] was a TypeError."""
    model = Containers()
    x = (torch.randint(0, 20, (3, 2)), torch.randint(0, 20, (3, 2)))
    fast = fxrec.transform(model, x)
    for m in (fast, copy.deepcopy(fast), pickle.loads(pickle.dumps(fast))):
        assert m.bags[1].weight is m.get_parameter("bags.1.weight")
        assert torch.equal(m.bags[-1].weight, model.bags[1].weight)
        assert len(m.bags) == 2 and [b.weight.shape for b in m.bags] == [(20, 4), (20, 4)]
        assert len(m.top) == 3 and m.top[2].bias is m.get_parameter("top.2.bias") and m.top[-1] is m.top[2]
        assert list(m.heads) == ["ctr", "cvr"] and m.heads["cvr"].weight is m.get_parameter("heads.cvr.weight")
        assert "ctr" in m.heads and [k for k, _ in m.heads.items()] == ["ctr", "cvr"]
        with pytest.raises(KeyError, match=r"member '1' of this Sequential holds no parameters or buffers"):
            m.top[1]
        with pytest.raises(IndexError, match=r"index 3 is out of range for a 3-member Sequential"):
            m.top[3]
        with pytest.raises(KeyError, match=r"'ctcvr' is not a key of this ModuleDict"):
            m.heads["ctcvr"]
        assert sorted(m.state_dict()) == sorted(model.state_dict())


class ParameterContainers(nn.Module):
    def __init__(self):
        super().__init__()
        self.pl = nn.ParameterList([nn.Parameter(torch.randn(10, 4)) for _ in range(2)])
        self.pd = nn.ParameterDict({"a": nn.Parameter(torch.randn(10, 4))})

    def forward(self, i):
        return F.embedding(i, self.pl[0]) + F.embedding(i, self.pl[1]) + F.embedding(i, self.pd["a"])


def test_parameter_lists_and_dicts_are_indexed_as_the_models_were():
    model = ParameterContainers()
    fast = fxrec.transform(model, (torch.randint(0, 10, (3,)),))
    assert fast.pl[1] is fast.get_parameter("pl.1") and fast.pl[-1] is fast.pl[1] and len(fast.pl) == 2
    assert fast.pd["a"] is fast.get_parameter("pd.a") and list(fast.pd) == ["a"]


class ConstantIndex(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(10, 4, mode="sum")

    def forward(self, ids, offsets):
        return self.emb(ids, offsets)[:, torch.tensor([0, 2])]  # (a constant the graph holds: lifted_tensor_0)


def test_a_deepcopy_has_the_original_models_state_dict_keys():
    """fx's deepcopy registered the graph's tensor constants as buffers: state_dict() listed
    'lifted_tensor_0', and the plain model's state_dict no longer loaded."""
    model = ConstantIndex()
    x = (torch.randint(0, 10, (8,)), torch.arange(0, 8, 2))
    fast = fxrec.transform(model, x)
    for m in (fast, copy.deepcopy(fast), pickle.loads(pickle.dumps(fast))):
        assert sorted(m.state_dict()) == sorted(model.state_dict())
        m.load_state_dict(model.state_dict())
        torch.testing.assert_close(m(*x), model(*x))


class ConstantOnInputsDevice(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(10, 4, mode="sum")

    def forward(self, ids, offsets):
        # made on the inputs' device in the plain model; one constant of the graph (lifted_tensor_0)
        return self.emb(ids, offsets) * torch.tensor([1.0, 2.0, 3.0, 4.0], device=ids.device)


def _constants(m):
    return {n.target: m.get_submodule(n.target.rpartition(".")[0]).__dict__[n.target.rpartition(".")[2]]
            for n in m.graph.nodes if n.op == "get_attr" and "lifted" in n.target}


def test_the_graphs_tensor_constants_follow_the_model_to_another_device_and_keep_their_dtype():
    """A tensor made in forward on the inputs' device is a constant of the graph: it must follow
    .to() / .cuda() as the parameters do (it stayed on the capture device, so the model failed on
    CUDA inputs), in a deepcopy too, without becoming a buffer or changing dtype under .double()."""
    model = ConstantOnInputsDevice()
    x = (torch.randint(0, 10, (8,)), torch.arange(0, 8, 2))
    fast = fxrec.transform(model, x)
    assert [c.device.type for c in _constants(fast).values()] == ["cpu"]
    fast.double()  # (a dtype change: the constant keeps fp32, as the plain model's tensor does)
    assert [c.dtype for c in _constants(fast).values()] == [torch.float32]
    fast.float()
    for m in (copy.deepcopy(fast).to("meta"), fast.to("meta")):
        assert [c.device.type for c in _constants(m).values()] == ["meta"]
        assert sorted(m.state_dict()) == sorted(model.state_dict())


@pytest.mark.parametrize("how", ["to_meta", "pickle_onto_meta", "pickle_of_a_model_on_meta", "deepcopy_on_meta"])
@pytest.mark.parametrize("kw", [{}, {"mode": "inference", "quantize": "int8"}], ids=["fp32", "int8"])
def test_the_graphs_tensor_constants_keep_their_values_through_meta_and_to_empty(how, kw):
    """A graph constant is code, not state: no state_dict brings it back. Sent to meta (.to("meta"),
    or torch.load(map_location="meta") of a pickle) and given memory again by to_empty, it was
    uninitialised memory, and the model answered otherwise than it was saved, silently."""
    model = ConstantOnInputsDevice().eval() if kw else ConstantOnInputsDevice()
    x = (torch.randint(0, 10, (8,)), torch.arange(0, 8, 2))
    fast = fxrec.transform(model, x, **kw)
    with torch.no_grad():
        want = fast(*x)
    state = {k: v.clone() for k, v in fast.state_dict().items()}

    def pickled(m):
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        return torch.load(buf, map_location="meta" if how == "pickle_onto_meta" else None, weights_only=False)

    there = {"to_meta": lambda: copy.deepcopy(fast).to("meta"),
             "pickle_onto_meta": lambda: pickled(fast),
             "pickle_of_a_model_on_meta": lambda: pickled(copy.deepcopy(fast).to("meta")),
             "deepcopy_on_meta": lambda: copy.deepcopy(copy.deepcopy(fast).to("meta"))}[how]()
    assert [c.device.type for c in _constants(there).values()] == ["meta"]
    here = there.to_empty(device="cpu")
    assert [c.tolist() for c in _constants(here).values()] == [[1.0, 2.0, 3.0, 4.0]]
    here.load_state_dict(state)
    assert sorted(here.state_dict()) == sorted(state)
    with torch.no_grad():
        assert torch.equal(here(*x), want)


@pytest.mark.parametrize("kw", [{}, {"mode": "inference", "quantize": "int8"}], ids=["fp32", "int8"])
def test_load_state_dict_with_assign_onto_a_model_on_meta_is_refused_saying_what_to_do(kw):
    """assign=True reaches the parameters and buffers, not the graph's constants and devices: the
    first call failed blaming the inputs' device (fp32), or copying out of meta (quantized)."""
    model = ConstantOnInputsDevice().eval() if kw else ConstantOnInputsDevice()
    x = (torch.randint(0, 10, (8,)), torch.arange(0, 8, 2))
    fast = fxrec.transform(model, x, **kw)
    state = fast.state_dict()
    holder = nn.ModuleDict({"fast": copy.deepcopy(fast).to("meta")})  # (reached from a parent's load too)
    for target, saved in ((copy.deepcopy(fast).to("meta"), state),
                          (holder, {f"fast.{k}": v for k, v in state.items()})):
        with pytest.raises(ValueError, match=r"assign=True.*on meta.*to_empty"):
            target.load_state_dict(saved, assign=True)
    fast.load_state_dict(state, assign=True)  # (a model that is not on meta: as torch does it)
    with torch.no_grad():
        torch.testing.assert_close(fast(*x), model(*x), rtol=0, atol=0 if not kw else 0.05)


@pytest.mark.parametrize("opt", ["rowwise_adagrad", "adagrad", "lazy_adam"])
@pytest.mark.parametrize("backend", ["fbgemm", "reference"])
def test_fused_states_of_a_model_loaded_on_meta_start_fresh_or_load_with_the_optimizer(opt, backend):
    """A trained model with fused states, loaded on meta and given memory by to_empty: its first
    call copied the states out of meta and crashed. The states start as a new optimizer's (fbgemm
    makes them), and ``opt.load_state_dict`` of the saved optimizer state resumes it exactly."""
    make = {"rowwise_adagrad": lambda: fxrec.optim.RowWiseAdagrad(lr=0.1),
            "adagrad": lambda: fxrec.optim.Adagrad(lr=0.1), "lazy_adam": lambda: fxrec.optim.LazyAdam(lr=0.01)}[opt]
    x = (torch.randint(0, 10, (8,)), torch.arange(0, 8, 2))
    torch.manual_seed(0)
    fast = fxrec.transform(ConstantOnInputsDevice(), x, optimizer=make(), backend=backend)

    def train(m, o, steps):
        for _ in range(steps):
            m(*x).square().sum().backward()
            o.step()
            o.zero_grad()
        return {k: v.clone() for k, v in m.state_dict().items()}

    trained = fast.make_optimizer()
    train(fast, trained, 3)
    state, opt_state = {k: v.clone() for k, v in fast.state_dict().items()}, copy.deepcopy(trained.state_dict())
    buf = io.BytesIO()
    torch.save(fast, buf)

    def loaded():
        buf.seek(0)
        m = torch.load(buf, map_location="meta", weights_only=False).to_empty(device="cpu")
        m.load_state_dict(state)
        return m, m.make_optimizer()

    fresh = fxrec.transform(ConstantOnInputsDevice(), x, optimizer=make(), backend=backend)
    fresh.load_state_dict(state)
    want_fresh = train(fresh, fresh.make_optimizer(), 2)
    m, o = loaded()
    assert all(torch.equal(v, want_fresh[k]) for k, v in train(m, o, 2).items())
    m, o = loaded()
    o.load_state_dict(copy.deepcopy(opt_state))
    want = train(fast, trained, 2)
    assert all(torch.equal(v, want[k]) for k, v in train(m, o, 2).items())


class PaddedMeanAndNarrow(nn.Module):
    """A mean bag with padding (fbgemm's path keeps, per output column, its feature) and a table of
    dim 6 (stored 8 wide in the TBE: the output's real columns picked): tensors a group makes once
    per device."""

    def __init__(self):
        super().__init__()
        self.mean = nn.EmbeddingBag(25, 8, mode="mean", padding_idx=3)
        self.narrow = nn.EmbeddingBag(30, 6, mode="sum")

    def forward(self, ids, more):
        return torch.cat([self.mean(ids), self.narrow(more)], 1)


@pytest.mark.parametrize("kw", [{"backend": "fbgemm"},
                                {"backend": "fbgemm", "optimizer": fxrec.optim.RowWiseAdagrad(lr=0.1)}],
                         ids=["fbgemm", "fbgemm_fused"])
def test_a_groups_per_device_tensors_are_made_again_after_a_pickle_lands_elsewhere(kw):
    """A group's tensors made once per device were pickled with their device as key: loaded with
    map_location="meta", the meta tensor was found under "cpu" after to_empty, and the padded mean
    bag's output was garbage (no error)."""
    ids = torch.randint(0, 25, (5, 3))
    ids[1] = 3  # a bag of padding only
    x = (ids, torch.randint(0, 30, (5, 2)))
    model = PaddedMeanAndNarrow()
    fast = fxrec.transform(model, x, **kw)
    with torch.no_grad():
        want = fast(*x)
    state = {k: v.clone() for k, v in fast.state_dict().items()}
    buf = io.BytesIO()
    torch.save(fast, buf)
    for where in ("meta", None):
        buf.seek(0)
        back = torch.load(buf, map_location=where, weights_only=False)
        if where == "meta":
            back = back.to_empty(device="cpu")
        back.load_state_dict(state)
        with torch.no_grad():
            assert torch.equal(back(*x), want), where
    torch.testing.assert_close(want, model(*x), rtol=0, atol=1e-6)


@pytest.mark.requires_cuda
def test_a_model_transformed_on_cpu_with_a_constant_runs_on_cuda_inputs_after_cuda():
    model = ConstantOnInputsDevice()
    x = (torch.randint(0, 10, (8,)), torch.arange(0, 8, 2))
    fast = fxrec.transform(model, x)
    for m in (copy.deepcopy(fast).cuda(), fast.cuda()):
        xc = tuple(t.cuda() for t in x)
        torch.testing.assert_close(m(*xc), model.cuda()(*xc))


class DevicesWrittenAtCapture(nn.Module):
    """A 2-D bag (F.embedding_bag makes its offsets with ``arange(..., device=ids.device)``) and a
    tensor made in forward on the inputs' device: capture writes the example's device into both."""

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(10, 4, mode="sum")
        self.top = nn.Linear(4, 1)

    def forward(self, ids):
        return self.top(self.emb(ids) + torch.ones(ids.shape[0], 4, device=ids.device))


def _devices_written(m):
    return [n.kwargs["device"] for n in m.graph.nodes if n.op == "call_function" and "device" in n.kwargs]


def test_the_devices_written_in_the_graph_follow_the_model_to_another_device():
    """The graph's device arguments stayed the capture device: a model transformed on CPU and moved
    to CUDA made the 2-D bag's offsets on the CPU beside the user's CUDA ids. They follow the
    parameters, as torch.export's move_to_device_pass moves an exported program's; a dtype change
    leaves them."""
    model = DevicesWrittenAtCapture()
    x = (torch.randint(0, 10, (6, 3)),)
    fast = fxrec.transform(model, x)
    assert [torch.device(d) for d in _devices_written(fast)] == [torch.device("cpu")] * 2
    code = fast.code
    fast.double().float()
    assert fast.code == code
    twin = copy.deepcopy(fast).to("meta")
    assert [torch.device(d) for d in _devices_written(twin)] == [torch.device("meta")] * 2
    assert [torch.device(d) for d in _devices_written(fast)] == [torch.device("cpu")] * 2
    twin.to_empty(device="cpu")
    assert [torch.device(d) for d in _devices_written(twin)] == [torch.device("cpu")] * 2
    twin.load_state_dict(model.state_dict())
    for m in (fast, twin):
        torch.testing.assert_close(m(*x), model(*x), rtol=0, atol=0)


def test_the_devices_written_in_the_graph_follow_a_model_loaded_onto_another_device():
    """torch.load(..., map_location=) moves the tensors of a pickled model but not its graph: a model
    pickled on CPU and loaded onto CUDA kept making the 2-D bag's offsets on the CPU. The graph's
    devices now follow, nested blocks' too (here onto meta, and back by to_empty)."""
    for model in (DevicesWrittenAtCapture(), DeviceInANoGradBlock()):
        x = (torch.randint(0, 10, (6, 3)),)
        fast = fxrec.transform(model, x)
        buf = io.BytesIO()
        torch.save(fast, buf)
        buf.seek(0)
        there = torch.load(buf, map_location="meta", weights_only=False)
        written = [torch.device(d) for m in there.modules() if isinstance(m, torch.fx.GraphModule)
                   for d in _devices_written(m)]
        assert len(written) >= 2 and set(written) == {torch.device("meta")}, written
        there.to_empty(device="cpu")
        there.load_state_dict(model.state_dict())
        torch.testing.assert_close(there(*x), model(*x), rtol=0, atol=0)
        buf.seek(0)
        here = torch.load(buf, weights_only=False)  # (loaded where it was: as it was)
        assert [torch.device(d) for d in _devices_written(here)] == [torch.device(d) for d in _devices_written(fast)]


class DeviceInANoGradBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(10, 4, mode="sum")

    def forward(self, ids):
        with torch.no_grad():  # (captured as a nested graph module)
            bias = torch.ones(ids.shape[0], 4, device=ids.device)
        return self.emb(ids) + bias


def test_the_devices_written_in_a_nested_block_follow_the_model_too():
    """(the review: a no_grad block's graph kept the capture device, and the call failed after a move)"""
    model = DeviceInANoGradBlock()
    x = (torch.randint(0, 10, (6, 3)),)
    fast = fxrec.transform(model, x)
    twin = copy.deepcopy(fast).to("meta")
    written = [torch.device(d) for m in twin.modules() if isinstance(m, torch.fx.GraphModule) for d in _devices_written(m)]
    assert len(written) >= 2 and set(written) == {torch.device("meta")}, written
    twin.to_empty(device="cpu")
    twin.load_state_dict(model.state_dict())
    torch.testing.assert_close(twin(*x), model(*x), rtol=0, atol=0)


@pytest.mark.requires_cuda
def test_a_model_transformed_on_cpu_with_devices_written_in_its_graph_runs_on_cuda_after_cuda():
    model = DevicesWrittenAtCapture()
    x = (torch.randint(0, 10, (6, 3)),)
    fast = fxrec.transform(model, x)
    for m in (copy.deepcopy(fast).cuda(), fast.cuda()):
        xc = (x[0].cuda(),)
        torch.testing.assert_close(m(*xc), model.cuda()(*xc))


@pytest.mark.parametrize("how", ["pickle", "torch.save", "deepcopy"])
def test_save_and_copy_keep_the_model_its_report_and_fused_states(how, tmp_path):
    model = M.BagList(dim=8)
    fast = fxrec.transform(model, M.bag_inputs(), optimizer=fxrec.optim.Adagrad(lr=0.1), backend="fbgemm")
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.Adagrad([p for n, p in ref.named_parameters() if n.startswith("bags")], lr=0.1)
    opt = fast.make_optimizer(torch.optim.SGD, lr=0.0)
    for step in range(2):
        x = M.bag_inputs(seed=step)
        fast(*x).sum().backward()
        opt.step()
        opt.zero_grad()
        ref(*x).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    if how == "pickle":
        other = pickle.loads(pickle.dumps(fast))
    elif how == "torch.save":
        buf = io.BytesIO()
        torch.save(fast, buf)
        buf.seek(0)
        other = torch.load(buf, weights_only=False)
    else:
        other = copy.deepcopy(fast)
    assert type(other).__mro__[1] is fxrec.graph_module.TransformedModule
    assert str(other.report) == str(fast.report)
    assert other.code == fast.code
    x = M.bag_inputs(seed=7)
    torch.testing.assert_close(other(*x), fast(*x))
    other.eval()
    other.train()
    # training goes on from the same fused Adagrad states in the copy
    opt2 = other.make_optimizer(torch.optim.SGD, lr=0.0)
    other(*x).sum().backward()
    opt2.step()
    ref(*x).sum().backward()
    ref_opt.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(other.state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("backend", ["fbgemm", "native"])
def test_torch_compile_runs_the_dense_parts_and_the_groups_as_they_are(backend):
    model = M.BagList()
    fast = fxrec.transform(model, M.bag_inputs(), backend=backend)
    compiled = torch.compile(fast, dynamic=True)
    for batch, seed in ((6, 1), (9, 2)):
        x = M.bag_inputs(batch=batch, seed=seed)
        for m in (model, fast):
            m.zero_grad()
        cot = torch.randn(batch, 32)
        (compiled(*x) * cot).sum().backward()
        (model(*x) * cot).sum().backward()
        torch.testing.assert_close(compiled(*x), model(*x))
        for name, p in model.named_parameters():
            torch.testing.assert_close(fast.get_parameter(name).grad, p.grad, msg=name)


class EightBags(nn.Module):
    def __init__(self):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(30, 4) for _ in range(8)])
        self.top = nn.Linear(32, 1)

    def forward(self, ids, offsets):
        return self.top(torch.cat([b(i, o) for b, i, o in zip(self.bags, ids, offsets)], 1))


def test_torch_compile_breaks_the_graph_only_around_the_groups():
    """The generated forward's reads of the parameters (eight in a row: one fxrec_attrs call) and
    the input size check are traced by torch.compile; the group (torch.compiler.disable) is the
    one break."""
    from torch._dynamo.utils import counters

    def batch(b, seed):
        g = torch.Generator().manual_seed(seed)
        return ([torch.randint(0, 30, (2 * b,), generator=g) for _ in range(8)],
                [torch.arange(0, 2 * b, 2) for _ in range(8)])

    model = EightBags()
    fast = fxrec.transform(model, batch(4, 0), backend="fbgemm")
    assert "fxrec_attrs(self, ('bags',), (('0', '1', " in fast.code, fast.code
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fast, dynamic=True, backend="eager")
    for b, seed in ((6, 1), (9, 2)):
        torch.testing.assert_close(compiled(*batch(b, seed)), model(*batch(b, seed)))
    breaks = {k.split("\n")[0][:80]: v for k, v in counters["graph_break"].items()}
    assert len(breaks) == 1 and "disable" in next(iter(breaks)), breaks
    ids, offsets = batch(6, 3)
    with pytest.raises(ValueError, match=r"input ids\[3\] .*has 2 dims"):
        compiled(ids[:3] + [ids[3].view(-1, 2)] + ids[4:], offsets)


class OddEven(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(30, 4)
        self.lin = nn.Linear(4, 4)

    def forward(self, ids, offsets, dense):
        d = dense * 2 if dense.shape[0] % 2 == 0 else dense - 100  # a branch on a size, taken at capture
        return torch.cat([self.lin(d), self.emb(ids, offsets)], 1)


def odd_even_inputs(batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 30, (2 * batch,), generator=g), torch.arange(0, 2 * batch, 2), torch.randn(batch, 4, generator=g)


def test_fxrec_tells_torch_export_from_torch_compile():
    """fxrec skips its value-reading checks and runs export's forms only under torch.export; torch
    2.11's torch.compile answers torch.compiler.is_exporting() with True (fxrec reads the flag)."""
    from fxrec.runtime._tracing import exporting

    seen = {}

    class Probe(nn.Module):
        def forward(self, x):
            seen[tag] = exporting()
            return x + 1

    tag = "compile"
    torch.compile(Probe(), backend="eager")(torch.ones(3))
    tag = "export"
    torch.export.export(Probe(), (torch.ones(3),), strict=False)
    tag = "eager"
    Probe()(torch.ones(3))
    assert seen == {"compile": False, "export": True, "eager": False}


def test_torch_compile_keeps_the_input_checks():
    model = OddEven()
    fast = fxrec.transform(model, odd_even_inputs(6), backend="native")
    compiled = torch.compile(fast, dynamic=True, backend="eager")
    torch.testing.assert_close(compiled(*odd_even_inputs(8, 1)), model(*odd_even_inputs(8, 1)))
    with pytest.raises(ValueError, match=r"a condition on their sizes .*\(dense.size\(\)\[0\] % 2\) == 0"):
        compiled(*odd_even_inputs(5, 2))


@pytest.mark.parametrize("bad", [None, 3])
def test_torch_compile_names_an_input_that_is_not_a_tensor(bad):
    """Compiled as eager: a None or an int where a tensor goes is an error naming the input (it
    failed inside the size check's reads with a bare TypeError)."""
    model = OddEven()
    fast = fxrec.transform(model, odd_even_inputs(6), backend="native")
    compiled = torch.compile(fast, dynamic=True, backend="eager")
    ids, offsets, dense = odd_even_inputs(8, 1)
    article = "an" if isinstance(bad, int) else "a"
    with pytest.raises(ValueError, match=rf"input offsets \(.*\) is {article} {type(bad).__name__}, not a tensor"):
        compiled(ids, bad, dense)
    torch.testing.assert_close(compiled(ids, offsets, dense), model(ids, offsets, dense))  # and it still runs


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(30, 4)

    def forward(self, ids, offsets, scale: float, shift: int):
        return self.emb(ids, offsets) * scale + shift


def test_inputs_that_are_not_tensors_hold_their_captured_values():
    model = Scaled()
    x = mode_inputs()[1:]
    fast = fxrec.transform(model, x + (2.0, 3), backend="fbgemm")
    torch.testing.assert_close(fast(*x, 2.0, 3), model(*x, 2.0, 3))
    with pytest.raises(ValueError, match=r"input scale is 5.0; the model was captured with 2.0 there"):
        fast(*x, 5.0, 3)


# --------------------------------------------------------------------------- batch sizes
class TwoDimIds(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag2d = nn.EmbeddingBag(20, 4, mode="mean")
        self.last = nn.EmbeddingBag(20, 4, mode="sum", include_last_offset=True)
        self.lin = nn.Linear(3, 4)

    def forward(self, dense, ids2d, ids, offsets):
        return torch.cat([self.lin(dense), self.bag2d(ids2d), self.last(ids, offsets)], 1)


def two_dim_inputs(batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (batch,), generator=g)
    return (torch.rand(batch, 3, generator=g), torch.randint(0, 20, (batch, 2), generator=g),
            torch.randint(0, 20, (int(lengths.sum()),), generator=g),
            torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_of_one_after_an_example_batch_of_three(backend):
    model = TwoDimIds()
    fast = fxrec.transform(model, two_dim_inputs(3), backend=backend, timing_rounds=1)
    assert not any("accepts" in n for n in fast.report.notes), fast.report.notes
    assert_matches(model, fast, two_dim_inputs(1, 1), two_dim_inputs(2, 2), two_dim_inputs(9, 3))


class NeedsFour(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(20, 4)

    def forward(self, dense, ids2d):
        torch._check(dense.shape[0] >= 4)
        return dense + self.emb(ids2d)


def test_report_names_restricted_sizes_and_errors_say_them():
    model = NeedsFour()
    fast = fxrec.transform(model, (torch.rand(5, 4), torch.randint(0, 20, (5, 2))), backend="fbgemm")
    assert any("accepts sizes 4 or more in dense dim 0" in n for n in fast.report.notes), fast.report.notes
    with pytest.raises(ValueError, match=r"input dense has size 2 in dim 0; the model accepts 4 or more there"):
        fast(torch.rand(2, 4), torch.randint(0, 20, (2, 2)))


# --------------------------------------------------------------------------- input errors
@pytest.fixture(scope="module")
def weighted():
    model = M.WeightedBags()
    return model, fxrec.transform(model, M.weighted_inputs(), backend="fbgemm")


def test_two_dim_offsets_name_the_input(weighted):
    _, fast = weighted
    x = list(M.weighted_inputs())
    x[1] = x[1].view(2, 2)
    with pytest.raises(ValueError, match=r"input off1 \(offsets of feature 'ids1', table 'w1'\) has 2 dims"):
        fast(*x)


def test_short_per_sample_weights_name_both_inputs(weighted):
    _, fast = weighted
    x = list(M.weighted_inputs())
    x[2] = x[2][:-1]
    with pytest.raises(ValueError, match=r"input psw1 \(per-sample weights of feature 'ids1', table 'w1'\) has size "
                                         r"8 in dim 0, but input ids1 .* has 9 in dim 0; the model was captured with "
                                         r"these two equal"):
        fast(*x)


@pytest.mark.parametrize("how", ["fbgemm", "native", "reference", "fused_sgd", "int8", "int8_scripted"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.int64])
def test_per_sample_weights_not_float32_are_refused_naming_the_feature_as_pytorch_refuses_them(how, dtype):
    """nn.EmbeddingBag wants its weight's dtype; fbgemm's kernels would convert the weights and
    answer (the TBE and quantized groups did)."""
    model = M.WeightedBags()
    x = list(M.weighted_inputs())
    bad = list(x)
    bad[2] = (x[2] * 10).to(dtype)
    with pytest.raises(RuntimeError):
        model(*bad)
    if how.startswith("int8"):
        fast = fxrec.transform(model.eval(), x, mode="inference", quantize="int8")
        fast = fxrec.export.torchscript(fast) if how == "int8_scripted" else fast
    else:
        kw = dict(optimizer=fxrec.optim.SGD(lr=0.1), backend="fbgemm") if how == "fused_sgd" else dict(backend=how)
        fast = fxrec.transform(model, x, **kw)
    said = ("that are not torch.float32" if how == "int8_scripted" else
            f"of dtype {dtype}; they must be torch.float32, the dtype of its table")
    with pytest.raises(Exception, match=rf"feature 'ids1' \(table 'w1'\) got per-sample weights {said}"):
        fast(*bad)
    fast(*x)  # (the good inputs still run)


def test_features_of_different_batch_sizes_are_named():
    model = M.BagList()
    fast = fxrec.transform(model, M.bag_inputs(), backend="native")
    dense, ids, offs = M.bag_inputs()
    offs[1] = offs[1][:-1]
    with pytest.raises(ValueError, match=r"input offsets\[1\] \(offsets of feature 'ids_1', table 'bags.1'\) has "
                                         r"size 5 in dim 0, but input dense has 6"):
        fast(dense, ids, offs)


def test_dense_input_of_the_wrong_width_is_named():
    model = M.BagList()
    fast = fxrec.transform(model, M.bag_inputs(), backend="fbgemm")
    dense, ids, offs = M.bag_inputs()
    with pytest.raises(ValueError, match=r"input dense has size 7 in dim 1; the model was captured with a fixed size 4"):
        fast(torch.rand(6, 7), ids, offs)


class GruHistory(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 8, padding_idx=0)
        self.gru = nn.GRU(8, 8, batch_first=True)

    def forward(self, ids):
        return self.gru(self.emb(ids))[1][0].sum(1)


def test_a_sequence_length_an_rnn_fixed_at_capture_says_so():
    """torch.export fixes the length nn.GRU runs over; the error said only that the model was captured
    with a fixed size (found by a fuzz of sequence models). The batch stays free."""
    model = GruHistory()
    fast = fxrec.transform(model, (torch.randint(0, 30, (4, 5)),))
    torch.testing.assert_close(fast(torch.randint(0, 30, (1, 5))).shape, torch.Size([1]))
    with pytest.raises(ValueError, match=r"input ids \(.*\) has size 7 in dim 1; the model was captured with a fixed "
                                         r"size 5 there \(the model fixed it when captured: .*nn\.GRU / nn\.LSTM / "
                                         r"nn\.RNN over that dim \(torch\.export fixes their sequence length\)"):
        fast(torch.randint(0, 30, (2, 7)))


@pytest.mark.parametrize("backend", ["fbgemm", "native", "reference"])
def test_ids_on_another_device_name_the_feature(backend):
    model = M.BagList()
    fast = fxrec.transform(model, M.bag_inputs(), backend=backend)
    dense, ids, offs = M.bag_inputs()
    ids[2] = ids[2].to("meta")
    with pytest.raises(ValueError, match=r"feature 'ids_2' \(table 'bags.2'\) got ids on meta, but the table is on cpu"):
        fast(dense, ids, offs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_integer_ids_with_int64_offsets_are_taken_as_pytorch_takes_them(backend):
    model = M.BagList()
    fast = fxrec.transform(model, M.bag_inputs(), backend=backend, timing_rounds=1)
    dense, ids, offs = M.bag_inputs(seed=3)
    ids = [ids[0].short(), ids[1].to(torch.uint8), ids[2].int()]  # embedding_bag promotes them with the offsets
    assert_matches(model, fast, (dense, ids, offs))


class EmptyMeans(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Embedding(20, 4), nn.Embedding(20, 4)

    def forward(self, i, j):
        return torch.cat([self.a(i).mean(1), self.b(j).mean(1)], 1)


@pytest.mark.parametrize("quantize", ["int8", "fp32"])
def test_quantized_mean_over_no_ids_is_nan_as_pytorch(quantize):
    model = EmptyMeans().eval()
    fast = fxrec.transform(model, (torch.randint(0, 20, (3, 2)), torch.randint(0, 20, (3, 2))), mode="inference",
                           quantize=quantize)
    scripted = fxrec.export.torchscript(fast)
    empty = torch.zeros(3, 0, dtype=torch.long)
    for x in ((empty, empty), (empty, torch.randint(0, 20, (3, 2)))):
        want = model(*x)
        for got in (fast(*x), scripted(*x)):
            assert torch.equal(got.isnan(), want.isnan())
            torch.testing.assert_close(got[:, 4:], want[:, 4:], atol=0.05, rtol=0.05, equal_nan=True)


class LastOffsetMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 4, mode="mean", include_last_offset=True)

    def forward(self, ids, offsets):
        return self.bag(ids, offsets)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ids_after_the_last_offset_divide_as_pytorch_or_are_refused(backend):
    """PyTorch's mean with include_last_offset divides the last bag by the ids up to the end of the
    tensor; the fp32 paths give exactly that (PyTorch's kernels), fused and quantized ones refuse."""
    model = LastOffsetMean()
    example = (torch.randint(0, 20, (7,)), torch.tensor([0, 2, 5, 7]))
    trailing = (torch.randint(0, 20, (9,)), torch.tensor([0, 2, 5, 7]))
    fast = fxrec.transform(model, example, backend=backend, timing_rounds=1)
    assert_matches(model, fast, trailing)
    fused = fxrec.transform(model, example, backend=backend, optimizer=fxrec.optim.SGD(lr=0.1), timing_rounds=1)
    if any(g.fused is not None for g in fused.modules() if hasattr(g, "fused")):
        with pytest.raises(ValueError, match=r"feature 'ids' \(table 'bag'\) has 2 ids after offsets\[-1\] = 7"):
            fused(*trailing)
    quantized = fxrec.transform(model.eval(), example, mode="inference", quantize="fp32")
    with pytest.raises(ValueError, match=r"feature 'ids' \(table 'bag'\) has 2 ids after offsets\[-1\] = 7"):
        quantized(*trailing)


# --------------------------------------------------------------------------- exported programs
BAD_INPUTS = {
    "id equal to the row count": lambda d, i, o: i[0].__setitem__(0, 50),
    "id 2**40": lambda d, i, o: i[1].__setitem__(0, 2 ** 40),
    "id -1": lambda d, i, o: i[2].__setitem__(0, -1),
    "offsets past the end": lambda d, i, o: o[0].__setitem__(-1, 1000),
    "decreasing offsets": lambda d, i, o: o[1].__setitem__(2, 0),
    "offsets not starting at 0": lambda d, i, o: o[1].__setitem__(0, 1),
}


@pytest.mark.parametrize("quantize", ["int8", "fp16", "fp32"])
def test_exported_quantized_programs_refuse_bad_ids_and_offsets(quantize):
    model = M.BagList(rows=(50, 80, 30)).eval()
    x = M.bag_inputs(empty_bags=False)
    fast = fxrec.transform(model, x, mode="inference", quantize=quantize)
    program = fxrec.export.program(fast, x).module()
    torch.testing.assert_close(program(*x), fast(*x))
    for what, spoil in BAD_INPUTS.items():
        bad = copy.deepcopy(x)
        spoil(*bad)
        with pytest.raises(RuntimeError, match=r"fxrec: (offsets of )?feature 'ids_\d' \(table 'bags.\d'"):
            program(*bad)
        with pytest.raises((IndexError, ValueError), match=r"feature 'ids_\d'"):
            fast(*bad)


@pytest.mark.parametrize("backend", ["reference", "native", "fbgemm"])
@pytest.mark.parametrize("mode", ["training", "inference"])
def test_every_kernel_refuses_bad_ids_and_offsets_naming_the_feature(backend, mode):
    """The reference kernel took decreasing offsets (PyTorch's lookups do, and return memory never
    written): every kernel names the feature, for each bad input of BAD_INPUTS."""
    model = M.BagList(rows=(50, 80, 30))
    x = M.bag_inputs(empty_bags=False)
    fast = fxrec.transform(model.eval() if mode == "inference" else model, x, backend=backend, mode=mode)
    for what, spoil in BAD_INPUTS.items():
        bad = copy.deepcopy(x)
        spoil(*bad)
        with pytest.raises((IndexError, ValueError), match=r"feature 'ids_\d'"):
            fast(*bad)


# --------------------------------------------------------------------------- reused output buffers
class OnlyBags(nn.Module):
    def __init__(self):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(50, 8) for _ in range(3)])

    def forward(self, ids, offsets):
        return torch.cat([b(i, o) for b, i, o in zip(self.bags, ids, offsets)], 1)  # the group's output itself


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_a_held_output_storage_stops_buffer_reuse(backend):
    model = OnlyBags().eval()
    example = M.bag_inputs(rows=(50, 50, 50))[1:]
    fast = fxrec.transform(model, example, mode="inference", backend=backend, reuse_outputs=True)
    assert group_calls(fast)
    with torch.no_grad():
        out = fast(*M.bag_inputs(rows=(50, 50, 50), seed=1)[1:])
        pointer = out.data_ptr()
        del out
        out = fast(*M.bag_inputs(rows=(50, 50, 50), seed=2)[1:])
        assert out.data_ptr() == pointer  # nothing held it: the buffer was reused
        storage = out.untyped_storage()  # now the tensor goes, its storage stays held
        want = out.clone()
        del out
        again = fast(*M.bag_inputs(rows=(50, 50, 50), seed=3)[1:])
        assert again.data_ptr() != pointer
        assert torch.equal(torch.tensor([], dtype=torch.float32).set_(storage).view_as(want), want)


def test_a_pickled_model_keeps_its_decisions_and_rebuilds_the_same_report():
    import pickle

    from fxrec.report import build_report

    fast = fxrec.transform(M.BagList(), M.bag_inputs(), optimizer=fxrec.optim.SGD(lr=0.1))
    back = pickle.loads(pickle.dumps(fast))
    assert build_report(back).to_dict()["groups"] == fast.report.to_dict()["groups"]
    assert str(back.report) == str(fast.report)


class _Bag2D(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(50, 8, mode="sum")

    def forward(self, ids):
        return self.bag(ids)


@pytest.mark.parametrize("kw", [{}, {"mode": "inference", "quantize": "int8"}], ids=["trained", "int8"])
def test_a_model_whose_graph_holds_a_memory_format_saves_with_torch_save(kw, tmp_path):
    """A non-contiguous example input (transposed 2-D ids) puts clone(memory_format=...) in the
    captured graph: torch.save's pickler cannot take a torch.memory_format (pickle can), and
    torch.save of the model raised 'cannot pickle module object'. The graph keeps it by name; the
    model saves, loads, and loads on meta then takes memory and its state_dict, answering as before.
    (Found by the inference fuzz: every model with a non-contiguous 2-D example.)"""
    torch.manual_seed(0)
    model = _Bag2D().eval() if kw else _Bag2D()
    example = (torch.randint(0, 50, (4, 3)).t(),)
    fast = fxrec.transform(model, example, **kw)
    assert any(n.kwargs.get("memory_format") is not None for n in fast.graph.nodes), "the case is gone"
    x = (torch.randint(0, 50, (5, 3)).t(),)
    with torch.no_grad():
        want = fast(*x)
    torch.save(fast, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    there = torch.load(tmp_path / "m.pt", map_location="meta", weights_only=False)
    there.to_empty(device="cpu")
    there.load_state_dict(fast.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(loaded(*x), want, rtol=0, atol=0)
        torch.testing.assert_close(there(*x), want, rtol=0, atol=0)
