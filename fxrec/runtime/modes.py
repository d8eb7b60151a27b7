"""What the captured graph calls to follow ``train()`` / ``eval()`` (see :mod:`fxrec.modes`)."""

from __future__ import annotations

import torch
import torch.fx


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
