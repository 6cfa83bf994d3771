package verify

import (
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/abnconvert/abnconvert/failure"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/model"
	"github.com/abnconvert/abnconvert/onnx"
	"github.com/abnconvert/abnconvert/rewrite"
	"github.com/abnconvert/abnconvert/runtime"
)

// ONNX: verify runs an ONNX graph and its converted form, each as written,
// in the runtime, and compares them; only ops the runtime models can run.
//
// The original is read as the converter reads it. The converted file is
// read the same way, and then its ai.abnconvert nodes (which the reader
// keeps opaque) become InPlaceABN, InPlaceABNSync or ABN nodes with the
// attributes and parameters the file gives them (DOMAIN.md), and a Mul by
// a +1/-1 constant before a BatchNormalization (how --onnx-ops standard
// writes a sign flip) becomes that node's sign vector. Any other op the
// runtime does not model, in either file, is refused by name.
//
// The reference is the original with the conversion's declared
// approximations (found by re-running the rewrite on the original with the
// flags given), exactly as for checkpoints. Compared: eval outputs, then,
// unless the converted model was folded for inference (--onnx-ops fold,
// which leaves fewer normalisation layers than the original has), the
// output and input gradient of one training step and eval outputs after
// it. Parameter gradients are not compared: the two files name their
// parameters differently.
func runONNX(opt Options) (*Result, error) {
	if !isONNXPath(opt.Original) || !isONNXPath(opt.Converted) {
		return nil, fmt.Errorf("%s, %s: an ONNX model is verified against an ONNX model; give both as .onnx", opt.Original, opt.Converted)
	}
	newBackend := opt.NewBackend
	if newBackend == nil {
		newBackend = func() (runtime.Backend, error) { return runtime.NewCPU(0), nil }
	}
	origModel, err := readRunnable(opt.Original, false)
	if err != nil {
		return nil, err
	}
	orig := origModel.ONNX
	convModel, err := readRunnable(opt.Converted, true)
	if err != nil {
		return nil, err
	}
	conv := convModel.ONNX
	// The conversion's flags, from the converted model's provenance record
	// (provenance.go).
	from, warnings, err := opt.settle(convModel)
	if err != nil {
		return nil, err
	}
	if opt.Batch < 1 || opt.Size < 1 {
		return nil, fmt.Errorf("--batch %d, --size %d: both must be positive", opt.Batch, opt.Size)
	}

	// The conversion's report, from the same rewrite on a fresh read.
	againModel, err := model.Open(opt.Original)
	if err != nil {
		return nil, err
	}
	again := againModel.ONNX
	rep, err := rewrite.Run(again.Graph, again.Weights, opt.rewriteOptions())
	if err != nil {
		return nil, fmt.Errorf("%s: %w", opt.Original, err)
	}
	gRef := orig.Graph
	refW := newOverlay(orig.Weights)
	approx, tiny, err := applyApproximations(gRef, refW, rep, opt.Slope)
	if err != nil {
		return nil, err
	}

	x, err := onnxInput(opt, orig)
	if err != nil {
		return nil, err
	}
	res := &Result{Original: opt.Original, Converted: opt.Converted, Arch: orig.Graph.Arch, Device: opt.Device,
		Input: x.Shape, Seed: opt.Seed, Strict: opt.Strict, FlagsFrom: from, Warnings: warnings}
	rebuild := func() (*graph.Graph, graph.Weights, func(), error) {
		m, err := readRunnable(opt.Original, false)
		if err != nil {
			return nil, nil, nil, err
		}
		return m.ONNX.Graph, m.ONNX.Weights, m.Close, nil
	}
	if err := opt.againstProbe(res, StructureRead, "", rebuild, newBackend); err != nil {
		return nil, err
	}
	mk := func(g *graph.Graph, w graph.Weights, what string) (*network, error) {
		return newNetwork(newBackend, opt.Seed, g, w, what, opt.Progress)
	}
	ref, err := mk(gRef, refW, "reference")
	if err != nil {
		return nil, err
	}
	defer ref.ex.Close()
	cv, err := mk(conv.Graph, conv.Weights, "converted")
	if err != nil {
		return nil, err
	}
	defer cv.ex.Close()

	opt.progress("eval forward of the reference and the converted model (%v)", x.Shape)
	yRef, yConv, err := evalPair(ref, cv, x)
	if err != nil {
		return nil, err
	}

	folded := norms(conv.Graph) < norms(gRef)
	g := gradOut(opt.Seed, yRef.Shape)
	var strictFail *Check
	var tOrig *step
	if approx > 0 || tiny > 0 {
		plainModel, err := readRunnable(opt.Original, false)
		if err != nil {
			return nil, err
		}
		plain := plainModel.ONNX
		o, err := mk(plain.Graph, plain.Weights, "original")
		if err != nil {
			return nil, err
		}
		yOrig, err := o.forward(x, false)
		if err == nil && !folded {
			tOrig, err = originalStep(o, x, g)
		}
		o.ex.Close()
		if err != nil {
			return nil, fmt.Errorf("original: %w", err)
		}
		d := drift(yConv.Data, yOrig.Data, yOrig.Shape)
		d.Sites, d.TinyGamma, d.Slope = approx, tiny, opt.Slope
		d.WithinLimit = d.Rel <= evalLimit(opt, yOrig.Data)
		res.Drift = &d
		if opt.Strict && !d.WithinLimit {
			strictFail = &Check{Name: "drift (--strict)", MaxAbs: d.MaxAbs, Rel: d.Rel, Limit: evalLimit(opt, yOrig.Data),
				Note: fmt.Sprintf("%d sites approximated by the ReLU policy, %d tiny-gamma channels", approx, tiny)}
		}
	}

	// The reference's noise: its eval output, training step and eval
	// output again on copies with input and weights moved by one rounding
	// (noise.go). The converted model's weights are named differently, so
	// the half-precision rounding of its BN weights is not modelled here.
	refRun := &sample{eval: yRef.Data}
	var tConv *step
	var yConvAfter []float32
	if !folded {
		opt.progress("training step of the reference and the converted model, then eval again")
		if refRun.t, err = trainStep(ref, x, g); err != nil {
			return nil, fmt.Errorf("reference: %w", err)
		}
		if tConv, err = trainStep(cv, x, g); err != nil {
			return nil, fmt.Errorf("converted: %w", err)
		}
		yRefAfter, yc, err := evalPair(ref, cv, x)
		if err != nil {
			return nil, err
		}
		refRun.after, yConvAfter = yRefAfter.Data, yc.Data
		if tOrig != nil {
			// The two files name their parameters differently: outputs
			// and input gradient only.
			tOrig.stats = nil
			res.Drift.Train = trainDrift(tConv, tOrig, nil)
		}
	}
	opt.progress("the same on %d copies of the reference with input and weights moved by one rounding, to measure its own error", noiseDraws)
	gy := g
	if folded {
		gy = nil
	}
	nz, err := measureNoise(refRun, gRef, refW, x, gy, opt.Seed, mk)
	if err != nil {
		return nil, err
	}
	res.add(evalCheck(opt, "eval output", yConv.Data, yRef.Data, nz.max(func(s *sample) []float32 { return s.eval })))
	if strictFail != nil {
		res.add(*strictFail)
	}
	if folded {
		res.add(Check{Name: "training step", Skipped: true,
			Reason: fmt.Sprintf("%s has %d normalisation layers, the original %d: folded for inference, it has no training step to compare", filepath.Base(opt.Converted), norms(conv.Graph), norms(gRef))})
		res.Preserved = len(res.Failed) == 0
		return res, nil
	}
	checks, err := nz.judge(opt, []quantity{
		{name: "train output", got: tConv.y.Data, pick: func(s *sample) []float32 { return s.t.y.Data }},
		{name: "input gradient", got: tConv.dx.Data, pick: func(s *sample) []float32 { return s.t.dx.Data }},
	})
	if err != nil {
		return nil, err
	}
	for _, c := range checks {
		res.add(c)
	}
	res.add(evalCheck(opt, "eval output after training step", yConvAfter, refRun.after, nz.max(func(s *sample) []float32 { return s.after })))
	res.Preserved = len(res.Failed) == 0
	return res, nil
}

