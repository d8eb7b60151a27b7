"""The `fxrec` command line: the console script in a subprocess on the example model and on
broken model files; argument handling and the plan wiring in-process (fast)."""

import argparse
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import fxrec
from fxrec import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = "examples/dlrm_factory.py:small"
FAST = ["--backend", "fbgemm"]  # fbgemm first: no kernel build on a fresh machine
HAVE_DOT = shutil.which("dot") is not None

TINY = '''
import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(40, 8) for _ in range(3)])
        self.top = nn.Linear(24, 1)

    def forward(self, ids, offsets):
        return self.top(torch.cat([b(i, o) for b, i, o in zip(self.bags, ids, offsets)], 1))


def small():
    torch.manual_seed(0)
    ids = [torch.randint(0, 40, (8,)) for _ in range(3)]
    offsets = [torch.arange(0, 8, 2) for _ in range(3)]
    return Tiny(), (ids, offsets)


def wrong():
    return Tiny()


def fails():
    raise RuntimeError("the data is not there")
'''

BROKEN_IMPORT = '''
import torch

WIDTH = undefined_name * 2


def small():
    return torch.nn.Linear(2, 2), (torch.rand(3, 2),)
'''

BROKEN_TRACE = '''
import torch
from torch import nn


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(10, 4)

    def forward(self, ids, offsets):
        out = self.emb(ids, offsets)
        if out.sum() > 0:
            return out * 2
        return out


def small():
    return Branchy(), (torch.randint(0, 10, (8,)), torch.arange(0, 8, 2))
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    out = {}
    for name, text in (("tiny_model", TINY), ("broken_import", BROKEN_IMPORT), ("broken_trace", BROKEN_TRACE)):
        path = d / f"{name}.py"
        path.write_text(textwrap.dedent(text))
        out[name] = str(path)
    return out


@pytest.fixture(scope="module")
def script():
    path = os.path.join(os.path.dirname(sys.executable), "fxrec")
    if not os.path.exists(path):
        pytest.fail(f"the console script {path} is missing: reinstall fxrec (pip install -e .) so that "
                    "pyproject.toml's [project.scripts] is installed")
    return path


def run(script, *args, timeout=240):
    return subprocess.run([script, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def one_paragraph(stderr: str) -> str:
    text = stderr.strip()
    assert "Traceback" not in text
    assert len(text.splitlines()) == 1, text
    return text


# --------------------------------------------------------------------------------------------
# The console script, in a subprocess
# --------------------------------------------------------------------------------------------


def test_help_version_and_python_m(script):
    r = run(script, "--help")
    assert r.returncode == 0
    for command in ("inspect", "draw", "plan", "bench"):
        assert command in r.stdout
    r = subprocess.run([sys.executable, "-m", "fxrec", "draw", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "--before PASS" in r.stdout and "--after PASS" in r.stdout
    r = run(script)  # no command: a usage error
    assert r.returncode == 2 and "usage: fxrec" in r.stderr and r.stdout == ""


def test_inspect_prints_the_report_of_the_example_model(script):
    r = run(script, "inspect", EXAMPLE, *FAST)
    assert r.returncode == 0, r.stderr
    assert "26 embedding lookups found, 26 lowered into 1 group(s), 0 left as they were" in r.stdout
    assert "Pass wall time" in r.stdout


@pytest.mark.skipif(not HAVE_DOT, reason="Graphviz's 'dot' is not installed (apt-get install graphviz)")
def test_draw_the_example_model_before_the_first_pass(script, tmp_path):
    out = tmp_path / "before.svg"
    r = run(script, "draw", EXAMPLE, "--before", "annotate_lookups", "-o", str(out), *FAST)
    assert r.returncode == 0, r.stderr
    svg = out.read_text()
    assert "<svg" in svg and "captured graph" in svg and "emb.25" in svg
    assert 'fill="#f9cb9c"' in svg  # lookups
    assert 'fill="#93c47d"' not in svg  # no group yet


def test_bench_the_example_model(script):
    r = run(script, "bench", EXAMPLE, "--rounds", "3", *FAST)
    assert r.returncode == 0, r.stderr
    assert "median of 3 alternating runs" in r.stdout
    assert float(r.stdout.split("speed-up (plain / fxrec):")[1].strip().rstrip("x")) > 0


def test_model_file_that_does_not_import(script, files):
    r = run(script, "inspect", files["broken_import"] + ":small")
    assert r.returncode == 1 and r.stdout == ""
    text = one_paragraph(r.stderr)
    assert text.startswith("fxrec inspect: error: could not import")
    assert "NameError: name 'undefined_name' is not defined" in text
    assert "broken_import.py, line 4" in text and "--debug" in text
    r = run(script, "inspect", files["broken_import"] + ":small", "--debug")
    assert r.returncode == 1 and "Traceback (most recent call last)" in r.stderr


def test_model_that_cannot_be_captured(script, files):
    r = run(script, "inspect", files["broken_trace"] + ":small")
    assert r.returncode == 1
    text = one_paragraph(r.stderr)  # torch.export's partial graph print is held back
    assert "could not transform Branchy" in text and "broken_trace.py:13" in text and "What to do" in text


# --------------------------------------------------------------------------------------------
# In-process: argument handling, factories, plan wiring, JSON
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["inspect", "nocolon"], "name the factory as FILE.py:FACTORY"),
    (["plan", "m.py:f", "--world-size", "0", "--memory-per-rank", "1GB"], "must be 1 or more"),
    (["plan", "m.py:f", "--world-size", "8", "--memory-per-rank", "16XB"], "cannot read memory size='16XB'"),
    (["plan", "m.py:f", "--world-size", "8"], "--memory-per-rank"),
    (["draw", "m.py:f"], "-o/--output"),
    (["draw", "m.py:f", "-o", "g.svg", "--before", "a", "--after", "b"], "not allowed with"),
    (["bench", "m.py:f", "--backend", "fast"], "invalid choice"),
])
def test_command_line_mistakes_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_draw_checks_its_arguments_before_loading_the_model(files, capsys):
    assert cli.main(["draw", files["tiny_model"] + ":small", "-o", "graph.jpg"]) == 2
    assert "must end in .svg, .png, .pdf or .dot" in capsys.readouterr().err
    assert cli.main(["draw", files["tiny_model"] + ":small", "-o", "g.svg", "--after", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "usage: fxrec draw" in err
    assert "no such pass" in err and "annotate_lookups, merge_lookups, assign_optimizers, group_lookups" in err


@pytest.mark.parametrize("factory, message", [
    ("nosuch", "has no 'nosuch'; the factory must be a function there that returns (model, example_inputs) "
               "(functions defined there: Tiny, fails, small, wrong)"),
    ("wrong", "must return (model, example_inputs), got a Tiny"),
    ("fails", "failed: RuntimeError: the data is not there (" ),
])
def test_factory_mistakes_exit_1(files, factory, message, capsys):
    assert cli.main(["inspect", f"{files['tiny_model']}:{factory}"]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_missing_model_file_exits_1(capsys):
    assert cli.main(["inspect", "no/such/model.py:small"]) == 1
    assert "model file 'no/such/model.py' does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("name, beside", [("model.py", "model/__init__.py"), ("model.txt", "model.py")])
def test_the_model_file_named_is_the_one_run(tmp_path, capsys, name, beside):
    """A package, or a .py, of the file's name beside it was imported in its place (Python's
    finder picks those first)."""
    (tmp_path / name).write_text(TINY)
    (tmp_path / beside).parent.mkdir(exist_ok=True)
    (tmp_path / beside).write_text("def small():\n    raise RuntimeError('the wrong file ran')\n")
    assert cli.main(["inspect", str(tmp_path / name) + ":small", *FAST, "--json"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["summary"]["lowered"] == 3


def test_inspect_json(files, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert cli.main(["inspect", files["tiny_model"] + ":small", *FAST, "--json", "-o", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert [t["name"] for t in printed["tables"]] == ["bags.0", "bags.1", "bags.2"]
    assert printed["summary"]["lowered"] == 3 and printed["plan_per_rank"] == []


def test_draw_final_graph_as_dot_needs_no_graphviz_program(files, tmp_path, monkeypatch, capsys):
    from fxrec import viz

    monkeypatch.setattr(viz.shutil, "which", lambda name: None)
    out = tmp_path / "graph.dot"
    assert cli.main(["draw", files["tiny_model"] + ":small", "-o", str(out), *FAST]) == 0
    dot = out.read_text()
    assert "Tiny after fxrec.transform" in dot and 'class="fxrec-group"' in dot
    # a picture, or a graph between passes (rendered while transforming), needs it: exit 1, saying so
    assert cli.main(["draw", files["tiny_model"] + ":small", "-o", str(tmp_path / "g.svg"), *FAST]) == 1
    assert "apt-get install graphviz" in capsys.readouterr().err


def test_plan_calls_fxrec_plan_with_its_options(files, tmp_path, capsys):
    """The command's plan is fxrec.plan's for the same arguments; --optimizer, --device, --hosts and
    --batch-size reach it (the command planned for a CPU, no optimizer and the examples' batch only,
    a plan transform(optimizer=...) then accepts only with a warning)."""
    import importlib.util

    out = str(tmp_path / "plan.json")
    argv = ["plan", files["tiny_model"] + ":small", "--world-size", "2", "--memory-per-rank", "1GB",
            "--optimizer", "rowwise_adagrad", "--device", "cuda", "--hosts", "1", "--batch-size", "64", "-o", out]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    spec = importlib.util.spec_from_file_location("tiny_model_for_plan", files["tiny_model"])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model, inputs = mod.small()
    want = fxrec.plan(model, inputs, world_size=2, memory_per_rank="1GB", optimizer="rowwise_adagrad", device="cuda",
                      hosts=1, batch_size=64)
    got = fxrec.planner.ShardingPlan.load(out)
    assert got.to_dict() == want.to_dict()
    assert (got.optimizer, got.batch_size, got.topology.device) == ("rowwise_adagrad", 64, "cuda"), got
    assert str(want).splitlines()[0] in printed


def test_plan_defaults_to_a_cpu_plan_with_no_optimizer_and_the_examples_batch(files, tmp_path, capsys):
    out = str(tmp_path / "plan.json")
    assert cli.main(["plan", files["tiny_model"] + ":small", "--world-size", "2", "--memory-per-rank", "1GB",
                     "-o", out]) == 0
    got = fxrec.planner.ShardingPlan.load(out)
    assert (got.optimizer, got.batch_size, got.topology.device) == ("none", 4, "cpu"), got


def test_plan_with_quantize_plans_for_serving(files, tmp_path, capsys):
    out = str(tmp_path / "plan.json")
    assert cli.main(["plan", files["tiny_model"] + ":small", "--world-size", "2", "--memory-per-rank", "1GB",
                     "--quantize", "int4", "-o", out]) == 0
    assert "for serving (quantized int4)" in capsys.readouterr().out
    got = fxrec.planner.ShardingPlan.load(out)
    assert got.serving and {tp.spec.quantize for tp in got.tables.values()} == {"int4"}
    assert cli.main(["plan", files["tiny_model"] + ":small", "--world-size", "2", "--memory-per-rank", "1GB",
                     "--quantize", "int4", "--optimizer", "sgd"]) == 1
    assert "quantize makes a plan for serving, and optimizer= is for training" in capsys.readouterr().err


def test_quantize_on_the_command_line_means_inference_and_device_refuses_autotune(files, capsys):
    """--quantize without --mode captured the model, then failed: quantize= needs mode='inference'.
    --autotune with --device was dropped without a word (explain builds nothing to time)."""
    assert cli.main(["inspect", files["tiny_model"] + ":small", "--quantize", "int8", "--json", *FAST]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {q["dtype"] for q in report["quantization"]} == {"int8"}, report  # (quantize= runs only in inference)
    with pytest.raises(SystemExit) as e:
        cli.main(["inspect", files["tiny_model"] + ":small", "--device", "cuda", "--autotune"])
    assert e.value.code == 2
    assert "--device builds nothing to time" in capsys.readouterr().err
    # an explicit --mode training with --quantize is still refused
    assert cli.main(["inspect", files["tiny_model"] + ":small", "--quantize", "int8", "--mode", "training"]) == 1
    assert "quantize= needs mode='inference'" in capsys.readouterr().err


def test_plan_without_a_planner_exits_1(files, monkeypatch, capsys):
    monkeypatch.delattr(fxrec, "plan", raising=False)
    argv = ["plan", files["tiny_model"] + ":small", "--world-size", "8", "--memory-per-rank", "16GB"]
    assert cli.main(argv) == 1
    assert "the planner is not available in this version" in capsys.readouterr().err


def test_memory_sizes():
    assert cli.parse_size("16GB") == 16 * 10**9
    assert cli.parse_size("16GiB") == 16 * 2**30
    assert cli.parse_size("512 mib") == 512 * 2**20
    assert cli.parse_size("1.5GB") == 1_500_000_000
    assert cli.parse_size("4096") == 4096
    with pytest.raises(argparse.ArgumentTypeError, match="'1e400' is too large"):  # (an OverflowError traceback)
        cli.parse_size("1e400")


def test_memory_sizes_read_as_the_api_reads_them():
    # One parser: the CLI took "1.5e9" as bytes only by luck and refused ".5GB" and "1E9", which
    # fxrec.plan(memory_per_rank=...) takes.
    for text in (".5GB", "1E9", "1.5e9", "2.GiB", "16 gb", "4096"):
        assert cli.parse_size(text) == fxrec.planner.parse_bytes(text), text
    for bad in ("16G", "-1GB", "0", "", "GB"):
        with pytest.raises(argparse.ArgumentTypeError, match="memory size"):
            cli.parse_size(bad)


def test_inspect_for_a_device_not_here_shows_the_decisions_without_building(files, capsys):
    assert cli.main(["inspect", files["tiny_model"] + ":small", "--device", "cuda", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(g["device"], g["kernel_train"], g["decided_by"]) for g in data["groups"]] == [("cuda", "fbgemm", "rule")]
    assert any("nothing was built" in n for n in data["notes"])


def test_inspect_autotune_says_it_measured(files, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FXREC_CACHE", str(tmp_path))
    assert cli.main(["inspect", files["tiny_model"] + ":small", "--autotune", "--timing-rounds", "1", "--json"]) == 0
    (g,) = json.loads(capsys.readouterr().out)["groups"]
    assert g["decided_by"] == "autotune (measured)" and g["timings_ms"]


def test_progress_is_shown_only_for_long_transforms(capsys):
    import logging

    log = logging.getLogger("fxrec.test.progress")
    log.setLevel(logging.DEBUG)
    with cli._Progress(after=0.0) as p:
        log.addHandler(p)
        log.debug("running pass group_lookups")
        log.removeHandler(p)
    with cli._Progress(after=60.0) as quiet:
        log.addHandler(quiet)
        log.debug("running pass group_lookups")
        log.removeHandler(quiet)
    assert p.shown and not quiet.shown


def test_a_file_beside_the_model_named_like_a_module_fxrec_imports_is_not_run(script, tmp_path):
    """Only the model file (and what it imports) runs: a graphviz.py beside it was imported by
    fxrec.viz's lazy import, since the model's directory stayed first on sys.path."""
    d = tmp_path / "shadow"
    d.mkdir()
    (d / "model.py").write_text(textwrap.dedent(TINY))
    marker = tmp_path / "ran"
    (d / "graphviz.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    r = run(script, "draw", f"{d / 'model.py'}:small", "-o", str(tmp_path / "g.dot"))
    assert not marker.exists(), r.stdout + r.stderr
    assert r.returncode == 0 and (tmp_path / "g.dot").exists(), r.stderr
