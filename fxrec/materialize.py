"""Models built on the ``meta`` device: captured without memory, then each rank allocates only
what it holds.

A model whose parameters or buffers are on ``meta`` (``with torch.device("meta"): model = ...``)
has shapes and no data. :func:`with_placeholders` gives a copy whose meta parameters are zero-stride
views of one zero on the example inputs' device (its meta buffers are allocated: a model writes
some in forward): ``torch.export`` captures it as it captures a real model, with no table's memory
allocated. ``transform(..., plan=...)`` then shards the
placeholders like real tables (a row block or column shard is a clone of the rows it keeps, the
only memory a shard takes; tables this rank does not own leave), and :func:`materialize`
allocates what is still a placeholder (whole tables this rank owns, data-parallel tables, dense
parameters) and initialises every tensor that came from ``meta`` with its module's
own ``reset_parameters()``, run on the tensors this rank holds: a shard gets the module's
initialiser applied to the shard (for ``nn.Embedding`` / ``nn.EmbeddingBag``: ``normal_``, the
same distribution, not the same numbers as one process), from a random state seeded by which
pieces the module's tensors are (every rank starts from the same state, and its pieces must not
repeat another rank's numbers). Tensors whole on every rank (dense
parameters, buffers, data-parallel tables) are then broadcast from rank 0, so all ranks agree.
Load trained values with ``fxrec.checkpoint.load`` afterwards.
"""

from __future__ import annotations

import copy
from typing import Dict, List

import torch
import torch.utils._pytree
from torch import nn

from .pass_infra import InputError


def meta_names(model: nn.Module) -> List[str]:
    """Names of the model's parameters and buffers that are on the meta device."""
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    return [n for n, t in named if t is not None and t.is_meta]


def with_placeholders(model: nn.Module, device: torch.device, every: bool = False) -> nn.Module:
    """A copy of ``model`` whose meta parameters (with ``every``: all its parameters) are zero-stride
    placeholders, on ``device`` for meta tensors and on their own device otherwise: one element
    each, so the copy allocates no table (ties stay tied). Buffers are copied, a meta buffer
    allocated (uninitialised) on ``device``: a model may write its buffers in forward (batch norm's
    running statistics), which a placeholder, one element for all, cannot take; every rank holds
    them whole anyway."""
    memo = {}
    for t in model.parameters():
        if t.is_meta or every:
            ph = torch.zeros((), dtype=t.dtype, device=device if t.is_meta else t.device).expand(t.shape)
            memo[id(t)] = nn.Parameter(ph, requires_grad=t.requires_grad)
    for t in model.buffers():
        if t.is_meta:
            memo[id(t)] = torch.empty(t.shape, dtype=t.dtype, device=device)
    return copy.deepcopy(model, memo)  # the placeholders stand in for the tensors they replace


def working_copy(model: nn.Module, args, every: bool = False) -> nn.Module:
    """The copy of ``model`` that fxrec captures: placeholders for its meta tensors (``every``: for
    all of them, filled by :func:`materialize` after sharding), meta ones on the device of the
    first tensor among the example ``args`` (CPU if none)."""
    if not every and not meta_names(model):
        return copy.deepcopy(model)
    leaves = [x for x in torch.utils._pytree.tree_leaves(args) if isinstance(x, torch.Tensor)]
    return with_placeholders(model, leaves[0].device if leaves else torch.device("cpu"), every)


def _held(t: torch.Tensor) -> bool:
    """Whether ``t`` has memory of its own: not a placeholder (whose strides are 0; a shard cut from
    one is a clone, with real strides)."""
    return t.numel() == 0 or 0 not in t.stride()


def _owner(root: nn.Module, fqn: str):
    path, _, attr = fqn.rpartition(".")
    return (root.get_submodule(path) if path else root), attr


def _put(owner: nn.Module, attr: str, t: torch.Tensor) -> None:
    if isinstance(t, nn.Parameter):
        setattr(owner, attr, t)
    else:
        owner.register_buffer(attr, t, persistent=attr not in owner._non_persistent_buffers_set)


