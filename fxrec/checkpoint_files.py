"""The files of a checkpoint directory (:mod:`fxrec.checkpoint`): all-or-nothing writing
(``<path>.fxrec-partial`` renamed when whole), ``fxrec_checksums.json`` (the SHA-256 and size of
every file) and its verification, and DCP's ``.metadata`` read by an unpickler that builds only
DCP's own metadata classes."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from typing import Dict, Tuple


class CheckpointError(ValueError):
    """A checkpoint does not fit the model (missing entries, other shapes, unknown entries), or it is
    damaged, incomplete or not written by fxrec.checkpoint; the message names the table or the file."""


CheckpointError.__module__ = "fxrec.checkpoint"  # (its public name)


CHECKSUMS = "fxrec_checksums.json"
_PARTIAL = ".fxrec-partial"
_OLD = ".fxrec-old"


# --------------------------------------------------------------------------- safe reading
# What DCP's .metadata may contain: its metadata classes, torch.Size, dtypes, layouts, paths.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata and nothing else: any other class or function in the file is refused."""

    def find_class(self, module: str, name: str):
        import torch as _torch

        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(_torch, name, None), (_torch.dtype, _torch.layout,
                                                                            _torch.memory_format)):
            return getattr(_torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP checkpoint's metadata")


def _read_metadata(path):
    """DCP's metadata of the checkpoint at ``path``, read with :class:`_MetadataUnpickler`."""
    file = os.path.join(str(path), ".metadata")
    try:
        with open(file, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except FileNotFoundError as e:
        raise FileNotFoundError(f"fxrec.checkpoint: {path!s} holds no DCP checkpoint (no .metadata file)") from e
    except Exception as e:  # truncated, damaged, or holding objects of other kinds
        raise CheckpointError(f"fxrec.checkpoint: {file} cannot be read as a checkpoint's metadata: "
                              f"{type(e).__name__}: {e}") from e
    if not hasattr(md, "state_dict_metadata"):
        raise CheckpointError(f"fxrec.checkpoint: {file} holds a {type(md).__name__}, not a checkpoint's metadata")
    for info in (getattr(md, "storage_data", None) or {}).values():
        name = str(getattr(info, "relative_path", ""))
        if not name or os.path.basename(name) != name or name in (".", ".."):
            raise CheckpointError(f"fxrec.checkpoint: {file} points DCP at {name!r}, which is not a file of the "
                                  "checkpoint directory")
    return md


def _file_digest(file: str) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _write_checksums(path: str) -> None:
    files = {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if os.path.isfile(full) and name != CHECKSUMS:
            files[name] = {"bytes": os.path.getsize(full), "sha256": _file_digest(full)}
    with open(os.path.join(path, CHECKSUMS), "w") as f:
        json.dump({"format": "fxrec-checkpoint/1", "files": files}, f, indent=1)


def _manifest(path: str) -> Dict[str, Tuple[int, str]]:
    manifest = os.path.join(path, CHECKSUMS)
    try:
        with open(manifest) as f:
            files = json.load(f)["files"]
        entries = {str(name): (int(e["bytes"]), str(e["sha256"])) for name, e in files.items()}
    except FileNotFoundError as e:
        hint = " (the save did not finish)" if path.endswith(_PARTIAL) else ""
        raise CheckpointError(f"fxrec.checkpoint: {path} has no {CHECKSUMS}: it was not written by "
                              f"fxrec.checkpoint{hint}, so its files cannot be verified (for a checkpoint you trust "
                              "that an older fxrec wrote, fxrec.checkpoint.add_checksums(path) adds them)") from e
    except Exception as e:  # noqa: BLE001 - damaged JSON
        raise CheckpointError(f"fxrec.checkpoint: {manifest} cannot be read: {type(e).__name__}: {e}") from e
    if ".metadata" not in entries:
        raise CheckpointError(f"fxrec.checkpoint: {manifest} does not list .metadata")
    return entries


def verify(path, *, part: Tuple[int, int] = (0, 1)) -> None:
    """Check the checkpoint at ``path`` against its ``fxrec_checksums.json``: every file it lists
    has its size and SHA-256, and every file DCP's metadata points at is one of them. Raises
    :class:`CheckpointError` naming the first file that is missing, of another size, changed, or
    not listed. ``part=(i, n)`` hashes only every n-th data file from the i-th (the ranks of a
    load share the work); .metadata is always checked."""
    path = os.path.normpath(os.fspath(path))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"fxrec.checkpoint: no checkpoint directory at {path}")
    entries = _manifest(path)
    names = sorted(entries)
    mine = [n for k, n in enumerate(names) if n == ".metadata" or k % part[1] == part[0]]
    for name in mine:
        size, digest = entries[name]
        file = os.path.join(path, name)
        if os.path.basename(name) != name or not os.path.isfile(file):
            raise CheckpointError(f"fxrec.checkpoint: {file} is missing")
        got = os.path.getsize(file)
        if got != size:
            raise CheckpointError(f"fxrec.checkpoint: {file} has {got} bytes, {size} when it was written "
                                  "(truncated or replaced)")
        if _file_digest(file) != digest:
            raise CheckpointError(f"fxrec.checkpoint: {file} does not match its checksum: its contents changed "
                                  "after it was written")
    for info in (getattr(_read_metadata(path), "storage_data", None) or {}).values():
        if str(info.relative_path) not in entries:
            raise CheckpointError(f"fxrec.checkpoint: {os.path.join(path, '.metadata')} points DCP at "
                                  f"{info.relative_path!s}, which {CHECKSUMS} does not list")


def add_checksums(path) -> None:
    """Write ``fxrec_checksums.json`` for the checkpoint directory ``path`` as its files are now: for a
    checkpoint you trust that an older fxrec (or DCP itself) wrote, so that :func:`load` takes it."""
    path = os.path.normpath(os.fspath(path))
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise FileNotFoundError(f"fxrec.checkpoint: {path} holds no DCP checkpoint (no .metadata file)")
    _write_checksums(path)


def check_replaceable(path: str) -> None:
    """Raises :class:`CheckpointError` where a save to ``path`` would replace something that is not
    a checkpoint: a file, or a directory holding other things than a checkpoint (one with DCP's
    ``.metadata`` or fxrec's checksums is replaced whole, an empty one taken)."""
    if not os.path.lexists(path):
        return
    if os.path.islink(path):
        raise CheckpointError(f"fxrec.checkpoint: {path} is a symbolic link (to {os.readlink(path)}); a save replaces "
                              "what is at its path: save to the directory itself, or remove the link first")
    if not os.path.isdir(path):
        raise CheckpointError(f"fxrec.checkpoint: {path} exists and is not a directory; a checkpoint is written as a "
                              "directory of that name: remove it or choose another path")
    entries = os.listdir(path)
    if entries and ".metadata" not in entries and CHECKSUMS not in entries:
        raise CheckpointError(f"fxrec.checkpoint: {path} is a directory holding {len(entries)} entries (e.g. "
                              f"{sorted(entries)[0]!r}) and no checkpoint; saving would replace it whole: choose "
                              "another path (a new or empty directory, or an earlier checkpoint)")


def _commit(tmp: str, path: str) -> None:
    """Checksums into ``tmp``, then ``tmp`` renamed to ``path``. An existing ``path`` (a
    checkpoint: :func:`check_replaceable`) is moved to ``<path>.fxrec-old`` first and removed
    after (two renames: if the process dies between them, the previous checkpoint is whole at
    ``<path>.fxrec-old``)."""
    try:
        check_replaceable(path)
    except CheckpointError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_checksums(tmp)
    old = None
    if os.path.exists(path):
        old = path + _OLD
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
