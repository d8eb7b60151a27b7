"""The parts composed, as a user runs them: a model trained sharded over 2 ranks with a fused
optimizer, checkpointed, resumed in one process and trained on, then served quantized over 2
ranks on a plan made for serving. Each stage is compared with the plain PyTorch model (training)
or with one process serving the same weights (serving)."""

import os
import sys

import torch
import torch.distributed as dist

import fxrec

from .test_sharding import LOCAL_B, Model, global_batch, gloo_group, local_batch, spawn

WORLD = 2
LR = 0.1
PINS = {"bags.0": ("table_wise", 1), "bags.1": "row_wise", "bags.2": {"sharding": "column_wise", "ranks": [0, 1]},
        "single": "data_parallel"}


def _plain_step(ref, ref_opt, step):
    x = global_batch(LOCAL_B * WORLD, step + 1)
    cot = torch.randn(LOCAL_B * WORLD, generator=torch.Generator().manual_seed(100 + step))
    ref_opt.zero_grad()
    out = ref(*x)
    (out * cot).sum().backward()
    ref_opt.step()
    return x, cot, out.detach()


def _sharded_steps(fast, opt, ref, ref_opt, rank, steps):
    """This rank's steps on its slice of each global batch, its outputs the plain model's."""
    for step in steps:
        x, cot, want = _plain_step(ref, ref_opt, step)
        got = fast(*local_batch(x, rank, LOCAL_B))
        mine = slice(rank * LOCAL_B, (rank + 1) * LOCAL_B)
        torch.testing.assert_close(got, want[mine], rtol=1e-5, atol=1e-6, msg=f"step {step}")
        opt.zero_grad()
        (got * cot[mine]).sum().backward()
        opt.step()


def _train_sharded_and_save(rank, world, init_file, root):
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = Model()
        ref = Model()
        ref.load_state_dict(model.state_dict())
        ref_opt = torch.optim.Adagrad(ref.parameters(), lr=LR)
        example = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)
        plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins=PINS,
                          optimizer=fxrec.optim.Adagrad(lr=LR))
        fast = fxrec.transform(model, example, plan=plan, optimizer=fxrec.optim.Adagrad(lr=LR))
        opt = fast.make_optimizer(torch.optim.Adagrad, lr=LR)
        _sharded_steps(fast, opt, ref, ref_opt, rank, range(3))
        fxrec.checkpoint.save(fast, os.path.join(root, "trained"), optimizer=opt)
        if rank == 0:
            torch.save({"model": ref.state_dict(), "opt": ref_opt.state_dict()}, os.path.join(root, "plain.pt"))
        dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def _resume_sharded_under_another_plan(rank, world, init_file, root):
    """The tables laid out otherwise: 'single' fused row-wise (torch.optim's state when saved),
    'bags.2' data-parallel (fused column-wise when saved): 2 more steps, the plain model's."""
    with gloo_group(rank, world, init_file):
        plain = torch.load(os.path.join(root, "plain.pt"))
        ref = Model()
        ref.load_state_dict(plain["model"])
        ref_opt = torch.optim.Adagrad(ref.parameters(), lr=LR)
        ref_opt.load_state_dict(plain["opt"])
        torch.manual_seed(11)  # (other initial weights: all of them come from the checkpoint)
        model = Model()
        example = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)
        pins = {"bags.0": "row_wise", "bags.1": ("table_wise", 0), "bags.2": "data_parallel", "single": "row_wise"}
        plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins=pins,
                          optimizer=fxrec.optim.Adagrad(lr=LR))
        fast = fxrec.transform(model, example, plan=plan, optimizer=fxrec.optim.Adagrad(lr=LR))
        opt = fast.make_optimizer(torch.optim.Adagrad, lr=LR)
        fxrec.checkpoint.load(fast, os.path.join(root, "trained"), optimizer=opt)
        _sharded_steps(fast, opt, ref, ref_opt, rank, range(3, 5))
        dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def _serve_sharded(rank, world, init_file, root):
    with gloo_group(rank, world, init_file):
        model = Model()
        fxrec.checkpoint.load_into_model(model, os.path.join(root, "final"))
        model.eval()
        example = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)
        plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", quantize="int8",
                          pins={"bags.0": ("table_wise", 0), "bags.1": "row_wise", "bags.2": ("table_wise", 1),
                                "single": ("table_wise", 0)})
        fast = fxrec.transform(model, example, mode="inference", quantize="int8", plan=plan)
        single = fxrec.transform(model, global_batch(LOCAL_B * world, 0), mode="inference", quantize="int8")
        with torch.no_grad():
            for step in range(3):
                x = global_batch(LOCAL_B * world, 50 + step)
                want = single(*x)[rank * LOCAL_B:(rank + 1) * LOCAL_B]
                torch.testing.assert_close(fast(*local_batch(x, rank, LOCAL_B)), want, msg=f"batch {step}")
        dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def test_train_sharded_checkpoint_resume_under_another_plan_and_in_one_process_then_serve_quantized_sharded(tmp_path):
    # 1. 3 steps over 2 ranks (table-, row-, column-wise and data-parallel tables, fused Adagrad),
    #    each step's outputs those of the plain model; saved with the optimizer's states
    spawn(_train_sharded_and_save, WORLD, str(tmp_path))

    # 2. resumed over 2 ranks under another plan (a data-parallel table fused, a fused one
    #    data-parallel), and in one process (fused Adagrad, its states and the dense optimizer's
    #    from the checkpoint), 2 more steps each: the plain model trained 5 steps without a break
    spawn(_resume_sharded_under_another_plan, WORLD, str(tmp_path))
    plain = torch.load(tmp_path / "plain.pt")
    ref = Model()
    ref.load_state_dict(plain["model"])
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=LR)
    ref_opt.load_state_dict(plain["opt"])
    torch.manual_seed(7)  # (other initial weights: all of them come from the checkpoint)
    one = fxrec.transform(Model(), global_batch(LOCAL_B * WORLD, 0), optimizer=fxrec.optim.Adagrad(lr=LR))
    opt = one.make_optimizer(torch.optim.Adagrad, lr=LR)
    fxrec.checkpoint.load_into_model(one, tmp_path / "trained", optimizer=opt)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(one.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=f"resumed {name}")
    for step in range(3, 5):
        x, cot, want = _plain_step(ref, ref_opt, step)
        got = one(*x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"step {step}")
        opt.zero_grad()
        (got * cot).sum().backward()
        opt.step()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(one.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=f"trained on {name}")
    fxrec.checkpoint.save_model(one, tmp_path / "final")

    # 3. served int8 over 2 ranks on a plan for serving: one process's int8 outputs of those weights
    spawn(_serve_sharded, WORLD, str(tmp_path))
