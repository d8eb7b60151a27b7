"""fxrec.transform: capture, run the pass pipeline, attach the report."""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any, Dict, Optional, Union

import torch
import torch.fx as fx

from .capture import accepted_sizes, capture, input_guards
from .graph_module import MODES_KEY
from .materialize import materialize, meta_names, working_copy
from .optim import check_spec as check_optimizer_spec
from .passes.assign_precisions import check_weights_precision
from .runtime.optimizer import CombinedOptimizer
from .runtime.group import EmbeddingGroup
from .runtime.kernels import KERNEL_NAMES
from .pass_infra import Config, InputError, PassContext, PassManager
from .pipeline import default_pipeline, explain_pipeline
from .report import Report, build_report
from . import meta
from .verify import compare_models

#: ``backend=``: "auto" (the rule table), or a kernel's name to put first wherever it supports a group.
BACKENDS = ("auto",) + KERNEL_NAMES
DEVICES = ("cpu", "cuda")


def write_back(transformed: torch.nn.Module, model: torch.nn.Module) -> None:
    """Copy the (trained) weights of a transformed model into the original ``model``.

    The transformed model's ``state_dict()`` has the original model's keys, so this is a strict
    ``load_state_dict``; it raises naming the keys when the two models do not match.
    """
    if getattr(transformed, "meta", {}).get("fxrec_plan") is not None:
        raise ValueError("fxrec.write_back: a sharded model holds only this rank's shards of its tables; save it "
                         "with fxrec.checkpoint.save (every rank) and load that into the plain model with "
                         "fxrec.checkpoint.load_into_model (docs/sharding.md)")
    missing, unexpected = model.load_state_dict(transformed.state_dict(), strict=False)
    if missing or unexpected:
        raise KeyError(
            f"fxrec.write_back: state_dict keys differ: {missing} are missing from the transformed "
            f"model, {unexpected} are not in the target model"
        )


def _as_args(example_inputs: Any) -> tuple:
    if isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    return (example_inputs,)


