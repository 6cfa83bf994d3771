package convert

import (
	"encoding/json"
	"errors"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/model"
	"github.com/abnconvert/abnconvert/pth"
	"github.com/abnconvert/abnconvert/rewrite"
	"github.com/abnconvert/abnconvert/runtime"
	"github.com/abnconvert/abnconvert/safetensors"
)

func f4(name string) string { return filepath.Join("..", "fixtures", "testdata", "formats4", name) }

// golden4 is a NAME.golden.json of fixtures/formats4.py.
type golden4 struct {
	Keys        []string  `json:"keys"`
	InputShape  []int     `json:"input_shape"`
	Input       []float32 `json:"input"`
	OutputShape []int     `json:"output_shape"`
	Output      []float32 `json:"output"`
}

func readGolden4(t *testing.T, name string) *golden4 {
	t.Helper()
	b, err := os.ReadFile(f4(name + ".golden.json"))
	if err != nil {
		t.Fatal(err)
	}
	var g golden4
	if err := json.Unmarshal(b, &g); err != nil {
		t.Fatal(err)
	}
	return &g
}

// evalOutput runs g over w in the runtime, eval mode.
func evalOutput(t *testing.T, g *graph.Graph, w graph.Weights, shape []int, x []float32) []float32 {
	t.Helper()
	ex, err := runtime.New(g, w, runtime.NewCPU(0), runtime.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer ex.Close()
	in := runtime.NewHostTensor(shape...)
	copy(in.Data, x)
	y, err := ex.Forward(in, false)
	if err != nil {
		t.Fatal(err)
	}
	return y.Data
}

func relErr(got, want []float32) float64 {
	if len(got) != len(want) {
		return math.Inf(1)
	}
	d, s := 0.0, 0.0
	for i := range want {
		d = math.Max(d, math.Abs(float64(got[i])-float64(want[i])))
		s = math.Max(s, math.Abs(float64(want[i])))
	}
	return d / s
}

func allValues(t *testing.T, w graph.Weights) map[string][]float64 {
	t.Helper()
	out := map[string][]float64{}
	for _, k := range w.Keys() {
		out[k] = values(t, w, k)
	}
	return out
}

func openAny(t *testing.T, path string) (graph.Weights, func()) {
	t.Helper()
	s, err := model.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	return s.Weights, s.Close
}

// TestSafetensorsConversions: every allowed combination of .pth and
// .safetensors in and out gives the same converted tensors as the plain
// .pth conversion of the same state dict, keeps every key, shape and dtype,
// and emits a module.
func TestSafetensorsConversions(t *testing.T) {
	dir := t.TempDir()
	ref := filepath.Join(dir, "ref.pth")
	if _, err := Run(Options{Input: fixture("tiny_resnet_basic"), Output: ref}); err != nil {
		t.Fatal(err)
	}
	refW, done := openAny(t, ref)
	defer done()
	want := allValues(t, refW)
	cases := []struct{ in, out string }{
		{f4("tiny_resnet_basic.safetensors"), "a.safetensors"},
		{f4("tiny_resnet_basic.safetensors"), "b.pth"},
		{fixture("tiny_resnet_basic"), "c.safetensors"},
	}
	for _, c := range cases {
		t.Run(filepath.Ext(c.in)+"->"+filepath.Ext(c.out), func(t *testing.T) {
			out := filepath.Join(dir, c.out)
			mod := filepath.Join(dir, c.out+".py")
			res, err := Run(Options{Input: c.in, Output: out, EmitModule: mod})
			if err != nil {
				t.Fatal(err)
			}
			if res.Report.Summary.Sites != 14 || res.Arch == "" {
				t.Errorf("report %+v, arch %q", res.Report.Summary, res.Arch)
			}
			w, done := openAny(t, out)
			defer done()
			got := allValues(t, w)
			if len(got) != len(want) {
				t.Fatalf("%d tensors, want %d", len(got), len(want))
			}
			for k, v := range want {
				if !equalF(got[k], v) {
					t.Fatalf("%s differs from the .pth conversion", k)
				}
			}
			if b, err := os.ReadFile(mod); err != nil || !strings.Contains(string(b), "class Model") {
				t.Errorf("emitted module: %v", err)
			}
			if isSafetensors(out) {
				f, err := safetensors.Open(out)
				if err != nil {
					t.Fatal(err)
				}
				defer f.Close()
				if f.Metadata["format"] != "pt" {
					t.Errorf("metadata %v", f.Metadata)
				}
				if f.DType("layer1.0.bn1.num_batches_tracked") != safetensors.I64 {
					t.Errorf("num_batches_tracked written as %s", f.DType("layer1.0.bn1.num_batches_tracked"))
				}
			}
		})
	}
	// torch loads the .pth written from safetensors (weights_only) and
	// finds the tensors the pure-Python reader finds in its input.
	if exec.Command("/usr/bin/python3", "-c", "import torch").Run() == nil {
		out := filepath.Join(dir, "plain.pth")
		if _, err := Run(Options{Input: f4("dtypes.safetensors"), Output: filepath.Join(dir, "x.safetensors"), Arch: "auto"}); err == nil {
			t.Error("a state dict of no known architecture converted")
		}
		src, err := model.Open(f4("dtypes.safetensors"))
		if err != nil {
			t.Fatal(err)
		}
		defer src.Close()
		set := outputs(false, false)
		if err := stage(src, set, out, nil); err != nil {
			t.Fatal(err)
		}
		if err := set.Commit(); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command("/usr/bin/python3", filepath.Join("..", "fixtures", "formats4.py"), "check-pth", out, f4("dtypes.safetensors"))
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%v\n%s", err, b)
		}
	}
}

