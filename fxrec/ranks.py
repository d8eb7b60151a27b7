"""transform(plan=...) on each rank: what every rank checks before the passes run, and the steps
that bind the ranks together (one refusal stops all, the dense gradients summed over ranks), with
the report's per-rank notes. The passes that rewrite the graph for a plan are shard_groups and
place_tables; the collectives they insert are in fxrec.runtime.collectives."""

from __future__ import annotations

import contextlib

import torch
import torch.fx as fx

from .dataflow import carries_gradient
from .pass_infra import InputError


def check_plan(plan) -> int:
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


def check_rank_device(model, args, kwargs) -> None:
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


def exchange_device(args) -> torch.device:
    """Where transform's exchanges between ranks run: the host under gloo; under NCCL (CUDA tensors
    only) this rank's current GPU, the one its process group uses (not the example's, which may be
    the wrong one: check_rank_device names that, and the exchange must still pair up)."""
    import torch.distributed as dist

    if str(dist.get_backend()) != "nccl":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _setting(value) -> str:
    """A setting as the ranks compare it: its repr, with a dict's entries in key order where the
    order cannot matter (no glob pattern among its keys: first match wins only among patterns), so
    that the same dict built in another order on another rank (from a set) compares equal."""
    if isinstance(value, dict) and not any(isinstance(k, str) and any(c in k for c in "*?[") for k in value):
        return repr(sorted(value.items(), key=lambda kv: repr(kv[0])))
    return repr(value)


@contextlib.contextmanager
def together(plan, args, where: str):
    """Run the block on every rank as one: with a plan, a failure in it on one rank is one on every
    rank. A check or a capture that fails on one rank only (its local example, its own arguments),
    or a refusal that depends on what a rank holds (a table's shards), raises there, and the other
    ranks would wait for it in the next collective until the process group's timeout. One exchange
    of a flag after the block: the failing rank raises its own error, the others an InputError
    saying which rank failed. Without a plan (or a process group) the block just runs."""
    import torch.distributed as dist

    from .runtime.collectives import all_gather_ints

    if plan is None or not (dist.is_available() and dist.is_initialized()):
        yield
        return
    error = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - any failure on one rank stops them all
        error = e
    every = all_gather_ints([0 if error is None else 1], exchange_device(args), where)
    if error is not None:
        raise error
    failed = [r for r, (flag,) in enumerate(every) if flag]
    if failed:
        raise InputError(f"fxrec: transform failed on rank(s) {failed} (their error says why); this rank stops with them")


def check_same_setup(plan, settings: dict, model: list, device: torch.device) -> None:
    """Every rank must run the same plan with the same transform settings and the same model (the
    collectives of their graphs pair up across ranks): a plan made on each rank from its own local
    batch can place a table differently, and a rank transformed for inference, with another
    optimizer or ``max_gradient``, or from another model, builds other collectives or steps its
    tables otherwise (gloo aborts the process; NCCL hangs). One exchange of a digest of the plan's
    layout, of ``settings`` (name -> value) and of ``model`` (its parameters' and buffers' names,
    shapes and dtypes); on a mismatch, an error on every rank naming a table, setting or parameter
    the ranks disagree on."""
    import hashlib

    import torch.distributed as dist

    from .runtime.collectives import all_gather_ints

    layout = sorted((t, tp.sharding, tp.spec.num_rows, tp.spec.dim, tp.spec.weights,
                     tuple((sh.rank, sh.row_offset, sh.num_rows, sh.col_offset, sh.num_cols) for sh in tp.shards))
                    for t, tp in plan.tables.items())
    said_settings = sorted((k, _setting(v)) for k, v in settings.items())
    digest = hashlib.sha256(repr((layout, said_settings, model)).encode()).digest()
    mine = [int.from_bytes(digest[k:k + 8], "little", signed=True) for k in (0, 8)]
    every = all_gather_ints(mine, device, "fxrec.transform (the plan and settings)")
    if all(row == every[0] for row in every):
        return
    gathered = [None] * len(every)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():  # (NCCL: this rank's GPU)
        dist.all_gather_object(gathered, (layout, said_settings, model))
    r = next(r for r, row in enumerate(every) if row != every[0])
    (lay0, set0, model0), (lay_r, set_r, model_r) = gathered[0], gathered[r]
    if model0 != model_r:
        names0, names_r = dict((e[0], e[1:]) for e in model0), dict((e[0], e[1:]) for e in model_r)
        n = next(n for n in sorted(set(names0) | set(names_r)) if names0.get(n) != names_r.get(n))

        def held(e):
            return "has none" if e is None else f"has it {list(e[0])} {e[1].replace('torch.', '')}"

        raise ValueError(f"fxrec: the ranks transformed different models: of '{n}', rank 0 {held(names0.get(n))} and "
                         f"rank {r} {held(names_r.get(n))}. Every rank must transform the same model")
    if set0 != set_r:
        first, other = dict(set0), dict(set_r)
        k = next(k for k in sorted(set(first) | set(other)) if first.get(k) != other.get(k))
        raise ValueError(f"fxrec: the ranks called transform differently: {k} is {first.get(k)} on rank 0 and "
                         f"{other.get(k)} on rank {r}. Every rank must transform the same model with the same "
                         "arguments (only the example inputs, each rank's local batch, differ)")
    first, other = ({d[0]: d for d in lay} for lay in (lay0, lay_r))
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


