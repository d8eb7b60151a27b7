"""fxrec.checkpoint: sharded state saved with torch.distributed.checkpoint under one plan and world
size loads under another plan, another world size and into the single-process model, exactly.

Each rank of the saving run also dumps its local parameters and shard layout with torch.save; the
global tables assembled from those dumps are what every load must reproduce bit for bit."""

import os
import shutil
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fxrec
import fxrec.checkpoint_files
from tests.test_sharding import gloo_group, local_batch  # one sample slicing for every multi-process test
from fxrec.checkpoint import CheckpointError

ROWS = (40, 64, 30, 6)  # bags.0, bags.1, bags.2, tiny (6 rows over 4 ranks row-wise: 2, 2, 2, 0)
SINGLE_ROWS = 50
DIM = 8
LOCAL_B = 4
STEPS = 3

PLAN_A = {"bags.0": ("table_wise", 1), "bags.1": "row_wise", "bags.2": "data_parallel", "tiny": "row_wise",
          "single": ("table_wise", 0)}
# every table changes: owner swapped, row-wise -> table-wise, data-parallel -> row-wise, table-wise -> dp
PLAN_B = {"bags.0": ("table_wise", 0), "bags.1": ("table_wise", 1), "bags.2": "row_wise", "tiny": ("table_wise", 0),
          "single": "data_parallel"}
PLAN_C = {"bags.0": "row_wise", "bags.1": ("table_wise", 3), "bags.2": ("table_wise", 2), "tiny": "row_wise",
          "single": "row_wise"}  # world size 4


class Model(nn.Module):
    def __init__(self, rows=ROWS, with_tiny=True):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(r, DIM, mode="sum") for r in rows[:3]])
        if with_tiny:
            self.tiny = nn.EmbeddingBag(rows[3], DIM, mode="mean")
        self.single = nn.Embedding(SINGLE_ROWS, DIM)
        self.top = nn.Linear(5 * DIM + 3, 1)

    def forward(self, dense, ids, offsets, single_ids):
        parts = [b(i, o) for b, i, o in zip(self.bags, ids, offsets)]
        parts += [self.tiny(ids[3], offsets[3]), self.single(single_ids), dense]
        return self.top(torch.cat(parts, 1)).squeeze(1)


def global_batch(batch, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = [torch.randint(0, 4, (batch,), generator=g) for _ in ROWS]
    ids = [torch.randint(0, r, (int(ln.sum()),), generator=g) for r, ln in zip(ROWS, lengths)]
    offsets = [torch.cat([torch.zeros(1, dtype=torch.long), ln.cumsum(0)[:-1]]) for ln in lengths]
    return torch.rand(batch, 3, generator=g), ids, offsets, torch.randint(0, SINGLE_ROWS, (batch,), generator=g)


def sharded(world, rank, pins, seed):
    """A freshly initialised model (seed) transformed for this rank of a plan."""
    torch.manual_seed(seed)
    model = Model()
    example = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)
    plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins=pins)
    return fxrec.transform(model, example, plan=plan)


def pieces(layout_entry):
    return [p for p in layout_entry[1] if p[1] and p[3]]


def assemble(dumps):
    """The global state from every rank's (local params, layout): tables from their pieces
    (each element written exactly once), everything else from rank 0."""
    params0, layout0 = dumps[0]
    out = {k: v for k, v in params0.items() if k not in layout0}
    for params, _ in dumps:  # dense parameters: whole and identical on every rank
        for k, v in out.items():
            assert torch.equal(params[k], v), f"{k} differs between ranks"
    for fqn, (shape, _) in layout0.items():
        if all(pieces(d[1][fqn]) == [(0, shape[0], 0, shape[1], 0)] for d in dumps):  # data-parallel
            for params, _ in dumps:
                assert torch.equal(params[fqn], params0[fqn]), f"{fqn} differs between ranks"
            out[fqn] = params0[fqn]
            continue
        table = torch.full(shape, float("nan"))
        written = torch.zeros(shape, dtype=torch.int)
        for params, layout in dumps:
            for ro, nr, co, nc, lc in pieces(layout[fqn]):
                table[ro:ro + nr, co:co + nc] = params[fqn][:nr, lc:lc + nc]
                written[ro:ro + nr, co:co + nc] += 1
        assert bool((written == 1).all()), f"{fqn}: the ranks' pieces do not cover the table exactly once"
        out[fqn] = table
    return out


