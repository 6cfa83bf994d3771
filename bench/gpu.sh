#!/usr/bin/env bash
# The CUDA backend on a GPU: correctness against the CPU runtime, InPlace-ABN
# kernel throughput, and training-step memory before and after conversion.
#
# Runs from the repo root on the GPU machine, which has PyTorch but no Go:
# build the two binaries here first, and carry bin/ there.
#
#   make cuda cuda-test          # bin/abnconvert-cuda, bin/cuda.test (needs cuda.h)
#   bash bench/gpu.sh            # on the GPU machine: writes $OUT/gpu.md (bench/gpu.md without $OUT)
#   bash bench/gpu.sh --emulated # rehearsal without a GPU: the same steps, small sizes, on
#                                # the emulated driver (make emudriver: bin/emudriver/libcuda.so.1,
#                                # the kernels compiled for the CPU); writes gpu-emulated.md
#   bash bench/gpu.sh --dry-run  # anywhere: the CPU parts, small sizes, no CUDA at all
#
# Exit status: 0 when every step passed, 1 when a check failed (a test, a
# verify that did not say PRESERVED, a measurement that failed), 2 when the
# binaries are missing. The report is written in every case.
#
# Steps, each logged to $OUT/gpu.log and summarised in gpu.md:
#  1. the device, the driver and PyTorch;
#  2. bin/cuda.test: every op and every fixture network (original and
#     converted, eval and one training step) on the GPU against the CPU
#     backend (eval within 1e-4 relative), and the allocator against the
#     driver's free-memory figure;
#  3. abnconvert verify --device cuda (and --device cpu) on each fixture,
#     on act_net (ReLU6, SiLU, SE gate, Hardswish, GELU, Hardsigmoid) and
#     the layout networks (shuffle, inception, head, seg, unet, upseq) and sd
#     (StochasticDepth, row and batch, from a train-mode export), converted with
#     --relu abn, structure from their ONNX exports; and fixtures/zoo.py's
#     networks as whole pickled modules (bench/gpu_torch.py zoo): those in
#     $ZOO_DIR, made here by torch 1.13 and carried, and $ZOO_MODELS made
#     there by the GPU machine's own PyTorch;
#  4. InPlace-ABN forward and backward throughput against the device's copy
#     bandwidth and against PyTorch's batch norm + leaky ReLU, same tensors;
#  5. resnet50 and densenet121 (torchvision, trained-like BatchNorm: gammas of
#     both signs): verify --device cuda and cpu at batch 8, 224x224; the GPU's
#     eval output, training output and gradients against the CPU backend's
#     (TestGPUCheckpointsMatchCPU); one training step before and after
#     conversion, in the runtime on the GPU and in PyTorch (the emitted module).
# Environment: BATCH (32), SIZE (224), PYTHON (python3), MODELS
# (resnet50,densenet121), VBATCH (8: verify's batch for MODELS), SHAPES (the
# throughput tensors), ZOO_DIR (build/gpu-zoo), ZOO_MODELS (made on the spot),
# ABN_COMMIT (the commit, where the tree came without .git); --emulated takes
# EMU_BATCH (2), EMU_SIZE (64), EMU_SHAPES and EMU_MODELS (densenet121).
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0 EMU=0 NAME=gpu
case "${1:-}" in
--dry-run) DRY=1 ;;
--emulated) EMU=1 NAME=gpu-emulated ;;
"") ;;
*)
	echo "usage: bash bench/gpu.sh [--emulated | --dry-run]" >&2
	exit 2
	;;
