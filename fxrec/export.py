"""Export a transformed model for serving.

``fxrec.export.program(fast, example_inputs, "model.pt2")``: ``torch.export`` of the model, every
input dim dynamic where the model allows (so other batch sizes run), saved when a path is given.
Quantized groups export as fbgemm's quantized lookup operator on their own buffers; fp32 groups
export as their plain ATen lookups (``aten.embedding_bag``). Input checks that read tensor
values are left out of the exported program (export cannot trace them). Load with
``torch.export.load(path)`` after ``import fbgemm_gpu`` (which registers fbgemm's operators).

``fxrec.export.aoti(fast, example_inputs, "model.pt2")``: that program compiled by AOTInductor into
a package that C++ loads with libtorch's ``AOTIModelPackageLoader`` (``examples/inference_cpp``).

``fxrec.export.torchscript(fast, "model.pt")``: ``torch.jit.script`` of the model after the
``emit_scriptable`` pass (typed ``forward`` with the model's own arguments, ATen calls by overload
packet, group modules swapped for their TorchScript twins in ``fxrec/runtime/serving.py``), saved
when a path is given. Load it in Python with ``torch.jit.load`` after ``import fbgemm_gpu``, or in
C++ with ``torch::jit::load`` after loading fbgemm_gpu's operator libraries
(``examples/inference_cpp``). It serves inference: the scripted model has no fused optimizers and
no kernel choice (fp32 groups run PyTorch's lookups, quantized groups fbgemm's operator).
torch 2.13 warns that ``torch.jit.script`` is deprecated; :func:`program` is the other way out.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Optional

import torch

from .capture import export_dynamic
from .capture_reshapes import nodes_as_functions
from .pass_infra import Config, InputError, PassContext, PassManager
from .report import Report
from .runtime.kernels.fbgemm_nbit_cache import caches_left_out


def _refuse_sharded(model: torch.nn.Module, who: str) -> None:
    """A model transformed with a plan calls torch.distributed's collectives, which neither export
    nor TorchScript takes: an error saying how to serve it instead."""
    if any(getattr(m, "_fxrec_collective", False) for m in model.modules()):  # (a plan's all data-parallel: none)
        raise ValueError(f"fxrec.export.{who}: the model is sharded over ranks (transform(plan=...)), and its "
                         "collectives do not export. Serve it as it is on its ranks, or export the single-process "
                         "model: save a checkpoint (fxrec.checkpoint.save), load it into the plain model "
                         "(fxrec.checkpoint.load_into_model) and transform that with mode='inference' (and quantize=) "
                         "without a plan (docs/inference.md)")


def program(model: torch.nn.Module, example_inputs, path: Optional[str] = None,
            example_kwargs: Optional[Dict[str, Any]] = None) -> torch.export.ExportedProgram:
    _refuse_sharded(model, "program")
    for mod in model.modules():  # (before tracing: the group's own refusal would come as torch.export's error)
        why = mod.stored_lower() if callable(getattr(mod, "stored_lower", None)) else ""
        if why:
            raise InputError(why)
    args = example_inputs if isinstance(example_inputs, tuple) else tuple(example_inputs) \
        if isinstance(example_inputs, list) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    from .graph_module import sync_caches

    sync_caches(model)  # the exported program holds the parameters: with the cached rows written back
    with torch.no_grad(), caches_left_out(model), nodes_as_functions(model):  # (quantized rows' caches:
        ep = export_dynamic(model, args, kwargs, warn_as="fxrec.export.program")  # read uncached, not kept)
    _refuse_other_ranks(ep)
    if path is not None:
        torch.export.save(ep, path)
    return ep


def _refuse_other_ranks(ep: torch.export.ExportedProgram) -> None:
    """Each tensor input read through an identity permute of the dims it was captured with.

    ``ExportedProgram.module()`` checks no input's number of dims (torch 2.11 to 2.13: its guard
    function, which replaces the check of the input constraints, leaves that out), and the program's
    own size checks are traced away (the number of dims is fixed while tracing): 2-D ids where 1-D
    ones were captured gave a wrong answer, and with offsets reached ``embedding_bag`` and crashed
    the process. ``permute`` takes exactly one entry per dim, so an input with more dims than
    captured, or fewer, raises (``number of dims don't match in permute``), whatever the extra
    dims' sizes (unless torch's guard function fails first: it reads the second size of ``[B, L]``
    bag ids, and 1-D ones raise a bare IndexError there). An identity permute is a view (no copy), and AOTInductor drops it (its packages
    check their inputs' dims themselves, with ``AOTI_RUNTIME_CHECK_INPUTS=1``)."""
    graph = ep.graph_module.graph
    names = set(ep.graph_signature.user_inputs)
    holders = [n for n in graph.nodes if n.op == "placeholder"]
    for ph in holders:
        val = ph.meta.get("val")
        if ph.name not in names or not isinstance(val, torch.Tensor) or not ph.users:
            continue
        with graph.inserting_after(holders[-1]):
            view = graph.call_function(torch.ops.aten.permute.default, (ph, list(range(val.dim()))))
        view.meta.update(val=val, tensor_meta=ph.meta.get("tensor_meta"))
        ph.replace_all_uses_with(view, delete_user_cb=lambda u, view=view: u is not view)
    graph.lint()
    ep.graph_module.recompile()


def scriptable(model: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of a transformed model that ``torch.jit.script`` compiles (see the module doc)."""
    from .dataflow import bodies
    from .passes.emit_scriptable import emit_scriptable

    _refuse_sharded(model, "torchscript")
    for n in model.graph.nodes:
        if bodies(n):  # (its body is torch.export's code, which TorchScript does not compile)
            name = getattr(n.target, "__name__", str(n.target))
            what = {"wrap_with_set_grad_enabled": "a torch.no_grad() / torch.enable_grad() block",
                    "wrap_with_autocast": "a torch.autocast block"}.get(name, f"a {name} block")
            raise ValueError(f"fxrec.export.torchscript: the model's forward has {what} ({n.name}), which fxrec's "
                             "TorchScript form does not take; serve it as a torch.export program "
                             "(fxrec.export.program), or move the block out of the model's forward")
    ctx = PassContext(config=Config(), report=Report())
    return PassManager([emit_scriptable]).run(model, ctx)


def torchscript(model: torch.fx.GraphModule, path: Optional[str] = None) -> torch.jit.ScriptModule:
    """``torch.jit.script`` of a transformed model (inference), saved to ``path`` when given.

    The scripted module is called like the original model (same positional and keyword
    arguments, lists and str-keyed dicts of tensors included) and returns what it returns.
    """
    gm = scriptable(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.jit.script.*deprecated.*")
        sm = torch.jit.script(gm)
    if path is not None:
        torch.jit.save(sm, str(path))
    return sm


def fbgemm_libraries() -> list:
    """Paths of fbgemm_gpu's operator libraries, in load order: what a C++ program loads before
    ``torch::jit::load`` of a model that calls fbgemm's operators (``examples/inference_cpp``)."""
    from .runtime.kernels import fbgemm as _fbgemm

    return _fbgemm.operator_libraries()


#: the key of an AOTInductor package's metadata (``loader.get_metadata()``) that names its input
#: tensors, one a line, in the order the package takes them (``input_handles[k]`` is line k)
INPUT_NAMES_KEY = "fxrec_inputs"


def aoti(model: torch.nn.Module, example_inputs, path: str, example_kwargs: Optional[Dict[str, Any]] = None) -> str:
    """AOTInductor: :func:`program` compiled by ``torch._inductor.aoti_compile_and_package`` into a
    ``.pt2`` package at ``path`` (dynamic batch). Python loads it with
    ``torch._inductor.aoti_load_package``; C++ with ``torch::inductor::AOTIModelPackageLoader``
    after loading fbgemm's operator libraries (:func:`fbgemm_libraries`), whose operators run as
    custom-op fallbacks. The package takes the input tensors flattened in pytree order and
    returns a flat list of output tensors. Compiling takes about a minute on a 2-core CPU.

    The package checks its inputs only where ``AOTI_RUNTIME_CHECK_INPUTS=1`` is set in the
    serving process's environment before its first call (``examples/inference_cpp`` sets it):
    each input's dtype, device, number of dims and sizes (those capture fixed and the ranges the
    program's guards give), an error naming the input by its index (``input_handles[k]``).
    Without it, an input of another dtype or size is read as if it were the example's. The
    package's metadata ``fxrec_inputs`` (:data:`INPUT_NAMES_KEY`) names input k on its line k."""
    ep = program(model, example_inputs, example_kwargs=example_kwargs)
    metadata = {INPUT_NAMES_KEY: "\n".join(_input_names(model, ep))}
    def compile_it():
        return torch._inductor.aoti_compile_and_package(ep, package_path=str(path),
                                                        inductor_configs={"aot_inductor.metadata": metadata})

    config = torch.fx.experimental._config
    if not hasattr(config, "backed_size_oblivious"):
        return compile_it()
    # AOTInductor's input checks take each dynamic size's lower bound from its own shape reasoning,
    # which without this takes every size to be 2 or more (the program's ranges start at 0)
    try:
        with config.patch(backed_size_oblivious=True):
            return compile_it()
    except Exception as e:  # noqa: BLE001 - torch 2.11's inductor fails so on a bag's offsets (KeyError)
        first = (str(e).strip().splitlines() or [""])[0][:200]
        warnings.warn(f"fxrec.export.aoti: AOTInductor could not compile the program size-obliviously "
                      f"({type(e).__name__}: {first}); compiled the ordinary way, so that with "
                      "AOTI_RUNTIME_CHECK_INPUTS=1 the package refuses dynamic sizes below 2 (batches of 0 and 1)",
                      stacklevel=2)
        return compile_it()


def _input_names(model: torch.nn.Module, ep: torch.export.ExportedProgram) -> list:
    """The program's input tensors in order, as the transformed model's input checks name them
    (``input ids[0] (ids of feature 'ids_0', table 'bags.0')``)."""
    from .capture import input_guards

    from torch.export.graph_signature import InputKind, TensorArgument

    guards = input_guards(model)
    user = [spec.arg for spec in ep.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT]
    return [guards._name(k) if guards is not None and k < len(guards.paths) else f"input {arg.name}"
            for k, arg in enumerate(user) if isinstance(arg, TensorArgument)]
