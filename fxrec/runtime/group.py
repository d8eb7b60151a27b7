"""EmbeddingGroup: the one runtime module for a group of embedding lookups.

It takes the lookups' own inputs (one id tensor per feature, with its offsets and per-sample
weights where it had them) and the group's weight parameters, and returns what the original
lookups returned: for pooled groups one ``[B, sum of dims]`` tensor whose columns are the
features side by side, for sequence groups one tensor per feature.

What a group does is always the same (check the inputs, pack them, look rows up, make gradients
or apply a fused update); only the *kernel* differs (:mod:`fxrec.runtime.kernels`). The group
holds the name of its training kernel and of its inference kernel, chosen by the
``choose_kernels`` pass; its forward calls that kernel, and the reference kernel (PyTorch's own
lookups) for any input the chosen one does not take. These modules know nothing of graphs or
passes. Its input checks (:mod:`.checks`) and its fused optimizer's side (:mod:`.group_fused`)
are mixins in their own files.
"""

from __future__ import annotations

import functools
from typing import List, Optional, Sequence

import torch
from torch import nn

from . import kernels
from ._tracing import exporting, functorch_active
from .checks import InputChecks
from .group_fused import FusedUpdates
from .grad import clamped_by
from .kernels import FBGEMM, REFERENCE
from .output_buffer import ReusedOutput
from .packing import _FLOAT16, _FLOAT32, FORM_CODES
from .specs import STEPPED, FeatureSpec, FusedSpec, GroupSpec, TableSpec, pad_dim


