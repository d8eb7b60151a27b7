"""Every ``node.meta`` key fxrec writes, with the record stored under it.

Analyses write these records; rewrites read them. A record is the single description of a
lookup or group that the passes, the report and the tests share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch.fx as fx

#: On an embedding lookup node: a :class:`LookupRecord` (written by ``annotate_lookups``).
LOOKUP = "fxrec_lookup"
#: On an embedding lookup node: the name of its group (written by ``group_lookups``).
GROUP = "fxrec_group"
#: On a node that fxrec emitted: the names of the original nodes it replaces.
ORIGIN = "fxrec_origin"
#: On the node that runs a group (its lookups until lower_groups, then its group module's call, or
#: the sharded input-dist): the group's :class:`GroupDecision` (written by ``choose_kernels`` or
#: ``shard_groups``). The report is built from these.
DECISION = "fxrec_decision"
#: On a quantized group's call: its tables' :class:`fxrec.report.QuantEntry` (``measure_quantization``).
QUANT = "fxrec_quant"
#: On an input placeholder: its name as the model's code spells it (``userIds``, ``feats_ItemIDs``;
#: torch.export lower-cases the placeholder's own), written by capture.
INPUT_NAME = "fxrec_input_name"
#: In ``gm.meta``: a tuple of :class:`RemovedLookup`, the lookups ``merge_lookups`` removed.
REMOVED = "fxrec_removed_lookups"
#: In ``gm.meta``: a :class:`Fragmentation`, how many groups ``group_lookups`` made and why.
FRAGMENTATION = "fxrec_fragmentation"
# (gm.meta) the names of the model's nn.Embedding / nn.EmbeddingBag weights (capture): a weight read
# by indexing (weight[ids]) is a lookup only where it is one of them (annotate_lookups)
EMBEDDING_WEIGHTS = "fxrec_embedding_weights"


@dataclass(frozen=True)
class LookupRecord:
    """One embedding lookup as the user wrote it, in canonical form.

    ``output`` is the node whose value the lookup produces for its users: the ``getitem 0`` of an
    ``embedding_bag``, the ``sum``/``mean`` after an ``embedding`` that pools by hand, or the
    ``embedding`` itself. ``nodes`` are all the original nodes the lookup is made of.
    ``reason`` is empty when the lookup can be lowered, else why it is left as it was.
    """

    node: fx.Node
    table: str  # the weight's name in the model, without ".weight"
    param: str  # the weight's full name in state_dict()
    feature: str  # a readable name of the ids input
    form: str  # bag | pooled_seq | single | seq  (see fxrec.runtime.specs.FeatureSpec)
    pooling: str  # sum | mean | none | max
    num_rows: int
    dim: int
    dtype: str
    device: str
    weight: fx.Node
    ids: fx.Node
    offsets: Optional[fx.Node]
    per_sample_weights: Optional[fx.Node]
    output: fx.Node
    nodes: Tuple[fx.Node, ...]
    padding_idx: Optional[int] = None
    include_last_offset: bool = False
    sparse: bool = False
    source: str = ""
    reason: str = ""
    optimizer: object = None  # the table's fxrec.optim optimizer, if the user gave one
    weights: str = ""  # the precision weights_precision= stores the table in ("fp16", "bf16"), or ""
    # a pooled lookup's batch size as captured (group_lookups: one name for the sizes it can prove
    # equal, "s20"), or "" (unpooled, or not yet named)
    batch: str = ""
    # False for a lookup inside a torch.no_grad() block: it makes no gradient (no optimizer needed)
    grad: bool = True
    # the table's weight does not require grad (frozen before transform): no optimizer may update it
    frozen: bool = False

    @property
    def lowerable(self) -> bool:
        return not self.reason

    @property
    def half(self) -> bool:
        """The user's model holds the table in fp16 (the tables lowered are fp32 or fp16)."""
        return self.dtype.replace("torch.", "") == "float16"

    @property
    def stored_bytes(self) -> int:
        """Bytes of one value of the table in fbgemm's TBE: 2 for an fp16 table in the user's model
        or one weights_precision= stores lower, else 4."""
        return 2 if self.weights or self.half else 4

    @property
    def weighted(self) -> bool:
        return self.per_sample_weights is not None

    @property
    def learned_weights(self) -> bool:
        """The per-sample weights need a gradient as captured (computed from parameters that
        train, outside a no_grad block)."""
        from .dataflow import needs_gradient

        return self.per_sample_weights is not None and self.grad and needs_gradient(self.per_sample_weights)


