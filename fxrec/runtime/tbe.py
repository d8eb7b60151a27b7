"""Runtime modules that the rewritten graph calls for a group of embedding lookups.

A group module takes the lookups' own inputs (one id tensor per feature, with its offsets and
per-sample weights where it had them) and the group's weight parameters, and returns what the
original lookups returned: for pooled groups one ``[B, sum of dims]`` tensor whose columns are
the features side by side, for sequence groups one tensor per feature.

Three implementations sit behind one module, chosen per group (and separately for training and
for inference) by the ``choose_kernels`` pass:

* ``"fbgemm"``: all features go through one fbgemm ``SplitTableBatchedEmbeddingBagsCodegen``
  forward. The user's weight parameters are views into the TBE's single flat weight buffer, so
  the kernel reads exactly the user's weights, and an optimizer step or ``load_state_dict`` on
  them is what the kernel sees next. Gradients are PyTorch's (dense, or sparse where the
  original lookup asked for ``sparse=True``), computed by :class:`_TBELookupFunction`; fbgemm's
  own backward, which would apply an SGD update to the weights, never runs.
* ``"direct"`` (pooled groups): the plain lookups, concatenated in inference into an output
  buffer the group keeps between calls and reuses when nothing refers to the previous result
  any more (CPU; see :class:`ReusedOutput`), which saves page-faulting a fresh output of tens
  of MB every call. In training: the plain lookups' forward with fxrec's gradients (as for
  ``"fbgemm"``), which a fused optimizer needs.
* ``"native"`` (pooled groups, CPU): fxrec's own kernel (``fxrec/csrc/pooled.cpp``, built on
  first use, see :mod:`fxrec.runtime._native`) reads every feature's ids as given and writes
  the pooled rows straight into their columns of the output: no per-table outputs, no cat,
  no packing. In inference it writes into the reused buffer; in training its forward feeds
  fxrec's gradients, and with a fused optimizer (``FusedSpec.impl == "native"``: SGD, Adagrad,
  row-wise Adagrad) its backward kernels update the looked-up rows, never making a gradient.
* ``"loop"``: the original ATen lookups one after the other, bit for bit what the user's model
  computed.

These modules know nothing of graphs or passes.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import _fbgemm, native_lookup
from ._tracing import exporting
from .output_buffer import ReusedOutput

PATHS = ("fbgemm", "native", "direct", "loop")



@dataclass(frozen=True)
class FeatureSpec:
    """One lookup of a group, as the runtime needs it.

    form:
      ``bag``        1-D ids with offsets (``nn.EmbeddingBag`` / ``F.embedding_bag``)
      ``pooled_seq`` 2-D ``[B, L]`` ids pooled over L (``nn.Embedding`` then sum/mean over dim 1)
      ``single``     1-D ``[B]`` ids, one row each (``nn.Embedding`` on a column)
      ``seq``        ids of any shape, no pooling (``nn.Embedding`` sequence lookup)
    padding_idx: the table's padding row, or None. For ``bag`` it is excluded from the bag (as
      ``nn.EmbeddingBag`` does); for the other forms it is looked up but gets no gradient (as
      ``nn.Embedding`` does).
    """

    name: str
    table: int
    form: str
    padding_idx: Optional[int] = None
    include_last_offset: bool = False
    weighted: bool = False


@dataclass(frozen=True)
class TableSpec:
    name: str
    num_rows: int
    dim: int
    sparse: bool = False


@dataclass(frozen=True)
class FusedSpec:
    """An optimizer fbgemm applies inside the TBE backward: ``sgd``, ``adagrad`` or
    ``rowwise_adagrad``, with its learning rate and eps."""

    kind: str
    lr: float
    eps: float = 1e-8
    # "fbgemm": fbgemm's backward kernel applies the update. "torch" (SGD only): fxrec's backward
    # adds -lr * gradient rows into the looked-up rows with index_add_ (PyTorch's multi-threaded
    # kernels), after whichever forward is faster. "native" (CPU): fxrec's own kernels, forward
    # and update (fxrec/csrc/pooled.cpp), for SGD, Adagrad and row-wise Adagrad; the Adagrad
    # states live in the bound fbgemm TBE (as for "fbgemm"). Where fxrec's kernels cannot run a
    # call: SGD as "torch", the Adagrads by fbgemm's fused kernel.
    impl: str = "fbgemm"


# Names of the optimizer states fbgemm keeps per table, in split_optimizer_states() order.
FUSED_STATE_NAMES = {"sgd": (), "adagrad": ("sum",), "rowwise_adagrad": ("sum",)}


def group_forward(forward):
    """Wraps every group module's ``forward``:

    * a bag's ids and offsets of different integer dtypes are both taken as their common dtype,
      as ``F.embedding_bag`` does (int16 ids with int64 offsets are int64 ids);
    * while torch.export traces, the checks of ids and offsets become graph ops (``_assert_inputs``);
    * an error raised inside is first checked for inputs on another device than the tables, and
      then says which feature got them;
    * ``torch.compile`` runs the group as it is (``torch.compiler.disable``: a graph break around
      it; the dense parts of the model are compiled); its kernels and checks are not traceable.
    """

    @functools.wraps(forward)
    def call(self, ids_list, offsets_list, psw_list, *params):
        if self._bag_features:
            ids_list, offsets_list = self._promote_bags(ids_list, offsets_list)
        if exporting():
            self._check_count(ids_list)
            self._assert_inputs(ids_list, offsets_list)
        try:
            return forward(self, ids_list, offsets_list, psw_list, *params)
        except (RuntimeError, TypeError, ValueError, IndexError) as e:
            self._check_devices(ids_list, offsets_list, psw_list, params[0] if params else [], e)
            raise

    return torch.compiler.disable(call)


class _Bound:
    """fbgemm TBE whose flat weight buffer the group's parameters are views of."""

    def __init__(self, tbe: nn.Module, ptrs: List[int]):
        self.tbe = tbe
        self.ptrs = ptrs


