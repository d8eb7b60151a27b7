"""fxrec.viz (graph pictures), transform(dump_dir=...), and the report's JSON and pass times.

The drawing tests read the DOT source (node kinds, colours, clusters), which needs only the
graphviz Python package; the tests that render need Graphviz's `dot` program (`make test`
installs it as root) and are skipped, saying so, where it is missing.
"""

import json
import os
import re
import shutil

import pytest
import torch
import torch.fx as fx
from torch import nn

import fxrec
from fxrec import viz
from fxrec.capture import capture
from fxrec.runtime.group import EmbeddingGroup
from fxrec.runtime.specs import FeatureSpec, TableSpec

HAVE_DOT = shutil.which("dot") is not None
needs_dot = pytest.mark.skipif(
    not HAVE_DOT, reason="Graphviz's 'dot' is not installed (apt-get install graphviz): rendering not tested"
)


class Tiny(nn.Module):
    """Three sum bags in a ModuleList (grouped), one max bag (left alone), two small MLPs."""

    def __init__(self):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(50, 8, mode="sum") for _ in range(3)])
        self.maxbag = nn.EmbeddingBag(20, 8, mode="max")
        self.bottom = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))
        self.top = nn.Sequential(nn.Linear(40, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, dense, ids, offsets, max_ids, max_offsets):
        pooled = [bag(i, o) for bag, i, o in zip(self.bags, ids, offsets)]
        x = torch.cat([self.bottom(dense), self.maxbag(max_ids, max_offsets)] + pooled, dim=1)
        return self.top(x).squeeze(1)


def tiny_inputs(batch=6):
    g = torch.Generator().manual_seed(0)
    dense = torch.rand(batch, 4, generator=g)
    ids = [torch.randint(0, 50, (2 * batch,), generator=g) for _ in range(3)]
    offsets = [torch.arange(0, 2 * batch, 2) for _ in range(3)]
    return dense, ids, offsets, torch.randint(0, 20, (batch,), generator=g), torch.arange(batch)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model, inputs = Tiny(), tiny_inputs()
    return model, inputs, fxrec.transform(model, inputs, backend="fbgemm", timing_rounds=1)


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(0)
    return capture(Tiny(), tiny_inputs(), {})


def statements(dot: str):
    """node id -> attribute text of every node statement of a DOT source."""
    out = {}
    for line in dot.splitlines():
        m = re.match(r"\s*([A-Za-z_][\w]*) \[(.*)\]\s*$", line)
        if m and "->" not in line and m.group(1) not in ("graph", "node", "edge"):
            out[m.group(1)] = m.group(2)
    return out


def kind_of(attrs: str) -> str:
    return re.search(r'class="fxrec-(\w+)"', attrs).group(1)


def clusters(dot: str):
    """cluster label -> ids of the nodes declared inside it."""
    out, current = {}, None
    for line in dot.splitlines():
        if line.strip().startswith("subgraph cluster_"):
            current = []
            continue
        if current is not None:
            m = re.match(r'\s*color=.* label=("([^"]*)"|(\S+))', line)
            if m:
                out[m.group(2) or m.group(3)] = current
            elif line.strip() == "}":
                current = None
            else:
                m = re.match(r"\s*([A-Za-z_]\w*) \[", line)
                if m and "->" not in line:
                    current.append(m.group(1))
    return out


# --------------------------------------------------------------------------------------------
# node_kind
# --------------------------------------------------------------------------------------------


def fake_all_to_all(x):
    return x


fake_all_to_all._fxrec_collective = True


class FakeInputDist(nn.Module):
    _fxrec_collective = True

    def forward(self, x):
        return x


def hand_built():
    root = nn.Module()
    root.w = nn.Parameter(torch.randn(10, 4))
    root.dist = FakeInputDist()
    root.group = EmbeddingGroup([TableSpec("t0", 10, 4)], [FeatureSpec("f0", 0, "bag")], "sum",
                                kernel_train="fbgemm", kernel_eval="reference")
    root.lin = nn.Linear(4, 4)
    g = fx.Graph()
    ids = g.placeholder("ids")
    offsets = g.placeholder("offsets")
    w = g.get_attr("w")
    ids2 = g.call_module("dist", (ids,))
    emb = g.call_function(torch.ops.aten.embedding.default, (w, ids2))
    bag = g.call_function(torch.ops.aten._embedding_bag.default, (w, ids, offsets))
    grouped = g.call_module("group", ([ids], [offsets], [None], [w]))
    out = g.call_function(fake_all_to_all, (grouped,))
    dense = g.call_module("lin", (out,))
    added = g.call_function(torch.add, (dense, emb))
    g.output((added, bag))
    return fx.GraphModule(root, g)


def test_node_kind_of_every_kind_in_a_hand_built_graph():
    gm = hand_built()
    kinds = {n.name: viz.node_kind(gm, n) for n in gm.graph.nodes}
    assert kinds == {
        "ids": "input", "offsets": "input", "w": "param", "dist": "collective", "embedding_default": "lookup",
        "_embedding_bag_default": "lookup", "group": "group", "fake_all_to_all": "collective", "lin": "dense",
        "add": "dense", "output": "output",
    }


def test_collective_attribute_must_be_true():
    def not_quite(x):
        return x

    not_quite._fxrec_collective = "yes"
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(not_quite, (x,)))
    gm = fx.GraphModule(nn.Module(), g)
    assert [viz.node_kind(gm, n) for n in gm.graph.nodes] == ["input", "dense", "output"]


