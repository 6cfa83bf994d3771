#!/usr/bin/env bash
# Training memory of torchvision's BatchNorm networks beyond the five
# families (issue 12): abnconvert memory against PyTorch's own figure.
#
#   bash bench/zoo_memory.sh                       # batch 8, 3x224x224, every model below
#   MODELS="mobilenet_v2 efficientnet_b0" bash bench/zoo_memory.sh
#
# For each model (built as ../shared/tools/saved_activations.py builds it),
# bench/zoo_memory.py prepare writes its state dict and its PRESERVE ONNX
# export (eval mode, dynamic batch and spatial axes, exported at 32x32: the
# 224x224 measurement also shows no shape was frozen); then
#   - the original's saved_bytes from `abnconvert memory --graph` beside
#     PyTorch's saved-tensor hooks figure (shared/tools/saved_activations.py),
#     and their ratio (aim: within 3%);
#   - the exact conversion (--relu abn) beside the targets of
#     shared/notes/zoo-and-peers.md (measured there with the real inplace_abn);
#   - the same converted network as PyTorch keeps it: abnconvert's emitted
#     module run with the inplace_abn stand-in under saved-tensor hooks, and
#     whether its backward runs;
#   - the default (--relu leaky) figure, beside the note's for the ResNet-based
#     segmentation models;
# and for mobilenet_v3_large the note's own method (every BatchNorm2d made
# InPlaceABN(identity) in torchvision's module, activations out of place)
# with the stand-in: its saved bytes and whether a backward pass runs.
# A model abnconvert cannot run yet is listed with the first line of why.
# Writes bench/zoo-memory.md (OUT=...). Needs bin/abnconvert (make build).
set -uo pipefail
cd "$(dirname "$0")/.."

BATCH=${BATCH:-8}
SIZE=${SIZE:-224}
PYTHON=${PYTHON:-/usr/bin/python3}
BIN=${BIN:-bin/abnconvert}
OUT=${OUT:-bench/zoo-memory.md}
MODELS=${MODELS:-"mobilenet_v2 mobilenet_v3_large efficientnet_b0 regnet_y_400mf shufflenet_v2_x1_0 inception_v3 googlenet deeplabv3_resnet50 fcn_resnet50 lraspp_mobilenet_v3_large mnasnet1_0 deeplabv3_mobilenet_v3_large efficientnet_v2_s"}
TOOL=../shared/tools/saved_activations.py
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# The note's figures (MiB, batch 8, 224x224, real inplace_abn 1.1.0).
declare -A NOTE_EXACT=([efficientnet_b0]=475.7 [mobilenet_v2]=401.5 [mobilenet_v3_large]=274.4
	[lraspp_mobilenet_v3_large]=341.8 [shufflenet_v2_x1_0]=141.5 [regnet_y_400mf]=256.6
	[mnasnet1_0]=326.6 [deeplabv3_mobilenet_v3_large]=366.3 [efficientnet_v2_s]=841.9)
declare -A NOTE_LEAKY=([deeplabv3_resnet50]="1566.8 -> 1288.0" [fcn_resnet50]="1499.3 -> 1245.0")

mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
jget() { "$PYTHON" -c "import json,sys; d=json.load(sys.stdin); print($1)"; }
first() { grep -v '^memory: ' | grep -m1 . | sed "s|$WORK/||g; s/, so no module could be emitted and no conversion verified//" | cut -c1-400 | sed 's/|/\\|/g'; }

