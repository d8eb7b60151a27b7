#!/usr/bin/env bash
# Build fxrec_infer against the libtorch inside the installed torch package (no CMake needed).
#   examples/inference_cpp/build.sh [PYTHON] [OUT]
set -euo pipefail
PY=${1:-python3}
OUT=${2:-$(dirname "$0")/fxrec_infer}
TORCH=$("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))')
ABI=$("$PY" -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')
${CXX:-g++} -O2 -std=c++20 -D_GLIBCXX_USE_CXX11_ABI="$ABI" "$(dirname "$0")/main.cpp" -o "$OUT" \
  -I"$TORCH/include" -I"$TORCH/include/torch/csrc/api/include" \
  -L"$TORCH/lib" -Wl,-rpath,"$TORCH/lib" -Wl,--no-as-needed -ltorch -ltorch_cpu -lc10 -ldl
echo "$OUT"
