"""Embedding optimizers that fxrec can fuse into the backward of a table-batched embedding.

Pass one to ``fxrec.transform(model, inputs, optimizer=...)`` (or a dict from table name or
glob pattern to optimizer, for a per-table choice). Each takes the keyword arguments of its
``torch.optim`` namesake, with the same meaning and defaults; ``RowWiseAdagrad`` is fbgemm's
row-wise Adagrad (one accumulator per row: ``sum += mean(g**2)``, ``w -= lr * g / (sqrt(sum) + eps)``);
``LazyAdam``, ``PartialRowWiseAdam``, ``LazyLamb`` and ``PartialRowWiseLamb`` are fbgemm's Adam,
partial row-wise Adam, LAMB and partial row-wise LAMB, and ``LarsSGD`` fbgemm's LARS-SGD (see the
classes).

Where fbgemm's kernel implements the optimizer's arithmetic, the update runs inside
``backward`` ("fused": no gradient is made), once per backward call (two backward calls per
step, or gradient accumulation, differ from torch.optim for the stateful optimizers). Otherwise the table gets PyTorch's gradient and the torch.optim
namesake (or :class:`RowWiseAdagradTorch`, :class:`LazyAdamTorch`, ...) updates it in ``opt.step()``
("fallback"); the report says which path every table takes. The CPU build of fbgemm fuses SGD,
Adagrad and row-wise Adagrad only; its CUDA build also the ``Lazy*``, ``PartialRowWise*`` and ``LarsSGD``. ``Adam`` always takes the
fallback: it is torch.optim.Adam, which updates every row at every step, and fbgemm's Adam
updates only the rows in the batch (that is ``LazyAdam``, an explicit choice).

Then ``fast.make_optimizer(torch.optim.Adam, lr=1e-3)`` gives one optimizer for the model:
dense parameters with the given class, embedding tables with theirs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar, Dict, Optional, Sequence, Tuple, Union

import torch

from .runtime._tracing import reads_values
from .runtime.grad import renorm_rows
from .runtime.specs import FusedSpec


class EmbeddingOptimizer:
    """Base of the optimizer configurations."""

    torch_name = ""

    def fused_spec(self) -> Optional[FusedSpec]:
        """The fbgemm kernel configuration when fbgemm computes exactly this update, else None."""
        return None

    def fused_unsupported_reason(self) -> str:
        return ""

    #: Whether :meth:`torch_optimizer` picks another torch class for tables of sparse gradients
    #: (Adam: SparseAdam): such tables then get a param group of their own.
    SPARSE_CLASS: ClassVar[bool] = False

    def torch_optimizer(self, params, sparse: bool = False) -> torch.optim.Optimizer:
        """The fallback: the same update done by a torch optimizer on PyTorch's gradients
        (``sparse``: the tables were created with sparse=True)."""
        raise NotImplementedError

    def sparse_refusal(self) -> str:
        """Why the fallback cannot train a table of sparse gradients with these arguments, or ""."""
        return ""

    def describe(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in asdict(self).items()
                         if k not in TORCH_OPTIONS or v != TORCH_OPTIONS[k])
        return f"{type(self).__name__}({args})"


#: torch.optim's keyword arguments (SGD, Adagrad, Adam) that choose how its step is computed, or
#: ascend, with their defaults: passed on to the torch.optim fallback. fbgemm's update has none of
#: them: ``maximize``, ``differentiable`` and ``capturable`` keep a table off the fused update (the
#: fallback then does what torch.optim does, its errors included); ``foreach`` and ``fused`` pick
#: torch.optim's implementation and say nothing of fbgemm's. ``describe`` shows those set.
TORCH_OPTIONS = {"maximize": False, "foreach": None, "differentiable": False, "fused": None,
                 "capturable": False, "decoupled_weight_decay": False}


def _torch_options(opt) -> dict:
    """``opt``'s torch.optim options (:data:`TORCH_OPTIONS`) as keyword arguments."""
    return {k: getattr(opt, k) for k in TORCH_OPTIONS if hasattr(opt, k)}


