"""The ``fxrec`` command line: inspect, draw, plan and benchmark a model without writing a script.

    fxrec inspect path/to/model.py:factory            # the transform report
    fxrec draw path/to/model.py:factory -o graph.svg  # the transformed graph (--before/--after PASS)
    fxrec plan path/to/model.py:factory --world-size 8 --memory-per-rank 16GB [-o plan.json]
    fxrec bench path/to/model.py:factory              # plain vs fxrec forward, median speed-up

``factory`` is a function of that file (or ``package.module:factory``) called with no arguments
that returns ``(model, example_inputs)``. Exit status: 0 done, 1 error (the model file does not
import, the factory fails, the model cannot be transformed, ...), 2 wrong command line. Errors are
one paragraph on stderr; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.machinery
import importlib.util
import io
import logging
import os
import statistics
import sys
import threading
import time
import traceback
from typing import Any, Callable, List, Optional, Sequence, Tuple

from .arguments import BACKENDS, DEVICES
from .planner.cost import OPTIMIZER_STATE

PROG = "fxrec"

class CLIError(Exception):
    """An error the command reports in one paragraph and exit status 1."""


def _paragraph(text: str) -> str:
    return " ".join(str(text).split())


def parse_size(text: str) -> int:
    """``"16GB"`` -> 16 * 10**9 bytes, read by the planner's :func:`fxrec.planner.parse_bytes` (GB/MB/KB/TB
    powers of ten, GiB/MiB/KiB/TiB powers of two, a plain number bytes), so the CLI and the API agree."""
    from .planner.specs import parse_bytes
    try:
        return parse_bytes(text, "memory size", "fxrec plan")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


# --------------------------------------------------------------------------------------------
# Loading the model
# --------------------------------------------------------------------------------------------


def _user_location(exc: BaseException, path: Optional[str]) -> str:
    """`` (file.py, line 12)`` for the innermost frame in the user's file, or ""."""
    frames = traceback.extract_tb(exc.__traceback__)
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" ({exc.filename}, line {exc.lineno})"
    target = os.path.abspath(path) if path else None
    mine = [f for f in frames if target and os.path.abspath(f.filename) == target]
    if mine:
        return f" ({mine[-1].filename}, line {mine[-1].lineno})"
    return ""


#: Modules fxrec imports lazily (fxrec.viz): resolved before a model file's directory is put on
#: sys.path, so that a file of that name beside the model is never run in their place.
_LAZY_IMPORTS = ("graphviz",)


def _import_file(path: str):
    """Import a model file as a module; a file inside packages is imported under its package
    name (so its relative and package imports work), with the packages' parent on sys.path:
    first while the file is imported (its own imports find what lies beside it, as for a script),
    then last (fxrec's later imports find installed packages first)."""
    for lazy in _LAZY_IMPORTS:
        if lazy not in sys.modules:
            try:
                importlib.import_module(lazy)
            except ImportError:
                sys.modules[lazy] = None  # (not installed: its import keeps failing, never finds the model's)
    path = os.path.abspath(path)
    directory, stem = os.path.split(path)
    stem = os.path.splitext(stem)[0]
    parts = [stem]
    while os.path.isfile(os.path.join(directory, "__init__.py")):
        directory, package = os.path.split(directory)
        parts.insert(0, package)
    name = ".".join(parts)
    added = directory not in sys.path
    if added:
        sys.path.insert(0, directory)
    try:
        if all(p.isidentifier() for p in parts) and path.endswith(".py"):
            loaded = sys.modules.get(name)
            if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") == path:
                return loaded
            # imported by its name (relative imports, pickling) only where that name finds this very
            # file: a package or an extension module of the same name beside it would win otherwise
            try:
                found = importlib.util.find_spec(name) if loaded is None else None
            except (ImportError, ValueError):
                found = None
            if found is not None and found.origin and os.path.abspath(found.origin) == path:
                return importlib.import_module(name)
        name = f"_fxrec_model_{abs(hash(path))}"  # (Python source whatever its suffix)
        spec = importlib.util.spec_from_file_location(name, path, loader=importlib.machinery.SourceFileLoader(name, path))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        if added and sys.path and sys.path[0] == directory:
            sys.path.append(sys.path.pop(0))


