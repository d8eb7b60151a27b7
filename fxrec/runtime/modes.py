"""What the captured graph calls to follow ``train()`` / ``eval()`` (see :mod:`fxrec.modes`)."""

from __future__ import annotations

from typing import List

import torch
import torch.fx


class ModeError(RuntimeError):
    """train() / eval() to a mode the transformed model cannot switch to, or modules whose flags the
    model's code reads left in different modes (see :mod:`fxrec.modes`)."""


def as_captured_or_flipped(modes: List[bool], captured: List[bool], names: str) -> None:
    """Raise a ModeError unless the modules whose ``training`` flags decide an argument that differs
    by mode (``names``) are as captured, or each flipped (``train()`` / ``eval()`` of the model from
    there): only those two combinations were captured."""
    same = True
    flipped = True
    for m, c in zip(modes, captured):
        same = same and m == c
        flipped = flipped and m != c
    if not (same or flipped):
        raise ModeError("fxrec: the model's code reads the training flag of " + names + " for one value, and the "
                        "transformed model knows it for their modes as captured and for each switched (train() / "
                        "eval() of the model), but they are in another combination now: switch them together")


def as_captured(modes: List[bool], captured: List[bool], names: str) -> None:
    """Raise a ModeError unless the modules whose ``training`` flag the model's code reads (``names``)
    are in the modes the model was captured in: a model that cannot switch modes computes only those."""
    for m, c in zip(modes, captured):
        if m != c:
            raise ModeError("fxrec: the model's code reads the training flag of " + names + ", and the "
                            "transformed model computes what the model does in the modes they were captured in "
                            "(it cannot switch: its report says why), but one of them is in another mode now")


def count_batch(num_batches_tracked: torch.Tensor, training: bool) -> torch.Tensor:
    """``BatchNorm``'s ``num_batches_tracked += 1``, which the module does in training mode only."""
    if training:
        num_batches_tracked.add_(1)
    return num_batches_tracked


def evaluating(training: bool) -> bool:
    """``not training``: an argument the model's code passes as ``not self.training``."""
    return not training


def by_mode(training: bool, in_training: float, in_eval: float) -> float:
    """A number the model's code passes as one value in training mode and another in eval mode
    (``nn.MultiheadAttention``'s dropout probability: its own in training, 0 in eval)."""
    return in_training if training else in_eval


# its result is unused: tell torch.fx's dead-code elimination that the call matters (where this
# torch has the marker)
getattr(torch.fx.node, "has_side_effect", lambda fn: fn)(count_batch)
getattr(torch.fx.node, "has_side_effect", lambda fn: fn)(as_captured_or_flipped)
getattr(torch.fx.node, "has_side_effect", lambda fn: fn)(as_captured)