rows=()
fails=()
for m in $MODELS; do
	echo "== $m" >&2
	if ! err=$(nice "$PYTHON" bench/zoo_memory.py prepare "$m" "$WORK" 2>&1 >/dev/null); then
		fails+=("| $m | | export | $(echo "$err" | tail -1 | cut -c1-200) |")
		continue
	fi
	pt=$(nice "$PYTHON" "$TOOL" "$m" --batch "$BATCH" --size "$SIZE" --json | jget 'd["saved_bytes"]')
	g=(--graph "$WORK/$m.onnx" --batch "$BATCH" --size "$SIZE" --json)
	abn=$(nice "$BIN" memory "$WORK/$m.pth" "${g[@]}" --relu abn 2>"$WORK/err")
	rc=$?
	if [ $rc -ne 0 ]; then
		fails+=("| $m | $(mib "$pt") MiB | memory --relu abn, exit $rc | $(first <"$WORK/err") |")
		continue
	fi
	orig=$(echo "$abn" | jget 'd["original"]["saved_bytes"]')
	exact=$(echo "$abn" | jget 'd["converted"]["saved_bytes"]')
	leaky=$(nice "$BIN" memory "$WORK/$m.pth" "${g[@]}" 2>/dev/null | jget 'd["converted"]["saved_bytes"]' 2>/dev/null || echo "")
	ratio=$(awk -v a="$orig" -v b="$pt" 'BEGIN {printf "%.4f", a / b}')
	within=$(awk -v r="$ratio" 'BEGIN {print (r >= 0.97 && r <= 1.03) ? "yes" : "**no**"}')
	target=${NOTE_EXACT[$m]:-}
	meets=""
	if [ -n "$target" ]; then
		meets=$(awk -v e="$(mib "$exact")" -v t="$target" 'BEGIN {print (e <= t) ? "yes" : "**no**"}')
		target="<= $target ($meets)"
	fi
	# The converted network as PyTorch runs it: the emitted module, stand-in.
	emitted="cannot emit"
	if nice "$BIN" convert -i "$WORK/$m.pth" --graph "$WORK/$m.onnx" --relu abn -o "$WORK/$m.abn.pth" \
		--emit-module "$WORK/$m.abn.py" --force --quiet 2>"$WORK/err"; then
		e=$(nice "$PYTHON" bench/zoo_memory.py emitted "$WORK/$m.abn.py" "$WORK/$m.abn.pth" --batch "$BATCH" --size "$SIZE")
		emitted="$(mib "$(echo "$e" | jget 'd["saved_bytes"]')") MiB, backward $(echo "$e" | jget '"runs" if d["backward_runs"] else "fails"')"
	else
		emitted="cannot emit: $(first <"$WORK/err")"
	fi
	lk=""
	[ -n "$leaky" ] && lk="$(mib "$leaky") MiB"
	[ -n "${NOTE_LEAKY[$m]:-}" ] && lk="$lk (note: ${NOTE_LEAKY[$m]})"
	rows+=("| $m | $(mib "$orig") MiB | $(mib "$pt") MiB | $ratio ($within) | $(mib "$exact") MiB | ${target:-} | $emitted | $lk |")
done

# The note's method for mobilenet_v3_large, with the stand-in.
nm=$(nice "$PYTHON" bench/zoo_memory.py note-method mobilenet_v3_large --batch "$BATCH" --size "$SIZE")
nm_bytes=$(mib "$(echo "$nm" | jget 'd["saved_bytes"]')")
nm_back=$(echo "$nm" | jget '"runs" if d["backward_runs"] else "fails: " + d["backward_error"]')

{
	cat <<EOF
# Training memory of torchvision's BatchNorm networks (issue 12)

Command: \`BATCH=$BATCH SIZE=$SIZE bash bench/zoo_memory.sh\` (written $(date -u +%Y-%m-%dT%H:%MZ),
$("$BIN" --version 2>&1 | head -1), torch $("$PYTHON" -c 'import torch; print(torch.__version__)')).

Bytes kept for the backward pass at the end of one training forward (saved-tensor
hooks' rule: distinct non-parameter storages), batch $BATCH, 3x${SIZE}x${SIZE}, float32.
Structure from each model's PRESERVE ONNX export (\`--graph\`; eval mode, dynamic
axes, exported at 32x32). "original" is \`abnconvert memory\`'s \`original.saved_bytes\`,
"PyTorch" \`../shared/tools/saved_activations.py NAME --batch $BATCH --size $SIZE\`;
"exact" is \`memory --relu abn\`'s converted figure, "target" the figure
\`shared/notes/zoo-and-peers.md\` measured with the real inplace_abn; "emitted module"
is abnconvert's \`--emit-module\` output run by PyTorch with the inplace_abn stand-in
(fixtures/standin, which saves what the real library saves) under the same hooks,
and whether its backward pass then runs; "leaky" is the default policy's figure.

| network | original | PyTorch | ratio (within 3%) | exact (\`--relu abn\`) | target | emitted module, PyTorch | leaky (default) |
|---|---|---|---|---|---|---|---|
EOF
	printf '%s\n' "${rows[@]}"
	if [ ${#fails[@]} -gt 0 ]; then
		cat <<EOF

Not measured yet (the first line of why):

| network | PyTorch | step | reason |
|---|---|---|---|
EOF
		printf '%s\n' "${fails[@]}"
	fi
	cat <<EOF

## mobilenet_v3_large: the note's 274.4 MiB

The note's method (every BatchNorm2d of torchvision's own module made
\`InPlaceABN(activation="identity")\`, every activation made out of place,
torchvision's forward otherwise unchanged), with the stand-in:
**$nm_bytes MiB saved**; one backward pass: **$nm_back**.
torchvision's InvertedResidual does \`result += input\` in place on the block's
last InPlace-ABN output, which that layer saved to invert in its backward: the
forward keeps one tensor fewer per residual block, and no backward can run.
abnconvert fuses that add into the layer instead (rewrite's add-residual; the
emitted module's \`_inplace_abn_add\`, which keeps the sum and recovers the
layer's output from it in backward): the exact conversion's figure above, with a
backward that runs.
EOF
} >"$OUT"
echo "wrote $OUT" >&2
cat "$OUT"
