#!/usr/bin/env bash
# An older commit's openm3 beside this tree's benchmarks, for `gpu_all.sh nodes` / `servegraphs` comparisons:
#   bash scripts/before.sh COMMIT [DIR]      (DIR defaults to before_<short hash>, made in the repo root)
# prints the directory; it is excluded from git (.git/info/exclude), so pass it to the device's `run` in `carry`
# and as BEFORE="$PWD/DIR" on the device.
set -euo pipefail
cd "$(dirname "$0")/.."
commit=$(git rev-parse --short "${1:?usage: bash scripts/before.sh COMMIT [DIR]}")
dir=${2:-before_$commit}
rm -rf "$dir" && mkdir -p "$dir"
git archive "$commit" openm3 | tar x -C "$dir"
tar c --exclude=results --exclude=__pycache__ benchmarks | tar x -C "$dir"
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qxF "/$dir/" "$exclude" 2>/dev/null || echo "/$dir/" >> "$exclude"
echo "$dir"