// TestSafetensorsRefusals: outputs that would lose data are refused before
// anything is written.
func TestSafetensorsRefusals(t *testing.T) {
	dir := t.TempDir()
	cases := []struct {
		name, in, out, want string
	}{
		{"training checkpoint", fixture("tiny_resnet_nested"), "x.safetensors", "holds more than its state dict (epoch, arch, optimizer)"},
		{"onnx out", f4("tiny_resnet_basic.safetensors"), "x.onnx", "writing ONNX needs an ONNX input"},
		{"onnx in", f4("custom.onnx"), "x.safetensors", "an ONNX input is written as ONNX"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			out := filepath.Join(dir, c.out)
			_, err := Run(Options{Input: c.in, Output: out})
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %v, want %q", err, c.want)
			}
			if _, err := os.Stat(out); err == nil {
				t.Error("output written")
			}
		})
	}
}

// TestWholeModules: the IR built from each pickled module computes what
// torch computed with it (golden outputs), its state dict has
// model.state_dict()'s keys in order, and the conversion writes a state
// dict that reopens as a plain checkpoint.
func TestWholeModules(t *testing.T) {
	dir := t.TempDir()
	for _, name := range []string{"seq_module", "resnet_module", "densenet_module", "vgg_module"} {
		t.Run(name, func(t *testing.T) {
			gold := readGolden4(t, name)
			s, err := model.Open(f4(name + ".pth"))
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			if strings.Join(s.Weights.Keys(), " ") != strings.Join(gold.Keys, " ") {
				t.Fatalf("keys %v\nwant %v", s.Weights.Keys(), gold.Keys)
			}
			g, _, err := s.Structure(model.Options{Arch: "auto"})
			if err != nil {
				t.Fatal(err)
			}
			y := evalOutput(t, g, s.Weights, gold.InputShape, gold.Input)
			if e := relErr(y, gold.Output); e > 1e-4 {
				t.Fatalf("eval output rel %.2e against torch", e)
			}
			out := filepath.Join(dir, name+".pth")
			res, err := Run(Options{Input: f4(name + ".pth"), Output: out, EmitModule: filepath.Join(dir, name+".py"), ReLU: "abn"})
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(res.Format, "whole pickled module") {
				t.Errorf("format %q", res.Format)
			}
			ck, err := pth.Open(out)
			if err != nil {
				t.Fatalf("the output is not a plain state dict: %v", err)
			}
			defer ck.Close()
			for _, gl := range ck.Globals {
				if strings.Contains(gl, "nn.modules") || strings.Contains(gl, "torchvision") {
					t.Errorf("output references %s", gl)
				}
			}
			if len(ck.Keys()) != len(gold.Keys) {
				t.Errorf("%d keys written, want %d", len(ck.Keys()), len(gold.Keys))
			}
			// Exact under --relu abn: the converted graph over the written
			// state dict computes what torch computed with the original.
			g2, _, err := s.Structure(model.Options{Arch: "auto"})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := rewrite.Run(g2, newCopy(t, s.Weights), rewrite.Options{ReLU: "abn"}); err != nil {
				t.Fatal(err)
			}
			y = evalOutput(t, g2, ck, gold.InputShape, gold.Input)
			if e := relErr(y, gold.Output); e > 1e-4 {
				t.Fatalf("converted eval output rel %.2e against torch", e)
			}
		})
	}
	_, err := Run(Options{Input: f4("custom_module.pth"), Output: filepath.Join(dir, "c.pth")})
	if err == nil || !strings.Contains(err.Error(), "__main__.CustomNet") || !strings.Contains(err.Error(), "--graph") {
		t.Errorf("custom module: %v", err)
	}
	var re *pth.ModuleRefusedError
	if !errors.As(err, &re) {
		t.Errorf("custom module: %T, not a *pth.ModuleRefusedError", err)
	}
}

