// Package rewrite converts a graph's BatchNorm2d + activation pairs into the
// InPlace-ABN family (Rota Bulò et al. 2018) and marks DenseNet dense layers
// for shared-buffer recomputation.
//
// The conversion is a named pipeline of small passes, in the manner of Go's
// cmd/compile/internal/ssa pass list: each pass does one thing, passOrder
// declares which pass must run before which (and why), and the graph is
// validated after every pass so that a pass that breaks it fails where it
// broke it. Each rule inside a pass is split into a precondition, which says
// in words why it does not apply (that text ends up in the report), and an
// action.
//
// The maths the passes must preserve: InPlace-ABN scales by |weight| + eps,
// never by the weight as stored, so a plain BN's gamma maps to
// weight = |gamma| - eps once gamma's sign has been moved elsewhere: folded
// into the linear producer of the channel (fold-signs), or applied to the
// layer's private input in place (flip-signs). Where neither is possible the
// site falls back to ABN, which uses the weight as stored.
package rewrite

import (
	"errors"
	"fmt"
	"io"
	"math"
	"strings"

	"github.com/abnconvert/abnconvert/graph"
)

// ReLU policies: what a BatchNorm2d + ReLU site becomes. InPlace-ABN cannot
// run a plain ReLU (it is not invertible, so the input cannot be recovered
// from the output in the backward pass).
const (
	// ReLULeaky converts to InPlace-ABN with leaky_relu(Slope): in place,
	// but the network's outputs change.
	ReLULeaky = "leaky"
	// ReLUABN converts to ABN with relu: exact, not in place.
	ReLUABN = "abn"
	// ReLUError refuses to convert a BN + ReLU site.
	ReLUError = "error"
)

// Tiny-gamma policies: what an in-place site with channels whose
// |gamma| < eps becomes. InPlace-ABN scales by |weight| + eps, at least
// eps, so such a channel has no exact in-place form.
const (
	// TinyGammaExact makes the site ABN, which uses the weight as stored:
	// exact in eval and in training, not in place.
	TinyGammaExact = "exact"
	// TinyGammaApprox keeps the site in place and gives those channels
	// scale eps (weight 0): the outputs, and more so the training step,
	// change. Conversions before the policy existed all did this.
	TinyGammaApprox = "approx"
)

// DefaultSlope is the leaky-ReLU slope of every ImageNet model in the
// InPlace-ABN paper.
const DefaultSlope = 0.01

// Options steer the conversion.
type Options struct {
	// ReLU is the policy for BN + ReLU sites: ReLULeaky (the default when
	// empty), ReLUABN or ReLUError.
	ReLU string
	// Slope is the leaky-ReLU slope used under ReLULeaky; 0 means
	// DefaultSlope. It must be positive: slope 0 is a plain ReLU again.
	Slope float64
	// TinyGamma is the policy for in-place sites with |gamma| < eps
	// channels: TinyGammaExact (the default when empty) or TinyGammaApprox.
	TinyGamma string
	// Sync makes every in-place site InPlaceABNSync (statistics reduced
	// across torch.distributed ranks).
	Sync bool
	// DumpAfter names a pass after which g.String() is written to Dump.
	DumpAfter string
	Dump      io.Writer
	// SignsSettled, when set, is called once the store holds every
	// channel negation the conversion makes (graph.ChannelNegater): in
	// the last pass that makes any (signsSettledAfter), as soon as its
	// negations are stored and before the vectors it changed are written
	// (tensors.flushThen), and before the passes that follow it, which
	// change values and the graph only. A writer that copies the
	// producers' records can start then with their flips known (see
	// pth.Prewrite); the vectors' new values reach it later, as every
	// value changed after it starts does.
	SignsSettled func() error
}

