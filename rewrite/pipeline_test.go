package rewrite

import (
	"bytes"
	"encoding/json"
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

const exact = 1e-9

// mixed are gammas of both signs, all well above eps.
var mixed = []float64{0.8, -0.5, 1.3, -1.1, 0.4, -0.7}

// convBNAct: input -> conv -> bn -> activation -> conv (so the site's output
// goes on through the network).
func convBNAct(op graph.Op, param float64) *net {
	b := newNet(3, 6, 1)
	x := b.conv("conv1", b.g.Input, len(mixed), 3, 1, true)
	y := b.bn("bn1", x, mixed...)
	if op != "" {
		y = b.act("act1", op, param, y)
	}
	b.conv("head", y, 2, 1, 1, false)
	return b
}

func TestConvBNActivation(t *testing.T) {
	cases := []struct {
		name    string
		op      graph.Op
		param   float64
		opt     Options
		wantOp  graph.Op
		wantAct string
		outcome Outcome
	}{
		{"relu leaky policy", graph.OpReLU, 0, Options{}, graph.OpInPlaceABN, graph.ActLeakyReLU, OutcomeApproximated},
		{"relu leaky policy slope 0.1", graph.OpReLU, 0, Options{Slope: 0.1}, graph.OpInPlaceABN, graph.ActLeakyReLU, OutcomeApproximated},
		{"relu abn policy", graph.OpReLU, 0, Options{ReLU: ReLUABN}, graph.OpABN, graph.ActReLU, OutcomeExact},
		{"leaky relu", graph.OpLeakyReLU, 0.2, Options{}, graph.OpInPlaceABN, graph.ActLeakyReLU, OutcomeSignFolded},
		{"leaky relu sync", graph.OpLeakyReLU, 0.2, Options{Sync: true}, graph.OpInPlaceABNSync, graph.ActLeakyReLU, OutcomeSignFolded},
		{"elu", graph.OpELU, 1.0, Options{}, graph.OpInPlaceABN, graph.ActELU, OutcomeSignFolded},
		{"leaky relu slope 0 is a relu", graph.OpLeakyReLU, 0, Options{ReLU: ReLUABN}, graph.OpABN, graph.ActReLU, OutcomeExact},
		{"elu alpha 0 is a relu", graph.OpELU, 0, Options{}, graph.OpInPlaceABN, graph.ActLeakyReLU, OutcomeApproximated},
		{"identity", "", 0, Options{}, graph.OpInPlaceABN, graph.ActIdentity, OutcomeSignFolded},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := convBNAct(tc.op, tc.param)
			rep, before, after := convert(t, b, tc.opt)
			s := siteOf(t, rep, "bn1")
			if s.Op != tc.wantOp || s.OpActivation != tc.wantAct || s.Outcome != tc.outcome {
				t.Fatalf("site = %s(%s) %s, want %s(%s) %s", s.Op, s.OpActivation, s.Outcome, tc.wantOp, tc.wantAct, tc.outcome)
			}
			n := b.g.Node("bn1")
			if n.Op != tc.wantOp || n.Attr.Activation != tc.wantAct || n.Attr.Features != len(mixed) || n.Attr.Eps != 1e-5 || n.Attr.Momentum != 0.1 {
				t.Fatalf("fused node %+v", n.Attr)
			}
			if b.g.Node("act1") != nil {
				t.Fatal("activation node still in the graph")
			}
			d := maxAbsDiff(before, after)
			if tc.outcome == OutcomeApproximated {
				if d < 1e-6 {
					t.Fatalf("ReLU -> leaky_relu should change the outputs, max diff %g", d)
				}
				if !strings.Contains(rep.Warnings[0], "WARNING: 1 BN+ReLU sites now use leaky_relu") {
					t.Fatalf("warnings = %q", rep.Warnings)
				}
				// The BN part is still exact: the converted net equals the
				// source net with LeakyReLU(slope) in place of the ReLU.
				ref := convBNAct(graph.OpLeakyReLU, rep.Slope)
				x := b.input(2)
				want, err := evaluate(ref.g, ref.w, x)
				if err != nil {
					t.Fatal(err)
				}
				got, err := evaluate(b.g, b.w, x)
				if err != nil {
					t.Fatal(err)
				}
				if d := maxAbsDiff(want, got); d > exact {
					t.Fatalf("differs from the leaky_relu(%g) source network by %g", rep.Slope, d)
				}
				return
			}
			if d > exact {
				t.Fatalf("exact outcome %s, but outputs differ by %g", tc.outcome, d)
			}
		})
	}
}

func TestReLUErrorPolicy(t *testing.T) {
	b := newNet(3, 6, 2)
	x := b.conv("conv1", b.g.Input, 2, 3, 1, false)
	x = b.bn("bn1", x, 1, 1) // identity site: not the error
	x = b.conv("conv2", x, 2, 3, 1, false)
	x = b.relu("relu2", b.bn("layer.bn2", x, 1, -1))
	x = b.relu("relu3", b.bn("layer.bn3", x, 1, -1))
	_, err := Run(b.g, b.w, Options{ReLU: ReLUError})
	if err == nil || !strings.Contains(err.Error(), "layer.bn2") || strings.Contains(err.Error(), "layer.bn3") {
		t.Fatalf("error = %v, want one naming the first BN+ReLU site layer.bn2", err)
	}
}

