"""Collectives on torch.distributed with autograd, as the sharded graph calls them.

Plain functions: ``all_to_all`` (variable splits; its backward is the all-to-all back),
``all_to_all_together`` (several tensors, any dtypes, in one all-to-all; no gradient),
``replicate_whole`` (DDP's reducer for the parameters whole on every rank, summing: :class:`ExactSums`) and
``all_reduce_grad`` (a gradient hook that sums one parameter's sparse gradient over ranks, sparse). They run on
whatever process group is initialised (gloo on CPU; written for NCCL on CUDA, not yet run there). A collective that fails —
usually because another rank did not arrive within the process group's timeout — raises
:class:`CollectiveError` naming the collective, the graph step that called it and this rank.
These functions know nothing of graphs or passes.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from .device_ints import ints_on


# torch 2.13 renamed it (the old name warns); torch 2.11 has only the old one
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CollectiveError(RuntimeError):
    """A collective failed on this rank (another rank did not arrive, or the group broke)."""


def _fail(what: str, where: str, e: BaseException) -> CollectiveError:
    rank = dist.get_rank() if dist.is_initialized() else -1
    return CollectiveError(
        f"fxrec: {what} in {where} failed on rank {rank}: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}. "
        "Usually another rank did not reach the same step (it failed earlier or is still running) "
        "within the process group's timeout (init_process_group(timeout=...))."
    )


def _a2a(x: torch.Tensor, out_splits: List[int], in_splits: List[int], where: str) -> torch.Tensor:
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    try:
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
    except Exception as e:  # noqa: BLE001 - re-raised with the step named
        raise _fail("all_to_all", where, e) from e
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, where):
        ctx.splits = (out_splits, in_splits, where)
        return _a2a(x, out_splits, in_splits, where)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, where = ctx.splits
        return _a2a(grad, in_splits, out_splits, where + " (backward)"), None, None, None


def all_to_all(x: torch.Tensor, out_splits: List[int], in_splits: List[int], where: str = "") -> torch.Tensor:
    """Rows ``in_splits[r]`` of ``x`` go to rank r; returns the rows received (``out_splits[r]``
    from rank r), in rank order. Differentiable."""
    if x.requires_grad and torch.is_grad_enabled():
        return _AllToAll.apply(x, list(out_splits), list(in_splits), where)
    return _a2a(x, list(out_splits), list(in_splits), where)


def all_to_all_together(tensors: List[torch.Tensor], out_splits: List[List[int]], in_splits: List[List[int]],
                        where: str = "") -> List[torch.Tensor]:
    """Several 1-D tensors exchanged by one all-to-all: ``in_splits[t][r]`` elements of
    ``tensors[t]`` go to rank r; returns, per tensor, what arrived (``out_splits[t][r]`` from rank
    r, in rank order), in its own dtype. Each collective costs a rank a wait for the others
    (about half a millisecond on gloo at world size 2, ``benchmarks/bench_collectives.py``), so
    the ids, lengths and weights of an input dist travel together, as bytes. Not differentiable
    (ids and counts)."""
    world = len(in_splits[0])
    nbytes = [t.element_size() for t in tensors]
    pieces = [torch.split(t.contiguous().view(torch.uint8), [n * b for n in splits])
              for t, splits, b in zip(tensors, in_splits, nbytes)]
    send = torch.cat([p[r] for r in range(world) for p in pieces])
    recv_splits = [sum(out_splits[k][r] * nbytes[k] for k in range(len(tensors))) for r in range(world)]
    got = _a2a(send, recv_splits, [sum(in_splits[k][r] * nbytes[k] for k in range(len(tensors))) for r in range(world)],
               where)
    chunks = torch.split(got, [out_splits[k][r] * nbytes[k] for r in range(world) for k in range(len(tensors))])
    return [torch.cat([chunks[r * len(tensors) + k] for r in range(world)]).view(t.dtype)  # (a copy: aligned)
            for k, t in enumerate(tensors)]


def check_rank_device(backend: str, current: Optional[int], local_rank: Optional[int], tables, inputs) -> None:
    """Under NCCL a rank's collectives run on its current CUDA device and take CUDA tensors only:
    an error saying what to do where ``tables`` (the devices of the model's tensors) or ``inputs``
    (the example's) are elsewhere, or where the current device is not the rank's ``LOCAL_RANK``
    (torch.cuda.set_device was not called: every rank of a host would run on cuda:0, which NCCL
    refuses or hangs on). Other backends: nothing."""
    if backend != "nccl":
        return
    todo = ("call torch.cuda.set_device(local_rank) before dist.init_process_group (or pass it device_id=), "
            "and build the model and its inputs on that device")
    if local_rank is not None and current is not None and current != local_rank:
        raise ValueError(f"fxrec: this rank (LOCAL_RANK={local_rank}) has cuda:{current} as its current CUDA device, "
                         f"on which NCCL runs its collectives: {todo}")
    for what, devices in (("the model's tensors", tables), ("the example inputs", inputs)):
        other = sorted({str(d) for d in devices if d.type != "cuda" or (d.index is not None and d.index != current)})
        if other:
            raise ValueError(f"fxrec: {what} are on {other}, and NCCL exchanges tensors on this rank's current CUDA "
                             f"device, cuda:{current}: {todo}")


def usable_device(device: torch.device) -> torch.device:
    """``device`` where the process group can exchange on it; else the one it can (the host under
    gloo, the current GPU under NCCL): a rank fed inputs on a device it cannot use still joins."""
    nccl = dist.is_initialized() and str(dist.get_backend()) == "nccl"
    if device.type == "meta" or (nccl and device.type != "cuda"):
        return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    return device


def all_gather_ints(values, device: torch.device, where: str = "") -> List[List[int]]:
    """Every rank's ints (as many on every rank), exchanged on ``device``: the device of the
    tensors they describe (NCCL takes only CUDA tensors; gloo either). ``values``: a list of
    host ints, or an int64 tensor already on ``device`` (its values are then read only once, as
    the exchanged result: one wait for the device)."""
    t = values.reshape(-1) if isinstance(values, torch.Tensor) else ints_on(values, device)
    out = t.new_empty(dist.get_world_size() * t.numel())
    try:
        _all_gather_single(out, t)
    except Exception as e:  # noqa: BLE001
        raise _fail("all_gather", where, e) from e
    return out.view(dist.get_world_size(), t.numel()).tolist()


def all_reduce_grad(name: str):
    """A gradient hook summing the gradient over ranks (data-parallel parameters); a sparse one
    stays sparse (:func:`sparse_sum`)."""

    def hook(grad: torch.Tensor) -> Optional[torch.Tensor]:
        where = f"the gradient of '{name}'"
        if grad.is_sparse:
            return sparse_sum(grad, where)
        g = grad.clone()
        try:
            dist.all_reduce(g)
        except Exception as e:  # noqa: BLE001
            raise _fail("all_reduce", where, e) from e
        return g

    return hook


def sparse_sum(grad: torch.Tensor, where: str) -> torch.Tensor:
    """A sparse gradient summed over ranks, sparse: every rank's rows and their values gathered
    (after one exchange of how many, which the host reads: the gathered tensors' sizes), then
    coalesced, which sums a row several ranks hold. Not ``all_reduce``: NCCL has no sparse one, and
    a dense sum would be a table-sized gradient that ``torch.optim.SparseAdam`` refuses; the
    same code on gloo and NCCL."""
    g = grad.coalesce()
    idx, vals = g.indices(), g.values()
    n = idx.shape[1]
    counts = [c[0] for c in all_gather_ints([n], idx.device, where + " (row counts)")]
    most, world = max(counts), len(counts)
    if most == 0:  # (no rank holds a row: nothing to gather)
        return g
    idx_pad = idx.new_zeros(idx.shape[0], most)
    idx_pad[:, :n] = idx
    val_pad = vals.new_zeros((most,) + tuple(vals.shape[1:]))
    val_pad[:n] = vals
    idx_all = idx_pad.new_empty(world * idx_pad.numel())
    val_all = val_pad.new_empty(world * val_pad.numel())
    try:
        _all_gather_single(idx_all, idx_pad.reshape(-1))
        _all_gather_single(val_all, val_pad.reshape(-1))
    except Exception as e:  # noqa: BLE001
        raise _fail("all_gather", where, e) from e
    idx_all = idx_all.view(world, idx.shape[0], most)
    val_all = val_all.view((world, most) + tuple(vals.shape[1:]))
    rows = torch.cat([idx_all[r, :, :c] for r, c in enumerate(counts)], 1)
    values = torch.cat([val_all[r, :c] for r, c in enumerate(counts)])
    return torch.sparse_coo_tensor(rows, values, grad.shape).coalesce()


class ExactSums:
    """DDP's reduction of a module's whole parameters, summing, kept what one process computes
    when ``backward`` runs more than once per step. DDP all-reduces each parameter's ``.grad``
    as it stands after a backward, and only in the first backward after a forward that had
    gradients on and sync on:

    * gradient accumulation (forward and backward on several micro-batches, then one step): the
      ``.grad`` already holds the previous micro-batches' sum, the same on every rank, which a sum
      over ranks would count ``world`` times. Each parameter's gradient hook (before the
      accumulation) sets that sum aside and DDP sums this backward's gradients alone; the
      communication hook adds it back once the bucket is summed. A parameter unused here while
      DDP reduces its bucket (``find_unused_parameters``) has its earlier sum in the bucket:
      the communication hook moves it out the same way.
    * a ``.grad`` accumulated with sync off (``set_requires_gradient_sync(False)``, DDP's
      ``no_sync``) is this rank's own: it is left in place, and DDP sums it with the new one.
    * a second backward through one forward (``retain_graph=True``): DDP reduces nothing, so the
      gradient hook sums it over ranks itself (one all-reduce a parameter, not overlapped).

    A forward without gradients (``no_grad``, eval) changes nothing: DDP's state is not reset by
    it either. One backward per forward, into ``.grad`` that are None, takes DDP's buckets as
    they are."""

    def __init__(self, module: torch.nn.Module, params: List[torch.Tensor]):
        self.reduces = False  # DDP reduces the next backward (the last forward had gradients and sync on)
        self.fired: set = set()  # ids of the parameters whose gradient hook ran since that forward
        self.local: set = set()  # ids of the parameters whose .grad holds this rank's own gradients
        self.before: dict = {}  # id -> (parameter, its .grad before this backward), set aside
        module.register_forward_pre_hook(self._forward)
        for p in params:
            p.register_hook(self._gradient_hook(p))

    def _forward(self, module, args):
        if not torch.is_grad_enabled():
            return
        for p, prev in self.before.values():  # (a backward DDP did not finish: put them back)
            p.grad = prev if p.grad is None else p.grad + prev
        self.before.clear()
        self.fired.clear()
        from torch.distributed._composable.replicate import replicate

        self.reduces = not getattr(replicate.state(module), "_no_sync", False)

    def _gradient_hook(self, p: torch.Tensor):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            key = id(p)
            if p.grad is None:
                self.local.discard(key)
            if not self.reduces:  # sync off: DDP leaves this rank's gradients in .grad
                self.local.add(key)
                return grad
            if key in self.fired:  # a second backward since the forward: DDP will not reduce it
                g = grad.clone()
                try:
                    dist.all_reduce(g)
                except Exception as e:  # noqa: BLE001
                    raise _fail("all_reduce", "a second backward through one forward", e) from e
                return g
            self.fired.add(key)
            if key in self.local:  # this rank's own sum: DDP sums it with the new gradient
                self.local.discard(key)
            elif p.grad is not None:  # the sum over ranks so far: DDP is to sum the new gradient alone
                self.before[key] = (p, p.grad)
                p.grad = None
            return grad

        return hook

    def comm_hook(self, bucket):
        """DDP communication hook: the bucket summed over ranks, each parameter's earlier sum
        added back (DDP's own hook averages; fxrec's sharded tables get summed gradients, so the
        dense parameters do too)."""
        params, grads = bucket.parameters(), bucket.gradients()
        for p, g in zip(params, grads):
            key = id(p)
            if key not in self.fired and p.grad is not None:  # unused here: its bucket slot holds .grad
                if key in self.local:
                    self.local.discard(key)  # (this rank's own: summed with the others')
                else:
                    self.before[key] = (p, p.grad.clone())
                    g.zero_()
        work = dist.all_reduce(bucket.buffer(), async_op=True)

        def add_back(fut):
            try:
                fut.value()
            except Exception as e:  # noqa: BLE001 - (DDP raises it in backward: named as fxrec's)
                raise _fail("all_reduce", "the dense parameters' gradients (DDP)", e) from e
            for p, g in zip(params, grads):
                kept = self.before.pop(id(p), None)
                if kept is not None:
                    prev = kept[1]
                    if prev.is_cuda:  # (used on this callback's stream: not freed before the add ran)
                        prev.record_stream(torch.cuda.current_stream(prev.device))
                    g.add_(prev)
            return fut.value()[0]

        return work.get_future().then(add_back)


def _exact_sums_hook(state: ExactSums, bucket):
    return state.comm_hook(bucket)


def shard_whole(module: torch.nn.Module, leave: set, units: Sequence[str] = (), whole: Sequence[str] = ()) -> List[str]:
    """Shard ``module``'s parameters other than ``leave`` (the embedding tables) over the ranks with FSDP (torch's ``fully_shard`` on the module itself, in place):
    each rank keeps dim-0 chunks of them (DTensors) and of their optimizer states; FSDP gathers
    them whole before the forward and backward and reduce-scatters their gradients, summed (a
    divide factor of 1: the single process's gradients, as DDP's hook sums). Rank 0's values are
    broadcast first, as DDP's set-up does (fully_shard keeps each rank's own chunk of its own
    copy), and so are the buffers but tables held as buffers (after that each rank keeps its own:
    FSDP does not broadcast them at every forward as DDP does), even where FSDP has nothing to shard. After a forward without
    gradients the parameters are sharded again (FSDP keeps the root's whole until a backward).
    ``units``: paths of submodules FSDP shards as units of their own (gathered for their call
    only, and freed after it), applied first; the rest is the module's own unit. ``whole``:
    parameters FSDP leaves whole (0-dim ones, which it refuses), broadcast from rank 0 too.
    Returns the names FSDP shards ([]: none, and FSDP is not applied)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    params = dict(module.named_parameters())
    kept = [n for n in params if n not in leave and n not in whole]
    buffers = [b for n, b in module.named_buffers() if n not in leave]  # (a table held as a buffer: its own)
    try:
        with torch.no_grad():
            for t in [params[n] for n in kept] + [params[n] for n in whole if n in params] + buffers:
                src = t.detach() if t.is_contiguous() else t.detach().contiguous()
                dist.broadcast(src, 0)
                if src.data_ptr() != t.data_ptr():
                    t.detach().copy_(src)
    except Exception as e:  # noqa: BLE001 - re-raised naming the step
        raise _fail("the broadcast of rank 0's parameters and buffers", "fxrec.transform", e) from e
    if not kept:
        return []
    device = params[kept[0]].device
    try:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        out = set(leave) | set(whole)
        sharded = [fully_shard(module.get_submodule(u), mesh=mesh,
                               ignored_params={params[n] for n in out if n in params and n.startswith(u + ".")})
                   for u in units]
        sharded.append(fully_shard(module, mesh=mesh, ignored_params={params[n] for n in out if n in params}))
    except Exception as e:  # noqa: BLE001 - re-raised naming the step
        raise _fail("FSDP's set-up (fully_shard of the parameters outside the tables)", "fxrec.transform", e) from e
    for m in sharded:  # (per unit: neither setting reaches a unit's submodules)
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM; nothing to divide)
    # FSDP keeps the root's parameters whole from its forward until the backward ends; a forward
    # with no backward to come (no_grad, evaluation) would leave them whole until the next one
    module.register_forward_hook(_reshard_without_gradients)
    return kept


