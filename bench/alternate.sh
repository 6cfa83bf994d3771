#!/usr/bin/env bash
# Two builds of abnconvert compared on a shared machine, where runs minutes
# apart differ by up to 0.3x: `cp` and each build convert the same
# checkpoint in turn, round after round, so that each round's noise falls
# on all of them alike; the minimum and median of the rounds are reported,
# wall time and CPU time (user + system, of the child, from bash's
# `times`, to the millisecond).
#
#   bash bench/alternate.sh ROUNDS CHECKPOINT BINARY...
#
# e.g. the build of an earlier commit against the current one:
#   git worktree add /tmp/old OLDCOMMIT && (cd /tmp/old && go build -tags urfave_cli_no_docs -o /tmp/abn-old ./cmd/abnconvert)
#   make build
#   bash bench/alternate.sh 15 /tmp/abn-bench/densenet201.trained.pth /tmp/abn-old bin/abnconvert
# Checkpoints come from bench/convert.sh (bench/trained_like.py). Each
# output is written to a temporary file beside the checkpoint and removed.
set -euo pipefail
[ $# -ge 3 ] || { sed -n '2,17p' "$0" >&2; exit 2; }
rounds=$1 in=$2; shift 2
out=$(dirname "$in")/.alternate-out.pth
tools=(cp "$@")
declare -A wall cpu
tf=$(mktemp)
trap 'rm -f "$tf" "$out"' EXIT
childcpu() { # the children's user + system milliseconds so far, into $cs
  # In this shell (a $(...) subshell has children of its own) and with
  # builtins only, so that measuring adds no child of its own.
  times >"$tf"
  local l
  mapfile -t l <"$tf"
  read -r u sy <<<"${l[1]}"
  cs=0
  for v in "$u" "$sy"; do # 0m1.234s
    local m=${v%%m*} sec=${v#*m}
    sec=${sec%s}
    cs=$((cs + m * 60000 + 10#${sec/./}))
  done
}
# Each round starts with the next tool (round r runs tools r, r+1, ...),
# so that no tool always follows the same one: on the 2 GB checkpoint,
# whose previous output the kernel is still writing back, one build
# measured a median of 1.03 s always third and 0.76 s always second (5
# rounds each, 2026-12-02).
for ((r = 0; r < rounds; r++)); do
  for ((k = 0; k < ${#tools[@]}; k++)); do
    t=${tools[(r + k) % ${#tools[@]}]}
    rm -f "$out"
    childcpu; c0=$cs t0=$EPOCHREALTIME
    if [ "$t" = cp ]; then cp "$in" "$out"; else "$t" convert --input "$in" --output "$out" --quiet >/dev/null; fi
    t1=$EPOCHREALTIME; childcpu; c1=$cs
    wall[$t]+="$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", (b-a)*1000}') "
    cpu[$t]+="$((c1 - c0)) "
  done
done
stats() { tr ' ' '\n' <<<"$1" | grep . | sort -n | awk '{v[NR]=$1} END{printf "%.1f | %.1f", v[1], v[int((NR+1)/2)]}'; }
echo "Command: \`bash bench/alternate.sh $rounds $in $*\` on $(nproc) cores, $(date -u '+%Y-%m-%d %H:%M') UTC."
echo
echo "| tool | wall min ms | wall median ms | CPU min ms | CPU median ms |"
echo "|---|---|---|---|---|"
for t in "${tools[@]}"; do
  echo "| $t | $(stats "${wall[$t]}") | $(stats "${cpu[$t]}") |"
done
