package onnx

import (
	"errors"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/failure"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/onnx/internal/pb"
)

// TestUpdateFixtures regenerates the committed fixtures with real torch
// when run with -update.
func TestUpdateFixtures(t *testing.T) {
	if !*update {
		t.Skip("run with -update to regenerate the fixtures")
	}
	havePython(t, "torch torchvision onnx")
	if out, err := exec.Command(python, "testdata/gen.py", "tiny", "testdata").CombinedOutput(); err != nil {
		t.Fatalf("gen.py: %v\n%s", err, out)
	}
}

// TestFixtureIR reads every committed fixture and compares its IR with the
// dump in testdata/<name>.ir.txt (refreshed by -update).
func TestFixtureIR(t *testing.T) {
	cases := []struct {
		name   string
		ops    map[graph.Op]int
		opaque string // Model.Opaque, joined
	}{
		{"tiny_cnn", map[graph.Op]int{graph.OpConv: 5, graph.OpBatchNorm: 6, graph.OpReLU: 2, graph.OpLeakyReLU: 2, graph.OpELU: 1,
			graph.OpAdd: 1, graph.OpMaxPool: 1, graph.OpAvgPool: 1, graph.OpAdaptiveAvgPool: 1, graph.OpFlatten: 1, graph.OpLinear: 1,
			graph.OpSigmoid: 1, graph.OpMul: 1}, ""},
		{"tiny_cnn_train", map[graph.Op]int{graph.OpBatchNorm: 6, graph.OpDropout: 1}, ""},
		{"tiny_cnn_fresh", map[graph.Op]int{graph.OpBatchNorm: 6}, ""},
		{"tiny_dense", map[graph.Op]int{graph.OpConv: 10, graph.OpBatchNorm: 11, graph.OpReLU: 11, graph.OpConcat: 6,
			graph.OpAvgPool: 1, "onnx.Pad": 1}, "Pad x1 (not modelled by the IR)"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := mustRead(t, filepath.Join("testdata", c.name+".onnx"))
			got := opCount(m.Graph)
			for op, n := range c.ops {
				if got[op] != n {
					t.Errorf("%d %s nodes, want %d", got[op], op, n)
				}
			}
			if c.opaque != "" {
				if o := strings.Join(m.Opaque(), "; "); o != c.opaque {
					t.Errorf("opaque: %s, want %s", o, c.opaque)
				}
			}
			dump := filepath.Join("testdata", c.name+".ir.txt")
			if *update {
				if err := os.WriteFile(dump, []byte(m.Graph.String()), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(dump)
			if err != nil {
				t.Fatalf("%v (run with -update)", err)
			}
			if m.Graph.String() != string(want) {
				t.Errorf("IR differs from %s:\n%s", dump, m.Graph.String())
			}
		})
	}
}

// TestOpsetsAgree: torch's exports of one network at opsets 9 to 17 read
// into the same IR.
func TestOpsetsAgree(t *testing.T) {
	want := mustRead(t, "testdata/tiny_cnn.onnx").Graph.String()
	for _, f := range []string{"tiny_cnn_op9", "tiny_cnn_op11", "tiny_cnn_op15", "tiny_cnn_op17"} {
		m := mustRead(t, filepath.Join("testdata", f+".onnx"))
		if got := m.Graph.String(); got != want {
			t.Errorf("%s (opset %d) reads differently:\n%s", f, m.Opset, got)
		}
	}
}

// TestFixtureWeights checks every initializer's decoded values against
// torch's fingerprint of it.
func TestFixtureWeights(t *testing.T) {
	cases := []struct{ model, golden string }{
		{"tiny_cnn", "tiny_cnn"},
		{"tiny_cnn_fresh", "tiny_cnn_fresh"},
		{"tiny_dense", "tiny_dense"},
		{"tiny_dense_ext", "tiny_dense"}, // the same network, external data
	}
	for _, c := range cases {
		t.Run(c.model, func(t *testing.T) {
			m := mustRead(t, filepath.Join("testdata", c.model+".onnx"))
			g := readGolden(t, filepath.Join("testdata", c.golden+".golden.json"))
			if len(g.Initializers) == 0 {
				t.Fatal("golden has no initializers")
			}
			for name, fp := range g.Initializers {
				shape, ok := m.Weights.Shape(name)
				if !ok {
					t.Errorf("no key %q", name)
					continue
				}
				if !equalInts(shape, fp.Dims) {
					t.Errorf("%s: shape %v, want %v", name, shape, fp.Dims)
				}
				v, err := m.Weights.Values(name)
				if err != nil {
					t.Errorf("%s: %v", name, err)
					continue
				}
				var sum, sq float64
				for _, x := range v {
					sum += x
					sq += x * x
				}
				if !near(sum, fp.Sum, 1e-5) || !near(sq, fp.SumSq, 1e-5) {
					t.Errorf("%s: sum %g sumsq %g, want %g %g", name, sum, sq, fp.Sum, fp.SumSq)
				}
				for i, f := range fp.First {
					if v[i] != f {
						t.Errorf("%s[%d] = %g, want %g", name, i, v[i], f)
					}
				}
			}
		})
	}
}

func near(a, b, rel float64) bool {
	return math.Abs(a-b) <= rel*math.Max(1, math.Max(math.Abs(a), math.Abs(b)))
}

func equalInts(a, b []int) bool {
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

// TestIdentityChains: in a freshly initialised network torch deduplicates
// the all-ones and all-zeros BN tensors into Identity chains. Each
// parameter still gets its own key, resolving to the shared initializer,
// and each key is its own copy-on-write view.
func TestIdentityChains(t *testing.T) {
	m := mustRead(t, "testdata/tiny_cnn_fresh.onnx")
	resolves := map[string]string{
		"stem_bn.weight":      "stem_bn.weight",
		"stem_bn.running_var": "stem_bn.weight",
		"bn1.running_var":     "stem_bn.weight",
		"bn2.weight":          "stem_bn.weight",
		"bn1.bias":            "stem_bn.bias",
		"bn1.running_mean":    "stem_bn.bias",
		"bn5.weight":          "bn3.weight",
		"bn4.running_mean":    "bn3.bias",
		"conv1.weight":        "conv1.weight",
	}
	for key, init := range resolves {
		got, ok := m.Initializer(key)
		if !ok || got != init {
			t.Errorf("Initializer(%q) = %q, %v; want %q", key, got, ok, init)
		}
	}
	if s := m.Shared(); len(s) != 4 || len(s[0]) != 6 {
		t.Errorf("shared groups %v, want 4 groups of 6", s)
	}
	bn1 := m.Graph.Node("/bn1/BatchNormalization")
	want := map[string]string{"weight": "bn1.weight", "bias": "bn1.bias", "running_mean": "bn1.running_mean", "running_var": "bn1.running_var"}
	for role, key := range want {
		if bn1.Params[role] != key {
			t.Errorf("bn1 %s = %q, want %q", role, bn1.Params[role], key)
		}
	}
	if p := ModulePath(bn1); p != "bn1" {
		t.Errorf("ModulePath = %q", p)
	}
	ones, _ := m.Weights.Values("bn1.running_var")
	for _, v := range ones {
		if v != 1 {
			t.Fatalf("bn1.running_var = %v", ones)
		}
	}
	// Changing one view leaves the others alone.
	if err := m.Weights.SetValues("bn1.weight", seq(8, func(i int) float64 { return 2 })); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"stem_bn.weight", "bn1.running_var", "bn2.weight"} {
		v, _ := m.Weights.Values(k)
		if v[0] != 1 {
			t.Errorf("%s changed with bn1.weight: %v", k, v)
		}
	}
	if c := m.Weights.Changed(); len(c) != 1 || c[0] != "bn1.weight" {
		t.Errorf("Changed() = %v", c)
	}
}

// TestKeySharing: two BatchNormalizations reading the very same values
// get keys of their own; two Convs reading one weight share its key, so the
// rewrite sees the tie.
func TestKeySharing(t *testing.T) {
	b := newModel(13).input("x", 1, 2, 4, 4).output("y")
	b.init("w", []int64{2, 2, 1, 1}, 1, 0, 0, 1)
	bn := b.bnParams("bn", []float64{1, -1})
	b.node("Conv", "c1", []string{"x", "w"}, []string{"a"})
	b.node("BatchNormalization", "bn1", append([]string{"a"}, bn...), []string{"b"})
	b.node("Conv", "c2", []string{"b", "w"}, []string{"c"})
	b.node("BatchNormalization", "bn2", append([]string{"c"}, bn...), []string{"y"})
	m, err := readBytes(t, b.bytes(t), ReadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	g := m.Graph
	if g.Node("c1").Params["weight"] != "w" || g.Node("c2").Params["weight"] != "w" {
		t.Errorf("conv keys %v %v, want both w", g.Node("c1").Params, g.Node("c2").Params)
	}
	if k := g.Node("bn1").Params["weight"]; k != "bn.weight" {
		t.Errorf("bn1 weight key %q", k)
	}
	if k := g.Node("bn2").Params["running_var"]; k != "bn.running_var@bn2.running_var" {
		t.Errorf("bn2 running_var key %q", k)
	}
	if init, _ := m.Initializer("bn.weight@bn2.weight"); init != "bn.weight" {
		t.Errorf("split key resolves to %q", init)
	}
}

func TestEvalExportDetection(t *testing.T) {
	biasConvRelu := func(bnAfterPool bool, folded bool) *mb {
		b := newModel(13).input("x", 1, 2, 4, 4).output("y")
		w, bias := "conv.weight", "conv.bias"
		if folded {
			w, bias = "onnx::Conv_12", "onnx::Conv_13"
		}
		b.init(w, []int64{2, 2, 1, 1}, 1, 0, 0, 1)
		b.init(bias, []int64{2}, 0.5, -0.5)
		b.node("Conv", "conv", []string{"x", w, bias}, []string{"c"})
		b.node("Relu", "relu", []string{"c"}, []string{"r"})
		if !bnAfterPool {
			b.node("Identity", "id", []string{"r"}, []string{"y"})
			return b
		}
		b.node("MaxPool", "pool", []string{"r"}, []string{"p"}, aInts("kernel_shape", 1, 1))
		bn := b.bnParams("bn", []float64{1, 1})
		b.node("BatchNormalization", "bn", append([]string{"p"}, bn...), []string{"y"})
		return b
	}
	cases := []struct {
		name string
		b    *mb
		eval bool
	}{
		{"conv bn relu", convBNRelu(), false},
		// Module names on the Conv: a network without BatchNorm, which
		// reads (NoBatchNorm says there is nothing to convert).
		{"biased conv, no BN", biasConvRelu(false, false), false},
		{"biased conv, folded names, no BN", biasConvRelu(false, true), true},
		{"folded names, BN after a pool", biasConvRelu(true, true), true},
		{"BN only after a pool, module names", biasConvRelu(true, false), false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := readBytes(t, c.b.bytes(t), ReadOptions{})
			if got := errors.Is(err, ErrEvalExport); got != c.eval {
				t.Fatalf("eval export %v, want %v (err %v)", got, c.eval, err)
			}
			if !c.eval && err != nil {
				t.Fatal(err)
			}
			if c.eval {
				var e *EvalExportError
				if !errors.As(err, &e) || e.BiasedConvs != 1 {
					t.Fatalf("error %#v", err)
				}
				for _, s := range []string{"m.onnx", "TrainingMode.PRESERVE", "do_constant_folding=False"} {
					if !strings.Contains(err.Error(), s) {
						t.Errorf("message lacks %q: %s", s, err)
					}
				}
				if _, err := readBytes(t, c.b.bytes(t), ReadOptions{AllowEvalExport: true}); err != nil {
					t.Errorf("AllowEvalExport: %v", err)
				}
			}
		})
	}
	_, err := Read("testdata/tiny_cnn_eval.onnx")
	var e *EvalExportError
	if !errors.As(err, &e) || e.Folded == 0 || e.BatchNorms != 2 {
		t.Fatalf("torch's eval export: %v", err)
	}
}

// TestMalformed: bad files are refused with an error naming the file and
// what is wrong in it, never a panic.
func TestMalformed(t *testing.T) {
	good, err := os.ReadFile("testdata/tiny_cnn.onnx")
	if err != nil {
		t.Fatal(err)
	}
	withOpset := func(v int64) *mb { b := convBNRelu(); b.m.OpsetImport[0].Version = i64p(v); return b }
	cases := []struct {
		name  string
		bytes func() []byte
		want  error
		says  string
	}{
		{"truncated", func() []byte { return good[:len(good)/2] }, ErrMalformed, "m.onnx"},
		{"garbage", func() []byte { return []byte("\xff\xff\xff\xff not a model") }, ErrMalformed, "m.onnx"},
		{"no graph", func() []byte { b := convBNRelu(); b.m.Graph = nil; return b.bytes(t) }, ErrMalformed, "no graph"},
		{"no opset", func() []byte { b := convBNRelu(); b.m.OpsetImport = nil; return b.bytes(t) }, ErrMalformed, "opset"},
		{"opset 8", func() []byte { return withOpset(8).bytes(t) }, ErrUnsupported, "opset 8"},
		{"opset 22", func() []byte { return withOpset(22).bytes(t) }, ErrUnsupported, "opset 22"},
		{"undefined input", func() []byte {
			b := convBNRelu()
			b.m.Graph.Node[1].Input[3] = "nowhere"
			return b.bytes(t)
		}, ErrMalformed, `node bn (BatchNormalization): malformed ONNX model: input 3 "nowhere"`},
		{"defined twice", func() []byte {
			b := convBNRelu()
			b.m.Graph.Node[1].Output[0] = "c"
			return b.bytes(t)
		}, ErrMalformed, `"c" defined twice`},
		{"raw_data too short", func() []byte {
			b := convBNRelu()
			b.m.Graph.Initializer[1].RawData = b.m.Graph.Initializer[1].RawData[:8]
			return b.bytes(t)
		}, ErrMalformed, `initializer "bn.weight"`},
		{"overflowing dims", func() []byte {
			b := convBNRelu()
			b.m.Graph.Initializer[0].Dims = []int64{1 << 40, 1 << 40}
			return b.bytes(t)
		}, ErrMalformed, `initializer "conv.weight"`},
		{"output computed by nothing", func() []byte {
			b := convBNRelu()
			b.m.Graph.Output[0].Name = strp("z")
			return b.bytes(t)
		}, ErrMalformed, `graph output "z"`},
		{"no input", func() []byte {
			b := convBNRelu()
			b.m.Graph.Input = nil
			return b.bytes(t)
		}, ErrUnsupported, "no input"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := readBytes(t, c.bytes(), ReadOptions{})
			if !errors.Is(err, c.want) {
				t.Fatalf("got %v, want %v", err, c.want)
			}
			// Valid ONNX this package does not handle exits 4, the rest 2.
			if kind, want := failure.Of(err), map[bool]failure.Kind{true: failure.Unsupported, false: failure.BadInput}[c.want == ErrUnsupported]; kind != want {
				t.Errorf("class %v, want %v", kind, want)
			}
			if !strings.Contains(err.Error(), c.says) || !strings.Contains(err.Error(), "m.onnx") {
				t.Errorf("message %q lacks %q or the file name", err, c.says)
			}
		})
	}
}

