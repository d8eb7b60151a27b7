"""fxrec.plan: from a model (or bare table specs) and a topology to a ShardingPlan."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

from ..table_keys import check_keys, deciding_key
from .cost import optimizer_kind
from .search import normalize_pins, search
from .specs import SHARDING_TYPES, ShardingPlan, TableSpec, Topology, format_bytes

#: Samples per rank per step when neither batch_size nor example inputs give it.
DEFAULT_BATCH_SIZE = 512


def plan(
    model=None,
    example_inputs=None,
    example_kwargs: Optional[Dict[str, Any]] = None,
    *,
    tables: Optional[Iterable[Union[TableSpec, dict]]] = None,
    world_size: Optional[int] = None,
    memory_per_rank: Union[int, str, None] = None,
    hosts: Optional[int] = None,
    ranks_per_host: Optional[int] = None,
    device: str = "cpu",
    memory_bandwidth: Optional[float] = None,
    intra_host_bandwidth: Optional[float] = None,
    inter_host_bandwidth: Optional[float] = None,
    topology: Optional[Topology] = None,
    batch_size: Optional[int] = None,
    pooling_factors: Optional[Dict[str, float]] = None,
    optimizer=None,
    pins: Optional[Dict[str, Any]] = None,
    sharding_types: Optional[Sequence[str]] = None,
    weights_precision=None,
    hbm_budget: Union[int, str, None] = None,
    cache_load_factor: float = 0.2,
    uvm_bandwidth: Optional[float] = None,
    quantize=None,
    logger: Optional[logging.Logger] = None,
) -> ShardingPlan:
    """Decide how to shard every embedding table over ``world_size`` ranks.

    Either ``model`` and ``example_inputs`` (the tables are found as :func:`fxrec.transform`
    finds them; ids per sample are measured on the example inputs), or ``tables``: a list of
    :class:`TableSpec` (or dicts of its fields) - no model needed, so thousands of tables can
    be planned in well under a second.

    Args:
      world_size: number of ranks (>= 1).
      memory_per_rank: bytes per rank for embedding weights and optimizer state: an int, or a
        string: ``"16GB"`` = 16 * 10**9 bytes, ``"16GiB"`` = 16 * 2**30 bytes (also B, KB, MB,
        TB, KiB, MiB, TiB). Required, except with ``device="cuda"`` on a machine with CUDA,
        where the device's total memory is read (and the plan says so; pass less to leave room
        for activations and dense parameters).
      hosts / ranks_per_host: ranks are grouped into hosts of equal size, rank r on host
        ``r // ranks_per_host`` (default: one host). Table-row-wise needs several hosts.
      device: ``"cpu"`` or ``"cuda"``: which default bandwidths apply.
      memory_bandwidth, intra_host_bandwidth, inter_host_bandwidth: GB/s (10**9 bytes/s) of
        embedding row reads on a rank, of one rank to the other ranks of its host, and of one
        rank to other hosts. Those not given are defaults for the device (on CUDA, the memory
        bandwidth is computed from the device's memory clock and bus width when torch reports
        them), and the printed plan lists every assumed figure.
      topology: a ready :class:`Topology` instead of the arguments above.
      batch_size: samples per rank per step (default: the example inputs' batch with a model,
        else 512; the plan notes which).
      pooling_factors: average ids per sample, by table name (or, with a model, by feature
        name); overrides what the example inputs or the specs say.
      optimizer: the optimizer you will give ``transform``; it sizes the optimizer state: None /
        "none", "sgd" (0 bytes), "sgd_momentum" (rows*dim*4), "adagrad" (rows*dim*4),
        "rowwise_adagrad" (rows*4), "adam" (torch.optim.Adam: 2*rows*dim*4), "lazy_adam", "lamb"
        (2*rows*dim*4), "partial_rowwise_adam", "partial_rowwise_lamb" (rows*dim*4 + rows*4),
        "lars_sgd" (rows*dim*4), an :mod:`fxrec.optim` optimizer, or a dict from table name / glob
        to one of these. A TableSpec's own ``optimizer`` wins. SGD and the Adagrads (and on a
        ``device="cuda"`` topology the lazy Adam / LAMB kinds and LARS-SGD) are fused into
        backward on sharded tables: no
        gradient; with the others, and on data-parallel tables, a dense gradient of the shard is
        counted.
      pins: ``{table: "row_wise"}`` fixes a table's sharding type; ``{table: ("table_wise", 3)}``
        or ``{table: {"sharding": "column_wise", "ranks": [0, 5]}}`` also its ranks.
      sharding_types: the types the planner may choose (default: all of
        ``table_wise, row_wise, column_wise, table_row_wise, data_parallel``); pins may use any.
      weights_precision: what you will give ``transform(weights_precision=...)``: ``"fp16"``
        (or ``"bf16"``), or a dict from table name / parameter name / glob to ``"fp32"``,
        ``"fp16"``, ``"bf16"``. The fp32 tables it names count 2 bytes a stored value where they
        are sharded (a data-parallel table stays fp32). A TableSpec's own ``weights`` wins.
      hbm_budget: with ``device="cuda"``: the GPU memory (bytes, or a string as for
        ``memory_per_rank``) of each rank for its tables. ``memory_per_rank`` (then required) is
        what a rank holds in all, GPU and host memory together; on each rank, the shards beyond
        the budget go to unified memory with an HBM cache of ``cache_load_factor`` of their rows,
        by the rule ``transform(hbm_budget=)`` applies (only shards with an optimizer fused into
        fbgemm's backward may move; served quantized, packed shards, cached or, where the budget is
        not met so, uncached), and their est. cost counts the reads that miss the cache at
        ``uvm_bandwidth`` GB/s (default 50, noted as assumed). A rank whose tables cannot meet
        the budget is a PlanError naming it. ``transform(plan=plan)`` takes the plan's budget and
        cache_load_factor unless it is given its own.
      quantize: a plan for serving: what you will give ``transform(mode="inference",
        quantize=...)`` (``"int8"``, ``"int4"``, ``"int2"``, ``"fp16"``, ``"fp32"``, ``"auto"``, or a
        dict from table name / parameter name / glob to one of them), decided per table by
        transform's rule. Sharded shards are sized as fbgemm's IntNBit kernel packs their rows for
        ``device`` (scale and bias included, 16-byte rows on CUDA), with no optimizer state or
        gradient, and costed as a forward; quantized tables are not data-parallel (a replica keeps
        the model's own lookups: give such a table ``"fp32"``) and integer-quantized ones not
        column-wise. ``transform`` refuses such a plan for training, or with another ``quantize=``.
        Not with ``optimizer=`` or ``weights_precision=``.

    Returns:
      a :class:`ShardingPlan`; ``print`` it to read it, ``.save(path)`` to keep it.

    Raises:
      PlanError (a ValueError) when the tables do not fit, naming the table, the bytes it needs,
      the most free memory it could get and how much is missing; ValueError for bad arguments
      (an unknown table or sharding type in ``pins``, world_size < 1, an unreadable size).
    """
    log = logger or logging.getLogger("fxrec")
    notes: List[str] = []
    if (model is None) == (tables is None):
        raise ValueError("fxrec.plan: pass either a model with example_inputs, or tables=[...], not both or neither")
    if model is not None and example_inputs is None:
        raise ValueError("fxrec.plan: a model needs example_inputs (one batch) so its tables can be found")

    topo = _topology(topology, world_size, memory_per_rank, hosts, ranks_per_host, device,
                     memory_bandwidth, intra_host_bandwidth, inter_host_bandwidth,
                     dict(hbm_budget=hbm_budget, cache_load_factor=cache_load_factor, uvm_bandwidth=uvm_bandwidth))
    factors = dict(pooling_factors or {})
    for k, v in factors.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"fxrec.plan: pooling_factors[{k!r}] must be a number >= 0, got {v!r}")

    if model is not None:
        specs, example_batch, left = _specs_from_model(model, example_inputs, example_kwargs, factors, notes, log,
                                                 lambda table, param: _kind_of(table, optimizer, param) != "none")
    else:
        specs, example_batch, left = _specs_from_list(tables, factors), None, {}

    if batch_size is None:
        if example_batch:
            batch_size = example_batch
            notes.append(f"batch_size {batch_size} per rank taken from the example inputs (pass batch_size=...)")
        else:
            batch_size = DEFAULT_BATCH_SIZE
            notes.append(f"batch_size {batch_size} per rank assumed (pass batch_size=...)")

    specs = _quantized(specs, quantize, dict(optimizer=optimizer, weights_precision=weights_precision))
    specs = _precisions(specs, weights_precision)
    kinds, label = _optimizers(specs, optimizer)
    if isinstance(sharding_types, str):
        raise ValueError(f"fxrec.plan: sharding_types must be a list of sharding types, got the string "
                         f"{sharding_types!r} (write [{sharding_types!r}])")
    allowed = list(SHARDING_TYPES) if sharding_types is None else list(sharding_types)
    bad = [s for s in allowed if s not in SHARDING_TYPES]
    if bad or not allowed:
        raise ValueError(f"fxrec.plan: sharding_types {bad or allowed!r}: use some of {list(SHARDING_TYPES)}")
    by_name = {s.name: s for s in specs}
    pinned = normalize_pins(pins, [s.name for s in specs], topo, by_name, left)
    placed = search(specs, topo, batch_size, kinds, pinned, allowed)
    result = ShardingPlan(topology=topo, tables=placed, batch_size=batch_size, optimizer=label, notes=tuple(notes))
    log.info("plan: %d tables on %d ranks, est. max %.4g ms per step, balance %.3f",
             len(placed), topo.world_size, max(result.rank_cost_ms()), result.balance)
    return result


def _topology(topology, world_size, memory_per_rank, hosts, ranks_per_host, device, memory_bw, intra_bw, inter_bw,
              unified):
    if topology is not None:
        given = [n for n, v in (("world_size", world_size), ("memory_per_rank", memory_per_rank), ("hosts", hosts),
                                ("ranks_per_host", ranks_per_host), ("memory_bandwidth", memory_bw),
                                ("intra_host_bandwidth", intra_bw), ("inter_host_bandwidth", inter_bw),
                                ("hbm_budget", unified["hbm_budget"]), ("uvm_bandwidth", unified["uvm_bandwidth"]))
                 if v is not None] + (["cache_load_factor"] if unified["cache_load_factor"] != 0.2 else [])
        if given:
            raise ValueError(f"fxrec.plan: pass either topology= or {given}, not both")
        if not isinstance(topology, Topology):
            raise ValueError(f"fxrec.plan: topology must be an fxrec.Topology, got {type(topology).__name__}")
        return topology
    if world_size is None:
        raise ValueError("fxrec.plan: world_size is required (number of ranks)")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"fxrec.plan: world_size must be an int >= 1, got {world_size!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"fxrec.plan: device must be 'cpu' or 'cuda', got {device!r}")
    if hosts is not None:
        if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 1 or world_size % hosts:
            raise ValueError(f"fxrec.plan: hosts must divide world_size {world_size}, got {hosts!r}")
        if ranks_per_host is not None and ranks_per_host * hosts != world_size:
            raise ValueError(f"fxrec.plan: hosts={hosts} x ranks_per_host={ranks_per_host} != world_size {world_size}")
        ranks_per_host = world_size // hosts
    if unified["hbm_budget"] is not None and memory_per_rank is None:
        raise ValueError("fxrec.plan: with hbm_budget=, memory_per_rank is what a rank holds in all (GPU and host "
                         "memory together): pass it")
    assumed = []
    if device == "cuda" and (memory_per_rank is None or memory_bw is None):
        mem, bw, notes = _cuda_figures()
        if memory_per_rank is None and mem is not None:
            memory_per_rank = mem
            assumed.append(notes["memory"])
        if memory_bw is None and bw is not None:
            memory_bw = bw
            assumed.append(notes["bandwidth"])
    return Topology(world_size=world_size, memory_per_rank=memory_per_rank, ranks_per_host=ranks_per_host,
                    device=device, memory_bandwidth=memory_bw, intra_host_bandwidth=intra_bw,
                    inter_host_bandwidth=inter_bw, assumed=tuple(assumed), **unified)


def _cuda_figures():
    """(total memory in bytes, peak memory bandwidth in GB/s, notes) of the current CUDA device,
    None where it cannot be read (no CUDA, or a torch that does not report the figure)."""
    import torch

    if not torch.cuda.is_available():
        return None, None, {}
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    mem = int(props.total_memory)
    notes = {"memory": f"memory_per_rank {format_bytes(mem)}: all of {props.name}'s memory "
                       f"(torch.cuda.get_device_properties); pass less to leave room for activations"}
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    bw = None
    if clock_khz and bus_bits:
        bw = 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate
        notes["bandwidth"] = (f"memory_bandwidth {bw:.0f} GB/s: peak of {props.name} from its memory clock and bus "
                              f"width (random row reads reach less)")
    return mem, bw, notes


def _specs_from_list(tables, factors) -> List[TableSpec]:
    specs = []
    for t in tables:
        if isinstance(t, TableSpec):
            specs.append(t)
        elif isinstance(t, dict):
            specs.append(TableSpec.from_dict(t))
        else:
            raise ValueError(f"fxrec.plan: tables must be TableSpec or dicts of its fields, got {type(t).__name__}")
    _check_unique(specs)
    names = {s.name for s in specs}
    unknown = [k for k in factors if k not in names]
    if unknown:
        raise ValueError(f"fxrec.plan: pooling_factors names unknown tables {unknown}")
    return [replace(s, pooling_factor=float(factors[s.name])) if s.name in factors else s for s in specs]


def _check_unique(specs: Sequence[TableSpec]) -> None:
    seen = set()
    for s in specs:
        if s.name in seen:
            raise ValueError(f"fxrec.plan: two tables are named {s.name!r}")
        seen.add(s.name)


def _specs_from_model(model, example_inputs, example_kwargs, factors, notes, log, optimized):
    from .detect import find_tables

    found, detect_notes, example_batch, left = find_tables(model, example_inputs, example_kwargs, log, optimized)
    notes.extend(detect_notes)
    features = {f for t in found for f, _, _ in t.lookups}
    names = {t.name for t in found}
    unknown = [k for k in factors if k not in names and k not in features]
    if unknown:
        raise ValueError(f"fxrec.plan: pooling_factors names {unknown}, which are neither tables {sorted(names)} "
                         f"nor features {sorted(features)} of the model")
    specs = []
    unmeasured = []
    for t in found:
        total = 0.0
        for feature, per_sample, _ in t.lookups:
            if feature in factors:
                total += float(factors[feature])
            elif per_sample is not None:
                total += per_sample
            else:
                total += 1.0
                unmeasured.append(feature)
        if t.name in factors:
            total = float(factors[t.name])
        pooled = all(p for _, _, p in t.lookups)
        specs.append(TableSpec(name=t.name, num_rows=t.num_rows, dim=t.dim, pooling_factor=total,
                               num_features=len(t.lookups), pooled=pooled, dtype=t.dtype, param=t.param,
                               data_parallel_only=t.data_parallel_only))
    if unmeasured:
        notes.append(f"ids per sample of features {unmeasured} could not be read from the example inputs: 1.0 assumed")
    if found:
        notes.append("ids per sample measured on the example inputs: " + ", ".join(
            f"{s.name} {s.pooling_factor:.3g}" for s in specs[:8]) + (" ..." if len(specs) > 8 else "")
            + " (pass pooling_factors=... for representative figures)")
    return specs, example_batch, left


def _precisions(specs: List[TableSpec], spec) -> List[TableSpec]:
    """The specs with ``weights`` set as ``weights_precision=`` asks (fp32 tables only)."""
    if spec is None:
        return specs
    choices = ("fp32", "fp16", "bf16")
    values = [spec] if isinstance(spec, str) else list(spec.values()) if isinstance(spec, dict) else None
    if values is None or any(v not in choices for v in values):
        raise ValueError(f"fxrec.plan: weights_precision must be one of {choices} or a dict of them, got {spec!r}")

    if isinstance(spec, dict):
        check_keys(spec, [(s.name, s.param) for s in specs], "fxrec.plan: weights_precision")
    out = []
    for s in specs:
        key = None if isinstance(spec, str) else deciding_key(spec, s.name, s.param)
        want = spec if isinstance(spec, str) else "fp32" if key is None else spec[key]
        out.append(replace(s, weights=want) if want != "fp32" and s.dtype == "fp32" and not s.weights else s)
    return out


def _quantized(specs: List[TableSpec], quantize, training: dict) -> List[TableSpec]:
    """The specs with ``quantize`` set as ``quantize=`` asks, by transform's rule (quantize_tables'
    dtype_for; a TableSpec's own ``quantize`` wins). A plan for serving (every table's quantize set)
    takes none of ``training``'s arguments."""
    if quantize is not None:
        from ..passes.quantize_tables import check_quantize, dtype_for

        check_quantize(quantize, "fxrec.plan")
        if isinstance(quantize, dict):
            check_keys(quantize, [(s.name, s.param) for s in specs], "fxrec.plan: quantize")  # (as transform's)
        specs = [s if s.quantize else
                 replace(s, quantize=dtype_for(quantize, s.name, s.param, s.num_rows, s.dim, s.dtype == "fp16"))
                 for s in specs]
    some = [s.name for s in specs if s.quantize]
    if some and len(some) != len(specs):
        raise ValueError(f"fxrec.plan: tables {some[:4]} have quantize and "
                         f"{[s.name for s in specs if not s.quantize][:4]} do not: a plan is for serving "
                         "(every table's quantize given) or for training (none)")
    given = [k for k, v in training.items() if v is not None]
    if some and given:
        raise ValueError(f"fxrec.plan: quantize makes a plan for serving, and {', '.join(k + '=' for k in given)} "
                         f"{'is' if len(given) == 1 else 'are'} for training")
    return specs


def _kind_of(table: str, optimizer, param: Optional[str] = None) -> str:
    """The optimizer kind ``optimizer`` (plan's ``optimizer=``) gives ``table`` (of parameter
    ``param``): in a dict, the first key that names it ("none" for none)."""
    if not isinstance(optimizer, dict):
        return optimizer_kind(optimizer)
    key = deciding_key(optimizer, table, param)
    return "none" if key is None else optimizer_kind(optimizer[key])


def _optimizers(specs: Sequence[TableSpec], optimizer):
    """Per-table optimizer kinds, and the plan's label for them."""
    if isinstance(optimizer, dict):
        check_keys(optimizer, [(s.name, s.param) for s in specs], "fxrec.plan: optimizer")  # (as transform's)
        kinds = [_kind_of(s.name, optimizer, s.param) for s in specs]
        label = "per table"
    else:
        default = optimizer_kind(optimizer)
        kinds = [default] * len(specs)
        label = default
    kinds = [optimizer_kind(s.optimizer) if s.optimizer is not None else k for s, k in zip(specs, kinds)]
    if len(set(kinds)) > 1:
        label = "per table"
    return kinds, label
