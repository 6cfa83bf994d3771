package rewrite

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

// net builds small graphs with random weights for the tests.
type net struct {
	g   *graph.Graph
	w   *graph.MemWeights
	rng *rand.Rand
	h   int // input height and width
	// last is the latest input made by input(), so that a test can
	// evaluate another network on it.
	last *tensor
}

func newNet(inChannels, size int, seed uint64) *net {
	return &net{g: graph.New("test", inChannels), w: graph.NewMemWeights(), rng: rand.New(rand.NewPCG(seed, 7)), h: size}
}

func (b *net) randn(n int, scale float64) []float64 {
	v := make([]float64, n)
	for i := range v {
		v[i] = b.rng.NormFloat64() * scale
	}
	return v
}

func (b *net) conv(name string, in *graph.Value, out, k, stride int, bias bool) *graph.Value {
	c := channels(in)
	params := map[string]string{graph.RoleWeight: name + ".weight"}
	b.w.Put(name+".weight", []int{out, c, k, k}, b.randn(out*c*k*k, 1/math.Sqrt(float64(c*k*k))))
	if bias {
		params[graph.RoleBias] = name + ".bias"
		b.w.Put(name+".bias", []int{out}, b.randn(out, 0.5))
	}
	v := b.g.Add(name, graph.OpConv, graph.Attr{
		KernelSize: [2]int{k, k}, Stride: [2]int{stride, stride}, Padding: [2]int{k / 2, k / 2},
		Dilation: [2]int{1, 1}, Groups: 1, InChannels: c, OutChannels: out, Bias: bias,
	}, params, in)
	v.Channels = out
	return v
}

// bn adds a BatchNorm2d with the given gammas and random beta and running
// statistics (variance in [0.5, 2]).
func (b *net) bn(name string, in *graph.Value, gamma ...float64) *graph.Value {
	c := len(gamma)
	b.w.Put(name+".weight", []int{c}, gamma)
	b.w.Put(name+".bias", []int{c}, b.randn(c, 0.3))
	b.w.Put(name+".running_mean", []int{c}, b.randn(c, 0.5))
	rv := make([]float64, c)
	for i := range rv {
		rv[i] = 0.5 + 1.5*b.rng.Float64()
	}
	b.w.Put(name+".running_var", []int{c}, rv)
	b.w.Put(name+".num_batches_tracked", nil, []float64{1000})
	v := b.g.Add(name, graph.OpBatchNorm, graph.Attr{Features: c, Eps: 1e-5, Momentum: 0.1}, map[string]string{
		graph.RoleWeight: name + ".weight", graph.RoleBias: name + ".bias",
		graph.RoleRunningMean: name + ".running_mean", graph.RoleRunningVar: name + ".running_var",
		graph.RoleNumBatches: name + ".num_batches_tracked",
	}, in)
	v.Channels = c
	return v
}

func (b *net) act(name string, op graph.Op, param float64, in *graph.Value) *graph.Value {
	v := b.g.Add(name, op, graph.Attr{ActParam: param}, nil, in)
	v.Channels = channels(in)
	return v
}

func (b *net) relu(name string, in *graph.Value) *graph.Value {
	return b.act(name, graph.OpReLU, 0, in)
}

func (b *net) op(name string, op graph.Op, attr graph.Attr, in ...*graph.Value) *graph.Value {
	v := b.g.Add(name, op, attr, nil, in...)
	v.Channels = channels(v)
	return v
}

func (b *net) cat(name string, in ...*graph.Value) *graph.Value {
	return b.op(name, graph.OpConcat, graph.Attr{Axis: 1}, in...)
}

func (b *net) maxpool(name string, in *graph.Value) *graph.Value {
	return b.op(name, graph.OpMaxPool, graph.Attr{KernelSize: [2]int{3, 3}, Stride: [2]int{2, 2}, Padding: [2]int{1, 1}, Dilation: [2]int{1, 1}}, in)
}

func (b *net) avgpool(name string, in *graph.Value) *graph.Value {
	return b.op(name, graph.OpAvgPool, graph.Attr{KernelSize: [2]int{2, 2}, Stride: [2]int{2, 2}, CountIncludePad: true}, in)
}

