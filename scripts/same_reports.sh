#!/usr/bin/env bash
# Usage: scripts/same_reports.sh [REV_A [REV_B]]   (default: HEAD~1 and the working tree)
# The text and JSON reports of every shipped demo (replay, --chain, --verbose, inspect, validate, scan, diff,
# replay-tui --check, every --help), produced by two revisions of the code, compared byte for byte; only the
# wall-clock "seconds" of scan rows are masked. A refactor that claims "no behaviour change" runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
A=${1:-HEAD~1}; B=${2:-}
WORK=$(mktemp -d)
trap 'for t in a b; do git worktree remove --force "$WORK/$t" >/dev/null 2>&1 || true; done; rm -rf "$WORK"; git worktree prune' EXIT
git worktree add -q --detach "$WORK/a" "$A"
if [ -n "$B" ]; then git worktree add -q --detach "$WORK/b" "$B"; TREE_B="$WORK/b"; else TREE_B="$PWD"; fi
snapshot() {  # snapshot TREE OUT
  local tree=$1 out=$2 demos="$WORK/demos"
  mkdir -p "$out"; rm -rf "$demos"
  run() { local name=$1; shift; (cd "$WORK" && PYTHONPATH="$tree" "$@" > "$out/$name" 2>&1; echo "rc=$?" >> "$out/$name") || true; }
  run write-all python -m replay_lib demo write-all "$demos"
  for b in $(ls "$demos"); do
    for flags in "" "--format json" "--chain" "--chain --format json" "--verbose"; do
      run "$b.replay${flags// /}" python -m replay_lib replay $flags "$demos/$b"
    done
    run "$b.inspect" python -m replay_lib inspect "$demos/$b"
    run "$b.inspect-json" python -m replay_lib inspect --format json "$demos/$b"
    run "$b.validate" python -m replay_lib validate "$demos/$b"
  done
  run scan python -m replay_lib scan "$demos"
  run scan-json python -m replay_lib scan --format json "$demos"
  sed -i -E 's/"seconds": [0-9.e-]+/"seconds": 0/' "$out/scan-json"
  run diff python -m replay_lib diff "$demos/pr65-buggy" "$demos/pr65-fixed"
  for c in "" inspect validate replay scan diff import config demo; do run "help.$c" python -m replay_lib $c --help; done
  run tui-check python -m replay_tui "$demos/pr65-buggy" --check
}
snapshot "$WORK/a" "$WORK/out-a"
snapshot "$TREE_B" "$WORK/out-b"
if diff -r "$WORK/out-a" "$WORK/out-b"; then
  echo "same reports: $(ls "$WORK/out-a" | wc -l) outputs, $(cat "$WORK"/out-a/* | wc -c) bytes, byte for byte ($A vs ${B:-working tree})"
else
  echo "reports differ ($A vs ${B:-working tree})"; exit 1
fi
