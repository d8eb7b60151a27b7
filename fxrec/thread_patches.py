"""Torch functions that trace otherwise while a thread captures a model.

Capture changes how a few torch functions are traced: ``torch.embedding_bag`` records one opaque
operator and ``F.embedding_bag`` of ``[B, L]`` ids of a computed L writes its offsets as a product
(:mod:`fxrec.capture_bags`), a reshape of a tensor whose layout depends on its sizes is traced
on a copy (:func:`fxrec.capture_reshapes.reshape_by_copy`), and a few ops (``F.linear``,
``F.dropout``, attention, einsum, recurrent cells) without the guards of their own workings
(:func:`fxrec.capture_reshapes.without_own_guards`). A :class:`ThreadPatch` installs its
wrappers when a first thread enters it and puts torch's own functions back when the last one
leaves; each wrapper acts only in a thread inside it (:meth:`ThreadPatch.on`) and calls torch's
own function in every other. While installed the wrappers are Python functions for every thread
(``torch.jit.script`` of code that calls them fails until the capture ends).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, List, Sequence, Tuple

_ABSENT = object()


class ThreadPatch:
    """``targets``: ``(owner, attribute name)`` pairs; ``wrap(original, name)`` makes the wrapper
    of one (which asks :meth:`on` whether to act). ``with patch():`` installs them (once for all
    threads inside) and marks this thread as inside."""

    def __init__(self, targets: Sequence[Tuple[object, str]], wrap: Callable):
        self._targets = tuple(targets)
        self._wrap = wrap
        self._inside = threading.local()  # .depth: how deep this thread is inside
        self._lock = threading.Lock()
        self._users = 0  # threads inside (nested entries counted)
        self._saved: List[Tuple[object, str, object]] = []  # (owner, name, what its __dict__ held)

    def on(self) -> bool:
        """Whether this thread is inside the patch."""
        return getattr(self._inside, "depth", 0) > 0

    @contextlib.contextmanager
    def __call__(self):
        with self._lock:
            if self._users == 0:
                for owner, name in self._targets:
                    self._saved.append((owner, name, vars(owner).get(name, _ABSENT)))
                    setattr(owner, name, self._wrap(getattr(owner, name), name))
            self._users += 1
        self._inside.depth = getattr(self._inside, "depth", 0) + 1
        try:
            yield
        finally:
            self._inside.depth -= 1
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    while self._saved:  # (an attribute inherited, as Tensor.reshape from TensorBase: removed again)
                        owner, name, held = self._saved.pop()
                        if held is _ABSENT:
                            delattr(owner, name)
                        else:
                            setattr(owner, name, held)