def assert_holds(fast, want, what):
    """fast's local parameters and buffers are exactly ``want``'s pieces (by the shard layout)."""
    layout = fast.meta["fxrec_shard_layout"]
    state = fast.state_dict()
    assert set(state) | set(layout) == set(want), (sorted(state), sorted(want))
    for name, value in want.items():
        if name in layout:
            for ro, nr, co, nc, lc in pieces(layout[name]):
                got = fast.get_parameter(name).detach()[:nr, lc:lc + nc]
                assert torch.equal(got, value[ro:ro + nr, co:co + nc]), f"{what}: {name} rows {ro}+{nr} cols {co}+{nc}"
        else:
            assert torch.equal(state[name], value), f"{what}: {name}"


def assert_computes_like(fast, state, world, rank, what):
    """fast on its local batch gives the rows of a plain model holding ``state``."""
    full = Model()
    full.load_state_dict(state)
    x = global_batch(LOCAL_B * world, 99)
    with torch.no_grad():
        want = full(*x)[rank * LOCAL_B:(rank + 1) * LOCAL_B]
        got = fast(*local_batch(x, rank, LOCAL_B))
    torch.testing.assert_close(got, want, msg=what)


# A 10 x 12 table as arbitrary pieces: (row_offset, num_rows, col_offset, num_cols, local_col_offset).
# Saved: rank 0 holds columns 0:4 and 8:12 side by side, rank 1 columns 4:8 in two row pieces side by
# side (rows 0:6 at local columns 0:4, rows 6:10 at local columns 4:8). Loaded: rank 0 rows 0:3,
# rank 1 rows 3:10 with columns 6:12 first and 0:6 after them.
TABLE = torch.arange(120, dtype=torch.float32).view(10, 12)
SAVED_PIECES = {0: [(0, 10, 0, 4, 0), (0, 10, 8, 4, 4)], 1: [(0, 6, 4, 4, 0), (6, 4, 4, 4, 4)]}
LOADED_PIECES = {0: [(0, 3, 0, 12, 0)], 1: [(3, 7, 6, 6, 0), (3, 7, 0, 6, 6)]}


class Pieces(nn.Module):
    """Stands in for a transformed model: a table held as pieces (meta["fxrec_shard_layout"]) and a
    dense layer."""

    def __init__(self, pieces, local_shape):
        super().__init__()
        self.t = nn.Module()
        self.t.weight = nn.Parameter(torch.zeros(local_shape))
        self.dense = nn.Linear(2, 2)
        self.meta = {"fxrec_shard_layout": {"t.weight": ((10, 12), pieces)}}


def _column_pieces(rank, root):
    saving = Pieces(SAVED_PIECES[rank], (10 if rank == 0 else 6, 8))
    with torch.no_grad():
        for ro, nr, co, nc, lc in SAVED_PIECES[rank]:
            saving.t.weight[:nr, lc:lc + nc] = TABLE[ro:ro + nr, co:co + nc]
        saving.dense.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    fxrec.checkpoint.save(saving, os.path.join(root, "pieces"))
    loading = Pieces(LOADED_PIECES[rank], (3, 12) if rank == 0 else (7, 12))
    fxrec.checkpoint.load(loading, os.path.join(root, "pieces"))
    want = TABLE[0:3] if rank == 0 else torch.cat([TABLE[3:10, 6:12], TABLE[3:10, 0:6]], 1)
    assert torch.equal(loading.t.weight.detach(), want), rank
    assert torch.equal(loading.dense.weight.detach(), saving.dense.weight.detach())


