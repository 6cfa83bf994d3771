package rewrite

import (
	"fmt"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

// densenet121 builds torchvision's DenseNet-121 topology (growth 32,
// bn_size 4, blocks 6/12/24/16, about 8M parameters) with random weights
// and about a fifth of all gammas negative: the largest concat fan-out the
// sign passes meet in the networks the tool targets.
func densenet121(seed uint64) *net {
	b := newNet(3, 8, seed)
	gammas := func(c int) []float64 {
		g := make([]float64, c)
		for i := range g {
			g[i] = 0.3 + 0.5*b.rng.Float64()
			if b.rng.Float64() < 0.2 {
				g[i] = -g[i]
			}
		}
		return g
	}
	norm := func(name string, x *graph.Value) *graph.Value {
		return b.relu(name+"_relu", b.bn(name, x, gammas(channels(x))...))
	}
	x := b.conv("features.conv0", b.g.Input, 64, 7, 2, false)
	x = b.maxpool("features.pool0", norm("features.norm0", x))
	for bi, layers := range []int{6, 12, 24, 16} {
		feats := []*graph.Value{x}
		for l := 1; l <= layers; l++ {
			p := fmt.Sprintf("features.denseblock%d.denselayer%d.", bi+1, l)
			y := norm(p+"norm1", b.cat(p+"cat", feats...))
			y = norm(p+"norm2", b.conv(p+"conv1", y, 128, 1, 1, false))
			feats = append(feats, b.conv(p+"conv2", y, 32, 3, 1, false))
		}
		x = b.cat(fmt.Sprintf("features.denseblock%d.cat", bi+1), feats...)
		if bi < 3 {
			p := fmt.Sprintf("features.transition%d.", bi+1)
			y := norm(p+"norm", x)
			x = b.avgpool(p+"pool", b.conv(p+"conv", y, channels(x)/2, 1, 1, false))
		}
	}
	norm("features.norm5", x)
	return b
}

func BenchmarkRunDenseNet121(b *testing.B) {
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		n := densenet121(1)
		b.StartTimer()
		rep, err := Run(n.g, n.w, Options{})
		if err != nil {
			b.Fatal(err)
		}
		if i == 0 {
			s := rep.Summary
			b.Logf("%d sites, %d dense layers; sites with folds/flips: %d/%d; %d keys changed", s.Sites, s.DenseLayersMarked, countFolded(rep), countFlipped(rep), len(rep.Changed))
		}
	}
}

func countFolded(r *Report) (n int) {
	for _, s := range r.Sites {
		if len(s.FoldedChannels) > 0 {
			n++
		}
	}
	return n
}

func countFlipped(r *Report) (n int) {
	for _, s := range r.Sites {
		if len(s.FlippedChannels) > 0 {
			n++
		}
	}
	return n
}

// TestDenseNet121Exact converts the full DenseNet-121 topology, with
// leaky-ReLU activations so that every site can be exact in place, and
// checks the outputs against the source network's: hundreds of concat
// channels read by up to 24 norms each, folded or flipped.
func TestDenseNet121Exact(t *testing.T) {
	if testing.Short() {
		t.Skip("about a second of evaluation")
	}
	b := densenet121(2)
	b.h = 32
	for _, n := range b.g.Nodes {
		if n.Op == graph.OpReLU {
			n.Op, n.Attr.ActParam = graph.OpLeakyReLU, 0.01
		}
	}
	x := b.input(1)
	before, err := evaluate(b.g, b.w, x)
	if err != nil {
		t.Fatal(err)
	}
	orig, shapes := snapshot(t, b.w), shapesOf(b.w)
	rep, err := Run(b.g, b.w, Options{})
	if err != nil {
		t.Fatal(err)
	}
	checkBookkeeping(t, orig, shapes, b.w, rep)
	after, err := evaluate(b.g, b.w, x)
	if err != nil {
		t.Fatal(err)
	}
	scale := 0.0
	for _, v := range before.data {
		scale = max(scale, v, -v)
	}
	if d := maxAbsDiff(before, after); d > exact*max(1, scale) {
		t.Fatalf("outputs differ by %g (scale %g)", d, scale)
	}
	s := rep.Summary
	if s.Sites != 121 || s.DenseLayersMarked != 61 || s.Approximated+s.FallbackABN != 0 || s.SignFolded == 0 || s.SignFlipped == 0 {
		t.Fatalf("summary %+v", s)
	}
	t.Logf("summary %+v, output scale %g", s, scale)
}
