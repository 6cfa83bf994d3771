#!/usr/bin/env bash
# Which memory technique saves what: `abnconvert memory --compare` on
# torchvision's resnet50 and densenet121, written up in bench/compare.md with
# the plot bench/compare-densenet121.svg.
#
#   bash bench/compare.sh                  # batch 8, 3x224x224, budget 16GiB
#   BATCH=16 SIZE=160 bash bench/compare.sh
#
# The networks are torchvision's, freshly initialised (torch.manual_seed(0)):
# the memory figures depend on their shapes only; the drift column runs their
# weights. At batch 8, 224x224 the table also shows what PyTorch 1.13 keeps
# for the rows it can reproduce (memory/testdata/pytorch_saved.json, made by
# bench/saved_activations_ext.py on the runtime's own checkpoint segments;
# `go test ./memory -run TestAgainstPyTorch -update` refreshes it), and
# PyTorch's own drift under autocast on the same weights.
set -euo pipefail
cd "$(dirname "$0")/.."

BATCH=${BATCH:-8}
SIZE=${SIZE:-224}
BUDGET=${BUDGET:-16GiB}
PYTHON=${PYTHON:-/usr/bin/python3}
OUT=${OUT:-bench/compare.md}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

go build -tags urfave_cli_no_docs -o "$WORK/abnconvert" ./cmd/abnconvert
"$PYTHON" - "$WORK" <<'EOF'
import sys
import torch
import torchvision
torch.manual_seed(0)
for n in ("resnet50", "densenet121"):
    torch.save(getattr(torchvision.models, n)().state_dict(), f"{sys.argv[1]}/{n}.pth")
EOF

for n in resnet50 densenet121; do
	echo "measuring $n" >&2
	(cd "$WORK" && ./abnconvert memory --compare --max-batch --budget "$BUDGET" --batch "$BATCH" --size "$SIZE" \
		--plot "$n.svg" --json --quiet "$n.pth" >"$n.json")
	"$PYTHON" bench/saved_activations_ext.py "$n" --drift "$WORK/$n.pth" --no-saved >"$WORK/$n.torch.json"
done
# What the command prints, for one of them.
(cd "$WORK" && ./abnconvert memory --compare --max-batch --budget "$BUDGET" --batch "$BATCH" --size "$SIZE" \
	--quiet resnet50.pth >resnet50.txt)
cp "$WORK/densenet121.svg" bench/compare-densenet121.svg

"$PYTHON" - "$WORK" "$BATCH" "$SIZE" "$BUDGET" >"$WORK/tables.md" <<'EOF'
import json
import sys

work, batch, size, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
golden = json.load(open("memory/testdata/pytorch_saved.json"))
mib = lambda b: f"{b / 2**20:.1f}"
torch_key = {"baseline": lambda g: g["baseline"], "checkpoint-blocks": lambda g: g["checkpoint"]["blocks"]["saved_bytes"],
             "checkpoint-sqrt": lambda g: g["checkpoint"]["sqrt"]["saved_bytes"], "half": lambda g: g["autocast_bfloat16"]}