def _unfusable_options(opt) -> str:
    """Why ``opt``'s torch.optim options keep it off fbgemm's fused update, or ""."""
    given = [k for k in ("maximize", "differentiable", "capturable") if getattr(opt, k, False)]
    return f"fbgemm's update has no {', '.join(given)}" if given else ""


def _sparse_refusal(opt, torch_class: str) -> str:
    given = _sparse_options(opt, torch_class)
    return (f"its gradients are sparse (sparse=True), which torch.optim.{torch_class} cannot take with "
            f"{' and '.join(f'{k}=True' for k in given)}; make the table dense, or drop it") if given else ""


def _sparse_options(opt, torch_class: str) -> list:
    """``opt``'s torch.optim options that ``torch_class`` cannot take for sparse gradients."""
    kinds = {"SparseAdam": ("foreach", "fused", "capturable", "differentiable")}
    return [k for k in kinds.get(torch_class, ("fused",)) if getattr(opt, k, None)]


def _check_numbers(opt, names: Sequence[str]) -> None:
    """torch.optim's argument checks, at construction: each of ``names`` a number >= 0 (a fused
    optimizer would otherwise run a negative learning rate as gradient ascent), naming it."""
    for name in names:
        v = getattr(opt, name)
        try:  # (numpy scalars and 0-dim tensors, as torch.optim takes them)
            ok = not isinstance(v, (bool, str, bytes)) and bool(v >= 0)
        except (TypeError, RuntimeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"fxrec: {type(opt).__name__} {name} must be a number >= 0, got {v!r}")


@dataclass(frozen=True)
class SGD(EmbeddingOptimizer):
    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    maximize: bool = False
    foreach: Optional[bool] = None
    differentiable: bool = False
    fused: Optional[bool] = None

    def __post_init__(self):
        _check_numbers(self, ("lr", "momentum", "weight_decay"))  # (torch.optim.SGD does not check dampening)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("fxrec: SGD with nesterov=True needs a momentum > 0 and zero dampening, as torch.optim.SGD")

    def fused_spec(self):
        return None if self.fused_unsupported_reason() else FusedSpec("sgd", self.lr)

    def fused_unsupported_reason(self) -> str:
        if self.momentum or self.weight_decay or self.nesterov:
            return "fbgemm's exact SGD has no momentum or weight decay"
        return _unfusable_options(self)

    def sparse_refusal(self) -> str:
        if self.weight_decay:
            return ("its gradients are sparse (sparse=True), which torch.optim.SGD's weight_decay cannot take (it "
                    "adds the dense table to them); make the table dense, or drop weight_decay")
        return _sparse_refusal(self, "SGD")

    def torch_optimizer(self, params, sparse=False):
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, dampening=self.dampening,
                               weight_decay=self.weight_decay, nesterov=self.nesterov, **_torch_options(self))


