"""The exact shard layouts of the sharding types (what the shard pass will cut).

    table_wise      one shard: all rows, all columns, on one rank
    row_wise        rows in contiguous blocks of ceil(rows / world_size) over ranks 0..W-1:
                    rank r holds rows [r*block, min((r+1)*block, rows)) (fbgemm's
                    block_bucketize_sparse_features convention); trailing ranks may hold 0 rows
    table_row_wise  the same over the ranks of one host, in local-rank order
    column_wise     the columns in k shards whose widths are multiples of 4 (fbgemm's training
                    TBE takes dims % 4 == 0 only), as equal as that allows, widest first; each
                    shard is table-wise on its own rank
    data_parallel   every rank holds all rows and columns

Each function returns ``(offset, size)`` pairs that cover ``[0, n)`` exactly once, in order.
"""

from __future__ import annotations

from typing import List, Tuple

from .specs import COLUMN_ALIGNMENT


def row_block(num_rows: int, num_ranks: int) -> int:
    """Rows per rank of a row-wise split: ceil(num_rows / num_ranks)."""
    return -(-num_rows // num_ranks)


def row_blocks(num_rows: int, num_ranks: int) -> List[Tuple[int, int]]:
    """``(row_offset, num_rows)`` per rank 0..num_ranks-1 (see the module docstring)."""
    if num_ranks < 1:
        raise ValueError(f"row_blocks: num_ranks must be >= 1, got {num_ranks}")
    block = row_block(num_rows, num_ranks)
    out = []
    for r in range(num_ranks):
        start = min(r * block, num_rows)
        out.append((start, min(start + block, num_rows) - start))
    return out


def max_column_shards(dim: int) -> int:
    """How many column-wise shards ``dim`` allows (0 when dim is not a multiple of 4)."""
    return dim // COLUMN_ALIGNMENT if dim % COLUMN_ALIGNMENT == 0 else 0


def column_splits(dim: int, num_shards: int) -> List[Tuple[int, int]]:
    """``(col_offset, num_cols)`` of ``num_shards`` column shards, widths multiples of 4."""
    units = max_column_shards(dim)
    if units == 0:
        raise ValueError(f"column-wise sharding needs a dim that is a multiple of {COLUMN_ALIGNMENT}, got {dim}")
    if not 1 <= num_shards <= units:
        raise ValueError(f"dim {dim} can be cut into 1 to {units} column shards, not {num_shards}")
    base, extra = divmod(units, num_shards)
    out = []
    offset = 0
    for i in range(num_shards):
        width = (base + (1 if i < extra else 0)) * COLUMN_ALIGNMENT
        out.append((offset, width))
        offset += width
    return out
