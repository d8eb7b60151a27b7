"""group_lookups: put lookups that can share one fbgemm TBE into groups, across the whole graph.

A pure key function decides what may share a TBE (:func:`group_key`); for pooled lookups it
includes the batch size, named first so that sizes the graph proves equal share a name
(:func:`_name_batches`: a pooled group returns one ``[B, sum of dims]`` tensor). Where the lookups were
written in ``forward`` does not matter; two lookups of one key are kept apart only when one truly
depends on the other: a path in the graph from one's output to the other's inputs (data flow,
or the order of side effects below).

1. Table ownership. Each table (weight parameter) belongs to one group, because its storage
   becomes part of that group's TBE. The lookups of a table with the key most of them share form
   one *unit* that is grouped as a whole. A one-id lookup (``single``, pooled by sum) gives the
   same numbers pooled by mean, or unpooled as a [B] sequence, so it takes the pooling of its
   table's other lookups (and of the other pooled lookups, when its table has no others and they
   are all pooled by mean); ``[B, L]`` ids pooled by the model's sum or mean are looked up
   unpooled, the model's op then pooling them, when their table is also looked up unpooled, or
   pooled so both ways (and by no bag). What
   still differs is left as it was, with the reason: a lookup of
   another kind (bag-pooled vs unpooled, over another batch size, ...; an unweighted sum bag beside
   weighted ones takes weights of one and joins them), one whose ids are
   computed from its own table's lookup, one whose table's lookups are tied through the lookups
   of another table.
2. Dependences. One sweep over the graph in order gives each node the set of units whose output
   reaches it (a bitmask), over the data-flow edges plus the ordering edges of side effects.
3. Groups. Units in topological order (by first position) join the first group of their key
   that is not among their ancestors in the graph of groups so far; else they start one. The
   graph of groups stays acyclic, so every group has a place to stand.
4. Reordering. A stable topological sort (Kahn's algorithm, ties by original position) of the
   nodes plus one virtual node per group (every input of every member -> virtual -> every user
   of every member's output) moves the nodes so that every group's inputs are defined before
   the first user of any of its outputs, where lower_groups / shard_groups put its call. Nodes
   keep their original order as far as that allows (a graph already in such an order is left
   as it is): typically the users of an early lookup move below the id computations of a later
   one. The lookups and their id computations (casts, slices, index arithmetic) move freely.

Side effects keep their order (:class:`fxrec.dataflow.SideEffects`: impure nodes keep their
relative order, and the readers of an argument an op writes in place stay on their side of it).
A group's call takes its members' side: an in-place write ordered before a member (to its ids)
comes before the call, one ordered after a member comes after it (the virtual node carries
those edges too, :func:`_place`).

Within a group, the lookups of one table are next to each other (:func:`_tables_adjacent`):
fbgemm's kernels need every table's features adjacent in ``feature_table_map`` (its CPU backward
and nobag forward read wrong rows otherwise, and fused Adagrad updates go wrong silently), as
TorchRec lays them out. Members are ordered as the first ``torch.cat`` that consumes them lists
them (:func:`_column_order`), then made table-adjacent, so the group's output can usually
replace that cat's arguments without reordering.

Before: lookups annotated by annotate_lookups. After: the nodes possibly reordered, and the
weights of ones of unweighted bags that joined weighted ones added (nothing else changes); ``ctx.groups`` holds GroupRecords, each member node carries
``meta["fxrec_group"]``, and ``gm.meta["fxrec_fragmentation"]`` (a :class:`fxrec.meta.Fragmentation`)
says how many groups were made, the fewest possible, and why each extra one is apart.

Not handled: lookups whose record has a reason (left alone).
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import networkx as nx
import torch
import torch.fx as fx

from .. import meta
from ..dataflow import SideEffects, reaches, reorder
from ..group_module import uses_outside_group
from ..pass_infra import PassContext, PassResult, compiler_pass
from ..runtime.specs import CUDA_MAX_DIM, pad_dim

aten = torch.ops.aten


def group_key(rec: meta.LookupRecord) -> tuple:
    """What must be equal for two lookups to share one TBE.

    pooling (one TBE pools one way), weighted or not, dtype and device (one weight buffer),
    sparse gradient or not (one gradient layout), for unpooled lookups the dim as stored
    (:func:`fxrec.runtime.specs.pad_dim`: fbgemm's sequence TBE has one dim for all its tables),
    the optimizer (one TBE runs one), the precision ``weights_precision=`` stores it in (one
    weight buffer), and for pooled lookups the batch size as captured (a pooled group returns one
    ``[B, sum of dims]`` tensor: its features must have one B; a size symbol the model's code
    never ties to another's is another batch size), and whether the table is wider than fbgemm's
    CUDA kernels take (those run PyTorch's lookups there: a wide table in a group would take the
    whole group with it; on any device, so that a model's groups do not depend on it).
    """
    return (
        rec.pooling,
        rec.weighted,
        rec.dtype,
        rec.device,
        rec.sparse,
        pad_dim(rec.dim) if rec.pooling == "none" else None,
        rec.optimizer,
        rec.weights,
        None if rec.pooling == "none" else rec.batch,
        pad_dim(rec.dim) > CUDA_MAX_DIM,
    )


def _name_batches(records: List[meta.LookupRecord]) -> List[meta.LookupRecord]:
    """Each pooled lowerable lookup with ``batch`` set: its output's dim 0 as captured, one name
    for every size the graph's shape facts prove equal (the model concatenating the outputs is
    such a proof; ``(s0*s1 + s1 - 1)//s1`` and ``s0`` can be one size)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    named: List[Tuple[object, str]] = []
    out = []
    for r in records:
        val = r.output.meta.get("val") if hasattr(r.output, "meta") else None
        if r.pooling == "none" or not r.lowerable or not isinstance(val, torch.Tensor) or val.dim() == 0:
            out.append(r)
            continue
        size = val.shape[0]
        name = next((n for v, n in named if v is size or _provably_equal(v, size, statically_known_true)), None)
        if name is None:
            # a size the capture left symbolic ("s13") is named by the first feature read over it
            name = str(size) if isinstance(size, int) else f"the batch of feature '{r.feature}'"
            named.append((size, name))
        out.append(dataclasses.replace(r, batch=name))
    return out


def _provably_equal(a, b, statically_known_true) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001 - sizes of two shape environments: not provably one
        return False


# --------------------------------------------------------------------------- records
def _inputs(rec: meta.LookupRecord) -> List[fx.Node]:
    """The nodes a lookup reads that are not its own."""
    own = set(rec.nodes)
    seen: Dict[fx.Node, None] = {}
    for n in rec.nodes:
        for x in n.all_input_nodes:
            if x not in own:
                seen.setdefault(x)
    return list(seen)


def _users(rec: meta.LookupRecord) -> List[fx.Node]:
    own = set(rec.nodes)
    return [u for u in rec.output.users if u not in own]


def _single_ids_join(records: List[meta.LookupRecord]) -> List[meta.LookupRecord]:
    """One-id lookups (``single``, pooled by sum) take the form of the lookups they can share a
    TBE with, since the numbers are the same: a sequence lookup of [B] ids ([B, D] out) when their
    table is also looked up unpooled (DIN's candidate and history); pooled by mean when the
    table's other lookups are (the mean of one row is the row); and pooled by mean when their
    table has no other lookups and the pooled lookups they could join are all pooled by mean.
    ``[B, L]`` ids pooled by the model's ``.sum(1)`` / ``.mean(1)`` of a table also looked up
    unpooled, or pooled so both ways (and not by bags), become sequence lookups too, the model's
    sum or mean left in the graph to pool their rows, as the model computes it (else one of the
    kinds was left as written: its table's fp32 rows kept for it, also when the table was
    quantized, and the table only data-parallel in a plan)."""
    lowerable = [r for r in records if r.lowerable]
    by_table: Dict[str, List[meta.LookupRecord]] = {}
    for r in lowerable:
        by_table.setdefault(r.param, []).append(r)

    def single(r):
        return r.form == "single" and r.pooling == "sum" and not r.weighted

    out = {}
    for param, rs in by_table.items():
        others = [r for r in rs if not single(r)]
        poolings = {r.pooling for r in others if r.form == "pooled_seq"}
        if any(r.form == "seq" for r in others) or (len(poolings) > 1 and all(r.form == "pooled_seq" for r in others)):
            new = dict(form="seq", pooling="none")
            for r in rs:  # [B, L] ids pooled by the model's sum or mean: its rows, which that op then pools
                if r.form == "pooled_seq":
                    out[r.node] = dataclasses.replace(r, form="seq", pooling="none", output=r.node, nodes=(r.node,),
                                                      batch=None)
        elif others and all(r.pooling == "mean" for r in others):
            new = dict(pooling="mean")
        else:
            continue
        for r in rs:
            if single(r):
                out[r.node] = dataclasses.replace(r, **new)
    # tables looked up only by one id: mean when nothing else of their key pools by sum
    only_single = {p for p, rs in by_table.items() if all(single(r) for r in rs)}
    fixed = {group_key(out.get(r.node, r)) for r in lowerable if r.param not in only_single}
    for p in only_single:
        for r in by_table[p]:
            k = group_key(r)
            if k not in fixed and (("mean",) + k[1:]) in fixed:
                out[r.node] = dataclasses.replace(r, pooling="mean")
    return [out.get(r.node, r) for r in records]


def _unjoin(rec: meta.LookupRecord) -> meta.LookupRecord:
    """``rec`` as the model wrote it where :func:`_unweighted_bags_join` gave it weights of ones and
    it is left as written after all (its table's lookups are mostly of another kind, or it depends
    on its group): the bag's weights argument back to None (the ones, unused, are erased after the
    reordering)."""
    ones = rec.per_sample_weights
    if ones is None or not ones.meta.get(_ONES):
        return rec
    if len(rec.node.args) > 6 and rec.node.args[6] is ones:
        rec.node.args = rec.node.args[:6] + (None,) + rec.node.args[7:]
    else:
        rec.node.kwargs = {k: v for k, v in rec.node.kwargs.items() if k != "per_sample_weights"}
    return dataclasses.replace(rec, per_sample_weights=None)


#: marks the weights of ones _unweighted_bags_join makes (node.meta)
_ONES = "fxrec_weights_of_one"


def _unweighted_bags_join(records: List[meta.LookupRecord], graph: fx.Graph) -> List[meta.LookupRecord]:
    """Unweighted sum bags of a table also looked up by weighted sum bags of their key but for the
    weighting take per-sample weights of ones (``aten.ones_like`` of their ids, of the weights'
    dtype), so that the table's lookups share its group: a weight of 1 multiplies each row
    exactly, forward and backward (else one kind was left as written, keeping the table's fp32
    rows when quantized and the table only data-parallel in a plan). Not for the model's fp16
    tables (:func:`_keep_mixed_half_tables` says why their lookups keep their places)."""
    by_table: Dict[str, List[meta.LookupRecord]] = {}
    for r in records:
        if r.lowerable and r.form == "bag" and r.pooling == "sum" and not r.half:
            by_table.setdefault(r.param, []).append(r)
    out = {}
    for rs in by_table.values():
        weighted = [r for r in rs if r.weighted]
        keys = {group_key(r) for r in weighted}
        for r in rs:
            val = r.ids.meta.get("val") if hasattr(r.ids, "meta") else None
            if r.weighted or not isinstance(val, torch.Tensor) or \
                    group_key(dataclasses.replace(r, per_sample_weights=r.ids)) not in keys:
                continue
            dtype = weighted[0].per_sample_weights.meta["val"].dtype
            with graph.inserting_before(r.node):
                ones = graph.call_function(torch.ops.aten.ones_like.default, (r.ids,), {"dtype": dtype})
            ones.meta["val"] = torch.ones_like(val, dtype=dtype)
            ones.meta[_ONES] = True
            # the bag itself takes them (the graph computes what the group does, and the reordering
            # sees them among the lookup's inputs); taken back where the bag is left as written
            # (:func:`_unjoin`)
            if len(r.node.args) > 6:
                r.node.args = r.node.args[:6] + (ones,) + r.node.args[7:]
            else:
                r.node.kwargs = {**r.node.kwargs, "per_sample_weights": ones}
            out[r.node] = dataclasses.replace(r, per_sample_weights=ones)
    return [out.get(r.node, r) for r in records]


# --------------------------------------------------------------------------- the pass
class _Unit:
    """The lookups of one table that run in one group (the table's storage is in one TBE)."""

    def __init__(self, index: int, key: tuple, members: List[meta.LookupRecord]):
        self.index = index
        self.key = key
        self.members = members
        self.group: Optional["_Group"] = None

    @property
    def table(self) -> str:
        return self.members[0].table


class _Group:
    def __init__(self, key: tuple):
        self.key = key
        self.units: List[_Unit] = []
        self.succ: Set["_Group"] = set()
        self.pred: Set["_Group"] = set()
        self.name = ""
        self.solo = False  # a table used outside its lookups, alone (_used_outside)

    @property
    def members(self) -> List[meta.LookupRecord]:
        return [r for u in self.units for r in u.members]


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _sweep(nodes: Sequence[fx.Node], effects: SideEffects, unit_of: Dict[fx.Node, int]):
    """One pass in graph order: for each unit member, the units whose output reaches its inputs
    (``anc``), and the members reached by their own unit (``dropped``)."""
    out: Dict[fx.Node, int] = {}
    anc: Dict[fx.Node, int] = {}
    dropped: List[fx.Node] = []
    for n in nodes:
        m = 0
        for p in effects.all_preds(n):
            m |= out.get(p, 0)
        u = unit_of.get(n)
        if u is not None:
            anc[n] = m
            if m >> u & 1:
                dropped.append(n)
            else:
                m |= 1 << u
        out[n] = m
    return anc, dropped


def _cause(x: meta.LookupRecord, ys: Sequence[meta.LookupRecord], effects: SideEffects) -> Tuple[Optional[meta.LookupRecord], bool]:
    """Which of ``ys`` lookup ``x`` depends on, and whether through data (True) or only through
    the order of side effects (False)."""
    by_node = {y.node: y for y in ys}
    hit = reaches(x.node, set(by_node), lambda n: n.all_input_nodes)
    if hit is not None:
        return by_node[hit], True
    hit = reaches(x.node, set(by_node), effects.all_preds)
    return (by_node[hit] if hit is not None else None), False


def _reads(x: meta.LookupRecord, y: Optional[meta.LookupRecord], data: bool) -> str:
    if y is None:
        return f"feature '{x.feature}' runs after it"
    if data:
        return f"feature '{x.feature}' reads '{y.feature}'"
    return f"feature '{x.feature}' must run after '{y.feature}': in-place writes or random numbers order them"


_FIELDS = ("pooling", "weighted", "dtype", "device", "sparse", "dim", "optimizer", "weights", "batch", "wide")


def _kind_text(key: tuple, field: str) -> str:
    k = dict(zip(_FIELDS, key))
    if field == "pooling":
        return "unpooled" if k["pooling"] == "none" else f"pooled by {k['pooling']}"
    if field == "weighted":
        return "weighted" if k["weighted"] else "unweighted"
    if field == "sparse":
        return "with sparse gradients" if k["sparse"] else "with dense gradients"
    if field == "dim":
        return f"of stored dim {k['dim']}"
    if field == "optimizer":
        return f"optimizer {k['optimizer'].describe()}" if k["optimizer"] is not None else "no optimizer"
    if field == "weights":
        return f"stored in {k['weights']}" if k["weights"] else "stored as the model holds it"
    if field == "batch":
        return f"over {_batch_text(k['batch'])}"
    if field == "wide":
        return (f"wider than {CUDA_MAX_DIM} columns (fbgemm's CUDA kernels take up to {CUDA_MAX_DIM})" if k["wide"]
                else f"at most {CUDA_MAX_DIM} columns wide")
    return f"{field} {k[field]}"


def _batch_text(name: str) -> str:
    """A batch name of :func:`_name_batches` in words: "a batch of 4" or "the batch of feature 'ids'"."""
    return f"a batch of {name}" if name.isdigit() else name


def _differing(a: tuple, b: tuple) -> List[str]:
    out = [f for f, x, y in zip(_FIELDS, a, b) if x != y]
    # only unpooled keys hold a dim, only pooled ones a batch size
    return [f for f in out if f not in ("dim", "batch")] if "pooling" in out else out


def key_difference(mine: tuple, theirs: tuple) -> str:
    """Why lookups of key ``mine`` cannot share a TBE with those of key ``theirs``, in words
    (each difference as "mine vs theirs")."""
    out = []
    for f in _differing(mine, theirs):
        if f == "sparse":
            out.append("sparse gradients differ")
        elif f == "optimizer":
            out.append(f"optimizer differs ({_kind_text(mine, f)} vs {_kind_text(theirs, f)})")
        elif f == "dim":
            out.append(f"stored dims differ ({mine[5]} vs {theirs[5]})")
        elif f == "batch":
            out.append(f"batch sizes differ ({_batch_text(mine[8])} vs {_batch_text(theirs[8])}: "
                       "nothing in the model makes them equal)")
        elif f in ("pooling", "weighted", "weights", "wide"):
            out.append(f"{_kind_text(mine, f)} vs {_kind_text(theirs, f)}")
        else:
            out.append(f"{f} {mine[_FIELDS.index(f)]} vs {theirs[_FIELDS.index(f)]}")
    return ", ".join(out) or "same key"


def kind_of(key: tuple, batches: bool = False) -> str:
    """The class a group of ``key`` falls in when counting the fewest groups: its pooling (with
    ``batches``, the model's pooled lookups having several batch sizes, and its batch size), or
    for unpooled lookups the stored dim."""
    if key[0] == "none":
        return f"sequence dim {key[5]}"
    return f"{key[0]} over {_batch_text(key[8])}" if batches else key[0]


def _keep_mixed_half_tables(nodes) -> None:
    """In training, every lookup of a table of the model's fp16 left as written where one of them
    is (or they would go to two groups): a group runs where its first lookup was, so its lookups'
    backward would run in another order among the others', and the table's fp16 gradients from
    them, summed in that order, would round otherwise than PyTorch's (one fp16 step, found)."""
    found = [n.meta[meta.LOOKUP] for n in nodes if meta.LOOKUP in n.meta]
    by_param: Dict[str, List[meta.LookupRecord]] = {}
    for rec in found:
        if rec.half:
            by_param.setdefault(rec.param, []).append(rec)
    for recs in by_param.values():
        kept = [r for r in recs if not r.lowerable]
        if not kept and len({group_key(r) for r in recs}) < 2:
            continue
        why = (f"table '{recs[0].table}' is fp16 in the model and its lookup '{kept[0].feature}' is left as written"
               if kept else f"table '{recs[0].table}' is fp16 in the model and its lookups are of kinds no one group takes")
        for r in recs:
            if r.lowerable:
                r.node.meta[meta.LOOKUP] = dataclasses.replace(
                    r, reason=why + ": grouped, this lookup's gradient would be summed into the table's in another "
                    "order among theirs, which rounds otherwise in fp16; left as written too, as PyTorch runs it")


@compiler_pass(needs=(meta.LOOKUP,), provides=(meta.GROUP, "groups"))
def group_lookups(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    graph = gm.graph
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    found = [n.meta[meta.LOOKUP] for n in nodes if meta.LOOKUP in n.meta]
    for rec in _unweighted_bags_join(_single_ids_join(_name_batches(found)), graph):
        rec.node.meta[meta.LOOKUP] = rec
    nodes = list(graph.nodes)  # (with the weights of ones made above)
    pos = {n: i for i, n in enumerate(nodes)}
    if ctx.config.mode == "training":
        _keep_mixed_half_tables(nodes)
    records = [n.meta[meta.LOOKUP] for n in nodes if meta.LOOKUP in n.meta and n.meta[meta.LOOKUP].lowerable]

    # 1. table ownership: each table's lookups of its most common key form a unit
    by_table: Dict[str, Dict[tuple, List[meta.LookupRecord]]] = {}
    for rec in records:
        by_table.setdefault(rec.param, {}).setdefault(group_key(rec), []).append(rec)
    units: List[_Unit] = []
    plain: List[Tuple[meta.LookupRecord, _Unit, str]] = []  # left as written: (record, its table's unit, why)
    for keys in by_table.values():
        owner = max(keys, key=lambda k: (len(keys[k]), -pos[keys[k][0].node]))
        unit = _Unit(len(units), owner, keys[owner])
        units.append(unit)
        for k, rs in keys.items():
            if k != owner:
                plain.extend((r, unit, "kind") for r in rs)

    # 2. dependences: which units reach each member; a member reached by its own unit, and the
    # units of a cycle of units, leave the unit
    effects = SideEffects(nodes)
    while True:
        unit_of = {r.node: u.index for u in units for r in u.members}
        anc, dropped = _sweep(nodes, effects, unit_of)
        for n in dropped:
            u = units[unit_of[n]]
            rec = next(r for r in u.members if r.node is n)
            u.members.remove(rec)
            plain.append((rec, u, "self"))
        unit_graph = nx.DiGraph()
        unit_graph.add_nodes_from(range(len(units)))
        preds: Dict[int, Set[int]] = {u.index: set() for u in units}
        for u in units:
            for r in u.members:
                for p in _bits(anc[r.node]):
                    preds[u.index].add(p)
                    unit_graph.add_edge(p, u.index)
        cycles = [c for c in nx.strongly_connected_components(unit_graph) if len(c) > 1]
        if not cycles:
            break
        for c in cycles:  # keep the first lookup of the unit that starts last; the graph is re-swept
            u = max((units[i] for i in c if len(units[i].members) > 1), key=lambda u: pos[u.members[0].node])
            other = units[next(i for i in c if i != u.index)]
            for rec in u.members[1:]:
                plain.append((rec, u, f"cycle:{other.table}"))
            del u.members[1:]

    # 3. groups: units in topological order join the first group of their key that is not among
    # their ancestors
    order: List[_Unit] = []
    indeg = {u.index: len(preds[u.index]) for u in units}
    succs: Dict[int, List[int]] = {u.index: [] for u in units}
    for v, ps in preds.items():
        for p in ps:
            succs[p].append(v)
    heap = [(pos[u.members[0].node], u.index) for u in units if indeg[u.index] == 0]
    heapq.heapify(heap)
    while heap:
        _, i = heapq.heappop(heap)
        order.append(units[i])
        for v in succs[i]:
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(heap, (pos[units[v].members[0].node], v))
    assert len(order) == len(units), "fxrec: the graph of lookups has a cycle"
    groups: List[_Group] = []
    for u in order:
        direct = {units[p].group for p in preds[u.index]}
        above = set(direct)
        todo = list(direct)
        while todo:
            g = todo.pop()
            for h in g.pred:
                if h not in above:
                    above.add(h)
                    todo.append(h)
        solo = _used_outside(u)
        target = None if solo else next((g for g in groups if g.key == u.key and g not in above and not g.solo), None)
        if target is None:
            target = _Group(u.key)
            target.solo = solo
            groups.append(target)
        target.units.append(u)
        u.group = target
        for g in direct:
            g.succ.add(target)
            target.pred.add(g)
    groups.sort(key=lambda g: min(pos[r.node] for r in g.members))

    records_out: List[meta.GroupRecord] = []
    for i, g in enumerate(groups):
        g.name = f"group_{i}"
        members = _tables_adjacent(_column_order(g.members, pos))
        records_out.append(meta.GroupRecord(name=g.name, key=g.key, lookups=members))
        for rec in members:
            rec.node.meta[meta.GROUP] = g.name

    # lookups left as written, with the reason
    for rec, u, why in plain:
        rec = _unjoin(rec)
        first = u.members[0]
        where = f"table '{rec.table}' is batched in {u.group.name}"
        if why == "kind":
            diff = _differing(u.key, group_key(rec))
            mine = ", ".join(_kind_text(group_key(rec), f) for f in diff)
            theirs = ", ".join(_kind_text(u.key, f) for f in diff)
            reason = (f"{where} with its lookups {theirs} (feature '{first.feature}'); this one is {mine}, "
                      "and a table is stored in one group")
        elif why == "self":
            y, data = _cause(rec, [r for r in u.members], effects)
            y = y or first
            what = (f"its ids are computed from the output of that table's lookup '{y.feature}'" if data else
                    f"it must run after that table's lookup '{y.feature}' (in-place writes or random numbers "
                    "order them)")
            reason = f"{where} (feature '{first.feature}'), and this lookup cannot run in that call: {what}"
        else:
            other = why.split(":", 1)[1]
            reason = (f"{where} (feature '{first.feature}'), and this lookup cannot join it: the two are tied "
                      f"through the lookups of table '{other}' (the output of one reaches the other's ids)")
        rec = dataclasses.replace(rec, reason=reason)
        rec.node.meta[meta.LOOKUP] = rec
        ctx.logger.debug("%s not grouped: %s", rec.feature, reason)

    gm.meta[meta.FRAGMENTATION] = _fragmentation(groups, effects)
    moved = reorder(graph, nodes, effects, [_place(gr, effects) for gr in records_out])
    ones = [n for n in graph.nodes if n.meta.get(_ONES)]
    for n in ones:
        if not n.users:  # (its bag left as written)
            graph.erase_node(n)
    ctx.groups = records_out
    return PassResult(gm, moved > 0 or any(n.users for n in ones), {
        "groups": len(records_out), "grouped": sum(len(g.lookups) for g in records_out),
        "fewest": gm.meta[meta.FRAGMENTATION].fewest, "left_plain": len(plain), "nodes_moved": moved,
    })


def _fragmentation(groups: List[_Group], effects: SideEffects) -> meta.Fragmentation:
    """The groups made, the fewest possible (one per pooling kind and batch size; for sequence
    groups one per stored dim), and why each extra group is apart from the first of its kind."""
    kinds: Dict[str, List[_Group]] = {}
    batches = len({g.key[8] for g in groups if g.key[0] != "none"}) > 1
    for g in groups:
        kinds.setdefault(kind_of(g.key, batches), []).append(g)
    splits = []
    for gs in kinds.values():
        for i, g in enumerate(gs[1:], 1):
            same = next((h for h in gs[:i] if h.key == g.key), None)
            if same is None:
                splits.append(f"{g.name} apart from {gs[0].name}: {key_difference(g.key, gs[0].key)}")
                continue
            if g.solo or same.solo:
                alone = g if g.solo else same
                splits.append(f"{g.name} apart from {same.name}: table '{alone.members[0].table}' is also used "
                              "outside its lookups, so its optimizer cannot be fused into a group's backward; a "
                              "group of its own keeps the other tables' update fused")
                continue
            path = _path(same, g)
            if path is not None:
                text = f"depends on the output of {same.name}"
            else:
                path = _path(g, same)
                text = f"{same.name} depends on its output"
            if path is None:  # not expected: groups of one key are apart only when connected
                splits.append(f"{g.name} apart from {same.name}")
                continue
            if len(path) > 2:
                text += " through " + ", ".join(h.name for h in path[1:-1])
            hops = []
            for a, b in zip(path, path[1:]):
                for x in b.members:
                    y, data = _cause(x, a.members, effects)
                    if y is not None:
                        hops.append(_reads(x, y, data))
                        break
            splits.append(f"{g.name} apart from {same.name}: {text}" + (f" ({'; '.join(hops)})" if hops else ""))
    return meta.Fragmentation(groups=len(groups), fewest=len(kinds), kinds=tuple(kinds), splits=tuple(splits))


def _used_outside(u: _Unit) -> bool:
    """Whether the table of ``u`` (with an optimizer that can be fused) is read by anything but its
    unit's lookups: a tied output layer, a lookup left as written. A fused update would miss that
    gradient, so its group steps with torch.optim (choose_kernels); the table takes a group of its
    own, so that the others in its key keep their update fused."""
    opt = u.key[6]
    return opt is not None and opt.fused_spec() is not None and bool(uses_outside_group(u.members))


def _path(a: _Group, b: _Group) -> Optional[List[_Group]]:
    """The shortest path a -> ... -> b in the graph of groups, or None."""
    back = {a: None}
    todo = [a]
    while todo:
        nxt = []
        for g in todo:
            for h in sorted(g.succ, key=lambda x: x.name):
                if h not in back:
                    back[h] = g
                    nxt.append(h)
        todo = nxt
    if b not in back:
        return None
    path = [b]
    while path[-1] is not a:
        path.append(back[path[-1]])
    return path[::-1]


def _place(gr: meta.GroupRecord, effects: SideEffects) -> Tuple[Set[fx.Node], Set[fx.Node]]:
    """What must come before the group's call (every input of every member, and what side
    effects order before one: an in-place write to its ids) and after it (every user of every
    member's output, and what side effects order after a member: a later in-place write to what
    it read; with none, the last lookup's output, where lower_groups puts the call)."""
    own = {n for r in gr.lookups for n in r.nodes}
    ins = {x for r in gr.lookups for x in _inputs(r)}
    ins |= {p for n in own for p in effects.preds.get(n, ()) if p not in own}
    users = {u for r in gr.lookups for u in _users(r)}
    users |= {w for n in own for w in effects.followers(n) if w not in own}
    return ins, users or {gr.lookups[-1].output}


def _column_order(members: List[meta.LookupRecord], pos: Dict[fx.Node, int]) -> List[meta.LookupRecord]:
    """Order members as the first concatenation that consumes them lists them."""

    def where(rec: meta.LookupRecord) -> Tuple[int, int, int]:
        best = (1 << 60, 0, pos[rec.node])
        for u in rec.output.users:
            if u.op == "call_function" and u.target is torch.ops.aten.cat.default:
                tensors = u.args[0]
                for i, t in enumerate(tensors):
                    if t is rec.output:
                        best = min(best, (pos[u], i, pos[rec.node]))
        return best

    return sorted(members, key=where)


def _tables_adjacent(members: List[meta.LookupRecord]) -> List[meta.LookupRecord]:
    """Each table's lookups next to each other, tables in order of their first lookup, lookups of
    one table in their given order: ``[a0, b1, a2]`` becomes ``[a0, a2, b1]``."""
    first: Dict[str, int] = {}
    for rec in members:
        first.setdefault(rec.param, len(first))
    return sorted(members, key=lambda r: first[r.param])  # stable