@dataclass(frozen=True)
class Adagrad(EmbeddingOptimizer):
    lr: float = 1e-2
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    foreach: Optional[bool] = None
    maximize: bool = False
    differentiable: bool = False
    fused: Optional[bool] = None

    def __post_init__(self):
        _check_numbers(self, ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps"))

    def fused_spec(self):
        return None if self.fused_unsupported_reason() else FusedSpec("adagrad", self.lr, self.eps)

    def fused_unsupported_reason(self) -> str:
        if self.lr_decay or self.weight_decay or self.initial_accumulator_value:
            return "fbgemm's exact Adagrad has no lr_decay, weight_decay or initial_accumulator_value"
        return _unfusable_options(self)

    def sparse_refusal(self) -> str:
        if self.weight_decay:
            return ("its gradients are sparse (sparse=True), which torch.optim.Adagrad's weight_decay cannot take; "
                    "make the table dense, or drop weight_decay")
        return _sparse_refusal(self, "Adagrad")

    def torch_optimizer(self, params, sparse=False):
        return torch.optim.Adagrad(params, lr=self.lr, lr_decay=self.lr_decay, weight_decay=self.weight_decay,
                                   initial_accumulator_value=self.initial_accumulator_value, eps=self.eps,
                                   **_torch_options(self))


#: RowWiseAdagrad's weight_decay_mode values (fbgemm's WeightDecayMode.L2 and .DECOUPLE).
WEIGHT_DECAY_MODES = ("l2", "decoupled")


@dataclass(frozen=True)
class RowWiseAdagrad(EmbeddingOptimizer):
    """fbgemm's row-wise Adagrad, on the rows in the batch: per row, with ``g`` its gradient
    (summed over its lookups) and ``D`` its width,

    * ``weight_decay_mode="l2"`` (TorchRec's default): ``g += weight_decay * w``, then
      ``sum += mean(g**2)``, ``w -= lr * g / (sqrt(sum) + eps)``;
    * ``weight_decay_mode="decoupled"``: ``sum += mean(g**2)``,
      ``w = (1 - lr * weight_decay) * w - lr * g / (sqrt(sum) + eps)``.

    ``max_norm`` (fbgemm's; 0, the default, for none): after its update, a row whose L2 norm
    exceeds ``max_norm`` is scaled down to it (``w *= max_norm / norm(w)``). Not the
    ``max_norm`` of ``nn.Embedding``, which renormalises the rows each forward reads, before the
    lookup: this one caps the rows an update wrote, after the step.

    As the update itself, the decay and the cap reach only the rows looked up in the batch."""

    lr: float = 1e-2
    eps: float = 1e-8
    weight_decay: float = 0.0
    weight_decay_mode: str = "l2"
    max_norm: float = 0.0

    def __post_init__(self):
        if self.weight_decay_mode not in WEIGHT_DECAY_MODES:
            raise ValueError(f"fxrec: RowWiseAdagrad weight_decay_mode must be one of {WEIGHT_DECAY_MODES}, "
                             f"got {self.weight_decay_mode!r}")
        _check_numbers(self, ("lr", "eps", "weight_decay", "max_norm"))

    def fused_spec(self):
        return FusedSpec("rowwise_adagrad", self.lr, self.eps, weight_decay=float(self.weight_decay),
                         weight_decay_mode=self.weight_decay_mode if self.weight_decay else "",
                         max_norm=float(self.max_norm))

    def torch_optimizer(self, params, sparse=False):
        return RowWiseAdagradTorch(params, lr=self.lr, eps=self.eps, weight_decay=self.weight_decay,
                                   weight_decay_mode=self.weight_decay_mode, max_norm=self.max_norm)


@dataclass(frozen=True)
class Adam(EmbeddingOptimizer):
    lr: float = 1e-3
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    foreach: Optional[bool] = None
    maximize: bool = False
    capturable: bool = False
    differentiable: bool = False
    fused: Optional[bool] = None
    decoupled_weight_decay: bool = False

    def __post_init__(self):
        _betas_tuple(self, "Adam")
        _check_numbers(self, ("lr", "eps", "weight_decay"))

    def fused_unsupported_reason(self) -> str:
        return ("torch.optim.Adam updates every row at every step, fbgemm's Adam only the rows in the batch "
                "(fxrec.optim.LazyAdam fuses that on CUDA)")

    def sparse_refusal(self) -> str:
        given = [n for n, v in (("weight_decay", self.weight_decay), ("amsgrad", self.amsgrad)) if v]
        given += _sparse_options(self, "SparseAdam")
        return (f"its gradients are sparse (sparse=True), where Adam runs as torch.optim.SparseAdam, which has no "
                f"{' and no '.join(given)}; make the table dense, or drop them") if given else ""

    SPARSE_CLASS: ClassVar[bool] = True

    def torch_optimizer(self, params, sparse=False):
        if sparse:
            return torch.optim.SparseAdam(params, lr=self.lr, betas=self.betas, eps=self.eps, maximize=self.maximize)
        return torch.optim.Adam(params, lr=self.lr, betas=self.betas, eps=self.eps,
                                weight_decay=self.weight_decay, amsgrad=self.amsgrad, **_torch_options(self))


@dataclass(frozen=True)
class _LazyMoments(EmbeddingOptimizer):
    """The arguments and checks of :class:`LazyAdam`, :class:`LazyLamb` and their partial row-wise forms."""

    lr: float = 1e-3
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    kind = ""  # the FusedSpec kind

    def __post_init__(self):
        _betas_tuple(self, type(self).__name__)
        _check_numbers(self, ("lr", "eps", "weight_decay"))

    def fused_spec(self):
        return FusedSpec(self.kind, self.lr, self.eps, self.betas[0], self.betas[1], self.weight_decay)

    def torch_optimizer(self, params, sparse=False):
        cls = {"lamb": LazyLambTorch, "partial_rowwise_adam": PartialRowWiseAdamTorch,
               "partial_rowwise_lamb": PartialRowWiseLambTorch}.get(self.kind, LazyAdamTorch)
        return cls(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)


@dataclass(frozen=True)
class LazyAdam(_LazyMoments):
    """fbgemm's Adam (``EmbOptimType.ADAM``, fused on CUDA only): Adam on the rows in the batch.

    At the group's ``t``-th training step (one count for the group, as fbgemm's ``iter``), each
    row looked up in the batch, with ``g`` its gradient summed over the batch::

        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        w = w - lr * ((m / (1 - beta1**t)) / (sqrt(v / (1 - beta2**t)) + eps) + weight_decay * w)

    That is torch.optim.Adam's arithmetic (torch.optim.AdamW's decoupled weight decay), applied
    to those rows only: rows not in the batch, and their ``m`` and ``v``, stay as they are (as
    ``torch.optim.SparseAdam``, whose ``eps`` is added before the bias correction instead).
    When every row is looked up at every step it is torch.optim.AdamW (torch.optim.Adam with
    ``weight_decay=0``). Where fbgemm cannot fuse it (CPU, or what the report names), the tables
    get PyTorch's gradients and :class:`LazyAdamTorch` applies the same update in ``opt.step()``.
    """

    kind = "adam"


@dataclass(frozen=True)
class LazyLamb(_LazyMoments):
    """fbgemm's LAMB (``EmbOptimType.LAMB``, fused on CUDA only): LAMB on the rows in the batch,
    each row its own layer (its own trust ratio).

    At the group's ``t``-th training step, each row looked up in the batch, with ``g`` its
    gradient summed over the batch, ``m`` and ``v`` as in :class:`LazyAdam`, and::

        r = (m / (1 - beta1**t)) / (sqrt(v / (1 - beta2**t)) + eps) + weight_decay * w
        w = w - lr * (norm(w) / norm(r)) * r        # norms over the row

    Rows not in the batch, and their ``m`` and ``v``, stay as they are. As in fbgemm, there is no
    clamp of the trust ratio: a row of zeros never moves (ratio 0), and a row whose ``r`` is all
    zero (a zero gradient at the first step, no weight decay) becomes NaN. There is no
    torch.optim LAMB; where fbgemm cannot fuse it (CPU, or what the report names), the tables get
    PyTorch's gradients and :class:`LazyLambTorch` applies this update in ``opt.step()`` (on a dense
    gradient to the rows that are not all zero, as :class:`LazyAdamTorch`: a looked-up row with an
    exactly zero gradient is left alone there, where fbgemm's fused update moves it).
    """

    kind = "lamb"


@dataclass(frozen=True)
class PartialRowWiseAdam(_LazyMoments):
    """fbgemm's partial row-wise Adam (``EmbOptimType.PARTIAL_ROWWISE_ADAM``, fused on CUDA only):
    :class:`LazyAdam` with one second moment a row instead of one a value (half of Adam's state)::

        m = beta1 * m + (1 - beta1) * g                     # per value, as LazyAdam
        v = beta2 * v + (1 - beta2) * mean(g * g)           # per row, the mean over the row
        w = w - lr * ((m / (1 - beta1**t)) / (sqrt(v / (1 - beta2**t)) + eps) + weight_decay * w)

    On the rows in the batch only. fbgemm averages over the row as it stores it, so a table whose
    dim is not a multiple of 4 (stored padded) is not fused (the report says so) and takes the
    fallback, :class:`PartialRowWiseAdamTorch`, as on CPU.
    """

    kind = "partial_rowwise_adam"


@dataclass(frozen=True)
class PartialRowWiseLamb(_LazyMoments):
    """fbgemm's partial row-wise LAMB (``EmbOptimType.PARTIAL_ROWWISE_LAMB``, fused on CUDA only):
    :class:`LazyLamb` with :class:`PartialRowWiseAdam`'s second moment (one a row, the mean of the
    row's squared gradient). Not fused on padded tables, for the same reason; the fallback is
    :class:`PartialRowWiseLambTorch`.
    """

    kind = "partial_rowwise_lamb"


@dataclass(frozen=True)
class LarsSGD(EmbeddingOptimizer):
    """fbgemm's LARS-SGD (``EmbOptimType.LARS_SGD``, fused on CUDA only): SGD with momentum whose
    learning rate each row scales by its own trust ratio, on the rows in the batch.

    Each row looked up in the batch, with ``g`` its gradient summed over the batch and ``m`` its
    momentum (one value per value of the row, zero at first)::

        lr_row = lr * eta * norm(w) / (norm(g) + weight_decay * norm(w))     # norms over the row
        m = momentum * m + lr_row * (g + weight_decay * w)
        w = w - m

    Rows not in the batch, and their ``m``, stay as they are. As in fbgemm, nothing guards the
    ratio: a row of zeros never moves, and a looked-up row whose gradient is exactly zero, without
    weight decay, becomes NaN (0 times an infinite ratio). There is no torch.optim LARS; where
    fbgemm cannot fuse it (CPU, or what the report names), the tables get PyTorch's gradients and
    :class:`LarsSGDTorch` applies this update in ``opt.step()`` (on a dense gradient, to the rows
    that are not all zero: a looked-up row with an exactly zero gradient is left alone there).
    Defaults are fbgemm's."""

    lr: float = 1e-2
    eta: float = 1e-3
    momentum: float = 0.9
    weight_decay: float = 0.0

    def __post_init__(self):
        if not (self.lr >= 0 and self.eta >= 0 and self.weight_decay >= 0 and 0 <= self.momentum < 1):
            raise ValueError(f"fxrec: LarsSGD lr, eta and weight_decay must be >= 0 and momentum in [0, 1), got {self}")

    kind = "lars_sgd"

    def fused_spec(self):
        return FusedSpec(self.kind, self.lr, weight_decay=float(self.weight_decay), momentum=float(self.momentum),
                         eta=float(self.eta))

    def torch_optimizer(self, params, sparse=False):
        return LarsSGDTorch(params, lr=self.lr, eta=self.eta, momentum=self.momentum, weight_decay=self.weight_decay)


class LazyAdamTorch(torch.optim.Optimizer):
    """:class:`LazyAdam`'s update as a torch optimizer, in ``step()``: on the rows of a sparse
    gradient (a table made with ``sparse=True``: exactly the rows in the batch), or of a dense
    gradient its rows that are not all zero (a row looked up with an exactly zero gradient is
    then left alone, where the fused update would move it). The step count is per parameter,
    one per ``step()`` that finds a gradient."""

    ELEMENT_WISE = True  # the second moment: one per element (False: one per row, the mean over the row)

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p if self.ELEMENT_WISE else p[:, 0])
                state["step"] += 1
                t = int(state["step"].item())

                def adam(w, g, moments):
                    m = torch.add(moments[0] * b1, g, alpha=1 - b1)
                    g2 = g * g if self.ELEMENT_WISE else (g * g).mean(1)
                    v = torch.add(moments[1] * b2, g2, alpha=1 - b2)
                    denom = (v / (1 - b2 ** t)).sqrt_().add_(eps)
                    upd = (m / (1 - b1 ** t)) / (denom if self.ELEMENT_WISE else denom.unsqueeze(1))
                    if wd:
                        upd.add_(w, alpha=wd)
                    return torch.sub(w, self._direction(w, upd), alpha=lr), [m, v]

                update_rows(p, [state["exp_avg"], state["exp_avg_sq"]], adam)
        return loss

    def _direction(self, w: torch.Tensor, upd: torch.Tensor) -> torch.Tensor:
        """What ``lr`` multiplies, for the rows ``w`` (before the update) and their Adam step ``upd``."""
        return upd


