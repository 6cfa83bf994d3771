// Package memory measures what training a network keeps in memory, before
// and after conversion, by running the training step in the runtime on its
// shape-only backend: the same executor and allocator as a computing run,
// with no arithmetic, so full-size figures come in seconds.
package memory

import (
	"fmt"
	"io"

	"github.com/abnconvert/abnconvert/arch"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/rewrite"
	"github.com/abnconvert/abnconvert/runtime"
)

// Options are memory's inputs.
type Options struct {
	Input string
	Arch  string
	ReLU  string
	Slope float64
	// TinyGamma is the conversion's --tiny-gamma ("" is exact): under
	// exact, sites with |gamma| < eps are ABN and save nothing.
	TinyGamma string
	Batch     int
	Size      int
	// Budget, when positive, asks for the largest batch whose peak fits.
	Budget   int64
	Progress io.Writer
	// NewBackend makes the measuring backend; nil means the shape-only one.
	// A backend on a device (runtime.DeviceMemory) is also cross-checked
	// against its driver: Figures.Device.
	NewBackend func() (runtime.Backend, error)

	// What Compare also reads.

	// Source opens the state dict; nil opens Input.
	Source Source
	// Structure builds a fresh graph over weights from Source; nil
	// recognises the architecture (arch.Recognize with Arch).
	Structure func(w graph.Weights) (*graph.Graph, *arch.Match, error)
	// Half is the 16-bit format of the half-precision rows: BFloat16 (the
	// default, what CPU autocast uses) or Float16.
	Half runtime.DType
	// NoDrift skips the drift measurement (it needs the weights' values).
	NoDrift bool
	// DriftBatch and DriftSize are the input of the drift step: 2 and
	// min(Size, 64) by default, small enough for the CPU.
	DriftBatch, DriftSize int
	// Seed draws the drift step's input, output gradient and dropout masks.
	Seed uint64
	// Curves measures every row against batch size (CurveBatches, default
	// 2 to 64 in powers of two, and Batch) and, for DenseNets, against
	// depth (DepthSeries): what PlotComparison draws.
	Curves       bool
	CurveBatches []int
}

// Figures are one variant's measurement.
type Figures struct {
	SavedBytes int64                 `json:"saved_bytes"`
	PeakBytes  int64                 `json:"peak_bytes"`
	ParamBytes int64                 `json:"param_bytes"`
	MaxBatch   int                   `json:"max_batch,omitempty"`
	Layers     []runtime.LayerMemory `json:"layers,omitempty"`
	// Device is the driver cross-check of a step measured on a device.
	Device *DeviceCheck `json:"device,omitempty"`
	// Work and Segments are for Compare's rows.
	Work     runtime.WorkReport `json:"-"`
	Segments int                `json:"-"`
}

// Technique is one row of the per-technique table.
type Technique struct {
	Name       string  `json:"name"`
	SavedBytes int64   `json:"saved_bytes"`
	PeakBytes  int64   `json:"peak_bytes"`
	Saving     float64 `json:"saving"` // of saved bytes, against the original
	MaxBatch   int     `json:"max_batch,omitempty"`
}

// Result is what memory prints; its JSON carries at least
// {"original": {"saved_bytes", "peak_bytes"}, "converted": {...}}.
type Result struct {
	Input      string      `json:"input"`
	Arch       string      `json:"arch"`
	Batch      int         `json:"batch"`
	Size       int         `json:"size"`
	Backend    string      `json:"backend"`
	Budget     int64       `json:"budget_bytes,omitempty"`
	Original   Figures     `json:"original"`
	Converted  Figures     `json:"converted"`
	Techniques []Technique `json:"techniques"`
}

// variant is one graph to measure.
type variant struct {
	name string
	g    *graph.Graph
	w    graph.Weights
	opt  runtime.Options
}

func (o *Options) progress(format string, args ...any) {
	if o.Progress != nil {
		fmt.Fprintf(o.Progress, "memory: "+format+"\n", args...)
	}
}

func (o *Options) structure(w graph.Weights) (*graph.Graph, *arch.Match, error) {
	if o.Structure != nil {
		return o.Structure(w)
	}
	return arch.Recognize(w, o.Arch)
}

