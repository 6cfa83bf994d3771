package rewrite

import (
	"slices"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

func TestPipelineOrder(t *testing.T) {
	index := map[string]int{}
	for i, p := range Pipeline {
		if p.Name == "" || p.Run == nil || p.Does == "" {
			t.Errorf("pass %d is incomplete: %+v", i, p)
		}
		if _, dup := index[p.Name]; dup {
			t.Errorf("pass %q listed twice", p.Name)
		}
		index[p.Name] = i
	}
	for _, c := range passOrder {
		ia, oka := index[c.a]
		ib, okb := index[c.b]
		if !oka || !okb {
			t.Errorf("constraint %s < %s names a pass that does not exist", c.a, c.b)
			continue
		}
		if ia >= ib {
			t.Errorf("%s must run before %s: %s", c.a, c.b, c.why)
		}
	}
	// Every pass takes part in some constraint: an unconstrained pass is
	// one whose place nobody has thought about.
	for _, p := range Pipeline {
		found := false
		for _, c := range passOrder {
			found = found || c.a == p.Name || c.b == p.Name
		}
		if !found {
			t.Errorf("pass %s has no ordering constraint", p.Name)
		}
	}
}

// upTo runs the pipeline up to and including pass last.
func upTo(t *testing.T, b *net, opt Options, last string) *State {
	t.Helper()
	if passIndex(last) < 0 {
		t.Fatalf("no pass %q", last)
	}
	st, err := newState(b.g, b.w, opt)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range Pipeline {
		if err := st.runPass(p, nil); err != nil {
			t.Fatal(err)
		}
		if p.Name == last {
			break
		}
	}
	return st
}

func siteFor(t *testing.T, st *State, name string) *site {
	t.Helper()
	for _, s := range st.sites {
		if s.bn.Name == name {
			return s
		}
	}
	t.Fatalf("no site %s", name)
	return nil
}

func vals(t *testing.T, b *net, key string) []float64 {
	t.Helper()
	v, err := b.w.Values(key)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func TestMatchBNAct(t *testing.T) {
	cases := []struct {
		name  string
		build func(b *net, x *graph.Value)
		act   string
		param float64
		match string // substring of the reason for no fusion
	}{
		{"relu", func(b *net, x *graph.Value) { b.relu("a", b.bn("bn", x, 1, 1)) }, graph.ActReLU, 0, ""},
		{"leaky", func(b *net, x *graph.Value) { b.act("a", graph.OpLeakyReLU, 0.2, b.bn("bn", x, 1, 1)) }, graph.ActLeakyReLU, 0.2, ""},
		{"elu", func(b *net, x *graph.Value) { b.act("a", graph.OpELU, 0.5, b.bn("bn", x, 1, 1)) }, graph.ActELU, 0.5, ""},
		{"add", func(b *net, x *graph.Value) { b.op("add", graph.OpAdd, graph.Attr{}, b.bn("bn", x, 1, 1), x) }, graph.ActIdentity, 0, "followed by Add add"},
		{"conv", func(b *net, x *graph.Value) { b.conv("c", b.bn("bn", x, 1, 1), 2, 1, 1, false) }, graph.ActIdentity, 0, "followed by Conv2d c"},
		{"two readers", func(b *net, x *graph.Value) {
			y := b.bn("bn", x, 1, 1)
			b.op("add", graph.OpAdd, graph.Attr{}, b.relu("a", y), y)
		}, graph.ActIdentity, 0, "read by 2 nodes (a, add)"},
		{"network output", func(b *net, x *graph.Value) { b.bn("bn", x, 1, 1) }, graph.ActIdentity, 0, "network output"},
		{"silu", func(b *net, x *graph.Value) { b.act("a", graph.OpSiLU, 0, b.bn("bn", x, 1, 1)) }, graph.ActIdentity, 0,
			"followed by SiLU a, which InPlace-ABN cannot invert: the BN takes the identity activation and SiLU stays after it, out of place, keeping the tensor an in-place BN keeps (exact; one tensor fewer"},
		{"relu6", func(b *net, x *graph.Value) {
			b.op("a", graph.OpHardtanh, graph.Attr{ActParam: 0, ActParam2: 6}, b.bn("bn", x, 1, 1))
		}, graph.ActIdentity, 0, "followed by Hardtanh a, which InPlace-ABN cannot invert"},
		{"sigmoid", func(b *net, x *graph.Value) { b.act("a", graph.OpSigmoid, 0, b.bn("bn", x, 1, 1)) }, graph.ActIdentity, 0,
			"Sigmoid keeps its own output, so the site keeps as many tensors as before"},
		{"relu reads it twice", func(b *net, x *graph.Value) {
			y := b.bn("bn", x, 1, 1)
			b.op("add", graph.OpAdd, graph.Attr{}, y, y)
		}, graph.ActIdentity, 0, "followed by Add add"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := newNet(2, 4, 1)
			tc.build(b, b.conv("conv", b.g.Input, 2, 1, 1, false))
			st := upTo(t, b, Options{}, "match-bn-act")
			s := siteFor(t, st, "bn")
			if s.srcAct != tc.act || s.srcParam != tc.param || (tc.match == "") != (s.act != nil) || !strings.Contains(s.match, tc.match) {
				t.Fatalf("site act %s(%g) node %v match %q", s.srcAct, s.srcParam, s.act, s.match)
			}
		})
	}
}

func TestMatchBNActBadParams(t *testing.T) {
	cases := []struct {
		name   string
		mangle func(b *net)
		want   string
	}{
		{"no running_var role", func(b *net) { delete(b.g.Node("bn").Params, graph.RoleRunningVar) }, "node bn: no running_var"},
		{"missing tensor", func(b *net) { b.g.Node("bn").Params[graph.RoleBias] = "nowhere.bias" }, `"nowhere.bias" not in the checkpoint`},
		{"wrong length", func(b *net) { b.w.Put("bn.running_mean", []int{3}, []float64{0, 0, 0}) }, `"bn.running_mean" has 3 entries for 2 features`},
		{"matrix", func(b *net) { b.w.Put("bn.weight", []int{2, 1}, []float64{1, 1}) }, `"bn.weight" has shape [2 1]`},
		{"negative eps", func(b *net) { b.g.Node("bn").Attr.Eps = -1 }, "negative eps"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := newNet(2, 4, 1)
			b.relu("a", b.bn("bn", b.conv("conv", b.g.Input, 2, 1, 1, false), 1, -1))
			tc.mangle(b)
			_, err := Run(b.g, b.w, Options{})
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "match-bn-act") {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

func TestChooseOp(t *testing.T) {
	cases := []struct {
		act     graph.Op
		param   float64
		opt     Options
		op      graph.Op
		actName string
		actPar  float64
		approx  bool
		forced  bool
	}{
		{graph.OpReLU, 0, Options{}, graph.OpInPlaceABN, graph.ActLeakyReLU, 0.01, true, false},
		{graph.OpReLU, 0, Options{Slope: 0.2, Sync: true}, graph.OpInPlaceABNSync, graph.ActLeakyReLU, 0.2, true, false},
		{graph.OpReLU, 0, Options{ReLU: ReLUABN, Sync: true}, graph.OpABN, graph.ActReLU, 0, false, false},
		{graph.OpLeakyReLU, 0.3, Options{}, graph.OpInPlaceABN, graph.ActLeakyReLU, 0.3, false, false},
		// Slope 0 is a ReLU and follows the ReLU policy.
		{graph.OpLeakyReLU, 0, Options{}, graph.OpInPlaceABN, graph.ActLeakyReLU, 0.01, true, false},
		{graph.OpLeakyReLU, 0, Options{ReLU: ReLUABN}, graph.OpABN, graph.ActReLU, 0, false, false},
		// A negative slope is not fused: the BN is identity, the
		// activation stays (TestNegativeActivationParam).
		{graph.OpLeakyReLU, -0.1, Options{}, graph.OpInPlaceABN, graph.ActIdentity, 0, false, false},
		{graph.OpELU, 1, Options{Sync: true}, graph.OpInPlaceABNSync, graph.ActELU, 1, false, false},
		{graph.OpELU, 0, Options{ReLU: ReLUABN}, graph.OpABN, graph.ActReLU, 0, false, false},
		{graph.OpELU, -1, Options{}, graph.OpInPlaceABN, graph.ActIdentity, 0, false, false},
		{"", 0, Options{ReLU: ReLUError}, graph.OpInPlaceABN, graph.ActIdentity, 0, false, false},
	}
	for _, tc := range cases {
		t.Run(string(tc.act)+"/"+tc.opt.ReLU, func(t *testing.T) {
			b := newNet(2, 4, 1)
			y := b.bn("bn", b.conv("conv", b.g.Input, 2, 1, 1, false), 1, 1)
			if tc.act != "" {
				b.act("a", tc.act, tc.param, y)
			}
			st := upTo(t, b, tc.opt, "choose-op")
			s := siteFor(t, st, "bn")
			if s.op != tc.op || s.actName != tc.actName || s.actParam != tc.actPar || s.approx != tc.approx || s.forced != tc.forced {
				t.Fatalf("got %s %s(%g) approx=%v forced=%v reason %q", s.op, s.actName, s.actParam, s.approx, s.forced, s.reason)
			}
			if (tc.approx || tc.forced) && s.reason == "" {
				t.Fatal("no reason given")
			}
		})
	}
}

func TestCheckInPlace(t *testing.T) {
	cases := []struct {
		name    string
		input   func(b *net) *graph.Value // the BN's input
		blocked string                    // "" when in place is allowed
	}{
		{"conv", func(b *net) *graph.Value { return b.conv("p", b.g.Input, 2, 1, 1, false) }, ""},
		{"concat", func(b *net) *graph.Value { return b.cat("p", b.conv("c", b.g.Input, 2, 1, 1, false)) }, ""},
		{"add", func(b *net) *graph.Value {
			c := b.conv("c", b.g.Input, 2, 1, 1, false)
			return b.op("p", graph.OpAdd, graph.Attr{}, c, b.g.Input)
		}, ""},
		{"maxpool", func(b *net) *graph.Value { return b.maxpool("p", b.conv("c", b.g.Input, 2, 1, 1, false)) }, ""},
		{"avgpool", func(b *net) *graph.Value { return b.avgpool("p", b.conv("c", b.g.Input, 2, 1, 1, false)) }, ""},
		{"silu keeps its input", func(b *net) *graph.Value {
			return b.act("p", graph.OpSiLU, 0, b.conv("c", b.g.Input, 2, 1, 1, false))
		}, ""},
		{"se gate", func(b *net) *graph.Value {
			c := b.conv("c", b.g.Input, 2, 1, 1, false)
			gate := b.act("g", graph.OpSigmoid, 0, b.op("pool", graph.OpAdaptiveAvgPool, graph.Attr{OutputSize: [2]int{1, 1}}, c))
			return b.op("p", graph.OpMul, graph.Attr{}, c, gate)
		}, ""},
		{"sigmoid keeps its output", func(b *net) *graph.Value {
			return b.act("p", graph.OpSigmoid, 0, b.conv("c", b.g.Input, 2, 1, 1, false))
		}, "Sigmoid p"},
		{"network input", func(b *net) *graph.Value { return b.g.Input }, "network input"},
		{"relu keeps its output", func(b *net) *graph.Value { return b.relu("p", b.conv("c", b.g.Input, 2, 1, 1, false)) }, "ReLU p"},
		{"another bn", func(b *net) *graph.Value { return b.bn("p", b.conv("c", b.g.Input, 2, 1, 1, false), 1, 1) }, "BatchNorm2d p"},
		{"dropout is a view", func(b *net) *graph.Value {
			return b.op("p", graph.OpDropout, graph.Attr{}, b.conv("c", b.g.Input, 2, 1, 1, false))
		}, "Dropout p"},
		{"shared", func(b *net) *graph.Value {
			c := b.conv("c", b.g.Input, 2, 1, 1, false)
			b.conv("other", c, 2, 1, 1, false)
			return c
		}, "also read by other"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := newNet(2, 4, 1)
			y := b.bn("bn", tc.input(b), 1, 1)
			b.act("a", graph.OpLeakyReLU, 0.01, y)
			st := upTo(t, b, Options{}, "check-inplace")
			s := siteFor(t, st, "bn")
			if tc.blocked == "" {
				if s.op != graph.OpInPlaceABN {
					t.Fatalf("fell back: %s", s.reason)
				}
				return
			}
			if s.op != graph.OpABN || !s.forced || !strings.Contains(s.reason, tc.blocked) {
				t.Fatalf("got %s forced=%v reason %q, want ABN because of %q", s.op, s.forced, s.reason, tc.blocked)
			}
		})
	}
}

func TestFoldSigns(t *testing.T) {
	cases := []struct {
		name  string
		build func(b *net)
		// after fold-signs: conv key -> negated channels; site -> folded
		convFlips map[string][]int
		folded    map[string][]int
		blocked   map[string]string // site -> substring of its note
		opt       Options
	}{
		{
			name: "one reader",
			build: func(b *net) {
				b.bn("bn", b.conv("conv", b.g.Input, 3, 1, 1, true), -1, 1, -1)
			},
			convFlips: map[string][]int{"conv.weight": {0, 2}, "conv.bias": {0, 2}},
			folded:    map[string][]int{"bn": {0, 2}},
		},
		{
			name: "two agreeing readers through concats",
			build: func(b *net) {
				x := b.conv("x", b.g.Input, 2, 1, 1, false)
				y := b.conv("y", b.g.Input, 2, 1, 1, false)
				b.bn("bn1", b.cat("cat1", x, y), 1, 1, -1, 1)
				b.bn("bn2", b.cat("cat2", y, x, y), -1, 1, 1, 1, -1, 1)
			},
			// y ch0 is bn1 ch2, bn2 ch0 and ch4: all negative.
			convFlips: map[string][]int{"y.weight": {0}},
			folded:    map[string][]int{"bn1": {2}, "bn2": {0, 4}},
		},
		{
			name: "readers disagree",
			build: func(b *net) {
				x := b.conv("x", b.g.Input, 2, 1, 1, false)
				b.bn("bn1", b.cat("cat1", x), -1, 1)
				b.bn("bn2", b.cat("cat2", x), 1, 1)
			},
			blocked: map[string]string{"bn1": "feeds channel 0 of bn2, whose gamma 1 is positive"},
		},
		{
			name: "an ABN reader takes any sign",
			build: func(b *net) {
				x := b.conv("x", b.g.Input, 2, 1, 1, false)
				b.bn("bn1", b.cat("cat1", x), -1, 1)
				// ReLU under --relu abn: bn2 is ABN.
				b.act("r", graph.OpReLU, 0, b.bn("bn2", b.cat("cat2", x), 1, 1))
			},
			opt:       Options{ReLU: ReLUABN},
			convFlips: map[string][]int{"x.weight": {0}},
			folded:    map[string][]int{"bn1": {0}, "bn2": {0}},
		},
		{
			name: "a non-BN reader sees the sign",
			build: func(b *net) {
				x := b.conv("x", b.g.Input, 2, 1, 1, false)
				b.bn("bn1", b.cat("cat1", x), -1, 1)
				b.conv("other", x, 2, 1, 1, false)
			},
			blocked: map[string]string{"bn1": "also read by Conv2d other"},
		},
		{
			name: "shared weights",
			build: func(b *net) {
				x := b.conv("x", b.g.Input, 2, 1, 1, false)
				x2 := b.g.Add("x2", graph.OpConv, b.g.Node("x").Attr, map[string]string{graph.RoleWeight: "x.weight"}, b.g.Input)
				x2.Channels = 2
				b.bn("bn1", x, -1, 1)
				b.bn("bn2", x2, 1, 1)
			},
			blocked: map[string]string{"bn1": `shares parameter "x.weight"`},
		},
		{
			name: "concat along another axis",
			build: func(b *net) {
				x := b.conv("x", b.g.Input, 2, 1, 1, false)
				c := b.op("cat", graph.OpConcat, graph.Attr{Axis: 2}, x)
				c.Channels = 2
				b.bn("bn", c, -1, 1)
			},
			blocked: map[string]string{"bn": "Concat cat, which has no weights"},
		},
		{
			name: "linear producer",
			build: func(b *net) {
				f := b.op("flat", graph.OpFlatten, graph.Attr{StartDim: 1}, b.g.Input)
				l := b.g.Add("fc", graph.OpLinear, graph.Attr{InChannels: 32, OutChannels: 2, Bias: true},
					map[string]string{graph.RoleWeight: "fc.weight", graph.RoleBias: "fc.bias"}, f)
				l.Channels = 2
				b.w.Put("fc.weight", []int{2, 32}, b.randn(64, 1))
				b.w.Put("fc.bias", []int{2}, b.randn(2, 1))
				b.bn("bn", l, 1, -1)
			},
			convFlips: map[string][]int{"fc.weight": {1}, "fc.bias": {1}},
			folded:    map[string][]int{"bn": {1}},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := newNet(2, 4, 1)
			tc.build(b)
			before := snapshot(t, b.w)
			st := upTo(t, b, tc.opt, "fold-signs")
			for _, s := range st.sites {
				if !slices.Equal(s.folded, tc.folded[s.bn.Name]) {
					t.Errorf("%s folded %v, want %v", s.bn.Name, s.folded, tc.folded[s.bn.Name])
				}
				if want := tc.blocked[s.bn.Name]; !strings.Contains(s.note, want) || (want == "") != (s.note == "") {
					t.Errorf("%s note %q, want %q", s.bn.Name, s.note, want)
				}
				// Folded channels have gamma and mean negated, others not.
				for _, role := range []string{graph.RoleWeight, graph.RoleRunningMean} {
					key := s.key(role)
					now := vals(t, b, key)
					for c := range now {
						want := before[key][c]
						if slices.Contains(s.folded, c) {
							want = -want
						}
						if now[c] != want {
							t.Errorf("%s[%d] = %g, want %g", key, c, now[c], want)
						}
					}
				}
			}
			flips := st.t.flipReport()
			for key, want := range tc.convFlips {
				if !slices.Equal(flips[key], want) {
					t.Errorf("flips[%s] = %v, want %v", key, flips[key], want)
				}
			}
		})
	}
}

func TestFlipSigns(t *testing.T) {
	b := newNet(2, 4, 1)
	x := b.maxpool("pool", b.conv("x", b.g.Input, 3, 1, 1, false))
	y := b.bn("bn", b.cat("cat", x), -0.5, 0.5, -2)
	b.act("a", graph.OpLeakyReLU, 0.01, y)
	before := snapshot(t, b.w)
	st := upTo(t, b, Options{}, "flip-signs")
	s := siteFor(t, st, "bn")
	if !slices.Equal(s.flipped, []int{0, 2}) || !slices.Equal(s.bn.Sign, []int8{-1, 1, -1}) {
		t.Fatalf("flipped %v sign %v", s.flipped, s.bn.Sign)
	}
	g, m := vals(t, b, "bn.weight"), vals(t, b, "bn.running_mean")
	for c, sign := range []float64{-1, 1, -1} {
		if g[c] != sign*before["bn.weight"][c] || m[c] != sign*before["bn.running_mean"][c] {
			t.Errorf("channel %d: gamma %g mean %g", c, g[c], m[c])
		}
	}
	if !strings.Contains(s.note, "MaxPool2d pool") {
		t.Errorf("note %q", s.note)
	}
}

func TestReparametrise(t *testing.T) {
	cases := []struct {
		name      string
		act       graph.Op
		gamma     []float64
		want      []float64
		tiny      []int
		tinyError float64
	}{
		{"in place", graph.OpLeakyReLU, []float64{1, 0.5, 2e-5}, []float64{1 - 1e-5, 0.5 - 1e-5, 1e-5}, nil, 0},
		{"negative folded first", graph.OpLeakyReLU, []float64{-1, -0.25}, []float64{1 - 1e-5, 0.25 - 1e-5}, nil, 0},
		{"tiny", graph.OpLeakyReLU, []float64{1e-5, 0, 6e-6, -2e-6}, []float64{0, 0, 0, 0}, []int{1, 2, 3}, 1e-5},
		{"ABN keeps the weight", graph.OpReLU, []float64{-1, 0, 1}, []float64{-1, 0, 1}, nil, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := newNet(2, 4, 1)
			b.act("a", tc.act, 0.01, b.bn("bn", b.conv("x", b.g.Input, len(tc.gamma), 1, 1, false), tc.gamma...))
			st := upTo(t, b, Options{ReLU: ReLUABN, TinyGamma: TinyGammaApprox}, "reparametrise")
			s := siteFor(t, st, "bn")
			got := vals(t, b, "bn.weight")
			for c := range got {
				if d := got[c] - tc.want[c]; d > 1e-18 || d < -1e-18 {
					t.Fatalf("weights %v, want %v", got, tc.want)
				}
			}
			if !slices.Equal(s.tiny, tc.tiny) || s.tinyErr != tc.tinyError {
				t.Fatalf("tiny %v (%g), want %v (%g)", s.tiny, s.tinyErr, tc.tiny, tc.tinyError)
			}
			if (len(tc.tiny) > 0) != (len(st.warn) > 0) {
				t.Fatalf("warnings %q", st.warn)
			}
		})
	}
}

// TestCheckTinyGamma: the pass alone, on sites in place (leaky_relu),
// already ABN (ReLU under --relu abn) and identity, under both policies.
func TestCheckTinyGamma(t *testing.T) {
	for _, policy := range []string{TinyGammaExact, TinyGammaApprox} {
		t.Run(policy, func(t *testing.T) {
			b := newNet(2, 4, 1)
			x := b.conv("x", b.g.Input, 3, 1, 1, false)
			y := b.act("a", graph.OpLeakyReLU, 0.01, b.bn("tiny", x, -1e-7, -0.5, 2))
			y = b.relu("r", b.bn("abn", b.conv("y", y, 3, 1, 1, false), 0, 1, 1))
			y = b.act("a2", graph.OpLeakyReLU, 0.01, b.bn("big", b.conv("z", y, 3, 1, 1, false), 1e-5, -1e-5, 3))
			b.conv("head", b.bn("id", b.conv("w", y, 2, 1, 1, false), 1, 9e-6), 1, 1, 1, false)
			st := upTo(t, b, Options{ReLU: ReLUABN, TinyGamma: policy}, "check-tiny-gamma")
			want := map[string][]int{"tiny": {0}, "id": {1}}
			if policy == TinyGammaApprox {
				want = map[string][]int{}
			}
			for _, s := range st.sites {
				name := s.bn.Name
				if !slices.Equal(s.tinyExact, want[name]) {
					t.Errorf("%s: tiny channels %v, want %v", name, s.tinyExact, want[name])
				}
				wantOp := graph.OpInPlaceABN
				if want[name] != nil || name == "abn" {
					wantOp = graph.OpABN
				}
				if s.op != wantOp || (want[name] != nil) != (s.forced && strings.Contains(s.reason, "|gamma| < eps=1e-05")) {
					t.Errorf("%s: %s forced %v %q", name, s.op, s.forced, s.reason)
				}
			}
			// Nothing is negated yet, and gammas are as stored.
			if g := vals(t, b, "tiny.weight"); !slices.Equal(g, []float64{-1e-7, -0.5, 2}) {
				t.Errorf("tiny.weight %v", g)
			}
		})
	}
}

func TestFuse(t *testing.T) {
	b := newNet(2, 4, 1)
	x := b.conv("x", b.g.Input, 2, 1, 1, false)
	y := b.act("act", graph.OpELU, 0.7, b.bn("bn", x, 1, 1))
	b.g.Node("bn").Attr.MomentumNone = true
	z := b.bn("bn2", y, 1, 1) // identity site, network output
	b.op("add", graph.OpAdd, graph.Attr{}, y, y)
	b.g.Output = z
	upTo(t, b, Options{}, "fuse")
	if b.g.Node("act") != nil {
		t.Fatal("activation node kept")
	}
	n := b.g.Node("bn")
	want := graph.Attr{Features: 2, Eps: 1e-5, Momentum: 0.1, MomentumNone: true, Activation: graph.ActELU, ActParam: 0.7}
	if n.Op != graph.OpInPlaceABN || n.Attr != want || n.Params[graph.RoleWeight] != "bn.weight" {
		t.Fatalf("fused %s %+v %v", n.Op, n.Attr, n.Params)
	}
	// Readers of the activation now read the fused node.
	add := b.g.Node("add")
	if add.Inputs[0] != n.Out || add.Inputs[1] != n.Out || b.g.Node("bn2").Inputs[0] != n.Out || len(n.Out.Consumers) != 3 {
		t.Fatalf("rewiring: add reads %s, %s; consumers %d", add.Inputs[0].Name, add.Inputs[1].Name, len(n.Out.Consumers))
	}
	if o := b.g.Node("bn2"); o.Op != graph.OpABN || b.g.Output != o.Out {
		// bn2 reads an ABN-family output, which keeps it for backward.
		t.Fatalf("bn2 is %s, output %s", o.Op, b.g.Output.Name)
	}
}

func TestMarkDense(t *testing.T) {
	cases := []struct {
		name  string
		build func(b *net)
		want  []string
	}{
		{"dense layer", func(b *net) {
			x := b.conv("c0", b.g.Input, 2, 1, 1, false)
			y := b.act("a", graph.OpLeakyReLU, 0.01, b.bn("block.layer.norm1", b.cat("cat", x), 1, 1))
			b.conv("block.layer.conv1", y, 2, 1, 1, false)
		}, []string{"block.layer"}},
		{"3x3 conv", func(b *net) {
			x := b.conv("c0", b.g.Input, 2, 1, 1, false)
			y := b.act("a", graph.OpLeakyReLU, 0.01, b.bn("block.layer.norm1", b.cat("cat", x), 1, 1))
			b.conv("block.layer.conv1", y, 2, 3, 1, false)
		}, nil},
		{"concat read twice", func(b *net) {
			x := b.conv("c0", b.g.Input, 2, 1, 1, false)
			c := b.cat("cat", x)
			b.op("add", graph.OpAdd, graph.Attr{}, b.conv("block.layer.conv1", b.bn("block.layer.norm1", c, 1, 1), 2, 1, 1, false), c)
		}, nil},
		{"abn output read twice", func(b *net) {
			x := b.conv("c0", b.g.Input, 2, 1, 1, false)
			y := b.bn("block.layer.norm1", b.cat("cat", x), 1, 1)
			b.op("add", graph.OpAdd, graph.Attr{}, b.conv("block.layer.conv1", y, 2, 1, 1, false), y)
		}, nil},
		{"top-level name", func(b *net) {
			x := b.conv("c0", b.g.Input, 2, 1, 1, false)
			b.conv("conv1", b.bn("norm", b.cat("cat", x), 1, 1), 2, 1, 1, false)
		}, []string{"norm"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := newNet(2, 4, 1)
			tc.build(b)
			st := upTo(t, b, Options{}, "mark-dense")
			if !slices.Equal(st.dense, tc.want) {
				t.Fatalf("marked %v, want %v", st.dense, tc.want)
			}
			marked := 0
			for _, n := range b.g.Nodes {
				if n.Recompute != "" {
					marked++
				}
			}
			if marked != 3*len(tc.want) {
				t.Fatalf("%d nodes marked", marked)
			}
		})
	}
}
