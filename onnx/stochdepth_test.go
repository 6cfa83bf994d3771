package onnx

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/abnconvert/abnconvert/failure"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/onnx/internal/pb"
	"github.com/abnconvert/abnconvert/runtime"
)

// sdDir holds fixtures/stochdepth.py's network (two MBConv-like blocks,
// StochasticDepth(0.25, "row") and StochasticDepth(0.5, "batch") on their
// residual branches, Dropout before the head), exported in train mode by
// torch 1.13 with torch 2.6's bernoulli symbolic registered (sd_*) and by
// torch 2.6 itself (sd_t26_*), opsets 11, 13 and 17.
const sdDir = "../fixtures/testdata/stochdepth"

// TestStochasticDepthExports: the random-noise pattern torch traces for
// torchvision.ops.stochastic_depth becomes one StochasticDepth node per
// block, with its p and mode; nothing opaque is left; the eval output at
// another batch size and resolution is PyTorch's; a training step runs
// and keeps the noise (N values in row mode, one in batch mode).
func TestStochasticDepthExports(t *testing.T) {
	for _, file := range []string{"sd_op11", "sd_op13", "sd_op17", "sd_t26_op11", "sd_t26_op13", "sd_t26_op17"} {
		t.Run(file, func(t *testing.T) {
			var gold actsGolden
			b, err := os.ReadFile(filepath.Join(sdDir, file[:strings.LastIndex(file, "_op")]+".json"))
			if err != nil {
				t.Fatal(err)
			}
			if err := json.Unmarshal(b, &gold); err != nil {
				t.Fatal(err)
			}
			m := mustRead(t, filepath.Join(sdDir, file+".onnx"))
			if _, err := m.LowerLayout(); err != nil {
				t.Fatal(err)
			}
			if o := m.Opaque(); len(o) != 0 {
				t.Errorf("opaque: %v", o)
			}
			var sds []graph.Attr
			for _, nd := range m.Graph.Nodes {
				if IsOpaque(nd.Op) {
					t.Errorf("opaque node left: %s (%s)", nd.Name, nd.Op)
				}
				if nd.Op == graph.OpStochasticDepth {
					sds = append(sds, nd.Attr)
				}
			}
			want := []graph.Attr{{P: 0.25}, {P: 0.5, Mode: graph.StochasticBatch}}
			if len(sds) != 2 || sds[0].P != want[0].P || sds[0].Mode != want[0].Mode || sds[1].P != want[1].P || sds[1].Mode != want[1].Mode {
				t.Errorf("StochasticDepth nodes %+v, want %+v", sds, want)
			}
			if c := opCount(m.Graph); c[graph.OpDropout] != 1 || c[graph.OpMul] != 2 {
				t.Errorf("%d Dropout, %d Mul (the SE gates), want 1 and 2", c[graph.OpDropout], c[graph.OpMul])
			}
			x := &runtime.HostTensor{Shape: gold.Input, Data: f32s(gold.InputValues)}
			e, err := runtime.New(m.Graph, m.Weights, runtime.NewCPU(2), runtime.Options{Seed: 1})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			y, err := e.Forward(x, false)
			if err != nil {
				t.Fatal(err)
			}
			if e := maxRel(y.Data, gold.EvalOutput); e > 1e-4 {
				t.Errorf("eval output differs from PyTorch's by %.2e", e)
			}
			if _, err := e.Forward(x, true); err != nil {
				t.Fatal(err)
			}
			noise := map[int64]int{}
			for _, l := range e.Memory().Layers {
				if strings.Contains(l.Node, "stochastic_depth") {
					noise[l.SavedBytes]++
				}
			}
			if n := int64(gold.Input[0]); noise[4*n] != 1 || noise[4] != 1 {
				t.Errorf("StochasticDepth saved bytes %v, want one node with %d (row) and one with 4 (batch)", noise, 4*n)
			}
		})
	}
}

// TestStochasticDepthNotMatched: random noise that is not torchvision's
// pattern (another range, another divisor, another shape) stays an
// opaque RandomUniformLike, listed by Opaque, and the runtime refuses the
// graph as unsupported.
func TestStochasticDepthNotMatched(t *testing.T) {
	for _, tc := range []struct {
		name string
		edit func(g *pb.GraphProto)
	}{
		{"range", func(g *pb.GraphProto) {
			for _, n := range g.Node {
				if n.GetOpType() == "RandomUniformLike" {
					for _, a := range n.Attribute {
						if a.GetName() == "high" {
							a.F = proto32(2)
						}
					}
				}
			}
		}},
		{"divisor", func(g *pb.GraphProto) {
			for _, n := range g.Node {
				if n.GetOpType() == "Div" && strings.Contains(n.GetName(), "stochastic_depth") {
					n.Input[1] = n.Input[0]
				}
			}
		}},
		{"not the multiplied value", func(g *pb.GraphProto) {
			for _, n := range g.Node {
				if n.GetOpType() == "Shape" && strings.Contains(n.GetName(), "stochastic_depth") {
					n.Input[0] = g.Input[0].GetName()
				}
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := mustRead(t, filepath.Join(sdDir, "sd_op13.onnx"))
			tc.edit(m.proto.Graph)
			// Re-read the edited proto as a file would be.
			path := filepath.Join(t.TempDir(), "edited.onnx")
			raw, err := proto.Marshal(m.proto)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(path, raw, 0o644); err != nil {
				t.Fatal(err)
			}
			m = mustRead(t, path)
			if _, err := m.LowerLayout(); err != nil {
				t.Fatal(err)
			}
			if o := strings.Join(m.Opaque(), "; "); !strings.Contains(o, "RandomUniformLike x") || !strings.Contains(o, "(random: of the random ops, only torchvision's stochastic_depth") {
				t.Fatalf("opaque %q, want RandomUniformLike and why", o)
			}
			e, err := runtime.New(m.Graph, m.Weights, runtime.NewShapes(), runtime.Options{})
			if err == nil {
				_, err = e.Forward(&runtime.HostTensor{Shape: []int{2, 3, 16, 16}}, true)
				e.Close()
			}
			// The runtime names the first op it cannot run (a Shape the
			// noise still reads); Opaque, which --graph, verify and memory
			// report, lists them all.
			if err == nil || failure.Of(err) != failure.Unsupported {
				t.Errorf("runtime: %v (kind %v), want unsupported", err, failure.Of(err))
			}
		})
	}
}

func proto32(f float32) *float32 { return &f }
