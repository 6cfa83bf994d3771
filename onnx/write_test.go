package onnx

import (
	"bytes"
	"errors"
	"io"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/onnx/internal/pb"
	"github.com/abnconvert/abnconvert/rewrite"
)

var leaky = rewrite.Options{ReLU: rewrite.ReLULeaky, Slope: 0.01}

func loadProto(t *testing.T, path string) *pb.ModelProto {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	m := &pb.ModelProto{}
	if err := proto.Unmarshal(b, m); err != nil {
		t.Fatal(err)
	}
	return m
}

func convert(t *testing.T, m *Model) *rewrite.Report {
	t.Helper()
	rep, err := rewrite.Run(m.Graph, m.Weights, leaky)
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

func write(t *testing.T, m *Model, opt WriteOptions) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "out.onnx")
	if err := m.Write(p, opt); err != nil {
		t.Fatal(err)
	}
	return p
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	b, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(to, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestRoundTripBytes: reading and writing with no rewrite gives the input
// file back byte for byte (Go's protobuf encoder writes fields in number
// order, as the C++ one torch uses does).
func TestRoundTripBytes(t *testing.T) {
	files, _ := filepath.Glob("testdata/*.onnx")
	if len(files) < 8 {
		t.Fatalf("only %d fixtures", len(files))
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			m, err := ReadWith(f, ReadOptions{AllowEvalExport: true})
			if err != nil {
				t.Fatal(err)
			}
			out := write(t, m, WriteOptions{})
			a, _ := os.ReadFile(f)
			b, _ := os.ReadFile(out)
			if strings.Contains(f, "_ext") {
				// Written elsewhere: the external data is inlined.
				for _, init := range loadProto(t, out).Graph.Initializer {
					if init.GetDataLocation() == pb.TensorProto_EXTERNAL {
						t.Fatalf("%s still external", init.GetName())
					}
				}
				m2 := mustRead(t, out)
				for _, k := range m.Weights.Keys() {
					v1, _ := m.Weights.Values(k)
					v2, err := m2.Weights.Values(k)
					if err != nil || !equalFloats(v1, v2) {
						t.Fatalf("%s differs after inlining: %v", k, err)
					}
				}
				return
			}
			if !bytes.Equal(a, b) {
				t.Fatalf("round trip changed the file (%d -> %d bytes)", len(a), len(b))
			}
		})
	}
}