func isONNXPath(p string) bool { return model.IsONNX(p) }

func norms(g *graph.Graph) int {
	n := 0
	for _, nd := range g.Nodes {
		if nd.Op.IsBNFamily() {
			n++
		}
	}
	return n
}

// runnable refuses a graph with ops the runtime does not model.
func runnable(m *onnx.Model, path string) error {
	count := map[string]int{}
	var ops []string
	for _, n := range m.Graph.Nodes {
		if !onnx.IsOpaque(n.Op) {
			continue
		}
		op := strings.TrimPrefix(string(n.Op), onnx.OpaquePrefix)
		if count[op] == 0 {
			ops = append(ops, op)
		}
		count[op]++
	}
	if len(ops) == 0 {
		return nil
	}
	sort.Strings(ops)
	for i, op := range ops {
		ops[i] = fmt.Sprintf("%s x%d", op, count[op])
	}
	return failure.Unsupportedf("%s: verify runs ONNX models in abnconvert's runtime, which does not model these ops yet: %s",
		path, strings.Join(ops, ", "))
}

const customPrefix = onnx.OpaquePrefix + onnx.Domain + "."

// readRunnable reads an ONNX model and lowers what it can into ops the
// runtime runs; it refuses a model with anything else. A converted model
// may be folded for inference (no BatchNormalization left), which the
// reader otherwise refuses as an eval-mode export.
func readRunnable(path string, converted bool) (*model.Model, error) {
	md, err := model.OpenONNX(path, onnx.ReadOptions{AllowEvalExport: converted})
	if err != nil {
		return nil, err
	}
	m := md.ONNX
	if err := lower(m, path); err != nil {
		return nil, err
	}
	if err := runnable(m, path); err != nil {
		return nil, err
	}
	return md, nil
}