esac
OUTDIR=${OUT:-bench}
mkdir -p "$OUTDIR"
LOG=$OUTDIR/$NAME.log
MD=$OUTDIR/$NAME.md
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
JSONL=$(cd "$OUTDIR" && pwd)/$NAME.jsonl
: >"$JSONL"
: >"$LOG"
BIN=bin/abnconvert-cuda
TEST=bin/cuda.test
MODELS=${MODELS:-resnet50,densenet121}
VBATCH=${VBATCH:-8}
ZOO_DIR=${ZOO_DIR:-build/gpu-zoo}
ZOO_MODELS=${ZOO_MODELS:-}
BATCH=${BATCH:-32}
SIZE=${SIZE:-224}
SHAPES=${SHAPES:-32x64x112x112,32x256x56x56,32x512x28x28,256x2048x7x7}
DEVICE=cuda
STEPS=2 # training steps per network in TestGPUTrainingMemory (the first warms up the pool)
if [ $DRY = 1 ]; then
	# Small sizes on the CPU: checks the plumbing, measures nothing.
	PYTHON=${PYTHON:-/usr/bin/python3}
	BATCH=2 SIZE=64 VBATCH=2 SHAPES=2x8x16x16,2x8x7x7 DEVICE=cpu
fi
if [ $EMU = 1 ]; then
	# The emulated driver runs every kernel on one CPU thread: small sizes.
	# PyTorch here has no GPU, so its side runs on the CPU.
	if [ ! -f bin/emudriver/libcuda.so.1 ]; then
		echo "bin/emudriver/libcuda.so.1 is missing: make emudriver (needs cuda.h and g++)" >&2
		exit 2
	fi
	export LD_LIBRARY_PATH=$PWD/bin/emudriver${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
	PYTHON=${PYTHON:-/usr/bin/python3}
	# Step 5 on densenet121 alone (EMU_MODELS): one emulated training step of
	# resnet50 and densenet121 took 11 of the rehearsal's 13 minutes on a
	# 2-core VM (2026-12-04), and densenet121 has the most of the path
	# (concatenation, recomputation, shared buffers); resnet50's ops run in
	# steps 2 and 3.
	BATCH=${EMU_BATCH:-2} SIZE=${EMU_SIZE:-64} VBATCH=2 SHAPES=${EMU_SHAPES:-2x16x16x16,2x8x7x7} DEVICE=cpu STEPS=1
	MODELS=${EMU_MODELS:-densenet121}
fi
FAILED=0
fail() { # fail MESSAGE: note a failed check for the report and the exit status
	echo "$*" >>"$WORK/notes.txt"
	FAILED=1
}
PYTHON=${PYTHON:-python3}

log() { echo "== $*" | tee -a "$LOG" >&2; }
run() { # run CMD...: log it and its output; never stop the script
	echo "\$ $*" >>"$LOG"
	"$@" >>"$LOG" 2>&1
	local rc=$?
	[ $rc = 0 ] || echo "(exit $rc)" >>"$LOG"
	return $rc
}

for f in "$BIN" "$TEST"; do
	if [ ! -x "$f" ]; then
		echo "$f is missing: build it where Go and the CUDA headers are (make cuda cuda-test) and carry bin/" >&2
		exit 2
	fi
done

log "1. environment"
{
	echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
	echo "commit: ${ABN_COMMIT:-$(git describe --always --dirty 2>/dev/null || echo unknown)}"
	nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader 2>/dev/null ||
		echo "nvidia-smi: none"
} | tee -a "$LOG" >"$WORK/env.txt"
"$PYTHON" bench/gpu_torch.py env >>"$JSONL" 2>>"$LOG" || echo "PyTorch: not importable by $PYTHON" >>"$WORK/env.txt"

log "2. CUDA backend against the CPU runtime (bin/cuda.test)"
(cd cuda && ABN_GPU_REPORT="$JSONL" "../$TEST" -test.run 'TestOpenError|TestGPUOpsMatchCPU|TestGPUNetworksMatchCPU|TestGPUMemCheck' \
	-test.v -test.timeout 300s) >"$WORK/tests.txt" 2>&1
TESTS_RC=$?
[ $TESTS_RC = 0 ] || fail "bin/cuda.test exited $TESTS_RC: see $NAME.log"
if [ $DRY = 0 ] && grep -q -- '--- SKIP' "$WORK/tests.txt"; then
	fail "bin/cuda.test skipped its GPU tests: $(grep -m1 'no GPU' "$WORK/tests.txt" | sed 's/^ *//')"
fi
cat "$WORK/tests.txt" >>"$LOG"
grep -E '^(--- |ok|PASS|FAIL)' "$WORK/tests.txt" | grep -v '^    ' >"$WORK/tests.sum" || true
# The per-op table TestGPUOpsMatchCPU logs (worst relative difference).
grep -E '^\s+compare_test.go:[0-9]+: .{45} [0-9.e+-]+$' "$WORK/tests.txt" | sed -E 's/^\s+compare_test.go:[0-9]+: //' >"$WORK/ops.txt" || true

log "3. abnconvert verify --device cuda / cpu on the fixtures"
: >"$WORK/verify.txt"
# verify_row NAME INPUT [CONVERT ARGS...]: convert INPUT (with the extra
# arguments, which verify takes too), verify on both devices, one table row;
# the array VARGS, verify's alone (--batch, --size).
VARGS=()
verify_row() {
	local n=$1 f=$2 out_pth
	shift 2
	out_pth=$WORK/$(echo "$n" | tr -c 'A-Za-z0-9_.-' '_').abn.pth
	run "$BIN" convert -i "$f" -o "$out_pth" "$@" --force --quiet || {
		echo "| $n | convert failed | |" >>"$WORK/verify.txt"
		fail "convert $n failed"
		return
	}
	local line="| $n |" dev out rc eval_rel verdict
	for dev in cuda cpu; do
		out=$("$BIN" verify --original "$f" --converted "$out_pth" "$@" ${VARGS[@]+"${VARGS[@]}"} --device $dev --quiet 2>&1)
		rc=$?
		echo "\$ verify $n $* ${VARGS[*]} --device $dev (exit $rc)" >>"$LOG"
		echo "$out" >>"$LOG"
		eval_rel=$(echo "$out" | sed -n 's/.*eval output *rel \([0-9.e+-]*\).*/\1/p' | head -1)
		case $rc in
		0) verdict=preserved ;;
		1) verdict="NOT preserved: $(echo "$out" | tail -1 | sed 's/^NOT PRESERVED: //' | cut -c1-80)" ;;
		*) verdict="error: $(echo "$out" | tail -1 | sed 's/^abnconvert: //' | cut -c1-100)" ;;
		esac
		# Without CUDA (--dry-run) --device cuda is expected to refuse.
		if [ $rc != 0 ] && ! { [ $DRY = 1 ] && [ $dev = cuda ] && [ $rc = 2 ]; }; then
			fail "verify $n --device $dev: $verdict"
		fi
		line="$line $verdict (eval output rel ${eval_rel:-n/a}) |"
	done
	echo "$line" >>"$WORK/verify.txt"
}
for f in fixtures/testdata/tiny_*.pth; do
	verify_row "$(basename "$f" .pth)" "$f"
