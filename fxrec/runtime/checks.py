"""The group module's input checks: every error names the feature and table that was wrong.

Cheap checks run on every call (a few ops for the whole group, on the packed input); when one
fails, the per-feature checks here find the feature and raise a message that names it.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from ._tracing import exporting, reads_values
from .device_ints import refuse_in_capture
from .packing import _device, _dtype, weights_elsewhere
from .specs import FeatureSpec


class InputChecks:
    """Mixed into :class:`~fxrec.runtime.group.EmbeddingGroup` (uses its ``features``, ``tables``)."""

    def _promote_bags(self, ids_list, offsets_list):
        """As F.embedding_bag: integer ids and offsets of different dtypes, both as their common dtype
        (float ones are left to the checks, which name the feature)."""
        if len(self._bag_features) == len(ids_list):  # every feature a bag: one C-level look at the dtypes
            try:
                if list(map(_dtype, ids_list)) == list(map(_dtype, offsets_list)):
                    return ids_list, offsets_list
            except AttributeError:  # offsets None: the checks name the feature
                return ids_list, offsets_list
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
            # (as int64: ids of a narrower dtype than the traced one would wrap the row count around;
            # _to_copy, as Tensor.to would also have the program refuse any dtype but the traced one)
            wide = torch.ops.aten._to_copy.default(ids, dtype=torch.int64)
            torch._assert_async(~((wide < 0) | (wide >= t.num_rows)).any(),
                                f"fxrec: {where} looks up an id outside 0..{t.num_rows - 1}")
            if f.form == "bag" and off is not None and off.dim() == 1:
                # (no one-element slice of offsets: AOTInductor reads off[:1] and off[-1:] of an empty
                # batch's offsets anyway, and the package crashed; the leading offsets that are not
                # 0 are counted instead, and with the offsets non-decreasing the last is the largest)
                bad = ((off != 0).long().cumprod(0).sum() > 0) | (off[1:] < off[:-1]).any() | (off > ids.numel()).any()
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

    def _check_weights(self, psw_list, ids_list, weights=None) -> None:
        """Per-sample weights of the dtype of the group's tables (``weights``: its parameters, of the
        model's dtype, which ``.double()`` changes; float32 or float16 as captured where none are
        given; fp32 tables stored lower by weights_precision= still take float32), as
        nn.EmbeddingBag wants its weight's (fbgemm's kernels would take others, converted): else a
        TypeError naming the feature."""
        want = self._psw_dtypes
        if weights and not self.weights and weights[0].dtype not in want:
            want = {weights[0].dtype}
        try:  # (the common case in C-level reads: every feature weighted, of that dtype, where its ids are)
            if set(map(_dtype, psw_list)) <= want and list(map(_device, psw_list)) == list(map(_device, ids_list)):
                return
        except AttributeError:  # a feature without weights (None): one by one
            pass
        for f, psw, ids, where in zip(self.features, psw_list, ids_list, self._where):
            if psw is not None and psw.dtype not in want:
                raise TypeError(f"fxrec: feature '{f.name}' (table '{self.tables[f.table].name}') got per-sample "
                                f"weights of dtype {psw.dtype}; they must be {next(iter(want))}, the dtype of its table")
            if psw is not None and psw.device != ids.device:  # (the one that is not where the tables are named)
                self._check_devices(ids_list, [None] * len(ids_list), psw_list, weights or [], None)
                raise ValueError(weights_elsewhere(where, psw, ids))

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

    def _nan_where_mean_of_none(self, out, ids_list):
        """``out`` with PyTorch's NaN in the columns of features that mean-pool ``[B, 0]`` ids (the
        kernel gives 0 there). A length is a symbol under torch.export, which settles a branch on
        it once, at the example's: each such feature's columns are multiplied by ``L / L``
        instead (1, exactly, for ``L > 0``; NaN for 0)."""
        if not exporting():
            cols = self._empty_mean_columns(ids_list)
            if cols:
                out[:, cols] = float("nan")
            return out
        if not self._means_of_seqs:
            return out
        scales = []
        for f, ids, d in zip(self.features, ids_list, self.dims):
            if f.form == "pooled_seq" and ids.dim() == 2:
                length = torch.scalar_tensor(ids.shape[1], dtype=torch.float32, device=out.device)  # (fp16: inf from 65520)
                scales.append((length / length).to(out.dtype).expand(d))
            else:
                scales.append(out.new_ones(d))
        return out * torch.cat(scales)

    def _empty_mean_columns(self, ids_list) -> List[int]:
        """Output columns of the features that mean-pool ``[B, 0]`` ids: PyTorch's answer there is NaN."""
        if not self._means_of_seqs:
            return []
        cols, start = [], 0
        for f, ids, d in zip(self.features, ids_list, self.dims):
            if f.form == "pooled_seq" and ids.dim() == 2 and ids.shape[1] == 0:  # (mean pooling: above)
                cols.extend(range(start, start + d))
            start += d
        return cols

    def _validate_packed(self, indices, offsets, ids_list, offsets_list, psw=None, firsts=None) -> None:
        """Cheap checks on the packed input (a few ops for the whole group); on failure, the
        per-feature checks find the feature and raise a message that names it. Where values may
        not be read (CUDA), the device's check instead (:meth:`_check_on_device`). ``firsts``:
        where each feature's first bag starts in its own ids (pack_bags'; must be 0)."""
        if exporting():
            return
        if not reads_values(indices.device):
            self._check_on_device(indices, offsets, psw, ids_list, offsets_list,
                                  None if firsts is None else torch.count_nonzero(firsts))
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

    def _check_on_device(self, indices, offsets, psw, ids_list, offsets_list, bad_firsts=None) -> None:
        """Bounds checks without reading a value on the host: fbgemm's ``bounds_check_indices``
        on the packed input, on its device, sends every id outside its table to row 0 (and fixes
        offsets out of range) and counts them; the count reaches the host later (see
        :class:`DeviceBoundsCheck`), and a count that grew raises the named error then.
        ``bad_firsts``: how many features' offsets do not start at 0 (0-dim, on the device)."""
        state = self.__dict__.get("_device_bounds")
        if state is None or state.counter.device != indices.device:
            refuse_in_capture(self, indices.device, "its bounds check's counters are made there")
            # (outside inference mode, as the TBE is bound: made in a first call under
            # torch.inference_mode() its tensors would be inference tensors, which the next
            # training call's check may not write)
            with torch.inference_mode(False):
                state = self._device_bounds = DeviceBoundsCheck(
                    [self.tables[f.table].num_rows for f in self.features], indices.device)
        self._raise_reported(state)
        state.check(indices, offsets, psw, ids_list, offsets_list, bad_firsts)
        if not state.cuda:  # (on CUDA the count just sent is seen at the next call)
            self._raise_reported(state)

    def raise_pending(self) -> None:
        """The named error for what the device's bounds check has counted and the host not yet
        heard of (calls replayed in a CUDA graph report nothing themselves). Waits for the device."""
        state = self.__dict__.get("_device_bounds")
        if state is None:
            return
        if state.cuda:
            torch.cuda.synchronize(state.counter.device)
        self._raise_reported(state, wait=True)

    def _raise_reported(self, state: "DeviceBoundsCheck", wait: bool = False) -> None:
        reported = state.reported(wait)
        if reported is None:
            return
        count, ids_list, offsets_list = reported
        if ids_list is None:
            pass  # (no inputs kept: the message below)
        elif offsets_list is None:  # unpooled lookups: ids only
            for f, ids in zip(self.features, ids_list):
                self._check_ids(f, ids)
        else:
            self._check_inputs(ids_list, offsets_list)  # raises, naming the feature, if those inputs are still bad
        raise ValueError(
            f"fxrec: fbgemm's bounds check on {state.counter.device} found {count} ids or offsets outside the tables "
            f"{[t.name for t in self.tables]} in a recent call (the ids read row 0 instead); "
            + ("the inputs of the last call no longer show them (changed in place?)" if ids_list is not None else
               "no call's inputs are kept to name the feature"))

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



