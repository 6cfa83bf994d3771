package onnx

import (
	"encoding/json"
	"errors"
	"math"
	"os"
	"path/filepath"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/onnx/internal/pb"
)

// fuseResidual makes the InPlaceABN(identity) node named bn add the other
// input of the Add that reads it, as the rewrite does at the end of an
// inverted residual block: the Add is removed and its readers read bn.
func fuseResidual(t *testing.T, g *graph.Graph, bn string) *graph.Node {
	t.Helper()
	n := g.Node(bn)
	if n == nil || n.Op != graph.OpInPlaceABN || n.Attr.Activation != graph.ActIdentity || len(n.Out.Consumers) != 1 {
		t.Fatalf("%s is not an InPlaceABN(identity) read once: %v", bn, n)
	}
	add := n.Out.Consumers[0]
	if add.Op != graph.OpAdd || len(add.Inputs) != 2 {
		t.Fatalf("%s is read by %s (%s), not a binary Add", bn, add.Name, add.Op)
	}
	r := add.Inputs[0]
	if r == n.Out {
		r = add.Inputs[1]
	}
	g.ReplaceUses(add.Out, n.Out)
	g.Remove(add)
	n.Inputs = append(n.Inputs, r)
	r.Consumers = append(r.Consumers, n)
	if err := g.Validate(); err != nil {
		t.Fatal(err)
	}
	return n
}

// invertedBlock is x[2,4,5,5] -> Conv -> BN -> Relu (r) -> Conv -> BN
// (gammas of both signs) -> Add(BN, r) -> Conv 1x1 -> y: the end of a
// residual block, which add-residual fuses (both the sum and r are read by
// a Conv, which keeps them anyway).
func invertedBlock() *mb {
	b := newModel(13).input("x", 2, 4, 5, 5).output("y")
	b.init("c1.weight", []int64{4, 4, 3, 3}, seq(144, func(i int) float64 { return 0.3 * math.Sin(float64(i)) })...)
	bn1 := b.bnParams("bn1", []float64{0.5, 1.5, -0.75, 1})
	b.init("c2.weight", []int64{4, 4, 3, 3}, seq(144, func(i int) float64 { return 0.3 * math.Cos(float64(i)) })...)
	bn2 := b.bnParams("bn2", []float64{-0.8, 1.2, 0.6, -1.1})
	b.init("c3.weight", []int64{3, 4, 1, 1}, seq(12, func(i int) float64 { return 0.1*float64(i) - 0.5 })...)
	conv := []*pb.AttributeProto{aInts("kernel_shape", 3, 3), aInts("pads", 1, 1, 1, 1)}
	b.node("Conv", "c1", []string{"x", "c1.weight"}, []string{"a"}, conv...)
	b.node("BatchNormalization", "bn1", append([]string{"a"}, bn1...), []string{"bn1_out"}, aFloat("epsilon", 1e-5), aFloat("momentum", 0.9))
	b.node("Relu", "relu", []string{"bn1_out"}, []string{"r"})
	b.node("Conv", "c2", []string{"r", "c2.weight"}, []string{"c"}, conv...)
	b.node("BatchNormalization", "bn2", append([]string{"c"}, bn2...), []string{"bn2_out"}, aFloat("epsilon", 1e-5), aFloat("momentum", 0.9))
	b.node("Add", "/Add", []string{"bn2_out", "r"}, []string{"sum"})
	b.node("Conv", "c3", []string{"sum", "c3.weight"}, []string{"y"}, aInts("kernel_shape", 1, 1))
	b.m.Graph.Output[0].Type = tensorType(2, 3, 5, 5) // onnx's checker wants it
	return b
}