done
# The activations InPlace-ABN cannot invert and the squeeze-and-excitation
# gate (fixtures/acts.py), structure from the PRESERVE export; from opset 14
# Hardswish is one node.
for op in 13 17; do
	verify_row "act_net (opset $op, --relu abn)" fixtures/testdata/acts/act_net.pth \
		--graph "fixtures/testdata/acts/act_net_op$op.onnx" --relu abn
done
# The layout ops (fixtures/shape_nets.py: channel shuffle, inception block
# with Pad and ceil_mode, Linear+BatchNorm1d head, segmentation Resize,
# UNet and nn.Sequential Resize by a scale factor and to a fixed size).
for n in shuffle inception head seg unet upseq; do
	verify_row "$n (opset 13, --relu abn)" "fixtures/testdata/shape/$n.pth" \
		--graph "fixtures/testdata/shape/${n}_op13.onnx" --relu abn
done
verify_row "upseq (whole module, --relu abn)" fixtures/testdata/shape/upseq_module.pth --relu abn
# StochasticDepth, row mode on an MBConv residual branch and batch mode
# (fixtures/stochdepth.py), structure from the train-mode export: verify's
# training step draws the noise on the device and on the CPU alike.
for op in 13 17; do
	verify_row "sd (opset $op, train-mode export, --relu abn)" fixtures/testdata/stochdepth/sd.pth \
		--graph "fixtures/testdata/stochdepth/sd_op$op.onnx" --relu abn
done

