package graph

import (
	"fmt"
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
		{"residual", func(g *Graph) { residual(g, g.Input, ActIdentity) }, ""},
		{"residual after an activation", func(g *Graph) { residual(g, g.Input, ActLeakyReLU) }, "only identity"},
		{"residual is the input", func(g *Graph) { residual(g, g.Node("conv").Out, ActIdentity) }, "its own input"},
		{"two residuals", func(g *Graph) {
			residual(g, g.Input, ActIdentity)
			n := g.Node("bn")
			n.Inputs = append(n.Inputs, g.Input)
		}, "want 1, or 2"},
		{"aux", func(g *Graph) { g.SetAux("aux", g.Node("bn").Out, false) }, ""},
		{"aux not computed", func(g *Graph) { g.SetAux("aux", &Value{Name: "ghost"}, false) }, "not computed"},
		{"aux repeated", func(g *Graph) {
			g.SetAux("aux", g.Node("bn").Out, false)
			g.SetAux("aux", g.Node("conv").Out, false)
		}, "repeated"},
		{"aux is main", func(g *Graph) { g.SetAux("aux", g.Output, false) }, "is the main output"},
		{"aux removed", func(g *Graph) {
			r := g.Node("relu")
			g.SetAux("aux", r.Out, false)
			g.Output = g.Node("bn").Out
			g.Remove(r)
		}, "not computed"},
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

// residual makes chain's bn an InPlaceABN adding r to its output.
func residual(g *Graph, r *Value, act string) {
	n := g.Node("bn")
	n.Op, n.Attr.Activation = OpInPlaceABN, act
	n.Inputs = append(n.Inputs, r)
	r.Consumers = append(r.Consumers, n)
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

// TestResizeForms: Validate accepts a Resize to another tensor's size, by
// a scale factor or to a fixed size, and nothing between them; ResizeShape
// floors in * scale.
func TestResizeForms(t *testing.T) {
	for _, c := range []struct {
		name   string
		attr   Attr
		two    bool
		want   string // error substring, "" for valid
		in     []int
		output []int
	}{
		{"to another's size", Attr{Mode: "nearest"}, true, "", []int{2, 3, 5, 7}, []int{2, 3, 5, 7}},
		{"by 2", Attr{Mode: "nearest", Scale: [2]float64{2, 2}}, false, "", []int{2, 3, 5, 7}, []int{2, 3, 10, 14}},
		{"by 1.5 and 0.5", Attr{Mode: "bilinear", Scale: [2]float64{1.5, 0.5}}, false, "", []int{1, 3, 5, 7}, []int{1, 3, 7, 3}},
		{"to 4x9", Attr{Mode: "bilinear", Size: [2]int{4, 9}}, false, "", []int{1, 3, 5, 7}, []int{1, 3, 4, 9}},
		{"one input, no factor", Attr{Mode: "nearest"}, false, "neither", nil, nil},
		{"both", Attr{Mode: "nearest", Scale: [2]float64{2, 2}, Size: [2]int{4, 4}}, false, "both", nil, nil},
		{"two inputs and a factor", Attr{Mode: "nearest", Scale: [2]float64{2, 2}}, true, "second input's size", nil, nil},
		{"negative factor", Attr{Mode: "nearest", Scale: [2]float64{2, -1}}, false, "positive", nil, nil},
		{"zero size", Attr{Mode: "nearest", Size: [2]int{4, 0}}, false, "positive", nil, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			g := New("r", 3)
			ins := []*Value{g.Input}
			if c.two {
				ins = append(ins, g.Input)
			}
			g.Add("op", OpResize, c.attr, nil, ins...)
			err := g.Validate()
			if c.want != "" {
				if err == nil || !strings.Contains(err.Error(), c.want) {
					t.Fatalf("error %v, want one containing %q", err, c.want)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var ref []int
			if c.two {
				ref = c.in
			}
			got, err := c.attr.ResizeShape(c.in, ref)
			if err != nil || fmt.Sprint(got) != fmt.Sprint(c.output) {
				t.Fatalf("shape %v (%v), want %v", got, err, c.output)
			}
		})
	}
	if _, err := (Attr{Scale: [2]float64{0.1, 1}}).ResizeShape([]int{1, 1, 5, 5}, nil); err == nil {
		t.Error("a factor that leaves no row is accepted")
	}
}

// TestAuxFollowsRewrites: an auxiliary output is an output to every pass
// (IsOutput), and moves with ReplaceUses as the main output does.
func TestAuxFollowsRewrites(t *testing.T) {
	g := chain()
	bn := g.Node("bn")
	g.SetAux("aux", bn.Out, false)
	if !g.IsOutput(bn.Out) || !g.IsOutput(g.Output) || g.IsOutput(g.Node("conv").Out) || g.IsOutput(nil) {
		t.Fatalf("IsOutput wrong")
	}
	fused := g.Add("fused", OpInPlaceABN, Attr{Features: 4}, nil, g.Node("conv").Out)
	g.Output = g.Node("relu").Out
	g.ReplaceUses(bn.Out, fused)
	if g.Aux[0].Value != fused {
		t.Fatalf("aux still %s after ReplaceUses", g.Aux[0].Value.Name)
	}
	if outs := g.Outputs(); len(outs) != 2 || outs[1] != fused {
		t.Fatalf("Outputs %v", outs)
	}
	if !strings.Contains(g.String(), "aux aux fused") {
		t.Errorf("dump lacks the auxiliary output:\n%s", g.String())
	}
}