for n in ("resnet50", "densenet121"):
    c = json.load(open(f"{work}/{n}.json"))
    g = golden.get(n)
    same = g is not None and g["batch"] == batch and g["size"] == size
    print(f"### {n}, batch {batch}, 3x{size}x{size} (parameters {mib(c['param_bytes'])} MiB)\n")
    head = ("| technique | saved for backward (MiB) | PyTorch keeps (MiB) | peak (MiB) | saving | extra compute | "
            f"max batch in {budget} | outputs | drift: output / input gradient |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for i, r in enumerate(c["rows"]):
        pt = mib(torch_key[r["key"]](g)) if same and r["key"] in torch_key else ""
        name = r["name"] + (f" ({r['segments']} segments)" if r.get("segments") else "")
        outputs = "reference" if i == 0 else "exact" if r["exact"] else r["note"]
        d = r["drift"]
        if i == 0:
            drift = ""
        elif d["output_max_abs"] == 0 and d["input_grad_max_abs"] == 0:
            drift = "bitwise identical"
        else:
            drift = f"{d['output_max_rel']:.1e} / {d['input_grad_max_rel']:.1e}"
        print(f"| {name} | {mib(r['saved_bytes'])} | {pt} | {mib(r['peak_bytes'])} | {100 * r['saving']:.1f}% | "
              f"{100 * r['extra_compute']:.2f}% | {r['max_batch']} | {outputs} | {drift} |")
    print()
    ds = c["drift_setup"]
    print(f"Drift: one training step with real arithmetic on the CPU at batch {ds['batch']}, {ds['size']}x{ds['size']}, "
          "against the baseline's, as the largest difference over the baseline's largest magnitude.\n")
    d = json.load(open(f"{work}/{n}.torch.json"))["drift"]
    a, l = d["autocast_bfloat16"], d["leaky_relu"]
    print(f"PyTorch on the same weights (bench/saved_activations_ext.py --drift, batch {d['batch']}, {d['size']}x{d['size']}, "
          f"another random input): autocast bfloat16 moves the output by {a['output_max_rel']:.1e} and the input gradient by "
          f"{a['input_grad_max_rel']:.1e} of their largest magnitudes; every ReLU a leaky ReLU (0.01), by "
          f"{l['output_max_rel']:.1e} and {l['input_grad_max_rel']:.1e}.\n")
print(f"What the command prints (resnet50):\n")
print("```")
print(open(f"{work}/resnet50.txt").read().rstrip())
print("```")
EOF

torchv=$("$PYTHON" -c 'import torch; print(torch.__version__)')
cat >"$OUT" <<EOF
# Which technique saves what: \`abnconvert memory --compare\`

Made by \`BATCH=$BATCH SIZE=$SIZE BUDGET=$BUDGET bash bench/compare.sh\` (written $(date -u +%Y-%m-%dT%H:%MZ)), which runs,
for torchvision's resnet50 and densenet121 (freshly initialised, seed 0, saved as state dicts):

    abnconvert memory --compare --max-batch --budget $BUDGET --batch $BATCH --size $SIZE --plot compare.svg IN.pth
    abnconvert memory --compare --max-batch --budget $BUDGET --batch $BATCH --size $SIZE --no-drift --json IN.pth

Every figure is measured by running one training step (forward and backward) in abnconvert's runtime under
the technique: memory on the runtime's allocator (shape-only backend), drift with real arithmetic on the CPU.

- **saved for backward**: bytes allocated at the end of the forward pass (what PyTorch's saved-tensor hooks
  count; parameters excluded); **peak**: the most allocated at once over forward and backward, gradients included.
- **PyTorch keeps**: the same count made by real PyTorch $torchv on the same network
  (\`bench/saved_activations_ext.py\`): plain training, \`torch.utils.checkpoint\` on exactly the runtime's
  segments, \`torch.autocast("cpu", dtype=torch.bfloat16)\`. \`go test ./memory -run TestAgainstPyTorch\` holds the
  rows within 5% of it (they agree within 0.6%).
- **checkpointing, every block**: one segment per residual block, dense layer or transition (module path
  \`layerN.M\`, \`denseblockN.denselayerM\`, \`transitionN\`; VGG: the stages between max pools); **sqrt(n)**: Chen et
  al. 2016, ceil(sqrt(n)) segments of about equal length over the n nodes, cut where a single value crosses.
  A segment keeps its inputs, and its BN layers' batch statistics (8 bytes a channel) so that the rerun
  updates running statistics once; outputs and gradients are bit for bit those of the plain step.
- **bfloat16 activations**: activations, their gradients and the weight copies convolutions compute with kept in
  16 bits, BN statistics in float32, as autocast keeps them (the copies of the weights are why VGG-like networks
  gain less).
- **shared DenseNet buffers**: the memory-efficient DenseNet (Pleiss et al. 2017): each dense layer's
  concatenation and BN output live in two shared buffers, refilled in the backward pass.
- **extra compute**: FLOPs done again (checkpoint reruns, buffer refills, InPlace-ABN's inversion) over the
  step's forward and backward FLOPs, counted from the graph: convolutions and linear layers 2 per multiply-add,
  every other op its element count. Elementwise work is memory-bound, so its share of time is larger than its
  share of FLOPs (the DenseNet report measures 15-20% more time for shared buffers).
- **max batch**: the largest batch whose parameters plus peak fit $BUDGET, found by measuring.
- **outputs**: whether the step computes the baseline's numbers; the InPlace-ABN rows change every BN + ReLU
  into leaky ReLU (slope 0.01), as the default conversion does.

The drift figures are large for every inexact row, PyTorch's own autocast included: a training step of a
freshly initialised network at batch 2 and 64x64 is ill-conditioned (its last BN layers normalise over 8
values a channel). They say that the numbers move, not by how much a trained network's accuracy would.

$(cat "$WORK/tables.md")

## The plot

![memory per technique](compare-densenet121.svg)

\`bench/compare-densenet121.svg\`, from the densenet121 run above: left, parameters plus peak against batch
size, one line per row; right, bytes kept for backward by densenet121, 169, 201 and (6, 12, 64, 48) (the
DenseNet-264 configuration, 265 layers counted as torchvision counts them), built from their configurations, at
batch $BATCH, ${SIZE}x${SIZE}: the figure of the memory-efficient DenseNet report. Without shared buffers memory grows
faster than linearly with depth (every layer keeps the concatenation of all before it); with them, linearly
(\`go test ./memory -run TestDepthCurve\` fits both).
EOF
echo "wrote $OUT and bench/compare-densenet121.svg" >&2