def group_forward(forward):
    """Wraps every group module's ``forward``:

    * a bag's ids and offsets of different integer dtypes are both taken as their common dtype,
      as ``F.embedding_bag`` does (int16 ids with int64 offsets are int64 ids);
    * per-sample weights must have the tables' dtype (float32, or float16 for the model's fp16 tables), as
      ``F.embedding_bag`` wants (its weight's dtype), and be where their ids are;
      fbgemm's kernels would convert others: a TypeError names the feature;
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
        if self._any_weighted:
            self._check_weights(psw_list, ids_list, params[0] if params else None)
        if exporting():
            self._check_count(ids_list)
            self._assert_inputs(ids_list, offsets_list)
        try:
            return forward(self, ids_list, offsets_list, psw_list, *params)
        except (RuntimeError, TypeError, ValueError, IndexError) as e:
            self._check_devices(ids_list, offsets_list, psw_list, params[0] if params else [], e)
            raise

    return torch.compiler.disable(call)



#: What EmbeddingGroup._set_flags keeps of its features (a group unpickled without one of them
#: works them all out again).
_FLAGS = ("_padded_bags", "_means_of_seqs", "_plain_bags", "_table_of")

class EmbeddingGroup(InputChecks, FusedUpdates, nn.Module):
    """One group of lookups: its specs, input checks and kernels (see the module docstring)."""

    #: the dtypes its per-sample weights may have (set in __init__; fp32 for groups pickled before
    #: it was, which were all of fp32 tables)
    _psw_dtypes = _FLOAT32

    def __init__(
        self,
        tables: Sequence[TableSpec],
        features: Sequence[FeatureSpec],
        pooling: str,
        kernel_train: str = REFERENCE,
        kernel_eval: str = REFERENCE,
        fused: Optional[FusedSpec] = None,
    ):
        super().__init__()
        if pooling not in ("sum", "mean", "none"):
            raise ValueError(f"pooling must be 'sum', 'mean' or 'none', got {pooling!r}")
        self.tables = list(tables)
        self.features = list(features)
        self.pooling = pooling
        self.set_kernels(kernel_train, kernel_eval)
        ftm = [f.table for f in self.features]
        if ftm != sorted(ftm):
            # fbgemm's kernels need each table's features adjacent (feature_table_map
            # non-decreasing); with [0, 1, 0] its CPU backward updates wrong rows
            raise ValueError(f"fxrec: a group's features must be ordered by table, got table order {ftm}")
        if pooling == "none" and len({pad_dim(t.dim) for t in self.tables}) != 1:
            # fbgemm's sequence TBE stores one width: dims that round up to one multiple of 4
            raise ValueError(f"fxrec: the tables of a sequence group must have dims that round up to one multiple "
                             f"of 4, got {[t.dim for t in self.tables]}")
        self.dims = [self.tables[f.table].dim for f in self.features]
        self._bag_features = [i for i, f in enumerate(self.features) if f.form == "bag"]
        # the features as the scriptable packing takes them (fxrec.runtime.packing.pack_bags)
        self._where = [f"feature '{f.name}' (table '{self.tables[f.table].name}')" for f in self.features]
        self._forms = [FORM_CODES[f.form] for f in self.features]
        self._pads = [-1 if f.padding_idx is None else int(f.padding_idx) for f in self.features]
        self._ilos = [bool(f.include_last_offset) for f in self.features]
        self._set_flags()
        self._any_weighted = any(f.weighted for f in self.features)
        self._table_of = [f.table for f in self.features]
        self._sparse = [bool(t.sparse) for t in self.tables]
        # the dtypes per-sample weights may have: the tables' in the user's model (_check_weights)
        self._psw_dtypes = _FLOAT16 if self.half else _FLOAT32
        self._min_rows = min(t.num_rows for t in self.tables)
        self._features_of_table = [
            [i for i, f in enumerate(self.features) if f.table == t] for t in range(len(self.tables))
        ]
        # per table, its features whose output a gradient can reach (FeatureSpec.grad)
        self._grad_features_of_table = [[i for i in mine if self.features[i].grad] for mine in self._features_of_table]
        self._no_grad_features = [i for i, f in enumerate(self.features) if not f.grad]
        self._bound = None  # kernels.fbgemm_bind.Bound: the TBE the parameters are views of, once bound
        # Inference of pooled groups on CPU: reuse the output buffer between calls.
        self.reuse_output = True
        # CUDA, tables placed managed_caching: the HBM cache's rows as a share of theirs (fbgemm's)
        self.cache_load_factor = 0.2
        # Training: the gradient of the group's outputs clamped elementwise to [-max_gradient,
        # max_gradient] before the tables (or their fused update) get it, as fbgemm's
        # gradient_clipping does; 0: not clamped (transform(max_gradient=)).
        self.max_gradient = 0.0
        self._out = ReusedOutput()
        self.fused = fused
        # Off while fxrec verifies the group: gradients instead of updates.
        self.fused_enabled = True
        self._carry_states: Optional[List[List[torch.Tensor]]] = None
        self._carry_step = 0  # a fused Adam's step count, until a TBE holds it

    @property
    def spec(self) -> GroupSpec:
        return GroupSpec(tuple(self.tables), tuple(self.features), self.pooling)

    @property
    def weights(self) -> str:
        """The precision weights_precision= stores the tables in ("fp16", "bf16"), or "" (fp32)."""
        return self.tables[0].weights if self.tables else ""

    @property
    def half(self) -> bool:
        """The user's model holds the tables in fp16 (see :attr:`GroupSpec.half`)."""
        return bool(self.tables) and self.tables[0].dtype == "float16"

    def set_kernels(self, kernel_train: str, kernel_eval: str) -> None:
        for k in (kernel_train, kernel_eval):
            kernels.get(k)  # raises on an unknown name
        self.kernel_train = kernel_train
        self.kernel_eval = kernel_eval

    def bind_on(self, params: Sequence[torch.Tensor], device: torch.device) -> bool:
        """Where the group's tables are placed in unified memory (``hbm_budget=``) and its kernels
        are fbgemm's, bind its TBE on CUDA ``device`` now, the rows copied there from where they
        are (the parameters become views of the TBE's rows): tables in unified memory never pass
        through GPU memory on their way from host memory. What ``.to()`` / ``.cuda()`` of the
        transformed model do before moving the rest. False (nothing done) for other groups, for
        none given (a sharded quantized lookup's), and for tables the TBE cannot hold as they are
        (another dtype: bound then, the tables would silently take the TBE's)."""
        if not params or not self.places_unified(device) or any(p.is_meta for p in params):
            return False
        from .kernels.fbgemm_bind import ensure_bound, usable

        if not usable(params, self):
            return False

        ensure_bound(self, params, device)
        return True

    def places_unified(self, device: torch.device) -> bool:
        """Whether the group keeps tables in unified memory on ``device`` (CUDA, ``hbm_budget=``
        placements, fbgemm's TBE: the only kernel that holds them there)."""
        return device.type == "cuda" and any(t.placement != "device" for t in self.tables) \
            and FBGEMM in (self.kernel_train, self.kernel_eval)

    def extra_repr(self) -> str:
        names = ", ".join(t.name for t in self.tables)
        return (f"pooling={self.pooling}, tables=[{names}], features={len(self.features)}, "
                f"kernel_train={self.kernel_train}, kernel_eval={self.kernel_eval}")

    def _set_flags(self) -> None:  # (sets _FLAGS)
        """What calls read of the features, fixed at init: bags with a padding_idx (a quantized
        group looks their padding ids up, weighing 0), whether a ``[B, 0]`` feature may
        mean-pool (PyTorch's NaN), whether every feature is a bag without a padding_idx or
        include_last_offset (fxrec's native kernel then reads a call's inputs at once), and
        each feature's table."""
        self._padded_bags = any(f.form == "bag" and f.padding_idx is not None for f in self.features)
        self._means_of_seqs = self.pooling == "mean" and any(f.form == "pooled_seq" for f in self.features)
        self._plain_bags = bool(self.features) and all(
            f.form == "bag" and f.padding_idx is None and not f.include_last_offset for f in self.features)
        self._table_of = [f.table for f in self.features]

    def __setstate__(self, state):
        super().__setstate__(state)
        if not all(k in self.__dict__ for k in _FLAGS):  # (a group pickled before fxrec kept them all)
            self._set_flags()

    # deepcopy/pickle must not carry the TBE: the copy's parameters are new tensors, and the
    # copy binds its own TBE to them on first use.
    def __getstate__(self):
        state = self.__dict__.copy()
        state["_bound"] = None
        state.pop("_device_bounds", None)  # the device check's count, event and last inputs: rebuilt on use
        # the link to an optimizer (its learning-rate hook) stays with the original
        state.pop("_fxrec_lr_hook", None)
        state["_forward_pre_hooks"] = type(self._forward_pre_hooks)(
            (k, h) for k, h in self._forward_pre_hooks.items() if not getattr(h, "fxrec_optimizer_link", False))
        self.sync_cache()  # a copy of the parameters must see the cached rows
        if self._bound is not None and self._bound.optimizer != "none":
            # the fused optimizer's states travel with the copy (its TBE is rebuilt)
            state["_carry_states"] = [[x.detach().clone() for x in t] for t in self._bound.tbe.split_optimizer_states()]
            if self._bound.optimizer in STEPPED:
                from .kernels.fbgemm_states import tbe_step

                state["_carry_step"] = tbe_step(self._bound.tbe)
        return state

    def _training(self, params: Sequence[torch.Tensor], psw_list) -> bool:
        return torch.is_grad_enabled() and (
            any(p.requires_grad for p in params)
            or any(w is not None and w.requires_grad for w in psw_list)
        )

    def lookups(self, ids_list, offsets_list, psw_list, params):
        """PyTorch's own lookups of the group (the reference kernel's, without a reused buffer)."""
        from .kernels.reference import lookups

        return lookups(self, ids_list, offsets_list, psw_list, params)

    @group_forward
    def forward(self, ids_list: List[torch.Tensor], offsets_list: List[Optional[torch.Tensor]],
                psw_list: List[Optional[torch.Tensor]], params: List[torch.Tensor]):
        self._check_count(ids_list)
        if self.pooling == "none":
            for f, ids in zip(self.features, ids_list):
                if ids.dtype not in (torch.int64, torch.int32):
                    self._check_ids(f, ids)  # raises, naming the feature
        if exporting():  # the form torch.export traces: PyTorch's own ops
            if self.stored_lower():
                raise RuntimeError(self.stored_lower())
            return self.lookups(ids_list, offsets_list, psw_list, params)
        if functorch_active():  # torch.func.grad / vmap / ...: what those transforms can differentiate
            held = [t.name for t in self.tables if t.placement == "managed_caching" or t.weights]
            if held:
                raise RuntimeError(f"fxrec: tables {held} are held by fbgemm's kernel (weights_precision= or unified "
                                   "memory), which torch.func transforms cannot run; transform without those to use "
                                   "torch.func")
            return self.lookups(ids_list, offsets_list, psw_list, params)
        training = self._training(params, psw_list)
        if training and self.fused_active:
            self._check_fused(params)
        chosen = kernels.get(self.kernel_train if training else self.kernel_eval)
        out = chosen.run(self, ids_list, offsets_list, psw_list, params, training)
        if out is None:  # an input the chosen kernel does not take: PyTorch's own answer (and update)
            held = [t.name for t in self.tables if t.placement == "managed_caching" or t.weights]
            if held and any(i.numel() for i in ids_list):
                how = f"stored in {self.weights}" if self.weights else "cached in GPU memory"
                from .kernels.fbgemm_bind import usable

                if params and not usable(params, self):
                    raise ValueError(
                        f"fxrec: tables {held} are {how} by fbgemm's kernel, which cannot take their parameters as "
                        f"they are now ({params[0].dtype} on {params[0].device}: a .double() / .half() / .to() after "
                        "transform?); convert the model back (.float())")
                raise ValueError(
                    f"fxrec: tables {held} are {how} by fbgemm's kernel, which cannot take this call (features with "
                    "different batch sizes, or include_last_offset mean bags with ids after offsets[-1]); PyTorch's "
                    "lookups would read and update them behind it")
            out = self._fp32(kernels.get(REFERENCE).run(self, ids_list, offsets_list, psw_list, params, training))
        return clamped_by(self, out) if training else out

    def _fp32(self, out):
        """Tables stored at a lower precision (weights_precision=): fbgemm's kernel gives fp32, so
        PyTorch's lookups of them (an empty batch) are made fp32 too."""
        if not self.weights:
            return out
        return out.float() if isinstance(out, torch.Tensor) else type(out)(o.float() for o in out)

    def stored_lower(self) -> str:
        """Why a group whose tables are stored in fp16/bf16 by fbgemm's training TBE cannot be
        exported or scripted for serving (PyTorch's lookups would read and pool them at that
        precision, or convert every table on every call), and what to do instead; "" otherwise."""
        if not self.weights:
            return ""
        return (f"fxrec: tables {[t.name for t in self.tables]} are stored in {self.weights} by fbgemm's "
                "training TBE (weights_precision=), which torch.export (fxrec.export, or transforming a model that "
                "contains this one) and TorchScript do not take; to serve them, "
                "load the weights into the plain model (fxrec.checkpoint.load_into_model gives the values exactly) "
                "and transform it with mode='inference', quantize='fp16'")

    def sync_cache(self, drop: bool = False) -> None:
        """Tables placed ``managed_caching`` on CUDA: fbgemm keeps their freshest rows in its HBM
        cache (a fused update writes there), so their parameters (the unified-memory rows) are
        current only after this writes the cache back; ``drop`` then empties it, for before the
        parameters are written by anything but the kernel. Nothing for other groups."""
        if self._bound is not None and any(t.placement == "managed_caching" for t in self.tables):
            from .kernels.fbgemm_tbe import sync_cache

            sync_cache(self._bound.tbe, drop)
