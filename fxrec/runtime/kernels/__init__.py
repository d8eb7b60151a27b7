"""The kernels a group of lookups can run on, as small objects that say what they support.

A kernel is the part of a group that differs: how rows are looked up (and, in training, how
gradients are made or a fused optimizer applied). Everything else (specs, input checks,
packing) is the group module's, :class:`fxrec.runtime.group.EmbeddingGroup`.

* ``reference``: PyTorch's own lookups (``F.embedding_bag`` / ``F.embedding``), bit for bit what
  the user's model computes; the form torch.export and TorchScript trace, and the oracle of
  ``verify``. In inference a pooled group writes into an output buffer it reuses between calls.
* ``native``: fxrec's C++ CPU kernels (``fxrec/csrc/pooled.cpp``): pooled groups, every feature
  written straight into its columns of the output; fused SGD / Adagrad / row-wise Adagrad.
* ``fbgemm``: fbgemm_gpu's table-batched embedding (training TBE; IntNBit for quantized tables).

Each kernel answers ``supports(group, device, mode, optimizer, options=) -> None | reason`` from the
group's :class:`~fxrec.runtime.specs.GroupSpec` alone, so a choice can be made and explained for
a device that is not present. ``run(group, ids, offsets, psw, params, training)`` returns the
group's output, or None when this call's inputs are outside what the kernel takes (the group then
runs the reference). Choosing a kernel is a lookup in the rule table of
``fxrec/passes/choose_kernels.py``; this package only holds the kernels.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

from ..specs import GroupSpec

#: Names of the kernels, in the order the report lists them. Defined here, used everywhere.
REFERENCE, NATIVE, FBGEMM = "reference", "native", "fbgemm"
KERNEL_NAMES = (REFERENCE, NATIVE, FBGEMM)
MODES = ("training", "inference")


class Kernel:
    """A way to run a group's lookups. Subclasses set ``name`` and implement both methods."""

    name: str = ""

    def supports(self, group: GroupSpec, device: str, mode: str, optimizer: Optional[str], *,
                 options: Tuple[str, ...] = ()) -> Optional[str]:
        """None when this kernel can run ``group`` on ``device`` ("cpu" / "cuda") in ``mode``
        with the fused ``optimizer`` ("sgd", "adagrad", "rowwise_adagrad", ..., or None for none)
        and its ``options`` (``FusedSpec.options``: "weight decay", "max_norm"), else a short
        reason (it goes into the report)."""
        raise NotImplementedError

    def available(self, device: str) -> Optional[str]:
        """None when the kernel's code is there for ``device`` on this machine, else why not.
        Checked only when deciding for the machine at hand (not by ``fxrec.explain``)."""
        return None

    def run(self, group, ids_list, offsets_list, psw_list, params, training: bool):
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<fxrec kernel {self.name}>"


def get(name: str) -> Kernel:
    """The kernel called ``name`` (imports it on first use)."""
    if name not in _KERNELS:
        if name not in KERNEL_NAMES:
            raise ValueError(f"fxrec: kernel must be one of {KERNEL_NAMES}, got {name!r}")
        if name == REFERENCE:
            from .reference import KERNEL
        elif name == NATIVE:
            from .native import KERNEL
        else:
            from .fbgemm import KERNEL
        _KERNELS[name] = KERNEL
    return _KERNELS[name]


_KERNELS: Dict[str, Kernel] = {}
