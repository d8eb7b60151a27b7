"""The demo DLRM (examples/dlrm.py) as TorchRec builds it, sharded by DistributedModelParallel on
the tables and plan fxrec uses: the peer of benchmarks/bench_sharded.py. TorchRec is a
benchmark-only dependency; nothing in fxrec imports this.

* :class:`TorchRecDLRM`: the same model, the tables in one ``EmbeddingBagCollection`` (table
  ``t{i}`` read by feature ``f{i}`` for ``emb.{i}``), the same bottom / top MLPs and the same
  interaction (pairwise dots, lower triangle in the same order), so the outputs are equal.
* :func:`torchrec_sharding`: fxrec's plan as TorchRec's per-table sharding (same type, same ranks);
  types TorchRec cannot run here go through ``fallback`` (recorded).
* :func:`build_dmp`: DistributedModelParallel over gloo on CPU, either the ``dense`` compute kernel
  (fbgemm's DenseTableBatchedEmbeddingBagsCodegen: the tables get gradients, torch.optim.SGD
  steps them, like fxrec's unfused variant) or the ``fused`` one (fbgemm's
  SplitTableBatchedEmbeddingBagsCodegen with EXACT_ROWWISE_ADAGRAD applied in backward, like
  fxrec's fused row-wise Adagrad). Data-parallel tables take TorchRec's ``dense`` kernel in both
  (TorchRec has no fused kernel for them); in the fused variant a row-wise Adagrad in
  ``step()`` updates them, as fxrec's fallback (RowWiseAdagradTorch) does.

What TorchRec 1.8.0 runs on CPU with gloo (tried at world size 2): table-wise, row-wise,
column-wise, table-row-wise and data-parallel, with the ``dense`` and ``fused`` kernels (fused:
not for data-parallel, which TorchRec always runs ``dense``). ``fallback`` stays for a type
that would not.

Gradients: fxrec sums every gradient over ranks (the loss is a sum over the global batch).
TorchRec averages by default: DDP (around the dense modules and around its data-parallel
lookups) averages, and its all-to-all / reduce-scatter backward divides the sharded tables'
gradients by the world size (``comm_ops.GRADIENT_DIVISION``). Here TorchRec is set to sum as well
(``set_gradient_division(False)``, and a summing communication hook on each DDP): the same
arithmetic with the same collectives, so one training step gives the same weights.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from torchrec.distributed import comm_ops
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    column_wise, construct_module_sharding_plan, data_parallel, row_wise, table_row_wise, table_wise,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from fbgemm_gpu.split_embedding_configs import EmbOptimType

DENSE, FUSED = "dense", "fused"


def table_name(i: int) -> str:
    return f"t{i}"


def feature_name(i: int) -> str:
    return f"f{i}"


class TorchRecDLRM(nn.Module):
    """examples.dlrm.DLRM with its ``nn.EmbeddingBag`` list as one EmbeddingBagCollection."""

    def __init__(self, src: nn.Module):
        super().__init__()
        bags = list(src.emb)
        self.num_tables = len(bags)
        self.dim = bags[0].embedding_dim
        self.features = [feature_name(i) for i in range(self.num_tables)]
        self.ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=table_name(i), embedding_dim=b.embedding_dim,
                                       num_embeddings=b.num_embeddings, feature_names=[feature_name(i)],
                                       pooling=PoolingType.SUM)
                    for i, b in enumerate(bags)],
            device=torch.device("cpu"),
        )
        with torch.no_grad():
            for i, b in enumerate(bags):
                self.ebc.embedding_bags[table_name(i)].weight.copy_(b.weight)
        self.bottom = copy.deepcopy(src.bottom)
        self.top = copy.deepcopy(src.top)

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        x = self.bottom(dense)
        pooled = self.ebc(kjt).to_dict()  # a sharded EBC's KeyedTensor groups its keys by sharding type
        feats = torch.stack([x] + [pooled[f] for f in self.features], dim=1)  # [B, 27, D]
        inter = torch.bmm(feats, feats.transpose(1, 2))
        li, lj = torch.tril_indices(feats.shape[1], feats.shape[1], offset=-1)
        z = torch.cat([x, inter[:, li, lj]], dim=1)
        return self.top(z).squeeze(1)


def to_kjt(ids: List[torch.Tensor], offsets: List[torch.Tensor]) -> KeyedJaggedTensor:
    """The DLRM's per-feature (ids, offsets) bags as one KeyedJaggedTensor (feature f{i} = bag i)."""
    lengths = [torch.diff(o, append=torch.tensor([i.numel()], dtype=o.dtype)) for i, o in zip(ids, offsets)]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[feature_name(i) for i in range(len(ids))],
        values=torch.cat(ids),
        lengths=torch.cat(lengths).to(torch.int64),
    )