def transform(
    model: torch.nn.Module,
    example_inputs: Union[tuple, list, torch.Tensor],
    example_kwargs: Optional[Dict[str, Any]] = None,
    *,
    backend: str = "auto",
    verify: bool = False,
    rtol: float = 1.3e-6,
    atol: float = 1e-5,
    check_passes: bool = False,
    optimizer=None,
    mode: str = "training",
    quantize=None,
    output_dtype: str = "fp32",
    timing_rounds: int = 5,
    reuse_outputs: bool = True,
    logger: Optional[logging.Logger] = None,
    dump_dir: Optional[str] = None,
    plan=None,
    autotune: bool = False,
    copy_model: bool = True,
    hbm_budget=None,
    cache_load_factor: float = 0.2,
    weights_precision=None,
    max_gradient: Optional[float] = None,
) -> fx.GraphModule:
    """Rewrite a plain PyTorch recommendation model so its embedding lookups run batched.

    Args:
      model: any ``nn.Module`` using ``nn.Embedding`` / ``nn.EmbeddingBag`` / ``F.embedding`` /
        ``F.embedding_bag`` on its parameters. It is not modified: fxrec works on a copy (but
        see ``copy_model``).
      example_inputs: the positional inputs of one call (a tuple; a single tensor is taken as
        the only input). Lists and dicts of tensors are fine.
      example_kwargs: keyword inputs of that call, if any.
      backend: ``"auto"``: each group's kernel by the rule table of
        ``fxrec/passes/choose_kernels.py`` (CUDA: fbgemm's TBE; CPU: fxrec's native kernel for
        pooled groups when it is built, else PyTorch's own lookups, ``"reference"``; fbgemm where
        only it fuses the optimizer). A kernel's name (``"reference"``, ``"native"``,
        ``"fbgemm"``) puts that kernel first wherever it supports the group; the report says
        where it does not and what runs instead.
      autotune: time the kernels that support each group on the example inputs (use a
        representative batch) and keep the fastest, for training and for inference; the winner is
        cached on disk (``$FXREC_CACHE``, default ``~/.cache/fxrec``) by group, input sizes,
        device and versions, so the next transform of the same model is instant and identical.
        Timing copies one group's tables at a time while it runs. A ``backend=`` other than
        ``"auto"`` wins over ``autotune``.
      copy_model: True (default): transform a copy, leaving ``model`` as it was (one copy of its
        tables while both live). False: hand the model over: the transformed model takes its
        parameters' storage (no copy; training the transformed model changes ``model``'s tables,
        and ``model`` must not be used afterwards).
      verify: run the example inputs through both models and raise
        :class:`fxrec.VerificationError` naming the tables whose outputs or gradients differ.
      check_passes: after every pass, compare the graph against the original model (slow;
        meant for tests and for bisecting a wrong answer to one pass).
      mode: ``"training"`` (default) or ``"inference"``.
      quantize: inference only: ``"int8"``, ``"int4"``, ``"int2"``, ``"fp16"`` or ``"fp32"`` for
        every lowered table, ``"auto"`` (int8 for tables of 64 KiB or more, fp32 below; fp16 tables: docs/inference.md), or a dict
        from table name / glob pattern to one of these. The report gives bytes and the error
        against the fp32 lookups on the example inputs per table.
      output_dtype: inference with quantize: dtype of the pooled outputs, ``"fp32"`` or ``"fp16"``.
      reuse_outputs: on CPU, in inference, a pooled group on the ``"native"`` or ``"reference"`` kernel writes into one
        output buffer that it keeps between calls and reuses whenever nothing references the
        previous result (a fresh tensor of tens of MB costs a page fault per 4 KiB every call).
        Costs one output's memory per group between calls; ``False`` allocates every call.
      optimizer: an :mod:`fxrec.optim` optimizer for every embedding table, or a dict from table
        name / parameter name / glob pattern to one. Where fbgemm implements it exactly, the
        update runs inside backward; then build the training optimizer with
        ``fast.make_optimizer(torch.optim.Adam, lr=...)`` (see :func:`make_optimizer`).
      dump_dir: a directory to write the graph into before the first pass (``00_captured.txt``
        with ``gm.code``, ``00_captured.svg`` its picture, ``00_captured.dot`` the picture's
        source) and after every pass (``01_annotate_lookups.*``, ...). Needs Graphviz (see
        :mod:`fxrec.viz`); without it this raises :class:`fxrec.viz.GraphvizMissing` before any
        work is done.

      plan: a :class:`fxrec.ShardingPlan` (``fxrec.plan(...)``): rewrite the model for this rank of
        the initialised torch.distributed process group (gloo on CPU): table-wise and row-wise
        tables get input-dist / lookup / output-dist nodes with their collectives, data-parallel
        tables and every other parameter stay whole with their gradients summed over ranks (by
        DDP's reducer, applied in place; sparse gradients by one all-reduce each).
        Every rank feeds its own local batch (the same size on every rank) and gets the rows of
        the single-process model for it; gradients are summed over ranks, so a loss that sums
        over the global batch (or divides by the global batch size) gives the single-process
        gradients. With ``optimizer=``, each rank's local lookups apply it inside backward to the
        rows they hold (docs/sharding.md). With ``mode="inference", quantize=...`` each rank serves
        its shards quantized (table-wise and row-wise; integer dtypes not column-wise; data-parallel
        tables stay fp32). A model built on
        the ``meta`` device needs a plan: each rank allocates only what it holds, initialised by
        the modules' own ``reset_parameters()`` (:mod:`fxrec.materialize`).
      hbm_budget: CUDA: the GPU memory the embedding tables (with their fused optimizer states, or
        their dense gradients when training has no fused optimizer) may take, in bytes or as
        ``"40GB"``. The largest tables beyond it that fbgemm alone reads and writes (inference,
        fused optimizers) go to unified memory (host RAM the GPU reads over the bus) with an HBM
        cache of ``cache_load_factor`` of their rows; the report says where each table is
        (docs/gpu.md). None (default): every table in GPU memory.
      cache_load_factor: with ``hbm_budget``: the HBM cache of the cached tables, as a share of
        their rows (fbgemm's ``cache_load_factor``, default 0.2).
      weights_precision: training with an optimizer fused into fbgemm's backward: ``"fp16"``
        (``"bf16"`` is refused: neither fbgemm build here has bf16 rows) stores the fp32 tables in the TBE at that precision (half the
        memory and bandwidth; their parameters become views of those rows; the lookups still give
        fp32; the update is computed in fp32 and rounded, stochastically on CUDA), or a dict from
        table name / glob pattern to ``"fp32"``, ``"fp16"``, ``"bf16"``. Tables fbgemm cannot run so
        are an error (docs/optimizers.md). With ``plan=``: the shards of the tables it shards are
        stored so; data-parallel tables stay fp32 (pass the same ``weights_precision`` to
        :func:`fxrec.plan` so it counts 2 bytes a value). None (default): as the model holds them.
      max_gradient: training: the gradient of every embedding lookup's output is clamped
        elementwise to ``[-max_gradient, max_gradient]`` before its table (or the fused update)
        gets it: fbgemm's and TorchRec's ``gradient_clipping=True, max_gradient=...``, on every
        kernel and sharding type, fused optimizer or not. The rest of the model's gradients are
        not touched. Identical lookups that fxrec merges into one are clamped once, on their
        summed gradient (docs/optimizers.md). None (default): not clamped.

    Returns:
      a ``torch.fx.GraphModule`` called exactly like ``model``, with ``.report`` and ``.code``;
      its ``state_dict()`` has the original keys (see :func:`write_back`).
    """
    if backend not in BACKENDS:
        raise ValueError(f"fxrec: backend must be one of {BACKENDS}, got {backend!r}")
    check_optimizer_spec(optimizer)
    if mode not in ("training", "inference"):
        raise ValueError(f"fxrec: mode must be 'training' or 'inference', got {mode!r}")
    check_weights_precision(weights_precision, mode, compares=verify or check_passes)
    _check_output_dtype(output_dtype, quantize)
    if mode == "inference" and optimizer is not None:
        raise ValueError("fxrec: an embedding optimizer needs mode='training'")
    max_gradient = _check_max_gradient(max_gradient, mode)
    rank = _check_plan(plan, optimizer, mode, quantize)
    hbm_budget = _check_placement(hbm_budget, cache_load_factor, plan)
    args = _as_args(example_inputs)
    kwargs = dict(example_kwargs or {})
    from torch.utils import _pytree

    if any(isinstance(x, torch.Tensor) and x.is_meta for x in _pytree.tree_leaves((args, kwargs))):
        raise InputError("fxrec: example inputs on the meta device (the meta model of a plan still takes real "
                         "example inputs: each rank's local batch); their device would be the transformed "
                         "model's, and their ids have no values to check")
    if plan is not None:
        _check_rank_device(model, args, kwargs)
        _check_same_plan(plan, args)
    on_meta = meta_names(model)
    if on_meta and plan is None:
        raise InputError(f"fxrec: the model's {on_meta[:4]}{' ...' if len(on_meta) > 4 else ''} are on the meta device: "
                         "transform(..., plan=...) allocates a meta model's tensors (each rank its own shards); "
                         "without a plan, build the model on a real device (docs/sharding.md)")
    if on_meta and quantize is not None:
        raise InputError("fxrec: quantize= quantizes the model's trained tables, and a model on the meta device has "
                         "no values: build it on a real device (or load its checkpoint into it) to serve it quantized")
    if quantize is not None and (verify or check_passes):
        raise InputError("fxrec: verify and check_passes compare outputs and table gradients with the model's own; "
                         "quantize= stores the tables quantized and untrainable (no gradients), so they cannot agree: "
                         "the report's Quantization section (fast.report.quantization) gives each table's error "
                         "against the model's lookups on the example inputs")
    if on_meta and (verify or check_passes):
        raise InputError("fxrec: verify and check_passes compare with the model's own outputs, which a model on the "
                         "meta device has none of")
    # What verify compares with: the user's model itself when fxrec works on a copy (no second copy
    # of the tables; its .grad fields are restored); a copy when the model is handed over.
    reference_model = None
    if verify or check_passes:
        reference_model = model if copy_model else copy.deepcopy(model)
    dump = None
    if dump_dir is not None:
        from .viz import pass_dumper  # checks that Graphviz is installed

        dump = pass_dumper(dump_dir)
    log = logger or logging.getLogger("fxrec")
    log.debug("capturing the model with torch.export")
    # With a plan, capture on placeholders (no copy of the tables): each rank then allocates and
    # fills only what it holds (materialize, below); verify, check_passes and quantize= need the
    # real values while the passes run.
    on_placeholders = plan is not None and not (verify or check_passes or quantize is not None)
    gm = capture(working_copy(model, args, every=on_placeholders) if copy_model or on_meta or on_placeholders
                 else model, args, kwargs)

    report = Report()
    ctx = PassContext(
        config=Config(backend=backend, check_numerics=check_passes, timing_rounds=timing_rounds, optimizer=optimizer,
                      mode=mode, quantize=quantize, output_dtype=output_dtype,
                      reuse_outputs=reuse_outputs, plan=plan, rank=rank, autotune=autotune,
                      hbm_budget=hbm_budget, cache_load_factor=float(cache_load_factor),
                      weights_precision=weights_precision),
        report=report, example_args=args, example_kwargs=kwargs, logger=log,
    )
    if check_passes:
        def check_against_the_model(g):  # after each pass; as verify: gradients, no fused update
            with fused_updates_off(g), fused_updates_off(reference_model):  # (a transformed model's too)
                compare_models(reference_model, g, args, kwargs, rtol=rtol, atol=atol)

        ctx.reference = check_against_the_model
    passes = default_pipeline(ctx.config)
    # Records are read before lowering erases the nodes that carry them.
    records, hidden = [], []

    def snapshot(g, c):
        records.extend(n.meta[meta.LOOKUP] for n in g.graph.nodes if meta.LOOKUP in n.meta)
        hidden.extend(meta.hidden_records(g))  # (in no_grad / autocast blocks: their optimizer as torch.optim)

    users_own = reference_model if reference_model is model else None  # its .grad are put back
    with _grads_restored(users_own):
        gm = _on_every_rank(plan, args, lambda: PassManager(passes).run(gm, ctx, after={"group_lookups": snapshot},
                                                                           dump=dump))
    _name_guarded_inputs(gm, records)
    with_opt = {r.param for r in records + hidden if r.optimizer is not None}
    # (a sparse table read elsewhere too: its .grad is dense)
    dense_grads = _dense_from_elsewhere(gm, with_opt) if plan is None else set()
    table_opts = {r.param: (r.optimizer, r.sparse and r.param not in dense_grads) for r in records + hidden
                  if r.optimizer is not None}
    for n in gm.graph.nodes:  # lowered tables: the gradient layout their group module gives
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), EmbeddingGroup) and len(n.args) > 3:
            for w, spec in zip(n.args[3], gm.get_submodule(n.target).tables):
                if w.target in table_opts:
                    table_opts[w.target] = (table_opts[w.target][0], spec.sparse and w.target not in dense_grads)
    fused_groups = _fused_groups(gm)
    fused_fqns = {f for _, fs in fused_groups for f in fs}
    for fqn, (opt, sparse) in table_opts.items():
        why = opt.sparse_refusal() if sparse and fqn not in fused_fqns else ""
        if why:
            raise InputError(f"fxrec: table '{fqn[:-len('.weight')] if fqn.endswith('.weight') else fqn}' cannot "
                             f"train with {opt.describe()}: {why}")
    gm.meta["fxrec_table_optimizers"] = table_opts
    gm.meta["fxrec_fused_groups"] = fused_groups
    if plan is None:
        _store_lower_precision(gm)
    if max_gradient:
        _clamp_lookup_gradients(gm, records)
    notes = _modes_notes(gm) + accepted_sizes(gm) + _placement_note(gm, hbm_budget) + _clamp_note(max_gradient)
    plan_per_rank = []
    if plan is not None:
        gm.meta["fxrec_plan"] = plan
        # this rank's tensors: allocated, filled from the model (meta ones: initialised, and the
        # whole ones broadcast from rank 0)
        materialize(gm, model, gm.meta.get("fxrec_sharded_params", {}), gm.meta.get("fxrec_shard_layout", {}))
        _store_lower_precision(gm)  # the rank's shards, now that they hold values
        if mode == "training":
            _sum_gradients_over_ranks(gm, records)
        notes.append(_rank_note(plan, rank))
        plan_per_rank = _plan_per_rank(plan)
    # the report, built once from the graph after the pipeline (every pipeline the same way)
    report = build_report(gm, report.passes, report.pass_runs, notes, plan_per_rank)
    # GraphModule keeps these attributes through deepcopy (TransformedModule through pickle too).
    preserved = gm.meta.setdefault("_user_preserved_attributes", {})
    preserved["report"] = report
    for k, v in preserved.items():
        setattr(gm, k, v)
    if verify:  # (the model given may be a transformed one whose fused updates must not run either)
        with fused_updates_off(gm), fused_updates_off(reference_model), _grads_restored(users_own):
            compare_models(reference_model, gm, args, kwargs, rtol=rtol, atol=atol)  # trains nothing
    if max_gradient:  # after verify and check_passes, which compare the gradients with the model's own
        _set_max_gradient(gm, max_gradient)
    return gm


