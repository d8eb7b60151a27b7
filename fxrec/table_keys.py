"""Per-table dicts (``optimizer=``, ``weights_precision=``, ``quantize=`` of ``transform`` and
``fxrec.plan``): which key decides for a table, and the check that every key decides for one.

A key names a table by its name (``"bags.0"``), its parameter's (``"bags.0.weight"``), or a glob
pattern matching either (``"bags.*"``); the first key that names a table decides for it. A key
that names no table, or only tables an earlier key decides for otherwise, would be ignored without
a word (``{"bags.*": Adagrad(), "bags.0": SGD()}`` trains ``bags.0`` with Adagrad): both are
refused (a later key giving its tables what the earlier one gives them is taken).
Pure Python, shared by the passes and the planner.
"""

from __future__ import annotations

import fnmatch
from typing import Dict, Optional, Sequence, Tuple, Type


def names_table(key: str, table: str, param: Optional[str] = None) -> bool:
    """Whether ``key`` names the table ``table`` (whose parameter is ``param``, if known)."""
    names = (table,) if param is None else (table, param)
    return key in names or any(fnmatch.fnmatchcase(n, key) for n in names)


def deciding_key(spec: Dict[str, object], table: str, param: Optional[str] = None) -> Optional[str]:
    """The first key of ``spec`` that names the table, or None."""
    return next((k for k in spec if names_table(k, table, param)), None)


def check_keys(spec: Dict[str, object], tables: Sequence[Tuple[str, Optional[str]]], what: str,
               error: Type[Exception] = ValueError, noun: str = "table", note: str = "") -> None:
    """Raise ``error`` unless every key of ``spec`` decides for at least one of ``tables`` (``(name,
    parameter name or None)``): naming the keys that name no table (``what`` says whose keys, as
    ``"fxrec: optimizer"``; with the tables, and ``note``), or a key every table of which an
    earlier key decides for."""
    names = sorted({t for t, _ in tables})
    unused = [k for k in spec if not any(names_table(k, t, p) for t, p in tables)]
    if unused:
        raise error(f"{what} keys {unused} match no {noun}; the tables are {names}{note}")
    decided = {deciding_key(spec, t, p) for t, p in tables}
    for k in spec:
        if k in decided:
            continue
        mine = sorted({t for t, p in tables if names_table(k, t, p)})
        earlier = sorted({deciding_key(spec, t, p) for t, p in tables if t in mine}, key=list(spec).index)
        if all(spec[e] is spec[k] or spec[e] == spec[k] for e in earlier):
            continue  # (the earlier keys give its tables what it gives them: nothing is lost)
        raise error(f"{what} key {k!r} decides for no table: every table it names ({mine}) an earlier key names "
                    f"({', '.join(repr(e) for e in earlier)}), and the first key that names a table decides for it; "
                    f"put {k!r} first to have it decide for them")
