package onnx

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/runtime"
)

// TestSmoothActivationExports reads fixtures/acts2.py's torch 1.13 exports
// of Conv-BN-Tanh/SELU/CELU(0.7)/Softplus(beta 2)/Mish at opsets 13 and
// 17: every node modelled (Mish and Softplus(beta) fused from their
// multi-node forms) with its parameters, the shape-only backend keeping
// for backward what PyTorch's saved-tensor hooks count; converted and
// written in each mode (custom, standard, folded), the file holds the
// activations' nodes as read, and the standard one reads back with the
// same activations.
func TestSmoothActivationExports(t *testing.T) {
	dir := "../fixtures/testdata/acts2"
	var gold struct {
		Input      []int `json:"input"`
		SavedBytes int64 `json:"saved_bytes"`
	}
	b, err := os.ReadFile(filepath.Join(dir, "acts2_net.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &gold); err != nil {
		t.Fatal(err)
	}
	acts := map[graph.Op]graph.Attr{
		graph.OpTanh: {}, graph.OpSELU: {}, graph.OpCELU: {ActParam: 0.7},
		graph.OpSoftplus: {ActParam: 2, ActParam2: 20}, graph.OpMish: {},
	}
	checkActs := func(t *testing.T, what string, m *Model) {
		t.Helper()
		if o := m.Opaque(); len(o) != 0 {
			t.Errorf("%s: opaque nodes: %v", what, o)
		}
		seen := map[graph.Op]int{}
		for _, n := range m.Graph.Nodes {
			want, ok := acts[n.Op]
			if !ok {
				continue
			}
			seen[n.Op]++
			if n.Attr != want {
				t.Errorf("%s: %s has %+v, want %+v", what, n.Op, n.Attr, want)
			}
		}
		for op := range acts {
			if seen[op] != 1 {
				t.Errorf("%s: %d %s nodes, want 1", what, seen[op], op)
			}
		}
	}
	for _, opset := range []int{13, 17} {
		t.Run(fmt.Sprint("opset", opset), func(t *testing.T) {
			path := filepath.Join(dir, fmt.Sprintf("acts2_net_op%d.onnx", opset))
			m := mustRead(t, path)
			checkActs(t, "read", m)

			e, err := runtime.New(m.Graph, m.Weights, runtime.NewShapes(), runtime.Options{})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := e.Forward(&runtime.HostTensor{Shape: gold.Input}, true); err != nil {
				t.Fatal(err)
			}
			if mem := e.Memory(); mem.SavedBytes != gold.SavedBytes {
				t.Errorf("saved for backward: %d bytes, PyTorch %d", mem.SavedBytes, gold.SavedBytes)
			}
			e.Close()

			// The activations' ONNX nodes, which every mode writes as read.
			types := func(path string) map[string]int {
				c := map[string]int{}
				for _, n := range loadProto(t, path).Graph.Node {
					switch n.GetOpType() {
					case "Tanh", "Selu", "Softplus", "Div":
						c[n.GetOpType()]++
					case "Celu":
						c[fmt.Sprintf("Celu(%g)", nodeAttrs(n).float("alpha", 1))]++
					}
				}
				return c
			}
			want := types(path)
			convert(t, m)
			for _, opt := range []WriteOptions{{}, {StandardOps: true}, {FoldForInference: true}} {
				out := write(t, m, opt)
				if got := types(out); fmt.Sprint(got) != fmt.Sprint(want) {
					t.Errorf("written %+v: activation nodes %v, read %v", opt, got, want)
				}
				if opt.StandardOps {
					// Standard ops read back as a network to convert.
					checkActs(t, "written with standard ops", mustRead(t, out))
				}
			}
		})
	}
}
