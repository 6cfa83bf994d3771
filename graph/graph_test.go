package graph

import (
	"strings"
	"testing"
)

// chain builds input -> conv -> bn -> relu.
func chain() *Graph {
	g := New("test", 3)
	c := g.Add("conv", OpConv, Attr{InChannels: 3, OutChannels: 4}, map[string]string{RoleWeight: "conv.weight"}, g.Input)
	b := g.Add("bn", OpBatchNorm, Attr{Features: 4}, map[string]string{RoleWeight: "bn.weight"}, c)
	g.Add("relu", OpReLU, Attr{}, nil, b)
	return g
}

func TestValidate(t *testing.T) {
	cases := []struct {
		name   string
		break_ func(g *Graph)
		want   string
	}{
		{"valid", func(g *Graph) {}, ""},
		{"consumer link missing", func(g *Graph) { g.Node("conv").Out.Consumers = nil }, "not among its consumers"},
		{"order", func(g *Graph) { g.Nodes[1], g.Nodes[2] = g.Nodes[2], g.Nodes[1] }, "before it is computed"},
		{"arity", func(g *Graph) { n := g.Node("bn"); n.Inputs = append(n.Inputs, g.Input) }, "has 2 inputs"},
		{"sign length", func(g *Graph) { g.Node("bn").Sign = []int8{1, -1} }, "sign vector"},
		{"stray consumer", func(g *Graph) {
			g.Input.Consumers = append(g.Input.Consumers, &Node{Name: "ghost"})
		}, "not in the graph"},
		{"no output", func(g *Graph) { g.Output = nil }, "no output"},
		{"index", func(g *Graph) { g.Node("relu").Name = "other" }, "name index"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			g := chain()
			c.break_(g)
			err := g.Validate()
			if c.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %v, want one containing %q", err, c.want)
			}
		})
	}
}

// TestFuse replaces bn+relu by one node the way a rewrite pass does and
// checks that the links stay consistent.
func TestFuse(t *testing.T) {
	g := chain()
	bn, relu := g.Node("bn"), g.Node("relu")
	abn := g.Add("abn", OpInPlaceABN, Attr{Features: 4, Activation: ActLeakyReLU, ActParam: 0.01}, bn.Params, bn.Inputs[0])
	// Move the new node next to the old one, as passes do, to keep topological order.
	g.Nodes = append(g.Nodes[:2], append([]*Node{abn.Producer}, g.Nodes[2:len(g.Nodes)-1]...)...)
	g.ReplaceUses(relu.Out, abn)
	g.Remove(relu)
	g.Remove(bn)
	if err := g.Validate(); err != nil {
		t.Fatalf("%v\n%s", err, g)
	}
	if g.Output != abn {
		t.Fatalf("output is %s, want abn", g.Output.Name)
	}
	if got := len(g.Node("conv").Out.Consumers); got != 1 {
		t.Fatalf("conv has %d consumers after the fusion, want 1", got)
	}
	if s := g.String(); !strings.Contains(s, "abn = InPlaceABN(conv)") {
		t.Fatalf("dump lacks the fused node:\n%s", s)
	}
}

func TestRemoveUsedPanics(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Fatal("removing a node whose output is used did not panic")
		}
	}()
	g := chain()
	g.Remove(g.Node("bn"))
}

func TestMemWeights(t *testing.T) {
	w := NewMemWeights()
	w.Put("a", []int{2, 2}, []float64{1, 2, 3, 4})
	if err := w.SetValues("a", []float64{1}); err == nil {
		t.Fatal("wrong length accepted")
	}
	if err := w.SetValues("b", []float64{1}); err == nil {
		t.Fatal("unknown key accepted")
	}
	v, _ := w.Values("a")
	v[0] = 9
	if v2, _ := w.Values("a"); v2[0] != 1 {
		t.Fatal("Values returned the store's own slice")
	}
}