def _clamp_lookup_gradients(gm: fx.GraphModule, records) -> None:
    """``max_gradient``: a lookup left as the model wrote it (data-parallel in a plan, or one no
    group takes) gets a :class:`~fxrec.runtime.grad.ClampGradient` module after it; the group
    modules and the sharded output dists clamp their outputs themselves. All start off (0):
    :func:`_set_max_gradient` turns them on once verify has compared the gradients."""
    from .runtime.grad import ClampGradient

    present = set(gm.graph.nodes)
    for k, out in enumerate(o for o in dict.fromkeys(r.output for r in records) if o in present):
        users = list(out.users)  # (a lookup's record may be there twice: each output once)
        name = f"fxrec_clamp_{k}"
        gm.add_submodule(name, ClampGradient())
        with gm.graph.inserting_after(out):
            clamped = gm.graph.call_module(name, (out,))
        for u in users:
            u.replace_input_with(out, clamped)
    gm.recompile()


def _set_max_gradient(gm: fx.GraphModule, limit: float) -> None:
    from .runtime.grad import ClampGradient
    from .runtime.sharded import PooledOutputDist
    from .runtime.sharded_sequence import SequenceOutputDist

    for m in gm.modules():
        if isinstance(m, (EmbeddingGroup, ClampGradient, PooledOutputDist, SequenceOutputDist)):
            m.max_gradient = limit