def load_factory(spec: str) -> Tuple[Callable[[], Any], Optional[str]]:
    """``"path/file.py:factory"`` or ``"package.module:factory"`` -> (the function, its file)."""
    where, _, name = spec.rpartition(":")
    path: Optional[str] = None
    try:
        if where.endswith(".py") or os.sep in where or "/" in where:
            path = where
            if not os.path.isfile(path):
                raise CLIError(f"model file {path!r} does not exist (from {spec!r})")
            module = _import_file(path)
        else:
            module = importlib.import_module(where)
            path = getattr(module, "__file__", None)
    except CLIError:
        raise
    except BaseException as e:  # anything the user's module raises, SyntaxError and SystemExit included
        if isinstance(e, KeyboardInterrupt):
            raise
        raise CLIError(
            f"could not import {where!r}: {type(e).__name__}: {_paragraph(e)}{_user_location(e, path)}"
        ) from e
    factory = getattr(module, name, None)
    if factory is None:
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                        and getattr(v, "__module__", None) == module.__name__)
        raise CLIError(
            f"{where!r} has no {name!r}; the factory must be a function there that returns "
            f"(model, example_inputs) (functions defined there: {', '.join(public) or 'none'})"
        )
    if not callable(factory):
        raise CLIError(f"{where}:{name} is a {type(factory).__name__}, not a function returning (model, example_inputs)")
    return factory, path


def load_model(spec: str) -> Tuple[Any, tuple]:
    """Call the factory named by ``spec``; check it returned ``(nn.Module, example_inputs)``."""
    import torch

    factory, path = load_factory(spec)
    try:
        result = factory()
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise
        raise CLIError(
            f"{spec} failed: {type(e).__name__}: {_paragraph(e)}{_user_location(e, path)}"
        ) from e
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        got = f"a {type(result).__name__}" + (f" of length {len(result)}" if isinstance(result, (tuple, list)) else "")
        raise CLIError(f"{spec} must return (model, example_inputs), got {got}")
    model, inputs = result
    if not isinstance(model, torch.nn.Module):
        raise CLIError(f"{spec} must return (model, example_inputs) with an nn.Module first, got {type(model).__name__}")
    if isinstance(inputs, list):
        inputs = tuple(inputs)
    elif not isinstance(inputs, tuple):
        inputs = (inputs,)
    return model, inputs


class _Progress(logging.Handler):
    """Says on the terminal which step a transform is in, once it has taken more than
    ``after`` seconds (short transforms print nothing)."""

    def __init__(self, after: float = 2.0):
        super().__init__(logging.DEBUG)
        self.start, self.after, self.stage, self.shown = time.perf_counter(), after, "", False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True)

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("running pass ") or msg.startswith("capturing"):
            self.stage = msg
            self._show()

    def _show(self) -> None:
        elapsed = time.perf_counter() - self.start
        if elapsed >= self.after and self.stage:
            print(f"{PROG}: {elapsed:5.1f} s: {self.stage}", file=sys.__stderr__, flush=True)
            self.shown = True

    def _tick(self) -> None:
        if not self._stop.wait(self.after):
            self._show()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.shown:
            print(f"{PROG}: {time.perf_counter() - self.start:5.1f} s: done", file=sys.__stderr__, flush=True)


def _transform(args, model, inputs, **extra):
    import fxrec

    log = logging.getLogger("fxrec.cli.transform")
    log.setLevel(logging.DEBUG)
    log.propagate = False
    try:
        with _Progress() as progress:
            log.addHandler(progress)
            try:
                return fxrec.transform(
                    model, inputs, backend=args.backend, mode=args.mode, quantize=args.quantize,
                    timing_rounds=args.timing_rounds, autotune=args.autotune, logger=log, **extra,
                )
            finally:
                log.removeHandler(progress)
    except Exception as e:
        raise CLIError(f"could not transform {type(model).__name__} from {args.model}: {_paragraph(e)}") from e


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------


def cmd_inspect(args) -> int:
    model, inputs = load_model(args.model)
    if args.device is not None:  # the decisions for that device, nothing built (fxrec.explain)
        import fxrec

        try:
            report = fxrec.explain(model, inputs, device=args.device, backend=args.backend, mode=args.mode,
                                   quantize=args.quantize)
        except Exception as e:
            raise CLIError(f"could not explain {type(model).__name__} from {args.model}: {_paragraph(e)}") from e
    else:  # the model was loaded for this only: hand it over (no copy of its tables)
        report = _transform(args, model, inputs, copy_model=False).report
    if args.json:
        print(report.to_json())
    else:
        print(report)
    if args.output:
        with open(args.output, "w") as f:
            f.write(report.to_json() + "\n")
    return 0


def _pass_names(args) -> List[str]:
    from .pass_infra import Config
    from .pipeline import default_pipeline

    return [p.name for p in default_pipeline(Config(backend=args.backend, mode=args.mode, quantize=args.quantize))]