// TestExternalStaysExternal: written next to the model, external data
// keeps pointing at the same file and the model file comes out identical.
func TestExternalStaysExternal(t *testing.T) {
	dir := t.TempDir()
	copyFile(t, "testdata/tiny_dense_ext.onnx", filepath.Join(dir, "m.onnx"))
	copyFile(t, "testdata/tiny_dense_ext.data", filepath.Join(dir, "tiny_dense_ext.data"))
	m := mustRead(t, filepath.Join(dir, "m.onnx"))
	out := filepath.Join(dir, "out.onnx")
	if err := m.Write(out, WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	a, _ := os.ReadFile(filepath.Join(dir, "m.onnx"))
	b, _ := os.ReadFile(out)
	if !bytes.Equal(a, b) {
		t.Fatal("same-directory round trip changed the file")
	}
	// Converted: the tensors a sign flip changed go to the output's own
	// data file, the unchanged ones keep pointing at the input's; small
	// vectors the passes rewrote are inline.
	convert(t, m)
	var negated []string
	for _, k := range m.Weights.Keys() {
		if p := m.Weights.byKey[k]; p.set == nil && len(p.negate) > 0 && p.src.td.ext != nil {
			negated = append(negated, k)
		}
	}
	if len(negated) == 0 {
		t.Fatal("the conversion negated no external tensor: the test proves nothing")
	}
	if err := m.Write(out, WriteOptions{Force: true}); err != nil {
		t.Fatal(err)
	}
	locs := map[string]int{}
	for _, init := range loadProto(t, out).Graph.Initializer {
		if init.GetDataLocation() == pb.TensorProto_EXTERNAL {
			for _, kv := range init.ExternalData {
				if kv.GetKey() == "location" {
					locs[kv.GetValue()]++
				}
			}
		}
	}
	if locs["out.onnx.data"] != len(negated) || locs["tiny_dense_ext.data"] == 0 {
		t.Fatalf("external locations %v, want %d in out.onnx.data and the rest in tiny_dense_ext.data", locs, len(negated))
	}
	// The negated tensors read back with their signs flipped.
	back := mustRead(t, out)
	for _, k := range negated {
		want, _ := m.Weights.Values(k)
		got, err := back.Weights.Values(k)
		if err != nil || !equalFloats(want, got) {
			t.Fatalf("%s reads back differently: %v", k, err)
		}
	}
	// Written elsewhere, the changed tensors are inline like the others.
	other := filepath.Join(t.TempDir(), "o.onnx")
	if err := m.Write(other, WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(other + ".data"); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("a data file beside an output written elsewhere: %v", err)
	}
	elsewhere := mustRead(t, other)
	for _, k := range negated {
		want, _ := m.Weights.Values(k)
		if got, err := elsewhere.Weights.Values(k); err != nil || !equalFloats(want, got) {
			t.Fatalf("%s inlined differently: %v", k, err)
		}
	}
	// The data file the model reads is never a target.
	if err := m.Write(filepath.Join(dir, "tiny_dense_ext.data"), WriteOptions{Force: true}); !errors.Is(err, ErrSameFile) {
		t.Fatalf("overwriting the external data: %v", err)
	}
}

func TestWriteTarget(t *testing.T) {
	dir := t.TempDir()
	in := filepath.Join(dir, "in.onnx")
	copyFile(t, "testdata/tiny_cnn.onnx", in)
	m := mustRead(t, in)
	if err := m.Write(in, WriteOptions{Force: true}); !errors.Is(err, ErrSameFile) {
		t.Errorf("overwriting the input: %v", err)
	}
	if err := os.Link(in, filepath.Join(dir, "hard.onnx")); err == nil {
		if err := m.Write(filepath.Join(dir, "hard.onnx"), WriteOptions{Force: true}); !errors.Is(err, ErrSameFile) {
			t.Errorf("overwriting a hard link to the input: %v", err)
		}
	}
	out := filepath.Join(dir, "out.onnx")
	os.WriteFile(out, []byte("precious"), 0o644)
	if err := m.Write(out, WriteOptions{}); !errors.Is(err, ErrOutputExists) {
		t.Errorf("overwriting without force: %v", err)
	}
	if b, _ := os.ReadFile(out); string(b) != "precious" {
		t.Error("refused write touched the file")
	}
	if err := m.Write(out, WriteOptions{Force: true}); err != nil {
		t.Fatal(err)
	}
	if err := m.Write(filepath.Join(dir, "no", "such", "dir.onnx"), WriteOptions{}); err == nil {
		t.Error("wrote into a missing directory")
	}
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if strings.Contains(e.Name(), ".tmp") {
			t.Errorf("temporary file left: %s", e.Name())
		}
	}
}

// TestUnshare: in a freshly initialised export every BN reads the same
// all-ones and all-zeros initializers. InPlace-ABN stores weight = 1 - eps;
// the written model must give each changed tensor its own initializer and
// leave running_var (all ones) and every other reader alone.
func TestUnshare(t *testing.T) {
	m := mustRead(t, "testdata/tiny_cnn_fresh.onnx")
	convert(t, m)
	out := write(t, m, WriteOptions{})
	o, err := ReadWith(out, ReadOptions{AllowEvalExport: true})
	if err != nil {
		t.Fatal(err)
	}
	abn := 0
	for _, n := range loadProto(t, out).Graph.Node {
		if n.GetDomain() != Domain {
			continue
		}
		abn++
		want := [][]float64{{1 - 1e-5}, {0}, {0}, {1}} // weight, bias, running_mean, running_var
		if strings.Contains(n.GetName(), "bn4") {
			want[0][0] = 1 - 1e-3 // its eps is 1e-3
		}
		for k, in := range n.Input[1:] {
			v, err := o.Weights.Values(in)
			if err != nil {
				t.Fatalf("%s input %s: %v", n.GetName(), in, err)
			}
			for _, x := range v {
				if math.Abs(x-want[k][0]) > 1e-7 {
					t.Fatalf("%s input %d (%s) = %v, want %g", n.GetName(), k+1, in, v, want[k][0])
				}
			}
		}
	}
	if abn != 6 {
		t.Fatalf("%d ai.abnconvert nodes, want 6", abn)
	}
	// Standard ops: |weight| + eps is the original gamma again, so every
	// initializer comes out with its original bytes and nothing is added.
	std := write(t, m, WriteOptions{StandardOps: true})
	in, got := loadProto(t, "testdata/tiny_cnn_fresh.onnx").Graph.Initializer, loadProto(t, std).Graph.Initializer
	if len(in) != len(got) {
		t.Fatalf("%d initializers, want %d", len(got), len(in))
	}
	for i := range in {
		if !proto.Equal(in[i], got[i]) {
			t.Errorf("initializer %s changed", in[i].GetName())
		}
	}
}

