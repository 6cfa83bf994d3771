// Package verify proves a conversion: it runs the original and the
// converted network in abnconvert's own runtime, in eval mode and for one
// training step, and compares outputs, running statistics and gradients,
// mapped through the conversion's reparametrisation and sign folding.
//
// The converted checkpoint carries no structure of its own (its keys are the
// original's), so the converted graph is rebuilt by recognising the original
// and running the same rewrite pipeline with the conversion's flags, which
// the converted file's provenance record gives (provenance.go); the
// converted weights are then read from the converted file. A conversion that wrote
// anything else (a perturbed weight, BN weights copied without the
// |weight| + eps reparametrisation) therefore fails.
//
// The conversion may approximate on purpose: --relu leaky replaces BN + ReLU
// with leaky_relu, and channels with |gamma| < eps get scale eps. The
// exactness checks compare against a reference that applies exactly those
// declared approximations to the original; the approximations themselves
// are reported as drift against the original, and fail only with Strict.
package verify

import (
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"time"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/model"
	"github.com/abnconvert/abnconvert/rewrite"
	"github.com/abnconvert/abnconvert/runtime"
)

// Options are verify's inputs, one per command-line flag.
type Options struct {
	Original, Converted string
	// The conversion's flags: the converted file must be what they give.
	Arch  string
	Graph string // an ONNX export that supplies the structure (--graph)
	ReLU  string
	Slope float64
	Sync  bool
	// TinyGamma is the conversion's --tiny-gamma (exact or approx).
	TinyGamma string

	// shapeDefault: no input shape was given (Run).
	shapeDefault bool

	Seed      uint64
	Batch     int
	Size      int
	InputData string // .npy file of shape [N, C, H, W]; overrides Batch/Size
	// Probe is a file python/abnexport.py recorded from the user's model:
	// the rebuild of the original is compared with it first (probe.go).
	Probe string

	// Atol and Rtol bound eval-mode differences: |a-b| <= Atol + Rtol*max|ref|.
	Atol, Rtol float64
	// TrainFactor scales each quantity's noise (the reference's own
	// float32 error for it, measured on the run) into its limit.
	TrainFactor float64
	Strict      bool
	Device      string
	Progress    io.Writer
	// NewBackend makes a backend for the device; nil means the CPU.
	NewBackend func() (runtime.Backend, error)
}

// Check is one comparison.
type Check struct {
	Name string `json:"name"`
	// MaxAbs is the largest absolute difference; Scale the reference's
	// largest magnitude; Rel = MaxAbs/Scale.
	MaxAbs float64 `json:"max_abs"`
	Scale  float64 `json:"scale"`
	Rel    float64 `json:"rel"`
	// Limit is the largest Rel that passes: for training-mode quantities
	// TrainFactor times Noise (at least one float32 rounding), for eval
	// outputs Rtol plus Atol over the reference's largest magnitude.
	Limit float64 `json:"limit"`
	// Noise is the reference's own error for this quantity, in the same
	// metric: the largest difference among the reference and its copies
	// with input and weights moved by a rounding (noise.go).
	Noise float64 `json:"noise"`
	// Metric says how Rel is measured: "max" (largest difference over the
	// reference's largest magnitude: eval comparisons) or "l2" (norm of the
	// difference over the reference's norm: training comparisons, where a
	// max-pool argmax or a ReLU mask flipped by rounding moves a few
	// elements a lot and the rest not at all).
	Metric string `json:"metric"`
	Pass   bool   `json:"pass"`
	// Skipped: the check cannot tell a right result from a wrong one (the
	// true value is zero, or below its noise), for the reason given. A
	// skipped check is neither passed nor failed.
	Skipped bool   `json:"skipped,omitempty"`
	Reason  string `json:"reason,omitempty"`
	Note    string `json:"note,omitempty"`
}

