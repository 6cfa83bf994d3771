package rewrite

import (
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

// TestSmoothActsKeptAfterBN: a BN followed by Tanh, SELU, CELU, Softplus
// or Mish, which InPlace-ABN cannot invert, becomes an identity
// InPlace-ABN with the activation kept after it, unchanged (op and
// parameters), reading the BN's output; the site's reason names the op.
func TestSmoothActsKeptAfterBN(t *testing.T) {
	cases := []struct {
		op   graph.Op
		attr graph.Attr
	}{
		{graph.OpTanh, graph.Attr{}},
		{graph.OpSELU, graph.Attr{}},
		{graph.OpCELU, graph.Attr{ActParam: 0.7}},
		{graph.OpSoftplus, graph.Attr{ActParam: 2, ActParam2: 3}},
		{graph.OpMish, graph.Attr{}},
	}
	for _, c := range cases {
		for _, relu := range []string{"", ReLUABN} {
			t.Run(string(c.op)+"/"+relu, func(t *testing.T) {
				b := newNet(2, 4, 1)
				y := b.bn("bn", b.conv("conv", b.g.Input, 2, 1, 1, false), 1, -1)
				v := b.g.Add("a", c.op, c.attr, nil, y)
				v.Channels = channels(y)

				st := upTo(t, b, Options{ReLU: relu}, "match-bn-act")
				s := siteFor(t, st, "bn")
				if s.act != nil || !strings.Contains(s.match, "followed by "+string(c.op)+" a, which InPlace-ABN cannot invert") {
					t.Fatalf("site fused %v, reason %q", s.act, s.match)
				}

				b = newNet(2, 4, 1)
				y = b.bn("bn", b.conv("conv", b.g.Input, 2, 1, 1, false), 1, -1)
				v = b.g.Add("a", c.op, c.attr, nil, y)
				v.Channels = channels(y)
				if _, err := Run(b.g, b.w, Options{ReLU: relu}); err != nil {
					t.Fatal(err)
				}
				if err := b.g.Validate(); err != nil {
					t.Fatal(err)
				}
				a := b.g.Node("a")
				if a == nil || a.Op != c.op || a.Attr != c.attr || len(a.Inputs) != 1 {
					t.Fatalf("activation after the rewrite: %v\n%s", a, b.g)
				}
				bn := a.Inputs[0].Producer
				if !bn.Op.IsBNFamily() || bn.Op == graph.OpBatchNorm || (bn.Attr.Activation != graph.ActIdentity && bn.Attr.Activation != "") {
					t.Fatalf("the BN became %s(%s), want an ABN-family layer with the identity activation\n%s", bn.Op, bn.Attr.Activation, b.g)
				}
			})
		}
	}
}
