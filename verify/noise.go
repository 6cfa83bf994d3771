package verify

import (
	"fmt"
	"math"
	"math/rand/v2"
	goruntime "runtime"
	"sort"
	"sync"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/runtime"
)

// How verify tells a difference from rounding. Each compared quantity gets
// its own limit: TrainFactor times its noise, the largest difference among
// the reference and noiseDraws copies of it whose input and weights moved
// by one rounding (by backward error analysis a float32 computation is the
// exact one on data moved by a few roundings, so this is the size of the
// reference's own float32 error for that quantity). Pairs of perturbed
// copies count too: one draw can be lucky on a sum whose terms nearly
// cancel (a BN bias gradient under a training-mode BN), two rarely both
// are. A quantity over its limit is judged again against more copies
// (MaxNoiseDraws) before it fails. A quantity whose limit reaches 1, which
// a result of zero would pass, cannot tell a right result from a wrong one
// and is skipped, as is one whose true value is zero.

// noiseDraws is how many perturbed copies of the reference run.
const noiseDraws = 2

// roundoff is float32's unit roundoff, 2^-24: the runtime computes in
// float32, so no noise is smaller than this.
const roundoff = 0x1p-24

// sample is one network's run: eval output, one training step on the same
// input, eval output again.
type sample struct {
	eval  []float32
	t     *step
	after []float32
}

// runSample runs n as verify runs the reference and the converted network
// (without g, eval only).
func runSample(n *network, x, g *runtime.HostTensor) (*sample, error) {
	y, err := n.forward(x, false)
	if err != nil {
		return nil, err
	}
	if g == nil {
		return &sample{eval: y.Data}, nil
	}
	t, err := trainStep(n, x, g)
	if err != nil {
		return nil, err
	}
	y2, err := n.forward(x, false)
	if err != nil {
		return nil, err
	}
	return &sample{eval: y.Data, t: t, after: y2.Data}, nil
}

// noise holds the reference's run and its perturbed copies', and how to
// run one more copy.
type noise struct {
	ref   *sample
	draws []*sample
	draw  func(d uint64) (*sample, error)
}

// measureNoise runs noiseDraws copies of the reference (graph g over
// weights w), each with its input and weights moved by one rounding; with
// output gradient gy nil, eval only.
func measureNoise(ref *sample, g *graph.Graph, w graph.Weights, x, gy *runtime.HostTensor,
	seed uint64, mk func(*graph.Graph, graph.Weights, string) (*network, error)) (*noise, error) {
	nz := &noise{ref: ref, draw: func(d uint64) (*sample, error) {
		pw, px := RoundingMoved(g, w, x, seed, d)
		n, err := mk(g, pw, "reference")
		if err != nil {
			return nil, err
		}
		defer n.ex.Close()
		s, err := runSample(n, px, gy)
		if err != nil {
			return nil, fmt.Errorf("reference: %w", err)
		}
		return s, nil
	}}
	for d := uint64(0); d < noiseDraws; d++ {
		s, err := nz.draw(d)
		if err != nil {
			return nil, err
		}
		nz.draws = append(nz.draws, s)
	}
	return nz, nil
}

// MaxNoiseDraws bounds the copies run when checks fail on the first
// noiseDraws. A float32 rounding can flip a ReLU mask or a max-pool's
// argmax where a value sits within a rounding of the switch; the flip
// moves every gradient upstream of it by a step that rounding's smooth
// effect is far below (on resnet50 at batch 2, 64x64: 1-3% against 1e-4).
// The converted network's arithmetic moves values near a switch further
// than one rounding of input and weights does (each output is a sum of
// many rounded terms), so it flips where the first copies do not: a check
// that fails is judged again against more copies, whose convolution and
// linear weights move as far as that arithmetic does (perturbedWeights.fan),
// and fails only if none of them moves that far. A real error (a wrong
// gradient formula, a wrong running update) is systematic and fails
// against every copy.
const MaxNoiseDraws = 10

// quantity is one training-mode comparison: the converted network's
// values, the reference's (pick on a run), the mapping between them, and
// why its true value is zero if it is; fixed is a check judged otherwise.
type quantity struct {
	name  string
	got   []float32
	mult  []float64
	zero  string
	pick  func(*sample) []float32
	fixed *Check
}

