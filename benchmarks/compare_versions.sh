#!/bin/bash
# One benchmark script run on two versions of fxrec, alternating (the order swapped every round),
# each run in its own process:
#   benchmarks/compare_versions.sh OLD_REF ROUNDS SCRIPT [ARGS...]      (new = this checkout)
# e.g. benchmarks/compare_versions.sh db553ee 3 benchmarks/bench_transform.py --skip-torchrec --skip-memory --rounds 3
#      benchmarks/compare_versions.sh ed798a7 3 benchmarks/bench_sharded.py --only-mixed
# This checkout's SCRIPT measures both (copied into the old version's git worktree, so the
# measurement is the same code); the old version has its own TORCH_EXTENSIONS_DIR (its C++
# kernels differ). SCRIPT must take --out; JSON per run under /tmp/fxrec_cmp/{old,new}_<round>.json.
set -eu
old_ref=$1; rounds=$2; script=$3; shift 3
root=$(cd "$(dirname "$0")/.." && pwd)
py=$root/.venv/bin/python
work=/tmp/fxrec_cmp; mkdir -p $work
if [ ! -d $work/old ]; then
  git -C "$root" worktree add -q $work/old "$old_ref"
elif [ "$(git -C $work/old rev-parse HEAD)" != "$(git -C "$root" rev-parse "$old_ref")" ]; then
  git -C $work/old checkout -q --detach "$old_ref"
fi
cp "$root/$script" "$work/old/$script.cmp.py"
for ((r = 0; r < rounds; r++)); do
  if ((r % 2 == 0)); then order="old new"; else order="new old"; fi
  for v in $order; do
    if [ $v = old ]; then dir=$work/old; ext=$work/ext_old; s=$script.cmp.py
    else dir=$root; ext=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}; s=$script; fi
    (cd "$dir" && TORCH_EXTENSIONS_DIR=$ext "$py" "$s" "$@" --out $work/${v}_$r.json > $work/${v}_$r.log 2>&1)
    echo "$v round $r: $work/${v}_$r.json"
  done
done