func (b *net) input(batch int) *tensor {
	x := newTensor(batch, b.g.Input.Channels, b.h, b.h)
	copy(x.data, b.randn(len(x.data), 1))
	b.last = &tensor{shape: x.shape, data: append([]float64(nil), x.data...)}
	return x
}

// snapshot copies every tensor of a store.
func snapshot(t *testing.T, w graph.Weights) map[string][]float64 {
	t.Helper()
	out := map[string][]float64{}
	for _, k := range w.Keys() {
		v, err := w.Values(k)
		if err != nil {
			t.Fatal(err)
		}
		out[k] = v
	}
	return out
}

// checkBookkeeping checks the report's Changed and Flips against the
// weights themselves: Changed lists exactly the keys whose values differ,
// every flipped index of a running mean or producer weight is negated and
// every other index is unchanged, running variances and batch counts never
// change, and no key or shape appears or disappears.
func checkBookkeeping(t *testing.T, before map[string][]float64, shapes map[string][]int, w graph.Weights, rep *Report) {
	t.Helper()
	after := snapshot(t, w)
	if len(after) != len(before) {
		t.Fatalf("key count changed: %d -> %d", len(before), len(after))
	}
	var changed []string
	for k, old := range before {
		now, ok := after[k]
		if !ok {
			t.Fatalf("key %q disappeared", k)
		}
		s, _ := w.Shape(k)
		if !slices.Equal(s, shapes[k]) {
			t.Errorf("%q: shape %v -> %v", k, shapes[k], s)
		}
		if differ(old, now) {
			changed = append(changed, k)
		}
		role := k[lastDot(k)+1:]
		flips := rep.Flips[k]
		switch role {
		case graph.RoleRunningVar, graph.RoleNumBatches:
			if differ(old, now) {
				t.Errorf("%q changed", k)
			}
		case graph.RoleRunningMean, graph.RoleWeight, graph.RoleBias:
			if role == graph.RoleWeight && len(shapes[k]) == 1 {
				// A BN weight: reparametrised at in-place sites, checked by
				// the numeric tests; its sign follows the flips.
				continue
			}
			stride := len(old) / max(shapes[k][0], 1)
			for c := 0; c < shapes[k][0]; c++ {
				want := 1.0
				if slices.Contains(flips, c) {
					want = -1
				}
				for j := c * stride; j < (c+1)*stride; j++ {
					if now[j] != want*old[j] {
						t.Errorf("%q[%d]: %g -> %g, flipped=%v", k, j, old[j], now[j], want < 0)
						break
					}
				}
			}
		}
	}
	slices.Sort(changed)
	if !slices.Equal(changed, rep.Changed) {
		t.Errorf("Changed = %v, but these keys differ: %v", rep.Changed, changed)
	}
}

func shapesOf(w graph.Weights) map[string][]int {
	out := map[string][]int{}
	for _, k := range w.Keys() {
		s, _ := w.Shape(k)
		out[k] = s
	}
	return out
}

func lastDot(s string) int {
	for i := len(s) - 1; i >= 0; i-- {
		if s[i] == '.' {
			return i
		}
	}
	return -1
}

// convert runs the whole pipeline, validating after every pass, and checks
// the bookkeeping. It returns the report and the outputs before and after on
// the same random input.
func convert(t *testing.T, b *net, opt Options) (*Report, *tensor, *tensor) {
	t.Helper()
	x := b.input(2)
	before, err := evaluate(b.g, b.w, x)
	if err != nil {
		t.Fatalf("evaluating the source network: %v", err)
	}
	orig, shapes := snapshot(t, b.w), shapesOf(b.w)
	rep, err := run(b.g, b.w, opt, func(p Pass, st *State) error {
		// run validates too; this is the harness's own check.
		if err := st.g.Validate(); err != nil {
			t.Fatalf("after %s: %v", p.Name, err)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	checkBookkeeping(t, orig, shapes, b.w, rep)
	after, err := evaluate(b.g, b.w, x)
	if err != nil {
		t.Fatalf("evaluating the converted network: %v\n%s", err, b.g)
	}
	return rep, before, after
}

func siteOf(t *testing.T, rep *Report, node string) Site {
	t.Helper()
	for _, s := range rep.Sites {
		if s.Node == node {
			return s
		}
	}
	t.Fatalf("no site %q in the report", node)
	return Site{}
}
