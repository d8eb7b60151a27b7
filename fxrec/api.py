"""fxrec.transform: capture, run the pass pipeline, attach the report."""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any, Dict, Optional, Union

import torch
import torch.fx as fx

from .arguments import (BACKENDS, check_max_gradient, check_output_dtype, check_placement, check_settings,
                        check_target_device, device_arg, tables_device)
from .capture import accepted_sizes, capture, input_guards
from .graph_module import bind_staged
from .materialize import materialize, meta_names, working_copy
from .optim import check_spec as check_optimizer_spec
from .passes.assign_precisions import check_weights_precision
from .runtime.group import EmbeddingGroup
from .pass_infra import Config, InputError, PassContext, PassManager
from .pipeline import default_pipeline, explain_pipeline
from .ranks import (check_dense, check_plan, check_rank_device, check_same_setup, exchange_device, plan_per_rank,
                    rank_note, sum_gradients_over_ranks, together, units_note)
from .report import Report, build_report
from .report_notes import clamp_note, modes_notes, placement_note, rank_placements
from .table_optimizers import fused_updates_off, record_table_optimizers
from . import meta
from .verify import compare_models


def write_back(transformed: torch.nn.Module, model: torch.nn.Module) -> None:
    """Copy the (trained) weights of a transformed model into the original ``model``.

    The transformed model's ``state_dict()`` has the original model's keys, so this is a strict
    ``load_state_dict``; it raises naming the keys when the two models do not match.
    """
    if getattr(transformed, "meta", {}).get("fxrec_plan") is not None:
        raise ValueError("fxrec.write_back: a sharded model holds only this rank's shards of its tables; save it "
                         "with fxrec.checkpoint.save (every rank) and load that into the plain model with "
                         "fxrec.checkpoint.load_into_model (docs/sharding.md)")
    from .runtime.quantized import QuantizedPooledGroup, QuantizedSequenceGroup

    state = transformed.state_dict()
    want = model.state_dict()
    missing, unexpected = [k for k in want if k not in state], [k for k in state if k not in want]
    if missing or unexpected:  # (checked before anything is copied: the model is left as it was)
        quantized = [t.name for m in transformed.modules() if isinstance(m, (QuantizedPooledGroup, QuantizedSequenceGroup))
                     for t in m.tables]
        if quantized:
            raise ValueError(f"fxrec.write_back: the model was quantized for serving: it holds the tables {quantized} "
                             "as quantized rows, not their weights, and nothing is written back (serve the "
                             "trained plain model by transforming it again)")
        raise KeyError(
            f"fxrec.write_back: state_dict keys differ: {missing} are missing from the transformed "
            f"model, {unexpected} are not in the target model"
        )
    shapes = [f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in want.items()
              if isinstance(v, torch.Tensor) and isinstance(state[k], torch.Tensor) and state[k].shape != v.shape]
    if shapes:
        raise ValueError(f"fxrec.write_back: the transformed model's tensors differ in shape from the target "
                         f"model's (transformed vs target): {', '.join(shapes[:4])}; nothing was written")
    model.load_state_dict(state)


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
    cache_load_factor: Optional[float] = None,
    weights_precision=None,
    max_gradient: Optional[float] = None,
    device: Union[str, torch.device, None] = None,
    dense: str = "ddp",
    fsdp_units=None,
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
        cache of ``cache_load_factor`` of their rows (quantized tables: without one where the
        budget is not met with it); the report
        says where each table is
        (docs/gpu.md). With ``plan=``, the budget of each rank's GPU: each rank places the pieces
        of tables it holds by the same rule (docs/sharding.md). None (default): every table in
        GPU memory, or, with a plan made with ``hbm_budget=``, the plan's.
      cache_load_factor: with ``hbm_budget``: the HBM cache of the cached tables, as a share of
        their rows (fbgemm's ``cache_load_factor``; default 0.2, or the plan's with its budget).
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

      device: the device the transformed model runs on, ``"cuda"`` or ``"cpu"`` (or a
        ``torch.device``; ``"cuda:1"`` names one GPU); None (default): where the model's tables
        are. ``"cuda"`` for a model on CPU: the decisions are made for
        CUDA (as ``fxrec.explain(device="cuda")`` gives them) on the model where it is, and the
        transformed model is then moved to the current CUDA device (or the one named), the tables
        ``hbm_budget=`` places in unified memory straight from host memory, never through GPU
        memory: tables that do not fit in GPU memory at all (docs/gpu.md). The example inputs stay
        where the model is; the transformed model then takes inputs on ``device``. Not with
        ``plan=`` (each rank's model and example must be on its own device).
      dense: with ``plan=``, training: how the parameters that are not table shards are kept over
        the ranks. ``"ddp"`` (default): whole on every rank, their gradients summed by DDP's
        reducer. ``"fsdp"``: those that are not embedding tables (the dense layers) sharded over
        the ranks by FSDP (torch's ``fully_shard`` on the transformed model: each rank keeps a
        dim-0 chunk of each, and an optimizer over ``fast.parameters()`` keeps its states for that
        chunk only; FSDP gathers them whole for the forward and backward and reduce-scatters their
        gradients, summed); data-parallel tables stay whole, their gradients summed by hooks. For
        dense layers too large to keep whole on every rank between steps (docs/sharding.md).
      fsdp_units: with ``dense="fsdp"``: which submodules are FSDP units of their own (each gathered
        whole only for its call, in forward and again in backward). None (default): by rule, where
        they at least halve the dense bytes whole at once (docs/sharding.md); ``"one"``: none, the
        whole model one unit (gathered once a step, whole for all of it); ``"every"``: every
        submodule that can be one; or a list of submodule names (``["blocks.0", "blocks.1"]``),
        each of which must be able to be a unit (else a ValueError naming it and why).

    Returns:
      a ``torch.fx.GraphModule`` called exactly like ``model``, with ``.report`` and ``.code``;
      its ``state_dict()`` has the original keys (see :func:`write_back`).
    """
    rank = check_plan(plan)
    # With a plan: every check below and the capture run on every rank as one (a rank whose own
    # arguments or local example fail stops the others at once), then the ranks compare their plans,
    # settings and models before the passes build collectives that must pair up.
    with together(plan, example_inputs, "fxrec.transform (its checks and capture)"):
        if backend not in BACKENDS:
            raise ValueError(f"fxrec: backend must be one of {BACKENDS}, got {backend!r}")
        check_optimizer_spec(optimizer)
        if mode not in ("training", "inference"):
            raise ValueError(f"fxrec: mode must be 'training' or 'inference', got {mode!r}")
        check_weights_precision(weights_precision, mode, compares=verify or check_passes)
        check_dense(dense, plan, mode, fsdp_units)
        check_output_dtype(output_dtype, quantize)
        if mode == "inference" and optimizer is not None:
            raise ValueError("fxrec: an embedding optimizer needs mode='training'")
        max_gradient = check_max_gradient(max_gradient, mode)
        check_settings(timing_rounds, rtol, atol, logger)
        hbm_budget, cache_load_factor = check_placement(hbm_budget, cache_load_factor, plan)
        args = _as_args(example_inputs)
        kwargs = dict(example_kwargs or {})
        target = check_target_device(device, model, plan, autotune)
        from torch.utils import _pytree

        if any(isinstance(x, torch.Tensor) and x.is_meta for x in _pytree.tree_leaves((args, kwargs))):
            raise InputError("fxrec: example inputs on the meta device (the meta model of a plan still takes real "
                             "example inputs: each rank's local batch); their device would be the transformed "
                             "model's, and their ids have no values to check")
        if plan is not None:
            check_rank_device(model, args, kwargs)
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
    if plan is not None:
        check_same_setup(plan, dict(
            mode=mode, backend=backend, optimizer=optimizer, quantize=quantize, output_dtype=output_dtype,
            weights_precision=weights_precision, max_gradient=max_gradient or None, verify=verify,
            check_passes=check_passes, reuse_outputs=reuse_outputs, dense=dense,
            fsdp_units=fsdp_units if isinstance(fsdp_units, (str, type(None))) else list(fsdp_units)),
            sorted((n, tuple(t.shape), str(t.dtype)) for n, t in list(model.named_parameters()) + list(model.named_buffers())),
            exchange_device(args))

    report = Report()
    ctx = PassContext(
        config=Config(backend=backend, check_numerics=check_passes, timing_rounds=timing_rounds, optimizer=optimizer,
                      mode=mode, quantize=quantize, output_dtype=output_dtype,
                      reuse_outputs=reuse_outputs, plan=plan, rank=rank, autotune=autotune,
                      hbm_budget=hbm_budget, cache_load_factor=float(cache_load_factor),
                      weights_precision=weights_precision, max_gradient=max_gradient or 0.0,
                      device=target.type if target is not None else None),
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
        with together(plan, args, "fxrec.transform (its passes)"):
            gm = PassManager(passes).run(gm, ctx, after={"group_lookups": snapshot}, dump=dump)
    _name_guarded_inputs(gm, records)
    record_table_optimizers(gm, records + hidden, sharded=plan is not None)
    if plan is None:
        _store_lower_precision(gm)
    if max_gradient:
        _clamp_lookup_gradients(gm, records + [r for r in hidden if r.grad])
    notes = modes_notes(gm) + accepted_sizes(gm) + placement_note(gm, hbm_budget) + clamp_note(max_gradient)
    per_rank = []
    if plan is not None:
        gm.meta["fxrec_plan"] = plan
        gm.meta["fxrec_quantize"] = quantize  # (the same on every rank: checkpoints refuse quantized shards)
        # this rank's tensors: allocated, filled from the model (meta ones: initialised, and the
        # whole ones broadcast from rank 0)
        materialize(gm, model, gm.meta.get("fxrec_sharded_params", {}), gm.meta.get("fxrec_shard_layout", {}))
        with together(plan, args, "fxrec.transform (binding the pieces placed in unified memory)"):
            bind_staged(gm)  # (pieces bound for unified memory, held in host memory until now)
        _store_lower_precision(gm)  # the rank's shards, now that they hold values
        if mode == "training":
            sum_gradients_over_ranks(gm, records + hidden, dense, fsdp_units)  # (tables read in no_grad / autocast blocks too)
        # It keeps its own parameters in step over ranks: a DistributedDataParallel around it would
        # broadcast rank 0's table shards over the other ranks' and average what is already summed.
        # DDP leaves the parameters this list names (its own replicate() above takes a list of
        # parameters, not this), and, left none, refuses the model before it touches anything.
        gm.meta.setdefault("_user_preserved_attributes", {})["_ddp_params_and_buffers_to_ignore"] = sorted(
            [n for n, _ in gm.named_parameters()] + [n for n, _ in gm.named_buffers()])
        notes.append(rank_note(plan, rank, dense))
        if dense == "fsdp" and mode == "training":
            notes.append(units_note(gm.meta.get("fxrec_fsdp_units"), fsdp_units))
        per_rank = plan_per_rank(plan)
    # the report, built once from the graph after the pipeline (every pipeline the same way)
    report = build_report(gm, report.passes, report.pass_runs, notes, per_rank)
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
    if target is not None:  # (tables placed in unified memory go there straight: TransformedModule._apply)
        gm.to(target)
    return gm


def _clamp_lookup_gradients(gm: fx.GraphModule, records) -> None:
    """``max_gradient``: a lookup left as the model wrote it (data-parallel in a plan, one no
    group takes, or one inside an autocast block, in the block's graph) gets a
    :class:`~fxrec.runtime.grad.ClampGradient` module after it; the group modules and the sharded
    output dists clamp their outputs themselves. All start off (0): :func:`_set_max_gradient`
    turns them on once verify has compared the gradients."""
    from .runtime.grad import ClampGradient

    graphs = {id(gm.graph): gm}
    for m in gm.modules():  # (the blocks' bodies: graphs of their own)
        if isinstance(m, fx.GraphModule):
            graphs.setdefault(id(m.graph), m)
    changed = {}
    present = {k: set(g.graph.nodes) for k, g in graphs.items()}
    outputs = [o for o in dict.fromkeys(r.output for r in records) if o in present.get(id(o.graph), ())]
    for k, out in enumerate(outputs):
        owner = graphs[id(out.graph)]
        users = list(out.users)  # (a lookup's record may be there twice: each output once)
        name = f"fxrec_clamp_{k}"
        owner.add_submodule(name, ClampGradient())
        with out.graph.inserting_after(out):
            clamped = out.graph.call_module(name, (out,))
        for u in users:
            u.replace_input_with(out, clamped)
        changed[id(owner)] = owner
    gm.recompile()
    for owner in changed.values():
        owner.recompile()


def _set_max_gradient(gm: fx.GraphModule, limit: float) -> None:
    from .runtime.grad import ClampGradient
    from .runtime.sharded import PooledOutputDist
    from .runtime.sharded_sequence import SequenceOutputDist

    for m in gm.modules():
        if isinstance(m, (EmbeddingGroup, ClampGradient, PooledOutputDist, SequenceOutputDist)):
            m.max_gradient = limit


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
    reshapes = {torch.ops.aten.reshape.default, torch.ops.aten.view.default, torch.ops.aten.flatten.using_ints,
                torch.ops.aten._unsafe_view.default, torch.ops.aten.contiguous.default}
    for r in records:
        for what, node in (("ids", r.ids), ("offsets", r.offsets), ("per-sample weights", r.per_sample_weights)):
            while isinstance(node, fx.Node) and node.op == "call_function" and node.target in reshapes:
                node = node.args[0]  # ([B, L] ids of a bag: flattened by the lookup)
            if isinstance(node, fx.Node) and node.op == "placeholder" and node.name in index:
                guards.roles.setdefault(index[node.name], f"{what} of feature '{r.feature}', table '{r.table}'")


def _store_lower_precision(gm: fx.GraphModule) -> None:
    """Tables stored in fp16/bf16 (weights_precision=) go into their TBE now, so the model holds
    them so (its parameters views of those rows) from the start, not from the first call."""
    from .runtime.kernels.fbgemm_bind import ensure_bound

    for name, fqns in gm.meta["fxrec_fused_groups"]:
        group = gm.get_submodule(name)
        if group.weights:
            ensure_bound(group, [gm.get_parameter(f) for f in fqns])


def explain(
    model: torch.nn.Module,
    example_inputs: Union[tuple, list, torch.Tensor],
    example_kwargs: Optional[Dict[str, Any]] = None,
    *,
    device: Union[str, torch.device, None] = None,
    backend: str = "auto",
    optimizer=None,
    mode: str = "training",
    quantize=None,
    plan=None,
    hbm_budget=None,
    cache_load_factor: Optional[float] = None,
    weights_precision=None,
    output_dtype: str = "fp32",
    max_gradient: Optional[float] = None,
    dense: str = "ddp",
    fsdp_units=None,
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
    want = device_arg(device)
    check_optimizer_spec(optimizer)
    if mode not in ("training", "inference"):
        raise ValueError(f"fxrec: mode must be 'training' or 'inference', got {mode!r}")
    if mode == "inference" and optimizer is not None:
        raise ValueError("fxrec: an embedding optimizer needs mode='training'")
    check_output_dtype(output_dtype, quantize)
    max_gradient = check_max_gradient(max_gradient, mode)
    check_dense(dense, plan, mode, fsdp_units)
    hbm_budget, cache_load_factor = check_placement(hbm_budget, cache_load_factor, plan)
    args, kwargs = _as_args(example_inputs), dict(example_kwargs or {})
    # tracing reads the model; it changes and copies nothing (a meta model: a copy with placeholders)
    gm = capture(working_copy(model, args) if meta_names(model) else model, args, kwargs, for_calls=False)
    ctx = PassContext(
        config=Config(backend=backend, optimizer=optimizer, mode=mode, quantize=quantize, plan=plan,
                      output_dtype=output_dtype, hbm_budget=hbm_budget,
                      device=want.type if want is not None else tables_device(model),
                      cache_load_factor=float(cache_load_factor), weights_precision=weights_precision,
                      max_gradient=max_gradient or 0.0),
        report=Report(), example_args=args, example_kwargs=kwargs, logger=logging.getLogger("fxrec"),
    )
    gm = PassManager(explain_pipeline(ctx.config)).run(gm, ctx)
    if plan is not None:
        from .passes.shard_plan import check_plan, plan_decision

        check_plan(gm, ctx)  # transform's refusals of the plan first (a table it does not name, other sizes)
        for gr in ctx.groups:
            d = plan_decision(gr, plan, ctx.config.device)
            for r in gr.lookups:
                r.node.meta[meta.DECISION] = d
    notes = modes_notes(gm) + accepted_sizes(gm) + placement_note(gm, hbm_budget) + clamp_note(max_gradient)
    if plan is not None:  # (transform's report has its own rank's note; here every rank's, as the plan says)
        world = plan.topology.world_size
        notes += [rank_note(plan, r, dense) for r in range(min(world, 8))]
        if dense == "fsdp":  # (the same rule on this graph: it reads only the dense operations around the lookups)
            from .passes.outline_dense_units import outline_dense_units

            tables = {n.meta[meta.LOOKUP].param for n in gm.graph.nodes if meta.LOOKUP in n.meta}
            units = outline_dense_units(gm, tables | {r.param for r in meta.hidden_records(gm)}, fsdp_units)
            notes.append(units_note(units, fsdp_units))
        if hbm_budget is not None:  # (the ranks' placements, as each rank's transform makes them)
            notes += rank_placements(ctx, world)
        if world > 8:
            notes.append(f"(ranks 8 to {world - 1}: see the plan)")
    notes.append(f"explained for device {ctx.config.device}: nothing was built; transform on that device gives "
                 "these decisions")
    return build_report(gm, ctx.report.passes, ctx.report.pass_runs, notes,
                        plan_per_rank(plan) if plan is not None else ())


