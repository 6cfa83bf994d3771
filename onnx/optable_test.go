package onnx

import (
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

// TestOpTableONNX checks that the reader models every ONNX op type the op
// table names as the row's op (a Conv -> BN -> Relu model, then the op on
// the Relu's output, twice for a binary op), so that a row cannot claim an
// ONNX type the reader carries as an opaque node.
func TestOpTableONNX(t *testing.T) {
	n := 0
	for _, r := range graph.Ops() {
		if r.ONNX == "" {
			continue
		}
		n++
		b := convBNRelu()
		b.m.Graph.Output[0].Name = strp("z")
		in := []string{"y"}
		if r.Op.IsBinary() {
			in = []string{"y", "y"}
		}
		b.node(r.ONNX, "op", in, []string{"z"})
		m, err := readBytes(t, b.bytes(t), ReadOptions{})
		if err != nil {
			t.Errorf("%s (ONNX %s): %v", r.Op, r.ONNX, err)
			continue
		}
		if op := m.Graph.Node("op"); op == nil || op.Op != r.Op {
			t.Errorf("ONNX %s: not read as %s:\n%s", r.ONNX, r.Op, m.Graph)
		}
	}
	if n < 3 {
		t.Fatalf("only %d rows name an ONNX type", n)
	}
}