# fixtures/zoo.py's networks, whole pickled modules (bench/gpu_torch.py zoo):
# those carried in $ZOO_DIR (torch 1.13, what CI's make zoo reads), and
# $ZOO_MODELS made here by this machine's PyTorch.
if [ -n "$ZOO_MODELS" ]; then
	run "$PYTHON" bench/gpu_torch.py zoo --out "$WORK/zoo" --models "$ZOO_MODELS" || fail "gpu_torch.py zoo failed: see $NAME.log"
	grep '"kind": "zoo_module"' "$LOG" >>"$JSONL" || true
fi
for f in "$ZOO_DIR"/*.module.pth "$WORK"/zoo/*.module.pth; do
	[ -f "$f" ] || continue
	case $f in "$WORK"/*) by="this machine's torch" ;; *) by="torch 1.13" ;; esac
	verify_row "$(basename "$f" .module.pth) (whole module by $by, --relu abn)" "$f" --relu abn
done

log "4. InPlace-ABN throughput"
if [ $DRY = 0 ]; then
	(cd cuda && ABN_GPU_BENCH=1 ABN_GPU_SHAPES="$SHAPES" ABN_GPU_REPORT="$JSONL" "../$TEST" -test.run 'TestGPUThroughput' -test.v -test.timeout 300s) >>"$LOG" 2>&1 ||
		fail "TestGPUThroughput failed: see $NAME.log"
fi
run "$PYTHON" bench/gpu_torch.py throughput --shapes "$SHAPES" --device $DEVICE || fail "gpu_torch.py throughput failed: see $NAME.log"
grep '"kind": "torch_throughput"' "$LOG" >>"$JSONL" || true

log "5. training-step memory: $MODELS, batch $BATCH, ${SIZE}x$SIZE"
run "$PYTHON" bench/gpu_torch.py checkpoints --out "$WORK" --models "$MODELS" --trained || fail "gpu_torch.py checkpoints failed: see $NAME.log"
CKPTS=""
for m in ${MODELS//,/ }; do
	[ -f "$WORK/$m.pth" ] || continue
	CKPTS="${CKPTS:+$CKPTS,}$WORK/$m.pth"
	run "$BIN" convert -i "$WORK/$m.pth" -o "$WORK/${m}_abn.pth" --emit-module "$WORK/${m}_abn.py" --force --quiet ||
		fail "convert $m failed: see $NAME.log"
	if [ $DRY = 0 ] && [ $EMU = 0 ]; then
		VARGS=(--batch "$VBATCH" --size "$SIZE")
		verify_row "$m (trained-like, batch $VBATCH, ${SIZE}x$SIZE)" "$WORK/$m.pth"
		VARGS=()
	fi
	if [ $DRY = 0 ]; then
		echo "\$ $BIN memory --device cuda --batch $BATCH --size $SIZE $m.pth" >>"$LOG"
		"$BIN" memory --device cuda --batch "$BATCH" --size "$SIZE" --quiet "$WORK/$m.pth" >"$WORK/memory-$m.txt" 2>&1 ||
			fail "memory --device cuda $m failed: $(tail -1 "$WORK/memory-$m.txt")"
		cat "$WORK/memory-$m.txt" >>"$LOG"
		if grep -q INCONSISTENT "$WORK/memory-$m.txt"; then
			fail "memory --device cuda $m: the driver shows less in use than the allocator holds"
		fi
	fi
	run "$PYTHON" bench/gpu_torch.py memory --model "$m" --checkpoint "$WORK/$m.pth" --converted "$WORK/${m}_abn.pth" \
		--module "$WORK/${m}_abn.py" --batch "$BATCH" --size "$SIZE" --device $DEVICE || fail "gpu_torch.py memory $m failed: see $NAME.log"
done
grep '"kind": "torch_memory"' "$LOG" >>"$JSONL" || true
# The full-size checkpoints' verify rows and their GPU results against the
# CPU backend's; the rehearsals take two tiny fixtures at 64x64 instead: at
# their small sizes resnet50's last stage is 1x1, where a training step on a
# batch of 2 is all rounding, and the emulator would take minutes.
VCKPTS=$CKPTS VSIZE=$SIZE
if [ $DRY = 1 ] || [ $EMU = 1 ]; then
	VCKPTS=fixtures/testdata/tiny_resnext.pth,fixtures/testdata/tiny_densenet.pth VSIZE=64
	VARGS=(--batch "$VBATCH" --size "$VSIZE")
	for f in ${VCKPTS//,/ }; do
		verify_row "$(basename "$f" .pth) (batch $VBATCH, ${VSIZE}x$VSIZE)" "$f"
	done
	VARGS=()
fi
if [ $DRY = 0 ] && [ -n "$VCKPTS" ]; then
	(cd cuda && ABN_GPU_COMPARE="$(echo "$VCKPTS" | sed -E 's#(^|,)fixtures/#\1../fixtures/#g')" ABN_GPU_COMPARE_BATCH=$VBATCH ABN_GPU_COMPARE_SIZE=$VSIZE ABN_GPU_REPORT="$JSONL" \
		"../$TEST" -test.run 'TestGPUCheckpointsMatchCPU' -test.v -test.timeout 300s) >"$WORK/compare.txt" 2>&1 ||
		fail "TestGPUCheckpointsMatchCPU failed: $(grep -m1 -E 'relative difference|Error|FAIL' "$WORK/compare.txt" | sed 's/^ *//')"
	cat "$WORK/compare.txt" >>"$LOG"
	(cd cuda && ABN_GPU_CHECKPOINTS="$CKPTS" ABN_GPU_BATCH=$BATCH ABN_GPU_SIZE=$SIZE ABN_GPU_STEPS=$STEPS ABN_GPU_REPORT="$JSONL" \
		"../$TEST" -test.run 'TestGPUTrainingMemory' -test.v -test.timeout 500s) >>"$LOG" 2>&1 ||
		fail "TestGPUTrainingMemory failed: see $NAME.log"