def test_hand_built_graph_draws_each_kind_in_its_colour():
    dot = viz.to_dot(hand_built(), show_params=True)
    nodes = statements(dot)
    for name, kind in [("dist", "collective"), ("fake_all_to_all", "collective"), ("embedding_default", "lookup"),
                       ("group", "group"), ("lin", "dense"), ("w", "param"), ("ids", "input")]:
        assert kind_of(nodes[name]) == kind
        assert f'fillcolor="{viz.KIND_COLORS[kind]}"' in nodes[name]
    assert "shape=hexagon" in nodes["fake_all_to_all"]
    # the group's label names its table and its paths
    assert "t0" in nodes["group"] and "train: fbgemm" in nodes["group"] and "eval: reference" in nodes["group"]
    # the legend names every kind present
    for text in ("collective", "fxrec TBE group", "embedding lookup", "dense op", "parameter"):
        assert text in dot


# --------------------------------------------------------------------------------------------
# Pictures of real graphs
# --------------------------------------------------------------------------------------------


def test_captured_graph_lookups_shapes_and_clusters(captured):
    dot = viz.to_dot(captured, collapse=False)
    nodes = statements(dot)
    lookups = {k: v for k, v in nodes.items() if kind_of(v) == "lookup"}
    assert len(lookups) == 4
    assert any("bags.0" in v and "50×8" in v and "sum" in v for v in lookups.values())
    assert any("maxbag" in v and "max" in v for v in lookups.values())
    # shapes and dtypes from node.meta["val"]
    assert "f32[s" in dot and "i64[" in dot
    # one cluster per submodule: the MLPs' ops and the ModuleList's lookups
    cl = clusters(dot)
    assert set(cl) == {"bottom (Sequential)", "top (Sequential)", "bags"}  # not maxbag: a box of one
    assert len(cl["bottom (Sequential)"]) == 3
    assert all(kind_of(nodes[n]) == "dense" for n in cl["bottom (Sequential)"])
    assert all(kind_of(nodes[n]) == "lookup" for n in cl["bags"])
    # the list inputs are one node each; its edge to all three bags is one bundled edge
    assert 'label="ids: 3 tensors' in dot
    assert re.search(r'input_ids -> \w+ \[label="×3" lhead=cluster_\d+_bags\]', dot)
    # parameters are folded into their users' labels, export's guard call is not drawn
    assert not any(kind_of(v) == "param" for v in nodes.values())
    assert "_guards_fn" not in nodes


def test_transformed_graph_has_the_group_and_the_left_alone_lookup(tiny):
    _, _, fast = tiny
    nodes = statements(viz.to_dot(fast, title="after"))
    kinds = [kind_of(v) for v in nodes.values()]
    assert kinds.count("group") == 1
    assert kinds.count("lookup") == 1  # mode="max" is left as written
    group = next(v for v in nodes.values() if kind_of(v) == "group")
    for text in ("bags.0", "bags.1", "bags.2", "3 table(s)", "train: fbgemm", "eval: fbgemm"):
        assert text in group
    assert f'fillcolor="{viz.KIND_COLORS["group"]}"' in group