def _worker(rank, world, init_file, root, body):
    with gloo_group(rank, world, init_file, 60):
        body(rank, world, root)
    # Leave without finalizing the interpreter: in torch 2.13 a gloo worker thread can drop the last
    # reference to the tensors of DCP's final broadcast while Python finalizes, and the process then
    # aborts ("terminate called without an active exception"; ~1 run in 4 here, whatever fxrec does).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _save_and_reshard(rank, world, root):
    """World 2: train plan A, save; load into plan B (every table resharded); a wrong shape fails."""
    fast = sharded(world, rank, PLAN_A, seed=0)
    torch.manual_seed(0)
    ref = Model()  # the same initial weights, trained in one process on the global batch
    opt = torch.optim.SGD(fast.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(STEPS):
        x = global_batch(LOCAL_B * world, step + 1)
        cot = torch.randn(LOCAL_B * world, generator=torch.Generator().manual_seed(100 + step))
        ref_opt.zero_grad()
        (ref(*x) * cot).sum().backward()
        ref_opt.step()
        opt.zero_grad()
        (fast(*local_batch(x, rank, LOCAL_B)) * cot[rank * LOCAL_B:(rank + 1) * LOCAL_B]).sum().backward()
        opt.step()
    fxrec.checkpoint.save(fast, os.path.join(root, "a"))
    local = {n: p.detach().clone() for n, p in fast.state_dict().items()}
    torch.save((local, fast.meta["fxrec_shard_layout"]), os.path.join(root, f"dump_{rank}.pt"))
    if rank == 0:
        torch.save(ref.state_dict(), os.path.join(root, "ref.pt"))
    dist.barrier()
    saved = assemble([torch.load(os.path.join(root, f"dump_{r}.pt")) for r in range(world)])
    for name, value in ref.state_dict().items():  # what was saved is the trained model
        torch.testing.assert_close(saved[name], value, msg=name)

    fast_b = sharded(world, rank, PLAN_B, seed=1)
    fxrec.checkpoint.load(fast_b, os.path.join(root, "a"))
    assert_holds(fast_b, saved, "plan A -> plan B at world 2")
    assert_computes_like(fast_b, saved, world, rank, "plan B after load")

    if rank == 0:  # bags.1 with 65 rows instead of 64
        fxrec.checkpoint.save_model(Model(rows=(40, 65, 30, 6)), os.path.join(root, "wrong"))
    dist.barrier()
    with pytest.raises(CheckpointError) as err:  # on every rank, before any collective
        fxrec.checkpoint.load(fast_b, os.path.join(root, "wrong"))
    assert "bags.1.weight" in str(err.value) and "65 x 8" in str(err.value) and "64 x 8" in str(err.value), err.value
    _column_pieces(rank, root)


def _at_world_4(rank, world, root):
    """World 4: load the world-2 checkpoint and a single-process one into plan C; save plan C."""
    saved = torch.load(os.path.join(root, "saved.pt"))
    fast = sharded(world, rank, PLAN_C, seed=4)
    assert bool(pieces(fast.meta["fxrec_shard_layout"]["tiny.weight"])) == (rank < 3)  # rank 3: 0 rows
    fxrec.checkpoint.load(fast, os.path.join(root, "a"))
    assert_holds(fast, saved, "world 2 plan A -> world 4 plan C")
    assert_computes_like(fast, saved, world, rank, "plan C after load")

    single = torch.load(os.path.join(root, "single.pt"))
    fxrec.checkpoint.load(fast, os.path.join(root, "single"))
    assert_holds(fast, single, "single process -> world 4 plan C")
    fxrec.checkpoint.save(fast, os.path.join(root, "c"))


def spawn(body, world, root):
    fd, init_file = tempfile.mkstemp(prefix="fxrec_ckpt_")
    os.close(fd)
    os.remove(init_file)
    try:
        mp.spawn(_worker, args=(world, init_file, str(root), body), nprocs=world, join=True)
    finally:
        if os.path.exists(init_file):  # the workers leave without the FileStore's clean-up
            os.remove(init_file)


def test_checkpoint_reshards_across_plans_world_sizes_and_into_one_process(tmp_path):
    spawn(_save_and_reshard, 2, tmp_path)
    saved = assemble([torch.load(tmp_path / f"dump_{r}.pt") for r in range(2)])

    # (c) into the single-process model
    torch.manual_seed(2)
    model = Model()
    fxrec.checkpoint.load_into_model(model, tmp_path / "a")
    state = model.state_dict()
    assert set(state) == set(saved)
    for name, value in saved.items():
        assert torch.equal(state[name], value), name
    ref = torch.load(tmp_path / "ref.pt")
    x = global_batch(8, 7)
    reference = Model()
    reference.load_state_dict(ref)
    with torch.no_grad():
        torch.testing.assert_close(model(*x), reference(*x))

    one = Pieces([(0, 10, 0, 12, 0)], (10, 12))  # column pieces of two ranks into one process
    fxrec.checkpoint.load_into_model(one, tmp_path / "pieces")
    assert torch.equal(one.t.weight.detach(), TABLE)

    # (b) into world 4, and a single-process checkpoint into world 4, saved there and read back here
    torch.save(saved, tmp_path / "saved.pt")
    torch.manual_seed(3)
    single = Model()
    fxrec.checkpoint.save_model(single, tmp_path / "single")
    torch.save(single.state_dict(), tmp_path / "single.pt")
    spawn(_at_world_4, 4, tmp_path)
    torch.manual_seed(5)
    back = Model()
    fxrec.checkpoint.load_into_model(back, tmp_path / "c")
    for name, value in single.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name


def test_float_tables_into_a_quantized_model_are_refused_saying_what_to_do(tmp_path):
    """The error named the quantized group's internal entries (q_weights, q_D_offsets, ...)."""
    torch.manual_seed(0)
    model = Model()
    fxrec.checkpoint.save_model(model, tmp_path / "float")
    x = global_batch(8, 0)
    served = fxrec.transform(Model(), x, mode="inference", quantize="int8")
    before = {k: v.clone() for k, v in served.state_dict().items() if isinstance(v, torch.Tensor)}
    for load in (fxrec.checkpoint.load, fxrec.checkpoint.load_into_model):
        with pytest.raises(CheckpointError, match=r"holds no quantized rows.*load the checkpoint into the plain model"):
            load(served, tmp_path / "float")
    for k, v in served.state_dict().items():
        assert not isinstance(v, torch.Tensor) or torch.equal(v, before[k]), k
    fxrec.checkpoint.load_into_model(served, tmp_path / "float", strict=False)  # the rest, as strict=False does
    torch.testing.assert_close(served.get_parameter("top.weight"), model.top.weight)
    for k, v in served.state_dict().items():
        assert k.startswith("top.") or not isinstance(v, torch.Tensor) or torch.equal(v, before[k]), k
    fxrec.checkpoint.load_into_model(plain := Model(), tmp_path / "float")  # what the error says, works
    again = fxrec.transform(plain, x, mode="inference", quantize="int8")
    torch.testing.assert_close(again(*x), model(*x), rtol=0.05, atol=0.05)
    fxrec.checkpoint.save_model(again, tmp_path / "packed")  # a quantized model's own checkpoint loads
    fxrec.checkpoint.load_into_model(served, tmp_path / "packed")
    torch.testing.assert_close(served(*x), again(*x))


def test_single_process_round_trip_and_errors_name_the_table_and_both_shapes(tmp_path):
    torch.manual_seed(0)
    model = Model()
    fxrec.checkpoint.save_model(model, tmp_path / "m")
    torch.manual_seed(1)
    other = Model()
    fxrec.checkpoint.load_into_model(other, tmp_path / "m")
    for name, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[name], value), name

    with pytest.raises(CheckpointError, match=r"table 'bags\.1\.weight' is 64 x 8 in the checkpoint and 65 x 8 in "
                                              r"the model"):
        fxrec.checkpoint.load_into_model(Model(rows=(40, 65, 30, 6)), tmp_path / "m")

    fxrec.checkpoint.save_model(Model(with_tiny=False), tmp_path / "no_tiny")
    with pytest.raises(CheckpointError, match=r"no table 'tiny\.weight' \(the model's is 6 x 8\)"):
        fxrec.checkpoint.load_into_model(Model(), tmp_path / "no_tiny")
    with pytest.raises(CheckpointError, match=r"entries the model does not: \['tiny\.weight'\]"):
        fxrec.checkpoint.load_into_model(Model(with_tiny=False), tmp_path / "m")
    partial = Model()
    before = partial.tiny.weight.detach().clone()
    fxrec.checkpoint.load_into_model(partial, tmp_path / "no_tiny", strict=False)  # tiny stays as it was
    assert torch.equal(partial.tiny.weight, before)

    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        fxrec.checkpoint.load_into_model(Model(), tmp_path / "nothing_here")


