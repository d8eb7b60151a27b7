"""fxrec's own CPU kernels (``fxrec/csrc/pooled.cpp``): built on first use, then loaded.

The kernels are plain C++ against the installed torch's headers (no pybind, no Python headers):
one ``g++`` line, the same kind ``examples/inference_cpp/build.sh`` uses, builds a shared library
that registers ``torch.ops.fxrec.pooled_forward`` and ``torch.ops.fxrec.sgd_update``. The library
is cached under ``$FXREC_CACHE`` (default ``~/.cache/fxrec``), keyed by the source, the torch
version, the compiler flags and the CPU, so it is built once per machine and torch (about 10 s
here).

Nothing depends on the kernels being there: when no C++ compiler is found, the build fails, or
``FXREC_NATIVE=0`` is set, :func:`available` is False, :func:`why_unavailable` says why, and the
groups run their other paths (the report names which). Use from Python: :func:`ops`.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Optional

import torch

_SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "pooled.cpp")
_lock = threading.Lock()
_state: dict = {"tried": False, "ok": False, "why": "not built yet"}


def _cpu_tag() -> str:
    """Machine features the build depends on (-march=native): a cached library built on
    another CPU is never loaded here."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = line
                    break
    except OSError:
        pass
    return hashlib.sha256((os.uname().machine + flags).encode()).hexdigest()[:12]


def _flags():
    from torch.utils import cpp_extension

    torch_dir = os.path.dirname(torch.__file__)
    lib_dir = os.path.join(torch_dir, "lib")
    inc = [f"-I{p}" for p in cpp_extension.include_paths()]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -fno-math-errno: sqrt may be vectorised (it changes no result, only errno, never read)
    compile_flags = ["-O3", "-march=native", "-fno-math-errno", "-std=c++17", "-fPIC", "-fopenmp",
                     f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    # ATen's parallel_for is OpenMP in these builds: link the libgomp torch itself loaded, so the
    # process keeps one OpenMP thread pool.
    gomp = sorted(glob.glob(os.path.join(lib_dir, "libgomp*.so*")))
    omp = [f"-L{lib_dir}", f"-l:{os.path.basename(gomp[0])}"] if gomp else ["-fopenmp"]
    link = ["-shared", f"-L{lib_dir}", "-lc10", "-ltorch_cpu", *omp, f"-Wl,-rpath,{lib_dir}"]
    return inc, compile_flags, link


def _library_path() -> str:
    inc, cflags, link = _flags()
    with open(_SOURCE, "rb") as fh:
        src = fh.read()
    key = hashlib.sha256(
        src + repr((torch.__version__, cflags, link, _cpu_tag(), sys.version_info[:2])).encode()
    ).hexdigest()[:16]
    return os.path.join(_cache_dir(), f"fxrec_kernels_{key}.so")


def _cache_dir() -> str:
    """``$FXREC_CACHE``, else ``~/.cache/fxrec``, else (a home that cannot be written) a folder
    of this user's in the system's temporary directory."""
    if os.environ.get("FXREC_CACHE"):
        return os.environ["FXREC_CACHE"]
    home = os.path.join(os.path.expanduser("~"), ".cache", "fxrec")
    try:
        os.makedirs(home, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return os.path.join(tempfile.gettempdir(), f"fxrec-{os.getuid()}")


def _build(target: str) -> None:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler (g++) found; set CXX or install g++")
    inc, cflags, link = _flags()
    os.makedirs(os.path.dirname(target), exist_ok=True)
    # build next to the target, then rename: concurrent builds (pytest workers, torchrun ranks)
    # never load a half-written file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    cmd = [cxx, *cflags, *inc, _SOURCE, "-o", tmp, *link]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"building fxrec's kernels failed:\n{' '.join(cmd)}\n{r.stderr[-3000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> bool:
    """Build (once) and load the kernels; True when ``torch.ops.fxrec`` has them."""
    with _lock:
        if _state["tried"]:
            return _state["ok"]
        _state["tried"] = True
        if os.environ.get("FXREC_NATIVE", "1") == "0":
            _state["why"] = "disabled by FXREC_NATIVE=0"
            return False
        if hasattr(torch.ops, "fxrec") and hasattr(torch.ops.fxrec, "pooled_forward"):
            _state.update(ok=True, why="")
            return True
        try:
            path = _library_path()
            if not os.path.exists(path):
                _build(path)
            torch.ops.load_library(path)
            torch.ops.fxrec.pooled_forward  # noqa: B018 - raises when the library did not register
            _state.update(ok=True, why="")
        except Exception as e:  # any failure: the other paths run, and the report says why
            _state.update(ok=False, why=f"{type(e).__name__}: {e}".strip())
        return _state["ok"]


def available() -> bool:
    return load()


def why_unavailable() -> Optional[str]:
    return None if load() else _state["why"]


def ops():
    """``torch.ops.fxrec`` (after :func:`load` returned True)."""
    return torch.ops.fxrec
