"""autotune=True: choose each group's kernels by timing them on the example inputs, cached on disk.

Opt-in (``fxrec.transform(..., autotune=True)``); by default kernels are chosen by the rule table
of ``fxrec/passes/choose_kernels.py`` and nothing is measured. For each group, every kernel that
supports it (and is there on this machine) is timed in turn, ``timing_rounds`` runs each after a
warm-up, median: the forward under no_grad for inference, forward + backward for training (with
the fused optimizer). Each kernel runs on its own copy of the group's tables, freed before the
next (one extra copy at a time; the model is neither trained nor rebound). The fastest wins; a
kernel must beat the rule's choice by more than the noise (10 %) to replace it.

Winners are cached in ``$FXREC_CACHE/autotune.json`` (default ``~/.cache/fxrec``), keyed by the
group's specs, its example input sizes, the device, torch's and fxrec's versions and the number of
threads: a second transform of the same model is instant and gives the same decisions.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import statistics
import tempfile
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from . import meta
from .group_module import build_group_module, group_inputs, group_spec
from .passes.choose_kernels import pick, replace_kernels
from .pass_infra import PassContext
from .runtime import kernels
from .verify import buffers_kept, written_in_forward

TIE = 1.10  # within 10 % counts as a tie on these noisy machines: the rule's choice stays


def cache_dir() -> str:
    """``$FXREC_CACHE``, else ``~/.cache/fxrec``, else a folder of this user's in the temp dir."""
    if os.environ.get("FXREC_CACHE"):
        return os.environ["FXREC_CACHE"]
    home = os.path.join(os.path.expanduser("~"), ".cache", "fxrec")
    try:
        os.makedirs(home, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return os.path.join(tempfile.gettempdir(), f"fxrec-{os.getuid()}")


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, wanted):
        super().__init__(gm)
        self.wanted = wanted
        self.values: Dict[fx.Node, object] = {}

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if n in self.wanted:
            self.values[n] = out
        return out


def _shape(x) -> object:
    return list(x.shape) if isinstance(x, torch.Tensor) else None