func TestOptions(t *testing.T) {
	var dump bytes.Buffer
	bad := []Options{
		{ReLU: "sometimes"},
		{Slope: -0.1},
		{TinyGamma: "roughly"},
		{Slope: math.NaN()},
		{DumpAfter: "no-such-pass", Dump: &dump},
		{DumpAfter: "fuse"},
	}
	for _, opt := range bad {
		b := convBNAct(graph.OpReLU, 0)
		if _, err := Run(b.g, b.w, opt); err == nil {
			t.Errorf("Run(%+v) accepted", opt)
		}
	}
	for _, tc := range []struct{ pass, want, not string }{
		{"match-bn-act", "bn1 = BatchNorm2d(conv1)", "InPlaceABN"},
		{"fuse", "bn1 = InPlaceABN(conv1) [6 eps=1e-05 momentum=0.1 leaky_relu(0.01)]", "act1"},
	} {
		dump.Reset()
		b := convBNAct(graph.OpReLU, 0)
		if _, err := Run(b.g, b.w, Options{DumpAfter: tc.pass, Dump: &dump}); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(dump.String(), tc.want) || strings.Contains(dump.String(), tc.not) {
			t.Errorf("dump after %s:\n%s\nwant %q, not %q", tc.pass, dump.String(), tc.want, tc.not)
		}
	}
}

// TestIdentityBeforeAdd: conv -> bn -> add, the end of a residual branch.
func TestIdentityBeforeAdd(t *testing.T) {
	b := newNet(4, 6, 3)
	x := b.conv("stem", b.g.Input, 4, 3, 1, false)
	y := b.bn("bn", b.conv("conv", x, 4, 3, 1, false), 0.9, -0.6, -1.2, 0.3)
	b.op("add", graph.OpAdd, graph.Attr{}, y, x)
	rep, before, after := convert(t, b, Options{})
	s := siteOf(t, rep, "bn")
	if s.Activation != graph.ActIdentity || s.Op != graph.OpInPlaceABN || s.Outcome != OutcomeSignFolded ||
		!strings.Contains(s.Match, "Add add") || !slices.Equal(s.FoldedInto, []string{"conv"}) {
		t.Fatalf("site %+v", s)
	}
	if !slices.Equal(rep.Flips["conv.weight"], []int{1, 2}) || !slices.Equal(rep.Flips["bn.running_mean"], []int{1, 2}) {
		t.Fatalf("flips %v", rep.Flips)
	}
	if d := maxAbsDiff(before, after); d > exact {
		t.Fatalf("outputs differ by %g", d)
	}
}

// bottleneck is a torchvision ResNet stem and one bottleneck block with a
// downsample, activations given by op.
func bottleneck(op graph.Op) *net {
	b := newNet(3, 8, 4)
	act := func(name string, v *graph.Value) *graph.Value { return b.act(name, op, 0.05, v) }
	x := b.conv("conv1", b.g.Input, 4, 3, 2, false)
	x = act("relu", b.bn("bn1", x, 1.1, -0.9, 0.6, -0.3))
	x = b.maxpool("maxpool", x)
	y := b.conv("layer1.0.conv1", x, 3, 1, 1, false)
	y = act("layer1.0.relu", b.bn("layer1.0.bn1", y, -0.7, 0.9, -1.4))
	y = b.conv("layer1.0.conv2", y, 3, 3, 2, false)
	y = act("layer1.0.relu_1", b.bn("layer1.0.bn2", y, 0.5, -0.5, 0.8))
	y = b.conv("layer1.0.conv3", y, 6, 1, 1, false)
	y = b.bn("layer1.0.bn3", y, 0.3, -0.2, 0.9, -1.0, 0.6, 0.7)
	d := b.conv("layer1.0.downsample.0", x, 6, 1, 2, false)
	d = b.bn("layer1.0.downsample.1", d, -0.4, 0.8, 0.5, -0.9, 1.2, -0.6)
	z := b.op("layer1.0.add", graph.OpAdd, graph.Attr{}, y, d)
	z = b.relu("layer1.0.relu_2", z)
	z = b.op("avgpool", graph.OpAdaptiveAvgPool, graph.Attr{OutputSize: [2]int{1, 1}}, z)
	z = b.op("flatten", graph.OpFlatten, graph.Attr{StartDim: 1}, z)
	lin := b.g.Add("fc", graph.OpLinear, graph.Attr{InChannels: 6, OutChannels: 3, Bias: true}, map[string]string{graph.RoleWeight: "fc.weight", graph.RoleBias: "fc.bias"}, z)
	lin.Channels = 3
	b.w.Put("fc.weight", []int{3, 6}, b.randn(18, 0.5))
	b.w.Put("fc.bias", []int{3}, b.randn(3, 0.5))
	return b
}

