#!/bin/bash
# Transform time of two versions of fxrec, alternating (the order swapped every round), each run
# in its own process: benchmarks/bench_transform.py --skip-torchrec --skip-memory --rounds 3.
#   benchmarks/compare_transform_versions.sh OLD_REF [ROUNDS]     (new = this checkout)
# The old version runs from a git worktree with its own TORCH_EXTENSIONS_DIR (its C++ kernels
# differ); JSON per run under /tmp/fxrec_cmp/{old,new}_<round>.json.
set -eu
old_ref=$1; rounds=${2:-3}
root=$(cd "$(dirname "$0")/.." && pwd)
py=$root/.venv/bin/python
work=/tmp/fxrec_cmp; mkdir -p $work
[ -d $work/old ] || git -C "$root" worktree add -q $work/old "$old_ref"
for ((r = 0; r < rounds; r++)); do
  if ((r % 2 == 0)); then order="old new"; else order="new old"; fi
  for v in $order; do
    if [ $v = old ]; then dir=$work/old; ext=$work/ext_old; else dir=$root; ext=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}; fi
    (cd "$dir" && TORCH_EXTENSIONS_DIR=$ext "$py" benchmarks/bench_transform.py --skip-torchrec --skip-memory \
      --rounds 3 --out $work/${v}_$r.json > $work/${v}_$r.log 2>&1)
    echo "$v round $r: $work/${v}_$r.json"
  done
done