#: ``transform(plan=..., dense=...)``: how the parameters that are not table shards are kept over ranks
DENSE = ("ddp", "fsdp")
#: ``transform(dense="fsdp", fsdp_units=...)`` besides a list of submodule names: "one", the whole model
#: one FSDP unit; "every", every submodule that can be a unit (fxrec.passes.outline_dense_units)
FSDP_UNITS = ("one", "every")


def check_dense(dense, plan, mode: str, fsdp_units=None) -> None:
    if dense not in DENSE:
        raise ValueError(f"fxrec: dense must be one of {DENSE}, got {dense!r}")
    if dense == "fsdp" and plan is None:
        raise ValueError("fxrec: dense='fsdp' shards the model's other parameters over the ranks of a sharding plan; "
                         "without plan= the model is not sharded: wrap the transformed model in "
                         "torch.distributed.fsdp.fully_shard yourself, leaving its tables out (ignored_params)")
    if dense == "fsdp" and mode != "training":
        raise ValueError("fxrec: dense='fsdp' shards the parameters trained over ranks; mode='inference' keeps "
                         "them whole on every rank (leave dense='ddp')")
    if fsdp_units is None:
        return
    if dense != "fsdp":
        raise ValueError(f"fxrec: fsdp_units= chooses the FSDP units of dense='fsdp'; dense is {dense!r}")
    if isinstance(fsdp_units, str):
        if fsdp_units not in FSDP_UNITS:
            raise ValueError(f"fxrec: fsdp_units must be None (the rule), one of {FSDP_UNITS} or a list of "
                             f"submodule names, got {fsdp_units!r}")
        return
    if not isinstance(fsdp_units, (list, tuple)) or not all(isinstance(u, str) for u in fsdp_units):
        raise ValueError(f"fxrec: fsdp_units must be None (the rule), one of {FSDP_UNITS} or a list of submodule "
                         f"names (strings, as model.named_modules() gives them), got {fsdp_units!r}")
    twice = sorted({u for u in fsdp_units if list(fsdp_units).count(u) > 1})
    if twice:
        raise ValueError(f"fxrec: fsdp_units names {twice[0]!r} twice")