def _check_output_dtype(output_dtype, quantize) -> None:
    if output_dtype not in ("fp32", "fp16"):
        raise ValueError(f"fxrec: output_dtype must be 'fp32' or 'fp16', got {output_dtype!r}")
    if output_dtype != "fp32" and quantize is None:
        raise ValueError("fxrec: output_dtype is the dtype of quantized tables' lookups: it needs quantize= "
                         "(mode='inference'); the model's own lookups give its tables' dtype")


def _check_max_gradient(max_gradient, mode: str) -> float:
    if max_gradient is None:
        return 0.0
    if isinstance(max_gradient, bool) or not isinstance(max_gradient, (int, float)) or not 0 < max_gradient < float("inf"):
        raise ValueError(f"fxrec: max_gradient must be a positive number (or None), got {max_gradient!r}")
    if mode != "training":
        raise ValueError("fxrec: max_gradient clamps the gradients of training; mode='inference' makes none")
    return float(max_gradient)


@contextlib.contextmanager
def _grads_restored(model: Optional[torch.nn.Module]):
    """verify clears and fills the ``.grad`` of the reference's parameters: when the reference is
    the user's model, put them back."""
    saved = [(p, p.grad) for p in model.parameters()] if model is not None else []
    try:
        yield
    finally:
        for p, g in saved:
            p.grad = g