def test_a_sharded_model_needs_the_process_group():
    class Fake(nn.Module):
        meta = {"fxrec_shard_layout": {"bags.0.weight": ((40, 8), [])}}

    with pytest.raises(RuntimeError, match="every rank"):
        fxrec.checkpoint.save(Fake(), "unused")


# --------------------------------------------------------------------------- safe, all-or-nothing
def _saved(tmp_path):
    torch.manual_seed(0)
    model = Model()
    fxrec.checkpoint.save_model(model, tmp_path / "ckpt")
    return model, tmp_path / "ckpt"


def _spoiled_copy(src, dst, spoil, rewrite_checksums=False):
    import shutil

    shutil.copytree(src, dst)
    spoil(dst)
    if rewrite_checksums:  # as if the file had been written so (checks the layers behind the checksums)
        fxrec.checkpoint_files._write_checksums(str(dst))
    return dst


def _data_file(path):
    return next(p for p in path.iterdir() if p.suffix == ".distcp")


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))  # creating the file is the proof that code ran


@pytest.mark.parametrize("rewrite_checksums", [False, True])
def test_a_metadata_file_holding_an_object_runs_no_code(tmp_path, rewrite_checksums):
    import pickle

    _, ckpt = _saved(tmp_path)
    marker = tmp_path / "ran"
    evil = _spoiled_copy(ckpt, tmp_path / "evil",
                         lambda p: (p / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker))), rewrite_checksums)
    model = Model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"evil/\.metadata"):
        fxrec.checkpoint.load_into_model(model, evil)
    assert not marker.exists()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("rewrite_checksums", [False, True])
