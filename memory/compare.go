package memory

import (
	"errors"
	"fmt"
	"math"
	"math/rand"
	"sort"
	"strings"

	"github.com/abnconvert/abnconvert/arch"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/model"
	"github.com/abnconvert/abnconvert/rewrite"
	"github.com/abnconvert/abnconvert/runtime"
)

// Source opens a fresh view of a state dict, and the function that closes
// it. The conversion rewrites the weights of its view in memory, so the
// original and the converted network each need their own.
type Source func() (graph.Weights, func() error, error)

// FileSource opens a checkpoint file (any format package model opens).
func FileSource(path string) Source {
	return func() (graph.Weights, func() error, error) {
		m, err := model.Open(path)
		if err != nil {
			return nil, nil, err
		}
		return m.Weights, func() error { m.Close(); return nil }, nil
	}
}

// MemSource builds a fresh in-memory state dict each time.
func MemSource(build func() *graph.MemWeights) Source {
	return func() (graph.Weights, func() error, error) { return build(), func() error { return nil }, nil }
}

// Comparison is the table of `abnconvert memory --compare`: one row per
// memory technique and per combination, each measured by running the
// training step under it.
type Comparison struct {
	Input  string `json:"input"`
	Arch   string `json:"arch"`
	Family string `json:"family"`
	Batch  int    `json:"batch"`
	Size   int    `json:"size"`
	// Backend is the backend that measured memory ("shapes": the runtime's
	// allocator without arithmetic); drift is computed on the CPU.
	Backend    string `json:"backend"`
	Half       string `json:"half_format"`
	ParamBytes int64  `json:"param_bytes"`
	Budget     int64  `json:"budget_bytes,omitempty"`
	// Conversion summarises what the InPlace-ABN rows run: sites converted,
	// and how many of them changed activation (ReLU to leaky ReLU).
	Conversion ConversionSummary `json:"conversion"`
	// DriftSetup says on what the drift columns were measured; nil when
	// they were not.
	DriftSetup *DriftSetup `json:"drift_setup,omitempty"`
	Rows       []Row       `json:"rows"`
	// Batches lists the batch sizes of Row.ByBatch (with --plot).
	Batches []int `json:"curve_batches,omitempty"`
	// Depth is memory against depth for the DenseNet configurations of
	// DepthSeries (DenseNets, with --plot).
	Depth []DepthPoint `json:"depth,omitempty"`
	// Segments lists, per checkpointing policy, the segments chosen on the
	// original network (JSON with --layers), as module paths and node
	// indices: what bench/saved_activations_ext.py reproduces in PyTorch.
	Segments map[string][]runtime.Segment `json:"segments,omitempty"`
}

// ConversionSummary is what the InPlace-ABN rows' conversion did.
type ConversionSummary struct {
	ReLU         string  `json:"relu_policy"`
	Slope        float64 `json:"slope"`
	Sites        int     `json:"sites"`
	Approximated int     `json:"approximated"`
	FallbackABN  int     `json:"fallback_abn"`
	DenseLayers  int     `json:"dense_layers_marked"`
}

// DriftSetup is the small training step every row's numbers are compared on.
type DriftSetup struct {
	Batch int    `json:"batch"`
	Size  int    `json:"size"`
	Seed  uint64 `json:"seed"`
}

// Row is one technique or combination.
type Row struct {
	// Key names the row for scripts: techniques joined by "+", e.g.
	// "inplace-abn+checkpoint-blocks"; "baseline" is plain BN + activation.
	Key        string `json:"key"`
	Name       string `json:"name"`
	SavedBytes int64  `json:"saved_bytes"`
	PeakBytes  int64  `json:"peak_bytes"`
	// Saving is the fraction of the baseline's saved bytes this row does
	// not keep; PeakSaving the same for the peak.
	Saving     float64 `json:"saving"`
	PeakSaving float64 `json:"peak_saving"`
	// ExtraCompute is RecomputeFLOPs over StepFLOPs: the work done again,
	// as a fraction of one training step (runtime.WorkReport).
	ExtraCompute   float64 `json:"extra_compute"`
	RecomputeFLOPs int64   `json:"recompute_flops"`
	StepFLOPs      int64   `json:"step_flops"`
	// Segments is the number of checkpoint segments, 0 without.
	Segments int `json:"segments,omitempty"`
	// Exact says whether outputs and gradients are those of the baseline
	// (up to float32 rounding); Note says why not.
	Exact bool   `json:"exact"`
	Note  string `json:"note,omitempty"`
	// Drift is the measured difference from the baseline on DriftSetup.
	Drift    *Drift  `json:"drift,omitempty"`
	MaxBatch int     `json:"max_batch,omitempty"`
	ByBatch  []Point `json:"by_batch,omitempty"`
}