func (o Options) normalised() (Options, error) {
	switch o.ReLU {
	case "":
		o.ReLU = ReLULeaky
	case ReLULeaky, ReLUABN, ReLUError:
	default:
		return o, fmt.Errorf("rewrite: unknown ReLU policy %q (want %q, %q or %q)", o.ReLU, ReLULeaky, ReLUABN, ReLUError)
	}
	switch o.TinyGamma {
	case "":
		o.TinyGamma = TinyGammaExact
	case TinyGammaExact, TinyGammaApprox:
	default:
		return o, fmt.Errorf("rewrite: unknown tiny-gamma policy %q (want %q or %q)", o.TinyGamma, TinyGammaExact, TinyGammaApprox)
	}
	if o.Slope == 0 {
		o.Slope = DefaultSlope
	}
	if !(o.Slope > 0) || math.IsInf(o.Slope, 0) {
		return o, fmt.Errorf("rewrite: leaky-ReLU slope %g: must be positive and finite (InPlace-ABN inverts the activation)", o.Slope)
	}
	if o.DumpAfter != "" {
		if o.Dump == nil {
			return o, fmt.Errorf("rewrite: dump after %q requested without a writer", o.DumpAfter)
		}
		if passIndex(o.DumpAfter) < 0 {
			return o, fmt.Errorf("rewrite: no pass named %q to dump after (passes: %s)", o.DumpAfter, strings.Join(PassNames(), ", "))
		}
	}
	return o, nil
}

// Pass is one step of the conversion.
type Pass struct {
	Name string
	// Does says what the pass does, for --help style listings.
	Does string
	Run  func(*State) error
}

// Pipeline is the conversion, in order. passOrder lists the constraints
// that order must satisfy; a test checks them.
var Pipeline = []Pass{
	{Name: "match-bn-act", Does: "find every BatchNorm2d and the activation it feeds (if any)", Run: matchBNAct},
	{Name: "choose-op", Does: "pick InPlaceABN/InPlaceABNSync/ABN and the activation for each site", Run: chooseOp},
	{Name: "check-inplace", Does: "fall back to ABN where the site's input may not be overwritten", Run: checkInPlace},
	{Name: "check-tiny-gamma", Does: "fall back to ABN where a channel's |gamma| < eps has no exact in-place form (--tiny-gamma exact)", Run: checkTinyGamma},
	{Name: "fold-signs", Does: "move negative gammas into the producing convolution's output channel", Run: foldSigns},
	{Name: "flip-signs", Does: "flip the remaining negative channels on the private input in place", Run: flipSigns},
	{Name: "reparametrise", Does: "store weight = |gamma| - eps for in-place sites", Run: reparametrise},
	{Name: "fuse", Does: "replace each BN and its activation by one ABN-family node", Run: fuse},
	{Name: "mark-dense", Does: "mark DenseNet concat -> ABN -> 1x1 conv groups for recomputation", Run: markDense},
	{Name: "add-residual", Does: "fuse the residual Add after an InPlaceABN(identity) into it, where that keeps one tensor fewer", Run: addResidual},
}

// constraint says that pass a must run before pass b.
type constraint struct {
	a, b string
	why  string
}

var passOrder = []constraint{
	{"match-bn-act", "choose-op", "the target op depends on the activation that follows the BN"},
	{"choose-op", "check-inplace", "only sites that chose an in-place op need the in-place precondition"},
	{"choose-op", "check-tiny-gamma", "only sites that chose an in-place op need |gamma| >= eps"},
	{"check-inplace", "check-tiny-gamma", "a site whose input may not be overwritten is ABN already, and its reason should say so"},
	{"check-tiny-gamma", "fold-signs", "a site that falls back keeps its gamma as stored and needs no sign moved; a fold needs every in-place reader of the channel to agree on the sign"},
	{"check-tiny-gamma", "reparametrise", "under --tiny-gamma exact no in-place site may reach reparametrise with |gamma| < eps, which it can only approximate"},
	{"check-inplace", "fold-signs", "a fold needs every in-place reader of the channel to agree on the sign; ABN readers accept either"},
	{"fold-signs", "flip-signs", "flipping is for the negative channels that folding could not take"},
	{"check-inplace", "flip-signs", "a flip is applied to the input in place, so it needs the in-place precondition"},
	{"flip-signs", "reparametrise", "|gamma| - eps is exact only once every negative gamma's sign is taken care of"},
	{"fold-signs", "reparametrise", "|gamma| - eps is exact only once every negative gamma's sign is taken care of"},
	{"flip-signs", "fuse", "a site's op is final only after flip-signs (it may still fall back to ABN)"},
	{"match-bn-act", "fuse", "fuse removes the activation node that match-bn-act found"},
	{"fuse", "mark-dense", "the dense-layer pattern concat -> ABN -> 1x1 conv exists only after fusion"},
	{"fuse", "add-residual", "the InPlaceABN that takes the residual exists only after fusion"},
	{"mark-dense", "add-residual", "a dense layer's ABN is recomputed and must not be fused with an Add"},
}