def materialize(gm: nn.Module, model: nn.Module, sharded: Dict[str, str], layout: Dict[str, tuple]) -> None:
    """Give every tensor of ``gm`` captured from a placeholder of ``model`` its memory and values
    (see the module doc): allocated where it is still a placeholder; copied from ``model``'s
    tensor (this rank's pieces of it, by ``layout``: fqn -> (global shape, [(row offset, rows,
    col offset, cols, local col offset)])), or, for a meta tensor, initialised by its module's
    ``reset_parameters()``. ``sharded``: fqn -> sharding of the table shards this rank holds
    (never broadcast). Collective when a process group is initialised and ``model`` has meta
    tensors."""
    import torch.distributed as dist

    sources = dict(model.named_parameters(remove_duplicate=False))
    sources.update(dict(model.named_buffers(remove_duplicate=False)))
    gm_tensors = dict(gm.named_parameters(remove_duplicate=False))
    gm_tensors.update(dict(gm.named_buffers(remove_duplicate=False)))
    replaced: Dict[int, torch.Tensor] = {}  # id of a placeholder -> the tensor that replaced it
    to_init: Dict[str, List[str]] = {}  # module path -> its meta tensors' names
    for fqn, t in list(gm_tensors.items()):
        src = sources.get(fqn)
        if src is None:
            continue  # a tensor fxrec made
        owner, attr = _owner(gm, fqn)
        if id(t) in replaced:  # a tied tensor, allocated under its other name
            t = replaced[id(t)]
            _put(owner, attr, t)
        elif not _held(t):  # still a placeholder: this rank holds it whole
            real = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            new = nn.Parameter(real, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else real
            replaced[id(t)] = t = new
            _put(owner, attr, t)
        gm_tensors[fqn] = t
        if src.is_meta:
            to_init.setdefault(fqn.rpartition(".")[0], []).append(fqn)
            continue
        with torch.no_grad():
            pieces = layout.get(fqn, (None, [(0, src.shape[0], 0, None, 0)] if src.dim() else []))[1]
            if not src.dim():
                t.copy_(src)
            for ro, nr, co, nc, lco in pieces:
                if src.dim() == 1 or nc is None:
                    t[:nr].copy_(src[ro:ro + nr])
                else:
                    t[:nr, lco:lco + nc].copy_(src[ro:ro + nr, co:co + nc])
    # A module holding table pieces draws them from a random state of their own, seeded by which
    # pieces they are: every rank starts from the same state (as DDP wants), so each rank's row
    # block or column shard (and two tables owned by two ranks) drew the same numbers
    base = int(torch.randint(0, 2**62, ())) if to_init else 0  # (drawn on every rank: their states stay alike)
    error = None
    try:
        _initialise_all(model, to_init, gm_tensors, {path: _seed(base, path, mine) if mine else None
                                                     for path, fqns in to_init.items()
                                                     for mine in [sorted((f, layout.get(f, (None, []))[1])
                                                                         for f in fqns if f in sharded)]})
    except Exception as e:  # noqa: BLE001 - a refusal (or the module's own error) on one rank stops every rank
        error = e
    if dist.is_available() and dist.is_initialized() and to_init:
        from .ranks import exchange_device
        from .runtime.collectives import all_gather_ints

        every = all_gather_ints([0 if error is None else 1], exchange_device(None),
                                "fxrec.transform (initialising the meta tensors)")
        if error is not None:
            raise error
        failed = [r for r, (flag,) in enumerate(every) if flag]
        if failed:
            raise InputError(f"fxrec: initialising the meta tensors failed on rank(s) {failed} (their error says "
                             "why); this rank stops with them")
        with torch.no_grad():
            for fqns in to_init.values():
                for fqn in fqns:
                    if fqn not in sharded:
                        dist.broadcast(gm_tensors[fqn].data, src=0)
    elif error is not None:
        raise error


def _initialise_all(model: nn.Module, to_init: Dict[str, List[str]], gm_tensors: Dict[str, torch.Tensor],
                    seeds: Dict[str, object]) -> None:
    """Every module's ``reset_parameters()`` on its meta tensors (:func:`_initialise`), then an
    InputError naming any tensor (or part of one) none of them wrote. Each tensor is filled first
    with :func:`_unwritten`'s value; where one still holds it, the calls run again from the same
    random state, those places given a second value, and a place holding that is unwritten (a
    value the module wrote is written again, the same: it cannot be both)."""
    tensors = {id(gm_tensors[f]): gm_tensors[f] for fqns in to_init.values() for f in fqns}
    names: Dict[int, List[str]] = {}
    for fqns in to_init.values():
        for f in fqns:
            names.setdefault(id(gm_tensors[f]), []).append(f)
    with torch.no_grad():
        for t in tensors.values():
            _values(t).fill_(_unwritten(_values(t).dtype))
    # the random state the calls start from (the host's, and the GPUs' the tensors are on), for a second run
    cuda = sorted({t.device.index or 0 for t in tensors.values() if t.is_cuda})
    start = torch.random.get_rng_state(), [torch.cuda.get_rng_state(d) for d in cuda]
    replaced = [f for path, fqns in to_init.items() for f in _initialise(model, path, fqns, gm_tensors, seeds[path])]
    if replaced:
        raise InputError(f"fxrec: {replaced} are on the meta device, and their module's reset_parameters() puts new "
                         "tensors in their place instead of writing them (self.w = nn.Parameter(...)); write them in "
                         "place there (nn.init functions, .copy_()): it is run on the tensors each rank holds")
    left = [t for t in tensors.values() if _holds(_values(t), _unwritten(_values(t).dtype))]
    if not left:
        return
    # (rare: a module may write those values too, a uint8 buffer 0; where, is kept for these only)
    where = {id(t): _matches(_values(t), _unwritten(_values(t).dtype)) for t in left}
    with torch.no_grad():
        for t in left:
            _values(t).masked_fill_(where[id(t)], _unwritten(_values(t).dtype, second=True))
    torch.random.set_rng_state(start[0])
    for d, state in zip(cuda, start[1]):
        torch.cuda.set_rng_state(state, d)
    for path, fqns in to_init.items():
        _initialise(model, path, fqns, gm_tensors, seeds[path])
    unwritten = [n for t in left for v in [_values(t)]
                 if bool((where[id(t)] & _matches(v, _unwritten(v.dtype, second=True))).any()) for n in names[id(t)]]
    if unwritten:
        owners = sorted({f.rpartition(".")[0] or type(model).__name__ for f in unwritten})
        raise InputError(
            f"fxrec: {unwritten} are on the meta device, and the reset_parameters() of their module(s) {owners} does "
            "not write all of them; write them there (it is run on the tensors each rank holds), or build the model "
            "on a real device")


def _seed(base: int, path: str, pieces) -> int:
    """A seed for the module ``path``'s table pieces ``pieces`` (fqn, [(row offset, rows, col offset,
    cols, local col)]), the same on every rank for the same pieces and different for others."""
    import hashlib

    text = repr((base, path, [(f, [tuple(p) for p in ps]) for f, ps in pieces]))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def _initialise(model: nn.Module, path: str, fqns: List[str], gm_tensors: Dict[str, torch.Tensor],
                seed=None) -> None:
    """Run the module ``path`` of ``model``'s own ``reset_parameters()`` on the tensors ``fqns`` as
    this rank holds them (``gm_tensors``), by a stand-in of the module that holds them; with
    ``seed``, from a random state seeded so (the global one is left as it was)."""
    orig = model.get_submodule(path) if path else model
    if not callable(getattr(orig, "reset_parameters", None)):
        raise InputError(
            f"fxrec: {fqns} are on the meta device, and their module '{path or type(orig).__name__}' "
            f"({type(orig).__name__}) has no reset_parameters() to initialise them; give it one (it is run on "
            "the tensors each rank holds), or build the model on a real device")
    stand = copy.copy(orig)
    stand._parameters, stand._buffers = dict(orig._parameters), dict(orig._buffers)
    mine = {}
    for fqn in fqns:
        t = gm_tensors[fqn]
        held = stand._parameters if isinstance(t, nn.Parameter) else stand._buffers
        held[fqn.rpartition(".")[2]] = mine[fqn] = t
    if seed is None:
        with torch.no_grad():
            stand.reset_parameters()
    else:
        # (manual_seed seeds every device: every one's state is put back)
        cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            torch.manual_seed(seed)
            stand.reset_parameters()
    now = {**stand._parameters, **stand._buffers}
    return [f for f, t in mine.items() if now.get(f.rpartition(".")[2]) is not t]


def _values(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the values its module writes: a complex tensor's real and imaginary parts, each."""
    return torch.view_as_real(t.detach()) if t.is_complex() else t.detach()


def _unwritten(dtype: torch.dtype, second: bool = False):
    """The value a meta tensor holds (:func:`_values`) before its module's ``reset_parameters()``
    runs: NaN, the lowest integer, False; ``second``: the value of the second run where the first
    left that value (see :func:`_initialise_all`): 0, the highest integer, True."""
    if dtype.is_floating_point:
        return 0.0 if second else float("nan")
    if dtype == torch.bool:
        return second
    return torch.iinfo(dtype).max if second else torch.iinfo(dtype).min


def _matches(part: torch.Tensor, value) -> torch.Tensor:
    if isinstance(value, float) and value != value:
        return torch.isnan(part)
    return part == value


def _holds(t: torch.Tensor, value, chunk: int = 1 << 24) -> bool:
    """Whether ``t`` holds ``value`` anywhere (read in chunks of ``chunk`` values: a mask of a whole
    table would be a quarter of its size again)."""
    if t.numel() == 0:
        return False
    flat = t.detach().reshape(-1)
    with torch.no_grad():
        return any(bool(_matches(part, value).any()) for part in flat.split(chunk))
