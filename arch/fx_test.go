package arch

import (
	"compress/gzip"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

// fxOp is one operation of a torchvision forward traced by torch.fx
// (testdata/gen_keys.py): the module's hyper-parameters for a module call,
// the constant arguments for a function call, and its inputs as indices into
// the trace (-1 for the network input).
type fxOp struct {
	Target          string  `json:"target"`
	Kind            string  `json:"kind"`
	Inputs          []int   `json:"inputs"`
	Args            []any   `json:"args"`
	In              int     `json:"in"`
	Out             int     `json:"out"`
	Kernel          [2]int  `json:"kernel"`
	Stride          [2]int  `json:"stride"`
	Padding         [2]int  `json:"padding"`
	Dilation        [2]int  `json:"dilation"`
	Groups          int     `json:"groups"`
	Bias            bool    `json:"bias"`
	Features        int     `json:"features"`
	Eps             float64 `json:"eps"`
	Momentum        float64 `json:"momentum"`
	CeilMode        bool    `json:"ceil_mode"`
	CountIncludePad bool    `json:"count_include_pad"`
	OutputSize      [2]int  `json:"output_size"`
	P               float64 `json:"p"`
}

// fxKind maps torch.fx's module classes and function names to graph ops.
var fxKind = map[string]graph.Op{
	"Conv2d": graph.OpConv, "BatchNorm2d": graph.OpBatchNorm, "ReLU": graph.OpReLU, "relu": graph.OpReLU,
	"MaxPool2d": graph.OpMaxPool, "AvgPool2d": graph.OpAvgPool, "AdaptiveAvgPool2d": graph.OpAdaptiveAvgPool,
	"adaptive_avg_pool2d": graph.OpAdaptiveAvgPool, "flatten": graph.OpFlatten, "Linear": graph.OpLinear,
	"Dropout": graph.OpDropout, "add": graph.OpAdd, "cat": graph.OpConcat,
}

// TestForwardMatchesTorchvision compares the graphs built from real key lists
// with torchvision's forward as traced by torch.fx: same operations in the
// same order, same wiring, same hyper-parameters, and node names equal to the
// module paths torchvision calls (a reused module such as a ResNet block's
// relu carries a ":n" suffix per extra use).
func TestForwardMatchesTorchvision(t *testing.T) {
	f, err := os.Open(filepath.Join("testdata", "torchvision_fx.json.gz"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	z, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	var traces map[string][]fxOp
	if err := json.NewDecoder(z).Decode(&traces); err != nil {
		t.Fatal(err)
	}
	keys := loadTorchvision(t)
	if len(traces) < 6 {
		t.Fatalf("only %d traces", len(traces))
	}
	for name, ops := range traces {
		t.Run(name, func(t *testing.T) {
			g, _, err := Recognize(weightsOf(keys[name], ""), "auto")
			if err != nil {
				t.Fatal(err)
			}
			nodes := g.Nodes[1:]
			if len(nodes) != len(ops) {
				t.Fatalf("%d nodes, torchvision's forward has %d operations", len(nodes), len(ops))
			}
			pos := map[*graph.Value]int{g.Input: -1}
			for i, n := range nodes {
				pos[n.Out] = i
			}
			bad := 0
			for i, n := range nodes {
				if msg := compareFx(n, ops[i], pos); msg != "" {
					t.Errorf("operation %d (%s): %s", i, n.Name, msg)
					if bad++; bad > 5 {
						t.FailNow()
					}
				}
			}
			if g.Output != nodes[len(nodes)-1].Out {
				t.Error("output is not the last node")
			}
		})
	}
}

func compareFx(n *graph.Node, op fxOp, pos map[*graph.Value]int) string {
	if fxKind[op.Kind] != n.Op {
		return fmt.Sprintf("op %s, torchvision calls %s %s", n.Op, op.Kind, op.Target)
	}
	if op.Target != "" {
		if base, _, _ := strings.Cut(n.Name, ":"); base != op.Target {
			return fmt.Sprintf("name %s, torchvision calls module %s", n.Name, op.Target)
		}
	}
	var ins []int
	for _, v := range n.Inputs {
		ins = append(ins, pos[v])
	}
	if fmt.Sprint(ins) != fmt.Sprint(op.Inputs) {
		return fmt.Sprintf("inputs %v, torchvision %v", ins, op.Inputs)
	}
	a := n.Attr
	var got, want string
	switch op.Kind {
	case "Conv2d":
		got = fmt.Sprint(a.InChannels, a.OutChannels, a.KernelSize, a.Stride, a.Padding, a.Dilation, a.Groups, a.Bias)
		want = fmt.Sprint(op.In, op.Out, op.Kernel, op.Stride, op.Padding, op.Dilation, op.Groups, op.Bias)
	case "BatchNorm2d":
		got, want = fmt.Sprint(a.Features, a.Eps, a.Momentum), fmt.Sprint(op.Features, op.Eps, op.Momentum)
	case "MaxPool2d":
		got = fmt.Sprint(a.KernelSize, a.Stride, a.Padding, [2]int{1, 1}, a.CeilMode)
		want = fmt.Sprint(op.Kernel, op.Stride, op.Padding, op.Dilation, op.CeilMode)
	case "AvgPool2d":
		got = fmt.Sprint(a.KernelSize, a.Stride, a.Padding, a.CeilMode, a.CountIncludePad)
		want = fmt.Sprint(op.Kernel, op.Stride, op.Padding, op.CeilMode, op.CountIncludePad)
	case "AdaptiveAvgPool2d":
		got, want = fmt.Sprint(a.OutputSize), fmt.Sprint(op.OutputSize)
	case "adaptive_avg_pool2d", "cat", "flatten":
		// The constant argument: output size, dim, start_dim.
		c := []any{a.OutputSize[0], a.OutputSize[1]}
		if op.Kind == "cat" {
			c = []any{a.Axis}
		} else if op.Kind == "flatten" {
			c = []any{a.StartDim}
		}
		got, want = fmt.Sprint(c), strings.NewReplacer("[[", "[", "]]", "]").Replace(fmt.Sprint(op.Args))
	case "Linear":
		got, want = fmt.Sprint(a.InChannels, a.OutChannels, a.Bias), fmt.Sprint(op.In, op.Out, op.Bias)
	case "Dropout":
		got, want = fmt.Sprint(a.P), fmt.Sprint(op.P)
	}
	if got != want {
		return fmt.Sprintf("attributes %s, torchvision %s", got, want)
	}
	return ""
}