// TestGraphFile: --graph gives a custom network's structure; the IR with
// the state dict's weights computes what torch computed; the conversion
// works and emits a module; missing, extra and misshapen tensors are all
// listed; a "module." prefix on the state dict is found.
func TestGraphFile(t *testing.T) {
	gold := readGolden4(t, "custom")
	ck := open(t, f4("custom.pth"))
	defer ck.Close()
	cm, err := model.Open(f4("custom.pth"))
	if err != nil {
		t.Fatal(err)
	}
	defer cm.Close()
	g, match, err := cm.Structure(model.Options{Graph: f4("custom.onnx")})
	if err != nil {
		t.Fatal(err)
	}
	if match.Family != "graph" || g.Node("bn_d") == nil || g.Node("bn_d").Attr.Eps != 1e-3 {
		t.Fatalf("graph %s", g)
	}
	if k := g.Node("stem_bn").Params[graph.RoleNumBatches]; k != "stem_bn.num_batches_tracked" {
		t.Errorf("num_batches_tracked key %q", k)
	}
	y := evalOutput(t, g, ck, gold.InputShape, gold.Input)
	if e := relErr(y, gold.Output); e > 1e-4 {
		t.Fatalf("eval output rel %.2e against torch", e)
	}

	dir := t.TempDir()
	res, err := Run(Options{Input: f4("custom.pth"), Graph: f4("custom.onnx"), Output: filepath.Join(dir, "c.pth"), EmitModule: filepath.Join(dir, "c.py")})
	if err != nil {
		t.Fatal(err)
	}
	if res.Report.Summary.Sites != 4 || res.Report.Summary.Approximated != 0 {
		t.Errorf("summary %+v", res.Report.Summary)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "c.py")); !strings.Contains(string(b), `_place(self, "bn_a", inplace_abn.InPlaceABN(8, eps=1e-05, momentum=0.1, activation="elu", activation_param=0.5))`) {
		t.Errorf("emitted module:\n%s", b)
	}

	// Variants of the state dict, written as safetensors.
	base := map[string]bool{}
	for _, k := range ck.Keys() {
		base[k] = true
	}
	variant := func(name string, rename func(string) string, drop string, reshape string, add string) string {
		var ts []safetensors.Tensor
		for _, k := range ck.Keys() {
			if k == drop {
				continue
			}
			shape, _ := ck.Shape(k)
			v := values(t, ck, k)
			if k == reshape {
				shape = []int{len(v)}
			}
			d := safetensors.FromTorch(pth.DType(ck.DType(k)))
			ts = append(ts, safetensors.Tensor{Name: rename(k), DType: d, Shape: shape, Write: encoder(t, d, v)})
		}
		if add != "" {
			ts = append(ts, safetensors.Tensor{Name: add, DType: safetensors.F32, Shape: []int{1}, Write: encoder(t, safetensors.F32, []float64{1})})
		}
		p := filepath.Join(dir, name+".safetensors")
		if err := safetensors.WriteTensors(p, ts, nil, safetensors.WriteOptions{}); err != nil {
			t.Fatal(err)
		}
		return p
	}
	same := func(k string) string { return k }
	cases := []struct {
		name string
		path string
		want []string // substrings; none means success
	}{
		{"module prefix", variant("prefixed", func(k string) string { return "module." + k }, "", "", ""), nil},
		{"missing", variant("missing", same, "bn_b.running_var", "", ""), []string{"1 tensor(s) the graph reads are missing from the state dict: bn_b.running_var"}},
		{"extra", variant("extra", same, "", "", "head.weight"), []string{"1 tensor(s) of the state dict are not in the graph: head.weight"}},
		{"auxiliary classifier", variant("aux", same, "", "", "aux1.fc1.weight"), []string{"not in the graph: aux1.fc1.weight (auxiliary classifiers: an eval-mode export"}},
		{"shape", variant("shape", same, "", "conv_a.weight", ""), []string{"conv_a.weight [576] (graph: [8 8 3 3])"}},
		{"all three", variant("all", same, "fc.bias", "stem.weight", "x.y"), []string{"missing from the state dict: fc.bias", "not in the graph: x.y", "stem.weight [216] (graph: [8 3 3 3])"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			out := filepath.Join(dir, c.name+"_out.safetensors")
			res, err := Run(Options{Input: c.path, Graph: f4("custom.onnx"), Output: out, EmitModule: filepath.Join(dir, c.name+".py")})
			if c.want == nil {
				if err != nil {
					t.Fatal(err)
				}
				if res.Prefix != "module." || res.Report.Sites[0].Node != "module.stem_bn" {
					t.Errorf("prefix %q, first site %q", res.Prefix, res.Report.Sites[0].Node)
				}
				return
			}
			if err == nil {
				t.Fatal("accepted")
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q\nwant it to say %q", err, w)
				}
			}
		})
	}
	// An eval-mode export has no BN to convert; the reader says how to
	// re-export.
	_, err = Run(Options{Input: f4("custom.pth"), Graph: filepath.Join("..", "onnx", "testdata", "tiny_cnn_eval.onnx"), Output: filepath.Join(dir, "e.pth")})
	if err == nil || !strings.Contains(err.Error(), "PRESERVE") {
		t.Errorf("eval export: %v", err)
	}
	// Inspect honours --graph.
	ins, err := Inspect(f4("custom.pth"), Options{Graph: f4("custom.onnx")})
	if err != nil || ins.Report == nil || ins.Report.Summary.Sites != 4 {
		t.Errorf("inspect --graph: %v %+v", err, ins)
	}
}