def _reshard_without_gradients(module, args, output) -> None:
    if not torch.is_grad_enabled():
        module.reshard()


def replicate_whole(module: torch.nn.Module, leave: set, unused: bool) -> List[str]:
    """Sum the gradients of ``module``'s trainable parameters over ranks with DDP's reducer
    (buckets, overlapped with backward), in place: torch's composable ``replicate``, with a
    communication hook that sums. ``leave``: names of parameters DDP must not touch (table shards,
    and tables with sparse gradients, which DDP's hooks cannot take); DDP leaves whole modules,
    so each module holding one must hold no other trainable parameter. ``unused``: some parameter
    gets no gradient (DDP then looks for them every step). Returns the names DDP reduces ([]:
    none, and DDP is not applied)."""
    from torch.distributed._composable.replicate import replicate

    params = dict(module.named_parameters())
    kept = [n for n, p in params.items() if p.requires_grad and n not in leave]
    if not kept:
        return []
    owners = {n.rpartition(".")[0] for n in leave if n in params}
    for n in kept:  # DDP leaves a module's descendants with it
        mod = n.rpartition(".")[0]
        clash = [o for o in owners if o == "" or mod == o or mod.startswith(o + ".")]
        if clash:
            tables = sorted(t for t in leave if t in params and t.rpartition(".")[0] in clash)
            raise ValueError(
                f"fxrec: module '{clash[0] or '(the model itself)'}' holds the sharded or sparse table(s) {tables} "
                f"and (itself or in a submodule) the parameter '{n}', whose gradient DDP sums over ranks; DDP takes "
                "or leaves whole modules: put the tables in modules of their own (nn.Embedding / "
                "nn.EmbeddingBag), or plan them data_parallel with dense gradients")
    device = params[kept[0]].device
    replicate(module, ignored_modules=[module.get_submodule(o) for o in owners], device_id=device,
              find_unused_parameters=unused)
    module.register_comm_hook(ExactSums(module, [params[n] for n in kept]), _exact_sums_hook)
    # DDP's set-up (a broadcast of the parameters from rank 0) now, while every rank is here, not
    # hidden in the first forward
    try:
        replicate.state(module).lazy_init()
    except Exception as e:  # noqa: BLE001 - re-raised naming the step
        raise _fail("DDP's set-up (broadcast of the parameters)", "fxrec.transform", e) from e
    return kept