def test_collapse_makes_one_box_per_run_of_a_submodule(captured):
    dot = viz.to_dot(captured, collapse=True)
    nodes = statements(dot)
    labels = [v for v in nodes.values() if kind_of(v) == "dense"]
    bottom = [v for v in labels if "bottom (Sequential)" in v]
    assert len(bottom) == 1 and "3 ops: linear ×2, relu" in bottom[0] and "→ f32[s" in bottom[0]
    assert not any(v.startswith('label="linear') for v in labels)
    assert "bottom (Sequential)" not in clusters(dot)


def test_auto_collapses_only_large_graphs(captured, monkeypatch):
    assert "3 ops:" not in viz.to_dot(captured)
    monkeypatch.setattr(viz, "COLLAPSE_ABOVE", 3)
    assert "3 ops: linear ×2, relu" in viz.to_dot(captured)


def test_wide_fan_out_is_stacked_in_rows():
    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.ModuleList([nn.EmbeddingBag(10, 4) for _ in range(12)])

        def forward(self, ids, offsets):
            return torch.cat([e(i, o) for e, i, o in zip(self.emb, ids, offsets)], 1)

    ids = [torch.randint(0, 10, (4,)) for _ in range(12)]
    offsets = [torch.tensor([0, 2]) for _ in range(12)]
    dot = viz.to_dot(capture(Wide(), (ids, offsets), {}), stagger=4)
    assert dot.count("style=invis") == 12 - 3  # 4 rows of 3 columns
    assert "style=invis" not in viz.to_dot(capture(Wide(), (ids, offsets), {}), stagger=1)


def test_quantized_group_is_its_own_kind():
    torch.manual_seed(0)
    model = Tiny().eval()
    inf = fxrec.transform(model, tiny_inputs(), mode="inference", quantize="int8", backend="fbgemm",
                          timing_rounds=1)
    nodes = statements(viz.to_dot(inf))
    quantized = [v for v in nodes.values() if kind_of(v) == "quantized"]
    assert len(quantized) == 1
    assert "int8 ×3" in quantized[0] and "bags.1" in quantized[0]
    assert f'fillcolor="{viz.KIND_COLORS["quantized"]}"' in quantized[0]
    assert not any(kind_of(v) == "group" for v in nodes.values())
    # the report: quantized tables, their bytes and errors, in the JSON
    data = json.loads(inf.report.to_json())
    tables = {t["name"]: t for t in data["tables"]}
    assert tables["bags.0"]["dtype"] == "int8" and tables["bags.0"]["bytes"] < 50 * 8 * 4
    assert tables["maxbag"]["dtype"] == "float32" and tables["maxbag"]["bytes"] == 20 * 8 * 4
    assert {q["table"] for q in data["quantization"]} == {"bags.0", "bags.1", "bags.2"}
    assert all(q["max_abs_error"] is not None for q in data["quantization"])
    assert "quantized" in data["groups"][0]["became"]


def test_bad_arguments_are_named(tiny, tmp_path):
    _, _, fast = tiny
    with pytest.raises(TypeError, match="needs a torch.fx.GraphModule .* got Linear"):
        viz.to_dot(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="collapse must be"):
        viz.to_dot(fast, collapse="sometimes")
    with pytest.raises(ValueError, match="format must be one of svg, png, pdf, dot .* 'jpg'"):
        viz.draw(fast, tmp_path / "graph.jpg")


def test_dot_source_is_written_without_graphviz(tiny, tmp_path, monkeypatch):
    _, _, fast = tiny
    monkeypatch.setattr(viz.shutil, "which", lambda name: None)
    path = viz.draw(fast, tmp_path / "graph.dot")
    assert open(path).read().startswith("digraph fxrec {")