// Drift describes how far the conversion's declared approximations move the
// outputs away from the original network's: in eval mode (the fields at
// the top level) and through one training step (Train).
type Drift struct {
	Sites     int `json:"approximated_sites"`
	TinyGamma int `json:"tiny_gamma_channels"`
	// Rounded counts the BN scales that half-precision storage moved
	// (applyStorageRounding).
	Rounded int `json:"rounded_gamma_channels,omitempty"`
	// Slope is the negative slope the approximated ReLU sites took.
	Slope  float64 `json:"slope,omitempty"`
	MaxAbs float64 `json:"max_abs"`
	Rel    float64 `json:"rel"`
	Cosine float64 `json:"cosine"`
	// Top1Agree is the share of samples whose argmax over the classes
	// agrees, for a 2-D (N, classes) output; PixelAgree the share of
	// pixels whose argmax over the channel axis agrees, for a 4-D
	// (N, C, H, W) output such as a segmentation map. Each is nil for
	// outputs of another rank, where an argmax says nothing (a top-1 over
	// the flattened map read 0% at cosine 1.000000).
	Top1Agree   *float64 `json:"top1_agreement,omitempty"`
	PixelAgree  *float64 `json:"pixel_agreement,omitempty"`
	WithinLimit bool     `json:"within_limit"`
	// Train is the drift of the training step (drift.go): a tiny gamma
	// at scale eps moves it far more than it moves eval outputs.
	Train *TrainDrift `json:"train,omitempty"`
}

// Result is the verdict; it is also the JSON the CLI prints.
type Result struct {
	Original  string  `json:"original"`
	Converted string  `json:"converted"`
	Arch      string  `json:"arch"`
	Device    string  `json:"device"`
	Input     []int   `json:"input_shape"`
	Seed      uint64  `json:"seed"`
	Checks    []Check `json:"checks"`
	Drift     *Drift  `json:"drift,omitempty"`
	Strict    bool    `json:"strict"`
	Preserved bool    `json:"preserved"`
	// Failed names the failing checks, for a one-line verdict; Skipped
	// the checks that could not discriminate (their reasons are in Checks).
	Failed  []string `json:"failed,omitempty"`
	Skipped []string `json:"skipped,omitempty"`
	// Passed, with len(Failed) and len(Skipped), counts the checks, the
	// probe's (Probe.Checks, named "probe: ..." here) included.
	Passed int `json:"passed"`
	// FlagsFrom says where the conversion's flags came from: the converted
	// file's provenance record (with the flags), or the command line.
	FlagsFrom string `json:"flags_from"`
	// Warnings: no record (which flags to give), or a record naming
	// another original.
	Warnings []string `json:"warnings,omitempty"`
	// Structure is "assumed" (recognised from the state dict's keys and
	// shapes) or "read" (--graph, an ONNX input, a whole pickled module);
	// Assumption says what was assumed. Conditional: the verdict holds only
	// if the assumption does (assumed, and no probe checked it). Probe is
	// the comparison with --probe (probe.go).
	Structure   string       `json:"structure"`
	Assumption  string       `json:"assumption,omitempty"`
	Conditional bool         `json:"conditional"`
	Probe       *ProbeResult `json:"probe,omitempty"`
	// Exact is false where the conversion declared approximations (ReLU
	// sites made leaky_relu by --relu leaky, tiny-gamma channels at scale
	// eps by --tiny-gamma approx, BN scales rounded by half-precision
	// storage): PRESERVED then means "computes what the conversion
	// promised", not "outputs unchanged", and Approximations says what
	// moved and by how much (Drift has the figures).
	Exact          bool   `json:"exact"`
	Approximations string `json:"approximations,omitempty"`
	// Verdict is the verdict's line as the text output prints it; the
	// command line fills it in.
	Verdict string `json:"verdict,omitempty"`
}

// Declared says what the declared approximations are and how far they
// move the outputs: "12 ReLU sites now leaky_relu(0.01) (--relu leaky):
// eval outputs move by max abs 0.00573 (rel 1.92e-02, cosine 0.999889),
// a training step's outputs by rel 1.16e-02". "" when there are none.
func (d *Drift) Declared() string {
	if d == nil {
		return ""
	}
	var what []string
	if d.Sites > 0 {
		what = append(what, fmt.Sprintf("%d ReLU site(s) now leaky_relu(%g) (--relu leaky; --relu abn keeps them exact)", d.Sites, d.Slope))
	}
	if d.TinyGamma > 0 {
		what = append(what, fmt.Sprintf("%d channel(s) with |gamma| < eps at scale eps (--tiny-gamma approx)", d.TinyGamma))
	}
	if d.Rounded > 0 {
		what = append(what, fmt.Sprintf("%d BN scale(s) rounded by half-precision storage", d.Rounded))
	}
	if len(what) == 0 {
		return ""
	}
	s := fmt.Sprintf("%s: eval outputs move by max abs %.3g (rel %.2e, cosine %.6f)", strings.Join(what, ", "), d.MaxAbs, d.Rel, d.Cosine)
	if d.Train != nil {
		s += fmt.Sprintf(", a training step's outputs by rel %.2e", d.Train.Output.Rel)
	}
	return s
}