def cmd_draw(args) -> int:
    import glob
    import tempfile

    from . import viz

    if os.path.splitext(args.output)[1].lstrip(".").lower() not in ("svg", "png", "pdf", "dot", "gv"):
        raise _Usage(f"-o {args.output}: the file must end in .svg, .png, .pdf or .dot")
    names = _pass_names(args)
    stage = None  # which dump of transform(dump_dir=...) to draw: 0 = captured, i = after pass i
    wanted = args.before or args.after
    if wanted:
        valid = names + (["captured"] if args.after else [])
        if wanted not in valid:
            raise _Usage(
                f"{'--before' if args.before else '--after'} {wanted}: no such pass in this pipeline; "
                f"the passes are: {', '.join(names)}" + ("; or 'captured'" if args.after else "")
            )
        stage = 0 if wanted == "captured" else names.index(wanted) + (0 if args.before else 1)
    if stage is not None or not args.output.endswith((".dot", ".gv")):
        viz.check_graphviz()  # before the work: the dumps between passes are rendered too
    model, inputs = load_model(args.model)
    if stage is None:
        fast = _transform(args, model, inputs, copy_model=False)  # loaded for this only
        viz.draw(fast, args.output, title=f"{type(model).__name__} after fxrec.transform")
    else:
        # The graph between passes is what transform(dump_dir=...) writes: take that picture.
        with tempfile.TemporaryDirectory(prefix="fxrec-draw-") as tmp:
            _transform(args, model, inputs, dump_dir=tmp, copy_model=False)
            found = sorted(glob.glob(os.path.join(tmp, f"{stage:02d}_*.dot")))
            if not found:
                raise CLIError(f"transform wrote no graph number {stage} ({wanted}); it wrote: "
                               f"{', '.join(sorted(os.listdir(tmp)))}")
            with open(found[0]) as f:
                viz.render(f.read(), args.output)
    print(f"wrote {args.output}")
    return 0


def cmd_plan(args) -> int:
    import fxrec

    planner = getattr(fxrec, "plan", None)
    if not callable(planner):
        raise CLIError("the planner is not available in this version (fxrec.plan is missing)")
    model, inputs = load_model(args.model)
    try:
        result = planner(model, inputs, world_size=args.world_size, memory_per_rank=args.memory_per_rank,
                         hosts=args.hosts, device=args.device, batch_size=args.batch_size, optimizer=args.optimizer,
                         quantize=args.quantize)
    except Exception as e:
        raise CLIError(f"could not plan {type(model).__name__} from {args.model}: {_paragraph(e)}") from e
    print(result)
    if args.output:
        result.save(args.output)
        print(f"wrote {args.output}")
    return 0


def cmd_bench(args) -> int:
    import torch

    model, inputs = load_model(args.model)
    fast = _transform(args, model, inputs)

    def forward(m):
        def run():
            with torch.no_grad():
                m(*inputs)
        return run

    fns = {"plain": forward(model), "fxrec": forward(fast)}
    try:
        for f in fns.values():
            f()  # warm-up
        times = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, f in fns.items():  # alternating, so that machine noise hits both alike
                t = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t)
    except Exception as e:
        raise CLIError(f"running {args.model} failed: {type(e).__name__}: {_paragraph(e)}") from e
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{type(model).__name__} from {args.model}: forward under no_grad, median of {args.rounds} "
          f"alternating runs (backend={args.backend}, mode={args.mode}"
          + (f", quantize={args.quantize}" if args.quantize else "") + ")")
    print(f"  plain  {med['plain'] * 1e3:9.3f} ms")
    print(f"  fxrec  {med['fxrec'] * 1e3:9.3f} ms")
    print(f"  speed-up (plain / fxrec): {med['plain'] / med['fxrec']:.2f}x")
    return 0


# --------------------------------------------------------------------------------------------
# Parser and entry point
# --------------------------------------------------------------------------------------------


