package convert

import (
	"bytes"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/onnx"
	"github.com/abnconvert/abnconvert/pth"
)

var fixtures = []string{"tiny_resnet_basic", "tiny_resnext", "tiny_densenet", "tiny_vgg"}

func fixture(name string) string { return filepath.Join("..", "fixtures", "testdata", name+".pth") }

func open(t *testing.T, path string) *pth.Checkpoint {
	t.Helper()
	ck, err := pth.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ck.Close() })
	return ck
}

func values(t *testing.T, w graph.Weights, key string) []float64 {
	t.Helper()
	v, err := w.Values(key)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// TestConvertFixtures converts every committed fixture under both exact and
// approximating policies and checks the written checkpoint tensor by tensor
// against the input: InPlace-ABN weights are |gamma| - eps, ABN weights keep
// |gamma|, untouched tensors are bit-identical, keys keep their order.
func TestConvertFixtures(t *testing.T) {
	for _, name := range fixtures {
		for _, relu := range []string{"leaky", "abn"} {
			t.Run(name+"/"+relu, func(t *testing.T) {
				dir := t.TempDir()
				out := filepath.Join(dir, "out.pth")
				res, err := Run(Options{Input: fixture(name), Output: out, EmitModule: filepath.Join(dir, "m.py"),
					ReportPath: filepath.Join(dir, "r.json"), ReLU: relu})
				if err != nil {
					t.Fatal(err)
				}
				in, conv := open(t, fixture(name)), open(t, out)
				if got, want := strings.Join(conv.Keys(), ","), strings.Join(in.Keys(), ","); got != want {
					t.Fatalf("keys changed:\n got %s\nwant %s", got, want)
				}
				changed := map[string]bool{}
				for _, k := range res.Report.Changed {
					changed[k] = true
				}
				bnKeys := 0
				for _, k := range in.Keys() {
					if strings.HasSuffix(k, ".running_var") {
						bnKeys++
					}
					if !changed[k] {
						a, b := values(t, in, k), values(t, conv, k)
						for i := range a {
							if math.Float64bits(a[i]) != math.Float64bits(b[i]) {
								t.Fatalf("%s[%d] changed from %v to %v but is not reported as changed", k, i, a[i], b[i])
							}
						}
					}
				}
				if res.Report.Summary.Sites != bnKeys {
					t.Errorf("report has %d sites, checkpoint has %d BNs", res.Report.Summary.Sites, bnKeys)
				}
				for _, s := range res.Report.Sites {
					gin := values(t, in, s.Node+".weight")
					gout := values(t, conv, s.Node+".weight")
					tiny := map[int]bool{}
					for _, c := range s.TinyGammaChannels {
						tiny[c] = true
					}
					for c := range gin {
						want := math.Abs(gin[c])
						got := math.Abs(gout[c])
						if s.Op == "InPlaceABN" {
							if gout[c] < 0 {
								t.Fatalf("%s channel %d: stored weight %v is negative", s.Node, c, gout[c])
							}
							got += 1e-5
							if tiny[c] {
								want = 1e-5
							}
						}
						if math.Abs(got-want) > 1e-6*math.Max(1, want) {
							t.Fatalf("%s (%s) channel %d: effective |gamma| %v, want %v", s.Node, s.Op, c, got, want)
						}
					}
					if relu == "abn" && s.Outcome == "approximated" {
						t.Errorf("%s approximated under --relu abn", s.Node)
					}
				}
				if relu == "leaky" && res.Report.Summary.Approximated == 0 {
					t.Errorf("no site approximated under --relu leaky")
				}
			})
		}
	}
}

func TestDeterministic(t *testing.T) {
	dir := t.TempDir()
	var outs [][]byte
	for i, name := range []string{"a.pth", "b.pth"} {
		out := filepath.Join(dir, name)
		if _, err := Run(Options{Input: fixture("tiny_densenet"), Output: out}); err != nil {
			t.Fatalf("run %d: %v", i, err)
		}
		b, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		outs = append(outs, b)
	}
	if !bytes.Equal(outs[0], outs[1]) {
		t.Fatal("two conversions of the same input with the same flags differ")
	}
}

// TestRefusals: each bad call fails with a message naming the file, leaves
// no output behind and does not touch the input.
func TestRefusals(t *testing.T) {
	dir := t.TempDir()
	input := filepath.Join(dir, "in.pth")
	orig, err := os.ReadFile(fixture("tiny_resnet_basic"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(input, orig, 0o644); err != nil {
		t.Fatal(err)
	}
	existing := filepath.Join(dir, "exists.pth")
	os.WriteFile(existing, []byte("keep me"), 0o644)
	out := filepath.Join(dir, "out.pth")
	cases := []struct {
		name string
		opt  Options
		want string
	}{
		{"missing input", Options{Input: filepath.Join(dir, "nope.pth"), Output: out}, "nope.pth: no such file"},
		{"output is input", Options{Input: input, Output: input}, "is the input file"},
		{"output exists", Options{Input: input, Output: existing}, "exists.pth: already exists"},
		{"module is output", Options{Input: input, Output: out, EmitModule: out}, "given to both"},
		{"bad policy", Options{Input: input, Output: out, ReLU: "gelu"}, `--relu "gelu"`},
		{"bad slope", Options{Input: input, Output: out, Slope: 1.5}, "--slope"},
		{"relu refused", Options{Input: input, Output: out, ReLU: "error", EmitModule: filepath.Join(dir, "m.py")}, "relu"},
		{"missing dir", Options{Input: input, Output: filepath.Join(dir, "no", "out.pth")}, "does not exist"},
		{"forced arch mismatch", Options{Input: input, Output: out, Arch: "densenet121"}, "in.pth"},
		{"not a checkpoint", Options{Input: existing, Output: out, Force: true}, "exists.pth"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Run(c.opt)
			if err == nil {
				t.Fatal("no error")
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Errorf("error %q does not mention %q", err, c.want)
			}
			if strings.Contains(err.Error(), "\n") {
				t.Errorf("error spans several lines: %q", err)
			}
			entries, _ := os.ReadDir(dir)
			for _, e := range entries {
				if n := e.Name(); n != "in.pth" && n != "exists.pth" {
					t.Errorf("left %s behind", n)
				}
			}
			if b, _ := os.ReadFile(input); !bytes.Equal(b, orig) {
				t.Error("input modified")
			}
			if b, _ := os.ReadFile(existing); string(b) != "keep me" {
				t.Error("existing output overwritten")
			}
		})
	}
}

func TestForceOverwrites(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "out.pth")
	os.WriteFile(out, []byte("old"), 0o644)
	if _, err := Run(Options{Input: fixture("tiny_vgg"), Output: out, Force: true}); err != nil {
		t.Fatal(err)
	}
	open(t, out)
}

func TestInspect(t *testing.T) {
	ins, err := Inspect(fixture("tiny_densenet"), Options{})
	if err != nil {
		t.Fatal(err)
	}
	if ins.Family != "densenet" || ins.Report == nil || ins.Report.Summary.DenseLayersMarked == 0 {
		t.Fatalf("unexpected inspection: family %q, report %+v", ins.Family, ins.Report)
	}
	var b bytes.Buffer
	ins.WriteText(&b)
	if !strings.Contains(b.String(), "densenet") {
		t.Errorf("text lacks the architecture:\n%s", b.String())
	}
}

// TestNestedTrainingCheckpoint converts a checkpoint as training scripts
// save it: the state dict of a DataParallel model nested under
// "state_dict", an epoch, and SGD momentum. The structure and the other
// entries survive, keys keep "module.", and each momentum buffer follows
// its parameter: negated on the channels whose sign the conversion flipped.
func TestNestedTrainingCheckpoint(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "out.pth")
	res, err := Run(Options{Input: fixture("tiny_resnet_nested"), Output: out})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(res.StatePath, ".") != "state_dict" || res.Prefix != "module." {
		t.Fatalf("state path %v, prefix %q", res.StatePath, res.Prefix)
	}
	if len(res.Report.Flips) == 0 {
		t.Fatal("fixture has no sign flips: the test would prove nothing")
	}
	in, conv := open(t, fixture("tiny_resnet_nested")), open(t, out)
	root := conv.Root.(*pth.Dict)
	if e, ok := root.Get("epoch"); !ok || e != int64(3) {
		t.Fatalf("epoch = %v", e)
	}
	if a, ok := root.Get("arch"); !ok || a != "resnet-tiny" {
		t.Fatalf("arch = %v", a)
	}
	// Parameters in state-dict order, as model.parameters() lists them.
	var params []string
	for _, k := range in.Keys() {
		if !strings.HasSuffix(k, "running_mean") && !strings.HasSuffix(k, "running_var") && !strings.HasSuffix(k, "num_batches_tracked") {
			params = append(params, k)
		}
	}
	momentum := func(ck *pth.Checkpoint, i int) []float64 {
		opt, _ := ck.Root.(*pth.Dict).Get("optimizer")
		state, _ := opt.(*pth.Dict).Get("state")
		ps, ok := state.(*pth.Dict).Get(int64(i))
		if !ok {
			t.Fatalf("no optimizer state for parameter %d (%s)", i, params[i])
		}
		buf, _ := ps.(*pth.Dict).Get("momentum_buffer")
		v, err := ck.TensorValues(buf.(*pth.Tensor))
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	checked := 0
	for i, k := range params {
		a, b := momentum(in, i), momentum(conv, i)
		shape, _ := in.Shape(k)
		per := len(a) / shape[0]
		flipped := map[int]bool{}
		for _, c := range res.Report.Flips[k] {
			flipped[c] = true
		}
		for j := range a {
			want := a[j]
			if flipped[j/per] {
				want = -want
				checked++
			}
			if b[j] != want {
				t.Fatalf("%s momentum[%d] = %v, want %v", k, j, b[j], want)
			}
		}
	}
	if checked == 0 {
		t.Fatal("no negated momentum checked")
	}
}

func TestONNX(t *testing.T) {
	dir := t.TempDir()
	in := filepath.Join("..", "onnx", "testdata", "tiny_cnn.onnx")
	for _, ops := range []string{"custom", "standard", "fold"} {
		out := filepath.Join(dir, ops+".onnx")
		res, err := Run(Options{Input: in, Output: out, ONNXOps: ops})
		if err != nil {
			t.Fatalf("%s: %v", ops, err)
		}
		if res.Report.Summary.Sites == 0 {
			t.Fatalf("%s: no sites", ops)
		}
		m, err := onnx.Read(out)
		if err != nil {
			t.Fatalf("%s: reading the output back: %v", ops, err)
		}
		abn := 0
		for _, n := range m.Graph.Nodes {
			// Read back, the custom-domain nodes are carried as opaque ops.
			if strings.Contains(string(n.Op), "InPlaceABN") {
				abn++
			}
		}
		if (ops == "custom") != (abn > 0) {
			t.Errorf("%s: %d ABN-family nodes read back", ops, abn)
		}
	}
	cases := []struct {
		name string
		opt  Options
		want string
	}{
		{"eval export", Options{Input: filepath.Join("..", "onnx", "testdata", "tiny_cnn_eval.onnx"), Output: filepath.Join(dir, "e.onnx")}, "PRESERVE"},
		{"onnx to pth", Options{Input: in, Output: filepath.Join(dir, "x.pth")}, "ending in .onnx"},
		{"pth to onnx", Options{Input: fixture("tiny_vgg"), Output: filepath.Join(dir, "x.onnx")}, "needs an ONNX input"},
		{"module from onnx", Options{Input: in, Output: filepath.Join(dir, "y.onnx"), EmitModule: filepath.Join(dir, "m.py")}, "--emit-module"},
	}
	for _, c := range cases {
		if _, err := Run(c.opt); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: error %v, want one mentioning %q", c.name, err, c.want)
		}
	}
	ins, err := Inspect(in, Options{})
	if err != nil || ins.Report == nil {
		t.Fatalf("inspect: %v", err)
	}
}