// Run measures the original network and its default conversion (InPlace-ABN
// and, for DenseNets, shared buffers), and each technique alone.
func Run(opt Options) (*Result, error) {
	if opt.Arch == "" {
		opt.Arch = "auto"
	}
	if opt.ReLU == "" {
		opt.ReLU = "leaky"
	}
	if opt.Slope == 0 {
		opt.Slope = 0.01
	}
	if opt.Batch < 1 || opt.Size < 1 {
		return nil, fmt.Errorf("--batch %d, --size %d: both must be positive", opt.Batch, opt.Size)
	}
	if opt.NewBackend == nil {
		opt.NewBackend = shapes
	}
	if opt.Source == nil {
		opt.Source = FileSource(opt.Input)
	}
	orig, closeOrig, err := opt.Source()
	if err != nil {
		return nil, err
	}
	defer closeOrig()
	g0, match, err := opt.structure(orig)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", opt.Input, err)
	}
	conv, closeConv, err := opt.Source() // a second view: the rewrite changes it in memory only
	if err != nil {
		return nil, err
	}
	defer closeConv()
	g1, _, err := opt.structure(conv)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", opt.Input, err)
	}
	rep, err := rewrite.Run(g1, conv, rewrite.Options{ReLU: opt.ReLU, Slope: opt.Slope, TinyGamma: opt.TinyGamma})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", opt.Input, err)
	}
	variants := []variant{
		{name: "original (BN + activation)", g: g0, w: orig},
		{name: "InPlace-ABN", g: g1, w: conv, opt: runtime.Options{NoRecompute: true}},
	}
	if len(rep.DenseLayers) > 0 {
		variants = append(variants, variant{name: "InPlace-ABN + shared DenseNet buffers", g: g1, w: conv})
	}
	res := &Result{Input: opt.Input, Arch: match.Arch, Batch: opt.Batch, Size: opt.Size, Budget: opt.Budget}
	var figs []Figures
	for _, v := range variants {
		opt.progress("measuring %s at batch %d, %dx%d", v.name, opt.Batch, opt.Size, opt.Size)
		f, backend, err := measure(v, opt.Batch, opt.Size, opt.NewBackend)
		if err != nil {
			return nil, err
		}
		res.Backend = backend
		if opt.Budget > 0 {
			opt.progress("largest batch of %s within %d bytes", v.name, opt.Budget)
			f.MaxBatch, err = maxBatch(v, opt.Size, opt.Budget, opt.NewBackend)
			if err != nil {
				return nil, err
			}
		}
		figs = append(figs, f)
	}
	res.Original = figs[0]
	res.Converted = figs[len(figs)-1]
	for i, v := range variants {
		t := Technique{Name: v.name, SavedBytes: figs[i].SavedBytes, PeakBytes: figs[i].PeakBytes, MaxBatch: figs[i].MaxBatch}
		if figs[0].SavedBytes > 0 {
			t.Saving = 1 - float64(t.SavedBytes)/float64(figs[0].SavedBytes)
		}
		res.Techniques = append(res.Techniques, t)
	}
	return res, nil
}

func shapes() (runtime.Backend, error) { return runtime.NewShapes(), nil }

// DeviceCheck is a step measured on a device, against its driver: the
// device's figures when the forward has ended (every saved activation live:
// the allocator's count, which is the runtime's figure, what its pool
// reserved from the driver, and what the driver says is in use since the
// device was opened), and the pool's peak over the step, the cache emptied
// before it. Consistent means driver >= pool >= live at the forward's end,
// and a pool peak that holds the runtime's peak and the parameters: the
// measurement and the device agree.
type DeviceCheck struct {
	runtime.DeviceFigures
	Consistent bool `json:"consistent"`
}

