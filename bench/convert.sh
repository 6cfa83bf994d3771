#!/usr/bin/env bash
# Conversion speed and memory, side by side in one run: `cp` of the file (the
# physical limit: every byte moved once), abnconvert, and the Python baseline
# a user would otherwise write (../shared/tools/python_baseline_convert.py).
#
#   bash bench/convert.sh [MODEL ...]      (default: wide_resnet101_2 resnet50)
#
# Checkpoints are made by real torchvision (random weights, same size and
# layout as the released ones) in $BENCH_DIR (default /tmp/abn-bench). Each
# tool runs 3 times after a warm-up copy (page cache warm for all three); the
# median wall time and the largest peak RSS are reported. `cp` does not
# flush to disk, and neither does abnconvert by default (it renames a
# complete temporary file into place); the --fsync column adds the flush. The table is
# written to stdout and to bench/convert.md.
set -euo pipefail
cd "$(dirname "$0")/.."
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(wide_resnet101_2 resnet50)
dir=${BENCH_DIR:-/tmp/abn-bench}
mkdir -p "$dir"
baseline=../shared/tools/python_baseline_convert.py
go build -o bin/abnconvert ./cmd/abnconvert

measure() { # prints "seconds maxrss_kb" of the median-time run of 3
  local out=$1; shift
  local runs=()
  for _ in 1 2 3; do
    rm -f "$out"
    /usr/bin/time -f "%e %M" -o "$dir/time.txt" "$@" >/dev/null 2>"$dir/stderr.txt" || { cat "$dir/stderr.txt" >&2; return 1; }
    runs+=("$(cat "$dir/time.txt")")
  done
  printf '%s\n' "${runs[@]}" | sort -n | awk 'NR==2{t=$1} {if ($2>m) m=$2} END{print t, m}'
}

{
  echo "# Conversion benchmark"
  echo
  echo "Command: \`bash bench/convert.sh ${models[*]}\` on $(nproc) cores, $(date -u +%Y-%m-%d), $(/usr/bin/python3 -c 'import torch; print("torch", torch.__version__)')."
  echo "Median of 3 runs, page cache warm; peak RSS is the largest of the 3."
  echo
  echo "| checkpoint | size | cp | abnconvert | ratio to cp | abnconvert peak RSS | abnconvert --fsync | Python baseline | baseline peak RSS |"
  echo "|---|---|---|---|---|---|---|---|---|"
} > "$dir/table.md"

for m in "${models[@]}"; do
  in="$dir/$m.pth"
  if [ ! -f "$in" ]; then
    /usr/bin/python3 -c "import torch, torchvision; torch.save(torchvision.models.$m().state_dict(), '$in')"
  fi
  size=$(stat -c %s "$in")
  cp "$in" "$dir/warm.pth" && rm -f "$dir/warm.pth"
  read -r cpt cpm < <(measure "$dir/cp.pth" cp "$in" "$dir/cp.pth")
  read -r abt abm < <(measure "$dir/abn.pth" bin/abnconvert convert --input "$in" --output "$dir/abn.pth" --quiet)
  read -r aft afm < <(measure "$dir/abn.pth" bin/abnconvert convert --input "$in" --output "$dir/abn.pth" --quiet --fsync)
  read -r pyt pym < <(measure "$dir/py.pth" /usr/bin/python3 "$baseline" "$in" "$dir/py.pth")
  ratio=$(awk -v a="$abt" -v c="$cpt" 'BEGIN{ if (c>0) printf "%.2fx", a/c; else print "n/a" }')
  printf '| %s | %d MB | %s s | %s s | %s | %d MB | %s s | %s s | %d MB |\n' "$m" $((size/1000000)) "$cpt" "$abt" "$ratio" $((abm/1024)) "$aft" "$pyt" $((pym/1024)) >> "$dir/table.md"
  rm -f "$dir/cp.pth" "$dir/abn.pth" "$dir/py.pth"
done
cp "$dir/table.md" bench/convert.md
cat bench/convert.md
