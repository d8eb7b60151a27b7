import fxrec
from fxrec.passes.annotate_lookups import annotate_lookups
from fxrec.passes.choose_kernels import choose_kernels
from fxrec.passes.fold_concat import fold_concat
from fxrec.passes.group_lookups import group_lookups
from fxrec.passes.lower_groups import lower_groups
from fxrec.testing import assert_matches, captured, embedding_ops, group_calls, run_passes
from tests import models as M

PIPE = [annotate_lookups, group_lookups, choose_kernels, lower_groups, fold_concat]


def test_forced_backends_set_both_paths():
    for backend in ("fbgemm", "native", "direct", "loop"):
        inputs = M.bag_inputs()
        gm, ctx = run_passes(captured(M.BagList(), inputs), PIPE, inputs, backend=backend)
        mod = gm.get_submodule(group_calls(gm)[0].target)
        assert (mod.path_train, mod.path_eval) == (backend, backend)
        assert ctx.report.groups[0].why == f"backend={backend!r} was asked for"


def test_auto_measures_both_paths_and_keeps_the_faster():
    inputs = M.bag_inputs()
    model = M.BagList()
    gm, ctx = run_passes(captured(model, inputs), PIPE, inputs, backend="auto")
    (gr,) = ctx.groups
    t = gr.timings_ms
    assert all(v > 0 for v in t.values())
    names = {"fbgemm": "fbgemm", "native": "native", "direct": "direct", "loop": "plain"}
    assert set(t) == {f"{m}_{n}" for m in ("fwd", "train") for n in names.values()}
    best = min(t[f"fwd_{n}"] for n in names.values())
    chosen = t[f"fwd_{names[gr.path_eval]}"]
    # direct wins its ties with the plain loop (the same kernels, a reused output)
    assert chosen == best or (gr.path_eval == "direct" and t["fwd_plain"] == best and chosen <= 1.10 * best)
    assert t[f"train_{names[gr.path_train]}"] == min(t[f"train_{n}"] for n in names.values())
    assert gr.lower == ((gr.path_eval, gr.path_train) != ("loop", "loop"))
    assert bool(group_calls(gm)) == gr.lower
    if not gr.lower:  # plain won both ways: the graph keeps the user's lookups, untouched
        assert len(embedding_ops(gm)) == 3
        assert "kept as they were" in gr.why
    assert_matches(model, gm, inputs)


def test_group_where_plain_wins_both_ways_is_not_lowered():
    """Tiny tables and a batch of two: the plain lookups win on any machine (fbgemm's TBE has a
    fixed per-call cost of tens of microseconds)."""
    inputs = M.bag_inputs(rows=(5, 5, 5), batch=2, max_len=1)
    model = M.BagList(rows=(5, 5, 5))
    fast = fxrec.transform(model, inputs, backend="auto", timing_rounds=5)
    g = fast.report.groups[0]
    if g.lowered:  # the measurement decides; report what it saw if fbgemm won somewhere
        t = g.timings_ms
        assert min(t["fwd_fbgemm"], t["fwd_direct"]) < t["fwd_plain"] or min(t["train_fbgemm"], t["train_direct"]) < t["train_plain"]
    else:
        assert not group_calls(fast) and len(embedding_ops(fast)) == 3
        assert all("kept plain" in line for line in str(fast.report).splitlines() if line.strip().startswith("bags."))
    assert_matches(model, fast, inputs)


def test_measuring_leaves_no_gradients_and_changes_no_weights():
    model = M.BagList()
    inputs = M.bag_inputs()
    fast = fxrec.transform(model, inputs, backend="auto", timing_rounds=2)
    assert all(p.grad is None for p in fast.parameters())
    for k, v in model.state_dict().items():
        assert (fast.state_dict()[k] == v).all(), k


def test_direct_wins_ties_within_ten_percent_only():
    from fxrec.passes.choose_kernels import _fastest

    assert _fastest({"fbgemm": 3.0, "direct": 2.15, "loop": 2.0}, "direct") == "direct"
    assert _fastest({"fbgemm": 3.0, "direct": 2.3, "loop": 2.0}, "direct") == "loop"
    assert _fastest({"fbgemm": 1.0, "direct": 2.0, "loop": 2.0}, "direct") == "fbgemm"
    assert _fastest({"fbgemm": 3.0, "direct": 2.15, "loop": 2.0}, None) == "loop"
