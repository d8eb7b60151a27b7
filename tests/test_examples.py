"""The examples run as their docstrings say (docs/sharding.md quotes examples/train_dist.py)."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_dist_runs_under_torchrun_and_matches_one_process():
    """`torchrun --nproc_per_node 2 examples/train_dist.py --check --serve int8`: the demo DLRM
    sharded over 2 gloo ranks (row-wise, table-wise and data-parallel tables) against the plain
    model trained in one process on the global batch, outputs at every step and the tables at the
    end; then served int8 from its checkpoint."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        os.path.join(ROOT, "examples", "train_dist.py"), "--check", "--steps", "3", "--cap", "2000",
                        "--local-batch", "32", "--serve", "int8"], capture_output=True, text=True, timeout=300,
                       env=env, cwd=ROOT)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    m = re.search(r"world 2: 3 steps, .* largest difference from the single-process model \(outputs and tables\): "
                  r"(\S+)", r.stdout)
    assert m is not None, r.stdout[-2000:]
    assert float(m.group(1)) < 1e-4
    assert "row_wise" in r.stdout and "data_parallel" in r.stdout  # (rank 0 prints the plan)
    # --serve int8: checkpointed, loaded into the plain model, served over the 2 ranks on a plan for
    # serving: every rank's outputs those of one process's int8 model of the same weights
    m = re.search(r"served int8 over 2 ranks from the checkpoint: largest difference from one process's int8 "
                  r"model: (\S+)", r.stdout)
    assert m is not None and float(m.group(1)) < 1e-4, r.stdout[-2000:]
    assert "for serving (quantized int8)" in r.stdout


def test_train_dist_with_fsdp_dense_layers_and_clipped_gradients_matches_one_process():
    """`... examples/train_dist.py --check --dense fsdp --clip 0.05`: the dense layers sharded by
    FSDP, the gradients clipped by fxrec.clip_grad_norm_ (the plain model by torch's, to a norm
    below theirs), against the plain model on the global batch."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        os.path.join(ROOT, "examples", "train_dist.py"), "--check", "--steps", "3", "--cap", "2000",
                        "--local-batch", "32", "--dense", "fsdp", "--clip", "0.05"], capture_output=True, text=True,
                       timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    m = re.search(r"world 2: 3 steps, .* largest difference from the single-process model \(outputs and tables\): "
                  r"(\S+)", r.stdout)
    assert m is not None and float(m.group(1)) < 1e-4, r.stdout[-2000:]
    m = re.search(r"gradient norm at the first step: (\S+) \(clipped to 0.05\)", r.stdout)
    assert m is not None and float(m.group(1)) > 0.05, r.stdout[-2000:]  # (it clips)