def torchrec_sharding(plan, num_tables: int, fallback: Optional[Dict[str, str]] = None) -> Dict[str, Tuple[str, list]]:
    """fxrec plan -> {torchrec table: (sharding type, ranks)}: the type fxrec chose for ``emb.{i}``
    (``fallback`` maps a type to the one TorchRec runs instead), on the same ranks."""
    fallback = fallback or {}
    out = {}
    for i in range(num_tables):
        tp = plan.tables[f"emb.{i}"]
        kind = fallback.get(tp.sharding, tp.sharding)
        ranks = sorted({s.rank for s in tp.shards})
        if kind == "table_wise" and len(ranks) != 1:
            ranks = ranks[:1]
        out[table_name(i)] = (kind, ranks)
    return out


def _generator(kind: str, ranks: list, kernel: str):
    if kind == "data_parallel":
        return data_parallel()
    if kind == "table_wise":
        return table_wise(rank=ranks[0], compute_kernel=kernel)
    if kind == "row_wise":
        return row_wise(compute_kernel=kernel)
    if kind == "column_wise":
        return column_wise(ranks=ranks, compute_kernel=kernel)
    if kind == "table_row_wise":  # its generator takes no compute_kernel: set it on what it gives
        gen = table_row_wise(host_index=ranks[0] // dist.get_world_size())

        def with_kernel(*args, **kwargs):
            ps = gen(*args, **kwargs)
            ps.compute_kernel = kernel
            return ps

        return with_kernel
    raise ValueError(f"torchrec peer: no TorchRec sharding for {kind!r}")


class RowWiseAdagrad(torch.optim.Optimizer):
    """fbgemm's row-wise Adagrad (``sum += mean(g**2)`` per row, ``w -= lr * g / (sqrt(sum) + eps)``,
    as fxrec.optim.RowWiseAdagradTorch) for TorchRec's dense-kernel table parameters, read as rows
    of ``dim`` whatever their shape (a TBE's weights can be one flat tensor)."""

    def __init__(self, params, dim: int, lr: float = 1e-2, eps: float = 1e-8):
        super().__init__(params, dict(lr=lr, eps=eps, dim=dim))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                w, g = p.view(-1, group["dim"]), p.grad.view(-1, group["dim"])
                st = self.state[p]
                if "sum" not in st:
                    st["sum"] = torch.zeros(w.shape[0], dtype=w.dtype)
                st["sum"].add_(g.pow(2).mean(dim=1))
                w.addcdiv_(g, (st["sum"].sqrt() + group["eps"]).unsqueeze(1), value=-group["lr"])


class _DMPOptimizer:
    """zero_grad / step over the DMP's non-fused parameters (the fused tables update in backward)."""

    def __init__(self, opts):
        self.opts = opts

    def zero_grad(self, set_to_none: bool = True):
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self):
        for o in self.opts:
            o.step()