// extModel is convBNRelu with conv.weight (216 bytes) in external data.
func extModel(dir, location string, offset, length int64) *mb {
	b := convBNRelu()
	t := b.m.Graph.Initializer[0]
	t.RawData = nil
	loc := pb.TensorProto_EXTERNAL
	t.DataLocation = &loc
	t.ExternalData = []*pb.StringStringEntryProto{{Key: strp("location"), Value: strp(location)}}
	if offset >= 0 {
		t.ExternalData = append(t.ExternalData, &pb.StringStringEntryProto{Key: strp("offset"), Value: strp(itoa(offset))})
	}
	if length >= 0 {
		t.ExternalData = append(t.ExternalData, &pb.StringStringEntryProto{Key: strp("length"), Value: strp(itoa(length))})
	}
	return b
}

func itoa(v int64) string { return strconv.FormatInt(v, 10) }

func TestExternalData(t *testing.T) {
	weights := rawOfValues(dtFloat, seq(54, func(i int) float64 { return math.Sin(float64(i)) }))
	setup := func(t *testing.T) string {
		dir := t.TempDir()
		// 100 bytes of padding, then the weights, then 4 more bytes.
		data := append(append(make([]byte, 100), weights...), 1, 2, 3, 4)
		if err := os.WriteFile(filepath.Join(dir, "w.bin"), data, 0o644); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	cases := []struct {
		name     string
		location string
		offset   int64
		length   int64
		prepare  func(t *testing.T, dir string)
		want     error
		says     string
	}{
		{"good", "w.bin", 100, 216, nil, nil, ""},
		{"good in a subdirectory", "sub/w.bin", 100, 216, func(t *testing.T, dir string) {
			os.Mkdir(filepath.Join(dir, "sub"), 0o755)
			os.Rename(filepath.Join(dir, "w.bin"), filepath.Join(dir, "sub", "w.bin"))
		}, nil, ""},
		{"absolute path", "/etc/passwd", 0, 216, nil, ErrMalformed, "absolute"},
		{"leaves the directory", "../w.bin", 100, 216, nil, ErrMalformed, "leaves the model's directory"},
		{"symlink out of the directory", "link.bin", 100, 216, func(t *testing.T, dir string) {
			out := t.TempDir()
			os.Rename(filepath.Join(dir, "w.bin"), filepath.Join(out, "w.bin"))
			if err := os.Symlink(filepath.Join(out, "w.bin"), filepath.Join(dir, "link.bin")); err != nil {
				t.Skip(err)
			}
		}, ErrMalformed, "outside the model's directory"},
		{"missing file", "gone.bin", 0, 216, nil, ErrMalformed, "gone.bin"},
		{"length past the end", "w.bin", 100, 1 << 40, nil, ErrMalformed, "run past"},
		{"offset past the end", "w.bin", 1 << 20, 216, nil, ErrMalformed, "beyond"},
		{"length disagrees with dims", "w.bin", 100, 212, nil, ErrMalformed, "need 216"},
		{"no length: to the end, too long", "w.bin", 100, -1, nil, ErrMalformed, "need 216"},
		{"bad offset", "w.bin", -5, 216, nil, ErrMalformed, "not a non-negative integer"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := setup(t)
			if c.prepare != nil {
				c.prepare(t, dir)
			}
			b := extModel(dir, c.location, c.offset, c.length)
			if c.offset == -5 {
				b.m.Graph.Initializer[0].ExternalData[1].Value = strp("-5")
			}
			path := b.save(t, dir, "m.onnx")
			m, err := Read(path)
			if !errors.Is(err, c.want) {
				t.Fatalf("got %v, want %v", err, c.want)
			}
			if err != nil {
				if !strings.Contains(err.Error(), c.says) || !strings.Contains(err.Error(), `"conv.weight"`) {
					t.Errorf("message %q lacks %q or the initializer", err, c.says)
				}
				return
			}
			v, err := m.Weights.Values("conv.weight")
			if err != nil {
				t.Fatal(err)
			}
			if string(rawOfValues(dtFloat, v)) != string(weights) {
				t.Fatal("external weights decoded wrongly")
			}
		})
	}
}

// TestOpsetRange: the default domain's opsets 9 to 21 read alike.
func TestOpsetRange(t *testing.T) {
	var want string
	for _, v := range []int64{MinOpset, 14, 18, MaxOpset} {
		b := convBNRelu()
		b.m.OpsetImport[0].Version = i64p(v)
		m, err := readBytes(t, b.bytes(t), ReadOptions{})
		if err != nil {
			t.Fatalf("opset %d: %v", v, err)
		}
		if m.Opset != v {
			t.Errorf("Opset = %d, want %d", m.Opset, v)
		}
		if want == "" {
			want = m.Graph.String()
		} else if got := m.Graph.String(); got != want {
			t.Errorf("opset %d reads differently:\n%s", v, got)
		}
	}
}