// TestResidualWrite: in every mode an InPlaceABN node that adds a residual
// is written as its InPlaceABN (custom node, BatchNormalization, or folded
// into its Conv) into the BatchNormalization's output name, then the
// model's own Add, unchanged; the file passes onnx's checker, computes what
// the original computes (numpy evaluator, leaky reference) and reads back.
// On tiny_cnn the residual is fused by hand (its sum goes to a ReLU, so
// add-residual leaves it); on invertedBlock and on torch's export of
// MobileNetV3-like blocks (fixtures/shape_nets.py's InvRes, one Add with the
// BatchNorm second) by the rewrite itself.
func TestResidualWrite(t *testing.T) {
	dir := t.TempDir()
	block := invertedBlock().save(t, dir, "block.onnx")
	blockGolden := filepath.Join(dir, "block.golden.json")
	writeJSON(t, blockGolden, map[string]any{"input_shape": []int{2, 4, 5, 5},
		"input": seq(200, func(i int) float64 { return math.Sin(0.37*float64(i)) * 2 })})
	// InvRes's input as check.py's eval task reads it.
	var inv struct {
		Input       []int     `json:"input"`
		Values      []float64 `json:"input_values"`
		OutputShape []int     `json:"output_shape"`
		Output      []float64 `json:"eval_output"`
	}
	b, err := os.ReadFile(filepath.Join(shapeDir, "invres.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &inv); err != nil {
		t.Fatal(err)
	}
	invGolden := filepath.Join(dir, "invres.golden.json")
	writeJSON(t, invGolden, map[string]any{"input_shape": inv.Input, "input": inv.Values,
		"output_shape": inv.OutputShape, "output": inv.Output})
	// The evaluator itself against PyTorch's eval output of InvRes
	// (HardSigmoid, Clip, grouped convolutions).
	invPath := filepath.Join(shapeDir, "invres_op13.onnx")
	tasks := []task{{"op": "eval", "path": invPath, "golden": invGolden, "reference": "golden"}}
	tol := map[string]float64{invPath: 1e-5}
	tinyGolden, _ := filepath.Abs("testdata/tiny_cnn.golden.json")

	type site struct{ bn, add string }
	for _, s := range []struct {
		name, path, golden string
		sites              []site
		byHand             bool
	}{
		{"tiny_cnn", "testdata/tiny_cnn.onnx", tinyGolden, []site{{"/bn2/BatchNormalization", "/Add"}}, true},
		{"block", block, blockGolden, []site{{"bn2", "/Add"}}, false},
		{"invres", invPath, invGolden, []site{
			{"/project1/project1.1/BatchNormalization", "/Add"}, {"/project2/project2.1/BatchNormalization", "/Add_1"}}, false},
	} {
		orig := map[string]*pb.NodeProto{}
		for _, n := range loadProto(t, s.path).Graph.Node {
			orig[n.GetName()] = n
		}
		for _, c := range []struct {
			mode     string
			opt      WriteOptions
			producer string // op type writing the sum's other operand
			tol      float64
		}{
			{"custom", WriteOptions{}, "InPlaceABN", 1e-6},
			{"standard", WriteOptions{StandardOps: true}, "BatchNormalization", 1e-7},
			{"fold", WriteOptions{FoldForInference: true}, "Conv", 1e-6},
		} {
			t.Run(s.name+"/"+c.mode, func(t *testing.T) {
				m := mustRead(t, s.path)
				convert(t, m)
				for _, st := range s.sites {
					if s.byHand {
						fuseResidual(t, m.Graph, st.bn)
					} else if n := m.Graph.Node(st.bn); n == nil || n.Residual() == nil {
						t.Fatalf("the rewrite did not fuse an Add into %s: %v", st.bn, n)
					}
				}
				path := filepath.Join(dir, s.name+"."+c.mode+".onnx")
				if err := m.Write(path, c.opt); err != nil {
					t.Fatal(err)
				}
				written := map[string]*pb.NodeProto{}
				readers := map[string]int{}
				producer := map[string]*pb.NodeProto{}
				for _, o := range loadProto(t, path).Graph.Node {
					written[o.GetName()] = o
					for _, in := range o.Input {
						readers[in]++
					}
					for _, v := range o.Output {
						producer[v] = o
					}
				}
				for _, st := range s.sites {
					add, want := written[st.add], orig[st.add]
					if add == nil || !proto.Equal(add, want) {
						t.Fatalf("the residual Add is written as %v, want the model's own %v", add, want)
					}
					bnOut := orig[st.bn].Output[0]
					if !containsString(add.Input, bnOut) {
						t.Fatalf("%s reads %v, not %s", st.add, add.Input, bnOut)
					}
					p := producer[bnOut]
					if p == nil || p.GetOpType() != c.producer {
						t.Fatalf("%s's input %s is made by %v, want a %s", st.add, bnOut, p, c.producer)
					}
					if c.mode == "custom" && (p.GetDomain() != Domain || nodeAttrs(p).str("activation", "") != graph.ActIdentity) {
						t.Errorf("custom node %v", p)
					}
					if readers[bnOut] != 1 {
						t.Errorf("%s has %d readers, want %s only", bnOut, readers[bnOut], st.add)
					}
				}
				back, err := ReadWith(path, ReadOptions{AllowEvalExport: c.opt.FoldForInference})
				if err != nil {
					t.Fatalf("reading it back: %v", err)
				}
				if got, want := opCount(back.Graph)[graph.OpAdd], opCount(mustRead(t, s.path).Graph)[graph.OpAdd]; got != want {
					t.Errorf("read back: %d Add nodes, the original %d", got, want)
				}
				tasks = append(tasks,
					task{"op": "checker", "path": path, "full": true},
					task{"op": "eval", "path": path, "golden": s.golden, "reference": s.path, "slope": 0.01})
				tol[path] = c.tol
			})
		}
	}
	if t.Failed() {
		return
	}
	for _, r := range runChecks(t, tasks) {
		path := str(r.Task["path"])
		what := filepath.Base(path) + " " + str(r.Task["op"])
		switch {
		case !r.OK:
			t.Errorf("%s: %s", what, r.Error)
		case r.Task["op"] == "eval" && (r.Rel > tol[path] || r.RefMax == 0):
			t.Errorf("%s: max abs diff %.3g (rel %.3g, reference max %.3g) against the original", what, r.MaxAbs, r.Rel, r.RefMax)
		case r.Task["op"] == "eval":
			t.Logf("%s: max abs diff %.3g, rel %.3g", what, r.MaxAbs, r.Rel)
		}
	}
}

func writeJSON(t *testing.T, path string, v any) {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestResidualWithoutAdd: a residual that no removed Add of the model
// stood for has no place in the file's node order: refused.
func TestResidualWithoutAdd(t *testing.T) {
	m := mustRead(t, "testdata/tiny_cnn.onnx")
	convert(t, m)
	n := m.Graph.Node("/bn2/BatchNormalization")
	r := m.Graph.Node("/conv2/Conv").Inputs[0]
	n.Inputs = append(n.Inputs, r)
	r.Consumers = append(r.Consumers, n)
	if err := m.Graph.Validate(); err != nil {
		t.Fatal(err)
	}
	for _, opt := range []WriteOptions{{}, {StandardOps: true}, {FoldForInference: true}} {
		err := m.Write(filepath.Join(t.TempDir(), "out.onnx"), opt)
		if !errors.Is(err, ErrUnsupported) {
			t.Errorf("%+v: %v, want ErrUnsupported", opt, err)
		}
	}
}