func TestBottleneck(t *testing.T) {
	t.Run("leaky source, exact in place", func(t *testing.T) {
		b := bottleneck(graph.OpLeakyReLU)
		rep, before, after := convert(t, b, Options{})
		if d := maxAbsDiff(before, after); d > exact {
			t.Fatalf("outputs differ by %g", d)
		}
		want := Summary{Sites: 5, SignFolded: 5}
		if rep.Summary != want {
			t.Fatalf("summary %+v, want %+v", rep.Summary, want)
		}
		for _, s := range rep.Sites {
			if s.Op != graph.OpInPlaceABN || len(s.FoldedInto) != 1 || !slices.Equal(s.FoldedChannels, s.NegativeChannels) {
				t.Errorf("site %+v", s)
			}
		}
		if s := siteOf(t, rep, "layer1.0.downsample.1"); s.FoldedInto[0] != "layer1.0.downsample.0" || s.Activation != graph.ActIdentity {
			t.Errorf("downsample site %+v", s)
		}
		if n := b.g.Node("layer1.0.relu_2"); n == nil || n.Op != graph.OpReLU {
			t.Error("the ReLU after the residual add must stay")
		}
	})
	t.Run("relu source, abn policy", func(t *testing.T) {
		b := bottleneck(graph.OpReLU)
		rep, before, after := convert(t, b, Options{ReLU: ReLUABN})
		if d := maxAbsDiff(before, after); d > exact {
			t.Fatalf("outputs differ by %g", d)
		}
		// bn3 and downsample.1 are identity sites: still in place, folded.
		want := Summary{Sites: 5, Exact: 3, SignFolded: 2}
		if rep.Summary != want {
			t.Fatalf("summary %+v, want %+v", rep.Summary, want)
		}
		if len(rep.Flips["bn1.weight"]) != 0 {
			t.Errorf("ABN site needs no sign handling, flips %v", rep.Flips)
		}
	})
	t.Run("relu source, leaky policy", func(t *testing.T) {
		b := bottleneck(graph.OpReLU)
		rep, before, after := convert(t, b, Options{Slope: 0.05})
		if d := maxAbsDiff(before, after); d < 1e-6 {
			t.Fatalf("approximation changed nothing (%g)", d)
		}
		if rep.Summary.Approximated != 3 || rep.Summary.SignFolded != 2 {
			t.Fatalf("summary %+v", rep.Summary)
		}
		// Equal to the same weights with LeakyReLU(0.05) in the source.
		ref := bottleneck(graph.OpLeakyReLU)
		x := ref.input(2)
		want, _ := evaluate(ref.g, ref.w, x)
		got, err := evaluate(b.g, b.w, x)
		if err != nil {
			t.Fatal(err)
		}
		if d := maxAbsDiff(want, got); d > exact {
			t.Fatalf("differs from the leaky source network by %g", d)
		}
	})
}

// denseBlock is a torchvision DenseNet stem, one block of two dense layers
// and the final norm; growth 2, so the block concatenation has 4+2+2
// channels. gammas for the block's readers are chosen so that:
//   - stem channels (after the max-pool) are negative in some readers: flip;
//   - y1 channel 0 is negative in every in-place reader: fold into conv2;
//   - y1 channel 1 is negative in layer2.norm1 but positive in norm5: flip;
//   - y2 channel 1 is negative in norm5 only: fold.
func denseBlock(op graph.Op) *net {
	b := newNet(3, 8, 5)
	act := func(name string, v *graph.Value) *graph.Value { return b.act(name, op, 0.1, v) }
	p := "features.denseblock1."
	x := b.conv("features.conv0", b.g.Input, 4, 3, 1, false)
	x = act("features.relu0", b.bn("features.norm0", x, 0.5, -0.8, 0.9, -0.4))
	x0 := b.maxpool("features.pool0", x)
	layer := func(name string, feats []*graph.Value, gamma1 []float64) *graph.Value {
		c := b.cat(p+name+".cat", feats...)
		c = act(p+name+".relu1", b.bn(p+name+".norm1", c, gamma1...))
		c = b.conv(p+name+".conv1", c, 4, 1, 1, false)
		c = act(p+name+".relu2", b.bn(p+name+".norm2", c, 0.7, -0.6, 1.1, -0.2))
		return b.conv(p+name+".conv2", c, 2, 3, 1, false)
	}
	y1 := layer("denselayer1", []*graph.Value{x0}, []float64{-0.6, 0.9, 0.4, -1.0})
	y2 := layer("denselayer2", []*graph.Value{x0, y1}, []float64{0.6, -0.9, 0.4, 1.0, -0.5, -0.8})
	out := b.cat(p+"cat", x0, y1, y2)
	out = b.bn("features.norm5", out, 0.6, 0.9, -0.4, 1.0, -0.5, 0.8, 0.7, -1.3)
	out = b.relu("relu", out)
	b.op("pool", graph.OpAdaptiveAvgPool, graph.Attr{OutputSize: [2]int{1, 1}}, out)
	return b
}