// lower turns the ai.abnconvert nodes of a converted file into IR nodes,
// a sign-flip Mul into its BatchNormalization's sign vector, and a Pad of
// zeros (torch exports one before every AveragePool with
// count_include_pad=True) into nothing.
func lower(m *onnx.Model, path string) error {
	m.DropZeroPads()
	var pm *protoModel
	g := m.Graph
	for _, n := range append([]*graph.Node(nil), g.Nodes...) {
		op := string(n.Op)
		if !strings.HasPrefix(op, customPrefix) && op != onnx.OpaquePrefix+"Mul" {
			continue
		}
		if pm == nil {
			var err error
			if pm, err = readProtoModel(path); err != nil {
				return err
			}
		}
		name, _, _ := m.Source(n)
		pn := pm.nodes[name]
		if pn == nil {
			if strings.HasPrefix(op, customPrefix) {
				return fmt.Errorf("%s: node %q (%s): its name is empty or not unique, so its attributes cannot be found", path, name, op)
			}
			continue
		}
		if strings.HasPrefix(op, customPrefix) {
			if err := lowerABN(m, n, pn); err != nil {
				return fmt.Errorf("%s: node %q: %w", path, name, err)
			}
			continue
		}
		if err := lowerSignMul(m, n, pn); err != nil {
			return fmt.Errorf("%s: node %q: %w", path, name, err)
		}
	}
	// Shape subgraphs and layout ops (channel shuffle, Resize to the
	// input's size...) become IR ops whose shapes follow the input.
	if _, err := m.LowerLayout(); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return g.Validate()
}