class _Usage(Exception):
    """A command-line mistake found after parsing: usage message, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``fxrec`` command."""
    from . import __version__

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("model", metavar="FILE.py:FACTORY",
                        help="a function returning (model, example_inputs): path/to/file.py:factory "
                             "or package.module:factory")
    common.add_argument("--debug", action="store_true", help="on an error, print the traceback too")
    transform = argparse.ArgumentParser(add_help=False)
    g = transform.add_argument_group("transform options (as fxrec.transform)")
    g.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="kernel to put first (default: auto, the rule table)")
    g.add_argument("--autotune", action="store_true",
                   help="time the kernels of each group on the example inputs (cached on disk)")
    g.add_argument("--mode", choices=("training", "inference"), default=None,
                   help="default: training, or inference with --quantize")
    g.add_argument("--quantize", default=None, metavar="DTYPE",
                   help="inference: int8, int4, int2, fp16, fp32 or auto")
    g.add_argument("--timing-rounds", type=_positive_int, default=5, metavar="N",
                   help="rounds per candidate when --autotune times kernels (default: 5)")

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="See what fxrec does to a model: its report, its graph before and after each "
                    "pass, a sharding plan, and a quick benchmark.",
        epilog="FACTORY is called with no arguments and returns (model, example_inputs). Exit status: "
               "0 done, 1 error, 2 wrong command line.",
    )
    parser.add_argument("--version", action="version", version=f"fxrec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("inspect", parents=[common, transform], help="transform the model and print its report",
                       description="Transform the model and print the report: lookups, groups, what was "
                                   "not lowered and why, quantization errors, time per pass.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("-o", "--output", metavar="FILE.json", help="also write the report as JSON to this file")
    p.add_argument("--device", choices=DEVICES, default=None,
                   help="the decisions transform would make on this device (cuda works without a GPU: "
                        "nothing is built, fxrec.explain)")
    p.set_defaults(run=cmd_inspect, parser=p)

    p = sub.add_parser("draw", parents=[common, transform], help="draw the graph (needs Graphviz)",
                       description="Draw the transformed graph, or the graph before/after one pass, "
                                   "as SVG, PNG, PDF or DOT (by the suffix of -o). Needs Graphviz.")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="graph.svg, graph.png, graph.pdf or graph.dot")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--before", metavar="PASS", help="the graph before this pass (e.g. annotate_lookups: "
                                                       "the captured graph)")
    when.add_argument("--after", metavar="PASS", help="the graph after this pass ('captured': before any pass)")
    p.set_defaults(run=cmd_draw, parser=p)

    p = sub.add_parser("plan", parents=[common], help="plan sharding over ranks (fxrec.plan)",
                       description="Call fxrec.plan(model, example_inputs, world_size=..., memory_per_rank=...) "
                                   "and print the plan.")
    p.add_argument("--world-size", type=_positive_int, required=True, metavar="N", help="number of ranks")
    p.add_argument("--memory-per-rank", type=parse_size, required=True, metavar="SIZE",
                   help="e.g. 16GB (powers of 10) or 16GiB (powers of 2), or bytes")
    p.add_argument("--optimizer", default=None, metavar="KIND",
                   help="the optimizer the tables train with, for its state's bytes: "
                        f"{', '.join(sorted(OPTIMIZER_STATE))} (default: none; transform(plan=..., optimizer=...) "
                        "wants the plan made with its optimizer)")
    p.add_argument("--quantize", default=None, metavar="DTYPE",
                   help="a plan for serving, shards sized as packed: int8, int4, int2, fp16, fp32 or auto "
                        "(transform(mode='inference', quantize=...) wants the same)")
    p.add_argument("--device", choices=DEVICES, default="cpu", help="the ranks' device (default: cpu)")
    p.add_argument("--hosts", type=_positive_int, default=None, metavar="N",
                   help="hosts the ranks are spread over (default: 1)")
    p.add_argument("--batch-size", type=_positive_int, default=None, metavar="N",
                   help="samples per rank and step (default: the example inputs' batch)")
    p.add_argument("-o", "--output", metavar="FILE.json", help="save the plan (plan.save)")
    p.set_defaults(run=cmd_plan, parser=p)

    p = sub.add_parser("bench", parents=[common, transform], help="time plain vs fxrec forward",
                       description="Transform the model, then time the plain model and fxrec's forward "
                                   "under no_grad on the example inputs, alternating, and print the "
                                   "medians and the speed-up.")
    p.add_argument("--rounds", type=_positive_int, default=15, help="timed runs of each (default 15)")
    p.set_defaults(run=cmd_bench, parser=p)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``fxrec`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 on a wrong command line
    if ":" not in args.model or not args.model.rpartition(":")[2] or not args.model.rpartition(":")[0]:
        parser.error(f"{args.model!r}: name the factory as FILE.py:FACTORY, e.g. examples/dlrm_factory.py:small")
    if getattr(args, "mode", "") is None:
        args.mode = "inference" if args.quantize else "training"
    if args.command == "inspect" and args.device is not None and args.autotune:  # (explain builds nothing to time)
        args.parser.error("--autotune times the kernels on the example inputs, and --device builds nothing to time; "
                          "drop one of them")
    prefix = f"{PROG} {args.command}: error:"
    # When it fails, torch.export logs and prints the graph it was building (pages of it) to
    # stderr; the error message says what matters. Without --debug, torch's warnings are kept
    # back and what the command wrote to stderr is passed on only if it succeeds.
    held = io.StringIO()
    torch_log = logging.getLogger("torch")
    level = torch_log.level
    if not args.debug:
        torch_log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(sys.stderr if args.debug else held):
            status = args.run(args)
        sys.stderr.write(held.getvalue())
        return status
    except _Usage as e:
        args.parser.print_usage(sys.stderr)
        print(f"{prefix} {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prefix} interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            traceback.print_exc()
        message = str(e) if isinstance(e, CLIError) else f"{type(e).__name__}: {e}"
        hint = "" if args.debug else " (run with --debug for the traceback)"
        print(f"{prefix} {_paragraph(message)}{hint}", file=sys.stderr)
        return 1
    finally:
        torch_log.setLevel(level)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