def test_a_truncated_data_file_is_an_exception_naming_it_and_the_model_stays(tmp_path, rewrite_checksums):
    _, ckpt = _saved(tmp_path)

    def truncate(p):
        f = _data_file(p)
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])

    cut = _spoiled_copy(ckpt, tmp_path / "cut", truncate, rewrite_checksums)
    model = Model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # an Exception (DCP's own CheckpointException is a BaseException that `except Exception` misses)
    with pytest.raises(CheckpointError, match=r"cut(/__0_0\.distcp has \d+ bytes, \d+ when it was written| failed, "
                                              r"nothing was loaded)"):
        fxrec.checkpoint.load_into_model(model, cut)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_flipped_bytes_and_a_truncated_metadata_are_found(tmp_path):
    _, ckpt = _saved(tmp_path)

    def flip(p):
        f = _data_file(p)
        data = bytearray(f.read_bytes())
        for i in range(len(data) // 3, len(data) // 3 + 64):
            data[i] ^= 0xFF
        f.write_bytes(bytes(data))

    with pytest.raises(CheckpointError, match=r"__0_0\.distcp does not match its checksum"):
        fxrec.checkpoint.load_into_model(Model(), _spoiled_copy(ckpt, tmp_path / "flipped", flip))

    def cut_metadata(p):
        (p / ".metadata").write_bytes((p / ".metadata").read_bytes()[:100])

    with pytest.raises(CheckpointError, match=r"\.metadata has 100 bytes"):
        fxrec.checkpoint.load_into_model(Model(), _spoiled_copy(ckpt, tmp_path / "md", cut_metadata))
    with pytest.raises(CheckpointError, match=r"\.metadata cannot be read as a checkpoint's metadata: UnpicklingError"):
        fxrec.checkpoint.load_into_model(Model(), _spoiled_copy(ckpt, tmp_path / "md2", cut_metadata, True))
    with pytest.raises(CheckpointError, match=r"has no fxrec_checksums\.json"):
        fxrec.checkpoint.load_into_model(
            Model(), _spoiled_copy(ckpt, tmp_path / "plain", lambda p: (p / "fxrec_checksums.json").unlink()))


def test_save_is_renamed_into_place_and_replaces_an_older_checkpoint(tmp_path):
    model, ckpt = _saved(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no partial directory left
    stale = tmp_path / "ckpt.fxrec-partial"
    stale.mkdir()
    (stale / "junk").write_text("left by a save that died")
    torch.manual_seed(5)
    newer = Model()
    fxrec.checkpoint.save_model(newer, ckpt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    fxrec.checkpoint.verify(ckpt)
    loaded = Model()
    fxrec.checkpoint.load_into_model(loaded, ckpt)
    for k, v in newer.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_save_refuses_to_replace_what_is_not_a_checkpoint(tmp_path):
    """A directory of other things (a run's logs and earlier checkpoints) was replaced whole, and
    a file in the way too; an empty directory is taken."""
    run = tmp_path / "run"
    (run / "step_100").mkdir(parents=True)
    (run / "train.log").write_text("log")
    (tmp_path / "file").write_text("not a directory")
    torch.manual_seed(5)
    model = Model()
    for where, what in ((run, r"run is a directory holding 2 entries \(e\.g\. 'step_100'\) and no checkpoint"),
                        (tmp_path / "file", r"file exists and is not a directory")):
        with pytest.raises(CheckpointError, match=what):
            fxrec.checkpoint.save_model(model, where)
    assert sorted(p.name for p in run.iterdir()) == ["step_100", "train.log"]
    assert (tmp_path / "file").read_text() == "not a directory"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".fxrec-partial")]
    (tmp_path / "empty").mkdir()
    fxrec.checkpoint.save_model(model, tmp_path / "empty")
    fxrec.checkpoint.verify(tmp_path / "empty")
    (tmp_path / "latest").symlink_to(tmp_path / "empty")  # a link to a checkpoint: named as a link
    with pytest.raises(CheckpointError, match=r"latest is a symbolic link \(to .*empty\)"):
        fxrec.checkpoint.save_model(model, tmp_path / "latest")


def test_a_metadata_that_points_outside_the_directory_or_an_empty_manifest_is_refused(tmp_path):
    import json
    import pickle

    _, ckpt = _saved(tmp_path)
    torch.manual_seed(3)
    fxrec.checkpoint.save_model(Model(), tmp_path / "other")

    def point_outside(p):
        md = fxrec.checkpoint._read_metadata(str(p))
        for info in md.storage_data.values():
            info.relative_path = str(tmp_path / "other" / info.relative_path)
        (p / ".metadata").write_bytes(pickle.dumps(md))
        _data_file(p).unlink()

    model = Model()
    with pytest.raises(CheckpointError, match=r"points DCP at '/.*other/__0_0\.distcp', which is not a file of the "
                                              r"checkpoint directory"):
        fxrec.checkpoint.load_into_model(model, _spoiled_copy(ckpt, tmp_path / "outside", point_outside, True))

    def list_nothing(p):
        (p / "fxrec_checksums.json").write_text(json.dumps({"format": "fxrec-checkpoint/1", "files": {}}))

    with pytest.raises(CheckpointError, match=r"does not list \.metadata"):
        fxrec.checkpoint.load_into_model(model, _spoiled_copy(ckpt, tmp_path / "empty", list_nothing))

    def list_only_metadata(p):
        files = json.loads((p / "fxrec_checksums.json").read_text())["files"]
        (p / "fxrec_checksums.json").write_text(json.dumps({"files": {".metadata": files[".metadata"]}}))

    with pytest.raises(CheckpointError, match=r"points DCP at __0_0\.distcp, which fxrec_checksums\.json does not list"):
        fxrec.checkpoint.load_into_model(model, _spoiled_copy(ckpt, tmp_path / "short", list_only_metadata))


@pytest.mark.parametrize("pieces", ["part", "none", "overlap", "outside"])
def test_saved_pieces_that_do_not_cover_a_table_are_refused_and_the_model_stays(tmp_path, pieces):
    """A checkpoint's metadata whose pieces of a table cover only some of its rows (a checkpoint
    written incompletely, or by another tool, then trusted with add_checksums): the load read the
    rest from uninitialised staging memory into the model, without a word."""
    import pickle

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    _, ckpt = _saved(tmp_path)
    rows = ROWS[0]

    def spoil(p):
        md = fxrec.checkpoint._read_metadata(str(p))
        tm = md.state_dict_metadata["bags.0.weight"]
        piece = {"part": [(0, 10)], "none": [], "overlap": [(0, rows), (5, 10)], "outside": [(rows - 5, 10)]}[pieces]
        tm.chunks = [ChunkStorageMetadata(offsets=torch.Size([o, 0]), sizes=torch.Size([n, DIM])) for o, n in piece]
        (p / ".metadata").write_bytes(pickle.dumps(md))

    model = Model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    want = {"part": rf"hold {10 * DIM} of its {rows * DIM} values", "none": rf"hold 0 of its {rows * DIM} values",
            "overlap": "overlap", "outside": "lies outside it"}[pieces]
    with pytest.raises(CheckpointError, match=rf"table 'bags\.0\.weight' \({rows} x {DIM}\): .*{want}"):
        fxrec.checkpoint.load_into_model(model, _spoiled_copy(ckpt, tmp_path / "spoiled", spoil, True))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_trailing_slash_and_a_checkpoint_an_older_fxrec_wrote(tmp_path):
    torch.manual_seed(0)
    model = Model()
    fxrec.checkpoint.save_model(model, f"{tmp_path}/slash/")
    fxrec.checkpoint.save_model(model, f"{tmp_path}/slash/")  # replaces it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slash"]
    # DCP alone (as an older fxrec wrote): refused until its checksums are added by someone who trusts it
    import torch.distributed.checkpoint as dcp

    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    with pytest.raises(CheckpointError, match=r"add_checksums"):
        fxrec.checkpoint.load_into_model(Model(), tmp_path / "plain")
    fxrec.checkpoint.add_checksums(tmp_path / "plain")
    loaded = Model()
    fxrec.checkpoint.load_into_model(loaded, f"{tmp_path}/plain/")
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def _column_wise_fused_states(rank, world, root):
    """Fused Adagrad on a column-wise table: each rank's sum is as wide as its columns (element-wise,
    not per-row); saved, it loads back under the plan and into the single-process model, column for
    column."""
    from fxrec.checkpoint_fused import states as _fused_states

    pins = {"bags.0": ("table_wise", 0), "bags.1": "column_wise", "bags.2": ("table_wise", 1),
            "tiny": ("table_wise", 0), "single": ("table_wise", 1)}
    example = local_batch(global_batch(LOCAL_B * world, 0), rank, LOCAL_B)

    def made(seed):
        torch.manual_seed(seed)
        model = Model()
        plan = fxrec.plan(model, example, world_size=world, memory_per_rank="1GB", pins=pins)
        return fxrec.transform(model, example, plan=plan, optimizer=fxrec.optim.Adagrad(lr=0.1))

    fast = made(0)
    opt = fast.make_optimizer(torch.optim.SGD, lr=0.1)
    for step in range(2):
        opt.zero_grad()
        fast(*local_batch(global_batch(LOCAL_B * world, step + 1), rank, LOCAL_B)).sum().backward()
        opt.step()
    fxrec.checkpoint.save(fast, os.path.join(root, "cw"))
    mine = {k: v.clone() for k, v in _fused_states(fast).items()}
    assert "bags.1.weight.fxrec_fused.sum" in mine and mine["bags.1.weight.fxrec_fused.sum"].any()
    again = made(1)
    fxrec.checkpoint.load(again, os.path.join(root, "cw"))
    theirs = _fused_states(again)
    assert sorted(theirs) == sorted(mine) and all(torch.equal(theirs[k], v) for k, v in mine.items())
    torch.manual_seed(2)
    single = fxrec.transform(Model(), global_batch(LOCAL_B * world, 0), optimizer=fxrec.optim.Adagrad(lr=0.1))
    fxrec.checkpoint.load_into_model(single, os.path.join(root, "cw"))
    whole = _fused_states(single)["bags.1.weight.fxrec_fused.sum"]
    for ro, nr, co, nc, lc in fast.meta["fxrec_shard_layout"]["bags.1.weight"][1]:
        assert torch.equal(whole[ro:ro + nr, co:co + nc], mine["bags.1.weight.fxrec_fused.sum"][:nr, lc:lc + nc])


def test_fused_states_of_a_column_wise_table_save_and_load(tmp_path):
    spawn(_column_wise_fused_states, 2, tmp_path)


def _paths_differ(rank, world, root):
    """Each rank names its own directory (a per-process timestamp in the path, say): save raises on
    every rank before anything is written (rank 1 does not see rank 0's directory), and a load of
    two different checkpoints too; copies of one checkpoint at two paths load (a mount point may
    differ between hosts)."""
    saving = Pieces(SAVED_PIECES[rank], (10 if rank == 0 else 6, 8))
    with torch.no_grad():
        saving.dense.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))  # (whole on every rank: the same)
    mine = os.path.join(root, f"ckpt_rank{rank}")
    want = (r"fxrec.checkpoint.save: rank 1 does not see rank 0's checkpoint directory at .*ckpt_rank1" if rank == 1
            else r"another rank does not see rank 0's checkpoint directory")
    with pytest.raises(CheckpointError, match=want):
        fxrec.checkpoint.save(saving, mine)
    dist.barrier()
    assert os.listdir(root) == [], os.listdir(root)
    for name in ("a", "b"):  # two checkpoints of different models
        with torch.no_grad():
            saving.dense.weight.add_(1.0)
        fxrec.checkpoint.save(saving, os.path.join(root, name))
    with pytest.raises(CheckpointError, match=r"fxrec.checkpoint.load: the ranks read different checkpoints "
                                              r"\(rank 0 '.*a', rank 1 '.*b'\)"):
        fxrec.checkpoint.load(saving, os.path.join(root, "a" if rank == 0 else "b"))
    if rank == 1:
        shutil.copytree(os.path.join(root, "a"), os.path.join(root, "a_copy"))
    dist.barrier()
    loading = Pieces(SAVED_PIECES[rank], (10 if rank == 0 else 6, 8))
    fxrec.checkpoint.load(loading, os.path.join(root, "a" if rank == 0 else "a_copy"))
    assert torch.equal(loading.dense.weight.detach(), saving.dense.weight.detach() - 1.0)


