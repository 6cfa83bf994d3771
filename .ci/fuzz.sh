#!/usr/bin/env bash
# CI: run every fuzz target for a short bounded time (FUZZTIME each,
# default 20s), one after the other. A crash fails the script; the engine
# writes the input to <package>/testdata/fuzz/<Target>/, which plain
# `go test` then replays forever: commit it with the fix.
#
#   .ci/fuzz.sh                 # 20 s per target
#   FUZZTIME=5m .ci/fuzz.sh     # a longer session
#
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=/usr/local/go/bin:$PATH
FUZZTIME=${FUZZTIME:-20s}
# Every fuzz target of the module, discovered from the sources (a target
# added anywhere runs without editing this file): each `func FuzzX(f
# *testing.F)` in a _test.go file, with its package's directory. (Not
# `go test -list`: a package whose TestMain checks what its tests ran,
# as cuda's does, fails a run that lists only.)
TARGETS=()
while IFS=: read -r file name; do
	TARGETS+=("./$(dirname "${file#./}") $name")
done < <(grep -rHo --include='*_test.go' --exclude-dir=testdata '^func Fuzz[A-Za-z0-9_]*([A-Za-z_]* \*testing\.F)' . |
	sed 's/^\(.*\):func \(Fuzz[A-Za-z0-9_]*\)(.*/\1:\2/' | sort -u)
if [ ${#TARGETS[@]} -eq 0 ]; then
	echo "fuzz: no fuzz target found (no func FuzzX(f *testing.F) in a _test.go file)" >&2
	exit 1
fi
echo "fuzz: ${#TARGETS[@]} targets: ${TARGETS[*]}"
count() { if [ -d "$1" ]; then find "$1" -type f | wc -l; else echo 0; fi; }
for t in "${TARGETS[@]}"; do
	read -r pkg name <<<"$t"
	echo "== fuzz $pkg $name for $FUZZTIME"
	# -fuzzminimizetime bounds the time spent shrinking each new input (60 s
	# by default), which would otherwise eat most of a short run.
	corpus="$pkg/testdata/fuzz/$name"
	before=$(count "$corpus")
	log=$(mktemp)
	if ! go test "$pkg" -run '^$' -fuzz "^${name}\$" -fuzztime "$FUZZTIME" -fuzzminimizetime 5s 2>&1 | tee "$log"; then
		after=$(count "$corpus")
		# Go's fuzzer reports "context deadline exceeded" when a worker is
		# still inside a slow input as the time runs out: no input failed,
		# none is written. Anything else, or a new crasher file, fails CI.
		if [ "$after" = "$before" ] && grep -q "context deadline exceeded" "$log" && ! grep -q "Failing input written" "$log"; then
			echo "note: $name stopped at its deadline inside an input; no failure found"
		else
			rm -f "$log"
			exit 1
		fi
	fi
	rm -f "$log"
done