def _name_guarded_inputs(gm: fx.GraphModule, records) -> None:
    """Input-size errors say what each input feeds: ``ids of feature 'ids_2' (table 'bags.2')``."""
    guards = input_guards(gm)
    if guards is None:
        return
    index = {n.name: k for k, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    for r in records:
        for what, node in (("ids", r.ids), ("offsets", r.offsets), ("per-sample weights", r.per_sample_weights)):
            if isinstance(node, fx.Node) and node.op == "placeholder" and node.name in index:
                guards.roles.setdefault(index[node.name], f"{what} of feature '{r.feature}', table '{r.table}'")


def _store_lower_precision(gm: fx.GraphModule) -> None:
    """Tables stored in fp16/bf16 (weights_precision=) go into their TBE now, so the model holds
    them so (its parameters views of those rows) from the start, not from the first call."""
    from .runtime.kernels.fbgemm import ensure_bound

    for name, fqns in gm.meta["fxrec_fused_groups"]:
        group = gm.get_submodule(name)
        if group.weights:
            ensure_bound(group, [gm.get_parameter(f) for f in fqns])


def _fused_groups(gm: fx.GraphModule) -> list:
    """(group module's name, its tables' parameter names) of every group with a fused optimizer:
    the group calls (weights as 4th argument), and with a plan each rank's local lookup group
    (its lookup module's ``group``, weights as the call's 2nd argument)."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_module":
            continue
        mod = gm.get_submodule(n.target)
        if isinstance(mod, EmbeddingGroup) and len(n.args) > 3 and mod.fused is not None:
            out.append((n.target, [w.target for w in n.args[3]]))
        elif isinstance(getattr(mod, "group", None), EmbeddingGroup) and mod.group.fused is not None:
            out.append((f"{n.target}.group", [w.target for w in n.args[1]]))
    return out


def _check_plan(plan, optimizer, mode: str, quantize) -> int:
    """This process's rank when ``plan`` is given (0 otherwise); raises on what a plan cannot do."""
    if plan is None:
        return 0
    import torch.distributed as dist

    if not hasattr(plan, "tables") or not hasattr(plan, "topology"):
        raise TypeError(f"fxrec: plan= needs a fxrec.ShardingPlan, got {type(plan).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fxrec: transform(plan=...) needs torch.distributed initialised "
                           "(dist.init_process_group('gloo') under torchrun)")
    if dist.get_world_size() != plan.topology.world_size:
        raise ValueError(f"fxrec: the plan is for world size {plan.topology.world_size}, the process group "
                         f"has {dist.get_world_size()} ranks")
    return dist.get_rank()


def _check_rank_device(model, args, kwargs) -> None:
    """Under NCCL: the model, the example and the current CUDA device agree (see
    :func:`fxrec.runtime.collectives.check_rank_device`)."""
    import os

    import torch.distributed as dist
    from torch.utils import _pytree

    from .runtime.collectives import check_rank_device

    backend = str(dist.get_backend())
    if backend != "nccl":
        return
    local = os.environ.get("LOCAL_RANK")
    tables = {t.device for t in list(model.parameters()) + list(model.buffers()) if not t.is_meta}
    inputs = {x.device for x in _pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)}
    check_rank_device(backend, torch.cuda.current_device(), int(local) if local is not None and local.isdigit() else None,
                      tables, inputs)


def _dense_from_elsewhere(gm: fx.GraphModule, tables: set) -> set:
    """The tables of ``tables`` whose ``.grad`` comes out dense whatever layout their groups give them: the graph
    also reads them with a dense gradient outside the groups (a tied output layer, ``weight[ids]``
    or an ``nn.Embedding`` lookup without ``sparse=True`` left as written), so their torch.optim
    step must take a dense one (torch.optim.Adam, not SparseAdam). Reads no gradient reaches
    (a detached lookup, a no_grad block) do not count."""
    from .dataflow import carries_gradient

    sparse_ops = {torch.ops.aten.embedding.default: 4, torch.ops.aten.embedding_bag.default: 5,
                  torch.ops.aten.embedding_bag.padding_idx: 5, torch.ops.aten._embedding_bag.default: 5}
    out = set()
    for n in gm.graph.nodes:
        if n.op != "get_attr" or n.target not in tables:
            continue
        for u in n.users:
            if u.op == "call_module" and isinstance(gm.get_submodule(u.target), EmbeddingGroup):
                continue
            if u.op == "call_function" and isinstance(u.target, torch._ops.HigherOrderOperator):
                continue  # (a no_grad / autocast block: its lookups are left as written, with no gradient or theirs)
            k = sparse_ops.get(u.target) if u.op == "call_function" else None
            if k is not None and len(u.args) > k and u.args[k] is True:
                continue  # (a sparse lookup left as written: its gradient is sparse)
            if u.op == "call_function" and not carries_gradient(u):
                continue
            out.add(n.target)
    return out


