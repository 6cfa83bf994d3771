#!/usr/bin/env bash
# The runtime's training step against PyTorch's, side by side in one run,
# for each network in MODELS.
#
#   bash bench/runtime.sh      # resnet50 and efficientnet_b0 at batch 8, deeplabv3_resnet50 at batch 2; 3x224x224, 2 threads, 5 rounds
#   MODELS="resnet50:2 efficientnet_b0:2" SIZE=64 ROUNDS=2 bash bench/runtime.sh
#
# bench/torch_step.py --save builds each torchvision network (weights=None;
# segmentation models with aux_loss=False) and writes it whole
# (torch.save(model)). Each round then times one forward+backward of that
# very file in the Go runtime (BenchmarkModelStep: the module read as
# abnconvert reads it, CPU backend, default build: the AVX2/FMA assembly
# GEMM kernel on CPUs that have them) and in PyTorch (bench/torch_step.py
# --load, torch.set_num_threads), one after the other so that both see the
# same machine load. The machine is shared, so single rounds move a lot:
# the report gives the ratio of the fastest rounds (the least disturbed), of
# the medians, and each round's own ratio. Writes bench/runtime.md.
set -euo pipefail
cd "$(dirname "$0")/.."

MODELS=${MODELS:-resnet50:8 efficientnet_b0:8 deeplabv3_resnet50:2}
SIZE=${SIZE:-224}
ROUNDS=${ROUNDS:-5}
THREADS=${THREADS:-2}
PYTHON=${PYTHON:-/usr/bin/python3}
OUT=${OUT:-bench/runtime.md}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
BIN=$TMP/runtime.test

go test -c -o "$BIN" ./runtime
kernel=$(go test -count=1 -run TestGEMM -v ./runtime 2>/dev/null | sed -n "s/.*micro-kernel: //p" | tail -1)

median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
least() { printf '%s\n' "$@" | sort -g | head -1; }

rows=""
summary=""
for spec in $MODELS; do
	name=${spec%%:*}
	batch=${spec##*:}
	module=$TMP/$name.pth
	"$PYTHON" bench/torch_step.py --model "$name" --save "$module"
	go_times=()
	torch_times=()
	ratios=()
	for r in $(seq "$ROUNDS"); do
		# BenchmarkModelStep runs one untimed step first; -test.benchtime 2x then times two.
		g=$(GOMAXPROCS=$THREADS RUNTIME_BENCH_MODEL=$module RUNTIME_BENCH_BATCH=$batch RUNTIME_BENCH_SIZE=$SIZE \
			RUNTIME_BENCH_THREADS=$THREADS "$BIN" -test.run '^$' -test.bench '^BenchmarkModelStep$' -test.benchtime 2x |
			awk '/^BenchmarkModelStep/ {print $3 / 1e9}')
		t=$("$PYTHON" bench/torch_step.py --load "$module" --batch "$batch" --size "$SIZE" --threads "$THREADS" --repeat 2 |
			"$PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["median_s"])')
		g=$(printf '%.2f' "$g")
		t=$(printf '%.2f' "$t")
		echo "$name round $r: runtime ${g}s, pytorch ${t}s"
		go_times+=("$g")
		torch_times+=("$t")
		ratios+=("$(awk -v g="$g" -v t="$t" 'BEGIN {printf "%.2f", g/t}')")
	done
	gm=$(median "${go_times[@]}")
	tm=$(median "${torch_times[@]}")
	gb=$(least "${go_times[@]}")
	tb=$(least "${torch_times[@]}")
	ratio=$(awk -v g="$gb" -v t="$tb" 'BEGIN {printf "%.2f", g/t}')
	mratio=$(awk -v g="$gm" -v t="$tm" 'BEGIN {printf "%.2f", g/t}')
	summary+="| $name | $batch | $gb | $tb | **${ratio}x** | ${mratio}x |"$'\n'
	rows+="| $name | Go runtime | $gb | $gm | ${go_times[*]} |"$'\n'
	rows+="| | PyTorch | $tb | $tm | ${torch_times[*]} |"$'\n'
	rows+="| | ratio | **${ratio}x** | ${mratio}x | ${ratios[*]} (per round) |"$'\n'
	echo "$name: ratio ${ratio}x (fastest rounds), ${mratio}x (medians)"
done
torchv=$("$PYTHON" -c 'import torch; print(torch.__version__)')
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')
load=$(cut -d' ' -f1-3 /proc/loadavg)

cat >"$OUT" <<EOF2
# Runtime speed: one training step, Go runtime against PyTorch

Command: \`MODELS="$MODELS" SIZE=$SIZE ROUNDS=$ROUNDS THREADS=$THREADS bash bench/runtime.sh\`
(written $(date -u +%Y-%m-%dT%H:%MZ)).

One forward and backward pass in training mode of each torchvision network,
3x${SIZE}x${SIZE}, float32, $THREADS threads on each side, at the batch given (name:batch),
rounds interleaved (runtime, then PyTorch) so that both see the same machine
load. Both sides run the same file: the network built with weights=None and
saved whole by \`bench/torch_step.py --save\`; the runtime reads it as
abnconvert reads any whole module (Dropout and StochasticDepth active, as in
PyTorch's training mode). Segmentation models are timed on their "out" map.

| network | batch | runtime fastest (s) | PyTorch fastest (s) | ratio, fastest | ratio, medians |
|---|---|---|---|---|---|
${summary}
Every round:

| network | | fastest (s) | median (s) | rounds (s) |
|---|---|---|---|---|
${rows}
Runtime: CPU backend, GEMM kernel: $kernel. PyTorch $torchv (\`torch.set_num_threads($THREADS)\`).
The aims: resnet50 at most 3x (issue 3), efficientnet_b0 and deeplabv3_resnet50
within 2x (issue 12). The runtime's time includes what its API costs and
PyTorch's does not: copying the input in, and every parameter gradient out
into a fresh map.

Machine: $(nproc) cores, $cpu; load average at the end $load. Go $(go env GOVERSION).
With the purego build tag (or on a CPU without AVX2 and FMA) the runtime uses
its plain-Go 4x4 kernel instead, about ten times slower on the convolutions.
EOF2
echo "wrote $OUT"
