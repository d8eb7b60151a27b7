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


# its result is unused: tell torch.fx's dead-code elimination that the call matters (where this
# torch has the marker)
getattr(torch.fx.node, "has_side_effect", lambda fn: fn)(count_batch)