// measure runs one training step (forward and backward) of v.
func measure(v variant, batch, size int, nb func() (runtime.Backend, error)) (Figures, string, error) {
	b, err := nb()
	if err != nil {
		return Figures{}, "", err
	}
	if c, ok := b.(io.Closer); ok {
		defer c.Close()
	}
	dm, _ := b.(runtime.DeviceMemory)
	if dm != nil {
		if err := dm.TrimCache(); err != nil {
			return Figures{}, "", fmt.Errorf("%s: %w", v.name, err)
		}
	}
	ex, err := runtime.New(v.g, v.w, b, v.opt)
	if err != nil {
		return Figures{}, "", fmt.Errorf("%s: %w", v.name, err)
	}
	defer ex.Close()
	x := &runtime.HostTensor{Shape: []int{batch, 3, size, size}}
	if b.Executes() {
		x = runtime.NewHostTensor(batch, 3, size, size)
	}
	y, err := ex.Forward(x, true)
	if err != nil {
		return Figures{}, "", fmt.Errorf("%s: %w", v.name, err)
	}
	var dev *DeviceCheck
	if dm != nil {
		f, err := dm.DeviceMemory()
		if err != nil {
			return Figures{}, "", fmt.Errorf("%s: %w", v.name, err)
		}
		dev = &DeviceCheck{DeviceFigures: f}
	}
	// Every output gets a gradient: a training loss adds the auxiliary
	// heads' terms, so their backward runs (and holds memory) too.
	var dys []*runtime.HostTensor
	for _, o := range ex.Outputs() {
		dy := &runtime.HostTensor{Shape: o.Shape}
		if b.Executes() {
			dy = runtime.NewHostTensor(o.Shape...)
		}
		dys = append(dys, dy)
	}
	if len(dys) == 0 {
		dys = []*runtime.HostTensor{{Shape: y.Shape}}
	}
	if _, _, err := ex.BackwardAll(dys); err != nil {
		return Figures{}, "", fmt.Errorf("%s: %w", v.name, err)
	}
	m := ex.Memory()
	if dev != nil {
		end, err := dm.DeviceMemory()
		if err != nil {
			return Figures{}, "", fmt.Errorf("%s: %w", v.name, err)
		}
		f := &dev.DeviceFigures
		f.PeakReservedBytes = end.PeakReservedBytes
		dev.Consistent = f.DriverUsedBytes >= f.ReservedBytes && f.ReservedBytes >= f.LiveBytes &&
			f.PeakReservedBytes >= m.PeakBytes+m.ParamBytes
	}
	return Figures{SavedBytes: m.SavedBytes, PeakBytes: m.PeakBytes, ParamBytes: m.ParamBytes, Layers: m.Layers,
		Work: ex.Work(), Segments: len(ex.Segments()), Device: dev}, m.Backend, nil
}

// maxBatch finds the largest batch whose peak fits the budget: it measures
// two sizes, solves the (affine) peak for the budget, then measures around
// the estimate until it holds the exact boundary. Measuring, not trusting
// the line, keeps it right where the allocator's reuse is not affine.
func maxBatch(v variant, size int, budget int64, nb func() (runtime.Backend, error)) (int, error) {
	// What must fit is the parameters plus the step's peak (activations,
	// gradients).
	peak := func(b int) (int64, error) {
		f, _, err := measure(v, b, size, nb)
		return f.ParamBytes + f.PeakBytes, err
	}
	// Fit the line on batches 2 and 4: batch 1 cannot train networks
	// whose last feature map is 1x1 (one value per BN channel).
	p2, err := peak(2)
	if err != nil {
		return 0, err
	}
	if p2 > budget {
		p1, err := peak(1)
		if err != nil || p1 > budget {
			return 0, nil
		}
		return 1, nil
	}
	p4, err := peak(4)
	if err != nil {
		return 0, err
	}
	slope := (p4 - p2) / 2
	if slope <= 0 {
		return 0, fmt.Errorf("%s: peak does not grow with the batch (%d, %d bytes)", v.name, p2, p4)
	}
	est := 2 + int((budget-p2)/slope)
	// Walk to the boundary: lo fits, hi does not.
	lo, hi := 0, 0
	pe, err := peak(est)
	if err != nil {
		return 0, err
	}
	if pe <= budget {
		lo, hi = est, est+1
		for {
			ph, err := peak(hi)
			if err != nil {
				return 0, err
			}
			if ph > budget {
				break
			}
			lo, hi = hi, hi*2
		}
	} else {
		lo, hi = 2, est
	}
	for hi-lo > 1 {
		mid := (lo + hi) / 2
		pm, err := peak(mid)
		if err != nil {
			return 0, err
		}
		if pm <= budget {
			lo = mid
		} else {
			hi = mid
		}
	}
	return lo, nil
}