func TestDenseBlock(t *testing.T) {
	b := denseBlock(graph.OpLeakyReLU)
	rep, before, after := convert(t, b, Options{ReLU: ReLUABN})
	if d := maxAbsDiff(before, after); d > exact {
		t.Fatalf("outputs differ by %g\n%s", d, b.g)
	}
	p := "features.denseblock1."
	l1, l2, n5 := siteOf(t, rep, p+"denselayer1.norm1"), siteOf(t, rep, p+"denselayer2.norm1"), siteOf(t, rep, "features.norm5")
	// Stem channels come out of a max-pool: never folded, flipped.
	if l1.Outcome != OutcomeSignFlipped || !slices.Equal(l1.FlippedChannels, []int{0, 3}) || !strings.Contains(l1.Note, "MaxPool2d") {
		t.Errorf("layer1.norm1 %+v", l1)
	}
	// norm5 is an ABN relu site (ABN policy): it takes any sign passively,
	// so y1's channels 0 and 1 (block channels 4, 5), negative at the
	// in-place layer2.norm1, fold into layer1.conv2; y2's channel 1 (block
	// channel 7) is negative only at norm5, which needs no sign handling.
	if !slices.Equal(l2.FoldedChannels, []int{4, 5}) || !slices.Equal(l2.FlippedChannels, []int{1}) || l2.Outcome != OutcomeSignFlipped {
		t.Errorf("layer2.norm1 %+v", l2)
	}
	if !slices.Equal(rep.Flips[p+"denselayer1.conv2.weight"], []int{0, 1}) || rep.Flips[p+"denselayer2.conv2.weight"] != nil {
		t.Errorf("conv flips %v", rep.Flips)
	}
	if n5.Op != graph.OpABN || n5.Outcome != OutcomeExact || !slices.Equal(n5.FoldedChannels, []int{4, 5}) {
		t.Errorf("norm5 %+v", n5)
	}
	if sign := b.g.Node(p + "denselayer2.norm1").Sign; !slices.Equal(sign, []int8{1, -1, 1, 1, 1, 1}) {
		t.Errorf("sign vector %v", sign)
	}
	if want := []string{p + "denselayer1", p + "denselayer2"}; !slices.Equal(rep.DenseLayers, want) {
		t.Errorf("dense layers %v, want %v", rep.DenseLayers, want)
	}
	for _, name := range []string{p + "denselayer2.cat", p + "denselayer2.norm1", p + "denselayer2.conv1"} {
		if g := b.g.Node(name).Recompute; g != p+"denselayer2" {
			t.Errorf("%s recompute %q", name, g)
		}
	}
	if b.g.Node(p+"cat").Recompute != "" || b.g.Node(p+"denselayer1.norm2").Recompute != "" {
		t.Error("the block's final concat and norm2 are not dense groups")
	}
}

// TestDenseBlockAllInPlace: with norm5 in place too, block channel 5 is
// positive at norm5 so y1 channel 1 cannot fold; channel 7 folds.
func TestDenseBlockAllInPlace(t *testing.T) {
	b := denseBlock(graph.OpLeakyReLU)
	b.g.Node("relu").Op = graph.OpLeakyReLU
	b.g.Node("relu").Attr.ActParam = 0.1
	rep, before, after := convert(t, b, Options{})
	if d := maxAbsDiff(before, after); d > exact {
		t.Fatalf("outputs differ by %g", d)
	}
	p := "features.denseblock1."
	// Block channel 4 (y1 ch0) is negative at both in-place readers: fold.
	// Block channel 5 (y1 ch1) is negative at layer2.norm1, positive at
	// norm5: no fold, flipped at layer2.norm1. Block channel 7 (y2 ch1) is
	// negative at norm5, its only reader: fold. Channel 2 (max-pool): flip.
	n5, l2 := siteOf(t, rep, "features.norm5"), siteOf(t, rep, p+"denselayer2.norm1")
	if n5.Op != graph.OpInPlaceABN || !slices.Equal(n5.FoldedChannels, []int{4, 7}) || !slices.Equal(n5.FlippedChannels, []int{2}) {
		t.Errorf("norm5 %+v", n5)
	}
	if !slices.Equal(l2.FoldedChannels, []int{4}) || !slices.Equal(l2.FlippedChannels, []int{1, 5}) ||
		!strings.Contains(l2.Note, "whose gamma") && !strings.Contains(l2.Note, "MaxPool2d") {
		t.Errorf("layer2.norm1 %+v", l2)
	}
	if !slices.Equal(rep.Flips[p+"denselayer1.conv2.weight"], []int{0}) || !slices.Equal(rep.Flips[p+"denselayer2.conv2.weight"], []int{1}) {
		t.Errorf("conv flips %v", rep.Flips)
	}
	if sign := b.g.Node(p + "denselayer2.norm1").Sign; !slices.Equal(sign, []int8{1, -1, 1, 1, 1, -1}) {
		t.Errorf("sign vector %v", sign)
	}
	for _, s := range rep.Sites {
		if s.Outcome == OutcomeFallbackABN || s.Outcome == OutcomeApproximated {
			t.Errorf("site %s: %s", s.Node, s.Outcome)
		}
	}
}