class LazyLambTorch(LazyAdamTorch):
    """:class:`LazyLamb`'s update as a torch optimizer: :class:`LazyAdamTorch`'s rows, moments and
    step count, each row's step scaled by its trust ratio ``norm(w) / norm(r)``."""

    def _direction(self, w, upd):
        return upd.mul_((w.norm(dim=1) / upd.norm(dim=1)).unsqueeze(1))


class PartialRowWiseAdamTorch(LazyAdamTorch):
    """:class:`PartialRowWiseAdam`'s update as a torch optimizer: :class:`LazyAdamTorch` with one
    second moment a row (``exp_avg_sq`` of shape ``[rows]``: the mean of the row's squared gradient)."""

    ELEMENT_WISE = False


class PartialRowWiseLambTorch(LazyLambTorch):
    """:class:`PartialRowWiseLamb`'s update as a torch optimizer: :class:`LazyLambTorch` with one
    second moment a row, as :class:`PartialRowWiseAdamTorch`."""

    ELEMENT_WISE = False


class LarsSGDTorch(torch.optim.Optimizer):
    """:class:`LarsSGD`'s update as a torch optimizer, in ``step()``: on the rows of a sparse
    gradient (a table made with ``sparse=True``: exactly the rows in the batch), or of a dense
    gradient its rows that are not all zero. State: ``momentum_buffer``, like the parameter."""

    def __init__(self, params, lr: float = 1e-2, eta: float = 1e-3, momentum: float = 0.9, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, eta=eta, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, eta, mom, wd = group["lr"], group["eta"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)

                def lars(w, g, buf):
                    w_norm = w.norm(dim=1, keepdim=True)
                    ratio = lr * eta * w_norm / (g.norm(dim=1, keepdim=True) + wd * w_norm)
                    m = torch.add(buf[0] * mom, ratio * (g + wd * w if wd else g))
                    return w - m, [m]

                update_rows(p, [state["momentum_buffer"]], lars)
        return loss


def update_rows(p: torch.Tensor, states: Sequence[torch.Tensor], update) -> None:
    """Apply ``update(w, g, states) -> (w, states)`` (new tensors, the inputs left as they are) to
    the rows of ``p`` that have a gradient, and to their rows of ``states`` (each ``[rows, ...]``):
    the rows a sparse gradient holds, each row's lookups summed, or a dense gradient's rows that
    are not all zero (:func:`gradient_rows`). Where finding those rows would make the host wait
    for the device (CUDA; :func:`fxrec.runtime._tracing.reads_values`), a dense gradient updates
    every row at once instead, a row whose gradient is all zero keeping its old values: the same
    arithmetic row by row, nothing read on the host, at the cost of table-sized temporaries."""
    g = p.grad
    if g.is_sparse or reads_values(g.device):
        rows, vals = gradient_rows(g)
        w, new = update(p[rows], vals, [s[rows] for s in states])
        for s, n in zip(states, new):
            s.index_copy_(0, rows, n)
        p.index_copy_(0, rows, w)
        return
    has = g.ne(0).any(1)
    w, new = update(p, g, list(states))
    for s, n in zip(states, new):
        s.copy_(torch.where(has.view((-1,) + (1,) * (s.dim() - 1)), n, s))
    p.copy_(torch.where(has.unsqueeze(1), w, p))


def gradient_rows(g: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(rows, their gradient rows) of a table's gradient: a row-sparse gradient's rows after
    coalescing (each row's lookups summed), or a dense gradient's rows that are not all zero."""
    if g.is_sparse and g.sparse_dim() != 1:  # not an embedding's (row-sparse) gradient
        g = g.to_dense()
    if g.is_sparse:
        g = g.coalesce()
        return g.indices()[0], g.values()
    rows = torch.nonzero(g.abs().sum(1)).squeeze(1)
    return rows, g[rows]


class RowWiseAdagradTorch(torch.optim.Optimizer):
    """fbgemm's row-wise Adagrad as a torch optimizer (dense or sparse gradients), weight decay and
    ``max_norm`` included (:class:`RowWiseAdagrad`): the rows with a gradient are the rows updated.
    (With a dense gradient, a row looked up whose gradient is exactly zero is neither updated,
    decayed nor capped; the fused kernels do all three.) On CUDA a dense gradient's step reads
    nothing on the host (:func:`update_rows`)."""

    def __init__(self, params, lr: float = 1e-2, eps: float = 1e-8, weight_decay: float = 0.0,
                 weight_decay_mode: str = "l2", max_norm: float = 0.0):
        if weight_decay_mode not in WEIGHT_DECAY_MODES:
            raise ValueError(f"fxrec: weight_decay_mode must be one of {WEIGHT_DECAY_MODES}, got {weight_decay_mode!r}")
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay, weight_decay_mode=weight_decay_mode,
                                      max_norm=max_norm))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "sum" not in state:
                    state["sum"] = torch.zeros(p.shape[0], dtype=p.dtype, device=p.device)
                lr, eps, wd = group["lr"], group["eps"], group.get("weight_decay", 0.0)
                mode, max_norm = group.get("weight_decay_mode", "l2"), group.get("max_norm", 0.0)

                def rowwise_adagrad(w, g, sums):
                    decayed = g + wd * w if wd and mode == "l2" else g
                    total = sums[0] + decayed.pow(2).mean(1)
                    mult = (lr / (total.sqrt() + eps)).unsqueeze(1)
                    if wd:  # fbgemm's form: w = (1 - c) * w - mult * g
                        keep = 1 - (mult * wd if mode == "l2" else lr * wd)
                        new = keep * w - mult * g
                    else:
                        new = w + -mult * g
                    return (renorm_rows(new, max_norm) if max_norm else new), [total]

                update_rows(p, [state["sum"]], rowwise_adagrad)
        return loss


def _betas_tuple(opt, name: str) -> Tuple[float, float]:
    """``betas`` as a tuple of two floats (a list, as torch.optim takes, would make the frozen
    configuration unhashable), each in [0, 1) as torch.optim.Adam checks."""
    try:
        b1, b2 = (float(b) for b in opt.betas)
    except (TypeError, ValueError) as e:
        raise ValueError(f"fxrec: {name} betas must be two numbers, got {opt.betas!r}") from e
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"fxrec: {name} betas must be in [0, 1), got {opt.betas}")
    object.__setattr__(opt, "betas", (b1, b2))
    return b1, b2


OptimizerSpec = Union[EmbeddingOptimizer, Dict[str, EmbeddingOptimizer], None]


def resolve(spec: OptimizerSpec, table: str, param: str) -> Optional[EmbeddingOptimizer]:
    """The optimizer for one table: a single optimizer applies to all tables; in a dict, the
    first key that equals or glob-matches the table name (or its parameter name) wins."""
    if spec is None or isinstance(spec, EmbeddingOptimizer):
        return spec
    from .table_keys import deciding_key

    key = deciding_key(spec, table, param)
    return None if key is None else spec[key]


def check_spec(spec: OptimizerSpec) -> None:
    if spec is None or isinstance(spec, EmbeddingOptimizer):
        return
    if not isinstance(spec, dict):
        raise TypeError(
            f"fxrec: optimizer must be an fxrec.optim optimizer or a dict of them, got {type(spec).__name__}"
        )
    for k, v in spec.items():
        if not isinstance(v, EmbeddingOptimizer):
            raise TypeError(f"fxrec: optimizer for '{k}' must be an fxrec.optim optimizer, got {type(v).__name__}")