// Run verifies. An error means bad input (unreadable files, keys or shapes
// that differ, flags the converted file was not made with would still give
// a Result that fails); a Result with Preserved false means the outputs
// differ; Exact false that they moved only as the conversion declared.
func Run(opt Options) (*Result, error) {
	// Neither --batch, --size nor --input-data: an export without dynamic
	// axes is verified at its own input shape (convert --verify).
	opt.shapeDefault = opt.Batch == 0 && opt.Size == 0 && opt.InputData == ""
	res, err := runAny(opt)
	if err != nil {
		return nil, err
	}
	res.Approximations = res.Drift.Declared()
	res.Exact = res.Approximations == ""
	return res, nil
}

func (o *Options) defaults() {
	if o.Arch == "" {
		o.Arch = "auto"
	}
	if o.ReLU == "" {
		o.ReLU = "leaky"
	}
	if o.Slope == 0 {
		o.Slope = 0.01
	}
	if o.TinyGamma == "" {
		// Only a file without a provenance record gets here without a
		// policy: one written before --tiny-gamma, which approximated.
		o.TinyGamma = rewrite.TinyGammaApprox
	}
	if o.Batch == 0 {
		o.Batch = 2
	}
	if o.Size == 0 {
		o.Size = 64
	}
	if o.Rtol == 0 {
		o.Rtol = 1e-4
	}
	if o.Atol == 0 {
		o.Atol = 1e-6
	}
	if o.TrainFactor == 0 {
		o.TrainFactor = 25
	}
	if o.Device == "" {
		o.Device = "cpu"
	}
}

func (o *Options) progress(format string, args ...any) {
	if o.Progress != nil {
		fmt.Fprintf(o.Progress, "verify: "+format+"\n", args...)
	}
}

// network is one side of the comparison.
type network struct {
	g    *graph.Graph
	w    graph.Weights
	ex   *runtime.Executor
	seed uint64
}

// forward runs n on x and returns what the model returns, as one flat
// tensor when it returns several: the main output, then the auxiliary ones
// (in eval, those the model computes in eval), so that every check covers
// every head. With one output it is Forward's result unchanged.
func (n *network) forward(x *runtime.HostTensor, training bool) (*runtime.HostTensor, error) {
	y, err := n.ex.Forward(x, training)
	if err != nil || len(n.g.Aux) == 0 {
		return y, err
	}
	outs := n.ex.Outputs()
	flat := &runtime.HostTensor{Data: append([]float32(nil), y.Data...)}
	added := false
	for k, a := range n.g.Aux {
		if a.TrainOnly && !training {
			continue
		}
		flat.Data = append(flat.Data, outs[k+1].Data...)
		added = true
	}
	if !added {
		// GoogLeNet's eval: the logits alone, with their shape (the
		// drift's top-1 agreement reads it).
		return y, nil
	}
	flat.Shape = []int{len(flat.Data)}
	return flat, nil
}