def _on_every_rank(plan, args, run):
    """``run()``. With a plan, a failure on one rank is one on every rank: a refusal that depends on
    what a rank holds (a table's shards) is raised where they are, and the other ranks would wait
    for that rank in the set-up's first collective (until the process group's timeout). One exchange
    of a flag: the failing rank raises its own error, the others an InputError saying which failed."""
    import torch.distributed as dist
    from torch.utils import _pytree

    from .runtime.collectives import all_gather_ints

    if plan is None or not (dist.is_available() and dist.is_initialized()):
        return run()
    error, out = None, None
    try:
        out = run()
    except Exception as e:  # noqa: BLE001 - any failure on one rank stops them all
        error = e
    leaves = [x for x in _pytree.tree_leaves(args) if isinstance(x, torch.Tensor)]
    every = all_gather_ints([0 if error is None else 1], leaves[0].device if leaves else torch.device("cpu"),
                            "fxrec.transform (its passes)")
    if error is not None:
        raise error
    failed = [r for r, (flag,) in enumerate(every) if flag]
    if failed:
        raise InputError(f"fxrec: transform failed on rank(s) {failed} (their error says why); this rank stops with them")
    return out


def _check_same_plan(plan, args) -> None:
    """Every rank must run the same plan (its collectives pair up across ranks): a plan made on
    each rank from its own local batch can place a table differently, and the ranks would then
    send each other collectives of other sizes (gloo aborts the process; NCCL hangs). One
    exchange of a digest of the plan's layout at transform; on a mismatch, an error on every rank
    naming a table the ranks disagree on."""
    import hashlib

    import torch.distributed as dist
    from torch.utils import _pytree

    from .runtime.collectives import all_gather_ints

    layout = sorted((t, tp.sharding, tp.spec.num_rows, tp.spec.dim, tp.spec.weights,
                     tuple((sh.rank, sh.row_offset, sh.num_rows, sh.col_offset, sh.num_cols) for sh in tp.shards))
                    for t, tp in plan.tables.items())
    digest = hashlib.sha256(repr(layout).encode()).digest()
    mine = [int.from_bytes(digest[k:k + 8], "little", signed=True) for k in (0, 8)]
    leaves = [x for x in _pytree.tree_leaves(args) if isinstance(x, torch.Tensor)]
    dev = leaves[0].device if leaves else torch.device("cpu")
    every = all_gather_ints(mine, dev, "fxrec.transform (the plan)")
    if all(row == every[0] for row in every):
        return
    layouts = [None] * len(every)
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():  # (NCCL: the inputs' GPU)
        dist.all_gather_object(layouts, layout)
    r = next(r for r, row in enumerate(every) if row != every[0])
    first, other = ({d[0]: d for d in layouts[k]} for k in (0, r))
    t = next(t for t in sorted(set(first) | set(other)) if first.get(t) != other.get(t))

    def said(d):
        if d is None:
            return "does not have it"
        shards = ", ".join(f"rank {sh[0]}: rows {sh[1]}+{sh[2]}, cols {sh[3]}+{sh[4]}" for sh in d[5])
        return f"plans it {d[1]} ({d[2]} x {d[3]}{', ' + d[4] if d[4] else ''}; {shards})"

    raise ValueError(f"fxrec: the ranks were given different sharding plans: for table '{t}', rank 0 {said(first.get(t))}, "
                     f"rank {r} {said(other.get(t))}. Every rank must run the same plan: make it once and share it "
                     "(plan.save(path) and fxrec.ShardingPlan.load(path), or dist.broadcast_object_list), or pin the "
                     "tables a per-rank plan could place differently")


def _sum_gradients_over_ranks(gm: fx.GraphModule, records) -> None:
    """Every parameter that is not a table shard is whole on every rank: sum its gradient. DDP
    (``replicate_whole``) does it for all of them but the tables with sparse gradients, which DDP's
    communication hooks cannot take: those keep a hook each, which sums them sparse (``sparse_sum``)."""
    from .runtime.collectives import all_reduce_grad, replicate_whole

    sharded = gm.meta.get("fxrec_sharded_params", {})
    params = dict(gm.named_parameters())
    sparse = {r.param for r in records if r.sparse and r.param in params and r.param not in sharded}
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr" and n.users}  # (export keeps unread ones)
    unused = any(p.requires_grad and n not in used for n, p in params.items() if n not in sharded)
    replicate_whole(gm, set(sharded) | sparse, unused)
    for name in sparse:
        if params[name].requires_grad:
            params[name].register_hook(all_reduce_grad(name))


