package onnx

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

// TestFuse: the multi-node exports of SiLU, Hardswish, GELU and Mish become one
// IR node, and only when every inner value stays inside the pattern and
// the constants are torch's.
func TestFuse(t *testing.T) {
	silu := func(swap, extraReader bool) *mb {
		b := newModel(13).input("x", 1, 4, 6, 6).output("y")
		b.node("Sigmoid", "s", []string{"x"}, []string{"sg"})
		in := []string{"x", "sg"}
		if swap {
			in = []string{"sg", "x"}
		}
		b.node("Mul", "n", in, []string{"y"})
		if extraReader {
			b.node("Relu", "r", []string{"sg"}, []string{"r"})
			b.output("r")
		}
		return b
	}
	hswish := func(alpha float32) *mb {
		b := newModel(13).input("x", 1, 4, 6, 6).output("y")
		b.node("HardSigmoid", "h", []string{"x"}, []string{"hs"}, aFloat("alpha", alpha))
		b.node("Mul", "n", []string{"x", "hs"}, []string{"y"})
		return b
	}
	mish := func(spIn string, swap bool) *mb {
		b := newModel(13).input("x", 1, 4, 6, 6).output("y")
		b.node("Relu", "r", []string{"x"}, []string{"rx"})
		b.node("Softplus", "sp", []string{spIn}, []string{"spo"})
		b.node("Tanh", "t", []string{"spo"}, []string{"th"})
		in := []string{"x", "th"}
		if swap {
			in = []string{"th", "x"}
		}
		b.node("Mul", "n", in, []string{"y"})
		b.output("rx")
		return b
	}
	softplusBeta := func(mul, div float64, swapDiv bool) *mb {
		b := newModel(13).input("x", 1, 4, 6, 6).output("y")
		b.init("c_mul", nil, mul)
		b.init("c_div", nil, div)
		b.node("Mul", "m", []string{"x", "c_mul"}, []string{"mx"})
		b.node("Softplus", "sp", []string{"mx"}, []string{"spo"})
		in := []string{"spo", "c_div"}
		if swapDiv {
			in = []string{"c_div", "spo"}
		}
		b.node("Div", "n", in, []string{"y"})
		return b
	}
	gelu := func(sqrt2, half float64) *mb {
		b := newModel(13).input("x", 1, 4, 6, 6).output("y")
		b.init("c_sqrt2", nil, sqrt2)
		b.init("c_one", nil, 1)
		b.init("c_half", nil, half)
		b.node("Div", "d", []string{"x", "c_sqrt2"}, []string{"dv"})
		b.node("Erf", "e", []string{"dv"}, []string{"er"})
		b.node("Add", "a", []string{"er", "c_one"}, []string{"ad"})
		b.node("Mul", "m", []string{"x", "ad"}, []string{"m1"})
		b.node("Mul", "n", []string{"m1", "c_half"}, []string{"y"})
		return b
	}
	cases := []struct {
		name  string
		b     *mb
		op    graph.Op
		nodes int // IR nodes, the input included
	}{
		{"silu", silu(false, false), graph.OpSiLU, 2},
		{"silu, sigmoid first", silu(true, false), graph.OpSiLU, 2},
		{"sigmoid read elsewhere", silu(false, true), graph.OpMul, 0},
		{"hardswish", hswish(1.0 / 6), graph.OpHardswish, 2},
		{"hardsigmoid of another alpha", hswish(0.2), graph.OpMul, 3},
		{"mish", mish("x", false), graph.OpMish, 4},
		{"mish, tanh first", mish("x", true), graph.OpMish, 4},
		{"mish of another value", mish("rx", false), graph.OpMul, 6},
		{"softplus beta 2", softplusBeta(2, 2, false), graph.OpSoftplus, 2},
		{"softplus, two betas", softplusBeta(2, 3, false), "onnx.Div", 4},
		{"softplus, beta over it", softplusBeta(2, 2, true), "onnx.Div", 4},
		{"gelu", gelu(1.4142135623730951, 0.5), graph.OpGELU, 2},
		{"gelu of another constant", gelu(2, 0.5), "onnx.Mul", 6},
		{"gelu not halved", gelu(1.4142135623730951, 0.25), "onnx.Mul", 6},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m, err := readBytes(t, c.b.bytes(t), ReadOptions{})
			if err != nil {
				t.Fatal(err)
			}
			n := m.Graph.Node("n")
			if n == nil || n.Op != c.op {
				t.Fatalf("node n is %v, want %s:\n%s", n, c.op, m.Graph)
			}
			if c.op == graph.OpSoftplus && n.Attr != (graph.Attr{ActParam: 2, ActParam2: 20}) {
				t.Errorf("fused softplus has beta %g, threshold %g, want 2 and 20", n.Attr.ActParam, n.Attr.ActParam2)
			}
			if c.nodes != 0 && len(m.Graph.Nodes) != c.nodes {
				t.Errorf("%d IR nodes, want %d:\n%s", len(m.Graph.Nodes), c.nodes, m.Graph)
			}
			if c.nodes == 2 && (len(n.Inputs) != 1 || n.Inputs[0] != m.Graph.Input) {
				t.Errorf("fused node reads %v, want the input", n.Inputs)
			}
			if err := m.Graph.Validate(); err != nil {
				t.Fatal(err)
			}
			// Written back unchanged: every ONNX node as read.
			out := filepath.Join(t.TempDir(), "o.onnx")
			if err := m.Write(out, WriteOptions{}); err != nil {
				t.Fatal(err)
			}
			back := mustRead(t, out)
			if back.Graph.String() != m.Graph.String() || len(back.proto.Graph.Node) != len(m.proto.Graph.Node) {
				t.Errorf("written back as\n%s", back.Graph)
			}
		})
	}
}

// TestFusedRenamedInput: the inner nodes of a fused pattern are written as
// read, so a rewrite that moves the pattern onto another value is refused,
// not written half done.
func TestFusedRenamedInput(t *testing.T) {
	b := newModel(13).input("x", 1, 4, 6, 6).input("x2", 1, 4, 6, 6).output("y")
	b.node("Sigmoid", "s", []string{"x"}, []string{"sg"})
	b.node("Mul", "n", []string{"x", "sg"}, []string{"y"})
	m, err := readBytes(t, b.bytes(t), ReadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	n := m.Graph.Node("n")
	if n.Op != graph.OpSiLU {
		t.Fatalf("not fused:\n%s", m.Graph)
	}
	other := m.Graph.Node("input:x2").Out
	n.Inputs[0].Consumers = nil
	n.Inputs[0] = other
	other.Consumers = append(other.Consumers, n)
	err = m.Write(filepath.Join(t.TempDir(), "o.onnx"), WriteOptions{})
	if !errors.Is(err, ErrUnsupported) || !strings.Contains(err.Error(), "stands for 2 ONNX nodes") {
		t.Fatalf("got %v, want the renamed input refused", err)
	}
}