// Drift is a row's output and input gradient against the baseline's, on the
// same input and output gradient: the largest absolute difference, and that
// over the largest magnitude of the baseline's.
type Drift struct {
	OutputMaxAbs    float64 `json:"output_max_abs"`
	OutputMaxRel    float64 `json:"output_max_rel"`
	InputGradMaxAbs float64 `json:"input_grad_max_abs"`
	InputGradMaxRel float64 `json:"input_grad_max_rel"`
}

// Point is one measurement of a curve.
type Point struct {
	X          int   `json:"x"`
	SavedBytes int64 `json:"saved_bytes"`
	PeakBytes  int64 `json:"peak_bytes"`
	// TotalBytes is parameters plus peak: what must fit.
	TotalBytes int64 `json:"total_bytes"`
}

// DepthPoint is every row measured on one DenseNet configuration.
type DepthPoint struct {
	Name  string `json:"name"`
	Arch  string `json:"arch"` // as arch.Recognize names it
	Depth int    `json:"depth"`
	// Rows maps a row key to its figures (X is the depth).
	Rows map[string]Point `json:"rows"`
}

// technique is a row's recipe.
type technique struct {
	key, name string
	converted bool // the InPlace-ABN graph
	shared    bool // DenseNet shared buffers
	ckpt      runtime.Checkpointing
	half      bool
}

// techniques lists the rows for a network: each technique alone, then
// InPlace-ABN with each other one (for DenseNets, InPlace-ABN with shared
// buffers, the default conversion, with each).
func techniques(dense bool, half runtime.DType) []technique {
	halfName := half.String() + " activations"
	ts := []technique{
		{key: "baseline", name: "baseline: BN + activation"},
		{key: "checkpoint-blocks", name: "checkpointing, every block", ckpt: runtime.CheckpointBlocks},
		{key: "checkpoint-sqrt", name: "checkpointing, sqrt(n) segments", ckpt: runtime.CheckpointSqrt},
		{key: "half", name: halfName, half: true},
	}
	if dense {
		ts = append(ts, technique{key: "shared", name: "shared DenseNet buffers", shared: true})
	}
	ts = append(ts,
		technique{key: "inplace-abn", name: "InPlace-ABN", converted: true},
		technique{key: "inplace-abn+checkpoint-blocks", name: "InPlace-ABN + checkpointing, every block", converted: true, ckpt: runtime.CheckpointBlocks},
		technique{key: "inplace-abn+checkpoint-sqrt", name: "InPlace-ABN + checkpointing, sqrt(n)", converted: true, ckpt: runtime.CheckpointSqrt},
		technique{key: "inplace-abn+half", name: "InPlace-ABN + " + halfName, converted: true, half: true},
	)
	if dense {
		ts = append(ts,
			technique{key: "inplace-abn+shared", name: "InPlace-ABN + shared buffers", converted: true, shared: true},
			technique{key: "inplace-abn+shared+checkpoint-blocks", name: "InPlace-ABN + shared + checkpointing, every block", converted: true, shared: true, ckpt: runtime.CheckpointBlocks},
			technique{key: "inplace-abn+shared+checkpoint-sqrt", name: "InPlace-ABN + shared + checkpointing, sqrt(n)", converted: true, shared: true, ckpt: runtime.CheckpointSqrt},
			technique{key: "inplace-abn+shared+half", name: "InPlace-ABN + shared + " + halfName, converted: true, shared: true, half: true},
		)
	}
	return ts
}