// backward runs n's backward from g, the gradient of what forward returned
// in eval (the main output and the auxiliary ones computed in eval, flat),
// split per output; a training-only auxiliary output's gradient is drawn
// from n's seed, the same in every network of a verify run. Every head is
// then trained, as a loss that adds their terms trains them.
func (n *network) backward(g *runtime.HostTensor) (*runtime.HostTensor, map[string][]float32, error) {
	if len(n.g.Aux) == 0 {
		return n.ex.Backward(g)
	}
	outs := n.ex.Outputs()
	var ds []*runtime.HostTensor
	off := 0
	take := func(shape []int) *runtime.HostTensor {
		d := &runtime.HostTensor{Shape: shape}
		if k := graph.Numel(shape); off+k <= len(g.Data) {
			d.Data = g.Data[off : off+k]
		}
		off += graph.Numel(shape)
		return d
	}
	ds = append(ds, take(outs[0].Shape))
	for k, a := range n.g.Aux {
		if a.TrainOnly {
			ds = append(ds, gradOut(n.seed+uint64(k)+1, outs[k+1].Shape))
			continue
		}
		ds = append(ds, take(outs[k+1].Shape))
	}
	if off != len(g.Data) {
		return nil, nil, fmt.Errorf("output gradient has %d values for outputs of %d", len(g.Data), off)
	}
	return n.ex.BackwardAll(ds)
}