// judge checks each quantity against its noise, running more copies of
// the reference (up to MaxNoiseDraws) while any fails.
func (nz *noise) judge(opt Options, qs []quantity) ([]Check, error) {
	checks := make([]Check, len(qs))
	var failing []int
	for i, q := range qs {
		if q.fixed != nil {
			checks[i] = *q.fixed
			continue
		}
		checks[i] = trainCheck(opt, q.name, q.got, q.pick(nz.ref), q.mult, nz.l2(q.pick, q.mult), q.zero)
		if c := checks[i]; !c.Pass && !c.Skipped && c.Note == "" {
			failing = append(failing, i)
		}
	}
	if len(failing) == 0 {
		return checks, nil
	}
	// Keep only the failing quantities of the extra copies.
	kept := map[int][][]float32{}
	for _, i := range failing {
		for _, s := range append([]*sample{nz.ref}, nz.draws...) {
			kept[i] = append(kept[i], qs[i].pick(s))
		}
	}
	runs := uint64(len(nz.draws))
	for d := runs; d < MaxNoiseDraws && len(failing) > 0; d++ {
		opt.progress("%d check(s) over their limits (first: %s): one more copy of the reference, to see whether its own rounding moves them that far", len(failing), qs[failing[0]].name)
		s, err := nz.draw(d)
		if err != nil {
			return nil, err
		}
		runs++
		var still []int
		for _, i := range failing {
			q := qs[i]
			v := q.pick(s)
			n := checks[i].Noise
			for _, w := range kept[i] {
				n = math.Max(n, relL2(v, w, kept[i][0], q.mult))
			}
			kept[i] = append(kept[i], v)
			checks[i] = trainCheck(opt, q.name, q.got, kept[i][0], q.mult, n, q.zero)
			checks[i].Note = fmt.Sprintf("noise from %d copies of the reference", runs)
			if !checks[i].Pass && !checks[i].Skipped {
				still = append(still, i)
			}
		}
		failing = still
	}
	return checks, nil
}

// l2 is the noise of one quantity in the "l2" metric: the largest norm of
// a difference between two of the runs over the reference's norm. mask,
// when given, leaves out the elements where it is 0.
func (nz *noise) l2(pick func(*sample) []float32, mask []float64) float64 {
	runs := append([]*sample{nz.ref}, nz.draws...)
	worst := 0.0
	for a := range runs {
		for b := a + 1; b < len(runs); b++ {
			worst = math.Max(worst, relL2(pick(runs[a]), pick(runs[b]), pick(nz.ref), mask))
		}
	}
	return worst
}

// relL2 is |a - b| / |ref| over the elements where mask is not 0.
func relL2(a, b, ref []float32, mask []float64) float64 {
	if len(a) != len(ref) || len(b) != len(ref) {
		return math.Inf(1)
	}
	var dd, ww float64
	for i := range ref {
		if mask == nil || mask[i] != 0 {
			d := float64(a[i]) - float64(b[i])
			dd += d * d
			ww += float64(ref[i]) * float64(ref[i])
		}
	}
	return relOf(dd, ww)
}

// max is the noise in the "max" metric: the largest element difference
// between two of the runs over the reference's largest magnitude.
func (nz *noise) max(pick func(*sample) []float32) float64 {
	runs := append([]*sample{nz.ref}, nz.draws...)
	scale := maxAbs(pick(nz.ref))
	worst := 0.0
	for a := range runs {
		for b := a + 1; b < len(runs); b++ {
			va, vb := pick(runs[a]), pick(runs[b])
			if len(va) != len(vb) {
				return math.Inf(1)
			}
			d := 0.0
			for i := range va {
				d = math.Max(d, math.Abs(float64(va[i])-float64(vb[i])))
			}
			if scale > 0 {
				worst = math.Max(worst, d/scale)
			} else if d > 0 {
				worst = math.Inf(1)
			}
		}
	}
	return worst
}

// relOf is sqrt(dd/ww), infinite when only the reference is zero.
func relOf(dd, ww float64) float64 {
	switch {
	case math.IsNaN(dd) || math.IsNaN(ww):
		return math.Inf(1)
	case ww > 0:
		return math.Sqrt(dd / ww)
	case dd > 0:
		return math.Inf(1)
	}
	return 0
}