class DeviceBoundsCheck:
    """A group's bounds check on its device, and what the host has heard of it.

    ``check`` runs fbgemm's bounds check (warning mode: bad ids go to row 0 and are counted in
    ``counter``, on the device; nothing waits) and starts the count's way to the host: on CUDA a
    non-blocking copy into pinned memory and an event; on CPU the count is in host memory when
    the check returns. ``reported`` reads the host copy only once it is there (``event.query()``
    does not wait) and returns ``(count, ids, offsets)`` of the last call checked when the count
    grew: on CUDA a bad batch raises at the group's next call, on CPU in the same call. Calls
    captured in a CUDA graph count on the device; the first call outside the graph reports.
    """

    def __init__(self, rows_per_feature, device: torch.device):
        from .kernels.fbgemm_ops import bounds_checker

        self._bounds_check = bounds_checker()
        self.rows = torch.tensor(rows_per_feature, dtype=torch.int64).to(device)  # once per device
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)  # every problem so far
        self.scratch = torch.zeros(1, dtype=torch.int64, device=device)  # fbgemm zeroes it each call
        self.cuda = device.type == "cuda"
        self.host = torch.zeros(1, dtype=torch.int64, pin_memory=self.cuda)
        # what reported() reads: a NumPy view of the host copy's memory (on CPU, the counter's, which
        # check() makes the host copy), made once: Tensor.numpy() dispatches a detach at each call
        self._host_values = (self.host if self.cuda else self.counter).numpy()
        self.event = None
        self.inputs = None
        self.seen = 0

    def check(self, indices, offsets, psw, ids_list, offsets_list, more=None) -> None:
        """``more``: a count of other problems found on the device (0-dim), added in. ``indices``
        is the group's packed copy (int64), which the check writes."""
        # fbgemm's check passes id -1 by (a pruned row, for its inference kernels), which its
        # training kernels would read (and a fused backward write) before the table's rows: made
        # -2 first, in place (the group's packed copy), which the check counts and sends to row 0
        indices.masked_fill_(indices == -1, -2)
        self._bounds_check(self.rows, indices, offsets, self.scratch, psw)
        self.counter.add_(self.scratch)
        if more is not None:
            self.counter.add_(more)
        if self.cuda and torch.cuda.is_current_stream_capturing():
            # inside a CUDA graph: the check (and count) is captured, the host copy is not; the
            # count replays add is read at the next call outside the graph, or by
            # fxrec.graph_module.check_bounds. The inputs kept are the graph's own, which hold
            # the last replay's values.
            self.inputs = (ids_list, offsets_list)
            return
        if self.cuda:
            self.host.copy_(self.counter, non_blocking=True)  # (on the counter's device's current stream)
            if self.event is None:  # one event, recorded again each call: once the newest record has
                self.event = torch.cuda.Event()  # completed, so have every copy before it
            self.event.record(torch.cuda.current_stream(self.counter.device))
        else:
            self.host = self.counter
        self.inputs = (ids_list, offsets_list)

    def reported(self, wait: bool = False):
        """``(new problems, ids, offsets)`` where the count grew since last reported, else None. ``wait``:
        read the count on the device itself (the caller has waited for it), where the host's copy
        may be older (calls replayed in a CUDA graph send none)."""
        if self.cuda and torch.cuda.is_current_stream_capturing():
            return None  # (an event may not be queried while a CUDA graph is captured)
        if wait:
            count = int(self.counter.item())
        else:
            if self.inputs is None or (self.event is not None and not self.event.query()):
                return None
            # host memory, written by a copy that has completed (or by the CPU op): no wait
            count = int(self._host_values[0])
        if count <= self.seen:
            return None
        count, self.seen = count - self.seen, count
        return (count,) + (self.inputs or (None, None))
