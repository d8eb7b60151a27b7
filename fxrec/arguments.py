"""The arguments of :func:`fxrec.transform` and :func:`fxrec.explain` that are checked before any
work: each error names the argument and what was wrong."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .pass_infra import InputError
from .runtime.kernels import KERNEL_NAMES

#: ``backend=``: "auto" (the rule table), or a kernel's name to put first wherever it supports a group.
BACKENDS = ("auto",) + KERNEL_NAMES
DEVICES = ("cpu", "cuda")


def device_arg(device) -> Optional[torch.device]:
    """``device=`` of transform and explain: None, or a ``str`` / ``torch.device`` of a type in
    :data:`DEVICES` ("cuda:1" and ``torch.device("cuda", 1)`` name one GPU)."""
    if device is None:
        return None
    try:
        d = torch.device(device) if isinstance(device, (str, torch.device)) else None
    except RuntimeError:
        d = None
    if d is None or d.type not in DEVICES:
        raise ValueError(f"fxrec: device must be one of {DEVICES} (a str or torch.device; \"cuda:1\" names one GPU; "
                         f"or None: the tables' own), got {device!r}")
    return d


def check_target_device(device, model: torch.nn.Module, plan, autotune: bool = False) -> Optional[torch.device]:
    """transform's ``device=``: None where it is None or where the tables already are, else the
    device to move the transformed model to (CUDA without an index: the current one); errors for
    what cannot be."""
    want = device_arg(device)
    if want is None:
        return None
    here = tables_device(model, index=True)
    if want.type == here.type and (want.index is None or want.type == "cpu" or want == here):
        return None
    if plan is not None:
        raise InputError(f"fxrec: transform(plan=..., device={device!r}) of a model on {here}: each rank transforms its "
                         "model where it runs (under NCCL, on its LOCAL_RANK's GPU); move the model and its example "
                         "there first")
    if autotune and want.type != here.type:
        raise InputError(f"fxrec: autotune=True times the kernels where the model is ({here.type}), and "
                         f"device={device!r} decides for another device: move the model to {want.type} to autotune "
                         "there, or leave autotune off (the rule table decides)")
    if want.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"fxrec: device={device!r}, and no CUDA device is available here; fxrec.explain(model, "
                             "example_inputs, device='cuda', ...) gives the decisions transform would make for CUDA "
                             "on any machine")
        if want.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        if want.index >= torch.cuda.device_count():
            raise InputError(f"fxrec: device={device!r}, and this machine has {torch.cuda.device_count()} CUDA "
                             "device(s)")
    return want


def check_output_dtype(output_dtype, quantize) -> None:
    if output_dtype not in ("fp32", "fp16"):
        raise ValueError(f"fxrec: output_dtype must be 'fp32' or 'fp16', got {output_dtype!r}")
    if output_dtype != "fp32" and quantize is None:
        raise ValueError("fxrec: output_dtype is the dtype of quantized tables' lookups: it needs quantize= "
                         "(mode='inference'); the model's own lookups give its tables' dtype")


def check_settings(timing_rounds, rtol, atol, logger) -> None:
    """The arguments that tune transform's own work: errors naming the argument."""
    import operator

    try:
        rounds = None if isinstance(timing_rounds, bool) else operator.index(timing_rounds)
    except TypeError:
        rounds = None
    if rounds is None or rounds < 1:
        raise ValueError(f"fxrec: timing_rounds must be an int of at least 1 (autotune times each kernel that many "
                         f"rounds), got {timing_rounds!r}")
    for name, tol in (("rtol", rtol), ("atol", atol)):
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 <= tol < float("inf"):
            raise ValueError(f"fxrec: {name} must be a number of at least 0 (verify's tolerance), got {tol!r}")
    if logger is not None and not all(callable(getattr(logger, m, None)) for m in ("debug", "info")):
        raise TypeError(f"fxrec: logger must be a logging.Logger or LoggerAdapter (or None for the 'fxrec' logger), "
                        f"got {type(logger).__name__}")


def check_max_gradient(max_gradient, mode: str) -> float:
    if max_gradient is None:
        return 0.0
    if isinstance(max_gradient, bool) or not isinstance(max_gradient, (int, float)) or not 0 < max_gradient < float("inf"):
        raise ValueError(f"fxrec: max_gradient must be a positive number (or None), got {max_gradient!r}")
    if mode != "training":
        raise ValueError("fxrec: max_gradient clamps the gradients of training; mode='inference' makes none")
    return float(max_gradient)


def check_placement(hbm_budget, cache_load_factor, plan) -> Tuple[Optional[int], float]:
    """``(hbm_budget in bytes or None, cache_load_factor)``: those given, else a plan's made with a
    budget (its cache_load_factor only with its budget), else none and 0.2; errors for what
    cannot be placed."""
    topo = getattr(plan, "topology", None)
    if hbm_budget is None and getattr(topo, "hbm_budget", None) is not None:
        hbm_budget = topo.hbm_budget
        cache_load_factor = topo.cache_load_factor if cache_load_factor is None else cache_load_factor
    cache_load_factor = 0.2 if cache_load_factor is None else cache_load_factor
    if isinstance(cache_load_factor, bool) or not isinstance(cache_load_factor, (int, float)) \
            or not 0 < cache_load_factor <= 1:
        raise ValueError(f"fxrec: cache_load_factor must be a number in (0, 1], got {cache_load_factor!r}")
    if hbm_budget is None:
        return None, float(cache_load_factor)
    from .planner.specs import parse_bytes

    return parse_bytes(hbm_budget, "hbm_budget", "fxrec"), float(cache_load_factor)


def tables_device(model: torch.nn.Module, index: bool = False):
    """The type of the device of the model's first parameter ("cpu" for none, or on meta); with
    ``index``, that ``torch.device`` itself."""
    p = next(model.parameters(), None)
    d = torch.device("cpu") if p is None or p.device.type == "meta" else p.device
    return d if index else d.type