// PassNames lists the pipeline's pass names in order.
func PassNames() []string {
	names := make([]string, len(Pipeline))
	for i, p := range Pipeline {
		names[i] = p.Name
	}
	return names
}

func passIndex(name string) int {
	for i, p := range Pipeline {
		if p.Name == name {
			return i
		}
	}
	return -1
}

// State is a conversion in progress, handed from pass to pass.
type State struct {
	g      *graph.Graph
	w      graph.Weights
	opt    Options
	sites  []*site
	byNode map[*graph.Node]*site
	t      *tensors
	warn   []string
	dense  []string
}

// Run converts g in place, rewriting parameter values through w, and
// reports what it did. On error the graph and weights may be half converted.
func Run(g *graph.Graph, w graph.Weights, opt Options) (*Report, error) {
	return run(g, w, opt, nil)
}

// run is Run with a hook called after each pass has been validated, for
// tests that inspect the state between passes.
func run(g *graph.Graph, w graph.Weights, opt Options, after func(p Pass, st *State) error) (*Report, error) {
	st, err := newState(g, w, opt)
	if err != nil {
		return nil, err
	}
	for _, p := range Pipeline {
		var settled func() error
		if p.Name == signsSettledAfter {
			settled = opt.SignsSettled
		}
		if err := st.runPass(p, settled); err != nil {
			return nil, err
		}
		if after != nil {
			if err := after(p, st); err != nil {
				return nil, err
			}
		}
	}
	return st.report(), nil
}

func newState(g *graph.Graph, w graph.Weights, opt Options) (*State, error) {
	if g == nil || w == nil {
		return nil, errors.New("rewrite: nil graph or weights")
	}
	opt, err := opt.normalised()
	if err != nil {
		return nil, err
	}
	if err := g.Validate(); err != nil {
		return nil, fmt.Errorf("rewrite: input graph: %w", err)
	}
	return &State{g: g, w: w, opt: opt, byNode: map[*graph.Node]*site{}, t: newTensors(w)}, nil
}

// signsSettledAfter is the last pass that negates channels of stored
// tensors (fold-signs, through tensors.sliceNegation); flip-signs and the
// passes after it change only per-channel vectors, which are rewritten
// whole, and the graph. TestSignsSettled holds the pipeline to it.
const signsSettledAfter = "fold-signs"

// checkEachPass validates the graph after every pass, as the compiler's
// SSA checker runs between passes when asked: this package's tests set
// it, so that a pass that breaks the graph is named at once. A conversion
// validates the graph it is given and the one the last pass leaves (and
// any it dumps): the eight checks between cost 2 ms of a DenseNet's 15 ms
// of rewriting, and the graph is checked before anything is written.
var checkEachPass = false

// runPass runs one pass, writes what it changed to the store (the cache only
// lives for one pass, so the store is consistent between passes), validates
// the graph and dumps it if asked. settled, when not nil, is called once
// the pass's channel negations are in the store (tensors.flushThen).
func (st *State) runPass(p Pass, settled func() error) error {
	if err := p.Run(st); err != nil {
		return fmt.Errorf("rewrite: pass %s: %w", p.Name, err)
	}
	if err := st.t.flushThen(settled); err != nil {
		return fmt.Errorf("rewrite: pass %s: %w", p.Name, err)
	}
	if checkEachPass || st.opt.DumpAfter == p.Name || p.Name == Pipeline[len(Pipeline)-1].Name {
		if err := st.g.Validate(); err != nil {
			return fmt.Errorf("rewrite: after pass %s: %w", p.Name, err)
		}
	}
	if st.opt.DumpAfter == p.Name {
		if _, err := io.WriteString(st.opt.Dump, st.g.String()); err != nil {
			return fmt.Errorf("rewrite: dumping after %s: %w", p.Name, err)
		}
	}
	return nil
}
