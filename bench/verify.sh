#!/usr/bin/env bash
# abnconvert verify's time, builds side by side: what CI's interop and zoo
# steps spend most of their time on (about 40% of .ci/run at fa29750).
#
#   bash bench/verify.sh ROUNDS BINARY...      # writes bench/verify.md (OUT)
#
# e.g. an earlier commit's build against the current one:
#   git worktree add /tmp/old OLDCOMMIT && (cd /tmp/old && go build -tags urfave_cli_no_docs -o /tmp/abn-old ./cmd/abnconvert)
#   make build && bash bench/verify.sh 3 /tmp/abn-old bin/abnconvert
#
# Checkpoints, as users have them (bench/trained_like.py, seed 0, about 11%
# negative gammas), in $ABN_BENCH_DIR (default /tmp/abn-bench): resnet50 and
# vgg16_bn, each converted once by the last binary (--relu abn). Each round
# runs every build's verify on each, at the sizes CI uses: resnet50 at batch
# 4, 40x40 (fixtures/zoo.py), vgg16_bn at batch 4, 64x64 (make
# interop-big). Rounds start with a different build each time, so that the
# shared machine's load falls on all alike; the table gives the fastest and
# the median round, wall time and CPU time (user + system), and peak RSS.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { sed -n '2,18p' "$0" >&2; exit 2; }
rounds=$1
shift
bins=("$@")
dir=${ABN_BENCH_DIR:-/tmp/abn-bench}
OUT=${OUT:-bench/verify.md}
PYTHON=${PYTHON:-/usr/bin/python3}
mkdir -p "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cases=("resnet50 4 40" "vgg16_bn 4 64")
last=${bins[${#bins[@]}-1]}
for c in "${cases[@]}"; do
	read -r m _ _ <<<"$c"
	[ -f "$dir/$m.trained.pth" ] || "$PYTHON" bench/trained_like.py "$m" trained "$dir/$m.trained.pth" --seed 0 >&2
	[ -f "$dir/$m.trained.abn.pth" ] || "$last" convert -i "$dir/$m.trained.pth" -o "$dir/$m.trained.abn.pth" --relu abn --quiet
done
declare -A wall cpu rss verdict
for ((r = 0; r < rounds; r++)); do
	for ((k = 0; k < ${#bins[@]}; k++)); do
		i=$(((k + r) % ${#bins[@]}))
		b=${bins[$i]}
		for c in "${cases[@]}"; do
			read -r m batch size <<<"$c"
			/usr/bin/time -f '%e %U %S %M' -o "$tmp/t" "$b" verify --original "$dir/$m.trained.pth" \
				--converted "$dir/$m.trained.abn.pth" --batch "$batch" --size "$size" --quiet >"$tmp/out" 2>&1 || true
			read -r e u s kb <"$tmp/t"
			wall[$i,$m]+="$e "
			cpu[$i,$m]+="$(awk -v u="$u" -v s="$s" 'BEGIN {printf "%.2f", u + s}') "
			rss[$i,$m]=$((kb / 1024))
			verdict[$i,$m]=$(tail -1 "$tmp/out" | cut -c1-40)
			echo "round $((r + 1)) $b $m: ${e}s wall, $(awk -v u="$u" -v s="$s" 'BEGIN {printf "%.2f", u + s}')s CPU, $((kb / 1024)) MB: ${verdict[$i,$m]}" >&2
		done
	done
done
stat() { # stat "v1 v2 ...": fastest and median
	tr ' ' '\n' <<<"$1" | sed '/^$/d' | sort -g | awk '{v[NR]=$1} END {printf "%.1f | %.1f", v[1], NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'
}
{
	echo "# abnconvert verify: time, builds side by side"
	echo
	echo "Command: \`bash bench/verify.sh $rounds ${bins[*]}\` (written $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs)."
	echo
	echo "Trained-like checkpoints (bench/trained_like.py, seed 0), converted with --relu abn by the last"
	echo "build; verify at CI's sizes. $rounds rounds, each build in turn; seconds, fastest | median."
	echo
	echo "| checkpoint | build | wall fastest | wall median | CPU fastest | CPU median | peak RSS (MB) | verdict |"
	echo "|---|---|---|---|---|---|---|---|"
	for c in "${cases[@]}"; do
		read -r m batch size <<<"$c"
		for ((i = 0; i < ${#bins[@]}; i++)); do
			echo "| $m, batch $batch, ${size}x$size | \`${bins[$i]}\` | $(stat "${wall[$i,$m]}") | $(stat "${cpu[$i,$m]}") | ${rss[$i,$m]} | ${verdict[$i,$m]} |"
		done
	done
} >"$OUT"
cat "$OUT"