// setup is the graphs of one network the rows run on.
type setup struct {
	match  *arch.Match
	report *rewrite.Report
	orig   *graph.Graph // plain
	shared *graph.Graph // plain, dense layers marked for shared buffers (nil: not a DenseNet)
	conv   *graph.Graph // converted, marks from the conversion
	w0, w1 graph.Weights
	close  []func() error
}

func (s *setup) Close() {
	for _, c := range s.close {
		c()
	}
}

func newSetup(src Source, opt Options) (*setup, error) {
	s := &setup{}
	w0, c0, err := src()
	if err != nil {
		return nil, err
	}
	s.close = append(s.close, c0)
	s.w0 = w0
	if s.orig, s.match, err = opt.structure(w0); err != nil {
		s.Close()
		return nil, err
	}
	if g, _, err := opt.structure(w0); err == nil && runtime.MarkSharedBuffers(g) > 0 {
		s.shared = g
	}
	w1, c1, err := src()
	if err != nil {
		s.Close()
		return nil, err
	}
	s.close = append(s.close, c1)
	s.w1 = w1
	if s.conv, _, err = opt.structure(w1); err != nil {
		s.Close()
		return nil, err
	}
	if s.report, err = rewrite.Run(s.conv, w1, rewrite.Options{ReLU: opt.ReLU, Slope: opt.Slope}); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

func (s *setup) dense() bool { return s.shared != nil }

// variant is the graph and runtime options a technique runs with.
func (s *setup) variant(t technique, half runtime.DType) variant {
	v := variant{name: t.name, g: s.orig, w: s.w0}
	switch {
	case t.converted:
		v.g, v.w = s.conv, s.w1
		v.opt.NoRecompute = !t.shared
	case t.shared:
		v.g = s.shared
	default:
		v.opt.NoRecompute = true
	}
	v.opt.Checkpoint = t.ckpt
	if t.half {
		v.opt.Half = half
	}
	return v
}

func (o *Options) compareDefaults() error {
	if o.Arch == "" {
		o.Arch = "auto"
	}
	if o.ReLU == "" {
		o.ReLU = rewrite.ReLULeaky
	}
	if o.Slope == 0 {
		o.Slope = rewrite.DefaultSlope
	}
	if o.Batch < 1 || o.Size < 1 {
		return fmt.Errorf("--batch %d, --size %d: both must be positive", o.Batch, o.Size)
	}
	if o.Half == runtime.Float32 {
		o.Half = runtime.BFloat16
	}
	if !o.Half.Is16() {
		return fmt.Errorf("half-precision format %v: want bfloat16 or float16", o.Half)
	}
	if o.NewBackend == nil {
		o.NewBackend = shapes
	}
	if o.DriftBatch == 0 {
		o.DriftBatch = 2
	}
	if o.DriftSize == 0 {
		o.DriftSize = min(o.Size, 64)
	}
	if len(o.CurveBatches) == 0 {
		o.CurveBatches = []int{2, 4, 8, 16, 32, 64}
	}
	return nil
}

// Compare measures every technique and combination on the network in
// opt.Input (or opt.Source) at opt.Batch and opt.Size: one training step in
// the runtime per row, under that row's policy, on the shape-only backend
// for memory and work; then, unless opt.NoDrift, the same step with real
// arithmetic on the CPU at DriftBatch x DriftSize for every row, against
// the baseline's; with opt.Budget, each row's largest batch; with
// opt.Curves, memory against batch size and, for DenseNets, against depth.
func Compare(opt Options) (*Comparison, error) {
	if err := opt.compareDefaults(); err != nil {
		return nil, err
	}
	if opt.Source == nil {
		if opt.Input == "" {
			return nil, errors.New("no input checkpoint")
		}
		opt.Source = FileSource(opt.Input)
	}
	s, err := newSetup(opt.Source, opt)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", opt.Input, err)
	}
	defer s.Close()
	c := &Comparison{
		Input: opt.Input, Arch: s.match.Arch, Family: s.match.Family, Batch: opt.Batch, Size: opt.Size,
		Half: opt.Half.String(), Budget: opt.Budget,
		Conversion: ConversionSummary{ReLU: s.report.ReLUPolicy, Slope: s.report.Slope, Sites: s.report.Summary.Sites,
			Approximated: s.report.Summary.Approximated, FallbackABN: s.report.Summary.FallbackABN, DenseLayers: s.report.Summary.DenseLayersMarked},
		Segments: map[string][]runtime.Segment{},
	}
	for _, p := range []runtime.Checkpointing{runtime.CheckpointBlocks, runtime.CheckpointSqrt} {
		segs, err := runtime.Segments(s.orig, p)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", opt.Input, err)
		}
		c.Segments[string(p)] = segs
	}
	ts := techniques(s.dense(), opt.Half)
	vs := make([]variant, len(ts))
	for i, t := range ts {
		vs[i] = s.variant(t, opt.Half)
		opt.progress("measuring %s at batch %d, %dx%d", t.name, opt.Batch, opt.Size, opt.Size)
		f, backend, err := measure(vs[i], opt.Batch, opt.Size, opt.NewBackend)
		if err != nil {
			return nil, err
		}
		c.Backend, c.ParamBytes = backend, f.ParamBytes
		r := Row{Key: t.key, Name: t.name, SavedBytes: f.SavedBytes, PeakBytes: f.PeakBytes,
			ExtraCompute: f.Work.Extra(), RecomputeFLOPs: f.Work.RecomputeFLOPs, StepFLOPs: f.Work.ForwardFLOPs + f.Work.BackwardFLOPs,
			Segments: f.Segments, Exact: true}
		var notes []string
		if t.half {
			r.Exact = false
			notes = append(notes, opt.Half.String()+" activations")
		}
		if t.converted && s.report.Summary.Approximated > 0 {
			r.Exact = false
			leaky, tiny := 0, 0
			for _, x := range s.report.Sites {
				if x.Outcome != rewrite.OutcomeApproximated {
					continue
				}
				if x.Activation != x.OpActivation {
					leaky++
				}
				if len(x.TinyGammaChannels) > 0 {
					tiny++
				}
			}
			if leaky > 0 {
				notes = append(notes, fmt.Sprintf("ReLU to leaky_relu(%g) at %d of %d sites", s.report.Slope, leaky, s.report.Summary.Sites))
			}
			if tiny > 0 {
				notes = append(notes, fmt.Sprintf("|gamma| < eps at scale eps at %d sites (--tiny-gamma approx)", tiny))
			}
		}
		r.Note = strings.Join(notes, "; ")
		c.Rows = append(c.Rows, r)
	}
	base := c.Rows[0]
	for i := range c.Rows {
		r := &c.Rows[i]
		r.Saving = saving(r.SavedBytes, base.SavedBytes)
		r.PeakSaving = saving(r.PeakBytes, base.PeakBytes)
	}
	if !opt.NoDrift {
		c.DriftSetup = &DriftSetup{Batch: opt.DriftBatch, Size: opt.DriftSize, Seed: opt.Seed}
		if err := drift(c, vs, opt); err != nil {
			return nil, err
		}
	}
	if opt.Budget > 0 {
		for i, v := range vs {
			opt.progress("largest batch of %s within %d bytes", v.name, opt.Budget)
			if c.Rows[i].MaxBatch, err = maxBatch(v, opt.Size, opt.Budget, opt.NewBackend); err != nil {
				return nil, err
			}
		}
	}
	if opt.Curves {
		c.Batches = curveBatches(opt.CurveBatches, opt.Batch)
		for i, v := range vs {
			opt.progress("memory of %s against batch size", v.name)
			for _, b := range c.Batches {
				f, _, err := measure(v, b, opt.Size, opt.NewBackend)
				if err != nil {
					return nil, err
				}
				c.Rows[i].ByBatch = append(c.Rows[i].ByBatch, Point{X: b, SavedBytes: f.SavedBytes, PeakBytes: f.PeakBytes, TotalBytes: f.ParamBytes + f.PeakBytes})
			}
		}
		if s.match.Family == arch.FamilyDenseNet {
			if c.Depth, err = DepthCurve(opt); err != nil {
				return nil, err
			}
		}
	}
	return c, nil
}