class Autotuner:
    """Times the kernels of each group on its example inputs (recorded once for all groups)."""

    def __init__(self, gm: fx.GraphModule, ctx: PassContext):
        self.gm, self.ctx = gm, ctx
        self.path = os.path.join(cache_dir(), "autotune.json")
        self._values: Optional[Dict[fx.Node, object]] = None
        try:
            with open(self.path) as fh:
                self.cache = json.load(fh)
        except (OSError, ValueError):
            self.cache = {}
        if not isinstance(self.cache, dict):  # (valid JSON of another shape: written by something else)
            self.cache = {}

    def _inputs(self, gr: meta.GroupRecord):
        if self._values is None:
            wanted = {x for g in self.ctx.groups for r in g.lookups
                      for x in (r.weight, r.ids, r.offsets, r.per_sample_weights) if isinstance(x, fx.Node)}
            rec = _Recorder(self.gm, wanted)
            with torch.no_grad(), buffers_kept(self.gm, params=written_in_forward(self.gm)):  # must not count a batch or move statistics
                rec.run(*copy.deepcopy(self.ctx.example_args), **copy.deepcopy(self.ctx.example_kwargs))
            self._values = rec.values
        if not all(r.ids in self._values for r in gr.lookups):
            return None
        return lambda n: self._values.get(n) if isinstance(n, fx.Node) else n

    def _key(self, gr: meta.GroupRecord, value, device: str) -> str:
        from . import __version__

        sizes = [[_shape(value(r.ids)), _shape(value(r.offsets)), _shape(value(r.per_sample_weights))]
                 for r in gr.lookups]
        text = repr((group_spec(gr), sizes, device, self.ctx.config.mode, gr.fused, torch.__version__, __version__,
                     torch.get_num_threads()))
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def tune(self, gr: meta.GroupRecord, decision: meta.GroupDecision) -> meta.GroupDecision:
        value = self._inputs(gr)
        if value is None:
            return decision  # not reached by the example inputs: the rule stands
        device = decision.device
        key = self._key(gr, value, device)
        spec = group_spec(gr)
        training = self.ctx.config.mode == "training"
        kind = gr.fused.kind if gr.fused is not None else None
        options = gr.fused.options if gr.fused is not None else ()
        eval_names = _supporting(spec, device, "inference", None)
        train_names = _supporting(spec, device, "training", kind, options) if training else eval_names
        hit = self.cache.get(key)
        if _well_formed(hit) and hit["eval"] in eval_names and hit["train"] in train_names:
            return replace_kernels(gr, decision, hit["train"], hit["eval"], "autotune (cached)",
                                   hit["why"] + f" (cached in {self.path})", hit["timings_ms"])
        # (an entry of another shape, or naming a kernel that does not take this group here: measured again)
        t_eval = self._time(gr, value, eval_names, train=False)
        best_eval = _fastest(t_eval, decision.kernel_eval)
        timings = {f"fwd_{k}": v for k, v in t_eval.items()}
        best_train, why = best_eval, "measured forward " + _text(t_eval)
        if training:
            t_train = self._time(gr, value, train_names, train=True)
            best_train = _fastest(t_train, decision.kernel_train)
            timings.update({f"train_{k}": v for k, v in t_train.items()})
            why += "; forward+backward " + _text(t_train)
        why = f"autotune: {best_train} for training, {best_eval} for inference; {why}"
        self.cache[key] = {"train": best_train, "eval": best_eval, "why": why, "timings_ms": timings}
        self._save()
        return replace_kernels(gr, decision, best_train, best_eval, "autotune (measured)", why, timings)

    def _time(self, gr: meta.GroupRecord, value, names: List[str], train: bool) -> Dict[str, float]:
        """Median ms of each kernel, one kernel at a time on its own copy of the group's tables
        (freed before the next: one extra copy at a time, and the model's own tables are never
        bound to a scratch kernel)."""
        saved = (gr.kernel_train, gr.kernel_eval)
        out: Dict[str, float] = {}
        try:
            for name in names:
                gr.kernel_train = gr.kernel_eval = name
                mod, index = build_group_module(gr, with_optimizer=train)
                ids, offs, psw, params = group_inputs(gr, index, value)
                params = [torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in params]
                run = _step(mod, (ids, offs, psw, params), train)
                run()  # warm-up: binds a TBE, builds nothing twice
                device = params[0].device if params else torch.device("cpu")
                out[name] = statistics.median(_timed(run, device) for _ in range(self.ctx.config.timing_rounds))
                del mod, params, run
        finally:
            gr.kernel_train, gr.kernel_eval = saved
        return out

    def _save(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), suffix=".json")
        with os.fdopen(fd, "w") as fh:
            json.dump(self.cache, fh, indent=1, sort_keys=True)
        os.replace(tmp, self.path)  # concurrent transforms never read a half-written file


def _timed(run, device: torch.device) -> float:
    """ms of one ``run()`` on ``device``: on CUDA between two events recorded on the stream, waited
    for (the kernels run after the call returns); elsewhere the call's wall time."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t = time.perf_counter()
    run()
    return (time.perf_counter() - t) * 1e3


def _well_formed(hit) -> bool:
    """Whether a cache entry has the shape :meth:`Autotuner.tune` writes (the file is the user's:
    anything may be in it; an entry is used only where its kernels also take the group)."""
    return (isinstance(hit, dict) and isinstance(hit.get("train"), str) and isinstance(hit.get("eval"), str)
            and isinstance(hit.get("why"), str) and isinstance(hit.get("timings_ms"), dict)
            and all(isinstance(k, str) and isinstance(v, (int, float)) for k, v in hit["timings_ms"].items()))


def _supporting(spec, device: str, mode: str, optimizer: Optional[str], options: Tuple[str, ...] = ()) -> List[str]:
    out = []
    for name in kernels.KERNEL_NAMES:
        k, _ = pick(spec, device, mode, optimizer, (name,), True, options)
        if k is not None:
            out.append(k)
    return out


def _step(mod, args, train: bool):
    def run():
        if not train:
            with torch.no_grad():
                mod(*args)
            return
        out = mod(*args)
        outs = out if isinstance(out, list) else [out]
        ones = [torch.ones_like(o) for o in outs]
        if mod.fused is not None:  # the update runs in backward; no gradient is made
            torch.autograd.backward(outs, ones)
        else:
            leaves = [p for p in args[3] if p.requires_grad]
            torch.autograd.grad(outs, leaves, ones, allow_unused=True)

    return run


def _fastest(times: Dict[str, float], rule_choice: str) -> str:
    best = min(times, key=times.get)
    if rule_choice in times and times[rule_choice] <= TIE * times[best]:
        return rule_choice
    return best


def _text(times: Dict[str, float]) -> str:
    return " vs ".join(f"{k} {v:.3g} ms" for k, v in times.items())