// TestSharedInput: a BN whose input is read by another node too cannot run
// in place.
func TestSharedInput(t *testing.T) {
	b := newNet(3, 6, 6)
	x := b.conv("conv1", b.g.Input, 3, 3, 1, false)
	y := b.act("act", graph.OpLeakyReLU, 0.01, b.bn("bn", x, -0.5, 0.7, 1.0))
	z := b.conv("side", x, 3, 1, 1, false)
	b.op("add", graph.OpAdd, graph.Attr{}, y, z)
	rep, before, after := convert(t, b, Options{})
	s := siteOf(t, rep, "bn")
	if s.Op != graph.OpABN || s.Outcome != OutcomeFallbackABN || !strings.Contains(s.Reason, "also read by side") {
		t.Fatalf("site %+v", s)
	}
	if d := maxAbsDiff(before, after); d > exact {
		t.Fatalf("outputs differ by %g", d)
	}
	// The evaluator catches a conversion that ignores the precondition:
	// run the same site in place (exact weights and all) and "side" reads
	// the overwritten tensor.
	n := b.g.Node("bn")
	n.Op = graph.OpInPlaceABN
	gamma, _ := b.w.Values("bn.weight")
	mean, _ := b.w.Values("bn.running_mean")
	gamma[0], mean[0] = -gamma[0], -mean[0]
	n.Sign = []int8{-1, 1, 1}
	for c := range gamma {
		gamma[c] -= 1e-5
	}
	b.w.SetValues("bn.weight", gamma)
	b.w.SetValues("bn.running_mean", mean)
	bad, err := evaluate(b.g, b.w, b.last)
	if err != nil {
		t.Fatal(err)
	}
	if d := maxAbsDiff(before, bad); d < 1e-6 {
		t.Fatalf("an in-place layer on a shared input went unnoticed (%g)", d)
	}
}

// TestAfterMaxPool: a max-pool output read only by the BN cannot take a
// folded sign (max is not sign-symmetric) but may be flipped in place; read
// elsewhere too, the site falls back to ABN.
func TestAfterMaxPool(t *testing.T) {
	for _, shared := range []bool{false, true} {
		b := newNet(3, 8, 7)
		x := b.maxpool("pool", b.conv("conv", b.g.Input, 3, 3, 1, false))
		y := b.act("act", graph.OpELU, 1.0, b.bn("bn", x, 0.5, -0.9, 0.3))
		if shared {
			b.op("add", graph.OpAdd, graph.Attr{}, y, x)
		}
		rep, before, after := convert(t, b, Options{})
		if d := maxAbsDiff(before, after); d > exact {
			t.Fatalf("shared=%v: outputs differ by %g", shared, d)
		}
		s := siteOf(t, rep, "bn")
		if shared {
			if s.Outcome != OutcomeFallbackABN || s.Op != graph.OpABN || len(rep.Flips) != 0 {
				t.Fatalf("shared: site %+v flips %v", s, rep.Flips)
			}
			continue
		}
		if s.Outcome != OutcomeSignFlipped || !slices.Equal(s.FlippedChannels, []int{1}) || len(s.FoldedInto) != 0 {
			t.Fatalf("site %+v", s)
		}
		if len(rep.Flips["conv.weight"]) != 0 {
			t.Fatalf("folded through a max-pool: %v", rep.Flips)
		}
	}
}

// TestFoldThroughAvgPool: average pooling is linear, so the sign goes on to
// the convolution before it.
func TestFoldThroughAvgPool(t *testing.T) {
	b := newNet(3, 8, 8)
	x := b.avgpool("pool", b.conv("conv", b.g.Input, 3, 3, 1, true))
	b.act("act", graph.OpLeakyReLU, 0.01, b.bn("bn", x, 0.5, -0.9, -0.3))
	rep, before, after := convert(t, b, Options{})
	if d := maxAbsDiff(before, after); d > exact {
		t.Fatalf("outputs differ by %g", d)
	}
	s := siteOf(t, rep, "bn")
	if s.Outcome != OutcomeSignFolded || !slices.Equal(s.FoldedInto, []string{"conv"}) || !slices.Equal(rep.Flips["conv.bias"], []int{1, 2}) {
		t.Fatalf("site %+v flips %v", s, rep.Flips)
	}
}

// TestTinyGamma: under --tiny-gamma approx, |gamma| < eps becomes weight
// 0, i.e. scale eps; the converted network equals the source with those
// gammas set to +-eps.
func TestTinyGamma(t *testing.T) {
	gamma := []float64{0, 3e-6, -4e-6, 0.5, -2e-5}
	build := func(g []float64) *net {
		b := newNet(3, 6, 9)
		b.act("act", graph.OpLeakyReLU, 0.01, b.bn("bn", b.conv("conv", b.g.Input, 5, 3, 1, false), g...))
		return b
	}
	b := build(gamma)
	rep, _, after := convert(t, b, Options{TinyGamma: TinyGammaApprox})
	s := siteOf(t, rep, "bn")
	if rep.TinyGammaPolicy != TinyGammaApprox || rep.Summary.TinyGammaFallback != 0 || len(s.TinyGammaExactChannels) > 0 {
		t.Fatalf("policy %q, summary %+v, site %+v", rep.TinyGammaPolicy, rep.Summary, s)
	}
	if !slices.Equal(s.TinyGammaChannels, []int{0, 1, 2}) || math.Abs(s.TinyGammaScaleError-1e-5) > 1e-18 {
		t.Fatalf("site %+v", s)
	}
	if rep.Summary.TinyGamma != 1 || rep.Summary.Approximated != 1 || s.Outcome != OutcomeApproximated || !slices.Equal(s.FoldedChannels, []int{2, 4}) ||
		!strings.Contains(s.Reason, "channels [0 1 2] with |gamma| < eps=1e-05 given scale eps") ||
		len(rep.Warnings) != 1 || !strings.Contains(rep.Warnings[0], "bn: 3 channel(s) [0 1 2]") {
		t.Fatalf("summary %+v warnings %q", rep.Summary, rep.Warnings)
	}
	w, _ := b.w.Values("bn.weight")
	if w[0] != 0 || w[1] != 0 || w[2] != 0 || w[3] != 0.5-1e-5 || w[4] != 2e-5-1e-5 {
		t.Fatalf("weights %v", w)
	}
	ref := build([]float64{1e-5, 1e-5, -1e-5, 0.5, -2e-5})
	want, err := evaluate(ref.g, ref.w, b.last)
	if err != nil {
		t.Fatal(err)
	}
	if d := maxAbsDiff(want, after); d > exact {
		t.Fatalf("differs from the source with gamma_eff by %g", d)
	}
}