class EmbeddingGroup(nn.Module):
    """Base of the group modules: specs, input checks, and the binding to fbgemm's TBE."""

    def __init__(
        self,
        tables: Sequence[TableSpec],
        features: Sequence[FeatureSpec],
        pooling: str,
        path_train: str = "fbgemm",
        path_eval: str = "fbgemm",
        fused: Optional[FusedSpec] = None,
    ):
        super().__init__()
        if pooling not in ("sum", "mean", "none"):
            raise ValueError(f"pooling must be 'sum', 'mean' or 'none', got {pooling!r}")
        self.tables = list(tables)
        self.features = list(features)
        self.pooling = pooling
        self.set_paths(path_train, path_eval)
        ftm = [f.table for f in self.features]
        if ftm != sorted(ftm):
            # fbgemm's kernels need each table's features adjacent (feature_table_map
            # non-decreasing); with [0, 1, 0] its CPU backward updates wrong rows
            raise ValueError(f"fxrec: a group's features must be ordered by table, got table order {ftm}")
        self.dims = [self.tables[f.table].dim for f in self.features]
        self._bag_features = [i for i, f in enumerate(self.features) if f.form == "bag"]
        self._min_rows = min(t.num_rows for t in self.tables)
        self._features_of_table = [
            [i for i, f in enumerate(self.features) if f.table == t] for t in range(len(self.tables))
        ]
        self._bound: Optional[_Bound] = None
        # Inference on the "direct" path: reuse the output buffer between calls (CPU only).
        self.reuse_output = True
        self._out = ReusedOutput()
        self.fused = fused
        # Off while fxrec verifies or times the group: gradients instead of updates.
        self.fused_enabled = True
        self._carry_states: Optional[List[List[torch.Tensor]]] = None

    @property
    def fused_active(self) -> bool:
        """Training updates the tables inside backward (no gradients reach the parameters)."""
        return self.fused is not None and self.fused_enabled and self.path_train != "loop"

    def _fbgemm_updates(self) -> bool:
        """Training applies the fused optimizer by fbgemm's backward: its own path, or an
        Adagrad of the native path on a call fxrec's kernels cannot take."""
        return self.fused_active and (
            self.fused.impl == "fbgemm" or (self.fused.impl == "native" and self.fused.kind != "sgd")
        )

    def set_learning_rate(self, lr: float) -> None:
        """Learning rate of the fused optimizer (from the next backward on)."""
        if self.fused is None:
            raise RuntimeError(f"fxrec: tables {[t.name for t in self.tables]} have no fused optimizer")
        if lr != self.fused.lr:
            self.fused = dataclasses.replace(self.fused, lr=float(lr))
            if self._bound is not None and self.fused.impl in ("fbgemm", "native"):
                self._bound.tbe.set_learning_rate(float(lr))

    def optimizer_states(self, params: Sequence[torch.Tensor]) -> List[dict]:
        """Per table, the fused optimizer's state tensors by name (views: writes go to the kernel)."""
        if self.fused is None:
            return [{} for _ in self.tables]
        states = self._ensure_bound(params).split_optimizer_states()
        names = FUSED_STATE_NAMES[self.fused.kind]
        return [dict(zip(names, per_table)) for per_table in states]

    def set_paths(self, path_train: str, path_eval: str) -> None:
        for p in (path_train, path_eval):
            if p not in PATHS:
                raise ValueError(f"path must be one of {PATHS}, got {p!r}")
        self.path_train = path_train
        self.path_eval = path_eval

    def extra_repr(self) -> str:
        names = ", ".join(t.name for t in self.tables)
        return (
            f"pooling={self.pooling}, tables=[{names}], features={len(self.features)}, "
            f"path_train={self.path_train}, path_eval={self.path_eval}"
        )

    # deepcopy/pickle must not carry the TBE: the copy's parameters are new tensors, and the
    # copy binds its own TBE to them on first use.
    def __getstate__(self):
        state = self.__dict__.copy()
        state["_bound"] = None
        # the link to an optimizer (its learning-rate hook) stays with the original
        state.pop("_fxrec_lr_hook", None)
        state["_forward_pre_hooks"] = type(self._forward_pre_hooks)(
            (k, h) for k, h in self._forward_pre_hooks.items() if not getattr(h, "fxrec_optimizer_link", False))
        if self._bound is not None and self.fused is not None:
            # the fused optimizer's states travel with the copy (its TBE is rebuilt)
            state["_carry_states"] = [[x.detach().clone() for x in t] for t in self._bound.tbe.split_optimizer_states()]
        return state

    # ---------------------------------------------------------------- input checks
    def _promote_bags(self, ids_list, offsets_list):
        """As F.embedding_bag: integer ids and offsets of different dtypes, both as their common dtype
        (float ones are left to the checks, which name the feature)."""
        new_ids = new_offs = None
        for i in self._bag_features:
            ids, off = ids_list[i], offsets_list[i]
            if off is not None and ids.dtype != off.dtype and not (ids.is_floating_point() or off.is_floating_point()):
                common = torch.promote_types(ids.dtype, off.dtype)
                if new_ids is None:
                    new_ids, new_offs = list(ids_list), list(offsets_list)
                new_ids[i], new_offs[i] = ids.to(common), off.to(common)
        return (ids_list, offsets_list) if new_ids is None else (new_ids, new_offs)

    def _table_device(self, params) -> Optional[torch.device]:
        if params:
            return params[0].device
        buf = next(self.buffers(), None)
        return buf.device if buf is not None else None

    def _check_devices(self, ids_list, offsets_list, psw_list, params, error: BaseException) -> None:
        """Raise, naming the feature, when an input is on another device than the tables."""
        dev = self._table_device(params)
        if dev is None:
            return
        for f, ids, off, psw in zip(self.features, ids_list, offsets_list, psw_list):
            for what, t in (("ids", ids), ("offsets", off), ("per-sample weights", psw)):
                if isinstance(t, torch.Tensor) and t.device != dev:
                    raise ValueError(
                        f"fxrec: feature '{f.name}' (table '{self.tables[f.table].name}') got {what} on {t.device}, "
                        f"but the table is on {dev}: move the inputs to {dev}") from error

    def _check_count(self, ids_list) -> None:
        if len(ids_list) != len(self.features):
            raise ValueError(
                f"fxrec: group of tables {[t.name for t in self.tables]} expects "
                f"{len(self.features)} id tensors, got {len(ids_list)}"
            )

    def _assert_inputs(self, ids_list, offsets_list) -> None:
        """An exported program checks ids and offsets as the eager group does: the checks become
        ``aten._assert_async`` ops (no value is read while tracing) that raise when the program
        runs, naming the feature and table."""
        for f, ids, off in zip(self.features, ids_list, offsets_list):
            t = self.tables[f.table]
            where = f"feature '{f.name}' (table '{t.name}', {t.num_rows} rows)"
            if ids.dtype.is_floating_point:
                self._check_ids(f, ids)  # raises (a dtype is known while tracing)
            torch._assert_async(~((ids < 0) | (ids >= t.num_rows)).any(),
                                f"fxrec: {where} looks up an id outside 0..{t.num_rows - 1}")
            if f.form == "bag" and off is not None and off.dim() == 1:
                bad = (off[:1] != 0).any() | (off[1:] < off[:-1]).any() | (off[-1:] > ids.numel()).any()
                torch._assert_async(~bad, f"fxrec: offsets of {where} must start at 0, never decrease and end "
                                    "at most at its number of ids")

    def _check_ids(self, f: FeatureSpec, ids: torch.Tensor) -> None:
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(
                f"fxrec: feature '{f.name}' (table '{self.tables[f.table].name}') got ids of "
                f"dtype {ids.dtype}; embedding ids must be int64 or int32 "
                "(cast them with .long() in the model)"
            )
        if ids.numel() == 0:
            return
        lo, hi = torch.aminmax(ids)
        lo_i, hi_i = int(lo), int(hi)
        rows = self.tables[f.table].num_rows
        if lo_i < 0 or hi_i >= rows:
            bad = lo_i if lo_i < 0 else hi_i
            raise IndexError(
                f"fxrec: feature '{f.name}' looks up id {bad} in table "
                f"'{self.tables[f.table].name}', which has {rows} rows (valid ids: 0..{rows - 1})"
            )

    def _check_offsets(self, f: FeatureSpec, ids: torch.Tensor, offsets: torch.Tensor) -> None:
        if offsets.dim() != 1 or offsets.dtype not in (torch.int64, torch.int32):
            raise TypeError(
                f"fxrec: feature '{f.name}' needs 1-D integer offsets, got shape "
                f"{tuple(offsets.shape)} and dtype {offsets.dtype}"
            )
        if offsets.numel() == 0:
            return
        n = ids.numel()
        first = int(offsets[0])
        bad_order = bool((offsets[1:] < offsets[:-1]).any()) if offsets.numel() > 1 else False
        last = int(offsets[-1])
        if first != 0 or bad_order or last > n:
            raise ValueError(
                f"fxrec: offsets of feature '{f.name}' (table '{self.tables[f.table].name}') do "
                f"not match its {n} ids: offsets must start at 0, never decrease and end at most "
                f"at {n}; got first={first}, last={last}, decreasing={bad_order}"
            )

    # ---------------------------------------------------------------- binding to fbgemm
    def _fbgemm_usable(self, params: Sequence[torch.Tensor]) -> bool:
        if not _fbgemm.fbgemm_available():
            return False
        dev = params[0].device
        return all(
            p.dtype == torch.float32 and p.device == dev and p.dim() == 2 for p in params
        )

    def _ensure_bound(self, params: Sequence[torch.Tensor]) -> nn.Module:
        b = self._bound
        if b is None or b.ptrs != [p.data_ptr() for p in params]:
            b = self._bind(params)
        return b.tbe

    def _bind(self, params: Sequence[torch.Tensor]) -> _Bound:
        """Move the group's weights into one fbgemm TBE and make the parameters views of it.

        Called on first use and again whenever a parameter no longer aliases the TBE (after
        ``.to(device)``, ``deepcopy``, or a ``param.data = ...`` by the user), so the kernel can
        never read stale weights.
        """
        for t, p in zip(self.tables, params):
            if tuple(p.shape) != (t.num_rows, t.dim):
                raise ValueError(
                    f"fxrec: weight of table '{t.name}' has shape {tuple(p.shape)}, expected "
                    f"({t.num_rows}, {t.dim}) as when the model was transformed"
                )
        ftm = [f.table for f in self.features]
        fused = self.fused if self.fused is not None and self.fused.impl in ("fbgemm", "native") else None
        tbe = _fbgemm.make_training_tbe(
            [(t.num_rows, t.dim) for t in self.tables], ftm, self.pooling, params[0].device,
            optimizer=fused.kind if fused else "none", learning_rate=fused.lr if fused else 0.0,
            eps=fused.eps if fused else 1e-8,
        )
        views = tbe.split_embedding_weights()
        old_states = (
            self._bound.tbe.split_optimizer_states() if self._bound is not None and fused else self._carry_states
        )
        with torch.no_grad():
            for p, v in zip(params, views):
                v.copy_(p.detach())
                p.data = v
            if fused and old_states:
                for new_t, old_t in zip(tbe.split_optimizer_states(), old_states):
                    for n, o in zip(new_t, old_t):
                        n.copy_(o)
        self._carry_states = None
        self._bound = _Bound(tbe, [p.data_ptr() for p in params])
        return self._bound

    def _run_tbe(self, tbe, batch, indices, offsets, psw, params, training: bool, forward=None):
        """Run the group on its packed input: with fbgemm's fused optimizer in training (fbgemm's
        backward updates the tables), else through _TBELookupFunction (PyTorch's gradients, or
        fxrec's own fused update). ``forward`` computes the output without autograd; by
        default fbgemm's TBE forward."""
        if training and self._fbgemm_updates():
            frozen = [t.name for t, p in zip(self.tables, params) if not p.requires_grad]
            if frozen:
                self._fused_unusable(
                    params, f"tables {frozen} are frozen (requires_grad=False) and fbgemm's fused kernel would update "
                    "them; give them no optimizer (optimizer={name: ...} for the others), or use backend='native' on CPU"
                )
            return tbe(indices, offsets, per_sample_weights=psw)
        if forward is None:
            def forward():
                if torch.is_inference_mode_enabled():
                    # fbgemm's training TBE registers its CPU forward behind autograd only, which
                    # inference mode (and its tensors) skip: outside it, on ordinary copies of the
                    # (small) index tensors, under no_grad, the same kernel runs
                    with torch.inference_mode(False), torch.no_grad():
                        return tbe(indices.clone(), offsets.clone(), per_sample_weights=None if psw is None else psw.clone())
                return tbe(indices, offsets, per_sample_weights=psw)
        return _TBELookupFunction.apply(self, forward, batch, indices, offsets, psw, *params)

    def _check_fused_usable(self, params, training: bool) -> bool:
        """Whether this call trains with the fused optimizer; raises when it should but cannot."""
        fused = training and self.fused_active
        if fused and not self._fbgemm_usable(params):
            self._fused_unusable(params, "fbgemm cannot run them (fbgemm missing, or not fp32 on one device)")
        return fused

    def _fused_unusable(self, params, why: str):
        raise RuntimeError(
            f"fxrec: tables {[t.name for t in self.tables]} train with a fused optimizer, but {why}; "
            "transform without optimizer= (or with backend='loop') to use torch.optim instead"
        )

    def _training(self, params: Sequence[torch.Tensor], psw_list) -> bool:
        return torch.is_grad_enabled() and (
            any(p.requires_grad for p in params)
            or any(w is not None and w.requires_grad for w in psw_list)
        )