def test_save_and_load_refuse_ranks_that_do_not_name_one_checkpoint(tmp_path):
    """(save returned on every rank and rank 0 committed a checkpoint naming rank 1's file, which
    was left in another directory: it could not be loaded.)"""
    spawn(_paths_differ, 2, tmp_path)


def _rank0_cannot_write(rank, world, root):
    """The save's parent is a file: rank 0 cannot make the directory; every rank raises (the
    others waited for rank 0 until the process group's timeout)."""
    blocker = os.path.join(root, "not_a_directory")
    if rank == 0:
        with open(blocker, "w") as fh:
            fh.write("x")
    dist.barrier()
    saving = Pieces(SAVED_PIECES[rank], (10 if rank == 0 else 6, 8))
    with pytest.raises(CheckpointError, match=r"fxrec.checkpoint.save: rank 0 could not make .*not_a_directory"):
        fxrec.checkpoint.save(saving, os.path.join(blocker, "ckpt"))


def test_a_save_rank_0_cannot_make_raises_on_every_rank(tmp_path):
    spawn(_rank0_cannot_write, 2, tmp_path)


class _Seq(nn.Module):
    """A row-wise table looked up unpooled: 4 rows over 3 ranks are blocks of 2, 2 and 0."""

    def __init__(self):
        super().__init__()
        self.seq = nn.Embedding(4, 4)
        self.top = nn.Linear(8, 1)

    def forward(self, ids):
        return self.top(self.seq(ids).flatten(1)).squeeze(1)