fi

log "report: $MD"
{
	echo "# The CUDA backend on a GPU"
	echo
	echo "Written by \`bash bench/gpu.sh${1:+ $1}\`; the full log is $NAME.log, the measurements $NAME.jsonl."
	[ $DRY = 1 ] && echo "DRY RUN: no GPU; the CPU parts at small sizes, to check the script. Nothing here is a GPU measurement."
	[ $EMU = 1 ] && echo "EMULATED: no GPU. The CUDA path ran on the emulated driver (cuda/emudriver: the kernels compiled for the CPU, one thread), at batch $BATCH, ${SIZE}x$SIZE: it checks the binaries, the driver calls, the kernels' results and this script. Times and bandwidths are the emulator's, not a GPU's."
	echo
	echo '```'
	cat "$WORK/env.txt"
	grep '"kind": "torch_env"' "$JSONL" || true
	grep '"kind": "device"' "$JSONL" || true
	echo '```'
	echo
	echo "## Tests (bin/cuda.test, exit $TESTS_RC)"
	echo
	echo '```'
	cat "$WORK/tests.sum"
	echo '```'
	if [ -s "$WORK/ops.txt" ]; then
		echo
		echo "Worst relative difference from the CPU backend, per op case (limit 2e-5):"
		echo
		echo '```'
		cat "$WORK/ops.txt"
		echo '```'
	fi
	echo
	echo "## abnconvert verify: fixtures, zoo networks, full-size checkpoints"
	echo
	echo "| fixture | --device cuda | --device cpu |"
	echo "|---|---|---|"
	cat "$WORK/verify.txt"
	echo
	"$PYTHON" bench/gpu_torch.py render --jsonl "$JSONL" 2>>"$LOG" || echo "(render failed: see gpu.log)"
	for m in ${MODELS//,/ }; do
		if [ -s "$WORK/memory-$m.txt" ]; then
			echo
			echo "\`abnconvert memory --device cuda --batch $BATCH --size $SIZE $m.pth\`:"
			echo
			echo '```'
			cat "$WORK/memory-$m.txt"
			echo '```'
		fi
	done
	echo
	if [ -s "$WORK/notes.txt" ]; then
		echo "## Failed checks"
		echo
		sed 's/^/- /' "$WORK/notes.txt"
	else
		echo "Every check passed."
	fi
} >"$MD"
cat "$MD"
exit $FAILED