// TestTinyGammaExact: by default a site with |gamma| < eps falls back to
// ABN, which holds every gamma as stored (negative ones included, so no
// sign is moved): exact, with a reason naming the channels and eps, the
// saving lost counted, and one warning naming the opt-in.
func TestTinyGammaExact(t *testing.T) {
	b := newNet(3, 6, 9)
	x := b.conv("conv", b.g.Input, 5, 3, 1, true)
	y := b.act("act", graph.OpLeakyReLU, 0.01, b.bn("bn", x, 0, 1e-7, -1e-7, 0.5, -2e-5))
	b.act("act2", graph.OpLeakyReLU, 0.01, b.bn("bn2", b.conv("conv2", y, 3, 1, 1, true), 0.7, -0.4, 9.99e-6))
	orig := snapshot(t, b.w)
	rep, before, after := convert(t, b, Options{})
	if d := maxAbsDiff(before, after); d > exact {
		t.Fatalf("outputs differ by %g", d)
	}
	if rep.TinyGammaPolicy != TinyGammaExact {
		t.Errorf("policy %q", rep.TinyGammaPolicy)
	}
	for _, tc := range []struct {
		node   string
		tiny   []int
		reason string
	}{
		{"bn", []int{0, 1, 2}, "channels [0 1 2] with |gamma| < eps=1e-05"},
		{"bn2", []int{2}, "channel 2 with |gamma| < eps=1e-05"},
	} {
		s := siteOf(t, rep, tc.node)
		if s.Op != graph.OpABN || s.OpActivation != graph.ActLeakyReLU || s.Outcome != OutcomeFallbackABN ||
			!slices.Equal(s.TinyGammaExactChannels, tc.tiny) || len(s.TinyGammaChannels) > 0 || s.TinyGammaScaleError != 0 ||
			len(s.FoldedChannels) > 0 || len(s.FlippedChannels) > 0 || !strings.Contains(s.Reason, tc.reason) {
			t.Errorf("site %+v", s)
		}
		if b.g.Node(tc.node).Sign != nil {
			t.Errorf("%s flipped", tc.node)
		}
		// ABN's weight is the gamma as stored.
		if w := vals(t, b, tc.node+".weight"); !slices.Equal(w, orig[tc.node+".weight"]) {
			t.Errorf("%s weights %v, want %v", tc.node, w, orig[tc.node+".weight"])
		}
	}
	sum := rep.Summary
	if sum.TinyGamma != 2 || sum.TinyGammaFallback != 2 || sum.FallbackABN != 2 || len(rep.Flips) != 0 || len(rep.Changed) != 0 {
		t.Errorf("summary %+v, flips %v, changed %v", sum, rep.Flips, rep.Changed)
	}
	if len(rep.Warnings) != 1 || !strings.Contains(rep.Warnings[0], "2 site(s) with |gamma| < eps kept out of place") ||
		!strings.Contains(rep.Warnings[0], "--tiny-gamma approx") {
		t.Errorf("warnings %q", rep.Warnings)
	}
	var table bytes.Buffer
	rep.WriteTable(&table)
	if !strings.Contains(table.String(), "2 with tiny gamma (2 kept out of place for it)") || !strings.Contains(table.String(), "tiny gamma exact") {
		t.Errorf("table:\n%s", table.String())
	}
}

// TestTinyGammaBeforeSigns: check-tiny-gamma decides before fold-signs.
// In denseBlock with every site in place, block channel 5 cannot fold
// (positive at norm5); with a tiny gamma at norm5's channel 7, norm5
// falls back to ABN, which takes any sign, so channel 5 folds into
// layer1.conv2 after all and channel 7, negative only at the ABN, is left
// alone. Under approx, norm5 stays in place and everything is as before.
func TestTinyGammaBeforeSigns(t *testing.T) {
	p := "features.denseblock1."
	build := func() *net {
		b := denseBlock(graph.OpLeakyReLU)
		b.g.Node("relu").Op = graph.OpLeakyReLU
		b.g.Node("relu").Attr.ActParam = 0.1
		g := vals(t, b, "features.norm5.weight")
		g[7] = -1e-7
		b.w.Put("features.norm5.weight", []int{len(g)}, g)
		return b
	}
	b := build()
	rep, before, after := convert(t, b, Options{})
	if d := maxAbsDiff(before, after); d > exact {
		t.Fatalf("outputs differ by %g", d)
	}
	n5, l2 := siteOf(t, rep, "features.norm5"), siteOf(t, rep, p+"denselayer2.norm1")
	if n5.Op != graph.OpABN || n5.Outcome != OutcomeFallbackABN || !slices.Equal(n5.TinyGammaExactChannels, []int{7}) ||
		!slices.Equal(n5.FoldedChannels, []int{4, 5}) || len(n5.FlippedChannels) > 0 {
		t.Errorf("norm5 %+v", n5)
	}
	if l2.Op != graph.OpInPlaceABN || !slices.Equal(l2.FoldedChannels, []int{4, 5}) || !slices.Equal(l2.FlippedChannels, []int{1}) {
		t.Errorf("layer2.norm1 %+v", l2)
	}
	if !slices.Equal(rep.Flips[p+"denselayer1.conv2.weight"], []int{0, 1}) || rep.Flips[p+"denselayer2.conv2.weight"] != nil {
		t.Errorf("conv flips %v", rep.Flips)
	}

	b = build()
	rep, _, _ = convert(t, b, Options{TinyGamma: TinyGammaApprox})
	n5 = siteOf(t, rep, "features.norm5")
	if n5.Op != graph.OpInPlaceABN || !slices.Equal(n5.TinyGammaChannels, []int{7}) || !slices.Equal(n5.FoldedChannels, []int{4, 7}) {
		t.Errorf("approx: norm5 %+v", n5)
	}
}