class PooledEmbeddingGroup(EmbeddingGroup):
    """Pooled lookups (sum or mean) of one group; returns ``[B, sum of dims]``."""

    @group_forward
    def forward(
        self,
        ids_list: List[torch.Tensor],
        offsets_list: List[Optional[torch.Tensor]],
        psw_list: List[Optional[torch.Tensor]],
        params: List[torch.Tensor],
    ) -> torch.Tensor:
        self._check_count(ids_list)
        if exporting():
            return self.loop(ids_list, offsets_list, psw_list, params)
        training = self._training(params, psw_list)
        fused = self._check_fused_usable(params, training)
        path = self.path_train if training else self.path_eval
        native = None
        if path == "native":
            own_state = fused and self.fused.impl == "native" and self.fused.kind != "sgd"
            if own_state:
                self._ensure_bound(params)  # the Adagrad states live in the bound TBE
            native = native_lookup.native_call(self, ids_list, offsets_list, psw_list, params)
            if native is not None and not training:
                return native_lookup.native_forward(self, native, ids_list, offsets_list, reuse=self.reuse_output)
            if native is not None and fused and self.fused.impl == "native" and native_lookup.fused_fits(params, psw_list):
                return native_lookup.NativeFusedFunction.apply(self, native, ids_list, offsets_list, *params)
            if own_state:
                path, native = "fbgemm", None  # this call: fbgemm's fused kernel, on the same states
        if path == "direct" and not training:
            out = self._direct(ids_list, offsets_list, psw_list, params) if self.reuse_output else None
            if out is not None:
                return out
        elif path in ("direct", "native") or (path == "fbgemm" and self._fbgemm_usable(params)):
            packed = self._pack(ids_list, offsets_list, psw_list, strict=fused)
            if packed is not None:
                indices, offsets, psw, batch = packed
                self._validate_packed(indices, offsets, ids_list, offsets_list)
                # the forward without autograd; fxrec's backward gives the gradients
                forward = None  # fbgemm's TBE
                if path == "direct" or (path == "native" and native is None):  # PyTorch's per-table kernels
                    forward = functools.partial(self.loop, ids_list, offsets_list, psw_list, params)
                elif path == "native":  # fxrec's kernel
                    forward = functools.partial(native_lookup.native_forward, self, native, ids_list, offsets_list,
                                                reuse=False)
                tbe = self._ensure_bound(params) if forward is None or (fused and self._fbgemm_updates()) else None
                return self._run_tbe(tbe, batch, indices, offsets, psw, params, training, forward)
            if fused and any(ids.numel() for ids in ids_list):
                self._fused_unusable(params, "its features have different batch sizes (or a [B, 0] id tensor is mean-pooled)")
            if fused:  # empty batch: nothing to update
                with torch.no_grad():
                    return self.loop(ids_list, offsets_list, psw_list, params)
        try:
            return self.loop(ids_list, offsets_list, psw_list, params)
        except (IndexError, RuntimeError, TypeError, ValueError):
            # PyTorch's own kernels checked the inputs; say which feature and table was wrong.
            self._check_inputs(ids_list, offsets_list)
            raise

    def _direct(self, ids_list, offsets_list, psw_list, params) -> Optional[torch.Tensor]:
        """The plain lookups concatenated into the group's reused output buffer (see
        :class:`ReusedOutput`); None where the loop must give PyTorch's own answer (an empty
        batch, batch sizes that differ, odd shapes)."""
        batch = -1
        for f, ids, off in zip(self.features, ids_list, offsets_list):
            if f.form == "bag":
                if off is None or off.dim() != 1 or ids.dim() != 1:
                    return None
                b = off.numel() - 1 if f.include_last_offset else off.numel()
            elif ids.dim() != (1 if f.form == "single" else 2):
                return None
            else:
                b = ids.shape[0]
            if batch < 0:
                batch = b
            elif b != batch:
                return None
        if batch <= 0:
            return None
        w0 = params[0]
        out = self._out.take([batch, sum(self.dims)], w0.dtype, w0.device)
        try:
            return self.loop(ids_list, offsets_list, psw_list, params, out=out)
        except (IndexError, RuntimeError, TypeError, ValueError):
            self._check_inputs(ids_list, offsets_list)  # names the feature and table
            raise

    def _empty_mean_columns(self, ids_list) -> List[int]:
        """Output columns of the features that mean-pool ``[B, 0]`` ids: PyTorch's answer there is NaN."""
        cols, start = [], 0
        for f, ids, d in zip(self.features, ids_list, self.dims):
            if self.pooling == "mean" and f.form == "pooled_seq" and ids.dim() == 2 and ids.shape[1] == 0:
                cols.extend(range(start, start + d))
            start += d
        return cols

    def _validate_packed(self, indices, offsets, ids_list, offsets_list) -> None:
        """Cheap checks on the packed input (a few ops for the whole group); on failure, the
        per-feature checks find the feature and raise a message that names it."""
        if exporting():
            return
        ok = True
        if indices.numel():
            lo, hi = (int(x) for x in torch.aminmax(indices))
            ok = lo >= 0 and hi < self._min_rows
            if not ok and lo >= 0:  # tables of different sizes: check each feature
                ok = all(
                    ids.numel() == 0 or int(ids.max()) < self.tables[f.table].num_rows
                    for f, ids in zip(self.features, ids_list)
                )
        if ok and offsets.numel() > 1:
            ok = bool((offsets[1:] >= offsets[:-1]).all())
        if not ok:
            self._check_inputs(ids_list, offsets_list)
            raise ValueError(f"fxrec: invalid ids or offsets for tables {[t.name for t in self.tables]}")

    def _check_inputs(self, ids_list, offsets_list) -> None:
        self._check_count(ids_list)
        for f, ids, off in zip(self.features, ids_list, offsets_list):
            self._check_ids(f, ids)
            if f.form == "bag":
                if off is None:
                    raise ValueError(f"fxrec: feature '{f.name}' needs offsets")
                self._check_offsets(f, ids, off)
            elif f.form == "pooled_seq" and ids.dim() != 2:
                raise ValueError(
                    f"fxrec: feature '{f.name}' expects 2-D [batch, length] ids, got shape "
                    f"{tuple(ids.shape)}"
                )
            elif f.form == "single" and ids.dim() != 1:
                raise ValueError(
                    f"fxrec: feature '{f.name}' expects 1-D ids, got shape {tuple(ids.shape)}"
                )

    def loop(self, ids_list, offsets_list, psw_list, params, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The original lookups, one after the other (PyTorch's own kernels), concatenated
        (into ``out`` when given)."""
        outs = []
        for f, ids, off, psw in zip(self.features, ids_list, offsets_list, psw_list):
            w = params[f.table]
            sparse = self.tables[f.table].sparse
            if f.form == "bag":
                outs.append(
                    F.embedding_bag(
                        ids, w, off, mode=self.pooling, sparse=sparse, per_sample_weights=psw,
                        include_last_offset=f.include_last_offset, padding_idx=f.padding_idx,
                    )
                )
            else:
                e = F.embedding(ids, w, padding_idx=f.padding_idx, sparse=sparse)
                if f.form == "pooled_seq":
                    e = e.sum(1) if self.pooling == "sum" else e.mean(1)
                outs.append(e)
        return torch.cat(outs, 1) if out is None else torch.cat(outs, 1, out=out)

    def _pack(self, ids_list, offsets_list, psw_list, empty_means: bool = False, strict: bool = False):
        """One indices/offsets/weights input for the TBE, or None when only the loop fits.

        ``empty_means``: pack a mean over ``[B, 0]`` ids as empty bags (the kernel gives 0; the
        caller writes PyTorch's NaN into those columns) instead of returning None. ``strict``: raise,
        naming the feature, where the answer would be None for an input only PyTorch's own kernels
        reproduce (the caller has no such fallback: a fused optimizer, a quantized table).

        Features are packed feature-major: bags ``f*B .. (f+1)*B`` belong to feature f. The
        common cases (plain bags, single ids, [B, L] ids) cost a constant number of tensor ops
        for the whole group, not a few per feature.
        """
        starts: List[torch.Tensor] = []  # per feature: where each of its B bags starts
        flat_ids: List[torch.Tensor] = []
        weights: List[torch.Tensor] = []
        batch = -1
        any_weighted = any(f.weighted for f in self.features)
        for f, ids, off, psw in zip(self.features, ids_list, offsets_list, psw_list):
            if ids.dtype not in (torch.int64, torch.int32):
                self._check_ids(f, ids)  # raises, naming the feature
            dev = ids.device
            if f.form == "bag":
                flat = ids.reshape(-1)
                if off is None or off.dtype not in (torch.int64, torch.int32):
                    self._check_inputs(ids_list, offsets_list)  # raises, naming the feature
                if off.dtype != torch.int64:
                    off = off.long()
                if f.include_last_offset and exporting():
                    # an exported program cannot drop a data-dependent number of trailing ids:
                    # it asserts there are none (offsets[-1] == number of ids)
                    torch._assert_async(off[-1] == flat.numel(),
                                        f"fxrec: offsets[-1] of feature '{f.name}' must equal its number of ids")
                    off = torch.cat([off[:-1], off.new_full((1,), flat.numel())])
                if f.include_last_offset or f.padding_idx is not None:
                    last = int(off[-1]) if f.include_last_offset and not exporting() and off.numel() else None
                    if last is not None and last > flat.numel():
                        raise ValueError(
                            f"fxrec: offsets of feature '{f.name}' (table '{self.tables[f.table].name}') end "
                            f"at {last}, past its {flat.numel()} ids"
                        )
                    if last is not None and last < flat.numel() and self.pooling == "mean":
                        # PyTorch sums the last bag up to offsets[-1] but divides it by the number of
                        # ids to the end of the tensor (and its backward gives those ids gradients)
                        if strict:
                            raise ValueError(
                                f"fxrec: feature '{f.name}' (table '{self.tables[f.table].name}') has "
                                f"{flat.numel() - last} ids after offsets[-1] = {last} with include_last_offset=True "
                                "and mean pooling, where PyTorch's mean divides the last bag by the ids up to the "
                                "end of the tensor; fused optimizers and quantized tables do not reproduce that: "
                                "pass only the ids up to offsets[-1]")
                        return None
                    if not f.include_last_offset:
                        off = torch.cat([off, off.new_full((1,), flat.numel())])
                    elif (f.padding_idx is not None or exporting()) and off.numel():
                        # as PyTorch does: with a padding_idx the last bag runs to the end of the ids
                        off = torch.cat([off[:-1], off.new_full((1,), flat.numel())])
                    else:
                        flat = flat[: int(off[-1])] if off.numel() else flat[:0]
                    if f.padding_idx is not None:
                        if not exporting() and bool((off > flat.numel()).any()):
                            self._check_offsets(f, flat, off)  # raises, naming the feature
                        keep = flat != f.padding_idx
                        kept_before = torch.cat([keep.new_zeros(1, dtype=torch.long), keep.long().cumsum(0)])
                        off = kept_before[off]
                        flat = flat[keep]
                        if psw is not None:
                            psw = psw.reshape(-1)[: keep.numel()][keep]
                    off = off[:-1]
                b = off.numel()
                start = off
            elif f.form == "pooled_seq":
                b, length = ids.shape
                flat = ids.reshape(-1)
                if length == 0 and self.pooling == "mean" and not empty_means:
                    return None  # PyTorch's mean of no rows is NaN; only its own kernels give that
                start = (torch.arange(0, b * length, length, device=dev) if length
                         else torch.zeros(b, dtype=torch.long, device=dev))
            else:  # single
                b = ids.shape[0]
                flat = ids
                start = torch.arange(b, device=dev)
            if batch < 0:
                batch = b
            elif b != batch:
                return None  # features with different batch sizes: TBE needs one B
            flat_ids.append(flat if flat.dtype == torch.int64 else flat.long())
            starts.append(start)
            if any_weighted:
                if psw is None:
                    psw = torch.ones(flat.numel(), dtype=torch.float32, device=flat.device)
                weights.append(psw.reshape(-1)[: flat.numel()].float())
        if batch <= 0:
            return None  # empty batch: PyTorch's own kernels give the exact empty result
        indices = torch.cat(flat_ids)
        bases = [0]
        for x in flat_ids[:-1]:
            bases.append(bases[-1] + x.numel())
        all_starts = torch.cat(starts)
        nfeat = len(flat_ids)
        firsts = all_starts.view(nfeat, batch)[:, 0]
        if not exporting() and bool((firsts != 0).any()):
            bad = int(torch.nonzero(firsts)[0, 0])
            f = self.features[bad]
            raise ValueError(
                f"fxrec: offsets of feature '{f.name}' (table '{self.tables[f.table].name}') must "
                f"start at 0, got {int(firsts[bad])}"
            )
        offsets = torch.empty(nfeat * batch + 1, dtype=torch.long, device=indices.device)
        base = torch.tensor(bases, dtype=torch.long, device=indices.device)
        torch.add(all_starts.view(nfeat, batch), base.unsqueeze(1), out=offsets[:-1].view(nfeat, batch))
        offsets[-1] = indices.numel()
        psw = torch.cat(weights) if any_weighted else None
        return indices, offsets, psw, batch


class SequenceEmbeddingGroup(EmbeddingGroup):
    """Unpooled lookups of one group (all tables share one dim); returns one tensor per feature."""

    def __init__(self, tables, features, pooling="none", path_train="fbgemm", path_eval="fbgemm", fused=None):
        super().__init__(tables, features, pooling, path_train, path_eval, fused)
        if len(set(t.dim for t in self.tables)) != 1:
            raise ValueError("fxrec: the tables of a sequence group must share one dim")

    @group_forward
    def forward(
        self,
        ids_list: List[torch.Tensor],
        offsets_list: List[Optional[torch.Tensor]],
        psw_list: List[Optional[torch.Tensor]],
        params: List[torch.Tensor],
    ) -> List[torch.Tensor]:
        self._check_count(ids_list)
        for f, ids in zip(self.features, ids_list):
            if ids.dtype not in (torch.int64, torch.int32):
                self._check_ids(f, ids)  # raises, naming the feature
        if exporting():
            return self.loop(ids_list, offsets_list, psw_list, params)
        counts = [ids.numel() for ids in ids_list]
        training = self._training(params, psw_list)
        if max(counts) == 0 and self._check_fused_usable(params, training):
            with torch.no_grad():
                return self.loop(ids_list, offsets_list, psw_list, params)
        if (
            (self.path_train if training else self.path_eval) == "fbgemm"
            and self._fbgemm_usable(params)
            and max(counts) > 0
        ):
            tbe = self._ensure_bound(params)
            indices, offsets, bmax = self._pack_sequence(ids_list)
            out = self._run_tbe(tbe, bmax, indices, offsets, None, params, training)
            return self._unpack_sequence(out, ids_list)
        try:
            return self.loop(ids_list, offsets_list, psw_list, params)
        except (IndexError, RuntimeError):
            for f, ids in zip(self.features, ids_list):
                self._check_ids(f, ids)  # name the feature and table PyTorch complained about
            raise

    def _pack_sequence(self, ids_list):
        """Packed nobag input: feature f gets max(counts) bags, the first counts[f] of length one."""
        counts = [ids.numel() for ids in ids_list]
        bmax = max(counts)
        dev = ids_list[0].device
        counts_t = torch.tensor(counts, device=dev)
        all_len = (torch.arange(bmax, device=dev) < counts_t.unsqueeze(1)).long().reshape(-1)
        indices = torch.cat([ids.reshape(-1).long() for ids in ids_list])
        if not exporting():
            lo, hi = torch.aminmax(indices)
            if int(lo) < 0 or int(hi) >= self._min_rows:
                for f, ids in zip(self.features, ids_list):
                    self._check_ids(f, ids)
        offsets = torch.zeros(all_len.numel() + 1, dtype=torch.long, device=dev)
        torch.cumsum(all_len, 0, out=offsets[1:])
        return indices, offsets, bmax

    def _unpack_sequence(self, out, ids_list) -> List[torch.Tensor]:
        d = self.tables[0].dim
        return [
            part.reshape(tuple(ids.shape) + (d,))
            for part, ids in zip(torch.split(out, [ids.numel() for ids in ids_list], 0), ids_list)
        ]

    def loop(self, ids_list, offsets_list, psw_list, params) -> List[torch.Tensor]:
        return [
            F.embedding(ids, params[f.table], padding_idx=f.padding_idx, sparse=self.tables[f.table].sparse)
            for f, ids in zip(self.features, ids_list)
        ]


class _TBELookupFunction(torch.autograd.Function):
    """fbgemm TBE forward with PyTorch's gradients.

    Forward runs the TBE kernel without autograd (so fbgemm's fused-update backward is never
    built). Backward returns, for each table parameter, the gradient ``nn.EmbeddingBag`` /
    ``nn.Embedding`` would give it: dense ``[rows, dim]`` or a sparse COO tensor of the looked-up
    rows for tables created with ``sparse=True``; and the gradient of the per-sample weights.
    """

    @staticmethod
    def forward(ctx, group, forward, batch, indices, offsets, psw, *params):
        with torch.no_grad():
            out = forward()
        ctx.group = group
        ctx.batch = batch
        if group.fused_active and group.fused.impl in ("torch", "native") and group.fused.kind == "sgd":
            # backward updates these in place, so they are not saved (a second forward before
            # backward, e.g. fast(pos) + fast(neg), must not trip autograd's version check)
            ctx.save_for_backward(indices, offsets, psw)
            ctx.params = params
        else:
            ctx.save_for_backward(indices, offsets, psw, *params)
            ctx.params = None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        group: EmbeddingGroup = ctx.group
        indices, offsets, psw, *params = ctx.saved_tensors
        if ctx.params is not None:
            params = list(ctx.params)
        batch = ctx.batch
        nfeat = len(group.features)
        n = indices.numel()
        dev = indices.device
        lengths = offsets.diff()
        # Features are packed feature-major, so feature i owns indices bounds[i]:bounds[i+1].
        bounds = offsets[torch.arange(0, nfeat + 1, device=dev) * batch].tolist()

        # Per-index scale: the sample weight, 1/len for mean pooling, 0 for a padding row.
        scale: Optional[torch.Tensor] = psw
        if group.pooling == "mean":
            bag = torch.repeat_interleave(
                torch.arange(lengths.numel(), device=dev), lengths, output_size=n
            )
            inv = (1.0 / lengths.clamp(min=1).to(grad_out.dtype))[bag]
            scale = inv if scale is None else scale * inv
        for i, f in enumerate(group.features):
            if f.padding_idx is not None and f.form != "bag":
                if scale is None:
                    scale = torch.ones(n, dtype=grad_out.dtype, device=dev)
                s, e = bounds[i], bounds[i + 1]
                scale = scale.clone() if scale is psw else scale
                scale[s:e] = scale[s:e] * (indices[s:e] != f.padding_idx)

        # fxrec's own fused SGD: no gradient is made, the rows are updated below. The -lr factor
        # goes on grad_out ([B, sum of dims]) before the rows are gathered, unless the
        # per-sample-weight gradient needs the unscaled rows.
        sgd_lr = (group.fused.lr if group.fused_active and group.fused.impl in ("torch", "native")
                  and group.fused.kind == "sgd" else None)
        prescaled = sgd_lr is not None and not (psw is not None and ctx.needs_input_grad[5])
        if prescaled:
            grad_out = grad_out * (-sgd_lr)

        # Gradient row for every looked-up index: the grad of its bag, in its feature's columns
        # (made when first needed).
        pieces: dict = {}
        cols = [0]
        for d in group.dims:
            cols.append(cols[-1] + d)
        bag_row: Optional[torch.Tensor] = None

        def piece(i: int) -> torch.Tensor:
            nonlocal bag_row
            if i not in pieces:
                if group.pooling == "none":
                    pieces[i] = grad_out[bounds[i] : bounds[i + 1]]
                else:
                    if bag_row is None:
                        bag_row = torch.repeat_interleave(
                            torch.arange(lengths.numel(), device=dev) % batch, lengths, output_size=n
                        )
                    pieces[i] = grad_out[:, cols[i] : cols[i + 1]].index_select(0, bag_row[bounds[i] : bounds[i + 1]])
            return pieces[i]

        def rows_of(i: int) -> torch.Tensor:
            if scale is None:
                return piece(i)
            rows = piece(i) * scale[bounds[i] : bounds[i + 1]].unsqueeze(1)
            f = group.features[i]
            if f.padding_idx is not None and f.form != "bag":
                # exactly zero for the padding row, even where grad_out holds inf or NaN
                pad = indices[bounds[i] : bounds[i + 1]] == f.padding_idx
                rows = rows.masked_fill(pad.unsqueeze(1), 0.0)
            return rows

        grad_psw = None
        if psw is not None and ctx.needs_input_grad[5]:
            parts = []
            for i, f in enumerate(group.features):
                s, e = bounds[i], bounds[i + 1]
                parts.append((params[f.table].detach()[indices[s:e]] * piece(i)).sum(1))
            grad_psw = torch.cat(parts)

        # The fused SGD update comes after the per-sample-weight gradient, which reads the
        # weights before the update.
        grads: List[Optional[torch.Tensor]] = [None] * len(params)
        need = ctx.needs_input_grad[6:]
        if sgd_lr is None and native_lookup.dense_grads_by_kernel(group, grad_out, need):
            grads = native_lookup.dense_grads(group, grad_out, indices, offsets, scale, bounds, batch)
        for t, (spec, p) in enumerate(zip(group.tables, params)):
            if not need[t] or grads[t] is not None:
                continue
            mine = group._features_of_table[t]
            if len(mine) == 1:  # one feature: no copy (the rows may be a view of grad_out)
                ids_t = indices[bounds[mine[0]] : bounds[mine[0] + 1]]
                rows_t = rows_of(mine[0])
            else:
                ids_t = torch.cat([indices[bounds[i] : bounds[i + 1]] for i in mine])
                rows_t = torch.cat([rows_of(i) for i in mine])
            if sgd_lr is not None:
                with torch.no_grad():
                    # index_add_ with alpha= is several times slower than scaling first
                    p.index_add_(0, ids_t, rows_t if prescaled else rows_t * (-sgd_lr))
            elif spec.sparse:
                grads[t] = torch.sparse_coo_tensor(
                    ids_t.unsqueeze(0), rows_t if len(mine) > 1 or group.pooling != "none" else rows_t.clone(),
                    (spec.num_rows, spec.dim), device=p.device, check_invariants=False,
                )
            else:
                grads[t] = torch.zeros(
                    spec.num_rows, spec.dim, dtype=p.dtype, device=p.device
                ).index_add_(0, ids_t, rows_t)
        return (None, None, None, None, None, grad_psw, *grads)