def test_missing_graphviz_says_how_to_install(tiny, tmp_path, monkeypatch):
    _, _, fast = tiny
    monkeypatch.setattr(viz.shutil, "which", lambda name: None)
    with pytest.raises(viz.GraphvizMissing, match=r"'dot' program.*apt-get install graphviz.*pip install graphviz"):
        viz.draw(fast, tmp_path / "graph.svg")
    # transform(dump_dir=...) fails before doing any work
    with pytest.raises(viz.GraphvizMissing, match="apt-get install graphviz"):
        fxrec.transform(Tiny(), tiny_inputs(), backend="fbgemm", timing_rounds=1, dump_dir=str(tmp_path / "d"))
    assert not (tmp_path / "d").exists()
    monkeypatch.setitem(__import__("sys").modules, "graphviz", None)
    with pytest.raises(viz.GraphvizMissing, match="graphviz Python package"):
        viz.to_dot(fast)


@needs_dot
def test_svg_and_png_render(tiny, tmp_path):
    _, _, fast = tiny
    svg = open(viz.draw(fast, tmp_path / "graph.svg", title="tiny")).read()
    assert "<svg" in svg and f'fill="{viz.KIND_COLORS["group"]}"' in svg and "bags.2" in svg
    png = open(viz.draw(fast, tmp_path / "graph.png"), "rb").read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


@needs_dot
def test_dump_dir_writes_code_and_picture_before_and_after_every_pass(tmp_path):
    torch.manual_seed(0)
    fast = fxrec.transform(Tiny(), tiny_inputs(), backend="fbgemm", timing_rounds=1, dump_dir=str(tmp_path))
    names = ["captured"] + [p.name for p in fast.report.pass_runs]
    expected = {f"{i:02d}_{n}.{ext}" for i, n in enumerate(names) for ext in ("txt", "svg", "dot")}
    assert set(os.listdir(tmp_path)) == expected
    assert "01_annotate_lookups.txt" in expected
    first = open(tmp_path / "00_captured.txt").read()
    last = open(tmp_path / f"{len(names) - 1:02d}_{names[-1]}.txt").read()
    assert "embedding_bag" in first and "fxrec_group" not in first
    assert "fxrec_group_0" in last and last == fast.code
    assert f'fill="{viz.KIND_COLORS["lookup"]}"' in open(tmp_path / "00_captured.svg").read()
    assert "after pass 1: annotate_lookups" in open(tmp_path / "01_annotate_lookups.dot").read()


# --------------------------------------------------------------------------------------------
# The report: JSON and pass times
# --------------------------------------------------------------------------------------------


def test_report_json(tiny):
    _, _, fast = tiny
    data = json.loads(fast.report.to_json())
    assert data["summary"] == {"lookups": 4, "lowered": 3, "left_alone": 1, "groups_lowered": 1}
    tables = {t["name"]: t for t in data["tables"]}
    assert tables["bags.0"] == {
        "name": "bags.0", "rows": 50, "dim": 8, "pooling": "sum", "dtype": "float32", "bytes": 50 * 8 * 4,
        "lookups": 1, "features": ["ids_0"], "groups": ["group_0"],
    }
    assert tables["maxbag"]["pooling"] == "max" and tables["maxbag"]["groups"] == []
    assert [(n["table"], "max" in n["reason"]) for n in data["not_lowered"]] == [("maxbag", True)]
    group = data["groups"][0]
    assert group["tables"] == ["bags.0", "bags.1", "bags.2"]
    assert group["became"] == "one group module, kernel fbgemm"
    assert data["plan_per_rank"] == []
    assert data["quantization"] == []
    assert [p["name"] for p in data["passes"]] == [
        "annotate_lookups", "merge_lookups", "assign_optimizers", "group_lookups", "choose_kernels", "lower_groups",
        "fold_concat",
    ]
    assert all(p["seconds"] > 0 for p in data["passes"])
    assert data["passes"][0]["stats"]["lookups"] == 4
    assert data["total_pass_seconds"] == pytest.approx(sum(p["seconds"] for p in data["passes"]))


def test_printed_report_has_the_pass_times(tiny):
    _, _, fast = tiny
    text = str(fast.report)
    assert re.search(r"Pass wall time \([\d.]+ m?s in all\): annotate_lookups [\d.]+ m?s", text)