def _plan_per_rank(plan) -> list:
    """The report's per-rank figures of a plan: its bytes and estimated cost on each rank."""
    return [{"rank": r, "bytes": int(b), "est_cost_ms": float(c)}
            for r, (b, c) in enumerate(zip(plan.rank_bytes(), plan.rank_cost_ms()))]


def _rank_note(plan, rank: int) -> str:
    def piece(s) -> str:  # (first..last, as the id errors give a table's rows)
        tp = plan.tables[s.table]
        cols = f", columns {s.col_offset}..{s.col_offset + s.num_cols - 1}" if s.num_cols != tp.spec.dim else ""
        return f"{s.table} ({tp.sharding}, rows {s.row_offset}..{s.row_offset + s.num_rows - 1}{cols})"

    mine = [piece(s) for s in plan.shards_on(rank) if plan.tables[s.table].sharding != "data_parallel" and s.num_rows]
    return (f"rank {rank} of {plan.topology.world_size}: holds {', '.join(mine) or 'no table shards'}; "
            "the gradients of every other parameter are summed over ranks in backward")


@contextlib.contextmanager
def fused_updates_off(gm: torch.nn.Module):
    """Inside: fused groups give gradients instead of updating their tables in backward."""
    mods = [m for m in gm.modules() if isinstance(m, EmbeddingGroup)]
    before = [m.fused_enabled for m in mods]
    for m in mods:
        m.fused_enabled = False
    try:
        yield
    finally:
        for m, b in zip(mods, before):
            m.fused_enabled = b


def make_optimizer(transformed: torch.nn.Module, dense_optimizer=torch.optim.SGD, **kwargs) -> CombinedOptimizer:
    """One optimizer for a transformed model, usable with torch.optim.lr_scheduler.

    Parameters that are not embedding tables with an :mod:`fxrec.optim` optimizer get
    ``dense_optimizer(params, **kwargs)``. Tables whose optimizer is fused are updated inside
    backward (their learning rate is the fused group's ``"lr"`` in ``param_groups``); tables
    whose optimizer is not fused get the torch.optim namesake, stepped in ``step()``.
    """
    from .runtime.optimizer import Unit

    table_opts = transformed.meta.get("fxrec_table_optimizers", {})  # every table of the model, on every rank
    fused = []
    fused_names = set()
    for name, fqns in transformed.meta.get("fxrec_fused_groups", []):
        mod = transformed.get_submodule(name)
        if mod.fused_active:
            fused.append((name, mod, [transformed.get_parameter(f) for f in fqns], list(fqns)))
            fused_names.update(fqns)
    # One param group per table optimizer, in the order of the tables it first serves: the same on
    # every rank and under any plan, whichever tables a rank holds and fuses. (A table's sparse
    # flag here is its gradients' as lowered, which a plan changes: it splits a table optimizer
    # only where the torch class differs, Adam's, whose tables are never lowered so.)
    by_unit: Dict = {}
    for fqn, (opt, sparse) in table_opts.items():
        by_unit.setdefault((opt, sparse) if opt.SPARSE_CLASS else (opt, None), []).append((fqn, sparse))
    held = dict(transformed.named_parameters())  # with a plan: the tables this rank holds
    position = {f: i for i, f in enumerate(table_opts)}
    fallbacks, units = [], []
    for (opt, _), items in by_unit.items():
        mine = [(f, sparse) for f, sparse in items if f not in fused_names and f in held]
        if mine:
            fallbacks.append(opt.torch_optimizer([held[f] for f, _ in mine], sparse=any(sp for _, sp in mine)))
        members = {f for f, _ in items}
        units.append(Unit(items[0][0], opt.lr, len(fallbacks) - 1 if mine else None,
                          [i for i, (_, _, _, names) in enumerate(fused) if names and names[0] in members],
                          [f for f, _ in mine], position[mine[0][0]] if mine else 0))
    dense_params = [p for n, p in transformed.named_parameters() if p.requires_grad and n not in table_opts]
    dense = dense_optimizer(dense_params, **kwargs) if dense_params else None
    return CombinedOptimizer(dense, fallbacks, fused, units)


def _clamp_note(max_gradient: Optional[float]) -> list:
    return [f"embedding outputs' gradients clamped to [-{max_gradient:g}, {max_gradient:g}] (max_gradient)"] \
        if max_gradient else []


def _placement_note(gm: fx.GraphModule, hbm_budget) -> list:
    """A report note where ``hbm_budget=`` was given and no group runs on CUDA (it places GPU memory)."""
    if hbm_budget is None:
        return []
    devices = {n.meta[meta.DECISION].device for n in gm.graph.nodes if meta.DECISION in n.meta}
    if "cuda" in devices:
        return []
    return [f"hbm_budget= places tables in GPU memory, and no group runs on CUDA here "
            f"({', '.join(sorted(devices)) or 'no groups'}): it changed nothing"]


