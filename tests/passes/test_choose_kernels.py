import fxrec
from fxrec.passes.annotate_lookups import annotate_lookups
from fxrec.passes.choose_kernels import choose_kernels
from fxrec.passes.fold_concat import fold_concat
from fxrec.passes.group_lookups import group_lookups
from fxrec.passes.lower_groups import lower_groups
from fxrec.testing import assert_matches, captured, group_calls, run_passes
from tests import models as M

PIPE = [annotate_lookups, group_lookups, lower_groups, fold_concat, choose_kernels]


def test_forced_backends_set_both_paths():
    for backend in ("fbgemm", "loop"):
        inputs = M.bag_inputs()
        gm, ctx = run_passes(captured(M.BagList(), inputs), PIPE, inputs, backend=backend)
        mod = gm.get_submodule(group_calls(gm)[0].target)
        assert (mod.path_train, mod.path_eval) == (backend, backend)
        assert ctx.report.groups[0].why == f"backend={backend!r} was asked for"


def test_auto_measures_both_paths_and_keeps_the_faster():
    inputs = M.bag_inputs()
    model = M.BagList()
    gm, ctx = run_passes(captured(model, inputs), PIPE, inputs, backend="auto")
    entry = ctx.report.groups[0]
    t = entry.timings_ms
    assert all(v > 0 for v in t.values())
    assert entry.path_eval == ("fbgemm" if t["fwd_fbgemm"] < t["fwd_loop"] else "loop")
    assert entry.path_train == ("fbgemm" if t["train_fbgemm"] < t["train_loop"] else "loop")
    assert_matches(model, gm, inputs)


def test_measuring_leaves_no_gradients_and_changes_no_weights():
    model = M.BagList()
    inputs = M.bag_inputs()
    fast = fxrec.transform(model, inputs, backend="auto", timing_rounds=2)
    assert all(p.grad is None for p in fast.parameters())
    for k, v in model.state_dict().items():
        assert (fast.state_dict()[k] == v).all(), k