def _sum_buckets(state, bucket):
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def build_dmp(src: nn.Module, plan, kernel: str, lr: float = 0.1, eps: float = 1e-8,
              fallback: Optional[Dict[str, str]] = None):
    """(DistributedModelParallel, optimizer, info) for rank ``dist.get_rank()``.

    ``kernel``: ``"dense"`` (tables get gradients; SGD(lr) on every parameter) or ``"fused"``
    (sharded tables: fbgemm EXACT_ROWWISE_ADAGRAD(lr, eps) in backward; data-parallel tables:
    row-wise Adagrad in step(); the rest SGD(lr)). ``info``: what TorchRec actually runs."""
    world = dist.get_world_size()
    comm_ops.set_gradient_division(False)  # summed table gradients, as fxrec's (see the module doc)
    model = TorchRecDLRM(src)
    wanted = torchrec_sharding(plan, model.num_tables, fallback)
    fused_params = None
    if kernel == FUSED:
        fused_params = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": lr, "eps": eps}
    sharder = EmbeddingBagCollectionSharder(fused_params=fused_params)
    per_param = {t: _generator(kind, ranks, None if kind == "data_parallel" else kernel)
                 for t, (kind, ranks) in wanted.items()}
    module_plan = construct_module_sharding_plan(model.ebc, per_param, sharder=sharder, local_size=world,
                                                 world_size=world, device_type="cpu")
    dmp = DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
        plan=ShardingPlan({"ebc": module_plan}), sharders=[sharder], init_data_parallel=True,
    )
    # DMP's DDP over the dense modules, and the DDP TorchRec puts around its data-parallel lookups
    # (a sharded EBC keeps its lookups in a plain list, out of modules())
    lookups = [lk for m in dmp.modules() for lk in getattr(m, "_lookups", [])]
    ddps = [m for m in [*dmp.modules(), *lookups] if isinstance(m, nn.parallel.DistributedDataParallel)]
    for m in ddps:
        m.register_comm_hook(None, _sum_buckets)
    _copy_tables(dmp, src)

    dp_tables = [t for t, (kind, _) in wanted.items() if kind == "data_parallel"]
    dense_params, dp_params = [], []
    for name, p in dmp.named_parameters():
        if not p.requires_grad:
            continue
        parts = name.split(".")  # ebc.embedding_bags.<table>.weight (<t1>/<t2>/... for a combined TBE weight)
        is_dp_table = parts[0] == "ebc" and any(t in parts[-2].split("/") for t in dp_tables)
        (dp_params if kernel == FUSED and is_dp_table else dense_params).append(p)
    opts = [torch.optim.SGD(dense_params, lr=lr)]
    if dp_params:
        opts.append(RowWiseAdagrad(dp_params, dim=model.dim, lr=lr, eps=eps))
    info = {
        "sharding": {t: {"type": ps.sharding_type, "compute_kernel": ps.compute_kernel, "ranks": ps.ranks}
                     for t, ps in module_plan.items()},
        "fused_optimizer": (f"fbgemm EXACT_ROWWISE_ADAGRAD lr={lr} eps={eps} in backward (sharded tables); "
                            "data-parallel tables: row-wise Adagrad in step()") if kernel == FUSED else None,
        "dense_optimizer": f"torch.optim.SGD lr={lr}",
        "ddp_modules": len(ddps),
        "ddp_comm_hook": "sum over ranks (as fxrec's), on every DDP TorchRec made",
        "gradient_division": comm_ops.get_gradient_division(),
        "non_fused_params": {"sgd": len(dense_params), "rowwise_adagrad": len(dp_params)},
        "lookup_modules": sorted({type(m).__name__ for lk in lookups for m in lk.modules()
                                  if "Batched" in type(m).__name__ or "Lookup" in type(m).__name__}),
    }
    return dmp, _DMPOptimizer(opts), info


@torch.no_grad()
def _copy_tables(dmp: nn.Module, src: nn.Module) -> None:
    """Put src's table weights into the DMP's shards: on CPU, TorchRec does not load the unsharded
    module's weights (it initialises the shards itself). The state dict's tensors are views of the
    kernels' weights."""
    sd = dmp.state_dict()
    for i, bag in enumerate(src.emb):
        key = f"ebc.embedding_bags.{table_name(i)}.weight"
        t = sd[key]
        full = bag.weight
        if hasattr(t, "local_shards"):  # ShardedTensor: this rank's pieces
            for sh in t.local_shards():
                (r0, c0), (nr, nc) = sh.metadata.shard_offsets, sh.metadata.shard_sizes
                sh.tensor.copy_(full[r0:r0 + nr, c0:c0 + nc])
        else:
            t.copy_(full)
