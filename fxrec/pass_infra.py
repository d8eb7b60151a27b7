"""How passes are written and run: PassContext, PassResult, the @compiler_pass decorator and
the PassManager that runs one ordered list (see fxrec/pipeline.py for the list itself)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch.fx as fx

from .report import PassRun, Report


@dataclass
class Config:
    """Everything a pass may read about how the user asked for the transform."""

    backend: str = "auto"  # auto (the rule table) | a kernel name, put first
    autotune: bool = False  # time the kernels on the example inputs (cached on disk) instead of the rules
    timing_rounds: int = 5
    # fxrec.explain: decide for this device ("cpu", "cuda") instead of the tables' own, build nothing
    device: Optional[str] = None
    # In tests: after every pass that changed the graph, compare it against the original model.
    check_numerics: bool = False
    # fxrec.optim optimizer, or dict from table name/pattern to one (None: plain gradients).
    optimizer: Any = None
    mode: str = "training"  # training | inference
    # None, "fp32", "fp16", "bf16", or dict pattern -> one of those: tables stored so in fbgemm's TBE
    weights_precision: Any = None
    # inference: None, a dtype for every table ("int8", ...), "auto", or dict pattern -> dtype
    quantize: Any = None
    output_dtype: str = "fp32"  # of quantized lookups: fp32 | fp16
    reuse_outputs: bool = True  # CPU inference of pooled groups: keep and reuse the output buffer
    plan: Any = None  # a fxrec.planner.ShardingPlan: shard the groups for this rank
    hbm_budget: Optional[int] = None  # CUDA: bytes of GPU memory the tables may take (place_tables)
    cache_load_factor: float = 0.2  # CUDA: HBM cache of a managed_caching table, as a share of its rows
    rank: int = 0
    max_gradient: float = 0.0  # training: the clamp of each lookup output's gradient (0: none)


@dataclass
class PassContext:
    config: Config
    report: Report
    example_args: Tuple[Any, ...] = ()
    example_kwargs: Dict[str, Any] = field(default_factory=dict)
    # Reference outputs of the original model on the example inputs (for check_numerics).
    reference: Optional[Callable[[fx.GraphModule], None]] = None
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("fxrec"))
    groups: list = field(default_factory=list)  # GroupRecord, filled by group_lookups
    # fp32 weights of tables that lower_groups quantized (read by measure_quantization, then dropped)
    fp32_weights: dict = field(default_factory=dict)


@dataclass
class PassResult:
    gm: fx.GraphModule
    modified: bool
    stats: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CompilerPass:
    name: str
    fn: Callable[[fx.GraphModule, PassContext], PassResult]
    needs: Tuple[str, ...] = ()  # facts (meta keys or ctx fields) that must exist before
    provides: Tuple[str, ...] = ()
    doc: str = ""

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        return self.fn(gm, ctx)


def compiler_pass(needs: Sequence[str] = (), provides: Sequence[str] = ()):
    """Mark a function ``(gm, ctx) -> PassResult`` as a pass, named after the function."""

    def wrap(fn):
        return CompilerPass(fn.__name__, fn, tuple(needs), tuple(provides), (fn.__doc__ or "").strip())

    return wrap


class PassError(RuntimeError):
    """A pass failed: a bug in fxrec or a model it does not handle; names the pass."""


class InputError(ValueError):
    """What the user asked for is wrong; raised by a pass and passed to the user as it is."""


class PassManager:
    def __init__(self, passes: Sequence[CompilerPass]):
        self.passes = list(passes)
        self._check_order()

    def _check_order(self) -> None:
        have: set = set()
        for p in self.passes:
            missing = [n for n in p.needs if n not in have]
            if missing:
                raise PassError(f"pass '{p.name}' needs {missing}, which no earlier pass provides")
            have.update(p.provides)

    def run(
        self, gm: fx.GraphModule, ctx: PassContext,
        after: Optional[Dict[str, Callable[[fx.GraphModule, PassContext], None]]] = None,
        dump: Optional[Callable[[int, str, fx.GraphModule], None]] = None,
    ) -> fx.GraphModule:
        """Run every pass in order; ``after[name]`` is called once that pass has run.

        Each pass's wall time (the pass, lint and recompile, and the numerics check when asked
        for) goes into ``ctx.report.pass_runs``. ``dump(index, name, gm)``, if given, is called
        with ``(0, "captured", gm)`` before the first pass and ``(i, pass name, gm)`` after the
        i-th (``fxrec.transform(dump_dir=...)`` writes the code and a picture there); its own
        time is not counted.
        """
        done: List[str] = []
        if dump is not None:
            dump(0, "captured", gm)
        for index, p in enumerate(self.passes, 1):
            start = time.perf_counter()
            ctx.logger.debug("running pass %s", p.name)  # progress: the CLI shows it on long transforms
            try:
                res = p(gm, ctx)
                gm = res.gm
                if res.modified:
                    gm.graph.lint()
                    gm.recompile()
                    if ctx.config.check_numerics and ctx.reference is not None:
                        ctx.reference(gm)
            except InputError:
                raise
            except Exception as e:
                before = ", ".join(done) or "none"
                raise PassError(
                    f"fxrec pass '{p.name}' failed (passes run before it: {before}): "
                    f"{type(e).__name__}: {e}"
                ) from e
            seconds = time.perf_counter() - start
            stats = ", ".join(f"{k}={v}" for k, v in res.stats.items())
            ctx.logger.info("%s: %s (%.3f s)", p.name, stats or "no change", seconds)
            ctx.report.passes.append(f"{p.name} ({stats})" if stats else p.name)
            ctx.report.pass_runs.append(PassRun(p.name, seconds, bool(res.modified), dict(res.stats)))
            done.append(p.name)
            if dump is not None:
                dump(index, p.name, gm)
            if after and p.name in after:
                after[p.name](gm, ctx)
        return gm