// TestCustomNodes checks the ai.abnconvert nodes against the rewritten IR,
// and that everything the rewrite did not touch is written as read.
func TestCustomNodes(t *testing.T) {
	for _, f := range []string{"tiny_cnn", "tiny_dense"} {
		t.Run(f, func(t *testing.T) {
			path := filepath.Join("testdata", f+".onnx")
			m := mustRead(t, path)
			orig := loadProto(t, path)
			convert(t, m)
			out := loadProto(t, write(t, m, WriteOptions{}))
			if !hasOpset(out, Domain, DomainVersion) {
				t.Error("ai.abnconvert not imported")
			}
			byName := map[string]*pb.NodeProto{}
			for _, n := range out.Graph.Node {
				byName[n.GetName()] = n
			}
			origNodes := map[string]*pb.NodeProto{}
			for _, n := range orig.Graph.Node {
				origNodes[n.GetName()] = n
			}
			abns := 0
			for _, n := range m.Graph.Nodes {
				src, _, ok := m.Source(n)
				if !ok {
					continue
				}
				w := byName[src]
				switch {
				case n.Op.IsBNFamily():
					abns++
					if w == nil || w.GetDomain() != Domain || w.GetOpType() != string(n.Op) {
						t.Fatalf("%s written as %v", src, w)
					}
					a := nodeAttrs(w)
					if a.float("epsilon", 0) != nodeAttrs(origNodes[src]).float("epsilon", 0) {
						t.Errorf("%s: epsilon bits changed", src)
					}
					if got := a.float("momentum", -1); got != float32(n.Attr.Momentum) || (got != 0.1 && got != 0.05) {
						t.Errorf("%s: momentum %g (IR %g)", src, got, n.Attr.Momentum)
					}
					if a.str("activation", "") != n.Attr.Activation || a.float("activation_param", -1) != float32(n.Attr.ActParam) {
						t.Errorf("%s: activation %s(%g), IR %s(%g)", src, a.str("activation", ""), a.float("activation_param", -1), n.Attr.Activation, n.Attr.ActParam)
					}
					if a.str("recompute_group", "") != n.Recompute {
						t.Errorf("%s: recompute_group %q, IR %q", src, a.str("recompute_group", ""), n.Recompute)
					}
					sign := a.ints("sign")
					if len(sign) != len(n.Sign) {
						t.Errorf("%s: %d sign entries, IR %d", src, len(sign), len(n.Sign))
					}
					for i := range sign {
						if sign[i] != int64(n.Sign[i]) {
							t.Errorf("%s: sign[%d] = %d", src, i, sign[i])
						}
					}
					if w.Output[0] != m.valueName[n.Out] && len(n.Out.Consumers) > 0 {
						// its readers read the fused activation's output name
						for _, r := range n.Out.Consumers {
							rs, _, _ := m.Source(r)
							if rn := byName[rs]; rn != nil && !containsString(rn.Input, w.Output[0]) {
								t.Errorf("%s reads %v, not %s's output %s", rs, rn.Input, src, w.Output[0])
							}
						}
					}
				case n.Op == graph.OpConv && n.Recompute == "":
					// Convolutions keep their node (weights may have changed).
					if w == nil || !equalStrings(w.Input[:1], origNodes[src].Input[:1]) {
						t.Errorf("%s rewired: %v", src, w)
					}
				case IsOpaque(n.Op) || n.Op == graph.OpLinear || n.Op == graph.OpAdd:
					if !proto.Equal(w, origNodes[src]) {
						t.Errorf("untouched node %s changed:\n%v\n%v", src, w, origNodes[src])
					}
				}
			}
			if abns == 0 {
				t.Fatal("no ABN node")
			}
			// Initializers of unchanged keys keep their bytes.
			changed := map[string]bool{}
			for _, k := range m.Weights.Changed() {
				changed[k] = true
			}
			outInit := map[string]*pb.TensorProto{}
			for _, i := range out.Graph.Initializer {
				outInit[i.GetName()] = i
			}
			for _, i := range orig.Graph.Initializer {
				if changed[i.GetName()] {
					continue
				}
				if !proto.Equal(i, outInit[i.GetName()]) {
					t.Errorf("unchanged initializer %s rewritten", i.GetName())
				}
			}
			if f == "tiny_dense" {
				if !hasMeta(out, MetaRecompute) {
					t.Error("no recompute metadata")
				}
			}
		})
	}
}