def _seq_batch(batch, seed):
    return torch.randint(0, 4, (batch, 2), generator=torch.Generator().manual_seed(seed))


def _empty_sequence_block(rank, world, root):
    torch.manual_seed(0)
    model = _Seq()  # (the one-process reference's initial weights)
    plan = fxrec.plan(model, _seq_batch(2, 0), world_size=world, memory_per_rank="1GB", pins={"seq": "row_wise"})
    assert [s.num_rows for s in plan.tables["seq"].shards] == [2, 2, 0]
    fast = fxrec.transform(model, _seq_batch(2, 0), plan=plan)
    opt = torch.optim.SGD(fast.parameters(), lr=0.1)
    for step in range(2):
        x = _seq_batch(2 * world, step + 1)
        opt.zero_grad()
        fast(x[2 * rank:2 * rank + 2]).sum().backward()
        opt.step()
    fxrec.checkpoint.save(fast, os.path.join(root, "seq"))  # (rank 2: no parameter of the table to read)
    fxrec.checkpoint.load(fast, os.path.join(root, "plain"))  # a one-process checkpoint into the blocks
    x = _seq_batch(2 * world, 9)
    with torch.no_grad():
        torch.save(fast(x[2 * rank:2 * rank + 2]), os.path.join(root, f"out_{rank}.pt"))


def test_a_row_wise_sequence_table_with_an_empty_block_saves_and_loads(tmp_path):
    """The rank holding no rows of a row-wise sequence table has no parameter for it, and save and load
    raised there (the other ranks waited in the collectives until the timeout): found by the sharded
    fuzzer. Trained at world 3, saved, read into one process: the one-process model's training."""
    torch.manual_seed(0)
    ref = _Seq()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        ref(_seq_batch(6, step + 1)).sum().backward()
        opt.step()
    torch.manual_seed(7)
    other = _Seq()
    fxrec.checkpoint.save_model(other, tmp_path / "plain")
    spawn(_empty_sequence_block, 3, tmp_path)
    back = _Seq()
    fxrec.checkpoint.load_into_model(back, tmp_path / "seq")
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], value, msg=name)
    with torch.no_grad():
        want = other(_seq_batch(6, 9))
    got = torch.cat([torch.load(tmp_path / f"out_{r}.pt") for r in range(3)])
    torch.testing.assert_close(got, want)