// TestNaiveRewriteIsCaught: copying gamma into InPlace-ABN's weight, the
// library's most reported failure, must fail the evaluator check that the
// real conversion passes.
func TestNaiveRewriteIsCaught(t *testing.T) {
	for _, tc := range []struct {
		name string
		net  func() *net
	}{
		{"conv-bn-leaky", func() *net { return convBNAct(graph.OpLeakyReLU, 0.01) }},
		{"bottleneck", func() *net { return bottleneck(graph.OpLeakyReLU) }},
		{"dense block", func() *net { return denseBlock(graph.OpLeakyReLU) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := tc.net()
			x := b.input(2)
			before, err := evaluate(b.g, b.w, x)
			if err != nil {
				t.Fatal(err)
			}
			for _, n := range b.g.Nodes {
				if n.Op != graph.OpBatchNorm {
					continue
				}
				n.Op, n.Attr.Activation = graph.OpInPlaceABN, graph.ActIdentity
				if r := n.Out.Consumers; len(r) == 1 && r[0].Op == graph.OpLeakyReLU {
					n.Attr.Activation, n.Attr.ActParam = graph.ActLeakyReLU, r[0].Attr.ActParam
					b.g.ReplaceUses(r[0].Out, n.Out)
					b.g.Remove(r[0])
				}
			}
			naive, err := evaluate(b.g, b.w, x)
			if err != nil {
				t.Fatal(err)
			}
			if d := maxAbsDiff(before, naive); d < 1e-3 {
				t.Fatalf("naive rewrite differs by only %g: the evaluator would not catch it", d)
			}
		})
	}
}

func TestReportJSONAndTable(t *testing.T) {
	b := bottleneck(graph.OpReLU)
	rep, _, _ := convert(t, b, Options{})
	data, err := json.Marshal(rep)
	if err != nil {
		t.Fatal(err)
	}
	var back Report
	if err := json.Unmarshal(data, &back); err != nil {
		t.Fatal(err)
	}
	if back.Summary != rep.Summary || len(back.Sites) != len(rep.Sites) || !slices.Equal(back.Changed, rep.Changed) {
		t.Fatalf("JSON round trip lost data")
	}
	for _, key := range []string{`"sites"`, `"outcome":"approximated"`, `"folded_into"`, `"flips"`, `"changed"`, `"tiny_gamma"`} {
		if !strings.Contains(string(data), key) {
			t.Errorf("JSON lacks %s", key)
		}
	}
	var buf bytes.Buffer
	rep.WriteTable(&buf)
	out := buf.String()
	warn := strings.Index(out, "WARNING: 3 BN+ReLU sites now use leaky_relu(0.01): outputs change; use --relu abn")
	table := strings.Index(out, "NODE")
	if !strings.HasPrefix(out, "rewrite test: 5 sites by outcome: 0 exact, 2 sign-folded") || warn < 0 || table < warn {
		t.Fatalf("table:\n%s", out)
	}
	if !strings.Contains(out, "layer1.0.downsample.1") {
		t.Fatalf("table lacks a site:\n%s", out)
	}
	// The table reaches its writer in a few large writes, not a system
	// call per cell (os.Stdout is unbuffered): 200 sites, as densenet201.
	many := *rep
	for len(many.Sites) < 200 {
		many.Sites = append(many.Sites, rep.Sites...)
	}
	var cw countingWriter
	many.WriteTable(&cw)
	if max := cw.bytes/4096 + 2; cw.writes > max {
		t.Errorf("the table of %d sites took %d writes for %d bytes, want at most %d", len(many.Sites), cw.writes, cw.bytes, max)
	}
}

type countingWriter struct{ writes, bytes int }

func (w *countingWriter) Write(p []byte) (int, error) {
	w.writes++
	w.bytes += len(p)
	return len(p), nil
}

