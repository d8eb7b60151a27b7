"""The save and load planners :mod:`fxrec.checkpoint` hands to ``torch.distributed.checkpoint``:
DCP's default ones plus a shard item per table piece a rank holds (its resharding reads every
saved chunk that overlaps a piece), non-tensor entries read with ``weights_only=True``, and a file
reader whose ``.metadata`` goes through :func:`fxrec.checkpoint_files._read_metadata`."""

from __future__ import annotations

import io
from typing import Dict, List, Tuple

import torch

from .checkpoint_files import _read_metadata

# fqn -> (global shape, [(chunk offsets, chunk sizes, local view), ...])
_Pieces = Dict[str, Tuple[torch.Size, List[Tuple[torch.Size, torch.Size, torch.Tensor]]]]


def _views(pieces: _Pieces) -> Dict[Tuple[str, tuple], torch.Tensor]:
    """Each piece's local view by (fqn, chunk offsets): what the planners hand DCP to read or write."""
    return {(fqn, tuple(off)): view for fqn, (_, ps) in pieces.items() for off, _, view in ps}


# torch.distributed.checkpoint is imported on first use (it adds ~0.3 s to ``import fxrec``).
_PLANNERS = None


def _dcp():
    import torch.distributed.checkpoint as dcp

    return dcp


def _planners():
    """(_PieceSavePlanner, _PieceLoadPlanner, _SafeLoadPlanner, _SafeReader), defined on first use."""
    global _PLANNERS
    if _PLANNERS is not None:
        return _PLANNERS
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class _PieceSavePlanner(DefaultSavePlanner):
        """The default planner for the whole tensors in the state dict, plus one shard write item per
        table piece this rank holds."""

        def __init__(self, pieces: _Pieces):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self._pieces, self._views = pieces, _views(pieces)

        def create_local_plan(self) -> SavePlan:
            plan = super().create_local_plan()
            items = list(plan.items)
            for fqn, (size, pieces) in self._pieces.items():
                for offsets, sizes, view in pieces:
                    items.append(WriteItem(
                        index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                                    properties=TensorProperties.create_from_tensor(view), size=size),
                    ))
            self.plan = SavePlan(items, storage_data=plan.storage_data, planner_data=plan.planner_data)
            return self.plan

        def lookup_object(self, index: MetadataIndex):
            if index.fqn in self._pieces:
                return self._views[(index.fqn, tuple(index.offset))]
            return super().lookup_object(index)

    class _SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's planner, reading non-tensor entries with ``torch.load(weights_only=True)``."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            import torch as _torch

            self.state_dict[read_item.dest_index.fqn] = _torch.load(value, weights_only=True)

    class _PieceLoadPlanner(_SafeLoadPlanner):
        """The default planner for the whole tensors in the state dict, plus read items for the table
        pieces this rank holds (DCP's resharding: every saved chunk that overlaps a piece)."""

        def __init__(self, pieces: _Pieces):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self._pieces, self._views = pieces, _views(pieces)

        def create_local_plan(self) -> LoadPlan:
            plan = super().create_local_plan()
            items = list(plan.items)
            for fqn, (_, pieces) in self._pieces.items():
                if not pieces:
                    continue
                md = self.metadata.state_dict_metadata[fqn]  # presence and shape were checked before
                chunks = [ChunkStorageMetadata(offsets=off, sizes=sz) for off, sz, _ in pieces]
                items.extend(create_read_items_for_chunk_list(fqn, md, chunks))
            return LoadPlan(items, storage_data=plan.storage_data, planner_data=plan.planner_data)

        def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
            if index.fqn in self._pieces:
                return self._views[(index.fqn, tuple(index.offset))]
            return super().lookup_tensor(index)

    from torch.distributed.checkpoint import FileSystemReader

    class _SafeReader(FileSystemReader):
        """DCP's file reader, reading .metadata with :class:`_MetadataUnpickler`."""

        def read_metadata(self, *args, **kwargs):
            md = _read_metadata(self.path)
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    _PLANNERS = (_PieceSavePlanner, _PieceLoadPlanner, _SafeLoadPlanner, _SafeReader)
    return _PLANNERS
