package onnx

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/runtime"
)

// actsDir holds fixtures/acts.py's ActNet: ReLU6, SiLU, a squeeze-and-
// excitation gate, Hardswish, GELU, Hardsigmoid and a mean over H, W,
// exported by torch 1.13 with training=PRESERVE at several opsets.
const actsDir = "../fixtures/testdata/acts"

type actsGolden struct {
	Input       []int     `json:"input"`
	InputValues []float64 `json:"input_values"`
	OutputShape []int     `json:"output_shape"`
	SavedBytes  int64     `json:"saved_bytes"`
	EvalOutput  []float64 `json:"eval_output"`
	TrainOutput []float64 `json:"train_output"`
}

// TestActivationExports reads torch's exports of ActNet at opsets 11 to 17:
// every node is modelled (SiLU, Hardswish and GELU fused from their
// multi-node exports), the IR is the same at every opset, the CPU runtime
// reproduces PyTorch's eval and training-mode outputs, the shape-only
// backend keeps for backward exactly what PyTorch's saved-tensor hooks
// count, and writing the model back unchanged gives the same graph.
func TestActivationExports(t *testing.T) {
	var gold actsGolden
	b, err := os.ReadFile(filepath.Join(actsDir, "act_net.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &gold); err != nil {
		t.Fatal(err)
	}
	want := map[graph.Op]int{graph.OpConv: 7, graph.OpBatchNorm: 5, graph.OpHardtanh: 1, graph.OpSiLU: 1,
		graph.OpAdaptiveAvgPool: 2, graph.OpReLU: 1, graph.OpSigmoid: 1, graph.OpMul: 1, graph.OpHardswish: 1,
		graph.OpGELU: 1, graph.OpHardsigmoid: 1}
	var first string
	for _, opset := range []int{11, 13, 14, 17} {
		t.Run(fmt.Sprint("opset", opset), func(t *testing.T) {
			path := filepath.Join(actsDir, fmt.Sprintf("act_net_op%d.onnx", opset))
			m := mustRead(t, path)
			if o := m.Opaque(); len(o) != 0 {
				t.Errorf("opaque nodes: %v", o)
			}
			got := opCount(m.Graph)
			for op, n := range want {
				if got[op] != n {
					t.Errorf("%d %s nodes, want %d", got[op], op, n)
				}
			}
			ops := opSequence(m.Graph)
			if first == "" {
				first = ops
			} else if ops != first {
				t.Errorf("opset %d reads into\n%s\nnot\n%s", opset, ops, first)
			}

			x := &runtime.HostTensor{Shape: gold.Input, Data: f32s(gold.InputValues)}
			for _, training := range []bool{false, true} {
				e, err := runtime.New(m.Graph, m.Weights, runtime.NewCPU(2), runtime.Options{})
				if err != nil {
					t.Fatal(err)
				}
				y, err := e.Forward(x, training)
				e.Close()
				if err != nil {
					t.Fatal(err)
				}
				ref := gold.EvalOutput
				if training {
					ref = gold.TrainOutput
				}
				if err := closeTo(y.Data, ref, 1e-4); err != nil {
					t.Errorf("training=%v: %v", training, err)
				}
			}

			e, err := runtime.New(m.Graph, m.Weights, runtime.NewShapes(), runtime.Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			y, err := e.Forward(&runtime.HostTensor{Shape: gold.Input}, true)
			if err != nil {
				t.Fatal(err)
			}
			if mem := e.Memory(); mem.SavedBytes != gold.SavedBytes {
				t.Errorf("saved for backward: %d bytes, PyTorch %d", mem.SavedBytes, gold.SavedBytes)
			}
			if _, _, err := e.Backward(&runtime.HostTensor{Shape: y.Shape}); err != nil {
				t.Fatal(err)
			}

			out := filepath.Join(t.TempDir(), "back.onnx")
			if err := m.Write(out, WriteOptions{}); err != nil {
				t.Fatal(err)
			}
			back := mustRead(t, out)
			if back.Graph.String() != m.Graph.String() {
				t.Errorf("written back, reads as\n%s\nnot\n%s", back.Graph, m.Graph)
			}
			if n, want := len(back.proto.Graph.Node), len(m.proto.Graph.Node); n != want {
				t.Errorf("written back with %d nodes, read with %d", n, want)
			}
		})
	}
}

// opSequence is the IR's ops in order with their attributes, without the
// node names, which differ between opsets.
func opSequence(g *graph.Graph) string {
	s := ""
	for _, n := range g.Nodes {
		s += fmt.Sprintf("%s%+v(%d)\n", n.Op, n.Attr, len(n.Inputs))
	}
	return s
}

func f32s(v []float64) []float32 {
	out := make([]float32, len(v))
	for i, x := range v {
		out[i] = float32(x)
	}
	return out
}

// closeTo compares with the runtime tests' measure: |got - want| relative
// to the largest |want|.
func closeTo(got []float32, want []float64, tol float64) error {
	if len(got) != len(want) {
		return fmt.Errorf("%d values, want %d", len(got), len(want))
	}
	scale := 0.0
	for _, w := range want {
		scale = math.Max(scale, math.Abs(w))
	}
	for i := range got {
		if d := math.Abs(float64(got[i]) - want[i]); !(d <= tol*scale) {
			return fmt.Errorf("element %d is %g, want %g (max |want| %g)", i, got[i], want[i], scale)
		}
	}
	return nil
}