// runAny is Run before the exactness is stated: a state dict's
// conversion here, an ONNX file's in runONNX.
func runAny(opt Options) (*Result, error) {
	if isONNXPath(opt.Original) || isONNXPath(opt.Converted) {
		return runONNX(opt) // onnx.go
	}
	// The converted file first: its provenance record gives the flags
	// the original's network is converted with (provenance.go).
	convModel, err := model.Open(opt.Converted)
	if err != nil {
		return nil, err
	}
	defer convModel.Close()
	from, warnings, err := opt.settle(convModel)
	if err != nil {
		return nil, err
	}
	if opt.Batch < 1 || opt.Size < 1 {
		return nil, fmt.Errorf("--batch %d, --size %d: both must be positive", opt.Batch, opt.Size)
	}
	convW := convModel.Weights
	newBackend := opt.NewBackend
	if newBackend == nil {
		newBackend = func() (runtime.Backend, error) { return runtime.NewCPU(0), nil }
	}
	// Every state-dict source a conversion reads (.pth state dict, whole
	// pickled module, .safetensors; structure recognised, from the module
	// tree, or from --graph) opens the same way; each open is a fresh view.
	mopt := model.Options{Arch: opt.Arch, Graph: opt.Graph}
	open := func() (*model.Network, error) { return model.OpenNetwork(opt.Original, mopt) }
	src, err := open()
	if err != nil {
		return nil, err
	}
	defer src.Close()
	if err := sameLayout(src.Weights, convW, opt); err != nil {
		return nil, err
	}

	// The converted structure: the rewrite re-run on a second, in-memory
	// view of the original (SetValues never touches the file).
	overlayNet, err := open()
	if err != nil {
		return nil, err
	}
	defer overlayNet.Close()
	gConv, match := overlayNet.Graph, overlayNet.Match
	rep, err := rewrite.Run(gConv, overlayNet.Weights, opt.rewriteOptions())
	if err != nil {
		return nil, fmt.Errorf("%s: %w", opt.Original, err)
	}

	// The reference: the original with the declared approximations.
	gRef := src.Graph
	orig := src.Weights
	refW := newOverlay(orig)
	approx, tiny, err := applyApproximations(gRef, refW, rep, opt.Slope)
	if err != nil {
		return nil, err
	}
	conv := convW
	rounded, err := applyStorageRounding(gRef, refW, rep, conv)
	if err != nil {
		return nil, err
	}

	x, err := input(opt)
	if err != nil {
		return nil, err
	}
	if f := match.FixedInput; opt.shapeDefault && len(f) == 4 && f[1] == 3 && f[2] == f[3] && !slices.Equal(f, x.Shape) {
		opt.Batch, opt.Size = f[0], f[2]
		if x, err = input(opt); err != nil {
			return nil, err
		}
	}
	if f := match.FixedInput; len(f) > 0 && !slices.Equal(f, x.Shape) {
		// The export's shapes are constants: at another shape a reshape
		// fails deep in the runtime, far from the cause.
		return nil, fixedInputError(opt.Graph, f, x.Shape)
	}
	res := &Result{Original: opt.Original, Converted: opt.Converted, Arch: match.Arch, Device: opt.Device,
		Input: x.Shape, Seed: opt.Seed, Strict: opt.Strict, FlagsFrom: from, Warnings: warnings}
	structure, assumption := structureOf(src.Model, opt, match.Arch)
	rebuild := func() (*graph.Graph, graph.Weights, func(), error) {
		n, err := open()
		if err != nil {
			return nil, nil, nil, err
		}
		return n.Graph, n.Weights, n.Close, nil
	}
	if err := opt.againstProbe(res, structure, assumption, rebuild, newBackend); err != nil {
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
	cv, err := mk(gConv, conv, "converted")
	if err != nil {
		return nil, err
	}
	defer cv.ex.Close()

	// 1. Eval outputs.
	opt.progress("eval forward of the reference and the converted network (%v)", x.Shape)
	yRef, yConv, err := evalPair(ref, cv, x)
	if err != nil {
		return nil, err
	}
	// (judged below, once its noise, reported with it, is measured)
	g := gradOut(opt.Seed, yRef.Shape)

	// 2. Drift of the declared approximations against the original, in
	// eval and through the training step (its figures once the converted
	// network's step is run, below).
	var strictFail *Check
	var tOrig *step
	if approx > 0 || tiny > 0 || rounded > 0 {
		opt.progress("eval forward of the original network (drift of %d approximated sites, %d tiny-gamma channels, %d BN scales rounded by half-precision storage)", approx, tiny, rounded)
		plain, err := open()
		if err != nil {
			return nil, err
		}
		defer plain.Close()
		gOrig := plain.Graph
		o, err := mk(gOrig, orig, "original")
		if err != nil {
			return nil, err
		}
		yOrig, err := o.forward(x, false)
		if err == nil {
			tOrig, err = originalStep(o, x, g)
		}
		o.ex.Close()
		if err != nil {
			return nil, fmt.Errorf("original: %w", err)
		}
		d := drift(yConv.Data, yOrig.Data, yOrig.Shape)
		d.Sites, d.TinyGamma, d.Rounded, d.Slope = approx, tiny, rounded, opt.Slope
		d.WithinLimit = d.Rel <= evalLimit(opt, yOrig.Data)
		res.Drift = &d
		if opt.Strict && !d.WithinLimit {
			strictFail = &Check{Name: "drift (--strict)", MaxAbs: d.MaxAbs, Rel: d.Rel, Limit: evalLimit(opt, yOrig.Data), Pass: false,
				Note: fmt.Sprintf("%d sites approximated by the ReLU policy, %d tiny-gamma channels, %d BN scales rounded by half-precision storage", approx, tiny, rounded)}
		}
	}

	// 3. One training step, then eval again (the running statistics moved
	// the same way); each compared quantity judged against its own noise,
	// measured on copies of the reference (noise.go).
	opt.progress("training step of the reference and the converted network, then eval again")
	tRef, err := trainStep(ref, x, g)
	if err != nil {
		return nil, fmt.Errorf("reference: %w", err)
	}
	tConv, err := trainStep(cv, x, g)
	if err != nil {
		return nil, fmt.Errorf("converted: %w", err)
	}
	yRefAfter, yConvAfter, err := evalPair(ref, cv, x)
	if err != nil {
		return nil, err
	}
	opt.progress("the same on %d copies of the reference with input and weights moved by one rounding, to measure its own error", noiseDraws)
	nz, err := measureNoise(&sample{eval: yRef.Data, t: tRef, after: yRefAfter.Data}, gRef, refW, x, g, opt.Seed, mk)
	if err != nil {
		return nil, err
	}
	res.add(evalCheck(opt, "eval output", yConv.Data, yRef.Data, nz.max(func(s *sample) []float32 { return s.eval })))
	if strictFail != nil {
		res.add(*strictFail)
	}
	qs := []quantity{
		{name: "train output", got: tConv.y.Data, pick: func(s *sample) []float32 { return s.t.y.Data }},
		{name: "input gradient", got: tConv.dx.Data, pick: func(s *sample) []float32 { return s.t.dx.Data }},
	}
	flips := map[string]map[int]bool{}
	for k, chans := range rep.Flips {
		m := map[int]bool{}
		for _, c := range chans {
			m[c] = true
		}
		flips[k] = m
	}
	if tOrig != nil {
		res.Drift.Train = trainDrift(tConv, tOrig, func(k string) []float64 {
			shape, _ := orig.Shape(k)
			return channelMap(shape, flips[k], nil)
		})
	}
	skip := tinyChannels(rep)
	zero := zeroGradients(gRef)
	for _, k := range sortedKeys(tRef.grads) {
		gc, ok := tConv.grads[k]
		if !ok {
			qs = append(qs, quantity{fixed: &Check{Name: "gradient " + k, Note: "missing in the converted network"}})
			continue
		}
		shape, _ := orig.Shape(k)
		qs = append(qs, quantity{name: "gradient " + k, got: gc, mult: channelMap(shape, flips[k], skip[k]), zero: zero[k],
			pick: func(s *sample) []float32 { return s.t.grads[k] }})
	}
	for _, k := range sortedKeys(tRef.stats) {
		if strings.HasSuffix(k, graph.RoleNumBatches) {
			ok := len(tConv.stats[k]) == 1 && tConv.stats[k][0] == tRef.stats[k][0]
			qs = append(qs, quantity{fixed: &Check{Name: "running " + k, Pass: ok, Limit: 0, Note: fmt.Sprintf("%v vs %v", tConv.stats[k], tRef.stats[k])}})
			continue
		}
		shape, _ := orig.Shape(k)
		var m []float64
		if strings.HasSuffix(k, graph.RoleRunningMean) {
			m = channelMap(shape, flips[k], nil)
		}
		qs = append(qs, quantity{name: "running " + k, got: tConv.stats[k], mult: m, pick: func(s *sample) []float32 { return s.t.stats[k] }})
	}
	checks, err := nz.judge(opt, qs)
	if err != nil {
		return nil, err
	}
	for _, c := range checks {
		res.add(c)
	}
	res.add(evalCheck(opt, "eval output after training step", yConvAfter.Data, yRefAfter.Data, nz.max(func(s *sample) []float32 { return s.after })))

	res.Preserved = len(res.Failed) == 0
	return res, nil
}

func (r *Result) add(c Check) {
	r.Checks = append(r.Checks, c)
	r.count(c)
}

func (r *Result) count(c Check) {
	switch {
	case c.Skipped:
		r.Skipped = append(r.Skipped, c.Name)
	case c.Pass:
		r.Passed++
	default:
		r.Failed = append(r.Failed, c.Name)
	}
}

func evalLimit(opt Options, ref []float32) float64 {
	scale := maxAbs(ref)
	if scale == 0 {
		return opt.Rtol
	}
	return opt.Rtol + opt.Atol/scale
}

// evalPair runs the reference and the converted network in eval mode on x.
func evalPair(ref, cv *network, x *runtime.HostTensor) (yRef, yConv *runtime.HostTensor, err error) {
	if yRef, err = ref.forward(x, false); err != nil {
		return nil, nil, fmt.Errorf("reference: %w", err)
	}
	if yConv, err = cv.forward(x, false); err != nil {
		return nil, nil, fmt.Errorf("converted: %w", err)
	}
	return yRef, yConv, nil
}

// newNetwork loads g with w on a fresh backend.
func newNetwork(newBackend func() (runtime.Backend, error), seed uint64, g *graph.Graph, w graph.Weights, what string, progress io.Writer) (*network, error) {
	b, err := newBackend()
	if err != nil {
		return nil, err
	}
	ex, err := runtime.New(g, w, b, runtime.Options{Seed: seed, Trace: nodeProgress(progress, what)})
	if err != nil {
		return nil, fmt.Errorf("%s network: %w", what, err)
	}
	return &network{g: g, w: w, ex: ex, seed: seed}, nil
}

// nodeProgress reports, at most every two seconds, which node a long run
// of the what network is at, so that a big network's step shows where it is.
func nodeProgress(w io.Writer, what string) func(string, int, int, *graph.Node, time.Duration) {
	if w == nil {
		return nil
	}
	last := time.Now()
	return func(phase string, i, n int, nd *graph.Node, _ time.Duration) {
		if i == 0 { // a pass starts: count from here
			last = time.Now()
			return
		}
		if time.Since(last) < 2*time.Second {
			return
		}
		last = time.Now()
		fmt.Fprintf(w, "verify:   %s network, %s: node %d of %d (%s)\n", what, phase, i+1, n, nd.Name)
	}
}

type step struct {
	y, dx *runtime.HostTensor
	grads map[string][]float32
	stats map[string][]float32
}

func trainStep(n *network, x, g *runtime.HostTensor) (*step, error) {
	y, err := n.forward(x, true)
	if err != nil {
		return nil, err
	}
	dx, grads, err := n.backward(g)
	if err != nil {
		return nil, err
	}
	stats, err := n.ex.RunningStats()
	if err != nil {
		return nil, err
	}
	return &step{y: y, dx: dx, grads: grads, stats: stats}, nil
}

// compareL2 is compare with the "l2" metric: the norm of the difference over
// the norm of the (mapped) reference.
func compareL2(name string, got, want []float32, mult []float64, limit float64) Check {
	c := compare(name, got, want, mult, limit)
	c.Metric = "l2"
	if len(got) != len(want) {
		return c
	}
	var dd, ww float64
	for i := range want {
		m := 1.0
		if mult != nil {
			m = mult[i]
			if m == 0 {
				continue
			}
		}
		w := m * float64(want[i])
		d := float64(got[i]) - w
		dd += d * d
		ww += w * w
	}
	switch {
	case ww > 0:
		c.Rel = math.Sqrt(dd / ww)
	case dd > 0:
		c.Rel = math.Inf(1)
	default:
		c.Rel = 0
	}
	if math.IsNaN(c.Rel) {
		c.Rel = math.Inf(1)
	}
	c.Pass = c.Rel <= limit
	return c
}

// compare returns the check of got against want; mult, when given, maps the
// reference into the converted parametrisation element by element (+1, -1,
// or 0 for elements not compared).
func compare(name string, got, want []float32, mult []float64, limit float64) Check {
	c := Check{Name: name, Limit: limit, Metric: "max"}
	if len(got) != len(want) {
		c.Note = fmt.Sprintf("%d values against %d", len(got), len(want))
		return c
	}
	for i := range want {
		m := 1.0
		if mult != nil {
			m = mult[i]
			if m == 0 {
				continue
			}
		}
		w := m * float64(want[i])
		d := math.Abs(float64(got[i]) - w)
		if math.IsNaN(d) {
			d = math.Inf(1)
		}
		c.MaxAbs = math.Max(c.MaxAbs, d)
		c.Scale = math.Max(c.Scale, math.Abs(w))
	}
	switch {
	case c.Scale > 0:
		c.Rel = c.MaxAbs / c.Scale
	case c.MaxAbs > 0:
		c.Rel = math.Inf(1)
	}
	c.Pass = c.Rel <= limit
	return c
}

func maxAbs(v []float32) float64 {
	m := 0.0
	for _, x := range v {
		m = math.Max(m, math.Abs(float64(x)))
	}
	return m
}

// channelMap expands per-channel signs (and channels left out) of a tensor
// whose dim 0 is the channel into a per-element multiplier.
func channelMap(shape []int, flipped, skipped map[int]bool) []float64 {
	if len(flipped) == 0 && len(skipped) == 0 {
		return nil
	}
	n := graph.Numel(shape)
	if len(shape) == 0 || shape[0] == 0 {
		return nil
	}
	per := n / shape[0]
	m := make([]float64, n)
	for i := range m {
		c := i / per
		switch {
		case skipped[c]:
		case flipped[c]:
			m[i] = -1
		default:
			m[i] = 1
		}
	}
	return m
}

// tinyChannels lists, per BN weight key, the channels whose gradient the
// converted network cannot reproduce: InPlace-ABN stores them as weight 0,
// whose gradient sign(0)*... is zero by the layer's definition.
func tinyChannels(rep *rewrite.Report) map[string]map[int]bool {
	out := map[string]map[int]bool{}
	for _, s := range rep.Sites {
		if len(s.TinyGammaChannels) == 0 {
			continue
		}
		m := map[int]bool{}
		for _, c := range s.TinyGammaChannels {
			m[c] = true
		}
		out[s.Node+"."+graph.RoleWeight] = m
	}
	return out
}

func drift(got, want []float32, shape []int) Drift {
	d := Drift{}
	var dot, ng, nw float64
	for i := range want {
		a, b := float64(got[i]), float64(want[i])
		d.MaxAbs = math.Max(d.MaxAbs, math.Abs(a-b))
		dot += a * b
		ng += a * a
		nw += b * b
	}
	if s := maxAbs(want); s > 0 {
		d.Rel = d.MaxAbs / s
	}
	if ng > 0 && nw > 0 {
		d.Cosine = dot / math.Sqrt(ng*nw)
	}
	switch {
	case len(shape) == 2 && shape[0] > 0:
		a := argmaxAgreement(got, want, shape[0], shape[1], 1)
		d.Top1Agree = &a
	case len(shape) == 4 && shape[0] > 0 && shape[2]*shape[3] > 0:
		a := argmaxAgreement(got, want, shape[0], shape[1], shape[2]*shape[3])
		d.PixelAgree = &a
	}
	return d
}

// argmaxAgreement is the share of the n*inner positions of two (n, k,
// inner) row-major tensors whose argmax over the k axis agrees.
func argmaxAgreement(got, want []float32, n, k, inner int) float64 {
	if n*inner == 0 || k == 0 {
		return 0
	}
	agree := 0
	for i := 0; i < n; i++ {
		base := i * k * inner
		for p := 0; p < inner; p++ {
			bg, bw := 0, 0
			for c := 1; c < k; c++ {
				if got[base+c*inner+p] > got[base+bg*inner+p] {
					bg = c
				}
				if want[base+c*inner+p] > want[base+bw*inner+p] {
					bw = c
				}
			}
			if bg == bw {
				agree++
			}
		}
	}
	return float64(agree) / float64(n*inner)
}

// input is the deterministic input: the .npy file, or N(0,1) values from
// the seed.
func input(opt Options) (*runtime.HostTensor, error) {
	if opt.InputData != "" {
		return ReadNPY(opt.InputData)
	}
	r := rand.New(rand.NewPCG(opt.Seed, 0x5eed))
	x := runtime.NewHostTensor(opt.Batch, 3, opt.Size, opt.Size)
	for i := range x.Data {
		x.Data[i] = float32(r.NormFloat64())
	}
	return x, nil
}

func gradOut(seed uint64, shape []int) *runtime.HostTensor {
	r := rand.New(rand.NewPCG(seed, 0x9a0d))
	g := runtime.NewHostTensor(shape...)
	for i := range g.Data {
		g.Data[i] = float32(r.NormFloat64())
	}
	return g
}

// sameLayout checks that the converted file holds the original's keys with
// the original's shapes: a conversion never renames or reshapes.
func sameLayout(orig, conv graph.Weights, opt Options) error {
	ok, ck := orig.Keys(), conv.Keys()
	if len(ok) != len(ck) {
		return fmt.Errorf("%s: %d tensors in the state dict, %s has %d: not a conversion of it", opt.Converted, len(ck), opt.Original, len(ok))
	}
	for _, k := range ok {
		s1, _ := orig.Shape(k)
		s2, found := conv.Shape(k)
		if !found {
			return fmt.Errorf("%s: no tensor %q, which %s has: not a conversion of it", opt.Converted, k, opt.Original)
		}
		if fmt.Sprint(s1) != fmt.Sprint(s2) {
			return fmt.Errorf("%s: %s has shape %v, %v in %s", opt.Converted, k, s2, s1, opt.Original)
		}
	}
	return nil
}

func sortedKeys(m map[string][]float32) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sortStrings(keys)
	return keys
}

var errNoNode = errors.New("no such node")

// fixedInputError refuses to verify an export without dynamic axes at
// another input shape than its own, saying which flags run it.
func fixedInputError(graphPath string, fixed, got []int) error {
	how := "--input-data with an array of that shape"
	if len(fixed) == 4 && fixed[2] == fixed[3] {
		how = fmt.Sprintf("--batch %d --size %d", fixed[0], fixed[2])
	}
	return fmt.Errorf("%s was exported without dynamic axes and runs only at its input shape %v, not %v: verify with %s, or re-export with dynamic_axes (the README's recipe)", graphPath, fixed, got, how)
}
