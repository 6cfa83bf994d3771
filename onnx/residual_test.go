package onnx

import (
	"errors"
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

// TestResidualWrite: in every mode an InPlaceABN node that adds a residual
// is written as its InPlaceABN (custom node, BatchNormalization, or folded
// into its Conv) into the BatchNormalization's output name, then the
// model's own Add, unchanged; the file passes onnx's checker, computes what
// the original computes (numpy evaluator, leaky reference) and reads back.
func TestResidualWrite(t *testing.T) {
	const src = "testdata/tiny_cnn.onnx"
	orig := loadProto(t, src)
	var origAdd *pb.NodeProto
	for _, n := range orig.Graph.Node {
		if n.GetName() == "/Add" {
			origAdd = n
		}
	}
	if origAdd == nil {
		t.Fatal("tiny_cnn has no /Add")
	}
	golden, _ := filepath.Abs("testdata/tiny_cnn.golden.json")
	dir := t.TempDir()
	var tasks []task
	tol := map[string]float64{}
	for _, c := range []struct {
		mode     string
		opt      WriteOptions
		producer string // op type writing the Add's first input
		tol      float64
	}{
		{"custom", WriteOptions{}, "InPlaceABN", 1e-6},
		{"standard", WriteOptions{StandardOps: true}, "BatchNormalization", 1e-7},
		{"fold", WriteOptions{FoldForInference: true}, "Conv", 1e-6},
	} {
		t.Run(c.mode, func(t *testing.T) {
			m := mustRead(t, src)
			convert(t, m)
			fuseResidual(t, m.Graph, "/bn2/BatchNormalization")
			path := filepath.Join(dir, c.mode+".onnx")
			if err := m.Write(path, c.opt); err != nil {
				t.Fatal(err)
			}
			out := loadProto(t, path)
			var add *pb.NodeProto
			readers := map[string]int{}
			producer := map[string]*pb.NodeProto{}
			for _, o := range out.Graph.Node {
				if o.GetName() == "/Add" {
					add = o
				}
				for _, in := range o.Input {
					readers[in]++
				}
				for _, v := range o.Output {
					producer[v] = o
				}
			}
			if add == nil || !proto.Equal(add, origAdd) {
				t.Fatalf("the residual Add is written as %v, want the model's own %v", add, origAdd)
			}
			bnOut := add.Input[0]
			p := producer[bnOut]
			if p == nil || p.GetOpType() != c.producer {
				t.Fatalf("the Add's input %s is made by %v, want a %s", bnOut, p, c.producer)
			}
			if c.mode == "custom" && (p.GetDomain() != Domain || nodeAttrs(p).str("activation", "") != graph.ActIdentity) {
				t.Errorf("custom node %v", p)
			}
			if readers[bnOut] != 1 {
				t.Errorf("%s has %d readers, want the Add only", bnOut, readers[bnOut])
			}
			back, err := ReadWith(path, ReadOptions{AllowEvalExport: c.opt.FoldForInference})
			if err != nil {
				t.Fatalf("reading it back: %v", err)
			}
			if got, want := opCount(back.Graph)[graph.OpAdd], opCount(mustRead(t, src).Graph)[graph.OpAdd]; got != want {
				t.Errorf("read back: %d Add nodes, the original %d", got, want)
			}
			tasks = append(tasks,
				task{"op": "checker", "path": path, "full": true},
				task{"op": "eval", "path": path, "golden": golden, "reference": src, "slope": 0.01})
			tol[path] = c.tol
		})
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