func hasOpset(m *pb.ModelProto, domain string, v int64) bool {
	for _, o := range m.OpsetImport {
		if o.GetDomain() == domain && o.GetVersion() == v {
			return true
		}
	}
	return false
}

func hasMeta(m *pb.ModelProto, key string) bool {
	for _, kv := range m.MetadataProps {
		if kv.GetKey() == key {
			return true
		}
	}
	return false
}

func containsString(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func equalStrings(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestStandardOps: no ai.abnconvert node; the activations the rewrite
// chose; the sign flips as a Mul by a [C,1,1] constant.
func TestStandardOps(t *testing.T) {
	m := mustRead(t, "testdata/tiny_cnn.onnx")
	convert(t, m)
	out := loadProto(t, write(t, m, WriteOptions{StandardOps: true}))
	if hasOpset(out, Domain, DomainVersion) {
		t.Error("ai.abnconvert imported")
	}
	nodes := map[string]*pb.NodeProto{}
	inits := map[string]*pb.TensorProto{}
	for _, n := range out.Graph.Node {
		if n.GetDomain() != "" {
			t.Errorf("node %s in domain %s", n.GetName(), n.GetDomain())
		}
		nodes[n.GetName()] = n
	}
	for _, i := range out.Graph.Initializer {
		inits[i.GetName()] = i
	}
	flipped := 0
	for _, n := range m.Graph.Nodes {
		if !n.Op.IsBNFamily() {
			continue
		}
		src, _, _ := m.Source(n)
		bn := nodes[src]
		if bn == nil || bn.GetOpType() != "BatchNormalization" {
			t.Fatalf("%s written as %v", src, bn)
		}
		if n.Sign == nil {
			continue
		}
		flipped++
		mul := nodes[src+"/sign"]
		if mul == nil || mul.GetOpType() != "Mul" || mul.Output[0] != bn.Input[0] {
			t.Fatalf("%s: sign Mul %v", src, mul)
		}
		c := inits[mul.Input[1]]
		td, err := inspectTensor(c, "")
		if err != nil {
			t.Fatal(err)
		}
		v, _ := td.values()
		if !equalInts(td.shape, []int{len(n.Sign), 1, 1}) {
			t.Errorf("%s: sign shape %v", src, td.shape)
		}
		for i, s := range n.Sign {
			if v[i] != float64(s) {
				t.Errorf("%s: sign[%d] = %g", src, i, v[i])
			}
		}
	}
	if flipped == 0 {
		t.Error("no sign flip in tiny_cnn (its BN after the max-pool has negative gammas): the test lost its point")
	}
	if n := nodes["/relu/Relu"]; n == nil || n.GetOpType() != "LeakyRelu" || nodeAttrs(n).float("alpha", 0) != 0.01 {
		t.Errorf("BN + ReLU site: %v", n)
	}
	if n := nodes["/relu_1/Relu"]; n == nil || n.GetOpType() != "Relu" {
		t.Errorf("ReLU after the residual add changed: %v", n)
	}
	if n := nodes["/elu/Elu"]; n == nil || n.GetOpType() != "Elu" {
		t.Errorf("ELU site: %v", n)
	}
}

func TestFoldForInference(t *testing.T) {
	b := convBNRelu(0.5, -1.5, 2)
	path := b.save(t, t.TempDir(), "m.onnx")
	m := mustRead(t, path)
	convert(t, m)
	out := loadProto(t, write(t, m, WriteOptions{FoldForInference: true}))
	var ops []string
	for _, n := range out.Graph.Node {
		ops = append(ops, n.GetOpType())
	}
	if strings.Join(ops, " ") != "Conv LeakyRelu" {
		t.Fatalf("nodes %v, want Conv LeakyRelu", ops)
	}
	conv := out.Graph.Node[0]
	if len(conv.Input) != 3 || conv.Output[0] != "n" {
		t.Fatalf("folded conv %v", conv)
	}
	if len(out.Graph.Initializer) != 2 {
		t.Errorf("initializers %d, want the folded weight and bias only", len(out.Graph.Initializer))
	}
	// Check the fold: conv(x) * s + t per channel, on one output pixel
	// computed by hand would need an evaluator; instead compare the folded
	// bias with the BN formula (the conv had no bias).
	o, err := ReadWith(write(t, m, WriteOptions{FoldForInference: true}), ReadOptions{AllowEvalExport: true})
	if err != nil {
		t.Fatal(err)
	}
	bias, _ := o.Weights.Values(conv.Input[2])
	for c, g := range []float64{0.5, -1.5, 2} {
		mean, v, beta := 0.05*float64(c), 1+0.1*float64(c), 0.1*float64(c)
		want := beta - mean*g/math.Sqrt(v+float64(float32(1e-5)))
		if math.Abs(bias[c]-want) > 1e-6 {
			t.Errorf("folded bias[%d] = %g, want %g", c, bias[c], want)
		}
	}
}

// TestGraphOutputs: a fused activation that was the graph output keeps the
// name; a BN whose output is also a graph output is not fused.
func TestGraphOutputs(t *testing.T) {
	m := mustRead(t, convBNRelu().save(t, t.TempDir(), "m.onnx"))
	convert(t, m)
	for _, opt := range []WriteOptions{{}, {StandardOps: true}} {
		out := loadProto(t, write(t, m, opt))
		last := out.Graph.Node[len(out.Graph.Node)-1]
		if last.Output[0] != "y" || out.Graph.Output[0].GetName() != "y" {
			t.Errorf("%+v: last node %v", opt, last)
		}
	}
	b := convBNRelu()
	b.output("n") // the BN's output, read by the Relu too
	m = mustRead(t, b.save(t, t.TempDir(), "m.onnx"))
	convert(t, m)
	out := loadProto(t, write(t, m, WriteOptions{}))
	ops := map[string]string{}
	for _, n := range out.Graph.Node {
		ops[n.GetName()] = n.GetOpType()
		if n.GetName() == "bn" && (n.Output[0] != "n" || nodeAttrs(n).str("activation", "") != "identity") {
			t.Errorf("bn written as %v", n)
		}
	}
	if ops["relu"] != "Relu" || ops["bn"] != "InPlaceABN" {
		t.Errorf("nodes %v", ops)
	}
}

// TestUnexpressible: rewrites the writer cannot put into ONNX are refused
// with the node's name, not written wrongly.
func TestUnexpressible(t *testing.T) {
	cases := []struct {
		name   string
		change func(g *graph.Graph)
		says   string
	}{
		{"new node", func(g *graph.Graph) {
			v := g.Add("extra", graph.OpReLU, graph.Attr{}, nil, g.Output)
			g.Output = v
		}, "extra"},
		{"changed attribute", func(g *graph.Graph) { g.Node("conv").Attr.Stride = [2]int{2, 2} }, "conv"},
		{"changed op", func(g *graph.Graph) { g.Node("relu").Op = graph.OpELU }, "relu"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := mustRead(t, convBNRelu().save(t, t.TempDir(), "m.onnx"))
			c.change(m.Graph)
			err := m.Write(filepath.Join(t.TempDir(), "out.onnx"), WriteOptions{})
			if !errors.Is(err, ErrUnsupported) || !strings.Contains(err.Error(), c.says) {
				t.Fatalf("got %v", err)
			}
		})
	}
}

// TestWriteTwice: writing does not disturb the model, so a second write
// (another mode) gives the same bytes as a first write in that mode.
func TestWriteTwice(t *testing.T) {
	m := mustRead(t, "testdata/tiny_dense.onnx")
	convert(t, m)
	a := write(t, m, WriteOptions{StandardOps: true})
	write(t, m, WriteOptions{})
	write(t, m, WriteOptions{FoldForInference: true})
	b := write(t, m, WriteOptions{StandardOps: true})
	fa, _ := os.Open(a)
	fb, _ := os.Open(b)
	ba, _ := io.ReadAll(fa)
	bb, _ := io.ReadAll(fb)
	fa.Close()
	fb.Close()
	if !bytes.Equal(ba, bb) {
		t.Fatal("writes differ")
	}
}

// TestWhereChangesGo: a changed key is written where only its own readers
// see it.
func TestWhereChangesGo(t *testing.T) {
	// x -> Conv(w) -> y, and Mul(x, w2) reading an Identity of w: the
	// Identity is torch's deduplication, the Mul an opaque reader.
	shared := func() *mb {
		b := newModel(13).input("x", 1, 2, 1, 1).output("y").output("z")
		b.init("w", []int64{2, 2, 1, 1}, 1, 2, 3, 4)
		b.node("Identity", "dedup", []string{"w"}, []string{"w2"})
		b.node("Conv", "conv", []string{"x", "w"}, []string{"y"})
		b.node("Mul", "mul", []string{"x", "w"}, []string{"z"})
		b.node("Conv", "conv2", []string{"x", "w2"}, []string{"z2"})
		b.output("z2")
		return b
	}
	cases := []struct {
		name   string
		b      *mb
		key    string
		value  []float64
		inits  map[string][]float64 // initializers expected in the output
		inputs map[string][]string  // node -> inputs expected
		gone   []string             // node names no longer written
	}{
		{"read by an opaque node too: new initializer", shared(), "w", []float64{-1, -2, -3, -4},
			map[string][]float64{"w": {1, 2, 3, 4}, "w_abn": {-1, -2, -3, -4}},
			map[string][]string{"conv": {"x", "w_abn"}, "mul": {"x", "w"}, "dedup": {"w"}, "conv2": {"x", "w2"}}, nil},
		{"Identity output read by its owner alone: becomes the initializer", shared(), "w2", []float64{5, 6, 7, 8},
			map[string][]float64{"w": {1, 2, 3, 4}, "w2": {5, 6, 7, 8}},
			map[string][]string{"conv": {"x", "w"}, "conv2": {"x", "w2"}}, []string{"dedup"}},
		{"sole reader: in place", convBNRelu(), "conv.weight", seq(54, func(i int) float64 { return float64(i) }),
			map[string][]float64{"conv.weight": seq(54, func(i int) float64 { return float64(i) })},
			map[string][]string{"conv": {"x", "conv.weight"}}, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := mustRead(t, c.b.save(t, t.TempDir(), "m.onnx"))
			if err := m.Weights.SetValues(c.key, c.value); err != nil {
				t.Fatal(err)
			}
			out := write(t, m, WriteOptions{})
			o, err := ReadWith(out, ReadOptions{AllowEvalExport: true})
			if err != nil {
				t.Fatal(err)
			}
			for name, want := range c.inits {
				v, err := o.Weights.Values(name)
				if err != nil || !equalFloats(v, want) {
					t.Errorf("initializer %s = %v (%v), want %v", name, v, err, want)
				}
				if got, _ := o.Initializer(name); got != name {
					t.Errorf("%s is held by %s, want an initializer of its own", name, got)
				}
			}
			nodes := map[string]*pb.NodeProto{}
			for _, n := range loadProto(t, out).Graph.Node {
				nodes[n.GetName()] = n
			}
			for name, want := range c.inputs {
				if n := nodes[name]; n == nil || !equalStrings(n.Input, want) {
					t.Errorf("node %s: %v, want inputs %v", name, n, want)
				}
			}
			for _, name := range c.gone {
				if nodes[name] != nil {
					t.Errorf("node %s still written", name)
				}
			}
		})
	}
}
