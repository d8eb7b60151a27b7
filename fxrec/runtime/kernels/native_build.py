"""Building and loading fxrec's C++ CPU kernels (``fxrec/csrc/pooled.cpp``) for the ``native``
kernel (:mod:`fxrec.runtime.kernels.native`).

The library is built by ``torch.utils.cpp_extension.load`` on first use (about 10 s here) and
cached by torch under ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), once
per machine, checkout and torch: its name carries a tag of the CPU (it is built with
``-march=native``), the source's path and torch's (:func:`_build_tag`).
Nothing depends on it being there: when the build fails or ``FXREC_NATIVE=0`` is set,
:func:`available` is False, :func:`why_unavailable` says why, and the rule table picks another
kernel (the report says so).
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import sysconfig
import threading
from typing import List, Optional

import torch

_SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "csrc",
                       "pooled.cpp")
_lock = threading.Lock()
_state: dict = {"tried": False, "ok": False, "why": "not built yet"}


def _build_tag() -> str:
    """What the build depends on, as part of the extension's name: the machine's features
    (-march=native: a library built on another CPU is never loaded here), and this checkout's
    source and torch (torch rebuilds an extension whose build command changed: two checkouts or
    environments on one machine sharing a name rebuilt it, ~10 s, each time use passed between them)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((line for line in fh if line.startswith("flags")), "")
    except OSError:
        pass
    key = "\0".join((os.uname().machine, flags, _SOURCE, os.path.dirname(torch.__file__), torch.__version__))
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _omp_link() -> List[str]:
    """ATen's parallel_for is OpenMP in these builds: link the libgomp torch itself loaded, so
    the process keeps one OpenMP thread pool."""
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    gomp = sorted(glob.glob(os.path.join(lib_dir, "libgomp*.so*")))
    return [f"-L{lib_dir}", f"-l:{os.path.basename(gomp[0])}", f"-Wl,-rpath,{lib_dir}"] if gomp else ["-fopenmp"]


def _build_and_load() -> None:
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # the ninja wheel's program, when the venv is not activated
        scripts = sysconfig.get_path("scripts")
        if os.path.exists(os.path.join(scripts, "ninja")):
            os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    try:
        cpp_extension.load(
            name=f"fxrec_kernels_{_build_tag()}", sources=[_SOURCE], is_python_module=False,
            # -fno-math-errno: sqrt may be vectorised (it changes no result, only errno, never read)
            extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fopenmp"],
            extra_ldflags=_omp_link(), verbose=False,
        )
    except Exception as e:
        raise RuntimeError(f"building fxrec's kernels failed: {e}") from e


def load() -> bool:
    """Build (once per machine) and load the kernels; True when ``torch.ops.fxrec`` has them."""
    with _lock:
        if _state["tried"]:
            return _state["ok"]
        _state["tried"] = True
        if os.environ.get("FXREC_NATIVE", "1") == "0":
            _state["why"] = "disabled by FXREC_NATIVE=0"
            return False
        try:
            if not (hasattr(torch.ops, "fxrec") and hasattr(torch.ops.fxrec, "pooled_forward")):
                _build_and_load()
            torch.ops.fxrec.pooled_forward  # noqa: B018 - raises when the library did not register
            _state.update(ok=True, why="")
        except Exception as e:  # any failure: another kernel runs, and the report says why
            _state.update(ok=False, why=f"{type(e).__name__}: {e}".strip())
        return _state["ok"]


def available() -> bool:
    return load()


def why_unavailable() -> Optional[str]:
    return None if load() else _state["why"]


def ops():
    """``torch.ops.fxrec`` (after :func:`load` returned True)."""
    return torch.ops.fxrec