@dataclass
class GroupRecord:
    """A set of lookups that run as one runtime group module (one kernel call)."""

    name: str
    key: tuple
    lookups: list = field(default_factory=list)  # LookupRecord, in output-column order
    module: str = ""  # attribute name of the runtime module in the GraphModule, once lowered
    # Set by choose_kernels: the kernel for training and for inference, and the decision record.
    kernel_train: str = "reference"
    kernel_eval: str = "reference"
    lower: bool = True  # False: the plain lookups stay in the graph as they were
    fused: object = None  # runtime.specs.FusedSpec when the optimizer runs inside backward
    quant: dict = field(default_factory=dict)  # param -> dtype, for inference on quantized tables
    decision: Optional["GroupDecision"] = None
    # Set by place_tables (CUDA with an HBM budget): param -> fxrec.runtime.specs.PLACEMENTS entry
    placements: dict = field(default_factory=dict)
    cache_load_factor: float = 0.2  # of its managed_caching tables: HBM cache rows / their rows

    @property
    def pooling(self) -> str:
        return self.key[0]

    @property
    def optimizer(self):
        """The group's fxrec.optim optimizer (one per group: it is part of the group key)."""
        return self.lookups[0].optimizer if self.lookups else None

    @property
    def tables(self) -> list:
        seen: list = []
        for r in self.lookups:
            if r.param not in seen:
                seen.append(r.param)
        return seen


@dataclass(frozen=True)
class GroupDecision:
    """What was decided for one group, and why: the data the report, the CLI and the tests read.

    ``kernel_train`` / ``kernel_eval`` are kernel names (:data:`fxrec.runtime.kernels.KERNEL_NAMES`),
    or ``"plain"`` for lookups left as the user wrote them. ``fused`` is the optimizer applied
    inside backward ("" when none), ``fused_by`` the kernel that applies it. ``decided_by``: "rule",
    "backend='<name>'", "autotune (measured)", "autotune (cached)" or "sharding plan".
    """

    group: str
    pooling: str
    lookups: tuple  # fxrec.report.LookupEntry of each lookup, in the group's order
    device: str
    kernel_train: str
    kernel_eval: str
    decided_by: str
    why: str
    fused: str = ""
    fused_by: str = ""
    optimizer: str = ""  # the table optimizer and where it runs, as text
    dtypes: Tuple[str, ...] = ()  # per table, as stored
    quantized: bool = False  # an inference group of quantize='s tables (``dtypes`` are quantize='s names)
    placement: str = "host"  # host (CPU memory) | device (accelerator memory) | how place_tables split it
    lowered: bool = True
    timings_ms: Tuple[Tuple[str, float], ...] = ()
    # tables stored wider than their dim (a kernel's alignment): (table, dim, stored width, extra bytes)
    padding: Tuple[Tuple[str, int, int, int], ...] = ()

    @property
    def tables(self) -> Tuple[str, ...]:
        """Each lookup's table, in the group's order."""
        return tuple(e.table for e in self.lookups)

    @property
    def features(self) -> Tuple[str, ...]:
        return tuple(e.feature for e in self.lookups)


@dataclass(frozen=True)
class RemovedLookup:
    """A lookup ``merge_lookups`` took out of the graph (plain data: it outlives the nodes).

    ``what``: ``"merged into <feature>"`` (the same table and inputs as that lookup: its users
    read that lookup's output) or ``"result unused: removed"``.
    """

    table: str
    feature: str
    source: str
    what: str


@dataclass(frozen=True)
class Fragmentation:
    """The groups ``group_lookups`` made against the fewest possible: one per kind (``kinds``:
    each pooling, "sum" / "mean", and for sequence groups each stored dim, "sequence dim 8"),
    and why each extra group is apart (``splits``: "group_3 apart from group_0: weighted vs
    unweighted", "group_5 apart from group_1: depends on the output of group_1 (...)")."""

    groups: int
    fewest: int
    kinds: Tuple[str, ...] = ()
    splits: Tuple[str, ...] = ()


def hidden_records(gm: fx.GraphModule) -> List[LookupRecord]:
    """The :class:`LookupRecord` of every lookup inside the body of a higher-order op (a
    ``torch.no_grad()`` or ``torch.autocast`` block), at any depth: left as written, and found so
    the report names them and their tables get their optimizer."""
    from .dataflow import bodies

    out: List[LookupRecord] = []
    todo = [n for n in gm.graph.nodes if n.op == "call_function"]
    while todo:
        n = todo.pop(0)
        for body, _ in bodies(n):
            for m in body.graph.nodes:
                if LOOKUP in m.meta:
                    out.append(m.meta[LOOKUP])
                if m.op == "call_function":
                    todo.append(m)
    return out


def all_records(gm: fx.GraphModule) -> List[LookupRecord]:
    """The records of the graph's own lookups, then :func:`hidden_records`."""
    return [n.meta[LOOKUP] for n in gm.graph.nodes if LOOKUP in n.meta] + hidden_records(gm)
