"""A transformed model (no plan) wrapped by the user in torch's DistributedDataParallel, two
ranks on gloo: without a fused optimizer it trains as the plain model wrapped alike; with one,
the tables would be updated by each rank alone and drift apart, so the call is refused, naming
the tables (unless the user told DDP to leave the tables)."""

import copy
import gc

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fxrec
from tests import models as M
from tests.test_sharding import gloo_group, spawn

WORLD = 2


def _batch(rank, step):
    return M.bag_inputs(batch=4, seed=100 * step + rank)


def _plain_worker(rank, world, init_file):
    """fxrec's model and the plain one, each wrapped in DDP, four SGD steps on each rank's batch."""
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        plain = M.BagList()
        fast = fxrec.transform(copy.deepcopy(plain), _batch(rank, 0), backend="fbgemm")
        models = {"plain": DDP(plain), "fxrec": DDP(fast)}
        opts = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in models.items()}
        for step in range(4):
            x = _batch(rank, step)
            for k, m in models.items():
                opts[k].zero_grad()
                m(*x).sin().sum().backward()
                opts[k].step()
        for (name, a), (_, b) in zip(plain.state_dict().items(), fast.state_dict().items()):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
            both = [torch.empty_like(b) for _ in range(world)]
            dist.all_gather(both, b.contiguous())
            assert torch.equal(both[0], both[1]), f"{name} differs between the ranks"
        # DDP's reducer freed (by the cycle collector) after the process group is destroyed can
        # deadlock: its destructor joins gloo's thread holding the GIL, which that thread needs to
        # free the last all_gather's tensors
        del models, opts
        gc.collect()


def test_a_model_without_a_fused_optimizer_trains_in_ddp_as_the_plain_model():
    spawn(_plain_worker, WORLD)


def _fused_worker(rank, world, init_file):
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        fast = fxrec.transform(M.BagList(), _batch(rank, 0), optimizer=fxrec.optim.SGD(lr=0.1))
        wrapped = DDP(fast)
        with pytest.raises(RuntimeError, match=r"tables \['bags\.0', 'bags\.1', 'bags\.2'\] train with a fused "
                                               r"optimizer, but the model runs in DistributedDataParallel over 2 ranks"):
            wrapped(*_batch(rank, 1)).sum()
        with torch.no_grad():  # evaluation updates nothing: allowed
            wrapped(*_batch(rank, 1))
        # the tables left out of DDP on purpose: each rank trains its own, as asked
        left = fxrec.transform(M.BagList(), _batch(rank, 0), optimizer=fxrec.optim.SGD(lr=0.1))
        DDP._set_params_and_buffers_to_ignore_for_model(left, [f"bags.{i}.weight" for i in range(3)])
        before = left.get_parameter("bags.0.weight").detach().clone()
        wrapped_left = DDP(left)
        wrapped_left(*_batch(rank, 1)).sum().backward()
        assert not torch.equal(left.get_parameter("bags.0.weight").detach(), before)
        del wrapped, wrapped_left
        gc.collect()  # (see _plain_worker)


def test_a_fused_optimizer_in_ddp_is_refused_naming_the_tables():
    spawn(_fused_worker, WORLD)


class _DenseWrapped(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(20, 4, mode="sum")
        self.top = DDP(torch.nn.Linear(4, 1))

    def forward(self, ids, offsets):
        return self.top(self.bag(ids, offsets))


def _wrapped_inside_worker(rank, world, init_file):
    with gloo_group(rank, world, init_file):
        model = _DenseWrapped()
        x = (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2]))
        for call in (lambda: fxrec.transform(model, x),
                     lambda: fxrec.plan(model, x, world_size=world, memory_per_rank="1GB")):
            with pytest.raises(fxrec.CaptureError, match=r"submodule 'top' is wrapped in DistributedDataParallel.*"
                                                         r"Pass the module it wraps"):
                call()
        del model
        gc.collect()  # (see _plain_worker)


def test_a_submodule_wrapped_in_ddp_is_named_saying_what_to_pass_instead():
    """It failed in torch.export ("Non-recursive torch.compiler.disable is not supported") under
    advice about data-dependent control flow (found by a composition hunt)."""
    spawn(_wrapped_inside_worker, WORLD)
