package verify

import (
	"strings"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/rewrite"
	"github.com/abnconvert/abnconvert/runtime"
)

// The declared approximations (--relu leaky, --tiny-gamma approx) are
// compared exactly against a reference that makes them too; how far they
// move the network from the original is drift. Eval drift alone hid what
// users measured: a smp Unet with 1% of its gammas at 1e-7 drifted 5e-7 in
// eval while its training step moved 1.5e-3 (outputs) and 0.12 (input
// gradient), since a channel at scale eps instead of 1e-7 is nearly dead
// in eval but its batch statistics are normalised afresh in training.

// TrainDrift is the drift of one training step: the converted network's
// against the original's, from the same input, output gradient and seed.
type TrainDrift struct {
	Output        Figure `json:"output"`
	InputGradient Figure `json:"input_gradient"`
	// RunningStats is the running statistic (running_mean, running_var)
	// that moved most, relative to its own largest magnitude, after the
	// step; nil where the two networks' statistics are not named alike
	// (an ONNX conversion).
	RunningStats *Figure `json:"running_stats,omitempty"`
}

// Figure is one quantity's difference from the original: MaxAbs, Rel
// (MaxAbs over the original's largest magnitude, as eval drift measures)
// and L2 (the norm of the difference over the original's norm, the
// training checks' metric). Name is the tensor, where there are several.
type Figure struct {
	Name   string  `json:"name,omitempty"`
	MaxAbs float64 `json:"max_abs"`
	Rel    float64 `json:"rel"`
	L2     float64 `json:"l2"`
}

func figure(name string, got, want []float32, mult []float64) Figure {
	c := compare(name, got, want, mult, 0)
	l2 := compareL2(name, got, want, mult, 0)
	return Figure{Name: name, MaxAbs: c.MaxAbs, Rel: c.Rel, L2: l2.Rel}
}

// originalStep is the original network's training step, for the drift:
// what trainStep gives, without the parameter gradients, which nothing
// compares and which would stay in memory until the converted network's
// step is run.
func originalStep(o *network, x, g *runtime.HostTensor) (*step, error) {
	t, err := trainStep(o, x, g)
	if err != nil {
		return nil, err
	}
	t.grads = nil
	return t, nil
}

// trainDrift compares the converted network's training step with the
// original's. mult maps a running statistic of the original into the
// converted parametrisation (a running_mean's flipped channels negated);
// nil for no running statistics.
func trainDrift(conv, orig *step, mult func(key string) []float64) *TrainDrift {
	d := &TrainDrift{
		Output:        figure("", conv.y.Data, orig.y.Data, nil),
		InputGradient: figure("", conv.dx.Data, orig.dx.Data, nil),
	}
	if mult == nil {
		return d
	}
	for _, k := range sortedKeys(orig.stats) {
		if strings.HasSuffix(k, graph.RoleNumBatches) {
			continue
		}
		got, ok := conv.stats[k]
		if !ok {
			continue
		}
		var m []float64
		if strings.HasSuffix(k, graph.RoleRunningMean) {
			m = mult(k)
		}
		f := figure(k, got, orig.stats[k], m)
		if d.RunningStats == nil || f.Rel > d.RunningStats.Rel {
			d.RunningStats = &f
		}
	}
	return d
}

// rewriteOptions are the conversion's flags, as the rewrite takes them.
func (o *Options) rewriteOptions() rewrite.Options {
	return rewrite.Options{ReLU: o.ReLU, Slope: o.Slope, TinyGamma: o.TinyGamma, Sync: o.Sync}
}