func saving(x, base int64) float64 {
	if base <= 0 {
		return 0
	}
	return 1 - float64(x)/float64(base)
}

func curveBatches(list []int, batch int) []int {
	seen := map[int]bool{}
	var out []int
	for _, b := range append(append([]int(nil), list...), batch) {
		if b >= 1 && !seen[b] {
			seen[b] = true
			out = append(out, b)
		}
	}
	sort.Ints(out)
	return out
}

// DepthCurve measures every row on each configuration of DepthSeries, built
// by synthesising its state dict's shapes and recognising it, at opt.Batch
// and opt.Size.
func DepthCurve(opt Options) ([]DepthPoint, error) {
	if err := opt.compareDefaults(); err != nil {
		return nil, err
	}
	var out []DepthPoint
	for _, cfg := range DepthSeries {
		opt.progress("memory of %s (depth %d)", cfg.Name, cfg.Depth())
		o := opt
		o.Arch = "auto"
		o.Structure = nil // synthesised torchvision configurations: recognised
		s, err := newSetup(MemSource(cfg.Weights), o)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", cfg.Name, err)
		}
		p := DepthPoint{Name: cfg.Name, Arch: s.match.Arch, Depth: cfg.Depth(), Rows: map[string]Point{}}
		for _, t := range techniques(s.dense(), opt.Half) {
			f, _, err := measure(s.variant(t, opt.Half), opt.Batch, opt.Size, opt.NewBackend)
			if err != nil {
				s.Close()
				return nil, fmt.Errorf("%s: %w", cfg.Name, err)
			}
			p.Rows[t.key] = Point{X: p.Depth, SavedBytes: f.SavedBytes, PeakBytes: f.PeakBytes, TotalBytes: f.ParamBytes + f.PeakBytes}
		}
		s.Close()
		out = append(out, p)
	}
	return out, nil
}