def sum_gradients_over_ranks(gm: fx.GraphModule, records, dense: str = "ddp", fsdp_units=None) -> None:
    """Every parameter that is not a table shard is whole on every rank: sum its gradient. DDP
    (``replicate_whole``) does it for all of them but the tables with sparse gradients, which DDP's
    communication hooks cannot take: those keep a hook each, which sums them sparse (``sparse_sum``).
    ``dense="fsdp"``: FSDP (``shard_whole``) shards the parameters that are not embedding tables
    over the ranks instead, each dense submodule ``outline_dense_units`` gives back its call a unit
    of its own; the data-parallel tables stay whole, each with a hook that sums its gradient (their
    optimizers, fxrec's row-wise fallbacks among them, step whole rows), and so do 0-dim parameters,
    which FSDP refuses. ``fsdp_units``: which units (None: the rule; see ``outline_dense_units``)."""
    from .passes.outline_dense_units import outline_dense_units
    from .runtime.collectives import all_reduce_grad, replicate_whole, shard_whole

    sharded = gm.meta.get("fxrec_sharded_params", {})
    params = dict(gm.named_parameters())
    sparse = {r.param for r in records if r.sparse and r.param in params and r.param not in sharded}
    hooked = sparse
    if dense == "fsdp":
        tables = {r.param for r in records if r.param in params and r.param not in sharded}
        # FSDP refuses 0-dim parameters (a learned scale): they stay whole, summed by a hook like the tables
        scalars = {n for n, p in params.items() if p.dim() == 0 and n not in sharded and n not in tables}
        units = outline_dense_units(gm, set(sharded) | tables, fsdp_units)
        gm.meta["fxrec_fsdp_units"] = units
        gm.meta["fxrec_fsdp_params"] = shard_whole(gm, set(sharded) | tables, units, sorted(scalars))  # (clip_grad reads it)
        hooked = tables | scalars
    else:
        # a parameter no gradient reaches (export keeps unread ones; one read only under torch.no_grad()
        # or through .detach()) makes DDP wait for it unless told (the second step raised)
        used = {n.target for n in gm.graph.nodes if n.op == "get_attr" and carries_gradient(n)}
        unused = any(p.requires_grad and n not in used for n, p in params.items() if n not in sharded)
        replicate_whole(gm, set(sharded) | sparse, unused)
    for name in sorted(hooked):
        if params[name].requires_grad:
            params[name].register_hook(all_reduce_grad(name))


def units_note(units, fsdp_units=None) -> str:
    """The report's line on the FSDP units of ``transform(plan=, dense="fsdp", fsdp_units=)``."""
    if not units:
        why = (f"fsdp_units={fsdp_units!r}" if fsdp_units == "one" or isinstance(fsdp_units, (list, tuple)) else
               "no submodule can be a unit; docs/sharding.md says when one can" if fsdp_units == "every" else
               "no submodule can be a unit, or the units would not halve the dense bytes whole at once; "
               "docs/sharding.md says when they can, and fsdp_units= chooses them")
        return f"FSDP: the whole model is one unit ({why}): its dense parameters are whole on every rank for each step"
    how = {None: "by rule", "every": "every submodule that can be one"}.get(
        fsdp_units if isinstance(fsdp_units, (str, type(None))) else "", "as fsdp_units names them")
    return (f"FSDP units ({how}): {', '.join(units)} (each gathered whole for its own call in forward and again in "
            "backward, and freed after); the other dense parameters are the model's own unit, whole for the step")


def plan_per_rank(plan) -> list:
    """The report's per-rank figures of a plan: its bytes and estimated cost on each rank."""
    return [{"rank": r, "bytes": int(b), "est_cost_ms": float(c)}
            for r, (b, c) in enumerate(zip(plan.rank_bytes(), plan.rank_cost_ms()))]


def rank_note(plan, rank: int, dense: str = "ddp") -> str:
    def piece(s) -> str:  # (first..last, as the id errors give a table's rows)
        tp = plan.tables[s.table]
        cols = f", columns {s.col_offset}..{s.col_offset + s.num_cols - 1}" if s.num_cols != tp.spec.dim else ""
        return f"{s.table} ({tp.sharding}, rows {s.row_offset}..{s.row_offset + s.num_rows - 1}{cols})"

    mine = [piece(s) for s in plan.shards_on(rank) if plan.tables[s.table].sharding != "data_parallel" and s.num_rows]
    return (f"rank {rank} of {plan.topology.world_size}: holds {', '.join(mine) or 'no table shards'}; "
            + ("the parameters that are not tables are sharded over the ranks by FSDP (this rank holds a dim-0 "
               "chunk of each, gathered for the forward and backward); the gradients of every parameter but the "
               "table shards are summed over ranks in backward"
               if dense == "fsdp" else "the gradients of every other parameter are summed over ranks in backward"))
