"""fxrec: plain PyTorch recommendation models in, fbgemm table-batched embeddings out.

    fast = fxrec.transform(model, example_inputs)
    print(fast.report)
"""

from . import checkpoint, export, optim, viz
from .api import explain, transform, write_back
from .clip_grad import clip_grad_norm_
from .table_optimizers import make_optimizer
from .capture import CaptureError
from .pass_infra import InputError, PassError
from .planner import PlanError, ShardingPlan, TableSpec, Topology, plan
from .report import Report
from .runtime.collectives import CollectiveError
from .verify import VerificationError, compare_models

__version__ = "0.1.0"

__all__ = [
    "transform", "explain", "write_back", "make_optimizer", "optim", "export", "viz", "Report", "CaptureError", "InputError", "PassError",
    "VerificationError", "compare_models", "plan", "ShardingPlan", "TableSpec", "Topology", "PlanError", "CollectiveError",
    "checkpoint", "clip_grad_norm_", "__version__",
]