// TestReLUFallbackIsExact: under the leaky policy, a ReLU site that cannot
// run in place becomes ABN, which runs relu itself: no approximation left.
func TestReLUFallbackIsExact(t *testing.T) {
	b := newNet(3, 6, 10)
	x := b.conv("conv1", b.g.Input, 3, 3, 1, false)
	y := b.relu("relu", b.bn("bn", x, -0.5, 0.7, 1.0))
	b.op("add", graph.OpAdd, graph.Attr{}, y, b.conv("side", x, 3, 1, 1, false))
	rep, before, after := convert(t, b, Options{})
	s := siteOf(t, rep, "bn")
	if s.Op != graph.OpABN || s.OpActivation != graph.ActReLU || s.Outcome != OutcomeFallbackABN || rep.Summary.Approximated != 0 {
		t.Fatalf("site %+v, summary %+v", s, rep.Summary)
	}
	if len(rep.Warnings) != 0 {
		t.Fatalf("warnings %q", rep.Warnings)
	}
	if d := maxAbsDiff(before, after); d > exact {
		t.Fatalf("outputs differ by %g", d)
	}
}

// TestNegativeActivationParam: a LeakyReLU or ELU with a negative parameter
// is neither fused into InPlace-ABN (not invertible) nor into ABN (whose
// activation runs in place, which torch cannot differentiate with a
// negative parameter): the BN becomes the identity form, in place where it
// may be, and the activation stays after it as its own node, exactly.
func TestNegativeActivationParam(t *testing.T) {
	cases := []struct {
		name   string
		op     graph.Op
		param  float64
		input  bool // the BN reads the network input: in place is impossible
		wantOp graph.Op
		what   string
	}{
		{"leaky -0.1", graph.OpLeakyReLU, -0.1, false, graph.OpInPlaceABN, "negative_slope -0.1"},
		{"elu -0.5", graph.OpELU, -0.5, false, graph.OpInPlaceABN, "alpha -0.5"},
		{"leaky -0.1 on the input", graph.OpLeakyReLU, -0.1, true, graph.OpABN, "negative_slope -0.1"},
		{"leaky NaN", graph.OpLeakyReLU, math.NaN(), false, graph.OpInPlaceABN, "negative_slope NaN"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := newNet(3, 6, 4)
			x := b.g.Input
			if !tc.input {
				x = b.conv("conv1", x, 3, 3, 1, true)
			}
			b.conv("head", b.act("act1", tc.op, tc.param, b.bn("bn1", x, 0.7, -1.2, 0.4)), 2, 1, 1, false)
			rep, before, after := convert(t, b, Options{ReLU: ReLUABN})
			s := siteOf(t, rep, "bn1")
			if s.Op != tc.wantOp || s.OpActivation != graph.ActIdentity || s.Activation != graph.ActIdentity || s.ActivationNode != "" || s.KeptActivation != "act1" {
				t.Fatalf("site = %s(%s) from %s %q, want %s(identity)", s.Op, s.OpActivation, s.Activation, s.ActivationNode, tc.wantOp)
			}
			for _, text := range []string{s.Match, s.Note} {
				if !strings.Contains(text, "act1 with "+tc.what) || !strings.Contains(text, "out of place") {
					t.Fatalf("match %q / note %q: want the activation named with its %s, kept out of place", s.Match, s.Note, tc.what)
				}
			}
			var table strings.Builder
			rep.WriteTable(&table)
			if !strings.Contains(table.String(), "stays after it, out of place") {
				t.Fatalf("the table does not say the activation was kept:\n%s", table.String())
			}
			act := b.g.Node("act1")
			if act == nil || act.Op != tc.op || len(act.Inputs) != 1 || act.Inputs[0] != b.g.Node("bn1").Out {
				t.Fatalf("activation node not kept after bn1: %+v", act)
			}
			if !(act.Attr.ActParam == tc.param || math.IsNaN(tc.param) && math.IsNaN(act.Attr.ActParam)) {
				t.Fatalf("activation parameter %g, want %g", act.Attr.ActParam, tc.param)
			}
			if math.IsNaN(tc.param) {
				return
			}
			if d := maxAbsDiff(before, after); d > 1e-6 {
				t.Fatalf("outputs differ by %g", d)
			}
		})
	}
}

// TestZeroActivationParamIsReLU: LeakyReLU(0) and ELU(alpha=0) are ReLUs
// and follow the ReLU policy, saying why.
func TestZeroActivationParamIsReLU(t *testing.T) {
	for _, op := range []graph.Op{graph.OpLeakyReLU, graph.OpELU} {
		t.Run(string(op), func(t *testing.T) {
			b := convBNAct(op, 0)
			_, err := Run(b.g, b.w, Options{ReLU: ReLUError})
			if err == nil || !strings.Contains(err.Error(), "("+string(op)+" act1 with") || !strings.Contains(err.Error(), "0 is a ReLU") {
				t.Fatalf("error = %v, want the ReLU policy's refusal saying act1 is a ReLU", err)
			}
			b = convBNAct(op, 0)
			rep, before, after := convert(t, b, Options{ReLU: ReLUABN})
			s := siteOf(t, rep, "bn1")
			if s.Op != graph.OpABN || s.OpActivation != graph.ActReLU || s.Activation != graph.ActReLU || !strings.Contains(s.Note, "0 is a ReLU") {
				t.Fatalf("site = %s(%s) from %s, note %q", s.Op, s.OpActivation, s.Activation, s.Note)
			}
			if d := maxAbsDiff(before, after); d > 1e-9 {
				t.Fatalf("outputs differ by %g", d)
			}
		})
	}
}