def _modes_notes(gm: fx.GraphModule) -> list:
    info = gm.meta.get(MODES_KEY)
    if info is None:
        return []
    if not info.switchable:
        return [f"train()/eval(): {info.why_not}"]
    if info.flags:
        return [f"train()/eval() switch {sum(info.flags.values())} dropout/normalisation node(s) of "
                f"{len(info.flags)} module(s), as on the original model (captured in {info.captured} mode)"]
    return []


def explain(
    model: torch.nn.Module,
    example_inputs: Union[tuple, list, torch.Tensor],
    example_kwargs: Optional[Dict[str, Any]] = None,
    *,
    device: Optional[str] = None,
    backend: str = "auto",
    optimizer=None,
    mode: str = "training",
    quantize=None,
    plan=None,
    hbm_budget=None,
    cache_load_factor: float = 0.2,
    weights_precision=None,
    output_dtype: str = "fp32",
    max_gradient: Optional[float] = None,
) -> Report:
    """The report :func:`transform` would give (the arguments are transform's), for ``device`` ("cpu" or "cuda"; default: where
    the model's tables are), without building any kernel, moving or copying any table, or needing
    that device: which lookups are found and grouped, and each group's kernels, fused optimizer,
    dtypes (``weights_precision=``: the precision each table is stored in) and placement on that
    device (with ``hbm_budget=``, which tables go to unified memory: see :func:`transform`). With ``plan=``, how the plan shards each group (no process group
    needed). ``print()`` it, or ``.to_json()``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"fxrec: backend must be one of {BACKENDS}, got {backend!r}")
    if device is not None and device not in DEVICES:
        raise ValueError(f"fxrec: device must be one of {DEVICES} (or None: the tables' own), got {device!r}")
    check_optimizer_spec(optimizer)
    if mode not in ("training", "inference"):
        raise ValueError(f"fxrec: mode must be 'training' or 'inference', got {mode!r}")
    if mode == "inference" and optimizer is not None:
        raise ValueError("fxrec: an embedding optimizer needs mode='training'")
    _check_output_dtype(output_dtype, quantize)
    max_gradient = _check_max_gradient(max_gradient, mode)
    hbm_budget = _check_placement(hbm_budget, cache_load_factor, plan)
    args, kwargs = _as_args(example_inputs), dict(example_kwargs or {})
    # tracing reads the model; it changes and copies nothing (a meta model: a copy with placeholders)
    gm = capture(working_copy(model, args) if meta_names(model) else model, args, kwargs, for_calls=False)
    ctx = PassContext(
        config=Config(backend=backend, optimizer=optimizer, mode=mode, quantize=quantize, plan=plan,
                      output_dtype=output_dtype, device=device or _tables_device(model), hbm_budget=hbm_budget,
                      cache_load_factor=float(cache_load_factor), weights_precision=weights_precision),
        report=Report(), example_args=args, example_kwargs=kwargs, logger=logging.getLogger("fxrec"),
    )
    gm = PassManager(explain_pipeline(ctx.config)).run(gm, ctx)
    if plan is not None:
        from .passes.shard_groups import _sharding, plan_decision

        for gr in ctx.groups:  # transform's refusals of the plan first (a table it does not name, other sizes)
            for r in gr.lookups:
                _sharding(ctx, r)
        for gr in ctx.groups:
            d = plan_decision(gr, plan, ctx.config.device)
            for r in gr.lookups:
                r.node.meta[meta.DECISION] = d
    notes = _modes_notes(gm) + accepted_sizes(gm) + _placement_note(gm, hbm_budget) + _clamp_note(max_gradient)
    if plan is not None:  # (transform's report has its own rank's note; here every rank's, as the plan says)
        world = plan.topology.world_size
        notes += [_rank_note(plan, r) for r in range(min(world, 8))]
        if world > 8:
            notes.append(f"(ranks 8 to {world - 1}: see the plan)")
    notes.append(f"explained for device {ctx.config.device}: nothing was built; transform on that device gives "
                 "these decisions")
    return build_report(gm, ctx.report.passes, ctx.report.pass_runs, notes,
                        _plan_per_rank(plan) if plan is not None else ())


def _check_placement(hbm_budget, cache_load_factor, plan) -> Optional[int]:
    """``hbm_budget`` in bytes (None stays None); errors for what cannot be placed."""
    if isinstance(cache_load_factor, bool) or not isinstance(cache_load_factor, (int, float)) \
            or not 0 < cache_load_factor <= 1:
        raise ValueError(f"fxrec: cache_load_factor must be a number in (0, 1], got {cache_load_factor!r}")
    if hbm_budget is None:
        return None
    if plan is not None:
        raise ValueError("fxrec: with a plan, the planner places the tables (memory_per_rank=); hbm_budget is for one GPU")
    from .planner.specs import parse_bytes

    return parse_bytes(hbm_budget, "hbm_budget", "fxrec")


def _tables_device(model: torch.nn.Module) -> str:
    p = next(model.parameters(), None)
    return "cpu" if p is None or p.device.type == "meta" else p.device.type
