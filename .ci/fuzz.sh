#!/usr/bin/env bash
# CI: run every fuzz target for a short bounded time (FUZZTIME each,
# default 20s), one after the other. A crash fails the script; the engine
# writes the input to <package>/testdata/fuzz/<Target>/, which plain
# `go test` then replays forever: commit it with the fix.
#
#   .ci/fuzz.sh                 # 20 s per target
#   FUZZTIME=5m .ci/fuzz.sh     # a longer session
#
# Readers whose targets live elsewhere (ONNX, safetensors) add their lines
# to TARGETS.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=/usr/local/go/bin:$PATH
FUZZTIME=${FUZZTIME:-20s}
TARGETS=(
	"./pth FuzzScanPickle"
	"./pth FuzzPickleInZip"
	"./pth FuzzOpenWrite"
	"./pth FuzzOpenModule"
	"./pth FuzzOpen"
	"./onnx FuzzRead"
	"./safetensors FuzzOpen"
	"./command FuzzConvert"
)
for t in "${TARGETS[@]}"; do
	read -r pkg name <<<"$t"
	echo "== fuzz $pkg $name for $FUZZTIME"
	# -fuzzminimizetime bounds the time spent shrinking each new input (60 s
	# by default), which would otherwise eat most of a short run.
	go test "$pkg" -run '^$' -fuzz "^${name}\$" -fuzztime "$FUZZTIME" -fuzzminimizetime 5s
done