func encoder(t *testing.T, d safetensors.DType, v []float64) func(io.Writer) error {
	return func(w io.Writer) error {
		b, err := pth.EncodeElements(d.Torch(), v)
		if err != nil {
			return err
		}
		_, err = w.Write(b)
		return err
	}
}

// TestInspectFormats: inspect reads safetensors and whole modules.
func TestInspectFormats(t *testing.T) {
	for _, c := range []struct{ path, format, arch string }{
		{f4("tiny_resnet_basic.safetensors"), "safetensors", "resnet"},
		{f4("densenet_module.pth"), "whole pickled module torchvision.models.densenet.DenseNet", "densenet"},
		{f4("seq_module.pth"), "whole pickled module torch.nn.modules.container.Sequential", "nn.Sequential"},
	} {
		ins, err := Inspect(c.path, Options{})
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(ins.Format, c.format) || !strings.Contains(ins.Arch, c.arch) || ins.Report == nil || ins.Tensors == 0 {
			t.Errorf("%s: %+v", c.path, ins)
		}
	}
}

func equalF(a, b []float64) bool {
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

// newCopy is an in-memory copy of a state dict, for rewrites that must
// not touch the source.
func newCopy(t *testing.T, w graph.Weights) *graph.MemWeights {
	m := graph.NewMemWeights()
	for _, k := range w.Keys() {
		shape, _ := w.Shape(k)
		m.Put(k, shape, values(t, w, k))
	}
	return m
}