// drift runs every row's training step with real arithmetic on the CPU
// (deterministic input and output gradient) and compares its output and
// input gradient with the baseline's.
func drift(c *Comparison, vs []variant, opt Options) error {
	r := rand.New(rand.NewSource(int64(opt.Seed) + 1))
	x := runtime.NewHostTensor(opt.DriftBatch, 3, opt.DriftSize, opt.DriftSize)
	for i := range x.Data {
		x.Data[i] = float32(r.NormFloat64())
	}
	var refOut, refDx []float32
	for i, v := range vs {
		opt.progress("drift of %s at batch %d, %dx%d (CPU)", v.name, opt.DriftBatch, opt.DriftSize, opt.DriftSize)
		out, dx, err := cpuStep(v, x, opt.Seed, func(n int) []float32 {
			// The output gradient, drawn once the output's size is known,
			// the same for every row.
			g := rand.New(rand.NewSource(int64(opt.Seed) + 2))
			d := make([]float32, n)
			for k := range d {
				d[k] = float32(g.NormFloat64())
			}
			return d
		})
		if err != nil {
			return fmt.Errorf("%s: drift: %w", v.name, err)
		}
		if i == 0 {
			refOut, refDx = out, dx
		}
		d := &Drift{}
		d.OutputMaxAbs, d.OutputMaxRel = diff(out, refOut)
		d.InputGradMaxAbs, d.InputGradMaxRel = diff(dx, refDx)
		c.Rows[i].Drift = d
	}
	return nil
}

func cpuStep(v variant, x *runtime.HostTensor, seed uint64, dout func(int) []float32) (out, dx []float32, err error) {
	opt := v.opt
	opt.Seed = seed
	ex, err := runtime.New(v.g, v.w, runtime.NewCPU(0), opt)
	if err != nil {
		return nil, nil, err
	}
	defer ex.Close()
	y, err := ex.Forward(x, true)
	if err != nil {
		return nil, nil, err
	}
	d, _, err := ex.Backward(&runtime.HostTensor{Shape: y.Shape, Data: dout(len(y.Data))})
	if err != nil {
		return nil, nil, err
	}
	return y.Data, d.Data, nil
}

// diff is the largest |a-b| and that over the largest |b|.
func diff(a, b []float32) (maxAbs, maxRel float64) {
	scale := 0.0
	for i := range b {
		maxAbs = math.Max(maxAbs, math.Abs(float64(a[i])-float64(b[i])))
		scale = math.Max(scale, math.Abs(float64(b[i])))
	}
	if scale > 0 {
		maxRel = maxAbs / scale
	}
	return maxAbs, maxRel
}