// trainCheck judges one training-mode quantity in norm against its own
// noise: limit TrainFactor*max(noise, roundoff). zero, when not empty, says
// why the true value is zero, and skips the check.
func trainCheck(opt Options, name string, got, want []float32, mult []float64, noise float64, zero string) Check {
	c := compareL2(name, got, want, mult, 0)
	c.Noise = noise
	c.Limit = opt.TrainFactor * math.Max(noise, roundoff)
	c.Pass = false
	switch {
	case len(got) != len(want):
		return c
	case !finite(got):
		c.Note = "non-finite values"
		return c
	case zero != "":
		return c.skip(zero)
	case c.Scale == 0:
		return c.skip("the reference is exactly zero: a difference of scale cannot show")
	case c.Limit >= 1:
		return c.skip(fmt.Sprintf("below its float32 noise: one rounding of input and weights moves the reference by %.2g of its norm, so the limit (%.2g) would pass a zero result", noise, c.Limit))
	}
	c.Pass = c.Rel <= c.Limit
	return c
}

// evalCheck judges an eval output: within Rtol of the reference's largest
// magnitude, plus Atol. Its noise is reported, not used: --rtol is the
// user's tolerance.
func evalCheck(opt Options, name string, got, want []float32, noise float64) Check {
	c := compare(name, got, want, nil, evalLimit(opt, want))
	c.Noise = noise
	if !finite(got) {
		c.Pass, c.Note = false, "non-finite values"
	}
	return c
}

func (c Check) skip(reason string) Check {
	c.Pass, c.Skipped, c.Reason = false, true, reason
	return c
}

func finite(v []float32) bool {
	for _, x := range v {
		if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) {
			return false
		}
	}
	return true
}

// zeroGradients names the parameters whose true gradient in a training
// step is zero, with the reason: the bias of a convolution or linear layer
// read only by training-mode normalisations, which subtract each channel's
// batch mean and with it any constant added to the channel. Their computed
// gradients are rounding noise on both sides, about 100% apart.
func zeroGradients(g *graph.Graph) map[string]string {
	out := map[string]string{}
	for _, nd := range g.Nodes {
		key := nd.Params[graph.RoleBias]
		if (nd.Op != graph.OpConv && nd.Op != graph.OpLinear) || key == "" || nd.Out == nil || g.IsOutput(nd.Out) || len(nd.Out.Consumers) == 0 {
			continue
		}
		all := true
		for _, c := range nd.Out.Consumers {
			all = all && c.Op.IsBNFamily()
		}
		if all {
			out[key] = fmt.Sprintf("true value zero: %s's bias feeds the training-mode %s, which subtracts each channel's batch mean", nd.Name, nd.Out.Consumers[0].Name)
		}
	}
	return out
}

// graphOrder numbers the floating-point parameters by where they are first
// read in graph order: the perturbation of a tensor is drawn from its
// number, so that it does not depend on what the keys are called (a
// `module.` prefix, a Lightning `model.` one).
func graphOrder(g *graph.Graph) map[string]uint64 {
	out := map[string]uint64{}
	for _, nd := range g.Nodes {
		roles := make([]string, 0, len(nd.Params))
		for r := range nd.Params {
			if r != graph.RoleNumBatches {
				roles = append(roles, r)
			}
		}
		sort.Strings(roles)
		for _, r := range roles {
			k := nd.Params[r]
			if _, ok := out[k]; !ok && k != "" {
				out[k] = uint64(len(out))
			}
		}
	}
	return out
}

// perturbedWeights moves every floating-point parameter to a neighbouring
// float32 (up or down at random: the runtime computes in float32, so a
// smaller move would round away), drawn from the seed, the draw and the
// tensor's position in graph order.
type perturbedWeights struct {
	graph.Weights
	order      map[string]uint64
	seed, draw uint64
	// fan, when set, spreads a convolution's or linear layer's weights by
	// up to sqrt(fan-in) roundings instead: a dot product of K terms is
	// the exact one on weights moved by about sqrt(K) roundings (backward
	// error analysis), which is how far the converted network's own
	// arithmetic moves its results, ReLU masks that flip included.
	fan map[string]float64
}

func (p perturbedWeights) Values(key string) ([]float64, error) {
	if _, ok := p.order[key]; !ok {
		// Not a parameter (a BatchNorm's num_batches_tracked): as it is,
		// not rounded to float32.
		return p.Weights.Values(key)
	}
	v, err := p.Float32Values(key)
	if err != nil {
		return nil, err
	}
	out := make([]float64, len(v))
	for i, x := range v {
		out[i] = float64(x)
	}
	return out, nil
}

