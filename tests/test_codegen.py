"""The captured model's forward (fxrec/codegen.py): the model's own arguments, read by index."""

import pytest
import torch
from torch import nn

import fxrec


class Collide(nn.Module):
    """An argument named like the placeholder export gives the first element of a list."""

    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(20, 4)

    def forward(self, ids, ids_0):
        return self.e(ids[0]).sum(1) + self.e(ids[1]).sum(1) * 2 + self.e(ids_0).sum(1) * 3


class Optional_(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.EmbeddingBag(20, 4, mode="sum")

    def forward(self, feats, psw=None):
        return self.e(feats["a"], feats["off"], per_sample_weights=psw)


def test_argument_named_like_a_placeholder_is_read_before_it_is_rebound():
    model = Collide()
    x = ([torch.randint(0, 20, (3, 2)), torch.randint(0, 20, (3, 2))], torch.randint(0, 20, (3, 2)))
    fast = fxrec.transform(model, x, backend="fbgemm")
    y = ([torch.randint(0, 20, (5, 2)), torch.randint(0, 20, (5, 2))], torch.randint(0, 20, (5, 2)))
    torch.testing.assert_close(fast(*y), model(*y))
    torch.testing.assert_close(fxrec.export.torchscript(fast)(*y), model(*y))


def test_structure_is_checked_naming_the_input():
    model = Optional_()
    feats = {"a": torch.randint(0, 20, (6,)), "off": torch.tensor([0, 2, 4])}
    fast = fxrec.transform(model, (feats, None), backend="fbgemm")
    torch.testing.assert_close(fast(feats, None), model(feats))
    with pytest.raises(ValueError, match="input psw was None when the model was captured"):
        fast(feats, torch.rand(6))
    without = fxrec.transform(model, (feats,), backend="fbgemm")  # captured without the argument
    with pytest.raises(TypeError, match="positional argument"):
        without(feats, torch.rand(6))
    with pytest.raises(ValueError, match="input feats must have 2 elements"):
        fast({**feats, "extra": torch.zeros(1)}, None)