func lowerABN(m *onnx.Model, n *graph.Node, pn *protoNode) error {
	op := graph.Op(pn.opType)
	switch op {
	case graph.OpInPlaceABN, graph.OpInPlaceABNSync, graph.OpABN:
	default:
		// A newer abnconvert's op in its own domain, perhaps: not yet
		// supported here rather than a bad file.
		return failure.Unsupportedf("unknown op %s.%s", pn.domain, pn.opType)
	}
	if len(pn.inputs) != 5 || len(n.Inputs) != 1 {
		return fmt.Errorf("%s with %d inputs, want X, weight, bias, running_mean, running_var", op, len(pn.inputs))
	}
	params := map[string]string{}
	for i, role := range []string{graph.RoleWeight, graph.RoleBias, graph.RoleRunningMean, graph.RoleRunningVar} {
		key := pn.inputs[i+1]
		if _, ok := m.Weights.Shape(key); !ok {
			return fmt.Errorf("%s %q is not a constant of the model", role, key)
		}
		params[role] = key
	}
	shape, _ := m.Weights.Shape(params[graph.RoleWeight])
	if len(shape) != 1 {
		return fmt.Errorf("weight has shape %v", shape)
	}
	eps, ok := pn.floats["epsilon"]
	if !ok {
		return fmt.Errorf("no epsilon attribute")
	}
	a := graph.Attr{Features: shape[0], Eps: decimal(eps), Activation: pn.strs["activation"], ActParam: decimal(pn.floats["activation_param"])}
	if mo, ok := pn.floats["momentum"]; ok {
		a.Momentum = decimal(mo)
	} else {
		a.MomentumNone = true
	}
	switch a.Activation {
	case graph.ActReLU, graph.ActLeakyReLU, graph.ActELU, graph.ActIdentity:
	default:
		return fmt.Errorf("activation %q", a.Activation)
	}
	var sign []int8
	if s, ok := pn.ints["sign"]; ok {
		if len(s) != shape[0] {
			return fmt.Errorf("sign has %d entries for %d channels", len(s), shape[0])
		}
		sign = make([]int8, len(s))
		for i, v := range s {
			if v != 1 && v != -1 {
				return fmt.Errorf("sign[%d] is %d", i, v)
			}
			sign[i] = int8(v)
		}
	}
	n.Op, n.Attr, n.Params, n.Sign = op, a, params, sign
	n.Out.Channels = shape[0]
	return nil
}

// lowerSignMul folds Mul(x, sign) feeding one BatchNormalization into that
// node's sign vector; other Muls stay opaque (and are refused later).
func lowerSignMul(m *onnx.Model, n *graph.Node, pn *protoNode) error {
	if len(pn.inputs) != 2 || len(n.Inputs) != 1 || len(n.Out.Consumers) != 1 {
		return nil
	}
	bn := n.Out.Consumers[0]
	if !bn.Op.IsBNFamily() || bn.Sign != nil {
		return nil
	}
	v, err := m.Weights.Values(pn.inputs[1])
	if err != nil || len(v) != bn.Attr.Features {
		return nil
	}
	sign := make([]int8, len(v))
	for i, s := range v {
		if s != 1 && s != -1 {
			return nil
		}
		sign[i] = int8(s)
	}
	bn.Sign = sign
	m.Graph.ReplaceUses(n.Out, n.Inputs[0])
	m.Graph.Remove(n)
	return nil
}

// decimal is a float32 attribute as the shortest decimal that rounds to
// it (0.1, not 0.10000000149011612), as the ONNX reader reads attributes.
func decimal(f float32) float64 {
	v, _ := strconv.ParseFloat(strconv.FormatFloat(float64(f), 'g', -1, 32), 64)
	return v
}

// onnxInput is the input: the .npy file, else N(0,1) values of the shape
// the model declares (its static spatial size, --size where symbolic).
func onnxInput(opt Options, m *onnx.Model) (*runtime.HostTensor, error) {
	if opt.InputData != "" {
		return ReadNPY(opt.InputData)
	}
	ch := m.Graph.Input.Channels
	if ch <= 0 {
		ch = 3
	}
	h, w := opt.Size, opt.Size
	if pm, err := readProtoModel(opt.Original); err == nil && len(pm.inputDim) == 4 {
		if pm.inputDim[2] > 0 && pm.inputDim[3] > 0 {
			h, w = int(pm.inputDim[2]), int(pm.inputDim[3])
		}
	}
	x := runtime.NewHostTensor(opt.Batch, ch, h, w)
	r := newRand(opt.Seed)
	for i := range x.Data {
		x.Data[i] = float32(r.NormFloat64())
	}
	return x, nil
}

func newRand(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, 0x5eed)) }