// Float32Values is Values as float32 (graph.Float32Valuer): the runtime
// loads the copies' parameters through it, without a float64 copy.
func (p perturbedWeights) Float32Values(key string) ([]float32, error) {
	v, err := graph.Float32Values(p.Weights, key)
	pos, ok := p.order[key]
	if err != nil || !ok {
		return v, err
	}
	spread := math.Sqrt(p.fan[key])
	chunks := (len(v) + perturbChunk - 1) / perturbChunk
	workers := min(goruntime.GOMAXPROCS(0), chunks)
	if len(v) < 1<<16 {
		workers = 1
	}
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for c := w; c < chunks; c += workers {
				lo := c * perturbChunk
				p.moveChunk(v[lo:min(lo+perturbChunk, len(v))], pos, uint64(c), spread)
			}
		}()
	}
	wg.Wait()
	return v, nil
}

// perturbChunk is how many elements share one random stream. A tensor's
// chunks are moved in parallel (the noise copies' weights were moved on
// one thread, an element at a time: a fifth of a resnet50 verify, a
// quarter of vgg16_bn's), and the draws depend on the seed, the draw, the
// tensor and the chunk only, not on how many threads move them.
const perturbChunk = 1 << 14

// moveChunk moves the elements of chunk c of tensor pos: by up to spread
// roundings when spread > 1, else (or where that moved nothing) to a
// neighbouring float32, up or down by one random bit each.
func (p perturbedWeights) moveChunk(v []float32, pos, c uint64, spread float64) {
	r := rand.New(rand.NewPCG(p.seed^c*0x9e3779b97f4a7c15, 0xf10a7<<40^p.draw<<32^pos))
	var bits uint64
	left := 0
	for i, x := range v {
		y := x
		if spread > 1 {
			y = float32(float64(x) * (1 + (2*r.Float64()-1)*spread*roundoff))
		}
		if y == x {
			if left == 0 {
				bits, left = r.Uint64(), 64
			}
			y = nextFloat32(y, bits&1 == 0)
			bits >>= 1
			left--
		}
		v[i] = y
	}
}

// nextFloat32 is math.Nextafter32(x, +Inf) when up, else toward -Inf,
// without its float64 comparisons and Copysign.
func nextFloat32(x float32, up bool) float32 {
	b := math.Float32bits(x)
	switch {
	case x != x: // NaN
		return x
	case b&0x7fffffff == 0: // ±0
		if up {
			return math.Float32frombits(1)
		}
		return math.Float32frombits(0x80000001)
	case b&0x7fffffff == 0x7f800000 && (x > 0) == up: // ±Inf away from zero
		return x
	case (x > 0) == up:
		return math.Float32frombits(b + 1)
	default:
		return math.Float32frombits(b - 1)
	}
}

// fanIn is the number of terms each output of a convolution or linear
// layer sums, per weight key.
func fanIn(g *graph.Graph, w graph.Weights) map[string]float64 {
	out := map[string]float64{}
	for _, nd := range g.Nodes {
		k := nd.Params[graph.RoleWeight]
		if (nd.Op != graph.OpConv && nd.Op != graph.OpLinear) || k == "" {
			continue
		}
		if shape, ok := w.Shape(k); ok && len(shape) >= 2 && shape[0] > 0 {
			out[k] = float64(graph.Numel(shape) / shape[0])
		}
	}
	return out
}

// neighbour is a float32 next to x, above or below at random.
func neighbour(x float32, r *rand.Rand) float32 {
	if r.IntN(2) == 0 {
		return math.Nextafter32(x, float32(math.Inf(1)))
	}
	return math.Nextafter32(x, float32(math.Inf(-1)))
}

// perturb moves every element of x to a neighbouring float32, for draw d.
func perturb(x *runtime.HostTensor, seed, d uint64) *runtime.HostTensor {
	r := rand.New(rand.NewPCG(seed, 0x0e77+d<<32))
	y := &runtime.HostTensor{Shape: x.Shape, Data: make([]float32, len(x.Data))}
	for i, v := range x.Data {
		y.Data[i] = neighbour(v, r)
	}
	return y
}

// RoundingMoved returns the d-th of verify's perturbed copies of a
// network's weights w (graph g) and input x: every value moved by one
// rounding, and from the noiseDraws-th copy on a convolution's or linear
// layer's weights by up to sqrt(fan-in) roundings (perturbedWeights).
// measureNoise runs these; exported so that another comparison, the CUDA
// backend's results against the CPU backend's, is judged against the same
// float32 noise.
func RoundingMoved(g *graph.Graph, w graph.Weights, x *runtime.HostTensor, seed, d uint64) (graph.Weights, *runtime.HostTensor) {
	pw := perturbedWeights{Weights: w, order: graphOrder(g), seed: seed, draw: d}
	if d >= noiseDraws {
		pw.fan = fanIn(g, w)
	}
	return pw, perturb(x, seed, d)
}
