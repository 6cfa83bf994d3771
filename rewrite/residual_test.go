package rewrite

import (
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

// TestAddResidual builds the end of a residual block, x -> conv -> BN ->
// Add(x), in the variants that decide add-residual, and checks which it
// fuses, that a fused graph computes what the original did, and what the
// report says.
func TestAddResidual(t *testing.T) {
	// block returns the block input (read by a 1x1 conv, which keeps it)
	// and the BN ending the branch.
	block := func(b *net) (x, y *graph.Value) {
		x = b.conv("stem", b.g.Input, 2, 3, 1, false)
		y = b.bn("block.bn", b.conv("block.conv", x, 2, 1, 1, false), -0.5, 1.5)
		return x, y
	}
	cases := []struct {
		name  string
		opt   Options
		build func(b *net)
		fused bool
		note  string // in the site's residual note when not fused
		// noEval: the test evaluator does not broadcast.
		noEval bool
	}{
		{"inverted residual", Options{}, func(b *net) {
			x, y := block(b)
			b.g.Output = b.conv("next", b.op("block.add", graph.OpAdd, graph.Attr{}, y, x), 2, 1, 1, false)
		}, true, "", false},
		{"residual first", Options{ReLU: ReLUABN}, func(b *net) {
			x, y := block(b)
			b.g.Output = b.conv("next", b.op("block.add", graph.OpAdd, graph.Attr{}, x, y), 2, 1, 1, false)
		}, true, "", false},
		{"sum read by a ReLU", Options{}, func(b *net) {
			// ResNet: the ReLU after the add keeps its own output.
			x, y := block(b)
			b.g.Output = b.relu("block.relu", b.op("block.add", graph.OpAdd, graph.Attr{}, y, x))
		}, false, "no reader keeps the sum block.add", false},
		{"residual read by a ReLU", Options{}, func(b *net) {
			x := b.conv("stem", b.g.Input, 2, 3, 1, false)
			y := b.bn("block.bn", b.conv("block.conv", b.relu("block.relu", x), 2, 1, 1, false), 1, 1)
			b.g.Output = b.conv("next", b.op("block.add", graph.OpAdd, graph.Attr{}, y, x), 2, 1, 1, false)
		}, false, "no other reader keeps the residual stem", false},
		{"residual computed later", Options{}, func(b *net) {
			y := b.bn("block.bn", b.conv("block.conv", b.g.Input, 2, 1, 1, false), 1, 1)
			x := b.conv("side", b.g.Input, 2, 3, 1, false)
			b.conv("side2", x, 2, 1, 1, false)
			b.g.Output = b.conv("next", b.op("block.add", graph.OpAdd, graph.Attr{}, y, x), 2, 1, 1, false)
		}, false, "computed after it", false},
		{"sum is the output", Options{}, func(b *net) {
			x, y := block(b)
			b.g.Output = b.op("block.add", graph.OpAdd, graph.Attr{}, y, x)
		}, false, "is a network output", false},
		{"broadcast", Options{}, func(b *net) {
			x := b.conv("stem", b.g.Input, 1, 3, 1, false)
			y := b.bn("block.bn", b.conv("block.conv", x, 2, 1, 1, false), 1, 1)
			b.g.Output = b.conv("next", b.op("block.add", graph.OpAdd, graph.Attr{}, y, x), 2, 1, 1, false)
		}, false, "a broadcast", true},
		{"sync", Options{Sync: true}, func(b *net) {
			x, y := block(b)
			b.g.Output = b.conv("next", b.op("block.add", graph.OpAdd, graph.Attr{}, y, x), 2, 1, 1, false)
		}, false, "", false},
		{"leaky activation", Options{}, func(b *net) {
			x := b.conv("stem", b.g.Input, 2, 3, 1, false)
			y := b.act("block.act", graph.OpLeakyReLU, 0.1, b.bn("block.bn", b.conv("block.conv", x, 2, 1, 1, false), 1, 1))
			b.g.Output = b.conv("next", b.op("block.add", graph.OpAdd, graph.Attr{}, y, x), 2, 1, 1, false)
		}, false, "", false},
		{"three addends", Options{}, func(b *net) {
			x, y := block(b)
			b.g.Output = b.conv("next", b.op("block.add", graph.OpAdd, graph.Attr{}, y, x, x), 2, 1, 1, false)
		}, false, "", false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := newNet(2, 5, 3)
			tc.build(b)
			in := b.input(2)
			var want *tensor
			if !tc.noEval {
				var err error
				if want, err = evaluate(b.g, b.w, in); err != nil {
					t.Fatal(err)
				}
			}
			rep, err := Run(b.g, b.w, tc.opt)
			if err != nil {
				t.Fatal(err)
			}
			n := b.g.Node("block.bn")
			fused := n.Residual() != nil
			if fused != tc.fused || (b.g.Node("block.add") == nil) != tc.fused {
				t.Fatalf("fused %v (add kept: %v), want %v\n%s", fused, b.g.Node("block.add") != nil, tc.fused, b.g)
			}
			var site Site
			for _, s := range rep.Sites {
				if s.Node == "block.bn" {
					site = s
				}
			}
			if tc.fused {
				if site.Residual != n.Residual().Name || site.ResidualAdd != "block.add" || rep.Summary.ResidualsFused != 1 {
					t.Fatalf("report: residual %q add %q, %d fused", site.Residual, site.ResidualAdd, rep.Summary.ResidualsFused)
				}
				if got := b.g.Node("next").Inputs[0]; got != n.Out {
					t.Fatalf("next reads %s, want the fused node", got.Name)
				}
			} else if site.Residual != "" || rep.Summary.ResidualsFused != 0 || !strings.Contains(site.ResidualNote, tc.note) {
				t.Fatalf("report: residual %q, %d fused, note %q, want one containing %q", site.Residual, rep.Summary.ResidualsFused, site.ResidualNote, tc.note)
			}
			if tc.noEval {
				return
			}
			got, err := evaluate(b.g, b.w, in)
			if err != nil {
				t.Fatal(err)
			}
			// No ReLU in these blocks: every policy is exact.
			if d := maxAbsDiff(got, want); d > 1e-9 {
				t.Fatalf("outputs differ by %g after conversion", d)
			}
		})
	}
}
