#!/usr/bin/env bash
# The runtime's training step against PyTorch's, side by side in one run.
#
#   bash bench/runtime.sh                 # resnet50, batch 8, 3x224x224, 2 threads, 5 rounds
#   BATCH=2 SIZE=64 ROUNDS=2 bash bench/runtime.sh
#
# Each round times one forward+backward of torchvision's resnet50 in the Go
# runtime (BenchmarkResNet50Step, CPU backend, default build: the AVX2/FMA
# assembly GEMM kernel on CPUs that have them) and then in PyTorch (bench/torch_step.py,
# torch.set_num_threads(2)), so that both see the same machine load. The
# machine is shared, so single rounds move a lot: the report gives the
# ratio of the fastest rounds (the least disturbed), of the medians, and
# each round's own ratio. Writes bench/runtime.md.
set -euo pipefail
cd "$(dirname "$0")/.."

BATCH=${BATCH:-8}
SIZE=${SIZE:-224}
ROUNDS=${ROUNDS:-5}
THREADS=${THREADS:-2}
PYTHON=${PYTHON:-/usr/bin/python3}
OUT=${OUT:-bench/runtime.md}
BIN=$(mktemp -d)/runtime.test
trap 'rm -rf "$(dirname "$BIN")"' EXIT

go test -c -o "$BIN" ./runtime
kernel=$(go test -count=1 -run TestGEMM -v ./runtime 2>/dev/null | sed -n "s/.*micro-kernel: //p" | tail -1)

go_times=()
torch_times=()
ratios=()
for r in $(seq "$ROUNDS"); do
	# -test.benchtime 2x runs the step once to warm up, then twice timed.
	g=$(GOMAXPROCS=$THREADS RUNTIME_BENCH_BATCH=$BATCH RUNTIME_BENCH_SIZE=$SIZE RUNTIME_BENCH_THREADS=$THREADS \
		"$BIN" -test.run '^$' -test.bench '^BenchmarkResNet50Step$' -test.benchtime 2x |
		awk '/^BenchmarkResNet50Step/ {print $3 / 1e9}')
	t=$("$PYTHON" bench/torch_step.py --batch "$BATCH" --size "$SIZE" --threads "$THREADS" --repeat 2 |
		"$PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["median_s"])')
	g=$(printf '%.2f' "$g")
	t=$(printf '%.2f' "$t")
	echo "round $r: runtime ${g}s, pytorch ${t}s"
	go_times+=("$g")
	torch_times+=("$t")
	ratios+=("$(awk -v g="$g" -v t="$t" 'BEGIN {printf "%.2f", g/t}')")
done

median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
least() { printf '%s\n' "$@" | sort -g | head -1; }
gm=$(median "${go_times[@]}")
tm=$(median "${torch_times[@]}")
gb=$(least "${go_times[@]}")
tb=$(least "${torch_times[@]}")
ratio=$(awk -v g="$gb" -v t="$tb" 'BEGIN {printf "%.2f", g/t}')
mratio=$(awk -v g="$gm" -v t="$tm" 'BEGIN {printf "%.2f", g/t}')
torchv=$("$PYTHON" -c 'import torch; print(torch.__version__)')
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')
load=$(cut -d' ' -f1-3 /proc/loadavg)

cat >"$OUT" <<EOF
# Runtime speed: one resnet50 training step, Go runtime against PyTorch

Command: \`BATCH=$BATCH SIZE=$SIZE ROUNDS=$ROUNDS THREADS=$THREADS bash bench/runtime.sh\`
(written $(date -u +%Y-%m-%dT%H:%MZ)).

One forward and backward pass of torchvision's resnet50 in training mode,
batch $BATCH, 3x${SIZE}x${SIZE}, float32, $THREADS threads on each side, rounds interleaved
(runtime, then PyTorch) so that both see the same machine load.

| | fastest (s) | median (s) | rounds (s) |
|---|---|---|---|
| Go runtime (CPU backend, GEMM kernel: $kernel) | $gb | $gm | ${go_times[*]} |
| PyTorch $torchv (\`torch.set_num_threads($THREADS)\`) | $tb | $tm | ${torch_times[*]} |
| ratio runtime / PyTorch | **${ratio}x** | ${mratio}x | ${ratios[*]} (per round) |

**Ratio runtime / PyTorch: ${ratio}x** between the fastest rounds, ${mratio}x
between the medians (the issue's aim: at most 3x). The runtime's time includes
what its API costs and PyTorch's does not: copying the input in, and every
parameter gradient out into a fresh map.

Machine: $(nproc) cores, $cpu; load average at the end $load. Go $(go env GOVERSION).
With the purego build tag (or on a CPU without AVX2 and FMA) the runtime uses
its plain-Go 4x4 kernel instead, about ten times slower on the convolutions.
EOF
echo "wrote $OUT: ratio ${ratio}x"
